"""`nelssa bench accuracy`: RULER-style needle accuracy at several selection budgets and lengths,
dense (NELSSA_OFF) vs NELSSA, as an accuracy/throughput table and plot (paper Fig. 13).

Builds on ``nelssa.bench.accuracy``: the same needle set (``nelssa.bench.needle``), the same engine
harness (one fresh engine per run, in this CPU's dtype unless --dtype), the same paired verdict. Dense
runs once; NELSSA once per budget. Throughput = (prompt + generated tokens) / the run's engine wall
time (prefill-dominated on this workload; the decode-throughput claims are the serving workloads').

    nelssa bench accuracy [--set ci|full] [--budgets 0.01,0.02,0.04,0.1] [--out DIR]

Writes DIR/accuracy.json (per budget: accuracy, paired verdict vs dense, per-length accuracy, wall
time, tokens/s; per prompt rows) and DIR/accuracy_vs_budget.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from nelssa.bench.common import positive_int, positive_ints


def sweep(model_dir: str, lengths, depths, seed: int, budgets: list[float], *, dtype: str | None = None,
          nelssa: dict | None = None, timeout: float | None = None, max_tokens: int = 12,
          per_haystack: int = 1, T_input: int = 2048) -> dict:
    from transformers import AutoTokenizer

    from nelssa.bench.accuracy import needle_requests, paired_verdict
    from nelssa.bench.harness import run_subprocess
    from nelssa.cpu import cpu_dtype
    tok = AutoTokenizer.from_pretrained(model_dir)
    reqs, want = needle_requests(tok, lengths, depths, seed, max_tokens, per_haystack)
    dtype = dtype or cpu_dtype()
    tokens = sum(len(r["prompt_ids"]) + r["max_tokens"] for r in reqs)
    spec = {"dtype": dtype, "requests": reqs, "max_model_len": max(len(r["prompt_ids"]) for r in reqs) + 64,
            "engine": {"enable_prefix_caching": True}}

    def score(res: dict) -> tuple[list[bool], dict]:
        ok = [v in res["results"][r["id"]]["text"] for r, v in zip(reqs, want)]
        per_len: dict[str, list] = {}
        for r, k in zip(reqs, ok):
            per_len.setdefault(str(len(r["prompt_ids"])), []).append(k)
        return ok, {L: sum(v) / len(v) for L, v in per_len.items()}

    print(f"[accuracy] dense (NELSSA_OFF): {len(reqs)} prompts, {tokens} tokens", file=sys.stderr, flush=True)
    t = time.time()
    off = run_subprocess({**spec, "mode": "off", "nelssa": {}}, timeout=timeout)
    dense_ok, dense_len = score(off)
    out = {"dtype": dtype, "prompts": len(reqs), "tokens": tokens, "lengths": list(lengths), "depths": list(depths),
           "dense": {"accuracy": sum(dense_ok) / len(reqs), "by_length": dense_len, "wall_s": time.time() - t,
                     "tok_s": tokens / (time.time() - t)}, "budgets": {}}
    for b in budgets:
        section = {"T_input": T_input, "defer_below": 0, **(nelssa or {}), "budget": b}  # the host tier measured
        print(f"[accuracy] NELSSA budget {b:g}", file=sys.stderr, flush=True)
        t = time.time()
        on = run_subprocess({**spec, "mode": "on", "nelssa": section}, timeout=timeout)
        wall = time.time() - t
        ok, by_len = score(on)
        out["budgets"][f"{b:g}"] = {"budget": b, "nelssa": section, "accuracy": sum(ok) / len(reqs),
                                    "by_length": by_len,
                                    "verdict": paired_verdict(ok, dense_ok), "wall_s": wall, "tok_s": tokens / wall,
                                    "rows": [{"id": r["id"], "ok": k, "dense_ok": d}
                                             for r, k, d in zip(reqs, ok, dense_ok)]}
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bs = sorted(res["budgets"].values(), key=lambda x: x["budget"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [100 * b["budget"] for b in bs]
    ax.plot(x, [100 * b["accuracy"] for b in bs], marker="o", label="NELSSA (all lengths)")
    for L in res["dense"]["by_length"]:
        ax.plot(x, [100 * b["by_length"].get(L, float("nan")) for b in bs], marker=".", lw=0.8, alpha=0.6,
                label=f"NELSSA {L} tokens")
    ax.axhline(100 * res["dense"]["accuracy"], color="k", ls="--", label="dense (NELSSA_OFF)")
    ax.set_xscale("log")
    ax.set_xticks(x, [f"{v:g}%" for v in x])
    ax.set_xlabel("selection budget")
    ax.set_ylabel("needle accuracy %")
    ax.set_title(f"Needle accuracy vs budget ({res['prompts']} prompts, {res['dtype']})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(res: dict) -> str:
    rows = [f"dense: accuracy {100 * res['dense']['accuracy']:.1f}%  {res['dense']['tok_s']:.0f} tok/s"]
    for k, b in sorted(res["budgets"].items(), key=lambda x: x[1]["budget"]):
        v = b["verdict"]
        rows.append(f"budget {100 * b['budget']:g}%: accuracy {100 * b['accuracy']:.1f}%  {b['tok_s']:.0f} tok/s  "
                    f"lost {v.get('lost')} gained {v.get('gained')} -> {'ok' if v.get('ok') else 'WORSE'}")
    return "\n".join(rows)


def _budgets(text: str) -> list[float]:
    """argparse type: '0.02,0.04' -> [0.02, 0.04], each in (0, 1]."""
    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated numbers expected, got {text!r}") from None
    if not all(0 < v <= 1 for v in vals):
        raise argparse.ArgumentTypeError(f"budgets in (0, 1] expected, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    from nelssa.bench.accuracy import SETS
    ap = argparse.ArgumentParser(prog="nelssa bench accuracy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=sorted(SETS), default="ci")
    ap.add_argument("--lengths", type=positive_ints, default=None,
                    help="comma-separated prompt lengths (overrides the set's)")
    ap.add_argument("--budgets", type=_budgets, default=[0.01, 0.02, 0.04, 0.1])
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default=None, help="results folder (default results/<UTC time>-accuracy)")
    ap.add_argument("--timeout", type=positive_int, default=3600)
    a = ap.parse_args(argv)
    s = dict(SETS[a.set])
    if a.lengths:
        s["lengths"] = tuple(a.lengths)
    if a.model:
        model = a.model
    else:
        from nelssa.models import prepare_smollm2
        model = str(prepare_smollm2())
    out = a.out or os.path.join("results", time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-accuracy")
    os.makedirs(out, exist_ok=True)
    res = sweep(model, s["lengths"], s["depths"], s["seed"], a.budgets, dtype=a.dtype,
                timeout=a.timeout, **{k: s[k] for k in ("per_haystack", "T_input") if k in s})
    res.update(command="nelssa bench accuracy " + " ".join(argv if argv is not None else sys.argv[1:]),
               time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), model=model)
    with open(os.path.join(out, "accuracy.json"), "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(out, "accuracy_vs_budget.png"))
    print(table(res))
    print(f"[accuracy] wrote {out}/accuracy.json and accuracy_vs_budget.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
