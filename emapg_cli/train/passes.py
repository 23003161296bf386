"""The no-grad passes before the update: old-policy log-probs (and q for reverse Top-k), then the anchor's."""

from __future__ import annotations

import contextlib

import torch

from emapg_cli.errors import UserError
from emapg_cli.train.logprobs import TokenStats, eval_mode
from emapg_cli.train.rollout import RolloutBatch, micro_batches
from emapg_cli.train.settings import StepSettings


def anchor_autocast(enabled: bool, device: torch.device):
    """bf16 autocast around the anchor's forward on CUDA when `enabled` (`ema.anchor_autocast`): the fp32 anchor's
    matmuls run in bf16 like the policy's, as in the paper's code; a no-op on CPU."""
    if enabled and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _layout_diff(scorer, mb: RolloutBatch, temperature: float, **layout) -> float:
    """The largest difference (nats) of `mb`'s response log-probs between the padded pass and `layout`."""
    mask = mb.response_mask.bool()
    if not mask.any():
        return 0.0
    args = (mb.input_ids, mb.attention_mask, mb.prompt_len, mb.response_mask)
    with eval_mode(scorer):  # no dropout: the two passes must see the same function
        padded = scorer(*args, temperature=temperature, entropy=False, pack=False, share=False).logp  # [b, R]
        other = scorer(*args, temperature=temperature, entropy=False, **layout).logp  # [b, R]
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
def _run(scorer, batch: RolloutBatch, micro: int, fill: dict[str, torch.Tensor], **kw) -> None:
    """The scorer's pass over micro-batches of rows; each field f of the result lands in fill[f][rows, :R_micro].

    Called through the scorer module (not `token_stats` on the bare model) so a sharded model's
    hooks gather its weights; every rank runs the same number of micro-batches.
    """
    b = batch.advantages.shape[0]
    for rows in micro_batches(torch.arange(b), micro):
        rows = rows.to(batch.input_ids.device)
        mb = batch.select(rows)  # trims every per-token field, q_index included
        stats: TokenStats = scorer(mb.input_ids, mb.attention_mask, mb.prompt_len, mb.response_mask, q_index=mb.q_index, **kw)
        r = mb.response_mask.shape[1]
        for name, out in fill.items():
            out[rows, :r] = getattr(stats, name)


def score_tokens(scorer, batch: RolloutBatch, settings: StepSettings) -> torch.Tensor:
    """log pi(y) of `batch`'s response tokens under `scorer`'s model, a no-grad pass with the step's pass settings
    (temperature, layouts, micro-batches): [B, R], zero at padding. Leaves the scorer in the mode it was in."""
    b, r = batch.response_mask.shape
    fill = {"logp": torch.zeros(b, r, dtype=torch.float32, device=batch.input_ids.device)}  # [B, R]
    p = settings.passes
    with eval_mode(scorer):
        _run(scorer, batch.with_(q_index=None), p.micro_batch_size, fill, **p.scorer_args(entropy=False))
    return fill["logp"]


def reference_passes(policy_scorer, anchor_scorer, batch: RolloutBatch, settings: StepSettings) -> RolloutBatch:
    """Fill old_logp / q_index (old-policy pass) and ref_logp / ref_logp_q (anchor pass) as `settings` say.

    Both models come as `TokenScorer`s (the policy's unwrapped from DDP; a sharded model's FSDP root).

    q (the top-k set of a Top-k estimator, `settings.k` ids: kl.k capped at the vocabulary) comes from where
    `settings.q_from` says. The exact estimator needs no anchor pass here: it evaluates the anchor's full logits
    chunk by chunk inside the loss.
    """
    s, k = settings, settings.k
    b, r = batch.response_mask.shape
    device = batch.input_ids.device

    def zeros(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=device)

    # no-grad passes never report entropy: skip its [chunk, V] softmax
    micro, common = s.passes.micro_batch_size, s.passes.scorer_args(entropy=False)
    sampling_q = s.q_from in ("engine", "policy")  # q: the sampling policy's top-k
    out = {}
    recorded = batch.sampling_logp is not None and not (sampling_q and batch.q_index is None)
    # `auto` uses the engine's records when it made them (the search agent's episodes, or a hand-built batch,
    # have none: then the pass runs); `engine` insists on them
    if s.old_from_engine and (recorded or s.engine_required):
        if sampling_q and batch.q_index is None:
            raise UserError("train.old_logprobs=engine with reverse Top-k needs an engine that records the top-k "
                            "ids while sampling (hf); use train.old_logprobs=pass")
        if batch.sampling_logp is None:
            raise UserError("train.old_logprobs=engine needs an engine that returns sampling log-probs")
        out["old_logp"] = None if s.single_on_policy else batch.sampling_logp
        if sampling_q:
            out["q_index"] = batch.q_index
    elif s.old_pass_fallback:
        fill = {"logp": zeros(b, r)}  # [B, R]
        if sampling_q:
            fill["topk_index"] = zeros(b, r, k, dtype=torch.long)  # [B, R, k]
        with eval_mode(policy_scorer):
            _run(policy_scorer, batch.with_(q_index=None), micro, fill, topk=k if "topk_index" in fill else 0, **common)
        out["old_logp"] = None if s.single_on_policy and not s.correction_old_pass else fill["logp"]
        if "topk_index" in fill:
            out["q_index"] = fill["topk_index"]
    if s.anchor_pass:
        with anchor_autocast(s.anchor_autocast, device):  # weights stay fp32; the matmuls run in bf16 on CUDA
            fill = {"logp": zeros(b, r)}  # [B, R]
            if s.topk:
                fill["logp_q"] = zeros(b, r, k)  # [B, R, k]
            if s.q_from == "anchor":  # q is the anchor's own top-k, gathered in the same pass
                fill["topk_index"] = zeros(b, r, k, dtype=torch.long)  # [B, R, k]
                _run(anchor_scorer, batch.with_(q_index=None), micro, fill, topk=k, **common)
                out["q_index"] = fill["topk_index"]
            else:
                _run(anchor_scorer, batch.with_(q_index=out.get("q_index")), micro, fill, **common)
            out["ref_logp"] = fill["logp"]
            if s.topk:
                out["ref_logp_q"] = fill["logp_q"]
    return batch.with_(**out)
