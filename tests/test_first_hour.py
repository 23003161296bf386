"""The newcomer path (issue "the first hour"): messages that say what to do, checks before any work,
escaped text, default folders, the toy bench, progress helpers and `emapg plot`."""

from __future__ import annotations

import json
import shlex
from importlib.util import find_spec
from pathlib import Path

import pytest

from conftest import run_cli as cli


# --------------------------------------------------------------- escaped text (rich markup)
def test_config_keys_keeps_text_in_square_brackets():
    r = cli("config", "keys", env={"COLUMNS": "400"})
    assert r.returncode == 0, r.stderr
    assert "importance weight s = pi_theta / pi_sampling to [lo, hi] (null: no clipping)." in r.stdout
    assert "[0, train.rollout_correction_cap]" in r.stdout
    assert "[chunk, V]" in r.stdout


# --------------------------------------------------------------- checks before any work
def test_missing_toy_model_names_the_expanded_path_and_the_command_to_run(emapg_home, tmp_path):
    run = tmp_path / "run"
    r = cli("train", "--preset", "toy", "--out", str(run))
    assert r.returncode == 2
    line = r.stderr.strip()
    assert line == f"error: model.path {emapg_home / 'toy' / 'model'}: no such model folder; run: emapg prepare --preset toy"
    assert not run.exists()


def test_dry_run_warns_about_missing_inputs_with_the_same_hint(emapg_home):
    r = cli("train", "--preset", "toy", "--dry-run", env={"COLUMNS": "400"})
    assert r.returncode == 0, r.stderr
    assert f"warning: model.path {emapg_home / 'toy' / 'model'}: no such model folder; run: emapg prepare --preset toy" in r.stdout
    assert f"warning: data.train: dataset file {emapg_home / 'toy' / 'train.jsonl'}: no such file; run: emapg prepare --preset toy" in r.stdout


def test_unknown_reward_fails_the_dry_run():
    r = cli("train", "--preset", "toy", "--set", "rollout.reward=nope", "--dry-run")
    assert r.returncode == 2
    from emapg_cli.rewards import REWARDS

    # the rewards registry's message (rewards.registry.check_reward, as `emapg eval --reward`), under the config key
    assert r.stderr.strip() == (f"error: rollout.reward: unknown reward 'nope' (known: {', '.join(sorted(REWARDS))}; "
                                "or module:function / path/to/file.py:function)")


@pytest.mark.skipif(find_spec("tensorboard") is not None, reason="tensorboard is installed here")
def test_missing_optional_package_fails_before_any_file_is_written(emapg_home, tmp_path):
    # the toy model is missing too: the package check comes first, and nothing is written
    run = tmp_path / "run"
    for extra in ((), ("--dry-run",)):
        r = cli("train", "--preset", "toy", "--set", "logging.tensorboard=true", "--out", str(run), *extra)
        assert r.returncode == 2
        assert r.stderr.strip() == ('error: logging.tensorboard needs the tensorboard package: '
                                    'pip install "emapg[tensorboard]" (or pip install tensorboard)')
        assert not run.exists()


def test_config_checks_look_up_each_optional_package(monkeypatch):
    from emapg_cli.config import load_config
    from emapg_cli.errors import UserError
    from emapg_cli.train import preflight as checks

    asked = []
    monkeypatch.setattr("importlib.util.find_spec", lambda name: asked.append(name) or None)
    cfg = load_config("toy", None, ["logging.wandb=true"])
    with pytest.raises(UserError, match=r'logging.wandb needs the wandb package: pip install "emapg\[wandb\]"'):
        checks.config_checks(cfg)
    assert asked == ["wandb"]  # tensorboard is off: not looked up
    checks.config_checks(load_config("toy"))  # nothing turned on: passes


# --------------------------------------------------------------- eval: the toy bench, default folders
def test_default_eval_folder_is_derived_from_the_run_and_the_bench():
    from emapg_cli.evaluation.naming import default_out

    # issue 40: the run's name already says the bench (`toy-1` of `--preset toy`): not `toy-toy-1`
    assert default_out("toy", "runs/toy-1/final/policy", None) == Path("runs/eval/toy-1")
    assert default_out("toy", "runs/toy-2/final/policy/", None) == Path("runs/eval/toy-2")  # no collision
    assert default_out("toy", "/h/toy/model", None) == Path("runs/eval/toy")  # the prepared model: its folder's name
    assert default_out("/h/smol/test.jsonl", "/h/smol/model", None) == Path("runs/eval/smol")
    assert default_out("toy", "runs/smol-1/final/policy", None) == Path("runs/eval/toy-smol-1")
    assert default_out("aime24", "runs/a/final/anchor", None) == Path("runs/eval/aime24-a-anchor")
    assert default_out("aime24", "runs/a/checkpoints/step_50/policy", None) == Path("runs/eval/aime24-a-step_50")
    assert default_out("data/olympiad.jsonl", "Qwen/Qwen2.5-3B", None) == Path("runs/eval/olympiad-Qwen2.5-3B")
    assert default_out("math500", None, Path("out/given.jsonl")) == Path("runs/eval/math500-given")


def test_eval_bench_toy_after_prepare(emapg_home, tiny_llama, tmp_path):
    """`--bench toy` reads $EMAPG_HOME/toy/test.jsonl; the default folder comes from the run's name;
    the figures are written next to the summary."""
    from emapg_cli.tasks.toy.task import make_splits

    (emapg_home / "toy").mkdir()
    _, test = make_splits(0, 10, 4)
    (emapg_home / "toy" / "test.jsonl").write_text("".join(json.dumps(e.model_dump()) + "\n" for e in test))
    model = tmp_path / "runs" / "toy-x" / "final" / "policy"
    model.parent.mkdir(parents=True)
    model.symlink_to(tiny_llama, target_is_directory=True)
    r = cli("eval", "--bench", "toy", "--model", "runs/toy-x/final/policy", "--backend", "hf", "--n", "2",
            "--max-tokens", "4", "--grader-workers", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "runs" / "eval" / "toy-x"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_items"] == 4 and summary["n"] == 2
    assert (out / "plots" / "pass_at_k.png").stat().st_size > 0


def test_eval_bench_toy_without_prepare_says_what_to_run(emapg_home):
    r = cli("eval", "--bench", "toy", "--model", "m", "--backend", "hf")
    assert r.returncode == 2
    assert r.stderr.strip() == f"error: dataset file {emapg_home / 'toy' / 'test.jsonl'}: no such file; run: emapg prepare --preset toy"


# --------------------------------------------------------------- ablate on GPU presets
def test_ablate_dry_run_prints_the_launch_line_and_a_folder_per_preset():
    r = cli("ablate", "--study", "paper", "--preset", "olympiad", "--processes", "8", "--dry-run")
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout.splitlines()[0])
    assert argv[:8] == ["accelerate", "launch", "--multi_gpu", "--num_processes", "8", "-m", "emapg_cli", "train"]
    assert argv[-2:] == ["--out", "ablations/paper-olympiad/runs/grpo/seed0"]
    toy = cli("ablate", "--study", "paper", "--dry-run")
    assert shlex.split(toy.stdout.splitlines()[0])[-1] == "ablations/paper-toy/runs/grpo/seed0"
    custom = cli("ablate", "--study", "paper", "--preset", "olympiad", "--processes", "4", "--dry-run",
                 "--launcher", "torchrun --nproc_per_node {processes} -m emapg_cli")
    assert custom.stdout.startswith("torchrun --nproc_per_node 4 -m emapg_cli train --preset olympiad ")
    bad = cli("ablate", "--study", "paper", "--processes", "2", "--launcher", "run {gpus}", "--dry-run")
    assert bad.returncode == 2 and "--launcher: cannot fill in the template" in bad.stderr


# --------------------------------------------------------------- progress helpers
def test_step_timer_smooths_the_eta():
    from emapg_cli.train.progress import StepTimer, clock

    t = StepTimer(alpha=0.1)
    assert t.eta(10) is None and clock(None) == "-:--"
    t.add(1.0)  # first step: mean 1.0
    t.add(11.0)  # an evaluation step: 0.1 * 11 + 0.9 * 1 = 2.0 (not 11)
    assert t.eta(100) == pytest.approx(200.0)
    t.add(1.0)  # 0.1 * 1 + 0.9 * 2 = 1.9
    assert t.eta(100) == pytest.approx(190.0)
    assert clock(190.4) == "3:10" and clock(3 * 3600 + 62) == "3:01:02"


def test_closing_table_is_rounded():
    from emapg_cli.train.progress import summary_rows

    rows = dict(summary_rows({"eval_accuracy_initial": 0.34400001168, "eval_accuracy_final": 0.5720000267028809,
                              "steps": 200, "wall_time_s": 1419.2231, "steps_skipped": 0, "reward_mean_last": 0.61234},
                             "runs/toy-1", ("runs/toy-1/plots", 8)))
    assert rows == {"run": "runs/toy-1", "eval accuracy": "34.4% -> 57.2% (+22.8 points)", "steps": "200",
                    "last train reward": "0.612", "wall time": "23:39", "plots": "runs/toy-1/plots (8 PNGs)"}


def test_config_line_names_the_run_shape(monkeypatch, tmp_path):
    from emapg_cli.config import load_config
    from emapg_cli.train.progress import config_line

    monkeypatch.setenv("EMAPG_HOME", str(tmp_path))
    line = config_line(load_config("toy"))  # the model path as the run will read it: $EMAPG_HOME expanded
    assert line == (f"toy: {tmp_path}/toy/model (float32), 200 steps x 32 prompts x 8 samples, lr 0.0003, "
                    f"KL β 0.01 topk reverse k 8, EMA anchor η 0.9 every 5, reward math, engine hf, evaluated on {tmp_path}/toy/test.jsonl")
    distill = config_line(load_config("toy-distill"))  # a teacher is named as such, with its dtype and the objective
    assert f"teacher anchor {tmp_path}/toy-distill/teacher (float32), objective distill, reward" in distill


# --------------------------------------------------------------- plots
def _metrics(run: Path, steps: int, with_entropy: bool) -> None:
    run.mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": 0.3}]
    for s in range(1, steps + 1):
        row = {"step": s, "reward/mean": s / steps, "kl/value": 0.01, "ema/distance": 0.02, "clip/frac": 0.0,
               "throughput/tokens_per_s": 100.0}
        if with_entropy:
            row["entropy"] = 1.0 / s
        if s % 10 == 0:
            row["eval/accuracy"] = 0.3 + s / 100
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_plot_overlays_runs_and_skips_absent_metrics(tmp_path):
    _metrics(tmp_path / "a", 30, with_entropy=True)
    _metrics(tmp_path / "b", 20, with_entropy=False)
    r = cli("plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "figs"))
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert names == sorted(["eval_accuracy.png", "reward.png", "kl.png", "ema_distance.png", "entropy.png",
                            "clip_fraction.png", "throughput.png", "training.png"])
    (tmp_path / "work").mkdir()
    one = cli("plot", str(tmp_path / "b"), cwd=tmp_path / "work")  # one run: into ./plots, the metric it lacks skipped
    assert one.returncode == 0, one.stderr
    assert not (tmp_path / "work" / "plots" / "entropy.png").exists()
    assert (tmp_path / "work" / "plots" / "training.png").stat().st_size > 0
    assert not (tmp_path / "b" / "plots").exists()  # issue 32: the run's own plots/ (train's) is left alone


def test_plot_refuses_what_it_cannot_draw(tmp_path):
    _metrics(tmp_path / "run", 3, with_entropy=True)
    ev = tmp_path / "ev"
    ev.mkdir()
    (ev / "summary.json").write_text(json.dumps({"pass@1": 0.5, "n": 1}))
    (ev / "results.jsonl").write_text("")
    mixed = cli("plot", str(tmp_path / "run"), str(ev))
    assert mixed.returncode == 2 and "plot training runs and evaluations separately" in mixed.stderr
    missing = cli("plot", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr.strip() == f"error: {tmp_path / 'nope'}: no such folder"


def test_eval_plots_draw_pass_at_k_and_groups(tmp_path):
    from emapg_cli.plots.eval import pass_at_k, plot_evals

    s = {"n": 4, "pass@1": 0.25, "pass@2": 0.4, "pass@4": 0.55, "maj@n": 0.3,
         "subsets": {"algebra": {"num_items": 3, "avg@n": 0.5}, "geometry": {"num_items": 2, "avg@n": 0.1}},
         "sources": {}}
    assert pass_at_k(s) == [(1, 0.25), (2, 0.4), (4, 0.55)]
    paths = plot_evals([("m", s)], tmp_path)
    assert [p.name for p in paths] == ["pass_at_k.png", "accuracy_by_subset.png"]  # no sources: no source plot


def test_readme_quick_start_is_what_the_newcomer_check_runs():
    from acceptance import newcomer_check as script

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):readme.index("## Install")]
    first = next(line for line in quick.splitlines() if line.startswith("python3 -m venv"))
    # one line: venv, the CPU torch wheel, emapg, then the main job
    assert first == (f"python3 -m venv .venv && . .venv/bin/activate && {script.README_TORCH} && "
                     f"{script.README_INSTALL} && {script.README_RUN}")
    assert '. .venv/bin/activate && pip install ".[dev]" && pytest -q' in quick
