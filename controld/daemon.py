# controld/daemon.py - one controld per host: an asyncio TCP server on the host's
# control_port taking CONTROL RPCs from operators (MAC) and WAKEUP / SHUTDOWN certificates
# from agreement replicas (Ed25519), acting on this host's execution replicas through the
# hypervisor interface with write-ahead inventory transitions. docs/controld.md.
"""The controld daemon.

Trust: an operator (CONTROL, MAC with the operator's key) may provision, destroy, list
and ask for status, and start, stop and watch this host's agreement replicas
(controld/agreed.py); only a verified certificate may wake a replica (WAKEUP) or shut one
down (SHUTDOWN, g+1 matching). Everything that fails to frame, decode, authenticate or
verify is dropped and counted (`status` shows the counters); no message can crash the
daemon. Certificate actions run one at a time, in arrival order, on one worker (so a
SHUTDOWN never overtakes the WAKEUP of its round), except a convicted slot's fresh spare:
its provisioning runs in the background (_fresh_spare), and a later certificate naming that
slot waits for it (_wait_for_spares). Operator operations run concurrently, serialised per
replica by the inventory's locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import math
import os
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from zz import audit, certs, wire
from zz import keys as keyfiles
from zz.atomicfile import write_atomic
from zz.config import Config, ConfigError, Host, Service
from zz.controld import actions, orphans, reset
from zz.controld import inventory as inv
from zz.controld.actions import HostContext, refresh_guest_keys
from zz.controld.agreed import MAX_LOG_LINES, MAX_WAIT_S, AgreedError, AgreedReplicas
from zz.controld.announce import Announcer
from zz.controld.guestsnap import GuestDatasets
from zz.controld.hypervisor import DomainNotFound, Hypervisor, HypervisorError
from zz.controld.ledger import Ledger
from zz.controld.metrics import HostMetrics, MetricsServer, count_peer
from zz.controld.rpc import RACK_SERVICE, JsonTooDeep, control_reply, decode_json
from zz.controld.snapshots import HostSnapshots
from zz.controld.warm import WarmSpares
from zz.drillfaults import FAULT_FILE, FAULTS
from zz.keys import ControldKeys, KeyFileError, controld_principal, rotate_exec
from zz.naming import domain_name
from zz.procrack import DEFAULT_AGREED, signal_group
from zz.snapshots import StorageError, fileserve
from zz.status import agreement_stats

log = logging.getLogger("zz.controld")

Send = Callable[[dict[str, Any]], Awaitable[None]]
MODES = ("paused", "hibernated", "active")
# A restored replica's balloon is grown back to the full memory when a SHUTDOWN keeps it
# active, or this long after its wake-up (Daemon._grow).
GROW_AFTER_S = 5.0
# The longest a woken guest keeps its raised CPU weight without a SHUTDOWN settling its round.
WAKE_PRIORITY_S = 20.0


def _lists(o: certs.Outcome) -> str:
    """`convict [..] sleep [..] active [..]`: how SHUTDOWN log lines give an outcome (zz
    drill, zz campaign and zz/report.py parse them)."""
    return f"convict {list(o.convict)} sleep {list(o.sleep)} active {list(o.active)}"


class OpError(Exception):
    """An operator request that cannot be served; the message goes into the reply."""


def _seconds(req: dict[str, Any], key: str, default: float, most: float) -> float:
    """req[key], a finite number of seconds in 0..most (default when absent)."""
    v = req.get(key, default)
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise OpError(f"{key}: a number of seconds is required, not {v!r}")
    if not 0 <= v <= most:
        raise OpError(f"{key}: must be in 0..{most:g}, not {v!r}")
    return float(v)


def _overrides(v: object) -> dict[str, Any]:
    """The replica-file overrides of an agreed_start (`zz rack up --set`): an object of
    keys to integers or strings, or to objects of replica number -> value (JSON keys are
    strings: "2" is replica 2). zz.render checks the keys and values."""
    if not isinstance(v, dict):
        raise OpError(f"overrides must be an object, not {type(v).__name__}")
    out: dict[str, Any] = {}
    for key, val in v.items():
        if isinstance(val, dict):
            per: dict[int, Any] = {}
            for r, x in val.items():
                if not (isinstance(r, str) and r.isdigit()) or not isinstance(x, int | str):
                    raise OpError(f"overrides.{key}: replica numbers to values, not {r!r}: {x!r}")
                per[int(r)] = x
            out[key] = per
        elif isinstance(val, int | str) and not isinstance(val, bool):
            out[key] = val
        else:
            raise OpError(f"overrides.{key}: an integer or a string, not {val!r}")
    return out


@dataclass(frozen=True)
class ConnLimits:
    """The RPC listener's resource limits (docs/security.md "Resource limits"). Over a
    connection cap a connection is accepted and closed at once, and counted."""

    max_conns: int = 256
    max_conns_per_source: int = 64
    # Nothing legitimate sent to controld is large (CONTROL, WAKEUP, SHUTDOWN, FILE-FETCH).
    max_frame: int = 1 << 20
    frame_timeout: float = 20.0  # a frame whose length arrived must be complete within this
    unauth_timeout: float = 10.0  # a connection must authenticate a message within this
    # A peer must take each reply (a FILE-DATA is up to 4 MiB) within this, else it is
    # dropped: one that never reads holds at most one reply.
    send_timeout: float = fileserve.FILE_SEND_TIMEOUT


class Daemon:
    """controld of `host`. `home` holds inventory.json, ledger.json, replicas/, saves/."""

    def __init__(
        self,
        config: Config,
        host: Host,
        hv: Hypervisor,
        keys: ControldKeys,
        home: Path,
        *,
        memory_mib: int = 512,
        image: Path | None = None,
        store: str = "dir",
        zfs_pool: str | None = None,
        ready_timeout: float = 60.0,
        drill_faults: bool = False,
        limits: ConnLimits | None = None,
        agreed: Path | None = None,
    ) -> None:
        self.config = config
        self.limits = limits or ConnLimits()
        self._conns_open = 0
        self._conns_by_source: Counter[str] = Counter()
        self.host = host
        self.hv = hv
        self.keys = keys
        self.me = controld_principal(host.index)
        home.mkdir(parents=True, exist_ok=True)
        self.ctx = HostContext(
            config, host, hv, home, memory_mib, image, store, zfs_pool, ready_timeout, drill_faults
        )
        self.inventory = inv.Inventory(home / "inventory.json", hv)
        self.snapshots = HostSnapshots(config, host, store, zfs_pool)
        self.ledger = Ledger(home / "ledger.json")
        self.freshness_path = home / "freshness.json"
        self.freshness = certs.Freshness.load(self.freshness_path)
        # Every WAKEUP, SHUTDOWN and SPARE-READY, accepted or refused (zz/audit.py).
        # Opened at start (or at the first entry, for a daemon driven without start()).
        self.audit = audit.AuditLog(home / audit.FILE_NAME, host.name)
        # The _note lines of the action running in this task (a certificate's, on the
        # worker; a fresh spare's, in its background task): its audit entry's `lines`.
        self._lines: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
            f"controld-{host.name}-lines", default=None
        )
        # (service id, index) -> the background provisioning of that slot's fresh spare.
        self._spares: dict[tuple[int, int], asyncio.Task[None]] = {}
        # Set by `halt` (its domains are being destroyed) until the next `provision` or
        # `reset`: a fresh spare's provisioning stops at its next step and is not tried
        # again, and no certificate starts a domain (a fresh spare, a wake-up).
        self._halt = threading.Event()
        # Fresh spares whose provisioning a stopped controld left under way (recover()):
        # start() finishes them in the background.
        self._unfinished: list[inv.Replica] = []
        # Per (service, slot): the last fresh spare's SPARE-READY, and lower sibling
        # certificates' seqs (_lower_sibling) seen before it was announced.
        self._announced: dict[tuple[int, int], bytes] = {}
        # (service id, index) -> the seq and awake set of the WAKEUP that woke that replica
        # here, until a SHUTDOWN settles it (_act_shutdown). In memory only.
        self._woken_for: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
        self._sibling_seqs: dict[tuple[int, int], set[int]] = {}
        self.counters: Counter[str] = Counter()
        self.dropped_by_source: Counter[str] = Counter()  # messages dropped, per address
        self.recent: deque[str] = deque(maxlen=64)
        # The steps of the latest wake-ups with their wall-clock times (_act_wakeup).
        self.wakes: deque[dict[str, Any]] = deque(maxlen=16)
        # (service id, index) -> a restored replica whose balloon is still as it was saved:
        # the task that grows it after grow_after_s, its domain and its entry in `wakes`.
        # A SHUTDOWN that keeps it active grows it at once (_grow), one that convicts it or
        # sends it back to sleep drops it (_drop_grow). In memory only: start() grows what
        # a controld that stopped meanwhile left small (_grow_left_small).
        self._grows: dict[tuple[int, int], tuple[asyncio.Task[None], str, dict[str, Any]]] = {}
        self.grow_after_s = GROW_AFTER_S
        # ZZ_WAKE_GROW=restore: grow with the restore, as before (the baseline mode
        # hibernated-growatonce of scripts/bench/recovery-phases).
        self.grow_at_restore = os.environ.get("ZZ_WAKE_GROW") == "restore"
        # (service id, index) -> (domain, the CPU weight to set back): a woken guest runs at
        # actions.WAKE_SHARES until a SHUTDOWN settles its round or wake_priority_s pass
        # (_lower_priority). ZZ_WAKE_PRIORITY=off: at its own weight (the baseline mode
        # paused-noprio of scripts/bench/recovery-phases). In memory only.
        self._prioritised: dict[tuple[int, int], tuple[str, int, asyncio.Task[None]]] = {}
        self.wake_priority = os.environ.get("ZZ_WAKE_PRIORITY") != "off"
        self.wake_priority_s = WAKE_PRIORITY_S
        # The agreement replicas placed here (zz-agreed processes: `agreed` is the binary).
        self.agreed = AgreedReplicas(
            config, host, home, agreed or DEFAULT_AGREED, self._note, self.counters
        )
        self._agreed_task: asyncio.Task[None] | None = None
        self.datasets = GuestDatasets(
            self.ctx, lambda sid: self.keys.services.get(sid, {}), self.counters
        )
        self._datasets_task: asyncio.Task[None] | None = None
        # This host's sleeping replicas kept at the latest stable checkpoint (controld/warm.py).
        self.warm = WarmSpares(config, self.inventory, self._warm_stable)
        self._warm_task: asyncio.Task[None] | None = None
        self.in_doubt_at_start: list[dict[str, Any]] = []
        self.lost: list[dict[str, Any]] = []
        self.orphans: list[dict[str, Any]] = []  # what reconcile_orphans ended
        # One collector per service: SHUTDOWN votes of one round, g+1 make a certificate.
        self.collectors: dict[int, certs.ShutdownCollector] = {}
        self._work: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.base_events.Server | None = None
        self._worker: asyncio.Task[None] | None = None
        self.started = time.time()
        assert keys.secret.sign is not None  # load_controld refuses a key without one
        # /metrics (controld/metrics.py): read at scrape time, served from start() on.
        self.metrics = HostMetrics(self)
        self.metrics_server = MetricsServer(
            self.metrics.registry, host.address, self.counters, self._note
        )
        self.announcer = Announcer(
            config, host, keys.secret.sign, self.counters, self._note, audit=self._audit_sent
        )

    # ---- start, restart, stop ---------------------------------------------------------------
    def recover(self) -> None:
        """On start: settle records left in doubt by a crash, and compare every other record
        with what the hypervisor shows. Nothing is acted upon: a replica whose state does
        not match (e.g. the process backend cannot adopt a dead controld's children) is
        reported in `lost` for the operator."""
        for line in self.audit.notes:  # a torn tail cut, a broken chain set aside
            self.counters["audit_log_repaired"] += 1
            self._note(line)
        self.agreed.load()
        for rec in self.inventory.reconcile(leave=self._finishable):
            self.in_doubt_at_start.append(asdict(rec))
            self._note(f"in doubt at start: {rec.service}/{rec.index}: {rec.error}")
        self._unfinished = [r for r in self.inventory.in_doubt() if self._finishable(r)]
        for rec in self._unfinished:
            self.in_doubt_at_start.append(
                asdict(rec)
                | {
                    "error": f"a fresh spare (successor of SHUTDOWN seq {rec.successor_of})"
                    " provisioning when controld stopped: finished in the background"
                }
            )
        self.lost = []
        for rec in self.inventory.replicas():
            if rec.pending is not None:
                continue  # a fresh spare being finished
            try:
                ok = inv.consistent_states(self.hv, rec)
            except HypervisorError as e:
                ok, why = set(), str(e)
            else:
                why = f"the hypervisor shows it as none of {sorted(map(str, ok))}"
            if rec.state not in ok:
                self.lost.append({"service": rec.service, "index": rec.index,
                                  "state": rec.state, "why": why})  # fmt: skip
                self._note(
                    f"lost: {rec.service}/{rec.index} is {rec.state} in the inventory; {why}"
                )
        self.reconcile_orphans()

    def _finishable(self, rec: inv.Replica) -> bool:
        """A fresh spare whose provisioning a stopped controld left under way, of a slot
        this host holds: start() finishes it (_fresh_spare) instead of reconcile()."""
        svc = next((s for s in self.config.services if s.name == rec.service), None)
        return (
            rec.state is None
            and rec.pending in (inv.PAUSED, inv.HIBERNATED)
            and rec.successor_of is not None
            and svc is not None
            and (svc, rec.index) in self._slots()
        )

    def _finish_spares(self) -> None:
        """At start: finish the fresh spares recover() found under way, in the background
        as their first provisioning ran (_fresh_spare with finish), and announce the ones
        provisioned but not announced (controld stopped in between)."""
        unfinished, self._unfinished = self._unfinished, []
        for rec in unfinished:
            svc = self.config.service(rec.service)
            assert rec.successor_of is not None
            raw = self._announcement(svc, rec.index, rec.successor_of)
            if raw is not None:
                self._spawn_spare(svc, rec.index, rec.successor_of, raw, finish=True)
                continue
            for r in self.inventory.reconcile(leave=lambda r, k=rec.key: r.key != k):
                self._note(f"in doubt at start: {r.service}/{r.index}: {r.error}")
        for rec in self.inventory.replicas():
            if rec.successor_of is None or rec.pending is not None:
                continue
            svc = self.config.service(rec.service)
            if rec.state not in (inv.PAUSED, inv.HIBERNATED):
                self.inventory.announced(svc.name, rec.index)  # woken since: nothing to say
                continue
            self._note(
                f"{svc.name}/{rec.index}: provisioned as the successor of SHUTDOWN"
                f" seq {rec.successor_of}, not announced when controld stopped"
            )
            raw = self._announcement(svc, rec.index, rec.successor_of)
            if raw is not None:
                self._announce_spare(svc, rec.index, rec.successor_of, raw)

    def _announcement(self, svc: Service, x: int, seq: int) -> bytes | None:
        """The SPARE-READY of slot x's re-key at `seq`, as rotate_exec made it (it returns
        the one it made for that conviction); None, noted, if the key directory fails."""
        sign = self.keys.secret.sign
        assert sign is not None
        try:
            return rotate_exec(self.config.rack.key_dir, self.config, svc, x, seq, sign,
                               self.host.index)  # fmt: skip
        except (OSError, KeyFileError, ValueError) as e:
            self.counters["action_failed"] += 1
            self._note(f"{svc.name}/{x}: the announcement of its successor's keys: {e}")
            return None

    # ---- orphans: what runs here that the inventory does not explain ------------------------
    def _slots(self, here: bool = True) -> list[tuple[Service, int]]:
        """The execution replica slots the config places on this host (here=False: on the
        other hosts)."""
        return [
            (svc, i)
            for svc in self.config.services
            if svc.uses_execution_replicas
            for i in range(svc.n_exec)
            if (svc.exec_host(self.config, i).index == self.host.index) == here
        ]

    def _explained(self, svc: Service, index: int) -> bool:
        """The inventory holds a live record of the slot (its runtime is accounted for,
        even if this backend cannot drive it after a restart: then it is `lost`)."""
        with contextlib.suppress(KeyError):
            return self.inventory.get(svc.name, index).state not in (None, inv.CONVICTED)
        return False

    def _orphan(self, what: str, why: str) -> None:
        self.counters["orphans_destroyed"] += 1
        self.orphans.append({"orphan": what, "action": "destroyed", "why": why})
        self._note(f"orphan: {what} {why}: destroyed")

    def reconcile_orphans(self, only: tuple[Service, int] | None = None) -> None:
        """Compare the inventory with what really runs and end what it does not explain
        (docs/controld.md "Orphans"): domains named like ours (zz-<rack>-...) the hypervisor
        lists, except those of slots placed on other hosts (a rack on one machine shares
        one libvirtd), runtime processes owning a slot's state directory (process backend:
        a runtime outlives a SIGKILLed controld), runtimes listening on a slot's execution
        port. Each is counted (orphans_destroyed) and noted. A port held by anything else
        is reported (orphan_port_busy), not touched. `only`: one slot (before provisioning
        it); None: every slot of this host and every domain (at start)."""
        slots = [only] if only is not None else self._slots()
        known = {r.domain for r in self.inventory.replicas() if r.state != inv.CONVICTED}
        if only is None and self.hv.kind != "process":
            prefix = f"zz-{self.config.rack.name}-"
            # The simulated hosts of a rack on one machine share its libvirtd: the domains
            # of slots placed on other hosts are their controlds' replicas, not orphans.
            theirs = {domain_name(self.config, svc, i) for svc, i in self._slots(here=False)}
            try:
                running = self.hv.list()
            except HypervisorError as e:
                running = []
                self._note(f"orphan check: cannot list domains: {e}")
            for name in running:
                if name.startswith(prefix) and name not in known and name not in theirs:
                    try:
                        self.hv.destroy(name)
                    except DomainNotFound:
                        continue
                    except HypervisorError as e:
                        self.counters["orphans_failed"] += 1
                        self._note(f"orphan: domain {name} not in the inventory: destroy"
                                   f" failed: {e}")  # fmt: skip
                        continue
                    self._orphan(f"domain {name}", "runs but is not in the inventory")
        if self.hv.kind != "process":
            return  # a guest's runtime is inside its domain, its port is QEMU's forward
        for svc, i in slots:
            if self._explained(svc, i):
                continue
            state = svc.exec_state_dir(self.config, i)
            port = actions.exec_port(svc, i)
            ours = getattr(self.hv, "pid", None)
            domain = domain_name(self.config, svc, i)
            mine: set[int] = set()
            with contextlib.suppress(HypervisorError):
                if ours is not None:
                    mine.add(ours(domain))
            found = {p.pid: p for p in orphans.runtimes_in(state) if p.pid not in mine}
            busy = []
            for p in orphans.port_listeners(port):
                if p.pid in mine or p.pid in found:
                    continue
                if orphans.is_runtime(p.cmdline):
                    found[p.pid] = p
                else:
                    busy.append(p)
            for p in found.values():
                why = (f"owns {svc.name}/{i} (state {state}, port {port}) but is not in the"
                       " inventory")  # fmt: skip
                if orphans.end(p.pid):
                    self._orphan(f"runtime {p.describe()}", why)
                else:
                    self.counters["orphans_failed"] += 1
                    self._note(f"orphan: runtime {p.describe()} {why}: would not die")
            for p in busy:
                self.counters["orphan_port_busy"] += 1
                self._note(f"orphan check: port {port} of {svc.name}/{i} is held by {p.describe()}")

    async def start(self, port: int | None = None, metrics_port: int | None = None) -> int:
        """Recover, then listen on the host's address and control_port (port=0: any, for
        tests), and serve /metrics on its metrics_port (`metrics_port`, else 0 when port is
        0, else the config's; a metrics_port of 0 in the config switches it off). Returns
        the port."""
        self.audit.ensure_open()  # AuditError: another controld runs on this home
        self.recover()
        await asyncio.to_thread(self._grow_left_small)
        self._worker = asyncio.create_task(self._work_loop())
        self._finish_spares()
        self._agreed_task = asyncio.create_task(self._watch_agreed())
        self._warm_task = asyncio.create_task(self._keep_warm())
        if self.datasets.enabled:
            self._datasets_task = asyncio.create_task(self.datasets.run())
        self._server = await asyncio.start_server(
            self._serve_conn, self.host.address, self.host.control_port if port is None else port
        )
        bound = self._server.sockets[0].getsockname()[1]
        if self.host.metrics_port:
            mport = metrics_port if metrics_port is not None else 0 if port == 0 else None
            await self.metrics_server.start(self.host.metrics_port if mport is None else mport)
        log.info("controld %s (principal %d) listening on %s:%d, %s backend, %d replicas",
                 self.host.name, self.me, self.host.address, bound, self.hv.kind,
                 len(self.inventory.replicas()))  # fmt: skip
        return int(bound)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
        await self.announcer.close()
        await self.metrics_server.close()
        # The agreement replicas run on (as libvirt domains do): a restarted controld adopts
        # them (controld/agreed.py); `zz rack stop|down` stop them first with agreed_stop.
        tasks = (self._worker, self._datasets_task, self._agreed_task, self._warm_task)
        background = [t for t in tasks if t is not None] + list(self._spares.values())
        background += [t for t, _, _ in self._grows.values()]
        background += [t for _, _, t in self._prioritised.values()]
        for t in [*self._tasks, *background]:
            t.cancel()
        for t in [*self._tasks, *background]:
            with contextlib.suppress(BaseException):
                await t
        # Read clones of the runtimes' ZFS snapshots go with us (a stale one would be
        # destroyed by the next controld that opens the dataset anyway).
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.snapshots.release)
        self.warm.close()
        self.audit.close()

    async def _watch_agreed(self, every: float = 0.5) -> None:
        """Notice an agreement replica that exits (counted, noted, reported; not restarted:
        controld/agreed.py says why)."""
        while True:
            await asyncio.sleep(every)
            try:
                self.agreed.poll()
            except Exception:  # never let the watch die: it is what reports the deaths
                self.counters["internal_error"] += 1
                log.exception("agreement replica watch failed")

    async def _keep_warm(self, every: float = 0.25) -> None:
        """Stage each new stable checkpoint for this host's sleeping replicas (controld/warm.py,
        docs/controld.md "Warm spares"), in a thread: the fetches block."""
        while True:
            await asyncio.sleep(every)
            try:
                await asyncio.to_thread(self.warm.turn, self.inventory.replicas())
            except Exception:
                self.counters["internal_error"] += 1
                log.exception("warm spares: turn failed")

    def _warm_stable(self, svc: Service) -> int | None:
        """The service's stable execution checkpoint as the agreement replicas' stats files
        readable here say (the highest; one replica's word, which only decides what is
        staged: the woken runtime takes nothing it cannot verify)."""
        seqs = [s["exec_stable"] for s in agreement_stats(self.config, svc, 5.0)
                if s is not None and isinstance(s.get("exec_stable"), int)]  # fmt: skip
        return max(seqs) if seqs else None

    async def idle(self) -> None:
        """Wait until every queued certificate action is done and every fresh spare they
        started is provisioned (or given up): tests, bench, reset."""
        while True:
            await self._work.join()
            spares = list(self._spares.values())
            if not spares:
                return
            await asyncio.wait(spares)

    def _note(self, line: str) -> None:
        # zz drill parses these lines (docs/controld.md): change their wording with it.
        log.info("%s", line)
        self.recent.append(f"{time.strftime('%H:%M:%S')} {line}")
        lines = self._lines.get()
        if lines is not None:
            lines.append(line)

    # ---- the audit log (zz/audit.py, docs/audit.md) -----------------------------------------
    def _audit(
        self,
        kind: str,
        verdict: str,
        raws: Sequence[bytes],
        m: wire.Message | None = None,
        err: certs.CertError | None = None,
        **fields: Any,
    ) -> None:
        """Append one entry (fsynced) before anything is acted on. A log that cannot be
        written is counted and noted, and the certificate is still acted on: a full disk
        must not stop a recovery."""
        header: dict[str, Any] = {"kind": kind, "verdict": verdict}
        if m is not None:
            header.update(service=m.service, sender=m.sender)
            seq = getattr(m, "seq", None)
            if isinstance(seq, int):
                header["seq"] = seq
        if err is not None:
            header.update(reason=err.reason, detail=err.detail)
        header.update(fields)
        try:
            written = self.audit.append(header, raws)
        except audit.AuditError as e:
            self.counters["audit_failed"] += 1
            self._note(f"audit log: {e}")
            return
        self.counters["audit_entries" if written is not None else "audit_suppressed"] += 1

    def _audit_sent(self, raw: bytes) -> None:
        """A SPARE-READY this controld signed and sends (controld/announce.py)."""
        try:
            m: wire.Message | None = wire.decode(raw)
        except (wire.WireError, ValueError):
            m = None
        more = {"replica": m.replica, "epoch": m.epoch} if isinstance(m, wire.SpareReady) else {}
        self._audit("spare-ready", "sent", [raw], m, **more)

    # ---- transport --------------------------------------------------------------------------
    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lim = self.limits
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) else "-"
        if self._conns_open >= lim.max_conns or self._conns_by_source[source] >= (
            lim.max_conns_per_source
        ):
            self.counters["conns_refused"] += 1
            if self._conns_open < lim.max_conns:
                self.counters["conns_refused_source"] += 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            return
        self._conns_open += 1
        self._conns_by_source[source] += 1
        lock = asyncio.Lock()  # replies of concurrent operations never interleave bytes
        challenge = fileserve.Challenge()  # FILE-FETCHes on this connection carry it

        async def send(frame: bytes) -> None:
            async with lock:
                if writer.is_closing():
                    raise ConnectionResetError("connection dropped")
                writer.write(frame)
                try:
                    async with asyncio.timeout(lim.send_timeout):
                        await writer.drain()
                except TimeoutError:
                    self.counters["send_timeouts"] += 1
                    writer.transport.abort()
                    raise ConnectionResetError("peer does not read") from None

        loop = asyncio.get_running_loop()
        auth_deadline: float | None = loop.time() + lim.unauth_timeout
        try:
            while True:
                try:
                    raw = await self._read_frame(reader, auth_deadline)
                except wire.FrameError:
                    self.counters["framing"] += 1
                    count_peer(self.dropped_by_source, source)
                    return
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except TimeoutError as e:
                    self.counters[str(e)] += 1
                    return
                try:
                    if await self._on_message(raw, send, challenge):
                        auth_deadline = None
                    else:  # dropped: it did not decode, authenticate or verify
                        count_peer(self.dropped_by_source, source)
                except (ConnectionError, OSError):
                    return
                except Exception:  # a bug must not take the daemon down: count and log
                    self.counters["internal_error"] += 1
                    log.exception("message handling failed")
        finally:
            self._conns_open -= 1
            self._conns_by_source[source] -= 1
            if self._conns_by_source[source] <= 0:
                del self._conns_by_source[source]
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _read_frame(self, reader: asyncio.StreamReader, auth_deadline: float | None) -> bytes:
        """One frame within the limits: at most max_frame bytes (the reader's buffer grows
        only with the bytes that arrive), complete within frame_timeout of its length, and
        before auth_deadline while the connection has authenticated nothing. A timeout is
        raised as TimeoutError naming its counter."""
        lim = self.limits
        loop = asyncio.get_running_loop()

        def left(cap: float | None) -> float | None:
            if auth_deadline is None:
                return cap
            rest = auth_deadline - loop.time()
            return rest if cap is None else min(cap, rest)

        try:
            async with asyncio.timeout(left(None)):
                hdr = await reader.readexactly(4)
        except TimeoutError:
            raise TimeoutError("unauth_timeouts") from None
        n = int.from_bytes(hdr, "big")
        if n < wire.HDR_LEN or n > lim.max_frame:
            raise wire.FrameError(f"frame length {n} outside {wire.HDR_LEN}..{lim.max_frame}")
        body_left = left(lim.frame_timeout)
        try:
            async with asyncio.timeout(body_left):
                return await reader.readexactly(n)
        except TimeoutError:
            unauth = (
                auth_deadline is not None
                and body_left is not None
                and body_left < lim.frame_timeout
            )
            raise TimeoutError("unauth_timeouts" if unauth else "frame_timeouts") from None

    async def _on_message(
        self,
        raw: bytes,
        send: Callable[[bytes], Awaitable[None]],
        challenge: fileserve.Challenge | None = None,
    ) -> bool:
        """Handle one message; whether it authenticated (then the connection no longer
        needs to within unauth_timeout). `challenge` is the connection's (none: a fresh
        one, as for a connection of this one message)."""
        try:
            m = wire.decode(raw)
        except (wire.WireError, ValueError):
            self.counters["malformed"] += 1
            return False
        if isinstance(m, wire.Control):
            return await self._on_control(m, send)
        if isinstance(m, wire.Wakeup):
            return self._on_wakeup(m, raw)
        if isinstance(m, wire.Shutdown):
            return self._on_shutdown(m, raw)
        if isinstance(m, wire.FileFetch):
            return await self._on_file_fetch(m, send, challenge or fileserve.Challenge())
        if isinstance(m, wire.SpareReady):
            return self._on_spare_ready(m, raw)
        self.counters["unexpected_type"] += 1
        return False

    # ---- SPARE-READY of another host's re-keyed slot (docs/wire.md "Key epochs") ----------
    def _on_spare_ready(self, m: wire.SpareReady, raw: bytes) -> bool:
        """Another host's controld announces a re-keyed slot's new keys (its Announcer sends
        every announcement of an epoch above 0 to every controld of the rack too). Verified
        against the rack's public keys, an epoch above the one this host knows is kept in
        the key directory (spare-p<id>.msg), where this host's runtimes (PeerKeys), its own
        key view and its agreement replicas at their next start take it from: on a rack
        keyed per host nothing else brings it here, and a fresh spare could fetch no state
        from this host's replicas or controld (their FILE-FETCH signatures verify under its
        new key only)."""
        svc = self._service_by_id(m.service)
        refused = None
        if svc is None or m.sender == self.me or m.epoch == 0:
            refused = certs.CertError("unexpected-type", "not another host's re-keyed slot")
        elif not keyfiles.service_dir(self.config.rack.key_dir, svc.id).is_dir():
            refused = certs.CertError("unknown-service", f"service {svc.name} not carried here")
        else:
            try:
                rack_public = keyfiles.load_public(
                    keyfiles.service_dir(self.config.rack.key_dir, RACK_SERVICE) / "public"
                )
                keyfiles.verify_spare_ready(raw, self.config, svc, rack_public)
            except (keyfiles.SpareKeyError, keyfiles.KeyFileError, OSError) as e:
                refused = certs.CertError("bad-signature", str(e))
        if refused is not None or svc is None:
            self.counters["spare_ready_refused"] += 1
            self._audit("spare-ready", "refused", [raw], m, refused)
            return False
        principal = wire.exec_principal(m.replica)
        try:
            known = keyfiles.slot_keys(self.config.rack.key_dir, self.config, svc).get(principal)
        except keyfiles.KeyFileError:
            known = None
        if known is not None and known.epoch >= m.epoch:
            # On one machine the hosts share the key directory: the re-keying controld
            # wrote it there, but this host's guests hold copies of their own.
            self.counters["spare_ready_known"] += 1
            self._refresh_guest_keys(svc)
            return True
        path = keyfiles.spare_cert_path(self.config.rack.key_dir, svc.id, principal)
        write_atomic(path, raw.hex() + "\n", durable=True)
        self.counters["spare_ready_stored"] += 1
        self._audit("spare-ready", "stored", [raw], m, replica=m.replica, epoch=m.epoch)
        self._note(f"{svc.name}/{m.replica}: key epoch {m.epoch} announced by controld"
                   f" {m.sender}: kept in {path.name}")  # fmt: skip
        self._refresh_guest_keys(svc)
        return True

    def _refresh_guest_keys(self, svc: Service) -> None:
        """Give this host's guests of svc the key directory's current announcements
        (actions.refresh_guest_keys): a guest's copy is made at its provisioning, and one
        provisioned before a slot's re-key would refuse the successor's FILE-FETCHes. Not
        needed at the re-key itself: the re-keying host holds no other replica of the
        service (_placement_check), and the successor's copy is made after it."""
        if self.hv.kind == "process" or self.ctx.fake_guests:
            return  # process runtimes read the key directory itself
        for rec in self.inventory.replicas():
            if rec.service != svc.name or rec.state == inv.CONVICTED:
                continue
            try:
                n = refresh_guest_keys(self.ctx, svc, svc.exec_state_dir(self.config, rec.index))
            except OSError as e:
                self.counters["guest_keys_failed"] += 1
                self._note(f"{svc.name}/{rec.index}: key announcements not copied to the"
                           f" guest: {e}")  # fmt: skip
                continue
            if n:
                self.counters["guest_keys_refreshed"] += 1
                self._note(f"{svc.name}/{rec.index}: the guest's key copy took {n} new"
                           " announcement file(s)")  # fmt: skip

    # ---- FILE-FETCH: checkpoint files of this host's replicas -------------------------------
    async def _on_file_fetch(
        self,
        m: wire.FileFetch,
        send: Callable[[bytes], Awaitable[None]],
        challenge: fileserve.Challenge,
    ) -> bool:
        svc = self._service_by_id(m.service)
        if svc is None:
            self.counters["file_fetch_wrong_sender"] += 1
            return False
        refused = m.refusal(self.keys.services.get(svc.id, {}), svc.n_exec)
        if refused is not None:  # not from a replica of the service: no answer
            self.counters[refused] += 1
            return False
        unbound = challenge.check(self.me, m.target, m.challenge)
        if unbound is not None:  # for another server or connection, or the first one
            counter, r = unbound
            self.counters[counter] += 1
            out = wire.FileData(svc.id, self.me, m.seq, m.path, m.offset, r.status, 0, r.data)
            await send(wire.frame(out.encode()))
            return True
        _, idx = wire.principal_kind(m.sender)
        if fileserve.bad_range(m.offset, m.length):
            self.counters["file_fetch_bad_range"] += 1
        r = await asyncio.to_thread(
            self.snapshots.read, svc, idx, m.seq, m.path_text(), m.offset, m.length, m.sha256
        )
        served = r.status in (fileserve.OK, fileserve.LATER, fileserve.COPY)
        self.counters["file_chunks_served" if served else "file_fetch_misses"] += 1
        if r.status == fileserve.COPY:
            self.counters["file_copies_served"] += 1
        # Copies whose bytes did not hash to what the manifest said: skipped, never sent.
        self.counters["file_copies_mismatched"] = self.snapshots.copy_counters["mismatched"]
        out = wire.FileData(svc.id, self.me, m.seq, m.path, m.offset, r.status, r.size, r.data)
        await send(wire.frame(out.encode()))
        return True

    # ---- CONTROL ----------------------------------------------------------------------------
    async def _on_control(self, m: wire.Control, send: Callable[[bytes], Awaitable[None]]) -> bool:
        key = self.keys.operators.get(m.sender)
        if m.service != RACK_SERVICE or key is None:
            self.counters["control_unknown_principal"] += 1
            return False
        if not m.verify_mac(self.me, key):
            self.counters["control_bad_mac"] += 1
            return False
        await self._on_authentic_control(m, key, send)
        return True

    async def _on_authentic_control(
        self, m: wire.Control, key: bytes, send: Callable[[bytes], Awaitable[None]]
    ) -> None:

        async def reply(body: dict[str, Any]) -> None:
            await send(control_reply(self.me, m.sender, key, m.request_id, body))

        if not self.ledger.accept_request(m.sender, m.request_id):
            self.counters["control_replayed"] += 1
            await reply({"ok": False, "final": True, "error": f"request id {m.request_id} reused"})
            return
        try:
            req = decode_json(m.json)
            op = req.get("op")
            if not isinstance(op, str):
                raise ValueError("no 'op'")
        except ValueError as e:
            self.counters["control_bad_request"] += 1
            if isinstance(e, JsonTooDeep):
                self.counters["control_json_too_deep"] += 1
            await reply({"ok": False, "final": True, "error": f"bad request: {e}"})
            return
        self.counters["control_ok"] += 1
        task = asyncio.create_task(self._run_op(op, req, reply))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_op(self, op: str, req: dict[str, Any], reply: Send) -> None:
        ops: dict[str, Callable[[dict[str, Any], Send], Awaitable[dict[str, Any]]]] = {
            "status": self._op_status,
            "list": self._op_list,
            "provision": self._op_provision,
            "destroy": self._op_destroy,
            "forensics": self._op_forensics,
            "purge_forensics": self._op_purge_forensics,
            "agreed_start": self._op_agreed_start,
            "agreed_stop": self._op_agreed_stop,
            "agreed_list": self._op_agreed_list,
            "agreed_log": self._op_agreed_log,
            "halt": self._op_halt,
            "exec_status": self._op_exec_status,
            "reset": self._op_reset,
            "drill_fault": self._op_drill_fault,
            "drill_crash": self._op_drill_crash,
        }
        try:
            fn = ops.get(op)
            if fn is None:
                raise OpError(f"unknown op {op!r}; one of {', '.join(sorted(ops))}")
            body = await fn(req, reply)
            body = {"ok": True, **body}
        except (OpError, AgreedError, inv.IllegalTransition, KeyError, ValueError,
                StorageError) as e:  # fmt: skip
            self.counters["control_failed"] += 1
            body = {"ok": False, "error": str(e).strip('"')}
        except (HypervisorError, OSError) as e:
            self.counters["control_failed"] += 1
            body = {"ok": False, "error": str(e)}
        except Exception as e:  # a bug: the operator still gets a final answer
            self.counters["internal_error"] += 1
            log.exception("op %s failed", op)
            body = {"ok": False, "error": f"internal error: {type(e).__name__}: {e}"}
        body["final"] = True
        if "service" in req and "index" in req:
            rec = self._find(req)
            body["replica"] = asdict(rec) if rec is not None else None
        with contextlib.suppress(ConnectionError, OSError):
            await reply(body)

    def _find(self, req: dict[str, Any]) -> inv.Replica | None:
        try:
            return self.inventory.get(self._service(req).name, int(req["index"]))
        except (KeyError, ValueError, TypeError, OverflowError, OpError):
            return None

    def _service(self, req: dict[str, Any]) -> Service:
        try:
            return self.config.service(req["service"])
        except (KeyError, ConfigError):
            raise OpError(f"unknown service {req.get('service')!r}") from None

    def _index(self, svc: Service, req: dict[str, Any]) -> int:
        idx = req.get("index")
        if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < svc.n_exec:
            raise OpError(f"{svc.name}: index must be an integer in 0..{svc.n_exec - 1}")
        return idx

    async def _op_status(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        return {
            "host": self.host.name,
            "principal": self.me,
            "backend": self.hv.kind,
            # How this controld was started (`zz rack up` with rack.controlds = "hosts"
            # takes the rack's store from them, and a drill needs drill_faults).
            "store": self.ctx.store,
            "zfs_pool": self.ctx.zfs_pool,
            "drill_faults": self.ctx.drill_faults,
            "uptime_s": round(time.time() - self.started, 1),
            "replicas": [asdict(r) for r in self.inventory.replicas()],
            "counters": dict(sorted(self.counters.items())),
            "in_doubt_at_start": self.in_doubt_at_start,
            "lost": self.lost,
            "orphans": self.orphans[-32:],
            "freshness": json.loads(self.freshness.to_json()),
            "audit": self.audit.status(),
            "metrics": self.metrics_server.status(),
            "recent": list(self.recent),
            "wakes": list(self.wakes),
            "warm": self.warm.status(),
            "agreed": await asyncio.to_thread(self.agreed.describe),
            "runtimes": await asyncio.to_thread(self._runtimes),
        }

    async def _op_exec_status(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        return {"runtimes": await asyncio.to_thread(self._runtimes)}

    def _runtimes(self) -> list[dict[str, Any]]:
        """Each execution replica slot placed here: the status file its runtime rewrites
        every second (docs/execution.md; a guest's is in its share), `status_age_s` and
        `status_written_at` (its mtime; both null when there is none), and `checkpoint`:
        the seq of its newest checkpoint manifest in its state directory (null: none)."""
        out = []
        now = time.time()
        for svc, i in self._slots():
            d: dict[str, Any] = {"service": svc.name, "index": i, "status": None,
                                 "status_age_s": None, "status_written_at": None,
                                 "checkpoint": None}  # fmt: skip
            manifests = svc.exec_state_dir(self.config, i) / "manifests"
            with contextlib.suppress(OSError):
                seqs = [m.name.removeprefix("ckpt-").removesuffix(".manifest")
                        for m in manifests.glob("ckpt-*.manifest")]  # fmt: skip
                d["checkpoint"] = max((int(n) for n in seqs if n.isdigit()), default=None)
            path = svc.exec_status_path(self.config, i)
            with contextlib.suppress(OSError, ValueError):
                mtime = path.stat().st_mtime
                st = json.loads(path.read_text())
                if isinstance(st, dict):
                    d["status"], d["status_age_s"] = st, round(now - mtime, 3)
                    # This host's clock when the file was written (a guest writes it over
                    # 9p, QEMU on the host sets the mtime): with the status's own `mono_now`
                    # it places the runtime's `wake_marks` on this clock (zz drill).
                    d["status_written_at"] = mtime
            out.append(d)
        return out

    async def _op_list(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        recs = self.inventory.replicas()
        shown = await asyncio.to_thread(lambda: [self._observed(r) for r in recs])
        return {
            "replicas": [
                {
                    "service": r.service,
                    "index": r.index,
                    "role": r.role,
                    "state": r.state,
                    "pending": r.pending,
                    "domain": r.domain,
                    "error": r.error,
                    "hv_state": hv_state,
                    "consistent": consistent,
                }  # fmt: skip
                for r, (hv_state, consistent) in zip(recs, shown, strict=True)
            ]
        }

    def _observed(self, rec: inv.Replica) -> tuple[str, bool | None]:
        """What the hypervisor shows for a record's domain (`gone` when it has none) and
        whether that agrees with the record's state (None: it could not be asked; a record
        pending an action counts as agreeing). `zz rack up` re-provisions a replica whose
        record it contradicts (docs/operations.md)."""
        try:
            shown = self.hv.state(rec.domain)
        except DomainNotFound:
            shown = "gone"
        except HypervisorError as e:
            return f"unknown ({e})", None
        if rec.pending is not None:
            return shown, True
        try:
            return shown, rec.state in inv.consistent_states(self.hv, rec)
        except HypervisorError:
            return shown, None

    def _placement_check(self, svc: Service, index: int) -> None:
        """Only replicas the config places here, and at most one execution replica of a
        service per host (docs/design.md §1): one faulty host can then take down one replica
        of a service, not two."""
        placed = svc.exec_host(self.config, index)
        if placed.index != self.host.index:
            raise OpError(
                f"{svc.name}/{index} is placed on host {placed.name}, not {self.host.name}"
            )
        for r in self.inventory.replicas():
            if r.service == svc.name and r.index != index and r.state != inv.CONVICTED:
                raise OpError(
                    f"{svc.name}/{r.index} is already on {self.host.name}: at most one execution"
                    " replica of a service per host"
                )

    async def _provision(
        self,
        svc: Service,
        index: int,
        mode: str,
        role: str | None = None,
        inject_fault: str | None = None,
        successor_of: int | None = None,
    ) -> dict[str, Any]:
        """Provision `svc`/`index` in `mode` (the inventory written ahead). A fresh spare
        (`successor_of`, the SHUTDOWN's seq) is stopped by a halt (self._halt)."""
        domain = domain_name(self.config, svc, index)
        with contextlib.suppress(KeyError):
            old = self.inventory.get(svc.name, index)
            if old.state == inv.CONVICTED and old.pending is None:
                # Destroyed already (controld stopped before forgetting it): only the
                # record is left, and it must not block the slot.
                self.inventory.remove(svc.name, index)
        # A domain (or save file) of that name the inventory does not know: never adopt or
        # overwrite it (the settle step of a failed create would take it for ours).
        try:
            await asyncio.to_thread(self.hv.state, domain)
            raise OpError(f"a domain {domain} exists on this host outside the inventory")
        except DomainNotFound:
            pass
        if actions.save_path(self.ctx, domain).exists():
            raise OpError(f"{actions.save_path(self.ctx, domain)} exists outside the inventory")
        # A runtime an earlier controld left behind (killed mid-provision) would hold the
        # port and the state directory: end it first (docs/controld.md "Orphans").
        await asyncio.to_thread(self.reconcile_orphans, (svc, index))
        save = str(actions.save_path(self.ctx, domain)) if mode == "hibernated" else None
        role = role or ("active" if index < svc.active else "standby")
        out: dict[str, Any] = {}

        stop = {"stop": self._halt} if successor_of is not None else {}

        def act() -> None:
            out.update(actions.provision(self.ctx, svc, index, mode, inject_fault, **stop))

        t0 = time.monotonic()
        await self.inventory.aprovision(svc.name, index, role, domain, mode, act, save_file=save,
                                        successor_of=successor_of)  # fmt: skip
        self.metrics.provision(svc, index, mode, time.monotonic() - t0)
        self._note(f"provisioned {svc.name}/{index} {mode} ({domain}) {out}")
        return out

    async def _op_provision(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        svc = self._service(req)
        index = self._index(svc, req)
        mode = req.get("mode", svc.sleep)
        if mode not in MODES:
            raise OpError(f"mode must be one of {', '.join(MODES)}")
        if not svc.uses_execution_replicas:
            raise OpError(f"service {svc.name!r}: app {svc.app!r} has no execution replicas")
        # Drills (zz drill): start the runtime with --inject-fault (process backend only).
        fault = req.get("inject_fault")
        if fault is not None:
            if fault not in FAULTS or mode != "active":
                raise OpError(f"inject_fault must be one of {', '.join(FAULTS)}, mode active")
        self._placement_check(svc, index)
        self._halt.clear()  # an operator provisions again (`zz rack start`): not halted
        await reply(
            {"ok": True, "final": False, "progress": f"booting {svc.name}/{index}, then {mode}"}
        )
        out = await self._provision(svc, index, mode, inject_fault=fault)
        if mode != "active":  # a standby: the agreement replicas may count it as a spare
            self.announcer.announce(svc, index, 0)
        return out

    async def _op_destroy(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        svc = self._service(req)
        index = self._index(svc, req)
        rec = self.inventory.get(svc.name, index)
        await reply({"ok": True, "final": False, "progress": f"destroying {rec.domain}"})
        await self._destroy(rec)
        return {"destroyed": rec.domain}

    async def _op_forensics(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        items = await asyncio.to_thread(actions.forensics, self.ctx)
        return {"forensics": [asdict(i) for i in items]}

    async def _op_purge_forensics(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        """Remove the kept states of convicted replicas older than `older_than_s` seconds
        (required: forensic evidence is never dropped by default)."""
        age = req.get("older_than_s")
        # NaN passes `age < 0` and makes every `now - created < age` false: it would
        # purge every kept state.
        if (
            not isinstance(age, int | float)
            or isinstance(age, bool)
            or not math.isfinite(age)
            or age < 0
        ):
            raise OpError(f"older_than_s: a finite number of seconds >= 0 is required, not {age!r}")
        # Our read clones of forensic datasets (copies by hash) would block their destroy.
        await asyncio.to_thread(self.snapshots.release_forensics)
        items = await asyncio.to_thread(actions.forensics, self.ctx)
        now = time.time()
        purged, failed = [], []
        for item in items:
            if now - item.created < age:
                continue
            try:
                await asyncio.to_thread(actions.purge_forensic, self.ctx, item)
            except (OSError, StorageError) as e:
                failed.append({"name": item.name, "error": str(e)})
                continue
            purged.append(item.name)
            self._note(f"purged forensic state {item.name}")
        return {"purged": purged, "failed": failed}

    async def _op_halt(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        """Destroy every running domain (process) of this rack on this host: each replica
        the inventory holds, records kept as they are (the hypervisor then shows them gone:
        `list` says inconsistent, `zz rack start` provisions them again on their state), and
        any other domain named zz-<rack>-*. What `zz rack stop` and `down` do before they
        stop controld, which leaves libvirt domains running; a save file stays. First every
        fresh spare's provisioning is stopped and waited for (it destroys what it had
        created and is not tried again), so no domain is created after the destroys; until
        the next `provision` or `reset` no certificate starts one."""
        prefix = f"zz-{self.config.rack.name}-"
        self._halt.set()
        while self._spares:  # none starts while halted (_start_fresh_spare)
            spares = dict(self._spares)
            names = ", ".join(f"{svc.name}/{x}" for svc in self.config.services
                              for x in range(svc.n_exec) if (svc.id, x) in spares)  # fmt: skip
            self._note(f"halt: stopping the provisioning of {names}")
            await asyncio.wait(list(spares.values()))

        def halt() -> tuple[list[str], list[str]]:
            names = [r.domain for r in self.inventory.replicas() if r.state != inv.CONVICTED]
            names += [n for n in self.hv.list() if n.startswith(prefix) and n not in names]
            destroyed, failed = [], []
            for name in names:
                try:
                    self.hv.destroy(name)
                except DomainNotFound:
                    continue
                except HypervisorError as e:
                    failed.append(f"{name}: {e}")
                    continue
                destroyed.append(name)
            return destroyed, failed

        destroyed, failed = await asyncio.to_thread(halt)
        for name in destroyed:
            self._note(f"halted: {name} destroyed (its record and state kept)")
        return {"destroyed": destroyed, "failed": failed}

    async def _op_reset(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        """The rack's state on this host goes, for a new rack from seq 0 (`zz rack down` with
        rack.controlds = "hosts", docs/operations.md): once the certificate worker is idle,
        every agreement replica here stopped, every domain of the rack destroyed and every
        inventory record forgotten; the execution replicas' state (directories, datasets),
        the agreement replicas' views and logs (controld/reset.py), the agreement replica
        records, the replay guard and the rounds remembered in memory. Forensic states stay
        unless `purge_forensics`; logs, the audit log and the keys stay."""
        purge = req.get("purge_forensics", False)
        if not isinstance(purge, bool):
            raise OpError(f"purge_forensics must be true or false, not {purge!r}")
        await reply({"ok": True, "final": False, "progress": "waiting for actions in flight"})
        try:
            await asyncio.wait_for(self.idle(), 120.0)
        except TimeoutError:
            raise OpError(
                "a certificate action or a fresh spare's provisioning is still running after"
                " 120 s: try again"
            ) from None
        stopped, killed = await asyncio.to_thread(
            self.agreed.stop, self.agreed.running_names(), 15.0
        )
        halted = await self._op_halt({}, reply)
        for rec in self.inventory.replicas():
            if rec.pending is not None:
                raise OpError(f"{rec.service}/{rec.index} is pending {rec.pending}: try again")
            await self._destroy(rec)  # (its domain is gone: halt) its save file too, forgotten
        await asyncio.to_thread(self.snapshots.release)
        await asyncio.to_thread(self.snapshots.release_forensics)
        pool = self.ctx.zfs_pool if self.ctx.store == "zfs" else None
        out = await asyncio.to_thread(
            reset.clear, self.config, self._slots(), self.agreed.placed(), pool, purge
        )
        self.agreed.forget()
        self.freshness = certs.Freshness()
        self.freshness_path.unlink(missing_ok=True)
        self.collectors.clear()
        self._announced.clear()
        self._woken_for.clear()
        self._sibling_seqs.clear()
        self._halt.clear()
        self._note(f"reset: {len(out['deleted'])} paths and datasets deleted, {len(out['kept'])}"
                   " forensic states kept")  # fmt: skip
        return {"stopped": stopped, "killed": killed, "destroyed": halted["destroyed"],
                "failed": halted["failed"], **out}  # fmt: skip

    # ---- drills (zz drill on a rack whose controlds run on their hosts) ----------------------
    def _drill_slot(self, req: dict[str, Any]) -> tuple[Service, int]:
        if not self.ctx.drill_faults:
            raise OpError(
                f"controld {self.host.name} runs without --drill-faults: it lets no drill"
                " switch or crash its runtimes (a production controld)"
            )
        svc = self._service(req)
        index = self._index(svc, req)
        placed = svc.exec_host(self.config, index)
        if placed.index != self.host.index:
            raise OpError(
                f"{svc.name}/{index} is placed on host {placed.name}, not {self.host.name}"
            )
        return svc, index

    async def _op_drill_fault(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        """Switch replica `index`'s injected fault in place (its runtime reads
        <state>/zz-fault.json every 20 ms, docs/execution.md): `fault` one of FAULTS or
        null, `lie` (false: corrupt-snapshot without lying yet), `slow_report_ms`."""
        svc, index = self._drill_slot(req)
        fault = req.get("fault")
        if fault is not None and fault not in FAULTS:
            raise OpError(f"fault must be null or one of {', '.join(FAULTS)}, not {fault!r}")
        body: dict[str, Any] = {"fault": fault}
        if "lie" in req:
            if not isinstance(req["lie"], bool):
                raise OpError(f"lie must be true or false, not {req['lie']!r}")
            body["lie"] = req["lie"]
        if "slow_report_ms" in req:
            ms = req["slow_report_ms"]
            if not isinstance(ms, int) or isinstance(ms, bool) or not 0 < ms <= 3_600_000:
                raise OpError(f"slow_report_ms must be an integer in 1..3600000, not {ms!r}")
            body["slow_report_ms"] = ms
        path = svc.exec_state_dir(self.config, index) / FAULT_FILE
        if not path.parent.is_dir():
            raise OpError(f"{svc.name}/{index}: no state directory {path.parent}")
        await asyncio.to_thread(write_atomic, path, json.dumps(body) + "\n")
        self._note(f"drill: {svc.name}/{index} fault {fault}")
        return {"path": str(path), "fault": body}

    async def _op_drill_crash(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        """Crash replica `index` under this controld's feet, as a drill's crash: its
        runtime's process group SIGKILLed (process backend), or its domain destroyed
        (libvirt, a power-off). The inventory is left as it is: the agreement replicas
        must notice, as after a real crash."""
        svc, index = self._drill_slot(req)
        rec = self.inventory.get(svc.name, index)
        if self.hv.kind == "process":
            pid = self.hv.pid(rec.domain)  # type: ignore[attr-defined]
            await asyncio.to_thread(signal_group, pid, signal.SIGKILL)
            self._note(f"drill: {svc.name}/{index} crashed (pid {pid} SIGKILLed)")
            return {"killed_pids": [pid]}
        await asyncio.to_thread(self.hv.destroy, rec.domain)
        self._note(f"drill: {svc.name}/{index} crashed (domain {rec.domain} destroyed)")
        return {"destroyed_domains": [rec.domain]}

    # ---- agreement replicas (controld/agreed.py) ---------------------------------------------
    async def _op_agreed_start(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        """Start agreement replica `replica` of `service` (placed here) on a replica file
        rendered with `overrides` (the rack's --set values); wait up to `wait_s` (default
        60) until it listens."""
        svc, r = self.agreed.replica(req.get("service"), req.get("replica"))
        overrides = _overrides(req.get("overrides", {}))
        wait = _seconds(req, "wait_s", 60.0, MAX_WAIT_S)
        await reply({"ok": True, "final": False, "progress": f"starting {svc.name}/agreed-{r}"})
        rec = await asyncio.to_thread(self.agreed.start, svc, r, overrides, wait)
        return {"agreed": asdict(rec)}

    async def _op_agreed_stop(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        """Stop this host's running agreement replicas (of `service`, or the one
        `replica` of it): SIGTERM (`kill`: SIGKILL, a crash), SIGKILL after `timeout_s`
        (default 15). Each writes its stats file once more as it exits on SIGTERM: `stats`
        has what they left."""
        names = self.agreed.running_names()
        if req.get("service") is not None:
            if req.get("replica") is not None:
                svc, r = self.agreed.replica(req["service"], req["replica"])
                names = [n for n in names if n == f"{svc.name}/agreed-{r}"]
            else:
                svc = self._service(req)
                names = [n for n in names if n.startswith(f"{svc.name}/agreed-")]
        elif req.get("replica") is not None:
            raise OpError("replica needs its service")
        kill = req.get("kill", False)
        if not isinstance(kill, bool):
            raise OpError(f"kill must be true or false, not {kill!r}")
        timeout = _seconds(req, "timeout_s", 15.0, MAX_WAIT_S)
        stopped, killed = await asyncio.to_thread(self.agreed.stop, names, timeout, kill)
        stats = {d["name"]: d["stats"] for d in await asyncio.to_thread(self.agreed.describe)
                 if d["name"] in names}  # fmt: skip
        return {"stopped": stopped, "killed": killed, "stats": stats}

    async def _op_agreed_list(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        return {"agreed": await asyncio.to_thread(self.agreed.describe)}

    async def _op_agreed_log(self, req: dict[str, Any], reply: Send) -> dict[str, Any]:
        svc, r = self.agreed.replica(req.get("service"), req.get("replica"))
        lines = req.get("lines", 50)
        if not isinstance(lines, int) or isinstance(lines, bool) or not 1 <= lines <= MAX_LOG_LINES:
            raise OpError(f"lines must be an integer in 1..{MAX_LOG_LINES}, not {lines!r}")
        tail = await asyncio.to_thread(self.agreed.log_tail, svc, r, lines)
        return {"name": f"{svc.name}/agreed-{r}", "lines": tail}

    async def _destroy(self, rec: inv.Replica) -> None:
        """-> convicted (destroy the domain, drop the save file), then forget it."""
        if rec.state != inv.CONVICTED:
            domain, save = rec.domain, rec.save_file
            await self.inventory.atransition(
                rec.service,
                rec.index,
                inv.CONVICTED,
                lambda: actions.destroy(self.ctx, domain, save),
            )
        self.inventory.remove(rec.service, rec.index)

    # ---- WAKEUP -----------------------------------------------------------------------------
    def _service_by_id(self, sid: int) -> Service | None:
        for s in self.config.services:
            if s.id == sid:
                return s
        return None

    def _on_wakeup(self, m: wire.Wakeup, raw: bytes) -> bool:
        received_at = time.time()
        svc = self._service_by_id(m.service)
        if svc is None:
            self.counters["wakeup_unknown_service"] += 1
            unknown = certs.CertError("unknown-service", f"service {m.service}")
            self._audit("wakeup", "refused", [raw], m, unknown)
            return False
        try:
            w = certs.verify_wakeup(
                raw, keys=self.keys.services[svc.id], f=svc.f, g=svc.g, n_exec=svc.n_exec
            )
        except certs.CertError as e:
            self.counters["wakeup_rejected"] += 1
            self.counters[f"wakeup_rejected:{e.reason}"] += 1
            self._audit("wakeup", "refused", [raw], m, e)
            return False
        decided = {"awake": list(w.awake), "wake": list(w.wake), "signers": list(w.signers)}
        if not w.wake and (asleep := self._asleep_outside(svc, w.awake)):
            # A round that wakes nobody is justified only with nobody asleep (its sender's
            # `sleeping` list is only its claim): one of this service's spares sleeps here,
            # so a correct agreement replica would have woken it. Nothing is recorded, and a
            # WAKEUP that wakes the spare for this round stays fresh.
            e = certs.CertError("spare-asleep", f"{svc.name}/{asleep} sleeps here")
            self.counters["wakeup_rejected"] += 1
            self.counters["wakeup_rejected:spare-asleep"] += 1
            self._audit("wakeup", "refused", [raw], m, e, **decided)
            return False
        try:
            self.freshness.check_wakeup(w)
        except certs.CertError as e:
            self.counters[f"wakeup_{e.reason}"] += 1
            self._audit("wakeup", e.reason, [raw], m, e, **decided)
            return True  # authentic, merely not fresh
        # Recorded before acting: a crash mid-action never acts twice on one certificate.
        self.freshness.acted_wakeup(w)
        self.freshness.save(self.freshness_path)
        self._audit("wakeup", "acted", [raw], m, **decided)
        self.counters["wakeup_accepted"] += 1
        awake = list(w.awake)
        self._note(
            f"WAKEUP {svc.name} seq {w.seq} awake {awake} wake {list(w.wake)} from {m.sender}"
        )
        verified = {"received_at": received_at, "accepted_at": time.time()}
        self._work.put_nowait(("wakeup", (svc, w.seq, awake, list(w.wake), verified)))
        return True

    def _asleep_outside(self, svc: Service, awake: tuple[int, ...]) -> list[int]:
        """This service's replicas asleep (paused or hibernated) on this host outside
        `awake`."""
        return sorted(
            rec.index
            for rec in self.inventory.replicas()
            if rec.service == svc.name
            and rec.index not in awake
            and rec.state in (inv.PAUSED, inv.HIBERNATED)
        )

    async def _act_wakeup(
        self,
        svc: Service,
        seq: int,
        awake: list[int],
        wake: list[int],
        verified: dict[str, float] | None = None,
    ) -> None:
        """Wake each replica of `wake` hosted here. Every wake's steps go to `wakes`
        (status), on this host's wall clock: when the certificate arrived and was accepted
        (`verified`), when the work queue took it, the hypervisor's resume (or restore)
        and the guest agent's wake (a hibernated guest mounts its share and starts its
        runtime there). zz drill turns them into the recovery phases of its report."""
        taken_at = time.time()
        for x in wake:
            try:
                rec = self.inventory.get(svc.name, x)
            except KeyError:
                continue  # hosted elsewhere
            if rec.state not in (inv.PAUSED, inv.HIBERNATED) or rec.pending is not None:
                self.counters["wakeup_not_sleeping"] += 1
                self._note(f"WAKEUP {svc.name}/{x}: is {rec.state}, nothing to wake")
                continue
            if self._halt.is_set():
                self.counters["halted_not_acted"] += 1
                self._note(f"WAKEUP {svc.name}/{x}: halted, not woken")
                continue
            domain, state, save = rec.domain, rec.state, rec.save_file
            # The notice before the resume: a replica that runs again must find the round's
            # seq at once, before it takes any log the agreement replicas serve it (else it
            # may choose a recovery checkpoint by an earlier round's seq: campaign seed 3202
            # round 18, woken again mid-recovery). A wake that fails leaves it for the next.
            notice = actions.wake_notice(self.ctx, svc, x, seq, awake)
            steps = {**(verified or {}), "taken_at": taken_at, "resume_at": time.time()}
            t0 = time.monotonic()
            raised: list[int] = []
            try:
                await self.inventory.atransition(
                    svc.name,
                    x,
                    inv.RECOVERING,
                    lambda d=domain, st=state, sv=save, r=raised: self._wake(d, st, sv, r),
                )
            except (HypervisorError, inv.IllegalTransition, OSError) as e:
                self.counters["action_failed"] += 1
                self._note(f"WAKEUP {svc.name}/{x} failed: {e}")
                continue
            dt = time.monotonic() - t0
            steps["resumed_at"] = time.time()
            if raised:
                self._prioritise(svc, x, domain, raised[0])
            self.counters["woken"] += 1
            self.metrics.woke(svc, x, state, dt)
            self._woken_for[(svc.id, x)] = (seq, tuple(awake))
            try:
                await asyncio.to_thread(actions.guest_wake, self.ctx, domain, seq)
            except HypervisorError as e:
                # It runs (recovering) but its agent did not take the notice: say so.
                self.counters["guest_wake_failed"] += 1
                self._note(f"{svc.name}/{x}: guest agent wake failed: {e}")
            steps["agent_woke_at"] = time.time()
            entry = {"service": svc.name, "index": x, "seq": seq, "from": state,
                     **{k: round(v, 6) for k, v in steps.items()}}  # fmt: skip
            self.wakes.append(entry)
            if state == inv.HIBERNATED and not self.grow_at_restore:
                self._grow_later(svc, x, domain, entry)
            self._note(f"woke {svc.name}/{x} from {state} in {dt * 1000:.1f} ms; notice {notice}")

    def _wake(self, domain: str, state: str, save: str | None, raised: list[int]) -> None:
        """Resume a paused replica; restore a hibernated one without growing its balloon:
        the guest's deflation of the balloon (320 MiB of a 512 MiB guest, 192 MiB saved) is
        work for its vCPU right after the restore, when it runs the whole wake-up (mount,
        runtime, recovery) anew under TCG; it waits for _grow (docs/controld.md "WAKEUP").
        Then its CPU weight is raised (actions.raise_wake_priority; the weight it had is
        appended to `raised`), right after the resume: the guest runs from the resume on."""
        if state == inv.HIBERNATED and not self.grow_at_restore:
            actions.wake(self.ctx, domain, state, save, grow=False)
        else:
            actions.wake(self.ctx, domain, state, save)
        if self.wake_priority and self.hv.kind == "libvirt":
            try:
                before = actions.raise_wake_priority(self.ctx, domain)
            except HypervisorError as e:
                log.warning("%s: raising its CPU weight failed: %s", domain, e)
                before = None
            if before is not None:
                raised.append(before)

    def _prioritise(self, svc: Service, x: int, domain: str, before: int) -> None:
        self.counters["wake_priority_raised"] += 1
        key = (svc.id, x)
        old = self._prioritised.pop(key, None)
        if old is not None:
            old[2].cancel()

        async def later() -> None:
            await asyncio.sleep(self.wake_priority_s)
            await self._lower_priority(svc, x, "timer")

        self._prioritised[key] = (domain, before, asyncio.create_task(later()))

    async def _lower_priority(self, svc: Service, x: int, why: str) -> None:
        """Set a woken guest's CPU weight back, if it is still raised: once a SHUTDOWN
        settles its round (it stays active, or goes back to sleep), or wake_priority_s
        after its wake-up. A convicted one's domain is gone with its weight (dropped)."""
        entry = self._prioritised.pop((svc.id, x), None)
        if entry is None:
            return
        domain, before, timer = entry
        if timer is not asyncio.current_task():
            timer.cancel()
        if why == "convicted":
            return
        try:
            await asyncio.to_thread(actions.lower_wake_priority, self.ctx, domain, before)
        except HypervisorError as e:  # DomainNotFound too
            self.counters["wake_priority_lower_failed"] += 1
            self._note(f"{svc.name}/{x}: setting its CPU weight back failed: {e}")
            return
        self.counters[f"wake_priority_lowered_{why}"] += 1

    def _grow_later(self, svc: Service, x: int, domain: str, entry: dict[str, Any]) -> None:
        self._drop_grow(svc, x)
        key = (svc.id, x)

        async def later() -> None:
            await asyncio.sleep(self.grow_after_s)
            await self._grow(svc, x, "timer")

        self._grows[key] = (asyncio.create_task(later()), domain, entry)

    def _drop_grow(self, svc: Service, x: int) -> None:
        """Forget a pending grow (the replica is convicted or goes back to sleep)."""
        pending = self._grows.pop((svc.id, x), None)
        if pending is not None and pending[0] is not asyncio.current_task():
            pending[0].cancel()

    async def _grow(self, svc: Service, x: int, why: str) -> None:
        """Grow a restored replica's balloon to the full memory, if one waits for it: once
        a SHUTDOWN keeps it active (it has recovered as far as the round needed), or
        grow_after_s after its wake-up, whichever comes first. Until then the guest runs in
        the memory it was saved with; autodeflate gives it pages back under pressure."""
        pending = self._grows.get((svc.id, x))
        if pending is None:
            return
        self._drop_grow(svc, x)
        _, domain, entry = pending
        try:
            await asyncio.to_thread(actions.grow, self.ctx, domain)
        except HypervisorError as e:
            self.counters["grow_failed"] += 1
            self._note(f"{svc.name}/{x}: growing its balloon failed: {e}")
            return
        entry["grown_at"] = round(time.time(), 6)
        self.counters[f"grown_{why}"] += 1
        self._note(f"{svc.name}/{x} balloon grown to {self.ctx.memory_mib} MiB ({why})")

    def _grow_left_small(self) -> None:
        """At start: a replica that runs (active or recovering) with less than the full
        memory was restored by a controld that stopped before it grew the balloon: grow it
        now. Only libvirt guests have a balloon."""
        if self.hv.kind != "libvirt":
            return
        full = self.ctx.memory_mib * 1024
        for rec in self.inventory.replicas():
            if rec.state not in (inv.ACTIVE, inv.RECOVERING) or not rec.domain:
                continue
            try:
                if self.hv.memory_kib(rec.domain) < full:
                    actions.grow(self.ctx, rec.domain)
                    self.counters["grown_at_start"] += 1
                    self._note(f"{rec.service}/{rec.index} balloon grown at start")
            except HypervisorError as e:
                self._note(f"{rec.service}/{rec.index}: growing its balloon at start: {e}")

    # ---- SHUTDOWN ---------------------------------------------------------------------------
    def _on_shutdown(self, m: wire.Shutdown, raw: bytes) -> bool:
        svc = self._service_by_id(m.service)
        if svc is None:
            self.counters["shutdown_unknown_service"] += 1
            unknown = certs.CertError("unknown-service", f"service {m.service}")
            self._audit("shutdown", "refused", [raw], m, unknown)
            return False
        col = self.collectors.get(svc.id)
        if col is None:
            trust = certs.ServiceTrust(svc.id, self.keys.services[svc.id], svc.f, svc.g, svc.n_exec)
            col = self.collectors[svc.id] = certs.ShutdownCollector(trust)
        late = col.late_votes
        try:
            cert = col.add(raw)
        except certs.CertError as e:
            self.counters["shutdown_rejected"] += 1
            self.counters[f"shutdown_rejected:{e.reason}"] += 1
            self._audit("shutdown", "refused", [raw], m, e)
            return False
        self.counters["shutdown_votes"] += 1
        body = {"awake": list(m.awake), "convict": list(m.convict), "sleep": list(m.sleep),
                "active": list(m.active)}  # fmt: skip
        self._audit("shutdown", "late" if col.late_votes > late else "vote", [raw], m, **body)
        if cert is None:
            return True
        # The certificate is an entry of its own, with all g+1 votes: checkable alone.
        whole = {"service": svc.id, "seq": cert.seq, **body, "signers": list(cert.signers)}
        try:
            self.freshness.check_shutdown(cert)
        except certs.CertError as e:
            before = self.freshness.outcome(svc.id)
            merged = self.freshness.merged(cert) if e.reason == "stale" else None
            if merged is not None and before is not None:
                self._merge_shutdown(svc, cert, whole, before, merged)
                return True
            self._audit("shutdown-certificate", e.reason, cert.votes, None, e, **whole)
            self.counters[f"shutdown_{e.reason}"] += 1
            if e.reason == "sibling" and cert.seq < self.freshness.last_shutdown(svc.id):
                self._lower_sibling(svc, cert)
            return True
        self.freshness.acted_shutdown(cert)
        self.freshness.save(self.freshness_path)
        self._audit("shutdown-certificate", "acted", cert.votes, None, **whole)
        col.forget_below(cert.seq)
        self.counters["shutdown_accepted"] += 1
        self._note(f"SHUTDOWN {svc.name} seq {cert.seq} {_lists(cert.outcome)}")
        self._queue_shutdown(svc, cert.outcome, None)
        return True

    def _merge_shutdown(
        self,
        svc: Service,
        cert: certs.Shutdown,
        whole: dict[str, Any],
        before: certs.Outcome,
        merged: certs.Outcome,
    ) -> None:
        """A second certificate at the seq of the SHUTDOWN acted on, over a nested awake
        set, with another body: correct agreement replicas split and each body got g+1
        (campaign seed 3502 round 63). zz-agreed settles on the merge of the two
        (zz.certs.merge_outcomes), and so does this controld: it acts on what the merge
        adds to what it acted on, which is only ever more convicted and fewer active."""
        self.freshness.acted_merge(merged)
        self.freshness.save(self.freshness_path)
        lists = {f"merged_{k}": list(getattr(merged, k)) for k in ("convict", "sleep", "active")}
        self._audit("shutdown-certificate", "merged", cert.votes, None, **whole, **lists)
        self.counters["shutdown_merged"] += 1
        self._note(f"SHUTDOWN {svc.name} seq {merged.seq} {_lists(merged)} (merged with"
                   " another certificate)")  # fmt: skip
        self._queue_shutdown(svc, merged, before)

    def _queue_shutdown(
        self, svc: Service, outcome: certs.Outcome, before: certs.Outcome | None
    ) -> None:
        """Queue the actions of `outcome` that `before` (the outcome acted on at its seq,
        None for the first) did not take: newly convicted, newly asleep, newly active."""
        done = before or certs.Outcome(outcome.service, outcome.seq, (), (), (), ())

        def new(ids: tuple[int, ...], old: tuple[int, ...]) -> list[int]:
            return [x for x in ids if x not in old]

        named = sorted({*outcome.convict, *outcome.sleep, *outcome.active})
        work = (
            svc, outcome.seq, new(outcome.convict, done.convict), new(outcome.sleep, done.sleep),
            new(outcome.active, done.active), named, outcome.awake,
        )  # fmt: skip
        self._work.put_nowait(("shutdown", work))

    def _lower_sibling(self, svc: Service, cert: certs.Shutdown) -> None:
        """A certificate for the round we acted on, at a lower seq: the agreement replicas
        settle on it (check_done), so a fresh spare is announced under its seq too."""
        for x in cert.convict:
            self._sibling_seqs.setdefault((svc.id, x), set()).add(cert.seq)
            raw = self._announced.get((svc.id, x))
            if raw is not None:
                self._announce_as(svc, x, raw, cert.seq)

    def _announce_as(self, svc: Service, x: int, raw: bytes, seq: int) -> None:
        m = wire.decode(raw)
        assert isinstance(m, wire.SpareReady)
        sign = self.keys.secret.sign
        assert sign is not None
        again = wire.SpareReady(m.service, m.sender, m.replica, seq, m.epoch, m.sign_pub, m.dh_pub)
        self.counters["spare_announced_for_sibling"] += 1
        self.announcer.announce(svc, x, seq, again.signed(sign).encode())

    async def _start_fresh_spare(self, svc: Service, x: int, seq: int) -> None:
        """On the certificate worker, right after the conviction: re-key the slot, then hand
        the successor's provisioning (a whole boot: 60-110 s for a TCG guest) to a
        background task, so the worker takes the next certificate at once. A certificate
        naming the slot waits for that task (_wait_for_spares); the inventory record of the
        slot is written ahead (state None, pending the sleep mode) as any provisioning's."""
        # The successor gets new keys (docs/wire.md "Key epochs"): whatever the convicted
        # guest held (its key file was in its share) must not speak for the slot any more.
        try:
            announcement = await asyncio.to_thread(self._rekey, svc, x, seq)
        except (OSError, KeyFileError, ValueError) as e:
            self.counters["action_failed"] += 1
            self._note(f"no fresh spare for {svc.name}/{x}: new keys failed: {e}")
            return
        if self._halt.is_set():
            self.counters["halted_not_acted"] += 1
            self._note(f"{svc.name}/{x}: halted, its successor is not provisioned (the next"
                       " provision of the slot, e.g. by `zz rack start`, is)")  # fmt: skip
            return
        key = (svc.id, x)
        earlier = self._spares.get(key)
        if earlier is not None:  # never two provisionings of one slot (_wait_for_spares)
            await asyncio.wait([earlier])
        self._spawn_spare(svc, x, seq, announcement)
        # Not "fresh spare ...": zz drill takes those lines for failures (exec_faults.py).
        self._note(f"{svc.name}/{x}: successor provisioning in the background")

    def _spawn_spare(
        self, svc: Service, x: int, seq: int, announcement: bytes, finish: bool = False
    ) -> None:
        """The background task of slot x's fresh spare (_fresh_spare), in self._spares."""
        key = (svc.id, x)
        task = asyncio.create_task(self._fresh_spare(svc, x, seq, announcement, finish=finish))
        self._spares[key] = task

        def done(t: asyncio.Task[None]) -> None:
            if self._spares.get(key) is t:
                del self._spares[key]

        task.add_done_callback(done)

    def _announce_spare(self, svc: Service, x: int, seq: int, announcement: bytes) -> None:
        """Slot x's fresh spare sleeps: its SPARE-READY (the re-key's `announcement`) under
        the SHUTDOWN's seq (the agreement replicas may wake it from now on), and under the
        lower siblings' seqs seen meanwhile; its record succeeds no conviction any more."""
        self.announcer.announce(svc, x, seq, announcement)
        self._announced[(svc.id, x)] = announcement
        for lower in sorted(self._sibling_seqs.pop((svc.id, x), set())):
            self._announce_as(svc, x, announcement, lower)
        self.inventory.announced(svc.name, x)

    async def _fresh_spare(
        self,
        svc: Service,
        x: int,
        seq: int,
        announcement: bytes,
        attempts: int = 2,
        finish: bool = False,
    ) -> None:
        """Provision and announce the convicted replica's successor (a background task of
        _start_fresh_spare). A guest that fails to boot (seen: one stopped while booting
        next to five busy TCG guests) is destroyed by provision() and tried once more:
        without it the service stays a spare short. A halt stops it for good. `finish`:
        a stopped controld left it under way (recover()): first finish that boot from
        where the hypervisor shows it (actions.finish_provision); if it is gone or broken,
        what is left is destroyed and it is provisioned anew. Its log lines go into an
        audit entry of its own (`action`, what `fresh-spare`, docs/audit.md)."""
        lines: list[str] = []
        self._lines.set(lines)  # this task's context only: not the worker's action
        began = round(time.time(), 6)
        try:
            if finish and await self._finish_spare(svc, x, seq, announcement):
                return
            for attempt in range(1, attempts + 1):
                if self._halt.is_set():
                    self._note(f"{svc.name}/{x}: halted, its successor is not provisioned")
                    return
                try:
                    self._placement_check(svc, x)
                    await self._provision(svc, x, svc.sleep, role="standby", successor_of=seq)
                    self.counters["reprovisioned"] += 1
                    # Announced only now that it sleeps: the agreement replicas may wake it.
                    self._announce_spare(svc, x, seq, announcement)
                    return
                except OpError as e:
                    self._note(f"no fresh spare for {svc.name}/{x} here: {e}")
                    return
                except actions.Stopped:
                    self.counters["halted_not_acted"] += 1
                    self._note(f"{svc.name}/{x}: halted while its successor was provisioned:"
                               " destroyed, not tried again")  # fmt: skip
                    return
                except (HypervisorError, inv.IllegalTransition, OSError) as e:
                    self.counters["action_failed"] += 1
                    again = "; trying once more" if attempt < attempts else ""
                    self._note(f"fresh spare {svc.name}/{x} failed: {e}{again}")
        except Exception:
            self.counters["internal_error"] += 1
            log.exception("fresh spare %s/%d failed", svc.name, x)
        finally:
            self._audit("action", "done", [], service=svc.id, seq=seq, what="fresh-spare",
                        index=x, began=began, lines=lines)  # fmt: skip

    async def _finish_spare(self, svc: Service, x: int, seq: int, announcement: bytes) -> bool:
        """_fresh_spare's first step after a restart: finish the boot a stopped controld
        left under way. True if the spare sleeps and is announced; False if it is to be
        provisioned anew (the record is then forgotten, what was left destroyed)."""
        rec = self.inventory.get(svc.name, x)
        mode = rec.pending
        assert mode is not None
        self._note(f"{svc.name}/{x}: its successor (of SHUTDOWN seq {seq}) was being"
                   f" provisioned {mode} when controld stopped: finishing it")  # fmt: skip
        out: dict[str, Any] = {}

        def act() -> None:
            out.update(actions.finish_provision(self.ctx, svc, x, mode, stop=self._halt))

        try:
            await self.inventory.afinish(svc.name, x, act)
        except actions.Stopped:
            self.counters["halted_not_acted"] += 1
            self._note(f"{svc.name}/{x}: halted while its successor was finished: destroyed")
            return True
        except (HypervisorError, inv.IllegalTransition, OSError) as e:
            self.counters["spare_reprovisioned_at_start"] += 1
            self._note(f"{svc.name}/{x}: the successor left under way cannot be finished"
                       f" ({e}): what was left is destroyed, provisioning it anew")  # fmt: skip
            return False
        self.counters["spare_finished_at_start"] += 1
        self.counters["reprovisioned"] += 1
        self._note(f"provisioned {svc.name}/{x} {mode} ({rec.domain}) {out}")
        self._announce_spare(svc, x, seq, announcement)
        return True

    def _named_here(self, kind: str, args: tuple[Any, ...]) -> list[int]:
        """The slots of its service a queued certificate action may act on."""
        if kind == "wakeup":
            return list(args[3])  # wake
        svc, named = args[0], args[5]
        return [*named, *(x for sid, x in self._woken_for if sid == svc.id)]

    async def _wait_for_spares(self, kind: str, args: tuple[Any, ...]) -> None:
        """A certificate naming a slot whose fresh spare is being provisioned waits until
        that provisioning is over (the spare sleeps, or it failed and the slot is empty):
        never a wake-up of a half-booted spare, never a second provisioning of the slot.
        The worker waits, so the certificates behind it keep their arrival order."""
        svc, seq = args[0], args[1]
        for x in sorted(set(self._named_here(kind, args))):
            task = self._spares.get((svc.id, x))
            if task is None:
                continue
            self.counters["spare_waited"] += 1
            self._note(f"{kind.upper()} {svc.name} seq {seq} names {svc.name}/{x}: waiting for"
                       " its successor's provisioning")  # fmt: skip
            await asyncio.wait([task])

    def _rekey(self, svc: Service, x: int, seq: int) -> bytes:
        """A new key epoch for slot x (zz.keys.rotate_exec); our key view (PeerKeys) reads
        the announcement it leaves in the key directory."""
        sign = self.keys.secret.sign
        assert sign is not None
        raw = rotate_exec(self.config.rack.key_dir, self.config, svc, x, seq, sign, self.host.index)
        m = wire.decode(raw)
        assert isinstance(m, wire.SpareReady)
        self.counters["rekeyed"] += 1
        self._note(f"{svc.name}/{x}: key epoch {m.epoch} for the successor")
        return raw

    async def _act_shutdown(
        self,
        svc: Service,
        seq: int,
        convict: list[int],
        sleep: list[int],
        active: list[int],
        named: list[int],
        awake: tuple[int, ...],
    ) -> None:
        # A replica woken here for this round (or an earlier one, or a sibling above it: the
        # same awake set) that the certificate does not name goes back to sleep too: agreement
        # replicas that built their WAKEUPs for one round from different evidence can wake
        # different spares (the number woken depends on the rows), this controld acted on the
        # one that woke more, and the round's outcome never counted it (campaign seed 3202, a
        # rerun's round 3: it ran on, asleep in every agreement replica's view).
        settled = [
            k
            for k, (w, a) in self._woken_for.items()
            if k[0] == svc.id and (w <= seq or a == awake)
        ]
        extra = [x for _, x in settled if x not in named]
        for k in settled:
            del self._woken_for[k]
        for x in extra:
            self.counters["woken_not_named"] += 1
            self._note(f"{svc.name}/{x}: woken here, not named by SHUTDOWN seq {seq}: to sleep")
        for x in convict:
            self._drop_grow(svc, x)
            await self._lower_priority(svc, x, "convicted")
            try:
                rec = self.inventory.get(svc.name, x)
            except KeyError:
                continue
            try:
                await self._destroy(rec)
                # Its SPARE-READY announced an incarnation that is gone: a lower sibling of
                # this round must not send it again (_lower_sibling), only the successor's.
                self._announced.pop((svc.id, x), None)
                # Our read clones of its snapshots would follow the dataset into forensics
                # and block purging it later.
                await asyncio.to_thread(self.snapshots.forget, svc, x)
                self.datasets.forget(svc, x)
                kept = await asyncio.to_thread(actions.set_aside_state, self.ctx, svc, x, seq)
                self.counters["convicted"] += 1
                self.metrics.convicted(svc, x)
                self._note(f"convicted {svc.name}/{x} destroyed; state kept as {kept}")
            except (HypervisorError, inv.IllegalTransition, OSError, StorageError) as e:
                self.counters["action_failed"] += 1
                self._note(f"SHUTDOWN {svc.name}/{x} destroy failed: {e}")
                continue
            await self._start_fresh_spare(svc, x, seq)
        for x in [*sleep, *extra]:
            self._drop_grow(svc, x)  # hibernate() balloons it down (or back up if it fails)
            await self._lower_priority(svc, x, "settled")
            try:
                rec = self.inventory.get(svc.name, x)
            except KeyError:
                continue
            if rec.state not in (inv.RECOVERING, inv.ACTIVE):
                continue
            mode = svc.sleep
            domain = rec.domain
            save = str(actions.save_path(self.ctx, domain)) if mode == "hibernated" else None
            try:
                await self.inventory.atransition(
                    svc.name,
                    x,
                    mode,
                    lambda d=domain, md=mode: actions.put_to_sleep(self.ctx, d, md),
                    save_file=save,
                )
                self._note(f"{svc.name}/{x} back to sleep ({mode})")
            except (HypervisorError, inv.IllegalTransition, OSError) as e:
                self.counters["action_failed"] += 1
                self._note(f"SHUTDOWN {svc.name}/{x} sleep failed: {e}")
        # The round is decided and keeps these running: a woken one has recovered as far as
        # the round needed (it reported the round's seq), so it is active from now on.
        for x in active:
            await self._grow(svc, x, "recovered")
            await self._lower_priority(svc, x, "settled")
            try:
                rec = self.inventory.get(svc.name, x)
            except KeyError:
                continue
            if rec.state != inv.RECOVERING or rec.pending is not None:
                continue
            try:
                await self.inventory.atransition(svc.name, x, inv.ACTIVE, lambda: None)
            except inv.IllegalTransition as e:
                self._note(f"SHUTDOWN {svc.name}/{x} active failed: {e}")
                continue
            self._note(f"{svc.name}/{x} active (recovered, kept by SHUTDOWN seq {seq})")

    # ---- the certificate worker -------------------------------------------------------------
    async def _work_loop(self) -> None:
        while True:
            kind, args = await self._work.get()
            lines: list[str] = []
            token = self._lines.set(lines)
            began = round(time.time(), 6)
            try:
                await self._wait_for_spares(kind, args)
                if kind == "wakeup":
                    await self._act_wakeup(*args)
                else:
                    await self._act_shutdown(*args)
            except Exception:
                self.counters["internal_error"] += 1
                log.exception("%s action failed", kind)
            finally:
                # What the certificate led to, in the words of the log lines (audit story).
                self._lines.reset(token)
                svc, seq = args[0], args[1]
                self._audit("action", "done", [], service=svc.id, seq=seq, what=kind,
                            began=began, lines=lines)  # fmt: skip
                self._work.task_done()
