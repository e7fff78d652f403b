"""The dashboard serves TensorBoard over a run directory and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from flodl.monitor import dashboard
from flodl.monitor.dashboard import Dashboard, port_in_use
from flodl.monitor.metrics import EpochMetrics
from flodl.monitor.tensorboard import RunLogger

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("job")
    with RunLogger(root, world_size=1) as log:
        log.epoch(EpochMetrics(epoch=0, avg_loss=0.5, epoch_ms=10.0, per_rank_throughput=[100.0]))
    return root


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _poll(url: str, ok: Any, timeout_s: float = 30.0) -> Any:
    """TensorBoard loads event files in the background: ask until ``ok(answer)`` holds."""
    deadline = time.monotonic() + timeout_s
    answer = None
    while time.monotonic() < deadline:
        answer = _get(url)
        if ok(answer):
            return answer
        time.sleep(0.5)
    raise AssertionError(f"{url} never satisfied the check; last answer: {answer}")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_serves_runs_and_tags_then_stops_cleanly(job_dir: Path) -> None:
    with Dashboard.start(job_dir, port=0) as dash:
        assert dash.url == f"http://127.0.0.1:{dash.port}/"
        runs = _poll(dash.url + "data/runs", lambda r: {"tb", "tb/rank_0"} <= set(r))
        assert "tb" in runs
        tags = _poll(dash.url + "data/plugin/scalars/tags", lambda t: "tb" in t)
        assert "loss/train" in tags["tb"]
        assert "throughput/samples_per_s" in tags["tb/rank_0"]
        # The port is taken: a second dashboard says so before starting anything.
        with pytest.raises(OSError, match=rf"logger.serve={dash.port}: port already in use"):
            Dashboard.start(job_dir, port=dash.port)
        assert dash.running
    assert not dash.running
    assert _gone(dash.pid)
    assert not port_in_use("127.0.0.1", dash.port)
    dash.stop()  # idempotent


def test_server_dies_with_its_launcher(job_dir: Path) -> None:
    # A launcher killed without cleanup (os._exit skips atexit) must not leave a server behind.
    code = (
        "import sys, os; from pathlib import Path; from flodl.monitor.dashboard import Dashboard; "
        f"d = Dashboard.start(Path({str(job_dir)!r}), port=0); "
        "print(d.pid, d.port, flush=True); os._exit(0)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=90, check=True
    )
    pid, port = (int(x) for x in out.stdout.split())
    deadline = time.monotonic() + 15
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(pid), "TensorBoard outlived its launcher"
    assert not port_in_use("127.0.0.1", port)


def test_failed_start_reports_tensorboard_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = "import sys; print('tensorboard: cannot load plugins'); sys.exit(3)"
    monkeypatch.setattr(dashboard, "_CHILD", broken)
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*cannot load plugins"):
        Dashboard.start(tmp_path, port=0)


def test_foreign_host_is_refused_before_starting(tmp_path: Path) -> None:
    with pytest.raises(OSError, match=r"logger.host=203.0.113.1: cannot serve on this address"):
        Dashboard.start(tmp_path, port=0, host="203.0.113.1")  # TEST-NET-3: not this machine
