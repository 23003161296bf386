"""What one RL step needs, decided once from the config: the passes to run, where q comes from, how the token
scorer runs a pass, and the loss. The trainer builds a `StepSettings` at setup (`step_settings`) and hands it
down; train/passes.py, train/update.py and train/logprobs.py never read the config themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from emapg_cli.errors import UserError
from emapg_cli.grpo import sequence_level
from emapg_cli.grpo.distill import distill_estimator
from emapg_cli.kl import INFO, topk_source
from emapg_cli.train.loss import PolicyLoss


def capped_k(k: int, vocab: int) -> int:
    """The top-k size the passes use: kl.k, at most the vocabulary (a top-k of more ids than exist is all of them)."""
    return min(k, vocab)


@dataclass(frozen=True)
class PassSettings:
    """How the token scorer (`train.logprobs.TokenScorer`) runs a pass, and how a batch is cut into micro-batches.

    `temperature` is rollout.temperature (log-probs refer to the distribution sampled from); `chunk` / `budget_mib`
    size the output layer's chunks (train.logit_chunk / train.logit_memory_mib); `pack` / `share` are
    train.pack_sequences / train.share_prompts; `micro_batch_size` is train.micro_batch_size."""

    temperature: float = 1.0
    chunk: Optional[int] = None
    budget_mib: float = 256.0
    pack: str = "never"
    share: str = "never"
    micro_batch_size: int = 1

    def scorer_args(self, **over: Any) -> dict[str, Any]:
        """The scorer's keyword arguments for a pass with these settings (`over` adds or replaces some)."""
        return {"temperature": self.temperature, "chunk": self.chunk, "budget_mib": self.budget_mib,
                "pack": self.pack, "share": self.share, **over}


@dataclass(frozen=True)
class StepSettings:
    """What a step needs, decided once (`step_settings`).

    q_from: where the top-k set q of a Top-k estimator comes from (None: the estimator needs no q, or kl.coef = 0):
      "engine"  the rollout engine's records while sampling (reverse direction, old log-probs from the engine; under
                train.old_logprobs=auto a batch without records falls back to the old-policy pass),
      "policy"  the old-policy pass (reverse direction: q is the sampling policy's top-k),
      "anchor"  the anchor pass (forward direction, or kl.topk_from=anchor: q is the anchor's own top-k).
    """

    k: int  # kl.k capped to the vocabulary (`capped_k`)
    topk: bool  # the KL term reads log-probs at a top-k set q (kl.coef > 0 and a Top-k estimator)
    q_from: Optional[str]
    old_from_engine: bool  # old log-probs (and q) are the engine's records (`train.old_logprobs` engine, or auto with hf)
    engine_required: bool  # train.old_logprobs=engine: insist on the engine's records (auto falls back to the pass)
    single_on_policy: bool  # one epoch of one mini-batch: old log-probs = the update's own detached first pass
    correction_old_pass: bool  # a sequence-level rollout correction needs the old log-probs before the update
    old_pass_fallback: bool  # the old-policy pass is needed when the engine's records are not used
    old_pass: bool  # the old-policy pass runs (the engine's records do not stand in for it)
    anchor_pass: bool  # a separate anchor pass runs (kl.coef > 0 and not `anchor_inside_loss`)
    anchor_inside_loss: bool  # the exact estimator reads the anchor's full logits inside the policy's loss
    anchor_autocast: bool  # ema.anchor_autocast (bf16 autocast around the anchor's pass on CUDA)
    engine_topk: int  # how many top-k ids the engine records per token (k when q_from == "engine", else 0)
    epochs: int = 1  # train.epochs
    group_size: int = 1  # rollout.n
    sequences_per_mini_batch: int = 1  # all ranks' rows per optimizer step
    grad_clip: Optional[float] = None  # optim.grad_clip
    passes: PassSettings = field(default_factory=PassSettings)
    loss: PolicyLoss = field(default_factory=PolicyLoss)


def old_from_engine(cfg) -> bool:
    """The old-policy log-probs (and q) are the rollout engine's, recorded while sampling (`train.old_logprobs`)."""
    source = cfg.train.old_logprobs
    return source == "engine" or (source == "auto" and cfg.rollout.engine == "hf")


def check_rollout_correction(cfg) -> None:
    """A train.rollout_correction other than none needs the engine's sampling log-probs and old-policy log-probs that
    are not those same records: a one-line UserError when the config rules either out (at launch, and in `--dry-run`)."""
    mode = cfg.train.rollout_correction
    if mode == "none":
        return
    if old_from_engine(cfg):
        source = cfg.train.old_logprobs + (f" (engine, with rollout.engine={cfg.rollout.engine})" if cfg.train.old_logprobs == "auto" else "")
        raise UserError(f"train.rollout_correction={mode} weighs by pi_old / pi_engine, but train.old_logprobs={source} makes "
                        "the old-policy log-probs the engine's own (the ratio is 1): set train.old_logprobs=pass or "
                        "train.rollout_correction=none")
    if cfg.search.enabled and cfg.search.retokenize:
        raise UserError(f"train.rollout_correction={mode} needs the engine's sampling log-probs, which search.retokenize "
                        "drops: set train.rollout_correction=none")


def policy_loss(cfg) -> PolicyLoss:
    """The loss of the update (PPO-clip + beta * KL, rollout correction) from the `train` and `kl` sections; with
    train.objective distill / rl+distill the KL term is the distillation term (`grpo.distill.distill_estimator`)."""
    t, kl = cfg.train, cfg.kl
    distils = t.objective != "rl"  # K1 is trained in its score-function form (grpo/distill.py)
    return PolicyLoss(beta=kl.coef, estimator=distill_estimator(kl.estimator) if distils else kl.estimator, distill=distils, direction=kl.direction, iw=kl.iw, iw_clip=kl.iw_clip,
                      log_ratio_clamp=kl.log_ratio_clamp, estimate_clamp=kl.estimate_clamp, clip_low=t.clip_low,
                      clip_high=t.clip_high, dual_clip=t.dual_clip, agg=t.loss_agg, correction=t.rollout_correction,
                      correction_cap=t.rollout_correction_cap)


def pass_settings(cfg) -> PassSettings:
    """The token scorer's pass settings from the `rollout` and `train` sections."""
    t = cfg.train
    return PassSettings(temperature=cfg.rollout.temperature, chunk=t.logit_chunk, budget_mib=t.logit_memory_mib,
                        pack=t.pack_sequences, share=t.share_prompts, micro_batch_size=t.micro_batch_size)


def step_settings(cfg, vocab: int) -> StepSettings:
    """The step's settings for a policy whose output layer has `vocab` ids (decided once, at setup)."""
    info, loss = INFO[cfg.kl.estimator], policy_loss(cfg)
    kl_on = cfg.kl.coef > 0
    topk = loss.topk  # the one test of "the KL term needs q"
    from_engine = old_from_engine(cfg)
    sampling_q = topk and topk_source(cfg.kl.direction, cfg.kl.topk_from) == "sampling"  # q: the sampling policy's top-k
    q_from = None if not topk else ("anchor" if not sampling_q else "engine" if from_engine else "policy")
    single = cfg.train.epochs == 1 and cfg.derived.mini_batches_per_step == 1
    correction_old = sequence_level(cfg.train.rollout_correction)
    fallback = not single or sampling_q or correction_old
    k = capped_k(cfg.kl.k, vocab)
    inside = kl_on and info.full_vocab
    return StepSettings(
        k=k, topk=topk, q_from=q_from, old_from_engine=from_engine, engine_required=cfg.train.old_logprobs == "engine",
        single_on_policy=single, correction_old_pass=correction_old, old_pass_fallback=fallback,
        old_pass=not from_engine and fallback, anchor_pass=kl_on and not inside, anchor_inside_loss=inside,
        anchor_autocast=cfg.ema.anchor_autocast, engine_topk=k if q_from == "engine" else 0,
        epochs=cfg.train.epochs, group_size=cfg.rollout.n, sequences_per_mini_batch=cfg.sequences_per_mini_batch,
        grad_clip=cfg.optim.grad_clip, passes=pass_settings(cfg), loss=loss,
    )
