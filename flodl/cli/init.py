"""``flodl init [DIR] [--package NAME]``: write a project of one's own that ``flodl train`` runs.

The project is ``examples/own_project`` (a test keeps the two identical): a package with a model,
a dataset and a train step, ``conf/config.yaml`` listing flodl's config groups, and
``train_api.py`` for the Python API. Nothing is overwritten.
"""

from __future__ import annotations

import re
import sys
from importlib import resources
from pathlib import Path

USAGE = "usage: flodl init [DIR] [--package NAME]   (DIR: default '.', NAME: default 'myproj')"
TEMPLATE_PACKAGE = "myproj"


def template_files() -> dict[str, str]:
    """Relative path -> text of every template file (``*.tmpl`` under ``project_template/``)."""
    root = resources.files("flodl.cli").joinpath("project_template")
    files: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        for child in node.iterdir():
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            elif child.name.endswith(".tmpl"):
                files[prefix + child.name.removesuffix(".tmpl")] = child.read_text(encoding="utf-8")

    walk(root, "")
    return files


def render(package: str) -> dict[str, str]:
    """The project's files, its package named ``package``."""
    word = re.compile(rf"\b{TEMPLATE_PACKAGE}\b")
    return {
        word.sub(package, path): word.sub(package, text) for path, text in template_files().items()
    }


def parse(argv: list[str]) -> tuple[Path, str]:
    target, package, rest = ".", TEMPLATE_PACKAGE, list(argv)
    while rest:
        arg = rest.pop(0)
        if arg in ("--package", "-p") or arg.startswith("--package="):
            package = arg.split("=", 1)[1] if "=" in arg else (rest.pop(0) if rest else "")
        elif arg.startswith("-"):
            raise ValueError(f"{arg}: unknown flag; {USAGE}")
        else:
            target = arg
    if not package.isidentifier():
        raise ValueError(f"--package={package}: not a Python package name (letters, _, digits)")
    return Path(target), package


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    try:
        target, package = parse(argv)
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    files = render(package)
    clashes = sorted(p for p in files if (target / p).exists())
    if clashes:
        sys.stderr.write(
            f"error: {target / clashes[0]}: already exists; flodl init writes a new project "
            "(pick another DIR)\n"
        )
        return 2
    for rel, text in sorted(files.items()):
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    print(f"wrote a flodl project in {target}: {', '.join(sorted(files))}")
    print(f"next: cd {target} && flodl train")
    return 0
