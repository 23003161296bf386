"""Environments: the one factory that says how a prompt becomes a (possibly multi-turn) response.

`rollout.env` names the environment (docs/environments.md):

  single          the default: one engine call per prompt, the response is the completion (no observations)
  search          the Search-R1 agent (agents/search.py) with the `search` section's settings; `search.enabled=true`
                  is the same choice
  calc            the calculator tool of the toy arithmetic task (`emapg_cli.agents.calculator:CalculatorEnv`)
  FILE.py:Class   a user environment (or `module:Class`): `Class(example)` per episode, `step(text) -> str | None`,
                  optional `stop`, `max_turns`, `reward(text)`, `invalid`, `metrics()`, `template`; run by
                  `agents.runner.EnvRunner`

`make_environment` builds any of them for training (train/trainer.py), `emapg eval` (evaluation/runner.py) and
the toys (tasks/toy_search/prepare.py); each gives an `Environment`: the user-message rule, `bind(engine)` (what
rollouts sample from), its `env/*` metrics and its turn limit. A named built-in's module is imported only when
it is chosen, so a missing optional module fails only then.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from emapg_cli.errors import UserError

#: Built-in user-contract environments by name (imported lazily, when chosen).
BUILTINS: dict[str, str] = {"calc": "emapg_cli.agents.calculator:CalculatorEnv"}
#: Names that are not user-contract classes.
NATIVE = ("single", "search")
#: A user environment's turn limit when its class sets no `max_turns` (the search agent's default too).
DEFAULT_MAX_TURNS = 4


def check_env(name: str) -> str:
    """`name` as a run records it (a built-in name unchanged, a file path made absolute), checked WITHOUT running
    any of its code (`rewards.plugin.check_ref`: the file or module is there, outside the standard library, and
    defines the class); the class itself is imported and its contract checked when a run starts
    (`load_env_class`). Else a one-line UserError."""
    from emapg_cli.rewards.plugin import check_ref

    if name in NATIVE or name in BUILTINS:
        return name
    if ":" not in name:
        raise UserError(f"rollout.env: unknown environment '{name}' (known: {', '.join([*NATIVE, *BUILTINS])}; "
                        "or path/to/file.py:Class / module:Class)")
    return check_ref(name, "rollout.env", "class")


def load_env_class(name: str) -> type:
    """The class `name` (a BUILTINS name, FILE.py:Class or module:Class) names, its contract attributes checked.
    This imports a user's file or module (runs its code): only when a run starts, after the trust check."""
    from emapg_cli.rewards.plugin import in_stdlib, load_object

    ref = BUILTINS.get(name, name)
    cls = load_object(ref, "rollout.env", "class")
    where = f"rollout.env {ref}"
    if not isinstance(cls, type):
        raise UserError(f"{where}: expected a class, got {type(cls).__name__}")
    if in_stdlib(module=cls.__module__):
        raise UserError(f"{where}: {cls.__module__}.{cls.__qualname__} is a class of Python's standard library")
    if not callable(getattr(cls, "step", None)):
        raise UserError(f"{where}: the class has no step(self, text) -> str | None method")
    turns = getattr(cls, "max_turns", DEFAULT_MAX_TURNS)
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise UserError(f"{where}.max_turns must be an int >= 1, got {turns!r}")
    stop = getattr(cls, "stop", ())
    if isinstance(stop, str) or not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise UserError(f"{where}.stop must be a list of non-empty strings, got {stop!r}")
    template = getattr(cls, "template", None)
    if template is not None and (not isinstance(template, str) or "{question}" not in template):
        raise UserError(f"{where}.template must be a string with a {{question}} placeholder")
    return cls


def grades_itself(name: str) -> bool:
    """True when environment `name` grades its own episodes: a user-contract class (run by `EnvRunner`: a built-in
    like `calc`, or FILE.py:Class / module:Class) with a `reward` method."""
    return name not in NATIVE and callable(getattr(load_env_class(name), "reward", None))


def env_max_turns(name: str, search_max_turns: int) -> int:
    """The turn limit of environment `name`: 1 (single), search.max_turns (search: then one final turn without
    search), a user class's `max_turns` (default DEFAULT_MAX_TURNS). What `emapg train --dry-run` counts T with: a
    user file's class is not imported (a dry run runs no plugin code); its `max_turns = N` is read from the source."""
    from emapg_cli.rewards.plugin import static_class_int

    if name == "single":
        return 1
    if name == "search":
        return search_max_turns
    if name in BUILTINS:
        return int(getattr(load_env_class(name), "max_turns", DEFAULT_MAX_TURNS))
    turns = static_class_int(name, "max_turns")
    return turns if turns is not None and turns >= 1 else DEFAULT_MAX_TURNS


class Environment:
    """What a run needs from an environment. `bind(engine)` is Engine-shaped (`generate(prompts, params)`), or for
    a user environment needs each prompt's example too: call it through `generate` below."""

    name = "single"
    multi_turn = False  # its responses are `Episode`s with observations (env/* metrics)
    has_reward = False  # its episodes carry their own reward (Episode.env_reward), used instead of rollout.reward
    max_turns = 1

    def user_message(self) -> Optional[Callable[[str], str]]:
        """question -> user message, or None (the question alone)."""
        return None

    def bind(self, engine) -> Any:
        return engine

    def metrics(self, episodes: Sequence[Any]) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class SearchEnvironment(Environment):
    """The Search-R1 agent: `search.max_turns` search turns, then one final turn without search."""

    name, multi_turn = "search", True

    def __init__(self, tokenizer, retriever, settings, max_turns: int):
        from emapg_cli.agents.search import SearchAgent

        self.settings, self.max_turns = settings, max_turns
        self.agent = SearchAgent(tokenizer, retriever, settings, max_turns)

    def user_message(self):
        from emapg_cli.agents.protocol import format_question, load_template

        template = load_template(self.settings.prompt_template)
        return lambda question: format_question(question, template)

    def bind(self, engine):
        return self.agent.bind(engine)

    def metrics(self, episodes):
        from emapg_cli.agents.runner import env_metrics
        from emapg_cli.agents.search import search_metrics

        return {**search_metrics(episodes, self.agent.latencies), **env_metrics(episodes)}

    def close(self) -> None:
        self.agent.retriever.close()


class UserEnvironment(Environment):
    """A class keeping the user contract (a file's, or a built-in like `calc`), run by `EnvRunner`."""

    multi_turn = True

    def __init__(self, tokenizer, name: str, max_turns: Optional[int], max_context_tokens: int, timeout_s: float):
        from emapg_cli.agents.runner import EnvRunner

        cls = load_env_class(name)
        self.name = name
        self.max_turns = max_turns if max_turns is not None else int(getattr(cls, "max_turns", DEFAULT_MAX_TURNS))
        self.template: Optional[str] = getattr(cls, "template", None)
        self.runner = EnvRunner(tokenizer, cls, BUILTINS.get(name, name), self.max_turns, max_context_tokens, timeout_s)
        self.has_reward = self.runner.has_reward

    def user_message(self):
        template = self.template
        return None if template is None else (lambda question: template.replace("{question}", question))

    def bind(self, engine):
        return BoundEnv(self.runner, engine)

    def metrics(self, episodes):
        from emapg_cli.agents.runner import env_metrics

        return env_metrics(episodes)


class AgentEnvironment(Environment):
    """`rollout.agent=FILE.py:fn` (agents/agent.py): an OpenAI-client agent per episode, graded by its own reward."""

    name, multi_turn, has_reward = "agent", True, True

    def __init__(self, tokenizer, settings, max_context_tokens: int):
        from emapg_cli.agents.agent import AgentRunner

        self.settings = settings
        self.runner = AgentRunner(tokenizer, settings, max_context_tokens)

    def bind(self, engine):
        return BoundEnv(self.runner, engine)

    def metrics(self, episodes, where: str = "of this step"):
        """`agent/*`; stops the run (one line) when more than reward.max_failure_rate of the episodes failed."""
        from emapg_cli.agents.agent import agent_metrics

        return agent_metrics(episodes, self.settings.max_failure_rate, self.settings.ref, where)

    def close(self) -> None:
        self.runner.close()


class BoundEnv:
    """`UserEnvironment.bind(engine)`: `generate(prompts, params, examples)` runs the episodes on that engine."""

    needs_examples = True

    def __init__(self, runner, engine):
        self.runner, self.engine = runner, engine

    def generate(self, prompts, params, examples=None):
        if examples is None:
            raise ValueError("a user environment's episodes need each prompt's example")
        return self.runner.generate(self.engine, prompts, params, examples)


def generate(generator, prompts: list[list[int]], params, examples: Sequence[Any]):
    """`generator.generate(prompts, params)` (an engine, the search agent's), with the examples for one that needs
    them (a user environment's episodes are built from their example)."""
    if getattr(generator, "needs_examples", False):
        return generator.generate(prompts, params, examples)
    return generator.generate(prompts, params)


def make_environment(name: str, tokenizer, *, search: Any = None, retriever: Any = None, max_turns: Optional[int] = None,
                     max_context_tokens: int = 4096, timeout_s: float = 10.0, probe: bool = False,
                     agent: Any = None) -> Environment:
    """The environment `name` (`single`, `search`, `calc`, FILE.py:Class, module:Class).

    search: the `search` settings (config section, or any object with its fields), for `search`; `retriever`: one
    already built (else built from `search`; `probe` sends it one query, so a server that is down fails before any
    rollout); max_turns: overrides the environment's own (search.max_turns, a class's `max_turns`);
    max_context_tokens, timeout_s: a user environment's context limit and per-call time limit
    (rollout.max_context_tokens, rollout.env_timeout_s); agent: an `agents.agent.AgentSettings` (rollout.agent, with
    `name` single): the agent's episodes, each call within max_context_tokens.
    """
    if agent is not None:
        if name != "single":
            raise UserError(f"rollout.agent runs the episodes itself; it contradicts rollout.env={name}")
        return AgentEnvironment(tokenizer, agent, max_context_tokens)
    if name == "single":
        return Environment()
    if name == "search":
        if retriever is None:
            from emapg_cli.retrieval import make_retriever

            s = search
            retriever = make_retriever(s.retriever, index=s.index, url=s.url, timeout_s=s.timeout_s, retries=s.retries,
                                       backoff_s=s.backoff_s)
            if probe:
                retriever.search(["test"], 1)  # a one-line UserError when the server is down
        return SearchEnvironment(tokenizer, retriever, search, search.max_turns if max_turns is None else max_turns)
    return UserEnvironment(tokenizer, name, max_turns, max_context_tokens, timeout_s)
