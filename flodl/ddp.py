"""The bypass tier (docs/design/data.md): one replica per rank, synced exactly when the caller says.

For training patterns that need explicit per-step replica control (a GAN's discriminator vs
generator step, RL actor vs critic, progressive growing) ``Ddp`` is the low-level per-rank
primitive. It is not the production entry: ``Trainer.run()`` adds partitions, cadence, eval,
checkpoints and rank-death survival; here the caller owns the loop and every sync::

    rdv = Rendezvous.from_env()                 # under torchrun; or Rendezvous.tcp(...)
    with Ddp.wrap(model, device, rdv.rank, rdv) as ddp:
        ddp.sync_params()                       # every rank starts from rank 0's weights
        for x, y in loader:
            loss_fn(model(x), y).backward()
            ddp.all_reduce_gradients()          # or weighted_all_reduce_gradients(counts)
            ddp.sync_buffers()
            optimizer.step()
            optimizer.zero_grad()

Every method is a collective: all ranks call it, in the same order. Each call moves one flat
buffer, so it is one collective whatever the number of tensors. Tensors are collected afresh on
each call, so a model that grows (the same way on every rank) keeps working. Model code never
imports ``torch.distributed``; this module does.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType

import torch
import torch.distributed as dist
from torch import nn

from flodl.elche.weights import averaging_weights
from flodl.rig import links
from flodl.runtime.sync.averaging import FlatState, collective_average
from flodl.runtime.sync.trainable import trainable
from flodl.runtime.wire.store import rendezvous_store

_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class Rendezvous:
    """How ranks meet: a ``TCPStore`` at ``host:port`` that ``world_size`` ranks join."""

    host: str  # address of the TCPStore every rank connects to
    port: int  # its port, in [1, 65535]
    world_size: int  # how many ranks meet there
    is_host: bool  # True on the one process that serves the store (usually rank 0)
    rank: int | None = None  # this process's rank when the environment names it (from_env)
    local_rank: int | None = None  # this process's index on its node (torchrun's LOCAL_RANK)
    timeout_s: float = 300.0  # how long to wait for the other ranks, at joining and per collective

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"rendezvous host={self.host!r}: must be a non-empty address")
        if not _is_int(self.port) or not 1 <= self.port <= 65535:
            raise ValueError(f"rendezvous port={self.port!r}: must be an integer in [1, 65535]")
        if not _is_int(self.world_size) or self.world_size < 1:
            raise ValueError(f"rendezvous world_size={self.world_size!r}: must be an integer >= 1")
        if self.rank is not None:
            _check_rank(self.rank, self.world_size)
        if not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"rendezvous timeout_s={self.timeout_s!r}: must be > 0 seconds")

    @classmethod
    def tcp(
        cls, host: str, port: int, world_size: int, is_host: bool, timeout_s: float = 300.0
    ) -> Rendezvous:
        """Meet at ``host:port``; exactly one rank passes ``is_host=True`` and serves the store."""
        return cls(host, port, world_size, is_host, timeout_s=timeout_s)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, timeout_s: float = 300.0
    ) -> Rendezvous:
        """Read torchrun's ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` (and
        ``LOCAL_RANK`` when set) from ``environ`` (default ``os.environ``).

        The variables are read by :mod:`flodl.runtime.wire.rank_env`, the one reader of rank
        environment. Under torchrun the
        agent serves the store (``TORCHELASTIC_USE_AGENT_STORE=True``) and every rank is a
        client; otherwise rank 0 serves it, as with ``init_method="env://"``.
        Raises ``RuntimeError`` naming the missing or malformed variable.
        """
        from flodl.runtime.wire.rank_env import torchrun_vars

        found = torchrun_vars(environ)
        return cls(
            host=found.master_addr,
            port=found.master_port,
            world_size=found.world_size,
            is_host=found.rank == 0 and not found.agent_store,
            rank=found.rank,
            local_rank=found.local_rank,
            timeout_s=timeout_s,
        )


class Ddp:
    """One model replica on one rank, with explicit collective syncs. Build with :meth:`wrap`."""

    def __init__(
        self, model: nn.Module, device: torch.device, rank: int, world_size: int, owns_group: bool
    ) -> None:
        self._model = model
        self._device = device
        self._rank = rank
        self._world_size = world_size
        self._owns_group = owns_group
        self._closed = False

    @classmethod
    def wrap(
        cls,
        model: nn.Module,
        device: torch.device | str,
        rank: int | None,
        rendezvous: Rendezvous,
        backend: str | None = None,
    ) -> Ddp:
        """Join the process group (or reuse the one already initialised) and wrap ``model``.

        ``model`` must already live on ``device``. ``rank`` is this process's rank in
        ``[0, world_size)``; ``None`` takes the rank the rendezvous read from the environment.
        ``backend`` defaults to gloo on CPU and nccl on CUDA. All ranks must wrap the same
        architecture (checked here, with one small collective). Parameters are not synced
        here: call :meth:`sync_params` when the replicas should start equal.
        """
        dev = _as_device(device)
        rank = _resolve_rank(rank, rendezvous)
        backend = _pick_backend(backend, dev)
        _check_placement(model, dev)
        owns = not dist.is_initialized()
        if owns:
            _join(rendezvous, rank, dev, backend)
        else:
            _check_existing_group(rank, rendezvous.world_size, dev)
        ddp = cls(model, dev, rank, rendezvous.world_size, owns)
        try:
            ddp._check_replicas()
        except BaseException:
            ddp.close()
            raise
        return ddp

    # -- identity --------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def model(self) -> nn.Module:
        return self._model

    # -- collectives -----------------------------------------------------------------------------
    @torch.no_grad()
    def sync_params(self, src: int = 0, frozen: bool = False) -> None:
        """Broadcast the trainable parameters and all buffers (integer ones too) from rank
        ``src``; ``frozen``: the parameters that do not require grad too (a frozen base every
        rank built from the same weights need not travel)."""
        self._require_open()
        _check_rank(src, self._world_size, key="src")
        params = self._model.parameters() if frozen else trainable(self._model)
        tensors = [*params, *self._model.buffers()]
        if not tensors:
            return
        flat = _flatten(tensors, _wire_dtype(tensors), self._device)
        dist.broadcast(flat, src=src)
        links.broadcast(links.tensor_bytes(flat), self._world_size)
        _load(flat, tensors)

    def all_reduce_gradients(self) -> None:
        """Replace every ``.grad`` with its mean over ranks.

        A parameter without a gradient on some rank counts as zeros there; one without a
        gradient on every rank keeps ``grad=None`` (so the optimizer skips it, as usual).
        """
        self._require_open()
        self._reduce_grads(1.0 / self._world_size)

    def weighted_all_reduce_gradients(self, counts: Sequence[int]) -> None:
        """Average gradients accumulated over unequal numbers of batches.

        Contract: ``counts[r]`` is how many batches rank ``r`` accumulated into ``.grad`` since
        the last zero_grad, each by a plain ``loss.backward()`` on that batch's (mean) loss, *not*
        divided by the count. Each rank normalises its sum by ``1/counts[rank]`` and then
        contributes with weight ``counts[rank]/sum(counts)``, so every rank ends with the mean
        gradient over all ``sum(counts)`` batches, as one process would get from all of them.
        A rank with count 0 contributes nothing (whatever its ``.grad`` holds); a parameter that
        no contributing rank has a gradient for ends with ``grad=None`` on every rank.
        """
        self._require_open()
        counts = _check_counts(counts, self._world_size)
        weights = averaging_weights(counts, gamma=1.0)  # counts[r] / sum(counts)
        mine = counts[self._rank]
        self._reduce_grads(weights[self._rank] / mine if mine else 0.0)

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Float buffers (BatchNorm running stats) averaged equally; integer buffers (step
        counters such as ``num_batches_tracked``) take rank 0's value."""
        self._require_open()
        buffers = list(self._model.buffers())
        if not buffers:
            return
        dtype = _wire_dtype(buffers)
        share = 1.0 / self._world_size
        pieces = []
        for b in buffers:
            if b.is_floating_point():
                pieces.append(b.reshape(-1).to(dtype) * share)
            elif self._rank == 0:
                pieces.append(b.reshape(-1).to(dtype))
            else:
                pieces.append(torch.zeros(b.numel(), dtype=dtype, device=self._device))
        flat = torch.cat(pieces)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        links.all_reduce(links.tensor_bytes(flat), self._world_size)
        _load(flat, buffers)

    def average_params(self, weight: float | None = None) -> float:
        """Average parameters across ranks (the flodl way); returns this rank's divergence
        ``||W_before - W_after|| / ||W_after||``.

        ``weight`` is this rank's share, in [0, 1]; the shares of all ranks must sum to 1
        (default: equal, ``1/world_size``). Float buffers are averaged equally; integer buffers
        stay local.
        """
        self._require_open()
        if weight is None:
            weight = 1.0 / self._world_size
        elif not math.isfinite(weight) or not 0.0 <= weight <= 1.0:
            raise ValueError(f"weight={weight}: must be in [0, 1] (this rank's share of 1)")
        state = FlatState(self._model)
        before = state.flatten()[: state.n_params].clone()
        collective_average(state, weight, 1.0 / self._world_size)
        after = state.flatten()[: state.n_params]
        norm = float(torch.linalg.vector_norm(after))
        return float(torch.linalg.vector_norm(before - after)) / norm if norm > 0 else 0.0

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Destroy the process group if :meth:`wrap` created it; a reused group stays up."""
        if self._closed:
            return
        self._closed = True
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()

    def __enter__(self) -> Ddp:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------
    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("Ddp is closed: wrap the model again to keep syncing")

    @torch.no_grad()
    def _reduce_grads(self, scale: float) -> None:
        """All-reduce ``scale * grad`` (SUM), plus one presence flag per parameter, in one go."""
        params = [p for p in self._model.parameters() if p.requires_grad]
        if not params:
            return
        grads = [p.grad if scale else None for p in params]
        if any(g is not None and g.is_sparse for g in grads):
            raise ValueError("sparse gradients are not supported by Ddp: use dense embeddings")
        dtype = _wire_dtype([g if g is not None else p for p, g in zip(params, grads, strict=True)])
        pieces = [
            g.reshape(-1).to(dtype)
            if g is not None
            else torch.zeros(p.numel(), dtype=dtype, device=self._device)
            for p, g in zip(params, grads, strict=True)
        ]
        present = [1.0 if g is not None else 0.0 for g in grads]
        pieces.append(torch.tensor(present, dtype=dtype, device=self._device))
        flat = torch.cat(pieces)
        n = flat.numel() - len(params)
        flat[:n].mul_(scale)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        links.all_reduce(links.tensor_bytes(flat), self._world_size)
        pos = 0
        for p, any_rank_had in zip(params, flat[n:].tolist(), strict=True):
            piece = flat[pos : pos + p.numel()].view_as(p)
            pos += p.numel()
            if not any_rank_had:
                p.grad = None
            elif p.grad is None:
                p.grad = piece.to(p.dtype).clone()
            else:
                p.grad.copy_(piece)

    def _check_replicas(self) -> None:
        """Fail early, on every rank, when the ranks wrapped different architectures."""
        params = list(self._model.parameters())
        buffers = list(self._model.buffers())
        mine = [len(params), sum(p.numel() for p in params), len(buffers)]
        mine.append(sum(b.numel() for b in buffers))
        sig = torch.tensor(mine, dtype=torch.int64, device=self._device)
        gathered = [torch.empty_like(sig) for _ in range(self._world_size)]
        dist.all_gather(gathered, sig)
        ref = gathered[0].tolist()
        for r, other in enumerate(gathered):
            if other.tolist() != ref:
                raise ValueError(
                    f"rank {r} wrapped a model with (params, param values, buffers, buffer values)"
                    f"={tuple(other.tolist())} but rank 0 has {tuple(ref)}: every rank must wrap "
                    "the same architecture"
                )


# -- validation ----------------------------------------------------------------------------------
def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_rank(rank: object, world_size: int, key: str = "rank") -> None:
    if not _is_int(rank) or not 0 <= rank < world_size:  # type: ignore[operator]
        raise ValueError(
            f"{key}={rank!r}: must be an integer in [0, {world_size}) for world_size={world_size}"
        )


def _resolve_rank(rank: int | None, rendezvous: Rendezvous) -> int:
    if rank is None:
        if rendezvous.rank is None:
            raise ValueError(
                "rank=None: pass this process's rank; only Rendezvous.from_env() knows it"
            )
        return rendezvous.rank
    _check_rank(rank, rendezvous.world_size)
    if rendezvous.rank is not None and rank != rendezvous.rank:
        raise ValueError(f"rank={rank}: the environment says RANK={rendezvous.rank}")
    return int(rank)


def _check_counts(counts: Sequence[int], world_size: int) -> list[int]:
    values = list(counts)
    if len(values) != world_size:
        raise ValueError(
            f"counts={values}: needs one entry per rank (world_size={world_size}), "
            f"got {len(values)}"
        )
    if not all(_is_int(c) and c >= 0 for c in values):
        raise ValueError(f"counts={values}: every entry must be an integer >= 0 (batches)")
    if not any(values):
        raise ValueError(f"counts={values}: no rank accumulated a batch, nothing to reduce")
    return [int(c) for c in values]


def _as_device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={dev}: CUDA is not available here; use device='cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device={dev}: Ddp supports 'cpu' and 'cuda' devices")
    return dev


def _pick_backend(backend: str | None, device: torch.device) -> str:
    if backend is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}: must be one of {_BACKENDS} (or None for auto)")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"backend='nccl' with device={device}: nccl needs CUDA; use 'gloo'")
    return backend


def _check_placement(model: nn.Module, device: torch.device) -> None:
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if t.device != device:
            raise ValueError(
                f"model tensor {name!r} is on {t.device}, device={device}: "
                "move the model first (model.to(device))"
            )


def _check_existing_group(rank: int, world_size: int, device: torch.device) -> None:
    if dist.get_world_size() != world_size:
        raise ValueError(
            f"rendezvous world_size={world_size}: the process group already initialised in this "
            f"process has {dist.get_world_size()} ranks"
        )
    if dist.get_rank() != rank:
        raise ValueError(
            f"rank={rank}: the process group already initialised in this process says this is "
            f"rank {dist.get_rank()}"
        )
    backend = str(dist.get_backend())
    if device.type == "cpu" and "gloo" not in backend:
        raise ValueError(f"device=cpu: the initialised process group uses {backend}, not gloo")


# -- process group and flat buffers --------------------------------------------------------------
def _join(rendezvous: Rendezvous, rank: int, device: torch.device, backend: str) -> None:
    timeout = timedelta(seconds=rendezvous.timeout_s)
    where = f"{rendezvous.host}:{rendezvous.port}"
    try:
        store = rendezvous_store(
            rendezvous.host,
            rendezvous.port,
            rendezvous.world_size,
            rendezvous.is_host,
            rendezvous.timeout_s,
        )
    except (RuntimeError, OSError) as exc:
        role = "serve" if rendezvous.is_host else "reach"
        raise RuntimeError(
            f"rank {rank}: could not {role} the rendezvous store at {where} within "
            f"{rendezvous.timeout_s:g}s ({_first_line(exc)}); check that the host rank is "
            "running and the port is free and reachable"
        ) from exc
    if device.type == "cuda":
        torch.cuda.set_device(device)  # nccl binds each rank to its current device
    # The group keeps a reference to the store (and so the host's server) until it is destroyed.
    try:
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=rendezvous.world_size, timeout=timeout
        )
    except RuntimeError as exc:
        raise RuntimeError(
            f"rank {rank}: not all {rendezvous.world_size} ranks joined the rendezvous at "
            f"{where} within {rendezvous.timeout_s:g}s ({_first_line(exc)}); start every rank "
            "with the same rendezvous and a distinct rank"
        ) from exc


def _first_line(exc: BaseException) -> str:
    """torch's c10 errors carry a C++ backtrace after the first line; the advice needs only that."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _wire_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """One dtype that carries every tensor exactly: float64 when integers travel along."""
    if any(not t.is_floating_point() for t in tensors):
        return torch.float64
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors), torch.float32)


def _flatten(
    tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0, dtype=dtype, device=device)
    return torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors])


@torch.no_grad()
def _load(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    pos = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[pos : pos + n].view_as(t))
        pos += n
