# snapshots/copies.py - find a checkpoint file by its certified SHA-256 among every copy a
# server holds (any checkpoint, live state, a convicted replica's forensic state), verified.
"""Copies of a file found by content hash, for FILE-FETCH with a ``sha256`` (docs/wire.md).

A recovering replica verifies every file against the certified manifest, so any byte
source is safe for it to use. A server that is asked for a file by its hash looks through
*places*: trees a manifest describes (a checkpoint snapshot and its manifest, the live
state and the manifest it was last checkpointed or recovered to, a forensic copy). A
manifest only says where a file with that hash *was*: the live state may have changed
since, a convicted replica's snapshot may have been corrupted on purpose. So the server
reads the whole candidate, hashes it and serves it only if the hash matches; a candidate
that does not is counted (``mismatched``) and skipped. A server therefore never sends
bytes of a copy under status 7 (*copy*) that it has not verified, and a requester that
gets wrong ones may rank that server a liar.

A file verified once is kept in a small cache by its hash (bounded in bytes), so the
chunks of a large file are read and hashed once, not once per chunk.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from zz.snapshots.manifest import Manifest
from zz.snapshots.store import StorageError

# A copy is read whole to be verified; larger files are not looked for by hash.
MAX_COPY = 256 << 20
# Verified copies kept between chunk requests (the last few files asked for).
CACHE_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Place:
    """A tree whose files `manifest` describes, perhaps no longer truly: `root()` opens it
    (a snapshot through the store, the live directory, a forensic copy), `skip` names
    paths known not to be there (a recovering replica's pending files)."""

    name: str
    manifest: Manifest
    root: Callable[[], Path]
    skip: Callable[[str], bool] = lambda path: False


class CopyFinder:
    """Reads a file by hash from the first place holding a verified copy."""

    def __init__(
        self, cache_bytes: int = CACHE_BYTES, counters: Counter[str] | None = None
    ) -> None:
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, bytes] = OrderedDict()
        self._cached = 0
        # found: a copy served; mismatched: a candidate that did not hash right (a changed
        # live file, a corrupted snapshot) and was skipped; missing: none found. Several
        # finders may add to one owner's counters (controld: one per replica store).
        self.counters: Counter[str] = Counter() if counters is None else counters

    def find(self, places: Iterable[Place], sha256: bytes) -> bytes | None:
        """The content of a file hashing to `sha256`, verified; None if no place has one."""
        hit = self._cache.get(sha256)
        if hit is not None:
            self._cache.move_to_end(sha256)
            return hit
        for place in places:
            data = self._from(place, sha256)
            if data is not None:
                self.counters["found"] += 1
                self._keep(sha256, data)
                return data
        self.counters["missing"] += 1
        return None

    def _from(self, place: Place, sha256: bytes) -> bytes | None:
        paths = [p for p in place.manifest.paths_with(sha256) if not place.skip(p)]
        if not paths:
            return None
        size = place.manifest.files[paths[0]].size
        if size > MAX_COPY:
            return None
        try:
            root = place.root()
        except (OSError, StorageError):
            return None
        for path in paths:
            try:
                data = read_whole(root / path, size)
            except (OSError, ValueError):
                continue
            if data is not None and hashlib.sha256(data).digest() == sha256:
                return data
            self.counters["mismatched"] += 1
        return None

    def _keep(self, sha256: bytes, data: bytes) -> None:
        if len(data) > self.cache_bytes:
            return
        self._cache[sha256] = data
        self._cached += len(data)
        while self._cached > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached -= len(old)


def read_whole(full: Path, size: int) -> bytes | None:
    """The file at `full` if it is a regular file of `size` bytes (symlinks not followed),
    else None."""
    # Not even opened unless a regular file (a device node planted in a convicted
    # replica's state); O_NONBLOCK: nor may a FIFO swapped in meanwhile hang the server.
    if not stat.S_ISREG(os.lstat(full).st_mode):
        return None
    fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks = []
        got = 0
        while got <= size:
            chunk = os.read(fd, size + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks) if got == size else None
