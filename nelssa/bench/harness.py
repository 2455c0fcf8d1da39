"""Run a vLLM engine in-process (NELSSA on or off), step by step, and record what happened.

Used by the integration tests (in a fresh process each, forked from a server with vLLM imported) and
by the memory/accuracy reports: per step and request the device blocks held, free blocks, host-tier
bytes; at the end the outputs (token ids, logprobs, finish reasons), preemptions, aborts. Prints one
JSON object.

    python -m nelssa.bench.harness '{"mode": "on", "nelssa": {"budget": 1.0}, "requests": [...]}'

Spec "sync_handoff" (default true): after each step wait for NELSSA's background hand-offs, so the
switch to host attention comes at deterministic steps (a run of `nelssa bench hol` keeps them
asynchronous, as in serving).
A request: {"id", "prompt_ids" | "text_tokens": n (+ "offset") | "chat": str, "max_tokens",
"abort_at_step"?, "abort_on_migrate"?, "abort_on_recall"?, "abort_in_lane"?, "add_at_step"?, "after"?, "extra_args"?,
"priority"?, "sampling"?}. "sampling": SamplingParams fields over the greedy default (e.g. a seed). "after":
the id of an earlier request; added in the step after that one finished. "extra_args": the request's
SamplingParams.extra_args (e.g. {"nelssa_offload": false}). "abort_on_migrate": aborted after
the first step in which NELSSA's scheduler is migrating it (anchor set, not yet switched); listed in
the output's "aborted_migrating". "abort_on_recall": aborted after the first step in which the scheduler
is loading it back to the device (vllm_plugin/recall.py, not yet reported loaded); listed in
"aborted_recalling". "abort_in_lane": aborted before the first step at which the long lane is running a
job of it (lane.py, 6); listed in "aborted_in_lane".
"""

from __future__ import annotations

import json
import os
import shutil
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
    aborted_in_lane: list[str] = []
    aborted_recalling: list[str] = []
    lane = getattr(runner, "nelssa_lane", None)
    steps: list[dict] = []
    t0 = time.time()
    step = 0
    while step < spec.get("max_steps", 100000):
        hold = None
        due = [r for r in pending if r.get("add_at_step", 0) <= step and ("after" not in r or r["after"] in results)]
        for r in due:
            pending.remove(r)
            sp = SamplingParams(**{"temperature": 0, "max_tokens": r.get("max_tokens", 16), "ignore_eos": True,
                                   "logprobs": spec.get("logprobs"), "extra_args": r.get("extra_args"),
                                   **r.get("sampling", {})})
            internal[r["id"]] = eng.add_request(r["id"], {"prompt_token_ids": ids[r["id"]]}, sp,
                                                priority=r.get("priority", 0))
        for r in reqs:
            rid = internal.get(r["id"])
            if r.get("abort_on_migrate") and r["id"] not in results and rid in getattr(sched, "_anchor", {}) \
                    and not sched._host_end.get(rid) and r["id"] not in aborted_migrating:
                aborted_migrating.append(r["id"])
                eng.abort_request([r["id"]])
            if r.get("abort_on_recall") and r["id"] not in results and rid in getattr(sched, "_loading", {}) \
                    and r["id"] not in aborted_recalling:
                aborted_recalling.append(r["id"])
                eng.abort_request([r["id"]])
            if r.get("abort_at_step") == step and r["id"] not in results:
                eng.abort_request([r["id"]])
            # aborted while the long lane runs a job of it (lane.py, 6: released once that job has ended); the
            # lane's lock held through the step that releases it, so that job cannot end before (the step takes
            # the lock reentrantly on this thread, the lane thread waits for it only to end a batch)
            if r.get("abort_in_lane") and r["id"] not in results and r["id"] not in aborted_in_lane \
                    and lane is not None and hold is None:
                lane._cv.acquire()
                if rid in lane._running:
                    aborted_in_lane.append(r["id"])
                    eng.abort_request([r["id"]])
                    hold = lane._cv
                else:
                    lane._cv.release()
        if not sched.has_requests():
            if not pending:  # as EngineCore: one more step flushes finished ids
                break
            # an 'after' target was added (so it is earlier and not pending) and has no result: never due
            if all(r.get("after") in internal and r["after"] not in results for r in pending):
                raise RuntimeError(f"requests {[r['id'] for r in pending]} wait for requests that ended "
                                   "without a result")
        try:
            outs = eng.step()
        finally:
            if hold is not None:
                hold.release()
                hold = None
        if sync_handoff:  # deterministic switch points for tests: each move done before the next step
            runner.nelssa_handoff.wait_all()
        for rid, req in sched.requests.items():
            seen[rid] = req
        row: dict = {"step": step, "free_blocks": kvm.block_pool.get_num_free_blocks(), "rss_mb": _rss_mb(),
                     "host_bytes": host.nbytes if host is not None else 0, "running": len(sched.running),
                     "t": time.time() - t0,
                     "blocks": {}, "computed": {},
                     "switch_held": sorted(o for o, rid in internal.items() if rid in getattr(sched, "switch_held", ())),
                     "long_chunk": getattr(sched, "_chunk_step", None)}  # the step ran a long-prefill chunk
        for ours, rid in internal.items():
            if rid in sched.requests:
                b = kvm.get_block_ids(rid)[0]
                row["blocks"][ours] = sum(1 for x in b if x != 0)
                row["computed"][ours] = sched.requests[rid].num_computed_tokens
        steps.append(row)
        for o in outs:
            if o.finished:
                c = o.outputs[0]
                results[o.request_id] = {
                    "prompt_len": len(o.prompt_token_ids or []), "token_ids": list(c.token_ids),
                    "text": c.text, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    "cached_tokens": o.num_cached_tokens, "kv_transfer_params": o.kv_transfer_params,
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
        "aborted_migrating": aborted_migrating, "aborted_in_lane": aborted_in_lane,
        "aborted_recalling": aborted_recalling,
        "sched_counts": dict(getattr(sched, "nelssa_counts", {})),
        # the scheduler's step intervals (moving averages): all steps', and those after a step without a
        # long-prefill chunk (the one a long prompt's hold is counted in)
        "step_s": getattr(sched, "_step_s", None), "decode_step_s": getattr(sched, "_decode_step_s", None),
    }
    if spec.get("metrics"):
        out["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                          if m.name.startswith(("nelssa:", "vllm:num_preemptions"))}
    return out


class EngineTimeout(RuntimeError):
    """An engine run in run_subprocess exceeded its time limit (its process group was killed)."""

    def __init__(self, msg: str, pid: int = 0):
        super().__init__(msg)
        self.pid = pid  # the run's process (its session id)


def _describe_run(spec: dict) -> str:
    reqs = spec.get("requests", [])
    toks = sum(len(r["prompt_ids"]) if "prompt_ids" in r else r.get("text_tokens", 0) for r in reqs)
    return (f"mode={spec.get('mode')!r} dtype={spec.get('dtype', 'float32')!r} nelssa={spec.get('nelssa', {})} "
            f"{len(reqs)} requests, ~{toks} prompt tokens")


# Imported once by the fork server (vLLM's import is ~15 s of a run on a 2-vCPU box); each run is a
# fresh process forked from it, so no engine state is shared between runs.
_PRELOAD = ["vllm", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine", "vllm.model_executor.models.llama",
            "nelssa.vllm_plugin.model", "nelssa.vllm_plugin.scheduler", "nelssa.vllm_plugin.connector",
            "nelssa.vllm_plugin.runner", "nelssa.bench.harness"]
_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        import multiprocessing as mp
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


def _crash_trace() -> None:
    """A crash of the run says where, in its log: every Python thread's stack (faulthandler) and the crashing
    native thread's frames (csrc/fatal_trace.cpp), e.g. for a heap corruption's abort in a host thread."""
    import faulthandler
    faulthandler.enable()
    try:  # the extension itself, not nelssa._ext.ext(): that one also sizes the host pool from the config
        from nelssa import _C  # type: ignore[attr-defined]
    except ImportError:
        return
    _C.install_fatal_trace()


def _child(spec_json: str, env: dict, out_path: str) -> None:
    """A run in a process forked from the fork server: own session (killable as a group), the caller's
    environment, stdout/stderr to ``out_path + '.log'``, the result as JSON in ``out_path``."""
    os.setsid()
    fd = os.open(out_path + ".log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1), os.dup2(fd, 2)
    os.environ.clear()
    os.environ.update(env)
    _crash_trace()
    res = run(json.loads(spec_json))
    with open(out_path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(out_path + ".tmp", out_path)
    sys.stdout.flush(), sys.stderr.flush()


def run_subprocess(spec: dict, env: dict | None = None, timeout: float | None = None,
                   log_path: str | None = None) -> dict:
    """Run the harness in a fresh process (clean vLLM state) and return its JSON. NELSSA_OFF is not
    inherited: spec["mode"] decides; ``env`` adds to the environment; ``log_path``: where to keep the
    run's output (stdout and stderr), whatever the outcome. RuntimeError on failure;
    EngineTimeout (a RuntimeError) past ``timeout`` seconds, after killing the child's process group,
    naming the run, the time, the CPU's relevant flags and what to change.

    The process is forked from a fork server that has vLLM imported (multiprocessing's "forkserver"
    with a preload): a run starts at the engine, not at ``import vllm``."""
    import signal
    import tempfile
    e = {k: v for k, v in os.environ.items() if k != "NELSSA_OFF"}
    e.update(env or {})
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nelssa-harness-") as d:
        out_path = os.path.join(d, "result.json")
        p = _context().Process(target=_child, args=(json.dumps(spec), e, out_path), daemon=False)
        p.start()
        try:
            p.join(timeout)
        except BaseException:
            _killpg(p.pid, signal.SIGKILL)  # e.g. KeyboardInterrupt: leave no engine behind
            p.join()
            raise
        err = ""
        if os.path.exists(out_path + ".log"):
            with open(out_path + ".log", errors="replace") as f:
                err = f.read()
            if log_path:
                shutil.copyfile(out_path + ".log", log_path)
        if p.is_alive():
            _killpg(p.pid, signal.SIGKILL)  # the engine and anything it started
            p.join()
            from nelssa.cpu import describe
            dt = time.monotonic() - t0
            raise EngineTimeout(
                f"engine run exceeded its {timeout:.0f} s limit and was killed after {dt:.0f} s: {_describe_run(spec)}.\n"
                f"{describe()}.\n"
                "Hint: an engine in bfloat16 on a CPU without avx512_bf16/amx_bf16 runs emulated bf16 GEMMs "
                "(several times slower): use nelssa.cpu.cpu_dtype() for the dtype; check the threads vLLM "
                "uses (VLLM_CPU_OMP_THREADS_BIND, OMP_NUM_THREADS) against the usable cores; else shrink "
                f"the workload or raise the limit.\nlast output of the run:\n{err[-3000:]}", pid=p.pid) from None
        if p.exitcode == 0 and os.path.exists(out_path):
            with open(out_path) as f:
                return json.load(f)
    raise RuntimeError(f"harness failed (rc={p.exitcode}, {time.monotonic() - t0:.0f} s, {_describe_run(spec)}):\n"
                       f"{err[-6000:]}")


def _killpg(pid: int, sig: int) -> None:
    """The run's process group (it is its own session leader), or the process if it has none yet."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def equal_prefix(a: list, b: list) -> int:
    """Number of leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    spec = json.loads(sys.argv[1] if len(sys.argv) > 1 else sys.stdin.read())
    res = run(spec)
    print("HARNESS_JSON " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
