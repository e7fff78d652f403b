"""The public entry: ``Trainer.builder(...).run().join()`` and its config twin ``Trainer.run``.

Closures reach ranks by serialisation: the launcher cloudpickles the factories, the step and the
callbacks it ships, and sends them over the authenticated control channel. Functions from
importable modules travel by reference; functions and closures defined in the user's own script
(``__main__``) or a notebook travel by value. Nothing re-executes the user's script, so code
around the ``Trainer`` call runs once. With fewer than two devices the run stays in-process.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flodl.checkpoint.results import RunResult, TrainedState
from flodl.config import (
    ClusterConfig,
    EarlyStoppingConfig,
    ElCheConfig,
    LoaderConfig,
    LoggerConfig,
    MonitorConfig,
    TrainerConfig,
    validate_trainer_config,
)
from flodl.monitor.metrics import EpochMetrics, RunSummary
from flodl.runtime.cohorts import fork_server
from flodl.runtime.wire.job_spec import Callbacks, JobSpec
from flodl.runtime.wire.rank_env import ExternalRole, external_role, is_follower, placed_cohort
from flodl.signals import sigterm_as_interrupt

log = logging.getLogger(__name__)


class RunHandle:
    """A run in flight. ``join()`` blocks until it ends and returns the :class:`TrainedState`."""

    def __init__(self, job: Any) -> None:
        self._job = job
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        # Waiting on an Event, not Thread.join: a Ctrl-C that interrupts Thread.join can leave
        # the thread marked finished (CPython < 3.13), and the graceful stop would be cut short.
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._target, name="flodl-run", daemon=True)
        self._thread.start()

    def _target(self) -> None:
        try:
            self._result = self._job.execute()
        except BaseException as exc:
            self._error = exc
        finally:
            self._done.set()

    @property
    def job_dir(self) -> Path:
        return self._job.job_dir

    @property
    def world_size(self) -> int:
        return self._job.topology.world_size

    def cooperative_worker(self) -> Any:
        """In-process cooperative runs: the rank's worker for the caller to drive, else None."""
        return self._job.wait_cooperative_worker()

    def done(self) -> bool:
        return self._done.is_set()

    def join(self, timeout: float | None = None) -> TrainedState:
        """Wait for the run; Ctrl-C stops every rank before it propagates."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            with sigterm_as_interrupt():
                while not self._done.is_set():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError("run still in progress")
                    self._done.wait(timeout=0.2 if left is None else min(0.2, left))
        except KeyboardInterrupt:
            self._job.request_stop()  # graceful: in-flight windows, a bundle, then teardown
            self._wait_for_cleanup()
            if self._error is not None and not isinstance(self._error, KeyboardInterrupt):
                log.error("while stopping: %s", self._error)
            raise
        if self._error is not None:
            raise self._error
        assert self._result is not None and self._result.state is not None
        summary = self._result.summary
        if summary.status == "interrupted":  # stopped gracefully: the caller sees the stop
            raise KeyboardInterrupt(summary.error)
        return self._result.state

    def _wait_for_cleanup(self, timeout_s: float = 60.0) -> None:
        """After a stop signal: wait for the graceful stop (in-flight windows, the bundle,
        summary.json, model.pt). A second signal does not cut the cleanup short (torchrun's
        convention); a third aborts at once, without it."""
        deadline = time.monotonic() + timeout_s
        signals = 1
        while not self._done.is_set() and time.monotonic() < deadline:
            try:
                with sigterm_as_interrupt():
                    self._done.wait(timeout=0.2)
            except KeyboardInterrupt:
                signals += 1
                if signals >= 3:
                    log.error("third stop signal: aborting without waiting for the save")
                    raise
                log.warning(
                    "stopping already: saving what is trained and ending every rank "
                    "(one more stop signal aborts without saving)"
                )

    @property
    def summary(self) -> RunSummary | None:
        """The run's summary as written to ``summary.json`` (ok, interrupted or failed), once
        the run ended; None when it ended before writing one."""
        return self._job.summary  # type: ignore[no-any-return]

    @property
    def result(self) -> RunResult:
        if self._result is None:
            self.join()
        assert self._result is not None
        return self._result


class TrainerBuilder:
    """Fluent configuration, the tutorial's shape."""

    def __init__(self, model_factory: Callable, optim_factory: Callable, train_step: Callable):
        self._factories = (model_factory, optim_factory, train_step)
        self._config: dict[str, Any] = {}
        self._data: dict[str, Any] = {}

    def _set(self, key: str, value: Any) -> TrainerBuilder:
        self._config[key] = value
        return self

    def _put(self, key: str, value: Any) -> TrainerBuilder:
        self._data[key] = value
        return self

    def config(self, config: TrainerConfig) -> TrainerBuilder:
        self._config = {**config.model_dump(), **self._config}
        return self

    def dataset(self, dataset: Any) -> TrainerBuilder:
        return self._put("dataset", dataset)

    def eval_dataset(self, dataset: Any) -> TrainerBuilder:
        return self._put("eval_dataset", dataset)

    def eval_fn(
        self, fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], float]
    ) -> TrainerBuilder:
        return self._put("eval_fn", fn)

    def metrics(self, metrics: dict[str, Callable[[], Any]]) -> TrainerBuilder:
        """Name -> zero-argument factory of a torchmetrics ``Metric`` (built fresh per eval)."""
        return self._put("metrics", dict(metrics))

    def eval_loss(self, fn: Callable[[Any, Any], torch.Tensor]) -> TrainerBuilder:
        """``fn(preds, target) -> mean loss`` over an eval batch; reported as ``eval_loss``."""
        return self._put("eval_loss", fn)

    def eval_step(self, fn: Callable[[nn.Module, Any], tuple[Any, Any]]) -> TrainerBuilder:
        """``fn(model, batch) -> (preds, target)`` fed to the metrics (default: model(x), y)."""
        return self._put("eval_step", fn)

    def eval_result_fn(self, fn: Callable[[int, float], None]) -> TrainerBuilder:
        return self._put("eval_result_fn", fn)

    def metrics_fn(self, fn: Callable[[EpochMetrics], Any]) -> TrainerBuilder:
        """Called once per epoch on the launcher; returning True (or a reason) stops the run."""
        return self._put("metrics_fn", fn)

    def epoch_fn(self, fn: Callable[[int], None]) -> TrainerBuilder:
        return self._put("epoch_fn", fn)

    def scheduler(self, factory: Callable[..., Any], interval: str = "epoch") -> TrainerBuilder:
        """``factory(optimizer)``, or ``factory(optimizer, total_steps=...)`` to get the run's
        length; ``interval="step"`` advances it on the global progress clock per step."""
        if interval not in ("step", "epoch"):
            raise ValueError(f"scheduler.interval={interval!r}: must be 'step' or 'epoch'")
        self._put("scheduler_interval", interval)
        return self._put("scheduler_factory", factory)

    def output_dir(self, path: str | Path) -> TrainerBuilder:
        return self._put("job_dir", Path(path))

    def batch_size(self, n: int) -> TrainerBuilder:
        return self._set("batch_size", n)

    def num_epochs(self, n: int) -> TrainerBuilder:
        return self._set("num_epochs", n)

    def seed(self, n: int) -> TrainerBuilder:
        return self._set("seed", n)

    def max_grad_norm(self, x: float) -> TrainerBuilder:
        return self._set("max_grad_norm", x)

    def lr_scale_ratio(self, x: float) -> TrainerBuilder:
        return self._set("lr_scale_ratio", x)

    def precision(self, kind: str | int) -> TrainerBuilder:
        """``32``, ``"bf16-mixed"`` or ``"16-mixed"`` (CUDA ranks only)."""
        return self._set("precision", kind)

    def accumulate_grad_batches(self, n: int) -> TrainerBuilder:
        return self._set("accumulate_grad_batches", n)

    def compile(self, on: bool = True) -> TrainerBuilder:
        return self._set("compile", on)

    def eval_policy(self, policy: str) -> TrainerBuilder:
        """``elected`` (one rank evaluates) or ``sharded`` (each rank 1/N, states merged)."""
        return self._set("eval_policy", policy)

    def early_stopping(self, config: EarlyStoppingConfig) -> TrainerBuilder:
        return self._set("early_stopping", config.model_dump())

    def save_best(
        self,
        config: MonitorConfig | str = "eval_loss",
        save_path: str | Path | None = None,
        *,
        mode: str = "min",
    ) -> TrainerBuilder:
        """Keep ``<save_path>_best`` beside the last bundle (``save_path`` sets the stem):
        ``.save_best(MonitorConfig(...))`` or ``.save_best("accuracy", mode="max")``."""
        if save_path is not None:
            self.save_path(save_path)
        if isinstance(config, str):
            config = MonitorConfig(monitor=config, mode=mode)  # type: ignore[arg-type]
        return self._set("save_best", config.model_dump())

    def save_path(self, stem: str | Path) -> TrainerBuilder:
        """Bundle stem (a path or fsspec URL): ``<stem>.meta.json`` plus shard files, written at
        the end of the run (and every ``checkpoint_every`` epochs)."""
        return self._set("save_path", str(stem))

    def checkpoint_every(self, n: int) -> TrainerBuilder:
        """Save the bundle every ``n`` epochs (needs :meth:`save_path`)."""
        return self._set("checkpoint_every", n)

    def resume_from(self, stem: str | Path, fallback: bool | None = None) -> TrainerBuilder:
        """Resume from the bundle at ``stem``; ``fallback=True``: from an older bundle when the
        newest is damaged (else an error)."""
        if fallback is not None:
            self._set("resume_fallback", fallback)
        return self._set("resume_from", str(stem))

    def eval_every(self, n: int) -> TrainerBuilder:
        return self._set("eval_every", n)

    def device(self, kind: str) -> TrainerBuilder:
        """``auto``, ``cpu`` or ``cuda`` (the in-process device)."""
        return self._set("device", kind)

    def max_failure(self, ranks: int | str | None) -> TrainerBuilder:
        """Ranks that may be lost (a count or ``"N%"``) before save-and-stop; None: any."""
        return self._set("max_failure", ranks)

    def max_nonfinite(self, n: int) -> TrainerBuilder:
        """NaN/inf losses skipped (with a warning) before the run stops."""
        return self._set("max_nonfinite", n)

    def elche(self, config: ElCheConfig) -> TrainerBuilder:
        return self._set("elche", config.model_dump())

    def cluster(self, config: ClusterConfig) -> TrainerBuilder:
        return self._set("cluster", config.model_dump())

    def logger(self, config: LoggerConfig) -> TrainerBuilder:
        return self._set("logger", config.model_dump())

    def loader(self, config: LoaderConfig | None = None, **knobs: Any) -> TrainerBuilder:
        """How each rank loads its planned chunks (:class:`LoaderConfig` fields as keywords:
        ``num_workers``, ``prefetch_factor``, ``pin_memory``, ``persistent_workers``,
        ``collate_fn`` (a dotted path or a function), ``eval_batch_size``, ``placement``,
        ``ranks``)."""
        collate = knobs.get("collate_fn")
        if collate is not None and not isinstance(collate, str):
            self._put("collate_fn", knobs.pop("collate_fn"))
        base = config.model_dump() if config is not None else self._config.get("loader", {})
        return self._set("loader", {**base, **knobs})

    def build_config(self) -> TrainerConfig:
        return validate_trainer_config(self._config)

    def run(self) -> RunHandle:
        return Trainer.run(*self._factories, self.build_config(), **self._data)

    def into_worker(self) -> Any:
        """The cooperative tier (see :mod:`flodl.cooperative`): you own the loop body."""
        from flodl.runtime.wire.rank_env import is_rank_process

        if is_rank_process():
            from flodl.runtime.rank.process import cooperative_worker

            return cooperative_worker()
        from flodl.cooperative import LauncherView

        handle = Trainer.run(*self._factories, self.build_config(), cooperative=True, **self._data)
        local = handle.cooperative_worker()
        if local is not None:  # in-process: the caller's thread drives the only rank
            return local
        return LauncherView(handle.join())


def _follow_if_placed(config: TrainerConfig, cooperative: bool, role: ExternalRole | None) -> None:
    """Under torchrun / srun, every rank but 0 becomes a worker of rank 0's job, then exits."""
    if not placed_cohort(role):
        return
    assert role is not None
    if cooperative:
        raise RuntimeError(
            f"into_worker() under {role.launcher}: flodl's cooperative tier re-executes the "
            "script itself; start it with python, or use Trainer.run / Ddp.wrap under torchrun"
        )
    if is_follower(role):
        from flodl.runtime.cohorts.external import follow_job

        raise SystemExit(follow_job(role, config))


def console_logging(level: str) -> None:
    """The Python API's console, as the CLI's: flodl's banner, LR-scaling line and warnings on
    stderr with no logging set-up of the user's. ``LoggerConfig(level="WARNING")`` silences the
    INFO lines (``progress="off"`` the epoch lines). Where the user configured logging (a handler
    on the root or on ``flodl``), theirs is used and none is added."""
    flodl_log = logging.getLogger("flodl")
    flodl_log.setLevel(level)
    ours = [h for h in flodl_log.handlers if getattr(h, "flodl_console", False)]
    theirs = logging.getLogger().handlers or [h for h in flodl_log.handlers if h not in ours]
    if theirs:
        for handler in ours:  # the user set logging up since: no line twice
            flodl_log.removeHandler(handler)
    elif not ours:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.flodl_console = True  # type: ignore[attr-defined]
        flodl_log.addHandler(handler)


class Trainer:
    """Entry points. See the module docstring for how closures reach ranks."""

    @staticmethod
    def builder(
        model_factory: Callable[[torch.device], nn.Module],
        optim_factory: Callable[[Any], torch.optim.Optimizer],
        train_step: Callable[[nn.Module, list[torch.Tensor]], torch.Tensor],
    ) -> TrainerBuilder:
        return TrainerBuilder(model_factory, optim_factory, train_step)

    @staticmethod
    def run(
        model_factory: Callable[[torch.device], nn.Module],
        optim_factory: Callable[[Any], torch.optim.Optimizer],
        train_step: Callable[[nn.Module, list[torch.Tensor]], torch.Tensor],
        config: TrainerConfig,
        *,
        dataset: Any,
        eval_dataset: Any = None,
        eval_fn: Callable[..., float] | None = None,
        metrics: dict[str, Callable[[], Any]] | None = None,
        eval_loss: Callable[[Any, Any], torch.Tensor] | None = None,
        eval_step: Callable[..., tuple[Any, Any]] | None = None,
        eval_result_fn: Callable[[int, float], None] | None = None,
        metrics_fn: Callable[[EpochMetrics], Any] | None = None,
        epoch_fn: Callable[[int], None] | None = None,
        scheduler_factory: Callable[..., Any] | None = None,
        scheduler_interval: str = "epoch",
        job_dir: str | Path | None = None,
        eval_metric: str = "eval",
        run_info: dict[str, Any] | None = None,
        cooperative: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> RunHandle:
        """Start a run; returns at once with a handle (``.join()`` for the trained state).

        In a process torchrun (or srun) placed, rank 0 runs the job and the other ranks train
        as its workers, then exit: code after ``run()`` runs on rank 0 only.
        """
        from flodl.data.loader import adopt
        from flodl.job import Job
        from flodl.step.evaluation import EvalSpec

        if run_info is None:  # the Python API (the CLI's console is Hydra's logging set-up)
            console_logging(config.logger.level)
        placed = external_role()  # this process's placement, read once and passed down
        _follow_if_placed(config, cooperative, placed)
        if not cooperative:  # a cooperative rank re-executes the script: a cold interpreter
            fork_server.start_for(config.cluster, placed=placed is not None)
        # A DataLoader is adopted (or refused) here, before any rank starts.
        dataset, loader, adopted_collate = adopt(dataset, config.loader, config.batch_size)
        if loader != config.loader:
            config = config.with_(loader=loader)
        if isinstance(eval_dataset, torch.utils.data.DataLoader):
            eval_dataset = eval_dataset.dataset  # evaluation batches by loader.eval_batch_size
        evaluation = EvalSpec(
            metrics=dict(metrics or {}),
            eval_loss=eval_loss,
            eval_step=eval_step,
            eval_fn=eval_fn,
            eval_fn_name=eval_metric,
        )

        spec = JobSpec(
            config=config,
            model_factory=model_factory,
            optim_factory=optim_factory,
            train_step=train_step,
            dataset=dataset,
            eval_dataset=eval_dataset,
            evaluation=evaluation,
            scheduler_factory=scheduler_factory,
            scheduler_interval=scheduler_interval,
            collate_fn=collate_fn or adopted_collate,
            # cooperative: ranks re-execute the user's script, as torchrun does
            entry=list(sys.orig_argv[1:]) if cooperative else None,
        )
        callbacks = Callbacks(metrics_fn, eval_result_fn, epoch_fn)
        job = Job(
            spec,
            callbacks,
            job_dir,
            eval_metric=eval_metric,
            run_info=run_info if run_info is not None else {"config_yaml": _config_yaml(config)},
            placed=placed,
            cooperative=cooperative,
        )
        if run_info is None:  # the Python API: say where the outputs go (Hydra prints its own)
            print(f"flodl: outputs in {job.job_dir}", file=sys.stderr, flush=True)
        return RunHandle(job)


def _config_yaml(config: TrainerConfig) -> str:
    """The Python API's validated config as YAML, for TensorBoard's Text tab (the CLI writes
    the composed Hydra config there)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(config.model_dump(mode="json")))
