"""`nelssa bench report DIR`: a Markdown summary (``DIR/report.md``) of a results folder with its plots:
a workload run (``summary.json`` of ``nelssa bench <workload>``), a calibration (``calibration.json``),
a head-of-line run (``hol.json``), a needle sweep (``accuracy.json``), whichever are there (also in
sub-folders, one level down). Head-of-line runs with a long-lane timeline also get ``lane_timeline.png``
(one bar per run: where a lane batch's time goes)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from nelssa.bench import gpustate
from nelssa.bench.common import preemptions_text
from nelssa.bench.hol import TIMELINE_PARTS, result_modes
from nelssa.vllm_plugin.policy import CONTEXTS


def _f(v, d: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        return f"{v:,.{d}f}"
    return str(v)


def _img(rel: str, alt: str) -> str:
    return f"![{alt}]({rel})"


def workload_md(s: dict, rel: str) -> list[str]:
    out = [f"## Workload `{s['workload']}` ({s['time']})", ""]
    out.append(f"Command: `{s.get('command', '')}`  ")
    out.append(f"Model: `{s.get('model')}`; T_input {s.get('T_input')}; NELSSA config "
               f"`{json.dumps(s.get('preset', {}).get('nelssa', {}))}`; server args "
               f"`{' '.join(s.get('preset', {}).get('server', []))}`")
    if s.get("failed_modes"):
        out.append(f"\n**Failed modes:** {s['failed_modes']}")
    notes = s.get("notes") or {}
    if "scaling" in notes:
        sc = notes["scaling"]
        out.append(f"\nTrace `{notes['trace']}` ({notes['trace_rows']} rows): input x {sc['in_factor']:.4g} "
                   f"(trace max {sc['trace_max_input']:,} -> {sc['max_input']:,}), output x {sc['out_factor']:.4g} "
                   f"(max {sc['trace_max_output']:,} -> {sc['max_output']:,}); scaled long share "
                   f"{100 * notes['scaled_long_share']:.2f}%. {notes['rule']}.")
    out += ["", "| mode | point | class | n ok | TTFT p50 / p99 ms | TPOT p50 / p95 / p99 ms |",
            "|---|---|---|---|---|---|"]
    for mode, pts in s["modes"].items():
        for name, st in pts.items():
            for k, c in st["classes"].items():
                out.append(f"| {mode} | {name} | {k} | {c['ok']}/{c['n']} | {_f(c['ttft_ms_p50'])} / "
                           f"{_f(c['ttft_ms_p99'])}"
                           f" | {_f(c['tpot_ms_p50'])} / {_f(c['tpot_ms_p95'])} / {_f(c['tpot_ms_p99'])} |")
    out += ["", "| mode | point | decode tok/s | running mean / max | waiting max | KV max % | preemptions |",
            "|---|---|---|---|---|---|---|"]
    for mode, pts in s["modes"].items():
        for name, st in pts.items():
            kv = st.get("kv_usage_max")
            out.append(f"| {mode} | {name} | {_f(st.get('decode_tok_s'))} | {_f(st.get('running_mean'))} / "
                       f"{_f(st.get('running_max'), 0)} | {_f(st.get('waiting_max'), 0)} | "
                       f"{_f(None if kv is None else 100 * kv, 0)} | {preemptions_text(st, _f)} |")
    moves = [(mode, name, st["handoff"], st.get("nelssa", {})) for mode, pts in s["modes"].items()
             for name, st in pts.items() if st.get("handoff")]
    if moves:
        out += ["", "Migrations (hand-offs in the background) and the inter-token latency of every request in the "
                "/metrics intervals where one was in flight vs the rest:", "",
                "| mode | point | migrations started / completed | moved tokens | clustering s | migration s, mean | "
                "in-flight s | ITL p50 / p99 / max during (ms) | ITL p50 / p99 outside (ms) |",
                "|---|---|---|---|---|---|---|---|---|"]
        for mode, name, h, c in moves:
            n = c.get("nelssa:migration_seconds_count")
            mig = c.get("nelssa:migration_seconds_sum", 0.0) / n if n else None  # start to switch
            out.append(f"| {mode} | {name} | {_f(c.get('nelssa:migrations_started_total'), 0)} / "
                       f"{_f(c.get('nelssa:migrations_completed_total'), 0)} | {_f(c.get('nelssa:moved_tokens_total'), 0)} | "
                       f"{_f(c.get('nelssa:clustering_seconds_sum'))} | {_f(mig)} | {_f(h['window_s'])} | "
                       f"{_f(h['itl_ms_during_p50'])} / {_f(h['itl_ms_during_p99'])} / {_f(h['itl_ms_during_max'])} | "
                       f"{_f(h['itl_ms_outside_p50'])} / {_f(h['itl_ms_outside_p99'])} |")
        by_ctx = [(mode, name, handoff_by_context(c)) for mode, name, _, c in moves]
        if any(b for _, _, b in by_ctx):
            out += ["", "Hand-off time vs context (migrations, start to switch, by the tokens on the host tier "
                    "then): count x mean seconds", ""]
            out += [f"- {mode} / {name}: " + ", ".join(f"{ctx} {n:.0f} x {sec / n:.2f} s" for ctx, n, sec in b)
                    for mode, name, b in by_ctx if b]
    if s.get("ratios_on_over_off"):
        keys = [k for r in s["ratios_on_over_off"].values() for k in r]
        keys = list(dict.fromkeys(keys))
        out += ["", "NELSSA / stock ratios:", "", "| point | " + " | ".join(keys) + " |",
                "|---|" + "---|" * len(keys)]
        for name, r in s["ratios_on_over_off"].items():
            out.append(f"| {name} | " + " | ".join(_f(r.get(k), 2) for k in keys) + " |")
    for p in s.get("plots", []):
        out += ["", _img(os.path.join(rel, p), p)]
    return out + [""]


def handoff_by_context(c: dict) -> list[tuple[str, float, float]]:
    """A point's migrations by context bucket from its NELSSA counters -> [(bucket, count, seconds)] in
    bucket order (nelssa:migrations_by_context, nelssa:migration_by_context_seconds)."""
    out = []
    for ctx in CONTEXTS:
        n = c.get(f"nelssa:migrations_by_context_total{{{ctx}}}")
        if n:
            out.append((ctx, n, c.get(f"nelssa:migration_by_context_seconds_total{{{ctx}}}", 0.0)))
    return out


def calibration_md(d: dict, rel: str) -> list[str]:
    from nelssa.bench.calibrate import describe
    m = d.get("machine", {})
    out = [f"## Calibration ({d.get('time', '')})", "",
           f"Command: `{d.get('command', '')}`; device {m.get('device')}, host {m.get('cpu')} ({m.get('cores')} cores)",
           "", "```", describe(d), "```"]
    out += ["", _img(os.path.join(rel, "calibration.png"), "calibration")]
    return out + [""]


def hol_md(h: dict, rel: str) -> list[str]:
    out = [f"## Head-of-line run ({h.get('time', '')})", "", "| mode | phase | short TTFT p99 ms | short ITL p99 ms |",
           "|---|---|---|---|"]
    for mode in result_modes(h):
        for ph in ("before", "long_prefill", "long_decode"):
            x = h[mode][ph]
            out.append(f"| {mode} | {ph} | {_f(x['short_ttft_p99_ms'])} | {_f(x['short_itl_p99_ms'])} |")
    if "ratios_on_over_off" in h:
        out.append(f"\nOutput tok/s ratio NELSSA/stock: {_f(h['ratios_on_over_off'].get('output_tok_s'), 2)}")
    for mode in result_modes(h):  # when they came (the sampler's times, every 0.25 s): a burst or a trickle
        at = h[mode].get("preempted_at_s")
        if h[mode].get("preemptions"):
            when = ", ".join(f"{n:.0f} at {t:.2f} s" for t, n in at[:12]) + (" ..." if len(at) > 12 else "") \
                if at else "times not sampled"
            out.append(f"\nPreemptions ({mode}): {h[mode]['preemptions']:.0f}; {when}")
    for mode in result_modes(h):
        st = (h[mode].get("long_decode") or {}).get("itl_steps") or {}
        if st.get("worst"):  # hol.itl_steps: the steps that make the long decode phase's ITL p99
            out.append(f"\nLong decode phase ({mode}): short ITL p99 from its {st['p99_steps']} longest steps; the "
                       "longest (s into the phase, ms, requests that waited, first tokens): " +
                       ", ".join(f"{t:.2f} s {ms:.1f} ms x{c} ({p})" for t, ms, c, p in st["worst"][:4]))
        gp = h[mode].get("gpu_by_phase")
        if gp:  # gpustate.py: the device state each mode ran on
            out.append(f"\nGPU by phase ({mode}): " + gpustate.text(gp))
    split = [(mode, x) for mode in result_modes(h) for x in h[mode].get("long", []) if x.get("prefill_s") is not None]
    if split:  # hol.long_split: a long request's TTFT = its wait for its first scheduling + its prefill
        # and hol.longest_gap: its longest time without a token (a switch hold), the TPOT without it
        out += ["", "| mode | long request | TTFT s | admitted after s | prefill s | longest gap s (after token) | "
                "TPOT without it ms |", "|---|---|---|---|---|---|---|"]
        out += [f"| {mode} | {x['id']} | {_f(x['ttft_s'], 2)} | {_f(x['admitted_s'], 2)} | {_f(x['prefill_s'], 2)} | "
                + (f"{g['s']:.2f} ({g['after_token']}) | {_f(g['tpot_ms_without'])} |" if (g := x.get("longest_gap"))
                   else "– | – |")
                for mode, x in split]
    rows = [(mode, x["id"], ph, v) for mode in result_modes(h) for x in h[mode].get("long", [])
            for ph, v in (x.get("itl_ms_by_phase") or {}).items()]
    if rows:
        out += ["", "| mode | long request | phase | tokens | ITL p50 / mean / max ms |", "|---|---|---|---|---|"]
        out += [f"| {mode} | {rid} | {ph} | {v['n']} | {_f(v['p50'])} / {_f(v['mean'])} / {_f(v['max'])} |"
                for mode, rid, ph, v in rows]
    slots = [(mode, x["id"], x["itl_ms_by_block_slot"]) for mode in result_modes(h) for x in h[mode].get("long", [])
             if x.get("itl_ms_by_block_slot")]
    if slots:  # hol.itl_by_block_slot: a chain short of allocated slots stops at a block's first slot
        out += ["", "| mode | long request | first decoded token (the switch) ms | ITL p50 / mean ms, a block's "
                "first slot (n) | the other slots (n) |", "|---|---|---|---|---|"]
        out += [f"| {mode} | {rid} | " + (_f(v["switch"]["mean"]) if "switch" in v else "-") + " | " + " | ".join(
            f"{_f(v[k]['p50'])} / {_f(v[k]['mean'])} ({v[k]['n']})" if k in v else "-" for k in ("first", "other")) + " |"
            for mode, rid, v in slots]
    for mode, tl in _timelines(h):
        out.append(f"\nLong lane ({mode}), mean ms per batch (lane_host.py, 7): " +
                   ", ".join(f"{p} {_f(tl[p])}" for p in TIMELINE_PARTS) + f"; sum {_f(sum(tl.values()))}")
    for mode in result_modes(h):
        mv = h[mode].get("move_split_s_per_move") if mode != "off" else None
        if mv:
            out.append(f"\nMoves to the host tier ({mode}), mean s per move (handoff.py): " +
                       ", ".join(f"{p} {_f(v, 3)}" for p, v in mv.items()))
            th = h[mode].get("move_thread_s_per_move")
            if th:
                out[-1] += "; the hand-off thread " + ", ".join(f"{p} {_f(v, 3)}" for p, v in th.items())
        ks = h[mode].get("host_call_split_us_per_call") if mode != "off" else None
        if ks:
            out.append(f"\nHost attention calls ({mode}), mean us per call: " +
                       ", ".join(f"{p} {_f(v)}" for p, v in ks.items()) + f"; sum {_f(sum(ks.values()))}")
        cs = h[mode].get("node_comm_split_us_per_call") if mode != "off" else None
        if cs:
            out.append(f"\nnelssa-node communication ({mode}), mean us per layer call: " +
                       ", ".join(f"{p} {_f(v)}" for p, v in cs.items()) + f"; sum {_f(sum(cs.values()))} "
                       f"({_f(100 * (h[mode].get('node_comm_share_of_lane_batch') or 0))}% of the lane batches' time)")
        nel = h[mode].get("nelssa") or {}
        if mode != "off" and "nelssa:host_memory_free_bytes" in nel:
            out.append(f"\nHost-tier memory ({mode}, config host_reserve): "
                       f"{_f(nel.get('nelssa:host_memory_mappings_total', 0), 0)} parts in new mappings, "
                       f"{_f(nel['nelssa:host_memory_free_bytes'] / 2**30, 2)} GiB free at the end")
    return out + ["", _img(os.path.join(rel, "hol.png"), "hol"), ""]


def _timelines(h: dict) -> list[tuple[str, dict]]:
    """(mode, lane_timeline_ms_per_batch) of a hol.json's NELSSA modes that have one."""
    return [(m, h[m]["lane_timeline_ms_per_batch"]) for m in result_modes(h)
            if m != "off" and h[m].get("lane_timeline_ms_per_batch")]


def plot_lane_timelines(runs: list[tuple[str, dict]], path: str) -> None:
    """Stacked bars: per head-of-line run (label, its lane_timeline_ms_per_batch), where a long-lane batch's
    time goes (lead, host attention, device work between two layers' host calls, tail)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(runs) + 1.8))
    colors = {"lead": "#9e9e9e", "host": "#d62728", "between": "#1f77b4", "tail": "#bcbd22"}
    for i, (label, tl) in enumerate(runs):
        x = 0.0
        for p in TIMELINE_PARTS:
            v = tl.get(p, 0.0)
            ax.barh(i, v, left=x, color=colors[p], label=p if i == 0 else None)
            if v >= 4:
                ax.text(x + v / 2, i, f"{v:.0f}", ha="center", va="center", fontsize=8, color="white")
            x += v
        ax.text(x + 0.5, i, f"{x:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), [label for label, _ in runs])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.15 * max(sum(tl.values()) for _, tl in runs))
    ax.set_xlabel("ms per lane batch (one token of every long request)")
    ax.set_title("Long lane: where a batch's time goes")
    fig.legend(loc="lower center", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def accuracy_md(r: dict, rel: str) -> list[str]:
    out = [f"## Needle accuracy vs budget ({r.get('time', '')})", "", f"Command: `{r.get('command', '')}`; "
           f"{r['prompts']} prompts, lengths {r['lengths']}, {r['dtype']}", "",
           "| run | accuracy % | lost / gained vs dense | verdict | tokens/s |", "|---|---|---|---|---|",
           f"| dense (NELSSA_OFF) | {_f(100 * r['dense']['accuracy'])} | | | {_f(r['dense']['tok_s'], 0)} |"]
    for _, b in sorted(r["budgets"].items(), key=lambda x: x[1]["budget"]):
        v = b["verdict"]
        out.append(f"| NELSSA {100 * b['budget']:g}% | {_f(100 * b['accuracy'])} | {v['lost']} / {v['gained']} | "
                   f"{'not worse' if v['ok'] else 'worse'} | {_f(b['tok_s'], 0)} |")
    return out + ["", _img(os.path.join(rel, "accuracy_vs_budget.png"), "accuracy vs budget"), ""]


def handoff_md(r: dict, rel: str) -> list[str]:
    """benchmarks/bench_handoff.py's handoff.json: hand-off time per context, the steps beside it."""
    sh, idle = r["shape"], r["idle_steps"]
    out = [f"## Hand-off time vs context ({r.get('device', '')})", "",
           f"{sh['layers']} layers, {sh['kv_heads']} KV heads of {sh['head_dim']}, {sh['dtype']}, blocks of "
           f"{sh['block_size']}; synthetic steps reading {r.get('step_gb')} GB, stream priority "
           f"{r.get('step_priority', 0)}, idle p50 / p99 {_f(idle['p50_ms'], 2)} / {_f(idle['p99_ms'], 2)} ms; "
           f"host memory reserved {_f(r.get('host_reserve', 0) / 2**30, 1)} GiB (registered with CUDA "
           f"{_f((r.get('host_memory') or {}).get('registered_bytes', 0) / 2**30, 1)} GiB)", "",
           "| context | move s | read alone s | k-means alone s | store alone s (parts in new mappings) | "
           "steps beside it: n, p50 / p99 / max ms |",
           "|---|---|---|---|---|---|"]
    for c in r["contexts"]:
        st = c["steps_during"]
        store = f"{_f(c['put_s'], 2)} ({c.get('put_new_mappings', '-')})" if "put_s" in c else "-"
        out.append(f"| {c['context']:,} | {_f(c['move_s'], 2)} | {_f(c['read_s'], 3)} | {_f(c['cluster_s'], 2)} | "
                   f"{store} | {st['n']}, {_f(st['p50_ms'], 2)} / {_f(st['p99_ms'])} / {_f(st['max_ms'])} |")
    p = r.get("prefill")
    if p:  # a prompt's moves back to back: one thread against the stage ahead (handoff.py, 1)
        out += ["", f"A {p['tokens']:,}-token prompt's hand-off, its {p['moves']} moves of {p['segment']:,} tokens "
                    "submitted at once, to the last one's end:", "",
                "| hand-off | seconds | per move | steps beside it: n, p50 / p99 / max ms |", "|---|---|---|---|"]
        for key, name in (("serial", "one thread"), ("ahead", "read and k-means ahead (`handoff_ahead`)")):
            st = p[f"{key}_steps_during"]
            out.append(f"| {name} | {_f(p[f'{key}_s'], 2)} | {_f(p[f'{key}_per_move_s'], 3)} | {st['n']}, "
                       f"{_f(st['p50_ms'], 2)} / {_f(st['p99_ms'])} / {_f(st['max_ms'])} |")
        out += ["", f"Speed-up x{_f(p['speedup'], 2)}; the two stores {'equal' if p['same_parts'] else '**differ**'}."]
    return out + ["", _img(os.path.join(rel, "handoff.png"), "hand-off"), ""]


def render(folder: str) -> str:
    parts = [f"# NELSSA benchmark report: `{os.path.basename(os.path.abspath(folder))}`", ""]
    dirs = [folder] + sorted(os.path.join(folder, x) for x in os.listdir(folder)
                             if os.path.isdir(os.path.join(folder, x)))
    found, timelines = 0, []
    for d in dirs:
        rel = os.path.relpath(d, folder)
        rel = "" if rel == "." else rel
        for name, fn in (("summary.json", workload_md), ("calibration.json", calibration_md), ("hol.json", hol_md),
                         ("accuracy.json", accuracy_md), ("handoff.json", handoff_md)):
            p = os.path.join(d, name)
            if os.path.exists(p):
                with open(p) as f:
                    doc = json.load(f)
                parts += fn(doc, rel)
                found += 1
                if name == "hol.json":
                    timelines += [((rel or ".") + ("" if m == "on" else f" {m}"), tl) for m, tl in _timelines(doc)]
    if not found:
        raise FileNotFoundError(f"{folder}: no summary.json, calibration.json, hol.json, accuracy.json or handoff.json "
                                "(here or one level down)")
    if timelines:
        plot_lane_timelines(timelines, os.path.join(folder, "lane_timeline.png"))
        parts += ["## Long lane batches by run", "", _img("lane_timeline.png", "lane timeline"), ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nelssa bench report", description=__doc__)
    ap.add_argument("folder")
    ap.add_argument("--out", default=None, help="Markdown file (default FOLDER/report.md)")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.folder):
        ap.error(f"{a.folder}: not a folder")
    try:
        md = render(a.folder)
    except FileNotFoundError as e:
        ap.error(str(e))
    out = a.out or os.path.join(a.folder, "report.md")
    with open(out, "w") as f:
        f.write(md)
    print(f"[report] wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
