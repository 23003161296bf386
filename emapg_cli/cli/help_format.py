"""`--help` that reads at 80 columns: the command tree Typer builds, tidied once before it runs.

What Typer's rich help does that a reader trips on (issue 32): a flag's type column says `<bool>` (recent Typer
releases); a docstring's line breaks are kept inside its paragraphs, so a sentence stops mid-line where the source
wrapped it; and at 80 columns the type column (`<int range>`, `<str>`) leaves the descriptions so narrow that Rich
cuts their longer words with an ellipsis. `tidy` gives flags and options of a plain type (text, path, number, list of
text: the description says what to give) an empty type column, keeping choices (`<auto|vllm|hf>`) and ranges
(`[x>=1]`), and joins each paragraph of every command's help into one line for the terminal to wrap (paragraphs stay
apart; a paragraph that starts with Click's `\\b` marker keeps its lines).
"""

from __future__ import annotations

import re
from typing import Any

#: The type names Typer shows that add nothing to the description (its choices and ranges are kept).
PLAIN_TYPE = re.compile(r"<(bool|str|path|file|dir|int|float|int range|float range|list\[str\]|list\[path\])>(\.\.\.)?")


def reflow(text: str) -> str:
    """Each paragraph (blank-line separated) of `text` on one line, its words single-spaced; `\\b` paragraphs as
    they are."""
    import inspect

    paragraphs = [p.strip("\n") for p in inspect.cleandoc(text).split("\n\n")]
    return "\n\n".join(p if p.startswith("\b") else " ".join(p.split()) for p in paragraphs if p.strip())


def _commands(command: Any, parent: Any = None):
    """(command, its context) for `command` and every subcommand; contexts chain as when they run, so each inherits
    the root's context settings (help option names: `-h`)."""
    import typer

    ctx = typer.Context(command, parent=parent, **(getattr(command, "context_settings", None) or {}))
    yield command, ctx
    for sub in (getattr(command, "commands", None) or {}).values():
        yield from _commands(sub, ctx)


def tidy(root: Any) -> Any:
    """`root` (a Click command built by `typer.main.get_command`) and every subcommand, tidied in place; returns it."""
    for command, ctx in _commands(root):
        if command.help:
            command.help = reflow(command.help)
        params = list(command.params)
        if command.add_help_option:
            params.append(command.get_help_option(ctx))  # the help option object Click keeps for the command
        for param in params:
            if param is not None and param.metavar is None and _plain(param, ctx):
                param.metavar = ""  # no `<bool>` on a flag, no `<str>`
    return root


def _plain(param: Any, ctx: Any) -> bool:
    """A flag, or an option whose type Typer would show as a plain name (PLAIN_TYPE)."""
    if getattr(param, "is_flag", False):
        return True
    shown = getattr(param, "display_type_rich", None)  # Typer >= 0.26; older releases show Click's own metavar
    return shown is not None and bool(PLAIN_TYPE.fullmatch(shown(ctx) or ""))
