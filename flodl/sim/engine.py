"""A discrete-event simulation of a cohort of N virtual ranks driving the *real* controller.

The simulator owns only what the hardware would: a virtual clock, what each rank's batches
cost (:mod:`flodl.sim.costs`), and when a collective completes. Everything the runtime decides
is decided by the real code: :class:`flodl.runtime.controller.controller.Controller` (with its
planning,
aggregation and membership parts) and the :class:`flodl.elche.ElChe` it owns receive
the same messages (``Ready``, ``Report``, ``Settled``, ``Regrouped``, ``Final``, a rank's
``Exited``) that reader threads post in a launch, through the same per-message steps as
``Controller.run``; their ``Plan``, ``Regroup`` and ``Stop`` replies reach the virtual ranks
after ``latency_ms``. A virtual rank behaves as :class:`flodl.runtime.rank.loop.RankLoop` does in
the collective modes: it trains a window, reports it, averages with its group (a collective that
fails when a member is lost), skips windows voided by a regroup, and re-averages on ``Regroup``.

The controller's CPU cost is the real ``time.process_time`` spent in those per-message steps.
"""

from __future__ import annotations

import heapq
import itertools
import math
import pickle
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from flodl.config import ClusterConfig, ElCheConfig, Mode, TrainerConfig
from flodl.runtime.controller.controller import Controller, Exited
from flodl.runtime.controller.dispatch import count_batches
from flodl.runtime.wire import streaming
from flodl.runtime.wire.messages import (
    Final,
    Plan,
    Ready,
    Regroup,
    Regrouped,
    Report,
    Settled,
    Stop,
    Window,
    own_part,
)
from flodl.sim.costs import (
    RingAllReduce,
    Workload,
    batch_ms,
    ideal_ms,
    lockstep_ms,
    make_scenario,
)


@dataclass
class SimResult:
    """One simulated run, measured against the physical limit and lock-step DDP."""

    ranks: int
    scenario: str
    mode: str
    virtual_ms: float
    ideal_ms: float
    lockstep_ms: float
    windows: int
    controller_ms_per_window: float
    syncs_per_epoch: float
    coverage_exact: bool
    lost_ranks: list[int]
    anchors: list[int] = field(default_factory=list)
    overheads: list[float] = field(default_factory=list)

    @property
    def efficiency(self) -> float:
        return self.ideal_ms / self.virtual_ms

    @property
    def lockstep_efficiency(self) -> float:
        return self.ideal_ms / self.lockstep_ms


@dataclass
class _Rank:
    rank: int
    group: tuple[int, ...]
    work: deque = field(default_factory=deque)  # windows, Regroup and Stop, in link order
    state: str = "idle"  # idle, compute, collective, await, done, dead
    generation: int = 0
    announced: int = 0  # the newest generation a Regroup announced (the reader thread's view)
    void_after: int = -1
    unaveraged: int = -1
    sync_started: float | None = None
    last_sync_ms: float | None = None
    done_at: float = 0.0


@dataclass
class _Collective:
    kind: str  # "w": a window's average, "g": a regroup's re-average
    members: tuple[int, ...]
    index: int = -1
    settle: bool = False
    arrived: set[int] = field(default_factory=set)
    failed: bool = False
    done: bool = False


class _Link:
    """The controller's link to one virtual rank: the message is serialised as the socket
    channel does (:func:`flodl.runtime.wire.streaming.split`, on the controller's thread, so it is
    counted) and lands ``latency_ms`` later; only the socket write itself is left out, and
    so is the simulator's own delivery (the event is queued once the controller's step is
    timed, :meth:`Simulator.to_controller`)."""

    def __init__(self, sim: Simulator, rank: int) -> None:
        self.sim, self.rank = sim, rank

    def send(self, msg: Any) -> None:
        streaming.split(msg)
        self.sim.outgoing.append((self.rank, msg))

    def send_bytes(self, payload: bytes) -> None:
        """A message the controller pickled once for several ranks (a CohortPlan): decoded
        on arrival as the rank's socket link does, off the controller's clock."""
        self.sim.outgoing.append((self.rank, payload))


def _clock_cost_s(samples: int = 2000) -> float:
    """What one ``time.process_time`` call costs (a system call on some VMs): subtracted from
    every timed controller step, so the timer is not counted as controller work."""
    best = math.inf
    for _ in range(samples):
        t0 = time.process_time()
        best = min(best, time.process_time() - t0)
    return best


class Simulator:
    """``ranks`` virtual ranks, one scenario, one real controller; :meth:`run` measures it."""

    def __init__(
        self,
        ranks: int,
        scenario: str,
        *,
        mode: str = "nccl_cadence",
        epochs: int = 2,
        batches_per_rank: int = 150,
        work: Workload | None = None,
        comm: RingAllReduce | None = None,
        latency_ms: float = 0.2,
        seed: int = 0,
        elche: dict[str, Any] | None = None,
        n_samples: int | None = None,
        speed_hint: bool = False,
    ) -> None:
        self.n, self.work, self.comm = ranks, work or Workload(), comm or RingAllReduce()
        self.latency_ms, self.seed, self.epochs = latency_ms, seed, epochs
        per_epoch = batches_per_rank * ranks * self.work.batch_size
        self.n_samples = n_samples if n_samples is not None else per_epoch
        total = self.n_samples * epochs
        nominal = total * self.work.base_ms / (self.work.batch_size * ranks)
        self.scenario = make_scenario(scenario, ranks, nominal, seed)
        lost = self.scenario.lost_rank
        free = ideal_ms(total, self.scenario, ranks, self.work, math.inf)
        self.lost_ms = self.scenario.lost_at * free if lost is not None else math.inf
        self.ideal = ideal_ms(total, self.scenario, ranks, self.work, self.lost_ms)
        self.cfg = TrainerConfig(
            num_epochs=epochs,
            batch_size=self.work.batch_size,
            elche=ElCheConfig(mode=Mode(mode), **(elche or {})),
            # the bound (no knob is infinite): the wall clock never judges liveness in virtual time
            cluster=ClusterConfig(heartbeat_timeout_s=3600.0),
        )
        self.mode = Mode(mode)
        self.rng = random.Random(seed + 7)
        self.now = 0.0
        self.cpu_s = 0.0
        self._clock_cost = _clock_cost_s()
        self._heap: list[tuple[float, int, Any, tuple]] = []
        self._seq = itertools.count()
        self.ranks = [_Rank(r, tuple(range(ranks))) for r in range(ranks)]
        self.collectives: dict[tuple, _Collective] = {}
        self.outgoing: list[tuple[int, Any]] = []  # the controller's sends of one step
        # The launcher hands the controller the configured device speeds (a CPU rig's, or a
        # benchmark's): with speed_hint the first windows are shaped by the true speeds at t=0.
        hint = [self.scenario.speed(r, 0.0) for r in range(ranks)] if speed_hint else [1.0] * ranks
        self.ctl = Controller(self.cfg, ranks, hint, has_eval=False)
        for r in range(ranks):
            self.ctl.attach(r, _Link(self, r))

    # -- the clock -----------------------------------------------------------------------------
    def schedule(self, delay_ms: float, fn: Any, *args: Any) -> None:
        heapq.heappush(self._heap, (self.now + delay_ms, next(self._seq), fn, args))

    def run(self) -> SimResult:
        for r in range(self.n):
            ready = Ready(r, "sim", 1, self.work.base_ms, "sim", self.n_samples)
            self.schedule(0.0, self.to_controller, r, ready)
        if self.scenario.lost_rank is not None:
            heapq.heappush(self._heap, (self.lost_ms, -1, self.lose, (self.scenario.lost_rank,)))
        while self._heap:
            self.now, _, fn, args = heapq.heappop(self._heap)
            fn(*args)
        if not self.ctl.finished():
            raise RuntimeError(f"simulation stalled at {self.now:.0f} virtual ms")
        return self._result()

    def to_controller(self, rank: int, msg: Any) -> None:
        """One message through the controller's own per-message steps (those of
        ``Controller.run``: finished, check_deadlines, handle). The arrival
        stamp is a reader thread's work in a launch (``Controller.post``), as is decoding."""
        ctl = self.ctl
        ctl.members.seen(rank)
        t0 = time.process_time()
        ctl.finished()
        ctl.check_deadlines()
        ctl.handle(rank, msg)
        self.cpu_s += max(0.0, time.process_time() - t0 - self._clock_cost)
        sent, self.outgoing = self.outgoing, []
        for to, out in sent:  # delivered in the order sent, latency_ms from now
            self.schedule(self.latency_ms, self.on_message, to, out)

    def _result(self) -> SimResult:
        ctl, total = self.ctl, self.n_samples * self.epochs
        res = ctl.result()
        end = max(r.done_at for r in self.ranks if r.state == "done")
        lock = lockstep_ms(
            total, self.scenario, self.n, self.work, self.comm, self.lost_ms, self.seed
        )
        windows = max(len(res.events), 1)
        cov = res.coverage
        exact = cov is not None and all(cov.exact(e) for e in range(self.epochs))
        return SimResult(
            ranks=self.n,
            scenario=self.scenario.name,
            mode=self.mode.value,
            virtual_ms=end,
            ideal_ms=self.ideal,
            lockstep_ms=lock,
            windows=len(res.events),
            controller_ms_per_window=self.cpu_s * 1e3 / windows,
            syncs_per_epoch=len(res.events) / self.epochs,
            coverage_exact=exact and sum(res.rank_samples) == total,
            lost_ranks=list(res.lost_ranks),
            anchors=[e.anchor for e in res.events],
            overheads=[e.overhead for e in res.events],
        )

    # -- what arrives at a rank ----------------------------------------------------------------
    def on_message(self, rank: int, msg: Any) -> None:
        r = self.ranks[rank]
        if r.state == "dead":
            return
        if isinstance(msg, bytes):
            msg = own_part(pickle.loads(msg), rank)
            if msg is None:
                return
        if isinstance(msg, Plan):
            r.work.extend(msg.windows)
        elif isinstance(msg, Regroup):
            r.announced = max(r.announced, msg.generation)
            if r.state == "await" and msg.generation > r.generation:
                self._regroup(r, msg)
                return
            r.work.append(msg)
        else:
            r.work.append(msg)
        self._advance(r)

    def _advance(self, r: _Rank) -> None:
        while r.state == "idle" and r.work:
            item = r.work.popleft()
            if isinstance(item, Window):
                if item.generation < r.generation and item.index > r.void_after:
                    continue  # void: planned for an older membership
                self._begin(r, item)
            elif isinstance(item, Regroup):
                if item.generation > r.generation:
                    self._regroup(r, item)
            elif isinstance(item, Stop):
                r.state, r.done_at = "done", self.now
                if item.send_state:
                    self.to_controller(r.rank, Final(r.rank, {}, {}))

    # -- a window: compute, report, average ----------------------------------------------------
    def _begin(self, r: _Rank, w: Window) -> None:
        if r.sync_started is not None:
            r.last_sync_ms = self.now - r.sync_started
        t = self.now
        for _ in range(count_batches(w.chunks, self.work.batch_size)):
            t += batch_ms(self.work, self.scenario.speed(r.rank, t), self.rng)
        r.state = "compute"
        self.schedule(t - self.now, self._computed, r, w, t - self.now)

    def _computed(self, r: _Rank, w: Window, compute_ms: float) -> None:
        if r.state == "dead":
            return
        b = count_batches(w.chunks, self.work.batch_size)
        divergence = None if self.mode.is_sync else 0.01
        report = Report(
            r.rank,
            w.index,
            w.epoch,
            w.chunks,
            b,
            sum(s for _, s in w.chunks),
            compute_ms,
            float(b),
            b,
            prev_sync_ms=r.last_sync_ms,
            prev_divergence=divergence,
            lr=1e-3,
        )
        self.to_controller(r.rank, report)
        r.sync_started = self.now
        if len(r.group) < 2:
            self._averaged(r, w.settle, w.index)
            self._advance(r)
            return
        key = ("w", r.generation, w.index)
        self._join(r, key, _Collective("w", r.group, w.index, w.settle))

    def _averaged(self, r: _Rank, settle: bool, index: int) -> None:
        r.state = "idle"
        if settle:
            self.to_controller(r.rank, Settled(r.rank, index))

    # -- collectives ---------------------------------------------------------------------------
    def _join(self, r: _Rank, key: tuple, fresh: _Collective) -> None:
        coll = self.collectives.setdefault(key, fresh)
        dead = any(self.ranks[m].state == "dead" for m in coll.members)
        if coll.failed or dead or r.announced > r.generation:
            coll.failed = True
            self._failed(r, coll)
            return
        r.state = "collective"
        coll.arrived.add(r.rank)
        if coll.arrived >= set(coll.members):
            self.schedule(self.comm.ms(len(coll.members)), self._collective_done, key)

    def _collective_done(self, key: tuple) -> None:
        coll = self.collectives.pop(key)
        if coll.failed:
            return
        coll.done = True
        for m in coll.members:
            r = self.ranks[m]
            if coll.kind == "w":
                self._averaged(r, coll.settle, coll.index)
            else:
                r.state = "idle"
                self.to_controller(m, Regrouped(m, r.generation, r.unaveraged))
                r.unaveraged = -1
        for m in coll.members:
            self._advance(self.ranks[m])

    def _failed(self, r: _Rank, coll: _Collective) -> None:
        """A collective broke (a member is gone): wait for the controller's Regroup."""
        if coll.kind == "w":
            r.unaveraged = coll.index
        r.state = "await"
        for item in list(r.work):
            if isinstance(item, Regroup) and item.generation > r.generation:
                r.work.remove(item)
                self._regroup(r, item)
                return

    def _regroup(self, r: _Rank, msg: Regroup) -> None:
        r.generation, r.void_after, r.group = msg.generation, msg.last_window, msg.members
        if r.announced > r.generation:
            r.state = "await"  # an even newer membership is on its way
            self._failed(r, _Collective("g", r.group))
            return
        if len(r.group) < 2:
            r.state = "idle"
            self.to_controller(r.rank, Regrouped(r.rank, r.generation, r.unaveraged))
            r.unaveraged = -1
            self._advance(r)
            return
        self._join(r, ("g", r.generation), _Collective("g", r.group))

    # -- a lost rank -------------------------------------------------------------------------------
    def lose(self, rank: int) -> None:
        """The rank's process is gone: its collectives break, the supervisor reports the exit."""
        self.ranks[rank].state = "dead"
        for coll in list(self.collectives.values()):
            if rank in coll.members and not coll.done and not coll.failed:
                coll.failed = True
                for m in sorted(coll.arrived - {rank}):
                    self._failed(self.ranks[m], coll)
        self.to_controller(rank, Exited(1, "lost in the simulation"))
