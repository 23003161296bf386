"""`emapg train`: GRPO with an EMA anchor and a KL estimator from the library (or --dry-run: the plan only)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from emapg_cli.cli.common import ConfigOpt, PresetOpt, SetOpt, console, resolve_config
from emapg_cli.errors import UserError
from emapg_cli.outputs import marker_kind

OutOpt = Annotated[Optional[Path], typer.Option("--out", "-o", help="Run directory (default: runs/<name>-<timestamp>).")]
ResumeOpt = Annotated[
    Optional[Path],
    typer.Option("--resume", help="Continue the run in DIR from its newest intact checkpoint (its config.yaml, plus any --set overrides, validated before anything is written). A finished run is left as it is."),
]
TrustCodeOpt = Annotated[
    bool,
    typer.Option("--trust-code", help="Run the reward plugin / user environment (rollout.reward, rollout.env = FILE.py:NAME or module:NAME) that a --config file, a preset file or the run's saved config.yaml names; without it only those named by --set on this command line run (docs/reliability.md)."),
]
AllowMethodChangeOpt = Annotated[
    bool,
    typer.Option("--allow-method-change", help="With --resume: continue under another anchor.rule than the run's on purpose. The anchor is then the one the newest checkpoint holds (e.g. an EMA of the policy), not the new rule's start (the initial policy for fixed); the plan and the settings line say so. Without it such a --set is refused."),
]
DryRunOpt = Annotated[bool, typer.Option("--dry-run", help="Print the plan and a GPU memory estimate without loading weights, then exit.")]
ProcessesOpt = Annotated[
    Optional[int],
    typer.Option("--processes", min=1, help="With --dry-run: the number of GPUs the run will be launched on, for the per-device "
                 "estimate (train.parallel=fsdp divides weights, gradients, AdamW state and anchor by it). Default: $WORLD_SIZE or 1."),
]


def _resume_config(run_dir: Path, preset: Optional[str], config: Optional[str], overrides: Optional[list[str]],
                   allow_method_change: bool = False):
    if preset or config:
        raise UserError("--resume takes the run's own config.yaml; use --set for changes, not --preset/--config")
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"--resume {run_dir}: no config.yaml there (not a run directory)")
    cfg = resolve_config(None, str(run_dir / "config.yaml"), overrides)
    if overrides:  # a change that adds or drops the anchor cannot continue the saved checkpoints
        saved = resolve_config(None, str(run_dir / "config.yaml"), [])
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
    from operator import attrgetter

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


def _is_main_process() -> bool:
    """Rank 0 of a launch (or a plain single-process run): the process that owns the run folder."""
    return int(os.environ.get("RANK", "0")) == 0


def _eval_set_warning(cfg, items: list[str]) -> list[str]:
    """One line when --set moves data.train and leaves data.eval to the preset or config file: the evaluation (and the
    gain the run reports) stays on their set, not on the new training task."""
    keys = {item.split("=", 1)[0].strip() for item in items}
    if "data.train" not in keys or "data.eval" in keys or not cfg.data.eval:
        return []
    return [f"--set data.train={cfg.data.train} leaves data.eval at {cfg.data.eval}: the run evaluates (and reports its "
            "gain) on that set, not on the new training task; add --set data.eval=... to evaluate on it"]


def train(
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    out: OutOpt = None,
    resume: ResumeOpt = None,
    dry_run: DryRunOpt = False,
    processes: ProcessesOpt = None,
    trust_code: TrustCodeOpt = False,
    allow_method_change: AllowMethodChangeOpt = False,
) -> None:
    """Train a policy with EMA-anchored GRPO; writes metrics, checkpoints, final weights and summary.json."""
    if resume is not None:
        if out is not None and out.resolve() != resume.resolve():
            raise UserError("--resume DIR already names the run directory; drop --out")
        cfg = _resume_config(resume, preset, config, set_, allow_method_change)
        run_dir = resume
        done = _finished_steps(run_dir)
        if done is not None and done >= cfg.train.steps and not dry_run:
            if os.environ.get("RANK", "0") == "0":
                console.print(f"{run_dir} is finished ({done} steps, summary.json): nothing to do; raise train.steps "
                              "with --set to train further", markup=False, highlight=False)
            return
    else:
        cfg = resolve_config(preset, config, set_)
        if out is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise UserError("pass --out DIR when launching several processes (they must share one run directory)")
        run_dir = out or Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        # (the marker only on the main process: it writes it, and the other ranks start a moment later)
        if (run_dir / "checkpoints").exists() or (_is_main_process() and marker_kind(run_dir) == "train"):
            raise UserError(f"{run_dir} already holds a run; use --resume {run_dir} or another --out")
    if allow_method_change and resume is None:
        raise UserError("--allow-method-change applies to --resume (a new run has no method to change)")
    if processes is not None and not dry_run:
        raise UserError("--processes only sizes a --dry-run plan; the launcher (accelerate launch / torchrun) sets the processes of a run")

    from emapg_cli.config.trust import code_refs, load_code, named_refs, untrusted
    from emapg_cli.train.checks import config_checks, config_warnings

    config_checks(cfg)  # optional packages and the reward name: before a plan or any work
    if _is_main_process():  # e.g. a sampled-tail KL estimator under nucleus sampling: its measured bias
        for note in config_warnings(cfg) + _eval_set_warning(cfg, set_ or []):
            console.print(f"[yellow]warning:[/] {escape(note)}", highlight=False, soft_wrap=True)
    # the run's plugins run if this command line named them, or with --trust-code; a dry-run says what the run will need
    refs = code_refs(cfg)
    source = (f"the run's saved {resume / 'config.yaml'}" if resume is not None
              else " or ".join([*([f"--preset {preset}"] if preset else []), *([f"--config {config}"] if config else [])]))
    trust_problem = untrusted(refs, named_refs(set_ or []), trust_code, source)
    if not dry_run:
        if trust_problem is not None:
            raise UserError(trust_problem)
        load_code(refs)  # imported now, before the run folder is claimed: a broken plugin is one line, nothing written
    if not dry_run and cfg.model.path:  # a hub id offline and not cached: one line naming it, before torch loads
        from emapg_cli.models.hub import check_model_source

        check_model_source(cfg.model.path, "model.path")
    if dry_run:
        from emapg_cli.train.checks import missing_inputs
        from emapg_cli.train.plan import load_model_config, make_plan, render_plan

        n = processes if processes is not None else int(os.environ.get("WORLD_SIZE", "1"))
        console.print(render_plan(make_plan(cfg, load_model_config(cfg.model.path), processes=n)))
        for note in missing_inputs(cfg):
            console.print(f"[yellow]warning:[/] {escape(note)} (needed where the run starts)", highlight=False)
        if trust_problem is not None:  # the plan reads the config only; the run would refuse (exit 2) without the flag
            console.print(f"[yellow]warning:[/] the run will need --trust-code: {escape(trust_problem)}", highlight=False,
                          soft_wrap=True)
        return

    from emapg_cli.hf_quiet import quiet_transformers
    from emapg_cli.train.progress import config_line, eval_sets, summary_rows
    from emapg_cli.train.threads import set_torch_threads
    from emapg_cli.train.trainer import Trainer

    quiet_transformers()
    threads_note = set_torch_threads(cfg.train.torch_threads)  # on CPU: how many torch threads, and who chose them (they change the floating-point results)
    from emapg_cli.config.loading import to_yaml
    from emapg_cli.outputs import claim_folder, config_sha256

    # Only the main process owns the folder (the others of a multi-GPU launch write nothing but through it).
    # A folder this command created is removed again only when the run fails before it started (bad input refused
    # before training); once it started (status.json, metrics.jsonl) the folder stays, status.json saying why it ended.
    from emapg_cli.train.status import tracked

    kept = ("checkpoints", "metrics.jsonl", "status.json")
    claim = (claim_folder(run_dir, "train", config_sha256(to_yaml(cfg)), fresh=resume is None, keep=kept)
             if _is_main_process() else contextlib.nullcontext(run_dir))
    with claim:
        trainer = Trainer(cfg, run_dir, resume=resume is not None)  # checks every input; loads no weights yet
        if trainer.acc.is_main_process:
            console.print(f"[bold]{'resuming' if resume is not None else 'run'}[/] {escape(str(run_dir))}", highlight=False)
            console.print(escape(config_line(cfg) + threads_note), highlight=False)
        with tracked(run_dir, lambda: trainer.step_done, enabled=_is_main_process()) as started:
            trainer.on_started = started  # status.json "running" once the run has loaded everything
            summary = trainer.run()
    if trainer.acc.is_main_process:
        from rich.table import Table

        from emapg_cli.plots.folders import plot_folders

        from emapg_cli.plots.common import PLOTS_DIR

        _, plots_dir, pngs = plot_folders([run_dir], run_dir / PLOTS_DIR)
        table = Table(title="[bold green]done[/]", show_header=False, title_justify="left")
        for label, value in summary_rows(summary, run_dir, (plots_dir, len(pngs)), cfg.train.objective, eval_sets(cfg)):
            table.add_row(label, escape(value))
        console.print(table)
