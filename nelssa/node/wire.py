"""What travels between a client and nelssa-node: dtypes, limits, decode-job encoding and validation,
and the shared-memory channel. No pickle: protobuf messages (nelssa/node/proto) carrying raw
little-endian arrays whose every length, shape and id is checked against limits before anything is
allocated from them.
"""

from __future__ import annotations

import math
import mmap
import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from nelssa.node.proto import nelssa_node_pb2 as pb

# torch.frombuffer over an immutable protobuf bytes field: we only read from those tensors
warnings.filterwarnings("ignore", message="The given buffer is not writable")

DTYPES = {pb.FLOAT32: torch.float32, pb.FLOAT16: torch.float16, pb.BFLOAT16: torch.bfloat16}
DTYPE_IDS = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.int64: 8, torch.int32: 4, torch.uint8: 1}

TOKEN_HEADER = "x-nelssa-token"


class WireError(ValueError):
    """A message that does not follow the protocol (maps to INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 8 << 20   # one gRPC message / one shared-memory slot payload
    max_batch: int = 256               # requests in one decode job
    max_heads: int = 256               # query heads
    max_head_dim: int = 512
    max_layers: int = 512
    max_part_tokens: int = 1 << 22     # tokens in one stored part
    max_req_id_len: int = 256
    max_store_slot_bytes: int = 4 << 30  # a client's store slot (0: stores only stream over gRPC)

    def to_pb(self) -> pb.Limits:
        return pb.Limits(max_message_bytes=self.max_message_bytes, max_batch=self.max_batch,
                         max_heads=self.max_heads, max_head_dim=self.max_head_dim, max_layers=self.max_layers,
                         max_part_tokens=self.max_part_tokens, max_req_id_len=self.max_req_id_len,
                         max_store_slot_bytes=self.max_store_slot_bytes)

    @staticmethod
    def from_pb(m: pb.Limits) -> "Limits":
        return Limits(m.max_message_bytes, m.max_batch, m.max_heads, m.max_head_dim, m.max_layers,
                      m.max_part_tokens, m.max_req_id_len, m.max_store_slot_bytes)


def dtype_of(code: int) -> torch.dtype:
    if code not in DTYPES:
        raise WireError(f"unknown dtype code {code}")
    return DTYPES[code]


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a CPU tensor (any dtype, bf16 included)."""
    t = t.detach().contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def from_bytes(b: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A read-only tensor view of ``b`` (its length is checked against ``shape`` first)."""
    n = 1
    for s in shape:
        n *= s
    want = n * ITEMSIZE[dtype]
    if len(b) != want:
        raise WireError(f"{len(b)} bytes for {dtype} {list(shape)} ({want} expected)")
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(b, dtype=dtype).view(shape)


# ---------------------------------------------------------------- decode jobs

def encode_job(job_id: int, client_id: str, layer: int, scale: float, q: torch.Tensor, req_ids: list[str],
               lengths: list[int], ids: list[torch.Tensor], counts: list[torch.Tensor]) -> pb.AttendJob:
    """q [B, Hq, D] (CPU), per request ids [H, S] int64 / counts [H] int64 (CPU). A request's ids travel
    only as wide as its largest count (the node reads no further): selections come padded to the batch's
    id width, a power of two over the budget's tokens (~8x what a head selects at 4%)."""
    B, Hq, D = q.shape
    if q.dtype not in DTYPE_IDS:
        raise WireError(f"queries dtype {q.dtype} not supported")
    reqs = []
    for r, n, i, c in zip(req_ids, lengths, ids, counts, strict=True):
        i = i.to(torch.int64)
        w = min(i.shape[1], max(0, int(c.max()))) if c.numel() else i.shape[1]  # a bad count keeps the width:
        if w < i.shape[1]:                                                       # the node refuses it
            i = i[:, :w].contiguous()
        reqs.append(pb.JobRequest(req_id=r, length=n, selected=i.shape[1], ids=tensor_bytes(i),
                                  counts=tensor_bytes(c.to(torch.int64))))
    return pb.AttendJob(job_id=job_id, client_id=client_id, layer=layer, scale=scale, num_heads=Hq, head_dim=D,
                        q_dtype=DTYPE_IDS[q.dtype], q=tensor_bytes(q), reqs=reqs)


@dataclass
class DecodedJob:
    q: torch.Tensor                 # [B, Hq, D]
    req_ids: list[str]
    lengths: list[int]
    ids: list[torch.Tensor]         # [H, S] int64 each (H from the node's copy of the request)
    counts: list[torch.Tensor]      # [H] int64


def decode_job(job: pb.AttendJob, limits: Limits, heads_of) -> DecodedJob:
    """Validate a job against limits and the stored requests before making tensors of it.

    ``heads_of(req_id) -> (kv_heads, head_dim, clusters_visible_at(length))``: raises KeyError for an
    unknown request. Every id must be a valid cluster of the tokens the job attends."""
    B, Hq, D = len(job.reqs), job.num_heads, job.head_dim
    if not 1 <= B <= limits.max_batch:
        raise WireError(f"job has {B} requests (1..{limits.max_batch} allowed)")
    if not 1 <= Hq <= limits.max_heads or not 1 <= D <= limits.max_head_dim:
        raise WireError(f"job has {Hq} heads of dim {D} (limits {limits.max_heads}, {limits.max_head_dim})")
    if not math.isfinite(job.scale) or job.scale <= 0:
        raise WireError(f"bad scale {job.scale}")
    q = from_bytes(job.q, dtype_of(job.q_dtype), (B, Hq, D))
    req_ids, lengths, ids, counts = [], [], [], []
    for r in job.reqs:
        if not r.req_id or len(r.req_id) > limits.max_req_id_len:
            raise WireError("request id empty or too long")
        H, Dk, clusters = heads_of(r.req_id, r.length)
        if Dk != D or Hq % H:
            raise WireError(f"request {r.req_id}: {Hq} query heads of dim {D} for {H} KV heads of dim {Dk}")
        # S may exceed the request's clusters (a batch pads to its widest selection); the ids' byte
        # length is checked against H * S, and the message size bounds both
        S = r.selected
        i = from_bytes(r.ids, torch.int64, (H, S))
        c = from_bytes(r.counts, torch.int64, (H,))
        cn = np.frombuffer(r.counts, dtype=np.int64)
        lo, hi = int(cn.min()), int(cn.max())
        if lo < 0 or hi > S:
            raise WireError(f"request {r.req_id}: counts outside [0, {S}]")
        if hi:
            ids_np = np.frombuffer(r.ids, dtype=np.int64).reshape(H, S)
            sel = ids_np[:, :hi] if lo == hi else ids_np[np.arange(S)[None, :] < cn[:, None]]
            if sel.min() < 0 or sel.max() >= clusters:
                raise WireError(f"request {r.req_id}: cluster id outside [0, {clusters})")
        req_ids.append(r.req_id), lengths.append(r.length), ids.append(i), counts.append(c)
    if len(set(req_ids)) != B:
        raise WireError("a request appears twice in one job")
    return DecodedJob(q, req_ids, lengths, ids, counts)


def decode_result(res: pb.AttendResult, B: int, Hq: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = from_bytes(res.out, torch.float32, (B, Hq, D))
    lse = from_bytes(res.lse, torch.float32, (B, Hq))
    return out, lse


# ---------------------------------------------------------------- shared-memory channel
#
# One file in /dev/shm (mode 0600, created by the node) per client: a header of 64-byte lines, then
# a request slot and a response slot of slot_bytes each. Each side writes its payload, then its
# length, then its sequence number (aligned 8-byte stores through numpy; x86-64 keeps stores in
# order, so a reader that sees the new sequence number sees the payload). Payload: one serialized
# AttendJob (client -> node) or AttendResult (node -> client).

SHM_MAGIC = 0x4E454C5353414E31  # "NELSSAN1"
SHM_VERSION = 1
_HDR = 256
# header words (uint64 index): 0 magic, 1 version, 2 slot_bytes, 8 req_seq, 9 req_len, 16 resp_seq,
# 17 resp_len, 24 node heartbeat (time.monotonic_ns of the responder's last poll), 25 closed flag
W_MAGIC, W_VERSION, W_SLOT, W_REQ_SEQ, W_REQ_LEN, W_RESP_SEQ, W_RESP_LEN, W_BEAT, W_CLOSED = 0, 1, 2, 8, 9, 16, 17, 24, 25


class _ChannelFile:
    """A channel's file in /dev/shm (mode 0600): a 256-byte header whose words 0-2 are magic, version and
    slot size, then SLOTS slots (a request and a response slot; a store slot has one). ``create`` on the
    node, ``attach`` on the client; ``unlink`` removes the name (the mappings stay)."""

    PREFIX, MAGIC, VERSION, KIND, SLOTS = "", 0, 0, "", 2
    RESERVE = False  # create: allocate the file's memory now (a write past a full tmpfs would be a SIGBUS)

    def _map(self, path: str, fd: int, slot: int, create: bool) -> mmap.mmap:
        self.path, self.slot = path, slot
        size = _HDR + self.SLOTS * slot
        try:
            if create and self.RESERVE:
                os.posix_fallocate(fd, 0, size)
            elif create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise WireError(f"{path}: {os.fstat(fd).st_size} bytes, {size} expected")
            return mmap.mmap(fd, size)
        except BaseException:
            if create:
                os.unlink(path)
            raise
        finally:
            os.close(fd)

    def _stamp(self, w: np.ndarray, create: bool) -> None:
        """The header's identity written (create) or checked (attach)."""
        if create:
            w[W_MAGIC], w[W_VERSION], w[W_SLOT] = self.MAGIC, self.VERSION, self.slot
            w[W_BEAT] = time.monotonic_ns()  # alive from the start, before the responder first polls
        elif int(w[W_MAGIC]) != self.MAGIC or int(w[W_VERSION]) != self.VERSION or int(w[W_SLOT]) != self.slot:
            raise WireError(f"{self.path}: not a {self.KIND}nelssa-node channel of slot {self.slot}")

    @classmethod
    def create(cls, slot: int, directory: str = "/dev/shm"):
        import tempfile
        fd, path = tempfile.mkstemp(prefix=cls.PREFIX, dir=directory)  # mode 0600
        return cls(path, fd, slot, create=True)

    @classmethod
    def attach(cls, path: str, slot: int):
        return cls(path, os.open(path, os.O_RDWR), slot, create=False)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class ShmChannel(_ChannelFile):
    """Protobuf jobs: each side writes its payload, then its length, then its sequence number."""

    PREFIX, MAGIC, VERSION = "nelssa-node-", SHM_MAGIC, SHM_VERSION

    def __init__(self, path: str, fd: int, slot: int, create: bool):
        self.mm = self._map(path, fd, slot, create)
        self.w = np.frombuffer(self.mm, dtype=np.uint64, count=_HDR // 8)
        self._stamp(self.w, create)
        self.req = memoryview(self.mm)[_HDR:_HDR + slot]
        self.resp = memoryview(self.mm)[_HDR + slot:_HDR + 2 * slot]

    def write(self, which: str, seq: int, payload: bytes) -> None:
        n = len(payload)
        if n > self.slot:
            raise WireError(f"message of {n} bytes exceeds the shared-memory slot ({self.slot})")
        (self.req if which == "req" else self.resp)[:n] = payload
        if which == "req":
            self.w[W_REQ_LEN] = n
            self.w[W_REQ_SEQ] = seq
        else:
            self.w[W_RESP_LEN] = n
            self.w[W_RESP_SEQ] = seq

    def read(self, which: str) -> bytes:
        n = int(self.w[W_REQ_LEN] if which == "req" else self.w[W_RESP_LEN])
        if n > self.slot:
            raise WireError(f"declared length {n} exceeds the slot ({self.slot})")
        return bytes((self.req if which == "req" else self.resp)[:n])

    def beat(self) -> None:
        self.w[W_BEAT] = time.monotonic_ns()

    def close(self, unlink: bool = False) -> None:
        try:
            self.w[W_CLOSED] = 1
        except (ValueError, TypeError):
            pass
        self.req.release(), self.resp.release()
        del self.w
        try:
            self.mm.close()
        except BufferError:
            pass
        if unlink:
            self.unlink()


# ---------------------------------------------------------------- native channel (csrc/node_plane.cpp)
#
# A second kind of channel file: the same header size and a request and a response slot, but its jobs
# are raw arrays at the offsets a plan fixes (plan_layout), served by a native thread of the node. The
# word indices below are the C++ ones (``nelssa._C.native_header_words()``; a test compares).

NATIVE_MAGIC = 0x4E454C5353415031  # "NELSSAP1"
NATIVE_VERSION = 1
(N_MAGIC, N_VERSION, N_SLOT, N_REQ_SEQ, N_REQ_PLAN, N_REQ_LAYER, N_RESP_SEQ, N_RESP_CODE, N_RESP_MSG,
 N_RESP_NODE_NS, N_RESP_KERNEL_NS, N_BEAT, N_CLOSED) = (0, 1, 2, 8, 9, 10, 16, 17, 18, 19, 20, 24, 25)
_ALIGN = 64


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class PlanLayout:
    """Where a plan's job lives in a native channel's slots (byte offsets from each slot's start)."""
    bounds: tuple[int, ...]       # device d attends KV heads [bounds[d], bounds[d+1])
    q_off: tuple[int, ...]        # per device: queries [B, Hq_d, D] (the plan's dtype)
    ids_off: tuple[int, ...]      # per request: ids int64 [H, S]
    counts_off: tuple[int, ...]   # per request: counts int64 [H]
    out_off: tuple[int, ...]      # per device (response slot): out fp32 [B, Hq_d, D]
    lse_off: tuple[int, ...]      # per device (response slot): lse fp32 [B, Hq_d]
    request_bytes: int
    response_bytes: int


def plan_layout(B: int, Hq: int, H: int, D: int, S: int, q_itemsize: int, bounds: list[int]) -> PlanLayout:
    """The one layout of a plan's job, derived by the node (views for its prepared calls) and the client
    (where its RemoteJob writes and reads): nothing about it travels but the plan's parameters."""
    if H < 1 or Hq % H or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != H or list(bounds) != sorted(bounds):
        raise WireError(f"bad plan shape: {Hq} query heads over {H} KV heads, device bounds {bounds}")
    G, off = Hq // H, 0
    q_off = []
    for d in range(len(bounds) - 1):
        q_off.append(off)
        off += _up(B * (bounds[d + 1] - bounds[d]) * G * D * q_itemsize)
    ids_off, counts_off = [], []
    for _ in range(B):
        ids_off.append(off)
        off += _up(H * S * 8)
        counts_off.append(off)
        off += _up(H * 8)
    req, off = off, 0
    out_off, lse_off = [], []
    for d in range(len(bounds) - 1):
        hq = (bounds[d + 1] - bounds[d]) * G
        out_off.append(off)
        off += _up(B * hq * D * 4)
        lse_off.append(off)
        off += _up(B * hq * 4)
    return PlanLayout(tuple(bounds), tuple(q_off), tuple(ids_off), tuple(counts_off), tuple(out_off), tuple(lse_off),
                      req, off)


class NativeChannel(_ChannelFile):
    """Native jobs (csrc/node_plane.cpp). ``mem`` is a uint8 tensor over the whole mapping (the C++ side
    keeps it, and with it the mapping)."""

    PREFIX, MAGIC, VERSION, KIND = "nelssa-native-", NATIVE_MAGIC, NATIVE_VERSION, "native "

    def __init__(self, path: str, fd: int, slot: int, create: bool):
        mm = self._map(path, fd, slot, create)
        self.mem = torch.frombuffer(mm, dtype=torch.uint8)  # the tensor holds the buffer: mm stays mapped
        self.w = self.mem[:_HDR].view(torch.int64).numpy().view(np.uint64)
        self._stamp(self.w, create)

    def request(self) -> torch.Tensor:
        return self.mem[_HDR:_HDR + self.slot]

    def response(self) -> torch.Tensor:
        return self.mem[_HDR + self.slot:_HDR + 2 * self.slot]


# ---------------------------------------------------------------- store slot
#
# Same-host stores: a third kind of file (the same 256-byte header identity, then ONE slot). The node
# makes it for a client (OpenShm with ``store``), the client writes a store's data into it — exactly
# the bytes its gRPC data chunks would carry, in the same order (per layer: cluster sizes int32 [H, C],
# then K/V [H, n, 2, D]) — and sends only the header with ``from_slot``; the node reads the declared
# bytes from its own mapping into its memory and answers. One store at a time per slot (the client's
# lock); a new slot replaces the old one (unlinked; a store still reading from it keeps its mapping).

STORE_MAGIC = 0x4E454C5353415331  # "NELSSAS1"
STORE_VERSION = 1


class StoreSlot(_ChannelFile):
    """``data`` is a uint8 tensor over the slot (the tensor holds the mapping)."""

    PREFIX, MAGIC, VERSION, KIND, SLOTS = "nelssa-store-", STORE_MAGIC, STORE_VERSION, "store-slot ", 1
    RESERVE = True

    def __init__(self, path: str, fd: int, slot: int, create: bool):
        mm = self._map(path, fd, slot, create)
        mem = torch.frombuffer(mm, dtype=torch.uint8)
        self._stamp(mem[:_HDR].view(torch.int64).numpy().view(np.uint64), create)
        self.data = mem[_HDR:]


def store_bytes(H: int, D: int, itemsize: int, tokens: int, clusters: list[int], keep_centroids: bool = False) -> int:
    """A store's data bytes (chunks or slot): per layer its cluster sizes and its K/V rows (and with
    ``keep_centroids`` its centroids and value means)."""
    return sum(H * C * 4 + H * tokens * 2 * D * itemsize + keep_centroids * centroid_bytes(H, D, itemsize, C)
               for C in clusters)


def centroid_bytes(H: int, D: int, itemsize: int, C: int) -> int:
    """A layer's centroids and value means of C clusters ([H, C, D] each)."""
    return 2 * H * C * D * itemsize


MAX_RELEASED_QUERY = 4096  # hand-over handles per Released call (the node refuses more; clients split)
HANDLE_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_-")


def valid_handle(h: str) -> bool:
    """A client-chosen hand-over handle (ReleaseRequest.handle): 32-128 of [0-9A-Za-z_-]."""
    return 32 <= len(h) <= 128 and set(h) <= HANDLE_CHARS
