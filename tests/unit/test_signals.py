"""Stop signals: SIGTERM and SIGHUP stop like Ctrl-C, and SIGINT works even when inherited
as ignored (a background job of a shell script)."""

from __future__ import annotations

import os
import signal

import pytest

from flodl.signals import HungUp, Terminated, sigterm_as_interrupt


@pytest.mark.parametrize(
    ("signum", "kind", "code"),
    [(signal.SIGTERM, Terminated, 143), (signal.SIGHUP, HungUp, 129)],
)
def test_stop_signals_raise_a_graceful_interrupt(signum, kind, code):
    before = signal.getsignal(signum)
    with pytest.raises(kind) as info, sigterm_as_interrupt():
        os.kill(os.getpid(), signum)
    assert isinstance(info.value, KeyboardInterrupt) and info.value.exit_code == code
    assert signal.getsignal(signum) is before  # restored on the way out


def test_an_ignored_sigint_is_handled_while_running():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # restored
    finally:
        signal.signal(signal.SIGINT, previous)
