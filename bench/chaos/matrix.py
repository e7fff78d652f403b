"""The chaos matrix: moments x modes x victims x checkpoints, each a real 3-rank run.

    python -m bench.chaos.matrix                 # the full matrix (228 cells, ~75 min on 2 cores)
    python -m bench.chaos.matrix --modes nccl_cadence --victims 1 --moments report,eval
    python -m bench.chaos.matrix --cohort ssh    # the same cells, ranks on ssh hosts
    python -m bench.chaos.matrix --render bench/chaos/ssh_result.json   # README's table

``--cohort ssh`` runs every cell through two fake hosts (network namespaces with their own
sshd, tests/netns_hosts.py; needs root and OpenSSH): rank 0 on the first, ranks 1 and 2 on the
second, started over real ssh. The hosts are made once and every process on them but sshd is
killed after each cell.

Each cell runs ``bench/chaos/run_one.py`` in its own process with a hard timeout and is
classified:

* ``completed`` — the run finished with the survivors: status ok, coverage exact, no rank lost
  that the cell did not strike, the final weights returned (and, with checkpoints, the last
  bundle loads); with two victims, one may never come to the moment (``unreached``: at
  ``eval`` only the elected rank evaluates) — the loss that happened is what was tested;
* ``stopped`` — it stopped with a message that says what failed; with one survivor left and
  ``max_failure`` unset every loss is survivable, so this counts as a failure too;
* ``not-reached`` — the victim never came to that moment (e.g. the eval moment of a rank that is
  never elected), so nothing was tested;
* ``hang`` — no outcome within the timeout: the defect this harness exists to find;
* ``broken`` — anything else (an empty message, inexact coverage, no weights, a bundle that
  does not load).

Results go to ``bench/chaos/last_result.json`` (``ssh_result.json`` for ``--cohort ssh``);
Run records are not committed (``.gitignore``): git keeps the history of what a matrix found,
and the docs quote the pass counts per moment.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from bench.chaos import run_one
from flodl.runtime.wire.chaos import RANK_MOMENTS

MODES = ("nccl_cadence", "cpu_async", "nccl_sync")
#: Moments that are no named point of the code: a kill some time after one (chaos.py's
#: ``kill@SECONDS``). ``forming``: inside init_process_group, gloo connecting the members.
TIMED = {"forming": ("form", "kill@0.015")}
MOMENTS = (*RANK_MOMENTS, *TIMED)
#: ``--cuts``: host 1's link down this many seconds after the first epoch (``--cohort ssh``),
#: one cell per mode and length: longer than the heartbeat timeout (3 s) its ranks are
#: dropped and must stop themselves while it is down; shorter, nothing is lost.
CUTS = (12.0, 1.0)
VICTIMS = ("0", "1", "2", "1+2")
NTH = {"window": 2, "report": 2, "average": 2}  # not the first: the cohort is formed by then
RESULT = Path(__file__).with_name("last_result.json")
SSH_RESULT = Path(__file__).with_name("ssh_result.json")


def faults(victim: str, moment: str) -> str:
    """The FLODL_CHAOS value for one cell. ``regroup`` needs a regroup: a first victim dies in
    a window and the cell's victim during the regroup that follows."""
    nth = NTH.get(moment, 1)
    ranks = victim.split("+")
    if moment in TIMED:
        named, action = TIMED[moment]
        return ",".join(f"{r}:{named}:1:{action}" for r in ranks)
    if moment == "regroup":
        first = "2" if ranks != ["2"] else "1"
        return ",".join([f"{first}:window:2"] + [f"{r}:regroup:1" for r in ranks if r != first])
    return ",".join(f"{r}:{moment}:{nth}" for r in ranks)


def struck(victim: str, moment: str) -> set[int]:
    ranks = {int(r) for r in victim.split("+")}
    if moment == "regroup":
        ranks |= {2 if victim != "2" else 1}
    return ranks


def classify(
    out: dict | None,
    victims: set[int],
    ckpt: bool,
    timed_out: bool = False,
    aimed: set[int] | None = None,
) -> str:
    """The verdict of one run. ``victims``: every rank the cell strikes; ``aimed``: those struck
    at the cell's own moment (default: all; ``regroup`` strikes a first victim in a window to
    cause the regroup). A run that ended ok with none of ``aimed`` lost never reached the
    moment. One that lost some of them completed if nothing else went wrong: the others never
    came to their moment (two victims at ``eval``: only the elected one evaluates), and what was
    tested is the loss that happened. A lost rank the cell did not strike is a false loss."""
    if out is None:
        return "hang" if timed_out else "broken"  # broken: it died without an outcome
    aimed = victims if aimed is None else aimed
    lost = set(out.get("lost_ranks", []))
    message = out.get("summary_error") or out.get("error") or ""
    if out.get("status") == "ok":
        if not aimed & lost:
            return "not-reached"
        good = out["coverage_exact"] and out["has_state"] and lost <= victims
        good = good and (victims - aimed) <= lost  # the set-up losses happened
        if ckpt and not str(out.get("bundle", "")).startswith("epoch"):
            good = False
        return "completed" if good else "broken"
    if out.get("status") in ("failed", "interrupted") and message.strip(": ").strip():
        return "stopped"
    return "broken"


def run_cell(mode: str, victim: str, moment: str, ckpt: bool, timeout_s: float, hosts=None) -> dict:
    """One cell in its own process; ``hosts`` (a tests.netns_hosts.TestHosts): through ssh."""
    with tempfile.TemporaryDirectory(prefix="flodl-chaos-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "bench.chaos.run_one",
            "--mode",
            mode,
            "--faults",
            faults(victim, moment),
            "--job-dir",
            str(Path(tmp) / "job"),
            "--timeout",
            str(timeout_s),
        ]
        if ckpt:
            cmd += ["--ckpt", str(Path(tmp) / "ckpt")]
        if hosts is not None:
            cmd += ["--hosts", _hosts_file(hosts, Path(tmp))]
        t0 = time.perf_counter()
        out, timed_out, tail = run_faulted(cmd, tmp, timeout_s, hosts)
        aimed = {int(r) for r in victim.split("+")}
        verdict = classify(out, struck(victim, moment), ckpt, timed_out, aimed)
        lost = set((out or {}).get("lost_ranks", []))
        return {
            "mode": mode,
            "victim": victim,
            "moment": moment,
            "checkpoints": ckpt,
            "verdict": verdict,
            "unreached": sorted(aimed - lost) if verdict == "completed" else [],
            "wall_s": round(time.perf_counter() - t0, 1),
            "outcome": out,
            "tail": tail if verdict in ("hang", "broken") else [],
        }


def run_faulted(cmd: list[str], tmp: str, timeout_s: float, hosts=None) -> tuple:
    """Run one ``run_one`` command: its outcome (None: none printed), whether it timed out,
    and its output's last lines; whatever it left behind is killed (a frozen rank too)."""
    out, timed_out = None, False
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, start_new_session=True
        )
        for line in proc.stdout.splitlines():
            if line.startswith("CHAOS-RESULT "):
                out = json.loads(line.removeprefix("CHAOS-RESULT "))
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        tail, timed_out = ["timeout"], True
    finally:
        _kill_leftovers(tmp, hosts)
    return out, timed_out, tail


def _hosts_file(hosts, tmp: Path) -> str:
    fields = ("controller_address", "addresses", "ssh_config", "interface", "namespaces")
    path = tmp / "hosts.json"
    path.write_text(json.dumps({f: getattr(hosts, f) for f in fields}))
    return str(path)


def _kill_leftovers(tmp: str, hosts=None) -> None:
    """A hung cell leaves its ranks behind (their session was ours, or on the fake hosts):
    end them."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(tmp in part for part in proc.info["cmdline"] or []):
                proc.kill()
    for i in range(len(hosts.addresses) if hosts is not None else 0):
        hosts.kill_host(i)  # every process there but its sshd listener


@contextlib.contextmanager
def _cohort(kind: str):
    """None for local children; two fake ssh hosts for ``ssh``."""
    if kind == "local":
        yield None
        return
    from tests.netns_hosts import test_hosts

    with (
        tempfile.TemporaryDirectory(prefix="flodl-chaos-hosts-") as tmp,
        test_hosts(2, Path(tmp)) as hosts,
    ):
        yield hosts


def run_cut(mode: str, cut_s: float, timeout_s: float, hosts) -> dict:
    """One link-cut cell: host 1 (ranks 1 and 2) off the network for ``cut_s`` after the
    first epoch. ``completed``: status ok, coverage exact, and, longer than the heartbeat
    timeout, ranks 1 and 2 lost and gone from host 1 before its link came back; shorter,
    nothing lost."""
    with tempfile.TemporaryDirectory(prefix="flodl-chaos-") as tmp:
        cmd = [sys.executable, "-m", "bench.chaos.run_one", "--mode", mode, "--faults", ""]
        cmd += ["--job-dir", str(Path(tmp) / "job"), "--timeout", str(timeout_s)]
        cmd += ["--epochs", "6", "--hosts", _hosts_file(hosts, Path(tmp)), "--cut", str(cut_s)]
        t0 = time.perf_counter()
        out, timed_out, tail = run_faulted(cmd, tmp, timeout_s, hosts)
    verdict = "hang" if timed_out else "broken"
    if out is not None and out.get("status") == "ok" and out.get("coverage_exact"):
        long_cut = cut_s > run_one.HEARTBEAT_S
        lost = sorted(out.get("lost_ranks", []))
        gone = out.get("cut_gone_after_s")
        ok = lost == [1, 2] and gone is not None if long_cut else lost == []
        verdict = "completed" if ok else "broken"
    elif out is not None and out.get("status") == "failed":
        verdict = "stopped"
    return {
        "mode": mode,
        "victim": "host 1",
        "moment": f"cut {cut_s:g} s",
        "checkpoints": False,
        "verdict": verdict,
        "wall_s": round(time.perf_counter() - t0, 1),
        "outcome": out,
        "tail": tail if verdict in ("hang", "broken") else [],
    }


def _run_cuts(args: argparse.Namespace, out: Path) -> int:
    cells = []
    with _cohort("ssh") as hosts:
        for mode, cut_s in itertools.product(
            args.modes.split(","), map(float, args.cuts.split(","))
        ):
            cell = run_cut(mode, cut_s, args.timeout, hosts)
            cells.append(cell)
            print(f"{mode:13s} {cell['moment']:10s} {cell['verdict']:12s} {cell['wall_s']:6.1f} s")
            summary = _write(out, "ssh", cells)
    print(json.dumps(summary, indent=1))
    return 1 if any(c["verdict"] != "completed" for c in cells) else 0


def render(path: Path) -> str:
    """README's table for one result file: pass counts per moment, and what ran."""
    record = json.loads(path.read_text())
    cells = record["cells"]

    def values(key: str) -> str:
        return ", ".join(sorted({str(c[key]) for c in cells}))

    ckpt = {True: "on", False: "off"}
    lines = [
        f"`bench/chaos/{path.name}` (cohort {record.get('cohort', 'local')}): modes "
        f"{values('mode')}; "
        f"victims {values('victim')}; checkpoints "
        f"{', '.join(sorted({ckpt[c['checkpoints']] for c in cells}))}; {len(cells)} cells",
        "",
        "| moment | completed | not reached | hang / broken / stopped |",
        "|---|---|---|---|",
    ]
    for moment, counts in record["summary"].items():
        bad = sum(n for v, n in counts.items() if v not in ("completed", "not-reached"))
        done, unreached = counts.get("completed", 0), counts.get("not-reached", 0)
        lines.append(f"| `{moment}` | {done} | {unreached} | {bad} |")
    return "\n".join(lines)


def _write(out: Path, cohort: str, cells: list[dict]) -> dict:
    per_moment: dict[str, Counter] = defaultdict(Counter)
    for cell in cells:
        per_moment[cell["moment"]][cell["verdict"]] += 1
    summary = {m: dict(c) for m, c in per_moment.items()}
    record = {"cohort": cohort, "summary": summary, "cells": cells}
    out.write_text(json.dumps(record, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--victims", default=",".join(VICTIMS))
    parser.add_argument("--moments", default=",".join(MOMENTS))
    parser.add_argument(
        "--cuts",
        default="",
        help="with --cohort ssh: link-cut cells only, host 1 down this long (s), e.g. 12,1",
    )
    parser.add_argument("--checkpoints", choices=("off", "on", "both"), default="both")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before 'hang'")
    parser.add_argument("--cohort", choices=("local", "ssh"), default="local")
    parser.add_argument("--out", default="", help="result file (default: by cohort)")
    parser.add_argument("--render", metavar="RESULT", help="print README's table for a result")
    args = parser.parse_args(argv)
    if args.render:
        print(render(Path(args.render)))
        return 0
    out = Path(args.out or (SSH_RESULT if args.cohort == "ssh" else RESULT))
    ckpts = {"off": [False], "on": [True], "both": [False, True]}[args.checkpoints]
    cells: list[dict] = []
    summary: dict = {}
    grid = itertools.product(
        args.modes.split(","), args.moments.split(","), args.victims.split(","), ckpts
    )
    if args.cuts:
        if args.cohort != "ssh":
            parser.error("--cuts needs --cohort ssh (a link between fake hosts)")
        return _run_cuts(args, out)
    with _cohort(args.cohort) as hosts:
        for mode, moment, victim, ckpt in grid:
            if moment == "checkpoint" and not ckpt:
                continue  # no checkpoint, no checkpoint moment
            cell = run_cell(mode, victim, moment, ckpt, args.timeout, hosts)
            cells.append(cell)
            flag = "ckpt" if ckpt else "    "
            print(
                f"{mode:13s} {moment:10s} victim {victim:4s} {flag} {cell['verdict']:12s} "
                f"{cell['wall_s']:6.1f} s",
                flush=True,
            )
            summary = _write(out, args.cohort, cells)  # after every cell: a cut run keeps its part
    print(json.dumps(summary, indent=1))
    # Two of three ranks lost is always survivable (max_failure unset): only completed passes.
    bad = sum(c["verdict"] not in ("completed", "not-reached") for c in cells)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
