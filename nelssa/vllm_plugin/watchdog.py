"""Stall watchdog: where every thread of the worker is when the engine's step thread stops stepping
(config ``stall_log_ms``; 0 = off). A diagnostic for issue 9's "short requests never wait": a run's
per-token stamps show that short tokens stopped, this shows why.

  1. The runner calls ``beat(busy)`` at the start of every ``execute_model`` (the step thread); ``busy``:
     the step schedules work, so another step is due (an idle engine is not a stall).
  2. A daemon thread wakes every ``stall_log_ms / 4``; when the last beat is older than
     ``stall_log_ms`` it logs, once per stall, the stall's start (``time.perf_counter``: the same clock
     as the hol benchmark's stamps, system-wide on Linux) and the Python stack of every thread (the
     step thread, the lane, the hand-off, vLLM's own), then again when the next beat ends it, with its
     length. It needs the GIL to sample: a stall in C code holding the GIL shows as a late sample.
  3. CUDA (``StepTimer``): the device span of every step's ``execute_model`` (events before and after the
     work it enqueues on the step's stream, read back at later steps without waiting); a step whose
     span exceeds ``stall_log_ms / 5`` is logged with its stamps, what it carried (requests, tokens,
     lane rows) and what shared the device as it was enqueued (moves in flight, the lane batch's rows). The H200 profile of hol run 23 found 6-ms decode steps standing ~38 ms on the device
     once per lane batch, below any stall limit: this shows such steps in a plain run.
The same setting turns on the scheduler's trace of its reserves while a long prompt prefills or holds its
blocks (NelssaScheduler._trace_reserve, at most every 0.5 s).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections import deque

log = logging.getLogger("vllm.nelssa")


class Watchdog:
    def __init__(self, stall_ms: float):
        self.limit = stall_ms / 1e3
        self._last = time.perf_counter()
        self._stalled = False
        self._busy = False
        self._step_thread = None
        self._thread = threading.Thread(target=self._loop, name="nelssa-watchdog", daemon=True)
        self._thread.start()

    def beat(self, busy: bool) -> None:
        now = time.perf_counter()
        self._busy = busy
        if self._stalled:
            self._stalled = False
            log.warning("NELSSA watchdog: the step thread stepped again after %.0f ms (at t=%.3f)",
                        (now - self._last) * 1e3, now)
        self._step_thread = threading.get_ident()
        self._last = now

    def _loop(self) -> None:
        while True:
            time.sleep(self.limit / 4)
            last = self._last
            now = time.perf_counter()
            if self._stalled or not self._busy or now - last < self.limit:
                continue
            self._stalled = True
            names = {t.ident: t.name for t in threading.enumerate()}
            out = []
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident():
                    continue
                who = names.get(ident, str(ident)) + (" [step thread]" if ident == self._step_thread else "")
                stack = "".join(traceback.format_stack(frame, limit=8))
                out.append(f"--- {who}\n{stack}")
            log.warning("NELSSA watchdog: no step for %.0f ms (last step began at t=%.3f, sampled at t=%.3f); "
                        "threads:\n%s", (now - last) * 1e3, last, now, "\n".join(out))


class StepTimer:
    """The device span of each step (3). Step thread only."""

    def __init__(self, stall_ms: float):
        import torch
        self._torch = torch
        self.limit_ms = stall_ms / 5
        self._pending: deque = deque()
        self._free: list = []

    def _event(self):
        return self._free.pop() if self._free else self._torch.cuda.Event(enable_timing=True)

    def start(self):
        e = self._event()
        e.record()
        return e, time.perf_counter()

    def end(self, started, info: str) -> None:
        e = self._event()
        e.record()
        self._pending.append((started, e, info))
        while self._pending and self._pending[0][1].query():
            (s, t0), e, what = self._pending.popleft()
            ms = s.elapsed_time(e)
            if ms > self.limit_ms:
                log.info("NELSSA step: %.1f ms on the device (enqueued from t=%.3f; %s)", ms, t0, what)
            self._free += [s, e]
