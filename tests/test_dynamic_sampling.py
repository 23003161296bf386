"""Groups of one, the anchor's autocast switch, and the removed dynamic sampling's keys."""

from __future__ import annotations

import contextlib

import torch

from emapg_cli.config import load_config
from emapg_cli.grpo import grpo_advantages
from emapg_cli.train.passes import anchor_autocast


def test_groups_of_one():
    # n = 1: no baseline; the advantage is the raw reward under every normalisation
    single = torch.tensor([[1.0], [0.0], [0.25]])
    for norm in ("group", "batch", "none"):
        assert torch.equal(grpo_advantages(single, norm), single)


def test_anchor_autocast_only_on_cuda():
    on = load_config().ema.anchor_autocast
    assert on and isinstance(anchor_autocast(on, torch.device("cpu")), contextlib.nullcontext)
    off = load_config(overrides=["ema.anchor_autocast=false"]).ema.anchor_autocast
    assert isinstance(anchor_autocast(off, torch.device("cuda")), contextlib.nullcontext)


def test_removed_dynamic_sampling_keys():
    """train.filter_groups is gone: a run's config.yaml holding it off (and its filter_max_rounds) still loads, for
    --resume; turning it on, in a file or with --set, is the one-line error naming the removal."""
    import pytest

    from emapg_cli.config.loading import validate
    from emapg_cli.errors import UserError

    assert validate({"train": {"filter_groups": False, "filter_max_rounds": 4}}).train == load_config().train
    with pytest.raises(UserError, match="train.filter_groups .* is gone"):
        validate({"train": {"filter_groups": True}})
    with pytest.raises(UserError, match="train.filter_groups .* is gone"):
        load_config(overrides=["train.filter_groups=false"])
