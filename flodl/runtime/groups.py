"""A rank's torch.distributed group across membership changes.

The training loop forms the group and re-forms it over the survivors (:func:`form`), and drops it
when a collective on it failed (:func:`release`). The hard case is a rank blocked in a collective
on a peer that is alive but no longer taking part (it failed its own side and went to regroup):
nothing on the data plane tells it, and gloo would wait out its timeout (minutes). The controller's
Regroup does tell it, so a collective is awaited in short slices (:func:`wait`) and *abandoned*
once the control channel has announced a newer membership. gloo cannot cancel an operation in
flight, and destroying its group joins the blocked thread, so an abandoned group is leaked on
purpose: its thread ends at gloo's timeout, the rank is long gone by then. NCCL can abort a
communicator, which the control reader does at once (:func:`abort`).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
POLL_S = 0.05


class Abandoned(RuntimeError):
    """A collective left behind because the membership changed while it was in flight."""


def form(backend: str, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
    """Join a new default group (blocks until every member has joined, or the timeout)."""
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def wait(work: Any, doomed: Callable[[], bool], poll_s: float = POLL_S) -> None:
    """Wait for an async collective; raise :class:`Abandoned` once ``doomed()`` says the
    membership changed. Adds no latency: ``wait`` returns the moment the work completes."""
    while True:
        try:
            if work.wait(timeout=timedelta(seconds=poll_s)) is not False:
                return
        except RuntimeError:
            if work.is_completed():
                work.wait()  # the collective's own outcome: its error, or (a race) success
                return
        if doomed():
            raise Abandoned("the membership changed while this collective was in flight")


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
            _leak(dist.group.WORLD)
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
