"""What the Hydra launcher plugin does: validate every job, run each as a rank group, report.

Every job's config is composed and validated before any rank starts, so a bad value in the
third job of a sweep fails the sweep at once with exit code 2 rather than after two runs.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flodl import app
from flodl.config import ConfigError, validate_run_config

log = logging.getLogger("flodl")


def launch_sweep(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int):
    from hydra.core.utils import setup_globals
    from omegaconf import open_dict

    setup_globals()
    config, ctx = launcher.config, launcher.hydra_context
    sweep_dir = Path(str(config.hydra.sweep.dir))
    jobs, loggers = [], []
    for offset, overrides in enumerate(job_overrides):
        idx = initial_job_idx + offset
        job_cfg = ctx.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(job_cfg):
            job_cfg.hydra.job.id = f"{idx}"
            job_cfg.hydra.job.num = idx
        try:
            run_cfg = validate_run_config(app.plain_config(job_cfg))
            from flodl.runtime.preflight import check_config

            check_config(run_cfg.trainer_config())
        except ConfigError as exc:
            where = f" (job {idx}: {' '.join(overrides)})" if len(job_overrides) > 1 else ""
            print(f"error: {exc}{where}", file=sys.stderr)
            sys.exit(2)
        jobs.append((idx, list(overrides), job_cfg))
        loggers.append(run_cfg.logger)

    app.STATE["launched"] = 1
    follower = _follower()
    if follower is not None:  # torchrun / srun placed us: rank 0 runs the sweep, we serve it
        return _follow_jobs(follower, jobs)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    logger = loggers[0]
    dashboard = _serve(sweep_dir, logger) if logger.serve is not None else None
    try:
        returns = _run_jobs(launcher, ctx, jobs, sweep_dir)
    finally:
        if dashboard is not None:
            _linger(dashboard, logger.keep_serving)
            app.STATE["serving"] = 0
    return returns


def _follower() -> Any:
    """This process's torchrun / srun role when it is a rank other than 0 (else ``None``)."""
    from flodl.runtime.env import external_role

    role = external_role()
    return role if role is not None and role.world_size > 1 and not role.is_controller else None


def _follow_jobs(role: Any, jobs: list) -> list:
    """Train every job of the sweep as a worker of rank 0 (which writes every output)."""
    from flodl.runtime.external import follow

    codes = []
    for idx, _, job_cfg in jobs:
        run_cfg = validate_run_config(app.plain_config(job_cfg))
        if run_cfg.elche.mode.value == "solo":
            codes.append(0)  # solo trains on rank 0 alone
            continue
        code = follow(role, run_cfg.cluster.start_timeout_s)
        log.info("job %d: rank %d finished with exit code %d", idx, role.rank, code)
        codes.append(code)
    if any(codes):
        app.STATE["failed"] += sum(1 for c in codes if c)
    return []


def _serve(sweep_dir: Path, logger: Any) -> Any:
    from flodl.monitor.dashboard import Dashboard

    try:
        dashboard = Dashboard.start(sweep_dir, logger.serve, logger.host)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    app.STATE["serving"] = 1
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


def _run_jobs(launcher: Any, ctx: Any, jobs: list, sweep_dir: Path) -> list:
    from hydra.core.utils import JobReturn, JobStatus, run_job

    returns, rows = [], []
    for idx, overrides, job_cfg in jobs:
        log.info("job %d: %s", idx, " ".join(overrides) or "(defaults)")
        ret = run_job(
            hydra_context=ctx,
            task_function=launcher.task_function,
            config=job_cfg,
            job_dir_key="hydra.sweep.dir",
            job_subdir_key="hydra.sweep.subdir",
        )
        row = _row(ret, idx, overrides)
        rows.append(row)
        if row.get("status") != "ok":
            app.STATE["failed"] += 1
        # A failed job is a failed row, not an aborted sweep: hand Hydra a completed return.
        returns.append(
            JobReturn(
                overrides=ret.overrides,
                cfg=ret.cfg,
                hydra_cfg=ret.hydra_cfg,
                working_dir=ret.working_dir,
                task_name=ret.task_name,
                status=JobStatus.COMPLETED,
                _return_value=row,
            )
        )
    if len(rows) > 1 and launcher.report:
        from flodl.monitor.report import write_ab_report

        paths = write_ab_report(sweep_dir, rows)
        print(f"A/B report: {paths['md']}", flush=True)
    return returns


def _row(ret: Any, idx: int, overrides: list[str]) -> dict[str, Any]:
    from hydra.core.utils import JobStatus

    if ret.status == JobStatus.COMPLETED and isinstance(ret._return_value, dict):
        row = dict(ret._return_value)
    else:
        row = {
            "status": "failed",
            "error": f"{type(ret._return_value).__name__}: {ret._return_value}",
        }
    row.setdefault("job", str(idx))
    row.setdefault("overrides", overrides)
    return row
