"""nelssa-node data-plane benchmark: per-layer decode-job round trip over the native plane (a plan, then raw
arrays through shared memory, C++ on both sides), protobuf over shared memory, and gRPC, for
1..N devices, with an empty selection (pure overhead) and a real one; and decode-job latency with
and without a concurrent large store (ingestion isolation, paper 5.1); and a store's rate from a client on
this host, streamed over gRPC vs through the store slot (shared memory).

    python benchmarks/bench_node.py                        # defaults sized for a small CPU box
    python benchmarks/bench_node.py --devices 1,2,4 --tokens 32768 --heads 8 --qheads 32 --dim 128 \\
        --batch 4 --store-tokens 100000 --store-layers 32 --out results/bench_node.json

Each device count gets its own node subprocess (--cores-per-device = cores // devices, at least 1).
Reported per case: p50/p99 of the client's round trip (submit to result), the node's own time per
job (validation, dispatch to the devices, aggregation), the slowest device's kernel time, the
transport + client part (round trip - node time) and the part outside compute (round trip - kernel).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time

import grpc
import torch

from nelssa.config import NelssaConfig, set_config
from nelssa.node.client import NodeHostTier, pad_selection
from nelssa.node.proto import nelssa_node_pb2 as pb
from nelssa.node.proto import nelssa_node_pb2_grpc as pb_grpc
from nelssa.node.wire import encode_job
from nelssa.sparse import Selection, select_clusters


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


_all_cores = os.sched_getaffinity(0)  # the machine's, before --client-cores pins this process


def _start(devices: int, cores: int, memory: str, ingest: int = 0, spin_us: int | None = None,
           skip: int = 0) -> tuple[subprocess.Popen, int]:
    """A node whose devices share ``cores`` - ``ingest`` cores of the machine's affinity after its first
    ``skip`` (the client's, --client-cores); ``ingest`` > 0: the last ones handle stores (--ingest-cores)."""
    avail = sorted(_all_cores)[skip:]
    per = max(1, (cores - ingest) // devices)
    extra = ["--ingest-cores", ",".join(str(c) for c in avail[-ingest:])] if ingest else []
    if spin_us is not None:
        extra += ["--poll-spin-us", str(spin_us)]
    # consecutive cores per device, wrapping where there are fewer than asked (emulation on small boxes)
    dev = ";".join(",".join(str(avail[(d * per + i) % len(avail)]) for i in range(per)) for d in range(devices))
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, avail)  # the node inherits the machine's cores after the client's, not the client's
    try:
        p = subprocess.Popen([sys.executable, "-m", "nelssa.node", "--port", "0", "--devices", str(devices),
                              "--device-cores", dev, "--device-memory", memory, "--log-level", "WARNING", *extra],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    finally:
        os.sched_setaffinity(0, mine)
    m = re.search(r":(\d+) ", p.stdout.readline())
    if not m:
        p.kill()
        raise RuntimeError("node did not start")
    return p, int(m.group(1))


def _jobs(tier: NodeHostTier, rids: list[str], q: torch.Tensor, budget: float | None, scale: float, iters: int,
          warmup: int = 20, gap_s: float = 0.0, lane_width: bool = False, min_s: float = 0.0) -> dict:
    """Round trips of one layer's job for all ``rids`` (budget None: empty selection). ``lane_width``: the
    ids padded as the long lane's captured search pads them (select_graph._bound: a power of two over the
    budget's tokens), ~8x what a head selects, instead of to the widest head's selection. ``min_s``: jobs
    go on past ``iters`` until that long has passed (a concurrent store's window)."""
    ckvs = [tier.layer_kv(r, 0) for r in rids]
    if budget is None:
        H = ckvs[0].num_kv_heads
        sel = Selection([torch.zeros(H, 0, dtype=torch.int64)] * len(rids), [torch.zeros(H, dtype=torch.int64)] * len(rids))
    else:
        sel = select_clusters(q, ckvs, budget, scale)
        if lane_width:
            from nelssa.vllm_plugin.select_graph import _bound
            w = _bound(budget, ckvs, max(c.num_clusters for c in ckvs))
            sel = Selection([torch.nn.functional.pad(i.to(torch.int64), (0, max(0, w - i.shape[1]))) for i in sel.ids],
                            list(sel.counts))
    if tier._native is not None:
        return _native_jobs(tier, ckvs, q, sel, scale, iters, warmup, gap_s, min_s)
    job = encode_job(1, tier.client_id, 0, scale, q, rids, [c.length for c in ckvs], list(sel.ids), list(sel.counts))
    rt, node, comp = [], [], []
    for measured in _rounds(warmup, iters, min_s):
        t = time.perf_counter()
        res = tier._plane.run(job, 30.0)
        dt = time.perf_counter() - t
        if res.code:
            raise RuntimeError(res.message)
        if measured:
            rt.append(dt)
            node.append(res.node_s)
            comp.append(res.compute_s)
    return _summary(rt, node, comp)


def _native_jobs(tier: NodeHostTier, ckvs: list, q: torch.Tensor, sel: Selection, scale: float, iters: int,
                 warmup: int, gap_s: float = 0.0, min_s: float = 0.0) -> dict:
    """The native plane: each job a prepared HostCall's run() (the C++ round trip, what the long lane's
    calls do); node and kernel times from the node's answer. ``gap_s`` > 0: that long between jobs (a
    busy wait, so the client's core stays as busy as the lane's), the pace of an engine's lane batch
    (~0.7 ms of device work between its layers' calls on the H200) instead of back to back."""
    sel = pad_selection(sel)
    B, Hq, D = q.shape
    out, lse = torch.empty(B, Hq, D), torch.empty(B, Hq)
    rt, node, comp = [], [], []
    for measured in _rounds(warmup, iters, min_s):
        c = tier._native.call(ckvs, q, sel, scale, 0, out, lse)
        t = time.perf_counter()
        while gap_s and time.perf_counter() - t < gap_s:
            pass
        t = time.perf_counter()
        c.run()
        dt = time.perf_counter() - t
        if c.state != "done":
            raise RuntimeError(c.error)
        if measured:
            rt.append(dt)
            node.append(c.node_times[0])
            comp.append(c.node_times[1])
    return _summary(rt, node, comp)


def _rounds(warmup: int, iters: int, min_s: float):
    """Each job's turn -> whether it is measured: ``warmup`` jobs not, then ``iters`` jobs, and more until
    ``min_s`` has passed since the first."""
    end = time.perf_counter() + min_s
    i = 0
    while i < warmup + iters or time.perf_counter() < end:
        i += 1
        yield i > warmup


def _summary(rt: list[float], node: list[float], comp: list[float]) -> dict:
    over = [a - b for a, b in zip(rt, node)]
    outside = [a - c for a, c in zip(rt, comp)]
    return {"rt_p50_us": _pct(rt, 0.5) * 1e6, "rt_p99_us": _pct(rt, 0.99) * 1e6, "node_p50_us": _pct(node, 0.5) * 1e6,
            "compute_p50_us": _pct(comp, 0.5) * 1e6, "transport_p50_us": _pct(over, 0.5) * 1e6,
            "outside_compute_p50_us": _pct(outside, 0.5) * 1e6,
            "outside_compute_share": sum(outside) / sum(rt), "n": len(rt)}


def _store_data(tokens: int, H: int, D: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """One layer of a pre-clustered store: (clusters C, sizes int32 [H, C] summing to ``tokens`` per head,
    random fp32 K/V [H * tokens * 2 * D])."""
    C = max(1, tokens // 8)
    sizes = torch.full((H, C), tokens // C, dtype=torch.int32)
    sizes[:, 0] += tokens - sizes.sum(1)
    return C, sizes, torch.randn(H * tokens * 2 * D)


def _store_loop(port: int, stop: threading.Event, tokens: int, layers: int, H: int, D: int, out: dict,
                streaming: threading.Event) -> None:
    """Another client storing ``tokens`` x ``layers`` (fp32, pre-clustered random data) again and again;
    ``streaming`` set once its first data is handed to gRPC, ``out["sent"]`` the bytes so far (live)."""
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)])
    stub = pb_grpc.NelssaNodeStub(ch)
    cid = stub.Register(pb.RegisterRequest(name="bench-store", lease_s=60), timeout=10).client_id
    C, sizes, kv = _store_data(tokens, H, D)
    sizes_b, kv = sizes.numpy().tobytes(), kv.numpy().tobytes()
    step = 4 << 20
    n, sent, t0 = 0, [0], time.perf_counter()
    out["sent"] = sent
    while not stop.is_set():
        rid = f"s{n}"

        def chunks():
            yield pb.StoreChunk(header=pb.StoreHeader(client_id=cid, req_id=rid, part=0, num_layers=layers, kv_heads=H,
                                                      head_dim=D, dtype=pb.FLOAT32, tokens=tokens, clusters=[C] * layers))
            for _ in range(layers):
                yield pb.StoreChunk(data=sizes_b)
                for o in range(0, len(kv), step):
                    if stop.is_set() and n:  # a later store: stop streaming (the first one completes)
                        return
                    sent[0] += min(step, len(kv) - o)  # counted as handed to gRPC: a store in flight counts
                    streaming.set()
                    yield pb.StoreChunk(data=kv[o:o + step])

        try:
            stub.Store(chunks(), timeout=600)
            n += 1
        except grpc.RpcError:  # the cut-short store above: the node refuses an incomplete store
            if not stop.is_set():
                raise
        stub.Free(pb.FreeRequest(client_id=cid, req_id=rid), timeout=10)
    # stores = completed ones; store_gbps = bytes streamed (also of a store still in flight) per second
    out.update(stores=n, store_gbps=sent[0] / (time.perf_counter() - t0) / 1e9)
    del out["sent"]
    ch.close()


def _store_rate(port: int, tokens: int, layers: int, H: int, D: int, via: str, reps: int = 3) -> dict:
    """Seconds of one store of ``tokens`` x ``layers`` (fp32, pre-clustered random data) from a client on
    this host, ``via`` the gRPC stream or the store slot (the data written into the slot included), best
    and median of ``reps``; each stored request is freed after."""
    from nelssa.node.wire import StoreSlot, store_bytes
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)])
    stub = pb_grpc.NelssaNodeStub(ch)
    cid = stub.Register(pb.RegisterRequest(name=f"bench-store-{via}", lease_s=60), timeout=10).client_id
    C, sizes, kv = _store_data(tokens, H, D)
    nbytes = store_bytes(H, D, 4, tokens, [C] * layers)
    slot = None
    if via == "slot":
        rep = stub.OpenShm(pb.ShmRequest(client_id=cid, slot_bytes=nbytes, store=True), timeout=60)
        slot = StoreSlot.attach(rep.path, rep.slot_bytes)
        slot.unlink()
    sizes_b, kv_b, step = sizes.numpy().tobytes(), kv.numpy().tobytes() if via == "stream" else b"", 4 << 20
    secs = []
    for i in range(reps):
        header = pb.StoreHeader(client_id=cid, req_id=f"r{i}", part=0, num_layers=layers, kv_heads=H, head_dim=D,
                                dtype=pb.FLOAT32, tokens=tokens, clusters=[C] * layers, from_slot=slot is not None)
        t0 = time.perf_counter()
        if slot is not None:
            off, sb, kb = 0, sizes.numel() * 4, kv.numel() * 4
            for _ in range(layers):
                slot.data[off:off + sb].view(torch.int32).copy_(sizes.view(-1))
                slot.data[off + sb:off + sb + kb].view(torch.float32).copy_(kv)
                off += sb + kb
            stub.Store(iter([pb.StoreChunk(header=header)]), timeout=600)
        else:
            def chunks():
                yield pb.StoreChunk(header=header)
                for _ in range(layers):
                    yield pb.StoreChunk(data=sizes_b)
                    for o in range(0, len(kv_b), step):
                        yield pb.StoreChunk(data=kv_b[o:o + step])
            stub.Store(chunks(), timeout=600)
        secs.append(time.perf_counter() - t0)
        stub.Free(pb.FreeRequest(client_id=cid, req_id=f"r{i}"), timeout=10)
    stub.Unregister(pb.RenewRequest(client_id=cid), timeout=10)
    ch.close()
    return {"job": "store", "via": via, "tokens": tokens, "layers": layers, "bytes": nbytes,
            "best_s": min(secs), "median_s": _pct(secs, 0.5), "gbps_best": nbytes / min(secs) / 1e9}


def _fuzz_native(tier: NodeHostTier, pid: int, rids: list[str], q: torch.Tensor, budget: float, scale: float,
                 n: int, nd: int, plane: str) -> dict:
    """``n`` malformed native jobs (ids outside the clusters or negative, counts beyond the width or
    negative, NaN queries, layers outside the plan): each must fail with NaN outputs; then a valid job
    must still give the same bytes and the channel stay usable."""
    ckvs = [tier.layer_kv(r, 0) for r in rids]
    sel = pad_selection(select_clusters(q, ckvs, budget, scale))
    B, Hq, D = q.shape
    H, S = sel.ids[0].shape
    g = torch.Generator().manual_seed(nd)

    def run(q_, s_, layer=0):
        out, lse = torch.empty(B, Hq, D), torch.empty(B, Hq)
        c = tier._native.call(ckvs, q_, s_, scale, layer, out, lse)
        c.run()
        return c, out, lse

    _, want, _ = run(q, sel)
    rss0, accepted, nan_out = _rss(pid), 0, 0
    for k in range(n):
        ids, counts, q_, layer = [i.clone() for i in sel.ids], [c.clone() for c in sel.counts], q, 0
        b, h, kind = k % B, int(torch.randint(0, H, (1,), generator=g)), k % 5
        if kind == 0:
            ids[b][h, 0] = ckvs[b].num_clusters + int(torch.randint(0, 1 << 40, (1,), generator=g))
            counts[b][h] = max(1, int(counts[b][h]))
        elif kind == 1:
            ids[b][h, 0] = -int(torch.randint(1, 1 << 40, (1,), generator=g))
            counts[b][h] = max(1, int(counts[b][h]))
        elif kind == 2:
            counts[b][h] = S + int(torch.randint(1, 1 << 40, (1,), generator=g))
        elif kind == 3:
            q_ = q.clone()
            q_.view(-1)[int(torch.randint(0, q.numel(), (1,), generator=g))] = float("nan")
        else:
            layer = int(torch.randint(1, 1 << 40, (1,), generator=g))
        c, out, lse = run(q_, Selection(ids, counts), layer)
        accepted += c.state == "done"
        nan_out += bool(out.isnan().all() and lse.isnan().all())
    c, after, _ = run(q, sel)
    return {"devices": nd, "plane": plane, "job": "fuzz", "n": n, "accepted": accepted, "nan_outputs": nan_out,
            "valid_after_same": bool(c.state == "done" and torch.equal(after, want)),
            "rss_before_mb": rss0 / 2**20, "rss_after_mb": _rss(pid) / 2**20}


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def _fuzz(tier: NodeHostTier, pid: int, rids: list[str], q: torch.Tensor, budget: float, scale: float, n: int,
          nd: int, plane: str) -> dict:
    """``n`` malformed jobs: every one must get an error status; then a valid job must still match."""
    from nelssa.node.fuzz import bad_jobs
    ckvs = [tier.layer_kv(r, 0) for r in rids]
    sel = select_clusters(q, ckvs, budget, scale)
    good = encode_job(1, tier.client_id, 0, scale, q, rids, [c.length for c in ckvs], list(sel.ids), list(sel.counts))
    want = tier._plane.run(good, 30.0)
    before, t0, accepted = _rss(pid), time.perf_counter(), 0
    for j in bad_jobs(good, n, seed=nd, num_layers=1):
        accepted += tier._plane.run(j, 30.0).code == 0
    after = tier._plane.run(good, 30.0)
    return {"devices": nd, "plane": plane, "job": "fuzz", "n": n, "accepted": accepted,
            "still_serving_same_result": after.code == 0 and after.out == want.out,
            "rss_before_mb": before / 2**20, "rss_after_mb": _rss(pid) / 2**20, "s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="1,2")
    ap.add_argument("--planes", default="native,shm,grpc")
    ap.add_argument("--poll-spin-us", type=int, default=None,
                    help="the node's --poll-spin-us (default: the node's; 0 on machines without cores to spare)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per long request")
    ap.add_argument("--batch", type=int, default=2, help="long requests per job")
    ap.add_argument("--heads", type=int, default=4, help="KV heads")
    ap.add_argument("--qheads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--budget", type=float, default=0.04)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--store-tokens", type=int, default=100_000, help="concurrent store (0: skip isolation)")
    ap.add_argument("--store-layers", type=int, default=2)
    ap.add_argument("--store-window-s", type=float, default=2.0,
                    help="the jobs beside the concurrent store run at least this long")
    ap.add_argument("--device-memory", default="4GiB")
    ap.add_argument("--fuzz", type=int, default=0,
                    help="also send this many malformed jobs per plane (nelssa.node.fuzz) and check the node's RSS")
    ap.add_argument("--ingest-cores", type=int, default=0, help="cores kept for the node's store handling")
    ap.add_argument("--client-cores", type=int, default=0,
                    help="cores kept for this (client) process, taken before the node's: pinned there, the "
                         "waiting client never shares a device's core (0: not pinned)")
    ap.add_argument("--gap-us", type=float, default=0.0,
                    help="native plane: microseconds between jobs (the lane's pace; 0: back to back)")
    ap.add_argument("--margins-us", default="0",
                    help="native plane: wake margins to compare (config node_margin_us), each case run with each")
    ap.add_argument("--lane-width", action="store_true",
                    help="pad the real jobs' ids to the long lane's id width (a power of two over the budget's "
                         "tokens), as the engine's captured lane batches send them")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    H, Hq, D, n = a.heads, a.qheads, a.dim, a.tokens
    scale = D ** -0.5
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": cores},
              "shape": dict(tokens=n, batch=a.batch, heads=H, qheads=Hq, dim=D, budget=a.budget),
              "node": {"ingest_cores": a.ingest_cores}, "gap_us": a.gap_us, "cases": []}
    try:
        from nelssa.cpu import cpu_model
        report["machine"]["cpu"] = cpu_model()
    except Exception:  # noqa: BLE001 - informational only
        pass
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(H, n, D, generator=g) for _ in range(a.batch)]
    vals = [torch.randn(H, n, D, generator=g) for _ in range(a.batch)]
    q = torch.randn(a.batch, Hq, D, generator=g)
    every = sorted(os.sched_getaffinity(0))
    client = every
    if a.client_cores:
        if a.client_cores + a.ingest_cores >= cores:
            raise SystemExit(f"--client-cores {a.client_cores} + --ingest-cores {a.ingest_cores} leave no device core")
        client = every[:a.client_cores]  # the node's devices get the others (_start's skip)
        report["node"]["client_cores"] = client

    def timed(*args, **kw):
        # pinned only while it measures: the setup's clustering (client side) uses every core
        os.sched_setaffinity(0, client)
        try:
            return _jobs(*args, **kw)
        finally:
            os.sched_setaffinity(0, every)
    for nd in [int(x) for x in a.devices.split(",")]:
        proc, port = _start(nd, cores - a.client_cores, a.device_memory, a.ingest_cores, a.poll_spin_us,
                            skip=a.client_cores)
        try:
            for plane in a.planes.split(","):
                cfg = NelssaConfig(engine="node", node_address=f"127.0.0.1:{port}", node_transport=plane,
                                   segment=4096)
                set_config(cfg)
                tier = NodeHostTier(cfg, 1)
                rids = [f"r{i}" for i in range(a.batch)]
                t0 = time.perf_counter()
                for r, k, v in zip(rids, keys, vals):
                    tier.put_layers(r, [k], [v])
                print(f"[bench_node] {nd} device(s), {plane}: {a.batch} x {n} tokens clustered and stored in "
                      f"{time.perf_counter() - t0:.1f} s; {a.iters} jobs per case", file=sys.stderr, flush=True)
                margins = [int(x) for x in a.margins_us.split(",")] if tier._native is not None else [None]
                for label, budget in (("empty", None), ("real", a.budget)):
                    for margin in margins:  # the same jobs with each wake margin, back to back (native plane)
                        if margin is not None:
                            tier._native.chan.margin_us = margin
                        res = timed(tier, rids, q, budget, scale, a.iters, gap_s=a.gap_us * 1e-6,
                                    lane_width=a.lane_width)
                        case = {"devices": nd, "plane": plane, "job": label, **res,
                                **({"margin_us": margin} if margin is not None else {})}
                        report["cases"].append(case)
                        print(json.dumps(case), flush=True)
                if tier._native is not None:
                    tier._native.chan.margin_us = cfg.node_margin_us
                if a.store_tokens and plane == a.planes.split(",")[0]:
                    stop, info, streaming = threading.Event(), {}, threading.Event()
                    th = threading.Thread(target=_store_loop,
                                          args=(port, stop, a.store_tokens, a.store_layers, H, D, info, streaming))
                    th.start()
                    # the jobs only once the store streams (making its data took longer than 200 jobs on the
                    # H100 host: the first run of this case measured no store at all), for --store-window-s
                    if not streaming.wait(300):
                        stop.set()
                        th.join()
                        raise SystemExit("the concurrent store did not start streaming within 300 s")
                    b0, t0 = info["sent"][0], time.perf_counter()
                    res = timed(tier, rids, q, a.budget, scale, a.iters, warmup=5, gap_s=a.gap_us * 1e-6,
                                min_s=a.store_window_s)
                    during, dt = info["sent"][0] - b0, time.perf_counter() - t0
                    stop.set()
                    th.join()
                    case = {"devices": nd, "plane": plane, "job": "real+store", **res, **info,
                            "store_tokens": a.store_tokens, "store_layers": a.store_layers,
                            "store_bytes_during_jobs": during, "store_gbps_during_jobs": during / dt / 1e9}
                    report["cases"].append(case)
                    print(json.dumps(case), flush=True)
                if a.fuzz:
                    fz = _fuzz_native if tier._native is not None else _fuzz
                    report["cases"].append(fz(tier, proc.pid, rids, q, a.budget, scale, a.fuzz, nd, plane))
                    print(json.dumps(report["cases"][-1]), flush=True)
                tier.close()
            if a.store_tokens:
                for via in ("stream", "slot"):
                    case = {"devices": nd, **_store_rate(port, a.store_tokens, a.store_layers, H, D, via)}
                    report["cases"].append(case)
                    print(json.dumps(case), flush=True)
        finally:
            proc.terminate()
            proc.wait()
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
