"""Reward plugins: `rollout.reward = module:function` or `path/to/file.py:function`.

The function scores one response: `fn(response: str, example: dict) -> float`, where `example` is
the canonical row (`id`, `question`, `answers`, `source`, `meta`). It runs in the grading pool's
worker processes (grading/pool.py) with the same hard per-call timeout, each worker under an
address-space cap of reward.plugin_memory_mib: a call that raises, returns something that is not a
real number finite in float32, runs past the timeout or out of memory scores 0.0 and is counted as a
failure (the trainer logs `reward/errors` and stops past `reward.max_failure_rate`).

Code runs only when the user says so (docs/reliability.md): `check_ref` checks a reference without
running anything (the file exists or the module is found, and its source defines the name: parsed
with `ast`); `load_object` / `load_plugin` import it, only when a run starts and after the trust
check (config/trust.py), within IMPORT_TIMEOUT_S and inside `bounds.user_code()` (docs/reliability.md,
"User code is contained"). A reward must be a Python function from a file or an installed module
outside Python's standard library.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.machinery
import importlib.util
import inspect
import math
import numbers
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from emapg_cli.errors import UserError

#: Seconds one plugin call may take (like one math-verify comparison).
PLUGIN_TIMEOUT = 5.0
#: Seconds importing a plugin or a user environment's module may take (its top-level code runs then).
IMPORT_TIMEOUT_S = 60.0
#: Each plugin worker's address-space cap in MiB (reward.plugin_memory_mib; the maths graders have 1024).
PLUGIN_MEMORY_MIB = 2048
#: `emapg eval --reward PLUGIN`: the largest fraction of one graded batch's calls that may fail (training's
#: reward.max_failure_rate default); above it the evaluation stops with one line naming the first failure.
EVAL_MAX_FAILURE_RATE = 0.5
#: The largest finite float32 (a reward beyond it would be inf once cast for the advantages).
FLOAT32_MAX = 3.4028234663852886e38
#: A plugin source file larger than this is refused before it is parsed.
MAX_SOURCE_BYTES = 10 * 2**20


def is_plugin_ref(name: str) -> bool:
    """`module:function` or `path/to/file.py:function` (a registered reward name has no colon)."""
    return ":" in name


def _split(ref: str, what: str = "reward", kind: str = "function") -> tuple[str, str]:
    target, _, fn_name = ref.rpartition(":")
    if not target or not fn_name.isidentifier():
        raise UserError(f"{what} '{ref}': expected module:{kind} or path/to/file.py:{kind}")
    return target, fn_name


def resolve_ref(ref: str) -> str:
    """`ref` with a file path made absolute (worker processes and ablate's runs resolve it the same way)."""
    target, fn_name = _split(ref)
    if target.endswith(".py"):
        return f"{Path(target).expanduser().resolve()}:{fn_name}"
    return ref


def _stdlib_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    return [Path(paths[k]).resolve() for k in ("stdlib", "platstdlib") if paths.get(k)]


def in_stdlib(module: Optional[str] = None, path: Optional[Path] = None) -> bool:
    """True for a module of Python's standard library (its top-level package, `builtins` included) or a file
    inside the standard library's folders (but not in site-packages below them)."""
    if module is not None and module.partition(".")[0] in (*sys.stdlib_module_names, "__main__"):
        return True
    if path is not None:
        p = Path(path).resolve()
        return "site-packages" not in p.parts and "dist-packages" not in p.parts and any(p.is_relative_to(d) for d in _stdlib_dirs())
    return False


def _find_module_source(module: str, what: str, ref: str) -> Optional[Path]:
    """The source file of installed module `module`, found without importing it or its parents (None when it
    has no Python source: an extension module); a module that cannot be found is a one-line UserError."""
    if not all(part.isidentifier() for part in module.split(".")):
        raise UserError(f"{what} '{ref}': '{module}' is not a module name")
    spec = None
    parts = module.split(".")
    for i in range(len(parts)):
        name = ".".join(parts[: i + 1])
        loaded = sys.modules.get(name)
        if loaded is not None and getattr(loaded, "__spec__", None) is not None:
            spec = loaded.__spec__
        elif i == 0:  # a top-level name: the finders run, nothing is imported
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
        else:  # a submodule: searched in its parent's folders, without importing the parent (its __init__)
            locations = spec.submodule_search_locations if spec is not None else None
            spec = importlib.machinery.PathFinder.find_spec(name, list(locations)) if locations else None
        if spec is None:
            raise UserError(f"{what} module '{module}' not found (not installed, or not on the Python path)")
    origin = getattr(spec, "origin", None)
    if origin and origin.endswith(".py") and Path(origin).is_file():
        return Path(origin)
    return None


def _top_level_names(tree: ast.Module) -> tuple[dict[str, ast.AST], bool]:
    """Names bound at a module's top level (also inside top-level if/try blocks), and whether it star-imports."""
    names: dict[str, ast.AST] = {}
    star = False

    def visit(body: list) -> None:
        nonlocal star
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names.setdefault(n.id, node)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if alias.name == "*":
                        star = True
                    else:
                        names.setdefault(alias.asname or alias.name.partition(".")[0], node)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                for extra in (getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                    visit(extra)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return names, star


def _binds_two_positionals(fn: ast.FunctionDef) -> bool:
    """Whether `def fn(...)` can be called as fn(response, example) (inspect.Signature.bind, read from the source)."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    required = len(positional) - len(a.defaults)
    kw_required = sum(d is None for d in a.kw_defaults)
    return (len(positional) >= 2 or a.vararg is not None) and required <= 2 and kw_required == 0


def check_ref(ref: str, what: str = "reward plugin", kind: str = "function", agent: bool = False) -> str:
    """Check plugin reference `ref` WITHOUT running any of its code, and return it with a file path made absolute.

    A file must exist outside Python's standard library and define `name` at its top level (parsed with `ast`); a
    module must be installed, outside the standard library (its top-level package is not in
    `sys.stdlib_module_names`), found without importing it or its parents, and its source (when it has one) must
    define `name`. A `def` where a class is expected (or the reverse), or a function that cannot take
    (response, example), is refused here too. An assignment or import of `name` is accepted here and checked
    when the run imports it (`load_plugin`, `environments.load_env_class`). Else a one-line UserError. `agent`: the
    function is an agent, fn(client, example) (docs/agents.md), not a reward."""
    target, name = _split(ref, what.split()[0], kind)
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise UserError(f"{what} file not found: {path}")
        if in_stdlib(path=path):
            raise UserError(f"{what} '{ref}': {path} is part of Python's standard library; a {kind} must come from "
                            "your own file or an installed non-standard-library module")
        source: Optional[Path] = path
        ref = f"{path.resolve()}:{name}"
    else:
        if in_stdlib(module=target):
            raise UserError(f"{what} '{ref}': '{target.partition('.')[0]}' is Python's standard library; a {kind} must "
                            "come from your own file or an installed non-standard-library module")
        source = _find_module_source(target, what, ref)
    if source is None:
        return ref
    try:
        if source.stat().st_size > MAX_SOURCE_BYTES:
            raise UserError(f"{what} {source}: larger than {MAX_SOURCE_BYTES // 2**20} MiB")
        tree = ast.parse(source.read_bytes(), filename=str(source))
    except UserError:
        raise
    except SyntaxError as e:
        raise UserError(f"{what} {source} is not valid Python: {e.msg} (line {e.lineno})") from None
    except (OSError, ValueError, RecursionError, MemoryError) as e:
        raise UserError(f"{what} {source} cannot be read as Python: {type(e).__name__}: {e}") from None
    names, star = _top_level_names(tree)
    node = names.get(name)
    if node is None:
        if star:
            return ref  # `from x import *` may bind it: checked when the run imports it
        raise UserError(f"{what} '{ref}': no {kind} '{name}' in {target}")
    if kind == "function":
        role, args = ("an agent", "(client, example)") if agent else ("a reward", "(response, example)")
        if isinstance(node, ast.ClassDef):
            raise UserError(f"{what} '{ref}': '{name}' is a class; {role} is a function fn{args}")
        if isinstance(node, ast.AsyncFunctionDef):
            raise UserError(f"{what} '{ref}': '{name}' is an async function; {role} is a plain function")
        if isinstance(node, ast.FunctionDef) and not _binds_two_positionals(node):
            raise UserError(f"{what} '{ref}' must accept " + ("(client, example)" if agent else "(response: str, example: dict)"))
    elif kind == "class" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise UserError(f"{what} '{ref}': '{name}' is a function; expected a class")
    return ref


def static_class_int(ref: str, attr: str) -> Optional[int]:
    """The int literal a class body assigns to `attr` (`max_turns = 3`), read from the source without running it;
    None when the source, the class or a literal int is not there (then the caller's default applies)."""
    target, name = _split(ref, "rollout.env", "class")
    try:
        source = Path(target).expanduser() if target.endswith(".py") else _find_module_source(target, "rollout.env", ref)
        if source is None:
            return None
        tree = ast.parse(source.read_bytes())
    except (UserError, OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    node = _top_level_names(tree)[0].get(name)
    if not isinstance(node, ast.ClassDef):
        return None
    for stmt in node.body:
        if (isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == attr for t in stmt.targets)
                and isinstance(stmt.value, ast.Constant) and type(stmt.value.value) is int):
            return stmt.value.value
    return None


def load_object(ref: str, what: str = "reward plugin", kind: str = "function") -> Any:
    """The object `ref` (`module:name` or `path/to/file.py:name`) names, the module imported once per file (a
    file is loaded under a private module name). This RUNS the plugin's code: call it only when a run starts,
    after the trust check. A missing file, module or name, or an import that fails (an exception, or a
    `sys.exit` in the module) is a one-line UserError that starts with `what` (`reward plugin`, `rollout.env`).
    Shared by reward plugins and user environments."""
    target, name = _split(ref, what.split()[0], kind)
    check_ref(ref, what, kind)  # nothing from the standard library, before anything runs
    module = _load_module(target, what)
    if not hasattr(module, name):
        raise UserError(f"{what} '{ref}': no {kind} '{name}' in {target}")
    return getattr(module, name)


def _import_within(load: Callable[[], Any], what: str, where: str) -> Any:
    """`load()` (an import: the user's top-level code runs) in a helper thread, inside `bounds.user_code()`; past
    IMPORT_TIMEOUT_S a one-line UserError (the thread is left behind: the run stops). Its exception, or a sys.exit,
    is a one-line UserError too."""
    from emapg_cli.bounds import user_code

    done, box = threading.Event(), {}

    def run() -> None:
        try:
            with user_code():
                box["value"] = load()
        except BaseException as e:  # noqa: BLE001 - reported by the caller, in one line
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name="emapg-import").start()
    if not done.wait(IMPORT_TIMEOUT_S):
        raise UserError(f"{what} {where} did not finish importing within {IMPORT_TIMEOUT_S:g} s (its top-level code "
                        "waits or loops; do slow set-up on the first call instead)")
    e = box.get("error")
    if isinstance(e, SystemExit):
        raise UserError(f"{what} {where} called sys.exit({e.code!r}) while it was imported")
    if e is not None:
        raise UserError(f"{what} {where} failed to import: {type(e).__name__}: {e}")
    return box["value"]


@functools.lru_cache(maxsize=None)
def _load_module(target: str, what: str):
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise UserError(f"{what} file not found: {path}")
        prefix = "emapg_reward_plugin" if what == "reward plugin" else "emapg_plugin"
        name = f"{prefix}_{abs(hash(str(path.resolve())))}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[name] = module
        try:  # sys.exit(7) at import is the plugin's failure, not emapg's exit code
            _import_within(lambda: spec.loader.exec_module(module), what, str(path))  # type: ignore[union-attr]
        except UserError:
            sys.modules.pop(name, None)
            raise
        return module
    return _import_within(lambda: importlib.import_module(target), what, f"module '{target}'")


@functools.lru_cache(maxsize=None)
def load_plugin(ref: str) -> Callable[[str, dict], Any]:
    """The function `ref` names, imported (this runs the plugin's code: only at the start of a trusted run).
    It must be a Python function (`def` or `lambda`: not a class, a builtin or another callable) defined
    outside the standard library, callable as fn(response, example); else a one-line UserError."""
    return load_function(ref, "reward plugin", ("response", "example"), "a reward")


def load_function(ref: str, what: str, params: tuple[str, str], role: str) -> Callable:
    """The user function `ref` names, imported and checked (`load_plugin`'s rules): a Python function of the user's
    own, outside the standard library, callable with the two positional `params`; `what` starts each one-line
    UserError (`reward plugin`, `rollout.agent`), `role` names what it must be (`a reward`, `an agent`)."""
    fn = load_object(ref, what)
    target, fn_name = _split(ref, what.split()[0])
    if not callable(fn):
        raise UserError(f"{what} '{ref}': no function '{fn_name}' in {target}")
    if not inspect.isfunction(fn):
        raise UserError(f"{what} '{ref}': '{fn_name}' is a {type(fn).__name__}, not a Python function "
                        "(def) of your own")
    code_file = getattr(getattr(fn, "__code__", None), "co_filename", "")
    if in_stdlib(module=getattr(fn, "__module__", None) or "") or (code_file and in_stdlib(path=Path(code_file))):
        raise UserError(f"{what} '{ref}': '{fn_name}' is a function of Python's standard library "
                        f"({fn.__module__}.{fn.__qualname__}); {role} must be your own function")
    try:
        inspect.signature(fn).bind(*params)
    except (TypeError, ValueError):
        raise UserError(f"{what} '{ref}' must accept ({params[0]}, {params[1]})" if what != "reward plugin" else
                        f"{what} '{ref}' must accept (response: str, example: dict)") from None
    return fn


def reward_value(value: Any) -> float:
    """A plugin's return value as a float: a real number (int, float, bool as 0/1, a numpy number; not a string
    such as "1.0", not None) that stays finite in float32 (|value| <= 3.4028235e38); else ValueError/TypeError."""
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {str(value)[:60]!r}, not a number")
    try:
        v = float(value)
    except OverflowError:  # an int past float64
        v = math.inf
    if not math.isfinite(v) or abs(v) > FLOAT32_MAX:
        raise ValueError(f"returned {str(value)[:60]!r}, not finite in float32")
    return v


def call_plugin(ref: str, response: str, example: dict) -> float:
    """One plugin call (runs in a pool worker): a real number finite in float32, else it raises (scored 0, counted)."""
    return reward_value(load_plugin(ref)(response, example))


class PooledReward:
    """Third-party scoring code run over the grading pool (grading/pool.py), never in emapg's process: `call(*task)`
    per response in killable worker processes with a per-call time limit and an address-space cap, each worker
    warmed up with `warmup(*warmup_args)`. A call that raises, times out or kills its worker scores 0 and is counted
    (`errors`, `stats`). Subclasses say what a task is (`tasks`) and name themselves (`label`). Started on the first
    call; `close()` stops it."""

    label = "reward"

    def __init__(self, call: Callable, warmup: Callable, warmup_args: tuple, workers: Optional[int], timeout: float,
                 memory_mib: int) -> None:
        self._call, self._warmup, self._warmup_args = call, warmup, warmup_args
        self.workers, self.timeout, self.memory_mib = workers, timeout, memory_mib
        self._pool = None
        self.batch_first_error = ""  # the first failure of the last call ("Type: message"), "" when none

    @property
    def errors(self) -> int:
        """Calls that raised, returned a non-number, timed out or killed their worker (each scored 0)."""
        st = self.stats
        return st.errors + st.timeouts + st.crashes

    @property
    def timeouts(self) -> int:
        """Calls cut at the time limit (scored 0; counted in `errors` too)."""
        return self.stats.timeouts

    @property
    def stats(self):
        """The grading pool's counts (`grading.pool.PoolStats`; all 0 before the first call)."""
        from emapg_cli.grading.pool import PoolStats

        return self._pool.stats if self._pool is not None else PoolStats()

    @property
    def last_error(self) -> str:
        """The last failed call's error ("Type: message", or a timeout), "" when none."""
        return self.stats.last_error

    def tasks(self, responses: Sequence[str], examples: Sequence[Any]) -> list[tuple]:
        raise NotImplementedError

    def __call__(self, responses: Sequence[str], examples: Sequence[Any]) -> list[float]:
        from emapg_cli.grading.pool import TimeoutPool, WorkerStartError
        from emapg_cli.grading.verify import default_workers

        if self._pool is None:  # each worker warms up (imports) before its first call (not timed as one)
            self._pool = TimeoutPool(self._call, workers=self.workers or default_workers(), timeout=self.timeout, default=None,
                                     warmup=self._warmup, warmup_args=self._warmup_args, memory_limit=self.memory_mib << 20)
        pool = self._pool
        self.batch_first_error = ""

        def note(index: int, value: Any) -> None:  # the pool has just recorded this failure as its last error
            if value is None and not self.batch_first_error:
                self.batch_first_error = pool.stats.last_error

        try:
            values = pool.map(self.tasks(responses, examples), on_result=note)
        except WorkerStartError as e:  # e.g. its import needs more than the memory cap
            raise UserError(f"{self.label}: its worker processes cannot start ({e.reason[:200]}); each may use "
                            f"reward.plugin_memory_mib = {self.memory_mib} MiB (0: no cap)") from None
        return [0.0 if v is None else float(v) for v in values]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class PluginReward(PooledReward):
    """A per-sample plugin run over the grading pool (`PooledReward`)."""

    def __init__(self, ref: str, workers: Optional[int] = None, timeout: float = PLUGIN_TIMEOUT,
                 memory_mib: int = PLUGIN_MEMORY_MIB) -> None:
        self.ref = check_ref(ref)
        load_plugin(self.ref)  # import it here, in the parent (the run has started): a failure is one line
        self.label = f"reward plugin {self.ref}"
        super().__init__(call_plugin, load_plugin, (self.ref,), workers, timeout, memory_mib)

    def tasks(self, responses: Sequence[str], examples: Sequence[Any]) -> list[tuple]:
        return [(self.ref, r, e.model_dump() if hasattr(e, "model_dump") else dict(e)) for r, e in zip(responses, examples)]
