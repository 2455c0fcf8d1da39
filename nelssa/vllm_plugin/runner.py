"""Model-runner mixin: publishes each step's plan of offloaded rows and moves KV to the host tier.

Both sides derive "which tokens are on the host" from policy.Policy and the same numbers (prompt
length, tokens with KV), so no scheduler->worker channel is needed. Per step:
  * before: free the host KV of finished and preempted requests;
  * plan: decode rows of long requests whose prompt is processed are offloaded (H > 0);
  * during a long prompt's chunked prefill, every completed k-means segment (config ``segment``
    tokens from ``sink``) is read, clustered and staged on the host tier in the background (a side
    CUDA stream on GPUs), overlapping the next prefill chunks; its device blocks stay until the end;
  * after the forward: a long request whose host range grew this step (prompt completed, or a chunk
    of generated tokens filled) has the rest of that range moved (after its staged segments are
    done). Its device blocks are freed by the scheduler's KV-cache manager at the next step.
Failures are collected per request and reported through the NELSSA KV connector.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from nelssa.config import set_config, vllm_nelssa_config
from nelssa.node import LocalHostTier
from nelssa.vllm_plugin import runtime
from nelssa.vllm_plugin.attention import StepPlan, read_kv, set_plan
from nelssa.vllm_plugin.policy import Policy

log = logging.getLogger("vllm.nelssa")


class NelssaRunnerMixin:
    """Mix in before a vLLM V1 model runner class (CPUModelRunner, GPUModelRunner)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.nelssa_cfg = vllm_nelssa_config(self.vllm_config.additional_config)
        self.nelssa_host: LocalHostTier | None = None
        self._nelssa_so = None
        self._nelssa_staged: dict[str, int] = {}            # request -> end of its staged prompt range
        self._nelssa_pending: dict[str, list[Future]] = {}  # request -> staged moves in flight
        self._nelssa_stager: ThreadPoolExecutor | None = None
        self._nelssa_side = None  # CUDA side stream of the stager, made on first use

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
        self._nelssa_policy = Policy(cfg.T_input, cfg.sink, cfg.recent, cfg.chunk, self.cache_config.block_size)
        set_config(cfg)
        self._nelssa_stager = ThreadPoolExecutor(1, thread_name_prefix="nelssa-stage")
        self.nelssa_host = LocalHostTier(cfg, num_layers=len(layers))
        runtime.set_host(self.nelssa_host)
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
        for rid in scheduler_output.finished_req_ids | (scheduler_output.preempted_req_ids or set()):
            self._nelssa_drain(rid)
            self._nelssa_staged.pop(rid, None)
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
        plan, moves, stages = self._nelssa_plan(so)
        set_plan(plan)
        try:
            out = super()._model_forward(*args, **kwargs)
        finally:
            set_plan(None)
        self._nelssa_stage(stages)
        self._nelssa_move(moves, plan)
        for rid, msg in plan.failed.items():
            if rid not in runtime.failed:
                log.error("NELSSA: request %s fails: %s", rid, msg)
            runtime.fail(rid, msg)
        return out

    def _nelssa_plan(self, so) -> tuple[StepPlan, list[tuple[str, int, int]], list[tuple[str, int, int]]]:
        pol, ib, seg = self._nelssa_policy, self.input_batch, self.nelssa_cfg.segment
        rows, rids, tok, hend, seqs, moves, stages = [], [], [], [], [], [], []
        bad: dict[str, str] = {}
        qpos = 0
        for i in range(ib.num_reqs):
            rid = ib.req_ids[i]
            s = so.num_scheduled_tokens[rid]
            prompt = self.requests[rid].num_prompt_tokens
            if pol.is_long(prompt):
                c = int(ib.num_computed_tokens_cpu[i])
                h = pol.host_end(prompt, c)
                if h:
                    rows.append(i), rids.append(rid), tok.append(qpos), hend.append(h), seqs.append(c + s)
                    if s != 1:
                        bad[rid] = f"offloaded request scheduled {s} tokens in one step (1 supported)"
                    elif not self.nelssa_host.has(rid):
                        bad[rid] = "offloaded request has no host KV"
                h2 = pol.host_end(prompt, c + s)
                staged = self._nelssa_staged.get(rid, pol.sink)
                if h2 > h:
                    moves.append((rid, h if h else staged, h2))
                    self._nelssa_staged.pop(rid, None)
                elif h2 == 0:  # prompt still prefilling: stage its completed segments
                    end = min(pol.host_end(prompt, prompt), pol.sink + (c + s - pol.sink) // seg * seg)
                    if end > staged:
                        stages.append((rid, staged, end))
                        self._nelssa_staged[rid] = end
            qpos += s
        plan = StepPlan(self.nelssa_host, rids, rows, torch.tensor(tok, dtype=torch.long), hend, seqs)
        plan.failed.update(bad)
        plan.failed.update({r: runtime.failed[r] for r in rids if r in runtime.failed})
        plan.cache["block_size"] = self.cache_config.block_size
        plan.cache["dtype"] = self.model_config.dtype
        return plan, moves, stages

    def _nelssa_copy(self, rid: str, blocks: list[int], lo: int, hi: int) -> None:
        """Read [lo, hi) of a request from the paged cache, cluster it per layer, add it on the host."""
        t, host, bs = time.perf_counter(), self.nelssa_host, self.cache_config.block_size
        blocks_t, pos = torch.tensor(blocks, dtype=torch.long), torch.arange(lo, hi)
        for layer in self._nelssa_layers:
            kv = layer.kv_cache
            b, o = blocks_t[pos // bs].to(kv.device), (pos % bs).to(kv.device)
            k, v = read_kv(kv, layer.impl.nelssa_backend, b, o, layer.num_kv_heads, layer.head_size)
            host.put(rid, layer.nelssa_layer, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
        host.stats.add(cluster_s=time.perf_counter() - t, moved_tokens=hi - lo)

    def _nelssa_stage(self, stages: list[tuple[str, int, int]]) -> None:
        """Start the staged moves in the background; on CUDA on a side stream that waits for this step."""
        if not stages:
            return
        cuda = self._nelssa_layers[0].kv_cache.is_cuda
        ev = torch.cuda.Event() if cuda else None
        if ev is not None:
            ev.record()
            if self._nelssa_side is None:  # one side stream: the stager runs one move at a time
                self._nelssa_side = torch.cuda.Stream()
        side = self._nelssa_side

        def run(rid: str, blocks: list[int], lo: int, hi: int) -> None:
            if ev is None:
                return self._nelssa_copy(rid, blocks, lo, hi)
            side.wait_event(ev)
            with torch.cuda.stream(side):
                self._nelssa_copy(rid, blocks, lo, hi)
            side.synchronize()

        for rid, lo, hi in stages:
            blocks = list(self.requests[rid].block_ids[0])
            self._nelssa_pending.setdefault(rid, []).append(self._nelssa_stager.submit(run, rid, blocks, lo, hi))

    def _nelssa_drain(self, rid: str) -> BaseException | None:
        """Wait for a request's staged moves; the first failure, if any."""
        err = None
        for f in self._nelssa_pending.pop(rid, []):
            e = f.exception()
            err = err or e
        return err

    def _nelssa_move(self, moves: list[tuple[str, int, int]], plan: StepPlan) -> None:
        """Move [lo, hi) of each request to the host tier, after its staged segments."""
        host = self.nelssa_host
        for rid, lo, hi in moves:
            if rid in plan.failed:
                continue
            try:
                err = self._nelssa_drain(rid)
                if err is not None:
                    raise err
                self._nelssa_copy(rid, self.requests[rid].block_ids[0], lo, hi)
            except Exception as e:  # noqa: BLE001 - the request fails loudly; others continue
                host.free(rid)
                plan.fail(rid, f"moving tokens up to {hi} to the host tier: {type(e).__name__}: {e}")
