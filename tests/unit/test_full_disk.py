"""A full disk never loses the model or lies (issue 41, item 2): outputs are written all at
once, loggers degrade with one warning, a full disk says "no space left on <path>", and the
failed-job count counts a summary it cannot read. A fault-injection seam everywhere; a real
64 KiB tmpfs where the test runs as root (the ``tiny_tmpfs`` fixture, tests/conftest.py)."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from flodl.checkpoint.bundle import CheckpointError
from flodl.checkpoint.shards import write_shard
from flodl.checkpoint.store import write_atomic
from flodl.cli.sweep import count_failed
from flodl.monitor.loggers import CsvLogger, Loggers
from flodl.monitor.metrics import EpochMetrics
from flodl.monitor.tensorboard import RunLogger


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_write_atomic_keeps_the_previous_file_on_enospc(tmp_path):
    target = tmp_path / "summary.json"
    write_atomic(target, lambda f: f.write(b'{"status": "ok"}'))
    with pytest.raises(OSError, match=f"no space left on {target}") as info:
        write_atomic(target, _enospc)
    assert info.value.errno == errno.ENOSPC
    assert target.read_bytes() == b'{"status": "ok"}'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left


def test_write_atomic_on_a_full_tmpfs_leaves_no_truncated_file(tiny_tmpfs):
    disk = tiny_tmpfs("64k")
    target = disk / "model.pt"
    blob = {"w": torch.zeros(40_000)}  # 160 kB: more than the disk holds
    with pytest.raises(OSError, match=f"no space left on {target}"):
        write_atomic(target, lambda f: torch.save(blob, f))
    assert not target.exists() and list(disk.iterdir()) == []  # never 0 bytes or cut


def test_a_checkpoint_shard_on_a_full_tmpfs_says_no_space(tiny_tmpfs):
    """Was: "[enforce fail at inline_container.cc:672] unexpected pos 1920 vs 1812"."""
    disk = tiny_tmpfs("64k")
    stem = str(disk / "run")
    with pytest.raises(CheckpointError, match=rf"^no space left on {stem}\.t1\.model\.pt"):
        write_shard(stem, "t1", "model", {"params": {"w": torch.zeros(40_000)}})
    assert list(disk.iterdir()) == []


def _metrics(epoch: int) -> EpochMetrics:
    return EpochMetrics(epoch=epoch, avg_loss=1.0 / epoch, epoch_ms=10.0)


def test_a_failing_csv_logger_is_turned_off_with_one_warning(tmp_path, monkeypatch, caplog):
    csv = CsvLogger(tmp_path / "metrics.csv")
    loggers = Loggers([csv])
    loggers.epoch(_metrics(1))
    monkeypatch.setattr(CsvLogger, "log", lambda *a, **k: _enospc())
    with caplog.at_level(logging.WARNING):
        for epoch in (2, 3, 4):
            loggers.epoch(_metrics(epoch))  # never raises
        loggers.close()
    warnings = [r.getMessage() for r in caplog.records if "csv logging is off" in r.getMessage()]
    assert warnings == [
        f"no space left on {tmp_path / 'metrics.csv'}; csv logging is off for the rest of the run"
    ]
    assert loggers.loggers == []


def test_a_failing_tensorboard_writer_is_turned_off_with_one_warning(tmp_path, monkeypatch, caplog):
    """Was: a TensorBoard writer error aborted training at epoch 18-28 of 30."""
    from torch.utils.tensorboard import SummaryWriter

    tb = RunLogger(tmp_path, world_size=2)
    tb.epoch(_metrics(1))
    monkeypatch.setattr(SummaryWriter, "add_scalar", _enospc)
    with caplog.at_level(logging.WARNING):
        for epoch in (2, 3):
            tb.epoch(_metrics(epoch))
        tb.steps(0, ((1, 0.5, 0.1),))
        tb.flush()
        tb.close()
    warnings = [r.getMessage() for r in caplog.records if "tensorboard" in r.getMessage()]
    assert warnings == [
        f"no space left on {tmp_path / 'tb'}; tensorboard logging is off for the rest of the run"
    ]


def _job(sweep: Path, name: str, summary: bytes | None) -> Path:
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    if summary is not None:
        (job / "summary.json").write_bytes(summary)
    return job


def test_the_failed_job_count_counts_unreadable_and_missing_summaries(tmp_path):
    """Was: a 0-byte summary.json (a full disk) was skipped, and the sweep exited 0."""
    old = _job(tmp_path, "old", b"")  # an earlier sweep into the same directory
    for path in (old / "summary.json", old / ".hydra"):
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    since = time.time()
    _job(tmp_path, "0", json.dumps({"status": "ok"}).encode())
    assert count_failed(tmp_path, since) == 0
    _job(tmp_path, "1", b"")  # left at 0 bytes
    _job(tmp_path, "2", b'{"status": "o')  # cut
    _job(tmp_path, "3", None)  # could not be written at all
    _job(tmp_path, "4", json.dumps({"status": "failed"}).encode())
    assert count_failed(tmp_path, since) == 4


def test_metrics_csv_stays_whole_when_the_disk_fills(tiny_tmpfs, caplog):
    """metrics.csv is rewritten atomically each epoch: a full disk keeps the last whole file."""
    import csv

    disk = tiny_tmpfs("64k")
    loggers = Loggers([CsvLogger(disk / "metrics.csv")])
    loggers.epoch(_metrics(1))
    before = (disk / "metrics.csv").read_text()
    with contextlib.suppress(OSError):  # fill what is left
        (disk / "ballast").write_bytes(b"\0" * 128 * 1024)
    with caplog.at_level(logging.WARNING):
        loggers.steps(0, tuple((s, 0.5, 0.1) for s in range(2000)))
        loggers.epoch(_metrics(2))
        loggers.close()
    assert (disk / "metrics.csv").read_text() == before
    rows = list(csv.DictReader(before.splitlines()))
    assert rows and {r["step"] for r in rows} == {"1"}
    assert sum("csv logging is off" in r.getMessage() for r in caplog.records) == 1
