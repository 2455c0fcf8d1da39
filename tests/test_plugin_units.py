"""Plugin pieces without an engine: placement policy, KV spec merge, the CPU paged-cache reader
against vLLM's own cache-write op, config validation, the centroid estimate."""

import pytest
import torch

from conftest import rel_err
from nelssa.config import load_config, parse_bytes, parse_cores, vllm_nelssa_config
from nelssa.sparse import cluster_kv, dense_attention, merge_states, select_clusters, sparse_attention
from nelssa.vllm_plugin.policy import Policy, host_bytes


def test_policy_host_range_and_freed_blocks():
    p = Policy(T_input=2048, sink=16, recent=64, chunk=256, block_size=128)
    assert not p.is_long(2047) and p.is_long(2048)
    assert p.host_end(5000, 4999) == 0  # prompt not yet processed
    assert p.host_end(1000, 1200) == 0  # short request
    h0 = (5000 - 64) // 128 * 128
    assert p.host_end(5000, 5000) == h0 == 4864
    # generated tokens move a chunk at a time, keeping >= recent tokens on the device
    assert p.host_end(5000, h0 + 64 + 255) == h0 and p.host_end(5000, h0 + 64 + 256) == h0 + 256
    for n in range(5000, 6000, 7):
        h = p.host_end(5000, n)
        assert h % 128 == 0 and n - h >= 64 and p.device_tokens(5000, n) == 16 + n - h
    assert p.freed_blocks(5000, 5000) == (1, 38)
    with pytest.raises(ValueError, match="multiple of the KV block size"):
        Policy(2048, 16, 64, 100, 128)
    with pytest.raises(ValueError, match="T_input"):
        Policy(300, 16, 64, 128, 128)


def test_host_bytes_bounds_the_store():
    k, v = torch.randn(3, 3000, 64).bfloat16(), torch.randn(3, 3000, 64).bfloat16()
    ckv = cluster_kv(k, v)
    ckv.append(k[:, :1024], v[:, :1024])
    assert ckv.nbytes <= host_bytes(4024, 1, 3, 64, 2)


def test_spec_merge_keeps_nelssa_fields():
    from nelssa.vllm_plugin.spec import NelssaSpec
    s = NelssaSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, T_input=2048, sink=16,
                   recent=64, chunk=1024)
    m = NelssaSpec.merge([s, s])
    assert type(m) is NelssaSpec and m == s and m.policy().chunk == 1024
    other = NelssaSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, T_input=4096, sink=16,
                       recent=64, chunk=1024)
    with pytest.raises(AssertionError, match="disagree"):
        NelssaSpec.merge([s, other])


@pytest.mark.parametrize("block_size,dtype", [(16, torch.bfloat16), (128, torch.bfloat16), (128, torch.float32)])
def test_cpu_paged_cache_reader_matches_vllm_write(block_size, dtype):
    """read_kv recovers exactly what vLLM's CPU cache-write op stored (vec / vec16 layouts)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from nelssa.vllm_plugin.attention import read_kv
    nb, kh, d, n = 12, 3, 64, 150
    isa = _get_attn_isa(dtype, block_size, d, "auto")
    assert isa in ("vec", "vec16")
    cache = torch.zeros(nb, kh, block_size, 2 * d, dtype=dtype)
    kc, vc = cache.view(nb, kh, 2 * block_size, d).chunk(2, dim=2)
    slots = torch.randperm(nb * block_size)[:n]
    k, v = torch.randn(n, kh, d).to(dtype), torch.randn(n, kh, d).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    rk, rv = read_kv(cache, "cpu", slots // block_size, slots % block_size, kh, d)
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_config_sources_and_errors():
    cfg = load_config({"nelssa": {"T_input": 4096, "budget": 0.02}}, env={"NELSSA_POOL_THREADS": "3",
                                                                           "NELSSA_AFFINITY_CORES": "0-1,4"})
    assert (cfg.T_input, cfg.budget, cfg.pool_threads, cfg.affinity_cores) == (4096, 0.02, 3, (0, 1, 4))
    assert load_config({"nelssa": {"budget": 0.5}}, env={"NELSSA_BUDGET": "0.1"}).budget == 0.1  # env wins
    assert load_config(None, env={"NELSSA_PREFETCH": "l2", "NELSSA_PREFETCH_ROWS": "16"}).prefetch == "l2"
    assert vllm_nelssa_config({}) is None and vllm_nelssa_config(None) is None
    assert vllm_nelssa_config({"nelssa": {}}) is not None
    assert parse_bytes("64GiB") == 64 << 30 and parse_cores("2") == (2,)
    for bad, msg in [({"nelssa": {"budget": 0}}, "budget"), ({"nelssa": {"bogus": 1}}, "unknown nelssa config"),
                     ({"nelssa": {"engine": "x"}}, "engine"), ({"nelssa": []}, "must be an object"),
                     ({"nelssa": {"prefetch": "t0"}}, "prefetch must be one of")]:
        with pytest.raises(ValueError, match=msg):
            load_config(bad, env={})
    with pytest.raises(ValueError, match="NELSSA_AFFINITY_CORES"):
        load_config(None, env={"NELSSA_AFFINITY_CORES": "a-b"})


def test_estimate_of_unselected_clusters():
    """Budget 100%: nothing to estimate (lse -inf). At 4% the estimate over the unselected clusters,
    merged with the exact selected part, is closer to dense attention than the selection alone."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 4000, 64, generator=g) + 2 * torch.randn(2, 1, 64, generator=g)
    v = torch.randn(2, 4000, 64, generator=g)
    ckv = cluster_kv(k, v)
    errs = []
    for s in range(8):
        q = 0.5 * torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(s))
        full = select_clusters(q, [ckv], 1.0, estimate=True)
        assert torch.isinf(full.estimate[1]).all()
        sel = select_clusters(q, [ckv], 0.04, estimate=True)
        out, lse = sparse_attention(q[0], ckv, 0.04)
        merged, _ = merge_states(out, lse, sel.estimate[0][0], sel.estimate[1][0])
        ref, _ = dense_attention(q[0], k, v)
        errs.append((rel_err(out, ref), rel_err(merged, ref)))
    assert sum(m for _, m in errs) < 0.9 * sum(o for o, _ in errs)
