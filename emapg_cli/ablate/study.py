"""Named studies (`presets/ablations/*.yaml`) and the resolved description of a sweep.

A study file names a base preset, the seeds, study-wide overrides, and either named `variants`
(rows of a comparison table, e.g. GRPO vs EMA-PG), a cartesian `grid`, or both (variants x grid):

    description: Top-k head size k of the KL estimator
    preset: toy
    seeds: 3
    set: {kl.estimator: topk}
    grid:
      kl.k: [1, 8, 32, 128, "|V|"]

An optional `analysis:` section (`StudyAnalysis`) adds an analysis to aggregation. `kind: stability` (the default,
`ablate/stability.py`): methods (the variants) x the values of the one grid axis (e.g. the learning rate).
`kind: distill` (`ablate/distill.py`): the variants (distillation estimators) against the teacher, without a grid.
`kind: anchors` (`ablate/anchors.py`): the variants (anchor rules) x the cells of the grid axes, paired comparisons by
seed and by item.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from emapg_cli.ablate.grid import Axis, RunSpec, Variant, check_axes, format_value, plan_runs
from emapg_cli.ablate.measures import Cost, Measures
from emapg_cli.config.loading import is_path_like, preset_dir
from emapg_cli.errors import UserError
from emapg_cli.fileio import read_yaml_mapping

STUDY_FILE = "study.yaml"


#: The settings of each analysis kind (others may not be set; `baseline` and `kind` belong to both).
ANALYSIS_FIELDS = {
    "stability": ("baseline", "collapse_points", "target_gain", "within_points"),
    "distill": ("baseline", "teacher_fraction", "tail_fraction"),
    "anchors": ("baseline", "collapse_points", "tail_fraction"),
}


class StudyAnalysis(BaseModel):
    """The analysis of a study's aggregated runs, one of the kinds registered in ablate/__init__.py (`kind` says what
    each computes; docs/ablate.md "The stability study", "The distillation study", "The anchor study")."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["stability", "distill", "anchors"] = Field("stability", description="Which analysis: `stability` (variants x one grid axis: collapse, steps to +target_gain, tuning sensitivity; stability.md/.json), `distill` (variants against the teacher of a distillation run: gap closed, steps and wall time to teacher_fraction of the teacher's accuracy, entropy and tail mass; distill.md/.json) or `anchors` (anchor rules x the cells of any grid axes: accuracy over training, KL to the initial model, entropy, response length, collapse, paired comparisons with the baseline by seed and by item; anchors.md/.json).")
    baseline: str = Field(description="The variant every other one is compared with (paired differences method - baseline per grid value); must be one of `variants`.")
    collapse_points: float = Field(10.0, gt=0, le=100, description="X: a run collapses when its final eval accuracy is more than X points (X/100 in accuracy) below its own best evaluation, or when it diverged (non-finite weights, too many skipped steps).")
    target_gain: float = Field(0.15, gt=0, le=1, description="Steps to target = the first evaluated step whose eval accuracy is >= the run's initial accuracy + target_gain (accuracy units: 0.15 = 15 points).")
    within_points: float = Field(5.0, ge=0, le=100, description="Tuning sensitivity: the fraction of grid values where a method's mean final accuracy is within this many points of the best method's in that cell.")
    teacher_fraction: float = Field(0.9, gt=0, le=1, description="kind distill: steps to target = the first evaluated step (> 0) whose eval accuracy is >= teacher_fraction x the run's teacher_accuracy (summary.json).")
    tail_fraction: float = Field(0.2, gt=0, le=1, description="kinds distill and anchors: the per-step metrics (distill: the student's distill/entropy, distill/tail_mass, distill/kl, grad/norm; anchors: entropy, rollout/response_len) are averaged over this last fraction of the run's logged steps (0.2: the last 20%).")

    @model_validator(mode="after")
    def _fields_of_kind(self) -> "StudyAnalysis":
        """A setting of the other kind is a mistake (it would be silently ignored)."""
        other = sorted(self.model_fields_set - set(ANALYSIS_FIELDS[self.kind]) - {"kind"})
        if other:
            raise ValueError(f"{', '.join(other)}: not a setting of kind {self.kind} (its settings: {', '.join(ANALYSIS_FIELDS[self.kind])})")
        return self

    @model_serializer(mode="wrap")
    def _dump_its_kind(self, handler) -> dict[str, Any]:
        """Dumped (study.yaml of a sweep folder) with its kind's settings only, so it validates when read back."""
        return {k: v for k, v in handler(self).items() if k == "kind" or k in ANALYSIS_FIELDS[self.kind]}

    def settings(self) -> dict[str, Any]:
        """The settings of its kind (what its report records)."""
        return {k: v for k, v in self.model_dump().items() if k != "kind"}


class StudyFile(BaseModel):
    """The schema of a study YAML file."""

    model_config = ConfigDict(extra="forbid")

    description: str = Field("", description="One line saying what the study compares.")
    preset: Optional[str] = Field(None, description="Base preset of every run (the command's --preset wins).")
    config: Optional[str] = Field(None, description="Optional user config file layered on the preset (the command's --config wins).")
    seeds: int = Field(1, ge=1, description="Seeds per configuration: train.seed = 0..seeds-1 (the command's --seeds wins).")
    set: dict[str, Any] = Field(default_factory=dict, description="Dotted overrides applied to every run.")
    variants: dict[str, dict[str, Any]] = Field(default_factory=dict, description="Named configurations: name -> {dotted key: value}.")
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="Cartesian grid: dotted key -> list of values (`|V|`: vocabulary size; `x2`: twice the key's value without this axis).")
    analysis: Optional[StudyAnalysis] = Field(None, description="Analysis of the aggregated runs: kind stability (variants x the one grid axis) or distill (variants against the teacher, no grid); none by default.")
    measure: Optional[Measures] = Field(None, description="Evaluations of every finished run's final policy and, once, of the initial model (pass@n, distinct answers, forgetting on untrained tasks, the best-constant and format-only baselines; ablate/measures.py). None by default.")
    cost: Optional[Cost] = Field(None, description="Seconds per step and per evaluated sequence measured for this design, so --dry-run estimates its wall time.")


class Sweep(BaseModel):
    """A fully resolved sweep: what `study.yaml` in the output folder records."""

    name: str
    description: str = ""
    preset: Optional[str]
    config: Optional[str] = None
    seeds: int
    set: list[str] = Field(default_factory=list)
    variants: dict[str, dict[str, Any]] = Field(default_factory=dict)
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    analysis: Optional[StudyAnalysis] = None
    measure: Optional[Measures] = None
    cost: Optional[Cost] = None

    @model_validator(mode="after")
    def _analysis_fits(self) -> "Sweep":
        """The checks `build_sweep` makes of `analysis:`, again for a record read back from a sweep folder (an edited
        study.yaml would otherwise reach the stability analysis with a baseline it cannot find)."""
        if self.analysis is not None:
            if self.analysis.baseline not in self.variants:
                raise ValueError(f"analysis.baseline '{self.analysis.baseline}' is not one of its variants")
            if self.analysis.kind == "stability" and len(self.grid) != 1:
                raise ValueError(f"its analysis needs exactly one grid axis, the record has {len(self.grid)}")
            if self.analysis.kind == "distill" and self.grid:
                raise ValueError(f"its distill analysis compares the variants without a grid, the record has {len(self.grid)} axes")
        return self

    @property
    def axes(self) -> list[Axis]:
        return [Axis(k, tuple(v)) for k, v in self.grid.items()]

    @property
    def variant_list(self) -> list[Variant]:
        return [Variant(name, dict(over)) for name, over in self.variants.items()]

    @property
    def columns(self) -> list[str]:
        """The columns that tell configurations apart: `variant` (if any), then every grid key."""
        return (["variant"] if self.variants else []) + list(self.grid)

    def command(self, verb: str, sets: Sequence[str]) -> list[str]:
        """`VERB [--preset P] [--config C] [--set ITEM ...]`: a command on this sweep's base config (train, eval)."""
        base = [*(["--preset", str(self.preset)] if self.preset else []), *(["--config", str(self.config)] if self.config else [])]
        return [verb, *base, *(w for item in sets for w in ("--set", item))]

    def runs(self) -> list[RunSpec]:
        """Every run, validated (UserError before anything starts)."""
        return plan_runs(self.preset, self.config, self.set, self.variant_list, self.axes, list(range(self.seeds)))


def studies_dir() -> Path:
    return preset_dir() / "ablations"


def list_studies() -> list[str]:
    return sorted(p.stem for p in studies_dir().glob("*.yaml"))


def load_study(name: str, preset: Optional[str] = None, generic: bool = False) -> tuple[str, StudyFile]:
    """(name, parsed file) of a named study or a path to a study YAML file. A named study with a design fitted to the
    preset named (a built-in preset, not a file: `presets/ablations/NAME-PRESET.yaml`, e.g. anchors-smol) takes that
    design unless `generic`."""
    fitted = studies_dir() / f"{name}-{preset}.yaml" if preset and not is_path_like(name) and not is_path_like(preset) else None
    if fitted is not None and not generic and fitted.is_file():
        name = fitted.stem
    path = Path(name) if is_path_like(name) else studies_dir() / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown study '{name}' (available: {', '.join(list_studies())})")
    try:
        study = StudyFile.model_validate(read_yaml_mapping(path, "study"))
    except ValidationError as err:
        e = err.errors()[0]
        where, msg = ".".join(str(p) for p in e["loc"]), e["msg"].removeprefix("Value error, ")
        raise UserError(f"study {path}: {where}: {msg}") from None
    return path.stem, study


def build_sweep(
    study: Optional[str],
    preset: Optional[str],
    config: Optional[str],
    grids: list[Axis],
    seeds: Optional[int],
    sets: list[str],
    generic: bool = False,
) -> Sweep:
    """Combine a named study (optional) with the command-line options; the command line wins.

    `--grid` axes are added to the study's grid (replacing an axis with the same key), `--set`
    items come after the study's `set`, `--preset`/`--config`/`--seeds` replace the study's.
    """
    name, file = load_study(study, preset, generic) if study else ("", StudyFile())
    check_axes(grids)
    grid = {k: list(values) for k, values in file.grid.items()}
    for axis in grids:
        grid[axis.key] = list(axis.values)
    base = preset or file.preset
    if not base:
        raise UserError("give --study NAME or --preset NAME (the base preset of every run)")
    if seeds is not None and seeds < 1:
        raise UserError("--seeds must be at least 1")
    if file.analysis is not None:
        if file.analysis.baseline not in file.variants:
            raise UserError(f"study {name}: analysis.baseline '{file.analysis.baseline}' is not one of its variants ({', '.join(file.variants) or 'none'})")
        if file.analysis.kind == "distill" and grid:
            raise UserError(f"study {name}: its distill analysis compares the variants without a grid, but the sweep has "
                            f"{', '.join(grid)}; drop --grid (or give each value its own variant)")
        if file.analysis.kind == "stability" and len(grid) != 1:
            raise UserError(f"study {name}: its analysis compares the variants along one grid axis, but the sweep has {len(grid)} "
                            f"({', '.join(grid) or 'none'}); change the values of the study's axis with --grid {next(iter(file.grid), 'KEY')}=...")
    return Sweep(name=name or Path(base).stem, preset=base, config=config or file.config, seeds=seeds or file.seeds,
                 set=[f"{k}={format_value(v)}" for k, v in file.set.items()] + list(sets), grid=grid,
                 **{k: getattr(file, k) for k in ("description", "variants", "analysis", "measure", "cost")})


def save_sweep(sweep: Sweep, out: Path) -> None:
    """Record the sweep as `study.yaml` in the output folder (what aggregation reads back)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / STUDY_FILE).write_text(yaml.safe_dump(sweep.model_dump(mode="json"), sort_keys=False))


def read_sweep(out: Path) -> Sweep:
    path = out / STUDY_FILE
    if not path.is_file():
        raise UserError(f"{out} is not an ablation folder (no {STUDY_FILE})")
    try:
        return Sweep.model_validate(read_yaml_mapping(path, "sweep record"))
    except ValidationError as err:
        raise UserError(f"{path}: not a valid sweep record ({err.errors()[0]['msg']}); delete the folder to start over") from None


def estimate_wall_s(sweep: Sweep, runs: list[RunSpec], base_done: bool = False) -> Optional[float]:
    """The study's wall time from its `cost:` record (None without one): every run's steps at cost.step_s and its
    evaluated sequences (evaluations of eval_items, and the measurements) at cost.sequence_s, cost.jobs runs at once,
    plus the initial model's measurements unless `base_done`. `runs`: the runs still to do. Reads no data file, so it works before the model and the data are prepared."""
    from emapg_cli.config.loading import load_config

    c, m = sweep.cost, sweep.measure
    if c is None:
        return None
    untrained = len(m.untrained.split(":", 1)[-1].split(",")) * m.untrained_size if m else 0
    sampled = m.per_task * c.tasks * m.n if m else 0
    total = 0.0
    for spec in runs:
        cfg = load_config(sweep.preset, sweep.config, spec.overrides)
        steps, every = cfg.train.steps, cfg.eval.every
        evals = int(cfg.eval.initial) + (len(range(every, steps, every)) if every else 0) + 1
        total += steps * c.step_s + (evals * c.eval_items + sampled + untrained) * c.sequence_s
    base = (2 * c.eval_items + sampled + untrained) * c.sequence_s if m and not base_done else 0.0
    return total / c.jobs + base
