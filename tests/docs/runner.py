"""How the blocks of README.md, bench/README.md and docs/ are checked and run (the convention:
docs/contributing.md). The tests are test_snippets.py (every block parses and validates; the
blocks that run in one process) and test_snippet_ranks.py (the blocks that start ranks): two
modules, so that `make test`'s two workers can take one each.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.docs.snippets import ROOT, Snippet, all_snippets

SNIPPETS = all_snippets()
BIN = Path(sys.executable).parent
TIMEOUT_S = 120

# Config groups a `group=NAME` yaml block is validated against (the whole group's node).
_GROUPS = {
    "elche": "ElCheConfig",
    "cluster": "ClusterConfig",
    "trainer": "TrainerConfig",
    "logger": "LoggerConfig",
    "loader": "LoaderConfig",
    "task": "TaskConfig",
}


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    paths = [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # `python` is this interpreter
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(
    args: list[str], cwd: Path, what: Snippet, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        args,
        cwd=cwd,
        env={**_env(cwd), **extra_env},
        capture_output=True,
        text=True,
        timeout=int(what.opts.get("timeout", TIMEOUT_S)),
        stdin=subprocess.DEVNULL,
    )
    return out


def _check_rc(out: subprocess.CompletedProcess[str], s: Snippet, rc: int = 0) -> None:
    want = int(s.opts.get("rc", rc))
    assert out.returncode == want, (
        f"{s.id}: exit {out.returncode}, expected {want}\n--- stdout\n{out.stdout[-4000:]}"
        f"\n--- stderr\n{out.stderr[-4000:]}"
    )


def _in_repo(command: str) -> str:
    """`python run.py ...` in a block means the repository's run.py, run from a scratch dir."""
    return re.sub(r"(?<![\w/.])run\.py\b", shlex.quote(str(ROOT / "run.py")), command)


def check_static(s: Snippet) -> None:
    """What every block gets, runnable or not: it parses, and a config group validates."""
    if s.lang == "python":
        compile(s.code, s.id, "exec")
    elif s.lang in ("bash", "console"):
        code = s.code
        if s.lang == "console":
            code = "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ "))
        out = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
        assert out.returncode == 0, f"{s.id}: bash -n: {out.stderr}"
    elif s.lang == "yaml":
        data = yaml.safe_load(s.code)
        group = s.opts.get("group")
        if group:
            from flodl import config

            assert isinstance(data, dict), f"{s.id}: group={group} needs a mapping"
            data = {k: v for k, v in data.items() if k != "defaults"}
            getattr(config, _GROUPS[group]).model_validate(data)


def run_python(s: Snippet, cwd: Path) -> None:
    path = cwd / f"snippet_{s.line}.py"
    path.write_text(s.code)
    _check_rc(_run([sys.executable, path.name], cwd, s), s)


def run_bash(s: Snippet, cwd: Path) -> None:
    _check_rc(_run(["bash", "-euo", "pipefail", "-c", _in_repo(s.code)], cwd, s), s)


def _matches(expected: list[str], got: list[str]) -> bool:
    """Each expected line appears, in order; `...` in a line matches any text."""
    at = 0
    for want in expected:
        pattern = re.compile(".*".join(re.escape(p) for p in want.split("...")) + "$")
        while at < len(got) and not pattern.match(got[at]):
            at += 1
        if at == len(got):
            return False
        at += 1
    return True


def run_console(s: Snippet, cwd: Path) -> None:
    """Run each `$ command` (side by side: they are independent) and compare its output."""
    commands: list[tuple[str, list[str]]] = []
    for line in s.code.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands and line.strip():
            commands[-1][1].append(line)

    # Refusals start no rank: no speculative fork server (its torch import would only cost CPU).
    def one(command: str) -> subprocess.CompletedProcess[str]:
        return _run(["bash", "-c", _in_repo(command)], cwd, s, FLODL_FORK_SERVER="0")

    with ThreadPoolExecutor(max_workers=2) as pool:
        outs = list(pool.map(one, [command for command, _ in commands]))
    for (command, expected), out in zip(commands, outs, strict=True):
        _check_rc(out, s)
        got = (out.stdout + out.stderr).splitlines()
        assert _matches(expected, got), (
            f"{s.id}: `{command}` printed\n{textwrap.indent(out.stdout + out.stderr, '  ')}"
            f"\nexpected (in order)\n{textwrap.indent(chr(10).join(expected), '  ')}"
        )


def _module_exists(name: str) -> bool:
    """`needs=flodl.data.streams`: the block imports a module that a layout move brings. Asked
    without importing it (nor its parent: `flodl.data` is a module, not a package, before the
    move)."""
    parent, _, _ = name.rpartition(".")
    if parent:
        spec = importlib.util.find_spec(parent)
        if spec is None or spec.submodule_search_locations is None:
            return False
    return importlib.util.find_spec(name) is not None


RUNNERS = {"python": run_python, "bash": run_bash, "console": run_console}


def run_one(s: Snippet, cwd: Path) -> None:
    needs = s.opts.get("needs")
    if needs and not _module_exists(needs):
        pytest.skip(f"{needs} is not importable in this layout yet")
    if "file" in s.opts:  # a file of a session's scratch project, written, not run
        target = cwd / s.opts["file"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(s.code)
        return
    if s.lang in RUNNERS:
        RUNNERS[s.lang](s, cwd)


# The runnable blocks and sessions run two at a time (a process tree each, in its own scratch
# directory: they share nothing), so they take about half their serial time on two cores. They
# run inside one test per kind, because tests/conftest.py rightly fails a test that leaves child
# processes behind, and jobs of other tests still running would be exactly that. A failure names
# every failing block (page:line) with its output.
_SOLO = [s for s in SNIPPETS if not s.skip and "session" not in s.opts and s.lang in RUNNERS]


def _jobs() -> dict[str, list[Snippet]]:
    jobs: dict[str, list[Snippet]] = {s.id: [s] for s in _SOLO}
    sessions: dict[tuple[Path, str], list[Snippet]] = {}
    for s in SNIPPETS:
        if "session" in s.opts and not s.skip:
            sessions.setdefault((s.path, s.opts["session"]), []).append(s)
    for (_, name), blocks in sessions.items():
        jobs[f"{blocks[0].id}[session={name}]"] = blocks
    return jobs


JOBS = _jobs()
SLOW = {key for key, blocks in JOBS.items() if any("slow" in b.opts for b in blocks)}


def _run_blocks(blocks: list[Snippet], cwd: Path) -> str | None:
    """None when every block passed; else why (a skip says so and counts as passed)."""
    cwd.mkdir()
    started = time.monotonic()
    try:
        for s in blocks:
            run_one(s, cwd)
    except pytest.skip.Exception as why:
        return f"skipped: {why}"
    except Exception as exc:  # a block's assertion, a timeout: reported with the block's id
        return f"{type(exc).__name__}: {exc}"
    finally:  # with -s (or on failure): what each block costs
        print(f"{blocks[0].id}: {time.monotonic() - started:.1f} s")
    return None


def run_jobs(keys: list[str], scratch: Path) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            key: pool.submit(_run_blocks, JOBS[key], scratch / f"job{i}")
            for i, key in enumerate(keys)
        }
        results = {key: future.result() for key, future in futures.items()}
    skipped = {k: r for k, r in results.items() if r and r.startswith("skipped: ")}
    failed = {k: r for k, r in results.items() if r and k not in skipped}
    for key, why in skipped.items():
        print(f"{key}: {why}")  # shown with -rA / -s: a block waiting for a pending module
    assert not failed, "\n\n".join(f"--- {key}\n{why}" for key, why in failed.items())
