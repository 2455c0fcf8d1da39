"""Centroid search: pick each request's top clusters per KV head within a token budget."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from nelssa.config import get_config
from nelssa.sparse.clustered import ClusteredKV
from nelssa.sparse.kmeans import to_device


@dataclass
class Selection:
    """Per request: cluster ids [H, S] int64 (ascending, the first ``counts[h]`` valid) on the host.

    ``estimate`` (when asked for): fp32 (out [B, Hq, D], lse [B, Hq]) on the centroids' device,
    attention over the *unselected* clusters approximated by their centroids: each such cluster
    counts as size x exp(q . centroid) with its mean value (RetroInfer's estimation zone); lse is
    -inf where every cluster is selected; a function returning it where select_clusters was asked to
    defer it (``defer_estimate``)."""
    ids: list[torch.Tensor]
    counts: list[torch.Tensor]
    estimate: Any = None  # (out, lse), a function returning them (deferred), or None
    ready: Any = None  # CUDA event: ids/counts (pinned host memory) are valid once it has completed

    def tokens(self, ckvs: list[ClusteredKV]) -> list[torch.Tensor]:
        """Selected tokens per (request, head), for reporting."""
        out = []
        for ids, n, c in zip(self.ids, self.counts, ckvs):
            valid = torch.arange(ids.shape[1]) < n.unsqueeze(1)
            out.append((c.csize.gather(1, ids.clamp_max(max(c.num_clusters - 1, 0))) * valid).sum(1))
        return out


def budget_tokens(budget: float, length: int) -> int:
    """Tokens a request of ``length`` may attend at ``budget`` (1.0 = all)."""
    return min(length, max(1, math.ceil(budget * length - 1e-9)))


def host_budget_targets(ckvs: list[ClusteredKV], budget: float) -> torch.Tensor:
    """Tokens each request may attend at ``budget``, [B] int64 on the host."""
    return torch.tensor([budget_tokens(budget, c.length) for c in ckvs], dtype=torch.int64)


def budget_targets(ckvs: list[ClusteredKV], budget: float) -> torch.Tensor:
    """``host_budget_targets`` on the centroids' device (on CUDA by a pinned asynchronous copy: no wait
    for the stream). The same for every layer of a decode step."""
    return to_device(host_budget_targets(ckvs, budget), ckvs[0].centroids.device)


_RING = 4  # pinned output buffers per shape: a selection's ids are read by the host before the 2nd next call
_pinned: dict[tuple, list] = {}


def _pinned_buffer(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """One of a ring of reusable pinned buffers (allocating pinned memory per call costs launches)."""
    key = (shape, dtype)
    ring = _pinned.get(key)
    if ring is None:
        if len(_pinned) > 32:  # shapes change as requests come and go: keep the recent ones
            _pinned.clear()
        ring = _pinned[key] = [0, [torch.empty(shape, dtype=dtype, pin_memory=True) for _ in range(_RING)]]
    ring[0] = (ring[0] + 1) % _RING
    return ring[1][ring[0]]


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [H, M, K] @ b [H, K, N] -> fp32. On CUDA with 16-bit b: a cast to b's dtype, fp32 accumulation
    and output (cuBLAS tensor cores; the H200 profile: fp32 copies of the centroids cost more than the
    products); elsewhere in fp32."""
    if b.is_cuda and b.dtype in (torch.bfloat16, torch.float16):
        return torch.bmm(a.to(b.dtype), b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def _use_kernel(dev: torch.device) -> bool:
    return dev.type == "cuda" and get_config().select_kernel


def select_clusters(queries: torch.Tensor, ckvs: list[ClusteredKV], budget: float,
                    scale: float | None = None, estimate: bool = False, no_sync: bool = False,
                    target: torch.Tensor | None = None, device_out: bool = False,
                    kernel: bool | None = None, defer_estimate: bool = False) -> Selection:
    """Rank clusters by the query heads' softmax probability mass and fill the budget.

    queries [B, Hq, D] (on the centroids' device). Per request and KV head: scores of its centroids
    against each query head of the GQA group (scaled dot products), softmax over clusters, summed
    over the group; clusters in descending order (ties: ascending id) until ``budget`` of the
    request's tokens is covered (the last cluster may overshoot). Empty clusters are never selected.
    Batched over requests.

    ``no_sync`` (CUDA centroids): the ids go to pinned host memory by an asynchronous copy sized by the
    budget's upper bound (a selected cluster holds >= 1 token), so the caller never waits for the
    device; ``ready`` is the event after which they are valid. The pinned buffers are reused after
    a few calls: a caller consumes a selection (the host attention that reads it) before selecting
    twice more, as the decode step does layer by layer.
    ``target``: ``budget_targets(ckvs, budget)`` when the caller already has it (once per step).
    ``device_out``: no copy at all; ``ids`` [B, H, cmax] and ``counts`` [B, H] stay on the device as
    two tensors (for a caller that copies them itself, e.g. inside a captured CUDA graph).
    ``kernel``: the Triton kernels of ``select_kernel.py`` (same result; default on CUDA, config
    ``select_kernel``) instead of torch operations.
    ``defer_estimate`` (with ``device_out`` and ``estimate``): ``estimate`` is a function that enqueues the
    estimate's last kernels and returns it (the kernels' path; the torch path's is computed here), for a
    caller that sends the ids to the host tier first and computes the estimate during its call.
    """
    B, Hq, D = queries.shape
    H = ckvs[0].num_kv_heads
    scale = D ** -0.5 if scale is None else scale
    dev = ckvs[0].centroids.device
    cmax = max(c.num_clusters for c in ckvs)
    q = queries.to(device=dev).view(B, H, Hq // H, D)
    target = budget_targets(ckvs, budget) if target is None else target
    defer = defer_estimate and device_out and estimate
    if _use_kernel(dev) if kernel is None else kernel:
        from nelssa.sparse import select_kernel  # Triton: imported where it runs
        ids, counts, est = select_kernel.search(q, ckvs, target, scale, estimate, defer=defer)
    else:
        ids, counts, est = _search_torch(q, ckvs, target, scale, estimate)
        if defer:
            est = (lambda e: lambda: e)(est)
    if device_out:
        return Selection(ids, counts, est)
    if no_sync and dev.type == "cuda":
        bound = max(1, min(cmax, max(budget_tokens(budget, c.length) for c in ckvs)))
        ids_h = _pinned_buffer((B, H, bound), ids.dtype)
        cnt_h = _pinned_buffer(tuple(counts.shape), counts.dtype)
        ids_h.copy_(ids[..., :bound], non_blocking=True)
        cnt_h.copy_(counts, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return Selection([ids_h[b] for b in range(B)], [cnt_h[b] for b in range(B)], est, ready=ev)
    smax = int(counts.max())
    ids, counts = ids[..., :smax].cpu(), counts.cpu()
    return Selection([ids[b, :, :smax].contiguous() for b in range(B)], [counts[b] for b in range(B)], est)


def _search_torch(q: torch.Tensor, ckvs: list[ClusteredKV], target: torch.Tensor, scale: float,
                  estimate: bool):
    """select_clusters' search in torch operations: q [B, H, G, D] -> (ids [B, H, cmax] ascending, then
    cmax; counts [B, H]; estimate or None)."""
    B, H, G, D = q.shape
    dev = q.device
    cmax = max(c.num_clusters for c in ckvs)
    if B == 1:
        sizes = ckvs[0].sizes.unsqueeze(0)
        logits = _bmm(q[0], ckvs[0].centroids.transpose(1, 2)).mul_(scale).unsqueeze(0)
    else:  # per request (no padded copies of the centroids), into padded logits
        sizes = torch.zeros(B, H, cmax, dtype=torch.int32, device=dev)
        logits = torch.empty(B, H, G, cmax, dtype=torch.float32, device=dev)
        for b, c in enumerate(ckvs):
            sizes[b, :, :c.num_clusters] = c.sizes
            torch.mul(_bmm(q[b], c.centroids.transpose(1, 2)), scale, out=logits[b, :, :, :c.num_clusters])
    empty = sizes == 0
    logits.masked_fill_(empty.unsqueeze(2), float("-inf"))
    mass = torch.softmax(logits, dim=-1).sum(2)
    mass.masked_fill_(empty, -1.0)
    order = torch.sort(mass, dim=-1, descending=True, stable=True).indices  # ties: ascending id
    ssz = sizes.gather(-1, order).long()
    before = torch.cumsum(ssz, -1) - ssz
    keep = (before < target.view(B, 1, 1)) & (ssz > 0)
    counts = keep.sum(-1)
    ids = torch.where(keep, order, torch.full_like(order, cmax)).sort(-1).values
    if not estimate:
        return ids, counts, None
    rest = torch.zeros_like(keep).scatter_(-1, order, keep) | empty  # selected or empty: not estimated
    lg = (logits + sizes.clamp_min(1).float().log().unsqueeze(2)).masked_fill(rest.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(lg, -1)                                   # [B, H, G]
    w = torch.softmax(lg, -1).nan_to_num_(0.0)  # rows with every cluster selected: all -inf -> 0
    if B == 1:
        out = _bmm(w[0], ckvs[0].vmeans).unsqueeze(0)
    else:
        out = torch.empty(B, H, G, D, dtype=torch.float32, device=dev)
        for b, c in enumerate(ckvs):
            out[b] = _bmm(w[b, :, :, :c.num_clusters], c.vmeans)
    return ids, counts, (out.reshape(B, H * G, D), lse.reshape(B, H * G))
