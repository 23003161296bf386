"""Grid axes and variants -> the list of runs of a sweep, each validated as a Config before anything starts.

A sweep is (named variants) x (cartesian product of grid axes) x seeds. Every run is an ordinary
`emapg train` run described by `--set` overrides on one base preset (+ optional config file).
Grid values are written like `--set` values (parsed as YAML, then typed and checked by the config
model); the special value `|V|` stands for the policy model's vocabulary size, read from the
model's `config.json`.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from emapg_cli.config import Config, load_config
from emapg_cli.config.loading import split_key_value
from emapg_cli.errors import UserError
from emapg_cli.paths import expand

#: Grid value meaning "the vocabulary size of the policy model" (e.g. `kl.k=|V|`: exact KL head).
VOCAB = "|V|"
SEED_KEY = "train.seed"


@dataclass(frozen=True)
class Axis:
    """One grid key and the values it takes (raw: YAML-parsed, possibly the VOCAB marker)."""

    key: str
    values: tuple[Any, ...]


@dataclass(frozen=True)
class Variant:
    """A named configuration: dotted key -> raw value overrides (the `paper` study's rows)."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunSpec:
    """One run of the sweep.

    `values` holds the typed value of every grid key (as the config model resolved it) and, for
    studies with variants, the variant name under "variant"; `overrides` are the `--set` items
    of the run (study-wide ones, the combination's, then the seed).
    """

    config_id: str
    seed: int
    values: dict[str, Any]
    overrides: tuple[str, ...]

    @property
    def run_id(self) -> str:
        return f"{self.config_id}/seed{self.seed}"


def format_value(value: Any) -> str:
    """A value as `--set` text that parses back (YAML) to the same value: 0.9 -> '0.9', [0.5, 2] -> '[0.5, 2]'."""
    if isinstance(value, str):
        try:
            if yaml.safe_load(value) == value:
                return value
        except yaml.YAMLError:
            pass
    return json.dumps(value)


def parse_value(raw: str) -> Any:
    """One grid value as typed on the command line: the VOCAB marker, or YAML (so 8 is an int)."""
    raw = raw.strip()
    if raw == VOCAB:
        return VOCAB
    try:
        return yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets, so `kl.iw_clip=[0.5,2],[0.8,1.25]` has two values."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def parse_grid(item: str) -> Axis:
    """`KEY=V1,V2,...` -> Axis(KEY, (V1, V2, ...)); an empty or repeated value is a UserError."""
    key, raw = split_key_value(item, "grid", "KEY=V1,V2,..., e.g. kl.k=8,32")
    tokens = _split_top_level(raw)
    if any(not t.strip() for t in tokens):
        raise UserError(f"grid '{item}' has an empty value")
    axis = Axis(key, tuple(parse_value(t) for t in tokens))
    check_axes([axis])
    return axis


def check_axes(axes: list[Axis]) -> None:
    """Each grid key at most once, never train.seed (seeds are `--seeds`), with at least one value and no value twice."""
    seen: set[str] = set()
    for axis in axes:
        if axis.key == SEED_KEY:
            raise UserError("do not grid over train.seed; use --seeds N (runs take train.seed = 0..N-1)")
        if axis.key in seen:
            raise UserError(f"grid key '{axis.key}' is given twice; list all its values in one --grid")
        if not axis.values:
            raise UserError(f"grid key '{axis.key}' has no values (the sweep would have no runs)")
        if len({format_value(v) for v in axis.values}) != len(axis.values):
            raise UserError(f"grid key '{axis.key}' repeats a value")
        seen.add(axis.key)


def combinations(variants: list[Variant], axes: list[Axis]) -> list[tuple[Optional[str], dict[str, Any]]]:
    """The cartesian product variants x axis values, in order: [(variant name or None, {key: raw value})].

    Grid values override a variant's value for the same key.
    """
    rows = variants or [None]
    out = []
    for variant in rows:
        for combo in itertools.product(*(a.values for a in axes)):
            merged = dict(variant.overrides) if variant else {}
            merged.update({a.key: v for a, v in zip(axes, combo)})
            out.append((variant.name if variant else None, merged))
    return out


def lookup(cfg: Config, key: str) -> Any:
    """The typed value of dotted `key` in a resolved config (JSON-friendly: tuples become lists)."""
    node: Any = cfg.model_dump(mode="json")
    for part in key.split("."):
        node = node[part]
    return node


def vocab_size(model_path: Optional[str]) -> int:
    """The vocabulary size in a local model directory's `config.json` (what `|V|` resolves to)."""
    if not model_path:
        raise UserError(f"{VOCAB} needs model.path to be set (the vocabulary size is read from the model's config.json)")
    path = expand(model_path) / "config.json"
    if not path.is_file():
        raise UserError(f"{VOCAB}: no config.json in model.path {expand(model_path)} (prepare the model first, e.g. `emapg prepare`)")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{VOCAB}: cannot read {path}: {e}") from None
    size = data.get("vocab_size") or (data.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or size < 1:
        raise UserError(f"{VOCAB}: {path} has no integer vocab_size")
    return size


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "-", text).strip("-") or "x"


def config_id(variant: Optional[str], values: dict[str, Any], axes: list[Axis]) -> str:
    """Directory-safe name of one configuration: `ema-pg`, `kl.k=8_ema.decay=0.9`, `grpo_kl.k=8`."""
    parts = [_slug(variant)] if variant else []
    parts += [_slug(f"{a.key}={format_value(values[a.key])}") for a in axes]
    return "_".join(parts) or "base"


def plan_runs(
    preset: Optional[str],
    config_file: Optional[str],
    sets: list[str],
    variants: list[Variant],
    axes: list[Axis],
    seeds: list[int],
) -> list[RunSpec]:
    """Every run of the sweep, seed-major (all configurations of seed 0 first), each validated.

    Each combination is resolved with `load_config` (preset < file < study sets < combination <
    seed); a bad key or value is a UserError naming the combination, raised before any run starts.
    """
    check_axes(axes)
    if any(s.split("=", 1)[0].strip() == SEED_KEY for s in sets) or any(SEED_KEY in v.overrides for v in variants):
        raise UserError("do not set train.seed; use --seeds N (runs take train.seed = 0..N-1)")
    configs = []
    for variant, raw in combinations(variants, axes):
        what = ", ".join(([f"variant {variant}"] if variant else []) + [f"{k}={format_value(v)}" for k, v in raw.items()]) or "base"
        fixed = [f"{k}={format_value(v)}" for k, v in raw.items() if v != VOCAB]
        if any(v == VOCAB for v in raw.values()):
            try:
                size = vocab_size(load_config(preset, config_file, [*sets, *fixed]).model.path)
            except UserError as e:
                raise UserError(f"configuration {what}: {e}") from None
            raw = {k: (size if v == VOCAB else v) for k, v in raw.items()}
        overrides = [*sets, *(f"{k}={format_value(v)}" for k, v in raw.items())]
        try:
            cfg = load_config(preset, config_file, overrides)
        except UserError as e:
            raise UserError(f"configuration {what}: {e}") from None
        values: dict[str, Any] = {"variant": variant} if variants else {}
        values.update({a.key: lookup(cfg, a.key) for a in axes})
        configs.append((config_id(variant, values, axes), values, overrides))
    ids = [c[0] for c in configs]
    if len(set(ids)) != len(ids):
        raise UserError("two configurations of the sweep resolve to the same name; check the grid values")
    return [
        RunSpec(cid, seed, values, tuple([*overrides, f"{SEED_KEY}={seed}"]))
        for seed in seeds
        for cid, values, overrides in configs
    ]
