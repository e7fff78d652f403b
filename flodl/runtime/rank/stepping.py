"""One training step on a rank: a micro-batch's forward and backward in the run's precision, the
optimizer step once ``accumulate_grad_batches`` are in, and what is done about NaN/inf (a loss or
gradients skipped and counted; weights never leave the rank).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from flodl.runtime.rank import blame
from flodl.runtime.rank.setup import ModelParts
from flodl.runtime.rank.sync_modes import SyncMode
from flodl.runtime.wire.job_spec import JobSpec

log = logging.getLogger(__name__)


class RankStep:
    """The step of one rank, with what it reads of the rank once built: the model (and the
    compiled one the step runs), the optimizer after the memory plan, the step runner, the sync
    mode (nccl_sync's gradient all-reduce) and the flat state (the weights' check)."""

    def __init__(
        self,
        rank: int,
        spec: JobSpec,
        parts: ModelParts,
        optimizer: torch.optim.Optimizer,
        sync: SyncMode,
        epoch: Callable[[], int],
    ) -> None:
        self.rank = rank
        self.cfg = spec.config
        self.spec = spec
        self.model = parts.model
        self.train_model = parts.train_model
        self.optimizer = optimizer
        self.runner = parts.runner
        self.sync = sync
        self.state = parts.state
        self.epoch = epoch  # the loop's current epoch (0-based), for the messages
        self._nonfinite = 0

    def train_batch(self, batch: list[torch.Tensor], last: bool = False) -> float:
        """One micro-batch: forward in the run's precision, backward, and the optimizer step once
        ``accumulate_grad_batches`` micro-batches are in (or ``last``: the window ends)."""
        self.sync.arm(last)
        with blame.user_code("train_step"), self.runner.autocast():
            loss = self.spec.train_step(self.train_model, batch)
        value = float(loss.detach())
        if not math.isfinite(value):
            value = self._skip_nonfinite("loss", f"non-finite loss ({value})")
        else:
            self.runner.backward(loss)
        if self.runner.due or last:
            self.optimizer_step()
        return value

    def optimizer_step(self) -> None:
        """Step over the pending micro-batches; one whose gradients are not finite (checked in
        every precision, after the gradient all-reduce of nccl_sync) is skipped and counted."""
        self.sync.reduce_gradients()
        stepped = self.runner.step(self.model, self.optimizer)
        self.sync.after_step(stepped)  # memory_plan shard: the owners' pieces to the others
        if not stepped:
            scaler = " (16-mixed: the GradScaler lowered its scale)" if self.runner.scaler else ""
            self._skip_nonfinite("gradients", f"non-finite gradients{scaler}")

    def null_step(self) -> None:
        """A window with no batch for this rank whose gradients the cohort all-reduces
        (nccl_sync with sharded optimizer state, an epoch's tail): no forward or backward, the
        rank's zero gradient (weight 0) in the all-reduce, then the step of its pieces with
        the others' gradient, and their broadcast, as every rank does."""
        self.sync.arm(True)
        self.runner.pending = 1  # one micro-batch's worth: the all-reduced gradient, as is
        self.optimizer_step()

    def _skip_nonfinite(self, kind: str, what: str) -> float:
        """NaN/inf loss or gradients: skip the step (no update; its gradients are dropped) with
        a warning; past ``trainer.max_nonfinite`` such steps the job fails, naming this rank
        and the kind (``loss`` or ``gradients``)."""
        self._nonfinite += 1
        limit = self.cfg.max_nonfinite
        log.warning(
            "rank %d: %s in epoch %d; step skipped (%d of %d allowed)",
            self.rank,
            what,
            self.epoch(),
            self._nonfinite,
            limit,
        )
        if self._nonfinite > limit:
            verb = "was" if kind == "loss" else "were"
            advice = (
                "Lower the learning rate or set trainer.max_grad_norm"
                if self.cfg.max_grad_norm is None
                else f"Lower the learning rate (trainer.max_grad_norm={self.cfg.max_grad_norm} "
                "is set: clipping cannot mend NaN/inf)"
            )
            raise blame.NonFiniteError(
                f"{kind} {verb} NaN/inf {self._nonfinite} times (trainer.max_nonfinite={limit}) "
                f"on rank {self.rank}; stopping. {advice}; bundles saved earlier are untouched"
            )
        return math.nan

    def check_weights(self, when: str) -> None:
        """Non-finite weights never leave this rank: not into an average, a checkpoint or the
        final model. Design (issue 41): such a rank fails the job, named with the kind
        ``weights`` (``trainer.on_rank_error=drop`` drops it instead, and the others go on
        from their own average); it is never averaged in, and no bundle is written over the
        last good one. Skipped non-finite steps make this rare: what is left is an update
        that overflowed, or a step that wrote into the weights itself."""
        if self.state.finite():
            return
        raise blame.NonFiniteError(
            f"the weights of rank {self.rank} are NaN/inf {when} (epoch {self.epoch() + 1}); "
            "they are not averaged in nor saved, bundles saved earlier are untouched. Resume "
            "from the last one with a lower learning rate or trainer.max_grad_norm"
        )
