"""Outer optimizers on the averaged update (``elche.outer``).

``average`` keeps the plain parameter average. ``nesterov`` is DiLoCo's outer step: treat
``global_before - average`` as a pseudo-gradient and apply Nesterov momentum to it, so rounds of
local work move the consensus like steps of a slow, momentum-driven optimizer. It is applied
identically on every rank (collective modes) or once in the controller (``cpu_*`` modes), so all
copies stay equal.
"""

from __future__ import annotations

import torch

from flodl.config import ElCheConfig, Outer


class NesterovOuter:
    """``m = mu*m + g``; ``w = w_prev - lr*(g + mu*m)``, ``g = w_prev - w_avg`` (params only)."""

    def __init__(self, lr: float, momentum: float, n_params: int) -> None:
        self.lr = lr
        self.momentum = momentum
        self.n_params = n_params
        self.previous: torch.Tensor | None = None
        self.buffer: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, averaged: torch.Tensor) -> torch.Tensor:
        """The new global state from this round's average (buffers pass through unchanged),
        computed in place: ``averaged`` (the caller's to consume: a fresh average, or the
        model's own storage) becomes the result, and no temporary vector is made. With
        ``w_prev = w_avg + g``: ``w = w_avg + (1 - lr) * g - lr * mu * m``."""
        params = averaged[: self.n_params]
        if self.previous is None:
            self.previous = params.detach().clone()
            return averaged
        grad = self.previous.sub_(params)  # the previous state's memory now holds g
        if self.buffer is None:
            self.buffer = grad.clone()  # m = mu * 0 + g
        else:
            self.buffer.mul_(self.momentum).add_(grad)
        params.add_(grad, alpha=1 - self.lr).add_(self.buffer, alpha=-self.lr * self.momentum)
        self.previous.copy_(params)
        return averaged

    def reset(self, params: torch.Tensor) -> None:
        """Start from ``params`` (the consensus before the first round)."""
        self.previous = params[: self.n_params].detach().clone()


def make_outer(config: ElCheConfig, n_params: int) -> NesterovOuter | None:
    if config.outer is Outer.NESTEROV:
        return NesterovOuter(config.outer_lr, config.outer_momentum, n_params)
    return None
