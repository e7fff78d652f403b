"""How this rank agrees on weights with the others: one object per ``elche.mode``, chosen once.

As torchft's ``LocalSGD``/``DiLoCo`` are, a sync mode is an object with a small interface the
rank loop calls at fixed points, not ``if mode`` branches inside the loop:

* :class:`CollectiveSync` (``nccl_sync``, ``nccl_cadence``): the ranks average among themselves
  in a collective (nccl_sync: gradients all-reduced during backward), then the outer step;
* :class:`ControllerSync` (``cpu_sync``, ``cpu_cadence``, ``cpu_async``): a snapshot goes to the
  controller with the report, its average comes back (cpu_async: blended in between steps);
* :class:`SoloSync` (``solo``, or one rank): nothing to agree on.

Which class runs a mode, and what the mode declares to the controller's side (its policy: the
hooks read ``self.policy`` instead of the mode's name), is the mode's one entry in the registry,
:data:`flodl.config.registries.modes.MODES`.

Membership (a lost peer, a new group) is the rank's :class:`~flodl.runtime.rank.peers.Peers`, a
public object every mode gets: a mode asks it to run a collective, mark a window whose averaging
failed and wait for the next membership, or form one. A mode is built once the memory plan has
left the optimizer as it trains (nccl_sync's sharded state broadcasts its pieces).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from flodl.config import ElCheConfig, resolve_dotted
from flodl.rig.pacing import Pacer
from flodl.runtime.rank.peers import Peers
from flodl.runtime.rank.setup import ModelParts
from flodl.runtime.sync.averaging import collective_average
from flodl.runtime.sync.codec import Packed, RankCodec
from flodl.runtime.sync.compress import Compressor
from flodl.runtime.sync.gradsync import GradSync
from flodl.runtime.sync.outer import make_outer
from flodl.runtime.sync.sharded_optimizer import ShardedOptimizer
from flodl.runtime.wire import chaos
from flodl.runtime.wire.messages import Average, Plan, Regroup, Window


class SyncMode:
    """The interface every mode implements, each hook doing nothing by default: what a mode
    does not override, it does not need (:class:`SoloSync` overrides nothing)."""

    def __init__(
        self,
        peers: Peers,
        parts: ModelParts,
        pacer: Pacer,
        optimizer: torch.optim.Optimizer,
        elche: ElCheConfig,
    ) -> None:
        self.policy = elche.mode.policy  # what the mode declares (flodl/config/registries/modes.py)
        self.elche = elche
        self.peers = peers
        self.parts = parts
        self.pacer = pacer
        self.optimizer = optimizer  # as the memory plan left it (sharded: a ShardedOptimizer)
        self.state = parts.state
        self.link = peers.link
        self.outer = make_outer(elche, self.state.n_params)
        self.compressor = Compressor(elche.compress) if elche.compress != "none" else None
        self.last_divergence: float | None = None  # the guard's signal, sent with the report

    def begin(self, window: Window) -> None:
        """A window starts (nccl_sync: whether its gradients are all-reduced in backward)."""

    def arm(self, last: bool) -> None:
        """Before a micro-batch's backward; ``last``: the window's last micro-batch."""

    def reduce_gradients(self) -> None:
        """Before the optimizer step (nccl_sync: finish the gradient all-reduce)."""

    def after_step(self, stepped: bool) -> None:
        """After the optimizer step (nccl_sync with sharded optimizer state: every owner's
        updated pieces broadcast to the others)."""

    def steps_without_data(self) -> bool:
        """A window without a batch for this rank still takes the cohort's step (nccl_sync
        with sharded state: the rank's pieces are stepped with the others' gradient)."""
        return False

    def snapshot(self) -> torch.Tensor | Packed | None:
        """The weights the report carries to the controller (``elche.compress``: their change
        since the last average, packed); None where it averages nothing."""
        return None

    def average(self, window: Window) -> bool:
        """Average after ``window``; False when a collective averaging of it failed (the work
        of a rank lost in it never reached this rank's weights)."""
        return True

    def between_steps(self, tally: Any) -> None:
        """Between two steps of a window (cpu_async: blend in the averages that arrived)."""

    def take(self, msg: Average) -> None:
        """An average from the controller (the cpu_* modes)."""

    def drain(self) -> None:
        """The run ends: take the averages still in flight."""

    def reset_outer(self) -> None:
        """The ranks agree on the current weights: the outer step starts from them."""
        if self.outer is not None:
            self.outer.reset(self.state.current())  # reset copies

    def on_regroup(self, msg: Regroup) -> None:
        """A new membership is announced: forget what the old one shared."""
        if self.compressor is not None:  # the survivors' next average goes whole
            self.compressor.invalidate()

    def after_regroup(self, msg: Regroup) -> bool:
        """The new group is formed: agree on one set of weights; False when a survivor died
        meanwhile."""
        return True


class SoloSync(SyncMode):
    """No peers (``solo``, or a single rank): every average is trivially done."""


class CollectiveSync(SyncMode):
    """``nccl_sync`` and ``nccl_cadence``: the ranks average in a collective among themselves."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grad_sync: GradSync | None = None  # nccl_sync's gradient all-reduce
        if self.policy.gradient_sync:
            self.grad_sync = GradSync(
                self.parts.model, doomed=self.peers.doomed, buffers=self.state.buffers
            )
        self._grad_window = False  # this window's gradients are all-reduced in backward
        self._grad_failed = False  # ...and that all-reduce failed (a peer is gone)

    def begin(self, window: Window) -> None:
        grads = window.grad_sync and self.grad_sync is not None and self.peers.distributed
        self._grad_window = grads
        self._grad_failed = False
        if self.grad_sync is not None:
            self.grad_sync.weight = window.weight  # this rank's share of the step's samples
            self.grad_sync.buffer_weight = window.buffer_weight

    def arm(self, last: bool) -> None:
        if self._grad_window and self.grad_sync is not None:  # the step's last micro-batch
            runner = self.parts.runner
            self.grad_sync.armed = last or runner.pending + 1 >= runner.accumulate

    def reduce_gradients(self) -> None:
        if self._grad_window and self.grad_sync is not None and not self._grad_failed:
            t0 = time.perf_counter()
            run = self.grad_sync.finish
            self._grad_failed = not self.peers.collective(run, "gradient all-reduce")
            self.pacer.exempt(time.perf_counter() - t0)

    def after_step(self, stepped: bool) -> None:
        """Sharded optimizer state: each rank stepped only its own pieces; the owners
        broadcast them. Only after a step that every rank took alike (the gradients were
        all-reduced and finite on all: the same verdict everywhere); a failed broadcast (a
        peer is gone) is a failed averaging: the regroup's re-average brings the survivors
        together."""
        optimizer = self.optimizer
        if not (stepped and self._grad_window and not self._grad_failed):
            return
        if not isinstance(optimizer, ShardedOptimizer) or not optimizer.sharded:
            return
        t0 = time.perf_counter()
        members = self.peers.members

        def exchange() -> None:
            optimizer.exchange(members, self.peers.doomed)

        self._grad_failed = not self.peers.collective(exchange, "sharded state broadcast")
        self.pacer.exempt(time.perf_counter() - t0)

    def steps_without_data(self) -> bool:
        optimizer = self.optimizer
        sharded = isinstance(optimizer, ShardedOptimizer) and optimizer.sharded
        return sharded and self._grad_window and not self._grad_failed

    def on_regroup(self, msg: Regroup) -> None:
        super().on_regroup(msg)
        from flodl.runtime.rank.shard_plan import recut

        # a lost rank's pieces to the survivors
        recut(self.optimizer, self.peers.rank, tuple(msg.members))

    def average(self, window: Window) -> bool:
        peers = self.peers
        if peers.world == 1:
            return True
        chaos.point("average", peers.rank)
        # The guard reads divergence; lock-step sync modes never consult it. Without an
        # outer step it is measured inside the average (no copy of the weights kept).
        if self._grad_window:  # parameters and float buffers agree: averaged in the step
            averaged = not self._grad_failed
            if not averaged:
                peers.lost_in(window.index)
            elif self.outer is not None:  # the same update on every rank: still in step
                self._outer_step()
            return averaged
        guard = not self.policy.lock_step
        before = self.state.flatten() if guard and self.outer is not None else None
        if not self._averaged(window.weight, window.buffer_weight, measure=guard):
            peers.lost_in(window.index)  # the lost rank's work there never arrived
            return False
        if self.outer is not None:
            self._outer_step()
            if self.compressor is not None:  # the same step on every rank: still shared
                self.compressor.reset(self.state.current())
        if before is not None:
            self.last_divergence = self.state.divergence(before, self.state.current())
        return True

    def _outer_step(self) -> None:
        """The outer (Nesterov) step, in place on the model's own storage when it is shared
        (no copy of the weights; the outer state itself is the outer optimizer's)."""
        assert self.outer is not None
        flat = self.state.current()
        out = self.outer.step(flat)
        if out is not self.state.shared():
            self.state.load(out)

    def _averaged(self, weight: float, buffer_weight: float, measure: bool = False) -> bool:
        """The collective average; False when a peer is gone (the group is then released) or
        the controller announced a new membership while it was in flight (abandoned).
        ``measure``: record the divergence from the average (the guard's signal)."""

        def average() -> None:
            divergence = collective_average(
                self.state,
                weight,
                buffer_weight,
                doomed=self.peers.doomed,
                measure=measure,
                compressor=self.compressor,
            )
            if divergence is not None:
                self.last_divergence = divergence

        averaged = self.peers.collective(average, "averaging")
        if not averaged and self.compressor is not None:
            self.compressor.invalidate()  # the survivors may not share the last average now
        return averaged

    def after_regroup(self, msg: Regroup) -> bool:
        share = msg.weights[self.peers.rank]
        return self._averaged(share, share)


class ControllerSync(SyncMode):
    """``cpu_sync``, ``cpu_cadence``, ``cpu_async``: the controller averages the snapshots the
    reports carry and sends the average back; cpu_async keeps training meanwhile, within
    ``Window.max_overshoot`` windows, and blends each average in at ``easgd_alpha``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        elche = self.elche
        self.runner = self.parts.runner
        self.device = self.parts.device
        self.alpha = elche.effective_easgd_alpha
        self._pending = self.peers.inbox  # the loop's inbox of messages kept for later
        self._outstanding: list[int] = []  # windows whose average has not arrived
        self._whole: set[int] = set()  # cpu_async: windows whose average is taken whole
        # elche.compress: snapshots and averages travel as changes against the last average
        # taken (runtime/sync/codec.py); the collective modes' compressor does not apply.
        self.compressor = None
        self.codec = RankCodec(elche.compress) if elche.compress != "none" else None

    def snapshot(self) -> torch.Tensor | Packed:
        """The weights for the controller: compressed, their change since the last average
        taken; else the flat storage itself when the link serialises while sending (nothing
        changes it before ``send`` returns), else a copy."""
        if self.codec is not None:
            packed = self.codec.snapshot(self.state.current())
            if packed is not None:
                return packed
        if getattr(self.link, "serialises", False):
            return self.state.current().cpu()
        return self.state.flatten().cpu()

    def average(self, window: Window) -> bool:
        if self.peers.world == 1:
            return True
        chaos.point("average", self.peers.rank)
        self._outstanding.append(window.index)
        limit = window.max_overshoot if self.policy.overshoot else 0
        if window.consensus:  # cpu_async, an epoch's end: wait for it, take it whole
            self._whole.add(window.index)
            limit = 0
        while len(self._outstanding) > limit:
            msg = self.link.recv()
            if isinstance(msg, Average):
                self.take(msg)
            elif isinstance(msg, Regroup):
                self.peers.regroup(msg)
            else:  # a plan or stop that arrived ahead of the average: keep it for the loop
                self._pending.append(msg)
        return True

    def between_steps(self, tally: Any) -> None:
        """cpu_async: blend in, between two steps, every average that has arrived. The rank
        keeps training while an average round-trips and blends it in as soon as it is here:
        taken only when the rank ran out of overshoot, an average lands windows late (the
        controller plans ahead, so plans queue in front of it), and each blend then pulls the
        rank back towards weights that many windows old. Plans ahead of an average keep their
        order for the loop (as :meth:`average` keeps them); anything else (a stop, a regroup)
        ends the look, and nothing is blended while micro-batches accumulated on the current
        weights wait for their step."""
        if not self._outstanding or self.runner.pending:
            return
        t0 = time.perf_counter()
        while self._outstanding:
            waiting = self.link.peek()
            if not waiting or not isinstance(waiting[0], (Average, Plan)):
                break
            msg = self.link.recv()
            if isinstance(msg, Average):
                self.take(msg)
            else:
                self._pending.append(msg)
        tally.blend_ms += (time.perf_counter() - t0) * 1000.0

    def take(self, msg: Average) -> None:
        """Take an average: in cpu_async blended in at ``easgd_alpha`` (EASGD's pull towards
        the centre), except an epoch's last (``Window.consensus``), which every rank takes
        whole: the epoch ends at the ranks' average, so evaluation, a checkpoint and the final
        weights see the consensus and not one rank's local weights halfway to it (LeNet, 32 a
        rank, three runs: 0.932-0.953 evaluated on local weights, 0.944-0.962 on the average)."""
        if msg.window in self._outstanding:
            self._outstanding.remove(msg.window)
        whole = msg.window in self._whole
        self._whole.discard(msg.window)
        if msg.flat is None:  # the controller could not average this round: keep our weights
            return
        center = msg.flat
        if self.codec is not None:  # the consensus, exactly as the controller holds it
            center = self.codec.receive(msg.window, msg.flat)
            if center is None:
                return
        center = center.to(self.device)
        before = self.state.current()  # read before the load: no copy of the weights
        alpha = self.alpha
        if alpha is None or whole:
            # the guard's signal stays the blend's: ||before - blend|| = alpha ||before - centre||
            divergence = self.state.divergence(before, center)
            self.last_divergence = divergence * (1.0 if alpha is None else alpha)
            self.state.load(center)
            return
        after = center.mul_(alpha).add_(before, alpha=1 - alpha)
        self.last_divergence = self.state.divergence(before, after)
        self.state.load(after)

    def drain(self) -> None:
        while self._outstanding:  # cpu_async: take the averages still in flight
            reply = self.link.recv()
            if isinstance(reply, Average):
                self.take(reply)

    def on_regroup(self, msg: Regroup) -> None:
        super().on_regroup(msg)
        if self.codec is not None:  # every average from now on comes whole (it follows)
            self.codec.invalidate()
        self._outstanding = [w for w in self._outstanding if w <= msg.last_window]
        self._whole.intersection_update(self._outstanding)


def sync_for(
    peers: Peers,
    parts: ModelParts,
    pacer: Pacer,
    optimizer: torch.optim.Optimizer,
    elche: ElCheConfig,
) -> SyncMode:
    """The rank's sync mode, chosen once: the ``rank_side`` class ``elche.mode`` declares
    (flodl/config/registries/modes.py). A collective mode alone has nothing to agree on
    (solo's); a mode through the controller keeps its class even alone: the controller reads
    the snapshots."""
    policy = elche.mode.policy
    chosen: type[SyncMode] = SoloSync
    if peers.world > 1 or policy.via_controller:
        chosen = resolve_dotted(policy.rank_side)
    return chosen(peers, parts, pacer, optimizer, elche)
