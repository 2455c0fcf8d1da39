"""Sparse attention over selected clusters -> (output, LSE); the LSE merge; a dense reference."""

from __future__ import annotations

from typing import Sequence

import torch

from nelssa._ext import ext
from nelssa.config import PREFETCH_HINTS, get_config
from nelssa.sparse.clustered import KV_DTYPES, ClusteredKV
from nelssa.sparse.search import Selection, select_clusters


def _check_queries(q: torch.Tensor, ckvs: Sequence[ClusteredKV]) -> None:
    if q.dtype not in KV_DTYPES:
        raise ValueError(f"queries dtype must be bf16/fp16/fp32, got {q.dtype}")
    if q.dim() != 3:
        raise ValueError(f"queries must be [num_heads, D] per request, got shape {tuple(q.shape[1:])}")
    if len(ckvs) != q.shape[0]:
        raise ValueError(f"{q.shape[0]} query sets for {len(ckvs)} requests")
    if not ckvs:
        raise ValueError("empty batch: no requests")
    first = ckvs[0]
    for c in ckvs:
        if not isinstance(c, ClusteredKV):
            raise ValueError(f"expected ClusteredKV, got {type(c).__name__}")
        c.check_alive()
        if c.length == 0:
            raise ValueError("empty request: ClusteredKV holds 0 tokens")
        if (c.num_kv_heads, c.head_dim, c.dtype) != (first.num_kv_heads, first.head_dim, first.dtype):
            raise ValueError("all requests of a batch must share kv_heads, head_dim and dtype")
    Hq, D = q.shape[1:]
    if D != first.head_dim:
        raise ValueError(f"queries head_dim {D} != KV head_dim {first.head_dim}")
    if Hq % first.num_kv_heads:
        raise ValueError(f"mismatched heads: {Hq} query heads is not a multiple of {first.num_kv_heads} KV heads")


def _attend_torch(q: torch.Tensor, ckv: ClusteredKV, ids: torch.Tensor, n: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference path (index_select + matmul + softmax), fp32: q [Hq, D] -> ([Hq, D], [Hq])."""
    H, D = ckv.num_kv_heads, ckv.head_dim
    G = q.shape[0] // H
    valid = torch.arange(ids.shape[1]) < n.unsqueeze(1)
    ids = torch.where(valid, ids, 0)
    ks, vs = [], []
    for p, part in enumerate(ckv.parts):
        size = (ckv.csize.gather(1, ids) * (valid & (ckv.cpart[ids] == p))).long()
        start = ckv.cstart.gather(1, ids)
        flat = size.flatten()
        total = int(flat.sum())
        head = torch.arange(H).repeat_interleave(ids.shape[1]).repeat_interleave(flat)
        within = torch.arange(total) - torch.repeat_interleave(torch.cumsum(flat, 0) - flat, flat)
        row = torch.repeat_interleave(start.flatten(), flat) + within
        per_head = size.sum(1)
        rank = torch.arange(total) - torch.repeat_interleave(torch.cumsum(per_head, 0) - per_head, per_head)
        width = int(per_head.max()) if total else 0
        k = torch.full((H, width, D), float("nan"))
        v = torch.zeros(H, width, D)
        k[head, rank] = part.kv[head, row, 0].float()
        v[head, rank] = part.kv[head, row, 1].float()
        ks.append(k), vs.append(v)
    k, v = torch.cat(ks, 1), torch.cat(vs, 1)
    pad = torch.isnan(k[..., 0])
    s = torch.einsum("hgd,hnd->hgn", q.view(H, G, D).float(), k.nan_to_num(0.0)) * scale
    s.masked_fill_(pad.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num_(0.0)
    out = torch.einsum("hgn,hnd->hgd", p, v)
    return out.reshape(H * G, D), lse.reshape(H * G)


def attend(queries: torch.Tensor, ckvs: Sequence[ClusteredKV], sel: Selection,
           scale: float | None = None, touch_only: bool = False,
           pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Host-tier attention of queries [B, Hq, D] over the selected clusters -> fp32 ([B, Hq, D], [B, Hq]).

    Uses the fused C++ kernel (GIL released) or the torch reference path (config use_cpp / no extension).
    touch_only (benchmark probe, C++ only): read the selected rows the same way, compute nothing.
    pin: results in pinned memory (CUDA builds of torch). ValueError when the queries or the results
    hold NaN/Inf (an LSE of -inf, an empty selection, is valid).
    """
    q = queries.detach()
    if q.device.type != "cpu" or not q.is_contiguous():
        q = q.to("cpu").contiguous()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    mod, cfg = ext(), get_config()
    if mod is not None:
        # No torch ops on this path (each costs microseconds per layer call): the kernel takes q in
        # fp32 or the KV dtype, checks queries and results for NaN/Inf and pins the results itself.
        # Work items: <= work_tokens rows, fewer when needed for ~16 per pool thread (sized in C++).
        return mod.sparse_attention(q, *_tables(ckvs, sel), scale, cfg.work_tokens, touch_only, cfg.prefetch_rows,
                                    PREFETCH_HINTS[cfg.prefetch], pin)
    if touch_only:
        raise RuntimeError("touch_only needs the C++ extension")
    q = q.float()
    if not torch.isfinite(q).all():
        raise ValueError("queries contain NaN or Inf")
    outs = [_attend_torch(q[b], c, sel.ids[b], sel.counts[b], scale) for b, c in enumerate(ckvs)]
    out, lse = torch.stack([o for o, _ in outs]), torch.stack([s for _, s in outs])
    if not (torch.isfinite(out).all() and not torch.isnan(lse).any()):
        raise ValueError("host attention returned non-finite values")
    return (out.pin_memory(), lse.pin_memory()) if pin else (out, lse)


def _tables(ckvs: Sequence[ClusteredKV], sel: Selection) -> tuple:
    """The C++ kernel's per-request inputs: KV parts, cluster tables, selected ids and counts."""
    return ([[p.kv for p in c.parts] for c in ckvs], [c.cpart for c in ckvs], [c.cstart for c in ckvs],
            [c.csize for c in ckvs], sel.ids, sel.counts)


def prepare_attend(queries: torch.Tensor, ckvs: Sequence[ClusteredKV], sel: Selection, scale: float,
                   out: torch.Tensor, lse: torch.Tensor, cancel=None, fault: str = ""):
    """``attend`` prepared as a C++ ``HostCall`` that writes into ``out`` [B, Hq, D] / ``lse`` [B, Hq] (fp32,
    contiguous; pinned when a CUDA stream copies them), to run later: ``call.launch(stream)`` enqueues it
    on a CUDA stream, ``call.run()`` runs it here (csrc/host_call.cpp has the contract). The queries,
    ids and counts are read when it runs, not now. None without the C++ extension. ``cancel``: a shared
    ``CancelFlag``; ``fault``: fail with this message (fault injection)."""
    mod, cfg = ext(), get_config()
    if mod is None:
        return None
    return mod.HostCall(queries, *_tables(ckvs, sel), float(scale), cfg.work_tokens, cfg.prefetch_rows,
                        PREFETCH_HINTS[cfg.prefetch], out, lse, cancel, fault)


def sparse_attention(queries, ckv, budget: float = 0.04, *, scale: float | None = None):
    """Sparse attention of decode queries over clustered KV.

    ``sparse_attention(q [Hq, D], ckv, budget)`` -> (out [Hq, D], lse [Hq]); or a batch:
    ``sparse_attention([q1, q2] or [B, Hq, D], [ckv1, ckv2], budget)`` -> (out [B, Hq, D], lse [B, Hq]).
    Centroid search runs on the centroids' device, attention on the host; outputs are fp32 on the
    host. ``lse`` is the natural-log log-sum-exp of the scaled scores (scale 1/sqrt(D) by default)
    over the selected tokens; ``budget`` is the fraction of each request's tokens attended (1.0 = all,
    exact).
    """
    single = isinstance(ckv, ClusteredKV)
    ckvs = [ckv] if single else list(ckv)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise ValueError(f"budget must be in (0, 1], got {budget!r}")
    if single:
        if not isinstance(queries, torch.Tensor) or queries.dim() != 2:
            raise ValueError("queries for one request must be a [num_heads, D] tensor")
        q = queries.unsqueeze(0)
    elif isinstance(queries, torch.Tensor):
        q = queries
    else:
        qs = list(queries)
        if not qs or any(not isinstance(x, torch.Tensor) or x.dim() != 2 for x in qs):
            raise ValueError("queries of a batch must be [num_heads, D] tensors (or one [B, num_heads, D])")
        if len({(x.shape, x.dtype) for x in qs}) != 1:
            raise ValueError("all requests' queries must share shape and dtype")
        q = torch.stack(qs)
    _check_queries(q, ckvs)
    sel = select_clusters(q, ckvs, float(budget), scale)
    out, lse = attend(q, ckvs, sel, scale)
    return (out[0], lse[0]) if single else (out, lse)


def merge_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint token sets by LSE, in fp32.

    out [..., H, D], lse [..., H] (natural log; -inf = no tokens) -> merged (out, lse); both sides
    empty -> (0, -inf). Eight device ops (it runs twice per layer on the decode step's path).
    """
    la, lb = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(la, lb)
    ls = lse.unsqueeze(-1)
    wa = torch.exp(la.unsqueeze(-1) - ls)  # NaN only where both sides are empty (-inf - -inf)
    wb = torch.exp(lb.unsqueeze(-1) - ls)
    out = torch.addcmul(out_b.float() * wb, out_a.float(), wa).nan_to_num_(0.0)
    return out, lse


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention (float64) of q [Hq, D] over keys/values [H, L, D] -> (out [Hq, D], lse [Hq])."""
    H, L, D = keys.shape
    G = q.shape[0] // H
    scale = D ** -0.5 if scale is None else scale
    s = torch.einsum("hgd,hld->hgl", q.double().view(H, G, D), keys.double()) * scale
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("hgl,hld->hgd", torch.exp(s - lse.unsqueeze(-1)), values.double())
    return out.reshape(H * G, D), lse.reshape(H * G)
