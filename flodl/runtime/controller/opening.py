"""The controller's opening part: the ranks say Ready, the cohort is checked, training starts.

A part of :class:`flodl.runtime.controller.controller.Controller`. :class:`Opening` owns the
members' Ready
messages and the checkpoint a run resumes from: once every member is ready it checks that they
agree (architecture, dataset size), hands each its saved state, and says where training starts
(:class:`Start`). :func:`make_elche` builds the balancer, from the saved state when it fits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flodl.config import ElCheConfig
from flodl.elche import ElChe, ElCheState
from flodl.runtime.controller.events import RunFailed
from flodl.runtime.controller.membership import Membership
from flodl.runtime.controller.snapshots import ResumePoint
from flodl.runtime.wire.messages import Ready
from flodl.runtime.wire.rank_link import Outbound

log = logging.getLogger(__name__)


def make_elche(
    cfg: ElCheConfig, world: int, speeds: list[float], resume: ResumePoint | None
) -> ElChe | None:
    """ElChe for ``world`` ranks (None for one), from a resumed bundle's state when it fits."""
    if world < 2:
        return None
    hint = speeds if len(set(speeds)) > 1 else None
    saved = resume.meta.elche_state if resume is not None else None
    state = ElCheState.from_dict(saved) if saved else None
    if state is not None and state.world_size != world:
        log.warning(
            "checkpoint %s: ElChe state of %d ranks, this run has %d: re-calibrating",
            resume.stem if resume is not None else "",
            state.world_size,
            world,
        )
        state = None
    return ElChe(cfg, world, speed_hint=hint, state=state)


@dataclass(frozen=True)
class Start:
    """Where training starts, as the ready members agreed."""

    n_samples: int  # per epoch
    at: tuple[int, list]  # the first epoch, and its ranges left (a resumed run's)
    ready: list[Ready]  # the members' Ready messages, in arrival order
    signature: str  # the model's architecture fingerprint


class Opening:
    """Collects Ready messages and opens training once every member sent one."""

    def __init__(
        self,
        num_epochs: int,
        lr_scale_ratio: float,
        world: int,
        members: Membership,
        out: Outbound,
        resume: ResumePoint | None,
    ) -> None:
        self.num_epochs, self.lr_scale_ratio = num_epochs, lr_scale_ratio
        self.world, self.members, self.out, self.resume = world, members, out, resume
        self.ready: dict[int, Ready] = {}

    def take(self, msg: Ready) -> bool:
        """A member's Ready (True: kept; a lost rank's is not)."""
        if msg.rank not in self.members.members:
            return False
        self.ready[msg.rank] = msg
        return True

    def forget(self, rank: int) -> None:
        """``rank`` was lost before training began."""
        self.ready.pop(rank, None)

    def all_ready(self) -> bool:
        # Asked on every Ready: the count settles it until the last one.
        if len(self.ready) < len(self.members.members):
            return False
        return set(self.members.members) <= self.ready.keys()

    def missing(self) -> list[int]:
        return sorted(set(self.members.members) - self.ready.keys())

    def calibrated_step_ms(self) -> float:
        """The step the ranks agreed on in calibration (the slowest rank's, before the pace
        margin); 0.0 when nothing is paced."""
        return max((r.step_ms for r in self.ready.values()), default=0.0)

    def memory_plans(self) -> list[str]:
        """Each rank's memory plan as it announced it (cluster.memory_plan); [] when no rank
        had one to announce (no budget)."""
        plans = [self.ready[r].memory_plan for r in range(self.world) if r in self.ready]
        return plans if any(plans) else []

    def devices(self) -> list[str]:
        return [self.ready[r].device for r in range(self.world) if r in self.ready]

    def start(self) -> Start:
        """Every member is ready: check that they agree, resume them, say where to start."""
        signatures = {r.signature for r in self.ready.values()}
        if len(signatures) > 1:
            detail = ", ".join(f"rank {r}: {m.signature}" for r, m in sorted(self.ready.items()))
            raise RunFailed(f"ranks built different model architectures ({detail})")
        bases = {r.base for r in self.ready.values()}
        if len(bases) > 1:  # adapters averaged across different frozen bases mean nothing
            detail = ", ".join(f"rank {r}: {m.base}" for r, m in sorted(self.ready.items()))
            raise RunFailed(
                f"ranks built different frozen bases ({detail}); every rank must load the same "
                "base weights (the same model.pretrained files, or the same config and seed)"
            )
        sizes = {r.n_samples for r in self.ready.values()}
        if len(sizes) > 1:
            raise RunFailed(f"ranks loaded datasets of different sizes: {sorted(sizes)}")
        n_samples, signature = sizes.pop(), signatures.pop()
        at = self._resume_ranks(n_samples, signature)
        if at[0] >= self.num_epochs:
            raise RunFailed(
                f"checkpoint already finished {at[0]} epochs; trainer.num_epochs="
                f"{self.num_epochs} leaves nothing to train"
            )
        return Start(n_samples, at, list(self.ready.values()), signature)

    def _resume_ranks(self, n_samples: int, signature: str) -> tuple[int, list]:
        """Hand every rank its saved state; return the epoch and ranges to start from."""
        if self.resume is None:
            return 0, []
        meta = self.resume.meta
        if meta.signature and meta.signature != signature:
            raise RunFailed(
                f"checkpoint {self.resume.stem} was saved for another model (architecture "
                f"{meta.signature} != {signature}); point trainer.resume_from at this model's"
            )
        saved_n = (meta.coverage or {}).get("n_samples", n_samples)
        if saved_n != n_samples:
            raise RunFailed(
                f"checkpoint saw {saved_n} samples per epoch, the dataset has {n_samples}"
            )
        saved_world = int(meta.extra.get("launch_world", meta.world_size))
        factor = self._lr_factor(self.world) / self._lr_factor(saved_world)
        for rank in self.members.members:
            self.out.send(rank, self.resume.restore_for(rank, lr_factor=factor))
        return meta.epoch, self.resume.uncovered()

    def _lr_factor(self, world: int) -> float:
        return 1.0 + (world - 1) * self.lr_scale_ratio
