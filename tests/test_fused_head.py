"""The fused output layer + loss (emapg_cli/kl/fused.py) against plain autograd on the full logits.

Every estimator x direction x importance weight on/off x tied/untied head x masked tokens: the loss,
the log-probs and the gradients w.r.t. the hidden states' producer and the head must equal the
reference to 1e-5 relative (||a - b|| / ||b||, float32). Shapes are tiny (13 tokens, V = 50, chunks
of 4 so the last chunk is partial), so the whole matrix runs in seconds.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from emapg_cli.grpo import ppo_clip_loss
from emapg_cli.kl import INFO, importance_weight, kl_per_token, topk_membership
from emapg_cli.kl.fused import auto_chunk, fused_head_loss, stream_stats

N, H, V, K, TAU = 13, 8, 50, 5, 0.7
REL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def make_case(seed: int, tied: bool, bias: bool):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()  # [V, H] head
    emb = w if tied else (torch.randn(V, H, generator=g) * 0.5).requires_grad_()  # [V, H] input embedding
    mix = (torch.randn(H, H, generator=g) * 0.5).requires_grad_()  # a stand-in decoder
    b = (torch.randn(V, generator=g) * 0.1).requires_grad_() if bias else None
    inputs = torch.randint(0, V, (N,), generator=g)
    targets = torch.randint(0, V, (N,), generator=g)
    q = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])  # [N, K] distinct per row
    q[::3, 0] = targets[::3]  # some sampled tokens inside q (the in_q branch)
    old = -torch.rand(N, generator=g) * 3 - 1  # [N]
    ref = -torch.rand(N, generator=g) * 3 - 1  # [N]
    ref_q = torch.log_softmax(torch.randn(N, V, generator=g), -1).gather(1, q)  # [N, K]
    adv = torch.randn(N, generator=g)  # [N]
    weights = torch.rand(N, generator=g) / N  # [N] aggregation weights
    ref_w = torch.randn(V, H, generator=g) * 0.5  # anchor head (exact)
    ref_h = torch.randn(N, H, generator=g)  # anchor hidden states (exact)
    return dict(w=w, emb=emb, mix=mix, b=b, inputs=inputs, targets=targets, q=q, old=old, ref=ref, ref_q=ref_q,
                adv=adv, weights=weights, ref_w=ref_w, ref_h=ref_h)


def hidden_of(c):
    return torch.tanh(c["emb"][c["inputs"]] @ c["mix"])  # [N, H]: the embedding feeds the hidden states (tied)


def make_loss_fn(c, estimator: str, direction: str, iw: bool, beta: float = 0.3):
    info = INFO[estimator]
    in_q = topk_membership(c["q"], c["targets"])

    def loss_fn(s, e, logp, logp_q, logits=None, ref_logits=None):
        old = c["old"][s:e]
        pg, clipped = ppo_clip_loss(logp, old, c["adv"][s:e], 0.2, 0.28, 3.0)
        s_w = importance_weight(logp, old, (0.0, 2.0)) if iw else None
        kl = kl_per_token(estimator, direction, logp=logp, ref_logp=c["ref"][s:e], iw=s_w,
                          logp_q=logp_q if info.uses_topk else None, ref_logp_q=c["ref_q"][s:e],
                          in_q=in_q[s:e], logits=logits, ref_logits=ref_logits)
        w = c["weights"][s:e]
        return w * (pg + beta * kl), {"kl": (w * kl).detach(), "clipped": clipped.float()}

    return loss_fn


def reference(c, loss_fn, mask, exact: bool):
    """Plain autograd: the full [N, V] logits, then the same per-token loss."""
    h = hidden_of(c)
    z = (h @ c["w"].t() + (c["b"] if c["b"] is not None else 0)) / TAU  # [N, V]
    lse = torch.logsumexp(z, -1)
    logp = z.gather(1, c["targets"][:, None])[:, 0] - lse
    logp_q = z.gather(1, c["q"]) - lse[:, None]
    rz = (c["ref_h"] @ c["ref_w"].t()) / TAU if exact else None
    per_tok, aux = loss_fn(0, N, logp, logp_q, logits=z if exact else None, ref_logits=rz)
    kept = torch.where(mask, per_tok, 0.0) if mask is not None else per_tok
    aux["_scale"] = kept.detach().abs().sum()  # the loss's size before cancellations between tokens
    return kept.sum(), logp.detach(), logp_q.detach(), aux


def grads(c, loss):
    params = [c["w"], c["mix"]] + ([c["emb"]] if c["emb"] is not c["w"] else []) + ([c["b"]] if c["b"] is not None else [])
    return torch.autograd.grad(loss, params)


CASES = [(est, d) for est in INFO for d in INFO[est].directions]


@pytest.mark.parametrize("estimator,direction", CASES)
def test_fused_loss_and_gradients_equal_plain_autograd(estimator, direction):
    exact = INFO[estimator].full_vocab
    for iw, tied, masked in itertools.product((False, True), (False, True), (False, True)):
        c = make_case(zlib.crc32(f"{estimator}{direction}{iw}{tied}{masked}".encode()), tied, bias=tied)
        mask = torch.ones(N, dtype=torch.bool)
        poisoned = dict(c, ref=c["ref"].clone(), ref_q=c["ref_q"].clone())
        if masked:  # masked tokens: a non-finite anchor log-prob there must not leak into value or gradient
            mask[[1, 6, 12]] = False
            poisoned["ref"][1] = float("-inf")
            poisoned["ref_q"][6, 2] = float("nan")
        # the reference sees finite values everywhere (autograd would spread NaN * 0 from masked tokens)
        ref_loss, ref_logp, ref_lq, ref_aux = reference(c, make_loss_fn(c, estimator, direction, iw),
                                                        mask if masked else None, exact)
        loss_fn = make_loss_fn(poisoned, estimator, direction, iw)
        ref_g = grads(c, ref_loss)
        out = fused_head_loss(hidden_of(c), c["w"], c["b"], c["targets"], loss_fn,
                              q_index=c["q"], loss_mask=mask if masked else None, temperature=TAU, chunk=4,
                              ref_hidden=c["ref_h"] if exact else None, ref_weight=c["ref_w"] if exact else None)
        got_g = grads(c, out.loss)
        label = f"{estimator}/{direction} iw={iw} tied={tied} masked={masked}"
        assert torch.isfinite(ref_loss), label
        # the value to 1e-5 of sum_t |loss_t| (the loss itself can cancel to ~0 between tokens)
        assert abs(float(out.loss.detach()) - float(ref_loss.detach())) <= REL * float(ref_aux["_scale"]), label
        assert rel_err(out.logp, ref_logp) <= REL and rel_err(out.logp_q, ref_lq) <= REL, label
        assert rel_err(out.aux["clipped"], ref_aux["clipped"]) == 0.0, label
        for name, a, b in zip(("W", "mix", "emb/b", "b"), got_g, ref_g):
            assert torch.isfinite(a).all(), f"{label}: d{name} not finite"
            assert rel_err(a, b) <= REL, f"{label}: d{name} rel err {rel_err(a, b):.2e}"


def test_masked_tokens_contribute_nothing():
    # Changing a masked token's inputs (its advantage, its anchor log-prob) changes neither loss nor gradient.
    c = make_case(7, tied=False, bias=False)
    mask = torch.ones(N, dtype=torch.bool)
    mask[4] = False
    fn = make_loss_fn(c, "topk", "reverse", iw=False)
    a = fused_head_loss(hidden_of(c), c["w"], None, c["targets"], fn, q_index=c["q"], loss_mask=mask, chunk=5)
    ga = grads(c, a.loss)
    c["adv"][4], c["ref"][4] = 1e6, float("nan")
    b = fused_head_loss(hidden_of(c), c["w"], None, c["targets"], fn, q_index=c["q"], loss_mask=mask, chunk=5)
    gb = grads(c, b.loss)
    assert float(a.loss) == float(b.loss)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_entropy_and_chunking():
    # Entropy from the dH GEMM (lse - h . (p W)) equals -sum p log p; the chunk size changes nothing but rounding.
    c = make_case(3, tied=False, bias=True)
    fn = make_loss_fn(c, "k3", "reverse", iw=False)
    z = (hidden_of(c) @ c["w"].t() + c["b"]) / TAU
    ent = -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1)
    outs = [fused_head_loss(hidden_of(c), c["w"], c["b"], c["targets"], fn, temperature=TAU, chunk=ch) for ch in (1, 4, N)]
    for o in outs:
        assert rel_err(o.entropy, ent.detach()) <= REL
        assert abs(float(o.loss) - float(outs[-1].loss)) <= REL * abs(float(outs[-1].loss))


def test_stream_stats_match_full_logits():
    c = make_case(5, tied=False, bias=True)
    with torch.no_grad():
        h = hidden_of(c)
        z = (h @ c["w"].t() + c["b"]) / TAU  # [N, V]
        logp_full = torch.log_softmax(z, -1)
    st = stream_stats(h, c["w"].detach(), c["b"].detach(), c["targets"], topk=K, temperature=TAU, chunk=4, entropy=True)
    assert rel_err(st.logp, logp_full.gather(1, c["targets"][:, None])[:, 0]) <= REL
    assert rel_err(st.lse, torch.logsumexp(z, -1)) <= REL
    assert torch.equal(st.topk_index, z.topk(K, -1).indices)
    assert rel_err(st.logp_q, logp_full.gather(1, st.topk_index)) <= REL
    assert rel_err(st.entropy, -(logp_full.exp() * logp_full).sum(-1)) <= REL
    at_q = stream_stats(h, c["w"].detach(), c["b"].detach(), c["targets"], q_index=c["q"], temperature=TAU, chunk=3)
    assert at_q.topk_index is None and rel_err(at_q.logp_q, logp_full.gather(1, c["q"])) <= REL


def test_auto_chunk_from_budget():
    # 256 MiB of float32 rows of V = 151,936: 268,435,456 // 607,744 = 441; 8 buffers: // 4,861,952 = 55
    assert auto_chunk(151_936, 256) == 441
    assert auto_chunk(151_936, 256, buffers=8) == 55
    assert auto_chunk(10**9, 1) == 1



def test_float64_weights_with_a_bias_and_the_entropy():
    # issue 32: a float64 head with a bias and entropy=True failed (the bias part of sum_j p_j z_j was cast to float32
    # against float64 logits). The value, the entropy and the gradients equal plain autograd in float64 to 1e-12.
    g = torch.Generator().manual_seed(11)
    h = torch.randn(N, H, dtype=torch.float64, generator=g).requires_grad_()  # [N, H]
    w = torch.randn(V, H, dtype=torch.float64, generator=g).requires_grad_()  # [V, H]
    b = torch.randn(V, dtype=torch.float64, generator=g).requires_grad_()  # [V]
    targets = torch.randint(0, V, (N,), generator=g)

    def loss_fn(s, e, logp, logp_q, logits=None, ref_logits=None):
        return -logp, {}

    out = fused_head_loss(h, w, b, targets, loss_fn, temperature=TAU, chunk=4, entropy=True)
    got = torch.autograd.grad(out.loss, (h, w, b))
    z = (h @ w.t() + b) / TAU  # [N, V]
    logp = torch.log_softmax(z, -1)
    ref = -logp.gather(1, targets[:, None]).sum()
    want = torch.autograd.grad(ref, (h, w, b))
    assert abs(float(out.loss) - float(ref)) <= 1e-6 * abs(float(ref))  # the value is returned in float32
    assert rel_err(out.entropy.double(), -(logp.exp() * logp).sum(-1).detach()) <= 1e-6  # entropy kept in float32
    for a, c in zip(got, want):
        assert a.dtype == torch.float64 and rel_err(a, c) <= 1e-12


def test_half_gemm_with_a_float32_result_is_a_valid_call():
    # The CUDA branch of mm_float32 (torch.mm's out_dtype) cannot run on a CPU-only test machine; on the meta device
    # the same call checks that this torch accepts it and returns a float32 [3, 5] result from bfloat16 operands.
    from emapg_cli.kl.fused import mm_float32

    a = torch.empty(3, 4, dtype=torch.bfloat16, device="meta")
    b = torch.empty(4, 5, dtype=torch.bfloat16, device="meta")
    out = mm_float32(a, b, None)
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    buf = torch.empty(8, 5, device="meta")  # written into a reused float32 buffer, as _logits does
    assert mm_float32(a, b, None, out=buf[:3]).dtype == torch.float32
    # the CPU branch: the float32 GEMM of the widened operand, exact products of bfloat16 values
    a, b = torch.randn(3, 4).bfloat16(), torch.randn(4, 5).bfloat16()
    assert torch.equal(mm_float32(a, b, b.float()), a.float() @ b.float())
