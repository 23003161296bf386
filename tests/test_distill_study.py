"""The distillation study of `emapg ablate` (issue 22): `analysis: {kind: distill}`, the per-run numbers (gap closed,
steps and wall time to 90% of the teacher, last-20% means), the per-variant report over seeds with paired differences,
distill.md/.json and the plots, a partial sweep, --aggregate-only, and the stability kind left as it was. Sweep folders
are written by hand: no training runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from emapg_cli.ablate.aggregate import aggregate, save_plan
from emapg_cli.ablate.grid import Axis
from emapg_cli.ablate.distill import analyze, gap_closed, last_fraction_mean, wall_to_step, write
from emapg_cli.ablate.plots import plot_distill
from emapg_cli.ablate.runner import run_dir, status_path
from emapg_cli.ablate.study import StudyAnalysis, build_sweep, read_sweep, save_sweep
from emapg_cli.errors import UserError

VARIANTS = {"topk_mass": {"kl.estimator": "topk_mass"}, "k1": {"kl.estimator": "k1"}, "topk": {"kl.estimator": "topk"}}


def _study(tmp_path: Path, **changes) -> str:
    data = {"preset": "toy-distill", "seeds": 3, "variants": VARIANTS, "analysis": {"kind": "distill", "baseline": "topk_mass"}}
    data.update(changes)
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


# --- the analysis section ----------------------------------------------------------------------


def test_distill_analysis_section_is_checked(tmp_path):
    sweep = build_sweep(_study(tmp_path), None, None, [], None, [])
    assert sweep.analysis == StudyAnalysis(kind="distill", baseline="topk_mass", teacher_fraction=0.9, tail_fraction=0.2)
    for analysis, message in (({"kind": "distill", "baseline": "grpo"}, "analysis.baseline 'grpo' is not one of its variants"),
                              ({"kind": "distill", "baseline": "k1", "collapse_points": 5}, "collapse_points: not a setting of kind distill"),
                              ({"baseline": "k1", "teacher_fraction": 0.8}, "teacher_fraction: not a setting of kind stability"),
                              ({"kind": "distill", "baseline": "k1", "teacher_fraction": 1.5}, "teacher_fraction"),
                              ({"kind": "distil", "baseline": "k1"}, "analysis.kind")):
        with pytest.raises(UserError, match=message) as err:
            build_sweep(_study(tmp_path, analysis=analysis), None, None, [], None, [])
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="distill analysis compares the variants without a grid"):
        build_sweep(_study(tmp_path), None, None, [Axis("kl.k", (2, 8))], None, [])
    # recorded with its kind's settings only, and read back
    save_sweep(sweep, tmp_path / "out")
    assert yaml.safe_load((tmp_path / "out" / "study.yaml").read_text())["analysis"] == {
        "kind": "distill", "baseline": "topk_mass", "teacher_fraction": 0.9, "tail_fraction": 0.2}
    assert read_sweep(tmp_path / "out").analysis == sweep.analysis


def test_shipped_studies_keep_their_analysis():
    """presets/ablations/distill.yaml: 8 estimators x 3 seeds, baseline topk_mass at 90%; stability.yaml is still the
    stability kind (no `kind:` key) with the settings it always recorded."""
    distill = build_sweep("distill", None, None, [], None, [])
    assert (distill.analysis.kind, distill.analysis.baseline, distill.analysis.teacher_fraction) == ("distill", "topk_mass", 0.9)
    assert len(distill.runs()) == 8 * 3 and distill.set == ["train.steps=150", "train.save_every=0"]  # half the preset's run
    stability = build_sweep("stability", None, None, [], None, [])
    assert stability.analysis.kind == "stability"
    assert stability.analysis.settings() == {"baseline": "fixed", "collapse_points": 10, "target_gain": 0.15, "within_points": 5}


# --- per-run numbers ---------------------------------------------------------------------------


def test_run_numbers_by_hand():
    # 10 logged values at 0.2: the last ceil(2.0) = 2 -> (9 + 10) / 2; 7 values: ceil(1.4) = 2 -> (6 + 7) / 2;
    # 150 at 0.2: the last 30, values 121..150 -> mean 135.5; the order of the list does not matter
    assert last_fraction_mean([(s, float(s)) for s in range(1, 11)], 0.2) == 9.5
    assert last_fraction_mean([(s, float(s)) for s in (7, 1, 2, 3, 4, 5, 6)], 0.2) == 6.5
    assert last_fraction_mean([(s, float(s)) for s in range(1, 151)], 0.2) == 135.5
    assert last_fraction_mean([], 0.2) is None
    # 3 steps of 1.0 s rollout + 0.5 s update = 4.5 s; step 4 has no timing -> unknown
    curves = {"time/rollout": [(1, 1.0), (2, 1.0), (3, 1.0)], "time/update": [(1, 0.5), (2, 0.5), (3, 0.5)]}
    assert wall_to_step(curves, 3) == 4.5 and wall_to_step(curves, 4) is None
    # (0.78 - 0.3) / (0.8 - 0.3) = 0.96; a teacher not above the start has no gap
    assert gap_closed(0.3, 0.78, 0.8) == pytest.approx(0.96)
    assert gap_closed(0.5, 0.6, 0.5) is None and gap_closed(None, 0.6, 0.8) is None


# --- a sweep folder written by hand ------------------------------------------------------------


def _run(out, spec, evals: dict[int, float], final=None, teacher=0.8, steps=10, summary_teacher=True):
    """metrics.jsonl rows 0..steps (step 0: the initial and the teacher's evaluations; every step 1.0 s rollout + 0.5 s
    update, distill/entropy = step, distill/tail_mass = step / 100, distill/kl 0.5, grad/norm 2), summary.json when
    `final` is given. Rows stop at the last eval step without a final (a run that stopped)."""
    rdir = run_dir(out, spec)
    rdir.mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": evals[0], "eval/teacher_accuracy": teacher}]
    last = steps if final is not None else max(evals)
    for s in range(1, last + 1):
        row = {"step": s, "time/rollout": 1.0, "time/update": 0.5, "distill/entropy": float(s), "distill/tail_mass": s / 100,
               "distill/kl": 0.5, "grad/norm": 2.0}
        if s in evals:
            row["eval/accuracy"] = evals[s]
        if s == steps and final is not None:
            row["eval/accuracy"] = final
        rows.append(row)
    (rdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if final is not None:
        summary = {"eval_accuracy_initial": evals[0], "eval_accuracy_final": final, "steps": steps, "wall_time_s": 20.0}
        if summary_teacher:
            summary["teacher_accuracy"] = teacher
        (rdir / "summary.json").write_text(json.dumps(summary))


def _sweep(tmp_path: Path):
    """topk_mass: 3 finished seeds; k1: 2 finished, seed 2 crashed; topk: nothing run yet (a partial sweep)."""
    out = tmp_path / "sweep"
    sweep = build_sweep(_study(tmp_path), None, None, [], None, [])
    runs = {(r.values["variant"], r.seed): r for r in sweep.runs()}
    save_sweep(sweep, out)
    save_plan(out, list(runs.values()))
    # teacher 0.8 -> target 0.9 x 0.8 = 0.72
    _run(out, runs["topk_mass", 0], {0: 0.3, 2: 0.5, 4: 0.72, 6: 0.70, 8: 0.75}, 0.78)  # reached at 4 (exactly 0.72)
    _run(out, runs["topk_mass", 1], {0: 0.3, 2: 0.4, 4: 0.6, 6: 0.71, 8: 0.73}, 0.74)  # reached at 8
    _run(out, runs["topk_mass", 2], {0: 0.3, 2: 0.5, 4: 0.6, 6: 0.65, 8: 0.7}, 0.70)  # not reached (final 0.70 < 0.72)
    _run(out, runs["k1", 0], {0: 0.3, 2: 0.72, 4: 0.75, 6: 0.78, 8: 0.79}, 0.80)  # reached at 2
    # teacher only in the step-0 row (summary.json without teacher_accuracy): reached at 4
    _run(out, runs["k1", 1], {0: 0.3, 2: 0.6, 4: 0.73, 6: 0.74, 8: 0.76}, 0.77, summary_teacher=False)
    _run(out, runs["k1", 2], {0: 0.3, 2: 0.5})
    (run_dir(out, runs["k1", 2]) / "status.json").write_text(json.dumps({"status": "failed", "reason": "boom", "step": 3}))
    status_path(out, runs["k1", 2]).write_text(json.dumps({"status": "failed", "returncode": 1, "error": "error: RuntimeError: boom"}))
    return out, sweep


def test_distill_report_by_hand(tmp_path):
    out, sweep = _sweep(tmp_path)
    _, records, _ = aggregate(out)
    report = analyze(sweep, records)
    tm = report.row("topk_mass")
    # finals 0.78 / 0.74 / 0.70: mean 0.74, s = sqrt((0.04^2 + 0 + 0.04^2) / 2) = 0.04,
    # half width t*(0.95, 2) 4.302653 x 0.04 / sqrt(3) = 0.099366 -> [0.640634, 0.839366]
    assert (tm["runs"], tm["final"]["mean"], tm["final"]["std"]) == (3, pytest.approx(0.74), pytest.approx(0.04))
    assert (tm["final"]["lo"], tm["final"]["hi"]) == (pytest.approx(0.640634, abs=1e-6), pytest.approx(0.839366, abs=1e-6))
    # gap closed (0.78 - 0.3) / 0.5 = 0.96, 0.44 / 0.5 = 0.88, 0.40 / 0.5 = 0.80 -> mean 0.88
    assert tm["gap_closed"]["mean"] == pytest.approx(0.88) and (tm["gap_closed"]["min"], tm["gap_closed"]["max"]) == (pytest.approx(0.8), pytest.approx(0.96))
    # steps to 0.72: 4 and 8 (seed 2 not reached) -> mean 6 (4-8); wall 4 x 1.5 = 6 s and 8 x 1.5 = 12 s -> 9
    assert (tm["reached"], tm["not_reached"]) == (2, 1)
    assert (tm["steps_to_target"]["mean"], tm["steps_to_target"]["min"], tm["steps_to_target"]["max"]) == (6, 4, 8)
    assert (tm["wall_to_target_s"]["mean"], tm["wall_to_target_s"]["min"], tm["wall_to_target_s"]["max"]) == (9.0, 6.0, 12.0)
    # last 20% of the 10 steps: entropy (9 + 10) / 2 = 9.5, tail mass (0.09 + 0.10) / 2 = 0.095
    assert tm["entropy"]["mean"] == 9.5 and tm["tail_mass"]["mean"] == pytest.approx(0.095)
    assert (tm["kl"]["mean"], tm["grad_norm"]["mean"], tm["teacher"]["mean"]) == (0.5, 2.0, pytest.approx(0.8))
    k1 = report.row("k1")
    # seed 1's teacher from its step-0 row: steps 2 and 4, wall 3 s and 6 s; the crashed seed 2 is not counted
    assert (k1["runs"], k1["failed"], k1["reached"], k1["not_reached"]) == (2, 1, 2, 0)
    assert (k1["steps_to_target"]["mean"], k1["wall_to_target_s"]["mean"], k1["teacher"]["n"]) == (3, 4.5, 2)
    topk = report.row("topk")  # nothing ran: empty, not a crash
    assert (topk["runs"], topk["unfinished"], topk["final"]["mean"], topk["reached"]) == (0, 3, None, 0)
    # paired k1 - topk_mass on seeds 0 and 1: final 0.80 - 0.78 = 0.02, 0.77 - 0.74 = 0.03 -> mean 0.025,
    # sd = 0.01 / sqrt(2) = 0.0070711, half width t*(0.95, 1) 12.7062 x 0.0070711 / sqrt(2) = 0.063531
    d = report.difference("k1")
    assert (d["final"]["n"], d["final"]["seeds"], d["final"]["mean"]) == (2, [0, 1], pytest.approx(0.025))
    assert (d["final"]["lo"], d["final"]["hi"], d["final"]["excludes_zero"]) == (pytest.approx(-0.038531, abs=1e-5), pytest.approx(0.088531, abs=1e-5), False)
    # steps: 2 - 4 = -2, 4 - 8 = -4 -> mean -3; wall -3 s and -6 s -> -4.5
    assert (d["steps_to_target"]["mean"], d["wall_to_target_s"]["mean"]) == (-3, -4.5)
    assert report.difference("topk")["final"]["n"] == 0 and report.difference("topk_mass") is None
    # the mean accuracy curve of topk_mass at step 4: (0.72 + 0.6 + 0.6) / 3 = 0.64
    acc = report.curves["topk_mass"]["accuracy"]
    assert acc["mean"][acc["steps"].index(4)] == pytest.approx(0.64) and "accuracy" not in report.curves["topk"]

    paths = [*write(out, report), *plot_distill(out, report)]
    assert [p.name for p in paths] == ["distill.md", "distill.json", "distill_accuracy.png", "distill_entropy.png", "distill_tail_mass.png"]
    md = (out / "distill.md").read_text()
    assert "| topk_mass | 3 | 0.740 [0.641, 0.839] | 0.800 (0.800–0.800) | 0.88 (0.80–0.96) | 2/3 | 6 (4–8) | 9 (6–12) | 9.5 (9.5–9.5) |" in md
    assert "| k1 | 2 (+1 failed) |" in md and "| topk | 0 (+3 unfinished) | – |" in md
    assert "| k1 | +0.025 [-0.039, +0.089] (2) | -3.0 [-15.7, +9.7] (2) |" in md
    assert "`k1/seed2`: failed — error: RuntimeError: boom" in md
    js = json.loads((out / "distill.json").read_text())
    assert js["baseline"] == "topk_mass" and js["analysis"] == {"baseline": "topk_mass", "teacher_fraction": 0.9, "tail_fraction": 0.2}
    assert {r["run_id"]: r["steps_to_target"] for r in js["runs"]}["topk_mass/seed2"] is None
    assert all(p.stat().st_size > 5000 for p in paths[2:])


def test_aggregate_only_writes_the_report_of_its_kind(tmp_path, monkeypatch):
    """--aggregate-only on a partial distill sweep: distill.md and the plots beside results.csv, no stability report;
    with --study the study file's analysis replaces the recorded one (a folder recorded before the section existed)."""
    from emapg_cli.ablate import plots
    from emapg_cli.cli.ablate_cmd import _report

    out, sweep = _sweep(tmp_path)
    monkeypatch.setattr(plots, "plot_all", lambda *a, **k: [])  # the sweep's own figures are tested elsewhere (CI time)
    _report(out)
    names = {p.name for p in out.iterdir()}
    assert {"results.csv", "summary.md", "distill.md", "distill.json", "distill_accuracy.png"} <= names
    assert not {"stability.md", "stability.json"} & names
    monkeypatch.setattr(plots, "plot_distill", lambda *a, **k: [])  # from here on about the tables
    # a record without analysis: nothing, unless --study brings it (the folder's study.yaml is left as it was)
    record = yaml.safe_load((out / "study.yaml").read_text())
    (out / "study.yaml").write_text(yaml.safe_dump({**record, "analysis": None}))
    for name in ("distill.md", "distill.json"):
        (out / name).unlink()
    _report(out)
    assert not (out / "distill.md").exists()
    _report(out, _study(tmp_path, analysis={"kind": "distill", "baseline": "k1", "teacher_fraction": 0.5}))
    assert json.loads((out / "distill.json").read_text())["analysis"]["teacher_fraction"] == 0.5
    assert yaml.safe_load((out / "study.yaml").read_text())["analysis"] is None
    with pytest.raises(UserError, match="does not fit the sweep in the folder"):
        _report(out, _study(tmp_path, analysis={"kind": "distill", "baseline": "nope"}, variants={"nope": {}}))


def test_a_stability_sweep_still_gets_its_stability_report(tmp_path, monkeypatch):
    from emapg_cli.ablate import plots
    from emapg_cli.cli.ablate_cmd import _report

    monkeypatch.setattr(plots, "plot_all", lambda *a, **k: [])  # the sweep's own figures are tested elsewhere (CI time)

    study = tmp_path / "s.yaml"
    study.write_text(yaml.safe_dump({"preset": "toy", "seeds": 1, "variants": {"fixed": {"ema.decay": 1.0}, "ema": {}},
                                     "grid": {"optim.lr": ["x1"]}, "analysis": {"baseline": "fixed"}}))
    out = tmp_path / "stab"
    sweep = build_sweep(str(study), None, None, [], None, [])
    save_sweep(sweep, out)
    save_plan(out, sweep.runs())
    assert yaml.safe_load((out / "study.yaml").read_text())["analysis"] == {
        "kind": "stability", "baseline": "fixed", "collapse_points": 10.0, "target_gain": 0.15, "within_points": 5.0}
    for spec in sweep.runs():
        rdir = run_dir(out, spec)
        rdir.mkdir(parents=True)
        (rdir / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.4}) + "\n")
        (rdir / "summary.json").write_text(json.dumps({"eval_accuracy_initial": 0.4, "eval_accuracy_final": 0.6, "steps": 10}))
    _report(out)
    names = {p.name for p in out.iterdir()}
    assert {"stability.md", "stability.json", "stability_heatmap.png"} <= names and "distill.md" not in names
    # the settings it recorded before the kinds (and the sensitivity floor the analysis adds), no kind
    assert json.loads((out / "stability.json").read_text())["analysis"] == {
        "baseline": "fixed", "collapse_points": 10.0, "target_gain": 0.15, "within_points": 5.0, "sensitivity_floor": 0.4}
