"""End to end: `nelssa serve` (vLLM's OpenAI server + NELSSA) answers a long and a short request over
HTTP, and NELSSA's counters appear on /metrics."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from nelssa.bench.corpus import text_of_tokens


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def _metric(text: str, name: str) -> float:
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")]
    assert vals, f"{name} not on /metrics"
    return sum(vals)


@pytest.mark.engine
def test_serve_long_and_short_with_metrics(cut_model_dir, tmp_path):
    model_dir = cut_model_dir  # SmolLM2's first 8 layers: the server and its metrics, not the answers
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    env.pop("NELSSA_OFF", None)
    cmd = [sys.executable, "-m", "nelssa.cli", "serve", "--model", model_dir,
           "--nelssa", '{"T_input": 2048, "budget": 0.04, "defer_below": 0}', "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "4096", "--max-num-batched-tokens", "1024", "--enforce-eager", "--served-model-name", "smol"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                pytest.fail(f"server exited: {(tmp_path / 'server.log').read_text()[-4000:]}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir)
        long_prompt = text_of_tokens(tok, 3000, 12345)
        # the prompt's KV goes to the host tier in the background while the request keeps decoding on
        # the device; 256 tokens leave the hand-off (k-means of ~3K tokens x 8 layers) ample time to
        # finish, so the request switches to host attention before it ends
        r_long = _post(base + "/v1/completions", {"model": "smol", "prompt": long_prompt, "max_tokens": 256,
                                                  "temperature": 0, "ignore_eos": True})
        r_short = _post(base + "/v1/chat/completions", {"model": "smol", "max_tokens": 16, "temperature": 0,
                                                        "messages": [{"role": "user", "content": "Hi!"}]})
        assert r_long["usage"]["prompt_tokens"] >= 2048 and r_long["usage"]["completion_tokens"] == 256
        assert r_short["usage"]["completion_tokens"] > 0
        time.sleep(2)
        metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
        assert _metric(metrics, "nelssa:long_requests_total") >= 1
        assert _metric(metrics, "nelssa:clustering_seconds_count") >= 1
        assert _metric(metrics, "nelssa:host_attention_seconds_count") >= 8  # >= one step x 8 layers
        assert _metric(metrics, "nelssa:moved_tokens_total") >= 2048 - 16 - 64 - 128
        assert _metric(metrics, "nelssa:host_failures_total") == 0
        _metric(metrics, "nelssa:host_bytes")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
