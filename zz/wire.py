# zz/wire.py - the ZZ binary wire format (docs/wire.md): messages, authenticators, frames.
# Byte-for-byte twin of agreement/src/wire.c; both are held to tests/vectors/wire.txt. The
# messages are declared in wire/messages.toml: zz/wire_table.py has their fields and
# domains, and one codec below decodes, encodes and dumps every type by them.
from __future__ import annotations

import asyncio
import dataclasses
import operator
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Self

from zz.crypto import (
    DIGEST_LEN,
    MAC_LEN,
    NULL_DIGEST,
    SIG_LEN,
    SigningKey,
    ct_equal,
    hmac_sha256,
    sha256,
    verify_signature,
)
from zz.wire_table import CHECKS, LAYOUTS, MESSAGES, OPTIONAL, RECORDS

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
    _check_fixed("digest", DIGEST_LEN, v)
    return v


class _Reader:
    """Bounds-checked cursor over buf[pos, end); every overrun is a 'short' error."""

    def __init__(self, buf: bytes, pos: int, end: int) -> None:
        self.buf = buf
        self.pos = pos
        self.end = end

    def take(self, n: int, what: str) -> bytes:
        if self.end - self.pos < n:
            raise WireError("short", f"{what}: need {n} bytes, have {self.end - self.pos}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        return int.from_bytes(self.take(4, what), "big")

    def u64(self, what: str) -> int:
        return int.from_bytes(self.take(8, what), "big")

    def digest(self, what: str) -> bytes:
        return self.take(DIGEST_LEN, what)

    def bytes_(self, what: str) -> bytes:
        n = self.u32(what)
        return self.take(n, what)

    def count(self, what: str) -> int:
        n = self.u32(what)
        # The limit is checked before any item is read, so an absurd count is a
        # 'length' error even when the bytes for it are missing too.
        if n > MAX_LIST:
            raise WireError("length", f"{what}: count {n} > {MAX_LIST}")
        return n

    def done(self, what: str) -> None:
        if self.pos != self.end:
            raise WireError("length", f"{what}: {self.end - self.pos} trailing bytes")


# ---- canonical dump helpers ---------------------------------------------------


def _hx(b: bytes) -> str:
    return b.hex() if b else "-"


def _list(items: Iterable[str]) -> str:
    return "[" + ",".join(items) + "]"


# ---- the codec: zz.wire_table's layouts, compiled -----------------------------------


_INT_FORMATS = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q"}


class _Field(NamedTuple):
    """A field of zz.wire_table, with a list's item codec resolved."""

    name: str
    kind: str  # u8 u16 u32 u64 fixed bytes blist list
    size: int = 0  # fixed: its length
    item: _Codec | None = None  # list: the items'

    @property
    def format(self) -> str:
        return f"{self.size}s" if self.kind == "fixed" else _INT_FORMATS[self.kind]

    @property
    def annotation(self) -> str:
        if self.kind in _INT_FORMATS:
            return "int"
        if self.kind != "list":
            return "list[bytes]" if self.kind == "blist" else "bytes"
        rec = self.item.record if self.item else None
        return f"list[{rec.__name__ if rec else 'int'}]"

    @property
    def zero(self) -> int | bytes:
        """An optional field's default."""
        return 0 if self.kind in _INT_FORMATS else bytes(self.size)

    def show(self, v: Any) -> str:
        """The value as the canonical dump writes it."""
        if self.kind == "fixed":
            return v.hex()
        if self.kind == "bytes":
            return _hx(v)
        if self.kind == "blist":
            return _list(_hx(x) for x in v)
        if self.kind == "list":
            return _list(self.item.show_item(x) for x in v)
        return str(v)


def _check_fixed(name: str, size: int, v: bytes) -> None:
    if len(v) != size:
        raise ValueError(f"{name} must be {size} bytes, got {len(v)}")


def _check_count(name: str, items: Sequence[object]) -> None:
    if len(items) > MAX_LIST:
        raise ValueError(f"{name}: list longer than ZZ_MAX_LIST")


Check = Callable[[Sequence[Any]], None]


class _Step(NamedTuple):
    """Fields start .. start+count-1 of a layout: fixed-width ones packed by `run`, or one
    bytes, list<bytes> or list (`item`); then the checks due once they are read."""

    kind: str  # run bytes blist list
    start: int
    count: int
    run: struct.Struct | None
    item: _Codec | None
    checks: tuple[Check, ...]


class _Codec:
    """A layout of zz.wire_table compiled: fields, checks, and for a record its NamedTuple.
    Consecutive fixed-width fields are one struct.Struct, cut after a field whose domain is
    checked as soon as it is read: a message that breaks a domain and is short after it is a
    `field` error, as in agreement/src/wire.c, which reads field by field. A record's
    domains are checked once its whole list is read, as in C."""

    def __init__(self, fields: Sequence[tuple[Any, ...]], checks: Sequence[tuple[Any, ...]],
                 record: type | None = None) -> None:
        self.fields = [self._field(*f) for f in fields]
        self.names = [f.name for f in self.fields]
        self.record = record
        index = {n: i for i, n in enumerate(self.names)}
        self.checks = tuple(self._compile(c, index) for c in checks)  # a record's: per item
        due: list[list[Check]] = [[] for _ in self.names]
        for c, check in zip(checks, self.checks, strict=True):
            if record is None:
                due[index[c[0]]].append(check)
        self.steps: list[_Step] = []
        run: list[int] = []
        for i, f in enumerate(self.fields):
            if f.kind in ("fixed", *_INT_FORMATS):
                run.append(i)
                if due[i] or i + 1 == len(self.fields):
                    self._add_run(run, due[i])
                    run = []
                continue
            if run:
                self._add_run(run, [])
                run = []
            self.steps.append(_Step(f.kind, i, 1, None, f.item, tuple(due[i])))
        self.fixed = [(i, f) for i, f in enumerate(self.fields) if f.kind == "fixed"]
        self.writers = [self._writer(step) for step in self.steps]
        get = operator.attrgetter(*self.names)
        self.values = get if len(self.names) > 1 else (lambda obj: (get(obj),))
        # All the fields as one struct, when all are fixed-width: a list item (a record, or
        # list<u32>'s one integer), PREPARE, STATUS...
        whole = len(self.steps) == 1 and self.steps[0].run is not None
        self.packed = self.steps[0].run if whole else None

    @staticmethod
    def _field(name: str, kind: str, arg: int | str = 0) -> _Field:
        if kind == "list":
            return _Field(name, kind, 0, _ITEMS[str(arg)])
        return _Field(name, kind, int(arg))

    def _add_run(self, run: list[int], due: list[Check]) -> None:
        s = struct.Struct(">" + "".join(self.fields[i].format for i in run))
        self.steps.append(_Step("run", run[0], len(run), s, None, tuple(due)))

    def _compile(self, c: tuple[Any, ...], index: dict[str, int]) -> Check:
        _, name, test, arg, when_name, when_in = c
        i, when = index[name], index.get(when_name)
        length = self.fields[i].kind == "bytes"

        def check(vals: Sequence[Any]) -> None:
            if when is not None and vals[when] not in when_in:
                return
            v = len(vals[i]) if length else vals[i]
            if test == "in":
                ok = v in arg
            elif test == "max":
                ok = v <= arg
            else:
                ok = (v == NULL_DIGEST) == (test == "zero")
            if not ok:
                what = f"length {v}" if length else (v.hex() if isinstance(v, bytes) else v)
                cond = f" with {when_name} {vals[when]}" if when is not None else ""
                raise WireError("field", f"{name}: {what}{cond} fails {test} {arg}")

        return check

    def read(self, r: _Reader) -> list[Any]:
        vals: list[Any] = []
        for step in self.steps:
            name = self.names[step.start]
            if step.run is not None:
                vals += step.run.unpack(r.take(step.run.size, name))
            elif step.kind == "bytes":
                vals.append(r.bytes_(name))
            elif step.kind == "blist":
                vals.append([r.bytes_(f"{name}[{i}]") for i in range(r.count(name))])
            else:
                vals.append(step.item.read_items(r, name))
            for check in step.checks:
                check(vals)
        return vals

    def read_items(self, r: _Reader, name: str) -> list[Any]:
        assert self.packed is not None, "list items are fixed-width"
        n = r.count(name)
        raw = r.take(n * self.packed.size, name)
        if self.record is None:
            return [t[0] for t in self.packed.iter_unpack(raw)]
        items = [self.record(*t) for t in self.packed.iter_unpack(raw)]
        for it in items:
            for check in self.checks:
                check(it)
        return items

    def _writer(self, step: _Step) -> Callable[[Sequence[Any]], bytes]:
        i, name = step.start, self.names[step.start]
        if step.run is not None:
            pack, end = step.run.pack, i + step.count
            return (lambda v: pack(v[i])) if step.count == 1 else (lambda v: pack(*v[i:end]))
        if step.kind == "bytes":
            return lambda v: _bytes(v[i])
        item = _bytes if step.kind == "blist" else step.item.write_item

        def write_list(v: Sequence[Any]) -> bytes:
            _check_count(name, v[i])
            return _u32(len(v[i])) + b"".join(map(item, v[i]))

        return write_list

    def write(self, vals: Sequence[Any]) -> bytes:
        for i, f in self.fixed:
            if len(vals[i]) != f.size:
                _check_fixed(f.name, f.size, vals[i])
        if self.packed is not None:
            return self.packed.pack(*vals)
        return b"".join([w(vals) for w in self.writers])

    def write_item(self, item: Any) -> bytes:
        assert self.packed is not None, "list items are fixed-width"
        if self.record is None:
            return self.packed.pack(item)
        for i, f in self.fixed:
            _check_fixed(f.name, f.size, item[i])
        return self.packed.pack(*item)

    def dump(self, vals: Sequence[Any]) -> list[str]:
        return [f"{f.name}={f.show(v)}" for f, v in zip(self.fields, vals, strict=True)]

    def show_item(self, item: Any) -> str:
        if self.record is None:
            return str(item)
        return "/".join(f.show(v) for f, v in zip(self.fields, item, strict=True))


# The list items' codecs by record name; "u32": a list<u32>'s plain integers.
_ITEMS: dict[str, _Codec] = {"u32": _Codec((("value", "u32"),), ())}


def _record(name: str, doc: str) -> Any:
    """The NamedTuple of record `name` (zz.wire_table.RECORDS), its codec in _ITEMS."""
    fields = RECORDS[name]
    cls_name = "".join(p.capitalize() for p in name.split("_"))
    cls = NamedTuple(cls_name, [(f[0], bytes if f[1] == "fixed" else int) for f in fields])
    cls.__doc__ = doc
    _ITEMS[name] = _Codec(fields, CHECKS.get(name, ()), cls)
    return cls


Entry = _record("entry", "VIEW-CHANGE P/Q entry: 44 bytes on the wire.")
Choice = _record("choice", "NEW-VIEW choice: 40 bytes; a null digest means a null request.")
RowEntry = _record(
    "row_entry",
    "FAULT-STATEMENT row entry: 37 bytes. `state` is ROW_NONE (digest null), ROW_ONTIME or "
    "ROW_LATE.",
)
ReplyRef = _record(
    "reply_ref", "EXEC-REPORT reply_ref: 44 bytes; `result_digest` = SHA-256(result)."
)
assert set(_ITEMS) == {"u32", *RECORDS}, "a record of zz.wire_table has no class here"

_LAYOUTS = {name: _Codec(fields, CHECKS.get(name, ())) for name, fields in LAYOUTS.items()}


# The reply_ref of an EXEC-REPORT for a checkpoint seq that carries the replica's execution
# checkpoint digest (docs/wire.md "EXEC-REPORT"): no client has this principal, so nothing
# is ever affirmed with it, and the report's digest covers the checkpoint digest, which makes
# a checkpoint liar a mismatch like a wrong reply.
CHECKPOINT_REF_CLIENT = 0xFFFFFFFF


def checkpoint_ref(seq: int, checkpoint: bytes) -> ReplyRef:
    return ReplyRef(CHECKPOINT_REF_CLIENT, seq, checkpoint)


# ---- messages ---------------------------------------------------------------


@dataclass
class Message:
    """Common header fields; a subclass made by @_message adds the body's fields, in wire
    order, from zz.wire_table (declared in wire/messages.toml), and encoding, decoding and
    the dump follow from that table. `auth` is the raw authenticator."""

    TYPE: ClassVar[int] = 0
    NAME: ClassVar[str] = ""
    AUTH: ClassVar[int] = AUTH_NONE
    _CODEC: ClassVar[_Codec]

    service: int
    sender: int
    auth: bytes = field(default=b"", kw_only=True, repr=False)

    def _values(self) -> Sequence[Any]:
        return self._CODEC.values(self)

    def body(self) -> bytes:
        return self._CODEC.write(self._values())

    @classmethod
    def _parse(cls, r: _Reader, service: int, sender: int) -> Self:
        return cls(service, sender, *cls._CODEC.read(r))

    def _dump_fields(self) -> list[str]:
        return self._CODEC.dump(self._values())

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

    def verify_mac_received(self, raw: bytes, receiver: int, key: bytes) -> bool:
        """verify_mac over `raw`, the bytes this message was decoded from (decode(raw)):
        what the sender authenticated, as received. decode is strict (reserved byte 0,
        the body read to its end, the authenticator after it), so these are the bytes
        authed() would make again, without re-encoding them (three copies of a 4 MiB
        FETCH-REPLY's log, each time one arrives)."""
        end = len(raw) - len(self.auth)
        for rcv, mac in self.mac_entries():
            if rcv == receiver:
                return ct_equal(mac, hmac_sha256(key, memoryview(raw)[:end]))
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


# The message classes by (type, auth kind); MESSAGE_TYPES below by type.
_CLASSES: dict[tuple[int, int], type[Message]] = {}


def _message(name: str) -> Callable[[type], Any]:
    """Make the decorated class message `name` of zz.wire_table.MESSAGES: its TYPE and
    AUTH, and its body's fields in wire order, a dataclass after Message's header fields
    (optional ones default to 0, empty, all zero)."""
    ((mtype, (auth, *_), layout),) = [
        (t, kinds, lay) for t, (n, kinds, lay) in MESSAGES.items() if n == name
    ]

    def make(cls: type) -> Any:
        codec = _LAYOUTS[layout]
        cls.TYPE, cls.NAME, cls.AUTH, cls._CODEC = mtype, name, auth, codec
        cls.__annotations__ = {f.name: f.annotation for f in codec.fields}
        for f in codec.fields:
            if f.name in OPTIONAL.get(layout, ()):
                setattr(cls, f.name, f.zero)
        _CLASSES[(mtype, auth)] = dataclass(cls)
        return cls

    return make


@_message("REQUEST")
class Request(Message):
    """A client operation; the first copy of a request (auth kind 1, MACs only)."""

    @property
    def read_only(self) -> bool:
        return bool(self.flags & FLAG_READONLY)

    @property
    def ordered_read(self) -> bool:
        return bool(self.flags & FLAG_ORDERED_READ)

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


_CLASSES[(SignedRequest.TYPE, SignedRequest.AUTH)] = SignedRequest


@_message("REPLY")
class Reply(Message):
    """The result of a request, from an agreement or an execution replica."""

    @property
    def read_only(self) -> bool:
        return bool(self.flags & FLAG_READONLY)

    @property
    def rejected(self) -> tuple[int, int] | None:
        """(reason, limit) of a REJECTED reply, else None."""
        if not self.flags & FLAG_REJECTED:
            return None
        return self.result[0], int.from_bytes(self.result[1:5], "big")


def batch_encoding(nd_time: int, nd_seed: int, requests: Sequence[bytes]) -> bytes:
    """PRE-PREPARE body from nd_time on; also FETCH-REPLY kind 1 data."""
    return _LAYOUTS["batch"].write([nd_time, nd_seed, requests])


def batch_digest(nd_time: int, nd_seed: int, requests: Sequence[bytes]) -> bytes:
    return sha256(batch_encoding(nd_time, nd_seed, requests))


def decode_batch(buf: bytes) -> tuple[int, int, list[bytes]]:
    r = _Reader(buf, 0, len(buf))
    nd_time, nd_seed, reqs = _LAYOUTS["batch"].read(r)
    r.done("batch")
    return nd_time, nd_seed, reqs


@_message("PRE-PREPARE")
class PrePrepare(Message):
    """The primary's proposal; the batch digest hashes the body from nd_time on."""

    def batch(self) -> bytes:
        return batch_encoding(self.nd_time, self.nd_seed, self.requests)

    def digest(self) -> bytes:
        return sha256(self.batch())


@_message("PREPARE")
class Prepare(Message):
    """A backup's vote for the batch `digest` at `seq` in `view`."""


@_message("COMMIT")
class Commit(Message):
    """An agreement replica's commit vote."""


@_message("CHECKPOINT")
class Checkpoint(Message):
    """A signed statement of the state digest after executing `seq`."""


@_message("VIEW-CHANGE")
class ViewChange(Message):
    """Signed by a replica moving to `new_view`: its checkpoint proof, P and Q."""


@_message("NEW-VIEW")
class NewView(Message):
    """Signed by the primary of `view`: the view changes and the choice made from them."""


@_message("FETCH")
class Fetch(Message):
    """Ask one replica for a batch, a checkpoint state or the committed log."""


@_message("FETCH-REPLY")
class FetchReply(Message):
    """The answer to FETCH."""


@_message("STATUS")
class Status(Message):
    """Sent while a replica waits, so that peers retransmit what was lost."""


# ---- execution messages (ZZ §4.1-4.2) -------------------------------------------


@_message("EXEC-COMMIT")
class ExecCommit(Message):
    """An agreement replica's statement that batch `seq` committed (null digest and
    empty batch for a null request). The codec does not check that the batch hashes
    to the digest: the execution replica does, as part of its commit certificate."""


@_message("EXEC-REPORT")
class ExecReport(Message):
    """The codec does not check that `reply_digest` hashes `replies` (the receiver does,
    with `digest_ok`, and drops the report as a `field` error otherwise)."""

    @classmethod
    def of(cls, service: int, sender: int, seq: int, replies: Sequence[ReplyRef]) -> Self:
        """A report whose digest hashes its reply list, as a correct replica sends it."""
        return cls(service, sender, seq, reply_digest(replies), list(replies))

    def digest_ok(self) -> bool:
        return ct_equal(reply_digest(self.replies), self.reply_digest)


@_message("EXEC-CHECKPOINT")
class ExecCheckpoint(Message):
    """An execution replica's signed checkpoint digest at `seq`."""


# ---- fault detection and control messages (ZZ §4.3, docs/fault-detection.md) ----------


@_message("FAULT-STATEMENT")
class FaultStatement(Message):
    """Agreement replica `sender`'s signed row for `seq`: one entry per awake execution
    replica, ascending replica id (the evaluator, not the codec, checks the order)."""


@_message("WAKEUP")
class Wakeup(Message):
    """A self-certifying wake-up order: `evidence` holds complete signed FAULT-STATEMENT
    messages; the verifier (zz/certs.py, agreement/src/peer_certs.c) checks them."""


@_message("SHUTDOWN")
class Shutdown(Message):
    """One agreement replica's resolution of the round at `seq`; g+1 identical bodies from
    distinct agreement replicas make a SHUTDOWN certificate."""


@_message("REPLY-AFFIRM")
class ReplyAffirm(Message):
    """An agreement replica's statement that the request (client, timestamp) has the
    certified result whose SHA-256 is `result_digest`."""


@_message("CONTROL")
class Control(Message):
    """Operator -> controld RPC (service 0); `json` is a UTF-8 JSON object."""


@_message("CONTROL-REPLY")
class ControlReply(Message):
    """controld's answer to CONTROL, with the request's id."""


# ---- state fetching (ZZ §4.5, docs/recovery.md) -------------------------------------

FILE_MAX_CHUNK = 4194304
# The server's challenge on one connection (FILE-DATA status 6), which every FILE-FETCH
# on that connection carries (docs/wire.md "State fetching", docs/security.md).
FILE_CHALLENGE_LEN = 16
FILE_STATUS_CHALLENGE = 6


@_message("FILE-FETCH")
class FileFetch(Message):
    """A recovering execution replica asks a peer for a range of one checkpoint file
    (empty path: the manifest encoding). Bound to one server (`target`, its principal)
    and to one connection to it (`challenge`, the server's challenge on that connection;
    empty to ask for it), so a captured request cannot be replayed elsewhere."""

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


@_message("FILE-DATA")
class FileData(Message):
    """The answer to FILE-FETCH. Unauthenticated: the content is checked against the
    certified manifest by the requester."""


@_message("SPARE-READY")
class SpareReady(Message):
    """controld of the replica's host → the service's agreement replicas: a fresh sleeping
    replica stands under index `replica`. `seq` is the SHUTDOWN seq that convicted the
    previous incarnation (0 for a first provisioning); zz-agreed takes it only as the answer
    to that conviction, so an old SPARE-READY replayed after a later one does nothing.
    `epoch` numbers the slot's key generations (0: the key directory's keys); `sign_pub` and
    `dh_pub` are the new incarnation's Ed25519 and X25519 public keys: from then on the slot's
    messages verify only under them (docs/wire.md, "Key epochs")."""


def reply_ref(client: int, timestamp: int, result: bytes) -> ReplyRef:
    return ReplyRef(client, timestamp, sha256(result))


def reply_digest(refs: Iterable[ReplyRef]) -> bytes:
    """EXEC-REPORT reply_digest: SHA-256 of the concatenated reply_ref encodings, in batch
    order; the caller leaves out requests skipped as duplicates."""
    return sha256(b"".join(map(_ITEMS["reply_ref"].write_item, refs)))


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
    t: _CLASSES[(t, kinds[0])] for t, (_, kinds, _) in MESSAGES.items()
}
assert set(_CLASSES) == {(t, k) for t, (_, kinds, _) in MESSAGES.items() for k in kinds}


def _check_auth_shape(kind: int, auth: bytes) -> None:
    """The authenticator has exactly the size its kind implies (kind 3: a MAC vector, then a
    signature)."""
    if kind in (AUTH_MAC, AUTH_MAC_SIG):
        if len(auth) < 2:
            raise WireError("auth", "MAC vector without a count")
        n = int.from_bytes(auth[:2], "big")
        if n > MAX_MACS:
            raise WireError("length", f"MAC vector count {n} > {MAX_MACS}")
        sig = SIG_LEN if kind == AUTH_MAC_SIG else 0
        if len(auth) != 2 + MAC_ENTRY_LEN * n + sig:
            raise WireError("auth", f"MAC vector of {n} (+ {sig} signature bytes) in {len(auth)}")
    elif kind == AUTH_SIG:
        if len(auth) != SIG_LEN:
            raise WireError("auth", f"signature of {len(auth)} bytes")
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
    if mtype not in MESSAGE_TYPES:
        raise WireError("type", f"unknown type {mtype}")
    cls = _CLASSES.get((mtype, auth_kind))
    if cls is None:
        raise WireError("type", f"{MESSAGE_TYPES[mtype].NAME} with auth_kind {auth_kind}")
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
