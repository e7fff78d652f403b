"""A rank's torch.distributed group across membership changes.

The training loop forms the group and re-forms it over the survivors (:func:`form`), and drops it
when a collective on it failed (:func:`release`). The hard case is a rank blocked in a collective
on a peer that is alive but no longer taking part (it failed its own side and went to regroup):
nothing on the data plane tells it, and gloo would wait out its timeout (minutes). The controller's
Regroup does tell it, so a collective is awaited in short slices (:func:`wait`) and *abandoned*
once the control channel has announced a newer membership. Usually the operation then fails by
itself within milliseconds (the lost rank was killed) and the group is released like any failed
one. gloo cannot cancel an operation in flight, so one still blocked after a short grace is ended
by hanging up the group's connections (:func:`hang_up`: ``shutdown``, never ``close``, so no
descriptor number is reused under gloo). Only if even that fails is the group unregistered and
leaked (destroying it would join the blocked thread). NCCL can abort a
communicator, which the control reader does at once (:func:`abort`).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import socket
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


_group_sockets: set[int] = set()  # descriptors the current group opened (its rendezvous, pairs)
_protected_ports: set[int] = set()  # local ports of this process's control plane: never touched


def protect_port(port: int) -> None:
    """Sockets on this local port (a controller hosted in this process) are not a group's."""
    _protected_ports.add(port)


def form(
    backend: str,
    store: Any,
    rank: int,
    world_size: int,
    timeout_s: float,
    doomed: Callable[[], bool] | None = None,
    poll_s: float = POLL_S,
) -> None:
    """Join a new default group (blocks until every member has joined, or the timeout).

    Members first meet at a presence barrier polled in short slices (``Store.check`` does not
    block), so a formation that a newer membership made pointless — a member died while the
    others were forming, or two died at once — is given up (:class:`Abandoned`) as soon as
    ``doomed()`` says so, instead of waiting out the timeout for a rank that will never come.
    Only then does ``init_process_group`` run, with every member known to be there."""
    import torch.distributed as dist

    _await_members(store, rank, world_size, timeout_s, doomed, poll_s)
    before = _socket_fds()
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    _group_sockets.clear()
    _group_sockets.update(_socket_fds() - before)


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
    membership changed. Adds no latency: ``wait`` returns the moment the work completes."""
    while not _finished(work, poll_s):
        if doomed():
            if _settles(work, grace_s, poll_s):
                raise Abandoned(settled=True)
            hang_up()  # still blocked: end it by hanging up the group's connections
            raise Abandoned(settled=_settles(work, grace_s, poll_s))


def _settles(work: Any, grace_s: float, poll_s: float) -> bool:
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if _finished(work, poll_s, reraise=False):
            return True
    return False


def hang_up() -> int:
    """Shut down (not close) every connection of the current group: gloo sees end-of-stream on
    each and fails the operation in flight, and every peer still in it fails too. The descriptors
    stay open until the group is destroyed, so none can be reused under gloo. The count."""
    count = 0
    for fd in sorted(_group_sockets):
        try:
            with socket.socket(fileno=os.dup(fd)) as dup:  # a dup: closing it closes only ours
                if dup.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                if dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue  # gloo's listener: shut down, its accept loop aborts the process
                if dup.getsockname()[1] in _protected_ports:
                    continue
                dup.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            continue  # gone or not connected (a listener): nothing to hang up
    log.debug("hung up %d connection(s) of the abandoned group", count)
    return count


def _socket_fds() -> set[int]:
    fds: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: no descriptors to hang up; the leak below still applies
        return fds
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except OSError:
            continue
    return fds


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
    ``except`` block). An abandoned group still has an operation in flight: leaked, not joined."""
    import torch.distributed as dist

    with _lock:
        if not dist.is_initialized():
            return
        if abandoned:
            _forget_default_group()
            return
        try:
            dist.destroy_process_group()
        except Exception as exc:  # already broken: what matters is dropping our references
            log.debug("destroying the broken group: %s", exc)
        _group_sockets.clear()
    gc.collect()  # frames of the failed collective may sit in reference cycles


def _forget_default_group() -> None:
    """Unregister the default group *without* shutting it down, and leak it: destroying a gloo
    group joins the thread still blocked in its operation (measured: until gloo's timeout). The
    last resort, after :func:`hang_up` failed to end the operation."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    pg = dist.group.WORLD
    _leak(pg)
    _group_sockets.clear()
    world = c10d._world
    maps = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag")
    if not hasattr(c10d, "_update_default_pg") or not all(hasattr(world, m) for m in maps):
        dist.destroy_process_group()  # a torch whose registry we do not know: the safe old way
        return
    c10d._update_default_pg(None)
    for name in (*maps, "tags_to_pg", "pg_coalesce_state"):
        getattr(world, name, {}).clear()
    world.group_count = 0
    unregister = getattr(c10d, "_unregister_all_process_groups", None)
    if unregister is not None:
        unregister()


def abort() -> None:
    """Called by the control reader when a new membership is announced. NCCL: abort the
    communicators, so a kernel waiting on a gone peer ends now. gloo cannot abort an operation in
    flight; :func:`wait` abandons it instead."""
    import torch.distributed as dist

    with _lock:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "nccl":
            return
        _leak(dist.group.WORLD)
        try:
            dist.distributed_c10d._abort_process_group()
        except (AttributeError, RuntimeError, ValueError, AssertionError) as exc:
            log.warning("could not abort the NCCL group (%s); its timeout will end it", exc)


def _leak(obj: Any) -> None:
    """Keep ``obj`` alive for the life of the process: its destructor would block."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
