"""The cooperative tier: you own the loop body; the controller keeps cadence, partition, eval.

    worker = Trainer.builder(model_factory, optim_factory, train_step).dataset(ds).into_worker()
    for epoch in worker.epochs():
        for batch in worker.batches():
            worker.optimizer.zero_grad()
            loss = my_loss(worker.model, batch)
            loss.backward()
            worker.optimizer.step()
            worker.step(loss)            # paces (CPU rig) and records the loss
    state = worker.finish()              # TrainedState in the launcher

For ``trainer.precision`` and ``trainer.accumulate_grad_batches`` use ``with worker.autocast():``
around the forward and ``worker.backward(loss)`` in place of ``backward()`` + ``optimizer.step()``.

With two or more ranks this tier re-executes your script once per rank, as torchrun does: the
launcher runs ``sys.orig_argv`` again with the rank role in the environment, so code *before*
``into_worker()`` runs on every rank. On a rank, ``finish()`` ends the process; code after it runs
once, in the launcher, where ``epochs()`` yields nothing and ``finish()`` returns the trained state.
"""

from __future__ import annotations

import collections
import math
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch

from flodl.runtime.rank.loop import RankLoop, WindowTally
from flodl.runtime.wire.messages import Plan, Regroup, Stop, Window


class CooperativeWorker:
    """Drives a rank's :class:`RankLoop` from your loop instead of the managed one."""

    def __init__(self, core: RankLoop, finish_hook: Any = None) -> None:
        self._core = core
        self._finish_hook = finish_hook
        self._queue: collections.deque[Window] = collections.deque()
        self._window: Window | None = None
        self._tally: WindowTally | None = None
        self._step_started = 0.0
        self._pending_loss: float | None = None
        self._finished = False

    # -- what the loop body needs ------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self._core.setup.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._core.setup.optimizer

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def world_size(self) -> int:
        return self._core.spec.world_size

    @property
    def device(self) -> torch.device:
        return self._core.device

    # -- iteration ----------------------------------------------------------------------------
    def epochs(self) -> Iterator[int]:
        """The epochs this rank takes part in, as the controller plans them, counted from 1 like
        the console, the callbacks and TensorBoard."""
        while True:
            if self._window is None:
                self._window = self._next_window()
            if self._window is None:
                return
            epoch = self._window.epoch
            yield epoch + 1
            if self._window is not None and self._window.epoch == epoch:
                raise RuntimeError("consume worker.batches() fully before the next epoch")

    def batches(self) -> Iterator[list[torch.Tensor]]:
        """This rank's batches of the current epoch; call :meth:`step` once per batch."""
        if self._window is None:
            raise RuntimeError("call worker.batches() inside `for epoch in worker.epochs()`")
        epoch = self._window.epoch
        while self._window is not None and self._window.epoch == epoch:
            window = self._window
            self._tally = self._core.begin_window(window)
            batches = self._core.loading.window_batches(window)
            for batch in self._core.loading.timed(batches, self._tally):
                self._pending_loss = None
                self._step_started = time.perf_counter()
                yield batch
                if self._pending_loss is None:
                    raise RuntimeError("call worker.step(loss) once for every batch")
                self._tally.add(self._pending_loss)
                self._core.schedule.tick(batch)
                self._core.log_step(self._tally)
            # worker.backward's last group: step before averaging
            if self._core.setup.parts.runner.pending:
                self._core.steps.optimizer_step()
            self._core.end_window(window, self._tally)
            self._window = self._next_window()

    def autocast(self) -> Any:
        """A context for the forward pass in ``trainer.precision`` (no-op for 32)."""
        return self._core.setup.parts.runner.autocast()

    def backward(self, loss: torch.Tensor) -> bool:
        """``loss.backward()`` the managed way: scaled under 16-mixed, and the optimizer step
        (clipping, scaler) once ``accumulate_grad_batches`` micro-batches are in, or at the end of
        the window. True when this call stepped. Use it instead of ``backward()`` + ``step()``."""
        runner = self._core.setup.parts.runner
        runner.backward(loss)
        if not runner.due:
            return False
        self._core.steps.optimizer_step()
        return True

    def step(self, loss: torch.Tensor | float) -> None:
        """Record the batch's loss and pad the step to its CPU-rig deadline."""
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self._pending_loss = value if math.isfinite(value) else math.nan
        pacer = self._core.pacer
        if pacer.step_s is not None:
            delay = self._step_started + pacer.step_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)

    def finish(self) -> Any:
        """Wait for the end of the run. On a rank process this exits the process."""
        for _ in self.epochs():
            raise RuntimeError("finish() called before the last epoch was trained")
        if self._finish_hook is not None:
            return self._finish_hook()
        return None

    def _next_window(self) -> Window | None:
        while not self._queue:
            if self._finished:
                return None
            msg = self._core.peers.next_message()
            if isinstance(msg, Plan):
                self._queue.extend(w for w in msg.windows if not self._core.is_void(w))
                self._core.loading.feed(self._queue)  # the loader's workers start on them now
            elif isinstance(msg, Stop):
                self._core.finish(msg)
                self._core.data.close()
                self._finished = True
            else:
                self._core.handle(msg)
                if isinstance(msg, Regroup):  # windows planned for the old membership go
                    self._queue = collections.deque(
                        w for w in self._queue if not self._core.is_void(w)
                    )
        return self._queue.popleft()


class LauncherView:
    """What ``into_worker()`` returns in the launcher once the ranks have trained."""

    def __init__(self, state: Any) -> None:
        self._state = state
        self.rank = -1

    def epochs(self) -> Iterator[int]:
        return iter(())

    def batches(self) -> Iterator[list[torch.Tensor]]:
        return iter(())

    def step(self, loss: Any) -> None:
        raise RuntimeError("the launcher trains nothing itself")

    def finish(self) -> Any:
        return self._state


def exit_rank(code: int = 0) -> None:
    """End a re-executed rank process after its cohort is done."""
    sys.stdout.flush()
    sys.exit(code)
