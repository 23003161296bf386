"""The smol task (docs/smol.md): SmolLM2-135M-Instruct and easy reasoning-gym tasks."""

from emapg_cli.tasks.spec import Task

TASK = Task("smol", prepare="emapg_cli.tasks.smol.prepare:run", reward="reasoning-gym")
