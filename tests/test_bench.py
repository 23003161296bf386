"""`emapg bench` on tiny shapes: the real CLI writes the documented JSON keys; bad input exits 2.

Only the plumbing is tested here (timings on shared CI machines mean nothing); the measurements
themselves are opt-in (README, "Performance")."""

from __future__ import annotations

import json


def test_bench_update_and_passes_json(cli, tmp_path):
    out = tmp_path / "u.json"
    r = cli("bench", "update", "--tokens", "9", "--hidden", "8", "--vocab", "50", "--k", "4", "--chunk", "4",
            "--estimator", "topk_mass", "--repeats", "2", "--threads", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    for key in ("cpu_s", "wall_s", "peak_growth_mib", "floor_cpu_s", "floor_wall_s", "ratio", "beyond_w_grad_mib"):
        assert isinstance(res[key], float), key
    assert len(res["cpu_s_runs"]) == len(res["floor_cpu_s_runs"]) == 2 and res["chunk"] == 4
    assert abs(res["w_grad_mib"] - 50 * 8 * 4 / 2**20) < 1e-12  # V x H float32
    out = tmp_path / "p.json"
    r = cli("bench", "passes", "--tokens", "9", "--hidden", "8", "--vocab", "50", "--k", "4", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert {"cpu_s", "wall_s", "peak_growth_mib", "floor_cpu_s", "ratio"} <= set(res["old"]) and "ratio" in res["anchor"]


def test_bench_rejects_bad_input(cli):
    r = cli("bench", "update", "--tokens", "4", "--hidden", "4", "--vocab", "20", "--estimator", "k5", "--direction", "reverse")
    assert r.returncode == 2 and "k5" in r.stderr and "Traceback" not in r.stderr
    r = cli("bench", "update", "--dtype", "float16")
    assert r.returncode == 2 and "--dtype" in r.stderr
