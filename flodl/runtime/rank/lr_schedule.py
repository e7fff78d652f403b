"""The learning rate on a rank: scaled by the world size, and the user's scheduler stepped at the
run's *global* progress (every rank's samples), per step or per epoch.

Ranks of unequal speed run unequal shares of a window, so a per-step scheduler is advanced to the
global step that this rank's progress within the window implies (``schedules.global_samples``),
not once per local batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flodl.data.source import BatchSource, batch_samples
from flodl.runtime.wire.job_spec import JobSpec
from flodl.runtime.wire.messages import Window
from flodl.step import schedules


def scale_lr(optimizer: torch.optim.Optimizer, world_size: int, ratio: float) -> None:
    """``trainer.lr_scale_ratio``: every group's lr times ``1 + (world_size - 1) * ratio``."""
    factor = 1.0 + (world_size - 1) * ratio
    if factor != 1.0:
        for group in optimizer.param_groups:
            group["lr"] *= factor


class LrSchedule:
    """The rank's scheduler (None without ``scheduler_factory``) and the run's global clock."""

    def __init__(
        self,
        spec: JobSpec,
        rank: int,
        device: torch.device,
        distributed: bool,
        source: BatchSource,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        """Built once the rank's optimizer and batch size are final (after the memory plan);
        gathers every rank's batch size when they vary (a collective on the start-up group)."""
        self.spec = spec
        self.cfg = spec.config
        self.rank = rank
        self.device = device
        self.distributed = distributed
        self.batch_size = int(source.batch_size)
        self.per_step = self.spec.scheduler_interval == "step"
        self.run_length = schedules.RunLength(
            self.cfg.num_epochs * len(source), self._global_batch()
        )
        total = self.run_length.total_steps if self.per_step else self.cfg.num_epochs
        factory = self.spec.scheduler_factory
        self.scheduler = schedules.build(factory, optimizer, total) if factory else None
        self._clock = (0, 0, 0)  # (progress before the window, its samples, this rank's share)
        self._own_done = 0

    def _rank_sizes(self) -> list[int]:
        """Every rank's batch size; probed ones are gathered, so all ranks agree on the sum."""
        sizes = [self.spec.batch_size_for(r) for r in range(self.spec.world_size)]
        varies = any(b is None for b in sizes) or self.cfg.cluster.plans_choose_batches()
        if varies and self.distributed:
            gathered = torch.zeros(self.spec.world_size, dtype=torch.int64, device=self.device)
            gathered[self.rank] = self.batch_size
            dist.all_reduce(gathered)
            return [int(b) for b in gathered]
        return [
            self.batch_size if b is None or r == self.rank else int(b) for r, b in enumerate(sizes)
        ]

    def _global_batch(self) -> int:
        """Samples of one global step: every rank's batch, times the micro-batches per step."""
        return sum(self._rank_sizes()) * self.cfg.accumulate_grad_batches

    def begin(self, window: Window) -> None:
        """A window starts: where the run is, and this rank's share of the window."""
        own = sum(size for _, size in window.chunks)
        self._clock, self._own_done = (window.progress, window.window_samples, own), 0

    def new_epoch(self) -> None:
        """A new epoch begins after another: a per-epoch scheduler steps."""
        if self.scheduler is not None and not self.per_step:
            self.scheduler.step()

    def tick(self, batch: Any) -> None:
        """Advance a per-step scheduler to the global progress after this batch."""
        if self.scheduler is None or not self.per_step:
            return
        before, in_window, own_total = self._clock
        samples = batch_samples(batch)
        self._own_done += samples if samples is not None else self.batch_size
        done = schedules.global_samples(before, in_window, self._own_done, own_total)
        schedules.advance_to(self.scheduler, self.run_length.target_step(done))

    def to_window_end(self) -> None:
        """A window without a batch here whose step this rank still took (sharded optimizer
        state): a per-step scheduler goes to the window's end, where the others are."""
        if self.scheduler is None or not self.per_step:
            return
        before, in_window, _ = self._clock
        schedules.advance_to(self.scheduler, self.run_length.target_step(before + in_window))
