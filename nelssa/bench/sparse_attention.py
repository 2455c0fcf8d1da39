"""Host sparse-attention benchmark: fused C++ kernel vs naive torch vs the machine's read bandwidth.

Llama-3.1-8B layer shape (8 KV heads, 32 query heads, head_dim 128, bf16), budget 4%, contexts
32K/128K, batches 1/4/16, all in one run. The clustered layout is synthetic (random K/V, L/cluster_size
clusters (config, default 8) with random sizes, i.e. the kernel's real access pattern); selections come
from the real centroid search with fresh random queries per step, and enough independent "layers"
rotate that the selected bytes are not cache-resident. Reports ms per layer-step, effective GB/s over
the selected K/V bytes, the ratio to the read bandwidth and the speedup over torch. Same-run
references: the read bandwidth (best of sequential reads and random 1 MiB blocks, huge pages), the
machine's rate for random blocks of 4 KiB .. 1 MiB (``block_read_ceilings``: what scattered runs of
each length get, whatever reads them), and the gather probe (``gather_GBps``: the kernel's own
traversal of the same rows reading every cache line with no arithmetic). ``--sweep-prefetch`` times
the kernel per software-prefetch setting first and runs the table at the best one.

    python -m nelssa.bench.sparse_attention [--out results.json] [--quick] [--sweep-prefetch]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

from nelssa._ext import ext
from nelssa.bench.common import positive_int, positive_ints
from nelssa.config import PREFETCH_HINTS, get_config, mem_available, set_config
from nelssa.cpu import cpu_model
from nelssa.sparse import ClusteredKV, KVPart, attend, select_clusters
from nelssa.sparse.clustered import host_empty
from nelssa.sparse.search import Selection

GiB = 1 << 30


def synthetic_ckv(L: int, H: int, D: int, dtype: torch.dtype, gen: torch.Generator, cs: int) -> ClusteredKV:
    """A ClusteredKV with random K/V and L/cs clusters of random sizes (one part, real layout)."""
    C = max(1, L // cs)
    c = ClusteredKV(H, D, dtype, torch.device("cpu"), cluster_size=cs, segment=8192, iters=1, seed=0)
    labels = torch.randint(0, C, (H, L), generator=gen)
    sizes = torch.zeros(H, C, dtype=torch.long).scatter_add_(1, labels, torch.ones_like(labels))
    kv = host_empty((H, L, 2, D), dtype)
    flat, tile = kv.view(-1), torch.randn(1 << 22, generator=gen).to(dtype)  # tiled noise: fast to fill
    for o in range(0, flat.numel(), tile.numel()):
        n = min(tile.numel(), flat.numel() - o)
        flat[o:o + n] = tile[:n]
    c.parts = [KVPart(kv)]
    c.cpart = torch.zeros(C, dtype=torch.int32)
    c.cstart = (torch.cumsum(sizes, 1) - sizes).contiguous()
    c.csize = sizes.to(torch.int32)
    c.perm = torch.sort(labels, dim=1, stable=True).indices
    c.centroids = torch.randn(H, C, D, generator=gen).to(dtype)
    c.sizes = c.csize.clone()
    c.length = L
    return c


def read_bandwidth(threads: int, nbytes: int = 2 * GiB, reps: int = 5) -> dict:
    """Large-array read bandwidth (GB/s), best of reps: the C++ probe and torch's sum, over a buffer on
    huge pages like the host tier's (on 4 KiB pages TLB misses cap it well below the memory system)."""
    buf = host_empty((nbytes // 4,), torch.float32).uniform_()
    out = {}
    mod = ext()
    if mod is not None:
        mod.read_bandwidth(buf, 1)
        out["cpp_read_GBps"] = max(nbytes / mod.read_bandwidth(buf, 1)[0] / 1e9 for _ in range(reps))
    torch.set_num_threads(threads)
    buf.sum()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        ts.append(time.perf_counter() - t)
    out["torch_sum_GBps"] = nbytes / min(ts) / 1e9
    return out


def block_ceilings(nbytes: int, moved: int = 1 * GiB,
                   blocks=(4096, 16384, 65536, 1 << 20), hints=("none", "nta")) -> list[dict]:
    """What the machine gives scattered runs: GB/s reading random blocks of each size (best of 3) from
    an ``nbytes`` host-tier buffer (huge pages, like the KV; sized like the benchmark's working set,
    since TLB reach matters)."""
    mod = ext()
    if mod is None:
        return []
    buf = host_empty((nbytes,), torch.uint8)
    buf.fill_(1)
    rows = []
    for bb in blocks:
        for h in hints:
            n = moved // bb
            mod.block_read(buf, bb, n, 0, PREFETCH_HINTS[h])
            t = min(mod.block_read(buf, bb, n, s + 1, PREFETCH_HINTS[h])[0] for s in range(3))
            rows.append({"block_bytes": bb, "prefetch": h, "GBps": n * bb / t / 1e9})
    del buf
    return rows


def time_fn(fn, steps: int) -> list[float]:
    ts = []
    for i in range(steps):
        t = time.perf_counter()
        fn(i)
        ts.append(time.perf_counter() - t)
    return ts


PREFETCH_SWEEP = [(r, h) for h in ("l1", "l2", "nta") for r in (8, 16, 32, 64)] + [(0, "none")]


def run(contexts, batches, budget: float, steps: int, target_bytes: int, mem_frac: float,
        sweep: list[tuple[int, str]] | None = None, sweep_cases=((32768, 4), (131072, 4))) -> dict:
    """The table at the config's prefetch settings, or, with ``sweep``, first the kernel and gather probe
    per (prefetch_rows, prefetch) on ``sweep_cases`` (context, batch), then the table at
    the setting with the best geometric-mean GB/s over them (the run's recommendation)."""
    cfg = get_config()
    threads = cfg.pool_threads
    H, Hq, D, dtype = 8, 32, 128, torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    bw = read_bandwidth(threads)
    ceil = block_ceilings(int(min(8 * GiB, 0.25 * mem_frac * mem_available())))
    # the denominator: the best large-run read rate of this run (sequential, or random 1 MiB blocks)
    bw["random_1MiB_GBps"] = max((r["GBps"] for r in ceil if r["block_bytes"] >= 1 << 20), default=0.0)
    bw["read_GBps"] = max(bw.values())
    print(f"read bandwidth: {bw['read_GBps']:.1f} GB/s ({threads} threads; " +
          ", ".join(f"{k} {v:.1f}" for k, v in bw.items() if k != "read_GBps") + ")", flush=True)
    for r in ceil:
        print(f"random {r['block_bytes'] >> 10:>5} KiB blocks, prefetch {r['prefetch']:>4}: {r['GBps']:6.1f} GB/s "
              f"({r['GBps'] / bw['read_GBps'] * 100:5.1f}% of read)", flush=True)
    budget_mem = mem_frac * mem_available()

    def case(L: int, B: int):
        """Data, queries and selections of one (context, batch), or None where memory does not allow."""
        req_bytes = H * L * D * 2 * 2
        layers = max(1, min(int(target_bytes // (B * req_bytes * budget)) + 1, 16))
        if B * req_bytes > budget_mem:
            print(f"skip L={L} B={B}: {B * req_bytes / GiB:.1f} GiB > {budget_mem / GiB:.1f} GiB allowed", flush=True)
            return None
        layers = max(1, min(layers, int(budget_mem // (B * req_bytes))))
        data = [[synthetic_ckv(L, H, D, dtype, gen, cfg.cluster_size) for _ in range(B)] for _ in range(layers)]
        n = steps * layers
        qs = [torch.randn(B, Hq, D, generator=gen).to(dtype) for _ in range(n)]
        t = time.perf_counter()
        sels = [select_clusters(qs[i], data[i % layers], budget) for i in range(n)]
        search_ms = (time.perf_counter() - t) / n * 1e3
        sel_tok = [sum(int(x.sum()) for x in s.tokens(data[i % layers])) for i, s in enumerate(sels)]
        return dict(data=data, qs=qs, sels=sels, n=n, layers=layers, search_ms=search_ms, sel_tok=sel_tok,
                    sel_b=[t * D * 2 * 2 for t in sel_tok])

    def call(c, i, touch_only=False):
        attend(c["qs"][i], c["data"][i % c["layers"]], c["sels"][i], touch_only=touch_only)

    def kernel(c, pf: tuple[int, str]) -> tuple[float, float, float]:
        """(ms, GB/s, gather-probe GB/s) of the C++ kernel at prefetch setting pf."""
        set_config(cfg.replace(use_cpp=True, prefetch_rows=pf[0], prefetch=pf[1]))
        for i in range(min(c["n"], c["layers"])):
            call(c, i)
        tc, tg = time_fn(lambda i: call(c, i), c["n"]), time_fn(lambda i: call(c, i, True), c["n"])
        set_config(cfg)
        gbps = statistics.median(b / t for b, t in zip(c["sel_b"], tc)) / 1e9
        return statistics.median(tc) * 1e3, gbps, statistics.median(b / t for b, t in zip(c["sel_b"], tg)) / 1e9

    pf_used = (cfg.prefetch_rows, cfg.prefetch)
    sweep_rows = []
    if sweep:
        score = {pf: 0.0 for pf in sweep}
        for L, B in sweep_cases:
            c = case(L, B)
            if c is None:
                continue
            for pf in sweep:
                ms_c, gbps, gather = kernel(c, pf)
                score[pf] += math.log(gbps)
                sweep_rows.append({"context": L, "batch": B, "prefetch_rows": pf[0], "prefetch": pf[1], "cpp_ms": ms_c, "cpp_GBps": gbps, "gather_GBps": gather,
                                   "frac_of_read_bw": gbps / bw["read_GBps"]})
                print(f"  sweep L={L} B={B} prefetch {pf}: {ms_c:7.3f} ms {gbps:6.1f} GB/s (gather {gather:5.1f})",
                      flush=True)
            del c
        if sweep_rows:
            pf_used = max(score, key=score.get)
            print(f"best prefetch setting here: NELSSA_PREFETCH={pf_used[1]} NELSSA_PREFETCH_ROWS={pf_used[0]}",
                  flush=True)
    rows = []
    for L in contexts:
        for B in batches:
            c = case(L, B)
            if c is None:
                rows.append({"context": L, "batch": B, "skipped": "memory"})
                continue
            ms_c, gbps, gather = kernel(c, pf_used)
            set_config(cfg.replace(use_cpp=False))
            torch.set_num_threads(threads)
            tt = time_fn(lambda i: call(c, i), max(c["layers"], min(c["n"], 8)))
            set_config(cfg)
            ms_t = statistics.median(tt) * 1e3
            row = {"context": L, "batch": B, "budget": budget, "layers_rotated": c["layers"], "steps": c["n"],
                   "selected_tokens_per_step": statistics.median(c["sel_tok"]), "selected_MB_per_step":
                   statistics.median(c["sel_b"]) / 1e6, "cpp_ms": ms_c, "torch_ms": ms_t,
                   "search_ms": c["search_ms"], "cpp_GBps": gbps, "frac_of_read_bw": gbps / bw["read_GBps"],
                   "speedup_vs_torch": ms_t / ms_c, "gather_GBps": gather, "frac_of_gather": gbps / gather}
            rows.append(row)
            print(f"L={L:>6} B={B:>2}: cpp {ms_c:8.3f} ms  torch {ms_t:8.2f} ms  {gbps:6.1f} GB/s "
                  f"({row['frac_of_read_bw'] * 100:5.1f}% of read)  x{row['speedup_vs_torch']:.1f} vs torch  "
                  f"gather-only {gather:5.1f} GB/s", flush=True)
            del c
    mod = ext()
    return {
        "benchmark": "sparse_attention", "shape": {"kv_heads": H, "q_heads": Hq, "head_dim": D, "dtype": "bf16",
                                                   "cluster_size": cfg.cluster_size},
        "prefetch": {"rows": pf_used[0], "hint": pf_used[1], "chosen_by_sweep": bool(sweep_rows)},
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads,
                    "isa": getattr(mod, "isa", None), "mem_total_GiB": round(os.sysconf("SC_PAGE_SIZE") *
                                                                          os.sysconf("SC_PHYS_PAGES") / GiB, 1)},
        "bandwidth": bw, "block_read_ceilings": ceil, "results": rows, "prefetch_sweep": sweep_rows,
        "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(argv=None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/bench_sparse_attention.json")
    ap.add_argument("--contexts", type=positive_ints, default=[32768, 131072])
    ap.add_argument("--batches", type=positive_ints, default=[1, 4, 16])
    ap.add_argument("--budget", type=float, default=0.04)
    ap.add_argument("--steps", type=positive_int, default=10, help="timed steps per rotated layer")
    ap.add_argument("--target-mb", type=positive_int, default=1024, help="selected bytes per rotation (defeats caches)")
    ap.add_argument("--mem-frac", type=float, default=0.6, help="fraction of available memory to use")
    ap.add_argument("--quick", action="store_true", help="32K only, batches 1/4 (smoke run)")
    ap.add_argument("--sweep-prefetch", action="store_true",
                    help="first time the kernel per software-prefetch setting (32K and 128K, batch 4), then "
                         "run the table at the best one")
    a = ap.parse_args(argv)
    if not 0 < a.budget <= 1 or not 0 < a.mem_frac <= 1:
        ap.error(f"--budget and --mem-frac must be in (0, 1], got {a.budget} / {a.mem_frac}")
    contexts = [32768] if a.quick else a.contexts
    batches = [1, 4] if a.quick else a.batches
    res = run(contexts, batches, a.budget, a.steps, a.target_mb << 20, a.mem_frac,
              PREFETCH_SWEEP if a.sweep_prefetch else None)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
