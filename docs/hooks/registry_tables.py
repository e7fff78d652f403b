"""MkDocs hook: render the extension registries' tables at build time.

A page writes ``<!-- registry: NAME -->`` on a line of its own (``modes``, ``links``,
``plan_elements``, ``codecs``); the hook replaces it with a table read from that registry
(docs/design/registries.md), so the docs cannot drift from what the code declares.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

MARKER = re.compile(r"^<!-- registry: (\w+) -->$", re.MULTILINE)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else ""


def modes() -> str:
    registry = importlib.import_module("flodl.config.registries.modes")
    rows = []
    for mode, p in registry.MODES.items():
        cadence = "alone" if p.alone else "every step" if p.lock_step else "ElChe's windows"
        where = "—" if p.alone else "controller" if p.via_controller else "collective"
        rows.append(
            [
                f"`{mode.value}`",
                p.summary,
                cadence,
                where,
                f"`{p.rank_side.rsplit('.', 1)[1]}`",
                _yes(p.overshoot),
                _yes(p.gradient_sync),
                "yes" if p.compress_refusal is None else "",
            ]
        )
    header = ["mode", "how", "averages", "through", "rank side", "overshoot", "grad sync",
              "compress"]  # fmt: skip
    return _table(header, rows)


def _latency(ms: float) -> str:
    return f"{ms * 1000:g} µs" if ms < 1 else f"{ms:g} ms"


def links() -> str:
    registry = importlib.import_module("flodl.config.registries.link_profiles")
    rows = [[f"`{registry.NO_LINK}` (default)", "—", "—", "—", "loopback: nothing charged"]]
    for name, p in registry.LINK_PROFILES.items():
        staged = "yes (\u00d72 bytes)" if p.staged else "no"
        rows.append([f"`{name}`", f"{p.bandwidth_gbps:g}", _latency(p.latency_ms), staged, p.what])
    header = ["profile", "bandwidth (Gbit/s per direction)", "latency per hop",
              "staged through host", "stands for"]  # fmt: skip
    return _table(header, rows)


def plan_elements() -> str:
    registry = importlib.import_module("flodl.config.registries.plan_elements")
    modes = importlib.import_module("flodl.config.registries.modes")
    rows = []
    for name, e in registry.PLAN_ELEMENTS.items():
        needs = []
        if e.needs_mode is not None:
            able = [m.value for m, p in modes.MODES.items() if getattr(p, e.needs_mode)]
            needs.append(" or ".join(f"`{m}`" for m in able))
        if e.elementwise_optimizer:
            needs.append("an elementwise optimizer")
        apart = ", ".join(f"`{other}`" for other in e.excludes)
        rows.append([f"`{name}` — {e.words}", e.summary, "; ".join(needs), apart, str(e.cost)])
    header = ["element", "what it does and costs", "needs", "does not combine with",
              "auto's cost rank"]  # fmt: skip
    return _table(header, rows)


def codecs() -> str:
    registry = importlib.import_module("flodl.config.registries.codecs")
    rows = [[f"`{registry.NO_CODEC}` (default)", "fp32, whole", "4", "", ""]]
    for name, c in registry.CODECS.items():
        carried = "all-reduce" if c.collective == "all_reduce" else "all-gather"
        rows.append(
            [f"`{name}`", c.summary, f"{c.value_bytes:.4g}", carried, _yes(c.error_feedback)]
        )
    header = ["compress", "what travels", "bytes a value", "collective modes", "error feedback"]
    return _table(header, rows)


RENDERERS: dict[str, Callable[[], str]] = {
    "codecs": codecs,
    "modes": modes,
    "links": links,
    "plan_elements": plan_elements,
}


def render(markdown: str) -> str:
    def table(match: re.Match[str]) -> str:
        return RENDERERS[match.group(1)]()

    return MARKER.sub(table, markdown)


def on_page_markdown(markdown: str, **_: Any) -> str:
    return render(markdown) if "<!-- registry:" in markdown else markdown
