"""A rank process: ``python -m flodl.runtime.rank`` (managed tier) or a re-executed user script
that called ``into_worker()`` (cooperative tier).

Reads its role from the environment and the secret from stdin, joins the control plane, receives
the job, joins the data plane, and trains. Any failure is reported to the controller as one line
(the traceback goes to ``rank_N.log`` only) before the process exits non-zero.
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
from functools import partial
from typing import Any

from flodl.runtime import env as rank_env
from flodl.runtime.channel import Channel, connect
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


def _connect() -> tuple[rank_env.RankEnv, Channel]:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _die_with_parent()
    role = rank_env.rank_env()
    secret = rank_env.read_secret()
    channel = connect(role.controller_host, role.controller_port, secret)
    channel.send(Hello(rank=role.rank, pid=os.getpid(), host=socket.gethostname()))
    return role, channel


def report_failure(channel: Channel, rank: int, exc: BaseException) -> None:
    """One line to the controller; the traceback to this rank's log only."""
    message = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        channel.send(RankError(rank, message, trace))
    except OSError:
        pass
    for line in trace.splitlines():
        print(f"DEBUG traceback| {line}", flush=True)


def join(channel: Channel, role: rank_env.RankEnv) -> tuple[Any, Any, Any]:
    """Receive the job, pin threads and device, join the process group: (spec, link, device)."""
    import torch
    import torch.distributed as dist

    from flodl.runtime.links import SocketLink

    spec = channel.recv()
    cluster = spec.config.cluster
    if role.device == "cpu":
        torch.set_num_threads(cluster.threads_per_rank)
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    link = SocketLink(channel, role.rank)
    store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, use_libuv=False)
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=role.rank,
        world_size=role.world_size,
        timeout=timedelta(seconds=cluster.start_timeout_s),
    )
    return spec, link, device


def regroup(spec: Any, role: rank_env.RankEnv, members: tuple[int, ...], generation: int) -> None:
    """Re-form the process group over the survivors, under a fresh store prefix."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if len(members) < 2:
        return  # a lone survivor trains on alone
    store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, use_libuv=False)
    dist.init_process_group(
        spec.backend,
        store=dist.PrefixStore(f"generation{generation}", store),
        rank=members.index(role.rank),
        world_size=len(members),
        timeout=timedelta(seconds=spec.config.cluster.start_timeout_s),
    )


def leave(link: Any) -> None:
    import torch.distributed as dist

    link.stopping = True  # from here on, a closed channel is expected, not a lost launcher
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> int:
    """The managed tier: run the controller's plans until it says stop."""
    role, channel = _connect()
    link = None
    try:
        from flodl.runtime.worker import Worker

        spec, link, device = join(channel, role)
        Worker(spec, link, role.rank, device, regroup=partial(regroup, spec, role)).run()
        return 0
    except BaseException as exc:
        report_failure(channel, role.rank, exc)
        return 1
    finally:
        if link is not None:
            leave(link)
        channel.close()


def cooperative_worker() -> Any:
    """The cooperative tier on a re-executed rank: join, build, and hand the loop to the user."""
    from flodl.cooperative import CooperativeWorker, exit_rank
    from flodl.runtime.worker import Worker

    role, channel = _connect()
    previous_hook = sys.excepthook

    def on_uncaught(kind, exc, tb) -> None:  # the user's loop raised: tell the controller
        report_failure(channel, role.rank, exc)
        previous_hook(kind, exc, tb)

    sys.excepthook = on_uncaught
    try:
        spec, link, device = join(channel, role)
        core = Worker(spec, link, role.rank, device, regroup=partial(regroup, spec, role))
        core.start()
    except BaseException as exc:
        report_failure(channel, role.rank, exc)
        channel.close()
        exit_rank(1)

    def finish() -> None:
        leave(link)
        channel.close()
        exit_rank(0)

    return CooperativeWorker(core, finish_hook=finish)


if __name__ == "__main__":
    sys.exit(main())
