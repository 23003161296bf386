"""`emapg eval --reward`: one lookup with training (the rewards registry), plugins through the real CLI,
with `--responses` and with generation on a tiny model; hand-computed scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_untrusted_input import _one_line_error  # exit 2, one line on stderr, no traceback

PLUGIN = '''
def parity(response, example):
    """1.0 for an odd-length response, else 0.0."""
    return float(len(response) % 2)


def half_length(response, example):
    """Partial credit: len / 2 (1.0 and above count as solved)."""
    return len(response) / 2


def broken(response, example):
    return example["answer"]  # the canonical row has "answers": KeyError on every item


def picky(response, example):
    if response == "x":
        raise ValueError("cannot grade x")
    return 1.0
'''

# Two items, four responses each (lengths 1 2 3 4 and 2 4 2 1).
RESPONSES = {"0": ["a", "bb", "ccc", "dddd"], "1": ["bb", "dddd", "ff", "x"]}


@pytest.fixture
def files(tmp_path, emapg_home) -> tuple[Path, Path, Path]:
    bench = tmp_path / "bench.jsonl"
    bench.write_text("".join(json.dumps({"id": i, "question": f"{i}+{i}?", "answers": [str(2 * int(i))]}) + "\n" for i in "01"))
    given = tmp_path / "given.jsonl"
    given.write_text("".join(json.dumps({"id": i, "responses": rs}) + "\n" for i, rs in RESPONSES.items()))
    plugin = tmp_path / "my_reward.py"
    plugin.write_text(PLUGIN)
    return bench, given, plugin


def _run(out: Path) -> tuple[dict, list[dict]]:
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return summary, rows


def _grade_given(files, out: Path, cli, fn: str):
    """`emapg eval --responses` of the given responses with plugin function `fn`; (process, summary, rows)."""
    bench, given, plugin = files
    r = cli("eval", "--bench", str(bench), "--responses", str(given), "--reward", f"{plugin}:{fn}",
            "--grader-workers", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return (r, *_run(out))


def test_eval_grades_given_responses_with_a_plugin(files, tmp_path, cli):
    bench, given, plugin = files
    out = tmp_path / "parity"
    _, summary, rows = _grade_given(files, out, cli, "parity")
    # parity = len % 2: item 0 [1, 0, 1, 0] (c = 2 of 4), item 1 [0, 0, 0, 1] (c = 1 of 4)
    assert [row["scores"] for row in rows] == [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]
    assert [row["correct"] for row in rows] == [[True, False, True, False], [False, False, False, True]]
    assert all(row["extracted"] == [None] * 4 for row in rows)
    # avg@n = (2/4 + 1/4) / 2 = 0.375; pass@2 = mean(1 - C(2,2)/C(4,2), 1 - C(3,2)/C(4,2)) = (5/6 + 1/2) / 2 = 2/3
    assert summary["avg@n"] == summary["pass@1"] == pytest.approx(0.375)
    assert summary["pass@2"] == pytest.approx(2 / 3) and summary["pass@4"] == 1.0
    assert summary["mean_score"] == pytest.approx(0.375)  # 0/1 scores: the mean reward is avg@n
    # no answers to vote on: maj@n is not defined
    assert summary["maj@n"] is None and summary["maj@n_strict"] is None
    assert summary["reward"] == f"{plugin.resolve()}:parity" and summary["grader_version"] == f"plugin {plugin.resolve()}:parity"
    assert summary["grader_errors"] == 0 and summary["grader_timeouts"] == 0
    assert "| - | - |" in (out / "summary.md").read_text()  # maj@n columns print as "-"

    # partial credit: half_length = len / 2, solved at >= 1
    _, summary, rows = _grade_given(files, tmp_path / "half", cli, "half_length")
    # item 0 [0.5, 1, 1.5, 2] -> solved [F, T, T, T]; item 1 [1, 2, 1, 0.5] -> [T, T, T, F]: avg@n = 3/4
    assert [row["correct"] for row in rows] == [[False, True, True, True], [True, True, True, False]]
    assert summary["avg@n"] == pytest.approx(0.75)
    # mean reward = (5/4 + 9/8) / 2 = 1.1875 (a score above 1 is kept as it is)
    assert summary["mean_score"] == pytest.approx(1.1875)


def test_eval_generates_and_grades_with_a_plugin(files, tiny_qwen2, tmp_path, cli_many):
    bench, _, plugin = files
    out = tmp_path / "gen"
    common = ("eval", "--bench", str(bench), "--model", str(tiny_qwen2), "--backend", "hf", "--n", "3", "--max-tokens", "6",
              "--reward", f"{plugin}:parity", "--grader-workers", "1")
    # --truncated zero (the default) and --truncated grade: two independent runs, at once
    r, r_grade = cli_many((*common, "--out", str(out)), (*common, "--truncated", "grade", "--out", str(tmp_path / "gen2")))
    assert r.returncode == 0, r.stderr
    summary, rows = _run(out)
    assert len(rows) == 2 and summary["generated_tokens"] > 0
    for row in rows:  # each score recomputed from the sampled text (truncated at 6 tokens: scored 0, --truncated zero)
        cut = [fr == "length" for fr in row["finish_reasons"]]
        assert row["scores"] == [0.0 if c else float(len(t) % 2) for t, c in zip(row["responses"], cut)]
        assert row["correct"] == [s >= 1.0 for s in row["scores"]]
    assert summary["avg@n"] == pytest.approx(sum(sum(row["correct"]) / 3 for row in rows) / 2)
    assert summary["maj@n"] is None

    # --truncated grade: every response graded, so the scores are exactly len % 2
    assert r_grade.returncode == 0, r_grade.stderr
    _, rows = _run(tmp_path / "gen2")
    assert all(row["scores"] == [float(len(t) % 2) for t in row["responses"]] for row in rows)


def test_a_response_the_plugin_cannot_grade_scores_zero_and_is_reported(files, tmp_path, cli):
    r, summary, rows = _grade_given(files, tmp_path / "picky", cli, "picky")
    # only item 1's last response is "x": it raises, scores 0 and is counted; the other 7 score 1 -> avg@n = (4/4 + 3/4) / 2
    assert rows[1]["scores"] == [1.0, 1.0, 1.0, 0.0] and summary["grader_errors"] == 1
    assert summary["avg@n"] == pytest.approx(0.875)
    assert "warning: some responses could not be graded and scored 0 (1 errors" in r.stderr


def test_bad_plugin_refs_are_one_line_errors(files, tmp_path, cli_many):
    bench, given, plugin = files
    base = ("eval", "--bench", str(bench), "--responses", str(given), "--grader-workers", "1")
    out = tmp_path / "d"
    missing_file, missing_fn, unknown, broken = cli_many(  # four independent runs, two at a time
        (*base, "--reward", f"{tmp_path}/none.py:fn", "--out", str(tmp_path / "a")),
        (*base, "--reward", f"{plugin}:missing", "--out", str(tmp_path / "b")),
        (*base, "--reward", "nope", "--out", str(tmp_path / "c")),
        (*base, "--reward", f"{plugin}:broken", "--out", str(out)))
    _one_line_error(missing_file, "--reward: reward plugin file not found")
    _one_line_error(missing_fn, "--reward:", "no function 'missing'")
    _one_line_error(unknown, "--reward: unknown reward 'nope'", "math")
    # a plugin that fails on every response of its first batch: broken, not harsh; nothing is written
    _one_line_error(broken, "failed on all 8 responses of the first batch", "KeyError: 'answer'")
    assert not (out / "results.jsonl").exists() or (out / "results.jsonl").read_text() == ""


def test_eval_and_training_share_one_lookup(files):
    """Registered names stay names: math and toy grade answer by answer with math-verify, em and f1 with
    QA answers; any other reward (exact_match, a plugin) by its score. Unknown names fail as in training."""
    from emapg_cli.errors import UserError
    from emapg_cli.grading import MathGrader
    from emapg_cli.rewards.graders import ScoreGrader, get_grader
    from emapg_cli.rewards.qa import QAGrader

    _, _, plugin = files
    kinds = {"math": MathGrader, "toy": MathGrader, "em": QAGrader, "f1": QAGrader, "exact_match": ScoreGrader,
             f"{plugin}:parity": ScoreGrader}
    for name, kind in kinds.items():
        with get_grader(name, workers=1, timeout=2.0) as grader:
            assert isinstance(grader, kind), name
            assert grader.votes == (kind is not ScoreGrader)
    with get_grader("math", workers=1, timeout=2.0) as grader:  # --grader-workers / --grader-timeout reach the grader
        assert (grader.workers, grader.timeout) == (1, 2.0)
    with get_grader(f"{plugin}:parity", workers=1, timeout=2.0) as grader:
        assert (grader.reward.fn.workers, grader.reward.fn.timeout) == (1, 2.0)
    with pytest.raises(UserError, match="unknown reward 'nope'"):
        get_grader("nope")
