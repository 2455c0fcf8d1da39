"""The centroid search of a split-attention layer as one CUDA-graph replay (CUDA only).

On an offloaded decode step every layer runs ``nelssa.sparse.select_clusters`` for the same requests
with the same shapes; eagerly that is ~40 top-level launches per layer (the H200 profile of an
offloaded step: 79 ms of its 168 ms went to this search and its submission). Here, per layer:

  1. the key of the call: the layer, and for each request its centroid/size/value-mean tensors'
     addresses and cluster count, the batch's query shape and the id-copy width ``bound`` (a
     power-of-two bucket of the largest budget, so it changes rarely while requests grow). A graph
     reads whatever lies at the addresses it captured, so equal keys mean an equal computation; a
     commit to the host tier replaces a request's centroid tensors (new addresses, new key);
  2. a key seen for the first time runs eagerly (``select_clusters``) and is remembered; the second
     time in a row it is captured (the capture is itself a correct run), then replayed. So a shape
     that changes every step never pays for captures;
  3. the graph's inputs are static tensors shared by all layers of a step shape: the queries (filled
     by one ``index_select`` into them) and the budget targets (filled once per step); its outputs
     are per-layer: the selected ids and counts and the queries in pinned host memory (copied
     inside the graph) and the device estimate of the unselected clusters;
  4. after the replay an event is recorded; the host tier's pool thread waits for it before it reads
     the ids and queries (``Selection.ready``). The pinned outputs of a layer are rewritten only by
     that layer's next replay, one step later, after this step's host attention of the layer ended
     (the forward waits for it before it leaves the layer).
All graphs share one memory pool (they replay one after another on one stream and hand their
device outputs on within the layer). One graph per layer is kept: a new key replaces it.
"""

from __future__ import annotations

import logging

import torch

from nelssa.sparse.search import Selection, budget_tokens, select_clusters

log = logging.getLogger("vllm.nelssa")


def id_width(budget: float, tokens: int, clusters: int) -> int:
    """Width of the id copy for requests of up to ``tokens`` tokens and ``clusters`` clusters: the budget in
    tokens (>= selected clusters) as a power of two, at most the clusters."""
    return min(clusters, 1 << max(0, budget_tokens(budget, tokens) - 1).bit_length())


def _bound(budget: float, ckvs, cmax: int) -> int:
    """Width of the id copy of a batch: ``id_width`` of its longest request."""
    return id_width(budget, max(c.length for c in ckvs), cmax)


class SelectGraphs:
    """Per-layer captured centroid searches of one engine (see the module docstring)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()        # captures run on it
        self.graphs: dict[int, tuple] = {}     # layer -> (key, graph, outputs)
        self.seen: dict[int, tuple] = {}       # layer -> key of its last eager run
        self.inputs: dict[tuple, dict] = {}    # (B, Hq, D, dtype, bound) -> static q / target
        self.captures = 0
        self.replays = 0

    def _static(self, q: torch.Tensor, bound: int) -> dict:
        k = (*q.shape, q.dtype, bound)
        s = self.inputs.get(k)
        if s is None:
            if len(self.inputs) > 8:
                self.inputs.clear()
            s = self.inputs[k] = {"q": torch.empty_like(q), "target": torch.zeros(q.shape[0], dtype=torch.long,
                                                                                   device=q.device), "step": None}
        return s

    def select(self, layer: int, q: torch.Tensor, tok: torch.Tensor, ckvs: list, budget: float, scale: float,
               estimate: bool, target: torch.Tensor, step: object) -> tuple[Selection, torch.Tensor, torch.Tensor]:
        """(selection for queries ``q[tok]``, the queries the host tier reads — pinned host memory once
        a graph runs, the device rows on an eager run —, the device rows ``q[tok]``: valid until the
        next call). ``target``: ``budget_targets`` of this step; ``step``: any object identifying the
        step (the static target is refilled once per step)."""
        B = tok.shape[0]
        cmax = max(c.num_clusters for c in ckvs)
        bound = _bound(budget, ckvs, cmax)
        key = (tuple((c.centroids.data_ptr(), c.sizes.data_ptr(), c.vmeans.data_ptr(), c.num_clusters)
                     for c in ckvs), B, q.shape[1:], q.dtype, bound, estimate, budget)
        g = self.graphs.get(layer)
        if g is not None and g[0] == key:
            _, graph, out = g
            s = out["static"]
            if s["step"] is not step:
                s["target"].copy_(target, non_blocking=True)
                s["step"] = step
            torch.index_select(q, 0, tok, out=s["q"])
            graph.replay()
            out["event"].record()
            self.replays += 1
            return (Selection(out["ids"], out["counts"], out["estimate"], ready=out["event"]), out["q_host"],
                    s["q"])
        q_off = q.index_select(0, tok)
        if self.seen.get(layer) != key:  # first sight of this shape: eager, remembered
            self.seen[layer] = key
            return select_clusters(q_off, ckvs, budget, scale, estimate=estimate, no_sync=True,
                                   target=target), q_off, q_off
        return self._capture(layer, key, q_off, ckvs, budget, scale, estimate, target, bound, step)

    def _capture(self, layer, key, q_off, ckvs, budget, scale, estimate, target, bound, step):
        self.graphs.pop(layer, None)
        s = self._static(q_off, bound)
        s["q"].copy_(q_off)
        s["target"].copy_(target)
        s["step"] = step
        B, H = q_off.shape[0], ckvs[0].num_kv_heads
        out = {"static": s, "event": torch.cuda.Event(),
               "ids_h": torch.empty((B, H, bound), dtype=torch.long, pin_memory=True),
               "cnt_h": torch.empty((B, H), dtype=torch.long, pin_memory=True),
               "q_host": torch.empty(q_off.shape, dtype=q_off.dtype, pin_memory=True)}
        graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph() would synchronize the device and empty both caches on every capture: the
        # capture API directly, on a side stream ordered after the inputs' copies
        cur = torch.cuda.current_stream()
        self.stream.wait_stream(cur)
        with torch.cuda.stream(self.stream):
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                sel = select_clusters(s["q"], ckvs, budget, scale, estimate=estimate, target=s["target"],
                                      device_out=True)
                out["ids_h"].copy_(sel.ids[..., :bound], non_blocking=True)
                out["cnt_h"].copy_(sel.counts, non_blocking=True)
                out["q_host"].copy_(s["q"], non_blocking=True)
            finally:
                graph.capture_end()
        cur.wait_stream(self.stream)
        graph.replay()  # the capture recorded the work; this runs it for this layer
        out["event"].record()
        out["ids"] = [out["ids_h"][b] for b in range(B)]
        out["counts"] = [out["cnt_h"][b] for b in range(B)]
        out["estimate"] = sel.estimate
        self.graphs[layer] = (key, graph, out)
        if not self.captures:
            log.info("NELSSA: centroid search captured as a CUDA graph (layer %d, %d requests, %d clusters, "
                     "id width %d); layers replay their graphs until a request's clusters change", layer, B,
                     max(c.num_clusters for c in ckvs), bound)
        self.captures += 1
        return Selection(out["ids"], out["counts"], out["estimate"], ready=out["event"]), out["q_host"], s["q"]
