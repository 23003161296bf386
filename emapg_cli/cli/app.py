"""The `emapg` command: registers each subcommand once it works."""

from __future__ import annotations

import sys

import typer
from rich.markup import escape

from emapg_cli import __version__
from emapg_cli.cli import config_cmd
from emapg_cli.cli.common import err_console
from emapg_cli.errors import UserError

app = typer.Typer(
    name="emapg",
    help="EMA Policy Gradient (arXiv 2602.04417): GRPO with an EMA anchor and the Top-k KL estimator.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(config_cmd.app, name="config")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"emapg {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    """EMA Policy Gradient toolkit."""


# Each command lives in its own module as a plain function; heavy libraries (torch,
# transformers) are imported inside the function so `emapg --help` stays fast.
# Register a command here only once it works.
# (registrations)
from emapg_cli.cli import prepare_cmd  # noqa: E402

app.command("prepare")(prepare_cmd.prepare)
from emapg_cli.cli import eval_cmd  # noqa: E402

app.command("eval")(eval_cmd.eval_)
from emapg_cli.cli import train_cmd  # noqa: E402

app.command("train")(train_cmd.train)
from emapg_cli.cli import kl_check_cmd  # noqa: E402

app.command("kl-check")(kl_check_cmd.kl_check)
from emapg_cli.cli import ablate_cmd  # noqa: E402

app.command("ablate")(ablate_cmd.ablate)
from emapg_cli.cli import bench_cmd  # noqa: E402

app.add_typer(bench_cmd.app, name="bench")
from emapg_cli.cli import retriever_cmd  # noqa: E402

app.add_typer(retriever_cmd.app, name="retriever")
from emapg_cli.cli import plot_cmd  # noqa: E402

app.command("plot")(plot_cmd.plot)


def _fail(message: str) -> None:
    # the message is plain text: escaped, so brackets in it (`pip install emapg[vllm]`) are not read as Rich markup
    err_console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False, markup=True)
    sys.exit(2)


def main() -> None:
    """Console-script entry point: bad input (a UserError, or a usage error such as an unknown or
    out-of-range option) becomes one line on stderr and exit code 2, with no traceback."""
    try:  # typer >= 0.24 vendors click as typer._click; older releases use click itself
        from typer._click import exceptions as click
    except ImportError:  # pragma: no cover
        from click import exceptions as click

    try:
        rv = app(standalone_mode=False, prog_name="emapg")
    except UserError as e:
        _fail(str(e))
    except click.NoArgsIsHelpError as e:  # `emapg` / `emapg config` alone: show the help
        typer.echo(e.ctx.get_help())
        sys.exit(0)
    except click.UsageError as e:
        _fail(f"{e.format_message()} (see '{e.ctx.command_path if e.ctx else 'emapg'} --help')")
    except click.ClickException as e:
        _fail(e.format_message())
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
