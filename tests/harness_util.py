"""Run nelssa.bench.harness in a fresh subprocess (clean vLLM process state) and parse its JSON."""

import socket

from nelssa.bench.harness import run_subprocess


def run_harness(spec: dict, env: dict | None = None, timeout: int = 1500, log_path: str | None = None) -> dict:
    try:
        return run_subprocess(spec, env, timeout, log_path=log_path)
    except RuntimeError as e:  # a failed engine run is a test failure with its stderr
        raise AssertionError(str(e)) from None


def both(spec: dict, **kw) -> tuple[dict, dict]:
    """(NELSSA on, NELSSA_OFF baseline) runs of the same spec."""
    return run_harness({**spec, "mode": "on"}, **kw), run_harness({**spec, "mode": "off"}, **kw)


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free now (bound together, then released)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports
