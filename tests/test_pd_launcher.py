"""run_pd_with_nelssa.sh's process handling, with fake engines (no vLLM): start waits for health and
records process groups, requests go through the real proxy, `stop` from another shell ends every
process (children included) and frees every port, Ctrl-C does the same, a dying engine stops the rest,
a second start on busy ports is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from harness_util import free_ports

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.model  # the proxy loads SmolLM2's tokenizer

FAKE_ENGINE = r'''
import argparse, asyncio, json, os, socket, subprocess, sys, time
from aiohttp import web
ap = argparse.ArgumentParser()
ap.add_argument("--role"); ap.add_argument("--port", type=int); ap.add_argument("--nixl-port", type=int, default=0)
ap.add_argument("--model", default="m")
a, _ = ap.parse_known_args()
# a child in the same process group, like vLLM's EngineCore
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
side = None
if a.nixl_port:
    side = socket.socket(); side.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    side.bind(("127.0.0.1", a.nixl_port)); side.listen()
die = os.environ.get("FAKE_DIE_FILE") if os.environ.get("FAKE_DIE_ROLE") == a.role else None
t0 = time.time()
late = float(os.environ.get("FAKE_HEALTH_DELAY_S", "0")) if os.environ.get("FAKE_HEALTH_DELAY_ROLE") == a.role else 0
if os.environ.get("FAKE_ARGS_DIR"):  # what the launcher started this engine with, and when
    with open(os.path.join(os.environ["FAKE_ARGS_DIR"], a.role + ".json"), "w") as f:
        json.dump({"argv": sys.argv[1:], "started": t0, "healthy_from": t0 + late,
                   "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "env": {k: v for k, v in os.environ.items() if k.startswith(("NELSSA_", "X_"))}}, f)
async def health(r): return web.Response(status=200 if time.time() >= t0 + late else 503)
async def models(r):
    return web.json_response({"data": [{"id": a.model, "root": a.model, "max_model_len": 4096}]})
async def gen(r):
    body = await r.json()
    if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
        return web.json_response({"choices": [], "kv_transfer_params": {"do_remote_prefill": True}})
    return web.json_response({"choices": [{"index": 0, "text": a.role, "finish_reason": "length"}],
                              "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}})
async def main():
    app = web.Application()
    app.router.add_get("/health", health); app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", gen)
    runner = web.AppRunner(app); await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", a.port).start()
    while not (die and os.path.exists(die)):  # dies when the test says so
        await asyncio.sleep(0.2)
    os._exit(3)
asyncio.run(main())
'''

FAKE_NODE = r'''
import socket, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen()
print(f"nelssa-node listening on 127.0.0.1:{port}", flush=True)
time.sleep(3600)
'''


def _listening(ports) -> list[int]:
    from nelssa.proxy.pd import listening
    return listening(ports)


class Launch:
    def __init__(self, tmp: Path, model: str, **env):
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "fake_engine.py").write_text(FAKE_ENGINE)
        (tmp / "fake_node.py").write_text(FAKE_NODE)
        py = tmp / "python"
        # the launcher's python: engines and the node are fakes, everything else (proxy, helpers) is real
        py.write_text(f"""#!/usr/bin/env bash
case " $* " in
  *" engine-cmd "*) exec {sys.executable} {tmp}/fake_engine.py "$@" ;;
  *" -m nelssa.node "*) exec {sys.executable} {tmp}/fake_node.py "$@" ;;
esac
exec {sys.executable} "$@"
""")
        py.chmod(0o755)
        self.ports = free_ports(6)
        pp, dp, xp, pn, dn, node = self.ports
        self.proxy = f"http://127.0.0.1:{xp}"
        self.log_dir = tmp / "logs"
        self.env = {**os.environ, "NELSSA_PYTHON": str(py), "MODEL": model, "LOG_DIR": str(self.log_dir),
                    "PREFILL_PORT": str(pp), "DECODE_PORT": str(dp), "PROXY_PORT": str(xp),
                    "PREFILL_NIXL_PORT": str(pn), "DECODE_NIXL_PORT": str(dn), "NODE_PORT": str(node),
                    "NELSSA_ENGINE": "local", "HEALTH_TIMEOUT": "120", "STOP_TIMEOUT": "10", **env}
        self.env.pop("NELSSA_OFF", None)
        # SIGINT as a terminal gives it: a suite started in the background of a non-interactive shell
        # (`cmd &`) passes SIGINT on ignored, and bash cannot trap a signal ignored at its start
        self.p = subprocess.Popen(["bash", str(REPO / "run_pd_with_nelssa.sh")], cwd=REPO, env=self.env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True,
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line)
            if "] ready:" in line:
                self.ready.set()

    def wait_ready(self, timeout=120.0):
        t = time.monotonic() + timeout
        while not self.ready.wait(0.5):
            if self.p.poll() is not None or time.monotonic() > t:
                pytest.fail("not ready:\n" + "".join(self.lines))
        return self.groups()

    def groups(self) -> dict[str, int]:
        return {ln.split()[0]: int(ln.split()[1]) for ln in (self.log_dir / "pids").read_text().splitlines()}

    def stop(self) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(REPO / "run_pd_with_nelssa.sh"), "stop"], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=60)

    def cleanup(self):
        if self.p.poll() is None:
            self.stop()
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)


def _gone(groups: dict[str, int]) -> bool:
    for g in groups.values():
        try:
            os.killpg(g, 0)
            return False
        except ProcessLookupError:
            pass
    return True


@pytest.fixture
def model(model_dir):
    return model_dir


def test_start_serve_stop_from_another_shell(tmp_path, model):
    a = Launch(tmp_path / "a", model, NELSSA_ENGINE="node")
    try:
        groups = a.wait_ready()
        assert list(groups) == ["node", "prefill", "decode", "proxy"]
        r = httpx.post(a.proxy + "/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decode"
        time.sleep(0.5)
        out = "".join(a.lines)
        assert f"Send OpenAI requests to {a.proxy}/v1" in out and "host tier node" in out
        status = subprocess.run(["bash", str(REPO / "run_pd_with_nelssa.sh"), "status"], cwd=REPO, env=a.env,
                                capture_output=True, text=True)
        assert status.stdout.count(": running") == 4
        # a second stack on the same ports is refused, and leaves the first alone
        b = subprocess.run(["bash", str(REPO / "run_pd_with_nelssa.sh")], cwd=REPO, env={**a.env, "LOG_DIR": str(
            tmp_path / "b")}, capture_output=True, text=True, timeout=60)
        assert b.returncode == 1 and "ports already in use" in b.stderr
        assert httpx.get(a.proxy + "/health").status_code == 200
        children = subprocess.run(["pgrep", "-g", str(groups["decode"])], capture_output=True, text=True).stdout
        assert len(children.split()) >= 2  # the fake engine and its child
        s = a.stop()
        assert s.returncode == 0, s.stderr
        assert a.p.wait(20) == 0 and "stopped from another shell" in "".join(a.lines)
        assert _gone(groups) and _listening(a.ports) == []
        assert not (a.log_dir / "pids").exists()
        assert a.stop().returncode == 0  # nothing left to stop
    finally:
        a.cleanup()


def test_ctrl_c_stops_everything(tmp_path, model):
    # each group has STOP_TIMEOUT (10 s here) of TERM grace, one after another: the wait covers all
    # three on a loaded box (a 30 s wait failed once in a full suite on 2 vCPUs)
    a = Launch(tmp_path, model)
    try:
        groups = a.wait_ready()
        assert list(groups) == ["prefill", "decode", "proxy"]
        os.kill(a.p.pid, signal.SIGINT)
        assert a.p.wait(90) == 130
        assert _gone(groups) and _listening(a.ports) == []
    finally:
        a.cleanup()


def test_a_dying_engine_stops_the_stack(tmp_path, model):
    a = Launch(tmp_path, model, FAKE_DIE_ROLE="decode", FAKE_DIE_FILE=str(tmp_path / "die"))
    try:
        groups = a.wait_ready()
        (tmp_path / "die").touch()
        assert a.p.wait(60) == 1
        out = "".join(a.lines)
        assert "decode (pid" in out and "exited" in out
        assert "stopping what is left of decode" in out or "stopping decode" in out
        assert "SIGKILL" not in out  # its orphaned child got TERM and went
        assert _gone(groups) and _listening(a.ports) == []
    finally:
        a.cleanup()


@pytest.mark.parametrize("env, needle", [({"NELSSA_BUDGET": "abc"}, "NELSSA_BUDGET='abc'"),
                                         ({"NELSSA_BUDGET": "3"}, "budget must be in (0, 1]"),
                                         ({"DECODE_ENV": "NELSSA_MIGRATE_WATERMARK=7"}, "D: bad NELSSA config")])
def test_a_bad_config_is_refused_before_anything_starts(tmp_path, model, env, needle):
    """A NELSSA config an instance would refuse (a bad NELSSA_* variable, the stack's or one instance's):
    one line with the reason, exit 2, nothing started (before: both engines started and died, and a bad
    variable read as 'nelssa-node is not in this checkout')."""
    a = Launch(tmp_path, model, **env)
    try:
        assert a.p.wait(60) == 2
        a.reader.join(10)
        out = "".join(a.lines)
        assert needle in out and "not in this checkout" not in out, out
        assert not (a.log_dir / "pids").exists() or not (a.log_dir / "pids").read_text().strip()
        assert _listening(a.ports) == []
    finally:
        a.cleanup()


def _fake_gpu(tmp: Path) -> str:
    """A PATH whose nvidia-smi lists one GPU: the launcher's shared-GPU branch, with fake engines."""
    b = tmp / "bin"
    b.mkdir(parents=True)
    (b / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-fake)'\n")
    (b / "nvidia-smi").chmod(0o755)
    return f"{b}:{os.environ['PATH']}"


def _engines(d: Path) -> dict:
    return {r: json.loads((d / f"{r}.json").read_text()) for r in ("prefill", "decode")}


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_shared_gpu_memory_split_and_fixed_kv_caches(tmp_path, model):
    """One GPU for P and D: by default D starts only once P is healthy (vLLM sizes its KV from free
    memory); with KV_CACHE_MEMORY both get their KV size and start at once; bad values are refused."""
    path = _fake_gpu(tmp_path)
    slow_p = {"FAKE_HEALTH_DELAY_ROLE": "prefill", "FAKE_HEALTH_DELAY_S": "6", "PATH": path}
    for name, kv in (("profiled", None), ("fixed", "40G,24.3g")):
        d = tmp_path / name / "args"
        d.mkdir(parents=True)
        env = {**slow_p, "FAKE_ARGS_DIR": str(d), "GPU_MEMORY_SPLIT": "0.5,0.3",
               "PREFILL_ENV": "NELSSA_STEP_PRIORITY=0 X_A=1", "DECODE_ENV": "X_B=b=c"}
        if kv:
            env["KV_CACHE_MEMORY"] = kv
        a = Launch(tmp_path / name, model, **env)
        try:
            a.wait_ready()
            e = _engines(d)
            out = "".join(a.lines)
            assert e["prefill"]["cuda_visible_devices"] == e["decode"]["cuda_visible_devices"] == "0"
            assert _after(e["prefill"]["argv"], "--gpu-memory-utilization") == "0.5"
            assert _after(e["decode"]["argv"], "--gpu-memory-utilization") == "0.3"
            assert "--cuda" in e["decode"]["argv"] and "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in out
            # one instance's own environment (PREFILL_ENV / DECODE_ENV)
            assert e["prefill"]["env"].get("NELSSA_STEP_PRIORITY") == "0" and e["prefill"]["env"].get("X_A") == "1"
            assert "NELSSA_STEP_PRIORITY" not in e["decode"]["env"] and "X_A" not in e["decode"]["env"]
            assert e["decode"]["env"].get("X_B") == "b=c" and "X_B" not in e["prefill"]["env"]
            if kv is None:
                assert "--kv-cache-memory-bytes" not in e["prefill"]["argv"] + e["decode"]["argv"]
                assert e["decode"]["started"] >= e["prefill"]["healthy_from"], "D started before P was healthy"
                assert "D starts once P is healthy" in out
            else:
                assert _after(e["prefill"]["argv"], "--kv-cache-memory-bytes") == "40G"
                assert _after(e["decode"]["argv"], "--kv-cache-memory-bytes") == "24.3g"
                assert e["decode"]["started"] < e["prefill"]["healthy_from"], "D waited for P"
                assert "KV caches of fixed size: P 40G, D 24.3g" in out
        finally:
            a.cleanup()
    for env, msg in (({"GPU_MEMORY_SPLIT": "0.7,0.4"}, "must add up to less than 1"),
                     ({"GPU_MEMORY_SPLIT": "0.5,x"}, "each value must be a fraction"),
                     ({"KV_CACHE_MEMORY": "40G"}, "as P,D"),
                     ({"KV_CACHE_MEMORY": "40G,2.5G"}, "must be sizes vLLM's --kv-cache-memory-bytes takes"),
                     ({"PREFILL_ENV": "NELSSA_X=1 oops"}, "PREFILL_ENV: 'oops' is not NAME=value")):
        a = Launch(tmp_path / "bad", model, PATH=path, **env)
        try:
            assert a.p.wait(60) == 2
            a.reader.join(10)
            assert msg in "".join(a.lines)
        finally:
            a.cleanup()
