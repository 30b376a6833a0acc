# tests/test_convicted_reports.py - a convicted execution replica's EXEC-REPORTs count for
# nobody: from its conviction until its successor's SPARE-READY they are dropped and counted
# (stats exec_reports_convicted), so that nothing it says is held against the fresh replica
# that takes its index (campaign f=2 seed 2027 round 2: a liar's future-seq reports got its
# successor woken and convicted). What it reported before its conviction for later seqs is
# forgotten at the conviction too (zz_detect_forget); this test does not reach that part.
from __future__ import annotations

from pathlib import Path

from tests.cluster import SERVICE_ID, Cluster
from tests.test_sibling_rounds import _send, _shutdowns, _wakeup
from zz import keys, wire
from zz.crypto import sha256

S = 5


def _report(kd: Path, n: int, seq: int, label: bytes) -> bytes:
    sec = keys.load_secret(keys.secret_path(kd, SERVICE_ID, wire.exec_principal(0)))
    rep = wire.ExecReport.of(
        SERVICE_ID, wire.exec_principal(0), seq, [wire.ReplyRef(7, 1, sha256(label))]
    )
    return rep.with_macs({r: sec.macs[r] for r in range(n)}).encode()


def test_reports_of_a_convicted_replica_count_for_nobody(tmp_path: Path) -> None:
    with Cluster(tmp_path, app="kv", f=1) as c:
        c.start()
        kd = c.dir / "keys"
        # Replica 0 reports for a seq not dispatched yet (kept as early), then is convicted.
        early = _report(kd, c.n, S + 3, b"lie")
        for r in range(c.n):
            _send(c.port(r), early)
        c.wait_for(
            lambda: all(s["exec_reports_early"] >= 1 for s in c.stats_all()),
            what="the early report kept",
        )
        for r in range(c.n):
            _send(c.port(r), _wakeup(kd, S), *_shutdowns(kd, S))
        c.wait_for(
            lambda: all(s["exec_convicted"] == [0] for s in c.stats_all()),
            what="0 convicted everywhere",
        )
        # Until its successor is announced, whatever it reports is dropped and counted.
        for r in range(c.n):
            _send(c.port(r), _report(kd, c.n, S + 4, b"more"))
        c.wait_for(
            lambda: all(s["exec_reports_convicted"] == 1 for s in c.stats_all()),
            what="a convicted replica's report dropped and counted",
        )
        assert all(s["exec_mismatches"] == 0 for s in c.stats_all())
