"""Background hand-off of a request's KV from the device's paged cache to the host tier.

Used for a long prompt's completed k-means segments during its chunked prefill, for the rest of the
prompt once it is processed, and for each chunk of generated tokens (and, later, for migrating a
request that grew long). Nothing proportional to a request's length runs on the step path.

Contract (worker side; the ranges come from policy.Policy, the switch from the scheduler):
  0. ``warm(tokens)`` once before serving (CUDA): a move's work on the hand-off thread and side stream,
     nothing stored, so a process's first move does not set up CUDA for that thread beside the steps.
  1. ``submit(rid, blocks, lo, hi)`` right after the forward that wrote tokens [lo, hi) of the request:
     one background thread reads them from the paged cache (on CUDA on a side stream of the lowest
     priority that first waits for the main stream's work so far), clusters all layers and packs them into host memory as a
     *prepared* part (``commit=False``): attention does not see it yet. Ranges of a request are
     submitted in order and back to back; ``end(rid)`` is where the next one starts. When a move is
     complete, ``on_done(rid, hi, generation)`` reports it (to the scheduler, through the connector).
     With ``ahead`` (config ``handoff_ahead``; by default on CUDA) a move is two stages: its read and
     k-means on a thread and side stream of their own, then its packing and store on the thread above,
     which runs everything else here in submission order. So the next move's k-means (device work)
     runs while this one packs (a thread's launches), at most ``AHEAD_MOVES`` moves' K/V on the device
     at once. The k-means made ahead is for the part index the request's moves predict (its moves
     since its first, none of them an adoption); the host tier clusters again if the part is another.
  2. ``ready(rid, h)`` before the forward of a step whose attention uses the host range [sink, h)
     (the scheduler chose h from reported completions, so nothing is waited for; a wait would be
     counted as ``handoff_wait_s``): commits the prepared parts so exactly h - sink tokens are
     visible. The scheduler frees the blocks below h in the same step's scheduling; they are written
     again only by this step's forward, which starts after ``ready`` returns.
  3. ``drop(rid, preempted)`` when the request finishes, is aborted, preempted or recalled: waits for
     its moves (they read blocks that are about to be reused) and forgets them; a preemption starts a
     new generation of the request. The caller frees its host KV.
  4. P/D hand-over (handover.py): ``submit(moves, adopt)`` makes a request's first move [sink, H0) an
     adoption of what its prefill instance stored (falling back to the move); ``handover(rid, handle,
     on_end)`` (instead of ``drop``) releases a finished request on the node after its moves, off the
     step path, then calls ``on_end(rid)``. ``adopt(rid, handle, h0, on_fail)``: a window admission's
     adoption, at once and with no fallback (its [sink, H0) is not on this device: handover.py, 6).
  5. Recall (recall.py, 2): ``load(rid, blocks, lo, hi)`` reads tokens [lo, hi) of every layer back from
     the host tier and writes them into the paged cache at ``blocks``, on this thread after the request's
     moves (and on CUDA on the side stream after the main stream's work so far); ``drop`` waits for it.
A failed move (the host tier full, gone, or failing) is logged and counted (``handoff_failures``); the
request's later moves are skipped and none is reported, so it never switches: it decodes from its
device blocks (exactly: dense attention) to its end, holding them. A range whose move failed is thus
never in use; should ``ready`` still meet one, it raises (the request fails loudly). ``drop`` forgets
the failure with the request.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from nelssa.sparse.clustered import cluster_layers, cluster_part, pack, part_stats, settled
from nelssa.sparse.kmeans import to_device
from nelssa.vllm_plugin import handover
from nelssa.vllm_plugin.attention import write_kv

log = logging.getLogger("vllm.nelssa")


def thread_clock() -> tuple[float, float, float | None]:
    """(wall, CPU, runqueue) seconds of the calling thread so far (wall: time.perf_counter): Linux's
    schedstat gives the time it ran and the time it was runnable without a core; elsewhere CPU from
    time.thread_time and runqueue None. A move's wall time beyond the two is time blocked (waiting
    for the GIL or a stream): what tells a GIL-bound move from one starved of cores."""
    wall = time.perf_counter()
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
        return wall, int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return wall, time.thread_time(), None


def clock_since(c0: tuple[float, float, float | None]) -> tuple[float, float, float]:
    """(wall, CPU, runqueue) seconds of the calling thread since ``thread_clock()`` gave ``c0`` (runqueue 0
    where Linux's schedstat is not there)."""
    c1 = thread_clock()
    return c1[0] - c0[0], c1[1] - c0[1], c1[2] - c0[2] if c0[2] is not None and c1[2] is not None else 0.0


class HandoffFailed(RuntimeError):
    """A move of a request whose earlier move failed (it stays on its device blocks)."""


AHEAD_MOVES = 2  # with ``ahead``: moves read (their K/V on the device) and not yet stored: the one packing and
                 # the one read and clustered ahead of it (~1 GiB each for 8K tokens of a Llama-3.1-8B)


class Handoff:
    def __init__(self, host, layers: list, block_size: int, sink: int, read_kv, on_done=None,
                 ahead: bool | None = None):
        self.host, self.layers, self.block_size, self.sink = host, layers, block_size, sink
        self._read_kv, self._on_done = read_kv, on_done
        self._gen: dict[str, int] = {}                      # request -> preemptions seen
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nelssa-handoff")
        self._side = None                                   # CUDA side stream, made on first use
        if ahead is None:  # config handoff_ahead unset: by the device (config.vllm_nelssa_config)
            ahead = layers[0].kv_cache.is_cuda
        # 1, ahead: the moves' read and k-means, their own thread and stream; a semaphore of AHEAD_MOVES
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="nelssa-cluster") if ahead else None
        self._ahead_side = None
        self._room = threading.Semaphore(AHEAD_MOVES)
        self._parts: dict[str, int | None] = {}            # request -> its next move's part (None: unknown)
        self._end: dict[str, int] = {}                      # request -> end of its submitted ranges
        self._moves: dict[str, list[tuple[int, Future]]] = {}
        self._failed: set[str] = set()                      # requests with a failed move: no more moves
        self._dropping: set[str] = set()                    # requests whose drop waits for their moves

    # ------------------------------------------------------------------ 1. submit
    def end(self, rid: str) -> int:
        return self._end.get(rid, self.sink)

    def submit(self, moves: list[tuple[str, list[int], int, int]], adopt: dict[str, str] | None = None) -> None:
        """Start moves (rid, block ids, lo, hi) after this step's forward was launched. ``adopt``: request
        -> hand-over handle (handover.py, 5); a request's move from the sink adopts, and its entry is
        taken out of the dict."""
        if not moves:
            return
        ev = self._mark()
        for rid, blocks, lo, hi in moves:
            if lo != self.end(rid):
                raise RuntimeError(f"hand-off of {rid}: range [{lo}, {hi}) does not follow {self.end(rid)}")
            self._end[rid] = hi
            handle = adopt.pop(rid, None) if adopt and lo == self.sink else None
            part = self._next_part(rid, handle)
            pre = (self._ahead.submit(self._cluster_ahead, ev, rid, list(blocks), lo, hi, part)
                   if self._ahead is not None and part is not None else None)
            fut = self._pool.submit(self._run, ev, rid, list(blocks), lo, hi, self._gen.get(rid, 0), handle, pre)
            self._moves.setdefault(rid, []).append((hi, fut))

    def _next_part(self, rid: str, handle: str | None) -> int | None:
        """The part index a move of ``rid`` submitted now will have in the host tier (its moves since its first:
        one part each), or None where that is not known: a request whose first move adopts a hand-over
        (its parts are its prefill instance's)."""
        if handle is not None:
            self._parts[rid] = None
            return None
        part = self._parts.get(rid, 0)
        if part is not None:
            self._parts[rid] = part + 1
        return part

    def adopt(self, rid: str, handle: str, hi: int, on_fail) -> None:
        """D, a window admission (handover.py, 6): adopt the node's request as [sink, hi) now, on the hand-off
        thread, reported like a move (``on_done``). Its KV of that range is not on this device, so there is
        no fallback: a failed adoption calls ``on_fail(rid, why)`` (the request fails loudly)."""
        if self.end(rid) != self.sink:
            raise RuntimeError(f"adoption of {rid}: it has hand-offs up to {self.end(rid)} already")
        self._end[rid] = hi
        self._parts[rid] = None
        fut = self._pool.submit(self._adopt, rid, handle, hi, self._gen.get(rid, 0), on_fail)
        self._moves.setdefault(rid, []).append((hi, fut))

    def _adopt(self, rid: str, handle: str, hi: int, gen: int, on_fail) -> None:
        if self._adopted(rid, handle, self.sink, hi, gen, fallback=False):
            return
        self._failed.add(rid)
        if rid not in self._dropping:
            on_fail(rid, "its hand-over from the prefill instance could not be adopted from nelssa-node (see the "
                         "log); its KV of [sink, H0) is only there")
        raise HandoffFailed(f"adoption of {rid} failed")

    def _mark(self):
        """CUDA: an event after the main stream's work so far, for the side stream to wait for (``_on_side``);
        None on CPU."""
        if not self.layers[0].kv_cache.is_cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        self._side_stream()
        return ev

    def _on_side(self, ev, fn, *args, stream=None):
        """``fn(*args)`` on this thread: on CUDA on the side stream (or ``stream``) after ``ev``, done when this
        returns -> fn's result."""
        if ev is None:
            return fn(*args)
        side = stream or self._side
        side.wait_event(ev)
        with torch.cuda.stream(side):
            out = fn(*args)
        side.synchronize()
        return out

    def _side_stream(self) -> torch.cuda.Stream:
        """The moves' CUDA stream, made on first use (the paged cache exists only once vLLM bound it), at
        torch's lowest priority: the engine's step stream (config step_priority) and the lane's go first,
        a move's k-means fills the device's idle time. With ``ahead`` the read and k-means have a stream of
        their own at the same priority (``_ahead_side``)."""
        if self._side is None:
            self._side = torch.cuda.Stream(priority=0)
            if self._ahead is not None:
                self._ahead_side = torch.cuda.Stream(priority=0)
        return self._side

    def _cluster_ahead(self, ev, rid: str, blocks: list[int], lo: int, hi: int, part: int):
        """1, ahead: a move's read and k-means (as part ``part``) on the ahead thread, once fewer than
        AHEAD_MOVES moves' K/V are on the device -> (keys, values, read seconds, cluster_part's (part, labels,
        seconds), this thread's clock deltas), or None for a request whose earlier move failed. Holds one
        ``_room`` until ``_run`` has stored the move (released here if this raises or returns None)."""
        self._room.acquire()
        try:
            if rid in self._failed:
                self._room.release()
                return None
            c0 = thread_clock()
            ks, vs, read_s, ahead = self._on_side(ev, self._read_cluster, blocks, lo, hi, part, stream=self._ahead_side)
            return ks, vs, read_s, ahead, clock_since(c0)
        except BaseException:
            self._room.release()
            raise

    def _read_cluster(self, blocks: list[int], lo: int, hi: int, part: int):
        t = time.perf_counter()
        ks, vs = self._read(blocks, lo, hi)
        read_s = settled(ks[0]) - t
        return ks, vs, read_s, (part, *cluster_part(ks, self.host.cfg, part))

    def _run(self, ev, rid: str, blocks: list[int], lo: int, hi: int, gen: int, handle: str | None = None,
             pre: Future | None = None) -> None:
        state = err = None
        if pre is not None:  # this move's read and k-means, made ahead (1)
            try:
                state = pre.result()
            except Exception as e:  # a failure of the move, as one of its store below
                err = e
        try:
            if rid in self._failed:
                raise HandoffFailed(f"hand-off of {rid}: an earlier move failed")
            if handle is not None and self._adopted(rid, handle, lo, hi, gen, fallback=True):
                return
            if handle is not None and rid in self._dropping:
                return  # not adopted, and the request is gone: nothing to cluster for
            try:
                if err is not None:
                    raise err
                self._on_side(ev, self._copy, rid, blocks, lo, hi, state)
            except Exception as e:
                self._failed.add(rid)
                self.host.stats.add(handoff_failures=1)
                log.error("NELSSA: moving tokens [%d, %d) of %s to the host tier failed (%s: %s); it stays on its "
                          "device blocks", lo, hi, rid, type(e).__name__, e)
                raise
        finally:
            if state is not None:
                self._room.release()
        if self._on_done is not None:
            self._on_done(rid, hi, gen)

    def _adopted(self, rid: str, handle: str, lo: int, hi: int, gen: int, fallback: bool) -> bool:
        """The node's request released under ``handle`` adopted as [lo, hi) of ``rid`` and reported like a
        move (handover.adopt_handed_over; it gives up once the request is being dropped)."""
        if not handover.adopt_handed_over(self.host, rid, handle, hi - lo, self.host.cfg.handover_wait_s,
                                          self.layers[0].kv_cache.device, cancelled=lambda: rid in self._dropping,
                                          fallback=fallback):
            return False
        if self._on_done is not None:
            self._on_done(rid, hi, gen)
        return True

    def _copy(self, rid: str, blocks: list[int], lo: int, hi: int, state: tuple | None = None) -> None:
        """Read [lo, hi) of every layer from the paged cache, cluster, prepare it on the host; with ``state``
        (``_cluster_ahead``'s) the read and k-means were made ahead: only the store here. The move's seconds
        (``cluster_s``, ``move_thread_s``) are both stages' own, not the wait between them."""
        c0 = thread_clock()
        t = c0[0]
        if state is None:
            ks, vs = self._read(blocks, lo, hi)
            read_s, ahead, before = settled(ks[0]) - t, None, (0.0, 0.0, 0.0)
        else:
            ks, vs, read_s, ahead, before = state
            if ks[0].is_cuda:  # made on the ahead stream, used on this one: not reused before this one is done
                cur = torch.cuda.current_stream(ks[0].device)
                for x in (*ks, *vs, *(lab for lab, _ in ahead[1])):
                    x.record_stream(cur)
        self.host.stats.add(move_split_s={"read": read_s})
        self.host.put_layers(rid, ks, vs, commit=False, ahead=ahead)  # adds its parts (kmeans, pack[, store])
        wall, cpu, runq = (x + y for x, y in zip(clock_since(c0), before))
        self.host.stats.add(cluster_s=wall, moved_tokens=hi - lo,
                            moved_bytes=sum(2 * k.numel() * k.element_size() for k in ks),
                            move_thread_s={"cpu": cpu, "runq": runq, "blocked": max(0.0, wall - cpu - runq)})

    def _read(self, blocks: list[int], lo: int, hi: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Tokens [lo, hi) of every layer (nelssa_layer order) from the paged cache: keys, values [H, n, D]."""
        bs, dev = self.block_size, self.layers[0].kv_cache.device
        pos = torch.arange(lo, hi, device=dev)
        b, o = to_device(torch.tensor(blocks, dtype=torch.long), dev)[pos // bs], pos % bs
        ks, vs = [], []
        for layer in self.layers:
            k, v = self._read_kv(layer.kv_cache, layer.impl.nelssa_kv_layout, b, o, layer.num_kv_heads,
                                 layer.head_size)
            ks.append(k.transpose(0, 1).contiguous())
            vs.append(v.transpose(0, 1).contiguous())
        return ks, vs

    # ------------------------------------------------------------------ 5. load (recall.py)
    LOAD = 1 << 62  # a load's place among a request's moves: after any range ``ready`` may wait for

    def load(self, rid: str, blocks: list[int], lo: int, hi: int) -> Future:
        """Tokens [lo, hi) of ``rid`` (absolute positions, within its committed host range) read back from the
        host tier into the paged cache where ``blocks`` (its whole block row) puts them -> the load's future
        (its seconds). On this thread after the request's moves; on CUDA on the side stream after the main
        stream's work so far: the blocks were just allocated, and a step in flight may still write them for
        their former request."""
        fut = self._pool.submit(self._load, self._mark(), rid, list(blocks), lo, hi)
        self._moves.setdefault(rid, []).append((self.LOAD, fut))
        return fut

    def _load(self, ev, rid: str, blocks: list[int], lo: int, hi: int) -> float:
        t = time.perf_counter()
        self._on_side(ev, self._write_back, rid, blocks, lo, hi)
        dt = time.perf_counter() - t
        self.host.stats.add(recall_load_s=dt, recalled_tokens=hi - lo)
        return dt

    def _write_back(self, rid: str, blocks: list[int], lo: int, hi: int) -> None:
        if hi <= lo:
            return
        bs, dev = self.block_size, self.layers[0].kv_cache.device
        pos = torch.arange(lo, hi, device=dev)
        b, o = to_device(torch.tensor(blocks, dtype=torch.long), dev)[pos // bs], pos % bs
        for i, layer in enumerate(self.layers):
            k, v = self.host.read_back(rid, i, lo - self.sink, hi - self.sink, dev)
            write_kv(layer.kv_cache, layer.impl.nelssa_kv_layout, b, o, k.transpose(0, 1), v.transpose(0, 1))

    # ------------------------------------------------------------------ 0. warm
    def warm(self, tokens: int) -> float:
        """Once before serving: one move's device and host work (read, k-means of all layers, packing one
        layer, on CUDA through this thread's staging buffers) on the hand-off thread (and side stream),
        storing nothing (no host-tier call, no counter) -> seconds. On CUDA a process's first move
        otherwise pays its thread's one-time set-up (library handles, kernels loaded on first use,
        pinned buffers) while the engine steps: on the H200 the steps beside the first 8K move stood
        190-205 ms on the host side, beside the next one 11 ms at most (bench_handoff); the runner warms
        on CUDA only. The k-means runs on random keys of the cache's shape (uninitialised blocks may
        hold NaNs; what they hold is never used)."""
        if tokens <= 0:
            return 0.0
        t = time.perf_counter()
        if self._ahead is not None:  # its thread's set-up too (1: the moves' read and k-means run there)
            self._ahead.submit(self._warm, tokens, True).result()
        self._pool.submit(self._warm, tokens).result()
        return time.perf_counter() - t

    def _warm(self, tokens: int, ahead: bool = False) -> None:
        cuda = self.layers[0].kv_cache.is_cuda
        cfg = self.host.cfg
        if cuda:
            self._side_stream()
        side = self._ahead_side if ahead else self._side
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            k0, _ = self._read([0], 0, 1)  # the gather's kernels
            gen = torch.Generator(device=k0[0].device).manual_seed(cfg.seed)
            ks = [torch.randn(k.shape[0], tokens, k.shape[2], generator=gen, device=k.device).to(k.dtype)
                  for k in k0]
            labels = cluster_layers(ks, seed=cfg.seed, cluster_size=cfg.cluster_size, segment=cfg.segment,
                                    iters=cfg.iters)
            lab, C = labels[0]
            pack(ks[0], ks[0], part_stats(ks[0], ks[0], lab, C)[1])
        if cuda:
            side.synchronize()

    # ------------------------------------------------------------------ 2. ready
    def ready(self, rid: str, h: int) -> None:
        """Before a forward that attends [sink, h) on the host: moves up to h done and committed."""
        if self.host.committed(rid) == h - self.sink:
            return
        moves = self._moves.get(rid, [])
        t = time.perf_counter()
        waited = False
        while moves and moves[0][0] <= h:
            _, fut = moves.pop(0)
            waited |= not fut.done()
            fut.result()  # a failed move raises here: the caller fails the request
        if waited:
            self.host.stats.add(handoff_wait_s=time.perf_counter() - t)
        self.host.commit(rid, h - self.sink)

    # ------------------------------------------------------------------ 3. drop
    def drop(self, rid: str, preempted: bool = False, recalled: bool = False) -> None:
        """3 above; ``recalled`` (recall.py, 3): the request goes on as a device request, its generation kept
        (a later migration's moves are reported with it)."""
        self._dropping.add(rid)  # an adoption still waiting for its release gives up (handover.py, 5)
        for _, fut in self._moves.pop(rid, []):
            fut.exception()  # wait; the request is gone, its failure no longer matters
        self._dropping.discard(rid)
        self._end.pop(rid, None)
        self._parts.pop(rid, None)  # its host KV is freed by the caller: a later move is part 0 again
        self._failed.discard(rid)
        if preempted:
            self._gen[rid] = self._gen.get(rid, 0) + 1
        elif not recalled:
            self._gen.pop(rid, None)

    # ------------------------------------------------------------------ 4. hand-over (P)
    def handover(self, rid: str, handle: str, on_end) -> None:
        """A finished request of a prefill instance: released on the node under ``handle`` once its moves
        have run (this thread runs them in order), or freed if one failed; then ``on_end(rid)``. The
        step thread does not wait (handover.py, 3)."""
        self._moves.pop(rid, None)
        self._end.pop(rid, None)
        self._parts.pop(rid, None)
        self._gen.pop(rid, None)
        self._pool.submit(self._handover, rid, handle, on_end, time.monotonic())

    def _handover(self, rid: str, handle: str, on_end, ended: float) -> None:
        try:
            handover.release(self.host, rid, handle, failed=rid in self._failed, ended=ended)
        except Exception as e:  # noqa: BLE001 - D falls back; the blocks must still be reported
            log.error("NELSSA hand-over of %s failed: %s: %s", rid, type(e).__name__, e)
        finally:
            self._failed.discard(rid)
            on_end(rid)

    def in_flight(self) -> int:
        """Moves submitted and not yet finished (the step log's context; step thread)."""
        return sum(not fut.done() for moves in self._moves.values() for _, fut in moves)

    def wait_all(self) -> None:
        """Wait until every submitted move has finished (tests and shutdown; never on the step path)."""
        for moves in list(self._moves.values()):
            for _, fut in list(moves):
                fut.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # its moves wait for their stage ahead (1)
        if self._ahead is not None:
            self._ahead.shutdown(wait=True)
