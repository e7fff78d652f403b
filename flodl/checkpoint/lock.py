"""One saver per ``save_path``: the job that saves to a stem holds ``<stem>.lock`` for its life.

Two jobs writing one stem would replace each other's bundles, each reporting its own as saved.
The lock is an advisory ``flock`` on a file beside the stem, as pip, Git LFS and py-filelock's
``UnixFileLock`` take theirs: the kernel releases it when the holding process ends, however it
ends (SIGKILL and OOM kills included), so a killed job never leaves it stuck and there is no
stale-lock detection to get wrong. The file is never deleted (deleting a lock file another
process may have just opened splits the lock in two); it holds the holder's pid, host, job
directory and start time for the refusal message, nothing the lock relies on.

Local paths only (``file://`` included): fsspec stores (``s3://``, ``memory://``) offer no lock,
and a job saving there is not guarded (the checkpoints guide says so). Linux NFS clients map
``flock`` to NFS byte-range locks, so jobs on two machines sharing an NFS export are guarded too.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from flodl.checkpoint.store import normalize_stem

LOCK_SUFFIX = ".lock"


class StemLocked(RuntimeError):
    """Another live job holds the stem's lock; the message names it."""


class SaveLock:
    """A held stem lock; :meth:`release` (or the process's end) lets it go."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def take(cls, stem: str, job_dir: str | Path = "") -> SaveLock | None:
        """Hold ``stem``'s lock, or raise :class:`StemLocked` naming its holder; ``None`` for a
        stem on a store without locks (not a local path)."""
        stem = normalize_stem(stem)
        local = _local_path(stem)
        if local is None:
            return None
        path = Path(local + LOCK_SUFFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StemLocked(f"another job is saving to {stem} ({holder}; lock {path})") from None
        except BaseException:
            os.close(fd)
            raise
        _record(fd, job_dir)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = -1


def _local_path(stem: str) -> str | None:
    if stem.startswith("file://"):
        return stem.removeprefix("file://")
    return None if "://" in stem else str(Path(stem).expanduser())


def _record(fd: int, job_dir: str | Path) -> None:
    """Who holds the lock, for the message a refused job prints."""
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "job_dir": str(job_dir),
        "since": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()),
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        where = f" on {info['host']}" if info.get("host") != socket.gethostname() else ""
        job = f", job dir {info['job_dir']}" if info.get("job_dir") else ""
        return f"pid {info['pid']}{where}{job}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder did not say who it is"
