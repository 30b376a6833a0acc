# tests/test_sibling_rounds.py - one fault flagged at two adjacent seqs S and S+1: some
# agreement replicas gather g+1 statements for S first and decide there, others open (or
# decide) a round at S+1 with the same awake set. Every correct replica must end on the
# certificate at S (the lower seq, zw_check_done in agreement/src/peer_certs.c), and take the
# fresh spare's SPARE-READY for that conviction, or its view keeps the convicted slot out
# of the sleeping set for good (campaign seed 3001 rounds 17, 22, 44: f+1 not restored).
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.cluster import SERVICE_ID, Cluster
from zz import keys, wire
from zz.crypto import SigningKey

S = 5  # the lower seq, whose certificate controld acted on


def _send(port: int, *msgs: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for m in msgs:
            s.sendall(wire.frame(m))


def _sign_key(kd: Path, principal: int, service: int = SERVICE_ID) -> SigningKey:
    sec = keys.load_secret(keys.secret_path(kd, service, principal))
    assert sec.sign is not None
    return sec.sign


def _statement(kd: Path, signer: int, seq: int) -> bytes:
    """Agreement replica `signer`'s row for `seq`: execution replicas 0 and 1 disagree."""
    row = [
        wire.RowEntry(0, wire.ROW_ONTIME, b"a".ljust(32, b"\0")),
        wire.RowEntry(1, wire.ROW_ONTIME, b"b".ljust(32, b"\0")),
    ]
    msg = wire.FaultStatement(SERVICE_ID, signer, seq, row)
    return msg.signed(_sign_key(kd, signer)).encode()


def _wakeup(kd: Path, seq: int) -> bytes:
    evidence = [_statement(kd, 0, seq), _statement(kd, 1, seq)]
    return wire.Wakeup(SERVICE_ID, 0, seq, evidence, [2], [2]).signed(_sign_key(kd, 0)).encode()


def _shutdowns(kd: Path, seq: int) -> list[bytes]:
    """A certificate (g+1 = 2 identical bodies): 0 convicted, 1 and the spare 2 active."""
    return [
        wire.Shutdown(SERVICE_ID, r, seq, [0, 1], [0], [], [1, 2]).signed(_sign_key(kd, r)).encode()
        for r in (0, 1)
    ]


@pytest.mark.parametrize("announced", [S, S + 1])
def test_the_lower_sibling_certificate_wins_and_its_spare_is_taken(
    tmp_path: Path, announced: int
) -> None:
    """`announced`: the seq of the certificate controld acted on, which names the fresh
    spare in its SPARE-READY (the lower one, or the higher one that came first there)."""
    with Cluster(tmp_path, app="kv", f=1) as c:
        c.start()
        kd = c.dir / "keys"
        ctl = keys.load_secret(
            keys.secret_path(kd, keys.RACK_SERVICE, keys.controld_principal(0))
        ).sign
        assert ctl is not None
        # Replica 3 is in the round at S+1; replica 2 decided S+1 (a certificate) already;
        # replica 1 decides S.
        _send(c.port(3), _wakeup(kd, S + 1))
        _send(c.port(2), _wakeup(kd, S + 1), *_shutdowns(kd, S + 1))
        _send(c.port(1), _wakeup(kd, S), *_shutdowns(kd, S))
        c.wait_for(
            lambda: (
                c.stats(3).get("fault_round_seq") == S + 1
                and c.stats(2).get("exec_convicted") == [0]
                and c.stats(1).get("exec_convicted") == [0]
            ),
            what="3 in the round at S+1, 2 decided it, 1 decided S",
        )
        # The certificate at S, then controld's announcement of 0's successor.
        spare = keys.rotate_exec(kd, c.config, c.service, 0, announced, ctl, 0)
        for r in (2, 3):
            _send(c.port(r), *_shutdowns(kd, S))
        for r in (1, 2, 3):
            _send(c.port(r), spare)
        c.wait_for(
            lambda: all(
                c.stats(r)["exec_awake"] == [1, 2] and c.stats(r)["exec_sleeping"] == [0]
                for r in (1, 2, 3)
            ),
            what="1, 2 and 3 convicted 0 and took its fresh spare",
        )
        for r in (1, 2, 3):
            s = c.stats(r)
            assert s["exec_key_epoch"][0] == 1 and not s["fault_round_open"], s
            assert s["spares_ready_rejected"] == 0, s


def test_a_shutdown_before_its_wakeup_is_kept(tmp_path: Path) -> None:
    """Peers that adopted the WAKEUP first decide and send their SHUTDOWN before the WAKEUP
    reaches this replica (campaign seed 3101 round 26: the bodies were dropped, the round
    opened after them, waited for a report it never got and closed undecided). Replica 3
    gets a certificate with no round open; replica 2 one body, then the WAKEUP, then the
    other body."""
    with Cluster(tmp_path, app="kv", f=1) as c:
        c.start()
        kd = c.dir / "keys"
        first, second = _shutdowns(kd, S)
        _send(c.port(3), first, second)
        _send(c.port(2), first)
        c.wait_for(lambda: c.stats(2)["shutdowns_received"] == 1, what="2 holds one body")
        _send(c.port(2), _wakeup(kd, S))
        c.wait_for(lambda: c.stats(2).get("fault_round_seq") == S, what="2 in the round")
        _send(c.port(2), second)
        c.wait_for(
            lambda: all(
                c.stats(r)["exec_convicted"] == [0] and c.stats(r)["exec_awake"] == [1, 2]
                for r in (2, 3)
            ),
            what="2 and 3 adopted the certificate",
        )
        assert not any(c.stats(r)["fault_round_open"] for r in (2, 3))
