"""``import flodl.monitor`` is light; its names resolve to the implementing modules."""

from __future__ import annotations

import subprocess
import sys

import pytest

import flodl.monitor
from flodl.monitor.console import Progress
from flodl.monitor.dashboard import Dashboard
from flodl.monitor.report import write_ab_report
from flodl.monitor.tensorboard import RunLogger


def test_exports_resolve_lazily() -> None:
    assert flodl.monitor.RunLogger is RunLogger
    assert flodl.monitor.Progress is Progress
    assert flodl.monitor.Dashboard is Dashboard
    assert flodl.monitor.write_ab_report is write_ab_report
    assert set(flodl.monitor.__all__) <= set(dir(flodl.monitor))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = flodl.monitor.Nope


def test_import_pulls_in_no_heavy_dependency() -> None:
    code = (
        "import sys, flodl.monitor, flodl.monitor.console, flodl.monitor.report, "
        "flodl.monitor.tensorboard, flodl.monitor.dashboard; "
        "heavy = [m for m in ('torch', 'matplotlib', 'rich', 'tensorboard') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
