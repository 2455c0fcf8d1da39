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
  * recalls (recall.py): a recalled request's new block row taken, its load started, and once loaded
    (and let go by the lane) its host KV freed and the request reported recalled;
  * with the long lane (config ``lane``, lane.py): an offloaded row whose next position the lane
    computed is a lane row (its logits are the lane's); after the sampling every offloaded row of the
    step queues the lane job of its next position (none after a request's last token). A finished
    request's lane job is cancelled, not waited for (lane.release; the scheduler keeps its blocks until
    it is reported released); a preempted one's is waited for (lane.drop).
Failures are collected per request and reported through the NELSSA KV connector.
"""

from __future__ import annotations

import logging
import sys
import time

import numpy as np
import torch

from nelssa._ext import spin_us
from nelssa.config import engine_config, set_config
from nelssa.node import LocalHostTier, host_tier
from nelssa.sparse import hostmem
from nelssa.sparse.kmeans import to_device
from nelssa.vllm_plugin import runtime, sm_split
from nelssa.vllm_plugin.attention import StepPlan, read_kv, set_plan
from nelssa.vllm_plugin.connector import (step_adoptions, step_anchors, step_handovers, step_host_ends,
                                          step_recalls, step_seeds, step_switching)
from nelssa.vllm_plugin.handoff import Handoff
from nelssa.vllm_plugin.policy import Policy, device_only, prefill_move_end
from nelssa.vllm_plugin.recall import Recalls

log = logging.getLogger("vllm.nelssa")


class NelssaRunnerMixin:
    """Mix in before a vLLM V1 model runner class (CPUModelRunner, GPUModelRunner)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.nelssa_cfg = engine_config(self.vllm_config)
        self.nelssa_host: LocalHostTier | None = None
        self.nelssa_handoff: Handoff | None = None
        self.nelssa_lane = None
        self.nelssa_recalls: Recalls | None = None
        self.nelssa_watchdog = self.nelssa_step_timer = None
        self._nelssa_lane_rows = 0  # lane rows of the last forward (StepTimer's log)
        self._nelssa_so = None
        self._nelssa_step = None  # (plan, moves) of the step, from _prepare_inputs to _model_forward
        self._nelssa_jobs: list[tuple[str, int, int, int]] = []  # this step's lane jobs: (request, row, pos, H)
        self._nelssa_adopt: dict[str, str] = {}  # D: request -> hand-over handle, until its first move (handover.py)

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
        self._nelssa_policy = Policy(cfg.T_input, cfg.sink, cfg.recent, cfg.chunk, bs, cfg.defer_limit)
        set_config(cfg)
        self.nelssa_host = host_tier(cfg, num_layers=len(layers))  # engine local | node
        self.nelssa_handoff = Handoff(self.nelssa_host, self._nelssa_layers, bs, cfg.sink, read_kv,
                                      on_done=runtime.handoff_done, ahead=cfg.handoff_ahead)
        runtime.set_host(self.nelssa_host)
        self._nelssa_graphs = None
        if cfg.graphs and self.device.type == "cuda":
            from nelssa.vllm_plugin.select_graph import SelectGraphs
            self._nelssa_graphs = SelectGraphs()
        if cfg.lane:
            from nelssa.vllm_plugin.lane import Lane
            self.nelssa_lane = Lane(model, self._nelssa_layers, self.nelssa_host, cfg, bs, self.model_config.dtype,
                                    self.device)
            runtime.set_lane(self.nelssa_lane)
            model.nelssa_dense_lock = self.nelssa_lane.dense_lock  # the step's forward and logits (lane.py, 5)
            # the lane thread launches between host results; the step thread must get the GIL back
            # within a fraction of a decode step, not Python's 5 ms
            sys.setswitchinterval(min(sys.getswitchinterval(), cfg.lane_switch_us * 1e-6))
        self.nelssa_recalls = Recalls(self.nelssa_handoff, self.nelssa_host, self.nelssa_lane, self._nelssa_policy)
        if cfg.stall_log_ms > 0:
            from nelssa.vllm_plugin.watchdog import StepTimer, Watchdog
            self.nelssa_watchdog = Watchdog(cfg.stall_log_ms)
            if self.device.type == "cuda":
                self.nelssa_step_timer = StepTimer(cfg.stall_log_ms)
        log.info("NELSSA on: T_input=%d budget=%.3f sink=%d recent=%d chunk=%d, %d layers, host pool %d threads "
                 "(spin %d us), host memory reserved %.2f GiB", cfg.T_input, cfg.budget, cfg.sink, cfg.recent, cfg.chunk,
                 len(layers), cfg.pool_threads, spin_us(cfg), cfg.host_reserve / 2**30)
        if self.device.type == "cuda":
            from vllm.utils.torch_utils import current_stream
            prio = current_stream().priority
            (log.info if prio == cfg.step_priority else log.warning)(
                "NELSSA: steps run on a CUDA stream of priority %d (step_priority %d; the hand-off's 0); %s",
                prio, cfg.step_priority, sm_split.describe())

    def capture_model(self, *args, **kwargs):
        """vLLM's CUDA-graph capture, then the lane's (lane.warm): nothing is captured while serving; and the
        hand-off's first-move set-up (handoff.warm)."""
        out = super().capture_model(*args, **kwargs)
        if getattr(self, "nelssa_lane", None) is not None:
            self.nelssa_lane.warm(self.max_model_len)
        hand = getattr(self, "nelssa_handoff", None)
        if hand is not None and self.device.type == "cuda":  # (CPU: no one-time set-up worth a k-means)
            # the hand-off thread's one-time CUDA set-up before serving, not beside the first move's steps
            tokens = min(self.nelssa_cfg.segment, self.kv_cache_config.num_blocks * self.cache_config.block_size)
            try:
                secs = hand.warm(tokens)
            except torch.OutOfMemoryError as e:
                raise RuntimeError(f"NELSSA: the hand-off's warm-up (a {tokens}-token move, k-means scratch up to "
                                   "~1 GiB) found no device memory beside vLLM's: every move would fail; lower "
                                   "gpu_memory_utilization") from e
            log.info("NELSSA: hand-off warmed (a %d-token move's work, nothing stored) in %.2f s; %s", tokens, secs,
                     "a move's read and k-means one move ahead of its packing (handoff_ahead: up to two moves' K/V "
                     "on the device)" if self.nelssa_cfg.handoff_ahead else "one move at a time")
        self._nelssa_register_host_memory()
        return out

    def _nelssa_register_host_memory(self) -> None:
        """The host-tier reservation (config host_reserve) registered with CUDA for one-DMA moves
        (sparse/hostmem.py, 3): after vLLM's CUDA-graph capture (global mode: a registration from another
        thread would break it), before serving; the engine's start waits for it."""
        if self.device.type == "cuda" and self.nelssa_cfg is not None and self.nelssa_cfg.host_reserve:
            t = time.perf_counter()
            n = hostmem.register_cuda(self.device)
            log.info("NELSSA: host-tier reservation registered with CUDA: %.2f GiB in %.1f s (touching waited for)",
                     n / 2**30, time.perf_counter() - t)

    def initialize_kv_cache(self, *args, **kwargs):
        super().initialize_kv_cache(*args, **kwargs)
        from nelssa.vllm_plugin.connector import find_connector
        profiling = kwargs.get("is_profiling", False)  # GPU: a minimal cache for CUDA-graph profiling
        if self.nelssa_cfg is not None and not profiling and find_connector() is None:  # exists by now
            raise ValueError("NELSSA needs its KV connector: pass kv_transfer_config="
                             '{"kv_connector": "NelssaConnector", "kv_connector_module_path": '
                             '"nelssa.vllm_plugin.connector", "kv_role": "kv_both"} (see nelssa.vllm_plugin.engine_args)')
        if self.nelssa_cfg is not None and not profiling and self.model_config.enforce_eager:
            self._nelssa_register_host_memory()  # no CUDA-graph capture follows (capture_model is not called)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        host = self.nelssa_host
        if host is None:
            return super().execute_model(scheduler_output, intermediate_tensors)
        if self.nelssa_watchdog is not None:
            self.nelssa_watchdog.beat(bool(scheduler_output.total_num_scheduled_tokens))
        preempted = scheduler_output.preempted_req_ids or set()
        finished = scheduler_output.finished_req_ids - preempted
        release, adopt = step_handovers(scheduler_output.kv_connector_metadata)
        self._nelssa_adopt.update(adopt)
        for rid, handle in release.items():  # P: finished (this step's finished ids have them too); released
            self.nelssa_handoff.handover(rid, handle, runtime.handed_over)  # after their moves (handover.py, 3)
            runtime.forget(rid)
        finished = finished - release.keys()
        for rid in finished | preempted:
            self._nelssa_adopt.pop(rid, None)
        for rid, (handle, h0) in step_adoptions(scheduler_output.kv_connector_metadata).items():
            if rid not in finished:  # a window admission (handover.py, 6): adopted now, while NIXL reads
                try:
                    self.nelssa_handoff.adopt(rid, handle, h0, runtime.fail)
                except Exception as e:  # noqa: BLE001 - this request fails loudly; others go on
                    runtime.fail(rid, f"adopting its hand-over: {type(e).__name__}: {e}")
        lane, recalls = self.nelssa_lane, self.nelssa_recalls
        recalls.forget(finished | preempted)  # dropped below as any other (their load waited for)
        recalls.start(step_recalls(scheduler_output.kv_connector_metadata), self.requests)  # recall.py, 2
        if lane is not None:  # before this step may reuse their blocks (lane.py, 6; lane_spec.py, 4)
            self._nelssa_lane_seed(step_seeds(scheduler_output.kv_connector_metadata), finished)
            lane.drop(preempted)    # vLLM frees a preempted request's blocks at once: its job waited for
            lane.release(finished)  # the scheduler keeps a finished one's until the lane is done with it
            lane.stale(step_host_ends(scheduler_output.kv_connector_metadata))
            if not scheduler_output.total_num_scheduled_tokens:
                lane.wait_any(0.002)  # nothing to run but busy lane rows: do not spin against the lane
            # their host KV goes now, their blocks after the report; recalled ones are the recall's (3)
            finished = recalls.released(lane.take_released())
        for rid in finished | preempted:
            self.nelssa_handoff.drop(rid, preempted=rid in preempted)
            host.free(rid)
            runtime.forget(rid)
        if lane is not None and finished:
            runtime.released(finished)
        recalls.poll()
        self._nelssa_so = scheduler_output
        timer = self.nelssa_step_timer
        started = timer.start() if timer is not None else None
        beside = "" if started is None else (  # what shared the device as it was enqueued (watchdog, 3)
            f", {self.nelssa_handoff.in_flight()} moves in flight"
            + (f", a lane batch of {lane.rows_running()} rows running" if lane is not None else ""))
        self._nelssa_lane_rows = 0
        try:
            return super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._nelssa_so = self._nelssa_step = None
            so = scheduler_output
            if lane is not None:  # what shared the device with its batches (lane.beside_bucket)
                lane.note_step(len(so.num_scheduled_tokens) - self._nelssa_lane_rows)
            if started is not None:
                timer.end(started, f"{len(so.num_scheduled_tokens)} requests, {so.total_num_scheduled_tokens} "
                                   f"tokens, {self._nelssa_lane_rows} lane rows{beside}")

    def _prepare_inputs(self, scheduler_output, *args, **kwargs):
        """vLLM's input preparation, then the step's plan (which rows are split, which the lane computed)
        and the lane rows shrunk in vLLM's own buffers (lane.py, 4): the step's graphs and attention
        metadata, built after this, see them as rows of one token that write no KV."""
        out = super()._prepare_inputs(scheduler_output, *args, **kwargs)
        if self.nelssa_host is not None and scheduler_output is self._nelssa_so:
            self._nelssa_step = self._nelssa_plan(scheduler_output)
            self._nelssa_shrink_lane_rows(self._nelssa_step[0])
        return out

    def _nelssa_shrink_lane_rows(self, plan: StepPlan) -> None:
        """Lane rows attend one token (their first block's first: a live block, no work proportional to
        their length; their output is replaced before the logits) and their token's KV slot is vLLM's
        pad slot -1 (the lane wrote that position: the step must not overwrite it)."""
        if not plan.lane_rows:
            return
        rows, toks = self._nelssa_lane_index(plan)
        self.seq_lens.index_fill_(0, rows, 1)
        self.optimistic_seq_lens_cpu.index_fill_(0, torch.tensor(plan.lane_rows, dtype=torch.long), 1)  # max_seq_len, CPU schedules
        self.input_batch.block_table[0].slot_mapping.gpu.index_fill_(0, toks, -1)

    def _nelssa_lane_index(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The lane rows' batch rows and token indices on the device, made once per step with one copy
        from pinned memory. Not a pageable copy: the CUDA driver stages those on its worker thread, the
        one that runs host functions, and while a lane batch's host attention ran there one layer after
        another the step's copy waited ~38 ms and the device stood idle (H200 profile, hol run 23)."""
        got = plan.cache.get("lane_index")
        if got is None:
            n = len(plan.lane_rows)
            d = to_device(torch.tensor(plan.lane_rows + plan.lane_tokens, dtype=torch.long), self.device)
            got = plan.cache["lane_index"] = (d[:n], d[n:])
        return got

    def _build_attention_metadata(self, *args, **kwargs):
        """CPU lane: vLLM's CPU attention builder sizes the process's one kernel scratchpad for the step
        (``cpu_attn_get_scheduler_metadata`` reallocates it, freeing the old buffer), the buffer the lane's
        oneDNN linears write while they run; so the step builds it under the dense lock (lane.py, 5; a no-op on
        CUDA)."""
        lane = self.nelssa_lane
        if lane is None:
            return super()._build_attention_metadata(*args, **kwargs)
        with lane.dense_lock:
            return super()._build_attention_metadata(*args, **kwargs)

    def _model_forward(self, *args, **kwargs):
        so, step = self._nelssa_so, self._nelssa_step
        if self.nelssa_host is None or so is None or step is None:  # stock, or a warm-up/profile run
            return super()._model_forward(*args, **kwargs)
        self._nelssa_step = None
        plan, moves = step
        set_plan(plan)
        self._nelssa_lane_rows = len(plan.lane_rows)
        if plan.lane_rows:  # the lane's logits of their positions (lane.py, 4)
            rows = [self.nelssa_lane.take(r, c) for r, c in zip(plan.cache["lane_rids"], plan.cache["lane_pos"])]
            if rows[0].is_cuda:  # made on the lane's stream, read on this one: not reused before that read
                for t in rows:
                    t.record_stream(torch.cuda.current_stream())
            self.get_model().nelssa_inject = (self._nelssa_lane_index(plan)[0], torch.stack(rows))
        t = time.perf_counter()
        try:  # CPU: the lane's dense parts wait while the step's forward runs (lane.py, 5)
            with self.get_model().nelssa_dense_lock:
                out = super()._model_forward(*args, **kwargs)
        finally:
            set_plan(None)
        if plan.lane_rows:
            self.nelssa_host.stats.add(lane_step_s=time.perf_counter() - t)
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
        switching = step_switching(so.kv_connector_metadata)
        rows, rids, tok, hend, seqs, moves = [], [], [], [], [], []
        lane, lrows, ltok, lrids, lpos, jobs = self.nelssa_lane, [], [], [], [], []
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
                # its switch step (lane.py, 0): a device row, blocks still held; the lane computes its next
                # position with the host range [sink, H) like an offloaded request's
                hj = h or (switching.get(rid, 0) if lane is not None and not failed else 0)
                if h:
                    if lane is not None and s == 1 and not failed and lane.ready(rid, c):
                        lrows.append(i), ltok.append(qpos), lrids.append(rid), lpos.append(c)  # computed by the lane
                    else:
                        rows.append(i), rids.append(rid), tok.append(qpos), hend.append(h), seqs.append(n)
                if hj:
                    if s != 1:
                        kind = "offloaded" if h else "switching"
                        bad[rid] = f"{kind} request scheduled {s} tokens in one step (1 supported)"
                    elif not failed:
                        try:
                            ho.ready(rid, hj)
                            if lane is not None:
                                jobs.append((rid, i, n, hj))  # its next position, after the sampling
                        except Exception as e:  # noqa: BLE001 - this request fails loudly; others go on
                            bad[rid] = f"hand-off of tokens up to {hj} to the host tier: {type(e).__name__}: {e}"
                # what should be on the host once this step has run: completed segments while a long
                # prompt prefills, then the policy's goal
                want = (pol.goal(a, n) if n >= a
                        else prefill_move_end(n, pol.goal(a, a), pol.sink, seg, self.nelssa_cfg.tail_piece))
                if want > ho.end(rid) and not failed:
                    moves.append((rid, ho.end(rid), want))
            qpos += s
        plan = StepPlan(self.nelssa_host, rids, rows, torch.tensor(tok, dtype=torch.long), hend, seqs)
        plan.failed.update(bad)
        plan.failed.update({r: runtime.failed[r] for r in rids if r in runtime.failed})
        plan.cache["block_size"] = self.cache_config.block_size
        plan.cache["dtype"] = self.model_config.dtype
        plan.graphs = self._nelssa_graphs
        plan.lane_rows, plan.lane_tokens, plan.cache["lane_rids"], plan.cache["lane_pos"] = lrows, ltok, lrids, lpos
        self._nelssa_jobs = [j for j in jobs if j[0] not in bad]
        return plan, moves

    def _sample(self, *args, **kwargs):
        out = super()._sample(*args, **kwargs)
        jobs, self._nelssa_jobs = self._nelssa_jobs, []
        if jobs and self.nelssa_lane is not None:
            self._nelssa_lane_submit(jobs, out.sampled_token_ids)
        return out

    def _nelssa_lane_submit(self, jobs, sampled: torch.Tensor) -> None:
        """Queue the lane jobs of this step's offloaded rows (lane.py, 2): their sampled tokens as input;
        with drafts (lane_spec.py) also, on CUDA, those tokens in pinned memory for the lane's check (a CPU
        token is read as it is), and a drafting request's whole block row (the slots allocated ahead)."""
        from nelssa.vllm_plugin.lane import Job
        from nelssa.vllm_plugin.lane_spec import argmax_kept, drafts_ok
        ev = torch.cuda.Event() if sampled.is_cuda else None
        table = self.input_batch.block_table[0]
        bt, nbr = table.block_table.np, table.num_blocks_per_row  # the rows this step's inputs were made from
        bs = self.cache_config.block_size
        spec = self.nelssa_cfg.lane_spec and argmax_kept(self.input_batch.logitsprocs)
        th = torch.empty(len(jobs), dtype=torch.long, pin_memory=True) if spec and sampled.is_cuda else None
        out = []
        for k, (rid, row, pos, h) in enumerate(jobs):
            st = self.requests[rid]
            sp = st.sampling_params
            # the last position whose logits the request needs: its last token (max_tokens, or the model's
            # length) is sampled from the one before it
            last = min(st.num_prompt_tokens + (sp.max_tokens or self.max_model_len), self.max_model_len) - 2
            if rid in runtime.failed or pos > last:  # failed, or this step sampled its last token
                continue
            tok = sampled[row, :1].to(torch.long, copy=True)
            greedy = spec and drafts_ok(sp)
            if th is not None:
                th[k:k + 1].copy_(tok, non_blocking=True)
            stops = frozenset()
            if greedy:  # where its chain of drafts ends besides ``last`` (lane_spec.py, 2)
                stops = frozenset(t for t in (sp.eos_token_id, *(sp.stop_token_ids or ())) if t is not None)
            out.append(Job(rid, pos, h, tok, bt[row, :pos // bs + 1].copy(), ev, greedy=greedy,
                           alloc=bt[row, :nbr[row]].copy() if greedy else None, last=last, stops=stops,
                           token_host=(th, k) if th is not None else None))
        if ev is not None and out:  # the token copies above ran on this stream: record after them
            ev.record()
        self.nelssa_lane.submit(out)

    def _nelssa_lane_seed(self, seeds: dict, finished: set) -> None:
        """Queue the lane jobs of window admissions' first positions (handover.py, 6): the prompt's last
        token at its position, with H0 and the block ids the scheduler allocated (the window's KV is
        in: NIXL read it, and the node holds [sink, H0)). Not scheduled yet, these requests are not in
        this runner's batch; the step that schedules one finds its position computed (a lane row). The
        same for a long prompt held for its switch (scheduler._seed_switch): its sampled token at its
        next position, with its first H (its moves done: ``ready`` commits them)."""
        from nelssa.vllm_plugin.lane import Job
        ev = torch.cuda.Event() if self.device.type == "cuda" else None
        jobs = []
        for rid, (pos, h0, tok, blocks) in seeds.items():
            if rid in finished or rid in runtime.failed:
                continue
            try:
                self.nelssa_handoff.ready(rid, h0)  # the adoption (reported) committed: the lane reads it
            except Exception as e:  # noqa: BLE001 - this request fails loudly; others go on
                runtime.fail(rid, f"its adopted hand-over up to {h0}: {type(e).__name__}: {e}")
                continue
            jobs.append(Job(rid, pos, h0, torch.full((1,), tok, dtype=torch.long, device=self.device),
                            np.asarray(blocks, dtype=np.int32), ev))
        if ev is not None and jobs:  # the tokens made on this stream above: record after them
            ev.record()
        self.nelssa_lane.submit(jobs)

    def _nelssa_submit(self, moves: list[tuple[str, int, int]], plan: StepPlan) -> None:
        """Hand off the new ranges in the background (after this step's forward was launched)."""
        todo = [(rid, list(self.requests[rid].block_ids[0]), lo, hi) for rid, lo, hi in moves
                if rid not in plan.failed]
        try:
            self.nelssa_handoff.submit(todo, self._nelssa_adopt)
        except Exception as e:  # noqa: BLE001
            for rid, _, _, hi in todo:
                plan.fail(rid, f"handing off tokens up to {hi}: {type(e).__name__}: {e}")
