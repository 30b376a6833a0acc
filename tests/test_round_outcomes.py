# tests/test_round_outcomes.py - where a fault round's outcome goes and who takes it, at
# f = 2 (five execution replicas: 0, 1, 2 awake, 3 and 4 asleep), where a round can leave a
# spare out. Real zz-agreed replicas; the execution replicas and the controlds are the test
# (hand-made, MACed EXEC-REPORTs as in tests/test_agreement_window.py), so every row is
# exactly the one the scenario needs.
from __future__ import annotations

import socketserver
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.cluster import SERVICE_ID, Cluster
from tests.test_agreement_log import _secret
from tests.test_agreement_window import _order_until, _send_all
from tests.test_sibling_rounds import _send, _sign_key
from zz import certs, wire
from zz.ports import free_port

CP = 8
WINDOW = 16
TIMERS = {"detect_k": 2, "detect_floor_ms": 100, "detect_ceiling_ms": 300}
SEQ = 3
P: list[wire.ReplyRef] = []  # the right reply list (its digest: the right digest)
Q = [wire.ReplyRef(7, 7, b"q" * 32)]  # a wrong one


class Listener:
    """A controld's port: keeps every frame it is sent."""

    def __init__(self) -> None:
        self.port = free_port()
        self.frames: list[bytes] = []
        self.lock = threading.Lock()
        me = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                f = self.request.makefile("rb")
                while len(hdr := f.read(4)) == 4:
                    (n,) = struct.unpack(">I", hdr)
                    body = f.read(n)
                    if len(body) < n:
                        return
                    with me.lock:
                        me.frames.append(body)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def shutdowns(self) -> list[bytes]:
        with self.lock:
            return [b for b in self.frames if isinstance(wire.decode(b), wire.Shutdown)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def _f2_cluster(tmp_path: Path) -> Iterator[tuple[Cluster, Listener, Listener]]:
    """Execution replicas 0-3 on host 0, replica 4 on host 1 (the replica files are edited
    before the start: the test rack has one host); a listener as each host's controld."""
    c = Cluster(
        tmp_path, g=1, app="kv", f=2, checkpoint_interval=CP, log_window=WINDOW,
        overrides=dict(TIMERS),
    )  # fmt: skip
    h0, h1 = Listener(), Listener()
    try:
        for r in range(c.n):
            conf = c.conf_path(r).read_text()
            assert "exec 4 0 sleeping\n" in conf, conf
            conf = conf.replace("exec 4 0 sleeping\n", "exec 4 1 sleeping\n")
            conf = conf.replace(f"controld 0 127.0.0.1 {c.control_port}\n",
                                f"controld 0 127.0.0.1 {h0.port}\n"
                                f"controld 1 127.0.0.1 {h1.port}\n")  # fmt: skip
            c.conf_path(r).write_text(conf)
        with c:
            c.start()
            yield c, h0, h1
    finally:
        h0.close()
        h1.close()


def _report(c: Cluster, i: int, replies: list[wire.ReplyRef], to: int) -> bytes:
    p = wire.exec_principal(i)
    msg = wire.ExecReport.of(SERVICE_ID, p, SEQ, replies)
    return msg.with_macs({to: _secret(c, p)[to]}).encode()


def _reports(
    c: Cluster, rows: dict[int, list[wire.ReplyRef]], to: list[int] | None = None
) -> dict[int, list[bytes]]:
    """The same reports (execution replica -> reply list) to the agreement replicas `to`
    (default: all)."""
    to = list(range(c.n)) if to is None else to
    return {r: [_report(c, i, rep, r) for i, rep in rows.items()] for r in to}


def _liar_round(c: Cluster) -> None:
    """Replica 1 answers wrongly at SEQ; spare 3 is woken and reports right; the round
    convicts 1 everywhere and keeps 0, 2 and 3 active."""
    # Reports before the seq is ordered: judged at dispatch, no deadline race.
    _send_all(c, _reports(c, {0: P, 1: Q, 2: P}))
    _order_until(c, SEQ)
    c.wait_for(
        lambda: all(s["fault_round_open"] and 3 in s["exec_awake"] for s in c.stats_all()),
        what="a round at SEQ that woke 3",
    )
    _send_all(c, _reports(c, {3: P}))
    c.wait_for(
        lambda: all(
            s["exec_convicted"] == [1] and s["exec_awake"] == [0, 2, 3] for s in c.stats_all()
        ),
        what="1 convicted everywhere, 0, 2 and 3 active",
    )


def test_every_controld_learns_a_rounds_outcome(tmp_path: Path) -> None:
    """Replica 1 answers wrongly at SEQ; spare 3 is woken, 1 convicted. Spare 4 sleeps
    through the round, and its host's controld must still get the SHUTDOWN certificate: its
    replay guard (zz/certs.py Freshness) refuses a WAKEUP over the awake set of the last
    SHUTDOWN it acted on, which that SHUTDOWN changed, as a sibling of it. Without the
    rounds in between it took a new round over [0, 1, 2], 10,000 seqs after the last one it
    saw, for such a sibling and never woke 4; the round never closed (campaign seed 3202
    round 14)."""
    with _f2_cluster(tmp_path) as (c, h0, h1):
        _liar_round(c)
        trust = certs.ServiceTrust.load(c.dir / "keys", c.service)
        for host, listener in (("h0", h0), ("h1", h1)):
            collector = certs.ShutdownCollector(trust)
            got = [collector.add(raw) for raw in listener.shutdowns()]
            done = [x for x in got if x is not None]
            assert len(done) == 1, f"{host}: {len(listener.shutdowns())} SHUTDOWN votes"
            assert done[0].seq == SEQ and done[0].convict == (1,), done[0]
            assert done[0].active == (0, 2, 3), done[0]


def test_the_follow_up_rounds_certificate_is_adopted(tmp_path: Path) -> None:
    """Replicas 0 and 2 equivocate at SEQ with the same wrong digest, to agreement replicas
    0 and 2; agreement replica 3 is down. 0 and 2 see e0 Q, e1 P, e2 Q and wake 3; 1 saw
    every report right (a certificate) and adopts that WAKEUP. Spare 3 reports P: 1 decides
    at once (convict 0 and 2: the evidence shows both wrong; active 1 and 3, one short),
    while 0 and 2 have P twice and Q twice, close the round undecided, and the follow-up
    round at SEQ over the larger awake set [0, 1, 2, 3] wakes 4 and decides: convict 0 and
    2, active 1, 3, 4, a certificate of two. Replica 1 must take it over its own outcome,
    which nobody else voted for: it kept awake [1, 3] for good (campaign seed 3202
    round 18)."""
    live = [0, 1, 2]
    with _f2_cluster(tmp_path) as (c, _, _):
        _send_all(c, _reports(c, {0: Q, 1: P, 2: Q}, to=[0, 2]))
        _send_all(c, _reports(c, {0: P, 1: P, 2: P}, to=[1]))
        _order_until(c, SEQ)
        c.kill(3)  # it saw no report: no row, and nothing to decide
        c.wait_for(
            lambda: all(3 in s["exec_awake"] for s in c.stats_all(live)),
            what="the round at SEQ woke 3 at 0, 1 and 2",
        )
        _send_all(c, _reports(c, {3: P}, to=live))
        c.wait_for(
            lambda: all(4 in s["exec_awake"] for s in c.stats_all([0, 2])),
            what="0 and 2: the follow-up round woke 4",
        )
        _send_all(c, _reports(c, {4: P}, to=live))
        c.wait_for(
            lambda: all(
                s["exec_convicted"] == [0, 2] and not s["fault_round_open"]
                for s in c.stats_all(live)
            ),
            what="0 and 2 convicted at 0, 1 and 2",
        )
        c.wait_for(
            lambda: all(s["exec_awake"] == [1, 3, 4] for s in c.stats_all(live)),
            timeout=10,
            what="one awake set [1, 3, 4] at 0, 1 and 2",
        )
        assert c.stats(1)["shutdowns_adopted_over_own"] == 1, c.stats(1)


def _two_liars_woke_3(c: Cluster) -> None:
    """Replicas 0 and 2 equivocate at SEQ with the same wrong digest to agreement replicas
    0 and 2; 1 and 3 see every report right. The round at SEQ wakes 3 everywhere."""
    _send_all(c, _reports(c, {0: Q, 1: P, 2: Q}, to=[0, 2]))
    _send_all(c, _reports(c, {0: P, 1: P, 2: P}, to=[1, 3]))
    _order_until(c, SEQ)
    c.wait_for(
        lambda: all(3 in s["exec_awake"] for s in c.stats_all()),
        what="the round at SEQ woke 3 everywhere",
    )


def test_a_certified_round_wins_over_its_certified_follow_up(tmp_path: Path) -> None:
    """As above, but agreement replica 3 is up and, like 1, saw every report right: 1 and 3
    decide the first round (convict 0 and 2, active 1 and 3), a certificate of two, while
    0 and 2 close it undecided and go on over [0, 1, 2, 3]. Their bodies for the first
    round reach 0 and 2 after that (their awake set is larger now) and must still count;
    two certified outcomes of one seq end on the same merged one everywhere (both convict
    0 and 2; only 1 and 3 are active in both), and the spare only the follow-up woke (4)
    goes back to sleep."""
    with _f2_cluster(tmp_path) as (c, _, _):
        _two_liars_woke_3(c)
        _send_all(c, _reports(c, {3: P}))
        c.wait_for(
            lambda: all(
                s["exec_convicted"] == [0, 2] and not s["fault_round_open"] for s in c.stats_all()
            ),
            what="0 and 2 convicted everywhere, no round open",
        )
        for s in c.stats_all():
            assert s["exec_awake"] == [1, 3] and s["exec_sleeping"] == [4], s


def test_a_body_that_came_before_the_round_closed_undecided_still_counts(
    tmp_path: Path,
) -> None:
    """As above, with the order forced: agreement replica 1 decides first and its SHUTDOWN
    body reaches 0 and 2 while their round is still open; then they close it undecided
    (the follow-up wakes 4); then 3 decides. Closing the round dropped 1's body, so 3's
    alone was never a certificate at 0 and 2, and their round stayed open (seen in CI as a
    flaky run of the test above)."""
    with _f2_cluster(tmp_path) as (c, _, _):
        _two_liars_woke_3(c)
        _send_all(c, _reports(c, {3: P}, to=[1]))
        c.wait_for(
            lambda: all(
                c.stats_all()[r]["shutdowns_received"] >= 1 and c.stats_all()[r]["fault_round_open"]
                for r in (0, 2)
            ),
            what="1's body at 0 and 2, their round still open",
        )
        _send_all(c, _reports(c, {3: P}, to=[0, 2]))
        c.wait_for(
            lambda: all(4 in c.stats_all()[r]["exec_awake"] for r in (0, 2)),
            what="0 and 2 closed the round undecided and woke 4",
        )
        _send_all(c, _reports(c, {3: P}, to=[3]))
        c.wait_for(
            lambda: all(
                s["exec_convicted"] == [0, 2] and not s["fault_round_open"] for s in c.stats_all()
            ),
            what="0 and 2 convicted everywhere, no round open",
        )


def test_two_certified_outcomes_of_one_round_are_merged(tmp_path: Path) -> None:
    """Correct agreement replicas can split so that two different outcomes of one round are
    each certified by g+1 (campaign seed 3502 round 63: replica 1 equivocated to agreement
    replicas 0 and 3 while 3 was faulty too; 0 and 3 certified convict [1, 3], 1 and 2
    convict [3] sleep [2]). Every controld acted on the first certificate it completed and
    destroyed 1; the agreement replicas ended on the smaller body, counted 1's fresh spare
    awake and convicted it for silence. Both sides now take the merged outcome
    (zz/certs.py merge_outcomes): the union of the convictions, active only who every
    certificate keeps active. Here 0 and 1 certify the round's real outcome (convict [1],
    active [0, 2, 3]); the test signs another as agreement replicas 2 and 3 (convict
    [1, 2], active [0, 3]); every replica must end on convict [1, 2], active [0, 3]."""
    with _f2_cluster(tmp_path) as (c, _, _):
        _liar_round(c)
        kd = c.dir / "keys"
        other = [
            wire.Shutdown(SERVICE_ID, r, SEQ, [0, 1, 2], [1, 2], [], [0, 3])
            .signed(_sign_key(kd, r))
            .encode()
            for r in (2, 3)
        ]
        for r in range(c.n):
            _send(c.port(r), *other)
        c.wait_for(
            lambda: all(
                s["exec_convicted"] == [1, 2] and s["exec_awake"] == [0, 3]
                and s["exec_sleeping"] == [4] and s["shutdowns_merged"] == 1
                for s in c.stats_all()
            ),
            what="the merged outcome everywhere: convict [1, 2], active [0, 3]",
        )
        trust = certs.ServiceTrust.load(kd, c.service)
        collector = certs.ShutdownCollector(trust)
        real = [wire.Shutdown(SERVICE_ID, r, SEQ, [0, 1, 2], [1], [], [0, 2, 3])
                .signed(_sign_key(kd, r)).encode() for r in (0, 1)]  # fmt: skip
        got = [x for x in (collector.add(v) for v in [*real, *other]) if x is not None]
        merged = certs.merge_outcomes(got)
        assert (merged.convict, merged.sleep, merged.active) == ((1, 2), (), (0, 3)), merged
