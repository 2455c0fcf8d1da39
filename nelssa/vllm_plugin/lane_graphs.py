"""The long lane's dense parts as CUDA graphs (lane.py, step 3; CUDA with config ``graphs``).

Eagerly a lane batch launches vLLM's modules one by one, ~15-20 kernels per decoder layer, from a
Python thread that shares the GIL with the engine's step thread, so every launch may wait for the GIL
(run 7 on the H200: ~89 of a lane batch's 200 ms). Here everything between two attentions is one
graph replay:

  1. Per batch size n, L + 1 graphs on the lane's stream. Graph 0: embedding -> layer 0's input norm
     -> qkv -> rotary -> KV write at the rows' slots (-> q of layer 0). Graph i (0 < i < L): layer
     i-1's o_proj -> post-attention norm (residual add) -> MLP, then layer i's part up to its KV write
     as in graph 0 (-> q of layer i). Graph L: layer L-1's post-attention part and the final norm
     (-> the rows' hidden states).
  2. The split attention (``attend(i, q_i, out)``: centroid search, host submission, window, merge)
     runs eagerly between graph i and graph i + 1; it reads q_i and writes the static attention
     output that graph i + 1 reads.
  3. Static per n: the token ids, positions and KV slots (copied in by ``run``), the attention output;
     the hidden states and residuals the graphs pass on are tensors of the size's graph pool kept alive
     here, so graph i + 1 reads what graph i wrote. The graphs of a size replay in capture order.
  4. Small sizes are captured when the engine captures its own graphs (``warm``, on dummy rows whose
     KV slot is vLLM's pad slot -1, so nothing is written), not while serving; another size is
     captured the second time it is seen (the lane runs it eagerly the first time). Either way lazy
     state of vLLM's modules (e.g. the rotary cos/sin cache converted to the query's dtype on first
     use, a cuBLAS workspace for the lane's stream) is made by an eager pass outside any capture.
     Each graph is replayed right after its capture, so the capturing batch is computed too.
  5. A capture that fails raises ``CaptureFailed`` after logging the error; the size is not tried
     again and the lane reruns the batch eagerly from its embedding (the KV writes it repeats carry
     the same values). A replay failure is an error of the batch like any other.
The graphs run the same code as the eager path (``pre_attention`` and ``post_attention``, shared with
the eager lane; vLLM's CustomOp CUDA paths through ``call_op``), so the lane's results do not depend
on which path ran.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

log = logging.getLogger("vllm.nelssa")


class CaptureFailed(RuntimeError):
    pass


def call_op(m, *args):
    """A vLLM CustomOp's fused CUDA path where it has one (eager calls of forward_native would launch
    each elementwise op), else the module."""
    f = getattr(m, "forward_cuda", None)
    if f is not None and args[-1].is_cuda:
        return f(*args)
    return m(*args)


def pre_attention(layer, attn, h: torch.Tensor, r, pos: torch.Tensor, slots: torch.Tensor):
    """vLLM's LlamaDecoderLayer up to its attention, for lane rows: input norm (with the residual add
    unless ``r`` is None: the first layer) -> qkv -> rotary -> KV write at ``slots`` -> (q [n, q_size],
    residual). The eager lane and the graphs (``_segment``) run this same code."""
    sa, impl = layer.self_attn, attn.impl
    if r is None:
        r, x = h, call_op(layer.input_layernorm, h)
    else:
        x, r = call_op(layer.input_layernorm, h, r)
    qkv, _ = sa.qkv_proj(x)
    q, k, v = qkv.split([sa.q_size, sa.kv_size, sa.kv_size], dim=-1)
    q, k = call_op(sa.rotary_emb, pos, q, k)
    n = q.shape[0]
    impl.do_kv_cache_update(attn, k.reshape(n, impl.num_kv_heads, impl.head_size),
                            v.reshape(n, impl.num_kv_heads, impl.head_size), attn.kv_cache, slots)
    return q, r


def post_attention(layer, o: torch.Tensor, r: torch.Tensor):
    """The rest of the layer: o_proj of the attention output o [n, Hq, D] -> post-attention norm (with
    the residual add) -> MLP -> (hidden, residual)."""
    h, _ = layer.self_attn.o_proj(o.reshape(o.shape[0], -1))
    h, r = call_op(layer.post_attention_layernorm, h, r)
    return layer.mlp(h), r


@dataclass
class _Size:
    ids: torch.Tensor
    pos: torch.Tensor
    slots: torch.Tensor
    attn: torch.Tensor                                  # [n, Hq, D] the attention output of each layer
    pool: Any = None
    graphs: list = field(default_factory=list)
    q: list = field(default_factory=list)              # q of each layer (graph outputs)
    res: Any = None                                    # residual passed from graph i to graph i + 1
    out: Any = None                                    # final hidden states


class DenseGraphs:
    def __init__(self, model, decoder: list, attn_layers: list):
        self.model, self.decoder, self.layers = model, decoder, attn_layers
        self._seen: set[int] = set()
        self._broken: set[int] = set()
        self._sizes: dict[int, _Size] = {}

    def use(self, n: int) -> bool:
        """Whether a batch of n rows runs through graphs now (captured, or to be captured by this run)."""
        if n in self._sizes:
            return True
        if n in self._broken:
            return False
        if n in self._seen:
            return True
        self._seen.add(n)
        return False

    def warm(self, sizes, device: torch.device) -> None:
        """Capture the graphs of these batch sizes now (4): an eager pass, then the capture, on dummy
        rows (token 0 at position 0, KV slot -1). On the lane's stream (the caller's current)."""
        for n in sizes:
            if n in self._sizes or n in self._broken:
                continue
            ids = torch.zeros(n, dtype=torch.long, device=device)
            pos = torch.zeros(n, dtype=torch.long, device=device)
            slots = torch.full((n,), -1, dtype=torch.long, device=device)
            impl = self.layers[0].impl
            eager = _Size(ids, pos, slots, torch.zeros(n, impl.num_heads, impl.head_size,
                                                       dtype=self.model.model.norm.weight.dtype, device=device))
            for i in range(len(self.decoder) + 1):
                self._segment(eager, i)
            self._seen.add(n)
            try:
                self.run(ids, pos, slots, lambda i, q, out: None, lambda: False)
            except CaptureFailed:  # logged; this size runs eagerly
                pass

    def run(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
            attend: Callable[[int, torch.Tensor, torch.Tensor], None],
            cancelled: Callable[[], bool]) -> torch.Tensor | None:
        """The batch through the graphs (1-3) -> final hidden states [n, hidden] (a copy), or None when
        ``cancelled()`` turned true between two layers. On the lane's stream (the caller's current)."""
        n = ids.shape[0]
        s = self._sizes.get(n)
        capture = s is None
        if capture:
            impl = self.layers[0].impl
            s = _Size(torch.empty_like(ids), torch.empty_like(pos), torch.empty_like(slots),
                      torch.empty(n, impl.num_heads, impl.head_size, dtype=self.model.model.norm.weight.dtype,
                                  device=ids.device), pool=torch.cuda.graph_pool_handle())
        s.ids.copy_(ids), s.pos.copy_(pos), s.slots.copy_(slots)
        nl = len(self.decoder)
        for i in range(nl + 1):
            if i and cancelled():
                return None
            if capture:
                self._capture(s, i)
            else:
                s.graphs[i].replay()
            if i < nl:
                attend(i, s.q[i], s.attn)
        if capture:
            self._sizes[n] = s
            log.info("NELSSA lane: dense parts captured as %d CUDA graphs for %d rows", nl + 1, n)
        return s.out.clone()

    def _capture(self, s: _Size, i: int) -> None:
        n = s.ids.shape[0]
        g = torch.cuda.CUDAGraph()
        try:
            # thread_local: the engine's step thread keeps launching (and syncing) while the lane captures
            g.capture_begin(s.pool, capture_error_mode="thread_local")
            try:
                self._segment(s, i)
            finally:
                g.capture_end()
            g.replay()  # the capture recorded the work; this runs it
        except Exception as e:
            self._broken.add(n)
            log.exception("NELSSA lane: capturing graph %d for %d rows failed; this size runs eagerly", i, n)
            raise CaptureFailed(f"graph {i} for {n} rows: {type(e).__name__}: {e}") from e
        s.graphs.append(g)

    def _segment(self, s: _Size, i: int) -> None:
        segment(self.model, self.decoder, self.layers, s, i)


def segment(model, decoder: list, layers: list, s: _Size, i: int) -> None:
    """What graph i runs (1), on the static tensors of ``s``; also captured by lane_batch.py."""
    if i == 0:
        h, r = model.model.embed_input_ids(s.ids), None
    else:
        h, r = post_attention(decoder[i - 1], s.attn, s.res)
    if i == len(decoder):
        s.out, _ = call_op(model.model.norm, h, r)
        return
    q, s.res = pre_attention(decoder[i], layers[i], h, r, s.pos, s.slots)
    s.q.append(q)
