"""Entry point of a rank process: ``python -m flodl.runtime.rank`` (started by the launcher).

Reads its role from the environment and the secret from stdin, joins the control plane, receives
the job, joins the data plane, and runs the worker loop. Any failure is reported to the
controller as one line before the process exits non-zero.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import traceback
from datetime import timedelta

from flodl.runtime import env as rank_env
from flodl.runtime.channel import connect
from flodl.runtime.messages import Hello, RankError

log = logging.getLogger("flodl.rank")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the launcher dies (the control channel is the backstop)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass


def _device(kind: str):
    import torch

    return torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _die_with_parent()
    role = rank_env.rank_env()
    secret = rank_env.read_secret()
    channel = connect(role.controller_host, role.controller_port, secret)
    try:
        channel.send(Hello(rank=role.rank, pid=os.getpid(), host=socket.gethostname()))
        spec = channel.recv()
        return _train(spec, channel, role)
    except BaseException as exc:
        message = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        try:
            channel.send(RankError(role.rank, message, traceback.format_exc()))
        except OSError:
            pass
        # The launcher reports the one-line message; the traceback goes to rank_N.log only.
        for line in traceback.format_exc().splitlines():
            print(f"DEBUG traceback| {line}", flush=True)
        return 1
    finally:
        channel.close()


def _train(spec, channel, role) -> int:
    import torch

    from flodl.runtime.links import SocketLink

    cluster = spec.config.cluster
    if role.device == "cpu":
        torch.set_num_threads(cluster.threads_per_rank)
    device = _device(role.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    link = SocketLink(channel, role.rank)
    try:
        _join_and_train(spec, link, role, device)
    finally:
        link.stopping = True  # from here on, a closed channel is expected, not a lost launcher
    return 0


def _join_and_train(spec, link, role, device) -> None:
    import torch.distributed as dist

    from flodl.runtime.worker import Worker

    cluster = spec.config.cluster
    store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, use_libuv=False)
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=role.rank,
        world_size=role.world_size,
        timeout=timedelta(seconds=cluster.start_timeout_s),
    )
    try:
        Worker(spec, link, role.rank, device).run()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
