"""GPU check of the fused output layer (UNTESTED: no GPU has run it yet).

Runs `emapg bench update` and `emapg bench passes` on CUDA in bfloat16 at the Qwen shapes (H 1536,
V 151,936, k 32) for T = 1024, 2048 and 8192 and prints one line per run: wall seconds, the ratio
to the GEMM floor (wall time on a GPU), TFLOP/s and % of the dense bf16 peak (target >= 65% for
the fused update), and the peak CUDA memory above the set-up. Exit status 1 when a fused update
is below the target.

    python tests/gpu/gpu_bench_check.py                      # H100/H200: dense bf16 peak 989 TFLOP/s
    python tests/gpu/gpu_bench_check.py --peak-tflops 312    # A100
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def bench(kind: str, tokens: int, peak: float, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "emapg_cli", "bench", kind, "--tokens", str(tokens), "--hidden", "1536",
               "--vocab", "151936", "--k", "32", "--device", "cuda", "--dtype", "bfloat16",
               "--peak-tflops", str(peak), "--repeats", str(repeats), "--json", str(out)]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="Dense bf16 peak of the GPU (TFLOP/s).")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target-pct", type=float, default=65.0)
    args = parser.parse_args()
    ok = True
    for t in args.tokens:
        u = bench("update", t, args.peak_tflops, args.repeats)
        print(f"update T={t}: wall {u['wall_s']:.4f} s, {u['ratio']:.3f}x floor, {u['tflops']:.1f} TFLOP/s "
              f"({u['pct_of_peak']:.1f}% of peak), peak growth {u['peak_growth_mib']:.0f} MiB "
              f"({u['beyond_w_grad_mib']:.0f} MiB beyond W.grad)")
        ok = ok and u["pct_of_peak"] >= args.target_pct
        p = bench("passes", t, args.peak_tflops, args.repeats)
        for name in ("old", "anchor"):
            r = p[name]
            print(f"{name} pass T={t}: wall {r['wall_s']:.4f} s, {r['ratio']:.3f}x one GEMM, "
                  f"{r['tflops']:.1f} TFLOP/s ({r['pct_of_peak']:.1f}% of peak), peak growth {r['peak_growth_mib']:.0f} MiB")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
