"""The toy tools task (docs/toy.md): multiplication with a calculator tool, the `calc` environment."""

from emapg_cli.tasks.spec import Task

TASK = Task("toy-tools", prepare="emapg_cli.tasks.toy_tools.prepare:run", reward="math", bench="test.jsonl", env="calc")
