"""Observability of a run: TensorBoard files, the dashboard, the progress line, the A/B report.

Names are resolved on first use (PEP 562) so that ``import flodl.monitor`` stays cheap and never
imports torch, rich or matplotlib: the Hydra plugin and the launcher import it before they know
whether any of those will be needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flodl.monitor.console import Progress, format_epoch_line
    from flodl.monitor.dashboard import Dashboard
    from flodl.monitor.monitor import Monitor
    from flodl.monitor.report import format_table, write_ab_report
    from flodl.monitor.tensorboard import RunLogger

_EXPORTS = {
    "RunLogger": "flodl.monitor.tensorboard",
    "Progress": "flodl.monitor.console",
    "format_epoch_line": "flodl.monitor.console",
    "write_ab_report": "flodl.monitor.report",
    "format_table": "flodl.monitor.report",
    "Dashboard": "flodl.monitor.dashboard",
    "Monitor": "flodl.monitor.monitor",
}

__all__ = [
    "Dashboard",
    "Monitor",
    "Progress",
    "RunLogger",
    "format_epoch_line",
    "format_table",
    "write_ab_report",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flodl.monitor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
