"""Datasets: the registry (`registry.DATASETS`), conversion to the canonical schema, hub loading, decontamination."""

from emapg_cli.datasets.registry import DATASETS, DatasetSpec, Fields, get_spec

__all__ = ["DATASETS", "DatasetSpec", "Fields", "get_spec"]
