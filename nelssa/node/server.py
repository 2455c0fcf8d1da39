"""nelssa-node's service: its settings (``NodeSettings``), the gRPC control plane (proto/nelssa_node.proto)
over the node's state (nelssa.node.state: storage, devices, jobs, ingestion, leases) and ``serve``.

* Every call needs a deadline; a shared-secret token (metadata ``x-nelssa-token``) is checked on every
  call when set and required off loopback (``TokenInterceptor``).
* The port is the node's alone (no SO_REUSEPORT): a second node on it fails to start.
* Errors are gRPC statuses: ``NodeError``'s code, INVALID_ARGUMENT for malformed input (``WireError``)."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from nelssa.config import get_config, set_config
from nelssa.node.proto import nelssa_node_pb2 as pb
from nelssa.node.proto import nelssa_node_pb2_grpc as pb_grpc
from nelssa.node.state import NodeState
from nelssa.node.storage import NodeError
from nelssa.node.wire import TOKEN_HEADER, Limits, WireError
from nelssa.sparse import hostmem

log = logging.getLogger("nelssa.node")


@dataclass(frozen=True)
class NodeSettings:
    host: str = "127.0.0.1"
    port: int = 50151
    devices: int = 1
    device_cores: tuple[tuple[int, ...], ...] = ()   # per device; () = not pinned
    device_nodes: tuple[int | None, ...] = ()        # per device: the NUMA node its stored K/V is bound to
                                                     # (node/numa.py; None or () = the kernel's placement)
    threads_per_device: int = 1                      # OpenMP threads of a device's kernel calls
    device_memory: int = 1 << 30                     # bytes per device
    partition: str = "head"                          # head | cluster
    ingest_cores: tuple[int, ...] = ()               # store handlers pinned here (() = not pinned)
    token: str = ""
    lease_min_s: float = 0.5
    lease_max_s: float = 600.0
    limits: Limits = field(default_factory=Limits)
    poll_spin_us: int = 2000                         # shm responder and device workers: busy-poll this long after a job
    poll_sleep_us: int = 200                         # then sleep between polls
    shm_dir: str = "/dev/shm"
    grpc_workers: int = 16
    metrics_port: int = -1                           # Prometheus /metrics (-1: off, 0: any port)
    host_reserve: int = 0                            # bytes of host memory reserved at start for stored KV (hostmem.py)

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError(f"devices must be >= 1, got {self.devices}")
        if not 0 <= self.port <= 65535 or not -1 <= self.metrics_port <= 65535:  # (gRPC wraps 99999 to 34463)
            raise ValueError(f"ports must be in [0, 65535] (metrics: -1 for off), got {self.port} / {self.metrics_port}")
        if not 0 < self.lease_min_s <= self.lease_max_s:
            raise ValueError(f"leases need 0 < min <= max, got {self.lease_min_s} / {self.lease_max_s} s")
        if self.poll_spin_us < 0 or self.poll_sleep_us < 1 or self.grpc_workers < 1:
            raise ValueError("poll_spin_us >= 0, poll_sleep_us >= 1 and grpc_workers >= 1 required")
        if self.device_cores and len(self.device_cores) != self.devices:
            raise ValueError(f"{len(self.device_cores)} core sets for {self.devices} devices")
        if self.device_nodes and len(self.device_nodes) != self.devices:
            raise ValueError(f"{len(self.device_nodes)} NUMA nodes for {self.devices} devices")
        if self.partition not in ("head", "cluster"):
            raise ValueError(f"partition must be 'head' or 'cluster', got {self.partition!r}")
        if self.threads_per_device < 1 or self.device_memory < 0 or self.host_reserve < 0:
            raise ValueError("threads_per_device >= 1, device_memory >= 0 and host_reserve >= 0 required")
        if not is_loopback(self.host) and not self.token:
            raise ValueError(f"binding {self.host} (not loopback) requires a token (NELSSA_NODE_TOKEN or --token-file)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False



# ---------------------------------------------------------------- gRPC service

def _abort(context, e: Exception):
    code = e.code if isinstance(e, NodeError) else grpc.StatusCode.INVALID_ARGUMENT
    context.abort(code, str(e))


MAX_DEADLINE_S = 30 * 86400.0  # a call without a deadline shows gRPC's infinite future here


def _need_deadline(context) -> None:
    left = context.time_remaining()
    if left is None or left > MAX_DEADLINE_S:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "every call to nelssa-node needs a deadline")


class Servicer(pb_grpc.NelssaNodeServicer):
    def __init__(self, node: NodeState):
        self.node = node

    def _call(self, context, fn):
        _need_deadline(context)
        try:
            return fn()
        except (NodeError, WireError) as e:
            _abort(context, e)

    def Register(self, request, context):
        def f():
            c = self.node.register(request.name, request.lease_s)
            s = self.node.s
            return pb.RegisterReply(client_id=c.id, lease_s=c.lease_s, devices=[d.info() for d in self.node.devices],
                                    partition=pb.HEAD if s.partition == "head" else pb.CLUSTER,
                                    limits=s.limits.to_pb())
        return self._call(context, f)

    def Renew(self, request, context):
        return self._call(context, lambda: pb.RenewReply(lease_s=self.node.client(request.client_id).lease_s))

    def Unregister(self, request, context):
        def f():
            c = self.node.client(request.client_id)
            held = sum(r.bytes[d] for r in list(c.reqs.values()) for d in range(len(r.bytes)))
            n = len(c.reqs)
            self.node.drop_client(c.id)
            log.info("client %s (%s) unregistered, %d requests freed", c.id, c.name, n)
            return pb.FreeReply(existed=True, bytes=held)
        return self._call(context, f)

    def Store(self, request_iterator, context):
        def f():
            cores = self.node.s.ingest_cores
            before = os.sched_getaffinity(0) if cores else None
            if cores:
                os.sched_setaffinity(0, cores)
            try:
                reply = self.node.store(request_iterator, context)
                self.node.metrics.stores.labels(outcome="ok").inc()
                return reply
            except Exception:
                self.node.metrics.stores.labels(outcome="error").inc()
                raise
            finally:
                if before is not None:
                    os.sched_setaffinity(0, before)
        return self._call(context, f)

    def Free(self, request, context):
        def f():
            ok, n = self.node.free(self.node.client(request.client_id), request.req_id)
            return pb.FreeReply(existed=ok, bytes=n)
        return self._call(context, f)

    def Stats(self, request, context):
        return self._call(context, self.node.stats)

    def Health(self, request, context):
        s = self.node.s
        return self._call(context, lambda: pb.HealthReply(
            serving=True, uptime_s=time.monotonic() - self.node.t0, devices=len(self.node.devices),
            partition=pb.HEAD if s.partition == "head" else pb.CLUSTER))

    def Capacity(self, request, context):
        def f():
            st = self.node.stats()
            return pb.CapacityReply(capacity_bytes=sum(d.capacity_bytes for d in st.devices),
                                    used_bytes=sum(d.used_bytes for d in st.devices), devices=st.devices)
        return self._call(context, f)

    def OpenShm(self, request, context):
        def f():
            c = self.node.client(request.client_id)
            if request.store:
                ch = self.node.open_store_slot(c, request.slot_bytes)
            else:
                ch = (self.node.open_native if request.native else self.node.open_shm)(c, request.slot_bytes)
            return pb.ShmReply(path=ch.path, slot_bytes=ch.slot, node_pid=os.getpid())
        return self._call(context, f)

    def Plan(self, request, context):
        return self._call(context, lambda: self.node.plan(self.node.client(request.client_id), request))

    def Release(self, request, context):
        def f():
            handle, ttl = self.node.release_request(self.node.client(request.client_id), request.req_id,
                                                    request.ttl_s, request.handle)
            return pb.ReleaseReply(handle=handle, ttl_s=ttl)
        return self._call(context, f)

    def Adopt(self, request, context):
        return self._call(context, lambda: self.node.adopt(self.node.client(request.client_id), request.handle,
                                                           request.req_id))

    def Released(self, request, context):
        return self._call(context, lambda: pb.ReleasedReply(handles=self.node.released_handles(list(request.handles))))

    def _chunk_bytes(self) -> int:
        """A streamed answer's DataChunk size: the node's message limit less room for the framing."""
        return max(1 << 16, int(self.node.s.limits.max_message_bytes) - (1 << 12))

    def Centroids(self, request, context):
        _need_deadline(context)
        try:
            yield from self.node.centroids(self.node.client(request.client_id), request.req_id, self._chunk_bytes())
        except (NodeError, WireError) as e:
            _abort(context, e)

    def ReadBack(self, request, context):
        _need_deadline(context)
        try:
            yield from self.node.read_back(self.node.client(request.client_id), request.req_id, request.layer,
                                           request.part, self._chunk_bytes(), request.to_slot)
        except (NodeError, WireError) as e:
            _abort(context, e)

    def DropPlan(self, request, context):
        return self._call(context, lambda: pb.FreeReply(
            existed=self.node.drop_plan(self.node.client(request.client_id), request.plan_id)))

    def Attend(self, request_iterator, context):
        _need_deadline(context)
        for job in request_iterator:
            yield self.node.run_job(job, "grpc")


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose ``x-nelssa-token`` metadata is not the node's token."""

    def __init__(self, token: str):
        self.token = token.encode()

    def intercept_service(self, continuation, details):
        got = dict(details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self.token):
            return continuation(details)
        real = continuation(details)
        if real is None:
            return None

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong nelssa-node token")

        if real.request_streaming and real.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if real.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if real.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


@dataclass
class RunningNode:
    server: grpc.Server
    node: NodeState
    port: int
    metrics_port: int | None

    def stop(self, grace: float | None = 1.0) -> None:
        self.server.stop(grace).wait()
        self.node.close()


def serve(s: NodeSettings) -> RunningNode:
    """Start the node (returns once it listens)."""
    cfg = get_config()
    # the kernels' thread teams (csrc/host_team.cpp): threads_per_device each; pinning comes from the device
    # threads' masks; on cores of their own they spin between jobs as the device workers do (state.py)
    spin = s.poll_spin_us if s.device_cores else 0
    set_config(cfg.replace(pool_threads=s.threads_per_device, affinity_cores=(), pool_spin_us=spin))
    hostmem.configure(min(s.host_reserve, s.devices * s.device_memory), threads=min(4, s.threads_per_device * s.devices))
    node = NodeState(s)
    opts = [("grpc.max_receive_message_length", s.limits.max_message_bytes + (1 << 16)),
            ("grpc.max_send_message_length", s.limits.max_message_bytes + (1 << 16)),
            # a second node on a port in use fails to bind (gRPC's default SO_REUSEPORT let both listen:
            # the kernel then spread one client's calls over two nodes)
            ("grpc.so_reuseport", 0)]
    server = grpc.server(futures.ThreadPoolExecutor(s.grpc_workers, thread_name_prefix="nelssa-rpc"),
                         interceptors=[TokenInterceptor(s.token)] if s.token else [], options=opts,
                         maximum_concurrent_rpcs=4 * s.grpc_workers)
    pb_grpc.add_NelssaNodeServicer_to_server(Servicer(node), server)
    host = f"[{s.host}]" if ":" in s.host and not s.host.startswith("[") else s.host
    try:
        port = server.add_insecure_port(f"{host}:{s.port}")
    except RuntimeError:  # grpcio >= 1.60 raises where older ones returned 0
        port = 0
    if port == 0:
        node.close()
        raise OSError(f"could not bind {s.host}:{s.port} (in use, or not an address of this host)")
    server.start()
    mport = None
    if s.metrics_port >= 0:
        from prometheus_client import start_http_server
        httpd, _ = start_http_server(s.metrics_port, addr=s.host, registry=node.metrics.registry)
        mport = httpd.server_port
    log.info("nelssa-node on %s:%d: %d devices (%s partitioning), %d B each", s.host, port, s.devices,
             s.partition, s.device_memory)
    return RunningNode(server, node, port, mport)
