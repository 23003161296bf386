"""The run folder of a launch over several machines must be one folder that every rank sees.

Only the main process (global rank 0) writes the run's files (config, metrics, checkpoints, final weights,
status.json), but every rank writes its own RNG state into each checkpoint (`rng_rank{r}.json`) and reads the
checkpoint back on `--resume`. With `--out` on a node-local disk the other machines would not see the folder:
the first checkpoint, maybe hours in, would crash them. `check_shared_run_folder` finds this out once the main
process has written `config.yaml`, before the first step, and every rank stops with the same one-line error.

A network file system may show a new file to the other machines only after a delay (NFS caches a directory's
attributes, and a name it found missing, for `acdirmin`..`acdirmax` = 30..60 s by default), so a rank that
does not see the file yet looks again until `EMAPG_SHARED_FOLDER_WAIT_S` seconds (default 60) have passed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

from emapg_cli.errors import UserError

#: Environment variable: how long a rank waits to see the main process's run files (seconds, >= 0).
WAIT_ENV = "EMAPG_SHARED_FOLDER_WAIT_S"
DEFAULT_WAIT_S = 60.0


def wait_seconds() -> float:
    """EMAPG_SHARED_FOLDER_WAIT_S as seconds (default 60); anything but a number >= 0 is a UserError."""
    raw = os.environ.get(WAIT_ENV, "")
    if raw == "":
        return DEFAULT_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also nan
        raise UserError(f"{WAIT_ENV} must be a number of seconds >= 0, not '{raw}'")
    return value


def sees_file(path: Path, wait_s: float, poll_s: float = 0.5) -> bool:
    """Whether `path` exists, looking again every `poll_s` seconds for up to `wait_s` seconds. Each look lists the
    folder above it first: opening a directory makes a network file system client revalidate what it cached."""
    deadline = time.monotonic() + wait_s
    while True:
        for folder in (path.parent.parent, path.parent):
            try:
                os.listdir(folder)
            except OSError:
                pass
        if path.is_file():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def blind_ranks(missing: Sequence[int]) -> list[int]:
    """The ranks whose flag in `missing` (one 0/1 per rank, gathered in rank order) says they do not see the folder."""
    return [rank for rank, flag in enumerate(missing) if int(flag)]


def check_shared_run_folder(run_dir: Path, acc, wait_s: float | None = None) -> None:
    """Every rank of a launch sees the main process's `run_dir/config.yaml` (call it after the main process wrote it
    and a barrier), else every rank raises the same one-line UserError. One process: nothing to check.
    `acc`: the Accelerator (`num_processes`, `is_main_process`, `device`, `gather`); gathering is collective."""
    if acc.num_processes <= 1:
        return
    import torch

    wait_s = wait_seconds() if wait_s is None else wait_s
    seen = acc.is_main_process or sees_file(Path(run_dir) / "config.yaml", wait_s)
    missing = acc.gather(torch.tensor([0 if seen else 1], device=acc.device))  # [num_processes]
    blind = blind_ranks(missing.tolist())
    if blind:
        ranks = ", ".join(str(r) for r in blind)
        raise UserError(f"rank{'s' if len(blind) > 1 else ''} {ranks} cannot see the run folder {run_dir} that rank 0 "
                        f"writes (waited {wait_s:g} s): a launch over several machines needs --out on a file system "
                        "that every machine mounts at the same path")
