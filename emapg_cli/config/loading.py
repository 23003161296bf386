"""Resolve a Config from its sources: preset < user file < `--set` overrides.

Every failure is a `UserError` with one line naming the key and what is allowed.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml
from pydantic import BaseModel, ValidationError

from emapg_cli.config.models import MOVED_KEYS, Config
from emapg_cli.errors import UserError
from emapg_cli.fileio import read_yaml_mapping, safe_load_yaml
from emapg_cli.paths import shipped_dir


def preset_dir() -> Path:
    """The folder holding the preset YAML files (`paths.shipped_dir`: in the wheel, or the checkout's `presets/`)."""
    return shipped_dir("presets")


def list_presets() -> list[str]:
    """Names of the presets (YAML files directly in the preset folder)."""
    return sorted(p.stem for p in preset_dir().glob("*.yaml"))


def is_path_like(name: str) -> bool:
    """A `--preset` / `--study` value naming a file rather than a built-in (ends in .yaml/.yml or has a '/')."""
    return name.endswith((".yaml", ".yml")) or "/" in name


def read_preset(name: str) -> dict[str, Any]:
    """The raw mapping of preset `name` (a bare name, or a path to a YAML file)."""
    if is_path_like(name):
        return read_yaml_mapping(Path(name), "preset file")
    path = preset_dir() / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown preset '{name}' (available: {', '.join(list_presets())})")
    return read_yaml_mapping(path, "preset")


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Recursively merge `update` into a copy of `base` (mappings merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _resolve_model(path: list[str]) -> Optional[type[BaseModel]]:
    """The model class that owns the dotted key prefix `path` (None if it is not a group); an item of a list of
    groups is named by its index (`stages.0`, `data.chat_prefix.1`)."""
    import typing

    model: type[BaseModel] = Config
    item: Optional[type[BaseModel]] = None  # the item class after a list-of-groups field, awaiting its index
    for part in path:
        if item is not None:
            if not part.isdigit():
                return None
            model, item = item, None
            continue
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None) if field else None
        args = typing.get_args(ann)
        if typing.get_origin(ann) is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            item = args[0]
            continue
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return None if item is not None else model


def split_key_value(item: str, what: str, form: str) -> tuple[str, str]:
    """Split `a.b=raw` into ("a.b", "raw"); UserError when there is no `=` or a key part is empty.

    `what` names the kind of item in errors ("override", "grid"), `form` shows its expected shape.
    """
    if "=" not in item:
        raise UserError(f"{what} '{item}' must look like {form}")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise UserError(f"{what} '{item}' has an empty key")
    return key, raw


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split `a.b=value` into (["a", "b"], value); the value is parsed as YAML (so 64 is an int)."""
    key, raw = split_key_value(item, "override", "KEY=VALUE, e.g. kl.k=64")
    try:
        value = safe_load_yaml(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError):  # ValueError: an integer past Python's digit limit; the model then rejects the text
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply dotted `--set` overrides to a raw config mapping."""
    out = copy.deepcopy(data)
    for item in overrides:
        parts, value = parse_override(item)
        owner = _resolve_model(parts[:-1])
        if ".".join(parts) in MOVED_KEYS:
            raise UserError(MOVED_KEYS[".".join(parts)])
        if owner is None or parts[-1] not in owner.model_fields:
            where, key = ".".join(parts[:-1]), ".".join(parts)
            if owner is None:
                raise UserError(f"unknown config key '{key}' ('{where}' is not a config group; groups: {', '.join(Config.model_fields)})")
            raise UserError(f"unknown config key '{key}' (allowed{' in ' + where if where else ''}: {', '.join(owner.model_fields)})")
        node = out
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return out


def _format_validation_error(err: ValidationError) -> str:
    """One line: the first failing key and what is allowed there."""
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    if e["type"] == "extra_forbidden":
        parts = [str(p) for p in e["loc"]]
        group = _resolve_model(parts[:-1]) or Config
        where = ".".join(parts[:-1])
        return f"unknown config key '{loc}' (allowed{' in ' + where if where else ''}: {', '.join(group.model_fields)})"
    msg = e["msg"].removeprefix("Value error, ")
    got = e.get("input")
    got_s = "" if isinstance(got, dict) or e["type"] == "missing" else f" (got {got!r})"
    return f"{loc}: {msg}{got_s}" if loc else f"{msg}{got_s}"


def validate(data: dict[str, Any]) -> Config:
    """Validate a raw mapping into a Config, turning pydantic errors into one-line UserErrors."""
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise UserError(_format_validation_error(err)) from None


_warned_remote_code: set[str] = set()


def warn_remote_code(source: str, data: dict[str, Any]) -> None:
    """One line on stderr (once per source and process) when a preset or config file switches on
    model.trust_remote_code, which lets the model's repository run Python code at load time."""
    model = data.get("model")
    if isinstance(model, dict) and model.get("trust_remote_code") is True and source not in _warned_remote_code:
        _warned_remote_code.add(source)
        print(f"warning: {source} switches on model.trust_remote_code: loading the model may run Python code "
              "from the model's folder or repository", file=sys.stderr)


def load_config(preset: Optional[str] = None, config_file: Optional[str] = None, overrides: Iterable[str] = ()) -> Config:
    """Resolve a Config: preset, then user file, then dotted overrides (later sources win)."""
    data: dict[str, Any] = {}
    if preset:
        data = read_preset(preset)
        warn_remote_code(f"preset {preset}", data)
    if config_file:
        raw = read_yaml_mapping(Path(config_file), "config file")
        warn_remote_code(f"config file {config_file}", raw)
        data = deep_merge(data, raw)
    return validate(apply_overrides(data, overrides))


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what `emapg config show` prints and runs save)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
