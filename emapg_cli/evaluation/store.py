"""An evaluation's output folder: `run.json` (settings), `results.jsonl` (one row per item), resume.

Rows are appended and flushed as items finish, so an interrupted run keeps what it graded; a rerun
with the same folder and settings skips those items. A half-written last line is ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from emapg_cli.data.schema import write_jsonl
from emapg_cli.errors import UserError
from emapg_cli.paths import write_text_atomic

RESULTS, RUN, SUMMARY, TABLE = "results.jsonl", "run.json", "summary.json", "summary.md"

#: Settings that must match for a rerun to resume (anything else may change between runs).
RESUME_KEYS = ("bench", "model", "n", "temperature", "top_p", "max_tokens", "seed", "instruction", "responses_file")


def open_run(out_dir: Path, settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Record `settings` in `out_dir/run.json` and return the finished rows by id (empty when new).

    A folder holding a run with different RESUME_KEYS is a UserError (results would mix).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    run = out_dir / RUN
    if run.is_file():
        try:
            old = json.loads(run.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{run}: corrupt ({e}); delete the folder to start over, or use another --out") from None
        if not isinstance(old, dict):
            raise UserError(f"{run}: corrupt (not a JSON object); delete the folder to start over, or use another --out")
        diff = [k for k in RESUME_KEYS if old.get(k) != settings.get(k)]
        if diff:
            changes = ", ".join(f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in diff)
            raise UserError(f"{out_dir} holds a run with other settings ({changes}); use another --out")
    write_text_atomic(run, json.dumps(settings, indent=2) + "\n")
    return read_results(out_dir / RESULTS)


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    """Finished rows by id; a truncated final line (an interrupted write) is dropped."""
    rows: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return rows
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise UserError(f"{path}:{i + 1}: not valid JSON (delete the folder to start over)") from None
        rows[str(row["id"])] = row
    if text and not text.endswith("\n"):  # cut the partial line so appends stay valid
        write_jsonl(path, rows.values())
    return rows


def append_results(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append rows and flush them to disk."""
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
        f.flush()
