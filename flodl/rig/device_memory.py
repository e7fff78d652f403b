"""The rig's device memory: a rank with ``cluster.memory_mb`` fails as a GPU out of memory does.

Consumer rigs differ in memory as much as in speed (a 24 GB card beside 12 GB ones). On the CPU
rig nothing holds a rank to a device's size, so :class:`DeviceMemory` counts what a rank's
training really allocates and raises ``torch.OutOfMemoryError`` (the exception
``torch.cuda.OutOfMemoryError`` is) the moment the count passes the budget, so everything that
handles a CUDA out-of-memory handles the rig's the same way.

How it counts: a ``TorchDispatchMode`` sees every tensor each op returns; each storage not seen
before is counted at its size, with a weak reference to the storage itself (not to the Python
tensor: autograd keeps the activations it saved for backward alive in C++ long after their Python
tensors are gone, and they must count until torch frees them). A storage is uncounted once its
weak reference expires. Expired references are swept whenever the count would set a new peak or
pass the budget, so the peak and the out-of-memory decision are exact, not lagging.
:meth:`DeviceMemory.adopt` counts tensors that existed before (parameters, buffers, gradients,
optimizer state), so the budget covers the whole training state, as a device's does.

What it does not see, as a GPU's allocator would: the caching allocator's fragmentation and
rounding (a real card fails a little earlier), CUDA's context (~300-500 MB per process on a real
card: leave it out of ``memory_mb``), and host memory (pinned buffers, the loader's batches before
they are moved).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter

MiB = 1 << 20


class DeviceMemory(TorchDispatchMode):
    """Count a rank's live tensor storages against ``budget_bytes`` (None: count, never fail)."""

    def __init__(self, budget_bytes: int | None, name: str = "rank") -> None:
        super().__init__()
        self.budget = budget_bytes
        self.name = name
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0
        self.counting = True  # False in :meth:`host`: what is made there lives in host memory

    # -- counting ----------------------------------------------------------------------------
    def adopt(self, tensors: Iterable[Any]) -> None:
        """Count tensors allocated before the mode was entered (the model, its optimizer)."""
        self._count(t for t in tensors if isinstance(t, torch.Tensor))
        self._settle(0)

    @contextlib.contextmanager
    def host(self) -> Iterator[None]:
        """Work in host memory (an offloaded optimizer's step): nothing made here counts."""
        before, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = before

    def reset_peak(self) -> None:
        self.sweep()
        self.peak = self.current

    def sweep(self) -> None:
        """Uncount every storage torch has freed."""
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for key in dead:
            self.current -= self.live.pop(key)[1]

    def _count(self, tensors: Iterable[torch.Tensor]) -> int:
        new = 0
        for t in tensors:
            if t.device.type == "meta" or t.is_sparse:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            seen = self.live.get(key)
            if seen is not None and not seen[0].expired():
                continue
            if seen is not None:  # the address of a freed storage, reused
                self.current -= seen[1]
            nbytes = storage.nbytes()
            self.live[key] = (StorageWeakRef(storage), nbytes)
            self.current += nbytes
            new += nbytes
        return new

    def _settle(self, new: int) -> None:
        if self.current > self.peak or (self.budget is not None and self.current > self.budget):
            self.sweep()  # what looks like a new high may be storages freed since the last look
        if self.budget is not None and self.current > self.budget:
            used, budget = self.current, self.budget
            raise torch.OutOfMemoryError(
                f"{self.name} out of memory (CPU rig, cluster.memory_mb={budget / MiB:g}): "
                f"tried to allocate {new / MiB:.2f} MiB; {used / MiB:.2f} MiB would be in use "
                f"of {budget / MiB:.2f} MiB"
            )
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.counting:
            return out
        new = self._count(t for t in tree_iter(out) if isinstance(t, torch.Tensor))
        if new:
            self._settle(new)
        return out


def training_state(model: torch.nn.Module, optimizer: Any = None) -> list[torch.Tensor]:
    """The tensors a device holds between steps: parameters, buffers, gradients, optimizer
    state."""
    tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


# -- what offloading costs on the rig --------------------------------------------------------------
#
# A plan that keeps the optimizer state in host memory pays, on a real machine, for the traffic
# between host and device over PCIe and for the optimizer's step on the CPU, which is bound by
# host memory bandwidth (it streams parameters, gradients and state). The rig's ranks all run on
# the host already, so neither cost would show: each offloaded step is charged its simulated time.

#: Host <-> device: PCIe 4.0 x16, ~25 GB/s per direction (the rig's ``pcie_no_p2p`` figures).
HOST_LINK = "pcie_no_p2p"
#: What a CPU optimizer step streams per second: a desktop's dual-channel DDR5 peaks at ~60 GB/s;
#: a fused CPU Adam (DeepSpeed's) reaches about a third of it.
HOST_STEP_BYTES_PER_S = 20e9


def offload_step_s(moved: int, stepped: int) -> float:
    """Simulated seconds of one offloaded optimizer step: ``moved`` bytes over the host link,
    and a host step reading and writing ``stepped`` bytes (parameters and state)."""
    from flodl.rig.links import wire_for

    wire = wire_for(HOST_LINK)
    assert wire is not None
    link_s = (moved / wire._bytes_per_s) if moved else 0.0
    return link_s + 2 * stepped / HOST_STEP_BYTES_PER_S
