"""Shared steps of the eval end-to-end tests."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional


def data_dir() -> Optional[Path]:
    """$EMAPG_DATA_DIR (a folder of real benchmark files) if set and present, else None."""
    value = os.environ.get("EMAPG_DATA_DIR")
    if not value:
        return None
    path = Path(value).expanduser()
    return path if path.is_dir() else None


def rerun_after_torn_write(cli, args: list[str], out: Path, first: list[str], partial: str) -> dict:
    """Append half a row (`partial`) to out/results.jsonl, as an interrupted write leaves it, then rerun
    `emapg <args> --limit 4`: the 2 finished rows stay byte for byte, only the 2 new items are run.
    Returns the rerun's summary.json."""
    with open(out / "results.jsonl", "a") as f:
        f.write(partial)
    r = cli(*args, "--limit", "4")
    assert r.returncode == 0, r.stderr
    lines = (out / "results.jsonl").read_text().splitlines()
    assert lines[:2] == first and len(lines) == 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_items"] == 2
    return summary
