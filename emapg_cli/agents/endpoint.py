"""The trainer's in-process OpenAI endpoint for agents (docs/agents.md): one session per episode, named by its API key.

`EpisodeBackend` is the `serve.openai_service.Backend` of the agent runner. Each episode gets a fresh random API key
(its `openai.OpenAI` client sends it); the endpoint attributes every call to that episode, and refuses a key it does
not know or an episode that has ended (401). Per episode:

* sampling is the run's: temperature and top_p are the run's (a request may leave them out or repeat them; another
  value is refused, since the trainer's passes assume that distribution), each call's `max_tokens` at most the
  per-turn cap (`rollout.max_new_tokens`), prompt + completion within `rollout.max_context_tokens`, `rollout.stop`
  added to every call's stop strings;
* caps: at most `max_calls` calls, and no call once the episode's calls have sampled `max_tokens` tokens (400 with
  code `episode_limit`, which an agent may catch);
* an assistant turn with tool calls that the endpoint returned, sent back unchanged, is rendered as the text the
  model wrote (not as the template's own JSON of the calls);
* tokenization reuses the episode's own ids: a prompt text that starts with the text of an earlier call's prompt and
  one of its completions (the completion decoded in context) is tokenized as those exact ids plus the rest (without
  added special tokens), so a chat loop's next prompt extends the previous one token for token (no re-tokenization of
  what the model sampled, no BPE merge across the boundary; agents/trajectory.py);
* each call within the episode's `timeout_s` of its arrival, and cancelled once its client has left or the episode
  has ended (`Rounds`: a call still waiting for its round is withdrawn; a round whose calls are all cancelled stops at
  the engine's next decode step), answered 504 / 499;
* every call is recorded (`Call`: the prompt's ids and each choice's completion with the engine's log-probs and the
  weights version), and sampled in the runner's lockstep `Rounds`.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from emapg_cli.agents.rounds import EpisodeOver, Rounds
from emapg_cli.agents.trajectory import Call
from emapg_cli.engines.base import Cancelled
from emapg_cli.serve.openai_service import Policy
from emapg_cli.serve.openai_wire import OpenAIError
from emapg_cli.serve.http_server import Refused


@dataclass
class Session:
    """One episode's state at the endpoint."""

    slot: int
    policy: Policy
    rounds: Rounds
    max_calls: int
    max_tokens: int
    timeout_s: float = 300.0  # a call's deadline from its arrival (the episode's own time limit)
    key: str = field(default_factory=lambda: "emapg-episode-" + secrets.token_urlsafe(24))
    calls: list[Call] = field(default_factory=list)  # one per prompt of each request, in call order
    requests: int = 0  # model calls (requests) made
    sampled: int = 0  # tokens the episode's calls sampled
    known: list[tuple[str, list[int]]] = field(default_factory=list)  # (text, ids) of prompt + completion, for reuse
    turns: dict = field(default_factory=dict)  # its tool-calling turns as sampled (serve/openai_wire.own_turns)
    over: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class EpisodeBackend:
    """Sessions by API key over the runner's rounds (see the module docstring)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, session: Session) -> Session:
        with self._lock:
            self.sessions[session.key] = session
        return session

    def close(self, session: Session) -> None:
        """The episode has ended: its key is refused from now on."""
        session.over = True
        with self._lock:
            self.sessions.pop(session.key, None)

    # ------------------------------------------------------------------ Backend
    def session(self, api_key: Optional[str]) -> Session:
        with self._lock:
            s = self.sessions.get(api_key or "")
        if s is None or s.over:
            raise OpenAIError(401, "unknown API key, or its episode has ended: use the client the agent was given",
                              "authentication_error", code="invalid_api_key")
        return s

    def policy(self, session: Session) -> Policy:
        return session.policy

    def memory(self, session: Session) -> dict:
        return session.turns

    def tokenize(self, session: Session, text: str, special: bool) -> list[int]:
        """`text`'s ids, reusing the longest earlier prompt + completion of the episode that `text` starts with."""
        with session.lock:
            best = max((k for k in session.known if text.startswith(k[0])), key=lambda k: len(k[0]), default=None)
        if best is None:
            return self.tokenizer(text, add_special_tokens=special)["input_ids"]
        rest = text[len(best[0]):]
        return best[1] + (self.tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else [])

    def generate(self, session: Session, prompts, params, seed, texts, caller):
        with session.lock:
            if session.requests >= session.max_calls:
                raise OpenAIError(400, f"this episode has made its {session.max_calls} calls (rollout.agent_max_calls)",
                                  code="episode_limit")
            if session.sampled >= session.max_tokens:
                raise OpenAIError(400, f"this episode's calls have sampled {session.sampled} tokens, its cap is "
                                       f"{session.max_tokens} (rollout.agent_max_tokens)", code="episode_limit")
            session.requests += 1
            placeholder = Call([], [])  # this call's place in call order (an agent may call from several threads)
            session.calls.append(placeholder)
        deadline = caller.arrival + session.timeout_s
        try:
            rows = session.rounds.generate(session.slot, prompts, params, 0 if seed is None else seed % (1 << 63),
                                           cancelled=lambda: session.over or caller.left() or time.monotonic() > deadline)
        except BaseException as e:
            with session.lock:
                session.calls = [c for c in session.calls if c is not placeholder]
            if isinstance(e, EpisodeOver):
                raise OpenAIError(401, "this episode has ended", "authentication_error", code="invalid_api_key") from None
            if isinstance(e, Cancelled):
                late = time.monotonic() > deadline
                raise Refused(504 if late else 499, f"the call passed the episode's {session.timeout_s:g} s" if late
                              else "the client left or the episode ended: the call was cancelled") from None
            raise
        calls = [Call(list(p), list(row)) for p, row in zip(prompts, rows)]
        known = [(t + self._completion_text(p, c.token_ids), list(p) + list(c.token_ids))
                 for p, t, row in zip(prompts, texts, rows) if t is not None for c in row]
        with session.lock:
            at = next(i for i, c in enumerate(session.calls) if c is placeholder)
            session.calls[at:at + 1] = calls  # a /v1/completions call with several prompts records one Call each
            session.sampled += sum(len(c.token_ids) for row in rows for c in row)
            session.known += known
        versions = [c.weights_version for row in rows for c in row if c.weights_version is not None]
        return rows, min(versions) if versions else None

    def _completion_text(self, prompt: list[int], ids: list[int]) -> str:
        """The completion's text as it reads after its prompt (decoded in context: a sentencepiece tokenizer drops a
        leading space when a completion is decoded alone), special tokens kept (a template writes them as text)."""
        dec = self.tokenizer.decode
        head = dec(prompt, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        full = dec(prompt + ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return full[len(head):] if full.startswith(head) else dec(ids, skip_special_tokens=False,
                                                                 clean_up_tokenization_spaces=False)
