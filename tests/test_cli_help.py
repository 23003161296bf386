"""`emapg --help` and every `emapg CMD --help` are fast and import no heavy library.

Each help runs in a fresh subprocess that reports which heavy modules got imported and its own CPU
time. The bound is on CPU time (user + sys, the child's own `resource` usage): on an idle machine a
single-threaded help's wall time equals its CPU time, while on a machine shared by other jobs wall
time grows with the load (measured here: 0.3-0.45 s CPU, 1-2.6 s wall under a load of 4 on 2
cores). Headroom: the bound, 1.0 s, is about 2x the measured CPU time; the torch import alone that
this guards against costs ~2 s of CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "numpy", "matplotlib", "accelerate", "pandas", "scipy", "vllm")
CPU_BOUND_S = 1.0

_PROBE = """
import json, resource, sys
sys.argv = ["emapg", *json.loads(sys.argv[1]), "--help"]
code = None
from emapg_cli.cli.app import main
try:
    main()
except SystemExit as e:
    code = e.code
u = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"code": code, "cpu": u.ru_utime + u.ru_stime,
                  "heavy": sorted({m.split(".")[0] for m in sys.modules} & set(HEAVY))}), file=sys.stderr)
"""


def _commands() -> list[list[str]]:
    """Every command path of the app: [], ["train"], ["config"], ["config", "keys"], ..."""
    import typer

    from emapg_cli.cli.app import app

    paths: list[list[str]] = []

    def walk(cmd, prefix: list[str]) -> None:
        paths.append(prefix)
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, prefix + [name])

    walk(typer.main.get_command(app), [])
    return paths


def test_every_command_is_listed():
    names = {" ".join(p) for p in _commands()}
    # the registered commands, so the parametrised test below cannot silently test nothing
    assert {"", "prepare", "train", "eval", "ablate", "kl-check", "plot", "config", "config show", "config keys"} <= names


@pytest.mark.parametrize("command", _commands(), ids=lambda p: " ".join(p) or "emapg")
def test_help_is_fast_and_imports_nothing_heavy(command):
    probe = f"HEAVY = {HEAVY!r}\n" + _PROBE
    r = subprocess.run([sys.executable, "-c", probe, json.dumps(command)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "COLUMNS": "80"})
    report = json.loads(r.stderr.strip().splitlines()[-1])
    assert report["code"] in (0, None), r.stderr
    assert "Usage" in r.stdout and "--help" in r.stdout and "-h" in r.stdout
    # issue 32: read at 80 columns, a flag shows no type and no word is cut with an ellipsis
    assert "<bool>" not in r.stdout and "…" not in r.stdout, r.stdout
    assert report["heavy"] == [], f"`emapg {' '.join(command)} --help` imported {report['heavy']}"
    assert report["cpu"] <= CPU_BOUND_S, f"`emapg {' '.join(command)} --help` took {report['cpu']:.2f} s of CPU"


def test_help_paragraphs_are_one_line_each_for_the_terminal_to_wrap():
    # issue 32: Typer's rich help kept the docstring's own line breaks, so a sentence stopped where the source wrapped
    from emapg_cli.cli.help_format import reflow

    doc = """Measure each estimator's bias and variance
    by Monte Carlo.

    Second   paragraph,
    wrapped.

    \b
    kept
      as is"""
    assert reflow(doc) == ("Measure each estimator's bias and variance by Monte Carlo.\n\n"
                           "Second paragraph, wrapped.\n\n\b\nkept\n  as is")
    import typer

    from emapg_cli.cli.app import app
    from emapg_cli.cli.help_format import tidy

    root = tidy(typer.main.get_command(app))  # as `emapg` runs it (cli/app.py: main)
    assert root.commands["kl-check"].help.startswith("Measure each KL estimator's value bias, gradient bias (w.r.t. the "
                                                     "policy logits) and variance by Monte Carlo")
    helps = [c.help for c in root.commands.values()] + [c.help for c in root.commands["bench"].commands.values()]
    assert all("\n" not in p for h in helps if h for p in h.split("\n\n") if not p.startswith("\b"))


def test_a_bare_command_group_prints_its_help_once(cli_many):
    """Issue 40 (9): `emapg config` (and every group, `emapg` itself included) printed its help twice: rich prints it
    while click makes the no-arguments error, then main echoed `ctx.get_help()` again."""
    groups = [p for p in _commands() if getattr(_command_at(p), "commands", None)]
    assert {"", "config", "bench", "retriever", "rollout"} <= {" ".join(p) for p in groups}
    for path, r in zip(groups, cli_many(*[tuple(p) for p in groups])):
        assert r.returncode == 0 and r.stdout.count("Usage:") == 1, (path, r.stdout)


def _command_at(path: list[str]):
    import typer

    from emapg_cli.cli.app import app

    cmd = typer.main.get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return cmd
