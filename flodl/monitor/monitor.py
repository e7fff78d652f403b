"""``Monitor``: the Python API's handle on the dashboard (one TensorBoard URL for the cluster)."""

from __future__ import annotations

from pathlib import Path

from flodl.monitor.dashboard import Dashboard


class Monitor:
    """Serve a run's (or a sweep's) directory with TensorBoard from the launcher.

    monitor = Monitor("flodl_runs")
    print(monitor.serve(6006))      # http://127.0.0.1:6006/
    ... Trainer.builder(...).output_dir("flodl_runs/a").run().join()
    monitor.stop()
    """

    def __init__(self, logdir: str | Path) -> None:
        self.logdir = Path(logdir)
        self.dashboard: Dashboard | None = None

    def serve(self, port: int, host: str = "127.0.0.1") -> str:
        """Start TensorBoard on ``host:port`` (loopback by default); return its URL."""
        if self.dashboard is not None:
            return self.dashboard.url
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.dashboard = Dashboard.start(self.logdir, port, host)
        return self.dashboard.url

    @property
    def url(self) -> str | None:
        return self.dashboard.url if self.dashboard is not None else None

    def stop(self) -> None:
        if self.dashboard is not None:
            self.dashboard.stop()
            self.dashboard = None

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
