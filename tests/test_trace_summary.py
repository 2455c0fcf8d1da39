"""trace_summary on a Chrome trace in the torch profiler's format: per-stream queueing and per-thread waits."""

import gzip
import json

from nelssa.bench import trace_summary


def _trace():
    ev = []
    # step thread 1: launches two kernels on stream 7, each starting 5 us after its launch returns
    for i, t in enumerate((0.0, 100.0)):
        ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": t, "dur": 20.0, "tid": 1})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t + 5, "dur": 10.0, "tid": 1,
                   "args": {"correlation": 10 + i}})
        ev.append({"ph": "X", "cat": "kernel", "name": "gemm", "ts": t + 20, "dur": 50.0, "tid": 7,
                   "args": {"stream": 7, "correlation": 10 + i}})
    # hand-off thread 2: one kernel on stream 13 that waits 300 us behind the step's work, then a sync
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::bmm", "ts": 10.0, "dur": 15.0, "tid": 2})
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 12.0, "dur": 8.0, "tid": 2,
               "args": {"correlation": 20}})
    ev.append({"ph": "X", "cat": "kernel", "name": "kmeans_bmm", "ts": 320.0, "dur": 40.0, "tid": 13,
               "args": {"stream": 13, "correlation": 20}})
    ev.append({"ph": "X", "cat": "cpu_op", "name": "aten::item", "ts": 30.0, "dur": 340.0, "tid": 2})
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 31.0, "dur": 335.0,
               "tid": 2})
    return ev


def test_streams_queueing_and_thread_waits(tmp_path):
    path = tmp_path / "t.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace()}, f)
    s = trace_summary.summarize(trace_summary.load(str(path)))
    st = s["streams"]
    assert list(st) == ["7", "13"]  # the busier stream first
    assert st["7"]["busy_ms"] == 0.1 and st["7"]["n"] == 2
    assert st["7"]["queued_by_thread"] == {"1": {"n": 2, "ms": 0.01, "p50_us": 5.0, "max_us": 5.0}}
    assert st["13"]["queued_by_thread"]["2"]["max_us"] == 300.0
    assert st["13"]["top_kernels_ms"] == {"kmeans_bmm": 0.04}
    th = s["threads"]
    assert th["1"]["cuda_launches"] == 2 and th["1"]["cuda_wait_ms"] == 0.0
    assert th["2"]["cuda_launches"] == 1 and th["2"]["cuda_wait_ms"] == 0.335
    assert s["cuda_waits"]["cudaStreamSynchronize"] == {"n": 1, "ms": 0.335}
