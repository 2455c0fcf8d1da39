"""Loads the C++ extension ``nelssa._C``; None (with one warning) when it is missing or disabled."""

from __future__ import annotations

import warnings
from types import ModuleType

from nelssa.config import get_config

_mod: ModuleType | None = None
_tried = False
_pool: tuple | None = None


def ext() -> ModuleType | None:
    """The extension if config.use_cpp and it imports, else None (torch paths are used)."""
    global _mod, _tried, _pool
    cfg = get_config()
    if not cfg.use_cpp:
        return None
    if not _tried:
        _tried = True
        try:
            from nelssa import _C  # type: ignore[attr-defined]
            _mod = _C
        except ImportError as e:
            warnings.warn(f"nelssa._C is not available ({e}); using the pure-torch kernels "
                          "(slower). Build it with `pip install -e .`.", RuntimeWarning, stacklevel=2)
    if _mod is not None and _pool != (cfg.pool_threads, cfg.affinity_cores, cfg.pool_spin_us):
        _mod.set_pool(cfg.pool_threads, list(cfg.affinity_cores), cfg.pool_spin_us)
        _pool = (cfg.pool_threads, cfg.affinity_cores, cfg.pool_spin_us)
    return _mod
