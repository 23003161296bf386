"""The registry of built-in tasks (emapg_cli/tasks/, issue 42): one declaration per task, looked up by name."""

from __future__ import annotations

import re
from pathlib import Path
from pkgutil import resolve_name

import pytest

import emapg_cli
from emapg_cli.errors import UserError
from emapg_cli.tasks import REASONING_GYM, TASKS, get_task

PACKAGE = Path(emapg_cli.__file__).resolve().parent


def test_every_task_declares_a_prepare_step_that_resolves():
    for task in [*TASKS.values(), REASONING_GYM]:
        assert callable(resolve_name(task.prepare)), task.name


def test_an_unknown_task_is_one_line_naming_the_known_ones():
    with pytest.raises(UserError, match=r"^--preset supports 'toy', 'toy-search', 'toy-tools', 'toy-distill' and 'smol' "
                                        r"\(got 'nope'\)$"):
        get_task("nope")
    assert get_task("toy").bench == "test.jsonl" and get_task("toy-tools").env == "calc"


def test_no_module_names_a_task_outside_its_own_package():
    # issue 42's bar, `grep -rn '"toy"' emapg_cli`: a task's name as a string is written only in its own package
    for name in TASKS:
        quoted = re.compile(rf"""["']{re.escape(name)}["']""")
        found = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if quoted.search(p.read_text()))
        assert all(f.startswith(f"tasks/{name.replace('-', '_')}/") for f in found), (name, found)
