"""The prepared GPU checks as tests: each script of tests/gpu/ runs in a subprocess at its defaults (its JSON written
into the test's folder) and must exit 0. Opt in with `pytest -m gpu tests/gpu`; skipped without CUDA.

    python tests/gpu/gpu_anchor_check.py            # the anchor pass under bf16 autocast (ema.anchor_autocast)
    python tests/gpu/gpu_bench_check.py             # the fused output layer against the GEMM floor
    python tests/gpu/gpu_master_weights_check.py    # float32 master weights at the olympiad model's size
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("script", ["gpu_anchor_check.py", "gpu_bench_check.py", "gpu_master_weights_check.py"])
def test_gpu_check(script, tmp_path):
    r = subprocess.run([sys.executable, str(HERE / script)], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, f"{script} exit {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
