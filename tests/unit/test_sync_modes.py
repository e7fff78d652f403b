"""The rank's sync mode is one object chosen once from ``elche.mode``
(flodl/runtime/rank/sync_modes.py): collective for ``nccl_*``, through the controller for
``cpu_*`` (even alone: the controller reads the snapshots), nothing to do for ``solo`` or one
rank."""

from __future__ import annotations

import collections
import queue
from types import SimpleNamespace

import pytest
import torch

from flodl.config import ElCheConfig, Mode
from flodl.runtime.rank.sync_modes import CollectiveSync, ControllerSync, SoloSync, sync_for
from flodl.runtime.sync.averaging import FlatState
from flodl.runtime.wire.messages import Regroup, Window
from flodl.runtime.wire.rank_link import QueueLink

CPU = torch.device("cpu")


def _member(world: int = 2):
    model = torch.nn.Linear(3, 2)
    return SimpleNamespace(
        rank=0,
        world=world,
        distributed=False,
        link=QueueLink(queue.Queue(), queue.Queue()),
        model=model,
        state=FlatState(model, share_storage=True),
        device=CPU,
        runner=SimpleNamespace(pending=0, accumulate=1),
        pacer=None,
        _pending=collections.deque(),
        _unaveraged=-1,
        _doomed=lambda: False,
    )


@pytest.mark.parametrize(
    ("mode", "world", "kind"),
    [
        (Mode.NCCL_SYNC, 2, CollectiveSync),
        (Mode.NCCL_CADENCE, 2, CollectiveSync),
        (Mode.NCCL_CADENCE, 1, SoloSync),
        (Mode.SOLO, 1, SoloSync),
        (Mode.CPU_SYNC, 2, ControllerSync),
        (Mode.CPU_CADENCE, 2, ControllerSync),
        (Mode.CPU_ASYNC, 2, ControllerSync),
        (Mode.CPU_ASYNC, 1, ControllerSync),
    ],
)
def test_the_mode_is_chosen_once_from_elche_mode(mode: Mode, world: int, kind: type) -> None:
    sync = sync_for(_member(world), ElCheConfig(mode=mode), world)
    assert type(sync) is kind
    assert (sync.snapshot() is not None) == mode.via_controller


def test_only_nccl_sync_reduces_gradients_in_backward() -> None:
    grads = sync_for(_member(), ElCheConfig(mode=Mode.NCCL_SYNC), 2)
    cadence = sync_for(_member(), ElCheConfig(mode=Mode.NCCL_CADENCE), 2)
    assert isinstance(grads, CollectiveSync) and grads.grad_sync is not None
    assert isinstance(cadence, CollectiveSync) and cadence.grad_sync is None


def test_alone_there_is_nothing_to_average_and_a_snapshot_is_a_copy() -> None:
    member = _member(world=1)
    window = Window(index=0, epoch=0, chunks=((0, 4),), weight=1.0, buffer_weight=1.0)
    solo = sync_for(member, ElCheConfig(mode=Mode.SOLO), 1)
    assert solo.average(window) and solo.last_divergence is None
    controller = sync_for(member, ElCheConfig(mode=Mode.CPU_CADENCE), 1)
    assert controller.average(window)  # one rank: no round trip through the controller
    snapshot = controller.snapshot()
    assert snapshot is not None and torch.equal(snapshot, member.state.flatten())
    assert snapshot.data_ptr() != member.state.current().data_ptr()  # the link does not serialise


def test_a_regroup_forgets_the_windows_after_the_break() -> None:
    sync = sync_for(_member(), ElCheConfig(mode=Mode.CPU_ASYNC), 2)
    assert isinstance(sync, ControllerSync)
    sync._outstanding, sync._whole = [3, 4, 5], {4, 5}
    sync.on_regroup(Regroup(2, (0,), 4, {0: 1.0}))
    assert sync._outstanding == [3, 4] and sync._whole == {4}
