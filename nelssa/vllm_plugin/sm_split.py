"""The GPU's SMs split between the engine's steps and the long lane (config ``lane_sms``; CUDA green contexts).

Why: on the H200 a lane batch (one token of every long request) spends ~28 of its ~55 ms "between" two
layers' host calls (docs/results.md, runs 56/58): the lane's per-layer device work, a dozen small kernels
for one or two rows, each waiting for an SM that the step's kernels (a long prompt's prefill chunk, ~50
short rows) hold. Stream priority only orders blocks waiting for a free SM; it does not free one. A
green context gives the lane SMs of its own. The contract:

  1. ``setup(cfg, device)`` (the worker, before its model runner is built, in place of ``step_stream``'s
     plain priority stream): with ``cfg.lane_sms`` > 0 the device's SMs are split in two disjoint
     groups (``cuDevSmResourceSplitByCount``: ``lane_sms`` rounded up to the device's granularity, and
     the rest), a green context is made of each, and the step stream (vLLM's current stream: its steps,
     graph captures and replays) becomes a stream of the rest's context at ``cfg.step_priority``. An
     explicit ``lane_sms`` that cannot be had (no green contexts in this driver, more SMs than the
     device has less one group) raises: never a silent shared GPU.
  2. ``lane_stream(device, priority)`` (the lane, lane.py): a new stream of the lane's context, or None
     when there is no split (the lane makes a plain stream). Its kernels run on the lane's SMs only;
     the steps' on the others only. Streams of the primary context (the hand-off's side stream, vLLM's
     and NIXL's own) still run anywhere, below both in priority.
  3. ``describe()``: the split as set up (SM counts), for the engine's log and the benchmarks.

The lane's SMs idle when no long request decodes: the steps lose ``lane_sms`` of the device's SMs for
the engine's life (decode is bandwidth-bound, prefill compute-bound: measure before/after TPOT and long
TTFT against 0 — the default, no split). The driver API is reached through ctypes (libcuda.so.1); its
resource structures are held in zeroed buffers larger than any driver's, and only the SM count of a
split group is read (``CUdevResource``: a 4-byte type, 92 bytes of padding, then ``sm.smCount``).
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger("vllm.nelssa")

_RESOURCE_BYTES = 4096        # larger than CUdevResource in any CUDA 12/13 driver; zeroed
_SM_COUNT_OFFSET = 96         # CUdevResource.sm.smCount: after the type (4) and the padding (92)
_CU_DEV_RESOURCE_TYPE_SM = 1
_CU_GREEN_CTX_DEFAULT_STREAM = 0x1
_CU_STREAM_NON_BLOCKING = 0x1

_split: dict | None = None    # the process's split once set up (1): contexts, SM counts, device


class SplitError(RuntimeError):
    """``lane_sms`` was asked for and the split could not be made."""


def _driver():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise SplitError(f"lane_sms: no CUDA driver library ({e})") from e
    for name in ("cuDeviceGet", "cuDeviceGetDevResource", "cuDevSmResourceSplitByCount", "cuDevResourceGenerateDesc",
                 "cuGreenCtxCreate", "cuGreenCtxStreamCreate"):
        if not hasattr(lib, name):
            raise SplitError(f"lane_sms: this CUDA driver has no {name} (green contexts need a driver of CUDA 12.5+)")
    return lib


def _check(r: int, what: str) -> None:
    if r != 0:
        raise SplitError(f"lane_sms: {what} failed (CUresult {r})")


def _sm_count(res: ctypes.Array) -> int:
    return int.from_bytes(bytes(res[_SM_COUNT_OFFSET:_SM_COUNT_OFFSET + 4]), "little")


def setup(cfg, device: torch.device) -> bool:
    """1: split the SMs and make the step stream one of the rest's context -> whether a split is in place
    (False: ``lane_sms`` 0, nothing done). Once per process."""
    global _split
    if cfg is None or cfg.lane_sms == 0:  # (lane_sms with the lane off is refused by the config itself)
        return False
    if _split is not None:
        return True
    lib = _driver()
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_device(index)
    torch.cuda.init()  # the primary context exists before a green one is made from the device
    dev = ctypes.c_int()
    _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
    whole = ctypes.create_string_buffer(_RESOURCE_BYTES)
    _check(lib.cuDeviceGetDevResource(dev, whole, _CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource")
    total = torch.cuda.get_device_properties(index).multi_processor_count
    lane, rest = ctypes.create_string_buffer(_RESOURCE_BYTES), ctypes.create_string_buffer(_RESOURCE_BYTES)
    groups = ctypes.c_uint(1)
    _check(lib.cuDevSmResourceSplitByCount(lane, ctypes.byref(groups), whole, rest, 0, ctypes.c_uint(cfg.lane_sms)),
           f"cuDevSmResourceSplitByCount({cfg.lane_sms} of {total} SMs)")
    if groups.value != 1:
        raise SplitError(f"lane_sms: {cfg.lane_sms} of {total} SMs gave {groups.value} groups, not one")
    n_lane, n_rest = _sm_count(lane), _sm_count(rest)
    if n_lane + n_rest != total or not 0 < n_lane < total:  # the struct's layout not as assumed: counts unknown
        log.warning("NELSSA: the SM split's group sizes could not be read (%d, %d of %d)", n_lane, n_rest, total)
        n_lane = n_rest = None
    elif n_rest < n_lane:
        raise SplitError(f"lane_sms: {cfg.lane_sms} of {total} SMs leaves the steps {n_rest}: fewer than the lane's")
    ctxs = {}
    for name, res in (("lane", lane), ("steps", rest)):
        desc, ctx = ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cuDevResourceGenerateDesc(ctypes.byref(desc), res, 1), "cuDevResourceGenerateDesc")
        _check(lib.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, _CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate")
        ctxs[name] = ctx
    _split = {"lib": lib, "ctx": ctxs, "device": index, "lane_sms": n_lane, "step_sms": n_rest, "total_sms": total}
    step = _stream("steps", cfg.step_priority)
    torch.cuda.set_stream(step)
    log.info("NELSSA: %s", describe())
    return True


def _stream(name: str, priority: int) -> torch.cuda.ExternalStream:
    s = _split
    raw = ctypes.c_void_p()
    _check(s["lib"].cuGreenCtxStreamCreate(ctypes.byref(raw), s["ctx"][name], _CU_STREAM_NON_BLOCKING,
                                           ctypes.c_int(priority)), "cuGreenCtxStreamCreate")
    # never destroyed: the streams and their contexts live as long as the process
    return torch.cuda.ExternalStream(raw.value, device=torch.device("cuda", s["device"]))


def lane_stream(device: torch.device, priority: int) -> torch.cuda.ExternalStream | None:
    """2: a stream of the lane's SMs, or None without a split."""
    if _split is None:
        return None
    return _stream("lane", priority)


def describe() -> str:
    """3"""
    s = _split
    if s is None:
        return "no SM split (lane_sms 0): the steps and the lane share every SM"
    if s["lane_sms"] is None:
        return f"SMs split by green contexts (group sizes unread; {s['total_sms']} in all)"
    return (f"SMs split by green contexts: the lane {s['lane_sms']}, the steps {s['step_sms']} "
            f"(of {s['total_sms']})")
