"""Scheduler (``--scheduler-cls``): host-tier admission and error results for long requests.

* Admission: a long request reserves host-tier bytes for prompt + max_tokens. More than the whole
  capacity: rejected at once with an error result saying so. More than what is free now: held back
  (not scheduled) until running long requests finish.
* Errors: requests the worker reports failed (host-tier exception, timeout, missing KV) are finished
  with FINISHED_ERROR *before* this step's tokens are emitted, so no token computed from a failed
  attention reaches the client.
Reservations are released when a request finishes (preemption keeps it: the request comes back).
"""

from __future__ import annotations

import logging
from collections import deque

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import Request, RequestStatus

from nelssa.config import mem_available, vllm_nelssa_config
from nelssa.vllm_plugin.policy import host_bytes
from nelssa.vllm_plugin.spec import NelssaSpec

log = logging.getLogger("vllm.nelssa")


class NelssaScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.nelssa = cfg = vllm_nelssa_config(self.vllm_config.additional_config)
        self._held: deque[Request] = deque()
        self._reserved: dict[str, int] = {}
        self._rejected: list[tuple[Request, str]] = []
        if cfg is None:
            return
        groups = self.kv_cache_config.kv_cache_groups
        specs = [g.kv_cache_spec for g in groups]
        if len(groups) != 1 or not isinstance(specs[0], NelssaSpec):
            raise ValueError(f"NELSSA expects one KV-cache group of NelssaSpec layers, got "
                             f"{[type(s).__name__ for s in specs]}: is the model a Llama served with the "
                             "nelssa plugin?")
        spec = specs[0]
        self.nelssa_policy = spec.policy()
        self._bytes_per = (len(groups[0].layer_names), spec.num_kv_heads, spec.head_size, spec.dtype.itemsize)
        self.host_capacity = cfg.host_capacity or int(0.8 * mem_available())
        log.info("NELSSA scheduler: T_input=%d, host capacity %.2f GiB", cfg.T_input, self.host_capacity / 2**30)

    # ------------------------------------------------------------ admission
    def _need(self, request: Request) -> int:
        return host_bytes(request.num_prompt_tokens + request.max_tokens, *self._bytes_per)

    def add_request(self, request: Request) -> None:
        if self.nelssa is None or not self.nelssa_policy.is_long(request.num_prompt_tokens) \
                or request.request_id in self.requests:
            return super().add_request(request)
        need = self._need(request)
        if need > self.host_capacity:
            msg = (f"nelssa: request needs {need / 2**30:.2f} GiB of host-tier memory for "
                   f"{request.num_prompt_tokens} prompt + {request.max_tokens} max tokens; the host tier "
                   f"holds {self.host_capacity / 2**30:.2f} GiB (NELSSA_HOST_CAPACITY)")
            log.error("rejecting request %s: %s", request.request_id, msg)
            request.status = RequestStatus.FINISHED_ERROR
            self._rejected.append((request, msg))
            return
        if need > self.host_capacity - sum(self._reserved.values()):
            self._held.append(request)
            return
        self._reserved[request.request_id] = need
        super().add_request(request)

    def _admit_held(self) -> None:
        while self._held:
            need = self._need(self._held[0])
            if need > self.host_capacity - sum(self._reserved.values()):
                return
            req = self._held.popleft()
            self._reserved[req.request_id] = need
            super().add_request(req)

    def schedule(self, *args, **kwargs):
        self._admit_held()
        return super().schedule(*args, **kwargs)

    def _free_request(self, request: Request, delay_free_blocks: bool = False):
        self._reserved.pop(request.request_id, None)
        return super()._free_request(request, delay_free_blocks)

    def finish_requests(self, request_ids, finished_status):
        if self._held and request_ids is not None:
            ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
            gone = [r for r in self._held if r.request_id in ids]
            for r in gone:
                self._held.remove(r)
                r.status = finished_status
        return super().finish_requests(request_ids, finished_status)

    def get_num_unfinished_requests(self) -> int:
        return super().get_num_unfinished_requests() + len(self._held) + len(self._rejected)

    # ------------------------------------------------------------ errors
    def update_from_output(self, scheduler_output, model_runner_output):
        errors: list[EngineCoreOutput] = []
        clients: list[int] = []
        kvo = model_runner_output.kv_connector_output
        failed = getattr(kvo.kv_connector_worker_meta, "failed", None) if kvo is not None else None
        if failed:
            for req in self.finish_requests(failed.keys(), RequestStatus.FINISHED_ERROR):
                errors.append(self._error_output(req, f"nelssa: {failed[req.request_id]}"))
                clients.append(req.client_index)
        for req, msg in self._rejected:
            errors.append(self._error_output(req, msg))
            clients.append(req.client_index)
        self._rejected.clear()
        out = super().update_from_output(scheduler_output, model_runner_output)
        for client, eco in zip(clients, errors):
            if client in out:
                out[client].outputs.append(eco)
            else:
                out[client] = EngineCoreOutputs(outputs=[eco])
        if self.nelssa is not None and self.connector is not None and hasattr(self.connector, "sched_stats"):
            self.connector.sched_stats["reserved_bytes"] = sum(self._reserved.values())
        return out

    @staticmethod
    def _error_output(req: Request, msg: str) -> EngineCoreOutput:
        return EngineCoreOutput(request_id=req.request_id, new_token_ids=[], finish_reason=req.get_finished_reason(),
                                stop_reason=msg, events=req.take_events(), trace_headers=req.trace_headers)
