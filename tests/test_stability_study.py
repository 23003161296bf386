"""The stability study of `emapg ablate` (issue 21): relative grid values (`x2`), the `analysis:` section, run
classification (collapse, divergence, steps to target), the statistics (paired differences, bootstrap tuning
sensitivity, power), stability.md/.json and the heatmaps, and the command end to end on a tiny model."""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from emapg_cli.ablate.aggregate import aggregate, save_plan
from emapg_cli.ablate.grid import Axis, Variant, parse_grid, plan_runs
from emapg_cli.ablate.plots import plot_stability
from emapg_cli.ablate.runner import run_dir, status_path
from emapg_cli.ablate.stability import analyze, classify, divergence, steps_to_target, write
from emapg_cli.ablate.study import StudyAnalysis, build_sweep, read_sweep, save_sweep
from emapg_cli.config import load_config
from emapg_cli.errors import UserError
from emapg_cli.stats import bootstrap_within_best, median, paired_differences, percentile, seeds_for_power, within_best_fraction
from train_helpers import tiny_sweep_sets


def cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "emapg_cli", *args], capture_output=True, text=True, timeout=timeout)


# --- relative grid values ----------------------------------------------------------------------


def test_relative_values_are_multiples_of_the_value_without_the_axis():
    # toy: optim.lr = 3.0e-4. x2 -> 6e-4: the same id and --set as an absolute 6.0e-4
    rel = plan_runs("toy", None, [], [Variant("fixed", {"ema.decay": 1.0})], [parse_grid("optim.lr=x1,x2,x3,x0.5")], [0])
    absolute = plan_runs("toy", None, [], [Variant("fixed", {"ema.decay": 1.0})], [Axis("optim.lr", (6.0e-4,))], [0])
    assert [r.config_id for r in rel] == ["fixed_optim.lr=0.0003", "fixed_optim.lr=0.0006", "fixed_optim.lr=0.0009", "fixed_optim.lr=0.00015"]
    assert rel[1].config_id == absolute[0].config_id and rel[1].overrides == absolute[0].overrides
    assert rel[1].values == {"variant": "fixed", "optim.lr": 0.0006} and rel[1].grid == {"optim.lr": "x2"}
    # relative to the variant's own value (preset < set < variant): 1e-3 x 2 = 2e-3; and to --set: 1e-4 x 2
    own = plan_runs("toy", None, ["optim.lr=1e-4"], [Variant("v", {"optim.lr": 1e-3}), Variant("w", {})], [parse_grid("optim.lr=x2")], [0])
    assert [r.values["optim.lr"] for r in own] == [0.002, 0.0002]
    # an int key stays an int: kl.k = 8 -> x2 = 16, x0.5 = 4
    assert [r.overrides[0] for r in plan_runs("toy", None, [], [], [parse_grid("kl.k=x2,x0.5")], [0])] == ["kl.k=16", "kl.k=4"]
    # the study's own preset: toy-search's lr is 5.0e-4, so x2 = 1e-3
    assert [r.values["optim.lr"] for r in plan_runs("toy-search", None, [], [], [parse_grid("optim.lr=x1,x2")], [0])] == [0.0005, 0.001]
    # a string that merely starts with x is no multiple
    assert parse_grid("model.path=xdir").values == ("xdir",)


@pytest.mark.parametrize("grid, message", [
    ("optim.lr=x", "x<number>"), ("optim.lr=x0", "positive"), ("optim.lr=x-2", "positive"), ("optim.lr=x1e999", "positive"),
    ("kl.estimator=x2", "not a number"), ("kl.kk=x2", "unknown config key 'kl.kk'"),
])
def test_relative_values_rejected(grid, message):
    with pytest.raises(UserError, match=message) as err:
        plan_runs("toy", None, [], [], [parse_grid(grid)], [0])
    assert "\n" not in str(err.value)


# --- the analysis section ----------------------------------------------------------------------


def _study(tmp_path: Path, **changes) -> str:
    data = {"preset": "toy", "seeds": 2, "variants": {"fixed": {"ema.decay": 1.0}, "ema": {}},
            "grid": {"optim.lr": ["x1", "x2"]}, "analysis": {"baseline": "fixed"}}
    data.update(changes)
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_analysis_section_is_checked(tmp_path):
    sweep = build_sweep(_study(tmp_path), None, None, [], None, [])
    assert sweep.analysis == StudyAnalysis(baseline="fixed", collapse_points=10, target_gain=0.15, within_points=5)
    with pytest.raises(UserError, match="analysis.baseline 'grpo' is not one of its variants"):
        build_sweep(_study(tmp_path, analysis={"baseline": "grpo"}), None, None, [], None, [])
    with pytest.raises(UserError, match="analysis.collapse_pts"):
        build_sweep(_study(tmp_path, analysis={"baseline": "fixed", "collapse_pts": 5}), None, None, [], None, [])
    with pytest.raises(UserError, match="one grid axis, but the sweep has 2"):
        build_sweep(_study(tmp_path), None, None, [parse_grid("kl.k=4,8")], None, [])
    # it is recorded in the sweep folder's study.yaml, where aggregation reads it
    save_sweep(sweep, tmp_path / "out")
    assert yaml.safe_load((tmp_path / "out" / "study.yaml").read_text())["analysis"]["baseline"] == "fixed"
    assert read_sweep(tmp_path / "out").analysis == sweep.analysis
    # ... and checked again when read back: an edited record is a one-line refusal, not a KeyError in the analysis
    for edit in ({"analysis": {"baseline": "nope"}}, {"grid": {"optim.lr": ["x1"], "kl.k": [4, 8]}}):
        record = {**yaml.safe_load((tmp_path / "out" / "study.yaml").read_text()), **edit}
        (tmp_path / "edited").mkdir(exist_ok=True)
        (tmp_path / "edited" / "study.yaml").write_text(yaml.safe_dump(record))
        with pytest.raises(UserError, match="not a valid sweep record"):
            read_sweep(tmp_path / "edited")


# --- classification of one run -----------------------------------------------------------------

A = StudyAnalysis(baseline="fixed")  # X = 10 points, target +0.15, within 5 points


def test_collapse_and_steps_to_target_by_hand():
    evals = [(0, 0.40), (10, 0.50), (20, 0.58), (30, 0.70), (40, 0.62)]
    # best 0.70; final 0.62 is 8 points below: no collapse. Target 0.40 + 0.15 = 0.55: first reached at step 20
    assert classify(evals, 0.40, 0.62, False, A) == (0.62, 0.70, False, 20)
    # final 0.59 is 11 points below 0.70: collapsed; exactly 10 points below (0.60) is not "more than"
    assert classify(evals, 0.40, 0.59, False, A)[2] is True
    assert classify(evals, 0.40, 0.60, False, A)[2] is False
    # diverged: final 0.0, collapsed, best over what it evaluated before breaking down
    assert classify(evals[:2], 0.40, None, True, A) == (0.0, 0.50, True, None)
    # the target is judged on evaluated steps only, never step 0; unknown initial accuracy: no target
    assert steps_to_target([(0, 0.9), (10, 0.55)], 0.40, 0.15) == 10
    assert steps_to_target([(10, 0.9)], None, 0.15) is None


def test_divergence_matches_the_trainers_two_breakdowns_only():
    from emapg_cli.train.bookkeeping import check_skips

    cfg = load_config(overrides=["rollout.prompts_per_step=2", "train.mini_batch_prompts=2", "train.steps=2", "train.skip_window=20"])
    t = SimpleNamespace(state={})
    check_skips(t.state, cfg, 1, 1)
    with pytest.raises(UserError) as err:  # the real message of too many skipped optimizer steps
        check_skips(t.state, cfg, 2, 1)
    skipped = str(err.value)
    weights = ("step 1: the optimizer step made the policy's weights non-finite (finite loss, grad norm 0.3); stopped before the "
               "EMA anchor or a checkpoint could take them (the newest checkpoint is unchanged): lower optim.lr or optim.weight_decay, then --resume")
    assert divergence("failed", 2, skipped) == skipped
    assert divergence("failed", 2, weights) == weights
    assert divergence("failed", None, weights) == weights  # a run launched elsewhere: no exit code recorded
    # no reason in status.json: the last `error:` line of the output
    assert divergence("failed", 2, "", "loading...\nerror: " + weights + "\n") == weights
    # other failures stay failures: another exit code, another reason, a run that finished
    assert divergence("failed", 1, weights) is None
    assert divergence("failed", 2, "model.path /x: no such folder") is None
    assert divergence("failed", 1, "", "Traceback ...\nRuntimeError: probability tensor contains either inf, nan") is None
    assert divergence("done", 0, weights) is None


# --- statistics, by hand -------------------------------------------------------------------------


def test_paired_median_percentile():
    assert paired_differences({0: 0.8, 1: 0.6, 2: 0.7}, {1: 0.5, 0: 0.9, 3: 0.1}) == {0: pytest.approx(-0.1), 1: pytest.approx(0.1)}
    assert (median([3, 1, 2]), median([4, 1, 3, 2]), math.isnan(median([]))) == (2, 2.5, True)
    # position q (n - 1): 0.25 x 4 = 1 -> 2nd value; 0.9 x 4 = 3.6 -> 40 + 0.6 x (50 - 40) = 46
    assert percentile([50, 10, 20, 40, 30], 0.25) == 20 and percentile([50, 10, 20, 40, 30], 0.9) == pytest.approx(46)


def test_within_best_fraction_by_hand():
    means = {"a": {"x1": 0.80, "x2": 0.50, "x4": math.nan}, "b": {"x1": 0.76, "x2": 0.60, "x4": 0.1}}
    # x1: best 0.80, a in, b 0.76 >= 0.75 in; x2: best 0.60, a 0.50 < 0.55 out; x4: only b (a has no mean): b in
    assert within_best_fraction(means, 0.05) == {"a": pytest.approx(1 / 3), "b": 1.0}
    # floor 0.3 (the runs' start): at x4 the best (0.1) is not above it: nobody works there, it counts against both
    assert within_best_fraction(means, 0.05, floor=0.3) == {"a": pytest.approx(1 / 3), "b": pytest.approx(2 / 3)}
    # everything collapsed in both columns: no credit for anyone (without the floor both would get 1.0)
    dead = {"a": {"x1": 0.0, "x2": 0.01}, "b": {"x1": 0.02, "x2": 0.0}}
    assert within_best_fraction(dead, 0.05) == {"a": 1.0, "b": 1.0}
    assert within_best_fraction(dead, 0.05, floor=0.3) == {"a": 0.0, "b": 0.0}


def test_bootstrap_sensitivity_by_hand():
    """Two seeds, one column. a: 0.80 / 0.60, b: 0.70 / 0.72 (within 0.05). On the data: means 0.70 and 0.71, both
    within. A resample draws {0,0}, {0,1}, {1,0} or {1,1} (1/4 each): {0,0} -> a 0.80, b 0.70 < 0.75: b out;
    {1,1} -> a 0.60 < 0.67: a out; mixed -> both in. So each method's replicates are 0 (1/4) or 1 (3/4): the
    2.5% and 97.5% percentiles are 0 and 1."""
    cells = {"a": {"x1": {0: 0.80, 1: 0.60}}, "b": {"x1": {0: 0.70, 1: 0.72}}}
    got = bootstrap_within_best(cells, 0.05, resamples=2000, seed=0)
    assert got == {"a": (1.0, 0.0, 1.0), "b": (1.0, 0.0, 1.0)}
    assert bootstrap_within_best(cells, 0.05, resamples=2000, seed=0) == got  # deterministic
    # one seed: every resample is the data itself, the interval is the point
    assert bootstrap_within_best({"a": {"x1": {0: 0.8}}, "b": {"x1": {0: 0.6}}}, 0.05, 200) == {"a": (1.0, 1.0, 1.0), "b": (0.0, 0.0, 0.0)}


def test_seeds_for_power_by_hand():
    # z_0.975 = 1.959964, z_0.80 = 0.841621: (2.801585)^2 = 7.848879; + 1.959964^2 / 2 = 1.920729
    assert seeds_for_power(0.5) == 34  # 7.848879 / 0.25 + 1.920729 = 33.316 -> 34
    assert seeds_for_power(1.0) == 10  # 9.770 -> 10
    assert seeds_for_power(-0.2) == 199  # 196.222 + 1.921 = 198.143 -> 199
    assert seeds_for_power(3.0) == 3  # 0.872 + 1.921 = 2.793 -> 3
    assert seeds_for_power(0.0) is None and seeds_for_power(math.nan) is None


# --- the analysis of a sweep folder written by hand ----------------------------------------------


def _run(out, spec, evals: dict[int, float], final=None, kl=0.02, dist=0.1, steps=30):
    rdir = run_dir(out, spec)
    rdir.mkdir(parents=True)
    rows = [{"step": s, "kl/value": kl, "ema/distance": dist, **({"eval/accuracy": evals[s]} if s in evals else {})} for s in range(0, steps + 1)]
    (rdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= max(evals)))
    if final is not None:
        (rdir / "summary.json").write_text(json.dumps({"eval_accuracy_initial": evals[0], "eval_accuracy_final": final, "steps": steps}))


def _fail(out, spec, returncode: int, reason: str):
    (run_dir(out, spec) / "status.json").write_text(json.dumps({"status": "failed", "reason": reason, "step": 10}))
    status_path(out, spec).write_text(json.dumps({"status": "failed", "returncode": returncode, "error": f"error: {reason}"}))


def test_stability_report_by_hand(tmp_path):
    out = tmp_path / "sweep"
    sweep = build_sweep(_study(tmp_path), None, None, [], 3, [])
    runs = {(r.values["variant"], r.grid["optim.lr"], r.seed): r for r in sweep.runs()}
    save_sweep(sweep, out)
    save_plan(out, list(runs.values()))
    # fixed x1: finals 0.70 / 0.60 / 0.65, bests 0.72 / 0.75 / 0.65: seed 1 collapses (0.75 - 0.60 = 15 points > 10)
    _run(out, runs["fixed", "x1", 0], {0: 0.4, 10: 0.72}, 0.70)
    _run(out, runs["fixed", "x1", 1], {0: 0.4, 10: 0.75}, 0.60)
    _run(out, runs["fixed", "x1", 2], {0: 0.4, 10: 0.50}, 0.65)
    # ema x1: 0.75 / 0.70 / 0.75 -> differences +0.05 / +0.10 / +0.10
    for seed, final in enumerate((0.75, 0.70, 0.75)):
        _run(out, runs["ema", "x1", seed], {0: 0.4, 10: 0.6}, final)
    # fixed x2: seed 0 and 1 diverged (final 0.0), seed 2 crashed (left out) -> collapse 2/2
    for seed in (0, 1):
        _run(out, runs["fixed", "x2", seed], {0: 0.4, 10: 0.3})
        _fail(out, runs["fixed", "x2", seed], 2, f"step 1{seed}: 4 of the last 4 optimizer steps (2 RL steps) were skipped for a "
                                                   "non-finite loss or gradient, more than train.max_skipped_fraction=0.5: stopping")
    _run(out, runs["fixed", "x2", 2], {0: 0.4})
    _fail(out, runs["fixed", "x2", 2], 1, "RuntimeError: boom")
    # ema x2: 0.60 / 0.20 (best 0.6: collapsed) / 0.62
    for seed, final in enumerate((0.60, 0.20, 0.62)):
        _run(out, runs["ema", "x2", seed], {0: 0.4, 10: 0.6}, final)

    _, records, _ = aggregate(out)
    report = analyze(sweep, records)
    cell = report.cell("fixed", "x1")
    assert cell["runs"] == 3 and cell["final"]["mean"] == pytest.approx(0.65) and cell["best"]["mean"] == pytest.approx((0.72 + 0.75 + 0.65) / 3)
    assert (cell["collapsed"], cell["collapse_rate"]) == (1, pytest.approx(1 / 3))
    # target 0.55: seed 0 at step 10 (0.72), seed 1 at step 10, seed 2 at the final evaluation (step 30, 0.65)
    assert (cell["steps_to_target_median"], cell["reached_target"]) == (10, 3)
    assert cell["kl_mean"] == pytest.approx(0.02) and cell["ema_distance_final"] == pytest.approx(0.1)
    div = report.cell("fixed", "x2")
    assert (div["runs"], div["diverged"], div["failed"], div["collapsed"], div["final"]["mean"]) == (2, 2, 1, 2, 0.0)
    # paired differences at x1: mean 0.25/3 = 0.083333, sd = sqrt(((-1/3)^2 + (1/6)^2 * 2) / 2) * 0.1 = 0.028868
    # half width t*(0.95, 2) 4.302653 x 0.028868 / sqrt(3) = 0.071711 -> [0.011622, 0.155044]: excludes 0
    d = report.difference("ema", "x1")
    assert (d["n"], d["mean"], d["sd"]) == (3, pytest.approx(0.083333, abs=1e-6), pytest.approx(0.028868, abs=1e-6))
    assert (d["lo"], d["hi"], d["excludes_zero"]) == (pytest.approx(0.011622, abs=1e-5), pytest.approx(0.155044, abs=1e-5), True)
    assert d["d_z"] == pytest.approx(2.886751, abs=1e-5) and d["seeds_for_power"] == 3  # 7.8489 / 8.3333 + 1.9207 = 2.86
    # x2: only seeds 0 and 1 are paired (seed 2 of fixed crashed): 0.60 - 0 and 0.20 - 0
    d2 = report.difference("ema", "x2")
    assert (d2["n"], d2["seeds"], d2["mean"]) == (2, [0, 1], pytest.approx(0.4))
    # sensitivity: x1 best 0.7167 (ema), fixed 0.65 is 6.7 points below: out; x2 best ema 0.4733, fixed 0: out
    sens = {s["method"]: s for s in report.sensitivity}
    assert (sens["ema"]["fraction"], sens["fixed"]["fraction"]) == (1.0, 0.0)
    assert 0 <= sens["fixed"]["lo"] <= sens["fixed"]["hi"] <= 1
    # boundary: fixed collapses in 2/2 at x2; ema 1/3 at x2, 0/3 at x1: none
    assert {b["method"]: b["column"] for b in report.boundary} == {"fixed": "x2", "ema": None}

    paths = [*write(out, report), *plot_stability(out, report)]
    assert [p.name for p in paths] == ["stability.md", "stability.json", "stability_heatmap.png", "stability_difference.png"]
    md = (out / "stability.md").read_text()
    assert "| ema | x1 (0.0003) | 3 | 0.733 |" in md
    assert "| fixed | x2 (0.0006) | 2 (+1 failed) | 0.000 | [0.000, 0.000] | 0.400 | 2/2, 2 diverged |" in md
    # p: the exact permutation test over the 3 seeds, all differences positive: 2 of 8 sign patterns reach |sum| 0.25
    assert "| ema | x1 (0.0003) | 3 | +0.083 * | [+0.012, +0.155] | +2.89 | 3 | 0.250 |" in md
    assert d["p"] == 0.25 and d2["p"] == 0.5  # x2: +0.6 and +0.2, 2 of 4 patterns reach |sum| 0.8
    assert "| fixed | x2 (0.0006) |" in md and "| ema | none up to x2 |" in md
    assert json.loads((out / "stability.json").read_text())["baseline"] == "fixed"
    assert all(p.stat().st_size > 5000 for p in paths[2:])


# --- the command --------------------------------------------------------------------------------


def test_shipped_stability_study_dry_run(tmp_path):
    """`emapg ablate --study stability --dry-run`: 5 methods x 4 learning rates x 5 seeds = 100 runs, without a
    prepared model. Needs kl.target / ema.target_distance (the adaptive-beta and -eta variants of issue 21)."""
    r = cli("ablate", "--study", "stability", "--out", str(tmp_path / "sw"), "--dry-run")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 100
    ids = {shlex.split(line)[-1].split("/runs/")[1].rsplit("/", 1)[0] for line in lines}
    assert {f"{m}_optim.lr={lr}" for m in ("none", "fixed", "ema", "adaptive-beta", "adaptive-eta")
            for lr in ("0.0003", "0.0006", "0.0012", "0.0024")} == ids
    assert not (tmp_path / "sw").exists()


@pytest.mark.slow  # CI runs the shipped study reduced (below); this one adds the trainer's real divergence (exit 2) end to end
def test_stability_study_end_to_end(tmp_path, tiny_qwen2):
    """A reduced stability study on the tiny model: 2 methods x 2 values x 2 seeds, 2 RL steps, 2 runs at once. The
    axis is the weight decay, so that one value breaks training for sure: x1e43 of 1.0 with lr 3e-4 makes AdamW's
    decay factor 1 - lr x wd = -3e39, beyond float32, so the first optimizer step makes the weights non-finite (an lr
    that large would instead fail converting itself to float32, a crash). Those runs stop with exit 2 and must show
    up as diverged and collapsed, with final accuracy 0; the x1 runs (weight decay 1.0) train normally."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i % 7}+{i % 5}", "answers": [str(i % 7 + i % 5)]}) + "\n"
                            for i in range(8)))
    study = {
        "preset": "toy", "seeds": 2,
        "set": {"model.path": str(tiny_qwen2), "data.train": str(data), "data.eval": str(data), "data.eval_limit": 4,
                "rollout.prompts_per_step": 2, "rollout.n": 2, "rollout.max_new_tokens": 4, "eval.max_new_tokens": 4,
                "train.steps": 2, "train.save_every": 0, "eval.every": 1, "train.mini_batch_prompts": 2,
                "train.micro_batch_size": 4, "kl.k": 4, "ema.update_period": 1, "optim.weight_decay": 1.0},
        "variants": {"fixed": {"ema.decay": 1.0}, "ema": {"ema.decay": 0.5}},
        "grid": {"optim.weight_decay": ["x1", "x1e43"]},
        "analysis": {"baseline": "fixed"},
    }
    path = tmp_path / "tiny-stability.yaml"
    path.write_text(yaml.safe_dump(study, sort_keys=False))
    out = tmp_path / "sweep"
    t0 = time.perf_counter()
    r = cli("ablate", "--study", str(path), "--jobs", "2", "--out", str(out), timeout=600)
    print(f"end-to-end stability study: {time.perf_counter() - t0:.1f} s")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]  # the diverged runs are failed runs of the sweep
    assert "4 done, 0 finished before, 4 failed" in r.stdout
    assert "stability" in r.stdout and "collapses from" in r.stdout
    report = json.loads((out / "stability.json").read_text())
    assert report["methods"] == ["fixed", "ema"] and [c["label"] for c in report["columns"]] == ["x1", "x1e43"]
    for cell in report["cells"]:
        if cell["column"] == "x1e43":
            assert (cell["runs"], cell["diverged"], cell["collapsed"], cell["final"]["mean"]) == (2, 2, 2, 0.0)
        else:
            assert cell["runs"] == 2 and cell["diverged"] == 0 and 0.0 <= cell["final"]["mean"] <= 1.0
    assert {b["method"]: b["column"] for b in report["boundary"]} == {"fixed": "x1e43", "ema": "x1e43"}
    assert [(d["column"], d["n"]) for d in report["differences"]] == [("x1", 2), ("x1e43", 2)]
    md = (out / "stability.md").read_text()
    assert "diverged — step 1: the optimizer step made the policy's weights non-finite" in md
    for name in ("stability_heatmap.png", "stability_difference.png", "summary.md", "results.csv"):
        assert (out / name).is_file() and (out / name).stat().st_size > 1000, name


def test_the_shipped_stability_study_reduced(tmp_path, tiny_qwen2):
    """The issue's acceptance: `emapg ablate --study stability` itself, reduced on the command line (`--seeds 2`, one
    learning rate, `--set` 2 steps on the tiny model), runs and writes the table and both heatmaps. All five methods,
    the adaptive ones included, train; the paired differences pair both seeds."""
    out = tmp_path / "sweep"
    args = ["ablate", "--study", "stability", "--seeds", "2", "--grid", "optim.lr=x1", "--jobs", "2", "--out", str(out)]
    r = cli(*args, *tiny_sweep_sets(tiny_qwen2, tmp_path), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "10 done, 0 finished before, 0 failed" in r.stdout and "collapses from" in r.stdout
    report = json.loads((out / "stability.json").read_text())
    assert report["methods"] == ["none", "fixed", "ema", "adaptive-beta", "adaptive-eta"] and report["baseline"] == "fixed"
    assert [(c["label"], c["values"]) for c in report["columns"]] == [("x1", [0.0003])]
    assert all(c["runs"] == 2 and 0.0 <= c["final"]["mean"] <= 1.0 for c in report["cells"])
    assert [(d["method"], d["n"]) for d in report["differences"]] == [(m, 2) for m in ("none", "ema", "adaptive-beta", "adaptive-eta")]
    # the adaptive variants ran their controllers: kl/coef and ema/decay moved in their runs
    beta = [json.loads(line).get("kl/coef") for line in (out / "runs" / "adaptive-beta_optim.lr=0.0003" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    eta = [json.loads(line).get("ema/decay") for line in (out / "runs" / "adaptive-eta_optim.lr=0.0003" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    assert beta[1] == 0.01 and beta[2] != 0.01 and eta[1] != 0.9
    for name in ("stability.md", "stability_heatmap.png", "stability_difference.png", "summary.md", "results.csv"):
        assert (out / name).is_file() and (out / name).stat().st_size > 1000, name


def test_every_analysis_kind_is_registered():
    """ablate/__init__.py's registry has an analysis for each `analysis.kind` a study file may name, and only those."""
    from typing import get_args

    from emapg_cli.ablate import analyses
    from emapg_cli.ablate.study import StudyAnalysis

    assert set(analyses()) == set(get_args(StudyAnalysis.model_fields["kind"].annotation))
    assert all(hasattr(module, f) for module, _ in analyses().values() for f in ("analyze", "write", "console_table"))
