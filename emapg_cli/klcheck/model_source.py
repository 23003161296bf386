"""Policy/anchor logits from a local transformers causal LM (the only kl-check module that imports transformers)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from emapg_cli.errors import UserError
from emapg_cli.klcheck.distributions import LogitSet, check_logits

#: Used when no --text is given: ordinary prose, so positions have a realistic mix of
#: confident and uncertain next-token distributions.
DEFAULT_TEXT = (
    "The river rose slowly through the night, and by morning the lower fields were under water. "
    "Farmers moved their animals to the hills while the children watched from the bridge. "
    "Nobody could remember a flood like it, although the old records spoke of one a century ago. "
    "When the rain finally stopped, the town counted its losses and began, patiently, to rebuild. "
    "In the spring the fields were green again, and the river returned to its usual quiet course."
)


def _require_dir(path: str) -> None:
    """kl-check reads local model folders only: a hub id or a missing path is refused here, before transformers
    looks it up on the hub (without network, its retries take most of a minute per lookup). The folder is checked
    as every model folder is (`models.folder.check_model_folder`)."""
    from emapg_cli.models.folder import check_model_folder

    if check_model_folder(path, "--model/--anchor-model") is None:
        raise UserError(f"--model/--anchor-model {path}: not a local model directory")


def _load(path: str):
    from emapg_cli.models.loading import load_causal_lm

    _require_dir(path)
    try:
        return load_causal_lm(path, torch.float32, what="--model/--anchor-model").eval()
    except UserError:
        raise
    except Exception as e:  # a directory transformers cannot load: report it in one line
        raise UserError(f"cannot load a causal LM from {path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def perturbed_copy(model, sigma: float, seed: int):
    """A deep copy of `model` with N(0, sigma^2) noise added to every weight (seeded)."""
    import copy

    anchor = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in anchor.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * sigma)
    return anchor


def logits_from_model(
    path: str, anchor_path: Optional[str], text: Optional[str], positions: int, perturb: float, seed: int
) -> LogitSet:
    """Run `text` (default DEFAULT_TEXT) through the policy and the anchor (a second model, or the
    policy with Gaussian weight noise `perturb`) and keep the last `positions` positions' logits."""
    from transformers import AutoTokenizer

    for p in (path, anchor_path):
        if p:
            _require_dir(p)  # before the tokenizer: AutoTokenizer would try the hub for a name that is no folder
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:
        raise UserError(f"cannot load a tokenizer from {path}: {type(e).__name__}") from None
    policy = _load(path)
    anchor = _load(anchor_path) if anchor_path else perturbed_copy(policy, perturb, seed)
    ids = tokenizer(text or DEFAULT_TEXT, return_tensors="pt").input_ids  # [1, T]
    if ids.shape[1] < 1:
        raise UserError("the text produced no tokens")
    ids = ids[:, -min(ids.shape[1], getattr(policy.config, "max_position_embeddings", ids.shape[1])):]
    with torch.no_grad():
        z = policy(input_ids=ids).logits[0, -positions:].double()  # [P, V]
        z_ref = anchor(input_ids=ids).logits[0, -positions:].double()  # [P, V]
    if z.shape[-1] != z_ref.shape[-1]:
        raise UserError(f"policy and anchor vocabularies differ ({z.shape[-1]} vs {z_ref.shape[-1]})")
    name = Path(path).name + (f" vs {Path(anchor_path).name}" if anchor_path else f" vs weights+N(0,{perturb:g}²)")
    if z.shape[0] < positions:  # say so rather than silently measuring fewer positions
        name += f"; only {z.shape[0]} positions: the text has fewer tokens than --positions {positions}"
    return check_logits(z, z_ref, None, where=f"model {name}")
