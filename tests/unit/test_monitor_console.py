"""Epoch lines and the single launcher progress display, in every mode."""

from __future__ import annotations

import io
import re

import pytest

from flodl.monitor.console import Progress, format_epoch_line
from flodl.monitor.metrics import EpochMetrics


class FakeTty(io.StringIO):
    """A terminal as far as ``isatty`` is concerned; keeps what was written."""

    def isatty(self) -> bool:
        return True


def _screen(raw: str) -> list[str]:
    """Replay the cursor moves rich uses (CR, LF, erase line, cursor up); return the screen."""
    rows: list[str] = [""]
    row, col = 0, 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]+", raw):
        if token == "\n":
            row, col = row + 1, 0
            rows.extend([""] * (row + 1 - len(rows)))
        elif token == "\r":
            col = 0
        elif token == "\x1b[2K":
            rows[row] = ""
        elif token.startswith("\x1b[") and token.endswith("A"):
            row = max(0, row - int(token[2:-1] or 1))
        elif not token.startswith("\x1b"):
            line = rows[row].ljust(col)
            rows[row] = line[:col] + token + line[col + len(token) :]
            col += len(token)
    return [r.rstrip() for r in rows if r.strip()]


def _metrics(
    epoch: int, eval_value: float | None = None, shares: list[float] | None = None
) -> EpochMetrics:
    return EpochMetrics(
        epoch=epoch,
        avg_loss=0.21434,
        epoch_ms=1234.4,
        per_rank_batch_share=[0.67, 0.33] if shares is None else shares,
        anchor=12,
        eval_value=eval_value,
    )


def test_epoch_line_matches_the_documented_shape() -> None:
    line = format_epoch_line(_metrics(3, eval_value=0.94123), 5, "accuracy")
    assert line == "epoch 3/5  loss 0.2143  accuracy 0.9412  1234 ms  share [0.67 0.33]  anchor 12"


def test_epoch_line_shows_every_eval_metric_in_order() -> None:
    m = _metrics(2, eval_value=0.9)
    m.eval_metrics = {"eval_loss": 0.31234, "accuracy": 0.9, "f1": 0.88}
    line = format_epoch_line(m, 5, "accuracy")
    assert line.startswith("epoch 2/5  loss 0.2143  eval_loss 0.3123  accuracy 0.9000  f1 0.8800  ")


def test_epoch_line_omits_what_does_not_apply() -> None:
    assert format_epoch_line(_metrics(1), 5, "accuracy") == (
        "epoch 1/5  loss 0.2143  1234 ms  share [0.67 0.33]  anchor 12"
    )
    # One rank: no share or anchor; an eval without a metric name is called "eval".
    solo = _metrics(5, eval_value=0.5, shares=[1.0])
    assert format_epoch_line(solo, 5, None) == "epoch 5/5  loss 0.2143  eval 0.5000  1234 ms"


def test_epoch_line_keeps_tiny_losses_readable() -> None:
    m = _metrics(0)
    m.avg_loss = 2.5e-5
    assert "loss 2.500e-05" in format_epoch_line(m, 1, None)


def _drive(progress: Progress, lines: list[str]) -> None:
    for epoch, line in enumerate(lines):
        progress.start_epoch(epoch, total_samples=100)
        for done in (25, 50, 100):
            progress.advance(done, loss=0.5, shares=[0.6, 0.4])
        progress.end_epoch(line)
    progress.close()


LINES = ["epoch 1/2  loss 0.5000  share [0.60 0.40]", "epoch 2/2  loss 0.4000  share [0.60 0.40]"]


@pytest.mark.parametrize("mode", ["lines", "auto"])
def test_lines_mode_writes_exactly_the_epoch_lines(mode: str) -> None:
    out = io.StringIO()  # not a tty, so auto means lines
    progress = Progress(2, mode=mode, stream=out)
    assert progress.mode == "lines"
    _drive(progress, LINES)
    assert out.getvalue() == "".join(line + "\n" for line in LINES)


def test_off_writes_nothing() -> None:
    out = FakeTty()
    _drive(Progress(2, mode="off", stream=out), LINES)
    assert out.getvalue() == ""


@pytest.mark.parametrize("mode", ["bar", "auto"])
def test_bar_on_a_terminal_scrolls_the_lines_above_it(mode: str) -> None:
    out = FakeTty()
    progress = Progress(2, mode=mode, stream=out)
    assert progress.mode == "bar"
    _drive(progress, LINES)
    progress.close()  # idempotent
    # What the terminal shows at the end: the epoch lines, verbatim ("[0.60 0.40]" is not
    # markup), and no bar left behind.
    assert _screen(out.getvalue()) == LINES


def test_unknown_mode_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"logger.progress=fancy: must be one of"):
        Progress(1, mode="fancy", stream=io.StringIO())
