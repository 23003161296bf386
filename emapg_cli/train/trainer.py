"""The RL loop, read top to bottom in `run`: setup, then each `step` (rollout -> GRPO advantages -> old/anchor passes
-> update -> EMA anchor) followed by evaluate / log / checkpoint, then finish. The pieces sit beside it: rollout_phase.py,
passes.py, update.py, setup.py, bookkeeping.py, checkpoint.py, loggers.py.
Built on `accelerate.Accelerator`; how the ranks hold the policy and the anchor (DDP or FSDP2) is the `train.parallel`
strategy of train/parallel.py, which the loop calls without branching. Every source of randomness is seeded per step
from (train.seed, step), and a checkpoint holds the full optimizer/scheduler/anchor state, so a resumed run reproduces
an uninterrupted one bit for bit on CPU."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch

from emapg_cli.config.models import Config
from emapg_cli.engines.base import derive_seed
from emapg_cli.errors import UserError
from emapg_cli.models.loading import DTYPES, load_tokenizer
from emapg_cli.paths import write_text_atomic
from emapg_cli.train import beta_control, checkpoint as ckpt
from emapg_cli.train.async_rollouts import RolloutPipeline, eval_sampler
from emapg_cli.train.bookkeeping import check_skips, run_summary
from emapg_cli.train.preflight import check_launch, load_model_config, preflight
from emapg_cli.train.distill import initial_evaluations
from emapg_cli.train.engine_setup import in_process_engine, make_rollout_engine
from emapg_cli.train.anchor_rule import anchor_due, anchor_metrics, make_bema, move_anchor
from emapg_cli.train.rollout import reward_failures
from emapg_cli.train.evaluate import eval_params, evaluate, write_items
from emapg_cli.train.initial_kl import initial_kl, make_initial
from emapg_cli.train.loggers import METRICS_FILE, open_run
from emapg_cli.train.metrics import StepResult, reward_by_source, rollout_mismatch, step_metrics
from emapg_cli.train.parallel import make_strategy
from emapg_cli.train.passes import HALF_PRECISION_LAYOUT_TOL, check_layouts, reference_passes
from emapg_cli.train.progress import PhaseTimer, TrainProgress
from emapg_cli.train.rollout_phase import Rollouts, group_advantages
from emapg_cli.train.setup import build_models, run_prompts, seed_everything
from emapg_cli.train.update import NonFiniteWeights, update_policy

#: Offsets that keep the seed streams of updates and evaluation apart (1: rollouts).
_UPDATE, _EVAL = 2, 3


def make_env(cfg: Config, tokenizer):
    """The run's environment (rollout.env; agents/environments.py): single-turn, the search agent (its retriever
    probed here, before the models load, so one that is down fails fast) or a user environment."""
    from emapg_cli.agents.environments import make_environment

    r = cfg.rollout
    return make_environment(r.env, tokenizer, search=cfg.search, max_context_tokens=r.max_context_tokens,
                            timeout_s=r.env_timeout_s, probe=True, agent=cfg.agent_settings())


class Trainer:
    """One training run in `run_dir` (fresh, or resumed from its latest checkpoint)."""

    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False):
        from accelerate import Accelerator

        self.cfg, self.run_dir, self.resume = cfg, Path(run_dir), resume
        self._layouts_checked = False  # pack_sequences, share_prompts: == the padded pass, verified at the first step
        self.acc = Accelerator(cpu=not torch.cuda.is_available())
        check_launch(cfg, self.acc.num_processes, accelerate_fsdp=self.acc.distributed_type.name == "FSDP")
        self.strategy = make_strategy(self.acc, cfg.train.parallel)
        self.phases = PhaseTimer()  # wall seconds of the current step's phases (`step`)
        self._grader = ThreadPoolExecutor(1, thread_name_prefix="emapg-grading")  # rewards beside the passes
        self.inputs = preflight(cfg)
        self.step_done = 0  # the last step whose metrics were logged (status.json)
        self.on_started = lambda: None  # called once the run has loaded everything and opened its metrics
        self.reward_fn = self.inputs.reward_fn

    # ------------------------------------------------------------------ setup
    def setup(self) -> int:
        """Load data, models, engine, optimizer; restore the checkpoint when resuming. Returns the last finished step."""
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
        self.env = make_env(cfg, self.tokenizer)  # before the models load: a retriever that is down fails fast
        message = self.env.user_message()
        self.train_ex, self.train_prompts, self.eval_ex, self.eval_prompts, self.skipped_prompts = run_prompts(
            self.tokenizer, self.inputs, cfg.data.max_prompt_tokens, message, bool(cfg.data.eval), cfg.data.prefix_messages())
        self.cfg = cfg = self._micro_batch(cfg)  # train.micro_batch_size=auto, from the memory plan
        self.scorer, self.anchor_scorer, self.optimizer, self.scheduler, self.settings = build_models(cfg, self.strategy)
        self.anchor = self.anchor_scorer.lm if self.anchor_scorer is not None else None
        self.bema = make_bema(cfg, self.strategy, self.anchor)  # anchor.rule=bema: theta_0 and its EMA (train/anchor_rule.py)
        self.initial = make_initial(cfg, self.acc.device)  # eval.initial_kl_every: the model kl/to_initial compares with
        last = self._resume()
        self.engine = make_rollout_engine(cfg, self.policy, self.tokenizer, weights_context=self._generating)
        self.generator = self.env.bind(self.engine)  # what rollouts and evaluation sample from: the engine, or episodes on it
        self.rollouts = Rollouts(cfg, self.acc, self.generator, self.train_prompts, self.train_ex, self.reward_fn, self._grader,
                                 self.tokenizer.pad_token_id, topk=self.settings.engine_topk if self.engine.records_topk else 0, timed=self.phases)
        self._push(self.policy, last)
        self.pipeline = RolloutPipeline(self.rollouts, self.engine, cfg.rollout.max_staleness, last, cfg.train.steps)
        return last

    def _micro_batch(self, cfg: Config) -> Config:
        """`cfg` with train.micro_batch_size=auto resolved (train/auto_batch.py; said on stderr), else as it is."""
        if cfg.train.micro_batch_size != "auto":
            return cfg
        from emapg_cli.train.auto_batch import resolve
        agree = None
        if self.acc.num_processes > 1:  # every rank runs the same number of micro-batches: the smallest choice
            def agree(b: int) -> int:
                t = torch.tensor([b], device=self.acc.device)
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
                return int(t.item())
        cfg, line = resolve(cfg, load_model_config(cfg.model.path), self.train_prompts, self.acc.device, self.acc.num_processes, agree)
        self._warn(line)
        return cfg

    def _warn(self, line: str) -> None:
        """One line on stderr, from the main process only."""
        if self.acc.is_main_process:
            print(line, file=sys.stderr, flush=True)

    def _resume(self) -> int:
        """The run's counters, from its newest intact checkpoint when resuming; returns the last finished step."""
        self.state: dict[str, Any] = {"skipped": 0, "elapsed_s": 0.0, "eval_accuracy_initial": None, "skip_window": []}
        saved = ckpt.load_checkpoint(self.strategy, self.run_dir, scorer=self.scorer, policy=self.policy, anchor=self.anchor,
                                     optimizer=self.optimizer, scheduler=self.scheduler, notify=self._warn, extra=self.bema) if self.resume else None
        self.state = {**self.state, **(saved or {})}
        return self.state.get("step", 0)

    @contextlib.contextmanager
    def _generating(self, model):
        """Around `hf` generation from `model`: its whole weights (`full_weights`), computing in the compute
        dtype when they are float32 master weights (`compute`)."""
        with self.strategy.full_weights(model), self.strategy.compute(model):
            yield

    @property
    def policy(self):
        return self.acc.unwrap_model(self.scorer).lm

    def _push(self, model, version: int = 0) -> None:
        """Make the engine sample from `model` (the policy or the anchor). An engine with weights of its own (vLLM) is
        sent whole tensors, gathered first when the model is sharded (every rank calls this), a versioned one (a rollout
        server) the policy as `version`; `hf` samples from the live module."""
        if self.engine.shares_weights:
            self.engine.load_weights(model)
            return
        with self.strategy.full_weights(model):
            self.engine.push_weights(model, version) if self.engine.versioned else self.engine.load_weights(model)

    # ------------------------------------------------------------------ pieces
    def _eval(self, model, step: int, key: str = "eval/accuracy") -> dict[str, float]:
        """Accuracy of `model` (the policy or the anchor) on the evaluation set (`eval_params`): {key: over all items}
        plus {key/<source>: per source} when the set mixes sources."""
        params = eval_params(self.cfg, step, seed=derive_seed(self.cfg.train.seed, _EVAL, step))
        local = lambda m: self.env.bind(in_process_engine(self.cfg, m, self.tokenizer, self._generating, "hf", self.policy))  # noqa: E731
        with eval_sampler(model, params, step, policy=self.policy, engine=self.engine, generator=self.generator,
                          pipeline=self.pipeline, push=self._push, local=local) as (generator, params):
            scores = evaluate(generator, self.eval_prompts, self.eval_ex, self.reward_fn, params, self.acc, self.cfg.reward.truncated)
        if key == "eval/accuracy" and self.acc.is_main_process:  # the policy's per-item outcomes: evals/step_<N>.jsonl
            write_items(self.run_dir, step, scores.items)
        return scores.metrics(key)

    def _advantages(self, batch, pending) -> tuple[Any, Any, int, dict]:
        """Wait for the grades, then GRPO advantages over all ranks' rewards; (batch, all rewards [G, n], reward
        errors, search metrics of this process's episodes)."""
        grading, completions, examples = pending
        with self.phases("reward"):  # only the part of grading that the passes did not hide
            rewards, errors = grading.result()
        adv_local, all_rewards = group_advantages(self.acc, rewards, self.cfg.rollout.n, self.cfg.train.adv_norm, self.cfg.train.adv_eps)
        extra: dict[str, float] = {}
        if self.env.multi_turn:  # this process's episodes (an agent's: stops here past reward.max_failure_rate)
            extra = {**self.env.metrics(completions), **reward_by_source(rewards, examples)}
        return batch.with_advantages(adv_local), all_rewards, errors, extra

    def _passes(self, batch):
        """Old-policy and anchor passes (as the config needs them); (batch, engine/trainer log-prob differences or None)."""
        cfg = self.cfg
        self.engine.release_memory()
        with self.phases("passes"):
            if not self._layouts_checked:  # every rank, at its first step
                scorer = self.acc.unwrap_model(self.scorer)
                # float32 master weights are checked in float32: the layouts must agree to float32 rounding, while bf16
                # passes of different shapes differ by bf16 rounding
                # (lossy bf16 weights, and FSDP's bf16 all-gathers, can only be checked at bf16's tolerance)
                half = cfg.model.dtype != "float32" and (not cfg.model.master_weights or self.strategy.name == "sharded")
                with scorer.float32_passes():
                    p = self.settings.passes
                    check_layouts(scorer, batch, p.temperature, p.pack, p.share, tol=HALF_PRECISION_LAYOUT_TOL if half else 1e-4)
                self._layouts_checked = True
            batch = reference_passes(self.acc.unwrap_model(self.scorer), self.anchor_scorer, batch, self.settings)
        if self.anchor is not None:
            self.strategy.forget_forwards(self.anchor)
        # engine vs trainer log-probs of the sampled tokens under the same weights (the update records
        # them itself when the old-policy pass was skipped)
        mask = batch.policy_mask.bool()
        diff = ((batch.old_logp - batch.sampling_logp)[mask]
                if self.settings.old_pass and batch.old_logp is not None and batch.sampling_logp is not None else None)
        return batch, diff

    def _update(self, step: int, batch) -> Any:
        """The policy update; returns its UpdateStats."""
        cfg = self.cfg
        self.scorer.train()
        gen = torch.Generator().manual_seed(derive_seed(cfg.train.seed, _UPDATE, step))
        try:
            with self.strategy.full_weights(self.anchor) if self.settings.anchor_inside_loss else contextlib.nullcontext(), self.phases("update"):
                stats = update_policy(self.strategy, self.scorer, batch, self.settings, self.optimizer, self.scheduler, gen, self.anchor)
        except NonFiniteWeights as e:
            raise UserError(f"step {step}: {e}; stopped before the EMA anchor or a checkpoint could take them (the "
                            "newest checkpoint is unchanged): lower optim.lr or optim.weight_decay, then --resume") from None
        self.scorer.eval()
        return stats

    def _ema(self, step: int, skipped_now: bool) -> Optional[float]:
        """The anchor update of anchor.rule every ema.update_period steps (not after a skipped update: eta does not change
        then either); returns ||theta - theta_ema|| / ||theta||."""
        if self.anchor is None or self.cfg.anchor.source == "teacher":  # a teacher never moves: no EMA step, no distance
            return None
        if anchor_due(self.cfg, step, skipped_now):  # the rule's eta, or BEMA (train/anchor_rule.py); never for fixed
            move_anchor(self.cfg, self.state, step, self.strategy, self.policy, self.anchor, self.bema)
        return self.strategy.ema_distance(self.policy, self.anchor)

    def _controllers(self, step: int, beta: float, metrics: dict[str, Any], trained: int) -> None:
        """After step `step`, whose update trained on `trained` responses (all ranks): the next beta into the state
        (kl.target's adaptive beta, from the KL per token), the eta in force into the metrics."""
        beta_control.update_state(self.cfg, self.state, beta, metrics.get("kl/per_token"), trained)
        if self.anchor is not None and self.cfg.anchor.source == "ema":
            metrics.update(anchor_metrics(self.cfg, self.state, step))

    def step(self, step: int) -> StepResult:
        """One RL step: rollout (grading in the background), passes, advantages, update, EMA and weight push. Returns
        its metrics and wall-time breakdown (`StepResult.phase_s`): generation, batch, passes, reward (the grading the
        passes did not hide), update, ema, and the totals rollout (generation + batch) and update_total (the rest)."""
        self.phases.reset()
        seed_everything(derive_seed(self.cfg.train.seed, step, self.acc.process_index))
        beta, self.settings = beta_control.for_step(self.cfg, self.state, self.settings)  # kl.coef, or kl.target's adaptive beta
        counted = self.reward_fn.start_count() if hasattr(self.reward_fn, "start_count") else None
        with self.phases("rollout"):
            batch, pending, roll = self.pipeline(step)  # k >= 1: also starts step + 1's generation (async_rollouts.py)
        with self.phases("update_total"):
            batch, diff = self._passes(batch)
            batch, roll["rewards"], roll["reward_errors"], extra = self._advantages(batch, pending)
            extra.update(initial_kl(self.initial, self.cfg, step, batch, self.settings, self.acc.unwrap_model(self.scorer)))
            extra.update(reward_failures(self.reward_fn, counted, self.cfg, step, self.acc))  # before the update: a failing plugin stops the run here
            extra.update(roll.pop("pipeline"))  # rollout/staleness, waits (versioned engines)
            upd = self._update(step, batch)
            self.state["skipped"] += upd.skipped
            with self.phases("ema"):
                dist = self._ema(step, upd.skipped > 0)
                self._push(self.policy, step)  # version `step`
        diff = torch.cat(upd.logprob_diffs) if upd.logprob_diffs else diff  # recorded by the update without an old pass
        metrics = step_metrics(**roll, upd=upd, beta=beta, lr=self.scheduler.get_last_lr()[0],
                               t_rollout=self.phases.seconds["rollout"], t_update=self.phases.seconds["update_total"],
                               skipped_total=self.state["skipped"], ema_distance=dist)
        self._controllers(step, beta, metrics, round(upd.kl_seqs / self.cfg.train.epochs))
        metrics.update(rollout_mismatch(diff))  # this process's rollouts
        metrics.update(extra)
        return StepResult(metrics, upd.skipped, dict(self.phases.seconds), sum(roll["response_lens"]))

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
        start_time = time.time()
        last = self.setup()  # nothing is written before the data, models and checkpoint loaded
        logger = self._start(last)
        elapsed0, metrics = float(self.state.get("elapsed_s", 0.0)), {}
        progress = TrainProgress(self.cfg.train.steps, last, show=self.acc.is_main_process, objective=self.cfg.train.objective,
                                 held_out=self.state.get("eval_accuracy_initial") if last == 0 else None,
                                 teacher=self.state.get("teacher_accuracy"))
        with progress, self.pipeline:
            for step in range(last + 1, self.cfg.train.steps + 1):
                t0 = time.time()
                # ---------------------------------------------- rollout, grading, passes, update, EMA anchor
                result = self.step(step)
                metrics = result.metrics
                # ---------------------------------------------- evaluate (policy, anchor; always after the last step)
                metrics.update(self._evaluate(step))
                # ---------------------------------------------- log; stop when the run no longer trains
                logger.log(metrics, step)
                self.step_done = step
                check_skips(self.state, self.cfg, step, result.skipped, metrics_file=self.run_dir / METRICS_FILE)
                # ---------------------------------------------- checkpoint
                self.state["elapsed_s"] = elapsed0 + time.time() - start_time
                self._checkpoint(step)
                progress.advance(step, metrics, time.time() - t0)
        # -------------------------------------------------- finish: final weights, summary
        return self._finish(logger, metrics, started=start_time - elapsed0)

    def _start(self, last: int):
        """The run folder, its config and the metrics logger; at step 0 the data counts and the initial accuracy."""
        logger = open_run(self.cfg, self.run_dir, self.acc, last, self.resume)
        self.step_done = last
        self.on_started()  # status.json: running (the folder is kept from here on)
        if last == 0:
            row = {"data/train_prompts": float(len(self.train_prompts)), "data/skipped_prompts": float(self.skipped_prompts)}
            if self.eval_prompts and self.cfg.eval.initial:
                row.update(initial_evaluations(self._eval, self.policy, self.anchor, self.cfg.train.objective, self.state))
                self.state["eval_accuracy_initial"] = row["eval/accuracy"]
            logger.log(row, 0)
        self.scorer.eval()
        return logger

    def _evaluate(self, step: int) -> dict[str, float]:
        """The evaluations due after step `step`: the policy every eval.every steps and after the last one, the anchor
        every eval.anchor_every steps; {} without an evaluation set."""
        cfg, out = self.cfg, {}
        if not self.eval_prompts:
            return out
        if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
            out.update(self._eval(self.policy, step))
        if self.anchor is not None and cfg.eval.anchor_every and step % cfg.eval.anchor_every == 0:
            out.update(self._eval(self.anchor, step, "eval/anchor_accuracy"))
        if step == cfg.train.steps:
            out.update(self._eval(self.policy, step))
            self.state["eval_accuracy_final"] = out["eval/accuracy"]
        return out

    def _checkpoint(self, step: int) -> None:
        """A checkpoint every train.save_every steps and after the last one (every rank calls this)."""
        t = self.cfg.train
        if (t.save_every and step % t.save_every == 0) or step == t.steps:
            ckpt.save_checkpoint(self.strategy, self.run_dir, step, scorer=self.scorer, policy=self.policy, anchor=self.anchor,
                                 optimizer=self.optimizer, scheduler=self.scheduler, state=self.state, keep=t.keep_checkpoints,
                                 extra=self.bema)

    def _finish(self, logger, metrics: dict[str, Any], started: float) -> dict[str, Any]:
        """Final weights, summary.json (returned; wall time since `started`, earlier sessions included), and the
        process group torn down."""
        cfg, acc = self.cfg, self.acc
        ckpt.save_final(self.strategy, self.run_dir, {"policy": self.policy, "anchor": self.anchor}, self.tokenizer,
                        DTYPES[cfg.model.save_dtype or cfg.model.dtype], lora=cfg.lora.r > 0)
        logger.close()
        self.close()
        summary = run_summary(self.state, cfg.train.steps, time.time() - started, metrics, self.skipped_prompts, self.strategy,
                              self.anchor, acc.device)
        if acc.is_main_process:
            write_text_atomic(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        acc.wait_for_everyone()
        # Tear the process group down in order, on every rank: a rank that exits with gloo's group still alive can
        # abort in its destructors ("terminate called without an active exception", SIGABRT) and fail the launch.
        acc.end_training()
        return summary
