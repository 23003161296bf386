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
    # 2 samples x 28,000 tokens = 56,000 tokens per item at most
    assert "at most 2 x 28,000 = 56,000 generated tokens per item" in first and "--preset smol" in first, first
    assert any(line.startswith("eval ") and "1/1" in line for line in r.stdout.splitlines()[1:]), r.stdout
