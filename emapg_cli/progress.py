"""Progress bars that also work in a log: rich's bar on a terminal, a plain line at a steady interval otherwise.

Rich draws nothing while stdout is a pipe or a file (`emapg train ... | tee log`, CI) and prints at most one
line, cut to the width, when the bar stops. `Progress` here is rich's `Progress` with one difference: when its
console is not a terminal it draws no bar and prints one plain line per task, e.g.

    train  12/200  reward 0.410  kl 1.20e-03  850 tok/s  0:00:41  ETA 4:12

at most every `interval()` seconds (EMAPG_PROGRESS_SECONDS, default 30), and a last one when the bar stops. A line
comes every interval even when nothing advanced (a first chunk of long generations): a thread prints the current
state, its elapsed time grown, so a log never falls silent for longer than the interval.
Every command builds its bar from this class, so the rule lives in one place. rich only; no torch.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

import rich.progress
from rich.console import Console
from rich.text import Text

#: Seconds between two plain progress lines when the output is not a terminal.
DEFAULT_INTERVAL_S = 30.0


def interval() -> float:
    """EMAPG_PROGRESS_SECONDS (>= 0; 0 prints a line at every update), else DEFAULT_INTERVAL_S."""
    try:
        value = float(os.environ.get("EMAPG_PROGRESS_SECONDS", DEFAULT_INTERVAL_S))
    except ValueError:
        return DEFAULT_INTERVAL_S
    return value if value >= 0 else DEFAULT_INTERVAL_S


class Progress(rich.progress.Progress):
    """rich.progress.Progress; on a console that is not a terminal, plain lines instead of the live bar (module doc)."""

    def __init__(self, *columns: Any, console: Optional[Console] = None, disable: bool = False, **kwargs: Any):
        console = console or rich.get_console()
        self.plain = not disable and not console.is_terminal and not console.is_jupyter
        super().__init__(*columns, console=console, disable=disable or self.plain, **kwargs)
        self._every, self._printed_at, self._dirty = interval(), time.monotonic(), False
        self._quiet: Optional[threading.Event] = None  # set to stop the heartbeat thread (plain lines only)

    def line(self, task: rich.progress.Task) -> str:
        """The task's columns as text, the drawn ones (bar, spinner) left out."""
        parts = []
        for column in self.columns:
            if isinstance(column, str):
                column = rich.progress.TextColumn(column)
            if isinstance(column, (rich.progress.BarColumn, rich.progress.SpinnerColumn)):
                continue
            rendered = column(task)
            text = rendered.plain if isinstance(rendered, Text) else str(rendered)
            if text.strip():
                parts.append(text.strip())
        return "  ".join(parts)

    def _emit(self) -> None:
        for task in self.tasks:
            if task.visible:
                self.console.print(self.line(task), markup=False, highlight=False, soft_wrap=True)
        self._printed_at, self._dirty = time.monotonic(), False

    def _tick(self) -> None:
        if self.plain:
            with self._lock:  # the heartbeat thread prints too
                self._dirty = True
                if time.monotonic() - self._printed_at >= self._every:
                    self._emit()

    def update(self, task_id: rich.progress.TaskID, **kwargs: Any) -> None:  # type: ignore[override]
        super().update(task_id, **kwargs)
        self._tick()

    def advance(self, task_id: rich.progress.TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._tick()

    def start(self) -> None:
        super().start()
        if self.plain and self._every > 0 and self._quiet is None:
            self._quiet = threading.Event()
            threading.Thread(target=self._heartbeat, args=(self._quiet,), name="emapg-progress", daemon=True).start()

    def _heartbeat(self, quiet: threading.Event) -> None:
        """A line whenever `interval()` passed since the last one, advanced or not (module doc)."""
        while not quiet.wait(max(0.01, self._every - (time.monotonic() - self._printed_at))):
            with self._lock:
                if time.monotonic() - self._printed_at >= self._every:
                    self._emit()

    def stop(self) -> None:
        if self._quiet is not None:
            self._quiet.set()
            self._quiet = None
        super().stop()
        if self.plain and self._dirty:  # the last state, once
            self._emit()
