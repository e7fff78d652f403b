"""What a rank needs to train: the user's factories and step, the data, and the validated config."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flodl.config import LoaderConfig, TrainerConfig
from flodl.step.evaluation import EvalSpec


@dataclass
class Callbacks:
    """Launcher-side hooks (they never travel to ranks)."""

    metrics_fn: Callable[[Any], Any] | None = None  # a truthy return (or a str) stops the run
    eval_result_fn: Callable[[int, float], None] | None = None
    epoch_fn: Callable[[int], None] | None = None


@dataclass(frozen=True)
class JobSpec:
    """Sent once to each rank after authentication (cloudpickle: closures and ``__main__`` work).

    Frozen: the trainer states the user's part, the job adds the topology's (``replace``), the
    cohort the store's address; nothing changes it after."""

    config: TrainerConfig
    model_factory: Callable[..., Any]
    optim_factory: Callable[..., Any]
    train_step: Callable[..., Any]
    dataset: Any
    eval_dataset: Any = None
    evaluation: EvalSpec = field(default_factory=EvalSpec)
    scheduler_factory: Callable[..., Any] | None = None
    scheduler_interval: str = "epoch"  # "step": advanced on the global progress clock
    batch_sizes: list[int | None] | None = None  # the placement's, per rank (None: probed there)
    world_size: int = 1
    speeds: list[float] = field(default_factory=lambda: [1.0])
    pace: bool = False
    backend: str = "gloo"
    store_host: str = "127.0.0.1"
    store_port: int = 0
    store_prefix: str = "flodl"  # this job's keys in a store other jobs may share (torchrun's)
    entry: list[str] | None = None  # rank command after the interpreter (default: managed rank)
    collate_fn: Callable[..., Any] | None = None  # an adopted DataLoader's (else loader.collate_fn)
    loaders: list[LoaderConfig] | None = None  # per rank, overrides applied; launcher

    def batch_size_for(self, rank: int) -> int | None:
        """``rank``'s configured batch size, as the placement worked it out
        (:mod:`flodl.placement.batches`; ``None``: probed on the rank). A spec the job did not
        complete (no sizes) runs every rank at ``trainer.batch_size``."""
        if self.batch_sizes and rank < len(self.batch_sizes):
            return self.batch_sizes[rank]
        return self.config.batch_size

    def loader_for(self, rank: int) -> LoaderConfig:
        """``rank``'s loader settings (the ``loader`` node with its per-rank override)."""
        if self.loaders and rank < len(self.loaders):
            return self.loaders[rank]
        return self.config.loader.for_rank(None)

    @property
    def has_eval(self) -> bool:
        return self.evaluation.enabled and self.eval_dataset is not None


def state_signature(named_shapes: list[tuple[str, tuple[int, ...], str]]) -> str:
    """Fingerprint of an architecture: every rank must build the same one."""
    blob = ";".join(f"{n}:{s}:{d}" for n, s, d in named_shapes)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
