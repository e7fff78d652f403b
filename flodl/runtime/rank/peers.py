"""A rank's view of its group: who is in it, its generation, whether collectives run, and the
control messages kept for later. The sync modes and the rank loop share this one public object
(:class:`Peers`): a mode runs a collective through it (a lost peer is ``False``, never an error
of the user's), marks a window whose averaging failed, and waits through it for the next
membership; the loop forms that membership (``on_regroup``, bound once its sync mode exists).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from flodl.rig import links
from flodl.runtime.sync import groups
from flodl.runtime.wire.messages import Average, Regroup, Stop

log = logging.getLogger(__name__)


class CohortBroke(RuntimeError):
    """A start-up collective failed or was given up: a member was lost."""

    def __init__(self, message: str, abandoned: bool) -> None:
        super().__init__(message)
        self.abandoned = abandoned


class Peers:
    """This rank in its group, and the rank's control inbox (messages kept for later)."""

    def __init__(
        self, rank: int, world_size: int, link: Any, wait_s: float, reform: Any = None
    ) -> None:
        self.rank = rank
        self.world = world_size
        self.members: tuple[int, ...] = tuple(range(world_size))  # the group, in order
        self.generation = 0
        self.distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
        self.link = link
        self.reform = reform  # rebuilds the process group over the survivors (None: in-process)
        self.wait_s = wait_s  # how long a wait for the next membership waits for each message
        self.inbox: collections.deque[Any] = collections.deque()  # kept for the loop
        self.void_after = -1  # windows after this one, planned for an older group, are void
        self.unaveraged = -1  # a window whose averaging failed, until the controller knows
        self._regroup: Callable[[Regroup], None] = self._unbound
        self._take: Callable[[Average], None] = self._unbound

    def bind(self, regroup: Callable[[Regroup], None], take: Callable[[Average], None]) -> None:
        """What a new membership and an average arriving meanwhile are handed to (the loop's
        regroup, the sync mode's ``take``): both exist only once the sync mode is built."""
        self._regroup, self._take = regroup, take

    @staticmethod
    def _unbound(msg: Any) -> None:
        raise RuntimeError(f"{type(msg).__name__} before the rank's sync mode was built")

    # -- messages --------------------------------------------------------------------------------
    def next_message(self) -> Any:
        return self.inbox.popleft() if self.inbox else self.link.recv()

    def doomed(self) -> bool:
        """A newer membership is announced: this group's collectives will not complete."""
        return bool(self.link.announced_generation > self.generation)

    def regroup(self, msg: Regroup) -> None:
        self._regroup(msg)

    def next_regroup(self) -> None:
        """Before training: wait for the controller's next membership and form it."""
        while True:
            msg = self.next_message()
            if isinstance(msg, Regroup) and msg.generation > self.generation:
                self._regroup(msg)
                return
            if not isinstance(msg, Regroup):
                self.inbox.append(msg)

    def lost_in(self, window: int) -> None:
        """Averaging ``window`` failed (a peer is gone): say so at the regroup, and wait for it."""
        self.unaveraged = window
        self.await_regroup()

    def await_regroup(self) -> None:
        """After a failed collective: the new membership, unless the run is already stopping
        (Stop goes out once every window is reported, which is before the last average; a rank
        lost in that average is lost while stopping, and no new membership follows). A cpu_*
        average that arrives meanwhile is taken now: queued behind, it would be out of reach of
        the wait for it that this regroup may have interrupted (``ControllerSync.average``)."""
        while not any(isinstance(m, Stop) for m in self.inbox):
            msg = self.link.recv(timeout=self.wait_s)
            if isinstance(msg, Regroup):
                self._regroup(msg)
                return
            if isinstance(msg, Average):
                self._take(msg)
            else:
                self.inbox.append(msg)

    # -- collectives ---------------------------------------------------------------------------
    def collective(self, run: Callable[[], Any], what: str) -> bool:
        """Run one of the step's collectives; False when a peer is gone (the group released)."""
        failure, abandoned = None, False
        try:
            run()
        except groups.Abandoned as exc:
            failure, abandoned = str(exc), not exc.settled
        except torch.OutOfMemoryError:
            raise  # the device's memory, not a peer: handled as any out-of-memory is
        except (RuntimeError, dist.DistBackendError) as exc:  # a peer is gone
            failure = str(exc)
        if failure is None:
            return True
        # Out of the except block: its traceback pins the group, whose sockets must close now
        # so a survivor blocked on us fails at once.
        log.warning(
            "rank %d: %s failed in generation %d (%s); waiting to regroup",
            self.rank,
            what,
            self.generation,
            failure,
        )
        if self.reform is not None:
            groups.release(abandoned)
        return False

    def together(self, t: torch.Tensor, op: Any = None, broadcast: bool = False) -> None:
        """A start-up collective over the current group (nothing alone), given up once a newer
        membership is announced; a failure is :class:`CohortBroke`, never the user's error."""
        if not self.distributed:
            return
        failure, abandoned = None, False
        try:
            if broadcast:
                work = dist.broadcast(t, src=0, async_op=True)
            else:
                work = dist.all_reduce(t, op=op or dist.ReduceOp.SUM, async_op=True)
            if dist.get_backend() == "gloo":
                groups.wait(work, self.doomed)
            else:  # NCCL: the control reader aborts the communicator on a new membership
                work.wait()
            charge = links.broadcast if broadcast else links.all_reduce
            charge(links.tensor_bytes(t), dist.get_world_size())
        except groups.Abandoned as exc:
            failure, abandoned = str(exc), not exc.settled
        except torch.OutOfMemoryError:
            raise  # the device's memory, not a peer: handled as any out-of-memory is
        except (RuntimeError, dist.DistBackendError) as exc:
            failure = str(exc)
        if failure is not None:  # raised outside the except block: its traceback pins the group
            raise CohortBroke(failure, abandoned)

    def form(self, msg: Regroup) -> None:
        """Take ``msg``'s membership and form its group (given up when a newer one is announced
        meanwhile: the caller then waits for that one)."""
        self.generation = msg.generation
        self.void_after = msg.last_window
        self.world = len(msg.members)
        self.members = tuple(msg.members)
        if self.reform is not None:
            try:
                self.reform(msg.members, msg.generation, self.doomed)
            except groups.Abandoned:
                log.warning(
                    "rank %d: gave up forming generation %d (a newer membership was announced)",
                    self.rank,
                    msg.generation,
                )
        self.distributed = self.world > 1 and dist.is_initialized()
