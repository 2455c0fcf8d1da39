"""Plugin pieces without an engine: placement policy, KV spec merge, the CPU paged-cache reader
against vLLM's own cache-write op, config validation, the centroid estimate."""

import math
import os

import numpy as np
import pytest
import torch

from conftest import rel_err
from nelssa.config import load_config, parse_bytes, parse_cores, vllm_nelssa_config
from nelssa.sparse import cluster_kv, dense_attention, merge_states, select_clusters, sparse_attention
from nelssa.vllm_plugin.policy import (Policy, attention_balance, blocks_to_finish, blocks_within,
                                       ends_within_handoff, host_bytes, prefill_chunk)


def test_blocks_within_counts_the_blocks_decoding_requests_take():
    """policy.blocks_within (the migration trigger migrate_lead_steps): a request at n tokens takes the
    blocks it crosses into within the next steps; none while its current block has room."""
    assert blocks_within([], 64, 16) == 0
    assert blocks_within([100], 10, 128) == 0            # 100 -> 110: still block 1
    assert blocks_within([128], 1, 128) == 1             # a full block: the next token needs another
    assert blocks_within([2048, 2000, 1950], 200, 128) == 2 + 2 + 1  # blocks 16 -> 18, 16 -> 18, 16 -> 17
    assert blocks_within([0], 300, 128) == 3


def test_blocks_to_finish_counts_what_requests_still_allocate_to_their_end():
    """policy.blocks_to_finish (the recall's room): blocks from a request's context to its end."""
    assert blocks_to_finish([], 128) == 0
    assert blocks_to_finish([(100, 120)], 128) == 0      # within block 1
    assert blocks_to_finish([(128, 129)], 128) == 1      # a new block for token 129
    assert blocks_to_finish([(0, 2400), (2000, 2100), (2100, 2100)], 128) == 19 + 1 + 0
    assert blocks_to_finish([(300, 200)], 128) == 0      # never negative
    assert load_config({"nelssa": {"migrate_lead_steps": 64}}, env={}).migrate_lead_steps == 64
    with pytest.raises(ValueError, match="migrate_lead_steps must be"):
        load_config({"nelssa": {"migrate_lead_steps": -1}}, env={})


def test_a_request_ending_within_a_hand_off_does_not_migrate():
    """policy.ends_within_handoff (the migration rule): a grown request whose tokens to go are no more
    than the steps a hand-off takes (its measured seconds over the step interval) ends before a migration
    could free its blocks; nothing is skipped before both times are measured."""
    assert ends_within_handoff(15, 0.3, 0.015)           # H100 growth run 76: 15 to go, ~20 steps of hand-off
    assert ends_within_handoff(20, 0.3, 0.015) and not ends_within_handoff(21, 0.3, 0.015)
    assert not ends_within_handoff(152, 0.3, 0.015)      # the engine tests' migrations (152+ tokens to go)
    assert not ends_within_handoff(0, None, 0.015) and not ends_within_handoff(0, 0.3, None)
    assert ends_within_handoff(1, 0.001, 0.015)          # a hand-off within a step still takes that step


def test_lane_batches_are_labelled_by_the_steps_beside_them():
    """lane.beside_bucket: the mean requests (lane rows not counted) of the engine steps run during a lane
    batch; the benchmark reads the same labels (hol.BESIDE)."""
    from nelssa.bench.hol import BESIDE as HOL_BESIDE
    from nelssa.vllm_plugin.lane import BESIDE, beside_bucket
    assert BESIDE == HOL_BESIDE
    assert beside_bucket(0, 0) == "0" and beside_bucket(3, 1) == "0"     # no step, or steps of lane rows only
    assert beside_bucket(2, 2) == "1-15" and beside_bucket(4, 60) == "1-15"
    assert beside_bucket(4, 64) == "16-47" and beside_bucket(1, 47) == "16-47"
    assert beside_bucket(5, 250) == "48+" and beside_bucket(1, 48) == "48+"


def test_policy_goal_switch_and_freed_blocks():
    p = Policy(T_input=2048, sink=16, recent=64, chunk=256, block_size=128)
    assert not p.is_long(2047) and p.is_long(2048)
    assert p.goal(5000, 4999) == 0  # prompt not yet processed
    assert p.goal(1000, 1200) == 0  # short request
    h0 = (5000 - 64) // 128 * 128
    assert p.goal(5000, 5000) == h0 == 4864
    # generated tokens move a chunk at a time, keeping >= recent tokens on the device
    assert p.goal(5000, h0 + 64 + 255) == h0 and p.goal(5000, h0 + 64 + 256) == h0 + 256
    for n in range(5000, 6000, 7):
        h = p.goal(5000, n)
        assert h % 128 == 0 and n - h >= 64
    # a range is used only once hand-offs cover the prompt's goal: staged segments alone do not switch
    assert p.in_use(5000, 16 + 2048) == 0 and p.in_use(5000, h0 - 128) == 0
    assert p.in_use(5000, h0) == h0 and p.in_use(5000, h0 + 256) == h0 + 256
    assert p.in_use(1000, 5000) == 0
    assert p.freed_blocks(h0) == (1, 38) and p.freed_blocks(0) == (1, 0)
    with pytest.raises(ValueError, match="multiple of the KV block size"):
        Policy(2048, 16, 64, 100, 128)
    with pytest.raises(ValueError, match="T_input"):
        Policy(300, 16, 64, 128, 128)


def test_migrated_request_anchor():
    """A request that grew past T_input is host-backed from its anchor (tokens with KV when it
    migrated), exactly like a prompt of that length; a short prompt without an anchor never is."""
    p = Policy(T_input=2048, sink=16, recent=64, chunk=256, block_size=128)
    assert p.anchor(1950) == 0 and p.anchor(5000) == 5000 and p.anchor(1950, 2100) == 2100
    a = p.anchor(1950, 2100)
    assert p.goal(a, 2100) == (2100 - 64) // 128 * 128 == 1920
    assert p.in_use(a, 1920) == 1920 and p.in_use(a, 1792) == 0
    assert p.goal(a, 1920 + 64 + 256) == 1920 + 256
    # deferred: a long prompt shorter than defer_below is host-backed only from the anchor the scheduler gives it (its length while
    # it prefills, its tokens with KV once it decodes), like a grown request
    d = Policy(T_input=2048, sink=16, recent=64, chunk=256, block_size=128, defer_below=8192)
    assert d.anchor(5000) == 0 and d.anchor(5000, 5000) == 5000 and d.anchor(5000, 5200) == 5200
    assert d.deferred(5000) and not d.deferred(1950) and not d.deferred(8192) and d.anchor(8192) == 8192
    assert d.goal(d.anchor(5000, 5000), 5000) == p.goal(p.anchor(5000), 5000)


def test_device_only_opt_out():
    """extra_args nelssa_offload false keeps a request of any length on the device (anchor 0, even
    with a migration anchor); malformed values are errors, not guesses."""
    from types import SimpleNamespace as NS

    from nelssa.vllm_plugin.policy import device_only
    p = Policy(T_input=2048, sink=16, recent=64, chunk=256, block_size=128)
    assert p.anchor(5000, device_only=True) == 0 and p.anchor(1950, 2100, True) == 0
    assert not p.is_long(5000, True) and p.is_long(5000)
    for v, want in ((False, True), (0, True), ("off", True), ("False", True), (True, False), ("1", False)):
        assert device_only(NS(extra_args={"nelssa_offload": v})) is want, v
    assert not device_only(NS(extra_args=None)) and not device_only(NS(extra_args={"other": 1}))
    for v in ("maybe", 2, 0.5, None):
        with pytest.raises(ValueError, match="nelssa_offload"):
            device_only(NS(extra_args={"nelssa_offload": v}))


def test_spared_from_preemption():
    """Preempted last: requests decoding with >= T_input tokens of context (a prompt still prefilling is
    not spared, nor a short one however long it decodes below T_input)."""
    p = Policy(T_input=2048, sink=16, recent=64, chunk=256, block_size=128)
    assert p.spared(5001, 5000) and p.spared(2048, 1950) and p.spared(100_000, 100_000)
    assert not p.spared(4096, 5000)  # prefilling
    assert not p.spared(2047, 1000)  # short


def test_long_prefill_chunk_keeps_step_cost_flat():
    from types import SimpleNamespace as NS
    llama8b = NS(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336)
    leq = attention_balance(llama8b)
    assert 20_000 < leq < 35_000  # attention of ~27K context tokens costs a token's linear layers
    chunks = [prefill_chunk(1024, d, leq, 16) for d in (0, 25_000, 50_000, 100_000)]
    assert chunks[0] == 1024 and chunks == sorted(chunks, reverse=True) and all(c % 16 == 0 for c in chunks)
    for d, c in zip((0, 25_000, 50_000, 100_000), chunks):  # cost ~ c * (1 + d / leq) within a block
        assert abs(c * (1 + d / leq) - 1024) <= 16 * (1 + d / leq)
    assert prefill_chunk(64, 10**7, leq, 16) == 16  # never below one block


def test_prefill_moves_go_by_segment_then_by_tail_piece():
    """policy.prefill_move_end: whole segments from the sink while more than a segment is left before the goal,
    then pieces of tail_segment; monotone, never past the goal. The moves a prefill issues (one per new end;
    the rest up to the goal once it is done, the runner's other branch) are then at most a piece long near
    its end, where without pieces the last whole segment's move is issued ~1.6K tokens before the end of a
    100K prompt and still runs at its switch."""
    from nelssa.vllm_plugin.policy import prefill_move_end
    sink, seg, goal, prompt = 16, 8192, 99_920, 100_000
    assert prefill_move_end(50_000, goal, sink, seg, 2048) == sink + 6 * seg  # far from the goal: segments
    assert prefill_move_end(91_000, goal, sink, seg, 2048) == sink + 11 * seg  # more than a segment left
    assert prefill_move_end(92_500, goal, sink, seg, 2048) == sink + 11 * seg + 2048  # then by 2K pieces

    def moves(tail):  # the ranges a prefill issues, chunk by chunk (128 tokens a step here), to its end
        out, end = [], sink
        for n in list(range(sink, prompt, 128)) + [prompt - 1, prompt]:
            want = prefill_move_end(n, goal, sink, seg, tail) if n < prompt else goal  # done: the goal
            assert want >= end and want <= goal
            if want > end:
                out.append((end, want))
                end = want
        assert end == goal
        return out
    pieces, whole = moves(2048), moves(0)
    assert all(b - a == seg for a, b in pieces[:11]) and all(b - a <= 2048 for a, b in pieces[11:])
    assert all((a - sink) % 2048 == 0 for a, _ in pieces)  # pieces start on piece (and segment) boundaries
    # the moves issued in the last segment before the goal: 2K pieces, against one whole segment
    assert [b - a for a, b in pieces if b > goal - seg] == [2048, 2048, 2048, 2048, 1600]
    assert [b - a for a, b in whole if b > goal - seg] == [seg, 1600]
    assert moves(0) == [(sink + k * seg, sink + (k + 1) * seg) for k in range(12)] + [(sink + 12 * seg, goal)]


def test_chunk_budget_is_solo_only_while_no_long_request_decodes():
    from nelssa.vllm_plugin.policy import chunk_budget
    assert chunk_budget(1024, 2048, long_decoding=False) == 2048  # a first long prompt, nothing on the host tier
    assert chunk_budget(1024, 2048, long_decoding=True) == 1024   # a long request's lane batches beside the steps
    assert chunk_budget(1024, 0, long_decoding=False) == 1024     # off: long_chunk everywhere
    assert chunk_budget(0, 0, long_decoding=False) == 0           # vLLM's own threshold


def test_prefill_steps_bound_the_steps_of_the_shrinking_chunks():
    """policy.prefill_steps (the scheduler's horizon for what short requests grow to beside a long prefill):
    never fewer steps than prefill_chunk's chunks take, and close to them (within 15% here)."""
    from nelssa.vllm_plugin.policy import prefill_steps

    def simulated(done, total, budget, leq, bs):
        n = 0
        while done < total:
            done += prefill_chunk(budget, done, leq, bs)
            n += 1
        return n
    leq = 26_624.0
    for done, total, budget, bs in ((0, 100_000, 1024, 16), (60_000, 100_000, 1024, 16), (0, 100_000, 2048, 16),
                                    (99_990, 100_000, 1024, 16), (0, 3_000, 256, 128)):
        sim, bound = simulated(done, total, budget, leq, bs), prefill_steps(done, total, budget, leq, bs)
        assert sim <= bound <= max(sim + 1, 1.15 * sim), (done, total, budget, bs, sim, bound)
    # chunks of a block or a few: a step a block (5,324 steps take 6,250 blocks)
    assert simulated(0, 100_000, 64, leq, 16) <= prefill_steps(0, 100_000, 64, leq, 16) == 6_250
    assert prefill_steps(100, 100, 1024, leq, 16) == 0
    assert prefill_steps(0, 5_000, 1024, float("inf"), 16) == 5  # vLLM's own threshold: a fixed chunk


def test_switch_steps_cover_the_hold_after_a_long_prefill():
    """policy.switch_steps (the scheduler's horizon, after a long prefill's, for what short requests grow to
    while the prompt keeps its device blocks until its switch): the hold's bound in whole steps, rounded up;
    nothing while the step interval or the bound is unknown."""
    from nelssa.vllm_plugin.policy import switch_steps
    assert switch_steps(2.0, 0.05) == 40          # the lane's default bound at the H200 run's ~50-ms steps
    assert switch_steps(2.0, 0.03) == 67 and switch_steps(0.01, 0.05) == 1
    assert switch_steps(0.0, 0.05) == switch_steps(2.0, None) == switch_steps(None, 0.05) == 0


def test_step_plan_gives_every_decode_its_token_and_caps_the_prompts():
    from nelssa.vllm_plugin.policy import step_plan
    kinds = ["prompt", "decode", "long", "spared", "decode", "prompt", "long"]
    new = [600, 1, 224, 1, 3, 1000, 640]  # a decode with two drafts takes 3; two long prompts' chunks
    order, budget = step_plan(kinds, new, 1024)
    assert order == [3, 1, 4, 2, 6, 0, 5]
    assert budget == 1 + 1 + 3 + 224 + 640 + 1024
    # vLLM's loop over the running list in this order: decodes and long chunks whole, the short prompts
    # within the cap
    left, got = budget, {}
    for i in order:
        got[i] = min(new[i], left)
        left -= got[i]
    assert all(got[i] == new[i] for i in (1, 3, 4, 2, 6, 0)) and got[5] == 1024 - 600 and left == 0
    assert step_plan([], [], 1024) == ([], 1024)
    with pytest.raises(ValueError, match="unknown kind"):
        step_plan(["waiting"], [1], 8)


def test_host_bytes_bounds_the_store():
    k, v = torch.randn(3, 3000, 64).bfloat16(), torch.randn(3, 3000, 64).bfloat16()
    ckv = cluster_kv(k, v)
    ckv.append(k[:, :1024], v[:, :1024])
    assert ckv.nbytes <= host_bytes(4024, 1, 3, 64, 2)


def test_host_bytes_bounds_a_kept_store_on_the_node():
    """A hand-over's parts (centroid state kept, node/wire.py centroid_bytes): what the node reserves for
    them (K/V rows, tables, centroids and value means) stays within host_bytes(.., keep_cluster_size)."""
    from nelssa.node.storage import table_bytes
    from nelssa.node.wire import centroid_bytes
    from nelssa.sparse.clustered import cluster_layers
    H, D, es, cs = 3, 64, 2, 8
    held = 0
    for n in (3000, 1024, 700):  # a prompt's part, a generated chunk, a short tail
        k = torch.randn(H, n, D).bfloat16()
        (_, C), = cluster_layers([k], seed=0, cluster_size=cs, segment=2048, iters=2)
        held += H * n * 2 * D * es + table_bytes(H, C) + centroid_bytes(H, D, es, C)
    assert held <= host_bytes(4724, 1, H, D, es, keep_cluster_size=cs)
    assert held > host_bytes(4724, 1, H, D, es)  # without the kept state the bound does not hold


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


@pytest.mark.parametrize("block_size,dtype,d,isa", [(16, torch.bfloat16, 64, None), (128, torch.bfloat16, 64, None),
                                                    (128, torch.float32, 64, None), (32, torch.bfloat16, 64, "amx"),
                                                    (128, torch.bfloat16, 128, "amx")])
def test_cpu_paged_cache_reader_matches_vllm_write(block_size, dtype, d, isa):
    """read_kv recovers exactly what vLLM's CPU cache-write op stored: the layout vLLM picks on this CPU
    (isa None: vec / vec16, or amx on AMX CPUs) and the AMX layout explicitly where this CPU has AMX."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from nelssa.vllm_plugin.attention import read_kv
    if isa is None:
        isa = _get_attn_isa(dtype, block_size, d, "auto")
    elif not torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has no AMX: vLLM does not use the AMX layout here")
    assert isa in ("vec", "vec16", "amx")
    nb, kh, n = 12, 3, 150
    cache = torch.zeros(nb, kh, block_size, 2 * d, dtype=dtype)
    kc, vc = cache.view(nb, kh, 2 * block_size, d).chunk(2, dim=2)
    slots = torch.randperm(nb * block_size)[:n]
    k, v = torch.randn(n, kh, d).to(dtype), torch.randn(n, kh, d).to(dtype)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, isa)
    layout = "cpu_amx" if isa == "amx" else "cpu_vec"
    rk, rv = read_kv(cache, layout, slots // block_size, slots % block_size, kh, d)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    b2, o2 = (slots // block_size).view(10, 15), (slots % block_size).view(10, 15)  # any leading shape
    rk2, rv2 = read_kv(cache, layout, b2, o2, kh, d)
    assert torch.equal(rk2, k.view(10, 15, kh, d)) and torch.equal(rv2, v.view(10, 15, kh, d))
    # write_kv (a recall's load, recall.py) writes where read_kv reads, touching nothing else
    from nelssa.vllm_plugin.attention import write_kv
    k2, v2 = torch.randn(n, kh, d).to(dtype), torch.randn(n, kh, d).to(dtype)
    before = cache.clone()
    write_kv(cache, layout, slots[:80] // block_size, slots[:80] % block_size, k2[:80], v2[:80])
    rk, rv = read_kv(cache, layout, slots // block_size, slots % block_size, kh, d)
    assert torch.equal(rk[:80], k2[:80]) and torch.equal(rv[:80], v2[:80])
    assert torch.equal(rk[80:], k[80:]) and torch.equal(rv[80:], v[80:])
    write_kv(cache, layout, slots[:80] // block_size, slots[:80] % block_size, k[:80], v[:80])
    assert torch.equal(cache, before)


def test_flash_layout_write_kv_is_read_back():
    """write_kv and read_kv agree in FlashAttention's layout (the GPU's), positions anywhere in the blocks."""
    from nelssa.vllm_plugin.attention import read_kv, write_kv
    nb, kh, bs, d, n = 9, 2, 16, 32, 70
    cache = torch.randn(nb, kh, bs, 2 * d)
    slots = torch.randperm(nb * bs)[:n]
    b, o = slots // bs, slots % bs
    k, v = torch.randn(n, kh, d), torch.randn(n, kh, d)
    before = read_kv(cache, "flash", torch.arange(nb).repeat_interleave(bs), torch.arange(bs).repeat(nb), kh, d)
    write_kv(cache, "flash", b, o, k, v)
    rk, rv = read_kv(cache, "flash", b, o, kh, d)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    after = read_kv(cache, "flash", torch.arange(nb).repeat_interleave(bs), torch.arange(bs).repeat(nb), kh, d)
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(after[0][untouched], before[0][untouched]) and torch.equal(after[1][untouched], before[1][untouched])


def test_config_sources_and_errors():
    cfg = load_config({"nelssa": {"T_input": 4096, "budget": 0.02}}, env={"NELSSA_POOL_THREADS": "3",
                                                                           "NELSSA_AFFINITY_CORES": "0-1"})
    assert (cfg.T_input, cfg.budget, cfg.pool_threads, cfg.affinity_cores) == (4096, 0.02, 3, (0, 1))
    assert parse_cores("0-1,4") == (0, 1, 4)
    assert load_config({"nelssa": {"budget": 0.5}}, env={"NELSSA_BUDGET": "0.1"}).budget == 0.1  # env wins
    # deferral needs migration: with migrate off, long prompts are host-backed from admission
    assert load_config({"nelssa": {}}, env={}).defer_limit == 32768
    assert load_config({"nelssa": {"migrate": False}}, env={}).defer_limit == 0
    assert load_config(None, env={"NELSSA_DEFER_BELOW": "4096"}).defer_limit == 4096
    assert load_config(None, env={"NELSSA_PREFETCH": "l2", "NELSSA_PREFETCH_ROWS": "16"}).prefetch == "l2"
    assert load_config(None, env={}).lane_host_wait == "flags"
    assert load_config(None, env={"NELSSA_SHORT_CHUNK": "512"}).short_chunk == 512  # the step budget's own cap
    assert load_config(None, env={"NELSSA_SHORT_CHUNK_DECODE": "1024"}).short_chunk_decode == 1024
    assert load_config(None, env={}).short_chunk_decode == -1  # -1: short_chunk in the long decode phase too
    assert load_config(None, env={"NELSSA_LONG_CHUNK_SOLO": "4096"}).chunk_solo == 4096
    assert load_config(None, env={"NELSSA_TAIL_SEGMENT": "1024"}).tail_piece == 1024
    # the defaults in effect (-1): a solo chunk of max(4096, long_chunk), none without long_chunk; 2K tail
    # pieces where 2048 divides a longer segment, whole segments elsewhere; 0 turns either off
    d = load_config(None, env={})
    assert (d.long_chunk, d.chunk_solo, d.tail_piece) == (768, 4096, 2048)
    assert load_config({"nelssa": {"long_chunk": 6144}}, env={}).chunk_solo == 6144
    assert load_config({"nelssa": {"long_chunk": 0}}, env={}).chunk_solo == 0
    assert load_config({"nelssa": {"long_chunk_solo": 0}}, env={}).chunk_solo == 0
    pieces = [load_config({"nelssa": {"segment": s}}, env={}).tail_piece for s in (2048, 4096, 6000, 16384)]
    assert pieces == [0, 2048, 0, 2048]
    assert load_config({"nelssa": {"tail_segment": 0}}, env={}).tail_piece == 0
    assert load_config(None, env={"NELSSA_LANE_HOST_WAIT": "hostfn"}).lane_host_wait == "hostfn"
    assert load_config(None, env={}).lane_chain and not load_config(None, env={"NELSSA_LANE_CHAIN": "0"}).lane_chain
    assert load_config(None, env={}).lane_overlap and not load_config(None, env={"NELSSA_LANE_OVERLAP": "0"}).lane_overlap
    from nelssa.node.client import client_spin_us
    assert client_spin_us(load_config(None, env={"NELSSA_NODE_SPIN_US": "300"})) == 300
    assert client_spin_us(load_config(None, env={})) in (20, 1000)  # by the usable cores
    import os
    mine = os.sched_getaffinity(0)
    few = len(mine) < 8
    # a node pinned to cores this process may not run on: the waiter polls long; sharing any: by cores
    assert client_spin_us(load_config(None, env={}), frozenset({max(mine) + 1})) == 1000
    assert client_spin_us(load_config(None, env={}), frozenset({min(mine)})) == (20 if few else 1000)
    assert client_spin_us(load_config(None, env={"NELSSA_NODE_SPIN_US": "300"}), frozenset({max(mine) + 1})) == 300
    assert vllm_nelssa_config({}) is None and vllm_nelssa_config(None) is None
    assert vllm_nelssa_config({"nelssa": {}}) is not None
    # an engine's sink is whole KV blocks (the lane's window reads whole blocks from 0 and from H)
    assert [vllm_nelssa_config({"nelssa": {}}, bs).sink for bs in (None, 16, 64, 128)] == [16, 16, 64, 128]
    assert vllm_nelssa_config({"nelssa": {"sink": 130}}, 128).sink == 256
    assert vllm_nelssa_config({"nelssa": {"sink": 0}}, 64).sink == 0
    assert vllm_nelssa_config({"nelssa": {}}, 64).replace(T_input=8192).T_input == 8192
    # the lane, left unset, is on with CUDA and off elsewhere; an explicit choice (JSON or env) stands
    assert load_config({"nelssa": {}}, env={}).lane is None
    assert [vllm_nelssa_config({"nelssa": {}}, 16, d).lane for d in ("cuda", "cpu", None)] == [True, False, False]
    assert vllm_nelssa_config({"nelssa": {"lane": False}}, 16, "cuda").lane is False
    assert vllm_nelssa_config({"nelssa": {"lane": True}}, 16, "cpu").lane is True
    assert vllm_nelssa_config({"nelssa": {"engine": "node", "handover": True}}, 16, "cuda").lane is False  # P
    with pytest.raises(ValueError, match="lane must be"):
        load_config({"nelssa": {"lane": "yes"}}, env={})
    assert parse_bytes("64GiB") == 64 << 30 and parse_cores("2") == (2,)
    for bad, msg in [({"nelssa": {"budget": 0}}, "budget"), ({"nelssa": {"bogus": 1}}, "unknown nelssa config"),
                     ({"nelssa": {"kmeans_kernel": "false"}}, "kmeans_kernel must be true or false"),
                     ({"nelssa": {"graphs": 0}}, "graphs must be true or false"),  # every switch, not only some
                     ({"nelssa": {"recall": None}}, "recall must be true or false"),
                     ({"nelssa": {"engine": "x"}}, "engine"), ({"nelssa": []}, "must be an object"),
                     ({"nelssa": {"prefetch": "t0"}}, "prefetch must be one of"),
                     ({"nelssa": {"lane_host_wait": "event"}}, "lane_host_wait must be"),
                     ({"nelssa": {"lane_connections": 33}}, "lane_connections must be"),
                     ({"nelssa": {"node_spin_us": -2}}, "node_spin_us must be"),
                     ({"nelssa": {"lane_sms": -8}}, "lane_sms must be"),
                     ({"nelssa": {"short_chunk": -1}}, "short_chunk must be"),
                     ({"nelssa": {"short_chunk_decode": -2}}, "short_chunk_decode must be"),
                     ({"nelssa": {"long_chunk_solo": -2}}, "long_chunk_solo must be"),
                     ({"nelssa": {"tail_segment": -2}}, "tail_segment must be"),
                     ({"nelssa": {"tail_segment": 3000}}, "tail_segment must be"),  # no divisor of 8192
                     ({"nelssa": {"tail_segment": 4}}, "tail_segment must be"),     # below cluster_size
                     ({"nelssa": {"long_chunk": 0, "long_chunk_solo": 2048}}, "long_chunk_solo needs long_chunk"),
                     ({"nelssa": {"lane_sms": 16, "lane": False}}, "lane_sms needs the lane"),
                     ({"nelssa": {"node_address": "127.0.0.1:99999"}}, "port in"),  # (gRPC wraps it to 34463)
                     ({"nelssa": {"node_address": "localhost"}}, "host:port"),
                     ({"nelssa": {"affinity_cores": "0-100000"}}, "cores of this machine")]:
        with pytest.raises(ValueError, match=msg):
            load_config(bad, env={})
    with pytest.raises(ValueError, match="NELSSA_AFFINITY_CORES"):
        load_config(None, env={"NELSSA_AFFINITY_CORES": "a-b"})


def test_sm_split_is_off_by_default_and_refuses_loudly_without_green_contexts(monkeypatch):
    """config lane_sms (sm_split.py): 0 leaves every SM shared (nothing done, said so); asked for where the
    driver cannot split (here: no CUDA driver library), it raises rather than run on a shared GPU."""
    import ctypes

    from nelssa.vllm_plugin import sm_split
    cfg = load_config({"nelssa": {"lane": True, "lane_sms": 16}}, env={"NELSSA_LANE_SMS": "24"})
    assert cfg.lane_sms == 24  # the environment maps into the config
    assert sm_split.setup(load_config({"nelssa": {}}, env={}), torch.device("cpu")) is False
    assert "no SM split" in sm_split.describe()

    def no_driver(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    with pytest.raises(sm_split.SplitError, match="no CUDA driver library"):
        sm_split.setup(cfg, torch.device("cuda", 0))

    class OldDriver:
        cuDeviceGet = cuDeviceGetDevResource = object()
    monkeypatch.setattr(ctypes, "CDLL", lambda name: OldDriver())
    with pytest.raises(sm_split.SplitError, match="cuDevSmResourceSplitByCount"):
        sm_split.setup(cfg, torch.device("cuda", 0))
    assert sm_split._split is None and sm_split.lane_stream(torch.device("cuda", 0), -2) is None


def test_lane_asks_for_hardware_queues_before_cuda_starts(monkeypatch):
    """The GPU worker raises CUDA_DEVICE_MAX_CONNECTIONS for the lane (worker.hardware_queues) unless the
    lane is off, the config says 0, or the environment already names it; never once CUDA is up."""
    from nelssa.vllm_plugin.worker import hardware_queues
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    lane = load_config({"nelssa": {"lane": True}}, env={})
    assert lane.lane_connections == 32
    assert hardware_queues(load_config({"nelssa": {}}, env={})) is None  # no lane
    assert hardware_queues(load_config({"nelssa": {"lane": True, "lane_connections": 0}}, env={})) is None
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert hardware_queues(lane) is None and "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert hardware_queues(lane) == "32" and os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")  # the user's choice wins
    assert hardware_queues(lane) is None and os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "4"


def test_an_attention_backend_nelssa_does_not_read_is_refused_with_the_fix():
    """attention.wrap_impl: a backend whose paged KV NELSSA cannot read (vLLM may pick FlashInfer on some GPUs)
    stops the engine's start with the argument that selects FLASH_ATTN, not later with a wrong answer."""
    from types import SimpleNamespace

    from nelssa.config import NelssaConfig
    from nelssa.vllm_plugin.attention import wrap_impl
    impl = type("FlashInferImpl", (), {"forward": lambda *a: None})()
    with pytest.raises(ValueError, match="not FlashInferImpl .*--attention-backend FLASH_ATTN"):
        wrap_impl(SimpleNamespace(impl=impl), NelssaConfig())
    assert type(impl).__name__ == "FlashInferImpl" and not hasattr(impl, "nelssa_backend")  # left as it was
    flash = type("FlashAttentionImpl", (), {"forward": lambda *a: None})()
    wrap_impl(SimpleNamespace(impl=flash), NelssaConfig())
    assert type(flash).__name__ == "NelssaFlashAttentionImpl" and flash.nelssa_kv_layout == "flash"


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


def test_prepared_parts_stay_invisible_until_committed():
    """A background hand-off prepares parts (commit=False) that attention must not see until the
    switch: the committed view is unchanged, and committing gives exactly the eager result."""
    k, v = torch.randn(2, 600, 32), torch.randn(2, 600, 32)
    eager = cluster_kv(k[:, :400], v[:, :400], seed=3)
    eager.append(k[:, 400:], v[:, 400:])
    lazy = cluster_kv(k[:, :400], v[:, :400], seed=3, commit=False)
    assert lazy.length == 0 and lazy.num_clusters == 0 and lazy.pending_tokens == 400
    lazy.commit_until(400)
    lazy.append(k[:, 400:], v[:, 400:], commit=False)
    assert lazy.length == 400 and lazy.pending_tokens == 200
    with pytest.raises(ValueError, match="500 expected"):
        lazy.commit_until(500)  # out of step with the policy: loud
    lazy.commit_until(600)
    for name in ("centroids", "sizes", "cstart", "csize", "perm", "cpart"):
        assert torch.equal(getattr(lazy, name), getattr(eager, name)), name
    q = torch.randn(4, 32)
    o1, l1 = sparse_attention(q, lazy, 1.0)
    o2, l2 = sparse_attention(q, eager, 1.0)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_scheduler_follows_vllms_async_scheduling_choice():
    """vLLM builds the --scheduler-cls it is given; NELSSA's class then takes vLLM's AsyncScheduler as
    its base when async scheduling is on (CUDA default), so that fast path stays on."""
    from types import SimpleNamespace

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from nelssa.vllm_plugin.scheduler import NelssaAsyncScheduler, NelssaScheduler

    def cfg(on):
        return SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=on))
    a = NelssaScheduler.__new__(NelssaScheduler, vllm_config=cfg(True))
    s = NelssaScheduler.__new__(NelssaScheduler, cfg(False))
    assert type(a) is NelssaAsyncScheduler and isinstance(a, AsyncScheduler) and isinstance(a, NelssaScheduler)
    assert type(s) is NelssaScheduler and not isinstance(s, AsyncScheduler)
    # NELSSA's overrides run before AsyncScheduler's, which run before Scheduler's
    mro = NelssaAsyncScheduler.__mro__
    assert mro.index(NelssaScheduler) < mro.index(AsyncScheduler)


def test_layers_clustered_together_equal_layer_by_layer():
    """The hand-off clusters all layers in one k-means run (stacked along the head axis): each layer
    gets the labels a run of its own with the same seed gives; a small logits cap splits the layers
    into groups (seeded by their first layer) without changing shapes."""
    from nelssa.sparse.clustered import cluster_layers
    from nelssa.sparse.kmeans import segmented_kmeans
    ks = [torch.randn(3, 700, 32) for _ in range(4)]
    got = cluster_layers(ks, seed=5, cluster_size=8, segment=300, iters=4)
    for k, (lab, c) in zip(ks, got):
        want, wc = segmented_kmeans(k, seed=5, cluster_size=8, segment=300, iters=4)
        assert c == wc and torch.equal(lab, want)
    small = cluster_layers(ks, seed=5, cluster_size=8, segment=300, iters=4, max_logits_bytes=1)
    assert [lab.shape for lab, _ in small] == [(3, 700)] * 4
    assert torch.equal(small[2][0], segmented_kmeans(ks[2], seed=7, cluster_size=8, segment=300, iters=4)[0])


def test_lane_inputs_built_on_the_host():
    """lane_inputs.py: a batch's positions, KV slots (from each job's host block-table row, zero-padded
    to the widest), sequence lengths and budget targets, and its staging: named fields of one buffer per
    dtype whose device views hold what was uploaded."""
    from types import SimpleNamespace

    from nelssa.sparse.search import budget_targets, host_budget_targets
    from nelssa.vllm_plugin.lane_inputs import Staging, build, shapes
    jobs = [SimpleNamespace(pos=37, host_end=16, blocks=np.array([7, 9, 4], np.int32)),
            SimpleNamespace(pos=5, host_end=0, blocks=np.array([11], np.int32))]
    inp = build(jobs, 16)
    assert inp.pos.tolist() == [37, 5] and inp.seq_lens == [38, 6] and inp.host_end == [16, 0]
    assert inp.slots.tolist() == [4 * 16 + 5, 11 * 16 + 5] and inp.slots.dtype == np.int64
    assert inp.bt.tolist() == [[7, 9, 4], [11, 0, 0]] and inp.bt.dtype == np.int32
    g = torch.Generator().manual_seed(1)
    ckvs = [cluster_kv(torch.randn(2, n, 16, generator=g), torch.randn(2, n, 16, generator=g)) for n in (300, 77)]
    assert host_budget_targets(ckvs, 0.1).tolist() == budget_targets(ckvs, 0.1).tolist() == [30, 8]
    st = Staging(shapes(inp), torch.device("cpu"))
    d = st.upload(pos=inp.pos, slots=inp.slots, tok=np.arange(2), bt=inp.bt)
    assert d["pos"].tolist() == [37, 5] and d["slots"].tolist() == inp.slots.tolist()
    assert d["tok"].dtype == torch.int64 and d["bt"].dtype == torch.int32 and d["bt"].tolist() == inp.bt.tolist()
    assert d["pos"].is_contiguous() and d["bt"].is_contiguous()
    assert all(t.data_ptr() % 64 == 0 for t in d.values())  # aligned fields (Triton specialises on it)
    d2 = st.upload(pos=np.array([1, 2]), slots=inp.slots, tok=np.arange(2), bt=inp.bt)
    assert d2["pos"].tolist() == [1, 2] and d2["bt"].tolist() == inp.bt.tolist()


def test_lane_drafts_chain_check_and_drop():
    """lane_spec.py's bookkeeping (the engine tests run drafts end to end: outputs equal NELSSA_OFF's): a
    draft follows only a greedy job, one at a time per request, as far as the newest block row a step gave
    (past it the chain waits for the next step's job); the step's job of a drafted position is checked, not
    run, and another token there is a mismatch; a step's job past a stalled chain runs; drafts with
    another H than the step's are stale; a chain ends at its request's last position or a stop token."""
    from nelssa.vllm_plugin.lane import Job
    from nelssa.vllm_plugin.lane_spec import Drafts
    tok = torch.tensor([5])

    def job(rid, pos, h=32, **kw):
        return Job(rid, pos, h, tok, np.array([3, 4], np.int32), **kw)

    d = Drafts(block_size=16)
    assert d.chain(job("a", 20), torch.tensor([7]), 7) is None and not d.has("a")  # not greedy
    # no block row from a step yet: the chain waits; the step's job with a row through slot 33 resumes it
    assert d.chain(job("a", 20, greedy=True), torch.tensor([7]), 7) is None and "a" in d.stalled
    checked, a = d.accept(job("a", 20, greedy=True, alloc=np.array([3, 4, 9], np.int32)))
    assert not checked and a is not None and "a" not in d.stalled
    assert (a.pos, a.token_value, a.draft, a.host_end, a.event, a.alloc) == (21, 7, True, 32, None, None)
    assert a.blocks.tolist() == [3, 4] and a.greedy
    assert d.chain(job("a", 20, greedy=True), torch.tensor([7]), 7) is None  # one queued at a time
    d.finished(a)
    # the draft ran: the next one follows at once, as far as the row's three blocks (position 47)
    a2 = d.chain(a, torch.tensor([8]), 8)
    assert (a2.pos, a2.token_value) == (22, 8)
    d.finished(a2)
    chain = a2
    for p in range(23, 48):
        chain = d.chain(chain, torch.tensor([p]), p)
        d.finished(chain)
    assert chain.pos == 47 and chain.blocks.tolist() == [3, 4, 9]
    assert d.chain(chain, torch.tensor([1]), 1) is None and d.stalled["a"][0] is chain  # slot 48 not allocated
    # the step's jobs of drafted positions are checked, not run; the same token -> verified
    checked, nxt = d.accept(job("a", 21, greedy=True, alloc=np.array([3, 4, 9], np.int32)))
    assert checked and nxt is None and d.check(job("a", 21), 7)
    checked, nxt = d.accept(job("a", 22, greedy=True, alloc=np.array([3, 4, 9], np.int32)))
    assert checked and not d.check(job("a", 22), 99)  # another token: a mismatch (the lane fails the request)
    # a longer row resumes the stalled chain
    checked, nxt = d.accept(job("a", 23, greedy=True, alloc=np.array([3, 4, 9, 11], np.int32)))
    assert checked and nxt is not None and nxt.pos == 48 and nxt.blocks.tolist() == [3, 4, 9, 11]
    assert d.check(job("a", 5), 1)  # a position never drafted (or dropped): nothing to check
    # a step's job for the position a stalled chain could not draft runs (and ends the wait)
    b = d.chain(job("b", 40, greedy=True, alloc=np.array([3, 4], np.int32)), torch.tensor([8]), 8)  # 41: no slot
    assert b is None and "b" in d.stalled
    checked, nxt = d.accept(job("b", 41, greedy=True, alloc=np.array([3, 4, 9, 12], np.int32)))
    assert not checked and nxt is None and not d.has("b")
    # the step moved H: every draft of another H is stale (queued, drafted or stalled), not the step's own
    e = d.chain(job("e", 10, greedy=True, alloc=np.array([3], np.int32)), torch.tensor([8]), 8)
    f = d.chain(job("f", 10, greedy=True, alloc=np.array([3], np.int32)), torch.tensor([8]), 8)
    d.finished(f)
    assert e is not None and f is not None
    assert d.stale({"e": 32, "f": 64, "z": 16}) == {"f"} and d.has("e") and not d.has("f")
    # a step's job with another H than its drafted position's: dropped as stale, the job runs
    checked, _ = d.accept(job("e", 11, h=48))
    assert not checked and not d.has("e")
    # the chain ends with its request: at its last position, or at a stop token
    assert d.chain(job("g", 30, greedy=True, alloc=np.array([3, 4], np.int32), last=30), torch.tensor([1]), 1) is None
    assert d.chain(job("g", 30, greedy=True, alloc=np.array([3, 4], np.int32), stops=frozenset({2})),
                   torch.tensor([2]), 2) is None
    assert not d.has("g")
    g = d.chain(job("g", 29, greedy=True, alloc=np.array([3, 4], np.int32), last=30, stops=frozenset({2})),
                torch.tensor([1]), 1)
    assert g is not None and g.pos == 30 and (g.last, g.stops) == (30, frozenset({2}))
    d.drop({"a", "e", "f", "g"})
    assert not d.has("a") and "a" not in d.rows
    # each wait for a slot counts once ("a" at 21 and at 48, "b" at 41)
    assert d.take_counts() == {"run": 31, "verified": 1, "mismatch": 1, "stale": 2, "stalled": 3}
    assert d.take_counts() == {}
    # who drafts: greedy requests whose logits nothing changes before the argmax
    from vllm import SamplingParams

    from nelssa.vllm_plugin.lane_spec import drafts_ok
    assert drafts_ok(SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2))
    for kw in ({"temperature": 0.7}, {"repetition_penalty": 1.1}, {"presence_penalty": 0.5},
               {"frequency_penalty": 0.5}, {"logit_bias": {3: 2.0}}, {"allowed_token_ids": [1, 2]},
               {"min_tokens": 4}):
        assert not drafts_ok(SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **kw})), kw
    assert not drafts_ok(None)


def test_lane_release_keeps_a_running_jobs_request_until_it_ends():
    """lane.py, 6: a finished request is forgotten at once (queue, results, drafts), but while a job of its
    runs it is only cancelled: released (its host KV and blocks may go) once that job has ended; one with
    no job running is released at once. Preempted requests go through drop, which waits."""
    import threading

    from nelssa.node.local import HostStats
    from nelssa.vllm_plugin.lane import Job, Lane
    from nelssa.vllm_plugin.lane_spec import Drafts

    class Graphs:
        forgotten: set = set()

        def forget(self, ids):
            self.forgotten |= set(ids)

    lane = Lane.__new__(Lane)  # the bookkeeping only: no model, no thread
    lane._cv, lane._batch, lane.batch_graphs = threading.Condition(), None, Graphs()
    lane.host = type("H", (), {"stats": HostStats()})()
    lane.drafts = Drafts(block_size=16)
    lane._queue = [Job("q", 5, 32, torch.tensor([1]), np.array([3], np.int32))]
    lane._ready, lane._reported = {"a": {7: torch.zeros(3)}, "q": {5: torch.zeros(3)}}, {"a": 7}
    lane._awaiting, lane._checks, lane._cancel = {"q"}, [], set()
    lane._running, lane._releasing, lane._released = {"a"}, set(), set()
    lane.release({"a", "q"})
    assert lane._queue == [] and "a" not in lane._ready and "q" not in lane._ready and not lane._awaiting
    assert lane._cancel == {"a"} and lane.take_released() == {"q"}  # q had no job running
    assert lane.batch_graphs.forgotten == {"q"} and lane.take_released() == set()
    with lane._cv:  # the batch ends (lane._loop)
        lane._running = set()
        lane._settle()
    assert lane._cancel == set() and lane.take_released() == {"a"} and lane.batch_graphs.forgotten == {"q", "a"}
    assert lane.host.stats.totals.get("lane_finish_cancels") == 1


def test_lane_runs_a_function_on_its_thread():
    """Lane._on_thread (Lane.warm's cuBLAS handles, which are per thread): the function runs on the lane's own
    thread between batches, the caller waits for it and gets its exception; a lane thread that does not run
    it in time is an error, not a hang of the engine's start."""
    import threading

    from nelssa.vllm_plugin.lane import Lane

    lane = Lane.__new__(Lane)  # the loop's bookkeeping only: no model
    lane._cv, lane._queue, lane._calls, lane._checks = threading.Condition(), [], [], []
    lane._check_drafts = lambda: None
    lane._thread = threading.Thread(target=lane._loop, name="nelssa-lane", daemon=True)
    lane._thread.start()
    ran = []
    lane._on_thread(lambda: ran.append(threading.current_thread().name))
    lane._on_thread(lambda: ran.append(threading.current_thread().name))  # again, after the loop went back to waiting
    assert ran == ["nelssa-lane", "nelssa-lane"]

    def fails():
        raise ValueError("no handle")
    with pytest.raises(ValueError, match="no handle"):
        lane._on_thread(fails)

    idle = Lane.__new__(Lane)  # a lane whose thread is gone
    idle._cv, idle._calls = threading.Condition(), []
    idle._thread = threading.Thread(target=lambda: None)
    idle._thread.start()
    idle._thread.join()
    with pytest.raises(RuntimeError, match="did not run .* within 0 s .alive: False"):
        idle._on_thread(lambda: None, timeout_s=0.2)


def test_cpu_step_builds_its_attention_metadata_while_the_lane_waits():
    """lane.py 5: vLLM's CPU attention builder reallocates the process's one kernel scratchpad, which the lane's
    oneDNN linears write while they run (CI: heap corruption); the runner builds a step's attention metadata
    under the lane's dense lock, so no lane thread can enter its dense parts meanwhile. CUDA and an engine
    without the lane build it as vLLM does."""
    import contextlib
    import threading
    from types import SimpleNamespace

    from nelssa.vllm_plugin.runner import NelssaRunnerMixin

    class Base:  # vLLM's runner: the build, with what another thread (the lane) can take meanwhile
        def _build_attention_metadata(self, *args, **kwargs):
            got = []

            def lane():
                got.append(self.lock.acquire(blocking=False))
                if got[0]:
                    self.lock.release()
            t = threading.Thread(target=lane)
            t.start()
            t.join()
            return args, kwargs, got[0]

    class Runner(NelssaRunnerMixin, Base):
        pass

    r = Runner.__new__(Runner)
    r.lock = threading.RLock()
    r.nelssa_lane = SimpleNamespace(dense_lock=r.lock)  # the CPU lane's lock
    assert r._build_attention_metadata(1, x=2) == ((1,), {"x": 2}, False)  # the lane waits
    assert r.lock.acquire(blocking=False)  # and gets it back after the build
    r.lock.release()
    r.nelssa_lane = SimpleNamespace(dense_lock=contextlib.nullcontext())  # CUDA's lane: no lock (Lane.dense_lock)
    assert r._build_attention_metadata()[2] is True
    r.nelssa_lane = None
    assert r._build_attention_metadata()[2] is True


def test_lane_batch_graph_keys_windows_and_forget():
    """lane_batch.py's bookkeeping (its capture and replay need CUDA: the H200 exactness check runs them):
    the key changes exactly when a request's clusters are replaced (a commit), the window table is the
    sink blocks then the blocks from H with the lengths FlashAttention reads, a window past the capacity
    or a sink of partial blocks runs enqueued, and forgetting a request drops its graphs — at once, or
    at the end of the lane's current run when that holds the graphs (the step thread never waits)."""
    from types import SimpleNamespace

    from nelssa.config import NelssaConfig
    from nelssa.vllm_plugin.attention import StepPlan
    from nelssa.vllm_plugin.lane_batch import BatchGraphs
    from nelssa.vllm_plugin.lane_inputs import LaneInputs
    g = torch.Generator().manual_seed(0)

    def ckv(n):
        return cluster_kv(torch.randn(2, n, 16, generator=g), torch.randn(2, n, 16, generator=g))

    kv = {(r, li): ckv(300 + 50 * li) for r in ("a", "b") for li in range(2)}
    host = SimpleNamespace(layer_kv=lambda r, li: kv[(r, li)])
    bg = BatchGraphs(None, [None, None], [None, None], NelssaConfig(sink=16, recent=64, chunk=128, budget=0.1), 16)
    k1 = bg._key(host, ("a", "b"))
    assert bg._key(host, ("a", "b")) == k1 and bg._key(host, ("b", "a")) != k1
    old = kv[("b", 1)]  # alive, as a graph's host calls keep it
    kv[("b", 1)] = ckv(400)  # a commit replaced b's clusters of layer 1
    assert bg._key(host, ("a", "b")) != k1 and old is not None

    bt = np.arange(60, dtype=np.int32).reshape(2, 30)

    def inp(table, host_end, seq_lens):
        n = len(host_end)
        return LaneInputs(n, np.zeros(n, np.int64), np.zeros(n, np.int64), host_end, seq_lens, table)

    win, lens = inp(bt, [64, 96], [64 + 70, 96 + 20]).window(16, bg.cap, 16)
    assert bg.cap == 21 and win.shape == (2, 1 + 21) and win.dtype == np.int32
    assert win[:, 0].tolist() == [0, 30]                     # the sink's block
    assert win[:, 1].tolist() == [4, 36] and win[0, 5] == 8   # then the blocks from H on
    assert win[1, -1] == 30 + 6 + 20
    narrow, _ = inp(bt[:, :12], [64, 96], [64 + 70, 96 + 20]).window(16, bg.cap, 16)
    assert narrow[1, -1] == 30 + 11                          # past the table: its last block (not read)
    assert lens.tolist() == [16 + 70, 16 + 20] and lens.dtype == np.int32
    assert inp(bt[:1], [64], [64 + 21 * 16 + 1]).window(16, bg.cap, 16) is None
    assert inp(bt[:1], [64], [80]).window(8, bg.cap, 16) is None  # a sink of partial blocks
    # an engine's sink is whole blocks (vllm_nelssa_config): the default 16 on 64-token blocks gets a window
    assert inp(bt[:1], [128], [128 + 30]).window(16, bg.cap, 64) is None
    win64, len64 = inp(bt[:1], [128], [128 + 30]).window(vllm_nelssa_config({"nelssa": {}}, 64).sink, bg.cap, 64)
    assert win64[0, :2].tolist() == [0, 2] and len64.tolist() == [64 + 30]
    plan = StepPlan(host, ["a", "b"], [0, 1], torch.arange(2), [64, 96], [64 + 70, 96 + 20])

    bg._graphs.update({("a", "b"): "g1", ("c",): "g2"})
    bg._seen[("a",)] = k1
    bg.forget(["a"])
    assert list(bg._graphs) == [("c",)] and not bg._seen
    bg._graphs[("b",)] = "g3"
    inside = []

    def lane_run(*args):  # the step thread forgets "b" while the lane thread is in run()
        bg.forget(["b"])
        inside.append(("b",) in bg._graphs)

    bg._run = lane_run
    assert bg.run(None, plan, None, None) is None
    assert inside == [True] and list(bg._graphs) == [("c",)]


def test_lane_batch_captures_a_new_set_at_once_after_a_steady_one():
    """lane_batch.py 2: a request set seen for the first time runs enqueued and is captured the second
    time, except right after a replay (a steady lane): then the new set (a request joined or left, a
    commit replaced its tables) is captured at once; so is a set after the lane idled, and the lane's first
    set once the host calls' flags were made at start (else the process's first batch runs enqueued: it
    makes them, outside a capture). A set with a
    request about to end runs enqueued and counts as steady. (The capture itself
    needs CUDA; here it is a stand-in that records what was asked.)"""
    from types import SimpleNamespace

    from nelssa.config import NelssaConfig
    from nelssa.vllm_plugin.attention import StepPlan
    from nelssa.vllm_plugin.lane_batch import ENDING, IDLE_S, BatchGraphs, decide
    from nelssa.vllm_plugin.lane_inputs import LaneInputs
    # the rule alone: (previous batch's path, key seen last time, idle seconds, positions left)
    assert decide("", False, None, -1) == "new_key"                 # the process's first batch (makes its flags)
    assert decide("", False, math.inf, -1) == "capture"             # the first with the flags made at start
    assert decide("new_key", False, 0.01, -1) == "new_key"          # in flux
    assert decide("new_key", True, 0.01, -1) == "capture"           # seen twice in a row
    assert decide("captured", False, IDLE_S, -1) == "capture"       # after an idle lane
    assert decide("replay", False, 0.0, -1) == decide("ending", False, 0.0, 9) == "capture"
    assert decide("replay", True, None, ENDING - 1) == "ending"     # about to end: never captured
    g = torch.Generator().manual_seed(1)
    kv = {(r, li): cluster_kv(torch.randn(2, 300, 16, generator=g), torch.randn(2, 300, 16, generator=g))
          for r in "abc" for li in range(2)}
    host = SimpleNamespace(layer_kv=lambda r, li: kv[(r, li)])
    captured = []

    def graphs(flags_made=False, fail=False):  # BatchGraphs with a stand-in capture (recorded, or failing: 6)
        b = BatchGraphs(None, [None, None], [None, None], NelssaConfig(sink=16, recent=64, chunk=128, budget=0.1), 16)
        b.flags_made = flags_made  # as Lane.warm sets it, the flags made at engine start

        def capture(lane, plan, rs, key, inp, ids, win):
            captured.append(rs)
            if fail:
                b._capture_failed(rs, key)
                return None
            gr = SimpleNamespace(key=key, size=SimpleNamespace(out=torch.zeros(1)),
                                 end=SimpleNamespace(record=lambda s: None),
                                 batch=SimpleNamespace(flag=SimpleNamespace(clear=lambda: None), calls=[]),
                                 graph=SimpleNamespace(replay=lambda: None))
            b._graphs[rs] = gr
            return gr
        b._capture, b._inputs = capture, lambda *a: None
        return b
    bg = graphs()
    lane = SimpleNamespace(stream=None)

    def batch(rs, left=-1, on=None):
        b, n = on or bg, len(rs)
        inp = LaneInputs(n, np.zeros(n, np.int64), np.zeros(n, np.int64), [64] * n, [100] * n,
                         np.arange(30 * n, dtype=np.int32).reshape(n, 30))
        b.run(lane, StepPlan(host, list(rs), list(range(n)), torch.arange(n), [64] * n, [100] * n), inp, None,
              left)
        b.ended()  # as the lane does after every batch
        return b.path
    assert [batch(("a",)) for _ in range(3)] == ["new_key", "captured", "replay"]  # the first set: enqueued
    assert batch(("a", "b")) == "captured"              # after a replay: at once
    assert [batch(("a", "c")), batch(("b",))] == ["new_key", "new_key"]  # in flux: enqueued first
    bg._ended -= IDLE_S                                 # the lane idled
    assert batch(("b",)) == "captured"                  # its set is no set in flux
    bg.forget(["a", "b", "c"])
    bg.path = "new_key"                                 # as after a set in flux
    assert [batch(("c",)), batch(("b", "c"))] == ["new_key", "new_key"]   # in flux: enqueued first
    assert [batch(("b", "c")), batch(("b", "c"))] == ["captured", "replay"]
    kv[("b", 0)] = cluster_kv(torch.randn(2, 310, 16, generator=g), torch.randn(2, 310, 16, generator=g))
    assert batch(("b", "c")) == "captured"              # a commit replaced b's tables in a steady set
    assert captured == [("a",), ("a", "b"), ("b",), ("b", "c"), ("b", "c")]
    # a set whose request ends within ENDING positions is not captured; the set after it is, at once
    assert [batch(("b", "c"), left=5), batch(("a", "c"), left=3), batch(("a", "c"), left=0)] == \
        ["replay", "ending", "ending"]                  # a graph already there still replays
    assert batch(("c",)) == "captured"                  # seen once only, but after an ending set: at once
    assert captured[-1] == ("c",) and ("a", "c") not in bg._graphs
    # with the host calls' flags made at start, the lane's first set is captured at once
    first = graphs(flags_made=True)
    assert [batch(("a",), on=first), batch(("a",), on=first)] == ["captured", "replay"]
    # a capture at once that fails (6): the set runs enqueued, is captured again after that, and only a second
    # failure makes it run enqueued for good
    del captured[:]
    failing = graphs(flags_made=True, fail=True)
    assert [batch(("a",), on=failing) for _ in range(4)] == ["capture_failed", "capture_failed", "broken", "broken"]
    assert captured == [("a",), ("a",)] and failing.failures == 2


def test_stall_watchdog_logs_every_thread_once_per_stall(caplog):
    """watchdog.py: no step for longer than the limit while busy logs, once, every thread's stack (here
    the test's own thread, in this function), and the next beat logs the stall's end; an idle engine
    (last beat not busy) logs nothing."""
    import logging
    import time

    from nelssa.vllm_plugin.watchdog import Watchdog
    caplog.set_level(logging.INFO, logger="vllm.nelssa")
    w = Watchdog(40)
    w.beat(False)
    time.sleep(0.15)
    assert not [r for r in caplog.records if "watchdog" in r.getMessage()]
    w.beat(True)
    time.sleep(0.25)
    stalls = [r.getMessage() for r in caplog.records if "no step for" in r.getMessage()]
    assert len(stalls) == 1 and "test_stall_watchdog_logs_every_thread_once_per_stall" in stalls[0], stalls
    assert "[step thread]" in stalls[0]
    w.beat(True)
    assert any("stepped again after" in r.getMessage() for r in caplog.records)


def test_lane_pinned_buffers_shared_by_shape_with_headroom():
    """lane_host.Buffers: one buffer per (kind, layer, dtype) for every shape, allocated with room for 4x
    its first need (a 2-row set after a 1-row one allocates nothing), growing by doubling; a view handed
    out before a growth keeps its memory (a captured graph reads it by address)."""
    from nelssa.vllm_plugin.lane_host import Buffers
    b = Buffers(pin=False)
    ids1, dev = b.get("ids", 0, (1, 8, 512), torch.long)
    assert ids1.shape == (1, 8, 512) and ids1.is_contiguous() and dev is None and b.allocations == 1
    ids1.fill_(7)
    ids2, _ = b.get("ids", 0, (2, 8, 512), torch.long)  # the same memory, from its start
    assert b.allocations == 1 and ids2.data_ptr() == ids1.data_ptr() and bool((ids2[0] == 7).all())
    assert b.get("ids", 1, (1, 8, 512), torch.long)[0].data_ptr() != ids1.data_ptr()  # per layer
    assert b.get("ids", 0, (1, 8), torch.int32)[0].data_ptr() != ids1.data_ptr()      # per dtype
    assert b.allocations == 3
    big, _ = b.get("ids", 0, (4, 8, 1024), torch.long)  # 2x the room: a new buffer
    assert b.allocations == 4 and big.data_ptr() != ids1.data_ptr() and big.shape == (4, 8, 1024)
    assert bool((ids1 == 7).all())  # the old view still holds its memory
    assert b.get("ids", 0, (2, 8, 1024), torch.long)[0].data_ptr() == big.data_ptr() and b.allocations == 4


def test_lane_pinned_buffers_reserved_at_start():
    """Buffers.reserve_for (Lane.warm): every layer's five buffers for the warmed batch size at the model's
    id width, so batches within it allocate nothing while serving; a width over RESERVE_LIMIT is halved
    until it fits (wider selections then grow as before); a second reservation allocates nothing."""
    from nelssa.vllm_plugin.lane_host import Buffers
    b = Buffers(pin=False)
    layers, rows, hq, h, d = [0, 1, 2], 4, 32, 8, 128
    nbytes = b.reserve_for(layers, rows, hq, h, d, torch.bfloat16, 8192)
    per_layer = rows * h * 8192 * 8 + rows * h * 8 + rows * hq * d * (2 + 4) + rows * hq * 4
    assert nbytes == len(layers) * per_layer and b.allocations == 5 * len(layers)
    for li in layers:  # what the eager batch and a capture ask for (lane_host.attend, prepare_capture)
        for n in (1, 2, 4):
            b.get("ids", li, (n, h, 8192), torch.long), b.get("cnt", li, (n, h), torch.long)
            b.get("q", li, (n, hq, d), torch.bfloat16), b.get("out", li, (n, hq, d), torch.float32)
            b.get("lse", li, (n, hq), torch.float32)
    assert b.allocations == 5 * len(layers)
    assert b.reserve_for(layers, rows, hq, h, d, torch.bfloat16, 8192) == nbytes and b.allocations == 5 * len(layers)
    small = Buffers(pin=False)
    small.RESERVE_LIMIT = 4 << 20
    got = small.reserve_for(list(range(32)), rows, hq, h, d, torch.bfloat16, 1 << 14)
    assert got <= small.RESERVE_LIMIT < 2 * got  # the widest power of two that fits
    small.get("ids", 0, (rows, h, 1 << 14), torch.long)  # wider than reserved: grows
    assert small.allocations == 5 * 32 + 1


def test_lane_batch_timeline_from_the_calls_stamps():
    """lane_host.timeline (7): real host calls run with device work between them (here: sleeps) split the
    batch's wall time exactly into lead, host, between and tail; the host part is the calls' own kernel
    time and the between part at least the time slept between them; a call that did not run (cancelled)
    leaves no timeline rather than a wrong one."""
    import time

    import nelssa._C as C
    from nelssa.sparse import prepare_attend
    from nelssa.vllm_plugin.lane_host import timeline
    g = torch.Generator().manual_seed(3)
    ckvs = [cluster_kv(torch.randn(2, n, 32, generator=g).bfloat16(), torch.randn(2, n, 32, generator=g).bfloat16())
            for n in (900, 400)]
    q = torch.randn(2, 4, 32, generator=g).bfloat16()
    sel = select_clusters(q, ckvs, 0.25)
    calls = [prepare_attend(q, ckvs, sel, 32 ** -0.5, torch.empty(2, 4, 32), torch.empty(2, 4)) for _ in range(3)]
    launched = time.perf_counter()
    time.sleep(0.01)
    for i, c in enumerate(calls):
        if i:
            time.sleep(0.02)
        c.run()
    time.sleep(0.005)
    waited = time.perf_counter()
    t = timeline(calls, launched, waited)
    assert set(t) == {"lead", "host", "between", "tail"}
    assert t["lead"] >= 0.01 and t["between"] >= 0.04 and t["tail"] >= 0.005
    assert t["host"] == pytest.approx(sum(c.seconds for c in calls), rel=1e-6, abs=1e-7) and t["host"] > 0
    assert sum(t.values()) == pytest.approx(waited - launched, abs=1e-6)
    flag = C.CancelFlag()
    late = prepare_attend(q, ckvs, sel, 32 ** -0.5, torch.empty(2, 4, 32), torch.empty(2, 4), cancel=flag)
    assert timeline(calls + [late], launched, waited) is None  # not run yet
    c = calls[0]
    c.rearm()  # a replay re-arms its calls: their stamps are the next run's
    assert (c.started, c.ended) == (0.0, 0.0) and timeline(calls, launched, waited) is None


def test_thread_clock_tells_running_from_blocked():
    """handoff.thread_clock: a busy loop counts as CPU time, a sleep as neither CPU nor runqueue time."""
    import time as _t
    from nelssa.vllm_plugin.handoff import thread_clock
    a = thread_clock()
    end = _t.perf_counter() + 0.05
    while _t.perf_counter() < end:
        pass
    b = thread_clock()
    _t.sleep(0.05)
    c = thread_clock()
    assert b[1] - a[1] >= 0.025 and b[0] - a[0] >= 0.05
    assert c[0] - b[0] >= 0.05 and c[1] - b[1] < 0.01
    if a[2] is not None:  # Linux: runqueue time is never more than the wall time
        assert 0 <= c[2] - a[2] <= c[0] - a[0]


def test_handoff_bench_moves_every_token(tmp_path):
    """benchmarks/bench_handoff.py on a tiny CPU shape: the real Handoff moves each context to the host
    tier (the bench checks the committed length itself), steps beside the move are recorded and the
    plot is drawn."""
    import json
    import runpy
    import sys
    argv, switch = sys.argv, sys.getswitchinterval()
    sys.argv = ["bench_handoff.py", "--out", str(tmp_path), "--contexts", "600,600,1200", "--layers", "2",
                "--kv-heads", "2", "--head-dim", "64", "--dtype", "float32", "--step-gb", "0.001",
                "--idle-steps", "5", "--device", "cpu", "--prefill", "2500", "--segment", "512"]
    from nelssa.config import get_config, set_config
    cfg = get_config()
    try:
        runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_handoff.py"),
                       run_name="__main__")
    finally:
        sys.argv = argv
        sys.setswitchinterval(switch)  # the bench sets the engine's
        set_config(cfg)  # and its segment
    d = json.loads((tmp_path / "handoff.json").read_text())
    p = d["prefill"]  # 2,500 tokens in moves of the 512-token segment, by one thread and with the stage ahead
    assert p["moves"] == 5 and p["segment"] == 512 and p["serial_s"] > 0 and p["ahead_s"] > 0 and p["same_parts"]
    assert p["serial_steps_during"]["n"] >= 3 and p["ahead_steps_during"]["n"] >= 3
    assert [r["context"] for r in d["contexts"]] == [600, 600, 1200]  # a repeated context is its own move
    for r in d["contexts"]:
        assert r["move_s"] > 0 and r["steps_during"]["n"] >= 3 and r["worst_steps"]
        assert r["bytes"] == 2 * 2 * 2 * 64 * (r["context"] - d["shape"]["sink"]) * 4
        th = r["move_thread_s"]  # the move's time by its thread's state, within the submit-to-done time
        assert set(th) == {"cpu", "runq", "blocked"} and th["cpu"] > 0 and sum(th.values()) <= r["move_s"] * 1.05, th
    assert os.path.getsize(tmp_path / "handoff.png") > 5_000
    from nelssa.bench.report import main as report
    assert report([str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "## Hand-off time vs context (cpu)" in md and "| 1,200 |" in md and "![hand-off](handoff.png)" in md
    assert "store alone s (parts in new mappings)" in md and "host memory reserved 0.0 GiB" in md
    assert "A 2,500-token prompt's hand-off, its 5 moves of 512 tokens" in md and "| one thread |" in md
    assert "the two stores equal" in md


def test_host_call_bench_paced_on_cpu(tmp_path):
    """benchmarks/bench_host_call.py without CUDA: only the paced cases, each with its kernel's time by
    part (HostCall.kernel_split); an empty selection does no item work."""
    if torch.cuda.is_available():
        pytest.skip("the CPU-only form of the bench")
    import json
    import runpy
    import sys
    argv = sys.argv
    sys.argv = ["bench_host_call.py", "--out", str(tmp_path), "--length", "1024", "--batch", "2", "--calls", "20",
                "--gap-us", "100"]
    try:
        runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_host_call.py"),
                       run_name="__main__")
    finally:
        sys.argv = argv
    (f,) = tmp_path.glob("host_call_*.json")
    d = json.loads(f.read_text())
    assert d["device"] == "cpu" and "real" not in d and set(d["paced"]) == {"real", "empty", "real_back_to_back"}
    for case, r in d["paced"].items():
        assert r["median_ms"] > 0 and set(r["split_us"]) == {"prep", "fork", "tables", "items", "wait", "combine"}
        assert (r["split_us"]["items"] > 0) == (case != "empty"), (case, r)


def _handoff(device, blocks: int, ahead: bool | None = None, layers=None):
    """A Handoff over two fake layers of a paged cache of ``blocks`` blocks (FlashAttention's layout; or over
    ``layers``), an in-process host tier -> (cfg, handoff, host, layers, (KH, D, block size))."""
    from types import SimpleNamespace

    from nelssa.config import get_config
    from nelssa.node.local import LocalHostTier
    from nelssa.vllm_plugin.attention import read_kv
    from nelssa.vllm_plugin.handoff import Handoff

    cfg, L, KH, D, bs = get_config(), 2, 2, 64, 16
    layers = layers or [SimpleNamespace(kv_cache=torch.randn(blocks, KH, bs, 2 * D, device=device),
                                        impl=SimpleNamespace(nelssa_kv_layout="flash"), num_kv_heads=KH, head_size=D)
                        for _ in range(L)]
    host = LocalHostTier(cfg, num_layers=L)
    return cfg, Handoff(host, layers, bs, cfg.sink, read_kv, ahead=ahead), host, layers, (KH, D, bs)


def _host_parts(host, rid: str) -> list:
    """Every layer's committed host KV of ``rid``: per part its packed rows, and the cluster tables, perm,
    centroids and sizes."""
    out = []
    for ckv in host.reqs[rid].layers:
        out += [p.kv for p in ckv.parts]
        out += [ckv.cstart, ckv.csize, ckv.cpart, ckv.perm, ckv.centroids.cpu(), ckv.sizes.cpu(), ckv.vmeans.cpu()]
    return out


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_handoff_ahead_stores_what_one_thread_stores(device, monkeypatch, caplog):
    """Handoff with ``ahead`` (handoff.py, 1): a request's back-to-back moves are read and clustered on the
    ahead thread while the one before packs, reported in order, and the host tier holds exactly what the
    one-thread hand-off stores from the same blocks (the k-means made ahead is the same part's). A request
    whose host tier held a part already (the predicted part index is wrong) is clustered again there, and
    stored as one thread stores it; so is a request after a failed move's (its moves skipped, the
    semaphore of moves ahead not leaked: later moves of others still run)."""
    import logging
    import threading

    import nelssa.node.local as local_tier
    import nelssa.vllm_plugin.handoff as handoff_mod
    from nelssa.sparse.clustered import cluster_part
    made, used = [], []  # (thread, part) of each k-means made ahead; (part, the ahead one's) of each store

    def ahead_spy(keys, cfg, part, ahead=None):
        made.append((threading.current_thread().name.rsplit("_", 1)[0], part))
        return cluster_part(keys, cfg, part, ahead)

    def store_spy(keys, cfg, part, ahead=None):
        used.append((part, None if ahead is None else ahead[0]))
        return cluster_part(keys, cfg, part, ahead)

    monkeypatch.setattr(handoff_mod, "cluster_part", ahead_spy)
    monkeypatch.setattr(local_tier, "cluster_part", store_spy)
    caplog.set_level(logging.INFO, logger="vllm.nelssa")
    cfg, one, host1, layers, (KH, D, bs) = _handoff(device, 200, ahead=False)
    _, two, host2, _, _ = _handoff(device, 200, ahead=True, layers=layers)
    ranges = [(cfg.sink, 640), (640, 1280), (1280, 1920), (1920, 2400), (2400, 3000)]
    blocks = list(range(-(-3000 // bs)))
    try:
        for hand, host in ((one, host1), (two, host2)):
            seen = []
            hand._on_done = lambda rid, hi, gen, seen=seen: seen.append((rid, hi))
            hand.submit([("r", blocks, lo, hi) for lo, hi in ranges])
            hand.wait_all()
            assert seen == [("r", hi) for _, hi in ranges]  # in order, every one
            hand.ready("r", ranges[-1][1])
            assert host.committed("r") == ranges[-1][1] - cfg.sink
        assert made == [("nelssa-cluster", i) for i in range(len(ranges))]  # the ahead thread's, two's only
        assert used == [(i, None) for i in range(len(ranges))] + [(i, i) for i in range(len(ranges))]
        for a, b in zip(_host_parts(host1, "r"), _host_parts(host2, "r"), strict=True):
            assert torch.equal(a, b)
        # a request with a part in the host tier before its first move: part 1, not the predicted 0
        ks = [torch.randn(KH, 64, D, device=device) for _ in layers]
        for host in (host1, host2):
            host.put_layers("q", ks, ks, commit=True, ahead=(0, *cluster_part(ks, cfg, 0)))
        for hand in (one, two):
            hand.submit([("q", blocks, cfg.sink, 640)])
            hand.wait_all()
            hand.ready("q", 640 + 64)  # (its first part's 64 tokens, then the move's)
        for a, b in zip(_host_parts(host1, "q"), _host_parts(host2, "q"), strict=True):
            assert torch.equal(a, b)
        assert used[-1] == (1, 0) and "clustered ahead as part 0 is part 1 of its request" in caplog.text
        # a failed move: its later moves skipped, none reported, the moves ahead given back
        seen = []
        two._on_done = lambda rid, hi, gen: seen.append((rid, hi))
        real = host2.put_layers

        def failing(rid, *args, **kw):
            if rid == "f":
                raise RuntimeError("host tier full (test)")
            return real(rid, *args, **kw)

        host2.put_layers = failing
        two.submit([("f", blocks, lo, hi) for lo, hi in ranges])
        two.wait_all()
        assert seen == [] and host2.stats.totals.get("handoff_failures", 0) >= 1
        two.submit([("g", blocks, lo, hi) for lo, hi in ranges])
        done = threading.Thread(target=two.wait_all, daemon=True)
        done.start()
        done.join(60)
        assert not done.is_alive(), "moves after a failed request's hang: the moves-ahead semaphore leaked"
        assert seen == [("g", hi) for _, hi in ranges]
    finally:
        one.close()
        two.close()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_handoff_warm_stores_nothing(device):
    """Handoff.warm runs a move's work (read, k-means of every layer, packing) on the hand-off thread
    and leaves the host tier and its counters as they were; a move after it is stored as usual."""
    cfg, hand, host, _, _ = _handoff(device, 64)
    try:
        assert hand.warm(0) == 0.0
        assert hand.warm(700) > 0
        assert not host.reqs and host.stats.long_requests == 0 and host.stats.moved_tokens == 0
        assert hand.in_flight() == 0
        hand.submit([("r", list(range(40)), cfg.sink, 640)])
        hand.wait_all()
        assert hand.in_flight() == 0  # done, not yet taken by ready: not in flight (the step log's count)
        hand.ready("r", 640)
        assert host.committed("r") == 640 - cfg.sink
    finally:
        hand.close()


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_handoff_load_writes_back_what_it_moved(device):
    """A recall's load (recall.py, 2; Handoff.load): tokens moved to the host tier from some blocks come
    back, every layer, into other blocks at the same positions, exactly; on CUDA on the side stream, after
    the main stream's work so far (a write queued there before the load lands first, then the load's)."""
    from nelssa.vllm_plugin.attention import read_kv
    cfg, hand, host, layers, (KH, D, bs) = _handoff(device, 96)
    hi = 650
    first, last = -(-cfg.sink // bs), hi // bs  # the blocks a host range [sink, hi) frees (policy.freed_blocks)
    old = list(range(41))
    new = old[:first] + list(range(50, 50 + last - first)) + old[last:]  # new blocks where those were
    try:
        hand.submit([("r", old, cfg.sink, hi)])
        hand.wait_all()
        hand.ready("r", hi)
        lo, top = first * bs, last * bs
        pos = torch.arange(lo, top, device=device)
        want = [read_kv(x.kv_cache, "flash", torch.tensor(old, device=device)[pos // bs], pos % bs, KH, D)
                for x in layers]
        for x in layers:  # the main stream's last write to the new blocks, before the load
            x.kv_cache[50:50 + last - first].fill_(7.0)
        secs = hand.load("r", new, lo, top).result()
        got = [read_kv(x.kv_cache, "flash", torch.tensor(new, device=device)[pos // bs], pos % bs, KH, D)
               for x in layers]
        assert secs > 0 and host.stats.recalled_tokens == top - lo
        for (wk, wv), (gk, gv) in zip(want, got):
            assert torch.equal(wk, gk) and torch.equal(wv, gv)
        hand.drop("r", recalled=True)  # nothing left to wait for; its generation kept
        assert hand.end("r") == cfg.sink
    finally:
        hand.close()


def test_nelssa_stats_aggregate_counts_each_part_once():
    """Steps report per-part sums with different parts (e.g. lane drafts run in one step, verified in
    the next): aggregating adds each part once, lists concatenate, byte gauges keep the latest."""
    from nelssa.vllm_plugin.connector import NelssaStats
    a = NelssaStats({"lane_drafts": {"run": 2.0}, "attn_s": [0.1], "moved_tokens": 5, "host_bytes": 10})
    b = NelssaStats({"lane_drafts": {"verified": 1.0, "run": 1.0}, "attn_s": [0.2], "moved_tokens": 3,
                     "host_bytes": 7})
    c = NelssaStats({"lane_drafts": {"stale": 4.0}})
    m = a.aggregate(b).aggregate(c)
    assert m.data["lane_drafts"] == {"run": 3.0, "verified": 1.0, "stale": 4.0}
    assert m.data["attn_s"] == [0.1, 0.2] and m.data["moved_tokens"] == 8 and m.data["host_bytes"] == 7
    r = m.reduce()
    assert r["lane_drafts_run"] == 3.0 and r["attn_s_count"] == 2 and abs(r["attn_s_mean_ms"] - 150.0) < 1e-9
    assert a.data["lane_drafts"] == {"run": 2.0}  # aggregate leaves its inputs alone


def _nelssa_kv_manager(num_blocks: int, max_len: int, caching: bool = False):
    """vLLM's own KVCacheManager over one NelssaSpec group (blocks of 16 tokens, 2 KV heads of 64, fp32,
    T_input 256, sink 16, recent 64, chunk 128) -> (spec, the manager, its NelssaManager)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    from nelssa.vllm_plugin.spec import NelssaManager, NelssaSpec, register_spec
    register_spec()
    bs = 16
    spec = NelssaSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.float32, T_input=256, sink=16,
                      recent=64, chunk=128)
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    kvm = KVCacheManager(cfg, max_model_len=max_len, scheduler_block_size=bs, hash_block_size=bs,
                         enable_caching=caching)
    (mgr,) = kvm.coordinator.single_type_managers
    assert isinstance(mgr, NelssaManager)
    return spec, kvm, mgr


def test_window_admission_allocates_the_window_only():
    """A hand-over admitted with its window (handover.py, 6) through vLLM's own KVCacheManager: the async
    NIXL load of the prompt's tokens (NixlConnector loads all of them; vLLM recomputes the last) gets real blocks for the sink's and the window's positions and the null
    block for [sink, H0) — the pool loses only the window's blocks, admission asks only for them — and
    the blocks NIXL pairs with P's (non-null, in order) are the positions left in P's filtered list; the
    step after the load adds the last token's block; freeing gives every block back."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    bs = 16
    spec, kvm, mgr = _nelssa_kv_manager(num_blocks=64, max_len=2048, caching=True)
    pol, n = spec.policy(), 600
    h0 = pol.goal(n, n)
    first, last = pol.freed_blocks(h0)
    assert (h0, first, last) == (528, 1, 33)
    free0 = kvm.block_pool.get_num_free_blocks()
    whole = -(-n // bs)  # 38 blocks: more than half of this pool
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    init_none_hash(sha256)
    hasher = get_request_block_hasher(bs, sha256)
    req = Request("r", list(range(n)), SamplingParams(max_tokens=8), None, block_hasher=hasher)
    req.skip_reading_prefix_cache = True  # as NelssaScheduler._admit_window sets it
    mgr.window_ends["r"] = h0
    got = kvm.allocate_slots(req, 0, num_external_computed_tokens=n, delay_cache_blocks=True)
    assert got is not None
    (blocks,) = kvm.get_blocks("r").blocks
    assert len(blocks) == whole and all(b.is_null for b in blocks[first:last])
    assert not any(b.is_null for b in blocks[:first] + blocks[last:])
    spared = last - first
    assert free0 - kvm.block_pool.get_num_free_blocks() == whole - spared == 6
    # what NixlConnector pairs: this instance's non-null unhashed blocks with P's list less [first, last)
    local = kvm.get_blocks("r").get_unhashed_block_ids_all_groups()[0]
    remote = [1000 + i for i in range(whole)]
    filtered = remote[:first] + remote[last:]
    assert len(local) == len(filtered) and filtered[first:] == [1000 + i for i in range(last, whole)]
    # loaded: the step computing the last prompt token (and a lookahead slot) allocates past the window
    req.num_computed_tokens = n - 1
    assert kvm.allocate_slots(req, 1, num_lookahead_tokens=1) is not None
    assert len(kvm.get_blocks("r").blocks[0]) == -(-(n + 1) // bs)
    # H0 in use: the manager frees nothing more (the range is null already) and keeps the window
    mgr.host_ends["r"] = h0
    req.num_computed_tokens = n
    before = kvm.block_pool.get_num_free_blocks()
    assert kvm.allocate_slots(req, 1, num_lookahead_tokens=1) is not None
    assert kvm.block_pool.get_num_free_blocks() == before
    kvm.free(req)
    assert kvm.block_pool.get_num_free_blocks() == free0
    # without a window admission: the whole prompt's blocks, as stock
    req2 = Request("s", list(range(n)), SamplingParams(max_tokens=8), None, block_hasher=hasher)
    assert kvm.allocate_slots(req2, 0, num_external_computed_tokens=n, delay_cache_blocks=True) is not None
    assert free0 - kvm.block_pool.get_num_free_blocks() == whole


def test_lane_requests_get_a_block_of_slots_past_the_lookahead():
    """spec.NelssaManager.ahead through vLLM's own KVCacheManager: a request with its host range in use gets
    slots ``ahead`` tokens past vLLM's lookahead (the lane's drafts run in allocated slots only, lane_spec.py
    2), never past the model's length (the worker's block table is that wide); a request on the device gets
    what vLLM asks, and the free-block check counts the extra block (an allocation that cannot have it
    fails as a whole)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    bs, max_len = 16, 640
    spec, kvm, mgr = _nelssa_kv_manager(num_blocks=96, max_len=max_len)
    mgr.ahead, mgr.max_len = bs, max_len

    def decode(rid, n):  # a request with n tokens computed, scheduled for its next one (lookahead 2)
        req = Request(rid, list(range(n)), SamplingParams(max_tokens=max_len - n), None)
        assert kvm.allocate_slots(req, n, num_lookahead_tokens=0) is not None  # its prompt
        req.num_computed_tokens = n
        return req

    def slots(rid):
        return len(kvm.get_blocks(rid).blocks[0]) * bs

    pol = spec.policy()
    for rid, lane in (("dev", False), ("lane", True)):
        req = decode(rid, 300)
        if lane:
            mgr.host_ends[rid] = pol.goal(300, 300)
        for step in range(40):  # 40 decode steps: the row always covers the next token + 2 (+ a block)
            assert kvm.allocate_slots(req, 1, num_lookahead_tokens=2) is not None
            need = req.num_computed_tokens + 1 + 2 + (bs if lane else 0)
            assert need <= slots(rid) < need + bs, (rid, step, slots(rid))
            req.num_computed_tokens += 1
    # at the model's length the extra block is not given
    req = decode("end", max_len - 8)
    mgr.host_ends["end"] = pol.goal(max_len - 8, max_len - 8)
    assert kvm.allocate_slots(req, 1, num_lookahead_tokens=2) is not None and slots("end") == max_len
    # the free-block check counts the extra block: with one block free, a request at a block's end gets
    # its next slots on the device, not in the lane (vLLM would preempt for it)
    for rid, lane in (("x", False), ("y", True)):
        req = decode(rid, 14)  # one block; the next token + 2 need a second, a block more a third
        if lane:
            mgr.host_ends[rid] = 1  # (only "in use" counts)
        held = kvm.block_pool.get_new_blocks(kvm.block_pool.get_num_free_blocks() - 1)
        got = kvm.allocate_slots(req, 1, num_lookahead_tokens=2)
        assert (got is None) == lane, rid
        kvm.block_pool.free_blocks(held)


def test_a_long_request_holds_its_host_range_until_its_next_allocation():
    """spec.NelssaManager.holds_host_range through vLLM's own KVCacheManager (the scheduler's growth reserve
    lasts while it is true): a prompt's blocks are held before its H is in use, still after H is set (the
    manager frees them only when the request is next allocated: a lane request, once its first token from
    the host tier is computed), and no longer once that allocation made them null blocks."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    spec, kvm, mgr = _nelssa_kv_manager(num_blocks=64, max_len=640)
    req = Request("long", list(range(400)), SamplingParams(max_tokens=8), None)
    assert not mgr.holds_host_range("long")  # nothing allocated yet
    assert kvm.allocate_slots(req, 400, num_lookahead_tokens=0) is not None
    req.num_computed_tokens = 400
    free = kvm.block_pool.get_num_free_blocks()
    assert mgr.holds_host_range("long")  # prefilled, H not in use
    mgr.host_ends["long"] = h = spec.policy().goal(400, 400)
    assert mgr.holds_host_range("long")  # H in use, its blocks not freed yet
    assert kvm.allocate_slots(req, 1, num_lookahead_tokens=1) is not None  # its next allocation frees them
    first, last = spec.policy().freed_blocks(h)
    assert not mgr.holds_host_range("long") and kvm.block_pool.get_num_free_blocks() >= free + (last - first) - 1


def test_nixl_progress_thread_off_reads_when_both_sides_poll(monkeypatch):
    """NELSSA_NIXL_PROGRESS_THREAD=0 (nixl_progress.py): vLLM's NIXL worker module then makes its agents
    without NIXL's busy progress thread; such agents stay idle (an idle pair with the thread took ~2
    cores of this box), and a READ completes while the reader polls its state and the target its
    notifications, as vLLM's steps do on D and P."""
    pytest.importorskip("nixl")
    import resource
    import time

    import vllm.distributed.nixl_utils as nu
    from nelssa.vllm_plugin import nixl_progress
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    for mod in (nu, base_worker):  # both restored after the test
        monkeypatch.setattr(mod, "nixl_agent_config", mod.nixl_agent_config)
    monkeypatch.setenv(nixl_progress.ENV, "1")
    assert not nixl_progress.apply_from_env()
    monkeypatch.setenv(nixl_progress.ENV, "0")
    assert nixl_progress.apply_from_env()
    cfg = base_worker.nixl_agent_config(num_threads=4, capture_telemetry=True)  # as vLLM calls it
    assert cfg.enable_pthread is False and cfg.num_threads == 4
    from nixl._api import nixl_agent
    p, d = nixl_agent("nelssa-test-P", cfg), nixl_agent("nelssa-test-D", base_worker.nixl_agent_config(num_threads=4))

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    src, dst = torch.arange(1 << 18, dtype=torch.int32), torch.zeros(1 << 18, dtype=torch.int32)
    p.register_memory(src)
    d.register_memory(dst)
    d.add_remote_agent(p.get_agent_metadata())
    p.add_remote_agent(d.get_agent_metadata())
    c0, w0 = cpu(), time.monotonic()
    time.sleep(1.0)
    assert (cpu() - c0) / (time.monotonic() - w0) < 0.5  # idle agents do not spin
    h = d.initialize_xfer("READ", d.get_xfer_descs(dst), p.get_xfer_descs(src), "nelssa-test-P", b"done")
    st, notes, t = d.transfer(h), {}, time.monotonic()
    while st == "PROC" and time.monotonic() - t < 30:
        st = d.check_xfer_state(h)
        notes = notes or p.get_new_notifs()
    while not notes and time.monotonic() - t < 30:
        notes = p.get_new_notifs()
    assert st == "DONE" and torch.equal(src, dst) and notes == {"nelssa-test-D": [b"done"]}


def test_context_buckets_of_the_hand_off_metrics():
    """nelssa:migrations_by_context's buckets (policy.context_bucket) and the report's reading of them."""
    from nelssa.bench.report import handoff_by_context
    from nelssa.vllm_plugin.policy import CONTEXTS, context_bucket
    got = [context_bucket(n) for n in (1, 4095, 4096, 8191, 8192, 65535, 65536, 131071, 131072, 10 ** 6)]
    assert got == ["<4K", "<4K", "4K-8K", "4K-8K", "8K-16K", "32K-64K", "64K-128K", "64K-128K", ">=128K", ">=128K"]
    assert {context_bucket(2 ** k) for k in range(20)} <= set(CONTEXTS)
    c = {"nelssa:migrations_by_context_total{8K-16K}": 2.0, "nelssa:migration_by_context_seconds_total{8K-16K}": 3.0,
         "nelssa:migrations_by_context_total{<4K}": 1.0, "nelssa:migration_by_context_seconds_total{<4K}": 0.5}
    assert handoff_by_context(c) == [("<4K", 1.0, 0.5), ("8K-16K", 2.0, 3.0)]


def test_a_hold_is_counted_in_the_steps_after_the_prefill():
    """scheduler._hold_step_s: the growth reserve counts a long prompt's hold in the interval of the steps
    without a long-prefill chunk (the hold's own: decodes and short prompts) when that is the shorter one;
    the engine's interval until one is measured (H100 hol run 107: 150-340-ms prefill steps counted a 2-s hold
    as ~10 steps, the hold ran ~25 and vLLM preempted 15 requests)."""
    from nelssa.vllm_plugin.scheduler import NelssaScheduler
    s = NelssaScheduler.__new__(NelssaScheduler, vllm_config=None)
    s._step_s, s._decode_step_s = 0.2, None
    assert s._hold_step_s() == 0.2
    s._decode_step_s = 0.025
    assert s._hold_step_s() == 0.025
    from nelssa.vllm_plugin.policy import switch_steps
    assert switch_steps(2.0, s._hold_step_s()) == 80 > switch_steps(2.0, s._step_s) == 10
    s._step_s = 0.02  # a run of decode steps pulled the engine's below
    assert s._hold_step_s() == 0.02
