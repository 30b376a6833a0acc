# zz/audit.py - controld's audit log of certificates: one append-only, fsynced, hash-chained
# file per host holding every WAKEUP, SHUTDOWN and SPARE-READY its controld received or sent,
# with the full signed bytes and the verdict; the offline verifier and the story of a
# service (`zz audit verify|show`). docs/audit.md. The writer is controld's (daemon.py).
"""The certificate audit log (docs/audit.md).

File ``<controld home>/audit.log``, a sequence of records::

    record = u32 body_len | body | hash (32 bytes)
    body   = u32 header_len | header (JSON, UTF-8, sorted keys) | message*
    message= u32 len | the message exactly as received or sent (a signed wire message)
    hash   = SHA-256(prev_hash || body)       prev_hash of the first record: 32 zero bytes

The header carries ``v`` (1), ``n`` (0, 1, ...), ``prev`` (prev_hash in hex), ``time``
(Unix seconds), ``host``, ``kind``, ``verdict`` and, where they apply, ``service``,
``sender``, ``seq``, ``reason`` and ``detail`` (a refusal's zz.certs reason), and the
fields of what was decided (``wake``, ``convict``, ...). Integers big-endian.

A record is written with one write(2) and fsynced before controld acts on the
certificate. A crash can leave the last record incomplete (a *torn tail*): readers report
it and never take it for an entry; controld, when it opens the log again, saves those
bytes to ``audit.log.torn-<offset>``, cuts the file there and logs a ``torn-tail`` entry.
Anything else that does not chain (a changed, removed or reordered record) breaks the
chain at that entry: everything from it on is untrusted.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zz import certs, keys, wire
from zz.config import Config, Service

VERSION = 1
FILE_NAME = "audit.log"
HASH_LEN = 32
GENESIS = bytes(HASH_LEN)
MAX_BODY = 64 << 20  # far above anything controld logs (a frame is at most 1 MiB)
_U32 = struct.Struct(">I")

# kind -> the verdicts that claim the message(s) verified when they were logged: each such
# entry is checked again offline, and one that does not verify is an error.
AUTHENTIC = {
    "wakeup": {"acted", "duplicate", "stale", "sibling"},
    "shutdown": {"vote", "late"},
    "shutdown-certificate": {"acted", "merged", "stale", "sibling"},
    "spare-ready": {"sent", "stored"},
}
# Refusals of messages that may well verify: the round was seen already, or the message
# is not for controld. Any other refusal of one that verifies offline is worth a note.
NOT_ABOUT_SIGNATURES = {"conflicting", "duplicate", "stale", "sibling", "unexpected-type",
                        "unknown-service"}  # fmt: skip
# Entries that led to an action (never rate limited).
ACTING = {
    ("wakeup", "acted"),
    ("shutdown-certificate", "acted"),
    ("shutdown-certificate", "merged"),
    ("spare-ready", "sent"),
    ("spare-ready", "stored"),
    ("action", "done"),
}
# Certificates acted on (the events of `zz audit verify --json`).
CERTIFICATES_ACTED = {
    ("wakeup", "acted"),
    ("shutdown-certificate", "acted"),
    ("shutdown-certificate", "merged"),
}


class AuditError(Exception):
    """The audit log cannot be opened or written."""


@dataclass(frozen=True)
class Entry:
    n: int
    offset: int
    header: dict[str, Any]
    messages: tuple[bytes, ...]
    hash: bytes

    @property
    def kind(self) -> str:
        return str(self.header.get("kind", ""))

    @property
    def verdict(self) -> str:
        return str(self.header.get("verdict", ""))

    @property
    def time(self) -> float:
        t = self.header.get("time", 0.0)
        return float(t) if isinstance(t, int | float) else 0.0


@dataclass(frozen=True)
class Torn:
    """An incomplete record at the end of the file (a crash during the append)."""

    offset: int
    length: int


@dataclass
class Scan:
    """What a walk of the chain found. ``error``: the chain breaks at ``entries[-1].n + 1``
    (offset ``end``); nothing from there on is trusted."""

    entries: list[Entry] = field(default_factory=list)
    end: int = 0  # the offset after the last good record
    head: bytes = GENESIS  # hash of the last good record
    torn: Torn | None = None
    error: str | None = None


def _json(header: Mapping[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def encode_record(
    prev: bytes, n: int, header: Mapping[str, Any], messages: Sequence[bytes] = ()
) -> tuple[bytes, bytes]:
    """The record's bytes and its hash, chained to `prev`."""
    hdr = _json({**header, "v": VERSION, "n": n, "prev": prev.hex()})
    body = b"".join([_U32.pack(len(hdr)), hdr, *(_U32.pack(len(m)) + bytes(m) for m in messages)])
    h = hashlib.sha256(prev + body).digest()
    return _U32.pack(len(body)) + body + h, h


def _parse_body(body: bytes) -> tuple[dict[str, Any], tuple[bytes, ...]]:
    if len(body) < 4:
        raise ValueError("body shorter than its header length")
    (hl,) = _U32.unpack_from(body, 0)
    if 4 + hl > len(body):
        raise ValueError(f"header length {hl} beyond the body")
    header = json.loads(body[4 : 4 + hl].decode())
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    msgs, o = [], 4 + hl
    while o < len(body):
        if o + 4 > len(body):
            raise ValueError("message length cut")
        (ml,) = _U32.unpack_from(body, o)
        if o + 4 + ml > len(body):
            raise ValueError(f"message length {ml} beyond the body")
        msgs.append(body[o + 4 : o + 4 + ml])
        o += 4 + ml
    return header, tuple(msgs)


def scan(data: bytes) -> Scan:
    """Walk the chain: every record must be complete, hash to what it says and carry the
    previous record's hash and the next number. Stops at the first record that does not."""
    out = Scan()
    o, prev, n = 0, GENESIS, 0
    while o < len(data):
        rest = len(data) - o
        if rest < 4 or not any(data[o:]):
            out.torn = Torn(o, rest)  # a length cut short, or a zero-filled tail
            break
        (bl,) = _U32.unpack_from(data, o)
        if bl < 4 or bl > MAX_BODY:
            out.error = f"entry {n} at offset {o}: body length {bl} out of range"
            break
        if rest < 4 + bl + HASH_LEN:
            out.torn = Torn(o, rest)
            break
        body = data[o + 4 : o + 4 + bl]
        stored = data[o + 4 + bl : o + 4 + bl + HASH_LEN]
        where = f"entry {n} at offset {o}"
        if hashlib.sha256(prev + body).digest() != stored:
            out.error = f"{where}: hash does not chain (changed, removed or reordered)"
            break
        try:
            header, msgs = _parse_body(body)
        except (ValueError, UnicodeDecodeError) as e:
            out.error = f"{where}: {e}"
            break
        if header.get("prev") != prev.hex() or header.get("n") != n:
            out.error = f"{where}: header names entry {header.get('n')} after {header.get('prev')}"
            break
        out.entries.append(Entry(n, o, header, msgs, stored))
        prev, n = stored, n + 1
        o += 4 + bl + HASH_LEN
        out.end, out.head = o, prev
    return out


def read(path: Path) -> Scan:
    return scan(path.read_bytes())


class AuditLog:
    """controld's writer. One per host directory (an exclusive flock on the file): two
    writers would interleave records and break the chain.

    Entries that did not lead to an action (refused, duplicates, votes) share a budget
    (``burst``, refilled at ``rate`` per second): a peer flooding well-formed but refused
    messages costs a count (``suppressed``), not a disk. The next entry written says how
    many were left out before it.
    """

    def __init__(self, path: Path, host: str, *, burst: int = 1024, rate: float = 16.0) -> None:
        self.path = path
        self.host = host
        self.notes: list[str] = []  # what open() found (torn tail, broken chain)
        self.entries = 0
        self.head = GENESIS
        self.suppressed = 0  # in all
        self._pending_suppressed = 0  # since the last entry written
        self.failed = 0
        self._burst, self._rate = float(burst), rate
        self._tokens, self._t = float(burst), time.monotonic()
        self._fd = -1
        self._size = 0
        self._opened = False

    @classmethod
    def open(cls, path: Path, host: str, **kw: Any) -> AuditLog:
        """Open (or create) the log, settle a torn tail or a broken chain (both noted in
        ``notes`` and logged as an entry), and append a ``start`` entry."""
        log = cls(path, host, **kw)
        log.ensure_open()
        return log

    def ensure_open(self) -> None:
        """Open the file, once (a log closed again stays closed)."""
        if self._opened:
            return
        self._opened = True
        try:
            self._open()
        except OSError as e:
            self.close()
            raise AuditError(f"{self.path}: cannot open: {e}") from e
        except BaseException:
            self.close()
            raise

    def _lock(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise AuditError(f"{self.path}: in use by another controld") from None

    def _open(self) -> None:
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock()
        found = scan(path.read_bytes())
        extra: dict[str, Any] = {}
        if found.error is not None:
            # Never append to a chain that does not verify: set it aside as evidence.
            aside = _unused(path.with_name(f"{path.name}.broken-{int(time.time())}"))
            os.rename(path, aside)
            self.close()
            self._lock()
            self.notes.append(f"audit log chain broken ({found.error}): set aside as {aside}")
            extra["previous_log"] = {"set_aside_as": str(aside), "error": found.error}
            found = Scan()
        self._size, self.entries, self.head = found.end, len(found.entries), found.head
        if found.torn is not None:
            t = found.torn
            data = path.read_bytes()[t.offset :]
            saved = _unused(path.with_name(f"{path.name}.torn-{t.offset}"))
            saved.write_bytes(data)
            _fsync_file(saved)
            os.ftruncate(self._fd, t.offset)
            os.fsync(self._fd)
            self.notes.append(
                f"audit log: torn tail of {t.length} bytes at offset {t.offset} (a crash"
                f" mid-append) cut off, saved as {saved}"
            )
            self._append({"kind": "torn-tail", "verdict": "cut", "offset": t.offset,
                          "length": t.length, "sha256": hashlib.sha256(data).hexdigest(),
                          "saved_as": str(saved)})  # fmt: skip
        if self._size == 0:
            _fsync_dir(path.parent)  # a new file: its name must survive a crash too
        self._append({"kind": "start", "verdict": "", "pid": os.getpid(), **extra})

    def _allowed(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._t) * self._rate)
        self._t = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def append(self, header: Mapping[str, Any], messages: Sequence[bytes] = ()) -> Entry | None:
        """Write one entry and fsync it; None if the budget left it out. Raises AuditError
        (the file is cut back to the last whole record, so the chain stays intact)."""
        self.ensure_open()
        kind, verdict = header.get("kind"), header.get("verdict")
        if (kind, verdict) not in ACTING and not self._allowed():
            self.suppressed += 1
            self._pending_suppressed += 1
            return None
        return self._append(header, messages)

    def _append(self, header: Mapping[str, Any], messages: Sequence[bytes] = ()) -> Entry:
        if self._fd < 0:
            raise AuditError(f"{self.path}: not open")
        hdr = {"time": round(time.time(), 6), "host": self.host, **header}
        if self._pending_suppressed:
            hdr["suppressed_before"] = self._pending_suppressed
        rec, h = encode_record(self.head, self.entries, hdr, messages)
        try:
            written = os.write(self._fd, rec)
            if written != len(rec):
                raise OSError(f"short write ({written} of {len(rec)} bytes)")
            os.fsync(self._fd)
        except OSError as e:
            self.failed += 1
            try:
                os.ftruncate(self._fd, self._size)  # no torn record in the middle
            except OSError as e2:
                os.close(self._fd)
                self._fd = -1
                raise AuditError(f"{self.path}: append failed ({e}) and cut failed ({e2}):"
                                 " closed") from e  # fmt: skip
            raise AuditError(f"{self.path}: append failed: {e}") from e
        entry = Entry(self.entries, self._size, {**hdr, "n": self.entries}, tuple(messages), h)
        self._size += len(rec)
        self.entries += 1
        self.head = h
        self._pending_suppressed = 0
        return entry

    def status(self) -> dict[str, Any]:
        return {"path": str(self.path), "entries": self.entries, "head": self.head.hex(),
                "bytes": self._size, "suppressed": self.suppressed, "failed": self.failed,
                "open": self._fd >= 0}  # fmt: skip

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # the flock goes with it
            self._fd = -1


def _unused(p: Path) -> Path:
    out, k = p, 1
    while out.exists():
        out, k = p.with_name(f"{p.name}-{k}"), k + 1
    return out


def _fsync_file(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- offline verification ---------------------------------------------------------------


def log_paths(config: Config, host: str) -> list[Path]:
    """A host's log and every log set aside as broken, under controld's default home."""
    home = config.rack.run_dir / "controld" / host
    return [home / FILE_NAME, *sorted(home.glob(f"{FILE_NAME}.broken-*"))]


@dataclass
class Finding:
    level: str  # "error" | "warning" | "note"
    where: str
    text: str

    def __str__(self) -> str:
        return f"{self.level}: {self.where}: {self.text}"


class Trust:
    """The rack's public keys, loaded once per service (zz.keys, the rack's key_dir)."""

    def __init__(self, config: Config, key_dir: Path | None = None) -> None:
        self.config = config
        self.key_dir = Path(key_dir or config.rack.key_dir)
        self._svc: dict[int, certs.ServiceTrust] = {}
        self._rack: dict[int, bytes] | None = None

    def service(self, sid: int) -> Service | None:
        for s in self.config.services:
            if s.id == sid:
                return s
        return None

    def service_trust(self, svc: Service) -> certs.ServiceTrust:
        if svc.id not in self._svc:
            pub = keys.load_public(keys.public_path(self.key_dir, svc.id))
            self._svc[svc.id] = certs.ServiceTrust(svc.id, pub, svc.f, svc.g, svc.n_exec)
        return self._svc[svc.id]

    def rack_public(self) -> dict[int, bytes]:
        if self._rack is None:
            self._rack = keys.load_public(keys.public_path(self.key_dir, keys.RACK_SERVICE))
        return self._rack


def recheck(entry: Entry, trust: Trust) -> tuple[bool, str]:
    """Verify the entry's messages again with the rack's keys: (verifies, why not / what
    they establish). Only for kinds that carry messages."""
    h = entry.header
    sid = h.get("service")
    svc = trust.service(sid) if isinstance(sid, int) else None
    if svc is None:
        return False, f"unknown service {sid!r}"
    t = trust.service_trust(svc)
    if not entry.messages:
        return False, "no message"
    try:
        if entry.kind == "wakeup":
            w = certs.verify_wakeup(entry.messages[0], keys=t.keys, f=svc.f, g=svc.g,
                                    n_exec=svc.n_exec, service=svc.id)  # fmt: skip
            for name, got in (("seq", w.seq), ("wake", list(w.wake)), ("awake", list(w.awake))):
                if name in h and h[name] != got:
                    return False, f"the header says {name} {h[name]}, the certificate {got}"
            return True, f"seq {w.seq} wake {list(w.wake)} signers {list(w.signers)}"
        if entry.kind == "shutdown":
            m = certs.verify_shutdown_vote(entry.messages[0], t)
            return True, f"vote of agreement {m.sender} for seq {m.seq}"
        if entry.kind == "shutdown-certificate":
            col = certs.ShutdownCollector(t)
            cert = None
            for raw in entry.messages:
                cert = col.add(raw) or cert
            if cert is None:
                return False, f"{len(entry.messages)} votes make no certificate (g+1 = {svc.g + 1})"
            for name in ("seq", "awake", "convict", "sleep", "active", "signers"):
                got = list(getattr(cert, name)) if name != "seq" else cert.seq
                if name in h and h[name] != got:
                    return False, f"the header says {name} {h[name]}, the votes {got}"
            return True, f"seq {cert.seq} signed by {list(cert.signers)}"
        if entry.kind == "spare-ready":
            m = keys.verify_spare_ready(entry.messages[0], trust.config, svc, trust.rack_public())
            return True, f"x{m.replica} seq {m.seq} epoch {m.epoch} signed by host {m.sender}"
    except certs.CertError as e:
        return False, str(e)
    except keys.SpareKeyError as e:
        return False, f"spare-ready: {e}"
    return False, f"kind {entry.kind!r} carries no certificate"


def verify(entries: Iterable[Entry], trust: Trust, where: str) -> list[Finding]:
    """Findings for a chain that hashed correctly: an entry logged as authentic (acted,
    a vote, ...) whose messages do not verify now is an error."""
    out: list[Finding] = []
    for e in entries:
        at = f"{where} entry {e.n} ({_clock(e.time)} {e.kind} {e.verdict})"
        if e.kind == "torn-tail":
            out.append(Finding("warning", at, f"a torn tail of {e.header.get('length')} bytes"
                               f" was cut at offset {e.header.get('offset')} (controld crashed"
                               f" mid-append), saved as {e.header.get('saved_as')}"))  # fmt: skip
            continue
        if e.kind == "start" and "previous_log" in e.header:
            prev = e.header["previous_log"]
            out.append(Finding("warning", at, f"started a new log: the previous one did not"
                               f" chain ({prev.get('error')}), set aside as"
                               f" {prev.get('set_aside_as')}"))  # fmt: skip
        if e.kind not in AUTHENTIC:
            continue
        ok, why = recheck(e, trust)
        if e.verdict in AUTHENTIC[e.kind]:
            if not ok:
                text = f"logged as {e.verdict} but does not verify: {why}"
                out.append(Finding("error", at, text))
        elif ok and e.header.get("reason") not in NOT_ABOUT_SIGNATURES:
            out.append(Finding("note", at, f"refused as {e.header.get('reason')} then, verifies"
                               " now (were the keys changed?)"))  # fmt: skip
    return out


# ---- describing entries -----------------------------------------------------------------


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def _who(pid: object) -> str:
    if not isinstance(pid, int):
        return "?"
    kind, i = wire.principal_kind(pid)
    return {"agreement": f"agreement {i}", "exec": f"x{i}", "host": f"controld of host {i}",
            "client": f"client {i}", "operator": f"operator {i}"}[kind]  # fmt: skip


def _xs(ids: object) -> str:
    return ", ".join(f"x{i}" for i in ids) if isinstance(ids, list) and ids else "-"


def statements(raw: bytes) -> list[wire.FaultStatement]:
    """The FAULT-STATEMENTs a WAKEUP carries (what decodes of them)."""
    try:
        m = wire.decode(raw)
    except (wire.WireError, ValueError):
        return []
    if not isinstance(m, wire.Wakeup):
        return []
    out = []
    for ev in m.evidence:
        try:
            s = wire.decode(ev)
        except (wire.WireError, ValueError):
            continue
        if isinstance(s, wire.FaultStatement):
            out.append(s)
    return out


def _entry_text(e: wire.RowEntry) -> str:
    if e.state == wire.ROW_NONE:
        return f"x{e.replica} no report"
    when = "on time" if e.state == wire.ROW_ONTIME else "late"
    return f"x{e.replica} {when} {e.digest.hex()[:8]}"


def statement_lines(raw: bytes) -> list[str]:
    """One line per fault statement: its signer's row (what each awake replica reported)."""
    return [
        f"{_who(s.sender)} at seq {s.seq}: " + ", ".join(_entry_text(e) for e in s.row)
        for s in statements(raw)
    ]


def why(raw: bytes) -> str:
    """The fault the statements show: replies that differ, replicas that sent nothing or
    were late."""
    stmts = statements(raw)
    if not stmts:
        return "?"
    digests: dict[int, set[bytes]] = {}
    missing: set[int] = set()
    late: set[int] = set()
    for s in stmts:
        for e in s.row:
            if e.state == wire.ROW_NONE:
                missing.add(e.replica)
            else:
                digests.setdefault(e.replica, set()).add(e.digest)
                if e.state == wire.ROW_LATE:
                    late.add(e.replica)
    parts = []
    values = {d for ds in digests.values() for d in ds}
    if len(values) > 1:
        groups: dict[bytes, list[int]] = {}
        for x, ds in sorted(digests.items()):
            for d in ds:
                groups.setdefault(d, []).append(x)
        parts.append("replies differ (" + "; ".join(
            f"{_xs(xs)}: {d.hex()[:8]}" for d, xs in groups.items()) + ")")  # fmt: skip
    if missing:
        parts.append(f"no report from {_xs(sorted(missing))}")
    if late:
        parts.append(f"late report from {_xs(sorted(late))}")
    return "; ".join(parts) or "no fault shown"


def describe(e: Entry) -> list[str]:
    """What the entry records, in words: a first line and indented details."""
    h = e.header
    v = e.verdict
    seq = h.get("seq")
    by = _who(h.get("sender"))
    refusal = f"{h.get('reason')}" + (f": {h['detail']}" if h.get("detail") else "")
    if e.kind == "start":
        return [f"controld started (pid {h.get('pid')})"]
    if e.kind == "torn-tail":
        return [f"torn tail of {h.get('length')} bytes cut at offset {h.get('offset')}"]
    if e.kind == "action":
        lines = [str(x) for x in h.get("lines", [])] or ["nothing done"]
        what = h.get("what", "action")
        if what == "fresh-spare":  # a convicted slot's successor, provisioned in the background
            what = f"fresh spare x{h.get('index')} of SHUTDOWN"
        return [f"{what} seq {seq} led to: {lines[0]}", *lines[1:]]
    if e.kind == "wakeup":
        if v == "refused":
            return [f"WAKEUP seq {seq} from {by} REFUSED ({refusal})"]
        # An empty wake list: nobody asleep, a round decided from the awake replicas'
        # reports (docs/fault-detection.md §4a).
        wake = _xs(h.get("wake")) if h.get("wake") else "nobody"
        head = f"WAKEUP seq {seq} from {by}, round awake [{_xs(h.get('awake'))}]: wake {wake}"
        head += "" if v == "acted" else f" ({v}: not acted on again)"
        if v != "acted" or not e.messages:
            return [head]
        lines = [
            head,
            f"  why: {why(e.messages[0])}",
            f"  fault statements of {', '.join(_who(s) for s in h.get('signers', []))}:",
        ]
        return lines + [f"    {x}" for x in statement_lines(e.messages[0])]
    if e.kind == "shutdown":
        if v == "refused":
            return [f"SHUTDOWN vote seq {seq} from {by} REFUSED ({refusal})"]
        return [f"SHUTDOWN vote seq {seq} from {by}: convict {_xs(h.get('convict'))}"
                f" sleep {_xs(h.get('sleep'))} active {_xs(h.get('active'))}"
                f"{' (late: round certified already)' if v == 'late' else ''}"]  # fmt: skip
    if e.kind == "shutdown-certificate":
        signed = ", ".join(_who(s) for s in h.get("signers", []))
        tail = "" if v == "acted" else f" ({v}: not acted on again)"
        if v == "merged":
            tail = (f" (merged with the outcome acted on at that seq: convict"
                    f" {_xs(h.get('merged_convict'))}, sleep {_xs(h.get('merged_sleep'))},"
                    f" active {_xs(h.get('merged_active'))})")  # fmt: skip
        return [f"SHUTDOWN certificate seq {seq}, round awake [{_xs(h.get('awake'))}], signed by"
                f" {signed}: convict {_xs(h.get('convict'))}, sleep {_xs(h.get('sleep'))},"
                f" active {_xs(h.get('active'))}{tail}"]  # fmt: skip
    if e.kind == "spare-ready":
        if v == "refused":
            return [f"SPARE-READY from {by} REFUSED ({refusal})"]
        if v == "stored":
            return [f"SPARE-READY x{h.get('replica')} seq {seq} epoch {h.get('epoch')} from {by}:"
                    " another host's re-keyed slot, its key kept here"]  # fmt: skip
        return [f"SPARE-READY x{h.get('replica')} seq {seq} epoch {h.get('epoch')}: fresh spare"
                f" announced to the agreement replicas"]  # fmt: skip
    return [f"{e.kind} {v}"]


@dataclass
class HostLog:
    host: str
    path: Path
    scan: Scan


def load_hosts(config: Config, host: str | None = None, path: Path | None = None) -> list[HostLog]:
    if path is not None:
        return [HostLog(host or path.parent.name, path, read(path))]
    out = []
    for h in config.hosts:
        if host is not None and h.name != host:
            continue
        for p in log_paths(config, h.name):
            if p.exists():
                out.append(HostLog(h.name, p, read(p)))
    return out


def story_entries(
    logs: Sequence[HostLog], service: Service
) -> list[tuple[float, list[str], Entry]]:
    """The service's entries in time order across hosts: (time, hosts, entry), a
    certificate several controlds logged alike once, naming every host."""
    rows: list[tuple[float, str, Entry]] = []
    for hl in logs:
        for e in hl.scan.entries:
            if e.header.get("service") == service.id:
                # An action is placed where it began (what it sent, e.g. a SPARE-READY,
                # is logged before the action's own entry).
                began = e.header.get("began", e.time)
                rows.append(
                    (float(began) if isinstance(began, int | float) else e.time, hl.host, e)
                )
    rows.sort(key=lambda r: (r[0], r[1], r[2].n))
    merged: list[tuple[float, list[str], Entry]] = []
    seen: dict[tuple[Any, ...], int] = {}
    for t, host, e in rows:
        key: tuple[Any, ...]
        if e.messages and e.kind != "action":
            key = (e.kind, e.verdict, hashlib.sha256(b"".join(e.messages)).digest())
        else:
            key = ("once", host, e.n, t)
        if key in seen:
            merged[seen[key]][1].append(host)
            continue
        seen[key] = len(merged)
        merged.append((t, [host], e))
    return merged


def story(logs: Sequence[HostLog], service: Service) -> list[str]:
    """The service's certificates in time order across hosts, grouped by round: a
    certificate several controlds logged alike is one line naming every host."""
    out: list[str] = []
    last_round: object = None
    for t, hosts, e in story_entries(logs, service):
        seq = e.header.get("seq")
        if seq != last_round and seq is not None:
            out.append(f"round seq {seq}:" if seq else "seq 0 (no round: provisioning):")
            last_round = seq
        first, *rest = describe(e)
        out.append(f"  {_clock(t)} [{', '.join(hosts)}] {first}")
        out += [f"      {x}" for x in rest]
    return out


# ---- zz audit verify | show -------------------------------------------------------------


def _service_name(trust: Trust, sid: object) -> str:
    svc = trust.service(sid) if isinstance(sid, int) else None
    return svc.name if svc is not None else f"service {sid}"


@dataclass
class LogCheck:
    """One log file as `zz audit verify` walked it, and what it shows was acted on."""

    host: str
    path: Path
    entries: int
    intact: bool
    head: str
    events: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class VerifyResult:
    logs: list[LogCheck]
    findings: list[Finding]
    tally: dict[str, int]

    @property
    def errors(self) -> int:
        return sum(f.level == "error" for f in self.findings)

    @property
    def warnings(self) -> int:
        return sum(f.level == "warning" for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": not self.errors,
            "errors": self.errors,
            "warnings": self.warnings,
            "entries": sum(x.entries for x in self.logs),
            "tally": dict(sorted(self.tally.items())),
            "logs": [
                {"host": x.host, "path": str(x.path), "entries": x.entries,
                 "chain_intact": x.intact, "head": x.head, "events": x.events}  # fmt: skip
                for x in self.logs
            ],
            "findings": [vars(f) for f in self.findings],
        }


def verify_logs(config: Config, logs: Sequence[HostLog]) -> VerifyResult:
    """Walk each log's chain, verify every certificate again with the rack's keys, and
    collect who was woken and convicted (`events`, per log: each acted-on WAKEUP and
    SHUTDOWN certificate, each action that woke or convicted)."""
    trust = Trust(config)
    result = VerifyResult([], [], {})
    for hl in logs:
        sc, at = hl.scan, f"{hl.host} {hl.path}"
        check = LogCheck(hl.host, hl.path, len(sc.entries), sc.error is None, sc.head.hex()[:16])
        result.logs.append(check)
        if sc.error is not None:
            result.findings.append(
                Finding("error", at, f"{sc.error}; nothing from there on is trusted")
            )
        if sc.torn is not None:
            t = sc.torn
            text = (
                f"torn tail: {t.length} bytes at offset {t.offset} are no entry (a crash"
                " mid-append; controld cuts it off at its next start)"
            )
            result.findings.append(Finding("warning", at, text))
        if hl.path.name != FILE_NAME:
            text = "a log controld set aside because its chain did not verify"
            result.findings.append(Finding("error", at, text))
        result.findings += verify(sc.entries, trust, f"{hl.host} {hl.path.name}")
        for e in sc.entries:
            key = f"{e.kind} {e.verdict}".strip()
            result.tally[key] = result.tally.get(key, 0) + 1
            base = {"n": e.n, "time": e.time, "kind": e.kind, "verdict": e.verdict}
            if (e.kind, e.verdict) in CERTIFICATES_ACTED:
                sid = e.header.get("service")
                check.events.append(
                    {**base, "service": _service_name(trust, sid), "lines": describe(e),
                     "header": e.header}  # fmt: skip
                )
            elif e.kind == "action":
                lines = [str(x) for x in e.header.get("lines", [])]
                acted = [x for x in lines if x.startswith(("woke ", "convicted "))]
                if acted:
                    check.events.append({**base, "lines": acted, "header": e.header})
    return result


def _no_log(config: Config, host: str | None, path: Path | None) -> str:
    hosts = [h.name for h in config.hosts if host in (None, h.name)]
    where = [str(path)] if path else [str(log_paths(config, h)[0]) for h in hosts]
    return f"no audit log ({', '.join(where)})"


def verify_command(
    config: Config,
    host: str | None = None,
    path: Path | None = None,
    out: Any = print,
) -> int:
    """`zz audit verify`: walk every host's chain, verify every certificate again with the
    rack's keys, print who was woken, convicted and why. 0 if all holds, 1 on any error
    (a broken chain, an entry logged as accepted that does not verify, no log at all)."""
    logs = load_hosts(config, host, path)
    if not logs:
        out(f"error: {_no_log(config, host, path)}")
        return 1
    result = verify_logs(config, logs)
    for check in result.logs:
        state = "chain intact" if check.intact else "CHAIN BROKEN"
        out(f"{check.host} {check.path}: {check.entries} entries, {state}, head {check.head}")
        for ev in check.events:
            if ev["kind"] == "action":
                for line in ev["lines"]:
                    out(f"  #{ev['n']} {_clock(ev['time'])}   -> {line}")
                continue
            first, *rest = ev["lines"]
            out(f"  #{ev['n']} {_clock(ev['time'])} {ev['service']}: {first}")
            for x in rest:
                out(f"      {x}")
    for f in result.findings:
        out(str(f))
    total = sum(x.entries for x in result.logs)
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(result.tally.items()))
    verdict = "FAILED" if result.errors else "ok"
    out(f"{verdict}: {len(logs)} log(s), {total} entries ({counts});"
        f" {result.errors} error(s), {result.warnings} warning(s)")  # fmt: skip
    return 1 if result.errors else 0


def verify_json(
    config: Config, host: str | None = None, path: Path | None = None
) -> tuple[dict[str, Any], int]:
    """`zz audit verify --json`: the same walk as a document, and the exit code."""
    logs = load_hosts(config, host, path)
    if not logs:
        return {"ok": False, "error": _no_log(config, host, path), "logs": []}, 1
    result = verify_logs(config, logs)
    return result.to_json(), 1 if result.errors else 0


def show_command(
    config: Config,
    service: str,
    host: str | None = None,
    path: Path | None = None,
    out: Any = print,
) -> int:
    """`zz audit show --service S`: the service's story across the hosts' logs."""
    svc = config.service(service)
    logs = load_hosts(config, host, path)
    if not logs:
        out("error: no audit log")
        return 1
    for hl in logs:
        if hl.scan.error is not None:
            out(f"warning: {hl.host} {hl.path}: {hl.scan.error}; what follows it is not shown")
        if hl.scan.torn is not None:
            out(f"warning: {hl.host} {hl.path}: a torn tail at offset {hl.scan.torn.offset}")
    lines = story(logs, svc)
    out(f"service {svc.name} (id {svc.id}, f={svc.f}, g={svc.g}), from {len(logs)} log(s):")
    for line in lines or ["  nothing logged"]:
        out(line)
    return 0


def show_json(
    config: Config, service: str, host: str | None = None, path: Path | None = None
) -> tuple[dict[str, Any], int]:
    """`zz audit show --json`: the service's entries in time order, each with the hosts
    that logged it, its round (seq), its header and the same words as the text."""
    svc = config.service(service)
    logs = load_hosts(config, host, path)
    doc: dict[str, Any] = {
        "service": {"name": svc.name, "id": svc.id, "f": svc.f, "g": svc.g},
        "logs": [
            {"host": hl.host, "path": str(hl.path), "error": hl.scan.error,
             "torn_at": hl.scan.torn.offset if hl.scan.torn else None}  # fmt: skip
            for hl in logs
        ],
        "entries": [
            {"time": t, "hosts": hosts, "n": e.n, "kind": e.kind, "verdict": e.verdict,
             "seq": e.header.get("seq"), "lines": describe(e), "header": e.header}  # fmt: skip
            for t, hosts, e in story_entries(logs, svc)
        ],
    }
    if not logs:
        doc["error"] = "no audit log"
        return doc, 1
    return doc, 0
