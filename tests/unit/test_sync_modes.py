"""The rank's sync mode is one object chosen once from ``elche.mode``
(flodl/runtime/rank/sync_modes.py): collective for ``nccl_*``, through the controller for
``cpu_*`` (even alone: the controller reads the snapshots), nothing to do for ``solo`` or one
rank."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import torch

from flodl.config import ElCheConfig, Mode
from flodl.runtime.rank.peers import Peers
from flodl.runtime.rank.setup import ModelParts
from flodl.runtime.rank.sync_modes import CollectiveSync, ControllerSync, SoloSync, sync_for
from flodl.runtime.sync.averaging import FlatState
from flodl.runtime.wire.messages import Regroup, Window
from flodl.runtime.wire.rank_link import QueueLink

CPU = torch.device("cpu")


def _rank(world: int = 2) -> tuple[Peers, ModelParts]:
    """A rank's group (its public Peers) and model parts, without a process group."""
    model = torch.nn.Linear(3, 2)
    link = QueueLink(queue.Queue(), queue.Queue())
    runner = SimpleNamespace(pending=0, accumulate=1)
    state = FlatState(model, share_storage=True)
    return Peers(0, world, link, wait_s=1.0), ModelParts(model, model, state, None, runner, CPU)


def _sync(mode: Mode, world: int = 2, rank: tuple[Peers, ModelParts] | None = None):
    peers, parts = rank or _rank(world)
    optimizer = torch.optim.SGD(parts.model.parameters(), lr=0.1)
    return sync_for(peers, parts, None, optimizer, ElCheConfig(mode=mode))  # type: ignore[arg-type]


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
    sync = _sync(mode, world)
    assert type(sync) is kind
    assert (sync.snapshot() is not None) == mode.policy.via_controller


def test_only_nccl_sync_reduces_gradients_in_backward() -> None:
    grads = _sync(Mode.NCCL_SYNC)
    cadence = _sync(Mode.NCCL_CADENCE)
    assert isinstance(grads, CollectiveSync) and grads.grad_sync is not None
    assert isinstance(cadence, CollectiveSync) and cadence.grad_sync is None


def test_alone_there_is_nothing_to_average_and_a_snapshot_is_a_copy() -> None:
    rank = _rank(world=1)
    window = Window(index=0, epoch=0, chunks=((0, 4),), weight=1.0, buffer_weight=1.0)
    solo = _sync(Mode.SOLO, rank=rank)
    assert solo.average(window) and solo.last_divergence is None
    controller = _sync(Mode.CPU_CADENCE, rank=rank)
    assert controller.average(window)  # one rank: no round trip through the controller
    snapshot = controller.snapshot()
    state = rank[1].state
    assert snapshot is not None and torch.equal(snapshot, state.flatten())
    assert snapshot.data_ptr() != state.current().data_ptr()  # the link does not serialise


def test_a_regroup_forgets_the_windows_after_the_break() -> None:
    sync = _sync(Mode.CPU_ASYNC)
    assert isinstance(sync, ControllerSync)
    sync._outstanding, sync._whole = [3, 4, 5], {4, 5}
    sync.on_regroup(Regroup(2, (0,), 4, {0: 1.0}))
    assert sync._outstanding == [3, 4] and sync._whole == {4}
