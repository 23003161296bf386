"""Code runs only when the user says so (docs/reliability.md, "Code runs only when you say so").

A run imports user code for three keys: `rollout.reward` (a plugin `FILE.py:fn` / `module:fn`), `rollout.env`
(a user environment `FILE.py:Class` / `module:Class`) and `rollout.agent` (an agent `FILE.py:fn`, docs/agents.md). Built-in names (`math`, `em`, `calc`, ...) are emapg's own
code and need no trust. A plugin reference runs when it was named on THIS command line (`--set KEY=REF`, or
`emapg eval --reward/--env/--agent REF`); one that came from anywhere else (a `--config` file, a preset file, a run's saved
config.yaml on `train --resume`, an ablation study file) runs only with `--trust-code`. The boolean key
`model.trust_remote_code: true` (the model's folder or hub repository runs its own Python code when loaded) follows
the same rule: given on this command line (`--set model.trust_remote_code=true`) or with `--trust-code`.

    refs = code_refs(cfg)                                 # {"rollout.reward": "/abs/score.py:fn", ...}
    named = named_refs(set_)                              # the refs the --set options named
    require_trust(refs, named, trust_code, "the config file")   # else one-line UserError naming the file

Nothing here imports a plugin; `rewards.plugin.load_plugin` / `agents.environments.load_env_class` do, after it.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from emapg_cli.errors import UserError

#: The config keys whose value can name user code.
CODE_KEYS = ("rollout.reward", "rollout.env", "rollout.agent")
#: The boolean key that lets the model's own repository run code; its "reference" is the text "true".
REMOTE_CODE_KEY = "model.trust_remote_code"


def plugin_ref(key: str, value: Any) -> str | None:
    """`value` of `key` as the absolute plugin reference a run would import, None for a built-in name."""
    from emapg_cli.agents.environments import BUILTINS, NATIVE
    from emapg_cli.rewards.plugin import resolve_ref

    if not isinstance(value, str) or ":" not in value:
        return None  # a registered reward, or a malformed value the config's own validation reports
    if key == "rollout.env" and (value in NATIVE or value in BUILTINS):
        return None
    try:
        return resolve_ref(value)
    except UserError:
        return None


def code_refs(cfg: Any) -> dict[str, str]:
    """{config key: plugin reference} of the user code `cfg` (a Config) would import when its run starts, with
    {"model.trust_remote_code": "true"} when the model's repository may run its own code."""
    refs = code_refs_of(reward=cfg.rollout.reward, env=cfg.rollout.env, agent=cfg.rollout.agent)
    if cfg.model.trust_remote_code is True:
        refs[REMOTE_CODE_KEY] = "true"
    return refs


def code_refs_of(reward: str | None = None, env: str | None = None, agent: str | None = None) -> dict[str, str]:
    """`code_refs` of a reward, an environment and an agent given as values (`emapg eval --reward/--env/--agent`)."""
    refs = {"rollout.reward": plugin_ref("rollout.reward", reward), "rollout.env": plugin_ref("rollout.env", env),
            "rollout.agent": plugin_ref("rollout.agent", agent)}
    return {k: v for k, v in refs.items() if v is not None}


def named_refs(overrides: Iterable[str] = (), **options: str | None) -> dict[str, str]:
    """{config key: plugin reference} named on this command line: by `--set KEY=REF` items (the last one of a key
    wins, as in the config) and by options given as keyword arguments (`reward=` for rollout.reward, `env=` for
    rollout.env, `agent=` for rollout.agent: `emapg eval --reward/--env/--agent`)."""
    from emapg_cli.config.loading import parse_override

    named: dict[str, str] = {}
    for item in overrides:
        try:
            parts, value = parse_override(item)  # the value as the config reads it (YAML: quotes removed)
        except UserError:
            continue  # the config's own parsing reports it
        key = ".".join(parts)
        if key == REMOTE_CODE_KEY or key in CODE_KEYS:
            ref = ("true" if value is True else None) if key == REMOTE_CODE_KEY else plugin_ref(key, value)
            if ref is not None:
                named[key] = ref
            else:
                named.pop(key, None)
    for name, value in options.items():
        key = f"rollout.{name}"
        ref = plugin_ref(key, value) if key in CODE_KEYS and value is not None else None
        if ref is not None:
            named[key] = ref
    return named


def untrusted(refs: Mapping[str, str], named: Mapping[str, str], trust_code: bool, source: str = "a config file") -> str | None:
    """The one line refusing the first plugin reference of `refs` that `named` (this command line) does not hold,
    None when every one may run (`trust_code`: `--trust-code`). `source` says where the configuration came from."""
    if trust_code:
        return None
    for key, ref in refs.items():
        if named.get(key) != ref and key == REMOTE_CODE_KEY:
            return (f"{key} = true comes from {source}, not from this command line: the model's folder or "
                    f"repository may run its own Python code only with --trust-code (or give --set {key}=true)")
        if named.get(key) != ref:
            file = ref.rpartition(":")[0]
            return (f"{key} = {ref} comes from {source}, not from this command line: its code ({file}) runs "
                    f"only with --trust-code (or name it with --set {key}=...)")
    return None


def require_trust(refs: Mapping[str, str], named: Mapping[str, str], trust_code: bool, source: str = "a config file") -> None:
    """Refuse (one-line UserError, `untrusted`) a plugin reference of `refs` that `named` (this command line) does
    not hold, unless `trust_code` (`--trust-code`)."""
    problem = untrusted(refs, named, trust_code, source)
    if problem is not None:
        raise UserError(problem)


def load_code(refs: Mapping[str, str]) -> None:
    """Import the user code of `refs` (`code_refs`) and check it (a reward is a Python function of the user's own,
    an environment class keeps its contract): where a trusted run starts, before its folder is claimed. A failure
    (also an exception or `sys.exit` at import) is a one-line UserError."""
    from emapg_cli.agents.environments import load_env_class
    from emapg_cli.rewards.plugin import load_plugin

    for key, ref in refs.items():
        if key == "rollout.reward":
            try:
                load_plugin(ref)
            except UserError as e:
                raise UserError(f"rollout.reward: {e}") from None
        elif key == "rollout.env":
            load_env_class(ref)
        elif key == "rollout.agent":
            from emapg_cli.agents.agent import load_agent

            load_agent(ref)
        # (model.trust_remote_code imports nothing here: the model's loader runs that code, trusted now)
