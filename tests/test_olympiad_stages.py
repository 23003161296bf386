"""The olympiad preset's stages: 8k to step 480, 16k to step 800 (the official README's resume points), 24k after;
evaluation at each stage's length; the dry-run plan's stage row."""

from __future__ import annotations

from emapg_cli.config.loading import load_config
from emapg_cli.train.plan import make_plan, stage_spans
from emapg_cli.train.evaluate import eval_max_new_tokens


def test_olympiad_stage_spans_and_evaluation_lengths():
    c = load_config("olympiad")
    assert stage_spans(c) == ((1, 480, 8192, True), (481, 800, 16384, False), (801, 1000, 24576, False))
    assert make_plan(c).stages == stage_spans(c)
    # evaluation before training (step 0) and at every 20th step runs at that step's stage length
    assert [eval_max_new_tokens(c, s) for s in (0, 20, 480, 500, 800, 820, 1000)] == [
        8192, 8192, 8192, 16384, 16384, 24576, 24576]
    # eval.max_new_tokens still caps it
    capped = load_config("olympiad", overrides=["eval.max_new_tokens=10000"])
    assert [eval_max_new_tokens(capped, s) for s in (0, 500, 1000)] == [8192, 10000, 10000]


def test_without_stages_evaluation_keeps_its_own_cap():
    c = load_config(overrides=["rollout.max_new_tokens=64", "eval.max_new_tokens=100"])
    assert stage_spans(c) == () and eval_max_new_tokens(c, 5) == 100


def test_stage_spans_follow_train_steps():
    stages = "stages=[{steps: 2, max_new_tokens: 10, mask_truncated: true}, {steps: 3, max_new_tokens: 20}]"
    # a run shorter than the stages stops inside the second; a longer one keeps the last stage's settings
    assert stage_spans(load_config(overrides=["train.steps=4", stages])) == ((1, 2, 10, True), (3, 4, 20, False))
    assert stage_spans(load_config(overrides=["train.steps=2", stages])) == ((1, 2, 10, True),)
    assert stage_spans(load_config(overrides=["train.steps=9", stages])) == ((1, 2, 10, True), (3, 9, 20, False))


def test_olympiad_dry_run_shows_the_stage_changes(cli, emapg_home):
    r = cli("train", "--preset", "olympiad", "--dry-run")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.replace("│", " ").split())
    assert "steps 1-480: 8,192 tokens, truncated dropped; steps 481-800: 16,384 tokens; steps 801-1,000: 24,576 tokens" in out
    assert "changes after steps 480, 800" in out and "2 per RL step, 2,000 in total" in out
