"""Recall by load: a migrated request returns to the device with its KV read back from the host tier.

A request that grew past T_input and migrated under pressure (scheduler.py, ``_migrate``) decodes from the
host tier at the host's pace. Once the device has room for it and for every running request to its end,
and nothing waits for room (the room rule: NelssaScheduler._recall), it comes back. Nothing is recomputed
and vLLM does not preempt it, with either host tier:

  1. Scheduler (NelssaScheduler._recall): the request (running, not in the lane, no step output in flight)
     is held out of the steps (``loading``: left out of the list vLLM schedules, like a busy lane request,
     still counted against max_num_seqs). The KV-cache manager puts new blocks where its host range's
     null blocks are (NelssaManager.recall_blocks); the request keeps its host range H, so nothing else
     of it changes while it loads. The metadata's ``recalls`` carries (H, its whole new block row) to the
     worker, once.
  2. Worker (Recalls.start, before the step's forward): the lane lets go of the request (lane.release: a
     running draft is cancelled, not waited for); its block row in the runner's request state becomes the
     new one (vLLM re-adds a request it did not schedule to its batch from that state); the hand-off's
     thread loads tokens [first block, last block) of the host range — every layer, read back in token
     order (the in-process tier's ClusteredKV.unpack; nelssa-node sends each part back as stored and its
     client puts the rows in token order by the order it kept: node/client.py read_back) and written into
     the new blocks (attention.write_kv) — after the request's
     moves and, on CUDA, on the hand-off's side stream after the main stream's work so far (a step in
     flight may still write the blocks for their former request).
  3. Worker (Recalls.poll, each step): once the load is done and the lane has released the request, its
     hand-off state and host KV are freed and it is reported ``recalled`` through the connector.
  4. Scheduler, on the report (NelssaScheduler._recalled): the request is a device request again — its
     host range, anchor and host reservation gone (the manager no longer frees below H) — and is scheduled
     from the next step: a plain decode row whose attention reads its blocks. Counted ``recalls`` and
     ``recall_seconds`` (start to report).
A failed load (the host tier failing) fails the request loudly (runtime.fail): its host range is no longer
served by the lane, and the blocks may hold a partial load. A request that finishes or is aborted while it
loads is dropped as any other: the hand-off's ``drop`` waits for its load before the blocks can go.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from nelssa.vllm_plugin import runtime

log = logging.getLogger("vllm.nelssa")


class Recalls:
    """Worker side: the recalls in progress (2, 3)."""

    def __init__(self, handoff, host, lane, policy):
        self.handoff, self.host, self.lane, self.policy = handoff, host, lane, policy
        self._loads: dict[str, Future] = {}   # request -> its load
        self._let_go: set[str] = set()        # ... the lane has released (or there is no lane)

    def __contains__(self, rid: str) -> bool:
        return rid in self._loads

    def start(self, recalls: dict[str, tuple[int, list[int]]], requests: dict) -> None:
        """This step's recalls (request -> (H, its new block row)), before the step's forward (2)."""
        for rid, (h, row) in recalls.items():
            st = requests.get(rid)
            if st is None or rid in self._loads:
                continue
            first, last = self.policy.freed_blocks(h)
            bs = self.policy.block_size
            st.block_ids[0][:] = row  # vLLM re-adds it to its batch from this (it is not scheduled meanwhile)
            if self.lane is not None:
                self.lane.release({rid})
            else:
                self._let_go.add(rid)
            self._loads[rid] = self.handoff.load(rid, row, first * bs, last * bs)

    def released(self, ids: set[str]) -> set[str]:
        """Of the lane's released requests, those recalled (not finished): kept here, the rest returned."""
        mine = ids & self._loads.keys()
        self._let_go |= mine
        return ids - mine

    def forget(self, ids) -> None:
        """Finished or preempted requests: their load is the hand-off's (its drop waits for it)."""
        for rid in ids:
            self._loads.pop(rid, None)
            self._let_go.discard(rid)

    def poll(self) -> None:
        """Loads done and let go by the lane (3): hand-off state and host KV freed, reported recalled; a
        failed one fails its request."""
        for rid, fut in list(self._loads.items()):
            if not fut.done() or rid not in self._let_go:
                continue
            del self._loads[rid]
            self._let_go.discard(rid)
            err = fut.exception()
            if err is not None:
                log.error("NELSSA: recalling %s to the device failed (%s: %s)", rid, type(err).__name__, err)
                runtime.fail(rid, f"its recall to the device (read back from the host tier) failed: "
                                  f"{type(err).__name__}: {err}")
                continue
            self.handoff.drop(rid, recalled=True)  # its moves ran before the load: nothing to wait for
            self.host.free(rid)
            runtime.recalled(rid)
