"""The A/B report a sweep ends with: ``ab_report.md``, ``ab_report.json`` and ``ab_report.png``.

One row per job (a ``RunSummary.to_dict()`` plus ``job``): the ddp-bench table for the user's
own model. Speedup is measured against the sweep's ``solo`` job, else its ``nccl_sync`` job,
because those are the baselines a user asks about ("is cadence faster than one GPU / than DDP?").
Failed jobs stay in the table with their error, so a sweep never hides what went wrong.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]

BASELINE_MODES = ("solo", "nccl_sync")
_DASH = "—"
_ERROR_WIDTH = 80
# The mode has its own column; repeating ``elche.mode=...`` in the overrides column is noise.
_SHOWN_ELSEWHERE = {"elche.mode"}


def is_ok(row: Row) -> bool:
    """Whether a job finished; only finished jobs are baselines, plotted or compared."""
    return row.get("status") == "ok"


def _override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def differing_overrides(rows: Sequence[Row]) -> list[str]:
    """Overrides not shared by every row, in first-seen order: what tells jobs apart."""
    seen: list[str] = []
    for row in rows:
        seen.extend(o for o in row.get("overrides") or [] if o not in seen)
    common = set.intersection(*(set(r.get("overrides") or []) for r in rows)) if rows else set()
    return [o for o in seen if o not in common and _override_key(o) not in _SHOWN_ELSEWHERE]


def _row_overrides(row: Row, differing: Sequence[str]) -> str:
    return " ".join(o for o in row.get("overrides") or [] if o in differing)


def find_baseline(rows: Sequence[Row]) -> Row | None:
    """The first finished ``solo`` job, else the first finished ``nccl_sync`` job, else None."""
    for mode in BASELINE_MODES:
        for row in rows:
            if row.get("mode") == mode and is_ok(row) and (row.get("wall_s") or 0) > 0:
                return row
    return None


def speedup(row: Row, baseline: Row | None) -> float | None:
    """``baseline wall_s / row wall_s``; None for failed jobs or when there is no baseline."""
    wall = row.get("wall_s") or 0.0
    if baseline is None or not is_ok(row) or wall <= 0:
        return None
    return float(baseline["wall_s"]) / float(wall)


#: Two rig jobs whose calibrated nominal steps differ by more than this ran on a machine whose
#: load changed between them: raw samples/s then measures the machine, not the mode.
CALIBRATION_SPREAD = 0.10


def nominal_ms(row: Row) -> float | None:
    """A CPU-rig job's nominal step (its speed-1.0 rank's paced step), None off the rig."""
    rig = row.get("rig") or {}
    value = rig.get("nominal_step_ms")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def reference_nominal_ms(rows: Sequence[Row]) -> float | None:
    """The nominal step every rig job's throughput is matched to: the baseline's, else the
    median of the finished jobs'."""
    baseline = find_baseline(rows)
    if baseline is not None and nominal_ms(baseline) is not None:
        return nominal_ms(baseline)
    steps = sorted(s for r in rows if is_ok(r) for s in [nominal_ms(r)] if s is not None)
    return steps[len(steps) // 2] if steps else None


def t_matched_samples_per_s(row: Row, reference_ms: float | None) -> float | None:
    """Throughput as if the job had been paced to the reference nominal step: a paced rank's
    throughput scales as 1/T, so ``samples/s x T_job / T_ref``."""
    own = nominal_ms(row)
    rate = row.get("samples_per_s")
    if own is None or reference_ms is None or not isinstance(rate, (int, float)):
        return None
    return float(rate) * own / reference_ms


def calibration_warning(rows: Sequence[Row]) -> str | None:
    """One line naming the jobs whose calibrated steps differ by more than CALIBRATION_SPREAD."""
    steps = [(r, s) for r in rows if is_ok(r) for s in [nominal_ms(r)] if s is not None]
    if len(steps) < 2:
        return None
    (low_row, low), (high_row, high) = (
        min(steps, key=lambda x: x[1]),
        max(steps, key=lambda x: x[1]),
    )
    if high <= low * (1 + CALIBRATION_SPREAD):
        return None
    return (
        f"calibrated nominal steps differ {high / low:.2f}x: job {high_row.get('job')} "
        f"({high_row.get('mode')}) {high:.1f} ms vs job {low_row.get('job')} "
        f"({low_row.get('mode')}) {low:.1f} ms; the machine's load changed between jobs, so "
        "raw samples/s compares the machine, not the modes: read the T-matched column "
        "(samples/s @T), or rerun on an idle machine"
    )


def eval_metric_name(rows: Sequence[Row]) -> str:
    """The eval column's header: the sweep's metric when all jobs agree, else ``eval``."""
    names = {r["eval_metric"] for r in rows if r.get("eval_metric")}
    return names.pop() if len(names) == 1 else "eval"


def metric_columns(rows: Sequence[Row]) -> list[str]:
    """Every eval metric some job reported (``summary.json``'s ``metrics``), first-seen order,
    except the one the eval column already shows."""
    shown = eval_metric_name(rows)
    names: list[str] = []
    for row in rows:
        names.extend(n for n in row.get("metrics") or {} if n not in names and n != shown)
    return names


def _num(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return _DASH if value is None else str(value)
    return format(value, fmt)


def _cell(text: str) -> str:
    # A pipe or a newline inside a cell would break the markdown table.
    return " ".join(text.split()).replace("|", "\\|")


def _status(row: Row) -> str:
    if is_ok(row):
        return "ok"
    error = " ".join(str(row.get("error") or "").split())
    if len(error) > _ERROR_WIDTH:
        error = error[: _ERROR_WIDTH - 1] + "…"
    status = str(row.get("status") or "failed")
    return f"{status}: {error}" if error else status


def _idle(row: Row) -> str:
    fractions = row.get("idle_fraction") or []
    return "/".join(f"{f:.2f}" for f in fractions) if fractions else _DASH


def format_table(rows: Sequence[Row]) -> str:
    """The report's markdown table, one line per job."""
    differing = differing_overrides(rows)
    baseline = find_baseline(rows)
    metrics = metric_columns(rows)
    header = [
        "job",
        "mode",
        "overrides",
        "status",
        "final loss",
        eval_metric_name(rows),
        "wall s",
        "syncs",
        "mean sync ms",
        "idle",
        "samples/s",
        "samples/s @T",
        "speedup",
        *metrics,
    ]
    reference = reference_nominal_ms(rows)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        gain = speedup(row, baseline)
        cells = [
            str(row.get("job", "")),
            str(row.get("mode", "")),
            _row_overrides(row, differing) or _DASH,
            _status(row),
            _num(row.get("final_loss"), ".4f"),
            _num(row.get("eval_value"), ".4f"),
            _num(row.get("wall_s"), ".1f"),
            _num(row.get("syncs"), "d"),
            _num(row.get("mean_sync_ms"), ".1f"),
            _idle(row),
            _num(row.get("samples_per_s"), ".0f"),
            _num(t_matched_samples_per_s(row, reference), ".0f"),
            _DASH if gain is None else f"{gain:.2f}x",
            *(_num((row.get("metrics") or {}).get(name), ".4f") for name in metrics),
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _markdown(rows: Sequence[Row], baseline: Row | None) -> str:
    if baseline is None:
        note = "Speedup: no finished `solo` or `nccl_sync` job to compare against."
    else:
        note = (
            f"Speedup = wall time of job {baseline.get('job')} ({baseline.get('mode')}) "
            "/ wall time of the job."
        )
    parts = ["# A/B report", "", f"{len(rows)} jobs. {note}", ""]
    reference = reference_nominal_ms(rows)
    if reference is not None:
        parts += [
            f"samples/s @T: CPU-rig throughput matched to one nominal step ({reference:.1f} ms): "
            "samples/s x the job's nominal step / that step.",
            "",
        ]
    warning = calibration_warning(rows)
    if warning:
        parts += [f"**Warning:** {warning}.", ""]
    parts.append(format_table(rows))
    failed = [r for r in rows if not is_ok(r) and r.get("error")]
    if failed:
        parts += ["## Failed jobs", ""]
        for row in failed:
            error = str(row["error"]).strip()[:2000]
            parts += [f"### job {row.get('job')} ({row.get('mode')})", "", "```", error, "```", ""]
    return "\n".join(parts).rstrip() + "\n"


def _finite(value: Any) -> Any:
    """NaN/inf become null: strict JSON readers (jq, browsers) reject them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def report_data(rows: Sequence[Row]) -> dict[str, Any]:
    """What ``ab_report.json`` holds: the baseline job and every row with its speedup."""
    baseline = find_baseline(rows)
    reference = reference_nominal_ms(rows)
    return _finite(
        {
            "baseline": None if baseline is None else str(baseline.get("job")),
            "eval_metric": eval_metric_name(rows),
            "differing_overrides": differing_overrides(rows),
            "reference_nominal_ms": reference,
            "calibration_warning": calibration_warning(rows),
            "rows": [
                {
                    **row,
                    "speedup": speedup(row, baseline),
                    "samples_per_s_t_matched": t_matched_samples_per_s(row, reference),
                }
                for row in rows
            ],
        }
    )


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_ab_report(sweep_dir: Path, rows: list[Row]) -> dict[str, Path]:
    """Write the markdown, JSON and PNG reports into ``sweep_dir``; return their paths."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "md": sweep_dir / "ab_report.md",
        "json": sweep_dir / "ab_report.json",
        "png": sweep_dir / "ab_report.png",
    }
    _write_atomic(paths["md"], _markdown(rows, find_baseline(rows)))
    _write_atomic(paths["json"], json.dumps(report_data(rows), indent=2) + "\n")
    plot_report(paths["png"], rows)
    return paths


def _labels(rows: Sequence[Row]) -> list[str]:
    """Legend labels: mode plus the overrides that tell jobs apart; the job when still equal."""
    differing = differing_overrides(rows)
    labels = [f"{r.get('mode', '')} {_row_overrides(r, differing)}".strip() for r in rows]
    return [
        f"{label} (job {r.get('job')})" if labels.count(label) > 1 else label
        for label, r in zip(labels, rows, strict=True)
    ]


def plot_report(path: Path, rows: Sequence[Row]) -> None:
    """Loss against wall time per finished job (left) and the final eval per job (right)."""
    # Imported here: matplotlib costs a second to import and only sweeps need it. The Agg
    # canvas is used directly so the process-wide pyplot backend is left alone.
    from flodl.config.extras import require

    require("matplotlib", "the A/B report's plot (ab_report.png)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_eval = fig.subplots(1, 2)
    finished = [(r, label) for r, label in zip(rows, _labels(rows), strict=True) if is_ok(r)]
    if not finished:
        for ax in (ax_loss, ax_eval):
            ax.set_axis_off()
        ax_loss.text(0.5, 0.5, "no successful jobs", ha="center", va="center", fontsize=14)
    else:
        _plot_losses(ax_loss, finished)
        _plot_evals(ax_eval, finished, eval_metric_name(rows))
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100)
    os.replace(tmp, path)


def _plot_losses(ax: Any, finished: Sequence[tuple[Row, str]]) -> None:
    losses: list[float] = []
    # Colour i is finished job i in both panels, so a bar and its loss curve match.
    for i, (row, label) in enumerate(finished):
        curve = [(float(t), float(v)) for t, v in row.get("loss_curve") or []]
        if curve:
            xs = [t for t, _ in curve]
            ys = [v for _, v in curve]
            ax.plot(xs, ys, marker="o", markersize=3, label=label, color=f"C{i % 10}")
            losses.extend(ys)
    ax.set_title("train loss vs wall time")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("train loss")
    finite = [v for v in losses if math.isfinite(v)]
    # Losses spanning orders of magnitude are unreadable on a linear axis.
    if finite and min(finite) > 0 and max(finite) / min(finite) > 20:
        ax.set_yscale("log")
    if losses:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)


def _plot_evals(ax: Any, finished: Sequence[tuple[Row, str]], metric: str) -> None:
    scored = [
        (f"job {r.get('job')} {r.get('mode', '')}", float(r["eval_value"]), f"C{i % 10}")
        for i, (r, _) in enumerate(finished)
        if r.get("eval_value") is not None
    ]
    ax.set_title(f"final {metric}")
    if not scored:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no eval results", ha="center", va="center")
        return
    names = [name for name, _, _ in scored]
    bars = ax.bar(range(len(scored)), [v for _, v, _ in scored], color=[c for _, _, c in scored])
    ax.bar_label(bars, fmt="%.4f", fontsize="small")
    ax.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax.set_ylabel(metric)
