"""One saver per save_path (flodl/checkpoint/lock.py): a second holder is refused naming the
first, and the lock dies with its holder, however it dies (the kernel releases a flock)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from flodl.checkpoint.lock import SaveLock, StemLocked

HOLD = (
    "import sys, time\n"
    "from flodl.checkpoint.lock import SaveLock\n"
    "lock = SaveLock.take(sys.argv[1], 'holder-job')\n"
    "print('held', flush=True)\n"
    "time.sleep(120)\n"
)


def _holder(stem) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(stem)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    stem = tmp_path / "run"
    first = SaveLock.take(str(stem), tmp_path / "job1")
    assert first is not None
    with pytest.raises(StemLocked, match=r"another job is saving to .*run \(pid \d+, job dir"):
        SaveLock.take(str(stem) + ".pt")  # the same stem, named by its bundle
    first.release()
    again = SaveLock.take(f"file://{stem}")
    assert again is not None
    again.release()
    assert (tmp_path / "run.lock").exists()  # never deleted: see the module's docstring


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_holder_leaves_no_stuck_lock(tmp_path, sig):
    stem = tmp_path / "run"
    proc = _holder(stem)
    try:
        with pytest.raises(StemLocked, match=rf"pid {proc.pid}, job dir holder-job"):
            SaveLock.take(str(stem))
    finally:
        proc.send_signal(sig)
        proc.wait(timeout=30)
    lock = SaveLock.take(str(stem))
    assert lock is not None
    lock.release()


def test_stores_without_locks_are_not_guarded():
    assert SaveLock.take("memory://bucket/run") is None
