"""Does a chain with host work delay *another* stream's work? (CUDA; issue 9's decode-phase stalls)

In the head-of-line runs a short-request step that the engine enqueued right after a lane batch's
launch waited on the device for most of that batch (hol runs 23, 25, 26: once per lane batch, 40-55 ms
instead of ~6), although no event or stream wait ties the step to the lane. The lane batch hands its
host attention to the CPU 32 times, as CUDA host functions (csrc/host_call.cpp). CUDA documents that
"adding device work to any stream does not have the effect of making the stream active until all
preceding host functions and stream callbacks have executed" (cuLaunchHostFunc). This measures it
without vLLM, for the two ways the device can wait for the host:

  hostfn   per layer: a small kernel -> a host function that works ``--host-ms`` on the driver's
           callback thread (the lane's way today);
  memop    per layer: a small kernel -> the device writes a "ready" flag in pinned memory
           (cuStreamWriteValue32) -> waits until the host sets "done" (cuStreamWaitValue32) -> clears it;
           a thread of ours polls the flags and does the ``--host-ms`` of work (no host function);

each enqueued on a lane stream (``stream``) or captured once and replayed as a CUDA graph (``graph``).
Right after enqueueing the chain, another stream gets one small kernel; reported per case (medians over
``--reps``): ``lane_ms`` (the chain on the device) and ``other_done_ms`` (that kernel's completion, from
the chain's start). No coupling: ``other_done_ms`` ~ 0; coupling: ~ ``lane_ms``.

    python3 benchmarks/bench_stream_coupling.py [--layers 32] [--host-ms 0.8] [--reps 20] [--out FILE]
        [--shape single,branched] [--other pool,default] [--kernels 1,45]

``--shape``: the chain on one stream (``single``) or with the host work on a branch joined back by
events per layer (``branched``, the lane's shape); ``--other``: the other kernel on a stream of torch's
pool (non-blocking) or on the legacy default stream (``default``).
``--steps WAYS`` (``none``, ``hostfn-native``: libc's usleep as the host function, no GIL; ``hostfn``;
``memop``; ``memop-native``: the poller as a C thread, compiled with gcc at run time) runs the engine-like
experiment instead (``measure_steps``), with ``--step-graph/--step-eager/--step-pageable/--busy-us/--copies``.
Measured on the H200 (2026-12-03, docs/results.md, thirteenth and fourteenth sessions).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import threading
import time

import torch

CU_STREAM_WAIT_VALUE_EQ = 0x1


def _cu():
    lib = ctypes.CDLL("libcuda.so.1")

    def fn(*names):
        for n in names:
            try:
                return getattr(lib, n)
            except AttributeError:
                continue
        raise RuntimeError(f"libcuda has none of {names}")

    write = fn("cuStreamWriteValue32_v2", "cuStreamWriteValue32")
    wait = fn("cuStreamWaitValue32_v2", "cuStreamWaitValue32")
    for f in (write, wait):
        f.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        f.restype = ctypes.c_int
    host = lib.cuLaunchHostFunc
    host.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    host.restype = ctypes.c_int
    devptr = fn("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
    devptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    devptr.restype = ctypes.c_int
    return write, wait, host, devptr


_POLLER_C = r"""
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
static volatile int *flags; static int n, us; static atomic_int run; static pthread_t th;
static void work(int us) { struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
  do { clock_gettime(CLOCK_MONOTONIC, &b); } while ((b.tv_sec - a.tv_sec) * 1000000L + (b.tv_nsec - a.tv_nsec) / 1000 < us); }
static void *loop(void *x) { (void)x; while (atomic_load(&run)) { for (int i = 0; i < n; i++) if (flags[i] == 1) {
  flags[i] = 0; work(us); atomic_thread_fence(memory_order_seq_cst); flags[n + i] = 1; } } return 0; }
void start(volatile int *f, int layers, int work_us) { flags = f; n = layers; us = work_us; atomic_store(&run, 1);
  pthread_create(&th, 0, loop, 0); }
void stop(void) { atomic_store(&run, 0); pthread_join(th, 0); }
"""


def _native_poller():
    """The memop poller as a C thread, compiled here (gcc): spins over the ready flags, works ``us``
    microseconds (busy, like the host attention), sets done."""
    import os
    import subprocess
    import tempfile
    d = tempfile.mkdtemp()
    src, lib = os.path.join(d, "poller.c"), os.path.join(d, "poller.so")
    with open(src, "w") as f:
        f.write(_POLLER_C)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-pthread", src, "-o", lib], check=True)
    so = ctypes.CDLL(lib)
    so.start.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return so


def _check(r: int, what: str) -> None:
    if r != 0:
        raise RuntimeError(f"{what} failed (CUresult {r})")


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


class Chain:
    """``layers`` x (kernel -> host work) on ``stream``, in one of the two ways (module docstring)."""

    def __init__(self, way: str, layers: int, host_ms: float, branched: bool = True, kernels: int = 1,
                 copies: bool = False):
        self.way, self.layers, self.host_ms, self.branched, self.kernels = way, layers, host_ms, branched, kernels
        # copies: per layer the lane's transfers around its host work (queries device -> pinned, result
        # pinned -> device), as memcpy nodes in the graph
        self.copies = copies
        self.q = torch.zeros(2, 4096, dtype=torch.bfloat16, device="cuda")
        self.q_host = torch.zeros(2, 4096, dtype=torch.bfloat16, pin_memory=True)
        self.o_host = torch.zeros(2, 4096, dtype=torch.float32, pin_memory=True)
        self.o = torch.zeros(2, 4096, dtype=torch.float32, device="cuda")
        self.write, self.wait, self.host, devptr = _cu()
        self.x = torch.zeros(1024, device="cuda")
        self.cb = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: _spin(self.host_ms))  # hostfn
        # hostfn-native: libc's usleep as the host function (its argument, the microseconds, passed as the
        # user data): no Python, no GIL on the driver's callback thread, as with csrc/host_call.cpp
        self.usleep = ctypes.cast(ctypes.CDLL("libc.so.6").usleep, ctypes.c_void_p)
        self.flags = torch.zeros(2 * layers, dtype=torch.int32, pin_memory=True)  # ready[i], done[i]
        self.view = self.flags.numpy()
        d = ctypes.c_uint64()
        _check(devptr(ctypes.byref(d), ctypes.c_void_p(self.flags.data_ptr()), 0), "cuMemHostGetDevicePointer")
        self.dev = d.value
        self.host_stream = torch.cuda.Stream(priority=-1)  # the host work's branch, as lane_host.py has it
        self.events = [(torch.cuda.Event(), torch.cuda.Event()) for _ in range(layers)]
        self.stop = threading.Event()
        self.poller = None
        if way == "memop":
            self.poller = threading.Thread(target=self._poll, daemon=True)
            self.poller.start()
        self.native = None
        if way == "memop-native":  # the poller in C (no GIL): a thread of ours, as a real fix would have
            self.native = _native_poller()
            self.native.start(ctypes.c_void_p(self.flags.data_ptr()), layers, ctypes.c_int(int(host_ms * 1e3)))

    def _poll(self) -> None:
        v, n = self.view, self.layers
        while not self.stop.is_set():
            for i in range(n):
                if v[i] == 1:
                    v[i] = 0
                    _spin(self.host_ms)
                    v[n + i] = 1

    def enqueue(self, stream: torch.cuda.Stream) -> None:
        """Per layer: a kernel on ``stream`` -> (event) -> the host work on the host branch -> (event) ->
        back on ``stream``: lane_host.py's shape (``branched``); else all of it on ``stream``."""
        hs = self.host_stream if self.branched else stream
        s = ctypes.c_void_p(hs.cuda_stream)
        n = self.layers
        for i in range(n):
            ready, done = self.events[i]
            with torch.cuda.stream(stream):
                for _ in range(self.kernels):
                    self.x.add_(1.0)
                if self.copies:
                    self.q_host.copy_(self.q, non_blocking=True)
                ready.record(stream)
            if hs is not stream:
                hs.wait_event(ready)
            with torch.cuda.stream(hs):
                if self.way == "hostfn":
                    _check(self.host(s, ctypes.cast(self.cb, ctypes.c_void_p), None), "cuLaunchHostFunc")
                elif self.way == "hostfn-native":
                    _check(self.host(s, self.usleep, ctypes.c_void_p(max(1, int(self.host_ms * 1e3)))),
                           "cuLaunchHostFunc")
                elif self.way == "none":
                    pass
                elif self.way == "memop-native":
                    _check(self.write(s, self.dev + 4 * i, 1, 0), "cuStreamWriteValue32")
                    _check(self.wait(s, self.dev + 4 * (n + i), 1, CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32")
                    _check(self.write(s, self.dev + 4 * (n + i), 0, 0), "cuStreamWriteValue32")
                else:
                    _check(self.write(s, self.dev + 4 * i, 1, 0), "cuStreamWriteValue32")
                    _check(self.wait(s, self.dev + 4 * (n + i), 1, CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32")
                    _check(self.write(s, self.dev + 4 * (n + i), 0, 0), "cuStreamWriteValue32")
                if self.copies:
                    self.o.copy_(self.o_host, non_blocking=True)
                done.record(hs)
            if hs is not stream:
                stream.wait_event(done)

    def close(self) -> None:
        if self.native is not None:
            self.native.stop()
        self.stop.set()
        if self.poller is not None:
            self.poller.join()


def measure(way: str, mode: str, layers: int, host_ms: float, reps: int, other_kind: str = "pool",
            branched: bool = True, kernels: int = 1) -> dict:
    """``other_kind``: the other work on a stream of torch's pool (non-blocking) or on the legacy default
    stream (``default``: the stream vLLM's model runner enqueues on unless told otherwise)."""
    lane = torch.cuda.Stream(priority=-1)
    other = torch.cuda.default_stream() if other_kind == "default" else torch.cuda.Stream()
    chain = Chain(way, layers, host_ms, branched, kernels)
    y = torch.zeros(1024, device="cuda")
    graph = None
    try:
        if mode == "graph":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=lane):
                chain.enqueue(lane)
            torch.cuda.synchronize()
        lane_ms, other_ms = [], []
        for _ in range(reps + 2):
            start, end, done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record(lane)
            if graph is not None:
                with torch.cuda.stream(lane):
                    graph.replay()
            else:
                chain.enqueue(lane)
            end.record(lane)
            with torch.cuda.stream(other):  # the "next step": one small kernel, no tie to the lane
                y.add_(1.0)
                done.record(other)
            while not (end.query() and done.query()):
                time.sleep(0.0002)
            lane_ms.append(start.elapsed_time(end))
            other_ms.append(start.elapsed_time(done))
        lane_ms, other_ms = lane_ms[2:], other_ms[2:]  # the first replays warm up
        return {"way": way, "mode": mode, "other": other_kind, "branched": branched, "kernels": kernels,
                "layers": layers,
                "host_ms": host_ms, "reps": reps, "lane_ms": statistics.median(lane_ms),
                "other_done_ms": statistics.median(other_ms),
                "other_done_max_ms": max(other_ms)}
    finally:
        torch.cuda.synchronize()
        chain.close()


def measure_steps(way: str, layers: int, host_ms: float, reps: int, kernels: int, step_graph: int,
                  step_eager: int, pageable: int = 0, copies: bool = False, busy_us: int = 0) -> dict:
    """Engine-like: while the chain's graph replays on the lane stream, the main thread runs "steps" one
    after another on its own stream, each a graph of ``step_graph`` small kernels (vLLM's full-graph
    decode forward) and ``step_eager`` eager kernels (logits, sampler), waiting for each (vLLM waits for
    the step before last: close enough), and ``pageable`` host-to-device copies from pageable memory (as
    ``torch.tensor(list, device=...)`` makes) issued ``busy_us`` into a kernel of the step's (the stream
    still busy, as with vLLM's async scheduling: the driver then stages the copy later, on its worker
    thread, instead of in the call). Per step: the device span (events around it) and the host's
    enqueue time; alone (``alone_*``) and while the chain runs (``during_*``)."""
    lane = torch.cuda.Stream(priority=-1)
    other = torch.cuda.Stream()
    chain = Chain(way, layers, host_ms, True, kernels, copies)
    y = torch.zeros(1024, device="cuda")
    src = torch.ones(256)  # pageable
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=lane):
            chain.enqueue(lane)
        sg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(sg, stream=other):
            for _ in range(step_graph):
                y.add_(1.0)
        torch.cuda.synchronize()

        def step():
            t = time.perf_counter()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(other):
                a.record(other)
                if busy_us:
                    torch.cuda._sleep(int(busy_us * 2000))  # ~2 GHz: cycles
                sg.replay()
                for _ in range(step_eager):
                    y.mul_(1.0)
                for _ in range(pageable):
                    y[:256].add_(src.to("cuda", non_blocking=True))
                b.record(other)
            host = (time.perf_counter() - t) * 1e3
            b.synchronize()
            return a.elapsed_time(b), host

        alone = [step() for _ in range(reps + 2)][2:]
        during, lane_ms = [], []
        for _ in range(reps + 2):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(lane)
            with torch.cuda.stream(lane):
                graph.replay()
            end.record(lane)
            while not end.query():
                during.append(step())
            end.synchronize()
            lane_ms.append(start.elapsed_time(end))
        q = lambda xs, f: round(f(xs), 3) if xs else None  # noqa: E731
        p99 = lambda xs: sorted(xs)[int(0.99 * (len(xs) - 1))]  # noqa: E731
        return {"experiment": "steps", "way": way, "kernels": kernels, "layers": layers, "host_ms": host_ms,
                "step_graph": step_graph, "step_eager": step_eager, "pageable": pageable, "copies": copies, "busy_us": busy_us, "lane_ms": q(lane_ms[2:], statistics.median),
                "alone_span_ms": q([s for s, _ in alone], statistics.median),
                "alone_host_ms": q([h for _, h in alone], statistics.median),
                "during_steps": len(during), "during_span_ms": q([s for s, _ in during], statistics.median),
                "during_span_p99_ms": q([s for s, _ in during], p99),
                "during_host_ms": q([h for _, h in during], statistics.median),
                "during_host_p99_ms": q([h for _, h in during], p99)}
    finally:
        torch.cuda.synchronize()
        chain.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--host-ms", type=float, default=0.8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shape", default="single,branched", help="chain shapes to run: single (one stream), branched")
    ap.add_argument("--other", default="pool,default", help="where the other work goes: pool, default")
    ap.add_argument("--kernels", default="1", help="kernels per layer before the host work, e.g. 1,45 (the "
                    "lane's graph has ~46 nodes per layer: does a large graph's launch hold back other streams?)")
    ap.add_argument("--steps", default="", help="engine-like experiment instead (measure_steps): ways, e.g. "
                    "none,hostfn-native,hostfn; with --step-graph/--step-eager")
    ap.add_argument("--step-graph", type=int, default=300)
    ap.add_argument("--step-eager", type=int, default=40)
    ap.add_argument("--step-pageable", type=int, default=0, help="pageable host-to-device copies per step")
    ap.add_argument("--busy-us", type=int, default=0, help="each step starts with a kernel this long, so its "
                    "pageable copies are issued while its stream is busy")
    ap.add_argument("--copies", action="store_true", help="the chain copies to/from pinned memory around its "
                    "host work per layer, as the lane does")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    sys.setswitchinterval(1e-4)  # the memop poller is a Python thread: let the enqueueing thread in
    rows = []
    if a.steps:
        for k in (int(x) for x in a.kernels.split(",")):
            for way in a.steps.split(","):
                r = measure_steps(way, a.layers, a.host_ms, a.reps, k, a.step_graph, a.step_eager, a.step_pageable,
                                  a.copies, a.busy_us)
                print(json.dumps(r), flush=True)
                rows.append(r)
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f,
                          indent=1)
        return
    cases = [(k, shape, other, way, mode) for k in (int(x) for x in a.kernels.split(","))
             for shape in a.shape.split(",") for other in a.other.split(",")
             for way in ("hostfn", "memop") for mode in ("stream", "graph")]
    for k, shape, other, way, mode in cases:
        try:
            r = measure(way, mode, a.layers, a.host_ms, a.reps, other, shape == "branched", k)
        except Exception as e:  # noqa: BLE001 - e.g. memops not capturable on this driver: say so
            r = {"way": way, "mode": mode, "other": other, "shape": shape, "kernels": k,
                 "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(r), flush=True)
        rows.append(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
