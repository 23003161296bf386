"""Experiment loggers: the metrics.jsonl writer, resume truncation, and the optional sinks' wiring."""

from __future__ import annotations

import json
import math
import sys
import types

import numpy as np
import pytest

from emapg_cli.config.models import LoggingConfig
from emapg_cli.errors import UserError
from emapg_cli.train.loggers import METRICS_FILE, NullLogger, make_logger, truncate_metrics


def read_metrics(path):
    """The rows of a metrics.jsonl file, in order (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_jsonl_rows_are_written_and_flushed_every_step(tmp_path):
    logger = make_logger(LoggingConfig(), tmp_path, {})
    logger.log({"loss/policy": 0.5, "kl/value": np.float32(0.25)}, step=1)
    # Flushed before close: another reader sees the line now.
    assert (tmp_path / METRICS_FILE).read_text() == '{"step": 1, "loss/policy": 0.5, "kl/value": 0.25}\n'
    logger.log({"loss/policy": float("nan")}, step=2)
    logger.close()
    logger.close()  # idempotent
    rows = read_metrics(tmp_path / METRICS_FILE)
    assert rows[0] == {"step": 1, "loss/policy": 0.5, "kl/value": 0.25}
    assert rows[1]["step"] == 2 and math.isnan(rows[1]["loss/policy"])


def test_non_numeric_metric_is_rejected(tmp_path):
    logger = make_logger(LoggingConfig(), tmp_path, {})
    with pytest.raises(TypeError, match="'rollout/text' must be a number"):
        logger.log({"rollout/text": "hello"}, step=1)
    logger.close()


def _write_steps(path, steps):
    path.write_text("".join(json.dumps({"step": s, "loss/policy": s / 10}) + "\n" for s in steps))


def test_truncate_drops_later_steps_and_a_torn_line(tmp_path):
    path = tmp_path / METRICS_FILE
    _write_steps(path, [1, 2, 3, 4, 5])
    with path.open("a") as f:
        f.write('{"step": 6, "loss/pol')  # the crash cut this line short
    assert truncate_metrics(path, 3) == 3  # steps 4, 5 and the torn line
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    assert truncate_metrics(path, 3) == 0
    assert not path.with_name(METRICS_FILE + ".tmp").exists()
    assert truncate_metrics(tmp_path / "missing.jsonl", 0) == 0


def test_resume_truncates_then_appends(tmp_path):
    logger = make_logger(LoggingConfig(), tmp_path, {})
    for step in range(1, 6):
        logger.log({"loss/policy": float(step)}, step=step)
    logger.close()
    # The run resumes from its step-2 checkpoint and logs step 3 again with new values.
    logger = make_logger(LoggingConfig(), tmp_path, {}, resume_step=2)
    logger.log({"loss/policy": 30.0}, step=3)
    logger.close()
    assert [(r["step"], r["loss/policy"]) for r in read_metrics(tmp_path / METRICS_FILE)] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_missing_optional_packages_are_user_errors(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # `import` now raises ImportError
    with pytest.raises(UserError, match="pip install tensorboard"):
        make_logger(LoggingConfig(tensorboard=True), tmp_path, {})
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError, match="pip install wandb"):
        make_logger(LoggingConfig(wandb=True), tmp_path, {})
    assert not (tmp_path / METRICS_FILE).exists()  # nothing opened before the error


def test_tensorboard_and_wandb_sinks_receive_the_same_metrics(tmp_path, monkeypatch):
    events = []

    class FakeWriter:
        def __init__(self, log_dir):
            events.append(("tb_dir", log_dir))

        def add_scalar(self, key, value, global_step):
            events.append(("tb", key, value, global_step))

        def flush(self):
            pass

        def close(self):
            events.append(("tb_close",))

    class FakeRun:
        def log(self, metrics, step):
            events.append(("wandb", metrics, step))

        def finish(self):
            events.append(("wandb_finish",))

    import torch.utils  # noqa: F401  (the fake submodule below needs its parent package)

    tb = types.ModuleType("torch.utils.tensorboard")
    tb.SummaryWriter = FakeWriter
    wandb = types.ModuleType("wandb")
    wandb.util = types.SimpleNamespace(generate_id=lambda: "abc123")
    wandb.init = lambda **kw: events.append(("wandb_init", kw)) or FakeRun()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tb)
    monkeypatch.setitem(sys.modules, "wandb", wandb)

    cfg = LoggingConfig(tensorboard=True, wandb=True, wandb_project="proj")
    logger = make_logger(cfg, tmp_path / "run1", {"name": "x"})
    logger.log({"reward/mean": 1.5}, step=4)
    logger.close()
    init = next(e[1] for e in events if e[0] == "wandb_init")
    assert init == {"project": "proj", "name": "run1", "dir": str(tmp_path / "run1"), "config": {"name": "x"},
                    "id": "abc123", "resume": "allow"}
    assert ("tb", "reward/mean", 1.5, 4) in events and ("wandb", {"reward/mean": 1.5}, 4) in events
    assert ("tb_close",) in events and ("wandb_finish",) in events
    # A resumed run reuses the stored W&B id even if a new one would differ.
    wandb.util.generate_id = lambda: "other"
    make_logger(cfg, tmp_path / "run1", {}).close()
    assert [e[1]["id"] for e in events if e[0] == "wandb_init"] == ["abc123", "abc123"]


def test_null_logger_does_nothing(tmp_path):
    logger = NullLogger()
    logger.log({"loss/policy": 1.0}, step=1)
    logger.close()
    assert list(tmp_path.iterdir()) == []
