"""Sparse attention on real SmolLM2 KV (6,000 tokens of real text) vs dense attention.

Measured on the 2-core dev box, 2026-11-29 (`python -m nelssa.bench.real_kv`, layers 2/9/16/23/29,
the last 8 positions as decode queries, sink 16 + recent 64 exact, the middle clustered with the
default 8 tokens per cluster; fp32):

    budget  rel. error of output (mean / max)   recall of true top-32 middle tokens (mean / min)
    2%      0.135 / 0.408                       0.734 / 0.510
    4%      0.096 / 0.303                       0.870 / 0.705
    10%     0.042 / 0.132                       0.967 / 0.920
    without the exact window at 4%: mean error 0.376 (attention sinks are not captured by clusters).
    (16 tokens per cluster, for comparison: 0.143 / 0.101 / 0.052 mean error, 0.70 / 0.84 / 0.95 recall.)

The asserted bounds are these means with ~35% margin (means over 40 queries move little between
runs: clustering is seeded and the data is fixed).
"""

import pytest

from nelssa.bench.real_kv import capture_qkv, evaluate

BOUNDS = {"0.02": (0.18, 0.62), "0.04": (0.13, 0.78), "0.1": (0.06, 0.92)}  # (max mean error, min mean recall)


@pytest.mark.model
def test_real_kv_accuracy(model_dir):
    qkv, _ = capture_qkv(model_dir, 6000, [2, 9, 16, 23, 29])
    s = evaluate(qkv)
    print({b: (round(r["rel_err"]["mean"], 4), round(r["recall"]["mean"], 4)) for b, r in s.items()})
    for b, (err, rec) in BOUNDS.items():
        assert s[b]["rel_err"]["mean"] <= err, (b, s[b])
        assert s[b]["recall"]["mean"] >= rec, (b, s[b])
    # more budget, better; the exact sink/recent window matters
    assert s["0.02"]["rel_err"]["mean"] > s["0.04"]["rel_err"]["mean"] > s["0.1"]["rel_err"]["mean"]
    assert s["0.02"]["recall"]["mean"] < s["0.04"]["recall"]["mean"] < s["0.1"]["recall"]["mean"]
    assert s["0.04"]["rel_err_no_window"]["mean"] > 2 * s["0.04"]["rel_err"]["mean"]
