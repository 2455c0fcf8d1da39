"""Host-tier memory: the huge-page ranges that hold clustered K/V, kept for reuse (csrc/host_pool.cpp).

  1. ``host_empty(shape, dtype)``: an uninitialised CPU tensor; 2 MiB or more comes from the free ranges
     (a hit) or a new huge-page mapping (a miss); freeing the tensor gives its range back. Without the
     C++ extension: ``torch.empty``, no reuse.
  2. ``configure(reserve_bytes, threads)`` (config ``host_reserve``; the in-process host tier and
     nelssa-node call it at start): free ranges up to ``reserve_bytes`` stay mapped for the next move
     instead of being unmapped, and that much is mapped and touched now, on a background thread, so that
     a move's copy lands in memory whose page faults are paid (on the 2-vCPU Firecracker box fresh memory
     took 0.3-11 GB/s, depending on whether the hypervisor had taken the pages back; touched 17-25). A
     later call with a larger size reserves the difference; 0 (the default) keeps nothing.
  3. ``register_cuda(device)`` (an engine on CUDA, once vLLM has captured its graphs): the reservation,
     once touched, is registered with CUDA (page-locked, portable): ``clustered.to_host`` then copies a
     move's packed K/V from the device straight into it, one DMA, instead of through pinned staging
     buffers and a host-side copy (``is_pinned()`` tells them apart). A registration that fails is
     logged; the memory is used through the staging buffers.
  4. ``stats()``: bytes in use / free / reserved, hits and misses; ``wait_reserved()`` for tests and
     benchmarks that measure with the reservation complete.
  5. ``copy(dst, src, threads)``: bytes into host memory on several threads (the extension's copy_bytes;
     torch's copy without it): the host side of a staged device-to-host copy, a store slot's ingest.
  6. ``pin(t, device)`` / ``unpin(t)``: host memory that is not the tier's own (nelssa-node's store slot,
     a shared mapping the node client fills from the device) registered with CUDA for as long as its
     owner keeps it, so ``to_host`` copies into it in one DMA as into the reservation. Unlike 3 the owner
     unmaps it: ``unpin`` first (a range unmapped while registered stays locked in the driver). Never
     during vLLM's global-mode graph capture (3); the lane's captures are thread-local.
  7. ``host_empty_on(shape, dtype, node)``: as 1, its pages bound to a NUMA node before anything touches
     them (nelssa-node's devices, node/numa.py); a range of its own, unmapped when freed (host_pool.cpp,
     6). ``page_node(t)``: where a page landed.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from nelssa._ext import ext
from nelssa.config import mem_available

log = logging.getLogger("vllm.nelssa")  # shown in an engine's log (vLLM configures "vllm"), and the node's

RESERVE_CHUNK = 256 << 20  # touched and handed out in pieces of this size (host_pool.cpp, 3)

_lock = threading.Lock()
_target = 0                 # bytes asked of configure() so far (kept and reserved)
_threads: list[threading.Thread] = []
_regions: list[tuple[int, int]] = []     # (address, bytes) of each reservation, once touched
_registered: list[tuple[int, int]] = []  # those registered with CUDA (3)
_pinned: dict[int, int] = {}             # address -> bytes of other memory registered by pin() (6)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised host-tier tensor (1)."""
    mod = ext()
    return mod.host_empty(list(shape), dtype) if mod is not None else torch.empty(shape, dtype=dtype)


def host_empty_on(shape: tuple[int, ...], dtype: torch.dtype, node: int | None) -> torch.Tensor:
    """Uninitialised host-tier tensor whose pages come from NUMA node ``node`` (7); None: ``host_empty``."""
    if node is None:
        return host_empty(shape, dtype)
    mod = ext()
    if mod is None:
        raise RuntimeError(f"binding host memory to NUMA node {node} needs the C++ extension (nelssa._C)")
    return mod.host_empty_on(list(shape), dtype, node)


def page_node(t: torch.Tensor) -> int:
    """The NUMA node of the page holding ``t``'s first byte (-1: not known)."""
    mod = ext()
    return mod.host_page_node(t) if mod is not None else -1


def copy(dst: torch.Tensor, src: torch.Tensor, threads: int) -> None:
    """dst = src, bytewise, contiguous CPU tensors of equal size (5)."""
    mod = ext()
    if mod is not None:
        mod.copy_bytes(dst, src, threads)
    else:
        dst.copy_(src)


def configure(reserve_bytes: int, threads: int = 2) -> None:
    """Keep up to ``reserve_bytes`` of freed host-tier memory mapped, and reserve that much in the
    background (2; no CUDA call there). Never shrinks what an earlier call asked for. Raises ValueError
    for more than 90% of the memory available now."""
    global _target
    if reserve_bytes < 0:
        raise ValueError(f"host_reserve: {reserve_bytes} bytes")
    mod = ext()
    with _lock:
        if mod is None or reserve_bytes <= _target:
            if mod is None and reserve_bytes:
                log.warning("nelssa: host_reserve %d B ignored: no C++ extension (nelssa._C)", reserve_bytes)
            return
        more = reserve_bytes - _target
        avail = mem_available()
        if more > 0.9 * avail:  # touching it would bring the OOM killer, not an error
            raise ValueError(f"host_reserve: {more} more bytes asked, {avail} B of memory available "
                             f"(at most 90% of it can be reserved)")
        _target = reserve_bytes
        mod.host_pool_keep(reserve_bytes)
        t = threading.Thread(target=_reserve, args=(mod, more, max(1, threads)), name="nelssa-host-reserve",
                             daemon=True)
        _threads.append(t)
    t.start()


def _reserve(mod, nbytes: int, threads: int) -> None:
    t = time.perf_counter()
    log.info("nelssa: host memory: reserving %.2f GiB (%d threads)", nbytes / 2**30, threads)
    try:
        addr, got = mod.host_pool_reserve(nbytes, threads, RESERVE_CHUNK)
    except Exception as e:  # a reservation that fails leaves the tier working, on fresh mappings
        log.error("nelssa: host memory: reserving %d B failed: %s", nbytes, e)
        return
    with _lock:
        _regions.append((addr, got))
    dt = time.perf_counter() - t
    log.info("nelssa: host memory: %.2f GiB reserved in %.1f s (%.1f GB/s)", got / 2**30, dt, got / max(dt, 1e-9) / 1e9)


def register_cuda(device: torch.device | int) -> int:
    """3: page-lock every reservation made so far for the device's DMA (cudaHostRegisterPortable: every
    context sees it as pinned), after waiting for their touching -> bytes newly registered. Called by the
    engine once vLLM has captured its CUDA graphs: vLLM captures in the global mode, in which such a call
    from another thread would break the capture. Never unregistered: reserved memory lives as long as the
    process. A registration that fails is logged; that memory is used through the staging buffers."""
    wait_reserved()
    index = _index(device)
    with _lock:
        todo = [r for r in _regions if r not in _registered]
    done = 0
    for addr, nbytes in todo:
        if _cuda_register(addr, nbytes, index, "host memory"):
            with _lock:
                _registered.append((addr, nbytes))
            done += nbytes
    return done


def _index(device: torch.device | int) -> int:
    if isinstance(device, int):
        return device
    return device.index if device.index is not None else torch.cuda.current_device()


def _cuda_register(addr: int, nbytes: int, index: int, what: str) -> bool:
    """cudaHostRegister(addr, nbytes, portable) on device ``index``; a failure is logged -> False."""
    torch.cuda.set_device(index)
    t = time.perf_counter()
    err = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, 1))
    if err != 0:
        log.error("nelssa: %s: registering %.2f GiB with CUDA failed (cudaError %d): copies into it go "
                  "through the staging buffers", what, nbytes / 2**30, err)
        return False
    log.info("nelssa: %s: %.2f GiB registered with CUDA in %.2f s", what, nbytes / 2**30, time.perf_counter() - t)
    return True


def pin(t: torch.Tensor, device: torch.device) -> bool:
    """6: register the CPU memory under ``t`` (its whole storage) with CUDA for ``device`` -> whether it is
    registered now (already pinned memory: True, nothing done; a failed registration: False, logged)."""
    if t.device.type != "cpu" or device.type != "cuda":
        return False
    if t.is_pinned():
        return True
    st = t.untyped_storage()
    addr, nbytes = st.data_ptr(), st.nbytes()
    if not _cuda_register(addr, nbytes, _index(device), f"{nbytes} B of shared memory"):
        return False
    with _lock:
        _pinned[addr] = nbytes
    return True


def unpin(t: torch.Tensor) -> None:
    """6: undo ``pin(t, ...)`` (nothing when it was not pinned by it); before its memory is unmapped."""
    addr = t.untyped_storage().data_ptr()
    with _lock:
        nbytes = _pinned.pop(addr, None)
    if nbytes is not None:
        err = int(torch.cuda.cudart().cudaHostUnregister(addr))
        if err != 0:
            log.error("nelssa: unregistering %d B of shared memory from CUDA failed (cudaError %d)", nbytes, err)


def wait_reserved(timeout: float | None = None) -> bool:
    """True once every reservation started so far has finished (within ``timeout`` seconds)."""
    end = None if timeout is None else time.monotonic() + timeout
    for t in list(_threads):
        t.join(None if end is None else max(0.0, end - time.monotonic()))
        if t.is_alive():
            return False
    return True


def stats() -> dict[str, int]:
    """Host-tier memory: bytes in use, free (kept mapped), reserved, registered with CUDA; hits (served
    from free ranges) and misses (new mappings) of allocations of 2 MiB or more (4). Zeros without the
    extension."""
    mod = ext()
    used, free, reserved, hits, misses = mod.host_pool_stats() if mod is not None else (0, 0, 0, 0, 0)
    with _lock:
        registered = sum(n for _, n in _registered)
    return {"used_bytes": used, "free_bytes": free, "reserved_bytes": reserved, "registered_bytes": registered,
            "hits": hits, "misses": misses}
