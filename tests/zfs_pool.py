# tests/zfs_pool.py - the ZFS fixtures shared by tests/test_snapshots_zfs.py and
# tests/test_execution_zfs.py: a zfs-fuse (or kernel ZFS) daemon per module, and a pool of
# its own per test on a sparse file in tmp_path, destroyed even on failure.
# A test module binds them where pytest looks for fixtures:
#     zfs_daemon, pool = zfs_pool.zfs_daemon, zfs_pool.pool
# (an assignment: `from tests.zfs_pool import pool` would be an unused import that every
# test argument named `pool` redefines, ruff F811).
from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from zz.snapshots.zfs import (
    ZfsMissingError,
    create_file_pool,
    destroy_pool,
    ensure_zfs_daemon,
    pool_exists,
    pool_vdevs,
    run_zfs,
    stop_zfs_daemon,
)

POOL_SIZE = 128 << 20  # zfs-fuse refuses vdevs under 64 MiB


@pytest.fixture(scope="module")
def zfs_daemon() -> Iterator[None]:
    """zfs-fuse running for this module; stopped afterwards only if we started it."""
    try:
        started = ensure_zfs_daemon()
    except ZfsMissingError as e:
        pytest.fail(f"ZFS is required for these tests (CI installs it): {e}")
    sweep_dead_runs_pools()
    yield
    # Stop only a daemon we started, and only if nobody else put a pool on it meanwhile.
    if started is not None and not run_zfs(["zpool", "list", "-H", "-o", "name"]).strip():
        stop_zfs_daemon(started)


_TEST_POOL = re.compile(r"zztest(\d+)x[0-9a-f]{6}")


def sweep_dead_runs_pools() -> list[str]:
    """Destroy the pools of test runs that were killed before their teardown (the pid in
    the name is gone): zfs-fuse imports them again on every start."""
    swept = []
    for name in run_zfs(["zpool", "list", "-H", "-o", "name"]).split():
        m = _TEST_POOL.fullmatch(name)
        if m is None or Path(f"/proc/{m.group(1)}").exists():
            continue
        vdevs = pool_vdevs(name)
        destroy_pool(name, vdevs[0] if len(vdevs) == 1 else None)
        swept.append(name)
    return swept


@pytest.fixture
def pool(zfs_daemon: None, tmp_path: Path) -> Iterator[str]:
    """A fresh pool (its name) on tmp_path/vdev.img; gone, file included, afterwards.
    zfs-fuse is started again if it died since the module began (it did once in CI, under
    two concurrent dataset creates): one crash then costs one test, not the module."""
    ensure_zfs_daemon()
    name = f"zztest{os.getpid()}x{uuid.uuid4().hex[:6]}"
    vdev = tmp_path / "vdev.img"
    create_file_pool(name, vdev, POOL_SIZE)
    try:
        yield name
    finally:
        destroy_pool(name, vdev)
    assert not pool_exists(name) and not vdev.exists(), f"{name} or {vdev} left behind"
