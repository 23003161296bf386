"""A run's book-keeping between steps: the guard against a run that no longer trains, and the closing summary."""

from __future__ import annotations

from typing import Any

import torch

from emapg_cli.errors import UserError


def check_skips(state: dict[str, Any], cfg, step: int, skipped: int, metrics_file: Any = "metrics.jsonl") -> None:
    """Record `skipped` (optimizer steps skipped at RL step `step`) in state["skip_window"]; stop (UserError) when
    more than train.max_skipped_fraction of the optimizer steps of the last train.skip_window RL steps were skipped
    (judged once the window, or the whole run if shorter, is full). `metrics_file`: named in the message (the run keeps it)."""
    t = cfg.train
    window = [*state.get("skip_window", []), skipped][-t.skip_window:]  # skipped optimizer steps per RL step
    state["skip_window"] = window
    per_step = cfg.derived.optimizer_steps_per_rl_step
    if len(window) < min(t.skip_window, t.steps):
        return
    total = len(window) * per_step
    if sum(window) > t.max_skipped_fraction * total:
        raise UserError(f"step {step}: {sum(window)} of the last {total} optimizer steps ({len(window)} RL steps) were skipped "
                        f"for a non-finite loss or gradient, more than train.max_skipped_fraction={t.max_skipped_fraction}: "
                        f"stopping (the run is not training; see {metrics_file}, lower optim.lr or check the data/reward)")


def run_summary(state: dict[str, Any], steps: int, wall_time_s: float, last_metrics: dict[str, Any], skipped_prompts: int,
                strategy, anchor, device: torch.device) -> dict[str, Any]:
    """summary.json: accuracies before and after, steps, wall time, skipped steps and prompts, the last reward, the
    parallel strategy; on CPU what makes its floating-point results reproducible; each rank's anchor hash; a teacher
    anchor's path and fingerprint."""
    summary = {
        "eval_accuracy_initial": state.get("eval_accuracy_initial"),
        "eval_accuracy_final": state.get("eval_accuracy_final"),
        "steps": steps,
        "wall_time_s": wall_time_s,
        "steps_skipped": state["skipped"],
        "reward_mean_last": last_metrics.get("reward/mean"),
        "prompts_skipped_too_long": skipped_prompts,
    }
    if state.get("teacher_accuracy") is not None:  # train.objective distill / rl+distill: the teacher's, at step 0
        summary["teacher_accuracy"] = state["teacher_accuracy"]
    summary["parallel"] = strategy.name
    if device.type == "cpu":  # what makes a CPU run's floating-point results (and so the run) reproducible
        summary["torch_threads"] = torch.get_num_threads()
        summary["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    from emapg_cli.train.teacher import teacher_record

    if teacher_record(anchor) is not None:  # anchor.source=teacher: not saved in final/, named here
        summary["teacher"] = teacher_record(anchor)
    hashes = strategy.replica_hashes(anchor) if anchor is not None else None
    if hashes is not None:  # each rank's copy of the anchor, which must stay identical
        summary["anchor_sha256_per_rank"] = hashes
    return summary
