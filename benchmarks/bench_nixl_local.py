"""NIXL between two processes of one host: how fast a READ (vLLM's pull connector: D reads P's blocks)
and a WRITE (the push connector) move KV-block-sized pieces, per UCX setting.

    python benchmarks/bench_nixl_local.py [--device cuda|cpu] [--mib 256] [--chunk-kib 32]
                                          [--env NAME=VALUE,... (one setting per --env)] [--out F.json]

Why: with P and D sharing the lent H200, NixlConnector's transfers took 45 s each on average (87.5 GB in
468); UCX's cuda_ipc serves GETs only where it detects NVLink unless ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``.
Each setting runs in fresh processes (UCX reads its environment once): a target process registers a
buffer filled with one byte value and publishes its NIXL metadata in a folder; the initiator registers
its own buffer, READs the target's buffer in ``--chunk-kib`` descriptors (a KV block of one layer is
16 tokens x 8 KV heads x 128 x 2 bytes = 32 KiB), checks every byte, then WRITEs a second value back,
which the target checks. No pickling: metadata as NIXL's bytes, the rest JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _buffer(device: str, nbytes: int, value: int):
    import torch
    t = torch.full((nbytes,), value, dtype=torch.uint8, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    return t


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _wait_for(path: str, timeout: float) -> None:
    t = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t > timeout:
            raise SystemExit(f"timed out waiting for {path}")
        time.sleep(0.01)


def _mem(device: str) -> str:
    return "VRAM" if device == "cuda" else "DRAM"


def target(d: str, device: str, nbytes: int, timeout: float) -> int:
    buf = _buffer(device, nbytes, 7)
    agent = _agent("target")
    agent.register_memory(buf)
    with open(os.path.join(d, "target.meta.tmp"), "wb") as f:
        f.write(agent.get_agent_metadata())
    with open(os.path.join(d, "target.json.tmp"), "w") as f:
        json.dump({"addr": buf.data_ptr(), "dev": buf.device.index or 0}, f)
    os.replace(os.path.join(d, "target.meta.tmp"), os.path.join(d, "target.meta"))
    os.replace(os.path.join(d, "target.json.tmp"), os.path.join(d, "target.json"))
    _wait_for(os.path.join(d, "written"), timeout)
    if device == "cuda":
        import torch
        torch.cuda.synchronize()
    ok = bool((buf == 9).all().item())
    with open(os.path.join(d, "target_check.json"), "w") as f:
        json.dump({"write_landed": ok}, f)
    return 0 if ok else 1


def initiator(d: str, device: str, nbytes: int, chunk: int, timeout: float) -> dict:
    buf = _buffer(device, nbytes, 0)
    agent = _agent("initiator")
    agent.register_memory(buf)
    _wait_for(os.path.join(d, "target.json"), timeout)
    with open(os.path.join(d, "target.meta"), "rb") as f:
        remote = agent.add_remote_agent(f.read())
    with open(os.path.join(d, "target.json")) as f:
        tj = json.load(f)
    n = nbytes // chunk
    mem = _mem(device)
    dev = buf.device.index or 0
    local = agent.get_xfer_descs([(buf.data_ptr() + i * chunk, chunk, dev) for i in range(n)], mem)
    far = agent.get_xfer_descs([(tj["addr"] + i * chunk, chunk, tj["dev"]) for i in range(n)], mem)
    out: dict = {"bytes": n * chunk, "descriptors": n}
    for op in ("READ", "WRITE"):
        if op == "WRITE":
            buf.fill_(9)
            if device == "cuda":
                import torch
                torch.cuda.synchronize()
        times = []
        for _ in range(3):  # the first includes UCX's connection and protocol set-up
            h = agent.initialize_xfer(op, local, far, remote, b"")
            t = time.perf_counter()
            st = agent.transfer(h)
            while st == "PROC":
                st = agent.check_xfer_state(h)
                if time.perf_counter() - t > timeout:
                    raise SystemExit(f"{op} did not finish in {timeout} s")
            times.append(time.perf_counter() - t)
            if st != "DONE":
                raise SystemExit(f"{op} ended in state {st}")
            agent.release_xfer_handle(h)
        out[op] = {"seconds": times, "GBps_best": n * chunk / min(times) / 1e9}
        if op == "READ":
            if device == "cuda":
                import torch
                torch.cuda.synchronize()
            out["READ"]["data_ok"] = bool((buf == 7).all().item())
    with open(os.path.join(d, "written"), "w") as f:
        f.write("1")
    return out


def run_setting(env: dict[str, str], device: str, nbytes: int, chunk: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="nixl-probe-") as d:
        e = {**os.environ, **env}
        args = [sys.executable, __file__, "--device", device, "--bytes", str(nbytes), "--chunk", str(chunk),
                "--dir", d, "--timeout", str(timeout)]
        tp = subprocess.Popen(args + ["--role", "target"], env=e)
        ip = subprocess.run(args + ["--role", "initiator"], env=e, capture_output=True, text=True,
                            timeout=timeout + 60)
        try:
            tp.wait(timeout=60)
        except subprocess.TimeoutExpired:
            tp.kill()
        if ip.returncode != 0:
            return {"env": env, "error": (ip.stderr or ip.stdout)[-3000:]}
        res = json.loads(ip.stdout.strip().splitlines()[-1])
        chk = os.path.join(d, "target_check.json")
        res["WRITE"]["data_ok"] = json.load(open(chk))["write_landed"] if os.path.exists(chk) else None
        return {"env": env, **res}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--chunk-kib", type=int, default=32)
    ap.add_argument("--env", action="append", default=None,
                    help="one UCX setting: NAME=VALUE[,NAME=VALUE] (default: UCX's defaults, then GET over cuda_ipc)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--role", choices=["target", "initiator"], help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role == "target":
        return target(a.dir, a.device, a.bytes, a.timeout)
    if a.role == "initiator":
        print(json.dumps(initiator(a.dir, a.device, a.bytes, a.chunk, a.timeout)), flush=True)
        return 0
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    settings = [dict(kv.split("=", 1) for kv in s.split(",")) for s in a.env] if a.env else \
        [{}, {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}]
    nbytes, chunk = a.mib << 20, a.chunk_kib << 10
    results = []
    for env in settings:
        r = run_setting(env, a.device, nbytes, chunk, a.timeout)
        results.append(r)
        if "error" in r:
            print(f"[nixl-probe] {env or 'UCX defaults'}: failed: {r['error'][-400:]}", flush=True)
            continue
        print(f"[nixl-probe] {env or 'UCX defaults'}: {r['bytes'] >> 20} MiB in {r['descriptors']} x "
              f"{a.chunk_kib} KiB on {a.device}: READ {r['READ']['GBps_best']:.2f} GB/s (data ok "
              f"{r['READ']['data_ok']}), WRITE {r['WRITE']['GBps_best']:.2f} GB/s (landed {r['WRITE']['data_ok']}); "
              f"seconds READ {[round(x, 4) for x in r['READ']['seconds']]}", flush=True)
    doc = {"device": a.device, "mib": a.mib, "chunk_kib": a.chunk_kib, "results": results}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    bad = [r for r in results if "error" in r or not r["READ"]["data_ok"] or r["WRITE"]["data_ok"] is False]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
