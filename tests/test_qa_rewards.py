"""QA rewards `em` / `f1` (hand-computed) and `emapg eval --reward em --responses` on the shared Bamboogle questions."""

from __future__ import annotations

import json

import pytest

from emapg_cli.data.schema import Example
from emapg_cli.rewards import get_reward
from emapg_cli.rewards.qa import em_score, f1_score


def ex(*answers):
    return Example(id="x", question="q?", answers=list(answers))


def test_em_normalisation_and_last_answer():
    em = get_reward("em")
    responses = [
        "<think>..</think><answer> The  Eiffel Tower. </answer>",   # lower, punctuation, article, spaces -> "eiffel tower"
        "<answer> Eiffel-Tower </answer>",                           # "-" is dropped, not a space: "eiffeltower" -> 0
        "<answer> Paris </answer> then <answer> London </answer>",  # the last answer counts
        "I think it is Paris",                                       # no <answer>: 0
        "<answer> an apple </answer>",                               # "apple" vs gold "Apple Inc" -> 0
        "<answer>paris</answer>",                                     # any gold: second gold matches
    ]
    golds = [ex("Eiffel Tower"), ex("Eiffel Tower"), ex("london"), ex("Paris"), ex("Apple Inc"), ex("Rome", "PARIS")]
    assert em(responses, golds) == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_f1_hand_computed():
    # pred "barack obama jr" vs gold "Barack Obama": common 2, P = 2/3, R = 2/2, F1 = 2*(2/3)*1/(2/3+1) = 0.8
    assert f1_score("Barack Obama Jr.", ["Barack Obama"]) == pytest.approx(0.8)
    # best over golds: "obama" vs ["Michelle Obama" (P 1, R 1/2 -> 2/3), "Obama" (1.0)] -> 1.0
    assert f1_score("Obama", ["Michelle Obama", "Obama"]) == 1.0
    # articles are dropped before counting: "the cat" -> ["cat"]; gold "a cat sat" -> ["cat", "sat"]: P 1, R 1/2 -> 2/3
    assert f1_score("the cat", ["a cat sat"]) == pytest.approx(2 / 3)
    assert f1_score(None, ["x"]) == 0.0 and f1_score("dog", ["cat"]) == 0.0
    assert get_reward("f1")(["<answer> Barack Obama Jr. </answer>"], [ex("Barack Obama")]) == [pytest.approx(0.8)]
    assert em_score("Barack Obama Jr.", ["Barack Obama"]) == 0.0


def test_eval_grades_bamboogle_responses(shared_data, tmp_path, cli):
    rows = [json.loads(line) for line in open(shared_data / "search" / "bamboogle_test.jsonl")]
    assert len(rows) == 125
    bench = tmp_path / "bamboogle.jsonl"  # the canonical schema: {id, question, answers, source}
    bench.write_text("".join(json.dumps({"id": r["id"], "question": r["question"], "answers": r["golden_answers"],
                                         "source": "bamboogle"}) + "\n" for r in rows))
    first = {r["id"]: r for r in rows[:4]}
    assert first["test_0"]["golden_answers"] == ["james madison"] and first["test_1"]["golden_answers"] == ["Titan IIIE"]
    responses = [
        {"id": "test_0", "responses": ["<search> Citibank founded </search><answer> James Madison. </answer>",  # 1
                                       "<answer> Thomas Jefferson </answer>"]},                                   # 0
        {"id": "test_1", "responses": ["<answer> the Titan IIIE </answer>", "Titan IIIE"]},  # 1, 0 (no tag)
        {"id": "test_2", "responses": ["<answer> no idea </answer>", "<answer> no idea </answer>"]},  # 0, 0
    ]
    resp = tmp_path / "responses.jsonl"
    resp.write_text("".join(json.dumps(r) + "\n" for r in responses))
    out = tmp_path / "out"
    r = cli("eval", "--bench", str(bench), "--reward", "em", "--responses", str(resp), "--out", str(out))
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    # per item avg: test_0 1/2, test_1 1/2, test_2 0 -> avg@n = (0.5 + 0.5 + 0) / 3 = 1/3
    assert summary["num_items"] == 3 and summary["avg@n"] == pytest.approx(1 / 3)
    assert summary["pass@2"] == pytest.approx(2 / 3) and summary["mean_score"] == pytest.approx(1 / 3)
    results = [json.loads(line) for line in open(out / "results.jsonl")]
    assert results[0]["extracted"] == ["James Madison.", "Thomas Jefferson"] and results[1]["extracted"][1] is None
    r = cli("eval", "--bench", str(bench), "--reward", "f1", "--responses", str(resp), "--out", str(tmp_path / "f1"))
    assert r.returncode == 0, r.stderr
    # f1: test_0 (1 + 0)/2, test_1 (1 + 0)/2, test_2 0 -> 1/3 (no partial overlaps here)
    assert json.loads((tmp_path / "f1" / "summary.json").read_text())["mean_score"] == pytest.approx(1 / 3)
