"""The RL loop: rollout -> rewards -> GRPO advantages -> old/anchor passes -> update -> EMA anchor -> log/eval/checkpoint.

Built on `accelerate.Accelerator` (single process, or several with `accelerate launch`); how the
ranks hold the policy and the anchor (replicated with DDP, or sharded with FSDP2) is the
`train.parallel` strategy of train/parallel.py, which the loop calls without branching. Every
source of randomness is seeded per step from (train.seed, step), and a checkpoint holds the full
optimizer/scheduler/anchor state, so a resumed run reproduces an uninterrupted one bit for bit on CPU.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from emapg_cli.config.loading import to_yaml
from emapg_cli.agents.environments import generate
from emapg_cli.config.models import Config
from emapg_cli.engines.base import SamplingParams
from emapg_cli.engines.base import derive_seed
from emapg_cli.errors import UserError
from emapg_cli.grpo import ema_update_, grpo_advantages, informative_groups
from emapg_cli.models.loading import DTYPES, cast_state, compute_dtype, load_tokenizer, set_config_dtype
from emapg_cli.paths import write_text_atomic
from emapg_cli.rewards.shaping import is_truncated
from emapg_cli.train import checkpoint as ckpt
from emapg_cli.train.checks import preflight
from emapg_cli.train.evaluate import evaluate
from emapg_cli.train.loading import load_policy, make_anchor
from emapg_cli.train.metrics import reward_by_source, rollout_mismatch, step_metrics
from emapg_cli.train.parallel import make_strategy
from emapg_cli.train.passes import HALF_PRECISION_LAYOUT_TOL, anchor_inside_loss, check_layouts, engine_topk, needs_old_pass, reference_passes
from emapg_cli.train.progress import StepTimer, clock
from emapg_cli.train.rollout import build_batch, prepare_prompts, schedule, score
from emapg_cli.train.update import NonFiniteWeights, update_policy

#: Offsets that keep the seed streams of rollouts, updates and evaluation apart.
_ROLLOUT, _UPDATE, _EVAL, _FILTER = 1, 2, 3, 4


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_rollout_engine(cfg: Config, policy, tokenizer, weights_context=None):
    """The configured rollout engine; `hf` samples from the live policy module (vLLM is imported only when chosen).

    `weights_context(model)`: entered around `hf` generation (the strategy's `full_weights`). Both engines
    end responses on the same tokens (`end_token_ids`: the tokenizer's EOS plus the generation config's).
    """
    from emapg_cli.engines.base import end_token_ids

    end_ids = end_token_ids(tokenizer, getattr(policy, "generation_config", None))
    if cfg.rollout.engine == "hf":
        from emapg_cli.engines.hf import HFEngine

        return HFEngine(policy, tokenizer, batch_size=cfg.rollout.hf_batch_size, weights_context=weights_context,
                        share_prompts=cfg.train.share_prompts != "never", end_token_ids=end_ids)
    from emapg_cli.engines.vllm import VLLMEngine
    from emapg_cli.models.loading import model_ref

    # a multi-turn environment's contexts grow over turns, up to search.max_context_tokens / rollout.max_context_tokens
    max_len = cfg.search.max_context_tokens if cfg.search.enabled else cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if cfg.rollout.env not in ("single", "search"):
        max_len = cfg.rollout.max_context_tokens
    return VLLMEngine(
        model_ref(cfg.model.path), dtype=cfg.model.dtype, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
        seed=cfg.train.seed, max_model_len=max_len,
        trust_remote_code=cfg.model.trust_remote_code,
        # the log-prob mode exact for the rollouts' sampling (train/checks.py refuses the rest)
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, end_token_ids=end_ids,
    )


def make_env(cfg: Config, tokenizer):
    """The run's environment (rollout.env; agents/environments.py): single-turn, the search agent (its retriever
    probed here, before the models load, so one that is down fails fast) or a user environment."""
    from emapg_cli.agents.environments import make_environment

    r = cfg.rollout
    return make_environment(r.env, tokenizer, search=cfg.search, max_context_tokens=r.max_context_tokens,
                            timeout_s=r.env_timeout_s, probe=True)


def make_scheduler(optimizer, cfg: Config):
    """Linear warm-up over `optim.warmup_ratio` of all optimizer steps, then constant."""
    total = cfg.train.steps * cfg.derived.optimizer_steps_per_rl_step
    warmup = math.ceil(cfg.optim.warmup_ratio * total)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: min(1.0, (i + 1) / warmup) if warmup else 1.0)


def eval_max_new_tokens(cfg: Config, step: int) -> int:
    """The response cap of the evaluation after RL step `step` (0: before training): eval.max_new_tokens, and with
    staged lengths (cfg.stages, single-turn runs) at most the length of that step's stage, as each of the official
    stage scripts validates with its own data.max_response_length."""
    cap = cfg.eval.max_new_tokens
    if cfg.stages and not cfg.search.enabled:
        cap = min(cap, cfg.stage_at(max(step, 1)).max_new_tokens)
    return cap


class Trainer:
    """One training run in `run_dir` (fresh, or resumed from its latest checkpoint)."""

    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False):
        from accelerate import Accelerator

        self.cfg, self.run_dir, self.resume = cfg, Path(run_dir), resume
        self._layouts_checked = False  # pack_sequences, share_prompts: == the padded pass, verified at the first step
        self.acc = Accelerator(cpu=not torch.cuda.is_available())
        world = self.acc.num_processes
        r, t = cfg.rollout, cfg.train
        for name, value in (("rollout.prompts_per_step", r.prompts_per_step), ("train.mini_batch_prompts", t.mini_batch_prompts),
                            ("train.mini_batch_sequences", t.mini_batch_sequences)):
            if value is not None and value % world:
                raise UserError(f"{name} ({value}) must be a multiple of the number of processes ({world})")
        if cfg.train.max_tokens_per_micro_batch is not None and cfg.train.parallel == "fsdp" and world > 1:
            raise UserError("train.max_tokens_per_micro_batch needs the same number of micro-batches on every rank under "
                            "train.parallel=fsdp; use ddp or micro_batch_size")
        if cfg.train.share_prompts == "always" and cfg.train.parallel == "fsdp" and world > 1:
            raise UserError("train.share_prompts=always runs each prompt's layers twice per backward, which train.parallel=fsdp "
                            "on several processes does not support; use auto or never")
        if self.acc.distributed_type.name == "FSDP":
            raise UserError("emapg shards the policy and the anchor itself: launch without accelerate's FSDP config "
                            "(e.g. `accelerate launch --multi_gpu`) and set train.parallel=fsdp (see docs/multi_gpu.md)")
        self.strategy = make_strategy(self.acc, cfg.train.parallel)
        self.phase_s: dict[str, float] = {}  # wall seconds of the current step's phases (`step`)
        self._grader = ThreadPoolExecutor(1, thread_name_prefix="emapg-grading")  # rewards beside the passes
        self.inputs = preflight(cfg)
        self.reward_fn = self.inputs.reward_fn

    # ------------------------------------------------------------------ setup
    def _setup(self) -> int:
        """Load data, models, engine, optimizer; restore the checkpoint when resuming. Returns the last finished step."""
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
        self.env = make_env(cfg, self.tokenizer)
        message = self.env.user_message()
        train_ex, self.train_prompts, self.skipped_train = prepare_prompts(
            self.tokenizer, self.inputs.train, cfg.data.max_prompt_tokens, message)
        if not train_ex:
            raise UserError(f"every training prompt is longer than data.max_prompt_tokens ({cfg.data.max_prompt_tokens})")
        self.train_ex = train_ex
        self.eval_ex, self.eval_prompts, self.skipped_eval = [], [], 0
        if cfg.data.eval:
            ex = self.inputs.eval  # data.eval_limit already applied, per source (train/checks.py)
            self.eval_ex, self.eval_prompts, self.skipped_eval = prepare_prompts(self.tokenizer, ex, cfg.data.max_prompt_tokens, message)
        seed_everything(cfg.train.seed)
        policy = load_policy(cfg.model, cfg.lora)
        vocab = policy.get_output_embeddings().weight.shape[0]
        self.k = min(cfg.kl.k, vocab)
        opt = cfg.optim

        def make_optimizer(params):
            return torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)

        anchor = make_anchor(policy, DTYPES[cfg.ema.dtype]) if cfg.derived.loads_anchor else None
        # float32 master weights (model.master_weights): the optimizer steps the float32 parameters, the
        # passes compute in model.dtype (autocast, or FSDP2's mixed precision)
        self.scorer, self.anchor_scorer, self.optimizer = self.strategy.wrap(policy, anchor, make_optimizer,
                                                                             compute_dtype(cfg.model, cfg.lora))
        self.anchor = self.anchor_scorer.lm if self.anchor_scorer is not None else None
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.state: dict[str, Any] = {"skipped": 0, "elapsed_s": 0.0, "eval_accuracy_initial": None, "skip_window": []}
        last = 0
        if self.resume:
            saved = ckpt.load_checkpoint(self.strategy, self.run_dir, scorer=self.scorer, policy=self.policy,
                                         anchor=self.anchor, optimizer=self.optimizer, scheduler=self.scheduler,
                                         notify=self._warn)
            if saved is not None:
                self.state = {**self.state, **saved}
                last = self.state["step"]
        self.engine = make_rollout_engine(cfg, self.policy, self.tokenizer, weights_context=self._generating)
        # what rollouts and evaluation sample from: the engine, or the environment's episodes on it
        self.generator = self.env.bind(self.engine)
        self._push(self.policy)
        return last

    def _warn(self, line: str) -> None:
        """One line on stderr, from the main process only."""
        if self.acc.is_main_process:
            print(line, file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def _generating(self, model):
        """Around `hf` generation from `model`: its whole weights (`full_weights`), computing in the compute
        dtype when they are float32 master weights (`compute`)."""
        with self.strategy.full_weights(model), self.strategy.compute(model):
            yield

    @property
    def policy(self):
        return self.acc.unwrap_model(self.scorer).lm

    def _push(self, model) -> None:
        """Make the engine sample from `model` (the policy or the anchor). An engine with weights of
        its own (vLLM) is sent whole tensors, gathered first when the model is sharded (every rank
        calls this); `hf` samples from the live module, so nothing is copied."""
        if getattr(self.engine, "shares_weights", False):
            self.engine.load_weights(model)
            return
        with self.strategy.full_weights(model):
            self.engine.load_weights(model)

    # ------------------------------------------------------------------ pieces
    def _eval(self, model, step: int, key: str = "eval/accuracy") -> dict[str, float]:
        """Accuracy of `model` (the policy or the anchor) on the evaluation set: {key: over all items} plus
        {key/<source>: per source} when the set mixes sources. For search runs `eval.max_new_tokens` is the
        budget of each turn (the agent runs every turn with it), as rollout.max_new_tokens is in training."""
        e = self.cfg.eval
        params = SamplingParams(n=e.n, max_new_tokens=eval_max_new_tokens(self.cfg, step), temperature=e.temperature, top_p=e.top_p,
                                stop=tuple(self.cfg.rollout.stop), seed=derive_seed(self.cfg.train.seed, _EVAL, step))
        if model is not self.policy:
            self._push(model)
        scores = evaluate(self.generator, self.eval_prompts, self.eval_ex, self.reward_fn, params, self.acc, self.cfg.reward.truncated)
        if model is not self.policy:
            self._push(self.policy)
        return scores.metrics(key)

    def _generate(self, items: list[int], step: int, stage, round_: int) -> tuple[list, list, list]:
        """Generate this rank's groups for dataset indices `items` (may be empty: every rank calls
        generate, which a sharded engine needs). Returns (prompt ids, completions, their examples)."""
        cfg, acc, r = self.cfg, self.acc, self.cfg.rollout
        prompts = [self.train_prompts[i] for i in items]
        seed = derive_seed(cfg.train.seed, _ROLLOUT, step, acc.process_index, *((round_,) if round_ else ()))
        params = SamplingParams(n=r.n, max_new_tokens=stage.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                                stop=tuple(r.stop), seed=seed, topk=engine_topk(cfg, self.k))
        with self._timed("generation"):
            # engines take their memory back themselves
            groups = generate(self.generator, prompts, params, [self.train_ex[i] for i in items])
        completions = [c for g in groups for c in g]
        examples = [self.train_ex[i] for i in items for _ in range(r.n)]
        return prompts, completions, examples

    def _shaping(self, stage) -> dict:
        """`rewards.shaping.shape_rewards` settings of this stage: the truncation rule and DAPO's overlong penalty."""
        rw = self.cfg.reward
        return dict(truncated=rw.truncated, max_tokens=stage.max_new_tokens, overlong_buffer=rw.overlong_buffer,
                    overlong_penalty_max=rw.overlong_penalty)

    def _global_max(self, value: int) -> int:
        if self.acc.num_processes == 1:
            return value
        return int(self.acc.reduce(torch.tensor(float(value), device=self.acc.device), reduction="max"))

    def _filtered_groups(self, mine: list[int], step: int, stage):
        """DAPO's dynamic sampling (train.filter_groups): groups are graded at once; those whose rewards are all
        equal are dropped and fresh prompts (a seeded draw per extra round) are sampled until this rank has its
        share of prompts_per_step informative groups, or filter_max_rounds extra rounds were spent; then
        uninformative groups fill the rest (advantage 0: only the KL term acts on them).
        Returns (prompt ids, completions, examples, rewards [G_rank, n], reward errors, filter metrics)."""
        cfg, acc = self.cfg, self.acc
        r, t = cfg.rollout, cfg.train
        per_rank = len(mine)

        def graded(items: list[int], round_: int):
            prompts, completions, examples = self._generate(items, step, stage, round_)
            rewards, errors = score(self.reward_fn, completions, examples, shaping=self._shaping(stage))
            rewards = torch.tensor(rewards, dtype=torch.float32).view(len(items), r.n)  # [G, n]
            # each group as (prompt ids, its n completions, its n examples, its rewards [n])
            return [(prompts[g], completions[g * r.n:(g + 1) * r.n], examples[g * r.n:(g + 1) * r.n], rewards[g])
                    for g in range(len(items))], errors

        groups, errors = graded(mine, 0)
        flags = informative_groups(torch.stack([g[3] for g in groups])).tolist()  # [G_rank]
        keep = [g for g, ok in zip(groups, flags) if ok]
        spare = [g for g, ok in zip(groups, flags) if not ok]
        rounds = 0
        while self._global_max(per_rank - len(keep)) > 0 and rounds < t.filter_max_rounds:
            rounds += 1
            need = per_rank - len(keep)
            draw = random.Random(derive_seed(cfg.train.seed, _FILTER, step, rounds, acc.process_index))
            items = draw.sample(range(len(self.train_ex)), min(per_rank, len(self.train_ex))) if need > 0 else []
            more, e2 = graded(items, rounds)
            errors += e2
            if more:
                for g, ok in zip(more, informative_groups(torch.stack([g[3] for g in more])).tolist()):
                    (keep if ok else spare).append(g)
        dropped = len(spare)
        filled = max(0, per_rank - len(keep))
        groups = (keep + spare[:filled])[:per_rank]
        dropped -= filled
        counts = torch.tensor([float(rounds), float(dropped), float(filled)], device=acc.device)
        if acc.num_processes > 1:
            counts = acc.reduce(counts, reduction="sum")
            counts[0] = rounds  # every rank runs the same number of rounds
        filtering = {"rollout/filter_rounds": float(counts[0]), "rollout/filtered_groups": float(counts[1]),
                     "rollout/filter_filled": float(counts[2])}
        return ([g[0] for g in groups], [c for g in groups for c in g[1]], [e for g in groups for e in g[2]],
                torch.stack([g[3] for g in groups]), errors, filtering)

    def _rollout(self, step: int):
        """Generate this rank's groups, start grading them in the background and build the padded batch
        (advantages still zero: `_advantages` fills them). Returns (batch, pending grades, metrics inputs).
        With train.filter_groups the groups are graded before the batch is built (`_filtered_groups`)."""
        cfg, acc = self.cfg, self.acc
        r, t = cfg.rollout, cfg.train
        per_rank = r.prompts_per_step // acc.num_processes
        idx = schedule(len(self.train_ex), r.prompts_per_step, step, cfg.train.seed)
        mine = idx[acc.process_index * per_rank:(acc.process_index + 1) * per_rank]
        stage = cfg.stage_at(step)  # staged response lengths (cfg.stages), else rollout.max_new_tokens
        roll: dict[str, Any] = {}
        if t.filter_groups:
            prompts, completions, examples, rewards, errors, roll["filtering"] = self._filtered_groups(mine, step, stage)
            grading: Future = Future()
            grading.set_result((rewards.reshape(-1).tolist(), errors))
        else:
            prompts, completions, examples = self._generate(mine, step, stage, 0)
            # only the advantages need the rewards: grade while the batch is built and the log-prob passes run
            grading = self._grader.submit(score, self.reward_fn, completions, examples, self._shaping(stage))
        pending = (grading, completions, examples)
        with self._timed("batch"):
            rows_prompts = [p for p in prompts for _ in range(r.n)]
            batch = build_batch(rows_prompts, completions, torch.zeros(len(completions)), self.tokenizer.pad_token_id)
            cut = torch.tensor([is_truncated(c.finish_reason) for c in completions], dtype=torch.bool)  # [B]
            if stage.mask_truncated:  # overlong filtering: truncated rows leave the update (rllm's mask_truncated_samples)
                batch.response_mask[cut] = False  # no token of theirs is scored by the passes or counted in the metrics
                if batch.loss_mask is not None:
                    batch.loss_mask[cut] = False
                batch.keep = ~cut  # [B] ... nor counted as sequences of their mini-batch (update_policy); their rewards still
                # enter their group's GRPO statistics, as rllm drops them after computing the advantages
            batch = batch.with_(**{f: getattr(batch, f).to(acc.device) for f in
                                   ("input_ids", "attention_mask", "response_mask", "advantages", "sampling_logp", "q_index", "loss_mask")
                                   if getattr(batch, f) is not None})
        roll.update(response_lens=[len(c.token_ids) for c in completions], truncated=int(cut.sum()),
                    max_new_tokens=stage.max_new_tokens)
        return batch, pending, roll

    def _advantages(self, batch, pending) -> tuple[Any, Any, int, dict]:
        """Wait for the grades, then GRPO advantages over all ranks' rewards; (batch, all rewards [G, n], reward
        errors, search metrics of this process's episodes)."""
        grading, completions, examples = pending
        cfg, acc = self.cfg, self.acc
        r = cfg.rollout
        per_rank = r.prompts_per_step // acc.num_processes
        with self._timed("reward"):  # only the part of grading that the passes did not hide
            rewards, errors = grading.result()
        local = torch.tensor(rewards, dtype=torch.float32, device=acc.device).view(per_rank, r.n)  # [G_rank, n]
        all_rewards = acc.gather(local) if acc.num_processes > 1 else local  # [G, n]
        adv = grpo_advantages(all_rewards, cfg.train.adv_norm, cfg.train.adv_eps)  # [G, n]
        adv_local = adv[acc.process_index * per_rank:(acc.process_index + 1) * per_rank].reshape(-1)  # [G_rank * n]
        extra: dict[str, float] = {}
        if self.env.multi_turn:  # this process's episodes
            extra = {**self.env.metrics(completions), **reward_by_source(rewards, examples)}
        return batch.with_(advantages=adv_local.to(acc.device).float()), all_rewards.cpu(), errors, extra

    def _passes(self, batch):
        """Old-policy and anchor passes (as the config needs them); records the engine/trainer log-prob mismatch."""
        cfg = self.cfg
        self.engine.release_memory()
        with self._timed("passes"):
            if not self._layouts_checked:  # every rank, at its first step
                scorer = self.acc.unwrap_model(self.scorer)
                # float32 master weights are checked in float32: the layouts must agree to float32 rounding, while bf16
                # passes of different shapes differ by bf16 rounding
                # (lossy bf16 weights, and FSDP's bf16 all-gathers, can only be checked at bf16's tolerance)
                half = cfg.model.dtype != "float32" and (not cfg.model.master_weights or self.strategy.name == "sharded")
                with scorer.float32_passes():
                    check_layouts(scorer, batch, cfg.rollout.temperature, cfg.train.pack_sequences, cfg.train.share_prompts,
                                  tol=HALF_PRECISION_LAYOUT_TOL if half else 1e-4)
                self._layouts_checked = True
            batch = reference_passes(self.acc.unwrap_model(self.scorer), self.anchor_scorer, batch, cfg, self.k)
        if self.anchor is not None:
            self.strategy.forget_forwards(self.anchor)
        # engine vs trainer log-probs of the sampled tokens under the same weights (the update records
        # them itself when the old-policy pass was skipped)
        mask = batch.policy_mask.bool()
        self._logprob_diff = ((batch.old_logp - batch.sampling_logp)[mask]
                              if needs_old_pass(cfg) and batch.old_logp is not None and batch.sampling_logp is not None else None)
        return batch

    def _update(self, step: int, batch) -> Any:
        """The policy update; returns its UpdateStats."""
        cfg = self.cfg
        self.scorer.train()
        gen = torch.Generator().manual_seed(derive_seed(cfg.train.seed, _UPDATE, step))
        try:
            with self.strategy.full_weights(self.anchor) if anchor_inside_loss(cfg) else contextlib.nullcontext(), self._timed("update"):
                stats = update_policy(self.strategy, self.scorer, batch, cfg, self.optimizer, self.scheduler, gen, self.anchor)
        except NonFiniteWeights as e:
            raise UserError(f"step {step}: {e}; stopped before the EMA anchor or a checkpoint could take them (the "
                            "newest checkpoint is unchanged): lower optim.lr or optim.weight_decay, then --resume") from None
        self.scorer.eval()
        if stats.logprob_diffs:
            self._logprob_diff = torch.cat(stats.logprob_diffs)
        return stats

    def _ema(self, step: int, skipped_now: bool) -> Optional[float]:
        """EMA anchor update every ema.update_period steps (not after a skipped update); returns ||theta - theta_ema|| / ||theta||."""
        if self.anchor is None:
            return None
        e = self.cfg.ema
        if step % e.update_period == 0 and not skipped_now:
            ema_update_(self.strategy.ema_tensors(self.anchor), self.strategy.ema_tensors(self.policy), e.decay)
        return self.strategy.ema_distance(self.policy, self.anchor)

    def _check_skips(self, step: int, skipped: int) -> None:
        """Stop (UserError) when more than train.max_skipped_fraction of the optimizer steps of the last
        train.skip_window RL steps were skipped (judged once the window, or the whole run if shorter, is full)."""
        t = self.cfg.train
        window = [*self.state.get("skip_window", []), skipped][-t.skip_window:]  # skipped optimizer steps per RL step
        self.state["skip_window"] = window
        per_step = self.cfg.derived.optimizer_steps_per_rl_step
        if len(window) < min(t.skip_window, t.steps):
            return
        total = len(window) * per_step
        if sum(window) > t.max_skipped_fraction * total:
            raise UserError(f"step {step}: {sum(window)} of the last {total} optimizer steps ({len(window)} RL steps) were skipped "
                            f"for a non-finite loss or gradient, more than train.max_skipped_fraction={t.max_skipped_fraction}: "
                            "stopping (the run is not training; see metrics.jsonl, lower optim.lr or check the data/reward)")

    def _save(self, step: int) -> None:
        ckpt.save_checkpoint(self.strategy, self.run_dir, step, scorer=self.scorer, policy=self.policy, anchor=self.anchor,
                             optimizer=self.optimizer, scheduler=self.scheduler, state=self.state,
                             keep=self.cfg.train.keep_checkpoints)

    def _save_final(self) -> None:
        """final/policy and final/anchor in save_pretrained format (whole weights; gathering is collective), in
        model.save_dtype (default model.dtype, the transformers convention; checkpoints keep the master weights)."""
        dtype = DTYPES[self.cfg.model.save_dtype or self.cfg.model.dtype]
        for name, model in (("policy", self.policy), ("anchor", self.anchor)):
            if model is None:
                continue
            out = self.run_dir / "final" / name
            if self.cfg.lora.r > 0:  # merged weights in save_pretrained format, plus the adapter
                if self.acc.is_main_process:
                    from emapg_cli.train.lora import save_merged

                    save_merged(model, out, self.tokenizer, dtype=dtype)
                continue
            state = self.strategy.model_state(model)
            if self.acc.is_main_process:
                model.save_pretrained(out, state_dict=cast_state(state, dtype))
                set_config_dtype(out, dtype)
                self.tokenizer.save_pretrained(out)
        self.acc.wait_for_everyone()

    @contextlib.contextmanager
    def _timed(self, name: str):
        """Adds the wall time of the block to `phase_s[name]` (the step's breakdown, see `emapg bench step`)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phase_s[name] = self.phase_s.get(name, 0.0) + time.perf_counter() - t0

    def step(self, step: int):
        """One RL step: generation, batch (grading runs in the background), passes, advantages, update, EMA and weight push.

        Returns (rollout metrics inputs, UpdateStats, EMA distance, search metrics); `phase_s` holds its wall-time breakdown:
        generation, batch, passes, reward (waiting for grades the passes did not hide), update, ema, and the
        totals rollout (generation + batch) and update_total (the rest).
        """
        self.phase_s = {}
        seed_everything(derive_seed(self.cfg.train.seed, step, self.acc.process_index))
        with self._timed("rollout"):
            batch, pending, roll = self._rollout(step)
        with self._timed("update_total"):
            batch = self._passes(batch)
            batch, roll["rewards"], roll["reward_errors"], extra = self._advantages(batch, pending)
            extra.update(roll.pop("filtering", {}))
            upd = self._update(step, batch)
            self.state["skipped"] += upd.skipped
            with self._timed("ema"):
                dist = self._ema(step, upd.skipped > 0)
                self._push(self.policy)
        return roll, upd, dist, extra

    def close(self) -> None:
        """Stop the grading thread, the reward's worker pool and the environment (the search agent's retriever)."""
        self._grader.shutdown(wait=True)
        close = getattr(self.reward_fn, "close", None)
        if close is not None:
            close()
        self.env.close()

    # ------------------------------------------------------------------ loop
    def run(self) -> dict[str, Any]:
        """Train to `train.steps`; returns the summary also written to summary.json."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from emapg_cli.train.loggers import NullLogger, make_logger

        cfg, acc = self.cfg, self.acc
        start_time = time.time()
        last = self._setup()  # nothing is written before the data, models and checkpoint loaded
        if acc.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # on resume: the saved config plus any --set, written only now that the checkpoint took it;
            # atomic, as the other ranks may be reading the old one
            write_text_atomic(self.run_dir / "config.yaml", to_yaml(cfg))
        acc.wait_for_everyone()
        elapsed0 = float(self.state.get("elapsed_s", 0.0))
        # On resume, metrics of steps after the checkpoint are dropped (they are logged again); with no
        # checkpoint at all, every row goes (-1), step 0 included.
        resume_step = (last if last > 0 else -1) if self.resume else None
        logger = (make_logger(cfg.logging, self.run_dir, cfg.model_dump(mode="json"), resume_step=resume_step)
                  if acc.is_main_process else NullLogger())
        has_eval = bool(self.eval_prompts)
        if last == 0:  # step 0: the data counts and the initial accuracy
            row = {"data/train_prompts": float(len(self.train_prompts)),
                   "data/skipped_prompts": float(self.skipped_train + self.skipped_eval)}
            if has_eval:
                row.update(self._eval(self.policy, 0))
                self.state["eval_accuracy_initial"] = row["eval/accuracy"]
            logger.log(row, 0)
        self.scorer.eval()
        metrics: dict[str, Any] = {}
        progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                            TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"), disable=not acc.is_main_process)
        timer = StepTimer()  # smoothed seconds per step (evaluation steps included)
        with progress:
            task = progress.add_task("train", total=cfg.train.steps, completed=last, info="", eta=clock(None))
            for step in range(last + 1, cfg.train.steps + 1):
                t0 = time.time()
                roll, upd, dist, extra = self.step(step)
                metrics = step_metrics(**roll, upd=upd, beta=cfg.kl.coef, lr=self.scheduler.get_last_lr()[0],
                                       t_rollout=self.phase_s["rollout"], t_update=self.phase_s["update_total"],
                                       skipped_total=self.state["skipped"], ema_distance=dist)
                metrics.update(rollout_mismatch(self._logprob_diff))  # this process's rollouts
                metrics.update(extra)
                if has_eval and cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
                    metrics.update(self._eval(self.policy, step))
                if has_eval and self.anchor is not None and cfg.eval.anchor_every and step % cfg.eval.anchor_every == 0:
                    metrics.update(self._eval(self.anchor, step, "eval/anchor_accuracy"))
                if step == cfg.train.steps and has_eval:
                    metrics.update(self._eval(self.policy, step))
                    self.state["eval_accuracy_final"] = metrics["eval/accuracy"]
                logger.log(metrics, step)
                self._check_skips(step, upd.skipped)
                self.state["elapsed_s"] = elapsed0 + time.time() - start_time
                if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == cfg.train.steps:
                    self._save(step)
                info = f"reward {metrics['reward/mean']:.3f}  kl {metrics.get('kl/value', 0.0):.2e}  {metrics['throughput/tokens_per_s']:.0f} tok/s"
                timer.add(time.time() - t0)
                progress.update(task, advance=1, info=info, eta=clock(timer.eta(cfg.train.steps - step)))
        self._save_final()
        logger.close()
        self.close()
        summary = {
            "eval_accuracy_initial": self.state.get("eval_accuracy_initial"),
            "eval_accuracy_final": self.state.get("eval_accuracy_final"),
            "steps": cfg.train.steps,
            "wall_time_s": elapsed0 + time.time() - start_time,
            "steps_skipped": self.state["skipped"],
            "reward_mean_last": metrics.get("reward/mean"),
            "prompts_skipped_too_long": self.skipped_train + self.skipped_eval,
        }
        summary["parallel"] = self.strategy.name
        if acc.device.type == "cpu":  # what makes a CPU run's floating-point results (and so the run) reproducible
            summary["torch_threads"] = torch.get_num_threads()
            summary["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        hashes = self.strategy.replica_hashes(self.anchor) if self.anchor is not None else None
        if hashes is not None:  # each rank's copy of the anchor, which must stay identical
            summary["anchor_sha256_per_rank"] = hashes
        if acc.is_main_process:
            write_text_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        acc.wait_for_everyone()
        # Tear the process group down in order, on every rank: a rank that exits with gloo's group still alive can
        # abort in its destructors ("terminate called without an active exception", SIGABRT) and fail the launch.
        acc.end_training()
        return summary
