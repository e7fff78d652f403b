"""The controller's side of checkpoints: open a save, collect what the ranks wrote, commit the
meta last; and resume, on any world size.

Ranks write their own shards (:mod:`flodl.checkpoint.shards`): the launcher sees only their names,
sizes
and hashes, except on a store only it can reach (``memory://``), where ranks stream the shard
payloads to it in bounded frames and it writes them one at a time. A save is *pending* from the
moment it is planned until every expected rank reported; a rank lost meanwhile is dropped from
it (the bundle then lacks that rank's optimizer state, recorded in ``extra.missing_ranks``),
unless it was the one writing the weights: then the save is discarded and the next one (the
next ``checkpoint_every`` epoch, or the save at the end) goes ahead as usual. Nothing waits on
a lost rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from flodl.checkpoint import shards
from flodl.checkpoint.bundle import BundleMeta, CheckpointError, load_bundle
from flodl.runtime.wire.messages import RankState, Restore

log = logging.getLogger(__name__)


class ShardWriteFailed(CheckpointError):
    """A rank could not write its shard; the message is the rank's own ``Type: message``."""


@dataclass
class PendingSave:
    """One save in progress: who must still report, and what was written."""

    key: int  # the checkpoint's window index, or -1 for the save at Stop
    tag: str
    reason: str
    epoch: int | None  # completed epochs (None: the resume point, decided at commit)
    writer: int  # the rank writing the weights
    expected: set[int]
    written: dict[str, shards.ShardInfo] = field(default_factory=dict)
    reported: set[int] = field(default_factory=set)
    missing: list[int] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.expected <= self.reported and shards.MODEL in self.written


@dataclass
class Checkpointer:
    """Decides when to save, tracks saves in flight, and commits each one's meta last."""

    stem: str | None
    every: int | None
    config_hash: str
    world_size: int
    signature: str = ""
    pending: dict[int, PendingSave] = field(default_factory=dict)
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

    def open(
        self, key: int, reason: str, epoch: int | None, members: list[int], writer: int
    ) -> PendingSave:
        save = PendingSave(key, shards.new_tag(), reason, epoch, writer, set(members))
        self.pending[key] = save
        return save

    def collect(self, msg: RankState) -> PendingSave | None:
        """Record a rank's shards (writing relayed payloads); the save once it is complete."""
        save = self.pending.get(msg.window)
        if save is None or save.tag != msg.tag or msg.rank not in save.expected:
            return None  # a discarded save's late report
        if msg.error:
            del self.pending[save.key]
            self.discard(save, f"rank {msg.rank} could not write its shard: {msg.error}")
            raise ShardWriteFailed(msg.error)
        assert self.stem is not None
        for name, shard in msg.shards.items():
            if not isinstance(shard, shards.ShardInfo):  # relayed: the launcher writes it
                shard = self._relay(save, msg.rank, name, shard)
            save.written[name] = shard
        save.reported.add(msg.rank)
        return self._take(save)

    def _relay(self, save: PendingSave, rank: int, name: str, payload: Any) -> shards.ShardInfo:
        """Write a shard a rank streamed to the launcher's own store. A failure discards the
        save (a save left pending would keep a run that ends naturally waiting for ever)."""
        assert self.stem is not None
        try:
            return shards.write_shard(self.stem, save.tag, name, payload)
        except Exception as exc:
            from flodl.monitor.failures import describe

            del self.pending[save.key]
            why = f"writing rank {rank}'s {name} shard failed: {describe(exc)}"
            self.discard(save, why)
            raise ShardWriteFailed(why) from exc

    def _take(self, save: PendingSave) -> PendingSave | None:
        if not save.complete:
            return None
        del self.pending[save.key]
        return save

    def lose(self, rank: int, successor: int | None = None) -> list[PendingSave]:
        """A rank is gone: drop it from every pending save; the saves that are now complete.
        The save at Stop outlives the loss of its weights' writer when a ``successor`` (a
        survivor holding the same weights) is given: it writes them instead, and is awaited."""
        done = []
        for save in list(self.pending.values()):
            if rank not in save.expected or rank in save.reported:
                continue
            save.expected.discard(rank)
            save.missing.append(rank)
            if rank == save.writer:
                if save.key == -1 and successor in save.expected:
                    log.warning(
                        "checkpoint %s (%s): rank %d, which was writing the weights, was lost; "
                        "rank %d writes them instead",
                        self.stem,
                        save.reason,
                        rank,
                        successor,
                    )
                    save.writer = successor
                    save.reported.discard(successor)  # its report with the weights is awaited
                    continue
                del self.pending[save.key]
                self.discard(save, f"rank {rank}, which was writing the weights, was lost")
                continue
            complete = self._take(save)
            if complete is not None:
                done.append(complete)
        return done

    def void(self, key: int) -> None:
        """The window carrying a save was voided (a loss): that save will not happen."""
        save = self.pending.pop(key, None)
        if save is not None:
            self.discard(save, "its window was voided by a rank loss; it is planned again")

    def discard(self, save: PendingSave, why: str) -> None:
        log.warning("checkpoint %s (%s) discarded: %s", self.stem, save.reason, why)
        if self.stem is not None:
            shards.discard(self.stem, save.tag)

    def commit(self, save: PendingSave, extra: dict[str, Any], **fields: Any) -> str:
        """Write the meta naming every shard: the bundle exists from here on."""
        assert self.stem is not None
        ranks = sorted(int(n.removeprefix("rank")) for n in save.written if n.startswith("rank"))
        meta = BundleMeta(
            schema_version=shards.SHARDED_SCHEMA,
            world_size=len(ranks),
            save_reason=save.reason,
            config_hash=self.config_hash,
            signature=self.signature,
            saved_at=time.time(),
            extra={**extra, "ranks": ranks, "missing_ranks": sorted(save.missing)},
            **fields,
        )
        in_flight = {s.tag for s in self.pending.values()}
        shards.commit(self.stem, meta, save.written, in_flight=in_flight)
        self.saved.append(save.reason)
        log.info("saved %s bundle %s (epoch %d)", save.reason, self.stem, meta.epoch)
        return self.stem


@dataclass
class ResumePoint:
    """A verified bundle, ready to hand each rank the shards it resumes from."""

    stem: str
    meta: BundleMeta
    payload: dict[str, Any] | None = None  # loaded in the launcher: schema 1, or memory://

    @classmethod
    def load(cls, stem: str, fallback: bool = False) -> ResumePoint:
        """Verify every shard's size and sha256 (streamed: nothing is loaded into memory)."""
        payload, meta = _open(stem, fallback)
        point = cls(stem, meta, payload)
        point.check_finite()
        return point

    def check_finite(self) -> None:
        """Refuse a bundle whose weights hold NaN/inf before any rank starts: resuming would
        train on (and average in) nothing but NaN. Loads the weights shard once, here."""
        import torch

        model = self.payload if self.payload is not None else None
        if model is None:
            model = shards.load_shard(self._location(shards.MODEL))
        for group in ("params", "buffers"):
            for name, tensor in (model.get(group) or {}).items():
                floating = torch.is_tensor(tensor) and tensor.is_floating_point()
                if floating and not bool(torch.isfinite(tensor).all()):
                    raise CheckpointError(
                        f"the bundle's weights are NaN/inf ({name}, epoch "
                        f"{self.meta.epoch}); refused. Resume from an earlier bundle"
                    )

    @property
    def ranks(self) -> list[int]:
        """The ranks whose optimizer state the bundle holds."""
        if self.payload is not None:
            return sorted(self.payload["optimizer"])
        return sorted(int(n.removeprefix("rank")) for n in self.meta.shards if n.startswith("rank"))

    def source_rank(self, rank: int) -> int:
        """Whose optimizer state ``rank`` takes over: its own if saved, else one by modulo."""
        saved = self.ranks
        return rank if rank in saved else saved[rank % len(saved)]

    def restore_for(self, rank: int, lr_factor: float = 1.0) -> Restore:
        src = self.source_rank(rank)
        if self.payload is not None:
            p = self.payload
            model = {"params": p["params"], "buffers": p["buffers"], "outer": p.get("outer")}
            state = {
                "optimizer": p["optimizer"][src],
                "scheduler": p["scheduler"].get(src),
                "rng": p["rng"][src],
                "extra": (p.get("extra") or {}).get(src),
                "scaler": (p.get("scaler") or {}).get(src),  # bundles before 16-mixed have none
            }
            every = tuple({"optimizer": p["optimizer"][r]} for r in self.ranks)
            return Restore(model, state, self.meta.epoch, lr_factor, every)
        return Restore(
            self._location(shards.MODEL),
            self._location(shards.rank_shard(src)),
            self.meta.epoch,
            lr_factor,
            tuple(self._location(shards.rank_shard(r)) for r in self.ranks),
        )

    def _location(self, name: str) -> str:
        return shards.shard_location(self.stem, self.meta.shards[name]["file"])

    def controller_state(self) -> dict[str, Any] | None:
        """The cpu_* modes' controller-side state (EASGD centre, outer momentum), if saved."""
        if self.payload is not None:
            return self.payload.get("controller")
        if shards.CONTROLLER not in self.meta.shards:
            return None
        return shards.load_shard(self._location(shards.CONTROLLER))

    def uncovered(self) -> list[tuple[int, int]]:
        """The saved epoch's ranges not trained yet (empty at an epoch boundary)."""
        cov = self.meta.coverage or {}
        if cov.get("epoch") != self.meta.epoch:
            return []
        return [(int(o), int(s)) for o, s in cov.get("uncovered", [])]


def _open(stem: str, fallback: bool) -> tuple[dict[str, Any] | None, BundleMeta]:
    """Schema 2 on a shared store: verified, not loaded. Otherwise loaded here."""
    from flodl.checkpoint.bundle import _read_metas
    from flodl.checkpoint.store import BundleStore, normalize_stem

    store = BundleStore(normalize_stem(stem))
    files = store.listing()
    metas, _ = _read_metas(store, files)
    current = [c for c in metas if c.group == ""]
    if current and current[0].meta.shards and not shards.process_local(stem):
        meta = current[0].meta
        problems = shards.shard_problems(store, meta, files)
        if not problems:
            return None, meta
    payload, meta = load_bundle(stem, fallback=fallback)  # names every problem, or falls back
    return payload, meta
