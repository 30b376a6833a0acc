# zz/rackctl.py - `zz rack up` / `zz rack down`: bring a planned rack up on this machine
# (controld per host, zz-agreed replicas, execution replicas through controld) and tear it down.
"""Rack bring-up and tear-down (docs/operations.md).

    state = up(load("rack.toml"))        # keys, render, controlds, agreement, replicas
    down(load("rack.toml"))              # from any shell: everything in run/rack.json

Order of `up` (each step recorded in ``run/rack.json`` before the next, so that a `down`
after a failed or interrupted `up` still finds everything):

1. keys (``zz keys``) when the key directory does not exist yet;
2. the placement check (``zz rack plan``) and a port check: every listener must be free;
3. ZFS (``--store zfs``): one file-backed pool per host, ``zz<rack>h<i>``;
4. one controld per host (``python -m zz.controld``), process or libvirt backend;
5. every agreement replica (``zz-agreed``, rendered replica files);
6. every execution replica *through its host's controld* (CONTROL ``provision``): the
   active ones running, the spares paused or hibernated as the service says; controld
   then owns them, so a WAKEUP or SHUTDOWN certificate finds them in its inventory;
7. wait until every active execution replica is linked to all agreement replicas.

Processes are identified by pid *and* kernel start time (``/proc/<pid>/stat`` field 22),
so a recycled pid is never signalled. Each runs in its own process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zz import keys, placement, render
from zz.atomicfile import write_atomic
from zz.config import Config, Host, Service, is_loopback
from zz.naming import domain_name
from zz.procrack import DEFAULT_AGREED, leftover_pids, repo_env, signal_group, spawn

STATE_NAME = "rack.json"
# Written by `down` (the time it finished): a replica's stats file older than that is from
# the rack that went down, not a sign of one running (zz status).
DOWN_NAME = "rack.down"
BACKENDS = ("process", "libvirt")
STORES = ("dir", "zfs")
ZFS_POOL_SIZE = 256 << 20  # zfs-fuse refuses vdevs under 64 MiB; sparse file

Progress = Callable[[str], None]


class RackError(Exception):
    """The rack cannot be brought up or down; the message says why and what to do."""


class AlreadyUp(RackError):
    pass


def _quiet(_: str) -> None:
    pass


# ---- processes ----------------------------------------------------------------------------
def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, None if it is gone/a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat[stat.rindex(")") + 2 :].split()
    if rest[0] == "Z":
        return None
    return int(rest[19])


@dataclass
class ProcRecord:
    """One process `up` started: enough for another shell to find and stop it."""

    kind: str  # controld, agreed
    name: str  # h0 / web/agreed-0
    pid: int
    ticks: int  # kernel start time: pid + ticks is the process's identity
    log: str
    address: str = ""
    port: int = 0

    def alive(self) -> bool:
        return start_ticks(self.pid) == self.ticks


@dataclass
class ReplicaRecord:
    """An execution replica provisioned through a controld."""

    service: str
    index: int
    host: str
    mode: str  # active, paused, hibernated
    domain: str
    address: str
    port: int


@dataclass
class RackState:
    """run/rack.json: what `up` started, for `down`, `zz drill` and `zz status`."""

    rack: str
    config: str
    backend: str
    store: str
    started_at: float
    procs: list[ProcRecord] = field(default_factory=list)
    replicas: list[ReplicaRecord] = field(default_factory=list)
    pools: list[dict[str, str]] = field(default_factory=list)  # {"name", "vdev"}
    overrides: dict[str, Any] = field(default_factory=dict)  # replica-file keys (--set)
    complete: bool = False

    def proc(self, name: str) -> ProcRecord:
        for p in self.procs:
            if p.name == name:
                return p
        raise KeyError(name)

    def alive(self) -> list[ProcRecord]:
        return [p for p in self.procs if p.alive()]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RackState:
        return cls(
            rack=d["rack"],
            config=d["config"],
            backend=d["backend"],
            store=d.get("store", "dir"),
            started_at=d["started_at"],
            procs=[ProcRecord(**p) for p in d.get("procs", [])],
            replicas=[ReplicaRecord(**r) for r in d.get("replicas", [])],
            pools=list(d.get("pools", [])),
            overrides=dict(d.get("overrides", {})),
            complete=bool(d.get("complete")),
        )


# ---- removing only what is the rack's ----------------------------------------------------
def contained(path: Path, root: Path) -> Path | None:
    """`path` resolved (symlinks followed, `..` folded) if that lies strictly inside `root`
    (resolved too), else None. Every removal of a path built from the config or the state
    file goes through this: a name, a symlink or a recorded path must never lead out."""
    real_root = root.resolve()
    real = path.resolve()
    return real if real != real_root and real.is_relative_to(real_root) else None


def _inside(path: Path, root: Path) -> Path:
    """`path` with its parent resolved, if that lies strictly inside `root`; the last
    component is kept as it is, so a symlink there is removed itself, never followed."""
    real_root = root.resolve()
    target = path.parent.resolve() / path.name
    if path.name in ("", ".", "..") or target == real_root or not target.is_relative_to(real_root):
        raise RackError(f"refusing to remove {path}: not inside the rack's {root}")
    return target


def remove_tree(path: Path, root: Path) -> None:
    """rmtree `path` if it is inside `root` (RackError if not); a missing path is fine, a
    symlink is unlinked (its target stays). rmtree does not follow symlinks below `path`."""
    target = _inside(path, root)
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)


def remove_file(path: Path, root: Path) -> None:
    """unlink `path` if it is inside `root` (RackError if not); a missing file is fine."""
    target = _inside(path, root)
    if target.is_symlink() or not target.is_dir():
        target.unlink(missing_ok=True)


def _remove_each(
    removals: list[tuple[Callable[[Path, Path], None], Path]], root: Path, report: DownReport | None
) -> None:
    """Run every removal; one refused (outside `root`) is reported and the rest still run."""
    for remove, path in removals:
        try:
            remove(path, root)
        except RackError as e:
            if report is None:
                raise
            report.refused.append(str(e))


def state_path(config: Config) -> Path:
    return config.rack.run_dir / STATE_NAME


def down_time(config: Config) -> float:
    """When `down` last finished (time.time()), 0.0 if it never did or `up` ran since."""
    try:
        return float((config.rack.run_dir / DOWN_NAME).read_text().strip())
    except (OSError, ValueError):
        return 0.0


def load_state(config: Config) -> RackState | None:
    """The recorded rack, None if there is none; a corrupt file is an error (never guess
    what to kill)."""
    path = state_path(config)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise RackError(f"{path}: unreadable ({e}); remove it after checking `ps`") from e
    try:
        return RackState.from_json(data)
    except (KeyError, TypeError) as e:
        raise RackError(f"{path}: not a rack state file ({e})") from e


def _save_state(config: Config, state: RackState) -> None:
    path = state_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(state.to_json(), indent=1) + "\n")


# ---- up -----------------------------------------------------------------------------------
def _listeners(config: Config) -> list[tuple[str, tuple[str, int]]]:
    out = [(f"controld {h.name}", (h.address, h.control_port)) for h in config.hosts]
    for s in config.services:
        out += [(f"{s.name}/agreed-{r}", config.replica_address(s, r)) for r in range(s.n)]
        if s.uses_execution_replicas:
            out += [(f"{s.name}/exec-{i}", s.exec_address(config, i)) for i in range(s.n_exec)]
    return out


def _port_busy(addr: tuple[str, int]) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError:
            return True
    return False


def _wait_listening(rec: ProcRecord, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if not rec.alive():
            raise RackError(f"{what} exited while starting:\n{_tail(Path(rec.log))}")
        with (
            contextlib.suppress(OSError),
            socket.create_connection((rec.address, rec.port), timeout=0.5),
        ):
            return
        if time.monotonic() > deadline:
            raise RackError(f"{what} not listening on {rec.address}:{rec.port} after {timeout} s")
        time.sleep(0.05)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def pool_name(config: Config, host: Host) -> str:
    return f"zz{config.rack.name.replace('-', '')}h{host.index}"


def _start(
    state: RackState, config: Config, kind: str, name: str, cmd: list[str], log: Path, addr: Any
) -> ProcRecord:
    log.parent.mkdir(parents=True, exist_ok=True)
    p = spawn(cmd, log, repo_env())
    ticks = start_ticks(p.pid)
    if ticks is None:
        p.wait(timeout=10)
        raise RackError(f"{name} exited at once ({p.returncode}):\n{_tail(log)}")
    rec = ProcRecord(kind, name, p.pid, ticks, str(log), addr[0], addr[1])
    state.procs.append(rec)
    _save_state(config, state)
    return rec


def _provision_all(
    config: Config, state: RackState, progress: Progress, timeout: float
) -> list[ReplicaRecord]:
    """Every execution replica through its host's controld, hosts in parallel (one host
    provisions its replicas one after the other: controld's own order)."""
    from zz.controld.rpc import RpcError

    jobs: dict[int, list[tuple[Service, int, str]]] = {}
    for s in config.services:
        if not s.uses_execution_replicas:
            continue
        for i in range(s.n_exec):
            mode = "active" if i < s.active else s.sleep
            jobs.setdefault(s.exec_host(config, i).index, []).append((s, i, mode))

    async def host_jobs(h: Host, todo: list[tuple[Service, int, str]]) -> list[ReplicaRecord]:
        done = []
        for s, i, mode in todo:
            t0 = time.monotonic()
            try:
                reply = await operator_call(
                    config,
                    h,
                    {"op": "provision", "service": s.name, "index": i, "mode": mode},
                    timeout,
                )
            except RpcError as e:
                raise RackError(f"controld {h.name}: provision {s.name}/{i} {mode}: {e}") from e
            if not reply.get("ok"):
                raise RackError(f"controld {h.name}: provision {s.name}/{i} {mode}: "
                                f"{reply.get('error', reply)}")  # fmt: skip
            addr = s.exec_address(config, i)
            progress(f"  {s.name}/exec-{i} on {h.name} {addr[0]}:{addr[1]}: {mode}"
                     f" ({time.monotonic() - t0:.1f} s)")  # fmt: skip
            done.append(
                ReplicaRecord(s.name, i, h.name, mode, domain_name(config, s, i), *addr)
            )
        return done

    async def run() -> list[ReplicaRecord]:
        results = await asyncio.gather(
            *(host_jobs(config.hosts[h], todo) for h, todo in sorted(jobs.items())),
            return_exceptions=True,
        )
        out: list[ReplicaRecord] = []
        errors = []
        for r in results:
            if isinstance(r, BaseException):
                errors.append(r)
            else:
                out += r
        # Recorded even on failure: down must know what controld holds (it destroys all
        # of a controld's replicas anyway when it stops).
        state.replicas = out
        _save_state(config, state)
        if errors:
            raise errors[0]
        return out

    return asyncio.run(run())


async def operator_call(
    config: Config, host: Host, op: dict[str, Any], timeout: float = 120.0
) -> dict[str, Any]:
    """One CONTROL RPC to `host`'s controld as operator 0 (keys/s0)."""
    from zz.controld.rpc import RACK_SERVICE, call

    me = keys.operator_principal(0)
    ctl = keys.controld_principal(host.index)
    sec = keys.load_secret(keys.secret_path(config.rack.key_dir, RACK_SERVICE, me))
    if ctl not in sec.macs:
        raise RackError(f"operator {me} has no MAC key with controld {ctl}: regenerate keys")
    return await call(
        host.address,
        host.control_port,
        operator=me,
        controld=ctl,
        key=sec.macs[ctl],
        op=op,
        timeout=timeout,
    )


def controld_statuses(config: Config, timeout: float = 3.0) -> dict[str, dict[str, Any] | str]:
    """Every host's controld asked for its `status` at once (`zz status`): host name -> the
    reply, or why there is none (refused, timed out, a refusal, no operator key)."""

    async def one(h: Host) -> tuple[str, dict[str, Any] | str]:
        try:
            reply = await asyncio.wait_for(operator_call(config, h, {"op": "status"}, timeout),
                                           timeout + 1)  # fmt: skip
        except Exception as e:  # whatever it is, this controld did not answer
            return h.name, str(e) or type(e).__name__
        if not reply.get("ok", False):
            return h.name, f"refused: {reply.get('error', reply)}"
        return h.name, reply

    async def run() -> dict[str, dict[str, Any] | str]:
        return dict(await asyncio.gather(*(one(h) for h in config.hosts)))

    return asyncio.run(run())


def recorded(config: Config) -> tuple[bool, dict[str, Any] | None]:
    """Whether a process run/rack.json records is alive, and a summary of that file (None
    when there is none) for `zz status --json`."""
    try:
        state = load_state(config)
    except RackError as e:
        return False, {"state_file": str(state_path(config)), "error": str(e)}
    if state is None:
        return False, None
    alive = state.alive()
    return bool(alive), {
        "state_file": str(state_path(config)),
        "backend": state.backend,
        "store": state.store,
        "started_at": state.started_at,
        "complete": state.complete,
        "processes": len(state.procs),
        "alive": len(alive),
        "dead": sorted(p.name for p in state.procs if not p.alive()),
    }


def _wait_linked(config: Config, progress: Progress, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for s in config.services:
        if not s.uses_execution_replicas:
            continue
        for i in range(s.active):
            while True:
                status = s.exec_status_path(config, i)  # a guest's appears in its share
                with contextlib.suppress(OSError, ValueError):
                    if json.loads(status.read_text()).get("agreement_links_up") == s.n:
                        break
                if time.monotonic() > deadline:
                    raise RackError(f"{s.name}/exec-{i} not linked to its {s.n} agreement "
                                    f"replicas after {timeout} s (see {status})")  # fmt: skip
                time.sleep(0.1)
    progress("  active execution replicas linked to every agreement replica")


def up(
    config: Config,
    backend: str = "process",
    store: str = "dir",
    agreed: Path | None = None,
    progress: Progress = _quiet,
    timeout: float = 120.0,
    overrides: dict[str, Any] | None = None,
) -> RackState:
    """Bring the rack up; AlreadyUp if its recorded processes still run. On any failure
    everything started so far is torn down before the error goes up."""
    if backend not in BACKENDS:
        raise RackError(f"backend must be one of {', '.join(BACKENDS)}")
    if store not in STORES:
        raise RackError(f"store must be one of {', '.join(STORES)}")
    if backend == "libvirt":
        import importlib.util

        if importlib.util.find_spec("libvirt") is None:
            from zz.controld.hypervisor import LIBVIRT_HINT

            raise RackError(f"--backend libvirt needs libvirt-python: {LIBVIRT_HINT}")
    old = load_state(config)
    if old is not None:
        alive = old.alive()
        if alive:
            raise AlreadyUp(
                f"rack {config.rack.name!r} is already up ({len(alive)} of {len(old.procs)}"
                f" processes running, started {time.ctime(old.started_at)}); "
                f"`zz rack down {config.path}` first"
            )
        progress(f"a dead rack is recorded in {state_path(config)}: tearing its rest down")
        down(config, progress=progress)
    agreed = agreed or DEFAULT_AGREED
    if not agreed.exists():
        raise RackError(f"{agreed} not built: make -C agreement")
    try:
        placement.plan(config)
    except placement.PlacementError as e:
        raise RackError("placement: " + "; ".join(e.reasons)) from e
    if backend == "libvirt":
        for h in config.hosts:
            if is_loopback(h.address) and h.address != "127.0.0.1":
                raise RackError(
                    f"hosts.{h.name}.address = {h.address}: a guest reaches only the host's"
                    " 127.0.0.1 (as 10.0.2.2, QEMU user networking); give every simulated"
                    " host 127.0.0.1 and its own ports"
                )
    busy = [f"{who} ({a[0]}:{a[1]})" for who, a in _listeners(config) if _port_busy(a)]
    if busy:
        raise RackError("ports in use: " + ", ".join(busy))
    if not config.rack.key_dir.exists():
        out = keys.generate(config)
        progress(f"keys generated in {out}")
    _remove_exec_state(config)
    (config.rack.run_dir / DOWN_NAME).unlink(missing_ok=True)
    state = RackState(config.rack.name, str(config.path), backend, store, time.time())
    state.overrides = dict(overrides or {})
    _save_state(config, state)
    try:
        _up(config, state, agreed, progress, timeout)
    except BaseException:
        progress("bring-up failed: tearing down what was started")
        with contextlib.suppress(Exception):
            down(config, progress=progress)
        raise
    state.complete = True
    _save_state(config, state)
    return state


def _clear_stale_pool(name: str, vdev: Path, progress: Progress) -> None:
    """A pool of this rack's name on this rack's vdev file outlived a bring-up that died
    (the rack is not up: `up` checked): destroy it. One on another file is not ours."""
    from zz.snapshots.zfs import destroy_pool, pool_exists, pool_vdevs

    if not pool_exists(name):
        remove_file(vdev, vdev.parent)  # a vdev without its pool holds nothing
        return
    theirs = pool_vdevs(name)
    if theirs != [str(vdev)]:
        raise RackError(
            f"ZFS pool {name} exists on {', '.join(theirs) or '?'}, not on this rack's {vdev}:"
            f" another rack of this name on this machine? Rename the rack, or `zpool destroy"
            f" {name}` if nothing uses it"
        )
    progress(f"ZFS pool {name} left by an earlier bring-up that died: destroying it")
    destroy_pool(name, vdev)


def _up(config: Config, state: RackState, agreed: Path, progress: Progress, timeout: float) -> None:
    run = config.rack.run_dir
    pools: dict[str, str] = {}
    if state.store == "zfs":
        from zz.snapshots.zfs import create_file_pool, ensure_zfs_daemon

        ensure_zfs_daemon()
        for h in config.hosts:
            name = pool_name(config, h)
            vdev = run / "zfs" / f"{h.name}.img"
            vdev.parent.mkdir(parents=True, exist_ok=True)
            _clear_stale_pool(name, vdev.absolute(), progress)
            create_file_pool(name, vdev, ZFS_POOL_SIZE)
            state.pools.append({"name": name, "vdev": str(vdev)})
            _save_state(config, state)
            pools[h.name] = name
            progress(f"ZFS pool {name} on {vdev}")
    t0 = time.monotonic()
    for h in config.hosts:
        cmd = [sys.executable, "-m", "zz.controld", "--config", str(config.path)]
        # A rack on one machine is a drill ground: zz drill switches runtimes' faults.
        cmd += ["--host", h.name, "--backend", state.backend, "--drill-faults"]
        if state.backend == "libvirt":
            # A guest boots under TCG here (docs/design.md §9): tens of seconds on a busy host.
            cmd += ["--ready-timeout", "300"]
        if state.store == "zfs":
            cmd += ["--store", "zfs", "--zfs-pool", pools[h.name]]
        log = run / "controld" / f"{h.name}.log"
        _start(state, config, "controld", h.name, cmd, log, (h.address, h.control_port))
    for h in config.hosts:
        _wait_listening(state.proc(h.name), f"controld {h.name}", timeout)
    progress(f"controld on {len(config.hosts)} hosts ({state.backend} backend)"
             f" ({time.monotonic() - t0:.1f} s)")  # fmt: skip
    t0 = time.monotonic()
    for s in config.services:
        render.render_service(config, s, state.overrides)
        for r in range(s.n):
            conf = run / f"s{s.id}" / f"agreed-{r}.conf"
            log = run / f"s{s.id}" / f"agreed-{r}.log"
            addr = config.replica_address(s, r)
            _start(state, config, "agreed", f"{s.name}/agreed-{r}",
                   [str(agreed), "--conf", str(conf)], log, addr)  # fmt: skip
    for p in state.procs:
        if p.kind == "agreed":
            _wait_listening(p, p.name, timeout)
    n = sum(1 for p in state.procs if p.kind == "agreed")
    progress(f"{n} agreement replicas listening ({time.monotonic() - t0:.1f} s)")
    if any(s.uses_execution_replicas for s in config.services):
        progress("execution replicas through controld (active running, spares asleep):")
        # A guest boots in ~10 s under TCG alone, minutes on a busy 2-core host.
        _provision_all(config, state, progress, timeout if state.backend == "process" else 900)
        _wait_linked(config, progress, timeout)


# ---- down ---------------------------------------------------------------------------------
@dataclass
class DownReport:
    stopped: list[str] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)  # needed SIGKILL
    leftovers: list[int] = field(default_factory=list)  # found by command line, killed
    domains: list[str] = field(default_factory=list)
    pools: list[str] = field(default_factory=list)
    # Removals refused because the path led outside the rack's run directory.
    refused: list[str] = field(default_factory=list)
    nothing: bool = False

    @property
    def clean(self) -> bool:
        return not self.killed and not self.leftovers and not self.refused


def _stop_procs(procs: list[ProcRecord], timeout: float, report: DownReport) -> None:
    live = [p for p in procs if p.alive()]
    for p in live:
        signal_group(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in live:
        while p.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if p.alive():
            signal_group(p.pid, signal.SIGKILL)
            report.killed.append(p.name)
            while p.alive() and time.monotonic() < deadline + 5:
                time.sleep(0.05)
        else:
            report.stopped.append(p.name)
        # Anything left in the group (a replica a dead controld spawned) goes too.
        signal_group(p.pid, signal.SIGKILL)


def rack_domains(config: Config) -> list[tuple[str, str]]:
    """(uri, name) of every libvirt domain named zz-<rack>-* on the hosts' URIs; empty
    when libvirt-python is not installed or a URI does not answer."""
    try:
        import libvirt  # type: ignore[import-not-found, import-untyped]
    except ImportError:
        return []
    # libvirt prints every error to stderr by default; ours are expected (gone already).
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    prefix = f"zz-{config.rack.name}-"
    found = []
    for uri in sorted({h.libvirt_uri for h in config.hosts}):
        try:
            conn = libvirt.open(uri)
        except libvirt.libvirtError:
            continue
        try:
            found += [(uri, d.name()) for d in conn.listAllDomains() if d.name().startswith(prefix)]
        finally:
            conn.close()
    return found


def _destroy_domains(config: Config, report: DownReport) -> None:
    found = rack_domains(config)
    if not found:
        return
    import libvirt

    for uri, name in found:
        conn = libvirt.open(uri)
        try:
            dom = conn.lookupByName(name)
            with contextlib.suppress(libvirt.libvirtError):
                dom.destroy()
            with contextlib.suppress(libvirt.libvirtError):
                if dom.isPersistent():
                    dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE)
            report.domains.append(name)
        except libvirt.libvirtError:
            pass
        finally:
            conn.close()


# What a rack runs: only these are swept by command line, never e.g. a `timeout` or a
# shell that merely names the config.
_RACK_PROGRAMS = (b"zz-agreed", b"zz.execution", b"zz.controld", b"qemu-system")


def rack_leftovers(config: Config) -> list[int]:
    """Live rack processes (zz-agreed, runtimes, controlds, QEMU) naming this rack's
    config or run directory."""
    out = []
    for pid in leftover_pids([str(config.path), f"{config.rack.run_dir}/"]):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if any(m in cmd for m in _RACK_PROGRAMS):
            out.append(pid)
    return out


def _remove_exec_state(config: Config, report: DownReport | None = None) -> None:
    """Execution replicas' state directories (and convicted ones' forensic copies), and
    the agreement replicas' view of them (awake, sleeping, convicted: agreed-<r>.exec-view):
    the agreement replicas keep no log across a restart, so a new rack starts from seq 0
    with its planned roles and must not meet a replica that remembers a later state. Logs
    and status files stay. Nothing outside run_dir is touched (a symlink leading out is
    refused: RackError, or listed in `report.refused` when there is a report)."""
    run = config.rack.run_dir
    todo: list[tuple[Callable[[Path, Path], None], Path]] = []
    for s in config.services:
        base = run / f"s{s.id}"
        for r in range(s.n):
            todo.append((remove_file, base / f"agreed-{r}.exec-view"))
        for i in range(s.n_exec):
            for d in base.glob(f"exec-{i}") if base.exists() else []:
                todo.append((remove_tree, d))
            for d in base.glob(f"exec-{i}.forensic-*") if base.exists() else []:
                todo.append((remove_tree, d))
    _remove_each(todo, run, report)


def down(config: Config, progress: Progress = _quiet, timeout: float = 15.0) -> DownReport:
    """Stop every recorded process (controlds first: they destroy their replicas), then
    agreement replicas, then whatever still names this rack's config or run directory;
    destroy leftover zz-<rack>-* domains and the rack's pools; remove run/rack.json and
    controld's replica/save directories. Logs and stats stay in run_dir."""
    report = DownReport()
    state = load_state(config)
    if state is None:
        report.nothing = True
    else:
        ctl = [p for p in state.procs if p.kind == "controld"]
        rest = [p for p in state.procs if p.kind != "controld"]
        # controld's SIGTERM path destroys its replicas (process backend: terminate, 10 s
        # grace each), so it gets longer than a replica.
        _stop_procs(ctl, timeout + 15, report)
        _stop_procs(rest, timeout, report)
    run = config.rack.run_dir
    # Domains before the sweep: a guest's QEMU names the run dir (its console socket), and
    # libvirt should destroy it rather than find it killed under its feet.
    _destroy_domains(config, report)
    pids = rack_leftovers(config)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    report.leftovers = pids
    pools = list(state.pools) if state else []
    if pools:
        from zz.snapshots.zfs import destroy_pool, pool_exists

        # The state file is data: only this rack's pool names on vdevs in run/zfs count.
        ours = {pool_name(config, h) for h in config.hosts}
        for p in pools:
            vdev = Path(str(p.get("vdev", "")))
            if p.get("name") not in ours or contained(vdev, run / "zfs") is None:
                report.refused.append(f"recorded pool {p.get('name')!r} on {vdev}: not this rack's")
                continue
            if pool_exists(p["name"]):
                destroy_pool(p["name"])
                report.pools.append(p["name"])
            _remove_each([(remove_file, vdev)], run, report)
    _remove_exec_state(config, report)
    todo: list[tuple[Callable[[Path, Path], None], Path]] = []
    for h in config.hosts:
        home = run / "controld" / h.name
        todo += [(remove_tree, home / sub) for sub in ("replicas", "saves")]
        # The inventory describes replicas that no longer exist: a new controld must not
        # report them as lost.
        todo += [
            (remove_file, home / n) for n in ("inventory.json", "ledger.json", "freshness.json")
        ]
    todo.append((remove_file, state_path(config)))
    _remove_each(todo, run, report)
    if run.is_dir():
        write_atomic(run / DOWN_NAME, f"{time.time():.3f}\n")
    for why in report.refused:
        progress(f"rack {config.rack.name!r}: {why}")
    if report.nothing and not (report.leftovers or report.domains):
        progress(f"rack {config.rack.name!r}: nothing running (no {state_path(config)})")
    else:
        progress(
            f"rack {config.rack.name!r} down: {len(report.stopped)} stopped,"
            f" {len(report.killed)} killed, {len(report.leftovers)} leftovers,"
            f" {len(report.domains)} domains, {len(report.pools)} pools destroyed"
        )
    return report


def format_state(state: RackState) -> str:
    lines = [f"rack {state.rack} ({state.backend} backend, {state.store} store)"]
    for p in state.procs:
        where = f"{p.address}:{p.port}"
        lines.append(f"  {p.kind:9} {p.name:18} {where:21} pid {p.pid}")
    for r in state.replicas:
        where = f"{r.address}:{r.port}"
        lines.append(f"  {'exec':9} {r.service + '/exec-' + str(r.index):18} {where:21}"
                     f" {r.mode} on {r.host} ({r.domain})")  # fmt: skip
    return "\n".join(lines)
