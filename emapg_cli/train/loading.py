"""Loading the policy, its tokenizer and the float32 EMA anchor."""

from __future__ import annotations

import copy

import torch

from emapg_cli.paths import expand

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_ref(path: str) -> str:
    """A local folder (with ~ and $EMAPG_HOME expanded) or the hub id unchanged."""
    local = expand(path)
    return str(local) if local.exists() else path


def load_tokenizer(model_cfg):
    """The policy's tokenizer, left-padded, with a pad token (the EOS token when it has none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_ref(model_cfg.path), trust_remote_code=model_cfg.trust_remote_code)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(model_cfg, lora_cfg=None):
    """The policy causal LM in the configured dtype, with gradient checkpointing if asked, and LoRA
    adapters (peft) when `lora_cfg.r > 0`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_ref(model_cfg.path), dtype=DTYPES[model_cfg.dtype], trust_remote_code=model_cfg.trust_remote_code
    )
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_cfg is not None and lora_cfg.r > 0:
        from emapg_cli.train.lora import add_adapters

        model = add_adapters(model, lora_cfg)
    return model


def make_anchor(policy) -> torch.nn.Module:
    """A frozen float32 copy of the policy: parameters and buffers are the EMA shadow (paper Eq. 5).
    A LoRA policy's anchor is a float32 copy of its adapters only (train/lora.py)."""
    from emapg_cli.train.lora import AdapterAnchor, is_lora

    if is_lora(policy):
        return AdapterAnchor(policy)
    anchor = copy.deepcopy(policy).float().eval()
    anchor.requires_grad_(False)  # in eval mode, so activation checkpointing copied from the policy stays inactive
    return anchor


def ema_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters then buffers, in module order: the tensors the EMA averages (a LoRA policy: its adapters)."""
    from emapg_cli.train.lora import adapter_tensors, is_lora

    if is_lora(model):
        return adapter_tensors(model)
    return [p for _, p in model.named_parameters()] + [b for _, b in model.named_buffers()]
