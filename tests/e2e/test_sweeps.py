"""Sweeps through the real run.py: every sweeper, every launcher, the objective they optimize.

Jobs train in-process (cluster=auto on a machine without GPUs, solo mode), one short epoch on
the bundled digits, so a sweep of several jobs stays a few seconds per job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.light  # in-process jobs: no rank process

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "dataset=digits",
    "elche=solo",
    "cluster=auto",
    "trainer.device=cpu",
    "trainer.num_epochs=1",
    "trainer.batch_size=64",
    "model.hidden=16",
    "logger.progress=off",
    "logger.tensorboard=false",
]


def run_py(args: list[str], sweep: Path, script: str = "run.py") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, script, *args, f"hydra.sweep.dir={sweep}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def summaries(sweep: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]


def test_optuna_optimizes_the_job_objective(tmp_path):
    """The job returns the final eval value; Optuna's best trial is the best of the 3 jobs."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "optuna"
    args = [
        "-m",
        *TINY,
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.direction=maximize",
        "hydra.sweeper.sampler.seed=7",
        "optimizer.lr=interval(1e-4,1e-2)",
    ]
    out = run_py(args, sweep)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    jobs = summaries(sweep)
    assert len(jobs) == 3 and all(j["status"] == "ok" for j in jobs)
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(max(j["eval_value"] for j in jobs))
    report = json.loads((sweep / "ab_report.json").read_text())
    assert len(report["rows"]) == 3


def test_a_batched_sweep_reports_every_job(tmp_path):
    sweep = tmp_path / "batched"
    """Batches of 2: a full one, then a partial one."""
    out = run_py(["-m", *TINY, "hydra.sweeper.max_batch_size=2", "trainer.seed=range(1,4)"], sweep)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((sweep / "ab_report.json").read_text())["rows"]
    assert sorted(int(r["job"]) for r in rows) == [0, 1, 2]
    assert sorted(r["overrides"][-1] for r in rows) == [f"trainer.seed={s}" for s in range(1, 4)]
    assert "(2 jobs)" in out.stdout and "(3 jobs)" in out.stdout  # rewritten after each batch


def test_a_failed_job_fails_the_command_under_the_basic_launcher(tmp_path):
    sweep = tmp_path / "basic"
    failing = "dataset._target_=tests.e2e.faulty.missing_dataset"
    out = run_py(["-m", *TINY, "hydra/launcher=basic", failing], sweep)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    console = out.stdout + out.stderr
    assert console.count("FileNotFoundError: pretrained/backbone.pt: no such file") == 1, console
    assert "1 job(s) failed" in out.stderr
    (job,) = summaries(sweep)
    assert job["status"] == "failed"


def test_a_non_flodl_app_gets_one_line_from_the_flodl_launcher(tmp_path):
    out = run_py([], tmp_path / "plain", script="tests/e2e/plain_app/app.py")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "hydra/launcher=flodl runs flodl training jobs" in out.stderr
    assert "required key" not in out.stderr and "Traceback" not in out.stderr
    assert "plain app ran" not in out.stdout
