"""Deprecated: the recipes moved to :mod:`flodl.recipes` (a top-level ``recipes`` package collides
with a project's own). ``import recipes.models`` keeps working for one release, with a warning."""

import importlib
import sys
import warnings

warnings.warn(
    "the 'recipes' package moved to 'flodl.recipes'; import from flodl.recipes instead "
    "(the old path goes away in the next release)",
    DeprecationWarning,
    stacklevel=2,
)

for _name in ("datasets", "lm", "models", "steps", "text"):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"flodl.recipes.{_name}")
