# controld/snapshots.py - controld serves the checkpoint snapshots of the execution replicas on
# its host to recovering replicas of the same service (ZZ §4.5): the host still has a
# replica's snapshots when the replica itself is paused, crashed or busy.
"""Checkpoint files of this host's execution replicas, for FILE-FETCH (docs/controld.md).

The daemon authenticates the request (a signature of an execution replica of the service)
and frames the answer; this module finds the bytes. Each replica's store is read through
snapshots/fileserve.py, which serves only what a checkpoint manifest lists; the requester
verifies every file against the certified manifest, so a stale or corrupted snapshot costs
it one more source, never a wrong state. A directory store is ``run/s<id>/exec-<i>/store``
(on the host for a process, on the guest's 9p share for a VM); a ZFS store is the
runtime's dataset ``<pool>/s<id>-exec-<i>``, whose snapshots controld reads through clones
of its own (``--ctl-``). The runtime destroys a collected snapshot's clones with it
(ZfsStore.destroy_snapshot), so a clone held here never blocks its garbage collection.

A request that names the file's certified SHA-256 is also answered, each copy verified,
from the replicas' other checkpoints and live states and from the forensic states kept on
this host (``run/s<id>/exec-<i>.forensic-<seq>/``, controld/actions.py
set_aside_state) of the slots placed here: a convicted replica's checkpoints and live
state, by hash only, each copy hashed here before it is sent (a liar's files are right
where their hash matches, and only those are served). On ZFS the forensic state is the
dataset ``<pool>/<dataset>-forensic-<seq>`` (unmounted), read through clones of its
checkpoint snapshots and of its ``@forensic-<seq>`` snapshot (the live state at the
conviction), with the manifests of the forensic state directory of the same name.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from zz.config import Config, Host, Service
from zz.controld.actions import replica_dataset
from zz.crypto import NULL_DIGEST
from zz.naming import zfs_dataset
from zz.snapshots import StorageError
from zz.snapshots.copies import CopyFinder, Place
from zz.snapshots.dirstore import DirStore
from zz.snapshots.fileserve import COPY, LATER, NO_CHECKPOINT, OK, FileRead, SnapshotFiles
from zz.snapshots.manifest import Manifest, ManifestError, newest_manifest_path
from zz.snapshots.store import CheckpointStore
from zz.snapshots.zfs import ZfsStore, run_zfs


class HostSnapshots:
    def __init__(self, config: Config, host: Host, store: str, zfs_pool: str | None = None) -> None:
        self.config = config
        self.host = host
        self.store = store
        self.zfs_pool = zfs_pool
        self._lock = threading.Lock()
        # (service id, index) -> (inode of the state dir, its files): a convicted replica's
        # directory is renamed aside and its successor starts a new one at the same path.
        self._files: dict[tuple[int, int], tuple[int, SnapshotFiles]] = {}
        # forensic state (its directory, or its ZFS dataset) -> its files, by hash only
        self._forensic: dict[Path | str, SnapshotFiles] = {}
        self._zfs_listed: tuple[float, list[str]] = (0.0, [])  # (when, the pool's datasets)
        # copies found by hash and served, candidates that did not hash right (skipped)
        self.copy_counters: Counter[str] = Counter()
        # manifests dir -> (newest manifest file, its mtime, decoded): what a live state
        # (a replica's, a forensic one's) is looked up by; its own lock, as a SnapshotFiles
        # asks for it with its lock held
        self._newest: dict[Path, tuple[Path, int, Manifest]] = {}
        self._newest_lock = threading.Lock()

    def replicas(self, svc: Service) -> list[int]:
        """Indexes of `svc`'s execution replicas placed on this host."""
        return [i for i in range(svc.n_exec) if svc.exec_host(self.config, i) == self.host]

    def read(
        self,
        svc: Service,
        requester: int,
        seq: int,
        path: str,
        offset: int,
        length: int,
        sha256: bytes = NULL_DIGEST,
    ) -> FileRead:
        """The range from the first replica here that has it (never the requester's own);
        with a `sha256`, failing that, a verified copy from a forensic state here."""
        best = FileRead(NO_CHECKPOINT)
        for i in self.replicas(svc):
            if i == requester:
                continue
            files = self._open(svc, i)
            if files is None:
                continue
            r = files.read(seq, path, offset, length, sha256)
            if r.status in (OK, COPY):
                return r
            if best.status != LATER:
                best = r
        if sha256 != NULL_DIGEST:
            for files in self._forensics(svc):
                r = files.read(seq, path, offset, length, sha256)
                if r.status == COPY:
                    return r
        return best

    def _forensics(self, svc: Service) -> list[SnapshotFiles]:
        """The forensic states of `svc`'s slots on this host: directory stores, and on ZFS
        the forensic datasets."""
        out = []
        datasets = self._zfs_datasets()
        for i in self.replicas(svc):
            state = svc.exec_state_dir(self.config, i)
            dirs = sorted(state.parent.glob(f"{state.name}.forensic-*"))
            for d in dirs:
                files = self._forensic_files(d)
                if files is not None:
                    out.append(files)
            # <pool>/s<id>-exec-<i>[-<n>]-forensic-<seq>[-<n>] (actions.set_aside_state;
            # a guest's fresh dataset may carry a -<n>); "--" would be a reader's clone
            forensic = re.compile(
                re.escape(f"{self.zfs_pool}/{zfs_dataset(svc, i)}")
                + r"(?:-\d+)?-forensic-(\d+)((?:-\d+)?)"
            )
            for ds in datasets:
                m = forensic.fullmatch(ds)
                if m is not None:
                    files = self._forensic_zfs(ds, state, m.group(1), m.group(2))
                    if files is not None:
                        out.append(files)
        with self._lock:  # purged since: let go
            for gone in [
                k
                for k in self._forensic
                if (isinstance(k, Path) and not k.is_dir())
                or (isinstance(k, str) and k not in datasets)
            ]:
                self._forensic.pop(gone).release()
        return out

    def _zfs_datasets(self) -> list[str]:
        """The pool's file systems (listed at most every 2 s: a `zfs list` per request would
        cost more than the read)."""
        if self.store != "zfs" or not self.zfs_pool:
            return []
        with self._lock:
            when, names = self._zfs_listed
            if time.monotonic() - when < 2.0:
                return names
        try:
            out = run_zfs(["zfs", "list", "-H", "-o", "name", "-t", "filesystem", "-r",
                           self.zfs_pool])  # fmt: skip
        except StorageError:
            return []
        names = out.split()
        with self._lock:
            self._zfs_listed = (time.monotonic(), names)
        return names

    def _forensic_zfs(self, ds: str, state: Path, seq: str, n: str) -> SnapshotFiles | None:
        """A forensic dataset set aside at `seq` (`n`: "-<k>" when the name was taken),
        with the manifests of the forensic state directory set aside with it: of the same
        suffix, else of the same seq (the two names are made unique apart; a wrong pick
        costs nothing but misses, every copy is hashed)."""
        base = state.with_name(f"{state.name}.forensic-{seq}")
        manifests = base.with_name(base.name + n) / "manifests"
        if not manifests.is_dir():
            manifests = base / "manifests"
        if not manifests.is_dir():
            return None
        with self._lock:
            hit = self._forensic.get(ds)
            if hit is not None:
                return hit
            try:
                store = ZfsStore(
                    self.zfs_pool or "",
                    ds.partition("/")[2],
                    create=False,
                    reader="ctl",
                    unmounted=True,
                )
            except StorageError:
                return None
            files = SnapshotFiles(
                store,
                manifests,
                path_reads=False,
                copies=CopyFinder(counters=self.copy_counters),
            )

            def live() -> Place | None:
                # The live state at the conviction: its @forensic snapshot, through a clone
                # that `files` keeps open like a checkpoint's (its lock is held here).
                snap = f"forensic-{seq}"
                return self._live(f"{ds}/live", manifests, lambda: files.snapshot_root(snap))

            files.live = live
            self._forensic[ds] = files
            return files

    def release_forensics(self) -> None:
        """Close the clones held of forensic datasets (before they are purged: ZFS refuses
        to destroy a dataset whose snapshot has a clone). They are opened again on need."""
        with self._lock:
            for files in self._forensic.values():
                files.release()
            self._forensic.clear()

    def _forensic_files(self, d: Path) -> SnapshotFiles | None:
        with self._lock:
            hit = self._forensic.get(d)
            if hit is not None:
                return hit
            if not (d / "store" / "snapshots").is_dir() or not (d / "manifests").is_dir():
                return None
            try:
                store = DirStore(d / "store")
            except StorageError:
                return None
            files = SnapshotFiles(
                store,
                d / "manifests",
                path_reads=False,
                live=lambda: self._live(f"{d.name}/live", d / "manifests", lambda: store.path),
                copies=CopyFinder(counters=self.copy_counters),
            )
            self._forensic[d] = files
            return files

    def _open(self, svc: Service, i: int) -> SnapshotFiles | None:
        state = svc.exec_state_dir(self.config, i)
        try:
            ino = os.stat(state).st_ino
        except OSError:
            return None
        with self._lock:
            hit = self._files.get((svc.id, i))
            if hit is not None and hit[0] == ino:
                return hit[1]
            store = self._store(svc, i, Path(state))
            if store is None:
                return None
            if hit is not None:  # a successor's state dir: let go of the predecessor's
                hit[1].release()
            manifests = Path(state) / "manifests"
            files = SnapshotFiles(
                store,
                manifests,
                live=lambda: self._live(f"x{i}/live", manifests, lambda: store.path),
                copies=CopyFinder(counters=self.copy_counters),
            )
            self._files[(svc.id, i)] = (ino, files)
            return files

    def _store(self, svc: Service, i: int, state: Path) -> CheckpointStore | None:
        """A guest's (or a process's) directory store, else the runtime's ZFS dataset."""
        try:
            if (state / "store").is_dir():
                return DirStore(state / "store")
            if self.store == "zfs" and self.zfs_pool:
                name = replica_dataset(self.zfs_pool, state)
                ds = name.partition("/")[2] if name else zfs_dataset(svc, i)
                return ZfsStore(self.zfs_pool, ds, create=False, reader="ctl")
        except StorageError:
            return None
        return None

    def _live(self, name: str, manifests: Path, root: Callable[[], Path]) -> Place | None:
        """A live state (a replica's, asleep or not; a forensic one's) as a place to find a
        copy by hash, described by its newest checkpoint manifest: files changed since are
        skipped when their hash does not match (snapshots/copies.py)."""
        path = newest_manifest_path(manifests)
        if path is None:
            return None
        try:
            mtime = path.stat().st_mtime_ns
            with self._newest_lock:
                hit = self._newest.get(manifests)
            if hit is not None and hit[:2] == (path, mtime):
                m = hit[2]
            else:
                m = Manifest.decode(path.read_bytes())
                with self._newest_lock:
                    self._newest[manifests] = (path, mtime, m)
        except (OSError, ManifestError):
            return None
        return Place(name, m, root)

    def forget(self, svc: Service, i: int) -> None:
        """Close the clones held of replica i's snapshots (its state is being set aside)."""
        with self._lock:
            hit = self._files.pop((svc.id, i), None)
            if hit is not None:
                hit[1].release()

    def release(self) -> None:
        """Close every clone held (controld stopping)."""
        with self._lock:
            for _, files in self._files.values():
                files.release()
            self._files.clear()
            for files in self._forensic.values():
                files.release()
            self._forensic.clear()
