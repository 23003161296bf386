"""The vLLM generation engine (CUDA GPU only; `pip install emapg[vllm]`).

vLLM is imported only here, and only inside functions, so this module imports without it. One
`LLM.generate` call serves a whole batch: each prompt is one request asking for `n` samples,
with its own seed derived from (params.seed, prompt index) — never n copies of a request with
the same seed, which would return n identical samples.

After each optimizer update the trainer pushes the policy's weights in with `load_weights`.
The engine runs in this process (emapg sets VLLM_ENABLE_V1_MULTIPROCESSING=0 unless the user
set it), so the weights are copied tensor by tensor into vLLM's own model with its
`load_weights`; no file is written and nothing is pickled. Sleep mode (`llm.sleep(level=1)` /
`llm.wake_up()`) hands the engine's GPU memory (weights and KV cache) back during the update.
See docs/vllm.md.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional

from emapg_cli.engines.base import Completion, SamplingParams
from emapg_cli.errors import UserError

MISSING_VLLM = "the vllm backend needs `pip install emapg[vllm]` and a CUDA GPU"

#: Upper bound on prompts in one generate call, so request seeds never collide (see request_seed).
MAX_PROMPTS_PER_CALL = 2**24

#: Where the in-process model lives, newest layout first. vLLM V1 with the engine core in this
#: process exposes `llm_engine.model_executor` "for v0 compatibility"; its driver worker is a
#: wrapper that forwards attributes to the real worker (hence both of the first two paths);
#: the last one reaches the executor through the in-process engine-core client directly.
_INPROCESS_MODEL_PATHS = (
    "llm_engine.model_executor.driver_worker.model_runner.model",
    "llm_engine.model_executor.driver_worker.worker.model_runner.model",
    "llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model",
)

_SLEEP_TAGS = ("weights", "kv_cache")


def import_vllm():
    """The `vllm` module, or a UserError telling the user how to get it."""
    try:
        import vllm
    except ImportError:
        raise UserError(MISSING_VLLM) from None
    return vllm


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


def sampling_kwargs(params: SamplingParams, prompt_index: int) -> dict[str, Any]:
    """Keyword arguments of vLLM's `SamplingParams` for one prompt's request.

    Greedy decoding (temperature 0) asks for one sample: all n would be identical, and the caller
    repeats it (see `to_completions`). `logprobs=0` makes vLLM return the log-probability of each
    sampled token only (no alternatives).
    """
    n = 1 if params.temperature == 0 else params.n
    return {
        "n": n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": params.max_new_tokens,
        "stop": list(params.stop) or None,
        "seed": request_seed(params.seed, prompt_index, n),
        "logprobs": 0,
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


def named_weights(model) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for every parameter of `model`, in transformers' naming.

    Unwraps (Distributed)DataParallel (`.module`) and `torch.compile` (`._orig_mod`) so the names
    match the checkpoint's. Tied weights appear once (under the embedding's name), which is what
    vLLM's loaders expect: they skip `lm_head` when embeddings are tied.
    """
    import torch

    module = model.module if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)) else model
    module = getattr(module, "_orig_mod", module)
    for name, param in module.named_parameters():
        yield name, param.detach()


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


class _LoadWeights:
    """A picklable `apply_model` function: load the given (name, CPU tensor) pairs into the worker's model."""

    def __init__(self, weights: list[tuple[str, Any]]):
        self.weights = weights

    def __call__(self, model) -> None:
        model.load_weights(iter(self.weights))


def weight_loader(llm: Any) -> Callable[[Iterable[tuple[str, Any]]], None]:
    """How to push (name, tensor) pairs into `llm`, for the running vLLM version.

    1. In-process engine (the default emapg sets up): vLLM's model `load_weights` directly;
       tensors are copied device to device, one at a time.
    2. Engine core in another process (VLLM_ENABLE_V1_MULTIPROCESSING=1): `LLM.apply_model`
       ships CPU copies of the weights to the worker (slow: the whole model is serialised on
       every update; recent vLLM also needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 to send a function).
    Anything else is a UserError naming the vLLM version.
    """
    model = find_inprocess_model(llm)
    if model is not None:
        return lambda weights: model.load_weights(weights)
    if callable(getattr(llm, "apply_model", None)):
        warnings.warn(
            "vLLM runs its engine in another process: every weight update is serialised through "
            "LLM.apply_model (slow). Set VLLM_ENABLE_V1_MULTIPROCESSING=0 to load weights in place.",
            RuntimeWarning,
            stacklevel=3,
        )

        def via_apply_model(weights: Iterable[tuple[str, Any]]) -> None:
            llm.apply_model(_LoadWeights([(name, t.to("cpu")) for name, t in weights]))

        return via_apply_model
    version = getattr(import_vllm(), "__version__", "unknown")
    raise UserError(
        f"cannot push weights into vLLM {version}: no in-process model and no LLM.apply_model; "
        "use a vLLM version >= 0.8 with VLLM_ENABLE_V1_MULTIPROCESSING=0"
    )


class VLLMEngine:
    """The `Engine` interface on a vLLM `LLM` living in this process, on one GPU."""

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
    ):
        """Start vLLM on `model_path` (a local folder or a hub id), taking that fraction of GPU memory.

        `max_model_len` bounds prompt + response tokens (None: the model's own limit, which
        sizes the KV cache for very long sequences). Raises UserError without vLLM or a GPU.
        """
        vllm = import_vllm()
        import torch

        if not torch.cuda.is_available():
            raise UserError(MISSING_VLLM)
        # Keep the engine core in this process so load_weights can reach the model (see weight_loader).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._vllm = vllm
        self._llm = vllm.LLM(
            model=model_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            seed=seed,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            trust_remote_code=trust_remote_code,
        )
        self._sleep_mode = enable_sleep_mode and callable(getattr(self._llm, "sleep", None))
        self._sleeping: set[str] = set()  # which of _SLEEP_TAGS are offloaded/discarded now
        self._loader: Optional[Callable[[Iterable[tuple[str, Any]]], None]] = None
        self._warned_no_sleep = False

    @property
    def llm(self):
        """The underlying `vllm.LLM` (for measurements; emapg code goes through the Engine methods)."""
        return self._llm

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """`params.n` completions for each tokenised prompt, in prompt order (one vLLM call)."""
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        if len(prompts) > MAX_PROMPTS_PER_CALL:
            raise ValueError(f"at most {MAX_PROMPTS_PER_CALL} prompts per generate call, got {len(prompts)}")
        self.resume_memory()
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        sampling = [self._vllm.SamplingParams(**sampling_kwargs(params, i)) for i in range(len(prompts))]
        outputs = self._llm.generate(requests, sampling, use_tqdm=False)
        return [to_completions(o, params) for o in outputs]

    def load_weights(self, model) -> None:
        """Copy `model`'s current parameters into the engine and drop its prefix cache.

        Works asleep or awake: asleep, only the weights are woken (the KV cache stays released
        until the next `resume_memory`/`generate`). The prefix cache is reset because cached
        prompt KV was computed with the old weights.
        """
        self._wake(("weights",))
        if self._loader is None:
            self._loader = weight_loader(self._llm)
        self._loader(named_weights(model))
        reset = getattr(self._llm, "reset_prefix_cache", None)
        if callable(reset):
            reset()

    def release_memory(self) -> None:
        """Sleep level 1: offload the weights to CPU memory and discard the KV cache (no-op without sleep mode)."""
        if not self._sleep_mode:
            if not self._warned_no_sleep:
                warnings.warn("vLLM sleep mode is off: the engine keeps its GPU memory during updates", RuntimeWarning, stacklevel=2)
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
        try:
            self._llm.wake_up(tags=pending)
        except TypeError:  # vLLM without wake-up tags: everything wakes at once
            self._llm.wake_up()
            self._sleeping.clear()
            return
        self._sleeping.difference_update(pending)
