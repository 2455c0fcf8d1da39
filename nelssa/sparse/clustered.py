"""Clustered KV of one layer of one request: cluster-contiguous host K/V plus device centroids."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

from nelssa._ext import ext
from nelssa.config import get_config
from nelssa.sparse import hostmem
from nelssa.sparse.hostmem import host_empty
from nelssa.sparse.kmeans import kernels_for, segmented_kmeans

log = logging.getLogger("vllm.nelssa")

KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_kv(keys: torch.Tensor, values: torch.Tensor) -> None:
    if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
        raise ValueError("keys and values must be tensors")
    if keys.dim() != 3 or values.dim() != 3:
        raise ValueError(f"keys/values must be [kv_heads, L, D], got {tuple(keys.shape)} and {tuple(values.shape)}")
    if keys.shape != values.shape:
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ in shape")
    if keys.dtype not in KV_DTYPES or values.dtype != keys.dtype:
        raise ValueError(f"keys/values dtype must be one of bf16/fp16/fp32 and equal, got {keys.dtype}/{values.dtype}")
    if keys.shape[1] == 0:
        raise ValueError("empty request: keys have 0 tokens")
    if keys.shape[0] == 0 or keys.shape[2] == 0:
        raise ValueError(f"keys have an empty head or head_dim dimension: {tuple(keys.shape)}")
    if keys.device != values.device:
        raise ValueError(f"keys on {keys.device} but values on {values.device}")


def settled(t: torch.Tensor) -> float:
    """time.perf_counter() once the current stream of ``t``'s device has done its work so far: where a
    background move's parts are timed (its thread waits for the stream at its end anyway)."""
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()
    return time.perf_counter()


def pack(keys: torch.Tensor, values: torch.Tensor, perm: torch.Tensor, out: torch.Tensor | None = None,
         wait: bool = True) -> torch.Tensor:
    """Host KV in cluster-contiguous layout: [H, L, 2, D], row i of head h = (K, V) of token perm[h, i].

    perm [H, L] lists each head's tokens grouped by cluster, so a cluster is one contiguous run of
    K/V records that the kernel reads as a single stream. CPU inputs use the C++ OpenMP row copy
    (torch fallback); device inputs are permuted on the device and copied to the host once. ``out``:
    a contiguous host tensor of that shape and dtype to write into (e.g. nelssa-node's store slot).
    ``wait=False``: device inputs into memory registered with CUDA are only enqueued on the current stream
    (``to_host``); the caller waits for the stream before reading ``out``.
    """
    H, L, D = keys.shape
    if out is None:
        out = host_empty((H, L, 2, D), keys.dtype)
    elif out.shape != (H, L, 2, D) or out.dtype != keys.dtype or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"pack: out must be a contiguous CPU {keys.dtype} tensor [{H}, {L}, 2, {D}]")
    mod = ext()
    if keys.device.type == "cpu" and mod is not None:
        perm = perm.contiguous()
        rows = torch.arange(L).expand(H, L)
        flat = out.view(H, 2 * L, D)
        mod.copy_rows(keys.contiguous(), perm, flat, (2 * rows).contiguous())
        mod.copy_rows(values.contiguous(), perm, flat, (2 * rows + 1).contiguous())
        return out
    _store(_pairs(keys, values, perm), out, wait)
    return out


STAGE_BYTES = 16 << 20  # per pinned staging buffer (two per thread that copies from a GPU; made on first use)
COPY_THREADS = 4  # host-side copy of a staged chunk (to_host)
_stage = threading.local()


def _pairs(keys: torch.Tensor, values: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``pack``'s records on the inputs' device (the torch path): [H, L, 2, D], row i of head h = (K, V) of
    token perm[h, i]."""
    idx = perm.unsqueeze(-1).expand(-1, -1, keys.shape[2])
    return torch.stack([keys.gather(1, idx), values.gather(1, idx)], dim=2)


def _store(packed: torch.Tensor, out: torch.Tensor, wait: bool) -> bool:
    """``packed`` records into the host tensor ``out``: from CUDA by ``to_host`` (-> whether the copy was
    only enqueued), else a copy."""
    if packed.device.type == "cuda":
        return to_host(packed, out, wait)
    out.copy_(packed)
    return False


def wait_stream(device: torch.device) -> None:
    """Wait for the work enqueued on ``device``'s current stream so far (copies ``to_host`` left pending)."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    ev.synchronize()


def to_host(src: torch.Tensor, out: torch.Tensor, wait: bool = True) -> bool:
    """Copy a contiguous CUDA tensor into host-tier memory (same shape and dtype).

    The host tier is huge-page memory (the kernel wants the TLB reach). Registered with CUDA (reserved
    memory, hostmem.py 3) it takes one DMA. Pageable, a device-to-pageable copy runs at a few GB/s (3.6
    GB/s measured on the H200), so the copy goes through two pinned buffers of the calling thread, chunk
    by chunk: the next chunk's DMA on the current stream overlaps the host copy of the previous one, that
    copy on ``COPY_THREADS`` threads (``hostmem.copy``; torch's copy runs on one where vLLM
    sets OMP_NUM_THREADS=1: into fresh pages 11 GB/s against 17 with two threads on the 2-vCPU box).
    Returns when ``out`` holds the data -> False; with ``wait=False`` a copy into registered memory is
    only enqueued on the current stream -> True (the caller waits for the stream before reading ``out``, and
    keeps ``src`` or lets the caching allocator order its reuse after the copy: same stream).
    """
    a = src.contiguous().view(-1).view(torch.uint8)
    b = out.view(-1).view(torch.uint8)
    if a.numel() != b.numel():
        raise ValueError(f"to_host: {a.numel()} bytes into {b.numel()}")
    if a.numel() == 0:
        return False
    stream = torch.cuda.current_stream(src.device)
    if b.is_pinned():  # a range of one registered reservation (host_pool.cpp, 3)
        b.copy_(a, non_blocking=True)
        if wait:
            wait_stream(src.device)
        return not wait
    bufs = getattr(_stage, "bufs", None)
    if bufs is None:
        bufs = _stage.bufs = [torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    step = bufs[0].numel()
    chunks = [(o, min(step, a.numel() - o)) for o in range(0, a.numel(), step)]
    done = []

    def issue(i: int) -> None:
        o, n = chunks[i]
        bufs[i % 2][:n].copy_(a[o:o + n], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(stream)
        done.append(ev)

    issue(0)
    for i, (o, n) in enumerate(chunks):
        if i + 1 < len(chunks):
            issue(i + 1)  # its buffer's previous chunk (i - 1) was copied out below already
        done[i].synchronize()
        hostmem.copy(b[o:o + n], bufs[i % 2][:n], COPY_THREADS)
    return False


@dataclass
class KVPart:
    """One clustered chunk on the host: kv [H, Lp, 2, D], each head's (K, V) records grouped by cluster."""
    kv: torch.Tensor


def unpack_parts(parts, lo: int, hi: int, length: int, H: int, D: int, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [lo, hi) of clustered parts back in token order: keys, values [H, hi - lo, D] on ``device``
    (default: the host). ``parts``: (first position, perm [H, n], kv) per part in position order, ``kv()``
    returning its packed rows [H, n, 2, D] (``pack``'s layout; called only for a part the range touches:
    nelssa-node's client fetches it from the node); ``length`` tokens in all. The inverse of the packing:
    each part's rows are scattered to their tokens by its perm where the result lives (on a GPU: the part
    copied there once, the scatter run there)."""
    if not 0 <= lo <= hi <= length:
        raise ValueError(f"unpack: [{lo}, {hi}) is not within the {length} committed tokens")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    out = torch.empty(H, hi - lo, 2, D, dtype=dtype, device=dev)
    for off, perm, get in parts:
        n = perm.shape[1]
        if off >= hi or off + n <= lo:
            continue
        kv = get().to(dev, non_blocking=True)
        if kv.shape != (H, n, 2, D) or kv.dtype != dtype:
            raise ValueError(f"unpack: a part of {n} tokens holds {tuple(kv.shape)} {kv.dtype}, "
                             f"{(H, n, 2, D)} {dtype} expected")
        pos = perm.to(dev, torch.int64, non_blocking=True) + (off - lo)   # [H, n]: each row's token in the result
        keep = (pos >= 0) & (pos < hi - lo)
        if bool(keep.all()):
            out.scatter_(1, pos[:, :, None, None].expand(H, n, 2, D), kv)
        else:  # a part across the range's edge: its rows inside it (the same count per head)
            m = int(keep[0].sum())
            sel = keep.nonzero()[:, 1].view(H, m)
            rows = kv.gather(1, sel[:, :, None, None].expand(H, m, 2, D))
            out.scatter_(1, pos.gather(1, sel)[:, :, None, None].expand(H, m, 2, D), rows)
    return out[:, :, 0], out[:, :, 1]


@dataclass
class _Pending:
    """A clustered part prepared by ``append(commit=False)``, not yet visible to readers."""
    n: int
    kv: torch.Tensor
    sizes_cpu: torch.Tensor  # [H, C] int32: the cluster table's record counts of this part
    starts: torch.Tensor     # [H, C] int64: its clusters' first records
    perm: torch.Tensor
    cent: torch.Tensor
    sizes: torch.Tensor
    vmean: torch.Tensor
    # the host cluster table (cpart, cstart, csize) once every part up to this one is committed, made by
    # the appending thread; kept on the newest prepared part only (None on the others)
    tables: tuple | None = None


def part_stats(keys: torch.Tensor, values: torch.Tensor, labels: torch.Tensor, C: int):
    """Of one clustered chunk [H, n, D] with cluster ids ``labels`` [H, n] < C: cluster sizes [H, C],
    the stable order of tokens by cluster [H, n], centroids and value means [H, C, D] (keys' dtype)."""
    H, n, D = keys.shape
    sizes = torch.zeros(H, C, dtype=torch.long, device=keys.device)
    sizes.scatter_add_(1, labels, torch.ones_like(labels))
    perm = torch.sort(labels, dim=1, stable=True).indices
    idx = labels.unsqueeze(-1).expand(H, n, D)
    count = sizes.clamp_min(1).unsqueeze(-1)
    cent = (torch.zeros(H, C, D, device=keys.device).scatter_add_(1, idx, keys.float()) / count).to(keys.dtype)
    vmean = (torch.zeros(H, C, D, device=keys.device).scatter_add_(1, idx, values.float()) / count).to(keys.dtype)
    return sizes, perm, cent, vmean


PART_STATS_BYTES = 1 << 30  # parts_stats, pack_parts: a group's stacked keys and values and their fp32 copies or
                            # gathered pairs. A move's phases run one after another, each freeing its working
                            # set before the next: cluster_layers' is bounded by the same 1 GiB. At 256 MiB a
                            # 32-layer 8K move packed in 16 + 8 groups, 822 kernels from a thread that shares
                            # the GIL with the steps (H100 run 119p: ~0.3 s for 35 ms of device work)


def parts_stats(keys: list[torch.Tensor], values: list[torch.Tensor], labels: list[tuple[torch.Tensor, int]],
                cpu: bool = False, max_bytes: int = PART_STATS_BYTES) -> list[tuple]:
    """``part_stats`` of one chunk of several layers (each [H, n, D], the same shape; ``labels`` per layer
    (ids [H, n], C) as ``cluster_layers`` gives them) in as few launches as memory allows: consecutive
    layers with the same C stacked along the head axis (every operation of ``part_stats`` is per row), in
    groups whose fp32 sums stay under ``max_bytes``. Layer by layer a move of 32 layers made ~400 tensor
    operations from its hand-off thread, which shares the GIL with the engine's step thread. -> per layer
    (sizes, perm, cent, vmean), equal to ``part_stats``'s; with ``cpu`` also (sizes, perm) on the CPU,
    copied once per group (``ClusteredKV.append``'s two copies per layer each waited for the move's
    stream: on CUDA a wait behind the steps' kernels)."""
    if not keys:
        return []
    H, n, D = keys[0].shape
    g = max(1, max_bytes // max(1, 2 * H * n * D * (4 + keys[0].element_size())))  # the stacked copies, fp32 sums
    out: list[tuple] = []
    i = 0
    while i < len(keys):
        C = labels[i][1]
        j = i + 1
        while j < len(keys) and j - i < g and labels[j][1] == C:
            j += 1
        if j - i == 1:
            st = part_stats(keys[i], values[i], *labels[i])
        else:
            st = part_stats(torch.cat(keys[i:j], 0), torch.cat(values[i:j], 0),
                            torch.cat([lab for lab, _ in labels[i:j]], 0), C)
        if cpu:
            st = (*st, st[0].cpu(), st[1].cpu())
        out.extend(zip(*(t.split(H, 0) for t in st)))
        i = j
    return out


def pack_parts(keys: list[torch.Tensor], values: list[torch.Tensor], perms: list[torch.Tensor],
               max_bytes: int = PART_STATS_BYTES) -> list[torch.Tensor]:
    """``pack`` of one chunk of several layers (each [H, n, D], the same shape; ``perms`` [H, n] each) into new
    host-tier tensors. CPU keys with the C++ extension: layer by layer (its row copy). Else the layers'
    gathers stacked in groups (``max_bytes``: the stacked keys and values and the gathered pairs), and on
    CUDA each layer's copy into host memory registered with CUDA (the reserved host tier: hostmem) only
    enqueued, the group waited for once (``pack`` waits once per layer, each a wait behind the steps'
    kernels from the hand-off's low-priority stream); a copy into pageable memory goes through
    ``to_host``'s staging, as ``pack``'s."""
    if not keys:
        return []
    if keys[0].device.type == "cpu" and ext() is not None:
        return [pack(k, v, p) for k, v, p in zip(keys, values, perms)]
    H, n, D = keys[0].shape
    g = max(1, max_bytes // max(1, 4 * H * n * D * keys[0].element_size()))
    outs: list[torch.Tensor] = []
    for i in range(0, len(keys), g):
        packed = _pairs(torch.cat(keys[i:i + g], 0), torch.cat(values[i:i + g], 0),
                        torch.cat(perms[i:i + g], 0))  # [g H, n, 2, D]
        enqueued = False
        for part in packed.split(H, 0):
            out = host_empty((H, n, 2, D), keys[0].dtype)
            enqueued |= _store(part, out, wait=False)
            outs.append(out)
        if enqueued:
            wait_stream(packed.device)
    return outs


class ClusteredKV:
    """A request's clustered KV for one layer.

    Host: ``parts`` (cluster-contiguous K/V records, see ``pack``), the cluster table (``cpart`` [C]
    part of each cluster, ``cstart``/``csize`` [H, C] its first record and record count there) and ``perm`` [H, L] (original token index of
    each stored row, parts concatenated). Device (where the keys came from): ``centroids`` [H, C, D]
    (mean of each cluster's keys, keys' dtype), ``sizes`` [H, C] int32 and ``vmeans`` [H, C, D] (mean
    of each cluster's values), for the centroid search and the estimate of unselected clusters.
    Empty clusters have size 0 and are never selected.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, *,
                 cluster_size: int, segment: int, iters: int, seed: int):
        self.num_kv_heads, self.head_dim, self.dtype, self.device = num_kv_heads, head_dim, dtype, device
        self.params = dict(cluster_size=cluster_size, segment=segment, iters=iters)
        self.seed = seed
        self.parts: list[KVPart] = []
        H = num_kv_heads
        self.centroids = torch.empty(H, 0, head_dim, dtype=dtype, device=device)
        self.sizes = torch.empty(H, 0, dtype=torch.int32, device=device)
        self.vmeans = torch.empty(H, 0, head_dim, dtype=dtype, device=device)
        self.cpart = torch.empty(0, dtype=torch.int32)
        self.cstart = torch.empty(H, 0, dtype=torch.int64)
        self.csize = torch.empty(H, 0, dtype=torch.int32)
        self._perms: list[tuple[torch.Tensor, int]] = []  # per committed part: (its perm, its first position)
        self._perm: torch.Tensor | None = None           # their concatenation, made when read
        self.length = 0
        self._pending: list[_Pending] = []
        # the appender's read of the newest table and part count, and the committer's swap of tables and
        # parts, one at a time: unlocked, an append beside a commit (a chunk's hand-off as the prompt's
        # range is committed at a switch) numbered its part from a count that held the committed part
        # twice, and that layer's table named a part that does not exist ("selection out of range of its
        # cluster table", the CPU head-of-line test, 2026-12-04)
        self._swap = threading.Lock()
        self.freed = False

    @property
    def num_clusters(self) -> int:
        return self.cpart.numel()

    @property
    def nbytes(self) -> int:
        """Host bytes held (K/V rows and tables)."""
        kv = sum(p.kv.nbytes for p in self.parts) + sum(p.kv.nbytes for p in list(self._pending))
        return kv + self.cpart.nbytes + self.cstart.nbytes + self.csize.nbytes + sum(p.nbytes for p, _ in self._perms)

    @property
    def perm(self) -> torch.Tensor:
        """[H, L] original token index of each stored row, parts concatenated (benchmarks read it; the
        attention does not, so a commit only records each part's and this is made when read)."""
        if self._perm is None:
            H = self.num_kv_heads
            self._perm = torch.cat([torch.empty(H, 0, dtype=torch.int64)] + [p + off for p, off in self._perms], 1)
        return self._perm

    @perm.setter
    def perm(self, value: torch.Tensor) -> None:
        self._perms, self._perm = [(value, 0)], None

    @property
    def device_nbytes(self) -> int:
        """Bytes held where the keys came from (centroids and sizes)."""
        return self.centroids.nbytes + self.sizes.nbytes + self.vmeans.nbytes

    def check_alive(self) -> None:
        if self.freed:
            raise ValueError("this ClusteredKV was freed")

    def append(self, keys: torch.Tensor, values: torch.Tensor, commit: bool = True,
               labels: tuple[torch.Tensor, int] | None = None, stats: tuple | None = None,
               kv: torch.Tensor | None = None) -> None:
        """Cluster a chunk of new tokens [H, n, D] on its own and append it as a new part.

        Existing clusters are untouched; new tokens get positions length .. length + n - 1. With
        ``commit=False`` the part is prepared (clustered, packed on the host, centroids on the device)
        but stays invisible to readers until ``commit_until``: a background hand-off builds it while
        attention keeps reading the committed parts. One thread appends; readers and the committer
        are another (the appender's table and part count and the committer's swap hold ``_swap``).
        ``labels`` ([H, n] cluster ids, C): clustering done by the caller (``cluster_layers`` runs it
        for many layers at once); ``stats``: their ``part_stats`` too, with or without the CPU copies of
        sizes and perm (``parts_stats``, for many layers at once); ``kv``: the chunk packed by the caller
        in the order of ``stats``'s perm (``pack_parts``).
        """
        self.check_alive()
        _check_kv(keys, values)
        H, n, D = keys.shape
        if (H, D) != (self.num_kv_heads, self.head_dim) or keys.dtype != self.dtype:
            raise ValueError(f"append: chunk is [{H}, *, {D}] {keys.dtype}, store is "
                             f"[{self.num_kv_heads}, *, {self.head_dim}] {self.dtype}")
        if stats is None:
            if labels is None:
                labels = segmented_kmeans(keys, seed=self.seed + self.num_parts, **self.params)
            stats = part_stats(keys, values, *labels)
        sizes, perm, cent, vmean = stats[:4]
        if sizes.shape[0] != H or perm.shape != (H, n):
            raise ValueError(f"append: stats of [{sizes.shape[0]}, *] sizes and {tuple(perm.shape)} perm for a "
                             f"chunk of [{H}, {n}, *]")
        sizes_cpu, perm_cpu = stats[4:] if len(stats) == 6 else (sizes.cpu(), perm.cpu())
        dev = self.device
        if kv is None:
            kv = pack(keys, values, perm)
        elif kv.shape != (H, n, 2, D) or kv.dtype != keys.dtype or kv.device.type != "cpu":
            raise ValueError(f"append: packed records {tuple(kv.shape)} {kv.dtype} on {kv.device} for a chunk of "
                             f"[{H}, {n}, {D}] {keys.dtype}")
        part = _Pending(n=n, kv=kv, sizes_cpu=sizes_cpu.to(torch.int32),
                        starts=torch.cumsum(sizes_cpu, 1) - sizes_cpu, perm=perm_cpu,
                        cent=cent.to(dev), sizes=sizes.to(device=dev, dtype=torch.int32), vmean=vmean.to(dev))
        # the table after this part, from the newest prepared part's (or the committed one: an empty list
        # read here means the committer swapped its tables in before it removed the parts)
        with self._swap:
            last = self._pending[-1] if self._pending else None
            prev = last.tables if last is not None else (self.cpart, self.cstart, self.csize)
            if prev is not None:
                cpart, cstart, csize = prev
                part.tables = (torch.cat([cpart, torch.full((part.sizes_cpu.shape[1],), self.num_parts,
                                                            dtype=torch.int32)]),
                               torch.cat([cstart, part.starts], 1), torch.cat([csize, part.sizes_cpu], 1))
            self._pending.append(part)
            if last is not None:
                last.tables = None  # only the newest keeps one (a commit up to an older part builds its own)
        if commit:
            self.commit_until(self.length + self.pending_tokens)

    @property
    def num_parts(self) -> int:
        """Parts appended so far, committed or prepared."""
        return len(self.parts) + len(self._pending)

    @property
    def pending_tokens(self) -> int:
        return sum(p.n for p in list(self._pending))

    def commit_until(self, length: int) -> None:
        """Make prepared parts visible, in order, while they fit in ``length`` tokens. Raises if they do
        not add up to exactly ``length`` (a hand-off out of step with the policy); a part that would
        overshoot stays prepared."""
        self.check_alive()
        # all the parts that fit, at once: the host table the appending thread made for them (else one
        # concatenation per table) and one concatenation per device tensor. Part by part, the tables were
        # copied once per part: a 100K prompt's 13 parts x 32 layers held the step thread ~350 ms at its
        # switch on the H200 (run 19)
        with self._swap:  # the appender reads the newest table and the part count under it (__init__)
            take, n = [], self.length
            for p in list(self._pending):
                if n + p.n > length:
                    break
                take.append(p)
                n += p.n
            if take:
                base, off = len(self.parts), self.length
                tables = take[-1].tables  # made by the appending thread, or (a commit up to an older part) here
                if tables is None:
                    tables = (torch.cat([self.cpart] + [torch.full((p.sizes_cpu.shape[1],), base + i,
                                                                   dtype=torch.int32) for i, p in enumerate(take)]),
                              torch.cat([self.cstart] + [p.starts for p in take], 1),
                              torch.cat([self.csize] + [p.sizes_cpu for p in take], 1))
                self.parts.extend(KVPart(p.kv) for p in take)  # before the tables that index them
                self.cpart, self.cstart, self.csize = tables
                for p in take:
                    self._perms.append((p.perm, off))
                    off += p.n
                self._perm = None
                self.centroids = torch.cat([self.centroids] + [p.cent for p in take], 1)
                self.sizes = torch.cat([self.sizes] + [p.sizes for p in take], 1)
                self.vmeans = torch.cat([self.vmeans] + [p.vmean for p in take], 1)
                self.length = n
                del self._pending[:len(take)]  # the appender only appends (its own thread)
        if self.length != length:
            raise ValueError(f"host KV holds {self.length} committed (+{self.pending_tokens} prepared) tokens, "
                             f"{length} expected")

    def unpack(self, lo: int = 0, hi: int | None = None, device: torch.device | str | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed tokens [lo, hi) (positions relative to this store's first token) back in token order:
        keys, values [H, hi - lo, D] on ``device`` (default: the host), by ``unpack_parts``. A recall loads
        a migrated request's device blocks from it (vllm_plugin/recall.py)."""
        self.check_alive()
        with self._swap:  # the committed parts and their perms, as one snapshot
            parts, perms, length = list(self.parts), list(self._perms), self.length
        hi = length if hi is None else hi
        return unpack_parts([(off, perm, lambda kv=part.kv: kv) for part, (perm, off) in zip(parts, perms)],
                            lo, hi, length, self.num_kv_heads, self.head_dim, self.dtype, device)

    def free(self) -> None:
        """Release host and device memory now; later use raises."""
        self.parts.clear()
        self._pending.clear()
        H = self.num_kv_heads
        self.centroids = self.centroids.new_empty(H, 0, self.head_dim)
        self.sizes = self.sizes.new_empty(H, 0)
        self.vmeans = self.vmeans.new_empty(H, 0, self.head_dim)
        self.cpart, self._perms, self._perm = self.cpart.new_empty(0), [], None
        self.cstart, self.csize = self.cstart.new_empty(H, 0), self.csize.new_empty(H, 0)
        self.length = 0
        self.freed = True

    def __repr__(self) -> str:
        return (f"ClusteredKV(heads={self.num_kv_heads}, D={self.head_dim}, L={self.length}, "
                f"C={self.num_clusters}, parts={len(self.parts)}, {self.dtype}, host={self.nbytes} B)")


def cluster_kv(keys: torch.Tensor, values: torch.Tensor, *, seed: int | None = None,
               cluster_size: int | None = None, segment: int | None = None, iters: int | None = None,
               centroid_device: torch.device | str | None = None, commit: bool = True) -> ClusteredKV:
    """Cluster one layer of one request: keys/values [kv_heads, L, D] -> ClusteredKV.

    Clustering runs on the keys' device; K/V go to the host cluster-contiguously; centroids stay on
    the keys' device unless ``centroid_device`` says otherwise. Unset parameters come from the config.
    """
    _check_kv(keys, values)
    cfg = get_config()
    ckv = ClusteredKV(keys.shape[0], keys.shape[2], keys.dtype,
                      torch.device(centroid_device) if centroid_device is not None else keys.device,
                      cluster_size=cluster_size or cfg.cluster_size, segment=segment or cfg.segment,
                      iters=iters or cfg.iters, seed=cfg.seed if seed is None else seed)
    ckv.append(keys, values, commit=commit)
    return ckv


def cluster_part(keys: list[torch.Tensor], cfg, part: int, ahead: tuple | None = None
                 ) -> tuple[list[tuple[torch.Tensor, int]], float]:
    """A request's part ``part`` (its moves' count so far) clustered as every host tier clusters it (the
    in-process tier and nelssa-node's client must agree: the same seed for the same part) -> (per layer
    (labels, C), seconds until the device finished the k-means: a move's ``kmeans`` part). ``ahead``:
    (part, labels, seconds) of this function's call for these keys made before (the hand-off's thread
    ahead, vllm_plugin/handoff.py 1), used when it was for this part; another part's is clustered again."""
    if ahead is not None:
        if ahead[0] == part:
            return ahead[1], ahead[2]
        log.info("NELSSA: a move clustered ahead as part %d is part %d of its request: clustered again", ahead[0], part)
    t = time.perf_counter()
    labels = cluster_layers(keys, seed=cfg.seed + 1000 * part, cluster_size=cfg.cluster_size,
                            segment=cfg.segment, iters=cfg.iters)
    return labels, settled(keys[0]) - t


def cluster_layers(keys: list[torch.Tensor], *, seed: int, cluster_size: int, segment: int, iters: int,
                   max_logits_bytes: int = 1 << 30, sim_dtype: torch.dtype | None = None) -> list[tuple[torch.Tensor, int]]:
    """Segmented k-means of several layers' keys ([H, n, D] each, same shape) in as few launches as
    memory allows: layers are stacked along the head axis (k-means is per head), in groups whose
    working set stays under ``max_logits_bytes``: in torch the assignment logits, with the Triton kernels
    (kmeans.kernels_for) the keys in fp32 and in the similarity dtype. -> per layer (labels [H, n], C)."""
    H, n, D = keys[0].shape
    if kernels_for(keys[0].device):
        per_layer = H * n * D * 6
    else:
        per_layer = H * min(n, segment) * max(1, round(min(n, segment) / cluster_size)) * 4
    g = max(1, min(len(keys), max_logits_bytes // max(1, per_layer)))
    out: list[tuple[torch.Tensor, int]] = []
    for i in range(0, len(keys), g):
        group = keys[i:i + g]
        labels, C = segmented_kmeans(torch.cat(group, 0), seed=seed + i, cluster_size=cluster_size, segment=segment,
                                     iters=iters, max_logits_bytes=max_logits_bytes, sim_dtype=sim_dtype)
        out.extend((lab, C) for lab in labels.split(H, 0))
    return out
