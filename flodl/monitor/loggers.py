"""Scalar loggers beside TensorBoard: ``metrics.csv`` (built in), Weights & Biases, MLflow.

Every logger is fed the same flat scalars (:func:`epoch_scalars` once per epoch, stepped by the
1-based epoch; :func:`step_scalars` every ``logger.log_every_n_steps`` steps of a rank, stepped
by that rank's step count), so the CSV, the W&B run and the MLflow run hold the same numbers as
TensorBoard and ``summary.json``. wandb and mlflow are optional: imported only when enabled,
with an error naming the package to install when missing.
"""

from __future__ import annotations

import contextlib
import csv
import io
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from flodl.config import LoggerConfig, MlflowConfig, WandbConfig
from flodl.monitor.metrics import EpochMetrics

log = logging.getLogger(__name__)

_RANK_STATS = (
    "loss",
    "busy_fraction",
    "data_wait_fraction",
    "pace_overrun_fraction",
    "peak_mem_mb",
)


def epoch_scalars(m: EpochMetrics) -> dict[str, float]:
    """One epoch as flat, finite scalars: the tags every logger writes."""
    out: dict[str, float | None] = {
        "loss/train": m.avg_loss,
        "time/epoch_ms": m.epoch_ms,
        "epoch/anchor": float(m.anchor),
        "epoch/overhead": m.overhead,
        "lr": m.lr,
    }
    out |= {f"eval/{name}": v for name, v in m.eval_metrics.items()}
    out |= {f"scalars/{name}": v for name, v in m.scalars.items()}
    for r, stats in enumerate(m.per_rank):
        out |= {f"rank_{r}/{key}": stats.get(key) for key in _RANK_STATS}
    for r, (rate, share) in enumerate(
        zip(m.per_rank_throughput, m.per_rank_batch_share, strict=False)
    ):
        out[f"rank_{r}/samples_per_s"] = rate
        out[f"rank_{r}/batch_share"] = share
    return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(v)}


def step_scalars(rank: int, loss: float, lr: float) -> dict[str, float]:
    """One logged training step of ``rank``."""
    out = {f"step/rank_{rank}/loss": loss, f"step/rank_{rank}/lr": lr}
    return {k: v for k, v in out.items() if math.isfinite(v)}


class ScalarLogger(Protocol):
    def log(self, scalars: Mapping[str, float], step: int, kind: str) -> None: ...

    def close(self) -> None: ...


class CsvLogger:
    """``<job>/metrics.csv`` in long form: ``kind,step,name,value`` (kind: epoch or step).

    The file is always a whole CSV: it is rewritten atomically (temp + rename) after every
    epoch and at the end, with step rows held in between, so a full disk leaves the last
    complete file rather than a cut line (issue 41)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._rows = io.StringIO()
        self._writer = csv.writer(self._rows)
        self._writer.writerow(["kind", "step", "name", "value"])
        self._publish()  # the header now: a directory without room says so at the start

    def log(self, scalars: Mapping[str, float], step: int, kind: str) -> None:
        self._writer.writerows([kind, step, name, repr(v)] for name, v in scalars.items())
        if kind == "epoch":
            self._publish()

    def _publish(self) -> None:
        from flodl.checkpoint.store import write_atomic

        data = self._rows.getvalue().encode("utf-8")
        write_atomic(self.path, lambda f: f.write(data))

    def close(self) -> None:
        self._publish()


def _missing(package: str, key: str) -> ImportError:
    return ImportError(
        f"{key} is set but {package} is not installed: pip install {package} (or unset {key})"
    )


class WandbLogger:
    """A W&B run; ``mode: offline`` (the default) writes ``<job>/wandb`` and needs no network."""

    def __init__(self, cfg: WandbConfig, job_dir: Path, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "logger.wandb") from None
        # console="off": wandb must not wrap stdout, which carries the ranks' forwarded output.
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=str(job_dir),
            name=cfg.name or job_dir.name,
            config=dict(config),
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric("epoch")
        self.run.define_metric("step")
        self.run.define_metric("step/*", step_metric="step")

    def log(self, scalars: Mapping[str, float], step: int, kind: str) -> None:
        self.run.log({**scalars, kind: step})

    def close(self) -> None:
        import wandb

        self.run.finish()
        # The run's wandb-core service would outlive the job (a child the launcher must not
        # leave behind); the next job's wandb.init starts a fresh one.
        wandb.teardown()


@contextlib.contextmanager
def _file_store_allowed() -> Iterator[None]:
    """MLflow >= 3.7 refuses its file store unless told; a local file store is what we want."""
    previous = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = previous


class MlflowLogger:
    """An MLflow run, in a file store under ``<job>/mlruns`` unless ``tracking_uri`` is set."""

    def __init__(self, cfg: MlflowConfig, job_dir: Path, params: Mapping[str, Any]) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow-skinny", "logger.mlflow") from None
        uri = cfg.tracking_uri or (job_dir / "mlruns").resolve().as_uri()
        with _file_store_allowed():
            self.client = MlflowClient(tracking_uri=uri)
            found = self.client.get_experiment_by_name(cfg.experiment)
            experiment = (
                found.experiment_id if found else self.client.create_experiment(cfg.experiment)
            )
        run = self.client.create_run(experiment, run_name=cfg.run_name or job_dir.name)
        self.run_id = run.info.run_id
        self.tracking_uri = uri
        self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()])

    def log(self, scalars: Mapping[str, float], step: int, kind: str) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, v, now, step) for name, v in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Loggers:
    """Fans the same scalars out to every enabled logger (thread-safe; close is idempotent)."""

    def __init__(self, loggers: list[ScalarLogger]) -> None:
        self.loggers = loggers
        self._lock = threading.Lock()

    @classmethod
    def build(cls, cfg: LoggerConfig, job_dir: Path, params: Mapping[str, Any]) -> Loggers:
        loggers: list[ScalarLogger] = []
        if cfg.csv:
            try:
                loggers.append(CsvLogger(job_dir / "metrics.csv"))
            except OSError as exc:  # a full disk at the start: the run goes on without it
                from flodl.monitor.failures import write_failure

                log.warning("%s; csv logging is off", write_failure(exc, job_dir / "metrics.csv"))
        if cfg.wandb is not None:
            loggers.append(WandbLogger(cfg.wandb, job_dir, params))
        if cfg.mlflow is not None:
            loggers.append(MlflowLogger(cfg.mlflow, job_dir, params))
        return cls(loggers)

    def epoch(self, m: EpochMetrics) -> None:
        self._log(epoch_scalars(m), m.epoch, "epoch")

    def steps(self, rank: int, steps: tuple[tuple[int, float, float], ...]) -> None:
        for step, loss, lr in steps:
            self._log(step_scalars(rank, loss, lr), step, "step")

    def _log(self, scalars: Mapping[str, float], step: int, kind: str) -> None:
        with self._lock:
            for logger in list(self.loggers):
                try:
                    logger.log(scalars, step, kind)
                except Exception as exc:  # a full disk, a lost server: never stops training
                    self.loggers.remove(logger)
                    _degrade(logger, exc)

    def close(self) -> None:
        with self._lock:
            loggers, self.loggers = self.loggers, []
        for logger in loggers:
            try:
                logger.close()
            except Exception as exc:
                _degrade(logger, exc)


def _degrade(logger: ScalarLogger, exc: Exception) -> None:
    """One warning for a logger whose write failed; it is off for the rest of the run."""
    from flodl.monitor.failures import write_failure

    where = getattr(logger, "path", None) or type(logger).__name__
    log.warning("%s; %s is off for the rest of the run", write_failure(exc, where), _name(logger))


def _name(logger: ScalarLogger) -> str:
    return type(logger).__name__.removesuffix("Logger").lower() + " logging"
