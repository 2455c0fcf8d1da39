"""The needle test's paired verdict (nelssa.bench.accuracy.paired_verdict) on outcome patterns."""

from nelssa.bench.accuracy import paired_verdict


def outcomes(both: int, lost: int, gained: int, neither: int) -> tuple[list[bool], list[bool]]:
    on = [True] * both + [False] * lost + [True] * gained + [False] * neither
    off = [True] * both + [True] * lost + [False] * gained + [False] * neither
    return on, off


def test_equal_answers_pass():
    v = paired_verdict(*outcomes(28, 0, 0, 4))
    assert v["ok"] and v["acc_nelssa"] == v["acc_dense"] == 87.5


def test_one_or_two_flips_do_not_decide():
    assert paired_verdict(*outcomes(26, 1, 0, 5))["ok"]
    assert paired_verdict(*outcomes(25, 2, 0, 5))["ok"]      # 2 <= 2 sqrt(2)
    assert paired_verdict(*outcomes(24, 3, 1, 4))["ok"]      # noise both ways


def test_systematic_loss_fails():
    assert not paired_verdict(*outcomes(23, 5, 0, 4))["ok"]  # 5 > 2 sqrt(5)
    v = paired_verdict(*outcomes(20, 8, 1, 3))               # 7 > 2 sqrt(9)
    assert not v["ok"] and v["net_loss"] == 7 and v["limit"] == 6.0
    assert paired_verdict(*outcomes(24, 4, 0, 4))["ok"]      # 4 = 2 sqrt(4): the boundary passes
