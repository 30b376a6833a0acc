# controld/agreed.py - the agreement replicas (zz-agreed) the rack places on this host:
# controld starts, stops and watches them, and says how each is doing (docs/controld.md).
"""Agreement replicas under controld (ops `agreed_start`, `agreed_stop`, `agreed_list`,
`agreed_log`; docs/controld.md "Agreement replicas").

Each replica runs as `zz-agreed --conf run/s<id>/agreed-<r>.conf` in its own session, its
output appended to `run/s<id>/agreed-<r>.log`; its replica file is rendered here
(`zz.render.render_replica`, with the rack's `--set` overrides the operator passes). One
record per replica is kept in `<home>/agreed.json` (pid **and** kernel start time, so a
recycled pid is never signalled), written before the process is waited on, so a controld
that restarts finds the replicas still running and adopts them (it can signal them but
not learn their exit status: `exit_status` null).

States of a record:

    (none) --start--> running --exits on its own--> exited
                         |     --agreed_stop------> stopped
    exited | stopped --start--> running

**No automatic restart.** Without `rack.durability` a restarted zz-agreed has lost its log,
view and checkpoints, and rejoins as an amnesiac replica until state transfer brings it
up; at most `g` replicas of a service may be in that state, and only the operator (`zz
rack up`, which counts the dead ones of each service across every host) can see how many
are. One controld sees only its own host, so it reports a replica that exited (counter
`agreed_exited`, a log line, `agreed_list`) and leaves the restart to the operator.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from zz import render
from zz.atomicfile import write_atomic
from zz.config import Config, ConfigError, Host, Service
from zz.procrack import repo_env, signal_group, spawn, start_ticks
from zz.status import agreed_stats_path

RECORDS = "agreed.json"
RUNNING, EXITED, STOPPED = "running", "exited", "stopped"
MAX_LOG_LINES = 1000
MAX_WAIT_S = 600.0


class AgreedError(Exception):
    """An agreement replica cannot be started or stopped as asked; the message says why."""


@dataclass
class AgreedRecord:
    """One agreement replica this controld started (or adopted after a restart)."""

    service: str
    replica: int
    state: str  # running, exited, stopped
    pid: int
    ticks: int  # kernel start time: pid + ticks is the process's identity
    started_at: float
    ended_at: float | None = None
    exit_status: int | None = None  # None while running, or when not our child (adopted)
    adopted: bool = False  # running when this controld started: not its child

    @property
    def name(self) -> str:
        return f"{self.service}/agreed-{self.replica}"

    def alive(self) -> bool:
        return start_ticks(self.pid) == self.ticks


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of a log, reading at most its last 1 MiB."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - (1 << 20)))
            text = fh.read().decode(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


class AgreedReplicas:
    """The agreement replicas placed on `host`. Calls are synchronous (the daemon runs the
    slow ones, start and stop, with asyncio.to_thread); one lock keeps the records
    consistent, one per replica serialises its start and stop."""

    def __init__(
        self,
        config: Config,
        host: Host,
        home: Path,
        binary: Path,
        note: Callable[[str], None],
        counters: Counter[str],
    ) -> None:
        self.config = config
        self.host = host
        self.binary = binary
        self.path = home / RECORDS
        self._note = note
        self.counters = counters
        self._lock = threading.Lock()
        self._replica_locks: dict[str, threading.Lock] = {}
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._stopping: set[str] = set()  # being stopped: poll() leaves them to stop()
        self.records: dict[str, AgreedRecord] = {}

    # ---- placement --------------------------------------------------------------------------
    def placed(self) -> list[tuple[Service, int]]:
        """The agreement replicas the config places on this host."""
        return [
            (s, r)
            for s in self.config.services
            for r in range(s.n)
            if self.config.replica_host(s, r).index == self.host.index
        ]

    def replica(self, service: object, replica: object) -> tuple[Service, int]:
        """The named agreement replica, which must be placed here (AgreedError naming what
        is wrong otherwise)."""
        try:
            svc = self.config.service(str(service))
        except (KeyError, ConfigError):
            raise AgreedError(f"unknown service {service!r}") from None
        if not isinstance(replica, int) or isinstance(replica, bool) or not 0 <= replica < svc.n:
            raise AgreedError(f"{svc.name}: replica must be an integer in 0..{svc.n - 1}")
        placed = self.config.replica_host(svc, replica)
        if placed.index != self.host.index:
            raise AgreedError(f"{svc.name}/agreed-{replica} is placed on host {placed.name},"
                              f" not {self.host.name}")  # fmt: skip
        return svc, replica

    def paths(self, svc: Service, r: int) -> tuple[Path, Path]:
        """(replica file, log) of agreement replica r."""
        run = self.config.rack.run_dir / f"s{svc.id}"
        return run / f"agreed-{r}.conf", run / f"agreed-{r}.log"

    # ---- records ----------------------------------------------------------------------------
    def load(self) -> None:
        """At start: the records of an earlier controld. A replica still running (same pid
        and start time) is adopted; one gone meanwhile is `exited`, its status unknown."""
        try:
            data = json.loads(self.path.read_text())
            recs = [AgreedRecord(**d) for d in data]
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError) as e:
            self._note(f"agreement replicas: {self.path} unreadable ({e}); starting without it")
            return
        with self._lock:
            for rec in recs:
                if rec.state == RUNNING:
                    if rec.alive():
                        rec.adopted = True
                        self._note(f"agreed {rec.name} (pid {rec.pid}) runs: adopted")
                    else:
                        rec.state, rec.ended_at, rec.exit_status = EXITED, time.time(), None
                        self.counters["agreed_exited"] += 1
                        self._note(f"agreed {rec.name} (pid {rec.pid}) exited while controld"
                                   " was down; not restarted")  # fmt: skip
                self.records[rec.name] = rec
            self._save()

    def _save(self) -> None:
        data = [asdict(r) for r in sorted(self.records.values(), key=lambda r: r.name)]
        write_atomic(self.path, json.dumps(data, indent=1) + "\n", durable=True)

    def _replica_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._replica_locks.setdefault(name, threading.Lock())

    # ---- start, stop, watch -----------------------------------------------------------------
    def start(
        self, svc: Service, r: int, overrides: Mapping[str, Any], wait_s: float
    ) -> AgreedRecord:
        """Render the replica file, start zz-agreed on it and wait until it accepts on its
        port. AgreedError when it runs already, the binary is missing, the port is not
        listening within `wait_s` (it is stopped again) or it exits (with its log's tail)."""
        name = f"{svc.name}/agreed-{r}"
        with self._replica_lock(name):
            self.poll()
            old = self.records.get(name)
            if old is not None and old.state == RUNNING:
                raise AgreedError(f"{name} runs already (pid {old.pid})")
            if not self.binary.exists():
                raise AgreedError(f"{self.binary} not built: make -C agreement")
            conf, log = self.paths(svc, r)
            try:
                render.render_replica(self.config, svc, r, overrides)
            except ConfigError as e:
                raise AgreedError(f"{name}: {e}") from None
            log.parent.mkdir(parents=True, exist_ok=True)
            p = spawn([str(self.binary), "--conf", str(conf)], log, repo_env())
            ticks = start_ticks(p.pid)
            rec = AgreedRecord(svc.name, r, RUNNING, p.pid, ticks or 0, time.time())
            with self._lock:
                self._children[name] = p
                self.records[name] = rec
                self._save()
            self.counters["agreed_started"] += 1
            self._wait_listening(rec, p, log, wait_s)
            self._note(f"agreed {name} started (pid {p.pid})")
            return rec

    def _wait_listening(
        self, rec: AgreedRecord, p: subprocess.Popen[bytes], log: Path, wait_s: float
    ) -> None:
        addr = self.config.replica_address(self.config.service(rec.service), rec.replica)
        deadline = time.monotonic() + wait_s
        while True:
            if p.poll() is not None:
                self.poll()
                tail = "\n".join(_tail(log, 15))
                raise AgreedError(f"{rec.name} exited while starting ({p.returncode}):\n{tail}")
            with contextlib.suppress(OSError), socket.create_connection(addr, timeout=0.5):
                return
            if time.monotonic() > deadline:
                self.stop([rec.name], timeout=5.0)
                raise AgreedError(f"{rec.name} not listening on {addr[0]}:{addr[1]} after"
                                  f" {wait_s:g} s; stopped again")  # fmt: skip
            time.sleep(0.05)

    def stop(
        self, names: list[str], timeout: float, kill: bool = False
    ) -> tuple[list[str], list[str]]:
        """SIGTERM (with `kill`: SIGKILL) each named running replica's process group and
        wait up to `timeout` for it; one still running then is SIGKILLed. Returns (stopped,
        killed): killed are those that needed the SIGKILL after the timeout."""
        stopped: list[str] = []
        killed: list[str] = []
        live = []
        with self._lock:
            for name in names:
                rec = self.records.get(name)
                if rec is None or rec.state != RUNNING or name in self._stopping:
                    continue
                if self._running(rec):  # never signal a pid that may have been reused
                    self._stopping.add(name)
                    live.append(rec)
        self.poll()  # those that were gone already: exited
        try:
            for rec in live:
                signal_group(rec.pid, signal.SIGKILL if kill else signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for rec in live:
                while self._running(rec) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if self._running(rec):
                    signal_group(rec.pid, signal.SIGKILL)
                    killed.append(rec.name)
                    end = time.monotonic() + 10
                    while self._running(rec) and time.monotonic() < end:
                        time.sleep(0.05)
                else:
                    stopped.append(rec.name)
                signal_group(rec.pid, signal.SIGKILL)  # anything left in its group
                with self._lock:
                    p = self._children.pop(rec.name, None)
                    rec.exit_status = p.poll() if p is not None else None
                    rec.state, rec.ended_at = STOPPED, time.time()
                    self._save()
                how = "killed (SIGKILL)" if kill or rec.name in killed else "stopped"
                self._note(f"agreed {rec.name} (pid {rec.pid}) {how}, status {rec.exit_status}")
        finally:
            with self._lock:
                self._stopping.difference_update(r.name for r in live)
        return stopped, killed

    def _running(self, rec: AgreedRecord) -> bool:
        p = self._children.get(rec.name)
        if p is not None:
            return p.poll() is None  # reaps it: a zombie would still look alive
        return rec.alive()

    def poll(self) -> list[AgreedRecord]:
        """Mark every running replica whose process is gone as `exited` (with its status
        when it was our child), count and note it; returns those. Never restarts one (the
        module's docstring says why)."""
        gone = []
        with self._lock:
            for rec in self.records.values():
                if rec.state != RUNNING or rec.name in self._stopping or self._running(rec):
                    continue
                p = self._children.pop(rec.name, None)
                rec.state, rec.ended_at = EXITED, time.time()
                rec.exit_status = p.returncode if p is not None else None
                gone.append(rec)
            if gone:
                self._save()
        for rec in gone:
            self.counters["agreed_exited"] += 1
            self._note(f"agreed {rec.name} (pid {rec.pid}) exited, status {rec.exit_status};"
                       " not restarted (zz rack up repairs it)")  # fmt: skip
        return gone

    def forget(self) -> list[str]:
        """Drop the records of every replica that is not running (op `reset`: a new rack
        starts them anew); the names dropped."""
        with self._lock:
            gone = sorted(n for n, r in self.records.items() if r.state != RUNNING)
            for name in gone:
                del self.records[name]
            self._save()
        return gone

    def running_names(self) -> list[str]:
        return sorted(n for n, r in self.records.items() if r.state == RUNNING)

    # ---- what the operator sees -------------------------------------------------------------
    def describe(self) -> list[dict[str, Any]]:
        """Every agreement replica placed here: its record (state `not started` without
        one), address, log path, its last stats file (`stats`, with `stats_age_s`, as
        zz-agreed rewrites it every status_interval_ms; null when there is none;
        `stats_current`: written since the recorded process started),
        `rss_mib` while it runs, and `on_disk`: whether its data directory (write-ahead
        log, rack.durability) holds anything."""
        self.poll()
        out = []
        now = time.time()
        for svc, r in self.placed():
            name = f"{svc.name}/agreed-{r}"
            rec = self.records.get(name)
            conf, log = self.paths(svc, r)
            addr = self.config.replica_address(svc, r)
            d: dict[str, Any] = {"service": svc.name, "replica": r, "name": name,
                                 "state": "not started", "address": addr[0], "port": addr[1],
                                 "log": str(log)}  # fmt: skip
            if rec is not None:
                d.update(asdict(rec))
            d["stats"], d["stats_age_s"], d["stats_current"] = None, None, False
            path = agreed_stats_path(conf.parent, r)
            with contextlib.suppress(OSError, ValueError):
                mtime = path.stat().st_mtime
                stats = json.loads(path.read_text())
                if isinstance(stats, dict):
                    d["stats"], d["stats_age_s"] = stats, round(now - mtime, 3)
                    # Written by the process of the record, not left by an earlier one.
                    d["stats_current"] = rec is not None and mtime >= rec.started_at
            data = conf.parent / f"agreed-{r}.data"
            d["on_disk"] = data.is_dir() and any(data.iterdir())
            d["rss_mib"] = _rss_mib(rec.pid) if rec is not None and rec.state == RUNNING else None
            out.append(d)
        return out

    def log_tail(self, svc: Service, r: int, lines: int) -> list[str]:
        return _tail(self.paths(svc, r)[1], lines)
