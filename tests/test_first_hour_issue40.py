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
