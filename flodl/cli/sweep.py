"""What the Hydra launcher plugin does: validate every job, run each as a rank group, report.

Every job's config is composed and validated before any rank starts, so a bad value in the
third job of a sweep fails the sweep at once with exit code 2 rather than after two runs.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import open_dict

from flodl.cli import app
from flodl.config import ConfigError, validate_run_config
from flodl.monitor.failures import describe, write_failure

log = logging.getLogger("flodl")


def launch_sweep(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
    from hydra.core.utils import configure_log, setup_globals

    setup_globals()
    config, ctx = launcher.config, launcher.hydra_context
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)  # as BasicLauncher does
    sweep_dir = Path(str(config.hydra.sweep.dir))
    jobs, loggers = [], []
    several = initial_job_idx + len(job_overrides) > 1
    for offset, overrides in enumerate(job_overrides):
        idx = initial_job_idx + offset
        job_cfg = ctx.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(job_cfg):
            job_cfg.hydra.job.id = f"{idx}"
            job_cfg.hydra.job.num = idx
        _require_flodl_job(job_cfg)
        try:  # every job of the batch, before any of them starts a rank
            checked = check_job(job_cfg, warm=offset == 0)
        except ConfigError as exc:
            where = f" (job {idx}: {' '.join(overrides)})" if several else ""
            app.say_error(f"{exc}{where}{written_at(str(exc), config)}")
            sys.exit(2)
        jobs.append((idx, list(overrides), job_cfg, checked))
        loggers.append(checked.run.logger)
        if offset == 0 and initial_job_idx == 0:
            _check_direction(config, checked.run.task)

    if several and launcher.report:
        _require_report_plot()
    try:
        return _launch(launcher, ctx, jobs, sweep_dir, loggers[0])
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception:  # composition succeeded: this is no configuration error (exit 1, not 2)
        log.exception("the flodl launcher failed")
        raise app.LaunchFailed() from None


def _require_report_plot() -> None:
    """A sweep ends with its A/B report, whose plot needs matplotlib (flodl[report])."""
    from flodl.config.extras import has, missing_extra

    if not has("matplotlib"):
        exc = missing_extra(
            "matplotlib", "a sweep's A/B report (ab_report.png)", "hydra.launcher.report=false"
        )
        app.say_error(str(exc))
        sys.exit(2)


def written_at(message: str, config: Any) -> str:
    """`` (in conf/config.yaml:21)`` for an unknown key written in one of the project's own YAML
    files (its primary config directory, ``--config-dir``), else ``""``: flodl's own groups are
    never the culprit."""
    import re

    from omegaconf import OmegaConf

    key, sep, rest = message.partition(": ")
    if not sep or not rest.startswith("unknown key") or not re.fullmatch(r"[\w.]+", key):
        return ""
    leaf = re.compile(rf"^\s*{re.escape(key.rsplit('.', 1)[-1])}\s*:")
    sources = OmegaConf.select(config, "hydra.runtime.config_sources", default=None) or []
    for source in sources:
        if source.get("schema") != "file" or source.get("provider") not in ("main", "command-line"):
            continue
        root = Path(str(source.get("path")))
        for path in sorted(root.rglob("*.yaml")):
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError):
                continue
            for number, line in enumerate(lines, 1):
                if leaf.match(line):
                    try:
                        shown = path.relative_to(Path.cwd())
                    except ValueError:
                        shown = path
                    return f" (in {shown}:{number})"
    return ""


def _launch(launcher: Any, ctx: Any, jobs: list, sweep_dir: Path, logger: Any) -> list:
    from flodl.runtime.wire.rank_env import external_role, is_follower

    role = external_role()  # this process's placement, read once
    if is_follower(role):
        assert role is not None
        return _follow_jobs(role, jobs)  # torchrun / srun placed us: rank 0 runs the sweep
    sweep_dir.mkdir(parents=True, exist_ok=True)
    if logger.serve is None:
        return _run_jobs(launcher, ctx, jobs, sweep_dir)
    dashboard = _serve(sweep_dir, logger)
    jobs = [(idx, overrides, cfg, unserved(cfg, checked)) for idx, overrides, cfg, checked in jobs]
    try:
        return _run_jobs(launcher, ctx, jobs, sweep_dir)
    finally:
        _linger(dashboard, logger.keep_serving)


def check_job(job_cfg: Any, warm: bool = False) -> app.CheckedJob:
    """Validate one composed job, once and cheapest check first: a pure-config refusal exits
    before torch is imported, and only a good job imports its metrics (torchmetrics, scipy).
    ``warm``: once the pure-config checks passed, start the fork server of a CPU-rig job's ranks,
    so their imports overlap the checks that need torch (:func:`_warm_ranks`)."""
    from flodl.config.extras import check_hf, check_recipe_data
    from flodl.preflight import check_config, check_factories, check_task_targets

    data = app.plain_config(job_cfg)
    run_cfg = validate_run_config(data)
    config = run_cfg.trainer_config()
    check_config(config)
    check_recipe_data(run_cfg.dataset.target)
    peft = run_cfg.model.kwargs().get("peft") is not None
    check_hf(run_cfg.model.target, run_cfg.dataset.target, peft)
    if warm:
        _warm_ranks(run_cfg.cluster)
    signature = check_factories(run_cfg)
    check_task_targets(run_cfg.task)
    return app.CheckedJob(run_cfg, config, signature, data)


def _warm_ranks(cluster: Any) -> None:
    """A local CPU rig: start the fork server its ranks fork from now (if :func:`flodl.cli.app.cli`
    did not already), so its imports (torch, the worker) overlap the launcher's remaining checks
    (torch, the dry build) instead of following them (:mod:`flodl.runtime.cohorts.fork_server`).
    Any other job:
    end the server ``cli`` started on speculation."""
    from flodl.runtime.cohorts import fork_server
    from flodl.runtime.wire.rank_env import external_role

    if fork_server.serves(cluster, placed=external_role() is not None):
        fork_server.start()
    else:
        fork_server.close_idle()


def _require_flodl_job(job_cfg: Any) -> None:
    """This launcher trains flodl jobs; another app's task gets one line, not a schema error."""
    if not any(key in job_cfg for key in ("model", "optimizer", "dataset", "task")):
        app.say_error(
            "hydra/launcher=flodl runs flodl training jobs (a config with model, optimizer, "
            "dataset and task) and this app's config has none of them; use another launcher "
            "for it (hydra/launcher=basic)"
        )
        sys.exit(2)


def _check_direction(config: Any, task: Any) -> None:
    """Warn when an optimizing sweeper would optimize the objective the wrong way round."""
    from omegaconf import OmegaConf

    sweeper = OmegaConf.to_container(config.hydra.sweeper, resolve=False)
    assert isinstance(sweeper, dict)
    if "direction" in sweeper:  # Optuna
        setting, said = str(sweeper["direction"]).lower(), "hydra.sweeper.direction"
        sweeper_max = "max" in setting
    elif isinstance(sweeper.get("optim"), dict) and "maximize" in sweeper["optim"]:  # Nevergrad
        sweeper_max, said = bool(sweeper["optim"]["maximize"]), "hydra.sweeper.optim.maximize"
    else:
        return
    wanted = app.objective_maximized(task)
    if sweeper_max != wanted:
        key = app.objective_key(task, has_eval=task.has_eval)
        fix = "maximize" if wanted else "minimize"
        fix_line = f"{said}={fix}" if said.endswith("direction") else f"{said}={wanted}"
        log.warning(
            "%s asks to %s, but the objective (%s) is better when %s: add %s, or set "
            "task.objective / task.objective_direction",
            said,
            "maximize" if sweeper_max else "minimize",
            key,
            "larger" if wanted else "smaller",
            fix_line,
        )


def _follow_jobs(role: Any, jobs: list) -> list:
    """Train every job of the sweep as a worker of rank 0 (which writes every output)."""
    from flodl.runtime.cohorts.external import follow_job

    codes = []
    for idx, _, _, checked in jobs:
        code = follow_job(role, checked.config)
        log.info("job %d: rank %d finished with exit code %d", idx, role.rank, code)
        codes.append(code)
    if any(codes):
        raise app.JobsFailed(sum(1 for c in codes if c))
    return []


def unserved(job_cfg: Any, checked: app.CheckedJob) -> app.CheckedJob:
    """A job without its own dashboard (the sweep serves one over all jobs): the same change in
    the composed config and in what was validated, so the job is not checked again."""
    with open_dict(job_cfg):
        job_cfg.logger.serve = None
    logger = checked.run.logger.model_copy(update={"serve": None})
    return dataclasses.replace(
        checked,
        run=checked.run.model_copy(update={"logger": logger}),
        config=checked.config.model_copy(update={"logger": logger}),
        data=app.plain_config(job_cfg),
    )


def _serve(sweep_dir: Path, logger: Any) -> Any:
    from flodl.monitor.dashboard import Dashboard

    try:
        dashboard = Dashboard.start(sweep_dir, logger.serve, logger.host)
    except OSError as exc:
        app.say_error(str(exc))
        sys.exit(1)
    print(f"dashboard: {dashboard.url}", flush=True)
    return dashboard


def _linger(dashboard: Any, keep: bool) -> None:
    if keep:
        print(f"dashboard still serving at {dashboard.url} (Ctrl-C to stop)", flush=True)
        try:
            while dashboard.running:
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass
    dashboard.stop()


#: Rows of the jobs this process ran, over every sweep: what :func:`flodl.cli.app.cli` reads when
#: a sweeper fails after them (Optuna on an all-failed batch), to exit 1 rather than say "config".
RAN: list[dict[str, Any]] = []


def _run_jobs(launcher: Any, ctx: Any, jobs: list, sweep_dir: Path) -> list:
    from hydra.core.utils import JobReturn, JobStatus, run_job

    returns = []
    for idx, overrides, job_cfg, checked in jobs:
        log.info("job %d: %s", idx, " ".join(overrides) or "(defaults)")
        ret = run_job(  # the job itself, as validated above (not run.py's main again)
            hydra_context=ctx,
            task_function=partial(app.train, checked=checked),
            config=job_cfg,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
        row = _row(ret, idx, overrides)
        launcher.rows[idx] = row
        RAN.append(row)
        if ret.status != JobStatus.COMPLETED:  # raised out of the task: leave its failed row
            _write_failed(Path(str(ret.working_dir or sweep_dir / str(idx))), row)
        # A failed job is a failed row (NaN objective), not an aborted sweep.
        objective = ret._return_value if ret.status == JobStatus.COMPLETED else float("nan")
        returns.append(
            JobReturn(
                overrides=ret.overrides,
                cfg=ret.cfg,
                hydra_cfg=ret.hydra_cfg,
                working_dir=ret.working_dir,
                task_name=ret.task_name,
                status=JobStatus.COMPLETED,
                _return_value=objective,
            )
        )
    # Sweepers may launch a sweep in batches (max_batch_size, Optuna's n_jobs): the report covers
    # every job so far and is rewritten after each batch, so the last one covers the sweep.
    if len(launcher.rows) > 1 and launcher.report:
        from flodl.monitor.report import calibration_warning, write_ab_report

        rows = [launcher.rows[i] for i in sorted(launcher.rows)]
        paths = write_ab_report(sweep_dir, rows)
        print(f"A/B report: {paths['md']} ({len(rows)} jobs)", flush=True)
        warning = calibration_warning(rows)
        if warning:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
    return returns


def _row(ret: Any, idx: int, overrides: list[str]) -> dict[str, Any]:
    from hydra.core.utils import JobStatus

    value = ret._return_value
    if ret.status == JobStatus.COMPLETED and isinstance(value, app.Objective):
        row = dict(value.row)
    else:
        error = describe(value) if isinstance(value, BaseException) else str(value)
        row = {"status": "failed", "error": error}
    row.setdefault("job", str(idx))
    row.setdefault("overrides", overrides)
    return row


def _write_failed(job_dir: Path, row: dict[str, Any]) -> None:
    """A job that raised before writing its summary: write the failed row as its summary, so
    :class:`FailedJobs` counts it like any other failed job."""
    import json

    path = job_dir / "summary.json"
    if not path.exists():
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(row, indent=2, default=str) + "\n", encoding="utf-8")
        except OSError as exc:  # a full disk: FailedJobs counts the missing summary as failed
            log.error("job %s: %s", row.get("job"), write_failure(exc, path))


class FailedJobs(Callback):
    """Hydra callback: after a multirun, count the jobs whose ``summary.json`` says failed, so the
    command exits 1 under any launcher, also one that runs jobs in other processes or on other
    machines (joblib, submitit). No config needs to list it: :func:`flodl.cli.app.cli` adds it
    to every run (``hydra.callbacks.flodl_failed_jobs``) and the flodl launcher to its sweep
    (:func:`count_failed_jobs`)."""

    def __init__(self) -> None:
        self._t0 = time.time()

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        self._t0 = time.time()

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        from flodl.runtime.wire.rank_env import external_role, is_follower

        if is_follower(external_role()):
            return  # torchrun/srun placed us: rank 0 writes the jobs' summaries and judges them
        failed = count_failed(Path(str(config.hydra.sweep.dir)), since=self._t0)
        if failed:
            raise app.JobsFailed(failed)


def count_failed(sweep_dir: Path, since: float) -> int:
    """Jobs of this sweep (written since ``since``) that did not end ``ok``: a summary that says
    so, one that cannot be read (a full disk left it empty or cut), and a job directory Hydra
    made (``.hydra/``) with no summary at all (it could not be written). Exit codes never lie."""
    jobs = {p.parent for p in sweep_dir.glob("**/summary.json")}
    jobs |= {p.parent for p in sweep_dir.glob("**/.hydra") if p.is_dir()}
    return sum(_job_failed(job, since) for job in jobs)


def _job_failed(job: Path, since: float) -> bool:
    import json

    summary = job / "summary.json"
    try:
        stamp = (summary if summary.exists() else job / ".hydra").stat().st_mtime
    except OSError:
        return True
    if stamp < since - 1.0:
        return False  # an earlier sweep into the same directory
    try:
        return bool(json.loads(summary.read_text()).get("status") != "ok")
    except (OSError, ValueError, AttributeError):
        return True  # missing, unreadable or not a summary: the job did not end ok


def count_failed_jobs(hydra_context: Any) -> None:
    """The flodl launcher's sweep ends with :class:`FailedJobs`'s count, listed or not (a user's
    own ``@hydra.main`` entry without :func:`flodl.cli.app.cli`, a config without the callback).
    """
    callbacks = getattr(getattr(hydra_context, "callbacks", None), "callbacks", None)
    if isinstance(callbacks, list) and not any(isinstance(c, FailedJobs) for c in callbacks):
        callbacks.append(FailedJobs())
