"""The flodl Hydra launcher: each job becomes a rank group; a failed job is a failed row."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

# Importing this module registers the launcher's schema.
from hydra_plugins.flodl_launcher import config as _config  # noqa: F401


class FlodlLauncher(Launcher):
    def __init__(self, report: bool = True) -> None:
        self.report = report
        self.rows: dict[int, dict[str, Any]] = {}  # every job's row, over all of a sweep's batches
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function
        from flodl.cli.sweep import count_failed_jobs  # heavy imports only when a sweep runs

        count_failed_jobs(hydra_context)  # exit 1 when a job failed, whatever the config lists

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        from flodl.cli.sweep import launch_sweep  # heavy imports only when a sweep really runs

        assert self.config is not None and self.hydra_context is not None
        assert self.task_function is not None
        out: Any = launch_sweep(
            launcher=self,
            job_overrides=job_overrides,
            initial_job_idx=initial_job_idx,
        )
        return out
