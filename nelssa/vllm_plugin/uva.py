"""The long lane's transfers between pinned host memory and the device without the copy engines (CUDA).

A captured lane batch (lane_batch.py, lane_host.py) has, per layer, transfers that wait for the host
tier: the host attention's (out, LSE) go to the device after the layer's host call, and the queries
and selected cluster ids go to the host after the layer's centroid search, which waits for the
previous layer's host result. Enqueued as ``cudaMemcpyAsync`` they sit in a copy engine's in-order
queue for most of the batch. The lane moves these bytes with kernels on its own stream instead, so
nothing of the lane waits in a copy engine. (Written for hol run 23's ~38-ms decode steps; run 24
showed the copy engines were not their cause — a pageable copy of the step was, see
runner._nelssa_lane_index — and no change in the benchmark. Kept: five fewer memcpy nodes per layer.)

  1. ``view(pinned)``: the device's view of a pinned host tensor (UVA; vLLM's
     ``get_accelerator_view_from_cpu_tensor``), or None where the platform has none. A kernel reads
     and writes the host memory through it (a few KiB per layer over PCIe).
  2. ``copy(src, dst)``: ``dst`` <- ``src`` by one Triton kernel on the current stream (same dtype, same
     shape, unit stride over the last dimension, the leading ones collapsible into rows); either side
     may be such a view. Host-written data is read by a kernel that the stream orders after the
     write (a host function's end, or the lane's synchronisation before it restages its inputs);
     kernel-written data is read on the host after an event or host node that follows the kernel.
  3. Where there is no view, the callers keep ``cudaMemcpyAsync`` (``copy_``), as before.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("vllm.nelssa")


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """CUDA with unified addressing and vLLM's view op (its _C extension)."""
    try:
        from vllm.utils.platform_utils import is_uva_available
        return bool(torch.cuda.is_available() and is_uva_available()
                    and hasattr(torch.ops._C, "get_cuda_view_from_cpu_tensor"))
    except Exception as e:  # noqa: BLE001 - no view: the memcpy path
        log.info("NELSSA: no UVA views (%s: %s); the lane copies with cudaMemcpyAsync", type(e).__name__, e)
        return False


def view(pinned: torch.Tensor) -> torch.Tensor | None:
    """The device view of a pinned host tensor (1), or None."""
    if not available() or not pinned.is_pinned():
        return None
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor
    return get_accelerator_view_from_cpu_tensor(pinned)


def _rows(t: torch.Tensor) -> torch.Tensor:
    c = t.shape[-1] if t.dim() else 1
    return t.reshape(-1, c) if t.dim() != 2 else t


# One block width for every copy, so the kernel compiles once per dtype (the lane's warm-up, lane.py):
# a width per row length compiled the lane's other widths at its first batch, in the middle of serving
# (H200 run 77: vLLM's JIT monitor flagged _copy_rows; that batch took 312 ms). Rows narrower than it
# leave lanes masked: these copies are a few KiB.
BLOCK = 1024


@functools.lru_cache(maxsize=None)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["src", "s_row", "dst", "d_row", "C"])
    def _copy_rows(src, s_row, dst, d_row, C, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < C
        tl.store(dst + r * d_row + offs, tl.load(src + r * s_row + offs, mask=m), mask=m)

    return _copy_rows


def copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst <- src by a kernel on the current stream (2)."""
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"uva.copy: {tuple(src.shape)} {src.dtype} -> {tuple(dst.shape)} {dst.dtype}")
    if src.numel() == 0:
        return
    s, d = _rows(src), _rows(dst)  # views; reshape copies a tensor whose leading dims do not collapse
    if s.stride(-1) != 1 or d.stride(-1) != 1 or s.data_ptr() != src.data_ptr() or d.data_ptr() != dst.data_ptr():
        raise ValueError("uva.copy needs unit stride over the last dimension and collapsible leading ones")
    rows, c = s.shape
    _kernel()[(rows, -(-c // BLOCK))](s, s.stride(0), d, d.stride(0), c, BLOCK=BLOCK)
