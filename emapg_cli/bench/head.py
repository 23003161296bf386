"""`emapg bench update` / `emapg bench passes`: the output layer's part of the update and of the no-grad passes
against the GEMMs they cannot avoid.

update: random hidden states [T, H] (requiring grad), a random untied head [V, H] (requiring grad),
random q [T, k] and anchor log-probs; the real per-token loss (`train.loss.PolicyLoss.per_token`: PPO-clip
+ beta * KL with the chosen estimator) through the fused output layer, then backward. Its floor is
the three GEMMs it must do (logits, dH, dW) over the same chunks.
passes: the old-policy pass (log-probs, log-sum-exp, top-k indices) and the anchor pass (gathers at
q), each against one GEMM (the logits) over the same chunks.
Each timed run follows a warm-up; with `repeats` > 1 the floor and the measured code alternate.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Optional

import torch

from emapg_cli.bench.meter import Measurement, measure

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _summary(runs: list[Measurement], floor: list[Measurement], flops: float, device: torch.device,
             peak_tflops: Optional[float]) -> dict[str, Any]:
    """Medians (and ranges) of the measured runs and of the floor; ratio = median CPU s / median floor CPU s
    (on a GPU, where CPU time says nothing, wall time is compared)."""
    med = statistics.median
    out: dict[str, Any] = {
        "cpu_s": med(r.cpu_s for r in runs), "wall_s": med(r.wall_s for r in runs),
        "peak_growth_mib": max(r.peak_growth_mib for r in runs),
        "floor_cpu_s": med(r.cpu_s for r in floor), "floor_wall_s": med(r.wall_s for r in floor),
        "cpu_s_runs": [r.cpu_s for r in runs], "floor_cpu_s_runs": [r.cpu_s for r in floor],
        "wall_s_runs": [r.wall_s for r in runs], "floor_wall_s_runs": [r.wall_s for r in floor],
    }
    key = "wall_s" if device.type == "cuda" else "cpu_s"
    out["ratio"] = out[key] / out[f"floor_{key}"]
    out["ratio_runs"] = [a / b for a, b in zip(out[f"{key}_runs"], out[f"floor_{key}_runs"])]
    out["ratio_of"] = key
    out["tflops"] = flops / out["wall_s"] / 1e12
    if peak_tflops:
        out["pct_of_peak"] = 100.0 * out["tflops"] / peak_tflops
    return out


def _interleaved(work: Callable[[], object], floor: Callable[[], object], reset: Callable[[], None],
                 repeats: int, device: torch.device) -> tuple[list[Measurement], list[Measurement]]:
    work(), reset(), floor()  # warm-up (allocator, BLAS, first-touch pages)
    runs, floors = [], []
    for _ in range(repeats):
        reset()
        floors.append(measure(floor, device))
        reset()
        runs.append(measure(work, device))
    reset()
    return runs, floors


def least_bytes(tokens: int, hidden: int, vocab: int, k: int, chunk: int, dtype: str, *, update: bool,
                check_chunk: int = 0) -> int:
    """Bytes `bench_update` (`update`) or `bench_passes` allocates at least, before any timing: the inputs
    h [T, H] and W [V, H] (made in float32, then cast), for update their gradients and the floor's dH, dW,
    one [min(chunk, T), V] logits buffer, q [T, k] (int64) and the anchor's log-probs at q [T, k] (float32).
    `check_chunk` > 0 (`--check`, `--confident`): the float64 reference's copies of h, W and their gradients and its
    [check_chunk, V] float64 buffers (`bench.check.REFERENCE_BUFFERS`).
    A lower bound (the fused path's own buffers come on top): a shape past it cannot run here."""
    from emapg_cli.bench.check import REFERENCE_BUFFERS

    s = DTYPES[dtype].itemsize
    k = min(k, vocab)
    weights = (tokens + vocab) * hidden * (4 + s + (3 * s if update else 0))  # h, W (+ h.grad, W.grad, dH, dW)
    reference = (2 * (tokens + vocab) * hidden + REFERENCE_BUFFERS * min(check_chunk, tokens) * vocab) * 8 if check_chunk else 0
    return weights + min(chunk, tokens) * vocab * s + tokens * k * (8 + 4) + reference


def _chunks(n: int, chunk: int):
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def bench_update(tokens: int, hidden: int, vocab: int, k: int, *, chunk: Optional[int] = None,
                 budget_mib: float = 256.0, estimator: str = "topk", direction: str = "reverse", repeats: int = 1,
                 device: str = "cpu", dtype: str = "float32", peak_tflops: Optional[float] = None,
                 seed: int = 0, check: bool = False, confident: Optional[float] = None) -> dict[str, Any]:
    """Time the fused output layer + loss + backward at [T, H] x [V, H] against its three-GEMM floor.

    `confident`: every target token's probability is at least this (`bench.check.confident_hidden`); `check`: also
    the relative errors of dH and dW against the float64 reference of the same loss (`bench.check`)."""
    from emapg_cli.bench.check import REFERENCE_BUFFERS, confident_hidden
    from emapg_cli.config.loading import load_config
    from emapg_cli.kl import check_estimator
    from emapg_cli.kl.fused import EXACT_BUFFERS, auto_chunk, fused_head_loss
    from emapg_cli.train.rollout import RolloutBatch
    from emapg_cli.train.settings import policy_loss

    info = check_estimator(estimator, direction)
    dev, dt = torch.device(device), DTYPES[dtype]
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = min(k, vocab)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=dev, dtype=dt)

    h = rand(tokens, hidden)  # [T, H]
    w = rand(vocab, hidden, scale=hidden ** -0.5).requires_grad_()  # [V, H]
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(dev)  # [T]
    ref_chunk = auto_chunk(vocab, budget_mib, 2 * REFERENCE_BUFFERS)  # float64 [chunk, V] buffers
    if confident is not None:  # built on the CPU in float64 from the rounded W, then rounded to dtype
        h = confident_hidden(h.cpu(), w.detach().cpu(), targets.cpu(), confident, ref_chunk).to(dev)
    h.requires_grad_()
    q = torch.randint(0, vocab, (tokens, k), generator=g).to(dev)  # [T, k]
    f32 = dict(device=dev, dtype=torch.float32)
    batch = RolloutBatch(
        input_ids=torch.cat([torch.zeros(1, dtype=torch.long, device=dev), targets])[None],  # [1, 1 + T]
        attention_mask=torch.ones(1, tokens + 1, dtype=torch.long, device=dev), response_mask=torch.ones(1, tokens, dtype=torch.bool, device=dev),
        prompt_len=1, advantages=torch.ones(1, **f32),
        old_logp=-torch.rand(1, tokens, generator=g).to(**f32) * 4, q_index=q[None],
        ref_logp=-torch.rand(1, tokens, generator=g).to(**f32) * 4, ref_logp_q=-torch.rand(1, tokens, k, generator=g).to(**f32) * 4,
    )
    cfg = load_config(overrides=[f"kl.estimator={estimator}", f"kl.direction={direction}", f"kl.k={k}", "kl.coef=0.01"])
    loss_fn = policy_loss(cfg).per_token(batch, float(tokens), 1.0, batch.response_mask)
    exact = info.full_vocab
    ref = dict(ref_hidden=rand(tokens, hidden), ref_weight=rand(vocab, hidden, scale=hidden ** -0.5)) if exact else {}
    c = chunk or auto_chunk(vocab, budget_mib, EXACT_BUFFERS if exact else 1)

    def work():
        out = fused_head_loss(h, w, None, targets, loss_fn, q_index=q if info.uses_topk else None, chunk=c, **ref)
        out.loss.backward()

    def floor():  # logits, dH = dz W, dW += dz^T h over the same chunks
        buf = torch.empty(min(c, tokens), vocab, device=dev, dtype=dt)
        dh = torch.empty(tokens, hidden, device=dev, dtype=dt)
        dw = torch.empty(vocab, hidden, device=dev, dtype=dt)
        with torch.no_grad():
            for i, (s, e) in enumerate(_chunks(tokens, c)):
                z = torch.mm(h[s:e], w.t(), out=buf[: e - s])
                torch.mm(z, w, out=dh[s:e])
                dw.addmm_(z.t(), h[s:e], beta=0.0 if i == 0 else 1.0)

    def reset():
        h.grad = w.grad = None

    runs, floors = _interleaved(work, floor, reset, repeats, dev)
    flops = 3 * 2.0 * tokens * vocab * hidden
    out = _summary(runs, floors, flops, dev, peak_tflops)
    w_grad_mib = vocab * hidden * w.element_size() / 2**20
    out.update(w_grad_mib=w_grad_mib, beyond_w_grad_mib=out["peak_growth_mib"] - w_grad_mib, chunk=c, tokens=tokens,
               hidden=hidden, vocab=vocab, k=k, estimator=estimator, direction=direction, device=str(dev), dtype=dtype,
               threads=torch.get_num_threads(), repeats=repeats, confident=confident)
    if check:
        out.update(_check(work, reset, h, w, targets, loss_fn, q if info.uses_topk else None, ref_chunk, ref))
    return out


def _check(work: Callable[[], object], reset: Callable[[], None], h, w, targets, loss_fn, q, chunk: int,
           ref: dict) -> dict[str, Any]:
    """`--check`: one more fused pass, its dH and dW against the float64 reference (`bench.check`), and the smallest
    probability of a target token (float64, on the rounded inputs)."""
    from emapg_cli.bench.check import reference_grads, rel_err, target_prob

    reset()
    work()
    cpu = lambda t: t.detach().cpu() if t is not None else None  # noqa: E731
    ref_h, ref_w = cpu(ref.get("ref_hidden")), cpu(ref.get("ref_weight"))
    dh, dw = reference_grads(cpu(h), cpu(w), cpu(targets), loss_fn, cpu(q), chunk, ref_h, ref_w)
    with torch.no_grad():
        p_min = float(target_prob(cpu(h).double() @ cpu(w).double().t(), cpu(targets)).min())  # logits [T, V]
    out = {"dh_rel_err": rel_err(cpu(h.grad), dh), "dw_rel_err": rel_err(cpu(w.grad), dw), "target_prob_min": p_min}
    reset()
    return out


def bench_passes(tokens: int, hidden: int, vocab: int, k: int, *, chunk: Optional[int] = None, budget_mib: float = 256.0,
                 repeats: int = 1, device: str = "cpu", dtype: str = "float32", peak_tflops: Optional[float] = None,
                 seed: int = 0) -> dict[str, Any]:
    """Time the old-policy pass (log-probs, log-sum-exp, top-k) and the anchor pass (gathers at q) against one GEMM."""
    from emapg_cli.kl.fused import auto_chunk, stream_stats

    dev, dt = torch.device(device), DTYPES[dtype]
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = min(k, vocab)
    h = (torch.randn(tokens, hidden, generator=g)).to(device=dev, dtype=dt)  # [T, H]
    w = (torch.randn(vocab, hidden, generator=g) * hidden ** -0.5).to(device=dev, dtype=dt)  # [V, H]
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(dev)
    q = torch.randint(0, vocab, (tokens, k), generator=g).to(dev)
    c = chunk or auto_chunk(vocab, budget_mib)

    def floor():
        buf = torch.empty(min(c, tokens), vocab, device=dev, dtype=dt)
        for s, e in _chunks(tokens, c):
            torch.mm(h[s:e], w.t(), out=buf[: e - s])

    flops = 2.0 * tokens * vocab * hidden
    out: dict[str, Any] = {}
    for name, kw in (("old", dict(topk=k)), ("anchor", dict(q_index=q))):
        runs, floors = _interleaved(lambda: stream_stats(h, w, None, targets, chunk=c, **kw), floor, lambda: None, repeats, dev)
        out[name] = _summary(runs, floors, flops, dev, peak_tflops)
    out.update(chunk=c, tokens=tokens, hidden=hidden, vocab=vocab, k=k, device=str(dev), dtype=dtype,
               threads=torch.get_num_threads(), repeats=repeats)
    return out
