"""Helpers the serving benchmarks share (hol, the workloads, the report): percentiles, ratios,
exact-length prompts, the progress line."""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any


def pct(v: list[float], p: float) -> float | None:
    """The p-th percentile (numpy's linear interpolation), None for no values."""
    if not v:
        return None
    import numpy as np
    return float(np.percentile(np.asarray(v), p))


def device_ms(fn, n: int = 20, warm: int = 2) -> float:
    """Milliseconds per call of ``fn`` on the current CUDA stream (events around ``n`` calls after ``warm``);
    without CUDA one call's wall time (the microbenchmarks' CPU checks under Triton's interpreter)."""
    import torch
    for _ in range(warm):
        fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def metric_key(name: str, labels: dict[str, str]) -> str:
    """A Prometheus sample's key in the benches' metric dicts: its name, and its "part", "path", "outcome",
    "beside" or "context" label as name{part} (a lane batch's or a move's time by part, batches by path,
    drafts by outcome, lane batches by the requests beside them, migrations by context); every other label
    (engine, model) is summed over."""
    lab = (labels.get("part") or labels.get("path") or labels.get("outcome") or labels.get("beside")
           or labels.get("context"))
    return f"{name}{{{lab}}}" if lab else name


def run_metrics(first: dict[str, float], last: dict[str, float], names=lambda k: True) -> dict[str, float]:
    """A run's metrics from its first and last scrape (keys as ``metric_key`` makes them): counters and
    histograms as their growth over the run, gauges (levels: host bytes in use, free host memory) as
    their last value — a level's growth says nothing."""
    def grows(k: str) -> bool:
        return k.split("{", 1)[0].endswith(("_total", "_sum", "_count", "_bucket"))
    return {k: (v - first.get(k, 0.0)) if grows(k) else v for k, v in last.items() if names(k)}


def ratio(a, b):
    """a / b, None where either is missing or b is 0."""
    return a / b if a is not None and b not in (None, 0) else None


def preemptions_text(point: dict, fmt) -> str:
    """A point's vLLM preemptions, with how many of them were NELSSA's recalls by recompute: such a recall
    hands a migrated request back to the device through vLLM's preemption, so vllm:num_preemptions counts it
    too (H100 growth run of 2026-12-05: 16 preemptions, all 16 of them recalls). A recall by load (the
    in-process host tier, recall.py) is no preemption, and since nelssa-node reads back (2026-12-06) every
    recall is one: such metrics have the recall by load's ``nelssa:recall_load_seconds`` and no
    ``nelssa:recalls_recomputed``. Metrics from before the recall by load have only ``nelssa:recalls``, and
    every recall then was a recompute."""
    nel = point.get("nelssa") or {}
    rec = nel.get("nelssa:recalls_recomputed_total",
                  0 if "nelssa:recall_load_seconds_count" in nel else nel.get("nelssa:recalls_total"))
    return fmt(point.get("preemptions"), 0) + (f" ({fmt(rec, 0)} recalls)" if rec else "")


def prompt_ids(tok: Any, n_in: int, k: int, kind: str = "random", seed: int = 0) -> list[int]:
    """Exactly ``n_in`` prompt token ids for request number ``k``: a slice of real text
    (``kind="text"``, nelssa.bench.corpus) or seeded random ids away from the special tokens."""
    if kind == "text":
        from nelssa.bench.corpus import real_text
        text = real_text()
        off = (k * 7919 * 13) % max(1, len(text) - 8 * n_in)
        ids = tok.encode(text[off:off + 8 * n_in], add_special_tokens=False)[:n_in]
        if len(ids) < n_in:
            raise ValueError(f"corpus too short for a {n_in}-token prompt")
        return ids
    if kind != "random":
        raise ValueError(f"prompt kind must be 'random' or 'text', got {kind!r}")
    rng = random.Random(seed * 1_000_003 + k)
    hi = max(200, min(tok.vocab_size, 40_000) - 100)
    return [rng.randrange(100, hi) for _ in range(n_in)]


class Progress:
    """A one-line progress bar on stderr (done/total, elapsed, ETA), printed at most every ``every`` s."""

    def __init__(self, total: int, label: str, every: float = 2.0, stream=None) -> None:
        self.total, self.done, self.label, self.every = max(1, total), 0, label, every
        self.t0 = self.last = time.time()
        self.stream = stream or sys.stderr

    def update(self, n: int = 1, extra: str = "", force: bool = False) -> None:
        self.done += n
        now = time.time()
        if not force and now - self.last < self.every and self.done < self.total:
            return
        self.last = now
        el = now - self.t0
        eta = el / self.done * (self.total - self.done) if self.done else float("nan")
        bar = "#" * int(24 * min(1.0, self.done / self.total))
        print(f"[{self.label}] [{bar:<24}] {self.done}/{self.total} {el:5.0f}s elapsed, ~{eta:.0f}s left {extra}",
              file=self.stream, flush=True)


# The head-of-line scenario's long requests at one layer (Llama-3.1-8B heads: 8 KV heads of 128, GQA
# group 4; 8 tokens per cluster), for the CUDA micro-benchmarks of its parts (benchmarks/bench_*_gpu.py).
HOL_HEADS = (8, 4, 128)  # KV heads, query heads per KV head, head dim


def add_hol_shape_args(ap, length: int = 100_000, batch: int = 2, budget: float = 0.04) -> None:
    ap.add_argument("--length", type=int, default=length, help="tokens per long request")
    ap.add_argument("--batch", type=int, default=batch, help="long requests")
    ap.add_argument("--budget", type=float, default=budget)


def hol_shape_kv(length: int, batch: int, device: str = "cuda") -> list:
    """``batch`` requests of ``length`` random bf16 tokens, clustered on ``device`` (seeded)."""
    import torch

    from nelssa.sparse import cluster_kv
    H, _, D = HOL_HEADS
    torch.manual_seed(0)
    return [cluster_kv(torch.randn(H, length, D, device=device, dtype=torch.bfloat16),
                       torch.randn(H, length, D, device=device, dtype=torch.bfloat16), seed=b, cluster_size=8)
            for b in range(batch)]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer expected, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"an integer >= 1 expected, got {text!r}")
    return v


def positive_ints(text: str) -> list[int]:
    """argparse type: '1024,2048' -> [1024, 2048], each an integer >= 1."""
    return [positive_int(x) for x in text.split(",")]


def require_number(label: str, v, lo: float, *, integer: bool = False, strict: bool = False,
                   none: bool = False) -> None:
    """A benchmark setting checked before anything starts: ValueError naming ``label`` unless ``v`` is a
    number (an integer with ``integer``) >= ``lo`` (> with ``strict``), or None with ``none``."""
    if v is None and none:
        return
    kind = int if integer else (int, float)
    if not isinstance(v, kind) or isinstance(v, bool) or v < lo or (strict and v == lo):
        raise ValueError(f"{label}: {'an integer' if integer else 'a number'} {'>' if strict else '>='} {lo} "
                         f"expected, got {v!r}")
