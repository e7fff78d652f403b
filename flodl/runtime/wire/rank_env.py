"""The one place that reads (and writes) the rank role environment.

A rank process learns who it is from ``FLODL_*`` variables set by our launcher, or from the
torchrun/SLURM variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) when another launcher placed it. Each entry point reads them here once into a
frozen value and passes it down: :class:`RankEnv` (a rank our launcher started),
:class:`ExternalRole` (a process torchrun, srun or submitit placed) or :class:`TorchrunVars`
(the bypass tier, :mod:`flodl.ddp`). No other module of ``flodl/`` reads ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``GROUP_RANK``,
``ROLE_RANK``, ``TORCHELASTIC_*``, ``SLURM_*`` or the ``FLODL_*`` role variables below
(``tests/unit/test_import_graph.py`` fails when one does). The per-run secret never travels in
the environment or on a command line: it arrives on stdin.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ROLE = "FLODL_ROLE"
RANK = "FLODL_RANK"
WORLD_SIZE = "FLODL_WORLD_SIZE"
CONTROLLER = "FLODL_CONTROLLER"  # host:port of the control plane
DEVICE = "FLODL_DEVICE"  # "cpu" or "cuda"
LIFELINE = "FLODL_LIFELINE"  # "1": stdin stays open; its EOF means the launcher is gone
PLACED_BY = "FLODL_PLACED_BY"  # who placed an external rank ("torchrun" unless told)
RENDEZVOUS_FILE = "FLODL_RENDEZVOUS_FILE"  # SLURM rank0 mode: where rank 0 publishes itself
SECRET_FILE = "FLODL_SECRET_FILE"  # external placement: a file holding the control-plane secret
CHAOS = "FLODL_CHAOS"  # test-only fault injection (flodl/runtime/wire/chaos.py); unset in real runs


@dataclass(frozen=True)
class RankEnv:
    """A rank our launcher (or a placed rank 0) runs: who it is and where the controller is."""

    rank: int
    world_size: int
    controller_host: str
    controller_port: int
    device: str
    local_rank: int = 0  # CUDA device index when the process sees every GPU of its host
    lifeline: bool = False  # stdin stays open after the secret; its EOF: the launcher is gone


@dataclass(frozen=True)
class ExternalRole:
    """A process another launcher placed (torchrun, srun, submitit): who it is, where rank 0 is."""

    launcher: str  # "torchrun", "srun" or "submitit"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    device: str  # "cuda" when this host has a GPU for LOCAL_RANK, else "cpu"
    single_host: bool | None = None  # every rank on this host (None: the launcher did not say)
    run_id: str = "none"  # the placing launcher's job id (TORCHELASTIC_RUN_ID, SLURM_JOB_ID)
    agent_store: bool = False  # torchrun's agent serves the store at MASTER_ADDR:MASTER_PORT
    restart: str = "0"  # torchrun's restart count (its store outlives a restart)
    secret_file: str | None = None  # FLODL_SECRET_FILE: where every rank reads the secret
    rendezvous_file: str | None = None  # our SLURM launcher's rank0 mode: where rank 0 publishes

    @property
    def is_controller(self) -> bool:
        """Rank 0 hosts the controller beside its own worker."""
        return self.rank == 0


def external_role(environ: Mapping[str, str] | None = None) -> ExternalRole | None:
    """The torchrun / SLURM placement of this process, or ``None`` when nobody placed it.

    torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``;
    under ``srun`` the rank comes from ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` and
    ``MASTER_ADDR`` / ``MASTER_PORT`` are exported by the batch script. A process our own launcher
    started (``FLODL_ROLE``) is never external.
    """
    env = os.environ if environ is None else environ
    if env.get(ROLE):
        return None
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = env.get(PLACED_BY, "torchrun")
        rank, world, local = env["RANK"], env["WORLD_SIZE"], env.get("LOCAL_RANK", "0")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env and _srun_step(env):
        launcher = "srun"
        rank, world = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        local = env.get("SLURM_LOCALID", "0")
        env = {**env, **_slurm_master(env)}
    else:
        return None
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise RuntimeError(f"{launcher} placement without {', '.join(missing)} in the environment")
    try:
        role = ExternalRole(
            launcher=launcher,
            rank=int(rank),
            world_size=int(world),
            local_rank=int(local),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            device=env.get(DEVICE) or _external_device(int(local)),
            single_host=_single_host(env, launcher, int(world)),
            run_id=env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "none",
            agent_store=_flag(env.get("TORCHELASTIC_USE_AGENT_STORE")),
            restart=env.get("TORCHELASTIC_RESTART_COUNT", "0"),
            secret_file=env.get(SECRET_FILE) or None,
            rendezvous_file=env.get(RENDEZVOUS_FILE) or None,
        )
    except ValueError as exc:
        raise RuntimeError(f"bad {launcher} environment: {exc}") from None
    if not 0 <= role.rank < role.world_size:
        raise RuntimeError(
            f"bad {launcher} environment: RANK={role.rank} WORLD_SIZE={role.world_size}"
        )
    return role


def placed_cohort(role: ExternalRole | None, solo: bool = False) -> bool:
    """Whether another launcher placed this process as one rank of a cohort of several
    (``solo``: the job trains on rank 0 alone, so the placement forms no cohort)."""
    return role is not None and role.world_size > 1 and not solo


def is_follower(role: ExternalRole | None) -> bool:
    """Whether this process is a follower: a rank other than 0 of a placed cohort, which trains
    as a worker of rank 0's jobs and never runs a job itself. The one place this is decided
    (the Hydra launcher and ``Trainer.run`` both ask here)."""
    return placed_cohort(role) and role is not None and not role.is_controller


def submitit_role(task: Any, rendezvous_file: str) -> ExternalRole:
    """A task of our own SLURM launcher's ``controller: rank0`` job, from submitit's
    ``JobEnvironment`` (which reads SLURM's variables): rank 0 publishes itself in
    ``rendezvous_file``, the other tasks read it there."""
    return ExternalRole(
        launcher="submitit",
        rank=int(task.global_rank),
        world_size=int(task.num_tasks),
        local_rank=int(task.local_rank),
        master_addr=str(task.hostnames[0]),
        master_port=0,  # unused: the rendezvous file says where rank 0 listens
        device=os.environ.get(DEVICE) or _external_device(int(task.local_rank)),
        single_host=len(set(task.hostnames)) == 1,
        run_id=str(task.job_id),
        rendezvous_file=rendezvous_file,
    )


def _flag(value: str | None) -> bool:
    """A boolean environment variable as torch writes them (``True``; ``true``, ``1`` too)."""
    return (value or "").strip().lower() in ("true", "1")


def _single_host(env: Mapping[str, str], launcher: str, world_size: int) -> bool | None:
    """Whether the placing launcher put every rank on this host: torchrun's LOCAL_WORLD_SIZE,
    SLURM's node count."""
    if launcher != "srun" and env.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(env["LOCAL_WORLD_SIZE"]) == world_size
    for key in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if env.get(key, "").isdigit():
            return int(env[key]) == 1
    return None


def _srun_step(env: Mapping[str, str]) -> bool:
    """Tasks of an ``srun`` step (a batch script itself has no step id): placed, even when the
    script exported no MASTER_ADDR. One task alone is no cohort."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return "MASTER_ADDR" in env or (step is not None and env.get("SLURM_NTASKS", "1") != "1")


def _slurm_master(env: Mapping[str, str]) -> dict[str, str]:
    """MASTER_ADDR / MASTER_PORT as Lightning's SLURMEnvironment derives them: the first node of
    the step's node list, and 15000 + the job id's last four digits."""
    from flodl.placement.hostlist import root_node

    derived: dict[str, str] = {}
    if not env.get("MASTER_ADDR"):
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or ""
        if not nodes:
            raise RuntimeError(
                "srun placement without MASTER_ADDR and without SLURM_NODELIST: export "
                "MASTER_ADDR (rank 0's host) in the batch script"
            )
        try:
            derived["MASTER_ADDR"] = root_node(nodes)
        except ValueError as exc:
            raise RuntimeError(f"srun placement without MASTER_ADDR: {exc}; export it") from None
    if not env.get("MASTER_PORT"):
        job = env.get("SLURM_JOB_ID", "")
        if not job[-4:].isdigit():
            raise RuntimeError("srun placement without MASTER_PORT or SLURM_JOB_ID: export it")
        derived["MASTER_PORT"] = str(15000 + int(job[-4:]))
    return derived


def _external_device(local_rank: int) -> str:
    from flodl.placement.gpus import detect_gpus  # reads nvidia-smi / KFD: CUDA stays untouched

    return "cuda" if len(detect_gpus()) > local_rank else "cpu"


def is_rank_process(environ: Mapping[str, str] | None = None) -> bool:
    """True in a process our launcher started as a rank (the cooperative tier re-executes)."""
    return (os.environ if environ is None else environ).get(ROLE) == "rank"


def rank_env(environ: Mapping[str, str] | None = None) -> RankEnv:
    """Read this rank's identity; raise ``RuntimeError`` with the missing variable named."""
    env = os.environ if environ is None else environ
    try:
        host, _, port = env[CONTROLLER].rpartition(":")
        return RankEnv(
            rank=int(env.get(RANK, env.get("RANK", ""))),
            world_size=int(env.get(WORLD_SIZE, env.get("WORLD_SIZE", ""))),
            controller_host=host,
            controller_port=int(port),
            device=env.get(DEVICE, "cpu"),
            lifeline=env.get(LIFELINE) == "1",
        )
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"not started as a flodl rank: bad or missing {exc}") from None


@dataclass(frozen=True)
class TorchrunVars:
    """torchrun's variables as the bypass tier (:meth:`flodl.ddp.Rendezvous.from_env`) takes
    them: unchecked beyond being set and integers (the rendezvous checks ranges)."""

    master_addr: str
    master_port: int
    world_size: int
    rank: int
    local_rank: int | None  # LOCAL_RANK when set
    agent_store: bool  # TORCHELASTIC_USE_AGENT_STORE: torchrun's agent serves the store


def torchrun_vars(environ: Mapping[str, str] | None = None) -> TorchrunVars:
    """Read ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` (and ``LOCAL_RANK``);
    raise ``RuntimeError`` naming a missing or malformed one."""
    env = os.environ if environ is None else environ
    return TorchrunVars(
        master_addr=_required(env, "MASTER_ADDR"),
        master_port=_required_int(env, "MASTER_PORT"),
        world_size=_required_int(env, "WORLD_SIZE"),
        rank=_required_int(env, "RANK"),
        local_rank=_required_int(env, "LOCAL_RANK") if env.get("LOCAL_RANK") else None,
        agent_store=_flag(env.get("TORCHELASTIC_USE_AGENT_STORE")),
    )


def _required(env: Mapping[str, str], name: str) -> str:
    value = env.get(name)
    if not value:
        raise RuntimeError(
            f"{name} is not set: start this process under torchrun, or build the rendezvous "
            "with Rendezvous.tcp(host, port, world_size, is_host)"
        )
    return value


def _required_int(env: Mapping[str, str], name: str) -> int:
    value = _required(env, name)
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"{name}={value!r}: must be an integer") from None


def role_env(rank: int, world_size: int, controller: str, device: str, gpu: int | None) -> dict:
    """Just the role variables of a rank (what a remote rank gets besides its worker's env)."""
    env = {
        ROLE: "rank",
        RANK: str(rank),
        WORLD_SIZE: str(world_size),
        CONTROLLER: controller,
        DEVICE: device,
        "PYTHONUNBUFFERED": "1",
    }
    if os.environ.get(CHAOS):  # a test's fault injection reaches remote ranks too
        env[CHAOS] = os.environ[CHAOS]
    if gpu is not None:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


def child_env(rank: int, world_size: int, controller: str, device: str, gpu: int | None) -> dict:
    """The environment of a local rank child: ours plus its role; one visible GPU when on CUDA."""
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a launcher inside a torchrun-placed process must not leak its role
    env.update(role_env(rank, world_size, controller, device, gpu))
    # The child imports what the parent imports (user modules, recipes, the project).
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def chaos_spec(environ: Mapping[str, str] | None = None) -> str:
    """The fault-injection spec of this process (empty: no chaos)."""
    return (os.environ if environ is None else environ).get(CHAOS, "")


def read_secret(stream=None) -> bytes:
    """The per-run secret, hex on the first line of stdin."""
    line = (stream or sys.stdin).readline().strip()
    if not line:
        raise RuntimeError("no secret on stdin: rank processes are started by the flodl launcher")
    return bytes.fromhex(line)
