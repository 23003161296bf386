"""The trainer's policy (a loaded causal LM, with LoRA adapters when asked) and its EMA anchor.

Loading itself, and the dtype helpers, are `models/loading.py`.
"""

from __future__ import annotations

import copy

import torch

from emapg_cli.models.loading import load_causal_lm, param_dtype


def load_policy(model_cfg, lora_cfg=None):
    """The policy causal LM, with gradient checkpointing if asked, and LoRA adapters (peft) when `lora_cfg.r > 0`.

    Its parameters are in `param_dtype`: float32 master weights by default for a bfloat16/float16
    model.dtype (the checkpoint's tensors are cast straight to float32, never rounded to model.dtype first),
    else model.dtype."""
    model = load_causal_lm(model_cfg.path, param_dtype(model_cfg, lora_cfg), trust_remote_code=model_cfg.trust_remote_code,
                           gradient_checkpointing=model_cfg.gradient_checkpointing, what="model.path")
    if lora_cfg is not None and lora_cfg.r > 0:
        from emapg_cli.train.lora import add_adapters

        model = add_adapters(model, lora_cfg)
    return model


def make_anchor(policy, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A frozen copy of the policy in `dtype` (ema.dtype: float32 by default, bfloat16 as the official search
    run holds its reference): parameters and buffers are the EMA shadow (paper Eq. 5).
    A LoRA policy's anchor is a copy of its adapters only (train/lora.py)."""
    from emapg_cli.train.lora import AdapterAnchor, is_lora

    if is_lora(policy):
        return AdapterAnchor(policy, dtype)
    anchor = copy.deepcopy(policy).to(dtype).eval()
    anchor.requires_grad_(False)  # in eval mode, so activation checkpointing copied from the policy stays inactive
    return anchor


def ema_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters then buffers, in module order: the tensors the EMA averages (a LoRA policy: its adapters)."""
    from emapg_cli.train.lora import adapter_tensors, is_lora

    if is_lora(model):
        return adapter_tensors(model)
    return [p for _, p in model.named_parameters()] + [b for _, b in model.named_buffers()]
