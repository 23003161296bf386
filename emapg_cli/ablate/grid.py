"""Grid axes and variants -> the list of runs of a sweep, each validated as a Config before anything starts.

A sweep is (named variants) x (cartesian product of grid axes) x seeds. Every run is an ordinary
`emapg train` run described by `--set` overrides on one base preset (+ optional config file).
Grid values are written like `--set` values (parsed as YAML, then typed and checked by the config
model); the special value `|V|` stands for the policy model's vocabulary size, read from the
model's `config.json`, and `x<number>` (e.g. `x2`, `x0.5`) for that multiple of the key's value in the
run's config resolved without this axis (`resolve_relative`).
"""

from __future__ import annotations

import itertools
import json
import math
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
#: A relative grid value: `x` followed by a number (`x2`, `x0.5`, `x1e3`); `x` then anything else is a plain string.
RELATIVE = re.compile(r"^x(?=$|[0-9.+-])")


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
    grid: dict[str, str] = field(default_factory=dict)  # each grid value as written (`x2`, `|V|`, `0.0006`)

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


def relative_factor(value: Any) -> Optional[float]:
    """The multiple m of a relative grid value `x<m>` (`x2` -> 2.0), None for any other value; UserError (one line)
    for `x` without a number or a multiple that is not a positive finite number."""
    if not isinstance(value, str) or not RELATIVE.match(value):
        return None
    try:
        factor = float(value[1:])
    except ValueError:
        raise UserError(f"grid value '{value}': write a multiple of the key's value as x<number>, e.g. x2 or x0.5") from None
    if not (math.isfinite(factor) and factor > 0):
        raise UserError(f"grid value '{value}': the multiple must be a positive number")
    return factor


def scaled(base: Any, factor: float) -> Any:
    """base x factor, rounded to 12 significant digits (so x3 of 3e-4 is 0.0009, not 0.0009000000000000001, and
    x2 of 3e-4 is exactly the 0.0006 that an absolute 6.0e-4 gives); an int base stays an int when the product is whole."""
    value = float(f"{base * factor:.12g}")
    return int(value) if isinstance(base, int) and value.is_integer() else value


def resolve_relative(preset: Optional[str], config_file: Optional[str], sets: list[str], variant: dict[str, Any],
                     raw: dict[str, Any], what: str) -> dict[str, Any]:
    """Replace every relative grid value `x<m>` in one combination's `raw` values by m x the key's value in the
    run's config resolved without that axis (preset < config file < sets < variant < the other, absolute grid
    values), rounded by `scaled`. UserError naming the combination when the key is unknown or not a number."""
    factors = {k: f for k, v in raw.items() if (f := relative_factor(v)) is not None}
    if not factors:
        return raw
    base_raw = {**variant, **{k: v for k, v in raw.items() if k not in factors}}
    base_raw = {k: v for k, v in base_raw.items() if v != VOCAB}
    try:
        cfg = load_config(preset, config_file, [*sets, *(f"{k}={format_value(v)}" for k, v in base_raw.items())])
    except UserError as e:
        raise UserError(f"configuration {what}: {e}") from None
    out = dict(raw)
    for key, factor in factors.items():
        try:
            base = lookup(cfg, key)
        except (KeyError, TypeError):
            raise UserError(f"configuration {what}: unknown config key '{key}'") from None
        if isinstance(base, bool) or not isinstance(base, (int, float)):
            raise UserError(f"configuration {what}: {key}={raw[key]} multiplies {key}'s value, which is {base!r} here, not a number")
        out[key] = scaled(base, factor)
    return out


def check_axes(axes: list[Axis]) -> None:
    """Each grid key at most once, never train.seed (seeds are `--seeds`), with at least one value and no value twice;
    a relative value (`x<number>`) well formed."""
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
        for v in axis.values:
            relative_factor(v)
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
    from emapg_cli.models.folder import local_folder, read_config

    folder = local_folder(model_path, f"{VOCAB}: model.path")
    if folder is None or not (folder / "config.json").is_file():
        raise UserError(f"{VOCAB}: no config.json in model.path {expand(model_path)} (prepare the model first, e.g. `emapg prepare`)")
    data = read_config(folder, f"{VOCAB}: model.path")  # a JSON object whose vocab_size, when there, is an int >= 1
    size = data.get("vocab_size") or (data.get("text_config") or {}).get("vocab_size")
    if size is None:
        raise UserError(f"{VOCAB}: {folder / 'config.json'} has no integer vocab_size")
    return size


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]+", "-", text).strip("-") or "x"


def config_id(variant: Optional[str], values: dict[str, Any], axes: list[Axis]) -> str:
    """Directory-safe name of one configuration: `ema-pg`, `kl.k=8_ema.decay=0.9`, `grpo_kl.k=8`."""
    parts = [_slug(variant)] if variant else []
    parts += [_slug(f"{a.key}={format_value(values[a.key])}") for a in axes]
    return "_".join(parts) or "base"


def _once(configs: list[tuple]) -> list[tuple]:
    """The configurations with exact repeats dropped: two combinations that resolve to the same name and the same
    overrides are one run (a relative value of a key that a variant sets to 0, e.g. `none`'s kl.coef=0 on a
    kl.coef=x1,x10 axis, is 0 at every multiple); the first keeps its grid values as written."""
    seen: dict[str, list[str]] = {}
    out = []
    for c in configs:
        if c[0] in seen and seen[c[0]] == c[2]:
            continue
        seen.setdefault(c[0], c[2])
        out.append(c)
    return out


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
    by_name = {v.name: v.overrides for v in variants}
    for variant, raw in combinations(variants, axes):
        what = ", ".join(([f"variant {variant}"] if variant else []) + [f"{k}={format_value(v)}" for k, v in raw.items()]) or "base"
        written = {a.key: format_value(raw[a.key]) for a in axes}
        raw = resolve_relative(preset, config_file, sets, by_name.get(variant, {}) if variant else {}, raw, what)
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
        configs.append((config_id(variant, values, axes), values, overrides, written))
    configs = _once(configs)
    ids = [c[0] for c in configs]
    if len(set(ids)) != len(ids):
        raise UserError("two configurations of the sweep resolve to the same name; check the grid values")
    return [
        RunSpec(cid, seed, values, tuple([*overrides, f"{SEED_KEY}={seed}"]), written)
        for seed in seeds
        for cid, values, overrides, written in configs
    ]
