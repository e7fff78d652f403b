"""One real 2-rank run: sharded torchmetrics eval, early stopping, keep-best, every logger and
per-rank telemetry, each checked against a hand computation or summary.json."""

from __future__ import annotations

import csv
import importlib.util
import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import f1_score
from torchmetrics.classification import MulticlassF1Score

from flodl import ClusterConfig, ElCheConfig, EpochMetrics, LoggerConfig, Trainer
from flodl.checkpoint.bundle import load_bundle
from flodl.config import EarlyStoppingConfig, MlflowConfig, MonitorConfig, WandbConfig
from flodl.recipes.steps import classification_step
from tests.integration.helpers import CLASSES, data, model_factory, optim_factory
from tests.loggers_readback import csv_last, mlflow_last, wandb_last
from tests.unit.test_evaluation import SampleCount

pytestmark = pytest.mark.slow

HAVE_WANDB = importlib.util.find_spec("wandb") is not None
HAVE_MLFLOW = importlib.util.find_spec("mlflow") is not None
N_TEST = 256  # data("test") size


def f1_metric() -> MulticlassF1Score:
    return MulticlassF1Score(num_classes=CLASSES, average="macro")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    seen: list[EpochMetrics] = []
    logger = LoggerConfig(
        progress="off",
        tensorboard=False,
        csv=True,
        log_every_n_steps=2,  # the slow rank logs too, however few steps it gets
        wandb=WandbConfig() if HAVE_WANDB else None,
        mlflow=MlflowConfig() if HAVE_MLFLOW else None,
    )
    # The count never improves after epoch 1, so patience 2 stops the run after epoch 3 of 6.
    builder = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(partial(data, "train", 512))
        .eval_dataset(partial(data, "test"))
        .metrics({"count": SampleCount, "f1": f1_metric})
        .eval_loss(F.cross_entropy)
        .batch_size(32)
        .num_epochs(6)
        .elche(ElCheConfig(mode="nccl_cadence"))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=3))
        .logger(logger)
        .metrics_fn(seen.append)
        .output_dir(out / "job")
        .eval_policy("sharded")
        .early_stopping(EarlyStoppingConfig(monitor="count", mode="max", patience=2))
        .save_best(MonitorConfig(monitor="f1", mode="max"), save_path=str(out / "bundle"))
    )
    handle = builder.run()
    handle.join(timeout=240)
    summary = json.loads((out / "job" / "summary.json").read_text())
    return out, handle, seen, summary


def test_sharded_metrics_are_exact_and_early_stopping_ends_every_rank(run):
    _out, handle, seen, summary = run
    assert summary["status"] == "ok" and summary["epochs"] == 3
    assert summary["stopped_early"] == {"reason": "early_stopping", "epoch": 3}
    assert [m.epoch for m in seen] == [1, 2, 3]  # the console's numbering, from 1
    assert [m.eval_metrics["count"] for m in seen] == [N_TEST] * 3  # two shards, exact sum
    assert summary["metrics"] == seen[-1].eval_metrics
    assert list(summary["metrics"]) == ["eval_loss", "count", "f1"]
    # No task.eval_metric among them: eval_value is the first task metric, not the eval loss.
    assert summary["eval_metric"] == "count" and summary["eval_value"] == N_TEST
    assert handle.result.coverage_exact


def test_the_best_bundle_holds_the_weights_its_f1_was_computed_on(run):
    out, _handle, seen, summary = run
    best = summary["best"]
    f1s = [m.eval_metrics["f1"] for m in seen]
    assert best["value"] == pytest.approx(max(f1s)) and best["epoch"] == 1 + f1s.index(max(f1s))
    payload, meta = load_bundle(str(out / "bundle_best"))
    assert meta.save_reason == "best" and meta.epoch == best["epoch"]
    model = model_factory(torch.device("cpu"))
    model.load_state_dict({**payload["params"], **payload["buffers"]})
    model.eval()
    x, y = data("test").tensors
    with torch.no_grad():
        pred = model(x).argmax(1).numpy()
    # The merged shards' F1 is scikit-learn's F1 over the whole eval set, on the same weights.
    assert best["value"] == pytest.approx(f1_score(y.numpy(), pred, average="macro"), abs=1e-5)
    assert load_bundle(str(out / "bundle"))[1].save_reason == "early_stopping"


def test_every_logger_holds_the_final_metrics_of_summary_json(run):
    out, _handle, _seen, summary = run
    job = out / "job"
    final = {f"eval/{k}": v for k, v in summary["metrics"].items()}
    logged = {"csv": csv_last(job / "metrics.csv")}
    if HAVE_WANDB:
        logged["wandb"] = wandb_last(job)
    if HAVE_MLFLOW:
        logged["mlflow"] = mlflow_last(job)
    for name, values in logged.items():
        assert {k: values[k] for k in final} == pytest.approx(final, rel=1e-6), name
        assert values["loss/train"] == pytest.approx(summary["final_loss"], rel=1e-6), name
    steps = csv_last(job / "metrics.csv", "step")
    assert set(steps) == {f"step/rank_{r}/{k}" for r in (0, 1) for k in ("loss", "lr")}
    with open(job / "metrics.csv", newline="") as f:
        logged_steps = [int(r["step"]) for r in csv.DictReader(f) if r["kind"] == "step"]
    assert logged_steps and all(s % 2 == 0 for s in logged_steps)  # log_every_n_steps=2


def test_per_rank_telemetry_is_present_and_plausible(run):
    _out, _handle, seen, summary = run
    telemetry = summary["telemetry"]
    assert [t["rank"] for t in telemetry] == [0, 1] and {t["device"] for t in telemetry} == {"cpu"}
    for t, idle in zip(telemetry, summary["idle_fraction"], strict=True):
        assert 50 < t["peak_mem_mb"] < 8192  # a torch process's peak RSS
        assert 0 < t["data_wait_fraction"] < t["busy_fraction"] < 1
        # Busy plus data wait is the compute time the idle fraction leaves (same clock).
        assert t["busy_fraction"] + t["data_wait_fraction"] == pytest.approx(1 - idle, abs=1e-6)
        # Paced steps past their deadlines are part of that compute time.
        assert 0 <= t["pace_overrun_fraction"] <= t["busy_fraction"] + t["data_wait_fraction"]
    for m in seen:
        for r, s in enumerate(m.per_rank):
            assert s["peak_mem_mb"] > 50 and 0 < s["data_wait_fraction"] < s["busy_fraction"] < 1
            busy_s = (s["busy_fraction"] + s["data_wait_fraction"]) * m.epoch_ms
            assert busy_s == pytest.approx(s["compute_ms"], rel=1e-6), (m.epoch, r)


def not_a_metric() -> float:
    return 0.5


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_bad_metric_refuses_the_run_before_any_rank_trains(tmp_path, ranks):
    """The launcher builds the metrics while the ranks start (their import overlaps the ranks'
    imports); one that is not a metric stops the started ranks before the first window, and
    an in-process rank (one rank) is told to end rather than left waiting for a plan."""
    import threading

    speeds = [1.0, 0.5][:ranks]
    handle = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(partial(data, "train", 512))
        .eval_dataset(partial(data, "test"))
        .metrics({"bad": not_a_metric})
        .batch_size(32)
        .num_epochs(2)
        .elche(ElCheConfig(mode="nccl_cadence"))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=ranks, speeds=speeds, warmup_steps=3))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / "job")
        .run()
    )
    with pytest.raises(TypeError, match=r"task.metrics.bad: must build a torchmetrics Metric"):
        handle.join(timeout=120)
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert summary["status"] == "failed" and "task.metrics.bad" in summary["error"]
    assert summary["samples_seen"] in (0, None) and not summary["loss_curve"]
    logs = sorted(p.name for p in (tmp_path / "job").glob("rank_*.log"))
    assert logs == ([] if ranks == 1 else ["rank_0.log", "rank_1.log"])  # they had started
    assert "flodl-rank0" not in [t.name for t in threading.enumerate()]
