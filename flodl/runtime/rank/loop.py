"""The rank loop: train the chunks the controller plans, report, average, repeat.

The same loop runs in a rank process (socket link, a torch.distributed group) and in-process on a
single device (queue link, no group). A report is sent *before* averaging, so the controller
plans the next window while the collective runs.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flodl.data.loader import collate_for, data_path
from flodl.data.residency import place
from flodl.data.source import BatchSource, count_batches, resolve_dataset
from flodl.monitor.metrics import drain_scalars
from flodl.rig import links
from flodl.rig.device_memory import DeviceMemory
from flodl.rig.pacing import Pacer
from flodl.runtime.rank import blame, shard_plan
from flodl.runtime.rank.calibration import Calibration
from flodl.runtime.rank.eval_shard import EvalShard
from flodl.runtime.rank.lr_schedule import LrSchedule, scale_lr
from flodl.runtime.rank.memory_plan import RankMemory, own_batch_size
from flodl.runtime.rank.state import CheckpointState
from flodl.runtime.rank.stepping import RankStep
from flodl.runtime.rank.sync_modes import SyncMode, sync_for
from flodl.runtime.rank.window_feed import WindowFeed
from flodl.runtime.sync import groups
from flodl.runtime.sync.averaging import FlatState
from flodl.runtime.sync.compress import Compressor
from flodl.runtime.sync.trainable import base_fingerprint
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
from flodl.step.precision import StepRunner, compiled

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
    steps: list[tuple[int, float, float]] = dataclasses.field(default_factory=list)

    def add(self, loss: float) -> None:
        self.batches += 1
        self.last_loss = loss
        if math.isfinite(loss):
            self.loss_sum += loss
            self.loss_count += 1


class _CohortBroke(RuntimeError):
    """A start-up collective failed or was given up: a member was lost."""

    def __init__(self, message: str, abandoned: bool) -> None:
        super().__init__(message)
        self.abandoned = abandoned


class RankLoop:
    """One rank's training state and loop."""

    def __init__(
        self,
        spec: JobSpec,
        link: Any,
        rank: int,
        device: torch.device,
        regroup: Callable[..., None] | None = None,
    ) -> None:
        self.spec = spec
        self.regroup_fn = regroup  # rebuilds the process group over the survivors
        self.world = spec.world_size
        self.members: tuple[int, ...] = tuple(range(spec.world_size))  # the group, in order
        self.generation = 0
        self._void_after = -1
        self.cfg = spec.config
        self.link = link
        self.rank = rank
        self.device = device
        self.mode = self.cfg.elche.mode
        self.distributed = spec.world_size > 1 and dist.is_available() and dist.is_initialized()
        self.pacer = Pacer(spec.speeds[rank] if spec.pace else 1.0)
        links.install(links.model_for_rank(self.cfg.cluster, rank))  # cluster.link: the wire
        self._last_sync_ms: float | None = None
        self._sync_started: float | None = None
        self._eval_ms = 0.0
        self._epoch = -1
        self._pending: collections.deque[Any] = collections.deque()
        self._unaveraged = -1  # a window whose averaging failed, until the controller knows
        self._step = 0  # this rank's optimizer steps so far (per-step logging)
        # The rank's device memory: the rig's simulated device, the plan, the peak.
        self.device_memory = RankMemory(self.cfg, rank, device, self.pacer, spec.pace)

    @property
    def memory(self) -> DeviceMemory | None:
        """The rig's simulated device (``cluster.memory_mb``); None when not simulated."""
        return self.device_memory.rig

    # -- set-up ------------------------------------------------------------------------------
    def build(self) -> None:
        torch.manual_seed(self.cfg.seed)
        self.model: nn.Module = self.spec.model_factory(self.device)
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"model_factory must return an nn.Module, got {type(self.model)}")
        self.model.to(self.device).train()
        # Before the optimizer: parameters move into one buffer the collectives use in place.
        self.state = FlatState(self.model, share_storage=True)
        self.base = base_fingerprint(self.model)  # the frozen parameters' (None: all train)
        # What the step runs; averaging, checkpoints and the final state read self.model.
        self.train_model: nn.Module = compiled(self.model) if self.cfg.compile else self.model
        self.runner = StepRunner(
            self.cfg.precision,
            self.device,
            self.cfg.accumulate_grad_batches,
            self.cfg.max_grad_norm,
        )
        self.optimizer = self.spec.optim_factory(self.model.parameters())
        self.device_memory.simulate(self.model, self.optimizer)
        # How this rank agrees on weights with the others: chosen once, from elche.mode.
        self.sync: SyncMode = sync_for(self, self.cfg.elche, self.spec.world_size)
        self.compressor: Compressor | None = self.sync.compressor  # the plan's probe reads it
        with self.device_memory.host():  # read or generated into host memory (placement decides)
            dataset = resolve_dataset(self.spec.dataset)
        self.batch_size = own_batch_size(self, dataset)
        if self.batch_size > len(dataset):
            key = (
                f"trainer.batch_size={self.batch_size}"
                if self.batch_size == self.cfg.batch_size
                else f"rank {self.rank}'s batch size {self.batch_size} (cluster.batch_sizes)"
            )
            raise ValueError(f"{key}: larger than the dataset ({len(dataset)} samples)")
        self.loader_cfg = self.spec.loader_for(self.rank)
        collate = collate_for(self.loader_cfg, self.spec.collate_fn)
        self.source = BatchSource(dataset, self.batch_size, self.cfg.seed, self.device, collate)
        self.resident = place(self.source, self.loader_cfg)
        # resident data counts against the device, before the plan
        self.device_memory.place(self.source, self.loader_cfg)
        # before the LR scaling: offload replaces the optimizer
        self.memory_plan = self.device_memory.plan(self)
        scale_lr(self.optimizer, self.spec.world_size, self.cfg.lr_scale_ratio)
        self._build_parts(collate)

    def _build_parts(self, collate: Any) -> None:
        """The parts built on the final optimizer and batch size (after the memory plan and
        the LR scaling): data path, schedule, step, checkpoint state, evaluation."""
        self.data = data_path(self.source, self.loader_cfg)
        self.loading = WindowFeed(self.data, self.link, self._pending, self.is_void)
        self.schedule = LrSchedule(self)
        self.steps = RankStep(self, epoch=lambda: self._epoch)
        self.checkpoint = CheckpointState(  # after the plan's optimizer and the scheduler
            self.rank,
            self.model,
            self.state,
            self.optimizer,
            self.schedule.scheduler,
            self.runner,
            self.sync.outer,
            self.sync.compressor,
            link=self.link,
            device=self.device,
            save_path=self.cfg.save_path,
            memory=self.memory,
            check_weights=self.steps.check_weights,
            base=self.base,
        )
        self.eval_source = None
        if self.spec.has_eval:
            with self.device_memory.host():  # its batches count as they are cut
                eval_set = resolve_dataset(self.spec.eval_dataset, "eval_dataset")
            self.eval_source = BatchSource(
                eval_set, self.cfg.batch_size, self.cfg.seed, self.device, collate
            )
            place(self.eval_source, self.loader_cfg.model_copy(update={"placement": "auto"}))
            # The metrics are built at this rank's first evaluation, not here: the launcher
            # built them once already (a bad metric refuses the run there), and a rank that
            # never evaluates (elected policy) never pays torchmetrics' import (~1.6 s CPU,
            # dearer than torch's), which would delay every rank's first step. The import then
            # lands in that evaluation, outside the paced steps.
        self.evaluation = EvalShard(
            self.rank,
            self.model,
            self.eval_source,
            self.loader_cfg,
            self.spec.evaluation,
            self.device,
            self.link,
        )

    # -- loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.start()
            self._loop()
        finally:
            self.device_memory.close()
            data = getattr(self, "data", None)
            if data is not None:
                data.close()  # the loader's worker processes end with the rank

    def _loop(self) -> None:
        while True:
            msg = self.next_message()
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
            self._epoch = msg.epoch - 1
        elif isinstance(msg, Regroup):
            self.regroup(msg)

    def _meet(self) -> float | None:
        """One set of weights (the first member's) and the calibration; ``None`` when a member
        was lost in a collective (the group is released; a Regroup will follow)."""
        try:
            if self.distributed:
                flat = self.state.flatten()  # a copy: loaded only once the broadcast succeeded
                self._together(flat, broadcast=True)
                self.state.load(flat)
                del flat  # not held through the calibration steps (the rank's peak)
            step_ms = Calibration(self).calibrate()
            shard_plan.agree(self)  # memory_plan shard: the cohort's cut
        except _CohortBroke as exc:
            log.warning(
                "rank %d: a member was lost before training (%s); waiting to regroup",
                self.rank,
                exc,
            )
            groups.release(exc.abandoned)
            return None
        self.sync.reset_outer()
        return step_ms

    def _together(self, t: torch.Tensor, op: Any = None, broadcast: bool = False) -> None:
        """A start-up collective over the current group (nothing alone), given up once a newer
        membership is announced; a failure is :class:`_CohortBroke`, never the user's error."""
        if not self.distributed:
            return
        failure, abandoned = None, False
        try:
            if broadcast:
                work = dist.broadcast(t, src=0, async_op=True)
            else:
                work = dist.all_reduce(t, op=op or dist.ReduceOp.SUM, async_op=True)
            if dist.get_backend() == "gloo":
                groups.wait(work, self._doomed)
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
            raise _CohortBroke(failure, abandoned)

    def _next_regroup(self) -> None:
        """Before training: wait for the controller's next membership and form it (the
        controller announces one as soon as it knows a member is gone, or ends the job)."""
        while True:
            msg = self._pending.popleft() if self._pending else self.link.recv()
            if isinstance(msg, Regroup) and msg.generation > self.generation:
                self.regroup(msg)
                return
            if not isinstance(msg, Regroup):
                self._pending.append(msg)

    def next_message(self) -> Any:
        return self._pending.popleft() if self._pending else self.link.recv()

    def start(self) -> None:
        """Build, meet the cohort (same weights, one nominal step) and tell the controller this
        rank is ready. A rank lost meanwhile is survived: the controller announces the smaller
        membership, the survivors re-form their group and meet again."""
        self.build()
        chaos.point("start", self.rank)
        while True:
            if not self._doomed():
                step_ms = self._meet()
                if step_ms is not None and not self._doomed():
                    break
            self._next_regroup()
        shapes = [(n, tuple(t.shape), str(t.dtype)) for n, t in self.model.state_dict().items()]
        self.link.send(
            Ready(
                rank=self.rank,
                signature=state_signature(shapes),
                n_params=self.state.n_params,
                step_ms=step_ms,
                device=str(self.device),
                n_samples=len(self.source),
                batch_size=self.batch_size,
                memory_plan=self.memory_plan.describe(self.rank),
                sharded_state="shard" in self.memory_plan.elements,
                base=self.base,
                shard_sizes=tuple(getattr(self.source.dataset, "shard_sizes", ())),
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
                final = Final(rank=self.rank, params=params, buffers=buffers, base=self.base)
                self.link.send(final)
            if not msg.hold:
                return
            msg = self._next_stop()

    def _next_stop(self) -> Stop:
        while True:
            msg = self.next_message()
            if isinstance(msg, Stop):
                return msg

    def is_void(self, window: Window) -> bool:
        """Planned for an older membership after the window the cohort broke on: skip it."""
        return window.generation < self.generation and window.index > self._void_after

    # -- windows ------------------------------------------------------------------------------
    def run_window(self, window: Window) -> None:
        if self.is_void(window):
            self.loading.cancel(window)
            return
        tally = self.begin_window(window)
        batches = self.loading.timed(self.loading.window_batches(window), tally)
        n = count_batches(window.chunks, self.batch_size)
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
        self._step += 1
        every = self.cfg.logger.log_every_n_steps
        if every and self._step % every == 0 and math.isfinite(tally.last_loss):
            lr = float(self.optimizer.param_groups[0]["lr"])
            tally.steps.append((self._step, tally.last_loss, lr))

    def begin_window(self, window: Window) -> WindowTally:
        """Account the sync that just ended and start timing this window's compute."""
        if window.epoch != self._epoch:
            if self._epoch >= 0:
                self.schedule.new_epoch()
            self._epoch = window.epoch
        if self._sync_started is not None:
            elapsed = (time.perf_counter() - self._sync_started) * 1000.0
            self._last_sync_ms = max(0.0, elapsed - self._eval_ms)
        self._eval_ms = 0.0
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
        self._sync_started = time.perf_counter() - tally.blend_ms / 1000.0
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
                prev_sync_ms=self._last_sync_ms,
                prev_divergence=self.sync.last_divergence,
                lr=float(self.optimizer.param_groups[0]["lr"]),
                snapshot=snapshot,
                data_ms=tally.data_ms,
                overrun_ms=(self.pacer.overrun_s - tally.overrun_s) * 1000.0,
                peak_mem=self.device_memory.peak(),
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
            self._eval_ms += self.evaluation.evaluate(window)

    # -- membership ------------------------------------------------------------------------------
    def _collective(self, run: Callable[[], Any], what: str) -> bool:
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
        if self.regroup_fn is not None:
            groups.release(abandoned)
        return False

    def _doomed(self) -> bool:
        return bool(self.link.announced_generation > self.generation)

    def _await_regroup(self) -> None:
        """After a failed collective: the new membership, unless the run is already stopping
        (Stop goes out once every window is reported, which is before the last average; a rank
        lost in that average is lost while stopping, and no new membership follows).
        A cpu_* average that arrives meanwhile is taken now: queued behind, it would be out of
        reach of the wait for it that this regroup may have interrupted
        (:meth:`ControllerSync.average`)."""
        while not any(isinstance(m, Stop) for m in self._pending):
            msg = self.link.recv(timeout=self.cfg.cluster.heartbeat_timeout_s * 2)
            if isinstance(msg, Regroup):
                self.regroup(msg)
                return
            if isinstance(msg, Average):
                self.sync.take(msg)
            else:
                self._pending.append(msg)

    def regroup(self, msg: Regroup) -> None:
        """Survivors: rebuild the process group, agree on one set of weights, go on."""
        if msg.generation <= self.generation:
            return
        chaos.point("regroup", self.rank)
        self.generation = msg.generation
        self.sync.on_regroup(msg)  # the survivors' next average goes whole
        self._void_after = msg.last_window
        self.world = len(msg.members)
        self.members = tuple(msg.members)
        if self.regroup_fn is not None:
            try:
                self.regroup_fn(msg.members, msg.generation, self._doomed)
            except groups.Abandoned:
                log.warning(
                    "rank %d: gave up forming generation %d (a newer membership was announced)",
                    self.rank,
                    msg.generation,
                )
        self.distributed = self.world > 1 and dist.is_initialized()
        if self._doomed():  # lost another rank meanwhile: form the newer membership now, before
            self._await_regroup()  # any window of this plan runs a collective on no group
            return
        if self.distributed and not self.sync.after_regroup(msg):  # a survivor died meanwhile
            self._await_regroup()
            return
        self.sync.reset_outer()
        self.link.send(Regrouped(self.rank, msg.generation, self._unaveraged))
        self._unaveraged = -1

    # -- evaluation ----------------------------------------------------------------------------
