"""Callbacks that act: early stopping and keep-best, decided on the launcher per closed epoch.

Pure bookkeeping over :class:`~flodl.monitor.metrics.EpochMetrics` (no processes, no I/O); the
controller turns a stop into a graceful stop of every rank and a new best into a bundle.
"""

from __future__ import annotations

import math
from typing import Any

from flodl.config import ConfigError, EarlyStoppingConfig, MonitorConfig
from flodl.monitor.metrics import EpochMetrics

TRAIN_LOSS = "train_loss"  # monitor name of the epoch's mean training loss


def monitored(m: EpochMetrics, name: str, key: str) -> float | None:
    """The value of ``name`` in this epoch; None when the epoch was not evaluated.

    ``key`` is the config key, for the error when an evaluated epoch lacks the name.
    """
    if name == TRAIN_LOSS:
        return m.avg_loss if math.isfinite(m.avg_loss) else None
    if not m.eval_metrics:
        return None
    if name not in m.eval_metrics:
        known = ", ".join([TRAIN_LOSS, *m.eval_metrics])
        raise ConfigError(f"{key}.monitor={name}: not a metric of this run; known: {known}")
    value = m.eval_metrics[name]
    return value if math.isfinite(value) else None


class Watch:
    """The best value of one monitored quantity and how many of its epochs since it improved."""

    def __init__(self, config: MonitorConfig, key: str, min_delta: float = 0.0) -> None:
        self.config = config
        self.key = key
        self.min_delta = min_delta
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.stale = 0  # observed epochs since the last improvement

    def observe(self, m: EpochMetrics) -> bool | None:
        """True when ``m`` improves on the best, False when not, None when not observed."""
        value = monitored(m, self.config.monitor, self.key)
        if value is None:
            return None
        if self.best is None or self._better(value, self.best):
            self.best, self.best_epoch, self.stale = value, m.epoch, 0
            return True
        self.stale += 1
        return False

    def _better(self, value: float, best: float) -> bool:
        if self.config.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta

    def to_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.config.monitor,
            "mode": self.config.mode,
            "value": self.best,
            "epoch": self.best_epoch,
        }


class EarlyStopping(Watch):
    """Stop once ``patience`` observed epochs in a row have not improved by ``min_delta``."""

    def __init__(self, config: EarlyStoppingConfig) -> None:
        super().__init__(config, "trainer.early_stopping", config.min_delta)
        self.patience = config.patience

    def should_stop(self, m: EpochMetrics) -> bool:
        self.observe(m)
        return self.stale >= self.patience


def stop_request(returned: Any) -> str | None:
    """What a ``metrics_fn`` return value asks: a reason to stop, or None to go on."""
    if isinstance(returned, str):
        return returned or None
    return "metrics_fn" if returned is True else None
