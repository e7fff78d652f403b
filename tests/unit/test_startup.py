"""Start-up stays cheap: what a rank process imports, and the warm-rank hand-over protocol.

Guards against regressions of bench/startup.py's launch -> first step without timing anything:
a rank that imports Hydra, TensorBoard or torchmetrics at start pays seconds of CPU for nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flodl.runtime import warm

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
        "import flodl.runtime.rank, flodl.runtime.worker, flodl.runtime.warm\n"
        f"print(json.dumps(sorted(m for m in {LAUNCHER_ONLY!r} if m in sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _echo_two_lines() -> subprocess.Popen:
    """A stand-in warm interpreter: prints the two lines it is handed."""
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; print(sys.stdin.readline(), end=''); print(input())"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )


def test_take_hands_over_the_environment_then_the_secret(monkeypatch) -> None:
    proc = _echo_two_lines()
    monkeypatch.setattr(warm, "_pool", [proc])
    taken = warm.take({"FLODL_RANK": "1", "X": "y"}, b"\x01\xfe")
    assert taken is proc and proc.stdin is None and warm.pool_size() == 0
    out, _ = proc.communicate(timeout=60)
    env_line, secret_line = out.decode().splitlines()
    assert json.loads(env_line) == {"FLODL_RANK": "1", "X": "y"}
    assert secret_line == "01fe"  # hex, as a cold child reads it (env.read_secret)
    assert warm.take({}, b"") is None  # the pool is empty: the cohort starts a cold child


def test_take_skips_a_dead_interpreter_and_close_kills_the_rest(monkeypatch) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE)
    dead.wait(timeout=60)
    waiting = _echo_two_lines()
    monkeypatch.setattr(warm, "_pool", [dead, waiting])
    assert warm.take({}, b"\x00") is waiting
    waiting.communicate(timeout=60)
    idle = _echo_two_lines()
    monkeypatch.setattr(warm, "_pool", [idle])
    warm.close()
    assert idle.returncode is not None and idle.returncode < 0  # killed, not left waiting
    assert warm.pool_size() == 0


def test_a_rank_process_ends_with_its_code_after_exit_handlers_and_flushed_output(tmp_path) -> None:
    # end_process skips interpreter finalization (where a gloo worker's last reference can abort
    # the process) but keeps what a normal exit gives: atexit handlers, logs and output flushed.
    mark = tmp_path / "atexit"
    code = (
        "import atexit, logging, sys; from flodl.runtime.rank import end_process; "
        f"atexit.register(lambda: open({str(mark)!r}, 'w').write('ran')); "
        "logging.basicConfig(); logging.getLogger('x').warning('logged'); "
        "sys.stdout.write('unflushed'); end_process(3)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert done.stdout == "unflushed" and "logged" in done.stderr
    assert mark.read_text() == "ran"
