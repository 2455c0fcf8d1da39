"""KV-cache spec + manager: a long request's host-resident blocks go back to vLLM's block pool."""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import FullAttentionSpec

from nelssa.vllm_plugin.policy import Policy


@dataclass(frozen=True, kw_only=True)
class NelssaSpec(FullAttentionSpec):
    """Full attention whose long requests keep only a window on the device (see policy.Policy)."""

    T_input: int
    sink: int
    recent: int
    chunk: int

    def policy(self) -> Policy:
        return Policy(self.T_input, self.sink, self.recent, self.chunk, self.block_size)

    @classmethod
    def merge(cls, specs: list["NelssaSpec"]) -> "NelssaSpec":
        assert all(isinstance(s, NelssaSpec) for s in specs), "all layers of a group must be NelssaSpec"
        knobs = {(s.T_input, s.sink, s.recent, s.chunk) for s in specs}
        assert len(knobs) == 1, f"NELSSA layers disagree on T_input/sink/recent/chunk: {knobs}"
        base = FullAttentionSpec.merge(specs)
        T_input, sink, recent, chunk = knobs.pop()
        return cls(**{f.name: getattr(base, f.name) for f in fields(FullAttentionSpec)},
                   T_input=T_input, sink=sink, recent=recent, chunk=chunk)


class NelssaManager(FullAttentionManager):
    """Frees the device blocks of a long request's host range once its KV is on the host.

    ``host_ends`` (request -> H in use, set by NelssaScheduler from the worker's completed hand-offs)
    says which range that is; ``remove_skipped_blocks``, called by ``KVCacheManager.allocate_slots``
    for every scheduled request, frees the blocks below H. Freed blocks become null blocks in the
    request's table (as for R-SWA); the worker never reads them (window attention gathers window
    positions only). ``window_ends`` (request -> H0, set by NelssaScheduler on a P/D decode instance
    for a hand-over admitted with its window only, handover.py 6): the request's first allocation puts
    the null block at [sink, H0) from the start, and admission counts only its real blocks.
    ``ahead`` (tokens; set by NelssaScheduler: a block with the lane's drafts, lane_spec.py 2): a request
    with its host range in use gets slots that many tokens past what vLLM asks (its lookahead), at most to
    ``max_len`` (the model's length: the worker's block table is that wide), as vLLM's MambaManager adds its
    speculative blocks. A draft runs only in allocated slots; with two slots ahead, the lane's chain stopped
    at every block boundary until the steps caught up (H200 hol run 84: the first long request's token after
    a boundary came 90 ms after the one before, 50 ms elsewhere).
    """

    def __init__(self, kv_cache_spec: NelssaSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.policy = kv_cache_spec.policy()
        self.host_ends: dict[str, int] = {}
        # request -> H0 of a hand-over admitted with its window only (set by NelssaScheduler on a decode
        # instance, handover.py, 6): its first allocation has null blocks where [sink, H0) is, on the node
        self.window_ends: dict[str, int] = {}
        self.ahead = 0
        self.max_len: int | None = None

    def _slots(self, request_id: str, num_tokens: int) -> int:
        """The slots a request gets: ``num_tokens`` (vLLM's count, its lookahead included), ``ahead`` more for a
        request whose host range is in use."""
        if not self.ahead or not self.host_ends.get(request_id):
            return num_tokens
        want = num_tokens + self.ahead
        return want if self.max_len is None else max(num_tokens, min(want, self.max_len))

    def _nulls(self, request_id: str, upto_blocks: int) -> tuple[int, int]:
        """[first, last) of the null blocks a window admission has among its first ``upto_blocks``."""
        h = self.window_ends.get(request_id, 0)
        if not h:
            return 0, 0
        first, last = self.policy.freed_blocks(h)
        return first, max(first, min(last, upto_blocks))

    # (these run for every scheduled request in every step: with no host range or window admission anywhere
    # they are vLLM's own calls, no lookups, so a step with only short requests costs what stock's does)
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args, **kwargs) -> int:
        if not self.host_ends and not self.window_ends:
            return super().get_num_blocks_to_allocate(request_id, num_tokens, *args, **kwargs)
        n = super().get_num_blocks_to_allocate(request_id, self._slots(request_id, num_tokens), *args, **kwargs)
        if request_id in self.num_cached_block:  # allocated already: its nulls are among its blocks
            return n
        first, last = self._nulls(request_id, -(-num_tokens // self.block_size))
        return max(0, n - (last - first))

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        return super().allocate_new_blocks(request_id, self._slots(request_id, num_tokens), num_tokens_main_model)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int) -> None:
        """A window admission's blocks for the KV it receives: real blocks for the sink's and the window's
        positions, the null block for [sink, H0) (no transient full-size allocation)."""
        total = num_local_computed_tokens + num_external_computed_tokens
        want = -(-total // self.block_size)
        first, last = self._nulls(request_id, want)
        if first == last or num_external_computed_tokens <= 0:
            return super().allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                              num_external_computed_tokens)
        blocks = self.req_to_blocks[request_id]
        pos = range(len(blocks), want)
        new = self.block_pool.get_new_blocks(sum(1 for i in pos if not first <= i < last))
        fresh = iter(new)
        blocks.extend(self._null_block if first <= i < last else next(fresh) for i in pos)
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new)

    def recall_blocks(self, request_id: str, h: int) -> list[int]:
        """A recall by load (recall.py, 1): new blocks where the null blocks of the request's host range
        [sink, h) are -> its whole block row (ids). The caller has checked the room. Nothing is freed below
        h again while the request is not scheduled (this manager frees on allocation); its host range is
        dropped (``host_ends``) once the worker has loaded the blocks."""
        blocks = self.req_to_blocks[request_id]
        first, last = self.policy.freed_blocks(h)
        nulls = [i for i in range(first, min(last, len(blocks))) if blocks[i] is self._null_block]
        for i, b in zip(nulls, self.block_pool.get_new_blocks(len(nulls))):
            blocks[i] = b
        return [b.block_id for b in blocks]

    def holds_host_range(self, request_id: str) -> bool:
        """Whether the request still holds device blocks of its host range: before its H is in use, and after
        it until its next allocation frees them (``remove_skipped_blocks``: a lane request is scheduled
        again only once the lane has computed its next position; a seeded switch calls it at once,
        scheduler._seed_switch)."""
        h = self.host_ends.get(request_id, 0)
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return False
        if not h:
            return True
        first, last = self.policy.freed_blocks(h)
        return first < min(last, len(blocks)) and blocks[first] is not self._null_block

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        h = self.host_ends.get(request_id, 0)
        if num_prompt_tokens is None or not h:
            return super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        first, last = self.policy.freed_blocks(h)
        if first < last:
            self._remove_blocks_in_range(request_id, first, last)


def register_spec() -> None:
    """Register NelssaSpec -> NelssaManager (after vLLM's built-ins, which register only into an empty
    registry)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(NelssaSpec, NelssaManager, uniform_type_base_spec=FullAttentionSpec)
