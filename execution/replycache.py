"""execution/replycache.py - per-client last reply, for exactly-once execution (DESIGN §3.1).
Checkpointed as `.zz/replies` with one canonical encoding, so correct replicas hash it alike."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

MAGIC = b"ZZRC"
VERSION = 1
PATH = ".zz/replies"  # reserved runtime path in the state directory (docs/checkpoints.md)
MAX_ENTRIES = 1 << 24

_HEAD = struct.Struct(">4sBBHI")
_ENTRY = struct.Struct(">IQBI")


class ReplyCacheError(ValueError):
    """A malformed `.zz/replies` encoding."""


@dataclass(frozen=True)
class CachedReply:
    timestamp: int
    read_only: bool
    result: bytes


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

    def record(self, client: int, timestamp: int, result: bytes, read_only: bool = False) -> None:
        if not self.is_new(client, timestamp):
            raise ValueError(f"client {client}: timestamp {timestamp} is not new")
        self._entries[client] = CachedReply(timestamp, read_only, bytes(result))

    def encode(self) -> bytes:
        """Canonical: sorted by client id, so equal caches encode to equal bytes."""
        out = [_HEAD.pack(MAGIC, VERSION, 0, 0, len(self._entries))]
        for client, e in sorted(self._entries.items()):
            out.append(_ENTRY.pack(client, e.timestamp, int(e.read_only), len(e.result)))
            out.append(e.result)
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
            if flags > 1:
                raise ReplyCacheError(f"reply cache: entry {i} has flags {flags}")
            if len(data) - pos < n:
                raise ReplyCacheError(f"reply cache: entry {i} result truncated")
            rc._entries[client] = CachedReply(ts, bool(flags), bytes(data[pos : pos + n]))
            pos += n
            last = client
        if pos != len(data):
            raise ReplyCacheError(f"reply cache: {len(data) - pos} trailing bytes")
        return rc
