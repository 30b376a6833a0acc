# tests/test_wire.py - unit tests of zz.wire beyond the shared vectors: round trips,
# framing bounds, authenticator semantics, principals and the checkpoint state encoding.
from __future__ import annotations

import asyncio
import os

import pytest

from zz import wire
from zz.crypto import NULL_DIGEST, SigningKey, sha256

D = sha256(b"d")
K = {0: os.urandom(32), 1: os.urandom(32), 2: os.urandom(32), 3: os.urandom(32)}
SK = SigningKey(sha256(b"seed"))

SAMPLES: list[wire.Message] = [
    wire.Request(5, 65537, 2**64 - 1, 1, b"\x00" * 300),
    wire.Reply(5, 3, 2**32 - 1, 1, 65537, 0, b""),
    wire.PrePrepare(5, 0, 1, 2, 3, 4, [b"a", b"", b"c" * 70]),
    wire.Prepare(5, 1, 0, 9, D),
    wire.Commit(5, 2, 0, 9, D),
    wire.Checkpoint(5, 3, 128, D),
    wire.ViewChange(5, 1, 2, 128, [b"cp"], [wire.Entry(129, 1, D)], []),
    wire.NewView(5, 2, 2, [b"vc1", b"vc2"], 128, [wire.Choice(129, NULL_DIGEST)]),
    wire.Fetch(5, 65537, 2, 128, D),
    wire.FetchReply(5, 1, 3, 0, NULL_DIGEST, b"log"),
    wire.Status(5, 3, 1, 2, 3),
    wire.ExecCommit(5, 2, 7, 9, D, b"batch"),
    wire.ExecCommit(5, 2, 7, 10, NULL_DIGEST, b""),
    wire.ExecReport.of(5, 257, 9, [wire.ReplyRef(65537, 3, D), wire.ReplyRef(65538, 1, D)]),
    wire.ExecReport.of(5, 257, 10, []),
    wire.ExecCheckpoint(5, 258, 128, D),
    wire.FaultStatement(
        5, 1, 9, [wire.RowEntry(0, wire.ROW_ONTIME, D), wire.RowEntry(1, 0, NULL_DIGEST)]
    ),
    wire.Wakeup(5, 1, 9, [b"fs1", b"fs2"], [2, 3], [2]),
    wire.Shutdown(5, 2, 9, [0, 1, 2], [1], [], [0, 2]),
    wire.ReplyAffirm(5, 3, 2**64 - 1, 65537, D),
    wire.Control(0, wire.operator_principal(0), 1, b"{}"),
    wire.ControlReply(0, wire.host_principal(2), 1, b""),
    wire.SpareReady(5, wire.host_principal(2), 2**32 - 1, 2**64 - 1),
]


def authenticate(m: wire.Message) -> wire.Message:
    return m.with_macs(K) if m.AUTH == wire.AUTH_MAC else m.signed(SK)


@pytest.mark.parametrize("m", SAMPLES, ids=lambda m: m.NAME)
def test_round_trip(m: wire.Message) -> None:
    a = authenticate(m)
    raw = a.encode()
    d = wire.decode(raw)
    assert d == a
    assert d.encode() == raw
    assert type(d).TYPE == raw[3]
    if m.AUTH == wire.AUTH_MAC:
        assert all(d.verify_mac(r, k) for r, k in K.items())
        assert not d.verify_mac(0, K[1])
    else:
        assert d.verify_sig(SK.public)


@pytest.mark.parametrize("m", [m for m in SAMPLES if m.AUTH == wire.AUTH_MAC], ids=lambda m: m.NAME)
def test_a_mac_checked_over_the_received_bytes_agrees_with_one_over_the_encoding(
    m: wire.Message,
) -> None:
    """verify_mac_received (the runtime's, for 4 MiB FETCH-REPLYs) MACs the frame as it
    came instead of encoding the message again: the same answer for every receiver and
    key, and a flipped bit anywhere before the authenticator that still decodes fails."""
    raw = authenticate(m).encode()
    d = wire.decode(raw)
    for r, k in K.items():
        assert d.verify_mac_received(raw, r, k) and not d.verify_mac_received(
            raw, r, K[(r + 1) % 4]
        )
    assert not d.verify_mac_received(raw, 7, K[0])  # no entry for this receiver
    end = len(raw) - len(d.auth)
    for i in range(0, end, max(1, end // 40)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        try:
            t = wire.decode(bytes(bad))
        except wire.WireError:
            continue
        assert not any(t.verify_mac_received(bytes(bad), r, k) for r, k in K.items())
        assert not any(t.verify_mac(r, k) for r, k in K.items())


@pytest.mark.parametrize("m", SAMPLES, ids=lambda m: m.NAME)
def test_every_truncation_is_rejected(m: wire.Message) -> None:
    raw = authenticate(m).encode()
    for cut in range(len(raw)):
        with pytest.raises(wire.WireError):
            wire.decode(raw[:cut])


def test_trailing_bytes_after_mac_vector_are_an_auth_error() -> None:
    raw = wire.Status(1, 0, 0, 0, 0).with_macs({1: K[1]}).encode()
    with pytest.raises(wire.WireError) as e:
        wire.decode(raw + b"\x00")
    assert e.value.name == "auth"


def test_first_entry_for_receiver_decides() -> None:
    m = wire.Status(1, 0, 0, 0, 0)
    good = m.with_macs({1: K[1]})
    bad = m.with_macs({1: K[2]})
    # Hand-build a vector [bad entry for 1, good entry for 1]: the first must be used.
    entries = bad.auth[2:] + good.auth[2:]
    both = wire.decode(m.authed() + (2).to_bytes(2, "big") + entries)
    assert both.mac_entries()[0][0] == both.mac_entries()[1][0] == 1
    assert not both.verify_mac(1, K[1])


def test_encoder_rejects_out_of_range_values() -> None:
    with pytest.raises(ValueError):
        wire.Status(70000, 0, 0, 0, 0).encode()
    with pytest.raises(ValueError):
        wire.Prepare(1, 0, 0, 0, b"short digest").encode()
    with pytest.raises(ValueError):
        wire.Checkpoint(1, 0, 0, D).with_macs(K)
    with pytest.raises(ValueError):
        wire.Status(1, 0, 0, 0, 0).signed(SK)
    with pytest.raises(ValueError):
        wire.SpareReady(1, wire.host_principal(0), 2**32, 0).signed(SK)
    with pytest.raises(ValueError):
        wire.SpareReady(1, wire.host_principal(0), 0, 0).with_macs(K)


def test_principals() -> None:
    assert wire.agreement_principal(3) == 3
    assert wire.exec_principal(2) == 258
    assert wire.client_principal(5) == 65541
    assert wire.host_principal(1) == 16777217
    assert wire.principal_kind(258) == ("exec", 2)
    assert wire.principal_kind(65541) == ("client", 5)
    assert wire.principal_kind(16777217) == ("host", 1)
    with pytest.raises(ValueError):
        wire.agreement_principal(256)


def test_state_encoding_sorted_and_strict() -> None:
    entries = [wire.ClientEntry(65540, 9, b"x"), wire.ClientEntry(65536, 3, b"")]
    enc = wire.state_encoding(64, D, entries)
    seq, app, got = wire.decode_state(enc)
    assert (seq, app) == (64, D)
    assert [e.client for e in got] == [65536, 65540]
    with pytest.raises(wire.WireError) as e:
        wire.decode_state(enc + b"\x00")
    assert e.value.name == "length"
    # Swap the two entries: a state encoding must be sorted by client id.
    first = 4 + 8 + 4 + 0  # client, timestamp, result length, empty result
    head = enc[: 8 + 32 + 4]
    body = enc[8 + 32 + 4 :]
    with pytest.raises(wire.WireError) as e:
        wire.decode_state(head + body[first:] + body[:first])
    assert e.value.name == "field"


def test_batch_digest_ignores_view() -> None:
    a = wire.PrePrepare(1, 0, 0, 5, 10, 11, [b"r"])
    b = wire.PrePrepare(1, 1, 7, 5, 10, 11, [b"r"])
    assert a.digest() == b.digest() == wire.batch_digest(10, 11, [b"r"])
    assert a.digest() != wire.batch_digest(10, 12, [b"r"])


async def _read(data: bytes) -> list[bytes]:
    r = asyncio.StreamReader()
    r.feed_data(data)
    r.feed_eof()
    out = []
    while True:
        try:
            out.append(await wire.read_frame(r))
        except asyncio.IncompleteReadError:
            return out


async def test_frames_round_trip_and_bounds() -> None:
    m1 = wire.Status(1, 0, 1, 2, 3).with_macs(K).encode()
    m2 = wire.Prepare(1, 0, 0, 9, D).with_macs({1: K[1]}).encode()
    assert await _read(wire.frame(m1) + wire.frame(m2)) == [m1, m2]
    with pytest.raises(wire.FrameError):
        await _read((15).to_bytes(4, "big") + b"x" * 15)
    with pytest.raises(wire.FrameError):
        await _read((wire.MAX_MSG + 1).to_bytes(4, "big"))
    # A frame cut by EOF is not returned half-read.
    assert await _read(wire.frame(m1)[:-1]) == []
    with pytest.raises(ValueError):
        wire.frame(b"tiny")


# ---- execution helpers ------------------------------------------------------------


def test_reply_digest_layout_and_order() -> None:
    a, b = wire.reply_ref(65536, 5, b"r1"), wire.reply_ref(65537, 6, b"")
    assert a.result_digest == sha256(b"r1")
    want = sha256(
        (65536).to_bytes(4, "big")
        + (5).to_bytes(8, "big")
        + sha256(b"r1")
        + (65537).to_bytes(4, "big")
        + (6).to_bytes(8, "big")
        + sha256(b"")
    )
    assert wire.reply_digest([a, b]) == want
    assert wire.reply_digest([b, a]) != want  # batch order matters
    assert wire.reply_digest([]) == sha256(b"")
    # Results are hashed one by one: moving a byte between results changes the digest.
    assert wire.reply_digest(
        [wire.reply_ref(1, 1, b"ab"), wire.reply_ref(1, 2, b"")]
    ) != wire.reply_digest([wire.reply_ref(1, 1, b"a"), wire.reply_ref(1, 2, b"b")])


def test_exec_report_digest_must_hash_its_list() -> None:
    refs = [wire.reply_ref(65536, 5, b"r1")]
    good = wire.ExecReport.of(1, 256, 3, refs)
    assert good.digest_ok()
    # A report whose digest is for other results still decodes (the codec has no opinion)
    # but fails the receiver's check.
    bad = wire.ExecReport(1, 256, 3, good.reply_digest, [wire.reply_ref(65536, 5, b"r2")])
    assert wire.decode(bad.with_macs(K).encode()) == bad.with_macs(K)
    assert not bad.digest_ok()
    assert not wire.ExecReport(1, 256, 3, good.reply_digest, []).digest_ok()


@pytest.mark.parametrize(
    ("state", "digest"),
    [(3, D), (0, D), (wire.ROW_ONTIME, NULL_DIGEST), (wire.ROW_LATE, NULL_DIGEST)],
)
def test_fault_statement_row_domains(state: int, digest: bytes) -> None:
    m = wire.FaultStatement(1, 0, 7, [wire.RowEntry(0, state, digest)]).signed(SK)
    with pytest.raises(wire.WireError) as ei:
        wire.decode(m.encode())
    assert ei.value.name == "field"


def test_operator_principals() -> None:
    assert wire.operator_principal(3) == 33554435
    assert wire.principal_kind(33554435) == ("operator", 3)
    assert wire.principal_kind(wire.host_principal(7)) == ("host", 7)


def _log() -> list[tuple[int, bytes, bytes]]:
    b1 = wire.batch_encoding(1, 2, [b"req"])
    b3 = wire.batch_encoding(3, 4, [])
    return [(5, sha256(b1), b1), (6, NULL_DIGEST, b""), (9, sha256(b3), b3)]


def test_log_entries_round_trip_and_truncation() -> None:
    entries = _log()
    data = wire.log_encoding(entries, certified_through=entries[0][0])
    assert wire.log_reply(data) == (entries[0][0], entries)
    assert wire.log_entries(data) == entries
    assert wire.log_reply(wire.log_encoding([])) == (0, [])
    for cut in range(len(data)):
        with pytest.raises(wire.WireError) as ei:
            wire.log_entries(data[:cut])
        assert ei.value.name == "short"
    with pytest.raises(wire.WireError) as ei:
        wire.log_entries(data + b"\x00")
    assert ei.value.name == "length"
    with pytest.raises(wire.WireError) as ei:
        wire.log_entries(bytes(8) + (65537).to_bytes(4, "big"))
    assert ei.value.name == "length"


@pytest.mark.parametrize(
    "bad",
    [
        "out-of-order",
        "duplicate-seq",
        "null-with-batch",
        "digest-mismatch",
    ],
)
def test_log_entries_rejects_what_no_correct_replica_sends(bad: str) -> None:
    e = _log()
    if bad == "out-of-order":
        e = [e[1], e[0], e[2]]
    elif bad == "duplicate-seq":
        e = [e[0], (5, e[1][1], e[1][2]), e[2]]
    elif bad == "null-with-batch":
        e[1] = (6, NULL_DIGEST, e[0][2])
    else:
        e[2] = (9, e[0][1], e[2][2])
    with pytest.raises(wire.WireError) as ei:
        wire.log_entries(wire.log_encoding(e))
    assert ei.value.name == "field"


def test_exec_messages_only_accept_their_auth_kind() -> None:
    ec = wire.ExecCommit(1, 0, 0, 1, D, b"x")
    with pytest.raises(ValueError):
        ec.signed(SK)
    ecp = wire.ExecCheckpoint(1, 256, 128, D)
    with pytest.raises(ValueError):
        ecp.with_macs(K)
    with pytest.raises(ValueError):
        wire.ExecReport(1, 256, 1, b"short", []).encode()
