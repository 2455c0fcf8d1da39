"""Pinned versions (nelssa/pins.env, the one place they are set)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def pins() -> dict[str, str]:
    out = {}
    for line in (Path(__file__).with_name("pins.env")).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out
