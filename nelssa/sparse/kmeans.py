"""Segmented spherical k-means over one layer's keys, per KV head, on the keys' own device."""

from __future__ import annotations

import logging
import os

import torch

from nelssa.config import get_config

log = logging.getLogger("vllm.nelssa")  # shown in an engine's log (vLLM configures "vllm")
_kernels_broken = False  # set when the Triton path failed once in this process (logged; torch from then on)


def kernels_for(device: torch.device) -> bool:
    """Whether k-means on ``device`` runs as kmeans_kernel's Triton kernels: on CUDA (and on the CPU under
    Triton's interpreter, ``TRITON_INTERPRET=1``: the tests) with config ``kmeans_kernel``, unless they failed
    once in this process."""
    if _kernels_broken or not (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    if not get_config().kmeans_kernel:
        return False
    try:
        import nelssa.sparse.kmeans_kernel  # noqa: F401
    except ImportError:
        return False
    return True


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``; to CUDA asynchronously from pinned memory. A pageable host->device
    copy waits for the stream, and is staged by the CUDA driver's worker thread, which can be busy
    running the long lane's host functions for tens of ms (H200, hol run 23)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def segments(length: int, segment: int) -> list[tuple[int, int]]:
    """Split [0, length) into round(length / segment) (at least 1) near-equal segments."""
    n = max(1, round(length / segment))
    bounds = [round(i * length / n) for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


def _normalize(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """Rows of x scaled to unit length (zero rows stay zero); ``inplace``: x itself, no second copy."""
    n = x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return x.div_(n) if inplace else x / n


def _update(xs1: torch.Tensor, labels: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """New unit centroids = normalised sums of members; empty clusters keep their centroid. ``xs1``: the
    unit rows [H, n, D] with a column of ones appended, so one scatter sums the members and counts them
    (a k-means iteration's launches are what a background move pays beside the engine's steps)."""
    H, n, D1 = xs1.shape
    sums = torch.zeros(H, cent.shape[1], D1, dtype=xs1.dtype, device=xs1.device)
    sums.scatter_add_(1, labels.unsqueeze(-1).expand(H, n, D1), xs1)
    return torch.where(sums[..., D1 - 1:] > 0, _normalize(sums[..., :D1 - 1]), cent)


def similarity_dtype(device: torch.device) -> torch.dtype:
    """The dtype k-means compares tokens with centroids in: bf16 on CUDA (tensor cores; fp32 logits), fp32
    elsewhere (a CPU without native bf16 emulates it several times slower). In fp32 on the H200 a 100K
    prompt's clustering took ~5 s of CUDA-core matmuls (bench_handoff); the comparisons only pick each
    token's nearest centroid, and bf16 rounding moves a token only between near-equal ones."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _logits(x: torch.Tensor, ct: torch.Tensor) -> torch.Tensor:
    """Cosine similarities [H, n, C] of unit rows x [H, n, D] with unit centroids ct [H, D, C], both in
    the similarity dtype; fp32 out."""
    if x.dtype == torch.float32:
        return torch.bmm(x, ct)
    if x.is_cuda:
        return torch.bmm(x, ct, out_dtype=torch.float32)
    return torch.bmm(x, ct).float()  # CPU: no bf16 -> fp32 kernel (tests)


def segmented_kmeans(keys: torch.Tensor, *, cluster_size: int = 16, segment: int = 8192, iters: int = 10,
                     seed: int = 0, assign_chunk: int = 8192,
                     max_logits_bytes: int = 256 << 20,
                     sim_dtype: torch.dtype | None = None, kernels: bool | None = None) -> tuple[torch.Tensor, int]:
    """Cluster keys [H, L, D] per head -> (labels [H, L] int64, number of clusters C).

    Keys are mean-centred per head and compared by cosine (spherical k-means). Each segment of
    ~``segment`` tokens gets round(len / cluster_size) clusters initialised from its own tokens
    (seeded, device independent) and ``iters - 1`` local iterations; a last assignment is global
    over all segments' centroids. Tokens are compared with the centroids in ``sim_dtype`` (default
    ``similarity_dtype``: bf16 on CUDA), the centroids updated in fp32 one segment at a time: the
    whole context is held once, in ``sim_dtype`` (a 128K-token move of 4 layers: 1 GB in bf16 on
    CUDA, where fp32 keys and their normalised copy had held 4 GB).
    ``kernels`` (default ``kernels_for``: CUDA): the iterations and the assignment as kmeans_kernel's
    Triton kernels, 3 launches per iteration and no logits in memory. Otherwise in torch: the logits
    of the last assignment in token chunks that stay under ``max_logits_bytes`` (C grows with L: at
    128K tokens, 8 heads x 4 layers and 8192-token chunks the logits were 17 GB, allocated at once
    beside the serving engine, and each chunk's fp32 matmul ~1.1 TFLOP in one kernel); deterministic
    given the seed on the CPU. A failure of the kernels is logged and the clustering redone in torch (and
    the kernels not used again in this process).
    """
    global _kernels_broken
    if kernels if kernels is not None else kernels_for(keys.device):
        try:
            return _kmeans(keys, cluster_size, segment, iters, seed, assign_chunk, max_logits_bytes, sim_dtype, True)
        except torch.OutOfMemoryError:
            raise  # the device's memory, not the kernels: the caller's to handle (the torch path needs more)
        except Exception:  # noqa: BLE001 - the torch path computes the same clustering
            if kernels:
                raise
            _kernels_broken = True
            log.exception("NELSSA k-means: the Triton kernels failed; clustering in torch from now on")
    return _kmeans(keys, cluster_size, segment, iters, seed, assign_chunk, max_logits_bytes, sim_dtype, False)


def _kmeans(keys, cluster_size, segment, iters, seed, assign_chunk, max_logits_bytes, sim_dtype, kern):
    H, L, D = keys.shape
    sd = sim_dtype or similarity_dtype(keys.device)
    x = keys.to(torch.float32, copy=True)  # fp32 keys: .float() is the caller's tensor (the KV being stored)
    x -= x.mean(dim=1, keepdim=True)
    _normalize(x, inplace=True)
    xs_all = x.to(sd)  # fp32: the same tensor
    del x
    if kern:
        from nelssa.sparse import kmeans_kernel as kk
    gen = torch.Generator().manual_seed(seed)
    cents = []
    for lo, hi in segments(L, segment):
        n = hi - lo
        c = min(n, max(1, round(n / cluster_size)))
        init = to_device(torch.randperm(n, generator=gen)[:c].sort().values, keys.device)
        seg = xs_all[:, lo:hi]
        cent = seg[:, init].float()
        if kern:
            cs = seg[:, init]  # the centroids in the similarity dtype (a copy), rewritten by each finish
            lab = torch.empty(H, n, dtype=torch.long, device=keys.device)
            sums = torch.empty(H, c, D + 1, dtype=torch.float32, device=keys.device)
            for _ in range(max(0, iters - 1)):
                sums.zero_()
                kk.assign(seg, cs, lab, sums)
                kk.finish(sums, cent, cs)
            cents.append(cent)
            continue
        if iters > 1:  # fp32 unit rows and a column of ones (_update): this segment's one copy
            xs1 = torch.cat([seg.float(), seg.new_ones(H, n, 1, dtype=torch.float32)], dim=-1)
        for _ in range(max(0, iters - 1)):
            labels = _logits(seg, cent.to(sd).transpose(1, 2)).argmax(-1)
            cent = _update(xs1, labels, cent)
        cents.append(cent)
    cent = torch.cat(cents, dim=1)
    labels = torch.empty(H, L, dtype=torch.long, device=keys.device)
    if kern:
        kk.assign(xs_all, cent.to(sd), labels)
        return labels, cent.shape[1]
    ct = cent.to(sd).transpose(1, 2)
    chunk = max(1, min(assign_chunk, max_logits_bytes // max(1, H * cent.shape[1] * 4)))
    for lo in range(0, L, chunk):
        hi = min(L, lo + chunk)
        labels[:, lo:hi] = _logits(xs_all[:, lo:hi], ct).argmax(-1)
    return labels, cent.shape[1]
