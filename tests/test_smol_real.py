"""The real pretrained model of `emapg prepare --preset smol` (SmolLM2-135M-Instruct) through the paths a GPU run
takes: `emapg eval` with the hf engine, float32 and bfloat16 with float32 master weights, LoRA, a kill and resume,
and the dry run's memory plan. Marked `real` (opt in: `pytest -m real tests/test_smol_real.py`); each test is skipped
when `$EMAPG_HOME/smol/model` is absent. Each run is a few small steps (2 prompts x 4 samples of at most 8 tokens),
about a minute of two cores each (docs/smol.md, "Every path on the real model")."""

from __future__ import annotations

import json

import pytest

from train_helpers import killed_and_resumed, load_weights, run, train_cmd

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def smol():
    from emapg_cli.paths import emapg_home

    home = emapg_home() / "smol"
    if not (home / "model" / "config.json").is_file() or not (home / "test.jsonl").is_file():
        pytest.skip(f"{home}/model is absent: run `emapg prepare --preset smol` (docs/smol.md)")
    return home


def small(steps: int = 2, **extra) -> list[str]:
    """--set items for a short run of the smol preset: 2 prompts x 4 samples of <= 8 tokens, 4 held-out items."""
    values = {"train.steps": steps, "rollout.prompts_per_step": 2, "rollout.n": 4, "rollout.max_new_tokens": 8,
              "train.mini_batch_prompts": 2, "train.micro_batch_size": 8, "data.eval_limit": 4, "eval.every": 0,
              "eval.max_new_tokens": 8, "train.save_every": 1, "ema.update_period": 1, "optim.lr": 1e-5}
    values.update(extra)
    return ["--preset", "smol", *[x for k, v in values.items() for x in ("--set", f"{k}={v}")]]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_eval_with_the_hf_engine_answers_in_the_reward_format(smol, tmp_path, cli):
    # two demonstrations of the format (the preset has one, and RL teaches the rest: docs/smol.md)
    two = tmp_path / "two.yaml"
    two.write_text("data:\n  chat_prefix:\n"
                   "    - {role: user, content: 'What is the capital of France?'}\n"
                   "    - {role: assistant, content: '<answer>Paris</answer>'}\n"
                   "    - {role: user, content: 'How many days are in a week?'}\n"
                   "    - {role: assistant, content: '<answer>7</answer>'}\n")
    out = tmp_path / "ev"
    r = cli("eval", "--preset", "smol", "--config", str(two), "--model", str(smol / "model"), "--backend", "hf",
            "--limit", "8", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "4 chat turns before each question (data.chat_prefix)" in r.stdout
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(len(row["scores"]) == 1 for row in rows)
    # the chat prefix's demonstrations: the base model answers inside <answer> tags
    tagged = sum("<answer>" in row["responses"][0] and "</answer>" in row["responses"][0] for row in rows)
    assert tagged >= 7, [row["responses"] for row in rows]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reward"] == "reasoning-gym" and 0 <= summary["avg@n"] <= 1


@pytest.mark.parametrize("extra", [
    pytest.param({}, id="float32"),
    pytest.param({"model.dtype": "bfloat16"}, id="bf16-master-weights"),
    pytest.param({"lora.r": 8, "optim.lr": 1e-4}, id="lora"),
])
def test_a_few_steps_on_the_real_model(smol, tmp_path, extra):
    import torch

    out = tmp_path / "run"
    proc = run(train_cmd(*small(**extra), "--out", str(out)), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["reward/errors"] == 0 and r["steps/skipped"] == 0 and torch.isfinite(torch.tensor([r["loss/pg"], r["loss/kl"], r["grad/norm"]])).all()
        # the hf engine's sampling log-probs against the trainer's pass: round-off (bf16 compute: bf16's)
        assert r["rollout/logprob_max_abs_diff"] < (0.5 if "model.dtype" in extra else 1e-3)
    policy = load_weights(out / "final" / "policy") if "lora.r" not in extra else None
    if "model.dtype" in extra:  # bf16 compute over float32 master weights; final/ is saved in model.save_dtype, which
        # defaults to model.dtype (the transformers convention): policy and anchor in bf16
        assert policy["model.embed_tokens.weight"].dtype == torch.bfloat16
        assert load_weights(out / "final" / "anchor")["model.embed_tokens.weight"].dtype == torch.bfloat16
    if "lora.r" in extra:  # only the adapters trained: the final folder holds them
        assert (out / "final" / "policy" / "adapter" / "adapter_config.json").is_file()


def test_kill_and_resume_on_the_real_model_is_bit_identical(smol, tmp_path):
    a, b = killed_and_resumed(small(steps=3), tmp_path)
    for part in ("policy", "anchor"):
        wa, wb = load_weights(a / "final" / part), load_weights(b / "final" / part)
        assert wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa), part
    assert [r["step"] for r in _rows(b)] == [0, 1, 2, 3]
