"""cpu_async: an average that arrives while the rank trains is blended in between two steps, not
at the end of the windows the rank ran meanwhile (``ControllerSync.between_steps``)."""

from __future__ import annotations

import collections
import queue
from types import SimpleNamespace

import pytest
import torch

from flodl.runtime.rank.loop import WindowTally
from flodl.runtime.rank.peers import Peers
from flodl.runtime.rank.sync_modes import ControllerSync
from flodl.runtime.sync.averaging import FlatState
from flodl.runtime.wire.messages import Average, Plan, Regroup, Stop
from flodl.runtime.wire.rank_link import QueueLink


def _rank(outstanding: list[int], inbox: list, pending_micro_batches: int = 0):
    box: queue.Queue = queue.Queue()
    for msg in inbox:
        box.put(msg)
    applied: list[int] = []
    rank = SimpleNamespace(
        runner=SimpleNamespace(pending=pending_micro_batches),
        link=QueueLink(box, queue.Queue()),
        _outstanding=list(outstanding),
        _pending=collections.deque(),
    )

    def apply(msg: Average) -> None:
        applied.append(msg.window)
        rank._outstanding.remove(msg.window)

    rank.take = apply
    return rank, applied, box


def test_every_average_at_the_head_of_the_inbox_is_blended_in_and_timed() -> None:
    rank, applied, box = _rank([3, 4], [Average(3, None), Average(4, None)])
    tally = WindowTally(0.0)
    ControllerSync.between_steps(rank, tally)
    assert applied == [3, 4] and rank._outstanding == [] and box.empty()
    assert tally.blend_ms >= 0.0


def test_plans_queued_ahead_of_an_average_do_not_hold_it_back() -> None:
    """The controller plans ahead, so plans queue in front of an average: they move to the
    loop's pending messages in their order, and the average behind them is blended in now."""
    first, second = Plan(windows=()), Plan(windows=())
    rank, applied, box = _rank([3], [first, second, Average(3, None)])
    ControllerSync.between_steps(rank, WindowTally(0.0))
    assert applied == [3] and box.empty()
    assert list(rank._pending) == [first, second]
    assert rank._pending[0] is first


def test_a_stop_ahead_of_an_average_keeps_both_in_order() -> None:
    stop = Stop("done")
    rank, applied, box = _rank([3], [stop, Average(3, None)])
    ControllerSync.between_steps(rank, WindowTally(0.0))
    assert applied == [] and rank._outstanding == [3]
    assert box.get_nowait() is stop and isinstance(box.get_nowait(), Average)


def test_nothing_is_blended_while_micro_batches_wait_for_their_step() -> None:
    rank, applied, box = _rank([3], [Average(3, None)], pending_micro_batches=1)
    ControllerSync.between_steps(rank, WindowTally(0.0))
    assert applied == [] and box.qsize() == 1


def test_an_empty_inbox_returns_at_once() -> None:
    rank, applied, _ = _rank([3], [])
    ControllerSync.between_steps(rank, WindowTally(0.0))
    assert applied == [] and rank._outstanding == [3]


def _holder(alpha: float, whole: set[int], share_storage: bool, codec=None):
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    return SimpleNamespace(
        state=FlatState(model, share_storage=share_storage),
        device=torch.device("cpu"),
        alpha=alpha,
        _outstanding=[4, 5],
        _whole=set(whole),
        last_divergence=None,
        codec=codec,  # elche.compress: runtime/sync/codec.py
    )


@pytest.mark.parametrize("share_storage", [True, False])
def test_an_average_is_blended_in_but_an_epochs_last_is_taken_whole(share_storage):
    """EASGD's pull: ``alpha * centre + (1 - alpha) * local``; the epoch's last average
    (``Window.consensus``) replaces the weights, and the guard still sees the blend's
    divergence (``alpha`` times the distance to the centre), so one whole average an epoch
    does not read as a jump."""
    rank = _holder(0.25, {5}, share_storage)
    n = rank.state.n_params
    ControllerSync.take(rank, Average(4, torch.full((n,), 3.0)))
    assert torch.allclose(rank.state.flatten(), torch.full((n,), 1.5))  # 0.25 * 3 + 0.75 * 1
    blended = rank.last_divergence
    assert blended == pytest.approx(0.5 / 1.5)  # ||1 - 1.5|| / ||1.5||
    ControllerSync.take(rank, Average(5, torch.full((n,), 3.5)))
    assert torch.equal(rank.state.flatten(), torch.full((n,), 3.5))
    assert rank.last_divergence == pytest.approx(0.25 * 2.0 / 3.5)
    assert rank._outstanding == [] and rank._whole == set()


def test_a_compressed_average_is_blended_from_the_consensus_it_names():
    """elche.compress: the average comes as a change against the last one taken; the rank
    blends in the consensus (reference + change), which becomes its reference untouched by
    the blend."""
    from flodl.runtime.sync.codec import RankCodec, pack

    codec = RankCodec("bf16")
    rank = _holder(0.5, set(), True, codec)
    n = rank.state.n_params
    codec.receive(3, torch.full((n,), 2.0))
    ControllerSync.take(rank, Average(4, pack("bf16", torch.full((n,), 1.0), base=3)))
    assert torch.equal(rank.state.flatten(), torch.full((n,), 2.0))  # 0.5 * 3 + 0.5 * 1
    assert codec.version == 4 and torch.equal(codec.ref, torch.full((n,), 3.0))


def test_a_void_whole_average_keeps_the_weights_and_is_forgotten():
    rank = _holder(0.5, {4}, True)
    ControllerSync.take(rank, Average(4, None))
    assert torch.equal(rank.state.flatten(), torch.ones(rank.state.n_params))
    assert rank._outstanding == [5] and rank._whole == set()


def test_an_average_arriving_while_a_regroup_is_awaited_is_taken_not_queued() -> None:
    """A regroup can interrupt the wait for an epoch's last average (:meth:`ControllerSync.average`,
    ``limit`` 0). Queued behind, an average that arrives while the rank awaits the new
    membership was out of that wait's reach: the rank blocked on its socket for an average
    already in hand, and the run hung (the ssh chaos test, 1 run in ~10)."""
    rank, applied, box = _rank([3], [Average(3, None), Regroup(2, (0,), 3, {0: 1.0})])
    peers = Peers(0, 2, rank.link, wait_s=1.0)
    peers.bind(regroup=lambda msg: applied.append(("regroup", msg.generation)), take=rank.take)
    peers.await_regroup()
    assert applied == [3, ("regroup", 2)] and rank._outstanding == [] and not peers.inbox
    assert box.empty()
