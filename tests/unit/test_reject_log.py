"""Rejected control-plane peers are logged once per address per interval (issue: a storm of
bad connections logged 2,217 lines)."""

from __future__ import annotations

import logging

from flodl.runtime.cohorts.control_server import RejectLog


def test_a_storm_from_one_address_logs_once_per_interval(caplog):
    log = RejectLog(every_s=60.0)
    with caplog.at_level(logging.WARNING, logger="flodl.runtime.cohorts.control_server"):
        logged = [log.rejected("10.0.0.9", "bad hmac", now=100.0 + i * 0.01) for i in range(500)]
        logged.append(log.rejected("10.0.0.9", "bad hmac", now=161.0))
    assert logged.count(True) == 2 and logged[0] and logged[-1]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "10.0.0.9" in lines[0] and "bad hmac" in lines[0]
    assert "499 more from it not logged in 60 s" in lines[1]


def test_each_address_gets_its_own_line():
    log = RejectLog(every_s=60.0)
    assert log.rejected("a", "x", now=0.0)
    assert log.rejected("b", "x", now=0.1)
    assert not log.rejected("a", "x", now=59.0)
    assert log.rejected("a", "x", now=60.5)
