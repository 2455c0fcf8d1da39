"""nelssa-node as a real subprocess: results equal the in-process tier, capacity, leases, tokens,
deadlines, malformed messages, a killed node, metrics, reproducible generated code."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from nelssa.config import NelssaConfig, set_config
from nelssa.node import HostError, LocalHostTier
from nelssa.node.client import NodeHostTier
from nelssa.node.fuzz import bad_jobs
from nelssa.node.proto import nelssa_node_pb2 as pb
from nelssa.node.proto import nelssa_node_pb2_grpc as pb_grpc
from nelssa.node.wire import TOKEN_HEADER, ShmChannel, encode_job
from nelssa.sparse import dense_attention, select_clusters

REPO = Path(__file__).resolve().parents[1]
L, H, HQ, D = 2, 4, 8, 32
SCALE = D ** -0.5


class Node:
    """``python -m nelssa.node`` on a free loopback port; stopped (or killed) by the test."""

    def __init__(self, *args: str, env: dict | None = None, port: int = 0):
        e = dict(os.environ, **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "nelssa.node", "--port", str(port), "--log-level", "WARNING",
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e,
                                     start_new_session=True)
        line = self.proc.stdout.readline()
        m = re.search(r"listening on (\S+):(\d+) metrics (\S+)", line)
        if not m:
            self.proc.kill()
            raise RuntimeError(f"node did not start: {line!r} {self.proc.stderr.read()}")
        self.port = int(m.group(2))
        self.metrics_port = None if m.group(3) == "None" else int(m.group(3))
        self.address = f"127.0.0.1:{self.port}"

    def stub(self):
        ch = grpc.insecure_channel(self.address)
        return ch, pb_grpc.NelssaNodeStub(ch)

    def stats(self, token: str = "") -> pb.StatsReply:
        ch, stub = self.stub()
        try:
            return stub.Stats(pb.StatsRequest(), timeout=5, metadata=((TOKEN_HEADER, token),) if token else ())
        finally:
            ch.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def nodes():
    started: dict[str, Node] = {}

    def get(name: str) -> Node:
        if name not in started:
            args = {"head1": ["--devices", "1"], "head3": ["--devices", "3"],
                    "cluster2": ["--devices", "2", "--partition", "cluster"]}[name]
            started[name] = Node(*args, "--device-memory", "64MiB")
        return started[name]

    yield get
    for n in started.values():
        n.stop()


@pytest.fixture(autouse=True, scope="module")
def _no_shm_left_behind():
    """Clients unlink their channel's name once mapped: even killed nodes leave nothing in /dev/shm."""
    def ours():
        return {f for f in os.listdir("/dev/shm") if f.startswith(("nelssa-node-", "nelssa-native-", "nelssa-store-"))}
    before = ours()
    yield
    time.sleep(0.5)
    assert ours() <= before


def _cfg(node: Node, transport: str, **kw) -> NelssaConfig:
    cfg = NelssaConfig(engine="node", node_address=node.address, node_transport=transport, cluster_size=8,
                       segment=128, iters=5, pool_threads=1, host_timeout_s=kw.pop("host_timeout_s", 20.0), **kw)
    set_config(cfg)
    return cfg


def _kv(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(H, n, D, generator=g) for _ in range(L)], [torch.randn(H, n, D, generator=g) for _ in range(L)])


def _attend(tier, rids, layer, q, budget):
    ckvs = [tier.layer_kv(r, layer) for r in rids]
    sel = select_clusters(q, ckvs, budget, SCALE)
    return tier.wait(tier.submit_attend(q, ckvs, sel, SCALE, layer), layer)


@pytest.mark.parametrize("name,transport", [("head1", "native"), ("head1", "shm"), ("head1", "grpc"),
                                            ("head3", "native"), ("head3", "grpc"), ("cluster2", "shm"),
                                            ("cluster2", "native")])
def test_node_equals_local_and_dense(nodes, name, transport):
    node = nodes(name)
    cfg = _cfg(node, transport)
    local, remote = LocalHostTier(cfg, L), NodeHostTier(cfg, L)
    try:
        a1, a2, b = _kv(300, 1), _kv(70, 2), _kv(200, 3)
        for t in (local, remote):
            t.put_layers("a", *a1, commit=False)   # prepared, then made visible (the hand-off's path)
            t.commit("a", 300)
            t.put_layers("a", *a2, commit=False)   # appended, not yet visible
            t.put_layers("b", *b)
        assert remote.committed("a") == 300 and remote.has("b") and not remote.has("c")
        g = torch.Generator().manual_seed(7)
        for length, budgets in ((300, (1.0,)), (370, (1.0, 0.04))):
            if length == 370:
                for t in (local, remote):
                    t.commit("a", 370)
            for layer in range(L):
                q = torch.randn(2, HQ, D, generator=g)
                for budget in budgets:
                    lo, ll = _attend(local, ["a", "b"], layer, q, budget)
                    ro, rl = _attend(remote, ["a", "b"], layer, q, budget)
                    torch.testing.assert_close(ro, lo, atol=2e-6, rtol=1e-5)
                    torch.testing.assert_close(rl, ll, atol=2e-6, rtol=1e-5)
                    if budget == 1.0:  # every token: exact attention
                        ka = torch.cat([a1[0][layer], a2[0][layer]], 1)[:, :length]
                        va = torch.cat([a1[1][layer], a2[1][layer]], 1)[:, :length]
                        do, dl = dense_attention(q[0], ka, va, SCALE)
                        torch.testing.assert_close(ro[0].double(), do, atol=1e-5, rtol=1e-5)
                        torch.testing.assert_close(rl[0].double(), dl, atol=1e-5, rtol=1e-5)
        # read-back (a recall, vllm_plugin/recall.py): every layer's tokens back in token order from the node,
        # across the two parts' edge too, as the in-process tier reads them
        for layer in range(L):
            for lo, hi in ((0, 370), (250, 320), (301, 302)):
                rk, rv = remote.read_back("a", layer, lo, hi)
                torch.testing.assert_close(rk, torch.cat([a1[0][layer], a2[0][layer]], 1)[:, lo:hi], atol=0, rtol=0)
                torch.testing.assert_close(rv, torch.cat([a1[1][layer], a2[1][layer]], 1)[:, lo:hi], atol=0, rtol=0)
                lk, lv = local.read_back("a", layer, lo, hi)
                assert torch.equal(lk, rk) and torch.equal(lv, rv)
        assert torch.equal(remote.read_back("b", 1, 0, 200)[1], b[1][1])
        with pytest.raises(HostError, match="not within"):
            remote.read_back("a", 0, 0, 371)  # past the committed tokens
        # the native plane where it serves (head-wise, or one device), else the protobuf planes; stores
        # through the store slot on the same-host transports
        assert (remote._native is not None) == (transport == "native" and name != "cluster2")
        assert (remote._slot is not None) == (transport != "grpc")
        held = node.stats().devices
        assert sum(d.used_bytes for d in held) == remote.nbytes > 0
        assert remote.free("a") and remote.free("b") and not remote.free("a")
        assert sum(d.used_bytes for d in node.stats().devices) == 0
        with pytest.raises(HostError):
            remote.layer_kv("a", 0)
    finally:
        local.close()
        remote.close()


def test_capacity_refusal_leaves_nothing():
    node = Node("--devices", "2", "--device-memory", "200KiB")
    try:
        cfg = _cfg(node, "grpc")
        t = NodeHostTier(cfg, L)
        with pytest.raises(HostError, match="RESOURCE_EXHAUSTED"):
            t.put_layers("big", *_kv(600, 1))        # ~77 KiB per layer and device: 2 layers x 2 parts too many
        assert not t.has("big") and t.nbytes == 0
        s = node.stats()
        assert s.requests == 0 and all(d.used_bytes == 0 for d in s.devices)
        t.put_layers("small", *_kv(100, 2))          # what fits is still stored
        used = sum(d.used_bytes for d in node.stats().devices)
        assert used == t.nbytes > 0
        with pytest.raises(HostError, match="RESOURCE_EXHAUSTED"):
            t.put_layers("small", *_kv(900, 3))      # a refused append leaves the request as it was
        assert sum(d.used_bytes for d in node.stats().devices) == used
        assert t.committed("small") == 100
        o, _ = _attend(t, ["small"], 1, torch.randn(1, HQ, D), 1.0)
        assert torch.isfinite(o).all()
        t.close()                                    # unregisters: the node drops the client and its KV now
        s = node.stats()
        assert s.clients == 0 and s.requests == 0 and all(d.used_bytes == 0 for d in s.devices)
    finally:
        node.stop()


def test_metrics_and_lease_expiry_frees_the_clients_kv():
    node = Node("--devices", "2", "--device-memory", "64MiB", "--lease-min-s", "0.3", "--metrics-port", "0")
    try:
        cfg = _cfg(node, "shm", node_lease_s=0.6)
        t = NodeHostTier(cfg, L)
        t.put_layers("a", *_kv(200, 1))
        _attend(t, ["a"], 0, torch.randn(1, HQ, D), 1.0)
        text = urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=5).read().decode()
        for name in ('nelssa_node_device_bytes{device="1"}', 'nelssa_node_jobs_total{outcome="ok",plane="shm"}',
                     "nelssa_node_job_seconds_bucket", "nelssa_node_ingested_bytes_total", "nelssa_node_clients 1.0"):
            assert name in text, name
        time.sleep(1.0)                              # the client renews: still held
        assert node.stats().requests == 1
        t._closed.set()                              # a crashed client: no more renewals
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and node.stats().requests:
            time.sleep(0.1)
        s = node.stats()
        assert s.requests == 0 and s.clients == 0 and s.expired_clients == 1
        assert all(d.used_bytes == 0 for d in s.devices)
        with pytest.raises(HostError):               # its channel is closed: fails, does not hang
            _attend(t, ["a"], 0, torch.randn(1, HQ, D), 1.0)
    finally:
        node.stop()


def test_node_host_reserve_serves_stores_from_touched_memory():
    """--host-reserve: the node reserves host memory at start; stores land in it (hits, no new mappings),
    a freed request's memory serves the next one, and the results stay exact."""
    with pytest.raises(RuntimeError, match="memory available"):  # refused at start, not left to the OOM killer
        Node("--devices", "1", "--device-memory", "200TiB", "--host-reserve", "100TiB")
    node = Node("--devices", "1", "--device-memory", "256MiB", "--host-reserve", "32MiB", "--metrics-port", "0")

    def pool() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=5).read().decode()
        return {m.group(1): float(m.group(2)) for m in re.finditer(r'nelssa_node_host_memory\{what="(\w+)"\} (\S+)', text)}
    try:
        deadline = time.monotonic() + 60
        while pool().get("reserved_bytes") != 32 << 20 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool()["reserved_bytes"] == 32 << 20
        t = NodeHostTier(_cfg(node, "native"), L)
        g = torch.Generator().manual_seed(3)
        for rid in ("a", "b"):                       # 2,048 tokens: 2 MiB per layer on the device
            keys, values = _kv(2048, ord(rid))
            t.put_layers(rid, keys, values)
            q = torch.randn(1, HQ, D, generator=g)
            out, lse = _attend(t, [rid], 1, q, 1.0)
            do, dl = dense_attention(q[0], keys[1], values[1], SCALE)
            torch.testing.assert_close(out[0].double(), do, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[0].double(), dl, atol=1e-5, rtol=1e-5)
            p = pool()
            assert p["misses"] == 0 and p["hits"] >= L * (1 + (rid == "b")) and p["used_bytes"] >= L * (2 << 20), p
            assert t.free(rid)
        assert pool()["used_bytes"] == 0 and pool()["free_bytes"] == 32 << 20
        t.close()
    finally:
        node.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="registration with CUDA")
def test_device_stores_go_through_the_store_slot_registered_with_cuda(nodes):
    """Keys on a CUDA device: the client registers its store slot with CUDA once (hostmem.pin), every
    piece of a store (each layer's sizes, packed K/V, centroids) is a DMA into it enqueued on the stream,
    waited for once per store (_fill_slot), the node's results equal dense attention, and a read-back to the
    device comes out of it by DMA; a larger store replaces the slot (the old one unregistered first), and
    close unregisters the last one."""
    from nelssa.sparse import hostmem
    node = nodes("head1")
    t = NodeHostTier(_cfg(node, "native"), L)
    t.SLOT_MIN = 1 << 16  # slots of the stores' size: "c" grows it
    g = torch.Generator().manual_seed(5)
    try:
        sizes = []
        for rid, n in (("a", 300), ("b", 300), ("c", 1000)):
            keys, values = _kv(n, ord(rid))
            t.put_layers(rid, [k.cuda() for k in keys], [v.cuda() for v in values])
            assert t._slot_pinned and t._slot.data.is_pinned() and len(hostmem._pinned) == 1
            sizes.append(t._slot.slot)
            q = torch.randn(1, HQ, D, generator=g)
            out, lse = _attend(t, [rid], 1, q.cuda(), 1.0)
            do, dl = dense_attention(q[0], keys[1], values[1], SCALE)
            torch.testing.assert_close(out[0].double().cpu(), do, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(lse[0].double().cpu(), dl, atol=1e-4, rtol=1e-4)
            rk, rv = t.read_back(rid, 1, 7, n, "cuda")  # a recall's read: out of the registered slot by DMA
            assert rk.is_cuda and torch.equal(rk.cpu(), keys[1][:, 7:]) and torch.equal(rv.cpu(), values[1][:, 7:])
            assert t.free(rid)
        assert sizes[0] == sizes[1] < sizes[2]
    finally:
        t.close()
    assert not hostmem._pinned


def test_token_required_off_loopback_and_checked_on_every_call():
    r = subprocess.run([sys.executable, "-m", "nelssa.node", "--host", "0.0.0.0", "--port", "0"],
                       capture_output=True, text=True, timeout=120, env={k: v for k, v in os.environ.items()
                                                                         if k != "NELSSA_NODE_TOKEN"})
    assert r.returncode != 0 and "requires a token" in r.stderr
    node = Node("--host", "0.0.0.0", env={"NELSSA_NODE_TOKEN": "s3cret"})
    try:
        ch, stub = node.stub()
        for md in ((), ((TOKEN_HEADER, "wrong"),)):
            for call in (lambda: stub.Health(pb.HealthRequest(), timeout=5, metadata=md),
                         lambda: stub.Register(pb.RegisterRequest(lease_s=5), timeout=5, metadata=md),
                         lambda: next(stub.Attend(iter([pb.AttendJob()]), timeout=5, metadata=md))):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Health(pb.HealthRequest(), timeout=5, metadata=((TOKEN_HEADER, "s3cret"),)).serving
        ch.close()
        with pytest.raises(HostError, match="UNAUTHENTICATED"):
            NodeHostTier(_cfg(node, "grpc"), L)
        t = NodeHostTier(_cfg(node, "grpc", node_token="s3cret"), L)
        t.put_layers("a", *_kv(100, 1))
        assert torch.isfinite(_attend(t, ["a"], 0, torch.randn(1, HQ, D), 0.5)[0]).all()
        t.close()
    finally:
        node.stop()


def test_bad_arguments_and_a_port_in_use_are_refused_at_start(nodes):
    """Start-up errors are one line and a non-zero exit: a port in use (gRPC's default SO_REUSEPORT had let
    a second node listen beside the first, the kernel spreading calls over both), a port out of range (gRPC
    wrapped 99999 to 34463), bad device counts (a division by zero)."""
    def run(*args):
        return subprocess.run([sys.executable, "-m", "nelssa.node", *args], capture_output=True, text=True,
                              timeout=120)
    busy = nodes("head1")
    r = run("--port", str(busy.port))
    assert r.returncode == 1 and f"could not bind 127.0.0.1:{busy.port}" in r.stderr, r.stderr
    assert busy.stats().devices  # the first one serves on
    r = run("--port", "99999")
    assert r.returncode == 1 and "ports must be in [0, 65535]" in r.stderr, r.stderr
    for args in (["--devices", "0"], ["--devices", "3", "--device-cores", "0;1"], ["--device-cores", "100000"],
                 ["--ingest-cores", "100000"]):
        r = run("--port", "0", *args)
        assert r.returncode == 2 and "nelssa-node: error: --" in r.stderr, r.stderr


def test_store_slot_refusals_leave_nothing_and_a_node_without_slots_streams(nodes):
    """Stores from the store slot: no slot, a slot smaller than the declared bytes, one over the node's
    limit, data chunks beside it, bad cluster sizes in it - each refused with its status and nothing
    held; a valid one stored; the slot's file is gone once the client is dropped. A node that makes no
    slots (--max-store-slot 0) gets the same results over the gRPC stream."""
    from nelssa.node.wire import StoreSlot, store_bytes
    node = nodes("head1")
    ch, stub = node.stub()

    def refused(code, *chunks):
        with pytest.raises(grpc.RpcError) as e:
            stub.Store(iter(chunks), timeout=10)
        assert e.value.code() == code, e.value.details()
        assert sum(d.used_bytes for d in node.stats().devices) == 0

    n, C = 8, 2
    want = store_bytes(H, D, 4, n, [C])
    cid = stub.Register(pb.RegisterRequest(name="slot-test", lease_s=30), timeout=5).client_id
    hdr = pb.StoreHeader(client_id=cid, req_id="x", part=0, num_layers=1, kv_heads=H, head_dim=D, dtype=pb.FLOAT32,
                         tokens=n, clusters=[C], from_slot=True)
    try:
        refused(grpc.StatusCode.FAILED_PRECONDITION, pb.StoreChunk(header=hdr))  # no slot
        stub.OpenShm(pb.ShmRequest(client_id=cid, slot_bytes=want - 1, store=True), timeout=5)
        refused(grpc.StatusCode.FAILED_PRECONDITION, pb.StoreChunk(header=hdr))  # too small
        with pytest.raises(grpc.RpcError) as e:
            stub.OpenShm(pb.ShmRequest(client_id=cid, slot_bytes=1 << 40, store=True), timeout=5)
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
        rep = stub.OpenShm(pb.ShmRequest(client_id=cid, slot_bytes=want, store=True), timeout=5)
        slot = StoreSlot.attach(rep.path, rep.slot_bytes)
        refused(grpc.StatusCode.INVALID_ARGUMENT, pb.StoreChunk(header=hdr), pb.StoreChunk(data=b"\0" * 64))
        slot.data.zero_()  # cluster sizes summing to 0, not 8
        refused(grpc.StatusCode.INVALID_ARGUMENT, pb.StoreChunk(header=hdr))
        slot.data[:H * C * 4].view(torch.int32).fill_(n // C)
        slot.data[H * C * 4:want].view(torch.float32).normal_()
        assert stub.Store(iter([pb.StoreChunk(header=hdr)]), timeout=10).bytes > 0
        assert os.path.exists(rep.path)
    finally:
        stub.Unregister(pb.RenewRequest(client_id=cid), timeout=5)
        ch.close()
    assert not os.path.exists(rep.path) and sum(d.used_bytes for d in node.stats().devices) == 0

    plain = Node("--devices", "1", "--device-memory", "64MiB", "--max-store-slot", "0")
    try:
        cfg = _cfg(plain, "native")
        local, remote = LocalHostTier(cfg, L), NodeHostTier(cfg, L)
        kv = _kv(300, 5)
        for t in (local, remote):
            t.put_layers("a", *kv)
        assert remote._slot is None and remote._native is not None
        q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(3))
        for layer in range(L):
            for x, y in zip(_attend(remote, ["a"], layer, q, 1.0), _attend(local, ["a"], layer, q, 1.0)):
                torch.testing.assert_close(x, y, atol=2e-6, rtol=1e-5)
        local.close()
        remote.close()
    finally:
        plain.stop()


def test_a_released_request_is_adopted_by_another_client_or_freed_in_time(nodes):
    """Hand-over (a prefill instance's request taken over by a decode instance): P releases a stored
    request (a part committed, one prepared); D adopts it with P's centroid state and decodes from it
    exactly as the in-process tier does; the handle works once; an adoption whose centroid state does not
    match the node's request is refused and leaves nothing; a released request nobody adopts is freed
    after its time."""
    node = nodes("head3")
    cfg = _cfg(node, "native")
    p, d, local = NodeHostTier(cfg, L), NodeHostTier(cfg, L), LocalHostTier(cfg, L)

    def used():
        return sum(dv.used_bytes for dv in node.stats().devices)
    try:
        a1, a2 = _kv(300, 11), _kv(70, 12)
        for t in (p, local):
            t.put_layers("a", *a1)
            t.put_layers("a", *a2, commit=False)
        held = used()
        handle, layers = p.release("a")
        assert not p.has("a") and p.nbytes == 0 and node.stats().released == 1 and used() == held
        d.adopt(handle, "b", layers)
        assert node.stats().released == 0 and d.nbytes == held > 0
        with pytest.raises(HostError, match="NOT_FOUND"):
            d.adopt(handle, "c", layers)  # a handle is taken once
        g = torch.Generator().manual_seed(5)
        for length in (300, 370):
            d.commit("b", length)
            local.commit("a", length)
            for layer in range(L):
                q = torch.randn(1, HQ, D, generator=g)
                for x, y in zip(_attend(d, ["b"], layer, q, 1.0), _attend(local, ["a"], layer, q, 1.0)):
                    torch.testing.assert_close(x, y, atol=2e-6, rtol=1e-5)
        p.put_layers("x", *_kv(100, 13))
        h2, _ = p.release("x")
        with pytest.raises(HostError, match="adopt y"):
            d.adopt(h2, "y", layers)  # another request's centroid state: refused, and freed on the node
        assert not d.has("y") and used() == held
        p.put_layers("z", *_kv(100, 14))
        p.release("z", ttl_s=0.5)
        deadline = time.monotonic() + 10
        while node.stats().released and time.monotonic() < deadline:
            time.sleep(0.1)
        assert node.stats().released == 0 and used() == held  # nobody adopted it: freed
        assert d.free("b") and used() == 0
    finally:
        for t in (p, d, local):
            t.close()


@pytest.mark.parametrize("name,transport", [("head3", "native"), ("cluster2", "grpc")])
def test_a_handed_over_request_carries_its_centroid_state_through_the_node(nodes, name, transport):
    """The P/D hand-over without P's tier at hand: P's tier stores with keep_centroids and releases under
    a handle it chose (so it can name it before the release); D adopts with only the handle and gets
    P's exact centroid state from the node, then attends exactly as the in-process tier does. The
    kept state is counted in the node's bytes; a bad or taken handle is refused; a request stored
    without it cannot be adopted that way (refused, freed on the node)."""
    import secrets
    node = nodes(name)
    cfg = _cfg(node, transport)
    p, plain = NodeHostTier(cfg, L, keep_centroids=True), NodeHostTier(cfg, L)
    d, local = NodeHostTier(cfg, L), LocalHostTier(cfg, L)

    def used():
        return sum(dv.used_bytes for dv in node.stats().devices)
    try:
        a1, a2 = _kv(300, 21), _kv(70, 22)
        base = used()
        for t in (plain, p, local):
            t.put_layers("a", *a1)
            t.put_layers("a", *a2, commit=False)
            if t is plain:
                without = used() - base
        kept = used() - base - 2 * without  # p's bytes beyond plain's
        clusters = [c.num_clusters + sum(x[1].shape[1] for x in c.pending) for c in (p.layer_kv("a", i) for i in range(L))]
        assert kept == sum(2 * H * C * D * 4 for C in clusters) > 0  # centroids + value means, fp32
        assert plain.free("a") and used() == base + without + kept
        held = used()
        handle = secrets.token_hex(20)
        with pytest.raises(HostError, match="INVALID_ARGUMENT"):
            p.release("a", handle="short")
        assert p.has("a")
        h, layers = p.release("a", handle=handle)
        assert h == handle and not p.has("a")
        p.put_layers("x", *_kv(50, 23))
        with pytest.raises(HostError, match="ALREADY_EXISTS"):
            p.release("x", handle=handle)  # taken by a released request: x stays with p
        assert p.has("x") and p.free("x")
        d.adopt(handle, "b")  # no layers: the centroid state comes from the node
        assert d.nbytes == held - base > 0
        for i in range(L):  # as far as the node had made parts visible (none: no job ran), the rest prepared
            mine = d.layer_kv("b", i)
            assert mine.length == 0 and [x[0] for x in mine.pending] == [300, 70]
        g = torch.Generator().manual_seed(7)
        for length in (300, 370):
            d.commit("b", length)
            local.commit("a", length)
            for layer in range(L):
                q = torch.randn(1, HQ, D, generator=g)
                for budget in (0.25, 1.0):
                    for x, y in zip(_attend(d, ["b"], layer, q, budget), _attend(local, ["a"], layer, q, budget)):
                        torch.testing.assert_close(x, y, atol=2e-6, rtol=1e-5)
        for i in range(L):  # P's exact centroid state
            mine, theirs = d.layer_kv("b", i), layers[i]
            theirs.commit_until(370)
            for x, y in ((mine.centroids, theirs.centroids), (mine.sizes, theirs.sizes), (mine.vmeans, theirs.vmeans)):
                assert torch.equal(x, y)
        plain.put_layers("y", *_kv(60, 24))
        h2, _ = plain.release("y")
        with pytest.raises(HostError, match="adopt c.*keep_centroids"):
            d.adopt(h2, "c")  # stored without the centroid state: refused, and freed on the node
        assert not d.has("c") and used() == held
        assert d.free("b") and used() == base
    finally:
        for t in (p, plain, d, local):
            t.close()


def test_every_call_needs_a_deadline(nodes):
    ch, stub = nodes("head1").stub()
    with pytest.raises(grpc.RpcError) as e:
        stub.Health(pb.HealthRequest())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "deadline" in e.value.details()
    ch.close()


def test_malformed_jobs_get_errors_and_the_node_keeps_serving(nodes):
    node = nodes("head3")
    for transport in ("grpc", "shm"):
        t = NodeHostTier(_cfg(node, transport), L)
        t.put_layers("a", *_kv(150, 1))
        q = torch.randn(1, HQ, D)
        ckvs = [t.layer_kv("a", 0)]
        sel = select_clusters(q, ckvs, 0.5, SCALE)
        good = encode_job(1, t.client_id, 0, SCALE, q, ["a"], [150], list(sel.ids), list(sel.counts))
        want = _attend(t, ["a"], 0, q, 0.5)
        for j in bad_jobs(good, 240, seed=len(transport), num_layers=L):
            res = t._plane.run(j, 10)
            assert res.code != 0, j
        if transport == "shm":  # garbage that is not a protobuf at all, and an over-long declared length
            ch: ShmChannel = t._plane.ch
            for payload in (b"\xff" * 100, os.urandom(3000)):
                t._plane.seq += 1
                ch.write("req", t._plane.seq, payload)
                while int(ch.w[16]) != t._plane.seq:
                    time.sleep(1e-4)
                assert pb.AttendResult.FromString(ch.read("resp")).code != 0
            ch.w[9] = ch.slot + 1  # declared length beyond the slot
            t._plane.seq += 1
            ch.w[8] = t._plane.seq
            while int(ch.w[16]) != t._plane.seq:
                time.sleep(1e-4)
            assert pb.AttendResult.FromString(ch.read("resp")).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        got = _attend(t, ["a"], 0, q, 0.5)
        torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
        t.close()
    s = node.stats()
    assert s.job_errors >= 480 and s.requests == 0


def _wait_stopped(pgid: int, timeout: float = 5.0) -> None:
    """Until every thread of every process in the group is stopped: SIGSTOP is delivered asynchronously."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getpgid(int(pid)) != pgid:
                    continue
                for tid in os.listdir(f"/proc/{pid}/task"):
                    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                    states.append(stat.rsplit(")", 1)[1].split()[0])
            except (OSError, ProcessLookupError):
                continue
        if states and all(st in "Tt" for st in states):
            return
        assert time.monotonic() < deadline, f"node group {pgid} not stopped: {states}"
        time.sleep(0.01)


def test_killed_node_fails_calls_within_the_deadline_and_a_restarted_node_serves():
    node = Node("--devices", "2")
    tiers = {tr: NodeHostTier(_cfg(node, tr, host_timeout_s=8.0, node_lease_s=4.0), L)
             for tr in ("native", "shm", "grpc")}
    assert tiers["native"]._native is not None
    q = torch.randn(1, HQ, D)
    try:
        for t in tiers.values():
            t.put_layers("a", *_kv(200, 1))
            assert torch.isfinite(_attend(t, ["a"], 0, q, 1.0)[0]).all()
        os.killpg(node.proc.pid, signal.SIGSTOP)     # a node that stalls: shared-memory clients see no heartbeat
        stopped = time.monotonic()
        _wait_stopped(node.proc.pid)                 # (a responder not yet stopped could still answer the job)
        for tr in ("native", "shm"):
            t0 = time.monotonic()
            with pytest.raises(HostError, match="heartbeat"):
                _attend(tiers[tr], ["a"], 1, q, 1.0)
            assert time.monotonic() - t0 < 8.0
        time.sleep(max(0.0, stopped + 4.0 + 1.5 - time.monotonic()))  # stopped longer than the 4 s lease: the
        os.killpg(node.proc.pid, signal.SIGCONT)     # node's own pause does not expire it; the next job gets a
        #                                              fresh channel (alive before its responder first runs), served
        for tr in ("native", "shm"):
            assert torch.isfinite(_attend(tiers[tr], ["a"], 1, q, 1.0)[0]).all()
        node.kill()
        for t in tiers.values():
            t0 = time.monotonic()
            with pytest.raises(HostError):
                _attend(t, ["a"], 1, q, 1.0)
            assert time.monotonic() - t0 < 8.0 + 1.0
            with pytest.raises(HostError):
                t.put_layers("b", *_kv(50, 2))
        node = Node("--devices", "2", port=node.port)  # restarted: the clients register again
        for name, t in tiers.items():
            deadline = time.monotonic() + 10
            while True:
                try:
                    t.put_layers("c", *_kv(120, 3))
                    break
                except HostError:
                    assert time.monotonic() < deadline, f"{name} client never got the restarted node back"
                    time.sleep(0.2)
            assert torch.isfinite(_attend(t, ["c"], 1, q, 1.0)[0]).all()
            with pytest.raises(HostError, match="no longer holds"):  # what the old node held is gone
                t.layer_kv("a", 0)
        assert node.stats().requests == len(tiers)
        for t in tiers.values():
            t.close()
    finally:
        node.kill()


def test_native_plane_header_and_layout_agree_with_the_extension():
    """wire.py's native header words are the C++ ones; a plan's layout is aligned, disjoint and in order."""
    from nelssa._ext import ext
    from nelssa.node import wire
    mod = ext()
    if mod is None:
        pytest.skip("no C++ extension")
    words = [wire.N_MAGIC, wire.N_VERSION, wire.N_SLOT, wire.N_REQ_SEQ, wire.N_REQ_PLAN, wire.N_REQ_LAYER,
             wire.N_RESP_SEQ, wire.N_RESP_CODE, wire.N_RESP_MSG, wire.N_RESP_NODE_NS, wire.N_RESP_KERNEL_NS,
             wire.N_BEAT, wire.N_CLOSED, 256, wire.NATIVE_MAGIC, wire.NATIVE_VERSION]
    assert mod.native_header_words() == words
    lay = wire.plan_layout(3, 32, 8, 128, 40, 2, [0, 3, 6, 8])
    spans = sorted([(o, 3 * (b - a) * 4 * 128 * 2) for o, a, b in zip(lay.q_off, lay.bounds, lay.bounds[1:])] +
                   [(o, 8 * 40 * 8) for o in lay.ids_off] + [(o, 64) for o in lay.counts_off])
    assert all(o % 64 == 0 for o, _ in spans) and spans[-1][0] + spans[-1][1] <= lay.request_bytes
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
    with pytest.raises(wire.WireError):
        wire.plan_layout(1, 12, 8, 64, 4, 2, [0, 8])  # query heads not a multiple of KV heads



def test_the_extension_uses_the_shared_libstdcxx():
    """No private libstdc++ inside nelssa._C (setup.py names the shared one): a static copy's iostreams
    crashed formatting an error message on the node's device threads on the H200 host."""
    import shutil

    from nelssa._ext import ext
    if ext() is None or not shutil.which("nm"):
        pytest.skip("no C++ extension or no nm")
    syms = subprocess.run(["nm", "-D", "--defined-only", ext().__file__], capture_output=True, text=True,
                          check=True).stdout
    own = [s for s in ("execute_native_thread_routine", "_ZNSo9_M_insertIlEERSoT_", "_ZNSt6locale7classicEv")
           if s in syms]
    assert not own, f"nelssa._C defines libstdc++'s {own}: rebuild it against the shared libstdc++"


def test_a_native_crash_writes_the_crashing_threads_frames():
    """nelssa-node installs the fatal-signal trace: a segfault on a thread with no Python frame (as the
    responder's) prints the signal, the address and native frames, and the process still dies of it."""
    from nelssa._ext import ext
    if ext() is None:
        pytest.skip("no C++ extension")
    code = ("import ctypes, faulthandler, threading\n"
            "import torch\n"
            "from nelssa._ext import ext\n"
            "faulthandler.enable()\n"
            "assert ext().install_fatal_trace() and not ext().install_fatal_trace()\n"
            "t = threading.Thread(target=lambda: ctypes.memset(0x20, 1, 8))\n"
            "t.start(); t.join()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGSEGV, (p.returncode, p.stderr[-2000:])
    assert "nelssa: fatal signal 11 (SIGSEGV) at address 0x20 in thread" in p.stderr, p.stderr[-2000:]
    frames = p.stderr.split("native frames:\n", 1)[1].split("nelssa: end of native frames", 1)[0].splitlines()
    assert len(frames) >= 3 and any("libc" in f or "python" in f for f in frames), frames
    assert "Fatal Python error: Segmentation fault" in p.stderr  # faulthandler's dump still follows

def test_native_plane_refuses_bad_jobs_and_freed_plans_and_keeps_serving(nodes):
    """Native jobs with layers outside the plan, ids and counts outside the request's clusters, NaN
    queries -> error answers (never a result); the next valid job is bit-identical; a request freed drops
    its plans (a job of one is NOT_FOUND, not a stale answer)."""
    node = nodes("head3")
    t = NodeHostTier(_cfg(node, "native"), L)
    try:
        t.put_layers("a", *_kv(150, 1))
        q = torch.randn(1, HQ, D)
        ckvs = [t.layer_kv("a", 0)]
        sel = select_clusters(q, ckvs, 0.5, SCALE)
        want = _attend(t, ["a"], 0, q, 0.5)
        plane = t._native
        from nelssa.node.client import pad_selection
        from nelssa.sparse import Selection
        padded = pad_selection(sel)
        ids, counts = padded.ids[0], padded.counts[0]
        S = ids.shape[1]
        assert S >= 16 and S & (S - 1) == 0 and S >= sel.ids[0].shape[1]

        def run(q_, ids_, counts_, layer=0):
            out, lse = torch.empty(1, HQ, D), torch.empty(1, HQ)
            c = plane.call(ckvs, q_, Selection([ids_], [counts_]), SCALE, layer, out, lse)
            c.run()
            return c, out, lse

        c, out, _ = run(q, ids, counts)
        assert c.state == "done"
        torch.testing.assert_close(out, want[0], atol=0, rtol=0)
        from nelssa.node.local import HostStats, call_results
        st = HostStats()  # a node call's communication: its round trip outside the node's kernels
        assert call_results(st, [c]) is None and len(st.node_comm_s) == 1
        node_s, kernel_s, wait_s = c.node_times  # and by part: this side's copies, the channel, the node's dispatch
        assert 0 < kernel_s <= node_s <= wait_s <= c.seconds and st.node_comm_s[0] == pytest.approx(c.seconds - kernel_s)
        assert st.node_comm_split_s == pytest.approx({"copy": c.seconds - wait_s, "wire": wait_s - node_s,
                                                      "dispatch": node_s - kernel_s})
        bad = []
        g = torch.Generator().manual_seed(3)
        C = ckvs[0].num_clusters
        # the lane's selections come padded to its id width (a power of two over the budget's tokens: ~8x the
        # ids a head of a 100K request selects at 4%); only each head's first counts[h] ids travel
        # (node_plane.cpp, 2) and what lies beyond them, here ids outside the cluster table, is never read
        wide = torch.full((H, 4 * S), C + 12345, dtype=torch.int64)
        wide[:, :S] = ids
        c, out_w, _ = run(q, wide, counts)
        assert c.state == "done", c.error
        torch.testing.assert_close(out_w, want[0], atol=0, rtol=0)
        for k in range(60):  # ids and counts outside the request's clusters, negative, beyond S
            i2, c2 = ids.clone(), counts.clone()
            h = k % H
            if k % 3 == 0:
                i2[h, 0] = C + int(torch.randint(0, 1000, (1,), generator=g))
                c2[h] = max(1, int(c2[h]))
            elif k % 3 == 1:
                i2[h, 0] = -1 - k
                c2[h] = max(1, int(c2[h]))
            else:
                c2[h] = S + 1 + k if k % 2 else -k
            bad.append((q, i2, c2, 0))
        qn = q.clone()
        qn[0, 1, 2] = float("nan")
        bad += [(qn, ids, counts, 0), (q, ids, counts, L), (q, ids, counts, 1 << 40)]
        for q_, i_, c_, layer in bad:
            c, out, lse = run(q_, i_, c_, layer)
            assert c.state == "failed" and "nelssa-node job" in c.error, (layer, c.error)
            assert out.isnan().all() and lse.isnan().all()  # never a plausible answer
        c, out, _ = run(q, ids, counts)
        torch.testing.assert_close(out, want[0], atol=0, rtol=0)
        assert not plane.chan.broken
        # the waiting job's wake margin (config node_margin_us): polled around the answer's expected time
        # (the recent waits' average), the same answers
        assert plane.chan.margin_us == 0 and plane.chan.expect_us > 0
        plane.chan.margin_us = 200
        for _ in range(3):
            c, out, _ = run(q, ids, counts)
            torch.testing.assert_close(out, want[0], atol=0, rtol=0)
        assert plane.chan.margin_us == 200 and c.state == "done"
        with pytest.raises(RuntimeError, match="margin_us"):
            plane.chan.margin_us = -1
        # a plan of a freed request: dropped on the node with it
        c = plane.call(ckvs, q, Selection([ids], [counts]), SCALE, 0, torch.empty(1, HQ, D), torch.empty(1, HQ))
        t._free_remote("a")  # the node frees it (the client's own free would also forget its plans)
        c.run()
        assert c.state == "failed" and "NOT_FOUND" in c.error and "plan" in c.error
    finally:
        t.close()
    assert node.stats().job_errors >= len(bad) + 1


def test_node_call_served_through_flags_like_a_lane_replay(nodes):
    """The long lane's way with the node (lane_host.py with NodeHostTier.prepare_call): a remote call
    armed on flags (csrc/flag_wait.cpp, the test playing the device), served by the extension's poller
    through the native plane, re-armed as at each graph replay with new queries in the same buffer:
    every answer equals the in-process tier's (to summation order: the node splits heads by device)."""
    import ctypes
    node = nodes("head3")
    cfg = _cfg(node, "native")
    local, t = LocalHostTier(cfg, L), NodeHostTier(cfg, L)
    try:
        for tier in (local, t):
            tier.put_layers("a", *_kv(260, 4))
            tier.put_layers("b", *_kv(90, 5))
        assert t.prepared_calls and local.prepared_calls
        q = torch.empty(2, HQ, D)
        out, lse = torch.empty(2, HQ, D), torch.empty(2, HQ)
        ckvs = [t.layer_kv(r, 1) for r in ("a", "b")]
        call = t.prepare_call(q, ckvs, _sel := _fixed_selection(ckvs), SCALE, 1, out, lse)
        ready, done = (ctypes.c_int32.from_address(a) for a in call.arm_flags_for_test())
        g = torch.Generator().manual_seed(11)
        for i in range(3):
            q.copy_(torch.randn(2, HQ, D, generator=g))
            if i:
                call.rearm()
            ready.value = 1
            t0 = time.monotonic()
            while done.value != 1:
                assert time.monotonic() - t0 < 10, "the poller did not serve the node call"
                time.sleep(0.0005)
            done.value = 0
            assert call.state == "done", call.error
            lo, ll = local.wait(local.submit_attend(q.clone(), [local.layer_kv(r, 1) for r in ("a", "b")], _sel,
                                                    SCALE, 1), 1)
            torch.testing.assert_close(out, lo, atol=2e-6, rtol=1e-5)  # the node splits the work by device
            torch.testing.assert_close(lse, ll, atol=2e-6, rtol=1e-5)
        assert t.call_results([call]) is None
    finally:
        local.close()
        t.close()


def test_node_room_follows_the_node(caplog):
    """NodeRoom (the scheduler's view of the node, vllm_plugin/scheduler.py): capacity = the smallest
    device times the devices; its thread's answers follow a store and a free, each stamped with when it
    was asked (after the store completed: the drop is there); a node that stops answering has no
    room, logged once."""
    import logging

    from nelssa.node.client import NodeRoom
    node = Node("--devices", "2", "--device-memory", "32MiB")
    room = t = None
    try:
        cfg = _cfg(node, "native")
        room = NodeRoom(cfg, max_age_s=0.05)
        assert room.capacity == 2 * (32 << 20)
        free0, _ = room.free()
        assert free0 == room.capacity

        def until(cond, what):
            t0 = time.monotonic()
            while not cond(*room.free()):
                assert time.monotonic() - t0 < 5, what
                time.sleep(0.02)

        t = NodeHostTier(cfg, L)
        t.put_layers("a", *_kv(260, 4))
        stored = time.monotonic()
        until(lambda free, asked: asked > stored, "no answer after the store")
        free, _ = room.free()
        used = [d.used_bytes for d in node.stats().devices]
        assert free == 2 * ((32 << 20) - max(used)) < free0  # the fuller device decides
        t.free("a")
        until(lambda free, asked: free == free0, "the free did not show")
        caplog.set_level(logging.ERROR, logger="nelssa.node.client")
        node.stop()
        until(lambda free, asked: free == 0, "a stopped node still has room")
        time.sleep(0.2)
        assert len([r for r in caplog.records if "no long request is admitted" in r.getMessage()]) == 1
    finally:
        if room is not None:
            room.close()
        if t is not None:
            t.close()
        node.stop()


def test_lane_batch_key_through_the_node(nodes):
    """A captured lane batch (vllm_plugin/lane_batch.py, 1) through the node: its key reads the node
    client's RemoteKV (the H200 run through the node failed every lane batch here: the key read a
    ClusteredKV's host tables). It is stable while nothing changes, changes when a commit extends a
    request (a new node plan), and when a plan its calls may name was dropped — a call of a dropped
    plan fails, so its graph must not be replayed."""
    from nelssa.vllm_plugin.lane_batch import BatchGraphs
    node = nodes("head1")
    cfg = _cfg(node, "native", budget=0.5)
    t = NodeHostTier(cfg, L)
    try:
        t.put_layers("a", *_kv(260, 4))
        t.put_layers("b", *_kv(90, 5))
        bg = BatchGraphs(None, [None] * L, [None] * L, cfg, 16)
        k1 = bg._key(t, ("a", "b"))
        assert bg._key(t, ("a", "b")) == k1 and bg._key(t, ("b", "a")) != k1
        ckvs = [t.layer_kv(r, 0) for r in ("a", "b")]
        old = t.prepare_call(torch.randn(2, HQ, D), ckvs, _fixed_selection(ckvs), SCALE, 0,
                             torch.empty(2, HQ, D), torch.empty(2, HQ))
        t.put_layers("b", *_kv(40, 6))  # a chunk appended and committed: b is longer
        k2 = bg._key(t, ("a", "b"))
        assert k2 != k1 and bg._key(t, ("a", "b")) == k2
        t._native.MAX_PLANS = 1  # the next plan drops the one ``old`` names
        ckvs = [t.layer_kv(r, 0) for r in ("a", "b")]
        t.prepare_call(torch.randn(2, HQ, D), ckvs, _fixed_selection(ckvs), SCALE, 0,
                       torch.empty(2, HQ, D), torch.empty(2, HQ))
        assert bg._key(t, ("a", "b")) != k2
        old.run()
        assert old.state == "failed" and "plan" in old.error
    finally:
        t.close()


def _fixed_selection(ckvs):
    """Every cluster of each request, as int64 [H, S] with a common width S (what a captured lane batch
    holds in its pinned buffers)."""
    from nelssa.sparse import Selection
    S = max(c.num_clusters for c in ckvs)
    ids = [torch.arange(S).clamp(max=c.num_clusters - 1).expand(H, S).contiguous() for c in ckvs]
    return Selection(ids, [torch.full((H,), c.num_clusters, dtype=torch.int64) for c in ckvs])


def test_generated_code_is_reproducible(tmp_path):
    """The committed generated code is what scripts/gen_proto.sh makes of the .proto."""
    r = subprocess.run(["bash", str(REPO / "scripts/gen_proto.sh")], env=dict(os.environ, OUT=str(tmp_path),
                       PYTHON=sys.executable), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for f in ("nelssa_node_pb2.py", "nelssa_node_pb2_grpc.py"):
        assert (tmp_path / "nelssa/node/proto" / f).read_bytes() == (REPO / "nelssa/node/proto" / f).read_bytes(), f


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def _store(stub, cid: str, rid: str, *, tokens=64, clusters=8, layers=L, heads=H, dim=D, sizes=None, data=None,
           extra=b"", part=0):
    t_, h_, c_ = min(max(tokens, 8), 64), min(heads, H), max(clusters, 1)  # real data stays small for bad headers
    sz = torch.full((h_, c_), t_ // c_, dtype=torch.int32) if sizes is None else sizes
    kv = torch.randn(h_ * t_ * 2 * dim).numpy().tobytes() if data is None else data

    def chunks():
        yield pb.StoreChunk(header=pb.StoreHeader(client_id=cid, req_id=rid, part=part, num_layers=layers,
                                                  kv_heads=heads, head_dim=dim, dtype=pb.FLOAT32, tokens=tokens,
                                                  clusters=[clusters] * layers))
        for _ in range(layers):
            yield pb.StoreChunk(data=sz.numpy().tobytes())
            yield pb.StoreChunk(data=kv)
        if extra:
            yield pb.StoreChunk(data=extra)
    return stub.Store(chunks(), timeout=10)


def test_read_back_returns_the_part_as_stored_and_refuses_what_the_caller_does_not_hold(nodes):
    """ReadBack (a recall's read of a migrated request): one layer's stored part comes back byte for byte as
    it was stored, also cluster-wise where the node split its clusters over two devices; an unknown or
    another client's request, a layer or part outside the stored ones, a read into a store slot the client
    has not opened and a freed request are refused. (The store slot's path: test_node_equals_local_and_dense.)"""
    node = nodes("cluster2")
    ch, stub = node.stub()
    cid, other = (stub.Register(pb.RegisterRequest(name=n, lease_s=30), timeout=5).client_id for n in ("rb", "rb2"))
    sizes = torch.tensor([[1, 0, 15, 8, 8, 16, 4, 12]] * H, dtype=torch.int32)  # uneven, one empty cluster
    kv = torch.randn(H, 64, 2, D)
    _store(stub, cid, "r", sizes=sizes, data=kv.numpy().tobytes())

    def read(client, rid, layer=0, part=0) -> torch.Tensor:
        data = b"".join(m.data for m in stub.ReadBack(pb.ReadBackRequest(client_id=client, req_id=rid, layer=layer,
                                                                         part=part), timeout=10))
        return torch.frombuffer(bytearray(data), dtype=torch.float32).view(H, 64, 2, D)

    for layer in range(L):
        assert torch.equal(read(cid, "r", layer), kv)
    for client, rid, layer, part, code in ((cid, "nope", 0, 0, grpc.StatusCode.NOT_FOUND),
                                           (other, "r", 0, 0, grpc.StatusCode.NOT_FOUND),
                                           (cid, "r", L, 0, grpc.StatusCode.INVALID_ARGUMENT),
                                           (cid, "r", 0, 1, grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as e:
            read(client, rid, layer, part)
        assert e.value.code() == code, (client == other, rid, layer, part)
    with pytest.raises(grpc.RpcError) as e:  # into a store slot the client never opened
        list(stub.ReadBack(pb.ReadBackRequest(client_id=cid, req_id="r", to_slot=True), timeout=10))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    stub.Free(pb.FreeRequest(client_id=cid, req_id="r"), timeout=5)
    with pytest.raises(grpc.RpcError) as e:
        read(cid, "r")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    ch.close()


def test_malformed_stores_leave_nothing_and_store_free_cycles_keep_rss_flat(nodes):
    node = nodes("head3")
    ch, stub = node.stub()
    cid = stub.Register(pb.RegisterRequest(name="raw", lease_s=30), timeout=5).client_id
    base = sum(d.used_bytes for d in node.stats().devices)
    bad = [dict(sizes=torch.full((H, 8), 9, dtype=torch.int32)),           # sizes do not sum to the tokens
           dict(sizes=torch.tensor([[-8] + [16] * 4 + [8] * 3] * H, dtype=torch.int32)),  # negative size
           dict(data=b"\0" * 100),                                          # K/V shorter than declared
           dict(extra=b"x"),                                                # more data than declared
           dict(tokens=0), dict(tokens=1 << 40), dict(clusters=0), dict(layers=0), dict(heads=1 << 20),
           dict(part=3)]                                                    # an append that follows nothing
    for kw in bad:
        with pytest.raises(grpc.RpcError) as e:
            _store(stub, cid, "bad", **kw)
        assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), kw
    s = node.stats()
    assert sum(d.used_bytes for d in s.devices) == base
    for i in range(50):                                                     # warm-up
        _store(stub, cid, "c")
        stub.Free(pb.FreeRequest(client_id=cid, req_id="c"), timeout=5)
    before = _rss(node.proc.pid)
    for i in range(1000):  # issue 10: 1,000 store/free cycles, RSS within 5%
        _store(stub, cid, "c")
        assert stub.Free(pb.FreeRequest(client_id=cid, req_id="c"), timeout=5).existed
    after = _rss(node.proc.pid)
    assert abs(after - before) <= 0.05 * before, (before, after)
    assert sum(d.used_bytes for d in node.stats().devices) == base
    stub.Unregister(pb.RenewRequest(client_id=cid), timeout=5)
    ch.close()


def test_property_arbitrary_jobs_are_refused_in_process():
    """Hypothesis: a node (in this process) given decode jobs with arbitrary fields and bytes answers
    each with an error status (a valid job is vanishingly unlikely) and keeps its state."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from nelssa.node.server import NodeSettings
    from nelssa.node.state import NodeState
    node = NodeState(NodeSettings(devices=2))
    cid = node.register("prop", 60).id
    sizes = torch.full((H, 8), 8, dtype=torch.int32).numpy().tobytes()
    kv = torch.randn(H * 64 * 2 * D).numpy().tobytes()
    node.store(iter([pb.StoreChunk(header=pb.StoreHeader(client_id=cid, req_id="a", num_layers=L, kv_heads=H,
                                                         head_dim=D, dtype=pb.FLOAT32, tokens=64, clusters=[8] * L))]
                    + [pb.StoreChunk(data=b) for _ in range(L) for b in (sizes, kv)]), None)
    held = node.stats().devices
    ch_bytes = st.binary(max_size=512)
    req = st.builds(pb.JobRequest, req_id=st.sampled_from(["a", "b", ""]) | st.text(max_size=20),
                    length=st.sampled_from([64, 0]) | st.integers(0, 1 << 40),
                    selected=st.integers(0, 1 << 20), ids=ch_bytes, counts=ch_bytes)
    job = st.builds(pb.AttendJob, job_id=st.integers(0, 1 << 63), client_id=st.sampled_from([cid, "", "x"]),
                    layer=st.integers(0, 3) | st.integers(0, 1 << 31), scale=st.floats(allow_nan=True, width=32),
                    num_heads=st.sampled_from([HQ, H]) | st.integers(0, 1 << 20),
                    head_dim=st.sampled_from([D]) | st.integers(0, 1 << 16),
                    q_dtype=st.integers(0, 5), q=ch_bytes, reqs=st.lists(req, max_size=4))

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(job)
    def check(j):
        res = node.run_job(j, "prop")
        assert res.code != 0 and not res.out

    try:
        check()
        s = node.stats()
        assert s.clients == 1 and s.requests == 1 and s.job_errors >= 300 and s.devices == held
    finally:
        node.close()


def test_job_ids_travel_as_wide_as_the_largest_count():
    """wire.encode_job (the shm and gRPC planes): a request's ids are cut to its largest count, the rest of
    the padded width never travels; a count beyond the width keeps it whole, for the node to refuse."""
    from nelssa.node.wire import encode_job
    q = torch.randn(1, 4, 8)
    ids = torch.full((2, 64), 999, dtype=torch.int64)
    ids[0, :5], ids[1, :3] = torch.arange(5), torch.arange(3)
    job = encode_job(1, "c", 0, 0.1, q, ["a"], [100], [ids], [torch.tensor([5, 3])])
    r = job.reqs[0]
    assert r.selected == 5 and len(r.ids) == 2 * 5 * 8
    assert torch.equal(torch.frombuffer(bytearray(r.ids), dtype=torch.int64).view(2, 5), ids[:, :5])
    assert encode_job(1, "c", 0, 0.1, q, ["a"], [100], [ids], [torch.tensor([5, 65])]).reqs[0].selected == 64
    assert encode_job(1, "c", 0, 0.1, q, ["a"], [100], [ids], [torch.tensor([0, 0])]).reqs[0].selected == 0


def test_devices_are_placed_on_numa_nodes(tmp_path):
    """node/numa.py: the topology read from sysfs; with two nodes, devices of --cores-per-device spread over
    them, each device's cores from one node; explicit core lists bound where they sit on one node; with one
    node the devices take consecutive cores as before and bind nothing."""
    from nelssa.node import numa
    for n, cpus in ((0, "0-3,8-11"), (1, "4-7,12-15"), (2, "")):  # node 2: memory only
        (tmp_path / f"node{n}").mkdir()
        (tmp_path / f"node{n}" / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-2\n")
    topo = numa.topology(str(tmp_path))
    assert topo == {0: (0, 1, 2, 3, 8, 9, 10, 11), 1: (4, 5, 6, 7, 12, 13, 14, 15), 2: ()}
    cores, nodes = numa.place(4, 2, list(range(16)), topo)
    assert nodes == (0, 1, 0, 1) and cores == ((0, 1), (4, 5), (2, 3), (6, 7))
    # the affinity decides which CPUs count: node 1 has none here, so one node, no binding
    cores, nodes = numa.place(2, 2, [0, 1, 2, 3], topo)
    assert nodes == (None, None) and cores == ((0, 1), (2, 3))
    assert numa.node_of((4, 5, 12), topo) == 1 and numa.node_of((3, 4), topo) is None
    assert numa.topology(str(tmp_path / "absent")) == {}
    assert numa.place(2, 1, [0, 1], {}) == (((0,), (1,)), (None, None))
    with pytest.raises(ValueError):
        numa.place(0, 1, [0], topo)


def test_stored_kv_is_bound_to_its_devices_numa_node():
    """A device placed on a NUMA node (NodeSettings.device_nodes) gets its stored K/V from that node's memory
    (csrc/host_pool.cpp 6: bound before anything touches it): here node 0, the one this machine has. A node
    the kernel refuses fails the store loudly and leaves nothing."""
    from nelssa.node.server import NodeSettings
    from nelssa.node.state import NodeError, NodeState
    from nelssa.sparse import hostmem
    tokens = 8192  # one device's share of a layer: 2 heads x 8,192 x 2 x 32 x 4 B = 4 MiB, a bound range

    def store(node, cid, rid):
        sizes = torch.full((H, 16), tokens // 16, dtype=torch.int32).numpy().tobytes()
        kv = torch.randn(H * tokens * 2 * D).numpy().tobytes()
        node.store(iter([pb.StoreChunk(header=pb.StoreHeader(client_id=cid, req_id=rid, num_layers=L, kv_heads=H,
                                                             head_dim=D, dtype=pb.FLOAT32, tokens=tokens,
                                                             clusters=[16] * L))]
                        + [pb.StoreChunk(data=b) for _ in range(L) for b in (sizes, kv)]), None)

    node = NodeState(NodeSettings(devices=2, device_nodes=(0, 0)))
    try:
        cid = node.register("numa", 60).id
        used = hostmem.stats()["used_bytes"]
        store(node, cid, "a")
        r = node.clients[cid].reqs["a"]
        kvs = [p.kv for layer in r.shards for shard in layer for p in shard.parts] + \
              [item[1] for layer in r.shards for shard in layer for item in shard.pending]  # not yet committed
        assert len(kvs) == 2 * L and all(hostmem.page_node(kv) == 0 for kv in kvs)
        assert hostmem.stats()["used_bytes"] - used >= sum(kv.nbytes for kv in kvs)  # counted in use
    finally:
        node.close()
    node = NodeState(NodeSettings(devices=2, device_nodes=(0, 1000 - 1)))
    try:
        cid = node.register("numa", 60).id
        with pytest.raises((NodeError, RuntimeError), match="NUMA node 999"):
            store(node, cid, "b")
        assert not node.clients[cid].reqs and all(d.used == 0 for d in node.devices)
    finally:
        node.close()
