"""Hand-over of long prompts from a prefill instance (P) to a decode instance (D) through nelssa-node.

In a P/D stack with the node, P clusters a long prompt while it prefills it (the hand-off of a single
instance, handoff.py, storing into the node) and D adopts the node's request instead of clustering
the prompt again: clustering leaves D, whose steps serve the short requests. Both instances run the
NELSSA plugin with engine "node" and the same policy (T_input, sink, recent, block size); P has config
``handover``. The prompt's KV reaches D over NIXL (NixlConnector beside the NELSSA connector): only
its window once P has released it on the node (6), else whole, so D can fall back to clustering it.

Contract, by side:
  P, scheduler (NelssaScheduler, NelssaConnector.request_finished):
    1. A request P host-backs by its prompt (policy anchor = its prompt length), prefilled for remote
       decode (kv_transfer_params ``do_remote_decode``) and finished normally, gets a handle (128
       random bits) named in its returned kv_transfer_params: ``{"nelssa_handover": {"handle",
       "host_end", "block_size"}}`` (host_end: H0, the end of the range on the node; block_size: P's).
       Its blocks stay held (delayed free) until the worker reports the hand-over ended; the handle
       reaches the worker in the next step's connector metadata (``release``), with the request among
       that step's finished ones.
    2. Such a request is never switched on P (no host range in use, no block freed): D can read any
       block of it over NIXL (its window, 6, or all of them), and P never decodes it.
  P, worker (Handoff.handover):
    3. The finished request is not dropped on the step path: after its moves (the hand-off thread runs
       a request's work in order) its node entry is released under the handle with ``release_ttl_s``
       (its centroid state is on the node: the tier keeps it, node/client.py ``keep_centroids``); one
       whose move failed is freed instead (D falls back, 5). Either way the request is then reported
       (NelssaConnector.get_finished: finished sending) and vLLM frees its blocks once NixlConnector
       has reported it too.
  D, scheduler (NelssaScheduler._handover_released, NelssaConnector.on_new_request, build_connector_meta):
    4. A request whose params name a hand-over is held (no blocks) until the node holds P's release
       (the node's Released, asked by the scheduler's NodeRoom thread), so D allocates the prompt's
       blocks for the NIXL read and the adoption only; meanwhile its connectors know it (NIXL renews
       P's lease on the KV). Its handle goes to the worker (``adopt``) in the metadata of the first
       step that schedules it. Not released within ``handover_wait_s``: admitted without the hand-over
       (the handle dropped, ``handover_fallbacks``), clustered here from the KV it receives.
  D, worker (Handoff.submit, ``adopt_handed_over``):
    5. The request's first move, [sink, H0) (its KV arrived whole over NIXL), adopts the node's request
       instead of clustering: retried while the node does not hold it yet (P releases after its last
       move) up to ``handover_wait_s``; the adopted request must hold exactly H0 - sink tokens. It then
       completes as the move would (reported; the scheduler switches the request and frees its blocks
       below H0); the moves after it append to the adopted request. A failed adoption (not released in
       time, a mismatch, a node error) is logged and counted (``handover_fallbacks``), anything adopted is
       freed, and the move runs as usual from D's blocks: nothing is lost, D clusters once more.
  D, window admission (config ``handover_window``, on by default; NelssaScheduler._admit_window,
  NelssaManager, NelssaConnector.update_state_after_alloc, Handoff.adopt):
    6. A hand-over admitted once released (4) whose H0 is D's own for the prompt (the same policy), whose
       KV comes over NIXL and whose blocks are of D's size is admitted with its window only: the manager
       allocates real blocks for [0, sink) and [H0, prompt) and the null block for [sink, H0) (no
       transient full-size allocation;
       admission asks only for the window's blocks), and the same block positions are taken out of
       P's block list in its kv_transfer_params, so NixlConnector (which pairs P's blocks with D's
       non-null ones in order) reads only the window. No prefix-cache reads for it (a hit inside
       [sink, H0) would break that pairing). The adoption starts in the step after the allocation
       (``adopt_now``), while NIXL reads; the request stays unscheduled until both are done (the
       scheduler's promotion of a loaded request waits for its H0 in use), and its first step — the
       prompt's last token — attends [sink, H0) on the host already. With the lane, the scheduler then
       sends that position as a lane seed (``seeds``: position, H0, the prompt's last token, its block
       ids) and promotes the request once the lane has reported it computed: the first step finds a
       lane row, so no step waits for the host tier (NelssaScheduler._seed, runner._nelssa_lane_seed);
       without the lane that step is a split step. A failed adoption (its
       [sink, H0) exists only on the node) or a failed NIXL read fails the request loudly
       (``handover_failures``); a preempted one comes back as a prompt prefilled on D (whole blocks).
"""

from __future__ import annotations

import logging
import secrets
import time

from nelssa.node.local import HostError

log = logging.getLogger("vllm.nelssa")

KEY = "nelssa_handover"   # in kv_transfer_params
RELEASE_TTL_S = 120.0     # how long the node keeps a released request for D (bounded by its lease limits)
RETRY_S = 0.05


def new_handle() -> str:
    return secrets.token_hex(16)


def params(handle: str, host_end: int, block_size: int = 0) -> dict:
    """What P adds to a handed-over request's kv_transfer_params (``block_size``: P's KV block size, which
    D's window admission (6) needs to equal its own: it names P's blocks by position)."""
    return {KEY: {"handle": handle, "host_end": int(host_end), "block_size": int(block_size)}}


def handle_of(kv_transfer_params) -> str:
    """D: the hand-over handle in a request's kv_transfer_params ('' when it has none). A malformed
    entry is an error, not a silent fallback."""
    h = (kv_transfer_params or {}).get(KEY)
    if h is None:
        return ""
    if not isinstance(h, dict) or not isinstance(h.get("handle"), str) or not h["handle"]:
        raise ValueError(f"kv_transfer_params[{KEY!r}] must be {{'handle': str, 'host_end': int}}, got {h!r}")
    return h["handle"]


def release(host, rid: str, handle: str, failed: bool, ended: float | None = None) -> None:
    """P (3), on the hand-off thread after the request's moves: its node entry released under
    ``handle`` (or, after a failed move, freed). ``ended``: time.monotonic() at the request's end, for
    ``handover_lag_s``."""
    if failed or not host.has(rid):
        host.free(rid)
        log.warning("NELSSA hand-over of %s: %s; the decode instance will cluster it itself", rid,
                    "a move of it failed" if failed else "nothing of it on the node")
        host.stats.add(handover_failures=1)
        return
    try:
        host.release(rid, ttl_s=RELEASE_TTL_S, handle=handle)
        host.stats.add(handovers_released=1)
        if ended is not None:
            host.stats.add(handover_lag_s=time.monotonic() - ended)
    except HostError as e:
        host.free(rid)
        host.stats.add(handover_failures=1)
        log.warning("NELSSA hand-over of %s: release failed (%s); the decode instance will cluster it itself", rid, e)


def adopt_handed_over(host, rid: str, handle: str, tokens: int, wait_s: float, device,
                      cancelled=lambda: False, fallback: bool = True) -> bool:
    """D (5, 6): adopt the request P released under ``handle`` as ``rid``, holding exactly ``tokens``
    tokens -> True; False (logged, counted, nothing left adopted) when it cannot be had in ``wait_s``
    or ``cancelled()`` (the request finished meanwhile: its drop waits for this). ``fallback``: D
    clusters the request itself then (5: counted ``handover_fallbacks``); else the caller fails it (6:
    ``handover_failures``)."""
    t0 = time.monotonic()
    why = ""
    then, counter = ("clustering it here", "handover_fallbacks") if fallback else ("the request fails",
                                                                                    "handover_failures")
    if not hasattr(host, "adopt"):
        log.warning("NELSSA hand-over of %s: this instance's host tier is not nelssa-node; %s", rid, then)
        host.stats.add(**{counter: 1})
        return False
    while True:
        try:
            host.adopt(handle, rid, device=device)
            break
        except HostError as e:
            why = str(e)
            # only "not released yet" is worth waiting for (an unknown client, a mismatch: not)
            if "no released request" not in why or time.monotonic() - t0 > wait_s or cancelled():
                break
            time.sleep(RETRY_S)
    if host.has(rid):
        kv = host.layer_kv(rid, 0)
        held = kv.length + sum(p[0] for p in kv.pending)
        if held == tokens:
            host.stats.add(handovers_adopted=1, handover_wait_s=time.monotonic() - t0)
            return True
        why = f"the node's request holds {held} tokens, {tokens} expected (P and D policies differ?)"
        host.free(rid)
    if cancelled():
        log.info("NELSSA hand-over of %s not adopted: the request finished first", rid)
        return False
    log.warning("NELSSA hand-over of %s not adopted (%s); %s", rid, why or "not released in time", then)
    host.stats.add(**{counter: 1})
    return False
