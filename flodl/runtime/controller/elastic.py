"""The controller's membership part: ranks lost, failures judged, survivors regrouped.

A part of :class:`flodl.runtime.controller.controller.Controller`. :class:`Elastic` owns who was
told which
generation, the regroup in progress, a failure waiting for its rank's own message, and the
windows whose collective averaging is not yet known to have held. The alive mask itself is the
:class:`~flodl.runtime.controller.membership.Membership` it is given; the work a lost rank leaves
goes back
through the :class:`~flodl.runtime.controller.planning.Planner`; what it needs of the controller
(has the
cohort formed, is it stopping, stop, start) is the small :class:`Host` protocol.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from flodl.runtime.controller.checkpointing import Checkpointing
from flodl.runtime.controller.events import RunFailed
from flodl.runtime.controller.membership import Membership
from flodl.runtime.controller.planning import Planner
from flodl.runtime.controller.tracking import WindowTrack
from flodl.runtime.wire.messages import Regroup, Regrouped, Stop
from flodl.runtime.wire.rank_link import Outbound

log = logging.getLogger(__name__)
_STALL_S = 1.0  # a gap between two liveness checks longer than this is the judge's own stall
_LIVENESS_S = 0.05  # how often silent ranks are looked for


class Host(Protocol):
    """What the membership part asks of the controller."""

    def formed(self) -> bool: ...  # every member ready and training started
    def stopping(self) -> bool: ...  # Stop was sent
    def final_in(self) -> bool: ...  # the final weights arrived
    def current_stop(self) -> str | None: ...  # the stop's reason, if stopping
    def begin_stop(self, reason: str) -> None: ...
    def not_ready(self, rank: int) -> None: ...  # lost before training: forget its Ready
    def maybe_begin(self) -> None: ...
    def complete(self, track: WindowTrack) -> None: ...
    def close_epochs(self) -> None: ...
    def resume_planning(self) -> None: ...  # plan on; send Stop if all is done
    def closed_count(self) -> int: ...  # epochs closed so far
    def forget_references(self) -> None: ...  # elche.compress: the next average goes whole


class Elastic:
    """Losses and regroups over ``members`` (see the module docstring)."""

    def __init__(
        self,
        max_failure: int | str | None,
        members: Membership,
        planner: Planner,
        saves: Checkpointing,
        out: Outbound,
        host: Host,
        kill: Callable[[int], None],
    ) -> None:
        self.max_failure, self.members, self.planner, self.saves = (
            max_failure,
            members,
            planner,
            saves,
        )
        self.out = out
        self.host, self._kill = host, kill  # kill: end a silent rank's process
        self._last_check = time.monotonic()
        self._last_liveness = 0.0
        self.regrouping: dict[int, bool] = {}  # survivor -> regrouped; planning waits on it
        self._told: dict[int, int] = {}  # the membership generation each rank was told
        self._failure: tuple[float, str, int | None] | None = None  # (due, message, rank)
        self._recent: dict[int, WindowTrack] = {}  # completed windows, averaging in flight
        self._unaveraged: dict[int, set[int]] = {}  # window -> survivors whose averaging failed

    @property
    def alive(self) -> list[int]:
        return self.members.members

    def tell_if_late(self, rank: int) -> None:
        """Before training starts: a rank that joined late, after a rank was lost, hears the
        membership first."""
        told = self._told.get(rank, 0) >= self.members.generation
        if not told and rank in self.alive:
            self._tell(rank)

    def _tell(self, rank: int) -> None:
        members = tuple(self.alive)
        weights = {r: 1.0 / len(members) for r in members}
        self._told[rank] = self.members.generation
        self.out.send(rank, Regroup(self.members.generation, members, -1, weights))

    def remember(self, track: WindowTrack) -> None:
        """Collective modes: keep a completed window until its averaging is known to hold."""
        self._recent[track.index] = track
        for old in [i for i in self._recent if i < track.index - 4]:
            del self._recent[old]

    # -- liveness --------------------------------------------------------------------------------
    def excuse_stalls(self) -> None:
        """A gap between two checks longer than a heartbeat interval means this process did not
        run (SIGSTOP, a swapped-out VM) or this thread was blocked: heartbeats may be sitting
        unread in the sockets, so the gap does not count as the ranks' silence."""
        now = time.monotonic()
        gap = now - self._last_check
        self._last_check = now
        if gap > _STALL_S:
            self.members.excuse(gap)

    def judge(self, now: float) -> None:
        """Drop the ranks whose heartbeat went stale. O(ranks), so judged every _LIVENESS_S,
        not on every message (a 128-rank window brings 128 reports): far finer than any
        heartbeat timeout."""
        if now - self._last_liveness < _LIVENESS_S:
            return
        self._last_liveness = now
        for rank in self.members.stale():
            log.warning(
                "rank %d: no heartbeat for %.0f s; dropping it",
                rank,
                self.members.heartbeat_timeout_s,
            )
            self._kill(rank)
            self.drop(rank, "heartbeat went stale")

    # -- failures --------------------------------------------------------------------------------
    def on_failure(self, rank: int, message: str, immediate: bool = False) -> None:
        stopping = self.host.stopping()
        if stopping and self.host.formed() and self._lose_while_stopping(rank, message):
            return
        if not self.host.formed() or stopping:
            # A rank's own error before the cohort forms (the same on every rank, typically)
            # fails the job fast; a rank that just went away is a loss (see failure_due).
            if immediate:
                raise RunFailed(message)
            self._defer(message, None if stopping else rank)
            return
        self.lose(rank, message)

    def _defer(self, message: str, rank: int | None, grace_s: float = 1.0) -> None:
        # Give the rank's own error message (already on its way) a moment to arrive first.
        if self._failure is None:
            self._failure = (time.perf_counter() + grace_s, message, rank)

    def failure_due(self, now: float) -> None:
        """A rank exited or hung up without an error of its own: before training began that
        is a lost rank, survived like any other while ``trainer.max_failure`` allows."""
        if self._failure is None or now < self._failure[0]:
            return
        _, message, rank = self._failure
        self._failure = None
        if rank is None or self.host.stopping():
            raise RunFailed(message)
        self.drop(rank, message)

    def drop(self, rank: int, why: str) -> None:
        """Lose ``rank`` however far the run is."""
        if self.host.formed():
            self.lose(rank, why)
        else:
            self._lose_early(rank, why)

    def _lose(self, rank: int) -> bool:
        """Mark ``rank`` lost and cut it off (True: it was a member): its control channel is
        closed and nothing it sends later is read, so a rank cut off by the network and still
        running never rejoins the run it was dropped from."""
        if not self.members.lose(rank):
            return False
        self.out.detach(rank)
        return True

    def _lose_early(self, rank: int, why: str) -> None:
        """Lose ``rank`` before the cohort formed: the others re-form without it and meet
        again (the same weights, a new calibration); training then starts without it."""
        if not self._lose(rank):
            return
        self.host.not_ready(rank)
        if not self.alive:
            raise RunFailed(f"every rank was lost before training began; last: {why}")
        if self.members.over_budget:
            raise RunFailed(
                f"{why}; trainer.max_failure={self.max_failure} allows "
                f"{self.members.budget} lost rank(s) and nothing is trained yet to save"
            )
        log.warning(
            "lost rank %d before training began (%s); %d rank(s) go on", rank, why, len(self.alive)
        )
        for r in self.alive:
            self._tell(r)
        self.host.maybe_begin()

    def _lose_while_stopping(self, rank: int, why: str) -> bool:
        """A rank lost after Stop (True: handled). If it owed the final weights, the next
        survivor, held until now with the same weights, sends them (and writes the save's)."""
        sender = not self.host.final_in() and rank == self.planner.head()
        if sender and len(self.alive) < 2:
            return False  # the final weights are gone with the last rank: fail with its message
        if not self._lose(rank):
            return True
        log.warning("lost rank %d while stopping (%s)", rank, why)
        self.planner.lose_after_stop(rank)  # the last epoch may still await its eval shard
        self.saves.after_loss(rank, self.planner.head(), mid_run=False)
        self.host.close_epochs()
        if sender:
            self._hand_over_final(rank)
        return True

    def _hand_over_final(self, lost: int) -> None:
        """Ask the new head for the final weights, and for the save's weights if it writes
        them now (every survivor holds the last average: cpu_async takes the run's last whole)."""
        head = self.planner.head()
        log.warning(
            "rank %d, which was sending the final weights, was lost; rank %d sends them", lost, head
        )
        save = self.saves.final_save()
        rewrite = save is not None and save.writer == head
        stop = Stop(
            self.host.current_stop() or "done",
            send_state=True,
            checkpoint=rewrite,
            save_tag=save.tag if save is not None and rewrite else "",
            write_weights=rewrite,
        )
        self.out.send(head, stop)

    # -- losses and regroups -----------------------------------------------------------------------
    def lose(self, rank: int, why: str) -> None:
        """Lose ``rank`` mid-run: its work goes back and the survivors regroup."""
        if not self._lose(rank):
            return
        log.warning("lost rank %d (%s); %d rank(s) go on", rank, why, len(self.alive))
        if not self.alive:
            raise RunFailed(f"every rank was lost; last: {why}")
        members = tuple(self.alive)
        self.regrouping = {r: False for r in members}  # no planning until survivors regroup
        first_open, complete = self.planner.lose(rank)
        if complete is not None:
            self.host.complete(complete)
        self.saves.after_loss(rank, None, mid_run=True)
        self.host.close_epochs()
        weights = {r: 1.0 / len(members) for r in members}
        # The survivors drop their compressed averages' reference when they take the Regroup,
        # and every average sent from now on follows it on the channel: it goes whole.
        self.host.forget_references()
        for r in members:
            self.out.send(r, Regroup(self.members.generation, members, first_open, weights))

    def on_regrouped(self, msg: Regrouped) -> None:
        if msg.unaveraged >= 0:
            self._unaveraged.setdefault(msg.unaveraged, set()).add(msg.rank)
        if msg.generation != self.members.generation or msg.rank not in self.regrouping:
            return
        self.regrouping[msg.rank] = True
        if not all(self.regrouping.values()):
            return
        self.regrouping = {}
        self._take_back_unaveraged()
        if self.members.over_budget:
            self.host.begin_stop("max_failure")
            return
        if len(self.alive) == 1:
            log.warning("rank %d goes on alone", self.alive[0])
        self.host.resume_planning()

    def _take_back_unaveraged(self) -> None:
        """A window whose collective averaging failed counted the reports of ranks lost in it,
        but their work never reached the survivors' weights (the regroup re-averages the
        survivors only): give it back, so coverage counts only what the model holds. An epoch
        already closed cannot take work back: its coverage is then recorded short, not exact."""
        for index, failed in sorted(self._unaveraged.items()):
            self.planner.unsettle(index, failed)  # they will not settle it: they regrouped
            track = self._recent.pop(index, None)
            if track is None:
                continue
            for rank in sorted(set(track.reports) - set(self.alive)):
                self._give_back_settled(track, rank)
        self._unaveraged.clear()
        self.host.close_epochs()  # (planning resumes right after, in on_regrouped)

    def _give_back_settled(self, track: WindowTrack, rank: int) -> None:
        """``rank``'s work in a completed window whose averaging failed never reached the
        model: trained again, unless its epoch already closed (its coverage is then short)."""
        if track.epoch < self.planner.first_epoch() + self.host.closed_count():
            self.planner.unrecord(track, rank)
            log.warning(
                "rank %d was lost while averaging window %d, the last of epoch %d: its %d "
                "samples there never reached the model; epoch %d's coverage is short",
                rank,
                track.index,
                track.epoch + 1,
                sum(size for _, size in track.chunks[rank]),
                track.epoch + 1,
            )
            return
        log.warning(
            "rank %d was lost while averaging window %d: its work there is trained again",
            rank,
            track.index,
        )
        self.planner.give_back(track, rank)  # the window stays completed; only this work returns
