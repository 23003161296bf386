"""`differences` (emapg_cli/bench/generate.py; scripts/benchmarks/generate_shares.py prints it): how two variants'
samples differ (docs/performance.md, "The samples are the same"), on hand-made samples whose answer is counted by
hand."""

from emapg_cli.bench.generate import differences


def test_identical_samples_have_no_difference():
    a = [([1, 2, 3], [-0.5, -1.0, -2.0]), ([4], [-0.25])]
    assert differences(a, [(list(t), list(lp)) for t, lp in a]) == {
        "responses": 2, "differing_tokens": 0, "first_divergence": None, "max_abs_dlogp": 0.0}


def test_log_probs_compared_only_where_the_tokens_agree():
    a = [([1, 2, 3], [-0.5, -1.0, -2.0]), ([4, 5], [-0.25, -0.75])]
    # response 0: same tokens, log-probs off by 1e-6 and 3e-6 -> largest 3e-6 (|-2.0 - (-2.000003)|)
    # response 1: the second token differs (5 vs 6), so its log-prob (-0.75 vs -9.0) is not compared; the first is
    # off by 0.5e-6; first divergence at token 1
    b = [([1, 2, 3], [-0.500001, -1.0, -2.000003]), ([4, 6], [-0.2500005, -9.0])]
    d = differences(a, b)
    assert d["responses"] == 2 and d["differing_tokens"] == 1 and d["first_divergence"] == 1
    assert abs(d["max_abs_dlogp"] - 3e-6) < 1e-12


def test_a_shorter_response_differs_from_where_it_ends():
    # the same first two tokens, then one response ended: they differ, first at token 2
    d = differences([([7, 8, 9], [-1.0, -1.0, -1.0])], [([7, 8], [-1.0, -1.0])])
    assert d == {"responses": 1, "differing_tokens": 1, "first_divergence": 2, "max_abs_dlogp": 0.0}
