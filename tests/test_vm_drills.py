# tests/test_vm_drills.py - the drills end to end on a rack of real QEMU/libvirt guests (zz rack
# up --backend libvirt): the execution runtimes run inside the VMs, the spare is a paused VM.
# Slow (TCG guests boot in ~25 s on a busy 2-core host); skipped without libvirt and an image.
# The default test command runs the f = 1 rack (runtimes in the guests); the drills (crash on
# that rack, and on racks of their own f = 2, ZFS, byzantine-host: ~9 min) are marked `long`
# and run with `scripts/test.sh --long` (README "Tests", docs/operations.md lists where each
# real-VM check runs).
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_drill import _args, assert_phases, assert_recovered, needs_go
from tests.test_execution_runtime import needs_agreed
from tests.test_guest_share import _virtiofsd_pids
from tests.test_rack_lifecycle import kv, wait_dead
from tests.test_rackctl import leftovers, write_rack
from zz import drill, kvop, rackctl
from zz import report as rp
from zz.config import Config, load
from zz.naming import zfs_dataset
from zz.procrack import leftover_pids

try:
    import libvirt  # type: ignore[import-not-found]  # noqa: F401

    _conn = libvirt.open("qemu:///system")
    _conn.close()
    HAVE_LIBVIRT = True
except Exception:  # no binding, or no libvirtd answering
    HAVE_LIBVIRT = False

needs_vms = pytest.mark.skipif(
    not HAVE_LIBVIRT or os.geteuid() != 0,
    reason="needs libvirtd on qemu:///system and root (scripts/setup-virt.sh)",
)
# TCG guests on a loaded 2-core host: a correct replica's report is sometimes late by 1 s.
# The more guests share the 2 cores, the later (racks of 5 and 6 guests set more).
FLOOR_MS = 2000


def _down(config: Config) -> None:
    report = rackctl.down(config)
    for pid in leftovers(config):
        os.kill(pid, signal.SIGKILL)
    assert not rackctl.rack_domains(config), f"domains survived: {report}"


# Where a failing VM test leaves its rack's logs (guest consoles carry the runtimes' logs;
# agreed and controld logs are in run/): the rack directory itself is removed.
KEPT_LOGS = Path(os.environ.get("ZZ_KEEP_FAILED", "/tmp/zz-failed-racks"))


def _keep_logs(tmp: Path, name: str) -> None:
    """Copy the rack's logs (not its disk images) to KEPT_LOGS/<name>-<time>, and print
    the controlds' last lines: on CI only the output outlives the machine."""
    dest = KEPT_LOGS / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}"
    for src in tmp.rglob("*"):
        if src.is_file() and src.suffix in (".log", ".json", ".toml"):
            out = dest / src.relative_to(tmp)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out)
    print(f"a test failed while rack {name} was up: its logs are kept in {dest}")
    for log in sorted((tmp / "run" / "controld").glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        print(f"---- {log.name}, last lines ----", *lines[-6:], sep="\n")


@contextlib.contextmanager
def vm_rack_up(
    name: str,
    hosts: int,
    f: list[int],
    placement: str = "spread",
    floor_ms: int = FLOOR_MS,
    session: pytest.Session | None = None,
    store: str = "dir",
    sleep: str = "paused",
    ceiling_ms: int | None = None,
    durability: str = "off",
) -> Iterator[Config]:
    """A rack of guests with kv services kv0, kv1, ... of the given f (their spares
    `sleep`: paused or hibernated; rack.durability `durability`), torn down (and its
    directory removed) also on failure. Every simulated host is 127.0.0.1: a guest reaches
    only the host's 127.0.0.1 (as 10.0.2.2). Not under pytest's tmp_path: QEMU runs as
    libvirt-qemu and must reach the shares, and /tmp/pytest-of-root is private."""
    tmp = Path(tempfile.mkdtemp(prefix=f"zz-{name}-"))
    os.chmod(tmp, 0o755)
    failed_before = session.testsfailed if session is not None else 0
    ok = False
    try:
        path = write_rack(
            tmp, name, len(f), sleep, hosts=hosts, one_address=True, f=f, placement=placement
        )
        text = path.read_text().replace("[rack]\n", f'[rack]\ndurability = "{durability}"\n', 1)
        path.write_text(text)
        config = load(path)
        try:
            overrides = {"detect_floor_ms": floor_ms}
            if ceiling_ms is not None:
                overrides["detect_ceiling_ms"] = ceiling_ms
            rackctl.up(config, "libvirt", store, overrides=overrides, progress=print)
            yield config
            ok = session is None or session.testsfailed == failed_before
        finally:
            if not ok:
                _keep_logs(tmp, name)
            _down(config)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def vm_rack(request: pytest.FixtureRequest) -> Iterator[Config]:
    """One f = 1 kv service on 4 simulated hosts: 2 active guests and a paused one."""
    with vm_rack_up("vm", 4, [1], session=request.session) as config:
        yield config


def _run(config: Config, kind: str, out: Path, **kw: object) -> rp.DrillReport:
    report, where = drill.run(config, _args(kind, config, out, **{"after": 10.0, **kw}), print)
    print(rp.format_text(report))
    assert where == out and (out / "report.json").exists()
    assert (out / "timeline.png").read_bytes().startswith(rp.PNG_MAGIC)
    assert report.linearizable, report.linearizability
    assert_recovered(report)
    return report


def _guest_status(config: Config, service: str, i: int) -> dict[str, object]:
    s = config.service(service)
    path = s.exec_status_path(config, i)
    assert path.parent == s.exec_state_dir(config, i), "a guest writes its status in its share"
    return dict(json.loads(path.read_text()))


@pytest.mark.slow
@needs_vms
@needs_agreed
@needs_go
def test_runtimes_run_inside_the_guests(vm_rack: Config) -> None:
    """The execution replicas are the runtimes in the VMs (not host processes): their
    status comes through the share, and no zz.execution process runs on the host."""
    assert not [p for p in leftovers(vm_rack) if b"zz.execution" in _cmdline(p)]
    # Two active guests, whichever: a drill on this module's rack (in any order) leaves
    # another pair active and a fresh paused spare.
    statuses = {i: _guest_status(vm_rack, "kv0", i) for i in range(3)}
    awake = [i for i, st in statuses.items() if st["asleep"] is False]
    assert len(awake) == 2, statuses
    assert all(statuses[i]["agreement_links_up"] == 4 for i in awake), statuses
    names = {n for _, n in rackctl.rack_domains(vm_rack)}
    assert names == {"zz-vm-kv0-x0", "zz-vm-kv0-x1", "zz-vm-kv0-x2"}


def _domain_shares(config: Config) -> dict[str, str]:
    """Each domain of the rack: how its state is shared (its live XML's filesystem)."""
    import libvirt

    out = {}
    for uri, name in rackctl.rack_domains(config):
        conn = libvirt.open(uri)
        try:
            xml = conn.lookupByName(name).XMLDesc(0)
        finally:
            conn.close()
        out[name] = "virtiofs" if "<driver type='virtiofs'" in xml else "9p"
    return out


@pytest.mark.slow
@needs_vms
@needs_agreed
@needs_go
# `long`: 60-90 s with its fresh spare's boot, more than the default command's 20 minutes
# leave; the default runs the runtimes on this rack's virtiofs shares
# (test_runtimes_run_inside_the_guests) and controld's wake of a real paused guest.
@pytest.mark.long
def test_vm_wrong_reply_drill_on_virtiofs(vm_rack: Config, tmp_path: Path) -> None:
    """The rack's guests share their state over virtiofs (rack.guest_share's default for a
    service whose spares pause): they serve, checkpoint on the share (the directory store's
    snapshots), and a liar's wrong replies right before a checkpoint are detected, the
    paused guest woken recovers from its peers' checkpoint, the liar is convicted and a
    fresh paused guest, on virtiofs too, takes its index; linearizable."""
    assert set(_domain_shares(vm_rack).values()) == {"virtiofs"}, _domain_shares(vm_rack)
    cp = vm_rack.rack.checkpoint_interval
    r = _run(vm_rack, "wrong-reply", tmp_path / "drill", before=10.0, cp_phase=cp - 1)
    assert r.details["fault_at_seq"] > cp, r.details
    assert len(r.convicted) == 1 and len(r.woken) == 1, (r.convicted, r.woken)
    woken = r.woken[0].who
    assert r.convicted[0].who in {x.who for x in r.spares_restored if x.mode == "paused"}
    st = _guest_status(vm_rack, "kv0", int(woken.split("/")[1]))
    assert st["asleep"] is False and st["recovery"].get("checkpoint", 0) >= cp, st
    assert set(_domain_shares(vm_rack).values()) == {"virtiofs"}, _domain_shares(vm_rack)


def _zfs_snapshots(config: Config) -> list[str]:
    """<dataset>@<snapshot> of every snapshot in the rack's pools (names without the pool)."""
    from zz.snapshots.zfs import run_zfs

    pools = {rackctl.pool_name(config, h) for h in config.hosts}
    out = run_zfs(["zfs", "list", "-H", "-t", "snapshot", "-o", "name"])
    return [n.split("/", 1)[1] for n in out.split() if n.split("/", 1)[0] in pools]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow
@needs_vms
@needs_agreed
@needs_go
# `long`: 50-70 s with its fresh spare's boot, which kept the default command near its 20
# minutes; controld's wake of a real paused guest stays in it (test_real_guest_wakeup).
@pytest.mark.long
@pytest.mark.parametrize(
    ("kind", "cp_phase"),
    # A crash right after a checkpoint (CP = 32). A liar right before one, and corrupted
    # snapshots, on guests: test_vm_wrong_reply_drill_on_zfs (the directory-store
    # variants are tests/test_drill.py's, on processes; this rack ran wrong-reply-31 too
    # until CI neared 30 minutes).
    [("crash", 0)],
)
def test_vm_execution_fault_drill(
    vm_rack: Config, tmp_path: Path, kind: str, cp_phase: int | None
) -> None:
    """A faulty guest (lying through its runtime, or destroyed) is detected, the paused
    guest is resumed and recovers, the faulty one is convicted and destroyed, a fresh
    paused guest takes the index; linearizable."""
    r = _run(vm_rack, kind, tmp_path / kind, cp_phase=cp_phase)
    if cp_phase is not None:
        assert r.details["fault_at_seq"] % vm_rack.rack.checkpoint_interval == cp_phase
    assert r.detection_s is not None and r.wakeup_s is not None
    assert r.first_correct_reply_s is not None
    assert r.convicted and r.woken and r.spares_restored
    if kind == "crash":
        assert r.details["destroyed_domains"], r.details


@pytest.mark.slow
@pytest.mark.long
@needs_vms
@needs_agreed
@needs_go
def test_vm_wrong_reply_drill_f2(tmp_path: Path) -> None:
    """f = 2: three active guests, two paused; one lies: a spare is woken (f+1 = 3
    matching replies again), the liar convicted, a fresh spare provisioned."""
    with vm_rack_up("vmf2", 5, [2], floor_ms=4000) as config:
        assert set(_domain_shares(config).values()) == {"virtiofs"}, _domain_shares(config)
        r = _run(config, "wrong-reply", tmp_path / "drill")
        assert "kv0/0" in {c.who for c in r.convicted}, r.convicted
        assert {w.who for w in r.woken} & {"kv0/3", "kv0/4"}, r.woken
        assert ("kv0/0", "paused") in {(x.who, x.mode) for x in r.spares_restored}


@pytest.mark.slow
@pytest.mark.long
@needs_vms
@needs_agreed
@needs_go
def test_vm_wrong_reply_drill_hibernated_spare(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The spare is hibernated (paged out: ballooned down, saved to disk, its runtime not
    running): one active guest lies, the spare is restored from its save file, its agent
    mounts the share and starts the runtime, which recovers and gives the correct replies;
    the liar is convicted and a fresh hibernated spare provisioned; linearizable; every
    recovery phase of the report placed."""
    # A fault round waits for its woken replica 5 s plus the detection ceiling
    # (agreement/src/wake.h WAKE_RESOLVE_MS), then closes undecided. Here a hibernated TCG
    # guest's restore alone took 4.9 and 7.5 s (load average 13-17 on the 2 cores), and its
    # runtime then recovers and replays: with the default 5 s ceiling the round closed before
    # the spare reported (docs/performance.md "Recovery with real guests").
    with vm_rack_up(
        "vmhib", 4, [1], sleep="hibernated", session=request.session, ceiling_ms=20000
    ) as config:
        r = _run(config, "wrong-reply", tmp_path / "drill")
        print("recovery marks:", json.dumps(r.details.get("recovery_marks")))
        assert "kv0/0" in {c.who for c in r.convicted}, r.convicted
        assert ("kv0/2", "hibernated") in {(w.who, w.from_state) for w in r.woken}, r.woken
        assert ("kv0/0", "hibernated") in {(x.who, x.mode) for x in r.spares_restored}
        assert_phases(r, "kv0/2")
        # Its runtime started at the wake-up, after the restore: not a paused process.
        marks = r.details["recovery_marks"]["kv0/2"]
        assert "started" in marks and "noticed" not in marks, marks
        assert marks["started"] >= marks["resumed"], marks
        st = _guest_status(config, "kv0", 2)
        assert st["asleep"] is False and st["last_executed"] > 0, st


@pytest.mark.slow
@pytest.mark.long
@needs_vms
@needs_agreed
@needs_go
def test_vm_wrong_reply_drill_on_zfs(tmp_path: Path) -> None:
    """A rack on ZFS (docs/design.md §8): each guest's state is a dataset of its host's pool
    mounted in its share, its checkpoints are snapshots its controld takes on its signed
    request, and the woken guest fetches its peers' files from their controlds (zfs
    clone; a guest cannot read its own snapshots). The liar's dataset is kept for
    forensics and its fresh spare gets a new one. Then a corrupt-snapshot drill on the
    same rack."""
    with vm_rack_up("vmzfs", 4, [1], store="zfs") as config:
        svc = config.service("kv0")
        # Right before a checkpoint, past the first (10 s of load): the spare recovers from
        # a snapshot its peers' controlds read through clones.
        r = _run(config, "wrong-reply", tmp_path / "drill", before=10.0, cp_phase=31)
        assert r.details["fault_at_seq"] > config.rack.checkpoint_interval, r.details
        assert "kv0/0" in {c.who for c in r.convicted}, r.convicted
        assert "kv0/2" in {w.who for w in r.woken}, r.woken
        assert ("kv0/0", "paused") in {(x.who, x.mode) for x in r.spares_restored}
        snaps = _zfs_snapshots(config)
        assert any(s.startswith(f"{zfs_dataset(svc, 1)}@ckpt-") for s in snaps), snaps
        assert any(s.startswith(f"{zfs_dataset(svc, 0)}-forensic-") for s in snaps), snaps
        st = _guest_status(config, "kv0", 2)
        assert st["recovery"].get("checkpoint", 0) >= config.rack.checkpoint_interval, st
        assert not st["recovery"].get("bad_sources"), st["recovery"]
        # Same rack, the fresh spare 0 asleep: guest 1 snapshots corrupted files (ZFS
        # snapshots cannot be changed from outside) and lies once such a checkpoint is
        # stable. Spare 0 recovers from it through the controlds and rejects h-of-1's copies.
        r = _run(config, "corrupt-snapshot", tmp_path / "corrupt")
        assert r.details["corrupted_files"] > 0, r.details
        assert "kv0/1" in {c.who for c in r.convicted}, r.convicted
        assert "kv0/0" in {w.who for w in r.woken}, r.woken
        host1 = svc.exec_host(config, 1).name
        assert any(f"from controld-{host1}:" in x for x in r.details["rejected"]), r.details


@pytest.mark.slow
@pytest.mark.long
@needs_vms
@needs_agreed
@needs_go
def test_vm_byzantine_host_drill(tmp_path: Path) -> None:
    """Two kv services (f = 1); every replica on h2 misbehaves at once (its guests lie, its
    agreement replicas stop): each service wakes its paused guest, convicts its guest on
    h2 and gets a fresh paused spare for it (h2 boots them one after the other); both
    histories stay linearizable. (Two services with f = 2 on this 2-core machine make 8
    TCG guests: correct ones then grow too slow for the timer and are convicted too.)"""
    # h2 carries kv0/exec-1, kv1/exec-0, kv0/agreed-2 and kv1/agreed-1 (zz rack plan of
    # the "rotate" placement; "spread" gives no host active replicas of both services).
    # 6 guests, and h2 boots two fresh ones while they run: at a 2 s floor the correct guests'
    # reports came late enough that woken spares were convicted too, one after the other.
    with vm_rack_up("vmbh", 4, [1, 1], placement="rotate", floor_ms=5000) as config:
        assert set(_domain_shares(config).values()) == {"virtiofs"}, _domain_shares(config)
        r = _run(config, "byzantine-host", tmp_path / "drill", host="h2")
        assert set(r.service.split(",")) == {"kv0", "kv1"}
        assert "kv0/1" in {c.who for c in r.convicted}, r.convicted
        assert "kv1/0" in {c.who for c in r.convicted}, r.convicted
        assert "kv0/2" in {w.who for w in r.woken} and "kv1/2" in {w.who for w in r.woken}
        restored = {(x.who, x.mode) for x in r.spares_restored}
        assert {("kv0/1", "paused"), ("kv1/0", "paused")} <= restored, r.spares_restored


def _qemu_pids(config: Config) -> dict[str, int]:
    """Each running domain of the rack: its QEMU process (`-name guest=<domain>,`)."""
    out = {}
    for _, name in rackctl.rack_domains(config):
        pids = [p for p in leftover_pids([f"guest={name},"]) if b"qemu-system" in _cmdline(p)]
        assert len(pids) == 1, (name, pids)
        out[name] = pids[0]
    return out


def _virtiofsds(config: Config, service: str) -> dict[int, list[int]]:
    """Each execution replica of `service`: the virtiofsd processes serving its share."""
    s = config.service(service)
    return {i: sorted(_virtiofsd_pids(s.exec_state_dir(config, i))) for i in range(s.n_exec)}


def _controld_views(config: Config) -> dict[str, dict[str, object]]:
    """Every controld's status (each must answer)."""
    answers = rackctl.controld_statuses(config, timeout=10)
    assert all(isinstance(a, dict) for a in answers.values()), answers
    return answers  # type: ignore[return-value]


@pytest.mark.slow
@pytest.mark.long
@needs_vms
@needs_agreed
@needs_go
def test_vm_controld_restart_adopts_running_virtiofs_guests(tmp_path: Path) -> None:
    """An operator restarts the controlds of a guest rack while its guests run: the
    spare's host's controld crashes (SIGKILL) and an active guest's host's controld is
    stopped (SIGTERM, an upgrade); the service keeps answering meanwhile; `zz rack start`
    restarts the two controlds, which find their domains (same QEMU processes, the same
    libvirt virtiofsd on each share, nothing lost, in doubt or orphaned) and provision
    nothing; then a wrong-reply drill: the restarted controld wakes the paused virtiofs
    spare on the WAKEUP certificate, the other convicts its liar and boots a fresh virtiofs
    spare; `zz rack stop` and `zz rack start` bring the same rack back (durable agreement
    replicas, every guest booted again on its state directory) and it answers."""
    with vm_rack_up("vmrs", 4, [1], durability="write") as config:
        svc = config.service("kv0")
        assert set(_domain_shares(config).values()) == {"virtiofs"}, _domain_shares(config)
        assert all(r.ok for r in kv(config, *(kvop.encode_put(b"a%d" % n, b"v") for n in range(8))))
        qemu, fsd = _qemu_pids(config), _virtiofsds(config, "kv0")
        assert all(fsd.values()), fsd
        state = rackctl.load_state(config)
        assert state is not None
        spare_host = svc.exec_host(config, 2).name  # kv0/2 sleeps paused
        active_host = svc.exec_host(config, 0).name
        crashed, upgraded = state.proc(spare_host), state.proc(active_host)
        os.kill(crashed.pid, signal.SIGKILL)
        os.kill(upgraded.pid, signal.SIGTERM)
        wait_dead([crashed.pid, upgraded.pid])
        # Without those two controlds the guests and the agreement replicas serve on.
        got = kv(config, kvop.encode_put(b"b", b"w"), kvop.encode_get(b"a3"))
        assert got[-1] == kvop.KvReply(kvop.OK, b"v"), got

        lines: list[str] = []
        rackctl.start(config, progress=lines.append)
        repaired = rackctl.load_state(config)
        assert repaired is not None and all(p.alive() for p in repaired.procs)
        assert sorted(repaired.repairs[-1]["restarted"]) == sorted(
            f"controld {p.name} (pid {p.pid} dead)" for p in (crashed, upgraded)
        ), lines  # nothing provisioned: each guest runs as its controld recorded it
        assert _qemu_pids(config) == qemu and _virtiofsds(config, "kv0") == fsd
        views = _controld_views(config)
        for h in (spare_host, active_host):
            v = views[h]
            assert v["lost"] == [] and v["in_doubt_at_start"] == [] and v["orphans"] == [], v
        assert [(r["index"], r["state"]) for r in views[spare_host]["replicas"]] == [  # type: ignore[index]
            (2, "paused")
        ]
        got = kv(config, kvop.encode_get(b"b"))
        assert got == [kvop.KvReply(kvop.OK, b"w")], got

        # A fault after the restart: the restarted controlds act on the certificates.
        r = _run(config, "wrong-reply", tmp_path / "drill")
        assert "kv0/0" in {c.who for c in r.convicted}, r.convicted
        assert ("kv0/2", "paused") in {(w.who, w.from_state) for w in r.woken}, r.woken
        assert {w.host for w in r.woken if w.who == "kv0/2"} == {spare_host}, r.woken
        assert ("kv0/0", "paused") in {(x.who, x.mode) for x in r.spares_restored}
        assert set(_domain_shares(config).values()) == {"virtiofs"}, _domain_shares(config)

        stopped = rackctl.stop(config, progress=print)
        assert stopped.clean, stopped
        assert not rackctl.rack_domains(config) and not _virtiofsds_left(config, "kv0")
        rackctl.start(config, progress=print)
        assert set(_domain_shares(config).values()) == {"virtiofs"}, _domain_shares(config)
        got = kv(config, kvop.encode_get(b"a3"), kvop.encode_put(b"c", b"x"))
        assert got[0] == kvop.KvReply(kvop.OK, b"v") and got[1].ok, got
        states = {i: _guest_status(config, "kv0", i)["asleep"] for i in range(svc.n_exec)}
        assert sorted(states.values()) == [False, False, True], states


def _virtiofsds_left(config: Config, service: str) -> list[int]:
    return [p for pids in _virtiofsds(config, service).values() for p in pids]
