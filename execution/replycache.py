"""execution/replycache.py - per-client last reply, for exactly-once (docs/design.md §3.4).
Checkpointed as `.zz/replies` with one canonical encoding, so correct replicas hash it alike.
A read's result is not checkpointed (only its timestamp): a replica replaying a certified log
skips reads (ZZ §4.7.2) and could not write it, so no replica does."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

MAGIC = b"ZZRC"
VERSION = 2  # 2: reads' results are not kept
PATH = ".zz/replies"  # reserved runtime path in the state directory (docs/checkpoints.md)
MAX_ENTRIES = 1 << 24

_HEAD = struct.Struct(">4sBBHI")
_ENTRY = struct.Struct(">IQBI")
_READ_ONLY, _READ = 1, 2  # entry flags


class ReplyCacheError(ValueError):
    """A malformed `.zz/replies` encoding."""


@dataclass(frozen=True)
class CachedReply:
    timestamp: int
    read_only: bool  # the REPLY's read-only flag (the request was an unordered read)
    result: bytes | None  # None: a read whose result this replica does not hold
    read: bool = False  # it ran without write access: checkpoints keep no result


class ReplyCache:
    """client principal -> the reply to its latest executed request.

    `t` is new when it is above the cached timestamp; a request with t <= cached is
    never executed again (the client sends one request at a time, and timestamps only
    grow). The view is not state: replicas execute the same batch in different views.
    """

    def __init__(self) -> None:
        self._entries: dict[int, CachedReply] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[tuple[int, CachedReply]]:
        return iter(sorted(self._entries.items()))

    def get(self, client: int) -> CachedReply | None:
        return self._entries.get(client)

    def is_new(self, client: int, timestamp: int) -> bool:
        cur = self._entries.get(client)
        return cur is None or timestamp > cur.timestamp

    def cached(self, client: int, timestamp: int) -> CachedReply | None:
        """The stored reply if it answers exactly (client, timestamp)."""
        cur = self._entries.get(client)
        return cur if cur is not None and cur.timestamp == timestamp else None

    def record(
        self,
        client: int,
        timestamp: int,
        result: bytes | None,
        read_only: bool = False,
        read: bool = False,
    ) -> None:
        """`read`: the request ran without write access (an ordered read; an unordered
        one, `read_only`, is a read too)."""
        if not self.is_new(client, timestamp):
            raise ValueError(f"client {client}: timestamp {timestamp} is not new")
        read = read or read_only
        if result is None and not read:
            raise ValueError(f"client {client}: a write's result must be kept")
        self._entries[client] = CachedReply(
            timestamp, read_only, None if result is None else bytes(result), read
        )

    def encode(self) -> bytes:
        """Canonical: sorted by client id, so equal caches encode to equal bytes."""
        out = [_HEAD.pack(MAGIC, VERSION, 0, 0, len(self._entries))]
        for client, e in sorted(self._entries.items()):
            result = b"" if e.read or e.result is None else e.result
            flags = (_READ_ONLY if e.read_only else 0) | (_READ if e.read else 0)
            out.append(_ENTRY.pack(client, e.timestamp, flags, len(result)))
            out.append(result)
        return b"".join(out)

    @classmethod
    def decode(cls, data: bytes) -> ReplyCache:
        """Strict inverse of encode(); anything encode() would not produce is an error."""
        if len(data) < _HEAD.size:
            raise ReplyCacheError("reply cache: too short")
        magic, version, r1, r2, count = _HEAD.unpack_from(data)
        if magic != MAGIC or version != VERSION or r1 or r2:
            raise ReplyCacheError("reply cache: bad magic, version or reserved bytes")
        if count > MAX_ENTRIES:
            raise ReplyCacheError(f"reply cache: {count} entries > {MAX_ENTRIES}")
        pos = _HEAD.size
        rc = cls()
        last = -1
        for i in range(count):
            if len(data) - pos < _ENTRY.size:
                raise ReplyCacheError(f"reply cache: entry {i} truncated")
            client, ts, flags, n = _ENTRY.unpack_from(data, pos)
            pos += _ENTRY.size
            if client <= last:
                raise ReplyCacheError(f"reply cache: entry {i} not sorted by client")
            if flags not in (0, _READ, _READ_ONLY | _READ):
                raise ReplyCacheError(f"reply cache: entry {i} has flags {flags}")
            if flags and n:
                raise ReplyCacheError(f"reply cache: entry {i} keeps a read's result")
            if len(data) - pos < n:
                raise ReplyCacheError(f"reply cache: entry {i} result truncated")
            result = None if flags else bytes(data[pos : pos + n])
            rc._entries[client] = CachedReply(ts, bool(flags & _READ_ONLY), result, bool(flags))
            pos += n
            last = client
        if pos != len(data):
            raise ReplyCacheError(f"reply cache: {len(data) - pos} trailing bytes")
        return rc
