"""Padding removed from the decoder passes (`train.pack_sequences`): the layout by hand, and the packed
passes equal to the padded ones (values and gradients) on both tiny architectures."""

from __future__ import annotations

import pytest
import torch

from emapg_cli.train.packing import first_fit_decreasing, pack, plan, unpack
from train_helpers import assert_layout_equals_padded


def test_first_fit_decreasing_by_hand():
    # lengths 5, 2, 4, 1, 3 into bins of 5: 5 alone; 4 + 1; 3 + 2 (longest first, first bin with room)
    assert first_fit_decreasing([5, 2, 4, 1, 3], 5) == [[0], [2, 3], [4, 1]]
    assert first_fit_decreasing([7, 2], 5) == [[0], [1]]  # over capacity: a bin of its own
    assert first_fit_decreasing([], 5) == []


def test_pack_layout_by_hand():
    # row 0: 2 pads then 3 tokens (left padding); row 1: 2 tokens then 3 pads; row 2: 5 tokens
    ids = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 0, 0, 0], [31, 32, 33, 34, 35]])
    mask = (ids != 0).long()
    p = pack(ids, mask, pad_id=0)
    # width 5 (the longest); bins: [row 2], [row 0 (3 tokens), row 1 (2 tokens)]
    assert p.input_ids.tolist() == [[31, 32, 33, 34, 35], [11, 12, 13, 21, 22]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]  # restarts at each sequence
    # flat index row * 5 + column of every real token; -1 at padding
    assert p.source.tolist() == [[-1, -1, 5, 6, 7], [8, 9, -1, -1, -1], [0, 1, 2, 3, 4]]
    hidden = torch.arange(10.0).view(2, 5, 1)  # [b, C, H=1]: the value is the flat index
    assert unpack(hidden, p.source[:, 1:4]).squeeze(-1).tolist() == [[0, 5, 6], [9, 0, 0], [1, 2, 3]]  # 0 at padding


def test_auto_packs_sequences_of_128_tokens_or_more():
    ids = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 0, 0, 0], [31, 32, 33, 34, 35]])
    mask = (ids != 0).long()
    # 5-token sequences are under auto's 128: the padded batch; "always" packs 3 rows into 2
    assert plan(ids, mask, "auto") is None and plan(ids, mask, "always").rows == 2
    assert plan(ids, mask, "never") is None and plan(ids, mask, False) is None
    wide = torch.repeat_interleave(ids, 26, dim=1)  # the same layout at 26x the width: 130 >= 128 tokens
    assert plan(wide, (wide != 0).long(), "auto").rows == 2
    narrow = wide[:, :127]  # the longest sequence now 127 tokens (row 2): padded
    assert plan(narrow, (narrow != 0).long(), "auto") is None
    with pytest.raises(ValueError):
        plan(ids, mask, "sometimes")


def _batch(vocab: int):
    """6 rows of prompts left-padded to 7 and responses right-padded to 9, lengths chosen so that
    several sequences share a packed row; one row has no response token."""
    g = torch.Generator().manual_seed(0)
    p, r = 7, 9
    prompt_lens, response_lens = [7, 3, 5, 1, 7, 2], [9, 4, 0, 9, 1, 6]
    ids = torch.randint(3, vocab, (6, p + r), generator=g)
    attn = torch.ones(6, p + r, dtype=torch.long)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens)):
        attn[i, : p - pl] = 0
        attn[i, p + rl:] = 0
    return ids * attn, attn, p, attn[:, p:].clone()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_passes_equal_the_padded_ones(arch):
    from emapg_cli.models.tiny import build_byte_tokenizer, build_tiny_model

    model = build_tiny_model(build_byte_tokenizer(), arch=arch, seed=0)
    ids, attn, p, resp = _batch(model.config.vocab_size)
    assert pack(ids, attn).rows < ids.shape[0]  # the case packs something: 6 rows into fewer
    assert_layout_equals_padded(model, ids, attn, p, resp, pack=True)


def test_packing_check_accepts_a_packing_model_and_refuses_one_that_attends_across(monkeypatch):
    from emapg_cli.errors import UserError
    from emapg_cli.models.tiny import build_byte_tokenizer, build_tiny_model
    from emapg_cli.train import packing
    from emapg_cli.train.logprobs import TokenScorer
    from emapg_cli.train.passes import check_layouts
    from emapg_cli.train.rollout import RolloutBatch

    model = build_tiny_model(build_byte_tokenizer(), arch="qwen2", seed=0)
    ids, attn, p, resp = _batch(model.config.vocab_size)
    batch = RolloutBatch(input_ids=ids, attention_mask=attn, response_mask=resp, prompt_len=p, advantages=torch.zeros(6))
    assert check_layouts(TokenScorer(model), batch, 1.0, "always", "never")["pack"] < 1e-5
    # a model that ignored the restarting positions would attend across the packed sequences: simulate it
    real = packing.pack

    def no_restarts(*a, **kw):
        out = real(*a, **kw)
        out.position_ids = torch.arange(out.input_ids.shape[1]).expand_as(out.input_ids).contiguous()
        return out

    monkeypatch.setattr(packing, "pack", no_restarts)
    with pytest.raises(UserError, match="pack_sequences=never"):
        check_layouts(TokenScorer(model), batch, 1.0, "always", "never")
