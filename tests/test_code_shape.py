"""The trainer on one screen (issue 19): train/trainer.py at most 350 lines, and no function in emapg_cli/train/ (nested
ones and methods included) over 60 lines. Parsed with `ast`, nothing imported: a function's length is
end_lineno - lineno + 1 of its `def` (decorators not counted, its docstring counted)."""

from __future__ import annotations

import ast
from pathlib import Path

import emapg_cli

TRAIN = Path(emapg_cli.__file__).resolve().parent / "train"
MAX_TRAINER_LINES = 350
MAX_FUNCTION_LINES = 60


def long_functions(source: str, limit: int) -> list[tuple[str, int, int]]:
    """(name, first line, length) of every function of `source` longer than `limit` lines."""
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def test_long_functions_counts_def_to_last_line():
    # f: lines 1-4 (4 lines, its nested g 2-3 counted on its own: 2 lines); h: line 5 alone (1 line)
    source = "def f():\n    def g():\n        pass\n    return g\ndef h(): pass\n"
    assert long_functions(source, 3) == [("f", 1, 4)]
    assert sorted(long_functions(source, 1)) == [("f", 1, 4), ("g", 2, 2)]


def test_trainer_fits_on_one_screen():
    lines = len((TRAIN / "trainer.py").read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_TRAINER_LINES, f"train/trainer.py has {lines} lines (at most {MAX_TRAINER_LINES}): move a piece out"


def test_no_long_function_in_train():
    found = [f"{path.name}:{line} {name} ({n} lines)" for path in sorted(TRAIN.rglob("*.py"))
             for name, line, n in long_functions(path.read_text(encoding="utf-8"), MAX_FUNCTION_LINES)]
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines in emapg_cli/train/: {found}"
