"""Model-runner mixin: publishes each step's plan of offloaded rows and hands KV to the host tier.

Per step:
  * before: drop the hand-offs and host KV of finished and preempted requests;
  * plan: decode rows of long requests with a host range in use this step (H > 0, decided by the
    scheduler and read from the NELSSA connector's metadata) are offloaded; their prepared host KV up
    to H is committed (handoff.Handoff.ready);
  * after the forward: the ranges policy.Policy now wants on the host (a long prompt's completed
    k-means segments while it prefills, the rest of the prompt once processed, each filled chunk of
    generated tokens) are handed off in the background (handoff.Handoff.submit); completions go to
    the scheduler through the connector, which switches the request to them in a later step.
Failures are collected per request and reported through the NELSSA KV connector.
"""

from __future__ import annotations

import logging
import time

import torch

from nelssa.config import set_config, vllm_nelssa_config
from nelssa.node import LocalHostTier, host_tier
from nelssa.vllm_plugin import runtime
from nelssa.vllm_plugin.attention import StepPlan, read_kv, set_plan
from nelssa.vllm_plugin.connector import step_anchors, step_host_ends
from nelssa.vllm_plugin.handoff import Handoff
from nelssa.vllm_plugin.policy import Policy, device_only

log = logging.getLogger("vllm.nelssa")


class NelssaRunnerMixin:
    """Mix in before a vLLM V1 model runner class (CPUModelRunner, GPUModelRunner)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.nelssa_cfg = vllm_nelssa_config(self.vllm_config.additional_config)
        self.nelssa_host: LocalHostTier | None = None
        self.nelssa_handoff: Handoff | None = None
        self._nelssa_so = None

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        cfg = self.nelssa_cfg
        if cfg is None:
            return
        from nelssa.vllm_plugin.model import NelssaAttention, NelssaLlamaForCausalLM

        model = self.get_model()
        if not isinstance(model, NelssaLlamaForCausalLM) or not model.nelssa_enabled:
            arch = self.model_config.hf_config.architectures
            raise ValueError(f"NELSSA supports Llama-family models served by vLLM's LlamaForCausalLM; this "
                             f"model is {arch} ({type(model).__name__}). Remove the nelssa config to serve it.")
        layers = [m for m in model.modules() if isinstance(m, NelssaAttention)]
        self._nelssa_layers = sorted(layers, key=lambda m: m.nelssa_layer)
        bs = self.cache_config.block_size
        self._nelssa_policy = Policy(cfg.T_input, cfg.sink, cfg.recent, cfg.chunk, bs)
        set_config(cfg)
        self.nelssa_host = host_tier(cfg, num_layers=len(layers))  # engine local | node
        self.nelssa_handoff = Handoff(self.nelssa_host, self._nelssa_layers, bs, cfg.sink, read_kv,
                                      on_done=runtime.handoff_done)
        runtime.set_host(self.nelssa_host)
        self._nelssa_graphs = None
        if cfg.graphs and self.device.type == "cuda":
            from nelssa.vllm_plugin.select_graph import SelectGraphs
            self._nelssa_graphs = SelectGraphs()
        log.info("NELSSA on: T_input=%d budget=%.3f sink=%d recent=%d chunk=%d, %d layers, host pool %d threads",
                 cfg.T_input, cfg.budget, cfg.sink, cfg.recent, cfg.chunk, len(layers), cfg.pool_threads)

    def initialize_kv_cache(self, *args, **kwargs):
        super().initialize_kv_cache(*args, **kwargs)
        from nelssa.vllm_plugin.connector import find_connector
        profiling = kwargs.get("is_profiling", False)  # GPU: a minimal cache for CUDA-graph profiling
        if self.nelssa_cfg is not None and not profiling and find_connector() is None:  # exists by now
            raise ValueError("NELSSA needs its KV connector: pass kv_transfer_config="
                             '{"kv_connector": "NelssaConnector", "kv_connector_module_path": '
                             '"nelssa.vllm_plugin.connector", "kv_role": "kv_both"} (see nelssa.vllm_plugin.engine_args)')

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        host = self.nelssa_host
        if host is None:
            return super().execute_model(scheduler_output, intermediate_tensors)
        preempted = scheduler_output.preempted_req_ids or set()
        for rid in scheduler_output.finished_req_ids | preempted:
            self.nelssa_handoff.drop(rid, preempted=rid in preempted)
            host.free(rid)
            runtime.forget(rid)
        self._nelssa_so = scheduler_output
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._nelssa_so = None

    def _model_forward(self, *args, **kwargs):
        so = self._nelssa_so
        if self.nelssa_host is None or so is None:  # stock, or a warm-up/profile run
            return super()._model_forward(*args, **kwargs)
        plan, moves = self._nelssa_plan(so)
        set_plan(plan)
        t = time.perf_counter()
        try:
            out = super()._model_forward(*args, **kwargs)
        finally:
            set_plan(None)
        if plan.rows:
            dt = time.perf_counter() - t
            self.nelssa_host.stats.add(offload_step_s=dt, host_wait_s=plan.split.get("wait", 0.0),
                                       offload_split_s=plan.split)
            if all(n == 1 for n in so.num_scheduled_tokens.values()):  # no prefill chunk in this step
                self.nelssa_host.stats.add(offload_decode_step_s=dt)
        self._nelssa_submit(moves, plan)
        for rid, msg in plan.failed.items():
            if rid not in runtime.failed:
                log.error("NELSSA: request %s fails: %s", rid, msg)
            runtime.fail(rid, msg)
        return out

    def _nelssa_plan(self, so) -> tuple[StepPlan, list[tuple[str, int, int]]]:
        """The step's offloaded rows (their hand-offs made ready) and the ranges to hand off after it."""
        pol, ib, seg, ho = self._nelssa_policy, self.input_batch, self.nelssa_cfg.segment, self.nelssa_handoff
        in_use = step_host_ends(so.kv_connector_metadata)
        anchors = step_anchors(so.kv_connector_metadata)
        rows, rids, tok, hend, seqs, moves = [], [], [], [], [], []
        bad: dict[str, str] = {}
        qpos = 0
        for i in range(ib.num_reqs):
            rid = ib.req_ids[i]
            s = so.num_scheduled_tokens[rid]
            prompt = self.requests[rid].num_prompt_tokens
            a = pol.anchor(prompt, anchors.get(rid, 0), device_only(self.requests[rid].sampling_params))  # 0: device
            if a:
                failed = rid in runtime.failed
                c = int(ib.num_computed_tokens_cpu[i])
                n = c + s  # tokens with KV after this step
                h = in_use.get(rid, 0)
                if h:
                    rows.append(i), rids.append(rid), tok.append(qpos), hend.append(h), seqs.append(n)
                    if s != 1:
                        bad[rid] = f"offloaded request scheduled {s} tokens in one step (1 supported)"
                    elif not failed:
                        try:
                            ho.ready(rid, h)
                        except Exception as e:  # noqa: BLE001 - this request fails loudly; others go on
                            bad[rid] = f"hand-off of tokens up to {h} to the host tier: {type(e).__name__}: {e}"
                # what should be on the host once this step has run: completed segments while a long
                # prompt prefills, then the policy's goal
                want = (pol.goal(a, n) if n >= a
                        else min(pol.goal(a, a), pol.sink + (n - pol.sink) // seg * seg))
                if want > ho.end(rid) and not failed:
                    moves.append((rid, ho.end(rid), want))
            qpos += s
        plan = StepPlan(self.nelssa_host, rids, rows, torch.tensor(tok, dtype=torch.long), hend, seqs)
        plan.failed.update(bad)
        plan.failed.update({r: runtime.failed[r] for r in rids if r in runtime.failed})
        plan.cache["block_size"] = self.cache_config.block_size
        plan.cache["dtype"] = self.model_config.dtype
        plan.graphs = self._nelssa_graphs
        return plan, moves

    def _nelssa_submit(self, moves: list[tuple[str, int, int]], plan: StepPlan) -> None:
        """Hand off the new ranges in the background (after this step's forward was launched)."""
        todo = [(rid, list(self.requests[rid].block_ids[0]), lo, hi) for rid, lo, hi in moves
                if rid not in plan.failed]
        try:
            self.nelssa_handoff.submit(todo)
        except Exception as e:  # noqa: BLE001
            for rid, _, _, hi in todo:
                plan.fail(rid, f"handing off tokens up to {hi}: {type(e).__name__}: {e}")
