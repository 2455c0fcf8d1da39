"""Host-tier ownership: a request's clustered KV for all layers, and a byte-accounted store."""

from __future__ import annotations

import threading

from nelssa.sparse.clustered import ClusteredKV


class RequestKV:
    """One request's clustered KV, one ClusteredKV per layer; ``free()`` releases all of it."""

    def __init__(self, req_id: str, num_layers: int):
        self.req_id = req_id
        self.layers: list[ClusteredKV | None] = [None] * num_layers
        self.freed = False

    def set_layer(self, i: int, ckv: ClusteredKV) -> None:
        if self.freed:
            raise ValueError(f"request {self.req_id}: store already freed")
        if self.layers[i] is not None:
            self.layers[i].free()
        self.layers[i] = ckv

    def layer(self, i: int) -> ClusteredKV:
        ckv = self.layers[i]
        if ckv is None or self.freed:
            raise ValueError(f"request {self.req_id}: layer {i} has no host KV")
        return ckv

    @property
    def complete(self) -> bool:
        return all(c is not None for c in self.layers)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers if c is not None)

    @property
    def device_nbytes(self) -> int:
        return sum(c.device_nbytes for c in self.layers if c is not None)

    def free(self) -> None:
        for c in self.layers:
            if c is not None:
                c.free()
        self.layers = [None] * len(self.layers)
        self.freed = True


class CapacityError(RuntimeError):
    """The host tier cannot hold a request."""


class KVStore:
    """Thread-safe map req_id -> RequestKV with a byte capacity (reservations checked at admission)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._lock = threading.Lock()
        self._reqs: dict[str, RequestKV] = {}
        self._reserved: dict[str, int] = {}

    def reserve(self, req_id: str, nbytes: int) -> None:
        """Reserve bytes for a request before its KV arrives; raises CapacityError when it cannot fit."""
        with self._lock:
            used = sum(self._reserved.values())
            if nbytes > self.capacity - used + self._reserved.get(req_id, 0):
                raise CapacityError(f"request {req_id} needs {nbytes} B of host tier; "
                                    f"{self.capacity - used} B of {self.capacity} B free")
            self._reserved[req_id] = nbytes

    def add(self, rkv: RequestKV) -> None:
        with self._lock:
            if rkv.req_id in self._reqs:
                raise ValueError(f"request {rkv.req_id} already in the store")
            self._reqs[rkv.req_id] = rkv

    def get(self, req_id: str) -> RequestKV:
        with self._lock:
            return self._reqs[req_id]

    def __contains__(self, req_id: str) -> bool:
        with self._lock:
            return req_id in self._reqs

    def free(self, req_id: str) -> bool:
        """Free a request's host KV and reservation; False if it held nothing."""
        with self._lock:
            rkv = self._reqs.pop(req_id, None)
            had = self._reserved.pop(req_id, None) is not None
        if rkv is not None:
            rkv.free()
        return rkv is not None or had

    @property
    def nbytes(self) -> int:
        """Host bytes actually held by all requests."""
        with self._lock:
            reqs = list(self._reqs.values())
        return sum(r.nbytes for r in reqs)

    @property
    def reserved(self) -> int:
        with self._lock:
            return sum(self._reserved.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._reqs)
