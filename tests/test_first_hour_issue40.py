"""Issue 40, item 9: the first hour tried as a new user would (a fresh clone, the README and docs/smol.md literally,
a loaded 2-core machine): what `eval`, `train`, the plots and the docs tell a newcomer."""

from __future__ import annotations

import json
import os

import pytest

from train_helpers import write_dataset


def test_a_missing_local_model_path_is_one_line_before_any_work(cli, tmp_path):
    """`--model $EMAPG_HOME/smol/model` with EMAPG_HOME unset is `--model /smol/model`: it printed `eval ... 0/200`, then
    transformers' "Repo id must be in the form ..." (a hub error for a local path)."""
    bench = write_dataset(tmp_path / "bench.jsonl", n=3)
    env = {k: v for k, v in os.environ.items() if k != "EMAPG_HOME"}
    missing = tmp_path / "smol" / "model"  # an absolute path, as the shell expands $EMAPG_HOME/smol/model
    r = cli("eval", "--bench", str(bench), "--model", str(missing), "--out", str(tmp_path / "out"), env=env | {"EMAPG_HOME": ""})
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: --model {missing}: no such model folder") and "EMAPG_HOME is unset" in lines[0], lines
    assert "eval" not in r.stdout and not (tmp_path / "out").exists()


@pytest.mark.parametrize("path, local", [("/smol/model", True), ("./m", True), ("../m", True), ("~/m", True),
                                          ("a/b/c", True), ("org/name", False), ("gpt2", False), ("here/m", True)])
def test_which_model_references_are_local_paths(path, local, tmp_path, monkeypatch):
    from emapg_cli.models.hub import path_like

    (tmp_path / "here").mkdir()  # `here/m`: one slash, but after a folder that exists in the working folder
    monkeypatch.chdir(tmp_path)
    assert path_like(path) is local


def test_a_piped_progress_bar_prints_a_line_every_interval_even_when_nothing_advanced(monkeypatch):
    """`emapg eval ... | cat` on eval's defaults (28,000 tokens) had not finished its first chunk after 7.5 minutes and
    had printed nothing: a plain line came only with an update. Now the heartbeat prints one every interval."""
    import io
    import time

    from rich.console import Console
    from rich.progress import MofNCompleteColumn, TextColumn

    from emapg_cli.progress import Progress

    monkeypatch.setenv("EMAPG_PROGRESS_SECONDS", "0.2")
    out = io.StringIO()
    with Progress(TextColumn("eval"), MofNCompleteColumn(), console=Console(file=out, force_terminal=False)) as bar:
        bar.add_task("t", total=200)
        time.sleep(1.0)  # no update at all: 1.0 s / 0.2 s = 5 intervals, at least 2 lines even on a loaded machine
    lines = out.getvalue().splitlines()
    assert len(lines) >= 2 and set(lines) == {"eval  0/200"}, lines


def test_eval_without_a_preset_says_its_settings_and_cost_first_and_prints_progress_when_piped(cli, tiny_qwen2, tmp_path):
    """Eval's own defaults (n 32, 28,000 tokens) on a reasoning-gym bench ran for minutes without a word: the first line
    now says the settings and where they came from and the most it will generate per item."""
    pytest.importorskip("reasoning_gym")
    from emapg_cli.data.schema import write_jsonl
    from emapg_cli.datasets.reasoning_gym_data import generate

    bench = tmp_path / "bench.jsonl"
    write_jsonl(bench, (e.model_dump() for e in generate([("gcd", {"max_value": 50})], 1, 1)))
    r = cli("eval", "--bench", str(bench), "--model", str(tiny_qwen2), "--backend", "hf", "--n", "2", "--grader-workers",
            "1", "--reward", "reasoning-gym", "--limit", "1", "--out", str(tmp_path / "out"),
            env={"EMAPG_PROGRESS_SECONDS": "0", "OMP_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    first = r.stdout.splitlines()[0]
    assert first.startswith("eval settings from the command line: bench ") and "n 2 (command line)" in first, first
    assert "max tokens 28000 (eval's default)" in first, first
    # 2 samples x 28,000 tokens = 56,000 tokens per item at most; --limit 1: 1 x 56,000 = 56,000 in all
    assert "at most 2 x 28,000 = 56,000 generated tokens per item, 56,000 for the 1 item" in first, first
    assert "--preset smol" in first, first
    assert any(line.startswith("eval ") and "1/1" in line for line in r.stdout.splitlines()[1:]), r.stdout


def test_the_training_accuracy_panel_is_in_percent_as_every_printout(tmp_path, monkeypatch):
    """eval_accuracy.png drew 0-1 while the progress line, the summary and the eval plots say %."""
    from emapg_cli.plots import train as plots

    figures = []
    monkeypatch.setattr(plots, "save", lambda fig, path: figures.append(fig) or path)
    rows = [{"step": s, "reward/mean": 0.1 * s, "eval/accuracy": a} for s, a in ((0, 0.125), (5, 0.36))]
    plots.plot_runs([("smol", rows)], tmp_path)
    ax = figures[0].axes[0]  # eval_accuracy.png: the first panel
    assert "(%)" in ax.get_title()
    assert list(ax.get_lines()[0].get_ydata()) == [12.5, 36.0]  # 0.125 and 0.36, x 100


def test_kl_check_panel_c_draws_identical_estimators_as_one_line_with_one_entry():
    """Panel (c) drew topk and topk_paper's equal variances on top of each other: 6 legend entries, about 2 lines."""
    from types import SimpleNamespace as NS

    from emapg_cli.klcheck.plot import variance_panel
    from emapg_cli.plots.common import pyplot

    def row(name, direction, k, var):
        return NS(spec=NS(name=name, direction=direction, k=k), grad_variance=var)

    rows = [row(name, d, k, v * (3.0 if name == "topk_mass" else 1.0)) for name in ("topk", "topk_paper", "topk_mass")
            for d, v0 in (("reverse", 1.0), ("forward", 2.0)) for k, v in ((4, v0), (16, v0 / 4))]
    fig, ax = pyplot().subplots()
    variance_panel(ax, rows)
    labels = sorted(line.get_label() for line in ax.get_lines())
    # topk and topk_paper agree in both directions (one line each); topk_mass (x 3) is its own: 4 lines, not 6
    assert labels == ["topk = topk_paper (forward)", "topk = topk_paper (reverse)", "topk_mass (forward)", "topk_mass (reverse)"]
    pyplot().close(fig)


def test_moving_data_train_without_data_eval_is_one_warning_line(cli, emapg_home):
    """`train --preset smol --set data.train=reasoning-gym:chain_sum` evaluated on the preset's gcd/letter_counting set
    and reported its gain there, without a word."""
    r = cli("train", "--preset", "smol", "--set", "data.train=reasoning-gym:chain_sum", "--dry-run")
    warnings = [x for x in r.stdout.splitlines() if x.startswith("warning: --set data.train")]
    assert r.returncode == 0 and len(warnings) == 1, r.stdout + r.stderr
    assert "leaves data.eval at $EMAPG_HOME/smol/test.jsonl" in warnings[0]
    both = cli("train", "--preset", "smol", "--set", "data.train=reasoning-gym:chain_sum", "--set", "data.eval=x.jsonl",
               "--dry-run")
    assert "warning: --set data.train" not in both.stdout  # the user chose both: nothing to say


def test_the_launch_line_and_the_closing_table_say_which_set_is_evaluated(monkeypatch, tmp_path):
    from emapg_cli.config import load_config
    from emapg_cli.train.progress import config_line, eval_sets, summary_rows

    monkeypatch.setenv("EMAPG_HOME", str(tmp_path))
    cfg = load_config("smol")
    assert config_line(cfg).endswith(f", evaluated on {tmp_path}/smol/test.jsonl")
    rows = dict(summary_rows({"eval_accuracy_initial": 0.125, "eval_accuracy_final": 0.255}, "runs/r",
                             evaluated=eval_sets(cfg)))
    # 25.5 - 12.5 = +13.0 points
    assert rows["eval accuracy"] == f"12.5% -> 25.5% (+13.0 points), evaluated on {tmp_path}/smol/test.jsonl"
