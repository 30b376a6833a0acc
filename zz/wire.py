# zz/wire.py - the ZZ binary wire format (docs/wire.md): messages, authenticators, frames.
# Byte-for-byte twin of agreement/src/wire.c; both are held to tests/vectors/wire.txt.
from __future__ import annotations

import asyncio
import dataclasses
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, Self

from zz.crypto import (
    DIGEST_LEN,
    KEY_LEN,
    MAC_LEN,
    NULL_DIGEST,
    SIG_LEN,
    SigningKey,
    ct_equal,
    hmac_sha256,
    sha256,
    verify_signature,
)

MAGIC = b"ZZ"
VERSION = 1
HDR_LEN = 16
MAX_MSG = 16777216
MAX_LIST = 65536
MAX_MACS = 1024
MAC_ENTRY_LEN = 4 + MAC_LEN

AUTH_NONE = 0
AUTH_MAC = 1
AUTH_SIG = 2
# A MAC vector followed by the sender's signature, both over the authenticated bytes: only
# a REQUEST may carry it, a client's signed request (docs/wire.md "Signed requests").
AUTH_MAC_SIG = 3

FLAG_READONLY = 1  # REQUEST/REPLY: unordered read at the agreement replicas (PBFT)
FLAG_ORDERED_READ = 2  # REQUEST: ordered, run without write access (ZZ §4.7.2)
FLAG_REJECTED = 2  # REPLY: the request was refused unordered; result = u8 reason, u32 limit
REJECT_TOO_LARGE = 1  # REPLY rejected reason: the REQUEST is over the replicas' size limit
# Size limits (docs/wire.md "Size limits"): a batch of at most MAX_BATCH_BYTES fits every
# message that carries it (FETCH-REPLY kind 3 packs LOG_REPLY_SOFT bytes, then one more).
LOG_REPLY_SOFT = 4194304
MSG_OVERHEAD_MAX = 65536
MAX_BATCH_BYTES = MAX_MSG - LOG_REPLY_SOFT - MSG_OVERHEAD_MAX
BATCH_HDR_LEN = 20

FETCH_BATCH = 1
FETCH_STATE = 2
FETCH_LOG = 3

PRINCIPAL_EXEC = 256
PRINCIPAL_CLIENT = 65536
PRINCIPAL_HOST = 16777216
PRINCIPAL_OPERATOR = 33554432

# FAULT-STATEMENT row entry states.
ROW_NONE = 0
ROW_ONTIME = 1
ROW_LATE = 2

ERROR_NAMES = ("short", "magic", "version", "type", "length", "auth", "field")

_HDR = struct.Struct(">2sBBBBHII")


class WireError(Exception):
    """A malformed or unauthenticated message. `name` is one of ERROR_NAMES."""

    def __init__(self, name: str, detail: str = "") -> None:
        if name not in ERROR_NAMES:
            raise ValueError(f"unknown wire error name {name!r}")
        self.name = name
        self.detail = detail
        super().__init__(f"{name}: {detail}" if detail else name)


class FrameError(Exception):
    """A frame length outside 16..MAX_MSG: the stream cannot be resynchronised."""


# ---- principals -------------------------------------------------------------


def agreement_principal(r: int) -> int:
    if not 0 <= r < PRINCIPAL_EXEC:
        raise ValueError(f"agreement replica index {r} out of 0..255")
    return r


def exec_principal(i: int) -> int:
    if not 0 <= i < PRINCIPAL_CLIENT - PRINCIPAL_EXEC:
        raise ValueError(f"execution replica index {i} out of range")
    return PRINCIPAL_EXEC + i


def client_principal(c: int) -> int:
    if not 0 <= c < PRINCIPAL_HOST - PRINCIPAL_CLIENT:
        raise ValueError(f"client index {c} out of range")
    return PRINCIPAL_CLIENT + c


def host_principal(h: int) -> int:
    if not 0 <= h <= 0xFFFFFFFF - PRINCIPAL_HOST:
        raise ValueError(f"host index {h} out of range")
    return PRINCIPAL_HOST + h


def operator_principal(k: int) -> int:
    if not 0 <= k <= 0xFFFFFFFF - PRINCIPAL_OPERATOR:
        raise ValueError(f"operator index {k} out of range")
    return PRINCIPAL_OPERATOR + k


def principal_kind(pid: int) -> tuple[str, int]:
    """('agreement'|'exec'|'client'|'host'|'operator', index) for a principal id."""
    if pid < PRINCIPAL_EXEC:
        return "agreement", pid
    if pid < PRINCIPAL_CLIENT:
        return "exec", pid - PRINCIPAL_EXEC
    if pid < PRINCIPAL_HOST:
        return "client", pid - PRINCIPAL_CLIENT
    if pid < PRINCIPAL_OPERATOR:
        return "host", pid - PRINCIPAL_HOST
    return "operator", pid - PRINCIPAL_OPERATOR


# ---- primitive encoding -----------------------------------------------------


def _u8(v: int) -> bytes:
    return struct.pack(">B", v)


def _u16(v: int) -> bytes:
    return struct.pack(">H", v)


def _u32(v: int) -> bytes:
    return struct.pack(">I", v)


def _u64(v: int) -> bytes:
    return struct.pack(">Q", v)


def _bytes(v: bytes) -> bytes:
    if len(v) > MAX_MSG:
        raise ValueError("bytes field longer than ZZ_MAX_MSG")
    return _u32(len(v)) + v


def _digest(v: bytes) -> bytes:
    if len(v) != DIGEST_LEN:
        raise ValueError(f"digest must be {DIGEST_LEN} bytes, got {len(v)}")
    return v


def _blist(items: Sequence[bytes]) -> bytes:
    if len(items) > MAX_LIST:
        raise ValueError("list longer than ZZ_MAX_LIST")
    return _u32(len(items)) + b"".join(_bytes(i) for i in items)


class Entry(NamedTuple):
    """VIEW-CHANGE P/Q entry: 44 bytes on the wire."""

    seq: int
    view: int
    digest: bytes


class Choice(NamedTuple):
    """NEW-VIEW choice: 40 bytes on the wire; a null digest means a null request."""

    seq: int
    digest: bytes


class RowEntry(NamedTuple):
    """FAULT-STATEMENT row entry: 37 bytes on the wire. `state` is ROW_NONE (digest
    null), ROW_ONTIME or ROW_LATE."""

    replica: int
    state: int
    digest: bytes


class ReplyRef(NamedTuple):
    """EXEC-REPORT reply_ref: 44 bytes on the wire; `result_digest` = SHA-256(result)."""

    client: int
    timestamp: int
    result_digest: bytes


# The reply_ref of an EXEC-REPORT for a checkpoint seq that carries the replica's execution
# checkpoint digest (docs/wire.md "EXEC-REPORT"): no client has this principal, so nothing
# is ever affirmed with it, and the report's digest covers the checkpoint digest, which makes
# a checkpoint liar a mismatch like a wrong reply.
CHECKPOINT_REF_CLIENT = 0xFFFFFFFF


def checkpoint_ref(seq: int, checkpoint: bytes) -> ReplyRef:
    return ReplyRef(CHECKPOINT_REF_CLIENT, seq, checkpoint)


def _check_count(items: Sequence[object]) -> None:
    if len(items) > MAX_LIST:
        raise ValueError("list longer than ZZ_MAX_LIST")


def _rows(items: Sequence[RowEntry]) -> bytes:
    _check_count(items)
    return _u32(len(items)) + b"".join(
        _u32(e.replica) + _u8(e.state) + _digest(e.digest) for e in items
    )


def _reply_refs(items: Sequence[ReplyRef]) -> bytes:
    _check_count(items)
    return _u32(len(items)) + b"".join(_reply_ref(e) for e in items)


def _reply_ref(e: ReplyRef) -> bytes:
    return _u32(e.client) + _u64(e.timestamp) + _digest(e.result_digest)


def _u32s(items: Sequence[int]) -> bytes:
    _check_count(items)
    return _u32(len(items)) + b"".join(_u32(v) for v in items)


def _entries(items: Sequence[Entry]) -> bytes:
    if len(items) > MAX_LIST:
        raise ValueError("list longer than ZZ_MAX_LIST")
    return _u32(len(items)) + b"".join(
        _u64(e.seq) + _u32(e.view) + _digest(e.digest) for e in items
    )


def _choices(items: Sequence[Choice]) -> bytes:
    if len(items) > MAX_LIST:
        raise ValueError("list longer than ZZ_MAX_LIST")
    return _u32(len(items)) + b"".join(_u64(c.seq) + _digest(c.digest) for c in items)


class _Reader:
    """Bounds-checked cursor over buf[pos, end); every overrun is a 'short' error."""

    def __init__(self, buf: bytes, pos: int, end: int) -> None:
        self.buf = buf
        self.pos = pos
        self.end = end

    def _take(self, n: int, what: str) -> bytes:
        if self.end - self.pos < n:
            raise WireError("short", f"{what}: need {n} bytes, have {self.end - self.pos}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return self._take(1, what)[0]

    def u32(self, what: str) -> int:
        return int.from_bytes(self._take(4, what), "big")

    def u64(self, what: str) -> int:
        return int.from_bytes(self._take(8, what), "big")

    def digest(self, what: str) -> bytes:
        return self._take(DIGEST_LEN, what)

    def bytes_(self, what: str) -> bytes:
        n = self.u32(what)
        return self._take(n, what)

    def count(self, what: str) -> int:
        n = self.u32(what)
        # The limit is checked before any item is read, so an absurd count is a
        # 'length' error even when the bytes for it are missing too.
        if n > MAX_LIST:
            raise WireError("length", f"{what}: count {n} > {MAX_LIST}")
        return n

    def blist(self, what: str) -> list[bytes]:
        return [self.bytes_(f"{what}[{i}]") for i in range(self.count(what))]

    def entries(self, what: str) -> list[Entry]:
        out = []
        for i in range(self.count(what)):
            seq = self.u64(f"{what}[{i}].seq")
            view = self.u32(f"{what}[{i}].view")
            out.append(Entry(seq, view, self.digest(f"{what}[{i}].digest")))
        return out

    def choices(self, what: str) -> list[Choice]:
        out = []
        for i in range(self.count(what)):
            seq = self.u64(f"{what}[{i}].seq")
            out.append(Choice(seq, self.digest(f"{what}[{i}].digest")))
        return out

    def rows(self, what: str) -> list[RowEntry]:
        out = []
        for i in range(self.count(what)):
            replica = self.u32(f"{what}[{i}].replica")
            state = self.u8(f"{what}[{i}].state")
            digest = self.digest(f"{what}[{i}].digest")
            # A state outside 0..2, or a null digest anywhere but with state 0 (and a
            # non-null one with it), is no statement a correct replica makes.
            if state > ROW_LATE:
                raise WireError("field", f"{what}[{i}].state: {state} not in 0..2")
            if (state == ROW_NONE) != (digest == NULL_DIGEST):
                raise WireError("field", f"{what}[{i}]: state {state} with digest {digest.hex()}")
            out.append(RowEntry(replica, state, digest))
        return out

    def reply_refs(self, what: str) -> list[ReplyRef]:
        out = []
        for i in range(self.count(what)):
            client = self.u32(f"{what}[{i}].client")
            ts = self.u64(f"{what}[{i}].timestamp")
            out.append(ReplyRef(client, ts, self.digest(f"{what}[{i}].result_digest")))
        return out

    def u32s(self, what: str) -> list[int]:
        return [self.u32(f"{what}[{i}]") for i in range(self.count(what))]

    def done(self, what: str) -> None:
        if self.pos != self.end:
            raise WireError("length", f"{what}: {self.end - self.pos} trailing bytes")


# ---- canonical dump helpers ---------------------------------------------------


def _hx(b: bytes) -> str:
    return b.hex() if b else "-"


def _list(items: Iterable[str]) -> str:
    return "[" + ",".join(items) + "]"


# ---- messages ---------------------------------------------------------------


@dataclass
class Message:
    """Common header fields; subclasses add the body. `auth` is the raw authenticator."""

    TYPE: ClassVar[int] = 0
    NAME: ClassVar[str] = ""
    AUTH: ClassVar[int] = AUTH_NONE

    service: int
    sender: int
    auth: bytes = field(default=b"", kw_only=True, repr=False)

    # -- subclass hooks
    def body(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        raise NotImplementedError

    def _dump_fields(self) -> list[str]:
        raise NotImplementedError

    # -- encoding
    def authed(self) -> bytes:
        """Header + body: the bytes every authenticator covers."""
        try:
            body = self.body()
            hdr = _HDR.pack(
                MAGIC, VERSION, self.TYPE, self.AUTH, 0, self.service, self.sender, len(body)
            )
        except struct.error as e:
            raise ValueError(f"{self.NAME}: field out of range: {e}") from e
        return hdr + body

    def encode(self) -> bytes:
        out = self.authed() + self.auth
        if len(out) > MAX_MSG:
            raise ValueError(f"{self.NAME}: message of {len(out)} bytes exceeds ZZ_MAX_MSG")
        return out

    def with_macs(self, keys: Mapping[int, bytes]) -> Self:
        """A copy authenticated with one MAC per receiver (insertion order kept)."""
        if self.AUTH != AUTH_MAC:
            raise ValueError(f"{self.NAME} is not MAC-authenticated")
        if len(keys) > MAX_MACS:
            raise ValueError(f"{len(keys)} MAC entries > {MAX_MACS}")
        data = self.authed()
        auth = _u16(len(keys)) + b"".join(
            _u32(rcv) + hmac_sha256(key, data) for rcv, key in keys.items()
        )
        return dataclasses.replace(self, auth=auth)

    def signed(self, key: SigningKey) -> Self:
        if self.AUTH != AUTH_SIG:
            raise ValueError(f"{self.NAME} is not signature-authenticated")
        return dataclasses.replace(self, auth=key.sign(self.authed()))

    # -- verification
    def mac_entries(self) -> list[tuple[int, bytes]]:
        if self.AUTH not in (AUTH_MAC, AUTH_MAC_SIG) or len(self.auth) < 2:
            return []
        n = int.from_bytes(self.auth[:2], "big")
        out = []
        for i in range(n):
            off = 2 + i * MAC_ENTRY_LEN
            ent = self.auth[off : off + MAC_ENTRY_LEN]
            if len(ent) != MAC_ENTRY_LEN:
                break
            out.append((int.from_bytes(ent[:4], "big"), ent[4:]))
        return out

    def verify_mac(self, receiver: int, key: bytes) -> bool:
        """Check the first MAC entry naming `receiver`; no entry means not authentic."""
        for rcv, mac in self.mac_entries():
            if rcv == receiver:
                return ct_equal(mac, hmac_sha256(key, self.authed()))
        return False

    def verify_sig(self, public: bytes) -> bool:
        if self.AUTH == AUTH_MAC_SIG:  # the signature ends the authenticator
            return len(self.auth) >= SIG_LEN and verify_signature(
                public, self.authed(), self.auth[-SIG_LEN:]
            )
        if self.AUTH != AUTH_SIG:
            return False
        return verify_signature(public, self.authed(), self.auth)

    def dump(self) -> str:
        head = [f"type={self.NAME}", f"service={self.service}", f"sender={self.sender}"]
        return " ".join(head + self._dump_fields())


@dataclass
class Request(Message):
    TYPE: ClassVar[int] = 1
    NAME: ClassVar[str] = "REQUEST"
    AUTH: ClassVar[int] = AUTH_MAC

    timestamp: int
    flags: int
    op: bytes

    @property
    def read_only(self) -> bool:
        return bool(self.flags & FLAG_READONLY)

    @property
    def ordered_read(self) -> bool:
        return bool(self.flags & FLAG_ORDERED_READ)

    def body(self) -> bytes:
        return _u64(self.timestamp) + _u8(self.flags) + _bytes(self.op)

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        ts = r.u64("timestamp")
        flags = r.u8("flags")
        if flags not in (0, FLAG_READONLY, FLAG_ORDERED_READ):
            raise WireError("field", f"flags: {flags:#x} is not 0, 1 or 2")
        return cls(service, sender, ts, flags, r.bytes_("op"))

    def _dump_fields(self) -> list[str]:
        return [f"timestamp={self.timestamp}", f"flags={self.flags}", f"op={_hx(self.op)}"]

    @property
    def is_signed(self) -> bool:
        return self.AUTH == AUTH_MAC_SIG

    def signed_with_macs(self, keys: Mapping[int, bytes], key: SigningKey) -> SignedRequest:
        """The signed form (auth kind 3): a MAC vector as with_macs, then the client's
        signature over the same authenticated bytes."""
        if len(keys) > MAX_MACS:
            raise ValueError(f"{len(keys)} MAC entries > {MAX_MACS}")
        m = SignedRequest(self.service, self.sender, self.timestamp, self.flags, self.op)
        data = m.authed()
        macs = _u16(len(keys)) + b"".join(
            _u32(rcv) + hmac_sha256(k, data) for rcv, k in keys.items()
        )
        m.auth = macs + key.sign(data)
        return m


@dataclass
class SignedRequest(Request):
    """A REQUEST with auth kind 3 (MAC vector + the client's Ed25519 signature): what a
    client sends when it retransmits. Every replica can check the signature, so all agree
    whether it is authentic (docs/agreement.md "Signed requests")."""

    AUTH: ClassVar[int] = AUTH_MAC_SIG


@dataclass
class Reply(Message):
    TYPE: ClassVar[int] = 2
    NAME: ClassVar[str] = "REPLY"
    AUTH: ClassVar[int] = AUTH_MAC

    view: int
    timestamp: int
    client: int
    flags: int
    result: bytes

    @property
    def read_only(self) -> bool:
        return bool(self.flags & FLAG_READONLY)

    @property
    def rejected(self) -> tuple[int, int] | None:
        """(reason, limit) of a REJECTED reply, else None."""
        if not self.flags & FLAG_REJECTED:
            return None
        return self.result[0], int.from_bytes(self.result[1:5], "big")

    def body(self) -> bytes:
        return (
            _u32(self.view)
            + _u64(self.timestamp)
            + _u32(self.client)
            + _u8(self.flags)
            + _bytes(self.result)
        )

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        view = r.u32("view")
        ts = r.u64("timestamp")
        client = r.u32("client")
        flags = r.u8("flags")
        if flags not in (0, FLAG_READONLY, FLAG_REJECTED):
            raise WireError("field", f"flags: unknown value {flags:#x}")
        result = r.bytes_("result")
        if flags == FLAG_REJECTED and len(result) != 5:
            raise WireError("field", f"rejected reply: result of {len(result)} bytes, not 5")
        return cls(service, sender, view, ts, client, flags, result)

    def _dump_fields(self) -> list[str]:
        return [
            f"view={self.view}",
            f"timestamp={self.timestamp}",
            f"client={self.client}",
            f"flags={self.flags}",
            f"result={_hx(self.result)}",
        ]


def batch_encoding(nd_time: int, nd_seed: int, requests: Sequence[bytes]) -> bytes:
    """PRE-PREPARE body from nd_time on; also FETCH-REPLY kind 1 data."""
    return _u64(nd_time) + _u64(nd_seed) + _blist(requests)


def batch_digest(nd_time: int, nd_seed: int, requests: Sequence[bytes]) -> bytes:
    return sha256(batch_encoding(nd_time, nd_seed, requests))


def decode_batch(buf: bytes) -> tuple[int, int, list[bytes]]:
    r = _Reader(buf, 0, len(buf))
    nd_time = r.u64("nd_time")
    nd_seed = r.u64("nd_seed")
    reqs = r.blist("requests")
    r.done("batch")
    return nd_time, nd_seed, reqs


@dataclass
class PrePrepare(Message):
    TYPE: ClassVar[int] = 3
    NAME: ClassVar[str] = "PRE-PREPARE"
    AUTH: ClassVar[int] = AUTH_MAC

    view: int
    seq: int
    nd_time: int
    nd_seed: int
    requests: list[bytes]

    def batch(self) -> bytes:
        return batch_encoding(self.nd_time, self.nd_seed, self.requests)

    def digest(self) -> bytes:
        return sha256(self.batch())

    def body(self) -> bytes:
        return _u32(self.view) + _u64(self.seq) + self.batch()

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        view = r.u32("view")
        seq = r.u64("seq")
        nd_time = r.u64("nd_time")
        nd_seed = r.u64("nd_seed")
        return cls(service, sender, view, seq, nd_time, nd_seed, r.blist("requests"))

    def _dump_fields(self) -> list[str]:
        return [
            f"view={self.view}",
            f"seq={self.seq}",
            f"nd_time={self.nd_time}",
            f"nd_seed={self.nd_seed}",
            f"requests={_list(_hx(q) for q in self.requests)}",
        ]


@dataclass
class _Phase(Message):
    AUTH: ClassVar[int] = AUTH_MAC

    view: int
    seq: int
    digest: bytes

    def body(self) -> bytes:
        return _u32(self.view) + _u64(self.seq) + _digest(self.digest)

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        view = r.u32("view")
        seq = r.u64("seq")
        return cls(service, sender, view, seq, r.digest("digest"))

    def _dump_fields(self) -> list[str]:
        return [f"view={self.view}", f"seq={self.seq}", f"digest={self.digest.hex()}"]


@dataclass
class Prepare(_Phase):
    TYPE: ClassVar[int] = 4
    NAME: ClassVar[str] = "PREPARE"


@dataclass
class Commit(_Phase):
    TYPE: ClassVar[int] = 5
    NAME: ClassVar[str] = "COMMIT"


@dataclass
class Checkpoint(Message):
    TYPE: ClassVar[int] = 6
    NAME: ClassVar[str] = "CHECKPOINT"
    AUTH: ClassVar[int] = AUTH_SIG

    seq: int
    state: bytes

    def body(self) -> bytes:
        return _u64(self.seq) + _digest(self.state)

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        seq = r.u64("seq")
        return cls(service, sender, seq, r.digest("state"))

    def _dump_fields(self) -> list[str]:
        return [f"seq={self.seq}", f"state={self.state.hex()}"]


def _entry_str(e: Entry) -> str:
    return f"{e.seq}/{e.view}/{e.digest.hex()}"


@dataclass
class ViewChange(Message):
    TYPE: ClassVar[int] = 7
    NAME: ClassVar[str] = "VIEW-CHANGE"
    AUTH: ClassVar[int] = AUTH_SIG

    new_view: int
    stable_seq: int
    proof: list[bytes]
    prepared: list[Entry]
    preprepared: list[Entry]

    def body(self) -> bytes:
        return (
            _u32(self.new_view)
            + _u64(self.stable_seq)
            + _blist(self.proof)
            + _entries(self.prepared)
            + _entries(self.preprepared)
        )

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        new_view = r.u32("new_view")
        stable = r.u64("stable_seq")
        proof = r.blist("proof")
        p = r.entries("prepared")
        return cls(service, sender, new_view, stable, proof, p, r.entries("preprepared"))

    def _dump_fields(self) -> list[str]:
        return [
            f"new_view={self.new_view}",
            f"stable_seq={self.stable_seq}",
            f"proof={_list(_hx(x) for x in self.proof)}",
            f"prepared={_list(_entry_str(e) for e in self.prepared)}",
            f"preprepared={_list(_entry_str(e) for e in self.preprepared)}",
        ]


@dataclass
class NewView(Message):
    TYPE: ClassVar[int] = 8
    NAME: ClassVar[str] = "NEW-VIEW"
    AUTH: ClassVar[int] = AUTH_SIG

    view: int
    view_changes: list[bytes]
    min_s: int
    chosen: list[Choice]

    def body(self) -> bytes:
        return (
            _u32(self.view) + _blist(self.view_changes) + _u64(self.min_s) + _choices(self.chosen)
        )

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        view = r.u32("view")
        vcs = r.blist("view_changes")
        min_s = r.u64("min_s")
        return cls(service, sender, view, vcs, min_s, r.choices("chosen"))

    def _dump_fields(self) -> list[str]:
        return [
            f"view={self.view}",
            f"view_changes={_list(_hx(x) for x in self.view_changes)}",
            f"min_s={self.min_s}",
            f"chosen={_list(f'{c.seq}/{c.digest.hex()}' for c in self.chosen)}",
        ]


def _check_kind(kind: int) -> None:
    if kind not in (FETCH_BATCH, FETCH_STATE, FETCH_LOG):
        raise WireError("field", f"kind: {kind} not in 1..3")


@dataclass
class Fetch(Message):
    TYPE: ClassVar[int] = 9
    NAME: ClassVar[str] = "FETCH"
    AUTH: ClassVar[int] = AUTH_MAC

    kind: int
    seq: int
    digest: bytes

    def body(self) -> bytes:
        return _u8(self.kind) + _u64(self.seq) + _digest(self.digest)

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        kind = r.u8("kind")
        _check_kind(kind)
        seq = r.u64("seq")
        return cls(service, sender, kind, seq, r.digest("digest"))

    def _dump_fields(self) -> list[str]:
        return [f"kind={self.kind}", f"seq={self.seq}", f"digest={self.digest.hex()}"]


@dataclass
class FetchReply(Message):
    TYPE: ClassVar[int] = 10
    NAME: ClassVar[str] = "FETCH-REPLY"
    AUTH: ClassVar[int] = AUTH_MAC

    kind: int
    seq: int
    digest: bytes
    data: bytes

    def body(self) -> bytes:
        return _u8(self.kind) + _u64(self.seq) + _digest(self.digest) + _bytes(self.data)

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        kind = r.u8("kind")
        _check_kind(kind)
        seq = r.u64("seq")
        digest = r.digest("digest")
        return cls(service, sender, kind, seq, digest, r.bytes_("data"))

    def _dump_fields(self) -> list[str]:
        return [
            f"kind={self.kind}",
            f"seq={self.seq}",
            f"digest={self.digest.hex()}",
            f"data={_hx(self.data)}",
        ]


@dataclass
class Status(Message):
    TYPE: ClassVar[int] = 11
    NAME: ClassVar[str] = "STATUS"
    AUTH: ClassVar[int] = AUTH_MAC

    view: int
    last_exec: int
    stable_seq: int

    def body(self) -> bytes:
        return _u32(self.view) + _u64(self.last_exec) + _u64(self.stable_seq)

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        view = r.u32("view")
        last = r.u64("last_exec")
        return cls(service, sender, view, last, r.u64("stable_seq"))

    def _dump_fields(self) -> list[str]:
        return [
            f"view={self.view}",
            f"last_exec={self.last_exec}",
            f"stable_seq={self.stable_seq}",
        ]


# ---- execution messages (ZZ §4.1-4.2) -------------------------------------------


@dataclass
class ExecCommit(Message):
    """An agreement replica's statement that batch `seq` committed (null digest and
    empty batch for a null request). The codec does not check that the batch hashes
    to the digest: the execution replica does, as part of its commit certificate."""

    TYPE: ClassVar[int] = 16
    NAME: ClassVar[str] = "EXEC-COMMIT"
    AUTH: ClassVar[int] = AUTH_MAC

    view: int
    seq: int
    digest: bytes
    batch: bytes

    def body(self) -> bytes:
        return _u32(self.view) + _u64(self.seq) + _digest(self.digest) + _bytes(self.batch)

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        view = r.u32("view")
        seq = r.u64("seq")
        digest = r.digest("digest")
        return cls(service, sender, view, seq, digest, r.bytes_("batch"))

    def _dump_fields(self) -> list[str]:
        return [
            f"view={self.view}",
            f"seq={self.seq}",
            f"digest={self.digest.hex()}",
            f"batch={_hx(self.batch)}",
        ]


@dataclass
class ExecReport(Message):
    """The codec does not check that `reply_digest` hashes `replies` (the receiver does,
    with `digest_ok`, and drops the report as a `field` error otherwise)."""

    TYPE: ClassVar[int] = 17
    NAME: ClassVar[str] = "EXEC-REPORT"
    AUTH: ClassVar[int] = AUTH_MAC

    seq: int
    reply_digest: bytes
    replies: list[ReplyRef]

    @classmethod
    def of(cls, service: int, sender: int, seq: int, replies: Sequence[ReplyRef]) -> Self:
        """A report whose digest hashes its reply list, as a correct replica sends it."""
        return cls(service, sender, seq, reply_digest(replies), list(replies))

    def digest_ok(self) -> bool:
        return ct_equal(reply_digest(self.replies), self.reply_digest)

    def body(self) -> bytes:
        return _u64(self.seq) + _digest(self.reply_digest) + _reply_refs(self.replies)

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        seq = r.u64("seq")
        d = r.digest("reply_digest")
        return cls(service, sender, seq, d, r.reply_refs("replies"))

    def _dump_fields(self) -> list[str]:
        return [
            f"seq={self.seq}",
            f"reply_digest={self.reply_digest.hex()}",
            "replies="
            + _list(f"{e.client}/{e.timestamp}/{e.result_digest.hex()}" for e in self.replies),
        ]


@dataclass
class ExecCheckpoint(Message):
    TYPE: ClassVar[int] = 18
    NAME: ClassVar[str] = "EXEC-CHECKPOINT"
    AUTH: ClassVar[int] = AUTH_SIG

    seq: int
    checkpoint: bytes

    def body(self) -> bytes:
        return _u64(self.seq) + _digest(self.checkpoint)

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        seq = r.u64("seq")
        return cls(service, sender, seq, r.digest("checkpoint"))

    def _dump_fields(self) -> list[str]:
        return [f"seq={self.seq}", f"checkpoint={self.checkpoint.hex()}"]


# ---- fault detection and control messages (ZZ §4.3, docs/fault-detection.md) ----------


@dataclass
class FaultStatement(Message):
    """Agreement replica `sender`'s signed row for `seq`: one entry per awake execution
    replica, ascending replica id (the evaluator, not the codec, checks the order)."""

    TYPE: ClassVar[int] = 19
    NAME: ClassVar[str] = "FAULT-STATEMENT"
    AUTH: ClassVar[int] = AUTH_SIG

    seq: int
    row: list[RowEntry]

    def body(self) -> bytes:
        return _u64(self.seq) + _rows(self.row)

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        seq = r.u64("seq")
        return cls(service, sender, seq, r.rows("row"))

    def _dump_fields(self) -> list[str]:
        return [
            f"seq={self.seq}",
            "row=" + _list(f"{e.replica}/{e.state}/{e.digest.hex()}" for e in self.row),
        ]


@dataclass
class Wakeup(Message):
    """A self-certifying wake-up order: `evidence` holds complete signed FAULT-STATEMENT
    messages; the verifier (zz/certs.py, agreement/src/wakeup.c) checks them."""

    TYPE: ClassVar[int] = 20
    NAME: ClassVar[str] = "WAKEUP"
    AUTH: ClassVar[int] = AUTH_SIG

    seq: int
    evidence: list[bytes]
    sleeping: list[int]
    wake: list[int]

    def body(self) -> bytes:
        return _u64(self.seq) + _blist(self.evidence) + _u32s(self.sleeping) + _u32s(self.wake)

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        seq = r.u64("seq")
        ev = r.blist("evidence")
        sleeping = r.u32s("sleeping")
        return cls(service, sender, seq, ev, sleeping, r.u32s("wake"))

    def _dump_fields(self) -> list[str]:
        return [
            f"seq={self.seq}",
            f"evidence={_list(_hx(x) for x in self.evidence)}",
            f"sleeping={_list(str(v) for v in self.sleeping)}",
            f"wake={_list(str(v) for v in self.wake)}",
        ]


@dataclass
class Shutdown(Message):
    """One agreement replica's resolution of the round at `seq`; g+1 identical bodies from
    distinct agreement replicas make a SHUTDOWN certificate."""

    TYPE: ClassVar[int] = 21
    NAME: ClassVar[str] = "SHUTDOWN"
    AUTH: ClassVar[int] = AUTH_SIG

    seq: int
    awake: list[int]
    convict: list[int]
    sleep: list[int]
    active: list[int]

    def body(self) -> bytes:
        return (
            _u64(self.seq)
            + _u32s(self.awake)
            + _u32s(self.convict)
            + _u32s(self.sleep)
            + _u32s(self.active)
        )

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        seq = r.u64("seq")
        awake = r.u32s("awake")
        convict = r.u32s("convict")
        sleep = r.u32s("sleep")
        return cls(service, sender, seq, awake, convict, sleep, r.u32s("active"))

    def _dump_fields(self) -> list[str]:
        return [
            f"seq={self.seq}",
            f"awake={_list(str(v) for v in self.awake)}",
            f"convict={_list(str(v) for v in self.convict)}",
            f"sleep={_list(str(v) for v in self.sleep)}",
            f"active={_list(str(v) for v in self.active)}",
        ]


@dataclass
class ReplyAffirm(Message):
    """An agreement replica's statement that the request (client, timestamp) has the
    certified result whose SHA-256 is `result_digest`."""

    TYPE: ClassVar[int] = 22
    NAME: ClassVar[str] = "REPLY-AFFIRM"
    AUTH: ClassVar[int] = AUTH_MAC

    timestamp: int
    client: int
    result_digest: bytes

    def body(self) -> bytes:
        return _u64(self.timestamp) + _u32(self.client) + _digest(self.result_digest)

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        ts = r.u64("timestamp")
        client = r.u32("client")
        return cls(service, sender, ts, client, r.digest("result_digest"))

    def _dump_fields(self) -> list[str]:
        return [
            f"timestamp={self.timestamp}",
            f"client={self.client}",
            f"result_digest={self.result_digest.hex()}",
        ]


@dataclass
class _ControlBase(Message):
    AUTH: ClassVar[int] = AUTH_MAC

    request_id: int
    json: bytes

    def body(self) -> bytes:
        return _u64(self.request_id) + _bytes(self.json)

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        rid = r.u64("request_id")
        return cls(service, sender, rid, r.bytes_("json"))

    def _dump_fields(self) -> list[str]:
        return [f"request_id={self.request_id}", f"json={_hx(self.json)}"]


@dataclass
class Control(_ControlBase):
    """Operator -> controld RPC (service 0); `json` is a UTF-8 JSON object."""

    TYPE: ClassVar[int] = 23
    NAME: ClassVar[str] = "CONTROL"


@dataclass
class ControlReply(_ControlBase):
    TYPE: ClassVar[int] = 24
    NAME: ClassVar[str] = "CONTROL-REPLY"


# ---- state fetching (ZZ §4.5, docs/recovery.md) -------------------------------------

FILE_MAX_CHUNK = 4194304
# The server's challenge on one connection (FILE-DATA status 6), which every FILE-FETCH
# on that connection carries (docs/wire.md "State fetching", docs/security.md).
FILE_CHALLENGE_LEN = 16
FILE_STATUS_CHALLENGE = 6


@dataclass
class FileFetch(Message):
    """A recovering execution replica asks a peer for a range of one checkpoint file
    (empty path: the manifest encoding). Bound to one server (`target`, its principal)
    and to one connection to it (`challenge`, the server's challenge on that connection;
    empty to ask for it), so a captured request cannot be replayed elsewhere."""

    TYPE: ClassVar[int] = 25
    NAME: ClassVar[str] = "FILE-FETCH"
    AUTH: ClassVar[int] = AUTH_SIG

    seq: int
    path: bytes
    offset: int
    length: int
    target: int
    challenge: bytes = b""

    def body(self) -> bytes:
        if len(self.challenge) not in (0, FILE_CHALLENGE_LEN):
            raise ValueError(f"FILE-FETCH challenge must be 0 or {FILE_CHALLENGE_LEN} bytes")
        return (
            _u64(self.seq)
            + _bytes(self.path)
            + _u64(self.offset)
            + _u32(self.length)
            + _u32(self.target)
            + _bytes(self.challenge)
        )

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        seq = r.u64("seq")
        path = r.bytes_("path")
        offset = r.u64("offset")
        length = r.u32("length")
        if length > FILE_MAX_CHUNK:
            raise WireError("field", f"length: {length} > {FILE_MAX_CHUNK}")
        target = r.u32("target")
        challenge = r.bytes_("challenge")
        if len(challenge) not in (0, FILE_CHALLENGE_LEN):
            raise WireError("field", f"challenge: {len(challenge)} bytes, not 0 or 16")
        return cls(service, sender, seq, path, offset, length, target, challenge)

    def _dump_fields(self) -> list[str]:
        return [
            f"seq={self.seq}",
            f"path={_hx(self.path)}",
            f"offset={self.offset}",
            f"length={self.length}",
            f"target={self.target}",
            f"challenge={_hx(self.challenge)}",
        ]

    def refusal(
        self, publics: Mapping[int, bytes], n_exec: int, server: int | None = None
    ) -> str | None:
        """None if a server may answer: only replicas of the service read its state, so
        the sender must be execution replica 0..n_exec-1 (not the server itself) with a
        valid signature. Else the counter to count the drop under."""
        kind, idx = principal_kind(self.sender)
        pub = publics.get(self.sender)
        if kind != "exec" or idx >= n_exec or self.sender == server or pub is None:
            return "file_fetch_wrong_sender"
        if not self.verify_sig(pub):
            return "file_fetch_bad_sig"
        return None

    def path_text(self) -> str:
        """The path as text; not UTF-8 gives one every reader refuses as non-canonical."""
        try:
            return self.path.decode("utf-8")
        except UnicodeDecodeError:
            return "\x00"


@dataclass
class FileData(Message):
    """The answer to FILE-FETCH. Unauthenticated: the content is checked against the
    certified manifest by the requester."""

    TYPE: ClassVar[int] = 26
    NAME: ClassVar[str] = "FILE-DATA"
    AUTH: ClassVar[int] = AUTH_NONE

    seq: int
    path: bytes
    offset: int
    status: int
    size: int
    data: bytes

    def body(self) -> bytes:
        return (
            _u64(self.seq)
            + _bytes(self.path)
            + _u64(self.offset)
            + _u8(self.status)
            + _u64(self.size)
            + _bytes(self.data)
        )

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        seq = r.u64("seq")
        path = r.bytes_("path")
        offset = r.u64("offset")
        status = r.u8("status")
        size = r.u64("size")
        data = r.bytes_("data")
        if status > FILE_STATUS_CHALLENGE:
            raise WireError("field", f"status: {status} not in 0..6")
        # 0 (ok) and 5 (later) carry the file's bytes, 6 (challenge) the connection's
        # challenge; the others carry nothing.
        if status == FILE_STATUS_CHALLENGE:
            if size or len(data) != FILE_CHALLENGE_LEN:
                raise WireError("field", f"challenge with size {size} and {len(data)} bytes")
        elif status not in (0, 5) and (size or data):
            raise WireError("field", f"status {status} with size {size} and {len(data)} bytes")
        if len(data) > FILE_MAX_CHUNK:
            raise WireError("field", f"data: {len(data)} bytes > {FILE_MAX_CHUNK}")
        return cls(service, sender, seq, path, offset, status, size, data)

    def _dump_fields(self) -> list[str]:
        return [
            f"seq={self.seq}",
            f"path={_hx(self.path)}",
            f"offset={self.offset}",
            f"status={self.status}",
            f"size={self.size}",
            f"data={_hx(self.data)}",
        ]


@dataclass
class SpareReady(Message):
    """controld of the replica's host → the service's agreement replicas: a fresh sleeping
    replica stands under index `replica`. `seq` is the SHUTDOWN seq that convicted the
    previous incarnation (0 for a first provisioning); zz-agreed takes it only as the answer
    to that conviction, so an old SPARE-READY replayed after a later one does nothing.
    `epoch` numbers the slot's key generations (0: the key directory's keys); `sign_pub` and
    `dh_pub` are the new incarnation's Ed25519 and X25519 public keys: from then on the slot's
    messages verify only under them (docs/wire.md, "Key epochs")."""

    TYPE: ClassVar[int] = 27
    NAME: ClassVar[str] = "SPARE-READY"
    AUTH: ClassVar[int] = AUTH_SIG

    replica: int
    seq: int
    epoch: int = 0
    sign_pub: bytes = bytes(KEY_LEN)
    dh_pub: bytes = bytes(KEY_LEN)

    def body(self) -> bytes:
        if len(self.sign_pub) != KEY_LEN or len(self.dh_pub) != KEY_LEN:
            raise ValueError(f"SPARE-READY keys must be {KEY_LEN} bytes")
        return (
            _u32(self.replica)
            + _u64(self.seq)
            + _u32(self.epoch)
            + bytes(self.sign_pub)
            + bytes(self.dh_pub)
        )

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        replica = r.u32("replica")
        seq = r.u64("seq")
        epoch = r.u32("epoch")
        sign_pub = r._take(KEY_LEN, "sign_pub")
        return cls(service, sender, replica, seq, epoch, sign_pub, r._take(KEY_LEN, "dh_pub"))

    def _dump_fields(self) -> list[str]:
        return [
            f"replica={self.replica}",
            f"seq={self.seq}",
            f"epoch={self.epoch}",
            f"sign_pub={_hx(self.sign_pub)}",
            f"dh_pub={_hx(self.dh_pub)}",
        ]


def reply_ref(client: int, timestamp: int, result: bytes) -> ReplyRef:
    return ReplyRef(client, timestamp, sha256(result))


def reply_digest(refs: Iterable[ReplyRef]) -> bytes:
    """EXEC-REPORT reply_digest: SHA-256 of the concatenated reply_ref encodings, in batch
    order; the caller leaves out requests skipped as duplicates."""
    return sha256(b"".join(_reply_ref(e) for e in refs))


class LogEntry(NamedTuple):
    """FETCH-REPLY kind 3 item: a committed batch (null digest + empty batch = null request)."""

    seq: int
    digest: bytes
    batch: bytes


def log_encoding(entries: Sequence[tuple[int, bytes, bytes]], certified_through: int = 0) -> bytes:
    """FETCH-REPLY kind 3 data: u64 certified_through, list<log_entry>."""
    if len(entries) > MAX_LIST:
        raise ValueError("list longer than ZZ_MAX_LIST")
    return (
        _u64(certified_through)
        + _u32(len(entries))
        + b"".join(_u64(seq) + _digest(d) + _bytes(b) for seq, d, b in entries)
    )


class LogReply(NamedTuple):
    """FETCH-REPLY kind 3 data, decoded. The replier vouches that every listed batch with
    seq <= certified_through has an execution certificate (0: none); one replier's word is
    not proof, g+1 of them are (docs/recovery.md, ZZ §4.7.2)."""

    certified_through: int
    entries: list[LogEntry]


def log_reply(data: bytes) -> LogReply:
    """Decode FETCH-REPLY kind 3 data. Beyond the shape (exact fill, count limit) it
    rejects what no correct replica sends, so a caller can count entries toward commit
    certificates without re-checking them: seqs strictly increasing, a null digest only
    with an empty batch, and every other batch hashing to its digest."""
    r = _Reader(data, 0, len(data))
    certified = r.u64("log.certified_through")
    out: list[LogEntry] = []
    for i in range(r.count("log")):
        seq = r.u64(f"log[{i}].seq")
        d = r.digest(f"log[{i}].digest")
        batch = r.bytes_(f"log[{i}].batch")
        if out and seq <= out[-1].seq:
            raise WireError("field", f"log[{i}].seq: {seq} not above {out[-1].seq}")
        if d == NULL_DIGEST:
            if batch:
                raise WireError("field", f"log[{i}]: null request with a non-empty batch")
        elif sha256(batch) != d:
            raise WireError("field", f"log[{i}]: batch does not hash to its digest")
        out.append(LogEntry(seq, d, batch))
    r.done("log")
    return LogReply(certified, out)


def log_entries(data: bytes) -> list[LogEntry]:
    """The batches of FETCH-REPLY kind 3 data (log_reply without the vouch)."""
    return log_reply(data).entries


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Request,
        Reply,
        PrePrepare,
        Prepare,
        Commit,
        Checkpoint,
        ViewChange,
        NewView,
        Fetch,
        FetchReply,
        Status,
        ExecCommit,
        ExecReport,
        ExecCheckpoint,
        FaultStatement,
        Wakeup,
        Shutdown,
        ReplyAffirm,
        Control,
        ControlReply,
        FileFetch,
        FileData,
        SpareReady,
    )
}


def _check_auth_shape(kind: int, auth: bytes) -> None:
    if kind == AUTH_MAC:
        if len(auth) < 2:
            raise WireError("auth", "MAC vector without a count")
        n = int.from_bytes(auth[:2], "big")
        if n > MAX_MACS:
            raise WireError("length", f"MAC vector count {n} > {MAX_MACS}")
        if len(auth) != 2 + MAC_ENTRY_LEN * n:
            raise WireError("auth", f"MAC vector of {n} entries but {len(auth)} bytes")
    elif kind == AUTH_SIG:
        if len(auth) != SIG_LEN:
            raise WireError("auth", f"signature of {len(auth)} bytes")
    elif kind == AUTH_MAC_SIG:
        if len(auth) < 2:
            raise WireError("auth", "MAC vector without a count")
        n = int.from_bytes(auth[:2], "big")
        if n > MAX_MACS:
            raise WireError("length", f"MAC vector count {n} > {MAX_MACS}")
        if len(auth) != 2 + MAC_ENTRY_LEN * n + SIG_LEN:
            raise WireError("auth", f"MAC vector of {n} and a signature in {len(auth)} bytes")
    elif auth:
        raise WireError("auth", "authenticator present with auth_kind none")


def decode(buf: bytes) -> Message:
    """Decode and structurally validate one message (no frame prefix).

    Checks the authenticator's shape but not its validity: the caller knows which
    key applies (verify_mac / verify_sig)."""
    buf = bytes(buf)
    if len(buf) < HDR_LEN:
        raise WireError("short", f"{len(buf)} bytes < header")
    magic, version, mtype, auth_kind, reserved, service, sender, body_len = _HDR.unpack_from(buf)
    if len(buf) > MAX_MSG:
        raise WireError("length", f"{len(buf)} bytes > ZZ_MAX_MSG")
    if magic != MAGIC:
        raise WireError("magic", magic.hex())
    if version != VERSION:
        raise WireError("version", str(version))
    cls = MESSAGE_TYPES.get(mtype)
    if cls is None:
        raise WireError("type", f"unknown type {mtype}")
    if cls is Request and auth_kind == AUTH_MAC_SIG:
        cls = SignedRequest
    if auth_kind != cls.AUTH:
        raise WireError("type", f"{cls.NAME} with auth_kind {auth_kind}")
    if reserved != 0:
        raise WireError("field", f"reserved byte {reserved}")
    end = HDR_LEN + body_len
    if end > len(buf):
        raise WireError("short", f"body_len {body_len} beyond the message")
    r = _Reader(buf, HDR_LEN, end)
    msg = cls._parse(r, service, sender)
    r.done("body")
    auth = buf[end:]
    _check_auth_shape(auth_kind, auth)
    msg.auth = auth
    return msg


# ---- checkpoint state encoding ------------------------------------------------


class ClientEntry(NamedTuple):
    """One client's exactly-once record in the checkpoint state (no view: replicas may
    execute the same batch in different views, docs/wire.md)."""

    client: int
    timestamp: int
    result: bytes


def state_encoding(seq: int, app_state: bytes, clients: Iterable[ClientEntry]) -> bytes:
    items = sorted(clients, key=lambda e: e.client)
    if len(items) > MAX_LIST:
        raise ValueError("list longer than ZZ_MAX_LIST")
    out = [_u64(seq), _digest(app_state), _u32(len(items))]
    for e in items:
        out.append(_u32(e.client) + _u64(e.timestamp) + _bytes(e.result))
    return b"".join(out)


def decode_state(buf: bytes) -> tuple[int, bytes, list[ClientEntry]]:
    r = _Reader(buf, 0, len(buf))
    seq = r.u64("seq")
    app = r.digest("app_state")
    entries = []
    last = -1
    for i in range(r.count("clients")):
        c = r.u32(f"clients[{i}].client")
        if c <= last:
            raise WireError("field", f"clients[{i}]: not sorted by client id")
        last = c
        ts = r.u64(f"clients[{i}].timestamp")
        entries.append(ClientEntry(c, ts, r.bytes_(f"clients[{i}].result")))
    r.done("state")
    return seq, app, entries


# ---- framing ------------------------------------------------------------------


def frame(msg: bytes) -> bytes:
    if not HDR_LEN <= len(msg) <= MAX_MSG:
        raise ValueError(f"cannot frame a message of {len(msg)} bytes")
    return _u32(len(msg)) + msg


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """Read one framed message. EOF raises asyncio.IncompleteReadError; a length
    outside 16..MAX_MSG raises FrameError and the caller must close the connection."""
    hdr = await reader.readexactly(4)
    n = int.from_bytes(hdr, "big")
    if n < HDR_LEN or n > MAX_MSG:
        raise FrameError(f"frame length {n} outside {HDR_LEN}..{MAX_MSG}")
    return await reader.readexactly(n)


__all__ = [
    "AUTH_MAC",
    "AUTH_MAC_SIG",
    "AUTH_NONE",
    "AUTH_SIG",
    "Checkpoint",
    "Choice",
    "ClientEntry",
    "Commit",
    "Control",
    "ControlReply",
    "Entry",
    "ExecCheckpoint",
    "ExecCommit",
    "ExecReport",
    "Fetch",
    "FaultStatement",
    "FetchReply",
    "FrameError",
    "LogEntry",
    "LogReply",
    "MESSAGE_TYPES",
    "Message",
    "NULL_DIGEST",
    "NewView",
    "PrePrepare",
    "Prepare",
    "Reply",
    "ReplyAffirm",
    "ReplyRef",
    "Request",
    "RowEntry",
    "Shutdown",
    "SignedRequest",
    "Status",
    "ViewChange",
    "Wakeup",
    "WireError",
    "agreement_principal",
    "batch_digest",
    "batch_encoding",
    "client_principal",
    "decode",
    "decode_batch",
    "decode_state",
    "exec_principal",
    "frame",
    "host_principal",
    "log_encoding",
    "log_entries",
    "log_reply",
    "operator_principal",
    "principal_kind",
    "read_frame",
    "reply_digest",
    "reply_ref",
    "state_encoding",
]
