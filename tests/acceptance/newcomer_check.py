"""The first hour, scripted: what a newcomer does with the README on a fresh CPU machine.

fresh clone -> fresh virtual environment -> the README's install lines -> `emapg prepare --preset toy
&& emapg train --preset toy` -> `emapg eval --bench toy --model <run>/final/policy` -> `emapg plot <run>`,
each step timed, in a fresh EMAPG_HOME; prints a table of wall times and the accuracies.

    python tests/acceptance/newcomer_check.py                                   # the README's lines as they are
    python tests/acceptance/newcomer_check.py --torch-install "pip install torch==2.13.0"   # a torch wheel you already have
    python tests/acceptance/newcomer_check.py --train-args "--set train.steps=10"           # a quick smoke run

Needs git, python3 with venv, and network access to PyPI (and to the PyPI torch index the torch line
names) unless the packages are cached. Everything is written under --workdir (default: a new temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The README's Quick start install line for torch (tests/test_first_hour.py checks the README has it).
README_TORCH = "pip install torch --index-url https://download.pytorch.org/whl/cpu"
README_INSTALL = "pip install ."
README_RUN = "emapg prepare --preset toy && emapg train --preset toy"
EVAL_ARGS = "--max-tokens 14"  # the toy's answers are at most 12 tokens; the paper's default (28000) is for maths


def step(name: str, command: str, cwd: Path, env: dict[str, str], log: Path, rows: list) -> None:
    """Run `command` in bash (the venv activated), log its output, record its wall time; stop on failure."""
    print(f"--> {name}: {command}", flush=True)
    start = time.perf_counter()
    with log.open("a") as f:
        f.write(f"\n$ {command}\n")
        f.flush()
        rc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - start
    rows.append((name, seconds, rc))
    print(f"    {'ok' if rc == 0 else f'FAILED (exit {rc}), see {log}'} in {seconds:.0f} s", flush=True)
    if rc != 0:
        report(rows, {})
        sys.exit(rc)


def report(rows: list, numbers: dict) -> None:
    print("\n| step | wall time (s) | exit |\n|---|---:|---:|")
    for name, seconds, rc in rows:
        print(f"| {name} | {seconds:.0f} | {rc} |")
    for key, value in numbers.items():
        print(f"{key}: {value}")


def main() -> None:
    here = Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=str(here), help="What to clone (a URL or a local repository; default: this checkout).")
    parser.add_argument("--workdir", type=Path, default=None, help="Empty folder for the clone, venv, EMAPG_HOME and runs (default: a new temp folder).")
    parser.add_argument("--torch-install", default=README_TORCH, help=f"The torch install line (default, the README's: {README_TORCH!r}).")
    parser.add_argument("--train-args", default="", help="Extra arguments for `emapg train` (e.g. '--set train.steps=10' for a smoke run).")
    parser.add_argument("--eval-args", default=EVAL_ARGS, help=f"Extra arguments for `emapg eval` (default {EVAL_ARGS!r}).")
    args = parser.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="emapg-newcomer-"))
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        sys.exit(f"{work} is not empty")
    log = work / "log.txt"
    clone, venv, home = work / "emapg", work / "venv", work / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "EMAPG_HOME")}
    env.update(EMAPG_HOME=str(home), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv))
    print(f"workdir {work} (log: {log})")
    rows: list = []
    step("git clone", f"git clone --quiet {shlex.quote(args.repo)} {shlex.quote(str(clone))}", work, env, log, rows)
    step("venv", f"{shlex.quote(sys.executable)} -m venv {shlex.quote(str(venv))}", work, env, log, rows)
    step("install torch", args.torch_install, clone, env, log, rows)
    step("install emapg", README_INSTALL, clone, env, log, rows)
    step("emapg --help", "emapg --help > /dev/null", clone, env, log, rows)
    prepare, train = README_RUN.split(" && ")
    step("prepare toy", prepare, clone, env, log, rows)
    step("train toy", f"{train} {args.train_args}".strip(), clone, env, log, rows)
    runs = sorted((clone / "runs").glob("toy-[0-9]*"))  # runs/toy-<timestamp>, not runs/toy-search-* or toy-tools-*
    if len(runs) != 1:
        sys.exit(f"expected one run folder under {clone / 'runs'}, found {runs}")
    run = runs[0].relative_to(clone)
    step("eval toy", f"emapg eval --bench toy --model {run}/final/policy {args.eval_args}".strip(), clone, env, log, rows)
    step("plot", f"emapg plot {run}", clone, env, log, rows)

    manifest = json.loads((home / "toy" / "manifest.json").read_text())
    summary = json.loads((clone / run / "summary.json").read_text())
    evals = sorted((clone / "runs" / "eval").glob("toy-[0-9]*"))  # runs/eval/<run name>: the run name says the bench
    ev = json.loads((evals[0] / "summary.json").read_text()) if evals else {}
    report(rows, {
        "warm start": f"{manifest['sft_steps']} steps, greedy test accuracy {manifest['sft_test_accuracy']:.1%}",
        "train": f"{summary['steps']} steps, greedy test accuracy {summary['eval_accuracy_initial']:.1%} -> "
                 f"{summary['eval_accuracy_final']:.1%} ({100 * (summary['eval_accuracy_final'] - summary['eval_accuracy_initial']):+.1f} points)",
        "eval": (f"{evals[0].relative_to(clone)}: n={ev.get('n')}, pass@1 {ev.get('pass@1', float('nan')):.1%}, "
                 f"maj@n {ev.get('maj@n', float('nan')):.1%}") if ev else "no eval folder",
        "plots": ", ".join(sorted(p.name for p in (clone / "plots").glob("*.png"))),  # `emapg plot` writes ./plots
        # what the documented commands left in the clone that git would list (.gitignore covers .venv, runs, plots)
        "untracked": subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=clone,
                                    capture_output=True, text=True).stdout.strip().replace("\n", "; ") or "none",
    })


if __name__ == "__main__":
    main()
