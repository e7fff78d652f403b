"""The chaos harness's plumbing, without a run: FLODL_CHAOS reaches ssh ranks through their
role env, the matrix's cells and verdicts, and the tests' rank lookup that must not mistake a
DataLoader worker (which inherits FLODL_RANK) for its rank."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time

import psutil
import pytest

from bench.chaos import matrix
from flodl import ClusterBuilder, SshConfig
from flodl.placement.remote import shell_line, ssh_argv
from flodl.runtime.controller.events import Exited
from flodl.runtime.wire import chaos, rank_env
from tests.integration.helpers import is_rank_itself, rank_pid


def test_flodl_chaos_travels_in_the_ssh_command_line(monkeypatch):
    monkeypatch.setenv("FLODL_CHAOS", "1:window:2:stop")
    worker = (
        ClusterBuilder()
        .controller("10.0.0.1")
        .worker("node-a", devices="cpu", ssh=SshConfig(target="node-a"))
        .build()
        .workers[0]
    )
    env = rank_env.role_env(1, 3, "10.0.0.1:4000", "cpu", None)
    remote = shlex.split(ssh_argv(worker, shell_line(worker, env, ["-m", "x"]))[-1])
    assert "FLODL_CHAOS=1:window:2:stop" in remote and "FLODL_RANK=1" in remote
    monkeypatch.delenv("FLODL_CHAOS")
    assert "FLODL_CHAOS" not in rank_env.role_env(1, 3, "h:1", "cpu", None)


def test_matrix_cells_name_their_faults_and_victims():
    assert matrix.faults("1", "checkpoint") == "1:checkpoint:1"
    assert matrix.faults("0", "window") == "0:window:2"
    assert matrix.faults("1", "regroup") == "2:window:2,1:regroup:1"
    assert matrix.struck("1", "regroup") == {1, 2}
    ok = {"status": "ok", "lost_ranks": [1], "coverage_exact": True, "has_state": True}
    assert matrix.classify({**ok, "bundle": "epoch 2 (periodic)"}, {1}, ckpt=True) == "completed"
    assert matrix.classify({**ok, "bundle": "unloadable: x"}, {1}, ckpt=True) == "broken"
    assert matrix.classify({**ok, "lost_ranks": []}, {1}, ckpt=False) == "not-reached"
    assert matrix.classify(None, {1}, ckpt=False, timed_out=True) == "hang"
    # Two victims at eval, only the elected one evaluates: the loss that happened was tested.
    assert matrix.classify(ok, {1, 2}, ckpt=False) == "completed"
    assert matrix.classify({**ok, "lost_ranks": [1, 0]}, {1}, ckpt=False) == "broken"  # false loss
    # regroup: the first victim (2) is lost in a window; only the cell's victim (1) is aimed.
    assert matrix.classify({**ok, "lost_ranks": [2]}, {1, 2}, False, aimed={1}) == "not-reached"
    assert matrix.classify({**ok, "lost_ranks": [2, 1]}, {1, 2}, False, aimed={1}) == "completed"
    assert matrix.classify(ok, {1, 2}, False, aimed={1}) == "broken"  # the set-up loss is missing


def test_start_up_cells_and_timed_kills():
    """A kill at each start-up moment, and one a set time after a moment: inside
    init_process_group, which no named point reaches."""
    assert matrix.faults("1", "form") == "1:form:1"
    assert matrix.faults("1+2", "forming") == "1:form:1:kill@0.015,2:form:1:kill@0.015"
    assert {"hello", "join", "form", "forming"} <= set(matrix.MOMENTS)
    (fault,) = chaos.parse("0:join:1:kill@0.25")
    assert (fault.moment, fault.action, fault.delay_s) == ("join", "kill", 0.25)
    for bad in ("1:join:1:kill@x", "1:join:1:stop@1", "1:join:1:kill@-1"):
        with pytest.raises(ValueError, match="bad fault"):
            chaos.parse(bad)


def test_an_exit_status_is_told_as_a_signal_or_a_code():
    assert Exited(-9).describe() == "killed by SIGKILL — out of memory?"
    assert Exited(-11).describe() == "killed by SIGSEGV"
    assert Exited(137).describe() == "killed by SIGKILL — out of memory? (exit code 137)"
    assert Exited(3).describe() == "exited with code 3"
    assert Exited(0).describe() == "exited with code 0"


def test_rank_lookup_skips_a_loader_worker_that_inherited_the_rank(monkeypatch):
    """A fake rank 7 with a child carrying the same FLODL_ROLE/FLODL_RANK (as a DataLoader
    worker does): the lookup returns the rank, never the child, whichever is listed first."""
    monkeypatch.setenv("FLODL_ROLE", "rank")
    monkeypatch.setenv("FLODL_RANK", "7")
    sleep = "import time; time.sleep(30)"
    child = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {sleep!r}]); {sleep}"
    rank = subprocess.Popen([sys.executable, "-c", child])
    try:
        me = psutil.Process(rank.pid)
        deadline = time.monotonic() + 10
        while not me.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (worker,) = me.children()
        assert worker.environ()["FLODL_RANK"] == "7"
        assert rank_pid(7) == rank.pid
        assert is_rank_itself(me, 7) and not is_rank_itself(worker, 7)
        assert not is_rank_itself(me, 6)
    finally:
        for proc in me.children(recursive=True):
            proc.kill()
        rank.kill()
        rank.wait()
