"""Process-wide state a test must not leave behind: tests/conftest.py restores it after every test.

A serial `pytest -q` runs every test file in one interpreter, so a test that registers a reward, chdirs or sets
torch's threads changes what every later test sees (issue 32: `test_digit`, registered by an in-process training
test, showed up in a later test's list of known rewards). What is restored:

- REGISTRIES: module-level containers that emapg fills by name or adds to while it runs (rewards, environments,
  estimators and their dispatch tables, built-in benches, once-per-process warnings, claimed output folders).
  Engines and retrievers have no registry: `engines.make_engine` and `retrieval.make_retriever` choose by name
  in code.
- CACHES: memoised look-ups whose answer depends on files a test may write (dataset cards, plugin modules), cleared;
  the modules plugins were imported as (`emapg_*` outside `emapg_cli`) are dropped from sys.modules.
- the environment variables, the working directory and torch's intra-op thread count.

`changed_containers` finds what the lists above miss: every dict, list or set at the top of a loaded emapg_cli
module whose contents a test changed (conftest.py fails that test); tests/test_process_state.py checks that every
module-level container or memo that emapg's own code mutates is listed here.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
from typing import Any

#: Module-level containers that code fills or mutates at run time ("module:name"), restored in place.
REGISTRIES = (
    "emapg_cli.rewards.registry:REWARDS",  # register_reward (tests/train_launcher.py registers test_digit, test_nan)
    "emapg_cli.agents.environments:BUILTINS",  # environments by name
    "emapg_cli.estimator_names:INFO",  # estimators by name
    "emapg_cli.kl.registry:_SAMPLED",  # the estimators' tensor functions by name
    "emapg_cli.kl.registry:_TOPK",
    "emapg_cli.kl.registry:_TRUNCATED",
    "emapg_cli.kl.registry:_EXACT",
    "emapg_cli.evaluation.naming:BUILTIN_BENCHES",  # --bench toy, toy-search, toy-tools
    "emapg_cli.config.loading:_warned_remote_code",  # the trust_remote_code warning, once per source and process
    "emapg_cli.outputs:_claimed",  # output folders this process holds
    "emapg_cli.outputs:_last",
)
#: Memoised functions whose answers depend on files a test writes, cleared after every test.
CACHES = (
    "emapg_cli.datasets.registry:_cards",  # the dataset cards of a folder
    "emapg_cli.rewards.plugin:_load_module",  # a plugin's file or module, imported
    "emapg_cli.rewards.plugin:load_plugin",
)
#: Memoised pure functions (same arguments, same answer, whatever a test did): kept.
PURE_CACHES = (
    "emapg_cli.agents.agent:_http",  # an agent process's connection pool (made in agent processes only)
    "emapg_cli.agents.protocol:*",  # compiled tag patterns
    "emapg_cli.grading.verify:*",  # math-verify's parser, parsed gold answers
    "emapg_cli.kl.fused:_float32_out",  # whether this torch's CUDA GEMMs can return float32 (a property of the build)
    "emapg_cli.models.hub:*",  # whether a string is a hub id
    "emapg_cli.datasets.reasoning_gym_data:_dataset",  # reasoning-gym datasets rebuilt from (task, config, size, seed): a function of its key
)


def _split(ref: str) -> tuple[str, str]:
    module, name = ref.split(":")
    return module, name


def _loaded(ref: str) -> tuple[Any, str] | None:
    """(module, attribute name) when the module is imported already (a cache nobody imported holds nothing)."""
    module, name = _split(ref)
    mod = sys.modules.get(module)
    return (mod, name) if mod is not None else None


def snapshot() -> dict[str, Any]:
    """The restorable state now: each registry (the object and a shallow copy of it), the environment, the working
    directory, the imported modules and torch's thread count (when torch is imported: kl.registry imports it)."""
    registries = {}
    for ref in REGISTRIES:  # imported here if no test has yet: a registry first imported by a test is restored too
        obj = resolve(ref)
        registries[ref] = (obj, copy.copy(obj))
    torch = sys.modules.get("torch")
    return {"registries": registries, "environ": dict(os.environ), "cwd": os.getcwd(), "modules": set(sys.modules),
            "threads": torch.get_num_threads() if torch is not None else None}


def _refill(obj: Any, saved: Any) -> None:
    if isinstance(obj, dict):
        obj.clear()
        obj.update(saved)
    elif isinstance(obj, (set, list)):
        obj.clear()
        obj.extend(saved) if isinstance(obj, list) else obj.update(saved)
    else:  # pragma: no cover - REGISTRIES holds containers only (tests/test_process_state.py)
        raise TypeError(f"cannot restore a {type(obj).__name__}")


def restore(state: dict[str, Any]) -> None:
    """Put back what `snapshot` saw (registries in place and rebound to the same objects), clear CACHES and drop the
    plugin modules imported since."""
    for ref, (obj, saved) in state["registries"].items():
        module, name = _split(ref)
        setattr(sys.modules[module], name, obj)
        if obj != saved:
            _refill(obj, saved)
    for ref in CACHES:
        found = _loaded(ref)
        if found is not None:
            getattr(*found).cache_clear()
    for name in set(sys.modules) - state["modules"]:
        if name.startswith("emapg_") and not name.startswith("emapg_cli"):
            del sys.modules[name]  # an imported plugin file (rewards.plugin names them emapg_*)
    if dict(os.environ) != state["environ"]:
        os.environ.clear()
        os.environ.update(state["environ"])
    if os.getcwd() != state["cwd"]:
        os.chdir(state["cwd"])
    torch = sys.modules.get("torch")
    if state["threads"] is not None and torch.get_num_threads() != state["threads"]:
        torch.set_num_threads(state["threads"])


def _fingerprint(value: Any) -> tuple:
    """What a container holds, by identity (no element's __eq__ runs: arrays, tensors)."""
    if isinstance(value, dict):
        return tuple((type(k), id(k), id(v)) for k, v in value.items())
    if isinstance(value, list):
        return tuple(id(v) for v in value)
    return tuple(sorted(id(v) for v in value))


def containers() -> dict[str, tuple]:
    """Every dict, list or set at the top of a loaded emapg_cli module: "module:name" -> its fingerprint."""
    out = {}
    for name, mod in list(sys.modules.items()):
        if mod is None or not (name == "emapg_cli" or name.startswith("emapg_cli.")):
            continue
        for attr, value in list(vars(mod).items()):
            if type(value) in (dict, list, set) and not attr.startswith("__"):
                out[f"{name}:{attr}"] = _fingerprint(value)
    return out


def changed_containers(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """The containers of `before` whose contents differ in `after` (modules first imported in between are new,
    not changed)."""
    return sorted(ref for ref, value in before.items() if ref in after and after[ref] != value)


def resolve(ref: str) -> Any:
    """The object "module:name" names (imports the module)."""
    module, name = _split(ref)
    return getattr(importlib.import_module(module), name)
