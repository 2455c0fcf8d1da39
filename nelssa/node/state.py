"""nelssa-node's state: clustered KV of many clients' long requests on N emulated PNM devices, sparse attention
over it per decode job (the paper's NelssaHost: KV partitioner, job dispatcher, output aggregator).

* Devices: a device is a native worker thread (csrc/device_group.cpp) pinned to its own cores (when
  given) whose kernel calls run an OpenMP team of ``threads_per_device`` threads, inheriting the
  pinning, plus a byte capacity. A job's shares are handed to the workers and awaited in C++.
* Partitioning (paper 5.3): ``head`` - a device holds every cluster of its share of KV heads; a job
  goes to all devices at once and the aggregator concatenates the heads. ``cluster`` - a device holds
  whole clusters (global cluster id mod devices) of every head; every device attends the job's
  selection over its own clusters and the aggregator merges the partial results by LSE.
* Ingestion (paper 5.1): stores are copied by the gRPC handler thread, optionally pinned to
  ``ingest_cores``; decode jobs run on the device threads, never behind a store.
* Control plane (nelssa.node.server): gRPC calls become the methods of ``NodeState``.
* Data plane: the same AttendJob/AttendResult over a gRPC bidi stream or a shared-memory channel
  served by a polling responder thread per client; and for same-host clients the native plane
  (csrc/node_plane.cpp): a plan (``Plan``) fixes a job's shape, each job is raw arrays at the plan's
  offsets in a native channel, served by a C++ thread that runs the plan's prepared calls on the
  devices (head-wise partitioning; no Python per job).
* Leases: every call renews the caller's lease; a client whose lease runs out is dropped with all
  its KV (and its shared-memory channel). Only time the node ran counts: a node that was itself
  paused (stopped, its VM suspended) extends every lease by the pause, since no client could renew.
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
import uuid
from typing import TYPE_CHECKING

import grpc
import torch
from google.protobuf.message import DecodeError

from nelssa._ext import ext
from nelssa.node.proto import nelssa_node_pb2 as pb
from nelssa.node.wire import (DTYPE_IDS, ITEMSIZE, MAX_RELEASED_QUERY, W_REQ_SEQ, NativeChannel, ShmChannel, StoreSlot,
                              WireError, centroid_bytes, decode_job, dtype_of, plan_layout, store_bytes, tensor_bytes,
                              valid_handle)
from nelssa.sparse import Selection, host_empty, host_empty_on, hostmem, merge_states, prepare_attend
from nelssa.node.storage import (Client, Device, Devices, NodeError, NodeRequest, even_share, split_heads,
                                 table_bytes)

if TYPE_CHECKING:
    from nelssa.node.server import NodeSettings

log = logging.getLogger("nelssa.node")


# ---------------------------------------------------------------- metrics

class Metrics:
    def __init__(self, node: "NodeState"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = r = CollectorRegistry()
        self.device_bytes = Gauge("nelssa_node_device_bytes", "bytes held or reserved per device", ["device"], registry=r)
        self.device_capacity = Gauge("nelssa_node_device_capacity_bytes", "capacity per device", ["device"], registry=r)
        for d in node.devices:
            self.device_bytes.labels(device=str(d.index)).set_function(lambda d=d: d.used)
            self.device_capacity.labels(device=str(d.index)).set(d.capacity)
        self.clients = Gauge("nelssa_node_clients", "registered clients", registry=r)
        self.clients.set_function(lambda: len(node.clients))
        self.requests = Gauge("nelssa_node_requests", "requests holding KV", registry=r)
        self.requests.set_function(lambda: sum(len(c.reqs) for c in list(node.clients.values())))
        self.jobs = Counter("nelssa_node_jobs", "decode jobs", ["plane", "outcome"], registry=r)
        self.job_s = Histogram("nelssa_node_job_seconds", "decode job time on the node (validation to aggregation)",
                               ["plane"], registry=r,
                               buckets=(5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5, 2.0))
        self.ingested = Counter("nelssa_node_ingested_bytes", "KV bytes stored", registry=r)
        self.stores = Counter("nelssa_node_stores", "store calls", ["outcome"], registry=r)
        self.expired = Counter("nelssa_node_expired_clients", "clients dropped at lease expiry", registry=r)
        self.host_memory = Gauge("nelssa_node_host_memory", "host memory of stored KV (sparse/hostmem.py): bytes "
                                 "used, free (kept mapped), reserved; allocations served from free memory (hits) or "
                                 "new mappings (misses)", ["what"], registry=r)
        for what in ("used_bytes", "free_bytes", "reserved_bytes", "hits", "misses"):
            self.host_memory.labels(what=what).set_function(lambda what=what: hostmem.stats()[what])
        self._children: dict = {}

    def job(self, plane: str, outcome: str, seconds: float) -> None:
        ch = self._children.get((plane, outcome))
        if ch is None:
            ch = self._children[(plane, outcome)] = (self.jobs.labels(plane=plane, outcome=outcome),
                                                     self.job_s.labels(plane=plane))
        ch[0].inc()
        ch[1].observe(seconds)


# ---------------------------------------------------------------- the node

class NodeState:
    def __init__(self, s: NodeSettings):
        self.s = s
        cores = s.device_cores or ((),) * s.devices
        nodes = s.device_nodes or (None,) * s.devices
        self.devices = [Device(i, tuple(cores[i]), s.device_memory, nodes[i]) for i in range(s.devices)]
        self.workers = Devices(self.devices, s.poll_spin_us)
        self.clients: dict[str, Client] = {}
        self.lock = threading.Lock()   # clients map and byte accounting
        self.t0 = time.monotonic()
        self.jobs = self.job_errors = self.ingested = self.expired_clients = self.stores = self.slot_stores = 0
        self.native_done = (0, 0)  # native (jobs, errors) of clients dropped
        self.released: dict[str, tuple[NodeRequest, float]] = {}  # hand-over: handle -> (request, deadline)
        self.metrics = Metrics(self)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="nelssa-lease", daemon=True)
        self._reaper.start()

    # -------- clients and leases
    def register(self, name: str, lease_s: float) -> Client:
        lease = min(max(lease_s or 30.0, self.s.lease_min_s), self.s.lease_max_s)
        c = Client(uuid.uuid4().hex, name[:128], lease)
        with self.lock:
            self.clients[c.id] = c
        log.info("client %s (%s) registered, lease %.1fs", c.id, c.name, lease)
        return c

    def client(self, client_id: str) -> Client:
        with self.lock:
            c = self.clients.get(client_id)
            if c is None:
                raise NodeError(grpc.StatusCode.NOT_FOUND, f"unknown client {client_id!r} (lease expired or node restarted)")
            c.last = time.monotonic()
        return c

    PAUSE_S = 1.0  # a reaper tick this much late: the node did not run (no client could renew meanwhile)

    def _reap(self) -> None:
        tick = min(0.25, self.s.lease_min_s / 2)
        prev = time.monotonic()
        while not self._stop.wait(tick):
            now = time.monotonic()
            paused, prev = now - prev - tick, now
            with self.lock:
                if paused > self.PAUSE_S:  # leases and hand-over deadlines count the node's running time only
                    log.warning("the node did not run for %.1fs: leases extended by that", paused)
                    for c in self.clients.values():
                        c.last += paused
                    for h, (r, t) in list(self.released.items()):
                        self.released[h] = (r, t + paused)
                dead = [c for c in self.clients.values() if now - c.last > c.lease_s]
                unadopted = [h for h, (_, t) in self.released.items() if now > t]
                gone = [self.released.pop(h)[0] for h in unadopted]
            for r in gone:
                log.warning("released request %s: not adopted in time, freed", r.req_id)
                self._drop_request(r)
            for c in dead:
                log.warning("client %s (%s): lease of %.1fs expired, dropping %d requests", c.id, c.name, c.lease_s,
                            len(c.reqs))
                self.drop_client(c.id)
                self.expired_clients += 1
                self.metrics.expired.inc()

    def drop_client(self, client_id: str) -> None:
        with self.lock:
            c = self.clients.pop(client_id, None)
        if c is None:
            return
        c.stop.set()
        with self.lock:
            self._stop_native(c)
            self.native_done = (self.native_done[0] + c.native_counts[0], self.native_done[1] + c.native_counts[1])
            if c.store_slot is not None:
                c.store_slot.unlink()  # a store still reading from it keeps its mapping
                c.store_slot = None
        for rid in list(c.reqs):
            self.free(c, rid)
        if c.shm_thread is not None and c.shm_thread is not threading.current_thread():
            c.shm_thread.join(timeout=5)  # the responder closes and unlinks its channel as it exits

    # -------- accounting
    def reserve(self, need: list[int]) -> None:
        with self.lock:
            for d, n in zip(self.devices, need):
                if d.used + n > d.capacity:
                    raise NodeError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"device {d.index} has {d.capacity - d.used} of {d.capacity} B free, "
                                    f"the store needs {n} B there ({need} B per device)")
            for d, n in zip(self.devices, need):
                d.used += n

    def release(self, held: list[int]) -> None:
        with self.lock:
            for d, n in zip(self.devices, held):
                d.used -= n

    def free(self, c: Client, req_id: str) -> tuple[bool, int]:
        with self.lock:
            r = c.reqs.pop(req_id, None)
        if r is None:
            return False, 0
        with self.lock:  # its plans go first: a job of one that is running keeps its own references
            self._drop_plans(c, req_id)
        return True, self._drop_request(r)

    def _drop_plans(self, c: Client, req_id: str) -> None:
        """(Under the lock.) The client's native plans over ``req_id`` dropped."""
        for p in [p for p, rs in c.plan_reqs.items() if req_id in rs]:
            del c.plan_reqs[p]
            c.plan_table.drop(p)

    def _drop_request(self, r: NodeRequest) -> int:
        """A request no client holds any more: its memory released -> bytes freed."""
        with r.lock:
            held, r.bytes = r.bytes, [0] * len(r.bytes)
            r.shards = []  # a job in flight keeps its own references until it returns
            r.kept = []
        self.release(held)
        return sum(held)

    # -------- hand-over (ReleaseRequest / AdoptRequest in the .proto)
    def release_request(self, c: Client, req_id: str, ttl_s: float, handle: str = "") -> tuple[str, float]:
        """The client's request leaves it without being freed, under an unguessable handle (the node's,
        or the client's own: ``valid_handle``), until a client adopts it or ``ttl_s`` (within the lease
        limits) passes: then it is freed."""
        ttl = min(max(ttl_s or self.s.lease_max_s, self.s.lease_min_s), self.s.lease_max_s)
        if handle and not valid_handle(handle):
            raise WireError("a release handle is 32-128 characters of [0-9A-Za-z_-]")
        handle = handle or secrets.token_hex(16)
        with self.lock:
            if handle in self.released:
                raise NodeError(grpc.StatusCode.ALREADY_EXISTS, "a released request already has this handle")
            r = c.reqs.pop(req_id, None)
            if r is None:
                raise NodeError(grpc.StatusCode.NOT_FOUND, f"request {req_id} is not stored for this client")
            self._drop_plans(c, req_id)
            self.released[handle] = (r, time.monotonic() + ttl)
        return handle, ttl

    def released_handles(self, handles) -> list[str]:
        """Those of ``handles`` under which a released request waits for its adopter (ReleasedRequest)."""
        if len(handles) > MAX_RELEASED_QUERY:
            raise WireError(f"at most {MAX_RELEASED_QUERY} handles per Released call, got {len(handles)}")
        if not all(valid_handle(h) for h in handles):
            raise WireError("a release handle is 32-128 characters of [0-9A-Za-z_-]")
        now = time.monotonic()
        with self.lock:
            return [h for h in handles if h in self.released and self.released[h][1] > now]

    def adopt(self, c: Client, handle: str, req_id: str) -> pb.AdoptReply:
        lim = self.s.limits
        if not req_id or len(req_id) > lim.max_req_id_len:
            raise WireError("request id empty or too long")
        with self.lock:
            if req_id in c.reqs:
                raise NodeError(grpc.StatusCode.ALREADY_EXISTS, f"request {req_id} already exists for this client")
            ent = self.released.pop(handle, None)
            if ent is None:
                raise NodeError(grpc.StatusCode.NOT_FOUND, "no released request under this handle (adopted "
                                                           "already, not adopted in time, or never released)")
            r = ent[0]
            r.client_id, r.req_id = c.id, req_id
            c.reqs[req_id] = r
        with r.lock:
            committed = r.shards[0][0].length if r.shards else 0
            return pb.AdoptReply(num_layers=r.num_layers, kv_heads=r.H, head_dim=r.D, dtype=DTYPE_IDS[r.dtype],
                                 part_tokens=r.part_tokens,
                                 part_clusters=[k for pc in r.part_clusters for k in pc], committed=committed,
                                 bytes=sum(r.bytes))

    def centroids(self, c: Client, req_id: str, step: int):
        """The centroid state of the client's request (every part stored with keep_centroids) as data
        chunks of at most ``step`` bytes, in the order of the .proto (Centroids)."""
        with self.lock:
            r = c.reqs.get(req_id)
        if r is None:
            raise NodeError(grpc.StatusCode.NOT_FOUND, f"request {req_id} is not stored for this client")
        with r.lock:
            kept = list(r.kept)
        if not kept or any(k is None for k in kept):
            raise NodeError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"request {req_id}: not every part was stored with keep_centroids")
        for part in kept:
            for t in (t for layer in part for t in layer):
                yield from _data_chunks(t, step)

    def read_back(self, c: Client, req_id: str, layer: int, part: int, step: int, to_slot: bool = False):
        """One stored part of one layer of the client's request as it was stored (ReadBack in the .proto):
        [kv_heads, tokens, 2, head_dim], each head's rows grouped by cluster in id order, as data chunks of
        at most ``step`` bytes, or (``to_slot``) written at the start of the client's store slot, yielding
        nothing. The devices' shares put back together: head-wise their heads in order; cluster-wise each
        cluster's rows taken from the device that holds it (_split_clusters inverted)."""
        with self.lock:
            r, slot = c.reqs.get(req_id), c.store_slot
        if r is None:
            raise NodeError(grpc.StatusCode.NOT_FOUND, f"request {req_id} is not stored for this client")
        with r.lock:
            if not r.shards:
                raise NodeError(grpc.StatusCode.NOT_FOUND, f"request {req_id} was freed")
            if not 0 <= layer < r.num_layers:
                raise WireError(f"layer {layer} outside [0, {r.num_layers})")
            if not 0 <= part < len(r.part_tokens):
                raise WireError(f"part {part} outside the request's {len(r.part_tokens)} stored parts")
            items = [s.stored_part(part) for s in r.shards[layer]]  # (rows, sizes) per device
            base = sum(pc[layer] for pc in r.part_clusters[:part])  # global id of the part's cluster 0
            n = r.part_tokens[part]
        want = r.H * n * 2 * r.D * ITEMSIZE[r.dtype]
        if to_slot:
            if slot is None or slot.slot < want:
                raise NodeError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"read-back of {want} bytes into the store slot, but the client has "
                                f"{'no slot' if slot is None else f'a slot of {slot.slot} bytes'} (OpenShm store)")
            kv = slot.data[:want].view(r.dtype).view(r.H, n, 2, r.D)
        else:
            kv = torch.empty(r.H, n, 2, r.D, dtype=r.dtype)
        if self.s.partition == "head":
            for (rows, _), (h0, h1) in zip(items, r.head_ranges):
                kv[h0:h1] = rows[:, :n]
        else:
            sizes = sum(sz for _, sz in items)  # [H, C]: a cluster's rows are on one device, zero elsewhere
            _, row_owner = _cluster_owners(sizes, base, len(items))
            for hh in range(r.H):
                for d, (rows, sz) in enumerate(items):
                    m = int(sz[hh].sum())
                    if m:
                        kv[hh][row_owner[hh] == d] = rows[hh, :m]
        if not to_slot:
            yield from _data_chunks(kv, step)

    # -------- ingestion
    def store(self, chunks, context) -> pb.StoreReply:
        first = next(chunks, None)
        if first is None or first.WhichOneof("msg") != "header":
            raise WireError("a store starts with its header")
        h = first.header
        lim = self.s.limits
        c = self.client(h.client_id)
        if not h.req_id or len(h.req_id) > lim.max_req_id_len:
            raise WireError("request id empty or too long")
        L, H, D, n = h.num_layers, h.kv_heads, h.head_dim, h.tokens
        if not (1 <= L <= lim.max_layers and 1 <= H <= lim.max_heads and 1 <= D <= lim.max_head_dim
                and 1 <= n <= lim.max_part_tokens):
            raise WireError(f"store shape out of limits: layers {L}, kv heads {H}, head dim {D}, tokens {n}")
        if len(h.clusters) != L or any(not 1 <= k <= n for k in h.clusters):
            raise WireError(f"store needs 1..tokens clusters for each of its {L} layers")
        dtype = dtype_of(h.dtype)
        es = torch.empty((), dtype=dtype).element_size()
        N = len(self.devices)
        head = self.s.partition == "head"
        ranges = split_heads(H, N) if head else [(0, H)] * N
        with self.lock:
            r = c.reqs.get(h.req_id)
        if h.part == 0:
            if r is not None:
                raise NodeError(grpc.StatusCode.ALREADY_EXISTS, f"request {h.req_id} already stored; append with part > 0")
            r = NodeRequest(c.id, h.req_id, L, H, D, dtype, ranges)
        elif r is None or len(r.part_tokens) != h.part or (r.num_layers, r.H, r.D, r.dtype) != (L, H, D, dtype):
            raise NodeError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"request {h.req_id}: append of part {h.part} does not follow the stored parts or shape")
        row = n * 2 * D * es  # bytes of one head's K/V rows in a layer
        keep = h.keep_centroids
        if head:  # a device holds its heads' K/V, tables (and kept centroid state)
            need = [sum((h1 - h0) * row + table_bytes(h1 - h0, k) + keep * centroid_bytes(h1 - h0, D, es, k)
                        for k in h.clusters) for h0, h1 in ranges]
        else:  # the exact split is known once a layer's sizes arrive: each layer reserves evenly first
            need = [sum(even_share(H, row, k, N) + keep * -(-centroid_bytes(H, D, es, k) // N)
                        for k in h.clusters)] * N
        if h.from_slot:  # the data is in the client's store slot: the stream ends with the header
            with self.lock:
                slot = c.store_slot
            want = store_bytes(H, D, es, n, list(h.clusters), keep)
            if slot is None or slot.slot < want:
                raise NodeError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"store of {want} bytes from the store slot, but the client has "
                                f"{'no slot' if slot is None else f'a slot of {slot.slot} bytes'} (OpenShm store)")
            if next(chunks, None) is not None:
                raise WireError("a store from the slot carries no data chunks")
            reader = _SlotReader(slot.data[:want], threads=len(self.s.ingest_cores) or 2)
        else:
            reader = _ByteReader(chunks, context)
        self.reserve(need)
        reserved = list(need)
        base = [sum(pc[li] for pc in r.part_clusters) for li in range(L)]  # global id of this part's cluster 0
        try:
            built, kept = self._receive(reader, h, dtype, es, ranges, reserved, base)
            with r.lock, self.lock:
                if (h.part == 0 and h.req_id in c.reqs) or c.id not in self.clients or \
                        (h.part > 0 and (c.reqs.get(h.req_id) is not r or len(r.part_tokens) != h.part)):
                    raise NodeError(grpc.StatusCode.ABORTED, f"request {h.req_id} changed while its store ran")
                for li, row_parts in enumerate(built):
                    for d, item in enumerate(row_parts):
                        r.shards[li][d].pending.append(item)
                r.part_tokens.append(n)
                r.part_clusters.append(list(h.clusters))
                r.kept.append(kept)
                for d in range(N):
                    r.bytes[d] += reserved[d]
                c.reqs[h.req_id] = r
                stored, reserved = sum(reserved), None
        finally:
            if reserved is not None:
                self.release(reserved)
        self.ingested += stored
        self.stores += 1
        self.slot_stores += bool(h.from_slot)
        self.metrics.ingested.inc(stored)
        return pb.StoreReply(bytes=sum(r.bytes), parts=len(r.part_tokens))

    def _receive(self, it, h, dtype, es, ranges, reserved, base) -> tuple[list[list[tuple]], list[tuple] | None]:
        """Read each layer's sizes and K/V from ``it`` (the stream's chunks or the store slot) into
        per-device tensors -> ([layer][device] (tokens, kv, starts, sizes) ready to be appended as
        prepared parts, the kept centroid state: [layer] (sizes, centroids, vmeans) or None)."""
        L, H, D, n = h.num_layers, h.kv_heads, h.head_dim, h.tokens
        N = len(self.devices)
        head = self.s.partition == "head"
        row = n * 2 * D * es
        built, kept = [], []
        for li in range(L):
            C = h.clusters[li]
            sizes = torch.frombuffer(bytearray(it.take(H * C * 4)), dtype=torch.int32).view(H, C)
            if (sizes < 0).any() or (sizes.sum(1, dtype=torch.int64) != n).any():
                raise WireError(f"layer {li}: cluster sizes must be >= 0 and sum to {n} per head")
            starts = torch.cumsum(sizes, 1, dtype=torch.int64) - sizes
            if head:
                row_parts = []
                for dev, (h0, h1) in zip(self.devices, ranges):
                    kv = host_empty_on((h1 - h0, n, 2, D), dtype, dev.numa_node)  # its node's memory (numa.py)
                    if h1 > h0:
                        it.into(kv.view(-1).view(torch.uint8))
                    row_parts.append((n, kv, starts[h0:h1].contiguous(), sizes[h0:h1].contiguous()))
            else:
                full = torch.empty(H, n, 2, D, dtype=dtype)
                it.into(full.view(-1).view(torch.uint8))
                row_parts = self._split_clusters(full, sizes, starts, base[li], reserved)
            built.append(row_parts)
            if h.keep_centroids:
                cv = torch.empty(2, H, C, D, dtype=dtype)
                it.into(cv.view(-1).view(torch.uint8))
                kept.append((sizes, cv[0], cv[1]))
        it.end()
        return built, (kept if h.keep_centroids else None)

    def _split_clusters(self, full: torch.Tensor, sizes: torch.Tensor, starts: torch.Tensor, base: int,
                        reserved: list[int]) -> list[tuple]:
        """Cluster-wise: cluster c (ids of this part, offset by ``base``) lives on device (base + c) % N."""
        H, n, _, D = full.shape
        N = len(self.devices)
        C = sizes.shape[1]
        owner, row_owner = _cluster_owners(sizes, base, N)
        out = []
        for d in range(N):
            mine = (owner == d).unsqueeze(0).expand(H, C)
            sz = torch.where(mine, sizes, torch.zeros_like(sizes))
            rows_h = sz.sum(1, dtype=torch.int64)
            kv = host_empty_on((H, max(1, int(rows_h.max())), 2, D), full.dtype, self.devices[d].numa_node)
            for hh in range(H):  # rows of this device's clusters, in cluster order (a stable boolean gather)
                if rows_h[hh]:
                    kv[hh, :int(rows_h[hh])] = full[hh][row_owner[hh] == d]
            new_start = torch.cumsum(sz, 1, dtype=torch.int64) - sz
            out.append((n, kv, torch.where(mine, new_start, torch.zeros_like(new_start)).contiguous(), sz.contiguous()))
        # settle the reservation to the exact bytes of this layer (it was estimated evenly)
        exact = [int(o[1].nbytes) + table_bytes(H, C) for o in out]
        est = even_share(H, n * 2 * D * full.element_size(), C, N)
        delta = [e - est for e in exact]
        grow = [max(0, x) for x in delta]
        if any(grow):
            self.reserve(grow)
        self.release([max(0, -x) for x in delta])
        for d in range(N):
            reserved[d] += delta[d]
        return out

    # -------- decode jobs
    def run_job(self, job: pb.AttendJob, plane: str, client: Client | None = None) -> pb.AttendResult:
        t = time.perf_counter()
        try:
            c = self.client(job.client_id)
            if client is not None and c is not client:
                raise NodeError(grpc.StatusCode.PERMISSION_DENIED, "job for another client on this channel")
            with self.lock:
                reqs_map = dict(c.reqs)
            reqs: list[NodeRequest] = []

            def heads_of(rid: str, length: int):
                r = reqs_map.get(rid)
                if r is None:
                    raise NodeError(grpc.StatusCode.NOT_FOUND, f"request {rid!r} holds no KV on this node")
                k = r.visible(job.layer, length)
                reqs.append(r)
                return r.H, r.D, k

            dj = decode_job(job, self.s.limits, heads_of)
            if len({(r.H, r.dtype) for r in reqs}) != 1:
                raise WireError("all requests of a job must share KV heads and dtype")
            timing: list[float] = []
            out, lse = self._dispatch(dj, reqs, job.layer, float(job.scale), timing)
            res = pb.AttendResult(job_id=job.job_id, code=0, out=tensor_bytes(out), lse=tensor_bytes(lse),
                                  compute_s=max(timing, default=0.0))
            outcome = "ok"
        except NodeError as e:
            res, outcome = pb.AttendResult(job_id=job.job_id, code=e.code.value[0], message=str(e)), "error"
        except (WireError, ValueError) as e:
            res, outcome = pb.AttendResult(job_id=job.job_id, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                           message=str(e)), "error"
        except Exception as e:  # noqa: BLE001 - reported to the client, which fails its requests
            log.exception("job %d failed", job.job_id)
            res, outcome = pb.AttendResult(job_id=job.job_id, code=grpc.StatusCode.INTERNAL.value[0],
                                           message=f"{type(e).__name__}: {e}"), "error"
        dt = time.perf_counter() - t
        res.node_s = dt
        self.jobs += 1
        if outcome != "ok":
            self.job_errors += 1
        self.metrics.job(plane, outcome, dt)
        return res

    def _dispatch(self, dj, reqs: list[NodeRequest], layer: int, scale: float,
                  timing: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
        q = dj.q
        B, Hq, D = q.shape
        H = reqs[0].H
        G = Hq // H
        shards = [r.shards[layer] for r in reqs]
        if any(not s for s in shards):
            raise NodeError(grpc.StatusCode.NOT_FOUND, "a request of the job was freed")
        n = len(self.devices)
        if n == 1 or self.s.partition == "head":  # each device its heads; outputs concatenated
            work, ranges = [], []
            for d in range(n):
                h0, h1 = reqs[0].head_ranges[d]
                ranges.append((h0, h1))
                if h1 == h0:
                    work.append(None)
                    continue
                if n == 1:
                    work.append((q, [s[0] for s in shards], Selection(dj.ids, dj.counts), scale))
                    continue
                sel = Selection([i[h0:h1].contiguous() for i in dj.ids], [c[h0:h1].contiguous() for c in dj.counts])
                work.append((q[:, h0 * G:h1 * G].contiguous(), [s[d] for s in shards], sel, scale))
            res = self.workers.run(work)
            timing += [r[2] for r in res if r is not None]
            if n == 1:
                return res[0][0], res[0][1]
            out, lse = torch.empty(B, Hq, D), torch.empty(B, Hq)
            for (h0, h1), r in zip(ranges, res):
                if r is not None:
                    out[:, h0 * G:h1 * G] = r[0]
                    lse[:, h0 * G:h1 * G] = r[1]
            return out, lse
        # cluster-wise: every device attends the selection over its own clusters; merged by LSE
        sel = Selection(dj.ids, dj.counts)
        q = q.contiguous()
        res = self.workers.run([(q, [s[d] for s in shards], sel, scale) for d in range(n)])
        timing += [r[2] for r in res]
        out, lse = res[0][0], res[0][1]
        for r in res[1:]:
            out, lse = merge_states(out, lse, r[0], r[1])
        return out, lse

    # -------- shared memory
    def open_shm(self, c: Client, slot: int) -> ShmChannel:
        """A new shared-memory channel for the client; one it had before (a client that gave up on it
        after a timeout) is retired: its responder stops, closes and unlinks it."""
        slot = min(max(slot, 1 << 16), self.s.limits.max_message_bytes)
        ch, stop = ShmChannel.create(slot, self.s.shm_dir), threading.Event()
        with self.lock:
            if c.shm_stop is not None:
                c.shm_stop.set()
            c.shm, c.shm_stop = ch, stop
            # the jobs it answers are those after the channel's sequence now: read here, not in the thread, so
            # a first job posted before the thread first runs (a busy or just resumed node) is not missed
            first = int(ch.w[W_REQ_SEQ])
            c.shm_thread = threading.Thread(target=self._respond, args=(c, ch, stop, first),
                                            name=f"nelssa-shm-{c.id[:8]}", daemon=True)
        c.shm_thread.start()
        return ch

    def _respond(self, c: Client, ch: ShmChannel, stop: threading.Event, last: int) -> None:
        try:
            self._poll(c, ch, stop, last)
        finally:
            ch.close(unlink=True)  # sets the header's closed flag: a waiting client fails at once

    def _poll(self, c: Client, ch: ShmChannel, stop: threading.Event, last: int) -> None:
        """Polling responder: answers every job after sequence ``last``; busy-polls for poll_spin_us after
        each job (yielding the GIL), then sleeps poll_sleep_us between polls; heartbeats into the header so
        the client sees a dead node."""
        idle = time.perf_counter()
        spin, nap = self.s.poll_spin_us * 1e-6, self.s.poll_sleep_us * 1e-6
        while not (c.stop.is_set() or stop.is_set()):
            ch.beat()
            seq = int(ch.w[W_REQ_SEQ])
            if seq == last:
                time.sleep(0 if time.perf_counter() - idle < spin else nap)
                continue
            last = seq
            try:
                job = pb.AttendJob.FromString(ch.read("req"))
                res = self.run_job(job, "shm", client=c)
            except (DecodeError, WireError) as e:
                res = pb.AttendResult(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=f"bad message: {e}")
                self.metrics.job("shm", "error", 0.0)
            payload = res.SerializeToString()
            if len(payload) > ch.slot:
                payload = pb.AttendResult(job_id=res.job_id, code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                          message=f"result of {len(payload)} B exceeds the slot").SerializeToString()
            ch.write("resp", seq, payload)
            idle = time.perf_counter()

    # -------- native plane (csrc/node_plane.cpp)
    MAX_PLANS = 64  # per client

    def open_store_slot(self, c: Client, size: int) -> StoreSlot:
        """A new store slot of ``size`` bytes for the client (wire.py "store slot"); one it had before is
        unlinked (a store still reading from it keeps its mapping until it ends)."""
        cap = self.s.limits.max_store_slot_bytes
        if not 1 <= size <= cap:
            raise NodeError(grpc.StatusCode.OUT_OF_RANGE if size > cap else grpc.StatusCode.INVALID_ARGUMENT,
                            f"store slot of {size} bytes: 1 .. {cap} (the node's --max-store-slot)")
        try:
            slot = StoreSlot.create(size, self.s.shm_dir)
        except OSError as e:  # the shared-memory file system is full (a container's /dev/shm is often small)
            raise NodeError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"store slot of {size} bytes in {self.s.shm_dir}: {e.strerror or e}") from None
        with self.lock:
            old, c.store_slot = c.store_slot, slot
        if old is not None:
            old.unlink()
        return slot

    def open_native(self, c: Client, slot: int) -> NativeChannel:
        """A new native channel for the client (one it had before is closed: its responder stops); its
        plans stay (the plan table is the client's)."""
        mod, group = ext(), self.workers._group
        if mod is None or group is None:
            raise NodeError(grpc.StatusCode.UNIMPLEMENTED, "this node has no native data plane (C++ extension not built)")
        slot = min(max(slot, 1 << 16), self.s.limits.max_message_bytes)
        ch = NativeChannel.create(slot, self.s.shm_dir)
        with self.lock:
            self._stop_native(c)
            if c.plan_table is None:
                c.plan_table = mod.PlanTable()
            c.native = ch
            # it spins between jobs only where the devices have cores of their own (as their workers do,
            # csrc/device_group.cpp 5): on shared cores a spinning poller delays the kernel it waits for
            spin = self.s.poll_spin_us if self.s.device_cores else 0
            c.responder = mod.ShmResponder(ch.mem, slot, group, c.plan_table, spin, self.s.poll_sleep_us)
        return ch

    def _stop_native(self, c: Client) -> None:
        """(Under the lock.) The client's native responder stopped (its channel marked closed: a waiting
        client fails at once) and the file unlinked."""
        if c.responder is not None:
            c.responder.stop()
            j, e = c.responder.counts()
            c.native_counts = (c.native_counts[0] + j, c.native_counts[1] + e)
            c.responder = None
        if c.native is not None:
            c.native.unlink()
            c.native = None

    def plan(self, c: Client, m: pb.PlanRequest) -> pb.PlanReply:
        """Prepare every layer's calls of a plan (csrc/node_plane.cpp, 1): validated here once, so a job
        of it needs no Python."""
        lim, n = self.s.limits, len(self.devices)
        ch = c.native
        if ch is None or c.responder is None:
            raise NodeError(grpc.StatusCode.FAILED_PRECONDITION, "open a native channel (OpenShm native) first")
        if n > 1 and self.s.partition != "head":
            raise NodeError(grpc.StatusCode.FAILED_PRECONDITION, "the native plane serves head-wise partitioning only")
        B, Hq, D, S = len(m.req_ids), m.num_heads, m.head_dim, m.selected
        if not 1 <= B <= lim.max_batch or len(m.lengths) != B or len(set(m.req_ids)) != B:
            raise WireError(f"a plan needs 1..{lim.max_batch} distinct requests, each with its length")
        if not 1 <= Hq <= lim.max_heads or not 1 <= D <= lim.max_head_dim or S < 1:
            raise WireError(f"plan of {Hq} heads of dim {D}, {S} ids per head: outside the limits")
        if not math.isfinite(m.scale) or m.scale <= 0:
            raise WireError(f"bad scale {m.scale}")
        qdt = dtype_of(m.q_dtype)
        with self.lock:
            if m.plan_id in c.plan_reqs:
                raise WireError(f"plan {m.plan_id} exists")
            if len(c.plan_reqs) >= self.MAX_PLANS:
                raise NodeError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.MAX_PLANS} plans held: drop some first")
            reqs = [c.reqs.get(rid) for rid in m.req_ids]
        for rid, r in zip(m.req_ids, reqs):
            if r is None:
                raise NodeError(grpc.StatusCode.NOT_FOUND, f"request {rid!r} holds no KV on this node")
        H, L = reqs[0].H, reqs[0].num_layers
        if any(r.H != H or r.D != D or r.dtype != reqs[0].dtype or r.num_layers != L for r in reqs) or Hq % H:
            raise WireError(f"plan: requests must share KV heads, layers, dim {D} and dtype; query heads a multiple")
        for r, length in zip(reqs, m.lengths):
            for layer in range(L):
                r.visible(layer, length)  # commits parts up to it; an error unless it matches exactly
        bounds = [h0 for h0, _ in reqs[0].head_ranges] + [H]
        lay = plan_layout(B, Hq, H, D, S, ITEMSIZE[qdt], bounds)
        if max(lay.request_bytes, lay.response_bytes) > ch.slot:
            raise NodeError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a job of this plan needs "
                            f"{max(lay.request_bytes, lay.response_bytes)} B, the channel's slot holds {ch.slot}")
        req_t, resp_t = ch.request(), ch.response()

        def view(t: torch.Tensor, off: int, dt: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            return t[off:off + math.prod(shape) * ITEMSIZE[dt]].view(dt).view(shape)

        G = Hq // H
        ids = [view(req_t, o, torch.int64, (H, S)) for o in lay.ids_off]
        counts = [view(req_t, o, torch.int64, (H,)) for o in lay.counts_off]
        layers = []
        for layer in range(L):
            shards = []
            for r in reqs:
                with r.lock:
                    if not r.shards:
                        raise NodeError(grpc.StatusCode.NOT_FOUND, f"request {r.req_id} was freed")
                    shards.append(r.shards[layer])
            row = []
            for d in range(n):
                h0, h1 = bounds[d], bounds[d + 1]
                if h1 == h0:
                    row.append(None)
                    continue
                hq = (h1 - h0) * G
                row.append(prepare_attend(view(req_t, lay.q_off[d], qdt, (B, hq, D)), [s[d] for s in shards],
                                          Selection([i[h0:h1] for i in ids], [k[h0:h1] for k in counts]), m.scale,
                                          view(resp_t, lay.out_off[d], torch.float32, (B, hq, D)),
                                          view(resp_t, lay.lse_off[d], torch.float32, (B, hq))))
            layers.append(row)
        with self.lock:
            if c.native is not ch:
                raise NodeError(grpc.StatusCode.ABORTED, "the native channel was replaced meanwhile")
            if any(rid not in c.reqs for rid in m.req_ids):
                raise NodeError(grpc.StatusCode.NOT_FOUND, "a request of the plan was freed meanwhile")
            c.plan_table.add(m.plan_id, layers)
            c.plan_reqs[m.plan_id] = frozenset(m.req_ids)
        return pb.PlanReply(head_bounds=bounds, request_bytes=lay.request_bytes, response_bytes=lay.response_bytes)

    def drop_plan(self, c: Client, plan_id: int) -> bool:
        with self.lock:
            if c.plan_reqs.pop(plan_id, None) is None:
                return False
            c.plan_table.drop(plan_id)
            return True

    # -------- reports
    def native_jobs(self) -> tuple[int, int]:
        """(jobs, errors) the native responders answered, all clients (dropped ones included)."""
        with self.lock:
            cs = list(self.clients.values())
            j, e = self.native_done
        for c in cs:
            j, e = j + c.native_counts[0], e + c.native_counts[1]
            r = c.responder
            if r is not None:
                a, b = r.counts()
                j, e = j + a, e + b
        return j, e

    def stats(self) -> pb.StatsReply:
        with self.lock:
            clients = list(self.clients.values())
            devs = [d.info() for d in self.devices]
        nj, ne = self.native_jobs()
        return pb.StatsReply(devices=devs, clients=len(clients), requests=sum(len(c.reqs) for c in clients),
                             jobs=self.jobs + nj, job_errors=self.job_errors + ne, ingested_bytes=self.ingested,
                             expired_clients=self.expired_clients, native_jobs=nj, stores=self.stores,
                             slot_stores=self.slot_stores, released=len(self.released))

    def close(self) -> None:
        self._stop.set()
        for cid in list(self.clients):
            self.drop_client(cid)
        with self.lock:
            gone, self.released = [r for r, _ in self.released.values()], {}
        for r in gone:
            self._drop_request(r)
        self.workers.close()


def _cluster_owners(sizes: torch.Tensor, base: int, N: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Cluster-wise partitioning: of a part's clusters (sizes [H, C], ids offset by ``base``) the device each
    lives on, (base + c) % N -> (owner [C], per head the owner of each of its stored rows [n])."""
    owner = (torch.arange(sizes.shape[1]) + base) % N
    return owner, [owner.repeat_interleave(sizes[hh].long()) for hh in range(sizes.shape[0])]


def _data_chunks(t: torch.Tensor, step: int):
    """A contiguous tensor's bytes as DataChunks of at most ``step`` bytes (Centroids, ReadBack)."""
    flat = t.reshape(-1).view(torch.uint8).numpy()
    for o in range(0, flat.size, step):
        yield pb.DataChunk(data=flat[o:o + step].tobytes())


class _StoreReader:
    """A store's data, read in order by _receive: ``into`` fills a flat uint8 tensor, ``end`` checks that
    nothing is left over."""

    def into(self, dst: torch.Tensor) -> None:
        raise NotImplementedError

    def take(self, n: int) -> bytes:
        out = torch.empty(n, dtype=torch.uint8)
        self.into(out)
        return out.numpy().tobytes()


class _ByteReader(_StoreReader):
    """Consumes the data chunks of a store stream in order, never buffering more than one chunk."""

    def __init__(self, chunks, context):
        self.chunks, self.context = chunks, context
        self.buf, self.off = b"", 0

    def _more(self) -> None:
        m = next(self.chunks, None)
        if m is None:
            raise WireError("store stream ended before all its data")
        if m.WhichOneof("msg") != "data":
            raise WireError("a second header in one store")
        self.buf, self.off = m.data, 0

    def into(self, dst: torch.Tensor) -> None:
        """Fill the flat uint8 tensor ``dst`` from the stream (torch's copy releases the GIL, so decode
        jobs are not held up by a large store's copies)."""
        pos, want = 0, dst.numel()
        while pos < want:
            if self.off == len(self.buf):
                self._more()
            k = min(want - pos, len(self.buf) - self.off)
            dst[pos:pos + k].copy_(torch.frombuffer(self.buf, dtype=torch.uint8, count=k, offset=self.off))
            pos += k
            self.off += k

    def end(self) -> None:
        if self.off != len(self.buf) or next(self.chunks, None) is not None:
            raise WireError("store stream carries more data than its header declares")


class _SlotReader(_StoreReader):
    """A store's data from the client's store slot, with _ByteReader's interface: ``src`` is exactly the
    declared bytes (checked against the slot before), read in order; the copies release the GIL and run
    on ``threads`` threads (hostmem.copy; its threads inherit the store handler's cores)."""

    def __init__(self, src: torch.Tensor, threads: int = 1):
        self.src, self.off, self.threads = src, 0, threads

    def into(self, dst: torch.Tensor) -> None:
        k = dst.numel()
        if self.off + k > self.src.numel():
            raise WireError("store slot read past the store's declared bytes")
        hostmem.copy(dst, self.src[self.off:self.off + k], self.threads)
        self.off += k

    def end(self) -> None:
        if self.off != self.src.numel():
            raise WireError("store slot holds more data than the store's header declares")
