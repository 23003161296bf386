"""What probes share: running emapg as a user does, and the checks every bad input must pass."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str

    def show(self) -> str:
        return f"exit {self.code}; stderr: {self.err.strip()[-600:]!r}; stdout: {self.out.strip()[-300:]!r}"


def base_env(ws: Path) -> dict[str, str]:
    """A private EMAPG_HOME inside the probe's folder, offline hub, one torch thread, wide columns."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMAPG_") or k == "EMAPG_DATA_DIR"}
    env.update(EMAPG_HOME=str(ws / "home"), EMAPG_TORCH_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", COLUMNS="200",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return env


def emapg(ws: Path, *argv: str, timeout: float = 120, env: Optional[dict[str, str]] = None,
          stdin: Optional[str] = None) -> Result:
    """`emapg ARGV` as a real subprocess in `ws`; a run past `timeout` seconds is a probe failure."""
    try:
        r = subprocess.run([sys.executable, "-m", "emapg_cli", *argv], cwd=ws, capture_output=True, text=True,
                           timeout=timeout, env={**base_env(ws), **(env or {})}, input=stdin)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"`emapg {' '.join(argv)[:200]}` ran past {timeout:.0f} s")
    return Result(r.returncode, r.stdout, r.stderr)


def one_line_error(r: Result, *needles: str, code: int = 2) -> str:
    """Assert `r` is bad input as emapg promises: exit `code`, one `error:` line, no traceback; return the line."""
    lines = r.err.strip().splitlines()
    assert "Traceback" not in r.err + r.out, f"traceback: {r.show()}"
    assert r.code == code, f"expected exit {code}: {r.show()}"
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], f"expected one `error:` line: {r.show()}"
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


def ok(r: Result) -> Result:
    assert r.code == 0 and "Traceback" not in r.err, f"expected success: {r.show()}"
    return r


def snapshot(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under `root` (to prove nothing was changed or deleted)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}
