"""`nelssa calibrate`: the paper's §4.1 decode-attention latency model measured on this machine, the
crossover L*(N) and the routing threshold T_input it gives.

Per layer of the model shape (default Llama-3.1-8B: 8 KV / 32 query heads, head_dim 128), on the
*device* (the CUDA GPU when present, else the CPU standing in for it):

  * T_dense(L, B): dense decode attention of B requests of L tokens (vLLM's FlashAttention decode
    kernel where it imports on CUDA, else torch SDPA), KV rotated over enough layers that it is not
    cache-resident;
  * T_search(L, B): NELSSA's centroid search (``nelssa.sparse.select_clusters`` called as the plugin
    calls it: with the estimate of the unselected clusters, no sync on CUDA) over L / cluster_size
    centroids on the device;
  * T_host(L, N, B): the host tier's fused sparse-attention kernel (``nelssa.sparse.attend``) over the
    selected clusters, N emulated devices = N x ``threads_per_device`` OpenMP threads of the pool;
  * T_xfer(B): queries and selected ids device -> host, outputs and LSE host -> device (pinned copies
    on CUDA; plain copies on CPU).

The model (§4.1; ``x = B * L * M_kv``, M_kv the KV bytes per token of one layer):

    T_dense(L)    = t_dense0 + x / BW_dev
    T_nelssa(L,N) = t_search0 + x / (C * BW_dev)  +  S * x / (N * BW_host)  +  T_comm(N)
    T_comm(N)     = t_base + N * t_dev + [N > 1] * t_multi

C (compression of the centroid search) comes out of the fitted search slope relative to the dense
slope; S is the measured selected fraction of tokens; BW_host the effective per-device bandwidth
under the kernel's sparse access; T_comm(N) the fixed costs of the host path per N (transfer, call,
dispatch: the host kernel's intercepts plus the measured transfer), least squares over the measured
N (t_multi only where >= 3 distinct N were measured). The fixed terms t_dense0 / t_search0 (kernel
launches) extend the paper's pure-bandwidth forms; with them 0 it is exactly the paper's model.
Crossover (T_dense = T_nelssa):

    L*(N, B) = (t_search0 + T_comm(N) - t_dense0) / (B * M_kv * ((C - 1) / (C * BW_dev) - S / (N * BW_host)))

none where the bracket is <= 0 (the host path never wins: the paper's condition
S / (N BW_host) < (C - 1) / (C BW_dev) fails). ``T_input`` written to the JSON = ceil(L*(N, B)) at the
chosen N (default: the largest measured) and batch (default 1, the paper's per-request model).

    nelssa calibrate [--out DIR] [--contexts 1024,...] [--batches 1,4] [--devices 1,2] [--quick]

Every measurement is the best of ``--reps`` calls (the median is kept beside it). Writes
DIR/calibration.json (fitted parameters, crossovers, every measurement, machine) and
DIR/calibration.png (both curves with the crossover). Point the config at the JSON:
``--nelssa '{"calibration": "DIR/calibration.json"}'`` or ``NELSSA_CALIBRATION=...`` (an explicit
``T_input`` wins).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from nelssa.bench.common import positive_int, positive_ints
from nelssa.config import usable_cores

GiB = 1 << 30
KIND = "nelssa-calibration"
VERSION = 1

SHAPES = {  # per layer: (kv heads, query heads, head_dim)
    "llama-3.1-8b": (8, 32, 128),
    "llama-3.1-70b": (8, 64, 128),
    "smollm2-135m": (3, 9, 64),
}


# ------------------------------------------------------------------ the model

@dataclass
class LatencyModel:
    """The paper's §4.1 model with fitted parameters (seconds, bytes, bytes/s)."""
    M_kv: float                  # KV bytes per token of one layer (K and V, all KV heads)
    bw_dev: float                # device bandwidth of dense decode attention
    t_dense0: float = 0.0        # fixed cost of a dense attention call
    C: float = 16.0              # compression factor of the centroid search
    t_search0: float = 0.0       # fixed cost of the centroid search
    S: float = 0.04              # selected fraction of tokens
    bw_host: float = 1e10        # effective host bandwidth per emulated device
    t_base: float = 0.0          # T_comm: fixed part (transfer, call)
    t_dev: float = 0.0           # T_comm: per device
    t_multi: float = 0.0         # T_comm: dispatch/aggregation when N > 1

    def t_comm(self, N: int) -> float:
        return self.t_base + N * self.t_dev + (self.t_multi if N > 1 else 0.0)

    def t_dense(self, L: float, B: int = 1) -> float:
        return self.t_dense0 + B * L * self.M_kv / self.bw_dev

    def t_search(self, L: float, B: int = 1) -> float:
        return self.t_search0 + B * L * self.M_kv / (self.C * self.bw_dev)

    def t_host(self, L: float, N: int, B: int = 1) -> float:
        """Host sparse attention plus T_comm(N) (what the host path costs beyond the search)."""
        return self.t_comm(N) + self.S * B * L * self.M_kv / (N * self.bw_host)

    def t_nelssa(self, L: float, N: int, B: int = 1) -> float:
        return self.t_search(L, B) + self.t_host(L, N, B)

    def crossover(self, N: int, B: int = 1) -> float | None:
        """L where T_dense = T_nelssa (0.0: the host path is never slower; None: never faster)."""
        slope = (self.C - 1) / (self.C * self.bw_dev) - self.S / (N * self.bw_host)
        fixed = self.t_search0 + self.t_comm(N) - self.t_dense0
        if slope <= 0:
            return 0.0 if fixed < 0 and slope == 0 else None
        return max(0.0, fixed / (B * self.M_kv * slope))


def _lstsq(cols: list[list[float]], y: list[float]) -> list[float]:
    import numpy as np
    a = np.asarray(cols, dtype=float).T
    sol, *_ = np.linalg.lstsq(a, np.asarray(y, dtype=float), rcond=None)
    return [float(v) for v in sol]


C_MAX = 1e4  # cap on C (and on BW ratios) when a cost does not grow with L inside the measured range


def _line(x: list[float], y: list[float]) -> tuple[float, float]:
    """y = a + b x by least squares, relative residuals (points span decades); a < 0 -> refit through 0;
    b <= 0 (no growth with x measurable: noise over a fixed cost) -> a constant, b = 0."""
    w = [1.0 / max(v, 1e-12) for v in y]
    a, b = _lstsq([[wi for wi in w], [xi * wi for xi, wi in zip(x, w)]], [1.0] * len(y))
    if a < 0:
        a, b = 0.0, _lstsq([[xi * wi for xi, wi in zip(x, w)]], [1.0] * len(y))[0]
    if b <= 0:
        a, b = _lstsq([w], [1.0] * len(y))[0], 0.0
    return a, b


def fit(m_kv: float, dense: list[dict], search: list[dict], host: list[dict], xfer: list[dict],
        selected: float, notes: list[str] | None = None) -> LatencyModel:
    """Fit the model to measurements: dense/search rows {L, B, t}, host rows {L, N, B, t}, xfer rows
    {B, t}; ``selected`` = the measured selected fraction S. Degenerate fits (a cost that does not grow
    with L over the measured range) are capped and explained in ``notes``."""
    notes = [] if notes is None else notes
    t_d0, kd = _line([r["B"] * r["L"] * m_kv for r in dense], [r["t"] for r in dense])
    if kd <= 0:
        raise ValueError("dense attention time does not grow with L over the measured contexts: measure longer "
                         "contexts (--contexts)")
    t_s0, ks = _line([r["B"] * r["L"] * m_kv for r in search], [r["t"] for r in search])
    bw_dev = 1.0 / kd
    if ks <= kd / C_MAX:
        notes.append(f"centroid search time did not grow with L over the measured contexts (fixed cost "
                     f"{1e6 * t_s0:.0f} us dominates): C capped at {C_MAX:g}")
        ks = kd / C_MAX
    C = kd / ks
    # host: an intercept per N plus one common slope on x / N (x = B L M_kv), relative residuals
    Ns = sorted({r["N"] for r in host})
    w = [1.0 / max(r["t"], 1e-12) for r in host]
    cols = [[wi * (r["N"] == n) for r, wi in zip(host, w)] for n in Ns]
    cols.append([wi * r["B"] * r["L"] * m_kv / r["N"] for r, wi in zip(host, w)])
    sol = _lstsq(cols, [1.0] * len(host))
    a_n, k_h = dict(zip(Ns, sol[:-1])), sol[-1]
    if k_h <= selected * kd / C_MAX:
        notes.append("host attention time did not grow with L over the measured contexts: BW_host capped at "
                     f"{C_MAX:g} x BW_dev")
        k_h = selected * kd / C_MAX
    bw_host = selected / k_h
    t_x = statistics.median(r["t"] for r in xfer) if xfer else 0.0
    comm = {n: max(0.0, a_n[n]) + t_x for n in Ns}
    # T_comm(N) = t_base + N t_dev + [N > 1] t_multi over the measured N (non-negative terms)
    if len(Ns) >= 3:
        t_base, t_dev, t_multi = _lstsq([[1.0] * len(Ns), [float(n) for n in Ns], [float(n > 1) for n in Ns]],
                                        [comm[n] for n in Ns])
    elif len(Ns) == 2:
        t_base, t_dev, t_multi = *_lstsq([[1.0, 1.0], [float(n) for n in Ns]], [comm[n] for n in Ns]), 0.0
    else:
        t_base, t_dev, t_multi = comm[Ns[0]], 0.0, 0.0
    if t_dev < 0 or t_multi < 0 or t_base < 0:  # keep the paper's additive, non-negative form
        t_multi = max(0.0, t_multi)
        t_dev = max(0.0, t_dev)
        t_base = max(0.0, statistics.mean(comm[n] - n * t_dev - (t_multi if n > 1 else 0) for n in Ns))
    return LatencyModel(M_kv=m_kv, bw_dev=bw_dev, t_dense0=t_d0, C=C, t_search0=t_s0, S=selected,
                        bw_host=bw_host, t_base=t_base, t_dev=t_dev, t_multi=t_multi)


def t_input_of(model: LatencyModel, N: int, B: int = 1) -> int | None:
    L = model.crossover(N, B)
    return None if L is None else max(1, math.ceil(L))


def calibration_doc(model: LatencyModel, Ns: list[int], batches: list[int], N: int, B: int,
                    measurements: dict | None = None, **extra: Any) -> dict:
    """The calibration JSON (``T_input`` at N devices and batch B; crossovers for every (N, B))."""
    cross = {str(n): {str(b): model.crossover(n, b) for b in batches} for n in Ns}
    doc = {"kind": KIND, "version": VERSION, "T_input": t_input_of(model, N, B), "T_input_at": {"N": N, "batch": B},
           "model": asdict(model), "crossover_tokens": cross,
           "derived": {"bw_dev_GBps": model.bw_dev / 1e9, "bw_host_per_device_GBps": model.bw_host / 1e9,
                       "t_comm_us": {str(n): 1e6 * model.t_comm(n) for n in Ns},
                       "paper_condition_holds": {str(n): model.S / (n * model.bw_host) <
                                                 (model.C - 1) / (model.C * model.bw_dev) for n in Ns},
                       # what the condition asks of the host tier: N * BW_host > S * BW_dev * C / (C - 1)
                       # (none: C <= 1, the centroid search alone costs more per token than dense attention)
                       "host_bw_needed_total_GBps": (model.S * model.bw_dev * model.C / (model.C - 1) / 1e9
                                                     if model.C > 1 else None),
                       "host_bw_total_GBps": {str(n): n * model.bw_host / 1e9 for n in Ns}}}
    if measurements is not None:
        doc["measurements"] = measurements
    doc.update(extra)
    return doc


def load(path: str) -> tuple[LatencyModel, dict]:
    with open(path) as f:
        doc = json.load(f)
    if doc.get("kind") != KIND:
        raise ValueError(f"{path} is not a NELSSA calibration (kind {doc.get('kind')!r})")
    return LatencyModel(**doc["model"]), doc


# ------------------------------------------------------------------ measurements

def _device():
    import torch
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _timer(dev, fn, reps: int, warm: int = 2) -> list[float]:
    """Per-call seconds of fn(i) (CUDA: events around each call, device synchronised)."""
    import torch
    for i in range(warm):
        fn(i)
    out = []
    for i in range(reps):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(i)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def _stat(ts: list[float]) -> dict:
    """A measurement: ``t`` = the best of the repetitions (what the fit uses: on a shared machine the
    slower ones measure the neighbours' load; the 2-core box's medians swung 3x between neighbours), and
    the median."""
    return {"t": min(ts), "t_median": statistics.median(ts)}


def _dense_fn(dev):
    """(name, fn(q [B, Hq, D], k, v) -> out, layout) of the device's dense decode attention; ``layout``
    "BLHD": k/v contiguous [B, L, H, D] (vLLM's FlashAttention decode kernel, where it imports);
    "BHLD": k/v contiguous [B, H, L, D] (torch)."""
    import torch
    if dev.type == "cuda":
        try:
            from vllm.vllm_flash_attn import flash_attn_with_kvcache

            def fa(q, k, v):
                return flash_attn_with_kvcache(q.unsqueeze(1), k, v, causal=True)
            return "vllm_flash_attn.flash_attn_with_kvcache", fa, "BLHD"
        except Exception:  # noqa: BLE001 - fall back to torch's kernel
            pass

        def sdpa(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True)
        return "torch.sdpa (enable_gqa)", sdpa, "BHLD"

    def gqa(q, k, v):
        """One pass over K and one over V per KV head (the GQA group as the GEMM's rows): torch's CPU SDPA
        with enable_gqa expands K/V per query head (4x the bytes) and ran at < 1 GB/s here."""
        B, H, L, D = k.shape
        s = torch.matmul(q.view(B, H, -1, D), k.transpose(-1, -2)) * D ** -0.5
        return torch.matmul(torch.softmax(s.float(), -1).to(v.dtype), v)
    return "torch GQA matmul (CPU)", gqa, "BHLD"


class _Progress:
    def __init__(self, total: int, label: str = "calibrate") -> None:
        self.total, self.n, self.t0, self.label = total, 0, time.time(), label

    def step(self, what: str) -> None:
        self.n += 1
        el = time.time() - self.t0
        eta = el / self.n * (self.total - self.n)
        bar = "#" * int(24 * self.n / self.total)
        print(f"[{self.label}] [{bar:<24}] {self.n}/{self.total} {what}  {el:5.0f}s elapsed, ~{eta:.0f}s left",
              file=sys.stderr, flush=True)


def measure(contexts: list[int], batches: list[int], devices: list[int], *, shape=(8, 32, 128), dtype=None,
            budget: float | None = None, threads_per_device: int = 1, reps: int = 10,
            target_bytes: int = 256 << 20, mem_frac: float = 0.4) -> dict:
    """Run every measurement; returns {dense, search, host, xfer: rows, selected: S, meta}."""
    import torch

    from nelssa.bench.sparse_attention import synthetic_ckv
    from nelssa.config import get_config, mem_available, set_config
    from nelssa.sparse import attend, select_clusters
    cfg = get_config()
    dev = _device()
    if dtype is None:
        if dev.type == "cuda":
            dtype = torch.bfloat16
        else:
            from nelssa.cpu import cpu_dtype
            dtype = getattr(torch, cpu_dtype())
    budget = cfg.budget if budget is None else budget
    H, Hq, D = shape
    esz = torch.tensor([], dtype=dtype).element_size()
    m_kv = 2 * H * D * esz
    gen = torch.Generator().manual_seed(0)
    allow = mem_frac * mem_available()
    dense_name, dense, layout = _dense_fn(dev)
    cases = [(L, B) for L in contexts for B in batches]
    prog = _Progress(len(cases) * (2 + len(devices)))
    rows: dict[str, list] = {"dense": [], "search": [], "host": [], "xfer": []}
    sel_fracs: list[float] = []
    host_threads = os.cpu_count() or 1
    for L, B in cases:
        req = B * L * m_kv
        if 2 * req > allow:  # dense copy + host copy
            print(f"[calibrate] skip L={L} B={B}: {2 * req / GiB:.1f} GiB > {allow / GiB:.1f} GiB allowed",
                  file=sys.stderr, flush=True)
            prog.n += 2 + len(devices)
            continue
        layers = max(1, min(8, int(target_bytes // req) + 1, int(allow // (2 * req))))
        # dense: KV [B, L, H, D] per rotated layer
        def kv():
            shape = (B, L, H, D) if layout == "BLHD" else (B, H, L, D)
            return torch.randn(shape, generator=gen).to(dtype).to(dev)
        ks = [kv() for _ in range(layers)]
        vs = [kv() for _ in range(layers)]
        qd = torch.randn(B, Hq, D, generator=gen).to(dtype).to(dev)
        if dev.type == "cpu":
            torch.set_num_threads(host_threads)
        ts = _timer(dev, lambda i: dense(qd, ks[i % layers], vs[i % layers]), reps)
        rows["dense"].append({"L": L, "B": B, **_stat(ts), "layers": layers})
        del ks, vs
        prog.step(f"dense L={L} B={B}: {1e3 * rows['dense'][-1]['t']:.3f} ms")
        # host-tier data (synthetic clustered layout) and device centroids of the same clusters
        hl = max(1, min(16, int(target_bytes // max(1.0, req * budget)) + 1, int(allow // (2 * req))))
        data = [[synthetic_ckv(L, H, D, dtype, gen, cfg.cluster_size) for _ in range(B)] for _ in range(hl)]
        ddata = []
        for layer in data:
            dl = []
            for c in layer:
                d = copy.copy(c)
                d.centroids = c.centroids.to(dev)
                d.sizes = c.sizes.to(dev)
                d.vmeans = torch.randn(c.centroids.shape, generator=gen).to(dtype).to(dev)
                dl.append(d)
            ddata.append(dl)
        n = max(reps, hl)
        qs = [torch.randn(B, Hq, D, generator=gen).to(dtype) for _ in range(n)]
        qdev = [q.to(dev) for q in qs]
        if dev.type == "cpu":
            torch.set_num_threads(host_threads)
        # as the plugin calls it (attention.py): with the estimate, ids to pinned memory without a sync on
        # CUDA (the timer synchronises after each call)
        ts = _timer(dev, lambda i: select_clusters(qdev[i % n], ddata[i % hl], budget, estimate=cfg.estimate,
                                                   no_sync=dev.type == "cuda"), reps)
        rows["search"].append({"L": L, "B": B, **_stat(ts), "clusters": data[0][0].num_clusters})
        prog.step(f"search L={L} B={B}: {1e3 * rows['search'][-1]['t']:.3f} ms")
        sels = [select_clusters(qs[i], data[i % hl], budget) for i in range(n)]
        for i, s in enumerate(sels):
            sel_fracs.append(sum(int(x.sum()) for x in s.tokens(data[i % hl])) / (B * H * L))
        # transfer: q + ids to the host, out + lse back
        qh = torch.empty(B, Hq, D, dtype=dtype, pin_memory=dev.type == "cuda")
        idh = [x.clone() for x in sels[0].ids]
        out_h = torch.empty(B, Hq, D + 1, dtype=torch.float32, pin_memory=dev.type == "cuda")
        out_d = torch.empty(B, Hq, D + 1, dtype=torch.float32, device=dev)

        def xfer(i):
            qh.copy_(qdev[i % n], non_blocking=True)
            if dev.type == "cuda":
                for x in idh:
                    x.to(dev, non_blocking=True)
            out_d.copy_(out_h, non_blocking=True)
        ts = _timer(dev, xfer, reps)
        rows["xfer"].append({"L": L, "B": B, **_stat(ts)})
        for N in devices:
            set_config(cfg.replace(pool_threads=N * threads_per_device))
            ts = _timer(dev, lambda i: attend(qs[i % n], data[i % hl], sels[i % n]), max(reps, hl), warm=min(hl, 4))
            rows["host"].append({"L": L, "N": N, "B": B, **_stat(ts), "threads": N * threads_per_device})
            prog.step(f"host L={L} B={B} N={N}: {1e3 * rows['host'][-1]['t']:.3f} ms")
        set_config(cfg)
        del data, ddata, sels
    meta = {"device": (torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"), "dense_kernel": dense_name,
            "dtype": str(dtype).replace("torch.", ""), "shape": {"kv_heads": H, "q_heads": Hq, "head_dim": D},
            "M_kv_bytes": m_kv, "budget": budget, "cluster_size": cfg.cluster_size, "estimate": cfg.estimate,
            "threads_per_device": threads_per_device, "reps": reps}
    return {**rows, "selected": statistics.mean(sel_fracs) if sel_fracs else budget, "meta": meta}


# ------------------------------------------------------------------ plot

def plot(model: LatencyModel, meas: dict | None, Ns: list[int], path: str, B: int = 1, title: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    Ls = sorted({r["L"] for r in (meas or {}).get("dense", [])}) or [1024, 131072]
    lo, hi = min(Ls) / 2, max(Ls) * 4
    for n in Ns:
        c = model.crossover(n, B)
        if c:
            lo, hi = min(lo, c / 2), max(hi, c * 2)
    x = np.geomspace(max(16, lo), hi, 200)
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(x, [1e3 * model.t_dense(v, B) for v in x], color="k", label="T_dense (model)")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, n in enumerate(Ns):
        col = colors[j % len(colors)]
        ax.plot(x, [1e3 * model.t_nelssa(v, n, B) for v in x], color=col, label=f"T_nelssa N={n} (model)")
        c = model.crossover(n, B)
        if c:
            ax.axvline(c, color=col, ls=":", lw=1)
            ax.annotate(f"L*={c:,.0f}", (c, 1e3 * model.t_dense(c, B)), color=col, fontsize=8,
                        xytext=(4, -12), textcoords="offset points")
    if meas:
        d = [r for r in meas["dense"] if r["B"] == B]
        ax.scatter([r["L"] for r in d], [1e3 * r["t"] for r in d], color="k", marker="o", s=18,
                   label="dense (measured)")
        srch = {r["L"]: r["t"] for r in meas["search"] if r["B"] == B}
        xf = {r["L"]: r["t"] for r in meas["xfer"] if r["B"] == B}
        for j, n in enumerate(Ns):
            h = [r for r in meas["host"] if r["B"] == B and r["N"] == n and r["L"] in srch]
            ax.scatter([r["L"] for r in h], [1e3 * (r["t"] + srch[r["L"]] + xf.get(r["L"], 0)) for r in h],
                       color=colors[j % len(colors)], marker="x", s=22)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context length L (tokens)")
    ax.set_ylabel(f"decode attention per layer, batch {B} (ms)")
    ax.set_title(title or "NELSSA calibration (x: measured search + host + transfer)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def describe(doc: dict) -> str:
    m = doc["model"]
    lines = [f"M_kv {m['M_kv']:.0f} B/token/layer",
             f"dense:  BW_dev {m['bw_dev'] / 1e9:.2f} GB/s, t_dense0 {1e6 * m['t_dense0']:.1f} us",
             f"search: C {m['C']:.2f}, t_search0 {1e6 * m['t_search0']:.1f} us",
             f"host:   S {m['S']:.4f}, BW_host per device {m['bw_host'] / 1e9:.2f} GB/s",
             f"T_comm: t_base {1e6 * m['t_base']:.1f} us + N x {1e6 * m['t_dev']:.1f} us"
             f" + [N>1] {1e6 * m['t_multi']:.1f} us"]
    for n, per_b in doc["crossover_tokens"].items():
        lines.append(f"L*(N={n}): " + ", ".join(f"batch {b}: {'never' if v is None else f'{v:,.0f}'}"
                                                 for b, v in per_b.items()))
    d = doc.get("derived", {})
    if "host_bw_needed_total_GBps" in d:
        need = d["host_bw_needed_total_GBps"]
        lines.append("host path can win only if N x BW_host > S x BW_dev x C/(C-1) = " +
                     (f"{need:.1f} GB/s" if need is not None else "impossible (C <= 1: the centroid search alone "
                      "costs more per token than dense attention)") + "; measured N x BW_host: " +
                     ", ".join(f"N={n}: {v:.1f}" for n, v in d["host_bw_total_GBps"].items()))
    at = doc["T_input_at"]
    lines.append(f"T_input = {doc['T_input']} (N={at['N']}, batch {at['batch']})")
    return "\n".join(lines)


def _refit(a, argv) -> int:
    with open(a.refit) as f:
        old = json.load(f)
    meas = old["measurements"]
    Ns = sorted({r["N"] for r in meas["host"]})
    batches = sorted({r["B"] for r in meas["dense"]})
    notes: list[str] = []
    model = fit(meas["meta"]["M_kv_bytes"], meas["dense"], meas["search"], meas["host"], meas["xfer"],
                meas["selected"], notes)
    N = a.N or max(Ns)
    B = a.batch if a.batch in batches else batches[0]
    keep = {k: old[k] for k in ("shape_name", "machine", "command", "time", "wall_s") if k in old}
    doc = calibration_doc(model, Ns, batches, N, B, meas, fit_notes=notes, refit_of=os.path.abspath(a.refit), **keep)
    out = a.out or os.path.dirname(os.path.abspath(a.refit))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "calibration.json"), "w") as f:
        json.dump(doc, f, indent=1)
    m = doc.get("machine", {})
    plot(model, meas, Ns, os.path.join(out, "calibration.png"), B,
         f"{doc.get('shape_name', '')} layer, {meas['meta']['dtype']}, device {m.get('device')}, host {m.get('cpu')}")
    print(describe(doc))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nelssa calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default results/<UTC time>-calibrate)")
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--contexts", type=positive_ints, default=None,
                    help="comma-separated L (default: 1K..32K on CPU, 1K..128K on CUDA)")
    ap.add_argument("--batches", type=positive_ints, default=[1, 4])
    ap.add_argument("--devices", type=positive_ints, default=None,
                    help="emulated device counts N (default: powers of 2 up to the cores)")
    ap.add_argument("--threads-per-device", type=positive_int, default=1)
    ap.add_argument("--budget", type=float, default=None, help="selection budget (default: the config's)")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                    help="KV dtype (default: bf16 on CUDA, nelssa.cpu's decision on CPU)")
    ap.add_argument("--reps", type=positive_int, default=10)
    ap.add_argument("--target-mb", type=positive_int, default=256,
                    help="bytes rotated per measurement (defeats caches)")
    ap.add_argument("--N", type=positive_int, default=None, help="device count T_input is chosen at (default: largest)")
    ap.add_argument("--batch", type=positive_int, default=1, help="batch T_input is chosen at")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke run, seconds)")
    ap.add_argument("--refit", default=None, metavar="JSON",
                    help="no measuring: fit an existing calibration's measurements again (e.g. another --N/--batch), "
                         "write the JSON and plot to --out")
    a = ap.parse_args(argv)
    if a.budget is not None and not 0 < a.budget <= 1:
        ap.error(f"--budget must be in (0, 1], got {a.budget}")
    if a.refit:
        if not os.path.isfile(a.refit):
            ap.error(f"--refit {a.refit}: no such file")
        return _refit(a, argv)
    import torch
    cuda = torch.cuda.is_available()
    cores = len(usable_cores())
    if a.contexts:
        contexts = a.contexts
    elif a.quick:
        contexts = [512, 1024, 2048, 4096]
    else:
        contexts = [1024 << i for i in range(8 if cuda else 6)]
    batches = a.batches if not a.quick else [1]
    if a.devices:
        Ns = a.devices
    else:
        Ns = [1 << i for i in range(8) if (1 << i) * a.threads_per_device <= cores] or [1]
    N = a.N or max(Ns)
    B = a.batch if a.batch in batches else batches[0]
    out = a.out or os.path.join("results", time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-calibrate")
    os.makedirs(out, exist_ok=True)
    dtype = getattr(torch, a.dtype) if a.dtype else None
    t0 = time.time()
    meas = measure(contexts, batches, Ns, shape=SHAPES[a.shape], dtype=dtype, budget=a.budget,
                   threads_per_device=a.threads_per_device, reps=2 if a.quick else a.reps,
                   target_bytes=(8 << 20) if a.quick else a.target_mb << 20)
    notes: list[str] = []
    model = fit(meas["meta"]["M_kv_bytes"], meas["dense"], meas["search"], meas["host"], meas["xfer"],
                meas["selected"], notes)
    for n in notes:
        print(f"[calibrate] note: {n}", file=sys.stderr)
    from nelssa.cpu import cpu_model
    machine = {"cpu": cpu_model(), "cores": cores, "device": meas["meta"]["device"]}
    doc = calibration_doc(model, Ns, batches, N, B, meas, shape_name=a.shape, machine=machine, fit_notes=notes,
                          command="nelssa calibrate " + " ".join(argv if argv is not None else sys.argv[1:]),
                          time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), wall_s=time.time() - t0)
    path = os.path.join(out, "calibration.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    plot(model, meas, Ns, os.path.join(out, "calibration.png"), B,
         f"{a.shape} layer, {meas['meta']['dtype']}, device {machine['device']}, host {machine['cpu']}")
    print(describe(doc))
    print(f"[calibrate] wrote {path} and calibration.png ({time.time() - t0:.0f} s); use it with "
          f"--nelssa '{{\"calibration\": \"{path}\"}}' or NELSSA_CALIBRATION={path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
