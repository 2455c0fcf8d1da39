"""In-process host tier (engine "local"): host-memory KV store + a sparse-attention pool.

Attention runs on one submission thread calling the C++ kernel (GIL released) whose OpenMP team is
sized by NELSSA_POOL_THREADS and optionally pinned by NELSSA_AFFINITY_CORES; the caller keeps
running device work and collects the (output, LSE) later. Failures raise HostError: callers must
fail the affected requests, never merge a partial result.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from nelssa._ext import ext
from nelssa.config import NelssaConfig
from nelssa.sparse import ClusteredKV, RequestKV, Selection, attend, prepare_attend
from nelssa.sparse import hostmem
from nelssa.sparse.clustered import cluster_part, pack_parts, parts_stats, settled


class HostError(RuntimeError):
    """The host tier could not serve a request."""


class HostStats:
    """Counters since the last take() (for the stats connector), and lifetime totals; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals: dict[str, float] = {}  # sums since start; lists count too, as "<name>_n"
        self.reset()

    def reset(self) -> None:
        self.long_requests = 0
        self.attn_s: list[float] = []      # per-layer host attention seconds (one batched submission)
        self.cluster_s: list[float] = []   # per-request clustering seconds (all layers of a move)
        self.move_split_s: dict[str, float] = {}  # those moves' seconds per part (summed): read (paged cache),
                                                  # kmeans, pack (cluster tables, packing, copy to host memory),
                                                  # store (nelssa-node's store call)
        self.move_thread_s: dict[str, float] = {}  # those moves' wall seconds by the hand-off thread's state
                                                   # (summed): cpu (running), runq (runnable, waiting for a
                                                   # core), blocked (the rest: the GIL, stream waits)
        self.moved_tokens = 0
        self.moved_bytes = 0                   # those tokens' KV bytes read from the device (all layers, K and V)
        self.failures = 0
        self.handoff_wait_s: list[float] = []  # main-thread waits for a hand-off not done by its switch
        self.offload_step_s: list[float] = []  # wall time of each forward with offloaded rows (launch + waits)
        self.offload_decode_step_s: list[float] = []  # the same, of such forwards without prefill chunks
        self.host_wait_s: list[float] = []     # per such step: time the forward's thread waited for host results
        self.offload_split_s: dict[str, float] = {}  # such steps' forward-thread seconds per part (summed)
        self.lane_batch_s: list[float] = []    # long lane: wall time of each batch of jobs (one position each)
        self.lane_rows = 0                     # long lane: rows computed
        self.lane_step_s: list[float] = []     # forward wall time of steps with lane rows (no host wait)
        self.lane_split_s: dict[str, float] = {}  # long lane: its thread's seconds per part (summed)
        self.lane_captures = 0                 # long lane: batches captured as one CUDA graph
        self.lane_capture_failures = 0         # long lane: captures that failed (that request set runs enqueued)
        self.lane_paths: dict[str, float] = {}  # long lane: batches per way they ran (lane_batch.BatchGraphs.path)
        self.lane_drafts: dict[str, float] = {}  # long lane: drafts by outcome (lane_spec.py: run, verified,
                                                 # mismatch, stale)
        self.node_comm_s: list[float] = []     # through nelssa-node's native plane, per layer call: its round
                                               # trip minus the slowest device's kernel (issue 10's communication)
        self.host_call_split_s: dict[str, float] = {}  # local host calls (HostCall) by part, summed: prep, fork,
                                                       # tables, items, wait, combine (csrc/common.h KernelSplit)
        self.node_comm_split_s: dict[str, float] = {}  # that communication by part (summed): copy (this side's
                                                       # copies and channel lock), wire (post to answer seen, minus
                                                       # the node's time: the two hand-offs), dispatch (the node's
                                                       # time beyond its slowest kernel: its devices' wake-up)
        self.lane_timeline_s: dict[str, float] = {}  # long lane batches with host calls: launch-to-end seconds
                                                     # per part (lead, host, between, tail; lane_host.py, 7)
        self.lane_timeline_batches = 0
        self.lane_beside_s: dict[str, float] = {}  # long lane batches' seconds by the requests of the engine steps
                                                   # run beside them (vllm_plugin/lane.py beside_bucket)
        self.lane_beside_n: dict[str, float] = {}  # those batches, counted
        self.lane_finish_cancels = 0           # long lane: requests finished while a job of theirs ran (lane.py, 6)
        self.handoff_failures = 0              # background moves to the host tier that failed (handoff.py)
        self.recall_load_s: list[float] = []   # recalls by load (vllm_plugin/recall.py): read-back and write per request
        self.recalled_tokens = 0               # tokens those loads wrote back into device blocks
        self.handovers_released = 0            # P/D hand-over (vllm_plugin/handover.py), P: requests released
        self.handover_failures = 0             # P: hand-overs given up (a failed move or release)
        self.handovers_adopted = 0             # D: requests adopted from P instead of clustered
        self.handover_fallbacks = 0            # D: hand-overs not adopted (clustered here instead)
        self.handover_wait_s: list[float] = []  # D: per adoption, seconds from its start to the node's answer
        self.handover_lag_s: list[float] = []   # P: per release, seconds from the request's end to its release
                                                # (its moves still running: D waits that long to adopt it)

    def take(self) -> dict:
        with self._lock:
            d = {"long_requests": self.long_requests, "attn_s": self.attn_s, "cluster_s": self.cluster_s,
                 "move_split_s": self.move_split_s, "move_thread_s": self.move_thread_s,
                 "moved_tokens": self.moved_tokens, "moved_bytes": self.moved_bytes, "failures": self.failures,
                 "handoff_wait_s": self.handoff_wait_s, "offload_step_s": self.offload_step_s,
                 "offload_decode_step_s": self.offload_decode_step_s,
                 "host_wait_s": self.host_wait_s, "offload_split_s": self.offload_split_s,
                 "lane_batch_s": self.lane_batch_s, "lane_rows": self.lane_rows, "lane_step_s": self.lane_step_s,
                 "lane_split_s": self.lane_split_s, "lane_captures": self.lane_captures,
                 "lane_capture_failures": self.lane_capture_failures, "lane_paths": self.lane_paths,
                 "lane_drafts": self.lane_drafts,
                 "node_comm_s": self.node_comm_s, "node_comm_split_s": self.node_comm_split_s,
                 "host_call_split_s": self.host_call_split_s,
                 "lane_timeline_s": self.lane_timeline_s,
                 "lane_timeline_batches": self.lane_timeline_batches, "lane_beside_s": self.lane_beside_s,
                 "lane_beside_n": self.lane_beside_n, "handoff_failures": self.handoff_failures,
                 "recall_load_s": self.recall_load_s, "recalled_tokens": self.recalled_tokens,
                 "lane_finish_cancels": self.lane_finish_cancels, "handovers_released": self.handovers_released,
                 "handover_failures": self.handover_failures, "handovers_adopted": self.handovers_adopted,
                 "handover_fallbacks": self.handover_fallbacks, "handover_wait_s": self.handover_wait_s,
                 "handover_lag_s": self.handover_lag_s}
            self.reset()
        return d

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                if isinstance(v, dict):  # per-part sums
                    cur = getattr(self, k)
                    for part, x in v.items():
                        cur[part] = cur.get(part, 0.0) + x
                        self.totals[f"{k}:{part}"] = self.totals.get(f"{k}:{part}", 0) + x
                    continue
                if isinstance(getattr(self, k), list):
                    getattr(self, k).append(v)
                    self.totals[k + "_n"] = self.totals.get(k + "_n", 0) + 1
                else:
                    setattr(self, k, getattr(self, k) + v)
                self.totals[k] = self.totals.get(k, 0) + v


def stage_queries(q: torch.Tensor, sel: Selection, pin_result: bool | None):
    """The caller's side of a host attention job, shared by both tiers -> (q on the host, event the
    job's thread waits for or None, whether to pin the result). Device queries: a pinned
    non-blocking copy and an event recorded after it (and after the selection's copies on the same
    stream), so the caller's thread never waits; host queries are used as they are (the kernel takes
    the KV dtype or fp32). ``pin_result`` None: pin when the queries are on the device (the caller
    copies the result back without waiting for its stream)."""
    pinned = q.is_cuda if pin_result is None else pin_result
    if not q.is_cuda:
        return q.detach(), sel.ready, pinned
    q_cpu = torch.empty(q.shape, dtype=q.dtype, pin_memory=True)
    q_cpu.copy_(q.detach(), non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return q_cpu, ready, pinned


def pin_if(out: tuple[torch.Tensor, torch.Tensor], pinned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(x.pin_memory() for x in out) if pinned else out


def call_results(stats: HostStats, calls: list) -> str | None:
    """Prepared calls the stream (or thread) has passed: their host attention time added to ``stats``;
    the first failure's message, or None. A call neither done nor skipped is a failure too."""
    err = None
    for c in calls:
        state = c.state
        if state == "done":
            stats.add(attn_s=c.seconds)
            ks = c.kernel_split  # a local call: its kernel's time by part
            if ks is not None:
                stats.add(host_call_split_s=ks)
            nt = c.node_times  # a call nelssa-node did: (node, slowest kernel, post-to-answer seconds)
            if nt is not None:
                node_s, kernel_s, wait_s = nt
                stats.add(node_comm_s=max(0.0, c.seconds - kernel_s),
                          node_comm_split_s={"copy": max(0.0, c.seconds - wait_s), "wire": max(0.0, wait_s - node_s),
                                             "dispatch": max(0.0, node_s - kernel_s)})
        elif state != "skipped" and err is None:
            err = c.error if state == "failed" else f"host call {state} after its stream passed it"
    if err is not None:
        stats.add(failures=1)
    return err


class LocalHostTier:
    def __init__(self, cfg: NelssaConfig, num_layers: int):
        self.cfg = cfg
        self.num_layers = num_layers
        self.reqs: dict[str, RequestKV] = {}
        self.stats = HostStats()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nelssa-host")
        self._lock = threading.Lock()
        reserve = min(cfg.host_reserve, cfg.host_capacity) if cfg.host_capacity else cfg.host_reserve
        hostmem.configure(reserve, threads=min(4, cfg.pool_threads))  # an engine on CUDA registers it later

    # -------- KV placement
    def _request(self, req_id: str) -> RequestKV:
        with self._lock:
            rkv = self.reqs.get(req_id)
            if rkv is None:
                rkv = self.reqs[req_id] = RequestKV(req_id, self.num_layers)
                self.stats.add(long_requests=1)
        return rkv

    def put_layers(self, req_id: str, keys: list[torch.Tensor], values: list[torch.Tensor],
                   commit: bool = True, ahead: tuple | None = None) -> None:
        """Cluster tokens [H, n, D] of every layer (layer order) into the request's store (first call) or
        append them; k-means runs over the layers together (``cluster_layers``), far fewer launches
        than layer by layer. ``commit=False``: prepared in the background, invisible to attention
        until ``commit``. ``ahead``: their k-means done before (``cluster_part``'s)."""
        cfg = self.cfg
        if cfg.fault == "store":
            raise HostError("injected host-tier fault (NELSSA_FAULT=store)")
        rkv = self._request(req_id)
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise HostError(f"put_layers: {len(keys)} layers given, the host tier has {self.num_layers}")
        part = 0 if rkv.layers[0] is None else rkv.layers[0].num_parts
        labels, kmeans_s = cluster_part(keys, cfg, part, ahead)
        t = time.perf_counter()
        stats = parts_stats(keys, values, labels, cpu=True)
        kvs = pack_parts(keys, values, [st[1] for st in stats])
        for i, (k, v, lab, st, kv) in enumerate(zip(keys, values, labels, stats, kvs)):
            ckv = rkv.layers[i]
            if ckv is None:
                ckv = ClusteredKV(k.shape[0], k.shape[2], k.dtype, k.device, cluster_size=cfg.cluster_size,
                                  segment=cfg.segment, iters=cfg.iters, seed=cfg.seed + i)
                rkv.set_layer(i, ckv)
            ckv.append(k, v, commit=commit, labels=lab, stats=st, kv=kv)
        self.stats.add(move_split_s={"kmeans": kmeans_s, "pack": settled(keys[0]) - t})

    def commit(self, req_id: str, length: int) -> None:
        """Make a request's prepared parts visible until every layer holds exactly ``length`` tokens."""
        rkv = self.reqs.get(req_id)
        if rkv is None:
            raise HostError(f"request {req_id} has no host KV")
        if not rkv.complete:
            raise HostError(f"request {req_id}: host KV incomplete (layers missing)")
        for ckv in rkv.layers:
            ckv.commit_until(length)

    def committed(self, req_id: str) -> int:
        """Tokens of a request visible to attention (0 when none)."""
        rkv = self.reqs.get(req_id)
        return rkv.layers[0].length if rkv is not None and rkv.layers[0] is not None else 0

    def layer_kv(self, req_id: str, layer: int) -> ClusteredKV:
        rkv = self.reqs.get(req_id)
        if rkv is None:
            raise HostError(f"request {req_id} has no host KV")
        return rkv.layer(layer)

    def read_back(self, req_id: str, layer: int, lo: int, hi: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, values [H, hi - lo, D] of committed tokens [lo, hi) (from the host range's first token) of one
        layer, in token order, on ``device``: what a recall loads into the device's blocks (recall.py)."""
        if self.cfg.fault == "recall":
            raise HostError("injected host-tier fault (NELSSA_FAULT=recall)")
        return self.layer_kv(req_id, layer).unpack(lo, hi, device)

    def has(self, req_id: str) -> bool:
        return req_id in self.reqs

    def free(self, req_id: str) -> bool:
        with self._lock:
            rkv = self.reqs.pop(req_id, None)
        if rkv is not None:
            rkv.free()
        return rkv is not None

    @property
    def nbytes(self) -> int:
        with self._lock:
            reqs = list(self.reqs.values())
        return sum(r.nbytes for r in reqs)

    # -------- attention
    def submit_attend(self, q: torch.Tensor, ckvs: list[ClusteredKV], sel: Selection, scale: float,
                      layer: int, pin_result: bool | None = None) -> Future:
        """Start host attention of q [n, Hq, D] over the selected clusters; returns a future of
        fp32 (out [n, Hq, D], lse [n, Hq]) on the host."""
        q_cpu, ready, pinned = stage_queries(q, sel, pin_result)
        fault = self.cfg.fault

        def run():
            if ready is not None:
                ready.synchronize()
            t = time.perf_counter()
            if fault == "attend":
                raise HostError("injected host-tier fault (NELSSA_FAULT=attend)")
            try:  # NaN/Inf in the queries or the results are checked by attend (in C++: no torch ops here)
                out = attend(q_cpu, ckvs, sel, scale, pin=pinned)
            except ValueError as e:
                raise HostError(f"host attention of layer {layer}: {e}") from None
            mod = ext()  # the kernel's time by part, when it was the C++ one (on this thread)
            self.stats.add(attn_s=time.perf_counter() - t,
                           **({"host_call_split_s": mod.last_kernel_split()} if mod is not None else {}))
            return out

        return self._pool.submit(run)

    def prepare_call(self, q: torch.Tensor, ckvs: list[ClusteredKV], sel: Selection, scale: float, layer: int,
                     out: torch.Tensor, lse: torch.Tensor, cancel=None):
        """Host attention of q [n, Hq, D] (host memory, read when the call runs) over the selected
        clusters into ``out`` / ``lse`` (fp32), as a C++ call the caller enqueues on a CUDA stream
        (``nelssa.sparse.prepare_attend``); None without the C++ extension (use submit_attend).
        ``call_results`` after the stream passed it."""
        fault = "injected host-tier fault (NELSSA_FAULT=attend)" if self.cfg.fault == "attend" else ""
        return prepare_attend(q, ckvs, sel, scale, out, lse, cancel, fault)

    @property
    def prepared_calls(self) -> bool:
        """Whether ``prepare_call`` works (the C++ extension is there)."""
        return ext() is not None

    def call_results(self, calls: list) -> str | None:
        return call_results(self.stats, calls)

    def wait(self, fut: Future, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            out, lse = fut.result(timeout=self.cfg.host_timeout_s)
        except FutureTimeout:
            self.stats.add(failures=1)
            raise HostError(f"host attention of layer {layer} timed out after {self.cfg.host_timeout_s}s") from None
        except Exception:
            self.stats.add(failures=1)
            raise
        return out, lse

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for r in list(self.reqs):
            self.free(r)
