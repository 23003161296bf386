"""A rollout's parts, which the step's rollout phase (rollout_phase.py) puts together: the prompts that fit the token
budget, the deterministic prompt schedule, scoring, and the padded batch the passes consume (rendering a prompt is
`models/prompts.py`)."""

from __future__ import annotations

import random
from dataclasses import dataclass, fields, replace
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from emapg_cli.data.schema import Example
from emapg_cli.engines.base import Completion
from emapg_cli.engines.base import derive_seed
from emapg_cli.errors import UserError
from emapg_cli.models.prompts import max_chars_per_token, render_prompt


def prepare_prompts(tokenizer, examples: Sequence[Example], max_prompt_tokens: int,
                    user_message: Optional[Callable[[str], str]] = None,
                    prefix: Sequence[dict[str, str]] = ()) -> tuple[list[Example], list[list[int]], int]:
    """(kept examples, their prompt ids, number skipped for exceeding max_prompt_tokens).

    A question longer than max_prompt_tokens x `max_chars_per_token` characters cannot fit in the
    token budget and is skipped before it is tokenised (a huge question costs no tokenizer time or memory).
    `user_message(question)` builds the user message (the search agent's prompt template); default: the question.
    `prefix`: the chat turns rendered before it (`data.chat_prefix`).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the model's tokenizer has no chat template; prompts are rendered with it (set one in tokenizer_config.json)")
    char_bound = max_prompt_tokens * max_chars_per_token(tokenizer)
    kept, ids = [], []
    for ex in examples:
        if len(ex.question) > char_bound:
            continue
        p = render_prompt(tokenizer, user_message(ex.question) if user_message else ex.question, prefix)
        if len(p) <= max_prompt_tokens:
            kept.append(ex)
            ids.append(p)
    return kept, ids, len(examples) - len(kept)


def schedule(n_items: int, per_step: int, step: int, seed: int) -> list[int]:
    """Dataset indices for RL step `step` (1-based): consecutive slices of per-epoch permutations.

    Epoch e's order is a permutation seeded by (seed, e), so the prompts of any step are a pure
    function of (seed, step): the data cursor of a checkpoint is just its step number.
    """
    start = (step - 1) * per_step
    out: list[int] = []
    orders: dict[int, list[int]] = {}
    for pos in range(start, start + per_step):
        epoch, offset = divmod(pos, n_items)
        if epoch not in orders:
            orders[epoch] = list(range(n_items))
            random.Random(derive_seed(seed, epoch)).shuffle(orders[epoch])
        out.append(orders[epoch][offset])
    return out


def solved_rule(reward_fn) -> Callable[[float], bool]:
    """When a response counts as solved: the reward's own rule (`reward_fn.solved(score)`, e.g. reasoning-gym's
    partial credit counts only a full score, as `emapg eval` does), else a reward above 0.5 (a 0/1 reward's 1s; for
    `f1`, the better half)."""
    rule = getattr(reward_fn, "solved", None)
    return rule if callable(rule) else (lambda r: r > 0.5)


def score(reward_fn: Callable, completions: Sequence[Completion], examples: list[Example], shaping: Optional[dict] = None) -> tuple[list[float], int]:
    """Rewards for (completion, example) pairs and how many items raised (scored 0).

    Episodes of an environment with its own `reward(text)` (`Episode.env_reward`) score that instead of `reward_fn`.
    `reward_fn` comes from `emapg_cli.rewards.get_reward`, whose `SafeReward` wrapper scores an item
    that raises as 0 and counts it in `.errors`; this returns the increase of that count.
    `shaping`: keyword arguments of `rewards.shaping.shape_rewards` (the truncation rule), applied with each
    completion's finish_reason, and `credit` (reward.credit):
    `solved` turns each score into 1 or 0 by the reward's solved rule first.
    """
    from emapg_cli.rewards.shaping import shape_rewards

    before = getattr(reward_fn, "errors", 0)
    own = [getattr(c, "env_reward", None) for c in completions]
    if completions and all(r is not None for r in own):  # a user environment's own reward(text), instead of rollout.reward
        rewards = [float(r) for r in own]
    else:
        rewards = [float(r) for r in reward_fn([c.text for c in completions], examples)]
    if shaping is not None:
        shaping = dict(shaping)
        if shaping.pop("credit", "partial") == "solved":
            solved = solved_rule(reward_fn)
            rewards = [float(solved(r)) for r in rewards]
        rewards = shape_rewards(rewards, [c.finish_reason for c in completions], **shaping)
    return rewards, getattr(reward_fn, "errors", 0) - before


def reward_failures(reward_fn, counted: Optional[tuple[int, int]], cfg, step: int, acc=None) -> dict[str, float]:
    """A reward plugin's failed calls in step `step` since `counted` (`SafeReward.start_count()` at the step's start):
    calls that raised, timed out, returned a non-number or a value not finite in float32 (each scored 0). Above
    reward.max_failure_rate of its calls the run stops with one line naming the plugin and the first failure; any
    fewer are warned about on stderr. The counts are summed over the ranks of `acc` (an Accelerator; None: this
    process only), so every rank stops together. Returns {reward/failure_rate} for a plugin reward, and
    {reward/timeouts} (this process's calls cut at their time limit in the step) for any reward scoring in workers."""
    import sys

    from emapg_cli.rewards.plugin import is_plugin_ref

    timeouts = {} if counted is None or not hasattr(reward_fn, "timeouts_at_start") or not hasattr(reward_fn.fn, "timeouts") \
        else {"reward/timeouts": float(reward_fn.timeouts - reward_fn.timeouts_at_start)}
    if counted is None or not is_plugin_ref(cfg.rollout.reward):
        return timeouts
    calls, failures = reward_fn.calls - counted[0], reward_fn.errors - counted[1]
    if acc is not None and acc.num_processes > 1:  # every rank takes the same decision
        total = acc.reduce(torch.tensor([float(calls), float(failures)], device=acc.device), reduction="sum")
        calls, failures = int(total[0]), int(total[1])
    if calls <= 0:  # an environment's own reward(text) scored every response
        return {}
    rate, limit, ref = failures / calls, cfg.reward.max_failure_rate, cfg.rollout.reward
    first = reward_fn.first_error or "no finite score"
    if rate > limit:
        raise UserError(f"step {step}: reward plugin {ref} failed on {failures} of {calls} calls ({rate:.0%} > "
                        f"reward.max_failure_rate {limit:g}); first failure: {first}")
    if failures:
        print(f"warning: step {step}: reward plugin {ref} failed on {failures} of {calls} calls ({rate:.0%}, scored 0; "
              f"first failure: {first})", file=sys.stderr, flush=True)
    return {"reward/failure_rate": rate, **timeouts}


@dataclass
class RolloutBatch:
    """B = groups x n (prompt, response) rows: prompts left-padded to P, responses right-padded to R."""

    input_ids: Tensor  # [B, P + R]
    attention_mask: Tensor  # [B, P + R]
    response_mask: Tensor  # [B, R] 1 = a real response token (policy or observation): the log-prob passes score these
    prompt_len: int
    advantages: Tensor  # [B]
    loss_mask: Optional[Tensor] = None  # [B, R] 1 = a token the policy sampled (multi-turn: observations are 0); None = response_mask
    sampling_logp: Optional[Tensor] = None  # [B, R] engine's log-probs (diagnostic)
    old_logp: Optional[Tensor] = None  # [B, R]
    is_weight: Optional[Tensor] = None  # [B, R] sg weight of the policy-gradient term (train.rollout_correction); None: 1
    q_index: Optional[Tensor] = None  # [B, R, k]
    ref_logp: Optional[Tensor] = None  # [B, R]
    ref_logp_q: Optional[Tensor] = None  # [B, R, k]
    keep: Optional[Tensor] = None  # [B] bool, on the CPU: rows the update trains on (None: all); train.mask_truncated drops the others
    # [B] int64 on the CPU: the GRPO sample (episode) of each row, when an agent's episode is several sequences
    # (`agents.agent.AgentEpisode.segments`; docs/agents.md); None: row i is sample i
    episode: Optional[Tensor] = None

    @property
    def policy_mask(self) -> Tensor:
        """[B, R] the tokens every loss term, the entropy metric and the token counts use (observation masking)."""
        return self.loss_mask if self.loss_mask is not None else self.response_mask

    @property
    def targets(self) -> Tensor:
        return self.input_ids[:, self.prompt_len:]  # [B, R]

    def select(self, rows: Tensor) -> "RolloutBatch":
        """Rows `rows`, with padding columns that none of them uses trimmed off both ends."""
        attn = self.attention_mask[rows]
        left_pad = int((attn[:, :self.prompt_len] == 0).sum(-1).min())
        resp = self.response_mask[rows]
        r_len = max(int(resp.sum(-1).max()), 1)
        p_new = self.prompt_len - left_pad
        cols = slice(left_pad, self.prompt_len + r_len)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("input_ids", "attention_mask"):
                out[f.name] = v[rows][:, cols]
            elif f.name == "prompt_len":
                out[f.name] = p_new
            elif f.name in ("advantages", "keep", "episode"):
                out[f.name] = v[rows] if v is not None else None
            elif v is not None:
                out[f.name] = v[rows][:, :r_len]
        return RolloutBatch(**out)

    def lengths(self) -> tuple[Tensor, Tensor]:
        """(real prompt tokens [B], response tokens [B]) of every row, on the CPU."""
        prompt = self.attention_mask[:, :self.prompt_len].sum(-1).cpu()
        return prompt, self.response_mask.sum(-1).cpu()

    def with_(self, **kw) -> "RolloutBatch":
        return replace(self, **kw)

    def with_advantages(self, per_sample: Tensor) -> "RolloutBatch":
        """The batch with each row's advantage: its sample's (`per_sample` [samples]; every row of an agent's episode
        gets the episode's)."""
        rows = per_sample if self.episode is None else per_sample[self.episode.to(per_sample.device)]  # [B]
        return replace(self, advantages=rows)

    @property
    def num_samples(self) -> int:
        """GRPO samples (groups x n) the rows belong to."""
        return self.advantages.shape[0] if self.episode is None else int(self.episode.max()) + 1

    def rows_of(self, samples: Tensor) -> Tensor:
        """The rows of `samples` [S] (sample indices), sample by sample in the order given. [>= S]"""
        if self.episode is None:
            return samples
        return (self.episode[None, :] == samples[:, None].cpu()).nonzero()[:, 1]  # [rows]: row-major, so sample order


def _ragged(lengths: list[int]) -> tuple[Tensor, Tensor]:
    """(row, position within the row) of every element of rows of `lengths` laid end to end. [sum], [sum]"""
    n = torch.tensor(lengths, dtype=torch.long)  # [B]
    rows = torch.repeat_interleave(torch.arange(len(lengths)), n)  # [sum]
    starts = torch.cumsum(n, 0) - n  # [B]
    return rows, torch.arange(int(n.sum())) - starts[rows]


def build_batch(prompt_ids: Sequence[list[int]], completions: Sequence[Completion], advantages: Tensor, pad_id: int) -> RolloutBatch:
    """Pad prompt i (repeated once per completion row) and completion i into one RolloutBatch (vectorised:
    every token is placed by one indexed assignment).

    A completion with a `policy_mask` (a multi-turn `agents.Episode`: 1 = sampled by the policy,
    0 = an observation) sets the batch's `loss_mask`; otherwise every response token is the policy's.
    Completions that recorded their top-k ids (`Completion.topk_index`, all or none) fill `q_index` [B, R, k].
    """
    b = len(completions)
    plens = [len(p) for p in prompt_ids]
    rlens = [len(c.token_ids) for c in completions]
    plen, rlen = max(plens), max(max(rlens), 1)
    input_ids = torch.full((b, plen + rlen), pad_id, dtype=torch.long)  # [B, P + R]
    attn = torch.zeros((b, plen + rlen), dtype=torch.long)  # [B, P + R]
    resp_mask = torch.zeros((b, rlen), dtype=torch.bool)  # [B, R]
    # engine log-probs (diagnostic); None when a completion has none (search.retokenize)
    samp = torch.zeros((b, rlen)) if all(c.logprobs is not None for c in completions) else None  # [B, R]
    rows, pos = _ragged(plens)
    cols = plen - torch.tensor(plens, dtype=torch.long)[rows] + pos  # left padding
    input_ids[rows, cols] = torch.tensor([t for p in prompt_ids for t in p], dtype=torch.long)
    attn[rows, cols] = 1
    rows, pos = _ragged(rlens)
    input_ids[rows, plen + pos] = torch.tensor([t for c in completions for t in c.token_ids], dtype=torch.long)
    attn[rows, plen + pos] = 1
    resp_mask[rows, pos] = True
    if samp is not None:
        samp[rows, pos] = torch.tensor([x for c in completions for x in c.logprobs], dtype=torch.float32)
    loss_mask = None  # [B, R]
    if any(getattr(c, "policy_mask", None) is not None for c in completions):
        loss_mask = torch.zeros((b, rlen), dtype=torch.bool)
        loss_mask[rows, pos] = torch.tensor([bool(x) for c in completions for x in
                                             (getattr(c, "policy_mask", None) or [1] * len(c.token_ids))], dtype=torch.bool)
    q_index = None
    if completions and all(getattr(c, "topk_index", None) is not None for c in completions):
        k = max(c.topk_index.shape[-1] for c in completions)
        q_index = torch.zeros((b, rlen, k), dtype=torch.long)  # [B, R, k]
        if rows.numel():
            q_index[rows, pos] = torch.cat([c.topk_index.reshape(-1, k) for c in completions])
    return RolloutBatch(input_ids, attn, resp_mask, plen, advantages.float(), sampling_logp=samp, q_index=q_index,
                        loss_mask=loss_mask)


def padded_batch(prompt_ids: Sequence[list[int]], completions: Sequence[Completion], n: int, mask_truncated: bool,
                 pad_id: int, device) -> tuple[RolloutBatch, int]:
    """The step's batch on `device` (advantages zero until the rewards are in) from each group's prompt ids and its
    n completions each, and how many rows were truncated. `mask_truncated` (overlong filtering, rllm's
    mask_truncated_samples): truncated rows leave the update; their rewards still enter their group's GRPO
    statistics, as rllm drops them after computing the advantages."""
    from emapg_cli.rewards.shaping import is_truncated

    prompts, rows, episode, empty = sequence_rows([p for p in prompt_ids for _ in range(n)], completions)
    batch = build_batch(prompts, rows, torch.zeros(len(rows)), pad_id)
    cut = torch.tensor([is_truncated(c.finish_reason) for c in rows], dtype=torch.bool)  # [B]
    truncated = int(cut.sum()) if episode is None else sum(is_truncated(c.finish_reason) for c in completions)
    if episode is not None:  # an agent's episodes: their sequences, and one empty row (not trained) for an episode without
        batch.episode = episode
        batch.keep = ~empty if not mask_truncated else ~(empty | cut)
    if mask_truncated:
        batch.response_mask[cut] = False  # no token of theirs is scored by the passes or counted in the metrics
        if batch.loss_mask is not None:
            batch.loss_mask[cut] = False
        batch.keep = ~cut if episode is None else batch.keep  # [B] ... nor counted as sequences of their mini-batch (update_policy)
    batch = batch.with_(**{f: getattr(batch, f).to(device) for f in
                           ("input_ids", "attention_mask", "response_mask", "advantages", "sampling_logp", "q_index", "loss_mask")
                           if getattr(batch, f) is not None})
    return batch, truncated


def sequence_rows(prompt_ids: list[list[int]], completions: Sequence[Completion]):
    """(row prompts, row completions, each row's sample [B] or None, empty rows [B] bool or None): one row per
    completion, except an agent's episodes (`segments`, docs/agents.md): a row per sequence, its own prompt, and
    one empty row (the trainer's prompt, no response token) for an episode without any."""
    if not any(hasattr(c, "segments") for c in completions):
        return prompt_ids, completions, None, None
    prompts, rows, episode, empty = [], [], [], []
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        segments = getattr(c, "segments", None) or []
        for seg in segments:
            prompts.append(seg.prompt)
            rows.append(seg.episode)
        if not segments:
            prompts.append(p)
            rows.append(Completion(token_ids=[], text="", finish_reason="stop", logprobs=[]))
        episode += [i] * max(len(segments), 1)
        empty += [not segments] * max(len(segments), 1)
    return prompts, rows, torch.tensor(episode, dtype=torch.long), torch.tensor(empty, dtype=torch.bool)


def micro_batches(rows: Tensor, max_rows: int) -> list[Tensor]:
    """Split `rows` [n] into consecutive micro-batches of at most `max_rows` rows."""
    return [rows[i:i + max_rows] for i in range(0, rows.numel(), max_rows)]
