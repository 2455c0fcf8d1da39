"""Split-batch attention: offloaded decode rows go window (device) + sparse (host tier), merged by LSE.

Each step the model runner publishes a StepPlan (which batch rows are offloaded, their host range
and window). The wrapped backend impl, per layer:
  1. ranks the offloaded rows' clusters against their queries on the device and submits the host
     attention over the selected clusters (one batched submission for all long requests);
  2. runs the stock kernel for the whole batch with the offloaded rows shrunk to a single live
     token (so it never reads freed blocks and does no work proportional to their length);
  3. computes window attention with LSE over [0, sink) + [H, seq_len) of each offloaded row,
     read through its block table (and, with ``estimate``, the centroid estimate of the clusters
     not selected);
  4. waits for the host result and merges them by LSE into the rows' output.
A host-tier failure marks the request failed (its output rows are zeroed and the scheduler finishes
it with an error); it never falls back to a partial answer.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nelssa.config import NelssaConfig
from nelssa.sparse import merge_states, select_clusters
from nelssa.sparse.search import budget_targets

_local = threading.local()


@dataclass
class StepPlan:
    """Offloaded rows of one step (the same for every layer)."""
    host: Any                       # nelssa.node.LocalHostTier
    req_ids: list[str]              # offloaded requests, in batch-row order
    rows: list[int]                 # their batch rows
    token_idx: torch.Tensor         # index of each row's (single) query token in the flat batch
    host_end: list[int]             # H: the host holds [sink, H)
    seq_lens: list[int]             # tokens with KV after this step's write
    failed: dict[str, str] = field(default_factory=dict)
    cache: dict = field(default_factory=dict)  # per-step derived tensors, keyed by purpose
    split: dict = field(default_factory=dict)  # seconds of the forward's thread per part (SPLIT_PARTS)
    graphs: Any = None              # CUDA: the engine's select_graph.SelectGraphs (config ``graphs``)
    lane_rows: list[int] = field(default_factory=list)  # batch rows whose hidden state the lane computed
    lane_tokens: list[int] = field(default_factory=list)  # their token indices in the flat batch

    def fail(self, req_id: str, msg: str) -> None:
        self.failed.setdefault(req_id, msg)

    def lap(self, part: str, t0: float) -> float:
        """Add the time since ``t0`` to ``part``; returns now."""
        t = time.perf_counter()
        self.split[part] = self.split.get(part, 0.0) + t - t0
        return t


# Parts of a step's forward thread time in the split-batch layers (the rest, "other", is everything
# else the forward does: the model's own layers, launches, graph replays), reported per step.
SPLIT_PARTS = ("select", "stock", "window", "wait", "merge")


def set_plan(plan: StepPlan | None) -> None:
    _local.plan = plan


def current_plan() -> StepPlan | None:
    return getattr(_local, "plan", None)


# ---------------------------------------------------------------- paged KV access (per backend)

def _kv_at(kv_cache: torch.Tensor, layout: str, blocks: torch.Tensor, offs: torch.Tensor, head_dim: int):
    """Where K and V of (blocks, offs) are in one layer's paged cache, in the layout ``wrap_impl`` named:
    (K's tensor, its index, V's tensor, its index, heads_last). ``tensor[index]`` reads them (``read_kv``)
    and assigning to it writes them (``write_kv``); heads_last: indexed they are [..., D, KH], not [..., KH, D].

    The cache's logical shape is [NB, KH, bs, 2D] in all three; per (block, head) the CPU layouts store
    K in the first bs*D elements and V in the next:
    cpu_vec (vLLM's vec / vec16 CPU ISAs): K as [D, bs], V as [bs, D];
    cpu_amx (bf16 with a block size multiple of 32 on AMX CPUs): tiles in VNNI pairs, K as
      [bs/16, D/2, 16 tokens, 2 dims] and V as [D/16, bs/2, 16 dims, 2 tokens];
    flash: as FlashAttention reads it (transpose(1, 2).split(D)).
    """
    every = slice(None)
    if layout in ("cpu_vec", "cpu_amx"):
        nb, kh, bs, _ = kv_cache.shape
        flat = kv_cache.view(nb, kh, 2, bs * head_dim)
        if layout == "cpu_vec":
            return (flat[:, :, 0].unflatten(-1, (head_dim, bs)), (blocks, every, every, offs),
                    flat[:, :, 1].unflatten(-1, (bs, head_dim)), (blocks, every, offs, every), False)
        t, j = offs.unsqueeze(-1), torch.arange(head_dim, device=offs.device)  # [..., 1], [D]
        koff = (t // 16) * (head_dim * 16) + (j // 2) * 32 + (t % 16) * 2 + j % 2
        voff = (j // 16) * (bs * 16) + (t // 2) * 32 + (j % 16) * 2 + t % 2
        b = blocks.unsqueeze(-1)
        # advanced indices around a slice: the heads' dimension comes last -> [..., D, KH]
        return flat[:, :, 0], (b, every, koff), flat[:, :, 1], (b, every, voff), True
    if layout == "flash":
        kc, vc = kv_cache.transpose(1, 2).split(head_dim, dim=-1)
        return kc, (blocks, offs), vc, (blocks, offs), False
    raise ValueError(f"unsupported KV cache layout {layout!r}")


def read_kv(kv_cache: torch.Tensor, layout: str, blocks: torch.Tensor, offs: torch.Tensor,
            num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V [..., KH, D] at (blocks, offs) of one layer's paged cache (layouts: ``_kv_at``)."""
    kc, ki, vc, vi, heads_last = _kv_at(kv_cache, layout, blocks, offs, head_dim)
    if heads_last:
        return kc[ki].transpose(-1, -2), vc[vi].transpose(-1, -2)
    return kc[ki], vc[vi]


def write_kv(kv_cache: torch.Tensor, layout: str, blocks: torch.Tensor, offs: torch.Tensor,
             keys: torch.Tensor, values: torch.Tensor) -> None:
    """The inverse of ``read_kv``: K/V [n, KH, D] written at (blocks, offs) [n] of one layer's paged cache."""
    kc, ki, vc, vi, heads_last = _kv_at(kv_cache, layout, blocks, offs, keys.shape[-1])
    kc[ki] = keys.transpose(-1, -2) if heads_last else keys
    vc[vi] = values.transpose(-1, -2) if heads_last else values


def window_index(plan: StepPlan, block_table: torch.Tensor, sink: int, bs: int):
    """(blocks, offsets, valid) [n, W] of each offloaded row's window positions [0, sink) + [H, seq_len)."""
    key = ("win", id(block_table))
    if key not in plan.cache:
        pos = []
        for h, s in zip(plan.host_end, plan.seq_lens):
            pos.append(torch.cat([torch.arange(0, min(sink, h)), torch.arange(h, s)]))
        w = max(len(p) for p in pos)
        n = len(pos)
        p = torch.zeros(n, w, dtype=torch.long)
        valid = torch.zeros(n, w, dtype=torch.bool)
        for i, x in enumerate(pos):
            p[i, :len(x)] = x
            valid[i, :len(x)] = True
        rows = torch.tensor(plan.rows, dtype=torch.long, device=block_table.device)
        dev = block_table.device
        p = p.to(dev)
        blocks = block_table[rows].long().gather(1, p // bs)
        plan.cache[key] = (blocks, p % bs, valid.to(dev))
    return plan.cache[key]


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, Hq, D]; k/v [n, W, KH, D]; valid [n, W] -> fp32 (out [n, Hq, D], lse [n, Hq])."""
    n, hq, d = q.shape
    kh = k.shape[2]
    s = torch.einsum("nhgd,nwhd->nhgw", q.float().view(n, kh, hq // kh, d), k.float()) * scale
    s.masked_fill_(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("nhgw,nwhd->nhgd", torch.exp(s - lse.unsqueeze(-1)), v.float())
    return out.reshape(n, hq, d), lse.reshape(n, hq)


def flash_window_parts(impl, q: torch.Tensor, kv_cache: torch.Tensor, plan: StepPlan, md: Any, sink: int,
                       bs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Window attention on CUDA with FlashAttention's LSE as partial states -> [(out [n, Hq, D] in q's
    dtype, lse [n, Hq] fp32 (a transposed view))]. One paged call over the sink blocks followed by the
    recent blocks (from H, block aligned) when the sink is whole blocks that every row keeps (the usual
    case: attention of one query does not depend on the order of its keys); else a call each."""
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
    dev, n = q.device, q.shape[0]
    key = ("fa",)  # one KV-cache group (asserted by the scheduler): every layer's batch is the same
    if key not in plan.cache:
        rows = torch.tensor(plan.rows, dtype=torch.long, device=dev)
        bt = md.block_table.index_select(0, rows)
        hb = torch.tensor([h // bs for h in plan.host_end], device=dev)
        rlen = [s - h for s, h in zip(plan.seq_lens, plan.host_end)]
        nrb = -(-max(rlen) // bs)
        ridx = (hb[:, None] + torch.arange(nrb, device=dev)[None]).clamp_max(bt.shape[1] - 1)
        rec_bt = bt.gather(1, ridx)
        c = dict(cu=torch.arange(n + 1, dtype=torch.int32, device=dev))
        if sink % bs == 0 and all(h >= sink for h in plan.host_end):  # one call: sink blocks + recent
            sb = sink // bs
            c["calls"] = [(torch.cat([bt[:, :sb], rec_bt], 1).contiguous(),
                           torch.tensor([sink + r for r in rlen], dtype=torch.int32, device=dev), sink + max(rlen))]
        else:
            c["calls"] = [(rec_bt.contiguous(), torch.tensor(rlen, dtype=torch.int32, device=dev), max(rlen))]
            if sink:
                c["calls"].append((bt[:, :max(1, -(-sink // bs))].contiguous(),
                                   torch.tensor([min(sink, h) for h in plan.host_end], dtype=torch.int32,
                                                device=dev), sink))
        plan.cache[key] = c
    c = plan.cache[key]
    kc, vc = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    common = dict(q=q, k=kc, v=vc, max_seqlen_q=1, cu_seqlens_q=c["cu"], softmax_scale=impl.scale, causal=False,
                  return_softmax_lse=True, fa_version=impl.vllm_flash_attn_version)
    parts = []
    for bt, lens, mx in c["calls"]:
        o, lse = flash_attn_varlen_func(**common, max_seqlen_k=mx, seqused_k=lens, block_table=bt)
        parts.append((o, lse.t()))
    return parts


def flash_window(impl, q: torch.Tensor, kv_cache: torch.Tensor, plan: StepPlan, md: Any, sink: int,
                 bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The window parts merged by vLLM's merge_attn_states -> fp32 (out, lse [n, Hq])."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states
    parts = flash_window_parts(impl, q, kv_cache, plan, md, sink, bs)
    if len(parts) == 1:
        return parts[0][0].float(), parts[0][1].float()
    (o2, l2), (o1, l1) = parts
    out = torch.empty_like(o1)
    lse = torch.empty(l1.shape[::-1], dtype=torch.float32, device=o1.device)
    merge_attn_states(out, o1, l1.t().contiguous(), o2, l2.t().contiguous(), output_lse=lse)
    return out.float(), lse.t()


# ---------------------------------------------------------------- stock kernel with shrunk rows

def shrunk_metadata(plan: StepPlan, md: Any, impl: Any, backend: str) -> Any:
    """A copy of the step's attention metadata where each offloaded row attends only to its last token
    (a live block): the stock kernel then neither reads freed blocks nor spends O(L) on those rows."""
    key = ("md",)  # built once per step, not per layer (layers may get their own metadata objects)
    if key in plan.cache:
        return plan.cache[key]
    m = copy.copy(md)
    rows = torch.tensor(plan.rows, dtype=torch.long, device=md.seq_lens.device)  # lane rows: shrunk already
    seq = md.seq_lens.clone()
    bt = md.block_table.clone()
    bs = plan.cache["block_size"]
    last_blk = bt[rows].gather(1, ((seq[rows].long() - 1) // bs).unsqueeze(1)).squeeze(1)
    bt[rows, 0] = last_blk
    seq[rows] = 1
    m.seq_lens, m.block_table = seq, bt
    if backend == "cpu":
        from vllm import _custom_ops as ops
        from vllm import envs
        m.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq.shape[0], num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
            head_dim=impl.head_size, seq_lens=seq, dtype=plan.cache["dtype"], query_start_loc=md.query_start_loc,
            causal=md.causal, sliding_window_size=impl.sliding_window, isa=impl.isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=md.dynamic_causal)
    elif backend == "flash":
        m.max_seq_len = md.max_seq_len  # an upper bound is valid; int(seq.max()) would sync the device
        if getattr(m, "scheduler_metadata", None) is not None:
            m.scheduler_metadata = None  # FA3 AOT schedule was planned for the old lengths
    plan.cache[key] = m
    return m


# ---------------------------------------------------------------- the wrapped impl

def _token_index(plan: StepPlan, device: torch.device) -> torch.Tensor:
    """The offloaded rows' query-token indices on the device, copied once per step."""
    tok = plan.cache.get("tok")
    if tok is None:
        tok = plan.cache["tok"] = plan.token_idx.to(device)
    return tok


def _forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
             output_block_scale=None):
    plan = current_plan()
    base = super(type(self), self).forward
    if plan is None or not plan.rows or attn_metadata is None:  # lane rows: shrunk in the step's inputs
        return base(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)

    def stock():  # offloaded rows shrunk to one live token
        base(layer, query, key, value, kv_cache, shrunk_metadata(plan, attn_metadata, self, self.nelssa_backend),
             output, output_scale, output_block_scale)
    q = query.view(-1, self.num_heads, self.head_size)
    split_attention(self, layer, q, kv_cache, attn_metadata, output.view(-1, self.num_heads, self.head_size), plan,
                    stock)
    return output


def split_attention(self, layer, q: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any, o: torch.Tensor,
                    plan: StepPlan, stock=None) -> None:
    """Steps 1-4 for the plan's offloaded rows: q / o [T, Hq, D] (rows at ``plan.token_idx``);
    ``attn_metadata.block_table`` rows at ``plan.rows``; ``stock`` (step 2) runs the stock kernel for the
    whole batch (None in the lane, whose rows are all offloaded)."""
    if plan.graphs is not None and self.nelssa_backend == "flash" and not plan.failed:
        return _forward_cuda(self, layer, q, kv_cache, attn_metadata, o, plan, stock)
    t = time.perf_counter()
    cfg: NelssaConfig = self.nelssa_cfg
    li = layer.nelssa_layer
    backend = self.nelssa_backend
    tok = _token_index(plan, q.device)
    q_off = q.index_select(0, tok)
    host, live = plan.host, [r not in plan.failed for r in plan.req_ids]

    # 1. centroid search on the device, host attention submitted before the device work
    fut = None
    sel_rows = [i for i, ok in enumerate(live) if ok]
    if sel_rows:
        try:
            ckvs = [host.layer_kv(plan.req_ids[i], li) for i in sel_rows]
            qs = q_off[sel_rows] if len(sel_rows) < len(live) else q_off
            tk = ("target", tuple(sel_rows))  # every layer of the step has the same requests and lengths
            if tk not in plan.cache:
                plan.cache[tk] = budget_targets(ckvs, cfg.budget)
            sel = select_clusters(qs, ckvs, cfg.budget, self.scale, estimate=cfg.estimate, no_sync=True,
                                  target=plan.cache[tk])
            fut = host.submit_attend(qs, ckvs, sel, self.scale, li)
        except Exception as e:  # noqa: BLE001 - any host-tier failure fails these requests, loudly
            for i in sel_rows:
                plan.fail(plan.req_ids[i], f"host tier (layer {li}): {type(e).__name__}: {e}")
            sel_rows = []
    t = plan.lap("select", t)

    # 2. stock kernel for every row, offloaded rows shrunk to one live token
    if stock is not None:
        stock()
        t = plan.lap("stock", t)

    # 3. window attention of the offloaded rows
    bs = plan.cache["block_size"]
    if backend == "flash":
        w_out, w_lse = flash_window(self, q_off, kv_cache, plan, attn_metadata, cfg.sink, bs)
    else:
        blocks, offs, valid = window_index(plan, attn_metadata.block_table, cfg.sink, bs)
        k, v = read_kv(kv_cache, self.nelssa_kv_layout, blocks, offs, self.num_kv_heads, self.head_size)
        w_out, w_lse = window_attention(q_off, k, v, valid, self.scale)
    t = plan.lap("window", t)

    # 4. merge with the host result (rows of failed requests get zeros: they finish with an error)
    out = None
    if fut is not None:
        try:
            whole = len(sel_rows) == len(live)  # the common case: no indexing
            if whole:
                m, m_lse = w_out, w_lse
            else:
                idx = plan.cache.get(("sel", tuple(sel_rows)))
                if idx is None:
                    idx = plan.cache[("sel", tuple(sel_rows))] = torch.tensor(sel_rows, device=w_out.device)
                m, m_lse = w_out[idx], w_lse[idx]
            if sel.estimate is not None:  # the unselected clusters, estimated on the device
                m, m_lse = merge_states(m, m_lse, *sel.estimate)
            t = plan.lap("merge", t)
            h_out, h_lse = host.wait(fut, li)
            t = plan.lap("wait", t)
            m, _ = merge_states(m, m_lse, h_out.to(w_out.device, non_blocking=True),
                                h_lse.to(w_out.device, non_blocking=True))
            if whole:
                out = m
            else:
                out = torch.zeros_like(w_out)
                out[idx] = m
        except Exception as e:  # noqa: BLE001
            out = None
            for i in sel_rows:
                plan.fail(plan.req_ids[i], f"host tier (layer {li}): {type(e).__name__}: {e}")
    if out is None:
        out = torch.zeros_like(w_out)
    o.index_copy_(0, tok, out.to(o.dtype))
    plan.lap("merge", t)


def layer_search(plan: StepPlan, li: int, q: torch.Tensor, tok: torch.Tensor, cfg: NelssaConfig, scale: float):
    """CUDA step 1 for layer ``li``: the plan's requests' clustered KV of the layer and the centroid search
    of their queries ``q[tok]`` (select_graph.py; the budget targets computed once per plan) -> (ckvs,
    selection, the queries the host tier reads, the device rows ``q[tok]``)."""
    ckvs = [plan.host.layer_kv(r, li) for r in plan.req_ids]
    target = plan.cache.get("target")
    if target is None:
        target = plan.cache["target"] = budget_targets(ckvs, cfg.budget)
    sel, q_host, q_off = plan.graphs.select(li, q, tok, ckvs, cfg.budget, scale, cfg.estimate, target, plan)
    return ckvs, sel, q_host, q_off


def _forward_cuda(self, layer, q, kv_cache, attn_metadata, o, plan: StepPlan, stock):
    """The same four steps on CUDA in ~12 launches: the centroid search replayed as a captured graph
    (select_graph), the host queries copied inside it; the window as partial states; one kernel merges
    window, estimate and host result into the output rows (merge_kernel). Every row is live."""
    from nelssa.vllm_plugin.merge_kernel import merge_into
    t = time.perf_counter()
    cfg: NelssaConfig = self.nelssa_cfg
    li, host = layer.nelssa_layer, plan.host
    tok = _token_index(plan, q.device)
    # 1. centroid search (graph replay) and host attention submitted
    fut = sel = None
    q_off = None
    try:
        ckvs, sel, q_host, q_off = layer_search(plan, li, q, tok, cfg, self.scale)
        fut = host.submit_attend(q_host, ckvs, sel, self.scale, li, pin_result=True)
    except Exception as e:  # noqa: BLE001 - any host-tier failure fails these requests, loudly
        for r in plan.req_ids:
            plan.fail(r, f"host tier (layer {li}): {type(e).__name__}: {e}")
    t = plan.lap("select", t)
    # 2. stock kernel, offloaded rows shrunk to one live token
    if stock is not None:
        stock()
        t = plan.lap("stock", t)
    # 3. window parts (the search's device rows, or gathered here when it failed)
    if q_off is None:
        q_off = q.index_select(0, tok)
    parts = flash_window_parts(self, q_off, kv_cache, plan, attn_metadata, cfg.sink, plan.cache["block_size"])
    t = plan.lap("window", t)
    # 4. host result, then one merge into the output rows (failed rows: zeros, finished with an error)
    ok = False
    if fut is not None:
        try:
            h_out, h_lse = host.wait(fut, li)
            t = plan.lap("wait", t)
            if sel.estimate is not None:
                parts.append(sel.estimate)
            parts.append((h_out.to(q.device, non_blocking=True), h_lse.to(q.device, non_blocking=True)))
            merge_into(o, tok, parts)
            ok = True
        except Exception as e:  # noqa: BLE001
            for r in plan.req_ids:
                plan.fail(r, f"host tier (layer {li}): {type(e).__name__}: {e}")
    if not ok:
        o.index_fill_(0, tok, 0.0)
    plan.lap("merge", t)


def wrap_impl(layer, cfg: NelssaConfig) -> None:
    """Give ``layer.impl`` NELSSA's split-batch forward (a subclass of its own class)."""
    impl = layer.impl
    name = type(impl).__name__
    if name == "CPUAttentionBackendImpl":
        isa = impl.isa
        if isa not in ("vec", "vec16", "amx"):
            raise ValueError(f"NELSSA reads vLLM's CPU paged KV cache in its x86 layouts (vec, vec16, amx), "
                             f"not {isa!r}")
        backend, layout = "cpu", "cpu_amx" if isa == "amx" else "cpu_vec"
    elif name == "FlashAttentionImpl":
        backend = layout = "flash"
    else:
        raise ValueError(f"NELSSA supports the CPU_ATTN and FLASH_ATTN backends, not {name} (vLLM chose it for this "
                         f"GPU and model): start vLLM with --attention-backend FLASH_ATTN (engine argument "
                         f"attention_backend='FLASH_ATTN'; vLLM 0.26 ignores the VLLM_ATTENTION_BACKEND variable)")
    cls = type(f"Nelssa{name}", (type(impl),), {"forward": _forward})
    impl.__class__ = cls
    impl.nelssa_cfg = cfg
    impl.nelssa_backend = backend
    impl.nelssa_kv_layout = layout  # read_kv
