"""NELSSA as a vLLM plugin: adapters from vLLM's extension points to nelssa.sparse / nelssa.node.

Entry point ``vllm.general_plugins`` -> ``register()`` (every vLLM process). An instance serves with
NELSSA when its ``additional_config`` has a "nelssa" section and NELSSA_OFF is unset; it then needs
NELSSA's worker, scheduler and KV connector, which ``engine_args()`` spells out:

    LLM(model, **engine_args({"T_input": 2048, "budget": 0.04}))
    AsyncEngineArgs(model=model, **engine_args({...}))   # EngineArgs too: the same keywords
"""

from __future__ import annotations

import os
from typing import Any

WORKER_CPU = "nelssa.vllm_plugin.worker.NelssaCPUWorker"
WORKER_GPU = "nelssa.vllm_plugin.worker.NelssaGPUWorker"
SCHEDULER = "nelssa.vllm_plugin.scheduler.NelssaScheduler"


def register() -> None:
    """Called by vLLM in each of its processes."""
    from nelssa.config import _bool
    from nelssa.vllm_plugin.nixl_progress import apply_from_env
    apply_from_env()  # a deployment setting of NIXL, the baseline's too (nixl_progress.py)
    if _bool(os.environ.get("NELSSA_OFF", "0")):
        return  # the baseline: nothing of NELSSA is registered
    from vllm import ModelRegistry

    from nelssa.vllm_plugin.spec import register_spec
    ModelRegistry.register_model("LlamaForCausalLM", "nelssa.vllm_plugin.model:NelssaLlamaForCausalLM")
    register_spec()


def engine_args(nelssa: dict[str, Any] | None = None, *, cuda: bool | None = None) -> dict[str, Any]:
    """vLLM engine arguments that turn NELSSA on (or, with NELSSA_OFF=1, the stock baseline: {}).

    The values are vLLM's own config objects where vLLM wants one (``kv_transfer_config``), so the
    same keywords work for ``LLM``, ``EngineArgs`` and ``AsyncEngineArgs``."""
    from nelssa.config import _bool, load_config
    if _bool(os.environ.get("NELSSA_OFF", "0")):
        return {}
    if nelssa is not None and not isinstance(nelssa, dict):
        raise ValueError(f"the NELSSA config must be an object (a dict), got {type(nelssa).__name__}")
    section = dict(nelssa or {})
    load_config({"nelssa": section})  # validate now, with a clear message
    from nelssa.vllm_plugin.connector import CONNECTOR
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    if cuda:
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm.config import KVTransferConfig
    return {"additional_config": {"nelssa": section}, "worker_cls": WORKER_GPU if cuda else WORKER_CPU,
            "scheduler_cls": SCHEDULER, "kv_transfer_config": KVTransferConfig(**CONNECTOR)}
