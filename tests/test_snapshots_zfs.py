# tests/test_snapshots_zfs.py - the ZFS CheckpointStore against real zfs-fuse (or kernel ZFS).
# Each test gets its own pool on a sparse file in tmp_path; fixtures destroy it even on failure.
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tests import zfs_pool
from tests.zfs_pool import POOL_SIZE
from zz.snapshots import StorageError, checkpoint_name, open_store
from zz.snapshots.manifest import ManifestBuilder, scan
from zz.snapshots.zfs import (
    ZfsStore,
    create_file_pool,
    dataset_exists,
    destroy_pool,
    pool_exists,
    pool_vdevs,
    run_zfs,
)

zfs_daemon, pool = zfs_pool.zfs_daemon, zfs_pool.pool  # the fixtures, found here by pytest


@pytest.fixture
def store(pool: str, tmp_path: Path) -> ZfsStore:
    s = open_store("zfs", pool=pool, dataset="exec-0", mountpoint=tmp_path / "mnt")
    assert isinstance(s, ZfsStore)
    return s  # the pool fixture destroys it with the pool


def _clones(pool: str) -> list[str]:
    out = run_zfs(["zfs", "list", "-H", "-o", "name,origin", "-t", "filesystem", "-r", pool])
    return [ln.split("\t")[0] for ln in out.splitlines() if ln.split("\t")[1] != "-"]


def test_checkpoints_read_back_through_clones(store: ZfsStore, pool: str) -> None:
    assert store.path.is_dir() and store.path == store.path.absolute()
    (store.path / "a").write_text("v1")
    (store.path / "d").mkdir()
    (store.path / "d" / "big").write_bytes(os.urandom(1 << 20))
    b = ManifestBuilder(store.path)
    b.write_memory(b"mem-16")
    m16 = b.build()
    store.snapshot(checkpoint_name(16))

    with open(store.path / "a", "r+") as f:  # in place, same inode
        f.write("v2")
    (store.path / "d" / "big").unlink()
    (store.path / "c").write_text("new")
    b.mark_all_dirty(["a", "d/big", "c"])
    b.write_memory(b"mem-32")
    m32 = b.build()
    store.snapshot(checkpoint_name(32))
    assert store.list_snapshots() == ["ckpt-16", "ckpt-32"]

    with store.open_snapshot("ckpt-16") as p:
        assert p != store.path
        assert (p / "a").read_text() == "v1"
        assert (p / "d" / "big").stat().st_size == 1 << 20
        assert not (p / "c").exists()
        assert scan(p).files == m16.files  # what a peer would serve matches the checkpoint
        with pytest.raises(OSError):
            (p / "x").write_text("clones for reading are read-only")
        assert len(_clones(pool)) == 1
    assert not p.exists()
    assert _clones(pool) == []
    with store.open_snapshot("ckpt-32") as p:
        assert (p / "a").read_text() == "v2" and (p / "c").read_text() == "new"
        assert scan(p, m16) == m32
    assert (store.path / "a").read_text() == "v2"

    store.destroy_snapshot("ckpt-16")
    assert store.list_snapshots() == ["ckpt-32"]
    store.destroy_snapshot("ckpt-32")
    assert store.list_snapshots() == []


def test_open_snapshot_cleans_up_when_the_body_raises(store: ZfsStore, pool: str) -> None:
    (store.path / "f").write_text("x")
    store.snapshot("s")
    with pytest.raises(RuntimeError, match="boom"):
        with store.open_snapshot("s") as p:
            assert (p / "f").read_text() == "x"
            raise RuntimeError("boom")
    assert _clones(pool) == [] and not p.exists()
    store.destroy_snapshot("s")  # no dependent clone left behind


def test_two_readers_of_one_snapshot(store: ZfsStore, pool: str) -> None:
    (store.path / "f").write_text("x")
    store.snapshot("s")
    with store.open_snapshot("s") as p1, store.open_snapshot("s") as p2:
        assert p1 != p2 and (p1 / "f").read_text() == (p2 / "f").read_text() == "x"
        assert len(_clones(pool)) == 2
    assert _clones(pool) == []


def test_list_order_is_creation_order_within_a_second(store: ZfsStore) -> None:
    for n in ["ckpt-9", "ckpt-10", "b", "a"]:
        store.snapshot(n)
    assert store.list_snapshots() == ["ckpt-9", "ckpt-10", "b", "a"]


def test_errors_carry_command_and_stderr(store: ZfsStore) -> None:
    store.snapshot("ckpt-1")
    with pytest.raises(StorageError) as e:
        store.snapshot("ckpt-1")
    assert e.value.command[:2] == ["zfs", "snapshot"] and "exists" in e.value.stderr
    with pytest.raises(StorageError) as e:
        store.destroy_snapshot("ckpt-2")
    assert "ckpt-2" in e.value.stderr
    with pytest.raises(StorageError):
        with store.open_snapshot("nope"):
            pass
    for bad in ["a/b", "a@b", "", "-R"]:
        with pytest.raises(ValueError):
            store.snapshot(bad)
    assert store.list_snapshots() == ["ckpt-1"]


def test_reopen_existing_dataset_and_destroy(pool: str, tmp_path: Path) -> None:
    mnt = tmp_path / "r1"
    s = ZfsStore(pool, "svc/exec-1", mnt)
    (s.path / "f").write_text("kept")
    s.snapshot("one")
    again = ZfsStore(pool, "svc/exec-1")  # existing dataset: its mountpoint is read back
    assert again.path == mnt and (again.path / "f").read_text() == "kept"
    assert again.list_snapshots() == ["one"]
    with pytest.raises(StorageError, match="mountpoint"):
        ZfsStore(pool, "svc/exec-1", tmp_path / "elsewhere")
    again.destroy()
    assert not dataset_exists(f"{pool}/svc/exec-1")
    with pytest.raises(StorageError, match="no mountpoint"):
        ZfsStore(pool, "nomount")  # the pool has mountpoint=none, so one must be given


def test_pool_helpers_reject_bad_input(zfs_daemon: None, tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        create_file_pool("1bad", tmp_path / "v", POOL_SIZE)
    with pytest.raises(ValueError):
        ZfsStore("ok", "../x")
    existing = tmp_path / "exists.img"
    existing.write_text("not yours")
    with pytest.raises(StorageError, match="cannot create vdev"):
        create_file_pool(f"zztest{uuid.uuid4().hex[:6]}", existing, POOL_SIZE)
    assert existing.read_text() == "not yours"
    # zfs-fuse refuses a tiny vdev; the helper removes the file it created.
    name = f"zztest{uuid.uuid4().hex[:6]}"
    with pytest.raises(StorageError) as e:
        create_file_pool(name, tmp_path / "tiny.img", 1 << 20)
    assert e.value.command[:2] == ["zpool", "create"]
    assert not (tmp_path / "tiny.img").exists() and not pool_exists(name)


@pytest.mark.parametrize("kind", ["zfs", "dir"])
def test_restore_live_drops_what_came_after(kind: str, pool: str, tmp_path: Path) -> None:
    if kind == "zfs":
        s = open_store("zfs", pool=pool, dataset="rl", mountpoint=tmp_path / "live")
    else:
        s = open_store("dir", root=tmp_path / "dirstore")
    (s.path / "d").mkdir()
    (s.path / "d" / "a").write_bytes(b"one")
    s.snapshot(checkpoint_name(4))
    before = scan(s.path).files
    (s.path / "d" / "a").write_bytes(b"two")
    (s.path / "new").write_bytes(b"after the checkpoint")
    s.restore_live(checkpoint_name(4))
    assert scan(s.path).files == before
    assert not (s.path / "new").exists()


def test_stale_read_clones_are_dropped_on_open(pool: str, tmp_path: Path) -> None:
    s = open_store("zfs", pool=pool, dataset="sc", mountpoint=tmp_path / "live")
    (s.path / "a").write_bytes(b"a")
    s.snapshot(checkpoint_name(1))
    # What a runtime killed while serving a peer leaves behind.
    stale = f"{pool}/sc--read-ckpt-1-dead"
    run_zfs(["zfs", "clone", "-o", "mountpoint=none", f"{pool}/sc@ckpt-1", stale])
    s2 = open_store("zfs", pool=pool, dataset="sc", mountpoint=tmp_path / "live")
    assert stale not in run_zfs(["zfs", "list", "-H", "-o", "name"]).split()
    s2.destroy_snapshot(checkpoint_name(1))  # possible again: no clone depends on it


def test_pools_of_killed_test_runs_are_swept(zfs_daemon: None, tmp_path: Path) -> None:
    """A pool named for a test process that is gone is destroyed with its vdev; one of a
    live process (ours) and pool_vdevs report the vdev file."""
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = f"zztest{dead.pid}x{uuid.uuid4().hex[:6]}"
    mine = f"zztest{os.getpid()}x{uuid.uuid4().hex[:6]}"
    gone_vdev, mine_vdev = tmp_path / "gone.img", tmp_path / "mine.img"
    create_file_pool(gone, gone_vdev, POOL_SIZE)
    create_file_pool(mine, mine_vdev, POOL_SIZE)
    try:
        assert pool_vdevs(gone) == [str(gone_vdev)]
        swept = zfs_pool.sweep_dead_runs_pools()
        assert gone in swept and mine not in swept
        assert not pool_exists(gone) and not gone_vdev.exists()
        assert pool_exists(mine)
    finally:
        for name, vdev in ((gone, gone_vdev), (mine, mine_vdev)):
            if pool_exists(name):
                destroy_pool(name, vdev)


def test_datasets_mounted_at_the_same_time_all_answer(pool: str, tmp_path: Path) -> None:
    """Datasets created (and so mounted) by several threads at once all answer afterwards.
    zfs-fuse hands each new mount to its FUSE listener threads through one pipe, as a record
    and then the mountpoint in two write()s: two mounts at once interleave there, the
    listener reading it takes mountpoint bytes for a length and waits in read() for good,
    holding the lock every other listener waits on, and no dataset is served again (the
    processes touching one sleep in fuse_get_req). run_zfs runs the commands that change
    anything one at a time on the machine (docs/design.md §9); without that this test wedged
    zfs-fuse in the second of two runs, as the namespace rack test did (issue 20)."""
    import subprocess
    import threading
    from concurrent.futures import ThreadPoolExecutor

    n, rounds = 6, 12
    for r in range(rounds):
        names = [f"r{r}d{i}" for i in range(n)]
        start = threading.Barrier(n)

        def create(name: str, start: threading.Barrier) -> None:
            start.wait()
            run_zfs(["zfs", "create", "-o", f"mountpoint={tmp_path / name}", f"{pool}/{name}"])

        with ThreadPoolExecutor(n) as ex:
            list(ex.map(create, names, [start] * n))
        for name in names:
            # stat in a child: whoever touches a mount zfs-fuse no longer serves sleeps
            # there, the child is killed at the limit and the test fails instead.
            try:
                p = subprocess.run(["stat", "-c", "%i", str(tmp_path / name)],
                                   capture_output=True, text=True, timeout=60)  # fmt: skip
            except subprocess.TimeoutExpired:
                pytest.fail(f"round {r}: {tmp_path / name} does not answer (zfs-fuse wedged)")
            assert p.returncode == 0, p.stderr
        for name in names:
            run_zfs(["zfs", "destroy", f"{pool}/{name}"], retry_busy=True)


def test_a_mount_namespace_made_meanwhile_does_not_keep_a_dataset(
    pool: str, tmp_path: Path
) -> None:
    """A mount namespace made while a dataset is mounted (libvirt makes one per QEMU, a
    copy of every mount at that moment, turned into a slave of the machine's) does not keep
    the dataset from being destroyed. Where / is a private mount (no systemd: the
    development machines, CI) the copy is private too: it keeps the FUSE mount alive after
    zfs unmounts it in the machine's namespace, zfs-fuse keeps the dataset open, and every
    destroy says "dataset is busy" until that QEMU exits (the namespace rack test's `rack
    down` failed so while another job's guests ran). scripts/setup-zfs.sh makes / shared, as
    systemd does at boot; the copy is then a slave and the unmount reaches it."""
    import subprocess

    store = ZfsStore(pool, "held", tmp_path / "live")
    (store.path / "f").write_text("x")
    other = subprocess.Popen(["unshare", "--mount", "--propagation", "slave", "sleep", "600"])
    try:
        # unshare execs sleep once the namespace is made and set up.
        while Path(f"/proc/{other.pid}/comm").read_text().strip() != "sleep":
            assert other.poll() is None, "unshare failed"
        assert str(store.path) in Path(f"/proc/{other.pid}/mountinfo").read_text()
        store.destroy()
        assert not dataset_exists(f"{pool}/held")
    finally:
        other.kill()
        other.wait()
