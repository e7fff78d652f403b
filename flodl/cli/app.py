"""The Hydra job: a composed config in, a trained model and its summary out.

``run.py`` stays tiny; this module turns the validated :class:`RunConfig` into the Python API's
call (factories built from ``_target_`` references) and maps failures to exit codes: 2 for a
configuration error (nothing started), 1 when a job failed.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from flodl import config as schema
from flodl.config import ConfigError, RunConfig, TrainerConfig, resolve_dotted
from flodl.config.base import did_you_mean
from flodl.config.factories import (  # module-level: they pickle by reference to the ranks
    build_dataset,
    build_metric,
    build_model,
    build_optimizer,
    build_scheduler,
)

log = logging.getLogger("flodl")


class Objective(float):
    """A job's objective (what an optimizing sweeper sees) carrying the job's summary row (what
    the flodl launcher's A/B report reads): the task's return value, no module state."""

    row: dict[str, Any]

    def __new__(cls, value: float, row: dict[str, Any]) -> Objective:
        made = super().__new__(cls, value)
        made.row = row
        return made

    def __reduce__(self) -> Any:  # other launchers pickle the return value
        return (Objective, (float(self), self.row))


class JobsFailed(SystemExit):
    """Raised after a sweep whose jobs failed (counted from their summaries): exit code 1."""

    def __init__(self, failed: int) -> None:
        super().__init__(1)
        self.failed = failed


class LaunchFailed(SystemExit):
    """The launcher itself failed after composition succeeded: exit code 1, not 2."""

    def __init__(self) -> None:
        super().__init__(1)


# -- the job -----------------------------------------------------------------------------------
def say_error(text: str) -> None:
    """``error: text`` on stderr in one write. ``print`` writes the text and its newline
    separately, and where stderr is unbuffered (PYTHONUNBUFFERED, as in most containers)
    another thread's output, such as the metric import's, could land between them."""
    sys.stderr.write(f"error: {text}\n")
    sys.stderr.flush()


def plain_config(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data, without Hydra's own node."""
    from omegaconf import OmegaConf, open_dict

    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.pop("hydra", None)  # Hydra's own node may hold values only a running job has
    data = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(data, dict)
    return {str(k): v for k, v in data.items()}


@dataclass(frozen=True)
class CheckedJob:
    """A composed job, validated once: its schema, the knobs that need no topology, its
    factories' dry build and its task's targets (:func:`flodl.cli.sweep.check_job`). The flodl
    launcher checks every job of a sweep before any starts, then hands each its own, so
    nothing is validated twice."""

    run: RunConfig
    config: TrainerConfig  # run.trainer_config(): the Python API's config bag
    signature: str | None  # the model's architecture, from the factories' dry build
    data: dict[str, Any]  # the resolved job config that was validated (plain_config)


def train(cfg: Any, checked: CheckedJob | None = None) -> Objective:
    """Run one job; return its objective (for optimizing sweepers: Optuna, Nevergrad, Ax)
    carrying its summary row (for the A/B report). ``checked``: the job as the flodl launcher
    already validated it (another launcher calls ``run.py``'s ``main``, which validates here).

    A failed job is a failed row and a NaN objective, never an aborted sweep. A configuration
    error exits with code 2 before any rank starts.
    """
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    data = plain_config(cfg)
    if checked is not None and checked.data != data:
        checked = None  # it resolves differently inside the job (a ${hydra:...} value): recheck
    run_cfg = checked.run if checked is not None else schema.validate_run_config(data)
    logging.getLogger("flodl").setLevel(run_cfg.logger.level)
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    run_info: dict[str, Any] = {
        "job": str(hydra_cfg.job.num),
        "overrides": list(hydra_cfg.overrides.task),
        "config_yaml": OmegaConf.to_yaml(OmegaConf.create(data)),
    }
    try:
        handle = _start(run_cfg, job_dir, run_info, checked)
    except ConfigError as exc:
        where = (
            f" (job {run_info['job']}: {' '.join(run_info['overrides'])})"
            if hydra_cfg.job.num
            else ""
        )
        say_error(f"{exc}{where}")
        sys.exit(2)
    outputs_error = None
    try:
        state = handle.join()
        try:
            _hf_outputs(run_cfg, state, job_dir)
        except Exception as exc:  # the run trained, its Hugging Face outputs are not readable
            outputs_error = f"Hugging Face outputs: {exc}"
            raise
    except Exception as exc:
        log.error("job %s failed: %s (outputs in %s)", run_info["job"], exc, job_dir)
        if os.environ.get("FLODL_FULL_ERROR"):
            log.exception("full traceback")
    summary = handle.summary
    written = summary.to_dict() if summary is not None else _NO_SUMMARY
    if outputs_error is not None:
        written = written | {"status": "failed", "error": outputs_error}
    row = written | {"job": run_info["job"]}
    return Objective(objective(row, run_cfg.task), row)


_NO_SUMMARY: dict[str, Any] = {"status": "failed", "error": "no summary written"}


def _start(
    run_cfg: RunConfig, job_dir: Path, run_info: dict[str, Any], checked: CheckedJob | None
) -> Any:
    """Check what the launcher did not yet (:mod:`flodl.preflight`), then start the run."""
    from flodl import preflight
    from flodl.trainer import Trainer

    task = run_cfg.task
    has_eval = task.has_eval
    if checked is None:
        run_info["model_signature"] = preflight.check_factories(run_cfg)
        preflight.check_task_targets(task)  # last: its metrics need torchmetrics
        config = run_cfg.trainer_config()
    else:
        run_info["model_signature"], config = checked.signature, checked.config
    return Trainer.run(
        partial(build_model, run_cfg.model),
        partial(build_optimizer, run_cfg.optimizer),
        resolve_dotted(task.train_step),
        config,
        dataset=partial(build_dataset, run_cfg.dataset, "train"),
        eval_dataset=partial(build_dataset, run_cfg.dataset, "test") if has_eval else None,
        **evaluation_kwargs(task),
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


def _hf_outputs(run_cfg: RunConfig, state: Any, job_dir: Path) -> None:
    """A Hugging Face model's ``save_pretrained`` outputs (``flodl.hf.export``), after a run
    that ended with a trained state."""
    from flodl.hf.export import is_hf_model

    if state is None or not is_hf_model(run_cfg.model):
        return
    from flodl.hf.data import dataset_tokenizer
    from flodl.hf.export import export

    dataset = run_cfg.dataset
    tokenizer = None
    if dataset.target == "flodl.hf.data.text_dataset":
        tokenizer = dataset_tokenizer(dataset.kwargs())
    export(run_cfg.model, state, job_dir, run_cfg.trainer_config().seed, tokenizer)


def evaluation_kwargs(task: schema.TaskConfig) -> dict[str, Any]:
    """What ``Trainer.run`` evaluates with, from the task section: the legacy ``eval_fn``, the
    torchmetrics ``metrics``, ``eval_loss`` and ``eval_step`` (also
    ``flodl.step.evaluation.EvalSpec``'s
    fields, which is how bench/ddp_worker.py evaluates its torch DDP baseline alike)."""
    return {
        "eval_fn": _optional(task.eval_fn),
        "metrics": {name: partial(build_metric, t) for name, t in task.metrics.items()},
        "eval_loss": _optional(task.eval_loss),
        "eval_step": _optional(task.eval_step),
    }


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
            hint = did_you_mean(part, list(fields), f"{path}.")
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


#: Counts the sweep's failed jobs from their summaries (exit 1), whatever the user's config lists.
FAILED_JOBS_CALLBACK = "++hydra.callbacks.flodl_failed_jobs._target_=flodl.cli.sweep.FailedJobs"


def cli(main: Callable[[], Any]) -> None:
    """Run the Hydra entry with flodl's exit codes (2: bad config, 1: a job failed, 130:
    interrupted), whatever the config lists: the failed-jobs callback is added here, and Hydra's
    own composition errors (an unknown group option, a missing primary config) become one line."""
    user_full_error = bool(os.environ.get("HYDRA_FULL_ERROR"))
    try:
        check_override_keys(sys.argv[1:])
        if not any(a.split("=", 1)[0] in _INFO_FLAGS for a in sys.argv[1:]):
            sys.argv.append(FAILED_JOBS_CALLBACK)
        _warm_early(sys.argv[1:])
        with _sigterm_as_interrupt(), _hydra_raises():
            main()
    except KeyboardInterrupt as exc:
        if os.environ.get("FLODL_FULL_ERROR"):
            import traceback

            traceback.print_exc()
        code = getattr(exc, "exit_code", 130)
        say_error(f"interrupted (exit {code}); see summary.json for what was saved")
        sys.exit(code)
    except ConfigError as exc:
        say_error(str(exc))
        sys.exit(2)
    except JobsFailed as exc:
        say_error(f"{exc.failed} job(s) failed; see summary.json in their job directories")
        sys.exit(1)
    except LaunchFailed:
        raise
    except SystemExit as exc:
        # Hydra exits 1 when composition fails (unknown group option, bad override syntax)
        # before our launcher ran: that is a configuration error too.
        if exc.code == 1:
            sys.exit(2)
        raise
    except Exception as exc:
        if user_full_error or os.environ.get("FLODL_FULL_ERROR"):
            raise
        line = hydra_error_line(exc)
        ran = _jobs_ran()
        if ran:  # e.g. Optuna's sweeper on a batch whose jobs all failed (a NaN objective)
            failed = sum(1 for row in ran if row.get("status") != "ok")
            first = (str(exc).strip().splitlines() or [""])[0]
            say_error(
                f"the sweep stopped after {len(ran)} job(s), {failed} failed: "
                f"{type(exc).__name__}: {first} (FLODL_FULL_ERROR=1 shows the traceback)"
            )
            sys.exit(1)
        if line is None:
            raise
        say_error(line)
        sys.exit(2)


def _jobs_ran() -> list[dict[str, Any]]:
    """The rows of the jobs the flodl launcher ran in this process (none if it never ran)."""
    sweep = sys.modules.get("flodl.cli.sweep")
    return list(getattr(sweep, "RAN", []))


class _hydra_raises:
    """Hydra's ``run_and_report`` prints a composition error over several lines and exits 1;
    with ``HYDRA_FULL_ERROR`` it raises instead, so :func:`cli` can say it in one line. Set only
    while Hydra runs (a user's own setting is kept, and means a full traceback)."""

    def __enter__(self) -> None:
        self.was = os.environ.get("HYDRA_FULL_ERROR")
        os.environ["HYDRA_FULL_ERROR"] = "1"

    def __exit__(self, *exc: Any) -> None:
        if self.was is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = self.was


def hydra_error_line(exc: BaseException) -> str | None:
    """A composition error of Hydra or OmegaConf (nothing ran yet) as one line; None for any
    other exception (a bug: its traceback is shown)."""
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(exc, (HydraException, OmegaConfBaseException)):
        return None
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    head = lines[0]
    if isinstance(exc, MissingConfigException):
        options = getattr(exc, "options", None) or [
            line for line in text.splitlines()[1:] if line.startswith("\t")
        ]
        options = [str(o).strip() for o in options if not str(o).strip().startswith("_")]
        if "primary config" in head:
            return f"{head.rstrip('.')} (the --config-dir/--config-name of flodl train)"
        hint = ""
        if options:
            hint = f"; available: {', '.join(options)}"
        return (
            f"{head.rstrip('.')} in your config directory or flodl's config groups "
            f"(conf/, pkg://flodl.conf){hint}"
        )
    if isinstance(exc.__cause__, OmegaConfBaseException):
        head = f"{head} ({str(exc.__cause__).splitlines()[0].strip()})"
    if "not in struct" in head and head.startswith("Could not override"):
        key = head.split("'")[1] if head.count("'") >= 2 else "KEY"
        group = key.split(".")[0]
        missing = str(getattr(exc.__cause__, "key", "") or "")
        known = _sibling_keys(exc.__cause__) if "." in key and missing == key.split(".")[-1] else []
        if known:  # the section is there, the key in it is not: a misspelt key
            parent, _, leaf = key.rpartition(".")
            hint = did_you_mean(leaf, known, f"{parent}." if parent else "")
            return (
                f"{key}: no such key{hint}; {parent or 'the config'} has "
                f"{', '.join(known)}; a new key is added with +{key}=VALUE"
            )
        options = flodl_options(group)
        listed = (
            f"list one of flodl's {group} options ({', '.join(options)}) in its defaults, or "
            if options
            else ""
        )
        head += f"; your config has no such key: {listed}add the key with +{key}=VALUE"
    return head


def flodl_options(group: str) -> list[str]:
    """The options of flodl's config group ``group`` (``pkg://flodl.conf``), [] for none."""
    from importlib import resources

    folder = resources.files("flodl.conf").joinpath(group)
    if not folder.is_dir():
        return []
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


def _sibling_keys(cause: BaseException | None) -> list[str]:
    """The keys beside a missing one (OmegaConf's error knows the section it looked in)."""
    from omegaconf import DictConfig

    parent = getattr(cause, "parent_node", None)
    if not isinstance(parent, DictConfig):
        return []
    return [str(k) for k in parent if not str(k).startswith("_")]


_INFO_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "--shell-completion")


def _warm_early(args: list[str]) -> None:
    """Start the fork server of local CPU ranks before Hydra composes the job, on speculation:
    the default job is a CPU rig, and the server's imports (torch, the worker: ~2.5 s of CPU)
    then overlap composition and the launcher's checks. A job that turns out not to fork its
    ranks from it ends it (:func:`flodl.cli.sweep._warm_ranks`), as does a refusal (at exit: it is
    killed, not waited for). Not when torchrun or srun placed this process, nor for Hydra's
    informational flags (nothing trains)."""
    from flodl.runtime.cohorts import fork_server
    from flodl.runtime.wire.rank_env import external_role

    if any(arg.split("=", 1)[0] in _INFO_FLAGS for arg in args):
        return
    try:
        placed = external_role() is not None
    except RuntimeError:  # a broken placement: the launcher refuses it later, with its message
        placed = True
    if not placed:
        fork_server.start()


__all__ = ["RunConfig", "build_dataset", "build_model", "build_optimizer", "cli", "train"]
