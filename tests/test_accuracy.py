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


def test_multi_needle_prompts_share_their_haystack(model_dir):
    """The "multi2" set's prompts: 2 needles per haystack, one prompt per needle, all of a haystack's prompts
    equal up to the question (so the prefix cache prefills it once) and within the length."""
    import os

    from transformers import AutoTokenizer

    from nelssa.bench.accuracy import FOLLOW_UP_STEP, SETS, needle_requests
    tok = AutoTokenizer.from_pretrained(model_dir)
    s = SETS["multi2"]
    reqs, want = needle_requests(tok, s["lengths"], s["depths"], s["seed"], 12, s["per_haystack"])
    assert len(reqs) == 32 and len(set(want)) == 32
    k = s["per_haystack"]
    for h in range(32 // k):
        group = reqs[k * h: k * h + k]
        ids = [r["prompt_ids"] for r in group]
        assert all(len(x) <= s["lengths"][h // (32 // k // 4)] for x in ids)
        assert len(os.path.commonprefix(ids)) >= min(map(len, ids)) - 40  # only the question differs
        text = tok.decode(ids[0])
        assert all(v in text for v in want[k * h: k * h + k])  # every needle in the haystack
        assert [r.get("add_at_step", 0) for r in group] == [0] + [FOLLOW_UP_STEP] * (k - 1)
