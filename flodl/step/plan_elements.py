"""What a step can give up to fit a small device: activations recomputed, optimizer state on host.

The two elements of a rank's memory plan (``cluster.memory_plan``; chosen per rank by
:mod:`flodl.runtime.rank.memory_plan`), both usable on any device:

* **Activation recomputation** (:func:`recompute`): the model's blocks keep only their inputs for
  backward and run their forward again there (``torch.utils.checkpoint``, non-reentrant), so a
  step holds one block's activations instead of all of them, for about one more forward pass.
  The blocks are found, not declared: the largest ``nn.ModuleList`` / ``nn.Sequential`` of the
  model (by parameters). Its elements are checkpointed one by one when they are compound (a
  transformer's blocks); a flat ``Sequential`` of single layers is cut into about ``sqrt(n)``
  segments instead (checkpointing single layers would keep every layer's input, saving nothing).
  The forward is patched on the instances (a bound method, so ``copy.deepcopy`` rebinds it), so
  parameter names, ``state_dict`` keys and the averaged buffer are untouched.
* **Optimizer state on host** (:class:`HostOptimizer`, ZeRO-Offload's idea without the sharding):
  the optimizer steps host copies of the parameters, so its state (Adam: two more copies of the
  model) never occupies the device. Each step moves the gradients down, steps on host and moves the
  parameters back up; parameters changed on the device since the last step (an average, a
  restore: seen by the tensors' version counters) are moved down first. Its ``state_dict`` is
  the wrapped optimizer's, in the same format, so a bundle resumes with or without the plan, on
  any world size.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

#: A context in which host tensors are made and used (the rig pauses its device-memory count).
HostScope = Callable[[], contextlib.AbstractContextManager[Any]]


# -- activation recomputation ---------------------------------------------------------------------
def _recomputed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(self).forward
    if not (getattr(self, "_flodl_recompute", False) and torch.is_grad_enabled()):
        return forward(self, *args, **kwargs)
    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)


def _recomputed_sequential(self: nn.Sequential, input: Any) -> Any:
    if not (getattr(self, "_flodl_recompute", False) and torch.is_grad_enabled()):
        return nn.Sequential.forward(self, input)
    segments = max(1, round(math.sqrt(len(self))))
    return checkpoint_sequential(self, segments, input, use_reentrant=False)


def _n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _compound(module: nn.Module) -> bool:
    return sum(1 for c in module.children() if _n_params(c) > 0) > 1


def blocks(model: nn.Module) -> tuple[list[nn.Module], nn.Sequential | None]:
    """The modules recomputation wraps: ``(blocks, None)`` to checkpoint each, or
    ``([], sequential)`` for a flat ``Sequential`` cut into segments."""
    lists = [
        m
        for m in model.modules()
        if isinstance(m, nn.ModuleList | nn.Sequential) and len(m) >= 2 and _n_params(m) > 0
    ]
    if not lists:
        children = [c for c in model.children() if _n_params(c) > 0]
        return (children, None) if len(children) >= 2 else ([model], None)
    biggest = max(lists, key=_n_params)
    if any(_compound(m) for m in biggest):
        return [m for m in biggest if _n_params(m) > 0], None
    if isinstance(biggest, nn.Sequential):
        return [], biggest
    return [m for m in biggest if _n_params(m) > 0], None  # a ModuleList of single layers


def recompute(model: nn.Module) -> int:
    """Checkpoint the model's blocks (see the module docstring); returns how many modules now
    recompute. Idempotent; :func:`set_recompute` switches it off and on."""
    each, sequential = blocks(model)
    targets: list[nn.Module] = [sequential] if sequential is not None else each
    for m in targets:
        if sequential is not None and m is sequential:
            m.forward = types.MethodType(_recomputed_sequential, m)  # type: ignore[method-assign]
        else:
            m.forward = types.MethodType(_recomputed_forward, m)  # type: ignore[method-assign]
        m._flodl_recompute = True  # type: ignore[assignment]
    return len(targets)


def set_recompute(model: nn.Module, on: bool) -> None:
    for m in model.modules():
        if hasattr(m, "_flodl_recompute"):
            m._flodl_recompute = on  # type: ignore[assignment]


@contextlib.contextmanager
def recompute_off(model: nn.Module) -> Iterator[None]:
    set_recompute(model, False)
    try:
        yield
    finally:
        set_recompute(model, True)


def recomputes(model: nn.Module) -> bool:
    return any(getattr(m, "_flodl_recompute", False) for m in model.modules())


# -- optimizer state on host ----------------------------------------------------------------------
class HostOptimizer(torch.optim.Optimizer):
    """Steps the optimizer ``factory`` builds over host copies of ``params``.

    Its ``param_groups`` hold the device parameters (gradient clipping, a ``GradScaler`` and LR
    schedulers see what they would see without the plan); their hyperparameters are handed to the
    host optimizer at each step. ``charge(nbytes_moved, nbytes_stepped)`` is told each step's
    traffic (the CPU rig turns it into simulated time); ``host`` is the scope host work runs in.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        factory: Callable[[Any], torch.optim.Optimizer],
        host: HostScope = contextlib.nullcontext,
        charge: Callable[[int, int], None] | None = None,
        watch: Callable[[], Sequence[torch.Tensor | None]] | None = None,
    ) -> None:
        device_params = [p for p in params]
        self._host = host
        self._watch = watch
        self._charge = charge
        pin = any(p.device.type == "cuda" for p in device_params) and torch.cuda.is_available()
        with host():
            self.host_params = []
            for p in device_params:
                if not p.requires_grad:  # frozen (a LoRA base): never stepped, no host copy;
                    h = torch.empty(0, dtype=p.dtype)  # a placeholder keeps the state's order
                else:
                    h = p.detach().to("cpu", copy=True)
                    h = h.pin_memory() if pin else h
                self.host_params.append(nn.Parameter(h, requires_grad=p.requires_grad))
            self.inner = factory(self.host_params)
        to_device = {id(h): d for h, d in zip(self.host_params, device_params, strict=True)}
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}}
            | {"params": [to_device[id(h)] for h in g["params"]]}
            for g in self.inner.param_groups
        ]
        super().__init__(groups, dict(self.inner.defaults))
        # What moves each step: the trainable parameters (frozen ones have no host copy).
        self._pairs = [(d, h) for d, h in zip(device_params, self.host_params, strict=True)
                       if d.requires_grad]  # fmt: skip
        self._versions = [d._version for d, _ in self._pairs]
        self._watched = self._watched_versions()

    def _watched_versions(self) -> list[tuple[int, int]]:
        """Versions of the tensors weights are written through besides the parameters (a flat
        buffer the parameters live in: writes through it do not bump theirs)."""
        if self._watch is None:
            return []
        return [(id(t), t._version) for t in self._watch() if t is not None]

    def _hyper_down(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v

    def _hyper_up(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            for k, v in inner.items():
                if k != "params":
                    outer[k] = v

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("HostOptimizer: closures are not supported (one step per call)")
        self._hyper_down()
        moved = 0
        rewritten = self._watched_versions() != self._watched
        with self._host():
            for i, (d, h) in enumerate(self._pairs):
                if rewritten or d._version != self._versions[i]:  # averaged, restored
                    h.copy_(d, non_blocking=True)
                    moved += d.numel() * d.element_size()
                if d.grad is None:
                    h.grad = None
                    continue
                if h.grad is None or h.grad.shape != d.grad.shape:
                    h.grad = torch.empty_like(h)
                h.grad.copy_(d.grad, non_blocking=True)
                moved += d.grad.numel() * d.grad.element_size()
            if any(d.device.type == "cuda" for d, _ in self._pairs):
                torch.cuda.synchronize()
            self.inner.step()
        stepped = 0
        for d, h in self._pairs:
            if h.grad is not None:
                d.copy_(h, non_blocking=True)
                moved += d.numel() * d.element_size()
                stepped += h.numel() * h.element_size()
        # After every copy: parameters that are views of one tensor share its version counter.
        self._versions = [d._version for d, _ in self._pairs]
        self._watched = self._watched_versions()
        if self._charge is not None:
            self._charge(moved, stepped + self.state_bytes())
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        with self._host():
            self.inner.zero_grad(set_to_none)

    def state_bytes(self) -> int:
        """Bytes of the optimizer state (all on host)."""
        return sum(
            v.numel() * v.element_size()
            for s in self.inner.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )

    def state_dict(self) -> dict[str, Any]:
        self._hyper_down()
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with self._host():
            self.inner.load_state_dict(state_dict)
        self._hyper_up()
