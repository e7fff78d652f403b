"""``run.py``'s default job end to end in a subprocess (a _PACED module: its share and accuracy
are measured claims; run.py's other jobs are in test_run_py_jobs.py, its refusals in
test_refusals.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAST = [
    "dataset=digits",
    "trainer.num_epochs=2",
    "trainer.batch_size=32",
    "cluster.warmup_steps=3",
    "logger.progress=lines",
]


def run_py(args: list[str], sweep_dir: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "run.py", *args, f"hydra.sweep.dir={sweep_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_the_default_job_is_what_the_readme_promises(tmp_path):
    """`make run` = `python run.py`: MLP on mnist5k, [1.0, 0.5] rig, nccl_cadence, >= 90 %."""
    out = run_py(["logger.progress=lines"], tmp_path, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "0" / "summary.json").read_text())
    assert summary["mode"] == "nccl_cadence" and summary["world_size"] == 2
    assert summary["eval_value"] >= 0.90
    assert summary["coverage_exact"] is True
    # The share *settles* near 2/3: read the last epoch line (early windows are calibration).
    last = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("epoch 8/8")]
    share = float(last[0].split("share [")[1].split()[0])
    assert share == pytest.approx(2 / 3, abs=0.05), last
    job = tmp_path / "0"
    assert summary["status"] == "ok" and summary["eval_metric"] == "accuracy"
    assert (job / "model.pt").exists()
    assert (job / "rank_0.log").exists() and (job / "rank_1.log").exists()
    console = out.stdout + out.stderr
    # One line per epoch from the launcher, not one copy per rank.
    assert console.count("epoch 1/8") == 1 and console.count("epoch 8/8") == 1
    assert not (tmp_path / "ab_report.md").exists()  # a single job is not an A/B
