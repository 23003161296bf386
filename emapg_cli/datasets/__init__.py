"""Datasets: the dataset cards (`registry`, one YAML file per dataset in `data/`), conversion to the canonical schema, hub loading, decontamination."""

from emapg_cli.datasets.registry import DatasetSpec, Fields, datasets, get_spec

__all__ = ["DatasetSpec", "Fields", "datasets", "get_spec"]
