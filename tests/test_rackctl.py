# tests/test_rackctl.py - zz rack up / down on this machine (process backend, real zz-agreed,
# controlds and execution runtimes): everything comes up, and down leaves nothing behind.
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.test_execution_runtime import needs_agreed
from zz import ports, rackctl
from zz.config import Config, load
from zz.procrack import leftover_pids

HOSTS = 4


def write_rack(
    tmp_path: Path,
    name: str = "rt",
    services: int = 1,
    sleep: str = "paused",
    *,
    hosts: int = HOSTS,
    one_address: bool = False,
    f: Sequence[int] = (),
    placement: str = "spread",
) -> Path:
    """A rack of `hosts` simulated hosts 127.0.0.1..N (all 127.0.0.1 with one_address, as
    a rack of guests needs) and `services` kv services kv0, kv1, ... (g = 1, f from `f`,
    else 1), on free ports, laid out by `placement` (docs/placement.md)."""
    ctl = ports.free_base(range(hosts))
    lines = [f'[rack]\nname = "{name}"\ncheckpoint_interval = 32\nplacement = "{placement}"\n']
    for h in range(hosts):
        addr = "127.0.0.1" if one_address else f"127.0.0.{h + 1}"
        lines.append(f'[[hosts]]\nname = "h{h}"\naddress = "{addr}"\ncontrol_port = {ctl + h}\n')
    for s in range(services):
        base = ports.free_base(range(70))
        fs = f[s] if s < len(f) else 1
        lines.append(
            f'[[services]]\nname = "kv{s}"\nid = {s + 1}\ng = 1\nf = {fs}\napp = "kv"\n'
            f'sleep = "{sleep}"\nbase_port = {base}\n'
        )
    path = tmp_path / "rack.toml"
    path.write_text("\n".join(lines))
    return path


def leftovers(config: Config) -> list[int]:
    return leftover_pids([str(config.path), f"{config.rack.run_dir}/"])


def assert_nothing_left(config: Config) -> None:
    assert not leftovers(config), "processes of the rack survived `down`"
    assert not rackctl.rack_domains(config), "libvirt domains of the rack survived"
    assert not rackctl.state_path(config).exists()
    for h in config.hosts:
        home = config.rack.run_dir / "controld" / h.name
        assert not (home / "replicas").exists() and not (home / "inventory.json").exists()
        assert not (home / "agreed.json").exists()


@pytest.fixture
def rack(tmp_path: Path) -> Iterator[Config]:
    config = load(write_rack(tmp_path))
    try:
        yield config
    finally:
        # Also after a failed assertion: nothing of the rack may outlive the test.
        rackctl.down(config)
        for pid in leftovers(config):
            os.kill(pid, signal.SIGKILL)


async def _list(config: Config, host: str) -> list[dict[str, object]]:
    h = next(x for x in config.hosts if x.name == host)
    reply = await rackctl.operator_call(config, h, {"op": "list"}, timeout=10)
    assert reply["ok"], reply
    return list(reply["replicas"])  # type: ignore[arg-type]


@needs_agreed
def test_up_twice_down_twice_leaves_nothing(rack: Config) -> None:
    lines: list[str] = []
    state = rackctl.up(rack, progress=lines.append, overrides={"detect_floor_ms": 1000})
    assert state.complete
    assert (rack.rack.key_dir / "s0").is_dir(), "keys generated when missing"
    svc = rack.services[0]
    # One controld per host, 3g+1 agreement replicas, all alive and recorded on disk.
    assert sorted(p.name for p in state.procs if p.kind == "controld") == ["h0", "h1", "h2", "h3"]
    assert len([p for p in state.procs if p.kind == "agreed"]) == svc.n
    assert all(p.alive() for p in state.procs)
    # The agreement replicas are their hosts' controlds': each reports its own running,
    # with the pid rack.json records.
    entries, silent = rackctl.agreed_states(rack)
    assert silent == {} and len(entries) == svc.n
    for p in state.agreed():
        r = int(p.name.rsplit("-", 1)[1])
        assert p.host == rack.replica_host(svc, r).name
        assert (entries[p.name]["state"], entries[p.name]["pid"]) == ("running", p.pid)
    on_disk = rackctl.load_state(rack)
    assert on_disk is not None and on_disk.to_json() == state.to_json()
    assert on_disk.overrides == {"detect_floor_ms": 1000}
    assert "detect_floor_ms 1000" in (rack.rack.run_dir / "s1" / "agreed-0.conf").read_text()
    # Execution replicas live in their hosts' controlds: 2 active, 1 paused spare.
    modes = {r.index: r.mode for r in state.replicas}
    assert modes == {0: "active", 1: "active", 2: "paused"}
    for r in state.replicas:
        listed = asyncio.run(_list(rack, r.host))
        assert [(x["index"], x["state"]) for x in listed] == [(r.index, r.mode)]
    assert any("agreement replicas listening" in line for line in lines)

    with pytest.raises(rackctl.AlreadyUp, match="already up"):
        rackctl.up(rack)
    assert all(p.alive() for p in state.procs), "a second up must not touch the running rack"

    report = rackctl.down(rack)
    assert report.clean, report
    assert sorted(report.stopped) == sorted(p.name for p in state.procs)
    assert_nothing_left(rack)
    again = rackctl.down(rack)
    assert again.nothing and again.clean and not again.stopped


@needs_agreed
def test_down_after_a_controld_was_killed(rack: Config) -> None:
    """A controld SIGKILLed leaves its replicas running (their own sessions, docs/controld.md);
    down finds them by the rack's paths on their command lines."""
    state = rackctl.up(rack, overrides={"detect_floor_ms": 1000})
    victim = next(r for r in state.replicas if r.mode == "active")
    ctl = state.proc(victim.host)
    os.kill(ctl.pid, signal.SIGKILL)
    report = rackctl.down(rack)
    assert report.leftovers, "the orphaned execution replica should have been found"
    # Named: "not running", or "does not answer" when it was still dying as down asked.
    assert [w.split()[:2] for w in report.unanswered] == [["controld", victim.host]], report
    assert_nothing_left(rack)


@needs_agreed
def test_up_refuses_busy_ports_and_starts_nothing(rack: Config) -> None:
    import socket

    h = rack.hosts[1]
    with socket.socket() as s:
        s.bind((h.address, h.control_port))
        s.listen()
        with pytest.raises(rackctl.RackError, match=f"controld h1 .*{h.control_port}"):
            rackctl.up(rack)
    assert not leftovers(rack)
    assert rackctl.load_state(rack) is None


@needs_agreed
def test_dead_rack_record_is_cleaned_by_the_next_up(rack: Config) -> None:
    rackctl.up(rack, overrides={"detect_floor_ms": 1000})
    state = rackctl.load_state(rack)
    assert state is not None
    # Everything dies without `down` (say the machine's processes were killed).
    for p in state.procs:
        os.killpg(p.pid, signal.SIGKILL)
    for pid in leftovers(rack):
        os.kill(pid, signal.SIGKILL)
    # SIGKILL is not instant: an exiting process (an ASan zz-agreed freeing its memory)
    # still counts as running for a moment, and `up` rightly refuses a running rack.
    deadline = time.monotonic() + 30
    while state.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not state.alive(), state.alive()
    lines: list[str] = []
    state2 = rackctl.up(rack, progress=lines.append)
    assert any("dead rack" in line for line in lines)
    assert all(p.alive() for p in state2.procs)
    rackctl.down(rack)
    assert_nothing_left(rack)


def test_corrupt_state_file_is_an_error_not_a_guess(tmp_path: Path) -> None:
    config = load(write_rack(tmp_path))
    path = rackctl.state_path(config)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(rackctl.RackError, match="unreadable"):
        rackctl.load_state(config)
    path.write_text(json.dumps({"rack": "x"}))
    with pytest.raises(rackctl.RackError, match="not a rack state file"):
        rackctl.down(config)


def test_leftovers_include_a_guest_that_names_no_path_of_the_rack(tmp_path: Path) -> None:
    """A guest with a virtiofs share: its QEMU's command line names its domain, not the
    rack's run directory (the share is virtiofsd's), and `stop`'s sweep must still find
    it. Stood in for by a process with QEMU's `-name` argument."""
    import subprocess
    import sys

    config = load(write_rack(tmp_path))
    svc = config.services[0]
    name = f"zz-{config.rack.name}-{svc.name}-x0"
    argv = [sys.executable, "-c", "import time; time.sleep(60)", "qemu-system-x86_64",
            "-name", f"guest={name},debug-threads=on"]  # fmt: skip
    other = [*argv[:-1], f"guest={name}9,debug-threads=on"]  # another rack's domain
    procs = [subprocess.Popen(argv), subprocess.Popen(other)]
    try:
        found = rackctl.rack_leftovers(config)
        assert procs[0].pid in found and procs[1].pid not in found
    finally:
        for pr in procs:
            pr.kill()
            pr.wait()


def test_start_ticks_tells_a_recycled_pid_apart() -> None:
    me = rackctl.start_ticks(os.getpid())
    assert me is not None
    rec = rackctl.ProcRecord("x", "x", os.getpid(), me + 1, "/dev/null")
    assert not rec.alive(), "same pid, another start time: not our process"
    assert rackctl.ProcRecord("x", "x", os.getpid(), me, "/dev/null").alive()


@contextlib.contextmanager
def zfs_rack_config(tmp_path: Path) -> Iterator[Config]:
    """A rack whose name (so its pool names) no other run shares: a run killed before its
    teardown leaves pools behind that zfs-fuse imports again on its next start. Brought
    down (pools destroyed) whatever happens."""
    from zz.snapshots.zfs import ZfsMissingError, ensure_zfs_daemon

    try:
        ensure_zfs_daemon()
    except ZfsMissingError as e:
        pytest.fail(f"ZFS is required for this test (CI installs it): {e}")
    config = load(write_rack(tmp_path, name=f"rz{uuid.uuid4().hex[:6]}"))
    try:
        yield config
    finally:
        rackctl.down(config)
        for pid in leftovers(config):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def zfs_rack(tmp_path: Path) -> Iterator[Config]:
    with zfs_rack_config(tmp_path) as config:
        yield config


@needs_agreed
def test_zfs_store_pools_are_created_and_destroyed(zfs_rack: Config) -> None:
    """--store zfs: a file-backed pool per host, each replica's dataset on its host's pool;
    a pool that a died bring-up of this rack left on its vdev is replaced; down destroys
    the pools and removes their vdev files."""
    from zz.snapshots.zfs import create_file_pool, pool_exists, run_zfs

    rack = zfs_rack
    stale = rack.rack.run_dir / "zfs" / "h0.img"
    stale.parent.mkdir(parents=True)
    create_file_pool(rackctl.pool_name(rack, rack.hosts[0]), stale, rackctl.ZFS_POOL_SIZE)
    lines: list[str] = []
    state = rackctl.up(
        rack, store="zfs", overrides={"detect_floor_ms": 1000}, progress=lines.append
    )
    assert any("left by an earlier bring-up" in x for x in lines), lines
    names = [p["name"] for p in state.pools]
    assert names == [rackctl.pool_name(rack, h) for h in rack.hosts]
    assert all(pool_exists(n) for n in names)
    datasets = run_zfs(
        ["zfs", "list", "-H", "-o", "name", "-r", rackctl.pool_name(rack, rack.hosts[1])]
    )
    assert "s1-exec-0" in datasets, datasets  # exec-0 of kv0 is placed on h1
    report = rackctl.down(rack)
    assert sorted(report.pools) == sorted(names)
    assert not any(pool_exists(n) for n in names)
    assert not any(Path(p["vdev"]).exists() for p in state.pools)
    assert_nothing_left(rack)


@needs_agreed
def test_zfs_store_refuses_a_pool_it_did_not_create(zfs_rack: Config, tmp_path: Path) -> None:
    """A pool of the rack's pool name on another file is someone else's: up refuses, names
    it, leaves it alone and leaves nothing of the rack behind."""
    from zz.snapshots.zfs import create_file_pool, destroy_pool, pool_exists

    rack = zfs_rack
    name = rackctl.pool_name(rack, rack.hosts[2])
    other = tmp_path / "other.img"
    create_file_pool(name, other, rackctl.ZFS_POOL_SIZE)
    try:
        with pytest.raises(rackctl.RackError, match=f"pool {name} exists on {other}"):
            rackctl.up(rack, store="zfs")
        assert pool_exists(name)
        assert not any(pool_exists(rackctl.pool_name(rack, h)) for h in rack.hosts[:2])
        assert_nothing_left(rack)
    finally:
        destroy_pool(name, other)
