# tests/test_report_resend.py - a correct execution replica whose EXEC-REPORT was lost on a
# broken link sends it again when the link is back (issue 14: a faulty execution replica must
# never get a correct one convicted; nor must a network blip). docs/execution.md "Reports
# sent again" and docs/fault-detection.md "Reports sent again".
#
# The process test: 4 zz-agreed (f = g = 1), execution replicas 0 and 1 active, 2 a sleeping
# spare, a test-side controld (tests/test_fault_detection_e2e.py). Replica 1 reaches the
# agreement replicas through a relay in the test (it dials 127.0.0.2, the relay forwards to
# 127.0.0.1), which can swallow what replica 1 sends to agreement replicas 0 and 1 and then
# break those connections: the report for one batch misses g+1 agreement replicas while
# replica 1 executed it, as when a connection drops with the report in flight.
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import RACK_TOML

from tests.cluster import Cluster, running_cluster
from tests.test_agreement_window import _order_until, _report, _send_all
from tests.test_execution_runtime import _kv_ok
from tests.test_fault_detection_e2e import SPARE, FaultRig, _puts, _start
from zz import keys, wire
from zz.config import load
from zz.execution.reports import SentReports
from zz.execution.runtime import Runtime, RuntimeOptions

ALIAS = "127.0.0.2"  # where replica 1 dials the agreement replicas: the relay
# The floor is far above the time a dropped link takes to come back (50 ms backoff) on a
# loaded 2-core machine, and far below how long the test waits for a wake-up.
TIMERS = {"detect_k": 4, "detect_floor_ms": 2000, "detect_ceiling_ms": 4000}


# ---- the bookkeeping ------------------------------------------------------------------------


def _rep(seq: int) -> wire.ExecReport:
    refs = [wire.reply_ref(wire.client_principal(0), seq, b"r%d" % seq)]
    return wire.ExecReport.of(1, wire.exec_principal(1), seq, refs)


def test_kept_reports_are_bounded_and_above_what_each_replica_holds_stable() -> None:
    kept = SentReports(n=4, limit=8)
    for seq in range(1, 21):
        kept.add(_rep(seq))
    # At most `limit`, the newest.
    assert len(kept) == 8
    assert [r.seq for r in kept.for_replica(0)] == list(range(13, 21))
    # A replica that names a stable execution checkpoint gets only what lies above it; the
    # others still get everything kept.
    kept.stable_at(2, 16)
    assert [r.seq for r in kept.for_replica(2)] == [17, 18, 19, 20]
    assert [r.seq for r in kept.for_replica(0)] == list(range(13, 21))
    assert len(kept) == 8
    # Dropped only once every agreement replica named a stable checkpoint at or above it.
    kept.stable_at(0, 14)
    kept.stable_at(1, 18)
    kept.stable_at(3, 20)
    assert len(kept) == 6 and [r.seq for r in kept.for_replica(3)] == []
    assert [r.seq for r in kept.for_replica(0)] == [15, 16, 17, 18, 19, 20]
    # A replica's latest claim counts (one that restarted may name a lower one again).
    kept.stable_at(2, 0)
    assert [r.seq for r in kept.for_replica(2)] == [15, 16, 17, 18, 19, 20]
    # A new report goes to every replica whose claim lies below it.
    kept.add(_rep(21))
    assert [r.seq for r in kept.for_replica(1)] == [19, 20, 21]
    # Claims by principals that are no agreement replica are ignored.
    kept.stable_at(9, 1000)
    assert len(kept) == 7


def test_a_reconnecting_link_gets_the_registration_then_the_reports_it_may_have_missed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rack.toml"
    path.write_text(RACK_TOML.format(base_port=17300))
    config = load(path)
    keys.generate(config)
    svc = config.services[0]
    rt = Runtime(config, svc, 1, RuntimeOptions(state_dir=tmp_path / "st"))
    secret = keys.load_secret(keys.secret_path(config.rack.key_dir, svc.id, rt.me))
    rt.agree_keys = keys.peer_keys(secret, range(svc.n))
    assert rt.sent_reports.limit == config.rack.log_window
    for seq in range(1, 12):
        rt.sent_reports.add(_rep(seq))
    rt.sent_reports.stable_at(2, 8)
    for r in range(svc.n):
        frames = rt.on_link_connect(SimpleNamespace(peer=r))  # type: ignore[arg-type]
        msgs = [wire.decode(f) for f in frames]
        assert isinstance(msgs[0], wire.Fetch) and msgs[0].kind == wire.FETCH_LOG
        reports = msgs[1:]  # no checkpoint taken yet: the rest are the reports
        assert all(isinstance(m, wire.ExecReport) for m in reports)
        want = [9, 10, 11] if r == 2 else list(range(4, 12))  # log_window 8 kept
        assert [m.seq for m in reports] == want
        for m in reports:
            # One MAC, for this receiver, verifying under its key; the digest hashes the list.
            assert [e[0] for e in m.mac_entries()] == [r]
            assert m.verify_mac(r, rt.agree_keys[r]) and m.digest_ok()
    assert rt.counters["reports_resent"] == 3 * 8 + 3
    # A peer execution replica's link gets no reports.
    assert not any(
        isinstance(wire.decode(f), wire.ExecReport)
        for f in rt.on_link_connect(SimpleNamespace(peer=wire.exec_principal(0)))  # type: ignore[arg-type]
    )


# ---- zz-agreed's intake of reports sent again ---------------------------------------------


def test_agreed_takes_reports_sent_again_quietly(tmp_path: Path) -> None:
    """What zz-agreed does with a report it may already hold (detect.c zz_detect_report):
    a second copy changes nothing, a report for a seq already certified here is recorded
    and nothing else, and neither is counted as malformed, dropped or a fault. (On time and
    not yet held, a report sent again is an ordinary report: the process test below.)"""
    timers = {"detect_k": 2, "detect_floor_ms": 100, "detect_ceiling_ms": 300}
    with running_cluster(
        tmp_path,
        g=1,
        app="kv",
        f=1,
        active=3,  # three awake: two reports certify, the third comes after that
        checkpoint_interval=8,
        log_window=16,
        overrides=timers,
    ) as c:
        _order_until(c, 2)
        seq = c.stats(0)["last_exec"] + 2  # within the window, not yet ordered
        # Sent before the seq is dispatched (no deadline race on a loaded machine); exec 1's
        # report twice, as a runtime whose link broke after the first copy arrived sends it.
        _send_all(c, {r: [_report(c, i, seq, r) for i in (0, 1, 1)] for r in range(c.n)})
        c.wait_for(
            lambda: all(s["exec_reports"] >= 3 for s in c.stats_all()),
            timeout=10,
            what="the reports taken",
        )
        for s in c.stats_all():
            assert s["exec_reports_early"] == 2, s  # the copy is not kept a second time
        _order_until(c, seq)
        c.wait_for(
            lambda: all(s["exec_certificates"] == 1 for s in c.stats_all()),
            timeout=10,
            what="the seq certified by exec 0 and 1",
        )
        before = c.stats_all()
        # Exec 2 reports the certified seq only now, and exec 0 and 1 send theirs again (a
        # reconnect after the certificate): all taken quietly.
        _send_all(c, {r: [_report(c, i, seq, r) for i in (2, 0, 1)] for r in range(c.n)})
        c.wait_for(
            lambda: all(
                s["exec_reports"] == b["exec_reports"] + 3
                for s, b in zip(c.stats_all(), before, strict=True)
            ),
            timeout=10,
            what="the reports sent again taken",
        )
        time.sleep(0.6)  # beyond the detection ceiling (300 ms): any timer would have fired
        for s, b in zip(c.stats_all(), before, strict=True):
            assert s["exec_certificates"] == 1, s
            assert s["exec_timeouts"] == 0 and s["exec_mismatches"] == 0, s
            assert s["fault_statements_sent"] == 0 and s["wakeups_sent"] == 0, s
            assert s["dropped"] == b["dropped"], (s["dropped"], b["dropped"])
            assert s["stale"] == b["stale"] and s["exec_window_drops"] == [0, 0, 0], s
            assert s["exec_awake"] == [0, 1, 2] and s["exec_convicted"] == [], s


# ---- the relay ------------------------------------------------------------------------------


@dataclass
class _Pair:
    down: socket.socket  # from the runtime
    up: socket.socket  # to the agreement replica
    hold: bool = False  # swallow what the runtime sends

    def close(self) -> None:
        for s in (self.down, self.up):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()


@dataclass
class LinkCutter:
    """Listens on ALIAS at each agreement replica's port and relays to 127.0.0.1."""

    ports: list[int]
    pairs: dict[int, list[_Pair]] = field(default_factory=dict)
    swallowed: dict[int, int] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    listeners: list[socket.socket] = field(default_factory=list)

    def start(self) -> None:
        for r, port in enumerate(self.ports):
            ls = socket.socket()
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((ALIAS, port))
            ls.listen(16)
            self.listeners.append(ls)
            threading.Thread(target=self._accept, args=(r, ls), daemon=True).start()

    def _accept(self, r: int, ls: socket.socket) -> None:
        while True:
            try:
                down, _ = ls.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.ports[r]), timeout=5)
                up.settimeout(None)
            except OSError:
                down.close()
                continue
            pair = _Pair(down, up)
            with self.lock:
                self.pairs.setdefault(r, []).append(pair)
                self.accepted[r] = self.accepted.get(r, 0) + 1
            threading.Thread(target=self._pump, args=(r, pair, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(r, pair, False), daemon=True).start()

    def _pump(self, r: int, pair: _Pair, upward: bool) -> None:
        src, dst = (pair.down, pair.up) if upward else (pair.up, pair.down)
        try:
            while data := src.recv(65536):
                if upward and pair.hold:
                    with self.lock:
                        self.swallowed[r] = self.swallowed.get(r, 0) + len(data)
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            pair.close()

    def hold(self, rs: set[int]) -> None:
        """From now on swallow what the runtime sends on its connections to `rs`."""
        with self.lock:
            for r in rs:
                for p in self.pairs.get(r, []):
                    p.hold = True

    def cut(self, rs: set[int]) -> None:
        """Break the connections to `rs`; the runtime's next ones are relayed in full."""
        with self.lock:
            doomed = [p for r in rs for p in self.pairs.pop(r, [])]
        for p in doomed:
            p.close()

    def close(self) -> None:
        for ls in self.listeners:
            with contextlib.suppress(OSError):
                ls.close()
        with self.lock:
            doomed = [p for ps in self.pairs.values() for p in ps]
            self.pairs.clear()
        for p in doomed:
            p.close()


@pytest.fixture
def relay_rig(tmp_path: Path) -> Iterator[tuple[FaultRig, LinkCutter]]:
    cutters: list[LinkCutter] = []

    def relay(cluster: Cluster) -> None:
        cutter = LinkCutter([cluster.port(r) for r in range(cluster.n)])
        cutter.start()
        cutters.append(cutter)

    args = {1: ["--loopback-alias", ALIAS, "--listen", "127.0.0.1"]}
    try:
        for rig in _start(tmp_path, args, TIMERS, before_execs=relay):
            yield rig, cutters[-1]
    finally:
        for c in cutters:
            c.close()


def _agreement(rig: FaultRig) -> list[dict[str, Any]]:
    return rig.agreement()


def _flagged(rig: FaultRig) -> bool:
    return bool(rig.controld.wakeups) or any(s["fault_statements_sent"] for s in _agreement(rig))


@pytest.mark.slow
def test_a_report_lost_on_a_broken_link_is_sent_again_and_nobody_is_flagged(
    relay_rig: tuple[FaultRig, LinkCutter],
) -> None:
    rig, cutter = relay_rig
    assert all(cutter.accepted.get(r) == 1 for r in range(rig.cluster.n)), cutter.accepted
    assert _puts(rig, 3, "pre") == [_kv_ok()] * 3
    rig.wait(
        lambda: all(s["exec_certificates"] >= 3 for s in _agreement(rig)),
        "seqs 1-3 certified by every agreement replica",
    )
    # Replica 1's report for the next batch never reaches agreement replicas 0 and 1 (g+1
    # of them), though it executes the batch: the commits reach it, its report is lost in
    # the connections, which then break.
    cutter.hold({0, 1})
    assert _puts(rig, 1, "x") == [_kv_ok()]
    rig.wait(
        lambda: all(cutter.swallowed.get(r, 0) > 0 for r in (0, 1)),
        "replica 1's report for seq 4 swallowed on its links to agreement replicas 0 and 1",
        timeout=10,
    )
    t_cut = time.monotonic()
    cutter.cut({0, 1})
    rig.wait(
        lambda: all(cutter.accepted.get(r, 0) >= 2 for r in (0, 1)),
        "replica 1 connected again to agreement replicas 0 and 1",
        timeout=10,
    )
    rig.wait(
        lambda: all(s["exec_certificates"] >= 4 for s in _agreement(rig)) or _flagged(rig),
        "seq 4 certified everywhere (or replica 1 flagged)",
        timeout=15,
    )
    # Past every timer that seq 4 may have started (floor 2 s), nothing was flagged.
    time.sleep(max(0.0, t_cut + TIMERS["detect_floor_ms"] / 1000 + 1.0 - time.monotonic()))
    if _flagged(rig):  # what became of it, for the failure message
        with contextlib.suppress(TimeoutError):
            rig.wait(lambda: bool(rig.controld.shutdowns), "a SHUTDOWN", timeout=15)
    c = rig.controld
    assert not c.wakeups and not c.votes, (
        f"WAKEUPs {c.wakeups}, SHUTDOWN certificates {c.shutdowns}"
    )
    for s in _agreement(rig):
        assert s["exec_timeouts"] == 0 and s["exec_mismatches"] == 0, s
        assert s["fault_statements_sent"] == 0 and s["wakeups_sent"] == 0, s
        assert s["exec_certificates"] >= 4, s
        assert s["exec_awake"] == [0, 1] and s["exec_sleeping"] == [SPARE], s
        assert s["dropped"]["field"] == 0, s
    counters = rig.execs.status(1)["counters"]
    assert counters.get("reports_resent", 0) >= 2, counters
    # The service goes on with both replicas.
    assert _puts(rig, 2, "after") == [_kv_ok()] * 2
