"""What nelssa-node holds (nelssa.node.state keeps it, nelssa.node.server serves it): a request's clustered
K/V per layer and device (``Shard``, ``NodeRequest``), the clients holding requests (``Client``), the
emulated devices and their native workers (``Device``, ``Devices``: csrc/device_group.cpp), and the byte
sizes the accounting charges (``table_bytes``, ``even_share``)."""

from __future__ import annotations

import threading
import time

import grpc
import torch

from nelssa._ext import ext
from nelssa.node.proto import nelssa_node_pb2 as pb
from nelssa.node.wire import NativeChannel, ShmChannel, StoreSlot, WireError
from nelssa.sparse import KVPart, attend, prepare_attend


class NodeError(Exception):
    def __init__(self, code: grpc.StatusCode, msg: str):
        super().__init__(msg)
        self.code = code



def split_heads(H: int, n: int) -> list[tuple[int, int]]:
    """KV heads [0, H) over n devices as contiguous ranges, sizes differing by at most one."""
    out, h = [], 0
    for d in range(n):
        k = H // n + (1 if d < H % n else 0)
        out.append((h, h + k))
        h += k
    return out


# ---------------------------------------------------------------- storage

class Shard:
    """One layer of one request on one device: duck-types what ``nelssa.sparse.attend`` reads of a
    ClusteredKV (parts, cpart, cstart, csize, num_kv_heads, head_dim)."""

    def __init__(self, heads: int, head_dim: int):
        self.num_kv_heads, self.head_dim = heads, head_dim
        self.parts: list[KVPart] = []
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # n, kv, starts, sizes
        self.cpart = torch.empty(0, dtype=torch.int32)
        self.cstart = torch.empty(heads, 0, dtype=torch.int64)
        self.csize = torch.empty(heads, 0, dtype=torch.int32)
        self.length = 0

    def stored_part(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored part ``p`` (committed or prepared) as stored: its rows [heads, rows, 2, head_dim] and cluster
        sizes [heads, C] (ReadBack)."""
        if p < len(self.parts):
            return self.parts[p].kv, self.csize[:, self.cpart == p]
        _, kv, _, sizes = self.pending[p - len(self.parts)]
        return kv, sizes

    def commit_until(self, length: int) -> None:
        while self.pending and self.length + self.pending[0][0] <= length:
            n, kv, starts, sizes = self.pending.pop(0)
            p = len(self.parts)
            self.parts.append(KVPart(kv))
            self.cpart = torch.cat([self.cpart, torch.full((sizes.shape[1],), p, dtype=torch.int32)])
            self.cstart = torch.cat([self.cstart, starts], 1).contiguous()
            self.csize = torch.cat([self.csize, sizes], 1).contiguous()
            self.length += n


def table_bytes(heads: int, clusters: int) -> int:
    return clusters * 4 + heads * clusters * 12  # cpart int32, cstart int64, csize int32


def even_share(H: int, row: int, clusters: int, n: int) -> int:
    """Cluster-wise: a device's first reservation for one layer (K/V split evenly, tables on every device)."""
    return -(-H * row // n) + table_bytes(H, clusters)


class NodeRequest:
    def __init__(self, client_id: str, req_id: str, num_layers: int, H: int, D: int, dtype: torch.dtype,
                 head_ranges: list[tuple[int, int]]):
        self.client_id, self.req_id = client_id, req_id
        self.num_layers, self.H, self.D, self.dtype = num_layers, H, D, dtype
        self.head_ranges = head_ranges
        self.shards = [[Shard(h1 - h0, D) for h0, h1 in head_ranges] for _ in range(num_layers)]
        self.part_tokens: list[int] = []
        self.part_clusters: list[list[int]] = []     # [part][layer]
        self.kept: list[list[tuple] | None] = []     # [part]: per layer (sizes, centroids, vmeans), or None
        self.bytes = [0] * len(head_ranges)          # held per device
        self.lock = threading.Lock()

    def visible(self, layer: int, length: int) -> int:
        """Clusters of ``layer`` over exactly ``length`` tokens (committing prepared parts up to it)."""
        if not 0 <= layer < self.num_layers:
            raise WireError(f"layer {layer} outside [0, {self.num_layers})")
        with self.lock:
            if not self.shards:
                raise NodeError(grpc.StatusCode.NOT_FOUND, f"request {self.req_id} was freed")
            row = self.shards[layer]
            if row[0].length < length:
                for s in row:
                    s.commit_until(length)
            if row[0].length != length:
                raise NodeError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"request {self.req_id}: the job attends {length} tokens, the node holds "
                                f"{row[0].length} visible + {sum(p[0] for p in row[0].pending)} prepared")
            return int(row[0].cpart.numel())


class Client:
    def __init__(self, client_id: str, name: str, lease_s: float):
        self.id, self.name, self.lease_s = client_id, name, lease_s
        self.last = time.monotonic()
        self.reqs: dict[str, NodeRequest] = {}
        self.shm: ShmChannel | None = None
        self.shm_thread: threading.Thread | None = None
        self.shm_stop: threading.Event | None = None
        self.stop = threading.Event()
        # native plane: its channel and responder (one at a time), its plans (C++ table) and their requests
        self.native: NativeChannel | None = None
        self.responder = None
        self.plan_table = None
        self.plan_reqs: dict[int, frozenset[str]] = {}
        self.native_counts = (0, 0)  # (jobs, errors) of responders already stopped
        self.store_slot: StoreSlot | None = None  # same-host stores (wire.py "store slot")


class Device:
    """An emulated PNM device: its cores and byte capacity. Its worker is a native thread of the node's
    ``DeviceGroup`` (csrc/device_group.cpp), pinned to the cores; the OpenMP team a kernel call starts
    from it inherits the mask."""

    def __init__(self, index: int, cores: tuple[int, ...], capacity: int, numa_node: int | None = None):
        self.index, self.cores, self.capacity, self.numa_node = index, cores, capacity, numa_node
        self.used = 0  # held + reserved (guarded by the node's accounting lock)

    def info(self) -> pb.DeviceInfo:
        return pb.DeviceInfo(index=self.index, cores=list(self.cores), capacity_bytes=self.capacity,
                             used_bytes=self.used)


class Devices:
    """The devices' workers: ``run(work)`` computes ``attend`` for each device's share of a job in
    parallel on the native workers (one hand-over in C++, the caller waits without the GIL) and returns
    each share's (out, lse) and kernel seconds. Without the C++ extension (a build without it: the
    kernels' torch reference path) the shares run one after another on the caller's thread."""

    def __init__(self, devices: list[Device], spin_us: int):
        mod = ext()
        # hand-offs spin spin_us before they sleep (csrc/device_group.cpp, 5)
        self._group = mod.DeviceGroup([list(d.cores) for d in devices], spin_us) if mod is not None else None

    def run(self, work: list) -> list:
        """work[i]: (q [B, Hq_i, D], shards, Selection) for device i, or None -> [(out, lse, seconds) or None].
        A kernel's ValueError (bad input: NaN/Inf queries or results) is raised as ValueError, any other
        failure as RuntimeError."""
        if self._group is None:
            res = []
            for w in work:
                if w is None:
                    res.append(None)
                    continue
                t = time.perf_counter()
                out, lse = attend(*w[:3], scale=w[3])
                res.append((out, lse, time.perf_counter() - t))
            return res
        calls, bufs = [], []
        for w in work:
            if w is None:
                calls.append(None), bufs.append(None)
                continue
            q, shards, sel, scale = w
            B, Hq, D = q.shape
            out, lse = torch.empty(B, Hq, D), torch.empty(B, Hq)
            calls.append(prepare_attend(q, shards, sel, scale, out, lse))
            bufs.append((out, lse))
        self._group.run(calls)
        res = []
        for c, b in zip(calls, bufs):
            if c is None:
                res.append(None)
                continue
            if c.state != "done":
                raise (ValueError if c.value_error else RuntimeError)(c.error)
            res.append((*b, c.seconds))
        return res

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
