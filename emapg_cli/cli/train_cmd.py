"""`emapg train`: GRPO with an EMA anchor and a KL estimator from the library (or --dry-run: the plan only)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from emapg_cli.cli.common import ConfigOpt, PresetOpt, SetOpt, console

OutOpt = Annotated[Optional[Path], typer.Option("--out", "-o", help="Run directory (default: runs/<name>-<timestamp>).")]
ResumeOpt = Annotated[Optional[Path], typer.Option("--resume", help="Continue the run in DIR from its newest intact checkpoint (its config.yaml, plus any --set overrides, validated before anything is written). A finished run is left as it is.")]
TrustCodeOpt = Annotated[bool, typer.Option("--trust-code", help="Run the reward plugin / user environment (rollout.reward, rollout.env = FILE.py:NAME or module:NAME) that a --config file, a preset file or the run's saved config.yaml names; without it only those named by --set on this command line run (docs/reliability.md).")]
AllowMethodChangeOpt = Annotated[bool, typer.Option("--allow-method-change", help="With --resume: continue under another anchor.rule than the run's on purpose. The anchor is then the one the newest checkpoint holds (e.g. an EMA of the policy), not the new rule's start (the initial policy for fixed); the plan and the settings line say so. Without it such a --set is refused.")]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan and a GPU memory estimate without loading weights, then exit.")]
ProcessesOpt = Annotated[Optional[int], typer.Option("--processes", min=1, help="With --dry-run: the number of GPUs the run will be launched on, for the per-device "
                                                     "estimate (train.parallel=fsdp divides weights, gradients, AdamW state and anchor by it). Default: $WORLD_SIZE or 1.")]


def train(preset: PresetOpt = None, config: ConfigOpt = None, set_: SetOpt = None, out: OutOpt = None,
          resume: ResumeOpt = None, dry_run: DryRunOpt = False, processes: ProcessesOpt = None,
          trust_code: TrustCodeOpt = False, allow_method_change: AllowMethodChangeOpt = False) -> None:
    """Train a policy with EMA-anchored GRPO; writes metrics, checkpoints, final weights and summary.json."""
    from emapg_cli.train.preflight import check_train, is_main_process

    launch = check_train(preset, config, set_ or [], out, resume, dry_run, processes, trust_code, allow_method_change,
                         warn=lambda note: console.print(f"[yellow]warning:[/] {escape(note)}", highlight=False, soft_wrap=True))
    if launch.finished is not None:
        if is_main_process():
            console.print(f"{launch.run_dir} is finished ({launch.finished} steps, summary.json): nothing to do; raise "
                          "train.steps with --set to train further", markup=False, highlight=False)
    elif dry_run:  # the plan, then the inputs this machine lacks and the trust a run would need, as warnings
        from emapg_cli.train.plan import load_model_config, make_plan, render_plan
        from emapg_cli.train.preflight import missing_inputs

        n = processes if processes is not None else int(os.environ.get("WORLD_SIZE", "1"))
        console.print(render_plan(make_plan(launch.cfg, load_model_config(launch.cfg.model.path), processes=n)))
        for note in missing_inputs(launch.cfg):
            console.print(f"[yellow]warning:[/] {escape(note)} (needed where the run starts)", highlight=False)
        if launch.trust_problem is not None:  # the plan reads the config only; the run would refuse (exit 2) without the flag
            console.print(f"[yellow]warning:[/] the run will need --trust-code: {escape(launch.trust_problem)}",
                          highlight=False, soft_wrap=True)
    else:
        _run(launch.cfg, launch.run_dir, resume is not None)


def _run(cfg, run_dir: Path, resume: bool) -> None:
    """Claim the run folder, train, and print the summary table."""
    from emapg_cli.config.loading import to_yaml
    from emapg_cli.hf_quiet import quiet_transformers
    from emapg_cli.outputs import claim_folder, config_sha256
    from emapg_cli.train.preflight import is_main_process
    from emapg_cli.train.progress import config_line, eval_sets, summary_rows
    from emapg_cli.train.status import tracked
    from emapg_cli.train.threads import set_torch_threads
    from emapg_cli.train.trainer import Trainer

    quiet_transformers()
    threads_note = set_torch_threads(cfg.train.torch_threads)  # on CPU: how many torch threads, and who chose them (they change the floating-point results)
    # Only the main process owns the folder (the others of a multi-GPU launch write nothing but through it).
    # A folder this command created is removed again only when the run fails before it started (bad input refused
    # before training); once it started (status.json, metrics.jsonl) the folder stays, status.json saying why it ended.
    kept = ("checkpoints", "metrics.jsonl", "status.json")
    claim = (claim_folder(run_dir, "train", config_sha256(to_yaml(cfg)), fresh=not resume, keep=kept)
             if is_main_process() else contextlib.nullcontext(run_dir))
    with claim:
        trainer = Trainer(cfg, run_dir, resume=resume)  # checks every input; loads no weights yet
        if trainer.acc.is_main_process:
            console.print(f"[bold]{'resuming' if resume else 'run'}[/] {escape(str(run_dir))}", highlight=False)
            console.print(escape(config_line(cfg) + threads_note), highlight=False)
        with tracked(run_dir, lambda: trainer.step_done, enabled=is_main_process()) as started:
            trainer.on_started = started  # status.json "running" once the run has loaded everything
            summary = trainer.run()
    if trainer.acc.is_main_process:
        from rich.table import Table

        from emapg_cli.plots.common import PLOTS_DIR
        from emapg_cli.plots.folders import plot_folders

        _, plots_dir, pngs = plot_folders([run_dir], run_dir / PLOTS_DIR)
        table = Table(title="[bold green]done[/]", show_header=False, title_justify="left")
        for label, value in summary_rows(summary, run_dir, (plots_dir, len(pngs)), cfg.train.objective, eval_sets(cfg)):
            table.add_row(label, escape(value))
        console.print(table)
