"""The toy search task (docs/search.md): questions answered from a small corpus through the search agent."""

from emapg_cli.tasks.spec import Task

TASK = Task("toy-search", prepare="emapg_cli.tasks.toy_search.prepare:run", reward="em", bench="test.jsonl", env="search")
