"""Waiting on a collective that the membership may doom: pure logic on fake work objects."""

from __future__ import annotations

import time

import pytest

from flodl.runtime.sync import groups


class FakeWork:
    """Completes (or fails) ``after_s`` after creation; never, when ``after_s`` is None."""

    def __init__(self, after_s: float | None, error: str | None = None) -> None:
        self.due = None if after_s is None else time.monotonic() + after_s
        self.error = error

    def is_completed(self) -> bool:
        return self.due is not None and time.monotonic() >= self.due

    def wait(self, timeout=None):
        if timeout is not None and not self.is_completed():
            left = None if self.due is None else self.due - time.monotonic()
            if left is None or left > timeout.total_seconds():
                time.sleep(timeout.total_seconds())
                raise RuntimeError("Operation timed out!")
            time.sleep(max(left, 0))
        if self.error:
            raise RuntimeError(self.error)
        return True


def test_a_collective_that_completes_returns_without_consulting_the_membership():
    asked = []
    groups.wait(FakeWork(0.05), lambda: asked.append(1) or False, poll_s=0.01)
    assert asked  # polled while in flight, and returned when done


def test_a_collective_that_fails_raises_its_own_error_not_abandoned():
    with pytest.raises(RuntimeError, match="Connection reset") as info:
        groups.wait(FakeWork(0.03, "Connection reset by peer"), lambda: False, poll_s=0.01)
    assert not isinstance(info.value, groups.Abandoned)


def test_a_doomed_collective_that_ends_within_the_grace_is_settled():
    work = FakeWork(0.2, "Connection reset by peer")
    with pytest.raises(groups.Abandoned) as info:
        groups.wait(work, lambda: True, poll_s=0.01, grace_s=2.0)
    assert info.value.settled


def test_a_doomed_collective_still_blocked_after_the_grace_is_left_behind():
    start = time.monotonic()
    with pytest.raises(groups.Abandoned) as info:
        groups.wait(FakeWork(None), lambda: True, poll_s=0.01, grace_s=0.2)
    assert not info.value.settled
    assert "left behind" in str(info.value)
    assert time.monotonic() - start < 2.0


def test_a_collective_is_only_abandoned_once_the_membership_changed():
    calls = []

    def doomed() -> bool:
        calls.append(1)
        return len(calls) >= 5

    with pytest.raises(groups.Abandoned):
        groups.wait(FakeWork(None), doomed, poll_s=0.01, grace_s=0.05)
    assert len(calls) == 5
