"""Start-up stays cheap: what a rank process imports, and the fork server ranks start from.

Guards against regressions of bench/startup.py's launch -> first step without timing anything:
a rank that imports Hydra, TensorBoard or torchmetrics at start pays seconds of CPU for nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy
import psutil
import pytest

from flodl.runtime.cohorts import fork_server

pytestmark = pytest.mark.light  # no rank is started

# What the launcher may need, and a rank must not import before its first step.
LAUNCHER_ONLY = (
    "hydra",
    "omegaconf",
    "tensorboard",
    "torch.utils.tensorboard",
    "torchmetrics",
    "matplotlib",
    "scipy",
)


def test_a_rank_process_imports_no_launcher_only_module() -> None:
    code = (
        "import json, sys\n"
        "import flodl.runtime.rank.process, flodl.runtime.rank.loop\n"
        "import flodl.runtime.cohorts.fork_server\n"
        f"print(json.dumps(sorted(m for m in {LAUNCHER_ONLY!r} if m in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _probe() -> int:
    """A fork's target: what it was given, as JSON on its output."""
    print(
        json.dumps(
            {
                "cwd": os.getcwd(),
                "x": os.environ.get("X"),
                "inherited": "FLODL_PROBE_NOT_PASSED" in os.environ,
                "secret": sys.stdin.readline().strip(),
                "own_session": os.getpgid(0) == os.getpid(),
                "parent": os.getppid(),
                "numpy_draw": float(numpy.random.random()),
                "argv": sys.argv,
            }
        ),
        flush=True,
    )
    print("to stderr", file=sys.stderr, flush=True)
    return 7


def _sleep() -> int:
    print("sleeping", flush=True)
    time.sleep(600)
    return 0


def _env() -> dict[str, str]:
    return {"X": "y", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


@pytest.fixture
def server():
    fork_server.close()
    yield
    fork_server.close()


def test_a_fork_gets_its_environment_directory_secret_and_session(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FLODL_PROBE_NOT_PASSED", "1")  # in this process, not in the fork's env
    child = fork_server.take(_env(), b"\x01\xfe", target="tests.unit.test_startup:_probe")
    sibling = fork_server.take(_env(), b"\x00", target="tests.unit.test_startup:_probe")
    assert child is not None and child.stdin is None and sibling is not None
    assert child.wait(timeout=60) == 7 and child.poll() == 7
    out = child.stdout.read().decode().splitlines()
    seen = json.loads(out[0])
    assert sibling.wait(timeout=60) == 7
    other = json.loads(sibling.stdout.read().decode().splitlines()[0])
    assert seen.pop("numpy_draw") != other["numpy_draw"]  # not the server's generator, shared
    assert seen.pop("argv") == [str(Path(__file__).resolve())]
    assert seen == {
        "cwd": str(tmp_path),
        "x": "y",
        "inherited": False,
        "secret": "01fe",  # hex on stdin, as a cold child reads it (env.read_secret)
        "own_session": True,  # the cohort's killpg reaches what it starts
        "parent": fork_server.server_pid(),
    }
    assert out[1] == "to stderr"  # stdout and stderr are one pipe, as for a cold child


def test_a_killed_fork_reports_the_signal_and_a_closed_server_takes_its_forks(server):
    first = fork_server.take(_env(), b"\x00", target="tests.unit.test_startup:_sleep")
    second = fork_server.take(_env(), b"\x00", target="tests.unit.test_startup:_sleep")
    assert first is not None and second is not None
    assert first.stdout.readline() == b"sleeping\n" and second.stdout.readline() == b"sleeping\n"
    with pytest.raises(subprocess.TimeoutExpired):
        first.wait(timeout=0.2)
    os.killpg(first.pid, signal.SIGKILL)
    assert first.wait(timeout=60) == -signal.SIGKILL
    assert second.poll() is None
    fork_server.close()  # the launcher is done: nothing the server forked outlives it
    assert second.wait(timeout=60) == -signal.SIGKILL
    assert not psutil.pid_exists(second.pid) or psutil.Process(second.pid).status() == "zombie"


def test_a_server_started_under_other_load_time_settings_is_replaced(server, monkeypatch):
    first = fork_server.take(_env(), b"\x00", target="tests.unit.test_startup:_probe")
    assert first is not None and first.wait(timeout=60) == 7
    before = fork_server.server_pid()
    monkeypatch.setenv("FLODL_CHAOS", "")  # a per-run variable: each fork gets it anyway
    assert fork_server.take(_env(), b"\x00", target="tests.unit.test_startup:_probe").wait(60) == 7
    assert fork_server.server_pid() == before
    running = fork_server.take(_env(), b"\x00", target="tests.unit.test_startup:_sleep")
    assert running is not None and running.stdout.readline() == b"sleeping\n"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # libgomp read it when torch was loaded
    assert fork_server.take(_env(), b"\x00", target="tests.unit.test_startup:_probe").wait(60) == 7
    assert fork_server.server_pid() not in (None, before)
    assert running.poll() is None  # another run's rank on the old server is left running
    fork_server.close()  # ... until the launcher closes its servers
    assert running.wait(timeout=60) == -signal.SIGKILL and not psutil.pid_exists(before)


def test_a_dead_server_is_replaced_and_no_server_means_a_cold_start(server, monkeypatch):
    first = fork_server.take(_env(), b"\x00", target="tests.unit.test_startup:_sleep")
    assert first is not None and first.stdout.readline() == b"sleeping\n"
    dead = fork_server.server_pid()
    assert dead is not None
    os.kill(dead, signal.SIGKILL)
    assert first.wait(timeout=60) == -signal.SIGKILL  # died with its server (PDEATHSIG)
    again = fork_server.take(_env(), b"\x05", target="tests.unit.test_startup:_probe")
    assert again is not None and again.wait(timeout=60) == 7
    assert fork_server.server_pid() not in (None, dead)
    fork_server.close()
    monkeypatch.setenv("FLODL_FORK_SERVER", "0")
    assert fork_server.take(_env(), b"\x00") is None and fork_server.server_pid() is None


def test_a_rank_process_ends_with_its_code_after_exit_handlers_and_flushed_output(tmp_path) -> None:
    # end_process skips interpreter finalization (where a gloo worker's last reference can abort
    # the process) but keeps what a normal exit gives: atexit handlers, logs and output flushed.
    mark = tmp_path / "atexit"
    code = (
        "import atexit, logging, sys; from flodl.runtime.rank.process import end_process; "
        f"atexit.register(lambda: open({str(mark)!r}, 'w').write('ran')); "
        "logging.basicConfig(); logging.getLogger('x').warning('logged'); "
        "sys.stdout.write('unflushed'); end_process(3)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert done.stdout == "unflushed" and "logged" in done.stderr
    assert mark.read_text() == "ran"


def test_a_fork_of_the_launcher_neither_uses_nor_closes_its_server(server) -> None:
    fork_server.start()
    owned = fork_server.server_pid()
    assert owned is not None
    pid = os.fork()
    if pid == 0:  # a fork of the launcher (a loader worker, say): the socket is not its own
        mine = fork_server.server_pid()
        fork_server.close()
        os._exit(0 if mine is None else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert fork_server.server_pid() == owned and psutil.pid_exists(owned)
    child = fork_server.take(_env(), b"\x00", target="tests.unit.test_startup:_probe")
    assert child is not None and child.wait(timeout=60) == 7  # still serving its owner


def test_run_py_starts_the_server_before_composing_and_ends_it_for_a_job_that_does_not_fork(
    server, monkeypatch
) -> None:
    """``flodl.cli.app.cli`` starts the server on speculation (the default job is a CPU rig); the
    first job's check keeps it for a rig and ends it, unused, for anything else, at once
    rather than after its imports."""
    from flodl.cli import app, sweep
    from flodl.config import ClusterConfig

    for flags in (["--help"], ["--cfg", "job"], ["--info=config"], ["-c", "job"]):
        app._warm_early(flags)
        assert fork_server.server_pid() is None, flags
    monkeypatch.setenv("RANK", "1")  # torchrun placed this process: its ranks are not ours
    monkeypatch.setenv("WORLD_SIZE", "2")
    app._warm_early(["model=lenet"])
    assert fork_server.server_pid() is None
    monkeypatch.delenv("RANK")
    app._warm_early(["model=lenet"])
    kept = fork_server.server_pid()
    assert kept is not None
    sweep._warm_ranks(ClusterConfig(kind="cpu_rig", ranks=2, speeds=[1.0, 0.5]))
    assert fork_server.server_pid() == kept
    started = time.monotonic()
    sweep._warm_ranks(ClusterConfig(kind="cpu_rig", ranks=1))
    assert fork_server.server_pid() is None and not psutil.pid_exists(kept)
    assert time.monotonic() - started < 1.0  # killed, not waited for (its imports take ~2 s)


def test_the_error_line_leaves_in_one_write(monkeypatch) -> None:
    """run.py's one refusal line: the metric import's thread runs beside the checks, and with
    PYTHONUNBUFFERED a ``print`` would give its output a moment between the text and the
    newline (seen under load in test_refusals: ``error: ...fresh`` + ``import time: ...``)."""
    import io

    from flodl.cli import app

    writes: list[str] = []

    class Recording(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Recording())
    app.say_error("trainer.resume_from=x: no checkpoint")
    assert writes == ["error: trainer.resume_from=x: no checkpoint\n"]
