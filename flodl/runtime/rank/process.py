"""A rank process: ``python -m flodl.runtime.rank`` (managed tier) or a re-executed user script
that called ``into_worker()`` (cooperative tier).

Reads its role from the environment and the secret from stdin, joins the control plane, receives
the job, joins the data plane, and trains. Any failure is reported to the controller as one line
(the traceback goes to ``rank_N.log`` only) before the process exits non-zero.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any, NoReturn

from flodl.runtime.rank import blame
from flodl.runtime.sync import groups
from flodl.runtime.wire import chaos, rank_env
from flodl.runtime.wire.channel import Channel, connect
from flodl.runtime.wire.messages import Abort, Hello, RankError
from flodl.runtime.wire.store import join_store

log = logging.getLogger("flodl.rank")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL us when the launcher dies (the control channel is the backstop)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass


def _watch_lifeline() -> None:
    """A remote rank: stdin stays open after the secret; EOF means the launcher (or its ssh link)
    is gone, so this rank and its children go too. ``ssh -T`` delivers no SIGHUP to do it."""

    def watch() -> None:
        try:
            while sys.stdin.readline():
                pass
        except (OSError, ValueError):
            pass
        print("WARNING launcher gone (its ssh link closed): exiting", flush=True)
        try:
            if os.getpgid(0) == os.getpid():
                os.killpg(os.getpid(), signal.SIGTERM)  # our process group: loader workers too
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="flodl-lifeline", daemon=True).start()


def _start() -> tuple[rank_env.RankEnv, bytes]:
    """A process our launcher started: logging, parent-death signal, role, secret, lifeline."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _die_with_parent()

    role = rank_env.rank_env()
    secret = rank_env.read_secret()
    if role.lifeline:
        _watch_lifeline()
    return role, secret


def _hello(role: rank_env.RankEnv, secret: bytes) -> Channel:
    channel = connect(role.controller_host, role.controller_port, secret)
    log.info(
        "rank %d: bulk tensors to and from the launcher go %s",
        role.rank,
        "through shared memory" if channel.shm is not None else "over TCP",
    )
    channel.send(Hello(rank=role.rank, pid=os.getpid(), host=socket.gethostname()))
    return channel


def report_failure(channel: Channel, rank: int, exc: BaseException) -> None:
    """One line to the controller (the chain's innermost cause, and where in the user's code it
    was raised); the traceback to this rank's log only."""
    message, blame_ = failure_message(exc)
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    for line in trace.splitlines():  # first: once the controller knows, teardown may be quick
        print(f"DEBUG traceback| {line}", flush=True)
    try:
        channel.send(RankError(rank, message, trace, blame_))
    except OSError:
        pass


def failure_message(exc: BaseException) -> tuple[str, str]:
    """``(one line, blame)`` of a rank's exception (:mod:`flodl.runtime.rank.blame`)."""
    from flodl.monitor.failures import describe

    kind, where = blame.classify(exc)
    message = describe(exc)
    return (f"{message} (at {where})" if where else message), kind


def join(
    channel: Channel, role: rank_env.RankEnv, secret: bytes, in_launcher: bool = False
) -> tuple[Any, Any, Any]:
    """Receive the job, pin threads and device, join the process group: (spec, link, device)."""
    import torch

    from flodl.runtime.wire.rank_link import SocketLink, beat_interval_s

    spec = channel.recv()
    chaos.point("join", role.rank)
    if isinstance(spec, Abort):  # another rank failed before this one got the job
        log.info("rank %d: the launcher ended the run (%s); exiting", role.rank, spec.reason)
        if in_launcher:
            raise RuntimeError(f"the run ended before rank {role.rank} started: {spec.reason}")
        os._exit(1)
    cluster = spec.config.cluster
    if not in_launcher:  # a controller out of reach for the heartbeat timeout: stop (links.py)
        channel.bound_silence(cluster.heartbeat_timeout_s)
    if role.device == "cpu":
        torch.set_num_threads(cluster.threads_per_rank)
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", role.local_rank)
        torch.cuda.set_device(device)
    link = SocketLink(
        channel,
        role.rank,
        on_regroup=groups.abort,
        in_launcher=in_launcher,
        beat_s=beat_interval_s(cluster.heartbeat_timeout_s),
    )
    try:
        groups.form(
            spec.backend,
            _data_store(spec, secret, "generation0", doomed=lambda: link.announced_generation > 0),
            role.rank,
            role.world_size,
            cluster.start_timeout_s,
            doomed=lambda: link.announced_generation > 0,
            on_present=lambda: chaos.point("form", role.rank),
            failure_grace_s=_failure_grace_s(cluster),
        )
    except groups.Abandoned:  # a rank was lost before it joined: the worker forms the next one
        log.warning("rank %d: a rank was lost before the group formed; regrouping", role.rank)
    return spec, link, device


def _data_store(
    spec: Any, secret: bytes, generation: str, doomed: Callable[[], bool] | None = None
) -> Any:
    """The data plane's rendezvous: the launcher's store, under this job's and generation's keys,
    every value signed with the run's secret (:mod:`flodl.runtime.wire.signed_store`); its
    blocking reads are given up once ``doomed()`` (a member was lost while the group formed)."""
    prefix = f"{spec.store_prefix}/{generation}"
    timeout_s = spec.config.cluster.start_timeout_s
    return join_store(spec.store_host, spec.store_port, secret, prefix, timeout_s, doomed)


def regroup(
    spec: Any,
    role: rank_env.RankEnv,
    secret: bytes,
    members: tuple[int, ...],
    generation: int,
    doomed: Callable[[], bool] | None = None,
) -> None:
    """Re-form the process group over the survivors, under a fresh store prefix; given up
    (:class:`groups.Abandoned`) once ``doomed()`` says a newer membership was announced."""
    groups.release()
    if len(members) < 2:
        return  # a lone survivor trains on alone
    groups.form(
        spec.backend,
        _data_store(spec, secret, f"generation{generation}", doomed),
        members.index(role.rank),
        len(members),
        spec.config.cluster.start_timeout_s,
        doomed=doomed,
        failure_grace_s=_failure_grace_s(spec.config.cluster),
    )


def _failure_grace_s(cluster: Any) -> float:
    """How long a failed formation waits for the controller to name a lost member before it is
    taken for the rank's own failure: a silent host is declared lost after the heartbeat
    timeout."""
    return float(min(2 * cluster.heartbeat_timeout_s, cluster.start_timeout_s))


def leave(link: Any) -> None:
    link.stopping = True  # from here on, a closed channel is expected, not a lost launcher
    groups.release()


def run_managed(role: rank_env.RankEnv, secret: bytes, in_launcher: bool = False) -> int:
    """Join the controller as ``role`` and run its plans until it says stop; the exit code.
    ``in_launcher``: this rank is a thread of the launcher's process (never exit the process)."""
    chaos.point("hello", role.rank)
    channel = _hello(role, secret)
    link = None
    try:
        from flodl.runtime.rank.loop import RankLoop

        spec, link, device = join(channel, role, secret, in_launcher)
        RankLoop(spec, link, role.rank, device, regroup=partial(regroup, spec, role, secret)).run()
        return 0
    except BaseException as exc:
        report_failure(channel, role.rank, exc)
        return 1
    finally:
        if link is not None:
            leave(link)
        _shared_memory_summary(channel, role.rank)
        channel.close()


def _shared_memory_summary(channel: Channel, rank: int) -> None:
    side = channel.shm
    if side is not None:
        log.info(
            "rank %d: %d messages to the launcher and %d from it went through shared memory",
            rank,
            side.sent,
            side.received,
        )


def main() -> int:
    """The managed tier: a process our launcher started (locally, over ssh, or as a fork of its
    fork server, :mod:`flodl.runtime.cohorts.fork_server`, whose environment and stdin are then the
    rank's)."""
    return run_managed(*_start())


def cooperative_worker() -> Any:
    """The cooperative tier on a re-executed rank: join, build, and hand the loop to the user."""
    from flodl.cooperative import CooperativeWorker, exit_rank
    from flodl.runtime.rank.loop import RankLoop

    role, secret = _start()
    channel = _hello(role, secret)
    previous_hook = sys.excepthook

    def on_uncaught(kind, exc, tb) -> None:  # the user's loop raised: tell the controller
        report_failure(channel, role.rank, exc)
        previous_hook(kind, exc, tb)

    sys.excepthook = on_uncaught
    try:
        spec, link, device = join(channel, role, secret)
        core = RankLoop(spec, link, role.rank, device, regroup=partial(regroup, spec, role, secret))
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


def end_process(code: int) -> NoReturn:
    """Leave the rank process as multiprocessing's children do: exit handlers and flushed output,
    then ``os._exit``, without interpreter finalization. A gloo worker thread can still hold the
    last reference to a finished work's tensors; dropping it while the interpreter is torn down
    aborts the process (SIGABRT, "terminate called without an active exception";
    pytorch/pytorch#179291), and the launcher would see a finished rank fail."""
    try:
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
