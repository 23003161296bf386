"""An agent episode's recorded model calls as training sequences (docs/agents.md, "What the policy is trained on").

A call **extends** a sequence when its prompt's token ids start with the sequence's token ids so far (its first
prompt, then every completion and everything between them): exactly what a chat loop produces when the endpoint
renders each new prompt from the previous one (the agent endpoint reuses an episode's earlier ids for a prompt text
that starts with an earlier prompt + completion, serve/openai_service.py `Backend.tokenize`). The ids between the
sequence's end and the end of the call's prompt (the tool result, the next user turn, the chat template's own
tokens) are appended as an observation (mask 0, log-prob 0) and the completion as a policy turn (mask 1, the
engine's log-probs), with `agents.episode`'s two functions, so an agent's trajectory is laid out exactly as an
environment's or the search agent's. Ids, not text, decide: a prompt that says the same text with other ids (a
completion re-tokenized differently, a template that rewrites an earlier turn) does not extend.

A call that extends no sequence starts a new one whose prompt is the call's prompt (a **prefix break** when the
episode already had a sequence). Among the `n` choices of one call, the first extends the sequence the prompt
extends and each other one starts a sequence of its own (siblings, not breaks). The longest sequence that the
prompt extends is the one extended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from emapg_cli.agents.episode import Episode, add_observation, add_policy_turn, new_episode, turn_tokens
from emapg_cli.engines.base import Completion


@dataclass
class Call:
    """One model call of an episode, as the endpoint sampled it: the prompt's ids and each choice."""

    prompt: list[int]
    choices: list[Completion]


@dataclass
class Segment:
    """One training row of an episode: its prompt (the first call's) and the trajectory after it."""

    prompt: list[int]
    episode: Episode = field(default_factory=new_episode)

    def ids(self) -> list[int]:
        return self.prompt + self.episode.token_ids


def _extended(segments: list[Segment], prompt: list[int]) -> Optional[int]:
    """The index of the longest sequence whose ids are a prefix of `prompt` (None: none is)."""
    prefixes = [i for i, s in enumerate(segments) if prompt[:len(s.ids())] == s.ids()]
    return max(prefixes, key=lambda i: len(segments[i].ids()), default=None)  # the first of the longest


def _turn(ep: Episode, c: Completion) -> None:
    ids, logprobs = turn_tokens(c)
    add_policy_turn(ep, ids, logprobs, c.text, c.finish_reason, c.weights_version)


def build_sequences(calls: list[Call]) -> tuple[list[Segment], int]:
    """(the training segments of an episode's calls in call order, its prefix breaks); see the module docstring."""
    segments: list[Segment] = []
    breaks = 0
    for call in calls:
        base = _extended(segments, call.prompt)
        if base is None and segments:
            breaks += 1
        for j, c in enumerate(call.choices):
            if base is not None and j == 0:
                s = segments[base]
                between = call.prompt[len(s.ids()):]
                add_observation(s.episode, between, len(between))
                s.episode.calls += 1
            else:
                s = Segment(list(call.prompt))
                segments.append(s)
            _turn(s.episode, c)
    return segments, breaks
