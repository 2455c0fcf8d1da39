"""Serving workloads (nelssa.bench.trace / workloads / serving / report) without an engine: trace
scaling keeps shares, Poisson arrivals, long-fraction draws, growth plans, /metrics parsing, the
per-class summary and NELSSA/OFF ratios, plots and the Markdown report. Seconds."""

import json
import math
import os
import statistics

import pytest

from nelssa.bench import trace as tr
from nelssa.bench import workloads as wl
from nelssa.bench.common import pct, ratio, run_metrics

TRACE = [{"input": 1000, "output": 100}, {"input": 50_000, "output": 400}, {"input": 100_000, "output": 2000},
         {"input": 5, "output": 1}, {"input": 20_000, "output": 1000}]


def test_scale_trace_keeps_each_requests_share():
    scaled, sc = tr.scale_trace(TRACE, max_model_len=3200, max_output=32, min_input=16)
    assert sc.max_input == 3168 and sc.trace_max_input == 100_000 and sc.trace_max_output == 2000
    assert scaled[2] == {"input": 3168, "output": 32}            # the longest maps to the model's maximum
    for r, s in zip(TRACE, scaled):
        if r["input"] * sc.in_factor >= 16:                      # share of the maximum kept (to rounding)
            assert s["input"] / sc.max_input == pytest.approx(r["input"] / 100_000, abs=1 / sc.max_input)
        assert 1 <= s["output"] <= 32
    assert scaled[3]["input"] == 16                              # the floor
    with pytest.raises(ValueError):
        tr.scale_trace(TRACE, max_model_len=32, max_output=32)


def test_run_metrics_counters_grow_gauges_stay_levels():
    first = {"nelssa:moved_tokens_total": 100.0, "nelssa:move_split_seconds_total{kmeans}": 1.0,
             "nelssa:clustering_seconds_count": 2.0, "nelssa:host_memory_free_bytes": 64.0, "nelssa:host_bytes": 10.0}
    last = {"nelssa:moved_tokens_total": 350.0, "nelssa:move_split_seconds_total{kmeans}": 1.5,
            "nelssa:clustering_seconds_count": 5.0, "nelssa:host_memory_free_bytes": 64.0, "nelssa:host_bytes": 0.0,
            "vllm:x": 3.0}
    m = run_metrics(first, last, lambda k: k.startswith("nelssa:"))
    assert m == {"nelssa:moved_tokens_total": 250.0, "nelssa:move_split_seconds_total{kmeans}": 0.5,
                 "nelssa:clustering_seconds_count": 3.0, "nelssa:host_memory_free_bytes": 64.0, "nelssa:host_bytes": 0.0}


def test_poisson_arrivals_rate_and_seed():
    t = tr.poisson_times(4.0, n=4000, seed=1)
    assert t[0] == 0.0 and t == sorted(t) and t == tr.poisson_times(4.0, n=4000, seed=1)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.06)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: sd = mean
    d = tr.poisson_times(2.0, duration=10.0, seed=0, start=5.0)
    assert d[0] == 5.0 and all(x < 15.0 for x in d)
    with pytest.raises(ValueError):
        tr.poisson_times(0, n=3)


def test_mixed_plan_long_fraction_and_classes():
    scaled, _ = tr.scale_trace(TRACE * 20, 3200, 32)
    plan = tr.mixed_plan(scaled, t_input=1500, rate=2.0, n=2000, long_fraction=0.3, seed=3)
    longs = [r for r in plan if r["kind"] == "long"]
    assert len(longs) / len(plan) == pytest.approx(0.3, abs=0.04)
    assert all(r["n_in"] >= 1500 for r in longs) and all(r["n_in"] < 1500 for r in plan if r["kind"] == "short")
    assert len({r["id"] for r in plan}) == len(plan)
    nat = tr.mixed_plan(scaled, 1500, 2.0, 2000, None, seed=3)      # the trace's own share (2 of 5)
    assert sum(r["kind"] == "long" for r in nat) / 2000 == pytest.approx(0.4, abs=0.04)
    with pytest.raises(ValueError, match="no long"):
        tr.mixed_plan(scaled, 10**6, 1.0, 5, 0.5)
    sh = tr.shares(plan)
    assert sh["long"]["n"] + sh["short"]["n"] == 2000


def test_growth_plan_passes_t_input():
    p = tr.growth_plan(3, 400, None, 1024)
    assert [r["n_out"] for r in p] == [800] * 3 and all(r["at"] == 0 for r in p)
    assert all(r["n_in"] < 1024 < r["n_in"] + r["n_out"] for r in p)
    with pytest.raises(ValueError, match="grow past"):
        tr.growth_plan(3, 400, None, 2000)


def test_load_real_trace_head():
    path = tr.default_trace()
    if not os.path.exists(path):
        pytest.skip("shared Mooncake trace not present")
    rows = tr.load_trace(path, limit=50)
    assert len(rows) == 50 and all(r["input"] > 0 and r["output"] > 0 for r in rows)


def test_parse_metrics_sums_label_sets():
    from nelssa.bench.serving import parse_metrics, sample_of
    text = """# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_preemptions_total x
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
# HELP vllm:kv_cache_usage_perc x
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# HELP nelssa:moved_tokens_total x
# TYPE nelssa:moved_tokens_total counter
nelssa:moved_tokens_total 1234.0
# HELP other_metric x
# TYPE other_metric gauge
other_metric 9.0
"""
    m = parse_metrics(text)
    assert m["vllm:num_requests_running"] == 5.0 and "other_metric" not in m
    s = sample_of(m)
    assert s["running"] == 5.0 and s["preemptions"] == 7.0 and s["kv_usage"] == 0.5 and s["waiting"] == 0.0
    assert s["nelssa:moved_tokens_total"] == 1234.0
    # several instances (P/D: P's and D's /metrics; or a server's engines): counts add up, the KV-use
    # fraction is the fullest instance's (a P/D run had reported 152%)
    from nelssa.bench.serving import combine_metrics
    two = combine_metrics([m, parse_metrics(text.replace(" 0.5", " 0.75").replace(" 7.0", " 1.0"))])
    assert two["vllm:kv_cache_usage_perc"] == 0.75 and two["vllm:num_preemptions_total"] == 8.0
    assert two["vllm:num_requests_running"] == 10.0
    assert parse_metrics(text + 'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25\n')[
        "vllm:kv_cache_usage_perc"] == 0.5
    # a part label is kept as name{part} (as the in-process scrape names it: the hol analysis reads a lane
    # batch's and a move's time by part; summed over the engines, the parts were lost)
    parts = parse_metrics("""# HELP nelssa:lane_timeline_seconds x
# TYPE nelssa:lane_timeline_seconds counter
nelssa:lane_timeline_seconds_total{engine="0",model_name="m",part="host"} 2.0
nelssa:lane_timeline_seconds_total{engine="1",model_name="m",part="host"} 1.0
nelssa:lane_timeline_seconds_total{engine="0",model_name="m",part="lead"} 0.5
""")
    assert parts == {"nelssa:lane_timeline_seconds_total{host}": 3.0, "nelssa:lane_timeline_seconds_total{lead}": 0.5}
    beside = parse_metrics("""# HELP nelssa:lane_beside_batches x
# TYPE nelssa:lane_beside_batches counter
nelssa:lane_beside_batches_total{beside="16-47",engine="0",model_name="m"} 7.0
""")  # lane batches by the requests beside them (lane.beside_bucket): the same keying
    assert beside == {"nelssa:lane_beside_batches_total{16-47}": 7.0}


def test_later_scrapes_ask_only_for_the_samples_kept():
    """After a URL's first, full scrape, the replay's /metrics samples ask vLLM's endpoint (prometheus_client's
    ``name[]``) for the samples it keeps: METRICS' and nelssa:*'s, no bucket, no _created, and also those of
    families with no sample yet (a labelled counter before its first increment). A full NELSSA /metrics
    took 9 ms to generate and 25 to parse on the 2-vCPU box, a gap in every request's stream."""
    from urllib.parse import parse_qs, urlparse

    from nelssa.bench.serving import METRICS, metrics_url, sample_names
    text = """# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# HELP vllm:e2e_request_latency_seconds x
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 1.5
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 2.0
# HELP nelssa:moved_tokens_total x
# TYPE nelssa:moved_tokens_total counter
nelssa:moved_tokens_total{engine="0",model_name="m"} 1234.0
nelssa:moved_tokens_created{engine="0",model_name="m"} 1.7e9
# HELP nelssa:migration_seconds x
# TYPE nelssa:migration_seconds histogram
nelssa:migration_seconds_bucket{engine="0",le="0.1",model_name="m"} 0.0
nelssa:migration_seconds_sum{engine="0",model_name="m"} 0.0
nelssa:migration_seconds_count{engine="0",model_name="m"} 0.0
# HELP nelssa:lane_batches_total x
# TYPE nelssa:lane_batches_total counter
# HELP nelssa:host_bytes x
# TYPE nelssa:host_bytes gauge
nelssa:host_bytes{engine="0",model_name="m"} 0.0
# HELP other_metric x
# TYPE other_metric gauge
other_metric 9.0
"""
    names = sample_names(text)
    assert set(names) == set(METRICS.values()) | {
        "nelssa:moved_tokens_total", "nelssa:migration_seconds_sum", "nelssa:migration_seconds_count",
        "nelssa:lane_batches_total", "nelssa:host_bytes"}, names
    url = metrics_url("http://127.0.0.1:8000/metrics", names)
    q = urlparse(url)  # /metrics/: vLLM's mounted prometheus_client app (its /metrics route ignores name[])
    assert q.path == "/metrics/" and sorted(parse_qs(q.query)["name[]"]) == sorted(names)
    assert metrics_url("http://h/metrics", None) == "http://h/metrics"


def _rec(i, kind, point, start, ttft, itl, ok=True):
    stamps = []
    if ok:
        t = start + ttft
        stamps = [t]
        for d in itl:
            t += d
            stamps.append(t)
    return {"id": f"{kind}{i}", "kind": kind, "point": point, "at": start, "n_in": 10, "n_out": len(itl) + 1,
            "start": start, "success": ok, "error": "" if ok else "boom", "ttft_s": ttft if ok else None,
            "output_tokens": len(itl) + 1 if ok else 0, "prompt_len": 10, "stamps": stamps}


def _runs():
    runs = {}
    for mode, tp in (("on", 0.02), ("off", 0.05)):
        recs = [_rec(i, "short", "p", i * 0.5, 0.1, [tp] * 9) for i in range(10)]
        recs += [_rec(0, "long", "p", 1.0, 2.0, [0.1] * 19), _rec(1, "long", "p", 1.0, 2.0, [], ok=mode == "on")]
        samples = [{"t": t * 0.5, "point": "p", "running": 2.0 + (t % 3), "waiting": float(mode == "off"),
                    "kv_usage": 0.1 * (t % 10), "preemptions": float(t // 4 if mode == "off" else 0),
                    "generation_tokens": 10.0 * t} for t in range(14)]
        runs[mode] = {"requests": recs, "samples": samples, "points": {"p": [0.0, 7.0]}}
    return runs


def test_summary_percentiles_ratios_and_errors():
    assert pct([], 50) is None and pct([1, 2, 3, 4], 50) == 2.5 and ratio(1, 0) is None and ratio(1, 2) == 0.5
    runs = _runs()
    s = wl.summarise(runs, {"workload": "mixed"})
    on, off = s["modes"]["on"]["p"], s["modes"]["off"]["p"]
    assert on["classes"]["short"]["tpot_ms_p99"] == pytest.approx(20.0)
    assert off["classes"]["short"]["tpot_ms_p50"] == pytest.approx(50.0)
    assert on["classes"]["short"]["ttft_ms_p50"] == pytest.approx(100.0)
    assert off["classes"]["long"]["errors"] == ["long1"] and off["classes"]["long"]["ok"] == 1
    assert off["preemptions"] == 3.0 and on["running_max"] == 4.0 and off["waiting_max"] == 1.0
    r = s["ratios_on_over_off"]["p"]
    assert r["classes.short.tpot_ms_p99"] == pytest.approx(0.4)
    assert r["decode_tok_s"] == pytest.approx(on["decode_tok_s"] / off["decode_tok_s"])
    toks = sum(x["output_tokens"] for x in runs["on"]["requests"] if x["success"])
    a = min(x["start"] for x in runs["on"]["requests"])
    b = max(x["stamps"][-1] for x in runs["on"]["requests"] if x["stamps"])
    assert on["decode_tok_s"] == pytest.approx(toks / (b - a))


def test_migration_windows_split_the_inter_token_latency(tmp_path):
    """A growth run's migrations: the /metrics intervals with one in flight, and the ITL of tokens in them
    against the rest (issue 13's jitter); the report shows the table."""
    from nelssa.bench.report import workload_md
    st, cp = "nelssa:migrations_started_total", "nelssa:migrations_completed_total"
    # one migration in flight from ~1.2 s to ~2.1 s (samples every 0.5 s)
    samples = [{"t": 0.5 * i, "point": "g", "running": 2.0, "waiting": 0.0, "kv_usage": 0.5, "preemptions": 0.0,
                st: float(i >= 3), cp: float(i >= 5), "nelssa:moved_tokens_total": 9000.0 * (i >= 5),
                "nelssa:clustering_seconds_sum": 0.8 * (i >= 5), "nelssa:migration_seconds_sum": 0.9 * (i >= 5),
                "nelssa:migration_seconds_count": float(i >= 5)} for i in range(9)]
    assert wl.handoff_windows(samples) == [(1.0, 1.5), (1.5, 2.0), (2.0, 2.5)]
    # tokens every 10 ms, except 60-ms gaps inside the window
    stamps, t = [], 0.1
    while t < 4.0:
        stamps.append(t)
        t += 0.06 if 1.0 <= t < 2.5 else 0.01
    rec = _rec(0, "growing", "g", 0.0, 0.1, [b - a for a, b in zip(stamps, stamps[1:])])
    out = wl.point_stats([rec], samples, [0.0, 4.0])
    h = out["handoff"]
    assert h["windows"] == 3 and h["window_s"] == pytest.approx(1.5)
    assert h["itl_ms_during_p50"] == pytest.approx(60.0, abs=1.0) and h["itl_ms_outside_p99"] == pytest.approx(10.0, abs=1.0)
    assert h["itl_during_n"] + h["itl_outside_n"] == len(rec["stamps"]) - 1
    no = wl.point_stats([rec], [{**x, st: 0.0, cp: 0.0} for x in samples], [0.0, 4.0])
    assert "handoff" not in no  # no migration: no split
    md = "\n".join(workload_md({"workload": "growth", "time": "t", "modes": {"on": {"g": out}}}, "."))
    assert "| on | g | 1 / 1 | 9,000 | 0.8 | 0.9 | 1.5 | 60.0 / 60.0 / 60.0 | 10.0 / 10.0 |" in md


def test_recalls_are_shown_within_the_preemptions():
    """A recall goes back to the device through vLLM's preemption, so vllm:num_preemptions counts it: the
    console table and the report say how many of a point's preemptions were recalls (H100 growth run of
    2026-12-05: 16 preemptions, all recalls, beside stock's 29 from pressure)."""
    from nelssa.bench.report import workload_md
    rec = _rec(0, "growing", "g", 0.0, 0.1, [0.01] * 20)
    samples = [{"t": 0.5 * i, "point": "g", "running": 2.0, "waiting": 0.0, "kv_usage": 0.5, "preemptions": 3.0 * (i >= 2),
                "nelssa:recalls_total": 2.0 * (i >= 2), "nelssa:migrations_completed_total": 2.0}
               for i in range(6)]
    on = wl.point_stats([rec], samples, [0.0, 3.0])
    off = wl.point_stats([rec], [{k: v for k, v in x.items() if not k.startswith("nelssa:")} for x in samples],
                         [0.0, 3.0])
    summ = {"workload": "growth", "time": "t", "modes": {"on": {"g": on}, "off": {"g": off}}}
    table = wl._table(summ)
    assert "preemptions 3 (2 recalls)" in table and "preemptions 3\n" in table + "\n"
    md = "\n".join(workload_md(summ, "."))
    assert "| 3 (2 recalls) |" in md and "| 3 |" in md
    # recalls by load (recall.py) are no preemptions: only the recomputed ones are named among them
    both = [{**x, "nelssa:recalls_total": 5.0 * (i >= 2), "nelssa:recalls_recomputed_total": 2.0 * (i >= 2)}
            for i, x in enumerate(samples)]
    mixed = wl.point_stats([rec], both, [0.0, 3.0])
    assert "preemptions 3 (2 recalls)" in wl._table({**summ, "modes": {"on": {"g": mixed}}})
    # every recall by load (no recalls_recomputed metric any more): none of the preemptions is a recall
    loads = [{**x, "nelssa:recalls_total": 5.0 * (i >= 2), "nelssa:recall_load_seconds_count": 5.0 * (i >= 2)}
             for i, x in enumerate(samples)]
    by_load = wl.point_stats([rec], loads, [0.0, 3.0])
    assert "preemptions 3\n" in wl._table({**summ, "modes": {"on": {"g": by_load}}}) + "\n"


def test_plots_and_report(tmp_path):
    from nelssa.bench.report import main as report
    runs = _runs()
    s = wl.summarise(runs, {"workload": "mixed", "time": "t", "preset": {"nelssa": {"T_input": 2048}, "server": []},
                            "T_input": 2048, "command": "nelssa bench mixed", "model": "m", "failed_modes": {}})
    s["plots"] = wl.plot_all(runs, s, str(tmp_path))
    assert s["plots"] == ["throughput.png", "running.png", "short_tpot_cdf.png", "itl.png"]
    for p in s["plots"]:
        assert os.path.getsize(tmp_path / p) > 5_000
    (tmp_path / "summary.json").write_text(json.dumps(s))
    # a calibration next to it, one level down
    from nelssa.bench import calibrate as cal
    m = cal.LatencyModel(M_kv=4096.0, bw_dev=40e9, t_dense0=2e-5, C=14, t_search0=3e-5, S=0.04, bw_host=6e9,
                         t_base=6e-5)
    (tmp_path / "cal").mkdir()
    (tmp_path / "cal" / "calibration.json").write_text(json.dumps(cal.calibration_doc(m, [1, 2], [1], 2, 1)))
    assert report([str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "## Workload `mixed`" in md and "| on | p | short | 10/10 |" in md
    assert "![throughput.png](throughput.png)" in md and "classes.short.tpot_ms_p99" in md
    assert "## Calibration" in md and "![calibration](cal/calibration.png)" in md and "T_input =" in md
    assert "lane_timeline.png" not in md  # no head-of-line run with a lane timeline here
    # two head-of-line runs, one level down, with their lanes' timelines: one bar each
    for name, tl in (("hol_a", {"lead": 14.2, "host": 26.7, "between": 22.2, "tail": 1.1}),
                     ("hol_b", {"lead": 13.2, "host": 65.4, "between": 18.6, "tail": 0.5})):
        (tmp_path / name).mkdir()
        ph = {"short_ttft_p99_ms": 50.0, "short_itl_p99_ms": 30.0}
        (tmp_path / name / "hol.json").write_text(json.dumps(
            {"time": "t", "on": {"before": ph, "long_prefill": ph, "long_decode": ph, "lane_timeline_ms_per_batch": tl,
                                 "move_split_s_per_move": {"read": 0.012, "kmeans": 0.25, "pack": 0.2},
                                 "node_comm_split_us_per_call": {"copy": 12.0, "wire": 120.0, "dispatch": 40.0},
                                 "host_call_split_us_per_call": {"prep": 2.0, "fork": 30.0, "tables": 20.0,
                                                                 "items": 500.0, "wait": 100.0, "combine": 5.0},
                                 "node_comm_share_of_lane_batch": 0.082,
                                 "nelssa": {"nelssa:host_memory_free_bytes": 32 * 2**30}}}))
    assert report([str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "Long lane (on), mean ms per batch" in md
    assert "Moves to the host tier (on), mean s per move (handoff.py): read 0.012, kmeans 0.250, pack 0.200" in md
    assert ("Host attention calls (on), mean us per call: prep 2.0, fork 30.0, tables 20.0, items 500.0, "
            "wait 100.0, combine 5.0; sum 657.0") in md
    assert ("nelssa-node communication (on), mean us per layer call: copy 12.0, wire 120.0, dispatch 40.0; "
            "sum 172.0 (8.2% of the lane batches' time)") in md
    assert "lead 14.2, host 26.7, between 22.2, tail 1.1; sum 64.2" in md and "sum 97.7" in md
    assert "Host-tier memory (on, config host_reserve): 0 parts in new mappings, 32.00 GiB free at the end" in md
    assert "![lane timeline](lane_timeline.png)" in md and os.path.getsize(tmp_path / "lane_timeline.png") > 5_000
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as e:  # a usage error naming what is missing
        report([str(tmp_path / "empty")])
    assert e.value.code == 2


def test_hol_modes_and_variants():
    """nelssa bench hol's modes (no engine): on:NAME is NELSSA with the variant's fields over the scenario's
    NELSSA config, every mode runs on the same scenario otherwise; unknown, unnamed or repeated modes
    are refused before any engine starts."""
    from nelssa.bench.hol import Scenario, mode_specs
    sc = Scenario(nelssa={"T_input": 8192, "budget": 0.04, "lane": True})
    specs = mode_specs(sc, ["off", "on", "on:t12"], {"t12": {"pool_threads": 12}, "unused": {"budget": 1.0}})
    assert [(label, base) for label, base, _ in specs] == [("off", "off"), ("on", "on"), ("on:t12", "on")]
    assert specs[1][2]["nelssa"] == {"T_input": 8192, "budget": 0.04, "lane": True}
    assert specs[2][2]["nelssa"] == {"T_input": 8192, "budget": 0.04, "lane": True, "pool_threads": 12}
    assert specs[2][2]["rate"] == specs[0][2]["rate"] == sc.rate
    v1 = mode_specs(sc, ["off", "off:v1", "on"], {})  # stock on the V1 runner: the same scenario, no variant
    assert [(label, base) for label, base, _ in v1] == [("off", "off"), ("off:v1", "off"), ("on", "on")]
    assert v1[1][2] == v1[0][2]
    from nelssa.bench.hol import result_modes
    assert result_modes({"on": {}, "off:v1": {}, "off": {}, "on:t12": {}}) == ["off", "off:v1", "on", "on:t12"]
    for bad, why in ((["on:x"], "no --variant x"), (["off:x"], "unknown mode"), (["fast"], "unknown mode"),
                     (["on", "on"], "repeated")):
        with pytest.raises(ValueError, match=why):
            mode_specs(sc, bad, {})


def test_presets_plan_every_workload():
    for name, p in wl.PRESETS.items():
        for w in wl.WORKLOADS:
            if w == "mixed" and not os.path.exists(tr.default_trace()):
                continue
            pts, _ = wl.plans(w, p, p["nelssa"]["T_input"])
            assert pts and all(plan for _, plan in pts), (name, w)
            for _, plan in pts:
                assert all(r["n_in"] + r["n_out"] <= p["max_model_len"] for r in plan), (name, w)
    o = wl._override(wl.PRESETS["cpu"], ["mixed.rates=[0.5,1]", "nelssa={\"budget\": 0.1}"])
    assert o["mixed"]["rates"] == [0.5, 1] and o["nelssa"] == {"budget": 0.1}
    with pytest.raises(SystemExit):
        wl._override(wl.PRESETS["cpu"], ["mixed.nope=1"])
    assert math.isfinite(wl.PRESETS["cpu"]["max_model_len"])


def test_accuracy_sweep_plot_and_report(tmp_path):
    from nelssa.bench import accuracy_sweep as acc
    from nelssa.bench.accuracy import paired_verdict
    from nelssa.bench.report import render
    dense = [True, True, False, True]
    res = {"dtype": "float32", "prompts": 4, "tokens": 9000, "lengths": [2200, 2400], "depths": [0.1, 0.9],
           "dense": {"accuracy": 0.75, "by_length": {"2200": 1.0, "2400": 0.5}, "wall_s": 10.0, "tok_s": 900.0},
           "budgets": {}, "command": "nelssa bench accuracy", "time": "t"}
    for b, ok in ((0.02, [True, False, False, True]), (0.1, dense)):
        res["budgets"][f"{b:g}"] = {"budget": b, "accuracy": sum(ok) / 4, "by_length": {"2200": 0.5, "2400": 0.5},
                                    "verdict": paired_verdict(ok, dense), "wall_s": 12.0, "tok_s": 750.0, "rows": []}
    acc.plot(res, str(tmp_path / "accuracy_vs_budget.png"))
    assert os.path.getsize(tmp_path / "accuracy_vs_budget.png") > 5_000
    (tmp_path / "accuracy.json").write_text(json.dumps(res))
    md = render(str(tmp_path))
    assert "| NELSSA 2% | 50.0 | 1 / 0 | not worse | 750 |" in md and "| dense (NELSSA_OFF) | 75.0 |" in md
    assert "budget 10%: accuracy 75.0%" in acc.table(res)


class _FakeTok:
    vocab_size = 50_000


def _fake_server():
    """An OpenAI-compatible stand-in (aiohttp, own thread): streaming /v1/completions (one chunk per token,
    2 ms apart), /v1/models, /health, /metrics (running gauge, a preemption counter)."""
    import asyncio
    import json as _json
    import threading

    from aiohttp import web

    from nelssa.bench.serving import free_port
    state = {"running": 0, "seen": []}

    async def completions(req):
        body = await req.json()
        state["seen"].append(body)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        state["running"] += 1
        try:
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(0.002)
                await resp.write(b"data: " + _json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode() + b"\n\n")
            usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"],
                                              "prompt_tokens": len(body["prompt"])}}
            await resp.write(b"data: " + _json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        finally:
            state["running"] -= 1
        return resp

    async def models(_):
        return web.json_response({"data": [{"id": "fake", "root": "/nonexistent"}]})

    async def metrics(_):
        return web.Response(text=f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{engine=\"0\"}} "
                                 f"{state['running']}.0\n# TYPE vllm:num_preemptions_total counter\n"
                                 f"vllm:num_preemptions_total{{engine=\"0\"}} 2.0\n")

    async def health(_):
        return web.Response(text="")

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/v1/models", models),
                    web.get("/metrics", metrics), web.get("/health", health)])
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        loop.run_forever()
    threading.Thread(target=serve, daemon=True).start()
    import time as _t
    from nelssa.bench.serving import http_get
    for _ in range(100):
        try:
            http_get(f"http://127.0.0.1:{port}/health")
            break
        except OSError:
            _t.sleep(0.05)
    return f"http://127.0.0.1:{port}", state, lambda: loop.call_soon_threadsafe(loop.stop)


def test_replay_against_a_fake_endpoint(tmp_path, monkeypatch):
    """The whole client side (vLLM's streaming request function, arrivals, /metrics sampling, summary,
    plots) against a stand-in server, both modes given as endpoints: seconds, no engine."""
    url, state, stop = _fake_server()
    monkeypatch.setattr(wl, "_tokenizer", lambda path: _FakeTok())
    try:
        preset = wl._override(wl.PRESETS["cpu"], ["hol-http.duration=1.0", "hol-http.rate=6",
                                                  "hol-http.long_at=0.2", "hol-http.long_len=300"])
        s = wl.run("hol-http", preset, str(tmp_path), endpoints={"on": url, "off": url}, model=None, interval=0.05)
    finally:
        stop()
    assert s["failed_modes"] == {}
    body = state["seen"][-1]
    assert body["ignore_eos"] is True and body["stream"] is True and isinstance(body["prompt"][0], int)
    (name, plan), = wl.plans("hol-http", preset, 2048)[0]
    sent = [b for b in state["seen"] if b["max_tokens"] != 2]                           # not the warm-ups
    assert sorted(len(b["prompt"]) for b in sent) == sorted(2 * [r["n_in"] for r in plan])  # exact lengths
    for mode in ("on", "off"):
        st = s["modes"][mode][name]
        assert st["classes"]["long"]["ok"] == 1 and st["classes"]["short"]["ok"] == len(plan) - 1
        assert 1.0 < st["classes"]["short"]["tpot_ms_p50"] < 1000.0  # 2 ms per token, plus a loaded box
        assert st["running_max"] >= 1 and st["preemptions"] == 0.0
        recs = [json.loads(x) for x in (tmp_path / f"requests_{mode}.jsonl").read_text().splitlines()]
        assert all(len(r["stamps"]) == r["n_out"] == r["output_tokens"] for r in recs)
    assert s["ratios_on_over_off"][name]["decode_tok_s"] > 0
    for mode in ("on", "off"):  # nelssa bench hol's phases from the streams' stamps
        a = s["hol"][mode]
        (lg,) = a["long"]
        assert lg["tokens"] == preset["hol-http"]["long_out"] and lg["ttft_s"] > 0 and a["errors"] == []
        lo, hi = a["phases_s"]["long_prefill"]
        assert 0.2 <= lo < hi <= a["phases_s"]["long_decode"][1]
        assert a["before"]["n_short_arrivals"] + a["long_prefill"]["n_short_arrivals"] + \
            a["long_decode"]["n_short_arrivals"] <= len(plan) - 1
        assert a["preemptions"] == 0.0 and set(a["residency_targets"]) == {
            f"{ph}_{k}_le_1.5x_before" for ph in ("long_prefill", "long_decode") for k in ("ttft", "itl")}
    assert set(s["hol_targets"]) >= {"long_tpot_le_50ms", "prefill_max_gap_le_1s"}
    for f in ("summary.json", "throughput.png", "running.png", "short_tpot_cdf.png", "metrics_on.jsonl", "hol.png"):
        assert (tmp_path / f).exists(), f


def test_sweep_plot_for_several_points(tmp_path):
    runs = {}
    for mode in ("on", "off"):
        recs, pts = [], {}
        for j, name in enumerate(("rate1-long0.2", "rate2-long0.2", "rate1-longtrace", "rate2-longtrace")):
            recs += [{**r, "point": name, "id": f"{name}-{r['id']}"} for r in _runs()[mode]["requests"]]
            pts[name] = [0.0, 7.0]
        runs[mode] = {"requests": recs, "samples": _runs()[mode]["samples"], "points": pts}
    s = wl.summarise(runs, {"workload": "mixed"})
    assert set(s["ratios_on_over_off"]) == {"rate1-long0.2", "rate2-long0.2", "rate1-longtrace", "rate2-longtrace"}
    assert "sweep.png" in wl.plot_all(runs, s, str(tmp_path))
    assert os.path.getsize(tmp_path / "sweep.png") > 5_000


def test_modes_run_apart_then_merged(tmp_path, monkeypatch):
    """One mode per invocation (a device call each), then `nelssa bench merge`: the summary, ratios and
    plots of a joint run; a mode's raw files exist after each point; mismatched folders are refused."""
    url, state, stop = _fake_server()
    monkeypatch.setattr(wl, "_tokenizer", lambda path: _FakeTok())
    preset = wl._override(wl.PRESETS["cpu"], ["hol-http.duration=0.6", "hol-http.rate=6",
                                              "hol-http.long_at=0.1", "hol-http.long_len=300"])
    seen = []
    real_save = wl.save_mode
    monkeypatch.setattr(wl, "save_mode", lambda out, mode, run: (seen.append((mode, sorted(run["points"]))),
                                                                  real_save(out, mode, run)))
    try:
        a = wl.run("hol-http", preset, str(tmp_path / "a"), endpoints={"on": url}, interval=0.05)
        b = wl.run("hol-http", preset, str(tmp_path / "b"), endpoints={"off": url}, interval=0.05)
        other = wl._override(preset, ["hol-http.long_len=280"])
        wl.run("hol-http", other, str(tmp_path / "c"), endpoints={"off": url}, interval=0.05)
    finally:
        stop()
    assert ("on", ["hol"]) in seen and ("off", ["hol"]) in seen  # saved after the point, before the end
    assert "ratios_on_over_off" not in a and "ratios_on_over_off" not in b
    from nelssa.cli import main as cli
    assert cli(["bench", "merge", "--out", str(tmp_path / "m"), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    m = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert set(m["modes"]) == {"on", "off"} and m["served_modes"] == ["off", "on"]
    assert m["modes"]["on"] == a["modes"]["on"] and m["modes"]["off"] == b["modes"]["off"]  # nothing re-derived differently
    r = m["ratios_on_over_off"]["hol"]
    assert r["decode_tok_s"] == pytest.approx(a["modes"]["on"]["hol"]["decode_tok_s"] / b["modes"]["off"]["hol"]["decode_tok_s"])
    assert set(m["hol"]) == {"on", "off"} and "hol_targets" in m and len(m["merged_from"]) == 2
    for f in ("throughput.png", "running.png", "short_tpot_cdf.png", "hol.png", "requests_on.jsonl", "meta.json"):
        assert (tmp_path / "m" / f).exists(), f
    # refused: another plan, a mode twice, not a results folder
    assert cli(["bench", "merge", "--out", str(tmp_path / "x"), str(tmp_path / "a"), str(tmp_path / "c")]) == 2
    assert cli(["bench", "merge", "--out", str(tmp_path / "x"), str(tmp_path / "b"), str(tmp_path / "b")]) == 2
    (tmp_path / "empty").mkdir()
    assert cli(["bench", "merge", "--out", str(tmp_path / "x"), str(tmp_path / "empty")]) == 2
    # a run stopped after its first point (no summary.json): its finished point is merged
    (tmp_path / "b" / "summary.json").unlink()
    assert cli(["bench", "merge", "--out", str(tmp_path / "m2"), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert set(json.loads((tmp_path / "m2" / "summary.json").read_text())["modes"]) == {"on", "off"}


def test_a_run_stopped_in_its_second_mode_keeps_the_firsts_summary(tmp_path, monkeypatch):
    """A run killed by a time limit while its second mode runs (the device call's BENCH_TIMEOUT; a growth
    run of 2026-12-05 lost its report so) leaves summary.json of the finished mode for `nelssa bench report`."""
    url, state, stop = _fake_server()
    monkeypatch.setattr(wl, "_tokenizer", lambda path: _FakeTok())
    preset = wl._override(wl.PRESETS["cpu"], ["hol-http.duration=0.6", "hol-http.rate=6",
                                              "hol-http.long_at=0.1", "hol-http.long_len=300"])
    real_drive = wl._drive

    def drive(url, *args):
        if url == "http://stopped":  # the second mode: killed as the limit's SIGTERM would (not an Exception)
            raise KeyboardInterrupt
        return real_drive(url, *args)
    monkeypatch.setattr(wl, "_drive", drive)
    try:
        with pytest.raises(KeyboardInterrupt):
            wl.run("hol-http", preset, str(tmp_path), endpoints={"on": url, "off": "http://stopped"}, interval=0.05)
    finally:
        stop()
    s = json.loads((tmp_path / "summary.json").read_text())
    assert set(s["modes"]) == {"on"} and s["modes"]["on"]["hol"]["classes"]["long"]["ok"] == 1
    from nelssa.cli import main as cli
    assert cli(["bench", "report", str(tmp_path)]) == 0 and (tmp_path / "report.md").exists()


def test_point_counters_are_differenced_between_points():
    """A point's counters (tokens, preemptions, NELSSA) run from the sample before its first to its last,
    so a request whose tokens all stream between two samples (a starved API server) is still counted,
    though no gauge sample saw it running."""
    samples = [{"t": 0.0, "point": None, "running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "preemptions": 0.0,
                "generation_tokens": 2.0, "prompt_tokens": 64.0},
               {"t": 0.3, "point": "a", "running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "preemptions": 0.0,
                "generation_tokens": 2.0, "prompt_tokens": 64.0},
               {"t": 2.2, "point": "a", "running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "preemptions": 1.0,
                "generation_tokens": 34.0, "prompt_tokens": 1564.0},
               {"t": 4.1, "point": "b", "running": 1.0, "waiting": 0.0, "kv_usage": 0.1, "preemptions": 1.0,
                "generation_tokens": 40.0, "prompt_tokens": 1664.0},
               {"t": 5.0, "point": "b", "running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "preemptions": 1.0,
                "generation_tokens": 50.0, "prompt_tokens": 1664.0}]
    a = wl.point_stats([_rec(0, "long", "a", 0.1, 1.2, [0.0] * 31)], samples, [0.0, 1.5])
    assert a["running_max"] == 0 and a["generation_tokens"] == 32 and a["prompt_tokens"] == 1500
    assert a["preemptions"] == 1
    b = wl.point_stats([_rec(1, "short", "b", 3.9, 0.1, [0.05] * 15)], samples, [3.9, 5.0])
    assert b["generation_tokens"] == 16 and b["prompt_tokens"] == 100 and b["preemptions"] == 0



@pytest.mark.parametrize("args, needle", [
    (["growth", "--set", "growth.n=0"], "growth.n: an integer >= 1"),
    (["mixed", "--set", "mixed.rates=[]"], "mixed.rates: a non-empty list"),
    (["mixed", "--set", "mixed.long_fractions=[2]"], "fractions in [0, 1]"),
    (["multi-long", "--set", "multi-long.n=abc"], "multi-long.n: an integer"),
    (["hol-http", "--set", "hol-http.rate=0"], "scenario field rate: a number > 0"),
    (["single-long", "--set", 'nelssa={"budget": 5}'], "budget must be in (0, 1]"),
    (["hol", "--preset", "cpu", "--set", "n_long=1.5"], "scenario field n_long: an integer >= 0"),
    (["hol", "--preset", "cpu", "--set", "prompts=foo"], "scenario field prompts"),
    (["hol", "--preset", "cpu", "--set", "profile_at=3", "--set", "profile_decode_s=1"], "one of them, not both"),
    (["hol", "--preset", "cpu", "--set", "n_long=0", "--set", "profile_decode_s=1"], "no long decode phase"),
    (["hol", "--preset", "cpu", "--variant", 't={"pool_threadz": 2}', "--modes", "off,on:t"], "pool_threadz"),
    (["report", "/nonexistent-results"], "not a folder"),
    (["accuracy", "--budgets", "0.04,2"], "budgets in (0, 1]"),
    (["accuracy", "--lengths", "0"], "an integer >= 1")])
def test_bad_benchmark_settings_are_refused_before_any_server_starts(capsys, args, needle):
    """`nelssa bench` checks its settings first: a usage error naming the value (exit 2), not a server
    started for minutes and a traceback (growth.n=0 had failed with an IndexError after starting one)."""
    from nelssa.cli import main as cli
    with pytest.raises(SystemExit) as e:
        cli(["bench", *args, "--out", "/nonexistent-out"] if args[0] != "report" else ["bench", *args])
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [(["calibrate", "--contexts", "0"], "nelssa calibrate: error"),
                                         (["bench-sparse", "--contexts", "0"], "nelssa bench-sparse: error"),
                                         (["bench-sparse", "--budget", "3"], "must be in (0, 1]")])
def test_commands_with_their_own_options_report_bad_ones(capsys, args, needle):
    """calibrate and bench-sparse take all their options themselves (bench-sparse took none through
    `nelssa` before: argparse split them around its leading REMAINDER)."""
    from nelssa.cli import main as cli
    with pytest.raises(SystemExit) as e:
        cli(args)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_every_preset_passes_its_checks():
    for p in wl.PRESETS.values():
        for w in wl.WORKLOADS:
            wl.check_workload(w, p)


def test_h100_presets_fix_the_h200_scenarios_kv():
    """On an 80-GB GPU the H200 presets' memory share (0.27) leaves ~3 GB of KV; the h100 presets fix it at
    11,700 blocks of 16 (187,200 tokens, both modes) and change nothing else."""
    from nelssa.bench import hol
    sc = hol.Scenario(**hol.PRESETS["h100"])
    assert sc.kv_blocks * 16 == 187_200 and sc.util == 0.6
    assert {k: v for k, v in vars(sc).items() if k not in ("util", "kv_blocks")} == \
        {k: v for k, v in vars(hol.Scenario()).items() if k not in ("util", "kv_blocks")}
    h100, h200 = wl.PRESETS["h100"], wl.PRESETS["h200"]
    assert {k: v for k, v in h100.items() if k != "server"} == {k: v for k, v in h200.items() if k != "server"}
    s = h100["server"]
    assert s[s.index("--num-gpu-blocks-override") + 1] == "11700"
    assert s[s.index("--gpu-memory-utilization") + 1] == "0.6" and "0.27" not in s
    assert [a for a in s if a not in ("0.6", "--num-gpu-blocks-override", "11700")] == \
        [a for a in h200["server"] if a != "0.27"]
