"""Experiment loggers: metrics.jsonl always, TensorBoard and Weights & Biases when asked.

`make_logger(cfg, run_dir, run_config)` returns one `Logger` that fans each step's metrics out
to its sinks. metrics.jsonl holds one JSON object per line, `{"step": N, "<namespace>/<name>":
value, ...}`, appended and flushed every step; on resume, `truncate_metrics` first drops the lines
of steps after the checkpoint, which the resumed run logs again. Non-finite values are written as
NaN / Infinity (Python's `json` reads them back).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Protocol

from emapg_cli.config.models import LoggingConfig
from emapg_cli.errors import UserError
from emapg_cli.paths import write_text_atomic

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_id.txt"


class Logger(Protocol):
    """Where a run's metrics go."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record `metrics` (namespaced keys such as `loss/policy`) for RL step `step`."""
        ...

    def close(self) -> None:
        """Flush and release everything (idempotent)."""
        ...


class NullLogger:
    """Logs nothing (e.g. on the non-main ranks of a multi-GPU run)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


def _as_float(key: str, value: Any) -> float:
    try:
        return float(value)  # also 0-d tensors and numpy scalars
    except (TypeError, ValueError):
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}") from None


class JsonlLogger:
    """Appends one JSON line per step to `path` and flushes it (a crash loses at most the line being written)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": int(step), **{k: _as_float(k, v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardLogger:
    """Scalars into `<run_dir>/tensorboard` with torch's SummaryWriter."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("logging.tensorboard needs the tensorboard package: pip install tensorboard") from None
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, _as_float(key, value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A Weights & Biases run; its id is kept in `<run_dir>/wandb_id.txt` so a resumed run continues it."""

    def __init__(self, project: str, run_dir: Path, run_config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise UserError("logging.wandb needs the wandb package: pip install wandb") from None
        id_file = run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
        id_file.write_text(run_id + "\n")
        self._wandb = wandb
        self._run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=run_config, id=run_id, resume="allow")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log({k: _as_float(k, v) for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


class MultiLogger:
    """Sends every call to each sink in order."""

    def __init__(self, sinks: list[Logger]):
        self.sinks = sinks
        self._closed = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks:
            sink.close()


def truncate_metrics(path: Path, last_step: int) -> int:
    """Drop the lines of `path` with step > `last_step` (and a torn last line); returns how many were dropped.

    Called on resume from the checkpoint of `last_step`, before the logger reopens the file. The
    file is rewritten through a temporary file and an atomic rename. A missing file drops nothing.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            dropped += 1  # a line cut short by a crash
            continue
        if step <= last_step:
            keep.append(line)
        else:
            dropped += 1
    if dropped:
        write_text_atomic(path, "".join(line + "\n" for line in keep))
    return dropped


def make_logger(cfg: LoggingConfig, run_dir: Path, run_config: dict[str, Any], *, resume_step: Optional[int] = None) -> Logger:
    """The run's logger: metrics.jsonl in `run_dir`, plus TensorBoard / W&B when `cfg` turns them on.

    With `resume_step`, metrics.jsonl is first truncated to that step (see `truncate_metrics`).
    `run_config` (the resolved config as a dict) goes to W&B as the run's config.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume_step is not None:
        truncate_metrics(run_dir / METRICS_FILE, resume_step)
    sinks: list[Logger] = []
    try:
        if cfg.tensorboard:
            sinks.append(TensorBoardLogger(run_dir / TENSORBOARD_DIR))
        if cfg.wandb:
            sinks.append(WandbLogger(cfg.wandb_project, run_dir, run_config))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    sinks.insert(0, JsonlLogger(run_dir / METRICS_FILE))
    return MultiLogger(sinks)


def open_run(cfg, run_dir: Path, accelerator, last: int, resume: bool) -> Logger:
    """Write the run's config.yaml (main process; atomic, as the other ranks may be reading the old one) and open its
    metrics logger there (a NullLogger on the other ranks). On resume the config is the saved one plus any --set,
    written only once the checkpoint took it, and metrics of steps after the checkpoint (`last`) are dropped (they
    are logged again); with no checkpoint at all, every row goes (-1), step 0 included. Every rank must see the
    folder (`shared_folder.check_shared_run_folder`)."""
    from emapg_cli.config.loading import to_yaml

    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(run_dir / "config.yaml", to_yaml(cfg))
    accelerator.wait_for_everyone()
    from emapg_cli.train.shared_folder import check_shared_run_folder

    check_shared_run_folder(run_dir, accelerator)  # a launch over several machines: every rank sees the folder
    if not accelerator.is_main_process:
        return NullLogger()
    resume_step = (last if last > 0 else -1) if resume else None
    return make_logger(cfg.logging, run_dir, cfg.model_dump(mode="json"), resume_step=resume_step)
