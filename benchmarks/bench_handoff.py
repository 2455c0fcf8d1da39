"""Hand-off time vs context length, and what a hand-off does to the steps beside it (issue 13).

A request that grows past ``T_input`` under pressure (or a long prompt) moves to the host tier through
``vllm_plugin.handoff.Handoff``: one background thread reads its tokens from the paged KV cache (a CUDA
side stream), clusters every layer and packs it into host memory while the engine keeps stepping. This
measures exactly that object on a synthetic paged cache of the model's shape (Llama-3.1-8B by default:
32 layers, 8 KV heads of 128, bf16, 16-token blocks), per context length:

  move_s       submit -> the move's completion (what a migration of that context takes; ``move_thread_s``: by
               the hand-off thread's state, running, runnable without a core, blocked), and its parts
               measured alone on an idle device: ``read_s`` (the gather from the paged cache, all layers),
               ``cluster_s`` (k-means over the layers; ``cluster_torch_s`` the torch k-means, not the Triton
               kernels of config ``kmeans_kernel``; ``cluster_fp32_s`` with fp32 similarities) and
               ``put_s`` (the host tier's store: k-means, the parts' tables, packing and the copy into
               host memory; ``pack_s`` = put_s - cluster_s; ``put_new_mappings``: its parts that went into
               new memory rather than the ``--host-reserve`` reservation);
  prefill      a long prompt's hand-off (``--prefill`` tokens): its segments' moves submitted back to back
               (a backlog, as at the end of a 100K prompt's prefill, when the hand-off trails it), timed to the
               last one's completion with one thread (``serial_s``) and with the read and k-means on a
               thread ahead of the packing (``ahead_s``; config ``handoff_ahead``, handoff.py 1), steps beside;
  steps        a synthetic decode step on the main stream (per layer one GEMM that reads a
               ``--step-gb``/layers slice of weights, then a wait for that stream, as an engine's step
               ends on its sampled tokens), run back to back on another Python thread (GIL switch
               interval as the engine's with the lane) while the move is in flight: step time p50 / p99 /
               max against the same loop with no move (``idle``) — the hand-off's jitter on a step.

    python3 benchmarks/bench_handoff.py --out DIR [--contexts 8192,16384,32768,65536,131072] [--prefill 98304]

Writes handoff.json and handoff.png (move time vs context; step time during moves vs idle).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from types import SimpleNamespace

import torch

from nelssa.bench.common import pct
from nelssa.bench.hol import THREAD_STATES
from nelssa.config import get_config, parse_bytes, set_config
from nelssa.node.local import LocalHostTier
from nelssa.sparse import hostmem
from nelssa.sparse.clustered import cluster_layers
from nelssa.vllm_plugin.attention import read_kv
from nelssa.vllm_plugin.handoff import Handoff


class Steps:
    """Synthetic decode steps on the main stream, back to back, each timed wall-clock to its sync."""

    def __init__(self, layers: int, gb: float, dev: torch.device, dtype: torch.dtype, priority: int = 0):
        width = 4096
        cols = max(width, int(gb * 2**30 / layers / width / torch.finfo(dtype).bits * 8))
        self.w = torch.randn(layers, width, cols, device=dev, dtype=dtype)
        self.x = torch.randn(8, width, device=dev, dtype=dtype)
        self.dev = dev
        # the steps' stream: the engine's step_priority (its worker sets vLLM's current stream to one of that
        # priority); 0 is vLLM's own dedicated stream's, the same as the hand-off's side stream, whose
        # queued kernels then delay the step's (H200: step p99 beside a 32K move 27 ms at 0, 7.8 at -1)
        self.stream = torch.cuda.Stream(dev, priority=priority) if dev.type == "cuda" else None

    def one(self) -> tuple[float, float]:
        """(seconds to the step's end, seconds to enqueue its kernels): a long enqueue is the host side
        (the GIL, a lock in torch's allocator or the driver), a long wait after it the device side."""
        if self.stream is None:
            return self._one()
        with torch.cuda.stream(self.stream):
            return self._one()

    def _one(self) -> tuple[float, float]:
        t = time.perf_counter()
        x = self.x
        for w in self.w:
            x = (x @ w)[:, : self.x.shape[1]] * 1e-3
        launched = time.perf_counter() - t
        if self.dev.type == "cuda":
            # the step's own stream only, as an engine's step waits for its sampled tokens (an event on its
            # stream), not for the hand-off's side stream (a device-wide synchronize would wait for that too)
            torch.cuda.current_stream(self.dev).synchronize()
        return time.perf_counter() - t, launched

    def beside(self, fn):
        """``fn()`` with steps running back to back on another thread (started 50 ms before it) -> (fn's result,
        the steps' (start, seconds, enqueue seconds), at least three)."""
        stop = threading.Event()
        box: dict = {}
        th = threading.Thread(target=lambda: box.setdefault("s", self.run_until(stop, min_steps=3)))
        th.start()
        time.sleep(0.05)
        try:
            out = fn()
        finally:
            stop.set()
            th.join()
        return out, box["s"]

    def run_until(self, stop: threading.Event, min_steps: int = 0) -> list[tuple[float, float, float]]:
        """(start, seconds, enqueue seconds) of each step until ``stop`` (and at least ``min_steps``)."""
        out: list[tuple[float, float, float]] = []
        while not stop.is_set() or len(out) < min_steps:
            t = time.perf_counter()
            out.append((t, *self.one()))
        return out


def step_stats(v: list[float]) -> dict:
    ms = [1e3 * x for x in v]
    return {"n": len(ms), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "max_ms": max(ms) if ms else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--contexts", default="8192,16384,32768,65536,131072")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--step-gb", type=float, default=14.0, help="weights one synthetic step reads (8B: ~15 GB)")
    ap.add_argument("--idle-steps", type=int, default=200)
    ap.add_argument("--profile", type=int, default=0, metavar="CONTEXT",
                    help="record that context's move with torch.profiler (CPU + CUDA; both threads): "
                         "profile_<CONTEXT>.json.gz (Chrome trace) and profile_<CONTEXT>.txt (top ops)")
    ap.add_argument("--step-priority", type=int, default=get_config().step_priority,
                    help="CUDA priority of the steps' stream (default: the engine's, config step_priority; 0: "
                         "vLLM's own, the hand-off's too)")
    ap.add_argument("--no-warm", action="store_true",
                    help="skip Handoff.warm (the engine warms before serving): the first move then pays the "
                         "thread's one-time CUDA set-up beside the steps")
    ap.add_argument("--host-reserve", default="",
                    help="host-tier memory reserved (touched; with CUDA registered) before the moves, e.g. 20GiB "
                         "(config host_reserve, sparse/hostmem.py; default: the config's, 0)")
    ap.add_argument("--prefill", type=int, default=98304,
                    help="tokens of a long prompt handed off as back-to-back moves of one segment each, by one "
                         "thread and with the stage ahead (config handoff_ahead); 0: skip")
    ap.add_argument("--segment", type=int, default=0, help="k-means segment and the prefill's move (default: the config's)")
    ap.add_argument("--switch-us", type=float, default=200.0,
                    help="Python's GIL switch interval (the engine's worker sets 200 us with the lane)")
    a = ap.parse_args()
    sys.setswitchinterval(a.switch_us * 1e-6)
    os.makedirs(a.out, exist_ok=True)
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    ctxs = [int(x) for x in a.contexts.split(",")]
    L, KH, D, bs = a.layers, a.kv_heads, a.head_dim, a.block_size
    cfg = get_config()
    if a.host_reserve:
        cfg = cfg.replace(host_reserve=parse_bytes(a.host_reserve))
    if a.segment:
        cfg = cfg.replace(segment=a.segment)
    set_config(cfg)
    nb = math.ceil(max(ctxs + [a.prefill]) / bs)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    # the paged cache as read_kv's "flash" layout sees it: [blocks, KV heads, block size, 2 D]
    layers = [SimpleNamespace(kv_cache=torch.randn(nb, KH, bs, 2 * D, device=dev, dtype=dtype),
                              impl=SimpleNamespace(nelssa_kv_layout="flash"), num_kv_heads=KH, head_size=D)
              for _ in range(L)]
    steps = Steps(L, a.step_gb, dev, dtype, a.step_priority)
    host = LocalHostTier(cfg, num_layers=L)  # reserves cfg.host_reserve in the background
    t = time.perf_counter()
    hostmem.wait_reserved()
    if dev.type == "cuda" and cfg.host_reserve:  # as the engine does after its graphs' capture
        hostmem.register_cuda(dev)
    reserve_s = time.perf_counter() - t
    done: dict[str, float] = {}
    hand = Handoff(host, layers, bs, cfg.sink, read_kv, on_done=lambda rid, hi, gen: done.setdefault(rid, time.perf_counter()))
    res: dict = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
                 "shape": dict(layers=L, kv_heads=KH, head_dim=D, block_size=bs, dtype=a.dtype, sink=cfg.sink,
                               cluster_size=cfg.cluster_size, segment=cfg.segment, iters=cfg.iters),
                 "step_gb": a.step_gb, "switch_us": a.switch_us, "step_priority": a.step_priority, "setup_s": time.perf_counter() - t0,
                 "host_reserve": cfg.host_reserve, "host_reserve_wait_s": reserve_s, "host_memory": hostmem.stats(),
                 "contexts": []}
    res["warm_s"] = 0.0 if a.no_warm else hand.warm(min(cfg.segment, nb * bs))  # as the engine, before serving
    print(f"[handoff] setup {res['setup_s']:.1f} s on {res['device']}, warm {res['warm_s']:.2f} s", flush=True)
    for _ in range(5):
        steps.one()
    idle = [steps.one() for _ in range(a.idle_steps)]
    res["idle_steps"] = step_stats([x for x, _ in idle])
    res["idle_steps"]["enqueue"] = step_stats([x for _, x in idle])
    print(f"[handoff] idle step p50 {res['idle_steps']['p50_ms']:.2f} ms", flush=True)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for i, n in enumerate(ctxs):
        blocks = list(range(math.ceil(n / bs)))
        # the parts alone, the device otherwise idle
        pos = torch.arange(cfg.sink, n, device=dev)
        b, o = torch.tensor(blocks, device=dev)[pos // bs], pos % bs
        sync()
        t = time.perf_counter()
        kvs = [read_kv(x.kv_cache, "flash", b, o, KH, D) for x in layers]
        ks = [k.transpose(0, 1).contiguous() for k, _ in kvs]
        vs = [v.transpose(0, 1).contiguous() for _, v in kvs]
        sync()
        read_s = time.perf_counter() - t
        cluster_s = {}
        # the default (on CUDA: bf16 similarities, the Triton kernels), the torch k-means, all-fp32 similarities
        for name, sd, kern in (("default", None, cfg.kmeans_kernel), ("torch", None, False),
                               ("fp32", torch.float32, cfg.kmeans_kernel)):
            set_config(cfg.replace(kmeans_kernel=kern))
            t = time.perf_counter()
            cluster_layers(ks, seed=cfg.seed, cluster_size=cfg.cluster_size, segment=cfg.segment, iters=cfg.iters,
                           sim_dtype=sd)
            sync()
            cluster_s[name] = time.perf_counter() - t
        set_config(cfg)
        # the store alone (k-means, the parts' tables, packing, the copy into host memory), device idle
        mapped = hostmem.stats()["misses"]
        t = time.perf_counter()
        host.put_layers(f"alone{n}_{i}", ks, vs, commit=False)
        sync()
        put_s = time.perf_counter() - t
        put_mappings = hostmem.stats()["misses"] - mapped  # parts that went into new memory, not the reservation
        host.free(f"alone{n}_{i}")
        del ks, vs, kvs, pos, b, o
        # the move, steps running beside it
        rid = f"ctx{n}_{i}"  # a context may repeat (the first move vs the next)
        prof = None
        if a.profile == n:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            prof = profile(activities=acts, with_stack=False, record_shapes=False)
            prof.__enter__()

        def move():
            states0 = {p: host.stats.totals.get(f"move_thread_s:{p}", 0.0) for p in THREAD_STATES}
            t = time.perf_counter()
            hand.submit([(rid, blocks, cfg.sink, n)])
            hand.wait_all()
            return states0, t, done.get(rid, time.perf_counter())

        (states0, t, end), during = steps.beside(move)
        if prof is not None:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(os.path.join(a.out, f"profile_{n}.json.gz"))  # .gz: torch compresses it
            with open(os.path.join(a.out, f"profile_{n}.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        move_s = end - t
        # the move's wall time by the hand-off thread's state (handoff.thread_clock): running, runnable, blocked
        thread_s = {p: host.stats.totals.get(f"move_thread_s:{p}", 0.0) - v for p, v in states0.items()}
        hand.ready(rid, n)
        stored = host.committed(rid)
        if stored != n - cfg.sink:
            raise RuntimeError(f"context {n}: the host tier holds {stored} tokens, expected {n - cfg.sink}")
        hand.drop(rid)
        host.free(rid)
        row = {"context": n, "move_s": move_s, "tokens_per_s": (n - cfg.sink) / move_s, "read_s": read_s,
               "cluster_s": cluster_s["default"], "cluster_torch_s": cluster_s["torch"],
               "cluster_fp32_s": cluster_s["fp32"], "put_s": put_s,
               "pack_s": put_s - cluster_s["default"], "move_thread_s": thread_s, "put_new_mappings": put_mappings, "bytes": 2 * L * KH * D * (n - cfg.sink) * torch.finfo(dtype).bits // 8,
               "steps_during": {**step_stats([x for _, x, _ in during]),
                                "enqueue": step_stats([e for _, _, e in during])},
               # the slowest steps beside the move: (start - submit, ms, of which enqueue ms), to place them
               # in its phases and on a side (host: enqueue; device: the wait after it)
               "worst_steps": sorted(((st - t, 1e3 * x, 1e3 * e) for st, x, e in during), key=lambda y: -y[1])[:10]}
        res["contexts"].append(row)
        sd = row["steps_during"]
        print(f"[handoff] {n:>7} tokens: move {move_s:.2f} s (thread: " +
              ", ".join(f"{p} {v:.2f}" for p, v in thread_s.items()) + f"; alone: read {read_s:.2f}, cluster {cluster_s['default']:.2f} "
              f"(torch {cluster_s['torch']:.2f}, fp32 {cluster_s['fp32']:.2f}), store {put_s:.2f} = cluster + tables, packing, copy, "
              f"{put_mappings} new mappings); "
              f"steps during: {sd['n']} p50 {sd['p50_ms']:.2f} p99 {sd['p99_ms']:.2f} max {sd['max_ms']:.2f} ms "
              f"(enqueue p99 {sd['enqueue']['p99_ms']:.2f} max {sd['enqueue']['max_ms']:.2f} ms)",
              flush=True)
    hand.close()
    if a.prefill > cfg.sink:
        res["prefill"] = prefill_moves(a.prefill, host, layers, steps, cfg, bs, not a.no_warm)
    with open(os.path.join(a.out, "handoff.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(a.out, "handoff.png"))


def prefill_moves(n: int, host, layers, steps: Steps, cfg, bs: int, warm: bool) -> dict:
    """A long prompt's hand-off as its prefill submits it, all segments at once (the backlog at its end):
    the time to the last move's completion with one thread and with the stage ahead (handoff.py, 1),
    synthetic steps beside; the two stores compared (the same parts: the k-means made ahead is the same)."""
    seg = cfg.segment
    ranges, lo = [], cfg.sink  # [sink, segment), then whole segments (the engine's moves of a prompt, less its tail pieces)
    while lo < n:
        ranges.append((lo, min(n, (lo // seg + 1) * seg)))
        lo = ranges[-1][1]
    blocks = list(range(math.ceil(n / bs)))
    out: dict = {"tokens": n, "moves": len(ranges), "segment": seg}
    stored = {}
    for ahead in (False, True):
        ends: list[float] = []
        hand = Handoff(host, layers, bs, cfg.sink, read_kv, on_done=lambda rid, hi, gen: ends.append(time.perf_counter()),
                       ahead=ahead)
        if warm:
            hand.warm(min(seg, n))
        rid = f"prefill_{'ahead' if ahead else 'serial'}"
        def moves() -> float:
            t = time.perf_counter()
            hand.submit([(rid, blocks, lo, hi) for lo, hi in ranges])
            hand.wait_all()
            return t

        t, during = steps.beside(moves)
        if len(ends) != len(ranges):
            raise RuntimeError(f"prefill hand-off ({'ahead' if ahead else 'one thread'}): {len(ends)} of "
                               f"{len(ranges)} moves reported")
        hand.ready(rid, n)
        stored[ahead] = [(ckv.perm, ckv.csize) for ckv in host.reqs[rid].layers]
        hand.drop(rid)
        hand.close()
        host.free(rid)
        key = "ahead" if ahead else "serial"
        out[f"{key}_s"] = ends[-1] - t
        out[f"{key}_per_move_s"] = (ends[-1] - t) / len(ranges)
        out[f"{key}_steps_during"] = step_stats([x for _, x, _ in during])
    out["speedup"] = out["serial_s"] / out["ahead_s"]
    out["same_parts"] = all(torch.equal(a, b) for x, y in zip(stored[False], stored[True]) for a, b in zip(x, y))
    print(f"[handoff] prefill of {n} tokens, {len(ranges)} moves back to back: one thread {out['serial_s']:.2f} s "
          f"({out['serial_per_move_s']:.3f} s a move), ahead {out['ahead_s']:.2f} s ({out['ahead_per_move_s']:.3f}), "
          f"x{out['speedup']:.2f}; steps p99 {out['serial_steps_during']['p99_ms']:.2f} / "
          f"{out['ahead_steps_during']['p99_ms']:.2f} ms; same parts: {out['same_parts']}", flush=True)
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["contexts"]
    x = [r["context"] / 1024 for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(x, [r["move_s"] for r in rows], marker="o", label="move (submit to done, steps beside it)")
    axes[0].plot(x, [r["read_s"] for r in rows], marker=".", ls="--", label="read alone (paged-cache gather)")
    axes[0].plot(x, [r["cluster_s"] for r in rows], marker=".", ls="--", label="k-means alone")
    if all("put_s" in r for r in rows):
        axes[0].plot(x, [r["cluster_fp32_s"] for r in rows], marker=".", ls=":", label="k-means alone, fp32")
        axes[0].plot(x, [r["put_s"] for r in rows], marker=".", ls="--", label="store alone (k-means, packing, copy)")
    axes[0].set_xlabel("context (K tokens)")
    axes[0].set_ylabel("seconds")
    axes[0].set_title(f"Hand-off time vs context ({res['device']})", fontsize=10)
    axes[0].legend(fontsize=7)
    idle = res["idle_steps"]
    for key, m in (("p50_ms", "o"), ("p99_ms", "s"), ("max_ms", "^")):
        axes[1].plot(x, [r["steps_during"][key] for r in rows], marker=m, label=f"during a move, {key[:-3]}")
    axes[1].axhline(idle["p50_ms"], color="k", lw=0.8, label="no move, p50")
    axes[1].axhline(idle["p99_ms"], color="k", lw=0.8, ls="--", label="no move, p99")
    axes[1].set_xlabel("context of the move (K tokens)")
    axes[1].set_ylabel("synthetic decode step (ms)")
    axes[1].set_title("Steps beside a hand-off", fontsize=10)
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
