"""The one place that reads (and writes) the rank role environment.

A rank process learns who it is from ``FLODL_*`` variables set by our launcher, or from the
torchrun/SLURM variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) when another launcher placed it. The per-run secret never travels in the
environment or on a command line: it arrives on stdin.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

ROLE = "FLODL_ROLE"
RANK = "FLODL_RANK"
WORLD_SIZE = "FLODL_WORLD_SIZE"
CONTROLLER = "FLODL_CONTROLLER"  # host:port of the control plane
DEVICE = "FLODL_DEVICE"  # "cpu" or "cuda"


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    controller_host: str
    controller_port: int
    device: str


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
        )
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"not started as a flodl rank: bad or missing {exc}") from None


def child_env(rank: int, world_size: int, controller: str, device: str, gpu: int | None) -> dict:
    """The environment of a rank child: ours plus its role; one visible GPU when on CUDA."""
    env = dict(os.environ)
    env.update(
        {
            ROLE: "rank",
            RANK: str(rank),
            WORLD_SIZE: str(world_size),
            CONTROLLER: controller,
            DEVICE: device,
            "PYTHONUNBUFFERED": "1",
            # The child imports what the parent imports (user modules, recipes, the project).
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        }
    )
    if gpu is not None:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return env


def read_secret(stream=None) -> bytes:
    """The per-run secret, hex on the first line of stdin."""
    line = (stream or sys.stdin).readline().strip()
    if not line:
        raise RuntimeError("no secret on stdin: rank processes are started by the flodl launcher")
    return bytes.fromhex(line)
