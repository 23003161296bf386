"""Run a sweep: each run is an `emapg train` subprocess in its own directory, several at once.

Layout of the output folder (`--out`):

    study.yaml                       the resolved sweep
    runs/<config_id>/seed<N>/        the trainer's run directory (`--out` of `emapg train`)
    runs/<config_id>/seed<N>.log     the run's stdout and stderr
    runs/<config_id>/seed<N>.status.json   {"status": running|done|failed|interrupted, "returncode", "error", ...}

Resumable: a run whose directory holds `summary.json` (the trainer writes it last) is finished
and skipped; any other run (never started, failed, interrupted) is started again, from its latest
checkpoint (`emapg train --resume`) when it left one. A finished or checkpointed run is reused only
when its `config.yaml` equals the run's full resolved config now (`check_reuse`); otherwise the
sweep refuses before writing anything, so results of two configurations are never mixed.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from emapg_cli.ablate.grid import RunSpec
from emapg_cli.ablate.measures import is_measured, measure_run
from emapg_cli.ablate.study import Sweep
from emapg_cli.errors import UserError
from emapg_cli.paths import write_text_atomic

SUMMARY = "summary.json"
ERROR_TAIL_LINES = 30


@dataclass(frozen=True)
class RunResult:
    """What happened to one run in this invocation: `done`, `skipped` (finished before) or `failed`."""

    run_id: str
    status: str
    returncode: Optional[int] = None
    wall_time_s: float = 0.0
    error: str = ""


def run_dir(out: Path, spec: RunSpec) -> Path:
    return out / "runs" / spec.config_id / f"seed{spec.seed}"


def log_path(out: Path, spec: RunSpec) -> Path:
    return run_dir(out, spec).with_name(f"seed{spec.seed}.log")


def status_path(out: Path, spec: RunSpec) -> Path:
    return run_dir(out, spec).with_name(f"seed{spec.seed}.status.json")


def is_finished(out: Path, spec: RunSpec) -> bool:
    return (run_dir(out, spec) / SUMMARY).is_file()


def is_complete(sweep: Sweep, out: Path, spec: RunSpec) -> bool:
    """Trained, and measured when the study measures its runs (`measure:`)."""
    return is_finished(out, spec) and (sweep.measure is None or is_measured(run_dir(out, spec)))


def read_status(out: Path, spec: RunSpec) -> dict:
    """The run's status record ({} when it never started, or when the file is not a JSON object: a record this
    command did not write, which tells nothing)."""
    return read_record(status_path(out, spec)) or {}


def read_record(path: Path) -> Optional[dict]:
    """A JSON object a run left (a status record, summary.json); None when it is missing, unreadable, not UTF-8, not
    JSON or not an object."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError):  # ValueError: UnicodeDecodeError, JSONDecodeError, 5000-digit ints
        return None
    return data if isinstance(data, dict) else None


def train_args(sweep: Sweep, spec: RunSpec, out: Path) -> list[str]:
    """The `train` arguments of one run (everything after the program name)."""
    return sweep.command("train", spec.overrides) + ["--out", str(run_dir(out, spec))]


def has_checkpoint(out: Path, spec: RunSpec) -> bool:
    """Whether an interrupted run left a complete checkpoint (and its config.yaml) to resume from."""
    rdir = run_dir(out, spec)
    ckpts = rdir / "checkpoints"
    return (rdir / "config.yaml").is_file() and ckpts.is_dir() and any((p / "state.json").is_file() for p in ckpts.glob("step_*"))


def launch_args(sweep: Sweep, spec: RunSpec, out: Path) -> list[str]:
    """What to run now: `train --resume DIR` when the run left a checkpoint, else the fresh run (after removing
    the folder a previous attempt left without a checkpoint, so metrics start clean: only an `emapg train` folder,
    recognised by its marker, or an empty one; anything else in its place is a UserError and stays)."""
    from emapg_cli.outputs import marker_kind

    rdir = run_dir(out, spec)
    if has_checkpoint(out, spec):
        return ["train", "--resume", str(rdir)]
    if rdir.exists():
        if not rdir.is_dir() or rdir.is_symlink() or (any(rdir.iterdir()) and marker_kind(rdir) != "train"):
            raise UserError(f"{rdir} was not written by `emapg train`; move it away to run {spec.run_id} there")
        shutil.rmtree(rdir)
    return train_args(sweep, spec, out)


#: How a run on several processes starts (`--processes N`); `{processes}` is replaced, `train ...` follows.
MULTI_PROCESS_LAUNCHER = "accelerate launch --multi_gpu --num_processes {processes} -m emapg_cli"


def launcher(processes: int = 1, template: Optional[str] = None) -> list[str]:
    """The words before `train ...`: `emapg` for one process, else the launcher template
    (default MULTI_PROCESS_LAUNCHER) with `{processes}` filled in; UserError on a broken template."""
    if processes == 1 and template is None:
        return ["emapg"]
    try:
        words = shlex.split((template or MULTI_PROCESS_LAUNCHER).format(processes=processes))
    except (KeyError, IndexError, ValueError) as err:
        raise UserError(f"--launcher: cannot fill in the template ({err}); use {{processes}} for the process count") from None
    if not words:
        raise UserError("--launcher: empty template")
    return words


def shell_command(sweep: Sweep, spec: RunSpec, out: Path, prefix: Sequence[str] = ("emapg",), train_flags: Sequence[str] = ()) -> str:
    """The run as one portable shell line (`emapg train ...`, or the launcher's line), what `--dry-run` prints;
    `train_flags` (`--trust-code`) end it."""
    return shlex.join([*prefix, *train_args(sweep, spec, out), *train_flags])


def config_differences(expected: Any, found: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two config dumps (nested mappings compared key by key)."""
    if isinstance(expected, dict) and isinstance(found, dict):
        out = []
        for key in [*expected, *(k for k in found if k not in expected)]:
            out += config_differences(expected.get(key), found.get(key), f"{prefix}{key}.")
        return out
    return [] if expected == found else [prefix.rstrip(".")]


def check_reuse(sweep: Sweep, runs: list[RunSpec], out: Path) -> None:
    """UserError (one line naming the run and the differing keys) when a run folder that this sweep would
    reuse (finished, or resumed from its checkpoint) was made with another config than the run's now."""
    from emapg_cli.config.loading import load_config, validate
    from emapg_cli.datasets.rows import lookup
    from emapg_cli.fileio import read_yaml_mapping

    for spec in runs:
        if not (is_finished(out, spec) or has_checkpoint(out, spec)):
            continue  # a fresh start: launch_args clears what a previous attempt left
        path = run_dir(out, spec) / "config.yaml"
        hint = "use another --out, or delete that run folder to run it again"
        if not path.is_file():
            raise UserError(f"run {spec.run_id} in {out} has results but no config.yaml to compare with this sweep; {hint}")
        try:
            found = validate(read_yaml_mapping(path, "run config")).model_dump(mode="json")
        except UserError as e:
            raise UserError(f"run {spec.run_id} in {out}: {e}; {hint}") from None
        expected = load_config(sweep.preset, sweep.config, spec.overrides).model_dump(mode="json")
        diff = config_differences(expected, found)
        if diff:
            shown = ", ".join(f"{k}: {lookup(found, k)!r} there, {lookup(expected, k)!r} now" for k in diff[:5])
            more = f" and {len(diff) - 5} more" if len(diff) > 5 else ""
            raise UserError(f"run {spec.run_id} in {out} was made with another config ({shown}{more}); {hint}")


def _write_status(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(record, indent=2) + "\n")


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def auto_jobs(pending: int, processes: int) -> tuple[int, str]:
    """(runs at once, why) when `--jobs` is left out: on a CPU machine the cores idle now (`train.threads`: a short
    sample of /proc/stat), at most the runs still to do; one at a time when each run takes GPUs (`--processes` > 1)
    or the machine has a CUDA GPU (two runs would share its memory)."""
    if processes > 1:
        return 1, f"one at a time: each run takes {processes} processes"
    import torch

    if torch.cuda.is_available():
        return 1, "one at a time on a GPU machine (--jobs N to share it)"
    from emapg_cli.train.threads import auto_threads, available_cores, measure_busy

    cores = available_cores()
    free = auto_threads(len(cores), 1, measure_busy(cores)[0])
    return max(1, min(free, pending)), f"auto: {free} of {len(cores)} cores free"


def child_env(jobs: int) -> dict[str, str]:
    """The environment of each run: with several runs at once, split the cores between them
    (OMP/MKL threads = cores // jobs) unless the user already chose a thread count."""
    env = dict(os.environ)
    if jobs > 1 and "OMP_NUM_THREADS" not in env:
        threads = str(max(1, (os.cpu_count() or 1) // jobs))
        env["OMP_NUM_THREADS"] = threads
        env.setdefault("MKL_NUM_THREADS", threads)
    return env


class _Pool:
    """Starts runs as subprocesses and can stop all of them (Ctrl-C)."""

    def __init__(self, sweep: Sweep, out: Path, jobs: int, prefix: Sequence[str] = ("emapg",), train_flags: Sequence[str] = ()):
        self.sweep, self.out, self.env = sweep, out, child_env(jobs)
        self.prefix, self.train_flags = list(prefix), list(train_flags)
        self.procs: set[subprocess.Popen] = set()
        self.lock = threading.Lock()
        self.stopping = False

    def run(self, spec: RunSpec) -> RunResult:
        if is_finished(self.out, spec):  # trained before: only its measurements are left
            return self._measure(spec, RunResult(spec.run_id, "done"), read_status(self.out, spec) or {"run_id": spec.run_id})
        args = [*launch_args(self.sweep, spec, self.out), *self.train_flags]
        # `emapg` itself runs as this interpreter's module, so the sweep uses the emapg it was started with
        cmd = [sys.executable, "-m", "emapg_cli", *args] if self.prefix == ["emapg"] else [*self.prefix, *args]
        status, log = status_path(self.out, spec), log_path(self.out, spec)
        record = {"run_id": spec.run_id, "status": "running", "command": shlex.join([*self.prefix, *args]),
                  "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        _write_status(status, record)
        start = time.monotonic()
        with open(log, "w") as f:
            with self.lock:
                if self.stopping:
                    return RunResult(spec.run_id, "interrupted")
                try:
                    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
                except OSError as e:
                    proc = None
                    f.write(f"cannot start {cmd[0]}: {e}\n")
                else:
                    self.procs.add(proc)
            rc = proc.wait() if proc is not None else None
            with self.lock:
                self.procs.discard(proc)
        wall = time.monotonic() - start
        if self.stopping:
            record.update(status="interrupted", returncode=rc, wall_time_s=round(wall, 2))
            _write_status(status, record)
            return RunResult(spec.run_id, "interrupted", rc, wall)
        ok = rc == 0 and is_finished(self.out, spec)
        error = "" if ok else (_tail(log, ERROR_TAIL_LINES) or f"exit code {rc}")
        if rc == 0 and not ok:
            error = f"exit code 0 but no {SUMMARY} was written\n{error}"
        record.update(status="done" if ok else "failed", returncode=rc, wall_time_s=round(wall, 2), error=error,
                      finished_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        _write_status(status, record)
        return self._measure(spec, RunResult(spec.run_id, record["status"], rc, wall, error), record)

    def _measure(self, spec: RunSpec, result: RunResult, record: dict) -> RunResult:
        """The study's measurements of a trained run (`measure:`), timed into its status record; a failure fails the
        run (its training is kept: the next invocation measures it again)."""
        if self.sweep.measure is None or result.status != "done" or self.stopping:
            return result
        start = time.monotonic()
        try:
            measure_run(self.sweep, self.sweep.measure, self.out, run_dir(self.out, spec), log_path(self.out, spec), self.env)
        except UserError as e:
            record.update(status="failed", error=str(e))
            _write_status(status_path(self.out, spec), record)
            return RunResult(spec.run_id, "failed", result.returncode, result.wall_time_s, str(e))
        record["measure_wall_time_s"] = round(time.monotonic() - start, 2)
        _write_status(status_path(self.out, spec), record)
        return result

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            for proc in self.procs:
                proc.terminate()


def run_sweep(sweep: Sweep, runs: list[RunSpec], out: Path, jobs: int = 1, show_progress: bool = True,
              prefix: Sequence[str] = ("emapg",), train_flags: Sequence[str] = ()) -> list[RunResult]:
    """Run every unfinished run (at most `jobs` at once); failures are recorded and the sweep goes on.
    `train_flags` end each `train` command line (`--trust-code`, once ablate checked the sweep's plugins).

    Returns one RunResult per run, in the order of `runs`. Ctrl-C stops the running trainers; the
    interrupted runs are simply started again by the next invocation.
    """
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from emapg_cli.progress import Progress  # plain lines when the output is a log, not a terminal

    results: dict[str, RunResult] = {}
    todo = []
    for spec in runs:
        if is_complete(sweep, out, spec):
            results[spec.run_id] = RunResult(spec.run_id, "skipped")
        else:
            todo.append(spec)
    pool = _Pool(sweep, out, jobs, prefix, train_flags)
    failed = 0
    with Progress(
        TextColumn("[bold]ablate[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.description}"), disable=not show_progress,
    ) as progress:
        task = progress.add_task(f"{len(results)} finished before", total=len(runs), completed=len(results))
        executor = ThreadPoolExecutor(max_workers=max(1, jobs))
        try:
            futures = {executor.submit(pool.run, spec): spec for spec in todo}
            for fut in as_completed(futures):
                res = fut.result()
                results[res.run_id] = res
                failed += res.status == "failed"
                progress.update(task, advance=1, description=escape(f"last: {res.run_id} {res.status}" + (f" | {failed} failed" if failed else "")))
        except KeyboardInterrupt:
            pool.stop()
            executor.shutdown(wait=True, cancel_futures=True)
            raise
        executor.shutdown(wait=True)
    return [results[spec.run_id] for spec in runs]
