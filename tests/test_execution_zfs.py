# tests/test_execution_zfs.py - the execution runtime on real ZFS (--store zfs): checkpoints are
# @ckpt-N snapshots of each replica's dataset, collected after stability, equal manifests.
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import zfs_pool
from tests.test_execution_faults import start_rig
from tests.test_execution_runtime import (
    CP,
    KV_GET,
    KV_PUT,
    Rig,
    _kv,
    _kv_ok,
    needs_agreed,
    restart_after_checkpoint,
)
from zz.crypto import sha256
from zz.snapshots.manifest import Manifest, scan
from zz.snapshots.zfs import ZfsStore, run_zfs

zfs_daemon, pool = zfs_pool.zfs_daemon, zfs_pool.pool  # the fixtures, found here by pytest


@pytest.fixture
def zfs_rig(pool: str, tmp_path: Path) -> Iterator[Rig]:
    # Depends on `pool`, so the replicas are stopped before their datasets go away.
    args = ["--store", "zfs", "--zfs-pool", pool]
    yield from start_rig(tmp_path / "rig", [0, 1], {0: args, 1: args}, one_by_one=True)


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
            and execs.status(i)["counters"].get("snapshots_destroyed", 0) >= 1
            for i in (0, 1)
        ),
        "checkpoint 3*CP stable and the older snapshots collected on both replicas",
    )
    st = [execs.status(i) for i in (0, 1)]
    snaps = _snapshots(pool)
    for i, ds in enumerate(datasets):
        # Exactly the stable checkpoint and the one before it are left (a spare woken
        # below the newest recovers from the older), and nothing else (no clone, no stray
        # snapshot) exists.
        assert snaps[ds] == [2 * CP, 3 * CP], snaps
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
    assert manifests == [f"ckpt-{3 * CP}.manifest", f"ckpt-{2 * CP}.manifest"]

    # Stop the replicas (SIGTERM, clean exit), then read the snapshot back through a clone:
    # what a recovering peer would be served matches the signed manifest.
    assert execs.close() == {0: 0, 1: 0}
    for i, ds in enumerate(datasets):
        store = ZfsStore(pool, ds.split("/", 1)[1])
        with store.open_snapshot(f"ckpt-{3 * CP}") as snap:
            assert scan(snap).files == Manifest.decode(m[i]).files
            assert (snap / ".zz" / "replies").is_file()
    assert _snapshots(pool) == {ds: [2 * CP, 3 * CP] for ds in datasets}  # no clones left


@pytest.mark.slow
@needs_agreed
def test_restart_on_zfs_restores_the_snapshot(zfs_rig: Rig, pool: str) -> None:
    rig = zfs_rig
    execs = rig.execs
    restart_after_checkpoint(rig, exact=True)
    # f+1 = 2 matching replies need replica 1: it must have restored ckpt-2CP from its
    # ZFS snapshot (through a clone) and replayed the rest from the agreement log.
    more = [_kv(KV_GET, b"k3"), _kv(KV_PUT, b"after", b"x"), _kv(KV_GET, b"after")]
    assert rig.invoke_all(more, client_index=1) == [_kv_ok(b"v3"), _kv_ok(), _kv_ok(b"x")]
    assert f"restored checkpoint ckpt-{2 * CP}" in execs.log_path(1).read_text()
    ds = f"{pool}/s{rig.cluster.service.id}-exec-1"
    assert 2 * CP in _snapshots(pool)[ds]
