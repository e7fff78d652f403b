"""Bulk tensors on the control channel: a message pickled *without* its tensors, then their raw
bytes in bounded frames, reassembled into preallocated tensors on the other side.

A message holding tensors (final weights, a cpu_* snapshot or average, a resume state) would be
one pickled frame as large as the model; the frame bound (256 MiB) then caps the model size. Here
the pickler takes every tensor out of band (``persistent_id``): the pickle holds only a
placeholder per tensor, and the tensor's bytes follow it, sent straight from the tensor's memory
(no serialised copy) in frames of at most :data:`CHUNK_BYTES`. The receiver reads them into
``torch.empty`` tensors of the announced dtype and shape, then unpickles the skeleton with those
tensors in place of the placeholders. So a message costs its tensors once on each side, whatever
its size, and every frame stays under the bound; the pickle itself is chunked the same way.

Wire format of a streamed message (all frames use the channel's ``magic + length`` header):
``FDL2`` frame with ``pickle((skeleton_bytes, [(dtype, shape), ...]))`` for small skeletons, or
the skeleton length with the skeleton following in frames; then each tensor's bytes in order.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import torch

from flodl.runtime.wire import messages

#: Bytes per frame of a streamed tensor or skeleton (well under the channel's frame bound).
CHUNK_BYTES = 64 << 20

_TAG = "flodl-tensor"

#: Messages that never hold a tensor: sent without the tensor-extracting pickler (whose Python
#: ``persistent_id`` runs on every object): a controller of 128 ranks sends 128 plans a window.
_NO_TENSORS = frozenset(
    {
        messages.Plan,
        messages.CohortPlan,
        messages.Stop,
        messages.Regroup,
        messages.Heartbeat,
        messages.Settled,
        messages.Regrouped,
        messages.Hello,
        messages.Ready,
        messages.Abort,
    }
)


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


class _Extracting:
    """Mixin: pickle every tensor as a placeholder and keep the tensor aside."""

    tensors: list[torch.Tensor]

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
            self.tensors.append(_detached(obj))
            return (_TAG, len(self.tensors) - 1, isinstance(obj, torch.nn.Parameter))
        return None


class _Pickler(_Extracting, pickle.Pickler):
    pass


class _CodePickler(_Extracting, cloudpickle.Pickler):
    pass


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, tensors: list[torch.Tensor | None]) -> None:
        super().__init__(io.BytesIO(data))
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 3 and pid[0] == _TAG):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        t = self.tensors[pid[1]]
        if t is None:  # consumed as it arrived (summed): the message carries no tensor
            return None
        return torch.nn.Parameter(t, requires_grad=t.is_floating_point()) if pid[2] else t


class Placeholder:
    """Stands for a tensor not received yet (a message looked at before its tensors)."""

    def __init__(self, index: int) -> None:
        self.index = index


class _Peeking(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 3 and pid[0] == _TAG):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return Placeholder(pid[1])


def peek(skeleton: bytes) -> Any:
    """The message with a :class:`Placeholder` for each tensor (None if it cannot be built so:
    a class that checks its fields, say)."""
    try:
        return _Peeking(skeleton).load()
    except Exception:
        return None


def split(msg: Any, code: bool = False) -> tuple[bytes, list[torch.Tensor]]:
    """The pickled skeleton and the tensors it refers to (``code``: cloudpickle, for closures)."""
    if not code and type(msg) in _NO_TENSORS:  # the control plane's bulk: plain pickle, 3x faster
        return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), []
    buf = io.BytesIO()
    pickler_class = _CodePickler if code else _Pickler
    pickler = pickler_class(buf, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.tensors = []
    pickler.dump(msg)
    return buf.getvalue(), pickler.tensors


def describe(tensors: list[torch.Tensor]) -> list[tuple[str, tuple[int, ...]]]:
    return [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]


def tensor_view(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (no copy)."""
    if t.numel() == 0:
        return memoryview(b"")
    array: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def chunks(view: memoryview, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
    for start in range(0, len(view), size):
        yield view[start : start + size]


def _dtype(descriptor: Any) -> tuple[torch.dtype, tuple[int, ...]]:
    dtype_name, shape = descriptor
    dtype = getattr(torch, str(dtype_name), None)
    if not isinstance(dtype, torch.dtype) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"bad tensor descriptor {(dtype_name, shape)!r}")
    return dtype, tuple(shape)


def nbytes(descriptor: Any) -> int:
    """How many bytes a tensor of this ``(dtype, shape)`` descriptor takes."""
    dtype, shape = _dtype(descriptor)
    return math.prod(shape) * dtype.itemsize


def allocate(descriptors: Any, skip: set[int] | None = None) -> list[torch.Tensor | None]:
    """Empty tensors for the announced ``(dtype, shape)`` list (None at the ``skip`` indices);
    ValueError if it is malformed."""
    out: list[torch.Tensor | None] = []
    for i, descriptor in enumerate(descriptors):
        dtype, shape = _dtype(descriptor)
        out.append(None if skip and i in skip else torch.empty(shape, dtype=dtype))
    return out


def join(skeleton: bytes, tensors: list[torch.Tensor | None]) -> Any:
    """The message again, its tensors in place of their placeholders."""
    return _Unpickler(skeleton, tensors).load()


def fill(tensor: torch.Tensor, recv_into: Callable[[memoryview], None]) -> None:
    """Read a tensor's bytes frame by frame into its memory."""
    view = tensor_view(tensor)
    for part in chunks(view):
        recv_into(part)
