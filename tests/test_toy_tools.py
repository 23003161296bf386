"""The toy-tools task: the calculator (values and refusals by hand), `CalculatorEnv` under the user-environment
contract and the real runner, the seeded task generator, the warm start's episode encoding and its check, the
preset, `prepare_toy_tools`'s outputs; and, slow, the issue's bar: the policy learns to call the calculator."""

from __future__ import annotations

import builtins
import json
import time

import pytest

from emapg_cli.agents.calculator import CalcError, CalculatorEnv, evaluate
from emapg_cli.tasks.toy.sft import IGNORE
from emapg_cli.tasks.toy_tools.task import Problem, gold_turns, make_splits, problem_stream


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: one thread is faster and immune to load


@pytest.fixture(scope="module")
def tok():
    from emapg_cli.models.tiny import build_byte_tokenizer

    return build_byte_tokenizer()  # one token per byte


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- the calculator
@pytest.mark.parametrize("expr, value", [
    ("347 * 58", "20126"),  # 347*50 + 347*8 = 17350 + 2776
    ("(2 + 3) * 4", "20"),
    ("2 + 3 * 4", "14"),  # precedence
    ("10 - 4 - 3", "3"),  # left to right: (10 - 4) - 3
    ("-7 // 2", "-4"),  # floor division rounds down: -3.5 -> -4
    ("7 % 3", "1"),
    ("6 / 3", "2"),  # exact: an integer quotient prints as an integer
    ("7 / 2", "3.5"),
    ("1 / 3", "0.333333"),  # 6 decimals
    ("-(1 / 8)", "-0.125"),
    ("20000001 / 10000000", "2"),  # 2.0000001 rounds to 2.000000: no trailing "."
    ("-1 / 3000000", "0"),  # -0.00000033 rounds to -0.000000: no "-0"
    ("1 / 3 * 3", "1"),  # exact fractions: no 0.999999
    ("2 ** 10", "1024"),
    ("(1 + 1) ** 3 ** 2", "512"),  # right associative: 2 ** 9
    ("  42  ", "42"),
    ("999999999999999", "999999999999999"),  # 15 digits: the largest literal
])
def test_calculator_values_by_hand(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr, why", [
    ("", "empty"),
    ("1 +", "syntax"),
    ("1 / 0", "division by zero"),
    ("5 % (2 - 2)", "division by zero"),
    ("2 ** 33", "exponents"),  # MAX_EXPONENT = 32
    ("2 ** -1", "exponents"),
    ("4 ** (1 / 2)", "exponents"),
    ("9 ** 9 ** 9", "exponents"),  # 9 ** 9 = 387420489 as an exponent: refused before computing
    ("0 ** 0", "0 \\*\\* 0"),
    ("1000000000000000", "digits"),  # 16 digits
    ("99999999 * 99999999", "digits"),  # 9999999800000001: 16 digits
    ("10 ** 15", "digits"),
    ("(10 ** 14) ** 32", "digits"),  # 449 digits, computed then refused
    ("1 / 1000000000000000", "digits"),  # denominator 10**15
    ("abs(3)", "only digits"),
    ("__import__('os')", "only digits"),
    ("x + 1", "only digits"),
    ("3.5 * 2", "only digits"),
    ("True + 1", "only digits"),
    ("[1] * 3", "only digits"),
    ("1 < 2", "only digits"),
    ("1_000", "only digits"),
    ("0x10", "only digits"),
    ("007", "syntax"),  # leading zeros are not Python integers
    ("(" * 40 + "1" + ")" * 40, "longer than 64"),
])
def test_calculator_refuses(expr, why):
    with pytest.raises(CalcError, match=why):
        evaluate(expr)


def test_calculator_never_calls_eval_and_stays_fast(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("eval called")

    monkeypatch.setattr(builtins, "eval", boom)
    monkeypatch.setattr(builtins, "exec", boom)
    start = time.perf_counter()
    for expr in ("99999999999999 ** 32", "(999999999999999 * 999999999999999) ** 32", "2 ** 32 ** 32",
                 "((((((((((((((((((((1))))))))))))))))))))", "9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9"):
        try:
            evaluate(expr)
        except CalcError:
            pass
    assert time.perf_counter() - start < 0.5
    assert evaluate("9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9 * 9") == str(9**15)  # 15 digits


# ---------------------------------------------------------------- the environment
def test_calculator_env_keeps_the_user_contract():
    from emapg_cli.agents.environments import check_env, load_env_class

    assert check_env("calc") == "calc"
    cls = load_env_class("calc")  # the factory's checks: step, max_turns, stop
    assert cls is CalculatorEnv and cls.stop == ["</calc>"] and cls.max_turns == 4
    assert not hasattr(cls, "reward")  # rollout.reward grades the final text

    env = CalculatorEnv({"question": "What is 347 * 58?", "answers": ["20126"]})
    assert env.step("<calc>347 * 58</calc>") == "<result>20126</result>"
    assert env.step("I think <calc> 3*(4+5) </calc>") == "<result>27</result>"  # content stripped
    assert env.invalid == 0
    assert env.step("<calc>347 x 58</calc>") == "<result>error</result>"
    assert env.step("<calc>1/0</calc>") == "<result>error</result>"
    assert env.invalid == 2
    assert env.step("\\boxed{20126}") is None  # any turn without a call ends the episode
    assert env.step("<calc>1 + 1") is None  # an unclosed call is no call
    assert env.invalid == 2


class Scripted:
    """An Engine that answers every row with the next of `turns` (all rows alike), log-prob -1 per token."""

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns, self.seen = tok, turns, []

    def generate(self, prompts, params):
        from emapg_cli.engines.base import Completion

        self.seen.append(params.stop)
        text = self.turns[len(self.seen) - 1]
        return [[Completion(ids(self.tok, text), "", "stop", [-1.0] * len(ids(self.tok, text)))] for _ in prompts]


def test_calculator_episode_through_the_runner_is_token_exact_and_graded(tok):
    from emapg_cli.agents.environments import generate, make_environment
    from emapg_cli.data.schema import Example
    from emapg_cli.engines.base import SamplingParams
    from emapg_cli.rewards import get_reward

    example = Example(id="t", question="What is 347 * 58?", answers=["20126"], source="toy-tools")
    env = make_environment("calc", tok)
    engine = Scripted(tok, ["<calc>347 * 58</calc>", "\\boxed{20126}"])
    [[ep]] = generate(env.bind(engine), [[1, 2, 3]], SamplingParams(n=1, max_new_tokens=24, temperature=0.0), [example])
    call, obs, answer = ids(tok, "<calc>347 * 58</calc>"), ids(tok, "<result>20126</result>"), ids(tok, "\\boxed{20126}")
    assert ep.token_ids == call + obs + answer
    assert ep.policy_mask == [True] * len(call) + [False] * len(obs) + [True] * len(answer)
    assert ep.logprobs == [-1.0] * len(call) + [0.0] * len(obs) + [-1.0] * len(answer)
    assert ep.text == "<calc>347 * 58</calc>\\boxed{20126}"  # the policy's text: the observation is not in it
    assert (ep.turns, ep.calls, ep.invalid, ep.outcome) == (2, 1, 0, "done")
    assert "</calc>" in engine.seen[0]  # the class's stop string ends a turn
    reward = get_reward("math")
    try:
        assert reward([ep.text], [example]) == [1.0]
    finally:
        reward.close()
    assert env.metrics([ep])["env/calls"] == 1.0


# ---------------------------------------------------------------- the task
def test_problems_and_gold_episodes_by_hand():
    p = Problem(347, 58)
    assert (p.value, p.question, p.expression) == (20126, "What is 347 * 58?", "347 * 58")
    assert gold_turns(p, call=False) == [("\\boxed{20126}", True)]
    assert gold_turns(p, call=True) == [("<calc>347 * 58</calc>", True), ("<result>20126</result>", False),
                                        ("\\boxed{20126}", True)]
    assert evaluate(p.expression) == str(p.value)  # the calculator answers what the gold episode shows


def test_splits_are_seeded_disjoint_and_canonical():
    sizes = {"test": 50, "dev": 20, "train": 200}
    splits = make_splits(0, sizes)
    assert {k: len(v) for k, v in splits.items()} == sizes
    assert [e.model_dump() for s in splits.values() for e in s] == [e.model_dump() for s in make_splits(0, sizes).values() for e in s]
    assert [e.question for e in make_splits(1, sizes)["train"]] != [e.question for e in splits["train"]]
    rows = [e for s in splits.values() for e in s]
    assert len({e.question for e in rows}) == len({e.id for e in rows}) == 270  # distinct within and across splits
    for e in rows:
        a, b = e.meta["a"], e.meta["b"]
        assert 100 <= a <= 999 and 10 <= b <= 99 and 10_000 <= a * b  # five-digit products only
        assert e.answers == [str(a * b)] and e.question == f"What is {a} * {b}?" and e.source == "toy-tools"
    held_out = frozenset(e.question for e in splits["test"] + splits["dev"])
    stream = problem_stream(5, held_out)
    assert not any(next(stream).question in held_out for _ in range(2000))


# ---------------------------------------------------------------- the warm start
def test_episode_encoding_trains_the_policy_turns_only(tok):
    from emapg_cli.tasks.toy_tools.prepare import encode_episode

    prompt = [7, 8, 9]
    call, obs, answer = ids(tok, "<calc>1 * 2</calc>"), ids(tok, "<result>2</result>"), ids(tok, "\\boxed{2}")
    x, y = encode_episode(tok, prompt, gold_turns(Problem(1, 2), call=True))
    eos = tok.eos_token_id
    assert x == prompt + call + obs + answer + [eos]
    assert y == [IGNORE] * 3 + call + [IGNORE] * len(obs) + answer + [eos]
    _, y_copy = encode_episode(tok, prompt, gold_turns(Problem(1, 2), call=True), decide=False)
    assert y_copy == [IGNORE] * 4 + call[1:] + [IGNORE] * len(obs) + answer + [eos]  # the decision `<` untrained


class OneHot:
    """A model whose logits at position t put `scale` on token `next_ids[row][t]` (0 elsewhere)."""

    def __init__(self, next_ids, vocab: int, scale: float):
        self.next_ids, self.vocab, self.scale = next_ids, vocab, scale

    def __call__(self, input_ids, attention_mask):
        import torch
        from types import SimpleNamespace

        logits = torch.zeros(*input_ids.shape, self.vocab)  # [B, T, V]
        for row, seq in enumerate(self.next_ids):
            for t, token in enumerate(seq):
                logits[row, t, token] = self.scale
        return SimpleNamespace(logits=logits)


def test_protocol_check_by_hand(tok):
    import math

    from emapg_cli.tasks.toy_tools.prepare import encode_episode, protocol_check

    prompt = ids(tok, "Q:")  # 2 tokens
    episodes = [encode_episode(tok, prompt, gold_turns(Problem(a, 2), call=True)) for a in (1, 3)]
    lens = [len(prompt)] * 2
    perfect = [x[1:] + [0] for x, _ in episodes]  # position t predicts x[t + 1]
    v = len(tok)
    exact, p_call = protocol_check(OneHot(perfect, v, 0.0 + math.log(v - 1)), tok, episodes, lens)
    # every row predicts every trained token; p(`<`) at the first response position = e^s / (e^s + V - 1) = 1/2
    assert exact == 1.0 and p_call == pytest.approx(0.5, abs=1e-5)
    wrong_first = [list(r) for r in perfect]
    wrong_first[0][len(prompt) - 1] = 5  # the decision is not checked: still exact, p(`<`) of row 0 now 1/V
    exact, p_call = protocol_check(OneHot(wrong_first, v, math.log(v - 1)), tok, episodes, lens)
    assert exact == 1.0 and p_call == pytest.approx((0.5 + 1 / (2 * (v - 1))) / 2, abs=1e-5)
    wrong_obs = [list(r) for r in perfect]
    obs_at = len(prompt) + len(ids(tok, "<calc>1 * 2</calc>")) + 1  # inside the observation: not trained, not checked
    wrong_obs[1][obs_at] = 5
    assert protocol_check(OneHot(wrong_obs, v, 1.0), tok, episodes, lens)[0] == 1.0
    wrong_answer = [list(r) for r in perfect]
    wrong_answer[1][len(episodes[1][0]) - 3] = 5  # a digit of `\boxed{6}` in row 1: one of two episodes wrong
    assert protocol_check(OneHot(wrong_answer, v, 1.0), tok, episodes, lens)[0] == 0.5


# ---------------------------------------------------------------- preset and prepare
def test_toy_tools_preset(tmp_path, monkeypatch, tok):
    from emapg_cli.config import load_config
    from emapg_cli.models.prompts import render_prompt
    from emapg_cli.paths import expand

    monkeypatch.setenv("EMAPG_HOME", str(tmp_path))
    cfg = load_config("toy-tools")
    assert cfg.rollout.env == "calc" and cfg.rollout.reward == "math"
    assert expand(cfg.model.path) == tmp_path / "toy-tools" / "model"
    assert expand(cfg.data.train) == tmp_path / "toy-tools" / "train.jsonl"
    assert expand(cfg.data.eval) == tmp_path / "toy-tools" / "test.jsonl"
    # the longest turns fit the per-turn budgets: `<calc>999 * 99</calc>` 21 tokens, `\boxed{98901}` + EOS 14
    p = Problem(999, 99)
    turns = [len(ids(tok, text)) + (text.startswith("\\") and 1) for text, trained in gold_turns(p, True) if trained]
    assert turns == [21, 14] and max(turns) <= min(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    longest = len(render_prompt(tok, p.question)) + sum(len(ids(tok, t)) for t, _ in gold_turns(p, True)) + 1
    assert len(render_prompt(tok, p.question)) <= cfg.data.max_prompt_tokens
    assert longest + cfg.rollout.max_new_tokens <= cfg.rollout.max_context_tokens  # room for a third turn


def test_prepare_toy_tools_writes_the_task_the_model_and_a_manifest(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from emapg_cli.datasets.loading import load_examples
    from emapg_cli.tasks.toy_tools import prepare as tools_prepare
    from emapg_cli.tasks.toy.sft import SFTConfig

    monkeypatch.setattr(tools_prepare, "SIZES", {"test": 12, "dev": 8, "train": 40})
    sft = SFTConfig(hidden=32, layers=1, heads=2, kv_heads=1, batch_size=8, warmup=1, lr=1e-2, max_steps=4,
                    check_every=2, target_accuracy=1.0)
    manifest = tools_prepare.prepare_toy_tools(tmp_path, seed=3, sft=sft)
    out = tmp_path / "toy-tools"
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["rows"] == {"test": 12, "train": 40} and manifest["seed"] == 3
    assert manifest["sft_steps"] == 4 and [c["step"] for c in manifest["sft_dev_checks"]] == [2, 4]
    assert 0.0 <= manifest["sft_test_accuracy"] <= 1.0 and 0.0 <= manifest["sft_test_calls"] <= 4.0
    assert 0.0 <= manifest["sft_call_probability"] <= 1.0
    splits = make_splits(3, {"test": 12, "dev": 8, "train": 40})
    for split in ("train", "test"):
        assert [e.model_dump() for e in load_examples(str(out / f"{split}.jsonl"))] == [e.model_dump() for e in splits[split]]
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 32


def test_prepare_cli_names_the_toy_presets(cli, emapg_home):
    r = cli("prepare", "--preset", "toy-nope")
    assert r.returncode != 0 and "'toy', 'toy-search', 'toy-tools', 'toy-distill' and 'smol'" in r.stderr + r.stdout


# ---------------------------------------------------------------- the bar (slow)
@pytest.mark.slow
def test_toy_tools_policy_learns_to_call_the_calculator(emapg_home, cli, tmp_path):
    """prepare + `emapg train --preset toy-tools` (seed 0): the warm start answers in its head (greedy: no calls,
    almost nothing right); after RL the greedy policy calls and is mostly right. ~3-5 minutes on 2 CPU cores."""
    from emapg_cli.tasks.toy_tools.prepare import prepare_toy_tools

    manifest = prepare_toy_tools(emapg_home, seed=0)
    assert manifest["sft_test_calls"] <= 0.2 and manifest["sft_test_accuracy"] <= 0.2
    assert 0.05 <= manifest["sft_call_probability"] <= 0.5  # sampled, it calls now and then
    r = cli("train", "--preset", "toy-tools", "--out", str(tmp_path / "run"), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert abs(summary["eval_accuracy_initial"] - manifest["sft_test_accuracy"]) <= 0.01
    assert summary["eval_accuracy_final"] >= 0.6
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    calls = [row["env/calls"] for row in rows if "env/calls" in row]
    assert calls[0] <= 0.6 and calls[-1] >= 0.8
