# tests/test_execution_zfs.py - the execution runtime on real ZFS (--store zfs): checkpoints are
# @ckpt-N snapshots of each replica's dataset, collected after stability, equal manifests.
from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from zz.snapshots.manifest import Manifest, scan
from zz.snapshots.zfs import (
    ZfsMissingError,
    ZfsStore,
    create_file_pool,
    destroy_pool,
    ensure_zfs_daemon,
    pool_exists,
    run_zfs,
    stop_zfs_daemon,
)

from tests.test_execution_faults import start_rig
from tests.test_execution_runtime import CP, KV_GET, KV_PUT, Rig, _kv, _kv_ok, needs_agreed
from zz.crypto import sha256

POOL_SIZE = 128 << 20  # zfs-fuse refuses vdevs under 64 MiB


@pytest.fixture(scope="module")
def zfs_daemon() -> Iterator[None]:
    try:
        started = ensure_zfs_daemon()
    except ZfsMissingError as e:
        pytest.fail(f"ZFS is required for these tests (CI installs it): {e}")
    yield
    # Stop only a daemon we started, and only if nobody else has a pool on it.
    if started is not None and not run_zfs(["zpool", "list", "-H", "-o", "name"]).strip():
        stop_zfs_daemon(started)


@pytest.fixture
def pool(zfs_daemon: None, tmp_path: Path) -> Iterator[str]:
    name = f"zzexec{os.getpid()}x{uuid.uuid4().hex[:6]}"
    vdev = tmp_path / "vdev.img"
    create_file_pool(name, vdev, POOL_SIZE)
    try:
        yield name
    finally:
        destroy_pool(name, vdev)
    assert not pool_exists(name) and not vdev.exists()


@pytest.fixture
def zfs_rig(pool: str, tmp_path: Path) -> Iterator[Rig]:
    # Depends on `pool`, so the replicas are stopped before their datasets go away.
    args = ["--store", "zfs", "--zfs-pool", pool]
    yield from start_rig(tmp_path / "rig", [0, 1], {0: args, 1: args})


def _snapshots(pool: str) -> dict[str, list[int]]:
    """dataset -> checkpoint seqs of its @ckpt-N snapshots, as zfs lists them."""
    out = run_zfs(["zfs", "list", "-H", "-t", "snapshot", "-o", "name", "-r", pool])
    snaps: dict[str, list[int]] = {}
    for line in out.split():
        ds, _, snap = line.partition("@")
        assert snap.startswith("ckpt-"), line
        snaps.setdefault(ds, []).append(int(snap[5:]))
    return {ds: sorted(s) for ds, s in snaps.items()}


@pytest.mark.slow
@needs_agreed
def test_kv_on_zfs_checkpoints_are_snapshots(zfs_rig: Rig, pool: str) -> None:
    rig = zfs_rig
    cluster, execs = rig.cluster, rig.execs
    datasets = [f"{pool}/s{cluster.service.id}-exec-{i}" for i in (0, 1)]
    for i, ds in enumerate(datasets):
        mp = run_zfs(["zfs", "get", "-H", "-o", "value", "mountpoint", ds]).strip()
        assert Path(mp) == cluster.service.exec_state_dir(cluster.config, i) / "live"

    ops = [_kv(KV_PUT, f"k{k}".encode(), b"v%d" % k) for k in range(3 * CP)]
    ops += [_kv(KV_GET, b"k5")]
    assert rig.invoke_all(ops) == [_kv_ok()] * (3 * CP) + [_kv_ok(b"v5")]
    rig.wait(
        lambda: all(
            execs.status(i).get("stable_checkpoint") == 3 * CP
            and execs.status(i)["counters"].get("snapshots_destroyed", 0) >= 2
            for i in (0, 1)
        ),
        "checkpoint 3*CP stable and the older snapshots collected on both replicas",
    )
    st = [execs.status(i) for i in (0, 1)]
    snaps = _snapshots(pool)
    for i, ds in enumerate(datasets):
        # Exactly the stable checkpoint is left (the runtime keeps nothing older), and
        # nothing else (no clone, no stray snapshot) exists.
        assert snaps[ds] == [3 * CP], snaps
        assert [int(s) for s in st[i]["checkpoints"]] == [3 * CP]
    assert set(snaps) == set(datasets)
    # Same manifest byte for byte; its digest is the C the replicas signed.
    m = [
        (cluster.run_dir / f"exec-{i}" / "manifests" / f"ckpt-{3 * CP}.manifest").read_bytes()
        for i in (0, 1)
    ]
    assert m[0] == m[1]
    assert st[0]["checkpoints"][str(3 * CP)] == sha256(m[0]).hex()
    manifests = sorted(p.name for p in (cluster.run_dir / "exec-0" / "manifests").iterdir())
    assert manifests == [f"ckpt-{3 * CP}.manifest"]

    # Stop the replicas (SIGTERM, clean exit), then read the snapshot back through a clone:
    # what a recovering peer would be served matches the signed manifest.
    assert execs.close() == {0: 0, 1: 0}
    for i, ds in enumerate(datasets):
        store = ZfsStore(pool, ds.split("/", 1)[1])
        with store.open_snapshot(f"ckpt-{3 * CP}") as snap:
            assert scan(snap).files == Manifest.decode(m[i]).files
            assert (snap / ".zz" / "replies").is_file()
    assert _snapshots(pool) == {ds: [3 * CP] for ds in datasets}  # the clones are gone


@pytest.mark.slow
@needs_agreed
def test_restart_on_zfs_restores_the_snapshot(zfs_rig: Rig, pool: str) -> None:
    rig = zfs_rig
    execs = rig.execs
    puts = [_kv(KV_PUT, f"k{k}".encode(), b"v%d" % k) for k in range(2 * CP)]
    assert rig.invoke_all(puts) == [_kv_ok()] * (2 * CP)
    rig.wait(
        lambda: execs.status(1).get("stable_checkpoint") == 2 * CP,
        "checkpoint 2*CP stable on replica 1",
    )
    p = execs.procs[1]
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(timeout=10) == 0
    execs.start(1)
    rig.wait_linked(1)
    # f+1 = 2 matching replies need replica 1: it must have restored ckpt-2CP from its
    # ZFS snapshot (through a clone) and replayed the rest from the agreement log.
    more = [_kv(KV_GET, b"k3"), _kv(KV_PUT, b"after", b"x"), _kv(KV_GET, b"after")]
    assert rig.invoke_all(more, client_index=1) == [_kv_ok(b"v3"), _kv_ok(), _kv_ok(b"x")]
    assert f"restored checkpoint ckpt-{2 * CP}" in execs.log_path(1).read_text()
    ds = f"{pool}/s{rig.cluster.service.id}-exec-1"
    assert 2 * CP in _snapshots(pool)[ds]
