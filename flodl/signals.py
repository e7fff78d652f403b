"""Stop signals handled like Ctrl-C, in a module light enough for the CLI to import before torch.

SIGTERM (a scheduler, ``kill``) and SIGHUP (the terminal or ssh session went away) stop the run
gracefully, as SIGINT does. A process started as a background job of a non-interactive shell
script (``python run.py &``) begins with SIGINT *ignored* (POSIX), so Python installs no
KeyboardInterrupt handler; torchrun installs its own handler for the same reason, and so do we:
a Ctrl-C or ``kill -INT`` must stop the run however it was started.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: stop dispatch, save a graceful bundle, end every rank."""

    exit_code = 143


class HungUp(Terminated):
    """SIGHUP: the same graceful stop as SIGTERM."""

    exit_code = 129


def _raise(kind: type[KeyboardInterrupt]) -> Any:
    def handler(signum: int, frame: Any) -> None:
        raise kind()

    return handler


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While joining in the main thread, SIGTERM and SIGHUP raise :class:`Terminated` (like
    SIGINT), and SIGINT raises KeyboardInterrupt even when the process started with it ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _raise(Terminated))}
    if hasattr(signal, "SIGHUP"):
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, _raise(HungUp))
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
