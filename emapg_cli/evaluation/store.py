"""An evaluation's output folder: `run.json` (settings), `results.jsonl` (one row per item), resume.

Rows are appended and flushed as items finish, so an interrupted run keeps what it graded; a rerun
with the same folder and settings skips those items. A half-written last line is ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from emapg_cli.data.schema import json_line, parse_json_line, write_jsonl
from emapg_cli.errors import UserError
from emapg_cli.paths import write_text_atomic

RESULTS, RUN, SUMMARY, TABLE = "results.jsonl", "run.json", "summary.json", "summary.md"

#: Settings that must match for a rerun to resume (anything else may change between runs).
RESUME_KEYS = ("bench", "model", "n", "temperature", "top_p", "max_tokens", "seed", "instruction", "responses_file",
               "retriever", "max_turns", "topk", "max_obs_tokens", "max_context_tokens", "prompt_template", "env", "chat_prefix",
               "stop")


def open_run(out_dir: Path, settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Record `settings` in `out_dir/run.json` and return the finished rows by id (empty when new).

    A folder holding a run with different RESUME_KEYS is a UserError (results would mix).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    run = out_dir / RUN
    if run.is_file():
        old = _read_run(run)
        diff = [k for k in RESUME_KEYS if old.get(k) != settings.get(k)]
        if diff:
            changes = ", ".join(f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in diff)
            raise UserError(f"{out_dir} holds a run with other settings ({changes}); use another --out")
    write_text_atomic(run, json.dumps(settings, indent=2) + "\n")
    return read_results(out_dir / RESULTS)


def _read_run(path: Path) -> dict[str, Any]:
    """A previous run's settings; a file that is not a JSON object is a UserError."""
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        old = None
    if not isinstance(old, dict):
        raise UserError(f"{path}: not a JSON object of run settings (corrupt; use another --out or delete the folder)")
    return old


def _check_row(row: dict[str, Any], where: str) -> None:
    """A result row as `_Grading` writes it: id, and equally long lists of responses and grades."""
    lists = ("responses", "extracted", "correct", "strict")
    ok = isinstance(row.get("id"), (str, int)) and all(isinstance(row.get(k), list) for k in lists)
    ok = ok and len({len(row[k]) for k in lists}) == 1 and len(row["correct"]) > 0
    ok = ok and all(isinstance(v, bool) for k in ("correct", "strict") for v in row[k])
    ok = ok and all(e is None or isinstance(e, str) for e in row["extracted"])
    if not ok:
        raise UserError(f"{where}: not a result row (needs id and equally long lists {', '.join(lists)}); delete the folder to start over")


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    """Finished rows by id; a truncated final line (an interrupted write) is dropped. A corrupt row
    elsewhere (not UTF-8, not JSON, not a result row, a repeated id) is a UserError."""
    rows: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return rows
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start}); delete the folder to start over") from None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}:{i + 1}"
        try:
            row = parse_json_line(line, where, unicode_only=False)
        except UserError:
            if i == len(lines) - 1 and not text.endswith("\n"):
                break
            raise
        _check_row(row, where)
        if str(row["id"]) in rows:
            raise UserError(f"{where}: duplicate id {row['id']!r}; delete the folder to start over")
        rows[str(row["id"])] = row
    if text and not text.endswith("\n"):  # cut the partial line so appends stay valid
        write_jsonl(path, rows.values())
    return rows


def append_results(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Append rows and flush them to disk."""
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json_line(row))
        f.flush()
