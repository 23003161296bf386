"""train.mini_batch_sequences: mini-batches counted in sequences (verl's ppo_mini_batch_size), groups may span them."""

from __future__ import annotations

import pytest
import torch

from emapg_cli.config.loading import load_config
from emapg_cli.engines.base import SamplingParams
from train_helpers import OneProcess, settings_of

QUESTIONS = ("1+2", "what is 13*17?", "2+2", "7-3")


def _batch(tiny, n: int, prompts: int):
    """`prompts` groups of `n` sampled responses from the tiny model, advantages spread over [-1, 1]."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from emapg_cli.engines.hf import HFEngine
    from emapg_cli.models.prompts import render_prompt
    from emapg_cli.train.rollout import build_batch

    lm, tok = AutoModelForCausalLM.from_pretrained(tiny).eval(), AutoTokenizer.from_pretrained(tiny)
    ids = [render_prompt(tok, q) for q in QUESTIONS[:prompts]]
    groups = HFEngine(lm, tok).generate(ids, SamplingParams(n=n, max_new_tokens=5, seed=3))
    comps = [c for g in groups for c in g]
    return build_batch([p for p in ids for _ in range(n)], comps, torch.linspace(-1, 1, len(comps)), tok.pad_token_id)


def _update(tiny, batch, cfg, spy=None, monkeypatch=None):
    """One update_policy call on a fresh copy of the tiny model; returns (weights after, stats, scheduler)."""
    from transformers import AutoModelForCausalLM

    from emapg_cli.train import update
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.parallel import Replicated
    from emapg_cli.train.setup import make_scheduler

    if spy is not None:  # record the rows of every mini-batch (micro_batches sees each mini-batch's rows first)
        real = update.micro_batches

        def recording(rows, *a, **kw):
            spy.append(rows.tolist())
            return real(rows, *a, **kw)

        monkeypatch.setattr(update, "micro_batches", recording)
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(tiny)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    sched = make_scheduler(opt, cfg)
    stats = update.update_policy(Replicated(OneProcess()), TokenScorer(lm), batch, settings_of(cfg), opt, sched,
                                 torch.Generator().manual_seed(1))
    return [p.detach().clone() for p in lm.parameters()], stats, sched


def test_mini_batch_rows_prompt_mode_is_the_old_whole_group_loop():
    from emapg_cli.train.update import mini_batch_rows

    for seed in range(5):
        order = torch.randperm(6, generator=torch.Generator().manual_seed(seed))
        # the loop before train.mini_batch_sequences: 2 groups of n = 3 per mini-batch
        old = [(order[g0:g0 + 2][:, None] * 3 + torch.arange(3)).reshape(-1) for g0 in range(0, 6, 2)]
        new = mini_batch_rows(order, 3, 2 * 3)
        assert len(new) == len(old) and all(torch.equal(a, b) for a, b in zip(new, old))


def test_sequences_equal_prompts_times_n_bit_for_bit(tiny_qwen2):
    # 2 prompts x n = 3, 2 epochs: mini_batch_prompts=1 and mini_batch_sequences=3 cut the same rows (whole groups)
    batch = _batch(tiny_qwen2, n=3, prompts=2)
    base = ["rollout.prompts_per_step=2", "rollout.n=3", "train.micro_batch_size=2", "train.epochs=2", "kl.coef=0"]
    prompts = load_config(overrides=[*base, "train.mini_batch_prompts=1"])
    seqs = load_config(overrides=[*base, "train.mini_batch_sequences=3"])
    assert seqs.train.mini_batch_prompts is None and seqs.derived.optimizer_steps_per_rl_step == 4
    w_p, s_p, _ = _update(tiny_qwen2, batch, prompts)
    w_s, s_s, _ = _update(tiny_qwen2, batch, seqs)
    assert len(s_s.grad_norm) == 4 and s_s.grad_norm == s_p.grad_norm and s_s.pg == s_p.pg
    assert all(torch.equal(a, b) for a, b in zip(w_p, w_s))
    # and a different cut (2 sequences per step) moves the weights differently
    w_2, s_2, _ = _update(tiny_qwen2, batch, load_config(overrides=[*base, "train.mini_batch_sequences=2"]))
    assert len(s_2.grad_norm) == 6 and not all(torch.equal(a, b) for a, b in zip(w_p, w_2))


def test_groups_span_mini_batches(tiny_qwen2, monkeypatch):
    # n = 5, 4 prompts = 20 rows, 4 sequences per optimizer step -> 20 / 4 = 5 optimizer steps.
    # The update's generator (seed 1) shuffles the groups to [1, 3, 2, 0]; group g holds rows 5g .. 5g + 4, so the
    # rows are laid out 5-9, 15-19, 10-14, 0-4 and cut every 4 rows.
    assert torch.randperm(4, generator=torch.Generator().manual_seed(1)).tolist() == [1, 3, 2, 0]
    batch = _batch(tiny_qwen2, n=5, prompts=4)
    cfg = load_config(overrides=["rollout.prompts_per_step=4", "rollout.n=5", "train.mini_batch_sequences=4",
                                 "train.micro_batch_size=8", "kl.coef=0"])
    assert cfg.derived.optimizer_steps_per_rl_step == 5
    seen: list[list[int]] = []
    _, stats, sched = _update(tiny_qwen2, batch, cfg, spy=seen, monkeypatch=monkeypatch)
    assert seen == [[5, 6, 7, 8], [9, 15, 16, 17], [18, 19, 10, 11], [12, 13, 14, 0], [1, 2, 3, 4]]
    assert len(stats.grad_norm) == 5 and stats.skipped == 0 and sched.last_epoch == 5
    # steps 2-4 each hold rows of two groups (group = row // 5)
    assert [sorted({r // 5 for r in rows}) for rows in seen] == [[1], [1, 3], [2, 3], [0, 2], [0]]


def test_sequences_must_divide_the_step():
    from emapg_cli.errors import UserError

    with pytest.raises(UserError, match="mini_batch_sequences"):
        load_config(overrides=["rollout.prompts_per_step=4", "rollout.n=5", "train.mini_batch_sequences=3"])
    with pytest.raises(UserError, match="exactly one"):
        load_config(overrides=["train.mini_batch_sequences=64", "train.mini_batch_prompts=8"])


def test_search_qa_counts_sequences(cli, emapg_home):
    # Search-R1's ppo_mini_batch_size 256 counts sequences: 512 prompts x 5 = 2,560 / 256 = 10 optimizer steps
    r = cli("config", "show", "--preset", "search-qa")
    assert r.returncode == 0, r.stderr
    assert "mini_batch_sequences: 256" in r.stdout and "mini_batch_prompts: null" in r.stdout
    # a wide terminal: the plan's cells then hold the phrase on one line, whatever the length of the data path
    # the warnings column shows (pytest-xdist's worker folders lengthen it)
    r = cli("train", "--preset", "search-qa", "--dry-run", env={"COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "256 sequences (groups may span); 10 per step x 1 epoch(s)" in out and "10 per RL step" in out


def test_plan_counts_sequences_per_rank_and_flags_an_uneven_split():
    from emapg_cli.train.plan import make_plan

    cfg = load_config("search-qa")
    # 256 sequences per step on 8 ranks: 32 rows each, 4 micro-batches of 8
    plan = make_plan(cfg, processes=8)
    assert (plan.mini_batch_sequences, plan.mini_batches_per_step, plan.micro_batches_per_mini_batch) == (256, 10, 4)
    assert not any("not a multiple" in n for n in plan.notes)
    notes = " ".join(make_plan(cfg, processes=3).notes)
    assert "train.mini_batch_sequences (256) is not a multiple of 3 processes" in notes
