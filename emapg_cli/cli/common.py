"""Options shared by several commands (preset / config file / overrides) and the error wrapper."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console

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
    from emapg_cli.errors import UserError

    try:
        check_seconds(value)
    except ValueError as e:
        raise UserError(f"{option} {value:g}: {e}") from None

