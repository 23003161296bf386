"""Loading a transformers causal LM and its tokenizer, and which dtype a policy is held and computed in.

Plain arguments (a path, a dtype), no config object: evaluation, the engines and the trainer all load
models through here. The trainer's own policy (LoRA adapters, the EMA anchor) is built on top in
`train/loading.py`.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch

from emapg_cli.paths import expand

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_ref(path: str) -> str:
    """A local folder (with ~ and $EMAPG_HOME expanded) or the hub id unchanged."""
    local = expand(path)
    return str(local) if local.exists() else path


def load_tokenizer(path: str, trust_remote_code: bool = False):
    """The tokenizer of the model at `path` (see `model_ref`), left-padded, with a pad token (the EOS token when it has none)."""
    from transformers import AutoTokenizer

    from emapg_cli.models.folder import loading
    from emapg_cli.models.hub import check_model_source

    check_model_source(path)  # one fast line for a hub id that cannot load (offline, not cached), not a minute of retries
    with loading(path):
        tok = AutoTokenizer.from_pretrained(model_ref(path), trust_remote_code=trust_remote_code)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, dtype: Union[str, torch.dtype], trust_remote_code: bool = False,
                   gradient_checkpointing: bool = False, what: str = "model"):
    """The causal LM at `path` (see `model_ref`) with its parameters in `dtype` (a torch dtype or a `DTYPES` name;
    the checkpoint's tensors are cast straight to it), with gradient checkpointing if asked. A local folder is checked
    first (`folder.check_model_folder`); what transformers refuses in it is one line too (`folder.loading`), naming
    `what` (model.path, anchor.path, ...)."""
    from transformers import AutoModelForCausalLM

    from emapg_cli.models.folder import check_model_folder, loading

    check_model_folder(path, what)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    with loading(path, what):
        model = AutoModelForCausalLM.from_pretrained(model_ref(path), dtype=dtype, trust_remote_code=trust_remote_code)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def uses_master_weights(model_cfg, lora_cfg=None) -> bool:
    """float32 master weights apply: model.master_weights with a bfloat16/float16 model.dtype, and no LoRA
    (a LoRA policy's trainable adapters are float32 already, peft's default, and its frozen base, which no
    update touches, stays in model.dtype)."""
    lora = lora_cfg is not None and lora_cfg.r > 0
    return model_cfg.master_weights and model_cfg.dtype != "float32" and not lora


def param_dtype(model_cfg, lora_cfg=None) -> torch.dtype:
    """The dtype the policy's parameters (hence gradients and AdamW state) are held in: float32 under
    master weights, else model.dtype."""
    return torch.float32 if uses_master_weights(model_cfg, lora_cfg) else DTYPES[model_cfg.dtype]


def compute_dtype(model_cfg, lora_cfg=None) -> Optional[torch.dtype]:
    """The dtype the float32 master weights' forward/backward run in (model.dtype), or None when the
    parameters are already in model.dtype (float32 runs, master_weights=false, LoRA): nothing to cast."""
    return DTYPES[model_cfg.dtype] if uses_master_weights(model_cfg, lora_cfg) else None


def compute_autocast(device_type: str, dtype: Optional[torch.dtype]):
    """`torch.autocast(device_type, dtype)` around a forward of the float32 master weights; no context at all
    (not even a disabled autocast) when `dtype` is None, so float32 runs are untouched."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype of the autocast region the caller is in on `device_type`, or None outside autocast."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` with its floating tensors in `dtype`; a tensor under several names (tied embeddings) stays one
    tensor, so save_pretrained still writes it once. Tensors already in `dtype` are returned as they are."""
    cast: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        if t.is_floating_point() and t.dtype != dtype:
            # state_dict() gives tied parameters as distinct tensors over one storage: one cast for them all
            key = (t.device, t.data_ptr(), tuple(t.shape), t.stride()) if t.numel() else (id(t),)
            if key not in cast:
                cast[key] = t.to(dtype)
            t = cast[key]
        out[name] = t
    return out


def set_config_dtype(folder, dtype: torch.dtype) -> None:
    """Record `dtype` as the saved weights' dtype in `folder`/config.json (save_pretrained writes the live
    module's, float32 for master weights saved in model.dtype). Atomic; a folder without config.json is left."""
    import json
    from pathlib import Path

    from emapg_cli.paths import write_text_atomic

    path = Path(folder) / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    name = str(dtype).split(".")[1]
    if config.get("dtype", name) == name and config.get("torch_dtype", name) == name:
        return
    config["dtype"] = name
    if "torch_dtype" in config:
        config["torch_dtype"] = name
    write_text_atomic(path, json.dumps(config, indent=2, sort_keys=True) + "\n")
