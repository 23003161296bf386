"""Reward functions by name: `get_reward("math")(responses, examples) -> [0.0 | 1.0, ...]`.

A name is a registered reward (`math`, `exact_match`, `toy`, `em`, `f1`, `reasoning-gym`) or a plugin reference
`module:function` / `path/to/file.py:function` (rewards/plugin.py): a per-sample
`fn(response: str, example: dict) -> float` run in the grading pool.

A reward maps a batch of responses (one per example, in order) to floats. Every reward returned by
`get_reward` is wrapped in `SafeReward`: a batch that raises is retried item by item, and an item
that still raises scores 0.0 and is counted in `errors`, so one bad response never stops training.

This is the one way to choose a reward: training calls `get_reward`, and `emapg eval` calls
`rewards.graders.get_grader`, which calls `get_reward` and grades with what the reward returns.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable, Optional, Protocol, Sequence

from emapg_cli.data.schema import Example
from emapg_cli.errors import UserError
from emapg_cli.tasks import TASKS

log = logging.getLogger(__name__)


class RewardFn(Protocol):
    def __call__(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]: ...


def _math(think: str = "emapg", workers: Optional[int] = None, timeout: float = 5.0) -> RewardFn:
    from emapg_cli.rewards.math_reward import MathReward

    return MathReward(workers=workers, timeout=timeout, think=think)


def _exact_match(think: str = "emapg") -> RewardFn:
    from emapg_cli.rewards.exact_match import ExactMatchReward

    return ExactMatchReward(think=think)


def _qa(kind: str) -> Callable[..., RewardFn]:
    def factory(**_) -> RewardFn:
        from emapg_cli.rewards.qa import QAReward

        return QAReward(kind)

    return factory


def _reasoning_gym(workers: Optional[int] = None, timeout: Optional[float] = None, memory_mib: Optional[int] = None,
                   **_) -> RewardFn:
    from emapg_cli.rewards.reasoning_gym_reward import PLUGIN_MEMORY_MIB, PLUGIN_TIMEOUT, ReasoningGymReward

    return ReasoningGymReward(workers, timeout or PLUGIN_TIMEOUT, PLUGIN_MEMORY_MIB if memory_mib is None else memory_mib)


#: name -> factory `factory(think=...)` (called once per `get_reward`, so each caller owns its
#: reward's resources; `think` is the `grading.think` rule, which a factory may ignore). A factory
#: that also accepts `workers` and `timeout` gets them (`emapg eval --grader-workers/--grader-timeout`).
REWARDS: dict[str, Callable[..., RewardFn]] = {
    "math": _math,
    "exact_match": _exact_match,
    "em": _qa("em"),  # search agent: Search-R1 exact match of the last <answer>
    "f1": _qa("f1"),  # search agent: SQuAD token F1 of the last <answer>
    "reasoning-gym": _reasoning_gym,  # rows of `emapg prepare reasoning-gym:TASK`: the task's own score_answer (partial credit)
}
#: A built-in task's name that is also a reward name (`toy`: its answers are integers in \boxed{}, maths grading).
ALIASES = {t.name: t.reward for t in TASKS.values() if t.reward_alias}
REWARDS.update({alias: REWARDS[name] for alias, name in ALIASES.items()})


def canonical_reward(name: str) -> str:
    """The registered reward `name` stands for: a task's alias (`toy`) -> its reward (`math`), else `name`."""
    return ALIASES.get(name, name)


def register_reward(name: str, factory: Callable[..., RewardFn]) -> None:
    """Add (or replace) a reward factory `factory(think=...)` under `name`."""
    REWARDS[name] = factory


class SafeReward:
    """Wraps a reward: exceptions score 0.0 per item and are counted in `errors`; a UserError (the reward cannot
    run at all: a plugin's workers cannot start) stops the caller with its one line."""

    def __init__(self, name: str, fn: RewardFn) -> None:
        self.name, self.fn = name, fn
        self._errors = 0  # items that raised here, over this object's life
        self._last_error = ""  # the last of them, "Type: message"
        self.calls = 0  # items scored, over this object's life
        self.first_error = ""  # the first failure since `start_count()` ("Type: message"), "" when none
        self.timeouts_at_start = 0  # `timeouts` at the last `start_count()`

    @property
    def errors(self) -> int:
        """Items scored 0 because they raised (here, or inside the reward: a plugin's pool counts its own)."""
        return self._errors + int(getattr(self.fn, "errors", 0))

    @property
    def timeouts(self) -> int:
        """Items scored 0 because the reward's worker ran past its time limit (a reward scoring in the grading pool: a
        plugin, reasoning-gym); counted in `errors` too."""
        return int(getattr(self.fn, "timeouts", 0))

    @property
    def solved(self) -> Optional[Callable[[float], bool]]:
        """The reward's own rule for a solved response (`fn.solved(score)`), None when it has none (the caller's
        default applies: training's eval/accuracy counts a reward above 0.5)."""
        return getattr(self.fn, "solved", None)

    @property
    def last_error(self) -> str:
        """The last failure ("Type: message"; a plugin's pool keeps its own), "" when none."""
        return str(getattr(self.fn, "last_error", "") or self._last_error)

    def start_count(self) -> tuple[int, int]:
        """Forget `first_error` and return (calls, errors) so far: what a step's failure rate is counted from (and note
        the timeouts so far, `timeouts_at_start`)."""
        self.first_error = ""
        self.timeouts_at_start = self.timeouts
        return self.calls, self.errors

    def __call__(self, responses: Sequence[str], examples: Sequence[Example]) -> list[float]:
        if len(responses) != len(examples):
            raise ValueError(f"reward {self.name}: {len(responses)} responses but {len(examples)} examples")
        self.calls += len(responses)
        try:
            out = [float(r) for r in self.fn(responses, examples)]
            self.first_error = self.first_error or str(getattr(self.fn, "batch_first_error", "") or "")
            return out
        except UserError:
            raise
        except Exception:
            log.warning("reward %s raised on a batch of %d; scoring item by item", self.name, len(responses), exc_info=True)
        out = []
        for response, example in zip(responses, examples):
            try:
                out.append(float(self.fn([response], [example])[0]))
            except Exception as e:
                self._errors += 1
                self._last_error = f"{type(e).__name__}: {e}"
                self.first_error = self.first_error or self._last_error
                out.append(0.0)
        return out

    def close(self) -> None:
        """Release the reward's resources (a grading pool), if it has any."""
        close = getattr(self.fn, "close", None)
        if close is not None:
            close()


def _build(factory: Callable[..., RewardFn], **kwargs) -> RewardFn:
    """`factory(think=...)`, plus those of `kwargs` (workers, timeout) it accepts and that are set."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    extra = {k: v for k, v in kwargs.items() if k != "think" and v is not None and (takes_all or k in params)}
    return factory(think=kwargs["think"], **extra)


def check_reward(name: str) -> str:
    """`name` as a run records it: a registered name unchanged, a plugin checked without running it
    (`rewards.plugin.check_ref`: the file or module is there and defines the function) and its file path made
    absolute; else a one-line UserError (as `get_reward`)."""
    from emapg_cli.rewards.plugin import check_ref, is_plugin_ref

    if is_plugin_ref(name):
        return check_ref(name)
    if name not in REWARDS:
        raise UserError(f"unknown reward '{name}' (known: {', '.join(sorted(REWARDS))}; or module:function / path/to/file.py:function)")
    return name


def get_reward(name: str, think: str = "emapg", workers: Optional[int] = None, timeout: Optional[float] = None,
               memory_mib: Optional[int] = None) -> SafeReward:
    """The reward registered as `name`, or the plugin `name` refers to; an unknown name is a UserError
    listing the known ones. `think` is the `grading.think` rule of the rewards that extract answers;
    `workers` and `timeout` (None: the defaults, as in training) size the grading pool and bound one
    call (a plugin call, a math-verify comparison); `memory_mib` caps the workers of a plugin or of the reasoning-gym
    scorers (reward.plugin_memory_mib; None: its default)."""
    from emapg_cli.rewards.plugin import PLUGIN_MEMORY_MIB, PLUGIN_TIMEOUT, PluginReward, is_plugin_ref

    name = check_reward(name)
    if is_plugin_ref(name):
        return SafeReward(name, PluginReward(name, workers=workers, timeout=timeout or PLUGIN_TIMEOUT,
                                             memory_mib=PLUGIN_MEMORY_MIB if memory_mib is None else memory_mib))
    return SafeReward(name, _build(REWARDS[name], think=think, workers=workers, timeout=timeout, memory_mib=memory_mib))
