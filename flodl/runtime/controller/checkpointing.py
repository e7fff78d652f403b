"""Checkpointing: the controller's side of saving — bundles collected from the ranks' shards,
committed with the controller's own facts, the best epoch kept, a failed save survived.

A part of :class:`flodl.runtime.controller.controller.Controller`. The :class:`Checkpointing` part
owns the
bundle writer (:class:`~flodl.runtime.controller.snapshots.Checkpointer`), keep-best's watch and
verdicts
and the save error; what a commit records of the run it asks for through ``facts``, and a save
that fails mid-run asks the controller to stop through ``stop``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flodl.checkpoint import shards
from flodl.config import MonitorConfig
from flodl.monitor.callbacks import Watch
from flodl.monitor.metrics import EpochMetrics
from flodl.runtime.controller.snapshots import (
    Checkpointer,
    PendingSave,
    ShardWriteFailed,
)
from flodl.runtime.wire import chaos
from flodl.runtime.wire.messages import RankState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CommitFacts:
    """What a committed bundle records of the run, as the controller knows it now."""

    epoch: int  # epochs done: where a resumed run starts
    uncovered: list = field(default_factory=list)  # that epoch's samples not trained yet
    controller_state: dict[str, Any] | None = None  # cpu_*: EASGD centre, outer momentum
    lost_ranks: list[int] = field(default_factory=list)
    launch_world: int = 1
    global_step: int = 0
    sync_round: int = 0
    elche_state: dict[str, Any] | None = None
    n_samples: int = 0


class Checkpointing:
    """Collects, commits and keeps the best of the run's bundles (``checkpointer``: None
    when nothing is saved)."""

    def __init__(
        self,
        save_best: MonitorConfig | None,
        checkpointer: Checkpointer | None,
        facts: Callable[[int | None], CommitFacts],
        stop: Callable[[str], None],
    ) -> None:
        self.checkpointer = checkpointer
        self._facts = facts  # save.epoch (None: the end of the run, or a stop) -> the facts
        self._stop = stop
        self.best = Watch(save_best, "trainer.save_best") if save_best is not None else None
        self._best_verdicts: dict[int, bool] = {}  # epoch -> improved?
        self._committed_epoch: int | None = None  # epochs done in the bundle at save_path
        self.save_error: str | None = None  # set when a bundle could not be written

    @property
    def pending(self) -> bool:
        return self.checkpointer is not None and bool(self.checkpointer.pending)

    @property
    def saved(self) -> list[str]:
        return list(self.checkpointer.saved) if self.checkpointer is not None else []

    def sign(self, signature: str) -> None:
        """The model's architecture fingerprint, recorded in every bundle."""
        if self.checkpointer is not None:
            self.checkpointer.signature = signature

    def open_final(self, reason: str, alive: list[int], writer: int) -> str:
        """The end-of-run save's tag ("" when nothing is saved, or a save already failed)."""
        if self.checkpointer is None or not self.checkpointer.enabled or self.save_error:
            return ""
        return self.checkpointer.open(-1, reason, None, alive, writer=writer).tag

    def write_controller_state(self, state: dict[str, Any]) -> bool:
        """Write the controller's own shard into every pending save now (at Stop, so the
        controller can drop that state); False when a write failed (kept: the commit tries
        again and reports it)."""
        if self.checkpointer is None or self.checkpointer.stem is None:
            return True
        for save in list(self.checkpointer.pending.values()):
            if shards.CONTROLLER in save.written:
                continue
            try:
                save.written[shards.CONTROLLER] = shards.write_shard(
                    self.checkpointer.stem, save.tag, shards.CONTROLLER, state
                )
            except Exception as exc:
                log.warning("writing the controller shard at stop failed: %s", exc)
                return False
        return True

    def final_save(self) -> PendingSave | None:
        """The end-of-run save still collecting shards, if any."""
        return self.checkpointer.pending.get(-1) if self.checkpointer is not None else None

    def on_rank_state(self, msg: RankState) -> None:
        assert self.checkpointer is not None
        try:
            save = self.checkpointer.collect(msg)
            if save is not None:
                self._commit(save)
        except Exception as exc:
            self._save_failed(exc, mid_run=msg.window >= 0)

    def after_loss(self, rank: int, successor: int | None, mid_run: bool) -> None:
        """``rank`` is lost: its shards of open saves are written by ``successor`` (or the
        saves wait for the regroup)."""
        if self.checkpointer is None:
            return
        try:
            for save in self.checkpointer.lose(rank, successor):
                self._commit(save)
        except Exception as exc:
            self._save_failed(exc, mid_run=mid_run)

    def _save_failed(self, exc: Exception, mid_run: bool) -> None:
        """A bundle could not be written: never lose what was trained. Stop cleanly; the trained
        state still reaches the launcher (Final), which writes it to the job directory."""
        from flodl.monitor.failures import describe

        assert self.checkpointer is not None
        detail = str(exc) if isinstance(exc, ShardWriteFailed) else describe(exc)
        self.save_error = f"saving a checkpoint to {self.checkpointer.stem} failed: {detail}"
        if mid_run:
            log.error("%s; stopping", self.save_error)
            self._stop("checkpoint save failed")
        else:  # the end-of-run save: the run is over, the trained state still reaches the job
            log.error("%s (the end-of-run save)", self.save_error)

    def observe(self, epoch: int, metrics: EpochMetrics) -> None:
        """Keep-best: judge a closed epoch; its bundle is copied once it is committed."""
        if self.best is not None:
            self._best_verdicts[epoch] = bool(self.best.observe(metrics))
            self._write_best(epoch)

    def _write_best(self, epoch: int) -> None:
        """Once an evaluated epoch has both its verdict and its committed bundle: if it was the
        best so far, copy that bundle to ``<save_path>_best``."""
        if epoch not in self._best_verdicts:
            return
        if self._committed_epoch is None or self._committed_epoch < epoch + 1:
            return  # its bundle is still being written; _commit calls again
        improved = self._best_verdicts.pop(epoch)
        if not improved:
            return
        assert self.checkpointer is not None and self.checkpointer.stem is not None
        if self._committed_epoch != epoch + 1:
            log.warning("epoch %d was the best, but its bundle was replaced before", epoch + 1)
            return
        best = self.checkpointer.stem + "_best"
        shards.copy_bundle(self.checkpointer.stem, best, "best")
        log.info("kept the best bundle %s (epoch %d)", best, epoch + 1)

    def _commit(self, save: PendingSave) -> None:
        """Every expected shard is written: add the controller's own, then the meta."""
        assert self.checkpointer is not None
        chaos.point("checkpoint_write")
        facts = self._facts(save.epoch)
        if facts.controller_state is not None and shards.CONTROLLER not in save.written:
            assert self.checkpointer.stem is not None
            save.written[shards.CONTROLLER] = shards.write_shard(
                self.checkpointer.stem, save.tag, shards.CONTROLLER, facts.controller_state
            )
        epoch = facts.epoch
        self.checkpointer.commit(
            save,
            extra={"lost_ranks": facts.lost_ranks, "launch_world": facts.launch_world},
            epoch=epoch,
            global_step=facts.global_step,
            sync_round=facts.sync_round,
            elche_state=facts.elche_state,
            coverage={"epoch": epoch, "n_samples": facts.n_samples, "uncovered": facts.uncovered},
        )
        self._committed_epoch = epoch
        if self.best is not None and save.epoch is not None:
            self._write_best(epoch - 1)
