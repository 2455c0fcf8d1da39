"""Serving workloads against an OpenAI-compatible endpoint, NELSSA vs NELSSA_OFF side by side:

    nelssa bench single-long | multi-long | mixed | growth | hol-http  [--preset cpu|h200|h100]
                 [--serve on,off | --endpoints on=URL,...]

* ``single-long`` / ``multi-long``: one / N concurrent long requests: TTFT, TPOT, decode tok/s.
* ``mixed``: the Mooncake conversation trace (``nelssa.bench.trace``: lengths scaled to the model's
  context keeping each request's share, Poisson arrivals at each swept rate, each swept long
  fraction), short-request TPOT p50/p95/p99 apart from long ones, decode tok/s, running batch, KV
  usage, waiting queue and preemptions over time from ``/metrics`` (paper Fig. 14-16).
* ``growth``: input:output 1:2, contexts that start below T_input and pass it while decoding (§8.4).
* ``hol-http``: ``nelssa bench hol``'s scenario (its arrivals, ``nelssa.bench.hol.Scenario`` fields under
  ``hol-http``) sent to the endpoint instead of an in-process AsyncLLM, so it runs through the proxy too.

Modes: ``--serve on,off`` starts ``nelssa serve`` per mode (NELSSA with the preset's config, then stock
vLLM under NELSSA_OFF=1), one after the other, each on a free port, and stops it after its run;
``--endpoints on=URL[,off=URL]`` drives servers (or proxies) that are already up. Every request is a
streaming completion with exact-length token-id prompts and ``ignore_eos`` (vLLM's benchmark client).

Writes ``results/<UTC time>-<workload>/`` (or ``--out``): ``requests_<mode>.jsonl`` (per request: class,
sweep point, arrival, token times), ``metrics_<mode>.jsonl`` (the /metrics samples), ``summary.json``
(per mode and point: per-class TTFT/TPOT percentiles, decode tok/s, batch/KV/queue/preemptions; the
NELSSA/OFF ratios), ``throughput.png``, ``running.png``, ``short_tpot_cdf.png``, ``itl.png`` (and ``sweep.png`` for
sweeps), ``server_<mode>.log``; ``nelssa bench report DIR`` renders ``report.md``.

One mode per invocation (``--serve on``, then ``--serve off``: e.g. one device call each) and
``nelssa bench merge --out DIR A B`` puts them side by side as if run together: the same summary, ratios
and plots, from the modes' raw files (which are written after every sweep point, so a run stopped by
a time limit keeps the points it finished). Both runs must have the same workload and sweep points.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from functools import partial
from typing import Any

from nelssa.bench import trace as tr
from nelssa.bench.common import pct, preemptions_text, prompt_ids, ratio, require_number

WORKLOADS = ("single-long", "multi-long", "mixed", "growth", "hol-http")

# Per preset: the server (both modes alike; "nelssa" is the on-mode config) and each workload's size.
PRESETS: dict[str, dict[str, Any]] = {
    # SmolLM2 on 2 CPU cores, KV limited to 28 blocks of 128 tokens (3,584): two long prompts do not fit
    # side by side in stock vLLM.
    "cpu": {
        "model": "smollm2", "prompts": "random",
        "env": {"VLLM_CPU_KVCACHE_SPACE": "2"},  # CPU vLLM otherwise reserves 92% of RAM (the KV is 28 blocks)
        "server": ["--max-model-len", "3200", "--num-gpu-blocks-override", "28", "--max-num-seqs", "16",
                   "--max-num-batched-tokens", "1024", "--long-prefill-token-threshold", "512", "--enforce-eager",
                   "--no-enable-prefix-caching", "--seed", "0"],
        "nelssa": {"T_input": 2048, "budget": 0.04, "chunk": 128, "defer_below": 0},  # the host path, whatever the room
        "max_model_len": 3200,
        "single-long": {"n_in": 2600, "n_out": 32},
        "multi-long": {"n": 2, "n_in": 2600, "n_out": 32},
        "mixed": {"rates": [1.0], "long_fractions": [0.2], "n": 10, "max_output": 32, "min_output": 8},
        "growth": {"n": 3, "n_in": 400, "rate": 0.0, "T_input": 1024},
        "hol-http": {"rate": 1.5, "duration": 10.0, "short_in": 96, "short_out": 12, "long_at": 3.0, "n_long": 1,
                     "long_len": 2600, "long_out": 24},
    },
    # H200, Llama-3.1-8B-shaped dummy weights, KV ~187K tokens (as nelssa bench hol)
    "h200": {
        "model": "dummy", "prompts": "random",
        "server": ["--load-format", "dummy", "--gpu-memory-utilization", "0.27", "--max-model-len", "131072",
                   "--max-num-seqs", "128", "--max-num-batched-tokens", "8192", "--long-prefill-token-threshold",
                   "2048", "--no-enable-prefix-caching", "--seed", "0"],
        # the long lane on, as in `nelssa bench hol`'s H200 runs (short requests never wait for the host tier)
        "nelssa": {"T_input": 8192, "budget": 0.04, "host_capacity": "64GiB", "lane": True},
        "max_model_len": 131072,
        "single-long": {"n_in": 100_000, "n_out": 256},
        "multi-long": {"n": 4, "n_in": 100_000, "n_out": 256},
        "mixed": {"rates": [2.0, 4.0, 8.0], "long_fractions": [None, 0.1], "n": 200, "max_output": 2000,
                  "min_output": 1},
        "growth": {"n": 16, "n_in": 4096, "rate": 1.0, "T_input": 8192},
        "hol-http": {},  # nelssa bench hol's H200 defaults
    },
}


def _on_80gb(server: list[str]) -> list[str]:
    """The h200 preset's server arguments with the same KV on an 80-GB GPU: ``nelssa bench hol --preset
    h100``'s memory share and KV blocks (187,200 tokens) instead of a memory share that leaves ~3 GB of KV."""
    from nelssa.bench.hol import PRESETS as HOL
    i = server.index("--gpu-memory-utilization")
    return server[:i] + ["--gpu-memory-utilization", str(HOL["h100"]["util"]),
                         "--num-gpu-blocks-override", str(HOL["h100"]["kv_blocks"])] + server[i + 2:]


PRESETS["h100"] = {**PRESETS["h200"], "server": _on_80gb(PRESETS["h200"]["server"])}


# ------------------------------------------------------------------ plans

def plans(workload: str, p: dict, t_input: int, trace_path: str | None = None, seed: int = 0) -> tuple[list, dict]:
    """[(point name, plan)] for a workload at preset ``p`` (its workload section already overridden),
    and notes for the summary (scaling etc.)."""
    w = p[workload]
    if workload == "single-long":
        return [("single", tr.long_plan(1, w["n_in"], w["n_out"]))], {}
    if workload == "multi-long":
        return [(f"n{w['n']}", tr.long_plan(w["n"], w["n_in"], w["n_out"]))], {}
    if workload == "growth":
        return [("growth", tr.growth_plan(w["n"], w["n_in"], w.get("rate") or None, w["T_input"], seed))], \
            {"growth_T_input": w["T_input"]}
    if workload == "hol-http":
        from nelssa.bench.hol import Scenario, _arrivals
        return [("hol", _arrivals(Scenario(**{**w, "seed": seed})))], {"hol_scenario": w}
    rows = tr.load_trace(trace_path)
    scaled, sc = tr.scale_trace(rows, p["max_model_len"], w["max_output"], min_output=w.get("min_output", 1))
    pts = []
    for f in w["long_fractions"]:
        for rate in w["rates"]:
            name = f"rate{rate:g}-long{'trace' if f is None else f'{f:g}'}"
            pts.append((name, tr.mixed_plan(scaled, t_input, rate, w["n"], f, seed=seed, prefix=f"{name}-")))
    notes = {"trace": os.path.abspath(trace_path or tr.default_trace()), "trace_rows": len(rows),
             "scaling": sc.__dict__,
             "scaled_long_share": sum(r["input"] >= t_input for r in scaled) / len(scaled),
             "rule": "lengths x one factor (max_input / trace max), long = scaled input >= T_input; "
                     "Poisson arrivals per rate; long fraction f: class drawn with probability f"}
    return pts, notes


# ------------------------------------------------------------------ analysis

def tpot_ms(r: dict) -> float | None:
    s = r["stamps"]
    return 1e3 * (s[-1] - s[0]) / (len(s) - 1) if len(s) > 1 else None


def class_stats(recs: list[dict]) -> dict:
    ok = [r for r in recs if r["success"] and r["stamps"]]
    ttft = [1e3 * r["ttft_s"] for r in ok]
    tpot = [t for t in (tpot_ms(r) for r in ok) if t is not None]
    itl = [1e3 * (b - a) for r in ok for a, b in zip(r["stamps"], r["stamps"][1:])]
    out: dict[str, Any] = {"n": len(recs), "ok": len(ok), "errors": sorted(r["id"] for r in recs if not r["success"])}
    for name, v in (("ttft_ms", ttft), ("tpot_ms", tpot), ("itl_ms", itl)):
        for p in (50, 95, 99):
            out[f"{name}_p{p}"] = pct(v, p)
    toks = sum(r["output_tokens"] for r in ok)
    dec = [(r["output_tokens"] - 1) / (r["stamps"][-1] - r["stamps"][0]) for r in ok
           if len(r["stamps"]) > 1 and r["stamps"][-1] > r["stamps"][0]]
    out["output_tokens"] = toks
    out["per_request_decode_tok_s_p50"] = pct(dec, 50)
    return out


def point_stats(recs: list[dict], samples: list[dict], span: list[float]) -> dict:
    """One sweep point of one mode: per class and overall; decode tok/s = output tokens over the point's
    window (first arrival to last token); /metrics over that window (running batch, waiting, KV usage,
    preemptions, NELSSA counters)."""
    out: dict[str, Any] = {"classes": {}}
    for k in sorted({r["kind"] for r in recs}):
        out["classes"][k] = class_stats([r for r in recs if r["kind"] == k])
    out["all"] = class_stats(recs)
    ok = [r for r in recs if r["success"] and r["stamps"]]
    if ok:
        a = min(r["start"] for r in recs)
        b = max(r["stamps"][-1] for r in ok)
        out["window_s"] = [a, b]
        out["decode_tok_s"] = sum(r["output_tokens"] for r in ok) / (b - a) if b > a else None
    else:
        out["window_s"], out["decode_tok_s"] = list(span), None
    lo, hi = out["window_s"]
    ss = [s for s in samples if lo <= s["t"] <= hi + 1.0]
    if not ss and recs:
        ss = [s for s in samples if s["point"] == recs[0]["point"]]
    if ss:
        # gauges over the window: as coarse as the sampling (a request that starts and ends between two
        # samples, e.g. a starved API server streaming all its tokens at once, is in no sample)
        out["samples"] = len(ss)
        out["running_max"] = max(s["running"] for s in ss)
        out["running_mean"] = sum(s["running"] for s in ss) / len(ss)
        out["waiting_max"] = max(s["waiting"] for s in ss)
        out["kv_usage_max"] = max(s["kv_usage"] for s in ss)
        a, b = _point_bounds(samples, recs[0]["point"]) if recs else (ss[0], ss[-1])
        out["preemptions"] = b["preemptions"] - a["preemptions"]
        for k in ("generation_tokens", "prompt_tokens"):
            if k in b:
                out[k] = b[k] - a.get(k, 0.0)
        # NELSSA counters over the point, gauges (e.g. host bytes) at their maximum over the window
        out["nelssa"] = {k: (b[k] - a.get(k, 0.0)) if k.endswith(("_total", "_sum", "_count"))
                         else max(s.get(k, 0.0) for s in ss) for k in b if k.startswith("nelssa:")}
        if out["nelssa"].get("nelssa:migrations_started_total"):
            out["handoff"] = handoff_itl(ok, ss)
    return out


def _point_bounds(samples: list[dict], point: str) -> tuple[dict, dict]:
    """The samples a point's counters are differenced between: the last one before the point's first
    (replay takes one before any request and keeps sampling through the gap after each point), and the
    point's last (taken after its last token: vLLM counts a token before it streams it)."""
    idx = [i for i, s in enumerate(samples) if s["point"] == point]
    if not idx:
        return samples[0], samples[-1]
    return samples[max(idx[0] - 1, 0)], samples[idx[-1]]


def handoff_windows(samples: list[dict]) -> list[tuple[float, float]]:
    """Sample intervals [t_i, t_i+1] in which a migration may have been in flight: one had started by the
    interval's end that had not completed by its start (``nelssa:migrations_*`` counters; the windows are
    as coarse as the /metrics sampling)."""
    st, cp = "nelssa:migrations_started_total", "nelssa:migrations_completed_total"
    return [(a["t"], b["t"]) for a, b in zip(samples, samples[1:]) if b.get(st, 0.0) > a.get(cp, 0.0)]


def handoff_itl(recs: list[dict], samples: list[dict]) -> dict:
    """Inter-token latency of every request (any class) whose interval overlaps a migration window vs
    the rest: what a background hand-off costs the tokens beside it (issue 13's jitter)."""
    win = handoff_windows(samples)
    during, other = [], []
    for r in recs:
        for a, b in zip(r["stamps"], r["stamps"][1:]):
            (during if any(a < hi and b > lo for lo, hi in win) else other).append(1e3 * (b - a))
    return {"windows": len(win), "window_s": sum(hi - lo for lo, hi in win),
            **{f"itl_ms_during_p{p}": pct(during, p) for p in (50, 99)}, "itl_during_n": len(during),
            **{f"itl_ms_outside_p{p}": pct(other, p) for p in (50, 99)}, "itl_outside_n": len(other),
            "itl_ms_during_max": max(during) if during else None}


RATIO_KEYS = ["decode_tok_s", "classes.short.tpot_ms_p99", "classes.short.tpot_ms_p50", "classes.short.ttft_ms_p99",
              "classes.long.tpot_ms_p50", "classes.long.ttft_ms_p50", "running_mean", "preemptions"]


def _get(d: dict, dotted: str):
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def summarise(runs: dict[str, dict], meta: dict) -> dict:
    summ: dict[str, Any] = {**meta, "modes": {}}
    for mode, run in runs.items():
        summ["modes"][mode] = {name: point_stats([r for r in run["requests"] if r["point"] == name], run["samples"],
                                                 span) for name, span in run["points"].items()}
    if meta.get("workload") == "hol-http":  # nelssa bench hol's phases and targets, through the endpoint
        from nelssa.bench import hol
        phases = {m: hol.analyse(hol.from_http(r)) for m, r in runs.items()}
        summ["hol"] = {m: {**a, "residency_targets": hol.residency_targets(a)} for m, a in phases.items()}
        if "on" in phases and "off" in phases:
            summ["hol_targets"] = hol.targets(phases["on"], phases["off"])
    if "on" in runs and "off" in runs:
        summ["ratios_on_over_off"] = {
            name: {k: ratio(_get(summ["modes"]["on"][name], k), _get(summ["modes"]["off"][name], k))
                   for k in RATIO_KEYS}
            for name in summ["modes"]["on"] if name in summ["modes"]["off"]}
    return summ


# ------------------------------------------------------------------ plots

MODE_NAMES = {"on": "NELSSA", "off": "stock (NELSSA_OFF)"}


def _mode_name(m: str) -> str:
    return MODE_NAMES.get(m, m)


def plot_all(runs: dict[str, dict], summ: dict, out: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    files = []
    # throughput over time: output tokens per 1-s bin (token times from the streams)
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for mode, run in runs.items():
        ts = [t for r in run["requests"] for t in r["stamps"]]
        if ts:
            edges = np.arange(0, math.ceil(max(ts)) + 2, 1.0)
            h, _ = np.histogram(ts, edges)
            ax.step(edges[:-1], h, where="post", label=_mode_name(mode))
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Decode throughput over time (1 s bins)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append("throughput.png")
    fig.savefig(os.path.join(out, files[-1]), dpi=110)
    plt.close(fig)
    # running batch / waiting / KV usage over time
    fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)
    for mode, run in runs.items():
        s = run["samples"]
        t = [x["t"] for x in s]
        axes[0].plot(t, [x["running"] for x in s], label=_mode_name(mode))
        axes[1].plot(t, [x["waiting"] for x in s], label=_mode_name(mode))
        axes[2].plot(t, [100 * x["kv_usage"] for x in s], label=_mode_name(mode))
    for ax, lab in zip(axes, ("running requests", "waiting requests", "KV usage %")):
        ax.set_ylabel(lab)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[0].set_title("vLLM /metrics over time", fontsize=10)
    axes[-1].set_xlabel("seconds since start")
    fig.tight_layout()
    files.append("running.png")
    fig.savefig(os.path.join(out, files[-1]), dpi=110)
    plt.close(fig)
    # short-request TPOT CDF (per mode and point)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for mode, run in runs.items():
        pts = sorted({r["point"] for r in run["requests"]})
        for name in pts:
            v = sorted(t for r in run["requests"] if r["point"] == name and r["kind"] == "short"
                       for t in [tpot_ms(r)] if t is not None)
            if v:
                drawn = True
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), drawstyle="steps-post",
                        label=f"{_mode_name(mode)}" + (f" {name}" if len(pts) > 1 else ""))
    ax.set_xlabel("short-request TPOT (ms)")
    ax.set_ylabel("fraction of short requests")
    ax.set_title("Short-request TPOT CDF" + ("" if drawn else " (no short requests in this workload)"),
                 fontsize=10)
    if drawn:
        ax.set_xscale("log")
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    files.append("short_tpot_cdf.png")
    fig.savefig(os.path.join(out, files[-1]), dpi=110)
    plt.close(fig)
    # every token's inter-token latency over time, per mode: stalls (a preempted request's wait, a lane
    # capture's) stand out where a percentile hides them
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * max(1, len(runs))), sharex=True, sharey=True,
                             squeeze=False)
    for ax, (mode, run) in zip(axes[:, 0], runs.items()):
        pts = [(b, 1e3 * (b - a)) for r in run["requests"] for a, b in zip(r["stamps"], r["stamps"][1:])]
        if pts:
            t, itl = zip(*pts)
            ax.scatter(t, itl, s=2, alpha=0.4, linewidths=0)
            ax.set_yscale("log")
        ax.set_ylabel("ITL (ms)")
        ax.set_title(f"{_mode_name(mode)}: every token's inter-token latency", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[-1, 0].set_xlabel("seconds since start")
    fig.tight_layout()
    files.append("itl.png")
    fig.savefig(os.path.join(out, files[-1]), dpi=110)
    plt.close(fig)
    # sweep: decode tok/s and short P99 TPOT vs rate, per long fraction (mixed only)
    rates = {n: n.split("-")[0] for m in summ["modes"].values() for n in m}
    if len(rates) > 1 and all(n.startswith("rate") for n in rates):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for mode, pts in summ["modes"].items():
            groups: dict[str, list] = {}
            for n, st in pts.items():
                r, f = n.split("-", 1)
                groups.setdefault(f, []).append((float(r[4:]), st))
            for f, lst in groups.items():
                lst.sort(key=lambda x: x[0])
                lab = f"{_mode_name(mode)} {f}"
                axes[0].plot([x for x, _ in lst], [s.get("decode_tok_s") or 0 for _, s in lst], marker="o", label=lab)
                p99 = [_get(s, "classes.short.tpot_ms_p99") or float("nan") for _, s in lst]
                axes[1].plot([x for x, _ in lst], p99, marker="o", label=lab)
        axes[0].set_ylabel("decode tok/s")
        axes[1].set_ylabel("short TPOT p99 (ms)")
        for ax in axes:
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        files.append("sweep.png")
        fig.savefig(os.path.join(out, files[-1]), dpi=110)
        plt.close(fig)
    if "hol" in summ:  # the head-of-line scenario's phases, as `nelssa bench hol` draws them
        from nelssa.bench import hol
        files.append("hol.png")
        hol.plot(runs, summ["hol"], os.path.join(out, files[-1]))
    return files


# ------------------------------------------------------------------ driver

def _tokenizer(path: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def _model_path(name: str) -> str:
    if name == "smollm2":
        from nelssa.models import prepare_smollm2
        return str(prepare_smollm2())
    if name == "dummy":
        from nelssa.models import make_dummy_model
        return str(make_dummy_model())
    return name


def run(workload: str, preset: dict, out: str, serve: list[str] | None = None,
        endpoints: dict[str, str] | None = None, model: str | None = None, trace_path: str | None = None,
        seed: int = 0, start_timeout: float = 900.0, interval: float = 0.5,
        metrics: dict[str, list[str]] | None = None) -> dict:
    """Run one workload for every mode (starting servers or against endpoints); write the results."""
    os.makedirs(out, exist_ok=True)
    if workload == "growth":  # the on-mode server routes at the growth threshold (and the summary says so)
        preset = {**preset, "nelssa": {**preset["nelssa"], "T_input": preset["growth"]["T_input"]}}
    t_input = int(preset["nelssa"].get("T_input", 2048))
    points, notes = plans(workload, preset, t_input, trace_path, seed)
    modes = list(serve or []) + list((endpoints or {}).keys())
    model_path = _model_path(model or preset["model"]) if serve else model
    runs: dict[str, dict] = {}
    failed: dict[str, str] = {}
    tok = None
    meta = {"workload": workload, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "preset": preset, "T_input": t_input, "points": {n: tr.shares(p) for n, p in points},
            "endpoints": endpoints or {}, "metrics_urls": metrics or {}, "served_modes": serve or [],
            "model": model_path, "notes": notes, "command": " ".join(sys.argv)}
    with open(os.path.join(out, "meta.json"), "w") as f:  # for `nelssa bench merge`, also of a stopped run
        json.dump(meta, f, indent=1)

    def finished() -> dict:  # the summary's meta for the modes run so far
        return {**meta, "failed_modes": failed, "wall_s": {m: r.get("wall_s") for m, r in runs.items()}}
    for mode in modes:
        print(f"[bench] {workload}: mode {mode}", file=sys.stderr, flush=True)
        t = time.time()
        try:
            if serve and mode in serve:
                from nelssa.bench.serving import Server, free_port
                with Server(mode, model_path, preset["nelssa"], preset["server"], free_port(),
                            os.path.join(out, f"server_{mode}.log"), start_timeout, preset.get("env")) as srv:
                    runs[mode], tok = _drive(srv.url, workload, points, preset, tok, model_path, interval,
                                             (metrics or {}).get(mode), partial(save_mode, out, mode))
            else:
                runs[mode], tok = _drive(endpoints[mode], workload, points, preset, tok, model_path, interval,
                                         (metrics or {}).get(mode), partial(save_mode, out, mode))
        except Exception as e:  # noqa: BLE001 - the other modes still run; the invocation fails at the end
            failed[mode] = f"{type(e).__name__}: {e}"[-3000:]
            print(f"[bench] mode {mode} failed after {time.time() - t:.0f} s: {failed[mode]}", file=sys.stderr,
                  flush=True)
            continue
        runs[mode]["wall_s"] = time.time() - t
        save_mode(out, mode, runs[mode])
        if mode != modes[-1]:  # the finished modes' summary now: a run stopped by a time limit still has one
            _write(out, runs, finished())
    return _write(out, runs, finished())


def _write(out: str, runs: dict[str, dict], meta: dict) -> dict:
    summ = summarise(runs, meta)
    summ["plots"] = plot_all(runs, summ, out) if runs else []
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summ, f, indent=1)
    return summ


def merge(out: str, folders: list[str]) -> dict:
    """Results folders of one workload, each with its own modes (e.g. ``--serve on`` and ``--serve off``
    run apart), side by side in ``out``: summary with ratios and plots as ``run`` writes them. Refuses
    folders of different workloads or sweep points, and a mode found in two folders."""
    runs: dict[str, dict] = {}
    metas: list[dict] = []
    failed: dict[str, str] = {}
    for d in folders:
        path = os.path.join(d, "meta.json")
        if not os.path.exists(path):
            path = os.path.join(d, "summary.json")
        if not os.path.exists(path):
            raise ValueError(f"{d}: no meta.json or summary.json (not a `nelssa bench` results folder)")
        with open(path) as f:
            meta = json.load(f)
        for k in ("workload", "points"):
            if metas and meta.get(k) != metas[0].get(k):
                raise ValueError(f"{d}: its {k} differs from {folders[0]}'s; only runs of one plan can be merged")
        metas.append(meta)
        failed.update(meta.get("failed_modes") or {})
        modes = sorted(n[len("requests_"):-len(".jsonl")] for n in os.listdir(d)
                       if n.startswith("requests_") and n.endswith(".jsonl"))
        if not modes:
            raise ValueError(f"{d}: no requests_<mode>.jsonl (the run finished no point)")
        for m in modes:
            if m in runs:
                raise ValueError(f"mode {m} is in more than one folder ({d})")
            runs[m] = load_mode(d, m)
    for m, r in runs.items():
        if set(r["points"]) != set(metas[0]["points"]):
            missing = sorted(set(metas[0]["points"]) - set(r["points"]))
            print(f"[bench] merge: mode {m} finished {len(r['points'])} of {len(metas[0]['points'])} points "
                  f"(missing {', '.join(missing)})", file=sys.stderr)
    os.makedirs(out, exist_ok=True)
    meta = {**metas[0], "merged_from": [os.path.abspath(d) for d in folders],
            "commands": [m.get("command") for m in metas], "failed_modes": failed,
            "served_modes": sorted(runs), "wall_s": {m: r.get("wall_s") for m, r in runs.items()}}
    meta.pop("command", None)
    summ = _write(out, runs, meta)
    for m, r in runs.items():  # the merged folder is a results folder of its own (report, a later merge)
        save_mode(out, m, r)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump({k: v for k, v in meta.items() if k not in ("failed_modes", "wall_s")}, f, indent=1)
    return summ


def merge_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nelssa bench merge", description=merge.__doc__)
    ap.add_argument("folders", nargs="+", help="results folders of `nelssa bench <workload>` runs")
    ap.add_argument("--out", required=True, help="folder for the merged summary and plots")
    a = ap.parse_args(argv)
    try:
        summ = merge(a.out, a.folders)
    except (ValueError, OSError) as e:
        print(f"nelssa bench merge: {e}", file=sys.stderr)
        return 2
    print(_table(summ))
    print(f"[bench] wrote {a.out}/summary.json, {', '.join(summ['plots'])}", file=sys.stderr)
    return 0


def save_mode(out: str, mode: str, run: dict) -> None:
    """One mode's raw results: requests_<mode>.jsonl, metrics_<mode>.jsonl and points_<mode>.json (each
    point's span). Written after every point too, so a run stopped by a time limit keeps its finished
    points (``nelssa bench merge`` reads them back)."""
    for name, rows in ((f"requests_{mode}.jsonl", run["requests"]), (f"metrics_{mode}.jsonl", run["samples"])):
        with open(os.path.join(out, name + ".tmp"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    with open(os.path.join(out, f"points_{mode}.json"), "w") as f:
        json.dump({"points": run["points"], "wall_s": run.get("wall_s")}, f)


def load_mode(folder: str, mode: str) -> dict:
    """save_mode's files read back: {requests, samples, points[, wall_s]}. Points without a spans file
    (results written before it existed) span their requests' first start to last token."""
    def rows(name: str) -> list[dict]:
        with open(os.path.join(folder, name)) as f:
            return [json.loads(line) for line in f if line.strip()]
    run = {"requests": rows(f"requests_{mode}.jsonl"), "samples": rows(f"metrics_{mode}.jsonl")}
    spans = os.path.join(folder, f"points_{mode}.json")
    if os.path.exists(spans):
        with open(spans) as f:
            d = json.load(f)
        run["points"], run["wall_s"] = d["points"], d.get("wall_s")
    else:
        run["points"] = {}
        for r in run["requests"]:
            end = r["stamps"][-1] if r.get("stamps") else r["start"]
            lo, hi = run["points"].get(r["point"], [r["start"], end])
            run["points"][r["point"]] = [min(lo, r["start"]), max(hi, end)]
    # only the points that finished: a stopped run's unfinished point has no span end yet
    run["requests"] = [r for r in run["requests"] if r["point"] in run["points"]]
    return run


def _drive(url: str, workload: str, points, preset, tok, model_path, interval,
           metrics_urls: list[str] | None = None, on_point=None) -> tuple[dict, Any]:
    from nelssa.bench.serving import endpoint_model, replay
    mid, root = endpoint_model(url)
    if tok is None:
        tok = _tokenizer(model_path or root or mid)
    prompts, k = {}, 0
    for _, plan in points:
        for r in plan:
            prompts[r["id"]] = prompt_ids(tok, r["n_in"], k, preset.get("prompts", "random"))
            k += 1
    res = asyncio.run(replay(url, mid, points, prompts, metrics_urls, interval=interval,
                             label=f"{workload}:{url.split(':')[-1]}", on_point=on_point))
    return res, tok


def _table(summ: dict) -> str:
    f = (lambda v, d=1: "-" if v is None else f"{v:,.{d}f}")  # noqa: E731
    rows = []
    for mode, pts in summ["modes"].items():
        for name, st in pts.items():
            for k, c in st["classes"].items():
                rows.append(f"{mode:>3} {name:<22} {k:<7} n {c['ok']}/{c['n']}  TTFT p50/p99 {f(c['ttft_ms_p50'])}/"
                            f"{f(c['ttft_ms_p99'])} ms  TPOT p50/p95/p99 {f(c['tpot_ms_p50'])}/{f(c['tpot_ms_p95'])}/"
                            f"{f(c['tpot_ms_p99'])} ms")
            rows.append(f"{mode:>3} {name:<22} decode {f(st.get('decode_tok_s'))} tok/s  running max "
                        f"{f(st.get('running_max'), 0)}  waiting max {f(st.get('waiting_max'), 0)}  KV max "
                        f"{f(100 * st['kv_usage_max'] if st.get('kv_usage_max') is not None else None, 0)}%  "
                        f"preemptions {preemptions_text(st, f)}")
            nel = st.get("nelssa") or {}
            moves = {k: nel.get(f"nelssa:{k}_total") for k in ("long_requests", "migrations_completed", "recalls")}
            if any(moves.values()):  # the host tier's part in it: long requests, migrations, recalls
                rows.append(f"{mode:>3} {name:<22} host tier: long {f(moves['long_requests'], 0)}  migrated "
                            f"{f(moves['migrations_completed'], 0)}  recalled {f(moves['recalls'], 0)}")
    for mode, a in summ.get("hol", {}).items():
        for ph in ("before", "long_prefill", "long_decode"):
            x = a[ph]
            gap = x["max_gap_without_short_token_s"]
            rows.append(f"{mode:>3} hol {ph:<12} short TTFT p50/p99 {f(x['short_ttft_p50_ms'])}/{f(x['short_ttft_p99_ms'])} ms"
                        f"  ITL p50/p99 {f(x['short_itl_p50_ms'])}/{f(x['short_itl_p99_ms'])} ms  longest gap "
                        f"{f(gap, 2)} s")
        rows.append(f"{mode:>3} hol long " + ", ".join(f"{x['id']} TTFT {f(x['ttft_s'], 2)} s TPOT {f(x['tpot_ms'])} ms"
                                                     for x in a["long"]) + f"; residency targets {a['residency_targets']}")
    for name, r in summ.get("ratios_on_over_off", {}).items():
        rows.append(f"on/off {name}: " + ", ".join(f"{k} {f(v, 2)}" for k, v in r.items() if v is not None))
    return "\n".join(rows)


def _override(d: dict, items: list[str]) -> dict:
    d = json.loads(json.dumps(d))
    for item in items:
        k, _, v = item.partition("=")
        try:
            val = json.loads(v)
        except json.JSONDecodeError:
            val = v
        cur = d
        parts = k.split(".")
        for p in parts[:-1]:
            if p not in cur or not isinstance(cur[p], dict):
                raise SystemExit(f"--set {item}: unknown key {k!r}")
            cur = cur[p]
        if parts[-1] not in cur:
            raise SystemExit(f"--set {item}: unknown key {k!r}; known here: {sorted(cur)}")
        cur[parts[-1]] = val
    return d


def check_workload(workload: str, p: dict) -> None:
    """A preset's section of ``workload`` (after --set) and its NELSSA config: ValueError naming the bad
    value, before any server starts."""
    w = p[workload]

    def num(key, lo, integer=True):
        require_number(f"{workload}.{key}", w.get(key), lo, integer=integer)

    if workload in ("single-long", "multi-long"):
        for k in ("n_in", "n_out") + (("n",) if workload == "multi-long" else ()):
            num(k, 1)
    elif workload == "growth":
        num("n", 1), num("n_in", 1), num("T_input", 1), num("rate", 0, integer=False)
    elif workload == "mixed":
        num("n", 1), num("min_output", 1), num("max_output", w.get("min_output", 1))
        for key, ok in (("rates", lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0),
                        ("long_fractions", lambda x: x is None or (isinstance(x, (int, float))
                                                                    and not isinstance(x, bool) and 0 <= x <= 1))):
            v = w.get(key)
            if not isinstance(v, list) or not v or not all(ok(x) for x in v):
                raise ValueError(f"mixed.{key}: a non-empty list of "
                                 f"{'rates > 0' if key == 'rates' else 'fractions in [0, 1] or null'}, got {v!r}")
    elif workload == "hol-http":
        from nelssa.bench.hol import Scenario
        Scenario(**w)  # its own checks
    require_number("max_model_len", p.get("max_model_len"), 1, integer=True)
    if not isinstance(p.get("nelssa"), dict):
        raise ValueError(f"nelssa: a JSON object expected, got {p.get('nelssa')!r}")
    from nelssa.config import load_config
    load_config({"nelssa": p["nelssa"]}, env={})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nelssa bench <workload>", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workload", choices=WORKLOADS)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--serve", default=None, help="start `nelssa serve` per mode, e.g. on,off (default when no "
                                                   "--endpoints)")
    ap.add_argument("--endpoints", default=None, help="existing servers/proxies: on=http://host:8000,off=http://...")
    ap.add_argument("--metrics", default=None, help="/metrics URLs per mode when not the endpoint's own (e.g. the "
                                                     "decode instance behind a proxy): on=URL[+URL],off=URL")
    ap.add_argument("--model", default=None, help="model path (default: the preset's)")
    ap.add_argument("--trace", default=None, help="Mooncake-format JSONL (default ../shared/data/mooncake/"
                                                   "conversation_trace.jsonl or NELSSA_TRACE)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a preset value, e.g. --set mixed.rates=[0.5,1] --set 'nelssa={\"budget\": 0.1}' "
                         "--set single-long.n_in=3000")
    ap.add_argument("--server-arg", action="append", default=[], help="extra argument for `nelssa serve` (repeat)")
    ap.add_argument("--out", default=None, help="results folder (default results/<UTC time>-<workload>)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--interval", type=float, default=0.5, help="seconds between /metrics samples")
    a = ap.parse_args(argv)
    preset = _override(PRESETS[a.preset], a.set)
    try:
        check_workload(a.workload, preset)
    except (TypeError, ValueError) as e:  # (TypeError: a hol-http field Scenario does not have)
        ap.error(str(e))
    preset["server"] = list(preset["server"]) + a.server_arg
    endpoints = dict(x.split("=", 1) for x in a.endpoints.split(",")) if a.endpoints else None
    serve = [m.strip() for m in a.serve.split(",")] if a.serve else (None if endpoints else ["on", "off"])
    if serve and any(m not in ("on", "off") for m in serve):
        ap.error(f"--serve modes are on and off, got {serve}")
    out = a.out or os.path.join("results", time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{a.workload}")
    metrics = {k: v.split("+") for k, v in (x.split("=", 1) for x in a.metrics.split(","))} if a.metrics else None
    summ = run(a.workload, preset, out, serve, endpoints, a.model, a.trace, a.seed, a.start_timeout, a.interval,
               metrics)
    print(_table(summ))
    print(f"[bench] wrote {out}/summary.json, requests_<mode>.jsonl, metrics_<mode>.jsonl, {', '.join(summ['plots'])}"
          f"; `nelssa bench report {out}` renders report.md", file=sys.stderr)
    if summ["failed_modes"]:
        print(f"[bench] failed modes: {summ['failed_modes']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
