"""A multi-turn trajectory, token-exact: the policy's sampled ids (mask 1) and the observations between them (mask 0).

Every environment (the search agent, a user's `rollout.env` class) builds its episodes with the two functions
here, so a trajectory is laid out one way: `add_policy_turn` appends what the engine sampled as it is, with its
sampling log-probs; `add_observation` appends an observation's token ids with mask 0 and log-prob 0, cut to a
limit. `train.rollout.build_batch` turns `policy_mask` into the batch's `loss_mask`, which every loss term,
the KL, the entropy metric and the token counts use (tests/test_observation_masking.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from emapg_cli.engines.base import Completion, SamplingParams, derive_seed


@dataclass
class Episode(Completion):
    """One multi-turn trajectory: `token_ids` is everything after the prompt (policy turns and observations).

    `text` is the policy's own text only (observations excluded): rewards read the answer there.
    `finish_reason` is per turn: "length" when the episode's last policy turn hit the per-turn token cap
    (`SamplingParams.max_new_tokens`) and gave no answer, else "stop": an answer, a turn that ended on its own
    (a search, an invalid turn, EOS) before the turn or context limit ended the episode, or no turn at all.
    So `rewards.shaping.is_truncated`, `train.mask_truncated` and `reward.truncated` see an unanswered
    episode as truncated only when the policy was cut mid-turn; `outcome` says why the episode ended.
    `last_turn_tokens` is that last turn's policy token count (observations and earlier turns excluded).
    """

    policy_mask: list[bool] = field(default_factory=list)  # per token of token_ids: True = sampled by the policy
    # search: "answer" | "no_answer" (turns used up) | "context"; a user environment: "done" (step returned None),
    # "turns" (max_turns used up) | "context" (context limit reached)
    outcome: str = ""
    turns: int = 0  # generation turns taken (the final no-search turn included)
    last_turn_tokens: int = 0  # policy tokens of the last generated turn (0: no turn)
    searches: int = 0  # retriever queries issued
    invalid: int = 0  # turns with neither a search nor an answer (final turn excluded); a user environment's `invalid`
    obs_tokens: int = 0  # observation tokens appended (mask 0)
    obs_cut: int = 0  # observations cut at max_obs_tokens or at the context limit
    queries: list[str] = field(default_factory=list)  # the searches issued, in order
    retrieved: list[list[str]] = field(default_factory=list)  # per search: the ids of the hits shown, best first
    calls: int = 0  # a user environment: turns whose observation was appended (the search agent counts `searches`)
    env_reward: Optional[float] = None  # a user environment's own `reward(text)`, when it defines one
    counters: dict[str, float] = field(default_factory=dict)  # a user environment's `metrics()` at the episode's end


def turn_tokens(c: Completion) -> tuple[list[int], Optional[list[float]]]:
    """(sampled ids, their sampling log-probs or None) of one engine completion, checked to be as long."""
    ids = list(c.token_ids)
    logprobs: Optional[list[float]] = list(c.logprobs) if c.logprobs is not None else None
    if logprobs is not None and len(logprobs) != len(ids):
        raise RuntimeError(f"the engine returned {len(ids)} tokens with {len(logprobs)} log-probs for one turn")
    return ids, logprobs


def add_policy_turn(ep: Episode, ids: list[int], logprobs: Optional[list[float]], text: str, finish_reason: str,
                    version: Optional[int] = None) -> None:
    """Append one policy turn as sampled (mask 1); `logprobs` None drops the episode's log-probs (all or none).
    `version`: the weights version that sampled the turn (versioned engines); the episode keeps its oldest."""
    if version is not None:
        ep.weights_version = version if ep.weights_version is None else min(ep.weights_version, version)
    ep.token_ids += ids
    ep.policy_mask += [True] * len(ids)
    ep.logprobs = ep.logprobs + logprobs if (ep.logprobs is not None and logprobs is not None) else None
    ep.text += text
    ep.turns += 1
    ep.last_turn_tokens = len(ids)
    ep.finish_reason = "length" if finish_reason == "length" else "stop"  # this turn hit the per-turn cap


#: Characters per token assumed when an observation is cut by characters before it is tokenised
#: (`observation_ids`): generous (English averages about 4 characters per BPE token, a byte tokenizer 1).
OBS_CHARS_PER_TOKEN = 8
OBS_MIN_CHARS = 4096  # an observation this short is always tokenised whole


def observation_ids(encode, text: str, limit: int) -> list[int]:
    """The token ids `add_observation(ep, ids, limit)` needs of `text`, without tokenising a huge text whole.

    An observation is cut to `limit` tokens, so only its first `limit + 1` tokens matter (one more than kept tells
    `add_observation` it was cut). Text up to max(OBS_MIN_CHARS, (limit + 1) * OBS_CHARS_PER_TOKEN) characters
    (every normal observation: Search-R1's 3 passages of ~100 words are ~2,000) is tokenised whole, exactly as
    before. A longer one is cut by characters first: its prefix of that many characters is tokenised, and when it
    gives at least 16 tokens more than needed its first `limit + 1` are taken (the same as the whole text's,
    except when one unbroken run of characters crosses the cut); otherwise the prefix grows 4-fold (so never
    more than about 4/3 of the whole text is tokenised). A 1 MB passage cut to 500 tokens is tokenised as
    4 KB, not 1 MB.
    """
    want = limit + 1
    chars = max(OBS_MIN_CHARS, want * OBS_CHARS_PER_TOKEN)
    while chars < len(text):
        ids = encode(text[:chars])
        if len(ids) >= want + 16:
            return ids[:want]
        chars *= 4
    return encode(text)


def add_observation(ep: Episode, ids: list[int], limit: int) -> None:
    """Append an observation's first `limit` token ids (mask 0, log-prob 0); a cut one is counted in `obs_cut`."""
    keep = min(len(ids), limit)
    ep.obs_cut += keep < len(ids)
    ids = ids[:keep]
    ep.token_ids += ids
    ep.policy_mask += [False] * len(ids)
    if ep.logprobs is not None:
        ep.logprobs += [0.0] * len(ids)
    ep.obs_tokens += len(ids)


@dataclass
class EpisodeState:
    """One running episode of a turn loop: its prompt ids, the trajectory so far, the environment object (user
    environments), and whether it has ended."""

    prompt: list[int]
    episode: Episode
    env: Any = None
    done: bool = False


def new_episode() -> Episode:
    return Episode(token_ids=[], text="", finish_reason="stop", logprobs=[])


def still_running(states: list[EpisodeState], max_context_tokens: int, max_new_tokens: int) -> list[EpisodeState]:
    """The episodes that take the next turn: not ended, and with room for prompt + trajectory + a full turn
    (`max_new_tokens`) within `max_context_tokens`; one without that room ends here (outcome `context`)."""
    active = []
    for st in states:
        if st.done:
            continue
        if len(st.prompt) + len(st.episode.token_ids) + max_new_tokens > max_context_tokens:
            st.done, st.episode.outcome = True, "context"
        else:
            active.append(st)
    return active


def turn_params(params: SamplingParams, stop: tuple[str, ...], turn: int) -> SamplingParams:
    """One turn's sampling: one sample per running episode (the episodes are the rows), the caller's length cap,
    temperature, top-p and oldest weights version, the loop's stop strings, and a seed derived from (params.seed, turn)."""
    return SamplingParams(n=1, max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                          top_p=params.top_p, stop=stop, seed=derive_seed(params.seed, turn), min_version=params.min_version)
