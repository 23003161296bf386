"""Config-time validation: finite floats, betas, run names, duplicate YAML keys, trust_remote_code
warnings, sweeps over train.seed or with empty axes, and ablate's refusal to reuse a run of another config."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from emapg_cli.ablate.grid import Axis, Variant, plan_runs
from emapg_cli.ablate.runner import check_reuse, run_dir
from emapg_cli.ablate.study import build_sweep, load_study
from emapg_cli.config import Config, load_config
from emapg_cli.config.loading import list_presets, read_preset, to_yaml
from emapg_cli.errors import UserError


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "emapg_cli", *args], capture_output=True, text=True, timeout=120)


def _float_fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, how to set it) of every float-typed field, tuples of floats included."""
    out = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _float_fields(ann, f"{prefix}{name}.")
            continue
        union = typing.get_origin(ann) is typing.Union
        options = [a for a in typing.get_args(ann) if a is not type(None)] if union else [ann]  # Optional[X] -> [X]
        if float in options:
            out.append((f"{prefix}{name}", "scalar"))
        elif any(typing.get_origin(a) is tuple and float in typing.get_args(a) for a in options):
            out.append((f"{prefix}{name}", "pair"))
    return out


FLOAT_FIELDS = _float_fields(Config)


def test_float_fields_found():
    keys = [k for k, _ in FLOAT_FIELDS]
    assert {"optim.lr", "optim.eps", "optim.betas", "kl.coef", "ema.decay", "kl.iw_clip"} <= set(keys)


@pytest.mark.parametrize("key,kind", FLOAT_FIELDS)
@pytest.mark.parametrize("bad", [".inf", "-.inf", ".nan"])
def test_non_finite_float_rejected_at_config_time(key, kind, bad):
    value = bad if kind == "scalar" else f"[0.5, {bad}]"
    with pytest.raises(UserError, match="finite number"):
        load_config("toy", None, [f"{key}={value}"])


def test_issue_reproduction_lr_inf_is_refused_before_any_work(tmp_path):
    """`emapg train --preset toy --set ema.update_period=1 --set optim.lr=.inf`: exit 2, one line, no run folder."""
    out = tmp_path / "run"
    r = cli("train", "--preset", "toy", "--set", "ema.update_period=1", "--set", "optim.lr=.inf", "--out", str(out))
    assert r.returncode == 2 and r.stderr == "error: optim.lr: Input should be a finite number (got inf)\n"
    assert not out.exists()


@pytest.mark.parametrize("betas", ["[2, 3]", "[0.9, 1.0]", "[-0.1, 0.9]"])
def test_betas_outside_unit_interval_rejected(betas):
    with pytest.raises(UserError, match=r"optim.betas: each beta must be in \[0, 1\)"):
        load_config("toy", None, [f"optim.betas={betas}"])


@pytest.mark.parametrize("name", ["/abs/path", "..", ".", "a/../b", "a\\b", "", " x"])
def test_name_that_would_move_the_run_directory_rejected(name, tmp_path):
    with pytest.raises(UserError, match="name: must be a plain name"):
        load_config(None, None, [f"name={json.dumps(name)}"])
    preset = tmp_path / "p.yaml"
    preset.write_text(yaml.safe_dump({"name": name}))
    with pytest.raises(UserError, match="name: must be a plain name"):
        load_config(str(preset))
    assert load_config(None, None, ["name=my-run_1.2"]).name == "my-run_1.2"


def test_cli_name_outside_parent_exits_2_and_writes_nothing(tmp_path):
    preset = tmp_path / "evil.yaml"
    preset.write_text(f"name: {tmp_path / 'elsewhere'}\n")
    r = subprocess.run([sys.executable, "-m", "emapg_cli", "train", "--preset", str(preset)], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: name: must be a plain name")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.yaml"]


DUPLICATED = "name: dup\noptim:\n  lr: 0.1\n  eps: 1.0e-8\n  lr: 0.2\n"


@pytest.mark.parametrize("where", ["--preset", "--config"])
def test_duplicate_yaml_key_is_one_line_naming_file_and_key(where, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(DUPLICATED)
    with pytest.raises(UserError) as err:
        load_config(str(path)) if where == "--preset" else load_config(None, str(path))
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "duplicate key 'lr' (line 5)" in msg
    if where == "--config":  # and through the CLI (one subprocess is enough)
        r = cli("config", "show", where, str(path))
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "duplicate key 'lr'" in r.stderr


def test_duplicate_key_in_study_file_and_in_set_value(tmp_path):
    study = tmp_path / "s.yaml"
    study.write_text("preset: toy\ngrid:\n  kl.k: [1, 8]\n  kl.k: [32]\n")
    with pytest.raises(UserError, match=r"duplicate key 'kl.k' \(line 4\)") as err:
        load_study(str(study))
    assert str(study) in str(err.value)
    with pytest.raises(UserError):  # a mapping value on the command line: {a: 1, a: 2} is not silently {a: 2}
        load_config("toy", None, ["kl.iw_clip={a: 1, a: 2}"])


def test_preset_switching_on_remote_code_warns_naming_it(tmp_path, capsys):
    preset = tmp_path / "remote.yaml"
    preset.write_text("name: remote\nmodel:\n  trust_remote_code: true\n")
    r = cli("config", "show", "--preset", str(preset), "--set", "name=x")  # --set does not hide it
    assert r.returncode == 0
    assert r.stderr.strip() == (f"warning: preset {preset} switches on model.trust_remote_code: loading the model may "
                                "run Python code from the model's folder or repository")
    # the built-in presets keep it off, and --set (the user's own choice on the command line) does not warn
    assert all(not (read_preset(p).get("model") or {}).get("trust_remote_code") for p in list_presets())
    capsys.readouterr()
    load_config("toy", None, ["model.trust_remote_code=true"])
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- sweeps
def _study(tmp_path: Path, text: str) -> str:
    path = tmp_path / "study.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,message", [
    ("preset: toy\ngrid:\n  train.seed: [0, 1]\n", "do not grid over train.seed"),
    ("preset: toy\nvariants:\n  a: {train.seed: 3}\n", "do not set train.seed"),
    ("preset: toy\ngrid:\n  kl.k: []\n", "grid key 'kl.k' has no values"),
    ("preset: toy\ngrid:\n  kl.k: [8, 8]\n", "grid key 'kl.k' repeats a value"),
])
def test_study_file_grid_rejected(tmp_path, text, message):
    study = _study(tmp_path, text)
    with pytest.raises(UserError, match=message):
        build_sweep(study, None, None, [], None, []).runs()
    if "train.seed: [0, 1]" in text:  # and through the CLI (one subprocess is enough)
        out = tmp_path / "sw"
        r = cli("ablate", "--study", study, "--out", str(out))
        assert r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1
        assert not out.exists()


def test_plan_runs_rejects_seed_axis_and_empty_axis():
    with pytest.raises(UserError, match="train.seed"):
        plan_runs("toy", None, [], [], [Axis("train.seed", (0, 1))], [0])
    with pytest.raises(UserError, match="no values"):
        plan_runs("toy", None, [], [Variant("a", {})], [Axis("kl.k", ())], [0])


def _finish(out: Path, sweep, spec, overrides: list[str]) -> Path:
    """A finished run folder whose config.yaml is the resolved config of `overrides`."""
    rdir = run_dir(out, spec)
    rdir.mkdir(parents=True)
    (rdir / "config.yaml").write_text(to_yaml(load_config(sweep.preset, sweep.config, overrides)))
    (rdir / "summary.json").write_text(json.dumps({"eval_accuracy_final": 0.5, "steps": 10}))
    return rdir


def test_reuse_only_when_the_whole_resolved_config_matches(tmp_path):
    out = tmp_path / "sw"
    sweep = build_sweep(None, "toy", None, [Axis("kl.k", (1, 8))], 1, ["kl.coef=0.05"])
    runs = sweep.runs()
    for spec in runs:
        _finish(out, sweep, spec, list(spec.overrides))
    check_reuse(sweep, runs, out)  # same config: reused
    changed = build_sweep(None, "toy", None, [Axis("kl.k", (1, 8))], 1, ["kl.coef=0.07", "optim.lr=0.5"])
    with pytest.raises(UserError) as err:
        check_reuse(changed, changed.runs(), out)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"run kl.k=1/seed0 in {out} was made with another config (")
    assert "optim.lr: 0.0003 there, 0.5 now" in msg and "kl.coef: 0.05 there, 0.07 now" in msg


def test_cli_rerun_with_other_settings_refuses_and_changes_nothing(tmp_path):
    out = tmp_path / "sw"
    sweep = build_sweep(None, "toy", None, [Axis("kl.k", (1, 8))], 1, [])
    for spec in sweep.runs():
        _finish(out, sweep, spec, list(spec.overrides))
    (out / "study.yaml").write_text("old record\n")
    r = cli("ablate", "--preset", "toy", "--grid", "kl.k=1,8", "--set", "ema.decay=0.5", "--out", str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "run kl.k=1/seed0" in r.stderr and "ema.decay: 0.9 there, 0.5 now" in r.stderr
    assert (out / "study.yaml").read_text() == "old record\n"  # nothing rewritten
    assert not (out / "results.csv").exists()


def test_share_prompts_always_with_gradient_checkpointing_rejected_at_config_time():
    # transformers turns the key/value cache off under gradient checkpointing, so prompts cannot be shared there;
    # `auto` (the default) just keeps the padded pass
    with pytest.raises(UserError, match="share_prompts=always needs .* which model.gradient_checkpointing turns off"):
        load_config("toy", None, ["train.share_prompts=always", "model.gradient_checkpointing=true"])
    assert load_config("toy", None, ["model.gradient_checkpointing=true"]).train.share_prompts == "auto"


def test_mini_batch_sequences_replaces_prompts_and_counts_optimizer_steps():
    # 512 prompts x 5 samples = 2,560 sequences; 256 sequences per optimizer step -> 2560 / 256 = 10 steps
    cfg = Config(rollout={"prompts_per_step": 512, "n": 5}, train={"mini_batch_sequences": 256})
    assert cfg.train.mini_batch_prompts is None  # nulled: the two keys are exclusive
    assert cfg.derived.mini_batches_per_step == 10 and cfg.sequences_per_mini_batch == 256
    # the same step in prompts: 256 prompts x 5 = 1,280 sequences -> 2 steps
    assert Config(rollout={"prompts_per_step": 512, "n": 5}, train={"mini_batch_prompts": 256}).derived.mini_batches_per_step == 2
    with pytest.raises(Exception, match="exactly one of train.mini_batch_prompts and train.mini_batch_sequences"):
        Config(train={"mini_batch_prompts": 64, "mini_batch_sequences": 256})
    with pytest.raises(Exception, match="must divide the sequences of a step"):  # 128 x 8 = 1024 is not a multiple of 300
        Config(rollout={"prompts_per_step": 128, "n": 8}, train={"mini_batch_sequences": 300})


def test_rollout_correction_default_follows_the_engine_unless_given():
    assert Config(rollout={"engine": "hf"}).train.rollout_correction == "none"
    assert Config(rollout={"engine": "vllm"}).train.rollout_correction == "token_truncate"
    given = Config(rollout={"engine": "vllm"}, train={"rollout_correction": "sequence_mask"})
    assert given.train.rollout_correction == "sequence_mask"
    # the resolved value is written out, so a saved config.yaml reloads to the same setting
    assert Config(**yaml.safe_load(to_yaml(Config(rollout={"engine": "vllm"})))).train.rollout_correction == "token_truncate"


def test_search_eval_budget_is_per_turn_and_must_fit_the_context():
    search = {"enabled": True}
    cfg = Config(search=search, rollout={"max_new_tokens": 500}, data={"max_prompt_tokens": 2048})
    assert cfg.eval.max_new_tokens == 500  # unset: the per-turn rollout cap, not 8192
    # 2048 prompt + 3000 per turn = 5048 > 4096: no evaluation turn could start
    with pytest.raises(Exception, match=r"eval.max_new_tokens \(3000, per turn\)"):
        Config(search=search, rollout={"max_new_tokens": 500}, data={"max_prompt_tokens": 2048}, eval={"max_new_tokens": 3000})
    assert Config().eval.max_new_tokens == 8192  # single-turn runs keep the default


def test_rollout_correction_default_is_none_where_vllm_cannot_record_the_trainer_distribution():
    # T = 0.7 with top_p 0.9: vLLM's raw log-probs are untempered, its processed ones renormalised over the nucleus
    cfg = Config(rollout={"engine": "vllm", "temperature": 0.7, "top_p": 0.9})
    assert cfg.train.rollout_correction == "none"
    assert Config(rollout={"engine": "vllm", "temperature": 0.7}).train.rollout_correction == "token_truncate"  # top_p 1
    assert Config(rollout={"engine": "vllm", "top_p": 0.9}).train.rollout_correction == "token_truncate"  # T = 1


def test_an_unknown_key_in_a_list_item_names_the_items_keys():
    # before: the keys of the whole config were listed ("allowed in stages.0: name, model, data, ...")
    from emapg_cli.config import load_config

    with pytest.raises(UserError, match=r"unknown config key 'stages\.0\.x' \(allowed in stages\.0: steps, max_new_tokens, mask_truncated\)"):
        load_config("toy", overrides=["stages=[{steps: 3, max_new_tokens: 4, x: 1}]"])
