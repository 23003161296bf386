"""Open-domain QA layouts -> canonical rows, keeping every gold alias as an accepted answer.

One reader for the layouts the search datasets are published in (a row is recognised by its fields):

| layout | question | answers | id |
|---|---|---|---|
| FlashRAG JSONL (all seven) | `question` | `golden_answers` | `id` |
| Search-R1 parquet | `question`, else the prompt after "Question: " | `golden_answers`, else `reward_model.ground_truth.target` | `id`, else `extra_info.index` |
| HotpotQA JSON (official / hub) | `question` | `answer` | `_id` / `id` |
| IRCoT (HotpotQA, 2Wiki, MuSiQue) | `question_text` | every `answers_objects[].spans` (and `number`) | `question_id` |
| 2WikiMultihopQA JSON | `question` | `answer` (+ `answer_aliases` when present) | `_id` |
| MuSiQue JSONL | `question` | `answer` + `answer_aliases`; `answerable: false` rows are dropped | `id` |
| PopQA (original) | `question` | `possible_answers` (a JSON-encoded list) | `id` |

`source` is the row's `data_source` when it has one (Search-R1's merged files), else the dataset
name. `meta` keeps the question type (`subset`), the titles of the supporting paragraphs
(`supporting_titles`, for retrieval recall) and other scalar fields.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from emapg_cli.datasets.rows import ID_FIELDS, RowError, answer_text, source_id

QUESTION_MARK = "Question: "


def _question(row: dict[str, Any]) -> str:
    q = row.get("question", row.get("question_text"))
    if q is None and isinstance(row.get("prompt"), list):  # Search-R1 parquet without a question column
        users = [m.get("content", "") for m in row["prompt"] if isinstance(m, dict) and m.get("role") == "user"]
        text = users[-1] if users else ""
        q = text.rsplit(QUESTION_MARK, 1)[1] if QUESTION_MARK in text else None
    if not isinstance(q, str) or not q.strip():
        raise RowError("empty or missing question (question | question_text | prompt)")
    return q.strip()


def _as_list(value: Any, name: str) -> list[Any]:
    if isinstance(value, str) and name == "possible_answers":  # PopQA stores a JSON-encoded list
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # not JSON, an integer past 4300 digits, nested too deeply
            raise RowError(f"'{name}' is not a JSON list") from None
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _ircot_answers(objects: Any) -> list[Any]:
    """The spans (and non-empty numbers) of IRCoT's `answers_objects`."""
    out: list[Any] = []
    for obj in objects if isinstance(objects, list) else []:
        if isinstance(obj, dict):
            out += list(obj.get("spans") or [])
            if str(obj.get("number") or "").strip():
                out.append(obj["number"])
    return out


def qa_answers(row: dict[str, Any]) -> list[str]:
    """Every gold alias of a row, first-seen order, without duplicates; RowError when there is none."""
    ground_truth = (row.get("reward_model") or {}).get("ground_truth") if isinstance(row.get("reward_model"), dict) else None
    if row.get("golden_answers") is not None:
        values = _as_list(row["golden_answers"], "golden_answers")
    elif isinstance(ground_truth, dict) and ground_truth.get("target") is not None:
        values = _as_list(ground_truth["target"], "target")
    elif row.get("answers_objects") is not None:
        values = _ircot_answers(row["answers_objects"])
    elif row.get("possible_answers") is not None:
        values = _as_list(row["possible_answers"], "possible_answers")
    elif row.get("answers") is not None:
        values = _as_list(row["answers"], "answers")
    elif row.get("answer") is not None:
        values = _as_list(row["answer"], "answer") + _as_list(row.get("answer_aliases") or [], "answer_aliases")
    else:
        raise RowError("no answer field (golden_answers | answers_objects | answer | answers | possible_answers)")
    answers = list(dict.fromkeys(text for text in map(answer_text, values) if text))
    if not answers:
        raise RowError("no non-empty gold answer")
    return answers


def _row_id(row: dict[str, Any], index: int) -> str:
    extra = row.get("extra_info")
    if not any(row.get(n) is not None for n in ID_FIELDS) and isinstance(extra, dict) and extra.get("index") is not None:
        return str(extra["index"])  # Search-R1 parquet without an id column
    return source_id(row, index)


def supporting_titles(row: dict[str, Any]) -> Optional[list[str]]:
    """Titles of the gold paragraphs, from any of the layouts' supporting-fact fields; None if absent."""
    facts = row.get("supporting_facts")
    titles: list[str] = []
    if isinstance(facts, dict):  # HotpotQA on the hub: {"title": [...], "sent_id": [...]}
        titles = [str(t) for t in facts.get("title") or []]
    elif isinstance(facts, list):  # official HotpotQA / 2Wiki: [[title, sent_id], ...]
        titles = [str(f[0]) for f in facts if isinstance(f, (list, tuple)) and f]
    for key in ("contexts", "paragraphs"):  # IRCoT / MuSiQue: paragraphs flagged is_supporting
        if isinstance(row.get(key), list):
            titles += [str(p.get("title", "")) for p in row[key] if isinstance(p, dict) and p.get("is_supporting")]
    unique = list(dict.fromkeys(t for t in titles if t))
    return unique or None


def convert_qa_row(row: dict[str, Any], index: int, name: str) -> dict[str, Any]:
    """One canonical row {id, question, answers, source, meta} from any layout in the table above."""
    if row.get("answerable") is False:
        raise RowError("unanswerable (MuSiQue full-setting row)")
    question = _question(row)
    answers = qa_answers(row)
    skip = {*ID_FIELDS, "question", "question_text", "answer", "possible_answers", "data_source"}
    meta: dict[str, Any] = {k: v for k, v in row.items() if k not in skip and isinstance(v, (str, int, float, bool))}
    if isinstance(row.get("type"), str):
        meta["subset"] = row["type"]
    titles = supporting_titles(row)
    if titles:
        meta["supporting_titles"] = titles
    source = row.get("data_source")
    return {
        "id": _row_id(row, index),
        "question": question,
        "answers": answers,
        "source": source if isinstance(source, str) and source else name,
        "meta": meta,
    }
