"""Hostile-user probes: each one an attack or a mistake a user made, and what emapg must do about it.

A probe is a function `fn(ws: Path) -> None` that gets a fresh empty folder, runs emapg (mostly as a
real subprocess, see `common.emapg`) and raises `AssertionError` with a one-line reason when emapg
misbehaves. Probes are grouped by surface, one module each (`AREAS`); `@probe(...)` registers one.

`tests/probes/test_probes.py` runs the registry under pytest, one test per probe (slow probes marked `slow`):

    pytest tests/probes                      # the fast probes (as CI runs them)
    pytest tests/probes -m slow              # the slow ones
    pytest tests/probes -m "" -k server      # every probe whose id contains "server"
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

#: Probe modules, one per surface (tests/probes/<area>.py).
AREAS = ("trust", "server", "rollout", "index", "readers", "first_hour", "one_line", "isolation", "openai")


@dataclass(frozen=True)
class Probe:
    area: str
    name: str
    fn: Callable[[Path], None]
    slow: bool
    doc: str

    @property
    def id(self) -> str:
        return f"{self.area}:{self.name}"


REGISTRY: list[Probe] = []


def probe(name: str, *, slow: bool = False):
    """Register `fn(ws)` as the probe `<area>:<name>`; its docstring says what a user did and what must happen."""

    def register(fn: Callable[[Path], None]) -> Callable[[Path], None]:
        area = fn.__module__.rsplit(".", 1)[-1]
        if any(p.area == area and p.name == name for p in REGISTRY):
            raise ValueError(f"duplicate probe {area}:{name}")
        REGISTRY.append(Probe(area, name, fn, slow, " ".join((fn.__doc__ or "").split())))
        return fn

    return register


def load_all() -> list[Probe]:
    """Import every area module (registering its probes) and return the registry in a stable order."""
    for area in AREAS:
        try:
            importlib.import_module(f"{__name__}.{area}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{area}":
                raise
    return sorted(REGISTRY, key=lambda p: (AREAS.index(p.area), p.name))
