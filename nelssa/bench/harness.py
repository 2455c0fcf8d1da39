"""Run a vLLM engine in-process (NELSSA on or off), step by step, and record what happened.

Used by the integration tests (in a fresh subprocess each) and by the memory/accuracy reports:
per step and request the device blocks held, free blocks, host-tier bytes; at the end the outputs
(token ids, logprobs, finish reasons), preemptions, aborts. Prints one JSON object.

    python -m nelssa.bench.harness '{"mode": "on", "nelssa": {"budget": 1.0}, "requests": [...]}'

Spec "sync_handoff" (default true): after each step wait for NELSSA's background hand-offs, so the
switch to host attention comes at deterministic steps (a run of `nelssa bench hol` keeps them
asynchronous, as in serving).
A request: {"id", "prompt_ids" | "text_tokens": n (+ "offset") | "chat": str, "max_tokens",
"abort_at_step"?, "abort_on_migrate"?, "add_at_step"?, "after"?, "extra_args"?, "priority"?}. "after":
the id of an earlier request; added in the step after that one finished. "extra_args": the request's
SamplingParams.extra_args (e.g. {"nelssa_offload": false}). "abort_on_migrate": aborted after
the first step in which NELSSA's scheduler is migrating it (anchor set, not yet switched); listed in
the output's "aborted_migrating".
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _rss_mb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


def _engine(spec: dict):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if "kv_space_gib" in spec:  # CPU KV cache size; vLLM's CPU default is most of RAM
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec["kv_space_gib"])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "3")
    if spec["mode"] == "off":
        os.environ["NELSSA_OFF"] = "1"
    from vllm import LLM

    from nelssa.models import prepare_smollm2
    from nelssa.vllm_plugin import engine_args

    cuda = bool(spec.get("cuda"))
    kw: dict[str, Any] = dict(model=spec.get("model") or str(prepare_smollm2()), enforce_eager=not cuda, seed=0,
                              max_model_len=spec.get("max_model_len", 8192), dtype=spec.get("dtype", "float32"),
                              distributed_executor_backend="uni", disable_log_stats=False)
    kw.update(spec.get("engine", {}))
    if spec["mode"] == "on":
        kw.update(engine_args(spec.get("nelssa", {}), cuda=cuda))
    return LLM(**kw)


def _prompt_ids(tok, r: dict) -> list[int]:
    if "prompt_ids" in r:
        return list(r["prompt_ids"])
    if "chat" in r:
        return tok.apply_chat_template([{"role": "user", "content": r["chat"]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
    from nelssa.bench.corpus import text_of_tokens
    n = r["text_tokens"]
    return tok.encode(text_of_tokens(tok, n, r.get("offset", 0)), add_special_tokens=False)[:n]


def run(spec: dict) -> dict:
    from vllm import SamplingParams

    llm = _engine(spec)
    eng = llm.llm_engine
    core = eng.engine_core.engine_core
    sched = core.scheduler
    kvm = sched.kv_cache_manager
    worker = core.model_executor.driver_worker.worker
    runner = worker.model_runner
    host = getattr(runner, "nelssa_host", None)
    sync_handoff = spec.get("sync_handoff", True) and getattr(runner, "nelssa_handoff", None) is not None
    tok = llm.get_tokenizer()

    reqs = spec["requests"]
    ids = {r["id"]: _prompt_ids(tok, r) for r in reqs}
    pending, earlier = list(reqs), set()
    for r in reqs:
        if "after" in r and r["after"] not in earlier:
            raise ValueError(f"request {r['id']!r}: 'after' must name an earlier request, not {r['after']!r}")
        earlier.add(r["id"])
    internal: dict[str, str] = {}  # our id -> scheduler id
    seen: dict[str, Any] = {}
    results: dict[str, dict] = {}
    aborted_migrating: list[str] = []
    steps: list[dict] = []
    t0 = time.time()
    step = 0
    while step < spec.get("max_steps", 100000):
        due = [r for r in pending if r.get("add_at_step", 0) <= step and ("after" not in r or r["after"] in results)]
        for r in due:
            pending.remove(r)
            sp = SamplingParams(temperature=0, max_tokens=r.get("max_tokens", 16), ignore_eos=True,
                                logprobs=spec.get("logprobs"), extra_args=r.get("extra_args"))
            internal[r["id"]] = eng.add_request(r["id"], {"prompt_token_ids": ids[r["id"]]}, sp,
                                                priority=r.get("priority", 0))
        for r in reqs:
            rid = internal.get(r["id"])
            if r.get("abort_on_migrate") and r["id"] not in results and rid in getattr(sched, "_anchor", {}) \
                    and not sched._host_end.get(rid) and r["id"] not in aborted_migrating:
                aborted_migrating.append(r["id"])
                eng.abort_request([r["id"]])
            if r.get("abort_at_step") == step and r["id"] not in results:
                eng.abort_request([r["id"]])
        if not sched.has_requests():
            if not pending:  # as EngineCore: one more step flushes finished ids
                break
            # an 'after' target was added (so it is earlier and not pending) and has no result: never due
            if all(r.get("after") in internal and r["after"] not in results for r in pending):
                raise RuntimeError(f"requests {[r['id'] for r in pending]} wait for requests that ended "
                                   "without a result")
        outs = eng.step()
        if sync_handoff:  # deterministic switch points for tests: each move done before the next step
            runner.nelssa_handoff.wait_all()
        for rid, req in sched.requests.items():
            seen[rid] = req
        row: dict = {"step": step, "free_blocks": kvm.block_pool.get_num_free_blocks(), "rss_mb": _rss_mb(),
                     "host_bytes": host.nbytes if host is not None else 0, "blocks": {}}
        for ours, rid in internal.items():
            if rid in sched.requests:
                b = kvm.get_block_ids(rid)[0]
                row["blocks"][ours] = sum(1 for x in b if x != 0)
        steps.append(row)
        for o in outs:
            if o.finished:
                c = o.outputs[0]
                results[o.request_id] = {
                    "prompt_len": len(o.prompt_token_ids or []), "token_ids": list(c.token_ids),
                    "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    "cached_tokens": o.num_cached_tokens,
                    "top2": [sorted(((float(v.logprob), int(t)) for t, v in d.items()), reverse=True)[:2]
                             for d in (c.logprobs or [])] if spec.get("logprobs") else None,
                }
        step += 1
    out = {
        "mode": spec["mode"], "steps": steps, "results": results, "wall_s": time.time() - t0,
        "num_steps": step, "preemptions": sum(r.num_preemptions for r in seen.values()),
        "preempted": {ours: seen[rid].num_preemptions for ours, rid in internal.items() if rid in seen},
        "total_blocks": kvm.block_pool.num_gpu_blocks, "block_size": core.vllm_config.cache_config.block_size,
        "final_free_blocks": kvm.block_pool.get_num_free_blocks(),
        "final_host_bytes": host.nbytes if host is not None else 0,
        "host_requests": len(host.reqs) if host is not None else 0,
        "host_totals": dict(host.stats.totals) if host is not None else {},
        "aborted_migrating": aborted_migrating,
    }
    if spec.get("metrics"):
        out["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                          if m.name.startswith(("nelssa:", "vllm:num_preemptions"))}
    return out


class EngineTimeout(RuntimeError):
    """An engine run in run_subprocess exceeded its time limit (its process group was killed)."""


def _describe_run(spec: dict) -> str:
    reqs = spec.get("requests", [])
    toks = sum(len(r["prompt_ids"]) if "prompt_ids" in r else r.get("text_tokens", 0) for r in reqs)
    return (f"mode={spec.get('mode')!r} dtype={spec.get('dtype', 'float32')!r} nelssa={spec.get('nelssa', {})} "
            f"{len(reqs)} requests, ~{toks} prompt tokens")


def run_subprocess(spec: dict, env: dict | None = None, timeout: float | None = None) -> dict:
    """Run the harness in a fresh process (clean vLLM state) and return its JSON. NELSSA_OFF is not
    inherited: spec["mode"] decides; ``env`` adds to the environment. RuntimeError on failure;
    EngineTimeout (a RuntimeError) past ``timeout`` seconds, after killing the child's process group,
    naming the run, the time, the CPU's relevant flags and what to change."""
    import signal
    import subprocess
    e = {k: v for k, v in os.environ.items() if k != "NELSSA_OFF"}
    e.update(env or {})
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "nelssa.bench.harness"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, start_new_session=True)
    try:
        out, err = p.communicate(json.dumps(spec), timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the engine and anything it started
        out, err = p.communicate()
        from nelssa.cpu import describe
        dt = time.monotonic() - t0
        raise EngineTimeout(
            f"engine run exceeded its {timeout:.0f} s limit and was killed after {dt:.0f} s: {_describe_run(spec)}.\n"
            f"{describe()}.\n"
            "Hint: an engine in bfloat16 on a CPU without avx512_bf16/amx_bf16 runs emulated bf16 GEMMs "
            "(several times slower): use nelssa.cpu.cpu_dtype() for the dtype; check the threads vLLM "
            "uses (VLLM_CPU_OMP_THREADS_BIND, OMP_NUM_THREADS) against the usable cores; else shrink "
            f"the workload or raise the limit.\nlast stderr of the run:\n{(err or '')[-3000:]}") from None
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)  # e.g. KeyboardInterrupt: leave no engine behind
        p.wait()
        raise
    for line in out.splitlines():
        if line.startswith("HARNESS_JSON "):
            return json.loads(line[len("HARNESS_JSON "):])
    raise RuntimeError(f"harness failed (rc={p.returncode}, {time.monotonic() - t0:.0f} s, {_describe_run(spec)}):\n"
                       f"{err[-6000:]}")


def equal_prefix(a: list, b: list) -> int:
    """Number of leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    spec = json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
    res = run(spec)
    print("HARNESS_JSON " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
