"""The toy distillation task (docs/distill.md): the toy's addition with a teacher and a weaker student."""

from emapg_cli.tasks.spec import Task

TASK = Task("toy-distill", prepare="emapg_cli.tasks.toy_distill.prepare:run", reward="math")
