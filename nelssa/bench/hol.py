"""Head-of-line benchmark: short requests at a Poisson rate, long requests injected mid-run, KV limited.

    nelssa bench hol --dummy --out results/hol                # the H200 scenario (defaults below)
    nelssa bench hol --model DIR --preset cpu --out DIR       # the scaled-down CPU run (CI)

One invocation runs every mode (``on``: NELSSA, ``off``: stock vLLM, the NELSSA_OFF baseline; ``on:NAME``:
NELSSA with ``--variant NAME=JSON`` over its config) as its own subprocess with the same arrivals and prompts, each through vLLM's AsyncLLM (async scheduling,
CUDA graphs: whatever vLLM picks), recording every token's arrival time. Per mode and phase:
  * before       -- from the start until the long requests arrive;
  * long_prefill -- from their arrival until every long request has its first token;
  * long_decode  -- from then until the last long request finishes;
short requests' TTFT (by arrival) and inter-token latency (by token time) p50/p99, their TPOT, the
longest time without any short-request token; long requests' TTFT/TPOT; output tok/s over the run;
vLLM's preemptions and KV usage; NELSSA's host-tier counters (from the front end's Prometheus
registry, where the NELSSA connector's metrics land). Writes ``hol.json`` (summary, NELSSA/OFF
ratios, the targets of issue 9 checked), ``hol_<mode>.jsonl`` (per request), ``hol_<mode>.log``
(the engine's log) and ``hol.png``.

Defaults are the H200 scenario: short 1K in / 128 out at 8 req/s for 60 s, two 100K-token requests
at t = 20 s, Llama-3.1-8B-shaped dummy weights, gpu_memory_utilization 0.27 (KV ~ 187K tokens),
prefix caching off, greedy with ignore_eos; NELSSA T_input 8192, budget 4%.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from nelssa.bench import gpustate
from nelssa.bench.common import metric_key
from nelssa.bench.common import pct as _pct
from nelssa.bench.common import prompt_ids
from nelssa.bench.common import require_number, run_metrics
from nelssa.bench.common import ratio as _ratio

PRESETS: dict[str, dict[str, Any]] = {
    "h200": {},
    # the H200 scenario's KV on an 80-GB GPU (H100): 11,700 blocks of 16 (187,200 tokens, both modes);
    # util 0.27 would leave ~3 GB of KV there (H100 runs of 2026-12-05)
    "h100": dict(util=0.6, kv_blocks=11700),
    # SmolLM2 on 2 CPU cores: a few short requests around one long prompt that does not fit beside
    # the others' KV in stock vLLM's way of admitting it; budget 1.0 so outputs must be equal. The long
    # request decodes from its device blocks until its prompt's hand-off completes (about as long as 24
    # of its tokens on a 2-core Intel Xeon, 64-80 on a 2-core AMD EPYC without AMX), then from the lane:
    # 192 tokens leave room for both.
    "cpu": dict(rate=1.5, duration=10.0, short_in=96, short_out=12, long_at=3.0, n_long=1, long_len=2600,
                long_out=192, prompts="text", dtype="float32", util=0.5, kv_blocks=28, max_model_len=3200,
                max_num_seqs=16, max_num_batched_tokens=1024, long_prefill_token_threshold=512,
                enforce_eager=True, load_format="auto",
                nelssa={"T_input": 2048, "budget": 1.0, "chunk": 128, "defer_below": 0}),  # the host path, whatever the room
}


MOVE_PARTS = ("read", "kmeans", "pack", "store")  # a move's time by part (vllm_plugin/handoff.py)
THREAD_STATES = ("cpu", "runq", "blocked")  # a move's time by its thread's state (handoff.thread_clock)
CALL_PARTS = ("prep", "fork", "tables", "items", "wait", "combine")  # a local host call by part (KernelSplit)
COMM_PARTS = ("copy", "wire", "dispatch")  # a node call's communication by part (node/local.py call_results)
TIMELINE_PARTS = ("lead", "host", "between", "tail")  # a lane batch's time by part (vllm_plugin/lane_host.py, 7)
BESIDE = ("0", "1-15", "16-47", "48+")  # lane batches by the requests of the steps beside them (vllm_plugin/lane.py)


@dataclass
class Scenario:
    rate: float = 8.0                  # short requests per second (Poisson)
    duration: float = 60.0             # seconds of short arrivals
    short_in: int = 1000
    short_out: int = 128
    long_at: float = 20.0              # seconds: the long requests arrive together
    n_long: int = 2
    long_len: int = 100_000
    long_out: int = 256
    seed: int = 0
    prompts: str = "random"            # random token ids | text (real text, for equal-output checks)
    # engine (both modes alike)
    dtype: str = "bfloat16"
    util: float | None = 0.27          # gpu_memory_utilization (None: leave vLLM's default)
    kv_blocks: int | None = None       # num_gpu_blocks_override (CPU runs; the h100 preset)
    max_model_len: int = 131072
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 2048  # vLLM's cap on a long prompt's chunk per step
    enforce_eager: bool = False
    load_format: str = "dummy"
    # NELSSA's configuration as measured on the H200 (README, docs/results.md): the long lane on, a host
    # tier of 64 GiB (the lent H200 VM has 128 GiB); --set nelssa=... replaces all of it
    nelssa: dict = field(default_factory=lambda: {"T_input": 8192, "budget": 0.04, "host_capacity": "64GiB",
                                                  "lane": True})
    # diagnostics: vLLM's torch profiler (CPU + CUDA, every thread of the engine core) from this second
    # of the run for profile_s seconds; trace and key-average table land in <out>/profile_<mode>/
    profile_at: float | None = None
    profile_s: float = 1.0
    # ... or from this many seconds into the long decode phase (every long request has its first token),
    # whenever that comes: e.g. the lane with nothing beside it (rate 0.05, duration 1) without guessing
    # when the long prefills end
    profile_decode_s: float | None = None

    def __post_init__(self) -> None:
        """Bad values are refused here, before any engine starts (ValueError naming the field)."""
        def num(name, lo, **kw):
            require_number(f"scenario field {name}", getattr(self, name), lo, **kw)
        for name in ("rate", "duration", "profile_s"):
            num(name, 0, strict=True)
        num("long_at", 0)
        num("profile_at", 0, none=True)
        num("profile_decode_s", 0, none=True)
        if self.profile_at is not None and self.profile_decode_s is not None:
            raise ValueError("scenario fields profile_at and profile_decode_s: one of them, not both")
        if self.profile_decode_s is not None and not self.n_long:
            raise ValueError("scenario field profile_decode_s: there is no long decode phase without long requests")
        for name in ("short_in", "short_out", "long_len", "long_out", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens", "long_prefill_token_threshold"):
            num(name, 1, integer=True)
        num("n_long", 0, integer=True)
        num("seed", 0, integer=True)
        num("kv_blocks", 1, integer=True, none=True)
        num("util", 0, none=True, strict=True)
        if self.util is not None and self.util > 1:
            raise ValueError(f"scenario field util: at most 1, got {self.util!r}")
        if self.prompts not in ("random", "text"):
            raise ValueError(f"scenario field prompts: 'random' or 'text', got {self.prompts!r}")
        if not isinstance(self.nelssa, dict):
            raise ValueError(f"scenario field nelssa: a JSON object expected, got {self.nelssa!r}")
        from nelssa.config import load_config
        load_config({"nelssa": self.nelssa}, env={})  # its own checks (unknown keys, ranges)


# ------------------------------------------------------------------ one mode (subprocess)

def _arrivals(sc: Scenario) -> list[dict]:
    rng = random.Random(sc.seed)
    reqs, t, i = [], 0.0, 0
    while t < sc.duration:
        reqs.append({"id": f"s{i}", "kind": "short", "at": t, "n_in": sc.short_in, "n_out": sc.short_out})
        i += 1
        t += rng.expovariate(sc.rate)
    for j in range(sc.n_long):
        reqs.append({"id": f"long{j}", "kind": "long", "at": sc.long_at, "n_in": sc.long_len, "n_out": sc.long_out})
    return sorted(reqs, key=lambda r: r["at"])


def _prompt_ids(sc: Scenario, tok, r: dict, k: int) -> list[int]:
    return prompt_ids(tok, r["n_in"], k, sc.prompts, sc.seed)


SAMPLED = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
           "vllm:num_preemptions_total")


def _scrape(names: tuple[str, ...] | None = None) -> dict[str, float]:
    """vLLM and NELSSA metrics of this (front-end) process, summed over label sets except "part", "path",
    "outcome" and "beside" (kept as name{part}: common.metric_key); ``names``: these samples only. The run's
    sampler reads SAMPLED alone, every 0.25 s in the loop that stamps the tokens: the whole registry took
    3.3 ms with NELSSA's metrics against 2.0 for stock vLLM on the 2-vCPU box, a gap in every stream."""
    from prometheus_client import REGISTRY
    out: dict[str, float] = {}
    for fam in (REGISTRY if names is None else REGISTRY.restricted_registry(names)).collect():
        if fam.name.startswith(("vllm:", "nelssa:")):
            for s in fam.samples:
                name = metric_key(s.name, s.labels)
                out[name] = out.get(name, 0.0) + float(s.value)
    return out


async def _run_mode(mode: str, sc: Scenario, model: str, out_dir: str = "") -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from nelssa.vllm_plugin import engine_args
    kw: dict[str, Any] = dict(model=model, load_format=sc.load_format, dtype=sc.dtype, max_model_len=sc.max_model_len,
                              enable_prefix_caching=False, max_num_seqs=sc.max_num_seqs,
                              max_num_batched_tokens=sc.max_num_batched_tokens,
                              long_prefill_token_threshold=sc.long_prefill_token_threshold,
                              enforce_eager=sc.enforce_eager, disable_log_stats=False, seed=0)
    if sc.util is not None:
        kw["gpu_memory_utilization"] = sc.util
    if sc.kv_blocks is not None:
        kw["num_gpu_blocks_override"] = sc.kv_blocks
    if mode == "on":
        kw.update(engine_args(sc.nelssa))
    profiling = sc.profile_at is not None or sc.profile_decode_s is not None
    if profiling:
        from vllm.config import ProfilerConfig
        kw["profiler_config"] = ProfilerConfig(profiler="torch", torch_profiler_dir=os.path.abspath(
            os.path.join(out_dir, f"profile_{mode}")), torch_profiler_with_stack=False, ignore_frontend=True)
    eng = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    tok = eng.tokenizer if getattr(eng, "tokenizer", None) is not None else await eng.get_tokenizer()
    plan = _arrivals(sc)
    prompts = {r["id"]: _prompt_ids(sc, tok, r, k) for k, r in enumerate(plan)}

    decoding = asyncio.Event()  # every long request has its first token: the long decode phase
    firsts: set[str] = set()

    async def one(r: dict, t0: float, rec: list | None) -> None:
        sp = SamplingParams(temperature=0, max_tokens=r["n_out"], ignore_eos=True)
        start, stamps, ids, finish, last = time.perf_counter() - t0, [], [], None, None
        async for out in eng.generate({"prompt_token_ids": prompts[r["id"]]}, sp, request_id=r["id"]):
            last = out
            o = out.outputs[0]
            now = time.perf_counter() - t0
            stamps.extend([now] * (len(o.token_ids) - len(ids)))
            ids = list(o.token_ids)
            finish = o.finish_reason
            if rec is not None and r["kind"] == "long" and ids and r["id"] not in firsts:
                firsts.add(r["id"])
                if len(firsts) == sc.n_long:
                    decoding.set()
        if rec is not None:
            rec.append({**r, "start": start, "stamps": stamps, "token_ids": ids, "finish_reason": finish,
                        "n_prompt": len(prompts[r["id"]]), "scheduled": scheduled_at(last, t0)})

    # warm-up (not recorded): one short request through the whole path
    prompts["warmup"] = prompts[plan[0]["id"]]
    await one({"id": "warmup", "kind": "short", "at": 0, "n_in": sc.short_in, "n_out": 4}, time.perf_counter(), None)
    base = _scrape()
    recs: list[dict] = []
    samples: list[dict] = []
    t0 = time.perf_counter()
    gpu = gpustate.Sampler(t0)  # the device's clocks beside the run (gpustate.py); nothing without NVML
    done = asyncio.Event()

    async def sampler() -> None:
        last = 0.0
        while not done.is_set():
            m = _scrape(SAMPLED)
            now = time.perf_counter() - t0
            samples.append({"t": now, "kv_usage": m.get("vllm:kv_cache_usage_perc", 0.0),
                            "running": m.get("vllm:num_requests_running", 0.0),
                            "waiting": m.get("vllm:num_requests_waiting", 0.0),
                            "preemptions": m.get("vllm:num_preemptions_total", 0.0)
                            - base.get("vllm:num_preemptions_total", 0.0)})
            if now - last >= 5:
                last = now
                print(f"[hol:{mode}] t={now:5.1f}s finished {len(recs)}/{len(plan)} running "
                      f"{samples[-1]['running']:.0f} waiting {samples[-1]['waiting']:.0f} "
                      f"kv {100 * samples[-1]['kv_usage']:.0f}% preemptions {samples[-1]['preemptions']:.0f}",
                      file=sys.stderr, flush=True)
            await asyncio.sleep(0.25)

    async def profile() -> None:
        if sc.profile_at is not None:
            await asyncio.sleep(max(0.0, sc.profile_at - (time.perf_counter() - t0)))
        else:
            await decoding.wait()
            await asyncio.sleep(sc.profile_decode_s)
        print(f"[hol:{mode}] profiling {sc.profile_s:.1f} s from t={time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
        await eng.start_profile()
        await asyncio.sleep(sc.profile_s)
        await eng.stop_profile()

    smp = asyncio.create_task(sampler())
    prof = asyncio.create_task(profile()) if profiling else None
    tasks = []
    for r in plan:
        await asyncio.sleep(max(0.0, r["at"] - (time.perf_counter() - t0)))
        tasks.append(asyncio.create_task(one(r, t0, recs)))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    if prof is not None:
        if sc.profile_at is None and not decoding.is_set():
            prof.cancel()  # no long decode phase came (its requests failed): nothing to profile
        with contextlib.suppress(asyncio.CancelledError):
            await prof
    done.set()
    await smp
    gpu_samples = gpu.stop()
    await asyncio.sleep(1.5)  # let the last iteration stats reach the registry
    end = _scrape()
    eng.shutdown()
    delta = run_metrics(base, end, lambda k: "_created" not in k and (k.endswith(("_total", "_sum", "_count"))
                                                                       or k.startswith("nelssa:")))
    return {"mode": mode, "wall_s": wall, "t0_perf": t0, "requests": recs, "samples": samples, "metrics": delta,
            "block_size": eng.vllm_config.cache_config.block_size, "gpu": gpu_samples,
            "v2_model_runner": _v2_runner(eng.vllm_config)}


def _v2_runner(cfg) -> bool | None:
    """Whether the engine ran vLLM's V2 model runner (VllmConfig.use_v2_model_runner); None where this vLLM
    cannot say."""
    try:
        return bool(cfg.use_v2_model_runner)
    except Exception:  # noqa: BLE001 - a diagnostic field; the run's results stand without it
        return None


def _worker(spec: dict) -> None:
    sc = Scenario(**spec["scenario"])
    res = asyncio.run(_run_mode(spec["mode"], sc, spec["model"], spec.get("out_dir", "")))
    print("HOL_JSON " + json.dumps(res), flush=True)


# ------------------------------------------------------------------ analysis

def scheduled_at(out, t0: float) -> float | None:
    """When vLLM first scheduled the request (its first prefill chunk), on the run's clock: the engine core's
    ``scheduled_ts`` (time.monotonic there, in its own process) from the request's last output's stats
    (AsyncLLM with log stats) less ``t0`` (time.perf_counter here: on Linux both are CLOCK_MONOTONIC, the
    clock the hol stamps and the engine logs share). None without stats. A long request's TTFT is then its
    wait for admission (NELSSA holds it outside vLLM's queue until it has room; stock vLLM queues it) plus its
    prefill (``long_split``)."""
    m = getattr(out, "metrics", None)
    ts = getattr(m, "scheduled_ts", 0.0) if m is not None else 0.0
    return ts - t0 if ts else None


def long_split(r: dict) -> dict:
    """A long request's TTFT split at its first scheduling (``scheduled_at``): admitted_s (arrival to first
    scheduled) and prefill_s (to its first token); None where the request has no stamp or no stats."""
    t = r.get("scheduled")
    if t is None or not r["stamps"]:
        return {"admitted_s": None, "prefill_s": None}
    return {"admitted_s": t - r["start"], "prefill_s": r["stamps"][0] - t}


_COMPILE_LOADED = "Directly load the compiled graph"
_COMPILE_TOOK = re.compile(r"torch\.compile took ([0-9.]+) s in total")


def compile_source(lines: list[str]) -> dict | None:
    """From a mode's engine log: whether vLLM compiled the model afresh or loaded it from its torch.compile
    cache (a machine kept warm between invocations keeps it), and the seconds it took -> {"cached", "s"}; None
    where the log says neither (eager mode). On one warm H100, three of four modes that loaded from the
    cache ran their before phase slower than the four that compiled (runs 116-118), also the machine's
    last runs: recorded so runs can be compared on it."""
    took = next((m for m in map(_COMPILE_TOOK.search, lines) if m), None)
    if took is None:
        return None
    return {"cached": any(_COMPILE_LOADED in x for x in lines), "s": float(took.group(1))}


def longest_gap(stamps: list[float]) -> dict | None:
    """A long request's longest inter-token gap: s, after_token (the index of the token before it) and the
    request's TPOT without it (ms). The first request's switch hold (scheduler._switch_waits: a prompt done
    prefilling waits, without a token, for the last of its hand-off and its first lane batch) is one such
    gap of 1.2-1.5 s on the H100 (hol runs 116-118), 5-6 ms of a 256-token request's TPOT: this tells it
    apart from the lane's per-token time. None with fewer than two tokens."""
    if len(stamps) < 2:
        return None
    i = max(range(len(stamps) - 1), key=lambda j: stamps[j + 1] - stamps[j])
    g = stamps[i + 1] - stamps[i]
    rest = len(stamps) - 2
    return {"s": g, "after_token": i,
            "tpot_ms_without": 1e3 * (stamps[-1] - stamps[0] - g) / rest if rest else None}


def itl_by_phase(stamps: list[float], phases: dict) -> dict[str, dict]:
    """A long request's inter-token latency in each phase its tokens fall in (by the later token's time):
    n, p50, mean, max in ms. A long request's TPOT mixes the tokens it decodes beside the other's prefill
    with those after; this tells them apart."""
    out = {}
    for name, (lo, hi) in phases.items():
        itl = [1e3 * (b - a) for a, b in zip(stamps, stamps[1:]) if lo <= b < hi or (name == "long_decode" and b == hi)]
        if itl:
            out[name] = {"n": len(itl), "p50": _pct(itl, 50), "mean": sum(itl) / len(itl), "max": max(itl)}
    return out


def itl_by_block_slot(stamps: list[float], n_prompt: int, block_size: int) -> dict[str, dict] | None:
    """A request's inter-token latency split by where the position it computed falls in its KV block: gap i
    (token i to i + 1) computes position ``n_prompt + i``; "first" when that is a block's first slot, "other"
    for the rest (n, p50, mean in ms). The lane's drafts run only in allocated slots, so a chain short of
    slots stops at block boundaries (H200 hol run 84: the first long request's gap after one 90 ms, 50 ms
    elsewhere; spec.NelssaManager.ahead). Gap 0 is kept apart as "switch": from the prefill's token to the
    first decoded one, a host-backed request's switch and its first lane batch (0.2-0.5 s, which in "first"
    would move its mean by ~20 ms at 100K tokens). None without a block size."""
    if not block_size:
        return None
    parts: dict[str, list[float]] = {"switch": [], "first": [], "other": []}
    for i, (a, b) in enumerate(zip(stamps, stamps[1:])):
        key = "switch" if i == 0 else "first" if (n_prompt + i) % block_size == 0 else "other"
        parts[key].append(1e3 * (b - a))
    return {k: {"n": len(v), "p50": _pct(v, 50), "mean": sum(v) / len(v)} for k, v in parts.items() if v}


def _in_window(shorts: list[dict], lo: float, hi: float) -> tuple[list[float], list[tuple[float, float]]]:
    """Short requests' TTFTs (ms) of arrivals in [lo, hi), and their inter-token gaps (the later token's
    time, ms) ending in it."""
    ttft = [1e3 * (r["stamps"][0] - r["start"]) for r in shorts if lo <= r["start"] < hi]
    itl_at = [(b, 1e3 * (b - a)) for r in shorts for a, b in zip(r["stamps"], r["stamps"][1:]) if lo <= b < hi]
    return ttft, itl_at


def itl_steps(shorts: list[dict], lo: float, hi: float, n: int = 8, join_s: float = 0.002) -> dict:
    """The engine steps behind a phase's short-request ITLs: gaps ending less than ``join_s`` apart came
    with one engine output (one step; the front end stamps its requests one after another). The ``n`` longest steps as [seconds into the phase, ms (the
    longest gap of the step), gaps (short requests that waited on it), first tokens (short requests whose
    first token came with it: their prompts' last chunks ran in it; the engine log's step lines, config
    ``stall_log_ms``, have every step's tokens)], and ``p99_steps``: how many of the longest steps hold the phase's top 1%
    of gaps. A step delays every request decoding in it, so with ~50 decoding requests the p99 of ~12,000
    gaps is the third-longest step: one step with two prompts moves it (H100 hol runs 110-113,
    docs/results.md)."""
    _, itl_at = _in_window(shorts, lo, hi)
    firsts = sorted(r["stamps"][0] for r in shorts if lo <= r["stamps"][0] < hi)
    steps: list[list] = []  # [first stamp, longest gap, gaps, last stamp]
    for b, x in sorted(itl_at):
        if steps and b - steps[-1][3] <= join_s:
            steps[-1][1], steps[-1][2], steps[-1][3] = max(steps[-1][1], x), steps[-1][2] + 1, b
        else:
            steps.append([b, x, 1, b])
    if not steps:
        return {"p99_steps": None, "worst": []}
    worst = sorted(steps, key=lambda s: -s[1])
    need, k, held = max(1, -(-len(itl_at) // 100)), 0, 0
    while held < need:
        held += worst[k][2]
        k += 1
    prompts = lambda a, b: bisect.bisect_right(firsts, b + join_s) - bisect.bisect_left(firsts, a - join_s)  # noqa: E731
    return {"p99_steps": k, "worst": [[round(a - lo, 3), round(x, 1), c, prompts(a, b)] for a, x, c, b in worst[:n]]}


def p99_from(shorts: list[dict], lo: float, hi: float, skips=(0.25, 0.5, 1.0)) -> dict[str, dict]:
    """A phase's short-request TTFT p99 (arrivals) and ITL p99 (gaps, by the later token) counted from
    ``skip`` seconds into it on, for each skip: where its p99 comes from a few slow steps at its start
    (the long decode phase: the steps right after the last long prompt's prefill; H100 run of
    2026-12-05: ITL p99 99.9 ms over the phase, 44.0 from 0.5 s on). A diagnostic beside the phase's own
    numbers, which the targets use."""
    out = {}
    for skip in skips:
        ttft, itl_at = _in_window(shorts, lo + skip, hi)
        itl = [x for _, x in itl_at]
        out[f"{skip:g}"] = {"short_ttft_p99_ms": _pct(ttft, 99), "short_itl_p99_ms": _pct(itl, 99),
                            "n_arrivals": len(ttft), "n_gaps": len(itl)}
    return out


def _us_per_call(m: dict, name: str, parts: tuple, count: str) -> dict | None:
    """A per-part counter's growth over the run (``name{part}``) as mean us per call of ``count``; None
    without calls or without any of the parts."""
    n = m.get(count)
    got = {p: 1e6 * m[f"{name}{{{p}}}"] / n for p in parts if f"{name}{{{p}}}" in m} if n else {}
    return got or None


def analyse(run: dict) -> dict:
    recs = run["requests"]
    shorts = [r for r in recs if r["kind"] == "short" and r["stamps"]]
    longs = [r for r in recs if r["kind"] == "long"]
    if longs and all(r["stamps"] for r in longs):
        t_arr = min(r["start"] for r in longs)
        t_first = max(r["stamps"][0] for r in longs)
        t_end = max(r["stamps"][-1] for r in longs)
    else:
        t_arr = t_first = t_end = float("inf")
    phases = {"before": (0.0, t_arr), "long_prefill": (t_arr, t_first), "long_decode": (t_first, t_end)}
    all_stamps = sorted(t for r in shorts for t in r["stamps"])
    out: dict[str, Any] = {"phases_s": {k: [a, b] for k, (a, b) in phases.items()}}
    for name, (lo, hi) in phases.items():
        ttft, itl_at = _in_window(shorts, lo, hi)
        itl = [x for _, x in itl_at]
        tpot = [1e3 * (r["stamps"][-1] - r["stamps"][0]) / (len(r["stamps"]) - 1) for r in shorts
                if len(r["stamps"]) > 1 and lo <= r["stamps"][0] and r["stamps"][-1] < hi]
        inside = [t for t in all_stamps if lo <= t < hi]
        end = min(hi, all_stamps[-1] if all_stamps else hi)  # no short token after the last one: no gap
        gap_at = [(a, b - a) for a, b in zip([lo] + inside, inside + [end])] if end > lo else []
        gaps = [g for _, g in gap_at]
        out[name] = {"short_ttft_p50_ms": _pct(ttft, 50), "short_ttft_p99_ms": _pct(ttft, 99),
                     "short_itl_p50_ms": _pct(itl, 50), "short_itl_p99_ms": _pct(itl, 99),
                     "short_tpot_p50_ms": _pct(tpot, 50), "short_tpot_p99_ms": _pct(tpot, 99),
                     "max_gap_without_short_token_s": max(gaps) if gaps and hi != float("inf") else None,
                     "n_short_arrivals": len(ttft), "n_short_tokens": len(inside),
                     # where the worst waits are: (seconds into the phase, ms), the 8 longest ITLs and TTFTs
                     "short_itl_worst": [[round(t - lo, 3), round(x, 1)] for t, x in sorted(itl_at, key=lambda p: -p[1])[:8]],
                     # the longest times without any short token: (start, seconds into the phase; ms)
                     "short_gaps_worst": [[round(t - lo, 3), round(1e3 * g, 1)] for t, g in sorted(gap_at, key=lambda p: -p[1])[:8]],
                     "short_ttft_worst": [[round(r["start"] - lo, 3), round(1e3 * (r["stamps"][0] - r["start"]), 1)]
                                          for r in sorted((r for r in shorts if lo <= r["start"] < hi),
                                                          key=lambda r: r["start"] - r["stamps"][0])[:8]],
                     "itl_steps": itl_steps(shorts, lo, hi)}
    lo, hi = phases["long_decode"]
    if hi != float("inf"):
        out["long_decode"]["from_s"] = p99_from(shorts, lo, hi)
    # the run's time 0 on time.perf_counter (system-wide on Linux): engine logs that print perf_counter
    # stamps (the NELSSA watchdog and lane) line up with the phases
    out["t0_perf"] = run.get("t0_perf")
    out["long"] = [{"id": r["id"], "ttft_s": (r["stamps"][0] - r["start"]) if r["stamps"] else None,
                    "tpot_ms": 1e3 * (r["stamps"][-1] - r["stamps"][0]) / max(1, len(r["stamps"]) - 1)
                    if len(r["stamps"]) > 1 else None, "tokens": len(r["stamps"]), "finish": r["finish_reason"],
                    **long_split(r), "longest_gap": longest_gap(r["stamps"]),
                    "itl_ms_by_phase": itl_by_phase(r["stamps"], phases),
                    "itl_ms_by_block_slot": itl_by_block_slot(r["stamps"], r.get("n_prompt", r.get("n_in", 0)),
                                                              run.get("block_size"))}
                   for r in longs]
    toks = sum(len(r["stamps"]) for r in recs)
    last = max((r["stamps"][-1] for r in recs if r["stamps"]), default=run["wall_s"])
    out["output_tok_s"] = toks / last if last > 0 else None
    out["errors"] = sorted(r["id"] for r in recs if r["finish_reason"] not in ("length", "stop"))
    m = run["metrics"]
    out["preemptions"] = m.get("vllm:num_preemptions_total")
    out["kv_usage_max"] = max((s["kv_usage"] for s in run["samples"]), default=None)
    out["preempted_at_s"] = preempted_at(run["samples"])
    out["nelssa"] = {k: v for k, v in m.items() if k.startswith("nelssa:")}
    # through nelssa-node: the share of the long lane's batches (one token of every long request: their
    # decode step) spent in communication, i.e. layer calls' round trips outside the node's kernels
    comm, batch = m.get("nelssa:node_comm_seconds_sum"), m.get("nelssa:lane_batch_seconds_sum")
    out["node_comm_share_of_lane_batch"] = comm / batch if comm is not None and batch else None
    # in-process host calls by part, and the node calls' communication by part: mean us per call
    out["host_call_split_us_per_call"] = _us_per_call(m, "nelssa:host_call_split_seconds_total", CALL_PARTS,
                                                      "nelssa:host_attention_seconds_count")
    out["node_comm_split_us_per_call"] = _us_per_call(m, "nelssa:node_comm_split_seconds_total", COMM_PARTS,
                                                      "nelssa:node_comm_seconds_count")
    # where a move's time goes (handoff.py): mean seconds per move, by part (on P/D: P's moves)
    nm = m.get("nelssa:clustering_seconds_count")
    out["move_split_s_per_move"] = {
        p: m[f"nelssa:move_split_seconds_total{{{p}}}"] / nm for p in MOVE_PARTS
        if f"nelssa:move_split_seconds_total{{{p}}}" in m} if nm else None
    # the hand-off thread's state during those moves (handoff.thread_clock): mean seconds per move
    out["move_thread_s_per_move"] = {
        p: m[f"nelssa:move_thread_seconds_total{{{p}}}"] / nm for p in THREAD_STATES
        if f"nelssa:move_thread_seconds_total{{{p}}}" in m} if nm else None
    # where a lane batch's time goes (lane_host.py, 7): mean ms per batch with host calls, by part
    nb = m.get("nelssa:lane_timeline_batches_total")
    out["lane_timeline_ms_per_batch"] = {
        p: 1e3 * m.get(f"nelssa:lane_timeline_seconds_total{{{p}}}", 0.0) / nb for p in TIMELINE_PARTS} if nb else None
    # lane batches by what the engine's steps computed beside them (lane.beside_bucket): batches, mean ms
    beside = {}
    for b in BESIDE:
        n = m.get(f"nelssa:lane_beside_batches_total{{{b}}}")
        if n:
            beside[b] = {"batches": int(n), "ms": 1e3 * m.get(f"nelssa:lane_beside_seconds_total{{{b}}}", 0.0) / n}
    out["lane_batch_ms_by_beside"] = beside or None
    # the GPU's state by phase (gpustate.py): a mode that ran on a throttled device reads slower
    out["gpu_by_phase"] = gpustate.by_phase(run.get("gpu") or [], out["phases_s"])
    out["gpu_samples"] = run.get("gpu") or None
    return out


def residency_targets(a: dict) -> dict:
    """The P/D stack's target (issue 11), on one mode's analysis: short TTFT p99 and ITL p99 within 1.5x
    of their before-phase values through the whole long residency, its prefill included."""
    b = a["before"]

    def within(phase: str, key: str):
        v, base = a[phase][key], b[key]
        return None if v is None or base is None else bool(v <= 1.5 * base)
    return {f"{ph}_{k}_le_1.5x_before": within(ph, f"short_{k}_p99_ms")
            for ph in ("long_prefill", "long_decode") for k in ("ttft", "itl")}


def preempted_at(samples: list[dict]) -> list[list[float]]:
    """When the preemptions came: [t, how many] at each sample whose counter (``preemptions``: the run's
    growth, or the endpoint's running total) rose since the one before. H200 hol run 99: all 31 within
    0.25 s of the first prompt's last chunk, which then only the requests' token times told."""
    return [[round(b["t"], 2), b["preemptions"] - a["preemptions"]] for a, b in zip(samples, samples[1:])
            if b.get("preemptions", 0.0) > a.get("preemptions", 0.0)]


def from_http(run: dict) -> dict:
    """An endpoint run (nelssa.bench.serving.replay: stamps per streamed chunk, /metrics samples) in the
    shape ``analyse`` reads: a failed request counts as an error, the counters' growth between the first
    and the last /metrics sample as the run's metrics (gauges: the last sample's; summed over the sampled
    instances: P and D behind a proxy)."""
    first, last = (run["samples"][0], run["samples"][-1]) if run["samples"] else ({}, {})
    metrics = run_metrics(first, last, lambda k: k.startswith("nelssa:"))
    if "preemptions" in last:
        metrics["vllm:num_preemptions_total"] = last["preemptions"] - first.get("preemptions", 0.0)
    reqs = [{**r, "finish_reason": "length" if r["success"] else "error"} for r in run["requests"]]
    return {"requests": reqs, "samples": run["samples"], "metrics": metrics, "wall_s": run.get("wall_s", 0.0)}


def target_values(on: dict, off: dict | None) -> dict[str, dict]:
    """Issue 9's acceptance on one invocation's numbers, each target as its ``value``, its ``bound`` and
    whether it is ``met`` (None: not measurable here; without ``off``, a run of NELSSA's modes only, those
    against stock's). Every target is value <= bound but the last, tok/s >= stock's: a reader sees how far
    each one is from its bound (H100 run 109: the decode phase's ITL p99 48.3 ms against 48.1)."""
    b, p, d = on["before"], on["long_prefill"], on["long_decode"]
    if off is None:
        off = {"before": {"short_tpot_p50_ms": None}, "long": [], "output_tok_s": None}
    lt_on = [x["ttft_s"] for x in on["long"] if x["ttft_s"] is not None]
    lt_off = [x["ttft_s"] for x in off["long"] if x["ttft_s"] is not None]
    tp_on = [x["tpot_ms"] for x in on["long"] if x["tpot_ms"] is not None]

    def times(k, x):
        return None if x is None else k * x
    le = {  # value, bound
        "before_tpot_within_5pct": (b["short_tpot_p50_ms"], times(1.05, off["before"]["short_tpot_p50_ms"])),
        "decode_ttft_p99_le_1.5x_before": (d["short_ttft_p99_ms"], times(1.5, b["short_ttft_p99_ms"])),
        "decode_itl_p99_le_1.5x_before": (d["short_itl_p99_ms"], times(1.5, b["short_itl_p99_ms"])),
        "prefill_max_gap_le_1s": (p["max_gap_without_short_token_s"], 1.0),
        "prefill_ttft_p99_le_2s": (p["short_ttft_p99_ms"], 2000.0),
        "long_ttft_le_stock": (max(lt_on) if lt_on else None, max(lt_off) if lt_off else None),
        "long_tpot_le_50ms": (max(tp_on) if tp_on else None, 50.0),
    }
    out = {k: {"value": v, "bound": lim, "met": None if v is None or lim is None else bool(v <= lim)}
           for k, (v, lim) in le.items()}
    v, lim = on["output_tok_s"], off["output_tok_s"]
    out["tok_s_ge_stock"] = {"value": v, "bound": lim, "met": None if v is None or lim is None else bool(v >= lim)}
    return out


def verdicts(values: dict[str, dict]) -> dict:
    """``target_values``' verdicts: each target met or not (None: not measurable here)."""
    return {k: t["met"] for k, t in values.items()}


def targets(on: dict, off: dict | None) -> dict:
    """Issue 9's acceptance, met or not (None: not measurable here)."""
    return verdicts(target_values(on, off))


def plot(runs: dict[str, dict], summary: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.2 * len(runs)), sharex=True, squeeze=False)
    for ax, (mode, run) in zip(axes[:, 0], runs.items()):
        s = summary[mode]
        for r in run["requests"]:
            if r["kind"] == "short" and len(r["stamps"]) > 1:
                ax.scatter(r["stamps"][1:], [1e3 * (b - a) for a, b in zip(r["stamps"], r["stamps"][1:])],
                           s=2, color="tab:blue", alpha=0.5)
                ax.scatter([r["stamps"][0]], [1e3 * (r["stamps"][0] - r["start"])], s=6, color="tab:orange",
                           marker="x")
        lo, hi = s["phases_s"]["long_prefill"]
        d_hi = s["phases_s"]["long_decode"][1]
        if hi != float("inf"):
            ax.axvspan(lo, hi, color="tab:red", alpha=0.12, label="long prefill")
            ax.axvspan(hi, d_hi, color="tab:green", alpha=0.10, label="long decode")
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        if run.get("gpu"):  # the device's SM clock (gpustate.py): a throttled stretch shows as a dip
            ax2 = ax.twinx()
            ax2.plot([x["t"] for x in run["gpu"]], [x["sm_mhz"] for x in run["gpu"]], color="gray", lw=0.8,
                     label="SM clock")
            ax2.set_ylabel("SM MHz", color="gray", fontsize=8)
            ax2.set_ylim(0, 1.1 * max(x["sm_mhz"] for x in run["gpu"]))
        name = ("stock (NELSSA_OFF)" if mode == "off" else "stock (NELSSA_OFF, V1 model runner)" if mode == OFF_V1
                else "NELSSA" + (f" ({mode[3:]})" if ":" in mode else ""))
        ax.set_title(f"{name}: short-request inter-token latency (dots) and TTFT (x)", fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------ driver

OFF_V1 = "off:v1"  # stock vLLM on the V1 model runner (mode_specs)


def mode_specs(sc: Scenario, modes: list[str], variants: dict[str, dict] | None = None) -> list[tuple[str, str, dict]]:
    """(label, engine mode, scenario) per requested mode: ``on``, ``off``, ``on:NAME`` — NELSSA with the
    variant NAME's fields over the scenario's NELSSA config (``--variant NAME=JSON``), so several NELSSA
    configurations run against one stock baseline in one invocation — or ``off:v1``: stock vLLM on its V1
    model runner (``VLLM_USE_V2_MODEL_RUNNER=0``), the runner NELSSA runs on, where ``off`` has vLLM's default
    (V2 on CUDA in 0.26): what between ``off`` and ``on`` is the runner's and not NELSSA's. The targets stay
    against ``off``. ValueError for an unknown one."""
    variants = variants or {}
    out = []
    for m in modes:
        base, _, name = m.partition(":")
        if base not in ("on", "off") or (name and base != "on" and m != OFF_V1):
            raise ValueError(f"unknown mode {m!r}: on, off, off:v1 or on:NAME")
        if name and base == "on" and name not in variants:
            raise ValueError(f"mode {m!r}: no --variant {name}=JSON given (known: {sorted(variants)})")
        d = asdict(sc)
        if name and base == "on":
            d["nelssa"] = {**sc.nelssa, **variants[name]}
            Scenario(**d)  # the variant's config checked as the scenario's was
        out.append((m, base, d))
    if len({label for label, _, _ in out}) != len(out):
        raise ValueError(f"a mode is repeated: {modes}")
    return out


def _file_label(label: str) -> str:
    return label.replace(":", "_")


def result_modes(summary: dict) -> list[str]:
    """The modes a hol.json (or its summary) has results for, in table order: off, off:v1, on, then on:NAME."""
    return [m for m in ["off", OFF_V1, "on"] + sorted(k for k in summary if k.startswith("on:")) if m in summary]


def run_modes(sc: Scenario, model: str, modes: list[str], out_dir: str, timeout: float = 1800,
              variants: dict[str, dict] | None = None) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    runs: dict[str, dict] = {}
    failed: dict[str, str] = {}
    for mode, base, scenario in mode_specs(sc, modes, variants):
        spec = {"mode": base, "scenario": scenario, "model": model, "out_dir": out_dir}
        env = {k: v for k, v in os.environ.items() if k != "NELSSA_OFF"}
        if base == "off":
            env["NELSSA_OFF"] = "1"
        if mode == OFF_V1:
            env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        print(f"[hol] mode {mode}: starting the engine", file=sys.stderr, flush=True)
        t = time.time()
        try:
            p = subprocess.run([sys.executable, "-m", "nelssa.bench.hol", "--worker"], input=json.dumps(spec),
                               stdout=subprocess.PIPE, text=True, env=env, timeout=timeout)
            rc, out = p.returncode, p.stdout
        except subprocess.TimeoutExpired as e:
            rc, out = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        lines = out.splitlines()
        line = next((x for x in lines if x.startswith("HOL_JSON ")), None)
        # vLLM logs to stdout: the engine's log (and any error in it) kept beside the results
        with open(os.path.join(out_dir, f"hol_{_file_label(mode)}.log"), "w") as f:
            f.write("".join(x + "\n" for x in lines if not x.startswith("HOL_JSON ")))
        errors = [x for x in lines if " ERROR " in x or x.startswith("Traceback")]
        if errors:
            print(f"[hol] mode {mode}: {len(errors)} error lines in hol_{_file_label(mode)}.log, first: {errors[0][:300]}",
                  file=sys.stderr, flush=True)
        if rc != 0 or line is None:  # the other modes still run; the invocation fails at the end
            failed[mode] = f"the engine run failed (rc={rc}, after {time.time() - t:.0f} s); its log is above"
            print(f"[hol] mode {mode}: {failed[mode]}", file=sys.stderr, flush=True)
            continue
        runs[mode] = json.loads(line[len("HOL_JSON "):])
        runs[mode]["torch_compile"] = compile_source(lines)
        with open(os.path.join(out_dir, f"hol_{_file_label(mode)}.jsonl"), "w") as f:
            for r in runs[mode]["requests"]:
                f.write(json.dumps(r) + "\n")
    summary: dict[str, Any] = {"scenario": asdict(sc), "model": model, "failed_modes": failed,
                               "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if variants:
        summary["variants"] = {k: v for k, v in variants.items() if f"on:{k}" in modes}
    for mode, run in runs.items():
        summary[mode] = analyse(run)
        summary[mode]["wall_s"] = run["wall_s"]
        summary[mode]["v2_model_runner"] = run.get("v2_model_runner")  # off: vLLM's default; on, off:v1: V1
        summary[mode]["torch_compile"] = run["torch_compile"]
    for mode in [m for m in runs if m.partition(":")[0] == "on"]:
        sfx = "" if mode == "on" else "_" + mode.partition(":")[2]  # e.g. targets_threads12 for on:threads12
        if "off" not in runs:  # those of NELSSA's own phases (H100 run 68, --modes on:spin, had none printed)
            summary["target_values" + sfx] = tv = target_values(summary[mode], None)
            summary["targets" + sfx] = verdicts(tv)
            continue
        on, off = summary[mode], summary["off"]
        summary["ratios_on_over_off" + sfx] = {
            f"{ph}.{k}": _ratio(on[ph][k], off[ph][k]) for ph in ("before", "long_prefill", "long_decode")
            for k in ("short_ttft_p99_ms", "short_itl_p99_ms", "short_tpot_p50_ms")}
        summary["ratios_on_over_off" + sfx]["output_tok_s"] = _ratio(on["output_tok_s"], off["output_tok_s"])
        summary["target_values" + sfx] = tv = target_values(on, off)
        summary["targets" + sfx] = verdicts(tv)
        eq = [r for r in runs["off"]["requests"]]
        on_ids = {r["id"]: r["token_ids"] for r in runs[mode]["requests"]}
        summary["outputs_equal" + sfx] = sum(on_ids.get(r["id"]) == r["token_ids"] for r in eq)
        summary["outputs_total" + sfx] = len(eq)
    with open(os.path.join(out_dir, "hol.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if runs:
        plot(runs, summary, os.path.join(out_dir, "hol.png"))
    return summary


def _g(v) -> str:
    return "-" if v is None else f"{v:.5g}"


def _table(summary: dict) -> str:
    rows = []
    for mode in result_modes(summary):
        s = summary[mode]
        f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
        for ph in ("before", "long_prefill", "long_decode"):
            x = s[ph]
            rows.append(f"{mode:3} {ph:12} TTFT p50/p99 {f(x['short_ttft_p50_ms'])}/{f(x['short_ttft_p99_ms'])} ms  "
                        f"ITL p50/p99 {f(x['short_itl_p50_ms'])}/{f(x['short_itl_p99_ms'])} ms  "
                        f"TPOT p50 {f(x['short_tpot_p50_ms'])} ms  max gap {f(x['max_gap_without_short_token_s'], 2)} s")
        late = s["long_decode"].get("from_s", {}).get("0.5")
        if late:
            rows.append(f"{mode:3} long_decode from 0.5 s in: TTFT p99 {f(late['short_ttft_p99_ms'])} ms  "
                        f"ITL p99 {f(late['short_itl_p99_ms'])} ms")
        st = s["long_decode"].get("itl_steps") or {}
        if st.get("worst"):  # which steps make the phase's ITL p99
            rows.append(f"{mode:3} long_decode ITL p99 from its {st['p99_steps']} longest steps; longest: " + "  ".join(
                f"+{t:.2f} s {ms:.1f} ms x{c} ({p} first tokens)" for t, ms, c, p in st["worst"][:4]))
        rows.append(f"{mode:3} long {[(x['ttft_s'] and round(x['ttft_s'], 2), x['tpot_ms'] and round(x['tpot_ms'], 1)) for x in s['long']]}"
                    f"  tok/s {f(s['output_tok_s'])}  preemptions {s['preemptions']}  errors {s['errors']}")
        if any(x.get("prefill_s") is not None for x in s["long"]):  # TTFT = admitted + prefill (long_split)
            rows.append(f"{mode:3} long TTFT = admitted + prefill s: " + "  ".join(
                f"{x['id']} {f(x.get('admitted_s'), 2)} + {f(x.get('prefill_s'), 2)}" for x in s["long"]))
        if any(x.get("longest_gap") for x in s["long"]):  # a hold or a stall, apart from the per-token time
            rows.append(f"{mode:3} long longest gap: " + "  ".join(
                f"{x['id']} {g['s']:.2f} s after token {g['after_token']} (TPOT {f(g['tpot_ms_without'])} ms without it)"
                for x in s["long"] if (g := x.get("longest_gap"))))
        tc = s.get("torch_compile")
        if tc:  # vLLM's compiled model: afresh, or loaded from its cache (a warm machine's earlier run)
            rows.append(f"{mode:3} torch.compile: {'loaded from the cache' if tc['cached'] else 'compiled'} in {tc['s']:.1f} s")
        gp = s.get("gpu_by_phase")
        if gp:  # the device's state: the same in both modes, or one of them ran throttled
            rows.append(f"{mode:3} gpu by phase: " + gpustate.text(gp))
        mv, th = s.get("move_split_s_per_move"), s.get("move_thread_s_per_move")
        if mv:  # a move's time by part, and by its thread's state
            rows.append(f"{mode:3} moves, s per move: " + "  ".join(f"{p} {v:.3f}" for p, v in mv.items()) + (
                "  (thread: " + "  ".join(f"{p} {v:.3f}" for p, v in th.items()) + ")" if th else ""))
        bb = s.get("lane_batch_ms_by_beside")
        if bb:  # the lane's batches by the requests of the steps beside them
            rows.append(f"{mode:3} lane batch ms by requests beside: " + "  ".join(
                f"{b}: {f(v['ms'])} ({v['batches']})" for b, v in bb.items()))
    for k in sorted(k for k in summary if k.startswith("targets")):
        rows.append(f"{k}: " + json.dumps(summary[k]))
    for k in sorted(k for k in summary if k.startswith("target_values")):  # how far each is from its bound
        rows.append(f"{k}: " + "  ".join(f"{name} {_g(t['value'])}/{_g(t['bound'])}" for name, t in summary[k].items()))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nelssa bench hol", description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="model folder (default: the prepared SmolLM2, or with --dummy "
                                                   "a Llama-3.1-8B-shaped config with dummy weights)")
    ap.add_argument("--dummy", action="store_true", help="Llama-3.1-8B-shaped dummy weights (load_format=dummy)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    ap.add_argument("--modes", default="off,on", help="comma-separated: on (NELSSA), off (stock), on:NAME (NELSSA "
                                                      "with --variant NAME)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="NELSSA fields over the scenario's for mode on:NAME, e.g. --variant 't12={\"pool_threads\": "
                         "12}' --modes off,on,on:t12 (every variant against one stock run)")
    ap.add_argument("--out", default="results/hol")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="override a scenario field, e.g. --set rate=4 --set 'nelssa={\"budget\": 0.02}'")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per mode")
    a = ap.parse_args(argv)
    if a.worker:
        _worker(json.loads(sys.stdin.read()))
        return 0
    kw = dict(PRESETS[a.preset])
    for item in a.set:
        k, _, v = item.partition("=")
        if k not in Scenario.__dataclass_fields__:
            ap.error(f"unknown scenario field {k!r}; known: {sorted(Scenario.__dataclass_fields__)}")
        try:
            kw[k] = json.loads(v)
        except json.JSONDecodeError:
            kw[k] = v
    try:
        sc = Scenario(**kw)
    except ValueError as e:
        ap.error(str(e))
    if a.model:
        model = a.model
    elif a.dummy:
        from nelssa.models import make_dummy_model
        model = str(make_dummy_model())
    else:
        from nelssa.models import prepare_smollm2
        model = str(prepare_smollm2())
    if sc.load_format == "dummy" and not (a.dummy or a.model):
        ap.error("this preset uses dummy weights: pass --dummy (or --model with a config folder)")
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    variants: dict[str, dict] = {}
    for item in a.variant:
        name, _, v = item.partition("=")
        try:
            variants[name] = json.loads(v)
        except json.JSONDecodeError as e:
            ap.error(f"--variant {name}: not JSON ({e})")
        if not name or not isinstance(variants[name], dict):
            ap.error(f"--variant {item!r}: NAME={{...NELSSA fields...}} expected")
    try:
        mode_specs(sc, modes, variants)
    except ValueError as e:
        ap.error(str(e))
    summary = run_modes(sc, model, modes, a.out, a.timeout, variants)
    print(_table(summary))
    print(f"[hol] wrote {a.out}/hol.json, hol.png, hol_<mode>.jsonl, hol_<mode>.log", file=sys.stderr)
    if summary["failed_modes"]:
        print(f"[hol] failed modes: {summary['failed_modes']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
