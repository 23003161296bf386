"""LoRA (peft, the `lora` extra): adapters on the policy, and an EMA anchor made of adapter weights only.

With LoRA the policy is theta = (W_base, A, B) with W_base frozen, so the EMA of theta (paper Eq. 5)
is (W_base, EMA(A), EMA(B)): the anchor needs a float32 copy of the adapters only. `AdapterAnchor`
holds that copy; its log-prob pass runs the policy's own module with the anchor adapters swapped in
(and the policy's put back afterwards), so the base weights are never duplicated.
Only this module imports peft.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from emapg_cli.errors import UserError
from emapg_cli.train.logprobs import TokenScorer, eval_mode, token_stats


def is_lora(model) -> bool:
    """A peft model (LoRA adapters on a frozen base)."""
    return hasattr(model, "peft_config")


def add_adapters(model, lora_cfg):
    """`model` with LoRA adapters on `lora_cfg.target_modules`; only the adapters train (float32 by peft's default)."""
    layers = [(min(mod.in_features, mod.out_features), name, mod) for name, mod in model.named_modules()
              if name.rsplit(".", 1)[-1] in lora_cfg.target_modules and hasattr(mod, "in_features") and hasattr(mod, "out_features")]
    if layers and lora_cfg.r > min(layers, key=lambda t: t[0])[0]:  # rank(A B) <= min(in, out): a larger r is only memory
        smallest, name, mod = min(layers, key=lambda t: t[0])
        raise UserError(f"lora.r = {lora_cfg.r} exceeds the smallest dimension of the targeted layers ({name}: "
                        f"{mod.in_features} -> {mod.out_features}); use lora.r <= {smallest}")
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise UserError("lora.r > 0 needs peft: pip install \"emapg[lora]\"") from None
    config = LoraConfig(r=lora_cfg.r, lora_alpha=lora_cfg.alpha, target_modules=list(lora_cfg.target_modules),
                        lora_dropout=lora_cfg.dropout, bias="none", task_type="CAUSAL_LM")
    try:
        with warnings.catch_warnings():  # peft calls transformers' deprecated is_gradient_checkpointing (a FutureWarning)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(model, config)
    except ValueError as e:  # e.g. no module matches target_modules
        raise UserError(f"lora: {str(e).splitlines()[0]}") from None


def adapter_tensors(model) -> list[Tensor]:
    """The trainable adapter parameters of a peft model, in module order."""
    return [p for _, p in model.named_parameters() if p.requires_grad]


class AdapterAnchor(nn.Module):
    """The EMA anchor of a LoRA policy: float32 copies of its adapter tensors (the shadow, its parameters).

    The policy is kept outside the module's registered children, so `parameters()`, `state_dict()` and
    the EMA see the shadow only.
    """

    def __init__(self, policy, dtype: torch.dtype = torch.float32):
        super().__init__()
        object.__setattr__(self, "_policy", policy)  # not a submodule: its weights are not the anchor's
        self.shadow = nn.ParameterList(  # in `dtype` (ema.dtype)
            [nn.Parameter(t.detach().to(dtype).clone(), requires_grad=False) for t in adapter_tensors(policy)])

    @property
    def policy(self):
        return self._policy

    @contextlib.contextmanager
    def swapped(self):
        """Within: the policy module computes with the anchor's adapters; its own are restored after."""
        live = adapter_tensors(self._policy)
        saved = [t.detach().clone() for t in live]
        try:
            with torch.no_grad():
                for t, s in zip(live, self.shadow):
                    t.copy_(s)
            yield self._policy
        finally:
            with torch.no_grad():
                for t, s in zip(live, saved):
                    t.copy_(s)

    def scorer(self) -> "AdapterAnchorScorer":
        return AdapterAnchorScorer(self)

    def merged(self):
        """A plain transformers model: the base with the anchor's adapters merged in (a copy)."""
        with self.swapped() as lm:
            return copy.deepcopy(lm).merge_and_unload()


class AdapterAnchorScorer(TokenScorer):
    """`TokenScorer` of an `AdapterAnchor`: the policy's pass with the anchor adapters swapped in."""

    def __init__(self, anchor: AdapterAnchor):
        nn.Module.__init__(self)
        self.lm = anchor

    def forward(self, input_ids, attention_mask, prompt_len, response_mask, **kwargs):
        with self.lm.swapped() as lm, torch.no_grad(), eval_mode(lm):
            return token_stats(lm, input_ids, attention_mask, prompt_len, response_mask, **kwargs)


def save_merged(model, out: Path, tokenizer, dtype: torch.dtype) -> None:
    """`out`: the merged model in save_pretrained format (+ tokenizer), in `dtype`, and the peft adapter in
    `out/adapter`."""
    if isinstance(model, AdapterAnchor):
        merged = model.merged()
        with model.swapped() as lm:
            lm.save_pretrained(out / "adapter")
    else:
        merged = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(out / "adapter")
    merged.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
