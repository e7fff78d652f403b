"""The rank loop: train the chunks the controller plans, report, average, repeat.

The same loop runs in a rank process (socket link, a torch.distributed group) and in-process on a
single device (queue link, no group). A report is sent *before* averaging, so the controller
plans the next window while the collective runs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from flodl.config import TrainerConfig
from flodl.config.registries.codecs import NO_CODEC
from flodl.data.loader import collate_for, data_path
from flodl.data.residency import place
from flodl.data.source import BatchSource, count_batches, resolve_dataset
from flodl.monitor.metrics import drain_scalars
from flodl.rig import links
from flodl.rig.pacing import Pacer
from flodl.runtime.rank import blame, shard_plan
from flodl.runtime.rank.batch_probe import BatchProbe, own_batch_size
from flodl.runtime.rank.calibration import Calibration
from flodl.runtime.rank.eval_shard import EvalShard
from flodl.runtime.rank.lr_schedule import LrSchedule, scale_lr
from flodl.runtime.rank.memory_plan import ProbeTarget, RankMemory
from flodl.runtime.rank.peers import CohortBroke, Peers
from flodl.runtime.rank.setup import ModelParts, RankSetup
from flodl.runtime.rank.state import CheckpointState
from flodl.runtime.rank.stepping import RankStep
from flodl.runtime.rank.sync_modes import sync_for
from flodl.runtime.rank.window_feed import WindowFeed
from flodl.runtime.sync import groups
from flodl.runtime.wire import chaos
from flodl.runtime.wire.job_spec import JobSpec, state_signature
from flodl.runtime.wire.messages import (
    Average,
    Final,
    Plan,
    Ready,
    Regroup,
    Regrouped,
    Report,
    Restore,
    Settled,
    Stop,
    Window,
)

log = logging.getLogger(__name__)


@dataclass
class WindowTally:
    """Losses and batches of the window in progress."""

    start: float
    loss_sum: float = 0.0
    loss_count: int = 0
    batches: int = 0
    data_ms: float = 0.0  # waiting for batches
    blend_ms: float = 0.0  # cpu_async: blending in averages that arrived between steps
    overrun_s: float = 0.0  # the pacer's overrun count when the window began
    last_loss: float = math.nan
    steps: list[tuple[int, float, float]] = field(default_factory=list)

    def add(self, loss: float) -> None:
        self.batches += 1
        self.last_loss = loss
        if math.isfinite(loss):
            self.loss_sum += loss
            self.loss_count += 1


@dataclass
class WindowClock:
    """Where the rank is between windows: the epoch, the sync that ended (its start and its
    time, less the evaluation inside it), and its optimizer steps so far."""

    epoch: int = -1
    eval_ms: float = 0.0  # evaluation since the last report: not sync time
    sync_started: float | None = None
    last_sync_ms: float | None = None
    steps: int = 0  # per-step logging


class RankLoop:
    """One rank's training state and loop. What its parts read is built once, in
    :meth:`build`, as a frozen :class:`~flodl.runtime.rank.setup.RankSetup`; each part takes
    the fields it reads, and the group is the rank's public
    :class:`~flodl.runtime.rank.peers.Peers`."""

    def __init__(
        self,
        spec: JobSpec,
        link: Any,
        rank: int,
        device: torch.device,
        regroup: Callable[..., None] | None = None,
    ) -> None:
        cfg = spec.config
        self.spec = spec
        self.device = device
        wait_s = cfg.cluster.heartbeat_timeout_s * 2
        self.peers = Peers(rank, spec.world_size, link, wait_s, reform=regroup)
        self.pacer = Pacer(spec.speeds[rank] if spec.pace else 1.0)
        links.install(links.model_for_rank(cfg.cluster, rank))  # cluster.link: the wire
        self.clock = WindowClock()
        # The rank's device memory: the rig's simulated device, the plan, the peak.
        self.memory = RankMemory(cfg, rank, device, self.pacer, spec.pace)

    @property
    def rank(self) -> int:
        return self.peers.rank

    @property
    def link(self) -> Any:
        return self.peers.link

    @property
    def cfg(self) -> TrainerConfig:
        return self.spec.config

    # -- set-up ------------------------------------------------------------------------------
    def build(self) -> None:
        """The model, its data, the memory plan (batch size and optimizer), then everything
        that reads them: each built from what exists by then."""
        spec, cfg, rank, device = self.spec, self.cfg, self.rank, self.device
        parts = ModelParts.build(spec, device)
        optimizer = spec.optim_factory(parts.model.parameters())
        self.memory.simulate(parts.model, optimizer)
        with self.memory.host():  # read or generated into host memory (placement decides)
            dataset = resolve_dataset(spec.dataset)
        batch_size = own_batch_size(BatchProbe(spec, rank, device, parts), dataset)
        if batch_size > len(dataset):
            key = (
                f"trainer.batch_size={batch_size}"
                if batch_size == cfg.batch_size
                else f"rank {rank}'s batch size {batch_size} (cluster.batch_sizes)"
            )
            raise ValueError(f"{key}: larger than the dataset ({len(dataset)} samples)")
        loader_cfg = spec.loader_for(rank)
        collate = collate_for(loader_cfg, spec.collate_fn)
        source = BatchSource(dataset, batch_size, cfg.seed, device, collate)
        place(source, loader_cfg)
        self.memory.place(source, loader_cfg)  # resident data counts against the device
        policy = cfg.elche.mode.policy
        world = self.peers.world
        target = ProbeTarget(
            spec,
            rank,
            device,
            parts,
            source,
            world,
            gradient_buckets=policy.gradient_sync and world > 1,
            second_copy=policy.via_controller or cfg.elche.compress != NO_CODEC,
        )
        self.memory_plan, optimizer = self.memory.plan(target, optimizer)
        source.batch_size = self.memory_plan.batch_size
        scale_lr(optimizer, spec.world_size, cfg.lr_scale_ratio)  # the plan's optimizer
        self.setup = RankSetup(spec, rank, device, self.link, self.pacer, parts, optimizer, source,
                               loader_cfg)  # fmt: skip
        # How this rank agrees on weights with the others: chosen once, from elche.mode.
        self.sync = sync_for(self.peers, parts, self.pacer, optimizer, cfg.elche)
        self.peers.bind(self.regroup, self.sync.take)
        self._build_parts(collate)

    def _build_parts(self, collate: Any) -> None:
        """The parts that read the final setup: data path, schedule, step, checkpoint state,
        evaluation."""
        setup, parts, spec, rank = self.setup, self.setup.parts, self.spec, self.rank
        self.data = data_path(setup.source, setup.loader_cfg)
        self.loading = WindowFeed(self.data, self.link, self.peers.inbox, self.is_void)
        self.schedule = LrSchedule(
            spec, rank, self.device, self.peers.distributed, setup.source, setup.optimizer
        )
        self.steps = RankStep(
            rank, spec, parts, setup.optimizer, self.sync, epoch=lambda: self.clock.epoch
        )
        self.checkpoint = CheckpointState(
            rank,
            parts.model,
            parts.state,
            setup.optimizer,
            self.schedule.scheduler,
            parts.runner,
            self.sync.outer,
            self.sync.compressor,
            link=self.link,
            device=self.device,
            save_path=self.cfg.save_path,
            memory=self.memory.rig,
            check_weights=self.steps.check_weights,
            base=parts.base,
        )
        eval_source = None
        if spec.has_eval:
            with self.memory.host():  # its batches count as they are cut
                eval_set = resolve_dataset(spec.eval_dataset, "eval_dataset")
            eval_source = BatchSource(eval_set, self.cfg.batch_size, self.cfg.seed, self.device,
                                      collate)  # fmt: skip
            place(eval_source, setup.loader_cfg.model_copy(update={"placement": "auto"}))
            # The metrics are built at this rank's first evaluation, not here: the launcher
            # built them once already (a bad metric refuses the run there), and a rank that
            # never evaluates (elected policy) never pays torchmetrics' import (~1.6 s CPU,
            # dearer than torch's), which would delay every rank's first step. The import then
            # lands in that evaluation, outside the paced steps.
        self.evaluation = EvalShard(
            rank, parts.model, eval_source, setup.loader_cfg, spec.evaluation, self.device,
            self.link,
        )  # fmt: skip

    # -- loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.start()
            self._loop()
        finally:
            self.memory.close()
            data = getattr(self, "data", None)
            if data is not None:
                data.close()  # the loader's worker processes end with the rank

    def _loop(self) -> None:
        while True:
            msg = self.peers.next_message()
            if isinstance(msg, Plan):
                self.loading.feed(msg.windows)
                for window in msg.windows:
                    self.run_window(window)
            elif isinstance(msg, Stop):
                self.finish(msg)
                return
            else:
                self.handle(msg)

    def handle(self, msg: Any) -> None:
        """A control message that is neither a plan nor a stop: an average (cpu_*), a resume's
        state, a new membership. Shared with the cooperative tier's loop."""
        if isinstance(msg, Average):
            self.sync.take(msg)
        elif isinstance(msg, Restore):
            self.checkpoint.restore(msg)
            # The scheduler steps when a new epoch begins; the saved one had not stepped yet.
            self.clock.epoch = msg.epoch - 1
        elif isinstance(msg, Regroup):
            self.regroup(msg)

    def _meet(self) -> float | None:
        """One set of weights (the first member's) and the calibration; ``None`` when a member
        was lost in a collective (the group is released; a Regroup will follow)."""
        setup, parts, peers = self.setup, self.setup.parts, self.peers
        try:
            if peers.distributed:
                flat = parts.state.flatten()  # a copy: loaded only once the broadcast succeeded
                peers.together(flat, broadcast=True)
                parts.state.load(flat)
                del flat  # not held through the calibration steps (the rank's peak)
            step_ms = Calibration(
                self.rank, self.spec, parts.model, parts.runner, setup.source, setup.loader_cfg,
                self.pacer, self.memory, self.memory_plan.recomputes, peers.together,
            ).calibrate()  # fmt: skip
            self.memory_plan = shard_plan.agree(  # memory_plan shard: the cohort's cut
                setup.optimizer, self.memory_plan, self.rank, self.spec, peers.together,
                on_host=lambda: self.memory.host_optimizer(self.spec, parts),
            )  # fmt: skip
        except CohortBroke as exc:
            log.warning(
                "rank %d: a member was lost before training (%s); waiting to regroup",
                self.rank,
                exc,
            )
            groups.release(exc.abandoned)
            return None
        self.sync.reset_outer()
        return step_ms

    def start(self) -> None:
        """Build, meet the cohort (same weights, one nominal step) and tell the controller this
        rank is ready. A rank lost meanwhile is survived: the controller announces the smaller
        membership, the survivors re-form their group and meet again."""
        self.build()
        chaos.point("start", self.rank)
        while True:
            if not self.peers.doomed():
                step_ms = self._meet()
                if step_ms is not None and not self.peers.doomed():
                    break
            self.peers.next_regroup()
        model, source = self.setup.model, self.setup.source
        shapes = [(n, tuple(t.shape), str(t.dtype)) for n, t in model.state_dict().items()]
        self.link.send(
            Ready(
                rank=self.rank,
                signature=state_signature(shapes),
                n_params=self.setup.parts.state.n_params,
                step_ms=step_ms,
                device=str(self.device),
                n_samples=len(source),
                batch_size=self.setup.batch_size,
                memory_plan=self.memory_plan.describe(self.rank),
                sharded_state=self.memory_plan.cohort,
                base=self.setup.parts.base,
                shard_sizes=tuple(getattr(source.dataset, "shard_sizes", ())),
            )
        )

    def finish(self, msg: Stop) -> None:
        """Save and send what Stop asks; a held rank then waits for the controller's next Stop:
        its release, or the order to take over from a lost sender (its weights are the same)."""
        self.sync.drain()  # cpu_async: take the averages still in flight
        saved = ""  # the save this rank's own shard went to (a takeover adds the weights)
        while True:
            if msg.checkpoint:
                if msg.write_weights:
                    chaos.point("final_save", self.rank)
                own = saved != msg.save_tag
                self.checkpoint.save_shards(-1, msg.save_tag, msg.write_weights, own=own)
                saved = msg.save_tag
            if msg.send_state:
                chaos.point("final", self.rank)
                self.steps.check_weights("at the end of the run")
                params, buffers = self.checkpoint.weights()
                base = self.setup.parts.base
                final = Final(rank=self.rank, params=params, buffers=buffers, base=base)
                self.link.send(final)
            if not msg.hold:
                return
            msg = self._next_stop()

    def _next_stop(self) -> Stop:
        while True:
            msg = self.peers.next_message()
            if isinstance(msg, Stop):
                return msg

    def is_void(self, window: Window) -> bool:
        """Planned for an older membership after the window the cohort broke on: skip it."""
        return window.generation < self.peers.generation and window.index > self.peers.void_after

    # -- windows ------------------------------------------------------------------------------
    def run_window(self, window: Window) -> None:
        if self.is_void(window):
            self.loading.cancel(window)
            return
        tally = self.begin_window(window)
        batches = self.loading.timed(self.loading.window_batches(window), tally)
        n = count_batches(window.chunks, self.setup.batch_size)
        for i in range(n):
            # Paced from the request for the batch: loading overlaps the padded step, as it
            # overlaps device compute on a real rig; it is not added on top of the deadline.
            loss, batch = self.pacer.run(partial(self._fetch_train, batches, i == n - 1))
            tally.add(loss)
            self.schedule.tick(batch)
            self.log_step(tally)
            if tally.batches == 1:
                chaos.point("window", self.rank)
            self.sync.between_steps(tally)
        self.end_window(window, tally)

    def _fetch_train(self, batches: Any, last: bool) -> tuple[float, Any]:
        with blame.user_code("dataset"):
            batch = next(batches)
        return self.steps.train_batch(batch, last), batch

    def log_step(self, tally: WindowTally) -> None:
        """Every ``logger.log_every_n_steps``-th step: keep its loss and LR for the report."""
        self.clock.steps += 1
        every = self.cfg.logger.log_every_n_steps
        if every and self.clock.steps % every == 0 and math.isfinite(tally.last_loss):
            lr = float(self.setup.optimizer.param_groups[0]["lr"])
            tally.steps.append((self.clock.steps, tally.last_loss, lr))

    def begin_window(self, window: Window) -> WindowTally:
        """Account the sync that just ended and start timing this window's compute."""
        if window.epoch != self.clock.epoch:
            if self.clock.epoch >= 0:
                self.schedule.new_epoch()
            self.clock.epoch = window.epoch
        if self.clock.sync_started is not None:
            elapsed = (time.perf_counter() - self.clock.sync_started) * 1000.0
            self.clock.last_sync_ms = max(0.0, elapsed - self.clock.eval_ms)
        self.clock.eval_ms = 0.0
        self.sync.begin(window)
        self.schedule.begin(window)
        return WindowTally(time.perf_counter(), overrun_s=self.pacer.overrun_s)

    def end_window(self, window: Window, tally: WindowTally) -> None:
        """Report the window (before averaging, so planning overlaps it), average, evaluate."""
        if tally.batches == 0 and self.sync.steps_without_data():
            self.steps.null_step()  # sharded state, no batch here: the step's collectives
            self.schedule.to_window_end()
        # time spent blending in averages is averaging time, not compute: it goes to the sync
        compute_ms = (time.perf_counter() - tally.start) * 1000.0 - tally.blend_ms
        self.steps.check_weights(f"after window {window.index}")
        loss_sum, loss_count, batches = tally.loss_sum, tally.loss_count, tally.batches
        self.clock.sync_started = time.perf_counter() - tally.blend_ms / 1000.0
        snapshot = self.sync.snapshot()
        self.link.send(
            Report(
                rank=self.rank,
                window=window.index,
                epoch=window.epoch,
                chunks=window.chunks,
                batches=batches,
                samples=sum(size for _, size in window.chunks),
                compute_ms=compute_ms,
                loss_sum=loss_sum,
                loss_count=loss_count,
                scalars=drain_scalars(),
                prev_sync_ms=self.clock.last_sync_ms,
                prev_divergence=self.sync.last_divergence,
                lr=float(self.setup.optimizer.param_groups[0]["lr"]),
                snapshot=snapshot,
                data_ms=tally.data_ms,
                overrun_ms=(self.pacer.overrun_s - tally.overrun_s) * 1000.0,
                peak_mem=self.memory.peak(),
                steps=tuple(tally.steps),
            )
        )
        del snapshot  # sent: nothing of it is kept while the average is awaited
        chaos.point("report", self.rank)
        if self.sync.average(window) and window.settle:
            self.link.send(Settled(self.rank, window.index))
        if window.checkpoint_after:
            chaos.point("checkpoint", self.rank)
            self.checkpoint.save_shards(window.index, window.save_tag, window.write_weights)
        if window.eval_after:
            self.clock.eval_ms += self.evaluation.evaluate(window)

    # -- membership ------------------------------------------------------------------------------
    def regroup(self, msg: Regroup) -> None:
        """Survivors: rebuild the process group, agree on one set of weights, go on."""
        peers = self.peers
        if msg.generation <= peers.generation:
            return
        chaos.point("regroup", self.rank)
        self.sync.on_regroup(msg)  # the survivors' next average goes whole
        peers.form(msg)
        if peers.doomed():  # lost another rank meanwhile: form the newer membership now, before
            peers.await_regroup()  # any window of this plan runs a collective on no group
            return
        if peers.distributed and not self.sync.after_regroup(msg):  # a survivor died meanwhile
            peers.await_regroup()
            return
        self.sync.reset_outer()
        self.link.send(Regrouped(self.rank, msg.generation, peers.unaveraged))
        peers.unaveraged = -1
