"""`<run>/status.json`: what a run is doing, or why it ended (docs/reliability.md "What a failed run keeps").

    {"status": "running" | "done" | "failed" | "stopped", "reason": "<one line>", "step": N, "updated": "<UTC time>"}

`step` is the last step whose metrics were logged (0: none yet). Written atomically (temp file + rename) by the
main process when the run has started (data, models and checkpoint loaded), when it finishes, when it fails (the one-line error as `reason`) and when it
is stopped (Ctrl-C, SIGTERM). SIGKILL cannot be caught: the file then still says "running" (a process that is
gone no longer holds the folder's lock, `outputs.claim_folder`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Callable, Iterator

from emapg_cli.errors import UserError
from emapg_cli.paths import write_text_atomic

STATUS_FILE = "status.json"


def write_status(run_dir: Path, status: str, reason: str, step: int) -> None:
    """Replace `run_dir/status.json` (atomically)."""
    row = {"status": status, "reason": reason, "step": int(step), "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_text_atomic(Path(run_dir) / STATUS_FILE, json.dumps(row, indent=2) + "\n")


def one_line(e: BaseException) -> str:
    """The error as the CLI prints it: a UserError's message, else `Type: first line`."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if isinstance(e, UserError) else f"{type(e).__name__}: {text}".rstrip(": ")


@contextlib.contextmanager
def tracked(run_dir: Path, step: Callable[[], int], enabled: bool = True) -> Iterator[Callable[[], None]]:
    """status.json around a run. Yields `start()`, which the trainer calls once the run has started (data, models
    and checkpoint loaded, metrics file open): "running" is written then. Until then nothing is written, so an
    input refused before training (a missing model, no intact checkpoint to resume) leaves the folder as it was.
    After it: "done", "failed" (the error's line) or "stopped" (a signal) when the block ends. SIGTERM is
    recorded, then delivered again with its default action (the process ends as it would have); Ctrl-C
    (KeyboardInterrupt) is recorded and re-raised. `enabled`: False on the processes that do not own the folder."""
    started = [False]

    def start() -> None:
        if enabled:
            write_status(run_dir, "running", "", step())
            started[0] = True

    if not enabled:
        yield start
        return

    def on_term(signum, frame):  # noqa: ARG001
        if started[0]:
            with contextlib.suppress(Exception):
                write_status(run_dir, "stopped", f"stopped by {signal.Signals(signum).name}", step())
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield start
    except KeyboardInterrupt:
        if started[0]:
            write_status(run_dir, "stopped", "stopped by SIGINT (Ctrl-C)", step())
        raise
    except BaseException as e:
        if started[0]:
            with contextlib.suppress(Exception):  # a full disk: the original error matters more
                write_status(run_dir, "failed", one_line(e), step())
        raise
    else:
        if started[0]:
            write_status(run_dir, "done", "", step())
    finally:
        signal.signal(signal.SIGTERM, previous)
