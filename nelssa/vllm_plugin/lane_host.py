"""The long lane's split attention enqueued whole: no thread waits for the host tier layer by layer
(CUDA, local host tier with the C++ extension; config ``lane_host_calls``).

The lane's per-layer path (``attention.split_attention``) submits the host job to a pool thread and
waits for its future before the merge: per layer two Python threads hand the GIL over several
times (pool thread after the queries' event, after the kernel; the lane thread after the future),
each hand-off up to a GIL switch interval while the engine's step thread runs Python, and the lane's
enqueueing stops at every layer. On the H200 (hol run 10) a lane batch took 131 ms of which the host
kernel was 40: most of the rest was this orchestration. Here, per layer and on the lane's stream:

  1. the centroid search (``SelectGraphs.select``: a graph replay that also copies the queries, the
     selected ids and their counts to pinned memory; or the eager search whose ids go to pinned
     buffers, its queries copied here), then an event;
  2. on the host stream (``host_stream``): a wait for that event, the host attention
     (``LocalHostTier.prepare_call`` -> a C++ ``HostCall``, no Python involved) as the device's wait on
     a flag that the extension's poller thread sets once it ran the call (config ``lane_host_wait``
     "flags", csrc/flag_wait.cpp; the default) or as a CUDA host function ("hostfn",
     csrc/host_call.cpp: the driver runs it on its worker thread once the copies are done), the copies
     of its (out, LSE) from pinned memory to the device, an event (with UVA, uva.py: no copies, the
     merge reads them from the pinned memory; the transfers of 1 are kernels too);
  3. on the lane stream, overlapping 2: the window attention (``flash_window_parts``), a wait for 2's
     event, and the merge of window, estimate and host result into the layer's attention output.
     With ``lane_chain`` the host stream IS the lane stream and the window attention comes before the
     host call: a batch is one chain of operations. A host wait holds the head of its CUDA hardware
     work queue until the host answers; a captured batch whose host branches fork off becomes ~30
     internal streams spread over the queues, all enqueued at the replay, so a step stream's next
     operation can sit behind several layers' waits in a shared queue (22-35 ms, H200 profile,
     docs/results.md); one chain holds one queue.
  3a. In one chain served by flags (the default; a captured batch; config ``lane_overlap``), the flags'
     operations come in two launches (csrc/flag_wait.cpp, 1b): the ready write right after 1's copies,
     then the estimate of the unselected clusters (deferred by the search:
     ``select_clusters(defer_estimate=True)``) and the window attention, then the wait for done and the
     merge. So those ~35 us of a layer's device work run while the host attends (H100 profile of run 98:
     they came before the ready write, on every layer's path).
So the lane thread enqueues a whole batch (dense graphs between the layers, lane_graphs.py) and then
waits once, at its end, without the GIL. The device orders everything: layer i + 1's queries come
from layer i's merged output, and every buffer a host call reads or writes is rewritten only after
the lane stream passed that call's merge.

  4. The calls, pinned buffers and device results of a batch are kept here until ``finish``, which
     the lane calls after synchronising both streams (also when the batch failed or was cancelled):
     it reads each call's state, adds the host attention time to the host tier's stats, and returns
     the first failure's message. A failed call wrote NaN (csrc/host_call.cpp, 3) and its batch's
     requests fail: never an answer from a failed attention.
  5. Cancelling (every request of the batch finished or preempted): ``cancel()`` sets the batch's
     CancelFlag, so the host calls not yet run return at once and the batch ends after its
     remaining device work.
  6. The lane waits for a batch (``wait``) without the GIL and at most the host tier's deadline
     (``host_timeout_s``) before it gives up on it: the calls not yet run are cancelled as in 5 and
     the batch's requests fail with the timeout, as a late host result does on the layer-by-layer path.
  7. Where a batch's time goes (``timeline``): each call stamps when it ran (HostCall.started/ended,
     the clock of time.perf_counter), so the wall time from the batch's launch to the end of its wait
     splits exactly into lead (until the first layer's host call starts: input copies, the launch, the
     first layer's device work), host (the calls running), between (from one call's end to the next
     one's start: the device's work between two layers' host attention, and the flags' latency both
     ways) and tail (after the last call: the last layer's merge and dense work, the wait's wake-up).
"""

from __future__ import annotations

import logging
import math
import time

import torch

from nelssa._ext import ext
from nelssa.sparse.search import Selection, select_clusters
from nelssa.vllm_plugin import uva
from nelssa.vllm_plugin.attention import StepPlan, _token_index, flash_window_parts, layer_search

log = logging.getLogger("vllm.nelssa")


class Buffers:
    """The lane's pinned buffers, kept across batches (lane thread only): one per (kind, layer, dtype),
    handed out as its first elements viewed in the asked shape, with its device view (uva.py).

    Allocating pinned memory (cudaHostAlloc) takes ~2 ms a buffer and the CUDA driver's lock: a lane batch
    whose shapes were new (a new batch size, a longer selection) allocated ~64 of them in the middle of
    serving — the first capture of a 2-row set spent 0.12 s preparing (H100, hol run 64), in the decode
    phase's first half second, where its worst TTFTs are. So a buffer is allocated with room
    (``HEADROOM`` x its first need: up to 4 rows of that selection width) and grows by doubling; all
    shapes of a (kind, layer, dtype) share it. Sharing is safe because every batch runs on the lane's
    stream in order: a layer's buffers are written and read within that layer's part of one batch, which
    ends (its merge) before the stream reaches the next batch's. A captured graph keeps the buffers it
    read by address through the views its calls hold, so a buffer that grows stays alive for it.

    ``reserve_for`` allocates them at engine start (Lane.warm), sized for the lane's largest warmed batch
    at the model's length, so even the first lane batch allocates nothing (H100 hol run 67: the first
    batch, enqueued, ran 626 ms and its capture prepared for 0.157 s, in the prefill phase of the
    second long prompt)."""

    HEADROOM = 4
    RESERVE_LIMIT = 256 << 20  # bytes reserve_for may pin at start; a larger need is reserved in part

    def __init__(self, pin: bool = True):
        self.pin = pin
        self._bufs: dict = {}
        self.allocations = 0

    def get(self, kind: str, layer: int, shape, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(host tensor, its device view or None) of ``shape``: the first elements of the buffer."""
        shape = tuple(int(x) for x in shape)
        n = math.prod(shape)
        key = (kind, layer, dtype)
        b = self._bufs.get(key)
        if b is None or b[0].numel() < n:
            b = self._alloc(key, max(1, n * self.HEADROOM) if b is None else max(n, 2 * b[0].numel()))
        return b[0][:n].view(shape), (b[1][:n].view(shape) if b[1] is not None else None)

    def _alloc(self, key: tuple, n: int) -> tuple:
        t = torch.empty(n, dtype=key[2], pin_memory=self.pin)
        b = self._bufs[key] = (t, uva.view(t) if self.pin else None)
        self.allocations += 1
        return b

    def reserve_for(self, layers, rows: int, hq: int, h: int, d: int, dtype, bound: int) -> int:
        """Allocate now every layer's buffers for ``rows`` rows of ``hq`` query heads (``h`` KV heads, head
        size ``d``, queries of ``dtype``) and an id width ``bound`` (select_graph.id_width: a power of two,
        halved until all fit ``RESERVE_LIMIT``; wider selections grow as in ``get``). Returns the bytes."""
        def need(b: int) -> list[tuple[str, int, torch.dtype]]:
            return [("ids", rows * h * b, torch.long), ("cnt", rows * h, torch.long),
                    ("q", rows * hq * d, dtype), ("out", rows * hq * d, torch.float32),
                    ("lse", rows * hq, torch.float32)]

        def size(b: int) -> int:
            return len(layers) * sum(n * dt.itemsize for _, n, dt in need(b))
        bound = max(1, bound)
        while bound > 1 and size(bound) > self.RESERVE_LIMIT:
            bound //= 2
        for li in layers:
            for kind, n, dt in need(bound):
                b = self._bufs.get((kind, li, dt))
                if b is None or b[0].numel() < n:
                    self._alloc((kind, li, dt), n)
        return size(bound)


def batch(host, impl, lane_stream, host_stream, buffers: Buffers) -> "HostStreamBatch | None":
    """A batch that runs this way, or None when it cannot: a host tier without prepared calls (the node
    client without its native plane), another attention backend than FlashAttention, no C++ extension."""
    mod = ext()
    if mod is None or not getattr(host, "prepared_calls", False) or getattr(impl, "nelssa_backend", None) != "flash":
        return None
    return HostStreamBatch(lane_stream, host_stream, buffers, mod.CancelFlag())


def timeline(calls: list, launched: float, waited: float) -> dict[str, float] | None:
    """A batch's wall time from ``launched`` to ``waited`` split by its calls' stamps (7), or None when a call
    did not run (cancelled before the stream reached it, or the batch failed before)."""
    if not calls or any(c.started <= 0 or c.ended < c.started for c in calls):
        return None
    between = sum(max(0.0, b.started - a.ended) for a, b in zip(calls, calls[1:]))
    return {"lead": max(0.0, calls[0].started - launched), "host": sum(c.ended - c.started for c in calls),
            "between": between, "tail": max(0.0, waited - calls[-1].ended)}


class HostStreamBatch:
    """One lane batch's enqueued split attention (the module docstring). Lane thread only."""

    def __init__(self, lane_stream: torch.cuda.Stream, host_stream: torch.cuda.Stream, buffers: Buffers, flag,
                 capturing: bool = False):
        self.lane_stream, self.host_stream = lane_stream, host_stream
        self.buffers = buffers        # pinned buffers kept by the lane across batches
        self.flag = flag              # C++ CancelFlag of this batch
        self.calls: list = []
        self.keep: list = []          # device results and events, alive until finish (4)
        # while lane_batch.py captures the batch into a graph: the search without its own graphs, the
        # host calls as graph nodes (kept by the graph); buffers and events made before the capture
        self.capturing = capturing
        self.events: dict = {}
        self.timed_out = 0.0          # wait(): seconds after which the batch was given up on (0: it was not)
        self.parts: dict | None = None  # finish(): the batch's timeline (7), seconds by part

    def _pinned(self, kind: str, layer: int, shape, dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A pinned buffer and its device view (uva.py; None without UVA)."""
        return self.buffers.get(kind, layer, shape, dtype)

    @staticmethod
    def _to_host(src: torch.Tensor, dst: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Device -> pinned on the current stream: a kernel through the view (uva.py), else a copy."""
        if dst[1] is not None:
            uva.copy(src, dst[1])
        else:
            dst[0].copy_(src, non_blocking=True)

    def attend(self, impl, layer, q: torch.Tensor, kv_cache: torch.Tensor, o: torch.Tensor, md,
               plan: StepPlan) -> None:
        """Steps 1-3 for attention layer ``layer`` of the batch: q / o [n, Hq, D] (every row offloaded)."""
        from nelssa.vllm_plugin.merge_kernel import merge_into
        t = time.perf_counter()
        cfg, li, host = impl.nelssa_cfg, layer.nelssa_layer, plan.host
        tok = _token_index(plan, q.device)
        n, hq, d = q.shape
        call = done = sel = q_off = parts = None
        chain = self.host_stream is self.lane_stream
        # (3a) one chain served by flags: the ready write as soon as the call's inputs are copied, the estimate
        # and the window attention while it runs, then the wait (csrc/flag_wait.cpp, 1b); the search defers
        # its estimate for it (a capture's search: every lane batch is captured)
        split = chain and cfg.lane_overlap and cfg.lane_host_wait == "flags" and self.capturing
        waiting = False  # the ready write is enqueued and its wait not yet

        def window():  # (3) the window attention's partial states, from the search's device rows when it ran
            nonlocal q_off
            if q_off is None:
                q_off = q.index_select(0, tok)
            return flash_window_parts(impl, q_off, kv_cache, plan, md, cfg.sink, plan.cache["block_size"])
        try:
            if self.capturing:  # the capture's plan holds the static budget targets (lane_batch.py, 3)
                ckvs = [host.layer_kv(r, li) for r in plan.req_ids]
                sel, q_host, q_off = self._search_captured(li, q, tok, ckvs, cfg, impl.scale, plan.cache["target"],
                                                           defer=split)
            else:
                ckvs, sel, q_host, q_off = layer_search(plan, li, q, tok, cfg, impl.scale)
            t = plan.lap("search", t)  # the centroid search; "select" below: the host call's preparation and launch
            if q_host.is_cuda:  # the eager search (1): its queries to pinned memory
                staged = self._pinned("q", li, q_host.shape, q_host.dtype)
                self._to_host(q_host, staged)
                q_host = staged[0]
            (out_h, out_v), (lse_h, lse_v) = (self._pinned("out", li, (n, hq, d), torch.float32),
                                              self._pinned("lse", li, (n, hq), torch.float32))
            call = host.prepare_call(q_host, ckvs, sel, impl.scale, li, out_h, lse_h, self.flag)
            if call is None:
                raise RuntimeError("the host tier's C++ extension is not available")
            if chain and not split:  # (3) the window first: in one chain it would otherwise wait for the host call
                parts = window()
            ready, done = self.event(li, 0), self.event(li, 1)
            ready.record(self.lane_stream)
            hs = self.host_stream
            hs.wait_event(ready)
            if split:  # (3a) the ready write now; the estimate and the window, then the wait
                call.launch_flags(hs.cuda_stream, arm=False, ops=1)
                self.calls.append(call)
                waiting = True
                if callable(sel.estimate):
                    sel.estimate = sel.estimate()
                parts = window()
                call.launch_flags(hs.cuda_stream, arm=False, ops=2)
                waiting = False
            elif cfg.lane_host_wait == "flags":  # (2) served by the extension's thread (csrc/flag_wait.cpp)
                call.launch_flags(hs.cuda_stream, arm=not self.capturing)
            elif self.capturing:
                call.launch_borrowed(hs.cuda_stream)
            else:
                call.launch(hs.cuda_stream)  # (2)
            if not split:
                self.calls.append(call)
            if out_v is not None and lse_v is not None:  # the merge reads the host memory (uva.py)
                out_d, lse_d = out_v, lse_v
            else:
                out_d = torch.empty(n, hq, d, dtype=torch.float32, device=q.device)
                lse_d = torch.empty(n, hq, dtype=torch.float32, device=q.device)
                with torch.cuda.stream(hs):
                    out_d.copy_(out_h, non_blocking=True)
                    lse_d.copy_(lse_h, non_blocking=True)
            done.record(hs)
            self.keep += [out_d, lse_d, ready, done, q_host, out_h, lse_h]  # a captured graph reads them by address
        except Exception as e:  # noqa: BLE001 - any host-tier failure fails these requests, loudly
            for r in plan.req_ids:
                plan.fail(r, f"host tier (layer {li}): {type(e).__name__}: {e}")
            done = None
            if waiting:  # the call's outputs stay its own until it ran: the stream still waits for it
                call.launch_flags(self.host_stream.cuda_stream, arm=False, ops=2)
        t = plan.lap("select", t)
        if parts is None:
            parts = window()
        t = plan.lap("window", t)
        if done is not None and not plan.failed:
            self.lane_stream.wait_event(done)
            if sel.estimate is not None:
                parts.append(sel.estimate)
            parts.append((out_d, lse_d))
            merge_into(o, tok, parts)
        else:
            o.index_fill_(0, tok, 0.0)
        plan.lap("merge", t)

    def event(self, layer: int, k: int) -> torch.cuda.Event:
        e = self.events.get((layer, k))
        if e is None:
            e = self.events[(layer, k)] = torch.cuda.Event()
        return e

    def _search_captured(self, li, q, tok, ckvs, cfg, scale, target, defer: bool = False):
        """The centroid search inside a capture: select_clusters with device outputs, then the copies of
        ids, counts and queries to the layer's pinned buffers (as select_graph.py captures it). ``defer``:
        the estimate as a function the caller enqueues after the host call's ready write (3a)."""
        from nelssa.vllm_plugin.select_graph import _bound
        q_off = q.index_select(0, tok)
        n, H = q_off.shape[0], ckvs[0].num_kv_heads
        bound = _bound(cfg.budget, ckvs, max(c.num_clusters for c in ckvs))
        sel = select_clusters(q_off, ckvs, cfg.budget, scale, estimate=cfg.estimate, target=target, device_out=True,
                              defer_estimate=defer)
        ids, cnt, qb = (self._pinned("ids", li, (n, H, bound), torch.long), self._pinned("cnt", li, (n, H), torch.long),
                        self._pinned("q", li, q_off.shape, q_off.dtype))
        self._to_host(sel.ids[..., :bound], ids)
        self._to_host(sel.counts, cnt)
        self._to_host(q_off, qb)
        (ids_h, _), (cnt_h, _), (q_h, _) = ids, cnt, qb
        self.keep += [ids_h, cnt_h]
        return Selection([ids_h[b] for b in range(n)], [cnt_h[b] for b in range(n)], sel.estimate), q_h, q_off

    def prepare_capture(self, li: int, n: int, hq: int, d: int, H: int, bound: int, dtype) -> None:
        """Everything the capture of layer ``li`` allocates on the host or creates, made before it."""
        for kind, shape, dt in (("ids", (n, H, bound), torch.long), ("cnt", (n, H), torch.long),
                                ("q", (n, hq, d), dtype), ("out", (n, hq, d), torch.float32),
                                ("lse", (n, hq), torch.float32)):
            self._pinned(kind, li, shape, dt)
        for k in (0, 1):
            self.event(li, k).record(self.lane_stream)  # created (lazily by torch) outside the capture

    def cancel(self) -> None:
        self.flag.set()

    def wait(self, timeout_s: float, end: torch.cuda.Event | None = None) -> bool:
        """Wait, without the GIL, for the batch's work on both streams. Past ``timeout_s`` (the host tier's
        deadline) the calls not yet run are cancelled, the batch's requests will fail (finish) and False
        is returned; the caller then synchronises the streams (the call running, if any, ends first).
        ``end``: an event already recorded after all of it (a graph replay: its capture joined the host
        stream back into the lane's)."""
        if end is None:
            end = torch.cuda.Event()
            self.lane_stream.wait_stream(self.host_stream)
            end.record(self.lane_stream)
        if ext().wait_event(end.cuda_event, timeout_s):
            return True
        self.cancel()
        self.timed_out = timeout_s
        log.error("NELSSA lane: a batch's host attention did not finish within %.1f s; its requests fail", timeout_s)
        return False

    def finish(self, host, launched: float, waited: float) -> str | None:
        """After both streams were synchronised (4): the first failure's message, or None. The batch's
        timeline (7) from its launch and wait-end times (time.perf_counter) goes to the host tier's stats."""
        parts = self.parts = timeline(self.calls, launched, waited)
        if parts is not None:
            host.stats.add(lane_timeline_s=parts, lane_timeline_batches=1)
        err = host.call_results(self.calls)
        if self.timed_out:
            err, self.timed_out = f"host attention did not finish within {self.timed_out}s", 0.0
            host.stats.add(failures=1)
        if not self.capturing:  # a captured batch's calls live with its graph (lane_batch.py)
            self.calls, self.keep = [], []
        return err
