"""The output layer, log-probs and a per-token loss fused: dL/dlogits computed in the forward, chunk by chunk.

Every loss emapg trains with (PPO-clip + beta * KL, any estimator but `exact`) reads the logits
z_t = W h_t / tau of token t only through log-probs gathered at k + 1 positions: the sampled token
p_t and the top-k set q_t. With a_tj = z_t[i_tj] - logsumexp(z_t) and g_tj = dL/da_tj, the gradient
with respect to the logits has cross-entropy's form (a sparse term minus its total times softmax):

    dL/dz_t = sum_j g_tj e_{i_tj} - G_t softmax(z_t),              G_t = sum_j g_tj
    dL/dh_t = (sum_j g_tj W[i_tj] - G_t softmax(z_t) W) / tau      [H]
    dL/dW   = sum_t (sum_j g_tj e_{i_tj} - G_t softmax(z_t)) h_t^T / tau

so each [chunk, V] block of logits is used once: log-sum-exp and the gathers, the small per-token
loss (whose g comes from autograd on [chunk, k + 1] tensors: the estimator math stays in
`emapg_cli.kl`), the softmax in place, then one GEMM for dH (whose rows also give the entropy,
sum_j p_j z_j = h . (p W) / tau) and one `addmm_` into dW. Three GEMMs in all (the floor: logits,
dH, dW) instead of four with activation checkpointing, and no [chunk, V] tensor outlives its chunk
(as fused linear-cross-entropy kernels do: Liger-Kernel; Wijmans et al. 2024, "Cut Your Losses").

The `exact` estimator needs the full logits of both models; there the loss is differentiated by
autograd on the chunk's [chunk, V] logits (the anchor's chunk computed in the same loop).

Half precision (a bfloat16/float16 W and h): the GEMMs multiply in W's dtype, but the results that are
subtracted afterwards stay float32: the logits (z - logsumexp z), e W (subtracted from the sparse term) and the
sparse term sum_j g_tj W[i_tj] itself, as are the products h g and h G / sum(e) that dW accumulates. On a
confident token (p_target near 1) the sparse term and G softmax(z) W nearly cancel, dH_t ~ g (1 - p) W[y_t]:
rounded to 8 bits before the subtraction, they leave an error of ~2^-9 g |W| against a result of size
(1 - p) g |W| (at p = 0.999 larger than the result; `emapg bench update --check --confident P` measures it).
Only dH and dW themselves are rounded to W's dtype, once, at the end. On CUDA the half GEMMs return float32
(`torch.mm`'s out_dtype, where this torch has it); elsewhere W is widened to float32 once per call for them.

Pure tensors: the caller passes the per-token loss as a function (`LossFn`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch
from torch import Tensor

#: Default bytes of [chunk, V] work buffers per chunk (see `auto_chunk`).
DEFAULT_BUDGET_MIB = 256
#: float32 [chunk, V] tensors alive at once in an `exact` chunk (both models' logits, autograd's buffers).
EXACT_BUFFERS = 8


class LossFn(Protocol):
    """Per-token loss of tokens [start, end): (loss [c], aux) with aux a dict of detached [c] tensors.

    logp [c] and logp_q [c, k] (None without q) carry the gradient; logits / ref_logits [c, V] are
    given (logits with grad) only when the fused function was called with reference hidden states.
    """

    def __call__(self, start: int, end: int, logp: Tensor, logp_q: Optional[Tensor],
                 logits: Optional[Tensor] = None, ref_logits: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]: ...


def auto_chunk(vocab: int, budget_mib: float = DEFAULT_BUDGET_MIB, buffers: int = 1) -> int:
    """Rows per chunk so that `buffers` float32 [chunk, V] tensors fit in `budget_mib` (at least 1)."""
    return max(1, int(budget_mib * 2**20) // (buffers * vocab * 4))


HALF = (torch.bfloat16, torch.float16)


def acc_dtype(weight: Tensor) -> torch.dtype:
    """The dtype the layer's sums are kept in: float32 for a half-precision W, else W's own."""
    return torch.float32 if weight.dtype in HALF else weight.dtype


@functools.lru_cache(maxsize=None)
def _float32_out(device_type: str) -> bool:
    """Whether a GEMM of half-precision operands can return float32 here (`torch.mm`'s out_dtype: CUDA, in the torch
    releases that have it; tried once), so that a half W needs no float32 copy (`widened`)."""
    if device_type != "cuda":
        return False
    try:  # the call mm_float32 makes: half operands, a float32 result written into a float32 buffer
        one, out = torch.ones(1, 1, dtype=torch.bfloat16, device=device_type), torch.empty(1, 1, device=device_type)
        return torch.mm(one, one, out_dtype=torch.float32, out=out).dtype == torch.float32
    except (TypeError, RuntimeError):  # an older torch: no out_dtype argument, or no such kernel
        return False


def widened(weight: Tensor) -> Optional[Tensor]:
    """W [V, H] widened to float32 for the GEMMs whose results must stay float32 (`mm_float32`), once per call: None
    for a float32/float64 W, or where half GEMMs can return float32 themselves (`_float32_out`)."""
    if weight.dtype not in HALF or _float32_out(weight.device.type):
        return None
    return weight.detach().float()


def mm_float32(a: Tensor, b: Tensor, b_wide: Optional[Tensor], out: Optional[Tensor] = None) -> Tensor:
    """a @ b for a half-precision b with a float32 result (never rounded to b's dtype): the half GEMM with a float32
    output, a cast to b's dtype (`_float32_out`), or the float32 GEMM with b_wide, b widened (`widened`)."""
    if b_wide is None:
        return torch.mm(a.to(b.dtype), b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b_wide, out=out)


def logit_buffer(rows: int, weight: Tensor) -> Tensor:
    """The [rows, V] buffer `_logits` writes into, reused by every chunk: W's dtype, float32 for a half W."""
    return torch.empty(rows, weight.shape[0], dtype=acc_dtype(weight), device=weight.device)


def _logits(h: Tensor, weight: Tensor, bias: Optional[Tensor], buf: Tensor, wide: Optional[Tensor] = None) -> Tensor:
    """z = h W^T (+ b) in float32 ([c, V]; float64 for a float64 W), written into the reused buffer `buf`
    (`logit_buffer`: fresh [c, V] memory per chunk would cost page faults on every chunk); h and b are already
    divided by the temperature. A half W's logits are not rounded to its dtype (they are subtracted:
    z - logsumexp z); `wide` is its `widened` copy."""
    out = buf[: h.shape[0]]
    if weight.dtype in HALF:
        z = mm_float32(h, weight.t(), None if wide is None else wide.t(), out=out)  # [c, V] float32
        return z if bias is None else z.add_(bias)
    z = torch.mm(h, weight.t(), out=out) if bias is None else torch.addmm(bias, h, weight.t(), out=out)  # [c, V]
    return z if z.dtype in (torch.float32, torch.float64) else z.float()


def _sparse_rows(idx: Tensor, weight: Tensor, g: Tensor) -> Tensor:
    """sum_j g_tj W[i_tj] [c, H] (idx, g [c, 1 + k]): in W's dtype for a float32/float64 W (one embedding_bag), in
    float32 for a half W (one [c, H] row block per j: g is never rounded, nor the sum, which a confident token's
    dH subtracts from nearly the same vector)."""
    if weight.dtype not in HALF:
        return torch.nn.functional.embedding_bag(idx, weight, per_sample_weights=g.to(weight.dtype), mode="sum")
    out = torch.zeros(idx.shape[0], weight.shape[1], dtype=torch.float32, device=weight.device)  # [c, H]
    for j in range(idx.shape[1]):
        out.addcmul_(weight[idx[:, j]], g[:, j:j + 1].float())
    return out


def _exp_inplace(z: Tensor) -> tuple[Tensor, Tensor]:
    """Turn z [c, V] into e = exp(z - max z) in place; return (lse [c], row sums of e [c, 1]).

    logsumexp would allocate a [c, V] temporary; here the softmax is e / sum(e), and callers fold the
    1 / sum(e) into their [c]-sized coefficients instead of dividing the [c, V] block.
    """
    m = z.amax(-1, keepdim=True)  # [c, 1]
    e = z.sub_(m).exp_()  # [c, V]
    total = e.sum(-1, keepdim=True)  # [c, 1]
    return (m + total.log()).squeeze(-1), total


@dataclass
class HeadSpec:
    """Everything but the differentiable tensors: what to gather, the loss, and how to chunk."""

    targets: Tensor  # [N] the sampled tokens
    loss_fn: LossFn
    q_index: Optional[Tensor] = None  # [N, k]
    loss_mask: Optional[Tensor] = None  # [N] bool; False: no value, no gradient
    temperature: float = 1.0
    chunk: Optional[int] = None  # None: `auto_chunk` with `budget_mib`
    budget_mib: float = DEFAULT_BUDGET_MIB
    entropy: bool = True
    ref_hidden: Optional[Tensor] = None  # [N, H'] the anchor's hidden states (exact estimator)
    ref_weight: Optional[Tensor] = None  # [V, H']
    ref_bias: Optional[Tensor] = None
    out: dict = field(default_factory=dict)  # filled by the forward: logp, logp_q, entropy, aux


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], spec: HeadSpec) -> Tensor:
        n, hdim = hidden.shape
        vocab = weight.shape[0]
        dev = hidden.device
        exact = spec.ref_hidden is not None
        chunk = spec.chunk or auto_chunk(vocab, spec.budget_mib, EXACT_BUFFERS if exact else 1)
        acc = acc_dtype(weight)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        dh = torch.empty(n, hdim, dtype=hidden.dtype, device=dev) if need_h else None  # [N, H]
        dw = torch.empty(vocab, hdim, dtype=acc, device=dev) if need_w else None  # [V, H], set by the first addmm
        if need_w and n == 0:
            dw.zero_()
        beta = 0.0  # the first chunk's addmm overwrites dw
        db = torch.zeros(vocab, dtype=acc, device=dev) if need_b else None  # [V]
        k = spec.q_index.shape[-1] if spec.q_index is not None else 0
        logp = torch.empty(n, dtype=torch.float32, device=dev)  # [N]
        logp_q = torch.empty(n, k, dtype=torch.float32, device=dev)  # [N, k]
        ent = torch.zeros(n, dtype=torch.float32, device=dev)  # [N]
        mask = spec.loss_mask
        total = torch.zeros((), dtype=torch.float64, device=dev)
        aux: dict[str, list[Tensor]] = {}
        inv_t = 1.0 / spec.temperature
        bt = bias * inv_t if bias is not None and inv_t != 1.0 else bias  # [V] b / tau
        buf = logit_buffer(min(chunk, n), weight)  # [chunk, V] reused by every chunk
        wide = widened(weight)  # [V, H] float32 copy of a half W, where its GEMMs cannot return float32
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            h = hidden[s:e] * inv_t if inv_t != 1.0 else hidden[s:e]  # [c, H] h / tau
            z = _logits(h, weight, bt, buf, wide)  # [c, V]
            idx = spec.targets[s:e, None]  # [c, 1 + k]
            if k:
                idx = torch.cat([idx, spec.q_index[s:e]], 1)
            m = mask[s:e] if mask is not None else None  # [c]
            if exact:  # dL/dz from autograd, [c, V]
                gz, gathered, lse, per_tok, extra = _exact_chunk(spec, s, e, z, idx, inv_t, buf.shape[0])
                if need_h:
                    dh[s:e] = (torch.mm(gz.to(weight.dtype), weight) * inv_t).to(dh.dtype)
                if need_w:
                    dw.addmm_(gz.t().to(acc), h.to(acc), beta=beta)
                if need_b:
                    db.add_(gz.sum(0).to(acc), alpha=inv_t)
                if spec.entropy:
                    ent[s:e] = extra.pop("_entropy")
            else:
                zg = z.gather(1, idx)  # [c, 1 + k]
                lse, rowsum = _exp_inplace(z)  # z is now e = exp(z - max), softmax = e / rowsum
                gathered = zg - lse[:, None]  # [c, 1 + k] log-probs
                a = gathered.detach().requires_grad_()
                with torch.enable_grad():
                    per_tok, extra = spec.loss_fn(s, e, a[:, 0], a[:, 1:] if k else None)
                    value = per_tok.sum() if m is None else torch.where(m, per_tok, 0.0).sum()
                    (g,) = torch.autograd.grad(value, a)  # [c, 1 + k]
                if m is not None:
                    g = torch.where(m[:, None], g, 0.0)
                gsum = g.sum(-1)  # [c] G_t
                # softmax = z / rowsum: the 1 / rowsum goes into the [c]-sized factors, not the [c, V] block
                ew = mm_float32(z, weight, wide) if weight.dtype in HALF else torch.mm(z.to(weight.dtype), weight)  # [c, H] e W
                pw = ew.to(acc) / rowsum  # [c, H]  softmax(z) W
                ha = h.to(acc)  # [c, H] (h itself unless W is half precision)
                if spec.entropy:  # H = lse - sum_j p_j z_j, sum_j p_j z_j = h . (p W) (+ p . b)
                    pz = (ha * pw).sum(-1)
                    if bias is not None:
                        pz = pz + (z @ bt.to(z.dtype)) / rowsum[:, 0]
                    ent[s:e] = lse - pz
                if need_h:
                    sparse = _sparse_rows(idx, weight, g)  # [c, H]
                    dh[s:e] = ((sparse.to(acc) - gsum[:, None] * pw) * inv_t).to(dh.dtype)  # [c, H]
                coef = -gsum[:, None] / rowsum  # [c, 1]  -G_t / sum(e)
                if need_w:
                    dw.addmm_(z.t().to(acc), ha * coef.to(acc), beta=beta)  # [V, H]; h is already h / tau
                    for j in range(idx.shape[1]):  # the sparse term, one [c, H] block at a time
                        dw.index_add_(0, idx[:, j], ha * g[:, j:j + 1].to(acc))
                if need_b:
                    db.addmv_(z.t().to(acc), coef[:, 0].to(acc), alpha=inv_t)
                    db.index_add_(0, idx.reshape(-1), g.to(acc).reshape(-1), alpha=inv_t)
            beta = 1.0
            logp[s:e] = gathered[:, 0].detach()
            if k:
                logp_q[s:e] = gathered[:, 1:].detach()
            per_tok = per_tok.detach()
            total += (per_tok if m is None else torch.where(m, per_tok, 0.0)).sum().double()
            for name, val in extra.items():
                aux.setdefault(name, []).append(val.detach())
            del z
        spec.out.update(logp=logp, logp_q=logp_q if k else None, entropy=ent,
                        aux={name: torch.cat(v) for name, v in aux.items()})
        ctx.grads = (dh, dw.to(weight.dtype) if dw is not None else None, db.to(bias.dtype) if db is not None else None)
        return total.to(torch.float32)

    @staticmethod
    def backward(ctx, grad: Tensor):
        dh, dw, db = ctx.grads
        ctx.grads = None
        scale = None if bool(grad == 1) else grad
        out = [t if (t is None or scale is None) else t.mul_(scale.to(t.dtype)) for t in (dh, dw, db)]
        return out[0], out[1], out[2], None


def _exact_chunk(spec: HeadSpec, s: int, e: int, z: Tensor, idx: Tensor, inv_t: float, rows: int):
    """The `exact` estimator's chunk: the anchor's logits, then autograd on the [c, V] logits."""
    rh = spec.ref_hidden[s:e] * inv_t if inv_t != 1.0 else spec.ref_hidden[s:e]  # [c, H']
    rb = spec.ref_bias * inv_t if spec.ref_bias is not None else None  # [V]
    rz = _logits(rh, spec.ref_weight, rb, logit_buffer(rows, spec.ref_weight), widened(spec.ref_weight))  # [c, V]
    zl = z.detach().requires_grad_()
    k = idx.shape[1] - 1
    with torch.enable_grad():
        lse = torch.logsumexp(zl, -1)  # [c]
        gathered = zl.gather(1, idx) - lse[:, None]  # [c, 1 + k]
        per_tok, extra = spec.loss_fn(s, e, gathered[:, 0], gathered[:, 1:] if k else None, logits=zl, ref_logits=rz)
        m = spec.loss_mask[s:e] if spec.loss_mask is not None else None
        value = per_tok.sum() if m is None else torch.where(m, per_tok, 0.0).sum()
        (gz,) = torch.autograd.grad(value, zl)  # [c, V]
    if m is not None:
        gz = torch.where(m[:, None], gz, 0.0)
    extra = dict(extra)
    if spec.entropy:
        with torch.no_grad():
            p = torch.softmax(z, -1)  # [c, V]
            extra["_entropy"] = lse.detach() - (p * z).sum(-1)
    return gz, gathered.detach(), lse.detach(), per_tok, extra


@dataclass
class HeadLoss:
    """`fused_head_loss`'s result: the loss (differentiable) and detached per-token values."""

    loss: Tensor  # [] sum over unmasked tokens of the per-token loss
    logp: Tensor  # [N]
    logp_q: Optional[Tensor]  # [N, k]
    entropy: Tensor  # [N] (zeros with entropy=False)
    aux: dict[str, Tensor]  # the loss function's per-token extras, [N] each


def fused_head_loss(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, loss_fn: LossFn, *,
                    q_index: Optional[Tensor] = None, loss_mask: Optional[Tensor] = None, temperature: float = 1.0,
                    chunk: Optional[int] = None, budget_mib: float = DEFAULT_BUDGET_MIB, entropy: bool = True,
                    ref_hidden: Optional[Tensor] = None, ref_weight: Optional[Tensor] = None,
                    ref_bias: Optional[Tensor] = None) -> HeadLoss:
    """sum_t mask_t loss_fn(log-softmax(W h_t / tau + b) at [p_t, q_t]) and its gradient, computed chunk by chunk.

    hidden [N, H] (the decoder's states at the positions predicting `targets` [N]), weight [V, H]
    (tied or not: the gradient goes to whatever tensor is passed), bias [V] or None, q_index [N, k].
    The gradients w.r.t. hidden, weight and bias are accumulated during this call (dW in one
    [V, H] buffer that becomes W's gradient); backward only hands them on. Pass ref_hidden and
    ref_weight (the anchor's states and output layer) for losses that need full logits (`exact`).
    """
    spec = HeadSpec(targets=targets, loss_fn=loss_fn, q_index=q_index, loss_mask=loss_mask, temperature=temperature,
                    chunk=chunk, budget_mib=budget_mib, entropy=entropy, ref_hidden=ref_hidden,
                    ref_weight=ref_weight, ref_bias=ref_bias)
    loss = _FusedHeadLoss.apply(hidden, weight, bias, spec)  # fills spec.out: logp, logp_q, entropy, aux
    return HeadLoss(loss=loss, **spec.out)


@dataclass
class StreamStats:
    """`stream_stats`' per-token results (no gradient)."""

    logp: Tensor  # [N]
    lse: Tensor  # [N] log-sum-exp of the logits / tau
    topk_index: Optional[Tensor] = None  # [N, k]
    logp_q: Optional[Tensor] = None  # [N, k] at q_index, else at topk_index
    entropy: Optional[Tensor] = None  # [N]


@torch.no_grad()
def stream_stats(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, *,
                 q_index: Optional[Tensor] = None, topk: int = 0, temperature: float = 1.0,
                 chunk: Optional[int] = None, budget_mib: float = DEFAULT_BUDGET_MIB, entropy: bool = False) -> StreamStats:
    """One pass per chunk over the logits W h / tau + b: log-probs at `targets`, log-sum-exp, the top-k
    indices (topk > 0) and log-probs at q_index (or at the top-k). The old-policy and anchor passes."""
    n = hidden.shape[0]
    chunk = chunk or auto_chunk(weight.shape[0], budget_mib, 2 if entropy else 1)
    inv_t = 1.0 / temperature
    dev = hidden.device
    logp = torch.empty(n, dtype=torch.float32, device=dev)  # [N]
    lse_all = torch.empty(n, dtype=torch.float32, device=dev)  # [N]
    kq = q_index.shape[-1] if q_index is not None else topk
    idx_all = torch.empty(n, topk, dtype=torch.long, device=dev) if topk else None  # [N, k]
    lq = torch.empty(n, kq, dtype=torch.float32, device=dev) if kq else None  # [N, k]
    ent = torch.empty(n, dtype=torch.float32, device=dev) if entropy else None  # [N]
    bt = bias * inv_t if bias is not None and inv_t != 1.0 else bias  # [V]
    buf = logit_buffer(min(chunk, n), weight)  # [chunk, V] reused
    wide = widened(weight)  # [V, H] float32 copy of a half W, where its GEMMs cannot return float32
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        h = hidden[s:e] * inv_t if inv_t != 1.0 else hidden[s:e]  # [c, H]
        z = _logits(h, weight, bt, buf, wide)  # [c, V]
        zt = z.gather(1, targets[s:e, None])[:, 0]  # [c]
        if topk:
            zq, idx = z.topk(topk, -1)  # [c, k]
            idx_all[s:e] = idx
        if q_index is not None:
            zq = z.gather(1, q_index[s:e])  # [c, k]
        pz = (torch.softmax(z, -1) * z).sum(-1) if entropy else None  # [c]
        lse, _ = _exp_inplace(z)  # z is spent
        lse_all[s:e] = lse
        logp[s:e] = zt - lse
        if kq:
            lq[s:e] = zq - lse[:, None]
        if entropy:
            ent[s:e] = lse - pz
    return StreamStats(logp=logp, lse=lse_all, topk_index=idx_all, logp_q=lq, entropy=ent)
