"""Options shared by several commands (preset / config file / overrides), a seconds option's check, a counting
progress bar and a JSON output file."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from emapg_cli.errors import UserError

# Rich squeezes tables to 80 columns when stdout is not a terminal (pipes, CI logs); give them room.
_wide = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 160
console = Console(width=_wide)
err_console = Console(stderr=True)

PresetOpt = Annotated[
    Optional[str],
    typer.Option("--preset", "-p", help="Preset name from the presets folder (e.g. olympiad, search-qa, toy) or a path to a YAML file."),
]
ConfigOpt = Annotated[
    Optional[str],
    typer.Option("--config", "-c", help="User YAML config file; its values override the preset's."),
]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Dotted override KEY=VALUE, typed by the config model (e.g. --set kl.k=64). Repeatable; wins over preset and file."),
]


def check_seconds_option(option: str, value: float) -> None:
    """A seconds option is at most bounds.MAX_SECONDS (one week, as every `*_s` config key): else one line naming
    it (checked here rather than with typer's max=, whose range would widen every --help's option column)."""
    from emapg_cli.bounds import check_seconds

    try:
        check_seconds(value)
    except ValueError as e:
        raise UserError(f"{option} {value:g}: {e}") from None



def counting_bar(label: str, *more_columns: Any):
    """A transient progress bar (`label`, the bar, done/total, elapsed time, `more_columns`; plain lines in a log:
    progress.py) and a factory `total -> advance(k)` for a row loop (total None: no length, the count still shows)."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from emapg_cli.progress import Progress

    label = escape(label).replace("{", "{{").replace("}", "}}")  # rich markup, then TextColumn's str.format
    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), *more_columns,
                   console=console, transient=True)

    def start(total: Optional[int]):
        task = bar.add_task(label, total=total)
        return lambda k: bar.advance(task, k)

    return bar, start


def write_json_file(path: Path, payload: Any) -> None:
    """`payload` as indented JSON in `path` (its folder made, written atomically); a failed write is one line."""
    import json

    from emapg_cli.paths import write_text_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(payload, indent=2) + "\n")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
