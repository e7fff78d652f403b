"""One run from the launcher's side: pick the topology, start the cohort, watch it, write outputs.

Outputs per job directory: ``summary.json``, ``model.pt`` (the :class:`TrainedState`),
``elche_trace.jsonl`` (one line per averaging event), TensorBoard files under ``tb/`` and
``rank_N.log`` for each rank process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from flodl.checkpoint.lock import SaveLock, StemLocked
from flodl.checkpoint.results import RunResult, TrainedState
from flodl.checkpoint.store import write_atomic
from flodl.config import ConfigError
from flodl.monitor.failures import write_failure
from flodl.monitor.metrics import EpochMetrics, RunSummary, SyncEvent
from flodl.placement.batches import place_batches
from flodl.placement.topology import Topology, resolve_topology
from flodl.preflight import (
    check_launch,
    check_run,
    format_lr_scaling,
    launch_signature,
    rank_loaders,
)
from flodl.runtime.cohorts.factory import open_cohort
from flodl.runtime.cohorts.protocol import Cohort, run_cohort
from flodl.runtime.controller.build import new_controller
from flodl.runtime.controller.controller import (
    Controller,
    ControllerResult,
    Hooks,
    RunFailed,
)
from flodl.runtime.controller.snapshots import ResumePoint
from flodl.runtime.wire.job_spec import Callbacks, JobSpec
from flodl.runtime.wire.rank_env import ExternalRole
from flodl.step.evaluation import primary_name

log = logging.getLogger(__name__)


def _lock_save_path(save_path: str | None, job_dir: Path) -> SaveLock | None:
    """One saver per stem (:mod:`flodl.checkpoint.lock`): a second job is refused, exit 2."""
    if save_path is None:
        return None
    try:
        return SaveLock.take(save_path, job_dir.absolute())
    except StemLocked as exc:
        raise ConfigError(
            f"trainer.save_path={save_path}: {exc}; wait for that job to end, or choose "
            "another save_path"
        ) from None


def default_job_dir() -> Path:
    return Path("flodl_runs") / time.strftime("%Y%m%d-%H%M%S") / f"pid{os.getpid()}"


class Job:
    def __init__(
        self,
        spec: JobSpec,
        callbacks: Callbacks,
        job_dir: str | Path | None,
        eval_metric: str,
        run_info: dict[str, Any],
        placed: ExternalRole | None = None,
        cooperative: bool = False,
    ) -> None:
        self.spec = spec
        self.callbacks = callbacks
        self.job_dir = Path(job_dir) if job_dir is not None else default_job_dir()
        self.eval_metric = eval_metric
        self.run_info = run_info
        self.topology: Topology = resolve_topology(spec.config, placed=placed)
        # Before any rank: the closures' dry build (Python API), the callback rank, a writable
        # save_path, the resume bundle.
        signature = launch_signature(spec, run_info)
        self._resume: ResumePoint | None = check_run(
            spec.config, self.topology.world_size, signature
        )
        self.run_info["lr_scaling"] = check_launch(spec, self.topology)
        # Each rank's batch size, worked out once: the spec and the controller read it here.
        self.topology = topo = place_batches(self.topology, spec.config)
        # The job as every rank receives it, complete from here on (frozen).
        self.spec = replace(
            spec,
            batch_sizes=list(topo.batch_sizes),
            loaders=rank_loaders(spec.config, topo),
            world_size=topo.world_size,
            speeds=topo.speeds,
            pace=topo.pace,
            backend=topo.backend,
        )
        self._stop = threading.Event()
        self.cohort: Cohort | None = None  # once the ranks are started
        self.cooperative = cooperative
        self._local_worker: queue.Queue[Any] = queue.Queue()
        self._done = threading.Event()
        self._result_state: TrainedState | None = None
        self._trace: Any = None  # elche_trace.jsonl, once open (None: off)
        self.summary: RunSummary | None = None  # once written: ok, interrupted or failed
        self._curve: list[tuple[float, float]] = []
        self._t0 = time.perf_counter()
        self._controller: Controller | None = None
        # Epochs finished, a resumed bundle's included (as the console and the bundle count).
        self._epochs_done = self._resume.meta.epoch if self._resume is not None else 0
        self._save_lock = _lock_save_path(spec.config.save_path, self.job_dir)  # the last refusal

    def request_stop(self) -> None:
        self._stop.set()

    # -- execution -------------------------------------------------------------------------------
    def execute(self) -> RunResult:
        cfg = self.spec.config
        topo = self.topology
        self.job_dir.mkdir(parents=True, exist_ok=True)
        logging.getLogger("flodl").setLevel(cfg.logger.level)
        log.info("flodl: %s | mode %s", topo.description, cfg.elche.mode.value)
        dashboard = None
        try:
            log.info("flodl: %s", format_lr_scaling(self.run_info["lr_scaling"]))
            # Everything that can refuse the run does so before any rank trains; the metrics
            # are built (a bad one refuses here) while the ranks start.
            gate = _check_metrics(self.spec) if self.spec.has_eval else None
            controller = new_controller(
                self.spec, topo, self._hooks(), self._resume, self.eval_metric
            )
            self._controller = controller  # a failed run's summary reads its losses
            dashboard = self._serve()
            self._open_outputs()
            run = self._finish(self._train(controller, gate))
        except BaseException as exc:
            self.summary = self._failed_summary(exc)
            try:
                self._write_summary(self.summary)
            except OSError as unwritten:  # a full disk: say so; the run's own error goes on
                log.error("%s (the run failed: %s)", unwritten.strerror, self.summary.error)
            raise
        finally:
            if self._save_lock is not None:
                self._save_lock.release()
            self._done.set()
            self._close_outputs()
            if dashboard is not None and not cfg.logger.keep_serving:
                dashboard.stop()
        if run.summary.status == "failed":  # a failed save, too many ranks lost: summary written
            raise RunFailed(run.summary.error or "the run failed")
        return run  # ok, or interrupted (a graceful stop: what was trained, what was saved)

    def _train(
        self, controller: Controller, gate: Callable[[], None] | None = None
    ) -> ControllerResult:
        on_cooperative = self._hand_over if self.cooperative else None
        self.cohort = open_cohort(
            self.spec, controller, self.job_dir, self.topology, self._rank_line, on_cooperative
        )
        return run_cohort(self.cohort, self._stop.is_set, gate)

    def _hand_over(self, core: Any) -> None:
        """Cooperative and in-process: the caller's thread drives the only rank."""
        from flodl.cooperative import CooperativeWorker

        self._local_worker.put(CooperativeWorker(core, finish_hook=self._finish_cooperative))

    def _rank_line(self, line: str) -> None:
        """A rank's warning or print: above the progress bar when one is drawn."""
        if self.progress.drawing:
            self.progress.echo(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def _open_outputs(self) -> None:
        from flodl.monitor.console import Progress
        from flodl.monitor.loggers import Loggers
        from flodl.monitor.tensorboard import RunLogger

        cfg = self.spec.config
        self.tb = RunLogger(self.job_dir, self.topology.world_size, enabled=cfg.logger.tensorboard)
        self.loggers = Loggers.build(cfg.logger, self.job_dir, self._hparams())
        if "config_yaml" in self.run_info:
            self.tb.config_text(self.run_info.pop("config_yaml"))
        self.progress = Progress(cfg.num_epochs, mode=cfg.logger.progress)
        trace = self.job_dir / "elche_trace.jsonl"
        try:
            self._trace = open(trace, "w", encoding="utf-8")  # noqa: SIM115
        except OSError as exc:
            log.warning("%s; the ElChe trace is off", write_failure(exc, trace))

    def _close_outputs(self) -> None:
        for name in ("progress", "_trace", "tb", "loggers"):
            output = getattr(self, name, None)
            if output is not None:
                try:
                    output.close()
                except OSError as exc:  # a full disk at the end: the run's outcome stands
                    log.warning("closing %s: %s", name.strip("_"), write_failure(exc, self.job_dir))

    def _serve(self) -> Any:
        logger = self.spec.config.logger
        if logger.serve is None:
            return None
        from flodl.monitor.dashboard import Dashboard

        dashboard = Dashboard.start(self.job_dir / "tb", logger.serve, logger.host)
        print(f"dashboard: {dashboard.url}", flush=True)
        return dashboard

    def wait_cooperative_worker(self) -> Any:
        """The in-process cooperative worker (started), or None for a process cohort."""
        if not self.cooperative or not self.topology.in_process:
            return None
        worker = self._local_worker.get()
        worker._core.start()
        return worker

    def _finish_cooperative(self) -> Any:
        self._done.wait()
        if self._result_state is None:
            raise RuntimeError("the cooperative run failed; see summary.json")
        return self._result_state

    # -- hooks -----------------------------------------------------------------------------------
    def _hooks(self) -> Hooks:
        return Hooks(
            on_sync=self._on_sync,
            on_epoch=self._on_epoch,
            on_progress=self._on_progress,
            on_steps=self._on_steps,
        )

    def _on_steps(self, rank: int, steps: tuple[tuple[int, float, float], ...]) -> None:
        self.tb.steps(rank, steps)
        self.loggers.steps(rank, steps)

    def _on_sync(self, event: SyncEvent) -> None:
        if self._trace is not None:
            try:
                self._trace.write(json.dumps(event.to_dict()) + "\n")
                self._trace.flush()  # per event: a killed launcher still leaves the trace so far
            except OSError as exc:  # a full disk: the trace stops, training does not
                why = write_failure(exc, self.job_dir / "elche_trace.jsonl")
                log.warning("%s; the ElChe trace is off for the rest of the run", why)
                with contextlib.suppress(OSError):
                    self._trace.close()
                self._trace = None
        self.tb.sync_event(event)

    def _on_progress(self, epoch: int, done: int, total: int, loss: float | None, shares) -> None:
        if done and done == total:
            return
        if done <= self.spec.config.batch_size * self.topology.world_size * 2:
            self.progress.start_epoch(epoch, total)
        self.progress.advance(done, loss, shares)

    def _on_epoch(self, metrics: EpochMetrics) -> str | None:
        """Log a closed epoch and run the user's callbacks; return metrics_fn's stop request."""
        from flodl.monitor.callbacks import stop_request
        from flodl.monitor.console import format_epoch_line

        self._curve.append((time.perf_counter() - self._t0, metrics.avg_loss))
        self._epochs_done = max(self._epochs_done, metrics.epoch)  # counts from 1
        self.tb.epoch(metrics)
        self.loggers.epoch(metrics)
        metric = primary_name(metrics.eval_metrics, self.eval_metric)
        self.progress.end_epoch(format_epoch_line(metrics, self.spec.config.num_epochs, metric))
        cb = self.callbacks
        if metrics.eval_value is not None and cb.eval_result_fn is not None:
            cb.eval_result_fn(metrics.epoch, metrics.eval_value)
        request = stop_request(cb.metrics_fn(metrics)) if cb.metrics_fn is not None else None
        if cb.epoch_fn is not None:
            cb.epoch_fn(metrics.epoch)
        return request

    # -- outputs ---------------------------------------------------------------------------------
    def _finish(self, result: ControllerResult) -> RunResult:
        if result.final is None:
            raise RuntimeError("the run ended without a final state")
        final = result.final
        state = TrainedState(params=final.params, buffers=final.buffers, base=final.base)
        self._result_state = state
        write_atomic(self.job_dir / "model.pt", state.save)
        summary = self._summary(result)
        if self.spec.pace and summary.telemetry:
            _warn_overruns(summary.telemetry, list(self.spec.speeds))
        if result.save_error is not None:  # stopped cleanly; what was trained is in model.pt
            summary.status = "failed"
            summary.error = (
                f"{result.save_error}; the trained state was saved to {self.job_dir / 'model.pt'}"
            )
        elif result.stopped == "max_failure":  # a failure, not an interruption: exit 1
            summary.status = "failed"
            summary.error = (
                f"stopped: ranks {result.lost_ranks} lost, more than trainer.max_failure="
                f"{self.spec.config.max_failure} allows; saved: {result.saved or 'nothing'}, "
                f"the trained state in {self.job_dir / 'model.pt'}"
            )
        elif result.stopped is not None and result.stopped_early is None:
            summary.status = "interrupted"
            summary.error = f"stopped ({result.stopped}); saved: {result.saved or 'nothing'}"
        self.summary = summary
        self._write_summary(summary)
        if summary.status == "ok":
            self._log_hparams(summary)
        return RunResult(
            state, summary, result.epochs, result.events, coverage_exact=_coverage_exact(result)
        )

    def _summary(self, result: ControllerResult) -> RunSummary:
        cfg = self.spec.config
        last = result.epochs[-1] if result.epochs else None
        evals = [m.eval_value for m in result.epochs if m.eval_value is not None]
        evaluated = [m.eval_metrics for m in result.epochs if m.eval_metrics]
        syncs = [e.sync_ms for e in result.events]
        total_batches = sum(result.rank_batches) or 1
        return RunSummary(
            status="ok",
            mode=cfg.elche.mode.value,
            world_size=self.topology.world_size,
            epochs=self._epochs_done,
            final_loss=_finite(last.avg_loss) if last else None,
            eval_metric=primary_name(evaluated[-1], self.eval_metric) if evaluated else None,
            eval_value=evals[-1] if evals else None,
            wall_s=time.perf_counter() - self._t0,
            syncs=len(result.events),
            mean_sync_ms=sum(syncs) / len(syncs) if syncs else 0.0,
            samples_per_s=result.samples / result.train_s,
            per_rank_batch_share=[b / total_batches for b in result.rank_batches],
            per_rank_sample_share=[s / max(result.samples, 1) for s in result.rank_samples],
            per_rank_throughput=[s / result.train_s for s in result.rank_samples],
            idle_fraction=[
                max(0.0, 1.0 - c / 1000.0 / result.train_s) for c in result.rank_compute_ms
            ],
            overrides=list(self.run_info.get("overrides", [])),
            loss_curve=self._curve,
            samples_seen=result.samples,
            anchor=result.events[-1].anchor if result.events else None,
            lost_ranks=result.lost_ranks,
            coverage_exact=_coverage_exact(result),
            metrics=evaluated[-1] if evaluated else {},
            best=self._best(result),
            stopped_early=result.stopped_early,
            telemetry=_telemetry(result),
            rig=self._rig(result),
            memory_plans=result.memory_plans,
            averaging=result.averaging,
        )

    def _rig(self, result: ControllerResult) -> dict[str, Any] | None:
        if not self.spec.pace or result.calibrated_step_ms <= 0:
            return None
        margin = self.spec.config.cluster.pace_margin
        overruns = [t["pace_overrun_fraction"] for t in _telemetry(result)]
        return {
            "calibrated_step_ms": result.calibrated_step_ms,
            "pace_margin": margin,
            "nominal_step_ms": result.calibrated_step_ms * margin,
            "speeds": list(self.spec.speeds),
            "overrun_fraction": max(overruns, default=0.0),
        }

    def _best(self, result: ControllerResult) -> dict[str, Any] | None:
        if result.best is None:
            return None
        stem = self.spec.config.save_path
        return result.best | {"bundle": f"{stem}_best" if "best" in result.saved else None}

    def _failed_summary(self, exc: BaseException) -> RunSummary:
        message = str(exc) or type(exc).__name__
        if self.summary is not None and self.summary.status != "ok":
            return self.summary  # the run ended cleanly (a failed save) and wrote it
        if isinstance(exc, KeyboardInterrupt):
            message = "interrupted"
        return RunSummary(
            status="failed",
            mode=self.spec.config.elche.mode.value,
            world_size=self.topology.world_size,
            epochs=self._epochs_done,
            wall_s=time.perf_counter() - self._t0,
            error=message,
            lost_ranks=list(self._controller.members.lost) if self._controller else [],
            overrides=list(self.run_info.get("overrides", [])),
        )

    def _write_summary(self, summary: RunSummary) -> None:
        self.job_dir.mkdir(parents=True, exist_ok=True)
        data = summary.to_dict() | {"job_dir": str(self.job_dir), **self.run_info}
        text = json.dumps(data, indent=2, default=str) + "\n"
        write_atomic(self.job_dir / "summary.json", lambda f: f.write(text.encode("utf-8")))

    def _hparams(self) -> dict[str, Any]:
        elche = self.spec.config.elche
        return {
            "mode": elche.mode.value,
            "anchor": elche.anchor,
            "overhead_target": elche.overhead_target,
            "world_size": self.topology.world_size,
            "batch_size": self.spec.config.batch_size,
        }

    def _log_hparams(self, summary: RunSummary) -> None:
        hparams = self._hparams()
        metrics = {
            "final_loss": summary.final_loss,
            "eval": summary.eval_value,
            "wall_s": summary.wall_s,
            "samples_per_s": summary.samples_per_s,
        } | {f"final/{name}": value for name, value in summary.metrics.items()}
        self.tb.hparams(hparams, metrics)


def _check_metrics(spec: JobSpec) -> Callable[[], None]:
    """Build the eval metrics once on the launcher (a bad one refuses the run) in a thread, so
    their import (torchmetrics with scipy: ~1.3 s of CPU) overlaps the ranks' start rather than
    preceding it; the returned gate waits for it and raises what it raised (:func:`run_cohort`
    calls it once the ranks are started, before the controller plans a window)."""
    failure: list[BaseException] = []

    def build() -> None:
        try:
            spec.evaluation.build(torch.device("cpu"))
        except BaseException as exc:  # re-raised by the gate, in the launcher's thread
            failure.append(exc)

    thread = threading.Thread(target=build, name="flodl-metric-check", daemon=True)
    thread.start()

    def gate() -> None:
        thread.join()
        if failure:
            raise failure[0]

    return gate


def _coverage_exact(result: ControllerResult) -> bool:
    """Every sample of every trained epoch exactly once (a stopped epoch: no overlaps)."""
    cov = result.coverage
    if cov is None:
        return False
    return all(cov.exact(e) or (result.stopped and cov.overlaps(e) == 0) for e in cov.trained)


def _telemetry(result: ControllerResult) -> list[dict[str, Any]]:
    """Per rank over the whole run: device, peak memory, busy, data-wait and (CPU rig) pace
    overrun fractions."""
    train_s = result.train_s
    out = []
    for r, compute_ms in enumerate(result.rank_compute_ms):
        data_ms = result.rank_data_ms[r] if r < len(result.rank_data_ms) else 0.0
        overrun_ms = result.rank_overrun_ms[r] if r < len(result.rank_overrun_ms) else 0.0
        peak = result.rank_peak_mem[r] if r < len(result.rank_peak_mem) else 0
        out.append(
            {
                "rank": r,
                "device": result.devices[r] if r < len(result.devices) else None,
                "peak_mem_mb": peak / 2**20,
                "busy_fraction": max(0.0, compute_ms - data_ms) / 1000.0 / train_s,
                "data_wait_fraction": data_ms / 1000.0 / train_s,
                "pace_overrun_fraction": overrun_ms / 1000.0 / train_s,
            }
        )
    return out


#: A paced rank whose steps ran past their deadlines for more of the training time than this
#: is not simulating its speed: the summary says so.
OVERRUN_WARN = 0.10


def _warn_overruns(telemetry: list[dict[str, Any]], speeds: list[float]) -> None:
    """CPU rig: ranks whose paced steps overran their deadlines (the simulated device was
    slower than asked: the cores are oversubscribed), so the speed ratio was not held."""
    late = [t for t in telemetry if t["pace_overrun_fraction"] > OVERRUN_WARN]
    if not late:
        return
    detail = ", ".join(
        f"rank {t['rank']} (speed {speeds[t['rank']] if t['rank'] < len(speeds) else '?'}) "
        f"{t['pace_overrun_fraction']:.0%}"
        for t in late
    )
    log.warning(
        "cpu_rig: paced steps ran past their deadlines for part of the training time: %s. "
        "The cores are oversubscribed (loader workers, other ranks or processes) or batches "
        "arrived late (see data_wait_fraction), so the rig did not hold its speed ratios; raise "
        "cluster.pace_margin, use fewer loader.num_workers or fewer ranks",
        detail,
    )


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
