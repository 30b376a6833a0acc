# tests/test_snapshots_fileserve.py - serving checkpoint files to recovering peers
# (snapshots/fileserve.py), from a directory store and from real ZFS snapshots via clones.
from __future__ import annotations

from pathlib import Path

import pytest
from zz.snapshots import open_store
from zz.snapshots.fetch import SourceError, StateFetcher
from zz.snapshots.fileserve import LATER, NO_CHECKPOINT, NO_FILE, OK, REFUSED, SnapshotFiles
from zz.snapshots.manifest import Manifest, scan
from zz.snapshots.store import CheckpointStore, checkpoint_name

from tests import zfs_pool

zfs_daemon, pool = zfs_pool.zfs_daemon, zfs_pool.pool  # the fixtures, found here by pytest


def checkpoint(store: CheckpointStore, manifests: Path, seq: int) -> Manifest:
    m = scan(store.path)
    manifests.mkdir(exist_ok=True)
    (manifests / f"{checkpoint_name(seq)}.manifest").write_bytes(m.encode())
    store.snapshot(checkpoint_name(seq))
    return m


class LocalSource:
    """A StateFetcher source straight on SnapshotFiles (the wire in between is tested
    in tests/test_recovery_fetch.py)."""

    name = "local"

    def __init__(self, files: SnapshotFiles) -> None:
        self.files = files

    def fetch(self, seq: int, path: str, size: int) -> bytes:
        out = b""
        while True:
            r = self.files.read(seq, path, len(out), 3)  # tiny chunks: exercise offsets
            if r.status != OK:
                raise SourceError(f"status {r.status}")
            out += r.data
            if len(out) >= r.size or not r.data:
                return out


def exercise(store: CheckpointStore, tmp_path: Path) -> None:
    manifests = tmp_path / "manifests"
    (store.path / "d").mkdir()
    (store.path / "d" / "f").write_bytes(b"version one")
    m10 = checkpoint(store, manifests, 10)
    (store.path / "d" / "f").write_bytes(b"version two, longer")
    (store.path / "g").write_bytes(b"g")
    checkpoint(store, manifests, 20)
    files = SnapshotFiles(store, manifests, servable=lambda s: s != 30)
    try:
        assert files.read(10, "d/f", 0, 100).data == b"version one"
        assert files.read(20, "d/f", 8, 3).data == b"two"
        assert files.read(20, "d/f", 0, 1).size == len(b"version two, longer")
        assert files.read(10, "", 0, 1 << 20).data == m10.encode()
        assert files.read(10, "g", 0, 10).status == NO_FILE  # not in that checkpoint
        assert files.read(10, "../etc/passwd", 0, 10).status == REFUSED
        assert files.read(10, "d//f", 0, 10).status == REFUSED
        assert files.read(99, "d/f", 0, 10).status == NO_CHECKPOINT
        assert files.read(30, "d/f", 0, 10).status == REFUSED
        # A fetcher recovers checkpoint 10 into an empty directory through it.
        local = tmp_path / "recovering"
        local.mkdir()
        f = StateFetcher(local, m10, 10, [LocalSource(files)])
        f.prepare()
        f.fetch_all()
        assert scan(local).files == m10.files
        # Release before destroying: ZFS refuses to destroy a snapshot with a clone.
        files.release(checkpoint_name(10))
        store.destroy_snapshot(checkpoint_name(10))
        (manifests / f"{checkpoint_name(10)}.manifest").unlink()
        # A file of a collected checkpoint comes from the next one (the requester checks
        # it against its own manifest); the manifest itself only from the exact one.
        later = files.read(10, "d/f", 0, 100)
        assert (later.status, later.data) == (LATER, b"version two, longer")
        assert files.read(10, "", 0, 100).status == NO_CHECKPOINT
        assert files.read(20, "d/f", 0, 100).status == OK
        assert files.read(25, "d/f", 0, 100).status == NO_CHECKPOINT
    finally:
        files.release()


def test_dir_store(tmp_path: Path) -> None:
    exercise(open_store("dir", root=tmp_path / "store"), tmp_path)


def test_zfs_store_through_clones(pool: str, tmp_path: Path) -> None:
    store = open_store("zfs", pool=pool, dataset="fs", mountpoint=tmp_path / "live")
    exercise(store, tmp_path)


@pytest.mark.parametrize("bad", ["", "x" * 5000])
def test_bad_paths_never_raise(tmp_path: Path, bad: str) -> None:
    store = open_store("dir", root=tmp_path / "store")
    (store.path / "a").write_bytes(b"a")
    checkpoint(store, tmp_path / "m", 1)
    files = SnapshotFiles(store, tmp_path / "m")
    r = files.read(1, bad, 0, 10)
    assert r.status in (OK, REFUSED)  # "" is the manifest itself


def test_remembered_manifest_is_served_without_reading_its_file(tmp_path: Path) -> None:
    """The runtime hands over the manifest it just built (SnapshotFiles.remember): the
    first request of a recovering peer needs no decode of the saved file."""
    store = open_store("dir", root=tmp_path / "store")
    manifests = tmp_path / "manifests"
    (store.path / "a").write_bytes(b"a")
    m = checkpoint(store, manifests, 4)
    files = SnapshotFiles(store, manifests)
    files.remember(4, m)
    (manifests / f"{checkpoint_name(4)}.manifest").write_bytes(b"not read")
    assert files.read(4, "", 0, 1 << 20).data == m.encode()
    assert files.read(4, "a", 0, 10).data == b"a"
    files.release(checkpoint_name(4))  # forgets the remembered copy too
    assert files.read(4, "", 0, 1 << 20).status == NO_CHECKPOINT
