"""`emapg ablate`: run a sweep of `emapg train` runs (a named study or an ad-hoc grid) and aggregate it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from emapg_cli.cli.common import ConfigOpt, PresetOpt, SetOpt, console
from emapg_cli.errors import UserError
from emapg_cli.outputs import claim_folder, config_sha256


def ablate(
    study: Annotated[Optional[str], typer.Option("--study", help="Named study from presets/ablations (paper, topk-k, ema-decay, estimators, stability, distill, anchors) or a path to a study YAML file.")] = None,
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    grid: Annotated[Optional[list[str]], typer.Option("--grid", "-g", help="Grid axis KEY=V1,V2,... (values typed by the config model; `|V|` = the model's vocabulary size; `x2` = twice the key's value without this axis). Repeatable: the sweep is the cartesian product.")] = None,
    seeds: Annotated[Optional[int], typer.Option("--seeds", help="Seeds per configuration (train.seed = 0..N-1); default: the study's, or 1.", min=1)] = None,
    set_: SetOpt = None,
    jobs: Annotated[Optional[int], typer.Option("--jobs", "-j", help="Runs at once (each a subprocess; the CPU threads are split between them). Default: on a CPU machine the cores idle as the sweep starts, at most the runs left; 1 with a GPU or --processes above 1.", min=1)] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Output folder of the sweep (default: ablations/<study>-<preset>, e.g. ablations/paper-toy; ablations/<study> without a preset). Rerunning with the same folder resumes.")] = None,
    processes: Annotated[int, typer.Option("--processes", min=1, help="Processes (GPUs) per run: above 1, each run starts with the launcher (default `accelerate launch --multi_gpu --num_processes N -m emapg_cli train ...`).")] = 1,
    launcher: Annotated[Optional[str], typer.Option("--launcher", help="Command that starts one run, before `train ...`; {processes} is replaced by --processes (e.g. 'torchrun --nproc_per_node {processes} -m emapg_cli').")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate the sweep and print one shell line per run (`emapg train ...`, or the launcher's line with --processes), run nothing.")] = False,
    aggregate_only: Annotated[bool, typer.Option("--aggregate-only", help="Run nothing; rebuild results.csv, summary.md and the plots from the runs on disk (with --study: the study file's `analysis:` replaces the one recorded in the folder).")] = False,
    generic: Annotated[bool, typer.Option("--generic", help="A study with a design fitted to the preset (presets/ablations/STUDY-PRESET.yaml, e.g. anchors-smol, the default of `--study anchors --preset smol`): run the study's generic design instead (anchors on smol: 7 rules x 2 learning rates x 3 seeds, about 35 h on 2 cores).")] = False,
    trust_code: Annotated[bool, typer.Option("--trust-code", help="Run a reward plugin / user environment that the study, preset or --config file names; those named by --set / --grid on this command line always run (docs/reliability.md).")] = False,
) -> None:
    """Sweep `emapg train` over grids x variants x seeds; write results.csv, summary.md and plots (and, for a study
    with `analysis:`, stability.md/.json and the stability heatmaps, distill.md/.json and the distillation plots, or
    anchors.md/.json and the anchor study's plots).

    Finished runs (their folder holds summary.json) are skipped, so rerunning resumes a sweep; a
    run folder made with another config than the run's now is refused (exit 2), never mixed in;
    a failed run is recorded with its error and the sweep goes on.
    """
    from emapg_cli.ablate.aggregate import save_plan
    from emapg_cli.ablate.grid import parse_grid
    from emapg_cli.ablate.runner import launcher as launch_prefix
    from emapg_cli.ablate.runner import check_reuse, run_sweep, shell_command
    from emapg_cli.ablate.study import build_sweep, save_sweep

    if aggregate_only:
        if out is None:
            raise UserError("--aggregate-only needs --out, the folder of the sweep")
        if not out.is_dir():
            raise UserError(f"--aggregate-only: {out} is not a sweep folder")
        with claim_folder(out, "ablate"):
            _report(out, study, preset, generic)
        return
    sweep = build_sweep(study, preset, config, [parse_grid(g) for g in grid or []], seeds, list(set_ or []), generic)
    runs = sweep.runs()  # every combination validated before anything is written or started
    # per preset, so a GPU sweep never lands in the folder (and resumes the runs) of a toy sweep
    out = out or Path("ablations") / (f"{sweep.name}-{Path(sweep.preset).stem}" if sweep.preset and not sweep.name.endswith(Path(sweep.preset).stem) else sweep.name)
    prefix = launch_prefix(processes, launcher)
    flags = _trust_flags(sweep, runs, list(set_ or []), [parse_grid(g) for g in grid or []], trust_code)
    if dry_run:
        for spec in runs:
            typer.echo(shell_command(sweep, spec, out, prefix, flags))
        _estimate(sweep, runs, out, jobs)
        return
    import yaml

    digest = config_sha256(yaml.safe_dump(sweep.model_dump(mode="json"), sort_keys=True))
    with claim_folder(out, "ablate", digest, keep=("runs",)):
        check_reuse(sweep, runs, out)  # never mix runs of another config into this sweep's results
        save_sweep(sweep, out)
        save_plan(out, runs)
        configs = len({r.config_id for r in runs})
        how = "--jobs"
        if jobs is None and sweep.cost is not None:
            jobs, how = sweep.cost.jobs, "the study's cost.jobs"
        if jobs is None:
            from emapg_cli.ablate.runner import auto_jobs, is_finished

            jobs, how = auto_jobs(sum(not is_finished(out, r) for r in runs), processes)
        console.print(f"ablate [bold]{escape(sweep.name)}[/]: {configs} configuration(s) x {sweep.seeds} seed(s) = "
                      f"{len(runs)} runs -> {escape(str(out))}, {jobs} at once ({escape(how)})")
        if sweep.measure is not None:  # the initial model, once for every run (ablate/measures.py)
            from emapg_cli.ablate.measures import measure_base
            from emapg_cli.ablate.runner import child_env

            console.print("measuring the initial model (once for every run): the study's baselines")
            measure_base(sweep, sweep.measure, out, out / "measure.log", child_env(1))
        results = run_sweep(sweep, runs, out, jobs=jobs, prefix=prefix, train_flags=flags)
        counts = {s: sum(r.status == s for r in results) for s in ("done", "skipped", "failed")}
        console.print(f"runs: {counts['done']} done, {counts['skipped']} finished before, {counts['failed']} failed")
        _report(out)
    if counts["failed"]:
        raise typer.Exit(1)


def _estimate(sweep, runs, out: Path, jobs: Optional[int]) -> None:
    """The dry run's last lines, on stderr (stdout stays one shell line per run, for `| sh`): `N runs` and, for a study
    with a `cost:` record, `estimated wall time: …` of the runs still to do (finished ones in --out are not counted)."""
    from emapg_cli.ablate.measures import DONE, MEASURE_DIR
    from emapg_cli.ablate.runner import is_complete
    from emapg_cli.ablate.study import estimate_wall_s

    todo = [r for r in runs if not is_complete(sweep, out, r)]
    typer.echo(f"{len(runs)} runs" + (f" ({len(runs) - len(todo)} finished in {out})" if len(todo) < len(runs) else ""), err=True)
    if sweep.cost is None:
        return
    c = sweep.cost
    if jobs is not None and jobs != c.jobs:
        typer.echo(f"(the estimate assumes {c.jobs} runs at once, as measured: --jobs {jobs} changes it)", err=True)
    seconds = estimate_wall_s(sweep, todo, (out / MEASURE_DIR / "base" / DONE).is_file())
    minutes = round(seconds / 60)
    typer.echo(f"estimated wall time: {minutes // 60} h {minutes % 60:02d} min ({c.jobs} runs at once; {c.step_s:g} s a step, "
               f"{c.sequence_s:g} s an evaluated sequence: {c.measured or 'the study file'})", err=True)


def _trust_flags(sweep, runs, sets: list[str], grids, trust_code: bool) -> list[str]:
    """The trust rule for a sweep (config/trust.py): a plugin of a run runs when this ablate command line named it
    (--set, or a --grid value), else only with --trust-code. Then each run's `train` gets --trust-code (its runs,
    resumed ones too, read their plugins from config files)."""
    from emapg_cli.config.loading import load_config
    from emapg_cli.config.trust import CODE_KEYS, code_refs, named_refs, require_trust

    items = [*sets, *(f"{a.key}={v}" for a in grids if a.key in CODE_KEYS for v in a.values)]
    named: dict[str, set[str]] = {}
    for item in items:
        for key, ref in named_refs([item]).items():
            named.setdefault(key, set()).add(ref)
    needed = False
    for spec in runs:
        refs = code_refs(load_config(sweep.preset, sweep.config, spec.overrides))
        here = {k: v for k, v in refs.items() if v in named.get(k, ())}
        require_trust(refs, here, trust_code, "the study, preset or --config file")
        needed = needed or bool(refs)
    return ["--trust-code"] if needed else []


def _with_study_analysis(sweep, study: Optional[str], preset: Optional[str] = None, generic: bool = False):
    """The recorded sweep with the named study's `analysis:` (--aggregate-only --study), checked against the record's
    variants and grid; unchanged without --study or when the study has none. The folder's study.yaml is not rewritten."""
    if not study:
        return sweep
    from pydantic import ValidationError

    from emapg_cli.ablate.study import Sweep, load_study

    name, file = load_study(study, preset, generic)
    if file.analysis is None:
        return sweep
    try:
        return Sweep.model_validate({**sweep.model_dump(), "analysis": file.analysis.model_dump()})
    except ValidationError as err:
        raise UserError(f"study {name}: its analysis does not fit the sweep in the folder ({err.errors()[0]['msg']})") from None


def _report(out: Path, study: Optional[str] = None, preset: Optional[str] = None, generic: bool = False) -> None:
    """Aggregate the sweep in `out`, draw the plots and print the ranked table (`study`: see _with_study_analysis)."""
    from emapg_cli.ablate import run_analysis
    from emapg_cli.ablate.aggregate import RESULTS_FILE, SUMMARY_FILE, aggregate, one_seed_caveat
    from emapg_cli.ablate.plots import plot_all
    from emapg_cli.stats import format_ci, format_mean_std

    sweep, records, summaries = aggregate(out)
    sweep = _with_study_analysis(sweep, study, preset, generic)
    plots = plot_all(out, summaries, records, sweep.name)
    _print_table(f"{sweep.name}: final eval accuracy in % (mean ± std over seeds, 95% CI)",
                 ["rank", "configuration", "seeds", "final accuracy (%)", "95% CI"],
                 [[str(i), c.label, f"{c.runs}" + (f" (+{c.failed} failed)" if c.failed else ""),
                   format_mean_std(c.stats["eval_accuracy_final"], percent=True), format_ci(c.stats["eval_accuracy_final"], percent=True)]
                  for i, c in enumerate(summaries, 1)])
    caveat = one_seed_caveat(summaries)
    if caveat:
        console.print(f"[yellow]caveat:[/] {escape(caveat)}", highlight=False)
    written = [out / RESULTS_FILE, out / SUMMARY_FILE, *plots]
    if sweep.analysis is not None:  # the study's analysis, by its kind (ablate/__init__.py)
        paths, table = run_analysis(out, sweep, records)
        _print_table(*table)
        written += paths
    console.print("wrote " + ", ".join(str(p) for p in written), markup=False, highlight=False)


def _print_table(title: str, heads: list[str], rows: list[list[str]]) -> None:
    """A rich table of plain text (every title, header and cell is escaped: a name may hold `[`)."""
    from rich.table import Table

    table = Table(title=escape(title))
    for head in heads:
        table.add_column(escape(head))
    for row in rows:
        table.add_row(*map(escape, row))
    console.print(table)
