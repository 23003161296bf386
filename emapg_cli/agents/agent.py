"""`rollout.agent=FILE.py:fn`: any agent written against an OpenAI client drives training and `emapg eval --agent`.

`fn(client, example)` runs once per episode in an agent process of its own (a `grading.pool.TimeoutPool` worker:
its own session, under an address-space cap, killed with emapg and at the episode's deadline; a fork it makes exits
when the call returns in it, `bounds.user_code`): `client` is an `openai.OpenAI` pointed at the trainer's in-process
endpoint on 127.0.0.1 (agents/endpoint.py, serve/openai_http.py) with the episode's own API key (no retries, the
episode's time limit), `example` the canonical row (`id`, `question`, `answers`, `source`, `meta`). It returns the
episode's reward: a number, or a dict with `reward` and other numbers (each logged as `agent/<name>`, its mean over
the episodes that returned it). The `n` episodes of each prompt run at once (at most `workers` episodes of the step at
a time, admitted in order), each on a lane: a long-lived thread of the runner that keeps its agent process from one
episode to the next (a worker dies with the thread that started it). Their calls are sampled in lockstep rounds
(agents/rounds.py), so the samples are reproducible. Each episode's calls become its training sequences
(agents/trajectory.py).

A failed episode (the agent raised, exited, returned something else than a reward, ran past `timeout_s`, or made no
model call) is scored 0 and counted (`agent/errors`); past `reward.max_failure_rate` of a step's episodes the run
stops with one line naming the first failure (`AgentEnvironment.metrics`). An episode past its time is given up on:
its key is refused from then on and its process is killed (a new one takes the lane).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from emapg_cli.agents.endpoint import EpisodeBackend, Session
from emapg_cli.agents.episode import Episode
from emapg_cli.agents.rounds import Rounds
from emapg_cli.agents.trajectory import Segment, build_sequences
from emapg_cli.engines.base import SamplingParams
from emapg_cli.errors import UserError

#: The model id the agent endpoint lists (any `model` a request names is answered by the policy).
MODEL_ID = "policy"
#: Metric names of the runner (`agent/<name>`); a reward dict may not use them.
RESERVED = ("calls", "episode_s", "errors", "prefix_breaks", "sequences")
#: Each agent process's address-space cap in MiB (the reward plugins' workers have reward.plugin_memory_mib, 2048).
AGENT_MEMORY_MIB = 4096


@dataclass(frozen=True)
class AgentSettings:
    """`rollout.agent` and its limits (config: rollout.agent_*; `emapg eval --agent`)."""

    ref: str
    max_calls: int = 16
    max_tokens: int = 16384
    timeout_s: float = 300.0
    workers: int = 64
    max_failure_rate: float = 0.5


def load_agent(ref: str) -> Callable:
    """The agent function (imported: only when a trusted run starts), checked as reward plugins are: a Python function
    of the user's own, callable as fn(client, example); else a one-line UserError."""
    from emapg_cli.rewards.plugin import load_function

    return load_function(ref, "rollout.agent", ("client", "example"), "an agent")


@dataclass
class AgentEpisode(Episode):
    """One agent episode: what grading and the metrics read (`env_reward`: the agent's reward, 0 when it failed), and
    its training sequences (`segments`; none: the batch holds one empty row for it, `prompt` the trainer's own)."""

    segments: list[Segment] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    requests: int = 0  # model calls (requests) the agent made
    prefix_breaks: int = 0
    seconds: float = 0.0
    error: str = ""  # why the episode failed ("" when it did not)


def agent_value(value: Any) -> tuple[float, dict[str, float]]:
    """(reward, extra metrics) of what an agent returned: a real number finite in float32, or a dict with `reward`
    and other such numbers; else ValueError/TypeError with a one-line reason."""
    from emapg_cli.rewards.plugin import reward_value

    if not isinstance(value, dict):
        return reward_value(value), {}
    if "reward" not in value:
        raise ValueError(f"returned a dict without 'reward' (keys {sorted(map(str, value))[:5]})")
    extras = {}
    for k, v in value.items():
        if not isinstance(k, str) or not k.isidentifier():
            raise ValueError(f"returned a dict with the key {k!r:.40}; metric names are identifiers")
        if k in RESERVED:
            raise ValueError(f"returned the metric '{k}', a name the runner logs itself (agent/{k})")
        if k != "reward":
            extras[k] = reward_value(v)
    return reward_value(value["reward"]), extras


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())[:200]
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r})"
    return f"raised {type(e).__name__}" + (f": {text}" if text else "")


def _late(timeout: float) -> tuple:
    """The result of an episode given up on at its deadline (no reward, the error, its seconds)."""
    return None, f"did not return within rollout.agent_timeout_s = {timeout:g} s", timeout


@functools.lru_cache(maxsize=1)
def _http():
    """One connection pool for every episode of an agent process (a client of its own costs ~0.05 s)."""
    import openai

    return openai.DefaultHttpxClient()


def warm_agent(ref: str) -> None:
    """An agent process's warm-up (not timed as an episode): the agent imported and the client's connections made."""
    load_agent(ref)
    _http()


def run_episode(ref: str, url: str, key: str, timeout: float, example: dict) -> tuple[str, float, dict]:
    """One episode, in an agent process (`AgentRunner`'s pool worker, warmed up by `warm_agent`): ("", reward, its
    other metrics), or (the failure's line, 0.0, {})."""
    import openai

    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=timeout, http_client=_http())
    try:
        value = load_agent(ref)(client, example)
    except BaseException as e:  # noqa: BLE001 - the agent's failure: scored 0 and counted
        return _one_line(e), 0.0, {}
    try:
        return ("", *agent_value(value))
    except (TypeError, ValueError) as e:
        return str(e), 0.0, {}


def _check_in_a_process(ref: str) -> None:
    """Import the agent once in an agent process of its own (never in emapg's: its top-level code may exit, spin or
    fork), so that a broken agent is one line before any episode runs."""
    from emapg_cli.grading.pool import TimeoutPool, WorkerStartError

    pool = TimeoutPool(run_episode, workers=1, timeout=1.0, warmup=warm_agent, warmup_args=(ref,),
                       memory_limit=AGENT_MEMORY_MIB << 20)
    try:
        pool.warm()
    except WorkerStartError as e:
        reason = e.reason.removeprefix("UserError: ")
        raise UserError(reason if reason.startswith("rollout.agent") else f"rollout.agent {ref}: {reason}") from None
    finally:
        pool.close()


class AgentRunner:
    """Runs `settings.ref`'s episodes over any `Engine` (see the module's docstring); `close()` stops its endpoint."""

    def __init__(self, tokenizer, settings: AgentSettings, max_context_tokens: int):
        from emapg_cli.serve.openai_service import OpenAIService
        from emapg_cli.serve.request_limits import MAX_NEW_TOKENS, RequestLimits

        try:
            import openai  # noqa: F401 - the client each episode is given
        except ImportError:
            raise UserError("rollout.agent gives each episode an openai.OpenAI client: pip install 'emapg[agent]' "
                            "(or openai)") from None
        self.tokenizer, self.settings, self.max_context_tokens = tokenizer, settings, max_context_tokens
        _check_in_a_process(settings.ref)
        self.backend = EpisodeBackend(tokenizer)
        # each call is bounded by the run's caps (Policy: rollout.max_new_tokens within rollout.max_context_tokens)
        limits = RequestLimits(max_new_tokens=max(MAX_NEW_TOKENS, max_context_tokens))
        self.service = OpenAIService(tokenizer, MODEL_ID, self.backend, request_limits=limits)
        self.server: Any = None
        self.url = ""
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # episodes for the lanes; None: a lane ends
        self._lanes = 0

    def _endpoint(self) -> str:
        if self.server is None:
            from emapg_cli.serve.openai_http import start_server

            self.server, self.url = start_server(self.service, "127.0.0.1", 0)
        return self.url

    def _lane(self) -> None:
        """Runs episodes (`job(pool)` from `_jobs`) in its agent process until `close()` (see the module's docstring)."""
        from emapg_cli.grading.pool import TimeoutPool

        pool = TimeoutPool(run_episode, workers=1, timeout=self.settings.timeout_s, warmup=warm_agent,
                           warmup_args=(self.settings.ref,), memory_limit=AGENT_MEMORY_MIB << 20)
        try:
            while (job := self._jobs.get()) is not None:
                job(pool)
        finally:
            pool.close()

    def close(self) -> None:
        for _ in range(self._lanes):  # each lane ends after its episode, killing its agent process
            self._jobs.put(None)
        self._lanes = 0
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def generate(self, engine, prompts: list[list[int]], params: SamplingParams, examples: Sequence[Any]) -> list[list[AgentEpisode]]:
        """`params.n` episodes per example (row i*n + j is sample j of prompt i); `prompts[i]` is the trainer's own
        rendered prompt of example i (the row of an episode without a sequence)."""
        from emapg_cli.serve.openai_service import Policy

        if len(examples) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(examples)} examples")
        n, s = params.n, self.settings
        url = self._endpoint()
        rows = [i for i in range(len(examples)) for _ in range(n)]
        while self._lanes < min(s.workers, len(rows)):  # a lane per episode running at once
            self._lanes += 1
            threading.Thread(target=self._lane, name=f"emapg-agent-lane-{self._lanes}", daemon=True).start()
        policy = Policy(temperature=params.temperature, top_p=params.top_p, fixed=True, max_tokens=params.max_new_tokens,
                        max_context=self.max_context_tokens, stop=params.stop)
        results: list[Optional[tuple]] = [None] * len(rows)
        started: list[Optional[float]] = [None] * len(rows)
        done = threading.Condition()

        def finish(slot: int, result: tuple) -> None:
            with done:
                if results[slot] is None:
                    results[slot] = result
                done.notify_all()

        def run(slot: int, pool) -> None:
            from emapg_cli.grading.pool import WorkerStartError

            try:
                pool.warm()  # a new agent process's start is not the episode's time
            except WorkerStartError:
                pass  # raised again by the episode's map: the episode fails with its line
            started[slot] = time.monotonic()
            example = examples[rows[slot]]
            row = example.model_dump() if hasattr(example, "model_dump") else dict(example)
            result = self._episode(pool, sessions[slot], row, url, started[slot])
            if result[1] and time.monotonic() - started[slot] >= self.settings.timeout_s:
                result = _late(self.settings.timeout_s)  # its client's own timeout fired first: the same deadline
            finish(slot, result)
            self.backend.close(sessions[slot])
            rounds.leave(slot)

        rounds = Rounds(_Versioned(engine, params.min_version), params.seed, len(rows), s.workers,
                        lambda slot: self._jobs.put(functools.partial(run, slot)))
        sessions = [self.backend.open(Session(slot, policy, rounds, s.max_calls, s.max_tokens, s.timeout_s))
                    for slot in range(len(rows))]
        rounds.begin()
        self._wait(results, started, done, sessions, rounds)
        rounds.wait_idle()  # a round of given-up episodes is cancelled: no engine call outlives the step's rollouts
        if rounds.engine_error is not None:  # the engine failed (a rollout server that went away): the run's error
            raise rounds.engine_error
        episodes = [self._result(sessions[slot], prompts[rows[slot]], *results[slot]) for slot in range(len(rows))]
        return [episodes[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _wait(self, results, started, done, sessions, rounds) -> None:
        """Until every episode has ended; one past `timeout_s` is given up on (its key refused, scored 0)."""
        timeout = self.settings.timeout_s
        while True:
            with done:
                now = time.monotonic()
                late = [i for i, r in enumerate(results) if r is None and started[i] is not None and now - started[i] > timeout]
                for i in late:
                    results[i] = _late(timeout)
                over = all(r is not None for r in results)
                if not late and not over:
                    left = [timeout - (now - t) for i, t in enumerate(started) if t is not None and results[i] is None]
                    done.wait(timeout=max(0.01, min(left, default=0.5)))
            for i in late:  # outside the lock: leaving may run a round in this thread
                self.backend.close(sessions[i])
                rounds.leave(i)
            if over:
                return

    def _episode(self, pool, session: Session, example: dict, url: str, started: float) -> tuple:
        """((reward, metrics) or None, an error line or "", wall seconds) of one episode, run in `pool`'s process
        (killed at the episode's deadline)."""
        from emapg_cli.grading.pool import WorkerStartError

        before, left = replace(pool.stats), max(0.01, started + self.settings.timeout_s - time.monotonic())
        pool.timeout = left
        try:
            out = pool.map([(self.settings.ref, url, session.key, left, example)])[0]
        except WorkerStartError as e:  # e.g. its import needs more than the memory cap
            out = (f"its process could not start: {e.reason[:200]}", 0.0, {})
        seconds = time.monotonic() - started
        if out is None and pool.stats.timeouts > before.timeouts:
            return _late(self.settings.timeout_s)
        if out is None:  # it exited (os._exit), was killed, or its process failed otherwise
            return None, f"ended its process without returning ({pool.stats.last_error})", seconds
        return (None if out[0] else out[1:]), out[0], seconds

    def _result(self, session: Session, prompt: list[int], value: Any, error: str, seconds: float) -> AgentEpisode:
        with session.lock:
            calls = list(session.calls)
            requests = session.requests
        if not error and requests == 0:
            error = "made no model call"
        reward, extras = (0.0, {}) if error else value
        segments, breaks = build_sequences(calls)
        ep = AgentEpisode(token_ids=[], text="", finish_reason="stop", logprobs=None, segments=segments, prompt=list(prompt),
                          requests=requests, prefix_breaks=breaks, seconds=seconds, error=error,
                          env_reward=0.0 if error else reward, counters={} if error else extras,
                          outcome="error" if error else "done")
        last = calls[-1].choices[0] if calls and calls[-1].choices else None
        if last is not None:  # what the truncation rule reads: the episode's last call
            ep.finish_reason, ep.last_turn_tokens, ep.text = last.finish_reason, len(last.token_ids), last.text
        for seg in segments:
            ep.token_ids += seg.episode.token_ids
            ep.policy_mask += seg.episode.policy_mask
            ep.turns += seg.episode.turns
            ep.obs_tokens += seg.episode.obs_tokens
            v = seg.episode.weights_version
            if v is not None:
                ep.weights_version = v if ep.weights_version is None else min(v, ep.weights_version)
        ep.calls = requests
        return ep


class _Versioned:
    """The engine with the step's oldest weights version on every request (versioned engines; asynchronous rollouts)."""

    def __init__(self, engine, min_version: Optional[int]):
        self.engine, self.min_version = engine, min_version

    def generate(self, prompts, params, cancelled=None):
        return self.engine.generate(prompts, replace(params, min_version=self.min_version), cancelled=cancelled)


def agent_metrics(episodes: Sequence[AgentEpisode], max_failure_rate: float, ref: str, where: str) -> dict[str, float]:
    """`agent/*` of a step's episodes (this process's): calls (model calls per episode), episode_s, errors (failed
    episodes), prefix_breaks and sequences per episode, and `agent/<name>` for the numbers a reward dict carried.
    Failed episodes above `max_failure_rate` stop the run (one line naming the first failure; `where`: of what);
    fewer are a warning on stderr."""
    import sys

    n = max(len(episodes), 1)
    failed = [e for e in episodes if e.error]
    out = {"agent/calls": sum(e.requests for e in episodes) / n, "agent/episode_s": sum(e.seconds for e in episodes) / n,
           "agent/errors": float(len(failed)), "agent/prefix_breaks": sum(e.prefix_breaks for e in episodes) / n,
           "agent/sequences": sum(len(e.segments) for e in episodes) / n}
    for name in sorted({k for e in episodes for k in e.counters}):
        have = [e.counters[name] for e in episodes if name in e.counters]
        out[f"agent/{name}"] = sum(have) / len(have)
    if failed:
        rate = len(failed) / n
        line = f"rollout.agent {ref} failed on {len(failed)} of {len(episodes)} episodes {where} ({rate:.0%}"
        if rate > max_failure_rate:
            raise UserError(f"{line} > reward.max_failure_rate {max_failure_rate:g}); first failure: {failed[0].error}")
        print(f"warning: {line}, scored 0); first failure: {failed[0].error}", file=sys.stderr, flush=True)
    return out
