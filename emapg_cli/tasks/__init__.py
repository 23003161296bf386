"""The built-in tasks: one package each, its `__init__.py` the declaration (a `Task`, floor 0: `paths`, `rewards`,
`evaluation` and the CLI read it here) and its other modules the code (floor 6: the problems, the prepare step).
reasoning-gym tasks come in by prefix (`REASONING_GYM`): `emapg prepare reasoning-gym:TASK[,TASK...]`."""

from emapg_cli.errors import UserError
from emapg_cli.tasks import smol, toy, toy_distill, toy_search, toy_tools
from emapg_cli.tasks.spec import Task

TASKS: dict[str, Task] = {t.TASK.name: t.TASK for t in (toy, toy_search, toy_tools, toy_distill, smol)}
#: Generated datasets by prefix, `emapg prepare reasoning-gym:TASK[,TASK...]` (into $EMAPG_HOME/data/NAME): its prepare
#: step takes (name, size, seed, task_config, out_dir) and returns the manifest (datasets/reasoning_gym_data.py).
REASONING_GYM = Task("reasoning-gym:", prepare="emapg_cli.datasets.reasoning_gym_data:prepare_reasoning_gym",
                     reward="reasoning-gym")


def get_task(name: str) -> Task:
    """The task `emapg prepare --preset NAME` prepares; else a one-line UserError naming them."""
    if name not in TASKS:
        *rest, last = (f"'{n}'" for n in TASKS)
        raise UserError(f"--preset supports {', '.join(rest)} and {last} (got '{name}')")
    return TASKS[name]
