"""The dry-run plan of a training run: batch shapes, tokens per step and a GPU memory estimate.

`make_plan(cfg, model_config)` is pure: it reads the model's shapes from its config.json (as a
dict, read by `load_model_config` for a local folder) or, for hub ids, from `KNOWN_MODELS`, and
never loads weights. `render_plan(plan)` turns the plan into a rich renderable. The formulas
are listed in `memory_terms` and explained in docs/dry_run.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from emapg_cli.config.models import Config
from emapg_cli.errors import UserError
from emapg_cli.train.beta_control import kl_coef_text
from emapg_cli.train.preflight import eval_refs, launch_problems, load_model_config  # noqa: F401 - load_model_config: re-exported
from emapg_cli.config.anchor_rules import describe_rule

GIB = 2**30

#: Bytes per element of each training dtype.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class ModelShapes:
    """The shapes of a Llama/Qwen2-style decoder (what the parameter and memory counts need)."""

    arch: str  # config.json `model_type`
    hidden: int  # h
    layers: int  # L
    heads: int  # attention heads
    kv_heads: int  # key/value heads (grouped-query attention)
    head_dim: int
    intermediate: int  # I, the SwiGLU width
    vocab: int  # V
    tie_embeddings: bool  # lm_head shares the embedding matrix
    qkv_bias: bool  # q/k/v projections have biases (Qwen2: yes)
    o_bias: bool = False
    mlp_bias: bool = False

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def params_per_layer(self) -> int:
        """q, k, v, o projections (+ biases), the SwiGLU MLP (gate, up, down) and two RMSNorm weights."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        attn = h * q + 2 * h * kv + q * h + self.qkv_bias * (q + 2 * kv) + self.o_bias * h
        mlp = 3 * h * i + self.mlp_bias * (2 * i + h)
        return attn + mlp + 2 * h

    @property
    def n_params(self) -> int:
        """Embedding V*h, L layers, the final norm h, and lm_head V*h unless tied."""
        embed = self.vocab * self.hidden
        return embed + self.layers * self.params_per_layer() + self.hidden + (0 if self.tie_embeddings else embed)

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "ModelShapes":
        """Shapes from a transformers config.json mapping (Llama, Qwen2, Mistral and alikes).

        Raises UserError naming the first missing key. Defaults follow transformers: kv heads =
        heads, head_dim = hidden / heads, tied embeddings (PretrainedConfig's default), Qwen2's
        biased q/k/v projections, Llama's `attention_bias` / `mlp_bias` flags.
        """
        config = config.get("text_config") or config
        arch = str(config.get("model_type", "unknown"))
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            shapes = dict(
                hidden=hidden,
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate=int(config["intermediate_size"]),
                vocab=int(config["vocab_size"]),
            )
        except KeyError as e:
            raise UserError(f"the model's config.json has no {e.args[0]}: cannot size a {arch} model") from None
        attention_bias = bool(config.get("attention_bias", False))
        qwen2 = arch.startswith("qwen2")
        return cls(
            arch=arch,
            **shapes,
            tie_embeddings=bool(config.get("tie_word_embeddings", True)),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(config.get("mlp_bias", False)),
        )


#: Shapes of known hub models, so hub ids plan without network. The numbers are copied from each
#: model's config.json on the Hugging Face Hub (deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B, whose
#: card gives ~1.78B parameters; Qwen/Qwen2.5-3B, 3.09B with tied embeddings).
KNOWN_MODELS: dict[str, ModelShapes] = {
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B": ModelShapes(
        arch="qwen2", hidden=1536, layers=28, heads=12, kv_heads=2, head_dim=128,
        intermediate=8960, vocab=151936, tie_embeddings=False, qkv_bias=True,
    ),
    "Qwen/Qwen2.5-3B": ModelShapes(
        arch="qwen2", hidden=2048, layers=36, heads=16, kv_heads=2, head_dim=128,
        intermediate=11008, vocab=151936, tie_embeddings=True, qkv_bias=True,
    ),
}
KNOWN_MODELS["Qwen/Qwen2.5-3B-Instruct"] = KNOWN_MODELS["Qwen/Qwen2.5-3B"]


@dataclass(frozen=True)
class MemoryTerm:
    """One line of the memory estimate."""

    name: str
    bytes: int
    formula: str
    phase: str  # "state": held all run; "update": during forward/backward; "rollout": generation (vLLM engine, gathered policy)


@dataclass(frozen=True)
class Plan:
    """What a run will do, per RL step and in total, and what it needs in GPU memory (one GPU)."""

    name: str
    model_path: Optional[str]
    model: Optional[ModelShapes]
    model_source: str  # "config.json", "built-in table" or why the model is unknown
    dtype: str
    steps: int
    prompts_per_step: int
    n: int
    responses_per_step: int
    mini_batch_prompts: Optional[int]  # None: train.mini_batch_sequences
    mini_batch_sequences: int  # sequences per optimizer step (all ranks)
    groups_may_span: bool  # train.mini_batch_sequences: a group's rows may fall into two mini-batches
    mini_batches_per_step: int
    micro_batch_size: int
    micro_batches_per_mini_batch: int
    epochs: int
    optimizer_steps_per_rl_step: int
    optimizer_steps_total: int
    ema_updates: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_turns: int
    seq_len: int  # upper bound of prompt + response tokens of one sequence
    tokens_per_step: int  # upper bound: responses_per_step * seq_len
    engine: str
    gradient_checkpointing: bool
    device_memory_bytes: int
    stages: tuple[tuple[int, int, int, bool], ...] = ()  # (first step, last step, response cap, truncated dropped) of each stage
    processes: int = 1  # GPUs the run is launched on
    parallel: str = "single process"  # ddp / fsdp with several processes
    rollout_correction: str = "none"  # train.rollout_correction, with its cap
    memory: tuple[MemoryTerm, ...] = ()
    update_peak_bytes: Optional[int] = None
    rollout_peak_bytes: Optional[int] = None
    max_micro_batch_fit: Optional[int] = None  # largest micro_batch_size whose update peak fits the device
    notes: tuple[str, ...] = field(default_factory=tuple)
    evaluation: str = ""  # how and when the run evaluates (`evaluation_line`)
    kl_coef: str = ""  # an adaptive beta's rule (`beta_control.kl_coef_text`); "" for a fixed beta
    anchor_rule: str = ""  # the anchor and how it moves (config/anchor_rules.describe_rule); "" without an anchor

    @property
    def n_params(self) -> Optional[int]:
        return None if self.model is None else self.model.n_params


def activation_elems_per_token_per_layer(m: ModelShapes) -> int:
    """Elements one decoder layer keeps per token for its backward pass (approximation).

    4h (input and output of both RMSNorms) + 3q + 3kv (q and k before and after the rotary
    embedding, v) + q (attention output, the o_proj input) + 4I (SwiGLU gate, up, act(gate) and
    the product fed to down_proj). Fused attention (SDPA / flash) keeps no [T, T] score matrix;
    its per-row softmax statistics are neglected.
    """
    return 4 * m.hidden + 3 * m.q_dim + 3 * m.kv_dim + m.q_dim + 4 * m.intermediate


def memory_terms(
    m: ModelShapes,
    cfg: Config,
    seq_len: int,
    *,
    micro_batch: int,
    device_memory_bytes: int,
    master_weights: bool,
    processes: int = 1,
) -> list[MemoryTerm]:
    """The memory estimate of one device, term by term, with P parameters, b = micro_batch, T = seq_len.

    With train.parallel=fsdp each rank holds 1/N of the state and FSDP's gathered copies come on top
    (`_state_terms`).

    state (whole run):
      weights          P * 4 with master weights (model.master_weights and a bf16/fp16 model.dtype: the
                       fp32 master weights are the policy's parameters), else P * bytes(dtype)
      AdamW moments    2 * P * 4      exp_avg and exp_avg_sq in fp32 (torch keeps them in the
                                      parameter's dtype: fp32 with master weights; for bf16 parameters
                                      without them this is an upper bound)
      EMA anchor       P * bytes(ema.dtype)  shadow weights (fp32 by default), only when kl.coef > 0
    update (one micro-batch in flight):
      gradients        P * 4 with master weights (accumulated in fp32), else P * bytes(dtype)
      working copy     P * bytes(dtype), master weights held whole (one process, ddp): autocast's
                       model.dtype copies of the weights, kept from a micro-batch's forward to its
                       backward (under fsdp the gathered units are already in model.dtype)
      activations      b*T*(L*h + A) * bytes(dtype) with gradient checkpointing (each layer's input,
                       plus one layer recomputed at a time), b*T*L*A * bytes(dtype) without;
                       A = activation_elems_per_token_per_layer
      attention masks  b*T*T*L * 4 (b*T*T * 4 checkpointed): the float32 [b, 1, T, T] mask each layer saves for
                       its backward: T more elements per token per layer (float32 SmolLM2-135M at T = 1,200:
                       1,200 / A = 1,200 / 11,328 = 10.6% more than its activations, past auto's 10% headroom)
      logits           c*V * (4 n + bytes(dtype) if not fp32) with c = min(chunk, b*T): the fused
                       output layer (kl/fused.py) holds one chunk of fp32 logits (turned into the
                       softmax in place; n = 1), or for the exact estimator n = EXACT_BUFFERS fp32
                       [c, V] tensors (both models' logits and autograd's buffers); chunk =
                       train.logit_chunk, or train.logit_memory_mib / (4 V n) when that is null
      head gradient    V*H * 4: the fp32 buffer the fused layer accumulates dW in before it becomes
                       (or is added to) the output layer's gradient
      top-k extras     b*T*k * (4 + 4 + 8): policy and anchor log-probs on the top-k set (fp32) and
                       its indices (int64), for the topk / topk_paper / truncated estimators
    rollout:
      vLLM engine      gpu_memory_utilization * device memory (weights + KV cache of the engine)
    """
    wb = DTYPE_BYTES[cfg.model.dtype]
    state = _lora_terms(m, cfg) if cfg.lora.r > 0 else _state_terms(m, cfg, master_weights, processes)
    return state + _activation_terms(cfg, m, micro_batch, seq_len, wb, activation_elems_per_token_per_layer(m), device_memory_bytes)


def _lora_terms(m: ModelShapes, cfg: Config) -> list[MemoryTerm]:
    """LoRA: the frozen base in model.dtype; only the fp32 adapters train and are averaged (train/lora.py), so the
    AdamW moments, the anchor and the gradients are adapter-sized."""
    p, wb = m.n_params, DTYPE_BYTES[cfg.model.dtype]
    check_lora_rank(m, cfg.lora.r, cfg.lora.target_modules)
    ap = lora_params(m, cfg.lora.r, cfg.lora.target_modules)
    terms = [
        MemoryTerm("policy weights", p * wb, f"P x {wb} B ({cfg.model.dtype}, frozen base)", "state"),
        MemoryTerm("LoRA adapters", ap * FP32, f"P_lora x 4 B, P_lora = {_count(ap)} (r = {cfg.lora.r})", "state"),
        MemoryTerm("AdamW moments", 2 * ap * FP32, "2 x P_lora x 4 B (adapters only)", "state"),
    ]
    if cfg.derived.loads_anchor:
        terms.append(MemoryTerm("EMA anchor", ap * FP32, "P_lora x 4 B (fp32 adapters only: adapter-sized)", "state"))
    terms.append(MemoryTerm("gradients", ap * FP32, "P_lora x 4 B (adapters only)", "update"))
    return terms + _initial_terms(p, cfg)


def _initial_terms(p: int, cfg: Config) -> list[MemoryTerm]:
    """eval.initial_kl_every: the initial model kl/to_initial scores with (model.path in model.dtype, whole on every rank)."""
    if not cfg.eval.initial_kl_every:
        return []
    wb = DTYPE_BYTES[cfg.model.dtype]
    return [MemoryTerm("initial model", p * wb, f"P x {wb} B ({cfg.model.dtype}, eval.initial_kl_every)", "state")]


def _state_terms(m: ModelShapes, cfg: Config, master_weights: bool, processes: int) -> list[MemoryTerm]:
    """Weights, AdamW moments, anchor, gradients (and the working copy) of full fine-tuning, per rank.

    With train.parallel=fsdp over N = `processes` ranks, weights, AdamW moments, anchor and
    gradients are divided by N (each rank holds 1/N of every tensor), and FSDP's gathered copies
    come on top:
      gathered units   (R + 2 * layer) * bytes(dtype): the root unit (embeddings, output layer,
                       final norm: R = V*h, twice when untied, + h) whole during a pass, plus one
                       decoder layer gathered and the next prefetched
      anchor gathered  P * 4  the whole fp32 anchor during the update, for the exact estimator only
      policy gathered  P * bytes(dtype) in the rollout phase: hf generation and the vLLM weight
                       push gather the whole policy (P * 4 for the fp32 anchor instead when
                       eval.anchor_every evaluates it, one model at a time)
    With ddp (or one process) every rank holds everything.
    """
    from emapg_cli.kl.registry import INFO

    p, wb = m.n_params, DTYPE_BYTES[cfg.model.dtype]
    teacher = cfg.anchor.source == "teacher"  # counted as large as the policy (its own size is not read here)
    adt = (cfg.anchor.dtype or cfg.model.dtype) if teacher else cfg.ema.dtype
    ab = DTYPE_BYTES[adt]  # the anchor's bytes per parameter
    master = master_weights and cfg.model.dtype != "float32"
    pb = FP32 if master else wb  # the policy's parameters (and gradients)
    shards = processes if cfg.train.parallel == "fsdp" else 1
    per = f" / {shards} ranks" if shards > 1 else ""

    def sharded(n: int) -> int:
        return -(-n // shards)  # ceil(n / shards)

    weights = (f"P x 4 B (fp32 master weights; computes in {cfg.model.dtype}){per}" if master
               else f"P x {wb} B ({cfg.model.dtype}){per}")
    terms = [
        MemoryTerm("policy weights", sharded(p * pb), weights, "state"),
        MemoryTerm("AdamW moments", sharded(2 * p * FP32), f"2 x P x 4 B (fp32 exp_avg, exp_avg_sq){per}", "state"),
    ]
    if cfg.derived.loads_anchor:
        terms.append(MemoryTerm("teacher anchor" if teacher else "EMA anchor", sharded(p * ab),
                                f"P x {ab} B ({adt}, {'anchor.source=teacher, policy-sized' if teacher else 'kl.coef > 0'}){per}", "state"))
    if cfg.derived.loads_anchor and cfg.anchor.rule == "bema" and not teacher:
        terms.append(MemoryTerm("BEMA buffers", sharded(2 * p * ab), f"2 x P x {ab} B (theta_0 and BEMA's EMA, {adt}){per}", "state"))
    terms += _initial_terms(p, cfg)
    terms.append(MemoryTerm("gradients", sharded(p * pb), f"P x {pb} B{' (fp32)' if master else ''}{per}", "update"))
    if master and shards == 1:
        terms.append(MemoryTerm("working copy", p * wb, f"P x {wb} B ({cfg.model.dtype} autocast copies of the weights)", "update"))
    if shards > 1:
        root = m.vocab * m.hidden * (1 if m.tie_embeddings else 2) + m.hidden
        terms.append(MemoryTerm("gathered units", (root + 2 * m.params_per_layer()) * wb,
                                f"(root {_count(root)} + 2 layers) x {wb} B (FSDP all-gathers)", "update"))
        if cfg.derived.loads_anchor and INFO[cfg.kl.estimator].full_vocab:
            terms.append(MemoryTerm("anchor gathered", p * ab, f"P x {ab} B (whole {cfg.ema.dtype} anchor; exact KL)", "update"))
        if cfg.derived.loads_anchor and cfg.eval.anchor_every and ab > wb:  # the anchor's turn is the larger one
            terms.append(MemoryTerm("anchor gathered (eval)", p * ab, f"P x {ab} B (whole {cfg.ema.dtype} anchor: generation for "
                                    "eval.anchor_every / weight push; the policy's turn is smaller)", "rollout"))
        else:
            terms.append(MemoryTerm("policy gathered", p * wb, f"P x {wb} B (generation / weight push)", "rollout"))
    return terms


def _activation_terms(cfg: Config, m: "ModelShapes", b: int, t: int, wb: int, a: int, device_memory_bytes: int) -> list[MemoryTerm]:
    """Activations, logits, anchor logits, top-k extras and the vLLM engine (the same with or without LoRA)."""
    from emapg_cli.kl.fused import EXACT_BUFFERS, auto_chunk
    from emapg_cli.kl.registry import INFO

    terms: list[MemoryTerm] = []
    layers = m.layers
    bt, bt_text = b * t, "b x T"  # padded tokens of one micro-batch
    if cfg.train.pack_sequences != "never" or cfg.train.share_prompts != "never":  # both only remove tokens: all b rows at T is the worst case
        bt_text += " (worst case: packing and prompt sharing only remove tokens)"
    if cfg.model.gradient_checkpointing:
        terms.append(MemoryTerm("activations", bt * (layers * m.hidden + a) * wb,
                                f"{bt_text} x (L x h + A) x {wb} B, A = {a} (checkpointed)", "update"))
    else:
        terms.append(MemoryTerm("activations", bt * layers * a * wb, f"{bt_text} x L x A x {wb} B, A = {a}", "update"))
    kept = 1 if cfg.model.gradient_checkpointing else layers  # the layers whose saved tensors are held at once
    terms.append(MemoryTerm("attention masks", bt * t * kept * FP32, f"{bt_text} x T x {'1' if kept == 1 else 'L'} x 4 B "
                            "(each layer's float32 [b, 1, T, T] mask, saved for its backward)", "update"))
    exact = cfg.derived.loads_anchor and INFO[cfg.kl.estimator].full_vocab
    n_buf = EXACT_BUFFERS if exact else 1
    c = min(cfg.train.logit_chunk or auto_chunk(m.vocab, cfg.train.logit_memory_mib, n_buf), bt)
    copy = wb if wb != FP32 else 0
    terms.append(MemoryTerm("logits", c * m.vocab * (n_buf * FP32 + copy),
                            f"c x V x ({n_buf} x 4{f' + {copy}' if copy else ''}) B, c = {c}"
                            f"{' (both models, exact KL)' if exact else ''}", "update"))
    terms.append(MemoryTerm("head gradient", m.vocab * m.hidden * FP32, "V x H x 4 B (fp32 dW of the fused output layer)", "update"))
    if cfg.derived.loads_anchor and INFO[cfg.kl.estimator].uses_topk:
        from emapg_cli.train.settings import capped_k

        k = capped_k(cfg.kl.k, m.vocab)
        terms.append(MemoryTerm("top-k extras", bt * k * (2 * FP32 + INT64), f"{bt_text} x k x (4 + 4 + 8) B, k = {k}",
                                "update"))
    if cfg.rollout.engine == "vllm" and cfg.rollout.engine_url is None:  # a rollout server's engine is not on this device
        share = int(cfg.rollout.gpu_memory_utilization * device_memory_bytes)
        terms.append(MemoryTerm("vLLM engine", share, f"{cfg.rollout.gpu_memory_utilization} x device memory", "rollout"))
    return terms


def _lora_shapes(m: "ModelShapes") -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of a decoder block, by its name."""
    h, q, kv, i = m.hidden, m.q_dim, m.kv_dim, m.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def check_lora_rank(m: "ModelShapes", r: int, targets: list[str]) -> None:
    """UserError when r exceeds min(in, out) of a targeted layer: the rank of A (in -> r) B (r -> out) cannot
    exceed it, so a larger r only adds memory (train/lora.py checks the same on the loaded model)."""
    shapes = _lora_shapes(m)
    dims = [(min(shapes[n]), n) for n in targets if n in shapes]
    if dims and r > min(dims)[0]:
        smallest, name = min(dims)
        raise UserError(f"lora.r = {r} exceeds the smallest dimension of the targeted layers ({name}: "
                        f"{shapes[name][0]} -> {shapes[name][1]}); use lora.r <= {smallest}")


def lora_params(m: "ModelShapes", r: int, targets: list[str]) -> int:
    """Adapter parameters: r x (in + out) per targeted linear layer (A: in -> r, B: r -> out), per decoder layer."""
    shapes = _lora_shapes(m)
    return m.layers * sum(r * (shapes[n][0] + shapes[n][1]) for n in targets if n in shapes)


def largest_fitting_micro_batch(update_peak: Callable[[int], int], device: int, limit: int = 2**20) -> int:
    """The largest b in [0, limit] with update_peak(b) <= device (update_peak grows with b): bisection."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if update_peak(mid) <= device:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fitting_micro_batch(cfg: Config, shapes: ModelShapes, seq_len: int, budget: int, processes: int = 1) -> int:
    """The largest micro-batch in [1, sequences per mini-batch on one rank] whose planned update peak (state +
    update terms at length `seq_len`) is at most `budget` bytes; 1 when none fits (train.micro_batch_size=auto,
    train/auto_batch.py)."""
    per_mini = max(1, cfg.sequences_per_mini_batch // processes)

    def update_peak(b: int) -> int:
        terms = memory_terms(shapes, cfg, seq_len, micro_batch=max(1, b), device_memory_bytes=budget,
                             master_weights=cfg.model.master_weights, processes=processes)
        return sum(t.bytes for t in terms if t.phase in ("state", "update"))

    return max(1, largest_fitting_micro_batch(update_peak, budget, limit=per_mini))


def evaluation_line(cfg: Config) -> str:
    """The dry-run's evaluation row: sampling, the token budget (per turn, within the context, for search runs),
    the sets and when they run."""
    refs, e = eval_refs(cfg.data.eval), cfg.eval
    if not refs:
        return "none (data.eval is null)"
    how = "greedy" if e.temperature == 0 else f"temperature {e.temperature:g}, top_p {e.top_p:g}"
    how += f", {e.n} samples per item" if e.n > 1 else ""
    if cfg.search.enabled:  # the agent runs every turn with eval.max_new_tokens (checked to fit with the prompt)
        budget = (f"<= {e.max_new_tokens:,} tokens per turn, context {cfg.search.max_context_tokens:,} "
                  f"(prompt <= {cfg.data.max_prompt_tokens:,})")
    elif cfg.stages:  # each stage evaluates at its own response cap (train/evaluate.py eval_max_new_tokens)
        budget = f"<= each stage's response cap, at most {e.max_new_tokens:,} tokens"
    else:
        budget = f"<= {e.max_new_tokens:,} tokens"
    sets = ", ".join(refs) + (f" (first {cfg.data.eval_limit:,} items of each source)" if cfg.data.eval_limit else "")
    when = f"at step 0, every {e.every} steps and at the end" if e.every else "at step 0 and at the end"
    per_source = ", eval/accuracy/<source> per source" if len(refs) > 1 else ""
    return f"{how}, {budget}; {sets}; {when}{per_source}"


def stage_spans(cfg: Config) -> tuple[tuple[int, int, int, bool], ...]:
    """(first step, last step, response cap, mask_truncated) of each of `cfg.stages` the run reaches (the last one runs
    on to train.steps; `Config.stage_at` gives each step's settings); () without stages."""
    spans: list[tuple[int, int, int, bool]] = []
    first, steps = 1, cfg.train.steps
    for i, st in enumerate(cfg.stages):
        if first > steps:
            break
        last = steps if i == len(cfg.stages) - 1 else min(first + st.steps - 1, steps)
        s = cfg.stage_at(first)
        spans.append((first, last, s.max_new_tokens, bool(s.mask_truncated)))
        first += st.steps
    return tuple(spans)


def make_plan(
    cfg: Config,
    model_config: Optional[dict[str, Any]] = None,
    *,
    device_memory_gib: float = 80.0,
    master_weights: Optional[bool] = None,
    processes: int = 1,
) -> Plan:
    """The plan of `cfg`'s run; `model_config` is the model's config.json (None: look the path up in KNOWN_MODELS).

    Sequence length T = max_prompt_tokens + max_new_tokens for single-turn runs; for a multi-turn environment its
    context limit, `search.max_context_tokens` or `rollout.max_context_tokens` (prompt, turns and observations together
    never exceed it). Tokens per step = prompts_per_step * n * T.
    Memory is per GPU of `device_memory_gib` (an 80 GiB H100 by default) when the run is launched
    on `processes` GPUs: the whole model on each with ddp, 1/N of it with fsdp (see
    `memory_terms`), and vLLM sleep mode during the update (the engine's share is freed).
    Each rank rolls out and updates prompts_per_step / N prompts.
    `master_weights`: None follows model.master_weights (float32 master weights for a bf16/fp16 model.dtype).
    """
    r, t, d = cfg.rollout, cfg.train, cfg.derived
    if master_weights is None:
        master_weights = cfg.model.master_weights
    seq_len, max_turns, notes = sequence_length(cfg)
    device = int(device_memory_gib * GIB)
    model, source = _model_shapes(cfg, model_config, notes)
    if cfg.train.micro_batch_size == "auto":
        cfg = _auto_micro_batch(cfg, model, seq_len, device, processes, notes)
    t = cfg.train
    per_mini = max(1, cfg.sequences_per_mini_batch // processes)  # sequences per mini-batch on one rank
    notes += [f"{line} (the trainer refuses this)" for line in launch_problems(cfg, processes)]
    plan = dict(
        name=cfg.name, model_path=cfg.model.path, model=model, model_source=source, dtype=cfg.model.dtype,
        steps=t.steps, prompts_per_step=r.prompts_per_step, n=r.n, responses_per_step=d.responses_per_step,
        mini_batch_prompts=t.mini_batch_prompts, mini_batch_sequences=cfg.sequences_per_mini_batch,
        groups_may_span=t.mini_batch_sequences is not None, mini_batches_per_step=d.mini_batches_per_step,
        micro_batch_size=t.micro_batch_size, micro_batches_per_mini_batch=math.ceil(per_mini / t.micro_batch_size),
        epochs=t.epochs, optimizer_steps_per_rl_step=d.optimizer_steps_per_rl_step,
        optimizer_steps_total=t.steps * d.optimizer_steps_per_rl_step, ema_updates=d.ema_updates,
        max_prompt_tokens=cfg.data.max_prompt_tokens, max_new_tokens=r.max_new_tokens, max_turns=max_turns,
        seq_len=seq_len, tokens_per_step=d.responses_per_step * seq_len, engine=r.engine,
        gradient_checkpointing=cfg.model.gradient_checkpointing, device_memory_bytes=device,
        processes=processes, parallel=cfg.train.parallel if processes > 1 else "single process",
        rollout_correction=t.rollout_correction if t.rollout_correction == "none" else f"{t.rollout_correction}, cap {t.rollout_correction_cap:g}",
        evaluation=evaluation_line(cfg),
        stages=stage_spans(cfg),
        kl_coef=kl_coef_text(cfg) if cfg.kl.coef > 0 and cfg.kl.target is not None else "",
        anchor_rule=f"anchor.rule {describe_rule(cfg)}" if cfg.derived.loads_anchor and cfg.anchor.source == "ema" else
        describe_rule(cfg) if cfg.derived.loads_anchor else "",
    )
    if model is None:
        return Plan(**plan, notes=tuple(notes))
    return _memory_plan(plan, cfg, model, seq_len, device, master_weights, processes, notes)


def sequence_length(cfg: Config) -> tuple[int, int, list[str]]:
    """(T, the environment's turn limit, the notes that say how T was set): T = max_prompt_tokens + max_turns *
    max_new_tokens single-turn, search.max_context_tokens for the search agent, rollout.max_context_tokens for
    another multi-turn environment (rollout.env)."""
    from emapg_cli.agents.environments import env_max_turns

    r = cfg.rollout
    max_turns = env_max_turns(r.env, cfg.search.max_turns)
    if cfg.search.enabled:
        return cfg.search.max_context_tokens, max_turns, [
            f"T is search.max_context_tokens: the prompt, {max_turns} + 1 turns of <= {r.max_new_tokens} tokens "
            f"and observations of <= {cfg.search.max_obs_tokens} tokens fit in it"]
    if r.agent is not None:
        return r.max_context_tokens, r.agent_max_calls, [
            f"T is rollout.max_context_tokens: every call of the agent ({r.agent}) fits its prompt and <= "
            f"{r.max_new_tokens} tokens in it; an episode's calls that do not extend one another are extra rows of the batch"]
    if r.env != "single":
        return r.max_context_tokens, max_turns, [
            f"T is rollout.max_context_tokens: the prompt, {max_turns} turns of <= {r.max_new_tokens} tokens "
            f"and the environment's observations ({r.env}) fit in it"]
    return cfg.data.max_prompt_tokens + max_turns * r.max_new_tokens, max_turns, []


def _auto_micro_batch(cfg: Config, model: Optional[ModelShapes], seq_len: int, device: int, processes: int,
                      notes: list[str]) -> Config:
    """`cfg` with train.micro_batch_size=auto as the plan resolves it at the worst-case length T on this device (1
    when the model's shapes are unknown); the run resolves it again as it starts (train/auto_batch.py)."""
    b = 1 if model is None else fitting_micro_batch(cfg, model, seq_len, device, processes)
    notes.append(f"train.micro_batch_size auto: {b} here (the update peak at T = {seq_len:,} within "
                 f"{device / GIB:,.0f} GiB); the run resolves it again from the memory free as it starts and its "
                 "longest training prompt")
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_size": b})})


def _model_shapes(cfg: Config, model_config: Optional[dict[str, Any]], notes: list[str]) -> tuple[Optional[ModelShapes], str]:
    """(shapes, where they came from): the config.json, the built-in table, or None (noted: memory is not estimated)."""
    if model_config is not None:
        return ModelShapes.from_hf_config(model_config), "config.json"
    if cfg.model.path in KNOWN_MODELS:
        return KNOWN_MODELS[cfg.model.path], "built-in table"
    source = "unknown model: pass a local path" if cfg.model.path else "model.path is not set"
    notes.append(f"{source}; memory is not estimated (known hub ids: {', '.join(KNOWN_MODELS)})")
    return None, source


def _rollout_fit(cfg: Config, terms: list[MemoryTerm], state: int, rollout_peak: int, device: int) -> str:
    """The note for a rollout peak above the device: the largest rollout.gpu_memory_utilization, in steps of 0.05,
    whose engine share fits beside the state (the README's advice for `search-qa` on one GPU is this number)."""
    engine = sum(x.bytes for x in terms if x.name == "vLLM engine")
    room = (device - (rollout_peak - engine)) / device  # the share of the device left for the engine
    fits = math.floor(room * 20 + 1e-9) / 20
    if engine == 0 or fits < 0.05:
        return "the rollout peak exceeds the device, and the state alone leaves no room for a rollout engine"
    peak = (rollout_peak - engine + int(fits * device)) / 2**30
    return (f"the rollout peak exceeds the device: rollout.gpu_memory_utilization <= {fits:g} fits "
            f"(rollout peak {peak:.1f} GiB; now {cfg.rollout.gpu_memory_utilization:g})")


def _memory_plan(plan: dict[str, Any], cfg: Config, model: ModelShapes, seq_len: int, device: int, master_weights: bool,
                 processes: int, notes: list[str]) -> Plan:
    """The plan with its memory estimate: terms, update and rollout peaks, the largest micro-batch that fits, notes."""
    r, t, d = cfg.rollout, cfg.train, cfg.derived

    def terms_for(b: int) -> list[MemoryTerm]:
        return memory_terms(model, cfg, seq_len, micro_batch=b, device_memory_bytes=device, master_weights=master_weights,
                            processes=processes)

    terms = terms_for(t.micro_batch_size)
    state = sum(x.bytes for x in terms if x.phase == "state")
    update_peak = state + sum(x.bytes for x in terms if x.phase == "update")
    rollout_peak = state + sum(x.bytes for x in terms if x.phase == "rollout")
    fit = largest_fitting_micro_batch(lambda b: state + sum(x.bytes for x in terms_for(b) if x.phase == "update"), device)
    if update_peak > device:
        notes.append(f"the update peak exceeds the device: micro_batch_size <= {fit} fits (now {t.micro_batch_size})")
    else:
        notes.append(f"the update fits with micro_batch_size up to {fit}")
    if rollout_peak > device:
        notes.append(_rollout_fit(cfg, terms, state, rollout_peak, device))
    if r.engine_url is not None:
        notes.append(f"rollouts on the rollout server at {r.engine_url}: its engine's memory is not on this device "
                     "(the trainer holds its policy and pushes it there after each update)")
    elif r.engine == "vllm":
        kv_per_token = 2 * model.layers * model.kv_dim * DTYPE_BYTES[cfg.model.dtype]
        kv_tokens = max(0, next(x.bytes for x in terms if x.name == "vLLM engine") - model.n_params * DTYPE_BYTES[cfg.model.dtype]) // kv_per_token
        notes.append(
            f"vLLM KV cache: ~{kv_tokens:,} tokens ({kv_per_token:,} B/token), ~{kv_tokens // seq_len:,} "
            f"full-length sequences at once, of {d.responses_per_step // processes:,} per step on each rank"
        )
        notes.append("assumes vLLM sleep mode: the engine's share is freed during the update")
    else:
        notes.append("hf engine: the generation KV cache is not included in the rollout peak")
    if cfg.model.dtype != "float32" and not master_weights and cfg.lora.r == 0:
        notes.append(f"model.master_weights=false: the policy is updated in place in {cfg.model.dtype} (lossy: AdamW steps "
                     "below half an ulp of a weight round away)")
    return Plan(
        **plan, memory=tuple(terms), update_peak_bytes=update_peak, rollout_peak_bytes=rollout_peak,
        max_micro_batch_fit=fit, notes=tuple(notes),
    )


def _gib(n: int) -> str:
    return f"{n / GIB:,.1f}"


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def render_plan(plan: Plan):
    """The plan as a rich renderable: run shape, memory table, totals and notes."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    run = Table(title=f"Plan: {escape(plan.name)}", show_header=False, title_justify="left")
    run.add_column("what", style="bold")
    run.add_column("value")
    model = plan.model_path or "-"
    if plan.model is not None:
        m = plan.model
        model += (f"  ({m.arch}, {_count(plan.n_params)} params from {plan.model_source}: h={m.hidden}, L={m.layers}, "
                  f"heads={m.heads}/{m.kv_heads}, I={m.intermediate}, V={m.vocab}{', tied' if m.tie_embeddings else ''})")
    else:
        model += f"  ({plan.model_source})"
    run.add_row("model", escape(model))
    run.add_row("RL steps", f"{plan.steps:,}  ({f'{plan.ema_updates} EMA' if plan.ema_updates else 'no'} anchor updates)")
    for label, rule in (("anchor", plan.anchor_rule), ("KL coefficient", plan.kl_coef)):  # the anchor rule; adaptive beta
        if rule:
            run.add_row(label, escape(rule))
    run.add_row("rollout per step", f"{plan.prompts_per_step} prompts x {plan.n} responses = {plan.responses_per_step:,} sequences ({plan.engine})")
    run.add_row("rollout correction", f"{plan.rollout_correction} (pi_old / pi_engine on the policy-gradient term)")
    budget = plan.max_prompt_tokens + plan.max_turns * plan.max_new_tokens
    run.add_row("sequence length T", f"<= {plan.seq_len:,} = {plan.max_prompt_tokens:,} prompt + {plan.max_turns} x {plan.max_new_tokens:,} response tokens"
                if plan.seq_len == budget else f"<= {plan.seq_len:,} (the context limit: prompt <= {plan.max_prompt_tokens:,}, "
                f"turns of <= {plan.max_new_tokens:,} tokens and observations)")
    run.add_row("tokens per step", f"<= {plan.tokens_per_step:,}")
    if plan.stages:
        spans = "; ".join(f"steps {a:,}-{b:,}: {n:,} tokens{', truncated dropped' if m else ''}" for a, b, n, m in plan.stages)
        changes = ", ".join(f"{b:,}" for _, b, _, _ in plan.stages[:-1])
        run.add_row("stages", spans + (f" (the response cap changes after steps {changes})" if changes else ""))
    mini = (f"{plan.mini_batch_sequences:,} sequences (groups may span)" if plan.groups_may_span else
            f"{plan.mini_batch_prompts} prompts = {plan.mini_batch_sequences:,} sequences")
    run.add_row("mini-batch", f"{mini}; {plan.mini_batches_per_step} per step x {plan.epochs} epoch(s)")
    run.add_row("micro-batch", f"[{plan.micro_batch_size}, {plan.seq_len:,}] tokens; {plan.micro_batches_per_mini_batch} per mini-batch"
                f" ({'gradient checkpointing' if plan.gradient_checkpointing else 'no checkpointing'})")
    run.add_row("optimizer steps", f"{plan.optimizer_steps_per_rl_step} per RL step, {plan.optimizer_steps_total:,} in total")
    if plan.evaluation:
        run.add_row("evaluation", escape(plan.evaluation))
    if plan.processes > 1:
        run.add_row("processes", f"{plan.processes} ({plan.parallel}); each rolls out {plan.prompts_per_step // plan.processes} prompts per step")
    parts: list = [run]
    if plan.memory:
        where = f"each of {plan.processes} {plan.device_memory_bytes / GIB:.0f} GiB devices" if plan.processes > 1 else \
            f"one {plan.device_memory_bytes / GIB:.0f} GiB device"
        mem = Table(title=f"GPU memory estimate ({plan.dtype}, {where})", title_justify="left")
        mem.add_column("term")
        mem.add_column("phase")
        mem.add_column("GiB", justify="right")
        mem.add_column("formula")
        for term in plan.memory:
            mem.add_row(term.name, term.phase, _gib(term.bytes), escape(term.formula))
        mem.add_section()
        mem.add_row("update peak", "state + update", _gib(plan.update_peak_bytes), "", style="bold")
        mem.add_row("rollout peak", "state + rollout", _gib(plan.rollout_peak_bytes), "", style="bold")
        parts.append(mem)
    parts.extend(Text(f"note: {n}") for n in plan.notes)
    return Group(*parts)
