"""`emapg bench step`: whole RL steps of a preset, broken into generation, reward, batch, passes, update, EMA."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any, Iterable

PHASES = ("generation", "reward", "batch", "passes", "update", "ema")


def bench_step(preset: str, overrides: Iterable[str] = (), steps: int = 3, warmup: int = 1) -> dict[str, Any]:
    """Run `warmup` + `steps` RL steps of `preset` (in a temporary run folder; nothing is saved) and return
    the median wall seconds of each phase (`other`: the rest of the step), of the whole step, and response
    tokens per second."""
    from emapg_cli.config.loading import load_config
    from emapg_cli.train.trainer import Trainer

    cfg = load_config(preset, overrides=list(overrides))
    rows = []
    with tempfile.TemporaryDirectory(prefix="emapg-bench-") as tmp:
        trainer = Trainer(cfg, Path(tmp) / "run")
        trainer.setup()
        trainer.scorer.eval()
        for step in range(1, warmup + steps + 1):
            result = trainer.step(step)
            if step > warmup:
                phases = result.phase_s
                total = phases["rollout"] + phases["update_total"]
                row = {**{p: phases.get(p, 0.0) for p in PHASES}, "step": total, "tokens": float(result.response_tokens)}
                row["other"] = total - sum(row[p] for p in PHASES)
                rows.append(row)
        trainer.close()
    med = {key: statistics.median(r[key] for r in rows) for key in (*PHASES, "other", "step", "tokens")}
    out: dict[str, Any] = {f"{p}_s": med[p] for p in (*PHASES, "other")}
    out.update(step_s=med["step"], tokens=med["tokens"], tokens_per_s=statistics.median(r["tokens"] / r["step"] for r in rows),
               step_s_runs=[r["step"] for r in rows], preset=preset, steps=steps, warmup=warmup)
    return out
