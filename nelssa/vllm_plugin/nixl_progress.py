"""NIXL's progress thread, off on request (``NELSSA_NIXL_PROGRESS_THREAD=0``; the launcher's
``NIXL_PROGRESS_THREAD``, off on CPU by default).

vLLM's NixlConnector makes its NIXL agent with ``nixl_agent_config(num_threads=..)`` and the agent's
default ``enable_prog_thread=True``: a UCX progress thread that polls without sleeping, a whole core
per instance even when idle (measured on this project's 2-vCPU box: an idle agent pair 1.99 cores;
a P/D stack on CPU at load average 30-44, P's worker process with two threads at 100%, health checks
timing out and the stack failing its requests). vLLM drives NIXL itself on every step — D polls its
reads (``check_xfer_state``), P its notifications (``get_new_notifs``), and P keeps stepping while it
holds blocks for D (``Scheduler.has_finished_requests``) — which is all a read needs: with the thread
off on both agents a READ completed once the target also polled its notifications (tests/
test_plugin_units.py), and was still in progress after 60 s when only the reader polled. vLLM has no
setting for it, so this wraps the config factory vLLM imports (``vllm.distributed.nixl_utils.
nixl_agent_config``) before its NIXL worker module does; applied in every vLLM process by the plugin's
``register()``, also under NELSSA_OFF (a baseline's transfers are configured the same way)."""

from __future__ import annotations

import os
import sys

ENV = "NELSSA_NIXL_PROGRESS_THREAD"


def apply_from_env() -> bool:
    """Turn NIXL's progress thread off in this process when ``NELSSA_NIXL_PROGRESS_THREAD`` is false ->
    whether it did. A value that is not a boolean is an error."""
    from nelssa.config import _bool
    v = os.environ.get(ENV)
    if v is None or v.strip() == "" or _bool(v):
        return False
    import vllm.distributed.nixl_utils as nu
    base = getattr(nu, "nixl_agent_config", None)  # loads nixl's config class (None: NIXL not installed)
    if base is None or getattr(base, "nelssa_no_progress_thread", False):
        return base is not None

    def nixl_agent_config(*args, **kwargs):
        kwargs.setdefault("enable_prog_thread", False)
        return base(*args, **kwargs)

    nixl_agent_config.nelssa_no_progress_thread = True
    nu.nixl_agent_config = nixl_agent_config
    mod = sys.modules.get("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    if mod is not None:  # imported already: its own reference too
        mod.nixl_agent_config = nixl_agent_config
    return True
