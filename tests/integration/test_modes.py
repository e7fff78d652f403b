"""Every working mode, end to end, on a real 2-rank CPU rig over gloo."""

from __future__ import annotations

import json

import pytest
import torch

from flodl import TrainedState
from flodl.recipes.steps import accuracy

from .helpers import data, model_factory, small_run

pytestmark = pytest.mark.slow

MODES = ["solo", "nccl_sync", "nccl_cadence", "cpu_sync", "cpu_cadence", "cpu_async"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("modes")
    return {mode: small_run(root, mode) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_mode_trains_and_covers_every_sample_once(runs, mode):
    handle, _ = runs[mode]
    result = handle.result
    assert result.summary.status == "ok"
    assert result.coverage_exact
    world = 1 if mode == "solo" else 2
    assert result.summary.world_size == world
    assert result.summary.samples_seen == 2 * 1536
    assert len(result.epochs) == 2
    assert result.epochs[-1].avg_loss < result.epochs[0].avg_loss
    assert result.summary.eval_value is not None and result.summary.eval_value > 0.8


@pytest.mark.parametrize("mode", MODES)
def test_trained_state_is_the_evaluated_model(runs, mode):
    handle, state = runs[mode]
    model = state.load_into(model_factory(torch.device("cpu")))
    x, y = data("test").tensors
    assert accuracy(model, x, y) == pytest.approx(handle.result.summary.eval_value, abs=0.02)
    saved = TrainedState.load(handle.job_dir / "model.pt")
    for key, value in state.state_dict().items():
        assert torch.equal(saved.state_dict()[key], value)


@pytest.mark.parametrize("mode", ["nccl_cadence", "cpu_cadence", "cpu_async"])
def test_cadence_gives_the_fast_rank_proportionally_more(runs, mode):
    handle, _ = runs[mode]
    share = handle.result.summary.per_rank_batch_share
    assert share[0] == pytest.approx(2 / 3, abs=0.08), share


@pytest.mark.parametrize("mode", ["nccl_sync", "cpu_sync"])
def test_sync_splits_equally_and_averages_every_step(runs, mode):
    handle, _ = runs[mode]
    result = handle.result
    assert result.summary.per_rank_batch_share == pytest.approx([0.5, 0.5], abs=0.02)
    assert result.summary.syncs == pytest.approx(2 * 1536 / 32 / 2, abs=2)


@pytest.mark.parametrize("mode", MODES)
def test_outputs_are_written(runs, mode):
    handle, _ = runs[mode]
    job = handle.job_dir
    summary = json.loads((job / "summary.json").read_text())
    for key in (
        "status",
        "mode",
        "world_size",
        "epochs",
        "final_loss",
        "eval_metric",
        "eval_value",
        "wall_s",
        "syncs",
        "mean_sync_ms",
        "samples_per_s",
        "per_rank_batch_share",
        "per_rank_throughput",
    ):
        assert key in summary, key
    assert summary["mode"] == mode
    assert len(summary["per_rank_throughput"]) == summary["world_size"]
    assert list((job / "tb").glob("events.out.tfevents.*"))
    for rank in range(summary["world_size"]):
        assert list((job / "tb" / f"rank_{rank}").glob("events.out.tfevents.*"))
    if summary["world_size"] > 1:
        assert (job / "rank_1.log").exists()
        trace = [json.loads(line) for line in (job / "elche_trace.jsonl").read_text().splitlines()]
        assert len(trace) == summary["syncs"]
        assert {"anchor", "overhead", "sync_ms", "divergence", "verdict", "batches"} <= set(
            trace[0]
        )


def recording_step(out_dir: str, model, batch):
    """The classification step, saving this rank's parameters before it and its batch."""
    import os

    from flodl.recipes.steps import classification_step

    rank, calls = os.environ["FLODL_RANK"], len(os.listdir(out_dir))
    torch.save(
        {"params": [p.detach().clone() for p in model.parameters()], "batch": batch},
        f"{out_dir}/{rank}.{calls:04d}.{os.getpid()}",
    )
    return classification_step(model, batch)


def rmsprop(params):
    return torch.optim.RMSprop(params, lr=5e-3)


def test_nccl_sync_steps_are_the_full_batch_steps_of_both_ranks_batches(tmp_path):
    """DDP's semantics through the whole worker (sample weights, the LR rule, backward-time
    buckets, the optimizer step): every step equals one full-batch step on the union of the
    two ranks' batches at the scaled LR, exactly (RMSprop: sign-like, it amplifies any
    difference in the gradient), and both replicas stay equal."""
    from functools import partial
    from pathlib import Path

    from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
    from flodl.recipes.steps import classification_step

    calls = tmp_path / "calls"
    calls.mkdir()
    (
        Trainer.builder(model_factory, rmsprop, partial(recording_step, str(calls)))
        .dataset(partial(data, "train", 384))
        .batch_size(32)
        .num_epochs(1)
        .elche(ElCheConfig(mode="nccl_sync"))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=2))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .output_dir(tmp_path / "job")
        .run()
        .join(timeout=240)
    )
    by_rank = {
        r: [torch.load(p) for p in sorted(Path(calls).glob(f"{r}.*"))][3:]  # 1 + 2 probe calls
        for r in (0, 1)
    }
    assert [len(by_rank[0]), len(by_rank[1])] == [6, 6]  # 384 / 32 / 2 ranks
    model = model_factory(torch.device("cpu"))
    with torch.no_grad():
        for p, q in zip(model.parameters(), by_rank[0][0]["params"], strict=True):
            p.copy_(q)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=5e-3 * 2)  # lr x (1 + (2 - 1) x 1)
    for a, b in zip(by_rank[0], by_rank[1], strict=True):
        for p, q0, q1 in zip(model.parameters(), a["params"], b["params"], strict=True):
            assert torch.equal(q0, q1)  # the replicas
            assert torch.allclose(p.detach(), q0, rtol=0, atol=1e-6)  # the full-batch step
        na, nb = len(a["batch"][0]), len(b["batch"][0])
        loss = (
            classification_step(model, a["batch"]) * na
            + classification_step(model, b["batch"]) * nb
        )
        (loss / (na + nb)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
