"""The long lane: offloaded requests decode apart from the step, so short requests never wait for the
host tier (config ``lane``; the paper's "the long request rejoins the next available batch").

Without it a step that carries an offloaded row waits, layer by layer, for that row's host attention,
and every short row of the step waits with it. With it:

  0. The switch (NelssaScheduler, with the lane): a request's first host range H is sent as
     ``switching`` for one step. It keeps its device blocks and that step computes it like any row;
     after the step's sampling its first job is queued (2) with H, and H is in use (the blocks
     below it freed) from the next scheduling on. So the switch is not a split step: no step of the
     engine waits for the host tier.
  1. Scheduler (NelssaScheduler): a request scheduled with its host range in use (H > 0) enters the
     lane after that step and is not scheduled again until the worker reports its next position
     computed (``busy``). A busy request is not a preemption candidate either (it holds only its
     window; vLLM picks among the others), also under priority scheduling. vLLM allocates one slot
     ahead for every request (``num_lookahead_tokens`` >= 1), so the slot of the lane's position
     exists when the lane writes it. H of a busy request does not move, so the KV-cache manager
     frees none of the blocks the lane reads.
  2. Worker, after the step's sampling (runner ``_sample``): for each such row a job (request,
     position p = its tokens with KV after the step, input token = the step's sampled token on the
     device, its block-table row, H) is queued here; the step itself does not wait.
  3. Lane thread (its own CUDA stream; waits for the sampling by an event): batches the queued jobs
     (waiting up to ``lane_gather_ms`` for requests it reported to come back, so the long requests
     stay in one batch: one host submission per layer, one captured centroid search) and runs the
     decoder layers for their rows with vLLM's modules: norm -> qkv -> rope -> KV write at p's
     slot -> split attention (window on the device + the host tier over the selected
     clusters, ``attention.split_attention``, the same code as a split step) -> o_proj -> MLP; the
     final norm and vLLM's lm_head and logits processor give each row's logits. After the stream is
     done: reported (request -> p) through the NELSSA connector; the scheduler clears ``busy``.
  4. The step that schedules a request at the reported position is a "lane row", shrunk where vLLM
     prepares the step's inputs (runner ``_prepare_inputs``): its sequence length is 1 (it attends a
     live block's first token, no work proportional to its length) and its token's KV slot is the
     pad slot -1 (the lane wrote p), so the step runs like any decode step — on its full CUDA graph
     when no row of it is split. Its logits are the lane's (NelssaLlamaForCausalLM.compute_logits),
     so vLLM samples it like any row (sampling parameters, logprobs, stop conditions). Then 2 again.
  5. CPU: vLLM's CPU kernels share one process-wide scratchpad (its oneDNN linear layers, its
     attention), and the CPU attention builder reallocates it (frees the old buffer) when a step needs
     more; so the lane's dense parts and the step's attention-metadata build, forward and logits (its
     lm_head is such a linear) take turns (``dense_lock``; CUDA needs none). Without the logits in it,
     a lane batch's o_proj/MLP and the step's lm_head overlapped: NaN in both (seen on an Intel Xeon:
     lane requests failed, short ones answered garbage); without the metadata build, a lane batch's
     lm_head wrote into the freed buffer: heap corruption (CI: "malloc(): unsorted double linked list
     corrupted"; with glibc's malloc checks, a SIGSEGV in the lane's lm_head on the first run).
  6. A request finished while its job runs: the job is cancelled and the step goes on (``release``);
     the scheduler keeps the request's blocks out of vLLM's pool, and the runner its host KV, until the
     job has ended (NelssaScheduler._free_request_blocks; reported through the connector as
     ``released``). A preempted request (vLLM frees its blocks at once): the runner waits for its job
     (``drop``) before the step that may reuse them. A failing job fails its requests (runtime.fail):
     they finish with an error, never with text from a failed attention.
  7. Drafts (config ``lane_spec``, lane_spec.py): after a batch the lane also takes the argmax of its
     greedy rows' logits and computes their next position at once, its result published like any
     job's; the step's job for that position (4 -> 2) is only checked against it, so neither the lane
     nor the request waits for a step between two tokens: every step can sample one of its tokens.
Without the lane the switch step and every later one are split steps (attention.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nelssa._ext import ext
from nelssa.vllm_plugin import lane_host, lane_inputs, runtime, sm_split, uva
from nelssa.vllm_plugin.attention import StepPlan, split_attention
from nelssa.vllm_plugin.lane_graphs import CaptureFailed, DenseGraphs, call_op, post_attention, pre_attention
from nelssa.vllm_plugin.lane_spec import Drafts

log = logging.getLogger("vllm.nelssa")

WARM_SIZES = (1, 2, 3, 4)  # lane batch sizes whose dense graphs are captured at engine start (CUDA)
BESIDE = ("0", "1-15", "16-47", "48+")  # a lane batch by the mean requests of the engine steps run beside it


def beside_bucket(steps: int, rows: int) -> str:
    """The BESIDE label of a lane batch during which the engine ran ``steps`` steps computing ``rows``
    requests in all (lane rows not counted): how many of the steps' rows shared the device with it. A long
    token took 30-33 ms with nothing beside it and ~50 ms beside ~50 decoding requests (H100 hol runs
    74/75); this splits one run's lane batches the same way (nelssa:lane_beside_seconds)."""
    mean = rows / steps if steps else 0.0
    return "0" if mean < 0.5 else "1-15" if mean < 15.5 else "16-47" if mean < 47.5 else "48+"


@dataclass
class Job:
    req_id: str
    pos: int                 # the position the lane computes (its input token's)
    host_end: int            # H: the host holds [sink, H) for this job
    token: torch.Tensor      # [1] int64 input token id (device; valid after ``event``)
    blocks: Any              # [nb] int32 numpy: the request's block-table row (vLLM's host copy)
    event: Any = None        # CUDA event after the step's sampling (None on CPU)
    # drafts (lane_spec.py)
    greedy: bool = False     # the request drafts (lane_spec.drafts_ok)
    alloc: Any = None        # a step's job of a drafting request: its whole block row (the slots allocated ahead)
    last: int = -1           # the last position its request needs (-1: not known), and its stop tokens
    stops: frozenset = frozenset()
    token_host: Any = None   # CUDA: (pinned int64 tensor, index), ``token`` on the host once ``event`` is done
    draft: bool = False      # a draft (its input token the lane's argmax)
    token_value: int = -1    # a draft's input token


class _Window:
    """The attention metadata the split attention reads for lane rows: their block tables."""

    def __init__(self, block_table: torch.Tensor):
        self.block_table = block_table


class Lane:
    def __init__(self, model, attn_layers: list, host, cfg, block_size: int, dtype, device: torch.device):
        self.model, self.layers, self.host, self.cfg = model, attn_layers, host, cfg
        self.decoder = list(model.model.layers)
        if len(self.decoder) != len(attn_layers):
            raise ValueError("the lane needs one NELSSA attention layer per decoder layer")
        self.bs, self.dtype, self.device = block_size, dtype, device
        self.cuda = device.type == "cuda"
        # held by the step's forward and logits and the lane's dense parts on CPU (5); reentrant, so logits
        # computed within a wrapped forward cannot deadlock; a no-op lock on CUDA
        self.dense_lock = threading.RLock() if not self.cuda else contextlib.nullcontext()
        # one priority above the step's stream (cfg.step_priority): the lane's few kernels per layer go ahead
        # of the step's queued blocks, so the host tier gets each layer's queries sooner
        # (config lane_sms: streams of the lane's own SMs, sm_split.py 2)
        prio = cfg.step_priority - 1

        def stream():
            return sm_split.lane_stream(device, prio) or torch.cuda.Stream(device, priority=prio)
        self.stream = stream() if self.cuda else None
        # the host tier's calls and their results' copies (lane_host.py, 2); with lane_chain the lane's own
        # stream: a batch is one chain (lane_host.py, 3)
        self.host_stream = (self.stream if cfg.lane_chain else stream()) if self.cuda else None
        self._host_buffers = lane_host.Buffers()  # pinned buffers of lane_host batches, reused across batches
        self._staging: dict = {}        # lane_inputs.Staging of batches not replayed, per shape
        self._batch: lane_host.HostStreamBatch | None = None  # the running batch's, when it runs that way
        self.graphs = self.dense = None
        if self.cuda and cfg.graphs:
            from nelssa.vllm_plugin.select_graph import SelectGraphs
            self.graphs = SelectGraphs()  # its own: the step's split layers replay theirs concurrently
            self.dense = DenseGraphs(model, self.decoder, attn_layers)  # lane_graphs.py
        self.batch_graphs = None
        if self.cuda and cfg.graphs and cfg.lane_host_calls and cfg.lane_batch_graph:
            from nelssa.vllm_plugin.lane_batch import BatchGraphs
            self.batch_graphs = BatchGraphs(model, self.decoder, attn_layers, cfg, block_size)  # lane_batch.py
        self._cv = threading.Condition()
        self._steps = [0, 0]  # the engine's steps and the requests they computed, lane rows not counted (note_step)
        self._parts: dict | None = None  # lane thread: the last batch's timeline (lane_host.py, 7), for its log line
        self._queue: list[Job] = []
        self._running: set[str] = set()
        self._cancel: set[str] = set()
        self._ready: dict[str, dict[int, torch.Tensor]] = {}  # request -> {computed position: its logits [V]}
        self._reported: dict[str, int] = {}
        self._awaiting: set[str] = set()  # reported, their next job not yet queued
        self._running_drafts: set[str] = set()  # requests whose running job is a draft (lane_spec.py)
        self._checks: list[Job] = []  # step jobs of drafted positions, checked once their step has sampled
        self._releasing: set[str] = set()  # finished requests whose running job was cancelled (6)
        self._released: set[str] = set()   # finished requests with no job running any more (6)
        self._gather_s = cfg.lane_gather_ms / 1e3
        self.drafts = Drafts(block_size) if cfg.lane_spec else None  # lane_spec.py
        self._logits_end = torch.cuda.Event() if self.cuda else None  # a replayed batch's end after its logits
        self._blas_warm = False
        self._calls: list = []  # functions to run on the lane thread (_on_thread)
        self._thread = threading.Thread(target=self._loop, name="nelssa-lane", daemon=True)
        self._thread.start()

    def warm(self, max_len: int) -> None:
        """CUDA: capture the dense graphs of small batches now, with the engine's own graphs
        (lane_graphs.py, 4), so the first lane batches of a long request do not capture; and pin the
        host calls' buffers for those batches of requests up to ``max_len`` tokens (lane_host.Buffers)."""
        if self.dense is None:
            return
        t = time.perf_counter()
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            self.dense.warm(WARM_SIZES, self.device)
            self._warm_kernels()
        self.stream.synchronize()
        self._on_thread(self._warm_blas)  # its handles now, not in the first long token's gap
        pinned = self._reserve_buffers(max_len) if self.cfg.lane_host_calls else 0  # (lane_host.batch's)
        mod = ext()
        if self.batch_graphs is not None and self.cfg.lane_host_wait == "flags" and mod is not None:
            # the host calls' flags now, outside any capture, so the lane's first batch may be captured
            # (lane_batch.py, 2; csrc/flag_wait.cpp, 1a)
            if not mod.make_host_call_flags():
                raise RuntimeError("NELSSA lane: the host calls' flags are not device-mapped (no CUDA context at "
                                   "engine start): every host call would fail")
            self.batch_graphs.flags_made = True
        log.info("NELSSA lane: dense graphs for %s rows captured, the split attention's Triton kernels "
                 "compiled and %.1f MiB of the host calls' pinned buffers allocated in %.2f s", list(WARM_SIZES),
                 pinned / 2**20, time.perf_counter() - t)

    def _reserve_buffers(self, max_len: int) -> int:
        from nelssa.vllm_plugin.select_graph import id_width
        impl, cfg = self.layers[0].impl, self.cfg
        bound = id_width(cfg.budget, max_len, -(-max_len // cfg.cluster_size))  # a request of the model's length
        return self._host_buffers.reserve_for([a.nelssa_layer for a in self.layers], max(WARM_SIZES), impl.num_heads,
                                              impl.num_kv_heads, impl.head_size, self.dtype, bound)

    def _warm_kernels(self) -> None:
        """Compile the Triton kernels of the split attention now (the centroid search of select_kernel.py
        and the merge), on dummy inputs of the model's shapes and dtypes: compiled on the lane thread at
        its first batch, they held the GIL ~350 ms (H200, run 16: every short request's token waited). A
        failure here is only logged: the first batch then compiles them."""
        from nelssa.sparse import cluster_kv, select_clusters
        from nelssa.vllm_plugin.merge_kernel import merge_into
        impl = self.layers[0].impl
        hq, h, d, dev = impl.num_heads, impl.num_kv_heads, impl.head_size, self.device
        try:
            kv = torch.randn(h, 256, d, device=dev).to(self.dtype)
            ckv = cluster_kv(kv, kv, seed=0, cluster_size=8)
            q = torch.randn(2, hq, d, device=dev).to(self.dtype)
            sel = select_clusters(q, [ckv, ckv], 0.25, impl.scale, estimate=self.cfg.estimate, device_out=True)
            out = torch.empty(2, hq, d, dtype=self.dtype, device=dev)
            win = (torch.zeros(2, hq, d, dtype=self.dtype, device=dev), torch.zeros(hq, 2, device=dev).t())
            host = (torch.zeros(2, hq, d, device=dev), torch.zeros(2, hq, device=dev))
            tok = torch.arange(2, device=dev)
            est = [sel.estimate] if sel.estimate is not None else []
            merge_into(out, tok, [win, *est, host])          # the usual window: one FlashAttention call
            merge_into(out, tok, [win, win, *est, host])     # sink and recent apart
            if uva.available():  # the lane's transfers through pinned memory (uva.py), each dtype they move
                for dt in {torch.int64, torch.int32, torch.float32, self.dtype}:
                    src = torch.zeros(2, 3, dtype=dt, device=dev)
                    pinned = torch.zeros(2, 3, dtype=dt, pin_memory=True)
                    uva.copy(src, uva.view(pinned))
                    uva.copy(uva.view(pinned), src)
        except Exception as e:  # noqa: BLE001 - a warm-up only
            log.warning("NELSSA lane: compiling the split attention's kernels at start-up failed (%s: %s); the "
                        "first lane batch compiles them", type(e).__name__, e)

    # ------------------------------------------------------------ step thread
    def submit(self, jobs: list[Job]) -> None:
        if not jobs:
            return
        with self._cv:
            for j in jobs:
                self._awaiting.discard(j.req_id)
            self._queue.extend(jobs)
            self._cv.notify_all()

    def ready(self, req_id: str, pos: int) -> bool:
        with self._cv:
            return pos in self._ready.get(req_id, ())

    def take(self, req_id: str, pos: int) -> torch.Tensor:
        """The logits of the request's position ``pos`` (a step samples from them); earlier ones forgotten."""
        with self._cv:
            r = self._ready[req_id]
            for p in [p for p in r if p < pos]:
                del r[p]
            return r.pop(pos)

    def note_step(self, rows: int) -> None:
        """Step thread, once per step: the step computed ``rows`` requests besides the lane's rows (the lane
        reads the counts around each batch: beside_bucket)."""
        steps, total = self._steps
        self._steps = [steps + 1, total + rows]  # one assignment: the lane thread reads a consistent pair

    def drop(self, req_ids) -> None:
        """Forget these requests (preempted: vLLM frees their blocks at once; finished ones go through
        ``release``): queued jobs removed, a running job cancelled and waited for, so nothing of the lane
        writes their blocks after this returns."""
        ids = set(req_ids)
        if not ids:
            return
        with self._cv:
            self._forget(ids)
            self._wait_out(ids)
        if self.batch_graphs is not None:  # their graphs hold their host KV (lane_batch.py, 1)
            self.batch_graphs.forget(ids)

    def release(self, req_ids) -> None:
        """Step thread: finished requests forgotten as by ``drop``, but a running job is only cancelled, not
        waited for (6): they are ``released`` once it has ended."""
        ids = set(req_ids)
        if not ids:
            return
        with self._cv:
            self._forget(ids)
            running = self._cancel_running(ids)
            self._releasing |= running
            self._released |= ids - running
        if running:
            self.host.stats.add(lane_finish_cancels=len(running))

    def rows_running(self) -> int:
        """Rows of the lane batch running now, 0 between batches (a snapshot for the step log)."""
        return len(self._running)

    def take_released(self) -> set[str]:
        """Step thread: the finished requests no job of the lane runs for any more (6), their graphs forgotten:
        their host KV and device blocks can go."""
        with self._cv:
            out, self._released = self._released, set()
        if out and self.batch_graphs is not None:
            self.batch_graphs.forget(out)
        return out

    def _forget(self, ids: set) -> None:
        """(Under the lock.) Queued jobs, results, reports, drafts and checks of these requests gone."""
        self._queue = [j for j in self._queue if j.req_id not in ids]
        for r in ids:
            self._ready.pop(r, None)
            self._reported.pop(r, None)
        self._awaiting -= ids
        self._checks = [j for j in self._checks if j.req_id not in ids]
        if self.drafts is not None:
            self.drafts.drop(ids)
        self._cv.notify_all()  # a gather waiting for them (_gathering) stops

    def _cancel_running(self, ids: set) -> set:
        """(Under the lock.) A running job of these requests cancelled (its results not kept; when every
        request of the running batch is, the batch's host calls not yet run return at once, lane_host.py,
        5) -> the requests of ``ids`` with a job running."""
        running = ids & self._running
        self._cancel |= running
        if self._batch is not None and self._running and self._cancel >= self._running:
            self._batch.cancel()
        return running

    def _settle(self) -> None:
        """(Under the lock.) Released requests whose cancelled job is no longer running (6)."""
        done = self._releasing - self._running
        if done:
            self._releasing -= done
            self._released |= done
            self._cancel -= done

    def _wait_out(self, ids: set) -> None:
        """(Under the lock.) A running job of these requests cancelled and waited for: its results are not
        kept, and nothing of it runs after this returns."""
        self._cancel_running(ids)
        while self._running & ids:
            self._cv.wait(0.1)
        self._cancel -= ids

    def stale(self, host_ends: dict[str, int]) -> None:
        """Step thread, before a step's forward: drafts that use another host range H than this step's are
        dropped, a running one waited for, and their published results past the position this step takes
        (the request's first one: positions are taken in order) discarded (lane_spec.py, 4)."""
        if self.drafts is None or not host_ends:
            return
        with self._cv:
            ids = self.drafts.stale(host_ends)
            if ids:
                self._queue = [j for j in self._queue if not (j.draft and j.req_id in ids)]
                self._checks = [j for j in self._checks if j.req_id not in ids]
                self._cv.notify_all()
                self._wait_out(ids & self._running_drafts)
                for rid in ids:
                    r = self._ready.get(rid)
                    if r:
                        first = min(r)
                        self._ready[rid] = {first: r[first]}
                        if rid in self._reported:
                            self._reported[rid] = first

    def wait_any(self, timeout: float) -> None:
        """Block (without the GIL) until a job ends or ``timeout`` passes: an engine step with nothing
        to schedule but busy requests does not spin against the lane thread. With no job either (the
        requests wait for a hand-off: a switch, a recall's load) the step sleeps for half of it, so it
        does not spin against the hand-off's thread."""
        with self._cv:
            if self._queue or self._running:
                self._cv.wait(timeout)
                return
        time.sleep(timeout / 2)

    def take_reports(self) -> dict[str, int]:
        with self._cv:
            out, self._reported = self._reported, {}
        return out

    # ------------------------------------------------------------ lane thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    if self._calls:
                        break
                    self._check_drafts()
                    self._cv.wait(0.01 if self._checks else None)
                calls, self._calls = self._calls, []
            for call in calls:
                call()
            with self._cv:
                if not self._queue:
                    continue
                end = time.monotonic() + self._gather_s
                while self._gathering() and time.monotonic() < end:
                    self._cv.wait(max(0.0, end - time.monotonic()))
                jobs, self._queue = self._queue, []
                self._running = {j.req_id for j in jobs}
            if self.drafts is not None:
                jobs = self._accept(jobs)
                if not jobs:
                    continue
            t0 = time.perf_counter()
            steps0, rows0 = self._steps
            nxt, self._parts = None, None
            try:
                logits, failed, nxt = self._run(jobs)
            except Exception as e:  # noqa: BLE001 - these requests fail loudly; the lane goes on
                log.exception("NELSSA lane: a job batch failed")
                logits, failed = None, {j.req_id: f"lane: {type(e).__name__}: {e}" for j in jobs}
            dt = time.perf_counter() - t0
            path = self.batch_graphs.path if self.batch_graphs is not None else ""
            if self.batch_graphs is not None:
                self.batch_graphs.ended()
            if self.cfg.stall_log_ms > 0 and (dt * 1e3 > self.cfg.stall_log_ms / 2 or path not in ("", "replay")):
                parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in (self._parts or {}).items())
                if parts:  # a captured batch's lead holds its capture
                    parts = f" ({parts} ms{'; the capture is in the lead' if path == 'captured' else ''})"
                log.info("NELSSA lane: batch of %d rows (%s) ran t=%.3f..%.3f: %.0f ms%s", len(jobs), path or "-",
                         t0, t0 + dt, dt * 1e3, parts)
                # perf_counter: the clock of the watchdog and the hol stamps
            with self._cv:
                for i, j in enumerate(jobs):
                    if j.draft:
                        self.drafts.finished(j)
                    if j.req_id in self._cancel:
                        continue
                    if j.req_id in failed:
                        log.error("NELSSA: request %s fails in the lane: %s", j.req_id, failed[j.req_id])
                        runtime.fail(j.req_id, failed[j.req_id])
                    elif logits is not None:
                        row = (nxt[0][i:i + 1], int(nxt[1][i])) if nxt is not None else None  # its argmax
                        d = self._publish(j, logits[i], row)
                        if d is not None:
                            self._queue.append(d)
                self._check_drafts()
                self._running = set()
                self._running_drafts = set()
                self._settle()
                self._cv.notify_all()
            steps, rows = self._steps
            beside = beside_bucket(steps - steps0, rows - rows0)
            self.host.stats.add(lane_batch_s=dt, lane_rows=len(jobs), lane_beside_s={beside: dt},
                                lane_beside_n={beside: 1})
            if self.drafts is not None:
                with self._cv:
                    counts = self.drafts.take_counts()
                if counts:
                    self.host.stats.add(lane_drafts=counts)

    def _gathering(self) -> bool:
        """(Under the lock.) Whether a request the lane reported without a draft has no job queued yet. The lane
        waits for them (up to ``lane_gather_ms``) so that the long requests stay in one batch: a batch's
        cost hardly grows with its rows (H200 runs 47/48: a host call 0.77 ms at 1.22 rows per batch, 0.85
        at 1.45). Drafting requests do not wait for anything (lane_spec.py): their drafts follow their
        batch at once, so two of them stay in one batch once they have met in one."""
        return bool(self._awaiting)

    def _publish(self, j: Job, logits: torch.Tensor, nxt) -> Job | None:
        """(Under the lock.) ``j``'s position computed: reported to the scheduler. With drafts -> the next
        position's draft from ``nxt`` (its argmax on the device, its value), for the caller to run; without
        one the lane waits for the request's next job before a batch without it (the gather)."""
        self._ready.setdefault(j.req_id, {})[j.pos] = logits
        self._reported[j.req_id] = j.pos
        d = self.drafts.chain(j, *nxt) if self.drafts is not None and nxt else None
        if d is None and not (nxt and self.drafts.last(j, nxt[1])):  # else the request ends here
            self._awaiting.add(j.req_id)
        return d

    def _accept(self, jobs: list[Job]) -> list[Job]:
        """The step's jobs against the drafts (lane_spec.py, 3) -> the jobs to run: the step's jobs of positions
        not drafted, the drafts still queued and drafts that waited for a step's block row. The step's jobs
        of drafted positions are checked later (``_check_drafts``), without waiting for their steps here."""
        with self._cv:
            out = []
            for j in jobs:
                if j.draft:
                    if self.drafts.queued.get(j.req_id) is j:  # not dropped as stale meanwhile (lane_spec.py, 4)
                        out.append(j)
                    continue
                if j.req_id in self._cancel:
                    continue
                checked, d = self.drafts.accept(j)
                if checked:
                    self._checks.append(j)
                else:
                    out.append(j)
                if d is not None:
                    out.append(d)
            self._check_drafts()
            out.sort(key=lambda j: j.req_id)  # one order per request set (lane_batch.py's key)
            # running from here on, in the same hold of the lock as the check above: a step that finds a
            # draft stale (lane_spec.py, 4) either removed it before this or waits for it to end
            self._running = {j.req_id for j in out}
            self._running_drafts = {j.req_id for j in out if j.draft}
            self._settle()
            self._cv.notify_all()
        return out

    def _check_drafts(self) -> None:
        """(Under the lock.) The step's jobs of drafted positions whose steps have sampled: their tokens against
        the drafts' (lane_spec.py, 3); a mismatch fails the request."""
        if not self._checks:
            return
        left = []
        for j in self._checks:
            tok = self._sampled_token(j)
            if tok is None:
                left.append(j)
            elif not self.drafts.check(j, tok):
                msg = (f"lane: the step sampled another token at position {j.pos} than the lane's draft, the argmax "
                       f"of the same logits (a logits processor that moves the argmax?)")
                log.error("NELSSA: request %s fails: %s", j.req_id, msg)
                runtime.fail(j.req_id, msg)  # its published results stay until it ends: a step may be taking one
                self.drafts.drop((j.req_id,))
        self._checks = left

    @staticmethod
    def _sampled_token(j: Job) -> int | None:
        """The step's sampled token of ``j`` on the host, or None while its step has not sampled it (CUDA)."""
        if j.token_host is None:
            return int(j.token.reshape(-1)[0])
        if j.event is not None and not j.event.query():
            return None
        buf, i = j.token_host
        return int(buf[i])

    def _on_thread(self, fn, timeout_s: float = 120.0) -> None:
        """Run ``fn`` on the lane thread (between its batches) and wait for it; its exception is raised here, and
        so is a lane thread that does not run it within ``timeout_s``. For what is per thread (``_warm_blas``),
        called at engine start while no graph is being captured."""
        done, err = threading.Event(), []

        def call():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
                err.append(e)
            finally:
                done.set()
        with self._cv:
            self._calls.append(call)
            self._cv.notify_all()
        if not done.wait(timeout_s):
            raise RuntimeError(f"NELSSA lane: its thread did not run {getattr(fn, '__name__', fn)} within "
                               f"{timeout_s:.0f} s (alive: {self._thread.is_alive()})")
        if err:
            raise err[0]

    def _warm_blas(self) -> None:
        """CUDA, once, on the lane thread and stream (at engine start: ``warm``): cuBLAS and cuBLASLt handles
        are per thread and their workspaces per stream, made lazily by the first matmul. Made inside a
        capture (lane_batch.py) that fails with CUBLAS_STATUS_NOT_INITIALIZED (H200, run 15: every batch
        capture failed once the centroid search stopped running torch matmuls on this thread)."""
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            for dtype in {self.dtype, torch.float32}:
                x = torch.ones(2, 16, dtype=dtype, device=self.device)
                w = torch.ones(8, 16, dtype=dtype, device=self.device)
                torch.nn.functional.linear(x, w)
                torch.nn.functional.linear(x, w, torch.ones(8, dtype=dtype, device=self.device))
                torch.bmm(x.unsqueeze(0), w.t().unsqueeze(0))
        self.stream.synchronize()
        self._blas_warm = True

    def _run(self, jobs: list[Job]) -> tuple[torch.Tensor | None, dict[str, str], tuple | None]:
        """The batch -> (the rows' logits [n, V] or None when cancelled, failures by request, with drafts the
        argmax of the rows' logits: (on the device [n], on the host [n]) or None)."""
        n = len(jobs)
        with torch.inference_mode(), (torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()):
            if self.cuda and not self._blas_warm:  # (a lane not warmed at engine start)
                self._warm_blas()
            if self.cuda:  # the steps that sampled the batch's tokens (one event per step)
                for e in {id(j.event): j.event for j in jobs if j.event is not None}.values():
                    self.stream.wait_event(e)
            inp = lane_inputs.build(jobs, self.bs)  # numpy: no torch operation (lane_inputs.py, 2)
            ids = torch.cat([j.token for j in jobs])
            plan = StepPlan(self.host, [j.req_id for j in jobs], list(range(n)),
                            torch.from_numpy(np.arange(n)), inp.host_end, inp.seq_lens)
            plan.cache["block_size"], plan.cache["dtype"] = self.bs, self.dtype
            plan.graphs = self.graphs
            batch = None
            if self.cuda and self.graphs is not None and self.cfg.lane_host_calls:
                batch = lane_host.batch(self.host, self.layers[0].impl, self.stream, self.host_stream,
                                        self._host_buffers)
            with self._cv:
                self._batch = batch
            t0 = time.perf_counter()
            h = end = nxt = logits = None
            try:
                replayed = None
                if batch is not None and self.batch_graphs is not None:  # one replay (lane_batch.py)
                    n0, f0 = self.batch_graphs.captures, self.batch_graphs.failures
                    ends = [j.last - j.pos for j in jobs if j.last >= 0]
                    replayed = self.batch_graphs.run(self, plan, inp, ids, min(ends) if ends else -1)
                    self.host.stats.add(lane_captures=self.batch_graphs.captures - n0,
                                        lane_capture_failures=self.batch_graphs.failures - f0,
                                        lane_paths={self.batch_graphs.path: 1})
                if replayed is None:  # this batch's tensors on the device: one copy per dtype
                    ids, pos, slots, md = self._device_inputs(inp, ids, plan)
                if replayed is not None:
                    h, batch, end = replayed
                    with self._cv:
                        self._batch = batch
                    if self._cancel >= set(plan.req_ids):
                        batch.cancel()
                    plan.split["replay"] = time.perf_counter() - t0
                elif self.dense is not None and self.dense.use(n):
                    try:
                        h = self.dense.run(ids, pos, slots,
                                           lambda i, q, out: self._attend(self.layers[i], q, out, md, plan),
                                           lambda: self._cancel >= set(plan.req_ids))
                        if h is None:
                            return None, {}, None
                    except CaptureFailed:  # logged; this size runs eagerly from now on (lane_graphs.py, 5)
                        plan.split.clear()
                        h = None
                if h is None:
                    h = self._eager(ids, pos, slots, md, plan)
                    if h is None:
                        return None, {}, None
                if replayed is None:
                    plan.split["dense"] = max(0.0, time.perf_counter() - t0 - sum(plan.split.values()))
                logits = self._logits(h)  # the result (3; lane_spec.py, 1)
                if self.drafts is not None and any(j.greedy for j in jobs):  # lane_spec.py, 2
                    nxt = self._argmax(logits)
                if end is not None:  # the replay's end event came before these: the one wait covers them
                    end = self._logits_end
                    end.record(self.stream)
            finally:
                if self.cuda:  # also on failure: nothing of the batch may still run (lane_host.py, 4)
                    t = time.perf_counter()
                    # bounded by the host tier's deadline (lane_host.HostStreamBatch.wait); when it returns
                    # True both streams are done (its event follows the host stream's work on the lane
                    # stream), and each further synchronize would release the GIL and wait to get it back
                    # behind the step thread
                    if batch is None or not batch.wait(self.cfg.host_timeout_s, end):
                        self.stream.synchronize()
                        self.host_stream.synchronize()
                    if batch is not None:  # the batch's one wait for the device and the host tier
                        plan.lap("wait", t)
                waited = time.perf_counter()
                with self._cv:
                    self._batch = None
                if batch is not None:
                    err = batch.finish(self.host, t0, waited)  # with its timeline (lane_host.py, 7)
                    self._parts = batch.parts  # for the slow batch's log line (_loop)
                    if err is not None:
                        for r in plan.req_ids:
                            plan.fail(r, f"host tier: {err}")
        self.host.stats.add(lane_split_s=plan.split)
        return logits, dict(plan.failed), nxt

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The rows' logits from their final hidden states: vLLM's lm_head and logits processor (not the model's
        compute_logits: that one writes the lane's rows into the step's)."""
        with self.dense_lock:
            return self.model.logits_processor(self.model.lm_head, h)

    def _argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' next tokens as greedy sampling picks them from these logits (lane_spec.py, 2), on the
        device and copied to pinned memory (read after the batch's wait)."""
        nxt = logits.argmax(dim=-1)
        host = torch.empty(nxt.shape, dtype=torch.long, pin_memory=self.cuda)
        host.copy_(nxt, non_blocking=True)
        return nxt, host

    def _device_inputs(self, inp: lane_inputs.LaneInputs, ids: torch.Tensor, plan: StepPlan):
        """(ids, positions, KV slots, window metadata) of a batch that is not replayed, on the device; the
        token index in ``plan.cache`` (lane_inputs.py, 3)."""
        shapes = lane_inputs.shapes(inp)
        key = tuple((k, v[0]) for k, v in shapes.items())
        st = self._staging.get(key)
        if st is None:
            if len(self._staging) > 64:  # batch shapes come and go
                self._staging.clear()
            st = self._staging[key] = lane_inputs.Staging(shapes, self.device)
        d = st.upload(pos=inp.pos, slots=inp.slots, tok=np.arange(inp.n), bt=inp.bt)
        plan.cache["tok"] = d["tok"]
        return ids.long(), d["pos"], d["slots"], _Window(d["bt"])

    def _eager(self, ids, pos, slots, md, plan) -> torch.Tensor | None:
        """The batch through vLLM's modules one by one (CPU, graphs off, a size's first run); None when
        its requests were cancelled meanwhile."""
        with self.dense_lock:
            h = self.model.model.embed_input_ids(ids)
        residual = None
        for layer, attn in zip(self.decoder, self.layers):
            if self._cancel >= set(plan.req_ids):
                return None
            h, residual = self._layer(layer, attn, pos, h, residual, slots, md, plan)
        with self.dense_lock:
            h, _ = call_op(self.model.model.norm, h, residual)
        return h

    def _layer(self, layer, attn, pos, h, residual, slots, md, plan):
        """One decoder layer for the lane rows (vLLM's LlamaDecoderLayer with the split attention)."""
        with self.dense_lock:
            q, residual = pre_attention(layer, attn, h, residual, pos, slots)
        impl = attn.impl
        out = torch.empty(q.shape[0], impl.num_heads, impl.head_size, dtype=q.dtype, device=q.device)
        self._attend(attn, q, out, md, plan)
        with self.dense_lock:
            return post_attention(layer, out, residual)

    def _attend(self, attn, q, out, md, plan) -> None:
        """The split attention of lane rows: q [n, q_size] -> out [n, Hq, D]; enqueued whole when the batch
        runs with host calls (lane_host.py), else layer by layer (attention.split_attention)."""
        impl = attn.impl
        q = q.reshape(q.shape[0], impl.num_heads, impl.head_size)
        if self._batch is not None:
            self._batch.attend(impl, attn, q, attn.kv_cache, out, md, plan)
        else:
            split_attention(impl, attn, q, attn.kv_cache, md, out, plan, stock=None)
