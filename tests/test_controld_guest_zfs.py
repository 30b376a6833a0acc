# tests/test_controld_guest_zfs.py - a guest's checkpoint store on the host's ZFS: the guest
# half (snapshots/hostzfs.py, as the runtime in a VM uses it) against controld's half
# (controld/guestsnap.py, actions.make_guest_dataset), on a real zfs-fuse pool. The "guest"
# is this test writing the share; tests/test_vm_drills.py runs it inside real guests.
from __future__ import annotations

import asyncio
import json
import os
import pwd
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_controld_daemon import SVC, make_rack

from tests import zfs_pool
from zz import keys, wire
from zz.config import Service
from zz.controld.actions import (
    HostContext,
    make_guest_dataset,
    replica_dataset,
    set_aside_state,
)
from zz.controld.guestsnap import GuestDatasets
from zz.naming import zfs_dataset
from zz.snapshots import StorageError
from zz.snapshots.hostzfs import ANSWER, REQUEST, HostZfsStore, request_bytes, write_json_atomic
from zz.snapshots.zfs import run_zfs

zfs_daemon, pool = zfs_pool.zfs_daemon, zfs_pool.pool  # the fixtures, found here by pytest


@dataclass
class Guest:
    svc: Service
    share: Path
    datasets: GuestDatasets
    counters: Counter[str]
    dataset: str
    key_dir: Path

    def store(self, signer: int = 0, timeout: float = 10.0) -> HostZfsStore:
        """Replica 0's store, its requests signed with replica `signer`'s key."""
        path = keys.secret_path(self.key_dir, SVC, wire.exec_principal(signer))
        sk = keys.load_secret(path).sign
        assert sk is not None
        return HostZfsStore(self.share, service=SVC, index=0, sign_key=sk, timeout=timeout)


@pytest.fixture
async def guest(tmp_path: Path, pool: str) -> AsyncIterator[Guest]:
    rack = make_rack(tmp_path)
    config = rack.config
    svc = config.service("web")
    host = svc.exec_host(config, 0)
    hv = SimpleNamespace(kind="libvirt", state_accessmode="squash", is_test=False)
    ctx = HostContext(config, host, hv, tmp_path / "ctl", store="zfs", zfs_pool=pool)  # type: ignore[arg-type]
    share = svc.exec_state_dir(config, 0)
    share.mkdir(parents=True)
    make_guest_dataset(ctx, svc, 0, share)
    publics = keys.load_public(keys.public_path(config.rack.key_dir, SVC))
    counters: Counter[str] = Counter()
    datasets = GuestDatasets(ctx, lambda sid: publics if sid == SVC else {}, counters)
    assert datasets.enabled
    task = asyncio.create_task(datasets.run())
    try:
        yield Guest(svc, share, datasets, counters, f"{pool}/{zfs_dataset(svc, 0)}",
                    config.rack.key_dir)  # fmt: skip
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def _zfs_snapshots(dataset: str) -> list[str]:
    out = run_zfs(["zfs", "list", "-H", "-t", "snapshot", "-o", "name", "-s", "createtxg"])
    return [line.split("@")[1] for line in out.splitlines() if line.startswith(dataset + "@")]


async def test_guest_snapshots_are_taken_by_controld(guest: Guest) -> None:
    """The dataset is mounted in the share and QEMU's user owns it; snapshot, list,
    rollback and destroy go through controld and are real ZFS snapshots."""
    live = guest.share / "live"
    assert run_zfs(["zfs", "get", "-H", "-o", "value", "mountpoint", guest.dataset]).strip() == str(
        live
    )
    assert os.stat(live).st_uid == pwd.getpwnam("libvirt-qemu").pw_uid
    store = guest.store()
    assert await asyncio.to_thread(store.list_snapshots) == []
    (live / "a").write_text("one")
    await asyncio.to_thread(store.snapshot, "ckpt-4")
    (live / "a").write_text("two")
    (live / "b").write_text("new")
    await asyncio.to_thread(store.snapshot, "ckpt-8")
    assert store.list_snapshots() == ["ckpt-4", "ckpt-8"] == _zfs_snapshots(guest.dataset)
    assert not (guest.share / REQUEST).exists()  # acted on once, then removed
    # A restart goes back to its last checkpoint: rollback (-r: later snapshots go).
    await asyncio.to_thread(store.restore_live, "ckpt-4")
    assert (live / "a").read_text() == "one" and not (live / "b").exists()
    assert store.list_snapshots() == ["ckpt-4"] == _zfs_snapshots(guest.dataset)
    await asyncio.to_thread(store.destroy_snapshot, "ckpt-4")
    assert store.list_snapshots() == [] == _zfs_snapshots(guest.dataset)
    with pytest.raises(StorageError, match="read on the host"):
        store.open_snapshot("ckpt-4")
    c = guest.counters
    assert (c["guest_list"], c["guest_snapshot"], c["guest_rollback"], c["guest_destroy"]) == (
        1, 2, 1, 1,
    )  # fmt: skip


async def test_forged_replayed_and_malformed_requests_do_nothing(guest: Guest) -> None:
    """Only the replica's own signature moves its dataset; an old request planted again
    is refused; garbage is counted and never stops the poller."""
    forged = guest.store(signer=1, timeout=5.0)  # another replica's key
    with pytest.raises(StorageError, match="bad signature"):
        await asyncio.to_thread(forged.snapshot, "ckpt-4")
    assert _zfs_snapshots(guest.dataset) == []
    store = guest.store()
    req = guest.share / REQUEST
    await asyncio.to_thread(store.snapshot, "ckpt-4")
    n = json.loads((guest.share / ANSWER).read_text())["n"]
    # Replay: a request signed by the replica, with an n already acted upon, planted again.
    path = keys.secret_path(guest.key_dir, SVC, wire.exec_principal(0))
    sk = keys.load_secret(path).sign
    assert sk is not None
    sig = sk.sign(request_bytes(SVC, 0, n, "destroy", "ckpt-4")).hex()
    write_json_atomic(req, {"n": n, "op": "destroy", "name": "ckpt-4", "sig": sig})
    await _until(lambda: guest.counters["guest_snapshot_replayed"] == 1)
    assert _zfs_snapshots(guest.dataset) == ["ckpt-4"]
    for k, junk in enumerate(("not json", json.dumps({"n": "x"}), json.dumps({"n": 5}))):
        req.write_text(junk)
        await _until(lambda k=k: guest.counters["guest_snapshot_malformed"] == k + 1)
        assert not req.exists()
    assert guest.counters["guest_snapshot_malformed"] == 3
    assert _zfs_snapshots(guest.dataset) == ["ckpt-4"]
    await asyncio.to_thread(store.snapshot, "ckpt-8")  # still served
    assert _zfs_snapshots(guest.dataset) == ["ckpt-4", "ckpt-8"]


async def _until(pred: Callable[[], bool]) -> None:
    for _ in range(500):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("controld did not act on the request in 5 s")


@pytest.mark.parametrize("held", [False, True], ids=["renamed", "held-by-zfs-fuse"])
async def test_convicted_guests_dataset_is_set_aside(
    guest: Guest, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Conviction keeps the guest's dataset for forensics: snapshot, unmount, rename. On a
    rack of guests zfs-fuse kept holding a dataset QEMU had served over 9p (rename,
    destroy and mount all "busy", for good): then the evidence is copied out (zfs send |
    recv) and the fresh guest gets a dataset of another name (held: that refusal, faked
    on top of the real pool). Either way the successor starts empty and is served."""
    import zz.snapshots.zfs as zfs_mod

    store = guest.store()
    (guest.share / "live" / "evidence").write_text("x")
    await asyncio.to_thread(store.snapshot, "ckpt-4")
    if held:
        real = zfs_mod.run_zfs

        def busy_rename(argv: list[str], **kw: object) -> str:
            if argv[:2] == ["zfs", "rename"]:
                raise StorageError("exit status 1", argv, "cannot rename: dataset is busy")
            return real(argv, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(zfs_mod, "run_zfs", busy_rename)
    ctx = guest.datasets.ctx
    kept = await asyncio.to_thread(set_aside_state, ctx, guest.svc, 0, 7)
    monkeypatch.undo()
    assert kept is not None and f"{guest.dataset}-forensic-7@forensic-7" in kept
    snaps = run_zfs(["zfs", "list", "-H", "-t", "snapshot", "-o", "name"]).split()
    assert f"{guest.dataset}-forensic-7@forensic-7" in snaps
    assert not guest.share.exists()
    guest.datasets.forget(guest.svc, 0)
    guest.share.mkdir()
    live = make_guest_dataset(ctx, guest.svc, 0, guest.share)
    assert list(live.iterdir()) == []
    fresh = replica_dataset(ctx.zfs_pool, guest.share)  # type: ignore[arg-type]
    assert fresh == (f"{guest.dataset}-1" if held else guest.dataset)
    await asyncio.to_thread(guest.store().snapshot, "ckpt-8")
    snaps = run_zfs(["zfs", "list", "-H", "-t", "snapshot", "-o", "name"]).split()
    assert f"{fresh}@ckpt-8" in snaps
