"""Getting a LoRA policy's current weights into an engine with weights of its own (vLLM), two ways (`lora.sync`).

* `adapter`: the adapter alone, saved in PEFT's format (`save_pretrained`: adapter_config.json +
  adapter_model.safetensors) into a fresh folder under a temporary directory this process owns
  (`AdapterFolders`), which the engine then loads under a new name (vLLM's LoRARequest).
* `merged`: the adapter merged into a copy of each targeted base weight (`merge_lora`, below) and
  every tensor pushed under the base model's (transformers) names, as for full fine-tuning.

A LoRA policy is a peft model; this module reads its modules' attributes (`base_layer`, `lora_A`,
`lora_B`, `scaling`) and calls its `save_pretrained`, but imports neither peft nor vLLM.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Iterator

#: peft's prefix of the wrapped transformers model's parameter names (PeftModel -> LoraModel -> the model).
_PEFT_PREFIX = "base_model.model."


def is_peft(model) -> bool:
    """A peft model (LoRA adapters on a frozen base), after unwrapping DDP's `.module`."""
    return hasattr(getattr(model, "module", model), "peft_config")


def merge_lora(weight, lora_a, lora_b, scaling: float):
    """The merged weight of one LoRA linear layer: W + s B A (Hu et al. 2021, Eq. 3, h = W x + s B A x with
    s = alpha / r, peft's `scaling`), computed in float32 and returned as a new tensor in float32.

    weight [out, in], lora_a [r, in], lora_b [out, r] -> [out, in]. No deviation: this is what peft's
    `merge_and_unload` computes for a `Linear` without `fan_in_fan_out`, without touching the model.
    """
    return weight.float() + scaling * (lora_b.float() @ lora_a.float())  # [out, in]


def _unwrap(model):
    model = getattr(model, "module", model)  # DDP
    return getattr(model, "_orig_mod", model)  # torch.compile


def _lora_layers(model) -> dict[str, Any]:
    """{peft module name: its LoRA layer} for every layer carrying an active, unmerged adapter."""
    layers = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "base_layer") and hasattr(mod, "lora_A") and hasattr(mod, "scaling"):
            if getattr(mod, "merged", False) or getattr(mod, "fan_in_fan_out", False):
                raise RuntimeError(f"cannot merge the LoRA layer {name}: already merged or fan_in_fan_out (not an nn.Linear)")
            layers[name] = mod
    return layers


def merged_named_weights(model, dtype: Any = None) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every parameter of the peft `model`'s base, in transformers' naming, with each
    LoRA-adapted weight replaced by `merge_lora` of its active adapters (several: summed); cast to `dtype`
    (None: float32 for merged weights, as they are for the others). One tensor at a time: never a second
    copy of the model. The adapter tensors themselves are not yielded.
    """
    model = _unwrap(model)
    layers = _lora_layers(model)
    for name, param in model.named_parameters():
        if ".lora_" in name:  # lora_A / lora_B / lora_embedding_* / lora_magnitude_vector: merged below
            continue
        owner, _, leaf = name.rpartition(".")
        t = param.detach()
        if owner.endswith(".base_layer") and owner[: -len(".base_layer")] in layers:
            owner = owner[: -len(".base_layer")]
            layer = layers[owner]
            if leaf == "weight":
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        t = merge_lora(t, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight, layer.scaling[adapter])
        full = f"{owner}.{leaf}"
        full = full[len(_PEFT_PREFIX):] if full.startswith(_PEFT_PREFIX) else full
        yield full, t.to(dtype) if dtype is not None and t.is_floating_point() else t


class AdapterFolders:
    """Numbered adapter folders `<tmp>/1`, `<tmp>/2`, ... in a temporary directory of this process (rank-local:
    every rank's engine reads its own; nothing is shared between ranks or nodes), removed when this object is
    garbage-collected or the process exits.

    `save(model)` writes the peft model's adapter (`save_pretrained`, PEFT's format) into `<tmp>/.partial-<k>` and
    renames it to `<tmp>/<k>` (atomic: a reader never sees a half-written adapter); `drop(k)` removes folder k
    once the engine has loaded a newer one, so at most two exist at a time.
    """

    def __init__(self, prefix: str = "emapg-lora-"):
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self.count = 0

    def save(self, model) -> tuple[int, Path]:
        """(k, folder) of the adapter of `model` as it is now, k = 1, 2, ... (a new number at every call)."""
        self.count += 1
        partial, final = self.root / f".partial-{self.count}", self.root / str(self.count)
        # save_embedding_layers=False: no look-up of the base model's config (a hub id would be fetched); emapg
        # targets linear layers only
        _unwrap(model).save_pretrained(str(partial), save_embedding_layers=False)
        os.replace(partial, final)
        return self.count, final

    def drop(self, k: int) -> None:
        shutil.rmtree(self.root / str(k), ignore_errors=True)

    def close(self) -> None:
        self._cleanup()
