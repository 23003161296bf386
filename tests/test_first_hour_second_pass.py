"""Issue 20, the first hour: plain progress lines off a terminal, eval options as config overrides, prompts that
leave no room for a turn, a hub id that cannot load, eval's torch threads."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn

from emapg_cli.errors import UserError


def _bar(console, **kw):
    from emapg_cli.progress import Progress

    return Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                    console=console, **kw)


def test_plain_lines_off_a_terminal(monkeypatch):
    monkeypatch.setenv("EMAPG_PROGRESS_SECONDS", "0")
    out = io.StringIO()
    with _bar(Console(file=out, force_terminal=False, width=30)) as bar:
        task = bar.add_task("t", total=3, info="")
        for i in range(3):
            bar.update(task, advance=1, info=f"reward {i / 4:.2f}")
    # one line per update (interval 0), whole although wider than the 30 columns; the bar itself is left out
    assert out.getvalue().splitlines() == ["train  1/3  reward 0.00", "train  2/3  reward 0.25", "train  3/3  reward 0.50"]


def test_plain_lines_keep_their_interval(monkeypatch):
    monkeypatch.setenv("EMAPG_PROGRESS_SECONDS", "3600")
    out = io.StringIO()
    with _bar(Console(file=out, force_terminal=False)) as bar:
        task = bar.add_task("t", total=50, info="")
        for _ in range(50):
            bar.advance(task)
    assert out.getvalue().splitlines() == ["train  50/50"]  # none within the hour, then the last state once


def test_a_terminal_gets_the_bar_not_lines(monkeypatch):
    monkeypatch.setenv("EMAPG_PROGRESS_SECONDS", "0")
    out = io.StringIO()
    with _bar(Console(file=out, force_terminal=True, width=80)) as bar:
        bar.update(bar.add_task("t", total=2, info=""), advance=2)
    assert not bar.plain and "train  2/2" not in out.getvalue()


def test_eval_flags_become_config_overrides(tmp_path):
    from emapg_cli.cli.eval_cmd import _flag_overrides

    params = {"max_context_tokens": 2, "max_tokens": 1, "topk": 3, "retriever": f"bm25:{tmp_path}", "max_turns": 0,
              "backend": "auto", "env": None, "n": 5}
    got = _flag_overrides(params, {"max_context_tokens", "max_tokens", "retriever", "max_turns", "backend"})
    assert sorted(got) == sorted(["eval.max_new_tokens=1", "search.max_context_tokens=2", "rollout.max_context_tokens=2",
                   "search.enabled=true", 'search.retriever="bm25"', f'search.index="{tmp_path}"', "search.max_turns=0"])  # backend auto: the config's engine


def test_prompts_must_leave_room_for_a_turn(capsys):
    from emapg_cli.evaluation.runner import check_prompts_fit

    assert check_prompts_fit([10, 20], 12, 32) == 0  # 20 + 12 = 32 <= 32: every prompt's first turn fits
    assert capsys.readouterr().err == ""
    assert check_prompts_fit([10, 21], 12, 32) == 1  # 21 + 12 = 33 > 32, 10 + 12 = 22 fits: one warning, no refusal
    assert capsys.readouterr().err.strip() == ("warning: 1 of 2 prompts do not fit --max-context-tokens (32) with "
                                               "--max-tokens (12, per turn): they get no turn and score 0")
    with pytest.raises(UserError, match=r"none of the 2 prompts fits \(the shortest has 21 tokens\)"):
        check_prompts_fit([21, 25], 12, 32)  # 21 + 12 = 33 > 32: no prompt fits


def test_offline_hub_id_fails_fast_in_one_line(monkeypatch, tmp_path):
    from emapg_cli.models.hub import check_model_source

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    t0 = time.monotonic()
    with pytest.raises(UserError, match="'org/not-cached' is not a local folder nor in the Hugging Face cache, and HF_HUB_OFFLINE is set"):
        check_model_source("org/not-cached")
    assert time.monotonic() - t0 < 5
    (tmp_path / "m").mkdir()
    with pytest.raises(UserError, match="no config.json"):  # a local folder is checked as a model folder (issue 32)
        check_model_source(str(tmp_path / "m"))
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama", "vocab_size": 8}')
    check_model_source(str(tmp_path / "m"))  # a local model folder: fine
    with pytest.raises(UserError, match="missing: no such model folder"):  # a missing local path: one line (issue 40)
        check_model_source(str(tmp_path / "missing"))


def test_unreachable_hub_is_named(monkeypatch, tmp_path):
    from emapg_cli.models import hub

    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setattr(hub, "in_cache", lambda repo_id: False)
    with pytest.raises(UserError, match=r"the hub \(127.0.0.1\) cannot be reached"):
        hub.check_model_source("org/model")


def test_eval_sets_threads_as_train_does(monkeypatch):
    torch = pytest.importorskip("torch")
    from emapg_cli.train.threads import set_torch_threads

    if torch.cuda.is_available():
        pytest.skip("CPU only")
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("EMAPG_TORCH_THREADS", "1")
    try:
        assert set_torch_threads(4) == ", 1 torch thread (EMAPG_TORCH_THREADS)"
        monkeypatch.delenv("EMAPG_TORCH_THREADS")
        assert set_torch_threads(2) == ", 2 torch threads (train.torch_threads)"
    finally:
        torch.set_num_threads(before)


def test_every_command_builds_its_bar_from_the_plain_line_progress():
    """No module but emapg_cli/progress.py takes rich's Progress itself: each long command (train, eval, ablate,
    kl-check, retriever index, prepare...) prints plain lines into a log. Parsed with ast, nothing imported."""
    import ast
    from pathlib import Path

    import emapg_cli

    root = Path(emapg_cli.__file__).parent
    found = []
    for path in root.rglob("*.py"):
        if path == root / "progress.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "rich.progress" and any(a.name == "Progress" for a in node.names):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "Progress" and getattr(node.value, "attr", None) == "progress":
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not found, f"rich's Progress used directly (no plain lines in a log): {found}"


def test_kl_check_prints_plain_progress_lines_into_a_log(monkeypatch):
    from typer.testing import CliRunner

    from emapg_cli.cli.app import app

    monkeypatch.setenv("EMAPG_PROGRESS_SECONDS", "0")
    result = CliRunner().invoke(app, ["kl-check", "--vocab", "50", "--positions", "2", "--samples", "64", "--batches", "4",
                                      "--estimators", "k1,k3", "--directions", "reverse", "--k", "1"])
    assert result.exit_code == 0, result.output
    assert "measuring estimators  100%" in result.output
