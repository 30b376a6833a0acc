# tests/test_controld_libvirt_vms.py - sleeping replicas with real VMs on qemu:///system: a
# paused one and a hibernated (paged-out) one, each with a zfs-fuse dataset shared in over
# virtio-9p, woken through controld's hypervisor calls until the guest agent answers and its
# runtime starts; every domain, save file and pool is removed, also on failure.
# docs/controld.md "Sleeping replicas", docs/images.md.
from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_images
import zfs_pool
from test_images import _all_domains, _answers, _wait_ok

from zz.controld.hypervisor import (
    GUEST_AGENT_PORT,
    PAUSED,
    RUNNING,
    Hypervisor,
    HypervisorError,
    ReplicaSpec,
    open_backend,
)
from zz.ports import free_port
from zz.snapshots.zfs import run_zfs

zfs_daemon, pool = zfs_pool.zfs_daemon, zfs_pool.pool
image = test_images.image  # the cached guest build (skips without root/apt)
pytestmark = pytest.mark.slow

URI = os.environ.get("ZZ_LIBVIRT_URI", "qemu:///system")
MEMORY_MIB = 512
# What the guest runs once woken: it proves the wake reached the runtime (ZZ_RECOVER_FROM)
# and that the runtime writes to the replica's dataset through the share.
RUNTIME = {
    "command": ["sh", "-c", "echo $ZZ_RECOVER_FROM > /state/ran; exec sleep 600"],
    "start": "wake",
}


class Cleanup:
    """Everything a test makes on the host, removed in teardown even after a failure."""

    def __init__(self, hv: Hypervisor) -> None:
        self.hv = hv
        self.names: list[str] = []
        self.saves: list[Path] = []

    def run(self) -> None:
        for name in self.names:
            try:
                self.hv.destroy(name)
            except HypervisorError:
                pass  # never started, already destroyed, or still saved
        for save in self.saves:
            save.unlink(missing_ok=True)


@pytest.fixture
def hv(image) -> Iterator[Hypervisor]:  # type: ignore[no-untyped-def]
    pytest.importorskip("libvirt", reason="libvirt-python: bash scripts/setup-virt.sh")
    try:
        h = open_backend("libvirt", uri=URI, state_accessmode="passthrough")
    except HypervisorError as e:
        pytest.skip(f"{e}: bash scripts/setup-virt.sh")
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def cleanup(hv: Hypervisor) -> Iterator[Cleanup]:
    c = Cleanup(hv)
    try:
        yield c
    finally:
        c.run()
        left = [n for n in c.names if n in _all_domains()]
        assert not left, f"domains left behind: {left}"
        assert not [s for s in c.saves if s.exists()], "save files left behind"


def _replica(pool: str, tmp_path: Path, image, cleanup: Cleanup, kind: str) -> ReplicaSpec:  # type: ignore[no-untyped-def]
    """A dataset of its own (the replica's state) holding the runtime config, and the
    spec of a 1-vCPU guest sharing it in as 9p tag "state"."""
    name = f"zz-vm-{kind}-{uuid.uuid4().hex[:6]}"
    mnt = tmp_path / f"{kind}-state"
    run_zfs(["zfs", "create", "-o", f"mountpoint={mnt}", f"{pool}/{kind}"])
    (mnt / "zz-guest.json").write_text(json.dumps(RUNTIME))
    run_dir = tmp_path / f"{kind}-run"
    run_dir.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(run_dir, 0o755)
    cleanup.names.append(name)
    return ReplicaSpec(
        name, run_dir, image=image.directory, memory_mib=MEMORY_MIB, vcpus=1,
        ports=((free_port(), GUEST_AGENT_PORT),), state_dir=mnt,
    )  # fmt: skip


def _boot(hv: Hypervisor, spec: ReplicaSpec) -> float:
    t0 = time.monotonic()
    hv.create(spec)
    boot = _wait_ok(spec.ports[0][0], t0 + 120)
    hello = hv.guest_call(spec.name, "ping")
    assert hello["mode"] == "idle" and hello["state_mounted"], hello  # up idle
    return boot


def _check_woken(hv: Hypervisor, spec: ReplicaSpec, seq: int) -> None:
    """The wake reached the runtime: it started with ZZ_RECOVER_FROM and wrote to the
    dataset, which the host reads on the ZFS mount."""
    r = hv.guest_call(spec.name, "wake", seq=seq)
    assert r["mode"] == "running" and r["recovering_from"] == seq and r["state_mounted"], r
    assert spec.state_dir is not None
    assert json.loads((spec.state_dir / "zz-wake.json").read_text())["seq"] == seq
    ran = spec.state_dir / "ran"
    deadline = time.monotonic() + 30
    while not ran.exists() or not ran.read_text().strip():
        assert time.monotonic() < deadline, "the runtime never wrote to /state"
        time.sleep(0.05)
    assert ran.read_text().strip() == str(seq)


def _console(spec: ReplicaSpec) -> str:
    log = spec.run_dir / "console.log"
    return log.read_text(errors="replace")[-3000:] if log.exists() else "(no console log)"


# `long`: test_controld_daemon.py::test_real_guest_wakeup wakes a paused real guest through
# controld, the same calls, on every run.
@pytest.mark.long
def test_paused_replica_wakes(
    hv: Hypervisor, cleanup: Cleanup, pool: str, tmp_path: Path, image
) -> None:  # type: ignore[no-untyped-def]
    spec = _replica(pool, tmp_path, image, cleanup, "paused")
    port = spec.ports[0][0]
    try:
        boot = _boot(hv, spec)
        hv.suspend(spec.name)
        assert hv.state(spec.name) == PAUSED
        assert not _answers(port, 1.0), "a paused guest answered"
        t0 = time.monotonic()
        hv.resume(spec.name)
        _wait_ok(port, t0 + 30)
        answer = time.monotonic() - t0
        assert hv.state(spec.name) == RUNNING
        _check_woken(hv, spec, 17)
        print(f"\n{spec.name}: boot {boot:.1f} s, resume -> answer {answer * 1000:.0f} ms")
    except BaseException:
        print(f"--- console of {spec.name} ---\n{_console(spec)}")
        raise
    hv.destroy(spec.name)
    assert spec.name not in hv.list() and spec.name not in _all_domains()


def test_hibernated_replica_wakes_paged_out(
    hv: Hypervisor, cleanup: Cleanup, pool: str, tmp_path: Path, image
) -> None:  # type: ignore[no-untyped-def]
    spec = _replica(pool, tmp_path, image, cleanup, "hibernated")
    port = spec.ports[0][0]
    save = tmp_path / f"{spec.name}.save"
    cleanup.saves.append(save)
    try:
        _boot(hv, spec)
        # A plain save() with the share mounted is refused (QEMU's 9p migration blocker),
        # names the domain and leaves it running; hibernate() of the paused guest works.
        with pytest.raises(HypervisorError, match="VirtFS|migrat") as ei:
            hv.save(spec.name, save)
        assert ei.value.name == spec.name and ei.value.action == "save"
        assert hv.state(spec.name) == RUNNING and _answers(port, 5.0)
        hv.suspend(spec.name)
        res = hv.hibernate(spec.name, save, balloon_mib=192)
        # Gone from libvirt, on disk instead; the balloon made the file small.
        assert spec.name not in hv.list() and spec.name not in _all_domains()
        assert save.exists() and res.file_bytes == save.stat().st_size
        assert res.balloon_kib is not None and res.balloon_kib < MEMORY_MIB * 1024 * 0.6, res
        assert res.file_bytes < 0.6 * MEMORY_MIB * 2**20, res
        assert not _answers(port, 0.5)
        t0 = time.monotonic()
        assert hv.wake_hibernated(save, MEMORY_MIB) == spec.name
        _wait_ok(port, t0 + 30)
        answer = time.monotonic() - t0
        assert hv.state(spec.name) == RUNNING
        deadline = time.monotonic() + 30
        while hv.memory_kib(spec.name) < MEMORY_MIB * 1024:  # grown back
            assert time.monotonic() < deadline, hv.memory_kib(spec.name)
            time.sleep(0.1)
        # Asleep, the share was unmounted (QEMU refuses to save with it mounted); the
        # wake mounts it again and starts the runtime.
        assert not hv.guest_call(spec.name, "ping")["state_mounted"]
        _check_woken(hv, spec, 5)
        print(
            f"\n{spec.name}: balloon {res.balloon_s:.1f} s to {res.balloon_kib >> 10} MiB,"
            f" save {res.save_s:.2f} s ({res.file_bytes / 1e6:.0f} MB), restore + grow ->"
            f" answer {answer:.2f} s"
        )
    except BaseException:
        print(f"--- console of {spec.name} ---\n{_console(spec)}")
        raise
    hv.destroy(spec.name)
    hv.discard(save)
    assert not save.exists() and spec.name not in _all_domains()


# `long`: the refused save() is also checked in test_hibernated_replica_wakes_paged_out.
@pytest.mark.long
def test_hibernate_refused_with_share_mounted_is_reported(
    hv: Hypervisor, cleanup: Cleanup, pool: str, tmp_path: Path, image
) -> None:  # type: ignore[no-untyped-def]
    """A plain save() of a guest that has its share mounted fails (QEMU's 9p migration
    blocker): the error names the domain, and the domain keeps running and answering.
    hibernate() of the same guest, paused, works (paused -> hibernated)."""
    spec = _replica(pool, tmp_path, image, cleanup, "blocked")
    save = tmp_path / f"{spec.name}.save"
    cleanup.saves.append(save)
    try:
        _boot(hv, spec)
        with pytest.raises(HypervisorError, match="VirtFS|migrat") as ei:
            hv.save(spec.name, save)
        assert ei.value.name == spec.name and ei.value.action == "save"
        assert hv.state(spec.name) == RUNNING and _answers(spec.ports[0][0], 5.0)
        # paused -> hibernated: hibernate() resumes it so the agent can unmount the share.
        hv.suspend(spec.name)
        hv.hibernate(spec.name, save, balloon_mib=192)
        assert spec.name not in _all_domains() and save.exists()
        assert hv.wake_hibernated(save, MEMORY_MIB) == spec.name
        _wait_ok(spec.ports[0][0], time.monotonic() + 60)
        hv.discard(save)
    except BaseException:
        print(f"--- console of {spec.name} ---\n{_console(spec)}")
        raise
    hv.destroy(spec.name)
