"""NodeHostTier (engine "node"): LocalHostTier's interface over a nelssa-node service.

The client clusters where the keys are (as the local tier does, same seeds, so the same clusters),
keeps each layer's centroids / sizes / value means on that device for the centroid search
(``RemoteKV``), and streams the packed K/V to the node. Per layer and step one decode job carries
the queries and selected cluster ids of every long request to the node over shared memory (same host)
or a gRPC bidi stream and returns (output, LSE). On the same host with the C++ extension on both sides
the jobs take the native plane (csrc/node_plane.cpp): a plan per job shape, made once over gRPC, then
each job a round trip of raw arrays done in C++ (``prepare_call`` gives it as a HostCall, so the long
lane enqueues node jobs as it does local ones). Every failure raises HostError; a result is never
partial. Same-host stores go through a store slot (shared memory the node reads); with keys on a CUDA
device the slot is registered with CUDA (hostmem.pin), so each layer's packed K/V is one DMA into it.
Failures: a node that stops answering fails the call within ``host_timeout_s`` (a shared-
memory client fails a job after ``STALE_S`` with no heartbeat since it was posted); a node that lost the client
(restart, lease expiry) makes the client register again: its old requests fail, new ones are served.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import grpc
import torch

from nelssa._ext import ext
from nelssa.config import NelssaConfig, usable_cores
from nelssa.node.local import HostError, HostStats, call_results, pin_if, stage_queries
from nelssa.node.proto import nelssa_node_pb2 as pb
from nelssa.node.proto import nelssa_node_pb2_grpc as pb_grpc
from nelssa.node.server import is_loopback
from nelssa.node.wire import (DTYPE_IDS, ITEMSIZE, MAX_RELEASED_QUERY, TOKEN_HEADER, W_BEAT, W_CLOSED, W_REQ_SEQ,
                              W_RESP_SEQ, Limits, NativeChannel, PlanLayout, ShmChannel, StoreSlot, WireError,
                              decode_result, encode_job, plan_layout, store_bytes)
from nelssa.sparse import Selection, hostmem, pack
from nelssa.sparse.clustered import cluster_part, parts_stats, settled, unpack_parts, wait_stream

log = logging.getLogger("nelssa.node.client")

STALE_S = 2.0          # shared memory: a node heartbeat older than this is a dead node
STREAM_S = 3600.0      # deadline of one gRPC data-plane stream (reopened before it runs out)
STORE_BYTES_PER_S = 50e6  # a store's deadline: host_timeout_s + its bytes at this rate


def _status(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    return f"{code.name if code else 'ERROR'}: {e.details() if hasattr(e, 'details') else e}"


def _metadata(cfg: NelssaConfig) -> tuple:
    return ((TOKEN_HEADER, cfg.node_token),) if cfg.node_token else ()


def _call(stub, cfg: NelssaConfig, md: tuple, method: str, request, timeout: float):
    """One control-plane call; a gRPC failure is a HostError naming the node and the status."""
    try:
        return getattr(stub, method)(request, timeout=timeout, metadata=md)
    except grpc.RpcError as e:
        raise HostError(f"nelssa-node {method} at {cfg.node_address}: {_status(e)}") from None


class RemoteKV:
    """One layer of a request whose K/V is on the node: what the centroid search reads of a ClusteredKV
    (centroids [H, C, D], sizes [H, C] int32, vmeans on the keys' device; length), with prepared parts
    made visible by ``commit_until`` exactly like ClusteredKV."""

    def __init__(self, req_id: str, layer: int, H: int, D: int, dtype: torch.dtype, device: torch.device):
        self.req_id, self.layer = req_id, layer
        self.num_kv_heads, self.head_dim, self.dtype, self.device = H, D, dtype, device
        self.centroids = torch.empty(H, 0, D, dtype=dtype, device=device)
        self.sizes = torch.empty(H, 0, dtype=torch.int32, device=device)
        self.vmeans = torch.empty(H, 0, D, dtype=dtype, device=device)
        self.length = 0
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.freed = False

    @property
    def num_clusters(self) -> int:
        return self.centroids.shape[1]

    @property
    def device_nbytes(self) -> int:
        return self.centroids.nbytes + self.sizes.nbytes + self.vmeans.nbytes

    def check_alive(self) -> None:
        if self.freed:
            raise HostError(f"request {self.req_id}: host KV was freed")

    def commit_until(self, length: int) -> None:
        while self.pending and self.length + self.pending[0][0] <= length:
            n, cent, sizes, vmean = self.pending.pop(0)
            self.centroids = torch.cat([self.centroids, cent], 1)
            self.sizes = torch.cat([self.sizes, sizes], 1)
            self.vmeans = torch.cat([self.vmeans, vmean], 1)
            self.length += n
        if self.length != length:
            raise HostError(f"host KV of {self.req_id} holds {self.length} committed "
                            f"(+{sum(p[0] for p in self.pending)} prepared) tokens, {length} expected")


class _Req:
    def __init__(self, req_id: str, num_layers: int):
        self.req_id = req_id
        self.layers: list[RemoteKV | None] = [None] * num_layers
        self.part_tokens: list[int] = []   # tokens of each stored part
        # per stored part and layer its token order (int32 perm [H, n], host): what ReadBack's rows need to
        # be put back in token order; None where this tier did not store every part (an adopted request)
        # or keeps no order (``recall`` off, or a prefill instance's tier)
        self.orders: list[list[torch.Tensor]] | None = []
        self.bytes = 0          # on the node
        self.lost = ""          # why the node no longer holds it

    @property
    def parts(self) -> int:
        return len(self.part_tokens)


class _GrpcPlane:
    """Decode jobs over one long-lived bidi stream; one job in flight (the submission thread's)."""

    name = "grpc"

    def __init__(self, tier: "NodeHostTier"):
        self.tier = tier
        self.call = None
        self.q: queue.SimpleQueue | None = None
        self.opened = 0.0

    def _open(self) -> None:
        self.close()
        q = self.q = queue.SimpleQueue()

        def jobs():
            while True:
                j = q.get()
                if j is None:
                    return
                yield j

        self.call = self.tier._stub.Attend(jobs(), timeout=STREAM_S, metadata=self.tier._md)
        self.opened = time.monotonic()

    def run(self, job: pb.AttendJob, timeout: float) -> pb.AttendResult:
        if self.call is None or time.monotonic() - self.opened > STREAM_S - 4 * timeout:
            self._open()
        self.q.put(job)
        try:
            return next(self.call)
        except grpc.RpcError as e:
            self.call = None
            raise HostError(f"node data plane (gRPC): {_status(e)}") from None
        except StopIteration:
            self.call = None
            raise HostError("node data plane (gRPC): stream ended") from None

    def abort(self) -> None:
        if self.call is not None:
            self.call.cancel()
        self.call = None

    def close(self) -> None:
        if self.q is not None:
            self.q.put(None)
        self.abort()


class _ShmPlane:
    """Decode jobs through the node's shared-memory channel of this client (same host only)."""

    name = "shm"

    def __init__(self, tier: "NodeHostTier"):
        self.tier = tier
        self.ch: ShmChannel | None = None
        self._open()

    def _open(self) -> None:
        """(Re)open: the node retires a channel this client had (one left after a timeout)."""
        if self.ch is not None:
            self.ch.close()
            self.ch = None
        t = self.tier
        rep = t._rpc("OpenShm", pb.ShmRequest(client_id=t.client_id, slot_bytes=t.limits.max_message_bytes))
        self.ch = ShmChannel.attach(rep.path, rep.slot_bytes)
        try:  # both sides hold the mapping now: no name left behind even if the node is killed
            os.unlink(rep.path)
        except OSError:
            pass
        self.seq = max(int(self.ch.w[W_REQ_SEQ]), int(self.ch.w[W_RESP_SEQ]))
        self.broken = ""

    def run(self, job: pb.AttendJob, timeout: float) -> pb.AttendResult:
        if self.broken:  # the jobs that saw it break have failed; later ones get a fresh channel
            log.warning("reopening the shared-memory channel (%s)", self.broken)
            self._open()
        ch = self.ch
        payload = job.SerializeToString()
        if len(payload) > ch.slot:
            raise HostError(f"decode job of {len(payload)} B exceeds the node's shared-memory slot ({ch.slot} B)")
        self.seq += 1
        seq = self.seq
        ch.write("req", seq, payload)
        t0, t0_ns = time.monotonic(), time.monotonic_ns()
        deadline = t0 + timeout
        while int(ch.w[W_RESP_SEQ]) != seq:
            now = time.monotonic()
            if int(ch.w[W_CLOSED]):
                self.broken = "the node closed the channel (lease expired or node stopped)"
            elif now > deadline:
                self.broken = f"no answer within {timeout:.1f}s"
            elif (time.monotonic_ns() - max(int(ch.w[W_BEAT]), t0_ns)) * 1e-9 > STALE_S:  # none since the post
                self.broken = f"the node's heartbeat is older than {STALE_S}s (node dead?)"
            if self.broken:
                raise HostError(f"node data plane (shared memory): {self.broken}")
            time.sleep(0 if now - t0 < 2e-4 else 2e-5)
        return pb.AttendResult.FromString(ch.read("resp"))

    def abort(self) -> None:
        self.broken = self.broken or "a job timed out"

    def close(self) -> None:
        if self.ch is not None:
            self.ch.close()
            self.ch = None


def pad_selection(sel: Selection) -> Selection:
    """A selection for the native plane: int64 host ids of every request padded to one width, a power of
    two >= 16 (fewer plans: one per shape), counts int64."""
    w = max(i.shape[1] for i in sel.ids)
    S = 1 << max(4, (w - 1).bit_length())
    ids = []
    for i in sel.ids:
        i = i.to(device="cpu", dtype=torch.int64)
        ids.append(torch.nn.functional.pad(i, (0, S - i.shape[1])).contiguous() if i.shape[1] != S else i.contiguous())
    return Selection(ids, [c.to(device="cpu", dtype=torch.int64).contiguous() for c in sel.counts])


def client_spin_us(cfg: NelssaConfig, node_cores: frozenset[int] = frozenset()) -> int:
    """How long a native job polls its answer before it naps (config ``node_spin_us``; -1: by cores). A
    polling waiter holds a core, which delays the node's kernel where the two share cores: -1 polls long
    (1000 us) where this process may run on 8 or more cores, or where the node's devices are pinned to
    cores (``node_cores``, from the registration) none of which this process may run on (e.g. an engine
    pinned to 4 cores beside the node's: H100 run 65 napped at 20 us, 56 us of a call's 142 on the wire);
    else 20 us."""
    if cfg.node_spin_us >= 0:
        return cfg.node_spin_us
    mine = usable_cores()
    return 1000 if len(mine) >= 8 or (node_cores and not node_cores & mine) else 20


class _NativePlane:
    """Decode jobs through a native channel (csrc/node_plane.cpp has the contract): ``plan`` once per
    job shape (requests, their lengths, heads, selection width, dtype, scale; the node prepares every
    layer's calls), then ``call`` gives a C++ HostCall whose run() is the round trip."""

    name = "native"
    MAX_PLANS = 32   # kept per client (the node allows 64); the least recently used is dropped

    def __init__(self, tier: "NodeHostTier"):
        self.tier = tier
        self.plans: OrderedDict[tuple, tuple[int, PlanLayout]] = OrderedDict()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.chan = None
        self.epoch = 0   # +1 whenever a plan is dropped or the channel reopened: calls made before may name them
        self._open()

    def _open(self) -> None:
        t = self.tier
        if self.chan is not None:
            self.epoch += 1
        rep = t._rpc("OpenShm", pb.ShmRequest(client_id=t.client_id, slot_bytes=t.limits.max_message_bytes,
                                              native=True))
        ch = NativeChannel.attach(rep.path, rep.slot_bytes)
        ch.unlink()  # both sides hold the mapping now
        self.chan = ext().NodeChannel(ch.mem, rep.slot_bytes, STALE_S, client_spin_us(t.cfg, t.node_cores),
                                      t.cfg.node_margin_us)

    def _channel(self):
        """The channel, reopened when a job broke it (timeout, closed, stale heartbeat: the jobs that saw
        it failed; the node's plans of this client stay)."""
        with self._lock:
            if self.chan.broken:
                log.warning("reopening the native channel (%s)", self.chan.broken)
                self._open()
            return self.chan

    def plan(self, ckvs: list, Hq: int, D: int, S: int, dtype: torch.dtype, scale: float) -> tuple[int, PlanLayout]:
        key = (tuple((c.req_id, c.length) for c in ckvs), Hq, D, S, dtype, float(scale))
        with self._lock:
            hit = self.plans.get(key)
            if hit is not None:
                self.plans.move_to_end(key)
                return hit
        t, pid = self.tier, next(self._ids)
        rep = t._rpc("Plan", pb.PlanRequest(client_id=t.client_id, plan_id=pid, req_ids=[c.req_id for c in ckvs],
                                            lengths=[c.length for c in ckvs], num_heads=Hq, head_dim=D,
                                            q_dtype=DTYPE_IDS[dtype], selected=S, scale=scale))
        lay = plan_layout(len(ckvs), Hq, ckvs[0].num_kv_heads, D, S, ITEMSIZE[dtype], list(rep.head_bounds))
        if (lay.request_bytes, lay.response_bytes) != (rep.request_bytes, rep.response_bytes):
            raise HostError(f"nelssa-node plan layout differs from this client's: {rep} vs {lay}")
        drop = []
        with self._lock:
            self.plans[key] = (pid, lay)
            while len(self.plans) > self.MAX_PLANS:
                drop.append(self.plans.popitem(last=False)[1][0])
            self.epoch += bool(drop)
        for old in drop:
            try:
                t._rpc("DropPlan", pb.DropPlanRequest(client_id=t.client_id, plan_id=old))
            except HostError as e:  # its requests may be gone (the node dropped the plan with them)
                log.debug("dropping plan %d: %s", old, e)
        return pid, lay

    def forget(self, req_id: str) -> None:
        """The request was freed: the node dropped its plans with it."""
        with self._lock:
            for k in [k for k in self.plans if any(r == req_id for r, _ in k[0])]:
                del self.plans[k]

    def call(self, ckvs: list, q: torch.Tensor, sel: Selection, scale: float, layer: int, out: torch.Tensor,
             lse: torch.Tensor, cancel=None, fault: str = ""):
        """A HostCall for one layer: q [B, Hq, D], sel ids [H, S] / counts [H] int64 per request (host
        memory, read when it runs), out/lse fp32 written when it returns."""
        B, Hq, D = q.shape
        S = sel.ids[0].shape[1]
        pid, lay = self.plan(ckvs, Hq, D, S, q.dtype, scale)
        dims = [B, Hq, ckvs[0].num_kv_heads, D, S, q.element_size()]
        return ext().HostCall.remote(self._channel(), pid, layer, dims, list(lay.bounds), list(lay.q_off),
                                     list(lay.ids_off), list(lay.counts_off), list(lay.out_off), list(lay.lse_off),
                                     self.tier.cfg.host_timeout_s, q, list(sel.ids), list(sel.counts), out, lse,
                                     cancel, fault)

    def close(self) -> None:
        self.chan = None


def _wire_pieces(keys: list[torch.Tensor], values: list[torch.Tensor], stats: list, keep: bool, wait: bool = True):
    """A store's data in its wire order, the one description both paths write from: per layer the
    cluster sizes (int32 [H, C]), then the K/V packed by cluster ([H, n, 2, D]), then with ``keep`` the
    centroids and value means ([H, C, D] each); as (bytes, fill) pairs, ``fill(out)`` writing the
    piece into ``out`` (uint8 [bytes], host memory: the store slot or a buffer for the stream's chunks).
    ``wait=False`` (``out`` registered with CUDA): a device piece's copy is only enqueued on the current
    stream; the caller waits for it once (``_fill_slot``)."""
    nb = not wait
    for k, v, (sizes, perm, cent, vmean) in zip(keys, values, stats):
        H, n, D = k.shape
        yield sizes.numel() * 4, lambda out, s=sizes: out.view(torch.int32).copy_(s.reshape(-1), non_blocking=nb)
        yield (H * n * 2 * D * k.element_size(),
               lambda out, k=k, v=v, p=perm, shape=(H, n, 2, D): pack(k, v, p, out=out.view(k.dtype).view(shape),
                                                                      wait=wait))
        if keep:
            for t in (cent, vmean):
                yield (t.numel() * t.element_size(),
                       lambda out, t=t: out.view(t.dtype).copy_(t.reshape(-1), non_blocking=nb))


def _fill_slot(buf: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], stats: list,
               keep: bool) -> None:
    """A store's data written into the store slot ``buf`` (uint8) in its wire order (pack() in place). From
    a CUDA device into a slot registered with CUDA (``_pin_slot``) every piece's copy is enqueued and the
    stream waited for once, not once or more per layer (each such wait on the hand-off's low-priority
    stream stood behind the steps' kernels)."""
    enqueue = keys[0].is_cuda and buf.is_pinned()
    off = 0
    for nb, fill in _wire_pieces(keys, values, stats, keep, wait=not enqueue):
        fill(buf[off:off + nb])
        off += nb
    if enqueue:
        wait_stream(keys[0].device)


def _stream_chunks(header, keys: list[torch.Tensor], values: list[torch.Tensor], stats: list, step: int):
    """A store as gRPC chunks: the header, then its data in wire order, at most ``step`` bytes a chunk."""
    yield pb.StoreChunk(header=header)
    for nb, fill in _wire_pieces(keys, values, stats, header.keep_centroids):
        piece = torch.empty(nb, dtype=torch.uint8)
        fill(piece)
        flat = piece.numpy()
        for o in range(0, nb, step):
            yield pb.StoreChunk(data=flat[o:o + step].tobytes())


class NodeRoom:
    """The room nelssa-node has for long requests, as an engine's scheduler sees it (config ``engine: node``;
    the scheduler has no host tier of its own: it asks the node). From the node's Capacity: its
    devices' smallest capacity (and free bytes) times their number — head-wise partitioning puts a
    share of every request on every device, so the fullest device decides (cluster-wise: a
    conservative bound). A thread of its own asks every ``max_age_s``, so the scheduler's step never
    waits for the node; ``free`` is the latest answer, 0 while the node does not answer (logged once
    per outage: long requests wait, none is admitted into a failing store). On a P/D decode instance the
    same thread asks which watched hand-over handles are released (``watch``, ``released``)."""

    def __init__(self, cfg: NelssaConfig, max_age_s: float = 0.25):
        self.cfg, self.max_age_s = cfg, max_age_s
        self._md = _metadata(cfg)
        self._channel = grpc.insecure_channel(cfg.node_address)
        self._stub = pb_grpc.NelssaNodeStub(self._channel)
        self._down, self._stop = False, threading.Event()
        self._lock = threading.Lock()
        self._watched: set[str] = set()   # hand-over handles a decode instance waits for (watch)
        self._released: frozenset[str] = frozenset()  # those of them released, at the last answer
        t = time.monotonic()
        self.capacity, free = self._ask()  # HostError: an engine using a node it cannot reach does not start
        self._state = (free, t)
        threading.Thread(target=self._loop, name="nelssa-node-room", daemon=True).start()

    def watch(self, handle: str) -> None:
        """Ask, with the free bytes, whether the request handed over under ``handle`` is released (released)."""
        with self._lock:
            self._watched.add(handle)

    def forget(self, handle: str) -> None:
        with self._lock:
            self._watched.discard(handle)

    def released(self, handle: str) -> bool:
        """Whether, at the last answer (at most ``max_age_s`` old), the node held a request released under
        ``handle`` for its adopter (Released); False while the node does not answer."""
        return handle in self._released

    def _ask_released(self) -> None:
        with self._lock:
            handles = sorted(self._watched)
        out: set[str] = set()
        for i in range(0, len(handles), MAX_RELEASED_QUERY):
            rep = _call(self._stub, self.cfg, self._md, "Released",
                        pb.ReleasedRequest(handles=handles[i:i + MAX_RELEASED_QUERY]), self.cfg.host_timeout_s)
            out.update(rep.handles)
        self._released = frozenset(out)

    def _ask(self) -> tuple[int, int]:
        # the config's host-tier deadline: on a loaded 2-vCPU box a 5-s one expired again and again in the
        # engine's process (the node answered other processes in ms) and held every long request back
        rep = _call(self._stub, self.cfg, self._md, "Capacity", pb.CapacityRequest(), self.cfg.host_timeout_s)
        devs = list(rep.devices)
        if not devs:
            return 0, 0
        n = len(devs)
        return (min(d.capacity_bytes for d in devs) * n,
                max(0, min(d.capacity_bytes - d.used_bytes for d in devs)) * n)

    def _loop(self) -> None:
        while not self._stop.wait(self.max_age_s):
            t = time.monotonic()
            try:
                _, free = self._ask()
                self._state = (free, t)
                self._ask_released()
                if self._down:
                    log.warning("nelssa-node at %s answers again", self.cfg.node_address)
                self._down = False
            except HostError as e:
                if not self._down:
                    log.error("%s: no long request is admitted until it answers", e)
                self._state, self._down, self._released = (0, t), True, frozenset()

    def free(self) -> tuple[int, float]:
        """(free bytes, time.monotonic() when they were asked for): the answer holds every store that
        completed before that time."""
        return self._state

    def close(self) -> None:
        self._stop.set()
        self._channel.close()


class NodeHostTier:
    """Host tier on a nelssa-node (config ``engine: node``, ``node_address``, ``node_token``,
    ``node_transport``); same interface as LocalHostTier."""

    def __init__(self, cfg: NelssaConfig, num_layers: int, keep_centroids: bool = False):
        """``keep_centroids``: stores also leave each part's centroid state on the node, so a request
        this client releases can be adopted without it (a prefill instance's tier: ``adopt``)."""
        self.cfg, self.num_layers, self.keep_centroids = cfg, num_layers, keep_centroids
        # a recall (config ``recall``) reads a migrated request back (read_back): each part's token order is
        # kept here, int32 per token, KV head and layer (1/512 of the K/V in bf16 with 128-wide heads); a
        # prefill instance's tier (keep_centroids) hands its requests over and never recalls
        self._keep_order = cfg.recall and not keep_centroids
        self.reqs: dict[str, _Req] = {}
        self.stats = HostStats()
        self._lock = threading.Lock()
        self._md = _metadata(cfg)
        big = 64 << 20
        self._channel = grpc.insecure_channel(cfg.node_address, options=[
            ("grpc.max_receive_message_length", big), ("grpc.max_send_message_length", big)])
        self._stub = pb_grpc.NelssaNodeStub(self._channel)
        self._jobs = itertools.count(1)
        self._to_free: list[str] = []
        self._closed = threading.Event()
        self._plane = None
        self._native: _NativePlane | None = None
        self._plane_lock = threading.Lock()  # the data plane is swapped only between jobs
        self._slot: StoreSlot | None = None   # same-host stores (wire.py "store slot"), made on first use
        self._slot_off = False                # the node could not make one: stores stream over gRPC
        self._slot_stale = False              # the slot was the last registration's: replaced on next use
        self._slot_pinned: bool | None = None  # registered with CUDA (hostmem.pin) for device stores; None: not tried
        self._slot_lock = threading.Lock()    # one store at a time through the slot
        self._register()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nelssa-node-client")
        self._renewer = threading.Thread(target=self._renew_loop, name="nelssa-node-lease", daemon=True)
        self._renewer.start()

    # -------- control plane
    def _rpc(self, method: str, request, timeout: float | None = None):
        return _call(self._stub, self.cfg, self._md, method, request, timeout or self.cfg.host_timeout_s)

    def _transport(self) -> str:
        """native (shared memory: native jobs, protobuf ones where the native plane does not serve),
        shm (protobuf jobs through shared memory) or grpc."""
        t = self.cfg.node_transport
        if t == "auto":
            return "native" if is_loopback(self.cfg.node_address.rsplit(":", 1)[0]) else "grpc"
        return t

    def _register(self) -> None:
        rep = self._rpc("Register", pb.RegisterRequest(name=f"nelssa-client-{id(self):x}", lease_s=self.cfg.node_lease_s))
        self.client_id, self.lease_s = rep.client_id, rep.lease_s
        self.limits = Limits.from_pb(rep.limits)
        self.node_devices = len(rep.devices)
        # the node's device cores where every device is pinned (client_spin_us); empty: not known to be apart
        pinned = all(d.cores for d in rep.devices)
        self.node_cores = frozenset(c for d in rep.devices for c in d.cores) if pinned else frozenset()
        self._slot_off, self._slot_stale = False, True  # a new registration: a new slot when needed
        if self._plane is not None:
            self._plane.close()
        tr = self._transport()
        self._plane = _GrpcPlane(self) if tr == "grpc" else _ShmPlane(self)
        self._native = None
        if tr == "native" and ext() is not None and (self.node_devices == 1 or rep.partition == pb.HEAD):
            try:
                self._native = _NativePlane(self)
            except HostError as e:  # a node without the extension: the protobuf planes only
                log.warning("nelssa-node offers no native data plane (%s); jobs take the %s plane", e, self._plane.name)
        log.info("nelssa-node %s: client %s, %d devices, data plane %s", self.cfg.node_address, self.client_id,
                 self.node_devices, "native" if self._native is not None else self._plane.name)

    def _renew_loop(self) -> None:
        while not self._closed.wait(max(0.05, self.lease_s / 3)):
            try:
                self._rpc("Renew", pb.RenewRequest(client_id=self.client_id), timeout=max(0.5, self.lease_s / 3))
                with self._lock:
                    retry, self._to_free = self._to_free, []
                for rid in retry:
                    self._free_remote(rid)
            except HostError as e:
                if "NOT_FOUND" not in str(e):
                    log.warning("lease renewal: %s", e)
                    continue
                log.error("nelssa-node lost this client (%s); registering again, its requests fail", e)
                with self._lock:
                    for r in self.reqs.values():
                        r.lost = "the node no longer holds it (node restarted or lease expired)"
                    self._to_free = []
                try:
                    with self._plane_lock:
                        self._register()
                except HostError as e2:
                    log.warning("re-registration: %s", e2)

    # -------- KV placement
    SLOT_MIN = 256 << 20  # a store slot is made at least this large (a segment of an 8B model: ~0.5 GB)

    def _store_slot(self, nbytes: int) -> StoreSlot | None:
        """(Under _slot_lock.) The store slot for a store of ``nbytes``, made or grown as needed; None: the
        store streams over gRPC (a remote node, a store over the node's --max-store-slot, or a node
        that could not make one)."""
        if self._slot_stale:
            self._drop_slot()
            self._slot_stale = False
        if self._slot_off or self._transport() == "grpc" or nbytes > self.limits.max_store_slot_bytes:
            return None
        if self._slot is not None and self._slot.slot >= nbytes:
            return self._slot
        size = min(self.limits.max_store_slot_bytes, max(nbytes, self.SLOT_MIN))
        self._drop_slot()
        try:
            rep = self._rpc("OpenShm", pb.ShmRequest(client_id=self.client_id, slot_bytes=size, store=True))
            slot = StoreSlot.attach(rep.path, rep.slot_bytes)
        except (HostError, OSError, WireError) as e:
            log.warning("nelssa-node store slot of %d bytes: %s; stores stream over gRPC", size, e)
            self._slot_off = True
            return None
        slot.unlink()  # both sides hold the mapping
        self._slot = slot
        return slot

    def _drop_slot(self) -> None:
        """(Under _slot_lock, or at close.) Let the store slot go, unregistered from CUDA first."""
        if self._slot is not None and self._slot_pinned:
            hostmem.unpin(self._slot.data)
        self._slot, self._slot_pinned = None, None

    def _pin_slot(self, slot: StoreSlot, device: torch.device) -> None:
        """(Under _slot_lock.) A store from a CUDA device: the slot registered with CUDA once, so that each
        layer's packed K/V is one DMA into it (clustered.to_host) instead of a staged copy; a failed
        registration is logged once and the slot used through the staging buffers."""
        if device.type == "cuda" and self._slot_pinned is None:
            self._slot_pinned = hostmem.pin(slot.data, device)

    def put_layers(self, req_id: str, keys: list[torch.Tensor], values: list[torch.Tensor],
                   commit: bool = True, ahead: tuple | None = None) -> None:
        """As LocalHostTier.put_layers; the packed K/V goes to the node (one store per call, all layers:
        through the store slot on the node's host, else streamed over gRPC), the centroids stay here."""
        cfg = self.cfg
        if cfg.fault == "store":
            raise HostError("injected host-tier fault (NELSSA_FAULT=store)")
        if len(keys) != self.num_layers or len(values) != self.num_layers:
            raise HostError(f"put_layers: {len(keys)} layers given, the host tier has {self.num_layers}")
        r = self.reqs.get(req_id) or _Req(req_id, self.num_layers)  # a new one is kept once the node holds it
        if r.lost:
            raise HostError(f"request {req_id}: {r.lost}")
        H, n, D = keys[0].shape
        dtype = keys[0].dtype
        if dtype not in DTYPE_IDS or any(k.shape != (H, n, D) or v.shape != k.shape for k, v in zip(keys, values)):
            raise HostError(f"put_layers: every layer's keys/values must be [{H}, {n}, {D}] of bf16/fp16/fp32")
        part = r.parts
        labels, kmeans_s = cluster_part(keys, cfg, part, ahead)
        t1 = time.perf_counter()
        stats = parts_stats(keys, values, labels)
        header = pb.StoreHeader(client_id=self.client_id, req_id=req_id, part=part, num_layers=self.num_layers,
                                kv_heads=H, head_dim=D, dtype=DTYPE_IDS[dtype], tokens=n,
                                clusters=[C for _, C in labels], keep_centroids=self.keep_centroids)
        nbytes = store_bytes(H, D, keys[0].element_size(), n, [C for _, C in labels], self.keep_centroids)
        timeout = cfg.host_timeout_s + nbytes / STORE_BYTES_PER_S
        with self._slot_lock:
            slot = self._store_slot(nbytes)
            if slot is not None:  # same host: the data straight into the shared slot, only the header on gRPC
                self._pin_slot(slot, keys[0].device)
                _fill_slot(slot.data, keys, values, stats, self.keep_centroids)
                t2 = time.perf_counter()
                header.from_slot = True
                rep = self._rpc("Store", iter([pb.StoreChunk(header=header)]), timeout=timeout)
        if slot is None:
            t2 = settled(keys[0])  # streamed: the packing runs as gRPC takes the chunks (counted as the store)
            step = max(1 << 16, min(4 << 20, self.limits.max_message_bytes - (1 << 12)))
            rep = self._rpc("Store", _stream_chunks(header, keys, values, stats, step), timeout=timeout)
        self.stats.add(move_split_s={"kmeans": kmeans_s, "pack": t2 - t1, "store": time.perf_counter() - t2})
        order = [perm.to("cpu", torch.int32) for _, perm, _, _ in stats] if self._keep_order else None
        with self._lock:
            for i, (sizes, _, cent, vmean) in enumerate(stats):
                if r.layers[i] is None:
                    r.layers[i] = RemoteKV(req_id, i, H, D, dtype, keys[i].device)
                r.layers[i].pending.append((n, cent, sizes.to(torch.int32), vmean))
            r.part_tokens.append(n)
            r.orders = r.orders + [order] if r.orders is not None and order is not None else None
            r.bytes = rep.bytes
            if req_id not in self.reqs:
                self.reqs[req_id] = r
                self.stats.add(long_requests=1)
        if commit:
            self.commit(req_id, r.layers[0].length + sum(p[0] for p in r.layers[0].pending))

    def commit(self, req_id: str, length: int) -> None:
        """Make prepared parts visible until every layer holds exactly ``length`` tokens (the node
        makes the same parts visible when a job attends that many tokens)."""
        r = self.reqs.get(req_id)
        if r is None:
            raise HostError(f"request {req_id} has no host KV")
        if r.lost:
            raise HostError(f"request {req_id}: {r.lost}")
        if any(c is None for c in r.layers):
            raise HostError(f"request {req_id}: host KV incomplete (layers missing)")
        for c in r.layers:
            c.commit_until(length)

    def committed(self, req_id: str) -> int:
        r = self.reqs.get(req_id)
        return r.layers[0].length if r is not None and r.layers[0] is not None else 0

    def layer_kv(self, req_id: str, layer: int) -> RemoteKV:
        r = self.reqs.get(req_id)
        if r is None:
            raise HostError(f"request {req_id} has no host KV")
        if r.lost:
            raise HostError(f"request {req_id}: {r.lost}")
        c = r.layers[layer]
        if c is None:
            raise HostError(f"request {req_id}: layer {layer} has no host KV")
        return c

    def read_back(self, req_id: str, layer: int, lo: int, hi: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """As LocalHostTier.read_back: keys, values [H, hi - lo, D] of committed tokens [lo, hi) of one layer
        in token order, on ``device``. Each part the range touches comes from the node as stored
        (ReadBack) and is put back in token order by the order kept at its store (``unpack_parts``)."""
        if self.cfg.fault == "recall":
            raise HostError("injected host-tier fault (NELSSA_FAULT=recall)")
        c = self.layer_kv(req_id, layer)
        r = self.reqs[req_id]
        orders = r.orders
        if orders is None or len(orders) != r.parts:
            raise HostError(f"request {req_id}: this tier did not keep the token order of its parts "
                            f"(adopted from another client, or stored with recall off): no read-back")
        H, D, dtype = c.num_kv_heads, c.head_dim, c.dtype
        dev = torch.device(device) if device is not None else None
        parts, off = [], 0
        for p, (n, order) in enumerate(zip(r.part_tokens, orders)):
            parts.append((off, order[layer],
                          lambda p=p, n=n: self._read_part(req_id, layer, p, (H, n, 2, D), dtype, dev)))
            off += n
        try:
            return unpack_parts(parts, lo, hi, c.length, H, D, dtype, device)
        except ValueError as e:
            raise HostError(f"read-back of {req_id}: {e}") from None

    def _read_part(self, req_id: str, layer: int, part: int, shape: tuple, dtype: torch.dtype,
                   device: torch.device | None = None) -> torch.Tensor:
        """One stored part of one layer from the node (ReadBack), as stored: [H, n, 2, D] of ``dtype``. On the
        node's host through the store slot (the node writes it there), copied out of it before the slot is
        let go: to a CUDA ``device`` as one DMA (the slot registered with CUDA, as for device stores), else
        into host memory; from a remote node streamed."""
        want = math.prod(shape) * ITEMSIZE[dtype]

        def ask(to_slot: bool):
            return self._stream("ReadBack", pb.ReadBackRequest(client_id=self.client_id, req_id=req_id, layer=layer,
                                                               part=part, to_slot=to_slot), want)
        with self._slot_lock:
            slot = self._store_slot(want)
            if slot is not None:
                self._receive(ask(True), 0, f"{req_id}'s layer {layer} part {part} (written to the store slot)")
                src = slot.data[:want].view(dtype).view(shape)
                if device is not None and device.type == "cuda":
                    self._pin_slot(slot, device)
                    if self._slot_pinned:
                        out = src.to(device, non_blocking=True)
                        torch.cuda.current_stream(device).synchronize()  # the next store or read reuses the slot
                        return out
                return src.clone()
        return self._receive(ask(False), want, f"{req_id}'s layer {layer} part {part}").view(dtype).view(shape)

    def _stream(self, method: str, request, nbytes: int):
        """A server-streaming call's DataChunks (Centroids, ReadBack), its deadline host_timeout_s plus
        ``nbytes`` at STORE_BYTES_PER_S; a gRPC failure is a HostError naming the node and the status."""
        try:
            yield from getattr(self._stub, method)(request, timeout=self.cfg.host_timeout_s + nbytes / STORE_BYTES_PER_S,
                                                   metadata=self._md)
        except grpc.RpcError as e:
            raise HostError(f"nelssa-node {method} at {self.cfg.node_address}: {_status(e)}") from None

    @staticmethod
    def _receive(chunks, want: int, what: str) -> torch.Tensor:
        """Exactly ``want`` bytes of ``what`` from a stream of DataChunks -> uint8 [want]; a byte more or fewer
        is an error, never a guess."""
        buf = torch.empty(want, dtype=torch.uint8)
        off = 0
        for m in chunks:
            k = len(m.data)
            if off + k > want:
                raise HostError(f"the node sent more than the {want} bytes of {what}")
            buf[off:off + k] = torch.frombuffer(m.data, dtype=torch.uint8)
            off += k
        if off != want:
            raise HostError(f"the node sent {off} of the {want} bytes of {what}")
        return buf

    def has(self, req_id: str) -> bool:
        return req_id in self.reqs

    def _free_remote(self, req_id: str) -> None:
        try:
            self._rpc("Free", pb.FreeRequest(client_id=self.client_id, req_id=req_id))
        except HostError as e:
            if "NOT_FOUND" in str(e):
                return  # the node dropped this client: nothing of it is held
            log.warning("free of %s on the node failed (%s); retried with the next lease renewal", req_id, e)
            with self._lock:
                self._to_free.append(req_id)

    def free(self, req_id: str) -> bool:
        with self._lock:
            r = self.reqs.pop(req_id, None)
        if r is None:
            return False
        for c in r.layers:
            if c is not None:
                c.freed = True
        if self._native is not None:
            self._native.forget(req_id)
        if not r.lost:
            self._free_remote(req_id)
        return True

    # -------- hand-over (issue 11: a prefill instance's request taken over by a decode instance)
    def release(self, req_id: str, ttl_s: float = 60.0, handle: str = "") -> tuple[str, list[RemoteKV]]:
        """The request leaves this client without being freed on the node -> (handle, its layers'
        centroid state). Whoever gets the handle adopts it (``adopt``: with the centroid state given, or
        from the node when this tier keeps it there); the node frees it if nobody does within ``ttl_s``.
        ``handle``: this client's choice (wire.valid_handle), e.g. one already named to the adopter;
        else the node draws one. The local entry is gone either way."""
        with self._lock:
            r = self.reqs.get(req_id)
        if r is None:
            raise HostError(f"request {req_id} has no host KV")
        if r.lost or any(c is None for c in r.layers):
            raise HostError(f"request {req_id}: {r.lost or 'host KV incomplete (layers missing)'}")
        rep = self._rpc("Release", pb.ReleaseRequest(client_id=self.client_id, req_id=req_id, ttl_s=ttl_s,
                                                     handle=handle))
        with self._lock:
            self.reqs.pop(req_id, None)
        if self._native is not None:
            self._native.forget(req_id)
        return rep.handle, list(r.layers)

    def adopt(self, handle: str, req_id: str, layers: list[RemoteKV] | None = None,
              device: torch.device | str = "cpu") -> None:
        """Take over a request another client released (``release``'s handle, e.g. from a prefill
        instance) under ``req_id``: its K/V stays where it is on the node; its centroid state is copied
        here, from ``layers`` (the releasing tier's) to their device, or, without them, fetched from the
        node (the request was stored with ``keep_centroids``) to ``device``. The node's record of the
        request (parts, clusters, committed tokens) must match the layers given: a mismatch is an error,
        never a guess."""
        if layers is not None and len(layers) != self.num_layers:
            raise HostError(f"adopt: {len(layers)} layers given, the host tier has {self.num_layers}")
        rep = self._rpc("Adopt", pb.AdoptRequest(client_id=self.client_id, handle=handle, req_id=req_id))
        if layers is None:
            try:
                layers = self._fetch_centroids(req_id, rep, torch.device(device))
            except HostError as e:  # the request is this client's now: free it rather than leak it
                self._free_remote(req_id)
                raise HostError(f"adopt {req_id}: {e}") from None
        P, L = len(rep.part_tokens), rep.num_layers
        problem = ""
        if L != self.num_layers or len(rep.part_clusters) != P * L:
            problem = f"the node holds {L} layers, this tier has {self.num_layers}"
        else:
            for i, c in enumerate(layers):
                parts = c.num_clusters + sum(p[1].shape[1] for p in c.pending)
                node = sum(rep.part_clusters[k * L + i] for k in range(P))
                if (c.num_kv_heads, c.head_dim, DTYPE_IDS.get(c.dtype)) != (rep.kv_heads, rep.head_dim, rep.dtype) \
                        or parts != node or c.length + sum(p[0] for p in c.pending) != sum(rep.part_tokens) \
                        or c.length < rep.committed:  # the node commits lazily: never ahead of the client
                    problem = (f"layer {i}: {parts} clusters over {c.length} committed tokens given, the node "
                               f"holds {node} over {rep.committed} of {sum(rep.part_tokens)}")
                    break
        if problem:  # the node's request is this client's now: free it rather than leak it
            self._free_remote(req_id)
            raise HostError(f"adopt {req_id}: {problem}")
        r = _Req(req_id, self.num_layers)
        r.orders = None  # stored by another client: the token order of its parts is not here
        for i, c in enumerate(layers):
            k = RemoteKV(req_id, i, c.num_kv_heads, c.head_dim, c.dtype, c.device)
            k.centroids, k.sizes, k.vmeans, k.length = c.centroids.clone(), c.sizes.clone(), c.vmeans.clone(), c.length
            k.pending = [(n, cent.clone(), sz.clone(), vm.clone()) for n, cent, sz, vm in c.pending]
            r.layers[i] = k
        r.part_tokens, r.bytes = [int(n) for n in rep.part_tokens], rep.bytes
        with self._lock:
            self.reqs[req_id] = r
            self.stats.add(long_requests=1)

    def _fetch_centroids(self, req_id: str, rep: pb.AdoptReply, device: torch.device) -> list[RemoteKV]:
        """The centroid state of an adopted request from the node (Centroids), as the layers of a
        releasing tier: the committed parts (``rep.committed`` tokens) merged, the rest prepared."""
        L, H, D = rep.num_layers, rep.kv_heads, rep.head_dim
        if L != self.num_layers:
            raise HostError(f"the node holds {L} layers, this tier has {self.num_layers}")
        dtype = next((t for t, i in DTYPE_IDS.items() if i == rep.dtype), None)
        if dtype is None:
            raise HostError(f"the node's request has dtype id {rep.dtype}")
        es = torch.empty((), dtype=dtype).element_size()
        P = len(rep.part_tokens)
        if len(rep.part_clusters) != P * L:
            raise HostError(f"the node's record has {len(rep.part_clusters)} cluster counts for {P} parts of {L} layers")
        want = sum(H * C * (4 + 2 * D * es) for C in rep.part_clusters)
        buf = self._receive(self._stream("Centroids", pb.CentroidsRequest(client_id=self.client_id, req_id=req_id),
                                         want), want, "centroid state its record implies")
        layers = [RemoteKV(req_id, i, H, D, dtype, device) for i in range(L)]
        off = 0
        for p in range(P):
            for i in range(L):
                C = rep.part_clusters[p * L + i]
                sizes = buf[off:off + H * C * 4].view(torch.int32).view(H, C)
                off += H * C * 4
                cv = buf[off:off + 2 * H * C * D * es].view(dtype).view(2, H, C, D)
                off += 2 * H * C * D * es
                layers[i].pending.append((int(rep.part_tokens[p]), cv[0].to(device), sizes.to(device),
                                          cv[1].to(device)))
        for c in layers:
            c.commit_until(int(rep.committed))
        return layers

    @property
    def nbytes(self) -> int:
        """Bytes this client's requests hold on the node."""
        with self._lock:
            return sum(r.bytes for r in self.reqs.values() if not r.lost)

    # -------- attention
    def submit_attend(self, q: torch.Tensor, ckvs: list[RemoteKV], sel: Selection, scale: float,
                      layer: int, pin_result: bool | None = None) -> Future:
        """One decode job for all requests of ``ckvs`` (queries [n, Hq, D]); a future of fp32
        (out [n, Hq, D], lse [n, Hq]) on the host."""
        q_cpu, ready, pinned = stage_queries(q, sel, pin_result)
        req_ids = [c.req_id for c in ckvs]
        lengths = [c.length for c in ckvs]
        for c in ckvs:
            c.check_alive()
        fault = self.cfg.fault
        timeout = self.cfg.host_timeout_s

        native = self._native

        def run():
            if ready is not None:
                ready.synchronize()
            if fault == "attend":
                raise HostError("injected host-tier fault (NELSSA_FAULT=attend)")
            if native is not None:
                return self._run_native(native, q_cpu, ckvs, sel, scale, layer, pinned)
            t = time.perf_counter()
            B, Hq, D = q_cpu.shape
            with self._plane_lock:
                job = encode_job(next(self._jobs), self.client_id, layer, scale, q_cpu.contiguous(), req_ids,
                                 lengths, list(sel.ids), list(sel.counts))
                res = self._plane.run(job, timeout)
            if res.code:
                raise HostError(f"nelssa-node job (layer {layer}): {_CODES.get(res.code, str(res.code))}: {res.message}")
            if res.job_id != job.job_id:
                raise HostError(f"nelssa-node answered job {res.job_id} for job {job.job_id}")
            try:
                out, lse = decode_result(res, B, Hq, D)
            except ValueError as e:
                raise HostError(f"nelssa-node result (layer {layer}): {e}") from None
            self.stats.add(attn_s=time.perf_counter() - t)
            return pin_if((out, lse), pinned)

        return self._pool.submit(run)

    def _run_native(self, plane: _NativePlane, q: torch.Tensor, ckvs: list, sel: Selection, scale: float, layer: int,
                    pinned: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One job on the native plane, on this thread (the C++ round trip releases the GIL), its selection
        padded (``pad_selection``)."""
        B, Hq, D = q.shape
        out = torch.empty(B, Hq, D, pin_memory=pinned)
        lse = torch.empty(B, Hq, pin_memory=pinned)
        call = plane.call(ckvs, q.contiguous(), pad_selection(sel), scale, layer, out, lse)
        call.run()
        err = call_results(self.stats, [call])
        if err is not None:
            raise HostError(err)
        return out, lse

    # -------- prepared calls (the long lane: lane_host.py)
    @property
    def prepared_calls(self) -> bool:
        """Whether ``prepare_call`` works: the native plane is open."""
        return self._native is not None

    def prepare_call(self, q: torch.Tensor, ckvs: list, sel: Selection, scale: float, layer: int,
                     out: torch.Tensor, lse: torch.Tensor, cancel=None):
        """As LocalHostTier.prepare_call, the work done by the node through the native plane (a plan per
        shape; the call's run() is the round trip). HostError without the native plane."""
        if self._native is None:
            raise HostError("prepared host calls need the node's native plane (same host, C++ extension)")
        for c in ckvs:
            c.check_alive()
        fault = "injected host-tier fault (NELSSA_FAULT=attend)" if self.cfg.fault == "attend" else ""
        return self._native.call(ckvs, q, sel, scale, layer, out, lse, cancel, fault)

    def call_results(self, calls: list) -> str | None:
        return call_results(self.stats, calls)

    @property
    def capture_epoch(self) -> int:
        """Changes whenever a node plan or the channel that prepared calls name was replaced (a captured lane
        batch keyed on it is captured again: vllm_plugin/lane_batch.py, 1)."""
        return self._native.epoch if self._native is not None else 0

    def wait(self, fut: Future, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            out, lse = fut.result(timeout=self.cfg.host_timeout_s)
        except FutureTimeout:
            self.stats.add(failures=1)
            self._plane.abort()
            raise HostError(f"host attention of layer {layer} on nelssa-node timed out after "
                            f"{self.cfg.host_timeout_s}s") from None
        except Exception:
            self.stats.add(failures=1)
            raise
        if not (torch.isfinite(out).all() and not torch.isnan(lse).any()):
            self.stats.add(failures=1)
            raise HostError(f"host attention of layer {layer} returned non-finite values")
        return out, lse

    # -------- node reports
    def node_stats(self) -> pb.StatsReply:
        return self._rpc("Stats", pb.StatsRequest())

    def close(self) -> None:
        """Drop this client and all its KV on the node (best effort: a node that is gone has nothing
        to drop, and a node that missed this drops it at lease expiry)."""
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self._rpc("Unregister", pb.RenewRequest(client_id=self.client_id), timeout=5.0)
        except HostError as e:
            log.warning("unregistering from the node: %s", e)
        with self._lock:
            for r in self.reqs.values():
                for c in r.layers:
                    if c is not None:
                        c.freed = True
            self.reqs.clear()
        if self._plane is not None:
            self._plane.close()
        if self._native is not None:
            self._native.close()
        with self._slot_lock:  # after a store in flight
            self._drop_slot()
        self._channel.close()


_CODES = {c.value[0]: c.name for c in grpc.StatusCode}
