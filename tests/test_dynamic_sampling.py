"""Dynamic sampling (train.filter_groups), groups of one, and the anchor's autocast switch."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import torch

from emapg_cli.config import load_config
from emapg_cli.grpo import grpo_advantages, informative_groups
from emapg_cli.train.passes import anchor_autocast
from train_helpers import env, tiny_overrides, write_dataset


def test_informative_groups_and_groups_of_one():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.25]])
    assert informative_groups(rewards).tolist() == [False, True, False, True]
    # n = 1: no baseline; the advantage is the raw reward under every normalisation
    single = torch.tensor([[1.0], [0.0], [0.25]])
    for norm in ("group", "batch", "none"):
        assert torch.equal(grpo_advantages(single, norm), single)


def test_anchor_autocast_only_on_cuda():
    on = load_config().ema.anchor_autocast
    assert on and isinstance(anchor_autocast(on, torch.device("cpu")), contextlib.nullcontext)
    off = load_config(overrides=["ema.anchor_autocast=false"]).ema.anchor_autocast
    assert isinstance(anchor_autocast(off, torch.device("cuda")), contextlib.nullcontext)


PLUGIN = '''
def score(response, example):
    """Items q0 and q1 vary with the response (informative groups are likely); every other item always
    scores 1 (its groups are all-equal and dynamic sampling drops them)."""
    if example["id"] in ("q0", "q1"):
        return float(len(response) % 2)
    return 1.0
'''


def test_filter_groups_through_the_cli(tiny_qwen2, tmp_path):
    (tmp_path / "plugin.py").write_text(PLUGIN)
    data = write_dataset(tmp_path / "train.jsonl", n=8)
    opts = tiny_overrides(tiny_qwen2, data, steps=2, **{"rollout.reward": f"{tmp_path / 'plugin.py'}:score",
                                                     "train.filter_groups": "true", "train.filter_max_rounds": 3,
                                                     "data.eval": "null", "train.save_every": 0})
    r = subprocess.run([sys.executable, "-m", "emapg_cli", "train", *opts, "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=300, env=env())
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for row in rows[1:]:
        # 4 prompts per step, at most 2 of them informative in the first round (only q0, q1 can be):
        # at least one extra round runs, and at most filter_max_rounds
        assert 1 <= row["rollout/filter_rounds"] <= 3
        # at least 2 all-equal groups from the first round were dropped or, with the cap hit, fill the batch
        assert row["rollout/filtered_groups"] + row["rollout/filter_filled"] >= 2
        if row["rollout/filter_filled"] == 0:  # every kept group is informative: rewards vary
            assert row["reward/std"] > 0


def test_filtered_groups_by_hand():
    """One rank, 2 groups of 2: in round 0 item 0 is all-equal ([1, 1]) and item 1 informative ([0, 1]); every
    group of a later round is informative. With one extra round allowed: 1 round, item 0 dropped, nothing filled,
    and the batch is item 1 plus the first drawn item. With none: item 0 fills the batch (after item 1)."""
    from types import SimpleNamespace

    from emapg_cli.train.dynamic_sampling import filtered_groups

    acc = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"))
    calls = []

    def graded(items, round_):
        calls.append((list(items), round_))
        rows = {0: [1.0, 1.0], 1: [0.0, 1.0]} if round_ == 0 else {}
        return [(f"p{i}", [f"c{i}a", f"c{i}b"], [i, i], torch.tensor(rows.get(i, [0.0, 1.0]))) for i in items], 0

    prompts, completions, examples, rewards, errors, m = filtered_groups(acc, [0, 1], graded, 8, 1, seed=1, step=1)
    assert len(calls) == 2 and calls[1][1] == 1 and len(calls[1][0]) == 2  # one extra round drew 2 prompts
    assert prompts == ["p1", f"p{calls[1][0][0]}"] and rewards.shape == (2, 2) and len(completions) == 4
    assert m == {"rollout/filter_rounds": 1.0, "rollout/filtered_groups": 1.0, "rollout/filter_filled": 0.0}
    calls.clear()
    prompts, _, examples, rewards, _, m = filtered_groups(acc, [0, 1], graded, 8, 0, seed=1, step=1)
    assert calls == [([0, 1], 0)] and prompts == ["p1", "p0"] and examples == [1, 1, 0, 0]
    assert m == {"rollout/filter_rounds": 0.0, "rollout/filtered_groups": 0.0, "rollout/filter_filled": 1.0}
