"""zz/kvop.py - the kv app's op and reply encoding (docs/apps.md "kv").
Clients (zz/history.py, zz drill) encode ops and decode replies; the app (execution/apps/kv.py)
decodes ops and encodes replies."""

from __future__ import annotations

import struct
from dataclasses import dataclass

# Op codes (docs/apps.md "kv"). Every op: u8 code, then u32-length-prefixed fields.
GET = 1
PUT = 2
DELETE = 3
CAS = 4
APPEND = 5
_OP_NAMES = {GET: "GET", PUT: "PUT", DELETE: "DELETE", CAS: "CAS", APPEND: "APPEND"}

# Reply status codes: u8 status, then a u32-length-prefixed value (empty unless noted).
OK = 0  # GET: the value; others: empty
NOT_FOUND = 1  # GET/DELETE of a missing key
CAS_MISMATCH = 2  # CAS: u8 present + the current value (empty if absent)
BAD_OP = 3  # malformed op: the value is a UTF-8 message
READ_ONLY = 4  # a write op sent as a read-only request: resend it ordered
TOO_LARGE = 5  # key or resulting value over the configured limit
STATUS_NAMES = {
    OK: "OK",
    NOT_FOUND: "NOT_FOUND",
    CAS_MISMATCH: "CAS_MISMATCH",
    BAD_OP: "BAD_OP",
    READ_ONLY: "READ_ONLY",
    TOO_LARGE: "TOO_LARGE",
}

_U32 = struct.Struct(">I")


class KvDecodeError(ValueError):
    """A byte string that is not a valid kv op or reply."""


# -- client-side encoding ---------------------------------------------------------


def _field(data: bytes) -> bytes:
    return _U32.pack(len(data)) + bytes(data)


def encode_get(key: bytes) -> bytes:
    return bytes([GET]) + _field(key)


def encode_put(key: bytes, value: bytes) -> bytes:
    return bytes([PUT]) + _field(key) + _field(value)


def encode_delete(key: bytes) -> bytes:
    return bytes([DELETE]) + _field(key)


def encode_cas(key: bytes, expected: bytes | None, new: bytes) -> bytes:
    """Set key to `new` iff its value is `expected` (None: iff the key is absent)."""
    present = 0 if expected is None else 1
    return bytes([CAS]) + _field(key) + bytes([present]) + _field(expected or b"") + _field(new)


def encode_append(key: bytes, value: bytes) -> bytes:
    """Append to the key's value, creating it if absent."""
    return bytes([APPEND]) + _field(key) + _field(value)


@dataclass(frozen=True)
class KvReply:
    status: int
    value: bytes = b""
    present: bool = True  # CAS_MISMATCH only: whether the key existed

    @property
    def ok(self) -> bool:
        return self.status == OK

    def encode(self) -> bytes:
        if self.status == CAS_MISMATCH:
            return bytes([self.status, int(self.present)]) + _field(self.value)
        return bytes([self.status]) + _field(self.value)


def decode_reply(data: bytes) -> KvReply:
    r = _Reader(data)
    status = r.u8("status")
    if status not in STATUS_NAMES:
        raise KvDecodeError(f"unknown status {status}")
    present = True
    if status == CAS_MISMATCH:
        present = bool(r.flag("present"))
    value = r.field("value")
    r.end()
    return KvReply(status, value, present)


# -- op decoding ------------------------------------------------------------------


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.pos = 0

    def u8(self, what: str) -> int:
        if self.pos + 1 > len(self.data):
            raise KvDecodeError(f"truncated at {what}")
        self.pos += 1
        return self.data[self.pos - 1]

    def flag(self, what: str) -> int:
        v = self.u8(what)
        if v > 1:
            raise KvDecodeError(f"{what} must be 0 or 1, got {v}")
        return v

    def field(self, what: str) -> bytes:
        if self.pos + 4 > len(self.data):
            raise KvDecodeError(f"truncated at {what} length")
        (n,) = _U32.unpack_from(self.data, self.pos)
        self.pos += 4
        if self.pos + n > len(self.data):
            left = len(self.data) - self.pos
            raise KvDecodeError(f"{what} length {n} exceeds the {left} bytes left")
        self.pos += n
        return bytes(self.data[self.pos - n : self.pos])

    def end(self) -> None:
        if self.pos != len(self.data):
            raise KvDecodeError(f"{len(self.data) - self.pos} trailing bytes")


@dataclass(frozen=True)
class KvOp:
    code: int
    key: bytes
    value: bytes = b""
    expected: bytes | None = None  # CAS only


def decode_op(data: bytes) -> KvOp:
    r = _Reader(data)
    code = r.u8("op code")
    if code not in _OP_NAMES:
        raise KvDecodeError(f"unknown op code {code}")
    key = r.field("key")
    if code in (GET, DELETE):
        op = KvOp(code, key)
    elif code == CAS:
        present = r.flag("expected present")
        expected = r.field("expected")
        if not present and expected:
            raise KvDecodeError("CAS expects an absent key but carries an expected value")
        op = KvOp(code, key, r.field("new value"), expected if present else None)
    else:
        op = KvOp(code, key, r.field("value"))
    r.end()
    return op
