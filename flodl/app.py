"""The Hydra job: a composed config in, a trained model and its summary out.

``run.py`` stays tiny; this module turns the validated :class:`RunConfig` into the Python API's
call (factories built from ``_target_`` references) and maps failures to exit codes: 2 for a
configuration error (nothing started), 1 when a job failed.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from flodl import config as schema
from flodl.config import ConfigError, RunConfig, TargetConfig, resolve_dotted

log = logging.getLogger("flodl")

# Set by the launcher plugin (whether a sweep started, how many jobs it has) and by train()
# (how many jobs failed, under any launcher).
STATE: dict[str, int] = {"launched": 0, "failed": 0, "jobs": 0}
# Each finished job's summary row by job number: the A/B report's input.
ROWS: dict[int, dict[str, Any]] = {}


# -- factories (module-level so they pickle by reference to the ranks) ---------------------------
def _instantiate(target: TargetConfig, *args: Any, **extra: Any) -> Any:
    from hydra.utils import instantiate

    return instantiate({"_target_": target.target, **target.kwargs(), **extra}, *args)


def build_model(target: TargetConfig, device: Any) -> Any:
    return _instantiate(target).to(device)


def build_optimizer(target: TargetConfig, params: Any) -> Any:
    return _instantiate(target, params)


def build_dataset(target: TargetConfig, split: str) -> Any:
    return _instantiate(target, split=split)


def build_scheduler(target: TargetConfig, optimizer: Any, total_steps: int | None = None) -> Any:
    """``total_steps: auto`` (or left out where the target needs it) becomes the run's length."""
    from flodl.schedules import fill_total_steps

    kwargs = fill_total_steps(resolve_dotted(target.target), target.kwargs(), total_steps)
    from hydra.utils import instantiate

    return instantiate({"_target_": target.target, **kwargs}, optimizer)


def build_metric(target: TargetConfig) -> Any:
    return _instantiate(target)


# -- the job -----------------------------------------------------------------------------------
def plain_config(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data, without Hydra's own node."""
    from omegaconf import OmegaConf, open_dict

    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.pop("hydra", None)  # Hydra's own node may hold values only a running job has
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    return {str(k): v for k, v in data.items()}


def train(cfg: Any) -> float:
    """Run one job; return its objective (for optimizing sweepers: Optuna, Nevergrad, Ax).

    The job's summary row goes to :data:`ROWS` (the A/B report); a failed job is a failed row
    and a NaN objective, never an aborted sweep. A configuration error exits with code 2
    before any rank starts.
    """
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    run_cfg = schema.validate_run_config(plain_config(cfg))
    if STATE.get("serving"):  # the sweep serves one dashboard over all jobs
        run_cfg = run_cfg.model_copy(
            update={"logger": run_cfg.logger.model_copy(update={"serve": None})}
        )
    logging.getLogger("flodl").setLevel(run_cfg.logger.level)
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    run_info: dict[str, Any] = {
        "job": str(hydra_cfg.job.num),
        "overrides": list(hydra_cfg.overrides.task),
        "config_yaml": OmegaConf.to_yaml(OmegaConf.create(plain_config(cfg))),
    }
    try:
        handle = _start(run_cfg, job_dir, run_info)
    except ConfigError as exc:
        where = (
            f" (job {run_info['job']}: {' '.join(run_info['overrides'])})"
            if STATE.get("jobs", 0) > 1
            else ""
        )
        print(f"error: {exc}{where}", file=sys.stderr)
        sys.exit(2)
    try:
        handle.join()
        summary = handle.result.summary.to_dict()
    except Exception as exc:
        log.error("job %s failed: %s (outputs in %s)", run_info["job"], exc, job_dir)
        if os.environ.get("FLODL_FULL_ERROR"):
            log.exception("full traceback")
        STATE["failed"] += 1
        summary = _read_summary(job_dir)
    row = summary | {"job": run_info["job"]}
    ROWS[int(hydra_cfg.job.num)] = row
    return objective(row, run_cfg.task)


def _start(run_cfg: RunConfig, job_dir: Path, run_info: dict[str, Any]) -> Any:
    """Check everything the launcher can (:mod:`flodl.preflight`), then start the run."""
    from flodl import preflight
    from flodl.trainer import Trainer

    task = run_cfg.task
    has_eval = task.has_eval
    run_info["model_signature"] = preflight.check_factories(run_cfg)
    preflight.check_task_targets(task)  # last: its metrics import torchmetrics
    return Trainer.run(
        partial(build_model, run_cfg.model),
        partial(build_optimizer, run_cfg.optimizer),
        resolve_dotted(task.train_step),
        run_cfg.trainer_config(),
        dataset=partial(build_dataset, run_cfg.dataset, "train"),
        eval_dataset=partial(build_dataset, run_cfg.dataset, "test") if has_eval else None,
        eval_fn=_optional(task.eval_fn),
        metrics={name: partial(build_metric, t) for name, t in task.metrics.items()},
        eval_loss=_optional(task.eval_loss),
        eval_step=_optional(task.eval_step),
        scheduler_factory=(
            partial(build_scheduler, run_cfg.scheduler) if run_cfg.scheduler is not None else None
        ),
        scheduler_interval=run_cfg.scheduler.interval if run_cfg.scheduler else "epoch",
        metrics_fn=_optional(task.metrics_fn),
        eval_result_fn=_optional(task.eval_result_fn),
        epoch_fn=_optional(task.epoch_fn),
        job_dir=job_dir,
        eval_metric=task.eval_metric,
        run_info=run_info,
    )


def objective(row: dict[str, Any], task: schema.TaskConfig) -> float:
    """The number an optimizing sweeper sees: ``task.objective`` of the summary (``auto``: the
    final eval value, else the final loss); NaN for a failed job (Optuna records a failed trial).
    """
    key = objective_key(task, has_eval=task.has_eval)
    value: Any = row
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if row.get("status") != "ok" or not isinstance(value, (int, float)):
        return float("nan")
    return float(value)


def objective_key(task: schema.TaskConfig, has_eval: bool) -> str:
    if task.objective == "auto":
        return "eval_value" if has_eval else "final_loss"
    return {"eval": "eval_value", "loss": "final_loss"}.get(task.objective, task.objective)


def objective_maximized(task: schema.TaskConfig) -> bool:
    """Whether a larger objective is better (``task.objective_direction``; auto: the eval
    metric's direction when the objective is the eval value, else minimize)."""
    if task.objective_direction != "auto":
        return task.objective_direction == "maximize"
    key = objective_key(task, has_eval=task.has_eval)
    return key == "eval_value" and task.eval_higher_is_better


def _optional(path: str | None) -> Any:
    return resolve_dotted(path) if path is not None else None


def _read_summary(job_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((job_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {"status": "failed", "error": "no summary written"}


# -- command line --------------------------------------------------------------------------------
_SECTIONS: dict[str, type[BaseModel]] = {
    "trainer": schema.TrainerKnobs,
    "elche": schema.ElCheConfig,
    "cluster": schema.ClusterConfig,
    "logger": schema.LoggerConfig,
    "task": schema.TaskConfig,
}


def check_override_keys(args: list[str]) -> None:
    """Reject a misspelt key (``trainer.nmu_epochs=3``) before Hydra or any rank starts."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = [a for a in args if not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:
        return  # Hydra reports syntax errors itself
    for override in parsed:
        if override.is_add() or override.is_delete() or override.is_force_add():
            continue
        _check_key(override.key_or_group)


def _check_key(key: str) -> None:
    section, _, rest = key.partition(".")
    model = _SECTIONS.get(section)
    path = section
    for part in rest.split(".") if rest else []:
        if model is None:
            return
        fields = model.model_fields
        if part not in fields:
            close = difflib.get_close_matches(part, list(fields), n=1)
            hint = f" (did you mean {path}.{close[0]}?)" if close else ""
            allowed = ", ".join(sorted(fields))
            raise ConfigError(f"{path}.{part}: unknown key{hint}; allowed: {allowed}")
        path = f"{path}.{part}"
        annotation = fields[part].annotation
        model = (
            annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel)
            else None
        )


def _sigterm_as_interrupt() -> Any:
    from flodl.signals import sigterm_as_interrupt

    return sigterm_as_interrupt()


def cli(main: Callable[[], Any]) -> None:
    """Run the Hydra entry with flodl's exit codes (2: bad config, 1: a job failed)."""
    try:
        check_override_keys(sys.argv[1:])
        with _sigterm_as_interrupt():
            main()
    except KeyboardInterrupt as exc:
        if os.environ.get("FLODL_FULL_ERROR"):
            import traceback

            traceback.print_exc()
        code = getattr(exc, "exit_code", 130)
        print(
            f"error: interrupted (exit {code}); see summary.json for what was saved",
            file=sys.stderr,
        )
        sys.exit(code)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except SystemExit as exc:
        # Hydra exits 1 when composition fails (unknown group option, bad override syntax)
        # before our launcher ran: that is a configuration error too.
        if exc.code == 1 and not STATE["launched"]:
            sys.exit(2)
        raise
    if STATE["failed"]:
        print(
            f"error: {STATE['failed']} job(s) failed; see summary.json in their job directories",
            file=sys.stderr,
        )
        sys.exit(1)


__all__ = ["RunConfig", "build_dataset", "build_model", "build_optimizer", "cli", "train"]
