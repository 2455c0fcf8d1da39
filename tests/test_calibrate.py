"""`nelssa calibrate`: the §4.1 model fit recovers a known synthetic model, the crossover solves
T_dense = T_nelssa, the JSON round-trips into the config's T_input, and a tiny real run (seconds)
writes a well-formed calibration and plot."""

import json
import os
import random

import pytest

from nelssa.bench import calibrate as cal
from nelssa.config import load_config

TRUE = cal.LatencyModel(M_kv=4096.0, bw_dev=40e9, t_dense0=20e-6, C=14.0, t_search0=35e-6, S=0.045,
                        bw_host=6e9, t_base=60e-6, t_dev=8e-6, t_multi=25e-6)


def _synthetic(model, Ls, Bs, Ns, noise=0.0, seed=0):
    rng = random.Random(seed)
    j = (lambda: 1 + rng.uniform(-noise, noise))
    dense = [{"L": L, "B": B, "t": model.t_dense(L, B) * j()} for L in Ls for B in Bs]
    search = [{"L": L, "B": B, "t": model.t_search(L, B) * j()} for L in Ls for B in Bs]
    xfer = [{"L": L, "B": B, "t": 5e-6} for L in Ls for B in Bs]
    host = [{"L": L, "N": N, "B": B, "t": (model.t_host(L, N, B) - 5e-6) * j()} for L in Ls for B in Bs for N in Ns]
    return dense, search, host, xfer


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_fit_recovers_known_model(noise):
    Ls, Bs, Ns = [1024 << i for i in range(7)], [1, 4], [1, 2, 4, 8]
    m = cal.fit(TRUE.M_kv, *_synthetic(TRUE, Ls, Bs, Ns, noise), selected=TRUE.S)
    tol = 1e-6 if noise == 0 else 0.08
    for k in ("bw_dev", "C", "bw_host", "S"):
        assert getattr(m, k) == pytest.approx(getattr(TRUE, k), rel=tol), k
    for n in Ns:
        assert m.t_comm(n) == pytest.approx(TRUE.t_comm(n), rel=max(tol, 1e-6) * 3), n
        assert m.crossover(n) == pytest.approx(TRUE.crossover(n), rel=max(tol, 1e-6) * 3), n
    if noise == 0:
        for k in ("t_dense0", "t_search0", "t_base", "t_dev", "t_multi"):
            assert getattr(m, k) == pytest.approx(getattr(TRUE, k), rel=1e-5, abs=1e-9), k


def test_crossover_solves_the_model():
    for n in (1, 2, 8):
        for b in (1, 4):
            L = TRUE.crossover(n, b)
            assert L > 0
            assert TRUE.t_dense(L, b) == pytest.approx(TRUE.t_nelssa(L, n, b), rel=1e-9)
            assert TRUE.t_dense(2 * L, b) > TRUE.t_nelssa(2 * L, n, b)  # past L*, the host path wins
    # a slow host tier: one device never wins, more devices cross earlier (the paper's Fig. 3 trend)
    slow1 = cal.LatencyModel(**{**TRUE.__dict__, "bw_host": 1.5e9, "t_dev": 1e-6})
    assert slow1.crossover(1) is None
    assert 0 < slow1.crossover(8) < slow1.crossover(4) < slow1.crossover(2)
    # the paper's condition fails -> no crossover
    slow = cal.LatencyModel(**{**TRUE.__dict__, "bw_host": 1e8})
    assert slow.crossover(1) is None and cal.t_input_of(slow, 1) is None


def test_json_round_trips_into_config_t_input(tmp_path):
    doc = cal.calibration_doc(TRUE, [1, 2, 4], [1, 4], N=4, B=1)
    p = tmp_path / "calibration.json"
    p.write_text(json.dumps(doc))
    model, back = cal.load(str(p))
    assert model == TRUE
    want = cal.t_input_of(TRUE, 4, 1)
    assert back["T_input"] == want and want >= TRUE.crossover(4)
    assert load_config({"nelssa": {"calibration": str(p)}}, env={}).T_input == want
    assert load_config(None, env={"NELSSA_CALIBRATION": str(p)}).T_input == want
    # an explicit T_input wins over the calibration
    assert load_config({"nelssa": {"calibration": str(p), "T_input": 777}}, env={}).T_input == 777
    assert load_config({"nelssa": {"calibration": str(p)}}, env={"NELSSA_T_INPUT": "999"}).T_input == 999
    # a calibration without a crossover, or not a calibration at all, is refused by name
    none = tmp_path / "none.json"
    none.write_text(json.dumps({**doc, "T_input": None}))
    with pytest.raises(ValueError, match="no crossover"):
        load_config({"nelssa": {"calibration": str(none)}}, env={})
    other = tmp_path / "other.json"
    other.write_text("{}")
    with pytest.raises(ValueError, match="not a `nelssa calibrate` JSON"):
        load_config({"nelssa": {"calibration": str(other)}}, env={})


def test_tiny_real_calibration_run(tmp_path, capsys):
    """Real measurements at tiny sizes (seconds): every file written, parameters finite."""
    out = tmp_path / "cal"
    assert cal.main(["--quick", "--devices", "1", "--out", str(out)]) == 0
    doc = json.loads((out / "calibration.json").read_text())
    assert os.path.getsize(out / "calibration.png") > 10_000
    m = doc["model"]
    assert m["bw_dev"] > 0 and m["bw_host"] > 0 and 0 < m["S"] <= 1 and m["C"] > 0
    assert {r["L"] for r in doc["measurements"]["dense"]} == {512, 1024, 2048, 4096}
    assert len(doc["measurements"]["host"]) == 4
    assert "T_input" in capsys.readouterr().out
    # --refit: the same measurements fit again give the same model, at another (N, batch) if asked
    out2 = tmp_path / "refit"
    assert cal.main(["--refit", str(out / "calibration.json"), "--out", str(out2)]) == 0
    again = json.loads((out2 / "calibration.json").read_text())
    assert again["model"] == pytest.approx(doc["model"]) and again["T_input"] == doc["T_input"]
    assert os.path.getsize(out2 / "calibration.png") > 10_000


@pytest.mark.parametrize("args, needle", [(["--contexts", "abc"], "an integer expected"),
                                         (["--batches", "4,0"], "an integer >= 1"),
                                         (["--budget", "2"], "--budget must be in (0, 1]"),
                                         (["--refit", "/nonexistent.json"], "no such file")])
def test_bad_arguments_are_usage_errors(capsys, args, needle):
    """Before: a traceback after the measurements started (a ZeroDivisionError for --contexts 0), or a
    calibration measured at budget 2."""
    with pytest.raises(SystemExit) as e:
        cal.main([*args, "--out", "/nonexistent-out"])
    assert e.value.code == 2 and needle in capsys.readouterr().err
