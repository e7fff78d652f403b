"""A rank's torch.distributed group across membership changes.

The training loop forms the group and re-forms it over the survivors (:func:`form`), and drops it
when a collective on it failed (:func:`release`). The hard case is a rank blocked in a collective
on a peer that is alive but no longer taking part (it failed its own side and went to regroup):
nothing on the data plane tells it, and gloo would wait out its timeout (minutes). The controller's
Regroup does tell it, so a collective is awaited in short slices (``Work.wait(timeout)``,
:func:`wait`) and *abandoned* once the control channel has announced a newer membership. Usually
the operation then fails by itself within milliseconds (the lost rank was killed) and the group is
released like any failed one.

What each step rests on (checked against torch 2.13.0; the floor is torch 2.3):

* NCCL: the control reader aborts the communicators at once (:func:`abort`: torch's NCCL group
  abort ``_abort_process_group``, torch >= 2.5, else ``ProcessGroup.abort()``; ncclCommAbort), so
  a kernel waiting on a gone peer ends now.
* gloo has no abort: ``ProcessGroupGloo`` inherits ``Backend::abort()`` and ``shutdown()``, which
  do nothing (pytorch/pytorch#130345, gloo PR #388 are open); measured: an all-reduce blocked on a
  live peer is still blocked after either. ``tests/unit/test_groups_gloo.py`` fails the day that
  changes, and :func:`abort` can then end gloo operations too.
* So a gloo operation still blocked after a short grace is *left behind*, on public APIs only: the
  group is dropped with ``dist.destroy_process_group()``, which unregisters it and calls the no-op
  ``shutdown()`` (measured: returns at once with an operation in flight, and a new group forms
  after it), and the rank goes on in the new group. What would block is the old group's
  destructor, which joins the thread stuck in the operation; so such a group is handed to a daemon
  thread that keeps it referenced (:func:`_keep`). Python documents that a daemon thread's
  resources are not released at exit, so neither the loop nor the process's exit waits for it
  (measured: the process exits in 2 s, not gloo's timeout). The operation itself ends at the
  group's own timeout (``cluster.start_timeout_s``, given to ``init_process_group``): until then
  it holds its thread and the tensor it was reducing (one flat copy of the model for an average,
  one 25 MiB bucket for nccl_sync). It is rare: a peer that is killed or that fails its own side
  releases its group, which closes its connections, and the operation fails within milliseconds
  (``Abandoned.settled``); only a peer that is alive and stuck too (frozen, or itself left behind)
  leaves one. torchft's other way out (collectives in a killable child process, its "baby"
  groups) costs a copy through shared memory and an IPC round trip on every collective.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
POLL_S = 0.05
GRACE_S = 2.0  # for an abandoned collective to end by itself before it is left behind


class Abandoned(RuntimeError):
    """A collective given up because the membership changed while it was in flight. ``settled``:
    it ended during the grace that followed (the usual case: the lost rank was killed, so the
    operation fails within milliseconds) and the group can be released like any failed one."""

    def __init__(self, settled: bool) -> None:
        super().__init__(
            "the membership changed while this collective was in flight"
            + ("" if settled else "; it is still blocked and is left behind")
        )
        self.settled = settled


def form(
    backend: str,
    store: Any,
    rank: int,
    world_size: int,
    timeout_s: float,
    doomed: Callable[[], bool] | None = None,
    poll_s: float = POLL_S,
    on_present: Callable[[], None] | None = None,
    failure_grace_s: float = GRACE_S,
) -> None:
    """Join a new default group (blocks until every member has joined, or the timeout).

    Members first meet at a presence barrier polled in short slices (``Store.check`` does not
    block), so a formation that a newer membership made pointless — a member died while the
    others were forming, or two died at once — is given up (:class:`Abandoned`) as soon as
    ``doomed()`` says so, instead of waiting out the timeout for a rank that will never come.
    Only then does ``init_process_group`` run, with every member known to be there. A member
    lost inside it (published its address, never connected: gloo would wait for it until the
    timeout) is survived the same way: the store's blocking reads give up once ``doomed()``
    (a store made with it, :func:`flodl.runtime.wire.store.join_store`), the formation itself
    runs in a thread (:class:`_Init`) left behind once ``doomed()`` and the grace are over, and a
    formation that failed (a peer's connection refused or closed) is :class:`Abandoned` when a
    newer membership is announced within ``failure_grace_s``; any other failure is raised."""
    _await_members(store, rank, world_size, timeout_s, doomed, poll_s)
    if on_present is not None:
        on_present()
    init = _Init(backend, store, rank, world_size, timeout_s)
    while not init.done.wait(poll_s):
        if doomed is not None and doomed():
            if not init.done.wait(GRACE_S):
                init.abandoned = True  # blocked on a peer that will never connect: left behind
                raise Abandoned(settled=False)
            if init.failure is None:
                release()  # formed after all, for a membership that is gone
            raise Abandoned(settled=True)
    failure = init.failure
    if failure is not None:
        if doomed is not None and _announced(doomed, failure_grace_s, poll_s):
            log.warning("forming the group failed after a member was lost: %s", failure)
            raise Abandoned(settled=True)
        raise failure


class _Init(threading.Thread):
    """``init_process_group`` in a thread of its own: gloo connects every pair of members inside
    it and waits out the group's timeout for a peer killed halfway (it published its address,
    it never connects), so the caller watches ``doomed()`` meanwhile and may leave it behind.
    A daemon thread: neither the rank's loop nor its exit waits for it; the blocked
    formation fails at its timeout, as nothing can complete a mesh with a dead member."""

    def __init__(self, backend: str, store: Any, rank: int, world_size: int, timeout_s: float):
        super().__init__(name="flodl-form-group", daemon=True)
        self.args = (backend, store, rank, world_size, timeout_s)
        self.done = threading.Event()
        self.failure: BaseException | None = None
        self.abandoned = False
        self.start()

    def run(self) -> None:
        import torch.distributed as dist

        backend, store, rank, world_size, timeout_s = self.args
        _name_from_zero()
        try:
            dist.init_process_group(
                backend,
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
        except BaseException as exc:  # whatever gloo/NCCL raised: a lost peer's or not
            self.failure = exc
        finally:
            self.done.set()
        if self.abandoned and self.failure is None:  # not seen: see the docstring
            log.error("a group formation given up after %.0f s has completed after all", GRACE_S)


def _name_from_zero() -> None:
    """Name the default group as every member names it. torch names it from its count of the
    groups formed (:func:`torch.distributed.get_pg_count`), which each formation increments and
    only ``destroy_process_group`` resets: after a formation that failed or was left behind on
    this rank but succeeded (and was destroyed) on another, the two would look for each other's
    addresses under different names, each until the timeout. A count left over is reset through
    torch's public API: a one-member gloo group on a local store, formed and destroyed (~10 ms;
    nothing is sent). No default group exists here, so nothing else is named from the count."""
    import torch.distributed as dist

    if dist.is_initialized() or dist.get_pg_count() == 0:
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()


def _announced(doomed: Callable[[], bool], grace_s: float, poll_s: float) -> bool:
    """Whether ``doomed()`` says so within ``grace_s``: the controller announces a lost member
    at once when its process exits, after the heartbeat timeout when its host went silent."""
    deadline = time.monotonic() + grace_s
    while not doomed():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def _await_members(
    store: Any,
    rank: int,
    world_size: int,
    timeout_s: float,
    doomed: Callable[[], bool] | None,
    poll_s: float,
) -> None:
    store.set(f"present/{rank}", "1")
    keys = [f"present/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        if doomed is not None and doomed():
            raise Abandoned(settled=True)
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([f"present/{r}"])]
            raise TimeoutError(f"group ranks {missing} did not join within {timeout_s:.0f} s")
        time.sleep(poll_s)


def wait(
    work: Any, doomed: Callable[[], bool], poll_s: float = POLL_S, grace_s: float = GRACE_S
) -> None:
    """Wait for an async collective; raise :class:`Abandoned` once ``doomed()`` says the
    membership changed (``settled``: it ended within the grace that followed; else it is still
    blocked and the caller leaves it behind: ``release(abandoned=True)``). Adds no latency:
    ``wait`` returns the moment the work completes."""
    while not _finished(work, poll_s):
        if doomed():
            raise Abandoned(settled=_settles(work, grace_s, poll_s))


def _settles(work: Any, grace_s: float, poll_s: float) -> bool:
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if _finished(work, poll_s, reraise=False):
            return True
    return False


def _finished(work: Any, poll_s: float, reraise: bool = True) -> bool:
    """Whether ``work`` completed within ``poll_s``; its error is raised when ``reraise``."""
    try:
        if work.wait(timeout=timedelta(seconds=poll_s)) is not False:
            return True
    except RuntimeError:
        if not work.is_completed():
            return False  # only the poll's own timeout
        if reraise:
            work.wait()  # the collective's own outcome: its error, or (a race) success
        return True
    return False


def release(abandoned: bool = False) -> None:
    """Drop this rank's side of the current group after a failed collective. A group whose
    collective failed really dies (its sockets close, so a peer still blocked on us fails at
    once); nothing may reference it (a failed collective's traceback does: call this outside the
    ``except`` block). An abandoned group still has an operation in flight: it is unregistered
    like any other, but kept alive (:func:`_keep`), as its destructor would join that operation."""
    import torch.distributed as dist

    with _lock:
        if not dist.is_initialized():
            return
        if abandoned:
            _keep(dist.group.WORLD)
        try:
            dist.destroy_process_group()
        except Exception as exc:  # already broken: what matters is dropping our references
            log.debug("destroying the broken group: %s", exc)
    gc.collect()  # frames of the failed collective may sit in reference cycles


def abort() -> None:
    """Called by the control reader when a new membership is announced. NCCL: abort the
    communicators, so a kernel waiting on a gone peer ends now. gloo cannot abort an operation in
    flight; :func:`wait` abandons it instead."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    with _lock:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "nccl":
            return
        pg = dist.group.WORLD
        if pg is None:
            return
        _keep(pg)  # the worker may still hold its work: the last reference must not drop here
        try:
            if hasattr(c10d, "_abort_process_group"):  # torch >= 2.5: aborts and unregisters
                c10d._abort_process_group()
            else:
                pg.abort()  # ncclCommAbort on each communicator; release() unregisters it
        except (AttributeError, RuntimeError, ValueError, AssertionError) as exc:
            log.warning("could not abort the NCCL group (%s); its timeout will end it", exc)


_kept: list[Any] = []  # groups left behind: referenced for the life of the process


def _keep(obj: Any) -> None:
    """Keep ``obj`` referenced for the life of the process: its destructor would block. The list
    is also held by a daemon thread's frame, which Python never unwinds at exit (threading docs:
    a daemon thread's resources are not released), so not even the exit runs the destructor."""
    if not _kept:
        threading.Thread(target=_hold, args=(_kept,), name="flodl-kept", daemon=True).start()
    _kept.append(obj)


def _hold(kept: list[Any]) -> None:
    threading.Event().wait()  # forever: ``kept`` stays referenced from this frame


def kept() -> int:
    """How many groups were left behind (kept alive instead of destroyed)."""
    return len(_kept)
