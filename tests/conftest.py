"""Suite hygiene: no leaked environment variables, child processes or process groups."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest_plugins = ["tests.netns_hosts"]  # make_test_hosts: fake hosts in network namespaces


# Rank-starting tests whose assertions hold under CPU contention (leaks, refusals, exact
# equalities): they run first, while the other worker is still busy with the unit tests, so the
# tests that measure shares and pacing run on a quiet machine.
_CONTENTION_PROOF_FIRST = (
    "test_control_plane.py",
    "test_failures.py",
    "test_ddp_wrap.py",
    "test_user_scripts.py",
    "test_resume.py",
)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    """`make test` runs two xdist workers with ``--dist loadgroup``: every test that starts rank
    processes (integration, e2e) goes to one worker, one after another, since each run wants
    both cores; the unit tests and the ``light`` ones (they start no rank: refusals before any
    rank, environment parsing) share the other worker instead of waiting their turn."""
    grouped = []
    for item in items:
        if Path(item.path).relative_to(ROOT / "tests").parts[0] == "unit":
            continue
        if item.get_closest_marker("light") is None:
            item.add_marker(pytest.mark.xdist_group("processes"))
            grouped.append(item)
    first = [i for i in grouped if Path(i.path).name in _CONTENTION_PROOF_FIRST]
    if first:
        moved = set(first)
        items[:] = first + [i for i in items if i not in moved]


@pytest.fixture(autouse=True)
def _hygiene():
    env_before = dict(os.environ)
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    yield
    leaked_env = {k for k in os.environ if k.startswith("FLODL_") and k not in env_before}
    for key in leaked_env:
        del os.environ[key]
    assert not leaked_env, f"test leaked environment variables: {sorted(leaked_env)}"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test leaked an initialised torch.distributed process group")
    deadline_children = _wait_children(me, children_before)
    assert not deadline_children, f"test leaked child processes: {deadline_children}"


def _wait_children(me: psutil.Process, before: set[int], timeout_s: float = 10.0) -> list[str]:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        leaked = [p for p in me.children(recursive=True) if p.pid not in before and _alive(p)]
        if not leaked or time.monotonic() > deadline:
            names = [f"{p.pid}:{' '.join(p.cmdline()[:4])}" for p in leaked if _alive(p)]
            for p in leaked:  # reported; now gone, so one leak does not spill into later tests
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            return names
        time.sleep(0.1)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
