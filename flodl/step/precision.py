"""Mixed precision and gradient accumulation of one rank's optimizer steps.

``trainer.precision``: ``32`` (plain fp32), ``bf16-mixed`` (``torch.autocast`` in bfloat16, CPU
and CUDA) or ``16-mixed`` (autocast in float16 with a ``torch.amp.GradScaler``, CUDA only).
Parameters stay fp32 in every mode (autocast casts per op), so averaging always runs on fp32
master weights.

``trainer.accumulate_grad_batches: N``: gradients of N micro-batches are summed, then divided by
the number summed, so one optimizer step sees the mean gradient, as one batch N times larger
would. A window's last group may be shorter (the step is then taken at the window's end, so
averaging never meets pending gradients); the dispatch rounds windows to whole groups to make
that rare.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class StepRunner:
    """Autocast, scaled backward, accumulation and the optimizer step of one rank."""

    def __init__(
        self,
        precision: str,
        device: torch.device,
        accumulate: int = 1,
        max_grad_norm: float | None = None,
    ) -> None:
        self.precision = precision
        self.device = device
        self.dtype = DTYPES.get(precision)
        self.accumulate = accumulate
        self.max_grad_norm = max_grad_norm
        self.scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
        self.pending = 0  # micro-batches whose gradients wait for a step

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward pass (and loss) in the precision asked for."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(self.device.type, dtype=self.dtype):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """Add this micro-batch's gradients (scaled under 16-mixed)."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        self.pending += 1

    @property
    def due(self) -> bool:
        return self.pending >= self.accumulate

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Take the optimizer step over the pending gradients; False when they were not finite
        (the step is skipped in every precision; under 16-mixed the scaler lowers its scale).
        Gradients are cleared either way."""
        if self.pending == 0:
            return True
        if self.pending > 1:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.div_(self.pending)
        self.pending = 0
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        finite = self.check_gradients(model)
        if self.scaler is not None:
            if finite:  # the scaler found no inf either: it steps (its own check agrees)
                self.scaler.step(optimizer)
            self.scaler.update()  # lowers the scale after a non-finite step
        elif finite:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return finite

    def check_gradients(self, model: nn.Module) -> bool:
        """One fused norm over every gradient: False when it is NaN/inf (nothing is clipped
        then); else clip to ``max_grad_norm`` with that norm. A non-finite gradient must never
        reach the optimizer: one NaN step poisons the weights and, through the next average,
        every rank (issue 41)."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return True
        norm = nn.utils.get_total_norm(grads)
        if not bool(torch.isfinite(norm)):  # the step's one host sync of the check
            return False
        if self.max_grad_norm is not None:
            nn.utils.clip_grads_with_norm_(model.parameters(), self.max_grad_norm, norm)
        return True

    def state_dict(self) -> dict[str, Any] | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def compiled(model: nn.Module) -> nn.Module:
    """``torch.compile(model)``: the compiled wrapper shares the module's parameters, so the
    original module stays what averaging, checkpoints and ``TrainedState`` read."""
    return torch.compile(model)  # type: ignore[return-value]
