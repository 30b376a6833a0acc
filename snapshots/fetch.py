# snapshots/fetch.py - a recovering replica's state, fetched file by file on first touch.
# ZZ §4.5 / docs/design.md §5.5: execute at once, verify every file against the certified
# manifest, fetch the rest in the background. docs/recovery.md describes the protocol.
"""On-demand, hash-verified state fetching for a woken execution replica.

A :class:`StateFetcher` is created from a manifest whose digest the caller has already
checked against a checkpoint certificate. It brings the local state directory in line
with the manifest *lazily*:

* files the manifest lists that are already present locally with the right size and
  SHA-256 are kept (``kept``), never fetched;
* local files the manifest does not list are removed at once (they belong to a state no
  certificate vouches for);
* every other listed file is *pending*: fetched from a :class:`Source` the first time the
  application touches it (:meth:`ensure`), or by the background loop
  (:meth:`fetch_all`), verified against its SHA-256 and size, written atomically.

Every request names the file's certified SHA-256 as well as its path in checkpoint
``seq``: a source that no longer has ``seq`` (or never had a complete one) may answer with
any copy it holds that hashes to it (:class:`CopyBytes`; a convicted replica's forensic
state at controld included), so a file stays fetchable while any reachable copy of it
exists, not only while a complete checkpoint does (docs/recovery.md "Copies by hash").

A source that returns wrong bytes is reported through ``on_bad_source`` and the next
source is tried; only when no source has the right content does :class:`FetchError`
reach the caller, so one faulty peer can delay a fetch but never corrupt the state.
The fetcher is thread-safe: the app (in the executor thread) and the background loop
may ask for the same file at the same time and it is fetched once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from zz.crypto import NULL_DIGEST
from zz.snapshots.manifest import (
    FETCH_TMP_DIR,
    RESERVED_DIR,
    FileEntry,
    Manifest,
    files_under,
    hash_file,
)
from zz.snapshots.warm import WarmFiles

log = logging.getLogger("zz.snapshots.fetch")

# Fetched files are assembled here and renamed into place, so a crash mid-fetch never
# leaves a half file under a real name; the runtime wipes `.zz/` content it does not own.
TMP_DIR = FETCH_TMP_DIR


class FetchError(Exception):
    """No source could supply a file with the certified content; names the path."""


class StaleCheckpoint(FetchError):
    """No source had the file of this checkpoint any more, and the later copy one of them
    offered (LaterBytes) differs: the checkpoint was collected while the file changed
    since. Retrying cannot help; the owner must recover to a newer stable checkpoint."""


class SourceError(Exception):
    """One source could not supply a file (unreachable, refused, no such file)."""


class LaterBytes(bytes):
    """What a source returns when it had only a later checkpoint's copy of the file
    (FILE-DATA status 5). Right if the file did not change in between; if its hash is
    wrong, the source did not lie: the checkpoint asked for is gone."""


class CopyBytes(bytes):
    """What a source returns when it served a copy it found by the requested SHA-256
    (FILE-DATA status 7), not `path` of `seq`. The server verified it: wrong bytes are a
    lie like wrong bytes of `path`."""


class Source(Protocol):
    """Somewhere to read checkpoint files from: a peer's snapshot, usually over the wire."""

    name: str

    def fetch(self, seq: int, path: str, size: int, sha256: bytes = NULL_DIGEST) -> bytes:
        """The content of `path` in checkpoint `seq` (`size` bytes expected), or any copy
        hashing to `sha256` when that is given (CopyBytes); SourceError if neither."""
        ...


BadSourceHook = Callable[[str, str, str], None]  # (source name, path, reason)


class SourceRanking:
    """Which source to ask first. A peer that just failed (a paused VM accepts the
    connection and never answers, so every ask costs a timeout) goes to the back until
    it serves again; one that served wrong bytes stays at the back for good."""

    def __init__(self) -> None:
        self._strikes: Counter[str] = Counter()
        self._liars: set[str] = set()

    def order(self, sources: Sequence[Source]) -> list[Source]:
        return sorted(sources, key=lambda s: (s.name in self._liars, self._strikes[s.name]))

    def failed(self, name: str) -> None:
        self._strikes[name] += 1

    def lied(self, name: str) -> None:
        self._liars.add(name)

    def served(self, name: str) -> None:
        self._strikes[name] = 0


class StateFetcher:
    def __init__(
        self,
        root: Path,
        manifest: Manifest,
        seq: int,
        sources: Sequence[Source],
        *,
        on_bad_source: BadSourceHook | None = None,
        patience: float = 0.0,
        ranking: SourceRanking | None = None,
        stop: threading.Event | None = None,
        warm: WarmFiles | None = None,
    ) -> None:
        self.root = Path(root)
        # Files the host staged while this replica slept (snapshots/warm.py), looked up by
        # their certified hash before any source is asked; one that does not hash right is
        # a miss, not a lie.
        self.warm = warm
        # Set when the owner shuts down: a fetch waiting for a peer gives up at once.
        self.stop = stop or threading.Event()
        self.patience = patience
        self.ranking = ranking or SourceRanking()
        self.manifest = manifest
        self.seq = seq
        self.sources = list(sources)
        self.on_bad_source = on_bad_source
        self.counters: Counter[str] = Counter()
        self.bad_sources: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._inflight: dict[str, threading.Event] = {}
        # Directory -> names of pending entries directly inside it, for listdir.
        self._children: dict[str, set[str]] = {}
        # Directories of the certified tree (parents of pending files) not created yet:
        # made at the first install below them or when the app needs one on disk
        # (materialize), so that reconciling costs no mkdir per directory. Until then
        # StateDir shows them as directories (dir_pending, pending_names).
        self._dirs: set[str] = set()
        self._subdirs: dict[str, set[str]] = {}
        self._last_foreground = 0.0

    # -- set-up ---------------------------------------------------------------------

    def prepare(
        self, local: Mapping[str, FileEntry] | None = None, dirty: Iterable[str] = ()
    ) -> None:
        """Reconcile the local directory with the manifest without fetching anything.

        Local files that match the manifest are kept; everything else listed becomes
        pending; local files not listed are removed. Directories of pending files are not
        created here (a mkdir per directory made reconciling grow with the state): the app
        sees them through StateDir (dir_pending, pending_names) and they are made at the
        first install below them, or when the app moves one (materialize).

        Without `local` every local file is found by a walk and hashed. A replica that
        knows its own state passes `local` (the files of its last checkpoint manifest)
        and `dirty` (the paths written or deleted since): then only dirty files are
        hashed, and recovery costs O(changes), not O(state size) — the difference
        between a best-case recovery that stays flat and one that grows with the state.
        """
        if local is not None:
            self._prepare_known(local, set(dirty))
            return
        listed = self.manifest.files
        for rel in files_under(self.root):
            if rel.startswith(RESERVED_DIR + "/") and rel not in listed:
                continue  # the runtime's own scratch files are not state
            want = listed.get(rel)
            if want is None:
                (self.root / rel).unlink()
                self.counters["removed"] += 1
        for rel, want in listed.items():
            full = self.root / rel
            if _matches(full, want):
                self.counters["kept"] += 1
                continue
            if full.is_dir():
                raise FetchError(f"{rel}: a directory where the certified state has a file")
            if full.exists():
                full.unlink()
            self._add_pending(rel)
        self.counters["pending_at_start"] = len(self._pending)

    def _prepare_known(self, local: Mapping[str, FileEntry], dirty: set[str]) -> None:
        listed = self.manifest.files
        for rel in (set(local) | dirty) - set(listed):
            if rel.startswith(RESERVED_DIR + "/") and rel not in local:
                continue
            full = self.root / rel
            if full.is_file() or full.is_symlink():
                full.unlink()
                self.counters["removed"] += 1
        for rel, want in listed.items():
            if rel in dirty:
                if _matches(self.root / rel, want):
                    self.counters["kept"] += 1
                    continue
            elif local.get(rel) == want:
                self.counters["kept"] += 1
                continue
            full = self.root / rel
            if rel in dirty or rel in local:
                if full.is_dir() and not full.is_symlink():
                    raise FetchError(f"{rel}: a directory where the certified state has a file")
                full.unlink(missing_ok=True)
            self._add_pending(rel)
        self.counters["pending_at_start"] = len(self._pending)

    def _add_pending(self, rel: str) -> None:
        self._pending.add(rel)
        parent, _, name = rel.rpartition("/")
        self._children.setdefault(parent, set()).add(name)
        while parent and parent not in self._dirs:
            self._dirs.add(parent)
            up, _, name = parent.rpartition("/")
            self._subdirs.setdefault(up, set()).add(name)
            parent = up

    def _drop_dirs(self, dirs: Iterable[str]) -> None:
        """`dirs` exist on disk now, or are gone with everything below them: lock held."""
        for d in dirs:
            if d in self._dirs:
                self._dirs.discard(d)
                up, _, name = d.rpartition("/")
                names = self._subdirs.get(up)
                if names is not None:
                    names.discard(name)
                    if not names:
                        del self._subdirs[up]

    def _dirs_at_or_under(self, rel: str) -> list[str]:
        prefix = rel + "/"
        return sorted(d for d in self._dirs if d == rel or d.startswith(prefix))

    def _drop_pending(self, rel: str) -> None:
        self._pending.discard(rel)
        parent, _, name = rel.rpartition("/")
        names = self._children.get(parent)
        if names is not None:
            names.discard(name)
            if not names:
                del self._children[parent]

    # -- queries the state API needs ---------------------------------------------

    @property
    def done(self) -> bool:
        with self._lock:
            return not self._pending and not self._inflight

    def pending(self) -> list[str]:
        with self._lock:
            return sorted(self._pending)

    def is_pending(self, rel: str) -> bool:
        with self._lock:
            return rel in self._pending

    def pending_names(self, directory: str) -> set[str]:
        """Names of pending files and of directories not created yet directly inside
        `directory` ('' = the root)."""
        with self._lock:
            return set(self._children.get(directory, ())) | self._subdirs.get(directory, set())

    def dir_pending(self, rel: str) -> bool:
        """Whether `rel` is a directory of the certified tree not created on disk yet."""
        with self._lock:
            return rel in self._dirs

    def materialize(self, rel: str) -> None:
        """Create the directories not created yet at or below `rel` (and the ones above
        it): the app moves `rel`, which must then exist on disk with all it holds."""
        with self._lock:
            dirs = self._dirs_at_or_under(rel)
            for d in dirs:
                (self.root / d).mkdir(parents=True, exist_ok=True)
            self._drop_dirs(dirs)

    def forget_dir(self, rel: str) -> None:
        """The app deleted `rel`: the directories not created yet at or below it are gone."""
        with self._lock:
            self._drop_dirs(self._dirs_at_or_under(rel))

    def pending_under(self, rel: str) -> list[str]:
        prefix = rel + "/"
        with self._lock:
            return sorted(p for p in self._pending if p == rel or p.startswith(prefix))

    # -- the app touched something ----------------------------------------------------

    def ensure(self, rel: str) -> bool:
        """Make `rel` present with its certified content if it is pending.

        Returns True if this call (or a concurrent one) had to fetch it. Blocks while
        another thread fetches the same file."""
        fetched = self._ensure(rel, foreground=True)
        # Only a fetch makes the background step aside: the app calls this for every file
        # it touches, and under steady load the background never ran (a woken spare took
        # 24 s for 4 files in the short campaign, and stayed in recovery, where one more
        # fault can leave no replica with the whole state, that long).
        if fetched:
            self._last_foreground = time.monotonic()
        return fetched

    def ensure_under(self, rel: str) -> int:
        """ensure() every pending file at or below `rel`, and create the directories not
        created yet there (a rename of a directory)."""
        n = 0
        for p in self.pending_under(rel):
            n += self.ensure(p)
        self.materialize(rel)
        return n

    def forget(self, rel: str) -> None:
        """The app replaced or deleted `rel` before it was fetched: never fetch it. A
        fetch of it under way (the background's) is let finish first, or its install
        would land on top of what the app writes next."""
        while True:
            with self._lock:
                ev = self._inflight.get(rel)
                if ev is None:
                    if rel in self._pending:
                        self._drop_pending(rel)
                        self.counters["skipped_overwritten"] += 1
                    return
            ev.wait()

    def _ensure(self, rel: str, *, foreground: bool) -> bool:
        # A file stays pending until it is installed: the app's exists() and listdir()
        # see it all along (a GET that touched a file the background was fetching took
        # it for missing and answered wrongly: an execution-fault VM drill in CI).
        waited = False
        while True:
            with self._lock:
                ev = self._inflight.get(rel)
                if ev is None:
                    if rel not in self._pending:
                        return waited
                    ev = self._inflight[rel] = threading.Event()
                    break
            ev.wait()  # installed, or failed and still pending: then we try ourselves
            waited = True
        try:
            # The app is blocked on this file and cannot run without it: keep trying.
            self._fetch_one(rel, patience=self.patience if foreground else 0.0)
            self.counters["fetched_foreground" if foreground else "fetched_background"] += 1
            with self._lock:
                self._drop_pending(rel)
        finally:
            with self._lock:
                del self._inflight[rel]
            ev.set()
        return True

    def _fetch_one(self, rel: str, *, patience: float = 0.0) -> None:
        """Fetch `rel` from the first source with the right content; while none has it,
        retry with backoff for up to `patience` seconds (peers restart, or are busy
        taking the checkpoint that will serve it)."""
        deadline = time.monotonic() + patience
        delay = 0.05
        while True:
            try:
                self._fetch_from_sources(rel)
                return
            except StaleCheckpoint:
                raise  # waiting brings the collected checkpoint back no more than asking
            except FetchError:
                if time.monotonic() + delay > deadline or self.stop.is_set():
                    raise
                self.counters["fetch_retries"] += 1
                self.stop.wait(delay)
                delay = min(delay * 2, 2.0)

    def _fetch_from_sources(self, rel: str) -> None:
        want = self.manifest.files[rel]
        if self.warm is not None:
            staged = self.warm.get(want.size, want.sha256)  # verified against want, or None
            if staged is not None:
                self._install(rel, staged)
                self.counters["fetched_warm"] += 1
                return
            self.warm.note_miss(rel)
        reasons = []
        stale = False
        with self._lock:
            order = self.ranking.order(self.sources)
        for src in order:
            try:
                data = src.fetch(self.seq, rel, want.size, want.sha256)
            except SourceError as e:
                reasons.append(f"{src.name}: {e}")
                self.counters["source_errors"] += 1
                with self._lock:
                    self.ranking.failed(src.name)
                continue
            if len(data) != want.size or hashlib.sha256(data).digest() != want.sha256:
                if isinstance(data, LaterBytes):
                    reasons.append(f"{src.name}: checkpoint {self.seq} collected, file changed")
                    self.counters["stale_copies"] += 1
                    stale = True
                    continue
                why = f"content does not match the manifest ({len(data)} bytes)"
                reasons.append(f"{src.name}: {why}")
                with self._lock:
                    self.ranking.lied(src.name)
                self._report_bad(src.name, rel, why)
                continue
            with self._lock:
                self.ranking.served(src.name)
            self._install(rel, data)
            self.counters["bytes_fetched"] += len(data)
            if isinstance(data, CopyBytes):
                self.counters["fetched_copies"] += 1  # not path of seq: a copy by its hash
            return
        error = StaleCheckpoint if stale else FetchError
        raise error(f"{rel}: no source had the certified content: " + "; ".join(reasons))

    def _report_bad(self, source: str, rel: str, why: str) -> None:
        self.counters["bad_content"] += 1
        self.bad_sources.append((source, rel, why))
        log.warning("source %s served a bad %s: %s", source, rel, why)
        if self.on_bad_source is not None:
            self.on_bad_source(source, rel, why)

    def _install(self, rel: str, data: bytes) -> None:
        tmp_dir = self.root / TMP_DIR
        tmp = tmp_dir / f"{threading.get_ident()}-{time.monotonic_ns()}"
        # No fsync: a crash loses the recovery, not data. A restarted replica goes back
        # to its own last checkpoint and recovers again; fsync per file would cost a
        # synchronous round trip through ZFS for every file fetched.
        # Directories are made only when missing: each mkdir is a round trip through the
        # file system (zfs-fuse: one daemon every pool shares) even when it exists.
        try:
            f = open(tmp, "wb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            tmp_dir.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "wb")  # noqa: SIM115 - closed below
        with f:
            f.write(data)
        dest = self.root / rel
        try:
            os.replace(tmp, dest)
        except FileNotFoundError:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, dest)
        parent = rel.rpartition("/")[0]
        with self._lock:
            above = []
            while parent:
                above.append(parent)
                parent = parent.rpartition("/")[0]
            self._drop_dirs(above)

    # -- background ----------------------------------------------------------------

    def fetch_all(
        self,
        stop: threading.Event | None = None,
        *,
        yield_after_foreground: float = 0.05,
        pause: float = 0.0,
    ) -> int:
        """Fetch every pending file; returns how many this call fetched.

        Runs in its own thread. It steps aside for `yield_after_foreground` seconds after
        each foreground fetch (the app waiting on a file must not queue behind the
        background loop on the same sources) and sleeps `pause` between files, which
        bounds the bandwidth it takes from request execution. A file that no source can
        supply stays pending and is retried on the next call.
        """
        n = 0
        failed: set[str] = set()
        while stop is None or not stop.is_set():
            since = time.monotonic() - self._last_foreground
            if since < yield_after_foreground:
                time.sleep(yield_after_foreground - since)
                continue
            with self._lock:
                todo = sorted(self._pending - failed)
            if not todo:
                break
            try:
                n += self._ensure(todo[0], foreground=False)
            except FetchError as e:
                log.warning("background fetch: %s", e)
                failed.add(todo[0])
            if pause and stop is not None:
                stop.wait(pause)  # a long pause must not hold up the owner's shutdown
            elif pause:
                time.sleep(pause)
        return n


def _matches(full: Path, want: FileEntry) -> bool:
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        return False
    if not os.path.isfile(full) or os.path.islink(full) or st.st_size != want.size:
        return False
    return hash_file(full) == want
