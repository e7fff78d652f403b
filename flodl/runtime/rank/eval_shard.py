"""Evaluation on a rank: the task's metrics over this rank's shard of the eval set, their states
sent to the controller, which merges the shards (the launcher's metrics, built once)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from flodl.data.loader import eval_batches
from flodl.monitor.metrics import drain_scalars
from flodl.runtime.rank import blame
from flodl.runtime.wire import chaos
from flodl.runtime.wire.messages import EvalResult, Window
from flodl.step import evaluation


class EvalShard:
    """The rank's part of an evaluation (``eval_source`` None: the run has no eval set)."""

    def __init__(
        self,
        rank: int,
        model: nn.Module,
        eval_source: Any,
        loader_cfg: Any,
        spec_evaluation: Any,
        device: torch.device,
        link: Any,
    ) -> None:
        self.rank = rank
        self.model = model
        self.eval_source = eval_source
        self.loader_cfg = loader_cfg
        self.evaluation = spec_evaluation  # the task's eval step and metrics (JobSpec)
        self.device = device
        self.link = link

    def evaluate(self, window: Window) -> float:
        """Update the task's metrics over this rank's eval shard and send their states; the
        milliseconds it took (not the sync's: the loop subtracts them)."""
        assert self.eval_source is not None
        chaos.point("eval", self.rank)
        t0 = time.perf_counter()
        shard, shards = window.eval_shard
        start, stop = evaluation.shard_range(len(self.eval_source), shard, shards)
        with blame.user_code("evaluation"):  # the eval step, metrics and eval dataset
            parts = evaluation.evaluate(
                self.model,
                eval_batches(self.eval_source, self.loader_cfg, start, stop),
                self.evaluation,
                self.device,
            )
        drain_scalars()  # an eval step that records scalars must not leak them into training
        ms = (time.perf_counter() - t0) * 1000.0
        self.link.send(EvalResult(self.rank, window.epoch, window.index, parts, ms, shard))
        return ms
