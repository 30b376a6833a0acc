# tests/test_slow_reports.py - the execution runtime's account of late reports (status
# `slow_reports`, docs/execution.md): where the time of a batch whose report went out late
# went, and the log line that sums them up at most every SLOW_LOG_S.
from __future__ import annotations

import logging
from collections import Counter, deque
from types import SimpleNamespace

import pytest

from zz.execution import runtime as rtmod
from zz.execution.certificates import CommitCollector


def _bare_runtime() -> rtmod.Runtime:
    rt = rtmod.Runtime.__new__(rtmod.Runtime)
    rt.cp = 64
    rt.counters = Counter()
    rt.slow_reports = deque(maxlen=16)
    rt.checkpoint_reports = deque(maxlen=8)
    rt.faults = SimpleNamespace(fault=None)  # no drill fault on
    rt._slow_worst = None
    rt._slow_since = 0
    rt._slow_logged = -rtmod.SLOW_LOG_S
    return rt


def test_a_late_report_is_split_into_where_its_time_went(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rt = _bare_runtime()
    now = [100.0]
    monkeypatch.setattr(rtmod.time, "monotonic", lambda: now[0])
    caplog.set_level(logging.WARNING, logger=rtmod.log.name)
    # first vote at 97.0, 2g+1 at 97.1, taken at 98.5, executed by 99.5 (0.2 s CPU)
    rt._time_report(5, (97.0, 97.1), 98.5, 99.5, 0.2, 99.6)
    (e,) = rt.slow_reports
    assert e["seq"] == 5 and e["total"] == 3.0
    assert (e["votes"], e["queue"], e["execute"], e["cpu"]) == (0.1, 1.4, 1.0, 0.2)
    assert e["checkpoint"] == 0.0 and e["send"] == 0.5
    assert "batch 5, 3.00 s" in caplog.text
    # at a checkpoint seq the time from ckpt_from on is the checkpoint's
    now[0] = 101.0
    rt._time_report(64, (100.0, 100.0), 100.0, 100.2, 0.1, 100.3)
    assert rt.slow_reports[-1]["checkpoint"] == 0.7
    assert rt.counters["slow_reports"] == 2
    # logged once per SLOW_LOG_S: the second is counted, kept, not logged yet
    assert caplog.text.count("report(s)") == 1
    now[0] = 100.0 + rtmod.SLOW_LOG_S
    rt._time_report(65, (now[0] - 1.0, None), now[0] - 0.5, now[0], 0.1, now[0])
    assert caplog.text.count("report(s)") == 2 and "2 report(s)" in caplog.text
    # a report on time leaves no trace
    rt._time_report(66, (now[0] - 0.1, now[0] - 0.1), now[0], now[0], 0.0, now[0])
    assert len(rt.slow_reports) == 3


def test_the_collector_times_the_first_vote_and_the_quorum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zz.crypto import sha256
    from zz.execution import certificates

    t = [10.0]
    monkeypatch.setattr(certificates.time, "monotonic", lambda: t[0])
    c = CommitCollector(4, 1)
    batch = b"batch"
    d = sha256(batch)
    c.add(0, 1, d, batch)
    t[0] = 10.5
    c.add(1, 1, d, batch)
    assert c.arrival(1) == (10.0, None)
    t[0] = 11.0
    c.add(2, 1, d, batch)  # 2g+1 = 3 matching
    t[0] = 12.0
    c.add(3, 1, d, batch)
    assert c.arrival(1) == (10.0, 11.0)
    c.executed(1)
    assert c.arrival(1) is None
