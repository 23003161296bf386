"""The toy task (docs/toy.md): two-digit addition and a tiny warm-started Llama, for RL you can watch on a CPU.
`task.py` makes the problems, `sft.py` is the warm start the toys share, `prepare.py` writes it all."""

from emapg_cli.tasks.spec import Task

TASK = Task("toy", prepare="emapg_cli.tasks.toy.prepare:run", reward="math", bench="test.jsonl", reward_alias=True)
