"""Drafts: the long lane runs ahead of the steps for requests that sample greedily (config ``lane_spec``;
lane.py).

Without drafts a long request's token costs a lane batch plus the step that samples it: the lane's next
job waits for that step (lane.py, 2-4). With vLLM's async scheduling the step that samples a position's
token is scheduled before the lane has computed that position, so the request is scheduled again only
two steps after the lane's report: one token per two steps, ~87 ms per token while a long prompt
prefills beside it (H200 run 51: steps of ~40 ms). With drafts the lane computes the next positions
itself and publishes them at once, so a step finds the request's next position ready and every step
can sample one of its tokens:

  1. Logits. A lane batch ends with the logits of its rows (vLLM's lm_head and logits processor on the
     lane's stream, ``Lane._logits``); they are the lane's result, and the step that schedules the
     position samples from exactly these logits (NelssaLlamaForCausalLM.compute_logits writes them into
     the step's logits), with vLLM's sampler, sampling parameters and logprobs.
  2. Draft. A row whose request drafts (``drafts_ok``: greedy, nothing that changes the logits before
     the argmax) queues the job of its next position at once, the argmax of its logits as input token
     and the same host range H: that argmax is the token the step's greedy sampler will pick from the
     same logits, so the draft's result is published like any job's (lane.py, 3) and the chain goes
     on, a position at a time. Its KV slot must be allocated: a draft uses the newest block row the
     steps gave for its request (``Job.alloc``; the scheduler allocates two slots and, for a request in
     the lane, a block ahead: spec.NelssaManager.ahead); past it the chain waits (``stalled``, counted)
     for the next step's job to bring a longer row. The chain ends where the
     request does (``last``): at its last position (max_tokens, the model's length) or when the argmax is
     one of its stop tokens, so no draft is left running when its request finishes.
  3. Check. The step's job for a drafted position (its sampled token) does not run: it is checked
     against the draft's token once that step's sampling is done, without the lane waiting for it. By
     1-2 they are equal; a difference means the step sampled something else than the argmax of the
     lane's logits (a bug, or a logits processor that ``drafts_ok`` does not know), after the step may
     already have used the draft's result, so the request fails loudly (``mismatch``).
  4. H: the scheduler moves a request's H only at a step that schedules it, and that step's worker
     drops the request's drafts with another H before its forward (``stale``): queued ones forgotten, a
     running one cancelled and waited for, published results past the step's position discarded.
     The step's job then runs as without drafts.
  5. A finished or preempted request's drafts go with it (lane.release / lane.drop -> ``Drafts.drop``).
Only requests whose token is the argmax of the model's logits draft (``drafts_ok``: greedy, and no
sampling parameter that changes the logits before the argmax: penalties, logit bias, allowed or bad
words, structured output, a minimum length, a thinking budget); the runner also turns drafts off for an
engine with logits processors of its own that can change the argmax (``argmax_kept``).
The lane holds its condition's lock around every call here (lane.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch


def drafts_ok(sp) -> bool:
    """Whether a request with sampling parameters ``sp`` (vLLM's SamplingParams) drafts: its next token is the
    argmax of the model's logits as they are."""
    from vllm.sampling_params import SamplingType
    return (sp is not None and sp.sampling_type == SamplingType.GREEDY and sp.repetition_penalty == 1.0
            and sp.presence_penalty == 0.0 and sp.frequency_penalty == 0.0 and not sp.logit_bias
            and not sp.allowed_token_ids and not sp.bad_words and sp.structured_outputs is None
            and not sp.min_tokens and getattr(sp, "thinking_token_budget", None) is None)


def argmax_kept(logitsprocs) -> bool:
    """Whether an engine's batch-level logits processors (vLLM's LogitsProcessors of the input batch) leave the
    argmax of a ``drafts_ok`` request's logits alone: only vLLM's built-in ones that can move it, which such
    a request does not use (logit bias, min tokens)."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor
    return all(isinstance(p, (LogitBiasLogitsProcessor, MinTokensLogitsProcessor))
               for p in getattr(logitsprocs, "non_argmax_invariant", ()))


class Drafts:
    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.queued: dict[str, Any] = {}    # request -> its draft Job, queued or running (one at a time)
        self.marks: dict[str, dict[int, tuple[int, int]]] = {}  # request -> {drafted position: (token, H)}
        self.rows: dict[str, Any] = {}      # request -> the newest block row a step gave (Job.alloc)
        self.stalled: dict[str, tuple] = {}  # request -> (job, argmax, its value): its next slot not allocated
        self.counts: dict[str, float] = {}  # outcome -> drafts since the last take (run, verified, mismatch, stale)

    def _count(self, outcome: str, n: int = 1) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + n

    def take_counts(self) -> dict[str, float]:
        out, self.counts = self.counts, {}
        return out

    def has(self, rid: str) -> bool:
        return rid in self.queued or bool(self.marks.get(rid)) or rid in self.stalled

    def chain(self, job, nxt: torch.Tensor, nxt_value: int) -> Any | None:
        """The draft that follows ``job`` (its result published; ``nxt`` its argmax) or None (2); registered as
        queued. Without an allocated slot for it the chain waits (``stalled``) until ``accept`` gets a longer
        block row."""
        rid = job.req_id
        if not job.greedy or rid in self.queued or self.last(job, nxt_value):
            return None
        pos, row = job.pos + 1, self.rows.get(rid, job.alloc)
        if row is None or pos // self.bs >= len(row):
            if rid not in self.stalled:
                self._count("stalled")
            self.stalled[rid] = (job, nxt, nxt_value)
            return None
        self.stalled.pop(rid, None)
        d = replace(job, pos=pos, token=nxt, blocks=row[:pos // self.bs + 1].copy(), event=None, alloc=None,
                    token_host=None, draft=True, token_value=nxt_value)
        self.marks.setdefault(rid, {})[pos] = (nxt_value, job.host_end)
        self.queued[rid] = d
        self._count("run")
        return d

    @staticmethod
    def last(job, nxt_value: int) -> bool:
        """Whether ``job``'s position is the last its request needs (2): its last position, or its argmax (the
        next token) one that stops it."""
        return (0 <= job.last <= job.pos) or nxt_value in job.stops

    def finished(self, job) -> None:
        """A draft ran (its result is published by the caller)."""
        if self.queued.get(job.req_id) is job:
            del self.queued[job.req_id]

    def accept(self, job) -> tuple[bool, Any | None]:
        """A step's job (3) -> (whether it is checked instead of run, a stalled draft that can run now). Its
        block row becomes the request's newest."""
        rid = job.req_id
        if job.alloc is not None:
            self.rows[rid] = job.alloc
        m = self.marks.get(rid, {}).get(job.pos)
        if m is not None and m[1] != job.host_end:  # another H: stale should have dropped it (4)
            self.drop((rid,))
            self._count("stale")
            m = None
        st = self.stalled.get(rid)
        if st is not None and st[0].pos + 1 <= job.pos and m is None:
            del self.stalled[rid]  # the step's job is the position the chain waited to draft: it runs
            st = None
        d = self.chain(*st) if st is not None else None
        return m is not None, d

    def check(self, job, token: int) -> bool:
        """The step's sampled ``token`` for a drafted position (3): True when equal (or the draft was dropped
        meanwhile), False on a mismatch."""
        m = self.marks.get(job.req_id, {}).pop(job.pos, None)
        if m is None:
            return True
        ok = m[0] == token
        self._count("verified" if ok else "mismatch")
        return ok

    def stale(self, host_ends: dict[str, int]) -> set[str]:
        """Requests with drafts that use another H than the step's (4), dropped here; the caller removes their
        queued draft from its queue, waits for a running one and discards their results past the step's."""
        out = set()
        for rid, h in host_ends.items():
            q, st = self.queued.get(rid), self.stalled.get(rid)
            if ((q is not None and q.host_end != h) or (st is not None and st[0].host_end != h)
                    or any(m[1] != h for m in self.marks.get(rid, {}).values())):
                out.add(rid)
        self.drop(out, rows=False)
        if out:
            self._count("stale", len(out))
        return out

    def drop(self, ids, rows: bool = True) -> None:
        for rid in ids:
            self.queued.pop(rid, None)
            self.marks.pop(rid, None)
            self.stalled.pop(rid, None)
            if rows:
                self.rows.pop(rid, None)
