"""The no-grad passes before the update: old-policy log-probs (and q for reverse Top-k), then the anchor's."""

from __future__ import annotations

import contextlib

import torch

from emapg_cli.errors import UserError
from emapg_cli.grpo import sequence_level
from emapg_cli.kl import INFO, topk_source
from emapg_cli.train.logprobs import TokenStats
from emapg_cli.train.rollout import RolloutBatch, micro_batches


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


def old_from_engine(cfg) -> bool:
    """The old-policy log-probs (and q) are the rollout engine's, recorded while sampling (`train.old_logprobs`)."""
    source = cfg.train.old_logprobs
    return source == "engine" or (source == "auto" and cfg.rollout.engine == "hf")


def check_rollout_correction(cfg) -> None:
    """A train.rollout_correction other than none needs the engine's sampling log-probs and old-policy log-probs that
    are not those same records: a one-line UserError when the config rules either out (at launch, in `--dry-run`,
    and again before the first update)."""
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


def engine_topk(cfg, k: int) -> int:
    """How many top-k ids the engine must record per token: k when reverse Top-k reads q from the engine, else 0."""
    info = INFO[cfg.kl.estimator]
    needs_q = cfg.kl.coef > 0 and info.uses_topk and topk_source(cfg.kl.direction) == "sampling"
    return k if needs_q and old_from_engine(cfg) else 0


def anchor_autocast(cfg, device: torch.device):
    """bf16 autocast around the anchor's forward on CUDA (`ema.anchor_autocast`): the fp32 anchor's
    matmuls run in bf16 like the policy's, as in the paper's code; a no-op on CPU."""
    if cfg.ema.anchor_autocast and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def needs_old_pass(cfg) -> bool:
    """The old-policy pass runs unless the engine's log-probs stand in for it (`old_from_engine`) or
    `single_on_policy_step`; reverse Top-k needs it anyway for q (the sampling policy's top-k set, which
    must be fixed before the update) unless the engine recorded q."""
    return not old_from_engine(cfg) and _pass_needed(cfg)


def correction_needs_old_pass(cfg) -> bool:
    """A sequence-level train.rollout_correction weighs each token by its whole sequence's ratio, which the fused
    loss (chunk by chunk) cannot know before the chunk: the old-policy log-probs must exist before the update,
    also for one on-policy step (token modes then take them from the update's own first pass)."""
    return sequence_level(cfg.train.rollout_correction)


def _pass_needed(cfg) -> bool:
    """Without the engine's records: old log-probs unless `single_on_policy_step` (or for a sequence-level
    rollout correction), and q for reverse Top-k."""
    info = INFO[cfg.kl.estimator]
    needs_q = cfg.kl.coef > 0 and info.uses_topk and topk_source(cfg.kl.direction) == "sampling"
    return not single_on_policy_step(cfg) or needs_q or correction_needs_old_pass(cfg)


def _layout_diff(scorer, mb: RolloutBatch, temperature: float, **layout) -> float:
    """The largest difference (nats) of `mb`'s response log-probs between the padded pass and `layout`."""
    mask = mb.response_mask.bool()
    if not mask.any():
        return 0.0
    args = (mb.input_ids, mb.attention_mask, mb.prompt_len, mb.response_mask)
    was = scorer.training
    scorer.eval()  # no dropout: the two passes must see the same function
    try:
        padded = scorer(*args, temperature=temperature, entropy=False, pack=False, share=False).logp  # [b, R]
        other = scorer(*args, temperature=temperature, entropy=False, **layout).logp  # [b, R]
    finally:
        scorer.train(was)
    return float((padded - other).abs()[mask].max())


#: check_layouts' tolerance when the passes run in bfloat16/float16 weights (model.master_weights=false, or FSDP's
#: mixed precision): two layouts of one bf16 pass differ by rounding, 1e-3 nats on the tiny test models, while a
#: layout the model does not honour (packed positions ignored, a key/value cache attended wrongly) moves log-probs
#: by whole nats. float32 passes keep 1e-4.
HALF_PRECISION_LAYOUT_TOL = 5e-2


@torch.no_grad()
def check_layouts(scorer, batch: RolloutBatch, temperature: float, pack: str, share: str, rows: int = 4,
                  tol: float = 1e-4) -> dict[str, float]:
    """The packed pass (`train.pack_sequences`) and the shared-prompt pass (`train.share_prompts`) must give
    the padded pass's log-probs; checked once per run on a few rows, because a model whose attention ignored
    transformers' packed-sequence positions, or a given key/value cache, would be wrong without an error.
    Packing is checked on the longest and the shortest rows (two sequences then share a packed row), sharing
    on two groups of rows with one prompt each. Returns the largest difference (nats) of each layout checked;
    one above `tol` is a user error."""
    from emapg_cli.models import prefix

    out = {}
    if pack != "never":
        prompt_lens, response_lens = batch.lengths()
        order = torch.argsort(prompt_lens + response_lens, descending=True, stable=True)  # [B]
        picked = torch.unique(torch.cat([order[:1], order[-(rows - 1):]])) if order.numel() > 1 else order
        out["pack"] = diff = _layout_diff(scorer, batch.select(picked.to(batch.input_ids.device)), temperature,
                                          pack=True, share=False)
        if not diff <= tol:
            raise UserError(f"train.pack_sequences: this model's log-probs differ by {diff:.2g} nats between packed and "
                            "padded rows (its attention does not keep packed sequences apart); set train.pack_sequences=never")
    lm = getattr(scorer, "lm", scorer)
    if share != "never" and prefix.supported(lm.get_decoder()):
        groups = prefix.prompt_groups(batch.input_ids, batch.attention_mask, batch.prompt_len)
        members = [torch.nonzero(groups.inverse == u).flatten()[: rows // 2] for u in range(min(groups.distinct, 2))]
        picked = torch.cat(members)  # [<= rows] two rows of each of (up to) two prompts
        if picked.numel() > len(members):  # some prompt repeats: there is something to share
            out["share"] = diff = _layout_diff(scorer, batch.select(picked.sort().values), temperature, pack=False, share=True)
            if not diff <= tol:
                raise UserError(f"train.share_prompts: this model's log-probs differ by {diff:.2g} nats between shared-prompt "
                                "and padded rows (its attention over a given key/value cache differs); set train.share_prompts=never")
    return out


@torch.no_grad()
def _run(scorer, batch: RolloutBatch, micro: int, max_tokens, fill: dict[str, torch.Tensor], **kw) -> None:
    """The scorer's pass over micro-batches of rows; each field f of the result lands in fill[f][rows, :R_micro].

    Called through the scorer module (not `token_stats` on the bare model) so a sharded model's
    hooks gather its weights; every rank runs the same number of micro-batches.
    """
    b = batch.advantages.shape[0]
    prompt_lens, response_lens = batch.lengths()
    for rows in micro_batches(torch.arange(b), prompt_lens, response_lens, micro, max_tokens):
        rows = rows.to(batch.input_ids.device)
        mb = batch.select(rows)  # trims every per-token field, q_index included
        stats: TokenStats = scorer(mb.input_ids, mb.attention_mask, mb.prompt_len, mb.response_mask, q_index=mb.q_index, **kw)
        r = mb.response_mask.shape[1]
        for name, out in fill.items():
            out[rows, :r] = getattr(stats, name)


def reference_passes(policy_scorer, anchor_scorer, batch: RolloutBatch, cfg, k: int) -> RolloutBatch:
    """Fill old_logp / q_index (old-policy pass) and ref_logp / ref_logp_q (anchor pass) as the config needs.
    Both models come as `TokenScorer`s (the policy's unwrapped from DDP; a sharded model's FSDP root). k is the
    effective top-k size (kl.k capped at the vocabulary). The exact estimator needs no anchor pass here: it
    evaluates the anchor's full logits chunk by chunk inside the loss."""
    b, r = batch.response_mask.shape
    device = batch.input_ids.device

    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=device)

    # no-grad passes never report entropy: skip its [chunk, V] softmax
    max_tokens = cfg.train.max_tokens_per_micro_batch
    micro, common = cfg.train.micro_batch_size, dict(temperature=cfg.rollout.temperature, chunk=cfg.train.logit_chunk,
                                                       budget_mib=cfg.train.logit_memory_mib, entropy=False,
                                                       pack=cfg.train.pack_sequences, share=cfg.train.share_prompts)
    info = INFO[cfg.kl.estimator]
    use_topk = cfg.kl.coef > 0 and info.uses_topk
    source = topk_source(cfg.kl.direction)
    out = {}
    recorded = batch.sampling_logp is not None and not (use_topk and source == "sampling" and batch.q_index is None)
    # `auto` uses the engine's records when it made them (the search agent's episodes, or a hand-built batch,
    # have none: then the pass runs); `engine` insists on them
    if old_from_engine(cfg) and (recorded or cfg.train.old_logprobs == "engine"):
        if use_topk and source == "sampling" and batch.q_index is None:
            raise UserError("train.old_logprobs=engine with reverse Top-k needs an engine that records the top-k "
                            "ids while sampling (hf); use train.old_logprobs=pass")
        if batch.sampling_logp is None:
            raise UserError("train.old_logprobs=engine needs an engine that returns sampling log-probs")
        out["old_logp"] = None if single_on_policy_step(cfg) else batch.sampling_logp
        if use_topk and source == "sampling":
            out["q_index"] = batch.q_index
    elif _pass_needed(cfg):
        fill = {"logp": zeros(b, r)}  # [B, R]
        if use_topk and source == "sampling":
            fill["topk_index"] = zeros(b, r, k, dtype=torch.long)  # [B, R, k]
        was = policy_scorer.training
        policy_scorer.eval()
        _run(policy_scorer, batch.with_(q_index=None), micro, max_tokens, fill, topk=k if "topk_index" in fill else 0, **common)
        policy_scorer.train(was)
        out["old_logp"] = None if single_on_policy_step(cfg) and not correction_needs_old_pass(cfg) else fill["logp"]
        if "topk_index" in fill:
            out["q_index"] = fill["topk_index"]
    if cfg.kl.coef > 0 and not anchor_inside_loss(cfg):
        with anchor_autocast(cfg, device):  # weights stay fp32; the matmuls run in bf16 on CUDA
            fill = {"logp": zeros(b, r)}  # [B, R]
            if use_topk:
                fill["logp_q"] = zeros(b, r, k)  # [B, R, k]
            if use_topk and source == "anchor":  # q is the anchor's own top-k, gathered in the same pass
                fill["topk_index"] = zeros(b, r, k, dtype=torch.long)  # [B, R, k]
                _run(anchor_scorer, batch.with_(q_index=None), micro, max_tokens, fill, topk=k, **common)
                out["q_index"] = fill["topk_index"]
            else:
                _run(anchor_scorer, batch.with_(q_index=out.get("q_index")), micro, max_tokens, fill, **common)
            out["ref_logp"] = fill["logp"]
            if use_topk:
                out["ref_logp_q"] = fill["logp_q"]
    return batch.with_(**out)
