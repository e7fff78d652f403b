"""The one source of truth for every knob: a pydantic schema, validated once in the launcher.

YAML in ``conf/`` only composes; this module decides what is valid. Every model is frozen and
forbids unknown keys, so a typo (``trainer.nmu_epochs``) is an error that names the key, never a
silently ignored setting. Below this boundary code receives typed objects, never a ``DictConfig``.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import re
import sys
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A user configuration error: names the key, the value and what is allowed (exit code 2)."""

    exit_code = 2


class _Schema(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class Mode(str, Enum):
    """Averaging mode (DESIGN §4); ``nccl`` = the collective backend (NCCL on CUDA, else gloo)."""

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
    """ElChe, the heterogeneous cadence balancer (DESIGN §5). Defaults follow the original."""

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
#: rest comes from the schema, registered for Hydra as ``elche/_schema``).
ELCHE_PRESETS: dict[Mode, dict[str, Any]] = {
    Mode.NCCL_SYNC: {"anchor": 1},  # sync every step
    Mode.NCCL_CADENCE: {},
    Mode.CPU_SYNC: {"anchor": 1},
    Mode.CPU_CADENCE: {},
    # cpu_async windows as nccl_cadence (DESIGN §4; the original's preset keeps anchor 10): at
    # anchor 1 its overlapped averaging never measures an overhead to grow the anchor from, so
    # it averaged every slow-rank batch, each arrival an EASGD pull toward a stale centre
    Mode.CPU_ASYNC: {},
    Mode.SOLO: {},
}


def preset_yaml_keys(mode: Mode) -> dict[str, Any]:
    """The keys ``conf/elche/<mode>.yaml`` states: the mode and what its preset changes."""
    return {"mode": mode.value, **ELCHE_PRESETS[mode]}


def elche_schema_node() -> dict[str, Any]:
    """Every ElChe key at its schema default, as plain data: Hydra's base for the presets."""
    return ElCheConfig().model_dump(mode="json")


class ControllerAddress(_Schema):
    """Where the launcher's controller listens; ranks on other hosts must reach this address."""

    host: str = Field("127.0.0.1", min_length=1, description="bind address (loopback by default)")
    port: int = Field(
        0, ge=0, le=65535, description="control-plane port (0 = any free); the store takes port+1"
    )

    @field_validator("port")
    @classmethod
    def _store_port_fits(cls, v: int) -> int:
        if v == 65535:
            raise ValueError("must be at most 65534: the data-plane store listens on port+1")
        return v


class SshConfig(_Schema):
    """How the launcher reaches a worker host with the OpenSSH client (``ssh -T``, BatchMode)."""

    target: str | None = Field(None, description="ssh destination or ~/.ssh/config alias (host)")
    user: str | None = Field(None, description="remote user (ssh -l)")
    port: int | None = Field(None, ge=1, le=65535, description="sshd port (ssh -p)")
    identity_file: str | None = Field(None, description="private key (ssh -i)")
    config_file: str | None = Field(None, description="ssh_config file (ssh -F)")
    options: dict[str, str] = Field(default_factory=dict, description="extra -o Key=Value")
    connect_timeout_s: float = Field(10.0, gt=0, le=600, description="ssh ConnectTimeout")


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


_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


class WorkerConfig(_Schema):
    """One host of a multi-host cluster and the ranks it runs (global ranks in worker order)."""

    host: str = Field(min_length=1, description="the host's address (ssh and the data plane)")
    devices: Literal["all", "cpu"] | list[int] = Field(
        "all", description="GPU indices, 'all' GPUs of the host, or 'cpu' for CPU ranks"
    )
    ranks: int = Field(1, ge=1, le=64, description="devices=cpu: number of CPU ranks")
    speeds: list[float] | None = Field(
        None, description="devices=cpu: pace each rank like the CPU rig (speed in (0, 1])"
    )
    ssh: SshConfig | None = Field(
        None, description="how to reach the host; none = start ranks locally (loopback hosts only)"
    )
    python: str = Field("python3", min_length=1, description="the host's Python executable")
    project_path: str | None = Field(None, description="cd here first (default: launcher's cwd)")
    nccl_socket_ifname: str | None = Field(
        None, description="interface for NCCL and gloo (NCCL_/GLOO_SOCKET_IFNAME)"
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of its ranks")
    batch_size: int | Literal["auto"] | None = Field(
        None,
        description="per-rank batch of this host's ranks (auto: probed on CUDA); null: trainer's",
    )
    loader: LoaderOverride | None = Field(
        None, description="this host's ranks depart from the loader node (placement, workers)"
    )

    @field_validator("batch_size")
    @classmethod
    def _batch_positive(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < 1:
            raise ValueError("must be >= 1, 'auto' or null")
        return v

    @field_validator("devices")
    @classmethod
    def _devices_valid(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or len(set(v)) != len(v) or min(v) < 0):
            raise ValueError("a device list must name distinct GPU indices >= 0")
        return v

    @field_validator("speeds")
    @classmethod
    def _speeds_valid(cls, v: list[float] | None) -> list[float] | None:
        return _check_speeds(v)

    @model_validator(mode="after")
    def _consistent(self) -> WorkerConfig:
        if self.speeds is not None:
            if self.devices != "cpu":
                raise ValueError("speeds pace CPU ranks: set devices: cpu")
            if len(self.speeds) != self.ranks:
                raise ValueError(f"speeds has {len(self.speeds)} entries but ranks={self.ranks}")
        if self.ssh is None and self.host not in _LOCAL_HOSTS:
            raise ValueError(f"host {self.host!r} is remote: give it an ssh section")
        return self

    @property
    def remote(self) -> bool:
        return self.ssh is not None

    def rank_count(self) -> int | None:
        """Ranks this worker runs; ``None`` until ``devices: all`` is resolved on the host."""
        if self.devices == "cpu":
            return self.ranks
        return None if self.devices == "all" else len(self.devices)


class SlurmConfig(_Schema):
    """SLURM placement through submitit (``cluster=slurm``)."""

    nodes: int = Field(1, ge=1, description="nodes to allocate")
    tasks_per_node: int = Field(1, ge=1, description="ranks per node")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (0 = CPU ranks over gloo)")
    cpus_per_task: int | None = Field(None, ge=1, description="CPU cores per rank")
    partition: str | None = Field(None, description="SLURM partition")
    time_min: int = Field(60, ge=1, description="time limit in minutes")
    executor: Literal["auto", "slurm", "local"] = Field(
        "auto", description="submitit executor: slurm where sbatch exists, local runs tasks here"
    )
    controller: Literal["auto", "submitter", "rank0"] = Field(
        "auto",
        description="controller on the submitting host, or beside rank 0 (auto: rank0 when "
        "the nodes could not reach the submitter: a loopback controller.host on real SLURM)",
    )
    folder: str = Field("slurm", min_length=1, description="submitit logs, under the job dir")
    additional_parameters: dict[str, Any] = Field(
        default_factory=dict, description="extra sbatch parameters (submitit slurm_*)"
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def _check_speeds(v: list[float] | None) -> list[float] | None:
    if v is not None and (not v or any(not (0 < s <= 1.0) for s in v)):
        raise ValueError("every speed must be in (0, 1]")
    return v


class ClusterConfig(_Schema):
    """Where ranks run: ``auto`` (one rank per visible GPU, else in-process), the CPU rig,
    ``hosts`` (a cluster file: workers started over SSH) or ``slurm`` (placed by submitit)."""

    kind: Literal["auto", "cpu_rig", "hosts", "slurm"] = Field("auto", description="placement")
    ranks: int = Field(2, ge=1, le=64, description="cpu_rig: number of CPU ranks")
    speeds: list[float] | None = Field(
        None, description="cpu_rig: per-rank speed factor in (0, 1]; 0.4 = 2.5x slower"
    )
    threads_per_rank: int = Field(1, ge=1, description="CPU ranks: torch intra-op threads per rank")
    pace_margin: float = Field(
        1.3, ge=1.0, le=10.0, description="paced ranks: nominal step = margin x measured step"
    )
    warmup_steps: int = Field(8, ge=1, le=1000, description="paced ranks: steps timed to calibrate")
    controller: ControllerAddress = Field(
        default_factory=ControllerAddress, description="the controller's address"
    )
    workers: list[WorkerConfig] = Field(
        default_factory=list, description="hosts: the worker hosts, in global rank order"
    )
    slurm: SlurmConfig | None = Field(None, description="slurm: the allocation")
    start_timeout_s: float = Field(120.0, gt=0, description="seconds for every rank to join")
    heartbeat_timeout_s: float = Field(
        30.0, gt=0, description="a rank silent this long is dropped as lost"
    )
    batch_sizes: list[int] | Literal["auto"] | None = Field(
        None,
        description="per-rank batch sizes (memory-unequal devices); auto: probed per CUDA rank; "
        "null: trainer.batch_size everywhere",
    )
    memory_fraction: float = Field(
        0.9, gt=0.05, le=1.0, description="batch_sizes=auto: peak memory a probe step may use"
    )
    shared_memory: bool = Field(
        True,
        description="ranks on the launcher's host exchange bulk tensors (cpu_* averages, final "
        "weights, checkpoints relayed) through /dev/shm instead of loopback TCP",
    )

    @field_validator("speeds")
    @classmethod
    def _speeds_valid(cls, v: list[float] | None) -> list[float] | None:
        return _check_speeds(v)

    @field_validator("batch_sizes")
    @classmethod
    def _batch_sizes_valid(cls, v: list[int] | str | None) -> list[int] | str | None:
        if isinstance(v, list) and (not v or any(b < 1 for b in v)):
            raise ValueError("must be a non-empty list of sizes >= 1, 'auto' or null")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ClusterConfig:
        if self.speeds is not None and len(self.speeds) != self.ranks:
            raise ValueError(f"speeds has {len(self.speeds)} entries but ranks={self.ranks}")
        sizes = self.batch_sizes
        if isinstance(sizes, list) and self.kind == "cpu_rig" and len(sizes) != self.ranks:
            raise ValueError(f"batch_sizes has {len(sizes)} entries but ranks={self.ranks}")
        if isinstance(sizes, list) and self.kind == "hosts":
            raise ValueError("kind=hosts: set batch_size on each worker instead of batch_sizes")
        if self.kind == "hosts" and not self.workers:
            raise ValueError("kind=hosts needs at least one entry in workers")
        if self.kind != "hosts" and self.workers:
            raise ValueError(f"workers are only read with kind=hosts (kind={self.kind})")
        if self.kind == "slurm" and self.slurm is None:
            raise ValueError("kind=slurm needs a slurm section (nodes, tasks_per_node, ...)")
        if self.kind == "hosts":
            if len({(w.host, w.ssh.port if w.ssh else None) for w in self.workers}) != len(
                self.workers
            ):
                raise ValueError("two workers name the same host: list each host once")
            if any(w.remote for w in self.workers) and self.controller.host in _LOCAL_HOSTS:
                raise ValueError(
                    "controller.host is loopback but workers are remote: set it to an address "
                    "the workers can reach"
                )
        return self

    def rank_speeds(self) -> list[float]:
        return list(self.speeds) if self.speeds is not None else [1.0] * self.ranks


class WandbConfig(_Schema):
    """Weights & Biases run (``pip install wandb``); offline by default: no network, no login."""

    project: str = Field("flodl", min_length=1, description="W&B project name")
    mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="offline writes <job>/wandb for a later `wandb sync`"
    )
    entity: str | None = Field(None, description="W&B team or user (online mode)")
    name: str | None = Field(None, description="run name (default: the job directory's name)")


class MlflowConfig(_Schema):
    """MLflow run (``pip install mlflow-skinny``) in a local file store by default."""

    tracking_uri: str | None = Field(
        None, description="tracking URI (default: a file store in <job>/mlruns)"
    )
    experiment: str = Field("flodl", min_length=1, description="MLflow experiment name")
    run_name: str | None = Field(None, description="run name (default: the job directory's name)")


class LoggerConfig(_Schema):
    """What the launcher writes and prints."""

    tensorboard: bool = Field(True, description="write TensorBoard event files under <job>/tb")
    csv: bool = Field(True, description="write every logged scalar to <job>/metrics.csv")
    wandb: WandbConfig | None = Field(None, description="also log to Weights & Biases")
    mlflow: MlflowConfig | None = Field(None, description="also log to MLflow")
    log_every_n_steps: int | None = Field(
        None, ge=1, description="log each rank's training loss and LR every N of its steps"
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="console level")
    progress: Literal["auto", "bar", "lines", "off"] = Field(
        "auto", description="progress bar on a terminal, epoch lines otherwise"
    )
    serve: int | None = Field(None, ge=0, le=65535, description="serve TensorBoard on this port")
    host: str = Field("127.0.0.1", description="address the dashboard binds")
    keep_serving: bool = Field(False, description="keep the dashboard up after the run ends")


class CallbackPolicy(_Schema):
    """Which rank runs eval/epoch callbacks: the fastest (default) or a fixed global rank."""

    kind: Literal["fastest", "rank"] = "fastest"
    rank: int = Field(0, ge=0)


class MonitorConfig(_Schema):
    """A quantity to watch: an eval metric name (``eval_loss``, ``accuracy``, ...) or
    ``train_loss``, and whether lower (``min``) or higher (``max``) is better."""

    monitor: str = Field("eval_loss", min_length=1, description="eval metric name or train_loss")
    mode: Literal["min", "max"] = Field("min", description="min: lower is better; max: higher")


class EarlyStoppingConfig(MonitorConfig):
    """Stop every rank once ``monitor`` has not improved for ``patience`` evaluated epochs."""

    patience: int = Field(3, ge=1, description="evaluated epochs without improvement to stop")
    min_delta: float = Field(0.0, ge=0, description="smallest change that counts as improvement")


class TrainerKnobs(_Schema):
    """Training-loop knobs: the ``trainer`` node of the Hydra config."""

    batch_size: int = Field(64, ge=1, description="per-rank batch size")
    num_epochs: int = Field(1, ge=1, description="passes over the dataset")
    seed: int = Field(42, ge=0, description="seeds model init and the per-epoch permutation")
    max_grad_norm: float | None = Field(None, gt=0, description="clip gradients to this L2 norm")

    @field_validator("max_failure", check_fields=False)
    @classmethod
    def _max_failure(cls, v: int | str | None) -> int | str | None:
        return _check_max_failure(v)

    @model_validator(mode="after")
    def _best_needs_path(self) -> TrainerKnobs:
        return _check_save_best(self)

    lr_scale_ratio: float = Field(
        1.0, ge=0, le=1, description="LR x (1 + (world-1) x ratio): 1 = linear rule, 0 = off"
    )
    eval_every: int = Field(1, ge=1, description="evaluate every N epochs (when eval is set)")
    callback_policy: CallbackPolicy = Field(default_factory=CallbackPolicy)
    eval_policy: Literal["elected", "sharded"] = Field(
        "elected", description="evaluate on the callback_policy rank, or 1/N on every rank"
    )
    early_stopping: EarlyStoppingConfig | None = Field(
        None, description="stop every rank when a metric stops improving"
    )
    save_best: MonitorConfig | None = Field(
        None, description="keep the best bundle as <save_path>_best beside the last"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="in-process device")
    save_path: str | None = Field(
        None, description="bundle stem (path or fsspec URL): <stem>.meta.json + shard files"
    )
    resume_from: str | None = Field(None, description="bundle stem to resume from")
    resume_fallback: bool = Field(
        False, description="resume from an older bundle when the newest is damaged (else: error)"
    )
    checkpoint_every: int | None = Field(None, ge=1, description="save every N epochs")

    @field_validator("save_path", "resume_from", check_fields=False)
    @classmethod
    def _stem_not_empty(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("empty: give a path or fsspec URL, or null")
        return v

    max_failure: int | str | None = Field(
        None, description="ranks that may be lost (count or 'N%') before save-and-stop; null: any"
    )
    max_nonfinite: int = Field(
        10, ge=0, description="NaN/inf losses skipped (with a warning) before the run stops"
    )
    precision: Literal["32", "bf16-mixed", "16-mixed"] = Field(
        "32", description="32 (fp32), bf16-mixed (autocast) or 16-mixed (fp16 + GradScaler, CUDA)"
    )
    accumulate_grad_batches: int = Field(
        1, ge=1, le=4096, description="micro-batches whose gradients make one optimizer step"
    )
    compile: bool = Field(False, description="torch.compile each rank's model for the step")

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


def _check_save_best(knobs: TrainerKnobs) -> TrainerKnobs:
    if knobs.save_best is not None and knobs.save_path is None:
        raise ValueError(
            "save_best needs trainer.save_path: the best bundle is written beside it as "
            "<save_path>_best"
        )
    return knobs


def _check_max_failure(v: int | str | None) -> int | str | None:
    if v is None:
        return v
    if isinstance(v, int):
        if v < 0:
            raise ValueError("must be >= 0 (a count) or a percentage like '50%'")
        return v
    text = v.strip()
    try:
        percent = float(text.removesuffix("%"))
    except ValueError:
        raise ValueError("must be a count like 1 or a percentage like '50%'") from None
    if not text.endswith("%") or not 0 <= percent <= 100:
        raise ValueError("must be a count like 1 or a percentage like '50%'")
    return text


TrainerKnobs.model_rebuild()


class TrainerConfig(TrainerKnobs):
    """The Python API's config bag: the loop knobs plus the ElChe, cluster and logger sections."""

    elche: ElCheConfig = Field(default_factory=ElCheConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)

    def with_(self, **updates: Any) -> TrainerConfig:
        """A validated copy with ``updates`` applied (``model_copy`` skips validation)."""
        return type(self).model_validate({**self.model_dump(), **updates})


class TargetConfig(_Schema):
    """A ``_target_`` reference plus its keyword arguments (extra keys are the kwargs)."""

    model_config = ConfigDict(frozen=True, extra="allow", populate_by_name=True)
    target: str = Field(alias="_target_", description="dotted path of a callable")

    @field_validator("target")
    @classmethod
    def _importable(cls, v: str) -> str:
        check_locatable(v)
        return v

    def kwargs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class SchedulerConfig(TargetConfig):
    """An LR scheduler reference; ``interval`` says how it advances (the rest are its kwargs)."""

    interval: Literal["step", "epoch"] = Field(
        "epoch",
        description="step: advanced on the global progress clock per optimizer step; "
        "epoch: stepped once per epoch",
    )


class TaskConfig(_Schema):
    """What one step and one evaluation mean for the chosen model."""

    train_step: str = Field(description="dotted path: fn(model, batch) -> loss")
    eval_fn: str | None = Field(
        None, description="dotted path: fn(model, input, target) -> the chunk's mean over samples"
    )
    metrics: dict[str, TargetConfig] = Field(
        default_factory=dict, description="name -> torchmetrics Metric (_target_ + kwargs)"
    )
    eval_loss: str | None = Field(
        None, description="dotted path: fn(preds, target) -> mean loss, reported as eval_loss"
    )
    eval_step: str | None = Field(
        None, description="dotted path: fn(model, batch) -> (preds, target) (default: model(x), y)"
    )
    eval_metric: str = Field("accuracy", description="the eval metric summaries call eval_value")
    eval_higher_is_better: bool = Field(True, description="direction of the eval metric")
    objective: str = Field(
        "auto",
        min_length=1,
        description="a job's return value for optimizing sweepers: auto (final eval value, "
        "else final loss), eval, loss, or a numeric summary.json key (dots reach nested keys)",
    )
    objective_direction: Literal["auto", "minimize", "maximize"] = Field(
        "auto", description="direction of the objective (auto: the eval metric's, loss: minimize)"
    )
    metrics_fn: str | None = Field(
        None, description="dotted path: fn(EpochMetrics), launcher; a truthy return stops the run"
    )
    eval_result_fn: str | None = Field(None, description="dotted path: fn(epoch, value), launcher")
    epoch_fn: str | None = Field(None, description="dotted path: fn(epoch), launcher")

    @field_validator(
        "train_step",
        "eval_fn",
        "eval_loss",
        "eval_step",
        "metrics_fn",
        "eval_result_fn",
        "epoch_fn",
    )
    @classmethod
    def _importable(cls, v: str | None) -> str | None:
        if v is not None:
            check_locatable(v)
        return v

    @property
    def has_eval(self) -> bool:
        return self.eval_fn is not None or self.eval_loss is not None or bool(self.metrics)

    @property
    def eval_names(self) -> list[str]:
        """Names of the eval metrics this task reports (``eval_loss`` is the eval loss)."""
        names = ["eval_loss"] if self.eval_loss is not None else []
        if self.eval_fn is not None:
            names.append(self.eval_metric)
        return names + [n for n in self.metrics if n not in names]

    @model_validator(mode="after")
    def _metric_named(self) -> TaskConfig:
        if "eval_loss" in self.metrics:
            raise ValueError("metrics.eval_loss: the name is taken by the eval loss; rename it")
        if self.has_eval and self.eval_metric not in self.eval_names:
            raise ValueError(
                f"eval_metric={self.eval_metric}: not one of the eval metrics "
                f"({', '.join(self.eval_names)}); name one of them"
            )
        return self


class RunConfig(_Schema):
    """The composed Hydra config (``conf/config.yaml``), validated once in the launcher."""

    model: TargetConfig
    optimizer: TargetConfig
    dataset: TargetConfig
    task: TaskConfig
    scheduler: SchedulerConfig | None = Field(
        None, description="per-rank LR scheduler (total_steps: auto = the run's length)"
    )
    trainer: TrainerKnobs = Field(default_factory=TrainerKnobs)
    elche: ElCheConfig = Field(default_factory=ElCheConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    experiment: str | None = Field(None, description="name of the experiment overlay, if any")

    @model_validator(mode="after")
    def _monitors_known(self) -> RunConfig:
        known = ["train_loss", *self.task.eval_names]
        for key in ("early_stopping", "save_best"):
            watch = getattr(self.trainer, key)
            if watch is not None and watch.monitor not in known:
                raise ValueError(
                    f"trainer.{key}.monitor={watch.monitor}: not a metric of this task; "
                    f"one of {', '.join(known)}"
                )
        return self

    def trainer_config(self) -> TrainerConfig:
        """The Python API's config bag: trainer knobs with the sibling sections folded in."""
        return TrainerConfig(
            **dict(self.trainer),
            elche=self.elche,
            cluster=self.cluster,
            logger=self.logger,
            loader=self.loader,
        )

    def digest(self) -> str:
        """Stable hash of the resolved config (goes into checkpoint metadata)."""
        blob = json.dumps(self.model_dump(mode="json", by_alias=True), sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def resolve_dotted(path: str) -> Any:
    """Import ``pkg.module.attr`` and return the attribute, with an error that says what failed."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{path!r} is not a dotted path like 'package.module.name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} ({exc})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None


def check_locatable(path: str) -> None:
    """What validation can say about ``pkg.module.attr`` without importing anything: the module
    exists; the attribute is checked only when the module is already imported. Importing targets
    to validate them would import torch and torchmetrics (~2 s) before a pure-config refusal; the
    launcher resolves every target later (:mod:`flodl.preflight`), naming its key."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{path!r} is not a dotted path like 'package.module.name'")
    module = sys.modules.get(module_name)
    if module is not None:
        if not hasattr(module, attr):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
    elif not _module_found(module_name):
        resolve_dotted(path)  # not found on disk: the real import says why (or finds it after all)


def defined_in_source(path: str) -> bool:
    """Whether ``pkg.module.attr`` is found without importing anything: the module's source on
    the import path binds ``attr`` at its top level (a class, a function, an import, an
    assignment; inside ``if`` / ``try`` blocks too). False when that cannot be told so (no
    source, a module ``__getattr__``, a star import): the caller then imports it."""
    module_name, _, attr = path.rpartition(".")
    spec = _module_spec(module_name) if module_name else None
    if spec is None or not spec.origin or not str(spec.origin).endswith(".py"):
        return False
    try:
        tree = ast.parse(Path(spec.origin).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False
    return attr in _top_level_names(tree.body)


def _top_level_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            handlers = getattr(node, "handlers", [])
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                names |= _top_level_names(block)
            for handler in handlers:
                names |= _top_level_names(handler.body)
    return names


def _module_found(name: str) -> bool:
    """Whether ``name`` is on the import path, found without executing any package's code
    (``importlib.util.find_spec`` would import every parent package)."""
    return _module_spec(name) is not None


def _module_spec(name: str) -> Any:
    search: Any = None
    parts = name.split(".")
    spec = None
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        loaded = sys.modules.get(prefix)
        try:
            spec = loaded.__spec__ if loaded is not None else _find(prefix, search)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        search = spec.submodule_search_locations
        if search is None and depth < len(parts):
            return None  # a plain module has no submodules
    return spec


def _find(name: str, search: Any) -> Any:
    if search is None:  # top level: every finder on sys.meta_path (editable installs included)
        return importlib.util.find_spec(name)
    return importlib.machinery.PathFinder.find_spec(name, list(search))


def _format_location(loc: tuple[Any, ...], prefix: str) -> str:
    parts = [str(p) for p in loc if not str(p).startswith("function-after")]
    key = ".".join(p for p in parts if p)
    return f"{prefix}.{key}" if prefix and key else (key or prefix)


def _lookup(data: Any, loc: tuple[Any, ...]) -> Any:
    for part in loc:
        if (isinstance(data, Mapping) and part in data) or (
            isinstance(data, list) and isinstance(part, int) and part < len(data)
        ):
            data = data[part]
        else:
            return None
    return data


def explain(exc: ValidationError, data: Any, prefix: str = "") -> ConfigError:
    """Turn a pydantic error into one line: ``key=value: what is allowed``."""
    err = exc.errors()[0]
    loc = tuple(err["loc"])
    key = _format_location(loc, prefix)
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        return ConfigError(f"{key}: unknown key (check the spelling; see conf/ for valid keys)")
    if err["type"] == "missing":
        return ConfigError(f"{key}: required key is missing")
    value = _lookup(data, loc)
    if err["type"] == "value_error" and (isinstance(value, Mapping) or not key):
        # A check across a section's keys: its message names the key; no dump of the section.
        named = re.match(r"[A-Za-z_][\w.]*=", msg) is not None
        return ConfigError(msg if not key else f"{key}.{msg}" if named else f"{key}: {msg}")
    shown = json.dumps(value) if isinstance(value, (list, dict)) else value
    return ConfigError(f"{key}={shown}: {msg}")


def validate_run_config(data: Mapping[str, Any]) -> RunConfig:
    """Validate a composed, resolved config; raise :class:`ConfigError` on the first fault."""
    try:
        return RunConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise explain(exc, data) from None


def validate_trainer_config(data: Mapping[str, Any]) -> TrainerConfig:
    try:
        return TrainerConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise explain(exc, data, "trainer") from None
