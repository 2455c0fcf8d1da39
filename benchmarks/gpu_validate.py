"""GPU validation of NELSSA in one vLLM instance (CUDA vLLM 0.26, V1 runner, FlashAttention, CUDA
graphs on): exactness at budget 100% vs NELSSA_OFF (bf16: greedy tokens + logprobs), device blocks
held, and a short throughput check on a Llama-3.1-8B-shaped model with dummy weights.

    python3 benchmarks/gpu_validate.py --out DIR [--only exact|throughput] [--model DIR]

``--model``: a model folder for both checks with dummy weights (``load_format dummy``; e.g. the
Llama-3.1-8B-shaped config of ``nelssa make-dummy-model``) where SmolLM2 cannot be fetched. With
random weights the exactness check is the same comparison of tokens and logprobs; its margins are
those of that model.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from nelssa.bench.harness import equal_prefix, run_subprocess


def compare(on: dict, off: dict) -> dict:
    out = {}
    for rid, b in off["results"].items():
        a = on["results"][rid]
        ta, tb = a["token_ids"], b["token_ids"]
        n = equal_prefix(ta, tb)
        d = {"tokens": len(tb), "equal_prefix": n, "identical": ta == tb}
        if a.get("top2") and b.get("top2"):
            diffs = [abs(x[0][0] - y[0][0]) for x, y in zip(a["top2"][:n], b["top2"][:n])]
            d["max_logprob_diff_on_prefix"] = max(diffs) if diffs else 0.0
            if n < len(tb):
                t2 = b["top2"][n]
                d["baseline_top2_margin_at_divergence"] = t2[0][0] - t2[1][0] if len(t2) > 1 else None
        out[rid] = d
    return out


def exact(model: str, dummy: bool = False, logs: str | None = None) -> dict:
    reqs = [{"id": "long3k", "text_tokens": 3000, "max_tokens": 48},
            {"id": "short200", "text_tokens": 200, "offset": 5000, "max_tokens": 48},
            {"id": "long5k", "text_tokens": 5000, "offset": 20000, "max_tokens": 48},
            {"id": "long7k", "text_tokens": 7000, "offset": 60000, "max_tokens": 48},
            {"id": "chat", "chat": "What is the capital of France?", "max_tokens": 48}]
    spec = {"cuda": True, "model": model, "dtype": "bfloat16", "logprobs": 2, "requests": reqs,
            "nelssa": {"T_input": 2048, "budget": 1.0, "chunk": 128, "segment": 2048,  # segments staged in prefill
                       "defer_below": 0},  # the host path, however much room
            "engine": {"gpu_memory_utilization": 0.3, "max_num_batched_tokens": 2048}}
    if dummy:
        spec["engine"]["load_format"] = "dummy"
    on = run_subprocess({**spec, "mode": "on"}, timeout=900, log_path=logs and os.path.join(logs, "exact_on.log"))
    off = run_subprocess({**spec, "mode": "off"}, timeout=900, log_path=logs and os.path.join(logs, "exact_off.log"))
    held = [s["blocks"].get("long7k") for s in on["steps"] if "long7k" in s["blocks"]]
    held_off = [s["blocks"].get("long7k") for s in off["steps"] if "long7k" in s["blocks"]]
    return {"compare": compare(on, off), "long7k_blocks_on_last": held[-1], "long7k_blocks_off_last": held_off[-1],
            "block_size": on["block_size"], "on_wall_s": on["wall_s"], "off_wall_s": off["wall_s"],
            "final_host_bytes": on["final_host_bytes"], "preemptions": [on["preemptions"], off["preemptions"]],
            "host_totals": on.get("host_totals", {})}


def throughput(dummy: str) -> dict:
    reqs = [{"id": f"long{i}", "text_tokens": 16000, "offset": 37000 * i, "max_tokens": 64} for i in range(4)]
    reqs += [{"id": f"short{i}", "text_tokens": 1000, "offset": 11000 * i + 500, "max_tokens": 64} for i in range(16)]
    spec = {"cuda": True, "model": dummy, "dtype": "bfloat16", "requests": reqs, "max_model_len": 20000,
            "sync_handoff": False,  # hand-offs in the background, as when serving
            "nelssa": {"T_input": 8192, "budget": 0.04, "segment": 4096},
            "engine": {"load_format": "dummy", "gpu_memory_utilization": 0.5, "max_num_batched_tokens": 8192}}
    res = {}
    for mode in ("off", "on"):
        r = run_subprocess({**spec, "mode": mode}, timeout=1200)
        toks = sum(len(x["token_ids"]) for x in r["results"].values())
        res[mode] = {"wall_s": r["wall_s"], "steps": r["num_steps"], "output_tokens": toks,
                     "tok_per_s": toks / r["wall_s"], "preemptions": r["preemptions"],
                     "min_free_blocks": min(s["free_blocks"] for s in r["steps"]), "total_blocks": r["total_blocks"],
                     "host_totals": r.get("host_totals", {})}
    res["speedup"] = res["on"]["tok_per_s"] / res["off"]["tok_per_s"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=None)
    ap.add_argument("--model", default=None, help="model folder, dummy weights (default: SmolLM2 / dummy 8B)")
    a = ap.parse_args()
    from nelssa.models import make_dummy_model, prepare_smollm2
    os.makedirs(a.out, exist_ok=True)
    res: dict = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import torch
        res["device"] = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        res["device"] = repr(e)
    for name, fn in (("exact", lambda: exact(a.model, True, a.out) if a.model else exact(str(prepare_smollm2()), logs=a.out)),
                     ("throughput", lambda: throughput(a.model or str(make_dummy_model())))):
        if a.only and a.only != name:
            continue
        t = time.time()
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001 - record and go on to the next check
            res[name] = {"error": f"{type(e).__name__}: {e}"[-6000:]}
        res[name + "_s"] = time.time() - t
        with open(os.path.join(a.out, "gpu_validate.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(name, json.dumps(res[name], indent=1)[:3000], flush=True)


if __name__ == "__main__":
    main()
