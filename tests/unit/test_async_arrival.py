"""cpu_async: an average that arrives while the rank trains is blended in between two steps, not
at the end of the windows the rank ran meanwhile (``Worker._take_arrived``)."""

from __future__ import annotations

import collections
import queue
from types import SimpleNamespace

from flodl.runtime.links import QueueLink
from flodl.runtime.messages import Average, Plan, Stop
from flodl.runtime.worker import WindowTally, Worker


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

    rank._apply_average = apply
    return rank, applied, box


def test_every_average_at_the_head_of_the_inbox_is_blended_in_and_timed() -> None:
    rank, applied, box = _rank([3, 4], [Average(3, None), Average(4, None)])
    tally = WindowTally(0.0)
    Worker._take_arrived(rank, tally)
    assert applied == [3, 4] and rank._outstanding == [] and box.empty()
    assert tally.blend_ms >= 0.0


def test_plans_queued_ahead_of_an_average_do_not_hold_it_back() -> None:
    """The controller plans ahead, so plans queue in front of an average: they move to the
    loop's pending messages in their order, and the average behind them is blended in now."""
    first, second = Plan(windows=()), Plan(windows=())
    rank, applied, box = _rank([3], [first, second, Average(3, None)])
    Worker._take_arrived(rank, WindowTally(0.0))
    assert applied == [3] and box.empty()
    assert list(rank._pending) == [first, second]
    assert rank._pending[0] is first


def test_a_stop_ahead_of_an_average_keeps_both_in_order() -> None:
    stop = Stop("done")
    rank, applied, box = _rank([3], [stop, Average(3, None)])
    Worker._take_arrived(rank, WindowTally(0.0))
    assert applied == [] and rank._outstanding == [3]
    assert box.get_nowait() is stop and isinstance(box.get_nowait(), Average)


def test_nothing_is_blended_while_micro_batches_wait_for_their_step() -> None:
    rank, applied, box = _rank([3], [Average(3, None)], pending_micro_batches=1)
    Worker._take_arrived(rank, WindowTally(0.0))
    assert applied == [] and box.qsize() == 1


def test_an_empty_inbox_returns_at_once() -> None:
    rank, applied, _ = _rank([3], [])
    Worker._take_arrived(rank, WindowTally(0.0))
    assert applied == [] and rank._outstanding == [3]
