"""Real English text for prompts and haystacks: CPython's own documentation (pydoc_data), always present."""

from __future__ import annotations

import re
from functools import lru_cache


@lru_cache(maxsize=1)
def real_text() -> str:
    """~465K characters of the Python reference manual, in a fixed order."""
    import pydoc_data.topics as t
    text = "\n\n".join(t.topics[k] for k in sorted(t.topics))
    return re.sub(r"\n{3,}", "\n\n", text)


def sentences() -> list[str]:
    """The corpus split into sentences (for needle insertion at sentence boundaries)."""
    flat = re.sub(r"\s+", " ", real_text())
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", flat) if s.strip()]


def text_of_tokens(tokenizer, n_tokens: int, offset_chars: int = 0) -> str:
    """A slice of the corpus about n_tokens long under tokenizer (exactly n when re-encoded is not guaranteed)."""
    text = real_text()
    start = offset_chars % max(1, len(text) - 1)
    chunk = text[start:start + n_tokens * 8]
    ids = tokenizer.encode(chunk, add_special_tokens=False)[:n_tokens]
    if len(ids) < n_tokens:
        raise ValueError(f"corpus too short for {n_tokens} tokens at offset {offset_chars}")
    return tokenizer.decode(ids)
