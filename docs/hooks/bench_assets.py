"""MkDocs hook: publish the benchmark plots from ``bench/results`` without copying them.

``docs/benchmarks/index.md`` holds the tables ``bench/render.py`` generates, and those refer to
``results/<name>.png``; this hook adds every PNG of ``bench/results`` to the site as
``benchmarks/results/<name>.png``, so the plots exist in one place only (beside the JSON they
were drawn from) and a missing plot is a broken link, which ``mkdocs build --strict`` fails on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def on_files(files: Files, config: Any, **_: Any) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(
            File.generated(config, f"benchmarks/results/{png.name}", abs_src_path=str(png))
        )
    return files
