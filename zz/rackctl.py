# zz/rackctl.py - `zz rack up` / `zz rack down`: bring a planned rack up (controld per host,
# agreement and execution replicas through each host's controld) and tear it down.
"""Rack bring-up and tear-down (docs/operations.md).

    state = up(load("rack.toml"))        # keys, render, controlds, agreement, replicas
    down(load("rack.toml"))              # from any shell: everything in run/rack.json

Order of `up` (each step recorded in ``run/rack.json`` before the next, so that a `down`
after a failed or interrupted `up` still finds everything):

1. keys (``zz keys``) when the key directory does not exist yet;
2. the placement check (``zz rack plan``) and a port check: every listener must be free;
3. ZFS (``--store zfs``): one file-backed pool per host, ``zz<rack>h<i>``;
4. one controld per host (``python -m zz.controld``), process or libvirt backend, started
   here; with ``rack.controlds = "hosts"`` none: each runs on its host under its own
   supervisor and must answer (docs/config.md, docs/operations.md "Four real hosts");
5. every agreement replica *through its host's controld* (CONTROL ``agreed_start``: it
   renders the replica file and starts ``zz-agreed``);
6. every execution replica *through its host's controld* (CONTROL ``provision``): the
   active ones running, the spares paused or hibernated as the service says; controld
   then owns them, so a WAKEUP or SHUTDOWN certificate finds them in its inventory;
7. wait until every active execution replica is linked to all agreement replicas.

What runs on a host is known from its controld (``agreed_list``, ``list``, ``status``);
the only processes this module starts and signals itself are the controlds, identified by
pid *and* kernel start time (``/proc/<pid>/stat`` field 22), so a recycled pid is never
signalled, and with ``rack.controlds = "hosts"`` not even those: no process of this machine
is started, signalled or swept for the rack, no host's file read or removed (``down`` has
each controld clear its host: op ``reset``). A controld that does not answer is named in
the error or report.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zz import keys, placement
from zz.atomicfile import write_atomic
from zz.config import Config, ConfigError, Host, Service, is_loopback
from zz.naming import domain_name
from zz.procrack import (
    DEFAULT_AGREED,
    leftover_pids,
    repo_env,
    signal_group,
    spawn,
    start_ticks,
)

STATE_NAME = "rack.json"
# Written by `down` (the time it finished): a replica's stats file older than that is from
# the rack that went down, not a sign of one running (zz status).
DOWN_NAME = "rack.down"
BACKENDS = ("process", "libvirt")
STORES = ("dir", "zfs")
# `zz rack up --store`: auto (the default) is zfs wherever zpool answers, else dir with the
# reason (choose_store).
STORE_CHOICES = ("auto", *STORES)
ZFS_POOL_SIZE = 256 << 20  # zfs-fuse refuses vdevs under 64 MiB; sparse file

Progress = Callable[[str], None]


class RackError(Exception):
    """The rack cannot be brought up or down; the message says why and what to do."""


class AlreadyUp(RackError):
    pass


# ---- the checkpoint store ------------------------------------------------------------------
def choose_store(requested: str) -> tuple[str, str]:
    """The store a rack gets and why: `dir` and `zfs` as asked; `auto` is zfs when the
    zpool/zfs commands answer (zfs-fuse started if none runs, as root), else dir, with
    what failed. ZFS checkpoints are snapshots (O(1)); the directory store copies the whole
    state at every checkpoint (docs/checkpoints.md)."""
    if requested not in STORE_CHOICES:
        raise RackError(f"store must be one of {', '.join(STORE_CHOICES)}, not {requested!r}")
    if requested != "auto":
        return requested, f"--store {requested} given"
    from zz.snapshots import StorageError
    from zz.snapshots.zfs import ZfsMissingError, ensure_zfs_daemon, run_zfs

    try:
        run_zfs(["zpool", "list", "-H"])
        return "zfs", "zpool answers: checkpoints are ZFS snapshots"
    except ZfsMissingError as e:
        return "dir", f"fallback, ZFS is not usable here: {e}"
    except StorageError as e:
        if os.geteuid() != 0:
            return "dir", (f"fallback, ZFS is not usable here: `zpool list` fails ({e}) and"
                           " only root may start zfs-fuse")  # fmt: skip
    try:
        ensure_zfs_daemon()
    except StorageError as e:
        return "dir", f"fallback, ZFS is not usable here: {e}"
    return "zfs", "zfs-fuse started: checkpoints are ZFS snapshots"


def _quiet(_: str) -> None:
    pass


# ---- processes ----------------------------------------------------------------------------
@dataclass
class ProcRecord:
    """A process of the rack: a controld `up` started here (enough for another shell to
    find and stop it), or an agreement replica as its host's controld reported it when it
    started it (`host`; its liveness is its controld's to say: agreed_list)."""

    kind: str  # controld, agreed
    name: str  # h0 / web/agreed-0
    pid: int
    ticks: int  # kernel start time: pid + ticks is the process's identity
    log: str
    address: str = ""
    port: int = 0
    host: str = ""  # agreed: the host whose controld runs it

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
    store_reason: str = ""  # why this store (choose_store)
    # `zz rack stop`: when, and the highest seq each service had reached (what `start`
    # must continue from); None while the rack runs.
    stopped_at: float | None = None
    stopped_seq: dict[str, int] = field(default_factory=dict)
    # What `up`/`start` restarted in a rack with dead members, oldest first.
    repairs: list[dict[str, Any]] = field(default_factory=list)

    def proc(self, name: str) -> ProcRecord:
        for p in self.procs:
            if p.name == name:
                return p
        raise KeyError(name)

    def alive(self) -> list[ProcRecord]:
        """The controlds `up` started on this machine that still run (the agreement
        replicas are their controlds' to report: agreed_states)."""
        return [p for p in self.procs if p.kind == "controld" and p.alive()]

    def agreed(self) -> list[ProcRecord]:
        return [p for p in self.procs if p.kind == "agreed"]

    def record(self, rec: ProcRecord) -> None:
        """Add `rec`, replacing a record of the same name."""
        self.procs = [p for p in self.procs if p.name != rec.name] + [rec]

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
            store_reason=str(d.get("store_reason", "")),
            stopped_at=d.get("stopped_at"),
            stopped_seq={str(k): int(v) for k, v in d.get("stopped_seq", {}).items()},
            repairs=list(d.get("repairs", [])),
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
    """Run every removal; one refused (outside `root`) is reported and the rest still run.
    What existed and went is listed in `report.deleted`."""
    for remove, path in removals:
        existed = os.path.lexists(path)
        try:
            remove(path, root)
        except RackError as e:
            if report is None:
                raise
            report.refused.append(str(e))
            continue
        if existed and report is not None:
            report.deleted.append(str(path))


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


async def call_ok(
    config: Config, host: Host, op: dict[str, Any], timeout: float = 120.0
) -> dict[str, Any]:
    """operator_call that succeeds or raises RackError naming the host: one that does not
    answer (`controld h2 does not answer: agreed_list: cannot connect ...`) or refuses."""
    from zz.controld.rpc import RpcError

    try:
        reply = await operator_call(config, host, op, timeout)
    except RpcError as e:
        raise RackError(f"controld {host.name} does not answer: {op.get('op')}: {e}") from e
    if not reply.get("ok"):
        what = " ".join(f"{k}={v}" for k, v in op.items() if k != "overrides")
        raise RackError(f"controld {host.name}: {what}: {reply.get('error', reply)}")
    return reply


def ask_controlds(
    config: Config, op: dict[str, Any], hosts: list[str] | None = None, timeout: float = 10.0
) -> dict[str, dict[str, Any] | str]:
    """`op` to every host's controld (or those named) at once: host name -> the final
    reply, or why there is none (refused, timed out, a refusal, no operator key)."""

    async def one(h: Host) -> tuple[str, dict[str, Any] | str]:
        try:
            reply = await asyncio.wait_for(operator_call(config, h, op, timeout), timeout + 1)
        except Exception as e:  # whatever it is, this controld did not answer
            return h.name, str(e) or type(e).__name__
        if not reply.get("ok", False):
            return h.name, f"refused: {reply.get('error', reply)}"
        return h.name, reply

    async def run() -> dict[str, dict[str, Any] | str]:
        todo = [h for h in config.hosts if hosts is None or h.name in hosts]
        return dict(await asyncio.gather(*(one(h) for h in todo)))

    return asyncio.run(run())


def controld_statuses(config: Config, timeout: float = 3.0) -> dict[str, dict[str, Any] | str]:
    """Every host's controld asked for its `status` at once (`zz status`): host name -> the
    reply (its agreement replicas in `agreed`), or why there is none."""
    return ask_controlds(config, {"op": "status"}, timeout=timeout)


def agreed_entries(answers: dict[str, dict[str, Any] | str]) -> dict[str, dict[str, Any]]:
    """Agreement replica name -> its entry in its controld's answer (`agreed_list`, or the
    `agreed` of `status`: state, pid, stats, ...)."""
    out: dict[str, dict[str, Any]] = {}
    for answer in answers.values():
        if isinstance(answer, dict):
            for e in answer.get("agreed", []):
                if isinstance(e, dict) and isinstance(e.get("name"), str):
                    out[e["name"]] = e
    return out


def agreed_states(
    config: Config, timeout: float = 10.0
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Every agreement replica as its host's controld reports it (`agreed_list`): name ->
    entry; and host -> why its controld did not answer."""
    answers = ask_controlds(config, {"op": "agreed_list"}, timeout=timeout)
    silent = {h: a for h, a in answers.items() if isinstance(a, str)}
    return agreed_entries(answers), silent


def _silent_error(silent: dict[str, str], what: str) -> RackError:
    hosts = "; ".join(f"controld {h} does not answer ({why})" for h, why in sorted(silent.items()))
    return RackError(f"{hosts}: {what}")


def recorded(
    config: Config, controlds: dict[str, dict[str, Any] | str] | None = None
) -> tuple[bool, dict[str, Any] | None]:
    """Whether a process run/rack.json records is alive (a controld started here, or an
    agreement replica its controld reports running in `controlds`, answers carrying
    `agreed` as controld_statuses' do; None: the running controlds are asked), and a
    summary of that file (None when there is none) for `zz status --json`: `dead` names
    what is confirmed not running, `unknown` the agreement replicas whose controld did
    not answer."""
    try:
        state = load_state(config)
    except RackError as e:
        return False, {"state_file": str(state_path(config)), "error": str(e)}
    if state is None:
        return False, None
    if controlds is None:  # ask the running controlds for their agreement replicas
        live = controld_hosts(config, state)
        controlds = ask_controlds(config, {"op": "agreed_list"}, live, 3.0) if live else {}
    answers = controlds
    entries = agreed_entries(answers)
    alive = [p.name for p in state.alive()]
    dead = [p.name for p in state.procs if p.kind == "controld" and p.name not in alive]
    unknown = []
    for p in state.agreed():
        host = _agreed_host(config, p)
        if host is None or not isinstance(answers.get(host.name), dict):
            unknown.append(p.name)
        elif entries.get(p.name, {}).get("state") == "running":
            alive.append(p.name)
        else:
            dead.append(p.name)
    return bool(alive), {
        "state_file": str(state_path(config)),
        "backend": state.backend,
        "store": state.store,
        "started_at": state.started_at,
        "complete": state.complete,
        "stopped_at": state.stopped_at,
        "processes": len(state.procs),
        "alive": len(alive),
        "dead": sorted(dead),
        "unknown": sorted(unknown),
    }


def _agreed_host(config: Config, p: ProcRecord) -> Host | None:
    """The host of a recorded agreement replica (its record's, else its placement's)."""
    for h in config.hosts:
        if h.name == p.host:
            return h
    svc, _, r = p.name.partition("/agreed-")
    with contextlib.suppress(KeyError, ValueError, ConfigError):
        return config.replica_host(config.service(svc), int(r))
    return None


def _wait_linked(config: Config, progress: Progress, timeout: float) -> None:
    """Until every active execution replica's runtime says it is linked to all agreement
    replicas of its service, as its host's controld reads its status file (`exec_status`;
    a guest's is in its share). The active ones are those their controlds hold active
    (`list`): after convictions not the first `active` indexes (a woken spare is active, a
    convicted replica's successor a spare); the first `active` of a host whose controld
    does not answer."""
    deadline = time.monotonic() + timeout
    held: dict[tuple[str, int], str] = {}
    for answer in ask_controlds(config, {"op": "list"}, timeout=10.0).values():
        if isinstance(answer, dict):
            for rec in answer.get("replicas", []):
                held[(str(rec.get("service")), int(rec.get("index", -1)))] = str(rec.get("state"))
    pending = {
        (s.name, i): s
        for s in config.services
        if s.uses_execution_replicas
        for i in range(s.n_exec)
        if (held[(s.name, i)] in ("active", "recovering") if (s.name, i) in held else i < s.active)
    }
    while pending:
        hosts = sorted({s.exec_host(config, i).name for (_, i), s in pending.items()})
        answers = ask_controlds(config, {"op": "exec_status"}, hosts, 5.0)
        runtimes = runtimes_of(answers)
        for (name, i), s in list(pending.items()):
            st = runtimes.get((name, i), {}).get("status")
            if isinstance(st, dict) and st.get("agreement_links_up") == s.n:
                del pending[(name, i)]
        if not pending:
            break
        if time.monotonic() > deadline:
            (name, i), s = next(iter(pending.items()))
            host = s.exec_host(config, i).name
            why = answers.get(host)
            if isinstance(why, str):
                seen = f"controld {host} does not answer: {why}"
            else:
                seen = f"see {s.exec_status_path(config, i)} on {host}"
            raise RackError(f"{name}/exec-{i} not linked to its {s.n} agreement replicas"
                            f" after {timeout} s ({seen})")  # fmt: skip
        time.sleep(0.2)
    progress("  active execution replicas linked to every agreement replica")


def up(
    config: Config,
    backend: str | None = "process",
    store: str | None = "dir",
    agreed: Path | None = None,
    progress: Progress = _quiet,
    timeout: float = 120.0,
    overrides: dict[str, Any] | None = None,
) -> RackState:
    """Bring the rack up. A rack already recorded: one whose processes all run and whose
    execution replicas are all where their controlds say is left alone (AlreadyUp); one
    with dead members is repaired (`repair`), or the error says why it cannot be; a stopped
    one is refused (`start` brings it back); one whose processes are all dead is torn down
    (forensic states kept) and brought up anew. `store` is dir, zfs or auto
    (choose_store). On any failure everything started so far is torn down before the
    error goes up.

    With rack.controlds = "hosts" the controlds run on their hosts already (started there,
    docs/operations.md "Four real hosts"): `up` starts none, takes the backend and store
    they run with (`backend`/`store` None, or the same), makes no keys (the operator's
    come from `zz keys --operator`), checks no port here and has each controld clear what
    an earlier rack left on its host (op `reset`) instead of removing it here."""
    hosts = on_hosts(config)
    if backend is None and not hosts:
        backend = "process"
    if store is None and not hosts:
        store = "dir"
    if backend is not None and backend not in BACKENDS:
        raise RackError(f"backend must be one of {', '.join(BACKENDS)}")
    if store is not None and store not in STORE_CHOICES:
        raise RackError(f"store must be one of {', '.join(STORE_CHOICES)}")
    if backend == "libvirt" and not hosts:
        _need_libvirt()
    agreed = agreed or DEFAULT_AGREED
    old = load_state(config)
    if old is not None:
        if old.alive() or (hosts and old.stopped_at is None):
            return repair(config, old, agreed, progress, timeout, by="up")
        if old.stopped_at is not None:
            raise RackError(
                f"rack {config.rack.name!r} was stopped at {time.ctime(old.stopped_at)} with"
                f" its state kept: `zz rack start {config.path}` brings it back; `zz rack down"
                f" {config.path}` discards it (forensic states are kept) before a new `up`"
            )
        progress(f"a dead rack is recorded in {state_path(config)}: tearing its rest down"
                 " (its execution state goes, forensic states stay)")  # fmt: skip
        down(config, progress=progress)
    if not hosts and not agreed.exists():
        raise RackError(f"{agreed} not built: make -C agreement")
    try:
        placement.plan(config)
    except placement.PlacementError as e:
        raise RackError("placement: " + "; ".join(e.reasons)) from e
    if hosts:
        return _up_on_hosts(config, backend, store, agreed, progress, timeout, overrides)
    assert backend is not None and store is not None
    if backend == "libvirt":
        for h in config.hosts:
            if is_loopback(h.address) and h.address != "127.0.0.1":
                raise RackError(
                    f"hosts.{h.name}.address = {h.address}: a guest reaches only the host's"
                    " 127.0.0.1 (as 10.0.2.2, QEMU user networking); give every simulated"
                    " host 127.0.0.1 and its own ports"
                )
    _check_ports(config)
    store, why = choose_store(store)
    progress(f"checkpoint store: {store} ({why})")
    if not config.rack.key_dir.exists():
        out = keys.generate(config)
        progress(f"keys generated in {out}")
    _remove_exec_state(config)
    return _record_and_bring_up(config, backend, store, why, overrides, agreed, progress, timeout)


def _record_and_bring_up(
    config: Config,
    backend: str,
    store: str,
    why: str,
    overrides: dict[str, Any] | None,
    agreed: Path,
    progress: Progress,
    timeout: float,
) -> RackState:
    """The rack recorded as coming up (rack.json), then brought up (_up); torn down again
    if that fails, recorded complete if not."""
    (config.rack.run_dir / DOWN_NAME).unlink(missing_ok=True)
    state = RackState(config.rack.name, str(config.path), backend, store, time.time())
    state.store_reason = why
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


def on_hosts(config: Config) -> bool:
    """rack.controlds = "hosts": every controld runs on its host, started there; `zz`
    never starts, signals or sweeps a process of this machine for the rack, and reads none
    of the hosts' files (docs/config.md)."""
    return config.rack.controlds == "hosts"


HOSTS_HINT = (
    'rack.controlds = "hosts": each host\'s controld is started on its host'
    " (systemctl start zz-controld@NAME; docs/operations.md \"Four real hosts\")"
)


def _need_operator_key(config: Config) -> None:
    path = keys.secret_path(config.rack.key_dir, keys.RACK_SERVICE, keys.operator_principal(0))
    if not path.exists():
        raise RackError(
            f"no operator key {path}: with rack.controlds = \"hosts\" the operator's keys are"
            f" made on this machine by `zz keys {config.path} --operator` and the hosts' bundle"
            " installed with `zz keys --install` (docs/operations.md \"Four real hosts\");"
            " `zz rack up` makes keys only for a rack on one machine"
        )


def _controlds_on_hosts(
    config: Config, backend: str | None, store: str | None, timeout: float
) -> tuple[str, str, str]:
    """Every host's controld, which must answer: (backend, store, why) as they run them
    (`backend`/`store` None or "auto": whatever that is; else it must be that)."""
    answers = ask_controlds(config, {"op": "status"}, timeout=timeout)
    silent = {h: a for h, a in answers.items() if isinstance(a, str)}
    if silent:
        raise _silent_error(silent, HOSTS_HINT)
    got: dict[str, dict[str, Any]] = {h: a for h, a in answers.items() if isinstance(a, dict)}
    out = []
    for what, asked, field_ in (("backend", backend, "backend"), ("store", store, "store")):
        seen = {h: str(a.get(field_)) for h, a in sorted(got.items())}
        if len(set(seen.values())) != 1:
            each = ", ".join(f"{h} {v}" for h, v in seen.items())
            raise RackError(f"the hosts' controlds run different {what}s ({each}): start each"
                            f" with the same --{what} (zz host init)")  # fmt: skip
        value = next(iter(seen.values()))
        if asked not in (None, "auto", value):
            raise RackError(f"--{what} {asked}: the hosts' controlds run with --{what} {value}"
                            f" ({HOSTS_HINT}, with its own --{what}; zz host init)")  # fmt: skip
        out.append(value)
    pools = sorted({str(a.get("zfs_pool")) for a in got.values() if a.get("zfs_pool")})
    why = "the hosts' controlds run with it" + (f" (pools {', '.join(pools)})" if pools else "")
    return out[0], out[1], why


def _reset_hosts(config: Config, purge: bool, timeout: float) -> dict[str, dict[str, Any] | str]:
    """Every host's controld clears the rack's state on its host (op `reset`): stops its
    agreement replicas, destroys its domains, forgets its records, deletes the execution
    and agreement replicas' state (forensic states only with `purge`)."""
    op = {"op": "reset", "purge_forensics": purge}
    return ask_controlds(config, op, timeout=timeout + 150)


def _up_on_hosts(
    config: Config,
    backend: str | None,
    store: str | None,
    agreed: Path,
    progress: Progress,
    timeout: float,
    overrides: dict[str, Any] | None,
) -> RackState:
    """`up` against controlds running on their hosts (rack.controlds = "hosts")."""
    _need_operator_key(config)
    backend, store, why = _controlds_on_hosts(config, backend, store, 10.0)
    progress(f"checkpoint store: {store} ({why})")
    answers = _reset_hosts(config, False, timeout)
    silent = {h: a for h, a in answers.items() if isinstance(a, str)}
    if silent:
        raise _silent_error(silent, "cannot clear what an earlier rack left there")
    for h, a in sorted(answers.items()):
        assert isinstance(a, dict)
        left = len(a.get("stopped", [])) + len(a.get("destroyed", [])) + len(a.get("deleted", []))
        if left:
            progress(f"controld {h}: cleared what an earlier rack left ({left} processes,"
                     " domains, paths and datasets)")  # fmt: skip
    return _record_and_bring_up(config, backend, store, why, overrides, agreed, progress, timeout)


def _need_libvirt() -> None:
    import importlib.util

    if importlib.util.find_spec("libvirt") is None:
        from zz.controld.hypervisor import LIBVIRT_HINT

        raise RackError(f"--backend libvirt needs libvirt-python: {LIBVIRT_HINT}")


def _check_ports(config: Config, only: set[str] | None = None) -> None:
    """Every listener of the rack (or those named in `only`) must be free."""
    busy = [f"{who} ({a[0]}:{a[1]})" for who, a in _listeners(config)
            if (only is None or who in only) and _port_busy(a)]  # fmt: skip
    if busy:
        raise RackError("ports in use: " + ", ".join(busy))


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
    if state.store == "zfs" and not on_hosts(config):
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
            progress(f"ZFS pool {name} on {vdev}")
    _start_controlds(config, state, [h.name for h in config.hosts], progress, timeout, agreed)
    names = [f"{s.name}/agreed-{r}" for s in config.services for r in range(s.n)]
    _start_agreed(config, state, names, progress, timeout)
    if any(s.uses_execution_replicas for s in config.services):
        progress("execution replicas through controld (active running, spares asleep):")
        # A guest boots in ~10 s under TCG alone, minutes on a busy 2-core host.
        _provision_all(config, state, progress, _provision_timeout(state, timeout))
        _wait_linked(config, progress, timeout)


def _provision_timeout(state: RackState, timeout: float) -> float:
    return timeout if state.backend == "process" else 900.0


def _start_controlds(
    config: Config,
    state: RackState,
    hosts: list[str],
    progress: Progress,
    timeout: float,
    agreed: Path,
) -> None:
    """A controld for each host named (its home, inventory, audit log and agreement
    replica records are kept in run/controld/<host>/ from any earlier run), recorded in
    `state`; `agreed` is the zz-agreed binary it starts its agreement replicas with.
    With rack.controlds = "hosts" none is started: each must answer, running the rack's
    backend and store (RackError naming those that do not)."""
    t0 = time.monotonic()
    if on_hosts(config):
        backend, store, _ = _controlds_on_hosts(config, state.backend, state.store, 10.0)
        progress(f"controld on {len(hosts)} hosts ({backend} backend, {store} store):"
                 f" running on their hosts ({time.monotonic() - t0:.1f} s)")  # fmt: skip
        return
    pools = {h["name"] for h in state.pools}
    for h in config.hosts:
        if h.name not in hosts:
            continue
        cmd = [sys.executable, "-m", "zz.controld", "--config", str(config.path)]
        # A rack on one machine is a drill ground: zz drill switches runtimes' faults.
        cmd += ["--host", h.name, "--backend", state.backend, "--drill-faults"]
        cmd += ["--agreed", str(agreed)]
        if state.backend == "libvirt":
            # A guest boots under TCG here (docs/design.md §9): tens of seconds on a busy host.
            cmd += ["--ready-timeout", "300"]
        if state.store == "zfs":
            pool = pool_name(config, h)
            if pool not in pools:
                raise RackError(f"rack.json records no ZFS pool {pool} for host {h.name}")
            cmd += ["--store", "zfs", "--zfs-pool", pool]
        log = config.rack.run_dir / "controld" / f"{h.name}.log"
        _start(state, config, "controld", h.name, cmd, log, (h.address, h.control_port))
    for h in config.hosts:
        if h.name in hosts:
            _wait_listening(state.proc(h.name), f"controld {h.name}", timeout)
    progress(f"controld on {len(hosts)} hosts ({state.backend} backend)"
             f" ({time.monotonic() - t0:.1f} s)")  # fmt: skip


def _start_agreed(
    config: Config,
    state: RackState,
    names: list[str],
    progress: Progress,
    timeout: float,
) -> None:
    """Each agreement replica named (`<service>/agreed-<r>`) through its host's controld
    (`agreed_start`: it renders the replica file with the rack's --set values, starts
    zz-agreed and waits until it listens), hosts in parallel; recorded in `state` with the
    pid its controld reports."""
    t0 = time.monotonic()
    jobs: dict[int, list[tuple[Service, int]]] = {}
    for s in config.services:
        for r in range(s.n):
            if f"{s.name}/agreed-{r}" in names:
                jobs.setdefault(config.replica_host(s, r).index, []).append((s, r))

    async def host_jobs(h: Host, todo: list[tuple[Service, int]]) -> list[ProcRecord]:
        done = []
        for s, r in todo:
            op = {"op": "agreed_start", "service": s.name, "replica": r,
                  "overrides": state.overrides, "wait_s": timeout}  # fmt: skip
            rec = (await call_ok(config, h, op, timeout + 10))["agreed"]
            log = config.rack.run_dir / f"s{s.id}" / f"agreed-{r}.log"
            addr = config.replica_address(s, r)
            done.append(ProcRecord("agreed", f"{s.name}/agreed-{r}", int(rec["pid"]),
                                   int(rec["ticks"]), str(log), *addr, host=h.name))  # fmt: skip
        return done

    async def run() -> None:
        results = await asyncio.gather(
            *(host_jobs(config.hosts[h], todo) for h, todo in sorted(jobs.items())),
            return_exceptions=True,
        )
        errors = []
        for res in results:
            if isinstance(res, BaseException):
                errors.append(res)
                continue
            for rec in res:
                state.record(rec)
        _save_state(config, state)
        if errors:
            raise errors[0]

    asyncio.run(run())
    n = sum(len(t) for t in jobs.values())
    progress(f"{n} agreement replicas listening ({time.monotonic() - t0:.1f} s)")


# ---- dead members: repair, stop, start -------------------------------------------------------
def agreed_data_dir(config: Config, service: Service, r: int) -> Path:
    """Where agreement replica `r` of `service` keeps its state on disk (its write-ahead
    log: view, stable checkpoint, log slots; docs/agreement.md "Durable state"):
    run/s<id>/agreed-<r>.data/, the `data_dir` zz rack render gives it when the rack's
    `durability` is not "off". `start` continues a stopped rack's sequence numbers only
    when every agreement replica of a service has one."""
    return config.rack.run_dir / f"s{service.id}" / f"agreed-{r}.data"


def agreement_on_disk(
    config: Config, service: Service, entries: dict[str, dict[str, Any]] | None = None
) -> str | None:
    """None when every agreement replica of `service` has its state on disk
    (agreed_data_dir, not empty: `on_disk` in `entries`, its controld's agreed_list; without
    entries the directories are looked at here), else which have none."""
    missing = []
    for r in range(service.n):
        if entries is not None:
            if not entries.get(f"{service.name}/agreed-{r}", {}).get("on_disk"):
                missing.append(r)
            continue
        d = agreed_data_dir(config, service, r)
        if not (d.is_dir() and any(d.iterdir())):
            missing.append(r)
    if not missing:
        return None
    why = (
        'rack.durability is "off": zz-agreed keeps its log, view and checkpoints in memory only'
        if config.rack.durability == "off"
        else f'rack.durability is "{config.rack.durability}", but the rack ran without it'
    )
    where = agreed_data_dir(config, service, missing[0])
    return (f"agreement replica{'s' if len(missing) > 1 else ''}"
            f" {', '.join(map(str, missing))} of {service.name} keep no state on disk"
            f" ({where} is missing or empty; {why})")  # fmt: skip


def reached_seq(
    config: Config,
    service: Service,
    agreed_stats: list[dict[str, Any] | None] | None = None,
    runtimes: dict[tuple[str, int], dict[str, Any]] | None = None,
) -> int:
    """The highest sequence number the service is known to have reached, from what its
    replicas left: the agreement replicas' stats (last_exec), the execution replicas'
    status files (last_executed) and their newest checkpoint manifests (ckpt-<n>). As
    their controlds returned them (`agreed_stats`, `runtimes`: exec_status entries), else
    read from the run directory here (tests, and a rack with no controld to ask)."""
    from zz import status as st

    best = 0
    if agreed_stats is None:
        agreed_stats = list(st.agreement_stats(config, service, float("inf")))
    for s in agreed_stats:
        if s:
            best = max(best, int(s.get("last_exec", 0)))
    if not service.uses_execution_replicas:
        return best
    for i in range(service.n_exec):
        if runtimes is not None:
            e = runtimes.get((service.name, i), {})
            status = e.get("status") if isinstance(e.get("status"), dict) else {}
            with contextlib.suppress(ValueError, TypeError):
                best = max(best, int(status.get("last_executed", 0)), int(e.get("checkpoint") or 0))
            continue
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            data = json.loads(service.exec_status_path(config, i).read_text())
            best = max(best, int(data.get("last_executed", 0)))
        state = service.exec_state_dir(config, i)
        for m in state.glob("manifests/ckpt-*.manifest") if state.is_dir() else []:
            n = m.name.removeprefix("ckpt-").removesuffix(".manifest")
            if n.isdigit():
                best = max(best, int(n))
    return best


def runtimes_of(answers: dict[str, dict[str, Any] | str]) -> dict[tuple[str, int], dict[str, Any]]:
    """(service, index) -> its entry in its controld's `exec_status` (or `status`) answer."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for answer in answers.values():
        if isinstance(answer, dict):
            for e in answer.get("runtimes", []):
                if isinstance(e, dict) and isinstance(e.get("index"), int):
                    out[(str(e.get("service")), e["index"])] = e
    return out


def start_blockers(
    config: Config,
    state: RackState,
    entries: dict[str, dict[str, Any]] | None = None,
    runtimes: dict[tuple[str, int], dict[str, Any]] | None = None,
) -> list[str]:
    """Why the recorded rack cannot be started again with the sequence numbers it had
    (empty: it can): a service that ordered anything needs its agreement replicas' state
    on disk, else a restarted cluster would order from seq 1 again, under execution
    replicas (and clients) that remember later ones. `entries` and `runtimes` are what the
    controlds report (agreed_list, exec_status); without them the run directory is read."""
    out = []
    for s in config.services:
        stats = None
        if entries is not None:
            stats = [entries.get(f"{s.name}/agreed-{r}", {}).get("stats") for r in range(s.n)]
        seq = max(state.stopped_seq.get(s.name, 0), reached_seq(config, s, stats, runtimes))
        if seq == 0:
            continue  # nothing ordered yet: a cluster from seq 0 continues it exactly
        why = agreement_on_disk(config, s, entries)
        if why is not None:
            out.append(f"{s.name} reached seq {seq}, but {why}")
    return out


def repair(
    config: Config,
    state: RackState,
    agreed: Path,
    progress: Progress = _quiet,
    timeout: float = 120.0,
    by: str = "up",
) -> RackState:
    """A recorded rack with some processes alive: restart its dead controlds and agreement
    replicas and re-provision every execution replica its controld does not hold as the
    hypervisor shows it. AlreadyUp when nothing is dead; RackError naming the members when
    a repair would be unsafe (more than g agreement replicas of a service dead, without
    their state on disk) or impossible (their ports taken). Recorded in state.repairs."""
    if state.stopped_at is not None:
        raise RackError(
            f"rack {config.rack.name!r} is recorded as stopped at {time.ctime(state.stopped_at)}"
            f" but {len(state.alive())} of its processes run: `zz rack down {config.path}`"
        )
    if state.backend == "libvirt" and not on_hosts(config):
        _need_libvirt()
    restarted: list[str] = []

    def failed(e: BaseException) -> None:
        # What was started runs and is recorded; the rest is as it was.
        state.repairs.append({"at": time.time(), "by": by, "restarted": restarted,
                              "failed": str(e) or type(e).__name__})  # fmt: skip
        _save_state(config, state)
        progress(f"repair failed: what it restarted runs and is recorded in"
                 f" {state_path(config)}, the rest is as it was; `zz status {config.path}`"
                 " shows what is missing")  # fmt: skip

    # Dead controlds first: only a host's controld can say what runs there.
    dead_ctl = [p for p in state.procs if p.kind == "controld" and not p.alive()]
    if dead_ctl:
        if not agreed.exists():
            raise RackError(f"{agreed} not built: make -C agreement")
        _check_ports(config, {f"controld {p.name}" for p in dead_ctl})
        for p in dead_ctl:
            state.procs.remove(p)
            restarted.append(f"controld {p.name} (pid {p.pid} dead)")
        progress(f"dead: {', '.join(restarted)}")
        _save_state(config, state)
        try:
            _start_controlds(config, state, [p.name for p in dead_ctl], progress, timeout, agreed)
        except BaseException as e:
            failed(e)
            raise
    entries, silent = agreed_states(config)
    if silent:
        hint = f" ({HOSTS_HINT})" if on_hosts(config) else ""
        raise _silent_error(silent, f"cannot see the agreement replicas on those hosts{hint}")
    dead_agreed = {}
    for s in config.services:
        for r in range(s.n):
            e = entries.get(f"{s.name}/agreed-{r}", {})
            if e.get("state") != "running":
                dead_agreed[f"{s.name}/agreed-{r}"] = _agreed_why(e)
    why_not = []
    for s in config.services:
        gone = [n for n in dead_agreed if n.startswith(f"{s.name}/agreed-")]
        if len(gone) > s.g and agreement_on_disk(config, s, entries) is not None:
            why_not.append(
                f"{len(gone)} of {s.name}'s {s.n} agreement replicas are dead"
                f" ({', '.join(gone)}), more than g = {s.g}: they keep no state on disk,"
                " so restarted they would rejoin without their logs, more amnesiac replicas"
                " than the service tolerates"
            )
    if why_not:
        raise RackError(
            f"rack {config.rack.name!r} cannot be repaired: " + "; ".join(why_not)
            + f". `zz rack down {config.path}` and `zz rack up {config.path}` start it anew"
            " (same keys, execution state discarded, forensic states kept)"
        )
    if dead_agreed and not on_hosts(config):
        _check_ports(config, set(dead_agreed))
        lines = [f"agreed {n} ({why})" for n, why in dead_agreed.items()]
        progress(f"dead: {', '.join(lines)}")
        restarted += lines
    try:
        if dead_agreed:
            _start_agreed(config, state, list(dead_agreed), progress, timeout)
        fixed = _reprovision(config, state, progress, _provision_timeout(state, timeout))
    except BaseException as e:
        failed(e)
        raise
    if not restarted and not fixed:
        raise AlreadyUp(
            f"rack {config.rack.name!r} is already up: all {len(state.procs)} processes run"
            f" and its controlds hold all {len(state.replicas)} execution replicas as their"
            f" hypervisors show them (started {time.ctime(state.started_at)})"
        )
    if fixed:
        _wait_linked(config, progress, timeout)
    state.repairs.append({"at": time.time(), "by": by, "restarted": restarted + fixed})
    state.complete = True
    _save_state(config, state)
    return state


def _agreed_why(entry: dict[str, Any]) -> str:
    """Why an agreement replica is not running, from its controld's entry (its log says
    how it ended)."""
    state = entry.get("state", "not reported by its controld")
    return f"pid {entry.get('pid')} dead" if state in ("exited", "stopped") else str(state)


def _reprovision(
    config: Config, state: RackState, progress: Progress, timeout: float, every: bool = False
) -> list[str]:
    """Ask each controld for its inventory with what the hypervisor shows (`list`), and
    provision again every execution replica slot of its host that it does not hold as it
    should (`every`: all of them, after `start`): a record the hypervisor contradicts is
    destroyed (forgotten; its state directory stays) and provisioned in the mode it had
    (recovering: active); a slot without a record is provisioned active if the agreement
    replicas count it awake, else as a spare. The runtime resumes from its state directory.
    Returns one line per replica provisioned; state.replicas follows."""
    from zz import status as st

    # Who is awake, as the agreement replicas' last stats say (through their controlds).
    entries, silent = agreed_states(config)
    if silent:
        raise _silent_error(silent, "cannot see the agreement replicas on those hosts")
    views = {
        s.name: st.exec_view_of(
            [entries.get(f"{s.name}/agreed-{r}", {}).get("stats") for r in range(s.n)]
        )
        for s in config.services
    }

    async def call(h: Host, op: dict[str, Any]) -> dict[str, Any]:
        return await call_ok(config, h, op, timeout)

    async def host_fix(h: Host) -> list[tuple[ReplicaRecord, str]]:
        listed = (await call(h, {"op": "list"}))["replicas"]
        held = {(r["service"], r["index"]): r for r in listed}
        done = []
        for s in config.services:
            if not s.uses_execution_replicas:
                continue
            for i in range(s.n_exec):
                if s.exec_host(config, i).index != h.index:
                    continue
                rec = held.get((s.name, i))
                if rec is not None and rec.get("pending") is not None:
                    continue  # controld is acting on it right now
                if rec is not None and rec["state"] != "convicted":
                    if not every and rec.get("consistent", True):
                        continue
                    mode = "active" if rec["state"] in ("active", "recovering") else rec["state"]
                    why = (f"{rec['state']} in controld's inventory, the hypervisor shows"
                           f" {rec.get('hv_state', '?')}")  # fmt: skip
                    await call(h, {"op": "destroy", "service": s.name, "index": i})
                else:
                    awake = views[s.name].get("awake")
                    active = i in awake if awake is not None else i < s.active
                    mode = "active" if active else s.sleep
                    why = "not in controld's inventory"
                t0 = time.monotonic()
                await call(h, {"op": "provision", "service": s.name, "index": i, "mode": mode})
                line = (f"{s.name}/exec-{i} on {h.name} ({why}): provisioned {mode}"
                        f" ({time.monotonic() - t0:.1f} s)")  # fmt: skip
                progress(f"  {line}")
                addr = s.exec_address(config, i)
                done.append((ReplicaRecord(s.name, i, h.name, mode,
                                           domain_name(config, s, i), *addr), line))  # fmt: skip
        return done

    async def run() -> list[str]:
        results = await asyncio.gather(*(host_fix(h) for h in config.hosts),
                                       return_exceptions=True)  # fmt: skip
        lines, errors = [], []
        for r in results:
            if isinstance(r, BaseException):
                errors.append(r)
                continue
            for rec, line in r:
                state.replicas = [x for x in state.replicas
                                  if (x.service, x.index) != (rec.service, rec.index)]  # fmt: skip
                state.replicas.append(rec)
                lines.append(line)
        state.replicas.sort(key=lambda x: (x.service, x.index))
        _save_state(config, state)
        if errors:
            raise errors[0]
        return lines

    return asyncio.run(run())


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
    deleted: list[str] = field(default_factory=list)  # paths and pools removed
    kept: list[str] = field(default_factory=list)  # forensic states, logs, keys, ...
    # Hosts whose controld is not running or did not answer ("controld h2 not running"):
    # what runs there is ended by the sweep of leftovers (then listed there).
    unanswered: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.killed and not self.leftovers and not self.refused


def controld_hosts(config: Config, state: RackState) -> list[str]:
    """The hosts whose controld `stop` and `down` ask: those `up` started here that still
    run, or with rack.controlds = "hosts" every host (one that does not answer is named)."""
    if on_hosts(config):
        return [h.name for h in config.hosts]
    return [p.name for p in state.alive()]


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
    when libvirt-python is not installed or a URI does not answer. For the tests, which
    check that none survives: `stop` and `down` never open a host's URI (its controld
    destroys its domains: `halt`)."""
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


# What a rack runs: only these are swept by command line, never e.g. a `timeout` or a
# shell that merely names the config.
_RACK_PROGRAMS = (b"zz-agreed", b"zz.execution", b"zz.controld", b"qemu-system")


def rack_leftovers(config: Config) -> list[int]:
    """Live rack processes (zz-agreed, runtimes, controlds, QEMU) naming this rack's
    config or run directory, or, QEMU, one of its domains (`-name guest=<domain>,`: a
    guest with a virtiofs share names no path of the rack, its share is virtiofsd's)."""
    guests = [
        f"guest={domain_name(config, s, i)},"
        for s in config.services
        if s.uses_execution_replicas
        for i in range(s.n_exec)
    ]
    out = []
    for pid in leftover_pids([str(config.path), f"{config.rack.run_dir}/", *guests]):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if any(m in cmd for m in _RACK_PROGRAMS):
            out.append(pid)
    return out


def _remove_exec_state(
    config: Config, report: DownReport | None = None, purge_forensics: bool = False
) -> list[Path]:
    """Execution replicas' state directories and the agreement replicas' state: their
    view of the execution replicas (awake, sleeping, convicted: agreed-<r>.exec-view) and
    data directories (agreed_data_dir): a new rack starts from seq 0 with its planned roles
    and must not meet a replica that remembers a later state. The forensic states of
    convicted replicas (exec-<i>.forensic-<seq>: their state and console logs) go only with
    `purge_forensics`; returns the ones kept. Logs and status files stay. Nothing outside
    run_dir is touched (a symlink leading out is refused: RackError, or listed in
    `report.refused` when there is a report)."""
    run = config.rack.run_dir
    todo: list[tuple[Callable[[Path, Path], None], Path]] = []
    kept: list[Path] = []
    for s in config.services:
        base = run / f"s{s.id}"
        for r in range(s.n):
            todo.append((remove_file, base / f"agreed-{r}.exec-view"))
            todo.append((remove_tree, agreed_data_dir(config, s, r)))
        for i in range(s.n_exec):
            for d in base.glob(f"exec-{i}") if base.exists() else []:
                todo.append((remove_tree, d))
            for d in sorted(base.glob(f"exec-{i}.forensic-*")) if base.exists() else []:
                if purge_forensics:
                    todo.append((remove_tree, d))
                else:
                    kept.append(d)
    _remove_each(todo, run, report)
    return kept


# A ZFS forensic dataset: <pool>/s<id>-exec-<i>[-<n>]-forensic-<seq>[-<n>] (controld's
# set_aside_state; -<n> when the name was taken).
_FORENSIC_DATASET = re.compile(r"s(\d+)-exec-(\d+)(?:-\d+)?-forensic-(\d+)(?:-\d+)?")
FORENSIC_STREAM_DIR = "zfs"  # in a forensic state: `zfs send` streams of its datasets


def _save_zfs_forensics(config: Config, pool: str, report: DownReport) -> None:
    """Before `pool` is destroyed: every forensic dataset's @forensic-<seq> snapshot as a
    `zfs send` stream into the matching forensic state, run/s<id>/exec-<i>.forensic-<seq>/zfs/
    <dataset>@<snapshot>.zfs-send (`zfs recv POOL/NAME < FILE` restores one). A stream that
    cannot be written is reported in `refused` (and makes the exit 1)."""
    from zz.snapshots import StorageError
    from zz.snapshots.zfs import run_zfs

    try:
        out = run_zfs(["zfs", "list", "-H", "-o", "name", "-t", "snapshot", "-r", pool])
    except StorageError as e:
        report.refused.append(f"forensic datasets of pool {pool}: cannot list them: {e}")
        return
    for snap in out.split():
        dataset, _, snapname = snap.partition("@")
        leaf = dataset.rsplit("/", 1)[-1]
        m = _FORENSIC_DATASET.fullmatch(leaf)
        if m is None or not snapname.startswith("forensic-"):
            continue  # its checkpoints (ckpt-<n>) are in the forensic snapshot already
        sid, index, seq = m.groups()
        dest_dir = config.rack.run_dir / f"s{sid}" / f"exec-{index}.forensic-{seq}"
        dest = dest_dir / FORENSIC_STREAM_DIR / f"{leaf}@{snapname}.zfs-send"
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "wb") as fh:
            proc = subprocess.run(["zfs", "send", snap], stdout=fh, stderr=subprocess.PIPE,
                                  timeout=600, check=False)  # fmt: skip
        if proc.returncode != 0:
            dest.unlink(missing_ok=True)
            why = proc.stderr.decode(errors="replace").strip()
            report.refused.append(f"forensic snapshot {snap}: zfs send failed: {why}")
            continue
        report.kept.append(f"{snap} as {dest}")


def _stop_agreed(
    config: Config, state: RackState, report: DownReport, timeout: float
) -> dict[str, dict[str, Any]]:
    """Every running controld of the rack stops its host's agreement replicas
    (`agreed_stop`, SIGKILL after `timeout`); the stats each left as it exited, by name. A
    controld that does not answer is named in `report.unanswered`."""
    hosts = controld_hosts(config, state)
    dead = [p.name for p in state.procs if p.kind == "controld" and p.name not in hosts]
    for h in dead:
        report.unanswered.append(f"controld {h} not running")
    answers = ask_controlds(config, {"op": "agreed_stop", "timeout_s": timeout}, hosts,
                            timeout + 15)  # fmt: skip
    stats: dict[str, dict[str, Any]] = {}
    for host, answer in sorted(answers.items()):
        if isinstance(answer, str):
            report.unanswered.append(f"controld {host} does not answer ({answer})")
            continue
        report.stopped += answer.get("stopped", [])
        report.killed += answer.get("killed", [])
        stats.update({k: v for k, v in answer.get("stats", {}).items() if isinstance(v, dict)})
    return stats


def _halt(config: Config, state: RackState, report: DownReport, timeout: float) -> None:
    """Every running controld destroys its domains (processes) of the rack (`halt`: its
    inventory's records are kept), so that no host's hypervisor is opened from here."""
    silent = {w.split()[1] for w in report.unanswered}  # named already by _stop_agreed
    hosts = [h for h in controld_hosts(config, state) if h not in silent]
    answers = ask_controlds(config, {"op": "halt"}, hosts, timeout + 15)
    for host, answer in sorted(answers.items()):
        if isinstance(answer, str):
            report.unanswered.append(f"controld {host} does not answer halt ({answer})")
            continue
        if state.backend == "libvirt":
            report.domains += answer.get("destroyed", [])
        report.refused += [f"controld {host}: domain {x}" for x in answer.get("failed", [])]


def _stop_everything(
    config: Config, state: RackState | None, report: DownReport, timeout: float
) -> tuple[dict[str, dict[str, Any]], dict[tuple[str, int], dict[str, Any]]]:
    """The agreement replicas and the rack's domains through their controlds, then the
    controlds (they stop their process replicas), then whatever still names the rack's
    config or run directory (what a controld that did not answer left: its runtimes,
    agreement replicas and QEMU processes). Returns what the replicas left, as the
    controlds report it: the agreement replicas' last stats (_stop_agreed) and the
    runtimes' status files and newest checkpoints (exec_status)."""
    stats: dict[str, dict[str, Any]] = {}
    runtimes: dict[tuple[str, int], dict[str, Any]] = {}
    if state is not None:
        stats = _stop_agreed(config, state, report, timeout)
        # Domains before controld stops (it leaves libvirt domains running) and before
        # the sweep: a guest's QEMU names the run dir (its console socket), and libvirt
        # should destroy it rather than find it killed under its feet.
        _halt(config, state, report, timeout)
        silent = {w.split()[1] for w in report.unanswered}
        asked = [h for h in controld_hosts(config, state) if h not in silent]
        runtimes = runtimes_of(ask_controlds(config, {"op": "exec_status"}, asked, timeout))
        ctl = [p for p in state.procs if p.kind == "controld"]
        # controld's SIGTERM path destroys its replicas (process backend: terminate, 10 s
        # grace each), so it gets longer than a replica.
        _stop_procs(ctl, timeout + 15, report)
    if on_hosts(config):
        return stats, runtimes  # nothing of the rack runs on this machine: no sweep here
    pids = rack_leftovers(config)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    report.leftovers = pids
    return stats, runtimes


def down(
    config: Config,
    progress: Progress = _quiet,
    timeout: float = 15.0,
    purge_forensics: bool = False,
) -> DownReport:
    """Stop every recorded process (controlds first: they destroy their replicas), then
    agreement replicas, then whatever still names this rack's config or run directory;
    destroy leftover zz-<rack>-* domains and the rack's pools (their forensic datasets
    saved as streams first); remove run/rack.json, controld's replica/save directories
    and inventories, the execution and agreement replicas' state. Forensic states stay
    unless `purge_forensics`; logs and stats stay in run_dir. The report lists what was
    deleted and what was kept."""
    report = DownReport()
    state = load_state(config)
    if state is None:
        report.nothing = True
    _stop_everything(config, state, report, timeout)
    run = config.rack.run_dir
    if on_hosts(config):
        _down_on_hosts(config, report, timeout, purge_forensics)
        _remove_each([(remove_file, state_path(config))], run, report)
        return _down_report(config, report, progress)
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
                if not purge_forensics:
                    _save_zfs_forensics(config, p["name"], report)
                destroy_pool(p["name"])
                report.pools.append(p["name"])
                report.deleted.append(f"ZFS pool {p['name']}")
            _remove_each([(remove_file, vdev)], run, report)
    kept = _remove_exec_state(config, report, purge_forensics)
    report.kept[:0] = [f"forensic state {k}" for k in kept]
    todo: list[tuple[Callable[[Path, Path], None], Path]] = []
    for h in config.hosts:
        home = run / "controld" / h.name
        todo += [(remove_tree, home / sub) for sub in ("replicas", "saves")]
        # The inventory (and agreed.json, the agreement replicas' records) describe
        # replicas that no longer exist: a new controld must not report them as lost.
        names = ("inventory.json", "agreed.json", "ledger.json", "freshness.json")
        todo += [(remove_file, home / n) for n in names]
    todo.append((remove_file, state_path(config)))
    _remove_each(todo, run, report)
    return _down_report(config, report, progress)


def _down_on_hosts(config: Config, report: DownReport, timeout: float, purge: bool) -> None:
    """`down` with the controlds on their hosts: each clears the rack's state there (op
    `reset`); their pools are the hosts' own (zz host init) and stay, the rack's datasets
    in them go. A controld that does not answer is named in `report.unanswered`."""
    answers = _reset_hosts(config, purge, timeout)
    for host, answer in sorted(answers.items()):
        if isinstance(answer, str):
            if not any(w.split()[1] == host for w in report.unanswered):
                report.unanswered.append(f"controld {host} does not answer reset ({answer})")
            # Nothing sweeps a host here: what the rack left on it stays (exit 1).
            report.refused.append(f"controld {host}: the rack's state on {host} was not"
                                  f" cleared ({answer}); `zz rack down` again once it"
                                  " answers")  # fmt: skip
            continue
        report.stopped += [x for x in answer.get("stopped", []) if x not in report.stopped]
        report.killed += answer.get("killed", [])
        report.domains += [x for x in answer.get("destroyed", []) if x not in report.domains]
        report.deleted += [f"{host}: {x}" for x in answer.get("deleted", [])]
        report.kept += [f"forensic state on {host}: {x}" for x in answer.get("kept", [])]
        report.refused += [f"controld {host}: {x}" for x in answer.get("refused", [])]
        report.refused += [f"controld {host}: domain {x}" for x in answer.get("failed", [])]
    if answers and not report.unanswered:
        report.kept.append("each host's pool, controld log, audit log and keys (the hosts')")


def _down_report(config: Config, report: DownReport, progress: Progress) -> DownReport:
    """What `down` writes (run/rack.down) and prints, once everything was removed."""
    run = config.rack.run_dir
    if run.is_dir():
        write_atomic(run / DOWN_NAME, f"{time.time():.3f}\n")
        what = "drill reports" if on_hosts(config) else "logs, stats files and audit logs"
        report.kept.append(f"{what} in {run}")
    if config.rack.key_dir.exists():
        report.kept.append(f"keys in {config.rack.key_dir}")
    for why in report.refused:
        progress(f"rack {config.rack.name!r}: {why}")
    left = "left there" if on_hosts(config) else "left to the sweep of leftovers"
    for why in report.unanswered:
        progress(f"rack {config.rack.name!r}: {why}: what runs on its host is {left}")
    if report.nothing and not (report.leftovers or report.domains or report.deleted):
        progress(f"rack {config.rack.name!r}: nothing running (no {state_path(config)})")
    else:
        progress(
            f"rack {config.rack.name!r} down: {len(report.stopped)} stopped,"
            f" {len(report.killed)} killed, {len(report.leftovers)} leftovers,"
            f" {len(report.domains)} domains, {len(report.pools)} pools destroyed"
        )
        for line in report.deleted:
            progress(f"  deleted {line}")
    for line in report.kept:
        progress(f"  kept {line}")
    return report


def stop(config: Config, progress: Progress = _quiet, timeout: float = 15.0) -> DownReport:
    """Stop every process and guest of the rack and keep everything else: keys, the
    execution replicas' state (directories, ZFS pools and datasets), controlds' inventories
    and audit logs, logs, forensic states; run/rack.json is marked stopped, with the seq
    each service had reached, for `start`."""
    report = DownReport()
    state = load_state(config)
    if state is None:
        report.nothing = True
        progress(f"rack {config.rack.name!r}: nothing to stop (no {state_path(config)})")
        return report
    if state.stopped_at is not None and not state.alive():
        report.nothing = True
        progress(f"rack {config.rack.name!r}: stopped already ({time.ctime(state.stopped_at)})")
        return report
    last, runtimes = _stop_everything(config, state, report, timeout)
    # What the replicas reached: zz-agreed writes its stats file once more as it exits on
    # SIGTERM (its controld returns it), so a request ordered in its last second counts too.
    for s in config.services:
        stats = [last.get(f"{s.name}/agreed-{r}") for r in range(s.n)]
        seq = reached_seq(config, s, stats, runtimes)
        state.stopped_seq[s.name] = max(seq, state.stopped_seq.get(s.name, 0))
    state.stopped_at = time.time()
    _save_state(config, state)
    write_atomic(config.rack.run_dir / DOWN_NAME, f"{time.time():.3f}\n")
    report.kept = _kept_on_stop(config, state)
    for why in report.unanswered:
        progress(f"rack {config.rack.name!r}: {why}: what runs on its host is left to the"
                 " sweep of leftovers")  # fmt: skip
    progress(
        f"rack {config.rack.name!r} stopped: {len(report.stopped)} stopped,"
        f" {len(report.killed)} killed, {len(report.leftovers)} leftovers,"
        f" {len(report.domains)} domains destroyed"
    )
    for line in report.kept:
        progress(f"  kept {line}")
    progress(f"`zz rack start {config.path}` brings it back, `zz rack down {config.path}`"
             " discards it")  # fmt: skip
    return report


def _kept_on_stop(config: Config, state: RackState) -> list[str]:
    run = config.rack.run_dir
    out = [f"keys in {config.rack.key_dir}", f"rack record {state_path(config)}"]
    if on_hosts(config):
        return [*out, "on each host, by its controld: the execution replicas' state, its"
                " inventory, agreement replica records, audit log, logs and forensic states;"
                " the controlds run on"]  # fmt: skip
    for s in config.services:
        if s.uses_execution_replicas:
            dirs = [s.exec_state_dir(config, i) for i in range(s.n_exec)]
            out += [f"execution state {d}" for d in dirs if d.exists()]
        out += [f"forensic state {d}" for d in sorted((run / f"s{s.id}").glob("exec-*.forensic-*"))]
    out += [f"ZFS pool {p['name']} on {p['vdev']} (imported)" for p in state.pools]
    for h in config.hosts:
        home = run / "controld" / h.name
        files = [n for n in ("inventory.json", "agreed.json", "audit.log") if (home / n).exists()]
        if files:
            out.append(f"controld {h.name}'s {', '.join(files)} in {home}")
    out.append(f"logs and stats files in {run}")
    return out


def _import_pools(config: Config, state: RackState, progress: Progress) -> None:
    """The recorded pools, imported from their vdev files if zfs-fuse no longer has them
    (it was restarted); a pool of the name on another file is an error."""
    if not state.pools:
        return
    from zz.snapshots.zfs import ensure_zfs_daemon, pool_exists, pool_vdevs, run_zfs

    ensure_zfs_daemon()
    for p in state.pools:
        name, vdev = p["name"], Path(p["vdev"]).absolute()
        if name not in {pool_name(config, h) for h in config.hosts}:
            raise RackError(f"rack.json records pool {name!r}: not this rack's")
        if pool_exists(name):
            theirs = pool_vdevs(name)
            if theirs != [str(vdev)]:
                raise RackError(f"ZFS pool {name} is on {', '.join(theirs) or '?'}, not on"
                                f" this rack's {vdev}")  # fmt: skip
            continue
        if not vdev.exists():
            raise RackError(f"ZFS pool {name}: its vdev {vdev} is gone; the rack's state with"
                            " it: `zz rack down` and `zz rack up` start anew")  # fmt: skip
        run_zfs(["zpool", "import", "-d", str(vdev.parent), name])
        progress(f"ZFS pool {name} imported from {vdev}")


class CannotContinue(RackError):
    """`start` would not continue the rack's sequence numbers."""


def start(
    config: Config,
    agreed: Path | None = None,
    progress: Progress = _quiet,
    timeout: float = 120.0,
) -> RackState:
    """Bring a stopped rack (or one whose processes all died) back from disk: same keys,
    the controlds on their inventories, the agreement replicas, and every execution replica
    provisioned again on its state directory in the mode its controld recorded. A rack
    with processes alive is repaired like `up` does (AlreadyUp when nothing is dead).
    CannotContinue, before any replica starts, when a service reached a seq its agreement
    replicas cannot continue from (start_blockers, from what the controlds report: they are
    started first, and stopped again then, rack.json as it was). A failed start stops what
    it started and keeps the state."""
    state = load_state(config)
    if state is None:
        raise RackError(f"no rack recorded in {state_path(config)}: `zz rack up {config.path}`")
    agreed = agreed or DEFAULT_AGREED
    hosts = on_hosts(config)
    if state.alive() or (hosts and state.stopped_at is None):
        return repair(config, state, agreed, progress, timeout, by="start")
    if hosts:
        _need_operator_key(config)
    else:
        if state.backend == "libvirt":
            _need_libvirt()
        if not agreed.exists():
            raise RackError(f"{agreed} not built: make -C agreement")
        _check_ports(config)
    saved = state.to_json()
    down_mark = config.rack.run_dir / DOWN_NAME
    stopped_mark = down_mark.read_text() if down_mark.exists() else None
    was = state.stopped_at
    progress(f"rack {config.rack.name!r}: starting from disk"
             + (f" (stopped {time.ctime(was)})" if was else " (its processes had died)"))
    state.procs = []
    state.stopped_at = None
    state.complete = False
    _save_state(config, state)
    down_mark.unlink(missing_ok=True)
    try:
        _import_pools(config, state, progress)
        _start_controlds(config, state, [h.name for h in config.hosts], progress, timeout,
                         agreed)  # fmt: skip
        # Whether the services can go on where they stopped, from what the replicas left
        # on each host, as its controld reports it.
        entries, silent = agreed_states(config)
        if silent:
            raise _silent_error(silent, "cannot see what the agreement replicas left there")
        runtimes = runtimes_of(ask_controlds(config, {"op": "exec_status"}, timeout=timeout))
        blockers = start_blockers(config, state, entries, runtimes)
        if blockers:
            raise CannotContinue(
                f"rack {config.rack.name!r} cannot start where it stopped: "
                + "; ".join(blockers) + ". Restarted, they would order from seq 1 again,"
                " below what the execution replicas executed and the clients saw. No replica"
                " was started (the controlds asked were stopped again); the state stays on"
                f" disk. `zz rack down {config.path}` and `zz rack up {config.path}` start the"
                " rack anew from seq 0 with the same keys (execution state discarded, forensic"
                " states kept)"
            )
        names = [f"{s.name}/agreed-{r}" for s in config.services for r in range(s.n)]
        _start_agreed(config, state, names, progress, timeout)
        if any(s.uses_execution_replicas for s in config.services):
            progress("execution replicas through controld, on their state directories:")
            _reprovision(config, state, progress, _provision_timeout(state, timeout), every=True)
            _wait_linked(config, progress, timeout)
    except CannotContinue:
        # Back to the stopped rack it was: its controlds stopped, rack.json as it was.
        _stop_procs([p for p in state.procs if p.kind == "controld"], timeout + 15, DownReport())
        _save_state(config, RackState.from_json(saved))
        if stopped_mark is not None:
            write_atomic(down_mark, stopped_mark)
        raise
    except BaseException:
        progress("start failed: stopping what was started (the rack's state stays on disk)")
        with contextlib.suppress(Exception):
            stop(config, progress=progress)
        raise
    state.complete = True
    _save_state(config, state)
    return state


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
