"""Drafts: the long lane computes a request's next position before the step has sampled its token
(config ``lane_spec``; lane.py).

Without drafts a long request's token costs a lane batch plus the step that samples it: the lane's next
job waits for that step (lane.py, 2-4), 6-16 ms in the decode phase and 50-150 ms while a long prompt
prefills beside it (H200 runs 37-46: lane batch ~60 ms, long TPOT 66 and 110 ms). With drafts the lane
proposes the token itself and the step checks it, as speculative decoding does, one token deep:

  1. Draft. After a batch the lane computes the logits of its rows' final hidden states (vLLM's
     lm_head and logits processor, on the lane's stream) and their argmax. A row whose job's input
     token is verified (a job from the step, or a verified draft: 2), whose request samples greedily
     and whose next position's KV slot is allocated (with drafts on the scheduler allocates two slots
     ahead; the step's job carries the block-table row through that slot, ``Job.next_blocks``) queues a
     draft: the job of the next position, that argmax as its input token, the same host range H. A
     draft's result (hidden state and its own argmax) is held here, not reported.
  2. Verify. The step that computes the position before a draft's (the request's lane row, its hidden
     state injected) samples the real token with vLLM's sampler — sampling parameters, logits
     processors and logprobs stay vLLM's: it is the authority — and queues the next position's job as
     always, its token also copied to pinned memory. The lane compares that job with the request's
     draft once the step's sampling is done: the same position, token and H -> the draft IS that job
     (held: its result is reported at once and 1 follows from it; queued: it runs as a verified job).
     Anything else (``mismatch``): the draft is dropped and the job runs as always; the KV slot the
     draft wrote is written again by it before anything reads it (the step attends a lane row's first
     token only, lane.py 4).
  3. One draft per request, from a verified input only: a draft never builds on a draft, so a wrong one
     costs one lane batch and nothing else, and the lane never runs more than one position ahead of the
     tokens vLLM has sampled.
  4. H: the scheduler moves a request's H only at a step that schedules it, and that step's worker
     drops the request's draft before its forward (``stale``: queued or held ones forgotten, a running
     one cancelled and waited for as lane.drop does), before the blocks below the new H can be reused.
  5. A finished or preempted request's draft goes with it (lane.drop -> ``Drafts.drop``).
Only requests whose token is the argmax of the model's own logits draft (``drafts_ok``): greedy, and no
sampling parameter that changes the logits before the argmax (penalties, logit bias, allowed or bad
words, structured output, a minimum length, a thinking budget); for the others a draft would often be
wrong, and each wrong one costs a lane batch.
The lane holds its condition's lock around every call here (lane.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass
class Held:
    """A draft's result, not yet verified (1)."""
    job: Any                 # the draft's lane.Job
    hidden: torch.Tensor     # its final hidden state [H]
    nxt: torch.Tensor        # its argmax on the device [1] int64 (the next draft's input token)
    nxt_value: int


def drafts_ok(sp) -> bool:
    """Whether a request with sampling parameters ``sp`` (vLLM's SamplingParams) drafts: its next token is the
    argmax of the model's logits as they are."""
    from vllm.sampling_params import SamplingType
    return (sp is not None and sp.sampling_type == SamplingType.GREEDY and sp.repetition_penalty == 1.0
            and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0 and not sp.logit_bias
            and not sp.allowed_token_ids and not sp.bad_words and sp.structured_outputs is None
            and not sp.min_tokens and getattr(sp, "thinking_token_budget", None) is None)


class Drafts:
    def __init__(self) -> None:
        self.queued: dict[str, Any] = {}   # request -> its draft Job, queued or running
        self.held: dict[str, Held] = {}    # request -> a finished draft's result
        self.counts: dict[str, float] = {}  # outcome -> drafts since the last take (run, verified, mismatch, stale)

    def _count(self, outcome: str, n: int = 1) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + n

    def take_counts(self) -> dict[str, float]:
        out, self.counts = self.counts, {}
        return out

    def has(self, rid: str) -> bool:
        return rid in self.queued or rid in self.held

    def _of(self, rid: str):
        """The request's draft job, queued, running or held (None: none)."""
        q, h = self.queued.get(rid), self.held.get(rid)
        return q if q is not None else (h.job if h is not None else None)

    def chain(self, job, nxt: torch.Tensor, nxt_value: int, next_blocks) -> Any | None:
        """The draft that follows ``job`` (its input verified; ``nxt`` its argmax) or None (1); registered as
        queued. ``next_blocks``: the block-table row through the draft's position (None: not allocated)."""
        if not job.greedy or next_blocks is None or self.has(job.req_id):
            return None
        d = replace(job, pos=job.pos + 1, token=nxt, blocks=next_blocks, event=None, next_blocks=None,
                    token_host=None, draft=True, verified=False, token_value=nxt_value)
        self.queued[job.req_id] = d
        self._count("run")
        return d

    def hold(self, job, hidden: torch.Tensor, nxt: torch.Tensor, nxt_value: int) -> None:
        """A draft ran and was not verified meanwhile: keep its result for its job (2)."""
        if self.queued.get(job.req_id) is job:
            del self.queued[job.req_id]
            self.held[job.req_id] = Held(job, hidden, nxt, nxt_value)

    def finished(self, job) -> None:
        """A verified draft ran: it is a job like any other from now on."""
        if self.queued.get(job.req_id) is job:
            del self.queued[job.req_id]

    def verify(self, job, token: int) -> tuple[str, Held | None]:
        """The step's job ``job`` (sampled ``token``) against its request's draft (2): ("none", None) no draft,
        ("mismatch", None) a draft dropped, ("queued", None) the queued draft marked verified (the job is
        not run), ("held", result) the held draft's result is the job's."""
        rid = job.req_id
        d = self._of(rid)
        if d is None:
            return "none", None
        if d.pos == job.pos and d.token_value == token and d.host_end == job.host_end:
            self._count("verified")
            d.next_blocks, d.verified = job.next_blocks, True  # the step's row reaches the next slot (1)
            if rid in self.queued:
                return "queued", None
            return "held", self.held.pop(rid)
        self._count("mismatch")
        self.drop((rid,))
        return "mismatch", None

    def stale(self, host_ends: dict[str, int]) -> set[str]:
        """Requests whose draft uses another H than the step's (4): held ones forgotten here; the caller
        removes the queued ones from its queue and waits for a running one."""
        out = {rid for rid, h in host_ends.items() if (d := self._of(rid)) is not None and d.host_end != h}
        self.drop(out)
        if out:
            self._count("stale", len(out))
        return out

    def drop(self, ids) -> None:
        for rid in ids:
            self.queued.pop(rid, None)
            self.held.pop(rid, None)
