"""Run nelssa.bench.harness in a fresh subprocess (clean vLLM process state) and parse its JSON."""

import json
import os
import subprocess
import sys


def run_harness(spec: dict, env: dict | None = None, timeout: int = 1500) -> dict:
    e = dict(os.environ)
    e.pop("NELSSA_OFF", None)
    e.update(env or {})
    r = subprocess.run([sys.executable, "-m", "nelssa.bench.harness"], input=json.dumps(spec), text=True,
                       capture_output=True, env=e, timeout=timeout)
    for line in r.stdout.splitlines():
        if line.startswith("HARNESS_JSON "):
            return json.loads(line[len("HARNESS_JSON "):])
    raise AssertionError(f"harness failed (rc={r.returncode}):\n{r.stderr[-6000:]}")


def both(spec: dict, **kw) -> tuple[dict, dict]:
    """(NELSSA on, NELSSA_OFF baseline) runs of the same spec."""
    return run_harness({**spec, "mode": "on"}, **kw), run_harness({**spec, "mode": "off"}, **kw)
