"""What a run builds before its first step: the seeds, the prompts, the models with their optimizer and learning-rate schedule."""

from __future__ import annotations

import functools
import math
import random

import numpy as np
import torch

from emapg_cli.errors import UserError
from emapg_cli.models.loading import DTYPES, compute_dtype
from emapg_cli.train.loading import load_policy, make_anchor
from emapg_cli.train.rollout import prepare_prompts


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_scheduler(optimizer, cfg):
    """Linear warm-up over `optim.warmup_ratio` of all optimizer steps, then constant."""
    total = cfg.train.steps * cfg.derived.optimizer_steps_per_rl_step
    warmup = math.ceil(cfg.optim.warmup_ratio * total)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup) if warmup else 1.0)


def run_prompts(tokenizer, inputs, max_prompt_tokens: int, message, with_eval: bool, prefix=()):
    """The tokenised prompts of the training and evaluation examples (`inputs`, from `preflight.preflight`), those
    longer than `max_prompt_tokens` left out: (train examples, train prompts, eval examples, eval prompts, skipped).
    `message`: question -> user message (None: the question alone); `prefix`: the chat turns before it
    (data.chat_prefix). No training prompt left is a UserError."""
    train_ex, train_prompts, skipped = prepare_prompts(tokenizer, inputs.train, max_prompt_tokens, message, prefix)
    if not train_ex:
        raise UserError(f"every training prompt is longer than data.max_prompt_tokens ({max_prompt_tokens})")
    eval_ex, eval_prompts, skipped_eval = [], [], 0
    if with_eval:  # data.eval_limit already applied, per source (train/preflight.py)
        eval_ex, eval_prompts, skipped_eval = prepare_prompts(tokenizer, inputs.eval, max_prompt_tokens, message, prefix)
    return train_ex, train_prompts, eval_ex, eval_prompts, skipped + skipped_eval


def build_models(cfg, strategy):
    """The policy (loaded after seeding with train.seed) and, when the run needs one, its anchor (the EMA copy, or
    anchor.source=teacher's model), wrapped by the
    parallel `strategy` together with the optimizer; the scheduler. Returns (scorer, anchor scorer or None,
    optimizer, scheduler, the step settings: `train.settings.step_settings`, decided once with the vocabulary)."""
    from emapg_cli.train.settings import step_settings

    seed_everything(cfg.train.seed)
    policy = load_policy(cfg.model, cfg.lora)
    vocab = policy.get_output_embeddings().weight.shape[0]
    settings = step_settings(cfg, vocab)
    anchor = make_anchor(policy, DTYPES[cfg.ema.dtype]) if cfg.derived.loads_anchor and cfg.anchor.source == "ema" else None
    if cfg.derived.loads_anchor and cfg.anchor.source == "teacher":  # a fixed model of its own (train/teacher.py)
        from emapg_cli.train.teacher import load_teacher

        anchor = load_teacher(cfg.anchor, cfg.model)
    # params -> AdamW with the `optim` settings (the parallel strategy builds it once the parameters are wrapped)
    o = cfg.optim
    adamw = functools.partial(torch.optim.AdamW, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    # float32 master weights (model.master_weights): the optimizer steps the float32 parameters, the
    # passes compute in model.dtype (autocast, or FSDP2's mixed precision)
    scorer, anchor_scorer, optimizer = strategy.wrap(policy, anchor, adamw, compute_dtype(cfg.model, cfg.lora))
    return scorer, anchor_scorer, optimizer, make_scheduler(optimizer, cfg), settings
