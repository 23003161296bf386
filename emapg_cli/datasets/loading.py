"""Reading a data reference (config `data.train` / `data.eval`, `eval --bench`; see `data.schema`) into validated
canonical `Example`s: canonical rows as they are, any other layout through `emapg prepare`'s converter.
"""

from __future__ import annotations

from pydantic import ValidationError

from emapg_cli.data.schema import Example, first_error, read_jsonl, resolve_data_ref
from emapg_cli.errors import UserError


def load_examples(ref: str) -> list[Example]:
    """Load and validate every row of a dataset; the first bad row (or a repeated id) is a one-line UserError.

    Canonical rows are read as they are (a single `answer` string is accepted as `answers: [answer]`).
    Any other row goes through `emapg prepare`'s converter (datasets/convert.py): the common field
    names of every layout it reads (MATH's problem/answer, OlympiadBench's integer ids and
    `final_answer` lists, FlashRAG's `golden_answers`, ...), ids coerced to strings, and the field
    mapping of the dataset card whose name starts the file name (`olympiadbench_test.jsonl` ->
    the `olympiadbench` card: its context, subfield and tolerance columns).
    """
    path = resolve_data_ref(ref)
    out = []
    seen: set[str] = set()
    spec = None
    for i, (lineno, row) in enumerate(read_jsonl(path, numbered=True)):
        canonical = row
        if isinstance(row, dict) and "answer" in row and "answers" not in row:
            canonical = {**{k: v for k, v in row.items() if k != "answer"}, "answers": [str(row["answer"])]}
        if isinstance(canonical, dict):
            canonical.setdefault("id", str(i))
        try:
            ex = Example.model_validate(canonical)
        except ValidationError as err:
            error = first_error(err)
            from emapg_cli.datasets.convert import convert_row
            from emapg_cli.datasets.registry import card_for_file
            from emapg_cli.datasets.rows import RowError

            spec = spec or card_for_file(path)
            try:
                ex = Example.model_validate(convert_row(row, i, spec))
            except (RowError, ValidationError) as conv:
                reason = first_error(conv) if isinstance(conv, ValidationError) else str(conv)
                rid = row.get("id") if isinstance(row, dict) else None
                raise UserError(f"{path}:{lineno}: id {rid!r}: {error}; as another layout: {reason}") from None
        if ex.id in seen:
            raise UserError(f"{path}:{lineno}: duplicate id {ex.id!r} (ids must be unique within a dataset)")
        seen.add(ex.id)
        out.append(ex)
    if not out:
        raise UserError(f"{path}: no rows")
    return out
