"""The CPU dtype decision (nelssa.cpu), its use by `nelssa serve`, and the engine-run time limit."""

import os
import subprocess
import sys
import time

import pytest

from nelssa import cpu

BF16_CPU = frozenset({"avx2", "avx512f", "avx512_bf16"})
AMX_CPU = frozenset({"avx2", "avx512f", "amx_bf16", "amx_tile"})
NO_BF16_CPU = frozenset({"avx2", "avx512f", "avx512bw"})


@pytest.mark.parametrize("flags,caps,native", [
    (BF16_CPU, {}, True),
    (AMX_CPU, {}, False),  # vLLM's bf16 AMX attention gave wrong tokens: fp32 there
    (NO_BF16_CPU, {}, False),
    (frozenset({"avx2"}), {}, False),
    (BF16_CPU, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, False),
    (BF16_CPU, {"ONEDNN_MAX_CPU_ISA": "avx2"}, False),
    (BF16_CPU, {"DNNL_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, False),
    (BF16_CPU, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True),
    (AMX_CPU, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, False),
    (BF16_CPU, {"ONEDNN_MAX_CPU_ISA": "ALL"}, True),
    (BF16_CPU, {"ATEN_CPU_CAPABILITY": "avx2"}, False),
    (BF16_CPU, {"ATEN_CPU_CAPABILITY": "default"}, False),
    (BF16_CPU, {"ATEN_CPU_CAPABILITY": "avx512"}, True),
    (NO_BF16_CPU, {"ONEDNN_MAX_CPU_ISA": "ALL", "ATEN_CPU_CAPABILITY": "avx512"}, False),  # caps only lower
])
def test_bf16_decision(flags, caps, native):
    assert (cpu._bf16_refusal(flags, caps) is None) is native


def test_unknown_cap_is_an_error():
    with pytest.raises(ValueError, match="ONEDNN_MAX_CPU_ISA"):
        cpu._bf16_refusal(BF16_CPU, {"ONEDNN_MAX_CPU_ISA": "AVX513"})
    with pytest.raises(ValueError, match="ATEN_CPU_CAPABILITY"):
        cpu._bf16_refusal(BF16_CPU, {"ATEN_CPU_CAPABILITY": "avx1024"})


def test_this_process_follows_the_caps(monkeypatch):
    """The helper reads the real /proc/cpuinfo and the real environment."""
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    flags = cpu.cpu_flags()
    want = "bfloat16" if flags & {"avx512_bf16", "amx_bf16"} and "amx_tile" not in flags else "float32"
    assert cpu.cpu_dtype() == want
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    assert cpu.cpu_dtype() == "float32"
    assert "ONEDNN_MAX_CPU_ISA=AVX512_CORE" in cpu.describe() and "engine dtype float32" in cpu.describe()


def test_serve_defaults_to_the_cpu_dtype(monkeypatch):
    import torch

    from nelssa.cli import serve_command
    monkeypatch.delenv("NELSSA_OFF", raising=False)
    if torch.cuda.is_available():
        pytest.skip("the CPU default applies to CPU hosts")
    cmd = serve_command("/some/model", "{}", ["--port", "1"])
    assert cmd[cmd.index("--dtype") + 1] == cpu.cpu_dtype()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    cmd = serve_command("/some/model", "{}", [])
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    cmd = serve_command("/some/model", "{}", ["--dtype", "float16"])  # the user's choice wins, once
    assert cmd.count("--dtype") == 1 and cmd[cmd.index("--dtype") + 1] == "float16"


@pytest.mark.parametrize("bad, reason", [("{bad", "not JSON"), ("[1, 2]", "must be an object"),
                                         ('{"T_inptu": 100}', "unknown nelssa config keys ['T_inptu']"),
                                         ('{"budget": 2}', "budget must be in (0, 1]")])
def test_serve_refuses_a_bad_config_before_vllm_starts(monkeypatch, capsys, bad, reason):
    """`nelssa serve` with a bad --nelssa: a usage error (exit 2) with the reason, not a traceback."""
    from nelssa.cli import main
    monkeypatch.delenv("NELSSA_OFF", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "/some/model", "--nelssa", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "nelssa serve: error: NELSSA config" in err and reason in err, err


def _session_processes(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append(int(d))
    return out


def test_engine_run_past_its_limit_fails_clearly():
    """A run past its limit raises EngineTimeout naming the run, the time, the CPU's flags and the
    hint, and leaves no engine process behind."""
    from nelssa.bench.harness import EngineTimeout, run_subprocess
    spec = {"mode": "on", "dtype": "bfloat16", "nelssa": {"budget": 0.04},
            "requests": [{"id": "x", "text_tokens": 3000, "max_tokens": 4}]}
    t0 = time.monotonic()
    with pytest.raises(EngineTimeout) as ei:
        run_subprocess(spec, timeout=2)
    assert time.monotonic() - t0 < 60
    msg = str(ei.value)
    assert "2 s limit" in msg and "mode='on'" in msg and "dtype='bfloat16'" in msg and "~3000 prompt tokens" in msg
    assert "flags:" in msg and "engine dtype" in msg and "cpu_dtype()" in msg and "OMP_NUM_THREADS" in msg
    assert isinstance(ei.value, RuntimeError)  # callers that catch harness failures see it too
    assert ei.value.pid > 0
    time.sleep(0.5)
    assert _session_processes(ei.value.pid) == []


def test_cpu_module_runs():
    out = subprocess.run([sys.executable, "-m", "nelssa.cpu"], capture_output=True, text=True, check=True,
                         env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}).stdout
    assert "engine dtype float32" in out and "ATEN_CPU_CAPABILITY=avx2" in out
