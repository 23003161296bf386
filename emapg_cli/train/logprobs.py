"""Log-prob passes over (prompt, response) batches without materialising [T, V] tensors.

The decoder runs once per batch; its hidden states at the response positions are projected to
the vocabulary `chunk` tokens at a time (`emapg_cli.kl.fused`). From each [chunk, V] slice we keep
only what the loss and the KL estimators need, all [B, R] or [B, R, k]:
  logp       log pi(token) at the sampled token
  topk_index the top-k token ids q of this model                    (no-grad passes, `topk` > 0)
  logp_q     log pi at given indices q (`q_index`), else at its own top-k (when `topk` > 0)
  entropy    the distribution's entropy (detached, a metric; skipped with entropy=False)
  loss, aux  the policy pass: the fused per-token loss (PG + beta * KL) and its extras
The policy pass computes the gradient of its loss w.r.t. the logits inside the forward, so nothing
of size [chunk, V] outlives its chunk and the logits GEMM runs once. Logits are divided by the
rollout temperature so log-probs refer to the distribution sampled from.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional, Union

import torch
from torch import Tensor, nn

from emapg_cli.kl.fused import DEFAULT_BUDGET_MIB, LossFn, fused_head_loss, stream_stats
from emapg_cli.models.loading import autocast_dtype, compute_autocast
from emapg_cli.models.prefix import position_ids


@dataclass
class TokenStats:
    """Per-response-token outputs of one pass; all [B, R] (or [B, R, k]), zero at padding."""

    logp: Tensor
    entropy: Tensor  # zeros when the pass did not ask for it
    topk_index: Optional[Tensor] = None
    logp_q: Optional[Tensor] = None
    loss: Optional[Tensor] = None  # [] the fused loss (grad passes only), see `emapg_cli.kl.fused`
    aux: dict = field(default_factory=dict)  # the loss function's per-token extras, [B, R] each


def response_hidden(lm: nn.Module, input_ids: Tensor, attention_mask: Tensor, prompt_len: int,
                    pack: Union[bool, str] = False, share: Union[bool, str] = False) -> Tensor:
    """Final hidden states at the positions that predict the response tokens: [B, R, H].

    Position t - 1 predicts token t, so the response tokens input_ids[:, P:] are predicted by
    hidden[:, P-1:-1]. Two layouts remove work and give the same states:
    `share` (True / "always", or "auto": `emapg_cli.models.prefix.plan`) runs each distinct prompt once
    and the responses on its key/value cache; it is tried first, where the decoder allows it
    (`emapg_cli.models.prefix.supported`). `pack` (True / "always", or "auto"
    for sequences of at least 128 tokens: `emapg_cli.train.packing.plan`) runs the rows' real tokens
    packed into fewer rows (no padding, attention within each sequence only) and gathers the hidden
    states back to the padded layout (zeros where a row has no token).
    """
    from emapg_cli.models import prefix
    from emapg_cli.train import packing

    decoder = lm.get_decoder()
    positions = position_ids(attention_mask)  # [B, L]
    groups = prefix.plan(input_ids, attention_mask, prompt_len, share)
    if groups is not None and prefix.supported(decoder):
        return prefix.shared_hidden(decoder, input_ids, attention_mask, prompt_len, groups, positions)  # [B, R, H]
    packed = packing.plan(input_ids, attention_mask, pack)
    if packed is None:
        out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
        return out.last_hidden_state[:, prompt_len - 1:-1]  # [B, R, H]
    out = decoder(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None, use_cache=False)
    return packing.unpack(out.last_hidden_state, packed.source[:, prompt_len - 1:-1])  # [B, R, H]


def head_params(head: nn.Module) -> tuple[Tensor, Optional[Tensor]]:
    """(weight [V, H], bias [V] or None) of an output layer."""
    return head.weight, getattr(head, "bias", None)


def token_stats(
    lm: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    response_mask: Tensor,
    *,
    temperature: float = 1.0,
    topk: int = 0,
    q_index: Optional[Tensor] = None,
    chunk: Optional[int] = None,
    budget_mib: float = DEFAULT_BUDGET_MIB,
    loss_fn: Optional[LossFn] = None,
    loss_mask: Optional[Tensor] = None,
    ref_hidden: Optional[Tensor] = None,
    ref_head: Optional[nn.Module] = None,
    entropy: bool = True,
    pack: Union[bool, str] = False,
    share: Union[bool, str] = False,
) -> TokenStats:
    """One pass of `lm` over input_ids [B, P + R] (prompt left-padded to P, response right-padded).

    response_mask [B, R] marks real response tokens; only those are projected to the vocabulary,
    `chunk` tokens at a time (None: as many as `budget_mib` of logits allow).
    Without `loss_fn`: a no-grad pass (`stream_stats`): log-probs, the top-k (topk > 0) and log-probs
    at q_index [B, R, k]. With `loss_fn` (the per-token loss of `emapg_cli.kl.fused`): the fused
    lm_head + loss, whose `loss` carries the gradient; loss_mask [B, R] (default: response_mask)
    selects the tokens that count, and ref_hidden [B, R, H] with ref_head gives the loss the
    anchor's full logits (the exact estimator). `share`, `pack`: the decoder runs each distinct prompt once,
    or without padding (`response_hidden`).
    """
    hidden = response_hidden(lm, input_ids, attention_mask, prompt_len, pack, share)  # [B, R, H]
    weight, bias = head_params(lm.get_output_embeddings())
    cast = autocast_dtype(hidden.device.type)
    # Under autocast (float32 master weights computing in model.dtype): the output layer's GEMMs run in the
    # autocast dtype like any other Linear there, on a cast copy of its weight (whose gradient autograd casts
    # back to float32); the fused head's own arithmetic (log-softmax, the loss, dW's accumulation) is float32
    # as in a bfloat16 model's pass, so autocast is off inside it.
    if cast is not None:
        weight, bias, hidden = weight.to(cast), bias.to(cast) if bias is not None else None, hidden.to(cast)
    with torch.autocast(hidden.device.type, enabled=False) if cast is not None else contextlib.nullcontext():
        return _head_stats(hidden, weight, bias, input_ids, prompt_len, response_mask, temperature=temperature, topk=topk,
                           q_index=q_index, chunk=chunk, budget_mib=budget_mib, loss_fn=loss_fn, loss_mask=loss_mask,
                           ref_hidden=ref_hidden, ref_head=ref_head, entropy=entropy)


def _head_stats(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], input_ids: Tensor, prompt_len: int,
                response_mask: Tensor, *, temperature, topk, q_index, chunk, budget_mib, loss_fn, loss_mask, ref_hidden,
                ref_head, entropy) -> TokenStats:
    """`token_stats` from the decoder's response states hidden [B, R, H] on: the output layer (weight [V, H],
    bias [V] or None) and what the pass asks of it."""
    mask = response_mask.bool()
    targets = input_ids[:, prompt_len:][mask]  # [N]
    h = hidden[mask]  # [N, H]
    q = q_index[mask] if q_index is not None else None  # [N, k]

    def scatter(flat: Optional[Tensor], dtype=torch.float32) -> Optional[Tensor]:
        if flat is None:
            return None
        out = torch.zeros(*mask.shape, *flat.shape[1:], dtype=dtype, device=hidden.device)
        return out.index_put((mask,), flat.to(dtype)) if mask.any() else out

    if loss_fn is None:
        st = stream_stats(h.detach(), weight.detach(), bias.detach() if bias is not None else None, targets, q_index=q,
                          topk=topk, temperature=temperature, chunk=chunk, budget_mib=budget_mib, entropy=entropy)
        ent = scatter(st.entropy) if entropy else torch.zeros(mask.shape, device=hidden.device)
        return TokenStats(logp=scatter(st.logp), entropy=ent, topk_index=scatter(st.topk_index, torch.long),
                          logp_q=scatter(st.logp_q))
    ref_w = ref_b = rh = None
    if ref_hidden is not None:
        ref_w, ref_b = head_params(ref_head)
        rh = ref_hidden[mask].detach().to(ref_w.dtype)  # [N, H] (the anchor's states in its own head's dtype)
    lm_mask = loss_mask.bool()[mask] if loss_mask is not None else None  # [N]
    out = fused_head_loss(h, weight, bias, targets, loss_fn, q_index=q, loss_mask=lm_mask, temperature=temperature,
                          chunk=chunk, budget_mib=budget_mib, entropy=entropy, ref_hidden=rh,
                          ref_weight=ref_w.detach() if ref_w is not None else None,
                          ref_bias=ref_b.detach() if ref_b is not None else None)
    return TokenStats(logp=scatter(out.logp), entropy=scatter(out.entropy), logp_q=scatter(out.logp_q), loss=out.loss,
                      aux={name: scatter(v, v.dtype) for name, v in out.aux.items()})


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Within: `module` in eval mode (no dropout: a no-grad pass, or two passes that must see the same function); its
    own mode is restored after."""
    was = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was)


class TokenScorer(nn.Module):
    """Wraps a causal LM so its log-prob pass is the module's `forward` (what DDP/FSDP wrap and sync).

    `compute_dtype`: run the pass under autocast to this dtype (float32 master weights computing in
    model.dtype, `emapg_cli.models.loading.compute_dtype`); None: no autocast context at all."""

    def __init__(self, lm: nn.Module, compute_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.lm = lm
        self.compute_dtype = compute_dtype

    @contextlib.contextmanager
    def float32_passes(self) -> Iterator[None]:
        """Within: passes without autocast, i.e. in the float32 master weights' own precision (the layout checks,
        which compare two computations of one function at a float32 tolerance)."""
        saved, self.compute_dtype = self.compute_dtype, None
        try:
            yield
        finally:
            self.compute_dtype = saved

    def forward(self, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, response_mask: Tensor, **kwargs) -> TokenStats:
        with compute_autocast(input_ids.device.type, self.compute_dtype):
            return token_stats(self.lm, input_ids, attention_mask, prompt_len, response_mask, **kwargs)

