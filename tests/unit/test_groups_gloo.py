"""What flodl/runtime/groups.py rests on in torch's gloo backend, checked on a real in-process pair.

These fail loudly when a torch upgrade changes it: the day gloo can abort an operation in
flight, groups.hang_up (the one remaining trick) should give way to ``abort()``; the day shutting
down a group's connections stops ending its operation, the hang-up no longer frees a rank.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from flodl.runtime import groups

TIMEOUT = timedelta(seconds=20)  # gloo's own: far beyond every wait below


@pytest.fixture
def blocked():
    """Rank 0 of an in-process gloo pair in an all-reduce that rank 1 never joins: (pg, work,
    the sockets the pair opened). Ended afterwards by hanging up, so no destructor waits."""
    store = dist.HashStore()
    pgs: list = [None, None]
    before = groups._socket_fds()

    def make(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    opened = groups._socket_fds() - before
    work = pgs[0].allreduce([torch.ones(4)])
    yield pgs[0], work, opened
    for fd in opened:
        groups._shut_down(fd)
    with pytest.raises(RuntimeError):
        work.wait()


def _still_blocked(work, seconds: float = 0.5) -> bool:
    try:
        work.wait(timeout=timedelta(seconds=seconds))
    except RuntimeError:
        return not work.is_completed()
    return False


def test_gloo_still_cannot_abort_an_operation_in_flight(blocked):
    pg, work, _ = blocked
    pg.abort()
    pg.shutdown()
    assert _still_blocked(work), (
        f"torch {torch.__version__} ends a gloo operation with abort()/shutdown(): use that in "
        "groups.abort/release and drop groups.hang_up"
    )


def test_shutting_down_the_group_connections_ends_its_operation(blocked):
    _, work, opened = blocked
    assert _still_blocked(work)
    start = time.monotonic()
    assert sum(groups._shut_down(fd) for fd in opened) >= 1  # found by listing /proc/self/fd
    with pytest.raises(RuntimeError):
        work.wait()
    assert work.is_completed()
    assert time.monotonic() - start < 5.0  # not gloo's 20 s timeout


def test_a_kept_object_outlives_its_other_references_and_the_exit_skips_its_destructor():
    """The process exits at once although the kept object's destructor would take 30 s."""
    code = (
        "import time\n"
        "from flodl.runtime import groups\n"
        "class Slow:\n"
        "    def __del__(self):\n"
        "        print('destructor ran', flush=True); time.sleep(30)\n"
        "groups._keep(Slow())\n"
        "import gc; gc.collect()\n"
        "print('kept', groups.kept(), flush=True)\n"
    )
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["kept", "1"]
    assert time.monotonic() - start < 20.0
