"""Scoring the way the paper scores: truncated responses, the `</think>` rule,
maj@n by equivalence classes, and `emapg eval --bench` on raw benchmark layouts (through the real CLI)."""

from __future__ import annotations

import json

import pytest

from emapg_cli.evaluation.metrics import ItemScores, candidate_pairs, candidates, equivalence_votes, summarize
from emapg_cli.grading.extract import extract_answer
from emapg_cli.rewards.shaping import shape_rewards


def test_truncated_responses_score_zero_unless_graded():
    rewards, reasons = [1.0, 1.0, 0.0], ["stop", "length", "length"]
    assert shape_rewards(rewards, reasons, truncated="zero") == [1.0, 0.0, 0.0]
    assert shape_rewards(rewards, reasons, truncated="grade") == [1.0, 1.0, 0.0]


def test_reward_credit_solved_scores_one_or_zero_by_the_rewards_own_rule():
    """reward.credit=solved: each score becomes 1 if the reward counts it solved, else 0, before the truncation rule.
    reasoning-gym's partial credit (len(gold)/len(answer): `12` scores 0.5 against gold 1) is what a policy learnt to
    game on the smol preset (every answer `12`); with `solved` it earns nothing."""
    from types import SimpleNamespace

    from emapg_cli.train.rollout import score

    def rg_like(texts, examples):  # scores as given; solved = a full score, as reasoning-gym's reward says
        return [float(t) for t in texts]
    rg_like.solved = lambda r: r >= 1.0

    def plain(texts, examples):  # no rule of its own: solved = above 0.5
        return [float(t) for t in texts]

    done = [SimpleNamespace(text=t, finish_reason=fr, token_ids=[1, 2]) for t, fr in
            (("0.5", "stop"), ("1.0", "stop"), ("0.01", "stop"), ("1.0", "length"), ("0.75", "stop"))]
    shaping = {"truncated": "zero", "credit": "solved"}
    assert score(rg_like, done, [None] * 5, shaping)[0] == [0.0, 1.0, 0.0, 0.0, 0.0]  # 0.75 < 1: not solved
    assert score(plain, done, [None] * 5, shaping)[0] == [0.0, 1.0, 0.0, 0.0, 1.0]  # 0.75 > 0.5: solved
    # partial (the default) keeps the scores; the truncated one still scores 0
    assert score(rg_like, done, [None] * 5, {"truncated": "zero", "credit": "partial"})[0] == [0.5, 1.0, 0.01, 0.0, 0.75]


@pytest.mark.parametrize(
    "response, emapg, paper",
    [
        ("<think>\\boxed{1}</think> so \\boxed{2}", "2", "2"),  # one </think>: both look after it
        ("<think>\\boxed{1}</think>hm</think> \\boxed{3} then", "3", "3"),  # two: emapg after the last; paper everywhere (last box is 3 too)
        ("<think>a</think> \\boxed{5} </think> nothing boxed", None, "5"),  # two: after the last holds no box; paper searches the whole
        ("no think \\boxed{4}", "4", "4"),
    ],
)
def test_think_rules(response, emapg, paper):
    assert extract_answer(response, "emapg") == emapg
    assert extract_answer(response, "paper") == paper


def test_equivalence_votes_union_find():
    votes = ["3", "0.5", "\\frac12", "3", "1/2", None]
    cands = candidates(votes)
    assert cands == ["3", "0.5", "\\frac12", "1/2"]  # by count (3 twice), then first seen
    assert candidate_pairs(cands) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    same = [False, False, False, True, False, True]  # 0.5 ~ \frac12, \frac12 ~ 1/2 (so 0.5 ~ 1/2 by transitivity)
    assert equivalence_votes(votes, cands, same) == ["3", "0.5", "0.5", "3", "0.5", None]
    item = ItemScores([False, True, True, False, True, False], [False] * 6, votes,
                      classes=equivalence_votes(votes, cands, same))
    s = summarize([item])
    assert (s["maj@n"], s["maj@n_strict"]) == (1.0, 0.0)  # class "0.5" has 3 votes vs "3" with 2; strings: "3" wins


def test_eval_cli_truncation_and_equivalence_vote(tmp_path, cli):
    bench = tmp_path / "bench.jsonl"  # MATH-style problem/answer with integer ids: read through the converter
    bench.write_text('{"id": 1, "problem": "half?", "answer": "1/2"}\n{"id": 2, "problem": "two?", "answer": "2"}\n')
    resp = tmp_path / "resp.jsonl"
    resp.write_text(
        json.dumps({"id": "1", "responses": ["\\boxed{0.5}", "\\boxed{\\frac12}", "\\boxed{1/2}", "\\boxed{3}", "\\boxed{3}"]}) + "\n"
        + json.dumps({"id": "2", "responses": ["so \\boxed{2}. Wait, let", "\\boxed{5}", "\\boxed{5}", "\\boxed{2}", "\\boxed{7}"],
                      "finish_reasons": ["length", "stop", "stop", "stop", "stop"]}) + "\n")  # every item: 5 responses
    r = cli("eval", "--bench", str(bench), "--responses", str(resp), "--out", str(tmp_path / "zero"))
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "zero" / "summary.json").read_text())
    # item 1: 3 of 5 correct; the class {0.5, \frac12, 1/2} (3 votes) beats "3" (2 votes); by strings "3" wins.
    # item 2: the truncated "2" scores 0 and casts no vote: 1 of 5 correct, and "5" (2 votes) beats "2" and "7" (1 each).
    assert s["n"] == 5 and s["avg@n"] == pytest.approx((3 / 5 + 1 / 5) / 2)
    assert (s["maj@n"], s["maj@n_strict"], s["truncated"]) == (0.5, 0.0, "zero")
    r = cli("eval", "--bench", str(bench), "--responses", str(resp), "--out", str(tmp_path / "grade"), "--truncated", "grade")
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "grade" / "summary.json").read_text())
    # item 2 graded: "2" is correct (2 of 5) and ties "5" (2 votes each), the first seen ("2") wins.
    assert s["avg@n"] == pytest.approx((3 / 5 + 2 / 5) / 2) and (s["maj@n"], s["maj@n_strict"]) == (1.0, 0.5)


def test_eval_cli_reads_the_raw_olympiadbench_file(shared_data, tmp_path, cli):
    raw = shared_data / "math" / "olympiadbench_test.jsonl"
    rows = [json.loads(line) for line in raw.read_text().splitlines()[:3]]
    resp = tmp_path / "resp.jsonl"  # integer ids in the raw file; the gold as the response, and a wrong one
    resp.write_text("".join(json.dumps({"id": r["id"], "responses": [f"\\boxed{{{r['final_answer'][0].strip('$')}}}", "\\boxed{-12345}"]}) + "\n"
                            for r in rows))
    r = cli("eval", "--bench", str(raw), "--responses", str(resp), "--out", str(tmp_path / "ob"))
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "ob" / "summary.json").read_text())
    assert s["num_items"] == 3 and s["avg@n"] == pytest.approx(0.5)  # every gold right, every -12345 wrong


def test_removed_overlong_keys():
    """DAPO's soft overlong penalty is gone: a run's config.yaml holding it off (buffer 0, any penalty) still loads,
    for --resume; turning it on, or setting either key with --set, is the one-line error naming the removal."""
    from emapg_cli.config.loading import load_config, validate
    from emapg_cli.errors import UserError

    assert validate({"reward": {"overlong_buffer": 0, "overlong_penalty": 1.0}}).reward == load_config().reward
    with pytest.raises(UserError, match="reward.overlong_buffer .* is gone"):
        validate({"reward": {"overlong_buffer": 10}})
    with pytest.raises(UserError, match="reward.overlong_buffer .* is gone"):
        load_config(overrides=["reward.overlong_penalty=0.5"])
