"""Output folders: each command writes only into a new or empty folder or one of its own kind, under a lock.

`claim_folder(path, kind, config_hash)` is the one mechanism every writing command uses:

- kind: the folder must be absent, empty, or hold the marker file `.emapg.json`
  (``{"command": kind, "config_sha256": ...}``) of the same command. A folder with another command's
  marker, or with files and no marker (someone else's folder), is refused with a UserError before a
  single byte is written into it. Folders written before markers existed are recognised by the files
  only their command writes (`LEGACY`).
- lock: an exclusive `fcntl.flock` on `.emapg.lock` for as long as the command runs; the kernel
  drops it when the process exits or dies, so a crash never leaves a stale lock. A second writer gets
  a UserError at once.
- marker: written atomically (temp file + rename) after the lock is held, when the folder has none;
  it records the command and the hash of the settings the folder was made with. The lock file stays
  (removing it would let a third process lock a new file while a second waits on the old one).
- cleanup: a folder this call created is removed again when the command fails with a UserError or an
  OSError before it held anything worth keeping (`keep`), so a refused or failed command leaves no
  half-made folder; parent folders this call created go too, each only if it is empty by then.

`current_folder()` names the claimed folder and `last_folder()` the most recent one, where the CLI
writes the traceback of an unexpected error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional, Sequence

from emapg_cli.errors import UserError

MARKER = ".emapg.json"
LOCK = ".emapg.lock"

#: Files that identify a folder a command wrote before markers existed (all must be present).
LEGACY: dict[str, tuple[str, ...]] = {
    "train": ("config.yaml", "checkpoints"),
    "eval": ("run.json", "results.jsonl"),
    "prepare": ("manifest.json",),
    "ablate": ("study.yaml",),
}

_claimed: list[Path] = []
_last: list[Path] = []  # the folder claimed most recently in this process (held or released)


def config_sha256(text: str) -> str:
    """The hash recorded in the marker: sha256 of the command's resolved settings as text."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def current_folder() -> Optional[Path]:
    """The output folder claimed by the running command (innermost), if any."""
    return _claimed[-1] if _claimed else None


def last_folder() -> Optional[Path]:
    """The output folder claimed most recently by this process, held or already released."""
    return current_folder() or (_last[-1] if _last else None)


def read_marker(path: Path) -> Optional[dict]:
    """The folder's marker, None when it has none; a UserError when it is unreadable."""
    marker = Path(path) / MARKER
    if not marker.exists():
        return None
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{marker}: unreadable emapg marker ({e}); use another output folder") from None
    if not isinstance(data, dict) or not isinstance(data.get("command"), str):
        raise UserError(f"{marker}: not an emapg marker (no \"command\"); use another output folder")
    return data


def marker_kind(path: Path) -> Optional[str]:
    """The command named by the marker of folder `path` (None when it has none or is no folder)."""
    marker = read_marker(path) if Path(path).is_dir() else None
    return marker["command"] if marker else None


def check_folder(path: Path, kind: str, config_hash: Optional[str] = None, *, fresh: bool = False,
                 same_config: bool = False) -> bool:
    """Refuse (UserError) a folder `kind` may not write into; returns whether it already exists.

    `fresh`: the command starts anew and needs an empty folder even when it is of its own kind.
    `same_config`: a folder of this kind must carry the same `config_hash` (when both are known).
    """
    path = Path(path)
    if not path.exists():
        if path.is_symlink():
            raise UserError(f"{path}: a broken symbolic link; use another output folder")
        return False
    if not path.is_dir():
        raise UserError(f"{path} exists and is not a folder; use another output folder")
    try:
        entries = [p.name for p in path.iterdir() if p.name not in (LOCK, MARKER)]
    except OSError as e:
        raise UserError(f"{path}: cannot read the folder ({e.strerror})") from None
    marker = read_marker(path)
    if marker is None:
        if not entries:
            return True
        legacy = LEGACY.get(kind)
        if legacy and all((path / name).exists() for name in legacy) and not fresh:
            return True
        raise UserError(f"{path} is not empty and was not written by `emapg {kind}`; use a new or empty folder")
    if marker["command"] != kind:
        raise UserError(f"{path} holds the output of `emapg {marker['command']}`; `emapg {kind}` writes only into "
                        "a new or empty folder or one of its own; use another folder")
    if fresh and entries:
        raise UserError(f"{path} already holds an `emapg {kind}` output (continue it, or use another folder)")
    old = marker.get("config_sha256")
    if same_config and config_hash is not None and old is not None and old != config_hash:
        raise UserError(f"{path} holds an `emapg {kind}` output made with other settings; use another folder")
    return True


def _lock(path: Path):
    """Open and exclusively lock `path/.emapg.lock`; UserError when another process holds it."""
    import fcntl

    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise UserError(f"{path} is in use by another emapg process (it holds {path / LOCK}); wait for it "
                        "or use another folder") from None
    return fd


def _missing_parents(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, outermost first."""
    missing = []
    for p in [path, *path.parents]:
        if p.exists() or p.is_symlink():
            break
        missing.append(p)
    return missing[::-1]


def _write_marker(path: Path, kind: str, config_hash: Optional[str]) -> None:
    from emapg_cli import __version__
    from emapg_cli.paths import write_text_atomic

    marker = {"command": kind, "config_sha256": config_hash, "emapg_version": __version__}
    write_text_atomic(path / MARKER, json.dumps(marker, indent=2) + "\n")


@contextlib.contextmanager
def claim_folder(path: Path, kind: str, config_hash: Optional[str] = None, *, fresh: bool = False,
                 same_config: bool = False, keep: Sequence[str] = ()) -> Iterator[Path]:
    """Hold `path` as `kind`'s output folder for the `with` block (see the module doc).

    `fresh` and `same_config` as in `check_folder`; `config_hash` is recorded in the marker.
    `keep`: names whose presence means a failed command left something worth keeping (a checkpoint,
    graded rows), so a folder this call created is not removed on failure.
    """
    path = Path(path)
    check_folder(path, kind, config_hash, fresh=fresh, same_config=same_config)
    created: list[Path] = []
    fd = None
    try:
        for p in _missing_parents(path):
            try:
                p.mkdir()
                created.append(p)  # only what this call made is removed on failure
            except FileExistsError:
                pass
        fd = _lock(path)
        check_folder(path, kind, config_hash, fresh=fresh, same_config=same_config)  # again, now that no one else can write it
        if not (path / MARKER).exists():  # an existing marker stays as the folder's creator wrote it
            _write_marker(path, kind, config_hash)
        _claimed.append(path)
        _last[:] = [path]
        try:
            yield path
        finally:
            _claimed.pop()
    except (UserError, OSError):
        if created and not any((path / name).exists() for name in keep):
            # the folder itself (locked by us: no one else wrote into it), then each parent this call made only
            # while it is empty (another command may have put its own folder there meanwhile)
            shutil.rmtree(created[-1], ignore_errors=True)
            for parent in reversed(created[:-1]):
                try:
                    parent.rmdir()
                except OSError:
                    break
        raise
    finally:
        if fd is not None:
            os.close(fd)


def claim_prepare(folder: Path, what: str):
    """Hold `folder` as the output of `emapg prepare WHAT` (a dataset name, `--preset NAME`): a folder another
    `prepare` made for something else is refused before a byte is written (the marker's hash)."""
    return claim_folder(folder, "prepare", config_sha256(what), same_config=True)


def writable_file(path: Path, what: str) -> Path:
    """Check an output file path before the work that produces it: not a folder, parent creatable."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path} is a folder; give a file name")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and (not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK)):
        raise UserError(f"{what} {path}: cannot write into {parent}")
    return path
