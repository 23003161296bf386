"""`emapg eval`: metrics by hand, grading given responses, generation with a tiny model, resume."""

from __future__ import annotations

import itertools
import json

import pytest
from eval_helpers import rerun_after_torn_write

from emapg_cli.evaluation.metrics import ItemScores, by_subset, ks_for, majority_correct, pass_at_k, summarize
from emapg_cli.grading import clean_answer

# --- metrics ------------------------------------------------------------------------------------------


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)  # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 = c/n
    assert pass_at_k(4, 3, 2) == 1.0  # n - c = 1 < k: every pair holds a correct sample
    assert pass_at_k(4, 0, 4) == 0.0
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


@pytest.mark.parametrize("n", [1, 3, 6])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample(n):
    # The estimator is exact: it equals the share of the C(n, k) subsets of size k holding a correct one.
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_ks_and_majority():
    assert ks_for(32) == [1, 2, 4, 8, 16, 32] and ks_for(6) == [1, 2, 4] and ks_for(1) == [1]
    assert majority_correct(["1", "2", "2", None], [True, False, False, False]) is False  # "2" wins 2:1
    assert majority_correct(["2", "1", "1", "2"], [False, True, True, False]) is False  # tie: first seen ("2")
    assert majority_correct([None, "7", None], [False, True, False]) is True  # no answer never votes
    assert majority_correct([None, None], [False, False]) is False


def test_summarize_by_hand():
    a = ItemScores([True, False, False, False], [True, False, False, False], ["1", "2", "2", None], "Algebra")
    b = ItemScores([True, True, False, False], [False, False, False, False], ["3", "3", "4", "5"], "Geometry")
    s = summarize([a, b])
    assert s["n"] == 4 and s["num_items"] == 2
    assert s["avg@n"] == s["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)  # 0.375
    # pass@2: a: 1 - C(3,2)/C(4,2) = 0.5; b: 1 - C(2,2)/C(4,2) = 5/6; mean = 2/3
    assert s["pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert s["pass@4"] == 1.0
    assert s["maj@n"] == 0.5  # a: "2" (wrong) wins; b: "3" (right) wins
    assert s["strict"] == pytest.approx(1 / 8)  # (1/4 + 0) / 2
    assert by_subset([a, b])["Geometry"]["pass@1"] == 0.5


# --- the CLI ----------------------------------------------------------------------------------------------


@pytest.fixture
def bench(tmp_path, emapg_home) -> tuple[str, list[dict]]:
    """A prepared bench: the real OlympiadBench when EMAPG_DATA_DIR has it, else 4 synthetic items."""
    from emapg_cli.datasets.prepare import prepare_dataset

    from eval_helpers import data_dir

    shared = data_dir()
    src = shared / "math" / "olympiadbench_test.jsonl" if shared else None
    if src is None or not src.is_file():
        src = tmp_path / "synthetic.jsonl"
        rows = [{"id": str(i), "question": f"What is {i}+{i}?", "answer": str(2 * i), "subfield": "Algebra"} for i in range(4)]
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare_dataset("olympiadbench", from_file=src)
    rows = [json.loads(line) for line in (emapg_home / "data" / "olympiadbench" / "data.jsonl").open()]
    return "olympiadbench", rows


def test_grade_given_responses(bench, tmp_path, cli):
    name, rows = bench
    rows = rows[:120]  # the full 675 (and more wrong variants) run in test_grading's slow acceptance test
    # Two responses per item: the gold boxed (right), and gold + " + 1" boxed (wrong).
    given = tmp_path / "given.jsonl"
    given.write_text("".join(
        json.dumps({"id": r["id"], "responses": [
            f"<think>hmm</think> The answer is $\\boxed{{{clean_answer(r['answers'][0])}}}$.",
            f"The answer is \\boxed{{{clean_answer(r['answers'][0])} + 1}}",
        ]}) + "\n" for r in rows
    ))
    out = tmp_path / "graded"
    r = cli("eval", "--bench", name, "--responses", str(given), "--out", str(out))
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_items"] == len(rows) and summary["n"] == 2
    # Every gold wrapped as a response is right; (almost) every "+ 1" variant is wrong.
    results = [json.loads(line) for line in (out / "results.jsonl").open()]
    assert all(row["correct"][0] for row in results)
    assert sum(row["correct"][1] for row in results) <= 0.005 * len(rows)
    assert summary["pass@1"] == pytest.approx(0.5, abs=0.005)
    assert summary["strict"] == pytest.approx(summary["pass@1"], abs=0.005)
    assert set(summary["subsets"]) and {"pass@2", "maj@n", "grader_version", "wall_time_s"} <= set(summary)
    assert (out / "summary.md").read_text().startswith("| bench | model |")


def test_generate_resume_and_mismatch(bench, tiny_qwen2, tmp_path, cli):
    name, _ = bench
    out = tmp_path / "run"
    common = ["eval", "--bench", name, "--model", str(tiny_qwen2), "--backend", "hf", "--n", "2",
              "--max-tokens", "8", "--chunk", "1", "--grader-workers", "1", "--out", str(out)]
    r = cli(*common, "--limit", "2")
    assert r.returncode == 0, r.stderr
    first = (out / "results.jsonl").read_text().splitlines()
    assert len(first) == 2
    row = json.loads(first[0])
    assert {"id", "responses", "extracted", "correct"} <= set(row) and len(row["responses"]) == 2
    assert len(row["correct"]) == 2 and all(isinstance(c, bool) for c in row["correct"])

    # An interrupted write leaves half a line; the rerun drops it, keeps the 2 finished items
    # untouched (not regenerated) and samples only the 2 new ones.
    summary = rerun_after_torn_write(cli, common, out, first, '{"id": "half-writ')
    assert summary["num_items"] == 4
    assert summary["sampling"]["seed"] == 429 and summary["generated_tokens"] > 0 and summary["tokens_per_s"] > 0

    r = cli(*common[:-2], "--n", "3", "--out", str(out), "--limit", "4")  # other settings, same folder
    assert r.returncode == 2 and "other settings" in r.stderr


def test_eval_input_errors(cli, emapg_home):
    r = cli("eval", "--bench", "missing-bench")
    assert r.returncode == 2 and "--model" in r.stderr
