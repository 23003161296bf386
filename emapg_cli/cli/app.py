"""The `emapg` command: registers each subcommand once it works."""

from __future__ import annotations

import contextlib
import errno
import os
import sys

import typer
from rich.markup import escape

from emapg_cli import __version__
from emapg_cli.cli import config_cmd
from emapg_cli.cli.common import err_console
from emapg_cli.errors import UserError, write_failure

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
from emapg_cli.cli import (ablate_cmd, bench_cmd, eval_cmd, kl_check_cmd, plot_cmd, prepare_cmd,  # noqa: E402
                           retriever_cmd, rollout_cmd, train_cmd)

app.command("prepare")(prepare_cmd.prepare)
app.command("eval")(eval_cmd.eval_)
app.command("train")(train_cmd.train)
app.command("kl-check")(kl_check_cmd.kl_check)
app.command("ablate")(ablate_cmd.ablate)
app.add_typer(bench_cmd.app, name="bench")
app.add_typer(retriever_cmd.app, name="retriever")
app.add_typer(rollout_cmd.app, name="rollout")
app.command("plot")(plot_cmd.plot)


def _fail(message: str, code: int = 2) -> None:
    # the message is plain text: escaped, so brackets in it (`pip install emapg[vllm]`) are not read as Rich markup;
    # newlines are folded so it stays one line
    line = " ".join(str(message).split())
    err_console.print(f"[bold red]error:[/] {escape(line)}", soft_wrap=True, highlight=False, markup=True)
    sys.exit(code)


#: OSError numbers that are the user's environment, not a bug: a full disk, no permission, a read-only
#: file system, a path that is a file where a folder is needed (or the reverse), a missing file.
USER_ERRNOS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR,
    errno.EISDIR, errno.ENOENT, errno.ENAMETOOLONG, errno.ELOOP, errno.EEXIST, errno.ENOTEMPTY,
})


def os_error_message(e: OSError) -> str:
    """One line naming the path and the problem (`runs/x/config.yaml: Permission denied`)."""
    from emapg_cli.outputs import last_folder

    what = e.strerror or (str(e).strip().splitlines() or [type(e).__name__])[0]
    if e.errno is None and e.filename is None:  # a library's message already says what and where
        return what
    if e.filename is not None:
        where = f"{os.fsdecode(e.filename)}" + (f" -> {os.fsdecode(e.filename2)}" if e.filename2 is not None else "")
    else:  # a write to an open file (a full disk) names no path: name the output folder
        folder = last_folder()
        where = f"writing in {folder}" if folder is not None else "writing output"
    return f"{where}: {what}"


#: How torch.save reports a failed write (it raises RuntimeError, not OSError, without an errno).
_TORCH_WRITE_FAILURES = ("PytorchStreamWriter failed writing", "file write failed", "inline_container.cc")

#: How a collective (gloo, NCCL) reports that another process of the launch is gone: it died, or its machine did.
_PEER_FAILURES = ("Connection reset by peer", "Connection closed by peer", "NCCL communicator was aborted")


def _internal_error(e: BaseException) -> None:
    """An unexpected exception (a bug): one line, the full traceback in a file, exit 1."""
    import tempfile
    import traceback

    from emapg_cli.outputs import last_folder

    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    log = None
    folder = last_folder()
    if folder is not None:
        with contextlib.suppress(OSError):  # ENOENT if the folder was removed
            (folder / "error.log").write_text(text, encoding="utf-8", errors="replace")
            log = str(folder / "error.log")
    if log is None:
        with contextlib.suppress(OSError):
            fd, name = tempfile.mkstemp(prefix="emapg-error-", suffix=".log")
            with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
                f.write(text)
            log = name
    where = f"full traceback in {log}" if log else "no traceback file could be written"
    summary = f"{type(e).__name__}: {e}"[:300]
    _fail(f"internal error (a bug in emapg, please report it): {summary}; {where}", code=1)


def _command():
    """The Click command tree Typer builds from `app`, its help tidied (cli/help_format.py)."""
    from emapg_cli.cli.help_format import tidy

    return tidy(typer.main.get_command(app))


def main() -> None:
    """Console-script entry point, the one error path of every command.

    Bad input (a UserError, a usage error such as an unknown or out-of-range option, an OSError
    that is the user's: disk full, no permission, a file where a folder is needed) becomes one
    line on stderr and exit code 2, with no traceback. Any other exception is a bug: one line,
    the full traceback written to the output folder (or a temp file), exit 1.
    """
    try:  # typer >= 0.24 vendors click as typer._click; older releases use click itself
        from typer._click import exceptions as click
    except ImportError:  # pragma: no cover
        from click import exceptions as click

    try:
        rv = _command()(standalone_mode=False, prog_name="emapg")
    except UserError as e:
        _fail(str(e))
    except click.NoArgsIsHelpError as e:  # `emapg` / `emapg config` alone: show the help, once (rich has printed it
        if e.format_message().strip():  # while the error was made, and left its message empty; plain click has not)
            typer.echo(e.format_message())
        sys.exit(0)
    except click.UsageError as e:
        _fail(f"{e.format_message()} (see '{e.ctx.command_path if e.ctx else 'emapg'} --help')")
    except click.ClickException as e:
        _fail(e.format_message())
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except OSError as e:
        # errno None: libraries' own OSErrors (transformers: "not a local folder and not a valid model
        # identifier", "couldn't connect to huggingface.co") are about the user's paths and network
        if e.errno in USER_ERRNOS or (e.errno is None and e.filename is None):
            _fail(os_error_message(e))
        _internal_error(e)
    except Exception as e:  # noqa: BLE001 - the last resort: one line and a traceback file, never a raw traceback
        if isinstance(e, RuntimeError) and any(s in str(e) for s in _PEER_FAILURES):  # not a bug here: say where to look
            _fail("another process of this launch stopped (a collective lost its connection to it): its own log, on its "
                  "machine, says why; the run keeps its last checkpoint (emapg train --resume)", code=1)
        torch_write = type(e) is RuntimeError and any(s in str(e) for s in _TORCH_WRITE_FAILURES)
        if torch_write or write_failure(e):  # a library's own write failed for want of room
            from emapg_cli.outputs import last_folder

            _fail(f"writing in {last_folder() or 'the output folder'}: a file could not be written "
                  f"({write_failure(e) or 'disk full or a file-size limit?'})")
        _internal_error(e)
    sys.exit(rv if isinstance(rv, int) else 0)
