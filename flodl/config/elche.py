"""``elche``: the averaging mode and ElChe's knobs, and the presets behind ``conf/elche/``."""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from flodl.config.base import _Schema


class Mode(str, Enum):
    """Averaging mode (docs/design/modes.md); ``nccl`` = the collective backend (NCCL on CUDA,
    else gloo)."""

    NCCL_SYNC = "nccl_sync"
    NCCL_CADENCE = "nccl_cadence"
    CPU_SYNC = "cpu_sync"
    CPU_CADENCE = "cpu_cadence"
    CPU_ASYNC = "cpu_async"
    SOLO = "solo"

    @property
    def is_sync(self) -> bool:
        return self in (Mode.NCCL_SYNC, Mode.CPU_SYNC)

    @property
    def via_controller(self) -> bool:
        """True when averaging goes through the controller (snapshots in, average out)."""
        return self in (Mode.CPU_SYNC, Mode.CPU_CADENCE, Mode.CPU_ASYNC)


class Guard(str, Enum):
    """Convergence guard flavour: ``trend`` (3 rises), ``msf`` (can also nudge down), ``none``."""

    TREND = "trend"
    MSF = "msf"
    NONE = "none"


class Outer(str, Enum):
    """Outer optimizer applied to the averaged pseudo-gradient: plain average or DiLoCo Nesterov."""

    AVERAGE = "average"
    NESTEROV = "nesterov"


class ElCheConfig(_Schema):
    """ElChe, the heterogeneous cadence balancer (docs/design/elche.md). Defaults follow the
    original."""

    mode: Mode = Field(Mode.NCCL_CADENCE, description="averaging mode")
    anchor: int = Field(10, ge=1, description="initial batches of the slow rank per window")
    min_anchor: int | None = Field(
        None, ge=1, description="lower clamp of the anchor (default: anchor)"
    )
    max_anchor: int = Field(1000, ge=1, description="upper clamp of the anchor")
    overhead_target: float = Field(
        0.05, ge=0.01, le=0.5, description="sync cost as a fraction of compute ElChe aims for"
    )
    max_batch_diff: int | None = Field(
        None, ge=0, description="how far the fastest rank may lead the slowest (batches)"
    )
    relax_up: bool = Field(False, description="grow the anchor by one on stable convergence")
    partition_ratios: list[float] | None = Field(
        None, description="fixed per-rank data split instead of throughput-proportional"
    )
    meta_controller: bool = Field(True, description="shrink the anchor on LR cliffs / bad streaks")
    guard: Guard = Field(Guard.TREND, description="convergence guard: trend, msf or none")
    divergence_threshold: float | None = Field(
        None, gt=0, description="guard threshold (default 0.05; 0.3 with easgd_alpha)"
    )
    easgd_alpha: float | None = Field(
        None, gt=0, le=1, description="EASGD blend factor on arrival (cpu_async; default 0.5)"
    )
    gamma: float = Field(
        1.0, ge=-1, le=4, description="averaging weight exponent: w ∝ batches**gamma"
    )
    max_overshoot: int | None = Field(
        None, ge=0, description="cpu_async: windows a rank may run ahead of the average (auto)"
    )
    outer: Outer = Field(Outer.AVERAGE, description="outer optimizer on the averaged update")
    outer_lr: float = Field(0.7, gt=0, description="outer learning rate (outer=nesterov)")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="outer momentum (outer=nesterov)")
    compress: Literal["none", "bf16", "fp16", "int8"] = Field(
        "none",
        description="nccl_cadence and cpu_*: send each average's change in bf16/fp16 (half the "
        "bytes) or int8 with error feedback (a quarter); fp32 weights stay exact",
    )

    @field_validator("partition_ratios")
    @classmethod
    def _ratios_positive(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or any(r <= 0 for r in v)):
            raise ValueError("must be a non-empty list of positive numbers")
        return v

    @model_validator(mode="after")
    def _anchor_bounds(self) -> ElCheConfig:
        lo = self.effective_min_anchor
        if lo > self.max_anchor:
            raise ValueError(f"min_anchor={lo} exceeds max_anchor={self.max_anchor}")
        if self.anchor > self.max_anchor:
            raise ValueError(f"anchor={self.anchor} exceeds max_anchor={self.max_anchor}")
        if self.compress != "none" and self.mode in (Mode.NCCL_SYNC, Mode.SOLO):
            nccl_sync = self.mode is Mode.NCCL_SYNC
            why = "reduces gradients, not averages" if nccl_sync else "averages nothing"
            raise ValueError(
                f"elche.compress={self.compress}: mode={self.mode.value} {why}; compression "
                "applies to nccl_cadence, cpu_sync, cpu_cadence and cpu_async "
                "(or set elche.compress=none)"
            )
        return self

    @property
    def effective_min_anchor(self) -> int:
        return self.min_anchor if self.min_anchor is not None else min(self.anchor, self.max_anchor)

    @property
    def effective_divergence_threshold(self) -> float:
        if self.divergence_threshold is not None:
            return self.divergence_threshold
        return 0.3 if self.effective_easgd_alpha is not None else 0.05

    @property
    def effective_easgd_alpha(self) -> float | None:
        if self.mode is not Mode.CPU_ASYNC:
            return None
        return self.easgd_alpha if self.easgd_alpha is not None else 0.5

    # Presets, the tutorial's shape: ElCheConfig.nccl_cadence().model_copy(update={...}).
    @classmethod
    def preset(cls, mode: Mode | str, **kw: Any) -> ElCheConfig:
        """``mode``'s preset (:data:`ELCHE_PRESETS`, as its YAML), ``kw`` on top."""
        mode = Mode(mode)
        return cls(**{"mode": mode, **ELCHE_PRESETS[mode], **kw})

    @classmethod
    def nccl_sync(cls, **kw: Any) -> ElCheConfig:
        return cls.preset(Mode.NCCL_SYNC, **kw)

    @classmethod
    def nccl_cadence(cls, **kw: Any) -> ElCheConfig:
        return cls.preset(Mode.NCCL_CADENCE, **kw)

    @classmethod
    def cpu_sync(cls, **kw: Any) -> ElCheConfig:
        return cls.preset(Mode.CPU_SYNC, **kw)

    @classmethod
    def cpu_cadence(cls, **kw: Any) -> ElCheConfig:
        return cls.preset(Mode.CPU_CADENCE, **kw)

    @classmethod
    def cpu_async(cls, **kw: Any) -> ElCheConfig:
        return cls.preset(Mode.CPU_ASYNC, **kw)

    @classmethod
    def solo(cls, **kw: Any) -> ElCheConfig:
        return cls.preset(Mode.SOLO, **kw)


#: What each ElChe preset changes from :class:`ElCheConfig`'s defaults: the one table behind
#: ``ElCheConfig.<mode>()`` and ``conf/elche/<mode>.yaml`` (which states just these keys; the
#: rest comes from the schema, registered for Hydra as ``elche/_schema``, flodl/config/groups.py).
ELCHE_PRESETS: dict[Mode, dict[str, Any]] = {
    Mode.NCCL_SYNC: {"anchor": 1},  # sync every step
    Mode.NCCL_CADENCE: {},
    Mode.CPU_SYNC: {"anchor": 1},
    Mode.CPU_CADENCE: {},
    # cpu_async windows as nccl_cadence (docs/design/modes.md; the original's preset keeps anchor
    # 10): at
    # anchor 1 its overlapped averaging never measures an overhead to grow the anchor from, so
    # it averaged every slow-rank batch, each arrival an EASGD pull toward a stale centre
    Mode.CPU_ASYNC: {},
    Mode.SOLO: {},
}


def preset_yaml_keys(mode: Mode) -> dict[str, Any]:
    """The keys ``conf/elche/<mode>.yaml`` states: the mode and what its preset changes."""
    return {"mode": mode.value, **ELCHE_PRESETS[mode]}
