# snapshots/warm.py - a sleeping spare's warm files: checkpoint files its host's controld
# stages next to its state while it sleeps (controld/warm.py), found by the woken runtime
# by their certified SHA-256 (docs/recovery.md "A warm spare").
"""Files staged for a sleeping spare, named by their SHA-256.

The host's controld copies the manifest of each new stable checkpoint and the files it
lists that the spare's own state lacks into ``<state dir>/warm/``, each under the hex of
its SHA-256 (a manifest under the hex of the checkpoint digest ``C``, which is the SHA-256
of its encoding). The woken runtime looks a file up by the hash its certified manifest
names and takes it only if its bytes hash to it: a staged file that is stale, truncated or
forged is a miss (the file is fetched from the peers as before), never trusted and never
counted against a peer. So the directory needs no index and no trust in whoever wrote it.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter
from pathlib import Path

WARM_DIR = "warm"
# A staged file is read whole to verify it: larger ones are left to the peers.
WARM_MAX_FILE = 16 << 20


def warm_name(sha256: bytes) -> str:
    """The name a file (or a manifest, by its digest) is staged under."""
    return sha256.hex()


def read_file(path: Path, limit: int) -> bytes | None:
    """The bytes of the regular file `path` (no symlink followed), None if it is not
    there, not a regular file or larger than `limit`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not (st.st_mode & 0o170000 == 0o100000) or st.st_size > limit:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)


class WarmFiles:
    """The read side: `root` is `<state dir>/warm`. Thread-safe (the executor and the
    background fetch look files up at the same time)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        # The first paths looked for and not found (runtime status `warm_missed`).
        self.missed_paths: list[str] = []

    def note_miss(self, path: str) -> None:
        with self._lock:
            if len(self.missed_paths) < 16:
                self.missed_paths.append(path)

    def _count(self, what: str) -> None:
        with self._lock:
            self.counters[what] += 1

    def get(self, size: int, sha256: bytes) -> bytes | None:
        """The staged file whose content is `size` bytes hashing to `sha256`; None (a
        miss) if there is none or the one there does not hash to it."""
        if size > WARM_MAX_FILE:
            return None
        data = read_file(self.root / warm_name(sha256), size)
        if data is None:
            self._count("missed")
            return None
        if len(data) != size or hashlib.sha256(data).digest() != sha256:
            self._count("mismatched")
            return None
        self._count("hit")
        return data

    def manifest(self, digest: bytes, limit: int = 64 << 20) -> bytes | None:
        """The staged encoding of the manifest whose checkpoint digest is `digest`, if it
        hashes to it."""
        data = read_file(self.root / warm_name(digest), limit)
        if data is None:
            self._count("manifest_missed")
            return None
        if hashlib.sha256(data).digest() != digest:
            self._count("manifest_mismatched")
            return None
        self._count("manifest_hit")
        return data
