# tests/test_certs.py - zz/certs.py with real Ed25519-signed messages: every scenario of
# tests/vectors/faults.txt as a WAKEUP (and SHUTDOWN votes), forgeries, replays, conflicts.
from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
from test_faults import CASES, Case

from zz import certs, faults, keys, wire
from zz.certs import CertError, Freshness, ServiceTrust, ShutdownCollector
from zz.config import load
from zz.crypto import SigningKey

SERVICE = 1  # the vector file's service "web"
EXEC = wire.exec_principal(0)  # a principal of the service that is no agreement replica


def _key(p: int) -> SigningKey:
    # Fixed seeds: every byte of every signed test message is the same in each run, so a
    # test over random mutations of one is deterministic.
    return SigningKey(hashlib.sha256(b"test_certs signer %d" % p).digest())


# g <= 2 in every test here: agreement replicas 0..6, plus one execution replica's key.
SIGNERS = {p: _key(p) for p in [*range(7), EXEC]}
PUBLIC = {p: k.public for p, k in SIGNERS.items()}


def _digest(label: bytes) -> bytes:
    return label.ljust(32, b"\0")


def _row_entry(j: int, e: faults.Entry) -> wire.RowEntry:
    if e.kind is faults.Kind.NONE:
        return wire.RowEntry(j, wire.ROW_NONE, bytes(32))
    assert e.digest is not None
    state = wire.ROW_ONTIME if e.kind is faults.Kind.ONTIME else wire.ROW_LATE
    return wire.RowEntry(j, state, _digest(e.digest))


def statement(
    signer: int,
    seq: int,
    cells: dict[int, str],
    *,
    service: int = SERVICE,
    key: SigningKey | None = None,
) -> bytes:
    """A signed FAULT-STATEMENT; cells map replica -> 'a', "a'" or '-'."""
    row = [_row_entry(j, _parse(c)) for j, c in sorted(cells.items())]
    msg = wire.FaultStatement(service, signer, seq, row)
    return msg.signed(key or SIGNERS[signer]).encode()


def _parse(tok: str) -> faults.Entry:
    if tok == "-":
        return faults.Entry.missing()
    if tok.endswith("'"):
        return faults.Entry.late(tok[:-1].encode())
    return faults.Entry.ontime(tok.encode())


def wakeup(
    evidence: list[bytes],
    sleeping: list[int],
    wake: list[int],
    *,
    seq: int = 7,
    sender: int = 0,
    service: int = SERVICE,
    key: SigningKey | None = None,
) -> bytes:
    msg = wire.Wakeup(service, sender, seq, evidence, sleeping, wake)
    return msg.signed(key or SIGNERS[sender]).encode()


def _case_evidence(c: Case) -> list[bytes]:
    out = []
    for r in c.rows:
        key = SIGNERS.get(r.signer) or _key(r.signer)  # out-of-range signers still sign something
        row = [_row_entry(j, e) for j, e in zip(r.replicas, r.entries, strict=True)]
        out.append(wire.FaultStatement(SERVICE, r.signer, r.seq, row).signed(key).encode())
    return out


def verify(raw: bytes, *, f: int = 1, g: int = 1, n_exec: int = 3) -> certs.Wakeup:
    return certs.verify_wakeup(raw, keys=PUBLIC, f=f, g=g, n_exec=n_exec, service=SERVICE)


def _reason(raw: bytes, **kw: int) -> str:
    with pytest.raises(CertError) as ei:
        verify(raw, **kw)
    return ei.value.reason


# ---- every scenario of the shared vector file ---------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_vector_case_as_signed_wakeup(case: Case) -> None:
    assert case.wake is not None
    yes, reason, want_wake = case.wake
    n_exec = max([*case.awake, *case.sleeping]) + 1
    raw = wakeup(_case_evidence(case), case.sleeping, want_wake, seq=case.seq)
    kw = {"f": case.f, "g": case.g, "n_exec": n_exec}
    if not yes:
        assert _reason(raw, **kw) == reason
        return
    w = verify(raw, **kw)
    assert list(w.wake) == want_wake and list(w.awake) == case.awake
    assert w.signers == tuple(sorted(r.signer for r in case.rows))
    assert (w.service, w.seq) == (SERVICE, case.seq)
    if want_wake:  # waking one more or one fewer than the rules choose is refused
        fewer = wakeup(_case_evidence(case), case.sleeping, want_wake[:-1], seq=case.seq)
        assert _reason(fewer, **kw) == "wrong-wake"


@pytest.mark.parametrize("case", [c for c in CASES if c.reports is not None], ids=lambda c: c.name)
def test_vector_case_shutdown_votes(case: Case) -> None:
    assert case.wake is not None and case.reports is not None
    res = faults.resolve(
        case.rows,
        case.reports,
        f=case.f,
        g=case.g,
        service=case.service,
        seq=case.seq,
        awake=case.awake,
        woken=case.wake[2],
    )
    if res.decided is None:
        assert case.decided is None
        return
    n_exec = max([*case.awake, *case.sleeping]) + 1
    trust = ServiceTrust(SERVICE, PUBLIC, case.f, case.g, n_exec)
    col = ShutdownCollector(trust)
    body = (case.awake, list(res.convict), list(res.to_sleep), list(res.stay_active))
    got = [col.add(_shutdown(s, case.seq, *body)) for s in range(case.g + 1)]
    assert got[:-1] == [None] * case.g
    cert = got[-1]
    assert cert is not None
    assert list(cert.convict) == case.convict and list(cert.active) == case.stay
    assert list(cert.sleep) == case.sleep and cert.signers == tuple(range(case.g + 1))
    assert col.add(_shutdown(case.g + 1, case.seq, *body)) is None  # returned only once


def test_vector_file_covers_every_reason() -> None:
    reasons = {c.wake[1] for c in CASES if c.wake}
    assert {"ok", "too-few-signers", "not-convictable", "not-a-fault"} <= reasons
    assert {"duplicate-signer", "bad-signer", "wrong-seq"} <= reasons
    assert "empty-round" in reasons
    assert any(c.wake and c.wake[0] and not c.wake[2] for c in CASES)  # an empty round


# ---- a round that wakes nobody (docs/fault-detection.md §4a) ------------------------


def _overdue_round_rows(seq: int = 7) -> list[bytes]:
    """f = 1: a round woke spare 2, which was overdue; the follow-up rows over {0, 1, 2}."""
    return [statement(s, seq, {0: "a", 1: "b", 2: "-"}) for s in (0, 1)]


def test_empty_wakeup_over_2f_plus_1_awake_verifies() -> None:
    w = verify(wakeup(_overdue_round_rows(), [], []))
    assert (w.wake, w.awake, w.sleeping, w.signers) == ((), (0, 1, 2), (), (0, 1))
    # f = 2 needs five awake
    ev = [statement(s, 7, {0: "a", 1: "b", 2: "a", 3: "-", 4: "-"}) for s in (0, 2)]
    assert verify(wakeup(ev, [], []), f=2, n_exec=5).wake == ()


def test_empty_wakeup_needs_g_plus_1_statements() -> None:
    one = _overdue_round_rows()[:1]
    assert _reason(wakeup(one, [], [])) == "too-few-signers"
    # a faulty agreement replica's own statement twice is still one signer
    assert _reason(wakeup(one * 2, [], [])) == "duplicate-signer"
    # and it cannot sign for a correct one
    forged = statement(1, 7, {0: "a", 1: "b", 2: "-"}, key=SIGNERS[3])
    assert _reason(wakeup([one[0], forged], [], [])) == "bad-signature"
    # g+1 rows that hold a certificate are no fault, empty round or not
    cert = [statement(s, 7, {0: "a", 1: "b", 2: "a"}) for s in (0, 1)]
    assert _reason(wakeup(cert, [], [])) == "not-a-fault"


def test_empty_wakeup_over_fewer_than_2f_plus_1_awake_is_refused() -> None:
    """f = 1, two awake and nobody asleep (a conviction whose fresh spare is not ready): a
    round that wakes nobody could not be sure to decide, so it is not justified."""
    ev = [statement(s, 7, {1: "a", 2: "b"}) for s in (0, 1)]
    assert _reason(wakeup(ev, [], []), n_exec=3) == "empty-round"
    ev = [statement(s, 7, {0: "a", 1: "b", 2: "a", 3: "-"}) for s in (0, 1)]
    assert _reason(wakeup(ev, [], []), f=2, n_exec=5) == "empty-round"


def test_empty_wakeup_while_a_spare_sleeps_is_refused() -> None:
    """The rules wake a sleeping spare: a WAKEUP that lists it asleep and wakes nobody is
    wrong-wake; one that hides it (sleeping []) verifies here, and controld refuses it
    against its inventory (tests/test_controld_daemon.py)."""
    ev = _overdue_round_rows()
    assert _reason(wakeup(ev, [3], []), n_exec=4) == "wrong-wake"
    assert verify(wakeup(ev, [3], [3]), n_exec=4).wake == (3,)


def test_empty_round_then_its_shutdown_is_fresh() -> None:
    fresh = Freshness()
    fresh.acted_wakeup(verify(wakeup(*_w1())))  # the round that woke 2, closed undecided
    w = verify(wakeup(_overdue_round_rows(), [], []))
    fresh.check_wakeup(w)
    fresh.acted_wakeup(w)
    with pytest.raises(CertError, match="duplicate"):
        fresh.check_wakeup(verify(wakeup(_overdue_round_rows(), [], [], sender=2)))
    col = ShutdownCollector(ServiceTrust(SERVICE, PUBLIC, 1, 1, 3))
    cert = None
    for s in (0, 1):
        cert = col.add(_shutdown(s, 7, [0, 1, 2], [1], [], [0, 2])) or cert
    assert cert is not None and cert.convict == (1,) and cert.active == (0, 2)
    fresh.check_shutdown(cert)
    fresh.acted_shutdown(cert)
    with pytest.raises(CertError, match="stale"):
        fresh.check_wakeup(w)


# ---- forgeries and malformed certificates -------------------------------------------


def _w1() -> tuple[list[bytes], list[int], list[int]]:
    ev = [statement(0, 7, {0: "a", 1: "b"}), statement(1, 7, {0: "a", 1: "b"})]
    return ev, [2], [2]


def test_valid_w1_verifies() -> None:
    w = verify(wakeup(*_w1()))
    assert w.wake == (2,) and w.signers == (0, 1) and w.round == (SERVICE, 7, (0, 1))


def test_forged_outer_signature() -> None:
    raw = bytearray(wakeup(*_w1()))
    raw[-1] ^= 1
    assert _reason(bytes(raw)) == "bad-signature"
    # Signed with a key that is not the sender's.
    assert _reason(wakeup(*_w1(), key=SIGNERS[1])) == "bad-signature"


def test_forged_evidence_signature() -> None:
    ev, sl, wk = _w1()
    ev[1] = statement(1, 7, {0: "a", 1: "b"}, key=SIGNERS[2])
    assert _reason(wakeup(ev, sl, wk)) == "bad-signature"


def test_signer_without_public_key() -> None:
    ev, sl, wk = _w1()
    keys_wo_1 = {p: k for p, k in PUBLIC.items() if p != 1}
    with pytest.raises(CertError) as ei:
        certs.verify_wakeup(wakeup(ev, sl, wk), keys=keys_wo_1, f=1, g=1, n_exec=3)
    assert ei.value.reason == "bad-signature"


def test_evidence_signed_by_non_agreement_principal() -> None:
    ev, sl, wk = _w1()
    ev[1] = statement(EXEC, 7, {0: "a", 1: "b"})  # a valid signature, but not a replica
    assert _reason(wakeup(ev, sl, wk)) == "bad-signer"
    # Agreement replica 4 exists only when g >= 2.
    ev[1] = statement(4, 7, {0: "a", 1: "b"})
    assert _reason(wakeup(ev, sl, wk)) == "bad-signer"


def test_outer_sender_must_be_agreement_replica() -> None:
    ev, sl, wk = _w1()
    assert _reason(wakeup(ev, sl, wk, sender=EXEC)) == "bad-sender"


def test_same_signer_twice() -> None:
    ev = [statement(1, 7, {0: "a", 1: "b"}), statement(1, 7, {0: "a", 1: "-"})]
    assert _reason(wakeup(ev, [2], [2])) == "duplicate-signer"
    # Many copies are refused before any signature is checked.
    ev = [statement(1, 7, {0: "a", 1: "b"})] * 1000
    assert _reason(wakeup(ev, [2], [2])) == "duplicate-signer"


def test_statement_from_another_service() -> None:
    ev, sl, wk = _w1()
    ev[1] = statement(1, 7, {0: "a", 1: "b"}, service=2)
    assert _reason(wakeup(ev, sl, wk)) == "mixed-service"
    with pytest.raises(CertError) as ei:  # the whole WAKEUP is for another service
        certs.verify_wakeup(
            wakeup(*_w1(), service=2), keys=PUBLIC, f=1, g=1, n_exec=3, service=SERVICE
        )
    assert ei.value.reason == "wrong-service"


def test_other_seq_and_other_awake_set() -> None:
    ev, sl, wk = _w1()
    assert _reason(wakeup(ev, sl, wk, seq=8)) == "wrong-seq"
    ev[1] = statement(1, 7, {0: "a", 2: "b"})
    assert _reason(wakeup(ev, [2], [2])) == "shape"


def test_wrong_types() -> None:
    ev, sl, wk = _w1()
    assert _reason(ev[0]) == "wrong-type"  # a statement is not a WAKEUP
    ev[1] = _shutdown(1, 7, [0, 1], [1], [], [0, 2])
    assert _reason(wakeup(ev, sl, wk)) == "wrong-type"


def test_sleeping_must_be_disjoint_ascending_in_range() -> None:
    ev, _, _ = _w1()
    assert _reason(wakeup(ev, [1, 2], [1])) == "bad-sleeping"
    assert _reason(wakeup(ev, [3], [3])) == "bad-sleeping"  # n_exec = 3
    assert _reason(wakeup(ev, [2, 2], [2])) == "bad-sleeping"
    assert verify(wakeup(ev, [3, 4], [3]), n_exec=5).wake == (3,)
    assert _reason(wakeup(ev, [4, 3], [3]), n_exec=5) == "bad-sleeping"


def test_awake_outside_service() -> None:
    ev = [statement(0, 7, {0: "a", 5: "b"}), statement(1, 7, {0: "a", 5: "b"})]
    assert _reason(wakeup(ev, [2], [2])) == "bad-awake"


def test_bad_row_states() -> None:
    def raw_stmt(signer: int, state: int, dig: bytes) -> bytes:
        row = [wire.RowEntry(0, wire.ROW_ONTIME, _digest(b"a")), wire.RowEntry(1, state, dig)]
        return wire.FaultStatement(SERVICE, signer, 7, row).signed(SIGNERS[signer]).encode()

    good = statement(0, 7, {0: "a", 1: "b"})
    assert _reason(wakeup([good, raw_stmt(1, 3, _digest(b"b"))], [2], [2])) == "malformed"
    assert _reason(wakeup([good, raw_stmt(1, 0, _digest(b"b"))], [2], [2])) == "malformed"
    assert _reason(wakeup([good, raw_stmt(1, 1, bytes(32))], [2], [2])) == "malformed"


def test_no_evidence_and_malformed_bytes() -> None:
    assert _reason(wakeup([], [2], [])) == "too-few-signers"
    assert _reason(b"") == "malformed"
    assert _reason(wakeup(*_w1())[:-70]) == "malformed"
    ev, sl, wk = _w1()
    ev[0] = ev[0][:20]
    assert _reason(wakeup(ev, sl, wk)) == "malformed"


def test_mutations_only_raise_cert_error() -> None:
    # Untrusted bytes: any corruption is a CertError, never another exception, and
    # never an accepted certificate. Each mutation flips at least one bit (an XOR with a
    # non-zero byte): writing a random byte could write a byte's own value back and leave
    # the certificate unchanged, and whether it did depended on the signature bytes.
    rng = random.Random(7)
    good = wakeup(*_w1())
    accepted = []
    for _ in range(400):
        raw = bytearray(good)
        for i in rng.sample(range(len(raw)), rng.randint(1, 4)):
            raw[i] ^= rng.randrange(1, 256)
        assert raw != good
        try:
            verify(bytes(raw))
            accepted.append(bytes(raw))
        except CertError as e:
            assert e.reason in certs.REASONS or e.reason in _EVAL_REASONS
    assert accepted == []


_EVAL_REASONS = {
    "bad-params",
    "bad-signer",
    "duplicate-signer",
    "wrong-seq",
    "shape",
    "not-a-fault",
    "too-few-signers",
    "not-convictable",
    "empty-round",
}


def test_trust_from_key_directory(rack_config: Path) -> None:
    c = load(rack_config)
    svc = c.service("web")
    out = keys.generate(c)
    trust = ServiceTrust.load(out, svc)
    assert (trust.service, trust.f, trust.g, trust.n_exec) == (svc.id, svc.f, svc.g, svc.n_exec)

    def sec(p: int) -> SigningKey:
        s = keys.load_secret(keys.secret_path(out, svc.id, p)).sign
        assert s is not None
        return s

    row = [
        wire.RowEntry(0, wire.ROW_ONTIME, _digest(b"a")),
        wire.RowEntry(1, wire.ROW_NONE, bytes(32)),
    ]
    ev = [wire.FaultStatement(svc.id, s, 9, row).signed(sec(s)).encode() for s in (0, 3)]
    raw = wire.Wakeup(svc.id, 3, 9, ev, [2], [2]).signed(sec(3)).encode()
    w = certs.verify_wakeup(
        raw, keys=trust.keys, f=trust.f, g=trust.g, n_exec=trust.n_exec, service=svc.id
    )
    assert w.wake == (2,)
    assert certs.service_of(raw) == svc.id


# ---- replays ------------------------------------------------------------------------


def test_replayed_and_stale_wakeups(tmp_path: Path) -> None:
    fresh = Freshness()
    w = verify(wakeup(*_w1()))
    fresh.check_wakeup(w)
    fresh.acted_wakeup(w)
    with pytest.raises(CertError, match="duplicate"):
        fresh.check_wakeup(w)
    # The same round sent by another agreement replica is the same round.
    w_other = verify(wakeup(*_w1(), sender=3))
    with pytest.raises(CertError, match="duplicate"):
        fresh.acted_wakeup(w_other)
    # A second round at the same seq over a larger awake set is new (scenario w7).
    ev2 = [statement(s, 7, {0: "a", 1: "b", 2: "b"}) for s in (0, 1)]
    w2 = verify(wakeup(ev2, [3], [3]), f=2, n_exec=4)
    fresh.acted_wakeup(w2)
    # Persisted state survives a controld restart.
    path = tmp_path / "freshness.json"
    fresh.save(path)
    again = Freshness.load(path)
    with pytest.raises(CertError, match="duplicate"):
        again.check_wakeup(w2)
    # After the SHUTDOWN of seq 7, anything at seq <= 7 is stale, later seqs are fine.
    trust = ServiceTrust(SERVICE, PUBLIC, 1, 1, 3)
    col = ShutdownCollector(trust)
    cert = None
    for s in (0, 1):
        cert = col.add(_shutdown(s, 7, [0, 1], [1], [], [0, 2])) or cert
    assert cert is not None
    again.acted_shutdown(cert)
    with pytest.raises(CertError, match="stale"):
        again.check_wakeup(verify(wakeup(*_w1())))
    with pytest.raises(CertError, match="stale"):
        again.check_shutdown(cert)
    # A later round over the awake set that SHUTDOWN changed is the same fault flagged at
    # another seq (a sibling): not acted on again, WAKEUP or SHUTDOWN.
    ev9 = [statement(s, 9, {0: "a", 1: "b"}) for s in (0, 1)]
    with pytest.raises(CertError, match="sibling"):
        again.check_wakeup(verify(wakeup(ev9, [2], [2], seq=9)))
    sib = None
    for s in (2, 3):
        sib = col.add(_shutdown(s, 8, [0, 1], [1], [], [0, 2])) or sib
    assert sib is not None and again.sibling(sib)
    with pytest.raises(CertError, match="sibling"):
        again.check_shutdown(sib)
    # Over the new awake set {0, 2} (slot 1 refilled, asleep) later seqs are fine, and the
    # sibling rule survives a restart.
    ev9 = [statement(s, 9, {0: "a", 2: "b"}) for s in (0, 1)]
    again.check_wakeup(verify(wakeup(ev9, [1], [1], seq=9)))
    again.save(path)
    with pytest.raises(CertError, match="sibling"):
        Freshness.load(path).check_shutdown(sib)
    # Once a round over another awake set was acted on, the old set is a new round's again
    # (that round closed undecided and was judged over the larger set, say).
    again.acted_wakeup(verify(wakeup(ev9, [1], [1], seq=9)))
    ev11 = [statement(s, 11, {0: "a", 1: "b"}) for s in (0, 1)]
    again.check_wakeup(verify(wakeup(ev11, [2], [2], seq=11)))
    assert Freshness.load(tmp_path / "missing.json").last_shutdown(SERVICE) == 0
    assert Freshness.load(path).last_shutdown(SERVICE) == 7
    (tmp_path / "bad.json").write_text('{"1": {"rounds": 3}}')
    with pytest.raises(ValueError):
        Freshness.load(tmp_path / "bad.json")


# ---- SHUTDOWN certificates ----------------------------------------------------------


def _shutdown(
    sender: int,
    seq: int,
    awake: list[int],
    convict: list[int],
    sleep: list[int],
    active: list[int],
    *,
    key: SigningKey | None = None,
) -> bytes:
    msg = wire.Shutdown(SERVICE, sender, seq, awake, convict, sleep, active)
    return msg.signed(key or SIGNERS[sender]).encode()


def test_shutdown_needs_g_plus_1_identical_votes() -> None:
    col = ShutdownCollector(ServiceTrust(SERVICE, PUBLIC, 1, 1, 3))
    body = ([0, 1], [1], [], [0, 2])
    assert col.add(_shutdown(0, 7, *body)) is None  # g = 1 vote: no certificate
    assert col.add(_shutdown(0, 7, *body)) is None  # the same vote again counts once
    cert = col.add(_shutdown(2, 7, *body))
    assert cert is not None and cert.signers == (0, 2) and cert.convict == (1,)
    assert len(cert.votes) == 2


def test_shutdown_conflicting_votes() -> None:
    col = ShutdownCollector(ServiceTrust(SERVICE, PUBLIC, 1, 1, 3))
    a = ([0, 1], [1], [], [0, 2])
    b = ([0, 1], [0], [], [1, 2])
    assert col.add(_shutdown(0, 7, *a)) is None
    with pytest.raises(CertError, match="conflicting"):
        col.add(_shutdown(0, 7, *b))  # replica 0 changes its mind: its first vote stands
    assert col.add(_shutdown(1, 7, *b)) is None  # one vote for b, one for a
    cert = col.add(_shutdown(3, 7, *a))
    assert cert is not None and cert.convict == (1,) and cert.signers == (0, 3)


def test_shutdown_vote_checks() -> None:
    trust = ServiceTrust(SERVICE, PUBLIC, 1, 1, 3)
    col = ShutdownCollector(trust)
    body = ([0, 1], [1], [], [0, 2])
    with pytest.raises(CertError, match="bad-signature"):
        col.add(_shutdown(0, 7, *body, key=SIGNERS[1]))
    with pytest.raises(CertError, match="bad-sender"):
        col.add(_shutdown(EXEC, 7, *body))
    with pytest.raises(CertError, match="malformed"):
        col.add(_shutdown(0, 7, [0, 1], [1], [1], [0, 2]))  # convicted and asleep
    with pytest.raises(CertError, match="malformed"):
        col.add(_shutdown(0, 7, [0, 1], [], [], [0, 1, 2]))  # more than f+1 active
    with pytest.raises(CertError, match="malformed"):
        col.add(_shutdown(0, 7, [1, 0], [1], [], [0, 2]))
    with pytest.raises(CertError, match="wrong-type"):
        col.add(wakeup(*_w1()))
    other = wire.Shutdown(2, 0, 7, *body).signed(SIGNERS[0]).encode()
    with pytest.raises(CertError, match="wrong-service"):
        col.add(other)
    with pytest.raises(CertError, match="malformed"):
        col.add(b"ZZ")
    # None of the rejected votes counted.
    assert col.add(_shutdown(1, 7, *body)) is None


def test_shutdown_pending_votes_are_bounded_per_sender() -> None:
    col = ShutdownCollector(ServiceTrust(SERVICE, PUBLIC, 1, 1, 3))
    for seq in range(1, 200):  # a faulty replica votes for rounds nobody else resolves
        assert col.add(_shutdown(3, seq, [0, 1], [1], [], [0, 2])) is None
    assert sum(3 in t.voted for t in col._pending.values()) <= certs.MAX_PENDING_PER_SENDER
    body = ([0, 1], [1], [], [0, 2])
    assert col.add(_shutdown(0, 500, *body)) is None
    assert col.add(_shutdown(1, 500, *body)) is not None


def test_collector_returns_a_second_certificate_for_the_same_round() -> None:
    """Correct agreement replicas can split so that two bodies of one round are each
    certified (campaign seed 3502 round 63): the second is returned too, for controld to
    merge; a vote for a certified body is late, a sender's second body still conflicting."""
    col = ShutdownCollector(ServiceTrust(SERVICE, PUBLIC, 1, 1, 3))
    a = ([0, 1], [1], [], [0, 2])
    b = ([0, 1], [0], [2], [1])
    assert col.add(_shutdown(0, 7, *a)) is None
    assert col.add(_shutdown(2, 7, *b)) is None
    first = col.add(_shutdown(1, 7, *a))
    assert first is not None and first.signers == (0, 1) and first.convict == (1,)
    col.forget_below(7)  # what controld does once it acted on it: the round stays
    assert col.add(_shutdown(0, 7, *a)) is None and col.late_votes == 1
    with pytest.raises(CertError, match="conflicting"):
        col.add(_shutdown(1, 7, *b))  # replica 1 voted a: its vote stands
    second = col.add(_shutdown(3, 7, *b))
    assert second is not None and second.signers == (2, 3)
    assert (second.seq, second.awake, second.convict, second.sleep, second.active) == (
        7, (0, 1), (0,), (2,), (1,),
    )  # fmt: skip
    assert len(second.votes) == 2
    # Each body is returned once; later votes for either are late.
    assert col.add(_shutdown(3, 7, *b)) is None and col.late_votes == 2


def _cert(seq: int, awake: list[int], convict: list[int], sleep: list[int],
          active: list[int], signers: tuple[int, ...] = (0, 1)) -> certs.Shutdown:  # fmt: skip
    col = ShutdownCollector(ServiceTrust(SERVICE, PUBLIC, 2, 2, 5))
    got = [col.add(_shutdown(s, seq, awake, convict, sleep, active)) for s in signers]
    cert = col.add(_shutdown(6, seq, awake, convict, sleep, active))
    assert got == [None] * len(signers) and cert is not None
    return cert


def _lists(o: certs.Outcome) -> tuple[list[int], list[int], list[int], list[int]]:
    return list(o.awake), list(o.convict), list(o.sleep), list(o.active)


def test_merge_outcomes_of_the_split_round() -> None:
    """Seed 3502 round 63 (f = 2): replica 1 lied to agreement replicas 0 and 3 only while
    3 signed wrong checkpoints; 0 and 3 certified A, 1 and 2 certified B, both seq 4480
    over awake [1, 3, 4]. The merge convicts both, keeps active only what both keep and
    puts the rest to sleep, whichever certificate came first."""
    a = _cert(4480, [1, 3, 4], [1, 3], [], [0, 2, 4])
    b = _cert(4480, [1, 3, 4], [3], [2], [0, 1, 4], signers=(2, 3))
    m = certs.merge_outcomes([a, b])
    assert (m.service, m.seq) == (SERVICE, 4480)
    assert _lists(m) == ([1, 3, 4], [1, 3], [2], [0, 4])
    assert certs.merge_outcomes([b, a]) == m  # order independent
    assert certs.merge_outcomes([a, b, a]) == m  # a set: a body twice counts once
    # A merge merged with more bodies is the merge of them all (controld keeps only the
    # outcome it acted on).
    assert certs.merge_outcomes([certs.merge_outcomes([a]), b]) == m
    assert certs.merge_outcomes([m, a]) == m and certs.merge_outcomes([m, b]) == m


def test_merge_outcomes_of_one_body_is_that_body() -> None:
    # Awake 2 is named nowhere else: one body is kept as certified, not completed.
    c = _cert(9, [0, 1, 2], [1], [], [0, 3])
    assert certs.merge_outcomes([c]) == c.outcome
    assert _lists(certs.merge_outcomes([c, c])) == ([0, 1, 2], [1], [], [0, 3])


def test_merge_outcomes_of_nested_rounds() -> None:
    """A round at one seq certified by some, closed undecided by others, who certified the
    follow-up round over the larger awake set (spare 4 woken for it): 4 was never active
    for the first, so it sleeps."""
    first = _cert(12, [0, 1, 2], [0, 2], [], [1, 3])
    follow_up = _cert(12, [0, 1, 2, 3], [0, 2], [], [1, 3, 4], signers=(2, 3))
    for order in ([first, follow_up], [follow_up, first]):
        assert _lists(certs.merge_outcomes(order)) == ([0, 1, 2, 3], [0, 2], [4], [1, 3])


def test_merge_outcomes_refuses_what_is_no_round_of_one_seq() -> None:
    a = _cert(12, [0, 1, 2], [0, 2], [], [1, 3])
    with pytest.raises(ValueError, match="seq"):
        certs.merge_outcomes([a, _cert(13, [0, 1, 2], [0], [], [1, 2])])
    with pytest.raises(ValueError, match="not nested"):
        certs.merge_outcomes([a, _cert(12, [0, 1, 3], [0], [], [1, 3])])
    other = certs.Outcome(SERVICE + 1, 12, (0, 1, 2), (0, 2), (), (1, 3))
    with pytest.raises(ValueError, match="service"):
        certs.merge_outcomes([a, other])
    with pytest.raises(ValueError):
        certs.merge_outcomes([])


def test_freshness_merges_a_second_certificate_at_the_seq_acted_on(tmp_path: Path) -> None:
    a = _cert(4480, [1, 3, 4], [1, 3], [], [0, 2, 4])
    b = _cert(4480, [1, 3, 4], [3], [2], [0, 1, 4], signers=(2, 3))
    fresh = Freshness()
    assert fresh.outcome(SERVICE) is None and fresh.merged(a) is None
    fresh.acted_shutdown(a)
    assert fresh.outcome(SERVICE) == a.outcome
    with pytest.raises(CertError, match="stale"):
        fresh.check_shutdown(b)  # stale as a certificate of its own ...
    m = fresh.merged(b)  # ... merged with what was acted on
    assert m is not None and _lists(m) == ([1, 3, 4], [1, 3], [2], [0, 4])
    fresh.acted_merge(m)
    # The merged outcome survives a restart; b again (or a) adds nothing: no merge.
    path = tmp_path / "freshness.json"
    fresh.save(path)
    again = Freshness.load(path)
    assert again.outcome(SERVICE) == m and again.merged(b) is None and again.merged(a) is None
    # Nor does a certificate over a larger awake set at that seq that decides the same.
    assert again.merged(_cert(4480, [1, 2, 3, 4], [1, 3], [2], [0, 4])) is None
    # Not merged: another seq, an awake set not nested, or once a later SHUTDOWN was acted on.
    assert again.merged(_cert(4481, [1, 3, 4], [3], [2], [0, 1, 4])) is None
    assert again.merged(_cert(4480, [0, 1, 3], [3], [], [0, 1])) is None
    again.acted_shutdown(_cert(4490, [0, 4], [0], [], [2, 4]))
    assert again.merged(b) is None
    # A file written before the outcome was kept loads, with nothing to merge with.
    (tmp_path / "old.json").write_text(
        '{"1": {"shutdown_seq": 7, "rounds": [], "last_awake": [0, 1], "last_active": [0, 2]}}'
    )
    old = Freshness.load(tmp_path / "old.json")
    assert old.outcome(SERVICE) is None and old.last_shutdown(SERVICE) == 7
