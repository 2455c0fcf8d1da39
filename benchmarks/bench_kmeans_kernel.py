"""The k-means of a background move on CUDA: kmeans_kernel.py's Triton kernels against the torch path, per
iteration and for a whole segmented clustering, at a move's shape (one group of ``--layers`` layers of
Llama-3.1-8B's 8 KV heads of 128 stacked along the head axis, one ``--segment``-token segment, 8 tokens
per cluster, bf16 similarities).

    python3 benchmarks/bench_kmeans_kernel.py --out DIR [--layers 16] [--segment 8192]
        [--configs 64x64x4,128x64x4,...]   # BLOCK_N x BLOCK_C x num_warps of the assignment

Per iteration (CUDA events, ms): ``torch`` (bf16 bmm into fp32 logits, argmax, the one-scatter update:
kmeans._kmeans's loop body) and its ``torch_assign`` (bmm + argmax); per tiling, ``assign`` (the fused
assignment alone), ``iteration`` (zeroed sums, assignment with the sums' atomics, finish) and
``agree`` (the fraction of labels equal to the torch argmax's; the rest must be near-ties, ``near_tie``).
Then ``segmented_kmeans`` with kernels and in torch (s), and whether their partitions are equal.
Writes kmeans_kernel.json; needs no vLLM. Without CUDA it runs on the CPU in Triton's interpreter
(``TRITON_INTERPRET=1``, small shapes: a check of the script, its times meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from nelssa.bench.common import device_ms
from nelssa.sparse import kmeans, kmeans_kernel as kk

KV_HEADS, HEAD_DIM = 8, 128  # Llama-3.1-8B
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def keys_like(H: int, n: int, C: int, g: torch.Generator) -> torch.Tensor:
    """Keys with structure: C directions per head, tokens near them (a clustering's atomics contend on the
    clusters that real keys fill unevenly), mean-centred and normalised as _kmeans does."""
    centers = torch.randn(H, C, HEAD_DIM, generator=g)
    pick = (torch.rand(H, n, generator=g) ** 2 * C).long()  # skewed: low ids fuller
    x = centers.gather(1, pick.unsqueeze(-1).expand(H, n, HEAD_DIM)) + 0.5 * torch.randn(H, n, HEAD_DIM, generator=g)
    x -= x.mean(dim=1, keepdim=True)
    return kmeans._normalize(x)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--segment", type=int, default=8192)
    ap.add_argument("--cluster-size", type=int, default=8)
    ap.add_argument("--configs", default="64x64x4,128x64x4,128x64x8,64x128x4,128x128x8,64x32x4")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    H, n, D = a.layers * KV_HEADS, a.segment, HEAD_DIM
    C = n // a.cluster_size
    g = torch.Generator().manual_seed(0)
    x32 = keys_like(H, n, C, g).to(DEV)
    sd = kmeans.similarity_dtype(x32.device)  # bf16 on CUDA
    x = x32.to(sd)
    cent32 = x32[:, torch.randperm(n, generator=g)[:C].to(DEV)].contiguous()
    cent = cent32.to(sd)
    flop = 2 * H * n * C * D
    res: dict = {"device": torch.cuda.get_device_name(0) if CUDA else "cpu (interpreter)",
                 "shape": dict(H=H, n=n, C=C, D=D, layers=a.layers),
                 "gflop_per_assign": flop / 1e9}

    def tflops(ms: float) -> float:
        return round(flop / ms / 1e9, 1)

    logits = kmeans._logits(x, cent.transpose(1, 2))
    want = logits.argmax(-1)
    best = logits.max(-1).values
    xs1 = torch.cat([x32, x32.new_ones(H, n, 1)], -1)

    def torch_iter():
        lab = kmeans._logits(x, cent.transpose(1, 2)).argmax(-1)
        kmeans._update(xs1, lab, cent32)

    res["torch_assign_ms"] = device_ms(lambda: kmeans._logits(x, cent.transpose(1, 2)).argmax(-1))
    res["torch_ms"] = device_ms(torch_iter)
    print(f"[kmeans] {res['device']}: H {H} n {n} C {C} D {D}; torch: iteration {res['torch_ms']:.2f} ms, "
          f"bmm+argmax {res['torch_assign_ms']:.2f} ms ({tflops(res['torch_assign_ms'])} TFLOP/s)", flush=True)
    lab = torch.empty(H, n, dtype=torch.long, device=DEV)
    sums = torch.zeros(H, C, D + 1, device=DEV)
    cf, cs = cent32.clone(), cent.clone()
    res["configs"] = {}
    for spec in a.configs.split(","):
        bn, bc, nw = (int(v) for v in spec.split("x"))
        kw = dict(block_n=bn, block_c=bc, num_warps=nw)
        try:
            t0 = time.perf_counter()
            kk.assign(x, cent, lab, **kw)
            sync()
            compile_s = time.perf_counter() - t0
            top = logits.gather(-1, lab.unsqueeze(-1)).squeeze(-1)  # the score of each label, by the torch path
            r = {"compile_s": round(compile_s, 2), "agree": (lab == want).float().mean().item(),
                 "near_tie": bool((top >= best - 2e-2).all().item())}
            r["assign_ms"] = device_ms(lambda: kk.assign(x, cent, lab, **kw))

            def it():
                sums.zero_()
                kk.assign(x, cs, lab, sums, **kw)
                kk.finish(sums, cf, cs)

            r["iteration_ms"] = device_ms(it)
            r["assign_tflops"] = tflops(r["assign_ms"])
            r["speedup_vs_torch"] = round(res["torch_ms"] / r["iteration_ms"], 2)
        except Exception as e:  # noqa: BLE001 - a tiling that does not compile or fit is reported, not fatal
            r = {"error": f"{type(e).__name__}: {e}"[:300]}
        res["configs"][spec] = r
        print(f"[kmeans] {spec}: {r}", flush=True)
        cf.copy_(cent32)
        cs.copy_(cent)
    # a whole clustering of the group, as a move runs it (the defaults' tiling)
    del logits
    labels = {}
    for kern in (True, False):
        kmeans.segmented_kmeans(x, seed=1, cluster_size=a.cluster_size, segment=a.segment, kernels=kern)
        sync()
        t0 = time.perf_counter()
        labels[kern], _ = kmeans.segmented_kmeans(x, seed=1, cluster_size=a.cluster_size, segment=a.segment,
                                                  kernels=kern)
        sync()
        res["kmeans_kernel_s" if kern else "kmeans_torch_s"] = time.perf_counter() - t0
    same = (labels[True] == labels[False]).float().mean().item()
    res["kmeans_labels_equal_frac"] = same
    print(f"[kmeans] segmented_kmeans, {a.layers} layers: kernels {res['kmeans_kernel_s']:.3f} s, torch "
          f"{res['kmeans_torch_s']:.3f} s; labels equal {same:.4f}", flush=True)
    with open(os.path.join(a.out, "kmeans_kernel.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
