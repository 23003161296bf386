"""The multi-turn loop of a user environment (`rollout.env=FILE.py:ClassName`, docs/environments.md), over any Engine.

Shaped like `Engine.generate` and like the search agent's loop (agents/search.py): `params.n` episodes per
prompt, prompt-major (row i*n + j is sample j of prompt i), one environment object per episode built from
its example (`cls(example_dict)`). Per turn every still-active episode's context (prompt + trajectory) goes
to the engine in one batched call (n = 1 per row, seed `derive_seed(params.seed, turn)`, stop strings: the
class's `stop` plus `rollout.stop`); the sampled ids and their log-probs are appended as they are (mask 1).
The turn's decoded text goes to `env.step(text)`: None ends the episode (outcome `done`); a string is the
observation, tokenised and appended with mask 0 and log-prob 0 (a `call`). After `max_turns` policy turns
the episode ends (outcome `turns`; the last `step` is still called, its observation is not appended).

Context limit (`max_context_tokens`, the config's `rollout.max_context_tokens`): a turn starts only when
prompt + trajectory + a full turn (`params.max_new_tokens`) fit; an observation is cut to the room left;
an episode out of room ends (outcome `context`), as in the search agent.

Every call into the user's code (`__init__`, `step`, `reward`, `metrics`, reading `invalid`: every attribute of
the environment object, and the check of what it returned) runs in a worker thread bounded by `timeout_s`, inside
`bounds.user_code()` (a process it forks never runs emapg's code and dies with emapg); an exception, a hang or a
return value of the wrong type is one `UserError` line naming the file, the class and the method. Nothing is
written by the loop, so such an error leaves no partial file.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, wait
from queue import SimpleQueue
from typing import Any, Callable, Optional, Sequence

from emapg_cli.agents.episode import (Episode, EpisodeState as _State, add_observation, observation_ids, add_policy_turn, new_episode,
                                      still_running, turn_params, turn_tokens)
from emapg_cli.bounds import user_code
from emapg_cli.engines.base import SamplingParams
from emapg_cli.errors import UserError


class Worker:
    """One daemon thread that runs calls into user code with a per-call time limit (a call past it is left
    running in its thread, which never blocks the process's exit, and the caller gets a UserError)."""

    def __init__(self, label: str, timeout_s: float):
        self.label, self.timeout_s = label, timeout_s
        self._jobs: Optional[SimpleQueue] = None

    def _loop(self, jobs: SimpleQueue) -> None:
        while True:
            fut, fn, args = jobs.get()
            if fut.set_running_or_notify_cancel():
                try:
                    with user_code():  # a fork in the user's code exits there (bounds.py)
                        value = fn(*args)
                    fut.set_result(value)
                except BaseException as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def call(self, method: str, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` within the time limit; `method` names it in errors (`step`, `reward`, ...)."""
        if self._jobs is None:
            self._jobs = SimpleQueue()
            threading.Thread(target=self._loop, args=(self._jobs,), daemon=True, name="emapg-env").start()
        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        wait([fut], timeout=self.timeout_s)
        if not fut.done():
            self._jobs = None  # that thread is stuck: a later call gets a fresh one
            raise UserError(f"{self.label}.{method} did not return within rollout.env_timeout_s = {self.timeout_s:g} s")
        e = fut.exception()
        if e is None:
            return fut.result()
        if isinstance(e, UserError):
            raise e
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"{self.label}.{method} raised {type(e).__name__}" + (f": {msg}" if msg else ""))


def _number(value: Any, where: str) -> float:
    """`value` as a float finite in float32 (rewards become float32 advantages): the plugin rule,
    `rewards.plugin.reward_value`; else a UserError naming `where`."""
    from emapg_cli.rewards.plugin import reward_value

    try:
        return reward_value(value)
    except (TypeError, ValueError):
        raise UserError(f"{where} returned {type(value).__name__} {str(value)[:60]!r}; expected a number finite in float32") from None


class EnvRunner:
    """Runs episodes of the user environment class `cls` (reference `ref`) over any `Engine`."""

    def __init__(self, tokenizer, cls: type, ref: str, max_turns: int, max_context_tokens: int, timeout_s: float):
        self.tokenizer, self.cls, self.ref = tokenizer, cls, ref
        self.max_turns, self.max_context_tokens = max_turns, max_context_tokens
        self.stop = tuple(getattr(cls, "stop", ()) or ())
        self.has_reward = callable(getattr(cls, "reward", None))
        self.worker = Worker(f"rollout.env {ref}", timeout_s)

    def _start(self, prompt: list[int], example: Any) -> _State:
        row = example.model_dump() if hasattr(example, "model_dump") else dict(example)
        env = self.worker.call("__init__", self.cls, row)
        return _State(list(prompt), new_episode(), env)

    def generate(self, engine, prompts: list[list[int]], params: SamplingParams, examples: Sequence[Any]) -> list[list[Episode]]:
        """`params.n` episodes per prompt (row i*n + j is sample j of prompt i); `examples[i]` is prompt i's row."""
        if len(examples) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(examples)} examples")
        n = params.n
        states = [self._start(p, ex) for p, ex in zip(prompts, examples) for _ in range(n)]
        stop = self.stop + tuple(s for s in params.stop if s not in self.stop)
        for turn in range(self.max_turns):
            active = still_running(states, self.max_context_tokens, params.max_new_tokens)
            if not active:
                break
            outs = engine.generate([st.prompt + st.episode.token_ids for st in active], turn_params(params, stop, turn))
            for st, group in zip(active, outs):
                self._turn(st, group[0], last=turn == self.max_turns - 1)
        for st in states:
            self._finish(st)
        return [[st.episode for st in states[i * n:(i + 1) * n]] for i in range(len(prompts))]

    def _turn(self, st: _State, c, last: bool) -> None:
        """Append one policy turn (mask 1), give its text to `step`, append the observation (mask 0)."""
        ep = st.episode
        ids, logprobs = turn_tokens(c)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        add_policy_turn(ep, ids, logprobs, text, c.finish_reason, getattr(c, "weights_version", None))
        obs = self.worker.call("step", self._step, st.env, text)
        if obs is None:
            st.done, ep.outcome = True, "done"
        elif last:
            st.done, ep.outcome = True, "turns"
        else:
            ep.calls += 1
            room = max(self.max_context_tokens - len(st.prompt) - len(ep.token_ids), 0)
            add_observation(ep, observation_ids(lambda t: self.tokenizer(t, add_special_tokens=False)["input_ids"], obs, room), room)

    def _finish(self, st: _State) -> None:
        """The episode's outcome, the environment's counters (`invalid`, `metrics()`) and its own reward."""
        ep, env = st.episode, st.env
        if not st.done:
            ep.outcome = ep.outcome or "turns"
        ep.invalid = int(self.worker.call("invalid", self._invalid, env))
        ep.counters = self.worker.call("metrics", self._counters, env)
        if self.has_reward:
            ep.env_reward = self.worker.call("reward", self._reward, env, ep.text)

    # What the worker thread runs: each reads the environment object and checks what it gave (the user's code may
    # run in any of them: a property, __getattr__, a number's __float__), so all of it is under the time limit.
    def _step(self, env: Any, text: str) -> Optional[str]:
        obs = env.step(text)
        if obs is not None and not isinstance(obs, str):
            raise UserError(f"rollout.env {self.ref}.step returned {type(obs).__name__} {obs!r:.60}; "
                            "expected a str (the observation) or None (end the episode)")
        return obs

    def _invalid(self, env: Any) -> float:
        return _number(getattr(env, "invalid", 0), f"rollout.env {self.ref}.invalid")

    def _counters(self, env: Any) -> dict[str, float]:
        if not callable(getattr(env, "metrics", None)):
            return {}
        counters = env.metrics()
        if not isinstance(counters, dict) or not all(isinstance(k, str) for k in counters):
            raise UserError(f"rollout.env {self.ref}.metrics returned {type(counters).__name__}; expected a dict of "
                            "name -> number")
        return {k: _number(v, f"rollout.env {self.ref}.metrics[{k!r}]") for k, v in counters.items()}

    def _reward(self, env: Any, text: str) -> float:
        return _number(env.reward(text), f"rollout.env {self.ref}.reward")


def env_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """`env/*` metrics of one step's episodes (this process's), for every multi-turn environment:
    env/turns (policy turns per episode), env/calls (turns that got an observation: the search agent's searches),
    env/invalid_rate (invalid turns / turns: the search agent's turns with no action, a user environment's own
    `invalid` counter), env/obs_tokens_frac, env/context_full_frac, and env/<name>: the mean over episodes of each
    counter a user environment's `metrics()` returned."""
    n = max(len(episodes), 1)
    turns = sum(e.turns for e in episodes)
    tokens = sum(len(e.token_ids) for e in episodes)
    out = {
        "env/turns": turns / n,
        "env/calls": sum(e.calls + e.searches for e in episodes) / n,
        "env/invalid_rate": sum(e.invalid for e in episodes) / max(turns, 1),
        "env/obs_tokens_frac": sum(e.obs_tokens for e in episodes) / max(tokens, 1),
        "env/context_full_frac": sum(e.outcome == "context" for e in episodes) / n,
    }
    names = sorted({k for e in episodes for k in e.counters})
    for k in names:
        out[f"env/{k}"] = sum(e.counters.get(k, 0.0) for e in episodes) / n
    return out
