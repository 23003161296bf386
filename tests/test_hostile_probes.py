"""The hostile-user probes of scripts/probes/ (issue 20), one test each; slow probes are marked slow.

The same registry runs outside pytest as `python scripts/hostile_probes.py` (PASS/FAIL per line).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from probes import load_all  # noqa: E402

PROBES = load_all()


@pytest.mark.parametrize("p", [pytest.param(p, id=p.id, marks=[pytest.mark.slow] if p.slow else []) for p in PROBES])
def test_probe(p, tmp_path):
    p.fn(tmp_path)


def test_every_area_has_probes():
    from probes import AREAS

    assert {p.area for p in PROBES} == set(AREAS)
