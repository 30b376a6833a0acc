"""A durable agreement replica killed and restarted from its log flags nothing when every
execution replica is correct (docs/fault-detection.md "A restarted agreement replica";
docs/operations.md, the WAKEUP of the power-loss run at seed 1128).

Real zz-agreed replicas with their logs on disk (g = 1, f = 1: execution replicas 0 and 1
awake, 2 a sleeping spare); the execution replicas are the test, which sends their
EXEC-REPORTs by hand, so that replica 3 is killed at an exact point of a seq's reports:
after the seq was dispatched and before any report, between the two reports, or after its
certificate. A restart replays the committed seqs above the recovered stable checkpoint and
dispatches them again (wal.c, execute.c), with no record of the reports it had; the runtimes
send their kept reports again on the fresh connection (execution/reports.py), which the test
does as they do: every report each one kept, one connection each."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from tests.cluster import Cluster
from tests.test_agreed_durable import _start
from tests.test_agreement_log import _secret
from tests.test_agreement_window import _order_until, _quiet, _report, _send_all
from zz import wire

CP = 8
WINDOW = 16
# The floor is far above the time between the two resends (milliseconds) on a loaded
# machine; the test waits past the ceiling before it looks.
TIMERS = {"detect_k": 2, "detect_floor_ms": 1500, "detect_ceiling_ms": 2000}
VICTIM = 3  # a backup in view 0: the others go on ordering while it is down


def _cluster(tmp: Path) -> Cluster:
    data = {i: str(tmp / f"data{i}") for i in range(4)}
    return Cluster(
        tmp,
        g=1,
        app="kv",
        f=1,
        active=2,
        checkpoint_interval=CP,
        log_window=WINDOW,
        overrides={**TIMERS, "data_dir": data, "durability": "fsync"},
    )


def _both(c: Cluster, seqs: range, to: list[int]) -> None:
    """Execution replicas 0 and 1 report `seqs` (equal digests) to each of `to`."""
    _send_all(c, {r: [_report(c, i, s, r) for s in seqs for i in (0, 1)] for r in to})


def _order_one(c: Cluster, rs: list[int], seq: int) -> None:
    """One request through the primary (replica 0), with a client of its own; wait until
    replicas `rs` executed `seq` (_order_until waits for every replica, alive or not)."""
    client = c.client_principal(c.nclients - 1)
    keys = _secret(c, client)
    req = wire.Request(1, client, timestamp=time.time_ns(), flags=0, op=b"alone")
    with socket.create_connection(("127.0.0.1", c.port(0)), timeout=5) as s:
        s.sendall(wire.frame(req.with_macs({r: keys[r] for r in range(c.n)}).encode()))
        c.wait_for(
            lambda: all(x["last_exec"] >= seq for x in c.stats_all(rs)),
            what=f"seq {seq} executed by {rs}",
        )


def _certified(c: Cluster, rs: list[int], n: int) -> bool:
    return all(c.stats(r)["exec_certificates"] >= n for r in rs)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["dispatched", "one-report", "certified", "down-while-ordered"])
def test_a_restarted_agreement_replica_flags_nothing(tmp_path: Path, point: str) -> None:
    c = _cluster(tmp_path)
    others = [r for r in range(c.n) if r != VICTIM]
    with c:
        c.start()
        top = CP + 2  # the stable checkpoint at CP, two seqs above it
        _order_until(c, top)
        _both(c, range(1, top + 1), list(range(c.n)))
        c.wait_for(lambda: _certified(c, list(range(c.n)), top), what="seqs 1-10 certified")
        seq = top + 1
        if point == "down-while-ordered":
            c.kill(VICTIM)
            _order_one(c, others, seq)
            _both(c, range(seq, seq + 1), others)
        else:
            _order_until(c, seq)
            if point == "one-report":
                # Exec 0's report reached every replica (the victim's timer runs), exec 1's
                # only the others: the victim dies between the two.
                _send_all(c, {r: [_report(c, 0, seq, r)] for r in range(c.n)})
                c.wait_for(
                    lambda: c.stats(VICTIM)["exec_reports"] >= 2 * top + 1,
                    what="exec 0's report at the victim",
                )
                c.kill(VICTIM)
                _send_all(c, {r: [_report(c, 1, seq, r)] for r in others})
            elif point == "certified":
                _both(c, range(seq, seq + 1), list(range(c.n)))
                c.wait_for(lambda: _certified(c, list(range(c.n)), seq), what="certified")
                c.kill(VICTIM)
            else:  # dispatched everywhere, no report anywhere yet
                c.kill(VICTIM)
                _both(c, range(seq, seq + 1), others)
        c.wait_for(lambda: _certified(c, others, seq), what=f"seq {seq} certified by the others")
        log = _start(c, VICTIM)
        assert "durable state: recovered" in log, log
        rec = c.stats(VICTIM)["wal"]
        assert rec["recovered_stable"] == CP, rec
        # Each runtime's fresh connection: its kept reports, one connection per runtime.
        for i in (0, 1):
            _send_all(c, {VICTIM: [_report(c, i, s, VICTIM) for s in range(1, seq + 1)]})
        c.wait_for(
            lambda: c.stats(VICTIM)["last_exec"] == seq, what="the victim at the others' seq"
        )
        # Certified again: every seq it dispatched after the restart (CP + 1 .. seq).
        c.wait_for(
            lambda: _certified(c, [VICTIM], seq - CP),
            what="the victim's seqs above its stable checkpoint certified again",
        )
        # Past every timer a report of this test may have started.
        time.sleep(TIMERS["detect_ceiling_ms"] / 1000 + 0.5)
        for r in range(c.n):
            s = c.stats(r)
            assert _quiet(s), (r, s)
            assert s["exec_awake"] == [0, 1] and s["exec_sleeping"] == [2], (r, s)
