"""`emapg ablate`: grid parsing and typing, the sweep plan, the statistics, aggregation and the CLI."""

from __future__ import annotations

import csv
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from emapg_cli.ablate.aggregate import aggregate, save_plan
from emapg_cli.ablate.grid import VOCAB, Axis, Variant, combinations, parse_grid, plan_runs
from emapg_cli.ablate.plots import mean_band, plot_all
from emapg_cli.ablate.runner import run_dir, run_sweep, status_path
from emapg_cli.stats import mean_ci, t_quantile
from emapg_cli.ablate.study import build_sweep, list_studies, save_sweep
from emapg_cli.config import load_config
from emapg_cli.errors import UserError


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "emapg_cli", *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def fake_model_dir(tmp_path: Path, vocab: int = 259) -> Path:
    """A model folder holding only config.json: all `|V|` needs."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": vocab}))
    return path


# --- grid parsing -----------------------------------------------------------------------------


def test_parse_grid_types_values_like_set():
    axis = parse_grid("kl.k=1,8,|V|")
    assert axis == Axis("kl.k", (1, 8, VOCAB))
    assert parse_grid("ema.decay=0.9, 1.0").values == (0.9, 1.0)
    assert parse_grid("kl.estimator=k3,topk").values == ("k3", "topk")
    # commas inside brackets belong to one value: two iw_clip intervals
    assert parse_grid("kl.iw_clip=[0.5,2],[0.8,1.25]").values == ([0.5, 2], [0.8, 1.25])


@pytest.mark.parametrize("bad", ["kl.k", "kl.k=", "kl.k=1,,2", "kl.k=8,8", "=1,2", "train.seed=0,1"])
def test_parse_grid_rejects(bad):
    with pytest.raises(UserError):
        parse_grid(bad)


def test_cartesian_product_and_variants():
    axes = [Axis("kl.k", (1, 8)), Axis("ema.decay", (0.9, 1.0, 0.95))]
    combos = combinations([], axes)
    assert len(combos) == 2 * 3
    assert combos[0] == (None, {"kl.k": 1, "ema.decay": 0.9})
    assert combos[-1] == (None, {"kl.k": 8, "ema.decay": 0.95})
    # variants x grid; a grid value wins over the variant's value for the same key
    variants = [Variant("a", {"kl.k": 4, "kl.coef": 0.1}), Variant("b", {})]
    combos = combinations(variants, [Axis("kl.k", (1, 2))])
    assert combos == [("a", {"kl.k": 1, "kl.coef": 0.1}), ("a", {"kl.k": 2, "kl.coef": 0.1}), ("b", {"kl.k": 1}), ("b", {"kl.k": 2})]


def test_plan_runs_is_seed_major_and_typed_by_the_config():
    runs = plan_runs("toy", None, ["kl.coef=0.05"], [], [parse_grid("kl.k=1,8"), parse_grid("ema.decay=0.9,1")], [0, 1])
    assert len(runs) == 2 * 2 * 2
    assert [r.seed for r in runs] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert runs[1].values == {"kl.k": 1, "ema.decay": 1.0}  # `1` typed as the float field it is
    assert runs[1].config_id == "kl.k=1_ema.decay=1.0"
    assert runs[5].run_id == "kl.k=1_ema.decay=1.0/seed1"
    cfg = load_config("toy", None, runs[5].overrides)
    assert (cfg.kl.k, cfg.ema.decay, cfg.kl.coef, cfg.train.seed) == (1, 1.0, 0.05, 1)


def test_plan_runs_validates_every_combination_first():
    with pytest.raises(UserError, match="kl.kk"):
        plan_runs("toy", None, [], [], [parse_grid("kl.kk=1,2")], [0])
    # k5 is forward-only: only the second combination is invalid, and it names it
    with pytest.raises(UserError, match="configuration kl.estimator=k5.*forward"):
        plan_runs("toy", None, [], [], [parse_grid("kl.estimator=k3,k5")], [0])
    with pytest.raises(UserError, match="use --seeds"):
        plan_runs("toy", None, ["train.seed=3"], [], [], [0])


def test_vocab_marker_resolves_from_config_json(tmp_path):
    model = fake_model_dir(tmp_path, vocab=259)
    runs = plan_runs("toy", None, [f"model.path={model}"], [], [parse_grid("kl.k=8,|V|")], [0])
    assert [r.values["kl.k"] for r in runs] == [8, 259]
    with pytest.raises(UserError, match=r"\|V\|"):
        plan_runs("toy", None, [f"model.path={tmp_path / 'missing'}"], [], [parse_grid("kl.k=|V|")], [0])


def test_named_studies_plan(tmp_path):
    assert {"paper", "topk-k", "ema-decay", "estimators"} <= set(list_studies())
    model = str(fake_model_dir(tmp_path))
    sizes = {"paper": 4, "topk-k": 5, "ema-decay": 4, "estimators": 6}
    for name, n_configs in sizes.items():
        sweep = build_sweep(name, None, None, [], None, [f"model.path={model}"])
        assert len(sweep.runs()) == n_configs * sweep.seeds, name
    # paper: GRPO = fixed anchor (eta = 1) + k3, EMA-PG = the preset's EMA anchor (eta < 1) + topk
    sweep = build_sweep("paper", None, None, [], 1, [])
    cfgs = {r.values["variant"]: load_config(sweep.preset, None, r.overrides) for r in sweep.runs()}
    assert list(cfgs) == ["grpo", "ema-anchor", "topk", "ema-pg"]
    assert (cfgs["grpo"].kl.estimator, cfgs["grpo"].ema.decay) == ("k3", 1.0)
    assert cfgs["ema-anchor"].kl.estimator == "k3" and cfgs["ema-anchor"].ema.decay < 1.0
    assert (cfgs["topk"].kl.estimator, cfgs["topk"].ema.decay) == ("topk", 1.0)
    assert cfgs["ema-pg"].kl.estimator == "topk" and cfgs["ema-pg"].ema.decay < 1.0


# --- statistics --------------------------------------------------------------------------------


def test_t_quantile_matches_tables():
    # two-sided 95% critical values of Student's t (any printed table)
    for df, expected in [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (29, 2.0452)]:
        assert t_quantile(0.95, df) == pytest.approx(expected, abs=1e-4)
    assert t_quantile(0.99, 4) == pytest.approx(4.6041, abs=1e-4)


def test_mean_ci_hand_computed():
    iv = mean_ci([0.5, 0.6, 0.7])
    # mean 0.6; s^2 = (0.01 + 0 + 0.01) / 2 = 0.01 -> s = 0.1; se = 0.1 / sqrt(3) = 0.057735
    # half width = t*(0.95, 2) * se = 4.302653 * 0.057735 = 0.248414
    assert (iv.n, iv.mean, iv.std) == (3, pytest.approx(0.6), pytest.approx(0.1))
    assert (iv.lo, iv.hi) == (pytest.approx(0.351586, abs=1e-6), pytest.approx(0.848414, abs=1e-6))
    one = mean_ci([0.4, None, float("nan")])  # missing values dropped: one value, no spread
    assert one.n == 1 and one.mean == 0.4 and math.isnan(one.std) and math.isnan(one.lo)
    assert mean_ci([]).n == 0


def test_mean_band_aligns_by_step():
    steps, mean, std = mean_band([[(0, 0.2), (5, 0.4)], [(0, 0.4), (5, 0.8), (10, 1.0)]])
    assert steps == [0, 5, 10]
    assert mean == pytest.approx([0.3, 0.6, 1.0])
    # std of {0.2, 0.4} = sqrt(2 * 0.1^2 / 1) = 0.141421; one run at step 10 -> 0
    assert std == pytest.approx([0.141421, 0.282843, 0.0], abs=1e-6)


# --- aggregation on run folders written here -----------------------------------------------------


def _write_run(out, spec, init, evals, final, kls, emas, steps=10):
    rdir = run_dir(out, spec)
    rdir.mkdir(parents=True)
    rows = [{"step": s, "reward/mean": 0.1 * s, "kl/value": kl, "ema/distance": ed} for s, kl, ed in zip(range(1, steps + 1), kls, emas)]
    for s, acc in evals.items():
        rows[s - 1]["eval/accuracy"] = acc
    (rdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (rdir / "summary.json").write_text(json.dumps(
        {"eval_accuracy_initial": init, "eval_accuracy_final": final, "steps": steps, "wall_time_s": 12.5}))


def test_aggregate_writes_results_summary_and_plots(tmp_path):
    out = tmp_path / "sweep"
    sweep = build_sweep(None, "toy", None, [parse_grid("kl.k=1,8")], 2, [])
    runs = sweep.runs()  # k1/seed0, k8/seed0, k1/seed1, k8/seed1
    save_sweep(sweep, out)
    save_plan(out, runs)
    k1s0, k8s0, k1s1, k8s1 = runs
    kls, emas = [0.01] * 5 + [0.03] * 5, [0.0] * 9 + [0.5]  # mean KL = 0.02, final EMA distance 0.5
    _write_run(out, k1s0, 0.30, {5: 0.70}, 0.50, kls, emas)  # best = max(0.3, 0.7, 0.5) = 0.7
    _write_run(out, k1s1, 0.30, {5: 0.40}, 0.70, kls, emas)
    _write_run(out, k8s0, 0.30, {5: 0.45}, 0.40, kls, emas)
    status = status_path(out, k8s1)
    status.write_text(json.dumps({"status": "failed", "returncode": 1, "error": "Traceback ...\nRuntimeError: boom"}))

    sweep2, records, summaries = aggregate(out)
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [r["run_id"] for r in rows] == [r.run_id for r in runs]
    first = rows[0]
    assert (first["kl.k"], first["seed"], first["status"]) == ("1", "0", "done")
    assert float(first["eval_accuracy_best"]) == pytest.approx(0.7)
    assert float(first["kl_mean"]) == pytest.approx(0.02)
    assert float(first["ema_distance_final"]) == pytest.approx(0.5)
    assert (float(first["steps"]), float(first["wall_time_s"])) == (10, 12.5)
    assert (rows[3]["status"], rows[3]["error"]) == ("failed", "RuntimeError: boom")

    # k=1: final {0.5, 0.7} -> mean 0.6, s = sqrt(2 * 0.1^2) = 0.141421, half = 12.7062 * 0.141421 / sqrt(2) = 1.27062
    # k=8: final {0.4} (one seed) -> ranked below k=1 by the mean
    assert [s.label for s in summaries] == ["kl.k=1", "kl.k=8"]
    acc = summaries[0].stats["eval_accuracy_final"]
    assert (acc.mean, acc.std, acc.half_width) == (pytest.approx(0.6), pytest.approx(0.141421, abs=1e-6), pytest.approx(1.27062, abs=1e-4))
    assert (summaries[1].runs, summaries[1].failed) == (1, 1)
    md = (out / "summary.md").read_text()
    assert "| 1 | kl.k=1 | 2 | 60.0 ± 14.1 | [-67.1, 187.1] |" in md  # in % (issue 32), as every accuracy emapg prints
    assert "| 2 | kl.k=8 | 1 (+1 failed) | 40.0 | – |" in md
    assert "`kl.k=8/seed1`: failed — RuntimeError: boom" in md
    # the eval curve gains the initial evaluation at step 0 and the final one at the last step (10)
    k1 = records[0].curves["eval/accuracy"]
    assert k1 == [(0, 0.30), (5, 0.70), (10, 0.50)]

    paths = plot_all(out, summaries, records, "test")
    assert [p.name for p in paths] == ["accuracy.png", "final_accuracy.png", "kl_ema.png"]
    assert all(p.stat().st_size > 5000 for p in paths)


def test_finished_runs_are_skipped(tmp_path):
    out = tmp_path / "sweep"
    sweep = build_sweep(None, "toy", None, [parse_grid("kl.k=1,8")], 1, [])
    runs = sweep.runs()
    for spec in runs:
        _write_run(out, spec, 0.3, {}, 0.4, [0.0] * 10, [0.0] * 10)
    results = run_sweep(sweep, runs, out, jobs=2, show_progress=False)  # starts no process
    assert [r.status for r in results] == ["skipped", "skipped"]


# --- the command -------------------------------------------------------------------------------


def test_dry_run_prints_one_train_command_per_run(tmp_path):
    r = cli("ablate", "--preset", "toy", "--grid", "kl.k=1,8", "--grid", "ema.decay=0.9,1.0", "--seeds", "2",
            "--set", "kl.coef=0.05", "--out", str(tmp_path / "sw"), "--dry-run")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 * 2 * 2
    argv = shlex.split(lines[-1])
    assert argv[:4] == ["emapg", "train", "--preset", "toy"]
    assert argv[-2:] == ["--out", str(tmp_path / "sw" / "runs" / "kl.k=8_ema.decay=1.0" / "seed1")]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert sets == ["kl.coef=0.05", "kl.k=8", "ema.decay=1.0", "train.seed=1"]
    assert not (tmp_path / "sw").exists()  # a dry run writes nothing


def test_bad_grid_key_exits_2_before_running(tmp_path):
    r = cli("ablate", "--preset", "toy", "--grid", "kl.kk=1,8", "--out", str(tmp_path / "sw"))
    assert r.returncode == 2
    assert "error: configuration kl.kk=1: unknown config key 'kl.kk'" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "sw").exists()


def test_failed_run_is_recorded_and_the_sweep_goes_on(tmp_path):
    """Both runs fail fast (the model folder does not exist); each gets its status and error, the
    summary lists them, and the command exits 1."""
    out = tmp_path / "sw"
    r = cli("ablate", "--preset", "toy", "--grid", "kl.k=1,8", "--set", f"model.path={tmp_path / 'no-model'}",
            "--jobs", "2", "--out", str(out))
    assert r.returncode == 1, r.stderr
    for cid in ("kl.k=1", "kl.k=8"):
        status = json.loads((out / "runs" / cid / "seed0.status.json").read_text())
        assert status["status"] == "failed" and status["returncode"] != 0 and status["error"]
    assert "failed" in (out / "summary.md").read_text()


# --- end to end: a real 2 x 2 sweep of `emapg train` --------------------------------------------


@pytest.mark.slow  # a real 2 x 2 sweep of train, ~35 s; the fast tests cover the runner and aggregation (CI budget)
def test_small_sweep_end_to_end(tmp_path, tiny_qwen2):
    """2 x 2 grid (estimator x anchor decay), 1 seed, 2 RL steps of a tiny random model, 2 runs at
    once: every run finishes with its own directory, the aggregate has one row per run, and running
    the same command again skips all of them."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i % 7}+{i % 5}", "answers": [str(i % 7 + i % 5)]}) + "\n"
                            for i in range(8)))
    tiny = {
        "model.path": tiny_qwen2, "data.train": data, "data.eval": data, "data.eval_limit": 4,
        "rollout.prompts_per_step": 2, "rollout.n": 2, "rollout.max_new_tokens": 4, "eval.max_new_tokens": 4,
        "train.steps": 2, "train.mini_batch_prompts": 2, "train.micro_batch_size": 4, "kl.k": 4, "ema.update_period": 1,
    }
    out = tmp_path / "sweep"
    args = ["ablate", "--preset", "toy", "--grid", "kl.estimator=k3,topk", "--grid", "ema.decay=0.5,1.0",
            "--jobs", "2", "--out", str(out)]
    for k, v in tiny.items():
        args += ["--set", f"{k}={v}"]
    r = cli(*args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "4 done, 0 finished before, 0 failed" in r.stdout

    rows = list(csv.DictReader(open(out / "results.csv")))
    assert [(row["kl.estimator"], row["ema.decay"], row["status"]) for row in rows] == [
        ("k3", "0.5", "done"), ("k3", "1.0", "done"), ("topk", "0.5", "done"), ("topk", "1.0", "done")]
    for row in rows:
        assert float(row["steps"]) == 2 and float(row["wall_time_s"]) > 0
        assert 0.0 <= float(row["eval_accuracy_final"]) <= 1.0
        assert row["kl_mean"] != ""
    for name in ("summary.md", "accuracy.png", "final_accuracy.png", "kl_ema.png"):
        assert (out / name).is_file(), name
    cfg = load_config(None, str(out / "runs" / "kl.estimator=topk_ema.decay=0.5" / "seed0" / "config.yaml"))
    assert (cfg.kl.estimator, cfg.ema.decay, cfg.train.seed, cfg.train.steps) == ("topk", 0.5, 0, 2)

    again = cli(*args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "0 done, 4 finished before, 0 failed" in again.stdout
