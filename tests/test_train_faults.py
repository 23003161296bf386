"""Training faults: a step that makes the weights non-finite stops the run before the EMA anchor takes
them; mostly-skipped steps stop the run; a huge question is skipped before it is tokenised."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from emapg_cli.config import load_config
from emapg_cli.errors import UserError
from emapg_cli.train.parallel import Replicated
from emapg_cli.train.update import NonFiniteWeights, all_finite, finite_step

from train_helpers import OneProcess, run, tiny_overrides, train_cmd, write_dataset


def test_all_finite_finds_one_bad_element():
    good = [torch.randn(5, 3), torch.zeros(0), torch.randn(7).bfloat16()]
    assert all_finite(good)
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = torch.randn(4, 4)
        t[2, 3] = bad
        assert not all_finite([*good, t])
    assert all_finite([torch.full((3,), 3e38)])  # large but finite: max |x| does not overflow


class PoisonedAdamW(torch.optim.AdamW):
    """AdamW whose step also writes inf into one weight (what an overflowing update does)."""

    def step(self, closure=None):
        super().step(closure)
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[0] = float("inf")


def test_a_step_that_makes_weights_non_finite_raises():
    lin = torch.nn.Linear(3, 2)
    params = list(lin.parameters())
    strategy = Replicated(OneProcess())

    def step(opt):
        lin(torch.ones(1, 3)).sum().backward()
        return finite_step(strategy, params, opt, 1.0, loss_finite=True)

    norm, stepped = step(torch.optim.AdamW(params, lr=0.1))  # an ordinary step passes
    assert stepped and all_finite(params)
    with pytest.raises(NonFiniteWeights, match="non-finite"):
        step(PoisonedAdamW(params, lr=0.1))


def test_skipped_steps_window_by_hand():
    """2 optimizer steps per RL step, a window of 3 RL steps (6 optimizer steps), max fraction 0.5."""
    from emapg_cli.train.bookkeeping import check_skips

    cfg = load_config(overrides=["rollout.prompts_per_step=4", "train.mini_batch_prompts=2", "train.steps=10",
                                 "train.skip_window=3", "train.max_skipped_fraction=0.5"])
    assert cfg.derived.optimizer_steps_per_rl_step == 2
    t = SimpleNamespace(cfg=cfg, state={})
    check_skips(t.state, t.cfg, 1, 2)  # [2]: window not full yet (1 < 3 RL steps), even at 100% skipped
    check_skips(t.state, t.cfg, 2, 1)  # [2, 1]: not full
    check_skips(t.state, t.cfg, 3, 0)  # [2, 1, 0]: 3 of 6 = 0.5, not more than 0.5
    check_skips(t.state, t.cfg, 4, 1)  # [1, 0, 1]: 2 of 6 (step 1 left the window)
    assert t.state["skip_window"] == [1, 0, 1]
    check_skips(t.state, t.cfg, 5, 2)  # [0, 1, 2]: 3 of 6, not more than half
    with pytest.raises(UserError, match=r"step 6: 5 of the last 6 optimizer steps \(3 RL steps\) were skipped"):
        check_skips(t.state, t.cfg, 6, 2)  # [1, 2, 2]: 5 of 6 > 0.5 x 6 = 3
    t = SimpleNamespace(cfg=cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_skipped_fraction": 1.0})}), state={})
    for step in range(1, 6):
        check_skips(t.state, t.cfg, step, 2)  # 1.0: never stops, even at 6 of 6


def test_short_run_judged_over_all_its_steps():
    """A run shorter than the window is judged once all its steps are in: 2 steps, both fully skipped."""
    from emapg_cli.train.bookkeeping import check_skips

    cfg = load_config(overrides=["rollout.prompts_per_step=2", "train.mini_batch_prompts=2", "train.steps=2", "train.skip_window=20"])
    t = SimpleNamespace(cfg=cfg, state={})
    check_skips(t.state, t.cfg, 1, 1)
    with pytest.raises(UserError, match="2 of the last 2 optimizer steps"):
        check_skips(t.state, t.cfg, 2, 1)


def test_huge_question_is_skipped_before_tokenising(tiny_qwen2):
    """A 20 MB question is counted as too long without being tokenised: well under 2 s (tokenising only
    2 MB of it with this byte-level tokenizer took 13.6 s and 1.2 GB peak RSS on the loaded test
    machine), while short ones are kept."""
    from transformers import AutoTokenizer

    from emapg_cli.data.schema import Example
    from emapg_cli.models.prompts import max_chars_per_token, render_prompt
    from emapg_cli.train.rollout import prepare_prompts

    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    short = Example(id="s", question="1+1", answers=["2"])
    huge = Example(id="h", question="7" * 20_000_000, answers=["7"])
    t0 = time.perf_counter()
    kept, ids, skipped = prepare_prompts(tok, [short, huge, short], max_prompt_tokens=64)
    assert time.perf_counter() - t0 < 2.0
    assert (len(kept), skipped) == (2, 1)
    # the bound never drops a question that fits: its characters are at most tokens x the longest entry
    fits = Example(id="f", question="1+2*3", answers=["7"])
    n = len(render_prompt(tok, fits.question))
    assert len(fits.question) <= n * max_chars_per_token(tok)
    assert prepare_prompts(tok, [fits], max_prompt_tokens=n)[2] == 0


# ---------------------------------------------------------------- end to end, through the CLI
def _last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


def test_weights_made_non_finite_stop_the_run_before_the_anchor(tiny_qwen2, tmp_path):
    """lr 1e30 with weight decay 1e10 (both finite, so config validation passes): AdamW's decay factor
    1 - lr x wd = -1e40 overflows float32, step 1's weights become inf/nan; the run stops (exit 2, one
    line) before the EMA update and before any checkpoint, final weights or summary are written."""
    data = write_dataset(tmp_path / "d.jsonl")
    out = tmp_path / "r"
    proc = run(train_cmd(*tiny_overrides(tiny_qwen2, data, steps=2, **{"optim.lr": 1e30, "optim.weight_decay": 1e10, "data.eval": "null"}),
                         "--out", str(out)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert _last_line(proc).startswith("error: step 1: the optimizer step made the policy's weights non-finite")
    assert not (out / "checkpoints").exists() and not (out / "final").exists() and not (out / "summary.json").exists()


def test_mostly_skipped_steps_stop_the_run(tiny_qwen2, tmp_path):
    """Every reward nan -> every loss non-finite -> every optimizer step skipped; with a window of 2
    RL steps the run stops at step 2 (exit 2) instead of reporting success; step 1's checkpoint stays."""
    data = write_dataset(tmp_path / "d.jsonl")
    out = tmp_path / "r"
    opts = tiny_overrides(tiny_qwen2, data, steps=4, **{"rollout.reward": "test_nan", "train.skip_window": 2, "data.eval": "null"})
    proc = run(train_cmd(*opts, "--out", str(out)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert _last_line(proc).startswith("error: step 2: 4 of the last 4 optimizer steps (2 RL steps) were skipped")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1"]
    assert not (out / "summary.json").exists()
