"""The code blocks of README.md and docs/ that start rank processes (marked ``slow`` in their
``<!-- snippet: ... -->`` comment): 2-rank CPU rigs, sweeps, the tutorials' sessions."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.runner import JOBS, SLOW, run_jobs


@pytest.mark.slow
def test_the_blocks_that_start_ranks(tmp_path: Path) -> None:
    """Blocks marked slow: 2-rank CPU rigs, sweeps, the tutorials' sessions."""
    run_jobs([key for key in JOBS if key in SLOW], tmp_path)
