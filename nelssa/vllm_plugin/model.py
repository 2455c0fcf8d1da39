"""Llama with NELSSA attention layers (registered over vLLM's LlamaForCausalLM by the plugin).

With NELSSA disabled the class is exactly vLLM's Llama. Enabled, each decoder layer's attention
module reports a NelssaSpec (so the KV-cache manager frees host-resident blocks) and its backend
implementation splits the batch (nelssa.vllm_plugin.attention).
"""

from __future__ import annotations

import contextlib
import re

from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.llama import LlamaForCausalLM

from nelssa.config import NelssaConfig, engine_config
from nelssa.vllm_plugin.attention import wrap_impl
from nelssa.vllm_plugin.spec import NelssaSpec


class NelssaAttention(Attention):
    """vLLM's Attention reporting a NelssaSpec; its impl is wrapped by ``wrap_impl``."""

    nelssa_cfg: NelssaConfig
    nelssa_layer: int

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        if spec is None or type(spec).__name__ != "FullAttentionSpec":
            raise ValueError(f"NELSSA supports full-attention layers only; {self.layer_name} has "
                             f"{type(spec).__name__} (sliding window / quantised KV are not supported)")
        c = self.nelssa_cfg
        if c.sink % spec.block_size:  # vllm_nelssa_config rounded it with the block size at model init
            raise ValueError(f"NELSSA: the KV block size changed to {spec.block_size} after the model was built "
                             f"(sink {c.sink}); set --block-size explicitly")
        return NelssaSpec(**{k: getattr(spec, k) for k in spec.__dataclass_fields__},
                          T_input=c.T_input, sink=c.sink, recent=c.recent, chunk=c.chunk)


def layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    if not m:
        raise ValueError(f"cannot find the decoder layer index in {name!r}")
    return int(m.group(1))


class NelssaLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's LlamaForCausalLM; with NELSSA enabled its attention layers become NelssaAttention."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        cfg = engine_config(vllm_config)
        self.nelssa_enabled = cfg is not None
        # CPU lane: the lane's dense lock (lane.py, 5), held by the step's forward (runner) and the logits
        self.nelssa_dense_lock = contextlib.nullcontext()
        if cfg is None:
            return
        if vllm_config.speculative_config is not None:
            raise ValueError("NELSSA does not support speculative decoding (decode rows of long requests "
                             "must carry one query token)")
        self.nelssa_inject = None  # (rows, logits): the lane's logits for this step's lane rows
        for module in self.modules():
            if type(module) is Attention:
                # our own model's layers become the NELSSA subclass (same state, extra behaviour)
                module.__class__ = NelssaAttention
                module.nelssa_cfg = cfg
                module.nelssa_layer = layer_index(module.layer_name)
                wrap_impl(module, cfg)

    def compute_logits(self, hidden_states, *args, **kwargs):
        inj = getattr(self, "nelssa_inject", None)
        self.nelssa_inject = None
        with self.nelssa_dense_lock:
            logits = super().compute_logits(hidden_states, *args, **kwargs)
        if inj is not None and logits is not None:  # lane rows (lane.py, 4): their logits are the lane's
            rows, lane_logits = inj
            logits = logits.index_copy(0, rows, lane_logits.to(logits.dtype))
        return logits
