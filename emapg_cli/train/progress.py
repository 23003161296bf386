"""What `emapg train` shows while it runs: the config in one line, a progress bar whose ETA is
smoothed, the phases of a step timed, and the closing summary as a short table. No torch; rich only."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Optional

#: Weight of the newest step in the step-time average. Steps with an evaluation (every `eval.every`)
#: take several times longer than the others; with 0.1 one such step moves the ETA by ~10% of its
#: excess instead of the whole of it, and the average follows a real change of pace within ~20 steps.
ETA_ALPHA = 0.1


class StepTimer:
    """Exponential moving average of the seconds per step, and the ETA it implies."""

    def __init__(self, alpha: float = ETA_ALPHA):
        self.alpha, self.mean = alpha, None  # type: float, Optional[float]

    def add(self, seconds: float) -> None:
        self.mean = seconds if self.mean is None else self.alpha * seconds + (1 - self.alpha) * self.mean

    def eta(self, remaining: int) -> Optional[float]:
        """Seconds left for `remaining` steps; None before the first step."""
        return None if self.mean is None else self.mean * remaining


class PhaseTimer:
    """Wall seconds of a step's phases: `with timer("passes"): ...` adds the block's time to seconds["passes"]
    (the step's breakdown, see `emapg bench step`); `reset()` starts a new step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def reset(self) -> None:
        self.seconds = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


class TrainProgress:
    """The progress bar of `emapg train` (main process only): steps done, what the last step says (`step_info`),
    elapsed time and the smoothed ETA (evaluation steps included).

    `objective`: train.objective; `held_out`: the held-out accuracy known when the bar starts (the initial
    evaluation; None without an evaluation set); `teacher`: the teacher's accuracy of a distillation run."""

    def __init__(self, steps: int, done: int, show: bool, objective: str = "rl", held_out: Optional[float] = None,
                 teacher: Optional[float] = None):
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

        from emapg_cli.progress import Progress

        self.steps, self.timer = steps, StepTimer()
        self.objective, self.teacher = objective, teacher
        self.held_out = None if held_out is None else (done, held_out)  # (step, accuracy) of the last evaluation
        self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                            TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"), disable=not show)
        self.task = self.bar.add_task("train", total=steps, completed=done, info="", eta=clock(None))

    def __enter__(self) -> "TrainProgress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def advance(self, step: int, metrics: dict[str, Any], seconds: float) -> None:
        """Step `step` finished in `seconds` with `metrics`."""
        if isinstance(metrics.get("eval/accuracy"), (int, float)):
            self.held_out = (step, float(metrics["eval/accuracy"]))
        self.timer.add(seconds)
        self.bar.update(self.task, advance=1, info=step_info(metrics, self.objective, self.held_out, self.teacher),
                        eta=clock(self.timer.eta(self.steps - step)))


def step_info(metrics: dict[str, Any], objective: str = "rl", held_out: Optional[tuple[int, float]] = None,
              teacher: Optional[float] = None) -> str:
    """What a progress line says after a step, short enough that the bar keeps its place at 80 columns: the train
    reward (not for `distill`, which has no verifier: every reward is 0) or the distillation KL, the last held-out
    accuracy and the step it was evaluated at, then the KL to the anchor, or for distillation the teacher's accuracy
    minus the held-out one in points: `reward 0.412  eval 45.2%@10  kl 2.1e-02`,
    `distill kl 3.1e-02  eval 45.2%@100  teacher gap 37.6`. Throughput is in metrics.jsonl and throughput.png."""
    distills = objective != "rl" and "distill/kl" in metrics
    parts = [] if objective == "distill" else [f"reward {metrics['reward/mean']:.3f}"]
    if distills:
        parts.append(f"distill kl {metrics['distill/kl']:.1e}")
    if held_out is not None:
        parts.append(f"eval {100 * held_out[1]:.1f}%@{held_out[0]}")
    if distills and teacher is not None and held_out is not None:
        parts.append(f"teacher gap {100 * (teacher - held_out[1]):.1f}")
    elif not distills:
        parts.append(f"kl {metrics.get('kl/value', 0.0):.1e}")
    return "  ".join(parts)


def clock(seconds: Optional[float]) -> str:
    """1:02:03 / 4:05 style; '-:--' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-:--"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def config_line(cfg) -> str:
    """The run's shape in one line: model, steps, batch, optimizer, KL and anchor, reward, engine."""
    from emapg_cli.config.anchor_rules import describe_decay, describe_rule
    from emapg_cli.paths import expand
    from emapg_cli.train.beta_control import kl_coef_text

    r, k, e = cfg.rollout, cfg.kl, cfg.ema
    kl = f"{kl_coef_text(cfg)} {k.estimator} {k.direction}" + (f" k {k.k}" if k.estimator.startswith(("topk", "truncated", "teacher_support")) else "")
    anchor = "fixed anchor" if e.decay >= 1.0 else f"EMA anchor η {e.decay:g} every {e.update_period}"
    if e.target_distance is not None:
        anchor = f"EMA anchor {describe_decay(e)} every {e.update_period}"
    if cfg.anchor.rule != "ema" or cfg._anchor_from:  # a named rule (config/anchor_rules.py), or a resume that changed it
        anchor = f"anchor {describe_rule(cfg)}"
    if cfg.anchor.source == "teacher":
        anchor = f"teacher anchor {expand(cfg.anchor.path)} ({cfg.anchor.dtype or cfg.model.dtype})"
    if cfg.train.objective != "rl":
        anchor += f", objective {cfg.train.objective}"
    return (f"{cfg.name}: {expand(cfg.model.path)} ({cfg.model.dtype}), {cfg.train.steps} steps x {r.prompts_per_step} prompts"
            f" x {r.n} samples, lr {cfg.optim.lr:g}, KL {kl if k.coef > 0 else 'off'}, {anchor}, reward {r.reward}, engine {r.engine}"
            + (f" at {r.engine_url}" if r.engine_url else "") + f", {eval_sets(cfg)}")


def eval_sets(cfg) -> str:
    """Which set the run evaluates on (data.eval, its paths expanded): `evaluated on /home/u/.cache/emapg/smol/test.jsonl`."""
    from emapg_cli.paths import expand
    from emapg_cli.train.preflight import eval_refs

    refs = [str(expand(ref)) for ref in eval_refs(cfg.data.eval)]
    return f"evaluated on {', '.join(refs)}" if refs else "no evaluation set (data.eval is null)"


def summary_rows(summary: dict[str, Any], run_dir, plots: Optional[tuple[Any, int]] = None,
                 objective: str = "rl", evaluated: str = "") -> list[tuple[str, str]]:
    """The closing table of a run: (label, rounded value) rows (a distillation run: the teacher's accuracy and the gap
    left to it; no train reward when `objective` is `distill`, which has no verifier); `evaluated`: which set the
    accuracy is measured on (`eval_sets`)."""
    rows = [("run", str(run_dir))]
    init, final = summary.get("eval_accuracy_initial"), summary.get("eval_accuracy_final")
    if init is not None and final is not None:
        rows.append(("eval accuracy", f"{100 * init:.1f}% -> {100 * final:.1f}% ({100 * (final - init):+.1f} points)"
                     + (f", {evaluated}" if evaluated else "")))
    teacher = summary.get("teacher_accuracy")
    if teacher is not None:
        gap = f" (gap left {100 * (teacher - final):.1f} points)" if final is not None else ""
        rows.append(("teacher accuracy", f"{100 * teacher:.1f}%{gap}"))
    steps = f"{summary.get('steps')}"
    if summary.get("steps_skipped"):
        steps += f" ({summary['steps_skipped']} skipped: non-finite loss or gradient)"
    rows.append(("steps", steps))
    if summary.get("reward_mean_last") is not None and objective != "distill":
        rows.append(("last train reward", f"{summary['reward_mean_last']:.3f}"))
    rows.append(("wall time", clock(summary.get("wall_time_s"))))
    if plots is not None:
        rows.append(("plots", f"{plots[0]} ({plots[1]} PNGs)"))
    return rows
