"""Where emapg keeps things: EMAPG_HOME (prepared data, the toy task)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

DEFAULT_HOME = "~/.cache/emapg"


def emapg_home() -> Path:
    """$EMAPG_HOME, default ~/.cache/emapg."""
    return Path(os.environ.get("EMAPG_HOME") or DEFAULT_HOME).expanduser()


def expand(path: str) -> Path:
    """Expand `~` and environment variables in a configured path; `$EMAPG_HOME` gets its default when unset."""
    home = str(emapg_home())
    path = path.replace("${EMAPG_HOME}", home).replace("$EMAPG_HOME", home)
    return Path(os.path.expandvars(path)).expanduser()


def prepare_hint(path: Path) -> str:
    """'; run: emapg prepare --preset NAME' when `path` lies in a built-in task's folder ($EMAPG_HOME/NAME), else ''."""
    from emapg_cli.tasks import TASKS

    for name in TASKS:
        try:
            Path(path).resolve().relative_to((emapg_home() / name).resolve())
        except ValueError:
            continue
        return f"; run: emapg prepare --preset {name}"
    return ""


def shipped_dir(name: str) -> Path:
    """A data folder shipped with emapg (`presets`, `data`): inside the installed wheel it is
    `emapg_cli/<packaged name>`; in a source checkout (editable install, tests) the repository's top-level folder."""
    from importlib import resources

    packaged = Path(str(resources.files("emapg_cli"))) / SHIPPED[name]
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[1] / name


#: top-level folder -> its name inside the wheel (pyproject's force-include; `data` is a package already)
SHIPPED = {"presets": "presets", "data": "dataset_cards"}


def _unique_tmp(path: Path) -> Path:
    """A new empty file beside `path` with a name no one else has (`.NAME.XXXXXXXX.tmp`), for an atomic write:
    a fixed name could be a user's file, or another process's temporary file."""
    import secrets

    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:  # O_EXCL: never an existing file; mode 0o666 less the umask, as a plain open() would give
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def _write_atomic(path: Path, write: Callable[[Path], Any]) -> Path:
    """`write(tmp)` into a new temporary file beside `path` (`_unique_tmp`), then rename it over `path`: a reader (another
    rank, a crash) sees the old file or the new one, never a half-written one. A failed write (a full disk) leaves
    the old file and no temporary one."""
    path = Path(path)
    tmp = _unique_tmp(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` atomically (`_write_atomic`)."""
    _write_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def save_figure_atomic(fig: Any, path: Path, dpi: int) -> Path:
    """Save a matplotlib figure to `path` atomically (`_write_atomic`; format from the suffix, PNG without one)."""
    return _write_atomic(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format=Path(path).suffix.lstrip(".").lower() or "png"))
