# snapshots/manifest.py - per-file SHA-256 manifests of a replica's state and checkpoint digests.
# docs/design.md §4.2: re-hash only files written since the last checkpoint; C = SHA-256(encoding).
"""Checkpoint manifests: sorted path -> (size, SHA-256), plus tombstones for deletions.

Invariants of a :class:`Manifest`:

* ``files`` maps every regular file of the state directory to its size and SHA-256;
  ``deleted`` holds the paths that the previous checkpoint's manifest listed as files and
  that are gone now (tombstones last one checkpoint). The two sets are disjoint.
* Paths are canonical (see :func:`normalize_path`): relative, ``/``-separated, UTF-8, no
  empty, ``.`` or ``..`` component. Directories are implicit; empty ones are not recorded
  (known limit: a recovering replica does not recreate empty directories).
* ``.zz/`` is reserved for the runtime; ``.zz/memory`` holds the application's in-memory
  state, written by :meth:`ManifestBuilder.write_memory`, hashed like any other file.

The byte encoding (and so the digest) is specified in docs/checkpoints.md.
"""

from __future__ import annotations

import hashlib
import os
import stat
import struct
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from zz.snapshots.crashpoint import crash_point

MAGIC = b"ZZMF"
VERSION = 1
KIND_TOMBSTONE = 0
KIND_FILE = 1
RESERVED_DIR = ".zz"
# Scratch space of the state fetcher (snapshots/fetch.py): files being assembled, renamed
# into place once verified. Never part of a snapshot (snapshots/dirstore.py skips it).
FETCH_TMP_DIR = f"{RESERVED_DIR}/fetch-tmp"
MEMORY_PATH = ".zz/memory"
MAX_PATH_BYTES = 4096
_CHUNK = 1 << 20
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


class ManifestError(Exception):
    """Bad path, unsupported file type, or malformed manifest encoding."""


class FileEntry(NamedTuple):
    """A tuple, not a dataclass: a manifest has one per file and decoding builds them in
    its hot loop."""

    size: int
    sha256: bytes  # 32 raw bytes


def normalize_path(path: str) -> str:
    """Canonical form of a state-relative path; ManifestError if it cannot be one.

    ``./a//b`` becomes ``a/b``; absolute paths, ``..`` components, NUL, backslashes (a
    Windows separator we would otherwise store as a file name character) and non-UTF-8 names
    are rejected.
    """
    if not isinstance(path, str):
        raise ManifestError(f"path must be str, got {type(path).__name__}")
    if path.startswith("/"):
        raise ManifestError(f"{path!r}: absolute path, state paths are relative")
    if "\0" in path or "\\" in path:
        raise ManifestError(f"{path!r}: NUL or backslash in path")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts:
        raise ManifestError(f"{path!r}: empty path")
    if ".." in parts:
        raise ManifestError(f"{path!r}: '..' is not allowed in state paths")
    norm = "/".join(parts)
    try:
        raw = norm.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ManifestError(f"{path!r}: not valid UTF-8") from e
    if len(raw) > MAX_PATH_BYTES:
        raise ManifestError(f"{path[:40]!r}...: longer than {MAX_PATH_BYTES} bytes")
    return norm


def _is_canonical(path: str) -> bool:
    """normalize_path(path) == path, with string operations only (decode's hot loop)."""
    if not path or path[0] == "/" or path[-1] == "/" or "//" in path:
        return False
    if "\0" in path or "\\" in path:
        return False
    wrapped = "/" + path + "/"
    return "/./" not in wrapped and "/../" not in wrapped


def is_reserved(path: str) -> bool:
    return path == RESERVED_DIR or path.startswith(RESERVED_DIR + "/")


def _sort_key(path: str) -> bytes:
    return path.encode("utf-8")


@dataclass(frozen=True)
class Manifest:
    files: Mapping[str, FileEntry] = field(default_factory=dict)
    deleted: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        both = self.deleted & self.files.keys()
        if both:
            raise ManifestError(f"paths both present and deleted: {sorted(both)[:5]}")

    def encode(self) -> bytes:
        """Canonical encoding (docs/checkpoints.md); equal manifests encode equally.

        Computed once per manifest (it is immutable): a recovering replica's manifest
        has an entry per file, and encoding 10,000 of them costs ~80 ms."""
        cached = self.__dict__.get("_encoded")
        if cached is None:
            cached = self._encode()
            object.__setattr__(self, "_encoded", cached)
        return cached

    def _encode(self) -> bytes:
        items: list[tuple[bytes, FileEntry | None]] = [
            (_sort_key(p), e) for p, e in self.files.items()
        ]
        items += [(_sort_key(p), None) for p in self.deleted]
        items.sort(key=lambda it: it[0])
        out = [MAGIC, struct.pack(">BBHI", VERSION, 0, 0, len(items))]
        offsets = []
        off = _HEADER
        for raw, e in items:
            offsets.append(off)
            out.append(struct.pack(">I", len(raw)))
            out.append(raw)
            if e is None:
                out.append(bytes([KIND_TOMBSTONE]))
                off += 5 + len(raw)
            else:
                out.append(struct.pack(">BQ", KIND_FILE, e.size))
                out.append(e.sha256)
                off += 45 + len(raw)
        offsets.append(off)
        raws = [raw for raw, _ in items]
        object.__setattr__(self, "_layout", _Layout(offsets, raws, [r.decode() for r in raws]))
        return b"".join(out)

    def digest(self) -> bytes:
        """Checkpoint digest C = SHA-256(encode())."""
        return hashlib.sha256(self.encode()).digest()

    def paths_with(self, sha256: bytes) -> list[str]:
        """The paths whose entry has content hash `sha256` (a copy of a file found by its
        hash, snapshots/copies.py). The index is built once per manifest, O(files)."""
        index = self.__dict__.get("_by_hash")
        if index is None:
            index = {}
            for path, entry in self.files.items():
                index.setdefault(entry.sha256, []).append(path)
            object.__setattr__(self, "_by_hash", index)
        return list(index.get(sha256, ()))

    @classmethod
    def decode(cls, data: bytes, like: Manifest | None = None) -> Manifest:
        """Strict inverse of encode(): anything encode() would not produce is an error.

        `like` is a manifest the encoding probably shares most entries with (a replica's
        own last checkpoint, when it recovers a newer one): the entries byte-identical in
        both are taken from it and only the bytes in between are parsed, so decoding
        costs O(changes) instead of O(files). The result is the same either way."""
        data = bytes(data)
        count = _header(data)
        if like is not None:
            m = _decode_like(cls, data, count, like)
            if m is not None:
                return m
        files: dict[str, FileEntry] = {}
        deleted: set[str] = set()
        lay = _Layout([], [], [])
        end = _parse_entries(data, _HEADER, count, b"", files, deleted, lay)
        if end != len(data):
            raise ManifestError(f"{len(data) - end} trailing bytes after the manifest")
        lay.offsets.append(end)
        return _decoded(cls(files, frozenset(deleted)), data, lay)


class _Layout(NamedTuple):
    """Where each entry of an encoding starts (plus its end), its raw path and its path,
    in order."""

    offsets: list[int]
    raws: list[bytes]
    paths: list[str]


_HEADER = 12


def _decoded(m: Manifest, data: bytes, lay: _Layout) -> Manifest:
    """`m` with the encoding it was decoded from and that encoding's layout cached: only a
    canonical encoding decodes, so it is this manifest's encoding."""
    object.__setattr__(m, "_encoded", data)
    object.__setattr__(m, "_layout", lay)
    return m


def _header(data: bytes) -> int:
    """The entry count of an encoding, after checking its header."""
    if len(data) < _HEADER or data[:4] != MAGIC:
        raise ManifestError("not a manifest (bad magic or too short)")
    version, r1, r2, count = struct.unpack_from(">BBHI", data, 4)
    if version != VERSION or r1 or r2:
        raise ManifestError(f"unsupported manifest version {version} or reserved bits set")
    return int(count)


def _parse_entries(
    data: bytes,
    off: int,
    count: int,
    prev: bytes,
    files: dict[str, FileEntry],
    deleted: set[str],
    lay: _Layout,
) -> int:
    """Parse `count` entries from `off` (after the raw path `prev`) into files/deleted,
    appending to `lay`; returns the offset after the last one."""
    n = len(data)
    offsets, raws, paths = lay.offsets, lay.raws, lay.paths
    u32 = _U32.unpack_from
    u64 = _U64.unpack_from
    # The hot loop of a recovery (an entry per file): plain bytes slicing and string
    # checks only; every rule of the format is still enforced.
    for _ in range(count):
        offsets.append(off)
        if off + 4 > n:
            raise ManifestError(f"truncated manifest at byte {off}")
        (plen,) = u32(data, off)
        off += 4
        if plen > MAX_PATH_BYTES:
            raise ManifestError(f"path length {plen} over {MAX_PATH_BYTES}")
        if off + plen + 1 > n:
            raise ManifestError(f"truncated manifest at byte {off}")
        raw = data[off : off + plen]
        off += plen
        try:
            path = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ManifestError(f"path at byte {off - plen} is not UTF-8") from e
        if not _is_canonical(path):
            raise ManifestError(f"{path!r}: path not in canonical form")
        if raw <= prev:
            raise ManifestError(f"{path!r}: entries not strictly sorted")
        prev = raw
        raws.append(raw)
        paths.append(path)
        kind = data[off]
        off += 1
        if kind == KIND_FILE:
            if off + 40 > n:
                raise ManifestError(f"truncated manifest at byte {off}")
            files[path] = FileEntry(u64(data, off)[0], data[off + 8 : off + 40])
            off += 40
        elif kind == KIND_TOMBSTONE:
            deleted.add(path)
        else:
            raise ManifestError(f"{path!r}: unknown entry kind {kind}")
    return off


def _layout(m: Manifest) -> _Layout:
    m.encode()  # records the layout when it encodes
    return m.__dict__["_layout"]


def _common_prefix(a: bytes, b: bytes, start: int) -> int:
    """Length of the longest common prefix of a[start:] and b[start:] (memcmp-speed
    comparisons of halving spans, no per-byte Python loop)."""
    va, vb = memoryview(a), memoryview(b)
    lo, hi = 0, min(len(a), len(b)) - start  # a[start:start+lo] == b[...]; hi: upper bound
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if va[start + lo : start + mid] == vb[start + lo : start + mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: bytes, b: bytes, limit: int) -> int:
    """Length (at most `limit`) of the longest common suffix of a and b."""
    va, vb = memoryview(a), memoryview(b)
    na, nb = len(a), len(b)
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if va[na - mid : na - lo] == vb[nb - mid : nb - lo]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _decode_like(cls: type[Manifest], data: bytes, count: int, like: Manifest) -> Manifest | None:
    """decode(data) from the entries it shares with `like`, or None to decode it all
    (nothing in common, or boundaries that do not line up)."""
    old = like.encode()
    lay = _layout(like)
    if len(old) == len(data) and count == len(lay.raws):
        m = _decode_aligned(cls, data, like, old, lay)
        if m is not None:
            return m
    offs, raws, paths = lay.offsets, lay.raws, lay.paths
    n_old = len(raws)
    # Own entries [0, k) lie in the common prefix and [j, n_old) in the common suffix:
    # byte-identical entries at the same alignment decode to the same entries.
    k = bisect_right(offs, _HEADER + _common_prefix(old, data, _HEADER), 0, n_old + 1) - 1
    k = min(k, n_old)
    tail = _common_suffix(old, data, min(len(old), len(data)) - offs[k])
    j = max(bisect_left(offs, len(old) - tail, 0, n_old + 1), k)
    if k == 0 and j == n_old:
        return None  # nothing shared: the plain decode is as fast
    start = offs[k]
    stop = len(data) - (len(old) - offs[j])  # where own entry j starts in `data`
    middle = count - k - (n_old - j)
    if middle < 0 or stop < start:
        return None
    files: dict[str, FileEntry] = {}
    deleted: set[str] = set()
    new = _Layout(offs[:k], raws[:k], paths[:k])
    try:
        end = _parse_entries(data, start, middle, raws[k - 1] if k else b"", files, deleted, new)
    except ManifestError:
        return None  # the plain decode names the error
    if end != stop or (j < n_old and middle and new.raws[-1] >= raws[j]):
        return None
    shift = stop - offs[j]
    new.offsets.extend([o + shift for o in offs[j:]])
    new.raws.extend(raws[j:])
    new.paths.extend(paths[j:])
    theirs = like.files
    # Rebuilt in encoding order, as the plain decode builds it (C-speed comprehensions).
    head = {p: e for p in paths[:k] if (e := theirs.get(p)) is not None}
    rest = {p: e for p in paths[j:] if (e := theirs.get(p)) is not None}
    dead = (like.deleted - set(paths[k:j])) | deleted
    return _decoded(cls({**head, **files, **rest}, frozenset(dead)), data, new)


HashFile = Callable[[Path], FileEntry]


def hash_file(path: Path) -> FileEntry:
    """Size and SHA-256 of a regular file, never following a symlink.

    The size is the number of bytes hashed (not a separate stat), so the pair is consistent
    even if the file changes under us; the caller must not let the app write meanwhile.
    """
    return hash_file_keep(path, -1)[0]


def write_all(fd: int, data: bytes) -> None:
    """All of `data` to `fd` with os.write: one call for a file (a round trip on a guest's
    share) where a file object would add an fstat and buffer copies."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def newest_manifest_path(manifests: Path) -> Path | None:
    """The `ckpt-<n>.manifest` with the highest n in a state directory's `manifests/`."""
    newest: tuple[int, Path] | None = None
    try:
        for p in manifests.glob("ckpt-*.manifest"):
            num = p.name[5 : -len(".manifest")]
            if num.isdigit() and (newest is None or int(num) > newest[0]):
                newest = (int(num), p)
    except OSError:
        return None
    return None if newest is None else newest[1]


def hash_file_keep(path: Path, limit: int) -> tuple[FileEntry, bytes | None]:
    """hash_file, and the bytes hashed when the file holds at most `limit` of them: a
    checkpoint that copies a changed file into its snapshot writes the copy from them
    instead of reading the file a second time (ManifestBuilder.kept)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == 40:  # ELOOP: the last component is a symlink
            raise ManifestError(f"{path}: symbolic link, not allowed in state") from e
        raise
    try:  # os calls, not a file object: it stats the file again (a round trip on a share)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"{path}: not a regular file ({_kind(st.st_mode)})")
        h = hashlib.sha256()
        parts: list[bytes] | None = [] if st.st_size <= limit else None
        size = 0
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
            size += len(chunk)
            if parts is not None:
                parts.append(chunk)
                if size > limit:  # grew since the fstat
                    parts = None
    finally:
        os.close(fd)
    return FileEntry(size, h.digest()), None if parts is None else b"".join(parts)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "symbolic link"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


def _walk_files(root: Path, rel: str = "") -> Iterator[str]:
    """Relative paths of all regular files under root/rel; symlinks and specials raise."""
    base = root / rel if rel else root
    with os.scandir(base) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        try:
            e.name.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ManifestError(f"{base / e.name!r}: file name is not UTF-8") from err
        p = f"{rel}/{e.name}" if rel else e.name
        st = e.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            yield from _walk_files(root, p)
        elif stat.S_ISREG(st.st_mode):
            yield normalize_path(p)
        else:
            raise ManifestError(f"{root / p}: {_kind(st.st_mode)}, not allowed in state")


def files_under(root: Path, rel: str = "") -> Iterator[str]:
    """Relative paths ("a/b") of the files at or below root/rel as they are: unchecked and
    unsorted (os.walk: a symlink counts as a file, a linked directory is not entered). What
    a state directory holds, for removing or marking dirty (execution/state.py, fetch.py);
    a manifest is made from the checked walk above."""
    base = root / rel if rel else root
    for dirpath, _dirs, files in os.walk(base):
        sub = os.path.relpath(dirpath, root).replace(os.sep, "/")
        for name in files:
            yield name if sub == "." else f"{sub}/{name}"


def scan(
    root: Path | str, previous: Manifest | None = None, *, hasher: HashFile = hash_file
) -> Manifest:
    """Full manifest of ``root``, hashing every file (verification, first checkpoint).

    Tombstones are the files of ``previous`` that are gone; without ``previous`` none.
    """
    root = Path(root)
    files = {p: hasher(root / p) for p in _walk_files(root)}
    gone = frozenset(previous.files.keys() - files.keys()) if previous else frozenset()
    return Manifest(files, gone)


class ManifestBuilder:
    """Incremental manifests for one state directory.

    The runtime reports every path the application wrote, created, deleted or renamed
    (both names) through :meth:`mark_dirty` / :meth:`mark_renamed`; :meth:`build` then
    re-hashes only those paths and takes every other entry from the previous manifest.
    A dirty path that is a directory now is re-hashed as a whole tree; a dirty path that
    is gone removes everything the previous manifest had at or below it.

    Correct only if the dirty set is complete; :func:`scan` checks that (and is what a
    replica runs when unsure, e.g. after a restart). With ``previous=None`` the first
    :meth:`build` is a full scan.
    """

    def __init__(
        self, root: Path | str, previous: Manifest | None = None, *, hasher: HashFile = hash_file
    ) -> None:
        self.root = Path(root)
        self.previous = previous
        self._hasher = hasher
        self._dirty: set[str] = set()
        # The runtime files written since the last build, with the entry of the bytes
        # written: build() takes it instead of reading the file back.
        self._known: dict[str, FileEntry] = {}
        # keep_limit > 0: the bytes of each file up to that size that build() hashed, and of
        # the runtime files written, by path (`kept`, taken by take_kept()): a snapshot that
        # copies the changed files writes them from here (DirStore.stage_since `content`).
        self.keep_limit = 0
        self.keep_total = 32 << 20  # what all kept bytes may add up to
        self.kept: dict[str, bytes] = {}
        self._kept_bytes = 0

    def take_kept(self) -> dict[str, bytes]:
        """The bytes kept since the last call (and forget them)."""
        kept, self.kept, self._kept_bytes = self.kept, {}, 0
        return kept

    def _keep(self, rel: str, data: bytes) -> None:
        if self._kept_bytes + len(data) <= self.keep_total:
            self.kept[rel] = data
            self._kept_bytes += len(data)

    @property
    def dirty(self) -> frozenset[str]:
        return frozenset(self._dirty)

    def mark_dirty(self, path: str) -> None:
        """The application wrote, created or deleted ``path`` (a file or a directory)."""
        norm = normalize_path(path)
        if is_reserved(norm):
            raise ManifestError(f"{path!r}: {RESERVED_DIR}/ is reserved for the runtime")
        self._dirty.add(norm)

    def mark_renamed(self, old: str, new: str) -> None:
        self.mark_dirty(old)
        self.mark_dirty(new)

    def mark_all_dirty(self, paths: Iterable[str]) -> None:
        for p in paths:
            self.mark_dirty(p)

    def write_memory(self, data: bytes) -> None:
        """Store the app's in-memory state as ``.zz/memory`` (atomically) and mark it dirty."""
        self.write_runtime_file(MEMORY_PATH, data)

    def write_runtime_file(self, path: str, data: bytes) -> None:
        """Write one of the runtime's own files under the reserved ``.zz/`` (atomically)
        and mark it dirty. mark_dirty() refuses these paths: apps must not write there,
        the runtime is the one writer that may. Not fsynced: a checkpoint survives a
        killed process, not a host's power cut (docs/checkpoints.md "Crash consistency"),
        and the snapshot's copy of this file is not synced either; through a guest's share
        an fsync is the host's disk flush, on the report's path."""
        rel = normalize_path(path)
        if not is_reserved(rel) or rel == RESERVED_DIR:
            raise ManifestError(f"{path!r}: runtime files live under {RESERVED_DIR}/")
        target = self.root / rel
        tmp = target.with_name(target.name + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
        crash_point("manifest.runtime-file.written")
        os.replace(tmp, target)
        self._dirty.add(rel)
        self._known[rel] = FileEntry(len(data), hashlib.sha256(data).digest())
        if len(data) <= self.keep_limit:
            self._keep(rel, bytes(data))

    def build(self) -> Manifest:
        """Manifest of the current state; it becomes ``previous`` and the dirty set empties."""
        if self.previous is None:
            m = scan(self.root, hasher=self._hasher)
        else:
            m = self._build_incremental(self.previous)
        self.previous = m
        self._dirty.clear()
        self._known.clear()
        return m

    def _build_incremental(self, prev: Manifest) -> Manifest:
        files = dict(prev.files)
        order = sorted(prev.files)  # str order keeps every "p/..." range contiguous
        dirs: set[str] = set()  # ancestors already seen to be directories in this build
        for p in sorted(self._dirty):
            # Whatever the previous manifest had at p or below it is stale...
            for old in _at_or_below(order, p):
                files.pop(old, None)
            # ...then record what is there now.
            known = self._known.get(p)
            if known is not None:  # a runtime file, written in one piece by write_runtime_file
                files[p] = known
                for anc in _ancestors(p):
                    files.pop(anc, None)
                continue
            full = self.root / p
            try:
                st = full.lstat()
            except (FileNotFoundError, NotADirectoryError):
                continue
            # p exists, so each ancestor is a directory now: drop a file the previous
            # manifest had there (a replaced by a/b), and refuse a symlinked ancestor,
            # which would make us hash a file outside the state directory.
            for anc in _ancestors(p):
                files.pop(anc, None)
                if anc in dirs:
                    continue
                if stat.S_ISLNK((self.root / anc).lstat().st_mode):
                    raise ManifestError(f"{self.root / anc}: symbolic link, not allowed in state")
                dirs.add(anc)
            if stat.S_ISREG(st.st_mode):
                if self.keep_limit and self._hasher is hash_file:
                    files[p], data = hash_file_keep(full, self.keep_limit)
                    if data is not None:
                        self._keep(p, data)
                else:
                    files[p] = self._hasher(full)
            elif stat.S_ISDIR(st.st_mode):
                for q in _walk_files(self.root, p):
                    files[q] = self._hasher(self.root / q)
            else:
                raise ManifestError(f"{full}: {_kind(st.st_mode)}, not allowed in state")
        gone = frozenset(prev.files.keys() - files.keys())
        return Manifest(files, gone)


def _at_or_below(order: list[str], p: str) -> Iterator[str]:
    i = bisect_left(order, p)
    if i < len(order) and order[i] == p:
        yield p
        i += 1
    prefix = p + "/"
    i = bisect_left(order, prefix, lo=i)
    while i < len(order) and order[i].startswith(prefix):
        yield order[i]
        i += 1


def _ancestors(p: str) -> Iterator[str]:
    parts = p.split("/")
    for k in range(1, len(parts)):
        yield "/".join(parts[:k])


def _differing_spans(a: bytes, b: bytes, lo: int, hi: int, out: list[tuple[int, int]]) -> None:
    """The spans of [lo, hi) where equal-length a and b differ, found by halving with
    memcmp-speed comparisons: O(spans · log n), never a per-byte Python loop."""
    va, vb = memoryview(a), memoryview(b)
    todo = [(lo, hi)]
    while todo:
        x, y = todo.pop()
        if va[x:y] == vb[x:y]:
            continue
        if y - x <= 64:
            if out and out[-1][1] >= x:
                out[-1] = (out[-1][0], y)
            else:
                out.append((x, y))
            continue
        mid = (x + y) // 2
        todo.append((mid, y))  # popped second: spans come out in order
        todo.append((x, mid))


def _decode_aligned(
    cls: type[Manifest], data: bytes, like: Manifest, old: bytes, lay: _Layout
) -> Manifest | None:
    """decode(data) when it has the length and entry count of `like`'s encoding, the usual
    case of files rewritten in place (same paths, new sizes/hashes): only the entries
    whose bytes differ are parsed, each where `like` has its entry; None if they do not
    parse to the same boundaries."""
    offs, raws, paths = lay.offsets, lay.raws, lay.paths
    n = len(raws)
    spans: list[tuple[int, int]] = []
    _differing_spans(old, data, _HEADER, len(data), spans)
    changed: list[int] = []
    for x, y in spans:
        first = max(bisect_right(offs, x, 0, n + 1) - 1, 0)
        last = min(bisect_right(offs, y - 1, 0, n + 1) - 1, n - 1)
        for i in range(first, last + 1):
            if not changed or changed[-1] < i:
                changed.append(i)
    if len(changed) * 4 > n:
        return None  # most entries changed: the plain decode is as fast
    files: dict[str, FileEntry] = {}
    deleted: set[str] = set()
    new_raws, new_paths = list(raws), list(paths)
    one = _Layout([], [], [])
    try:
        for i in changed:
            end = _parse_entries(data, offs[i], 1, b"", files, deleted, one)
            if end != offs[i + 1]:
                return None
            new_raws[i], new_paths[i] = one.raws[-1], one.paths[-1]
    except ManifestError:
        return None  # the plain decode names the error
    for i in changed:  # strictly sorted around every entry that changed
        if (i and new_raws[i - 1] >= new_raws[i]) or (i + 1 < n and new_raws[i] >= new_raws[i + 1]):
            return None
    replaced = {paths[i] for i in changed}
    theirs = like.files
    merged = {
        p: e
        for p in new_paths
        if (e := files.get(p) if p in files or p in replaced else theirs.get(p)) is not None
    }
    dead = (like.deleted - replaced) | deleted
    return _decoded(cls(merged, frozenset(dead)), data, _Layout(list(offs), new_raws, new_paths))
