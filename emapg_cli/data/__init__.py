"""Datasets in one canonical schema: {id, question, answers, source, meta}."""

from emapg_cli.data.schema import Example, read_jsonl, write_jsonl

__all__ = ["Example", "read_jsonl", "write_jsonl"]
