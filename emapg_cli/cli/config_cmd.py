"""`emapg config show|keys`: print the resolved configuration or every key with its description."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from emapg_cli.cli.common import ConfigOpt, PresetOpt, SetOpt, console

if TYPE_CHECKING:  # pydantic loads only when a command runs, not for --help
    from pydantic import BaseModel

app = typer.Typer(help="Inspect configurations: resolve presets, files and overrides; list every key.", no_args_is_help=True)


@app.command("show")
def show(preset: PresetOpt = None, config: ConfigOpt = None, set_: SetOpt = None) -> None:
    """Print the resolved config as YAML (preset < --config file < --set overrides)."""
    from emapg_cli.config.loading import load_config, to_yaml

    typer.echo(to_yaml(load_config(preset, config, set_ or [])), nl=False)


def iter_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, Any]]:
    """(dotted key, description, default) for every leaf field of `model`."""
    from pydantic import BaseModel

    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(iter_keys(ann, f"{prefix}{name}."))
        else:
            rows.append((f"{prefix}{name}", field.description or "", field.get_default(call_default_factory=True)))
    return rows


@app.command("keys")
def keys() -> None:
    """List every config key with its default and description, and the available presets."""
    from rich.markup import escape
    from rich.table import Table

    from emapg_cli.config import Config, list_presets

    table = Table(title="emapg config keys")
    table.add_column("key", style="bold")
    table.add_column("default")
    table.add_column("description")
    for key, desc, default in iter_keys(Config):
        table.add_row(escape(key), escape(repr(default)), escape(desc))  # descriptions hold "[lo, hi]", "[chunk, V]"
    console.print(table)
    console.print(f"presets: {escape(', '.join(list_presets()))}")
