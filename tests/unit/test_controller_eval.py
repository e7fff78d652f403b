"""The controller's eval and callbacks on fake ranks: shards, lost shards, stops, keep-best."""

from __future__ import annotations

import logging

import pytest
import torch

from flodl.config import EarlyStoppingConfig, ElCheConfig, MonitorConfig, TrainerConfig
from flodl.runtime.controller.controller import Controller, Hooks
from flodl.runtime.controller.dispatch import count_batches
from flodl.runtime.wire.messages import (
    EvalResult,
    Final,
    Plan,
    RankState,
    Ready,
    Regroup,
    Regrouped,
    Report,
    Settled,
    Stop,
)
from flodl.step.evaluation import SampleMean, shard_range

from .test_controller import FakeLink
from .test_evaluation import SampleCount

N_EVAL = 101  # eval samples: odd, so shards differ in size


def make(world=2, epochs=3, hooks=None, checkpointer=None, **knobs):
    cfg = TrainerConfig(num_epochs=epochs, batch_size=10, elche=ElCheConfig(anchor=5), **knobs)
    ctl = Controller(
        cfg,
        world,
        [1.0] * world,
        has_eval=True,
        hooks=hooks,
        checkpointer=checkpointer,
        eval_metric="accuracy",
    )
    links = [FakeLink() for _ in range(world)]
    for rank, link in enumerate(links):
        ctl.attach(rank, link)
    for rank in range(world):
        ctl.handle(rank, Ready(rank, "sig", 10, 1.0, "cpu", 1000))  # 10 windows an epoch
    return ctl, links


def counted(accuracy_by_epoch):
    """Eval states of a shard: the samples it covered, and a fixed accuracy per epoch."""

    def parts(rank, window):
        start, stop = shard_range(N_EVAL, *window.eval_shard)
        count = SampleCount()
        count.update(torch.zeros(stop - start), torch.zeros(stop - start))
        acc = SampleMean()
        acc.update(accuracy_by_epoch(window.epoch), stop - start)
        return {"count": count, "accuracy": acc}

    return parts


def drive(ctl, links, eval_parts, on_stall=None, settles=lambda rank, w: True):
    """Answer plans, evals, regroups and stops like ranks would, until the controller is done
    (``settles(rank, window)``: that rank's averaging of an epoch's last window held)."""
    done = [0] * len(links)
    stopped: set[int] = set()
    while not ctl.finished():
        progressed = False
        for rank, link in enumerate(links):
            while rank in ctl.alive and done[rank] < len(link.sent):
                msg = link.sent[done[rank]]
                done[rank] += 1
                progressed = True
                _answer(ctl, rank, msg, eval_parts, stopped, settles)
        if not progressed:
            assert on_stall is not None, "controller stalled"
            on_stall()
            on_stall = None


def _shards(rank, weights):
    """A rank's checkpoint shards, relayed as payloads (the controller writes them)."""
    mine = {"optimizer": {}, "scheduler": None, "rng": torch.zeros(1), "extra": {}}
    shards = {f"rank{rank}": mine}
    if weights is not None:
        shards["model"] = {"params": weights, "buffers": {}, "outer": None}
    return shards


def _answer(ctl, rank, msg, eval_parts, stopped, settles):
    if isinstance(msg, Plan):
        for w in msg.windows:
            b = count_batches(w.chunks, 10)
            samples = sum(s for _, s in w.chunks)
            ctl.handle(rank, Report(rank, w.index, w.epoch, w.chunks, b, samples, b, b, b))
            if w.settle and settles(rank, w):  # its averaging held
                ctl.handle(rank, Settled(rank, w.index))
            if w.checkpoint_after:  # only the head writes the weights, as a real rank does
                weights = {"w": torch.full((2,), float(w.epoch))} if w.write_weights else None
                ctl.handle(rank, RankState(rank, w.index, w.save_tag, _shards(rank, weights)))
            parts = eval_parts(rank, w) if w.eval_after else None
            if parts is not None:
                ctl.handle(rank, EvalResult(rank, w.epoch, w.index, parts, 1.0, w.eval_shard[0]))
    elif isinstance(msg, Regroup):
        ctl.handle(rank, Regrouped(rank, msg.generation))
    elif isinstance(msg, Stop):
        stopped.add(rank)
        if msg.checkpoint:
            weights = {"w": torch.ones(2)} if msg.write_weights else None
            ctl.handle(rank, RankState(rank, -1, msg.save_tag, _shards(rank, weights)))
        if msg.send_state:
            ctl.handle(rank, Final(rank, {}, {}))


@pytest.mark.parametrize("policy", ["elected", "sharded"])
def test_every_policy_covers_the_eval_set_exactly_once(policy):
    ctl, links = make(world=3, eval_policy=policy)
    drive(ctl, links, counted(lambda e: 0.5))
    epochs = ctl.result().epochs
    assert [m.eval_metrics["count"] for m in epochs] == [N_EVAL] * 3
    assert [m.eval_value for m in epochs] == [0.5] * 3  # task.eval_metric names the value
    shards = [
        w.eval_shard
        for link in links
        for p in link.sent
        if isinstance(p, Plan)
        for w in p.windows
        if w.eval_after
    ]
    expected = {(i, 3) for i in range(3)} if policy == "sharded" else {(0, 1)}
    assert set(shards) == expected and len(shards) == 3 * len(expected)


def test_a_lost_shard_skips_that_epochs_eval_instead_of_hanging(caplog):
    ctl, links = make(world=2, epochs=2, eval_policy="sharded")
    eval_parts = counted(lambda e: 0.5)
    held = lambda rank, w: None if (rank, w.epoch) == (1, 0) else eval_parts(rank, w)  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="flodl"):
        drive(ctl, links, held, on_stall=lambda: ctl.elastic.lose(1, "killed"))
    epochs = ctl.result().epochs
    assert [m.epoch for m in epochs] == [1, 2]
    assert epochs[0].eval_metrics == {} and epochs[0].eval_value is None
    assert epochs[1].eval_metrics["count"] == N_EVAL  # the survivor evaluates all of it
    assert "eval of epoch 1 arrived: that epoch's eval is skipped" in caplog.text


def test_a_shard_lost_after_stop_skips_the_last_epochs_eval_instead_of_hanging(caplog):
    """Found by the chaos matrix (nccl_sync, victim 2 at eval, 4 hangs in 25 tries): Stop goes
    out once the last window is in, before the last epoch's eval shards; a rank lost then was
    handled as a loss after Stop, which kept the epoch waiting for its shard for ever."""
    ctl, links = make(world=2, epochs=2, eval_policy="sharded")
    eval_parts = counted(lambda e: 0.5)
    held = lambda rank, w: None if (rank, w.epoch) == (1, 1) else eval_parts(rank, w)  # noqa: E731

    def lose_after_stop() -> None:
        assert ctl.stopping()  # the loss comes after Stop, as in the matrix's hang
        ctl.elastic.on_failure(1, "rank 1 exited with code -9")

    with caplog.at_level(logging.WARNING, logger="flodl"):
        drive(ctl, links, held, on_stall=lose_after_stop)
    epochs = ctl.result().epochs
    assert [m.epoch for m in epochs] == [1, 2]
    assert epochs[0].eval_metrics["count"] == N_EVAL
    assert epochs[1].eval_metrics == {} and epochs[1].eval_value is None
    assert "eval of epoch 2 arrived: that epoch's eval is skipped" in caplog.text


def test_a_survivor_whose_last_average_failed_after_stop_does_not_keep_the_epoch_open():
    """Found once rank starts got fast (the fork server): Stop goes out once the last window is
    reported, before it is averaged. Rank 1 lost in that average leaves rank 0 with a failed
    average and no new membership to wait for (the run is stopping), so neither acknowledges
    the epoch's last window: the epoch stayed open for ever (and rank 0 failed waiting for a
    regroup). Now a loss after Stop gives up every acknowledgement still awaited."""
    ctl, links = make(world=2, epochs=1)

    def lose_after_stop() -> None:
        assert ctl.stopping() and ctl.final is not None  # rank 0 stopped with its own weights
        ctl.elastic.on_failure(1, "rank 1 exited with code -9")

    unsettled = lambda rank, w: False  # noqa: E731 - both averages of the last window failed
    drive(ctl, links, counted(lambda e: 0.5), on_stall=lose_after_stop, settles=unsettled)
    result = ctl.result()
    assert [m.epoch for m in result.epochs] == [1] and result.epochs[0].eval_value == 0.5
    assert ctl.members.lost == [1]


def test_a_relayed_shard_the_launcher_cannot_write_ends_the_run_with_the_error(
    tmp_path, monkeypatch
):
    """Found by review: a save whose relayed shard (a rank streamed it; the launcher writes it)
    failed to write stayed pending for ever, so a run ending naturally never finished (its
    final save at Stop has no deadline). Now the save is discarded and the error is the run's."""
    from flodl.checkpoint import shards
    from flodl.runtime.controller.snapshots import Checkpointer

    real = shards.write_shard

    def disk_full(stem, tag, name, payload):
        if name == "model":
            raise OSError(28, "No space left on device")
        return real(stem, tag, name, payload)

    monkeypatch.setattr(shards, "write_shard", disk_full)
    ctl, links = make(
        world=2, epochs=1, checkpointer=Checkpointer(str(tmp_path / "run"), None, "h", 2)
    )
    drive(ctl, links, counted(lambda e: 0.5))  # stalled here before the fix
    assert not ctl.saves.pending
    assert "No space left on device" in ctl.saves.save_error


def test_early_stopping_stops_after_patience_epochs_without_improvement():
    stopping = EarlyStoppingConfig(monitor="accuracy", mode="max", patience=2)
    ctl, links = make(epochs=6, early_stopping=stopping)
    drive(ctl, links, counted(lambda e: [0.5, 0.7, 0.7, 0.69, 0.9, 0.9][e]))
    result = ctl.result()
    assert [m.epoch for m in result.epochs] == [1, 2, 3, 4]  # best at 2, then 3 and 4 stale
    assert result.stopped == "early_stopping"
    assert result.stopped_early == {"reason": "early_stopping", "epoch": 4}


def test_metrics_fn_may_request_a_stop():
    hooks = Hooks(on_epoch=lambda m: "enough" if m.epoch == 2 else None)
    ctl, links = make(epochs=5, hooks=hooks)
    drive(ctl, links, counted(lambda e: 0.5))
    result = ctl.result()
    assert len(result.epochs) == 2 and result.stopped_early == {"reason": "enough", "epoch": 2}


def test_save_best_keeps_the_bundle_of_the_best_epoch(tmp_path):
    from flodl.checkpoint.bundle import load_bundle
    from flodl.runtime.controller.snapshots import Checkpointer

    stem = str(tmp_path / "run")
    ctl, links = make(
        epochs=4,
        checkpointer=Checkpointer(stem, None, "hash", 2),
        save_path=stem,
        save_best=MonitorConfig(monitor="accuracy", mode="max"),
    )
    drive(ctl, links, counted(lambda e: [0.5, 0.8, 0.6, 0.7][e]))
    payload, meta = load_bundle(stem + "_best")
    assert meta.save_reason == "best" and meta.epoch == 2  # after the 2nd epoch
    assert torch.equal(payload["params"]["w"], torch.full((2,), 1.0))  # epoch index 1's weights
    _, last = load_bundle(stem)
    assert last.save_reason == "final" and last.epoch == 4
    best = ctl.result().best
    assert best == {"monitor": "accuracy", "mode": "max", "value": pytest.approx(0.8), "epoch": 2}
    # every evaluated epoch is checkpointed; epochs 1 and 2 improved, so were copied to _best
    assert ctl.saves.saved == ["checkpoint"] * 4 + ["final"]


def test_epoch_checkpoints_take_the_weights_from_the_head_once_rank_0_is_lost(tmp_path):
    from flodl.checkpoint.bundle import load_bundle
    from flodl.runtime.controller.snapshots import Checkpointer

    stem = str(tmp_path / "run")
    ctl, links = make(epochs=3, checkpointer=Checkpointer(stem, 1, "hash", 2), save_path=stem)
    ctl.elastic.lose(0, "killed")
    drive(ctl, links, counted(lambda e: 0.5))
    checkpoints = [
        w for p in links[1].sent if isinstance(p, Plan) for w in p.windows if w.checkpoint_after
    ]
    assert checkpoints and all(w.write_weights for w in checkpoints)
    assert ctl.saves.saved == ["checkpoint", "checkpoint", "final"]
    assert load_bundle(stem)[1].epoch == 3
