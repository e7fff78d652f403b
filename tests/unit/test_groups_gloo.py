"""What flodl/runtime/sync/groups.py rests on in torch's gloo backend, checked on a real in-process
pair.

These fail loudly when a torch upgrade changes it: the day gloo can abort an operation in
flight, groups.abort should end gloo operations too instead of leaving them behind; the day
destroying a group with an operation in flight blocks, a regroup would wait out gloo's timeout.
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

TIMEOUT = timedelta(seconds=20)  # gloo's own: far beyond every wait below


@pytest.fixture
def blocked():
    """Rank 0 of an in-process gloo pair in an all-reduce that rank 1 has not joined: (pg, work,
    rank 1's pg). Ended afterwards by rank 1 joining it, so no destructor waits."""
    store = dist.HashStore()
    pgs: list = [None, None]

    def make(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    work = pgs[0].allreduce([torch.ones(4)])
    yield pgs[0], work, pgs[1]
    pgs[1].allreduce([torch.ones(4)]).wait(timeout=TIMEOUT)
    work.wait(timeout=TIMEOUT)


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
        "groups.abort instead of leaving the operation behind"
    )


def test_an_operation_left_behind_ends_at_the_group_timeout():
    """What bounds a left-behind operation (and the tensor it holds): the timeout the group was
    formed with (``cluster.start_timeout_s`` in a run), not a hang for ever."""
    store = dist.HashStore()
    pgs: list = [None, None]

    def make(rank: int) -> None:
        pgs[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=2))

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    start = time.monotonic()
    work = pgs[0].allreduce([torch.ones(4)])  # rank 1 never joins
    with pytest.raises(RuntimeError):
        work.wait()
    assert 1.5 < time.monotonic() - start < 10.0
    assert work.is_completed()


def test_a_kept_object_outlives_its_other_references_and_the_exit_skips_its_destructor():
    """The process exits at once although the kept object's destructor would take 30 s."""
    code = (
        "import time\n"
        "from flodl.runtime.sync import groups\n"
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


def test_a_count_left_by_a_failed_formation_is_reset_through_the_public_api():
    """A formation that failed here leaves torch's group count at 1, so the next default group
    would be named "1" while a peer that formed and destroyed one names it "0";
    groups._name_from_zero resets the count without touching torch's private state."""
    code = (
        "from datetime import timedelta\n"
        "import torch.distributed as dist\n"
        "from flodl.runtime.sync.groups import _name_from_zero\n"
        "try:\n"
        "    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=2,\n"
        "                            timeout=timedelta(seconds=0.5))\n"
        "except Exception:\n"
        "    pass\n"
        "left = dist.get_pg_count()\n"
        "_name_from_zero()\n"
        "print(left, dist.get_pg_count(), dist.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["1", "0", "False"], out.stderr[-2000:]
