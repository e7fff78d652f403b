"""``run.py`` end to end in a subprocess: a sweep with a failing job, the ddp_bench experiment.
Out of test_run_py.py, a _PACED module, because they measure no share or accuracy: they need
no machine to themselves."""

from __future__ import annotations

import json

import pytest

from .test_run_py import FAST, run_py

MISSING = "tests.e2e.faulty.missing_dataset"  # fails on every rank: FileNotFoundError


@pytest.mark.slow
def test_sweep_writes_ab_report_and_keeps_failed_rows(tmp_path):
    """A job that fails mid-sweep is a failed row; the next job still runs. (An all-ok sweep's
    report is checked field by field in test_dashboard_e2e.) The failed job's factory fails on
    the ranks (the launcher never builds datasets): its root cause, once, in the console (with
    the job directory) and summary.json; exit 1."""
    failing = f"dataset._target_={MISSING},flodl.recipes.datasets.digits"
    args = ["-m", *FAST, "trainer.num_epochs=1", failing]
    out = run_py(args, tmp_path, timeout=400)
    assert out.returncode == 1, out.stderr[-3000:]  # one job failed; the sweep went on
    report = json.loads((tmp_path / "ab_report.json").read_text())
    rows = sorted(report["rows"], key=lambda r: r["job"])
    assert [r["status"] for r in rows] == ["failed", "ok"]
    assert f"dataset._target_={MISSING}" in rows[0]["overrides"]
    cause = "FileNotFoundError: pretrained/backbone.pt: no such file"
    assert cause in rows[0]["error"]
    assert rows[1]["syncs"] > 0 and rows[1]["final_loss"] is not None
    md = (tmp_path / "ab_report.md").read_text()
    assert "failed" in md and "nccl_cadence" in md
    for job in range(2):
        assert (tmp_path / str(job) / "summary.json").exists()
    console = out.stdout + out.stderr
    assert console.count(cause) == 1, console[-3000:]
    assert console.count("job 0 failed: rank") == 1, console[-3000:]
    assert f"(outputs in {tmp_path / '0'})" in console
    assert "Traceback" not in console and "control channel lost" not in console
    summary = json.loads((tmp_path / "0" / "summary.json").read_text())
    assert summary["status"] == "failed" and cause in summary["error"]


@pytest.mark.slow
def test_ddp_bench_experiment_trains_gpt_nano_on_the_rig(tmp_path):
    """`experiment=ddp_bench`, narrowed to one cell and a few steps: gpt_nano on Shakespeare
    through run.py on the [1.0, 0.4] rig, its vocabulary saved in model.pt."""
    import torch

    from flodl.recipes.text import TINY_SHAKESPEARE_VOCAB

    args = [
        "experiment=ddp_bench",
        "workload=gpt_nano",  # the command line narrows the experiment's sweep to one cell
        "elche=nccl_cadence",
        "dataset.max_chars=8000",
        "dataset.block_size=16",
        "trainer.batch_size=16",
        "trainer.num_epochs=2",
        "cluster.warmup_steps=3",
        "logger.progress=lines",
    ]
    out = run_py(args, tmp_path, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "0" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["mode"] == "nccl_cadence"
    assert summary["world_size"] == 2 and summary["eval_metric"] == "val_loss"
    assert 0 < summary["eval_value"] < 3.9  # ln(65) = 4.17 nats/char is the uniform guess
    assert summary["coverage_exact"] is True
    blob = torch.load(tmp_path / "0" / "model.pt", weights_only=True)
    codes = blob["buffers"]["vocab_codes"]
    assert "".join(chr(int(c)) for c in codes) == TINY_SHAKESPEARE_VOCAB
    assert blob["params"]["tok.weight"].shape == (65, 128)
