"""In-process host tier (engine "local"): host-memory KV store + a sparse-attention pool.

Attention runs on one submission thread calling the C++ kernel (GIL released) whose OpenMP team is
sized by NELSSA_POOL_THREADS and optionally pinned by NELSSA_AFFINITY_CORES; the caller keeps
running device work and collects the (output, LSE) later. Failures raise HostError: callers must
fail the affected requests, never merge a partial result.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from nelssa.config import NelssaConfig
from nelssa.sparse import ClusteredKV, RequestKV, Selection, attend, cluster_kv


class HostError(RuntimeError):
    """The host tier could not serve a request."""


class HostStats:
    """Counters since the last take() (for the stats connector), and lifetime totals; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.totals: dict[str, float] = {}  # sums since start; lists count too, as "<name>_n"
        self.reset()

    def reset(self) -> None:
        self.long_requests = 0
        self.attn_s: list[float] = []      # per-layer host attention seconds (one batched submission)
        self.cluster_s: list[float] = []   # per-request clustering seconds (all layers of a move)
        self.moved_tokens = 0
        self.failures = 0

    def take(self) -> dict:
        with self._lock:
            d = {"long_requests": self.long_requests, "attn_s": self.attn_s, "cluster_s": self.cluster_s,
                 "moved_tokens": self.moved_tokens, "failures": self.failures}
            self.reset()
        return d

    def add(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                if isinstance(getattr(self, k), list):
                    getattr(self, k).append(v)
                    self.totals[k + "_n"] = self.totals.get(k + "_n", 0) + 1
                else:
                    setattr(self, k, getattr(self, k) + v)
                self.totals[k] = self.totals.get(k, 0) + v


class LocalHostTier:
    def __init__(self, cfg: NelssaConfig, num_layers: int):
        self.cfg = cfg
        self.num_layers = num_layers
        self.reqs: dict[str, RequestKV] = {}
        self.stats = HostStats()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nelssa-host")
        self._lock = threading.Lock()

    # -------- KV placement
    def put(self, req_id: str, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Cluster tokens [H, n, D] of a layer into the request's store (first call) or append them."""
        with self._lock:
            rkv = self.reqs.get(req_id)
            if rkv is None:
                rkv = self.reqs[req_id] = RequestKV(req_id, self.num_layers)
                self.stats.add(long_requests=1)
        ckv = rkv.layers[layer]
        if ckv is None:
            rkv.set_layer(layer, cluster_kv(keys, values, seed=self.cfg.seed + layer))
        else:
            ckv.append(keys, values)

    def layer_kv(self, req_id: str, layer: int) -> ClusteredKV:
        rkv = self.reqs.get(req_id)
        if rkv is None:
            raise HostError(f"request {req_id} has no host KV")
        return rkv.layer(layer)

    def has(self, req_id: str) -> bool:
        return req_id in self.reqs

    def free(self, req_id: str) -> bool:
        with self._lock:
            rkv = self.reqs.pop(req_id, None)
        if rkv is not None:
            rkv.free()
        return rkv is not None

    @property
    def nbytes(self) -> int:
        with self._lock:
            reqs = list(self.reqs.values())
        return sum(r.nbytes for r in reqs)

    # -------- attention
    def submit_attend(self, q: torch.Tensor, ckvs: list[ClusteredKV], sel: Selection, scale: float,
                      layer: int) -> Future:
        """Start host attention of q [n, Hq, D] over the selected clusters; returns a future of
        fp32 (out [n, Hq, D], lse [n, Hq]) on the host."""
        q_cpu = q.detach().to("cpu")  # in the caller's stream/thread; the kernel takes the KV dtype
        fault = self.cfg.fault

        def run():
            t = time.perf_counter()
            if fault == "attend":
                raise HostError("injected host-tier fault (NELSSA_FAULT=attend)")
            out = attend(q_cpu, ckvs, sel, scale)
            self.stats.add(attn_s=time.perf_counter() - t)
            return out

        return self._pool.submit(run)

    def wait(self, fut: Future, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            out, lse = fut.result(timeout=self.cfg.host_timeout_s)
        except FutureTimeout:
            self.stats.add(failures=1)
            raise HostError(f"host attention of layer {layer} timed out after {self.cfg.host_timeout_s}s") from None
        except Exception:
            self.stats.add(failures=1)
            raise
        if not (torch.isfinite(out).all() and not torch.isnan(lse).any()):
            self.stats.add(failures=1)
            raise HostError(f"host attention of layer {layer} returned non-finite values")
        return out, lse

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for r in list(self.reqs):
            self.free(r)
