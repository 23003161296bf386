"""The trainer's rollout engine: one in its own process (`engines.make_engine` on the live policy), or a rollout
server's (`rollout.engine_url`, engines/remote.py)."""

from __future__ import annotations

from emapg_cli.config.models import Config
from emapg_cli.engines.base import SamplingParams
from emapg_cli.errors import UserError


def make_rollout_engine(cfg: Config, policy, tokenizer, weights_context=None):
    """The configured rollout engine (`engines.make_engine` on the live policy): `hf` samples from the policy module,
    vLLM takes the rollouts' sampling settings (it is imported only when chosen); with rollout.engine_url, the
    rollout server's (`connect_server`).

    `weights_context(model)`: entered around `hf` generation (the strategy's `full_weights`). Both engines
    end responses on the same tokens (`end_token_ids`: the tokenizer's EOS plus the generation config's).
    """
    if cfg.rollout.engine_url is not None:
        return connect_server(cfg, policy, tokenizer)
    return in_process_engine(cfg, policy, tokenizer, weights_context)


def in_process_engine(cfg: Config, model, tokenizer, weights_context=None, backend=None, ends_like=None):
    """`engines.make_engine` in this process on the live `model`: rollout.engine (or `backend`), sized and set as the
    run's rollouts. `ends_like`: the model whose generation config names the end tokens (default `model`)."""
    from emapg_cli.engines import make_engine
    from emapg_cli.engines.base import end_token_ids
    from emapg_cli.models.loading import model_ref

    # a multi-turn environment's contexts grow over turns, up to search.max_context_tokens / rollout.max_context_tokens
    max_len = cfg.search.max_context_tokens if cfg.search.enabled else cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if cfg.rollout.env not in ("single", "search") or cfg.rollout.agent:
        max_len = cfg.rollout.max_context_tokens
    ends = getattr(ends_like if ends_like is not None else model, "generation_config", None)
    return make_engine(
        backend or cfg.rollout.engine, model_ref(cfg.model.path), model=model, tokenizer=tokenizer, seed=cfg.train.seed,
        dtype=cfg.model.dtype, max_model_len=max_len, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        trust_remote_code=cfg.model.trust_remote_code, batch_size=cfg.rollout.hf_batch_size,
        weights_context=weights_context, share_prompts=cfg.train.share_prompts != "never", fast_decode=cfg.rollout.hf_fast_decode,
        # vLLM: the log-prob mode exact for the rollouts' sampling (train/preflight.py refuses the rest)
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        end_token_ids=end_token_ids(tokenizer, ends), lora_rank=cfg.lora.r, lora_sync=cfg.lora.sync,
    )


def connect_server(cfg: Config, policy, tokenizer):
    """The `RemoteEngine` at rollout.engine_url, checked: the protocol (on connect), the model and the tokenizer
    (`check_compatible`), and that rollout.engine names the server's engine (the config's defaults follow it).
    Every refusal is one line."""
    from emapg_cli.engines.remote import RemoteEngine

    engine = RemoteEngine(cfg.rollout.engine_url, timeout_s=cfg.rollout.engine_timeout_s)
    engine.check_compatible(policy, tokenizer)
    if engine.engine_name != cfg.rollout.engine:
        raise UserError(f"rollout server {engine.url} runs the {engine.engine_name} engine but rollout.engine={cfg.rollout.engine}: "
                        f"set rollout.engine={engine.engine_name} (it decides train.old_logprobs=auto and the rollout "
                        "correction's default)")
    r, t = cfg.rollout, cfg.train
    uses = [f"train.{k}={v}" for k, v in (("old_logprobs", t.old_logprobs), ("rollout_correction", t.rollout_correction))
            if (k == "old_logprobs" and v == "engine") or (k == "rollout_correction" and v != "none")]
    if uses and not engine.full_vocab_logprobs(SamplingParams(temperature=r.temperature, top_p=r.top_p)):
        raise UserError(f"{' and '.join(uses)} need the engine's log-probs over the full vocabulary, which the rollout server "
                        f"{engine.url} does not record at rollout.temperature={r.temperature:g}, rollout.top_p={r.top_p:g}: "
                        f"start it with --temperature {r.temperature:g} --top-p {r.top_p:g} (docs/vllm.md)")
    return engine

