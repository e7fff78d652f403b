"""A window's batches on a rank: the loader is fed every planned window as soon as the plan is in
the inbox (its workers load ahead, in the order the windows will run), and the time the rank
waits for each batch is the window's data time.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from typing import Any

from flodl.runtime.wire.messages import Plan, Window


def _key(window: Window) -> tuple[int, int]:
    """A window's identity for the loader: its index within its membership generation."""
    return (window.index, window.generation)


class WindowFeed:
    """The rank's loader path (``data_path``) as the loop and the cooperative tier use it."""

    def __init__(
        self,
        data: Any,
        link: Any,
        pending: collections.deque[Any],
        is_void: Callable[[Window], bool],
    ) -> None:
        self.data = data
        self.link = link
        self._pending = pending  # the loop's inbox of messages kept for later
        self.is_void = is_void  # planned for an older membership: never loaded

    def feed(self, windows: Any = ()) -> None:
        """Hand ``windows`` and every planned window already waiting in the inbox to the loader,
        in the order they will run, so its workers load ahead (a no-op without workers)."""
        if not self.data.prefetches:
            return
        inbox = itertools.chain(self._pending, self.link.peek())
        waiting = [m for m in inbox if isinstance(m, Plan)]
        for window in itertools.chain(windows, *(m.windows for m in waiting)):
            if not self.is_void(window):
                self.data.feed(_key(window), window.epoch, window.chunks)

    def window_batches(self, window: Window) -> Any:
        """``window``'s batches from the loader (planned chunks only, in plan order)."""
        return self.data.batches(_key(window), window.epoch, window.chunks)

    def cancel(self, window: Window) -> None:
        """A void window: what the loader loaded ahead for it goes."""
        self.data.cancel(_key(window))

    def timed(self, batches: Any, tally: Any) -> Any:
        """Yield ``batches``, adding the time spent waiting for each to the tally's data time
        (and feeding windows planned meanwhile to the loader)."""
        iterator = iter(batches)
        while True:
            self.feed()
            t0 = time.perf_counter()
            batch = next(iterator, None)
            tally.data_ms += (time.perf_counter() - t0) * 1000.0
            if batch is None:
                return
            yield batch
