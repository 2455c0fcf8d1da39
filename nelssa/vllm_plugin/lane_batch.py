"""The whole lane batch as one CUDA-graph replay (CUDA; config ``graphs`` and ``lane_host_calls``).

lane_host.py enqueues a batch layer by layer from Python: ~47 ms per batch on the H200 (run 11), on a
thread that shares the GIL with vLLM's step thread, whose own launches slow down meanwhile (steps with
a prefill chunk: 45-66 ms instead of ~25). A host call launched while a stream captures becomes a
host node (with ``lane_host_wait`` "flags": memory-operation nodes on its flags), so the batch
can be captured once and replayed:

  1. Key: the requests in batch order and, per layer and request, what the layer's search and host
     call read — the centroid, size and value-mean tensors and the cluster count, the KV parts and
     the cluster tables (a commit to the host tier replaces them; through nelssa-node: the committed
     length, which names the node's plan, and the tier's ``capture_epoch``, which changes when a plan
     the calls name or their channel was replaced) — and the id-copy width per layer (bucketed budget). The host calls of a graph hold the tensors they read, so an equal key means
     the same tensors. One graph per request set; a new key for it replaces it; at most
     ``MAX_GRAPHS`` sets (least recently used dropped); ``forget`` drops the graphs of finished or
     preempted requests (they hold the requests' host KV).
  2. A key seen for the first time: the batch runs enqueued (lane_host.py) and the key is kept; the
     second time in a row it is captured, then replayed (the replay computes that batch). After a
     replay (the lane was steady) a new key is captured at once: a request joined or left a steady
     set, or a commit replaced its tables, and the new set is most likely the next steady one (H100,
     hol run 64: the 2-row set's first batch ran enqueued for 165 ms before its 0.27-s capture, in the
     decode phase's first half second). So is a set after the lane idled (no batch for ``IDLE_S``):
     its requests have just switched, and their tables change only with a commit ``chunk`` tokens
     later. Sets in flux (the previous batch ended less than ``IDLE_S`` ago and was not a replay) keep
     the rule. The lane's first set counts as after an idle lane once the host calls' flags exist
     (``flags_made``: Lane.warm makes them at engine start); without them the process's first batch runs
     enqueued and makes them (csrc/flag_wait.cpp: once per process, at their first use, by
     ``cuMemHostAlloc``, which a capture forbids — H100 hol runs 87/88, a first batch captured at once:
     every host call failed, loudly). ``decide`` is the rule.
     A set with a request that ends within ``ENDING`` positions (its last position known: drafts'
     ``Job.last``) is not captured: it runs enqueued, and the set after it counts as steady (H200 hol run
     77: the 2-row set was captured in 0.28 s for the one batch left to the first request, then the
     second request's own set in 0.23 s; both requests waited for both captures).
  3. Static inputs, written on the lane stream before each replay (these and every other tensor made
     before the capture that the graph reads — the capture's plan with its token index and window
     offsets, the pinned buffers held by the host calls — live as long as the graph): the token ids
     (one copy from the sampled tokens) and, as the graph's own lane_inputs.Staging (one pinned buffer
     and one copy per dtype), positions, KV slots (lane_graphs._Size), budget targets, the window's
     block table (sink blocks + ``cap`` blocks from H) and lengths; FlashAttention reads the lengths
     (``seqused_k``), the capacity bounds the read. After the replay one event is recorded on the lane
     stream (the capture joined the host stream back into it): the lane's one wait.
     A batch whose window does not fit the capacity (a hand-off lagging far behind) or whose sink is
     not whole blocks runs enqueued.
  4. The capture runs lane_graphs.segment and lane_host.HostStreamBatch.attend (``capturing``: the
     search without its own graphs, host calls as graph nodes; pinned buffers and events made before
     the capture) for every layer: the same operations as the enqueued batch, in the same order.
  5. Before a replay every host call is re-armed and the cancel flag cleared; after the lane
     synchronised, the calls' states decide as in lane_host.py (4): a failed call fails the batch's
     requests, a set flag (drop) has skipped the calls not yet run.
  6. A capture that fails (or whose attention failed) is logged and discarded; that request set runs
     enqueued from then on. One captured at once (before any enqueued run of its key: whatever an
     enqueued batch initialises on first use was not there yet) is captured once more after one
     enqueued batch.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nelssa._ext import ext
from nelssa.sparse.search import host_budget_targets
from nelssa.vllm_plugin import lane_inputs
from nelssa.vllm_plugin.attention import StepPlan
from nelssa.vllm_plugin.lane_graphs import _Size, segment
from nelssa.vllm_plugin.lane_host import HostStreamBatch

log = logging.getLogger("vllm.nelssa")

MAX_GRAPHS = 4
ENDING = 4  # a set with a request this few positions from its end runs enqueued (2): a capture (~0.25 s on
            # the H200) pays from about three replays (~45 ms each) against enqueued batches (~150 ms)
IDLE_S = 0.25  # a lane without a batch this long is no set in flux (2)


def decide(prev: str, seen: bool, idle_s: float | None, left: int) -> str:
    """How a request set without a graph for its key runs (2) -> "ending" or "new_key" (enqueued) or
    "capture". ``prev``: how the lane's previous batch ran ("" none yet); ``seen``: this key was the set's
    last key; ``idle_s``: seconds since the lane's previous batch ended (None: none yet); ``left``: the
    fewest positions a request of the set has left (-1: not known)."""
    if 0 <= left < ENDING:
        return "ending"
    if idle_s is None and not seen:  # the process's first batch: enqueued (its flags outside a capture)
        return "new_key"
    if seen or prev in ("replay", "ending") or idle_s >= IDLE_S:
        return "capture"
    return "new_key"


class _Window:
    def __init__(self, block_table: torch.Tensor):
        self.block_table = block_table


def _kv_key(c) -> tuple:
    """What a layer's search and host call read of one request (1): the centroid search's tensors, and the
    host tables — a ClusteredKV's own (a commit replaces them); on nelssa-node (RemoteKV) the node holds
    them and the call's plan follows the committed length."""
    dev = (c.centroids.data_ptr(), c.sizes.data_ptr(), c.vmeans.data_ptr() if c.vmeans is not None else 0,
           c.num_clusters)
    if hasattr(c, "cpart"):
        return dev + (c.cpart.data_ptr(), c.cstart.data_ptr(), c.csize.data_ptr(), tuple(p.kv.data_ptr() for p in c.parts))
    return dev + (c.req_id, c.length)


@dataclass
class _Graph:
    key: tuple
    graph: Any
    size: _Size
    staging: lane_inputs.Staging  # its static inputs (3): pos, slots, tok, win_bt, win_len, target
    batch: HostStreamBatch     # the capture's: its host calls, events, device results
    end: Any = None            # an event recorded after a replay (the lane's one wait)
    keep: list = field(default_factory=list)


class BatchGraphs:
    def __init__(self, model, decoder: list, layers: list, cfg, block_size: int):
        self.model, self.decoder, self.layers, self.cfg, self.bs = model, decoder, layers, cfg, block_size
        # window capacity in blocks after the sink: recent + two chunks (an append in flight) + a block
        self.cap = -(-(cfg.recent + 2 * cfg.chunk) // block_size) + 1
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()  # request set -> graph
        self._seen: dict[tuple, tuple] = {}                          # request set -> key of its last batch
        self._broken: set[tuple] = set()
        self.captures = 0
        self.replays = 0
        self.failures = 0               # captures that failed (6)
        self.path = ""                  # how the last batch ran: replay, captured, or why it ran enqueued
        self._ended: float | None = None  # when the lane's last batch ended (monotonic; ``ended``)
        self.flags_made = False  # the host calls' flags exist (Lane.warm): the first set may be captured (2)
        self._lock = threading.Lock()   # the graphs: run (lane thread) and forget (step thread)
        self._plock = threading.Lock()  # requests to forget
        self._pending: set[str] = set()

    def forget(self, req_ids) -> None:
        """Drop the graphs (and with them the host calls holding the host KV) of these requests: now, or
        at the end of the lane's current ``run`` (the step thread never waits for a capture). The lane
        calls this only once no batch of these requests runs (Lane.drop), so none of the graphs dropped
        has a replay in flight."""
        ids = set(req_ids)
        if not ids:
            return
        with self._plock:
            self._pending |= ids
        if self._lock.acquire(blocking=False):
            try:
                self._drop_pending()
            finally:
                self._lock.release()

    def _drop_pending(self) -> None:
        with self._plock:
            ids, self._pending = self._pending, set()
        if not ids:
            return
        for rs in [rs for rs in self._graphs if ids & set(rs)]:
            del self._graphs[rs]
        for rs in [rs for rs in self._seen if ids & set(rs)]:
            del self._seen[rs]
        self._broken = {rs for rs in self._broken if not ids & set(rs)}

    def _key(self, host, req_ids: tuple) -> tuple:
        from nelssa.vllm_plugin.select_graph import _bound
        # through nelssa-node the calls name the node's plan and channel: a tier that replaced either
        # since (a plan evicted, the channel reopened) counts a new epoch (node/client.py)
        per: list = [getattr(host, "capture_epoch", 0)]
        for li in range(len(self.layers)):
            ckvs = [host.layer_kv(r, li) for r in req_ids]
            per.append(_bound(self.cfg.budget, ckvs, max(c.num_clusters for c in ckvs)))
            per.extend(_kv_key(c) for c in ckvs)
        return tuple(per)

    def run(self, lane, plan: StepPlan, inp: lane_inputs.LaneInputs, ids: torch.Tensor, left: int = -1):
        """The batch as a replay -> (hidden [n, hidden] on the lane stream, the graph's batch for the
        calls' states), or None: run it enqueued (2, 3, 6). On the lane's stream; ``ids`` the batch's
        tokens on the device, ``inp`` its other inputs on the host (lane_inputs.py); ``left`` the fewest
        positions a request of the batch has left after this one (-1: not known). The lane calls
        ``ended`` when the batch has run."""
        with self._lock:
            try:
                return self._run(lane, plan, inp, ids, left)
            finally:
                self._drop_pending()

    def ended(self) -> None:
        """A lane batch has run, however it ran (2: the lane's idle time counts from here)."""
        self._ended = time.monotonic()

    def _run(self, lane, plan: StepPlan, inp, ids: torch.Tensor, left: int = -1):
        rs = tuple(plan.req_ids)
        if rs in self._broken:
            self.path = "broken"
            return None
        win = inp.window(self.cfg.sink, self.cap, self.bs)
        if win is None:
            self.path = "no_window"
            return None
        key = self._key(plan.host, rs)
        g = self._graphs.get(rs)
        if g is not None and g.key != key:
            del self._graphs[rs]
            g = None
        if g is None:
            if self._ended is not None:
                idle = time.monotonic() - self._ended
            else:  # no batch yet: an idle lane once the host calls' flags exist (2)
                idle = math.inf if self.flags_made else None
            how = decide(self.path, self._seen.get(rs) == key, idle, left)  # (2)
            if how != "capture":
                if how == "new_key":
                    self._seen[rs] = key
                self.path = how
                return None
            g = self._capture(lane, plan, rs, key, inp, ids, win)
            if g is None:
                self.path = "capture_failed"
                return None
            self.path = "captured"
        else:
            self.path = "replay"
            self._inputs(g, plan, inp, ids, win)
            g.batch.flag.clear()
            for c in g.batch.calls:
                c.rearm()
            g.graph.replay()
            self.replays += 1
        self._graphs.move_to_end(rs)
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        out = g.size.out.clone()  # before the end event: the lane's one wait covers it
        g.end.record(lane.stream)
        return out, g.batch, g.end

    def _inputs(self, g: _Graph, plan, inp, ids, win) -> None:
        """The static inputs of ``g`` for this batch: the tokens, and the rest in one copy per dtype."""
        g.size.ids.copy_(ids)
        g.staging.upload(pos=inp.pos, slots=inp.slots, win_bt=win[0], win_len=win[1],
                         target=host_budget_targets([plan.host.layer_kv(r, 0) for r in plan.req_ids],
                                                    self.cfg.budget).numpy())

    def _capture_failed(self, rs: tuple, key: tuple) -> bool:
        """A capture of the set ``rs`` (its key ``key``) failed (6) -> whether the set now runs enqueued for good:
        one captured before any enqueued run of its key gets one more capture, after an enqueued batch."""
        self.failures += 1
        if self._seen.get(rs) == key:
            self._broken.add(rs)
            return True
        self._seen[rs] = key
        return False

    def _capture(self, lane, plan, rs, key, inp, ids, win) -> _Graph | None:
        from nelssa.vllm_plugin.select_graph import _bound
        t = time.perf_counter()
        n, dev = ids.shape[0], ids.device
        impl = self.layers[0].impl
        hq, d = impl.num_heads, impl.head_size
        dtype = self.model.model.norm.weight.dtype
        st = lane_inputs.Staging(lane_inputs.shapes(inp, win), dev)
        v = st.dev
        s = _Size(torch.empty(n, dtype=torch.long, device=dev), v["pos"], v["slots"],
                  torch.empty(n, hq, d, dtype=dtype, device=dev), pool=torch.cuda.graph_pool_handle())
        g = _Graph(key, torch.cuda.CUDAGraph(), s, st,
                   HostStreamBatch(lane.stream, lane.host_stream, lane._host_buffers, ext().CancelFlag(),
                                   capturing=True), torch.cuda.Event())
        st.host["tok"][...] = np.arange(n)
        self._inputs(g, plan, inp, ids, win)
        # the capture's plan: the per-step tensors the attention reads are the graph's static inputs
        cp = StepPlan(plan.host, list(rs), list(range(n)), plan.token_idx, list(plan.host_end), list(plan.seq_lens))
        cp.cache.update({"block_size": self.bs, "dtype": plan.cache.get("dtype"), "target": v["target"],
                         "tok": v["tok"],
                         ("fa",): {"cu": torch.arange(n + 1, dtype=torch.int32, device=dev),
                                   "calls": [(v["win_bt"], v["win_len"], self.cfg.sink + self.cap * self.bs)]}})
        H = plan.host.layer_kv(rs[0], 0).num_kv_heads
        for li in range(len(self.layers)):
            ckvs = [plan.host.layer_kv(r, li) for r in rs]
            g.batch.prepare_capture(li, n, hq, d, H, _bound(self.cfg.budget, ckvs, max(c.num_clusters for c in ckvs)),
                                    dtype)
        # the graph reads these by address: kept with it (the capture's plan holds the token index and the
        # window's cu_seqlens, made before the capture outside the graph's pool)
        g.keep.append(cp)
        md = _Window(v["win_bt"])  # unread: the capture's plan has the window's tensors (cp.cache)
        L = len(self.decoder)
        parts = [time.perf_counter()]  # the capture's time by part (logged): prepare, record, instantiate, replay
        try:
            g.graph.capture_begin(s.pool, capture_error_mode="thread_local")
            try:
                for i in range(L + 1):
                    t_seg = time.perf_counter()
                    segment(self.model, self.decoder, self.layers, s, i)
                    cp.lap("dense", t_seg)  # the record's time by part (logged below; attend laps the rest)
                    if i < L:
                        attn = self.layers[i]
                        g.batch.attend(attn.impl, attn, s.q[i].reshape(n, hq, d), attn.kv_cache, s.attn, md, cp)
            finally:
                parts.append(time.perf_counter())
                g.graph.capture_end()
                parts.append(time.perf_counter())
            if cp.failed:
                raise RuntimeError(f"attention failed while capturing: {next(iter(cp.failed.values()))}")
            for c in g.batch.calls:
                c.rearm()
            g.graph.replay()  # the capture recorded the batch; this computes it
            parts.append(time.perf_counter())
        except Exception:
            broken = self._capture_failed(rs, key)
            log.exception("NELSSA lane: capturing the batch of %d rows as one graph failed; it runs enqueued%s", n,
                          "" if broken else " and is captured again after that")
            return None
        self._graphs[rs] = g
        self.captures += 1
        log.info("NELSSA lane: batch of %d rows captured as one CUDA graph (%d host calls) in %.3f s (prepare %.3f, "
                 "record %.3f [%s], instantiate %.3f, replay %.3f)", n, len(g.batch.calls), time.perf_counter() - t,
                 parts[0] - t, parts[1] - parts[0], ", ".join(f"{k} {v:.3f}" for k, v in sorted(cp.split.items())),
                 parts[2] - parts[1], parts[3] - parts[2])
        return g
