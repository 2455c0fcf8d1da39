"""`nelssa` command line: prepare-model, make-dummy-model, bench-sparse."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nelssa")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare-model", help="SmolLM2-135M-Instruct as an HF bf16 folder (cached); prints its path")
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    d = sub.add_parser("make-dummy-model", help="model-shaped config + tokenizer for vLLM load_format=dummy")
    d.add_argument("--shape", default="llama-3.1-8b")
    d.add_argument("--out", default=None)
    b = sub.add_parser("bench-sparse", help="host sparse-attention benchmark (see nelssa.bench.sparse_attention)")
    b.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.cmd == "prepare-model":
        from nelssa.models import prepare_smollm2
        print(prepare_smollm2(force=a.force))
    elif a.cmd == "make-dummy-model":
        from nelssa.models import make_dummy_model
        print(make_dummy_model(a.shape, a.out))
    elif a.cmd == "bench-sparse":
        from nelssa.bench.sparse_attention import main as bench
        bench(a.args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
