"""Early stopping and keep-best bookkeeping on fake epochs — no processes."""

from __future__ import annotations

import math

import pytest

from flodl.config import ConfigError, EarlyStoppingConfig, MonitorConfig
from flodl.monitor.callbacks import EarlyStopping, Watch, stop_request
from flodl.monitor.metrics import EpochMetrics


def _epoch(epoch: int, loss: float, **evals: float) -> EpochMetrics:
    return EpochMetrics(epoch=epoch, avg_loss=loss, epoch_ms=1.0, eval_metrics=dict(evals))


def test_min_delta_decides_what_counts_as_an_improvement() -> None:
    stop = EarlyStopping(EarlyStoppingConfig(monitor="eval_loss", patience=2, min_delta=0.1))
    losses = [1.0, 0.95, 0.8, 0.75, 0.72]  # only 1.0 -> 0.8 improves by more than 0.1
    verdicts = [stop.should_stop(_epoch(i + 1, 1.0, eval_loss=v)) for i, v in enumerate(losses)]
    assert verdicts == [False, False, False, False, True]
    assert (stop.best, stop.best_epoch, stop.stale) == (0.8, 3, 2)


def test_unevaluated_and_non_finite_epochs_are_not_observed() -> None:
    watch = Watch(MonitorConfig(monitor="accuracy", mode="max"), "trainer.save_best")
    assert watch.observe(_epoch(1, 1.0)) is None  # eval_every skipped this epoch
    assert watch.observe(_epoch(2, 1.0, accuracy=math.nan)) is None
    assert watch.observe(_epoch(3, 1.0, accuracy=0.5)) is True
    assert watch.observe(_epoch(4, 1.0, accuracy=0.5)) is False  # equal is not better
    assert watch.to_dict() == {"monitor": "accuracy", "mode": "max", "value": 0.5, "epoch": 3}


def test_train_loss_is_watched_every_epoch() -> None:
    stop = EarlyStopping(EarlyStoppingConfig(monitor="train_loss", patience=1))
    assert [stop.should_stop(_epoch(i + 1, v)) for i, v in enumerate([0.5, 0.4, 0.45])] == [
        False,
        False,
        True,
    ]


def test_an_unknown_monitor_names_the_key_and_the_known_metrics() -> None:
    watch = Watch(MonitorConfig(monitor="f1", mode="max"), "trainer.save_best")
    with pytest.raises(ConfigError, match=r"trainer.save_best.monitor=f1: .*train_loss, accuracy"):
        watch.observe(_epoch(1, 1.0, accuracy=0.9))


def test_a_metrics_fn_stops_with_true_or_a_reason_only() -> None:
    assert stop_request(True) == "metrics_fn" and stop_request("plateau") == "plateau"
    assert [stop_request(v) for v in (None, False, "", 1, 0.5)] == [None] * 5
