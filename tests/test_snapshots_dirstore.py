# tests/test_snapshots_dirstore.py - the plain-directory CheckpointStore and open_store().
# Same contract as the ZFS backend (tests/test_snapshots_zfs.py), on tmp_path only.
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from zz.snapshots import CheckpointStore, StorageError, checkpoint_name, open_store
from zz.snapshots.dirstore import DirStore
from zz.snapshots.manifest import ManifestBuilder, scan


@pytest.fixture
def store(tmp_path: Path) -> Iterator[DirStore]:
    s = open_store("dir", root=tmp_path / "store")
    assert isinstance(s, DirStore)
    yield s
    s.destroy()


def test_snapshot_keeps_old_content(store: CheckpointStore) -> None:
    (store.path / "a").write_text("v1")
    (store.path / "d").mkdir()
    (store.path / "d" / "b").write_bytes(b"\x00" * 5000)
    store.snapshot(checkpoint_name(16))
    # In-place writes (same inode) must not reach the snapshot: copies, not hard links.
    with open(store.path / "a", "r+") as f:
        f.write("v2")
    (store.path / "d" / "b").unlink()
    (store.path / "c").write_text("new")
    store.snapshot("ckpt-32")
    assert store.list_snapshots() == ["ckpt-16", "ckpt-32"]
    with store.open_snapshot("ckpt-16") as p:
        assert (p / "a").read_text() == "v1"
        assert (p / "d" / "b").read_bytes() == b"\x00" * 5000
        assert not (p / "c").exists()
        assert os.stat(p / "a").st_ino != os.stat(store.path / "a").st_ino
    with store.open_snapshot("ckpt-32") as p:
        assert (p / "a").read_text() == "v2" and (p / "c").read_text() == "new"
        assert not (p / "d" / "b").exists()
    store.destroy_snapshot("ckpt-16")
    assert store.list_snapshots() == ["ckpt-32"]
    with pytest.raises(StorageError):
        with store.open_snapshot("ckpt-16"):
            pass


def test_snapshot_manifest_matches_live_manifest(store: CheckpointStore) -> None:
    for i in range(20):
        (store.path / f"f{i}").write_bytes(os.urandom(i * 10))
    b = ManifestBuilder(store.path)
    m = b.build()
    store.snapshot("ckpt-4")
    (store.path / "f0").write_text("later")
    with store.open_snapshot("ckpt-4") as p:
        assert scan(p).digest() == m.digest()


def test_list_order_is_creation_order(store: DirStore) -> None:
    for n in ["ckpt-9", "ckpt-10", "a", "Z"]:
        store.snapshot(n)
    assert store.list_snapshots() == ["ckpt-9", "ckpt-10", "a", "Z"]
    # Reopening the same root sees the same snapshots in the same order.
    again = DirStore(store.root)
    assert again.list_snapshots() == ["ckpt-9", "ckpt-10", "a", "Z"]


def test_errors(store: CheckpointStore) -> None:
    store.snapshot("ckpt-1")
    with pytest.raises(StorageError, match="already exists"):
        store.snapshot("ckpt-1")
    with pytest.raises(StorageError, match="no snapshot"):
        store.destroy_snapshot("ckpt-2")
    for bad in ["", ".", "..", "a/b", "a@b", "-x", ".tmp-x", "a b"]:
        with pytest.raises(ValueError):
            store.snapshot(bad)
    assert store.list_snapshots() == ["ckpt-1"]
    with pytest.raises(ValueError):
        checkpoint_name(-1)


def test_symlink_copied_as_link_not_followed(store: CheckpointStore, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_text("secret")
    (store.path / "l").symlink_to(outside)
    store.snapshot("s")
    with store.open_snapshot("s") as p:
        assert (p / "l").is_symlink() and os.readlink(p / "l") == str(outside)


def test_destroy_removes_everything(tmp_path: Path) -> None:
    s = open_store("dir", root=tmp_path / "x")
    (s.path / "f").write_text("1")
    s.snapshot("one")
    s.destroy()
    assert not (tmp_path / "x").exists()
    s.destroy()  # idempotent


def test_open_store_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown store kind"):
        open_store("nfs", root=tmp_path)
    with pytest.raises(ValueError, match="needs root"):
        open_store("dir")
    with pytest.raises(ValueError, match="needs pool"):
        open_store("zfs", dataset="x")


def test_snapshot_skips_the_fetchers_scratch_files(
    store: DirStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background fetch renames its scratch files into place while a checkpoint copies
    the live directory. A scratch file that vanished mid-copy failed the snapshot, and the
    runtime (a correct replica) died of it (campaign seed 3401 round 97)."""
    from zz.snapshots import dirstore
    from zz.snapshots.manifest import FETCH_TMP_DIR

    (store.path / "a").write_bytes(b"state")
    scratch = store.path / FETCH_TMP_DIR / "140455564015296-1"
    scratch.parent.mkdir(parents=True)
    scratch.write_bytes(b"half a fetched file")
    copy = dirstore._copy

    def fetch_finishes_meanwhile(src: str, dst: str) -> object:
        scratch.unlink(missing_ok=True)  # renamed into place by the fetcher
        return copy(src, dst)

    monkeypatch.setattr(dirstore, "_copy", fetch_finishes_meanwhile)
    store.snapshot("ckpt-1")
    with store.open_snapshot("ckpt-1") as snap:
        assert (snap / "a").read_bytes() == b"state"
        assert not (snap / FETCH_TMP_DIR).exists()
