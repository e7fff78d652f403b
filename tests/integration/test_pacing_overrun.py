"""The CPU rig says when it did not hold its speed ratios: paced steps past their deadlines.

A rank's pacer pads each step to ``T / speed``; a step that takes longer than that (the cores
oversubscribed by loader workers, other ranks or processes) cannot be padded, and the simulated
device was slower than asked. The overrun time travels in each Report into the per-epoch and
per-run telemetry (``pace_overrun_fraction``), and the run warns above 10 %. Time a step spends
waiting in a collective (nccl_sync's gradient all-reduce, inside the step) is not an overrun.
"""

from __future__ import annotations

import json
import logging
from functools import partial

import pytest

from flodl import ClusterConfig, ElCheConfig, LoggerConfig, Trainer
from flodl.rig.pacing import Pacer
from tests.integration.helpers import data, late_step, model_factory, optim_factory


def test_the_pacer_counts_only_the_time_past_each_deadline():
    import time

    pacer = Pacer(0.5)
    pacer.run(lambda: time.sleep(0.03))
    assert pacer.overrun_s == 0.0  # not calibrated yet: nothing is paced
    pacer.set_nominal(0.01)  # deadline 20 ms at speed 0.5
    pacer.run(lambda: None)
    assert pacer.overrun_s == 0.0  # padded, not overrun
    pacer.run(lambda: time.sleep(0.05))
    assert 0.025 < pacer.overrun_s < 0.2  # ~30 ms past the 20 ms deadline
    before = pacer.overrun_s

    def waits_in_a_collective() -> None:
        time.sleep(0.05)
        pacer.exempt(0.05)  # all of it waiting for a peer: the step's own work was on time

    pacer.run(waits_in_a_collective)
    assert pacer.overrun_s == before


def test_overrunning_ranks_are_reported_and_warned_about(tmp_path, caplog):
    metrics = []
    handle = (
        Trainer.builder(model_factory, optim_factory, late_step)
        .dataset(partial(data, "train", 256))
        .batch_size(32)
        .num_epochs(2)
        .elche(ElCheConfig(mode="nccl_cadence"))
        .cluster(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5], warmup_steps=3))
        .logger(LoggerConfig(progress="off", tensorboard=False))
        .metrics_fn(metrics.append)
        .output_dir(tmp_path / "job")
    )
    with caplog.at_level(logging.WARNING, logger="flodl.job"):
        run = handle.run()
        run.join(timeout=240)
    summary = run.result.summary
    assert summary.status == "ok"
    for t in summary.telemetry:
        # Each step ran ~20 ms past a deadline of a few ms: most of the compute time (the rest
        # of the training time is the ranks' averaging and waiting for each other).
        compute = t["busy_fraction"] + t["data_wait_fraction"]
        assert 0.5 * compute < t["pace_overrun_fraction"] <= compute
        assert t["pace_overrun_fraction"] > 0.15
    assert [m.epoch for m in metrics] == [1, 2]
    assert all(s["pace_overrun_fraction"] > 0.15 for m in metrics for s in m.per_rank)
    # The summary records what the ranks were paced to, so two jobs can be compared fairly.
    rig = json.loads((tmp_path / "job" / "summary.json").read_text())["rig"]
    assert rig == summary.rig and rig["speeds"] == [1.0, 0.5] and rig["pace_margin"] == 1.3
    assert 0 < rig["calibrated_step_ms"] < 20  # the step, not the injected lateness
    assert rig["nominal_step_ms"] == pytest.approx(rig["calibrated_step_ms"] * 1.3)
    assert rig["overrun_fraction"] == max(t["pace_overrun_fraction"] for t in summary.telemetry)
    warned = [r.getMessage() for r in caplog.records if "past their deadlines" in r.getMessage()]
    assert (
        len(warned) == 1 and "rank 0 (speed 1.0)" in warned[0] and "rank 1 (speed 0.5)" in warned[0]
    )


STEPS: list[int] = []


def counted_step(model, batch):
    from flodl.recipes.steps import classification_step

    STEPS.append(len(batch[0]))
    return classification_step(model, batch)


def test_only_a_paced_run_spends_steps_on_calibration(tmp_path):
    """Calibration times 1 + warmup_steps probe steps to agree on a nominal step; a run with
    nothing to pace (a GPU, a solo run without rig speeds) skips them: its start-up is that
    much shorter (a ResNet-20 solo on CPU: ~5 s) and no probe copy of the model is made."""
    counts = {}
    for paced in (False, True):
        STEPS.clear()
        cluster = ClusterConfig(
            kind="cpu_rig", ranks=1, speeds=[1.0] if paced else None, warmup_steps=3
        )
        (
            Trainer.builder(model_factory, optim_factory, counted_step)
            .dataset(partial(data, "train", 320))
            .batch_size(32)
            .num_epochs(2)
            .cluster(cluster)
            .logger(LoggerConfig(progress="off", tensorboard=False))
            .output_dir(tmp_path / str(paced))
            .run()
            .join(timeout=120)
        )
        counts[paced] = len(STEPS)
        summary = json.loads((tmp_path / str(paced) / "summary.json").read_text())
        assert (summary["rig"] is not None) == paced  # nothing paced: no nominal step to record
    assert counts == {False: 2 * 10, True: 2 * 10 + 1 + 3}
