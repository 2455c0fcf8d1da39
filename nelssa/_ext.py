"""Loads the C++ extension ``nelssa._C``; None (with one warning) when it is missing or disabled."""

from __future__ import annotations

import warnings
from types import ModuleType

from nelssa.config import get_config, usable_cores

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


AUTO_SPIN_US = 1000  # pool_spin_us -1 where the pool has cores to spin on (H100 host, hol run 63: 19.4 -> 16.9 ms of
                     # host calls per lane batch, bench_host_call 942 -> 722 us a call)


def spin_us(cfg) -> int:
    """The host team's spin between calls as set (``pool_spin_us``). A spinning worker holds its core, so
    spinning pays only where the pool has cores of its own: fewer pool threads than this process may run
    on, or a pool the operator pinned (``affinity_cores``). With as many pool threads as cores the workers
    would take the cores of the threads that feed them (a 2-vCPU box: 8 threads spinning took 3.5 ms a call
    against 0.6 ms sleeping): an explicit spin is then ignored with a warning. -1 (by the machine):
    ``AUTO_SPIN_US`` in a process with CUDA (an engine on a GPU, whose CPU work is a few threads) whose
    pool has cores of its own, else 0 (a CPU engine's forward runs on every core between the calls)."""
    spin = cfg.pool_spin_us
    if spin == 0 or cfg.pool_threads <= 1:  # a team of one has no workers to spin
        return 0
    if cfg.affinity_cores:
        own = True
    else:
        cores = len(usable_cores())
        own = cfg.pool_threads < cores
    if spin < 0:
        return AUTO_SPIN_US if own and _cuda() else 0
    if own:
        return spin
    warnings.warn(f"pool_spin_us={spin} ignored: {cfg.pool_threads} pool threads on {cores} cores "
                  "leave none for the threads that feed them; the team sleeps between calls (give it fewer "
                  "threads than cores, or pin it with affinity_cores)", RuntimeWarning, stacklevel=3)
    return 0


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()
