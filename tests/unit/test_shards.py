"""Sharded bundles (no processes): meta last as the commit marker, orphans cleaned, damage
refused, pending saves that survive rank loss, and the per-rank mapping of a resume."""

from __future__ import annotations

import itertools

import fsspec
import pytest
import torch

from flodl.checkpoint import shards
from flodl.checkpoint.bundle import BundleMeta, CheckpointError, load_bundle
from flodl.config import ElCheConfig, TrainerConfig
from flodl.runtime.controller.snapshots import Checkpointer, ResumePoint
from flodl.runtime.wire.messages import RankState


@pytest.fixture(params=["path", "memory"])
def stem(request, tmp_path):
    if request.param == "path":
        yield str(tmp_path / "ck" / "run")
        return
    yield "memory://flodl-shards-test/ck/run"
    fsspec.filesystem("memory").rm("/flodl-shards-test", recursive=True)


def _meta(epoch: int) -> BundleMeta:
    return BundleMeta(
        schema_version=2,
        epoch=epoch,
        global_step=epoch * 10,
        sync_round=epoch,
        world_size=2,
        save_reason="checkpoint",
        elche_state=None,
        coverage={"epoch": epoch, "n_samples": 8, "uncovered": []},
        config_hash="h",
        signature="s",
        saved_at=float(epoch),
    )


def _save(stem: str, epoch: int, **commit) -> str:
    tag = shards.new_tag()
    written = {
        "model": shards.write_shard(
            stem, tag, "model", {"params": {"w": torch.full((4,), float(epoch))}, "buffers": {}}
        ),
        **{
            f"rank{r}": shards.write_shard(
                stem, tag, f"rank{r}", {"optimizer": {"r": r}, "scheduler": None, "rng": None}
            )
            for r in (0, 1)
        },
    }
    shards.commit(stem, _meta(epoch), written, **commit)
    return tag


def _names(stem: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(stem)
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path.rsplit("/", 1)[0], detail=False))


def test_round_trip_and_orphans_of_an_interrupted_save(stem):
    _save(stem, 1)
    orphan = shards.write_shard(stem, shards.new_tag(), "rank0", {"x": torch.ones(2)})
    in_flight = shards.write_shard(stem, "ab" * 6, "rank1", {"x": torch.ones(2)})
    payload, meta = load_bundle(stem)  # an interrupted save changes nothing
    assert meta.epoch == 1 and payload["params"]["w"].tolist() == [1.0] * 4
    assert sorted(payload["optimizer"]) == [0, 1] and payload["optimizer"][1] == {"r": 1}
    _save(stem, 2, in_flight={"ab" * 6})
    names = _names(stem)
    assert orphan.file not in names  # the next commit removed it ...
    assert in_flight.file in names  # ... but not the shard of a save still in flight
    assert len(names) == 1 + 3 + 1  # meta, this bundle's three shards, the in-flight one
    assert load_bundle(stem)[1].epoch == 2


def test_a_damaged_shard_is_refused_and_falling_back_is_asked_for(stem):
    _save(stem, 1)
    _save(stem, 2, keep_previous=True)
    _, meta = load_bundle(stem)
    target = shards.shard_location(stem, meta.shards["rank1"]["file"])
    with fsspec.open(target, "wb") as f:
        f.write(b"garbage")
    with pytest.raises(CheckpointError, match=r"rank1\.pt is corrupt.*epoch 2.*\(epoch 1, step 10"):
        load_bundle(stem)
    payload, older = load_bundle(stem, fallback=True)
    assert older.epoch == 1 and payload["params"]["w"].tolist() == [1.0] * 4
    with pytest.raises(CheckpointError, match="corrupt"):
        ResumePoint.load(stem)


def _rank_state(save, rank: int, weights: bool) -> RankState:
    payloads = {f"rank{rank}": {"optimizer": {"r": rank}, "scheduler": None, "rng": None}}
    if weights:
        payloads["model"] = {"params": {"w": torch.ones(3)}, "buffers": {}, "outer": None}
    return RankState(rank, save.key, save.tag, payloads)


def _fields() -> dict:
    return dict(
        epoch=1,
        global_step=5,
        sync_round=2,
        elche_state=None,
        coverage={"epoch": 1, "n_samples": 8, "uncovered": []},
    )


def test_pending_save_survives_the_loss_of_a_rank_but_not_of_its_writer(tmp_path):
    ck = Checkpointer(str(tmp_path / "run"), 1, "h", 3)
    save = ck.open(7, "checkpoint", 1, [0, 1, 2], writer=1)
    assert ck.collect(_rank_state(save, 1, weights=True)) is None
    assert ck.collect(_rank_state(save, 0, weights=False)) is None
    done = ck.lose(2)  # the states that already arrived complete the save: no waiting
    assert done == [save] and save.missing == [2] and not ck.pending
    ck.commit(done[0], extra={}, **_fields())
    payload, meta = load_bundle(str(tmp_path / "run"))
    assert meta.extra["ranks"] == [0, 1] and meta.extra["missing_ranks"] == [2]
    assert meta.world_size == 2 and sorted(payload["optimizer"]) == [0, 1]

    lost_writer = ck.open(9, "checkpoint", 2, [0, 1], writer=0)
    ck.collect(_rank_state(lost_writer, 1, weights=False))
    assert ck.lose(0) == [] and not ck.pending  # discarded, not waited for
    voided = ck.open(11, "checkpoint", 3, [0, 1], writer=0)
    ck.void(11)
    assert ck.collect(_rank_state(voided, 0, weights=True)) is None  # a late report is ignored
    assert load_bundle(str(tmp_path / "run"))[1].epoch == 1  # the committed bundle stands


def test_save_at_stop_outlives_its_writer_when_a_successor_writes_the_weights(tmp_path):
    """The save at Stop (key -1): its writer lost, the successor writes the weights; its
    earlier report without them does not complete the save, the one with them does."""
    ck = Checkpointer(str(tmp_path / "run"), None, "h", 3)
    save = ck.open(-1, "final", None, [0, 1, 2], writer=0)
    assert ck.collect(_rank_state(save, 2, weights=False)) is None
    assert ck.lose(0, successor=1) == [] and save.writer == 1 and save.missing == [0]
    assert ck.collect(_rank_state(save, 1, weights=False)) is None  # sent before the order
    assert ck.pending == {-1: save}
    takeover = _rank_state(save, 1, weights=True)  # the weights only: its own shard exists
    takeover.shards.pop("rank1")
    assert ck.collect(takeover) is save and not ck.pending
    ck.commit(save, extra={}, **_fields())
    payload, meta = load_bundle(str(tmp_path / "run"))
    assert meta.extra["ranks"] == [1, 2] and meta.extra["missing_ranks"] == [0]
    assert torch.equal(payload["params"]["w"], torch.ones(3))
    window_save = ck.open(4, "checkpoint", 1, [0, 1], writer=0)  # mid-run: no successor
    assert ck.lose(0, successor=1) == [] and not ck.pending and window_save.writer == 0


def test_resume_maps_saved_ranks_onto_any_world_and_restores_the_outer_state(tmp_path):
    stem = str(tmp_path / "run")
    ck = Checkpointer(stem, 1, "h", 3)
    save = ck.open(3, "checkpoint", 1, [0, 2], writer=2)
    ck.collect(_rank_state(save, 0, weights=False))
    ck.collect(_rank_state(save, 2, weights=True))
    centre = torch.arange(3.0)
    save.written["controller"] = shards.write_shard(
        stem,
        save.tag,
        "controller",
        {"center": centre, "outer_previous": centre[:2], "outer_buffer": torch.ones(2)},
    )
    ck.commit(save, extra={"launch_world": 3}, **_fields())
    point = ResumePoint.load(stem)
    assert point.payload is None  # verified, not loaded in the launcher
    assert [point.source_rank(r) for r in range(5)] == [0, 2, 2, 2, 0]
    restore = point.restore_for(1)
    assert isinstance(restore.state, str) and restore.state.endswith(".rank2.pt")
    assert shards.load_shard(restore.state)["optimizer"] == {"r": 2}
    from flodl.runtime.controller.controller import Controller

    cfg = TrainerConfig(elche=ElCheConfig(mode="cpu_cadence", outer="nesterov"))
    ctl = Controller(cfg, 2, [1.0, 1.0], has_eval=False, resume=point)
    held = ctl.aggregator
    assert torch.equal(held.outer.previous, centre[:2])  # an older bundle's centre: not read
    assert torch.equal(held.outer.buffer, torch.ones(2)) and held.outer.n_params == 2


@pytest.mark.parametrize("available", [True, False])
def test_a_local_shard_starts_each_parts_writeback_as_it_goes(tmp_path, monkeypatch, available):
    """Every large part written is handed to the kernel's writeback at its own offset (so the
    final fsync waits for the tail only); without sync_file_range the shard is the same."""
    import hashlib

    calls: list[tuple[int, int]] = []
    real = shards._start_writeback
    if available:
        monkeypatch.setattr(
            shards, "_start_writeback", lambda fd, o, n: (calls.append((o, n)), real(fd, o, n))
        )
    else:
        monkeypatch.setattr(shards, "_writeback", False)
    payload = {"w": torch.randn(5_000_000), "small": torch.ones(3)}  # 20 MB: three 8 MiB parts
    info = shards.write_shard(str(tmp_path / "run"), "t1", "model", payload)
    data = (tmp_path / info.file).read_bytes()
    assert info.bytes == len(data) and info.sha256 == hashlib.sha256(data).hexdigest()
    if available:
        assert sum(n for _, n in calls) == 20_000_000  # the tensor's bytes, every one once
        for (o1, n1), (o2, _) in itertools.pairwise(calls):
            assert o2 == o1 + n1  # contiguous parts, in order
        start = calls[0][0]
        assert data[start : start + 20_000_000] == payload["w"].numpy().tobytes()
    assert torch.equal(shards.load_shard(str(tmp_path / info.file))["w"], payload["w"])
