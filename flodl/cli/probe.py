"""``python -m flodl probe [cluster=NAME]``: is this host, or a whole cluster, ready for a cohort?

Checks what a launch needs before any rank starts: the devices (via ``nvidia-smi``, CUDA
untouched), torch and its CUDA/NCCL build, Python and flodl versions, that the controller port can
be bound, and that the data path is readable. Prints a table, or JSON with ``--json``; exits 0
when ready, 1 with the reasons when not, and 2 when the cluster file or an override is invalid.

Without ``cluster=`` (or with ``--local``) only this host is checked. With ``cluster=NAME``
(``conf/cluster/NAME.yaml``) or ``cluster=path/to/file.yaml``, plus ``cluster.KEY=VALUE``
overrides, the cluster is checked as a launch would use it: for ``kind: hosts`` every worker host
runs ``python -m flodl probe --local --json`` itself, over the same ssh a launch uses, and the
answers are compared for version skew; the controller address is bound here, on the launcher's
host, where the controller will listen.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flodl.config import ClusterConfig, ControllerAddress, SlurmConfig, WorkerConfig

CONF = Path(str(resources.files("flodl.conf")))
"""flodl's Hydra config groups (``pkg://flodl.conf``: the repository's ``conf/``, shipped in the
wheel); its cluster files are under it."""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    host: str
    checks: list[Check] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return all(c.ok for c in self.checks)

    def add(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(Check(name, ok, detail))

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    def as_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "ready": self.ready,
            "checks": [asdict(c) for c in self.checks],
            "facts": self.facts,
        }


# --------------------------------------------------------------------------- this host

# Run by a child interpreter: this process never loads torch (or a CUDA context). The NCCL
# version is the one torch was built with; CPU builds have none (the call raises).
_TORCH_FACTS = """
import json, torch, torch.distributed as d
try:
    v = torch.cuda.nccl.version()
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else f"{v // 10000}.{v // 100 % 100}"
except Exception:
    nccl = None
print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda,
                  'gloo': d.is_gloo_available(), 'nccl': d.is_nccl_available(),
                  'nccl_version': nccl}))
"""


def _torch_facts() -> dict[str, Any]:
    """Ask a child interpreter, so this process never loads torch (or a CUDA context)."""
    out = subprocess.run(
        [sys.executable, "-c", _TORCH_FACTS], capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr else "no output")
    facts: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return facts


def _bind(host: str, port: int) -> str | None:
    """Bind like the controller's listener does (SO_REUSEADDR); the error, or None when free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return (
                "in use" if exc.errno == errno.EADDRINUSE else f"cannot bind: {exc.strerror or exc}"
            )
        except OverflowError:
            return "cannot bind: port out of range"
    return None


def probe(host: str = "127.0.0.1", port: int = 0, data_path: str | None = None) -> Report:
    """Run every local check."""
    from flodl import __version__
    from flodl.placement.gpus import detect_gpus

    report = Report(host=socket.gethostname())
    report.facts.update(python=platform.python_version(), flodl=__version__)
    gpus = detect_gpus()
    report.facts["gpus"] = [f"{g.index}: {g.name} ({g.total_memory_mb} MB)" for g in gpus]
    # Physical indices, the ones a worker's ``devices: [0, 1]`` names (see flodl.placement.remote).
    report.facts["gpu_indices"] = [
        g.physical_index if g.physical_index is not None else g.index for g in gpus
    ]
    report.add("devices", True, f"{len(gpus)} GPU(s)" if gpus else "no GPU: CPU ranks (gloo)")
    try:
        facts = _torch_facts()
        report.facts.update(facts)
        report.add(
            "torch",
            facts["gloo"] or facts["nccl"],
            f"torch {facts['torch']}, CUDA {facts['cuda']}, gloo {facts['gloo']}, "
            f"nccl {facts['nccl']}",
        )
        if gpus and not facts["nccl"]:
            report.add(
                "nccl", False, "GPUs visible but this torch has no NCCL: install a CUDA build"
            )
    except (RuntimeError, subprocess.SubprocessError, ValueError) as exc:
        report.add("torch", False, f"torch does not import: {exc}")
    if port:
        error = _bind(host, port)
        report.add("controller port", error is None, f"{host}:{port} {error or 'free'}")
    if data_path is not None:
        readable = os.access(data_path, os.R_OK) and Path(data_path).exists()
        report.add("data path", readable, f"{data_path} " + ("readable" if readable else "missing"))
    return report


def render(report: Report) -> str:
    lines = [f"flodl probe — {report.host}"]
    lines += _check_lines(report.checks)
    for gpu in report.facts.get("gpus", []):
        lines.append(f"       gpu {gpu}")
    lines.append("ready" if report.ready else "NOT ready")
    return "\n".join(lines)


def _check_lines(checks: list[Check]) -> list[str]:
    width = max((len(c.name) for c in checks), default=8)
    return [f"  {'ok  ' if c.ok else 'FAIL'} {c.name:<{width}}  {c.detail}" for c in checks]


# --------------------------------------------------------------------------- a cluster


@dataclass
class ClusterReport:
    """One :class:`Report` per host, plus the checks that span hosts (controller, skew)."""

    kind: str
    hosts: list[Report]
    checks: list[Check] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return all(c.ok for c in self.checks) and all(r.ready for r in self.hosts)

    @property
    def reasons(self) -> list[str]:
        """Every failed check, host-specific ones named after their host."""
        failed = [
            f"{r.host}: {c.name}: {c.detail}" for r in self.hosts for c in r.checks if not c.ok
        ]
        return failed + [f"{c.name}: {c.detail}" for c in self.checks if not c.ok]

    def as_json(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "kind": self.kind,
            "hosts": [r.as_json() for r in self.hosts],
            "checks": [asdict(c) for c in self.checks],
            "reasons": self.reasons,
        }


def probe_cluster(cluster: ClusterConfig, data_path: str | None = None) -> ClusterReport:
    """Check ``cluster`` as a launch from this host would use it."""
    if cluster.kind == "hosts":
        reports = _probe_workers(cluster.workers, data_path)
        checks = controller_checks(cluster.controller)
        checks += cohort_checks(cluster.workers, reports)
        return ClusterReport(cluster.kind, reports, checks)
    here = probe(data_path=data_path)
    if cluster.kind == "slurm":
        assert cluster.slurm is not None
        from flodl.runtime.cohorts.slurm import controller_placement

        checks, chosen = slurm_checks(cluster.slurm)
        if chosen is not None and controller_placement(
            cluster.slurm, cluster.controller.host, chosen
        ):
            checks.append(Check("controller", True, "rank0: runs beside rank 0 (not bound here)"))
        else:
            checks += controller_checks(cluster.controller)
        return ClusterReport(cluster.kind, [here], checks)
    return ClusterReport(cluster.kind, [here], controller_checks(cluster.controller))


def controller_checks(address: ControllerAddress) -> list[Check]:
    """Bind the controller's address here, on the launcher's host, and the store's (port+1).

    Port 0 means "any free port", so only the address is tested: it must be one of this host's.
    """
    if address.port == 0:
        error = _bind(address.host, 0)
        detail = f"{address.host} (port 0: any free port) {error or 'bindable'}"
        return [Check("controller", error is None, detail)]
    checks = []
    for name, port in (("controller", address.port), ("store", address.port + 1)):
        error = _bind(address.host, port)
        checks.append(Check(name, error is None, f"{address.host}:{port} {error or 'free'}"))
    return checks


# ---- kind: hosts


def _probe_workers(workers: list[WorkerConfig], data_path: str | None) -> list[Report]:
    """Every worker host at once: a slow or dead host costs its timeout once, not per host."""
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(workers)))) as pool:
        futures = [pool.submit(_probe_worker, i, w, data_path) for i, w in enumerate(workers)]
    return [f.result() for f in futures]


def _probe_worker(index: int, worker: WorkerConfig, data_path: str | None) -> Report:
    """Run the local probe on the worker's host, as that host's Python, in its project dir."""
    from flodl.placement.remote import last_line, run_on

    report = Report(host=worker.host)
    argv = ["-m", "flodl", "probe", "--local", "--json"]
    if data_path is not None:
        argv += ["--data-path", data_path]
    timeout = (worker.ssh.connect_timeout_s if worker.ssh else 10.0) + 120.0
    link = "ssh" if worker.remote else "local"
    if not worker.remote:
        report.add(link, True, "this host")
    try:
        out = run_on(worker, argv, timeout)
    except subprocess.TimeoutExpired:
        report.add("probe", False, f"no answer within {timeout:.0f} s")
        return report
    except OSError as exc:
        report.add("flodl", False, f"{worker.python} does not start: {exc}")
        return report
    if out.returncode == 255 and worker.remote:
        report.add("ssh", False, f"unreachable: {last_line(out.stderr) or 'exit 255'}")
        return report
    there = _parse_report(out.stdout) if out.returncode in (0, 1) else None
    if there is None:
        why = last_line(out.stderr) or f"exit {out.returncode}"
        report.add("flodl", False, f"{worker.python} cannot run `flodl probe` there: {why}")
        return report
    if worker.remote:
        report.add(link, True, "reachable")
    report.facts = {"hostname": there["host"], **there["facts"]}
    # The host's own "devices" check only counts GPUs; the worker's devices decide readiness.
    report.checks += [Check(**c) for c in there["checks"] if c["name"] != "devices"]
    report.checks.append(_devices_check(index, worker, report.facts))
    return report


def _parse_report(stdout: str) -> dict[str, Any] | None:
    """The ``--json`` report in a host's stdout; a login banner may come before it."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("{")), None)
    if start is None:
        return None
    try:
        data = json.loads("\n".join(lines[start:]))
    except ValueError:
        return None
    if not isinstance(data, dict) or not {"host", "facts", "checks"} <= data.keys():
        return None
    return data


def _devices_check(index: int, worker: WorkerConfig, facts: dict[str, Any]) -> Check:
    """The worker's ``devices`` against the GPUs its host has, judged as the launch judges it."""
    from flodl.config import ConfigError
    from flodl.placement.topology import worker_devices

    try:
        ranks = worker_devices(index, worker, facts)
    except ConfigError as exc:
        return Check("devices", False, str(exc))
    if worker.devices == "cpu":
        return Check("devices", True, f"cpu: {len(ranks)} rank(s)")
    gpus = ", ".join(str(gpu) for _, gpu, _ in ranks)
    return Check("devices", True, f"GPU {gpus}: {len(ranks)} rank(s)")


def cohort_checks(workers: list[WorkerConfig], reports: list[Report]) -> list[Check]:
    """One collective backend for the cohort, and the versions every host must agree on."""
    kinds = {w.devices == "cpu" for w in workers}
    if len(kinds) > 1:
        backend = Check("backend", False, "workers mix GPU and CPU ranks: one backend per cohort")
    else:
        backend = Check("backend", True, "gloo (CPU ranks)" if kinds == {True} else "nccl (GPUs)")
    return [backend, *skew_checks(reports, nccl=kinds == {False})]


def _release(version: str) -> str:
    return version.split("+")[0]  # "2.5.1+cu121" -> "2.5.1": the CUDA build is its own column


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def skew_checks(reports: list[Report], nccl: bool) -> list[Check]:
    """Compare the versions the hosts reported; a host that did not answer is left out.

    Ranks exchange pickled state and meet in collectives, so torch, flodl and Python (major.minor)
    must agree, and NCCL's major.minor when NCCL carries the cohort. CUDA may differ (each host
    runs its own build against its own driver): reported, not a failure.
    """
    return [
        _skew(reports, "python", _major_minor, fatal=True),
        _skew(reports, "flodl", str, fatal=True),
        _skew(reports, "torch", _release, fatal=True),
        _skew(reports, "cuda", str, fatal=False),
        _skew(reports, "nccl_version", _major_minor, fatal=nccl, label="nccl"),
    ]


def _skew(
    reports: list[Report],
    fact: str,
    key: Callable[[str], str],
    fatal: bool,
    label: str | None = None,
) -> Check:
    name = f"{label or fact} versions"
    seen: dict[str, list[str]] = {}  # full version -> hosts
    for report in reports:
        if fact in report.facts:
            seen.setdefault(str(report.facts[fact] or "none"), []).append(report.host)
    answered = sum(len(hosts) for hosts in seen.values())
    if not answered:
        return Check(name, True, "no host answered")
    if len({key(v) for v in seen}) <= 1:
        where = (
            "every host"
            if answered == len(reports)
            else f"the {answered} of {len(reports)} hosts that answered"
        )
        return Check(name, True, f"{' / '.join(seen)} on {where}")
    groups = "; ".join(f"{v} on {', '.join(hosts)}" for v, hosts in seen.items())
    note = "" if fatal else " (allowed)"
    return Check(name, not fatal, f"differ across hosts: {groups}{note}")


# ---- kind: slurm


def slurm_checks(slurm: SlurmConfig) -> tuple[list[Check], str | None]:
    """submitit must import; the executor it will pick (returned) must be able to submit."""
    try:
        import submitit
    except ImportError as exc:
        fix = "pip install 'flodl[slurm]'"
        return [Check("submitit", False, f"does not import: {exc}: {fix}")], None
    checks = [Check("submitit", True, f"submitit {submitit.__version__}")]
    try:  # auto: what submitit.AutoExecutor would choose (slurm where srun exists)
        chosen = slurm.executor if slurm.executor != "auto" else submitit.AutoExecutor.which()
    except RuntimeError as exc:
        return [*checks, Check("executor", False, str(exc))], None
    if chosen != "slurm":
        how = "auto found no SLURM here, so " if slurm.executor == "auto" else ""
        detail = f"{how}submitit's local executor: the tasks run on this host"
        return [*checks, Check("executor", True, detail)], chosen
    sbatch = shutil.which("sbatch")
    detail = f"slurm, sbatch at {sbatch}" if sbatch else "slurm, but no sbatch on PATH"
    return [*checks, Check("executor", sbatch is not None, detail)], chosen


# ---- loading the cluster file


def load_cluster(args: list[str]) -> ClusterConfig:
    """``cluster=NAME_OR_FILE`` plus ``cluster.KEY=VALUE`` overrides, validated like a launch.

    Raises :class:`~flodl.config.ConfigError` with one line naming the bad key or file.
    """
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    from pydantic import ValidationError
    from yaml import YAMLError

    from flodl.config import ClusterConfig, ConfigError, explain

    spec, overrides = _split_args(args)
    path = cluster_file(spec)
    try:
        node = OmegaConf.load(path)
    except (OmegaConfBaseException, YAMLError, OSError) as exc:
        raise ConfigError(f"cluster={spec}: {path}: {_first_line(exc)}") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"cluster={spec}: {path} must hold a mapping of cluster keys")
    node = _on_schema(node)
    for key, value in overrides:
        try:
            # from_dotlist types the value as YAML; update() also walks list indices.
            parsed = OmegaConf.select(OmegaConf.from_dotlist([f"{key}={value}"]), key)
            OmegaConf.update(node, key, parsed, merge=True)
        except (OmegaConfBaseException, YAMLError) as exc:
            raise ConfigError(f"cluster.{key}={value}: {_first_line(exc)}") from None
    try:
        data = OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cluster={spec}: {_first_line(exc)}") from None
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise explain(exc, data, "cluster") from None


def _on_schema(node: Any) -> Any:
    """A cluster file as Hydra composes it: its keys over ``cluster/_schema`` (every key at its
    default, flodl/config/groups.py) where its defaults list names it, else as written."""
    from omegaconf import OmegaConf

    from flodl.config import schema_node

    defaults = node.pop("defaults", None) if "defaults" in node else None
    if defaults is None or "_schema" not in list(defaults):
        return node
    return OmegaConf.merge(OmegaConf.create(schema_node("cluster")), node)


def _first_line(exc: Exception) -> str:
    """OmegaConf and YAML errors span lines (key, context); the first says what went wrong."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _split_args(args: list[str]) -> tuple[str, list[tuple[str, str]]]:
    from flodl.config import ConfigError

    spec, overrides = None, []
    for arg in args:
        key, eq, value = arg.partition("=")
        if key == "cluster" and eq:
            spec = value
        elif key.startswith("cluster.") and eq:
            overrides.append((key.removeprefix("cluster."), value))
        else:
            raise ConfigError(f"{arg}: expected cluster=NAME_OR_FILE or cluster.KEY=VALUE")
    if not spec:
        raise ConfigError(f"{args[0]}: name the cluster too (cluster=NAME or cluster=FILE.yaml)")
    return spec, overrides


def cluster_file(spec: str) -> Path:
    """A path as given, else ``conf/cluster/<spec>.yaml`` here (the user's project) or flodl's."""
    from flodl.config import ConfigError

    given = Path(spec).expanduser()
    if given.suffix in (".yaml", ".yml") or os.sep in spec:
        if given.is_file():
            return given
        raise ConfigError(f"cluster={spec}: no such file")
    dirs = list(dict.fromkeys([Path.cwd() / "conf" / "cluster", CONF / "cluster"]))
    for folder in dirs:
        if (folder / f"{spec}.yaml").is_file():
            return folder / f"{spec}.yaml"
    names = sorted({p.stem for d in dirs for p in d.glob("*.yaml")})
    raise ConfigError(
        f"cluster={spec}: no cluster/{spec}.yaml in ./conf or flodl's config groups "
        f"({CONF}) (have: {', '.join(names) or 'none'}; or give a file path)"
    )


# ---- the table


_COLUMNS = ("host", "reachable", "python", "flodl", "torch", "cuda", "nccl", "gpus", "data")


def _row(report: Report) -> tuple[str, ...]:
    facts = report.facts
    link = report.check("ssh") or report.check("local")
    if link is None:  # the launcher's own host (auto, cpu_rig, slurm)
        reachable = "this host" if facts else "-"
    else:
        reachable = ("yes" if link.ok else "NO") if link.name == "ssh" else "this host"
    nccl = facts.get("nccl_version") or ("yes" if facts.get("nccl") else "no")
    data = report.check("data path")
    return (
        report.host,
        reachable,
        str(facts.get("python", "-")),
        str(facts.get("flodl", "-")),
        str(facts.get("torch", "-")),
        str(facts.get("cuda") or "-"),
        nccl if facts else "-",
        str(len(facts["gpus"])) if "gpus" in facts else "-",
        "-" if data is None else ("ok" if data.ok else "MISSING"),
    )


def render_cluster(report: ClusterReport) -> str:
    rows = [_COLUMNS, *(_row(r) for r in report.hosts)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [f"flodl probe — cluster kind={report.kind}, {len(report.hosts)} host(s)"]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    if report.checks:
        lines += ["", "cluster:", *_check_lines(report.checks)]
    if report.ready:
        lines += ["", "ready"]
    else:
        lines += ["", "NOT ready:", *(f"  - {reason}" for reason in report.reasons)]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flodl probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "cluster", nargs="*", metavar="cluster=NAME | cluster.KEY=VALUE", help="cluster to check"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--local", action="store_true", help="this host only (no cluster)")
    parser.add_argument("--host", default=None, help="address the controller would bind")
    parser.add_argument("--port", type=int, default=None, help="controller port to check")
    parser.add_argument("--data-path", default=None, help="a path every rank must read")
    args = parser.parse_intermixed_args(argv)
    if args.local and args.cluster:
        parser.error("--local probes this host only: drop the cluster arguments")
    if not args.cluster:
        report = probe(args.host or "127.0.0.1", args.port or 0, args.data_path)
        if args.json:
            print(json.dumps(report.as_json(), indent=2))
        else:
            print(render(report))
        return 0 if report.ready else 1
    return _main_cluster(args)


def _main_cluster(args: argparse.Namespace) -> int:
    from flodl.config import ConfigError

    overrides = list(args.cluster)
    if args.host is not None:
        overrides.append(f"cluster.controller.host={args.host}")
    if args.port is not None:
        overrides.append(f"cluster.controller.port={args.port}")
    try:
        cluster = load_cluster(overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ConfigError.exit_code
    report = probe_cluster(cluster, args.data_path)
    print(json.dumps(report.as_json(), indent=2) if args.json else render_cluster(report))
    return 0 if report.ready else 1
