"""The anchor study (presets/ablations/anchors.yaml, ablate/anchors.py): its plan on the toy and on a stand-in for
the smol preset (relative to the preset, as the stability study), the analysis of a sweep folder written by hand
(paired comparisons by seed and by item against hand computations), the plots, and the command end to end."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from emapg_cli.ablate.aggregate import aggregate, save_plan
from emapg_cli.ablate.anchors import analyze, write
from emapg_cli.ablate.grid import parse_grid
from emapg_cli.ablate.plots import plot_anchors
from emapg_cli.ablate.runner import run_dir
from emapg_cli.ablate.study import build_sweep, save_sweep
from train_helpers import tiny_sweep_sets

RULES = ["none", "fixed", "ema", "reset", "mixup", "bema", "adaptive-eta"]


def cli(*args: str, timeout: int = 120, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "emapg_cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


def _ids(stdout: str) -> list[str]:
    return [shlex.split(line)[-1].split("/runs/")[1] for line in stdout.strip().splitlines()]


def test_the_study_on_the_toy_with_a_beta_axis(tmp_path):
    """7 rules x lr {x1, x4} x 3 seeds = 42 runs; with the toy's beta axis kl.coef {x1, x10}, 78: `none` (kl.coef 0 at
    every multiple) runs once per lr, not twice."""
    plain = cli("ablate", "--study", "anchors", "--out", str(tmp_path / "a"), "--dry-run")
    assert plain.returncode == 0, plain.stderr
    assert len(_ids(plain.stdout)) == 42
    assert {i.rsplit("/", 1)[0] for i in _ids(plain.stdout)} == {f"{r}_optim.lr={lr}" for r in RULES for lr in ("0.0003", "0.0012")}
    beta = cli("ablate", "--study", "anchors", "--grid", "kl.coef=x1,x10", "--out", str(tmp_path / "b"), "--dry-run")
    ids = _ids(beta.stdout)
    assert len(ids) == 78 and len(set(ids)) == 78
    assert sorted(i for i in ids if i.startswith("none_") and i.endswith("seed0")) == [
        "none_optim.lr=0.0003_kl.coef=0.0/seed0", "none_optim.lr=0.0012_kl.coef=0.0/seed0"]
    line = next(x for x in beta.stdout.splitlines() if "bema_optim.lr=0.0012_kl.coef=0.1/seed2" in x)
    for item in ("anchor.rule=bema", "kl.coef=0.1", "optim.lr=0.0012", "train.steps=60", "eval.initial_kl_every=5", "train.seed=2"):
        assert f"--set {item}" in line
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_study_follows_the_preset(tmp_path, emapg_home):
    """`--preset smol` once presets/smol.yaml exists: a stand-in preset file with smol's shape (its own lr 2e-6, eta
    0.95 every 10 steps) gets x1 = 2e-6 and x4 = 8e-6, its own update period for every rule, and the default folder
    ablations/anchors-smol."""
    preset = tmp_path / "smol.yaml"
    preset.write_text(yaml.safe_dump({
        "name": "smol", "model": {"path": "$EMAPG_HOME/smol/model"},
        "data": {"train": "$EMAPG_HOME/smol/train.jsonl", "eval": "$EMAPG_HOME/smol/test.jsonl"},
        "rollout": {"prompts_per_step": 16, "n": 8, "max_new_tokens": 256}, "optim": {"lr": 2.0e-6},
        "train": {"steps": 100, "mini_batch_prompts": 16, "micro_batch_size": 16}, "kl": {"coef": 0.001},
        "ema": {"decay": 0.95, "update_period": 10}, "eval": {"every": 20, "max_new_tokens": 256}}))
    r = cli("ablate", "--study", "anchors", "--preset", str(preset), "--dry-run")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 42 and all(f"--preset {preset}" in x and "--out ablations/anchors-smol/runs/" in x for x in lines)
    assert {i.split("_optim.lr=")[1].split("/")[0] for i in _ids(r.stdout)} == {"2e-06", "8e-06"}
    plan = cli("train", "--preset", str(preset), "--set", "anchor.rule=reset", "--dry-run")
    assert "anchor.rule reset: η 0 (set by the rule) every 10 steps" in " ".join(plan.stdout.split())


def test_the_study_by_preset_name(tmp_path, monkeypatch):
    """`--preset smol` by name, as it will be once presets/smol.yaml ships: a presets folder holding the stand-in
    smol.yaml and the shipped anchors study; the sweep and its dry-run lines (`shell_command`, what --dry-run prints)."""
    import shutil

    from emapg_cli.ablate import study as study_mod
    from emapg_cli.ablate.runner import launcher, shell_command
    from emapg_cli.config import loading

    presets = tmp_path / "presets"
    (presets / "ablations").mkdir(parents=True)
    shutil.copy(study_mod.studies_dir() / "anchors.yaml", presets / "ablations" / "anchors.yaml")
    shutil.copy(study_mod.studies_dir().parent / "toy.yaml", presets / "toy.yaml")
    (presets / "smol.yaml").write_text(yaml.safe_dump({"name": "smol", "optim": {"lr": 2.0e-6}, "kl": {"coef": 0.001},
                                                       "ema": {"decay": 0.95, "update_period": 10}}))
    monkeypatch.setattr(loading, "preset_dir", lambda: presets)
    monkeypatch.setattr(study_mod, "preset_dir", lambda: presets)
    sweep = build_sweep("anchors", "smol", None, [], None, [])
    runs = sweep.runs()
    assert (sweep.name, sweep.preset, len(runs)) == ("anchors", "smol", 42)
    lines = [shell_command(sweep, r, Path("ablations/anchors-smol"), launcher()) for r in runs]
    assert all(line.startswith("emapg train --preset smol ") for line in lines)
    assert {r.values["optim.lr"] for r in runs} == {2e-6, 8e-6}


# --- the analysis of a sweep folder written by hand ------------------------------------------------


def _run(out, spec, final: float, items: list[bool], kl0: float, entropy=(0.5, 0.3), length=(4.0, 6.0)):
    """A finished run: evaluations at steps 0/10/20 (initial 0.4), kl/to_initial at 10 and 20, entropy and response
    length at steps 1..5 (first values then last ones), and its final per-item outcomes."""
    rdir = run_dir(out, spec)
    (rdir / "evals").mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": 0.4}]
    rows += [{"step": s, "entropy": entropy[s == 5], "rollout/response_len": length[s == 5], "kl/value": 0.02} for s in range(1, 6)]
    rows += [{"step": 10, "kl/to_initial": kl0 / 2, "eval/accuracy": 0.5}, {"step": 20, "kl/to_initial": kl0}]
    (rdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (rdir / "summary.json").write_text(json.dumps({"eval_accuracy_initial": 0.4, "eval_accuracy_final": final, "steps": 20}))
    (rdir / "evals" / "step_20.jsonl").write_text("".join(json.dumps({"id": f"q{i}", "correct": [c]}) + "\n" for i, c in enumerate(items)))


def test_anchor_report_by_hand(tmp_path):
    study = tmp_path / "s.yaml"
    study.write_text(yaml.safe_dump({"preset": "toy", "seeds": 3, "variants": {"fixed": {"anchor.rule": "fixed"}, "ema": {}},
                                     "grid": {"optim.lr": ["x1"]}, "analysis": {"kind": "anchors", "baseline": "fixed"}}))
    sweep = build_sweep(str(study), None, None, [parse_grid("kl.coef=x1,x10")], None, [])
    out = tmp_path / "sweep"
    specs = {(r.values["variant"], r.grid["kl.coef"], r.seed): r for r in sweep.runs()}
    save_sweep(sweep, out)
    save_plan(out, list(specs.values()))
    # 10 items per evaluation. At coef x1, per seed: fixed right on the first 5 items (0.5), ema on the first 6, then
    # on 7, then on 5 plus item 9: differences +0.1, +0.2, +0.0 (seed 2: item 4 lost, item 9 gained: 1 each way)
    for seed in range(3):
        _run(out, specs["fixed", "x1", seed], 0.5, [i < 5 for i in range(10)], kl0=0.10)
    ema_items = [[i < 6 for i in range(10)], [i < 7 for i in range(10)], [i < 4 or i == 9 for i in range(10)]]
    for seed, its in enumerate(ema_items):
        _run(out, specs["ema", "x1", seed], sum(its) / 10, its, kl0=0.02 * (seed + 1))
    # at coef x10: ema ends above fixed on every seed by 0.3, fixed collapsed on seed 0 (best 0.5, final 0.3)
    for seed in range(3):
        _run(out, specs["fixed", "x10", seed], 0.3 if seed == 0 else 0.45, [i < (3 if seed == 0 else 4) for i in range(10)], kl0=0.2)
        _run(out, specs["ema", "x10", seed], 0.6 if seed == 0 else 0.75, [i < (6 if seed == 0 else 7) for i in range(10)], kl0=0.05)
    _, records, _ = aggregate(out)
    report = analyze(sweep, records, out)
    assert [c["label"] for c in report.cells] == ["lr x1, coef x1", "lr x1, coef x10"]
    row = report.row("ema", "lr x1, coef x1")
    assert row["runs"] == 3 and row["final"]["mean"] == pytest.approx(0.6) and row["collapsed"] == 0
    # kl/to_initial over the last 20% of its 2 measurements (the last): 0.02, 0.04, 0.06 -> mean 0.04; entropy over the last 20% of 5 steps (1 step): 0.3;
    # response length likewise 6.0; KL to the anchor: 0.02
    assert row["kl_to_initial"]["mean"] == pytest.approx(0.04) and row["entropy"]["mean"] == pytest.approx(0.3)
    assert row["response_len"]["mean"] == pytest.approx(6.0) and row["kl_mean"]["mean"] == pytest.approx(0.02)
    assert report.row("fixed", "lr x1, coef x10")["collapsed"] == 1  # 0.5 best - 0.3 final = 20 points > 10
    c = report.comparison("ema", "lr x1, coef x1")
    seeds, items = c["seeds"], c["items"]
    # by seed: differences +0.1, +0.2, 0.0: mean 0.1; 2 nonzero -> 4 sign patterns, |sum| >= 0.3 for (+,+), (-,-): p = 0.5
    assert (seeds["n"], seeds["diff"], seeds["p"], seeds["test"], seeds["method"]) == (3, pytest.approx(0.1), 0.5, "permutation", "exact")
    assert (seeds["a_better"], seeds["b_better"], seeds["ties"]) == (2, 0, 1)
    # by (seed, item): 30 pairs; ema alone right on item 5 (seed 0), items 5-6 (seed 1), item 9 (seed 2): 4; fixed
    # alone on item 4 (seed 2): 1. McNemar exact: 2 P(X <= 1), X ~ Bin(5, 1/2) = 2 x 6 / 32 = 0.375; mean diff 3/30 = 0.1
    assert (items["n"], items["a_better"], items["b_better"], items["p"], items["test"]) == (30, 4, 1, 0.375, "mcnemar")
    assert items["diff"] == pytest.approx(0.1)
    c10 = report.comparison("ema", "lr x1, coef x10")
    # by seed: +0.3 on all three: 2 of 8 sign patterns reach |sum| = 0.9: p = 0.25, the smallest 3 seeds can give
    assert c10["seeds"]["p"] == 0.25 and c10["seeds"]["diff"] == pytest.approx(0.3)
    # by item: 9 discordant pairs, all ema's: 2 / 2^9 = 0.00390625
    assert (c10["items"]["a_better"], c10["items"]["b_better"], c10["items"]["p"]) == (9, 0, 2 / 512)
    # Holm over the 2 tests of each family: seeds 0.25 -> 0.5, 0.5 -> max(0.5, 0.5); items 0.0039 -> 0.0078, 0.375
    assert (c10["seeds"]["p_holm"], c["seeds"]["p_holm"]) == (0.5, 0.5)
    assert (c10["items"]["p_holm"], c["items"]["p_holm"]) == (2 * 2 / 512, 0.375)
    paths = [*write(out, report), *plot_anchors(out, report)]
    assert [p.name for p in paths] == ["anchors.md", "anchors.json", "anchors_accuracy.png", "anchors_kl_accuracy.png"]
    md = (out / "anchors.md").read_text()
    assert "| ema | lr x1, coef x1 | 3 | 0.600 [" in md and " · 4:1 · p 0.375 (Holm 0.375) · 129 pairs |" in md
    assert json.loads((out / "anchors.json").read_text())["baseline"] == "fixed"
    assert all(p.stat().st_size > 5000 for p in paths[2:])


@pytest.mark.slow
def test_the_shipped_anchor_study_reduced(tmp_path, tiny_qwen2):
    """`emapg ablate --study anchors` itself on the tiny model (one lr, one seed, 2 RL steps): every rule trains, the
    report, the plots and the per-item comparisons are written; a second invocation finds every run finished."""
    args = ["ablate", "--study", "anchors", "--seeds", "1", "--grid", "optim.lr=x1", "--jobs", "2", "--out", str(tmp_path / "sw"),
            *tiny_sweep_sets(tiny_qwen2, tmp_path, **{"eval.initial_kl_every": 1})]
    r = cli(*args, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "sw" / "anchors.json").read_text())
    assert report["rules"] == RULES and [r["status"] for r in report["runs"]] == ["done"] * 7
    assert all(c["items"]["n"] == 4 for c in report["comparisons"])
    again = cli(*args, timeout=300)
    assert "0 done, 7 finished before, 0 failed" in again.stdout
