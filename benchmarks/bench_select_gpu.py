"""Where a split-attention layer's device time goes on CUDA: the centroid search (eager and as a
captured graph; torch operations and the Triton kernels of select_kernel.py, with ``kernel_*`` the
kernels' speedups and ``kernel_ids_equal`` whether both select the same clusters) and the host
attention it feeds, at the head-of-line scenario's shape (two 100K-token
requests, Llama-3.1-8B heads: 32 query / 8 KV heads of 128, 8 tokens per cluster, budget 4%).

    python3 benchmarks/bench_select_gpu.py --out DIR [--length 100000] [--batch 2]

Writes select_gpu.json (GPU and host times per call) and select_gpu_ops_{torch,kernel}.txt (the eager
search's kernels by CUDA time, torch profiler).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from nelssa.bench.common import HOL_HEADS, add_hol_shape_args, device_ms, hol_shape_kv
from nelssa.config import get_config, set_config
from nelssa.sparse import attend, select_clusters
from nelssa.sparse.search import budget_targets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    add_hol_shape_args(ap)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from nelssa.vllm_plugin.select_graph import SelectGraphs
    H, G, D = HOL_HEADS
    t = time.time()
    ckvs = hol_shape_kv(a.length, a.batch)
    res = {"shape": dict(B=a.batch, L=a.length, H=H, G=G, D=D, clusters=ckvs[0].num_clusters, budget=a.budget),
           "cluster_s": time.time() - t, "device": torch.cuda.get_device_name(0)}
    q = torch.randn(a.batch + 3, H * G, D, device="cuda", dtype=torch.bfloat16)
    tok = torch.arange(a.batch, device="cuda") + 1
    target = budget_targets(ckvs, a.budget)
    scale = D ** -0.5
    base = get_config()
    for kern in (False, True):
        set_config(base.replace(select_kernel=kern))
        p = "kernel" if kern else "torch"
        for est in (True, False):
            eager = lambda: select_clusters(q[tok], ckvs, a.budget, scale, estimate=est, no_sync=True, target=target)
            res[f"{p}_eager_gpu_ms_est{int(est)}"] = device_ms(eager, 50, 3)
            t = time.perf_counter()
            for _ in range(20):
                eager()
            res[f"{p}_eager_cpu_ms_est{int(est)}"] = (time.perf_counter() - t) / 20 * 1e3
            torch.cuda.synchronize()
            g = SelectGraphs()
            for _ in range(2):
                g.select(0, q, tok, ckvs, a.budget, scale, est, target, None)
            res[f"{p}_graph_gpu_ms_est{int(est)}"] = device_ms(lambda: g.select(0, q, tok, ckvs, a.budget, scale, est,
                                                                              target, None), 50, 3)
            t = time.perf_counter()
            for _ in range(20):
                g.select(0, q, tok, ckvs, a.budget, scale, est, target, None)
            res[f"{p}_graph_cpu_ms_est{int(est)}"] = (time.perf_counter() - t) / 20 * 1e3
    for est in (0, 1):
        res[f"kernel_speedup_graph_est{est}"] = res[f"torch_graph_gpu_ms_est{est}"] / res[f"kernel_graph_gpu_ms_est{est}"]
    ref = select_clusters(q[tok], ckvs, a.budget, scale, estimate=True, device_out=True, kernel=False)
    got = select_clusters(q[tok], ckvs, a.budget, scale, estimate=True, device_out=True, kernel=True)
    res["kernel_ids_equal"] = bool(torch.equal(ref.ids, got.ids) and torch.equal(ref.counts, got.counts))
    res["kernel_ids_agree"] = float((ref.ids == got.ids).float().mean())  # bf16 scores: near-ties may differ
    res["kernel_estimate_max_diff"] = float((ref.estimate[0] - got.estimate[0]).abs().max())
    set_config(base)
    # the host attention this feeds (the engine's pool: config pool_threads)
    sel = select_clusters(q[tok], ckvs, a.budget, scale)
    qh = q[tok].cpu()
    for _ in range(3):
        attend(qh, ckvs, sel, scale)
    t = time.perf_counter()
    for _ in range(20):
        attend(qh, ckvs, sel, scale)
    res["host_attend_ms"] = (time.perf_counter() - t) / 20 * 1e3
    res["selected_tokens"] = [int(x.sum()) for x in sel.tokens(ckvs)]
    res["threads"] = torch.get_num_threads()
    from torch.profiler import ProfilerActivity, profile
    for kern in (False, True):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(5):
                select_clusters(q[tok], ckvs, a.budget, scale, estimate=True, no_sync=True, target=target,
                                kernel=kern)
            torch.cuda.synchronize()
        with open(os.path.join(a.out, f"select_gpu_ops_{'kernel' if kern else 'torch'}.txt"), "w") as f:
            f.write(p.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    with open(os.path.join(a.out, "select_gpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
