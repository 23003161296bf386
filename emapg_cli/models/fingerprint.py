"""What must agree between a trainer and a rollout server: the model's shape and the tokenizer.

A trainer that pushes its weights into an engine of another model, or reads token ids sampled under another
tokenizer, would train on nonsense without an error. Both sides compute these fingerprints (pure JSON data) and
the trainer refuses a server whose fingerprint differs, naming the first field that does (`first_difference`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Optional

#: The config fields compared, in this order (the first that differs is named).
CONFIG_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def params_digest(named_shapes: Iterable[tuple[str, Iterable[int]]]) -> str:
    """sha256 of the sorted (parameter name, shape) list: the same for two models whose weights can be
    copied one into the other name by name."""
    rows = sorted((name, [int(d) for d in shape]) for name, shape in named_shapes)
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def model_fingerprint(config: Any, named_shapes: Iterable[tuple[str, Iterable[int]]]) -> dict[str, Any]:
    """{"architecture", vocab_size, hidden_size, num_hidden_layers, num_attention_heads, "params"} of a
    transformers model (its `config` and `(name, shape)` of its parameters, tied weights once)."""
    arch = getattr(config, "architectures", None) or [type(config).__name__]
    out: dict[str, Any] = {"architecture": str(arch[0])}
    for name in CONFIG_FIELDS:
        value = getattr(config, name, None)
        if value is None and hasattr(config, "get_text_config"):
            value = getattr(config.get_text_config(), name, None)
        out[name] = None if value is None else int(value)
    out["params"] = params_digest(named_shapes)
    return out


def module_fingerprint(model: Any) -> dict[str, Any]:
    """`model_fingerprint` of a loaded module (unwrapped from DDP / torch.compile)."""
    module = getattr(model, "module", model)
    module = getattr(module, "_orig_mod", module)
    return model_fingerprint(module.config, ((n, p.shape) for n, p in module.named_parameters()))


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's sorted vocabulary, its special tokens and its chat template."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    special = {k: str(v) for k, v in sorted((getattr(tokenizer, "special_tokens_map", None) or {}).items())}
    template = getattr(tokenizer, "chat_template", None)
    payload = json.dumps({"vocab": vocab, "special": special, "chat_template": template if isinstance(template, (str, type(None))) else str(template)})
    return hashlib.sha256(payload.encode()).hexdigest()


def first_difference(ours: dict[str, Any], theirs: Any) -> Optional[str]:
    """`field ours vs theirs` of the first field of `ours` that `theirs` (a server's reply) does not match; None
    when they agree. The parameter digest is named as "parameter names or shapes"."""
    if not isinstance(theirs, dict):
        return "the model fingerprint is missing"
    for key, value in ours.items():
        if theirs.get(key) != value:
            if key == "params":
                return "parameter names or shapes"
            return f"{key} {value} vs {str(theirs.get(key))[:60]}"
    return None
