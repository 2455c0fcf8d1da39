"""Run nelssa.bench.harness in a fresh subprocess (clean vLLM process state) and parse its JSON."""

from nelssa.bench.harness import run_subprocess


def run_harness(spec: dict, env: dict | None = None, timeout: int = 1500) -> dict:
    try:
        return run_subprocess(spec, env, timeout)
    except RuntimeError as e:  # a failed engine run is a test failure with its stderr
        raise AssertionError(str(e)) from None


def both(spec: dict, **kw) -> tuple[dict, dict]:
    """(NELSSA on, NELSSA_OFF baseline) runs of the same spec."""
    return run_harness({**spec, "mode": "on"}, **kw), run_harness({**spec, "mode": "off"}, **kw)
