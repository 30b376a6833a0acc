"""execution/state.py - StateDir: the only way an app touches its state directory (ZZ §5.3).
Confines paths to the dataset and records changed files so a checkpoint re-hashes only those."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

# The manifest's path rules, shared so a path the app may write is one it can record.
from zz.snapshots.manifest import MAX_PATH_BYTES, RESERVED_DIR, files_under

# Modes that can change a file; "r" and "rb" alone cannot.
_WRITE_FLAGS = frozenset("wax+")
_VALID_MODE_CHARS = frozenset("rwaxbt+")


class LazyState(Protocol):
    """Files certified but not yet present (a recovering replica, snapshots/fetch.py)."""

    def ensure(self, rel: str) -> bool: ...
    def ensure_under(self, rel: str) -> int: ...
    def forget(self, rel: str) -> None: ...
    def is_pending(self, rel: str) -> bool: ...
    def pending_names(self, directory: str) -> set[str]: ...
    def pending_under(self, rel: str) -> list[str]: ...

    # Directories of the certified tree are made on disk only when first needed: one
    # not made yet is a directory to the app all the same.
    def dir_pending(self, rel: str) -> bool: ...
    def forget_dir(self, rel: str) -> None: ...


class StateError(Exception):
    """A state path or operation the app is not allowed to perform; names the path."""


class ReadOnlyStateError(StateError):
    """A write attempted while the state is read-only (a read-only request is executing)."""


@dataclass(frozen=True)
class DirtySet:
    """Files changed since the previous take_dirty().

    Invariant: `written` and `deleted` are disjoint. `written` holds paths that exist
    now and may have new content; `deleted` holds paths that no longer exist (they may
    or may not have existed at the previous checkpoint, so the manifest builder drops
    them if present). A rename shows as a delete of the source and a write of the
    destination. Paths are normalized, relative, '/'-separated, files only.
    """

    written: frozenset[str]
    deleted: frozenset[str]

    def __bool__(self) -> bool:
        return bool(self.written or self.deleted)


def _open_nofollow(path: str, full: Path, flags: int) -> int:
    """os.open of a state file that refuses a symlink as its last component."""
    try:
        return os.open(full, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StateError(f"state path {path!r} goes through a symlink") from e
        raise


def normalize(path: str) -> str:
    """Canonical relative form of an app path, or StateError.

    Rejects what could name something outside the state directory or give one file
    two names (and so two manifest entries): absolute paths, '..', NUL, backslashes;
    and what the manifest cannot hold: non-UTF-8, over MAX_PATH_BYTES, or the
    runtime's reserved '.zz/' (checkpointed app memory lives there).
    """
    if not isinstance(path, str):
        raise StateError(f"state path must be str, got {type(path).__name__}")
    if path == "" or "\x00" in path or "\\" in path:
        raise StateError(f"invalid state path {path!r}")
    if path.startswith("/"):
        raise StateError(f"state path {path!r} must be relative")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise StateError(f"state path {path!r} must not contain '..'")
    if not parts:
        raise StateError(f"state path {path!r} names the state root")
    if parts[0] == RESERVED_DIR:
        raise StateError(f"state path {path!r}: {RESERVED_DIR}/ is reserved for the runtime")
    norm = "/".join(parts)
    try:
        size = len(norm.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise StateError(f"state path {path!r} is not valid UTF-8") from e
    if size > MAX_PATH_BYTES:
        raise StateError(f"state path {path[:40]!r}... is longer than {MAX_PATH_BYTES} bytes")
    return norm


class StateDir:
    """An app's view of its state directory.

    All paths are relative to `root`; symlinks are refused anywhere below the root
    (apps cannot create them through this API, and following one could read or write
    outside the dataset). Files opened for writing must not outlive the request that
    opened them: `sync()` closes any that are still open before a checkpoint.
    """

    def __init__(self, root: str | os.PathLike[str], lazy: LazyState | None = None) -> None:
        self.root = Path(os.path.realpath(root))
        # While a woken replica recovers, files are fetched on first touch (ZZ §4.5):
        # every access below goes through `lazy` before it looks at the disk.
        self.lazy = lazy
        if not self.root.is_dir():
            raise StateError(f"state root {str(self.root)!r} is not a directory")
        self._written: set[str] = set()
        self._deleted: set[str] = set()
        self._open_writers: list[IO[Any]] = []
        self._read_only = 0
        # Directories below the root already seen to be real directories, not symlinks:
        # every access checked each component with an lstat, through pathlib, which cost
        # more than the write itself (a 128 KiB WRITE of the files app resolves eight
        # paths). Only this object and the fetcher make directories, neither makes
        # symlinks, and a delete or rename (the only ways the app changes what a path
        # names) forgets them all.
        self._real_dirs: set[str] = set()
        self._root_s = str(self.root)
        # While a run of certified batches is replayed (buffer_writes): rel -> the bytes a
        # write_bytes left there, written to the file once, at flush().
        self._buffer: dict[str, bytes] | None = None

    # -- paths -------------------------------------------------------------------

    def _resolve(self, path: str, last: bool = True) -> tuple[str, Path]:
        rel = self._check_path(path, last)
        return rel, self.root / rel

    def _check_path(self, path: str, last: bool = True) -> str:
        """normalize(path), refused if any component of it is a symlink. `last=False`:
        the last component is not looked at, for a caller that opens it with O_NOFOLLOW
        (_open_nofollow), which refuses a symlink there itself; through a guest's share
        every lstat is a round trip to the host."""
        rel = normalize(path)
        real = self._real_dirs
        end = rel.rfind("/")
        start = 0
        # The parents not known to be directories, then the last component: each lstat'ed.
        while end > 0 and rel[:end] not in real:
            end = rel.rfind("/", 0, end)
        if end > 0:
            start = end + 1
        while True:
            cut = rel.find("/", start)
            if cut < 0 and not last:
                break
            prefix = rel if cut < 0 else rel[:cut]
            try:
                st = os.lstat(self._root_s + "/" + prefix)
            except FileNotFoundError:
                break  # the rest does not exist yet, so it cannot be a symlink
            mode = st.st_mode
            if stat.S_ISLNK(mode):
                raise StateError(f"state path {path!r} goes through a symlink")
            if cut < 0:
                break
            if stat.S_ISDIR(mode):
                real.add(prefix)
            start = cut + 1
        return rel

    # -- dirty tracking ------------------------------------------------------------

    def _check_writable(self, path: str) -> None:
        if self._read_only:
            raise ReadOnlyStateError(f"write to {path!r} during a read-only request")

    def _mark_written(self, rel: str) -> None:
        self._deleted.discard(rel)
        self._written.add(rel)

    def _mark_deleted(self, rel: str) -> None:
        self._written.discard(rel)
        self._deleted.add(rel)

    def _files_under(self, rel: str, full: Path) -> list[str]:
        """Relative paths of the regular files at or below `full` (a file or directory)."""
        if not full.is_dir():
            return [rel]
        return list(files_under(self.root, rel))

    def peek_dirty(self) -> set[str]:
        """Paths written or deleted since the last take_dirty(), without resetting."""
        return self._written | self._deleted

    def take_dirty(self) -> DirtySet:
        """Return and reset the dirty set; call after sync() when taking a checkpoint."""
        dirty = DirtySet(frozenset(self._written), frozenset(self._deleted))
        self._written.clear()
        self._deleted.clear()
        return dirty

    def buffer_writes(self) -> None:
        """Keep whole-file writes (write_bytes) in memory until flush(): a replica
        replaying the certified log (ZZ §4.7.2, "apply the writes") writes each file once
        for the run, not once per request that replaced it, and a read of such a file is
        answered from memory. Every other call that looks at or changes the files
        flushes first, so what an app sees is the same. For apps whose files are only
        ever written whole (App.buffers_writes). The live state is not a checkpoint: a
        crash drops the buffer with everything else after the last checkpoint."""
        if self._buffer is None:
            self._buffer = {}

    @property
    def buffering(self) -> bool:
        return self._buffer is not None

    def flush(self) -> None:
        """Write what buffer_writes() kept and stop keeping it."""
        buf, self._buffer = self._buffer, None
        self._write_buffered(buf or {})

    def _unbuffer(self) -> None:
        """Write what buffer_writes() kept and go on keeping later writes."""
        if self._buffer:
            buf, self._buffer = self._buffer, {}
            self._write_buffered(buf)

    def _write_buffered(self, buf: dict[str, bytes]) -> None:
        for rel, data in buf.items():
            self._write_fd(rel, self.root / rel, os.O_TRUNC, 0, data)

    def sync(self) -> None:
        """Flush, fsync and close every file still open for writing (and write what
        buffer_writes() kept).

        A snapshot of a 9p-shared dataset only captures closed (or synced) files, so
        this runs before every checkpoint.
        """
        self.flush()
        writers, self._open_writers = self._open_writers, []
        for f in writers:
            if f.closed:
                continue
            f.flush()
            os.fsync(f.fileno())
            f.close()

    @contextlib.contextmanager
    def read_only(self) -> Iterator[None]:
        """Within this block every write raises ReadOnlyStateError (read-only requests)."""
        self._read_only += 1
        try:
            yield
        finally:
            self._read_only -= 1

    @property
    def is_read_only(self) -> bool:
        return self._read_only > 0

    # -- file API ------------------------------------------------------------------

    def open(self, path: str, mode: str = "rb", encoding: str | None = None) -> IO[Any]:
        """Open a state file like open(); write modes mark it dirty.

        Parent directories are created for write modes. Text modes default to UTF-8
        so that the bytes written never depend on the replica's locale.
        """
        self._unbuffer()
        if not mode or set(mode) - _VALID_MODE_CHARS:
            raise StateError(f"invalid mode {mode!r} for {path!r}")
        rel, full = self._resolve(path)
        writing = bool(set(mode) & _WRITE_FLAGS)
        if self.lazy is not None:
            if "w" in mode and not self._read_only:
                self.lazy.forget(rel)  # truncated anyway: the old content is not needed
            else:
                self.lazy.ensure(rel)
        if writing:
            self._check_writable(rel)
        if "b" not in mode and encoding is None:
            encoding = "utf-8"
        # The parents are made, and a directory told apart, only when the open fails:
        # checking first cost two more calls into the file system for every write.
        try:
            f = open(full, mode, encoding=encoding)  # noqa: SIM115 - the caller closes it
        except FileNotFoundError:
            if not writing:
                raise
            full.parent.mkdir(parents=True, exist_ok=True)
            f = open(full, mode, encoding=encoding)  # noqa: SIM115 - the caller closes it
        except (IsADirectoryError, FileExistsError) as e:
            if writing and full.is_dir():
                raise StateError(f"state path {path!r} is a directory") from e
            raise
        if writing:
            self._mark_written(rel)
            self._open_writers = [w for w in self._open_writers if not w.closed]
            self._open_writers.append(f)
        return f

    def read_bytes(self, path: str) -> bytes:
        """A state file's content (FileNotFoundError if there is none)."""
        rel, full = self._resolve(path, last=False)
        if self._buffer is not None and rel in self._buffer:
            return self._buffer[rel]
        if self.lazy is not None:
            self.lazy.ensure(rel)
        fd = _open_nofollow(path, full, os.O_RDONLY)
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks)

    def write_bytes(self, path: str, data: bytes) -> None:
        """Replace a state file's content with `data` (open(path, "wb") and write)."""
        rel, full = self._resolve(path, last=False)
        self._check_writable(rel)
        if self.lazy is not None:
            self.lazy.forget(rel)  # replaced whole: the old content is not needed
        if self._buffer is not None:
            self._buffer[rel] = bytes(data)
        else:
            self._write_fd(path, full, os.O_TRUNC, 0, data)
        self._mark_written(rel)

    def write_at(self, path: str, offset: int, data: bytes) -> None:
        """Write `data` at `offset` of a state file, keeping the rest of it; the file (and
        its directory) is created if missing. One open, pwrite and close: the files app's
        WRITE, which through a Python file object cost more calls than its bytes."""
        self._unbuffer()
        rel, full = self._resolve(path)
        self._check_writable(rel)
        if self.lazy is not None:
            self.lazy.ensure(rel)  # the bytes around the range are kept: fetch them first
        self._write_fd(path, full, 0, offset, data)
        self._mark_written(rel)

    def _write_fd(self, path: str, full: Path, flags: int, offset: int, data: bytes) -> None:
        flags |= os.O_WRONLY | os.O_CREAT
        try:
            fd = _open_nofollow(path, full, flags)
        except FileNotFoundError:
            full.parent.mkdir(parents=True, exist_ok=True)
            fd = _open_nofollow(path, full, flags)
        except IsADirectoryError as e:
            raise StateError(f"state path {path!r} is a directory") from e
        try:
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, offset)
                view = view[n:]
                offset += n
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        rel, full = self._resolve(path)
        if self._buffer is not None and rel in self._buffer:
            return True
        self._unbuffer()  # a directory whose files are all still in the buffer
        if full.exists():
            return True
        return self.lazy is not None and (self.lazy.is_pending(rel) or self.lazy.dir_pending(rel))

    def is_dir(self, path: str) -> bool:
        self._unbuffer()
        rel, full = self._resolve(path)
        return full.is_dir() or (self.lazy is not None and self.lazy.dir_pending(rel))

    def listdir(self, path: str = ".") -> list[str]:
        """Sorted entry names (os.listdir order differs between file systems).

        The root listing hides the runtime's reserved directory: whether it exists
        yet differs between a fresh and a recovered replica.
        """
        self._unbuffer()
        rel = normalize_or_root(path)
        if rel == "":
            names = {n for n in os.listdir(self.root) if n != RESERVED_DIR}
        else:
            full = self._resolve(path)[1]
            try:
                names = set(os.listdir(full))
            except FileNotFoundError:
                if self.lazy is None or not self.lazy.dir_pending(rel):
                    raise
                names = set()
        if self.lazy is not None:
            names |= self.lazy.pending_names(rel)
        if rel == "":
            names.discard(RESERVED_DIR)
        return sorted(names)

    def makedirs(self, path: str) -> None:
        self._unbuffer()
        # Directories are not manifest entries (only files are), so nothing to mark.
        rel, full = self._resolve(path)
        self._check_writable(rel)
        full.mkdir(parents=True, exist_ok=True)

    def delete(self, path: str) -> None:
        """Delete a file, or a directory with everything below it."""
        self._unbuffer()
        rel, full = self._resolve(path)
        self._check_writable(rel)
        self._real_dirs.clear()
        unfetched = self.lazy.pending_under(rel) if self.lazy is not None else []
        unmade = self.lazy is not None and self.lazy.dir_pending(rel)
        for f in unfetched:
            self.lazy.forget(f)  # type: ignore[union-attr]
            self._mark_deleted(f)
        if self.lazy is not None:
            self.lazy.forget_dir(rel)
        if not full.exists():
            if unfetched or unmade:
                return
            raise StateError(f"state path {path!r} does not exist")
        for f in self._files_under(rel, full):
            self._mark_deleted(f)
        if full.is_dir():
            shutil.rmtree(full)
        else:
            full.unlink()

    def rename(self, src: str, dst: str) -> None:
        """Rename a file or directory, replacing a destination file (os.replace)."""
        self._unbuffer()
        src_rel, src_full = self._resolve(src)
        dst_rel, dst_full = self._resolve(dst)
        self._check_writable(src_rel)
        self._real_dirs.clear()
        if self.lazy is not None:
            self.lazy.ensure_under(src_rel)
            if src_rel != dst_rel:
                self.lazy.forget(dst_rel)
        if not src_full.exists():
            raise StateError(f"state path {src!r} does not exist")
        if src_rel == dst_rel:
            return
        if dst_rel.startswith(src_rel + "/"):
            raise StateError(f"cannot move {src!r} into itself ({dst!r})")
        if dst_full.is_dir() or (self.lazy is not None and self.lazy.dir_pending(dst_rel)):
            # os.replace would either fail or merge; neither is worth defining.
            raise StateError(f"rename destination {dst!r} is a directory")
        moved = self._files_under(src_rel, src_full)
        dst_full.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src_full, dst_full)
        for f in moved:
            self._mark_deleted(f)
            self._mark_written(dst_rel + f[len(src_rel) :])


def normalize_or_root(path: str) -> str:
    """Like normalize() but '', '.' and './' name the root itself (for listdir)."""
    if path in ("", ".", "./"):
        return ""
    return normalize(path)
