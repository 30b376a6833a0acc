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

from tests.cluster import SERVICE_ID, Cluster, free_port_range
from tests.test_agreement_log import _secret
from tests.test_agreement_window import _order_until, _send_all
from zz import certs, wire

CP = 8
WINDOW = 16
TIMERS = {"detect_k": 2, "detect_floor_ms": 100, "detect_ceiling_ms": 300}
SEQ = 3
P: list[wire.ReplyRef] = []  # the right reply list (its digest: the right digest)
Q = [wire.ReplyRef(7, 7, b"q" * 32)]  # a wrong one


class Listener:
    """A controld's port: keeps every frame it is sent."""

    def __init__(self) -> None:
        self.port = free_port_range(1)
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


def _reports(c: Cluster, rows: dict[int, list[wire.ReplyRef]]) -> dict[int, list[bytes]]:
    """The same reports (execution replica -> reply list) to every agreement replica."""
    return {r: [_report(c, i, rep, r) for i, rep in rows.items()] for r in range(c.n)}


def test_every_controld_learns_a_rounds_outcome(tmp_path: Path) -> None:
    """Replica 1 answers wrongly at SEQ; spare 3 is woken, 1 convicted. Spare 4 sleeps
    through the round, and its host's controld must still get the SHUTDOWN certificate: its
    replay guard (zz/certs.py Freshness) refuses a WAKEUP over the awake set of the last
    SHUTDOWN it acted on, which that SHUTDOWN changed, as a sibling of it. Without the
    rounds in between it took a new round over [0, 1, 2], 10,000 seqs after the last one it
    saw, for such a sibling and never woke 4; the round never closed (campaign seed 3202
    round 14)."""
    with _f2_cluster(tmp_path) as (c, h0, h1):
        # Reports before the seq is ordered: judged at dispatch, no deadline race.
        _send_all(c, _reports(c, {0: P, 1: Q, 2: P}))
        _order_until(c, SEQ)
        c.wait_for(
            lambda: all(s["fault_round_open"] and 3 in s["exec_awake"] for s in c.stats_all()),
            what="a round at SEQ that woke 3",
        )
        _send_all(c, _reports(c, {3: P}))
        c.wait_for(
            lambda: all(s["exec_convicted"] == [1] for s in c.stats_all()),
            what="1 convicted everywhere",
        )
        trust = certs.ServiceTrust.load(c.dir / "keys", c.service)
        for host, listener in (("h0", h0), ("h1", h1)):
            collector = certs.ShutdownCollector(trust)
            got = [collector.add(raw) for raw in listener.shutdowns()]
            done = [x for x in got if x is not None]
            assert len(done) == 1, f"{host}: {len(listener.shutdowns())} SHUTDOWN votes"
            assert done[0].seq == SEQ and done[0].convict == (1,), done[0]
            assert done[0].active == (0, 2, 3), done[0]
