"""The reward registry: names, the math / exact_match / toy rewards, and error containment."""

from __future__ import annotations

import pytest

from emapg_cli.data.schema import Example
from emapg_cli.errors import UserError
from emapg_cli.rewards import REWARDS, get_reward, register_reward
from emapg_cli.rewards.exact_match import exact_match, normalize_qa


def ex(*answers: str, **meta) -> Example:
    return Example(id="x", question="q?", answers=list(answers), meta=meta)


def test_unknown_reward_lists_the_known_ones():
    with pytest.raises(UserError, match=r"unknown reward 'nope' \(known: em, exact_match, f1, math, reasoning-gym, toy"):
        get_reward("nope")


def test_math_and_toy_rewards():
    examples = [ex("\\frac{1}{2}"), ex("1,3,5"), ex("4.2", tolerance=0.1), ex("7")]
    responses = ["<think>\\boxed{3}</think> so \\boxed{0.5}", "\\boxed{5,3,1}", "\\boxed{4.25}", "\\boxed{-7}"]
    for name in ("math", "toy"):
        reward = get_reward(name)
        try:
            assert reward(responses, examples) == [1.0, 1.0, 1.0, 0.0]
            assert reward.errors == 0
        finally:
            reward.close()


@pytest.mark.parametrize(
    "response, answers, ok",
    [
        ("The answer is <answer>The Eiffel Tower.</answer>", ["eiffel tower"], True),  # article, case, period
        ("\\boxed{Paris}", ["London", "paris"], True),  # any of the answers
        ("<answer>Paris, France</answer>", ["Paris"], False),  # exact, not containment
        ("<think><answer>Rome</answer></think>Berlin", ["Berlin"], True),  # only after </think>
    ],
)
def test_exact_match(response, answers, ok):
    assert exact_match(response, answers) is ok


def test_normalize_qa():
    assert normalize_qa("  The  Quick, brown fox! ") == "quick brown fox"


def test_raising_reward_scores_zero_and_is_counted(monkeypatch):
    def flaky(responses, examples):  # raises on any batch holding the response "boom"
        if "boom" in responses:
            raise RuntimeError("bad response")
        return [1.0] * len(responses)

    monkeypatch.setitem(REWARDS, "flaky", lambda think: flaky)
    reward = get_reward("flaky")
    assert reward(["a", "boom", "b", "boom"], [ex("1")] * 4) == [1.0, 0.0, 1.0, 0.0]
    assert reward.errors == 2


def test_register_reward(monkeypatch):
    monkeypatch.setattr("emapg_cli.rewards.registry.REWARDS", dict(REWARDS))
    register_reward("len", lambda think: (lambda rs, es: [float(len(r)) for r in rs]))
    assert get_reward("len")(["abc"], [ex("1")]) == [3.0]
