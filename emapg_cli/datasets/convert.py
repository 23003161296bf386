"""Map a source row with any of the common field names onto the canonical schema.

question <- question | problem | prompt (a chat `prompt` list: its last user message)
answers  <- answer | final_answer | answers | golden_answers (string, number or list of aliases),
            else the last \\boxed{} of `solution`
id       <- id | unique_id | problem_id | _id | question_id, else the row index
A dataset card's own field names (`registry.Fields`, dotted paths for nested values) are tried
first; a row missing them falls back to the common names, so one card reads both the hub copy and
local copies of a dataset.
Other scalar fields go to `meta` (worked solutions are left out: they are long and unused).
"""

from __future__ import annotations

from typing import Any

from emapg_cli.datasets.qa import convert_qa_row
from emapg_cli.datasets.registry import DatasetSpec
from emapg_cli.datasets.rows import ID_FIELDS, RowError, answer_text, first_field, lookup
from emapg_cli.grading.extract import last_boxed

QUESTION_FIELDS = ("question", "problem", "prompt")
ANSWER_FIELDS = ("answer", "final_answer", "answers", "golden_answers")
SOLUTION_FIELDS = ("solution",)
SUBSET_FIELDS = ("subset", "subfield", "subject", "type")


def _question(value: Any) -> str:
    if isinstance(value, list):  # a chat prompt: [{"role": "user", "content": ...}, ...]
        users = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == "user"]
        value = users[-1] if users else None
    if not isinstance(value, str) or not value.strip():
        raise RowError("empty or missing question")
    return value.strip()


def _answers(row: dict[str, Any], spec: DatasetSpec) -> tuple[list[str], set[str]]:
    """(answers, fields used). The spec's field in its declared format first, then the common names."""
    preferred = spec.fields.answer if spec.fields.answer and lookup(row, spec.fields.answer) is not None else None
    if preferred and spec.answer_format == "boxed_solution":
        name, boxed = preferred, True
    elif (name := first_field(row, preferred, ANSWER_FIELDS)) is not None:
        boxed = False
    elif (name := first_field(row, None, SOLUTION_FIELDS)) is not None:
        boxed = True
    else:
        raise RowError("no answer field (answer | final_answer | answers | solution)")
    value = lookup(row, name)
    if boxed:
        found = last_boxed(value) if isinstance(value, str) else None
        if found is None or not found.strip():
            raise RowError(f"no \\boxed{{}} answer in '{name}'")
        return [found.strip()], {name}
    values = value if isinstance(value, list) else [value]
    answers = [answer_text(v) for v in values]
    if not answers or any(not a for a in answers):
        raise RowError(f"empty answer in '{name}'")
    return answers, {name}


def _meta_value(value: Any) -> bool:
    """Whether a field is small enough to keep in meta: scalars and lists of scalars."""
    scalar = (str, int, float, bool)
    return isinstance(value, scalar) or (isinstance(value, list) and all(isinstance(v, scalar) for v in value))


def convert_row(row: dict[str, Any], index: int, spec: DatasetSpec) -> dict[str, Any]:
    """One canonical row {id, question, answers, source, meta}; raises RowError with the reason."""
    if not isinstance(row, dict):
        raise RowError(f"row is a {type(row).__name__}, not an object")
    if spec.answer_format == "qa_aliases":
        return convert_qa_row(row, index, spec.name)
    f = spec.fields
    qname = first_field(row, f.question, QUESTION_FIELDS)
    if qname is None:
        raise RowError("no question field (question | problem | prompt)")
    question = _question(lookup(row, qname))
    context = lookup(row, f.context) if f.context else None
    if isinstance(context, str) and context.strip():
        question = f"{context.strip()}\n\n{question}"
    answers, used = _answers(row, spec)
    id_name = first_field(row, f.id, ID_FIELDS)
    used = {n.split(".")[0] for n in used | {qname, id_name, f.context} if n}  # top-level columns, left out of meta

    meta = {k: v for k, v in row.items() if k not in used and k not in SOLUTION_FIELDS and v is not None and _meta_value(v)}
    subset_name = first_field(row, f.subset, SUBSET_FIELDS)
    if subset_name is not None:
        meta["subset"] = str(lookup(row, subset_name))
    tolerance = lookup(row, f.tolerance) if f.tolerance else None
    if tolerance not in (None, ""):
        try:
            meta["tolerance"] = float(tolerance)
        except (TypeError, ValueError):
            raise RowError(f"tolerance '{f.tolerance}' is not a number: {tolerance!r}") from None
    return {
        "id": str(lookup(row, id_name)) if id_name else str(index),
        "question": question,
        "answers": answers,
        "source": spec.name,
        "meta": meta,
    }
