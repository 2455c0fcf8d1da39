"""NELSSA vs the NELSSA_OFF baseline on one vLLM engine workload (in-process engines, one per mode).

Default workload: 3K/5K/7K-token prompts of real text plus short chats in one batch, fp32, 70 KV
blocks of 128 tokens, chunked prefill. Modes: NELSSA at budget 100% (outputs must match the baseline
token for token), NELSSA at the sparse budget (default 4%: tokens equal to the baseline's, counted
per request up to the first difference) and NELSSA_OFF. Reports per mode: device blocks held by each
long request after its prompt, steps, preemptions, wall time, host-tier bytes left at the end, and
the host tier's totals (clustering seconds, host attention seconds and calls, moved tokens).

    python -m nelssa.bench.compare [--out results.json] [--budget 0.04] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os

from nelssa.bench.harness import equal_prefix, run_subprocess


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/nelssa_vs_baseline.json")
    ap.add_argument("--budget", type=float, default=0.04, help="the sparse budget (100%% always runs too)")
    ap.add_argument("--dtype", default="float32",
                    help="engine dtype; float32 (exact on every CPU) so budget 100%% can be compared token for token")
    ap.add_argument("--blocks", type=int, default=70)
    a = ap.parse_args(argv)
    reqs = [{"id": "long3k", "text_tokens": 3000, "max_tokens": 32},
            {"id": "short200", "text_tokens": 200, "offset": 5000, "max_tokens": 32},
            {"id": "long5k", "text_tokens": 5000, "offset": 20000, "max_tokens": 32},
            {"id": "long7k", "text_tokens": 7000, "offset": 60000, "max_tokens": 32},
            {"id": "chat", "chat": "What is the capital of France?", "max_tokens": 32}]
    spec = {"dtype": a.dtype, "requests": reqs, "nelssa": {"T_input": 2048, "budget": 1.0, "chunk": 128, "defer_below": 0},
            "engine": {"num_gpu_blocks_override": a.blocks, "max_num_batched_tokens": 1024}}
    res = {"on": run_subprocess({**spec, "mode": "on"}),
           "on_sparse": run_subprocess({**spec, "mode": "on", "nelssa": {**spec["nelssa"], "budget": a.budget}}),
           "off": run_subprocess({**spec, "mode": "off"})}
    from nelssa.cpu import describe
    summary = {"workload": spec, "cpu": describe(), "modes": {}}
    for m, r in res.items():
        held = {}
        for rid in ("long3k", "long5k", "long7k"):
            seq = [s["blocks"][rid] for s in r["steps"] if rid in s["blocks"]]
            held[rid] = seq[-1] if seq else None
        summary["modes"][m] = {"steps": r["num_steps"], "wall_s": round(r["wall_s"], 2),
                               "preemptions": r["preemptions"], "blocks_held_at_end": held,
                               "final_host_bytes": r["final_host_bytes"], "block_size": r["block_size"],
                               "host_totals": r.get("host_totals", {})}
    summary["identical_outputs"] = {rid: res["on"]["results"][rid]["token_ids"] == x["token_ids"]
                                    for rid, x in res["off"]["results"].items()}

    summary[f"sparse_budget_{a.budget}_tokens_equal_to_baseline"] = {
        rid: f'{equal_prefix(res["on_sparse"]["results"][rid]["token_ids"], x["token_ids"])}/{len(x["token_ids"])}'
        for rid, x in res["off"]["results"].items()}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "workload"}, indent=1))


if __name__ == "__main__":
    main()
