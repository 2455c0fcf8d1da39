"""Per-process state shared by the worker-side pieces (runner, attention, connector)."""

from __future__ import annotations

import threading

_host = None
_lane = None
_lock = threading.Lock()
failed: dict[str, str] = {}   # request id -> why it failed; kept until the request is freed
_reported: set[str] = set()
_handoffs: dict[str, tuple[int, int]] = {}  # request id -> (end of completed hand-offs, generation)
_released: list[str] = []  # finished requests the lane is done with, not yet reported (lane.py, 6)
_handed: set[str] = set()  # finished requests whose hand-over ended (handover.py): their blocks can go
_recalled: list[str] = []  # requests loaded back onto the device, not yet reported (recall.py, 3)


def set_host(host) -> None:
    global _host
    _host = host


def host():
    return _host


def set_lane(lane) -> None:
    global _lane
    _lane = lane


def lane():
    """This worker's lane.Lane (config ``lane``), or None."""
    return _lane


def fail(req_id: str, msg: str) -> None:
    with _lock:
        failed.setdefault(req_id, msg)


def take_new_failures() -> dict[str, str]:
    """Failures not yet reported to the scheduler (each is reported once)."""
    with _lock:
        new = {k: v for k, v in failed.items() if k not in _reported}
        _reported.update(new)
    return new


def forget(req_id: str) -> None:
    with _lock:
        failed.pop(req_id, None)
        _reported.discard(req_id)


def handoff_done(req_id: str, end: int, gen: int) -> None:
    """A hand-off of the request (``gen``: how often it was preempted) completed up to ``end``."""
    with _lock:
        e, g = _handoffs.get(req_id, (0, -1))
        if gen > g:
            _handoffs[req_id] = (end, gen)
        elif gen == g:
            _handoffs[req_id] = (max(e, end), gen)


def take_handoffs() -> dict[str, tuple[int, int]]:
    """Completed hand-offs not yet reported to the scheduler."""
    global _handoffs
    with _lock:
        out, _handoffs = _handoffs, {}
    return out


def released(ids) -> None:
    """Finished requests whose lane jobs have ended and whose host state is freed: their blocks can go."""
    with _lock:
        _released.extend(ids)


def take_released() -> list[str]:
    global _released
    with _lock:
        out, _released = _released, []
    return out


def handed_over(req_id: str) -> None:
    """A finished request's hand-over ended (released to the node, or given up): its blocks can go."""
    with _lock:
        _handed.add(req_id)


def take_handed_over() -> set[str]:
    global _handed
    with _lock:
        out, _handed = _handed, set()
    return out


def recalled(req_id: str) -> None:
    """A recalled request's KV is on the device again and its host KV freed (recall.py, 3)."""
    with _lock:
        _recalled.append(req_id)


def take_recalled() -> list[str]:
    global _recalled
    with _lock:
        out, _recalled = _recalled, []
    return out
