"""Which tokens of a request live on the host tier: one pure function shared by the scheduler's KV-cache
manager (which frees device blocks) and the worker (which moves KV and splits attention), so both
sides agree without a channel.

A request is long when its prompt has >= T_input tokens. Once its prompt is processed (n >= P tokens
have KV), the host holds [sink, H) and the device keeps the window [0, sink) + [H, n):
    H = H0 + chunk * floor(max(0, n - recent - H0) / chunk),   H0 = floor((P - recent) / bs) * bs
H is block aligned (chunk is a multiple of bs), so whole blocks [ceil(sink / bs), H / bs) are freed,
every token is in exactly one of host / window, and generated tokens move to the host a chunk at a
time while at least ``recent`` of them stay on the device.
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

    def host_end(self, prompt_len: int, n: int) -> int:
        """End H of the host range [sink, H) once n tokens have KV; 0 when nothing is on the host."""
        if prompt_len < self.T_input or n < prompt_len:
            return 0
        h0 = (prompt_len - self.recent) // self.block_size * self.block_size
        return h0 + self.chunk * (max(0, n - self.recent - h0) // self.chunk)

    def freed_blocks(self, prompt_len: int, n: int) -> tuple[int, int]:
        """Device block range [first, last) that is on the host (empty when first >= last)."""
        h = self.host_end(prompt_len, n)
        return -(-self.sink // self.block_size), h // self.block_size

    def device_tokens(self, prompt_len: int, n: int) -> int:
        """Tokens a long request keeps on the device (window) once n tokens have KV."""
        h = self.host_end(prompt_len, n)
        return n if h == 0 else self.sink + (n - h)


def host_bytes(tokens: int, num_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Upper bound of host-tier bytes for `tokens` tokens: K/V rows, the token permutation (8 B) and
    the cluster table (<= 1 B per token per head at >= 16 tokens per cluster, plus per-part slack)."""
    per_token_head = 2 * head_dim * dtype_bytes + 8 + 2
    return num_layers * (kv_heads * tokens * per_token_head + 64 * 1024)
