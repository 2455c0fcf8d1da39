"""The serving workloads end to end on the CPU, each at its smallest: one `nelssa serve` with NELSSA and
one under NELSSA_OFF (SmolLM2's first 8 layers, the cpu preset's KV-limited server: 28 blocks of 128
tokens), started once for the module, and every workload of `nelssa bench` driven against both
(`--endpoints`): streaming clients, exact-length prompts, `ignore_eos`, /metrics sampled. Asserts the
files of issue 12 are written and well-formed (the /metrics counters over each point account for every
generated token: a gauge sample may see nothing, since on CI's 2 vCPUs a starved API server once streamed a
request's 32 tokens at once between two samples), and what each workload exists to show happened (long
requests on the host tier, a grown request migrating under pressure); performance is judged on the
H200 only.

Sizes (2-core box): `mixed` 3 trace-scaled requests at 2 req/s (the seed's draw: one long prompt of
2,273 tokens, two short ones, 8 tokens out); `single-long` / `multi-long` 1 / 2 prompts of 1,500
tokens, 32 / 16 out; `growth` 3 requests of 400 tokens generating 800 (contexts pass T_input 1,024 and together
outgrow the 3,584-token KV); `hol-http` 6 s of short requests with one 1,500-token request at 2 s."""

import json
import os

import pytest

from nelssa.bench import trace as tr
from nelssa.bench import workloads as wl

pytestmark = pytest.mark.engine

# the on-server's config: the cpu preset's, routing at the growth workload's threshold (one server for all)
T_INPUT = 1024
NELSSA = {**wl.PRESETS["cpu"]["nelssa"], "T_input": T_INPUT}
SIZES = {
    "mixed": ["mixed.rates=[2.0]", "mixed.long_fractions=[0.3]", "mixed.n=3", "mixed.max_output=8"],
    "single-long": ["single-long.n_in=1500", "single-long.n_out=32"],
    "multi-long": ["multi-long.n=2", "multi-long.n_in=1500", "multi-long.n_out=16"],
    "growth": ["growth.n=3", "growth.n_in=400", f"growth.T_input={T_INPUT}"],
    "hol-http": ["hol-http.duration=6.0", "hol-http.long_at=2.0", "hol-http.long_len=1500", "hol-http.long_out=8",
                 "hol-http.short_out=8"],
}
SEED = 3  # mixed's draw at this seed has both classes


@pytest.fixture(scope="module")
def servers(tmp_path_factory, cut_model_dir):
    from nelssa.bench.serving import Server, free_port
    p = wl.PRESETS["cpu"]
    d = tmp_path_factory.mktemp("servers")
    with Server("on", cut_model_dir, NELSSA, p["server"], free_port(), str(d / "server_on.log"), 600, p["env"]) as on, \
            Server("off", cut_model_dir, {}, p["server"], free_port(), str(d / "server_off.log"), 600, p["env"]) as off:
        yield {"on": on.url, "off": off.url, "model": cut_model_dir}


def _run(workload: str, servers: dict, out) -> dict:
    args = [workload, "--preset", "cpu", "--model", servers["model"], "--out", str(out), "--seed", str(SEED),
            "--endpoints", f"on={servers['on']},off={servers['off']}", "--interval", "0.2", "--set", f"nelssa={json.dumps(NELSSA)}"]
    for s in SIZES[workload]:
        args += ["--set", s]
    assert wl.main(args) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["failed_modes"] == {}
    preset = wl._override(wl.PRESETS["cpu"], SIZES[workload] + [f"nelssa={json.dumps(NELSSA)}"])
    points = wl.plans(workload, preset, T_INPUT, seed=SEED)[0]
    for name, plan in points:
        for mode in ("on", "off"):
            st = s["modes"][mode][name]
            for k, c in st["classes"].items():
                assert c["errors"] == [] and c["ok"] == c["n"] > 0, (workload, mode, k, c)
                assert c["ttft_ms_p50"] > 0 and c["tpot_ms_p99"] > 0
            # /metrics covered the point and its counters saw every token (a gauge may miss a request
            # whose tokens a starved API server streamed at once: CI once saw running max 0 so)
            assert st["decode_tok_s"] > 0 and st["samples"] >= 1
            assert st["generation_tokens"] == sum(r["n_out"] for r in plan), (mode, name, st)
            assert st["prompt_tokens"] >= sum(r["n_in"] for r in plan), (mode, name, st)
        assert s["ratios_on_over_off"][name]["decode_tok_s"] > 0
    for mode in ("on", "off"):
        recs = [json.loads(x) for x in (out / f"requests_{mode}.jsonl").read_text().splitlines()]
        assert len(recs) == sum(len(p) for _, p in points)
        assert all(r["output_tokens"] == r["n_out"] for r in recs)  # ignore_eos: exactly the planned lengths
        assert (out / f"metrics_{mode}.jsonl").read_text().strip()
    for p in ("throughput.png", "running.png", "short_tpot_cdf.png"):
        assert os.path.getsize(out / p) > 5_000
    from nelssa.bench.report import main as report
    assert report([str(out)]) == 0 and "NELSSA / stock ratios" in (out / "report.md").read_text()
    return s


def _counter(s: dict, name: str) -> float:
    return sum(st.get("nelssa", {}).get(name, 0.0) for st in s["modes"]["on"].values())


def test_mixed_smallest(servers, tmp_path):
    if not os.path.exists(tr.default_trace()):
        pytest.skip("shared Mooncake trace not present")
    preset = wl._override(wl.PRESETS["cpu"], SIZES["mixed"])
    _, plan = wl.plans("mixed", preset, T_INPUT, seed=SEED)[0][0]
    assert {r["kind"] for r in plan} == {"short", "long"}, plan  # the seeded draw has both classes
    s = _run("mixed", servers, tmp_path / "mixed")
    assert _counter(s, "nelssa:long_requests_total") >= 1


@pytest.mark.parametrize("workload", ["single-long", "multi-long", "hol-http"])
def test_long_workloads_smallest(servers, tmp_path, workload):
    s = _run(workload, servers, tmp_path / workload)
    assert _counter(s, "nelssa:long_requests_total") >= 1  # the long prompts went to the host tier


def test_growth_smallest_migrates(servers, tmp_path):
    s = _run("growth", servers, tmp_path / "growth")
    st = s["modes"]["on"]["growth"]
    # contexts grew past T_input and outgrew the device KV: NELSSA moved some of them to the host tier
    assert _counter(s, "nelssa:migrations_completed_total") >= 1, st.get("nelssa")
    assert st["handoff"]["windows"] >= 1 and st["handoff"]["itl_during_n"] > 0
    report = (tmp_path / "growth" / "report.md").read_text()
    assert "Migrations (hand-offs in the background)" in report
    # hand-off time vs context length (issue 13), from nelssa:migrations_by_context and its seconds
    by_ctx = {k: v for k, v in st["nelssa"].items() if k.startswith("nelssa:migrations_by_context_total{")}
    assert sum(by_ctx.values()) == _counter(s, "nelssa:migrations_completed_total"), by_ctx
    assert set(by_ctx) == {"nelssa:migrations_by_context_total{<4K}"}, by_ctx  # contexts of <= 1,200 tokens
    assert "Hand-off time vs context" in report and "<4K " in report
