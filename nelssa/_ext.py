"""Loads the C++ extension ``nelssa._C``; None (with one warning) when it is missing or disabled."""

from __future__ import annotations

import os
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
        _mod.set_pool(cfg.pool_threads, list(cfg.affinity_cores), spin_us(cfg))
        _pool = (cfg.pool_threads, cfg.affinity_cores, cfg.pool_spin_us)
    return _mod


def spin_us(cfg) -> int:
    """The host team's spin between calls as set: ``pool_spin_us`` where its workers have cores to spin
    on, else 0 with a warning. A spinning worker holds its core, so spinning pays only where the pool
    has cores of its own; with as many pool threads as this process may run on (a 2-vCPU box: 8 threads
    on 2 cores took 3.5 ms a call spinning against 0.6 ms sleeping) the workers would take the cores of
    the threads that feed them. Pinned pools (``affinity_cores``) are the operator's layout and kept."""
    if cfg.pool_spin_us <= 0 or cfg.affinity_cores:
        return cfg.pool_spin_us
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cfg.pool_threads < cores:
        return cfg.pool_spin_us
    warnings.warn(f"pool_spin_us={cfg.pool_spin_us} ignored: {cfg.pool_threads} pool threads on {cores} cores "
                  "leave none for the threads that feed them; the team sleeps between calls (give it fewer "
                  "threads than cores, or pin it with affinity_cores)", RuntimeWarning, stacklevel=3)
    return 0
