"""Load a registered dataset from the Hugging Face hub (needs the optional `datasets` package)."""

from __future__ import annotations

from typing import Any, Iterable

from emapg_cli.datasets.registry import DatasetSpec
from emapg_cli.errors import UserError, first_line


def load_dataset(spec: DatasetSpec) -> Iterable[dict[str, Any]]:
    """`datasets.load_dataset(hub_id, config, split=..., revision=...)` (rows as dicts)."""
    if not spec.hub_id:
        raise UserError(f"dataset '{spec.name}' has no hub source in its card; convert a local copy with --from FILE")
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"loading '{spec.name}' from the hub needs the `datasets` package: "
            "pip install datasets, i.e. the emapg extra `hub` (or convert a local copy with --from FILE)"
        ) from None
    try:
        return datasets.load_dataset(spec.hub_id, spec.config, split=spec.split, revision=spec.revision)
    except Exception as e:  # offline, unknown revision, hub errors: one line, with the way out
        raise UserError(
            f"cannot load '{spec.name}' from the hub ({spec.hub_id}): {type(e).__name__}: {first_line(e)}; "
            "this needs network access to huggingface.co (or convert a local copy with --from FILE)"
        ) from None


def resolve_revision(spec: DatasetSpec) -> str:
    """The commit the hub serves for `spec.revision` (default branch when None); best effort."""
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(spec.hub_id, revision=spec.revision).sha or (spec.revision or "main")
    except Exception:  # offline, or huggingface_hub missing: record what was asked for
        return spec.revision or "main"


def load_from_hub(spec: DatasetSpec) -> tuple[list[dict[str, Any]], str]:
    """(rows, revision) of a registered dataset."""
    rows = [dict(r) for r in load_dataset(spec)]
    return rows, resolve_revision(spec)
