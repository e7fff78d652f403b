"""SIGTERM handled like Ctrl-C, in a module light enough for the CLI to import before torch."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: stop dispatch, save a graceful bundle, end every rank."""

    exit_code = 143


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While joining in the main thread, SIGTERM raises :class:`Terminated` (like SIGINT)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
