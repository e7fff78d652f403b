"""Dotted paths (``pkg.module.name``): found, importable, defined in source - without importing."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from typing import Any


def resolve_dotted(path: str) -> Any:
    """Import ``pkg.module.attr`` and return the attribute, with an error that says what failed."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{path!r} is not a dotted path like 'package.module.name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} ({exc})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}") from None


def check_locatable(path: str) -> None:
    """What validation can say about ``pkg.module.attr`` without importing anything: the module
    exists; the attribute is checked only when the module is already imported. Importing targets
    to validate them would import torch and torchmetrics (~2 s) before a pure-config refusal; the
    launcher resolves every target later (:mod:`flodl.preflight`), naming its key."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{path!r} is not a dotted path like 'package.module.name'")
    module = sys.modules.get(module_name)
    if module is not None:
        if not hasattr(module, attr):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
    elif not _module_found(module_name):
        resolve_dotted(path)  # not found on disk: the real import says why (or finds it after all)


def defined_in_source(path: str) -> bool:
    """Whether ``pkg.module.attr`` is found without importing anything: the module's source on
    the import path binds ``attr`` at its top level (a class, a function, an import, an
    assignment; inside ``if`` / ``try`` blocks too). False when that cannot be told so (no
    source, a module ``__getattr__``, a star import): the caller then imports it."""
    module_name, _, attr = path.rpartition(".")
    spec = _module_spec(module_name) if module_name else None
    if spec is None or not spec.origin or not str(spec.origin).endswith(".py"):
        return False
    try:
        tree = ast.parse(Path(spec.origin).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False
    return attr in _top_level_names(tree.body)


def _top_level_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            handlers = getattr(node, "handlers", [])
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                names |= _top_level_names(block)
            for handler in handlers:
                names |= _top_level_names(handler.body)
    return names


def _module_found(name: str) -> bool:
    """Whether ``name`` is on the import path, found without executing any package's code
    (``importlib.util.find_spec`` would import every parent package)."""
    return _module_spec(name) is not None


def _module_spec(name: str) -> Any:
    search: Any = None
    parts = name.split(".")
    spec = None
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        loaded = sys.modules.get(prefix)
        try:
            spec = loaded.__spec__ if loaded is not None else _find(prefix, search)
        except (ImportError, ValueError):
            return None
        if spec is None:
            return None
        search = spec.submodule_search_locations
        if search is None and depth < len(parts):
            return None  # a plain module has no submodules
    return spec


def _find(name: str, search: Any) -> Any:
    if search is None:  # top level: every finder on sys.meta_path (editable installs included)
        return importlib.util.find_spec(name)
    # A submodule: each finder on sys.meta_path with the parent's path, as an import asks them
    # (an editable install's finder maps flodl.recipes to the repository's recipes/), none of
    # them running the parent's code.
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        spec = find(name, list(search)) if find is not None else None
        if spec is not None:
            return spec
    return None
