"""The host CPU as the engine sees it: native bf16 or not, hence the CPU engine dtype.

One place decides the dtype of a vLLM engine on CPU (tests, benchmarks, ``nelssa serve``):
``bfloat16`` only where the CPU computes bf16 natively (``/proc/cpuinfo`` flag ``avx512_bf16`` or
``amx_bf16``), neither library ISA cap in the environment rules that out and the CPU has no AMX
(vLLM's bf16 AMX attention gave wrong tokens, see ``_bf16_refusal``); ``float32`` otherwise.
Without native bf16, oneDNN emulates the bf16 GEMMs on AVX-512 (or lacks them on AVX2), which made
a bf16 engine several times slower than fp32 on such CPUs.

The caps are the libraries' own environment variables (not NELSSA configuration), honoured so that
``ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512`` emulates a CPU without bf16 faithfully:
  ONEDNN_MAX_CPU_ISA (older name DNNL_MAX_CPU_ISA): oneDNN's upper ISA bound, upper-case names of
    ``dnnl_cpu_isa_t`` without the prefix (SSE41, AVX, AVX2, AVX2_VNNI, AVX2_VNNI_2, AVX512_CORE,
    AVX512_CORE_VNNI, AVX512_CORE_BF16, AVX10_1_512 = AVX512_CORE_FP16, AVX10_1_512_AMX =
    AVX512_CORE_AMX, AVX10_1_512_AMX_FP16 = AVX512_CORE_AMX_FP16, ALL / DEFAULT: no bound).
    bf16 is native from AVX512_CORE_BF16 up.
  ATEN_CPU_CAPABILITY: ATen's kernel level on x86, ``default`` / ``avx2`` / ``avx512``; below
    ``avx512`` the process runs as a CPU without AVX-512, hence without avx512_bf16.

    python -m nelssa.cpu     # prints the decision and why
"""

from __future__ import annotations

import os
import platform

# oneDNN ISA caps under which bf16 is native (its ISAs are partially ordered; these are the ones
# at or above AVX512_CORE_BF16). Everything else named in its docs is below.
_ONEDNN_BF16 = {"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX",
                "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "ALL", "DEFAULT"}
_ONEDNN_KNOWN = _ONEDNN_BF16 | {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                "AVX512_CORE_VNNI"}
_ATEN_KNOWN = {"default", "avx2", "avx512", "vsx", "zvector", "sve256", "sve"}
# The flags worth naming when a CPU is slow or an engine run times out.
RELEVANT_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2")


def cpu_flags() -> frozenset[str]:
    """The first processor's /proc/cpuinfo flags (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_caps() -> dict[str, str]:
    """The ISA caps set in the environment, as given."""
    names = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
    return {k: os.environ[k] for k in names if os.environ.get(k)}


def _bf16_refusal(flags: frozenset[str], caps: dict[str, str]) -> str | None:
    """Why this process's engines run fp32 rather than bf16 (None: bf16). No native bf16, or an AMX
    CPU: there vLLM 0.26 attends bf16 with its AMX kernels (block sizes that are multiples of 32, its
    default 128), which gave wrong greedy tokens for SmolLM2 (an Intel Xeon with AMX, 2026-12-02:
    "L'Étoile, la Marseillaise," for "The capital of France is Paris.", right with block size 16 or
    fp32)."""
    if not flags & {"avx512_bf16", "amx_bf16"}:
        return "the CPU has neither avx512_bf16 nor amx_bf16"
    if "amx_tile" in flags:
        return "AMX CPU: vLLM 0.26's bf16 AMX attention gave wrong tokens here"
    onednn = caps.get("ONEDNN_MAX_CPU_ISA") or caps.get("DNNL_MAX_CPU_ISA")
    if onednn is not None:
        v = onednn.strip().upper()
        if v not in _ONEDNN_KNOWN:
            raise ValueError(f"ONEDNN_MAX_CPU_ISA={onednn!r} is not an ISA name oneDNN knows "
                             f"(one of {', '.join(sorted(_ONEDNN_KNOWN))})")
        if v not in _ONEDNN_BF16:
            return f"ONEDNN_MAX_CPU_ISA={onednn} caps oneDNN below AVX512_CORE_BF16"
    aten = caps.get("ATEN_CPU_CAPABILITY")
    if aten is not None:
        v = aten.strip().lower()
        if v not in _ATEN_KNOWN:
            raise ValueError(f"ATEN_CPU_CAPABILITY={aten!r} is not a level ATen knows "
                             f"(one of {', '.join(sorted(_ATEN_KNOWN))})")
        if v != "avx512":
            return f"ATEN_CPU_CAPABILITY={aten} caps ATen below AVX-512"
    return None


def cpu_dtype() -> str:
    """The vLLM dtype for an engine on this CPU: "bfloat16" with native bf16 (no AMX), else "float32"."""
    return "bfloat16" if _bf16_refusal(cpu_flags(), isa_caps()) is None else "float32"


def describe() -> str:
    """One line for logs and error messages: CPU, relevant flags, caps, threads, dtype and why."""
    flags = cpu_flags()
    caps = isa_caps()
    have = [f for f in RELEVANT_FLAGS if f in flags] or ["none of " + "/".join(RELEVANT_FLAGS)]
    why = _bf16_refusal(flags, caps)
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cap_s = " ".join(f"{k}={v}" for k, v in caps.items()) or "no ISA caps"
    return (f"CPU {cpu_model()!r}, {n} usable cores, flags: {' '.join(have)}; {cap_s}; "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
            f"engine dtype {cpu_dtype()} ({why or 'native bf16'})")


if __name__ == "__main__":
    print(describe())
