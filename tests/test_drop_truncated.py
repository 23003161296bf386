"""train.mask_truncated drops truncated rows from the update after the advantages (rllm's mask_truncated_samples):
no loss and no count, where zeroing their mask (the former behaviour) still counted them as sequences."""

from __future__ import annotations

import pytest
import torch

from emapg_cli.config.loading import load_config
from test_mini_batch_sequences import _batch
from train_helpers import OneProcess, settings_of

#: advantages of the 6 rows; row 3 (A = 1.5) is the truncated one
ADV = [0.6, -0.3, 0.9, 1.5, -1.2, 0.3]


def _cfg(rows: int, agg: str = "seq-mean-token-mean"):
    # groups of one (rollout.n = 1): any number of rows makes a valid batch; one mini-batch of all rows, one epoch,
    # no KL, no old-policy pass -> the update's log-probs are the old ones, ratio 1, and PPO-clip's token loss is -A
    return load_config(overrides=[f"rollout.prompts_per_step={rows}", "rollout.n=1", f"train.mini_batch_prompts={rows}",
                                  "train.micro_batch_size=8", "kl.coef=0", f"train.loss_agg={agg}",
                                  "optim.grad_clip=null"])  # unclipped: the gradient scale shows


def _losses(tiny, batch, cfg, monkeypatch):
    """update_policy on a fresh tiny model: (the summed micro-batch losses it backpropagated, weights after)."""
    from transformers import AutoModelForCausalLM

    from emapg_cli.train import update
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.parallel import Replicated
    from emapg_cli.train.setup import make_scheduler

    seen: list[float] = []
    real = update.micro_batch_loss

    def recording(*a, **kw):
        parts = real(*a, **kw)
        seen.append(float(parts.loss.detach()))
        return parts

    monkeypatch.setattr(update, "micro_batch_loss", recording)
    lm = AutoModelForCausalLM.from_pretrained(tiny)
    opt = torch.optim.SGD(lm.parameters(), lr=0.1)
    update.update_policy(Replicated(OneProcess()), TokenScorer(lm), batch, settings_of(cfg), opt, make_scheduler(opt, cfg),
                         torch.Generator().manual_seed(0))
    return sum(seen), [p.detach().clone() for p in lm.parameters()]


@pytest.fixture(scope="module")
def six_rows(tiny_qwen2):
    return _batch(tiny_qwen2, n=3, prompts=2).with_(advantages=torch.tensor(ADV))


def _truncate_row_3(batch, drop: bool):
    """What the trainer does to a truncated row under train.mask_truncated: masks zeroed, and (now) the row dropped."""
    b = batch.with_(response_mask=batch.response_mask.clone())
    b.response_mask[3] = False
    return b.with_(keep=torch.tensor([True, True, True, False, True, True])) if drop else b


def test_dropped_row_loss_is_the_loss_without_it(tiny_qwen2, six_rows, monkeypatch):
    # seq-mean-token-mean with ratio 1: each row's token-mean of -A_i is -A_i, so the loss is -(sum of A_i) / N_seqs.
    # Kept rows: 0.6 - 0.3 + 0.9 - 1.2 + 0.3 = 0.3.
    #   dropped: N_seqs = 5 -> -0.3 / 5 = -0.06
    #   zeroed (the former behaviour): row 3 still counted, N_seqs = 6 -> -0.3 / 6 = -0.05
    #   the 5-row batch without row 3: -0.3 / 5 = -0.06
    kept_rows = torch.tensor([0, 1, 2, 4, 5])
    dropped, w_dropped = _losses(tiny_qwen2, _truncate_row_3(six_rows, drop=True), _cfg(6), monkeypatch)
    zeroed, w_zeroed = _losses(tiny_qwen2, _truncate_row_3(six_rows, drop=False), _cfg(6), monkeypatch)
    without, w_without = _losses(tiny_qwen2, six_rows.select(kept_rows), _cfg(5), monkeypatch)
    assert dropped == pytest.approx(-0.06, abs=1e-6)
    assert zeroed == pytest.approx(-0.05, abs=1e-6)
    assert without == pytest.approx(-0.06, abs=1e-6)
    # the whole update equals the one on the batch without the row (the same gradient, summed in another row order)
    for a, b in zip(w_dropped, w_without):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(not torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(w_dropped, w_zeroed))


def test_token_mean_never_counted_the_zeroed_tokens(tiny_qwen2, six_rows, monkeypatch):
    # token-mean divides by the kept tokens, which zeroing already removed: dropping changes nothing there.
    # loss = -(sum_i A_i T_i) / (sum_i T_i) over the kept rows (T_i their response tokens)
    t = six_rows.response_mask.sum(-1).float()  # [6]
    keep = torch.tensor([0, 1, 2, 4, 5])
    expected = float(-(torch.tensor(ADV)[keep] * t[keep]).sum() / t[keep].sum())
    dropped, _ = _losses(tiny_qwen2, _truncate_row_3(six_rows, drop=True), _cfg(6, "token-mean"), monkeypatch)
    zeroed, _ = _losses(tiny_qwen2, _truncate_row_3(six_rows, drop=False), _cfg(6, "token-mean"), monkeypatch)
    assert dropped == pytest.approx(expected, abs=1e-6) and zeroed == pytest.approx(expected, abs=1e-6)


def test_every_row_dropped_is_a_zero_step(tiny_qwen2, six_rows, monkeypatch):
    # a mini-batch whose rows were all dropped still runs one pass (on a masked row): loss 0, weights unchanged
    b = six_rows.with_(response_mask=torch.zeros_like(six_rows.response_mask), keep=torch.zeros(6, dtype=torch.bool))
    loss, w = _losses(tiny_qwen2, b, _cfg(6), monkeypatch)
    from transformers import AutoModelForCausalLM

    before = list(AutoModelForCausalLM.from_pretrained(tiny_qwen2).parameters())
    assert loss == 0.0 and all(torch.equal(a, b.detach()) for a, b in zip(w, before))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_drop_rows_and_span_groups(tiny_qwen2, tmp_path, parallel):
    """2 processes (gloo): 4 sequences per optimizer step (2 per rank, so each group of 4 spans two mini-batches)
    and truncated rows dropped, whose numbers differ between the ranks (a rank may be left with none in a
    mini-batch): the run completes with the ranks' anchors identical."""
    import json

    from test_parallel import _launch
    from train_helpers import tiny_overrides, write_dataset

    data = write_dataset(tmp_path / "train.jsonl")
    opts = tiny_overrides(tiny_qwen2, data, steps=2, **{"train.save_every": 0, "eval.anchor_every": 0, "data.eval": "null",
                                                        "train.mini_batch_prompts": "null", "train.mini_batch_sequences": 4,
                                                        "train.micro_batch_size": 2, "train.parallel": parallel})
    # stop strings on every digit and lower-case letter end some of the random tiny model's responses before the cap
    stop = "rollout.stop=[" + ", ".join(f"'{c}'" for c in "0123456789abcdefghijklmnopqrstuvwxyz") + "]"
    _launch(*opts, "--set", stop, "--set", "stages=[{steps: 2, max_new_tokens: 6, mask_truncated: true}]",
            "--out", str(tmp_path / "run"))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0 < r["rollout/truncated_frac"] < 1 for r in rows[1:])  # some rows dropped, some kept
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    if parallel == "ddp":
        assert len(set(summary["anchor_sha256_per_rank"])) == 1
