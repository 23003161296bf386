"""Issue 32: no test leaves process-wide state behind (tests/process_state.py, the autouse fixture in conftest.py).

The first two tests run in this order (a file's tests run in the order written, on one worker under xdist): the
first changes every kind of state the fixture restores and cleans nothing up, the second checks that none of it is
left. Before the fixture, a serial run failed the second (and `test_rewards.py` and `test_first_hour.py` after
`test_async_rollouts.py`, whose in-process training registers `test_digit`)."""

from __future__ import annotations

import ast
import os
import sys
import types
from pathlib import Path

import process_state

PACKAGE = Path(__file__).resolve().parents[1] / "emapg_cli"


def test_a_test_that_changes_process_state_and_cleans_nothing_up(tmp_path):
    import torch

    from emapg_cli.agents.environments import BUILTINS
    from emapg_cli.config.loading import warn_remote_code
    from emapg_cli.rewards import REWARDS, register_reward

    register_reward("leak_probe", lambda think="emapg": (lambda rs, es: [0.0] * len(rs)))
    BUILTINS["leak_probe"] = "leak_probe:Env"
    warn_remote_code("leak probe", {"model": {"trust_remote_code": True}})
    os.environ["EMAPG_LEAK_PROBE"] = "1"
    os.chdir(tmp_path)
    torch.set_num_threads(torch.get_num_threads() + 1)
    sys.modules["emapg_leak_probe_plugin"] = types.ModuleType("emapg_leak_probe_plugin")
    assert "leak_probe" in REWARDS


def test_the_next_test_finds_none_of_it(tmp_path):
    import torch

    from emapg_cli.agents.environments import BUILTINS
    from emapg_cli.config.loading import _warned_remote_code
    from emapg_cli.rewards import REWARDS

    assert "leak_probe" not in REWARDS and "leak_probe" not in BUILTINS
    assert "leak probe" not in _warned_remote_code  # the warning would be printed again, as in a fresh process
    assert "EMAPG_LEAK_PROBE" not in os.environ
    assert Path.cwd() == CWD_AT_IMPORT
    assert "emapg_leak_probe_plugin" not in sys.modules
    assert torch.get_num_threads() == THREADS_AT_IMPORT


THREADS_AT_IMPORT, CWD_AT_IMPORT = __import__("torch").get_num_threads(), Path.cwd()  # as collection found them


def test_the_restore_sees_through_a_rebound_registry(monkeypatch):
    # a test may rebind a registry (monkeypatch.setattr(..., dict(REWARDS))) or change it in place: both come back
    import emapg_cli.rewards.registry as registry

    state = process_state.snapshot()
    original = registry.REWARDS
    registry.REWARDS = {"only": None}
    original["extra"] = None
    process_state.restore(state)
    assert registry.REWARDS is original and "extra" not in original and "math" in original


def test_an_unlisted_container_that_changes_is_named():
    # the conftest fixture fails a test whose changes the lists miss: `changed_containers` is how it finds them
    probe = types.ModuleType("emapg_cli._probe")
    probe.TABLE, probe.ITEMS, probe.__all__ = {"a": 1}, [1], ["x"]
    sys.modules["emapg_cli._probe"] = probe
    try:
        before = process_state.containers()
        probe.TABLE["b"] = 2  # added to
        probe.ITEMS[0] = 1  # the same value, the same object: unchanged
        after = process_state.containers()
        assert process_state.changed_containers(before, after) == ["emapg_cli._probe:TABLE"]
        assert "emapg_cli._probe:__all__" not in before  # dunders are the module's own
    finally:
        del sys.modules["emapg_cli._probe"]


def _module_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


MUTATORS = {"update", "setdefault", "append", "add", "pop", "clear", "extend", "insert", "remove", "discard", "popitem"}


def _mutated_globals(tree: ast.Module) -> set[str]:
    """Module-level names a function of the module assigns into, deletes from, calls a mutating method of, or
    declares `global`."""
    top, out = _module_names(tree), set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                out.update(node.names)
            targets = getattr(node, "targets", None) or ([node.target] if isinstance(node, ast.AugAssign) else [])
            out.update(t.value.id for t in targets
                       if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in top)
            f = node.func if isinstance(node, ast.Call) else None
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in top and f.attr in MUTATORS:
                out.add(f.value.id)
    return out


def _cached_functions(tree: ast.Module) -> set[str]:
    def cached(d):
        d = d.func if isinstance(d, ast.Call) else d
        return (d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")) in ("lru_cache", "cache")

    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and any(cached(d) for d in n.decorator_list)}


def test_every_piece_of_process_state_in_the_code_is_restored_or_declared_pure():
    # what emapg's own code mutates at module level, and every memoised function, found by reading its source
    restored = set(process_state.REGISTRIES)
    memos = set(process_state.CACHES) | set(process_state.PURE_CACHES)
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        missing += [f"{module}:{n}" for n in sorted(_mutated_globals(tree)) if f"{module}:{n}" not in restored]
        missing += [f"{module}:{n} (cache)" for n in sorted(_cached_functions(tree))
                    if f"{module}:{n}" not in memos and f"{module}:*" not in memos]
    assert missing == [], "add to tests/process_state.py (REGISTRIES, CACHES or PURE_CACHES)"
    assert _mutated_globals(ast.parse("X = {}\ndef f():\n    X['a'] = 1\n")) == {"X"}  # the scan itself finds one


def test_every_listed_name_exists_and_is_restorable():
    for ref in process_state.REGISTRIES:
        assert type(process_state.resolve(ref)) in (dict, list, set), ref
    for ref in process_state.CACHES:
        assert callable(process_state.resolve(ref).cache_clear), ref
