"""The toy task: a pure seeded generator, the warm start (SFT) and `prepare_toy`'s outputs.

Fast tests use a 1-layer, 32-wide model and a handful of SFT steps. The slow test runs the real
thing end to end (prepare with the default settings, then `emapg train --preset toy`) and checks
the issue's bars: warm start within 3 minutes at 20-60% test accuracy, RL within 10 minutes
lifting greedy test accuracy by at least 15 points.
"""

from __future__ import annotations

import json
import math

import pytest

from emapg_cli.datasets.loading import load_examples
from emapg_cli.tasks.toy.sft import IGNORE, PairEncoder, SFTConfig, collate, warm_start
from emapg_cli.tasks.toy.task import Problem, make_splits, problem_stream, response_text

SMALL = SFTConfig(hidden=32, layers=1, heads=2, kv_heads=1, batch_size=8, warmup=1, lr=1e-2)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matmuls: one thread is faster and immune to load


# ---------------------------------------------------------------- task generator
def test_problem_arithmetic_by_hand():
    # 37 + 48: units 7 + 8 = 15 carries, tens 3 + 4 + 1 = 8 -> 85
    p = Problem(37, 48)
    assert (p.value, p.carries, p.question) == (85, True, "What is 37 + 48?")
    # 32 + 41: units 2 + 1 = 3 does not carry -> 73
    assert (Problem(32, 41).value, Problem(32, 41).carries) == (73, False)
    # 55 + 45: units 5 + 5 = 10 carries (the boundary) -> 100
    assert (Problem(55, 45).value, Problem(55, 45).carries) == (100, True)
    assert response_text(85) == "\\boxed{85}"


def test_splits_are_seeded_disjoint_and_canonical():
    train, test = make_splits(0, 300, 100)
    again_train, again_test = make_splits(0, 300, 100)
    assert [e.model_dump() for e in train + test] == [e.model_dump() for e in again_train + again_test]
    other_train, _ = make_splits(1, 300, 100)
    assert [e.question for e in other_train] != [e.question for e in train]
    questions = [e.question for e in train + test]
    assert len(set(questions)) == 400  # distinct within and across splits
    assert len({e.id for e in train + test}) == 400
    for e in train + test:
        a, b = e.meta["a"], e.meta["b"]
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert e.answers == [str(a + b)] and e.question == f"What is {a} + {b}?"
        assert e.meta["carry"] == (a % 10 + b % 10 >= 10)


def test_stream_skips_excluded_questions():
    first = [p.question for _, p in zip(range(50), problem_stream(7))]
    kept = [p.question for _, p in zip(range(50), problem_stream(7, frozenset(first[:10])))]
    assert not set(first[:10]) & set(kept)
    assert kept[:5] == [q for q in first[10:] if q not in first[:10]][:5]  # same stream, minus the excluded


def test_boxed_response_scores_one_under_the_math_reward():
    from emapg_cli.rewards import get_reward

    _, test = make_splits(0, 0, 3)
    reward = get_reward("math")
    try:
        good = [response_text(int(e.answers[0])) for e in test]
        off_by_ten = [response_text(int(e.answers[0]) - 10) for e in test]  # a dropped carry
        assert reward(good + off_by_ten, test + test) == [1.0] * 3 + [0.0] * 3
    finally:
        reward.close()


# ---------------------------------------------------------------- warm start
@pytest.fixture(scope="module")
def tokenizer():
    from emapg_cli.models.tiny import build_byte_tokenizer

    return build_byte_tokenizer()


def _model(tokenizer, seed=0):
    from emapg_cli.models.tiny import build_tiny_model

    return build_tiny_model(tokenizer, arch="llama", hidden=SMALL.hidden, layers=SMALL.layers,
                            heads=SMALL.heads, kv_heads=SMALL.kv_heads, seed=seed)


def test_pairs_supervise_only_the_response(tokenizer):
    from emapg_cli.models.prompts import render_prompt

    ids, labels = PairEncoder(tokenizer)("What is 37 + 48?", "\\boxed{85}")
    prompt = render_prompt(tokenizer, "What is 37 + 48?")
    assert ids[: len(prompt)] == prompt  # exactly the trainer's prompt
    # byte tokens: "\boxed{85}" is 10 bytes, plus EOS = 11 supervised positions
    supervised = [t for t in labels if t != IGNORE]
    assert len(supervised) == 11 and supervised[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(supervised[:-1]) == "\\boxed{85}"
    x, mask, y = collate([(ids, labels), ([1, 2], [IGNORE, 2])], pad_id=tokenizer.pad_token_id)
    assert x.shape == y.shape == mask.shape == (2, len(ids))
    assert mask[1].tolist() == [1, 1] + [0] * (len(ids) - 2)  # right padding, masked
    assert y[1].tolist() == [IGNORE, 2] + [IGNORE] * (len(ids) - 2)


def test_warm_start_learns_is_deterministic_and_stops_on_request(tokenizer):
    cfg = SFTConfig(**{**SMALL.as_dict(), "max_steps": 20, "check_every": 10})

    m1, m2 = _model(tokenizer), _model(tokenizer)
    losses, checks = warm_start(m1, tokenizer, cfg, 0, frozenset(), lambda: 0.0)
    assert len(losses) == 20 and [s for s, _ in checks] == [10, 20]  # asked at steps 10 and 20
    # a fresh model predicts ~uniformly over 259 tokens: loss ~ ln 259 = 5.56; 20 steps learn much of
    # the fixed "\boxed{" ... "}" format, at least halving it (measured: 5.58 -> 1.1)
    assert abs(losses[0] - math.log(len(tokenizer))) < 0.5
    assert sum(losses[-5:]) / 5 < losses[0] / 2
    assert warm_start(m2, tokenizer, cfg, 0, frozenset(), lambda: 0.0)[0] == losses  # same seed, same run
    m3 = _model(tokenizer)
    assert len(warm_start(m3, tokenizer, cfg, 0, frozenset(), lambda: 1.0)[0]) == 10  # stops at the first check
    assert not m1.training


def test_warm_start_checks_finely_during_the_climb_and_stops_on_the_smoothed_accuracy(tokenizer):
    # coarse checks every 10 steps until an accuracy >= fine_from 0.1, then every 2 for good (a later
    # check below 0.1 does not switch back); stop once the mean of the last 3 checks >= 0.3.
    # Scripted: 0.0 (step 10), 0.1 (20: fine from now on), 0.05 (22): mean(0, .1, .05) = 0.05;
    # 0.5 (24): mean(.1, .05, .5) = 0.217; 0.2 (26): mean(.05, .5, .2) = 0.25; 0.4 (28): mean(.5, .2, .4)
    # = 0.367 >= 0.3 -> stop after step 28. A single check at 0.5 (step 24) alone does not stop it.
    cfg = SFTConfig(**{**SMALL.as_dict(), "max_steps": 40, "check_every": 10, "fine_every": 2,
                       "fine_from": 0.1, "smooth": 3, "target_accuracy": 0.3})
    scripted = iter([0.0, 0.1, 0.05, 0.5, 0.2, 0.4, 0.9, 0.9])
    losses, checks = warm_start(_model(tokenizer), tokenizer, cfg, 0, frozenset(), lambda: next(scripted))
    assert checks == [(10, 0.0), (20, 0.1), (22, 0.05), (24, 0.5), (26, 0.2), (28, 0.4)]
    assert len(losses) == 28


def test_prepare_toy_writes_the_task_the_model_and_a_manifest(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emapg_cli.tasks.toy import prepare as toy_prepare

    monkeypatch.setattr(toy_prepare, "N_TRAIN", 300)
    monkeypatch.setattr(toy_prepare, "N_TEST", 40)
    monkeypatch.setattr(toy_prepare, "N_DEV", 20)
    cfg = SFTConfig(**{**SMALL.as_dict(), "max_steps": 4, "check_every": 2, "target_accuracy": 1.0})
    manifest = toy_prepare.prepare_toy(tmp_path, seed=3, sft=cfg)

    out = tmp_path / "toy"
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["rows"] == {"train": 300, "test": 40} and manifest["seed"] == 3
    assert manifest["sft_steps"] == 4  # checked at steps 2 and 4, never reaching 1.0
    assert [c["step"] for c in manifest["sft_dev_accuracy"]] == [2, 4]
    assert 0.0 <= manifest["sft_test_accuracy"] <= 1.0
    train, test = load_examples(str(out / "train.jsonl")), load_examples(str(out / "test.jsonl"))
    assert [e.model_dump() for e in train + test] == [e.model_dump() for e in sum(make_splits(3, 300, 40), [])]
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_size == 32
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    assert manifest["model"]["parameters"] == sum(p.numel() for p in model.parameters())


def test_toy_preset_points_at_the_prepared_files(tmp_path, monkeypatch):
    from emapg_cli.config import load_config
    from emapg_cli.paths import expand

    monkeypatch.setenv("EMAPG_HOME", str(tmp_path))
    cfg = load_config("toy")
    assert expand(cfg.model.path) == tmp_path / "toy" / "model"
    assert expand(cfg.data.train) == tmp_path / "toy" / "train.jsonl"
    assert expand(cfg.data.eval) == tmp_path / "toy" / "test.jsonl"
    # "\boxed{198}" + EOS is 12 tokens: the longest correct answer fits in both budgets
    assert min(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens) >= len(response_text(198)) + 1


# ---------------------------------------------------------------- the bars (slow)
@pytest.mark.slow
def test_toy_end_to_end_meets_the_bars(emapg_home, cli, tmp_path):
    from emapg_cli.tasks.toy.prepare import prepare_toy

    manifest = prepare_toy(emapg_home, seed=0)
    assert manifest["sft_wall_s"] <= 180
    assert 0.2 <= manifest["sft_test_accuracy"] <= 0.6
    r = cli("train", "--preset", "toy", "--out", str(tmp_path / "run"), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # same engine, prompts, budget and grader (only the torch thread count may differ)
    assert abs(summary["eval_accuracy_initial"] - manifest["sft_test_accuracy"]) <= 0.01
    assert summary["wall_time_s"] <= 600
    assert summary["eval_accuracy_final"] - summary["eval_accuracy_initial"] >= 0.15
