"""End to end on CPU: run_pd_with_nelssa.sh starts P, D, the proxy and (engine node) nelssa-node (real
processes, SmolLM2, fp32, NIXL over DRAM); short and long requests through the proxy with the
official openai client (one streamed); answers equal stock vLLM's (P asked directly, budget 1.0);
usage right; the long request's KV reached D's host tier — with the node (the default,
NELSSA_PD_ENGINE=node) clustered by P and adopted by D (the hand-over: D clustered nothing, and
allocated and read over NIXL only the window's blocks; with D's long lane, on by default here as on the
GPU, the lane computed the prompt's last position before its first step, so D ran no split step), with
NELSSA_PD_ENGINE=local moved there by D; KV came over NIXL; a short request that grows past T_input
migrates on D (issue 13) with stock's tokens and no preemption; a malformed body is a 400 and the stack
keeps serving; `stop` leaves no process and no listening port."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from harness_util import free_ports

REPO = Path(__file__).resolve().parents[1]
# 1.5-2 min on a 2-vCPU box since NIXL's busy progress thread is off on CPU (nixl_progress.py; with it the
# stack took 12-15 min there, or failed); NELSSA_PD_E2E=0 skips it
pytestmark = [pytest.mark.engine, pytest.mark.model, pytest.mark.skipif(
    os.environ.get("NELSSA_PD_E2E") == "0", reason="NELSSA_PD_E2E=0")]


def _metric_sum(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"([^{ ]+)(\{[^}]*\})? (\S+)", line)
        if m and m.group(1) == name and all(f'{k}="{v}"' in (m.group(2) or "") for k, v in labels.items()):
            total += float(m.group(3))
    return total


def _listening(ports: list[int]) -> list[int]:
    out = subprocess.run([sys.executable, "-m", "nelssa.proxy.pd", "listening", *map(str, ports)],
                         cwd=REPO, capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_pd_stack_end_to_end(tmp_path):
    from nelssa.models import prepare_smollm2
    model = str(prepare_smollm2())
    engine = os.environ.get("NELSSA_PD_ENGINE", "node")
    assert engine in ("node", "local"), engine
    pp, dp, xp, pn, dn, node = free_ports(6)
    ports = [pp, dp, xp, pn, dn] + ([node] if engine == "node" else [])
    log_dir = tmp_path / "logs"
    env = {**os.environ, "NELSSA_PYTHON": sys.executable, "MODEL": model, "LOG_DIR": str(log_dir),
           "PREFILL_PORT": str(pp), "DECODE_PORT": str(dp), "PROXY_PORT": str(xp),
           "PREFILL_NIXL_PORT": str(pn), "DECODE_NIXL_PORT": str(dn),
           "NELSSA_T_INPUT": "512", "NELSSA_BUDGET": "1.0", "NELSSA_ENGINE": engine, "NODE_PORT": str(node),
           "NELSSA_DEFER_BELOW": "0",  # D moves the long request to the host tier however much room it has
           "NELSSA_LANE": os.environ.get("NELSSA_LANE", "1"),  # D's long requests decode in the lane (lane.py)
           # node leases past the stalls of four busy processes on 2 vCPUs (30 s expired there: the node
           # dropped P's stored request, and D clustered the prompt itself)
           "NELSSA_NODE_LEASE_S": "300",
           # D migrates a request that grew past T_input whatever its KV use (issue 13 on the decode instance)
           "DECODE_ENV": "NELSSA_MIGRATE_WATERMARK=0",
           "VLLM_EXTRA_ARGS": "--dtype float32 --enforce-eager --max-model-len 1024 --max-num-seqs 8",
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("NELSSA_OFF", None)
    t0 = time.monotonic()
    launcher = subprocess.Popen(["bash", str(REPO / "run_pd_with_nelssa.sh")], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in launcher.stdout:
            lines.append(line)
            if "] ready:" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    groups: list[int] = []
    try:
        while not ready.wait(1.0):
            if launcher.poll() is not None or time.monotonic() - t0 > 600:
                logs = "".join(f"\n== {f}\n" + f.read_text()[-3000:] for f in sorted(log_dir.glob("*.log")))
                pytest.fail("the stack did not become ready:\n" + "".join(lines) + logs)
        started = time.monotonic() - t0
        groups = [int(line.split()[1]) for line in (log_dir / "pids").read_text().splitlines()]
        assert [line.split()[0] for line in (log_dir / "pids").read_text().splitlines()] == \
            ["node"] * (engine == "node") + ["prefill", "decode", "proxy"]
        proxy = f"http://127.0.0.1:{xp}"
        client = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0, timeout=180)
        stock = openai.OpenAI(base_url=f"http://127.0.0.1:{pp}/v1", api_key="none", max_retries=0, timeout=180)
        assert client.models.list().data[0].id == model

        # short completion (not streamed) through P/D == stock vLLM on P alone
        kw = dict(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
        short = client.completions.create(**kw)
        ref = stock.completions.create(**kw)
        assert short.choices[0].text == ref.choices[0].text and short.choices[0].text.strip()
        assert (short.usage.prompt_tokens, short.usage.completion_tokens) == (ref.usage.prompt_tokens, 8)

        # long chat (streamed, usage asked for) through P/D; D decodes it from its host tier
        story = " ".join(f"Item {i} is a {c} box." for i, c in zip(range(70), ["red", "blue", "green"] * 30))
        msgs = [{"role": "user", "content": story + " What color is item 4?"}]
        s = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        parts, usage = [], None
        for ch in s:
            if ch.choices:
                parts.append(ch.choices[0].delta.content or "")
            if ch.usage is not None:
                usage = ch.usage
        ref = stock.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
        assert "".join(parts) == ref.choices[0].message.content and "".join(parts).strip()
        assert usage is not None and usage.prompt_tokens == ref.usage.prompt_tokens >= 512
        assert usage.completion_tokens == ref.usage.completion_tokens

        # a malformed body is a 400 with a reason; the stack keeps serving
        r = httpx.post(proxy + "/v1/completions", content=b"{oops", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        again = client.completions.create(**kw)
        assert again.choices[0].text == short.choices[0].text

        # a client leaving mid-stream: D aborts the request (its KV and host-tier entry are freed); a
        # request that ran to its 200 tokens instead would count as finished by length
        def d_metrics():
            return httpx.get(f"http://127.0.0.1:{dp}/metrics").text
        done = _metric_sum(d_metrics(), "vllm:request_success_total", finished_reason="length")
        with httpx.stream("POST", proxy + "/v1/chat/completions", timeout=120,
                          json={"model": model, "messages": msgs, "max_tokens": 200, "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            dm = d_metrics()
            if _metric_sum(dm, "vllm:num_requests_running") + _metric_sum(dm, "vllm:num_requests_waiting") == 0:
                break
            time.sleep(0.5)
        else:
            pytest.fail("D still runs the request of a client that left")
        time.sleep(2)
        dm = d_metrics()
        assert _metric_sum(dm, "vllm:request_success_total", finished_reason="length") == done
        assert _metric_sum(dm, "nelssa:host_bytes") == 0

        # a short prompt growing past T_input on D migrates there in the background and decodes on from its
        # host tier (D's watermark 0): the same tokens as stock vLLM, no preemption, its host KV freed at its end
        dm_long = dm  # D's counters of the long requests (the checks below), before this one's moves
        moved_before = _metric_sum(dm_long, "nelssa:moved_tokens_total")
        items = " ".join(f"Item {i} is a {c} box." for i, c in zip(range(56), ["red", "blue", "green"] * 20))
        grow = dict(model=model, prompt=items + " Item 56 is a", max_tokens=100, temperature=0,
                    extra_body={"ignore_eos": True})
        grown, ref = client.completions.create(**grow), stock.completions.create(**grow)
        assert grown.choices[0].text == ref.choices[0].text
        # routed as short (prompt < T_input); >= 68 of its tokens decoded past T_input
        assert grown.usage.completion_tokens == 100 and 512 - 32 <= grown.usage.prompt_tokens < 512
        dm = d_metrics()
        assert _metric_sum(dm, "nelssa:migrations_completed_total") >= 1, "the grown request did not migrate on D"
        assert _metric_sum(dm, "nelssa:migration_seconds_count") >= 1 and _metric_sum(dm, "nelssa:moved_bytes_total") > 0
        assert _metric_sum(dm, "nelssa:moved_tokens_total") > moved_before
        assert _metric_sum(dm, "vllm:num_preemptions_total") == 0
        # its host KV goes in the worker's step after its last one, and the gauge comes with a later step's
        # stats: the response can come back first (the suite of 2026-12-07 read 11.8 MB once, 0 on a rerun)
        deadline = time.monotonic() + 10
        while _metric_sum(dm, "nelssa:host_bytes") and time.monotonic() < deadline:
            time.sleep(0.5)
            dm = d_metrics()
        assert _metric_sum(dm, "nelssa:host_bytes") == 0

        pm = httpx.get(proxy + "/metrics").text
        assert _metric_sum(pm, "nelssa_proxy_requests_total", route="short", status="200") == 3
        assert _metric_sum(pm, "nelssa_proxy_requests_total", route="long", status="200") == 1
        assert _metric_sum(pm, "nelssa_proxy_client_disconnects_total", route="long") == 1
        assert _metric_sum(pm, "nelssa_proxy_requests_total", route="none", status="400") == 1
        assert _metric_sum(pm, "nelssa_proxy_prompt_token_mismatch_total") == 0
        dm = httpx.get(f"http://127.0.0.1:{dp}/metrics").text
        assert _metric_sum(dm, "nelssa:long_requests_total") >= 1, "the long request is not on D's host tier"
        assert _metric_sum(dm, "vllm:nixl_bytes_transferred_sum") > 0, "no KV came over NIXL"
        if engine == "node":  # P clustered both long requests into the node, D adopted them
            pm = httpx.get(f"http://127.0.0.1:{pp}/metrics").text
            # each prompt (>= 512 tokens) moves [sink, H0): H0 >= 512 - 64 - 128, the sink one 128-token block
            assert _metric_sum(pm, "nelssa:moved_tokens_total") >= 2 * (512 - 64 - 128 - 128)
            assert _metric_sum(pm, "nelssa:handovers_released_total") == 2
            assert _metric_sum(pm, "nelssa:move_split_seconds_total", part="store") > 0  # P's store calls, timed
            assert _metric_sum(dm, "nelssa:handovers_adopted_total") >= 1  # the second: adopted unless aborted first
            # D's layer calls went through the node's native plane; their communication by part adds up
            comm = _metric_sum(dm, "nelssa:node_comm_seconds_sum")
            split = {p: _metric_sum(dm, "nelssa:node_comm_split_seconds_total", part=p) for p in ("copy", "wire", "dispatch")}
            assert _metric_sum(dm, "nelssa:node_comm_seconds_count") > 0 and split["wire"] > 0, split
            assert sum(split.values()) == pytest.approx(comm, rel=0.01, abs=1e-5), (split, comm)
            # a hand-over D could not take in time is clustered by D (nothing lost): on this 2-vCPU box one
            # adoption's RPC once ran out of its 30-s deadline (the answers above were still exact)
            if _metric_sum(dm, "nelssa:handover_fallbacks_total") == 0:
                assert moved_before == 0, "D clustered a prompt P had handed over"
                # admitted with device blocks for the window only, only those read over NIXL (handover.py, 6)
                assert _metric_sum(dm, "nelssa:handover_windows_total") >= 1
                assert _metric_sum(dm, "nelssa:handover_window_blocks_spared_total") >= 1
                if env["NELSSA_LANE"] == "1":  # the lane computed their first positions: no split step on D
                    assert _metric_sum(dm, "nelssa:handover_lane_seeds_total") >= 1
                    assert _metric_sum(dm_long, "nelssa:offload_step_seconds_count") == 0
            else:
                assert moved_before > 0
            assert _metric_sum(pm, "nelssa:host_bytes") == 0  # P's node entries went to D (or the node's ttl)
        else:
            assert moved_before >= 512 - 64 - 128 - 128
        served = time.monotonic() - t0 - started
    finally:
        stop = subprocess.run(["bash", str(REPO / "run_pd_with_nelssa.sh"), "stop"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
        try:
            launcher.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert launcher.returncode == 0, "".join(lines)
    for g in groups:
        with pytest.raises(ProcessLookupError):
            os.killpg(g, 0)
    assert _listening(ports) == []
    print(f"stack ready in {started:.0f} s, requests {served:.0f} s, stopped in {time.monotonic() - t0 - started - served:.0f} s")
