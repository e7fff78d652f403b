"""``cluster``: where ranks run (the CPU rig, GPUs, hosts, SLURM) and the controller's address."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from flodl.config.base import _Schema
from flodl.config.loader import LoaderOverride


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


_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")

#: The rig's link profiles (figures in flodl/rig/links.py); ``none``: loopback, nothing charged.
LinkProfile = Literal["none", "nvlink", "pcie_no_p2p", "10gbe", "1gbe"]


class LinkConfig(_Schema):
    """What the rig charges for moving bytes: a named profile, its figures replaced by explicit
    ones, and (host clusters) the link between hosts. ``cluster.link=1gbe`` is shorthand for
    ``{profile: 1gbe}``."""

    profile: LinkProfile = Field("none", description="the wire every collective crosses")
    bandwidth_gbps: float | None = Field(
        None, gt=0, le=1e5, allow_inf_nan=False, description="Gbit/s per direction (replaces)"
    )
    latency_ms: float | None = Field(
        None, ge=0, le=1e4, allow_inf_nan=False, description="per message or ring hop (replaces)"
    )
    between_hosts: LinkProfile | None = Field(
        None, description="hosts clusters: the wire between hosts (collectives then cross it)"
    )

    @model_validator(mode="after")
    def _figures_need_a_wire(self) -> LinkConfig:
        if self.profile == "none" and self.latency_ms is not None and self.bandwidth_gbps is None:
            raise ValueError("link.latency_ms without a profile or bandwidth_gbps: set either")
        return self

    @property
    def charged(self) -> bool:
        return self.profile != "none" or self.bandwidth_gbps is not None or bool(self.between_hosts)


#: The elements a memory plan combines (flodl/step/plan_elements.py): activations recomputed in
#: backward, the optimizer's state and step on the host, the optimizer's state sharded across the
#: ranks in proportion to their free memory (nccl_sync only: runtime/sync/sharded_optimizer.py).
PLAN_ELEMENTS = ("recompute", "offload", "shard")


def parse_memory_plan(plan: str) -> tuple[str, ...] | None:
    """``auto`` -> None (probed); ``none`` -> (); ``recompute+offload`` -> its elements."""
    text = plan.strip().lower()
    if text == "auto":
        return None
    if text == "none":
        return ()
    parts = tuple(p.strip() for p in text.split("+"))
    unknown = [p for p in parts if p not in PLAN_ELEMENTS]
    if unknown or len(set(parts)) != len(parts):
        raise ValueError(
            f"memory plan {plan!r}: use auto, none, or a '+'-joined set of "
            f"{', '.join(PLAN_ELEMENTS)} (e.g. recompute+offload)"
        )
    if "offload" in parts and "shard" in parts:
        raise ValueError(
            f"memory plan {plan!r}: shard and offload do not combine (sharded state on the "
            "host is not built); use shard (a share of the state on each device) or offload "
            "(all of it on the host)"
        )
    return tuple(e for e in PLAN_ELEMENTS if e in parts)


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
    link: LinkProfile | None = Field(
        None,
        description="the rig's link model: this host's link to the others (two hosts talk at "
        "the slower of their links); null: cluster.link.between_hosts",
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
    start_timeout_s: float = Field(
        120.0, ge=1.0, le=86400.0, description="seconds for every rank to join, in [1, 86400]"
    )
    heartbeat_timeout_s: float = Field(
        30.0,
        ge=0.1,
        le=3600.0,
        description="a rank silent this long is dropped as lost, in [0.1, 3600] s",
    )
    batch_sizes: list[int] | Literal["auto"] | None = Field(
        None,
        description="per-rank batch sizes (memory-unequal devices); auto: probed per CUDA rank; "
        "null: trainer.batch_size everywhere",
    )
    memory_fraction: float = Field(
        0.9, gt=0.05, le=1.0, description="batch_sizes=auto: peak memory a probe step may use"
    )
    memory_mb: float | list[float] | None = Field(
        None,
        description="cpu_rig: each rank's simulated device memory in MB (one value, or one per "
        "rank); a rank over it fails with torch.OutOfMemoryError, as a GPU does",
    )
    memory_plan: str | list[str] = Field(
        "auto",
        description="what a rank gives up to fit its device memory: auto (probed at start where "
        "a budget exists: memory_mb on the rig, CUDA), none, or a '+'-joined set of recompute "
        "(activation checkpointing), offload (optimizer state on host) and shard (nccl_sync: "
        "optimizer state split across ranks by free memory); one, or one per rank",
    )
    link: LinkConfig = Field(
        default_factory=LinkConfig,
        description="the rig's link model: none, nvlink, pcie_no_p2p, 10gbe, 1gbe (or a dict)",
    )
    shared_memory: bool = Field(
        True,
        description="ranks on the launcher's host exchange bulk tensors (cpu_* averages, final "
        "weights, checkpoints relayed) through /dev/shm instead of loopback TCP",
    )

    @field_validator("link", mode="before")
    @classmethod
    def _link_shorthand(cls, v: Any) -> Any:
        return {"profile": v} if isinstance(v, str) else v

    @field_validator("speeds")
    @classmethod
    def _speeds_valid(cls, v: list[float] | None) -> list[float] | None:
        return _check_speeds(v)

    @field_validator("memory_mb")
    @classmethod
    def _memory_valid(cls, v: float | list[float] | None) -> float | list[float] | None:
        values = v if isinstance(v, list) else [] if v is None else [v]
        if isinstance(v, list) and not v:
            raise ValueError("must be a number of MB, one per rank, or null")
        if any(not math.isfinite(m) or m <= 0 for m in values):
            raise ValueError("must be finite numbers of MB > 0")
        return v

    @field_validator("memory_plan")
    @classmethod
    def _memory_plan_valid(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("must be a plan or one plan per rank")
        for plan in v if isinstance(v, list) else [v]:
            parse_memory_plan(plan)
        return v

    def rank_memory_plan(self, rank: int) -> str:
        """``rank``'s memory plan as configured: auto, none, or elements joined by '+'."""
        if isinstance(self.memory_plan, list):
            return self.memory_plan[rank] if rank < len(self.memory_plan) else "auto"
        return self.memory_plan

    def plans_shard(self) -> bool:
        """Whether some rank's plan asks for ``shard`` explicitly."""
        plans = self.memory_plan if isinstance(self.memory_plan, list) else [self.memory_plan]
        return any("shard" in (parse_memory_plan(p) or ()) for p in plans)

    def plans_choose_batches(self) -> bool:
        """Whether an ``auto`` plan may lower a rank's batch (the rig with ``memory_mb``)."""
        return self.memory_mb is not None and any(
            self.rank_memory_plan(r).strip().lower() == "auto" for r in range(self.ranks)
        )

    def rank_memory_mb(self, rank: int) -> float | None:
        """``rank``'s simulated device memory (cpu_rig), None when unlimited."""
        if isinstance(self.memory_mb, list):
            return self.memory_mb[rank] if rank < len(self.memory_mb) else None
        return self.memory_mb

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
        if self.memory_mb is not None and self.kind != "cpu_rig":
            raise ValueError(
                f"memory_mb simulates device memory on the CPU rig (kind={self.kind}: a real "
                "device has its own)"
            )
        if isinstance(self.memory_mb, list) and len(self.memory_mb) != self.ranks:
            raise ValueError(f"memory_mb has {len(self.memory_mb)} entries but ranks={self.ranks}")
        plans = self.memory_plan
        if isinstance(plans, list) and self.kind == "cpu_rig" and len(plans) != self.ranks:
            raise ValueError(f"memory_plan has {len(plans)} entries but ranks={self.ranks}")
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
