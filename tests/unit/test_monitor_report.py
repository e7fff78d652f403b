"""The A/B report from fake job summaries: table, JSON, speedup baseline and the PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib.image
import pytest

from flodl.monitor.metrics import RunSummary
from flodl.monitor.report import (
    calibration_warning,
    differing_overrides,
    format_table,
    reference_nominal_ms,
    report_data,
    write_ab_report,
)

COMMON = ["model=mlp", "trainer.num_epochs=3"]
ERROR = "RuntimeError: rank 1 died: CUDA out of memory. Tried to allocate 2.00 GiB | " + "x" * 200


def _row(job: str, mode: str, wall_s: float, extra: list[str], **kw: Any) -> dict[str, Any]:
    summary = RunSummary(
        status=kw.pop("status", "ok"),
        mode=mode,
        world_size=1 if mode == "solo" else 2,
        epochs=3,
        final_loss=kw.pop("final_loss", 0.25),
        eval_metric="accuracy",
        eval_value=kw.pop("eval_value", 0.9),
        wall_s=wall_s,
        syncs=kw.pop("syncs", 30),
        mean_sync_ms=4.25,
        samples_per_s=1500.0,
        idle_fraction=kw.pop("idle_fraction", [0.02, 0.31]),
        overrides=[*COMMON, f"elche.mode={mode}", *extra],
        loss_curve=[(wall_s / 3 * (i + 1), 1.0 / (i + 1)) for i in range(3)],
        **kw,
    )
    return {**summary.to_dict(), "job": job}


def _sweep_rows() -> list[dict[str, Any]]:
    return [
        _row("0", "solo", 30.0, ["elche.anchor=10"], syncs=0, idle_fraction=[0.0]),
        _row("1", "nccl_sync", 20.0, ["elche.anchor=10"]),
        _row("2", "nccl_cadence", 12.0, ["elche.anchor=20"], eval_value=0.93),
        _row(
            "3",
            "cpu_async",
            4.0,
            ["elche.anchor=20"],
            status="failed",
            error=ERROR,
            final_loss=None,
            eval_value=None,
        ),
    ]


@pytest.fixture
def rows() -> list[dict[str, Any]]:
    return _sweep_rows()


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The report of the fixture sweep, rendered once: the PNG takes a second to draw."""
    return write_ab_report(tmp_path_factory.mktemp("sweep"), _sweep_rows())


def test_overrides_column_shows_only_what_differs(rows: list[dict[str, Any]]) -> None:
    # Shared overrides are hidden; elche.mode has its own column.
    assert differing_overrides(rows) == ["elche.anchor=10", "elche.anchor=20"]
    table = format_table(rows)
    assert "model=mlp" not in table and "num_epochs" not in table
    assert "elche.mode=" not in table


def test_markdown_lists_every_job_and_the_failure(written: dict[str, Path]) -> None:
    assert set(written) == {"md", "json", "png"}
    md = written["md"].read_text()
    table_lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert table_lines[0].split(" | ")[4:6] == ["final loss", "accuracy"]
    by_job = {ln.split(" | ")[0].lstrip("| "): ln for ln in table_lines[1:]}
    assert set(by_job) == {"0", "1", "2", "3"}
    assert "| 0.02/0.31 |" in by_job["1"]
    assert "| 2.50x |" in by_job["2"]  # 30 s solo / 12 s
    failed = by_job["3"]
    assert "failed: RuntimeError: rank 1 died: CUDA out of memory" in failed
    assert "x" * 100 not in failed and "…" in failed  # truncated in the table
    assert "\\|" in failed  # a pipe in the error does not break the table
    assert ERROR in md  # the full error is kept below the table


def test_json_round_trips_with_speedups_against_solo(
    rows: list[dict[str, Any]], written: dict[str, Path]
) -> None:
    data = json.loads(written["json"].read_text())
    assert data["baseline"] == "0"
    assert [r["speedup"] for r in data["rows"]] == [1.0, 1.5, 2.5, None]
    expected = json.loads(json.dumps(rows))  # tuples become lists, nothing else changes
    added = ("speedup", "samples_per_s_t_matched")
    assert [{k: v for k, v in r.items() if k not in added} for r in data["rows"]] == expected


def test_speedup_falls_back_to_nccl_sync_then_to_none(rows: list[dict[str, Any]]) -> None:
    without_solo = rows[1:]
    table = format_table(without_solo)
    assert "| 1.67x |" in table  # 20 s nccl_sync / 12 s
    only_cadence = [rows[2], rows[3]]
    speedups = [ln.rsplit(" | ", 1)[1] for ln in format_table(only_cadence).splitlines()[2:]]
    assert speedups == ["— |", "— |"]


def test_failed_baseline_is_not_a_baseline(rows: list[dict[str, Any]]) -> None:
    rows[0]["status"], rows[0]["error"] = "failed", "boom"
    data = report_data(rows)
    assert data["baseline"] == "1"
    assert [r["speedup"] for r in data["rows"]] == [None, 1.0, pytest.approx(20 / 12), None]


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_png_is_a_readable_image(written: dict[str, Path]) -> None:
    _assert_png(written["png"])
    # Exactly the three files: no temporary files left behind by the atomic writes.
    assert sorted(p.name for p in written["png"].parent.iterdir()) == [
        "ab_report.json",
        "ab_report.md",
        "ab_report.png",
    ]


def test_all_failed_sweep_still_writes_everything(tmp_path: Path) -> None:
    rows = [
        _row(str(i), mode, 1.0, [f"seed={i}"], status="failed", error="bad dataset")
        for i, mode in enumerate(["solo", "nccl_cadence"])
    ]
    paths = write_ab_report(tmp_path / "sweep", rows)
    assert json.loads(paths["json"].read_text())["baseline"] is None
    assert "failed: bad dataset" in paths["md"].read_text()
    _assert_png(paths["png"])


def test_every_eval_metric_gets_a_column_after_the_fixed_ones() -> None:
    rows = _sweep_rows()
    rows[1]["metrics"] = {"eval_loss": 0.31, "accuracy": 0.9, "f1": 0.88}
    rows[2]["metrics"] = {"eval_loss": 0.25, "accuracy": 0.93}
    header, _sep, *body = format_table(rows).splitlines()
    assert header.endswith("| speedup | eval_loss | f1 |")  # accuracy is the eval column
    assert body[1].endswith("| 0.3100 | 0.8800 |") and body[2].endswith("| 0.2500 | — |")
    assert report_data(rows)["rows"][1]["metrics"]["f1"] == 0.88


def _rig(nominal_ms: float) -> dict[str, Any]:
    return {
        "calibrated_step_ms": nominal_ms / 1.3,
        "pace_margin": 1.3,
        "nominal_step_ms": nominal_ms,
    }


def test_rig_jobs_are_t_matched_to_the_baselines_nominal_step() -> None:
    """A job paced to a 2.6x longer nominal step (a busier machine when it calibrated) shows
    2.6x its raw throughput at the baseline's step, and the report warns naming both jobs."""
    rows = [
        _row("0", "nccl_sync", 20.0, [], rig=_rig(10.0)),
        _row("1", "nccl_cadence", 30.0, [], rig=_rig(26.0)),
    ]
    data = report_data(rows)
    assert data["reference_nominal_ms"] == 10.0
    matched = [r["samples_per_s_t_matched"] for r in data["rows"]]
    assert matched == [pytest.approx(1500.0), pytest.approx(1500.0 * 2.6)]
    warning = calibration_warning(rows)
    assert warning is not None and "2.60x" in warning
    assert "job 1 (nccl_cadence) 26.0 ms" in warning and "job 0 (nccl_sync) 10.0 ms" in warning
    assert data["calibration_warning"] == warning
    table = format_table(rows)
    assert "samples/s @T" in table.splitlines()[0]
    assert "| 3900 |" in table


def test_steps_within_ten_percent_or_off_the_rig_raise_no_warning() -> None:
    close = [
        _row("0", "nccl_sync", 20.0, [], rig=_rig(10.0)),
        _row("1", "nccl_cadence", 15.0, [], rig=_rig(10.9)),
    ]
    assert calibration_warning(close) is None
    assert reference_nominal_ms(close) == 10.0
    off_rig = [_row("0", "nccl_sync", 20.0, []), _row("1", "nccl_cadence", 15.0, [])]
    assert calibration_warning(off_rig) is None and reference_nominal_ms(off_rig) is None
    assert "| — | 1.33x |" in format_table(off_rig)  # no T-matched figure, speedup as before


def test_markdown_carries_the_calibration_warning(tmp_path: Path) -> None:
    rows = [
        _row("0", "solo", 30.0, [], rig=_rig(12.0)),
        _row("1", "nccl_cadence", 12.0, [], rig=_rig(20.0)),
    ]
    text = write_ab_report(tmp_path, rows)["md"].read_text()
    assert "**Warning:** calibrated nominal steps differ 1.67x" in text
    assert "matched to one nominal step (12.0 ms)" in text
