"""The rig's link model: what moving bytes between ranks costs on a consumer rig's wire.

On one machine the ranks' collectives run over loopback shared memory, where communication is
nearly free; on the rigs flodl is for it is not: GeForce cards have no peer-to-peer, so every
all-reduce hop is staged through host memory over PCIe, and between hosts a lab has 1-10 GbE.
With ``cluster.link`` set, every collective and every controller transfer a rank makes pays
the modelled time for its bytes, on top of what it really cost, as compute is paced:

* ring all-reduce of ``B`` bytes over ``N`` ranks: ``2(N-1)/N x B x k / bw + 2(N-1) x lat``
* broadcast (pipelined chain): ``B x k / bw + (N-1) x lat``
* a transfer between a rank and the controller (cpu_* snapshots up, averages down):
  ``B / bw + lat`` each way (the controller lives in host memory: one copy, never staged)

``k`` is 2 on a host-staged link (``pcie_no_p2p``: each hop is a device-to-host copy then a
host-to-device copy) and 1 otherwise. Transfers queue on the rank's one link: a transfer starts
when the link is free, so buckets sent back to back take the sum of their times.

Inside a paced step (nccl_sync's gradient buckets, a DDP communication hook) the real compute
runs faster than the simulated device's, so a bucket launched at real time ``t`` is placed at
``start + (t - start) x scale`` of the simulated step (``scale`` = simulated / real compute
time): communication overlaps the backward pass as it would on the device, and the step ends
when both its compute deadline and its last transfer are done. Outside a step (nccl_cadence's
averaging, a broadcast) a collective's modelled time is simply waited out after it completes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flodl.config.cluster import LinkConfig, WorkerConfig
from flodl.config.registries.link_profiles import LINK_NAMES, LINK_PROFILES, NO_LINK, LinkProfile


@dataclass(frozen=True)
class Wire:
    """One link's figures: bandwidth (Gbit/s per direction), latency (ms), host-staged."""

    bandwidth_gbps: float
    latency_ms: float
    staged: bool = False

    @property
    def _bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8.0

    def all_reduce_s(self, nbytes: int, world: int) -> float:
        """Ring all-reduce: each rank sends and receives ``2(N-1)/N`` of the bytes."""
        if world <= 1 or nbytes <= 0:
            return 0.0
        steps = 2 * (world - 1)
        k = 2.0 if self.staged else 1.0
        return steps / world * nbytes * k / self._bytes_per_s + steps * self.latency_ms / 1e3

    def all_gather_s(self, nbytes: int, world: int) -> float:
        """Ring all-gather of ``nbytes`` from each rank: each receives the others' ``N-1``."""
        if world <= 1 or nbytes <= 0:
            return 0.0
        k = 2.0 if self.staged else 1.0
        return (world - 1) * (nbytes * k / self._bytes_per_s + self.latency_ms / 1e3)

    def broadcast_s(self, nbytes: int, world: int) -> float:
        """Pipelined broadcast down a chain of ranks."""
        if world <= 1 or nbytes <= 0:
            return 0.0
        k = 2.0 if self.staged else 1.0
        return nbytes * k / self._bytes_per_s + (world - 1) * self.latency_ms / 1e3

    def transfer_s(self, nbytes: int) -> float:
        """One message between a rank and the controller (host memory: one copy)."""
        return nbytes / self._bytes_per_s + self.latency_ms / 1e3


def wire_for(profile: str, bandwidth_gbps: float | None = None, latency_ms: float | None = None):
    """A profile's :class:`Wire`, with explicit figures replacing the profile's; None for
    ``none`` without figures (nothing is charged)."""
    if profile == NO_LINK and bandwidth_gbps is None:
        return None
    if profile == NO_LINK:
        base = LinkProfile(NO_LINK, float(bandwidth_gbps or 0.0), 0.0, False, "")
    elif (
        profile in LINK_PROFILES
    ):  # the registry's figures (flodl/config/registries/link_profiles.py)
        base = LINK_PROFILES[profile]
    else:
        raise ValueError(f"unknown link profile {profile!r}; one of {', '.join(LINK_NAMES)}")
    bw = base.bandwidth_gbps if bandwidth_gbps is None else bandwidth_gbps
    lat = base.latency_ms if latency_ms is None else latency_ms
    return Wire(float(bw), float(lat), base.staged)


class LinkModel:
    """A rank's link: the wire its collectives cross, the one its controller transfers cross,
    and the queue both share. Thread-safe (a DDP hook runs on autograd's thread)."""

    def __init__(self, wire: Wire, controller_wire: Wire | None = None) -> None:
        self.wire = wire
        self.controller_wire = controller_wire or wire
        self._lock = threading.Lock()
        self._free_at = 0.0  # perf_counter time the link finishes what it was given
        self._step_start: float | None = None
        self._in_step: list[tuple[float, float]] = []  # (real launch time, modelled seconds)
        self.charged_s = 0.0  # modelled seconds charged so far (tests, telemetry)
        self.charged_bytes = 0

    # -- outside a step: wait the modelled time out ------------------------------------------
    def in_step(self) -> bool:
        return self._step_start is not None

    def charge(self, seconds: float, nbytes: int = 0, background: bool = False) -> None:
        """A transfer that just completed: the link carries it for ``seconds`` more (after
        anything it still carries); the caller waits until it is done. Inside a paced step
        (and not ``background``: another thread's) it is placed when the step settles."""
        if seconds <= 0:
            return
        with self._lock:
            if self._step_start is not None and not background:
                self._in_step.append((time.perf_counter(), seconds))
                self._count(seconds, nbytes)
                return
            end = max(time.perf_counter(), self._free_at) + seconds
            self._free_at = end
            self._count(seconds, nbytes)
        sleep_until(end)

    def reserve(self, seconds: float, nbytes: int = 0, background: bool = False) -> float:
        """A transfer launched now that the caller does not wait for (a gradient bucket, a
        controller message in flight); returns when the link will have carried it. Launched
        inside a paced step (and not ``background``: another thread's, e.g. the control
        channel's reader), it is placed when the step settles and ``now`` is returned."""
        with self._lock:
            now = time.perf_counter()
            self._count(seconds, nbytes)
            if self._step_start is not None and not background:
                self._in_step.append((now, seconds))
                return now
            self._free_at = max(now, self._free_at) + seconds
            return self._free_at

    def _count(self, seconds: float, nbytes: int) -> None:
        self.charged_s += seconds
        self.charged_bytes += nbytes

    def all_reduce(self, nbytes: int, world: int) -> None:
        self.charge(self.wire.all_reduce_s(nbytes, world), nbytes)

    def broadcast(self, nbytes: int, world: int) -> None:
        self.charge(self.wire.broadcast_s(nbytes, world), nbytes)

    def round_trip_s(self, up_bytes: int, down_bytes: int) -> float:
        """A snapshot to the controller and its average back."""
        wire = self.controller_wire
        return wire.transfer_s(up_bytes) + wire.transfer_s(down_bytes)

    # -- a paced step ------------------------------------------------------------------------
    def open_step(self) -> None:
        with self._lock:
            self._step_start = time.perf_counter()
            self._in_step = []

    def settle_step(self, real_s: float, simulated_s: float | None) -> float:
        """Close the step whose compute really took ``real_s`` and is simulated as
        ``simulated_s`` (None: not paced, real time): place its transfers on the simulated
        timeline and return when the last one is done (0.0: none)."""
        with self._lock:
            start, launched = self._step_start, self._in_step
            self._step_start, self._in_step = None, []
            if start is None or not launched:
                return 0.0
            scale = 1.0 if simulated_s is None else max(simulated_s / max(real_s, 1e-9), 1.0)
            free = max(self._free_at, start)
            for launched_at, seconds in launched:
                free = max(free, start + (launched_at - start) * scale) + seconds
            self._free_at = free
            return free


_installed: LinkModel | None = None


def install(model: LinkModel | None) -> None:
    """This process's link (a rank installs its own at start; None: nothing is charged)."""
    global _installed
    _installed = model


def installed() -> LinkModel | None:
    return _installed


def sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def all_reduce(nbytes: int, world: int) -> None:
    """Charge a ring all-reduce of ``nbytes`` over ``world`` ranks that just completed."""
    if _installed is not None:
        _installed.all_reduce(nbytes, world)


def broadcast(nbytes: int, world: int) -> None:
    if _installed is not None:
        _installed.broadcast(nbytes, world)


def tensor_bytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def ddp_comm_hook(world: int) -> Callable[[Any, Any], Any]:
    """A DDP communication hook that all-reduces each bucket (averaging, as DDP's default)
    and charges it on this process's link, so torch DDP crosses the same modelled wire as
    flodl: ``ddp.register_comm_hook(None, ddp_comm_hook(world))``."""
    import torch.distributed as dist

    def hook(state: Any, bucket: Any) -> Any:
        buffer = bucket.buffer()
        model, nbytes = _installed, tensor_bytes(buffer)
        seconds = 0.0 if model is None else model.wire.all_reduce_s(nbytes, world)
        in_step = model is not None and model.in_step()
        if model is not None and in_step:  # placed on the paced step's timeline at launch
            model.reserve(seconds, nbytes)
        fut = dist.all_reduce(buffer.div_(world), async_op=True).get_future()

        def done(f: Any) -> Any:
            if model is not None and not in_step:  # after the real reduction, as flodl's
                model.charge(seconds, nbytes, background=True)
            return f.value()[0]

        return fut.then(done)

    import torch  # DDP checks the hook's annotations as objects, not as postponed strings

    hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook


def model_for(
    link: Any,
    spans_hosts: bool = False,
    remote_controller: bool = False,
    between: Wire | None = None,
    to_controller: Wire | None = None,
):
    """The :class:`LinkModel` a ``cluster.link`` config gives a rank (None: nothing charged).

    A cohort spread over hosts crosses the hosts' link in every collective (a ring is as fast
    as its slowest hop); a rank on another host than the controller crosses it to reach it.
    ``between`` / ``to_controller``: those wires when hosts differ (default: the config's
    ``between_hosts``)."""
    within = wire_for(link.profile, link.bandwidth_gbps, link.latency_ms)
    default = wire_for(link.between_hosts) if link.between_hosts else None
    between = between or default
    to_controller = to_controller or default
    collective = between if (spans_hosts and between is not None) else within
    controller = to_controller if (remote_controller and to_controller is not None) else within
    if collective is None and controller is None:
        return None
    base = collective or controller
    assert base is not None
    return LinkModel(base, controller or base)


def slower(a: Wire | None, b: Wire | None) -> Wire | None:
    """The wire two hosts' links give between them: the lower bandwidth, the higher latency."""
    if a is None or b is None:
        return a or b
    return Wire(min(a.bandwidth_gbps, b.bandwidth_gbps), max(a.latency_ms, b.latency_ms),
                a.staged or b.staged)  # fmt: skip


def _host_wire(host: WorkerConfig, link: LinkConfig) -> Wire | None:
    """A host's link to the others (its own, else the cluster's between hosts)."""
    profile = host.link or link.between_hosts
    return wire_for(profile) if profile else None


def model_for_rank(cluster: Any, rank: int):
    """The link model of ``rank`` of a cohort placed by ``cluster`` (a ClusterConfig).

    Hosts clusters: each host has its link to the others (``workers[].link``, default
    ``cluster.link.between_hosts``); two hosts talk at the slower of their two links, so a ring
    over every host crosses the slowest, and a rank reaches the controller at the slower of its
    host's link and the controller host's."""
    link = cluster.link
    if not link.charged and not any(w.link for w in cluster.workers):
        return None
    hosts: list[Any] = []
    for worker in cluster.workers:
        count = worker.ranks if worker.devices == "cpu" else None
        if isinstance(worker.devices, list):
            count = len(worker.devices)
        if count is None:  # 'all' GPUs of a host: how many is the host's to say
            hosts = []
            break
        hosts += [worker] * count
    spans = len({w.host for w in cluster.workers}) > 1
    mine = hosts[rank] if rank < len(hosts) else None
    remote = spans and (mine is None or mine.host != cluster.controller.host)
    if not spans:
        return model_for(link)
    ring: Wire | None = None
    for worker in cluster.workers:
        ring = slower(ring, _host_wire(worker, link))
    home = next((w for w in cluster.workers if w.host == cluster.controller.host), None)
    to_controller = None
    if mine is not None:
        between = wire_for(link.between_hosts or NO_LINK)
        far = _host_wire(home, link) if home is not None else between
        to_controller = slower(_host_wire(mine, link), far)
    return model_for(
        link, spans_hosts=True, remote_controller=remote, between=ring, to_controller=to_controller
    )
