"""The policy update of one RL step: mini-batches x epochs of PPO-clip + beta * KL, with a skip on non-finite values."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from emapg_cli.errors import UserError
from emapg_cli.grpo import CorrectionStats, rollout_correction
from emapg_cli.train.logprobs import response_hidden
from emapg_cli.train.loss import PolicyLoss, no_sampling_logprobs
from emapg_cli.train.rollout import RolloutBatch, micro_batches
from emapg_cli.train.settings import StepSettings


@dataclass
class LossParts:
    """The aggregated loss of one micro-batch and its detached parts (for metrics)."""

    loss: Tensor
    pg: float
    kl: float
    clipped_tokens: float
    entropy_sum: float
    tokens: float
    logprob_diff: Optional[Tensor] = None  # [tokens] this pass's log-probs - the engine's (no old-policy pass)
    distill: dict = field(default_factory=dict)  # sums over the tokens of the distillation extras (`loss.distill_extras`)
    kl_seq_sum: float = 0.0  # sum over the micro-batch's sequences (with a token) of their mean per-token KL estimate
    kl_seqs: float = 0.0  # those sequences


def sequence_token_means(values: Tensor, mask: Tensor) -> tuple[float, float]:
    """(sum over the rows of `mask` [b, R] with a token of the row's mean of `values` [b, R] over its tokens, the
    number of those rows): the KL per token as verl's adaptive controller measures it (`apply_kl_penalty`: the mean
    over sequences of each one's token mean), whatever train.loss_agg. Values outside the mask may hold anything."""
    m = mask.bool()
    count = m.sum(-1)  # [b]
    per_row = torch.where(m, values, torch.zeros_like(values)).double().sum(-1) / count.clamp(min=1)  # [b]
    rows = count > 0
    return float(per_row[rows].sum()), float(rows.sum())


def correction_weights(batch: RolloutBatch, loss: PolicyLoss) -> tuple[RolloutBatch, Optional[CorrectionStats]]:
    """The batch with `is_weight` [B, R] = sg(w) of train.rollout_correction computed from its old-policy and
    sampling log-probs over the policy's tokens, and the statistics of rho; unchanged (None) with mode none, or
    for a token mode without old-policy log-probs (one on-policy step: the loss computes w from its own first
    pass, `PolicyLoss.per_token`). Sequence modes always have them (`StepSettings.correction_old_pass`). The config's
    own refusals (`settings.check_rollout_correction`) ran once at launch."""
    mode = loss.correction
    if mode == "none":
        return batch, None
    if batch.sampling_logp is None:
        raise UserError(no_sampling_logprobs(mode))
    if batch.old_logp is None:
        return batch, None
    w, stats = rollout_correction(batch.old_logp, batch.sampling_logp, batch.policy_mask, mode, loss.correction_cap)
    return batch.with_(is_weight=w), stats


def micro_batch_loss(scorer, mb: RolloutBatch, settings: StepSettings, num_tokens: float, num_seqs: float, anchor_lm=None,
                     record: bool = False) -> LossParts:
    """PPO-clip + beta * KL (`settings.loss`) on one micro-batch, aggregated with the mini-batch totals (gradient
    accumulation).

    The loss is computed by the fused output layer (`emapg_cli.kl.fused`): its gradient w.r.t. the
    logits is formed chunk by chunk inside the forward. With `record` (the first optimizer step of the
    update, without an old-policy pass) this pass runs on the weights that sampled the batch, so its
    log-probs are also compared with the engine's (`logprob_diff`).
    """
    p = settings.passes
    ref_hidden = ref_head = None
    if settings.anchor_inside_loss:  # exact: the anchor's full logits, chunk by chunk inside the pass
        with torch.no_grad():
            ref_hidden = response_hidden(anchor_lm, mb.input_ids, mb.attention_mask, mb.prompt_len, p.pack, p.share)  # [b, R, H]
        ref_head = anchor_lm.get_output_embeddings()
    loss_mask = mb.policy_mask.bool()  # [b, R] observation tokens (multi-turn) get no loss, no KL, no entropy, no count
    stats = scorer(
        mb.input_ids, mb.attention_mask, mb.prompt_len, mb.response_mask, q_index=mb.q_index if settings.topk else None,
        loss_fn=settings.loss.per_token(mb, num_tokens, num_seqs, loss_mask), loss_mask=loss_mask, ref_hidden=ref_hidden,
        ref_head=ref_head, **p.scorer_args(),
    )
    m = loss_mask.float()
    record = record and mb.sampling_logp is not None
    diff = (stats.logp.detach() - mb.sampling_logp)[loss_mask] if record else None

    def total(name: str) -> float:  # over the tokens whose loss counts (masked ones may hold anything)
        v = stats.aux.get(name)
        return float(torch.where(loss_mask, v, torch.zeros_like(v)).sum()) if v is not None else 0.0

    kl_seq_sum, kl_seqs = sequence_token_means(stats.aux["kl_tok"], loss_mask) if "kl_tok" in stats.aux else (0.0, 0.0)
    return LossParts(
        loss=stats.loss, pg=total("pg"), kl=total("kl"),
        clipped_tokens=total("clipped"), entropy_sum=float((stats.entropy * m).sum()),
        tokens=float(m.sum()), logprob_diff=diff, distill={k: total(k) for k in ("dkl", "tail") if k in stats.aux},
        kl_seq_sum=kl_seq_sum, kl_seqs=kl_seqs,
    )


class NonFiniteWeights(Exception):
    """An optimizer step left inf or nan in the policy's weights (finite loss and gradient notwithstanding)."""


def all_finite(tensors: list[Tensor]) -> bool:
    """Whether every element of `tensors` (this rank's shards of DTensors) is finite: one fused
    max-|x| reduction per tensor (inf for an inf element, nan for a nan), no copy of the weights."""
    local = [t.detach().to_local() if hasattr(t, "to_local") else t.detach() for t in tensors]
    local = [t for t in local if t.numel()]  # a rank's shard may be empty
    if not local:
        return True
    norms = torch._foreach_norm(local, ord=math.inf)  # one 0-d tensor per parameter
    return bool(torch.stack([n.float() for n in norms]).isfinite().all())


def _any_rank(accelerator, flag: bool) -> bool:
    """Whether `flag` holds on any rank (every rank gets the same answer)."""
    if accelerator.num_processes == 1:
        return flag
    t = torch.tensor(1.0 if flag else 0.0, device=accelerator.device)
    return float(accelerator.reduce(t, reduction="sum")) > 0


def finite_step(strategy, params, optimizer, grad_clip: Optional[float], loss_finite: bool) -> tuple[float, bool]:
    """Clip and step the optimizer unless the loss or the gradient norm is non-finite.

    Returns (pre-clip global grad norm, stepped). On a non-finite value (agreed across ranks) the
    gradients are dropped and the optimizer state is left untouched. The norm is computed even
    without clipping (max_norm = inf). After a step the weights are checked (`all_finite`, agreed
    across ranks): a step that made them non-finite raises NonFiniteWeights, so the trainer stops
    before the EMA anchor or a checkpoint can take them.
    """
    accelerator = strategy.acc
    norm = strategy.clip_grad_norm(params, grad_clip if grad_clip is not None else math.inf)
    stepped = not _any_rank(accelerator, not (loss_finite and math.isfinite(norm)))
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if stepped and _any_rank(accelerator, not all_finite(params)):
        raise NonFiniteWeights(f"the optimizer step made the policy's weights non-finite (finite loss, grad norm {norm:.3g})")
    return norm, stepped


@dataclass
class UpdateStats:
    """Sums over the optimizer steps of one RL step (the trainer turns them into metrics)."""

    pg: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    clipped_tokens: float = 0.0
    entropy_sum: float = 0.0
    tokens: float = 0.0
    skipped: int = 0
    logprob_diffs: list[Tensor] = field(default_factory=list)  # see LossParts.logprob_diff
    correction: Optional[CorrectionStats] = None  # rho's statistics (train.rollout_correction), this rank's rows
    distill: dict = field(default_factory=dict)  # sums of LossParts.distill over the step's micro-batches
    kl_seq_sum: float = 0.0  # LossParts.kl_seq_sum over every micro-batch of every epoch (all ranks after the update)
    kl_seqs: float = 0.0  # LossParts.kl_seqs likewise: each trained sequence once per epoch

    def add(self, parts: "LossParts") -> None:
        """Count one micro-batch's clipped tokens, entropy, tokens and engine/trainer log-prob differences."""
        self.clipped_tokens += parts.clipped_tokens
        self.entropy_sum += parts.entropy_sum
        self.tokens += parts.tokens
        self.kl_seq_sum += parts.kl_seq_sum
        self.kl_seqs += parts.kl_seqs
        if parts.logprob_diff is not None:
            self.logprob_diffs.append(parts.logprob_diff)
        for k, v in parts.distill.items():
            self.distill[k] = self.distill.get(k, 0.0) + v


def global_token_share(accelerator, local_tokens: float) -> float:
    """The mini-batch's response tokens over all ranks, divided by the number of ranks.

    Passed as token-mean's N_tokens: each rank's loss is then sum_rank / (N_all / world), and the
    gradient average that DDP and FSDP apply (a mean over ranks) gives sum_all / N_all, the
    token-mean of the whole mini-batch however its tokens fall on the ranks. One process: unchanged.
    """
    if accelerator.num_processes == 1:
        return local_tokens
    total = accelerator.reduce(torch.tensor(local_tokens, dtype=torch.float64, device=accelerator.device), reduction="sum")
    return float(total) / accelerator.num_processes


def kept_rows(accelerator, batch: RolloutBatch, rows: Tensor) -> tuple[Tensor, float]:
    """The mini-batch's rows without the dropped ones (`batch.keep`, train.mask_truncated: no loss, no count), and
    its number of sequences (seq-mean's N_seqs: all ranks' kept rows / world when rows were dropped)."""
    if batch.keep is None:
        return rows, float(rows.numel())
    kept = rows[batch.keep[rows]]
    num_seqs = global_token_share(accelerator, float(kept.numel()))  # all ranks' kept rows / world
    # a mini-batch left empty on this rank still runs one (zero-loss) pass on a dropped row, whose masks
    # are zero, so that every rank takes part in the gradient reduction
    return (kept if kept.numel() else rows[:1]), num_seqs


def mini_batch_rows(order: Tensor, group_size: int, rows_per_mini: int) -> list[Tensor]:
    """The rows of each mini-batch of one epoch: groups in `order` [G] laid out row by row (group g holds
    rows g*n .. g*n + n - 1), cut into consecutive chunks of `rows_per_mini` rows. [rows_per_mini] each.

    With rows_per_mini a multiple of n every chunk is whole groups (train.mini_batch_prompts); otherwise
    a group's rows may fall into two chunks (train.mini_batch_sequences, verl's ppo_mini_batch_size
    splitting the batch of sequences).
    """
    laid = (order[:, None] * group_size + torch.arange(group_size)).reshape(-1)  # [G * n]
    return [laid[r0:r0 + rows_per_mini] for r0 in range(0, laid.numel(), rows_per_mini)]


def update_policy(strategy, scorer, batch: RolloutBatch, settings: StepSettings, optimizer, scheduler,
                  generator: torch.Generator, anchor_lm=None) -> UpdateStats:
    """`epochs` passes over this rank's rollouts in mini-batches, micro-batched.

    Each epoch shuffles the groups with `generator`, lays their rows out group by group and cuts
    that row sequence into mini-batches of this rank's share of `settings.sequences_per_mini_batch`
    rows (`mini_batch_rows`): whole groups with train.mini_batch_prompts, while with
    train.mini_batch_sequences a group may span two mini-batches (its advantages were computed
    over the whole group before the update, as in verl). The learning-rate schedule advances
    once per optimizer step that was taken (a skipped step leaves optimizer and schedule untouched).
    """
    accelerator = strategy.acc
    s, p, group_size = settings, settings.passes, settings.group_size
    n_groups = batch.num_samples // group_size
    rows_per_mini = s.sequences_per_mini_batch // accelerator.num_processes  # this rank's rows per optimizer step
    stats = UpdateStats()
    params = [p for p in scorer.parameters() if p.requires_grad]
    record = not s.old_pass  # no old-policy pass measured the engine/trainer mismatch: the first step does
    batch, stats.correction = correction_weights(batch, s.loss)
    in_loss = s.loss.correction != "none" and batch.is_weight is None  # w from the first pass (PolicyLoss.per_token)
    record = record or in_loss  # then the first pass is on the sampling weights (one on-policy step)
    for _ in range(s.epochs):
        order = torch.randperm(n_groups, generator=generator)
        for samples in mini_batch_rows(order, group_size, rows_per_mini):
            rows, num_seqs = kept_rows(accelerator, batch, batch.rows_of(samples))  # an agent's episode: all its sequences
            mask = batch.policy_mask[rows]
            num_tokens = float(mask.sum())
            if s.loss.agg == "token-mean":  # the only mode that divides by a token count
                num_tokens = global_token_share(accelerator, num_tokens)
            micros = micro_batches(rows, p.micro_batch_size)
            finite = True
            pg = kl = 0.0
            for i, micro in enumerate(micros):
                with strategy.no_sync(scorer, last=i == len(micros) - 1):
                    parts = micro_batch_loss(scorer, batch.select(micro), s, num_tokens, num_seqs, anchor_lm, record)
                    if not parts.loss.requires_grad:  # no response token left (train.mask_truncated): a zero gradient
                        parts.loss = parts.loss + sum(p.sum() for p in params) * 0.0
                    finite = finite and bool(torch.isfinite(parts.loss.detach()))
                    accelerator.backward(parts.loss)
                pg, kl = pg + parts.pg, kl + parts.kl
                stats.add(parts)
            record = False  # the weights change from here on
            norm, stepped = finite_step(strategy, params, optimizer, s.grad_clip, finite)
            if stepped:
                scheduler.step()
            stats.skipped += 0 if stepped else 1
            stats.pg.append(pg)
            stats.kl.append(kl)
            stats.grad_norm.append(norm)
    if in_loss and stats.logprob_diffs:  # the weights the loss used: rho = exp(first pass - engine), per token
        d = torch.cat(stats.logprob_diffs)  # [tokens]
        stats.correction = rollout_correction(d, torch.zeros_like(d), torch.ones_like(d, dtype=torch.bool),
                                              s.loss.correction, s.loss.correction_cap)[1]
    if accelerator.num_processes > 1:
        over_ranks(accelerator, stats)
    return stats


def over_ranks(accelerator, stats: UpdateStats) -> None:
    """The step's numbers that every rank must agree on: the loss parts (each rank's loss is its share of the mini-batch
    loss: their mean) and the sequences' per-token KL (adaptive beta's measure: sums over every rank's sequences)."""
    losses = torch.tensor(stats.pg + stats.kl, dtype=torch.float64, device=accelerator.device)
    losses = accelerator.reduce(losses, reduction="mean").tolist()
    stats.pg, stats.kl = losses[:len(stats.pg)], losses[len(stats.pg):]
    seqs = torch.tensor([stats.kl_seq_sum, stats.kl_seqs], dtype=torch.float64, device=accelerator.device)
    stats.kl_seq_sum, stats.kl_seqs = accelerator.reduce(seqs, reduction="sum").tolist()

