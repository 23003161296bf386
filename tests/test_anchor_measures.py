"""The anchor study's measurements (ablate/measures.py, `measure:` of a study) and its design fitted to this machine
(presets/ablations/anchors-smol.yaml): hand-computed pass@n, distinct answers, best-constant baseline, gain and
forgetting; the dry run's run count and wall-time estimate before anything is prepared; `--aggregate-only` rebuilding
every table and plot from a committed study folder (tests/fixtures/anchors-mini: a real 6-run study on the tiny model,
its weights deleted as the study deletes them, its machine paths replaced by /fixture)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from emapg_cli.ablate import measures
from emapg_cli.ablate.study import studies_dir

FIXTURE = Path(__file__).parent / "fixtures" / "anchors-mini"


def cli(*args: str, timeout: int = 300, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "emapg_cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


def _row(i: str, responses: list[str], correct: list[bool]) -> dict:
    return {"id": i, "responses": responses, "correct": correct}


def test_per_task_by_hand():
    rows = [
        # gcd: item 0 has 4 samples, 2 correct, answers {2, 2, 3, none} -> 3 distinct; item 1: 4 wrong, all `2`
        _row("gcd-1-0", ["<answer>2</answer>", "x <answer>2</answer>", "<answer> 3 </answer>", "no tags"], [True, True, False, False]),
        _row("gcd-1-1", ["<answer>2</answer>"] * 4, [False] * 4),
        # letter_counting: one item, one correct of 4, the last <answer> counts: answers {5, 4} -> 2 distinct
        _row("letter_counting-1-0", ["<answer>4</answer><answer>5</answer>", "<answer>4</answer>", "<answer>4</answer>",
                                     "<answer>4</answer>"], [False, True, True, True]),
    ]
    got = measures.per_task(rows)
    # gcd accuracy: (2/4 + 0/4) / 2 = 0.25; pass: 1 of 2 items; distinct per item (3 + 1) / 2 = 2; across items the
    # first samples' answers {2, 2} -> 1; answered: 7 of 8 samples
    assert got["gcd"] == {"items": 2.0, "accuracy": 0.25, "pass": 0.5, "distinct": 2.0, "distinct_items": 1.0, "answered": 7 / 8}
    # letter_counting: 3/4 correct, pass 1, distinct answers {5, 4} = 2, first answer 5 -> 1 across items
    assert got["letter_counting"] == {"items": 1.0, "accuracy": 0.75, "pass": 1.0, "distinct": 2.0, "distinct_items": 1.0,
                                      "answered": 1.0}
    # an answer is cut to MAX_ANSWER_CHARS, and only the last 16 KiB of a response are searched
    assert measures.answer_of("<answer>" + "9" * 1000 + "</answer>") == "9" * measures.MAX_ANSWER_CHARS
    assert measures.answer_of("<answer>1</answer>" + "z" * 20_000) is None


def test_best_constant_and_summary_by_hand():
    rows = [{"id": f"gcd-1-{i}", "answers": [a]} for i, a in enumerate(["2", "1", "2", "4", "2"])]
    rows += [{"id": f"count_bits-1-{i}", "answers": [a]} for i, a in enumerate(["1", "2"])]
    const = measures.best_constant(rows)
    # gcd: `2` on 3 of 5 items = 0.6; count_bits: a tie of 1 each, the first in the rows' order wins: `1`, 1/2
    assert const == {"gcd": {"answer": "2", "accuracy": 0.6, "items": 5}, "count_bits": {"answer": "1", "accuracy": 0.5, "items": 2}}
    base = {"best_constant": {"heldout": {"gcd": {"accuracy": 0.6}, "lc": {"accuracy": 0.1}}},
            "format_only": {"gcd": {"accuracy": 0.3}, "lc": {"accuracy": 0.25}},
            "untrained": {"cb": {"accuracy": 0.4, "distinct_items": 5.0}, "cs": {"accuracy": 0.1, "distinct_items": 7.0}}}
    found = {"heldout": {"gcd": {"accuracy": 0.7, "distinct_items": 1.0}, "lc": {"accuracy": 0.45, "distinct_items": 3.0}},
             "sampled": {"gcd": {"pass": 0.9, "distinct": 1.5}, "lc": {"pass": 0.5, "distinct": 2.5}},
             "untrained": {"cb": {"accuracy": 0.1, "distinct_items": 1.0}, "cs": {"accuracy": 0.2, "distinct_items": 2.0}}}
    s = measures.summarize_run(found, base)
    # gain: gcd 0.7 - max(0.6, 0.3) = 0.1, lc 0.45 - max(0.1, 0.25) = 0.2 -> 0.15
    assert s["gain"] == pytest.approx(0.15)
    # pass (0.9 + 0.5) / 2 = 0.7; distinct (1.5 + 2.5) / 2 = 2; across items (1 + 3) / 2 = 2
    assert (s["pass_n"], s["distinct"], s["distinct_items"]) == (pytest.approx(0.7), 2.0, 2.0)
    # forgetting: cb 0.4 - 0.1 = 0.3, cs 0.1 - 0.2 = -0.1 -> 0.1; untrained distinct (1 + 2) / 2 = 1.5
    assert s["forgetting"] == pytest.approx(0.1) and s["untrained_distinct_items"] == 1.5
    assert s["tasks"]["gcd"] == {"final": 0.7, "pass": 0.9, "distinct": 1.5, "distinct_items": 1.0}


def _hours(text: str) -> float:
    m = re.search(r"^estimated wall time: (\d+) h (\d+) min", text, re.M)
    assert m, text
    return int(m.group(1)) + int(m.group(2)) / 60


def test_the_fitted_design_before_anything_is_prepared(tmp_path):
    """`emapg ablate --study anchors --preset smol --dry-run` on a fresh EMAPG_HOME (no model, no data): 15 runs and
    the estimate from the study's cost record, which this test recomputes from the file itself."""
    r = cli("ablate", "--study", "anchors", "--preset", "smol", "--dry-run", EMAPG_HOME=str(tmp_path / "home"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert "15 runs" in r.stderr.splitlines() and len(lines) == 15 and all(x.startswith("emapg train --preset smol ") for x in lines)
    design = yaml.safe_load((studies_dir() / "anchors-smol.yaml").read_text())
    c, m, steps = design["cost"], design["measure"], design["set"]["train.steps"]
    assert design["set"]["eval.every"] == 0 and design["set"]["eval.initial"] is False  # one evaluation: the final one
    untrained = len(m["untrained"].split(":")[1].split(",")) * m["untrained_size"]
    sampled = m["per_task"] * c["tasks"] * m["n"]
    per_run = steps * c["step_s"] + (c["eval_items"] + sampled + untrained) * c["sequence_s"]
    base = (2 * c["eval_items"] + sampled + untrained) * c["sequence_s"]  # greedy held-out and format only, once
    expected = (15 * per_run / c["jobs"] + base) / 3600
    assert _hours(r.stderr) == pytest.approx(expected, abs=1 / 60)
    assert expected <= 3.0  # the budget
    # the 42-run design stays reachable
    g = cli("ablate", "--study", "anchors", "--preset", "smol", "--generic", "--dry-run", EMAPG_HOME=str(tmp_path / "home"))
    assert g.returncode == 0 and "42 runs" in g.stderr.splitlines() and len(g.stdout.strip().splitlines()) == 42


def test_untrained_must_name_reasoning_gym_tasks(tmp_path):
    """measure.untrained is refused when the study is read (exit 2, one line, no "Value error," prefix), not once the
    initial model's measurements have started; the committed design's value passes."""
    ok = {"untrained": "reasoning-gym:chain_sum,count_bits", "format_prefix": []}
    assert measures.Measures(**ok).untrained == ok["untrained"]
    for bad in ("toy", "reasoning-gym:", "reasoning-gym:gcd,,x", "reasoning-gym:gcd, x", "gcd"):
        with pytest.raises(ValueError, match="give reasoning-gym:TASK"):
            measures.Measures(**{**ok, "untrained": bad})
    study = tmp_path / "s.yaml"
    study.write_text("preset: toy\nvariants:\n  a: {}\n  b: {kl.estimator: k1}\nmeasure: {untrained: toy, format_prefix: []}\n")
    r = cli("ablate", "--study", str(study), "--out", str(tmp_path / "sweep"), "--dry-run", EMAPG_HOME=str(tmp_path / "home"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: study {study}: measure.untrained: give reasoning-gym:TASK") and "not 'toy'" in r.stderr
    assert not (tmp_path / "sweep").exists()


def test_aggregate_only_rebuilds_the_committed_study(tmp_path):
    """The committed folder holds results only (no weights); `--aggregate-only` writes every table and plot again,
    and its numbers are the files' (the best constant from the benches' gold answers, recomputed here)."""
    out = tmp_path / "study"
    shutil.copytree(FIXTURE, out)
    assert not list(out.rglob("*.safetensors")) and not list(out.rglob("final"))
    r = cli("ablate", "--study", "anchors", "--aggregate-only", "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for name in ("anchors.md", "anchors.json", "anchors_accuracy.png", "anchors_kl_accuracy.png", "anchors_gain_forgetting.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 1000, name
    md = (out / "anchors.md").read_text()
    assert all(h in md for h in ("## (d) The initial model", "## (e) What each rule kept", "## (f) Per trained task"))
    report = json.loads((out / "anchors.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["done"] * 6
    golds: dict[str, list[str]] = {}
    for line in (out / "measure" / "benches" / "untrained" / "data.jsonl").read_text().splitlines():
        row = json.loads(line)
        golds.setdefault(row["id"].rsplit("-", 2)[0], []).append(row["answers"][0])
    for task, answers in golds.items():
        top = max(answers.count(a) for a in answers)
        assert report["base"]["best_constant"]["untrained"][task]["accuracy"] == pytest.approx(top / len(answers))
    # every run's measurements were read: pass@n over the 2 trained tasks of the fixture's sampled evaluations
    assert all(r["measured"] is not None and set(r["measured"]["tasks"]) == {"gcd", "letter_counting"} for r in report["runs"])
    assert report["curve_metric"] == "reward/mean"  # the runs evaluate only at the end: the curve is each step's share solved


def test_a_trained_run_without_measurements_is_not_complete(tmp_path):
    """A study interrupted between a run's training and its measurements measures it on the next invocation (the
    run is trained, not complete) and never trains it again."""
    from emapg_cli.ablate.runner import is_complete, is_finished, run_dir
    from emapg_cli.ablate.study import read_sweep
    from emapg_cli.ablate.aggregate import read_plan

    out = tmp_path / "study"
    shutil.copytree(FIXTURE, out)
    sweep = read_sweep(out)
    spec = read_plan(out, sweep)[0]
    assert is_complete(sweep, out, spec)
    (run_dir(out, spec) / measures.MEASURE_DIR / measures.DONE).unlink()
    assert is_finished(out, spec) and not is_complete(sweep, out, spec)


def test_eval_initial_false_skips_the_step_0_evaluation(tmp_path, tiny_qwen2):
    """eval.initial=false: no evaluation before the first step (the study measures the initial model once), the
    final one still runs; summary.json's initial accuracy is null."""
    from train_helpers import run, tiny_overrides, train_cmd, write_dataset

    data = write_dataset(tmp_path / "d.jsonl")
    out = tmp_path / "run"
    r = run(train_cmd(*tiny_overrides(tiny_qwen2, data, steps=1, **{"eval.initial": "false", "eval.anchor_every": 0}),
                      "--out", str(out)))
    assert r.returncode == 0, r.stderr[-2000:]
    evals = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if "eval/accuracy" in json.loads(x)]
    assert evals == [1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_accuracy_initial"] is None and summary["eval_accuracy_final"] is not None
    # the per-item rows keep what was answered (distinct answers across items are counted from them)
    rows = [json.loads(x) for x in (out / "evals" / "step_1.jsonl").read_text().splitlines()]
    assert rows and all(isinstance(r["responses"], list) and len(r["responses"]) == len(r["correct"]) for r in rows)


@pytest.mark.slow
def test_a_measured_study_end_to_end(tmp_path, tiny_qwen2):
    """What produced tests/fixtures/anchors-mini: 3 rules x 2 seeds on the tiny model over reasoning-gym rows, the
    initial model measured once, every run measured and its weights deleted; a second invocation does nothing."""
    home = tmp_path / "home"
    data = tmp_path / "data"
    r = cli("prepare", "reasoning-gym:gcd,letter_counting", "--size", "6", "--seed", "1", "--out", str(data), EMAPG_HOME=str(home))
    assert r.returncode == 0, r.stderr
    preset = tmp_path / "preset.yaml"
    turns = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "<answer>A</answer>"}]
    preset.write_text(yaml.safe_dump({
        "name": "mini", "model": {"path": str(tiny_qwen2), "dtype": "float32"},
        "data": {"train": str(data / "data.jsonl"), "eval": str(data / "data.jsonl"), "max_prompt_tokens": 256, "chat_prefix": turns},
        "rollout": {"engine": "hf", "prompts_per_step": 2, "n": 2, "max_new_tokens": 4, "temperature": 0.7, "reward": "reasoning-gym"},
        "reward": {"credit": "solved"}, "optim": {"lr": 1e-4},
        "train": {"steps": 2, "seed": 0, "mini_batch_prompts": 2, "micro_batch_size": 4},
        "kl": {"estimator": "topk", "direction": "reverse", "k": 4, "coef": 0.01}, "ema": {"decay": 0.9, "update_period": 1},
        "eval": {"every": 0, "initial": False, "n": 1, "temperature": 0.0, "max_new_tokens": 4, "initial_kl_every": 1}}))
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump({
        "preset": str(preset), "seeds": 2,
        "variants": {"none": {"kl.coef": 0.0}, "fixed": {"anchor.rule": "fixed"}, "ema": {"anchor.rule": "ema"}},
        "analysis": {"kind": "anchors", "baseline": "fixed"},
        "measure": {"per_task": 2, "n": 2, "untrained": "reasoning-gym:chain_sum,count_bits", "untrained_size": 3,
                    "untrained_config": {"count_bits": {"min_n": 1, "max_n": 16}}, "format_prefix": turns * 2},
        "cost": {"jobs": 2, "step_s": 1.5, "sequence_s": 0.1, "eval_items": 12, "tasks": 2}}))
    out = tmp_path / "sw"
    r = cli("ablate", "--study", str(study), "--out", str(out), timeout=1200, EMAPG_HOME=str(home))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "runs: 6 done" in r.stdout and not list(out.rglob("*.safetensors"))
    assert (out / "measure" / "base" / measures.DONE).is_file() and (out / "anchors_gain_forgetting.png").is_file()
    again = cli("ablate", "--study", str(study), "--out", str(out), timeout=300, EMAPG_HOME=str(home))
    assert "0 done, 6 finished before, 0 failed" in again.stdout


def test_heldout_kl_against_torch_distributions(tmp_path, tiny_qwen2):
    """measures.heldout_kl: 0 for the initial model against itself; for a perturbed copy, the per-token mean of
    torch.distributions' KL(Categorical(policy) || Categorical(initial)) at the response positions, computed here."""
    import torch
    from torch.distributions import Categorical, kl_divergence

    from emapg_cli.models.loading import load_causal_lm, load_tokenizer
    from emapg_cli.models.prompts import render_prompt

    policy = tmp_path / "policy"
    model = load_causal_lm(str(tiny_qwen2), "float32")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(policy)
    load_tokenizer(str(tiny_qwen2)).save_pretrained(policy)
    bench = tmp_path / "b.jsonl"
    bench.write_text("".join(json.dumps({"id": f"gcd-1-{i}", "question": f"{i}+{i}?"}) + "\n" for i in range(3)))
    sampled = tmp_path / "sampled"
    sampled.mkdir()
    (sampled / "results.jsonl").write_text("".join(json.dumps({"id": f"gcd-1-{i}", "responses": [f"<answer>{2 * i}</answer>", "x"],
                                                                "correct": [True, False]}) + "\n" for i in range(3)))
    prefix = [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "<answer>A</answer>"}]
    assert measures.heldout_kl(str(tiny_qwen2), str(tiny_qwen2), sampled, bench, prefix)["kl"] == 0.0
    got = measures.heldout_kl(str(policy), str(tiny_qwen2), sampled, bench, prefix)
    tok, pi, pi0 = load_tokenizer(str(tiny_qwen2)), load_causal_lm(str(policy), "float32"), load_causal_lm(str(tiny_qwen2), "float32")
    kls = []
    with torch.no_grad():
        for i in range(3):
            prompt = render_prompt(tok, f"{i}+{i}?", prefix)
            resp = tok(f"<answer>{2 * i}</answer>", add_special_tokens=False)["input_ids"]
            ids = torch.tensor([prompt + resp])
            a, b = pi(ids).logits[0, len(prompt) - 1:-1], pi0(ids).logits[0, len(prompt) - 1:-1]
            kls += kl_divergence(Categorical(logits=a), Categorical(logits=b)).tolist()
    assert got["tokens"] == len(kls) and got["responses"] == 3
    assert got["kl"] == pytest.approx(sum(kls) / len(kls), rel=1e-4) and got["kl"] > 0


def test_the_committed_real_study_rebuilds(tmp_path):
    """docs/evidence/anchors-smol (the study on SmolLM2-135M, results only): `--aggregate-only` on a copy rebuilds
    anchors.md and the plots from its files alone, with every finished run counted."""
    real = Path(__file__).parents[1] / "docs" / "evidence" / "anchors-smol"
    if not (real / "study.yaml").is_file():
        pytest.skip("the real study folder is not in this checkout")
    out = tmp_path / "study"
    shutil.copytree(real, out, ignore=shutil.ignore_patterns("final", "checkpoints", ".emapg.lock"))
    r = cli("ablate", "--study", "anchors", "--preset", "smol", "--aggregate-only", "--out", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads((out / "anchors.json").read_text())
    done = [x for x in report["runs"] if x["status"] == "done"]
    assert all(x["measured"] is not None for x in done)
    assert (out / "anchors_accuracy.png").is_file() and (out / "anchors_gain_forgetting.png").is_file()
    assert len(done) == 15  # the study ran to the end: 5 arms x 3 seeds
    # the committed tables are what the committed files give (docs/evidence.md quotes them)
    assert (out / "anchors.md").read_text() == (real / "anchors.md").read_text()
    assert json.loads((out / "anchors.json").read_text()) == json.loads((real / "anchors.json").read_text())
