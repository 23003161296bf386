"""The search agent's turn loop: token-in, token-out multi-turn episodes with an observation mask.

Entry point: `SearchAgent(tokenizer, retriever, settings).generate(engine, prompts, params)`, shaped
like `Engine.generate` (params.n episodes per prompt, prompt-major), returning `Episode`s.

Per turn, every still-active episode's context (prompt + everything so far) goes to the engine in
one batched call (n = 1 per row, stop strings `</search>` / `</answer>`); the sampled token ids
and their sampling log-probs are appended as they are (mask 1). The turn's decoded text decides
the action (`protocol.parse_action`): an answer ends the episode; all searches of the turn go to
the retriever in one call; a turn with no action gets the invalid-action message. Observations are
tokenised, cut to `max_obs_tokens` and appended with mask 0 and log-prob 0. After
`search.max_turns` turns, episodes still running get one final turn with search disabled (a
search there ends the episode unanswered), as in Search-R1.

Context limit: a turn starts only when prompt + trajectory + a full turn (`params.max_new_tokens`)
fit in `max_context_tokens`; observations are cut to what fits. An episode that runs out of room
ends there (outcome `context`, counted in `search/context_full_frac`); like an episode that used up its turns, it
is not truncated unless its last turn was cut at the per-turn cap (see `Episode`). Search-R1 instead keeps the
last 4096 tokens of a rolling context, so the model can see a left-truncated context while the
trained sequence is the whole one; ending the episode keeps trained = seen.

`settings.retokenize` reproduces Search-R1's decode -> cut after the first closing tag ->
re-tokenise instead (EOS dropped, token boundaries may shift, no sampling log-probs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from emapg_cli.agents import protocol
from emapg_cli.agents.episode import (Episode, EpisodeState as _State, add_observation, observation_ids, add_policy_turn, new_episode,
                                      still_running, turn_params, turn_tokens)
from emapg_cli.engines.base import Completion, SamplingParams
from emapg_cli.retrieval.base import Retriever


class SearchAgent:
    """Runs Search-R1 episodes over any `Engine` (hf, vllm, or a test's scripted fake)."""

    def __init__(self, tokenizer, retriever: Retriever, settings, max_turns: int):
        """`settings`: the config's `search` section (or any object with its fields)."""
        self.tokenizer, self.retriever, self.s, self.max_turns = tokenizer, retriever, settings, max_turns
        self.latencies: list[float] = []  # seconds of each retriever call of the last `generate`

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, engine, prompts: list[list[int]], params: SamplingParams) -> list[list[Episode]]:
        """`params.n` episodes per prompt (row i*n + j is sample j of prompt i), in prompt order."""
        n, s = params.n, self.s
        states = [_State(list(p), new_episode()) for p in prompts for _ in range(n)]
        self.latencies = []
        for turn in range(self.max_turns + (1 if s.final_turn else 0)):
            final = turn == self.max_turns
            active = still_running(states, s.max_context_tokens, params.max_new_tokens)
            if not active:
                break
            outs = engine.generate([st.prompt + st.episode.token_ids for st in active], turn_params(params, protocol.STOP, turn))
            queries: list[tuple[_State, str]] = []
            for st, group in zip(active, outs):
                kind, content = self._take_turn(st, group[0])
                if kind == "answer":
                    st.done, st.episode.outcome, st.episode.finish_reason = True, "answer", "stop"
                elif final:
                    st.done, st.episode.outcome = True, "no_answer"
                elif kind == "search":
                    queries.append((st, content))
                else:
                    st.episode.invalid += 1
                    self._observe(st, s.invalid_message)
            if queries:
                t0 = time.perf_counter()
                hits = self.retriever.search([q for _, q in queries], s.topk)
                self.latencies.append(time.perf_counter() - t0)
                for (st, q), h in zip(queries, hits):
                    st.episode.searches += 1
                    st.episode.queries.append(q)
                    st.episode.retrieved.append([x.id for x in h])
                    self._observe(st, protocol.information(h))
        for st in states:
            if not st.done:
                st.episode.outcome = "no_answer"
        return [[st.episode for st in states[i * n:(i + 1) * n]] for i in range(len(prompts))]

    def bind(self, engine) -> "BoundAgent":
        """An `Engine`-shaped object whose `generate(prompts, params)` runs this agent's episodes on `engine`
        (what the trainer's rollout and evaluation call in place of the bare engine)."""
        return BoundAgent(self, engine)

    def _take_turn(self, st: _State, c: Completion) -> tuple[Optional[str], str]:
        """Append one generated turn (mask 1); return its action. Engines return only the tokens the policy
        sampled (no pad or unsampled EOS of a finished row: docs/vllm.md "End tokens"), each with its log-prob."""
        ids, logprobs = turn_tokens(c)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if self.s.retokenize:
            text = protocol.cut_after_action(text)
            ids, logprobs = self._encode(text), None
        add_policy_turn(st.episode, ids, logprobs, text, c.finish_reason, getattr(c, "weights_version", None))
        return protocol.parse_action(text)

    def _observe(self, st: _State, text: str) -> None:
        """Append an observation (mask 0, log-prob 0), cut to max_obs_tokens and to the room left."""
        ep, s = st.episode, self.s
        room = max(s.max_context_tokens - len(st.prompt) - len(ep.token_ids), 0)
        limit = min(s.max_obs_tokens, room)
        add_observation(ep, observation_ids(self._encode, text, limit), limit)  # cut by characters, then tokens


@dataclass
class BoundAgent:
    """`SearchAgent.bind(engine)`: `generate` = the agent's episodes on that engine."""

    agent: SearchAgent
    engine: Any

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Episode]]:
        return self.agent.generate(self.engine, prompts, params)


def search_metrics(episodes: list[Episode], latencies: list[float]) -> dict[str, float]:
    """`search/*` metrics of one step's episodes (this process's) and retriever call latencies."""
    n = max(len(episodes), 1)
    turns = sum(e.turns for e in episodes)
    tokens = sum(len(e.token_ids) for e in episodes)
    out: dict[str, Any] = {
        "search/calls_per_episode": sum(e.searches for e in episodes) / n,
        "search/invalid_action_rate": sum(e.invalid for e in episodes) / max(turns, 1),
        "search/turns": turns / n,
        "search/obs_tokens_frac": sum(e.obs_tokens for e in episodes) / max(tokens, 1),
        "search/answered_frac": sum(e.outcome == "answer" for e in episodes) / n,
        "search/context_full_frac": sum(e.outcome == "context" for e in episodes) / n,
        "search/obs_cut_frac": sum(e.obs_cut for e in episodes) / max(sum(e.searches + e.invalid for e in episodes), 1),
    }
    if latencies:
        out["search/retriever_latency_s"] = sum(latencies) / len(latencies)
    return out
