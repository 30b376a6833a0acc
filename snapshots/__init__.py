# snapshots - installed as zz.snapshots: checkpoint storage (ZFS or plain directory) and
# per-file SHA-256 manifests. open_store() is the one place a storage backend is chosen.
"""ZZ checkpoint snapshots: storage backends and per-file hash manifests."""

from __future__ import annotations

from pathlib import Path

from zz.snapshots.store import CheckpointStore, StorageError, check_snapshot_name, checkpoint_name

__all__ = [
    "CheckpointStore",
    "StorageError",
    "check_snapshot_name",
    "checkpoint_name",
    "open_store",
]


def open_store(
    kind: str,
    *,
    root: Path | str | None = None,
    pool: str | None = None,
    dataset: str | None = None,
    mountpoint: Path | str | None = None,
    writer: bool = False,
) -> CheckpointStore:
    """Open (creating if needed) a replica's state store.

    ``kind="dir"`` needs ``root``; ``kind="zfs"`` needs ``pool`` and ``dataset`` and takes
    ``mountpoint`` for a new dataset. ``writer``: the caller is the store's one writer
    (DirStore keeps its index in memory).
    """
    if kind == "dir":
        if root is None:
            raise ValueError("open_store('dir') needs root")
        from zz.snapshots.dirstore import DirStore

        return DirStore(root, writer=writer)
    if kind == "zfs":
        if pool is None or dataset is None:
            raise ValueError("open_store('zfs') needs pool and dataset")
        from zz.snapshots.zfs import ZfsStore

        return ZfsStore(pool, dataset, mountpoint)
    raise ValueError(f"unknown store kind {kind!r}: use 'dir' or 'zfs'")
