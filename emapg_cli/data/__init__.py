"""Datasets in one canonical schema: {id, question, answers, source, meta}."""

from emapg_cli.data.schema import Example, load_examples, read_jsonl, write_jsonl

__all__ = ["Example", "load_examples", "read_jsonl", "write_jsonl"]
