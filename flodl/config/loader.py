"""``loader``: each rank's data path (DataLoader workers, pinning, residency)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from flodl.config.base import _Schema
from flodl.config.locate import resolve_dotted

# -- loader (the data path of every rank) ------------------------------------------------------
Placement = Literal["auto", "resident", "streaming"]


class LoaderOverride(_Schema):
    """One rank's (or one host's ranks') departures from the ``loader`` node; null: inherit."""

    placement: Placement | None = Field(None, description="resident, streaming or auto")
    num_workers: int | None = Field(None, ge=0, le=64, description="DataLoader worker processes")
    prefetch_factor: int | None = Field(None, ge=1, le=64, description="batches per worker ahead")
    pin_memory: bool | Literal["auto"] | None = Field(None, description="pinned host batches")


class LoaderConfig(_Schema):
    """How each rank loads its planned chunks: a torch DataLoader (workers, pinned memory,
    prefetch) fed by the controller's plan one window ahead, or the dataset resident on the
    device. ``ranks`` overrides it per rank (a host's ``loader`` per host)."""

    num_workers: int = Field(0, ge=0, le=64, description="DataLoader worker processes per rank")
    prefetch_factor: int | None = Field(
        None, ge=1, le=64, description="batches each worker loads ahead (null: torch's 2)"
    )
    pin_memory: bool | Literal["auto"] = Field(
        "auto", description="page-locked batches for async copies (auto: on with CUDA)"
    )
    persistent_workers: bool = Field(
        True, description="workers live for the whole run (else: respawned every window)"
    )
    collate_fn: str | None = Field(
        None, description="dotted path: fn(list of samples) -> batch (null: default_collate)"
    )
    eval_batch_size: int | None = Field(
        None, ge=1, description="evaluation batch (null: max(trainer.batch_size, 256))"
    )
    placement: Placement = Field(
        "auto",
        description="resident: the dataset on the device once; streaming: workers + pinned "
        "memory + async copies; auto: resident when it is tensors that fit resident_fraction",
    )
    resident_fraction: float = Field(
        0.5, gt=0, le=1.0, description="resident: share of the device's free memory it may use"
    )
    ranks: list[LoaderOverride] | None = Field(
        None, description="per-rank overrides in rank order (cpu_rig, auto, slurm)"
    )

    @field_validator("collate_fn")
    @classmethod
    def _importable(cls, v: str | None) -> str | None:
        if v is not None:
            resolve_dotted(v)
        return v

    def for_rank(self, override: LoaderOverride | None) -> LoaderConfig:
        """This node with ``override``'s set fields applied (``ranks`` dropped)."""
        updates = {k: v for k, v in dict(override or {}).items() if v is not None}
        return type(self).model_validate({**self.model_dump(), **updates, "ranks": None})
