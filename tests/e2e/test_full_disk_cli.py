"""``run.py`` with its job directory on a nearly full filesystem (issue 41, item 2): training
runs to the end (loggers turn off with a warning), the job fails saying "no space left on
<path>", and the command exits 1 although no summary.json could be written (was: exit 0 over
a 0-byte summary.json and a cut model.pt)."""

from __future__ import annotations

import pytest

from .test_run_py import FAST, run_py


@pytest.mark.slow
def test_a_full_job_directory_exits_1_and_says_no_space(tiny_tmpfs):
    disk = tiny_tmpfs("512k")
    (disk / "ballast").write_bytes(b"\0" * (512 - 48) * 1024)  # Hydra's own files still fit
    sweep = disk / "sweep"
    out = run_py([*FAST], sweep, timeout=300)
    console = out.stdout + out.stderr
    assert out.returncode == 1, console[-3000:]
    job = sweep / "0"
    assert f"no space left on {job}/" in console, console[-3000:]
    assert "epoch 2/2" in console  # trained to the end: the loggers did not stop it
    assert not (job / "summary.json").exists() or (job / "summary.json").stat().st_size > 0
    assert not (job / "model.pt").exists() or (job / "model.pt").stat().st_size > 0
    assert list(job.glob("*.tmp-*")) == []
