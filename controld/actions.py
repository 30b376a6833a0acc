# controld/actions.py - the hypervisor sequences controld runs for one replica: provision
# (boot, wait until the runtime answers, then pause or hibernate), wake (resume, or restore
# + grow the balloon), put back to sleep, destroy, and the wake-up notice to the runtime.
# Blocking calls: the daemon runs each sequence in a thread (Inventory.atransition).
"""Replica action sequences of one host (docs/controld.md, "Provisioning", "WAKEUP").

Everything here is synchronous and touches one replica; the inventory bookkeeping around
it (write-ahead, settle on failure) is the daemon's. Names and paths:

    domain    zz-<rack>-<service>-x<index>          unique per rack and host
    run dir   <home>/replicas/<domain>/             console/log (libvirt), replica.log
    save file <home>/saves/<domain>.save            hibernation image (or process record)
    state dir Service.exec_state_dir(config, i)      run/s<id>/exec-<i>: the runtime's own
                                                     directory, shared into a guest as 9p
                                                     "state" / the process's cwd
    notice    <state dir>/controld-wakeup.json      written at WAKEUP (see wake_notice);
                                                     a real guest's agent is also told
                                                     ("wake", guest_wake)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zz.atomicfile import write_atomic
from zz.config import EXEC_PORT_OFFSET, GUEST_STATUS, Config, Host, Service
from zz.controld.hypervisor import (
    GUEST_AGENT_PORT,
    DomainNotFound,
    Hypervisor,
    HypervisorError,
    ReplicaSpec,
)
from zz.keys import RACK_SERVICE, public_path, secret_path, service_dir
from zz.naming import domain_name, zfs_dataset
from zz.ports import free_port
from zz.snapshots import StorageError
from zz.wire import exec_principal

# A spare boots with this CPU weight (libvirt cpu_shares; a domain's default is 1024 on
# cgroup v1) or, where that cannot be set, at this nice level: under TCG a boot takes a
# core for ~30 s. A quarter, not less: against one busy active guest it still gets a fifth
# of the core, so the next spare is there within minutes even when the actives are busy.
SPARE_BOOT_SHARES = 256
SPARE_BOOT_NICE = 10
# A woken replica's CPU weight until the round it was woken for is settled: the service
# waits for it (its report makes the f+1 matching replies), and its resume is a chain of
# host threads each waiting for a CPU (the vCPU, QEMU's main loop for the network and the
# share's notifications, virtiofsd): four times a domain's default, against the other
# guests of the host (docs/controld.md "WAKEUP").
WAKE_SHARES = 4096


def raise_wake_priority(ctx: HostContext, name: str) -> int | None:
    """Give a woken domain WAKE_SHARES; the weight it had (to set back), or None if it
    was not changed (no cgroup weight through libvirt: test:///, a process rack)."""
    get, put = getattr(ctx.hv, "cpu_shares", None), getattr(ctx.hv, "set_cpu_shares", None)
    if get is None or put is None:
        return None
    before = get(name)
    if before is None or before >= WAKE_SHARES or not put(name, WAKE_SHARES):
        return None
    return before


def lower_wake_priority(ctx: HostContext, name: str, shares: int) -> None:
    """Set a woken domain's weight back (raise_wake_priority's `before`)."""
    put = getattr(ctx.hv, "set_cpu_shares", None)
    if put is not None:
        put(name, shares)


# docs/design.md §9: a guest ballooned to 192 MiB saves small and survives; 128 MiB hangs it.
BALLOON_MIB = 192
NOTICE_NAME = "controld-wakeup.json"  # execution/runtime.py WAKE_NOTICE reads it
# A guest's view (images/zz_guest.py, images/init): the share is mounted at /state, the
# agent reads zz-guest.json there, and 10.0.2.2 is the host's 127.0.0.1 (QEMU user net).
GUEST_SHARE = "/state"
GUEST_CONFIG = "zz-guest.json"
GUEST_DIR = "guest"  # rack.toml and keys/ for the runtime, under the share
SLIRP_HOST = "10.0.2.2"


@dataclass
class HostContext:
    """What the action sequences need to know about this host."""

    config: Config
    host: Host
    hv: Hypervisor
    home: Path  # controld's directory: inventory, ledger, replicas/, saves/
    memory_mib: int = 512  # a replica's full memory
    image: Path | None = None  # images/build.py output (libvirt, real URIs)
    store: str = "dir"  # the runtime's checkpoint store: dir or zfs
    zfs_pool: str | None = None
    ready_timeout: float = 60.0
    # Runtimes honour <state>/zz-fault.json (zz drill): one-machine racks only.
    drill_faults: bool = False

    @property
    def fake_guests(self) -> bool:
        """libvirt's test:/// driver: domains without a guest, nothing ever answers."""
        return bool(getattr(self.hv, "is_test", False))


def run_dir(ctx: HostContext, domain: str) -> Path:
    return ctx.home / "replicas" / domain


def save_path(ctx: HostContext, domain: str) -> Path:
    return ctx.home / "saves" / f"{domain}.save"


def exec_port(service: Service, index: int) -> int:
    return service.base_port + EXEC_PORT_OFFSET + index


def runtime_command(
    ctx: HostContext,
    service: Service,
    index: int,
    inject_fault: str | None = None,
    asleep: bool = False,
) -> tuple[str, ...]:
    cmd = [sys.executable, "-m", "zz.execution", "--rack", str(ctx.config.path)]
    cmd += ["--service", service.name, "--index", str(index), "--store", ctx.store]
    cmd += _runtime_flags(ctx, inject_fault, asleep)
    if ctx.store == "zfs":
        if not ctx.zfs_pool:
            raise ValueError("--store zfs needs a ZFS pool")
        cmd += ["--zfs-pool", ctx.zfs_pool]
    return tuple(cmd)


def _runtime_flags(ctx: HostContext, inject_fault: str | None, asleep: bool) -> list[str]:
    """What a runtime is told about its role, on the host and in a guest alike."""
    flags = []
    if asleep:
        # A spare: up and listening, but it registers with the agreement replicas only
        # once controld's wake notice appears (execution/runtime.py _wake_watch).
        flags.append("--start-asleep")
    if inject_fault is not None:
        # Drills only (zz drill wrong-reply/slow): the runtime misbehaves on purpose.
        flags += ["--inject-fault", inject_fault]
    if ctx.drill_faults:
        flags.append("--drill-faults")
    if os.environ.get("ZZ_REPLAY_FLUSH") == "first":
        # The baseline of scripts/bench/recovery-phases' paused-cp8-flushfirst: a replayed
        # run's files written before the first batch that reports, not after its replies.
        flags.append("--flush-replay-first")
    return flags


def guest_share(ctx: HostContext, service: Service, mode: str) -> str:
    """How a guest's state is shared (docs/images.md "The state share"): the rack's
    guest_share (virtiofs by default), except 9p for a replica that may be hibernated: one
    provisioned hibernated, and every replica of a service whose spares hibernate (an
    active one goes back to sleep hibernated after a round). QEMU 7.2 cannot save a guest
    with a virtiofs device, and a 9p share can be unmounted for the save."""
    if mode == "hibernated" or service.sleep == "hibernated":
        return "9p"
    return ctx.config.rack.guest_share


def replica_spec(
    ctx: HostContext,
    service: Service,
    index: int,
    inject_fault: str | None = None,
    asleep: bool = False,
    mode: str | None = None,
) -> ReplicaSpec:
    domain = domain_name(ctx.config, service, index)
    rd = run_dir(ctx, domain)
    rd.mkdir(parents=True, exist_ok=True)
    # libvirt-qemu must reach the console socket in the run dir (docs/controld.md).
    os.chmod(rd, 0o755)
    state = service.exec_state_dir(ctx.config, index)
    state.mkdir(parents=True, exist_ok=True)
    if ctx.hv.kind == "libvirt" and not ctx.fake_guests:
        _share_with_qemu(ctx, state)
        if ctx.store == "zfs":
            make_guest_dataset(ctx, service, index, state)
    port = exec_port(service, index)
    ports: tuple[tuple[int, int], ...] = ((port, port),)
    if ctx.hv.kind == "process":
        command: tuple[str, ...] | None = runtime_command(ctx, service, index, inject_fault, asleep)
    else:
        # The guest runs the image's agent (images/zz_guest.py), which starts the runtime
        # the share's zz-guest.json names. Its forward lets controld ask it (ping, wake);
        # libvirt reads the port back from the domain XML after a restart.
        command = None
        ports = ((free_port(), GUEST_AGENT_PORT), *ports)
        if not ctx.fake_guests:
            write_guest_files(ctx, service, index, state, inject_fault, asleep)
    return ReplicaSpec(
        name=domain,
        run_dir=rd,
        command=command,
        image=ctx.image,
        memory_mib=ctx.memory_mib,
        ports=ports,
        state_dir=state,
        public_address=service.exec_host(ctx.config, index).address,
        public_ports=(port,),
        share=guest_share(ctx, service, mode or ("active" if not asleep else service.sleep)),
    )


def guest_runtime_command(
    ctx: HostContext, service: Service, index: int, inject_fault: str | None, asleep: bool
) -> list[str]:
    """The runtime's command line inside a guest: everything it reads is on the share
    (/state), it listens on the guest's interface (the host forwards the execution port to
    it) and reaches the host's loopback as 10.0.2.2 (QEMU user networking)."""
    cmd = ["python3", "-m", "zz.execution", "--rack", f"{GUEST_SHARE}/{GUEST_DIR}/rack.toml"]
    cmd += ["--service", service.name, "--index", str(index)]
    # No zfs inside a guest: on a ZFS rack its dataset is mounted in the share and the host
    # snapshots it on request (host-zfs); else directory snapshots on the share.
    store = "host-zfs" if ctx.store == "zfs" else "dir"
    cmd += ["--store", store, "--state-dir", GUEST_SHARE]
    cmd += ["--key-dir", f"{GUEST_SHARE}/{GUEST_DIR}/keys"]
    cmd += ["--status-file", f"{GUEST_SHARE}/{GUEST_STATUS}"]
    cmd += ["--listen", "0.0.0.0", "--loopback-alias", SLIRP_HOST]
    return cmd + _runtime_flags(ctx, inject_fault, asleep)


def write_guest_files(
    ctx: HostContext,
    service: Service,
    index: int,
    state: Path,
    inject_fault: str | None,
    asleep: bool,
) -> None:
    """Put on the share what the guest's runtime needs: the rack config, this replica's
    own key file and the service's public keys (nothing of any other principal), and the
    agent's zz-guest.json. A paused spare boots its runtime asleep (it wakes in
    milliseconds); a hibernated one starts it only at the wake-up, because the agent stops
    it to unmount the share before the save (docs/images.md)."""
    guest = state / GUEST_DIR
    if guest.exists():
        shutil.rmtree(guest)
    key_dir = ctx.config.rack.key_dir
    me = exec_principal(index)
    # Public only, besides its own secret: the re-keyed slots' signed announcements and the
    # controlds' keys that verify them, so its peer view holds every slot's current key.
    for src in (secret_path(key_dir, service.id, me), public_path(key_dir, service.id),
                *_announcements(key_dir, service)):  # fmt: skip
        dest = guest / "keys" / src.relative_to(key_dir)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        os.chmod(dest, 0o600)
    shutil.copyfile(ctx.config.path, guest / "rack.toml")
    hibernated = asleep and service.sleep == "hibernated"
    cmd = guest_runtime_command(ctx, service, index, inject_fault, asleep and not hibernated)
    body = {"command": cmd, "start": "wake" if hibernated else "boot"}
    (state / GUEST_CONFIG).write_text(json.dumps(body, indent=1) + "\n")
    (state / GUEST_STATUS).unlink(missing_ok=True)
    if _qemu_owns_share(ctx):
        # QEMU reads the share as libvirt-qemu: the key file must be its own.
        for p in [guest, *guest.rglob("*"), state / GUEST_CONFIG]:
            shutil.chown(p, "libvirt-qemu", "libvirt-qemu")


def _announcements(key_dir: Path, service: Service) -> list[Path]:
    """The key directory's files a guest needs to know every re-keyed slot's current key:
    the controlds' public keys (they sign the announcements) first, then each announcement
    (spare-p<id>.msg)."""
    certs = sorted(service_dir(key_dir, service.id).glob("spare-p*.msg"))
    return [public_path(key_dir, RACK_SERVICE), *certs] if certs else []


def refresh_guest_keys(ctx: HostContext, service: Service, state: Path) -> int:
    """Bring a provisioned guest's copy of the key directory up to the host's announcements
    of re-keyed slots; return how many files changed. The guest's copy is made at its
    provisioning: without this a guest running before a slot was re-keyed kept the old key
    of the successor and dropped its FILE-FETCHes as badly signed, so a woken successor
    waited out the fetch timeout at each such peer (2 s each, docs/performance.md
    "Recovery with real guests"). Each file is replaced whole (rename), so the runtime's
    PeerKeys, which re-reads the announcements when one of them changes, never reads half
    of one; the controlds' keys come first, so an announcement is never there without
    what verifies it."""
    dest_dir = state / GUEST_DIR / "keys"
    if not dest_dir.is_dir():
        return 0
    key_dir = ctx.config.rack.key_dir
    changed = 0
    for src in _announcements(key_dir, service):
        data = src.read_bytes()
        dest = dest_dir / src.relative_to(key_dir)
        try:
            if dest.read_bytes() == data:
                continue
        except FileNotFoundError:
            dest.parent.mkdir(parents=True, exist_ok=True)
        owner = "libvirt-qemu" if _qemu_owns_share(ctx) else None
        write_atomic(dest, data, mode=0o600, owner=owner)
        changed += 1
    return changed


def _qemu_owns_share(ctx: HostContext) -> bool:
    """9p accessmode 'squash' (the backend's default), with controld as root: QEMU reads
    and writes the share as libvirt-qemu, so what controld puts there must be that user's
    (docs/images.md). 'passthrough' runs QEMU as root; a controld that is not root makes
    its files its own user's anyway."""
    return getattr(ctx.hv, "state_accessmode", "squash") == "squash" and os.geteuid() == 0


def _share_with_qemu(ctx: HostContext, state: Path) -> None:
    """The guest can only write its share if libvirt-qemu owns it (_qemu_owns_share)."""
    if not _qemu_owns_share(ctx):
        return
    for d in state.resolve().parents:
        if not os.stat(d).st_mode & 0o001:
            why = (
                f"QEMU (user libvirt-qemu) cannot reach {state}: {d} is not searchable by"
                f" others (chmod o+x {d}, or keep the rack's run_dir elsewhere)"
            )
            raise HypervisorError(state.name, "provision", why)
    try:
        shutil.chown(state, "libvirt-qemu", "libvirt-qemu")
    except (LookupError, OSError) as e:
        why = f"cannot hand {state} to libvirt-qemu: {e}"
        raise HypervisorError(state.name, "provision", why) from e


def make_guest_dataset(ctx: HostContext, service: Service, index: int, share: Path) -> Path:
    """A guest's dataset <pool>/s<id>-exec-<i>, mounted at <share>/live and writable by
    QEMU's user, where the guest's runtime keeps its state; controld snapshots it on the
    guest's request (controld/guestsnap.py). A fresh replica gets a fresh dataset: its
    predecessor's was renamed aside (set_aside_state)."""
    from zz.snapshots.zfs import ZfsStore, dataset_exists

    if not ctx.zfs_pool:
        raise HypervisorError(share.name, "provision", "--store zfs needs a ZFS pool")
    try:
        name = replica_dataset(ctx.zfs_pool, share)
        if name is None:
            # A predecessor's dataset zfs-fuse would not let go of (set_aside_state) keeps
            # the plain name: then <name>-1, -2, ...
            name = _unused(f"{ctx.zfs_pool}/{zfs_dataset(service, index)}", dataset_exists)
        store = ZfsStore(ctx.zfs_pool, name.partition("/")[2], share / "live")
    except StorageError as e:
        raise HypervisorError(share.name, "provision", f"dataset: {e}") from e
    if _qemu_owns_share(ctx):
        try:
            shutil.chown(store.path, "libvirt-qemu", "libvirt-qemu")
        except (LookupError, OSError) as e:
            why = f"cannot hand {store.path} to libvirt-qemu: {e}"
            raise HypervisorError(share.name, "provision", why) from e
    return store.path


def _answers(ctx: HostContext, domain: str, addr: tuple[str, int], state_dir: Path) -> str | None:
    """None if the replica answers, else why not. A guest: its agent answers "ping" (a
    TCP connect proves nothing, slirp accepts on a forward before the guest listens). A
    process: the runtime accepts a connection on its execution port."""
    if ctx.hv.kind != "process":
        try:
            reply = ctx.hv.guest_call(domain, "ping", timeout=2.0)
        except HypervisorError as e:
            return str(e)
        if reply.get("mode") == "exited":
            raise HypervisorError(domain, "provision", f"its runtime exited: {reply}")
        if reply.get("mode") == "running" and not (state_dir / GUEST_STATUS).exists():
            # The runtime writes its status once it listens: a spare paused before that
            # would wake up still importing (seconds under TCG).
            return "the agent answers, its runtime is not up yet"
        return None
    try:
        with socket.create_connection(addr, timeout=1.0):
            pass
    except OSError as e:
        return str(e)
    # Something answers on the port: it must be the runtime just started, not an orphan
    # of an earlier controld holding the port (its status file names its pid).
    want = getattr(ctx.hv, "pid", None)
    if want is None:
        return None
    pid = want(domain)
    status = _runtime_status(ctx, state_dir)
    if status.get("pid") != pid:
        return f"the port answers, but not runtime pid {pid} (status: pid {status.get('pid')})"
    return None


def _runtime_status(ctx: HostContext, state_dir: Path) -> dict[str, Any]:
    """A process runtime's status JSON (next to its state dir, Service.exec_status_path)."""
    try:
        data = json.loads(state_dir.with_name(f"{state_dir.name}.status.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def wait_answering(
    ctx: HostContext,
    service: Service,
    index: int,
    timeout: float,
    stop: threading.Event | None = None,
) -> float:
    """Block until the replica answers (_answers); returns the seconds it took. Stopped
    when `stop` is set."""
    t0 = time.monotonic()
    addr = (service.exec_host(ctx.config, index).address, exec_port(service, index))
    domain = domain_name(ctx.config, service, index)
    while True:
        _stop_point(stop, domain)
        last = _answers(ctx, domain, addr, service.exec_state_dir(ctx.config, index))
        if last is None:
            return time.monotonic() - t0
        try:
            if ctx.hv.state(domain) not in ("running",):
                why = "it stopped while booting"
                raise HypervisorError(domain, "provision", why + _console_tail(ctx, domain))
        except DomainNotFound:
            raise HypervisorError(domain, "provision", "it is gone while booting") from None
        if time.monotonic() - t0 > timeout:
            raise HypervisorError(domain, "provision", f"not answering on {addr}: {last}")
        time.sleep(0.05)


def put_to_sleep(ctx: HostContext, domain: str, mode: str) -> None:
    """Paused: suspend. Hibernated: balloon down to BALLOON_MIB, then save to disk."""
    if mode == "paused":
        ctx.hv.suspend(domain)
        return
    path = save_path(ctx, domain)
    path.parent.mkdir(parents=True, exist_ok=True)
    hib = getattr(ctx.hv, "hibernate", None)
    if hib is not None:
        hib(domain, path, balloon_mib=BALLOON_MIB)
        return
    ctx.hv.set_memory(domain, BALLOON_MIB * 1024)
    ctx.hv.save(domain, path)


class Stopped(HypervisorError):
    """A provisioning given up between two of its steps because its `stop` event was set
    (controld's `halt`): what it had created is destroyed, and it is not tried again."""


def _stop_point(stop: threading.Event | None, domain: str) -> None:
    if stop is not None and stop.is_set():
        raise Stopped(domain, "provision", "stopped by a halt")


def provision(
    ctx: HostContext,
    service: Service,
    index: int,
    mode: str,
    inject_fault: str | None = None,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Boot the replica, wait until its runtime answers (not on test:///), then leave it
    running (mode active) or put it to sleep. On failure whatever was created is destroyed
    before the error goes up, so the inventory's settle sees nothing and forgets the
    record (never a half-provisioned replica nobody tracks). `stop` set (a halt) ends it
    with Stopped at the next step: before the boot, after it, while waiting for the
    runtime, before the sleep."""
    spec = replica_spec(ctx, service, index, inject_fault, asleep=mode != "active", mode=mode)
    _stop_point(stop, spec.name)
    t0 = time.monotonic()
    out: dict[str, Any] = {"domain": spec.name}
    ctx.hv.create(spec)
    _test_hold(spec.name, mode)
    try:
        _stop_point(stop, spec.name)
        # Booting a spare must not starve the replicas that serve (docs/controld.md).
        if mode != "active":
            _boot_at_low_priority(ctx, spec.name, out)
        _to_mode(ctx, service, index, spec.name, mode, out, stop)
    except BaseException:
        _destroy_quietly(ctx, spec.name, save_path(ctx, spec.name))
        raise
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


def _to_mode(
    ctx: HostContext,
    service: Service,
    index: int,
    domain: str,
    mode: str,
    out: dict[str, Any],
    stop: threading.Event | None,
) -> None:
    """The rest of a provisioning once the domain runs: wait until the runtime answers,
    then (a spare) give it its full CPU weight back and put it to sleep."""
    if not ctx.fake_guests:
        out["answering_s"] = round(wait_answering(ctx, service, index, ctx.ready_timeout, stop), 3)
    if mode != "active":
        restore_boot_priority(ctx, domain)  # it must run at full speed once woken
        _stop_point(stop, domain)
        put_to_sleep(ctx, domain, mode)


def finish_provision(
    ctx: HostContext,
    service: Service,
    index: int,
    mode: str,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Finish the provisioning of a spare (mode paused or hibernated) that a stopped or
    killed controld left under way, from what the hypervisor shows: asleep already (paused,
    or gone with its save file): nothing to do; running (booting, or up and not yet put to
    sleep): wait until its runtime answers, then put it to sleep as provision() would.
    Anything else (gone, shut off, crashed) or a failure on the way: what is left is
    destroyed (domain, save file) and HypervisorError says why, for the caller to provision
    anew. `found` in the result says what it found."""
    domain = domain_name(ctx.config, service, index)
    save = save_path(ctx, domain)
    try:
        shown: str | None = ctx.hv.state(domain)
    except DomainNotFound:
        shown = None
    out: dict[str, Any] = {"domain": domain, "found": shown or "gone"}
    if (mode, shown) == ("paused", "paused"):
        return out
    if mode == "hibernated" and shown is None and save.exists():
        out["found"] = "saved"
        return out
    t0 = time.monotonic()
    try:
        if shown != "running":
            why = f"the hypervisor shows it {shown or 'gone'}"
            raise HypervisorError(domain, "finish provisioning", why)
        _stop_point(stop, domain)
        _to_mode(ctx, service, index, domain, mode, out, stop)
    except BaseException:
        _destroy_quietly(ctx, domain, save)
        raise
    out["seconds"] = round(time.monotonic() - t0, 3)
    return out


BOOT_PRIORITY = "boot-priority.json"  # in the run dir while a spare boots at low priority


def _boot_at_low_priority(ctx: HostContext, name: str, out: dict[str, Any]) -> None:
    """Give a booting spare a small CPU weight (its cgroup's, through libvirt), else a high
    nice; record which in `out` (`low_priority_boot`, `boot_cpu_shares`), and what sets it
    back in the run dir (BOOT_PRIORITY, read by restore_boot_priority: a controld that
    finishes the boot of one it did not start still knows the weight it had)."""
    get, put = getattr(ctx.hv, "cpu_shares", None), getattr(ctx.hv, "set_cpu_shares", None)
    before = get(name) if get is not None and put is not None else None
    back: dict[str, int] | None = None
    if before is not None and put is not None and put(name, SPARE_BOOT_SHARES):
        out["low_priority_boot"] = True
        out["boot_cpu_shares"] = [SPARE_BOOT_SHARES, before]
        back = {"cpu_shares": before}
    else:
        renice = getattr(ctx.hv, "set_nice", None)
        if renice is None:
            return
        out["low_priority_boot"] = renice(name, SPARE_BOOT_NICE)
        back = {"nice": 0}
    write_atomic(run_dir(ctx, name) / BOOT_PRIORITY, json.dumps(back) + "\n")


def restore_boot_priority(ctx: HostContext, name: str) -> None:
    """Set a booted spare's CPU weight (or nice) back to what it had before its boot
    (_boot_at_low_priority); nothing if it was not changed."""
    path = run_dir(ctx, name) / BOOT_PRIORITY
    try:
        back = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if isinstance(back, dict) and isinstance(back.get("cpu_shares"), int):
        put = getattr(ctx.hv, "set_cpu_shares", None)
        if put is not None:
            put(name, back["cpu_shares"])
    elif isinstance(back, dict) and "nice" in back:
        renice = getattr(ctx.hv, "set_nice", None)
        if renice is not None:
            renice(name, 0)
    path.unlink(missing_ok=True)


# TESTS ONLY (tests/test_controld_orphans.py): after create(), write the domain name to
# this file and wait, so a test can SIGKILL controld between the runtime's spawn and the
# inventory's confirmation, deterministically; with TEST_HOLD_MODE_ENV set, only for a
# provisioning in that mode (e.g. paused: a fresh spare, not the replica it succeeds).
TEST_HOLD_ENV = "ZZ_CONTROLD_TEST_HOLD_AFTER_CREATE"
TEST_HOLD_MODE_ENV = "ZZ_CONTROLD_TEST_HOLD_MODE"


def _test_hold(domain: str, mode: str) -> None:
    path = os.environ.get(TEST_HOLD_ENV)
    if not path or os.environ.get(TEST_HOLD_MODE_ENV, mode) != mode:
        return
    Path(path).write_text(domain + "\n")
    time.sleep(300.0)


def _console_tail(ctx: HostContext, domain: str, lines: int = 3) -> str:
    """The replica's last output lines (a guest's console, where its init and runtime log;
    a process's replica.log), for an error that must say why it went away."""
    for name in ("console.log", "replica.log"):
        try:
            text = (run_dir(ctx, domain) / name).read_text(errors="replace")
            break
        except OSError:
            continue
    else:
        return ""
    tail = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return f" (console: {' | '.join(tail)})" if tail else ""


def _destroy_quietly(ctx: HostContext, domain: str, save: Path | None) -> None:
    try:
        ctx.hv.destroy(domain)
    except DomainNotFound:
        pass
    except HypervisorError:
        pass  # the settle step asks the hypervisor what is left and records it
    if save is not None and save.exists():
        try:
            ctx.hv.discard(save)
        except HypervisorError:
            pass


def wake(
    ctx: HostContext, domain: str, state: str, save_file: str | None, grow: bool = True
) -> None:
    """Paused: resume. Hibernated: restore, then grow the balloon to the full memory
    (paged-out restore: the guest pages its memory back in as it touches it); with grow
    False the restore only, the balloon left as it was saved (grow() later)."""
    if state == "paused":
        ctx.hv.resume(domain)
        return
    if not save_file:
        raise HypervisorError(domain, "wake", "hibernated without a save file")
    full_kib = ctx.memory_mib * 1024
    woke = getattr(ctx.hv, "wake_hibernated", None)
    if not grow:
        name = ctx.hv.restore(Path(save_file))
    elif woke is not None:
        name = woke(Path(save_file), ctx.memory_mib)
    else:
        name = ctx.hv.restore(Path(save_file))
        ctx.hv.set_memory(name, full_kib)
    if name != domain:
        raise HypervisorError(domain, "wake", f"the save file restored {name!r}")


def grow(ctx: HostContext, domain: str) -> None:
    """Grow a restored replica's balloon back to the full memory."""
    ctx.hv.set_memory(domain, ctx.memory_mib * 1024)


def destroy(ctx: HostContext, domain: str, save_file: str | None) -> None:
    """Destroy the domain (gone already is fine) and drop its save file."""
    try:
        ctx.hv.destroy(domain)
    except DomainNotFound:
        pass
    if save_file and Path(save_file).exists():
        ctx.hv.discard(Path(save_file))


def wake_notice(ctx: HostContext, service: Service, index: int, seq: int, awake: list[int]) -> Path:
    """Tell the runtime it is recovering and from which seq: a JSON file in its state
    directory (the process's cwd; inside a guest the 9p share /state), written atomically.
    The runtime's use of it (fetch the checkpoint, replay from seq) is issue 6."""
    state = service.exec_state_dir(ctx.config, index)
    state.mkdir(parents=True, exist_ok=True)
    path = state / NOTICE_NAME
    body = {
        "service": service.id,
        "index": index,
        "recovering_from_seq": seq,
        "awake": awake,
        "woken_at": time.time(),
    }
    write_atomic(path, json.dumps(body) + "\n")
    return path


def guest_wake(ctx: HostContext, domain: str, seq: int) -> None:
    """A real guest: ask its agent to mount /state again (a hibernated guest unmounted it
    to be saved), note the seq and start the runtime (images/zz_guest.py "wake"). A process
    or a test:/// domain has nothing to ask: the notice file is all."""
    if ctx.hv.kind == "process" or ctx.fake_guests:
        return
    ctx.hv.guest_call(domain, "wake", timeout=30.0, seq=seq)


def set_aside_state(ctx: HostContext, service: Service, index: int, seq: int) -> str | None:
    """Keep a convicted replica's state for forensics, out of its successor's way (the
    fresh replica starts from nothing). ZFS store: snapshot <pool>/<dataset>@forensic-<seq>,
    unmount the dataset and rename it to <dataset>-forensic-<seq>; the snapshot is
    then <pool>/<dataset>-forensic-<seq>@forensic-<seq>. Either store: the state directory
    becomes exec-<i>.forensic-<seq>, and the replica's console log moves into its
    console/ (keep_console). Returns what was kept (None: nothing was there)."""
    kept: list[str] = []
    state = service.exec_state_dir(ctx.config, index)
    if ctx.store == "zfs" and ctx.zfs_pool:
        from zz.snapshots.zfs import dataset_exists, run_zfs

        ds = replica_dataset(ctx.zfs_pool, state) or f"{ctx.zfs_pool}/{zfs_dataset(service, index)}"
        if dataset_exists(ds):
            run_zfs(["zfs", "snapshot", f"{ds}@forensic-{seq}"])
            new = _unused(f"{ds}-forensic-{seq}", dataset_exists)
            run_zfs(["zfs", "set", "mountpoint=none", ds], retry_busy=True)
            try:
                run_zfs(["zfs", "rename", ds, new], retry_busy=True)
            except StorageError as e:
                if "busy" not in str(e):
                    raise
                # zfs-fuse holds a guest's dataset after QEMU served it over 9p: rename,
                # destroy and mount all say "busy", for good. Copy the evidence out; the
                # held dataset stays unmounted, and the fresh guest gets a new one.
                _copy_dataset(f"{ds}@forensic-{seq}", new)
            kept.append(f"{new}@forensic-{seq}")
    dest = Path(_unused(str(state.with_name(f"{state.name}.forensic-{seq}")), os.path.exists))
    if state.exists():
        state.rename(dest)
        kept.append(str(dest))
    console = keep_console(ctx, service, index, dest)
    if console is not None:
        kept.append(f"console log in {console}")
    return ", ".join(kept) or None


FORENSIC_CONSOLE = "console"  # in a forensic state: the convicted replica's console log(s)


def keep_console(ctx: HostContext, service: Service, index: int, dest: Path) -> Path | None:
    """Move a convicted replica's console log into its forensic state (`dest/console/`):
    its successor has the same domain name and run dir, and libvirt would overwrite
    console.log (append='off') and a process would append to replica.log. Returns the
    directory (None: there was no log)."""
    rd = run_dir(ctx, domain_name(ctx.config, service, index))
    logs = [rd / n for n in ("console.log", "replica.log") if (rd / n).is_file()]
    if not logs:
        return None
    out = dest / FORENSIC_CONSOLE
    out.mkdir(parents=True, exist_ok=True)
    for log in logs:
        shutil.move(log, out / log.name)
    return out


def _copy_dataset(snapshot: str, dest: str) -> None:
    """`zfs send snapshot | zfs recv -u dest`: dest gets the snapshot's content and name,
    unmounted."""
    send = subprocess.Popen(["zfs", "send", snapshot], stdout=subprocess.PIPE)
    try:
        recv = subprocess.run(
            ["zfs", "recv", "-u", f"{dest}@{snapshot.partition('@')[2]}"],
            stdin=send.stdout,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    finally:
        assert send.stdout is not None
        send.stdout.close()
        sent = send.wait(timeout=600)
    if sent != 0 or recv.returncode != 0:
        raise StorageError(f"zfs send {snapshot} | zfs recv {dest}: {recv.stderr.strip()}")
    from zz.snapshots.zfs import run_zfs

    run_zfs(["zfs", "set", "mountpoint=none", dest], retry_busy=True)


def replica_dataset(pool: str, state: Path) -> str | None:
    """The dataset of `pool` mounted at <state>/live: a replica's state (a runtime's own
    dataset, or a guest's that controld made), whatever it is called."""
    from zz.snapshots.zfs import run_zfs

    want = str((state / "live").absolute())
    for line in run_zfs(["zfs", "list", "-H", "-o", "name,mountpoint", "-r", pool]).splitlines():
        name, _, mountpoint = line.partition("\t")
        if mountpoint == want:
            return name
    return None


def _unused(name: str, exists: Callable[[str], bool]) -> str:
    out, n = name, 1
    while exists(out):
        out, n = f"{name}-{n}", n + 1
    return out


@dataclass(frozen=True)
class Forensic:
    """One kept state of a convicted replica: a directory or a ZFS dataset (with its
    @forensic snapshot), created `created` (Unix time)."""

    kind: str  # "dir" or "zfs"
    name: str
    created: float


def forensics(ctx: HostContext) -> list[Forensic]:
    """What set_aside_state() kept on this host (for the services it holds replicas of)."""
    out: list[Forensic] = []
    for svc in ctx.config.services:
        base = ctx.config.rack.run_dir / f"s{svc.id}"
        if base.is_dir():
            for p in sorted(base.glob("exec-*.forensic-*")):
                if p.is_dir():
                    out.append(Forensic("dir", str(p), p.stat().st_mtime))
    if ctx.store == "zfs" and ctx.zfs_pool:
        from zz.snapshots.zfs import run_zfs

        # `zfs get -p` (zfs-fuse's `list` has no -p): creation in seconds since the epoch.
        lines = run_zfs(
            ["zfs", "get", "-rHp", "-o", "name,value", "creation", ctx.zfs_pool]
        ).splitlines()
        for line in lines:
            name, _, created = line.partition("\t")
            leaf = name.rsplit("/", 1)[-1]
            # "--": a reader's clone of one (controld serving copies by hash), not a state
            forensic = "@" not in leaf and "-forensic-" in leaf and "--" not in leaf
            if forensic and created.strip().isdigit():
                out.append(Forensic("zfs", name, float(created)))
    return out


def purge_forensic(ctx: HostContext, item: Forensic) -> None:
    """Remove one kept state for good (its snapshots with a ZFS dataset)."""
    if item.kind == "zfs":
        from zz.snapshots.zfs import run_zfs

        run_zfs(["zfs", "destroy", "-r", item.name], retry_busy=True)
    else:
        shutil.rmtree(item.name)
