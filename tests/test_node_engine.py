"""One real vLLM engine (CPU, SmolLM2, fp32, budget 1.0) with the host tier on a nelssa-node
subprocess over its native shared-memory plane (stores through its store slot): its greedy tokens equal
NELSSA_OFF's, and it leaves nothing on the node. The node holds one of the two long requests at a time
(24 MiB per device; each request ~31 MB by the scheduler's estimate, ~19 MB of it on the device with
two of the three KV heads): the scheduler admits by the node's capacity, not this machine's memory or a
larger ``host_capacity``, so the second waits for the first instead of failing in a store that does not
fit (RESOURCE_EXHAUSTED)."""

import pytest

from harness_util import run_harness
from test_node import Node

pytestmark = pytest.mark.engine

REQUESTS = [{"id": "long", "text_tokens": 2400, "max_tokens": 24},
            {"id": "long2", "text_tokens": 2200, "offset": 5000, "max_tokens": 24},
            {"id": "chat", "chat": "What is the capital of France?", "max_tokens": 24}]


def test_engine_node_equals_nelssa_off(cut_model_dir):
    node = Node("--devices", "2", "--device-memory", "24MiB")
    try:
        nelssa = {"T_input": 2048, "budget": 1.0, "chunk": 128, "segment": 1024, "engine": "node", "defer_below": 0,
                  "node_address": node.address, "node_transport": "native", "host_capacity": "4GiB"}
        spec = {"model": cut_model_dir, "nelssa": nelssa, "requests": REQUESTS, "max_model_len": 4096,
                "engine": {"num_gpu_blocks_override": 40, "max_num_batched_tokens": 1024}}
        on = run_harness({**spec, "mode": "on"}, timeout=600)
        s = node.stats()
        off = run_harness({**spec, "mode": "off"}, timeout=600)
        for rid in ("long", "long2", "chat"):
            assert on["results"][rid]["token_ids"] == off["results"][rid]["token_ids"], rid
            assert len(off["results"][rid]["token_ids"]) == 24
        assert on["host_totals"]["long_requests"] == 2, on["host_totals"]   # the long ones went to the node
        assert s.jobs > 0 and s.job_errors == 0 and s.native_jobs == s.jobs, s  # every job native
        assert s.stores > 0 and s.slot_stores == s.stores, s  # every store through the store slot
        assert on["final_host_bytes"] == 0 and on["host_requests"] == 0
        assert s.requests == 0 and all(d.used_bytes == 0 for d in s.devices), s
    finally:
        node.stop()
