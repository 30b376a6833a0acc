"""Malformed messages per peer (issue 17 item 1): zz-agreed charges what it drops at intake
(undecodable, wrong service or sender, a failed authenticator) and the framing errors of a
connection to the peer whose own messages that connection carries: an agreement replica
named by its authenticated STATUS, an execution replica by its EXEC-REPORT or FETCH. Stats
`peer_malformed_drops` (one per agreement replica) and `exec_malformed_drops` (one per
execution replica); a connection nobody identified on is counted by reason only.

Real zz-agreed replicas, hand-made (MACed / signed) messages from the test, which holds
every principal's keys (docs/monitoring.md "Per-peer drops")."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from tests.cluster import Cluster
from tests.test_agreement_log import _secret, _sign_seed
from tests.test_agreement_window import WINDOW, _exec_cluster, _report
from zz import wire
from zz.crypto import SigningKey, sha256


def _status(c: Cluster, sender: int, to: int, key: bytes | None = None) -> bytes:
    """A STATUS from agreement replica `sender`, MACed for `to` (with `key`: a wrong MAC)."""
    m = wire.Status(1, sender, view=0, last_exec=0, stable_seq=0)
    return m.with_macs({to: key or _secret(c, sender)[to]}).encode()


GARBAGE = b"XX" + bytes(60)  # a frame of a valid length whose magic is wrong
BAD_LENGTH = (1).to_bytes(4, "big")  # a frame length under the header: the link closes


def _send(c: Cluster, r: int, frames: list[bytes], raw_tail: bytes = b"") -> None:
    """Frames on one new connection to replica r, then `raw_tail` as is; waits until the
    replica has read them (it closes the connection after a framing error, or we close)."""
    with socket.create_connection(("127.0.0.1", c.port(r)), timeout=5) as s:
        s.sendall(b"".join(wire.frame(f) for f in frames) + raw_tail)
        if raw_tail:
            s.settimeout(5)
            try:
                while s.recv(65536):  # until the replica closes it
                    pass
            except ConnectionResetError:
                pass
        else:
            time.sleep(0.3)


def test_malformed_messages_are_counted_for_the_peer_whose_connection_carries_them(
    tmp_path: Path,
) -> None:
    with _exec_cluster(tmp_path) as c:
        c.wait_for(
            lambda: "peer_malformed_drops" in c.stats(0), timeout=10, what="replica 0's stats"
        )
        before = c.stats(0)
        assert before["peer_malformed_drops"] == [0] * c.n, before
        assert before["exec_malformed_drops"] == [0, 0, 0], before

        # Replica 3's connection: its STATUS names it; then an undecodable frame, a STATUS
        # with a wrong MAC, one of another service, and a frame length that closes the link.
        other_service = wire.Status(2, 3, view=0, last_exec=0, stable_seq=0)
        other_service = other_service.with_macs({0: _secret(c, 3)[0]}).encode()
        _send(
            c,
            0,
            [_status(c, 3, 0), GARBAGE, _status(c, 3, 0, key=bytes(32)), other_service],
            BAD_LENGTH,
        )
        # Execution replica 1's connection: a report far above the window (dropped there,
        # counted in exec_window_drops, but authenticated) names it; then garbage.
        far = c.stats(0)["stable_seq"] + WINDOW + 1
        _send(c, 0, [_report(c, 1, far, 0), GARBAGE, GARBAGE])
        # Nobody's: garbage on a fresh connection, and on one whose only authenticated
        # message is a CHECKPOINT of replica 2 (signed, relayed by others: it names nobody).
        ckpt = wire.Checkpoint(1, 2, seq=8, state=sha256(b"x"))
        ckpt = ckpt.signed(SigningKey(_sign_seed(c, 2))).encode()
        _send(c, 0, [GARBAGE, GARBAGE])
        _send(c, 0, [ckpt, GARBAGE])

        c.wait_for(
            lambda: c.stats(0)["dropped"]["magic"] >= before["dropped"]["magic"] + 6,
            timeout=10,
            what="replica 0 counted the six undecodable frames",
        )
        s = c.stats(0)
        assert s["peer_malformed_drops"] == [0, 0, 0, 4], s  # garbage, MAC, service, framing
        assert s["exec_malformed_drops"] == [0, 2, 0], s
        assert s["exec_window_drops"] == [0, 1, 0], s
        assert s["dropped"]["framing"] == before["dropped"]["framing"] + 1, s
        assert s["dropped"]["auth"] >= before["dropped"]["auth"] + 1, s
        # The other replicas saw none of it.
        for r in (1, 2, 3):
            assert c.stats(r)["peer_malformed_drops"] == [0] * c.n, c.stats(r)
