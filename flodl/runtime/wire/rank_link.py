"""Links between a rank and the controller: a socket link for rank processes, queues in-process.

Both look the same to the worker and the controller (``send``, ``recv``, ``poll``), so the
single-device path runs the very same loop as a process-per-rank cohort.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from flodl.rig import links as rig_links
from flodl.runtime.wire.channel import Channel
from flodl.runtime.wire.messages import Abort, Average, Regroup, own_part

log = logging.getLogger(__name__)

_CLOSED = object()


def beat_interval_s(heartbeat_timeout_s: float) -> float:
    """How often a rank beats: every second, and well inside the timeout (a beat every 1 s
    against ``heartbeat_timeout_s=1`` dropped a rank whenever its thread ran a little late)."""
    return min(1.0, heartbeat_timeout_s / 4)


def _charge_round_trip(msg: Average) -> None:
    """cluster.link: an average is not here before its snapshot went up to the controller and
    it came back down the modelled wire; the reader holds it (and what follows it on the
    channel) until then, so a rank training on meanwhile (cpu_async) really trains on."""
    link = rig_links.installed()
    # A tensor's bytes, or a compressed change's (``nbytes`` too: elche.compress); the snapshot
    # went up in the same form (whole rounds whole, changes as changes: runtime/sync/codec.py).
    nbytes = int(getattr(msg.flat, "nbytes", 0) or 0)
    if link is not None and nbytes:
        rig_links.sleep_until(link.reserve(link.round_trip_s(nbytes, nbytes), 2 * nbytes, True))


class _InboxLink:
    """Receiving side shared by both links: messages wait in a queue until asked for."""

    _inbox: queue.Queue
    announced_generation = 0  # the newest membership the controller announced (Regroup)

    def recv(self, timeout: float | None = None) -> Any:
        msg = self._inbox.get(timeout=timeout)
        if msg is _CLOSED:
            raise ConnectionResetError("link closed")
        return msg

    def peek(self) -> list[Any]:
        """The messages waiting, oldest first, left in place (the loader reads plans ahead)."""
        with self._inbox.mutex:
            return list(self._inbox.queue)

    def poll(self) -> Any | None:
        try:
            return self.recv(timeout=0)
        except queue.Empty:
            return None


class QueueLink(_InboxLink):
    """One end of an in-process link."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue) -> None:
        self._inbox = inbox
        self._outbox = outbox

    def send(self, msg: Any) -> None:
        self._outbox.put(msg)

    def close(self) -> None:
        self._outbox.put(_CLOSED)


class Outbound:
    """The controller's sending side: one link per rank; a rank going away is not an error.

    One object, handed to every controller part that tells ranks something."""

    def __init__(self) -> None:
        self.links: dict[int, Any] = {}

    def attach(self, rank: int, link: Any) -> None:
        self.links[rank] = link

    def detach(self, rank: int) -> None:
        """``rank`` was dropped: nothing more goes to it, and its control channel is closed,
        so a rank that is still alive somewhere (cut off, frozen) finds itself dropped and
        stops when it can tell (:class:`SocketLink`), and nothing it sends is read."""
        link = self.links.pop(rank, None)
        if isinstance(link, Channel):
            link.close()

    def send(self, rank: int, msg: Any) -> None:
        link = self.links.get(rank)
        if link is None:  # never attached (lost before it said hello): nothing to tell it
            return
        try:
            link.send(msg)
        except OSError as exc:  # the rank is going away; its exit is handled as a loss
            log.debug("send to rank %d failed: %s", rank, exc)

    def send_shared(self, ranks: list[int], msg: Any, part: Callable[[int], Any]) -> None:
        """One message for many ranks, pickled once: a link that takes raw frames (a socket
        channel's ``send_bytes``) gets the same bytes, and the rank's end keeps its own part
        on arrival (:func:`flodl.runtime.wire.messages.own_part`); any other link gets
        ``part(rank)``
        itself (None: nothing for that rank)."""
        payload: bytes | None = None
        for rank in ranks:
            link = self.links.get(rank)
            if link is None:
                continue
            if not hasattr(link, "send_bytes"):
                own = part(rank)
                if own is not None:
                    self.send(rank, own)
                continue
            if payload is None:
                payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
            try:
                link.send_bytes(payload)
            except OSError as exc:  # as in send: its exit is handled as a loss
                log.debug("send to rank %d failed: %s", rank, exc)

    def send_each(self, ranks: list[int], msg: Any) -> None:
        """The same (bulk) message to several ranks at once: one thread per rank, so the
        transfers overlap instead of queueing behind each other on one thread."""
        if len(ranks) < 2:
            for rank in ranks:
                self.send(rank, msg)
            return
        senders = [threading.Thread(target=self.send, args=(r, msg)) for r in ranks]
        for t in senders:
            t.start()
        for t in senders:
            t.join()


class _Posting:
    """Quacks like a queue; puts ``(rank, msg)`` into the controller's inbox."""

    def __init__(self, post: Callable[[int, Any], None], rank: int) -> None:
        self._post = post
        self._rank = rank

    def put(self, msg: Any) -> None:
        self._post(self._rank, msg)


def in_process_link(post: Callable[[int, Any], None], rank: int = 0) -> tuple[QueueLink, Any]:
    """A rank link whose sends land in the controller's inbox, and the controller's end."""
    to_rank: queue.Queue = queue.Queue()
    rank_link = QueueLink(to_rank, _Posting(post, rank))  # type: ignore[arg-type]
    controller_link = QueueLink(queue.Queue(), to_rank)
    return rank_link, controller_link


def _say_unblocked(line: str) -> None:
    """Write ``line`` to stdout without waiting: a remote rank's stdout is its ssh session, which
    a network cut stalls; a blocked write (or logging's lock, held by another thread blocked in
    one) would keep the rank from stopping."""
    with contextlib.suppress(OSError, ValueError):
        os.set_blocking(1, False)  # the process ends right after: nothing else writes there
        os.write(1, line.encode())


class SocketLink(_InboxLink):
    """The rank's end of the control channel; a reader thread keeps receiving in the background.

    If the controller goes away without saying Stop (the launcher was killed), the reader ends
    this process: a rank must never outlive its launcher, even when blocked in a collective.
    A new membership (Regroup) calls ``on_regroup`` from the reader thread *before* the message
    is queued, so a collective on the old group can be aborted while the loop is blocked in it.
    """

    # ``send`` has written every byte of a message's tensors when it returns: the sender may
    # then change them (a queue link passes the objects themselves, so copies are sent there).
    serialises = True

    def __init__(
        self,
        channel: Channel,
        rank: int,
        on_regroup: Callable[[], Any] | None = None,
        in_launcher: bool = False,
        beat_s: float = 1.0,
    ) -> None:
        self.channel = channel
        self.rank = rank
        self.stopping = False
        # Rank 0 of a torchrun/srun cohort trains on a thread of the launcher's own process:
        # its link never ends the process (the launcher is the one closing it).
        self.in_launcher = in_launcher
        self._on_regroup = on_regroup
        self._inbox: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="flodl-control", daemon=True)
        self._reader.start()
        self._beat = threading.Thread(
            target=self._heartbeat, args=(beat_s,), name="flodl-heartbeat", daemon=True
        )
        self._beat.start()

    def _heartbeat(self, every_s: float) -> None:
        from flodl.runtime.wire.messages import Heartbeat

        while not self.stopping:
            time.sleep(every_s)
            try:
                self.channel.send(Heartbeat(self.rank))
            except OSError:
                return

    def _read(self) -> None:
        while True:
            try:
                msg = self.channel.recv()
            except (OSError, EOFError, ConnectionError) as exc:
                if not self.stopping and not self.in_launcher:
                    self._stop_alone(exc)
                self._inbox.put(_CLOSED)
                return
            if isinstance(msg, Abort):  # not an error of ours: the launcher said why
                self.stopping = True
                log.info("rank %d: the launcher ended the run (%s); exiting", self.rank, msg.reason)
                if not self.in_launcher:
                    os._exit(1)
            msg = own_part(msg, self.rank)  # a CohortPlan: this rank's Plan of it
            if msg is None:
                continue
            if isinstance(msg, Average):
                _charge_round_trip(msg)
            if isinstance(msg, Regroup) and msg.generation > self.announced_generation:
                self.announced_generation = msg.generation
                if self._on_regroup is not None:
                    self._on_regroup()
            self._inbox.put(msg)
            # Not held while the next message is awaited: an Average (a weight copy) would
            # otherwise live on through the whole next window, at the rank's peak.
            del msg

    def _stop_alone(self, exc: BaseException) -> None:
        """The controller is gone or out of reach: this rank stops itself, its loader workers
        with it, whatever it was doing (a collective included). A rank the controller has
        dropped must not train on beside the survivors: no split brain. A network cut is
        found by the channel's own bound (:meth:`Channel.bound_silence`: nothing acknowledged
        for the heartbeat timeout), not by ssh's keep-alive."""
        if isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT:
            why = "the controller's host acknowledged nothing for the heartbeat timeout"
        else:
            why = f"control channel lost ({exc})"
        _say_unblocked(f"ERROR rank {self.rank}: {why}; stopping this rank\n")
        with contextlib.suppress(OSError):
            if os.getpgid(0) == os.getpid():  # our own process group: loader workers too
                os.killpg(os.getpid(), signal.SIGTERM)  # this process too, or _exit next
        os._exit(3)

    def send(self, msg: Any) -> None:
        self.channel.send(msg)

    def close(self) -> None:
        self.stopping = True
        self.channel.close()
