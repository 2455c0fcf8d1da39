"""NELSSA inside one vLLM 0.26 instance (CPU, SmolLM2, real engine): exactness vs NELSSA_OFF, device
memory, preemption, lifecycle, errors, accuracy. Each engine runs in a fresh subprocess
(nelssa.bench.harness). The mechanism tests run SmolLM2 cut to its first 8 layers
(nelssa.models.prepare_smollm2_cut: every layer runs the same code, at ~1/4 of the CPU time); the
needle test runs the whole model."""

import re

import pytest

from harness_util import both, run_harness
from nelssa.models import prepare_smollm2_cut

CUT = str(prepare_smollm2_cut(8))

NELSSA = {"T_input": 2048, "budget": 1.0, "chunk": 128, "defer_below": 0}  # long prompts host-backed at once
MIXED = [  # long prompts of real text mixed with short ones, in one batch
    {"id": "long3k", "text_tokens": 3000, "max_tokens": 32},
    {"id": "short200", "text_tokens": 200, "offset": 5000, "max_tokens": 32},
    {"id": "long5k", "text_tokens": 5000, "offset": 20000, "max_tokens": 32},
    {"id": "long7k", "text_tokens": 7000, "offset": 60000, "max_tokens": 32},
    {"id": "chat", "chat": "What is the capital of France?", "max_tokens": 32},
    {"id": "aborted", "text_tokens": 2600, "offset": 90000, "max_tokens": 64, "abort_at_step": 30},
    # short prompt that grows past T_input while decoding: migrates (the mixed run's watermark is 0)
    {"id": "grows", "text_tokens": 1950, "offset": 120000, "max_tokens": 250},
    # the same, aborted while its migration is in flight (NELSSA only: NELSSA_OFF never migrates)
    {"id": "grows_aborted", "text_tokens": 1950, "offset": 150000, "max_tokens": 250, "abort_on_migrate": True},
    # aborted while the lane runs a job of it: its blocks and host KV go only once that job has ended
    {"id": "aborted_in_lane", "text_tokens": 2300, "offset": 180000, "max_tokens": 64, "abort_in_lane": True},
]
MAX_TOKENS = {r["id"]: r["max_tokens"] for r in MIXED}
pytestmark = pytest.mark.engine


def tokens(res):
    return {k: r["token_ids"] for k, r in res["results"].items()
            if k not in ("aborted", "grows_aborted", "aborted_in_lane")}


@pytest.fixture(scope="module")
def mixed():
    """fp32, budget 100%, chunked prefill (1024-token chunks), 70 blocks of 128 (8,960 tokens);
    2,048-token k-means segments, so completed segments are staged on the host during prefill, the last
    one before a prompt's host range ends in 512-token pieces (``tail_segment``).
    With the long lane (lane.py): offloaded requests decode apart from the step after their first
    offloaded step, the aborted ones are dropped from it (the other tests run without it)."""
    spec = {"model": CUT, "nelssa": {**NELSSA, "segment": 2048, "tail_segment": 512, "migrate_watermark": 0.0,
                                     "lane": True},
            "requests": MIXED,
            "engine": {"num_gpu_blocks_override": 70, "max_num_batched_tokens": 1024}}
    return both(spec)


def test_exact_mixed_batch_chunked_prefill(mixed):
    on, off = mixed
    assert set(tokens(on)) == {"long3k", "short200", "long5k", "long7k", "chat", "grows"}
    for rid, ids in tokens(off).items():
        assert len(ids) == MAX_TOKENS[rid]
        assert tokens(on)[rid] == ids, rid
    # the long lane computed most offloaded tokens (each long request's first offloaded step is a split step)
    assert on["host_totals"]["lane_rows"] >= 3 * 20, on["host_totals"]
    # most of them as drafts the step's sampling confirmed (lane_spec.py), with the outputs equal all the same
    assert on["host_totals"].get("lane_drafts:verified", 0) >= 3 * 10, on["host_totals"]
    # "grows" decodes ~200 tokens in the lane with 128-token chunks: a step moves its host range while its next
    # position's draft exists (one is queued with every report), which drops that draft (lane_spec.py, 4)
    assert on["host_totals"].get("lane_drafts:stale", 0) >= 1, on["host_totals"]


def _window_blocks(bs: int) -> int:
    """The most device blocks a host-backed request of MIXED holds: sink + recent + chunk + straddling block,
    + one block for a chunk whose hand-off is in flight."""
    return -(-16 // bs) + -(-(64 + 128 + bs) // bs) + 1 + 1


def test_long_prompt_waits_out_of_the_steps_for_its_switch(mixed):
    """With the lane, a long prompt done prefilling is left out of the steps until its last segment's hand-off
    lets it switch (config switch_hold_s; scheduler._switch_waits): no step decodes it from its device blocks
    meanwhile, and its switch is a lane seed, not a switch step. Its tokens are the baseline's all the same
    (the test above)."""
    on, _ = mixed
    prompt = {r["id"]: on["results"][r["id"]]["prompt_len"] for r in MIXED if r["id"] in ("long3k", "long5k", "long7k")}
    for rid, n in prompt.items():
        held = [i for i, st in enumerate(on["steps"]) if rid in st["switch_held"]]
        print(f"{rid}: held out of steps {held}")
        # long3k's whole range is within two segments: held from its prefill's end on; the longer ones once
        # their earlier segments' moves are done, which on this CPU may be only when the last is done too
        assert held or rid != "long3k", (rid, [st["computed"].get(rid) for st in on["steps"]])
        for i in held:  # after its prefill, and not scheduled: its computed tokens stay where they were
            assert on["steps"][i]["computed"][rid] == on["steps"][i - 1]["computed"][rid] >= n, (rid, i)
        # then it switched: decoded on (in the lane), to its last token
        assert len(on["results"][rid]["token_ids"]) == MAX_TOKENS[rid]
        if held:  # seeded (below): its blocks below H back in vLLM's pool at its seed's step, not at its next
            # allocation after the seed's lane batch (scheduler._seed_switch)
            seeded = on["steps"][held[-1] + 1]
            assert seeded["blocks"][rid] <= _window_blocks(on["block_size"]) < n // on["block_size"], (rid, seeded)
    # a held one's switch is a lane seed (scheduler._seed_switch), not a switch step on the device
    assert on["sched_counts"].get("switch_seeds", 0) >= 1, on["sched_counts"]


def test_no_request_is_preempted_with_nelssa(mixed):
    """A long prompt is admitted only where its blocks fit beside the running requests and the ones in vLLM's
    waiting queues (scheduler._queued_growth): vLLM admits those first and in the same step, before the
    prompt's reserve is in its watermark, and their later chunks allocate unchecked. Without them counted,
    long5k was admitted beside the waiting 1,950-token "grows_aborted" and preempted after 3,641 of its
    5,000 tokens (2 runs of 2), its prefill computed again."""
    on, _ = mixed
    assert on["preemptions"] == 0 and not any(on["preempted"].values()), on["preempted"]


def test_a_held_long_prompt_starts_in_the_step_that_seeds_the_one_before():
    """Two long prompts whose blocks do not fit together (40 + 36 of 69): B is held until A gives its prompt's
    blocks back. With the lane A's switch is a seed (scheduler._seed_switch), which frees them in the scheduling
    of its step, and B is admitted in that same scheduling (``schedule``: ``_admit_held`` again after a seed),
    so its first chunk runs in that step, not the next. Both answer NELSSA_OFF's tokens; none is preempted."""
    spec = {"model": CUT, "nelssa": {**NELSSA, "segment": 2048, "tail_segment": 512, "lane": True},
            "requests": [{"id": "A", "text_tokens": 5000, "max_tokens": 16},
                         {"id": "B", "text_tokens": 4500, "offset": 30000, "max_tokens": 16}],
            "engine": {"num_gpu_blocks_override": 70, "max_num_batched_tokens": 1024}}
    on, off = both(spec)
    steps = on["steps"]
    held = [i for i, st in enumerate(steps) if "A" in st["switch_held"]]
    assert held and on["sched_counts"].get("switch_seeds", 0) == 2, (held, on["sched_counts"])
    seed = held[-1] + 1  # A's seed: its blocks below H back at once
    assert steps[seed]["blocks"]["A"] <= _window_blocks(on["block_size"]) < steps[seed - 1]["blocks"]["A"], steps[seed]
    first_b = min(i for i, st in enumerate(steps) if st["computed"].get("B", 0) > 0)
    assert first_b == seed, (first_b, seed, [st["computed"] for st in steps[:seed + 2]])
    for rid in ("A", "B"):
        assert on["results"][rid]["token_ids"] == off["results"][rid]["token_ids"], rid
    assert on["preemptions"] == 0, on["preempted"]
    # the scheduler knows which steps ran a long-prefill chunk, and counts a hold in the others' interval
    # (_hold_step_s): here 1,024-token chunks at up to 9.5K tokens of context against decodes
    prompt = {rid: on["results"][rid]["prompt_len"] for rid in ("A", "B")}
    before = {"A": 0, "B": 0}
    for st in steps:
        chunk = any(before[r] < prompt[r] and st["computed"].get(r, 0) > before[r] for r in before)
        assert st["long_chunk"] == chunk, (st["step"], st["computed"], before)
        before = {r: st["computed"].get(r, before[r]) for r in before}
    assert 0 < on["decode_step_s"] < on["step_s"], (on["decode_step_s"], on["step_s"])


def test_device_blocks_given_back(mixed):
    """A 7K-token long request holds only window + chunk blocks once its prompt is on the host."""
    on, off = mixed
    bs = on["block_size"]

    def held(res, rid):
        return [s["blocks"][rid] for s in res["steps"] if rid in s["blocks"]]

    on7, off7 = held(on, "long7k"), held(off, "long7k")
    window = _window_blocks(bs)
    print(f"long7k device blocks (block size {bs}): NELSSA last {on7[-1]} max-after-prefill {max(on7[-20:])}; "
          f"NELSSA_OFF last {off7[-1]}")
    assert off7[-1] >= 7000 // bs
    assert max(on7[-20:]) <= window
    assert on["final_host_bytes"] == 0 and on["host_requests"] == 0  # finished + aborted: all freed
    # staged during prefill: long3k 1 segment, long5k 2, long7k 2 (+ each one final move); "aborted"
    # reaches the host only if admitted before its abort (one long prefill at a time)
    assert on["host_totals"]["long_requests"] >= 3, on["host_totals"]
    assert on["host_totals"]["cluster_s_n"] >= 3 + 4, on["host_totals"]
    assert on["final_free_blocks"] == off["final_free_blocks"] == on["total_blocks"] - 1
    # the one aborted while the lane ran a job of it (lane.py, 6): its job cancelled, the step not waiting
    # for it; freed all the same (above)
    assert on["aborted_in_lane"] == ["aborted_in_lane"] and on["host_totals"].get("lane_finish_cancels", 0) >= 1


def test_grown_request_migrates_without_recompute(mixed):
    """A 1,950-token prompt decoding 250 tokens passes T_input (2,048) mid-generation and migrates in
    the background: its device blocks shrink to the window, it is never preempted or recomputed, and
    its tokens equal NELSSA_OFF's (budget 1.0, fp32; checked in the test above). Its twin is aborted
    while its migration is in flight and leaves nothing behind."""
    on, off = mixed
    bs = on["block_size"]
    held_on = [s["blocks"]["grows"] for s in on["steps"] if "grows" in s["blocks"]]
    held_off = [s["blocks"]["grows"] for s in off["steps"] if "grows" in s["blocks"]]
    full = -(-(1950 + 250 - 1) // bs)
    window = _window_blocks(bs)
    print(f"grows device blocks (block size {bs}): NELSSA max {max(held_on)} last {held_on[-1]}; "
          f"NELSSA_OFF last {held_off[-1]}")
    assert held_off[-1] >= full - 1
    assert held_on[-1] <= window < full - 1
    assert on["preempted"]["grows"] == 0  # (NELSSA_OFF may preempt and recompute it in this tight pool)
    # aborted mid-migration: nothing left on the host, every device block back (both runs end equal)
    assert on["aborted_migrating"] == ["grows_aborted"], on["aborted_migrating"]
    assert on["final_host_bytes"] == 0 and on["host_requests"] == 0
    assert on["final_free_blocks"] == on["total_blocks"] - 1
    # every move counted its KV bytes: 8 layers x (K, V) x 3 KV heads x 64 x fp32 per token
    tot = on["host_totals"]
    assert tot["moved_tokens"] > 0 and tot["moved_bytes"] == tot["moved_tokens"] * 8 * 2 * 3 * 64 * 4, tot


def test_seeded_sampling_across_prefill_chunks():
    """A seeded request (the OpenAI ``seed``; temperature 1, top-k 20) whose 600-token prompt is
    prefilled in 256-token chunks: vLLM 0.26 on CPU dies rewinding the discarded chunks' samples ("CPU
    Generator does not use offset", NELSSA_OFF as well); NELSSA's CPU runner rewinds them by state, so
    the request samples exactly what it samples with its prompt in one chunk."""
    req = {"id": "seeded", "text_tokens": 600, "max_tokens": 16,
           "sampling": {"temperature": 1.0, "top_k": 20, "seed": 7}}
    spec = {"model": CUT, "nelssa": NELSSA, "requests": [req], "mode": "on", "max_model_len": 1024}
    chunked = run_harness({**spec, "engine": {"max_num_batched_tokens": 256}})
    whole = run_harness({**spec, "engine": {"max_num_batched_tokens": 1024}})
    assert chunked["num_steps"] > whole["num_steps"]  # two more prefill steps, each discarding a sample
    got, ref = chunked["results"]["seeded"]["token_ids"], whole["results"]["seeded"]["token_ids"]
    assert len(got) == 16 and got == ref


def test_no_preemption_under_memory_pressure():
    """72 blocks of 128: three 2,900-token requests + 1 short decoding 100 tokens. The baseline must
    preempt; NELSSA gives the middle blocks back and runs all with zero preemptions, same tokens.
    Deferred (``defer_below``), a long prompt stays on the device while there is room: the third
    does not fit beside the first two, so one of those migrates; the others keep their device KV."""
    spec = {"model": CUT, "nelssa": {**NELSSA, "defer_below": 32768},
            "engine": {"num_gpu_blocks_override": 72, "max_num_batched_tokens": 1024},
            "requests": [{"id": "a", "text_tokens": 2900, "max_tokens": 100},
                         {"id": "b", "text_tokens": 2900, "offset": 30000, "max_tokens": 100},
                         {"id": "c", "text_tokens": 2900, "offset": 60000, "max_tokens": 100},
                         {"id": "s", "text_tokens": 300, "offset": 90000, "max_tokens": 100}]}
    on, off = both(spec)
    print(f"preemptions: baseline {off['preemptions']} in {off['num_steps']} steps, "
          f"NELSSA {on['preemptions']} in {on['num_steps']} steps")
    assert off["preemptions"] > 0
    assert on["preemptions"] == 0
    assert tokens(on) == tokens(off)
    last = {rid: [st["blocks"][rid] for st in on["steps"] if rid in st["blocks"]][-1] for rid in "abc"}
    print(f"NELSSA: device blocks at each long request's last step {last}; host {on['host_totals']}")
    kept = [rid for rid, n in last.items() if n >= 2900 // on["block_size"]]
    assert 1 <= len(kept) < 3, last  # some kept all their KV on the device, some gave it back
    assert on["host_totals"]["long_requests"] == 3 - len(kept), on["host_totals"]


def test_growing_requests_migrate_when_vllm_would_preempt_not_before():
    """migrate_watermark 1.0 with migrate_lead_steps: three 1,950-token prompts decoding 250 tokens each
    pass T_input (2,048) while decoding and outgrow a pool of 52 blocks of 128 (each ends at 18). The
    baseline preempts. NELSSA migrates once the free blocks are fewer than the three take within the
    lead (policy.blocks_within; its arithmetic: test_plugin_units): grown requests move to the host tier,
    zero preemptions, the baseline's tokens (budget 1.0, fp32). (With the harness's hand-offs done
    within a step, the watermark at 1.0 alone avoids the preemption here too; what the lead buys, time
    for a real hand-off, is measured on the H200.)"""
    reqs = [{"id": c, "text_tokens": 1950, "offset": 30000 * i, "max_tokens": 250} for i, c in enumerate("abc")]
    spec = {"model": CUT, "nelssa": {**NELSSA, "migrate_watermark": 1.0, "migrate_lead_steps": 200},
            "engine": {"num_gpu_blocks_override": 52, "max_num_batched_tokens": 2048, "max_model_len": 4096},
            "requests": reqs}
    on, off = both(spec)
    assert on["block_size"] == 128, on["block_size"]  # the pool's arithmetic above
    print(f"preemptions: baseline {off['preemptions']}, NELSSA {on['preemptions']}; host {on['host_totals']}")
    assert off["preemptions"] > 0
    assert on["preemptions"] == 0 and tokens(on) == tokens(off)
    assert on["host_totals"].get("long_requests", 0) >= 1, on["host_totals"]  # grown ones migrated


# c grows past T_input beside a and b, migrates, and comes back once they end (the recall tests)
RECALLED = [{"id": "a", "text_tokens": 1950, "max_tokens": 250},
            {"id": "b", "text_tokens": 1950, "offset": 30000, "max_tokens": 250},
            {"id": "c", "text_tokens": 2000, "offset": 60000, "max_tokens": 450}]


RECALL_SPEC = {"model": CUT, "nelssa": {**NELSSA, "migrate_watermark": 1.0, "migrate_lead_steps": 200, "lane": True},
               "engine": {"num_gpu_blocks_override": 52, "max_num_batched_tokens": 2048, "max_model_len": 4096},
               "requests": RECALLED}


@pytest.fixture(scope="module")
def recall_baseline():
    return run_harness({**RECALL_SPEC, "mode": "off"})


@pytest.mark.parametrize("engine", ["local", "node"])
def test_migrated_request_returns_to_the_device_once_there_is_room(recall_baseline, engine):
    """Recall (config ``recall``, recall.py): c (2,000 tokens, 450 to generate) grows past T_input beside a
    and b (1,950 + 250) in 52 blocks of 128, where the three do not fit once c has ~180 tokens (the
    baseline preempts); it migrates — the largest context — and decodes from the host tier through the
    lane. Once a and b have finished, the device has room for c to its end: its KV is loaded back from the
    host tier into new blocks (nothing recomputed: its computed tokens never go back; no preemption at
    all), and it ends there with all its blocks, its host KV freed. Tokens equal to the baseline's (budget
    1.0, fp32). With nelssa-node (a subprocess, two head-wise devices) the node sends c's parts back as
    stored (ReadBack) and the engine's client puts them in token order: the same, and the node is empty after."""
    spec, node = RECALL_SPEC, None
    if engine == "node":
        from test_node import Node
        node = Node("--devices", "2", "--device-memory", "256MiB")
        spec = {**spec, "nelssa": {**spec["nelssa"], "engine": "node", "node_address": node.address,
                                   "node_transport": "native", "host_capacity": "4GiB"}}
    try:
        on, off = run_harness({**spec, "mode": "on"}), recall_baseline
        stats = node.stats() if node else None
    finally:
        if node:
            node.stop()
    if stats is not None:
        assert stats.requests == 0 and all(d.used_bytes == 0 for d in stats.devices), stats
    assert on["block_size"] == 128, on["block_size"]
    held = [(st["blocks"].get("c", 0), "a" in st["blocks"] or "b" in st["blocks"]) for st in on["steps"]]
    print(f"preemptions: baseline {off['preemptions']}, NELSSA {on['preempted']}; host {on['host_totals']}; "
          f"c's device blocks per step {[n for n, _ in held]}")
    assert off["preemptions"] > 0
    assert on["host_totals"].get("long_requests", 0) == 1, on["host_totals"]  # c migrated, a and b did not
    assert on["preempted"] == {"a": 0, "b": 0, "c": 0}, on["preempted"]  # recalled by load: no preemption
    computed = [st["computed"]["c"] for st in on["steps"] if "c" in st["computed"]]
    assert all(x <= y for x, y in zip(computed, computed[1:])), computed  # nothing recomputed
    assert on["host_totals"].get("recalled_tokens", 0) >= 1500, on["host_totals"]  # its host range came back
    window = max(n for n, others in held if others and 0 < n < 2000 // 128)  # migrated: its window
    back = [n for n, others in held if not others and n > 0]
    assert window <= 6 and back and back[-1] >= -(-(2000 + 450 - 1) // 128), (window, back)
    assert on["final_host_bytes"] == 0 and on["host_requests"] == 0
    assert tokens(on) == tokens(off)


@pytest.mark.parametrize("case", ["read-back fails", "aborted while loading"])
def test_a_recall_that_fails_or_is_aborted_leaves_nothing_behind(case):
    """The recall above (a) with every read-back from the host tier failing (config fault "recall"): c ends
    with an error that says so — never with text from half-loaded blocks; (b) with c aborted in the step
    after its recall started (loaded, not yet reported). Either way a and b end normally, and nothing is
    left behind: host KV freed, every device block back in the pool but vLLM's null block."""
    fault = case == "read-back fails"
    reqs = [dict(r, abort_on_recall=True) if r["id"] == "c" and not fault else r for r in RECALLED]
    res = run_harness({"model": CUT, "mode": "on", "requests": reqs,
                       "nelssa": {**NELSSA, "migrate_watermark": 1.0, "migrate_lead_steps": 200, "lane": True,
                                  **({"fault": "recall"} if fault else {})},
                       "engine": {"num_gpu_blocks_override": 52, "max_num_batched_tokens": 2048, "max_model_len": 4096}})
    out = {k: (v["finish_reason"], v["stop_reason"]) for k, v in res["results"].items()}
    print(case, out, res["aborted_recalling"])
    assert out["a"] == ("length", None) and out["b"] == ("length", None)
    if fault:
        assert out["c"][0] == "error" and "recall" in out["c"][1] and "NELSSA_FAULT=recall" in out["c"][1], out
    else:  # aborted: no result of its own
        assert res["aborted_recalling"] == ["c"] and "c" not in out, (out, res["aborted_recalling"])
    assert res["final_host_bytes"] == 0 and res["host_requests"] == 0
    assert res["final_free_blocks"] == res["total_blocks"] - 1, (res["final_free_blocks"], res["total_blocks"])


def test_short_requests_admitted_beside_a_long_prefill_do_not_crowd_it_out(tmp_path):
    """32 blocks of 128: a 3,000-token prompt (24 blocks) prefills in chunks while 125-token requests arrive one
    a step, each crossing into a second block within a few tokens. vLLM admits a short request where its
    prompt fits beside the prefill's reserve (NELSSA's raised watermark); as the admitted ones grew they took
    the blocks the prompt's next chunks needed, and vLLM preempted the prompt itself (recomputed: 83 steps
    against 54). The watermark also holds what the requests decoding on the device grow to while the prefill
    lasts (policy.prefill_steps): zero preemptions, the late arrivals wait, every request completes. No long
    request decodes from the host tier meanwhile, so the prompt's chunks follow ``long_chunk_solo`` (512
    tokens at context 0), not ``long_chunk`` (128: a block a step). With the diagnostics on (``stall_log_ms``)
    the scheduler traces the reserves while the prompt prefills (NelssaScheduler._trace_reserve)."""
    reqs = [{"id": "s0", "text_tokens": 125, "offset": 90000, "max_tokens": 40},
            {"id": "long", "text_tokens": 3000, "max_tokens": 8, "add_at_step": 1}]
    reqs += [{"id": f"s{i}", "text_tokens": 125, "offset": 90000 + 300 * i, "max_tokens": 40, "add_at_step": 1 + i}
             for i in range(1, 13)]
    log = tmp_path / "on.log"
    on = run_harness({"model": CUT, "mode": "on", "nelssa": {**NELSSA, "long_chunk": 128, "long_chunk_solo": 512,
                                                             "stall_log_ms": 60000},  # no step is a stall here
                      "max_model_len": 3200,
                      "engine": {"num_gpu_blocks_override": 32, "max_num_batched_tokens": 1024}, "requests": reqs},
                     log_path=str(log))
    prefill = [st["blocks"] for st in on["steps"] if 0 < st["blocks"].get("long", 0) < 24]
    print(f"preemptions {on['preemptions']} in {on['num_steps']} steps; device blocks while the prompt prefilled: "
          f"{prefill}")
    assert on["preemptions"] == 0
    assert any(b.get(f"s{i}") == 0 for b in prefill for i in range(1, 13))  # an admitted-later short waited
    grown = [b["long"] - a["long"] for a, b in zip(prefill, prefill[1:])]
    assert max(grown) >= 3, grown  # chunks of long_chunk_solo (3-4 blocks early on), not long_chunk's one
    assert {k: len(r["token_ids"]) for k, r in on["results"].items()} == {r["id"]: r["max_tokens"] for r in reqs}
    trace = [re.search(r"t=([\d.]+) free blocks (\d+) at the scheduling's start, (\d+) after; watermark (\d+) \(long "
                       r"prefills (\d+) \+ growth (\d+) over (\d+) steps; prefilling (\w+)", ln)
             for ln in log.read_text().splitlines() if "NELSSA reserve:" in ln]
    print("\n".join(m.group(0) for m in trace if m))
    assert trace and all(trace), trace
    got = [tuple(float(x) if i == 0 else x for i, x in enumerate(m.groups())) for m in trace]
    assert [g[0] for g in got] == sorted(g[0] for g in got) and all(b - a >= 0.5 for a, b in zip(
        [g[0] for g in got], [g[0] for g in got][1:]))  # at most one line per 0.5 s
    assert got[0][7] == "True" and int(got[0][4]) > 0  # the prompt prefilling, its blocks still to come reserved
    assert all(int(g[3]) >= int(g[4]) + int(g[5]) for g in got)  # vLLM's watermark under both


DEFER_CHECK = """
import copy, json
from nelssa.bench import harness
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from nelssa.vllm_plugin.scheduler import NelssaScheduler
llm = harness._engine({"model": %r, "mode": "on", "nelssa": {"T_input": 2048},
                       "engine": {"num_gpu_blocks_override": 35, "max_model_len": 4096}})
core = llm.llm_engine.engine_core
s0 = getattr(core, "engine_core", core).scheduler
cfg = copy.copy(s0.vllm_config)
cfg.scheduler_config = copy.copy(cfg.scheduler_config)
cfg.scheduler_config.async_scheduling = True  # vLLM's CPU platform runs without it; a GPU engine with it
kw = dict(vllm_config=cfg, kv_cache_config=s0.kv_cache_config, structured_output_manager=s0.structured_output_manager,
          block_size=s0.block_size)
ours, stock = NelssaScheduler(**kw), AsyncScheduler(**kw)
print("DEFER " + json.dumps({"batches": cfg.max_concurrent_batches, "ours": type(ours).__name__,
                             "ours_defer": ours.defer_block_free, "stock_defer": stock.defer_block_free}))
"""


def test_preempted_blocks_go_back_at_once_under_async_scheduling():
    """With async scheduling vLLM defers returning a freed request's blocks for a consumer KV connector
    (NELSSA's is kv_both): a preemption then frees nothing in its own scheduling, and vLLM preempted every
    request after its victim down to the one it allocated for (H100 hol run 115sc: 32 preemptions at one
    scheduling). NelssaScheduler gives them back at once, as stock vLLM without a connector does (its own
    loads and the lane are ordered: scheduler.py). Schedulers built from a CPU engine's config with async
    scheduling turned on (the CPU platform turns it off): vLLM's AsyncScheduler with NELSSA's connector
    defers, NELSSA's does not."""
    import json
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-c", DEFER_CHECK % CUT], capture_output=True, text=True, timeout=600)
    line = next((x for x in p.stdout.splitlines() if x.startswith("DEFER ")), None)
    assert line is not None, p.stdout[-2000:] + p.stderr[-3000:]
    got = json.loads(line[len("DEFER "):])
    assert got == {"batches": 2, "ours": "NelssaAsyncScheduler", "ours_defer": False, "stock_defer": True}, got


def test_long_context_is_not_the_preemption_victim(tmp_path):
    """A 3,000-token request kept on the device (opted out of the host tier) decodes beside four short
    ones in a pool of 35 blocks of 128 that fills when the short ones grow into their third block. vLLM's
    FCFS victim is the running list's last request, here the long one: the baseline preempts it and
    recomputes its 3,000 tokens. NELSSA spares requests decoding with >= T_input tokens of context
    (policy.Policy.spared): a short one is preempted instead, the long one never; the same tokens. Each
    preemption under NELSSA is logged with the request vLLM allocated for and the step's reserves."""
    shorts = [{"id": f"s{i}", "text_tokens": 250, "offset": 40000 + 5000 * i, "max_tokens": 40} for i in range(4)]
    spec = {"model": CUT, "nelssa": NELSSA,
            "engine": {"num_gpu_blocks_override": 35, "max_num_batched_tokens": 1024, "max_model_len": 4096},
            "requests": shorts + [{"id": "long", "text_tokens": 3000, "max_tokens": 40,
                                   "extra_args": {"nelssa_offload": False}}]}
    log = tmp_path / "on.log"
    on, off = run_harness({**spec, "mode": "on"}, log_path=str(log)), run_harness({**spec, "mode": "off"})
    print(f"preempted: baseline {off['preempted']}, NELSSA {on['preempted']}")
    assert on["block_size"] == 128, on["block_size"]  # the pool's arithmetic above
    assert off["preempted"]["long"] >= 1  # vLLM's own order: the long one goes (the test's premise)
    assert on["preempted"]["long"] == 0
    assert sum(on["preempted"][s["id"]] for s in shorts) >= 1  # the pool is as tight with NELSSA
    assert tokens(on) == tokens(off)
    assert on["host_totals"].get("long_requests", 0) == 0  # opted out: nothing went to the host tier
    said = [ln for ln in log.read_text().splitlines() if "NELSSA: vLLM preempts" in ln]
    print("\n".join(said))
    assert len(said) == sum(on["preempted"].values()), said  # every one, each naming victim and requester
    assert all(re.search(r"preempts s\d-\w+ \(\d+/\d+ tokens computed, \d+ blocks\) for (s\d|long)-\w+ \(\d+/\d+ tokens", ln)
               and "free blocks" in ln and "watermark" in ln for ln in said), said


def test_lane_requests_count_against_max_num_seqs():
    """The long lane leaves its busy requests out of the list vLLM schedules (lane.py, 1); they still
    hold a place of ``max_num_seqs``: with 2 places, a long request in the lane and four short ones,
    vLLM must not admit a second short one beside the first while the long one is in the lane (on the
    H200 a P/D decode instance at 128 running did, and died on vLLM's own assertion). Same tokens."""
    shorts = [{"id": f"s{i}", "text_tokens": 120, "offset": 40000 + 5000 * i, "max_tokens": 24} for i in range(4)]
    spec = {"model": CUT, "nelssa": {**NELSSA, "lane": True},
            "engine": {"num_gpu_blocks_override": 70, "max_num_batched_tokens": 1024, "max_num_seqs": 2},
            "requests": [{"id": "long", "text_tokens": 2300, "max_tokens": 40}] + shorts}
    on, off = both(spec)
    print(f"running per step, NELSSA: {[s['running'] for s in on['steps']]}")
    assert max(s["running"] for s in on["steps"]) <= 2
    assert on["host_totals"]["lane_rows"] >= 10, on["host_totals"]  # the long one decoded in the lane
    assert tokens(on) == tokens(off) and set(tokens(on)) == {"long", "s0", "s1", "s2", "s3"}


def test_deferred_prompt_does_not_queue_behind_a_long_prefill():
    """One long prefill at a time (``long_prefills`` 1) is for host-backed prompts: a deferred prompt
    (``T_input`` <= length < ``defer_below``, served from the device like a short request) arriving while
    a host-backed one prefills is admitted at once, not after that prefill (H200 mixed run: an 11.7K
    prompt waited 14 s behind a 122K one). NELSSA only: the order of admission is the point; deferred
    prompts' exactness is test_no_preemption_under_memory_pressure's."""
    spec = {"model": CUT, "mode": "on", "nelssa": {**NELSSA, "defer_below": 2600},
            "engine": {"num_gpu_blocks_override": 80, "max_num_batched_tokens": 512},
            "requests": [{"id": "L", "text_tokens": 2900, "max_tokens": 4},                       # host-backed
                         {"id": "d", "text_tokens": 2100, "offset": 30000, "max_tokens": 4, "add_at_step": 1}]}
    on = run_harness(spec)
    first = {rid: min(st["step"] for st in on["steps"] if rid in st["blocks"]) for rid in ("L", "d")}
    prefill_end = min(st["step"] for st in on["steps"] if st["blocks"].get("L", 0) >= 2900 // on["block_size"])
    print(f"admitted at steps {first}; L's prompt on the device from step {prefill_end}")
    assert prefill_end >= 4  # L prefills over several 512-token steps
    assert first["d"] <= 2 < prefill_end, (first, prefill_end)  # d did not wait for L's prefill
    assert {k: len(r["token_ids"]) for k, r in on["results"].items()} == {"L": 4, "d": 4}
    assert on["host_totals"]["long_requests"] == 1  # L on the host tier; d stayed on the device


def test_prompts_after_a_long_prefill_do_not_all_prefill_in_one_step():
    """While a long request is resident and short requests decode, a step adds at most ``short_chunk``
    (2048 by default; 0: ``long_chunk``) tokens of short prompts to its decodes and long chunks (scheduler.py, step
    budget): three 300-token prompts that arrive during the long prompt's prefill (in ``long_chunk`` pieces:
    no solo chunk) are spread over steps, where NELSSA_OFF prefills them in one (on the H100 such a burst
    right after a 100K prompt's prefill gave the long decode phase its short-request ITL p99).
    ``short_chunk`` 200 below ``long_chunk`` 256: the cap is its own. Three more that arrive once the long
    prompt is prefilled and decodes get ``short_chunk_decode`` (100) instead. Same tokens."""
    shorts = [{"id": "s0", "text_tokens": 100, "offset": 40000, "max_tokens": 60}] + [
        {"id": f"p{i}", "text_tokens": 300, "offset": 50000 + 5000 * i, "max_tokens": 8, "add_at_step": 5}
        for i in range(3)] + [
        {"id": f"q{i}", "text_tokens": 300, "offset": 70000 + 5000 * i, "max_tokens": 4, "add_at_step": 30}
        for i in range(3)]
    spec = {"model": CUT, "nelssa": {**NELSSA, "long_chunk": 256, "long_chunk_solo": 0, "short_chunk": 200,
                                     "short_chunk_decode": 100},
            "engine": {"num_gpu_blocks_override": 80, "max_num_batched_tokens": 1024},
            "requests": shorts + [{"id": "L", "text_tokens": 2600, "max_tokens": 40, "add_at_step": 2}]}
    on, off = both(spec)
    lens = {k: r["prompt_len"] for k, r in on["results"].items()}

    def prompt_tokens(run):
        """Per step: (short prompts' tokens it computed, the phase: "prefill" while L prefills, "decode" once
        it decodes, each with a short request decoding; else None)."""
        out, before = [], {}
        for st in run["steps"]:
            c = st["computed"]
            n = sum(max(0, min(c[k], lens[k]) - min(before.get(k, 0), lens[k])) for k in c if k != "L")
            decoding = any(before.get(k, 0) >= lens[k] for k in c if k != "L")
            phase = None
            if "L" in c and decoding:
                phase = "prefill" if before.get("L", 0) < lens["L"] else "decode"
            out.append((n, phase))
            before = c
        return out

    got_on, got_off = prompt_tokens(on), prompt_tokens(off)
    print(f"prompt tokens per step, NELSSA: {got_on}; NELSSA_OFF: {[n for n, _ in got_off]}")
    assert max(n for n, _ in got_off) >= 900  # stock: three prompts in one step (each burst)
    in_prefill = [n for n, ph in got_on if ph == "prefill"]
    in_decode = [n for n, ph in got_on if ph == "decode"]
    assert max(in_prefill) > 100 and max(in_prefill) <= 200, got_on  # short_chunk while L prefills
    assert sum(in_decode) >= 900 and max(in_decode) <= 100, got_on  # the q prompts: short_chunk_decode
    assert tokens(on) == tokens(off) and set(tokens(on)) == {"L", "s0", "p0", "p1", "p2", "q0", "q1", "q2"}


def test_step_budget_leaves_long_prompt_chunks_alone():
    """The step budget bounds short prompts only: two deferred long prompts (served from the device)
    prefilling beside a decoding short request each keep their own chunk per step (policy.prefill_chunk of
    ``long_chunk``), together more than ``long_chunk`` (a first version made them share it; the H200's
    no-pressure check prefills four deferred 16K prompts at once). Each chunk, the first included (it
    had vLLM's threshold alone: 1,023 tokens here), within ``long_chunk``. Same tokens as NELSSA_OFF. No solo
    chunk (``long_chunk_solo`` 0): with no long request on the host tier, its default (4096) would size them."""
    spec = {"model": CUT, "nelssa": {**NELSSA, "long_chunk": 512, "long_chunk_solo": 0, "defer_below": 8000},
            "engine": {"num_gpu_blocks_override": 80, "max_num_batched_tokens": 1024},
            "requests": [{"id": "s", "text_tokens": 100, "offset": 40000, "max_tokens": 40},
                         {"id": "D1", "text_tokens": 2300, "max_tokens": 4, "add_at_step": 2},
                         {"id": "D2", "text_tokens": 2300, "offset": 20000, "max_tokens": 4, "add_at_step": 2}]}
    on, off = both(spec)
    lens = {k: r["prompt_len"] for k, r in on["results"].items()}
    per_step, before = [], {}
    for st in on["steps"]:
        c = st["computed"]
        if before.get("s", 0) >= lens["s"]:  # s decodes in this step
            per_step.append({k: min(c[k], lens[k]) - min(before.get(k, 0), lens[k]) for k in ("D1", "D2") if k in c})
        before = c
    print(f"deferred prompts' tokens per step while s decodes: {per_step}")
    both_steps = [d for d in per_step if d.get("D1", 0) > 0 and d.get("D2", 0) > 0]
    assert both_steps and max(sum(d.values()) for d in both_steps) > 512, per_step
    assert all(v <= 512 for d in per_step for v in d.values()), per_step  # each within its own chunk
    assert on["host_totals"].get("long_requests", 0) == 0  # both deferred: device only
    assert tokens(on) == tokens(off) and set(tokens(on)) == {"s", "D1", "D2"}


def test_preempting_an_offloaded_request():
    """An offloaded long request (low priority) is preempted when two shorts grow; its host KV is
    freed, it is recomputed and offloaded again (its prompt staged again in 1,024-token segments),
    and its tokens still equal the baseline's."""
    spec = {"model": CUT, "nelssa": {**NELSSA, "segment": 1024}, "max_model_len": 3200,
            "engine": {"num_gpu_blocks_override": 210, "block_size": 16, "max_num_batched_tokens": 1024,
                       "scheduling_policy": "priority"},
            "requests": [{"id": "L", "text_tokens": 2900, "max_tokens": 300, "priority": 1},
                         {"id": "s1", "text_tokens": 1400, "offset": 30000, "max_tokens": 200, "add_at_step": 4},
                         {"id": "s2", "text_tokens": 1400, "offset": 60000, "max_tokens": 200, "add_at_step": 4}]}
    on, off = both(spec)
    assert on["preempted"]["L"] >= 1
    assert on["final_host_bytes"] == 0 and on["host_requests"] == 0
    assert tokens(on) == tokens(off)


def test_prefix_caching_with_freed_blocks():
    """Prefix caching stays on: the same long prompt arrives again while the first copy decodes
    (its middle blocks freed but still cached) and again after it finished. The repeats hit vLLM's
    prefix cache, are offloaded from the hit blocks, and their tokens equal the baseline's."""
    spec = {"model": CUT, "nelssa": NELSSA, "engine": {"num_gpu_blocks_override": 90, "max_num_batched_tokens": 1024,
                                          "enable_prefix_caching": True},
            "requests": [{"id": "a", "text_tokens": 3000, "max_tokens": 32},
                         {"id": "b", "text_tokens": 3000, "max_tokens": 32, "add_at_step": 8},
                         {"id": "c", "text_tokens": 3000, "max_tokens": 32, "add_at_step": 60},
                         # opted out of the host tier (as the needle test's dense copies): device KV throughout
                         {"id": "d", "text_tokens": 3000, "max_tokens": 32, "after": "c",
                          "extra_args": {"nelssa_offload": False}},
                         MIXED[4]]}
    on, off = both(spec)
    print({m: {k: r["cached_tokens"] for k, r in res["results"].items()} for m, res in (("on", on), ("off", off))})
    for rid in ("b", "c", "d"):
        assert on["results"][rid]["cached_tokens"] >= 2048, on["results"][rid]
    assert tokens(on) == tokens(off)
    held_d = [st["blocks"]["d"] for st in on["steps"] if st["blocks"].get("d")]  # once allocated
    assert held_d and min(held_d) >= 3000 // on["block_size"], held_d  # never given back
    assert on["final_host_bytes"] == 0 and on["host_requests"] == 0


def test_host_failure_is_an_error_not_text():
    """With every host attention failing, long requests end with finish_reason 'error' and no tokens
    from the failed step on (the first is the prefill's, the next few come from their device blocks
    while the hand-off runs); short requests in the same batch are unaffected."""
    spec = {"model": CUT, "mode": "on", "nelssa": NELSSA, "requests": MIXED[:5],
            "engine": {"max_num_batched_tokens": 1024}}
    res = run_harness(spec, env={"NELSSA_FAULT": "attend"})
    r = res["results"]
    for rid in ("long3k", "long5k", "long7k"):
        assert r[rid]["finish_reason"] == "error", r[rid]
        assert "injected host-tier fault" in r[rid]["stop_reason"]
        assert len(r[rid]["token_ids"]) < 32  # stopped at the first step with host attention
    for rid in ("short200", "chat"):
        assert r[rid]["finish_reason"] == "length" and len(r[rid]["token_ids"]) == 32
    assert res["final_host_bytes"] == 0


def test_failed_store_keeps_the_request_on_its_device_blocks(mixed):
    """With every move to the host tier failing (the host tier full or gone), long requests never switch:
    they decode from their device blocks to the end, token for token as NELSSA_OFF (the mixed run's),
    holding them; each failure is counted (handoff_failures) and logged, nothing is left on the host."""
    spec = {"model": CUT, "mode": "on", "nelssa": {**NELSSA, "segment": 2048}, "requests": MIXED[:5],
            "engine": {"num_gpu_blocks_override": 70, "max_num_batched_tokens": 1024}}
    res = run_harness(spec, env={"NELSSA_FAULT": "store"})
    r, off = res["results"], tokens(mixed[1])
    for rid in ("long3k", "short200", "long5k", "long7k", "chat"):
        assert r[rid]["finish_reason"] == "length" and r[rid]["token_ids"] == off[rid], rid
    assert res["host_totals"].get("handoff_failures", 0) >= 3, res["host_totals"]
    assert res["host_totals"].get("long_requests", 0) == 0 and res["final_host_bytes"] == 0
    held = [st["blocks"]["long7k"] for st in res["steps"] if "long7k" in st["blocks"]]
    assert held[-1] >= 7000 // res["block_size"], held  # its whole prompt stayed on the device to the end


def test_request_over_host_capacity_is_rejected():
    """A long request that cannot fit the host tier is rejected with the reason; the same prompt opted
    out of the host tier (nelssa_offload false) runs on the device; a malformed opt-out is rejected."""
    spec = {"model": CUT, "mode": "on", "nelssa": {**NELSSA, "host_capacity": "20MiB"},
            "engine": {"max_num_batched_tokens": 1024},
            "requests": [{"id": "big", "text_tokens": 3000, "max_tokens": 8}, MIXED[4],
                         {"id": "big_device", "text_tokens": 3000, "max_tokens": 8,
                          "extra_args": {"nelssa_offload": False}},
                         {"id": "bad", "chat": "Hi", "max_tokens": 8, "extra_args": {"nelssa_offload": "maybe"}}]}
    r = run_harness(spec)["results"]
    assert r["big"]["finish_reason"] == "error"
    assert "host-tier memory" in r["big"]["stop_reason"] and "NELSSA_HOST_CAPACITY" in r["big"]["stop_reason"]
    assert r["chat"]["finish_reason"] == "length"
    assert r["big_device"]["finish_reason"] == "length" and len(r["big_device"]["token_ids"]) == 8
    assert r["bad"]["finish_reason"] == "error" and "nelssa_offload" in r["bad"]["stop_reason"], r["bad"]


def test_unsupported_architecture_is_refused():
    spec = {"model": CUT, "mode": "on", "nelssa": NELSSA, "engine": {"hf_overrides": {"architectures": ["MistralForCausalLM"]}},
            "requests": [MIXED[4]]}
    with pytest.raises(AssertionError, match="NELSSA supports Llama-family models"):
        run_harness(spec)


def test_needle_accuracy_at_4_percent(model_dir):
    """RULER-style needles (7-digit values in real-text haystacks, nelssa.bench.accuracy's "short"
    set: 32 prompts of 1.3K-1.9K tokens, 8 depths, T_input 1024) through the real engine in this
    CPU's dtype (nelssa.cpu.cpu_dtype()): NELSSA at budget 4% is not worse than dense attention.

    One engine (run_set's default): each prompt runs first opted out of the host tier (nelssa_offload
    false: device KV, exact dense attention; the baseline) and then as a NELSSA request that hits the
    prefix cache, so the prompts are prefilled once. On a 2-vCPU AVX2 box: two engines on the former
    2.2K-2.8K "ci" set (~79K tokens) took 20.3 min, one engine 12.4 min (same answers), one engine on
    "short" (~51K tokens) 7.2 min. The full sweep is `python -m nelssa.bench.accuracy`.

    Verdict (paired, not a fixed margin; nelssa.bench.accuracy.paired_verdict): on the same prompts,
    lost = answers dense finds and NELSSA misses, gained = the reverse. For a method as accurate as
    dense each of the d = lost + gained discordant prompts goes either way with equal odds, so
    lost - gained has standard deviation sqrt(d); the test fails when lost - gained > 2 sqrt(d) (at
    least 1): with no gains, 5 lost answers fail, 4 pass. Numerical noise (another dtype or CPU) flips
    answers both ways and stays inside; a systematic loss grows like d and does not. Dense must answer
    >= 25% so the set means something.

    Measured on the 2-vCPU AVX2 box (AMD EPYC, fp32), 2026-12-01: dense 93.8, NELSSA 84.4 (3 lost, 0
    gained: passes); with 16 tokens per cluster (a known regression) NELSSA 75.0 (6 lost, 0 gained:
    net loss 6 > limit 4.9, fails). The 3 lost answers drop or garble the value's last digits; on the
    "ci" set the prompts NELSSA missed had the needle outside the window and 84-88% of dense
    attention's mass on the needle inside the selected clusters, as a prompt it answered (85%): at
    4% of ~2K tokens (~11 clusters of 8 per head) the answers on the margin flip (docs/results.md).
    Cheaper sets sharing haystacks through the prefix cache do not catch the regression ("multi2").
    """
    from nelssa.bench.accuracy import SETS, run_set

    res = run_set(model_dir, **SETS["short"], budget=0.04, timeout=1500)
    v = res["verdict"]
    for x in res["rows"]:
        if x["nelssa_ok"] != x["dense_ok"]:
            print(f"{x['id']}: dense {x['dense_text']!r}, NELSSA {x['nelssa_text']!r} (expected {x['value']})")
    print(f"needle accuracy ({res['dtype']}, {v['n']} prompts, {res['prompt_tokens']} tokens, "
          f"{res['wall_s']} s): NELSSA {v['acc_nelssa']:.1f}, dense {v['acc_dense']:.1f}; lost {v['lost']}, "
          f"gained {v['gained']}, limit {v['limit']}")
    assert v["acc_dense"] >= 25  # the model does retrieve needles at these lengths: the comparison means something
    assert v["ok"], v
