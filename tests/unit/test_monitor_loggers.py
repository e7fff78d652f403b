"""csv, W&B (offline) and MLflow (file store) loggers hold the same scalars — no rank process."""

from __future__ import annotations

import importlib.util
import math

import pytest

from flodl.config import LoggerConfig, MlflowConfig, WandbConfig
from flodl.monitor.loggers import Loggers, epoch_scalars
from flodl.monitor.metrics import EpochMetrics
from tests.loggers_readback import csv_last, mlflow_last, wandb_history, wandb_last

HAVE_WANDB = importlib.util.find_spec("wandb") is not None
HAVE_MLFLOW = importlib.util.find_spec("mlflow") is not None


def _epoch(epoch: int, accuracy: float) -> EpochMetrics:
    return EpochMetrics(
        epoch=epoch,
        avg_loss=1.0 / epoch,
        epoch_ms=100.0 * epoch,
        per_rank=[
            {"loss": 0.5, "busy_fraction": 0.9, "data_wait_fraction": 0.01, "peak_mem_mb": 300.0}
        ],
        per_rank_throughput=[1000.0],
        per_rank_batch_share=[1.0],
        anchor=10,
        eval_value=accuracy,
        eval_metrics={"eval_loss": 0.3 / epoch, "accuracy": accuracy},
        lr=1e-3,
    )


def _feed(loggers: Loggers) -> list[EpochMetrics]:
    epochs = [_epoch(1, 0.8), _epoch(2, 0.9)]
    for m in epochs:
        loggers.epoch(m)
    loggers.steps(0, ((5, 0.7, 1e-3), (10, 0.6, 5e-4)))
    loggers.close()
    loggers.close()  # idempotent
    return epochs


def test_scalars_are_flat_finite_and_tagged() -> None:
    m = _epoch(2, 0.9)
    m.per_rank[0]["loss"] = math.nan
    scalars = epoch_scalars(m)
    assert scalars["eval/accuracy"] == 0.9 and scalars["eval/eval_loss"] == pytest.approx(0.15)
    assert scalars["rank_0/peak_mem_mb"] == 300.0 and scalars["loss/train"] == 0.5
    assert "rank_0/loss" not in scalars  # NaN is dropped, never written


def test_csv_holds_every_epoch_and_step_scalar(tmp_path) -> None:
    cfg = LoggerConfig(tensorboard=False, csv=True)
    epochs = _feed(Loggers.build(cfg, tmp_path, {"mode": "solo"}))
    assert csv_last(tmp_path / "metrics.csv") == epoch_scalars(epochs[-1])
    steps = csv_last(tmp_path / "metrics.csv", "step")
    assert steps == {"step/rank_0/loss": 0.6, "step/rank_0/lr": 5e-4}


@pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed (pip install wandb)")
def test_wandb_offline_run_holds_the_same_scalars(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: never the network
    cfg = LoggerConfig(csv=False, wandb=WandbConfig())
    epochs = _feed(Loggers.build(cfg, tmp_path, {"mode": "solo"}))
    last = wandb_last(tmp_path)
    assert {k: last[k] for k in epoch_scalars(epochs[-1])} == epoch_scalars(epochs[-1])
    assert last["epoch"] == 2
    steps = [r for r in wandb_history(tmp_path) if "step" in r]
    assert [(r["step"], r["step/rank_0/loss"]) for r in steps] == [(5, 0.7), (10, 0.6)]


@pytest.mark.skipif(not HAVE_MLFLOW, reason="mlflow is not installed (pip install mlflow-skinny)")
def test_mlflow_file_store_run_holds_the_same_scalars(tmp_path) -> None:
    cfg = LoggerConfig(csv=False, mlflow=MlflowConfig())
    epochs = _feed(Loggers.build(cfg, tmp_path, {"mode": "solo"}))
    assert mlflow_last(tmp_path) == epoch_scalars(epochs[-1]) | {
        "step/rank_0/loss": 0.6,
        "step/rank_0/lr": 5e-4,
    }


def test_a_missing_optional_logger_names_the_package(tmp_path, monkeypatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match=r"logger.wandb is set but wandb is not installed"):
        Loggers.build(LoggerConfig(csv=False, wandb=WandbConfig()), tmp_path, {})


def test_launch_banner_names_each_device_and_says_when_they_differ() -> None:
    from flodl.placement.gpus import GpuInfo
    from flodl.placement.topology import describe_gpus, describe_rig

    gpus = [
        GpuInfo(0, "RTX 5060 Ti", None, 16384, "12.0"),
        GpuInfo(1, "GTX 1060", None, 6144, "6.1"),
    ]
    assert describe_gpus(gpus) == (
        "ddp: 2 GPUs (heterogeneous) | RTX 5060 Ti (16.0 GB) | GTX 1060 (6.0 GB)"
    )
    assert describe_gpus([gpus[0], gpus[0]]).startswith("ddp: 2 GPUs (equal) | RTX 5060 Ti")
    rig = describe_rig([1.0, 0.5])
    assert rig.startswith("cpu_rig: 2 CPU ranks (heterogeneous, host RAM ")
    assert rig.endswith("| cpu x1 | cpu x0.5")
