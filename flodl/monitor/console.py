"""What the launcher prints: one epoch line per epoch and one progress display for the cluster.

There is never a bar per rank: ranks report to the launcher, which shows the whole run as one
bar (on a terminal) or one plain line per epoch (in logs, CI, pipes). The epoch line is the same
text in both, so a log file and a terminal session read alike.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Literal, TextIO

from flodl.monitor.metrics import EpochMetrics

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID

ProgressMode = Literal["auto", "bar", "lines", "off"]
_MODES = ("auto", "bar", "lines", "off")


def _has_rich() -> bool:
    from flodl.config.extras import has

    return has("rich")


def _fmt_value(value: float) -> str:
    # Four decimals read well for losses and accuracies; tiny values would all print 0.0000.
    if value != 0 and math.isfinite(value) and abs(value) < 1e-3:
        return f"{value:.3e}"
    return f"{value:.4f}"


def format_epoch_line(m: EpochMetrics, num_epochs: int, eval_metric: str | None) -> str:
    """``epoch 3/5  loss 0.2143  eval_loss 0.2511  accuracy 0.9412  1234 ms  share [0.67 0.33]``.

    ``epoch`` counts from 1 in :class:`EpochMetrics` and here alike. Every eval metric appears
    when the epoch was evaluated; share and anchor only when there is more than one rank.
    """
    parts = [f"epoch {m.epoch}/{num_epochs}", f"loss {_fmt_value(m.avg_loss)}"]
    if m.eval_metrics:
        parts += [f"{name} {_fmt_value(value)}" for name, value in m.eval_metrics.items()]
    elif m.eval_value is not None:
        parts.append(f"{eval_metric or 'eval'} {_fmt_value(m.eval_value)}")
    parts.append(f"{m.epoch_ms:.0f} ms")
    if len(m.per_rank_batch_share) > 1:
        parts.append("share [" + " ".join(f"{s:.2f}" for s in m.per_rank_batch_share) + "]")
        parts.append(f"anchor {m.anchor}")
    return "  ".join(parts)


def _share_text(shares: list[float]) -> str:
    return "share " + "/".join(f"{s:.2f}" for s in shares) if len(shares) > 1 else ""


class Progress:
    """The launcher's single progress display.

    ``mode``: ``auto`` draws a rich bar when ``stream`` is a terminal and prints epoch lines
    otherwise; ``bar``, ``lines`` and ``off`` force a style. ``stream`` defaults to stdout.
    """

    def __init__(
        self, num_epochs: int, mode: ProgressMode | str = "auto", stream: TextIO | None = None
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"logger.progress={mode}: must be one of {', '.join(_MODES)}")
        self.num_epochs = num_epochs
        self.stream: TextIO = stream if stream is not None else sys.stdout
        if mode == "auto":  # the bar needs rich (flodl[progress]); lines without it
            mode = "bar" if _isatty(self.stream) and _has_rich() else "lines"
        self.mode = mode
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        if mode == "bar":
            self._bar = self._make_bar()

    def _make_bar(self) -> RichProgress:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        # force_terminal: "bar" forced onto a pipe still draws; auto only gets here on a tty.
        console = Console(file=self.stream, force_terminal=True, highlight=False)
        bar = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=console,
            transient=True,  # the finished bar vanishes; the epoch lines above it remain
            redirect_stdout=False,  # rank output is forwarded by the launcher, not captured here
            redirect_stderr=False,
        )
        bar.start()
        return bar

    def start_epoch(self, epoch: int, total_samples: int) -> None:
        """Reset the bar for ``epoch`` (0-based) covering ``total_samples`` samples."""
        if self._bar is None:
            return
        description = f"epoch {epoch + 1}/{self.num_epochs}"
        if self._task is None:
            self._task = self._bar.add_task(description, total=total_samples, info="")
        else:
            self._bar.reset(self._task, total=total_samples, description=description, info="")

    def advance(self, samples_done: int, loss: float | None, shares: list[float]) -> None:
        """Samples done so far in this epoch (not an increment), the latest loss, rank shares."""
        if self._bar is None or self._task is None:
            return
        loss_text = f"loss {_fmt_value(loss)}" if loss is not None else ""
        info = "  ".join(p for p in (loss_text, _share_text(shares)) if p)
        self._bar.update(self._task, completed=samples_done, info=info)

    @property
    def drawing(self) -> bool:
        """True while a live bar owns the terminal (other output must go through echo)."""
        return self._bar is not None

    def echo(self, line: str) -> None:
        """Print a line above the bar (or plainly, in lines mode); nothing when off."""
        if self._bar is not None:
            # out(), not print(): no markup, so "[0.67 0.33]" is text, not a style tag.
            self._bar.console.out(line, highlight=False)
        elif self.mode == "lines":
            print(line, file=self.stream, flush=True)

    def end_epoch(self, line: str) -> None:
        """Print the epoch line (see :func:`format_epoch_line`)."""
        self.echo(line)

    def close(self) -> None:
        """Remove the bar and restore the terminal; idempotent."""
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.stop()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or file-like objects without isatty
        return False
