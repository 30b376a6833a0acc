# controld/snapshots.py - controld serves the checkpoint snapshots of the execution replicas on
# its host to recovering replicas of the same service (ZZ §4.5): the host still has a
# replica's snapshots when the replica itself is paused, crashed or busy.
"""Checkpoint files of this host's execution replicas, for FILE-FETCH (docs/controld.md).

The daemon authenticates the request (a signature of an execution replica of the service)
and frames the answer; this module finds the bytes. Each replica's directory store
(``run/s<id>/exec-<i>/store``, on the host for a process, on the guest's 9p share for a VM)
is read through snapshots/fileserve.py, which serves only what a checkpoint manifest lists;
the requester verifies every file against the certified manifest, so a stale or corrupted
snapshot costs it one more source, never a wrong state.

ZFS stores are not served from here: a clone controld made of a snapshot would make the
runtime's own `zfs destroy` of that snapshot fail. Their replicas serve themselves.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from zz.snapshots import StorageError
from zz.snapshots.dirstore import DirStore
from zz.snapshots.fileserve import NO_CHECKPOINT, OK, FileRead, SnapshotFiles

from zz.config import Config, Host, Service


class HostSnapshots:
    def __init__(self, config: Config, host: Host, store: str) -> None:
        self.config = config
        self.host = host
        self.store = store
        self._lock = threading.Lock()
        # (service id, index) -> (inode of the state dir, its files): a convicted replica's
        # directory is renamed aside and its successor starts a new one at the same path.
        self._files: dict[tuple[int, int], tuple[int, SnapshotFiles]] = {}

    def replicas(self, svc: Service) -> list[int]:
        """Indexes of `svc`'s execution replicas placed on this host."""
        return [i for i in range(svc.n_exec) if svc.exec_host(self.config, i) == self.host]

    def read(
        self, svc: Service, requester: int, seq: int, path: str, offset: int, length: int
    ) -> FileRead:
        """The range from the first replica here that has it (never the requester's own)."""
        best = FileRead(NO_CHECKPOINT)
        if self.store != "dir":
            return best
        for i in self.replicas(svc):
            if i == requester:
                continue
            files = self._open(svc, i)
            if files is None:
                continue
            r = files.read(seq, path, offset, length)
            if r.status == OK:
                return r
            best = r
        return best

    def _open(self, svc: Service, i: int) -> SnapshotFiles | None:
        state = svc.exec_state_dir(self.config, i)
        root = state / "store"
        try:
            ino = os.stat(state).st_ino
            if not root.is_dir():
                return None
        except OSError:
            return None
        with self._lock:
            hit = self._files.get((svc.id, i))
            if hit is not None and hit[0] == ino:
                return hit[1]
            try:
                files = SnapshotFiles(DirStore(root), Path(state) / "manifests")
            except StorageError:
                return None
            self._files[(svc.id, i)] = (ino, files)
            return files
