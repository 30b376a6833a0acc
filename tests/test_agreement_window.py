"""Bounded evidence (issue 14, items 1 and 4): every seq-indexed message an agreement
replica takes from one sender (EXEC-REPORT, EXEC-CHECKPOINT, CHECKPOINT, FAULT-STATEMENT)
must lie in the window above the low watermark, or it is dropped and counted for that
sender; a report timer starts only when the seq was dispatched here, never at an early
report; and one sender's votes can never push another sender's out of a table.

Real zz-agreed replicas, hand-made (properly signed / MACed) messages; the "execution
replicas" are the test itself (docs/fault-detection.md, "Bounded evidence")."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.cluster import Cluster, running_cluster
from tests.test_agreement_log import _secret, _sign_seed
from zz import wire
from zz.crypto import SigningKey, sha256

CP = 8  # checkpoint_interval
WINDOW = 16  # log_window: seqs in (stable, stable + 16] are in the window
# Fast detection timers: an early report's timer (old behaviour) expires well within the
# test, and correct reports sent right after dispatch need not race a short deadline
# because they are sent before the seq is ordered (see the tests).
TIMERS = {"detect_k": 2, "detect_floor_ms": 100, "detect_ceiling_ms": 300}


@contextmanager
def _exec_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """g = 1, f = 1: execution replicas 0 and 1 awake, 2 a sleeping spare."""
    with running_cluster(
        tmp_path,
        g=1,
        app="kv",
        f=1,
        active=2,
        checkpoint_interval=CP,
        log_window=WINDOW,
        overrides=dict(TIMERS),
    ) as c:
        yield c


def _order_until(c: Cluster, target: int) -> None:
    """Order requests until every replica executed `target`, never past it. Each round sends
    one request per seq still missing, each from a client of its own and all at once (a
    replica's stats are rewritten once a second: one request per round trip took ~3 s a
    seq); a batch may hold several of them, so a round orders at most that many seqs, and
    the next round starts once the primary executed them all. The requests go 50 ms apart,
    so that most make a batch of their own (a merged batch only costs another round)."""
    with contextlib.ExitStack() as stack:
        conns: dict[int, socket.socket] = {}
        while (s := c.stats(0))["last_exec"] < target:
            want = target - s["last_exec"]
            assert want < c.nclients, "one client per missing seq"
            done = s["executed"]
            for k in range(1, want + 1):
                client = c.client_principal(k)
                if k not in conns:
                    conns[k] = stack.enter_context(
                        socket.create_connection(("127.0.0.1", c.port(0)), timeout=5)
                    )
                keys = _secret(c, client)
                req = wire.Request(1, client, timestamp=time.time_ns(), flags=0, op=b"op%d" % k)
                conns[k].sendall(
                    wire.frame(req.with_macs({r: keys[r] for r in range(c.n)}).encode())
                )
                time.sleep(0.05)
            c.wait_for(
                lambda done=done, want=want: c.stats(0)["executed"] >= done + want,
                timeout=30,
                what=f"{want} requests ordered",
            )
    c.wait_for(
        lambda: all(s["last_exec"] >= target for s in c.stats_all()),
        timeout=15,
        what=f"all at {target}",
    )


def _send_all(c: Cluster, raws: dict[int, list[bytes]]) -> None:
    """raws[r]: messages for replica r, sent in order on one connection."""
    for r, msgs in raws.items():
        with socket.create_connection(("127.0.0.1", c.port(r)), timeout=5) as s:
            s.sendall(b"".join(wire.frame(m) for m in msgs))


def _report(c: Cluster, i: int, seq: int, to: int) -> bytes:
    p = wire.exec_principal(i)
    return wire.ExecReport.of(1, p, seq, []).with_macs({to: _secret(c, p)[to]}).encode()


def _quiet(s: dict[str, Any]) -> bool:
    return (
        s["exec_timeouts"] == 0
        and s["exec_mismatches"] == 0
        and s["fault_statements_sent"] == 0
        and s["wakeups_sent"] == 0
    )


def test_report_for_a_seq_never_ordered_is_dropped_and_starts_no_timer(tmp_path: Path) -> None:
    """Item 1: exec 0 reports a seq just above the window of 16. Today every agreement
    replica starts a timer for it, times out, signs a statement and sends WAKEUP; when the
    seq is really reached, exec 0's correct report counts as late. Now: dropped and counted
    for exec 0, no timer; once ordered, exec 0 and 1 report it and it is certified."""
    with _exec_cluster(tmp_path) as c:
        _order_until(c, 2)
        # Just above the window: as far as one sender's report can be from being dropped, and
        # few enough seqs to order below.
        far = max(s["stable_seq"] for s in c.stats_all()) + WINDOW + 1
        _send_all(c, {r: [_report(c, 0, far, r)] for r in range(c.n)})
        c.wait_for(
            lambda: all(s["exec_window_drops"][0] == 1 for s in c.stats_all()),
            timeout=10,
            what="the far report dropped and counted for exec 0 everywhere",
        )
        for s in c.stats_all():
            assert s["exec_window_drops"] == [1, 0, 0], s
            assert s["dropped"]["window"] >= 1, s
        # Ordering up to `far` takes far longer than the detection ceiling (300 ms): a timer
        # started by the dropped report would have expired meanwhile.
        _order_until(c, far - 1)
        for s in c.stats_all():
            assert _quiet(s), s
        # The seq is reached for real; both awake replicas report it on time (sent before it
        # is dispatched, so no deadline race on a loaded machine): a certificate, no fault.
        _send_all(c, {r: [_report(c, i, far, r) for i in (0, 1)] for r in range(c.n)})
        before = [s["exec_certificates"] for s in c.stats_all()]
        _order_until(c, far)
        c.wait_for(
            lambda: all(
                s["exec_certificates"] > b for s, b in zip(c.stats_all(), before, strict=True)
            ),
            timeout=10,
            what="the far seq certified",
        )
        for s in c.stats_all():
            assert _quiet(s), s
            assert s["exec_awake"] == [0, 1] and s["exec_convicted"] == [], s


def test_early_report_in_the_window_waits_for_dispatch(tmp_path: Path) -> None:
    """Item 1: a report for a seq inside the window that is not yet dispatched here is kept
    (a fast execution replica is not penalised) but starts no timer: the timer starts at
    dispatch. Today the early report starts it, it expires before the seq is ordered, and
    the seq is flagged as a timeout with a statement signed."""
    with _exec_cluster(tmp_path) as c:
        _order_until(c, 2)
        seq = c.stats(0)["last_exec"] + 3  # within the window, not yet ordered
        # A fast exec 0 reports first ...
        _send_all(c, {r: [_report(c, 0, seq, r)] for r in range(c.n)})
        c.wait_for(
            lambda: all(s["exec_reports"] >= 1 for s in c.stats_all()),
            timeout=10,
            what="the early report taken",
        )
        # ... and for longer than the detection ceiling (300 ms) nothing else happens: the
        # old code's timer, started by the early report, fires meanwhile (exec 1 "silent").
        time.sleep(1.0)
        for s in c.stats_all():
            assert _quiet(s), s
            assert s["exec_window_drops"] == [0, 0, 0], s
            assert s["exec_certificates"] == 0, s
        # exec 1 reports too, still before the seq is dispatched here (no deadline race on
        # a loaded machine); at dispatch the two kept reports make the certificate.
        _send_all(c, {r: [_report(c, 1, seq, r)] for r in range(c.n)})
        c.wait_for(
            lambda: all(s["exec_reports"] >= 2 for s in c.stats_all()),
            timeout=10,
            what="the second early report taken",
        )
        _order_until(c, seq)
        c.wait_for(
            lambda: all(s["exec_certificates"] == 1 for s in c.stats_all()),
            timeout=10,
            what="certified at dispatch from the kept early reports",
        )
        for s in c.stats_all():
            assert _quiet(s), s


def test_far_fault_statement_is_dropped_and_counted(tmp_path: Path) -> None:
    """A FAULT-STATEMENT from a peer for a seq far above the window changes nothing: dropped
    and counted for that signer (today it is collected as a candidate)."""
    with _exec_cluster(tmp_path) as c:
        _order_until(c, 1)
        key = SigningKey(_sign_seed(c, 3))
        row = [wire.RowEntry(i, wire.ROW_NONE, bytes(32)) for i in (0, 1)]
        msgs = [
            wire.FaultStatement(1, 3, seq=1000 + k, row=row).signed(key).encode() for k in range(40)
        ]
        _send_all(c, {0: msgs})
        c.wait_for(
            lambda: c.stats(0)["peer_window_drops"][3] == 40,
            timeout=10,
            what="40 statements dropped and counted for replica 3",
        )
        s = c.stats(0)
        assert s["fault_statements_received"] == 0, s
        assert s["peer_window_drops"][:3] == [0, 0, 0], s


def test_far_exec_checkpoints_cannot_flush_a_real_one(tmp_path: Path) -> None:
    """Item 4: exec 0 signs the checkpoint at 8, exec 2 floods 40 EXEC-CHECKPOINTs far above
    the window, exec 1 signs the one at 8. Today the flood evicts the lowest-seq record,
    exec 0's vote is lost and the checkpoint never becomes stable; now the flood is dropped
    and counted for exec 2, and no sender's votes can push out another sender's."""
    with _exec_cluster(tmp_path) as c:
        _order_until(c, CP + 1)
        digest = sha256(b"execution checkpoint at 8")

        def ckpt(i: int, seq: int) -> bytes:
            p = wire.exec_principal(i)
            msg = wire.ExecCheckpoint(1, p, seq=seq, checkpoint=digest)
            return msg.signed(SigningKey(_sign_seed(c, p))).encode()

        flood = [ckpt(2, 1000 * CP + CP * k) for k in range(40)]
        # In the window too: exec 2's own votes at 16 stay its own business.
        _send_all(c, {1: [ckpt(0, CP), *flood, ckpt(2, 2 * CP), ckpt(1, CP)]})
        c.wait_for(lambda: c.stats(1)["exec_stable"] == CP, timeout=10, what="exec stable 8")
        s = c.stats(1)
        assert s["exec_window_drops"] == [0, 0, 40], s


def test_far_checkpoint_votes_cannot_flush_a_real_one(tmp_path: Path) -> None:
    """Item 4: at replica 0 (idle, stable 0), signed CHECKPOINTs for seq 8 from replicas 1,
    then 40 from replica 3 far above the window, then 2 and 3 for seq 8. Today the flood
    evicts the record of seq 8 (fewest votes, oldest first), so the 2g+1 = 3 votes never
    meet; now the flood is dropped (replica 3 keeps one held vote) and the three votes
    certify seq 8, which replica 0 (behind it) notes as the checkpoint to reach."""
    with running_cluster(tmp_path, g=1, checkpoint_interval=CP, log_window=WINDOW) as c:
        digest = sha256(b"agreed state at 8")

        def vote(r: int, seq: int) -> bytes:
            msg = wire.Checkpoint(1, r, seq=seq, state=digest)
            return msg.signed(SigningKey(_sign_seed(c, r))).encode()

        flood = [vote(3, 1000 * CP + CP * k) for k in range(40)]
        _send_all(c, {0: [vote(1, CP), *flood, vote(2, CP), vote(3, CP)]})
        c.wait_for(
            lambda: c.stats(0)["ckpt_ahead_seq"] == CP or c.stats(0)["transfer_seq"] == CP,
            timeout=10,
            what="replica 0 sees seq 8 certified",
        )
        s = c.stats(0)
        assert s["peer_window_drops"] == [0, 0, 0, 40], s
        assert s["stable_seq"] == 0, s


def test_checkpoints_become_stable_under_a_far_vote_flood(tmp_path: Path) -> None:
    """Item 4, live: while replica 3's key floods far-future CHECKPOINTs at every replica,
    the real checkpoints still become stable everywhere."""
    with running_cluster(tmp_path, g=1, checkpoint_interval=CP, log_window=WINDOW) as c:
        key = SigningKey(_sign_seed(c, 3))
        socks = {r: socket.create_connection(("127.0.0.1", c.port(r)), timeout=5) for r in (0, 1)}
        try:
            client = c.client_principal(1)
            keys = _secret(c, client)
            with socket.create_connection(("127.0.0.1", c.port(0)), timeout=5) as cs:
                k = 0
                deadline = time.monotonic() + 60
                # The stats files as last written (once a second), not a fresh rewrite per
                # replica and round: the flood and the requests go on between two writes.
                while not all(c.stats(r, fresh=False)["stable_seq"] >= 3 * CP for r in range(c.n)):
                    assert time.monotonic() < deadline, c.summary()
                    for s in socks.values():
                        seqs = range(10_000 + 100 * k, 10_000 + 100 * k + 100, CP)
                        s.sendall(
                            b"".join(
                                wire.frame(
                                    wire.Checkpoint(1, 3, seq=q, state=bytes(32))
                                    .signed(key)
                                    .encode()
                                )
                                for q in seqs
                            )
                        )
                    req = wire.Request(1, client, timestamp=time.time_ns(), flags=0, op=b"x")
                    cs.sendall(wire.frame(req.with_macs({r: keys[r] for r in range(c.n)}).encode()))
                    k += 1
                    time.sleep(0.02)
        finally:
            for s in socks.values():
                s.close()
        for r in (0, 1):
            assert c.stats(r)["peer_window_drops"][3] > 0, c.stats(r)
