"""Reward plugins: `rollout.reward = module:function` or `path/to/file.py:function`.

The function scores one response: `fn(response: str, example: dict) -> float`, where `example` is
the canonical row (`id`, `question`, `answers`, `source`, `meta`). It runs in the grading pool's
worker processes (grading/pool.py) with the same hard per-call timeout: a call that raises, returns
something that is not a finite number, or runs past the timeout scores 0.0 and is counted in
`errors` (the trainer logs it as `reward/errors`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from emapg_cli.errors import UserError

#: Seconds one plugin call may take (like one math-verify comparison).
PLUGIN_TIMEOUT = 5.0


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


def load_object(ref: str, what: str = "reward plugin", kind: str = "function") -> Any:
    """The object `ref` (`module:name` or `path/to/file.py:name`) names, the module imported once per file (a
    file is loaded under a private module name). A missing file, module or name is a one-line UserError that
    starts with `what` (`reward plugin`, `rollout.env`). Shared by reward plugins and user environments."""
    target, name = _split(ref, what.split()[0], kind)
    module = _load_module(target, what)
    if not hasattr(module, name):
        raise UserError(f"{what} '{ref}': no {kind} '{name}' in {target}")
    return getattr(module, name)


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
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as e:
            raise UserError(f"{what} {path} failed to import: {type(e).__name__}: {e}") from None
        return module
    try:
        return importlib.import_module(target)
    except Exception as e:
        raise UserError(f"{what} module '{target}' failed to import: {type(e).__name__}: {e}") from None


@functools.lru_cache(maxsize=None)
def load_plugin(ref: str) -> Callable[[str, dict], Any]:
    """The function `ref` names; a missing file, module or function, or a wrong signature, is a UserError."""
    fn = load_object(ref)
    if not callable(fn):
        target, fn_name = _split(ref)
        raise UserError(f"reward plugin '{ref}': no function '{fn_name}' in {target}")
    try:
        inspect.signature(fn).bind("response", {})
    except TypeError:
        raise UserError(f"reward plugin '{ref}' must accept (response: str, example: dict)") from None
    except ValueError:  # builtins without a signature: accept
        pass
    return fn


def validate_ref(ref: str) -> None:
    """Config-time check of a plugin reference (importable, callable with (response, example))."""
    load_plugin(resolve_ref(ref))


def call_plugin(ref: str, response: str, example: dict) -> float:
    """One plugin call (runs in a pool worker): a finite float, else it raises (scored 0, counted)."""
    value = float(load_plugin(ref)(response, example))
    if not math.isfinite(value):
        raise ValueError(f"reward {value} is not finite")
    return value


class PluginReward:
    """A per-sample plugin run over the grading pool (started on the first call; `close()` stops it)."""

    def __init__(self, ref: str, workers: Optional[int] = None, timeout: float = PLUGIN_TIMEOUT) -> None:
        validate_ref(ref)  # fail here, in the parent, with one line
        self.ref = resolve_ref(ref)
        self.workers, self.timeout = workers, timeout
        self._pool = None

    @property
    def errors(self) -> int:
        """Calls that raised, returned a non-number or timed out (each scored 0)."""
        if self._pool is None:
            return 0
        st = self._pool.stats
        return st.errors + st.timeouts + st.crashes

    @property
    def stats(self):
        """The grading pool's counts (`grading.pool.PoolStats`; all 0 before the first call)."""
        from emapg_cli.grading.pool import PoolStats

        return self._pool.stats if self._pool is not None else PoolStats()

    @property
    def last_error(self) -> str:
        """The last failed call's error ("Type: message", or a timeout), "" when none."""
        return self.stats.last_error

    def __call__(self, responses: Sequence[str], examples: Sequence[Any]) -> list[float]:
        from emapg_cli.grading.pool import TimeoutPool
        from emapg_cli.grading.verify import default_workers

        if self._pool is None:
            self._pool = TimeoutPool(call_plugin, workers=self.workers or default_workers(), timeout=self.timeout, default=0.0)
        tasks = [(self.ref, r, e.model_dump() if hasattr(e, "model_dump") else dict(e)) for r, e in zip(responses, examples)]
        return [float(v) for v in self._pool.map(tasks)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
