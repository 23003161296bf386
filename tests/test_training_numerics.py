"""Configurations that cannot train, refused in one line before anything is written (issue 32): a float16 policy
(no loss scaling: the gradients underflow) and the raw teacher-support KL (a pathological target). Both through the
real CLI, `train` and `train --dry-run`; the reasons checked on the tensors themselves."""

from __future__ import annotations

import pytest
import torch

from emapg_cli.config import load_config
from emapg_cli.errors import UserError
from emapg_cli.train.preflight import FLOAT16_TINY, config_checks


def test_float16_is_refused_by_train_and_dry_run(cli_many, tmp_path):
    out = tmp_path / "run"
    runs = cli_many(("train", "--preset", "toy", "--set", "model.dtype=float16", "--out", str(out)),
                    ("train", "--preset", "toy", "--set", "model.dtype=float16", "--dry-run"))
    for r in runs:
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "model.dtype=float16 does not train" in lines[0] and "bfloat16" in lines[0], lines
    assert not out.exists()  # refused before the run folder is claimed


def test_float16_gradients_underflow_where_bfloat16_keeps_them():
    # Why float16 is refused: a KL term's per-token weight beta / N_tokens = 1e-3 / 1e5 = 1e-8 is below float16's
    # smallest number 2^-24 = 5.96e-8, so a gradient of that size is 0 in float16 and kept in bfloat16 (float32's
    # exponent range). The fused head's dW of the loss 1e-8 * (-log p) over 4 tokens, rounded to the head's dtype:
    from emapg_cli.kl.fused import fused_head_loss

    assert 1e-3 / 1e5 < FLOAT16_TINY == 2.0 ** -24
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(4, 8, generator=g), torch.randn(16, 8, generator=g) * 0.3  # [T, H], [V, H]
    targets = torch.tensor([1, 5, 9, 13])
    grads = {}
    for dtype in (torch.float16, torch.bfloat16):
        wd = w.to(dtype).requires_grad_()
        out = fused_head_loss(h.to(dtype), wd, None, targets, lambda s, e, logp, lq, **k: (-1e-8 * logp, {}), entropy=False)
        out.loss.backward()
        grads[dtype] = wd.grad
    assert torch.count_nonzero(grads[torch.float16]) == 0  # every element of dW underflowed
    assert torch.count_nonzero(grads[torch.bfloat16]) == grads[torch.bfloat16].numel()  # none did


@pytest.mark.parametrize("overrides, key", [
    (["kl.estimator=teacher_support_raw"], "kl.estimator=teacher_support_raw"),
])
def test_teacher_support_raw_is_refused_for_training(overrides, key):
    cfg = load_config(overrides=["anchor.source=teacher", "anchor.path=/x", "kl.topk_from=anchor", *overrides])
    with pytest.raises(UserError, match=f"{key} is not a training target.*p_teacher / e"):
        config_checks(cfg)
    config_checks(load_config(overrides=["anchor.source=teacher", "anchor.path=/x", "kl.topk_from=anchor",
                                         "kl.estimator=teacher_support"]))  # the renormalised KL trains


def test_teacher_support_raw_minimum_is_the_teacher_over_e():
    # The reason: sum_{j in q} p_j log(p_j / t_j) is minimised over the student p (its mass outside q free) at
    # p_j = t_j / e (d/dp [p log(p / t)] = log(p / t) + 1 = 0), so the student keeps P(q) = T(q) / e of the teacher's
    # T(q) on q. Gradient descent on the raw estimator's function (kl.tail) from the teacher itself reaches it.
    from emapg_cli.kl import kl_per_token

    t = torch.tensor([0.40, 0.24, 0.20, 0.10, 0.06], dtype=torch.float64)  # teacher; q = its top 2: T(q) = 0.64
    q = torch.tensor([0, 1])
    z = t.log().clone().requires_grad_()  # student logits, starting at the teacher
    opt = torch.optim.SGD([z], lr=2.0)
    for _ in range(3000):
        logp = torch.log_softmax(z, -1)
        v = kl_per_token("teacher_support_raw", "reverse", logp=logp[0], ref_logp=t.log()[0],
                         logp_q=logp[q], ref_logp_q=t.log()[q], in_q=torch.tensor(True))
        opt.zero_grad()
        v.backward()
        opt.step()
    p_q = float(torch.softmax(z.detach(), -1)[q].sum())
    assert abs(p_q - 0.64 / torch.e) < 1e-3  # 0.2354..., against the teacher's 0.64
