# snapshots/dirstore.py - CheckpointStore on a plain directory: snapshots are full copies.
# For unit tests and for users without ZFS; O(state size) per snapshot, where ZFS is O(1).
"""DirStore: ``root/live`` is the state, ``root/snapshots/<name>`` are full copies.

Layout under ``root`` (the store owns all of it):

* ``live/``             the live state directory (``path``).
* ``snapshots/<name>/`` one complete copy per snapshot. Files are copied, never hard-linked,
  so a later in-place write to ``live/`` cannot change a snapshot.
* ``ORDER``             snapshot names, one a line, oldest first (directory timestamps are
  not a reliable creation order: copies inherit the source's).

``ORDER`` is the commit point: a snapshot exists once ORDER lists it. Taking one copies
to ``snapshots/.tmp-<name>``, renames it to ``snapshots/<name>``, then adds it to ORDER;
destroying one drops it from ORDER, renames the copy to ``snapshots/.del-<name>``, then
removes that. A crash at any step leaves at most unlisted entries under ``snapshots/``
(``.tmp-*``, ``.del-*``, a complete copy not yet listed): :meth:`DirStore.recover` (the
runtime's start) removes them, and :meth:`DirStore.snapshot` replaces an unlisted copy of
the name it takes, so a killed checkpoint is as if it never started.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from zz.atomicfile import write_atomic
from zz.snapshots.crashpoint import crash_point
from zz.snapshots.manifest import FETCH_TMP_DIR, write_all
from zz.snapshots.store import CheckpointStore, StorageError, check_snapshot_name

_ORDER = "ORDER"


class DirStore(CheckpointStore):
    """Plain-directory backend. ``root`` is created if missing."""

    def __init__(self, root: Path | str, writer: bool = False) -> None:
        """`writer`: this object is the store's one writer (the runtime), so ORDER is read
        once and then kept in memory (a checkpoint listed it three times, each a round
        trip over a guest's share); a reader (controld) reads it at every call."""
        self._writer = writer
        self._order: list[str] | None = None
        self._root = Path(root).absolute()
        self._live = self._root / "live"
        self._snaps = self._root / "snapshots"
        try:
            self._live.mkdir(parents=True, exist_ok=True)
            self._snaps.mkdir(exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create store directory {self._root}: {e}") from e

    @property
    def path(self) -> Path:
        return self._live

    @property
    def root(self) -> Path:
        return self._root

    def recover(self) -> list[str]:
        listed = self.list_snapshots()
        removed = []
        for entry in sorted(self._snaps.iterdir()):
            if entry.name not in listed:  # .tmp-*, .del-*, a copy renamed but not listed
                _remove(entry)
                removed.append(f"snapshots/{entry.name}")
        present = [n for n in listed if (self._snaps / n).is_dir()]
        if present != listed:  # only if something else deleted copies: list what is there
            self._write_order(present)
            removed += [f"ORDER: {n}" for n in listed if n not in present]
        for tmp in self._root.glob(f".{_ORDER}.*tmp"):  # write_atomic's, of a killed writer
            tmp.unlink(missing_ok=True)
        return removed

    def snapshot(self, name: str) -> None:
        self._snapshot(name, _copy)

    shares_unchanged = True

    def snapshot_since(self, name: str, base: str, unchanged: Callable[[str], bool]) -> None:
        """A file unchanged since snapshot `base` is a hard link to its copy there: the
        copies are never written, so they may share an inode, and a checkpoint of a large
        state costs a link per file, not a copy (the report of a checkpoint seq waits for
        it). The live files are always copied, never linked: the application writes them."""
        if base not in self.list_snapshots():
            return self.snapshot(name)
        base_dir = self._snaps / base

        def link_or_copy(src: str, dst: str) -> object:
            rel = os.path.relpath(src, self._live)
            if unchanged(rel):
                try:
                    os.link(base_dir / rel, dst, follow_symlinks=False)
                    return dst
                except OSError:
                    pass  # not in `base` (a file a recovery fetched since): copied
            return _copy(src, dst)

        self._snapshot(name, link_or_copy)

    def stage_since(
        self,
        name: str,
        base: str,
        files: Iterable[str],
        unchanged: Callable[[str], bool],
        content: Mapping[str, bytes] | None = None,
    ) -> Callable[[], None] | None:
        """Copy the files that changed since `base` into ``snapshots/.stage-<name>/`` (flat,
        numbered): one copy per changed file and nothing per unchanged one, where the
        copytree of snapshot_since makes and stats every directory and file of the state
        (~330 system calls for 12 files in 16 directories; through a guest's state share
        each is a round trip to the host). The half returned links the unchanged files from
        `base`, moves the copies into place, renames the tree to ``snapshots/<name>`` and
        lists it; it reads nothing live. An unchanged file missing from `base` is a
        StorageError there (the caller vouches for `base` from its manifest). A changed
        file whose bytes `content` holds (what the manifest build hashed) is written from
        them: the live file is not read a second time (3 system calls instead of 6)."""
        check_snapshot_name(name)
        listed = self.list_snapshots()
        if base not in listed:
            return None
        if name in listed:
            raise StorageError(f"snapshot {name!r} already exists in {self._root}")
        keep: list[str] = []
        fresh: list[str] = []
        for rel in files:
            (keep if unchanged(rel) else fresh).append(rel)
        stage = self._snaps / f".stage-{name}"
        tmp = self._snaps / f".tmp-{name}"
        try:
            try:
                os.mkdir(stage)
            except FileExistsError:
                _remove(stage)  # what a crash left unlisted: taken anew
                os.mkdir(stage)
            for i, rel in enumerate(fresh):
                data = None if content is None else content.get(rel)
                if data is None:
                    _copy_file(self._live / rel, stage / str(i))
                else:
                    _write_file(data, stage / str(i))
        except OSError as e:
            shutil.rmtree(stage, ignore_errors=True)
            raise StorageError(f"cannot stage {name!r} from {self._live}: {e}") from e
        crash_point("dirstore.snapshot.staged")
        base_dir = self._snaps / base

        def finish() -> None:
            made: set[str] = set()

            def parent_of(rel: str) -> None:
                d = rel.rpartition("/")[0]
                if d and d not in made:
                    os.makedirs(tmp / d, exist_ok=True)
                    while d and d not in made:
                        made.add(d)
                        d = d.rpartition("/")[0]

            try:
                for old in (tmp, self._snaps / name):
                    if old.exists() or old.is_symlink():
                        _remove(old)  # what a crash left unlisted: taken anew
                os.mkdir(tmp)
                for rel in keep:
                    parent_of(rel)
                    os.link(base_dir / rel, tmp / rel, follow_symlinks=False)
                for i, rel in enumerate(fresh):
                    parent_of(rel)
                    os.rename(stage / str(i), tmp / rel)
                os.rmdir(stage)
                crash_point("dirstore.snapshot.copied")
                os.rename(tmp, self._snaps / name)
                crash_point("dirstore.snapshot.renamed")
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(stage, ignore_errors=True)
                raise StorageError(f"cannot complete snapshot {name!r} from {base!r}: {e}") from e
            self._write_order([*self.list_snapshots(), name])

        return finish

    def _snapshot(self, name: str, copy: Callable[[str, str], object]) -> None:
        check_snapshot_name(name)
        if name in self.list_snapshots():
            raise StorageError(f"snapshot {name!r} already exists in {self._root}")
        dest = self._snaps / name
        if dest.exists() or dest.is_symlink():
            _remove(dest)  # a copy a crash left unlisted: not a snapshot, taken anew
        tmp = self._snaps / f".tmp-{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            # symlinks=True copies a link as a link instead of following it out of the tree;
            # copy2 writes new inodes (no hard links), keeping the snapshot independent.
            # The fetcher's scratch files are skipped: a background fetch renames them away
            # while the copy runs, and copying one that vanished failed the checkpoint and
            # killed a correct replica (campaign seed 3401 round 97).
            shutil.copytree(
                self._live, tmp, symlinks=True, copy_function=copy, ignore=self._skip_scratch
            )
            crash_point("dirstore.snapshot.copied")
            os.rename(tmp, dest)
            crash_point("dirstore.snapshot.renamed")
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StorageError(f"cannot snapshot {self._live} as {name!r}: {e}") from e
        self._write_order([*self.list_snapshots(), name])

    def _skip_scratch(self, directory: str, names: list[str]) -> set[str]:
        parent, _, leaf = FETCH_TMP_DIR.rpartition("/")
        return {leaf} if leaf in names and Path(directory) == self._live / parent else set()

    def list_snapshots(self) -> list[str]:
        if self._order is not None:
            return list(self._order)
        try:
            lines = (self._root / _ORDER).read_text().splitlines()
        except FileNotFoundError:
            lines = []
        names = [n for n in lines if n]
        if self._writer:
            self._order = list(names)
        return names

    def destroy_snapshot(self, name: str) -> None:
        self.detach_snapshot(name)()

    def detach_snapshot(self, name: str) -> Callable[[], None]:
        """Unlist `name` and rename its copy away (quick); the copy's removal is returned."""
        check_snapshot_name(name)
        names = self.list_snapshots()
        if name not in names:
            raise StorageError(f"no snapshot {name!r} in {self._root}")
        # Drop it from ORDER first: a crash then leaves an unlisted copy (recover() removes
        # it), never a listed snapshot whose directory is half deleted.
        self._write_order([n for n in names if n != name])
        crash_point("dirstore.destroy.unlisted")
        # A name of its own: the removal may still run when a copy of the same name (a
        # checkpoint taken again after a restore) is detached.
        doomed = self._snaps / f".del-{name}-{time.monotonic_ns()}"
        if (self._snaps / name).exists():
            os.rename(self._snaps / name, doomed)
        crash_point("dirstore.destroy.renamed")
        return lambda: shutil.rmtree(doomed, ignore_errors=True)

    @contextmanager
    def _open(self, name: str) -> Iterator[Path]:
        check_snapshot_name(name)
        if name not in self.list_snapshots():
            raise StorageError(f"no snapshot {name!r} in {self._root}")
        # Known limit: the caller gets the snapshot copy itself, not a throw-away clone, so
        # it is read-only by contract only (as root, file modes would not stop a write).
        yield self._snaps / name

    def open_snapshot(self, name: str) -> AbstractContextManager[Path]:
        return self._open(name)

    def destroy(self) -> None:
        try:
            shutil.rmtree(self._root)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"cannot remove store {self._root}: {e}") from e

    def _write_order(self, names: list[str]) -> None:
        self._order = None  # read again if the write fails half-way
        write_atomic(self._root / _ORDER, "".join(f"{n}\n" for n in names))
        if self._writer:
            self._order = list(names)


def _copy(src: str, dst: str) -> object:
    crash_point("dirstore.snapshot.copying")  # a copy half made
    return shutil.copy2(src, dst)


def _write_file(data: bytes, dst: Path) -> None:
    """`data` in a new file `dst` (_copy_file from bytes already read)."""
    crash_point("dirstore.snapshot.copying")
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


def _copy_file(src: Path, dst: Path) -> None:
    """The bytes of `src` in a new file `dst` (no metadata: a manifest records none)."""
    crash_point("dirstore.snapshot.copying")
    fd_in = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            offset = 0
            while n := os.sendfile(fd_out, fd_in, offset, 1 << 23):
                offset += n
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
