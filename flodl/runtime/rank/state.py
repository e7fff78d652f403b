"""What a rank saves and restores: its shard (optimizer, scheduler, RNG, scaler), the consensus
weights with the outer momentum, and a resume's state loaded back.

The rank loop decides *when* (a window's ``checkpoint_after``, a Stop, a Restore); this part
knows *what*. It is built once the rank's parts exist (the optimizer after the memory plan, the
scheduler after the LR scaling) and holds them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flodl.checkpoint.shards import MODEL, load_shard, process_local, rank_shard, write_shard
from flodl.rig.device_memory import DeviceMemory, training_state
from flodl.runtime.rank import blame
from flodl.runtime.sync.averaging import FlatState
from flodl.runtime.sync.compress import Compressor
from flodl.runtime.sync.outer import NesterovOuter
from flodl.runtime.sync.shard_state import is_sharded
from flodl.runtime.sync.sharded_optimizer import ShardedOptimizer
from flodl.runtime.sync.trainable import load_trainable, trainable_state
from flodl.runtime.wire.messages import RankState, Restore
from flodl.step.precision import StepRunner

log = logging.getLogger(__name__)


class CheckpointState:
    """One rank's checkpoint state: what goes into its shard and the weights bundle, and what
    a resume loads back."""

    def __init__(
        self,
        rank: int,
        model: nn.Module,
        state: FlatState,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        runner: StepRunner,
        outer: NesterovOuter | None,
        compressor: Compressor | None,
        *,
        link: Any,
        device: torch.device,
        save_path: str | None,
        memory: DeviceMemory | None,
        check_weights: Callable[[str], None],
        base: str | None = None,
    ) -> None:
        self.rank = rank
        self.model = model
        self.state = state
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.runner = runner
        self.outer = outer
        self.compressor = compressor
        self.link = link
        self.device = device
        self.save_path = save_path
        self.memory = memory  # the rig's simulated device (None: not simulated)
        self.check_weights = check_weights  # the loop's: names the epoch
        self.base = base  # the frozen parameters' fingerprint (None: all train)

    def _memory_host(self) -> Any:
        return self.memory.host() if self.memory is not None else contextlib.nullcontext()

    def weights(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Trainable parameters and buffers by name, on CPU (the model's own tensors when the
        link serialises them while sending: no copy of the weights; else copies). A frozen base
        stays here: :attr:`base` stands for it."""
        return trainable_state(self.model, copy=not getattr(self.link, "serialises", False))

    def save_shards(self, window: int, tag: str, write_weights: bool, own: bool = True) -> None:
        """Write this rank's shard (``own``) and the weights, if asked; tell the controller."""
        stem = self.save_path
        assert stem is not None
        relay = process_local(stem)  # the launcher's own store: stream the payloads there
        try:
            if write_weights:  # never a bundle of non-finite weights over a good one
                self.check_weights("at a checkpoint")
            payloads = {rank_shard(self.rank): self.rank_payload()} if own else {}
            if write_weights:
                payloads[MODEL] = self.model_payload(copy=relay)
            shards: dict[str, Any] = (
                payloads
                if relay
                else {name: write_shard(stem, tag, name, p) for name, p in payloads.items()}
            )
        except Exception as exc:
            from flodl.monitor.failures import describe

            self.link.send(RankState(self.rank, window, tag, {}, error=describe(exc)))
            return
        self.link.send(RankState(self.rank, window, tag, shards))

    def rank_payload(self) -> dict[str, Any]:
        """This rank's own resumable state: optimizer, scheduler, RNG (CUDA too) and ``extra``."""
        payload: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": torch.get_rng_state(),
            "cuda_rng": None,
            "extra": self.extra_state(),
            "scaler": self.runner.state_dict(),  # 16-mixed: the GradScaler's state
        }
        if self.device.type == "cuda":
            payload["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return payload

    def extra_state(self) -> dict[str, Any]:
        """Per-rank state of other features (e.g. a GradScaler) for the shard; see restore."""
        return {}

    def load_extra_state(self, extra: dict[str, Any]) -> None:
        """Counterpart of :meth:`extra_state`."""

    def model_payload(self, copy: bool) -> dict[str, Any]:
        """The consensus weights and the collective outer momentum (identical on every rank)."""
        params, buffers = trainable_state(self.model, copy=copy)
        outer = None
        if self.outer is not None and self.outer.buffer is not None:
            outer = {"buffer": self.outer.buffer.detach().cpu().clone()}
        # A frozen base is not saved: its fingerprint is, so a resume refuses another base.
        return {"params": params, "buffers": buffers, "outer": outer, "base": self.base}

    def restore(self, msg: Restore) -> None:
        """Continue a saved run: weights, outer momentum, this rank's optimizer/scheduler/RNG."""
        with self._memory_host():  # a bundle is read into host memory, then copied in
            model = load_shard(msg.model) if isinstance(msg.model, str) else msg.model
            state = load_shard(msg.state) if isinstance(msg.state, str) else msg.state
        # A bundle that does not fit the configured model (adapters saved on another frozen
        # base) fails every rank alike: the job fails with it, no rank is "lost" over it.
        with blame.user_code("resume"):
            load_trainable(
                self.model,
                {**model["params"], **model["buffers"]},
                model.get("base"),
                f"checkpoint {msg.model if isinstance(msg.model, str) else 'state'}",
            )
        if self.compressor is not None:
            self.compressor.invalidate()
        if self.outer is not None:
            self.outer.reset(self.state.current())  # reset copies
            saved = model.get("outer") or {}
            if saved.get("buffer") is not None:
                self.outer.buffer = saved["buffer"].to(self.device).clone()
        self._load_optimizer(state["optimizer"], msg)
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._rescale_lr(msg.lr_factor)
        self.runner.load_state_dict(state.get("scaler"))
        torch.set_rng_state(state["rng"])
        if self.device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.load_extra_state(state.get("extra") or {})
        if self.memory is not None:  # the optimizer state now on the device (not offloaded)
            self.memory.adopt(training_state(self.model, self.optimizer))

    def _load_optimizer(self, own: dict[str, Any], msg: Restore) -> None:
        """The optimizer's state. A bundle saved sharded (memory_plan shard): this rank's
        pieces (or, unsharded now, whole parameters) re-assembled from every saved rank's
        shard, one in memory at a time, so it resumes on any world size and any cut. A plain
        one: this rank's own (or the one it takes over; a sharded optimizer cuts its pieces
        from it)."""
        if not is_sharded(own) or not msg.states:  # a plain state: the same on every rank
            self.optimizer.load_state_dict(own)
            return

        def loader(where: Any) -> Any:
            def load() -> Any:
                with self._memory_host():
                    shard = load_shard(where) if isinstance(where, str) else where
                return shard["optimizer"]

            return load

        loaders = [loader(where) for where in msg.states]
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.load_shards(loaders, what="the bundle")
            return
        from flodl.runtime.sync.shard_state import to_plain

        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        with self._memory_host():
            plain, fresh = to_plain((load() for load in loaders), [p.shape for p in params])
        if fresh:
            log.warning(
                "rank %d: the bundle holds no optimizer state for %d elements (a rank that "
                "wrote none was lost); they start afresh",
                self.rank,
                fresh,
            )
        self.optimizer.load_state_dict(plain)

    def _rescale_lr(self, factor: float) -> None:
        """Resumed on another world size: the saved lr carries the old world's scaling."""
        if factor == 1.0:
            return
        for group in self.optimizer.param_groups:
            group["lr"] *= factor
            if "initial_lr" in group:
                group["initial_lr"] *= factor
        if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
            self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]
