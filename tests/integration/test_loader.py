"""The data path on a real 2-rank CPU rig over gloo: DataLoader workers fed by the plan load
exactly the planned samples (dict samples, collated as they are), keep the rig's speed ratio,
survive a killed rank and resume mid-epoch."""

from __future__ import annotations

from functools import partial

import psutil
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer, record_scalar
from flodl.checkpoint.bundle import load_bundle
from flodl.data.source import epoch_permutation
from flodl.recipes.models import MLP
from flodl.runtime.cohorts import fork_server
from flodl.runtime.controller.events import RunFailed

from .helpers import CLASSES, SHAPE, data, optim_factory, rank_pid

pytestmark = pytest.mark.slow

N = 1536


class DictSamples(Dataset):
    """Hugging Face style samples: ``{"x", "y", "id"}`` (not a TensorDataset: no fast path)."""

    def __init__(self, n: int = N) -> None:
        self.x, self.y = data("train", n).tensors

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i], "id": torch.tensor(i, dtype=torch.float64)}


def dict_step(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    ids = batch["id"]
    # Per-batch means of these, in a known ratio, give the epoch's sums of ids and squares.
    record_scalar("id_sum", float(ids.sum()))
    record_scalar("id_sq", float((ids * ids).sum()))
    record_scalar("n", float(ids.numel()))
    return F.cross_entropy(model(batch["x"]), batch["y"])


def dict_eval(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return model(batch["x"]), batch["y"]


def big_model(device: torch.device) -> torch.nn.Module:
    """Steps slow enough that one loader worker keeps ahead of the fast rank (shared CPUs)."""
    return MLP(SHAPE, CLASSES, hidden=512).to(device)


def rank_process(rank: int) -> psutil.Process:
    """The rank itself, not one of its loader workers (they inherit FLODL_RANK)."""
    return psutil.Process(rank_pid(rank))


def loader_run(tmp_path, name, epochs=2, metrics_fn=None, dataset=None, **trainer):
    cfg = (
        Trainer.builder(big_model, optim_factory, dict_step)
        .batch_size(32)
        .num_epochs(epochs)
        .elche(ElCheConfig(mode="nccl_cadence"))
        # A nominal step 10x the measured one (~1 ms here): a batch's load (~2 ms, its worker
        # sharing the 2 cores) and the scheduler's stalls under a loaded CI stay inside the
        # paced step, so the rig's ratio is what the planner sees (margin 3 under two CPU hogs
        # gave the fast rank 0.60-0.69 of the batches, and 0.54 once in CI; margin 10: 2/3 in
        # 12 of 12 epochs under the same hogs).
        .cluster(
            ClusterConfig(
                kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=3, pace_margin=10.0
            )
        )
        .loader(num_workers=1, prefetch_factor=4)
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .build_config()
        .with_(**trainer)
    )
    return Trainer.run(
        big_model,
        optim_factory,
        dict_step,
        cfg,
        dataset=dataset or partial(DictSamples, N),
        eval_dataset=partial(DictSamples, 256),
        eval_step=dict_eval,
        eval_loss=F.cross_entropy,
        metrics_fn=metrics_fn,
        job_dir=tmp_path / name,
    )


EXACT = pytest.approx((N * (N - 1) / 2, (N - 1) * N * (2 * N - 1) / 6))


def _epoch_ids(metrics, samples: float = N) -> tuple[float, float]:
    """The sums of the ids and their squares an epoch trained (``samples`` of them)."""
    s = metrics.scalars
    return s["id_sum"] / s["n"] * samples, s["id_sq"] / s["n"] * samples


def _no_loader_workers_left() -> bool:
    kept = fork_server.server_pid()  # the fork server outlives a run; what it forks does not
    return not [
        p for p in psutil.Process().children(recursive=True) if p.pid != kept and p.is_running()
    ]


def kill_rank_1_after(epoch: int):
    """A metrics_fn that SIGKILLs rank 1 once, when ``epoch`` has closed."""
    killed: list[int] = []

    def metrics(m):
        if m.epoch == epoch and not killed:
            rank_process(1).kill()
            killed.append(1)

    return metrics


def assert_survived_exactly(result, epochs: int) -> None:
    """Rank 1 lost, the run ok, every sample trained once in every epoch as loaded (the lost
    rank's unfinished chunks trained by the survivor)."""
    assert result.summary.status == "ok", result.summary.error
    assert result.summary.lost_ranks == [1]
    assert result.coverage_exact and result.summary.samples_seen == epochs * N
    for m in result.epochs:
        assert _epoch_ids(m) == EXACT


def test_workers_load_exactly_the_plan_keep_the_ratio_and_survive_a_kill(tmp_path):
    """Dict samples through one worker per rank; rank 1 is SIGKILLed once epoch 2 closed
    (with ranks quick to start, epoch 3 could be over by then: a fourth is still to come)."""
    metrics = kill_rank_1_after(2)
    handle = loader_run(tmp_path, "workers", epochs=4, metrics_fn=metrics)
    handle.join(timeout=180)
    result = handle.result
    assert_survived_exactly(result, epochs=4)
    calibrated = result.epochs[1].per_rank_batch_share  # epoch 2: both ranks, calibrated
    # The fast rank does clearly more (2/3 at its speed; an equal split is 1/2); how close to
    # 2/3 a real loader gets at full speed is bench/loader.py's to measure.
    assert 0.6 <= calibrated[0] <= 0.72, calibrated
    last = result.epochs[-1].per_rank_batch_share  # killed in epoch 3 (or 4): less, or none
    assert last[1] < calibrated[1], (calibrated, last)
    assert result.summary.eval_value is not None  # dict batches reach eval_step as dicts
    assert _no_loader_workers_left()


def test_workers_in_cpu_async_with_checkpoints_survive_a_kill(tmp_path):
    """Where the data path meets the other features: cpu_async (snapshots to the controller,
    windows that overshoot), a bundle every epoch, rank 1 SIGKILLed once epoch 1 closed."""
    metrics = kill_rank_1_after(1)
    stem = str(tmp_path / "ckpt" / "run")
    handle = loader_run(
        tmp_path, "async", epochs=3, metrics_fn=metrics, save_path=stem, checkpoint_every=1,
        elche=ElCheConfig(mode="cpu_async"),
    )  # fmt: skip
    handle.join(timeout=180)
    result = handle.result
    assert_survived_exactly(result, epochs=3)
    _, meta = load_bundle(stem)  # the last bundle loads, saved by the survivor
    assert meta.epoch == 3 and meta.extra["lost_ranks"] == [1]
    assert _no_loader_workers_left()


def test_resume_mid_epoch_with_workers(tmp_path, monkeypatch):
    """Rank 1 is killed in its 3rd window: max_failure=0 saves mid-epoch and stops; the
    resumed run (a worker on both ranks) trains exactly what was left."""
    monkeypatch.setenv("FLODL_CHAOS", "1:window:3")
    stem = str(tmp_path / "ckpt" / "run")
    first = loader_run(tmp_path, "killed", max_failure=0, save_path=stem)
    with pytest.raises(RunFailed, match="max_failure=0"):
        first.join(timeout=120)
    _, meta = load_bundle(stem)
    assert meta.save_reason == "max_failure" and meta.extra["lost_ranks"] == [1]
    left = [(int(o), int(n)) for o, n in meta.coverage["uncovered"]]
    epoch, todo_n = meta.epoch, sum(n for _, n in left)
    assert meta.coverage["epoch"] == epoch < 2 and 0 < todo_n < N  # stopped inside an epoch
    monkeypatch.delenv("FLODL_CHAOS")
    resumed = loader_run(tmp_path, "resumed", resume_from=stem)
    resumed.join(timeout=120)
    result = resumed.result
    assert result.summary.status == "ok", result.summary.error
    assert result.summary.samples_seen == (1 - epoch) * N + todo_n
    # The resumed epoch trains exactly its saved uncovered ranges (this run's coverage of it
    # is partial by design), the next epoch every sample once.
    perm = epoch_permutation(N, 42, epoch).double()
    todo = torch.cat([perm[o : o + n] for o, n in left])
    first, *rest = result.epochs
    assert _epoch_ids(first, float(todo_n)) == pytest.approx(
        (float(todo.sum()), float((todo * todo).sum()))
    )
    assert all(_epoch_ids(m) == EXACT for m in rest)
    assert _no_loader_workers_left()


def write_shards(root, per_shard: list[int]) -> list[str]:
    """webdataset-layout tar shards of the helpers' data: ``<id>.x`` (raw float32), ``<id>.y``."""
    import io
    import tarfile

    x, y = data("train", N).tensors
    paths, i = [], 0
    for s, n in enumerate(per_shard):
        path = root / f"train-{s:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for _ in range(n):
                for ext, blob in (("x", x[i].numpy().tobytes()), ("y", str(int(y[i])).encode())):
                    info = tarfile.TarInfo(f"{i:06d}.{ext}")
                    info.size = len(blob)
                    tar.addfile(info, io.BytesIO(blob))
                i += 1
        paths.append(str(path))
    return paths


def decode_shard_sample(sample: dict) -> dict:
    x = torch.frombuffer(bytearray(sample["x"]), dtype=torch.float32).view(*SHAPE)
    key = float(sample["__key__"])
    return {"x": x, "y": torch.tensor(int(sample["y"])), "id": torch.tensor(key).double()}


def test_tar_shards_dispatched_whole_exactly_once_with_a_loss(tmp_path):
    """12 tar shards through one worker per rank; rank 1 is SIGKILLed once epoch 1 closed: the
    survivor trains its unfinished shards, every sample once per epoch."""
    from flodl.data.streams import ShardStream

    shards = write_shards(tmp_path, [128] * 12)
    metrics = kill_rank_1_after(1)
    handle = loader_run(
        tmp_path, "shards", metrics_fn=metrics,
        dataset=partial(ShardStream, shards, decode=decode_shard_sample),
    )  # fmt: skip
    handle.join(timeout=180)
    result = handle.result
    assert_survived_exactly(result, epochs=2)
    share = result.epochs[0].per_rank_batch_share  # whole shards, still throughput-weighted
    assert 0.5 < share[0] < 0.9, share
