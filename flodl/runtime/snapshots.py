"""The controller's side of checkpoints: collect every rank's state, write one bundle; resume.

A bundle holds the consensus parameters and buffers (identical on every rank right after an
average), each rank's optimizer, scheduler and RNG state, and the metadata a resumed run needs:
the epoch, the steps and rounds so far, ElChe's calibration and the epoch's uncovered ranges.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from flodl.checkpoint import SCHEMA_VERSION, BundleMeta, load_bundle, save_bundle
from flodl.runtime.messages import RankState, Restore

log = logging.getLogger(__name__)


@dataclass
class Checkpointer:
    """Decides when to save and assembles the bundle from the ranks' ``RankState`` messages."""

    stem: str | None
    every: int | None
    config_hash: str
    world_size: int
    signature: str = ""
    pending: dict[int, dict[int, RankState]] = field(default_factory=dict)
    saved: list[str] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        return self.stem is not None

    def due(self, epoch: int, num_epochs: int) -> bool:
        """Save after ``epoch``? (The last epoch is saved by the end-of-run bundle.)"""
        return (
            self.enabled
            and self.every is not None
            and epoch + 1 < num_epochs
            and (epoch + 1) % self.every == 0
        )

    def collect(self, msg: RankState, expected: int) -> dict[int, RankState] | None:
        """Keep a rank's state; return all of them once ``expected`` ranks have sent theirs."""
        states = self.pending.setdefault(msg.window, {})
        states[msg.rank] = msg
        if len(states) < expected:
            return None
        return self.pending.pop(msg.window)

    def write(
        self, states: dict[int, RankState], reason: str, stem: str | None = None, **fields: Any
    ) -> str:
        """Write the bundle (at ``stem``, default the run's); the weights come from whichever
        rank sent them."""
        stem = stem or self.stem
        assert stem is not None
        source = next(s for s in states.values() if s.params is not None)
        payload = {
            "params": source.params,
            "buffers": source.buffers,
            "optimizer": {r: s.optimizer for r, s in states.items()},
            "scheduler": {r: s.scheduler for r, s in states.items()},
            "scaler": {r: s.scaler for r, s in states.items()},
            "rng": {r: s.rng for r, s in states.items()},
        }
        meta = BundleMeta(
            schema_version=SCHEMA_VERSION,
            world_size=len(states),
            save_reason=reason,
            config_hash=self.config_hash,
            signature=self.signature,
            saved_at=time.time(),
            **fields,
        )
        save_bundle(stem, payload, meta)
        self.saved.append(reason)
        log.info("saved %s bundle %s (epoch %d)", reason, stem, meta.epoch)
        return stem


@dataclass
class ResumePoint:
    """A loaded bundle, ready to hand each rank its state."""

    stem: str
    meta: BundleMeta
    payload: dict[str, Any]

    @classmethod
    def load(cls, stem: str) -> ResumePoint:
        payload, meta = load_bundle(stem)
        return cls(stem, meta, payload)

    def restore_for(self, rank: int) -> Restore:
        p = self.payload
        return Restore(
            params=p["params"],
            buffers=p["buffers"],
            optimizer=p["optimizer"][rank],
            scheduler=p["scheduler"].get(rank),
            rng=p["rng"][rank],
            epoch=self.meta.epoch,
            scaler=p.get("scaler", {}).get(rank),  # bundles before 16-mixed have none
        )

    def uncovered(self) -> list[tuple[int, int]]:
        """The saved epoch's ranges not trained yet (empty at an epoch boundary)."""
        cov = self.meta.coverage or {}
        if cov.get("epoch") != self.meta.epoch:
            return []
        return [(int(o), int(s)) for o, s in cov.get("uncovered", [])]
