"""Build a canonical dataset folder: `data.jsonl` plus `manifest.json` (provenance and dropped rows).

Every source row either becomes a validated `Example` or is listed in the manifest with the
reason it was dropped (conversion failure, schema violation, duplicate question, duplicate id).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from pydantic import ValidationError

from emapg_cli import __version__
from emapg_cli.data.schema import Example, first_error, resolve_data_ref, write_jsonl
from emapg_cli.datasets.convert import convert_row
from emapg_cli.datasets.decontaminate import Overlap, find_overlaps, question_key
from emapg_cli.datasets.loading import load_examples
from emapg_cli.datasets.registry import DatasetSpec, custom_spec, datasets, get_spec
from emapg_cli.datasets.rows import RowError, source_id
from emapg_cli.errors import UserError
from emapg_cli.fileio import sha256_file
from emapg_cli.paths import emapg_home, write_text_atomic

MANIFEST = "manifest.json"


@dataclass
class Converted:
    """The result of converting source rows: the kept examples and every dropped row with its reason."""

    examples: list[Example] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)  # {index, id, reason}

    def reasons(self) -> dict[str, int]:
        """Dropped-row counts by reason kind (the text before the first colon)."""
        return dict(Counter(d["reason"].split(":")[0] for d in self.dropped))


def convert_rows(rows: Sequence[Any], spec: DatasetSpec, progress: Optional[Callable[[int], None]] = None) -> Converted:
    """Convert, validate and de-duplicate (by normalised question, then by id; the first one wins).

    QA benchmarks keep repeated questions (PopQA asks "Who was the composer of Easy Living?" about
    different works, with different answers): their published row counts are the benchmark.
    """
    keep_same_questions = spec.answer_format == "qa_aliases"
    out = Converted()
    seen_questions: dict[str, str] = {}
    seen_ids: set[str] = set()
    for index, raw in enumerate(rows):
        if progress:
            progress(1)
        rid = source_id(raw, index)
        try:
            ex = Example.model_validate(convert_row(raw, index, spec))
        except (RowError, ValidationError) as e:
            why = first_error(e) if isinstance(e, ValidationError) else e
            out.dropped.append({"index": index, "id": rid, "reason": f"invalid: {why}"})
            continue
        key = question_key(ex.question)
        if key in seen_questions and not keep_same_questions:
            out.dropped.append({"index": index, "id": ex.id, "reason": f"duplicate: same question as id {seen_questions[key]}"})
            continue
        if ex.id in seen_ids:
            out.dropped.append({"index": index, "id": ex.id, "reason": "duplicate: id already used"})
            continue
        seen_questions.setdefault(key, ex.id)
        seen_ids.add(ex.id)
        out.examples.append(ex)
    return out


def dataset_dir(name: str, out: Optional[Path] = None) -> Path:
    """Where `name` is written: `out`, else `$EMAPG_HOME/data/NAME` (what `load_examples(NAME)` reads)."""
    if out is not None:
        return out
    if not name or "/" in name or name.startswith("."):
        raise UserError(f"dataset name '{name}' must be a plain name (no '/'); use --out for a path")
    return emapg_home() / "data" / name


def write_dataset(out_dir: Path, converted: Converted, provenance: dict[str, Any], spec: DatasetSpec) -> dict[str, Any]:
    """Write data.jsonl and manifest.json into `out_dir`; returns the manifest."""
    data = out_dir / "data.jsonl"
    rows = write_jsonl(data, (ex.model_dump() for ex in converted.examples))
    manifest = {
        "name": spec.name,
        "role": spec.role,
        **provenance,
        "rows": rows,
        "expected_rows": spec.expected_rows,
        "dropped": len(converted.dropped),
        "dropped_by_reason": converted.reasons(),
        "dropped_rows": converted.dropped,
        "sha256": sha256_file(data),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "emapg_version": __version__,
    }
    write_manifest(out_dir, manifest)
    return manifest


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    """The dataset folder's manifest.json (UTF-8, indented), written atomically."""
    write_text_atomic(out_dir / MANIFEST, json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")


def prepare_dataset(
    name: str,
    from_file: Optional[Path] = None,
    out: Optional[Path] = None,
    progress: Optional[Callable[[int, int], Callable[[int], None]]] = None,
) -> tuple[Path, dict[str, Any]]:
    """Prepare `name` from the hub (registered names) or from a local file; returns (folder, manifest).

    `progress(total, ...)` may return a callback advanced once per source row.
    """
    # the registered spec; an unregistered name is fine with a local file (fields auto-detected)
    spec = get_spec(name) if name in datasets() or from_file is None else custom_spec(name)
    out_dir = dataset_dir(name, out)
    if from_file is not None:
        from emapg_cli.datasets.files import read_records

        rows = read_records(from_file)
        provenance = {"source": str(from_file), "source_sha256": sha256_file(from_file), "revision": None}
    else:
        from emapg_cli.datasets.hub import load_from_hub

        rows, revision = load_from_hub(spec)
        provenance = {
            "source": f"hf://datasets/{spec.hub_id}",
            "config": spec.config,
            "split": spec.split,
            "revision": revision,
        }
    advance = progress(len(rows)) if progress else None
    converted = convert_rows(rows, spec, advance)
    if not converted.examples:
        raise UserError(f"{provenance['source']}: no valid rows ({converted.reasons() or 'empty'})")
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir, write_dataset(out_dir, converted, provenance, spec)


def decontaminate(train: str, evals: Sequence[str], n: int = 13, remove: bool = False) -> tuple[list[Overlap], Optional[Path]]:
    """Overlaps of prepared training set `train` with the evaluation sets; optionally remove them.

    With `remove`, the training folder's data.jsonl is rewritten without the overlapping items and
    its manifest records them (`decontaminated`). Returns (overlaps, rewritten folder or None).
    """
    train_examples = load_examples(train)
    overlaps = find_overlaps(train_examples, {e: load_examples(e) for e in evals}, n=n)
    if not remove or not overlaps:
        return overlaps, None
    # rewrite exactly the file the examples were read from, and only if it is the prepared dataset
    data, out_dir = resolve_data_ref(train), dataset_dir(train)
    if data != out_dir / "data.jsonl":
        raise UserError(f"--remove rewrites a prepared dataset; '{train}' is not one (run `emapg prepare {train}` first)")
    bad = {o.train_id for o in overlaps}
    rows = write_jsonl(data, (ex.model_dump() for ex in train_examples if ex.id not in bad))
    manifest_path = out_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"name": train}
    manifest.update(
        rows=rows,
        sha256=sha256_file(data),
        decontaminated={"against": list(evals), "ngram": n, "removed": [o.__dict__ for o in overlaps]},
    )
    write_manifest(out_dir, manifest)
    return overlaps, out_dir
