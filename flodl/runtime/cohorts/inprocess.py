"""The in-process cohort: one rank, a thread of the launcher's own process (one device, solo).

The rank talks to the controller over an in-process link, not a socket; nothing is spawned and
no control plane is served. In the cooperative tier the caller's own thread drives the rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flodl.runtime.controller.controller import Controller, ControllerResult, RunFailed
from flodl.runtime.wire.job_spec import JobSpec
from flodl.runtime.wire.rank_link import beat_interval_s, in_process_link


class InProcessCohort:
    """Rank 0 on a thread beside the controller (or handed to the caller: cooperative)."""

    def __init__(
        self,
        spec: JobSpec,
        controller: Controller,
        on_cooperative: Callable[[Any], None] | None = None,
    ) -> None:
        self.spec = spec
        self.controller = controller
        self.on_cooperative = (
            on_cooperative  # receives the rank's loop (RankLoop); None: a thread runs it
        )
        self._failure: list[BaseException] = []
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._threads: int | None = None  # the caller's torch thread count, while we pin it
        self._to_rank: Any = None  # the controller's end of the rank's link

    def _heartbeat(self, every_s: float) -> None:
        """Beat for the rank as a rank process's link does: it shares this process, so it is
        alive while the process is. A step that outlasts the heartbeat timeout (torch.compile's
        first step, a slow eval) must not get the only rank dropped as stale."""
        from flodl.runtime.wire.messages import Heartbeat

        while not self._stopped.wait(every_s):
            self.controller.post(0, Heartbeat(0))

    def start(self) -> None:
        from flodl.runtime.rank.loop import RankLoop

        rank_end, controller_end = in_process_link(self.controller.post)
        self.controller.attach(0, controller_end)
        self._to_rank = controller_end
        device = in_process_device(self.spec.config.device)
        cluster = self.spec.config.cluster
        if cluster.kind == "cpu_rig":  # the rig simulates one device per rank: pin its threads
            self._threads = torch.get_num_threads()  # process-wide: given back at stop
            torch.set_num_threads(cluster.threads_per_rank)
        every_s = beat_interval_s(cluster.heartbeat_timeout_s)  # (measured at load 7)
        threading.Thread(
            target=self._heartbeat, args=(every_s,), name="flodl-heartbeat", daemon=True
        ).start()
        if self.on_cooperative is not None:
            self.on_cooperative(RankLoop(self.spec, rank_end, 0, device))
            return
        self._thread = threading.Thread(
            target=self._work, args=(rank_end, device), name="flodl-rank0", daemon=True
        )
        self._thread.start()

    def _work(self, rank_end: Any, device: torch.device) -> None:
        from flodl.runtime.rank.loop import RankLoop

        try:
            RankLoop(self.spec, rank_end, 0, device).run()
        except BaseException as exc:
            from flodl.runtime.rank.process import failure_message
            from flodl.runtime.wire.messages import RankError

            self._failure.append(exc)
            message, blame = failure_message(exc)
            self.controller.post(0, RankError(0, message, "", blame))

    def join(self, stop_requested: Callable[[], bool]) -> ControllerResult:
        try:
            return self.controller.run(stop_requested)
        except RunFailed as exc:
            if self._failure:  # the rank's own exception stays reachable for API callers
                raise exc from self._failure[0]
            raise

    def lose(self, rank: int) -> None:
        """The only rank is this process: a lost rank is a failed run, nothing to take down."""

    def outputs(self) -> list[Path]:
        return []  # the rank logs to this process's own console

    def stop(self, failure: BaseException | None) -> None:
        self._stopped.set()
        if failure is not None and self._to_rank is not None:
            self._to_rank.close()  # a rank waiting for a plan that will not come ends now
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._threads is not None:  # the caller's process (a notebook, a test) gets its own back
            torch.set_num_threads(self._threads)
            self._threads = None


def in_process_device(kind: str) -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", 0)
    return torch.device("cpu")
