"""What NELSSA's scheduler adds to a step before any long request arrives: ``schedule()`` and
``update_from_output()`` wall time per engine step with only short requests running, NELSSA against
``NELSSA_OFF`` (stock vLLM's scheduler), each mode an engine of its own in a subprocess, the same requests.

Issue 9's first target is that, before a long request arrives, NELSSA is stock vLLM. On a GPU the engine's
async scheduling runs ``schedule()`` beside the device's step, so its cost shows in TPOT only where the CPU
side is the step's bound; this measures that CPU side alone, on any machine (a CPU engine: SmolLM2, eager).

    python3 benchmarks/bench_scheduler.py --out DIR [--requests 96] [--tokens 48] [--repeat 2]

Writes scheduler.json: per mode and repeat the mean and p50 microseconds per step of both calls (the
prompts' steps left out), and ``ratio_on_over_off`` of the means (the repeats' medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = "--child"


def child(mode: str, n: int, tokens: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: its scheduler timed here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "3")
    if mode == "off":
        os.environ["NELSSA_OFF"] = "1"
    from vllm import LLM, SamplingParams

    from nelssa.models import prepare_smollm2
    from nelssa.vllm_plugin import engine_args
    kw = dict(model=str(prepare_smollm2()), enforce_eager=True, seed=0, max_model_len=4096, dtype="bfloat16",
              distributed_executor_backend="uni", max_num_seqs=max(256, n))
    if mode == "on":
        kw.update(engine_args({"T_input": 2048}, cuda=False))
    llm = LLM(**kw)
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    times: dict[str, list[float]] = {"schedule": [], "update_from_output": []}

    def timed(name, fn):
        def call(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            times[name].append(time.perf_counter() - t)
            return out
        return call

    sched.schedule = timed("schedule", sched.schedule)
    sched.update_from_output = timed("update_from_output", sched.update_from_output)
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    llm.generate([{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(n)], sp, use_tqdm=False)
    out = {"scheduler": type(sched).__name__}
    for name, v in times.items():
        v = v[5:]  # the first five steps (the prompts' admission and prefill) left out
        out[name] = {"steps": len(v), "mean_us": 1e6 * statistics.fmean(v), "p50_us": 1e6 * statistics.median(v)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=96, help="short requests decoding together")
    ap.add_argument("--tokens", type=int, default=48, help="tokens each generates")
    ap.add_argument("--repeat", type=int, default=2, help="engines per mode, alternating off / on")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for i in range(a.repeat):
        for mode in ("off", "on"):
            t = time.perf_counter()
            p = subprocess.run([sys.executable, __file__, CHILD, mode, str(a.requests), str(a.tokens)],
                               capture_output=True, text=True)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if p.returncode or line is None:
                raise SystemExit(f"bench_scheduler: the {mode} engine failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
            r = json.loads(line[len("RESULT "):])
            runs[mode].append(r)
            print(f"[scheduler] {mode} #{i + 1} ({r['scheduler']}, {time.perf_counter() - t:.0f} s): schedule "
                  f"{r['schedule']['mean_us']:.0f} us, update_from_output {r['update_from_output']['mean_us']:.0f} us "
                  f"a step over {r['schedule']['steps']} steps", flush=True)
    res = {"requests": a.requests, "tokens": a.tokens, "runs": runs, "ratio_on_over_off": {}}
    for name in ("schedule", "update_from_output"):
        on = statistics.median(r[name]["mean_us"] for r in runs["on"])
        off = statistics.median(r[name]["mean_us"] for r in runs["off"])
        res["ratio_on_over_off"][name] = on / off
        res[f"{name}_added_us"] = on - off
    print(f"[scheduler] NELSSA / stock per step: schedule x{res['ratio_on_over_off']['schedule']:.3f} "
          f"({res['schedule_added_us']:+.0f} us), update_from_output x{res['ratio_on_over_off']['update_from_output']:.3f} "
          f"({res['update_from_output_added_us']:+.0f} us)", flush=True)
    with open(os.path.join(a.out, "scheduler.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        print("RESULT " + json.dumps(child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))), flush=True)
    else:
        main()
