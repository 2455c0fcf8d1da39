"""Account for a step's time from a torch-profiler trace (vLLM's ``profiler_config``, Chrome JSON).

    python -m nelssa.bench.trace_summary TRACE.json[.gz] [--out summary.json] [--top 25]

Prints and writes, over the traced window:
  * per CPU thread: busy time in top-level ops and the ops with the most self time (what each thread
    spends its time on: the step thread, NELSSA's host pool and hand-off threads, ...);
  * the GPU: busy time (union of kernels and copies), idle gaps, the longest gaps with what the step
    thread was doing meanwhile (its innermost op), and the kernels with the most time;
  * per GPU stream: busy time, kernels and copies, the kernels with the most time, and how long they
    sat queued (kernel start minus the end of the runtime call that launched it, matched by the trace's
    correlation ids) by launching thread: a background stream's work that waits behind the engine's
    kernels shows as queued time, a thread too slow to launch as a busy thread and little queueing;
  * CUDA runtime calls that wait (synchronize, blocking copies) with their total time, overall and per
    thread;
  * user annotations (``record_function`` ranges such as vLLM's per-step ones): count and total.
No profiler output is interpreted beyond these event categories; unknown events are ignored.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict

WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy ",
         "cudaMemcpy\0", "cudaStreamWaitEvent")


def _is_wait(name: str) -> bool:
    """A CUDA runtime call that waits (a synchronize or a blocking copy)."""
    return name.startswith(WAITS) or "Synchronize" in name


def load(path: str) -> list[dict]:
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _self_times(evs: list[dict]) -> dict[str, float]:
    """Self time per op name of one thread's nested complete events (µs)."""
    evs = sorted(evs, key=lambda e: (e["ts"], -e["dur"]))
    self_t: dict[str, float] = defaultdict(float)
    stack: list[tuple[float, str]] = []  # (end, name)
    child: list[float] = []
    for e in evs:
        a, d = e["ts"], e["dur"]
        while stack and stack[-1][0] <= a:
            end, name = stack.pop()
            c = child.pop()
            self_t[name] += c
        if stack:
            child[-1] -= d
        stack.append((a + d, e["name"]))
        child.append(d)
    while stack:
        _, name = stack.pop()
        self_t[name] += child.pop()
    return self_t


def summarize(events: list[dict], top: int = 25) -> dict:
    x = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    if not x:
        raise ValueError("no complete events in the trace")
    t0 = min(e["ts"] for e in x)
    t1 = max(e["ts"] + e["dur"] for e in x)
    cpu = defaultdict(list)
    gpu, runtime, ann = [], [], defaultdict(list)
    for e in x:
        cat = str(e.get("cat", ""))
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append(e)
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            runtime.append(e)
        elif cat in ("cpu_op", "user_annotation", "python_function"):
            cpu[e.get("tid")].append(e)
            if cat == "user_annotation":
                ann[e["name"]].append(e["dur"])
    out: dict = {"window_ms": (t1 - t0) / 1e3, "threads": {}}
    for tid, evs in sorted(cpu.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        ops = [e for e in evs if e.get("cat") == "cpu_op"]
        busy = sum(b - a for a, b in _union([(e["ts"], e["ts"] + e["dur"]) for e in ops]))
        st = _self_times(ops)
        out["threads"][str(tid)] = {
            "busy_ms": busy / 1e3, "ops": len(ops),
            "top_self_ms": {k: round(v / 1e3, 3) for k, v in sorted(st.items(), key=lambda kv: -kv[1])[:top]}}
    if gpu:
        busy_iv = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
        busy = sum(b - a for a, b in busy_iv)
        gaps = [(b0, a1) for (_, b0), (a1, _) in zip(busy_iv, busy_iv[1:])]
        gaps.sort(key=lambda g: g[0] - g[1])
        main_tid = max(cpu, key=lambda t: len(cpu[t])) if cpu else None
        main = sorted((e for e in cpu.get(main_tid, []) if e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
        starts = [e["ts"] for e in main]

        def doing(t: float) -> str:
            """Innermost op of the step thread running at time t."""
            best, i = None, bisect.bisect_right(starts, t) - 1
            for j in range(i, max(-1, i - 400), -1):
                e = main[j]
                if e["ts"] <= t < e["ts"] + e["dur"] and (best is None or e["dur"] < best["dur"]):
                    best = e
            return best["name"] if best else "(no op: Python or idle)"
        kern = defaultdict(float)
        for e in gpu:
            kern[e["name"][:90]] += e["dur"]
        idle_by = defaultdict(float)
        for a, b in gaps:
            idle_by[doing((a + b) / 2)] += b - a
        out["gpu"] = {
            "busy_ms": busy / 1e3, "busy_frac": busy / (t1 - t0), "idle_ms": (t1 - t0 - busy) / 1e3,
            "gaps_over_100us": sum(1 for a, b in gaps if b - a > 100),
            "longest_gaps": [{"ms": round((b - a) / 1e3, 3), "at_ms": round((a - t0) / 1e3, 3),
                              "step_thread_in": doing((a + b) / 2)} for a, b in gaps[:top]],
            "idle_ms_by_step_thread_op": {k: round(v / 1e3, 3) for k, v in
                                          sorted(idle_by.items(), key=lambda kv: -kv[1])[:top]},
            "top_kernels_ms": {k: round(v / 1e3, 3) for k, v in sorted(kern.items(), key=lambda kv: -kv[1])[:top]},
            "step_thread": str(main_tid)}
    waits = defaultdict(lambda: [0, 0.0])
    for e in runtime:
        if _is_wait(e["name"]):
            w = waits[e["name"]]
            w[0] += 1
            w[1] += e["dur"] / 1e3
    out["cuda_waits"] = {k: {"n": n, "ms": round(ms, 3)} for k, (n, ms) in sorted(waits.items(), key=lambda kv: -kv[1][1])}
    out["streams"] = streams(gpu, runtime, top)
    for tid, th in out["threads"].items():
        mine = [e for e in runtime if str(e.get("tid")) == tid]
        th["cuda_launches"] = sum(1 for e in mine if "Launch" in e["name"])
        th["cuda_wait_ms"] = round(sum(e["dur"] for e in mine if _is_wait(e["name"])) / 1e3, 3)
    out["annotations"] = {k: {"n": len(v), "ms": round(sum(v) / 1e3, 3), "mean_ms": round(sum(v) / len(v) / 1e3, 3)}
                          for k, v in sorted(ann.items(), key=lambda kv: -sum(kv[1]))[:top]}
    return out


def streams(gpu: list[dict], runtime: list[dict], top: int = 10) -> dict:
    """Per GPU stream (the kernels' ``args.stream``): busy ms, kernel/copy count, top kernels, and per
    launching thread the queued time of its kernels (start minus the launch call's end; correlation ids)."""
    launch = {e["args"]["correlation"]: e for e in runtime if "correlation" in e.get("args", {})}
    by: dict[str, list[dict]] = defaultdict(list)
    for e in gpu:
        by[str(e.get("args", {}).get("stream", "?"))].append(e)
    out = {}
    for sid, evs in sorted(by.items(), key=lambda kv: -sum(e["dur"] for e in kv[1])):
        kern = defaultdict(float)
        for e in evs:
            kern[e["name"][:90]] += e["dur"]
        queued: dict[str, list[float]] = defaultdict(list)
        for e in evs:
            r = launch.get(e.get("args", {}).get("correlation"))
            if r is not None:
                queued[str(r.get("tid"))].append(max(0.0, e["ts"] - (r["ts"] + r["dur"])))
        out[sid] = {
            "busy_ms": round(sum(b - a for a, b in _union([(e["ts"], e["ts"] + e["dur"]) for e in evs])) / 1e3, 3),
            "n": len(evs),
            "top_kernels_ms": {k: round(v / 1e3, 3) for k, v in sorted(kern.items(), key=lambda kv: -kv[1])[:top]},
            "queued_by_thread": {tid: {"n": len(q), "ms": round(sum(q) / 1e3, 3),
                                       "p50_us": round(sorted(q)[len(q) // 2], 1), "max_us": round(max(q), 1)}
                                 for tid, q in queued.items()}}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nelssa.bench.trace_summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--out", default=None)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    s = summarize(load(a.trace), a.top)
    text = json.dumps(s, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
