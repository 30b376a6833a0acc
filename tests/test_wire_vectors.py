# tests/test_wire_vectors.py - the Python codec against the shared vectors tests/vectors/wire.txt.
# The C codec runs the same file; together they pin docs/wire.md byte for byte.
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from zz import wire

VEC_DIR = Path(__file__).parent / "vectors"
sys.path.insert(0, str(VEC_DIR))
import gen  # noqa: E402


@dataclass
class Vector:
    name: str
    msg: bytes = b""
    dump: str | None = None
    error: str | None = None
    mac_keys: list[tuple[int, bytes]] = field(default_factory=list)
    sign_pubs: list[bytes] = field(default_factory=list)


def parse_vectors(text: str) -> list[Vector]:
    out: list[Vector] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("[") and line.endswith("]"):
            out.append(Vector(line[1:-1]))
            continue
        key, sep, value = line.partition(" = ")
        assert sep and out, f"bad line {line!r}"
        v = out[-1]
        if key == "msg":
            v.msg = bytes.fromhex(value)
        elif key == "dump":
            v.dump = value
        elif key == "error":
            v.error = value
        elif key == "mac_key":
            rcv, _, hexkey = value.partition(":")
            v.mac_keys.append((int(rcv), bytes.fromhex(hexkey)))
        elif key == "sign_pub":
            v.sign_pubs.append(bytes.fromhex(value))
        else:
            raise AssertionError(f"unknown key {key!r}")
    return out


VECTORS = parse_vectors((VEC_DIR / "wire.txt").read_text())
VALID = [v for v in VECTORS if v.error is None]
INVALID = [v for v in VECTORS if v.error is not None]


def test_file_is_regenerated_exactly() -> None:
    assert gen.generate() == (VEC_DIR / "wire.txt").read_text()


def test_coverage_of_types_and_errors() -> None:
    types = {wire.decode(v.msg).TYPE for v in VALID}
    assert types == set(range(1, 12)) | set(range(16, 28))
    assert {v.error for v in INVALID} == set(wire.ERROR_NAMES)
    assert len({v.name for v in VECTORS}) == len(VECTORS)


@pytest.mark.parametrize("v", VALID, ids=lambda v: v.name)
def test_valid_vector(v: Vector) -> None:
    m = wire.decode(v.msg)
    assert m.dump() == v.dump
    assert m.encode() == v.msg
    if m.AUTH == wire.AUTH_NONE:
        # FILE-DATA: nothing to verify (its content is checked against a manifest).
        assert not v.mac_keys and not v.sign_pubs and not m.auth
        assert not m.verify_sig(gen.sign_key(m.sender).public)
        return
    assert v.mac_keys or v.sign_pubs, "a valid vector must carry something to verify"
    for rcv, key in v.mac_keys:
        assert m.verify_mac(rcv, key)
        assert not m.verify_mac(rcv, bytes(32))
        assert not m.verify_mac(rcv + 1000, key)
    for pub in v.sign_pubs:
        assert m.verify_sig(pub)
        assert not m.verify_sig(gen.sign_key(999).public)
    # Any flipped bit in the authenticated part must break authentication.
    tampered = bytearray(v.msg)
    tampered[8] ^= 0x40  # inside `sender`: still decodes, but the MAC/signature is wrong
    t = wire.decode(bytes(tampered))
    assert not any(t.verify_mac(r, k) for r, k in v.mac_keys)
    assert not any(t.verify_sig(p) for p in v.sign_pubs)


@pytest.mark.parametrize("v", INVALID, ids=lambda v: v.name)
def test_invalid_vector(v: Vector) -> None:
    try:
        m = wire.decode(v.msg)
    except wire.WireError as e:
        assert e.name == v.error, str(e)
        return
    # Decoding succeeded: only an authentication failure is allowed to remain.
    assert v.error == "auth"
    assert v.mac_keys or v.sign_pubs
    assert not any(m.verify_mac(r, k) for r, k in v.mac_keys)
    assert not any(m.verify_sig(p) for p in v.sign_pubs)


def test_batch_digest_of_pre_prepare_matches_prepare() -> None:
    by_name = {v.name: wire.decode(v.msg) for v in VALID}
    pp = by_name["pre-prepare-batch-of-2"]
    prep = by_name["prepare"]
    fr = by_name["fetch-reply-batch"]
    assert isinstance(pp, wire.PrePrepare) and isinstance(prep, wire.Prepare)
    assert isinstance(fr, wire.FetchReply)
    assert pp.digest() == prep.digest == fr.digest
    assert wire.decode_batch(fr.data) == (pp.nd_time, pp.nd_seed, pp.requests)
    for raw in pp.requests:
        assert isinstance(wire.decode(raw), wire.Request)


def test_execution_vectors_agree_with_the_agreement_vectors() -> None:
    by_name = {v.name: wire.decode(v.msg) for v in VALID}
    pp = by_name["pre-prepare-batch-of-2"]
    ec = by_name["exec-commit"]
    null = by_name["exec-commit-null"]
    log = by_name["fetch-reply-log"]
    assert isinstance(pp, wire.PrePrepare) and isinstance(ec, wire.ExecCommit)
    assert isinstance(null, wire.ExecCommit) and isinstance(log, wire.FetchReply)
    # An EXEC-COMMIT carries the PRE-PREPARE's batch encoding under the same digest.
    assert ec.batch == pp.batch() and ec.digest == pp.digest()
    assert null.digest == wire.NULL_DIGEST and null.batch == b""
    # FETCH-REPLY kind 3 lists exactly what the EXEC-COMMITs pushed.
    assert log.kind == wire.FETCH_LOG
    assert wire.log_reply(log.data) == (1, [(1, ec.digest, ec.batch), (2, null.digest, b"")])
    empty = by_name["fetch-reply-log-empty"]
    assert isinstance(empty, wire.FetchReply) and wire.log_reply(empty.data) == (0, [])
    rep = by_name["exec-report"]
    assert isinstance(rep, wire.ExecReport)
    # The first request of the batch echoes its op; recompute the digest from the requests.
    reqs = [wire.decode(raw) for raw in pp.requests]
    assert all(isinstance(q, wire.Request) for q in reqs)
    refs = [
        wire.reply_ref(reqs[0].sender, reqs[0].timestamp, b"hello"),
        wire.reply_ref(reqs[1].sender, reqs[1].timestamp, b""),
    ]
    assert rep.replies == refs and rep.reply_digest == wire.reply_digest(refs)
    assert rep.digest_ok()
    assert by_name["exec-checkpoint"].sender == wire.exec_principal(1)
    # A REPLY-AFFIRM vouches for the same result digest the report lists.
    aff = by_name["reply-affirm"]
    assert isinstance(aff, wire.ReplyAffirm)
    assert (aff.client, aff.timestamp, aff.result_digest) == tuple(refs[0])


def test_wakeup_vector_carries_verifiable_evidence() -> None:
    by_name = {v.name: wire.decode(v.msg) for v in VALID}
    wk = by_name["wakeup"]
    assert isinstance(wk, wire.Wakeup)
    assert len(wk.evidence) == 2
    for raw in wk.evidence:
        fs = wire.decode(raw)
        assert isinstance(fs, wire.FaultStatement) and fs.seq == wk.seq
        assert fs.service == wk.service
        assert fs.verify_sig(gen.sign_key(fs.sender).public)
    first = wire.decode(wk.evidence[0])
    assert first == by_name["fault-statement-mismatch"]
    sd = by_name["shutdown"]
    assert isinstance(sd, wire.Shutdown) and sd.seq == wk.seq
