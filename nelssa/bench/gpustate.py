"""The GPU's clocks, power and temperature through a benchmark run, by phase: whether two modes of one
invocation ran on the same device state (a GPU that throttles in the second mode's run makes that mode
look slower), read beside the run's latencies.

  1. ``Sampler(period_s)`` starts a daemon thread that reads NVML (vLLM's bundled pynvml) every
     ``period_s``: SM clock (MHz), power (W), temperature (C) and the active clock-event reasons (the
     bitmask NVML calls throttle reasons) of the process's first visible GPU. NVML's calls are ctypes calls
     that release the GIL, and the thread is not the event loop that stamps the tokens. Without NVML (no
     NVIDIA driver: the CPU box) it samples nothing and ``samples`` stays empty; that is not an error.
  2. ``stop()`` ends the thread and returns the samples: ``[{"t", "sm_mhz", "power_w", "temp_c",
     "reasons"}]``, ``t`` on the caller's clock (``time.perf_counter() - t0``).
  3. ``by_phase(samples, phases)`` summarises them over each phase ``{name: [lo, hi]}``: sample count,
     SM clock p50 and min, mean power, max temperature, and the share of samples with a power cap or a
     thermal or hardware slowdown active (``throttled``), with the reasons seen named; ``text`` prints it.
"""

from __future__ import annotations

import os
import threading
import time

# NVML clock-event reasons that lower the SM clock under load (nvmlClocksEventReason*); idle and the
# application clock setting are not throttling
REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake"}


def _visible_index() -> int:
    """NVML index of the first GPU CUDA sees: CUDA_VISIBLE_DEVICES' first entry when it is a number."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


class Sampler:
    def __init__(self, t0: float, period_s: float = 0.5):
        self.samples: list[dict] = []
        self._t0, self._period = t0, period_s
        self._stop = threading.Event()
        self._thread = None
        try:
            from vllm.third_party import pynvml
            pynvml.nvmlInit()
            self._nvml, self._h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(_visible_index())
        except Exception:  # noqa: BLE001 - no NVIDIA driver (or no vLLM): nothing to sample
            self._nvml = None
            return
        self._thread = threading.Thread(target=self._loop, name="hol-gpustate", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        nv, h = self._nvml, self._h
        while not self._stop.is_set():
            try:
                self.samples.append({
                    "t": time.perf_counter() - self._t0,
                    "sm_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                    "power_w": nv.nvmlDeviceGetPowerUsage(h) / 1e3,
                    "temp_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                    "reasons": int(nv.nvmlDeviceGetCurrentClocksEventReasons(h))})
            except Exception:  # noqa: BLE001 - a reading NVML refuses ends the sampling, not the run
                return
            self._stop.wait(self._period)

    def stop(self) -> list[dict]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._nvml.nvmlShutdown()
        return self.samples


def by_phase(samples: list[dict], phases: dict[str, list[float]]) -> dict[str, dict] | None:
    """3 above; None without samples."""
    if not samples:
        return None
    out = {}
    for name, (lo, hi) in phases.items():
        s = [x for x in samples if lo <= x["t"] < hi]
        if not s:
            out[name] = {"n": 0}
            continue
        mhz = sorted(x["sm_mhz"] for x in s)
        hot = [x for x in s if x["reasons"] & sum(REASONS)]
        out[name] = {"n": len(s), "sm_mhz_p50": mhz[len(mhz) // 2], "sm_mhz_min": mhz[0],
                     "power_w_mean": round(sum(x["power_w"] for x in s) / len(s), 1),
                     "temp_c_max": max(x["temp_c"] for x in s), "throttled": round(len(hot) / len(s), 3),
                     "reasons": sorted({n for x in hot for bit, n in REASONS.items() if x["reasons"] & bit})}
    return out


def text(phases: dict[str, dict]) -> str:
    """One line of ``by_phase``'s summary (phases without samples left out)."""
    return "  ".join(
        f"{ph} {g['sm_mhz_p50']} MHz (min {g['sm_mhz_min']}) {g['power_w_mean']:.0f} W {g['temp_c_max']} C"
        + (f" throttled {g['throttled']:.0%} {','.join(g['reasons'])}" if g["throttled"] else "")
        for ph, g in phases.items() if g["n"])
