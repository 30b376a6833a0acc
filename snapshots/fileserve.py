# snapshots/fileserve.py - serve the files of a replica's checkpoint snapshots to peers that
# recover (ZZ §4.5, docs/design.md §5.5). The transport (FILE-FETCH / FILE-DATA,
# docs/wire.md) and the authentication live with whoever runs this: the runtime or controld.
"""Read ranges of checkpoint files out of snapshots, for recovering peers.

Only what a checkpoint manifest lists is served: the requester names a path of the
manifest of checkpoint ``seq`` (or the empty path for the manifest encoding itself) and
gets bytes it will verify against that manifest. Anything else (a path outside the
manifest, a symlink, a snapshot that is gone) is a status code, never an exception that
reaches the transport.

A request that also names the file's certified SHA-256 is served from any copy this
server holds that hashes to it (status COPY, snapshots/copies.py) when ``path`` of
``seq`` cannot be: another checkpoint, the live state, the verified files of a state still
being recovered. The server verifies such a copy before it sends it.

Snapshots are read through the store's ``open_snapshot`` (a ZFS clone on ZFS). A clone
costs tens of milliseconds, so the last few stay open; the owner calls :meth:`release`
before it destroys a snapshot, because ZFS refuses to destroy a snapshot with a clone.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from zz.crypto import NULL_DIGEST
from zz.snapshots.copies import CopyFinder, Place
from zz.snapshots.manifest import Manifest, ManifestError, normalize_path
from zz.snapshots.store import CheckpointStore, StorageError, checkpoint_name

OK = 0
NO_CHECKPOINT = 1
NO_FILE = 2
REFUSED = 3
ERROR = 4
LATER = 5  # the file of a later checkpoint: `seq` was collected (docs/wire.md FILE-DATA)
CHALLENGE = 6  # not served: sign the request again with this connection's challenge (data)
COPY = 7  # a copy found by the requested sha256 and verified here (docs/wire.md FILE-DATA)

MAX_CHUNK = 4 << 20  # per FILE-DATA; far below the wire's 16 MiB frame limit
# A requester gets this long to take one FILE-DATA before its connection is dropped.
FILE_SEND_TIMEOUT = 10.0
# The wire carries a u64 offset; os.pread takes a signed one (OverflowError past it). No
# file comes near it, so a larger offset is refused as a bad request.
MAX_OFFSET = (1 << 63) - 1
# A connection's challenge (docs/wire.md "State fetching", docs/security.md "Snapshot file
# server"): random, so a FILE-FETCH signed for one connection is refused on any other.
CHALLENGE_LEN = 16


def bad_range(offset: int, length: int) -> bool:
    """Whether a requested range is one no file can have (refused, and counted by the
    transport as `file_fetch_bad_range`)."""
    return not (0 <= offset <= MAX_OFFSET and 0 <= length)


@dataclass(frozen=True, slots=True)
class FileRead:
    status: int
    size: int = 0
    data: bytes = b""


class Challenge:
    """What binds FILE-FETCHes to one server and one connection to it, so that a captured
    request cannot be replayed to another server, or on a connection of the replayer's
    own, to read the file (docs/security.md "Snapshot file server").

    The transport keeps one per connection. The server's challenge is 16 random bytes,
    made at the connection's first FILE-FETCH; a request is served only if it names this
    server (`target`) and carries that challenge. One with no challenge (a requester's
    first on the connection) is answered CHALLENGE with it, and the requester signs again;
    one with another challenge was signed for another connection: refused. Requests on a
    connection may repeat or come in any order (a retried chunk, several fetch threads),
    and a requester may hold any number of connections: each has its own challenge."""

    __slots__ = ("_nonce",)

    def __init__(self) -> None:
        self._nonce = b""

    @property
    def nonce(self) -> bytes:
        if not self._nonce:
            self._nonce = os.urandom(CHALLENGE_LEN)
        return self._nonce

    def check(self, server: int, target: int, challenge: bytes) -> tuple[str, FileRead] | None:
        """None if a request for `target` carrying `challenge` may be served here; else
        the counter to count it under and the answer to send instead."""
        if target != server:
            return "file_fetch_wrong_target", FileRead(REFUSED)
        if not challenge:
            return "file_fetch_challenges", FileRead(CHALLENGE, 0, self.nonce)
        if not hmac.compare_digest(challenge, self.nonce):
            return "file_fetch_replayed", FileRead(REFUSED)
        return None


class SnapshotFiles:
    def __init__(
        self,
        store: CheckpointStore,
        manifest_dir: Path,
        *,
        servable: Callable[[int], bool] | None = None,
        max_open: int = 2,
        live: Callable[[], Place | None] | None = None,
        path_reads: bool = True,
        copies: CopyFinder | None = None,
    ) -> None:
        self.store = store
        self.manifest_dir = Path(manifest_dir)
        # A replica still recovering holds snapshots with files it has not fetched yet:
        # it must not hand out what it does not have by path (by hash it may: verified).
        self.servable = servable or (lambda seq: True)
        self.max_open = max_open
        # The live state as one more place to find a copy by hash (the owner's callable:
        # its tree and the manifest it was last checkpointed or recovered to).
        self.live = live
        # False: serve by hash only, each copy verified here (a convicted replica's
        # forensic state: its snapshots may have been corrupted on purpose, and bytes
        # served by path are the server's word).
        self.path_reads = path_reads
        self.copies = copies or CopyFinder()
        self._lock = threading.Lock()
        self._open: OrderedDict[str, tuple[contextlib.ExitStack, Path]] = OrderedDict()
        self._manifests: OrderedDict[int, Manifest] = OrderedDict()

    def manifest(self, seq: int) -> Manifest | None:
        with self._lock:
            return self._manifest(seq)

    def remember(self, seq: int, manifest: Manifest) -> None:
        """The owner's in-memory copy of checkpoint `seq`'s manifest (the one it saved
        under manifest_dir), so that serving it needs no decode."""
        with self._lock:
            self._manifests[seq] = manifest
            while len(self._manifests) > 4:
                self._manifests.popitem(last=False)

    def _manifest(self, seq: int) -> Manifest | None:
        m = self._manifests.get(seq)
        if m is not None:
            return m
        p = self.manifest_dir / f"{checkpoint_name(seq)}.manifest"
        try:
            m = Manifest.decode(p.read_bytes())
        except (FileNotFoundError, ManifestError):
            return None
        self._manifests[seq] = m
        while len(self._manifests) > 4:
            self._manifests.popitem(last=False)
        return m

    def _next_after(self, seq: int) -> tuple[int, Manifest] | None:
        seqs = []
        for p in self.manifest_dir.glob("ckpt-*.manifest"):
            num = p.name[5 : -len(".manifest")]
            if num.isdigit() and int(num) > seq and self.servable(int(num)):
                seqs.append(int(num))
        for s in sorted(seqs):
            m = self._manifest(s)
            if m is not None:
                return s, m
        return None

    def read(
        self, seq: int, path: str, offset: int, length: int, sha256: bytes = NULL_DIGEST
    ) -> FileRead:
        """`path` of checkpoint `seq` (OK); failing that, with a `sha256`, a verified copy
        with that hash (COPY); failing that, `path` of the next checkpoint (LATER)."""
        if bad_range(offset, length):
            return FileRead(REFUSED)
        length = min(length, MAX_CHUNK)
        with self._lock:
            if path != "":
                try:
                    if normalize_path(path) != path:
                        return FileRead(REFUSED)
                except ManifestError:
                    return FileRead(REFUSED)
            by_path = self.path_reads and self.servable(seq)
            r = self._read_seq(seq, path, offset, length) if by_path else FileRead(REFUSED)
            if r.status == OK:
                return r
            if sha256 != NULL_DIGEST:
                c = self._read_copy(seq, path, sha256, offset, length)
                if c is not None:
                    return c
            if not by_path or path == "" or r.status != NO_CHECKPOINT:
                return r
            # Checkpoint `seq` was collected since the requester began recovering from it.
            # A file it has not fetched yet is one it has not touched since `seq`: once
            # it has executed past our next checkpoint, that one holds the same bytes.
            # Marked LATER: if they fail its hash check, `seq` is gone for it (it jumps to
            # the newer stable checkpoint), and we did not lie.
            later = self._next_after(seq)
            if later is None:
                return FileRead(NO_CHECKPOINT)
            r = self._read_from(*later, path, offset, length)
            return FileRead(LATER, r.size, r.data) if r.status == OK else r

    def _read_seq(self, seq: int, path: str, offset: int, length: int) -> FileRead:
        m = self._manifest(seq)
        if m is None:
            return FileRead(NO_CHECKPOINT)
        if path == "":
            enc = m.encode()
            return FileRead(OK, len(enc), enc[offset : offset + length])
        return self._read_from(seq, m, path, offset, length)

    def _read_copy(
        self, seq: int, path: str, sha256: bytes, offset: int, length: int
    ) -> FileRead | None:
        """A copy hashing to `sha256` among everything held here, verified; None if none.
        For the empty path: checkpoint `seq`'s manifest, if it hashes to `sha256` (a
        recovering replica's recorded one, or a forensic copy's)."""
        if path == "":
            m = self._manifest(seq)
            if m is None or m.digest() != sha256:
                return None
            data = m.encode()
        else:
            found = self.copies.find(self._places(), sha256)
            if found is None:
                return None
            data = found
        return FileRead(COPY, len(data), data[offset : offset + length])

    def _places(self) -> Iterator[Place]:
        """Where a copy may be: the snapshots, newest first (their manifests say what they
        hold; an incomplete one lacks some files), then the live state."""
        try:
            names = self.store.list_snapshots()
        except (OSError, StorageError):
            names = []
        for name in reversed(names):
            num = name[5:]
            if not (name.startswith("ckpt-") and num.isdigit()):
                continue
            m = self._manifest(int(num))
            if m is not None:
                yield Place(name, m, lambda name=name: self._root(name))
        live = self.live() if self.live is not None else None
        if live is not None:
            yield live

    def _read_from(self, seq: int, m: Manifest, path: str, offset: int, length: int) -> FileRead:
        entry = m.files.get(path)
        if entry is None:
            return FileRead(NO_FILE)
        name = checkpoint_name(seq)
        try:
            data = _read_range(self._root(name) / path, offset, length)
        except FileNotFoundError:
            # Gone under an open clone: its owner collected the snapshot (and destroyed
            # other readers' clones with it). Forget it; a later one may serve.
            self._drop(name, seq)
            return FileRead(NO_CHECKPOINT)
        except (OSError, StorageError, OverflowError, ValueError):
            return FileRead(ERROR)
        return FileRead(OK, entry.size, data)

    def _drop(self, name: str, seq: int) -> None:
        hit = self._open.pop(name, None)
        if hit is not None:
            with contextlib.suppress(OSError, StorageError):
                hit[0].close()
        self._manifests.pop(seq, None)

    def snapshot_root(self, name: str) -> Path:
        """Snapshot `name` opened (kept open like a checkpoint's), for a place's `root`
        callable: read() calls it with the lock held."""
        return self._root(name)

    def _root(self, name: str) -> Path:
        hit = self._open.get(name)
        if hit is not None:
            self._open.move_to_end(name)
            return hit[1]
        stack = contextlib.ExitStack()
        try:
            root = stack.enter_context(self.store.open_snapshot(name))
        except StorageError:
            stack.close()
            # Asked only now: listing is one more zfs command (10-30 ms on zfs-fuse) on the
            # first read of a recovering peer, and opening a snapshot that is gone fails.
            if name not in self.store.list_snapshots():
                raise FileNotFoundError(name) from None
            raise
        except BaseException:
            stack.close()
            raise
        self._open[name] = (stack, root)
        while len(self._open) > self.max_open:
            _, (old, _) = self._open.popitem(last=False)
            old.close()
        return root

    def release(self, name: str | None = None) -> None:
        """Close the open snapshot `name` (all when None) before it is destroyed."""
        with self._lock:
            names = [name] if name is not None else list(self._open)
            for n in names:
                hit = self._open.pop(n, None)
                if hit is not None:
                    hit[0].close()
            if name is None:
                self._manifests.clear()
            elif name.startswith("ckpt-") and name[5:].isdigit():
                self._manifests.pop(int(name[5:]), None)


def _read_range(full: Path, offset: int, length: int) -> bytes:
    fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)
