"""The hostile-user probes of tests/probes/ (issue 20), one test each; slow probes are marked slow.

    pytest tests/probes                      # the fast probes (as CI runs them)
    pytest tests/probes -m slow              # the slow ones
    pytest tests/probes -m "" -k server      # every probe whose id contains "server"
"""

from __future__ import annotations

import pytest

from probes import AREAS, load_all

PROBES = load_all()


@pytest.mark.parametrize("p", [pytest.param(p, id=p.id, marks=[pytest.mark.slow] if p.slow else []) for p in PROBES])
def test_probe(p, tmp_path):
    p.fn(tmp_path)


def test_every_area_has_probes():
    assert {p.area for p in PROBES} == set(AREAS)
