"""Scheduler (``--scheduler-cls``): admission of long requests and error results for host-tier failures.

``NelssaScheduler`` is what vLLM selects: it becomes ``NelssaAsyncScheduler`` (over vLLM's
AsyncScheduler) when async scheduling is on, and stays over the synchronous Scheduler otherwise
(CPU), so vLLM's own fast path is kept.

* Admission: a long request waits outside vLLM's queues (short requests pass it) until
  - host tier: its bytes for prompt + max_tokens fit beside the other admitted long requests'
    (more than the whole capacity: rejected at once with an error result saying so); on nelssa-node
    the capacity is the node's and its free bytes bound the room too (other clients share it;
    node/client.py NodeRoom, asked by a thread of its own), so a request waits rather than failing in a
    store that does not fit;
  - prefill: fewer than ``long_prefills`` admitted long requests still prefill or, host-backed, hold
    their whole prompt on the device until their switch, and its prompt's blocks fit in the free
    blocks beside what the running requests still need to finish (a host-backed one: its window). So a long prompt never
    makes vLLM preempt running short requests to find room (stock vLLM does: head-of-line blocking).
    Deferred prompts (below) are not counted against ``long_prefills`` until they migrate, and pass a
    held request that waits only for that limit (they are served like short requests).
  - while it prefills, vLLM's admission watermark is raised by the blocks its prompt still needs,
    so short requests admitted meanwhile leave them free.
  - P/D decode instance: a hand-over (handover.py, 4) also waits for its prefill instance's release
    on the node; it does not hold the requests behind it. The connectors see a held request when it is
    held (NIXL renews P's lease on its KV meanwhile), and one that ends held or is rejected as an
    unscheduled end (NIXL lets P free its KV at once).
* Long prefill chunks: while short requests decode, a long prompt advances by at most
  policy.prefill_chunk(long_chunk, its context so far) tokens per step (vLLM's
  long_prefill_token_threshold for that step), so a step with a long-prefill chunk costs about the
  same at 1K and at 100K tokens of context, and short requests' next token never waits for a
  chunk's quadratic attention. Without short decodes vLLM's own threshold applies. While no long
  request decodes from the host tier, ``long_chunk_solo`` (NelssaConfig.chunk_solo: 4096 by default)
  takes ``long_chunk``'s place (policy.chunk_budget): no long request's token waits for those longer
  steps.
* Step budget: while a long request is resident and short requests decode, a step adds at most
  ``short_chunk`` (2048; 0: ``long_chunk``) tokens of short prompts to its decodes and long-prompt
  chunks (policy.step_plan), so the short prompts a long prefill held back do not all prefill in the steps right after it;
  ``short_chunk_decode`` (-1: the same) while no long prompt prefills.
* Switch: the worker reports completed hand-offs through the NELSSA connector; before each step the
  scheduler sets each long request's host range in use, H = policy.in_use(prompt, completed end),
  sends it to the worker in the connector's metadata and lets the KV-cache manager free the blocks
  below it. A request whose hand-off is still running keeps decoding from its device blocks: no
  step waits for one. A preemption discards the request's reports (the worker frees its host KV).
* Migration: under device-KV pressure the running request with the largest context that grew past
  T_input (its prompt was short) or that has a deferred long prompt migrates: its anchor
  (policy.Policy.anchor) is its tokens with KV now (a long prompt still prefilling: its prompt
  length, so its hand-off follows the prefill), sent to the worker in the connector's metadata,
  whose background hand-off moves [sink, G) while it keeps computing from its device blocks; the
  switch and the freeing of its blocks are those of a long prompt. Pressure: device KV use at
  ``migrate_watermark``, or the first held long request not fitting beside what the running
  requests still need (_device_room), or fewer free blocks than the requests decoding on the device
  take within ``migrate_lead_steps`` steps (vLLM about to preempt). One migration at a time; none
  without pressure or host room; none of a grown request that ends (by its ``max_tokens``) within a
  hand-off's measured time in steps (policy.ends_within_handoff: its end frees its blocks sooner). A
  preempted migrated request starts over on the device (a grown one's host KV is freed).
  A deferred long prompt (shorter than ``defer_below``, 32K by default) is thus served from the
  device, exactly, as long as the device has room; a longer one is host-backed from admission on
  (the paper's rule): its dense attention would slow every step of the short requests.
* Preemption order: a running request that decodes with >= T_input tokens of context (policy.Policy.spared:
  a long request before its switch, a grown or deferred one on the device, one opted out of the host
  tier; on a P/D decode instance, one whose hand-over is not adopted yet) is put first in the list
  vLLM schedules, so vLLM's FCFS victim (the list's last) is a short request as long as one runs (the
  H200 P/D run: D preempted a 100K request and recomputed it for 28 s). The list's own order is back
  after the step; such requests get their one token of the step's budget first.
* Errors: requests the worker reports failed (host-tier exception, timeout, missing KV) are finished
  with FINISHED_ERROR *before* this step's tokens are emitted, so no token computed from a failed
  attention reaches the client.
* Long lane (config ``lane``, lane.py): a request scheduled with H > 0 is busy until the worker
  reports the lane computed its next position (through the connector's worker metadata, or read
  directly where the lane runs in the scheduler's process: vLLM's in-process executor); busy requests
  are left out of vLLM's running list while it schedules (they keep their place), and their H does
  not move. vLLM allocates one slot
  ahead for every request (num_lookahead_tokens >= 1) for the position the lane writes, two with the
  lane's drafts (lane_spec.py: it runs ahead of the steps, as far as the allocated slots), and a
  request in the lane a block more (spec.NelssaManager.ahead), so its drafts do not stop at every
  block boundary. The switch
  itself goes through the lane: the first H of a request is sent as ``switching`` for one step (the
  request keeps its blocks and is computed on the device; the lane computes its next position with
  H), and is in use — its blocks below H freed — from the next scheduling on. So no step of the
  engine waits for the host tier, not even the switch. A long prompt done prefilling whose switch waits
  only for its last segments' hand-off is left out of the steps like a busy request until it switches
  (at most ``switch_hold_s``): the steps that decoded a 100K-token row from its device blocks meanwhile
  took 65-67 ms (H200 hol run 77; ``_switch_waits``). Its switch is then no switch step either: its next
  position goes to the lane as a seed (``_seed_switch``). A migrating request decodes on the device.
* P/D hand-over (config ``handover``, a prefill instance with nelssa-node; handover.py): a long prompt
  prefilled for remote decode is never switched here (its blocks stay whole for D's NIXL read); when it
  finishes, the connector names its handle and H0 in its kv_transfer_params (``_handover_end``); P's
  admission counts the centroid state it keeps on the node. On the decode instance a handed-over
  request's node room is asked for less what it holds there already (its K/V of [sink, H0): a lower
  bound; should its adoption fail, D stores the prompt again beside P's copy until the node frees that).
  A released hand-over is admitted with its window only (handover.py, 6: ``_admit_window``; device room
  counted for the window's blocks) and promoted from vLLM's wait for its KV only once its adoption is
  reported, its H0 in use from its first step. With the lane, also only once the lane has computed the
  prompt's last position (``seeds`` in the connector's metadata, sent when its KV and adoption are in):
  its first step is then a lane row, not a split step.
* Opt-out: a request with ``extra_args={"nelssa_offload": False}`` (policy.device_only) is a short
  request at any length: device KV, exact attention, never migrated; a malformed value is rejected.
Reservations are released when a request finishes (preemption keeps it: the request comes back).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from collections import deque

from vllm.distributed.kv_transfer.kv_connector.v1 import SupportsHMA
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import Request, RequestStatus

from nelssa.config import engine_config, mem_available
from nelssa.vllm_plugin import handover, runtime
from nelssa.vllm_plugin.connector import find_connector, nelssa_worker_meta
from nelssa.vllm_plugin.policy import (attention_balance, blocks_to_finish, blocks_within, chunk_budget,
                                       context_bucket, device_only, ends_within_handoff, host_bytes, prefill_chunk,
                                       prefill_steps, step_plan, switch_steps)
from nelssa.vllm_plugin.spec import NelssaSpec

log = logging.getLogger("vllm.nelssa")
PREEMPTION_LOG_LINES = 40  # per engine: the first ones say why (_log_preemption)


class NelssaScheduler(Scheduler):
    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is NelssaScheduler and vllm_config is not None and vllm_config.scheduler_config.async_scheduling:
            cls = NelssaAsyncScheduler
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.nelssa = cfg = engine_config(self.vllm_config)
        self._held: deque[Request] = deque()
        self._reserved: dict[str, int] = {}
        self._rejected: list[tuple[Request, str]] = []
        self._done: dict[str, int] = {}      # request -> end of its completed hand-offs
        self._switched_at: dict[str, float] = {}  # request -> when its host range came into use (monotonic)
        self._host_end: dict[str, int] = {}  # request -> H in use (shared with the manager and connector)
        self._anchor: dict[str, int] = {}    # migrating/migrated request -> anchor (shared with the connector)
        self._migrating_at: dict[str, float] = {}  # migrating request -> when it started (monotonic)
        self._busy: set[str] = set()         # lane: requests whose next position the lane computes
        self._switching: dict[str, int] = {}  # lane: request -> first H, sent for its switch step
        self._switched: set[str] = set()     # lane: switching requests scheduled (H in use from next step)
        # lane (lane.py, 6): a finished lane request's blocks stay out of the pool until the worker reports
        # its lane job ended (a running job still writes its window)
        self._lane_reqs: set[str] = set()    # finished lane requests whose blocks are not yet freed
        self._fenced: dict[str, list] = {}   # request -> its blocks, popped from the manager, not yet freed
        self._lane_released: set[str] = set()  # released by the worker while a connector still holds the blocks
        self._on_node: dict[str, int] = {}   # D: handed-over request -> its bytes already on the node (handover.py)
        self._awaiting: dict[str, tuple[str, float]] = {}  # D: held hand-over -> (handle, since): not yet released
        self._window: dict[str, int] = {}    # D: hand-over admitted with its window only -> H0 (manager, connector)
        self._seeding: dict[str, int] = {}   # D, lane: window admission -> the position its lane seed computes
        self._seeded: set[str] = set()       # ... reported computed: promoted at the next try
        self._fail_soon: dict[str, str] = {}  # requests to finish with an error at the next output
        self._loading: dict[str, float] = {}  # recalled request -> since (monotonic): loading back (recall.py)
        self._prefilled: dict[str, float] = {}  # lane: long prompt done prefilling, not switched -> since (monotonic)
        self.switch_held: set[str] = set()      # lane: the long prompts _switch_waits left out of the last step
        self.nelssa_counts: dict[str, int] = {}  # what _count counted, since the start
        # the migration rule's clock (policy.ends_within_handoff): the engine's step interval and a hand-off's
        # time, start to switch, each a moving average (None until measured)
        self._step_s: float | None = None
        # ... and the interval after a scheduling without a long-prefill chunk: the steps a long prompt's hold
        # spans are those (_growth_reserve), several times faster than its prefill's (H100 hol run 107)
        self._decode_step_s: float | None = None
        self._chunk_step = False                 # the last scheduling ran a long-prefill chunk
        self._step_reserve: tuple | None = None  # this scheduling's free blocks and reserves (_log_preemption,
                                                 # _trace_reserve)
        self._preemptions_logged = 0
        self._reserve_traced = 0.0  # _trace_reserve's last line (perf_counter)
        self._last_schedule: float | None = None
        self._handoff_s: float | None = None
        if cfg is None:
            return
        if cfg.lane:
            # the slot of the lane's position; with drafts (lane_spec.py, 2) the next one's too
            self.num_lookahead_tokens = max(self.num_lookahead_tokens, 2 if cfg.lane_spec else 1)
        groups = self.kv_cache_config.kv_cache_groups
        specs = [g.kv_cache_spec for g in groups]
        if len(groups) != 1 or not isinstance(specs[0], NelssaSpec):
            raise ValueError(f"NELSSA expects one KV-cache group of NelssaSpec layers, got "
                             f"{[type(s).__name__ for s in specs]}: is the model a Llama served with the "
                             "nelssa plugin?")
        spec = specs[0]
        self.nelssa_policy = dataclasses.replace(spec.policy(), defer_below=cfg.defer_limit)
        from nelssa.vllm_plugin.spec import NelssaManager
        managers = [m for m in self.kv_cache_manager.coordinator.single_type_managers if isinstance(m, NelssaManager)]
        conn = find_connector(self.connector)
        if len(managers) != 1 or conn is None:
            raise ValueError("NELSSA needs its KV-cache manager and its KV connector (see nelssa.vllm_plugin.engine_args)")
        managers[0].host_ends = conn.host_ends = self._host_end
        self._manager = managers[0]
        # vLLM defers returning a freed request's blocks to the pool while a step in flight may still write
        # them, for a consumer KV connector under async scheduling: the connector's load into blocks given to
        # another request would not be ordered against that write. NELSSA's connector is kv_both, but alone it
        # loads nothing so: a recall's load runs after an event recorded behind the steps already launched
        # (handoff.py, 5), and the lane and the hand-off are waited for before a preempted or finished
        # request's blocks are written again (lane.py, 6; handoff.py, 3). Deferred, a preemption frees
        # nothing in its own scheduling, so vLLM preempted every request after the victim down to the one it
        # allocated for (H100 hol run 115sc: 32 at one scheduling where one victim's 66 blocks were enough).
        # So a victim's blocks go back at once, as in stock vLLM; composed with another connector (a P/D
        # decode instance: NIXL) vLLM's rule stays.
        if self.defer_block_free and self.connector is conn:
            self.defer_block_free = False
        # a block past the lookahead for the lane's drafts (spec.NelssaManager.ahead; lane_spec.py, 2)
        self._manager.ahead = self.block_size if cfg.lane and cfg.lane_spec else 0
        self._manager.max_len = self.max_model_len
        managers[0].window_ends = conn.window = self._window
        conn.anchors = self._anchor
        conn.switching = self._switching
        if cfg.handover:  # P of a P/D stack (handover.py, 1)
            conn.handover_end = self._handover_end
        self._conn = conn
        self._bytes_per = (len(groups[0].layer_names), spec.num_kv_heads, spec.head_size, spec.dtype.itemsize)
        self._l_eq = attention_balance(self.vllm_config.model_config.hf_text_config)
        self._node_room = None
        if cfg.engine == "node":  # the node's capacity, not this machine's memory (node/client.py NodeRoom)
            from nelssa.node.client import NodeRoom
            self._node_room = NodeRoom(cfg)
            cap = self._node_room.capacity
            self.host_capacity = min(cfg.host_capacity, cap) if cfg.host_capacity else cap
        else:
            self.host_capacity = cfg.host_capacity or int(0.8 * mem_available())
        log.info("NELSSA scheduler: T_input=%d, host capacity %.2f GiB%s", cfg.T_input, self.host_capacity / 2**30,
                 f" (nelssa-node at {cfg.node_address})" if self._node_room is not None else "")
        if cfg.T_input >= self.max_model_len:
            log.warning("NELSSA: T_input %d >= max_model_len %d: no request can become long, the host tier stays "
                        "unused", cfg.T_input, self.max_model_len)

    # ------------------------------------------------------------ admission
    def _need(self, request: Request) -> int:
        keep = self.nelssa.cluster_size if self.nelssa.handover else 0  # P keeps the centroid state there
        return host_bytes(request.num_prompt_tokens + request.max_tokens, *self._bytes_per, keep_cluster_size=keep)

    def _host_room(self, on_node: int = 0) -> int:
        """Host-tier bytes a new long request (or migration) may reserve: the capacity beside the admitted
        ones'; on nelssa-node also what the node has free (other clients use it too) less what admitted
        requests may still store there (counted whole: some may be stored already; a handed-over one
        without what it holds there already), plus ``on_node``: what the request itself holds there
        already (a hand-over from the prefill instance)."""
        room = self.host_capacity - sum(self._reserved.values())
        if self._node_room is not None:
            free, asked = self._node_room.free()
            # what that answer may not hold yet: requests not switched before it was asked (their prompt's
            # stores completed before their switch), counted whole
            pending = sum(n - self._on_node.get(rid, 0) for rid, n in self._reserved.items()
                          if self._switched_at.get(rid, math.inf) >= asked)
            room = min(room, free - pending + on_node)
        return room

    def add_request(self, request: Request) -> None:
        if self.nelssa is None or request.request_id in self.requests:
            return super().add_request(request)
        try:
            long = self._long(request)
        except ValueError as e:  # a malformed nelssa_offload: refused, not guessed
            return self._reject(request, f"nelssa: {e}")
        if not long:
            return super().add_request(request)
        need = self._need(request)
        if need > self.host_capacity:
            return self._reject(request, (
                f"nelssa: request needs {need / 2**30:.2f} GiB of host-tier memory for "
                f"{request.num_prompt_tokens} prompt + {request.max_tokens} max tokens; the host tier "
                f"holds {self.host_capacity / 2**30:.2f} GiB ("
                + (f"nelssa-node at {self.nelssa.node_address}" if self._node_room is not None else "NELSSA_HOST_CAPACITY")
                + ")"))
        if self._blocks(request.num_prompt_tokens) > self.kv_cache_manager.block_pool.num_gpu_blocks - 1:
            return self._reject(request, (f"nelssa: the {request.num_prompt_tokens}-token prompt needs more "
                                          "device KV blocks for its prefill than the instance has"))
        try:  # D: a hand-over's prompt is on the node already (K/V rows of [sink, H0): a lower bound)
            handle = handover.handle_of(request.kv_transfer_params)
            if handle and self._node_room is not None:
                h0 = min(int(request.kv_transfer_params[handover.KEY].get("host_end") or 0), request.num_prompt_tokens)
                layers, heads, dim, es = self._bytes_per
                self._on_node[request.request_id] = layers * heads * max(0, h0 - self.nelssa.sink) * 2 * dim * es
                self._awaiting[request.request_id] = (handle, time.monotonic())
                self._node_room.watch(handle)
        except (ValueError, TypeError):
            pass  # malformed: the connector logs it; the request is clustered here and counted whole
        if self.connector is not None:
            # the connectors see it now, not at its admission: on a P/D decode instance NixlConnector then
            # renews P's lease on the prompt's KV while the request is held here (vLLM's 30 s would expire
            # while D waits for room or for the hand-over's release, and P would free blocks D reads later)
            self.connector.on_new_request(request)
        self._held.append(request)
        self._admit_held()

    def _reject(self, request: Request, msg: str) -> None:
        """Finish ``request`` with an error result saying ``msg`` (emitted with the next step's outputs)."""
        log.error("rejecting request %s: %s", request.request_id, msg)
        request.status = RequestStatus.FINISHED_ERROR
        self._rejected.append((request, msg))
        self._unscheduled_finished(request)

    def _unscheduled_finished(self, request: Request) -> None:
        """A request that ends before vLLM's scheduler had it (held, or rejected here): the connectors are
        told as vLLM tells them of a request that ends unscheduled, with no blocks — on a P/D decode
        instance NixlConnector then has P free the prompt's KV at once instead of at its lease's end."""
        if self.connector is None:
            return
        empty = tuple([] for _ in self.kv_cache_config.kv_cache_groups)
        if isinstance(self.connector, SupportsHMA):
            self.connector.request_finished_all_groups(request, empty)
        else:
            self.connector.request_finished(request, empty[0])

    def _enqueue_held(self, request: Request) -> None:
        """vLLM's add_request for an admitted held request, without telling the connectors again (they saw
        it when it was held: add_request)."""
        conn, self.connector = self.connector, None
        try:
            super().add_request(request)
        finally:
            self.connector = conn

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _prefilling_longs(self) -> int:
        """Admitted long requests that still prefill, or that will hold their whole prompt on the device
        until their switch (host-backed, not switched yet); a deferred one counts only once it migrates."""
        n = 0
        for rid in self._reserved:
            r = self.requests.get(rid)
            if r is None or self._host_end.get(rid):
                continue
            if self.nelssa_policy.deferred(r.num_prompt_tokens) and rid not in self._anchor:
                continue  # on the device like a short request until it migrates
            if r.num_computed_tokens < r.num_prompt_tokens or self._anchor_of(r):
                n += 1
        return n

    def _long(self, r: Request) -> bool:
        return self.nelssa_policy.is_long(r.num_prompt_tokens, device_only(r.sampling_params))

    def _anchor_of(self, r: Request) -> int:
        return self.nelssa_policy.anchor(r.num_prompt_tokens, self._anchor.get(r.request_id, 0),
                                         device_only(r.sampling_params))

    def _handed_over(self, r: Request) -> bool:
        """P with ``handover``: a request prefilled for remote decode (never switched here: handover.py, 2)."""
        return self.nelssa.handover and bool((r.kv_transfer_params or {}).get("do_remote_decode"))

    def _handover_end(self, r: Request) -> int:
        """P: H0 of a finished request this instance host-backed by its prompt (0: no hand-over)."""
        a = self._anchor_of(r)
        if not a or a != r.num_prompt_tokens or r.num_computed_tokens < a:
            return 0
        return self.nelssa_policy.goal(a, a)

    def _switch(self) -> bool:
        """Set H for host-backed requests whose completed hand-offs now cover their anchor's range
        (with the lane a first H is ``switching`` for one scheduled step, then in use) -> whether one was
        seeded (``_seed_switch``: its blocks below H are free now)."""
        pol = self.nelssa_policy
        seeded = False
        for rid in self._switched:
            h = self._switching.pop(rid, 0)
            if h and rid in self.requests:
                self._use_host(rid, h)
        self._switched.clear()
        for rid, done in self._done.items():
            if rid in self._busy or rid in self._switching:
                continue  # the lane reads its blocks from H on: H moves when it is scheduled
            h0 = self._window.get(rid, 0)
            if h0 and done >= h0 and not self._host_end.get(rid):
                self._use_host(rid, h0)  # adopted (handover.py, 6): in use from its first step, no switch step
                continue
            r = self.requests.get(rid)
            a = self._anchor_of(r) if r is not None and not self._handed_over(r) else 0
            if a and r.num_computed_tokens >= a:
                h = pol.in_use(a, done)
                if h > self._host_end.get(rid, 0):
                    if not self._host_end.get(rid) and self.nelssa.lane:
                        if rid in self._prefilled and self._seed_switch(r, h):
                            seeded = True
                            continue  # held for its switch: its next position is the lane's, no switch step
                        self._switching[rid] = h  # its switch step: computed on the device, then the lane
                        continue
                    self._use_host(rid, h)
        return seeded

    def _seed_switch(self, r: Request, h: int) -> bool:
        """A long prompt held for its switch (``_switch_waits``) whose hand-off is done: H in use now and its
        next position (its sampled token's) computed by the lane as a seed, as a window admission's first
        position on D (runner._nelssa_lane_seed) — so it never decodes from its device blocks, not even in a
        switch step; the lane's report makes the step that schedules it a lane row. False (a switch step
        instead) while a step's output for it may be in flight.
        Its blocks below H go back to vLLM's pool here, not at its next allocation (the step after its seed's
        lane batch, which may capture: 0.2-0.3 s later on the H100, run 104): no step in flight computes it,
        its hand-off has read them, and the lane reads its sink's and window's only (its seed names the blocks
        before they are freed). So a long prompt waiting for device room is admitted that much sooner."""
        rid, pos = r.request_id, r.num_computed_tokens
        if r.status != RequestStatus.RUNNING or r.num_output_placeholders or len(r.all_token_ids) <= pos:
            return False
        blocks = self.kv_cache_manager.get_block_ids(rid)[0]
        self._conn.seeds[rid] = (pos, h, int(r.all_token_ids[pos]), list(blocks[:pos // self.block_size + 1]))
        self._end_hold(rid, time.monotonic())
        self._use_host(rid, h)
        self.kv_cache_manager.remove_skipped_blocks(rid, pos, r.num_prompt_tokens)  # (NelssaManager: [sink, H))
        self._busy.add(rid)
        self._count("switch_seeds")
        return True

    def _use_host(self, rid: str, h: int) -> None:
        """H of ``rid`` in use from now on; its first completes a migration and stamps the switch."""
        if not self._host_end.get(rid):
            if rid in self._anchor:
                self._count("migrations_completed")
            t = self._migrating_at.pop(rid, None)
            if t is not None:  # its hand-off time: start to switch, the request decoding on its device blocks
                dt = time.monotonic() - t
                self._conn.sched_stats.setdefault("migration_s", []).append(dt)
                ctx = context_bucket(h)
                for k, x in (("migration_context_s", dt), ("migration_context_n", 1)):
                    by = self._conn.sched_stats.setdefault(k, {})
                    by[ctx] = by.get(ctx, 0) + x
                self._handoff_s = dt if self._handoff_s is None else 0.5 * (self._handoff_s + dt)
                log.info("NELSSA: request %s on the host tier after a %.2f-s hand-off (%d tokens there)", rid, dt, h)
            self._switched_at[rid] = time.monotonic()
        self._host_end[rid] = h

    def _count(self, name: str, n: int = 1) -> None:
        self._conn.sched_stats[name] = self._conn.sched_stats.get(name, 0) + n
        self.nelssa_counts[name] = self.nelssa_counts.get(name, 0) + n  # (read by tests: bench.harness)

    def _pressure(self) -> str:
        """Why host-backing should grow now ('' when it should not): device KV use at the watermark; fewer
        free blocks than the requests decoding on the device take in the next ``migrate_lead_steps``
        steps (vLLM would preempt before a hand-off started then could free any); or the first held long
        request not fitting beside what running requests still need."""
        pool = self.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        use = 1.0 - free / max(1, pool.num_gpu_blocks - 1)  # block 0: vLLM's null block
        if use >= self.nelssa.migrate_watermark:
            return f"device KV {100 * use:.0f}% in use"
        lead = self.nelssa.migrate_lead_steps
        if lead:
            need = blocks_within([r.num_computed_tokens for r in self.running if not self._host_end.get(r.request_id)],
                                 lead, self.block_size)
            if need > free:
                return f"{free} free device blocks, {need} taken by the decoding requests within {lead} steps"
        # the first held request that may be admitted now (a hand-over not yet released may not)
        first = next((r for r in self._held if r.request_id not in self._awaiting), None)
        if first is not None and self._need(first) <= self._host_room() and not self._device_room(first):
            return f"long request {first.request_id} waits for device KV"
        return ""

    def _migrate(self) -> None:
        """Under pressure, start migrating the running request with the largest context that grew past
        T_input or has a deferred long prompt; not one that ends before its hand-off would complete (by
        its ``max_tokens``, policy.ends_within_handoff): its end frees its blocks sooner."""
        cfg, pol = self.nelssa, self.nelssa_policy
        if not cfg.migrate or any(rid in self.requests and not self._host_end.get(rid) for rid in self._anchor):
            return  # off, or one in progress
        why = self._pressure()  # first: a few counters, where the candidates are a pass over every running request
        if not why:
            return
        cands = []  # (anchor, request): a long prompt's length while it prefills, else its tokens with KV
        for r in self.running:
            if r.status != RequestStatus.RUNNING or r.request_id in self._anchor or device_only(r.sampling_params) \
                    or self._handed_over(r):
                continue
            if pol.is_long(r.num_prompt_tokens):
                if pol.deferred(r.num_prompt_tokens):
                    cands.append((max(r.num_computed_tokens, r.num_prompt_tokens), r))
            elif r.num_computed_tokens >= max(r.num_prompt_tokens, pol.T_input) and not ends_within_handoff(
                    self._end(r) - r.num_tokens, self._handoff_s, self._step_s):
                cands.append((r.num_computed_tokens, r))
        if not cands:
            return
        anchor, r = max(cands, key=lambda x: x[0])
        long = pol.is_long(r.num_prompt_tokens)
        if not long:  # a long prompt's host bytes were reserved at its admission
            need = host_bytes(min(r.num_prompt_tokens + (r.max_tokens or 0), self.max_model_len), *self._bytes_per)
            if need > self._host_room():
                return
            self._reserved[r.request_id] = need
        self._anchor[r.request_id] = anchor
        self._migrating_at[r.request_id] = time.monotonic()
        self._count("migrations_started")
        log.info("NELSSA: migrating %s request %s (%d tokens) to the host tier: %s",
                 "long" if long else "grown", r.request_id, anchor, why)

    def _recall(self) -> None:
        """A migrated request that grew past T_input returns to the device (config ``recall``) once the
        device has room for it and for every running request to its end, and nothing waits for room, and
        decodes at the device's pace again. Without it such a request decodes from the host tier to its end
        although the pressure that moved it is gone (H200 growth run 61: after the others finished, 16
        migrated requests decoded for 67 s at ~270 tok/s beside an idle device). Its KV is loaded back from
        the host tier (recall.py: new blocks where its host range's null blocks are, held out of
        the steps until the worker reports it loaded, ``_recalled``; nelssa-node sends it back as stored,
        node/client.py ``read_back``). One at a time, the one with the most
        tokens left; only one whose step output is not in flight and that the lane does not compute; never
        while anything would migrate a request, nor where the device's KV use with every running request
        at its end reaches ``migrate_watermark`` (no request goes back and forth)."""
        cfg = self.nelssa
        if not cfg.recall or not self._anchor or self.waiting or self._held or self._loading or any(
                rid in self.requests and not self._host_end.get(rid) for rid in self._anchor):
            return  # off; room is for waiting requests first; a recall or a migration in progress
        if self._pressure():
            return  # what migrates requests would migrate it again
        cands = [r for r in self.running
                 if r.request_id in self._anchor and self._host_end.get(r.request_id) and not self._long(r)
                 and r.status == RequestStatus.RUNNING and r.request_id not in self._busy
                 and not r.num_output_placeholders]
        if not cands:
            return
        end = self._end
        on_device = [(r.num_computed_tokens, end(r)) for r in self.running if not self._host_end.get(r.request_id)]
        bs, pool = self.block_size, self.kv_cache_manager.block_pool
        free = (pool.get_num_free_blocks() - self.kv_cache_manager.watermark_blocks
                - self._prefill_reserve() - len(self.running))  # a lookahead block each
        room = free - blocks_to_finish(on_device, bs)
        r = max(cands, key=lambda r: end(r) - r.num_computed_tokens)
        need = blocks_to_finish([(0, end(r))], bs)
        # it fits to its end, and the device's KV use then stays below the migration watermark (else it
        # would migrate again: with the watermark at 0, as the tests set it, nothing is recalled)
        if need > room or 1.0 - (room - need) / max(1, pool.num_gpu_blocks - 1) >= cfg.migrate_watermark:
            return
        rid = r.request_id  # by load (recall.py, 1)
        row = self._manager.recall_blocks(rid, self._host_end[rid])
        self._loading[rid] = time.monotonic()
        self._conn.recalls[rid] = (self._host_end[rid], row)
        log.info("NELSSA: recalling request %s (%d tokens, %d to go) to the device, loading its KV back from the "
                 "host tier: room for it and every running request to its end", rid, r.num_tokens,
                 end(r) - r.num_tokens)

    def _recalled(self, rid: str) -> None:
        """The worker loaded a recalled request back (recall.py, 4): a device request from the next step."""
        t = self._loading.pop(rid, None)
        r = self.requests.get(rid)
        if t is None or r is None:
            return
        for d in (self._host_end, self._anchor, self._switched_at, self._done, self._migrating_at):
            d.pop(rid, None)
        if not self._long(r):  # (a grown request; a long prompt keeps its reservation)
            self._reserved.pop(rid, None)
        self._count("recalls")
        self._conn.sched_stats.setdefault("recall_s", []).append(time.monotonic() - t)

    def _end(self, r: Request) -> int:
        """The tokens a request has when it ends by its ``max_tokens`` (at most the model's length)."""
        return min(r.num_prompt_tokens + (r.max_tokens or 0), self.max_model_len)

    def _preempt_request(self, request: Request, timestamp: float) -> None:
        rid = request.request_id
        if self.nelssa is not None:
            self._log_preemption(request)
        self._done.pop(rid, None)
        self._busy.discard(rid)
        self._switching.pop(rid, None)
        self._switched.discard(rid)
        self._host_end.pop(rid, None)
        self._switched_at.pop(rid, None)
        self._window.pop(rid, None)  # it comes back as a prompt prefilled here (its KV came from P)
        self._migrating_at.pop(rid, None)
        self._loading.pop(rid, None)
        self._prefilled.pop(rid, None)
        if self._anchor.pop(rid, None) is not None and not self._long(request):  # it comes back as a short one
            self._reserved.pop(rid, None)
        return super()._preempt_request(request, timestamp)

    def _trace_reserve(self, out) -> None:
        """With the watchdog's diagnostics on (``stall_log_ms``), while a long prompt prefills or holds its
        blocks: the step's free blocks, reserves and admissions, at most every 0.5 s (``t``: perf_counter, the
        hol benchmark's clock), so a run that preempts shows how the pool got there (H100 hol run 115sc: 2 free
        blocks against a growth reserve of 244 at the first prompt's hold, the admissions before not logged)."""
        if not self.nelssa.stall_log_ms:
            return
        now = time.perf_counter()
        if now - self._reserve_traced < 0.5:
            return
        self._reserve_traced = now
        free0, prefill, growth, prefilling, unswitched, chunked, horizon = self._step_reserve
        decoding = sum(r.num_computed_tokens >= r.num_prompt_tokens for r in self.running)
        log.info("NELSSA reserve: t=%.3f free blocks %d at the scheduling's start, %d after; watermark %d (long "
                 "prefills %d + growth %d over %d steps; prefilling %s, holding %s; step %.1f ms, %.1f ms after "
                 "one without a long chunk); admitted %d (%d tokens); running %d (%d decoding), waiting %d",
                 now, free0, self.kv_cache_manager.block_pool.get_num_free_blocks(),
                 self.kv_cache_manager.watermark_blocks, prefill, growth, horizon, prefilling, unswitched,
                 (self._step_s or 0.0) * 1e3, (self._decode_step_s or 0.0) * 1e3, len(out.scheduled_new_reqs),
                 sum(out.num_scheduled_tokens.get(r.req_id, 0) for r in out.scheduled_new_reqs),
                 len(self.running), decoding, len(self.waiting))

    def _log_preemption(self, victim: Request) -> None:
        """A preemption under NELSSA is a failure of its admission (the reserves above exist so that vLLM never
        preempts): say what the step's reserves were, so the run that shows one shows why. The request vLLM was
        allocating for is read from vLLM's schedule loop (its local ``request``), for this line only."""
        self._preemptions_logged += 1
        if self._preemptions_logged > PREEMPTION_LOG_LINES:
            return
        caller = sys._getframe(2).f_locals.get("request")
        who = (f"{caller.request_id} ({caller.num_computed_tokens}/{caller.num_prompt_tokens} tokens computed, "
               f"{len(self.kv_cache_manager.get_block_ids(caller.request_id)[0])} blocks)"
               if isinstance(caller, Request) else "?")
        free0, prefill, growth, prefilling, unswitched, chunked, _ = self._step_reserve or (-1, 0, 0, False, False, 0, 0)
        kinds = {"prefilling": 0, "decoding": 0}
        for r in self.running:
            kinds["prefilling" if r.num_computed_tokens < r.num_prompt_tokens else "decoding"] += 1
        log.warning(
            "NELSSA: vLLM preempts %s (%d/%d tokens computed, %d blocks) for %s; free blocks %d now, %d at this "
            "scheduling's start; watermark %d (vLLM's %d + long prefills %d + growth %d; prefilling %s, holding %s, "
            "chunk budget %d, step %.1f ms, %.1f ms after one without a long chunk); running %s, waiting %d, held %d, "
            "busy %d",
            victim.request_id, victim.num_computed_tokens, victim.num_prompt_tokens,
            len(self.kv_cache_manager.get_block_ids(victim.request_id)[0]), who,
            self.kv_cache_manager.block_pool.get_num_free_blocks(), free0, self.kv_cache_manager.watermark_blocks,
            self.kv_cache_manager.watermark_blocks - prefill - growth, prefill, growth, prefilling, unswitched,
            chunked, (self._step_s or 0.0) * 1e3, (self._decode_step_s or 0.0) * 1e3, kinds, len(self.waiting),
            len(self._held), len(self._busy))

    def _device_room(self, request: Request) -> bool:
        """The prompt's blocks (a window admission's: its window's) fit in the free blocks beside what
        running requests need to finish, what running long prefills still have to allocate (a deferred
        prompt may be admitted beside one) and what the requests in vLLM's waiting queues take to their ends
        (``_queued_growth``)."""
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        need = self._prefill_reserve()
        h0 = self._window_end(request)
        if h0:
            first, last = self.nelssa_policy.freed_blocks(h0)
            need -= last - first
        need += self._device_growth() + self._queued_growth()
        return self._blocks(request.num_prompt_tokens) + need <= free

    def _queued_growth(self) -> int:
        """Blocks the requests in vLLM's waiting queues allocate up to their ends once admitted. vLLM admits
        them (first come, first served) ahead of a long prompt admitted now and in the same step, before that
        prompt's reserve is in the watermark (``_prefill_reserve`` counts from its first scheduling), and their
        later chunks allocate unchecked: without them counted, a long prompt admitted beside them ran out of
        blocks mid-prefill and vLLM preempted it (the CPU engine test: long5k after 3,641 of its 5,000 tokens)."""
        n = 0
        for q in (self.waiting, self.skipped_waiting):
            for r in q:
                have = len(self.kv_cache_manager.get_block_ids(r.request_id)[0])
                n += max(0, self._blocks(self._end(r)) - have)
        return n

    def _admit_held(self) -> None:
        """Admit held long requests in arrival order. The first one without host or device room holds
        every one behind it (none is starved by later arrivals). One that waits only for the long-prefill
        limit lets the deferred prompts behind it pass: those are served from the device like short
        requests (exact, at stock speed) until pressure migrates them, so they do not queue behind a
        100K prompt's prefill (on the H200 an 11.7K prompt waited 14 s behind a 122K one, against
        1.1 s in stock vLLM)."""
        cfg, pol = self.nelssa, self.nelssa_policy
        i = 0
        while i < len(self._held):
            req = self._held[i]
            if req.request_id in self._awaiting and not self._handover_released(req):
                i += 1  # its prefill instance has not released it yet: not counted, not blocking others
                continue
            need = self._need(req)
            if need > self._host_room(self._on_node.get(req.request_id, 0)) or not self._device_room(req):
                return
            if (not pol.deferred(req.num_prompt_tokens) and cfg.long_prefills
                    and self._prefilling_longs() >= cfg.long_prefills):
                i += 1
                continue
            del self._held[i]
            self._reserved[req.request_id] = need
            h0 = self._window_end(req)
            if h0:
                self._admit_window(req, h0)
            self._enqueue_held(req)

    def _handover_released(self, req: Request) -> bool:
        """D (handover.py, 4): whether a held hand-over may be admitted — its prefill instance has released
        it on the node (asked by NodeRoom's thread), so the blocks this instance allocates for the NIXL
        read (its window's, 6, or the whole prompt's until the adoption) are not held while P still
        stores it (17-19 s per 100K prompt on the shared H200). Not released within
        ``handover_wait_s``: admitted without the hand-over (logged, ``handover_fallbacks``); the KV it
        receives is clustered here."""
        rid = req.request_id
        handle, since = self._awaiting[rid]
        if self._node_room.released(handle):
            self._stop_awaiting(rid)
            return True
        if time.monotonic() - since < self.nelssa.handover_wait_s:
            return False
        self._stop_awaiting(rid)
        self._on_node.pop(rid, None)
        req.kv_transfer_params = {k: v for k, v in req.kv_transfer_params.items() if k != handover.KEY}
        self._conn.drop_adoption(rid)
        self._count("handover_fallbacks")
        log.warning("NELSSA hand-over of %s: not released within %.0f s (handover_wait_s); admitted without it, "
                    "its prompt is clustered here", rid, self.nelssa.handover_wait_s)
        return True

    def _window_end(self, req: Request) -> int:
        """D (handover.py, 6): H0 if ``req`` is admitted with its window only — a released hand-over
        (config ``handover_window``) whose KV comes over NIXL in blocks of this instance's size and whose
        H0 is this instance's for its prompt (else 0: the whole prompt's blocks, and the adoption at its
        first move)."""
        ktp = req.kv_transfer_params or {}
        ho = ktp.get(handover.KEY)
        if (not self.nelssa.handover_window or not isinstance(ho, dict) or req.request_id in self._awaiting
                or not ktp.get("do_remote_prefill") or not ktp.get("remote_block_ids")):
            return 0
        pol, n = self.nelssa_policy, req.num_prompt_tokens
        if self._anchor_of(req) != n:
            return 0
        h0 = pol.goal(n, n)
        first, last = pol.freed_blocks(h0)
        groups = ktp["remote_block_ids"]  # P's blocks, per KV-cache group (NixlConnector's BlockIds)
        if ho.get("host_end") != h0 or ho.get("block_size") != self.block_size or first >= last or not all(
                isinstance(g, (list, tuple)) and len(g) >= last for g in groups):
            return 0
        return h0

    def _admit_window(self, req: Request, h0: int) -> None:
        """D (handover.py, 6): ``req`` gets device blocks for its window only (NelssaManager: null blocks
        for [sink, H0)), and NIXL reads only the window's blocks of P's: the same positions are taken out
        of P's block list (NixlConnector pairs what remains with this instance's non-null blocks in
        order). No prefix-cache reads: a hit inside [sink, H0) would break that pairing."""
        first, last = self.nelssa_policy.freed_blocks(h0)
        ktp = req.kv_transfer_params
        ktp["remote_block_ids"] = [list(g[:first]) + list(g[last:]) for g in ktp["remote_block_ids"]]
        req.skip_reading_prefix_cache = True
        self._window[req.request_id] = h0
        self._count("handover_windows")
        self._count("handover_window_blocks_spared", last - first)

    def _try_promote_blocked_waiting_request(self, request: Request) -> bool:
        """vLLM moves a request whose KV arrived to the waiting queue; a window admission (handover.py, 6)
        goes only once its adoption is reported too (its H0 in use: _switch), since its first step already
        attends [sink, H0) on the host. A window whose NIXL read failed cannot be recomputed into its null
        blocks: the request fails loudly."""
        rid = request.request_id
        if rid in self._window and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            if rid in self.failed_recving_kv_req_ids:
                self._fail_soon.setdefault(rid, "nelssa: the window KV of this handed-over request failed to "
                                                "arrive over NIXL")
                return False
            if not self._host_end.get(rid):
                return False
            if self.nelssa.lane and not self._seed(request):
                return False
        return super()._try_promote_blocked_waiting_request(request)

    def _seed(self, request: Request) -> bool:
        """D with the lane (handover.py, 6): whether the lane has computed a window admission's first
        position, the prompt's last token (then its first step is a lane row, not a split step that
        would make the step's short rows wait for the host tier). Once its window KV is in and its
        adoption reported (the lane reads both), the seed goes to the worker in the next step's
        metadata; the lane's report promotes the request."""
        rid = request.request_id
        if rid in self._seeded:
            return True
        lane = runtime.lane()  # in-process executor: the lane's result is visible before its report
        pos = self._seeding.get(rid)
        if pos is not None:
            if lane is not None and lane.ready(rid, pos):
                self._seeded.add(rid)
            return rid in self._seeded
        if rid not in self.finished_recving_kv_req_ids:
            return False  # NIXL still reads the window
        pos = request.num_prompt_tokens - 1
        blocks = self.kv_cache_manager.get_block_ids(rid)[0]
        self._seeding[rid] = pos
        self._conn.seeds[rid] = (pos, self._host_end[rid], int(request.all_token_ids[pos]),
                                 list(blocks[:pos // self.block_size + 1]))
        self._count("handover_lane_seeds")
        return False

    def _stop_awaiting(self, rid: str) -> None:
        """The request no longer waits for a hand-over's release (admitted, timed out, or finished held)."""
        wait = self._awaiting.pop(rid, None)
        if wait is not None:
            self._node_room.forget(wait[0])

    def _long_prefilling(self) -> list[Request]:
        """Admitted long requests (``_reserved``) running and still prefilling their prompt."""
        return [r for r in map(self.requests.get, self._reserved)
                if r is not None and r.status == RequestStatus.RUNNING and r.num_computed_tokens < r.num_prompt_tokens]

    def _prefill_reserve(self) -> int:
        """Blocks that running long prefills still have to allocate."""
        return sum(max(0, self._blocks(r.num_prompt_tokens) - self._blocks(r.num_computed_tokens))
                   for r in self._long_prefilling())

    def _device_growth(self, steps: int | None = None, skip=()) -> int:
        """Blocks the running requests on the device still allocate, each at most to its end (``max_tokens``);
        with ``steps``, only within that many steps (a request still prefilling its own prompt: from the
        prompt's end). Offloaded or migrating requests keep a window, long prefills are capped by
        ``long_prefills`` (both left out, as is any request in ``skip``)."""
        n = 0
        for r in self.running:
            if self._anchor_of(r) or r.request_id in skip:
                continue
            have = r.num_computed_tokens
            end = self._end(r) if steps is None else min(self._end(r), max(have, r.num_prompt_tokens) + steps)
            n += max(0, self._blocks(end) - self._blocks(have))
        return n

    def _holding(self) -> tuple[bool, bool]:
        """Whether a long prompt host-backed by its length holds its prompt's device blocks -> (one still
        prefilling, one done and not given back yet: before its switch, the lane holding it out of the steps
        meanwhile, and after a switch step until the manager frees them at its next allocation,
        NelssaManager.holds_host_range: with the lane, once its first token from the host tier is computed;
        the CPU test of the hold saw 6 steps of it; a seeded switch frees them at once, ``_seed_switch``).
        A migration is not one: its own rule (``_migrate``) decides under pressure."""
        prefilling = unswitched = False
        for rid in self._reserved:
            r = self.requests.get(rid)
            if r is None or r.status != RequestStatus.RUNNING or rid in self._anchor or not self._anchor_of(r):
                continue
            if r.num_computed_tokens < r.num_prompt_tokens:
                prefilling = True
            elif self._manager.holds_host_range(rid) and not self._handed_over(r):  # P: decoded elsewhere
                unswitched = True
        return prefilling, unswitched

    def _growth_reserve(self, thr: int, chunked: int, holding: bool) -> tuple[int, int]:
        """(blocks, steps): what the requests decoding on the device (``_device_growth``) allocate until the long prompts
        give their device blocks back: while the running long prefills last (policy.prefill_steps at this
        step's chunk budget ``chunked``, ``_chunk_budget``; 0: vLLM's threshold ``thr``, else its token
        budget) and, while one host-backed by its length holds its blocks (``holding``: either of
        ``_holding``'s), until its switch (policy.switch_steps: ``switch_hold_s`` with the lane, else a
        hand-off's measured time). A deferred prompt (in ``_reserved``) is left out: ``_prefill_reserve``
        holds its prompt, and it never switches. ``steps``: the horizon counted (_trace_reserve)."""
        budget = chunked or thr or self.scheduler_config.max_num_batched_tokens
        l_eq = self._l_eq if chunked else float("inf")
        steps = max((prefill_steps(r.num_computed_tokens, r.num_prompt_tokens, budget, l_eq, self.block_size)
                     for r in self._long_prefilling()), default=0)
        if holding:
            cfg = self.nelssa
            steps += switch_steps(cfg.switch_hold_s if cfg.lane else (self._handoff_s or 0.0), self._hold_step_s())
        return (self._device_growth(steps, self._reserved) if steps else 0), steps

    def _hold_step_s(self) -> float | None:
        """The step interval a long prompt's hold is counted in (``_growth_reserve``): the shorter of the engine's
        and the one after schedulings without a long-prefill chunk. The hold follows the prefill, and its steps
        are decodes and short prompts: with ``long_chunk_solo`` 4096 the prefill's steps took 150-340 ms on the
        H100, so the hold's bound (2 s) counted ~10 steps, and the requests decoding beside it grew past the
        reserve in the ~25 steps the hold ran (hol run 107: 15 preemptions, 0.2 s into the first prompt's
        hold)."""
        return min((s for s in (self._step_s, self._decode_step_s) if s is not None), default=None)

    def schedule(self, *args, **kwargs):
        if self.nelssa is None:
            return super().schedule(*args, **kwargs)
        now = time.monotonic()
        if self._last_schedule is not None and now - self._last_schedule < 1.0:  # not across an idle engine
            dt = now - self._last_schedule
            self._step_s = dt if self._step_s is None else 0.9 * self._step_s + 0.1 * dt
            if not self._chunk_step:
                self._decode_step_s = dt if self._decode_step_s is None else 0.9 * self._decode_step_s + 0.1 * dt
        self._last_schedule = now
        self._admit_held()
        self._migrate()
        if self._switch() and self._held:  # a seed gave its prompt's blocks back: a held prompt may fit now,
            self._admit_held()             # in this step rather than the next
        # before the recall: a lane request is busy from its scheduling until _lane_ready sees its next
        # position computed, so with the recall first it never saw one (in-process lane, async scheduling:
        # H100 growth run of 2026-12-05, 17 migrations, 0 recalls, 16 requests decoding from the host tier
        # for ~115 s at 4-8% KV use); their reports through the connector (update_from_output) come
        # later than this check, and the CPU test saw those
        self._lane_ready()
        self._recall()
        # vLLM's watermark keeps blocks free when it admits waiting requests: raised by what running
        # long prefills still need, so short arrivals cannot take them (vLLM would then preempt
        # running requests to finish the prompt)
        # and by what the requests decoding on the device grow to until those prefills end: the short
        # requests vLLM admitted beside a long prompt took the blocks its next chunks needed as they grew,
        # and vLLM preempted (H100 hol run 90, long_chunk 2048: 82 running, KV at 96%, 56 preemptions; the
        # CPU engine test: the prompt itself)
        kvm, sc = self.kv_cache_manager, self.scheduler_config
        base, thr = kvm.watermark_blocks, sc.long_prefill_token_threshold
        chunked = self._chunk_budget()
        sc.long_prefill_token_threshold = self._long_chunk(thr, chunked)
        # and until their switch: a long prompt keeps its blocks in its hold (H200 hol run 99: 31 preemptions
        # right after the first prompt's last chunk, with the reserve gone with the prefill)
        prefill, (prefilling, unswitched) = self._prefill_reserve(), self._holding()
        growth, horizon = (self._growth_reserve(thr, chunked, prefilling or unswitched) if prefill or unswitched
                           else (0, 0))
        kvm.watermark_blocks = base + prefill + growth
        self._step_reserve = (kvm.block_pool.get_num_free_blocks(), prefill, growth, prefilling, unswitched, chunked,
                              horizon)
        # the list vLLM schedules: lane requests left out (not scheduled, nor preempted, in this step;
        # still counted against max_num_seqs, so vLLM admits no more than it has room for — on a P/D
        # decode instance with 128 running it had admitted past it and failed its own assertion);
        # spared ones first, so vLLM's FCFS victim (the list's last) is any other one before them
        held = self._busy | self._loading.keys() if self._loading else self._busy
        waits = self._switch_waits()
        if waits:
            held = held | waits
        hidden = [r for r in self.running if r.request_id in held]
        visible = [r for r in self.running if r.request_id not in held] if hidden else self.running
        spared = self._spared(visible)
        plan = self._prefill_cap(visible, spared, sc.long_prefill_token_threshold)
        max_running, max_tokens = self.max_num_running_reqs, self.max_num_scheduled_tokens
        if hidden or spared or plan:
            order = {id(r): i for i, r in enumerate(self.running)}
            if plan:
                visible = plan[0]
                self.max_num_scheduled_tokens = min(max_tokens, plan[1])
            elif spared:
                first = {id(r) for r in spared}
                visible = spared + [r for r in visible if id(r) not in first]
            self.running = visible
            self.max_num_running_reqs = max(0, max_running - len(hidden))
        # admitted long prompts not done prefilling, running or still in vLLM's queue (a first chunk counts too)
        chunking = [r for r in map(self.requests.get, self._reserved)
                    if r is not None and r.num_computed_tokens < r.num_prompt_tokens] if self._reserved else ()
        try:
            out = super().schedule(*args, **kwargs)
            self._chunk_step = any(r.request_id in out.num_scheduled_tokens for r in chunking)
            if prefill or unswitched:
                self._trace_reserve(out)
        finally:
            kvm.watermark_blocks, sc.long_prefill_token_threshold = base, thr
            self.max_num_running_reqs, self.max_num_scheduled_tokens = max_running, max_tokens
            if hidden or spared or plan:  # the running list's own order back; vLLM's new requests after it
                n = len(order)
                self.running = sorted(self.running + hidden, key=lambda r: order.get(id(r), n))
        if self.nelssa.lane and (self._host_end or self._switching):
            self._busy.update(r for r in out.num_scheduled_tokens if self._host_end.get(r) or r in self._switching)
            self._switched.update(r for r in out.num_scheduled_tokens if r in self._switching)
        return out

    def _switch_waits(self) -> set[str]:
        """Lane: the long prompts to leave out of this step (class docstring, long lane): admitted by their
        length (not migrating, not a hand-over), done prefilling, not yet switching, and with at most two
        segments of their anchor's range left to hand off (the last whole segment's move may still run
        when the prefill ends; a decode instance that clusters a whole prompt itself decodes on the device
        meanwhile); each for at most ``switch_hold_s`` from when it was first seen so."""
        cfg = self.nelssa
        if not cfg.lane or cfg.switch_hold_s <= 0 or not self._reserved:
            return set()
        pol, now, out = self.nelssa_policy, time.monotonic(), set()
        for rid in self._reserved:
            r = self.requests.get(rid)
            if (r is None or r.status != RequestStatus.RUNNING or rid in self._anchor or self._host_end.get(rid)
                    or rid in self._switching or rid in self._busy or rid in self._window or self._handed_over(r)):
                if rid in self._switching or self._host_end.get(rid):  # held until its switch (if it was)
                    self._end_hold(rid, now)
                else:
                    self._prefilled.pop(rid, None)
                continue
            a = self._anchor_of(r)
            if not a or r.num_computed_tokens < a or pol.goal(a, a) - self._done.get(rid, 0) > 2 * cfg.segment:
                continue
            if rid not in self._prefilled:
                self._prefilled[rid] = now
                self._count("switch_holds")
            if now - self._prefilled[rid] < cfg.switch_hold_s:
                out.add(rid)
        self.switch_held = out  # (read by tests: nelssa.bench.harness)
        return out

    def _end_hold(self, rid: str, now: float) -> None:
        """A request held for its switch (``_switch_waits``) switches: its hold timed (at most switch_hold_s)."""
        t = self._prefilled.pop(rid, None)
        if t is not None:
            self._conn.sched_stats.setdefault("switch_hold_s", []).append(min(now - t, self.nelssa.switch_hold_s))

    def _spared(self, running: list[Request]) -> list[Request]:
        """Running requests vLLM preempts only after all others (policy.Policy.spared), in their order.
        vLLM's FCFS policy preempts the running list's last request; its priority policy picks by
        (priority, arrival) whatever the order, and is left to do so."""
        if self.policy != SchedulingPolicy.FCFS:
            return []
        # nothing to reorder where no allocation of this step can fail: the step's prefill tokens and
        # every running request's next token + lookahead, each in a new block, fit in the free blocks
        bs = self.block_size
        worst = -(-self.scheduler_config.max_num_batched_tokens // bs) + len(running) * (
            1 + -(-(self.num_lookahead_tokens + self._manager.ahead) // bs))
        if self.kv_cache_manager.block_pool.get_num_free_blocks() > worst:
            return []
        spared = self.nelssa_policy.spared
        return [r for r in running if spared(r.num_computed_tokens, r.num_prompt_tokens)]

    def _prefill_cap(self, visible: list[Request], spared: list[Request], thr: int):
        """While a long request is resident (prefilling, handing off or decoding in the lane) and short
        requests decode, a step adds at most ``short_chunk`` (2048; 0: ``long_chunk``) tokens of short prompts
        to its decodes and long-prompt chunks (those sized as before: _long_chunk): the list vLLM
        schedules and its token budget from policy.step_plan (decodes first, long chunks next, short
        prompts last). Without it, the short prompts that a long prefill's small chunks held back all
        prefill in the first steps after it: on the H100 (hol run of 2026-12-05) a step of 2,974 tokens
        (118 ms) and two more of ~2,000 right after the second 100K prompt's last chunk, which gave the
        long decode phase its short-request ITL p99 (99.9 ms; 44.0 ms from 0.5 s into the phase on).
        None: vLLM's own order and budget (before any long request arrives, NELSSA schedules as stock
        vLLM). While no long prompt prefills (the resident ones decode or hold), ``short_chunk_decode`` takes
        ``short_chunk``'s place where set. ``thr``: this step's per-request chunk cap (_long_chunk)."""
        cfg = self.nelssa
        # a long request is resident: every one holds a reservation from its admission to its end
        # (_admit_held, _free_request), so the few reserved are looked at, not every running request
        # (this runs each step, with no long request too)
        resident = [r for r in map(self.requests.get, self._reserved)
                    if r is not None and r.status == RequestStatus.RUNNING and self._long(r)]
        if not resident:
            return None
        short = cfg.short_chunk
        if cfg.short_chunk_decode >= 0 and all(r.num_computed_tokens >= r.num_prompt_tokens for r in resident):
            short = cfg.short_chunk_decode
        cap = short or cfg.long_chunk
        if not cap:
            return None
        first = {id(r) for r in spared}
        kinds, new = [], []
        for r in visible:
            n = r.num_tokens_with_spec + r.num_output_placeholders - r.num_computed_tokens
            if id(r) in first:
                kinds.append("spared")
            elif r.num_computed_tokens >= r.num_prompt_tokens:
                kinds.append("decode")
            else:
                kinds.append("long" if self._long(r) else "prompt")
            new.append(min(n, thr) if thr > 0 else n)
        if "decode" not in kinds and "spared" not in kinds:
            return None
        order, budget = step_plan(kinds, new, cap)
        return [visible[i] for i in order], budget

    def _lane_ready(self) -> None:
        """Busy requests whose next position the lane has computed are schedulable now, when the lane
        runs in this process (vLLM's in-process executor: the worker shares the engine core's process).
        The lane's report through the connector (update_from_output) rides on the output of the step
        that is running when a batch ends; with async scheduling that request would be scheduled two
        to three steps later (the H200 profile of run 12: 28-100 ms in which the lane is idle). The
        position checked is the one the scheduler expects, so a report can never free a later job."""
        lane = runtime.lane()
        if lane is None or not self._busy:
            return
        for rid in list(self._busy):
            r = self.requests.get(rid)
            if r is not None and lane.ready(rid, r.num_computed_tokens):
                self._busy.discard(rid)

    def _chunk_budget(self) -> int:
        """policy.chunk_budget: ``long_chunk_solo`` (in effect: NelssaConfig.chunk_solo) while no running request
        decodes from the host tier (its host range in use), else ``long_chunk``."""
        cfg = self.nelssa
        decoding = bool(cfg.chunk_solo and self._host_end) and any(self._host_end.get(r.request_id) for r in self.running)
        return chunk_budget(cfg.long_chunk, cfg.chunk_solo, decoding)

    def _long_chunk(self, thr: int, budget: int) -> int:
        """This step's cap on a prefill chunk: policy.prefill_chunk at ``budget`` (``_chunk_budget``) at the
        deepest running long prefill's context while a short request decodes; else vLLM's threshold ``thr``."""
        if not budget or not self._reserved:  # every long request in vLLM's queues was admitted here (_reserved)
            return thr
        done, short_decoding = None, False
        for r in self.running:
            if self._long(r):
                if r.num_computed_tokens < r.num_prompt_tokens:
                    done = max(done or 0, r.num_computed_tokens)
            elif r.num_computed_tokens >= r.num_prompt_tokens:
                short_decoding = True
        # a long prompt vLLM may admit in this step: its first chunk too (it had vLLM's threshold alone)
        for r in self.waiting:
            if self._long(r):
                done = max(done or 0, r.num_computed_tokens)
        if done is None or not short_decoding:
            return thr
        c = prefill_chunk(budget, done, self._l_eq, self.block_size)
        return min(c, thr) if thr > 0 else c

    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        rid = request.request_id
        if self.nelssa is not None and self.nelssa.lane and (rid in self._host_end or rid in self._switching
                                                               or rid in self._busy):
            self._lane_reqs.add(rid)
        self._loading.pop(rid, None)
        self._prefilled.pop(rid, None)
        self._busy.discard(request.request_id)
        self._switching.pop(request.request_id, None)
        self._switched.discard(request.request_id)
        self._reserved.pop(request.request_id, None)
        self._on_node.pop(request.request_id, None)
        self._window.pop(request.request_id, None)
        self._seeding.pop(request.request_id, None)
        self._seeded.discard(request.request_id)
        self._fail_soon.pop(request.request_id, None)
        self._done.pop(request.request_id, None)
        self._host_end.pop(request.request_id, None)
        self._switched_at.pop(request.request_id, None)
        self._anchor.pop(request.request_id, None)
        self._migrating_at.pop(request.request_id, None)
        return super()._free_request(request, delay_free_blocks)

    def _free_request_blocks(self, request: Request):
        """A finished lane request's blocks are popped from vLLM's manager (vLLM's own deferral primitive) and
        kept here until the worker reports the request released (lane.py, 6): its lane job may still run,
        and it writes the request's window. Preempted requests (the worker waits for their jobs) and all
        others go to vLLM at once."""
        rid = request.request_id
        if not (request.is_finished() and rid in self._lane_reqs):
            return super()._free_request_blocks(request)
        self._lane_reqs.discard(rid)
        if rid in self._lane_released:  # the worker released it while a connector held the blocks
            self._lane_released.discard(rid)
            return super()._free_request_blocks(request)
        self._fenced[rid] = self.kv_cache_manager.pop_blocks_for_free(request)

    def _release(self, ids) -> None:
        """The worker's lane is done with these finished requests (lane.py, 6): their blocks to the pool."""
        for rid in ids:
            blocks = self._fenced.pop(rid, None)
            if blocks is not None:
                self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))  # tail blocks evicted first
            elif rid in self._lane_reqs:  # finished, blocks still held by a connector (_free_request_blocks)
                self._lane_released.add(rid)

    def has_requests(self) -> bool:
        """Also while lane requests' blocks wait for their release: the engine keeps stepping until the
        worker has reported it (its lane job ends within a batch)."""
        return super().has_requests() or bool(self._fenced)

    def finish_requests(self, request_ids, finished_status):
        if self._held and request_ids is not None:
            ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
            gone = [r for r in self._held if r.request_id in ids]
            for r in gone:
                self._held.remove(r)
                self._on_node.pop(r.request_id, None)
                self._stop_awaiting(r.request_id)
                r.status = finished_status
                self._unscheduled_finished(r)
        return super().finish_requests(request_ids, finished_status)

    def get_num_unfinished_requests(self) -> int:
        return super().get_num_unfinished_requests() + len(self._held) + len(self._rejected)

    # ------------------------------------------------------------ errors
    def update_from_output(self, scheduler_output, model_runner_output):
        errors: list[EngineCoreOutput] = []
        clients: list[int] = []
        kvo = model_runner_output.kv_connector_output
        meta = nelssa_worker_meta(kvo.kv_connector_worker_meta) if kvo is not None else None
        failed = getattr(meta, "failed", None)
        if self._fail_soon:
            failed = {**self._fail_soon, **(failed or {})}
            self._fail_soon = {}
        self._release(getattr(meta, "released", None) or ())
        for rid, pos in (getattr(meta, "lane", None) or {}).items():
            if self._seeding.get(rid) == pos:  # a window admission's first position (_seed)
                self._seeded.add(rid)
            r = self.requests.get(rid)
            if r is not None and r.num_computed_tokens <= pos:  # else older than its scheduling (_lane_ready)
                self._busy.discard(rid)
        for rid, (end, gen) in (getattr(meta, "handoffs", None) or {}).items():
            r = self.requests.get(rid)
            if r is not None and gen == r.num_preemptions:  # else a report from before a preemption
                self._done[rid] = max(self._done.get(rid, 0), end)
        for rid in getattr(meta, "recalled", None) or ():  # after its moves' reports (recall.py, 3)
            self._recalled(rid)
        if failed:
            for req in self.finish_requests(failed.keys(), RequestStatus.FINISHED_ERROR):
                errors.append(self._error_output(req, f"nelssa: {failed[req.request_id]}"))
                clients.append(req.client_index)
        for req, msg in self._rejected:
            errors.append(self._error_output(req, msg))
            clients.append(req.client_index)
        self._rejected.clear()
        out = super().update_from_output(scheduler_output, model_runner_output)
        for client, eco in zip(clients, errors):
            if client in out:
                out[client].outputs.append(eco)
            else:
                out[client] = EngineCoreOutputs(outputs=[eco])
        if self.nelssa is not None:
            self._conn.sched_stats["reserved_bytes"] = sum(self._reserved.values())
        return out

    @staticmethod
    def _error_output(req: Request, msg: str) -> EngineCoreOutput:
        return EngineCoreOutput(request_id=req.request_id, new_token_ids=[], finish_reason=req.get_finished_reason(),
                                stop_reason=msg, events=req.take_events(), trace_headers=req.trace_headers)


class NelssaAsyncScheduler(NelssaScheduler, AsyncScheduler):
    """NelssaScheduler over vLLM's AsyncScheduler (selected by NelssaScheduler when async scheduling is on)."""
