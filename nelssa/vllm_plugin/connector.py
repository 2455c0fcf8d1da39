"""NELSSA's KV connector: the scheduler <-> worker channel of the host tier, and NELSSA's metrics.

It moves no KV itself (in P/D it runs beside NixlConnector in a MultiConnector).
  * scheduler -> worker, each step (NelssaConnectorMetadata): ``host_ends``, the host range [sink, H)
    each scheduled long request uses in this step (NelssaScheduler decides it; the KV-cache manager
    frees the blocks below it in the same step's scheduling); ``anchors``, the policy anchor of each
    scheduled request that is migrating or migrated (a long prompt's anchor is its length, derived
    by each side); ``switching`` (with the long lane), the host range [sink, H) of each scheduled request
    that switches in this step: it still holds its blocks below H and is computed on the device, and
    the lane computes its next position with H (the blocks are freed once H is in use, lane.py 0).
  * worker -> scheduler, each step (NelssaWorkerMeta): ``handoffs``, the ends of hand-offs completed
    since the last report (with the request's preemption count, so a stale report is ignored), and
    ``failed``, requests whose host-tier work failed (finished with an error before any token of
    theirs from that step is emitted); ``lane``, the requests whose next position the long lane
    computed (lane.py: the scheduler may schedule them again).
  * P/D hand-over (handover.py has the contract): on a prefill instance with ``handover``,
    ``request_finished`` names a long prompt's handle in its kv_transfer_params and holds its blocks,
    the metadata's ``release`` carries the handle to the worker, and ``get_finished`` reports the
    request once the worker has released it on the node; on a decode instance ``on_new_request`` reads
    the handle and the metadata's ``adopt`` carries it to the worker (``adopt_now``: a window admission,
    adopted from the step after its allocation on, unscheduled meanwhile).
  * worker: the host tier's counters (KVConnectorStats) reach the API process, where
    build_prom_metrics exports them on /metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorWorkerMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from nelssa.sparse import hostmem
from nelssa.vllm_plugin import handover, runtime

CONNECTOR = {"kv_connector": "NelssaConnector", "kv_connector_module_path": "nelssa.vllm_plugin.connector",
             "kv_role": "kv_both"}


@dataclass
class NelssaConnectorMetadata(KVConnectorMetadata):
    host_ends: dict[str, int] = field(default_factory=dict)
    anchors: dict[str, int] = field(default_factory=dict)
    switching: dict[str, int] = field(default_factory=dict)
    release: dict[str, str] = field(default_factory=dict)  # P: finished request -> hand-over handle
    adopt: dict[str, str] = field(default_factory=dict)    # D: request scheduled first -> hand-over handle
    adopt_now: dict[str, tuple[str, int]] = field(default_factory=dict)  # D: window admission -> (handle, H0)
    # D, with the lane: window admission -> (position, H0, its input token, its block ids up to the position):
    # the lane computes the prompt's last position before the request's first step (handover.py, 6)
    seeds: dict[str, tuple[int, int, int, list[int]]] = field(default_factory=dict)
    recalls: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # request -> (H, new block row): recall.py


@dataclass
class NelssaWorkerMeta(KVConnectorWorkerMetadata):
    failed: dict[str, str] = field(default_factory=dict)
    handoffs: dict[str, tuple[int, int]] = field(default_factory=dict)  # request -> (end, generation)
    lane: dict[str, int] = field(default_factory=dict)  # request -> position the lane computed (lane.py)
    released: list[str] = field(default_factory=list)  # finished requests the lane is done with (lane.py, 6)
    recalled: list[str] = field(default_factory=list)  # requests loaded back onto the device (recall.py, 3)

    def aggregate(self, other: "NelssaWorkerMeta") -> "NelssaWorkerMeta":
        return NelssaWorkerMeta({**self.failed, **other.failed}, {**self.handoffs, **other.handoffs},
                                {**self.lane, **other.lane}, [*self.released, *other.released],
                                [*self.recalled, *other.recalled])


def _ours(obj, cls, children: str):
    """``obj`` if it is a ``cls``, else its child that is (a MultiConnector keeps its connectors in
    ``_connectors`` and their metadata in ``metadata``), else None."""
    if isinstance(obj, cls):
        return obj
    return next((x for x in getattr(obj, children, ()) or () if isinstance(x, cls)), None)


def nelssa_worker_meta(meta) -> "NelssaWorkerMeta | None":
    """Ours from a step's aggregated worker metadata."""
    return _ours(meta, NelssaWorkerMeta, "metadata")


def step_host_ends(meta) -> dict[str, int]:
    """This step's host ranges from the scheduler output's connector metadata."""
    m = _ours(meta, NelssaConnectorMetadata, "metadata")
    return m.host_ends if m is not None else {}


def step_switching(meta) -> dict[str, int]:
    """This step's switching requests (lane): request -> the H its lane job uses."""
    m = _ours(meta, NelssaConnectorMetadata, "metadata")
    return m.switching if m is not None else {}


def step_handovers(meta) -> tuple[dict[str, str], dict[str, str]]:
    """This step's hand-overs (handover.py): (P: requests to release, D: requests to adopt) -> handle."""
    m = _ours(meta, NelssaConnectorMetadata, "metadata")
    return (m.release, m.adopt) if m is not None else ({}, {})


def step_adoptions(meta) -> dict[str, tuple[str, int]]:
    """This step's window admissions to adopt at once (handover.py, 6): request -> (handle, H0)."""
    m = _ours(meta, NelssaConnectorMetadata, "metadata")
    return m.adopt_now if m is not None else {}


def step_seeds(meta) -> dict[str, tuple[int, int, int, list[int]]]:
    """This step's lane seeds — window admissions' first positions (handover.py, 6) and the switches of long
    prompts held for them (scheduler._seed_switch): request -> (position, H, token, blocks)."""
    m = _ours(meta, NelssaConnectorMetadata, "metadata")
    return m.seeds if m is not None else {}


def step_recalls(meta) -> dict[str, tuple[int, list[int]]]:
    """This step's recalls (recall.py, 1): request -> (H, its new block row)."""
    m = _ours(meta, NelssaConnectorMetadata, "metadata")
    return m.recalls if m is not None else {}


def step_anchors(meta) -> dict[str, int]:
    """This step's anchors of migrating/migrated requests (policy.Policy.anchor)."""
    m = _ours(meta, NelssaConnectorMetadata, "metadata")
    return m.anchors if m is not None else {}


# The stats' gauges: a report's value replaces the last (the others are counts, lists of seconds or per-part sums)
_LATEST = frozenset({"host_bytes", "host_memory_free_bytes", "reserved_bytes"})


@dataclass
class NelssaStats(KVConnectorStats):
    """data: long_requests, failures, moved_tokens, moved_bytes (counts); _LATEST (gauges); attn_s,
    cluster_s, migration_s, handoff_wait_s, offload_step_s, host_wait_s (lists of seconds); _BY_PART
    (per-part sums, e.g. offload_split_s: the forward thread's seconds per part in steps with offloaded rows)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "NelssaStats":
        d = dict(self.data)
        for k, v in other.data.items():
            if isinstance(v, dict):  # per-part sums: parts of either side, each counted once
                mine = d.get(k, {})
                d[k] = {p: mine.get(p, 0.0) + v.get(p, 0.0) for p in {**mine, **v}}
            elif isinstance(v, list):
                d[k] = d.get(k, []) + v
            elif k in _LATEST:
                d[k] = v
            else:
                d[k] = d.get(k, 0) + v
        return NelssaStats(d)

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            if isinstance(v, dict):
                out.update({f"{k}_{p}": x for p, x in v.items()})
            elif isinstance(v, list):
                out[f"{k}_count"] = len(v)
                out[f"{k}_mean_ms"] = 1e3 * sum(v) / len(v) if v else 0.0
            else:
                out[k] = v
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


# The stats' per-part dicts (NelssaStats), each a counter labelled by part, path or outcome:
# key -> (metric name, label, documentation)
_BY_PART = {
    "offload_split_s": ("nelssa:offload_split_seconds", "part",
                        "Steps with offloaded rows: forward-thread seconds per part of the split-batch layers (select, "
                        "stock, window, wait, merge)"),
    "lane_split_s": ("nelssa:lane_split_seconds", "part",
                     "Long lane: its thread's seconds per part (search: the centroid search, select: the host call's "
                     "preparation and launch, window, merge, wait, dense, replay)"),
    "move_split_s": ("nelssa:move_split_seconds", "part",
                     "Moves to the host tier (nelssa:clustering_seconds): the hand-off thread's seconds per part "
                     "(read, kmeans, pack: tables, packing and the copy to host memory, store: nelssa-node's store "
                     "call)"),
    "move_thread_s": ("nelssa:move_thread_seconds", "part",
                      "Moves to the host tier: their wall seconds by the hand-off thread's state (Linux schedstat): "
                      "cpu (running), runq (runnable, waiting for a core), blocked (neither: the GIL, stream "
                      "waits)"),
    "host_call_split_s": ("nelssa:host_call_split_seconds", "part",
                          "In-process host attention calls (nelssa:host_attention_seconds) by part: prep (checks, "
                          "queries), fork (until the last pool thread entered), tables (spans and work items), items "
                          "(the fused pass: the threads' mean busy time), wait (its wall time beyond that), combine"),
    "node_comm_split_s": ("nelssa:node_comm_split_seconds", "part",
                          "nelssa:node_comm_seconds by part: copy (this side's copies into and out of the channel), "
                          "wire (post to answer seen minus the node's time: the two hand-offs), dispatch (the node's "
                          "time beyond its slowest kernel)"),
    "lane_timeline_s": ("nelssa:lane_timeline_seconds", "part",
                        "Long lane batches with host calls, launch to end: lead (until the first host call), host "
                        "(calls running), between (device work and flag latency between two layers' calls), tail "
                        "(lane_host.py, 7)"),
    "lane_beside_s": ("nelssa:lane_beside_seconds", "beside",
                      "Long lane batches' seconds by the mean requests of the engine steps run during them (0, "
                      "1-15, 16-47, 48+; lane rows not counted): the steps sharing the device with the lane"),
    "lane_beside_n": ("nelssa:lane_beside_batches", "beside",
                      "Long lane batches by the mean requests of the engine steps run during them (as "
                      "nelssa:lane_beside_seconds)"),
    "lane_paths": ("nelssa:lane_batches", "path",
                   "Long lane: batches by how they ran (replay, captured, or why enqueued: new_key, no_window, broken, "
                   "capture_failed)"),
    "migration_context_s": ("nelssa:migration_by_context_seconds", "context",
                            "Migrations: start to the switch (as nelssa:migration_seconds) summed by the tokens the "
                            "request has on the host tier then (<4K, 4K-8K, ... 64K-128K, >=128K): hand-off time vs "
                            "context length"),
    "migration_context_n": ("nelssa:migrations_by_context", "context",
                            "Migrations completed, by the tokens the request has on the host tier at its switch (as "
                            "nelssa:migration_by_context_seconds)"),
    "lane_drafts": ("nelssa:lane_drafts", "outcome",
                    "Long lane: drafts (a long request's next position computed before the step sampled its token, "
                    "lane_spec.py) by outcome: run, verified, mismatch (the step sampled another token: the request "
                    "fails), stale (its host range moved), stalled (its next slot was not allocated yet: the chain "
                    "waited for a step)"),
}


class NelssaPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def per_engine(metric):
            return create_metric_per_engine(metric, per_engine_labelvalues)

        c, g, h = self._counter_cls, self._gauge_cls, self._histogram_cls
        buckets = [1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0]
        self.m = {
            "long_requests": per_engine(c(name="nelssa:long_requests", labelnames=labelnames,
                                          documentation="Long requests whose KV moved to the host tier")),
            "migrations_started": per_engine(c(name="nelssa:migrations_started", labelnames=labelnames,
                                               documentation="Requests that grew past T_input and began "
                                                             "migrating to the host tier")),
            "migrations_completed": per_engine(c(name="nelssa:migrations_completed", labelnames=labelnames,
                                                 documentation="Migrations switched to host attention")),
            "failures": per_engine(c(name="nelssa:host_failures", labelnames=labelnames,
                                     documentation="Host-tier failures (requests finished with an error)")),
            "handoff_failures": per_engine(c(name="nelssa:handoff_failures", labelnames=labelnames,
                                             documentation="Moves to the host tier that failed (the request "
                                                           "stays on its device blocks; logged)")),
            "handovers_released": per_engine(c(name="nelssa:handovers_released", labelnames=labelnames,
                                               documentation="P/D, prefill instance: long prompts released on "
                                                             "nelssa-node for the decode instance")),
            "handover_failures": per_engine(c(name="nelssa:handover_failures", labelnames=labelnames,
                                              documentation="P/D: hand-overs given up (prefill instance: a move "
                                                            "or the release failed, D clusters the prompt; decode "
                                                            "instance: a window admission's adoption failed, the "
                                                            "request fails)")),
            "handovers_adopted": per_engine(c(name="nelssa:handovers_adopted", labelnames=labelnames,
                                              documentation="P/D, decode instance: long prompts adopted from the "
                                                            "prefill instance instead of clustered")),
            "handover_windows": per_engine(c(name="nelssa:handover_windows", labelnames=labelnames,
                                             documentation="P/D, decode instance: hand-overs admitted with "
                                                           "device blocks for their window only, read so over "
                                                           "NIXL")),
            "handover_window_blocks_spared": per_engine(c(
                name="nelssa:handover_window_blocks_spared", labelnames=labelnames,
                documentation="P/D, decode instance: device blocks window admissions did not allocate "
                              "(and NIXL did not read)")),
            "handover_lane_seeds": per_engine(c(name="nelssa:handover_lane_seeds", labelnames=labelnames,
                                                documentation="P/D, decode instance with the lane: window "
                                                              "admissions whose first position the lane computed "
                                                              "(their first step not a split step)")),
            "handover_fallbacks": per_engine(c(name="nelssa:handover_fallbacks", labelnames=labelnames,
                                               documentation="P/D, decode instance: hand-overs not adopted (not "
                                                             "released in time, a mismatch): clustered here")),
            "handover_wait_s": per_engine(h(name="nelssa:handover_wait_seconds", labelnames=labelnames,
                                            buckets=buckets, documentation="P/D, decode instance: per adoption, "
                                            "its start to the node's answer (waits for the prefill instance's "
                                            "release)")),
            "handover_lag_s": per_engine(h(name="nelssa:handover_lag_seconds", labelnames=labelnames,
                                           buckets=buckets, documentation="P/D, prefill instance: per release, "
                                           "the request's end to its release on the node (its moves still "
                                           "running; the decode instance waits that long to adopt it)")),
            "moved_tokens": per_engine(c(name="nelssa:moved_tokens", labelnames=labelnames,
                                         documentation="Tokens moved to the host tier (prompts, chunks and "
                                                       "migrations)")),
            "moved_bytes": per_engine(c(name="nelssa:moved_bytes", labelnames=labelnames,
                                        documentation="KV bytes (all layers, keys and values) those moves read "
                                                      "from device memory")),
            "recalls": per_engine(c(name="nelssa:recalls", labelnames=labelnames,
                                    documentation="Migrated requests returned to the device once it had room: "
                                                  "their KV loaded back from the host tier")),
            "recall_s": per_engine(h(name="nelssa:recall_seconds", labelnames=labelnames, buckets=buckets,
                                     documentation="Recalls by load: start to the request's report as a device "
                                                   "request (its load, after its moves, and the lane's release)")),
            "recall_load_s": per_engine(h(name="nelssa:recall_load_seconds", labelnames=labelnames,
                                          buckets=buckets, documentation="Recalls by load: the read-back from "
                                          "the host tier and the write into the new device blocks")),
            "recalled_tokens": per_engine(c(name="nelssa:recalled_tokens", labelnames=labelnames,
                                            documentation="Tokens loaded back onto the device by recalls")),
            "switch_holds": per_engine(c(name="nelssa:switch_holds", labelnames=labelnames,
                                         documentation="Lane: long prompts left out of the steps from the end of "
                                                       "their prefill until their switch (config switch_hold_s)")),
            "switch_seeds": per_engine(c(name="nelssa:switch_seeds", labelnames=labelnames,
                                         documentation="Lane: long prompts held so whose switch was a lane seed "
                                                       "(their next position computed by the lane, no switch "
                                                       "step on the device)")),
            "switch_hold_s": per_engine(h(name="nelssa:switch_hold_seconds", labelnames=labelnames,
                                          buckets=buckets, documentation="Lane: per long prompt held so, the "
                                          "time until its switch (its last segment's hand-off)")),
            "migration_s": per_engine(h(name="nelssa:migration_seconds", labelnames=labelnames, buckets=buckets,
                                        documentation="Migrations: start (under pressure) to the switch to host "
                                                      "attention, the request decoding on its device blocks "
                                                      "meanwhile (its moves: nelssa:clustering_seconds)")),
            "host_bytes": per_engine(g(name="nelssa:host_bytes", labelnames=labelnames, multiprocess_mode="mostrecent",
                                       documentation="Host-tier bytes in use (clustered KV)")),
            "host_memory_free_bytes": per_engine(g(name="nelssa:host_memory_free_bytes", labelnames=labelnames,
                                                   multiprocess_mode="mostrecent",
                                                   documentation="Host-tier memory mapped and touched, free for the "
                                                                 "next moves (config host_reserve, sparse/hostmem.py)")),
            "host_memory_mappings": per_engine(c(name="nelssa:host_memory_mappings", labelnames=labelnames,
                                                 documentation="Host-tier allocations of 2 MiB or more that mapped new "
                                                               "memory (its page faults paid by the move's copy) "
                                                               "instead of reusing free touched memory")),
            "reserved_bytes": per_engine(g(name="nelssa:host_reserved_bytes", labelnames=labelnames,
                                           multiprocess_mode="mostrecent",
                                           documentation="Host-tier bytes reserved by admitted long requests")),
            "attn_s": per_engine(h(name="nelssa:host_attention_seconds", labelnames=labelnames, buckets=buckets,
                                   documentation="Host sparse attention per layer and step (all long requests)")),
            "cluster_s": per_engine(h(name="nelssa:clustering_seconds", labelnames=labelnames, buckets=buckets,
                                      documentation="Clustering + move to the host tier, per request and move")),
            "handoff_wait_s": per_engine(h(name="nelssa:handoff_wait_seconds", labelnames=labelnames, buckets=buckets,
                                           documentation="Step-path waits for a hand-off not done by its switch")),
            "offload_step_s": per_engine(h(name="nelssa:offload_step_seconds", labelnames=labelnames, buckets=buckets,
                                           documentation="Forward wall time of steps with offloaded rows")),
            "offload_decode_step_s": per_engine(h(name="nelssa:offload_decode_step_seconds", labelnames=labelnames,
                                                  buckets=buckets, documentation="Forward wall time of steps with "
                                                  "offloaded rows and no prefill chunk")),
            "lane_batch_s": per_engine(h(name="nelssa:lane_batch_seconds", labelnames=labelnames, buckets=buckets,
                                         documentation="Long lane: one batch of offloaded rows (one token each)")),
            "lane_rows": per_engine(c(name="nelssa:lane_rows", labelnames=labelnames,
                                      documentation="Long lane: offloaded rows computed (tokens of long requests)")),
            "lane_step_s": per_engine(h(name="nelssa:lane_step_seconds", labelnames=labelnames, buckets=buckets,
                                        documentation="Forward wall time of steps with lane rows")),
            "host_wait_s": per_engine(h(name="nelssa:host_wait_seconds", labelnames=labelnames, buckets=buckets,
                                        documentation="Per step with offloaded rows: time waiting for host results")),
            "node_comm_s": per_engine(h(name="nelssa:node_comm_seconds", labelnames=labelnames, buckets=buckets,
                                        documentation="Through nelssa-node (native plane), per layer call: round "
                                                      "trip minus the slowest device's kernel")),
            "lane_timeline_batches": per_engine(c(name="nelssa:lane_timeline_batches", labelnames=labelnames,
                                                  documentation="Long lane: batches with host calls whose timeline "
                                                                "is in nelssa:lane_timeline_seconds")),
            "lane_finish_cancels": per_engine(c(name="nelssa:lane_finish_cancels", labelnames=labelnames,
                                                documentation="Long lane: requests that finished while a job of "
                                                              "theirs ran (cancelled; their blocks and host KV "
                                                              "kept until it ended, lane.py 6)")),
            "lane_captures": per_engine(c(name="nelssa:lane_captures", labelnames=labelnames,
                                          documentation="Long lane: batches captured as one CUDA graph (lane_batch.py)")),
            "lane_capture_failures": per_engine(c(name="nelssa:lane_capture_failures", labelnames=labelnames,
                                                  documentation="Long lane: batch captures that failed (logged; "
                                                                "that request set runs enqueued)")),
            "cuda_alloc_retries": per_engine(c(name="nelssa:cuda_alloc_retries", labelnames=labelnames,
                                               documentation="Worker: torch allocator retries after an out-of-memory "
                                                             "(cached blocks freed: the device synchronises)")),
            "cuda_device_frees": per_engine(c(name="nelssa:cuda_device_frees", labelnames=labelnames,
                                              documentation="Worker: cudaFree calls of torch's allocator (each waits "
                                                            "for the whole device)")),
            "cuda_sync_all_streams": per_engine(c(name="nelssa:cuda_sync_all_streams", labelnames=labelnames,
                                                  documentation="Worker: torch allocator synchronisations of all "
                                                                "streams")),
        }
        # labelled by part (or path, outcome) as well: one counter per stats dict (_BY_PART)
        self._by_part = {k: c(name=name, labelnames=[*labelnames, label], documentation=doc)
                         for k, (name, label, doc) in _BY_PART.items()}
        self._labels = per_engine_labelvalues

    def observe(self, data: dict[str, Any], engine_idx: int = 0):
        for k, counter in self._by_part.items():
            for value, x in data.get(k, {}).items():
                counter.labels(*self._labels[engine_idx], value).inc(x)
        for k, v in data.items():
            m = self.m.get(k)
            if m is None:
                continue
            if isinstance(v, list):
                for x in v:
                    m[engine_idx].observe(x)
            elif k in _LATEST:
                m[engine_idx].set(v)
            elif v:
                m[engine_idx].inc(v)


class NelssaConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.sched_stats: dict[str, Any] = {}  # filled by NelssaScheduler (scheduler role)
        self.host_ends: dict[str, int] = {}    # set by NelssaScheduler (scheduler role): request -> H in use
        self.anchors: dict[str, int] = {}      # set by NelssaScheduler: migrated request -> anchor
        self.switching: dict[str, int] = {}    # set by NelssaScheduler (lane): switching request -> H
        self.handover_end = None               # set by NelssaScheduler on P (handover): request -> H0 or 0
        self._release: dict[str, str] = {}     # P: finished hand-overs not yet sent to the worker
        self._adopt: dict[str, str] = {}       # D: hand-overs not yet scheduled
        self.window: dict[str, int] = {}       # set by NelssaScheduler on D: window admission -> H0
        self._adopt_now: dict[str, tuple[str, int]] = {}  # D: window admissions allocated, not yet sent
        self.seeds: dict[str, tuple[int, int, int, list[int]]] = {}  # set by NelssaScheduler (lane): not yet sent
        self.recalls: dict[str, tuple[int, list[int]]] = {}  # set by NelssaScheduler: recalls not yet sent (recall.py)
        self._alloc_next = 0.0                 # worker: when the allocator's counters are read next
        self._alloc_last: dict[str, int] = {}  # worker: their values at the last read
        self._mappings = 0                     # worker: hostmem's new mappings at the last report

    # ---- scheduler side: nothing to load, nothing to send
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        """D: a window admission (handover.py, 6) is adopted from the step after its allocation on, while
        NIXL reads its window (it is not scheduled before both are done)."""
        rid = request.request_id
        if rid in self.window and rid in self._adopt:
            self._adopt_now[rid] = (self._adopt.pop(rid), self.window[rid])

    def on_new_request(self, request) -> None:
        """D: a request handed over by its prefill instance (handover.py, 4). A malformed entry is logged
        and the request clustered here (its KV comes whole over NIXL): vLLM's add_request must not raise."""
        try:
            h = handover.handle_of(request.kv_transfer_params)
        except ValueError as e:
            import logging
            logging.getLogger("vllm.nelssa").error("request %s: %s; it is clustered here", request.request_id, e)
            return
        if h:
            self._adopt[request.request_id] = h

    def drop_adoption(self, request_id: str) -> None:
        """D: the scheduler admits this request without its hand-over (not released in time): no adoption."""
        self._adopt.pop(request_id, None)

    def build_connector_meta(self, scheduler_output):
        sched = scheduler_output.num_scheduled_tokens
        release, self._release = self._release, {}
        adopt = {r: self._adopt.pop(r) for r in [r for r in self._adopt if r in sched]}
        now, self._adopt_now = self._adopt_now, {}
        seeds, self.seeds = self.seeds, {}
        recalls, self.recalls = self.recalls, {}
        return NelssaConnectorMetadata({r: h for r, h in self.host_ends.items() if r in sched},
                                       {r: a for r, a in self.anchors.items() if r in sched},
                                       {r: h for r, h in self.switching.items() if r in sched}, release, adopt, now,
                                       seeds, recalls)

    def request_finished(self, request, block_ids):
        """P with ``handover`` (handover.py, 1): a long prompt prefilled for remote decode gets a handle in
        its kv_transfer_params and keeps its blocks until the worker has released it on the node."""
        from vllm.v1.request import RequestStatus
        rid = request.request_id
        self._adopt.pop(rid, None)
        self._adopt_now.pop(rid, None)
        self.seeds.pop(rid, None)
        self.recalls.pop(rid, None)
        f = self.handover_end
        if f is None or not (request.kv_transfer_params or {}).get("do_remote_decode") or request.status not in (
                RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None
        h0 = f(request)
        if not h0:
            return False, None
        handle = handover.new_handle()
        self._release[rid] = handle
        return True, handover.params(handle, h0, self._vllm_config.cache_config.block_size)

    # ---- worker side
    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids):
        """Worker: finished requests whose hand-over has ended (handover.py, 3): their blocks can go."""
        return runtime.take_handed_over() or None, None

    def build_connector_worker_meta(self):
        new, done, rel = runtime.take_new_failures(), runtime.take_handoffs(), runtime.take_released()
        back = runtime.take_recalled()
        lane = runtime.lane()
        ln = lane.take_reports() if lane is not None else {}
        return NelssaWorkerMeta(new, done, ln, rel, back) if new or done or ln or rel or back else None

    def get_kv_connector_stats(self):
        if self._role == KVConnectorRole.SCHEDULER:
            d, self.sched_stats = self.sched_stats, {}
            return NelssaStats(d) if d else None
        host = runtime.host()
        if host is None:
            return None
        d = host.stats.take()
        d["host_bytes"] = host.nbytes
        mem = hostmem.stats()
        d["host_memory_free_bytes"] = mem["free_bytes"]
        d["host_memory_mappings"], self._mappings = mem["misses"] - self._mappings, mem["misses"]
        d.update(self._cuda_allocator_events())
        return NelssaStats(d)

    _ALLOC_EVENTS = (("num_alloc_retries", "cuda_alloc_retries"), ("num_device_free", "cuda_device_frees"),
                     ("num_sync_all_streams", "cuda_sync_all_streams"))

    def _cuda_allocator_events(self) -> dict[str, int]:
        """Worker, CUDA: events of torch's caching allocator since the last report that synchronise the
        device (a retry after an out-of-memory frees cached blocks; cudaFree waits for every stream),
        read at most every 0.5 s: a cause of whole-engine stalls to look for in a benchmark."""
        now = time.monotonic()
        if now < self._alloc_next or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return {}
        self._alloc_next = now + 0.5
        ms = torch.cuda.memory_stats()
        cur = {name: int(ms.get(key, 0)) for key, name in self._ALLOC_EVENTS}
        last, self._alloc_last = self._alloc_last, cur
        return {k: v - last.get(k, 0) for k, v in cur.items() if v > last.get(k, 0)}

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return NelssaStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return NelssaPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def find_connector(connector=None):
    """Our NelssaConnector in ``connector`` (default: this worker process's KV transfer group), alone or
    inside a MultiConnector, or None."""
    if connector is None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
        if not has_kv_transfer_group():
            return None
        connector = get_kv_transfer_group()
    return _ours(connector, NelssaConnector, "_connectors")
