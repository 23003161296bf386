"""`emapg eval --compare A B` (evaluation/compare.py) and the paired statistics it shares with `emapg ablate`
(stats.paired_compare): hand-made evaluations with known per-item outcomes, against hand computations."""

from __future__ import annotations

import json
import math
import random

import pytest

from emapg_cli.stats import (binomial_cdf_half, bootstrap_mean_ci, mcnemar_exact, paired_compare, pairs_for_power_mcnemar,
                             percentile, sign_flip_test)


def _eval_folder(path, correct: dict[str, list[bool]]):
    """An `emapg eval` output folder with the rows `_Grading` writes."""
    path.mkdir(parents=True)
    rows = [{"id": i, "responses": ["x"] * len(c), "extracted": [None] * len(c), "correct": c, "strict": c} for i, c in correct.items()]
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run_folder(path, steps: dict[int, dict[str, list[bool]]]):
    """An `emapg train` run folder with its per-item evaluations evals/step_<N>.jsonl."""
    (path / "evals").mkdir(parents=True)
    for step, correct in steps.items():
        (path / "evals" / f"step_{step}.jsonl").write_text(
            "".join(json.dumps({"id": i, "correct": c, "scores": [float(x) for x in c]}) + "\n" for i, c in correct.items()))
    return path


# 20 items: A right on 0-13, B right on 7-13 and on 14: A alone on 0-6 (7 items), B alone on 14 (1), both on 7-13 (7),
# neither on 15-19 (5). Accuracies 14/20 = 0.70 and 8/20 = 0.40; paired difference (7 - 1) / 20 = +0.30.
A_RIGHT, B_RIGHT = set(range(14)), set(range(7, 15))
ITEMS = [f"q{i}" for i in range(20)]


def _exact_bootstrap_quantiles(up: int, down: int, n: int, qs=(0.025, 0.975)) -> list[float]:
    """The bootstrap distribution of the mean paired difference, exactly: a resample of the n pairs draws (u, d, z)
    ~ Multinomial(n; up/n, down/n, rest/n) pairs of difference +1, -1, 0; its mean is (u - d) / n. Returns the
    smallest mean whose CDF reaches each q (the quantile a percentile bootstrap estimates)."""
    pu, pd = up / n, down / n
    pz = 1 - pu - pd
    dist: dict[int, float] = {}
    for u in range(n + 1):
        for d in range(n + 1 - u):
            z = n - u - d
            prob = math.factorial(n) / (math.factorial(u) * math.factorial(d) * math.factorial(z)) * pu ** u * pd ** d * pz ** z
            dist[u - d] = dist.get(u - d, 0.0) + prob
    out, cdf = [], 0.0
    values = sorted(dist)
    for q in qs:
        cdf = 0.0
        for v in values:
            cdf += dist[v]
            if cdf >= q:
                out.append(v / n)
                break
    return out


def test_compare_two_eval_folders_by_hand(cli, tmp_path):
    a = _eval_folder(tmp_path / "a", {q: [i in A_RIGHT] for i, q in enumerate(ITEMS)})
    b = _eval_folder(tmp_path / "b", {q: [i in B_RIGHT] for i in reversed(range(20)) for q in [ITEMS[i]]})  # other order
    res = cli("eval", "--compare", str(a), str(b), "--json", str(tmp_path / "cmp.json"))
    assert res.returncode == 0, res.stderr
    rec = json.loads((tmp_path / "cmp.json").read_text())
    assert rec["items"] == 20 and rec["mean_a"] == 0.7 and rec["mean_b"] == 0.4
    assert rec["diff"] == pytest.approx(0.3, abs=1e-15)  # (7 - 1) / 20, exactly the difference of the accuracies
    assert rec["discordant"] == {"a_better": 7, "b_better": 1} and rec["ties"] == 12
    # McNemar exact: 8 discordant pairs, 1 the minority way: p = 2 P(X <= 1), X ~ Bin(8, 1/2) = 2 (1 + 8) / 256 = 0.0703125
    assert rec["test"] == "mcnemar" and rec["p"] == 0.0703125
    # the bootstrap interval: the exact bootstrap distribution's 2.5% and 97.5% quantiles of (u - d) / 20, computed
    # above from the multinomial (0.35, 0.05, 0.60), are 0.05 and 0.55 (the normal approximation: differences of mean
    # 0.3 and variance 8/20 - 0.3^2 = 0.31, 0.3 +- 1.96 sqrt(0.31 / 20) = [0.056, 0.544], on the grid of 1/20);
    # 2000 resamples estimate them to within one step of 1/20
    lo, hi = _exact_bootstrap_quantiles(7, 1, 20)
    assert (lo, hi) == (0.05, 0.55)
    assert abs(rec["ci"][0] - lo) <= 0.05 + 1e-12 and abs(rec["ci"][1] - hi) <= 0.05 + 1e-12
    assert rec["bootstrap"] == {"resamples": 2000, "seed": 0, "unit": "item"}
    # the verdict: p = 0.07 is not below 5%, though the interval excludes 0 (the test decides: it is exact)
    assert "no difference at the 0.05 level" in rec["verdict"] and rec["verdict"] in " ".join(res.stdout.split())
    assert "A better on 7, B better on 1, tied on 12" in res.stdout
    # reversed roles: the difference changes sign, the test does not
    rev = cli("eval", "--compare", str(b), str(a), "--json", str(tmp_path / "rev.json"))
    back = json.loads((tmp_path / "rev.json").read_text())
    assert rev.returncode == 0 and back["diff"] == pytest.approx(-0.3, abs=1e-15) and back["p"] == rec["p"]


def test_a_run_folder_means_its_final_evaluation(cli, tmp_path):
    """A run's final evaluation is its evals/step_<N>.jsonl with the largest N (10, not 9: numbers, not names); two
    samples per item make the scores fractions, so the paired permutation test is used."""
    a = _run_folder(tmp_path / "run", {9: {"q0": [False, False]}, 10: {"q0": [True, True], "q1": [True, False], "q2": [False, False],
                                                                        "q3": [True, True], "q4": [True, False], "q5": [False, False]}})
    b = _eval_folder(tmp_path / "b", {"q0": [False, False], "q1": [False, False], "q2": [True, False], "q3": [True, True],
                                      "q4": [False, False], "q5": [False, False]})
    res = cli("eval", "--compare", str(a), str(b), "--json", str(tmp_path / "c.json"))
    assert res.returncode == 0, res.stderr
    rec = json.loads((tmp_path / "c.json").read_text())
    assert rec["a"].endswith("step_10.jsonl")
    # per-item differences: q0 1 - 0 = 1, q1 0.5, q2 -0.5, q3 0, q4 0.5, q5 0; mean 1.5 / 6 = 0.25
    assert rec["diff"] == 0.25 and rec["test"] == "permutation" and rec["method"] == "exact"
    # exact sign flips of the 4 nonzero differences (1, 0.5, -0.5, 0.5), magnitudes summing to 2.5, observed sum 1.5:
    # a pattern whose negated magnitudes sum to s has sum 2.5 - 2 s, so |sum| >= 1.5 iff s <= 0.5 or s >= 2: the
    # subsets {}, {0.5} x 3 and their 4 complements: 8 of 16 patterns, p = 0.5
    assert rec["p"] == 0.5 and rec["discordant"] == {"a_better": 3, "b_better": 1}


def test_mismatched_items_and_bad_input_are_one_line(cli, tmp_path):
    a = _eval_folder(tmp_path / "a", {"q0": [True], "q1": [False]})
    b = _eval_folder(tmp_path / "b", {"q0": [True], "q2": [False], "q3": [True]})
    res = cli("eval", "--compare", str(a), str(b))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: --compare: the evaluations hold different items (2 in A, 3 in B; 1 only in A, 2 only in B; first: 'q1' only in A): "
        "compare evaluations of the same items"]
    other = cli("eval", "--compare", str(a), str(tmp_path), "--json", str(tmp_path / "x.json"))
    assert other.returncode == 2 and "neither an evaluation" in other.stderr and not (tmp_path / "x.json").exists()


def test_the_paired_statistics_by_hand():
    # binomial tails: P(X <= 1), X ~ Bin(8, 1/2) = 9/256
    assert binomial_cdf_half(1, 8) == 9 / 256 and mcnemar_exact(7, 1) == mcnemar_exact(1, 7) == 18 / 256
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(4, 4) == 1.0  # min(1, 2 * P(X <= 4 of 8) = 2 * 163/256)
    # McNemar is the exact sign-flip test on 0/1 differences (the same two-tailed distribution of |b - c|)
    assert sign_flip_test([1.0] * 7 + [-1.0] + [0.0] * 12) == (mcnemar_exact(7, 1), "exact", None)
    # 4 nonzero differences 0.5, 1, -0.25, 0.75 (observed sum 2.0, magnitudes 2.5): |sum| >= 2 iff the negated
    # magnitudes sum to <= 0.25 or >= 2.25: {}, {0.25} and their complements: 4 of 16
    assert sign_flip_test([0.5, 1.0, -0.25, 0.0, 0.75]) == (0.25, "exact", None)
    # Monte Carlo beyond 16 nonzero differences: 20 differences 1..20, all positive but 1 and 2. The exact p by
    # counting sign patterns (a DP over the sums, not enumeration) and the MC estimate agree within 4 standard errors
    d = [-1.0, -2.0] + [float(x) for x in range(3, 21)]
    counts = {0: 1}
    for x in range(1, 21):
        nxt: dict[int, int] = {}
        for s, c in counts.items():
            nxt[s + x] = nxt.get(s + x, 0) + c
            nxt[s - x] = nxt.get(s - x, 0) + c
        counts = nxt
    observed = abs(sum(d))  # 210 - 2 * 3 = 204
    exact = sum(c for s, c in counts.items() if abs(s) >= observed) / 2 ** 20
    p, method, flips = sign_flip_test(d, flips=20000, seed=0)
    assert method == "monte-carlo" and flips == 20000
    assert abs(p - exact) <= 4 * math.sqrt(exact * (1 - exact) / 20000) + 1 / 20001
    # the percentile bootstrap: constant differences give a point; two values 0 and 1 give [0, 1] (a resample of 2
    # is all zeros with probability 1/4, far above 2.5%)
    assert bootstrap_mean_ci([0.3] * 5) == pytest.approx((0.3, 0.3), abs=1e-15)
    assert bootstrap_mean_ci([0.0, 1.0]) == (0.0, 1.0)
    # Connor's formula: p10 = 0.35, p01 = 0.05: psi 0.4, delta 0.3:
    # n = ((1.95996 sqrt(0.4) + 0.84162 sqrt(0.4 - 0.09))^2 / 0.09) = (1.23959 + 0.46860)^2 / 0.09 = 32.43 -> 33
    assert pairs_for_power_mcnemar(0.35, 0.05) == 33 and pairs_for_power_mcnemar(0.1, 0.1) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5


def test_paired_compare_matches_keys_and_is_reproducible():
    rng = random.Random(3)
    a = {f"i{k}": float(rng.random() < 0.6) for k in range(300)}
    b = {f"i{k}": float(rng.random() < 0.5) for k in range(300)}
    first, again = paired_compare(a, b), paired_compare(dict(reversed(list(a.items()))), b)
    assert first == again  # the same pairs whatever the order they come in; the seeded bootstrap repeats
    assert first.n == 300 and first.a_better + first.b_better + first.ties == 300
    assert first.diff == pytest.approx(sum(a.values()) / 300 - sum(b.values()) / 300, abs=1e-12)
    # the bootstrap interval of a mean of 300 pairs is close to the normal one: mean +- 1.96 sd / sqrt(n); with 2000
    # resamples the percentiles sit within 0.01 of it here (sd of the differences ~0.7, se ~0.04)
    diffs = [a[k] - b[k] for k in a]
    sd = math.sqrt(sum((x - first.diff) ** 2 for x in diffs) / 299)
    assert first.lo == pytest.approx(first.diff - 1.96 * sd / math.sqrt(300), abs=0.01)
    assert first.hi == pytest.approx(first.diff + 1.96 * sd / math.sqrt(300), abs=0.01)
    assert paired_compare({1: 0.5}, {2: 0.5}).n == 0


# issue 40, item 7: the statistics were pure Python (~1.5 ms an item: 10^6 items took ~25 minutes); now numpy


def _pure_python_bootstrap(xs, confidence=0.95, resamples=2000, seed=0):
    """The implementation before: each resample draws len(xs) values with replacement (random.Random)."""
    rng = random.Random(seed)
    means = [sum(rng.choices(xs, k=len(xs))) / len(xs) for _ in range(resamples)]
    return percentile(means, (1 - confidence) / 2), percentile(means, (1 + confidence) / 2)


def _pure_python_flips(d, flips=20000, seed=0):
    """The implementation before: a coin per nonzero difference (all 2^m patterns up to m = 16)."""
    d = [x for x in d if x != 0.0]
    observed = abs(sum(d))
    if len(d) <= 16:
        hits = sum(abs(sum(-x if mask >> i & 1 else x for i, x in enumerate(d))) >= observed - 1e-12 for mask in range(2 ** len(d)))
        return hits / 2 ** len(d)
    rng = random.Random(seed)
    hits = sum(abs(sum(x if rng.random() < 0.5 else -x for x in d)) >= observed - 1e-12 for _ in range(flips))
    return (1 + hits) / (1 + flips)


def test_the_vectorised_statistics_equal_the_pure_python_ones():
    rng = random.Random(5)
    a = {f"i{k}": rng.choice([0.0, 0.5, 1.0]) for k in range(200)}  # avg@2 scores: fractions, so the permutation test
    b = {f"i{k}": rng.choice([0.0, 0.5, 1.0]) for k in range(200)}
    r = paired_compare(a, b)
    diffs = [a[k] - b[k] for k in sorted(a)]
    assert r.test == "permutation" and r.method == "monte-carlo" and r.n == 200
    assert r.mean_a == pytest.approx(sum(a.values()) / 200, abs=1e-12) and r.diff == pytest.approx(sum(diffs) / 200, abs=1e-12)
    assert (r.a_better, r.b_better, r.ties) == (sum(d > 0 for d in diffs), sum(d < 0 for d in diffs), sum(d == 0 for d in diffs))
    # the resampled numbers within Monte Carlo error of the pure-Python draws: the p-value within 4 standard errors
    # of 20000 flips each (sqrt(2 p (1 - p) / 20000) for the difference of two estimates), the bootstrap's
    # percentiles within 0.01 (se of the mean difference ~0.05 here; 2000 resamples put its 2.5% point within ~0.004)
    old_p = _pure_python_flips(diffs)
    assert abs(r.p - old_p) <= 4 * math.sqrt(2 * old_p * (1 - old_p) / 20000) + 2 / 20001
    old_lo, old_hi = _pure_python_bootstrap(diffs)
    assert abs(r.lo - old_lo) <= 0.01 and abs(r.hi - old_hi) <= 0.01
    # the exact test is the same enumeration: equal for up to 16 nonzero differences
    few = [0.5, -1.0, 0.25, 0.0, 1.0, -0.5, 0.75, 0.5, -0.25, 1.0, 0.5, 0.5, -0.75, 0.25]
    assert sign_flip_test(few) == (_pure_python_flips(few), "exact", None)


def test_a_million_pairs_take_seconds():
    import threading
    import time

    a = {k: (k % 3) / 2 for k in range(10 ** 6)}  # 0, 0.5, 1: the permutation test and the bootstrap both resample
    b = {k: (k % 7 > 2) * 1.0 for k in range(10 ** 6)}
    box: dict = {}
    t0 = time.perf_counter()
    worker = threading.Thread(target=lambda: box.update(r=paired_compare(a, b)), daemon=True)
    worker.start()
    worker.join(60)  # before: ~25 minutes
    assert "r" in box and time.perf_counter() - t0 < 60
    # mean_a = (0 + 0.5 + 1) / 3 = 0.5 over whole cycles (999999 of the 10^6 keys; key 999999 = 0 mod 3 scores 0)
    assert box["r"].n == 10 ** 6 and box["r"].mean_a == pytest.approx(0.5, abs=1e-5) and box["r"].test == "permutation"


def test_json_never_writes_over_a_file_it_did_not_write(cli, tmp_path):
    # issue 40, item 6: `--compare A B --json A/results.jsonl` replaced A's per-item results with the record
    a = _eval_folder(tmp_path / "A", {i: [i in A_RIGHT] for i in ITEMS})
    _eval_folder(tmp_path / "B", {i: [i in B_RIGHT] for i in ITEMS})
    before = (a / "results.jsonl").read_bytes()
    r = cli("eval", "--compare", str(a), str(tmp_path / "B"), "--json", str(a / "results.jsonl"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not an earlier comparison record" in r.stderr, r.stderr
    assert (a / "results.jsonl").read_bytes() == before
    # its own record, written before, is replaced
    for _ in range(2):
        assert cli("eval", "--compare", str(a), str(tmp_path / "B"), "--json", str(tmp_path / "cmp.json")).returncode == 0
    assert json.loads((tmp_path / "cmp.json").read_text())["items"] == 20


def test_differing_settings_are_one_warning_line(cli, tmp_path):
    # issue 40, item 9: a 32-sample T = 0.8 evaluation compared with a greedy one without a word
    correct = {i: [i in A_RIGHT] for i in ITEMS}
    for name, n, temperature in (("A", 32, 0.8), ("B", 1, 0.0), ("C", 1, 0.0)):
        folder = _eval_folder(tmp_path / name, correct)
        (folder / "run.json").write_text(json.dumps({"model": f"m-{name}", "n": n, "temperature": temperature, "top_p": 1.0,
                                                     "max_tokens": 64, "reward": "math", "think": "emapg", "truncated": "zero"}))
    r = cli("eval", "--compare", str(tmp_path / "A"), str(tmp_path / "B"), "--json", str(tmp_path / "ab.json"))
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert r.returncode == 0 and len(warnings) == 1, r.stderr
    assert "n 32 vs 1" in warnings[0] and "temperature 0.8 vs 0.0" in warnings[0] and "top_p" not in warnings[0]
    assert json.loads((tmp_path / "ab.json").read_text())["differing_settings"] == {"n": [32, 1], "temperature": [0.8, 0.0]}
    r = cli("eval", "--compare", str(tmp_path / "B"), str(tmp_path / "C"))  # different models, the same settings
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
