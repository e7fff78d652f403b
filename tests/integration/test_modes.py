"""Every working mode, end to end, on a real 2-rank CPU rig over gloo."""

from __future__ import annotations

import json

import pytest
import torch

from flodl import TrainedState
from recipes.steps import accuracy

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
