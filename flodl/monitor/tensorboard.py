"""TensorBoard event files for one job: launcher aggregates in ``tb/``, each rank in ``tb/rank_N/``.

Exactly one ``SummaryWriter`` per directory (two writers in one directory produce two event
files that TensorBoard interleaves unpredictably), so hparams are written into the aggregate
writer itself instead of through ``add_hparams``, which opens a writer of its own. Everything is
logged from the launcher, which already receives every rank's numbers; ranks write nothing.

``torch.utils.tensorboard`` is imported only when a logger is enabled, so importing this module
stays cheap and a disabled logger never touches torch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from flodl.monitor.metrics import EpochMetrics, SyncEvent

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

HParamValue = str | int | float | bool | None
log = logging.getLogger(__name__)
_Method = TypeVar("_Method", bound=Callable[..., None])


def _guarded(method: _Method) -> _Method:
    """A logging method that never raises: a failed write turns TensorBoard off, once."""

    @functools.wraps(method)
    def run(self: RunLogger, *args: Any, **kwargs: Any) -> None:
        if self._closed:
            return
        try:
            method(self, *args, **kwargs)
        except Exception as exc:
            self._degrade(exc)

    return run  # type: ignore[return-value]


class RunLogger:
    """Writes one job's scalars, hparams and config into ``<job_dir>/tb``.

    Safe to call from several launcher threads (sync events arrive on the controller's thread,
    epochs on the main one). Disabled, every method is a no-op and no file is created.
    """

    def __init__(self, job_dir: Path, world_size: int, enabled: bool = True) -> None:
        self.root = Path(job_dir) / "tb"
        self.world_size = world_size
        self.enabled = enabled
        self._closed = not enabled
        self._lock = threading.Lock()
        self._writers: dict[int | None, SummaryWriter] = {}
        self._open()  # the aggregate directory exists from the start (when enabled)

    @_guarded
    def _open(self) -> None:
        self._writer(None)

    def rank_dir(self, rank: int) -> Path:
        """Directory of rank ``rank``'s event file."""
        return self.root / f"rank_{rank}"

    def _writer(self, rank: int | None) -> SummaryWriter | None:
        """The writer of a directory, or None once closed (another thread may have closed it)."""
        # Rank writers are created on first use: each SummaryWriter owns a flushing thread,
        # and a rank that never reports should not leave an empty directory behind.
        with self._lock:
            if self._closed:
                return None
            writer = self._writers.get(rank)
            if writer is None:
                from torch.utils.tensorboard import SummaryWriter

                logdir = self.root if rank is None else self.rank_dir(rank)
                writer = SummaryWriter(log_dir=str(logdir), flush_secs=10)
                self._writers[rank] = writer
            return writer

    def _degrade(self, exc: Exception) -> None:
        """A write failed (a full disk): one warning, and TensorBoard logging is off for the
        rest of the run; training goes on (issue 41: a writer error aborted it)."""
        from flodl.monitor.failures import write_failure

        with self._lock:
            if self._closed:
                return
            self._closed = True
            writers, self._writers = list(self._writers.values()), {}
        log.warning(
            "%s; tensorboard logging is off for the rest of the run", write_failure(exc, self.root)
        )
        for writer in writers:
            with contextlib.suppress(Exception):
                writer.close()

    def _scalar(self, rank: int | None, tag: str, value: float | None, step: int) -> None:
        if value is None:
            return
        writer = self._writer(rank)
        if writer is not None:
            writer.add_scalar(tag, float(value), global_step=step)

    @_guarded
    def sync_event(self, ev: SyncEvent) -> None:
        """One averaging event: anchor, overhead, sync time, divergence; batches per rank."""
        if self._closed:
            return
        step = ev.index
        self._scalar(None, "elche/anchor", ev.anchor, step)
        self._scalar(None, "elche/overhead", ev.overhead, step)
        self._scalar(None, "elche/sync_ms", ev.sync_ms, step)
        self._scalar(None, "elche/divergence", ev.divergence, step)
        for rank, batches in enumerate(ev.batches):
            self._scalar(rank, "elche/batches", batches, step)

    @_guarded
    def epoch(self, m: EpochMetrics) -> None:
        """One epoch's aggregates in ``tb/`` and each rank's loss, throughput and share."""
        if self._closed:
            return
        step = m.epoch  # counts from 1, as the console's "epoch n/N"
        self._scalar(None, "loss/train", m.avg_loss, step)
        self._scalar(None, "eval/value", m.eval_value, step)
        # Not ``elche/anchor``: that tag is stepped by sync index, and one tag on two step
        # axes draws a zigzag in TensorBoard.
        self._scalar(None, "epoch/anchor", m.anchor, step)
        self._scalar(None, "epoch/overhead", m.overhead, step)
        self._scalar(None, "time/epoch_ms", m.epoch_ms, step)
        self._scalar(None, "lr", m.lr, step)
        for name, value in m.scalars.items():
            self._scalar(None, f"scalars/{name}", value, step)
        for name, value in m.eval_metrics.items():
            self._scalar(None, f"eval/{name}", value, step)
        for rank, stats in enumerate(m.per_rank):
            self._scalar(rank, "loss/train", stats.get("loss"), step)
            for key in (
                "busy_fraction",
                "data_wait_fraction",
                "pace_overrun_fraction",
                "peak_mem_mb",
            ):
                self._scalar(rank, f"telemetry/{key}", stats.get(key), step)
        for rank, throughput in enumerate(m.per_rank_throughput):
            self._scalar(rank, "throughput/samples_per_s", throughput, step)
        for rank, share in enumerate(m.per_rank_batch_share):
            self._scalar(rank, "share/batch", share, step)

    @_guarded
    def steps(self, rank: int, steps: tuple[tuple[int, float, float], ...]) -> None:
        """Every ``logger.log_every_n_steps``-th training step of a rank: loss and LR."""
        for step, loss, lr in steps:
            self._scalar(rank, "step/loss", loss, step)
            self._scalar(rank, "step/lr", lr, step)

    @_guarded
    def hparams(
        self, hparams: Mapping[str, HParamValue], metrics: Mapping[str, float | None]
    ) -> None:
        """Record this job's knobs and final metrics for TensorBoard's HParams view.

        Metric names should not collide with scalar tags logged elsewhere (use e.g.
        ``final/loss``): the HParams view reads a metric's value from the scalar of that tag.
        """
        if self._closed:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        clean_h: dict[str, Any] = {k: _hparam_value(v) for k, v in hparams.items()}
        clean_m = {k: float(v) for k, v in metrics.items() if v is not None}
        exp, start, end = hparams_summary(clean_h, clean_m)
        writer = self._writer(None)
        if writer is None:
            return
        file_writer = writer.file_writer
        assert file_writer is not None, "SummaryWriter opens its file writer on construction"
        for summary in (exp, start, end):
            file_writer.add_summary(summary)
        for tag, value in clean_m.items():
            writer.add_scalar(tag, value, global_step=0)

    @_guarded
    def config_text(self, text: str) -> None:
        """The resolved config, shown in TensorBoard's Text tab under the tag ``config``."""
        writer = self._writer(None)
        if writer is not None:
            writer.add_text("config", f"```yaml\n{text.rstrip()}\n```", global_step=0)

    @_guarded
    def flush(self) -> None:
        """Push buffered events to disk (TensorBoard reads only what is flushed)."""
        with self._lock:
            writers = list(self._writers.values())
        for writer in writers:
            writer.flush()

    def close(self) -> None:
        """Flush and close every writer; later calls to any method do nothing."""
        with self._lock:
            self._closed = True
            writers, self._writers = list(self._writers.values()), {}
        for writer in writers:
            try:
                writer.close()
            except Exception as exc:  # flushing onto a full disk: warned, never raised
                from flodl.monitor.failures import write_failure

                log.warning("closing tensorboard: %s", write_failure(exc, self.root))

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hparam_value(value: HParamValue) -> str | int | float | bool:
    """HParams accepts bool, number or string only, so an unset knob is shown as "none"."""
    return "none" if value is None else value
