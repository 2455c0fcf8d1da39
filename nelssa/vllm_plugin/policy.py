"""Which tokens of a request belong on the host tier: pure functions of (prompt length, tokens with KV)
that the worker (which hands KV off) and the scheduler (which switches a request to it and frees its
device blocks) both use.

A request is long when its prompt has >= T_input tokens. Once its prompt is processed (n >= P tokens
have KV), the *goal* is that the host holds [sink, G) and the device the window [0, sink) + [G, n):
    G(n) = H0 + chunk * floor(max(0, n - recent - H0) / chunk),   H0 = floor((P - recent) / bs) * bs
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

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    T_input: int
    sink: int
    recent: int
    chunk: int
    block_size: int

    def __post_init__(self) -> None:
        if self.chunk % self.block_size:
            raise ValueError(f"nelssa chunk ({self.chunk}) must be a multiple of the KV block size "
                             f"({self.block_size})")
        if self.T_input < self.sink + self.recent + 2 * self.block_size:
            raise ValueError(f"nelssa T_input ({self.T_input}) must be >= sink + recent + 2 * block_size "
                             f"({self.sink} + {self.recent} + 2 * {self.block_size})")

    def is_long(self, prompt_len: int) -> bool:
        return prompt_len >= self.T_input

    def goal(self, prompt_len: int, n: int) -> int:
        """G: end of the range that should be on the host once n tokens have KV (0: nothing)."""
        if prompt_len < self.T_input or n < prompt_len:
            return 0
        h0 = (prompt_len - self.recent) // self.block_size * self.block_size
        return h0 + self.chunk * (max(0, n - self.recent - h0) // self.chunk)

    def in_use(self, prompt_len: int, done: int) -> int:
        """H to use given the end of the completed hand-offs: 0 until the whole prompt's range (G at
        the prompt's end) is on the host; hand-offs end at the sink, a segment boundary or a G."""
        return done if self.is_long(prompt_len) and done >= self.goal(prompt_len, prompt_len) else 0

    def freed_blocks(self, h: int) -> tuple[int, int]:
        """Device block range [first, last) that is on the host when [sink, h) is (empty if first >= last)."""
        return -(-self.sink // self.block_size), h // self.block_size


def host_bytes(tokens: int, num_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Upper bound of host-tier bytes for `tokens` tokens: K/V rows, the token permutation (8 B) and
    the cluster table (<= 1 B per token per head at >= 16 tokens per cluster, plus per-part slack)."""
    per_token_head = 2 * head_dim * dtype_bytes + 8 + 2
    return num_layers * (kv_heads * tokens * per_token_head + 64 * 1024)
