"""The transformers `generate` engine: batched, left-padded, per-sample seeds, per-token sampling log-probs.

Sampling is done by `SeededSampler`, a logits processor that draws every row's token by
inverse-CDF sampling from uniforms pre-drawn with that row's own `torch.Generator`, then hands
`generate` a one-hot mask so its greedy step picks exactly that token. A row's randomness thus
depends only on (params.seed, row index) — never on batch composition or on the global RNG —
which is what makes rollouts reproducible on resume. Works on CPU and GPU.

Recorded log-probs are those of the full-vocabulary distribution softmax(logits / T), whatever
top_p is (the nucleus only decides which tokens can be drawn), so they are what the trainer's
log-prob passes compute. A response ends on any of `end_token_ids` (the tokenizer's EOS and the
generation config's EOS ids, `engines.base.end_token_ids`, the set the vLLM engine stops on too)
or on a stop string, and holds only tokens the sampler drew (see `HFEngine._completion`).

Two decode paths draw the same tokens: emapg's own loop (`engines/hf_decode.py`: a preallocated key/value
cache, finished rows leave the batch; the default wherever the model supports it) and transformers'
`generate` with the sampler as a logits processor (`fast_decode=False`, or a model the loop does not
support: the engine then warns once, naming why). `HFEngine.decode_path` says which one runs.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import warnings
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch import Tensor
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from emapg_cli.engines.base import CancelHook, Cancelled, Completion, EngineBase, SamplingParams, derive_seed, end_token_ids
from emapg_cli.kl.common import nucleus_keep
from emapg_cli.models.prefix import cache_kwarg, prompt_cache

log = logging.getLogger(__name__)


def sample_from_logits(scores: Tensor, uniforms: Tensor, temperature: float, top_p: float) -> tuple[Tensor, Tensor]:
    """Draw one token per row by inverse CDF; return (tokens [B], log-prob [B] under softmax(scores / T)).

    scores [B, V]; uniforms [B] in [0, 1). temperature 0 = greedy (argmax). With top_p < 1 the
    smallest set of most likely tokens whose mass reaches top_p is kept (the most likely token
    always) and renormalised (Holtzman et al. 2020). The returned log-prob is that of the
    temperature-scaled full distribution (what the trainer's log-prob passes compute), not of the
    top-p-renormalised one.
    """
    scores = scores.float()
    if temperature == 0:
        tokens = scores.argmax(-1)  # [B]
        return tokens, torch.log_softmax(scores, -1).gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(scores / temperature if temperature != 1.0 else scores, -1)  # [B, V] (x / 1 is x: skipped)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)  # [B, V]
        sorted_p = sorted_p * nucleus_keep(sorted_p, top_p)
    else:
        sorted_p, order = probs, None
    cdf = sorted_p.cumsum(-1)  # [B, V]
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    pos = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)  # [B, 1]
    tokens = (order.gather(-1, pos) if order is not None else pos).squeeze(-1)  # [B]
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class SeededSampler(LogitsProcessor):
    """Replace `generate`'s sampling with per-row seeded sampling; records each step's log-probs."""

    def __init__(self, uniforms: Tensor, prompt_len: int, temperature: float, top_p: float, topk: int = 0):
        self.uniforms = uniforms  # [B, max_new_tokens]
        self.prompt_len = prompt_len
        self.temperature = temperature
        self.top_p = top_p
        self.topk = topk
        self.logprobs: list[Tensor] = []  # one [B] per generated position
        self.tokens: list[Tensor] = []  # one [B] per generated position: the token drawn for each row
        self.topk_index: list[Tensor] = []  # one [B, k] per generated position (topk > 0)

    def draw(self, scores: Tensor, uniforms: Tensor) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """One step's tokens [B] and log-probs [B] drawn from scores [B, V] with uniforms [B], and the top-k ids
        [B, k] of softmax(scores / T) (the top-k of the scores) when `topk` > 0, else None."""
        tokens, logp = sample_from_logits(scores, uniforms, self.temperature, self.top_p)
        top = scores.topk(min(self.topk, scores.shape[-1]), -1).indices if self.topk else None  # [B, k]
        return tokens, logp, top

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        t = input_ids.shape[1] - self.prompt_len
        tokens, logp, top = self.draw(scores, self.uniforms[:, t])
        self.logprobs.append(logp)
        self.tokens.append(tokens)
        if top is not None:
            self.topk_index.append(top)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, tokens[:, None], 0.0)
        return out


class _CancelCheck(StoppingCriteria):
    """Raises `Cancelled` out of `generate` at the first decode step after `cancelled()` turned true."""

    def __init__(self, cancelled: Callable[[], bool]):
        self.cancelled = cancelled

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: Any) -> Tensor:
        if self.cancelled():
            raise Cancelled("the generation was cancelled")
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # [B]: no row stops here


class HFEngine(EngineBase):
    """`Engine` over a transformers causal LM that lives in this process (shares the trainer's weights)."""

    #: Samples from the live module it was given: `load_weights` copies nothing.
    shares_weights = True
    #: Records each step's top-k ids of softmax(scores / T) when asked (`SamplingParams.topk`).
    records_topk = True

    def __init__(self, model, tokenizer, batch_size: int = 256,
                 weights_context: Optional[Callable[[Any], ContextManager[Any]]] = None, share_prompts: bool = True,
                 end_token_ids: Optional[Sequence[int]] = None, fast_decode: bool = True):
        """`weights_context(model)` is entered around each generate call (default: nothing); the trainer
        passes one that gathers a sharded model's full weights for the duration (train/parallel.py).
        `share_prompts`: prefill each distinct prompt of a batch once (`emapg_cli.models.prefix.prompt_cache`).
        `end_token_ids`: the tokens a response ends on; default the tokenizer's EOS plus `model.generation_config`'s
        EOS ids (`engines.base.end_token_ids`). `fast_decode`: emapg's decode loop (`engines/hf_decode.py`) where the
        model supports it; False: transformers' `generate` (the same samples, slower)."""
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.share_prompts = share_prompts
        self.fast_decode = fast_decode
        self.weights_context = weights_context or (lambda model: contextlib.nullcontext())
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer has no pad token; set one (e.g. the EOS token) before generating")
        self.end_ids = tuple(end_token_ids) if end_token_ids is not None else \
            _end_ids_of(tokenizer, getattr(model, "generation_config", None))
        self._paths: dict[type, str] = {}  # decode path per model class, decided (and said) once
        self._stops: dict[tuple[str, ...], Any] = {}  # StopStringCriteria per stop-string set (its tables cost)

    @property
    def decode_path(self) -> str:
        """`fast` (engines/hf_decode.py) or `generate: <why>` for the model sampled from now."""
        return self._path_for(_forward_model(self.model))

    def _path_for(self, model) -> str:
        kind = type(model)
        if kind not in self._paths:
            from emapg_cli.engines.hf_decode import unsupported_reason

            reason = unsupported_reason(model) if self.fast_decode else "fast_decode is off"
            self._paths[kind] = "fast" if reason is None else f"generate: {reason}"
            if reason is None:
                log.info("hf engine: %s samples through emapg's decode loop", kind.__name__)
            elif self.fast_decode:
                warnings.warn(f"hf engine: {kind.__name__} samples through transformers' generate (slower): {reason}",
                              stacklevel=2)
        return self._paths[kind]

    def full_vocab_logprobs(self, params: SamplingParams) -> bool:
        """Whether the recorded log-probs are log softmax(logits / T) over the full vocabulary for `params`
        (the trainer's distribution): always when sampling (any top_p); greedy records T = 1's."""
        return params.temperature > 0

    def load_weights(self, model) -> None:
        """Sample from `model` from now on (the trainer passes its live policy or the anchor)."""
        self.model = model

    def generate(self, prompts: list[list[int]], params: SamplingParams, cancelled: CancelHook = None) -> list[list[Completion]]:
        """`params.n` completions per prompt; row i*n + j is seeded with derive_seed(params.seed, i*n + j).
        `cancelled`: polled at every decode step; once it returns True, `Cancelled` is raised (nothing returned)."""
        rows = [(i, p) for i, p in enumerate(prompts) for _ in range(params.n)]
        flat: list[Completion] = []
        with self.weights_context(self.model):
            for start in range(0, len(rows), self.batch_size):
                if cancelled is not None and cancelled():
                    raise Cancelled("the generation was cancelled")
                chunk = rows[start:start + self.batch_size]
                seeds = [derive_seed(params.seed, start + j) for j in range(len(chunk))]
                flat.extend(self._generate_chunk([p for _, p in chunk], seeds, params, cancelled))
        return [flat[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

    @torch.inference_mode()
    def _generate_chunk(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams,
                        cancelled: CancelHook = None) -> list[Completion]:
        model = self.model
        device = next(model.parameters()).device
        plen = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), plen), self.tokenizer.pad_token_id, dtype=torch.long)  # [B, P]
        attention = torch.zeros((len(prompts), plen), dtype=torch.long)  # [B, P]
        for r, p in enumerate(prompts):
            input_ids[r, plen - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[r, plen - len(p):] = 1
        uniforms = torch.stack([
            torch.rand(params.max_new_tokens, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds
        ]).to(device)  # [B, max_new_tokens]
        sampler = SeededSampler(uniforms, plen, params.temperature, params.top_p, params.topk)
        was_training = model.training
        model.eval()
        try:
            input_ids, attention = input_ids.to(device), attention.to(device)
            if self._path_for(_forward_model(model)) == "fast":
                rows = self._decode_rows(input_ids, attention, uniforms, sampler, params, cancelled)
            else:
                rows = self._generate_rows(input_ids, attention, sampler, params, cancelled)
        finally:
            model.train(was_training)
        return [self._completion(*row, params) for row in rows]

    def _decode_rows(self, input_ids: Tensor, attention: Tensor, uniforms: Tensor, sampler: SeededSampler,
                     params: SamplingParams, cancelled: CancelHook = None) -> list[tuple[Tensor, Tensor, Tensor, Optional[Tensor]]]:
        """emapg's decode loop: each row's (tokens, drawn, log-probs, top-k) through its last step."""
        from emapg_cli.engines.hf_decode import decode

        stop = self._stop_criteria(params.stop)
        out = decode(_forward_model(self.model), input_ids, attention, uniforms, sampler.draw, self.end_ids,
                     (lambda seqs: stop(seqs, None)) if stop is not None else None, share_prompts=self.share_prompts,
                     cancelled=cancelled)
        rows = []
        for r, n in enumerate(out.steps.tolist()):
            ids = out.tokens[r, :n]
            rows.append((ids, ids, out.logprobs[r, :n], out.topk[r, :n] if out.topk is not None else None))
        return rows

    def _generate_rows(self, input_ids: Tensor, attention: Tensor, sampler: SeededSampler, params: SamplingParams,
                       cancelled: CancelHook = None) -> list[tuple[Tensor, Tensor, Tensor, Optional[Tensor]]]:
        """transformers' `generate` with the sampler as its logits processor: each row's (tokens as generate returned
        them, the sampler's draws, log-probs, top-k)."""
        tok, model = self.tokenizer, self.model
        plen, b = input_ids.shape[1], input_ids.shape[0]
        end = list(self.end_ids) or None  # rows finish on any of these (generate fills finished rows with pad_token_id)
        gen_cfg = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=False, num_beams=1,
            eos_token_id=end, pad_token_id=tok.pad_token_id,
            stop_strings=list(params.stop) or None,
        )
        # `generate` fills every field we leave unset from model.generation_config (a checkpoint's
        # repetition_penalty, min_new_tokens, ...), which would silently change the distribution
        # sampled from; a neutral config in its place for the call keeps sampling = softmax(logits / T).
        saved_cfg = model.generation_config
        model.generation_config = GenerationConfig(eos_token_id=end, pad_token_id=tok.pad_token_id)
        try:
            shared = {}  # the repeated prompts' key/value cache, prefilled once each
            if self.share_prompts:
                decoder = model.get_decoder()
                cache = prompt_cache(decoder, input_ids, attention)
                if cache is not None:
                    shared[cache_kwarg(decoder)] = cache
            out = model.generate(
                input_ids=input_ids, attention_mask=attention, generation_config=gen_cfg,
                logits_processor=LogitsProcessorList([sampler]), tokenizer=tok if params.stop else None,
                stopping_criteria=StoppingCriteriaList([_CancelCheck(cancelled)] if cancelled is not None else []), **shared,
            )
        finally:
            model.generation_config = saved_cfg
        generated = out[:, plen:].cpu()  # [B, T']
        logprobs = torch.stack(sampler.logprobs, 1).cpu() if sampler.logprobs else torch.zeros(b, 0)  # [B, T']
        drawn = torch.stack(sampler.tokens, 1).cpu() if sampler.tokens else torch.zeros(b, 0, dtype=torch.long)  # [B, T']
        topk = torch.stack(sampler.topk_index, 1).cpu() if sampler.topk_index else None  # [B, T', k]
        return [(generated[r], drawn[r], logprobs[r], topk[r] if topk is not None else None) for r in range(b)]

    def _stop_criteria(self, stop: tuple[str, ...]):
        """generate's own StopStringCriteria for `stop` (None without stop strings), built once per set."""
        if not stop:
            return None
        if stop not in self._stops:
            from transformers.generation.stopping_criteria import StopStringCriteria

            self._stops[stop] = StopStringCriteria(self.tokenizer, list(stop))
        return self._stops[stop]

    def _completion(self, tokens: Tensor, drawn: Tensor, logprobs: Tensor, topk: Optional[Tensor],
                    params: SamplingParams) -> Completion:
        """Cut one row at its first end token (kept) or at the token completing a stop string, whichever
        comes first, keeping only tokens the sampler drew.

        tokens [T']: the row as `generate` returned it; drawn [T']: what the sampler drew at each step.
        They agree until the row finished; from then on `generate` fills the row with pad tokens while
        the others go on. With a tokenizer whose pad token is its EOS, a row that stopped on a stop
        string was followed by an "EOS" the policy never sampled; before this cut (an EOS search over
        the whole row came first) that token was kept, trained on and fed back as context by the search
        agent. Now the row never extends past the sampler's own tokens.
        """
        differ = (tokens != drawn).nonzero()  # [m, 1]: steps where generate's token is not the sampler's (padding)
        kept = int(differ[0, 0]) if len(differ) else len(tokens)
        ids = tokens[:kept].tolist()  # every token here was drawn by the sampler
        # a row shorter than max_new_tokens finished on an end token or a stop string (as generate's
        # StopStringCriteria matches it: in special tokens' text too, where the decoded text below has none)
        length, reason = len(ids), "length" if kept >= params.max_new_tokens else "stop"
        ends = [t for t, x in enumerate(ids) if x in self.end_ids]
        if ends:
            length, reason = ends[0] + 1, "stop"
        if params.stop:
            found = self._stop_length(ids[:length], params.stop)
            if found is not None:
                length, reason = found, "stop"
        ids = ids[:length]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = [text.index(s) for s in params.stop if s in text]
        if cut:
            text = text[:min(cut)]
        return Completion(token_ids=ids, text=text, finish_reason=reason, logprobs=logprobs[:length].tolist(),
                          topk_index=topk[:length] if topk is not None else None)

    def _stop_length(self, ids: list[int], stop: tuple[str, ...]) -> Optional[int]:
        """Smallest prefix length whose text contains a stop string (binary search: containment is monotone)."""
        def hit(n: int) -> bool:
            text = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            return any(s in text for s in stop)

        if not hit(len(ids)):
            return None
        return 1 + bisect.bisect_left(range(1, len(ids) + 1), True, key=hit)  # the first n with hit(n)


def _forward_model(model):
    """The module whose forward runs the decode loop: a peft model's base model (its adapters are injected there)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _end_ids_of(tokenizer, generation_config) -> tuple[int, ...]:
    ids = end_token_ids(tokenizer, generation_config)
    if not ids:
        raise ValueError("the tokenizer has no EOS token and the model's generation config names none")
    return ids
