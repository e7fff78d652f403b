"""The controller on fake ranks: plans, coverage, eval election, stop — no processes."""

from __future__ import annotations

import pytest
import torch

from flodl.config import CallbackPolicy, ElCheConfig, TrainerConfig
from flodl.runtime.controller.controller import Controller, RunFailed
from flodl.runtime.controller.dispatch import count_batches
from flodl.runtime.wire.messages import EvalResult, Final, Plan, Ready, Report, Settled, Stop
from flodl.step.evaluation import SampleMean


class FakeLink:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def make(world=2, epochs=2, n=1000, bs=10, has_eval=True, **elche):
    cfg = TrainerConfig(num_epochs=epochs, batch_size=bs, elche=ElCheConfig(**elche))
    ctl = Controller(cfg, world, [1.0, 0.5][:world], has_eval=has_eval)
    links = [FakeLink() for _ in range(world)]
    for rank, link in enumerate(links):
        ctl.attach(rank, link)
    for rank in range(world):
        ctl.handle(rank, Ready(rank, "sig", 10, 1.0, "cpu", n))
    return ctl, links


def half(rank, window):
    """A rank's eval states: a sample mean of 0.5 over its shard."""
    metric = SampleMean()
    metric.update(0.5, 10)
    return {"accuracy": metric}


def drive(ctl, links, ms_per_batch=(1.0, 2.0), bs=10, eval_parts=half):
    """Answer every planned window like real ranks would, until Stop."""
    done = [0] * len(links)
    stopped = [False] * len(links)
    while not all(stopped):
        progressed = False
        for rank, link in enumerate(links):
            while done[rank] < len(link.sent):
                msg = link.sent[done[rank]]
                done[rank] += 1
                progressed = True
                if isinstance(msg, Plan):
                    for w in msg.windows:
                        b = count_batches(w.chunks, bs)
                        ctl.handle(
                            rank,
                            Report(
                                rank,
                                w.index,
                                w.epoch,
                                w.chunks,
                                b,
                                sum(s for _, s in w.chunks),
                                b * ms_per_batch[rank],
                                1.0 * b,
                                b,
                                prev_sync_ms=1.0,
                                prev_divergence=0.01,
                                lr=1e-3,
                            ),
                        )
                        if w.settle:  # its averaging held (real ranks say so after it)
                            ctl.handle(rank, Settled(rank, w.index))
                        if w.eval_after:
                            parts = eval_parts(rank, w)
                            result = EvalResult(rank, w.epoch, w.index, parts, 1.0, w.eval_shard[0])
                            ctl.handle(rank, result)
                elif isinstance(msg, Stop):
                    stopped[rank] = True
                    if msg.send_state:
                        ctl.handle(rank, Final(rank, {}, {}))
        assert progressed, "controller stalled"


def test_every_epoch_is_covered_exactly_and_run_finishes():
    ctl, links = make()
    drive(ctl, links)
    assert ctl.finished()
    result = ctl.result()
    assert [m.epoch for m in result.epochs] == [1, 2]  # counted from 1, as the console
    assert all(result.coverage.exact(e) for e in (0, 1))
    assert result.samples == 2000
    assert all(m.eval_value == 0.5 for m in result.epochs)


def test_cadence_shares_follow_speed():
    ctl, links = make(epochs=3, n=6000)
    drive(ctl, links, ms_per_batch=(1.0, 2.5))
    share = ctl.result().epochs[-1].per_rank_batch_share
    assert share[0] == pytest.approx(2.5 / 3.5, abs=0.05)


def test_sync_mode_plans_lock_step_windows():
    ctl, links = make(mode="nccl_sync", anchor=1)
    drive(ctl, links)
    windows = [w for m in links[0].sent if isinstance(m, Plan) for w in m.windows]
    assert all(count_batches(w.chunks, 10) == 1 for w in windows)
    assert ctl.result().epochs[0].per_rank_batch_share == [0.5, 0.5]


def test_eval_goes_to_the_fastest_rank_or_the_pinned_one():
    ctl, links = make(epochs=2)
    drive(ctl, links, ms_per_batch=(3.0, 1.0))
    evals = [w for m in links[1].sent if isinstance(m, Plan) for w in m.windows if w.eval_after]
    assert len(evals) >= 1  # rank 1 is the fastest once calibrated

    cfg = TrainerConfig(
        num_epochs=1, batch_size=10, callback_policy=CallbackPolicy(kind="rank", rank=0)
    )
    pinned = Controller(cfg, 2, [1.0, 1.0], has_eval=True)
    pl = [FakeLink(), FakeLink()]
    for r in range(2):
        pinned.attach(r, pl[r])
        pinned.handle(r, Ready(r, "sig", 10, 1.0, "cpu", 100))
    drive(pinned, pl, ms_per_batch=(3.0, 1.0))
    assert any(w.eval_after for m in pl[0].sent if isinstance(m, Plan) for w in m.windows)


def test_mismatched_architectures_fail():
    cfg = TrainerConfig()
    ctl = Controller(cfg, 2, [1.0, 1.0], has_eval=False)
    for r in range(2):
        ctl.attach(r, FakeLink())
    ctl.handle(0, Ready(0, "aaa", 10, 1.0, "cpu", 100))
    with pytest.raises(RunFailed, match="different model architectures"):
        ctl.handle(1, Ready(1, "bbb", 10, 1.0, "cpu", 100))


def test_lookahead_keeps_one_window_queued():
    _ctl, links = make()
    plans = [m for m in links[0].sent if isinstance(m, Plan)]
    assert len(plans) == 2  # the current window and the next one


def test_graceful_stop_mid_epoch_saves_the_uncovered_rest(tmp_path):
    from flodl.checkpoint.bundle import load_bundle
    from flodl.runtime.controller.snapshots import Checkpointer
    from flodl.runtime.wire.messages import RankState

    cfg = TrainerConfig(num_epochs=2, batch_size=10, elche=ElCheConfig(anchor=2))
    stem = str(tmp_path / "ck")
    ctl = Controller(
        cfg, 2, [1.0, 1.0], has_eval=False, checkpointer=Checkpointer(stem, None, "hash", 2)
    )
    links = [FakeLink(), FakeLink()]
    for r in range(2):
        ctl.attach(r, links[r])
        ctl.handle(r, Ready(r, "sig", 10, 1.0, "cpu", 1000))
    # answer only the first window, then ask to stop
    for rank in range(2):
        w = links[rank].sent[0].windows[0]
        b = count_batches(w.chunks, 10)
        ctl.handle(
            rank,
            Report(
                rank,
                w.index,
                w.epoch,
                w.chunks,
                b,
                sum(s for _, s in w.chunks),
                1.0,
                1.0,
                b,
                prev_sync_ms=1.0,
                lr=1e-3,
            ),
        )
    ctl.begin_stop("interrupted")
    assert not any(isinstance(m, Stop) for m in links[0].sent)  # window 1 is still in flight
    in_flight = {r: [m for m in links[r].sent[1:] if isinstance(m, Plan)] for r in range(2)}
    assert in_flight[0]  # the lookahead window(s) planned before the stop
    for rank in range(2):
        for plan in in_flight[rank]:
            for w in plan.windows:
                b = count_batches(w.chunks, 10)
                ctl.handle(
                    rank,
                    Report(
                        rank,
                        w.index,
                        w.epoch,
                        w.chunks,
                        b,
                        sum(s for _, s in w.chunks),
                        1.0,
                        1.0,
                        b,
                        prev_sync_ms=1.0,
                        lr=1e-3,
                    ),
                )
    assert not [m for m in links[0].sent if isinstance(m, Plan)][len(in_flight[0]) + 1 :]
    stops = [m for m in links[0].sent if isinstance(m, Stop)]
    assert len(stops) == 1 and stops[0].checkpoint
    weights = {"w": torch.zeros(2)}
    assert [s.write_weights for s in stops] == [True]
    for rank in range(2):
        mine = {"optimizer": {}, "scheduler": None, "rng": torch.zeros(1), "extra": {}}
        shards = {f"rank{rank}": mine}
        if rank == 0:
            shards["model"] = {"params": weights, "buffers": {}, "outer": None}
        ctl.handle(rank, RankState(rank, -1, stops[0].save_tag, shards))
    ctl.handle(0, Final(0, weights, {}))
    assert ctl.finished()
    _, meta = load_bundle(stem)
    assert meta.save_reason == "interrupted" and meta.epoch == 0
    covered = sum(
        s
        for link in links
        for m in link.sent
        if isinstance(m, Plan)
        for w in m.windows
        for _, s in w.chunks
    )
    assert sum(size for _, size in meta.coverage["uncovered"]) == 1000 - covered


def test_an_epoch_closes_only_once_its_last_averaging_held():
    """Collective modes: the epoch's last window is reported before it is averaged; the epoch
    closes when every rank has said its averaging held (Settled), not on the reports alone."""
    ctl, links = make(epochs=1, has_eval=False)
    held, seen = [], [0] * len(links)
    while any(seen[r] < len(link.sent) for r, link in enumerate(links)):
        for rank, link in enumerate(links):
            while seen[rank] < len(link.sent):
                msg = link.sent[seen[rank]]
                seen[rank] += 1
                for w in msg.windows if isinstance(msg, Plan) else ():
                    b = count_batches(w.chunks, 10)
                    samples = sum(s for _, s in w.chunks)
                    report = Report(rank, w.index, w.epoch, w.chunks, b, samples, 1.0 * b, 1.0, b)
                    ctl.handle(rank, report)
                    held += [(rank, w.index)] if w.settle else []
    assert len(held) == 2 and not ctl.aggregator.closed_epochs  # reported, unsettled: open
    ctl.handle(*held[0][:1], Settled(*held[0]))
    assert not ctl.aggregator.closed_epochs  # one rank's averaging is still unconfirmed
    ctl.handle(*held[1][:1], Settled(*held[1]))
    assert len(ctl.aggregator.closed_epochs) == 1


@pytest.mark.parametrize(("ms", "expected"), [(1.0, 250), (0.1, 2500), (200.0, 10)])
def test_one_rank_windows_last_a_quarter_second_once_measured(ms, expected):
    """One rank averages with nobody: after the first report its windows hold ~0.25 s of
    batches (``elche.anchor`` at least), not ``anchor`` batches each (window boundaries cost a
    fast model several per cent of its time); every sample is still covered once."""
    ctl, links = make(world=1, epochs=2, n=50_000, has_eval=False)
    drive(ctl, links, ms_per_batch=(ms,))
    windows = [w for m in links[0].sent if isinstance(m, Plan) for w in m.windows]
    sizes = [count_batches(w.chunks, 10) for w in windows]
    assert sizes[:2] == [10, 10]  # planned before any report: anchor batches
    ends = {max(i for i, w in enumerate(windows) if w.epoch == e) for e in (0, 1)}
    measured = [s for i, s in enumerate(sizes) if i >= 2 and i not in ends]
    assert measured and set(measured) == {expected}  # an epoch's last window holds the rest
    result = ctl.result()
    assert all(result.coverage.exact(e) for e in (0, 1))
    assert result.samples == 100_000


@pytest.mark.parametrize("mode", ["cpu_async", "cpu_cadence", "nccl_cadence"])
def test_cpu_async_takes_each_epochs_last_average_whole(mode):
    """cpu_async blends averages in, but every rank waits for its epoch's last and takes it
    whole (``Window.consensus``): the epoch ends at one set of weights. No other mode needs it
    (their averages are whole already)."""
    ctl, links = make(epochs=3, n=2000, mode=mode)
    drive(ctl, links)
    for link in links:
        windows = [w for m in link.sent if isinstance(m, Plan) for w in m.windows]
        last = {w.epoch: w.index for w in windows}  # each epoch's last window
        assert len(windows) > len(last)  # windows blended in, not only each epoch's last
        whole = {w.index for w in windows if w.consensus}
        assert whole == (set(last.values()) if mode == "cpu_async" else set())
