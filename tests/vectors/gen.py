# tests/vectors/gen.py - deterministic generator of tests/vectors/wire.txt (docs/wire.md).
# Keys and values are fixed so the file is reproducible; both codecs are checked against it.
from __future__ import annotations

import argparse
import struct
import sys
from collections.abc import Callable
from pathlib import Path

from zz import keys, wire
from zz.crypto import NULL_DIGEST, SigningKey, sha256

SVC = 1
OUT = Path(__file__).with_name("wire.txt")


def mac_key(a: int, b: int) -> bytes:
    """Pairwise vector key; symmetric like the rack keys (K(a,b) = K(b,a))."""
    lo, hi = min(a, b), max(a, b)
    return sha256(b"zz-vector-mac:%d:%d" % (lo, hi))


def sign_key(p: int) -> SigningKey:
    return SigningKey(sha256(b"zz-vector-sign:%d" % p))


def macs(sender: int, receivers: list[int]) -> dict[int, bytes]:
    return {r: mac_key(sender, r) for r in receivers}


class Block:
    def __init__(self, name: str, msg: bytes) -> None:
        self.name = name
        self.msg = msg
        self.dump: str | None = None
        self.error: str | None = None
        self.mac_keys: list[tuple[int, bytes]] = []
        self.sign_pub: bytes | None = None

    def render(self) -> str:
        lines = [f"[{self.name}]", f"msg = {self.msg.hex()}"]
        if self.dump is not None:
            lines.append(f"dump = {self.dump}")
        if self.error is not None:
            lines.append(f"error = {self.error}")
        lines += [f"mac_key = {r}:{k.hex()}" for r, k in self.mac_keys]
        if self.sign_pub is not None:
            lines.append(f"sign_pub = {self.sign_pub.hex()}")
        return "\n".join(lines) + "\n"


def valid(name: str, m: wire.Message, receivers: list[int] | None = None) -> Block:
    """A valid vector; MAC messages get entries for `receivers`, signed ones a signature."""
    if m.AUTH == wire.AUTH_MAC:
        assert receivers is not None
        m = m.with_macs(macs(m.sender, receivers))
    elif m.AUTH == wire.AUTH_SIG:
        m = m.signed(sign_key(m.sender))
    elif m.AUTH == wire.AUTH_MAC_SIG and not m.auth:
        assert receivers is not None and isinstance(m, wire.Request)
        m = m.signed_with_macs(macs(m.sender, receivers), sign_key(m.sender))
    b = Block(name, m.encode())
    b.dump = m.dump()
    if m.AUTH in (wire.AUTH_MAC, wire.AUTH_MAC_SIG):
        b.mac_keys = [(r, mac_key(m.sender, r)) for r in (receivers or [])]
    if m.AUTH in (wire.AUTH_SIG, wire.AUTH_MAC_SIG):
        b.sign_pub = sign_key(m.sender).public
    return b


def invalid(name: str, msg: bytes, error: str) -> Block:
    b = Block(name, msg)
    b.error = error
    return b


def patch(msg: bytes, off: int, value: bytes) -> bytes:
    return msg[:off] + value + msg[off + len(value) :]


def raw_msg(mtype: int, auth_kind: int, sender: int, body: bytes, auth: bytes) -> bytes:
    """Hand-built message, for bodies the typed encoder refuses to produce."""
    hdr = struct.pack(">2sBBBBHII", b"ZZ", 1, mtype, auth_kind, 0, SVC, sender, len(body))
    return hdr + body + auth


def mac_auth(sender: int, authed: bytes, receivers: list[int]) -> bytes:
    from zz.crypto import hmac_sha256

    out = struct.pack(">H", len(receivers))
    for r in receivers:
        out += struct.pack(">I", r) + hmac_sha256(mac_key(sender, r), authed)
    return out


def with_raw_macs(mtype: int, sender: int, body: bytes, receivers: list[int]) -> bytes:
    authed = raw_msg(mtype, wire.AUTH_MAC, sender, body, b"")
    return authed + mac_auth(sender, authed, receivers)


def generate() -> str:
    replicas = [0, 1, 2, 3]
    c0 = wire.client_principal(0)
    c3 = wire.client_principal(3)
    e1 = wire.exec_principal(1)
    blocks: list[Block] = []
    add: Callable[[Block], None] = blocks.append

    # -- valid vectors, one or more per type
    req_a = wire.Request(SVC, c0, 1700000000000000001, 0, b"hello").with_macs(macs(c0, replicas))
    req_b = wire.Request(SVC, c3, 1700000000000000777, 0, b"put k v").with_macs(macs(c3, replicas))
    add(valid("request", wire.Request(SVC, c0, 1700000000000000001, 0, b"hello"), replicas))
    add(valid("request-read-only", wire.Request(SVC, c3, 42, 1, b"get k"), replicas))
    add(valid("request-ordered-read", wire.Request(SVC, c3, 43, 2, b"get k"), replicas))
    add(valid("request-empty-op", wire.Request(SVC, c0, 7, 0, b""), [0]))
    # A client's signed retransmission (auth kind 3): MAC vector, then the signature.
    req_s = wire.Request(SVC, c3, 1700000000000000778, 0, b"put k w")
    add(valid("request-signed", req_s.signed_with_macs({}, sign_key(c3)), []))
    add(valid("request-signed-with-macs", req_s, replicas))
    add(
        valid(
            "reply",
            wire.Reply(SVC, 2, 1, 1700000000000000001, c0, 0, b"hello"),
            [c0],
        )
    )
    add(valid("reply-read-only", wire.Reply(SVC, 3, 0, 42, c3, 1, b"v"), [c3]))
    add(valid("reply-from-exec", wire.Reply(SVC, e1, 4, 9, c3, 0, b""), [c3]))
    # A request over the size limit, refused unordered: reason 1, limit 1 MiB.
    rejected = wire.Reply(SVC, 1, 0, 44, c3, 2, b"\x01\x00\x10\x00\x00")
    add(valid("reply-rejected", rejected, [c3]))

    t, seed = 1700000000123, 0x0123456789ABCDEF
    pp = wire.PrePrepare(SVC, 0, 0, 1, t, seed, [req_a.encode(), req_b.encode()])
    d1 = pp.digest()
    add(valid("pre-prepare-batch-of-2", pp, [1, 2, 3]))
    signed_b = req_s.signed_with_macs(macs(c3, replicas), sign_key(c3)).encode()
    pp_s = wire.PrePrepare(SVC, 0, 0, 2, t, seed, [req_a.encode(), signed_b])
    add(valid("pre-prepare-signed-request", pp_s, [1, 2, 3]))
    pp_empty = wire.PrePrepare(SVC, 1, 1, 130, t + 5, 7, [])
    d2 = pp_empty.digest()
    add(valid("pre-prepare-empty-batch", pp_empty, [0, 2, 3]))
    add(valid("prepare", wire.Prepare(SVC, 1, 0, 1, d1), [0, 2, 3]))
    add(valid("commit", wire.Commit(SVC, 2, 0, 1, d1), [0, 1, 3]))

    state = wire.state_encoding(
        128,
        sha256(b"echo state"),
        [
            wire.ClientEntry(c3, 1700000000000000777, b"ok"),
            wire.ClientEntry(c0, 1700000000000000001, b"hello"),
        ],
    )
    sd = sha256(state)
    cps = [wire.Checkpoint(SVC, r, 128, sd).signed(sign_key(r)).encode() for r in (0, 1, 2)]
    add(valid("checkpoint", wire.Checkpoint(SVC, 3, 128, sd)))

    add(valid("view-change-empty", wire.ViewChange(SVC, 2, 1, 0, [], [], [])))
    d3 = sha256(b"batch 131")
    E = wire.Entry
    # Three view changes for view 1 that make the C&L choice: 129 -> d1 (prepared
    # everywhere), 130 -> null (prepared nowhere), 131 -> d3 (g+1 pre-prepared it).
    vc0 = wire.ViewChange(
        SVC, 0, 1, 128, cps, [E(129, 0, d1), E(131, 0, d3)], [E(129, 0, d1), E(131, 0, d3)]
    )
    vc2 = wire.ViewChange(SVC, 2, 1, 128, cps, [E(129, 0, d1)], [E(129, 0, d1), E(131, 0, d3)])
    vc3 = wire.ViewChange(SVC, 3, 1, 128, cps, [E(129, 0, d1)], [E(129, 0, d1)])
    add(valid("view-change-proof-p-q", vc0))
    vcs = [v.signed(sign_key(v.sender)).encode() for v in (vc0, vc2, vc3)]
    C = wire.Choice
    nv = wire.NewView(SVC, 1, 1, vcs, 128, [C(129, d1), C(130, NULL_DIGEST), C(131, d3)])
    add(valid("new-view", nv))

    add(valid("fetch-batch", wire.Fetch(SVC, c0, 1, 1, d1), [2]))
    add(valid("fetch-log", wire.Fetch(SVC, 3, 3, 128, NULL_DIGEST), [0]))
    add(valid("fetch-reply-batch", wire.FetchReply(SVC, 2, 1, 1, d1, pp.batch()), [c0]))
    add(valid("fetch-reply-state", wire.FetchReply(SVC, 1, 2, 128, sd, state), [3]))
    add(valid("fetch-reply-empty-data", wire.FetchReply(SVC, 1, 2, 0, d2, b""), [3]))
    add(valid("status", wire.Status(SVC, 3, 2, 1000, 896), [0, 1, 2]))

    # -- execution messages: agreement replica 2 pushes batch 1 (and a null request at
    # 2) to execution replica 1, which reports the echo replies and signs a checkpoint.
    # It vouches for batch 1's execution certificate, not for 2 (docs/wire.md).
    log = wire.log_encoding([(1, d1, pp.batch()), (2, NULL_DIGEST, b"")], certified_through=1)
    add(valid("fetch-reply-log", wire.FetchReply(SVC, 2, 3, 128, sd, log), [e1]))
    add(
        valid(
            "fetch-reply-log-empty",
            wire.FetchReply(SVC, 0, 3, 0, NULL_DIGEST, wire.log_encoding([])),
            [e1],
        )
    )
    add(valid("exec-commit", wire.ExecCommit(SVC, 2, 0, 1, d1, pp.batch()), [e1]))
    add(valid("exec-commit-null", wire.ExecCommit(SVC, 3, 1, 2, NULL_DIGEST, b""), [e1]))
    refs = [
        wire.reply_ref(c0, 1700000000000000001, b"hello"),
        wire.reply_ref(c3, 1700000000000000777, b""),
    ]
    rd = wire.reply_digest(refs)
    add(valid("exec-report", wire.ExecReport.of(SVC, e1, 1, refs), replicas))
    add(valid("exec-report-empty-batch", wire.ExecReport.of(SVC, e1, 2, []), [0]))
    ckpt = sha256(b"manifest at 128")
    add(valid("exec-checkpoint", wire.ExecCheckpoint(SVC, e1, 128, ckpt)))

    # -- fault detection (docs/fault-detection.md scenario w1): at seq 7 execution replicas
    # 0 and 1 are awake, 2 sleeps; 1 answered differently. Agreement replicas 0 and 1 sign
    # their rows, 0 wakes replica 2 with both as evidence and later signs the SHUTDOWN.
    da, db = sha256(b"reply digest a"), sha256(b"reply digest b")
    R = wire.RowEntry
    row_ab = [R(0, wire.ROW_ONTIME, da), R(1, wire.ROW_ONTIME, db)]
    fs0 = wire.FaultStatement(SVC, 0, 7, row_ab)
    fs1 = wire.FaultStatement(SVC, 1, 7, row_ab)
    add(valid("fault-statement-mismatch", fs0))
    late_none = [
        R(0, wire.ROW_ONTIME, da),
        R(1, wire.ROW_LATE, da),
        R(2, wire.ROW_NONE, NULL_DIGEST),
    ]
    add(valid("fault-statement-late-and-none", wire.FaultStatement(SVC, 3, 9, late_none)))
    evidence = [m.signed(sign_key(m.sender)).encode() for m in (fs0, fs1)]
    add(valid("wakeup", wire.Wakeup(SVC, 0, 7, evidence, [2], [2])))
    add(valid("wakeup-empty-lists", wire.Wakeup(SVC, 2, 8, [], [], [])))
    add(valid("shutdown", wire.Shutdown(SVC, 0, 7, [0, 1], [1], [], [0, 2])))
    add(valid("shutdown-sleep", wire.Shutdown(SVC, 3, 9, [0, 1, 2], [0], [4], [1, 2])))
    add(
        valid(
            "reply-affirm",
            wire.ReplyAffirm(SVC, 2, 1700000000000000001, c0, sha256(b"hello")),
            [c0],
        )
    )
    op0 = wire.operator_principal(0)
    h1 = wire.host_principal(1)
    ctl = wire.Control(0, op0, 5, b'{"op": "status"}')
    add(valid("control", ctl, [h1]))
    add(valid("control-reply", wire.ControlReply(0, h1, 5, b'{"ok": true}'), [op0]))
    add(valid("control-empty-json", wire.Control(0, op0, 6, b""), [h1]))
    e2 = wire.exec_principal(2)
    chal = bytes(range(0xA0, 0xB0))  # a server's challenge (16 bytes)
    ff = wire.FileFetch(SVC, e2, 8, b"kv/6b31", 4194304, 4194304, e1, chal)
    add(valid("file-fetch", ff))
    # the file named by its certified hash too: any copy that hashes to it may be served
    ffh = wire.FileFetch(SVC, e2, 8, b"kv/6b31", 0, 4194304, e1, chal, sha256(b"value"))
    add(valid("file-fetch-by-hash", ffh))
    # the first request on a connection: no challenge yet; addressed to controld of host 1
    ff0 = wire.FileFetch(SVC, e2, 8, b"", 0, 1024, wire.host_principal(1))
    add(valid("file-fetch-manifest-unchallenged", ff0))
    add(valid("file-data-challenge", wire.FileData(SVC, e1, 8, b"", 0, 6, 0, chal)))
    add(valid("file-data", wire.FileData(SVC, e1, 8, b"kv/6b31", 3, 0, 7, b"lue")))
    add(valid("file-data-no-file", wire.FileData(SVC, e1, 8, b"nope", 0, 2, 0, b"")))
    add(valid("file-data-later", wire.FileData(SVC, e1, 8, b"kv/6b31", 0, 5, 5, b"value")))
    add(valid("file-data-copy", wire.FileData(SVC, e1, 8, b"kv/6b31", 0, 7, 5, b"value")))
    # controld of host 1 announces the fresh spare under index 1 after the SHUTDOWN at seq 7,
    # with its new key pair (epoch 2: the slot's second fresh incarnation)
    new_x1 = sign_key(wire.exec_principal(1) + 1000)
    spare = wire.SpareReady(SVC, h1, 1, 7, 2, new_x1.public, keys.dh_public(new_x1))
    add(valid("spare-ready", spare))
    add(valid("spare-ready-first", wire.SpareReady(SVC, wire.host_principal(0), 2, 0)))

    # -- invalid vectors: each breaks exactly one rule of an otherwise valid message
    prep = wire.Prepare(SVC, 1, 0, 1, d1).with_macs(macs(1, [0, 2, 3])).encode()
    status = wire.Status(SVC, 3, 2, 1000, 896).with_macs(macs(3, [0])).encode()
    cp = wire.Checkpoint(SVC, 3, 128, sd).signed(sign_key(3)).encode()
    reqm = req_a.encode()

    add(invalid("short-header", prep[:10], "short"))
    add(invalid("short-body", prep[:36], "short"))
    add(
        invalid(
            "short-bytes-field",
            with_raw_macs(1, c0, struct.pack(">QBI", 5, 0, 100) + b"abc", [0]),
            "short",
        )
    )
    add(
        invalid(
            "short-list-items",
            with_raw_macs(
                3,
                0,
                struct.pack(">IQQQI", 0, 1, t, seed, 2) + struct.pack(">I", 2) + b"ab",
                [1],
            ),
            "short",
        )
    )
    add(invalid("magic", patch(prep, 0, b"\x59"), "magic"))
    add(invalid("version", patch(prep, 2, b"\x02"), "version"))
    add(invalid("version-zero", patch(prep, 2, b"\x00"), "version"))
    add(invalid("type-unknown", patch(status, 3, b"\x0c"), "type"))
    add(invalid("type-zero", patch(status, 3, b"\x00"), "type"))
    add(invalid("type-reserved-25", patch(status, 3, b"\x19"), "type"))
    add(invalid("type-reserved-31", patch(status, 3, b"\x1f"), "type"))
    # Well-formed authenticators of the wrong kind: only the kind/type pairing is wrong.
    cp_body = struct.pack(">Q", 128) + sd
    add(invalid("type-checkpoint-with-mac", with_raw_macs(6, 3, cp_body, [0]), "type"))
    req_body = struct.pack(">QBI", 9, 0, 2) + b"op"
    signed_req = raw_msg(1, wire.AUTH_SIG, c0, req_body, b"")
    signed_req += sign_key(c0).sign(signed_req)
    add(invalid("type-request-with-signature", signed_req, "type"))
    add(invalid("type-request-with-no-auth", raw_msg(1, wire.AUTH_NONE, c0, req_body, b""), "type"))
    # Signed requests (auth kind 3): a wrong signature decodes but must not verify; a kind-3
    # authenticator without its signature is malformed; no other type admits kind 3.
    bad_sig = bytearray(req_s.signed_with_macs({}, sign_key(c3)).encode())
    bad_sig[-1] ^= 0x01
    blk = invalid("auth-request-signed-bad-signature", bytes(bad_sig), "auth")
    blk.sign_pub = sign_key(c3).public
    add(blk)
    no_sig = wire.Request(SVC, c3, 5, 0, b"x").with_macs(macs(c3, [0])).encode()
    add(invalid("auth-request-signed-without-signature", patch(no_sig, 4, b"\x03"), "auth"))
    reply_ms = wire.Reply(SVC, 1, 0, 44, c3, 0, b"r").with_macs(macs(1, [c3])).encode()
    reply_ms = patch(reply_ms, 4, b"\x03") + bytes(64)
    add(invalid("type-reply-with-mac-and-signature", reply_ms, "type"))
    add(invalid("type-auth-kind-3", patch(status, 4, b"\x03"), "type"))

    # Execution messages: each with a well-formed authenticator of the wrong kind.
    ec_body = struct.pack(">IQ", 0, 1) + d1 + struct.pack(">I", 2) + b"ab"
    signed_ec = raw_msg(16, wire.AUTH_SIG, 2, ec_body, b"")
    signed_ec += sign_key(2).sign(signed_ec)
    add(invalid("type-exec-commit-with-signature", signed_ec, "type"))
    er_body = wire.ExecReport.of(SVC, e1, 1, refs).body()
    add(
        invalid(
            "type-exec-report-with-no-auth", raw_msg(17, wire.AUTH_NONE, e1, er_body, b""), "type"
        )
    )
    signed_er = raw_msg(17, wire.AUTH_SIG, e1, er_body, b"")
    signed_er += sign_key(e1).sign(signed_er)
    add(invalid("type-exec-report-with-signature", signed_er, "type"))
    ecp_body = struct.pack(">Q", 128) + ckpt
    add(invalid("type-exec-checkpoint-with-mac", with_raw_macs(18, e1, ecp_body, [0]), "type"))
    ec = wire.ExecCommit(SVC, 2, 0, 1, d1, pp.batch()).with_macs(macs(2, [e1])).encode()
    er = wire.ExecReport.of(SVC, e1, 1, refs).with_macs(macs(e1, replicas)).encode()
    ecp = wire.ExecCheckpoint(SVC, e1, 128, ckpt).signed(sign_key(e1)).encode()
    add(invalid("short-exec-commit-digest", ec[: 16 + 12 + 20], "short"))
    add(invalid("short-exec-commit-batch", ec[: 16 + 12 + 32 + 4 + 10], "short"))
    add(
        invalid(
            "short-exec-commit-batch-length",
            with_raw_macs(
                16, 2, struct.pack(">IQ", 0, 1) + d1 + struct.pack(">I", 9) + b"ab", [e1]
            ),
            "short",
        )
    )
    add(invalid("short-exec-report", er[: 16 + 8 + 31], "short"))
    add(invalid("short-exec-checkpoint", ecp[: 16 + 7], "short"))
    add(
        invalid(
            "length-trailing-exec-report",
            with_raw_macs(17, e1, er_body + b"\x00", [0]),
            "length",
        )
    )
    add(invalid("auth-exec-checkpoint-signature-short", ecp[:-1], "auth"))
    b = invalid("auth-exec-checkpoint-wrong-signer", ecp, "auth")
    b.sign_pub = sign_key(e1 + 1).public
    add(b)
    bad_ec = bytearray(ec)
    bad_ec[-1] ^= 0x01
    b = invalid("auth-exec-commit-bad-mac", bytes(bad_ec), "auth")
    b.mac_keys = [(e1, mac_key(2, e1))]
    add(b)

    # Fault detection and control: wrong auth kinds, field domains, truncations, limits.
    fs_body = fs0.body()
    add(invalid("type-fault-statement-with-mac", with_raw_macs(19, 0, fs_body, [1]), "type"))
    ff_body = wire.FileFetch(SVC, e2, 8, b"a", 0, 16, e1).body()
    add(
        invalid(
            "type-file-fetch-with-no-auth", raw_msg(25, wire.AUTH_NONE, e2, ff_body, b""), "type"
        )
    )
    fd_body = wire.FileData(SVC, e1, 8, b"a", 0, 0, 1, b"x").body()
    add(invalid("type-file-data-with-mac", with_raw_macs(26, e1, fd_body, [e2]), "type"))
    add(
        invalid("auth-file-data-with-bytes", raw_msg(26, wire.AUTH_NONE, e1, fd_body, b"x"), "auth")
    )

    def file_data_body(status: int, size: int, data: bytes) -> bytes:
        return (
            struct.pack(">QI", 8, 1)
            + b"a"
            + struct.pack(">QBQI", 0, status, size, len(data))
            + data
        )

    add(
        invalid(
            "field-file-data-status",
            raw_msg(26, wire.AUTH_NONE, e1, file_data_body(8, 0, b""), b""),
            "field",
        )
    )
    for name, size, data in (
        ("empty", 0, b""),
        ("short", 0, chal[:15]),
        ("long", 0, chal + b"x"),
        ("with-size", 16, chal),
    ):
        add(
            invalid(
                f"field-file-data-challenge-{name}",
                raw_msg(26, wire.AUTH_NONE, e1, file_data_body(6, size, data), b""),
                "field",
            )
        )
    add(
        invalid(
            "field-file-data-error-with-data",
            raw_msg(26, wire.AUTH_NONE, e1, file_data_body(2, 0, b"x"), b""),
            "field",
        )
    )

    def file_fetch_msg(length: int, challenge: bytes) -> bytes:
        body = struct.pack(">QI", 8, 1) + b"a" + struct.pack(">QI", 0, length)
        body += struct.pack(">II", e1, len(challenge)) + challenge + NULL_DIGEST
        m = raw_msg(25, wire.AUTH_SIG, e2, body, b"")
        return m + sign_key(e2).sign(m)

    add(invalid("field-file-fetch-length", file_fetch_msg(4194305, b""), "field"))
    add(invalid("field-file-fetch-challenge-short", file_fetch_msg(16, chal[:15]), "field"))
    add(invalid("field-file-fetch-challenge-long", file_fetch_msg(16, chal + b"x"), "field"))
    # the layout before the target and challenge: the body ends after `length`
    old = raw_msg(25, wire.AUTH_SIG, e2, ff_body[:-40], b"")
    add(invalid("short-file-fetch-without-target", old + sign_key(e2).sign(old), "short"))
    # the layout before the sha256: the body ends after the challenge
    old = raw_msg(25, wire.AUTH_SIG, e2, ff_body[:-32], b"")
    add(invalid("short-file-fetch-without-sha256", old + sign_key(e2).sign(old), "short"))
    add(
        invalid(
            "short-file-data",
            raw_msg(26, wire.AUTH_NONE, e1, file_data_body(0, 1, b"x")[:-1], b""),
            "short",
        )
    )
    sh_body = wire.Shutdown(SVC, 0, 7, [0, 1], [1], [], [0, 2]).body()
    add(invalid("type-shutdown-with-mac", with_raw_macs(21, 0, sh_body, [1]), "type"))
    ra_body = wire.ReplyAffirm(SVC, 2, 9, c0, da).body()
    signed_ra = raw_msg(22, wire.AUTH_SIG, 2, ra_body, b"")
    signed_ra += sign_key(2).sign(signed_ra)
    add(invalid("type-reply-affirm-with-signature", signed_ra, "type"))
    add(
        invalid(
            "type-control-with-no-auth", raw_msg(23, wire.AUTH_NONE, op0, ctl.body(), b""), "type"
        )
    )

    def signed_raw(mtype: int, sender: int, body: bytes) -> bytes:
        m = raw_msg(mtype, wire.AUTH_SIG, sender, body, b"")
        return m + sign_key(sender).sign(m)

    def row_body(entries: list[tuple[int, int, bytes]]) -> bytes:
        return struct.pack(">QI", 7, len(entries)) + b"".join(
            struct.pack(">IB", i, st) + d for i, st, d in entries
        )

    add(invalid("field-fault-statement-state", signed_raw(19, 0, row_body([(0, 3, da)])), "field"))
    add(
        invalid(
            "field-fault-statement-none-with-digest",
            signed_raw(19, 0, row_body([(0, 1, da), (1, 0, db)])),
            "field",
        )
    )
    add(
        invalid(
            "field-fault-statement-ontime-null-digest",
            signed_raw(19, 0, row_body([(0, 1, NULL_DIGEST)])),
            "field",
        )
    )
    add(
        invalid(
            "short-fault-statement-row", signed_raw(19, 0, row_body([(0, 1, da)])[:-1]), "short"
        )
    )
    wk_body = (
        struct.pack(">QI", 7, 0)
        + struct.pack(">II", 1, 2)
        + struct.pack(">I", 2)
        + b"\x00\x00\x00\x02"
    )
    add(invalid("short-wakeup-wake-list", signed_raw(20, 0, wk_body), "short"))
    add(invalid("length-trailing-shutdown", signed_raw(21, 0, sh_body + b"\x00"), "length"))
    sr_body = spare.body()
    add(invalid("type-spare-ready-with-mac", with_raw_macs(27, h1, sr_body, [0]), "type"))
    add(invalid("short-spare-ready", signed_raw(27, h1, sr_body[:-1]), "short"))
    add(invalid("length-trailing-spare-ready", signed_raw(27, h1, sr_body + b"\x00"), "length"))
    add(invalid("short-spare-ready-no-keys", signed_raw(27, h1, sr_body[:12]), "short"))
    add(invalid("short-spare-ready-half-dh-key", signed_raw(27, h1, sr_body[:-16]), "short"))
    sr_signed = spare.signed(sign_key(h1)).encode()
    b = invalid("auth-spare-ready-wrong-signer", sr_signed, "auth")
    b.sign_pub = sign_key(wire.host_principal(0)).public
    add(b)
    add(
        invalid(
            "length-shutdown-list-count",
            signed_raw(21, 0, struct.pack(">QI", 7, 65537)),
            "length",
        )
    )
    er_short = (
        struct.pack(">Q", 1) + rd + struct.pack(">I", 1) + struct.pack(">IQ", c0, 5) + da[:31]
    )
    add(invalid("short-exec-report-reply-ref", with_raw_macs(17, e1, er_short, [0]), "short"))
    wk = wire.Wakeup(SVC, 0, 7, evidence, [2], [2]).signed(sign_key(0)).encode()
    b = invalid("auth-wakeup-wrong-signer", wk, "auth")
    b.sign_pub = sign_key(1).public
    add(b)
    ctl_raw = ctl.with_macs(macs(op0, [h1])).encode()
    b = invalid("auth-control-wrong-key", ctl_raw, "auth")
    b.mac_keys = [(h1, mac_key(op0, h1 + 1))]
    add(b)

    add(
        invalid(
            "length-trailing-body",
            with_raw_macs(11, 3, struct.pack(">IQQ", 2, 1000, 896) + b"\x00", [0]),
            "length",
        )
    )
    add(
        invalid(
            "length-trailing-batch",
            with_raw_macs(3, 0, struct.pack(">IQQQI", 0, 1, t, seed, 0) + b"\xff\xff", [1]),
            "length",
        )
    )
    add(
        invalid(
            "length-list-count",
            raw_msg(7, wire.AUTH_SIG, 2, struct.pack(">IQI", 1, 0, 65537), b"\x00" * 64),
            "length",
        )
    )
    add(
        invalid(
            "length-mac-count",
            raw_msg(11, wire.AUTH_MAC, 3, struct.pack(">IQQ", 2, 1000, 896), b"\x04\x01"),
            "length",
        )
    )

    bad_mac = bytearray(reqm)
    bad_mac[-1] ^= 0x01  # last byte of the MAC for receiver 3
    b = invalid("auth-bad-mac", bytes(bad_mac), "auth")
    b.mac_keys = [(3, mac_key(c0, 3))]
    add(b)
    miss = wire.Request(SVC, c0, 11, 0, b"x").with_macs(macs(c0, [0, 2, 3])).encode()
    b = invalid("auth-no-entry-for-receiver", miss, "auth")
    b.mac_keys = [(1, mac_key(c0, 1))]
    add(b)
    bad_sig = bytearray(cp)
    bad_sig[-64] ^= 0x80
    b = invalid("auth-bad-signature", bytes(bad_sig), "auth")
    b.sign_pub = sign_key(3).public
    add(b)
    b = invalid("auth-wrong-signer", cp, "auth")
    b.sign_pub = sign_key(2).public
    add(b)
    add(invalid("auth-mac-vector-truncated", reqm[:-1], "auth"))
    add(invalid("auth-mac-vector-no-count", prep[: 16 + 44] + b"\x00", "auth"))
    add(invalid("auth-signature-short", cp[:-1], "auth"))
    add(invalid("auth-signature-missing", cp[:-64], "auth"))

    add(invalid("field-reserved", patch(prep, 5, b"\x01"), "field"))
    add(
        invalid(
            "field-request-flags",
            with_raw_macs(1, c0, struct.pack(">QBI", 5, 4, 0), [0]),
            "field",
        )
    )
    add(
        invalid(
            "field-request-flags-both-reads",
            with_raw_macs(1, c0, struct.pack(">QBI", 5, 3, 0), [0]),
            "field",
        )
    )
    add(
        invalid(
            "field-reply-flags-both",
            with_raw_macs(2, 1, struct.pack(">IQIBI", 0, 44, c3, 3, 1) + b"v", [c3]),
            "field",
        )
    )
    add(
        invalid(
            "field-reply-rejected-short",
            with_raw_macs(2, 1, struct.pack(">IQIBI", 0, 44, c3, 2, 1) + b"\x01", [c3]),
            "field",
        )
    )
    add(
        invalid(
            "field-fetch-kind",
            with_raw_macs(9, c0, struct.pack(">BQ", 4, 1) + d1, [2]),
            "field",
        )
    )

    names = [b.name for b in blocks]
    assert len(names) == len(set(names)), "duplicate vector names"
    return "\n".join(b.render() for b in blocks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Generate tests/vectors/wire.txt")
    ap.add_argument("--check", action="store_true", help="fail if the file is out of date")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    text = generate()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date; run {sys.argv[0]}", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
