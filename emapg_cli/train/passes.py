"""The no-grad passes before the update: old-policy log-probs (and q for reverse Top-k), then the anchor's."""

from __future__ import annotations

import contextlib

import torch

from emapg_cli.kl import INFO, topk_source
from emapg_cli.train.logprobs import TokenStats
from emapg_cli.train.rollout import RolloutBatch


def single_on_policy_step(cfg) -> bool:
    """One epoch of one mini-batch: the policy being updated is exactly the one that sampled.

    Then the old log-probs are the policy's own detached log-probs (ratio = 1 exactly) and the
    old-policy pass can be skipped.
    """
    return cfg.train.epochs == 1 and cfg.derived.mini_batches_per_step == 1


def anchor_inside_loss(cfg) -> bool:
    """The exact estimator reads the anchor's decoder and output layer inside the policy's loss (its full
    logits, chunk by chunk) instead of in a separate anchor pass."""
    return cfg.kl.coef > 0 and INFO[cfg.kl.estimator].full_vocab


def anchor_autocast(cfg, device: torch.device):
    """bf16 autocast around the anchor's forward on CUDA (`ema.anchor_autocast`): the fp32 anchor's
    matmuls run in bf16 like the policy's, as in the paper's code; a no-op on CPU."""
    if cfg.ema.anchor_autocast and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def needs_old_pass(cfg) -> bool:
    """The old-policy pass runs unless `single_on_policy_step`; reverse Top-k needs it anyway for q
    (the sampling policy's top-k set, which must be fixed before the update)."""
    info = INFO[cfg.kl.estimator]
    needs_q = cfg.kl.coef > 0 and info.uses_topk and topk_source(cfg.kl.direction) == "sampling"
    return not single_on_policy_step(cfg) or needs_q


@torch.no_grad()
def _run(scorer, batch: RolloutBatch, micro: int, fill: dict[str, torch.Tensor], **kw) -> None:
    """The scorer's pass over micro-batches of rows; each field f of the result lands in fill[f][rows, :R_micro].

    Called through the scorer module (not `token_stats` on the bare model) so a sharded model's
    hooks gather its weights; every rank runs the same number of micro-batches.
    """
    b = batch.advantages.shape[0]
    for s in range(0, b, micro):
        rows = torch.arange(s, min(s + micro, b), device=batch.input_ids.device)
        mb = batch.select(rows)  # trims every per-token field, q_index included
        stats: TokenStats = scorer(mb.input_ids, mb.attention_mask, mb.prompt_len, mb.response_mask, q_index=mb.q_index, **kw)
        r = mb.response_mask.shape[1]
        for name, out in fill.items():
            out[rows, :r] = getattr(stats, name)


def reference_passes(policy_scorer, anchor_scorer, batch: RolloutBatch, cfg, k: int) -> RolloutBatch:
    """Fill old_logp / q_index (old-policy pass) and ref_logp / ref_logp_q (anchor pass) as the config needs.

    Both models come as `TokenScorer`s (the policy's unwrapped from DDP; a sharded model's FSDP root).

    k is the effective top-k size (kl.k capped at the vocabulary). The exact estimator needs no
    anchor pass here: it evaluates the anchor's full logits chunk by chunk inside the loss.
    """
    b, r = batch.response_mask.shape
    device = batch.input_ids.device

    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=device)

    # no-grad passes never report entropy: skip its [chunk, V] softmax
    micro, common = cfg.train.micro_batch_size, dict(temperature=cfg.rollout.temperature, chunk=cfg.train.logit_chunk, entropy=False)
    info = INFO[cfg.kl.estimator]
    use_topk = cfg.kl.coef > 0 and info.uses_topk
    source = topk_source(cfg.kl.direction)
    out = {}
    if needs_old_pass(cfg):
        fill = {"logp": zeros(b, r)}  # [B, R]
        if use_topk and source == "sampling":
            fill["topk_index"] = zeros(b, r, k, dtype=torch.long)  # [B, R, k]
        was = policy_scorer.training
        policy_scorer.eval()
        _run(policy_scorer, batch.with_(q_index=None), micro, fill, topk=k if "topk_index" in fill else 0, **common)
        policy_scorer.train(was)
        out["old_logp"] = None if single_on_policy_step(cfg) else fill["logp"]
        if "topk_index" in fill:
            out["q_index"] = fill["topk_index"]
    if cfg.kl.coef > 0 and not anchor_inside_loss(cfg):
        with anchor_autocast(cfg, device):  # weights stay fp32; the matmuls run in bf16 on CUDA
            fill = {"logp": zeros(b, r)}  # [B, R]
            if use_topk:
                fill["logp_q"] = zeros(b, r, k)  # [B, R, k]
            if use_topk and source == "anchor":  # q is the anchor's own top-k, gathered in the same pass
                fill["topk_index"] = zeros(b, r, k, dtype=torch.long)  # [B, R, k]
                _run(anchor_scorer, batch.with_(q_index=None), micro, fill, topk=k, **common)
                out["q_index"] = fill["topk_index"]
            else:
                _run(anchor_scorer, batch.with_(q_index=out.get("q_index")), micro, fill, **common)
            out["ref_logp"] = fill["logp"]
            if use_topk:
                out["ref_logp_q"] = fill["logp_q"]
    return batch.with_(**out)
