"""What a lane layer's host call costs beyond its kernel (CUDA): the long lane runs, per layer, the
queries' copy to pinned memory -> the host attention as a CUDA host function (csrc/host_call.cpp)
-> the results' copy back, 32 times in a chain (layer i + 1's queries depend on layer i's output).
At the head-of-line scenario's shape (two 100K-token requests, 8 KV heads of 128, budget 4%):

  kernel      the host call run on this thread (``HostCall.run``): the kernel alone;
  stream      the chain enqueued on two streams (lane_host.py's shape), per layer;
  graph       the same chain captured as one CUDA graph and replayed (lane_batch.py's shape);
  *_empty     the same with empty selections (no rows read): the pure cost of a call.

  paced       the host call run on a thread of its own (as the engine's flag poller runs them: a thread
              team of its own, csrc/host_team.cpp) with ``--gap-us`` between calls (the lane's device work between layers):
              what a call costs when its team has waited in between, against ``kernel`` back to back;
              with the kernel's time by part (``HostCall.kernel_split``: prep, fork, tables, items, wait,
              combine; mean us per call).

Without CUDA only ``paced`` runs (the KV clustered on the CPU), e.g. a growth run's call on a CPU box:
``--length 6144 --batch 3``.

``overhead`` = per-layer chain time - kernel time. Run it twice to compare the team's spin between calls
(``NELSSA_POOL_SPIN_US``), the pool's size (``NELSSA_POOL_THREADS``) or torch's own OpenMP team on the
main thread (``--torch-threads``: an engine process has one; libgomp lets teams spin only while its
threads are fewer than the process's cores): all are recorded.

    python3 benchmarks/bench_host_call.py --out DIR [--length 100000] [--batch 2] [--layers 32]
        [--gap-us 700] [--torch-threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import torch

from nelssa.bench.common import HOL_HEADS, add_hol_shape_args, hol_shape_kv
from nelssa._ext import spin_us
from nelssa.config import get_config
from nelssa.sparse import prepare_attend, select_clusters
from nelssa.sparse.search import Selection


def chain(calls, q_d, q_h, outs, lane, hs, events, capture_borrowed=False):
    """Enqueue the 32-layer chain: per layer a device op on the queries, their copy to pinned memory,
    the host call on ``hs``, the results' copies back; the lane waits for them before the next layer."""
    x = q_d
    for i, call in enumerate(calls):
        ready, done = events[i]
        with torch.cuda.stream(lane):
            x = x * 1.0
            q_h[i].copy_(x, non_blocking=True)
            ready.record(lane)
        hs.wait_event(ready)
        if capture_borrowed:
            call.launch_borrowed(hs.cuda_stream)
        else:
            call.launch(hs.cuda_stream)
        with torch.cuda.stream(hs):
            outs[i][2].copy_(outs[i][0], non_blocking=True)
            outs[i][3].copy_(outs[i][1], non_blocking=True)
            done.record(hs)
        lane.wait_event(done)
        with torch.cuda.stream(lane):
            x = x + outs[i][2][..., :1].to(x.dtype) * 0  # layer i + 1 depends on layer i's result
    return x


def measure(ckvs, sel, q, layers: int, reps: int) -> dict:
    B, Hq, D = q.shape
    scale = D ** -0.5
    q_h = [torch.empty(B, Hq, D, dtype=q.dtype).pin_memory() for _ in range(layers)]
    outs = [(torch.empty(B, Hq, D).pin_memory(), torch.empty(B, Hq).pin_memory(),
             torch.empty(B, Hq, D, device="cuda"), torch.empty(B, Hq, device="cuda")) for _ in range(layers)]
    for i in range(layers):
        q_h[i].copy_(q)

    def fresh():  # a HostCall runs once (csrc/host_call.cpp): new calls for every chain
        return [prepare_attend(q_h[i], ckvs, sel, scale, outs[i][0], outs[i][1]) for i in range(layers)]

    # the kernel alone, on this thread (its own clock: HostCall.seconds)
    for c in fresh()[:3]:
        c.run()
    sets = [fresh() for _ in range(reps)]
    t = time.perf_counter()
    for calls in sets:
        for c in calls:
            c.run()
    res = {"kernel_wall_ms": (time.perf_counter() - t) / (reps * layers) * 1e3,
           "kernel_ms": sum(c.seconds for calls in sets for c in calls) / (reps * layers) * 1e3}
    assert all(c.state == "done" for calls in sets for c in calls), [c.error for calls in sets for c in calls]
    lane, hs = torch.cuda.Stream(), torch.cuda.Stream()
    events = [(torch.cuda.Event(), torch.cuda.Event()) for _ in range(layers)]
    q_d = q.cuda()
    for _ in range(2):
        chain(fresh(), q_d, q_h, outs, lane, hs, events)
    torch.cuda.synchronize()
    sets = [fresh() for _ in range(reps)]
    t = time.perf_counter()
    for calls in sets:
        chain(calls, q_d, q_h, outs, lane, hs, events)
        torch.cuda.synchronize()
    res["stream_ms"] = (time.perf_counter() - t) / (reps * layers) * 1e3
    assert all(c.state == "done" for calls in sets for c in calls), [c.error for calls in sets for c in calls]
    calls = fresh()  # borrowed by the graph: re-armed before each replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(lane):
        lane.synchronize()
        graph.capture_begin(capture_error_mode="thread_local")
        chain(calls, q_d, q_h, outs, lane, hs, events, capture_borrowed=True)
        graph.capture_end()
    for rep in range(reps + 2):
        if rep == 2:
            torch.cuda.synchronize()
            t = time.perf_counter()
        for c in calls:
            c.rearm()
        with torch.cuda.stream(lane):
            graph.replay()
        lane.synchronize()
    res["graph_ms"] = (time.perf_counter() - t) / (reps * layers) * 1e3
    assert all(c.state == "done" for c in calls), [c.error for c in calls]
    res["stream_overhead_ms"] = res["stream_ms"] - res["kernel_ms"]
    res["graph_overhead_ms"] = res["graph_ms"] - res["kernel_ms"]
    return res


def paced(ckvs, sel, q, calls: int, gap_s: float) -> dict:
    """Host calls one at a time on a new thread, ``gap_s`` apart (busy wait): median / p90 of their
    kernel time (HostCall.seconds)."""
    B, Hq, D = q.shape
    out, lse = torch.empty(B, Hq, D), torch.empty(B, Hq)
    ts: list[float] = []
    parts: list[dict] = []

    def run() -> None:
        for i in range(calls + 20):
            c = prepare_attend(q, ckvs, sel, D ** -0.5, out, lse)
            c.run()
            if c.state != "done":
                raise RuntimeError(c.error)
            if i >= 20:
                ts.append(c.seconds * 1e3)
                parts.append(c.kernel_split)
            t = time.perf_counter()
            while time.perf_counter() - t < gap_s:
                pass

    th = threading.Thread(target=run)
    th.start()
    th.join()
    ts.sort()
    split = {k: 1e6 * statistics.mean(d[k] for d in parts) for k in parts[0]} if parts else None
    return {"median_ms": statistics.median(ts), "p90_ms": ts[int(0.9 * (len(ts) - 1))], "gap_us": gap_s * 1e6,
            "split_us": split}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    add_hol_shape_args(ap)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--gap-us", type=float, default=700.0, help="paced: between calls (the lane's pace)")
    ap.add_argument("--calls", type=int, default=300, help="paced: calls per case")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch.set_num_threads and one parallel CPU op on the main thread first (0: torch's default)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    x = torch.randn(1024, 1024)
    (x @ x).sum()  # torch's OpenMP team on the main thread, as an engine process has it
    H, G, D = HOL_HEADS
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ckvs = hol_shape_kv(a.length, a.batch, dev)
    q = torch.randn(a.batch, H * G, D, dtype=torch.bfloat16)
    sel = select_clusters(q.to(dev), ckvs, a.budget, D ** -0.5)
    empty = Selection([i[:, :1].clone() for i in sel.ids], [torch.zeros_like(c) for c in sel.counts])
    res = {"shape": dict(B=a.batch, L=a.length, H=H, G=G, D=D, budget=a.budget, layers=a.layers),
           "selected_tokens": [int(x.sum()) for x in sel.tokens(ckvs)], "pool_threads": get_config().pool_threads,
           "env": {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
                   if k in os.environ},
           "torch_threads": torch.get_num_threads(), "cores": len(os.sched_getaffinity(0)), "device": dev,
           "pool_spin_us": spin_us(get_config()), "pool_spin_us_config": get_config().pool_spin_us}
    if dev == "cuda":  # the chain through streams and a graph (the lane's shapes)
        res["real"], res["empty"] = measure(ckvs, sel, q, a.layers, a.reps), measure(ckvs, empty, q, a.layers, a.reps)
    res["paced"] = {"real": paced(ckvs, sel, q, a.calls, a.gap_us * 1e-6),
                    "empty": paced(ckvs, empty, q, a.calls, a.gap_us * 1e-6),
                    "real_back_to_back": paced(ckvs, sel, q, a.calls, 0.0)}
    tag = (f"{os.environ.get('OMP_WAIT_POLICY', 'default')}_t{get_config().pool_threads}_tt{torch.get_num_threads()}"
           f"_s{spin_us(get_config())}")
    with open(os.path.join(a.out, f"host_call_{tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
