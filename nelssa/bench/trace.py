"""Request plans for the serving workloads: the Mooncake conversation trace scaled to a model's
context, Poisson arrivals, long/short mixes.

The trace (``../shared/data/mooncake/conversation_trace.jsonl``; never copied into the repository)
has per-request ``input_length`` / ``output_length`` and coarse 3-second timestamps. Replay:

* **Lengths, scaled keeping each request's share.** Every input length is multiplied by one factor,
  ``max_input / trace_max_input`` (``max_input`` = the model's context minus the largest scaled
  output), so a request that was 20% of the trace's longest prompt is 20% of the longest prompt the
  model takes; outputs likewise by ``max_output / trace_max_output``. Lengths are rounded and
  clamped to a floor (``min_input``, ``min_output``: prompts stay non-trivial and every request has a
  few decode steps to time, whatever the compression of a small model's context). The relative shape of the
  distribution — and which requests are long relative to the others — is kept; absolute lengths are
  not (on a 3K-context CPU model the trace's 126K-token maximum becomes ~3K).
* **Long / short.** A scaled request is *long* when its input is >= ``T_input`` (the routing
  threshold). ``long_fraction=None`` keeps the trace's own share (requests drawn from the whole trace);
  a number f draws each arrival's class with probability f, then a request of that class uniformly
  (the paper sweeps the long fraction, Fig. 14-16).
* **Arrivals.** The timestamps are too coarse to replay, so arrivals are Poisson at the swept rate
  (exponential gaps, seeded).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

DEFAULT_TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "mooncake",
                             "conversation_trace.jsonl")


def default_trace() -> str:
    return os.environ.get("NELSSA_TRACE") or os.path.normpath(DEFAULT_TRACE)


def load_trace(path: str | None = None, limit: int | None = None) -> list[dict]:
    """[{"input": int, "output": int}] from a Mooncake-format JSONL (input_length, output_length)."""
    path = path or default_trace()
    if not os.path.exists(path):
        raise FileNotFoundError(f"trace {path!r} not found (set --trace or NELSSA_TRACE; the Mooncake "
                                "conversation trace lives in ../shared/data/mooncake/)")
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                rows.append({"input": int(r["input_length"]), "output": int(r["output_length"])})
                if limit and len(rows) >= limit:
                    break
    if not rows:
        raise ValueError(f"trace {path!r} is empty")
    return rows


@dataclass(frozen=True)
class Scaling:
    in_factor: float
    out_factor: float
    trace_max_input: int
    trace_max_output: int
    max_input: int
    max_output: int
    min_input: int
    min_output: int


def scale_trace(rows: list[dict], max_model_len: int, max_output: int, min_input: int = 16,
                min_output: int = 1) -> tuple[list[dict], Scaling]:
    """Scale lengths keeping each request's share of the trace's maximum (module docstring)."""
    if max_output < 1 or max_model_len <= max_output:
        raise ValueError(f"need 1 <= max_output < max_model_len, got {max_output}, {max_model_len}")
    tmi = max(r["input"] for r in rows)
    tmo = max(r["output"] for r in rows)
    max_input = max_model_len - max_output
    fi, fo = max_input / tmi, max_output / tmo
    out = [{"input": min(max_input, max(min_input, round(r["input"] * fi))),
            "output": min(max_output, max(min_output, round(r["output"] * fo)))} for r in rows]
    return out, Scaling(fi, fo, tmi, tmo, max_input, max_output, min_input, min_output)


def poisson_times(rate: float, n: int | None = None, duration: float | None = None, seed: int = 0,
                  start: float = 0.0) -> list[float]:
    """Arrival times of a Poisson process at ``rate``/s: the first at ``start``, then exponential gaps;
    ``n`` arrivals, or every arrival before ``start + duration``."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if n is None and duration is None:
        raise ValueError("give n or duration")
    rng = random.Random(seed)
    t, out = start, []
    while (n is None or len(out) < n) and (duration is None or t < start + duration):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def mixed_plan(scaled: list[dict], t_input: int, rate: float, n: int, long_fraction: float | None = None,
               seed: int = 0, start: float = 0.0, prefix: str = "") -> list[dict]:
    """n requests at Poisson ``rate`` drawn from the scaled trace (see the module docstring)."""
    rng = random.Random(seed * 7_919 + 1)
    longs = [r for r in scaled if r["input"] >= t_input]
    shorts = [r for r in scaled if r["input"] < t_input]
    plan = []
    for i, at in enumerate(poisson_times(rate, n=n, seed=seed, start=start)):
        if long_fraction is None:
            r = scaled[rng.randrange(len(scaled))]
        else:
            pool = longs if rng.random() < long_fraction else shorts
            if not pool:
                raise ValueError(f"no {'long' if pool is longs else 'short'} requests in the scaled trace at "
                                 f"T_input {t_input} (long fraction {long_fraction})")
            r = pool[rng.randrange(len(pool))]
        kind = "long" if r["input"] >= t_input else "short"
        plan.append({"id": f"{prefix}{kind[0]}{i}", "kind": kind, "at": at, "n_in": r["input"], "n_out": r["output"]})
    return plan


def long_plan(n: int, n_in: int, n_out: int, at: float = 0.0, prefix: str = "") -> list[dict]:
    """n long requests arriving together (single-long: n = 1; multi-long: n concurrent)."""
    return [{"id": f"{prefix}long{j}", "kind": "long", "at": at, "n_in": n_in, "n_out": n_out} for j in range(n)]


def growth_plan(n: int, n_in: int, rate: float | None, t_input: int, seed: int = 0, prefix: str = "") -> list[dict]:
    """Input:output 1:2 (paper §8.4): n requests of n_in tokens generating 2 n_in, so contexts grow to
    3 n_in; they start short (n_in < T_input) and must pass T_input while decoding."""
    if not n_in < t_input < 3 * n_in:
        raise ValueError(f"growth needs n_in < T_input < 3 n_in (contexts that start short and grow past "
                         f"T_input), got n_in {n_in}, T_input {t_input}")
    times = [0.0] * n if not rate else poisson_times(rate, n=n, seed=seed)
    return [{"id": f"{prefix}g{j}", "kind": "growing", "at": t, "n_in": n_in, "n_out": 2 * n_in}
            for j, t in enumerate(times)]


def shares(plan: list[dict]) -> dict:
    """Counts and token shares by kind (documented in the summary)."""
    out: dict[str, dict] = {}
    for r in plan:
        d = out.setdefault(r["kind"], {"n": 0, "in_tokens": 0, "out_tokens": 0})
        d["n"] += 1
        d["in_tokens"] += r["n_in"]
        d["out_tokens"] += r["n_out"]
    return out
