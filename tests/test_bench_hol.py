"""The head-of-line benchmark (nelssa bench hol) end to end on the CPU: SmolLM2, the scaled-down
preset (short requests at a Poisson rate, one long prompt injected mid-run, 28 KV blocks of 128), NELSSA and
NELSSA_OFF as two AsyncLLM engines of one invocation, NELSSA with the long lane (lane.py) so the lane
runs under vLLM's serving front end. Asserts the run is well-formed, every request finished normally
and, at budget 1.0 in fp32, both modes produce the same tokens. Performance is judged on the H200 only
(README, docs/results.md)."""

import json
import os

import pytest

pytestmark = pytest.mark.engine


def test_hol_cpu_preset_is_well_formed_and_exact(tmp_path, cut_model_dir):
    model_dir = cut_model_dir  # SmolLM2's first 8 layers: the benchmark's machinery, not the model
    from nelssa.bench.hol import main
    out = tmp_path / "hol"
    # NELSSA as a variant (on:lane: the preset's NELSSA config with the lane) against the one stock run
    assert main(["--preset", "cpu", "--model", model_dir, "--out", str(out), "--timeout", "900",
                 "--modes", "off,on:lane", "--variant", 'lane={"lane": true, "host_reserve": "64MiB"}']) == 0
    s = json.loads((out / "hol.json").read_text())
    assert os.path.getsize(out / "hol.png") > 10_000
    assert s["variants"] == {"lane": {"lane": True, "host_reserve": "64MiB"}} and "on" not in s
    for key in ("targets", "outputs_equal", "outputs_total", "ratios_on_over_off"):  # per variant
        s[key] = s.pop(key + "_lane")
    s["on"] = s.pop("on:lane")
    for mode in ("on", "off"):
        r = s[mode]
        assert r["errors"] == [], r["errors"]
        assert r["before"]["n_short_arrivals"] > 0 and r["before"]["short_itl_p50_ms"] > 0
        assert r["long"][0]["tokens"] == s["scenario"]["long_out"]
        by_phase = r["long"][0]["itl_ms_by_phase"]  # one long request: all its gaps after its first token
        assert set(by_phase) == {"long_decode"} and by_phase["long_decode"]["n"] == r["long"][0]["tokens"] - 1
        by_slot = r["long"][0]["itl_ms_by_block_slot"]  # the same gaps by block slot (the engine's block size)
        assert sum(v["n"] for v in by_slot.values()) == r["long"][0]["tokens"] - 1, by_slot
        a, b = r["phases_s"]["long_prefill"]
        assert 0 < a <= b <= r["phases_s"]["long_decode"][1]
        # its TTFT split at its first scheduling (the engine core's clock against the bench's: hol.scheduled_at)
        x = r["long"][0]
        assert x["admitted_s"] >= -0.01 and x["prefill_s"] > 0, x
        assert abs(x["admitted_s"] + x["prefill_s"] - x["ttft_s"]) < 1e-6, x
        pa = r["preempted_at_s"]  # when the preemption counter rose (sampled): within the run's count
        assert all(t >= 0 and n > 0 for t, n in pa) and sum(n for _, n in pa) <= (r["preemptions"] or 0), pa
        f = {"on": "on_lane", "off": "off"}[mode]
        lines = (out / f"hol_{f}.jsonl").read_text().splitlines()
        assert len(lines) == s["outputs_total"]
        log = (out / f"hol_{f}.log").read_text()  # the engine's own log (vLLM logs to stdout)
        assert "vllm" in log.lower() and " ERROR " not in log, log[-2000:]
    # budget 1.0 in fp32: every output equals NELSSA_OFF's, the long request's (host tier, lane) first
    runs = {m: {r["id"]: r for r in map(json.loads, (out / f"hol_{f}.jsonl").read_text().splitlines())}
            for m, f in (("on", "on_lane"), ("off", "off"))}
    for rid, r in runs["off"].items():
        if r["kind"] == "long":
            assert runs["on"][rid]["token_ids"] == r["token_ids"], rid
    assert s["outputs_equal"] == s["outputs_total"], "budget 1.0 in fp32 must reproduce NELSSA_OFF's tokens"
    nel = s["on"]["nelssa"]  # the NELSSA connector's metrics reached the AsyncLLM front end
    assert nel.get("nelssa:moved_tokens_total", 0) >= s["scenario"]["long_len"] - 200, nel
    assert nel.get("nelssa:long_requests_total", 0) == 1, nel
    # host-tier memory (sparse/hostmem.py) reserved at start: the prompt's parts (~3.7 MiB per layer) went into
    # it, none into new mappings (without the reservation: one per layer); free memory is kept (whether the
    # long request's came back before the last step depends on which request finished last)
    assert nel.get("nelssa:host_memory_mappings_total", 0) == 0 and nel["nelssa:host_memory_free_bytes"] > 0, nel
    # where the moves' time went, by part (read, k-means, packing and copy): together within their total
    mv = s["on"]["move_split_s_per_move"]
    assert set(mv) == {"read", "kmeans", "pack"} and all(v > 0 for v in mv.values()), mv
    per_move = nel["nelssa:clustering_seconds_sum"] / nel["nelssa:clustering_seconds_count"]
    assert sum(mv.values()) <= per_move * 1.01, (mv, per_move)
    # the same moves by the hand-off thread's state (handoff.thread_clock): running, waiting for a core, blocked
    th = s["on"]["move_thread_s_per_move"]
    assert set(th) == {"cpu", "runq", "blocked"} and th["cpu"] > 0, th
    assert abs(sum(th.values()) - per_move) <= 0.05 * per_move + 1e-3, (th, per_move)
    assert nel.get("nelssa:lane_rows_total", 0) >= 10, nel  # the long request's tokens came from the lane
    # every lane batch counted once by what the steps computed beside it (lane.beside_bucket)
    bb = s["on"]["lane_batch_ms_by_beside"]
    assert bb and set(bb) <= {"0", "1-15", "16-47", "48+"} and all(v["ms"] > 0 for v in bb.values()), bb
    assert sum(v["batches"] for v in bb.values()) == nel["nelssa:lane_batch_seconds_count"], (bb, nel)
    # the lane's host calls by part (csrc/common.h KernelSplit): the fused pass is their bulk
    ks = s["on"]["host_call_split_us_per_call"]
    assert ks and set(ks) == {"prep", "fork", "tables", "items", "wait", "combine"} and ks["items"] > 0, ks
    # drafts (lane_spec.py): the lane computed positions before the step sampled their tokens, and the step's
    # tokens confirmed them (greedy requests; every output above is NELSSA_OFF's all the same)
    assert nel.get("nelssa:lane_drafts_total{verified}", 0) >= 5, nel
    # no step waited for the host tier: the switch step computed the request on the device (lane.py, 0)
    assert nel["nelssa:offload_step_seconds_count"] == 0, nel
    assert set(s["targets"]) >= {"before_tpot_within_5pct", "prefill_max_gap_le_1s", "long_tpot_le_50ms"}


def test_long_itl_by_phase_splits_a_long_requests_gaps():
    """hol.itl_by_phase: each gap counted once, in the phase of its later token; the run's last token (the
    end of long_decode) in long_decode."""
    from nelssa.bench.hol import itl_by_phase
    phases = {"before": (0.0, 1.0), "long_prefill": (1.0, 2.0), "long_decode": (2.0, 3.0)}
    got = itl_by_phase([1.5, 1.55, 1.65, 2.05, 3.0], phases)
    assert set(got) == {"long_prefill", "long_decode"}
    assert got["long_prefill"]["n"] == 2 and abs(got["long_prefill"]["max"] - 100.0) < 1e-6
    assert got["long_decode"]["n"] == 2 and abs(got["long_decode"]["mean"] - (400.0 + 950.0) / 2) < 1e-6
    from nelssa.bench.report import hol_md  # the report's table of them
    ph = {k: {"short_ttft_p99_ms": 1.0, "short_itl_p99_ms": 1.0} for k in phases}
    md = "\n".join(hol_md({"on": {**ph, "long": [{"id": "long0", "itl_ms_by_phase": got}]}}, "."))
    assert "| on | long0 | long_prefill | 2 | 75.0 / 75.0 / 100.0 |" in md, md


def test_preemption_times_from_the_samples_and_in_the_report():
    """hol.preempted_at: the sampled times at which the preemption counter rose, by how much (none without a
    sampled counter); the report names them beside the count."""
    from nelssa.bench.hol import preempted_at
    from nelssa.bench.report import hol_md
    samples = [{"t": 0.25 * i, "preemptions": p} for i, p in enumerate([0, 0, 3, 3, 3, 31, 31])]
    assert preempted_at(samples) == [[0.5, 3], [1.25, 28]]
    assert preempted_at([{"t": 0.0}, {"t": 0.25}]) == [] and preempted_at([]) == []
    ph = {k: {"short_ttft_p99_ms": 1.0, "short_itl_p99_ms": 1.0} for k in ("before", "long_prefill", "long_decode")}
    md = "\n".join(hol_md({"on": {**ph, "preemptions": 31.0, "preempted_at_s": preempted_at(samples)},
                           "off": {**ph, "preemptions": 0.0, "preempted_at_s": []}}, "."))
    assert "Preemptions (on): 31; 3 at 0.50 s, 28 at 1.25 s" in md and "Preemptions (off)" not in md, md


def test_long_ttft_split_at_the_first_scheduling_and_in_the_report():
    """hol.scheduled_at / long_split: a long request's TTFT = its wait until vLLM first scheduled it + its
    prefill, from the engine's scheduled_ts (its request stats) on the run's clock; None without stats (an
    engine without log stats, a request without a token). The report shows the split per request."""
    from types import SimpleNamespace

    from nelssa.bench.hol import long_split, scheduled_at
    from nelssa.bench.report import hol_md
    assert scheduled_at(SimpleNamespace(metrics=SimpleNamespace(scheduled_ts=105.5)), 100.0) == 5.5
    assert scheduled_at(SimpleNamespace(metrics=SimpleNamespace(scheduled_ts=0.0)), 100.0) is None  # not scheduled
    assert scheduled_at(SimpleNamespace(metrics=None), 100.0) is None and scheduled_at(None, 100.0) is None
    r = {"start": 20.0, "scheduled": 31.5, "stamps": [46.5, 46.6]}
    assert long_split(r) == {"admitted_s": 11.5, "prefill_s": 15.0}
    assert long_split({**r, "scheduled": None}) == {"admitted_s": None, "prefill_s": None}
    assert long_split({**r, "stamps": []})["prefill_s"] is None
    ph = {k: {"short_ttft_p99_ms": 1.0, "short_itl_p99_ms": 1.0} for k in ("before", "long_prefill", "long_decode")}
    on = [{"id": "long1", "ttft_s": 26.5, **long_split(r)}]
    off = [{"id": "long1", "ttft_s": 25.7, **long_split({**r, "scheduled": None})}]
    md = "\n".join(hol_md({"on": {**ph, "long": on}, "off": {**ph, "long": off}}, "."))
    assert "| on | long1 | 26.50 | 11.50 | 15.00 | – | – |" in md and "| off | long1 |" not in md, md
    on[0]["longest_gap"] = {"s": 0.586, "after_token": 0, "tpot_ms_without": 43.2}
    md = "\n".join(hol_md({"on": {**ph, "long": on}}, "."))
    assert "| on | long1 | 26.50 | 11.50 | 15.00 | 0.59 (0) | 43.2 |" in md, md


def test_itl_by_block_slot_tells_a_blocks_first_slot_apart():
    """hol.itl_by_block_slot: gap i computes position n_prompt + i; gaps at a block's first slot apart, and
    gap 0 (the switch and the first lane batch) apart from both, whatever its slot."""
    from nelssa.bench.hol import itl_by_block_slot
    stamps = [0.0, 0.4]  # gap 0: 400 ms
    for i in range(1, 40):  # 20 ms gaps, 100 ms where position 30 + i starts a block of 16 (i = 2, 18, 34)
        stamps.append(stamps[-1] + (0.1 if (30 + i) % 16 == 0 else 0.02))
    got = itl_by_block_slot(stamps, 30, 16)
    assert got["switch"]["n"] == 1 and abs(got["switch"]["mean"] - 400.0) < 1e-6
    assert got["first"]["n"] == 3 and abs(got["first"]["p50"] - 100.0) < 1e-6
    assert got["other"]["n"] == 36 and abs(got["other"]["mean"] - 20.0) < 1e-6
    at_boundary = itl_by_block_slot(stamps, 32, 16)  # gap 0 at a block's first slot: still the switch
    assert at_boundary["switch"]["n"] == 1 and at_boundary["first"]["n"] == 2
    assert itl_by_block_slot(stamps, 30, 0) is None
    from nelssa.bench.report import hol_md  # the report's table of them
    ph = {k: {"short_ttft_p99_ms": 1.0, "short_itl_p99_ms": 1.0} for k in ("before", "long_prefill", "long_decode")}
    md = "\n".join(hol_md({"on": {**ph, "long": [{"id": "long0", "itl_ms_by_block_slot": got}]}}, "."))
    assert "| on | long0 | 400.0 | 100.0 / 100.0 (3) | 20.0 / 20.0 (36) |" in md, md


def test_p99_from_counts_a_phase_from_later_on():
    """hol.p99_from: the phase's TTFT p99 of arrivals and ITL p99 of gaps from ``skip`` seconds into it
    on (a diagnostic of where a phase's p99 comes from; the targets keep the whole phase)."""
    from nelssa.bench.hol import p99_from
    slow = {"start": 10.0, "stamps": [10.2, 10.3, 10.45]}        # arrives at the phase's start: TTFT 200 ms
    late = {"start": 10.6, "stamps": [10.62, 10.63, 10.64, 11.5]}  # TTFT 20 ms; gaps 10, 10, 860 (at 11.5)
    got = p99_from([slow, late], 10.0, 11.2, skips=(0.0, 0.5))
    assert got["0"]["n_arrivals"] == 2 and got["0"]["n_gaps"] == 4  # 10.3, 10.45, 10.63, 10.64 (11.5 is past hi)
    assert got["0.5"]["n_arrivals"] == 1 and abs(got["0.5"]["short_ttft_p99_ms"] - 20.0) < 1e-6
    assert got["0.5"]["n_gaps"] == 2 and abs(got["0.5"]["short_itl_p99_ms"] - 10.0) < 1e-6
    assert got["0"]["short_itl_p99_ms"] > 140  # the 150-ms gap at 10.45 counts from 0 s on


def test_targets_of_a_nelssa_only_run():
    """hol.targets without NELSSA_OFF's run (e.g. --modes on:spin in a call of its own): the targets of
    NELSSA's own phases are checked, those against stock's are None."""
    from nelssa.bench.hol import targets
    ph = lambda ttft, itl, gap=0.1: {"short_ttft_p99_ms": ttft, "short_itl_p99_ms": itl,  # noqa: E731
                                     "short_tpot_p50_ms": 8.0, "max_gap_without_short_token_s": gap}
    on = {"before": ph(95.2, 37.3), "long_prefill": ph(459.3, 112.5, 0.16), "long_decode": ph(153.1, 55.0),
          "long": [{"ttft_s": 13.28, "tpot_ms": 63.4}, {"ttft_s": 29.04, "tpot_ms": 54.6}], "output_tok_s": 951.3}
    t = targets(on, None)  # H100 run 68's numbers
    assert t["decode_ttft_p99_le_1.5x_before"] is False and t["decode_itl_p99_le_1.5x_before"] is True
    assert t["prefill_max_gap_le_1s"] is True and t["prefill_ttft_p99_le_2s"] is True
    assert t["long_tpot_le_50ms"] is False
    assert t["before_tpot_within_5pct"] is None and t["long_ttft_le_stock"] is None and t["tok_s_ge_stock"] is None
    off = {"before": ph(101.6, 41.1), "long": [{"ttft_s": 13.49, "tpot_ms": 10.2}, {"ttft_s": 26.07, "tpot_ms": 37.5}],
           "output_tok_s": 985.3}
    off["before"]["short_tpot_p50_ms"] = 8.4
    t = targets(on, off)
    assert t["before_tpot_within_5pct"] is True and t["long_ttft_le_stock"] is False and t["tok_s_ge_stock"] is False


def test_target_values_show_each_bound():
    """hol.target_values: each target's value and bound beside its verdict (the verdicts are hol.targets'),
    on H100 run 109's numbers (rounded): the decode phase's ITL p99 over 1.5x the before phase's, tok/s
    0.009% under stock's; the rest met."""
    from nelssa.bench.hol import _table, target_values, targets
    ph = lambda ttft, itl, gap=0.05, tpot=7.68: {"short_ttft_p99_ms": ttft, "short_itl_p99_ms": itl,  # noqa: E731
                                                 "short_tpot_p50_ms": tpot, "max_gap_without_short_token_s": gap}
    on = {"before": ph(88.5, 32.1), "long_prefill": ph(1010.6, 263.8, 0.33), "long_decode": ph(124.8, 48.29),
          "long": [{"ttft_s": 9.80, "tpot_ms": 49.8}, {"ttft_s": 25.32, "tpot_ms": 42.8}], "output_tok_s": 985.65}
    off = {"before": ph(78.9, 29.5, tpot=7.54), "long": [{"ttft_s": 13.63, "tpot_ms": 10.1},
                                                        {"ttft_s": 26.12, "tpot_ms": 38.0}], "output_tok_s": 985.74}
    v = target_values(on, off)
    assert {k: t["met"] for k, t in v.items()} == targets(on, off)
    itl = v["decode_itl_p99_le_1.5x_before"]
    assert itl["met"] is False and abs(itl["bound"] - 48.15) < 1e-9 and itl["value"] == 48.29
    assert v["tok_s_ge_stock"] == {"value": 985.65, "bound": 985.74, "met": False}
    assert v["long_ttft_le_stock"] == {"value": 25.32, "bound": 26.12, "met": True}
    assert abs(v["before_tpot_within_5pct"]["bound"] - 1.05 * 7.54) < 1e-9 and v["before_tpot_within_5pct"]["met"]
    assert [k for k, t in v.items() if not t["met"]] == ["decode_itl_p99_le_1.5x_before", "tok_s_ge_stock"]
    alone = target_values(on, None)  # without stock's run: those against it are not measurable
    assert alone["tok_s_ge_stock"]["met"] is None and alone["long_ttft_le_stock"]["bound"] is None
    assert alone["long_tpot_le_50ms"] == {"value": 49.8, "bound": 50.0, "met": True}
    line = _table({"target_values": v}).splitlines()[-1]
    assert "decode_itl_p99_le_1.5x_before 48.29/48.15" in line and "tok_s_ge_stock 985.65/985.74" in line


def test_gpu_state_by_phase_and_in_the_table():
    """gpustate.by_phase: each phase's SM clock (p50, min), mean power, max temperature and the share of
    samples with a throttling reason active (a power cap, a thermal or hardware slowdown; idle is not one),
    and its line in the table. Without NVML (this box) the sampler samples nothing."""
    from nelssa.bench import gpustate
    s = [{"t": 1.0, "sm_mhz": 1980, "power_w": 400.0, "temp_c": 50, "reasons": 0x1},
         {"t": 2.0, "sm_mhz": 1980, "power_w": 420.0, "temp_c": 52, "reasons": 0x0},
         {"t": 21.0, "sm_mhz": 1600, "power_w": 690.0, "temp_c": 70, "reasons": 0x4},
         {"t": 22.0, "sm_mhz": 1755, "power_w": 680.0, "temp_c": 74, "reasons": 0x4 | 0x20},
         {"t": 23.0, "sm_mhz": 1980, "power_w": 500.0, "temp_c": 71, "reasons": 0x0}]
    g = gpustate.by_phase(s, {"before": [0.0, 20.0], "long_prefill": [20.0, 30.0], "long_decode": [30.0, float("inf")]})
    assert g["before"] == {"n": 2, "sm_mhz_p50": 1980, "sm_mhz_min": 1980, "power_w_mean": 410.0, "temp_c_max": 52,
                           "throttled": 0.0, "reasons": []}
    assert g["long_prefill"]["sm_mhz_min"] == 1600 and g["long_prefill"]["sm_mhz_p50"] == 1755
    assert g["long_prefill"]["throttled"] == round(2 / 3, 3) and g["long_prefill"]["reasons"] == ["sw_power_cap", "sw_thermal"]
    assert g["long_decode"] == {"n": 0} and gpustate.by_phase([], {"before": [0, 1]}) is None
    row = gpustate.text(g)
    from nelssa.bench.report import hol_md
    ph = {k: {"short_ttft_p99_ms": 1.0, "short_itl_p99_ms": 1.0} for k in ("before", "long_prefill", "long_decode")}
    assert f"GPU by phase (off): {row}" in "\n".join(hol_md({"off": {**ph, "gpu_by_phase": g}}, "."))
    assert "before 1980 MHz (min 1980) 410 W 52 C" in row and "throttled 67% sw_power_cap,sw_thermal" in row
    assert "long_decode" not in row
    import torch
    if not torch.cuda.is_available():
        assert gpustate.Sampler(0.0, 0.01).stop() == []


def test_itl_steps_name_the_steps_behind_a_p99():
    """hol.itl_steps: gaps that end together are one step; the longest steps with the requests that
    waited on each and the first tokens that came with it; how many of the longest steps hold the top 1%
    of gaps. 50 requests decode 10 ms steps for 1 s; at 0.5 s a 60-ms step with two prompts done: its 50
    gaps are the top 10% of ~500, so the p99 is that one step."""
    from nelssa.bench.hol import itl_steps
    ends = [0.01 * i for i in range(1, 50)] + [0.55] + [0.55 + 0.01 * i for i in range(1, 45)]
    shorts = [{"start": 0.0, "stamps": [e + 1e-4 * k for e in [0.0] + ends]} for k in range(50)]
    shorts += [{"start": 0.5, "stamps": [0.5501, 0.5601]}, {"start": 0.5, "stamps": [0.5502]}]  # done in the slow step
    st = itl_steps(shorts, 0.0, 2.0)
    assert st["worst"][0] == [0.55, 60.0, 50, 2] and st["p99_steps"] == 1
    assert all(w[1] == 10.0 and w[3] == 0 for w in st["worst"][1:])
    assert max(w[2] for w in st["worst"][1:]) <= 51  # a step: every request that decoded in it, once
    assert itl_steps(shorts, 5.0, 6.0) == {"p99_steps": None, "worst": []}
    from nelssa.bench.report import hol_md  # and in the report
    ph = {k: {"short_ttft_p99_ms": 1.0, "short_itl_p99_ms": 1.0} for k in ("before", "long_prefill", "long_decode")}
    ph["long_decode"]["itl_steps"] = st
    md = "\n".join(hol_md({"on": ph}, "."))
    assert "Long decode phase (on): short ITL p99 from its 1 longest steps" in md and "0.55 s 60.0 ms x50 (2)" in md, md


def test_longest_gap_of_a_long_request_and_its_line_in_the_table():
    """hol.longest_gap: a long request's longest inter-token gap (a switch hold: no token while its hand-off
    finishes), the token it follows and the TPOT without it; the table names it per long request."""
    from nelssa.bench.hol import _table, longest_gap
    stamps = [30.0 + 0.04 * i for i in range(31)]  # 30 gaps of 40 ms, then a 1.5-s hold, then 224 of 40 ms
    stamps += [stamps[-1] + 1.5 + 0.04 * i for i in range(225)]
    g = longest_gap(stamps)
    assert g["after_token"] == 30 and abs(g["s"] - 1.5) < 1e-9
    assert abs(g["tpot_ms_without"] - 40.0) < 1e-6  # the TPOT with it: (254 * 40 + 1500) / 255 = 45.7 ms
    assert longest_gap([1.0]) is None and longest_gap([1.0, 1.2])["tpot_ms_without"] is None
    ph = {k: {"short_ttft_p50_ms": 1.0, "short_ttft_p99_ms": 1.0, "short_itl_p50_ms": 1.0, "short_itl_p99_ms": 1.0,
              "short_tpot_p50_ms": 1.0, "max_gap_without_short_token_s": 0.1}
          for k in ("before", "long_prefill", "long_decode")}
    long = [{"id": "long0", "ttft_s": 9.9, "tpot_ms": 45.7, "longest_gap": g},
            {"id": "long1", "ttft_s": 25.6, "tpot_ms": None, "longest_gap": None}]
    table = _table({"on": {**ph, "long": long, "output_tok_s": 985.0, "preemptions": 0.0, "errors": []}})
    assert "on  long longest gap: long0 1.50 s after token 30 (TPOT 40.0 ms without it)\n" in table + "\n", table
    # the moves' line: by part, and by the hand-off thread's state
    table = _table({"on": {**ph, "long": long, "output_tok_s": 985.0, "preemptions": 0.0, "errors": [],
                           "move_split_s_per_move": {"read": 0.06, "kmeans": 0.3, "pack": 0.2},
                           "move_thread_s_per_move": {"cpu": 0.1, "runq": 0.05, "blocked": 0.41}}})
    assert ("on  moves, s per move: read 0.060  kmeans 0.300  pack 0.200  (thread: cpu 0.100  runq 0.050  "
            "blocked 0.410)") in table, table


def test_compile_source_from_the_engine_log_and_in_the_table():
    """hol.compile_source: from a mode's engine log (lines as vLLM 0.26 writes them on the H100), whether the
    model was compiled afresh or loaded from vLLM's torch.compile cache, and in how many seconds; None for
    an eager engine's log. The table says which per mode."""
    from nelssa.bench.hol import _table, compile_source
    pre = "(EngineCore pid=4071) INFO 12-07 12:10:57 "
    cached = [pre + "[backends.py:292] Directly load the compiled graph(s) for compile range (1, 8192) from the "
                    "cache, took 2.659 s", pre + "[monitor.py:53] torch.compile took 5.84 s in total"]
    fresh = [pre + "[backends.py:393] Compiling a graph for compile range (1, 8192) takes 7.79 s",
             pre + "[monitor.py:53] torch.compile took 20.98 s in total"]
    assert compile_source(cached) == {"cached": True, "s": 5.84}
    assert compile_source(fresh) == {"cached": False, "s": 20.98}
    assert compile_source([pre + "[core.py:340] init engine (profile, create kv cache, warmup model) took 9.1 s"]) is None
    ph = {k: {"short_ttft_p50_ms": 1.0, "short_ttft_p99_ms": 1.0, "short_itl_p50_ms": 1.0, "short_itl_p99_ms": 1.0,
              "short_tpot_p50_ms": 1.0, "max_gap_without_short_token_s": 0.1}
          for k in ("before", "long_prefill", "long_decode")}
    base = {**ph, "long": [], "output_tok_s": 985.0, "preemptions": 0.0, "errors": []}
    table = _table({"off": {**base, "torch_compile": compile_source(fresh)},
                    "on": {**base, "torch_compile": compile_source(cached)}})
    assert "off torch.compile: compiled in 21.0 s" in table and "on  torch.compile: loaded from the cache in 5.8 s" in table
    assert "torch.compile" not in _table({"on": {**base, "torch_compile": None}})
