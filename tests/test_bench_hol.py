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
        a, b = r["phases_s"]["long_prefill"]
        assert 0 < a <= b <= r["phases_s"]["long_decode"][1]
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
    assert nel.get("nelssa:lane_rows_total", 0) >= 10, nel  # the long request's tokens came from the lane
    # drafts (lane_spec.py): the lane computed positions before the step sampled their tokens, and the step's
    # tokens confirmed them (greedy requests; every output above is NELSSA_OFF's all the same)
    assert nel.get("nelssa:lane_drafts_total{verified}", 0) >= 5, nel
    # no step waited for the host tier: the switch step computed the request on the device (lane.py, 0)
    assert nel["nelssa:offload_step_seconds_count"] == 0, nel
    assert set(s["targets"]) >= {"before_tpot_within_5pct", "prefill_max_gap_le_1s", "long_tpot_le_50ms"}
