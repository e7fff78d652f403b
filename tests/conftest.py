"""Suite hygiene: no leaked environment variables, child processes or process groups."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest_plugins = ["tests.netns_hosts"]  # make_test_hosts: fake hosts in network namespaces


# `make test` runs two xdist workers (``-n 2 --dist loadgroup``) and gives each ONE group, so
# that neither idles: group "a" is half of the rank-starting tests, then the tests that measure
# shares, pacing and accuracy (_PACED), which run last; group "b" is the unit and light tests
# (no rank process), then the other half. The halves are balanced by each file's cost (idle
# seconds, measured from a whole run's --durations; a new file counts _DEFAULT_S), so that "b"
# ends about when "a" reaches _PACED: the paced tests then have the machine to themselves. The
# rank-starting tests outside _PACED assert completion, counts, leaks and exact equalities, which
# hold under contention (the suite passed at load 13-21 with two of them side by side).
_PACED = ("test_hetero_modes.py", "test_loader.py", "test_modes.py", "test_run_py.py")
_COST_S = {  # the whole run of r4-suite-time at load ~6 (1178 s), over 1.97 (902 s idle / 1781)
    "test_signals.py": 82,
    "test_placement.py": 82,
    "test_multihost.py": 72,
    "test_elastic.py": 68,
    "test_checkpoint_loss.py": 54,
    "test_big_model.py": 52,
    "test_cohorts.py": 52,
    "test_dashboard_e2e.py": 49,
    "test_chaos.py": 46,
    "test_multihost_chaos.py": 70,
    "test_resume.py": 36,
    "test_callbacks.py": 34,
    "test_hetero_modes.py": 24,
    "test_run_py_jobs.py": 22,
    "test_loader.py": 22,
    "test_failures.py": 21,
    "test_modes.py": 19,
    "test_control_plane.py": 17,
    "test_user_scripts.py": 14,
    "test_probe_cluster.py": 13,
    "test_ddp_wrap.py": 11,
    "test_run_py.py": 9,
    "test_evaluation.py": 8,
    "test_observability.py": 5,
    "test_netns_hosts.py": 4,
    "test_snippet_ranks.py": 85,  # + the memory guide's 3-rank command
    "test_snippets.py": 40,
    "test_site.py": 10,
    "test_user_errors.py": 45,
    "test_nonfinite.py": 24,
    "test_rig_links.py": 30,
    "test_rig_memory.py": 20,
    "test_full_disk.py": 11,
    "test_training_features.py": 4,
    "test_hf_lora.py": 50,
    "test_hf_modes.py": 30,
    "test_hf_adapters.py": 17,
    "test_startup_loss.py": 25,
    "test_memory_plans.py": 40,
    "test_sharded_state.py": 45,
    "test_controller_compress.py": 45,
}
_DEFAULT_S = 10
_UNIT_AND_LIGHT_S = 194  # the whole of group "b"'s first part (measured as _COST_S)


def _starts_ranks(item: pytest.Item) -> bool:
    unit = Path(item.path).relative_to(ROOT / "tests").parts[0] == "unit"
    return not unit and item.get_closest_marker("light") is None


def _halves(files: list[str]) -> set[str]:
    """The rank-starting files (not _PACED) that go to group "b": largest first, each to the
    group that ends earlier, with "b" starting behind the unit tests."""
    # "a" counts only its part before _PACED: both parts end together, then the paced modules
    # run alone (they wait for the shared lock of "b"'s last module: _paced_alone).
    a = 0.0
    b = _UNIT_AND_LIGHT_S
    to_b: set[str] = set()
    for name in sorted(files, key=lambda f: -_COST_S.get(f, _DEFAULT_S)):
        if name in _PACED:
            continue
        if b < a:
            to_b.add(name)
            b += _COST_S.get(name, _DEFAULT_S)
        else:
            a += _COST_S.get(name, _DEFAULT_S)
    return to_b


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config, items):
    """Order and group the tests as the comment on _PACED says. A run of unit tests alone
    stays ungrouped (both workers share it)."""
    ranked = [i for i in items if _starts_ranks(i)]
    if not ranked:
        return
    to_b = _halves(sorted({Path(i.path).name for i in ranked}))

    def group(item: pytest.Item) -> str:
        return "b" if not _starts_ranks(item) or Path(item.path).name in to_b else "a"

    def order(item: pytest.Item) -> tuple[int, int]:
        name = Path(item.path).name
        if group(item) == "b":
            return (1, 0 if not _starts_ranks(item) else 1)
        return (0, 1 if name in _PACED else 0)

    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    items.sort(key=order)  # stable: collection order within each part


@pytest.fixture(autouse=True, scope="module")
def _paced_alone(request, tmp_path_factory):
    """Ordering alone cannot promise the _PACED modules a quiet machine (the other worker's
    share of the work is only estimated; measured: shares 0.57-0.66 against 0.67-0.71 when a
    rank-starting test ran beside them). So, between xdist workers: a _PACED module holds an
    exclusive lock for its whole run (its module fixtures included: autouse module fixtures are
    set up first), every other module of tests/integration and tests/e2e a shared one. Each
    worker holds one lock at a time (a module's is released before the next module's is taken),
    so no cycle can form."""
    parts = Path(request.node.path).relative_to(ROOT / "tests").parts
    if "PYTEST_XDIST_WORKER" not in os.environ or parts[0] == "unit":
        yield
        return
    mode = fcntl.LOCK_EX if parts[-1] in _PACED else fcntl.LOCK_SH
    lock = tmp_path_factory.getbasetemp().parent / "paced.lock"  # shared by this run's workers
    with open(lock, "a") as handle:
        fcntl.flock(handle, mode)
        yield  # closing the file releases the lock


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

    from flodl.runtime.cohorts import fork_server

    deadline = time.monotonic() + timeout_s
    while True:
        kept = (
            fork_server.server_pid()
        )  # the fork server outlives a run by design; its forks do not
        leaked = [
            p
            for p in me.children(recursive=True)
            if p.pid not in before and p.pid != kept and _alive(p)
        ]
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


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """``tiny_tmpfs(size)``: a real filesystem that fills up (a tmpfs of ``size``, e.g. "64k"),
    unmounted after the test; the test is skipped, with the reason, when not root or when
    mounting fails."""
    import subprocess

    mounted: list[Path] = []

    def mount(size: str = "64k") -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(path)
        return path

    try:
        yield mount
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)
