"""The shape of the package, checked from its source: no import cycles (module-level or inside
functions), and rank identity read from the environment by one module only.

Both checks ast-parse every module of ``flodl/``; nothing is imported or run.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "flodl"
# Top-level folders shipped inside the package (pyproject.toml's package-dir mapping).
MAPPED = {ROOT / "conf": "flodl.conf", ROOT / "recipes": "flodl.recipes"}

# The one module allowed to read rank identity from the environment.
ENV_READER = "flodl.runtime.wire.rank_env"

# Rank identity: who this process is and where its peers are. Anything a placing launcher
# (torchrun, srun, submitit) or our own launcher sets to say so.
RANK_ENV_EXACT = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "NODE_RANK",
    }
)
RANK_ENV_PREFIXES = ("TORCHELASTIC_", "SLURM_", "FLODL_")
# FLODL_* variables that are no rank identity: a user's debugging switches and data directory.
NOT_RANK_ENV = frozenset({"FLODL_FULL_ERROR", "FLODL_FORK_SERVER", "FLODL_DATA_DIR"})


# Import edges tolerated for now, each with the reason. A cycle through any other edge fails.
KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    for folder, package in MAPPED.items():
        if path.is_relative_to(folder):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            break
    else:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    paths = [*PACKAGE.rglob("*.py"), *(p for folder in MAPPED for p in folder.rglob("*.py"))]
    return {module_name(p): p for p in sorted(paths)}


def _resolve(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every flodl module ``name`` imports, at any depth of its code (functions included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, name, path.name == "__init__.py")
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        for target in targets:
            while target and target not in known:  # ``from a import b``: b may be a name
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("flodl"):
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    graph = {name: imports_of(name, path, known) for name, path in mods.items()}
    for source, target in KNOWN_CYCLE_EDGES:
        graph[source].discard(target)
    # Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first; a package importing
    # its own submodule is no cycle, so parents are not added as edges.
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None (depth-first, colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def _is_rank_var(name: str) -> bool:
    if name in NOT_RANK_ENV:
        return False
    return name in RANK_ENV_EXACT or name.startswith(RANK_ENV_PREFIXES)


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ"
    return isinstance(node, ast.Name) and node.id == "environ"


def _key(node: ast.AST | None, on_environ: bool) -> str | None:
    """The variable a key names: a string literal, or (on ``os.environ``) a constant such as
    ``rank_env.SECRET_FILE``, reported by its name."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value if _is_rank_var(node.value) else None
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    if on_environ and isinstance(name, str) and name.isupper():
        return f"<{name}>"
    return None


def rank_env_reads(path: Path) -> list[tuple[int, str]]:
    """(line, variable) of each read of a rank variable: ``m[...]``, ``m.get(...)``,
    ``m.pop(...)``, ``os.getenv(...)`` and ``"X" in m``, where ``m`` is ``os.environ`` or any
    mapping standing in for it (``env = os.environ if environ is None else environ``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    reads: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        key: str | None = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = _key(node.slice, _is_environ(node.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            func = node.func
            if func.attr in ("get", "pop"):
                key = _key(node.args[0], _is_environ(func.value))
            elif func.attr == "getenv":
                key = _key(node.args[0], on_environ=True)
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            key = _key(node.left, any(_is_environ(c) for c in node.comparators))
        if key is not None:
            reads.append((node.lineno, key))
    return reads


def test_cycle_finder_reports_the_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_imports_found_at_function_level_and_relative(tmp_path: Path) -> None:
    pkg = tmp_path / "flodl"
    pkg.mkdir()
    source = "from . import b\n\ndef f():\n    from flodl.c import thing\n    import flodl.d\n"
    (pkg / "a.py").write_text(source)
    known = {"flodl", "flodl.a", "flodl.b", "flodl.c", "flodl.d"}
    assert imports_of("flodl.a", pkg / "a.py", known) == {"flodl", "flodl.b", "flodl.c", "flodl.d"}


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50  # the whole package was read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_rank_env_reader_finds_every_form(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "import os\n"
        "a = os.environ['RANK']\n"
        "b = os.environ.get('SLURM_PROCID')\n"
        "c = os.getenv('TORCHELASTIC_RUN_ID')\n"
        "d = 'MASTER_ADDR' in os.environ\n"
        "e = os.environ.get('HOME')\n"
        "g = env.get('LOCAL_RANK')\n"
        "h = os.environ.get(rank_env.SECRET_FILE)\n"
        "f = os.environ.get('FLODL_FULL_ERROR')\n"
        "os.environ['RANK'] = '1'\n"
    )
    found = sorted(name for _, name in rank_env_reads(path))
    expected = ["<SECRET_FILE>", "LOCAL_RANK", "MASTER_ADDR", "RANK", "SLURM_PROCID"]
    assert found == [*expected, "TORCHELASTIC_RUN_ID"]


def test_rank_env_is_read_in_one_module() -> None:
    mods = modules()
    assert ENV_READER in mods
    offenders = {
        name: reads
        for name, path in mods.items()
        if name != ENV_READER
        for reads in [rank_env_reads(path)]
        if reads
    }
    assert not offenders, (
        f"rank environment read outside {ENV_READER} (take the typed identity it reads "
        f"instead): {offenders}"
    )


# Which folders may not import which: a rank, its sync and the wire never reach up into the
# launcher's side (cohorts, controller); the wire is the bottom of the runtime; ElChe is pure
# (its config aside); recipes are plain models and steps that know nothing of the runtime.
FOLDER_RULES: dict[str, tuple[str, ...]] = {
    "flodl.runtime.rank": ("flodl.runtime.cohorts", "flodl.runtime.controller"),
    "flodl.runtime.sync": (
        "flodl.runtime.cohorts",
        "flodl.runtime.controller",
        "flodl.runtime.rank",
    ),
    "flodl.runtime.wire": (
        "flodl.runtime.cohorts",
        "flodl.runtime.controller",
        "flodl.runtime.rank",
        "flodl.runtime.sync",
    ),
    "flodl.recipes": ("flodl.runtime", "flodl.cli", "flodl.job", "flodl.trainer"),
}
# Folders that sit below everything: ElChe (pure) and the rig's models import only themselves
# and the config.
BOTTOM_FOLDERS: dict[str, tuple[str, ...]] = {
    "flodl.elche": ("flodl.elche", "flodl.config"),
    "flodl.rig": ("flodl.rig", "flodl.config"),
}
MAX_MODULES_PER_FOLDER = 15


def _inside(module: str, folder: str) -> bool:
    return module == folder or module.startswith(folder + ".")


def folder_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for source, targets in sorted(graph.items()):
        for folder, banned in FOLDER_RULES.items():
            if not _inside(source, folder):
                continue
            bad += [f"{source} -> {t}" for t in sorted(targets) for b in banned if _inside(t, b)]
        for folder, allowed in BOTTOM_FOLDERS.items():
            if _inside(source, folder):
                others = [t for t in targets if not any(_inside(t, ok) for ok in allowed)]
                bad += [f"{source} -> {t}" for t in sorted(others)]
    return bad


def test_folder_rules_catch_an_upward_import() -> None:
    graph = {
        "flodl.runtime.wire.channel": {"flodl.runtime.controller.sums"},
        "flodl.runtime.rank.loop": {"flodl.runtime.sync.averaging"},
        "flodl.elche.cadence": {"flodl.config", "flodl.runtime.sync.groups"},
        "flodl.rig.links": {"flodl.config.cluster", "flodl.runtime.wire.rank_link"},
    }
    assert folder_violations(graph) == [
        "flodl.elche.cadence -> flodl.runtime.sync.groups",
        "flodl.rig.links -> flodl.runtime.wire.rank_link",
        "flodl.runtime.wire.channel -> flodl.runtime.controller.sums",
    ]


def test_folders_import_only_downwards() -> None:
    bad = folder_violations(import_graph())
    assert not bad, "imports against the folder rules:\n" + "\n".join(bad)


def test_no_folder_holds_more_than_fifteen_modules() -> None:
    folders: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            key = str(path.parent.relative_to(ROOT))
            folders[key] = folders.get(key, 0) + 1
    crowded = {k: n for k, n in folders.items() if n > MAX_MODULES_PER_FOLDER}
    assert not crowded, f"folders over {MAX_MODULES_PER_FOLDER} modules: {crowded}"


# The command line sits on top: the library (everything but flodl.cli and `python -m flodl`)
# never imports it, so the Python API runs without the CLI's modules.
CLI = "flodl.cli"
CLI_ENTRIES = ("flodl.cli", "flodl.__main__")


def cli_importers(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{source} -> {target}"
        for source, targets in sorted(graph.items())
        if not any(_inside(source, entry) for entry in CLI_ENTRIES)
        for target in sorted(targets)
        if _inside(target, CLI)
    ]


def test_the_cli_rule_catches_a_library_import() -> None:
    graph = {"flodl.trainer": {"flodl.cli.signals"}, "flodl.__main__": {"flodl.cli.train"}}
    assert cli_importers(graph) == ["flodl.trainer -> flodl.cli.signals"]


def test_the_library_does_not_import_the_cli() -> None:
    bad = cli_importers(import_graph())
    assert not bad, "the library imports the CLI:\n" + "\n".join(bad)
