"""Which tokens of a request belong on the host tier: pure functions of (anchor, tokens with KV) that
the worker (which hands KV off) and the scheduler (which switches a request to it and frees its
device blocks) both use.

A request is host-backed from its *anchor* A on: a long request's prompt length (its prompt has
>= T_input tokens), or, for a request that grew past T_input and migrates (scheduler.py), the tokens
with KV when the scheduler decided to migrate it (>= T_input). The scheduler sends migrated requests'
anchors to the worker in the NELSSA connector's metadata; prompts' anchors each side derives itself.
A *deferred* long prompt (T_input <= length < ``defer_below``, config ``defer_below``) is not
host-backed by its length: it stays on the device like a short request until the scheduler migrates
it under device-KV pressure (scheduler.py), with anchor = its prompt length while it prefills (its
hand-off follows the prefill segment by segment, as an undeferred one's) or its tokens with KV once
it decodes; both sides read that anchor from the metadata, as a grown request's.
Once n >= A tokens have KV, the *goal* is that the host holds [sink, G) and the device the window
[0, sink) + [G, n):
    G(n) = H0 + chunk * floor(max(0, n - recent - H0) / chunk),   H0 = floor((A - recent) / bs) * bs
G is block aligned (chunk is a multiple of bs), so whole blocks [ceil(sink / bs), G / bs) can be
freed, every token is in exactly one of host / window, and generated tokens move to the host a chunk
at a time while at least ``recent`` of them stay on the device.

Moving a range to the host takes time (clustering, copying), so it runs in the background
(handoff.Handoff) while the request keeps decoding from its device blocks. The range in use, H, is
the end of the hand-offs the worker has reported complete (``in_use``) — the scheduler sets it per
step and sends it to the worker in the NELSSA connector's metadata; it frees the blocks below H. So
no step ever waits for a hand-off, and the two sides cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    T_input: int
    sink: int
    recent: int
    chunk: int
    block_size: int
    defer_below: int = 0  # long prompts shorter than this are host-backed only once migrated (0: none)

    def __post_init__(self) -> None:
        if self.chunk % self.block_size:
            raise ValueError(f"nelssa chunk ({self.chunk}) must be a multiple of the KV block size "
                             f"({self.block_size})")
        if self.T_input < self.sink + self.recent + 2 * self.block_size:
            raise ValueError(f"nelssa T_input ({self.T_input}) must be >= sink + recent + 2 * block_size "
                             f"({self.sink} + {self.recent} + 2 * {self.block_size})")

    def is_long(self, prompt_len: int, device_only: bool = False) -> bool:
        return not device_only and prompt_len >= self.T_input

    def deferred(self, prompt_len: int) -> bool:
        """A long prompt that stays on the device until it migrates (``defer_below``)."""
        return self.is_long(prompt_len) and prompt_len < self.defer_below

    def anchor(self, prompt_len: int, migrated: int = 0, device_only: bool = False) -> int:
        """A: ``migrated`` (the anchor the scheduler gave a migrating request) or an undeferred long
        prompt's length; 0: the request stays on the device (always for a ``device_only`` request)."""
        if device_only:
            return 0
        return migrated or (prompt_len if self.is_long(prompt_len) and not self.deferred(prompt_len) else 0)

    def goal(self, anchor: int, n: int) -> int:
        """G: end of the range that should be on the host once n tokens have KV (0: nothing)."""
        if anchor < self.T_input or n < anchor:
            return 0
        h0 = (anchor - self.recent) // self.block_size * self.block_size
        return h0 + self.chunk * (max(0, n - self.recent - h0) // self.chunk)

    def in_use(self, anchor: int, done: int) -> int:
        """H to use given the end of the completed hand-offs: 0 until the whole range up to the anchor
        (G at n = A) is on the host; hand-offs end at the sink, a segment boundary or a G."""
        return done if anchor >= self.T_input and done >= self.goal(anchor, anchor) else 0

    def spared(self, computed: int, prompt_len: int) -> bool:
        """Whether a running request is preempted only after every other one (the scheduler's victim
        order): it decodes with at least T_input tokens of context. Preempting it would recompute all of
        them as one long prefill (on a P/D decode instance a local prefill of what P already computed)
        and free far more blocks than a step's growth needs; a short request costs its few blocks.
        Long prompts still prefilling are not spared: admission keeps room for them instead."""
        return computed >= prompt_len and computed >= self.T_input

    def freed_blocks(self, h: int) -> tuple[int, int]:
        """Device block range [first, last) that is on the host when [sink, h) is (empty if first >= last)."""
        return -(-self.sink // self.block_size), h // self.block_size


OPT_OUT_KEY = "nelssa_offload"
_FALSE, _TRUE = ("0", "false", "off", "no"), ("1", "true", "on", "yes")


def device_only(sampling_params) -> bool:
    """Whether a request opted out of the host tier: ``SamplingParams(extra_args={"nelssa_offload":
    False})`` (OpenAI API: ``"vllm_xargs": {"nelssa_offload": 0}``). Such a request keeps all its KV
    on the device and exact attention at any length, and never migrates. ValueError on a value that
    is neither a boolean, 0/1 nor one of off/false/no/on/true/yes."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    if OPT_OUT_KEY not in extra:
        return False
    v = extra[OPT_OUT_KEY]
    if isinstance(v, (bool, int)) and v in (0, 1):
        return not v
    if isinstance(v, str) and v.strip().lower() in _FALSE + _TRUE:
        return v.strip().lower() in _FALSE
    raise ValueError(f"{OPT_OUT_KEY} must be a boolean, 0/1 or one of {_FALSE + _TRUE}, not {v!r}")


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def blocks_within(contexts: list[int], steps: int, block_size: int) -> int:
    """Device blocks that requests decoding one token a step, at these contexts, take within ``steps``
    steps (the scheduler's migration trigger ``migrate_lead_steps``: vLLM preempts once they exceed the
    free blocks)."""
    return sum(_blocks(n + steps, block_size) - _blocks(n, block_size) for n in contexts)


def blocks_to_finish(requests: list[tuple[int, int]], block_size: int) -> int:
    """Device blocks that requests at (context, end) — end: prompt + max_tokens, at most the model's
    length — still allocate until they end (the scheduler's recall: a migrated request returns to the
    device only when this, its own end included, fits in the free blocks)."""
    return sum(max(0, _blocks(end, block_size) - _blocks(n, block_size)) for n, end in requests)


def ends_within_handoff(to_go: int, handoff_s: float | None, step_s: float | None) -> bool:
    """A grown request with ``to_go`` tokens left ends before a hand-off started now would complete: its
    own end frees its blocks sooner than a migration, whose blocks are freed only once the hand-off is done
    (the scheduler's migration rule skips it). ``handoff_s``: a hand-off's measured time, start to switch;
    ``step_s``: the engine's step interval; either unknown (no migration measured yet): False. (H100 growth
    run 76: a request with 15 of 5,000 tokens to go started a ~0.3-s hand-off, ~20 steps, and ended in it.)"""
    if not handoff_s or not step_s:
        return False
    return to_go <= math.ceil(handoff_s / step_s)


def prefill_chunk(budget: int, done: int, l_eq: float, block_size: int) -> int:
    """Tokens of a long prompt to prefill in one step at ``done`` tokens of context so the step costs
    about what ``budget`` tokens cost at context 0: a chunk's work is ~ c * (1 + done / l_eq), where
    l_eq is the context at which a token's attention costs as much as its projections and MLP
    (``attention_balance``). At least one block."""
    c = int(budget / (1.0 + done / l_eq))
    return max(block_size, c // block_size * block_size)


def chunk_budget(long_chunk: int, long_chunk_solo: int, long_decoding: bool) -> int:
    """The ``budget`` of prefill_chunk for this step: ``long_chunk_solo`` while no long request decodes from
    the host tier (its tokens would wait for the longer steps: the lane's batches share the device with
    them), else ``long_chunk``; 0: vLLM's own threshold."""
    return long_chunk_solo if long_chunk_solo and not long_decoding else long_chunk


def prefill_move_end(n: int, goal: int, sink: int, segment: int, tail: int) -> int:
    """Where a long prompt's hand-off should reach while it prefills, once ``n`` tokens have KV (the runner's
    moves, handoff.py): whole ``segment``s from the sink, and within the last segment before ``goal`` (its host
    range at the prefill's end) pieces of ``tail`` tokens (0: whole segments only). What is left to move
    when the prefill ends is what its switch waits for (scheduler._switch_waits): a piece, not the last
    whole segment still in its move (H200 hol run 84: 0.33 s a request; a segment's move 0.51 s). Never past
    ``goal`` (the rest up to it is moved once the prefill is done: Policy.goal); ``tail`` divides ``segment``
    (config), so the pieces start on segment boundaries."""
    unit = tail if tail and goal - n < segment else segment
    return min(goal, sink + max(0, n - sink) // unit * unit)


def prefill_steps(done: int, total: int, budget: int, l_eq: float, block_size: int) -> int:
    """At most how many steps a long prompt at ``done`` of ``total`` tokens still prefills at
    ``prefill_chunk(budget, ...)`` tokens a step (the scheduler's reserve for what the requests decoding
    beside it grow to meanwhile). Unrounded chunks take the integral of (1 + d / l_eq) / budget over the
    context still to go; rounding a chunk down to whole blocks loses less than a block, at most
    ``block_size / c_last`` of the last (smallest) unrounded chunk, so that integral divided by
    (1 - block_size / c_last) bounds the steps; chunks of one block (c_last <= 2 blocks): a step a block."""
    left = total - done
    if left <= 0:
        return 0
    c_last = budget / (1.0 + total / l_eq)
    if c_last <= 2 * block_size:
        return -(-left // block_size)
    ideal = (left + (total * total - done * done) / (2.0 * l_eq)) / budget
    return min(math.ceil(ideal / (1.0 - block_size / c_last)), -(-left // block_size))


def switch_steps(hold_s: float, step_s: float | None) -> int:
    """Steps a long prompt done prefilling may keep its whole prompt's device blocks before its switch frees
    them: its hold's bound ``hold_s`` (the lane's switch_hold_s, or a hand-off's measured time) at the engine's
    step interval ``step_s`` (None, not yet measured: 0). The scheduler reserves what the requests decoding on
    the device grow to in these steps after a long prefill's: the reserve that ended with the prefill let
    vLLM fill the pool to its last blocks and preempt short requests in the hold (H200 hol run 99: 31
    preemptions, 22 requests 0.3-0.9 s without a token, right after the first prompt's last chunk)."""
    if not hold_s or not step_s or hold_s <= 0 or step_s <= 0:
        return 0
    return math.ceil(hold_s / step_s)


CONTEXTS = ("<4K", "4K-8K", "8K-16K", "16K-32K", "32K-64K", "64K-128K", ">=128K")  # context_bucket's, in order


def context_bucket(tokens: int) -> str:
    """A context length's power-of-two bucket for the hand-off-time-vs-context metrics (the scheduler's
    nelssa:migrations_by_context, read back by the workload report): one of ``CONTEXTS``."""
    if tokens < 4096:
        return "<4K"
    k = 4
    while k < 128 and tokens >= 2 * k * 1024:
        k *= 2
    return f"{k}K-{2 * k}K" if k < 128 else ">=128K"


def step_plan(kinds: list[str], new_tokens: list[int], cap: int) -> tuple[list[int], int]:
    """The order in which vLLM is to schedule running requests, and its token budget, for a step that
    may add at most ``cap`` tokens of short prompts to its decodes and long-prompt chunks (the
    scheduler, while a long request is resident and short requests decode). ``kinds[i]``: "spared"
    (policy.Policy.spared: first, as always), "decode", "long" (a long prompt still prefilling: its
    chunk is already sized by ``prefill_chunk``) or "prompt" (any other prefill); ``new_tokens[i]``: the
    tokens vLLM would schedule for it (its chunk, or 1 + drafts when decoding). Returns the indices in
    order (spared, decodes, long prompts, prompts; each in its own order) and the budget: every spared
    request's, decode's and long chunk's tokens plus ``cap``. vLLM schedules running requests in list
    order until the budget is spent, then waiting ones: so every decode gets its token, every long
    prompt its chunk as before, and the short prompts of a step stay within ``cap`` (waiting ones
    included)."""
    rank = {"spared": 0, "decode": 1, "long": 2, "prompt": 3}
    for k in kinds:
        if k not in rank:
            raise ValueError(f"step_plan: unknown kind {k!r}")
    order = sorted(range(len(kinds)), key=lambda i: (rank[kinds[i]], i))
    first = sum(n for k, n in zip(kinds, new_tokens) if rank[k] < 3)
    return order, first + max(0, cap)


def attention_balance(hf_config) -> float:
    """l_eq of a Llama-shaped model: per-token multiply-adds of its linear layers divided by its
    attention's per-context-token multiply-adds (QK and PV over all query heads and layers)."""
    h, nl = hf_config.hidden_size, hf_config.num_hidden_layers
    hq = hf_config.num_attention_heads
    d = getattr(hf_config, "head_dim", None) or h // hq
    hkv = getattr(hf_config, "num_key_value_heads", None) or hq
    linear = nl * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * hf_config.intermediate_size)
    return linear / (nl * 2 * hq * d)


def host_bytes(tokens: int, num_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int,
               keep_cluster_size: int = 0) -> int:
    """Upper bound of host-tier bytes for `tokens` tokens: K/V rows, the token permutation (8 B) and
    the cluster table (<= 1 B per token per head at >= 16 tokens per cluster, plus per-part slack).
    ``keep_cluster_size``: the parts' centroid state is kept too (a hand-over's, nelssa-node
    ``keep_centroids``): centroids and value means of at most tokens / cluster_size clusters, plus one
    per 1024 tokens for the rounding of each segment and part."""
    per_token_head = 2 * head_dim * dtype_bytes + 8 + 2
    kept = 0
    if keep_cluster_size:
        kept = kv_heads * (tokens // keep_cluster_size + tokens // 1024 + 2) * 2 * head_dim * dtype_bytes
    return num_layers * (kv_heads * tokens * per_token_head + 64 * 1024 + kept)
