"""Compressed averaging in the controller's modes (``elche.compress`` with cpu_cadence and
cpu_async; flodl/runtime/sync/codec.py) on real 2- and 3-rank rigs: the bytes on the wire per
average, the ranks' weights identical after every cadence average, training as good as
uncompressed, and a lost rank with checkpoints and a resume."""

from __future__ import annotations

import hashlib
import os
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.recipes.models import MLP
from flodl.recipes.steps import accuracy, classification_step
from tests.integration.helpers import CLASSES, SHAPE, data, model_factory, optim_factory

pytestmark = pytest.mark.slow

# A fixed cadence (fixed anchor and shares, no meta-controller): the same windows whatever the
# timing, so the runs differ only by compression. Anchor 2: 48 averages in 2 epochs, so the
# first, uncompressed one weighs little in the totals.
FIXED = {
    "anchor": 2,
    "min_anchor": 2,
    "max_anchor": 2,
    "partition_ratios": [0.5, 0.5],
    "meta_controller": False,
}
N_PARAMS = 64 * 32 + 32 + 32 * 4 + 4  # the helpers' MLP: 2212 fp32 values


def hashing_step(out: str, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """classification_step, after writing a digest of the weights it starts from to a file of
    this process's own: a window's first step starts from the average just taken."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    with open(Path(out) / f"{os.getpid()}.txt", "a") as f:
        f.write(hashlib.sha1(flat.numpy().tobytes()).hexdigest() + "\n")
    return classification_step(model, batch)


def _run(
    tmp_path: Path,
    mode: str,
    compress: str,
    ranks: int = 2,
    cluster: dict[str, Any] | None = None,
    **knobs: Any,
):
    """2 epochs of the helpers' task on the rig; the weights' digests under ``hashes/``."""
    out = tmp_path / f"{mode}-{compress}-{len(cluster or {})}"
    hashes = out / "hashes"
    hashes.mkdir(parents=True)
    handle = (
        Trainer.builder(model_factory, optim_factory, partial(hashing_step, str(hashes)))
        .dataset(partial(data, "train", 1536))
        .eval_dataset(partial(data, "test"))
        .eval_fn(accuracy)
        .batch_size(32)
        .num_epochs(2)
        .elche(ElCheConfig(mode=mode, compress=compress, **knobs))
        .cluster(
            ClusterConfig(
                kind="cpu_rig",
                ranks=ranks,
                speeds=[1.0, 0.5, 0.5][:ranks],
                warmup_steps=3,
                **(cluster or {}),
            )
        )
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(out)
        .run()
    )
    handle.join(timeout=240)
    result = handle.result
    assert result.summary.status == "ok" and result.coverage_exact
    return result, [set(p.read_text().split()) for p in sorted(hashes.glob("*.txt"))]


def _bytes(result) -> tuple[float, float]:
    """Bytes on the wire per average (up and down), and per average sent compressed."""
    a = result.summary.averaging
    total = a["up_bytes"] + a["down_bytes"]
    whole = a["uncompressed"] * 2 * 2 * N_PARAMS * 4  # 2 ranks, up and down, fp32
    packed = a["averages"] - a["uncompressed"]
    return total / a["averages"], (total - whole) / packed if packed else float("nan")


def test_cadence_compressed_halves_and_quarters_the_bytes_with_identical_ranks(tmp_path):
    """cpu_cadence at a fixed cadence, uncompressed, bf16 and int8: per average, bf16 sends
    half the bytes and int8 a quarter (plus a scale per 4096 values), the first average
    whole; after every average both ranks start from the same fp32 weights, bit for bit; the
    final loss and accuracy stay those of the uncompressed run."""
    runs = {c: _run(tmp_path, "cpu_cadence", c, **FIXED) for c in ("none", "bf16", "int8")}
    base, base_hashes = runs["none"]
    per_average, _ = _bytes(base)
    assert per_average == 2 * 2 * N_PARAMS * 4  # every snapshot and average whole
    for kind, total_bound, packed_ratio in (("bf16", 0.55, 0.5), ("int8", 0.30, 0.2505)):
        result, hashes = runs[kind]
        s = result.summary
        assert s.averaging["compress"] == kind and s.averaging["uncompressed_windows"] == [0]
        assert s.syncs == base.summary.syncs == s.averaging["averages"]
        total, packed = _bytes(result)
        assert total / per_average <= total_bound, (kind, total / per_average)
        assert packed / per_average == pytest.approx(packed_ratio, abs=0.001)
        # every average's consensus is a window's start on both ranks (but the last's)
        shared = hashes[0] & hashes[1]
        assert len(shared) >= s.averaging["averages"] - 1, (kind, len(shared))
        # issue 38's goal: loss within 1 %, accuracy within 0.2 pt (here: one test sample of
        # 256 at most); measured +0.17 % (bf16) and +0.07 % (int8), the same accuracy
        assert s.final_loss == pytest.approx(base.summary.final_loss, rel=0.01)
        assert abs(s.eval_value - base.summary.eval_value) <= 1 / 256
    assert len(base_hashes[0] & base_hashes[1]) >= base.summary.averaging["averages"] - 1


def test_cpu_sync_compresses_as_cpu_cadence(tmp_path):
    """cpu_sync (an average every step, through the controller) takes the same path: half the
    bytes in bf16 once compressing, the ranks identical after every average, the same loss."""
    base, _ = _run(tmp_path, "cpu_sync", "none")
    half, hashes = _run(tmp_path, "cpu_sync", "bf16")
    per_average, _ = _bytes(base)
    total, packed = _bytes(half)
    assert packed / per_average == pytest.approx(0.5) and total / per_average < 0.52
    assert len(hashes[0] & hashes[1]) >= half.summary.averaging["averages"] - 1
    assert half.summary.final_loss == pytest.approx(base.summary.final_loss, rel=0.05)


def big_model(device: torch.device) -> torch.nn.Module:
    """9.66 M parameters: a bf16 change (19.3 MB) streams in two pieces of 16 MiB and spans
    five lock cells of the controller's sum."""
    return MLP(SHAPE, CLASSES, hidden=140_000).to(device)


def test_packed_snapshots_over_tcp_sum_as_through_shared_memory(tmp_path):
    """The launcher sums a packed change as it streams: over loopback TCP in frames, or from
    the rank's shared file in pieces. With a change larger than a piece, a fixed cadence of
    bf16 averages ends in the same weights, bit for bit, either way."""
    out = {}
    for shm in (True, False):
        handle = (
            Trainer.builder(big_model, optim_factory, classification_step)
            .dataset(partial(data, "train", 512))
            .batch_size(32)
            .num_epochs(1)
            .elche(ElCheConfig(mode="cpu_cadence", compress="bf16", **FIXED))
            .cluster(ClusterConfig(kind="cpu_rig", ranks=2, warmup_steps=2, shared_memory=shm))
            .logger(LoggerConfig(progress="off", tensorboard=False))
            .output_dir(tmp_path / str(shm))
            .run()
        )
        handle.join(timeout=240)
        out[shm] = handle.result
        assert out[shm].summary.status == "ok"
        assert out[shm].summary.averaging["uncompressed_windows"] == [0]
        assert out[shm].summary.averaging["averages"] >= 3
    assert out[True].summary.averaging == out[False].summary.averaging
    for name, p in out[True].state.params.items():
        assert torch.equal(p, out[False].state.params[name]), name


def test_async_compressed_cuts_the_bytes_and_trains_as_well(tmp_path):
    """cpu_async, uncompressed, bf16 and int8: the bytes per average fall to about a half and
    a quarter (a rank's first ``max_overshoot + 1`` snapshots go whole: it holds no average
    yet), every rank takes the epoch's last average (the consensus) bit for bit, and the
    final loss and accuracy stay near the uncompressed run's (async blends on arrival, so the
    runs' timing, not only compression, makes them differ)."""
    runs = {c: _run(tmp_path, "cpu_async", c, **FIXED) for c in ("none", "bf16", "int8")}
    base, _ = runs["none"]
    per_average, _ = _bytes(base)
    assert per_average == 2 * 2 * N_PARAMS * 4
    for kind, total_bound, packed_bound in (("bf16", 0.55, 0.53), ("int8", 0.33, 0.30)):
        result, hashes = runs[kind]
        s = result.summary
        assert s.averaging["uncompressed_windows"] == [0]
        total, packed = _bytes(result)
        assert total / per_average <= total_bound, (kind, total / per_average)
        assert packed / per_average <= packed_bound, (kind, packed / per_average)
        # the initial weights and the first epoch's consensus, taken whole by both ranks
        assert len(hashes[0] & hashes[1]) >= 2
        # uncompressed runs alone differ by about +-10 % in loss here (three repeats: 0.0119
        # to 0.0142); int8 measured 0.0138 to 0.0147, bf16 0.0120 to 0.0127, and once, in a
        # loaded clean-clone CI run, 0.0169 against 0.0126: async's final loss follows the
        # arrival timing; accuracy (below) stayed the same in every run
        assert s.final_loss == pytest.approx(base.summary.final_loss, rel=0.5)
        assert abs(s.eval_value - base.summary.eval_value) <= 0.02


def test_compressed_cadence_survives_a_lost_rank_and_resumes(tmp_path, monkeypatch):
    """int8 x a rank SIGKILLed after its second report x checkpoints every epoch, 3 ranks:
    the survivors regroup, their next average goes whole (the references are dropped on
    both ends), the rest compressed again; the run ends with exact coverage, and a resume
    from its bundle trains on, its first average whole again."""
    monkeypatch.setenv("FLODL_CHAOS", "2:report:2")
    stem = str(tmp_path / "ckpt" / "run")
    knobs = {**FIXED, "partition_ratios": None}

    def run(name: str, epochs: int, ranks: int, **trainer: Any):
        builder = (
            Trainer.builder(model_factory, optim_factory, classification_step)
            .dataset(partial(data, "train", 1536))
            .eval_dataset(partial(data, "test"))
            .eval_fn(accuracy)
            .batch_size(32)
            .num_epochs(epochs)
            .elche(ElCheConfig(mode="cpu_cadence", compress="int8", **knobs))
            .cluster(
                ClusterConfig(
                    kind="cpu_rig", ranks=ranks, speeds=[1.0, 0.5, 0.5][:ranks], warmup_steps=3
                )
            )
            .logger(LoggerConfig(progress="off", tensorboard=False))
            .output_dir(tmp_path / name)
        )
        cfg = builder.build_config().with_(**trainer)
        handle = Trainer.run(
            model_factory,
            optim_factory,
            classification_step,
            cfg,
            dataset=partial(data, "train", 1536),
            eval_dataset=partial(data, "test"),
            eval_fn=accuracy,
            job_dir=tmp_path / name,
        )
        handle.join(timeout=240)
        return handle.result

    lost = run("lost", 2, 3, save_path=stem, checkpoint_every=1, max_failure=1)
    s = lost.summary
    assert s.status == "ok" and s.lost_ranks == [2] and lost.coverage_exact
    assert all(bool(torch.isfinite(p).all()) for p in lost.state.params.values())
    whole = s.averaging["uncompressed_windows"]
    # the first average, and one after the loss: the first window averaged without rank 2,
    # or the next averaged (a window the loss itself completes is averaged before the Regroup
    # goes out, to ranks still holding the reference; the next is the first after it)
    since = [
        e.index
        for e in lost.events
        if e.index >= min(e.index for e in lost.events if e.batches[2] == 0)
    ]
    assert len(whole) == 2 and whole[0] == 0 and whole[1] in since[:2], (whole, since)
    assert s.averaging["averages"] > 4  # the rest went compressed

    monkeypatch.delenv("FLODL_CHAOS")
    resumed = run("resumed", 3, 2, resume_from=stem)
    r = resumed.summary
    assert r.status == "ok" and r.epochs == 3
    assert [m.epoch for m in resumed.epochs] == [3]  # the third epoch only
    assert r.averaging["uncompressed"] == 1 < r.averaging["averages"]
    assert r.eval_value >= s.eval_value - 0.02


def test_async_compressed_over_a_slow_link_survives_a_rank_lost_at_start(tmp_path, monkeypatch):
    """bf16 x cpu_async x a slow modelled link x a rank killed in its first moments (``hello``)
    x checkpoints, 3 ranks: the two survivors train with exact coverage, and their averages
    after the first go compressed."""
    monkeypatch.setenv("FLODL_CHAOS", "1:hello")
    builder = (
        Trainer.builder(model_factory, optim_factory, classification_step)
        .dataset(partial(data, "train", 1536))
        .eval_dataset(partial(data, "test"))
        .eval_fn(accuracy)
        .batch_size(32)
        .num_epochs(2)
        .elche(ElCheConfig(mode="cpu_async", compress="bf16"))
        .cluster(
            ClusterConfig(
                kind="cpu_rig", ranks=3, speeds=[1.0, 0.5, 0.5], warmup_steps=3,
                link={"bandwidth_gbps": 0.2, "latency_ms": 1.0},
            )
        )
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / "early")
    )  # fmt: skip
    cfg = builder.build_config().with_(
        save_path=str(tmp_path / "ckpt" / "run"), checkpoint_every=1, max_failure=1
    )
    handle = builder.config(cfg).run()
    handle.join(timeout=240)
    result = handle.result
    s = result.summary
    assert s.status == "ok" and s.lost_ranks == [1] and result.coverage_exact
    a = s.averaging
    assert a["compress"] == "bf16" and a["averages"] > a["uncompressed"] >= 1
    assert all(bool(torch.isfinite(p).all()) for p in result.state.params.values())
