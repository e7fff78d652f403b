"""``nccl_sync``'s gradient all-reduce: bucketed, launched during backward, weighted by samples.

This is DDP's Reducer in small: the parameters are split into buckets of about
``bucket_mb`` (in reverse registration order, the order backward produces their gradients); a
``register_post_accumulate_grad_hook`` counts each bucket's gradients in, and once a bucket is
complete its weighted all-reduce starts asynchronously while backward goes on with the earlier
layers. Buckets are launched strictly in index order, so every rank issues the same collectives
in the same order. :meth:`GradSync.finish` (before the optimizer step) launches what is left
(a parameter without a gradient contributes zeros), waits, and makes each parameter's gradient
its slice of the reduced bucket. As DDP's, the bucket buffers are kept across steps (a fresh
bucket-sized tensor each step costs a CPU rank page faults and zeroing) and the gradients are
views into them (``gradient_as_bucket_view``: no copy back). Each rank scales its gradients by
its share of the step's samples, so the sum is the gradient of the mean loss over the global
batch, unequal batch sizes included; every rank then steps with the same gradient and keeps
identical parameters.

A collective that fails (a peer is gone) leaves the rank's own gradients in place: the rank
steps locally and the regroup's re-average brings the survivors together (as a failed
parameter average does in the other modes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flodl.rig import links
from flodl.runtime.sync import groups
from flodl.runtime.sync.averaging import load_into, weighted_buffers

#: torch DDP's default bucket size.
BUCKET_MB = 25.0


def plan_buckets(params: Sequence[nn.Parameter], bucket_mb: float = BUCKET_MB) -> list[list[int]]:
    """Indices of ``params`` grouped into buckets of at most ``bucket_mb`` (one parameter larger
    than that is a bucket of its own), last parameter first."""
    limit = bucket_mb * 2**20
    buckets: list[list[int]] = []
    size = 0.0
    for i in reversed(range(len(params))):
        n = params[i].numel() * params[i].element_size()
        if not buckets or size + n > limit:
            buckets.append([])
            size = 0.0
        buckets[-1].append(i)
        size += n
    return buckets


class GradSync:
    """Bucketed, overlapped, sample-weighted gradient all-reduce over the default group."""

    def __init__(
        self,
        model: nn.Module,
        bucket_mb: float = BUCKET_MB,
        doomed: Callable[[], bool] | None = None,
        buffers: Sequence[torch.Tensor] = (),
    ) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Float buffers (BatchNorm's running statistics), averaged with ``buffer_weight`` in the
        # same step, their all-reduce launched with the last bucket's: one wait, inside the step
        # (as DDP broadcasts its buffers inside forward), not a second collective after it.
        self.buffers = list(buffers)
        self.buffer_weight = 1.0
        self.buckets = plan_buckets(self.params, bucket_mb)
        self._bucket_of = {id(self.params[i]): b for b, ix in enumerate(self.buckets) for i in ix}
        self._doomed = doomed
        self.armed = False  # reduce this backward's gradients (the last micro-batch of a step)
        self.weight = 1.0  # this rank's share of the step's samples
        # One flat buffer per bucket, kept across steps as DDP keeps its buckets: a fresh
        # bucket-sized tensor every step is a fresh mmap, page-faulted and zeroed by the kernel
        # (a 50 MB bucket: ~5-10 ms a step on a CPU rank).
        self._flats: dict[int, torch.Tensor] = {}
        self._reset()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _reset(self) -> None:
        self._left = [len(ix) for ix in self.buckets]
        self._next = 0
        self._works: list[tuple[int, torch.Tensor, Any]] = []
        self._link_s = 0.0  # unpaced: the buckets' modelled time (cluster.link), paid at the end
        self._link_bytes = 0  # ... and their bytes

    def _ready(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        b = self._bucket_of[id(param)]
        self._left[b] -= 1
        while self._next < len(self.buckets) and self._left[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        grads = []
        for i in self.buckets[b]:
            p = self.params[i]
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads.append(g.detach().reshape(-1))
        flat = self._flat(b, grads).mul_(self.weight)  # a copy: the local gradients stay intact
        self._works.append((b, flat, dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True)))
        self._charge(flat)

    def _charge(self, flat: torch.Tensor) -> None:
        """The bucket crosses the modelled link (queued behind the ones before it); inside a
        paced step it is placed on the simulated step's timeline when the step settles."""
        link = links.installed()
        if link is not None:
            nbytes = links.tensor_bytes(flat)
            seconds = link.wire.all_reduce_s(nbytes, dist.get_world_size())
            if link.in_step():
                link.reserve(seconds, nbytes)
            else:
                self._link_s += seconds
                self._link_bytes += nbytes

    def _flat(self, b: int, grads: list[torch.Tensor]) -> torch.Tensor:
        """``grads`` concatenated into bucket ``b``'s kept buffer (a new one when the bucket's
        size, dtype or device changed)."""
        buf = self._flats.get(b)
        n, dtype, device = sum(g.numel() for g in grads), grads[0].dtype, grads[0].device
        if any(g.dtype != dtype for g in grads) or (buf is not None and _aliases(buf, grads)):
            return torch.cat(
                grads
            )  # mixed dtypes, or gradients not set to None since the last step
        if buf is None or (buf.numel(), buf.dtype, buf.device) != (n, dtype, device):
            buf = self._flats[b] = torch.empty(n, dtype=dtype, device=device)
        return torch.cat(grads, out=buf)

    def finish(self) -> None:
        """Launch the buckets still out (and the buffers'), wait for all, write the reduced
        gradients (and buffers) back. Raises (``groups.Abandoned``, RuntimeError) when a
        collective failed: the gradients are then the rank's own, unscaled, and the buffers
        its own."""
        try:
            while self._next < len(self.buckets):
                self._launch(self._next)
                self._next += 1
            works = [work for _, _, work in self._works]
            if self.buffers:
                buffers = weighted_buffers(self.buffers, self.buffer_weight)
                works.append(dist.all_reduce(buffers, async_op=True))
                self._charge(buffers)
            for work in works:
                if self._doomed is not None and dist.get_backend() == "gloo":
                    groups.wait(work, self._doomed)
                else:
                    work.wait()
            link = links.installed()
            if link is not None and self._link_s:  # unpaced: after the real reductions
                link.charge(self._link_s, self._link_bytes)
            for b, flat, _ in self._works:
                self._write_back(b, flat)
            if self.buffers:  # landed only once every collective of the step succeeded
                load_into(self.buffers, buffers)
        except BaseException:
            # A collective given up on may still write into its buffer: never reuse one.
            self._flats.clear()
            raise
        finally:
            self.armed = False
            self._reset()

    @torch.no_grad()
    def _write_back(self, b: int, flat: torch.Tensor) -> None:
        """Each parameter's gradient becomes its slice of the reduced bucket (a view, as DDP's
        ``gradient_as_bucket_view``: no second pass over the bucket); the step's
        ``zero_grad(set_to_none=True)`` lets the bucket go."""
        pos = 0
        for i in self.buckets[b]:
            p = self.params[i]
            n = p.numel()
            reduced = flat[pos : pos + n].view(p.shape)
            if p.grad is not None and p.grad.stride() != reduced.stride():
                p.grad.copy_(reduced)  # a gradient in another memory format keeps its layout
            else:
                p.grad = reduced
            pos += n


def _aliases(buf: torch.Tensor, grads: list[torch.Tensor]) -> bool:
    """Some gradient still lives in ``buf`` (a view the last step made)."""
    ptr = buf.untyped_storage().data_ptr()
    return any(g.untyped_storage().data_ptr() == ptr for g in grads)
