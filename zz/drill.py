# zz/drill.py - `zz drill KIND CONFIG`: fault injection against a rack that is up (zz rack up),
# under recorded KV load; watches the replicas and controlds, writes the report (zz/report.py).
"""Fault-injection drills (docs/operations.md, "Drills").

One drill = KV clients recording a history (zz/history.py) on the kv services of a running
rack, `--before` seconds of load, the fault, `--after` seconds of watching, then the
verdicts. Observed on one monotonic clock, every 100 ms:

* agreement replicas' stats files (view, view change, every counter: exec_mismatches,
  exec_timeouts, and whatever fault detection adds), the first change after the fault
  of any counter is a detection event;
* every controld's `status` (CONTROL RPC as operator 0): counters `wakeup_accepted`,
  `woken`, `shutdown_accepted`, `convicted`, `reprovisioned`, and its `recent` lines,
  which name the replicas woken, convicted and provisioned.

Nothing is inferred that was not observed: a drill whose fault pipeline (detection in
zz-agreed, WAKEUP/SHUTDOWN to controld, recovery) did not act says FAIL and names the
missing step; a kind that cannot be injected into this rack refuses before starting.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zz import history as zh
from zz import kvop, wire
from zz import report as rp
from zz.atomicfile import write_atomic
from zz.client import Client, ClientParams, ClientTimeout
from zz.config import Config, Service, load
from zz.drillfaults import FAULT_FILE
from zz.naming import domain_name
from zz.procrack import DEFAULT_AGREED, leftover_pids, signal_group
from zz.rackctl import (
    ProcRecord,
    RackError,
    _save_state,
    _start,
    load_state,
    operator_call,
)

KINDS = (
    "primary",
    "client-flood",
    "slow-reader",
    "mac-split",
    "wrong-reply",
    "crash",
    "slow",
    "corrupt-snapshot",
    "byzantine-host",
)
# Drill kind -> the runtime's --inject-fault (zz/drillfaults.py FAULTS).
RUNTIME_FAULT = {
    "wrong-reply": "wrong-reply",
    "slow": "slow-report",
    "byzantine-host": "wrong-reply",
}
POLL_S = 0.1
# How long a corrupt-snapshot victim may take to have a corrupted checkpoint
# stable: up to two checkpoint intervals of load (TCG guests: ~10 s each).
CORRUPT_WAIT_S = 120.0
# Agreement stats counters whose first change after the fault is the detection: the view
# (primary), or a signed fault statement / mismatch / WAKEUP sent (execution faults).
# exec_timeouts alone is not: late reports happen under load without any fault.
PRIMARY_KEYS = ("view", "in_view_change", "view_changes")
DETECT_KEYS = ("fault_statements_sent", "exec_mismatches", "wakeups_sent")
KEYS_PER_DRILL = 4
# slow-reader: a client that never reads its replies, on SLOW_CONNS connections to every
# agreement replica, sending read-only requests of SLOW_OP bytes (each echoed back in a
# reply of that size) at SLOW_RATE bytes/s per replica. The verdict's bounds, against the
# quiet seconds before the fault: honest throughput at least SLOW_MIN_THROUGHPUT of it, p99
# latency at most SLOW_MAX_P99 times it (or SLOW_P99_FLOOR_MS, whichever is more), and no
# agreement replica's RSS more than SLOW_MAX_RSS_MIB above where it was.
SLOW_CONNS = 3
SLOW_OP = 256 << 10
SLOW_RATE = 8 << 20
SLOW_MIN_THROUGHPUT = 0.5
SLOW_MAX_P99 = 3.0
SLOW_P99_FLOOR_MS = 250.0
SLOW_MAX_RSS_MIB = 32.0
# mac-split: a client whose requests authenticate at the backups but not at the primary
# (its MAC entry for the current primary is garbage), MAC_SPLIT_RATE new ones a second to
# every agreement replica, every other one also as a signed copy with a wrong signature.
# Before signed requests each such request made the backups suspect a correct primary
# (22 view changes in 30 s). Bounds: no view change at all, and honest throughput and p99
# as for slow-reader (SLOW_MIN_THROUGHPUT, SLOW_MAX_P99, SLOW_P99_FLOOR_MS).
MAC_SPLIT_RATE = 50.0
# Drills with no execution fault: nothing may be detected, no spare woken.
CLIENT_FAULTS = ("primary", "client-flood", "slow-reader", "mac-split")

Progress = Callable[[str], None]


class DrillError(Exception):
    """The drill cannot run against this rack (not up, no kv service, unsupported kind)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=KINDS, metavar="KIND", help=" | ".join(KINDS))
    p.add_argument("config", metavar="CONFIG", help="rack config (TOML) of a rack that is up")
    p.add_argument("--service", help="the kv service to load and fault (default: the first kv)")
    p.add_argument(
        "--replica", type=int, help="execution replica to fault (default: first running)"
    )
    p.add_argument("--host", help="byzantine-host: the host (default: the faulted replica's)")
    p.add_argument("--clients", type=int, default=4, help="KV clients per service (default 4)")
    p.add_argument("--first-client", type=int, help="first client index (default: clients-16)")
    p.add_argument("--before", type=float, default=3.0, help="load before the fault (s)")
    p.add_argument("--after", type=float, default=12.0, help="watching after the fault (s)")
    p.add_argument(
        "--after-recovery",
        type=float,
        metavar="S",
        help="end the watch S seconds after the fault is handled (a replica convicted, no"
        " fault round open, every convicted replica's fresh spare back asleep) if that is"
        " before --after ends (default: watch all of --after)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=180.0,
        help="after --after, up to this long until the fault round is decided and a convicted"
        " replica's fresh spare is up (s)",
    )
    p.add_argument(
        "--cp-phase",
        type=int,
        metavar="K",
        help="kv load only: before the fault, pause the load and bring the service to a seq"
        " = K mod checkpoint_interval with nothing in flight (0: right after a checkpoint,"
        " checkpoint_interval-1: right before the next one)",
    )
    p.add_argument("--out", type=Path, help="report directory (default run/drills/KIND-TIME)")
    p.add_argument(
        "--http",
        metavar="URL",
        help="HTTP load on the guestbook served at URL by zz proxy (with --service), instead"
        " of KV clients",
    )


# ---- observation --------------------------------------------------------------------------
@dataclass
class Event:
    t_ns: int  # time.monotonic_ns() when observed
    source: str  # "kv/agreed-1", "controld h1" (a log line), "controld h1 counters"
    what: str
    t: float = 0.0  # seconds after the fault (negative: before), set by mark_fault/evaluate


@dataclass
class Observer:
    """Polls stats files and controlds; remembers the baseline at the fault and every
    change after it."""

    config: Config
    services: list[Service]
    fault_ns: int = 0
    events: list[Event] = field(default_factory=list)
    agreed: dict[str, dict[str, Any]] = field(default_factory=dict)
    agreed_base: dict[str, dict[str, Any]] = field(default_factory=dict)
    controld: dict[str, dict[str, Any]] = field(default_factory=dict)
    controld_base: dict[str, dict[str, int]] = field(default_factory=dict)
    recent_seen: set[str] = field(default_factory=set)
    errors: Counter[str] = field(default_factory=Counter)

    def now(self) -> int:
        return time.monotonic_ns()

    def rel(self) -> list[Event]:
        """Every event with `t` set relative to the fault."""
        for e in self.events:
            e.t = (e.t_ns - self.fault_ns) / 1e9
        return self.events

    def read_agreed(self) -> None:
        for s in self.services:
            for r in range(s.n):
                name = f"{s.name}/agreed-{r}"
                d = _agreed_stats(self.config, s, r)
                if d is None:
                    continue
                old = self.agreed.get(name)
                self.agreed[name] = d
                if old is None:
                    continue
                for k, v in d.items():
                    if isinstance(v, int | float) and not isinstance(v, bool) and old.get(k) != v:
                        if k in ("view", "in_view_change") or _is_fault_counter(k):
                            self.events.append(Event(self.now(), name, f"{k} {old.get(k)} -> {v}"))

    async def poll(self) -> None:
        """One observation of every agreement replica and controld, then POLL_S of rest."""
        self.read_agreed()
        await self.read_controlds()
        await asyncio.sleep(POLL_S)

    async def read_controlds(self) -> None:
        async def one(h: Any) -> None:
            try:
                st = await operator_call(self.config, h, {"op": "status"}, timeout=3.0)
            except Exception as e:  # a controld that is down is itself an observation
                self.errors[f"controld {h.name}: {type(e).__name__}"] += 1
                return
            if not st.get("ok", True):
                return
            old = self.controld.get(h.name)
            self.controld[h.name] = st
            if old is None:
                self.recent_seen |= {f"{h.name} {line}" for line in st.get("recent", [])}
                return
            for k, v in st.get("counters", {}).items():
                # control_* count our own status polls: noise.
                if old.get("counters", {}).get(k) != v and not k.startswith("control_"):
                    self.events.append(
                        Event(self.now(), f"controld {h.name} counters", f"{k} -> {v}")
                    )
            for line in st.get("recent", []):
                key = f"{h.name} {line}"
                if key not in self.recent_seen:
                    self.recent_seen.add(key)
                    # controld prefixes its lines with HH:MM:SS; our clock is better.
                    text = re.sub(r"^\d\d:\d\d:\d\d ", "", line)
                    self.events.append(Event(self.now(), f"controld {h.name}", text))

        await asyncio.gather(*(one(h) for h in self.config.hosts))

    def mark_fault(self) -> None:
        self.fault_ns = time.monotonic_ns()
        self.agreed_base = {k: dict(v) for k, v in self.agreed.items()}
        self.controld_base = {k: dict(v.get("counters", {})) for k, v in self.controld.items()}

    def counter_delta(self, name: str) -> int:
        total = 0
        for h, st in self.controld.items():
            total += st.get("counters", {}).get(name, 0) - self.controld_base.get(h, {}).get(
                name, 0
            )
        return total

    def first(self, pred: Callable[[Event], bool]) -> Event | None:
        for e in self.rel():
            if e.t >= 0 and pred(e):
                return e
        return None

    def lines(self, pattern: str, before: bool = False) -> list[tuple[float, str]]:
        """(t, line) of the controld log lines matching `pattern`, after the fault (or,
        with `before`, before it)."""
        rx = re.compile(pattern)
        return [
            (e.t, f"{e.source.split()[1]}: {e.what}")
            for e in self.rel()
            if e.source.startswith("controld")
            and not e.source.endswith("counters")
            and (e.t < 0) == before
            and rx.search(e.what)
        ]


def _agreed_stats(config: Config, s: Service, r: int) -> dict[str, Any] | None:
    path = config.rack.run_dir / f"s{s.id}" / f"agreed-{r}.stats.json"
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _is_fault_counter(key: str) -> bool:
    return any(w in key for w in ("mismatch", "timeout", "fault", "wakeup", "shutdown", "convict"))


# ---- load ---------------------------------------------------------------------------------
@dataclass
class Load:
    recorders: dict[str, zh.HistoryRecorder]
    tally: Counter[str]
    stop: asyncio.Event
    tasks: list[asyncio.Task[None]]
    # HTTP load (--http): (call, return or None, ok) in monotonic ns, and POST message ->
    # the entry id it was acknowledged with.
    http: list[tuple[int, int | None, bool]] = field(default_factory=list)
    acked: dict[str, int] = field(default_factory=dict)
    # kv load: workers start an op only while `gate` is set; `inflight` counts started ops.
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    inflight: Counter[str] = field(default_factory=Counter)


# ---- HTTP load on a guestbook behind zz proxy (--http URL) --------------------------------
HTTP_TIMEOUT_S = 35.0


async def _http(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    method: str,
    target: str,
    body: bytes | None = None,
) -> tuple[int, bytes, bool]:
    """One HTTP/1.1 request on a keep-alive connection: (status, body, server closes)."""
    head = f"{method} {target} HTTP/1.1\r\nHost: zz\r\n"
    if body is not None:
        head += "Content-Type: application/x-www-form-urlencoded\r\n"
        head += f"Content-Length: {len(body)}\r\n"
    writer.write(head.encode() + b"\r\n" + (body or b""))
    await writer.drain()
    parts = (await reader.readline()).split()
    if len(parts) < 2 or not parts[1].isdigit():
        raise ConnectionError(f"bad status line {b' '.join(parts)[:80]!r}")
    length, close = 0, False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"connection" and b"close" in value.lower():
            close = True
    return int(parts[1]), await reader.readexactly(length), close


def _http_addr(url: str) -> tuple[str, int]:
    m = re.fullmatch(r"http://([^/:]+):(\d+)/?", url)
    if not m:
        raise DrillError(f"--http {url!r}: expected http://HOST:PORT/")
    return m.group(1), int(m.group(2))


async def _http_worker(url: str, w: int, load: Load, stamp: str) -> None:
    """POST / a new guestbook entry, every 10th request GET /entries.json; one request at
    a time on one keep-alive connection, reconnecting after an error."""
    from urllib.parse import quote

    host, port = _http_addr(url)
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    k = 0
    try:
        while not load.stop.is_set():
            is_get = k % 10 == 9
            msg = f"drill {stamp} w{w} #{k}"
            call = time.monotonic_ns()
            try:
                # Above zz proxy's 30 s in main.sh: in TCG guests the first reply after a
                # fault can take ~10 s, and a client that gives up earlier only retries.
                async with asyncio.timeout(HTTP_TIMEOUT_S):
                    if conn is None:
                        conn = await asyncio.open_connection(host, port)
                    if is_get:
                        status, body, close = await _http(*conn, "GET", "/entries.json")
                    else:
                        form = f"name=drill&message={quote(msg)}".encode()
                        status, body, close = await _http(*conn, "POST", "/", form)
            except (OSError, EOFError, TimeoutError, ValueError, asyncio.IncompleteReadError):
                load.http.append((call, None, False))
                load.tally["http_errors"] += 1
                if conn is not None:
                    conn[1].close()
                conn = None
                # The next attempt is a new entry: the one that timed out may still be
                # executed, and must then not count as a duplicate of an acknowledged one.
                k += 1
                await asyncio.sleep(0.1)
                continue
            m = re.match(rb"added entry (\d+)", body)
            ok = status == 200 if is_get else (status == 303 and m is not None)
            load.http.append((call, time.monotonic_ns(), ok))
            load.tally["ok" if ok else f"http_{status}"] += 1
            if ok and not is_get and m is not None:
                load.acked[msg] = int(m.group(1))
            if close and conn is not None:
                conn[1].close()
                conn = None
            k += 1
    finally:
        if conn is not None:
            conn[1].close()


def _start_http_load(url: str, clients: int) -> Load:
    load = Load({}, Counter(), asyncio.Event(), [])
    stamp = f"{time.time_ns():x}"
    load.tasks = [asyncio.create_task(_http_worker(url, w, load, stamp)) for w in range(clients)]
    return load


async def _entries(url: str) -> list[dict[str, Any]]:
    host, port = _http_addr(url)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        async with asyncio.timeout(30.0):
            status, body, _ = await _http(reader, writer, "GET", "/entries.json")
    finally:
        writer.close()
    if status != 200:
        raise DrillError(f"GET /entries.json: HTTP {status}")
    data = json.loads(body)
    return data if isinstance(data, list) else []


async def _worker(
    client: Client, rec: zh.HistoryRecorder, seed: int, load: Load, keys: list[bytes]
) -> None:
    rng = random.Random(seed)
    kc = rec.client(client, timeout=8.0)
    seen: dict[bytes, bytes | None] = {}
    n = 0
    stop, tally = load.stop, load.tally
    try:
        while not stop.is_set():
            if not load.gate.is_set():
                await load.gate.wait()
                continue
            key = rng.choice(keys)
            n += 1
            value = b"s%d-%d" % (seed, n)
            r = rng.random()
            load.inflight["kv"] += 1
            try:
                if r < 0.4:
                    reply = await kc.get(key)
                    seen[key] = reply.value if reply.ok else None
                elif r < 0.8:
                    await kc.put(key, value)
                else:
                    await kc.cas(key, seen.get(key), value)
                tally["ok"] += 1
            except ClientTimeout:
                tally["timeouts"] += 1
            finally:
                load.inflight["kv"] -= 1
    finally:
        await client.close()


def _start_load(config: Config, services: list[Service], clients: int, first: int | None) -> Load:
    """`clients` recording kv clients per service. Keys are fresh per drill (the store
    keeps earlier drills' keys, and the checker assumes every key starts absent)."""
    stamp = b"%x" % time.time_ns()
    keys = [b"d%s-k%d" % (stamp, k) for k in range(KEYS_PER_DRILL)]
    load = Load({}, Counter(), asyncio.Event(), [])
    load.gate.set()
    for s in services:
        base = first if first is not None else max(0, s.clients - 16)
        if base + clients > s.clients:
            raise DrillError(f"{s.name}: clients {base}..{base + clients - 1} exceed {s.clients}")
        rec = load.recorders[s.name] = zh.HistoryRecorder()
        for i in range(clients):
            c = Client(ClientParams.from_config(config, s.name, base + i))
            load.tasks.append(asyncio.create_task(_worker(c, rec, s.id * 1000 + i, load, keys)))
    return load


_EXEC_NAME = re.compile(r"(.+)/exec-(\d+)")


def _awaiting_spares(obs: Observer) -> set[str]:
    """ "svc/i" convicted by a SHUTDOWN some controld acted on whose fresh spare is not
    provisioned yet (a host re-provisions its convicted replicas one after the other), or
    not yet back in the agreement replicas' sleeping set (its SPARE-READY is sent once the
    guest is paused; until they have it, a next fault could not wake it)."""
    convicted = set()
    for _, line in obs.lines(r"^SHUTDOWN \S+ seq \d+ convict \["):
        m = re.search(r"SHUTDOWN (\S+) seq \d+ convict \[([\d, ]*)\]", line)
        if m:
            convicted |= {f"{m.group(1)}/{x.strip()}" for x in m.group(2).split(",") if x.strip()}
    restored = {
        m.group(1)
        for _, line in obs.lines(r"^provisioned \S+ (paused|hibernated)")
        if (m := re.search(r"provisioned (\S+) ", line))
    }
    # Services whose zz-agreed reports its sleeping set (fault detection on), and it.
    watched, sleeping = set(), set()
    for name, d in obs.agreed.items():
        if "exec_sleeping" in d:
            svc = name.split("/agreed-", 1)[0]
            watched.add(svc)
            sleeping |= {f"{svc}/{i}" for i in d.get("exec_sleeping") or []}
    return {
        c
        for c in convicted
        if c not in restored or (c.split("/", 1)[0] in watched and c not in sleeping)
    }


def _fault_handled(obs: Observer) -> bool:
    """A replica convicted since the fault, no fault round open and no convicted replica
    waiting for its fresh spare: what --after-recovery waits for."""
    convicted = obs.lines(r"^SHUTDOWN \S+ seq \d+ convict \[\d")
    return bool(convicted) and not _open_rounds(obs) and not _awaiting_spares(obs)


def _open_rounds(obs: Observer) -> set[str]:
    """Services with a fault round still undecided at g+1 of their agreement replicas (so
    at a correct one: a stopped replica's last stats may say anything). A woken replica
    that cannot report the round's seq leaves it to the WAKE_RESOLVE timeout (5 s plus
    the detection ceiling) to decide without it."""
    open_at: Counter[str] = Counter()
    for name, d in obs.agreed.items():
        if d.get("fault_round_open"):
            open_at[name.split("/agreed-", 1)[0]] += 1
    return {s.name for s in obs.services if open_at[s.name] >= s.g + 1}


# ---- the drill ----------------------------------------------------------------------------
class Drill:
    def __init__(self, config: Config, args: argparse.Namespace, progress: Progress) -> None:
        self.config = config
        self.args = args
        self.kind: str = args.kind
        self.progress = progress
        self.watched_s: float = args.after  # how long the watch after the fault really ran
        state = load_state(config)
        if state is None or not state.complete:
            raise DrillError(f"rack {config.rack.name!r} is not up: zz rack up {config.path}")
        dead = [p.name for p in state.procs if not p.alive()]
        if dead:
            raise DrillError(
                f"rack {config.rack.name!r} is degraded ({', '.join(dead)} not running):"
                f" zz rack down {config.path} && zz rack up {config.path}"
            )
        self.state = state
        kvs = [s for s in config.services if s.app == "kv"]
        self.http: str | None = getattr(args, "http", None)
        if args.service:
            self.service = config.service(args.service)
            if self.http and not self.service.app.startswith("wsgi:"):
                raise DrillError(f"--http: {self.service.name} is not a wsgi app")
            if not self.http and self.service.app != "kv":
                raise DrillError(
                    f"{self.service.name}: drills record a kv history (app 'kv'), or HTTP"
                    " load on a guestbook behind zz proxy with --http URL"
                )
        elif self.http:
            raise DrillError("--http needs --service (the wsgi service behind that proxy)")
        elif kvs:
            self.service = kvs[0]
        else:
            raise DrillError("no service with app = 'kv': drills load and check a kv service")
        if args.cp_phase is not None and (self.http or args.cp_phase < 0):
            raise DrillError("--cp-phase K: K >= 0, and only with kv load (not --http)")
        if args.cp_phase is not None and self.kind == "corrupt-snapshot":
            raise DrillError(
                "--cp-phase: the corrupt-snapshot fault starts once a corrupted checkpoint"
                " is stable (a checkpoint of its own choosing)"
            )
        self.notes: list[str] = []
        self.phase = "starting"
        self.details: dict[str, Any] = {}
        self.reasons: list[str] = []
        self.fault_host: str | None = None
        self.faulted: list[str] = []
        self.services = [self.service]
        self.kvs = kvs
        self.replica = 0
        if self.kind not in CLIENT_FAULTS and self.service.n_exec <= self.service.active:
            raise DrillError(f"{self.service.name} has no sleeping spare to wake")

    def _running(self, obs: Observer, s: Service) -> list[int]:
        """Execution replicas of `s` controld shows running (active or recovering): after
        a conviction the woken spare is active and the convicted index a fresh spare."""
        return sorted(
            rec["index"]
            for st in obs.controld.values()
            for rec in st.get("replicas", [])
            if rec.get("service") == s.name and rec.get("state") in ("active", "recovering")
        )

    def _check_agreement_spares(self, obs: Observer) -> None:
        """The agreement replicas must know a sleeping spare to wake: after a conviction
        controld provisions a fresh one, but the cluster may still list its index as
        convicted."""
        for s in self.services:
            rows = [d for n, d in obs.agreed.items() if n.startswith(f"{s.name}/agreed-")]
            if not rows or "exec_sleeping" not in rows[0]:
                continue  # no detection in zz-agreed: the verdict will say so
            if not any(d.get("exec_sleeping") for d in rows):
                d = rows[0]
                raise DrillError(
                    f"{s.name}: the agreement replicas know no sleeping execution replica"
                    f" (awake {d.get('exec_awake')}, convicted {d.get('exec_convicted')});"
                    " controld re-provisions a convicted index as a fresh spare, but"
                    " zz-agreed does not take it back as sleeping yet: restart the rack"
                )

    def _choose(self, obs: Observer) -> None:
        running = self._running(obs, self.service)
        if self.kind in ("wrong-reply", "crash", "slow", "corrupt-snapshot", "byzantine-host"):
            if self.args.replica is None:
                if not running:
                    raise DrillError(f"{self.service.name}: no running execution replica")
                self.replica = running[0]
            elif self.args.replica not in running:
                raise DrillError(
                    f"--replica {self.args.replica} is not running (running: {running})"
                )
            else:
                self.replica = self.args.replica
        if self.kind == "byzantine-host":
            self._plan_byzantine_host(self.kvs, obs)

    def _plan_byzantine_host(self, kvs: list[Service], obs: Observer) -> None:
        host = self.args.host or self.service.exec_host(self.config, self.replica).name
        names = [h.name for h in self.config.hosts]
        if host not in names:
            raise DrillError(f"--host {host!r}: not one of {', '.join(names)}")
        self.fault_host = host
        hit = []
        self.running = {s.name: self._running(obs, s) for s in kvs}
        for s in kvs:
            on = [i for i in self.running[s.name] if s.exec_host(self.config, i).name == host]
            if on:
                hit.append(s)
        if not hit:
            raise DrillError(f"no active execution replica of a kv service on {host}")
        self.services = hit
        if len(hit) < 2:
            self.notes.append(
                f"only {len(hit)} kv service has an active replica on {host}: the paper's"
                " drill affects several services (add more kv services to the rack)"
            )

    # ---- fault injection ------------------------------------------------------------------
    async def inject(self, obs: Observer) -> None:
        k = self.kind
        if k == "primary":
            await self._kill_primary(obs)
        elif k == "client-flood":
            self.flood = asyncio.create_task(self._flood())
        elif k == "slow-reader":
            self._agreed_rss(self.details.setdefault("agreed_rss_mib", {}), "before")
            self.flood = asyncio.create_task(self._slow_reader())
        elif k == "mac-split":
            self.flood = asyncio.create_task(self._mac_split(obs))
        elif k in ("wrong-reply", "slow"):
            await self._faulty_runtime(self.service, self.replica, RUNTIME_FAULT[k])
        elif k == "crash":
            self._kill_exec(self.service, self.replica)
        elif k == "corrupt-snapshot":
            self.victim = self._snapshot_victim()
            await self._corrupting_runtime(obs)
        elif k == "byzantine-host":
            await self._byzantine_host()

    async def _align_cp_phase(self, load: Load) -> None:
        """Pause the load and PUT one request at a time until the service's last executed
        seq is cp_phase mod checkpoint_interval with nothing in flight: the fault follows at
        once, right after a checkpoint or right before the next one (docs/operations.md)."""
        s, a = self.service, self.args
        cp = self.config.rack.checkpoint_interval
        want = a.cp_phase % cp
        load.gate.clear()
        t_end = time.monotonic() + 30
        while load.inflight["kv"] and time.monotonic() < t_end:
            await asyncio.sleep(0.02)
        if load.inflight["kv"]:
            raise DrillError("--cp-phase: the kv load did not pause within 30 s")
        base = a.first_client if a.first_client is not None else max(0, s.clients - 16)
        index = base + a.clients if base + a.clients < s.clients else base - 1
        if index < 0:
            raise DrillError(f"--cp-phase: no client of {s.name} left for the aligning PUTs")
        client = Client(ClientParams.from_config(self.config, s.name, index))
        kc = load.recorders[s.name].client(client, timeout=20.0)
        key = b"pad-%x" % time.time_ns()
        try:
            for attempt in range(4):
                n = await self._settled_seq(s)
                if n % cp == want:
                    break
                if attempt == 3:
                    raise DrillError(f"--cp-phase: seq {n}, not {want} mod {cp} (null batches?)")
                for j in range((want - n) % cp):
                    await kc.put(key, b"%d" % j)
        finally:
            await client.close()
        self.details["fault_at_seq"] = n
        self.details["cp_phase"] = want
        self.progress(f"service at seq {n} = {want} mod {cp}, nothing in flight")

    async def _settled_seq(self, s: Service) -> int:
        """The service's last executed seq once two stats writes (1 s apart) agree."""
        prev = None
        for _ in range(30):
            stats = [_agreed_stats(self.config, s, r) or {} for r in range(s.n)]
            n = max(int(d.get("last_exec", 0)) for d in stats)
            if n == prev:
                return n
            prev = n
            await asyncio.sleep(1.1)
        raise DrillError(f"{s.name}: the agreement replicas did not settle in 33 s")

    def _agreed_proc(self, s: Service, r: int) -> ProcRecord:
        return self.state.proc(f"{s.name}/agreed-{r}")

    async def _kill_primary(self, obs: Observer) -> None:
        s = self.service
        views = [
            d.get("view", 0) for n, d in obs.agreed.items() if n.startswith(f"{s.name}/agreed-")
        ]
        view = max(views) if views else 0
        primary = view % s.n
        p = self._agreed_proc(s, primary)
        signal_group(p.pid, signal.SIGKILL)
        self.details["view_before"] = view
        self.details["killed"] = p.name
        self.faulted.append(p.name)

    async def _flood(self) -> None:
        """A Byzantine client: its own valid requests, and every request it ever sent,
        resent to every agreement and execution replica every ~2 ms, for the whole drill.
        Plus requests whose MACs are garbage."""
        s = self.service
        base = self.args.first_client
        base = base if base is not None else max(0, s.clients - 16)
        idx = base + self.args.clients  # the client right after the honest ones
        if idx >= s.clients:
            raise DrillError(f"{s.name}: no client principal {idx} for the flooding client")
        params = ClientParams.from_config(self.config, s.name, idx)
        params.initial_timeout = 0.002
        params.max_timeout = 0.004
        c = Client(params)
        c.start()
        sent: Counter[str] = Counter()
        self.details["flood_client"] = idx
        self.details["flood_sent"] = sent
        everyone = list(range(params.n))
        all_exec = list(range(params.n_exec))
        old: list[bytes] = []
        try:
            while True:
                ts = time.time_ns()
                req = wire.Request(params.service, params.principal, ts, 0, kvop.encode_get(b"k0"))
                macs = {r: params.keys[r] for r in everyone}
                macs |= {wire.exec_principal(i): k for i, k in params.exec_keys.items()}
                good = req.with_macs(macs).encode()
                bad = req.with_macs({r: os.urandom(32) for r in everyone}).encode()
                old = (old + [good])[-8:]
                for _ in range(25):
                    for m in old:
                        c._send(m, everyone, all_exec)
                        sent["retransmissions"] += 1
                    c._send(bad, everyone, all_exec)
                    sent["bad_mac"] += 1
                    await asyncio.sleep(0.002)
                with contextlib.suppress(ClientTimeout, ValueError):
                    # And its own pending requests on a 2 ms retransmission timer.
                    await c.invoke(kvop.encode_get(b"k1"), timeout=0.05)
                    sent["invoked"] += 1
        finally:
            await c.close()

    def _agreed_rss(self, into: dict[str, dict[str, float]], key: str) -> None:
        """VmRSS (MiB) of the service's agreement replicas, as `key` (\"max\" keeps the
        largest seen)."""
        for r in range(self.service.n):
            p = self._agreed_proc(self.service, r)
            try:
                status = Path(f"/proc/{p.pid}/status").read_text()
            except OSError:
                continue
            m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
            if m and p.alive():
                mib = int(m.group(1)) / 1024
                row = into.setdefault(p.name, {})
                row[key] = max(row.get(key, 0.0), mib) if key == "max" else mib

    def _faulty_client(self, role: str) -> ClientParams:
        """The client principal right after the honest load's clients, for a faulty one."""
        s = self.service
        base = self.args.first_client
        base = base if base is not None else max(0, s.clients - 16)
        idx = base + self.args.clients
        if idx >= s.clients:
            raise DrillError(f"{s.name}: no client principal {idx} for {role}")
        return ClientParams.from_config(self.config, s.name, idx)

    async def _slow_reader(self) -> None:
        """A faulty client that never reads: SLOW_CONNS connections to every agreement
        replica, each sent read-only requests whose replies (SLOW_OP bytes each) it never
        reads, at SLOW_RATE bytes/s per replica; a connection the replica closes is opened
        again. Every request is valid (its own key), so each one is answered."""
        params = self._faulty_client("the slow reader")
        op = b"r" * min(SLOW_OP, (params.max_request or SLOW_OP) - 4096)
        req = wire.Request(params.service, params.principal, time.time_ns(), wire.FLAG_READONLY, op)
        frame = wire.frame(req.with_macs(params.keys).encode())
        sent: Counter[str] = Counter()
        self.details["slow_reader"] = {"client": params.principal, "conns_per_replica":
                                       SLOW_CONNS, "op_bytes": len(op), "rate_bytes_s":
                                       SLOW_RATE, "sent": sent}  # fmt: skip
        rss = self.details.setdefault("agreed_rss_mib", {})
        loop = asyncio.get_running_loop()

        async def one(addr: tuple[str, int]) -> None:
            gap = len(frame) * SLOW_CONNS / SLOW_RATE  # seconds between two frames per conn
            while True:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, addr)
                    sent["connections"] += 1
                    while True:  # never a recv: every reply stays queued somewhere
                        await loop.sock_sendall(sock, frame)
                        sent["requests"] += 1
                        sent["bytes"] += len(frame)
                        await asyncio.sleep(gap)
                except OSError:
                    sent["closed_by_replica"] += 1
                    await asyncio.sleep(0.5)
                finally:
                    sock.close()

        async def watch_rss() -> None:
            while True:
                self._agreed_rss(rss, "max")
                await asyncio.sleep(0.5)

        tasks = [asyncio.create_task(watch_rss())]
        tasks += [asyncio.create_task(one(a)) for a in params.replicas for _ in range(SLOW_CONNS)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _mac_split(self, obs: Observer) -> None:
        """A faulty client (the principal after the honest ones) whose requests carry MAC
        entries good for every agreement replica but the current primary (the highest view
        in the stats files): MAC_SPLIT_RATE new requests a second, each to every agreement
        replica, every other one followed by its signed copy (auth kind 3) with the same MAC
        split and a wrong signature. Each is a kv read of a key nobody writes."""
        params = self._faulty_client("the mac-split client")
        c = Client(params)
        c.start()
        sent: Counter[str] = Counter()
        self.details["mac_split"] = {"client": params.principal, "rate_per_s": MAC_SPLIT_RATE,
                                     "sent": sent}  # fmt: skip
        everyone = list(range(params.n))
        try:
            while True:
                views = [d.get("view", 0) for n, d in obs.agreed.items()
                         if n.startswith(f"{self.service.name}/agreed-")]  # fmt: skip
                primary = max(views, default=0) % params.n
                req = wire.Request(params.service, params.principal, time.time_ns(), 0,
                                   kvop.encode_get(b"mac-split"))  # fmt: skip
                macs = {r: params.keys[r] if r != primary else os.urandom(32) for r in everyone}
                c._send(req.with_macs(macs).encode(), everyone)
                sent["mac_split"] += 1
                if sent["mac_split"] % 2 == 0 and params.sign is not None:
                    signed = bytearray(req.signed_with_macs(macs, params.sign).encode())
                    signed[-1] ^= 0x01  # a wrong signature
                    c._send(bytes(signed), everyone)
                    sent["bad_signature"] += 1
                await asyncio.sleep(1.0 / MAC_SPLIT_RATE)
        finally:
            await c.close()

    def _exec_pids(self, s: Service, i: int) -> list[int]:
        return leftover_pids(
            ["zz.execution"],
            [
                str(self.config.path),
                f"--service {s.name}".replace(" ", "\0"),
                f"--index\0{i}\0",
            ],  # fmt: skip
        )

    def _kill_exec(self, s: Service, i: int) -> None:
        if self.state.backend == "libvirt":
            self._crash_domain(s, i)
            return
        pids = self._exec_pids(s, i)
        if not pids:
            raise DrillError(f"{s.name}/exec-{i}: no running process found")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.faulted.append(f"{s.name}/exec-{i}")
        self.details.setdefault("killed_pids", []).extend(pids)

    def _crash_domain(self, s: Service, i: int) -> None:
        """A VM crash: libvirt destroys the domain under controld's feet (controld finds it
        gone, as after a QEMU crash)."""
        import libvirt  # type: ignore[import-not-found, import-untyped]

        name = domain_name(self.config, s, i)
        uri = s.exec_host(self.config, i).libvirt_uri
        try:
            conn = libvirt.open(uri)
            try:
                conn.lookupByName(name).destroy()
            finally:
                conn.close()
        except libvirt.libvirtError as e:
            raise DrillError(f"{s.name}/exec-{i}: cannot destroy domain {name}: {e}") from e
        self.faulted.append(f"{s.name}/exec-{i}")
        self.details.setdefault("destroyed_domains", []).append(name)

    def _set_fault(self, s: Service, i: int, fault: str | None, lie: bool = True) -> None:
        """Switch a running runtime's injected fault through its state directory (a
        guest's share): runtimes of a `zz rack up` rack run with --drill-faults and look
        at the file every 20 ms. In place, so the replica is never down for a restart
        (which the timers would see as a crash, not as the fault), and a guest needs no
        reboot."""
        body: dict[str, object] = {"fault": fault}
        if fault == "slow-report":
            body["slow_report_ms"] = self._slow_report_ms(s)
        if not lie:
            body["lie"] = False
        path = s.exec_state_dir(self.config, i) / FAULT_FILE
        write_atomic(path, json.dumps(body) + "\n")

    def _slow_report_ms(self, s: Service) -> int:
        """Slow means later than the agreement replicas wait: one second beyond the
        K·t1 timer's ceiling as the rack runs it (its --set values win)."""
        floor = int(self.state.overrides.get("detect_floor_ms", s.detect_floor_ms))
        ceiling = int(self.state.overrides.get("detect_ceiling_ms", s.detect_ceiling_ms))
        return max(floor, ceiling) + 1000

    async def _faulty_runtime(self, s: Service, i: int, fault: str) -> None:
        """Make replica i faulty; controld keeps owning it, so a SHUTDOWN certificate
        finds it. The fault starts within 20 ms (_set_fault)."""
        self._set_fault(s, i, fault)
        self.faulted.append(f"{s.name}/exec-{i} ({fault})")
        self.fault_at_ns = time.monotonic_ns()

    async def _byzantine_host(self) -> None:
        """Every replica of every service on the host misbehaves at once: its execution
        replicas answer wrongly, its agreement replicas stop (a crash is one Byzantine
        behaviour; one faulty agreement replica per service is within g)."""
        assert self.fault_host is not None
        jobs = []
        for s in self.services:
            for i in self.running[s.name]:
                if s.exec_host(self.config, i).name == self.fault_host:
                    jobs.append(self._faulty_runtime(s, i, "wrong-reply"))
        await asyncio.gather(*jobs)
        for s in self.services:
            for r in range(s.n):
                if self.config.replica_host(s, r).name == self.fault_host:
                    p = self._agreed_proc(s, r)
                    signal_group(p.pid, signal.SIGKILL)
                    self.faulted.append(p.name)

    def _snapshot_victim(self) -> int:
        """The replica whose storage goes bad: the first peer the spare asks (the runtime
        asks peers from index+1 on, execution/runtime.py _peer_sources), so the corrupted
        copy is really offered."""
        s = self.service
        spare = self.spares_at_start[s.name][0]
        for k in range(1, s.n_exec):
            j = (spare + k) % s.n_exec
            if j in self.running_now:
                return j
        raise DrillError(f"{s.name}: no running replica to corrupt")

    async def _corrupting_runtime(self, obs: Observer) -> None:
        """Byzantine storage: replica B's runtime snapshots one flipped byte per file while
        certifying the right digest (execution/runtime.py, fault corrupt-snapshot), so each
        snapshot is corrupt from the moment it exists, on a directory store as on ZFS
        (where a snapshot cannot be changed from outside). Corrupting the snapshots from
        the drill instead raced the victim's checkpoints: one taken just before the lies
        could be served intact before the drill's next pass. B's lies are held back until
        one such checkpoint is stable, so the spare woken by them recovers from a
        checkpoint whose copy at B is corrupt, and the fault's clock starts at the lies."""
        s, b = self.service, self.victim
        self._set_fault(s, b, "corrupt-snapshot", lie=False)
        self.faulted.append(f"{s.name}/exec-{b} (corrupt-snapshot)")
        path = s.exec_status_path(self.config, b)
        t_end = time.monotonic() + CORRUPT_WAIT_S
        st: dict[str, Any] = {}
        while True:
            with contextlib.suppress(OSError, ValueError):
                st = json.loads(path.read_text())
            lie_from = st.get("corrupt_lie_from")
            if lie_from is not None and st.get("last_executed", 0) >= lie_from:
                break
            if time.monotonic() > t_end:
                self._set_fault(s, b, None)  # the rack is left as it was
                raise DrillError(
                    f"{s.name}/exec-{b}: no corrupted checkpoint stable within"
                    f" {CORRUPT_WAIT_S:.0f} s ({path}: stable {st.get('stable_checkpoint')},"
                    f" last executed {st.get('last_executed')}, inject_fault"
                    f" {st.get('inject_fault')})"
                )
            await obs.poll()
        self.details["corrupted_files"] = st.get("counters", {}).get("snapshot_files_corrupted", 0)
        self.details["corrupted_from_checkpoint"] = st.get("stable_checkpoint")
        self._set_fault(s, b, "corrupt-snapshot")
        self.fault_at_ns = time.monotonic_ns()

    # ---- after the drill ------------------------------------------------------------------
    async def restore(self, report: rp.DrillReport) -> None:
        """Leave the rack usable for the next drill: a killed agreement replica is started
        again (same replica file); a faulty execution replica that was not convicted is
        told to behave again (a convicted one controld already replaced)."""
        for p in list(self.state.procs):
            if p.kind == "agreed" and not p.alive():
                s = next(x for x in self.config.services if p.name.startswith(x.name + "/"))
                r = int(p.name.rsplit("-", 1)[1])
                conf = self.config.rack.run_dir / f"s{s.id}" / f"agreed-{r}.conf"
                self.state.procs.remove(p)
                _start(self.state, self.config, "agreed", p.name,
                       [str(DEFAULT_AGREED), "--conf", str(conf)], Path(p.log),
                       (p.address, p.port))  # fmt: skip
                self.notes.append(f"restarted {p.name} after the drill")
        _save_state(self.config, self.state)
        for name in self.faulted:
            m = re.match(r"(.+)/exec-(\d+)", name)
            if not m:
                continue
            s, i = self.config.service(m.group(1)), int(m.group(2))
            if any(f"{s.name}/{i}" in c for c in report.convicted):
                continue
            if "(" in name:
                self._set_fault(s, i, None)
                self.notes.append(f"not convicted: {s.name}/exec-{i} told to behave again")

    # ---- run ------------------------------------------------------------------------------
    async def run(self) -> rp.DrillReport:
        a = self.args
        obs = Observer(self.config, self.services)
        obs.read_agreed()
        await obs.read_controlds()
        if len(obs.controld) < len(self.config.hosts):
            raise DrillError(f"controlds not answering: {dict(obs.errors)}")
        self._choose(obs)
        if self.kind not in CLIENT_FAULTS:
            self._check_agreement_spares(obs)
        self.running_now = self._running(obs, self.service)
        self.spares_at_start = self._sleeping(obs)
        if self.kind not in CLIENT_FAULTS:
            missing = [s.name for s in self.services if not self.spares_at_start.get(s.name)]
            if missing:
                raise DrillError(
                    f"no sleeping spare of {', '.join(missing)} to wake (an earlier fault round"
                    f" woke it; `zz status {self.config.path}`): restart the rack"
                )
        self.phase = "building tools/lincheck"
        await asyncio.to_thread(zh.lincheck_binary)  # before the clock starts
        self.phase = "load before the fault"
        if self.http:
            load = _start_http_load(self.http, a.clients)
        else:
            load = _start_load(self.config, self.services, a.clients, a.first_client)
        what = "HTTP connections" if self.http else "kv clients"
        self.progress(f"load: {a.clients} {what} on {', '.join(s.name for s in self.services)}"
                      f"; fault '{self.kind}' in {a.before:.0f} s")  # fmt: skip
        try:
            t_end = time.monotonic() + a.before
            while time.monotonic() < t_end:
                await obs.poll()
            if a.cp_phase is not None:
                self.phase = "bringing the service to the checkpoint phase"
                await self._align_cp_phase(load)
            self.phase = "injecting the fault"
            obs.mark_fault()
            wall = time.time()
            self.fault_at_ns = 0
            await self.inject(obs)
            load.gate.set()
            if self.fault_at_ns:
                obs.fault_ns = self.fault_at_ns
            self.phase = "watching after the fault"
            self.progress(f"fault injected: {', '.join(self.faulted) or self.kind};"
                          f" watching {a.after:.0f} s")  # fmt: skip
            t_fault = time.monotonic()
            t_end = t_fault + a.after
            handled = False
            while time.monotonic() < t_end:
                await obs.poll()
                if a.after_recovery is not None and not handled and _fault_handled(obs):
                    handled = True
                    t_end = min(t_end, time.monotonic() + a.after_recovery)
                    self.progress(f"fault handled; watching {a.after_recovery:.0f} s more")
            self.watched_s = time.monotonic() - t_fault
            # A fault round still open is decided at the latest by its timeout, and a
            # convicted replica's successor boots as a fresh spare: a VM takes tens of
            # seconds under TCG. Keep watching (load running) until both are done.
            t_end = time.monotonic() + a.settle
            while time.monotonic() < t_end:
                if rounds := _open_rounds(obs):
                    phase = f"waiting for the fault round of {', '.join(sorted(rounds))}"
                elif _awaiting_spares(obs):
                    phase = "waiting for the fresh spare"
                else:
                    break
                if self.phase != phase:
                    self.phase = phase
                    self.progress(f"{phase} (up to {a.settle:.0f} s)")
                await obs.poll()
            if rounds := _open_rounds(obs):
                self.notes.append(
                    f"fault round still open at the end (--settle {a.settle:.0f} s):"
                    f" {', '.join(sorted(rounds))}"
                )
            await obs.read_controlds()
        finally:
            load.stop.set()
            load.gate.set()
            task = getattr(self, "flood", None)
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            # Workers finish their current op (<= 8 s timeout) and close their clients.
            self.phase = "stopping the load"
            await asyncio.wait(load.tasks, timeout=15)
            for t in load.tasks:
                t.cancel()
        self.phase = "checking the history (Porcupine)"
        report = await asyncio.to_thread(self.evaluate, obs, load, wall)
        self.phase = "restoring the rack"
        await self.restore(report)
        report.notes = self.notes
        return report

    def evaluate(self, obs: Observer, load: Load, wall: float) -> rp.DrillReport:
        s = self.service
        r = rp.DrillReport(
            self.kind, self.config.rack.name, ",".join(x.name for x in self.services), wall
        )
        f_ns = obs.fault_ns
        samples: list[rp.Sample] = []
        first_ret: float | None = None
        verdicts = []
        for name, rec in load.recorders.items():
            h = rec.history()
            for o in h.operations:
                call = (o.call - f_ns) / 1e9
                ret = None if o.ret is None else (o.ret - f_ns) / 1e9
                samples.append(rp.Sample(call, ret))
                if ret is not None and call >= 0 and (first_ret is None or ret < first_ret):
                    first_ret = ret
            r.operations += len(h.operations)
            r.pending += sum(1 for o in h.operations if o.pending)
            out = self.out_dir
            out.mkdir(parents=True, exist_ok=True)
            h.save(out / f"history-{name}.json")
            try:
                v = zh.check(h, html=out / f"history-{name}.html", timeout=120)
                verdicts.append((name, v))
            except zh.LincheckError as e:
                self.reasons.append(f"linearizability check of {name} failed to run: {e}")
        for c, ret_ns, ok in load.http:
            call = (c - f_ns) / 1e9
            ret = None if ret_ns is None else (ret_ns - f_ns) / 1e9
            samples.append(rp.Sample(call, ret, ok))
            if ok and ret is not None and call >= 0 and (first_ret is None or ret < first_ret):
                first_ret = ret
            r.operations += 1
            r.pending += ret is None
        if self.http:
            self._check_acked(r, load)
        r.first_correct_reply_s = first_ret
        self.samples = samples
        r.timeline = rp.buckets(samples)
        before = [x for x in samples if x.ret is not None and -self.args.before <= x.ret < 0]
        r.load_before = len(before) / self.args.before if self.args.before else None
        end = max((x.ret for x in samples if x.ret is not None), default=0.0)
        tail = [x for x in samples if x.ret is not None and end - 3.0 <= x.ret and x.ret > 0]
        r.load_after = len(tail) / 3.0 if end > 3.0 else None
        if verdicts:
            r.linearizable = all(v.linearizable for _, v in verdicts)
            r.linearizability = "; ".join(f"{n}: {v}" for n, v in verdicts)
            if not r.linearizable:
                self.reasons.append("history is not linearizable")

        # Observed control-plane events.
        woke = obs.lines(r"^woke ")
        r.wakeup_s = woke[0][0] if woke else None
        r.woken = [ln for _, ln in woke]
        r.convicted = [ln for _, ln in obs.lines(r"^convicted ")]
        r.shut_down = [ln for _, ln in obs.lines(r"^SHUTDOWN .* convict ")]
        r.spares_restored = [ln for _, ln in obs.lines(r"^provisioned .* (paused|hibernated)")]
        keys = PRIMARY_KEYS if self.kind == "primary" else DETECT_KEYS
        det = obs.first(
            lambda e: e.source.startswith(f"{s.name}/agreed") and e.what.split()[0] in keys
        )
        # A WAKEUP reaching a controld proves the cluster had detected the fault by then;
        # the stats files (rewritten about once a second) may show it later.
        wakeups = obs.lines(r"^WAKEUP ")
        times = [
            x for x in (det.t if det else None, wakeups[0][0] if wakeups else None) if x is not None
        ]
        r.detection_s = min(times) if times else None
        early = obs.lines(r"^WAKEUP ", before=True)
        if early:
            t, line = early[0]
            msg = (f"a WAKEUP before the fault (t = {t:.1f} s, no fault injected yet: a false"
                   f" wake-up under load): {line}")  # fmt: skip
            if self.kind == "primary":
                self.notes.append(msg)
            else:
                self.reasons.append(msg)
        for n, d in obs.agreed.items():
            if "detect_latency_max_ms" in d:
                r.details.setdefault("detect_latency_ms", {})[n] = {
                    "last": d.get("detect_latency_last_ms"),
                    "max": d["detect_latency_max_ms"],
                }
        r.details.update(self.details)
        r.details["faulted"] = self.faulted
        r.details["tally"] = dict(load.tally)
        r.details["events"] = [vars(e) for e in obs.rel()[:600]]
        r.details["controld_deltas"] = {
            k: obs.counter_delta(k)
            for k in (
                "wakeup_accepted",
                "wakeup_rejected",
                "woken",
                "shutdown_accepted",
                "convicted",
                "reprovisioned",
                "action_failed",
            )  # fmt: skip
        }
        if obs.errors:
            r.details["observer_errors"] = dict(obs.errors)
        if isinstance(r.details.get("flood_sent"), Counter):
            r.details["flood_sent"] = dict(r.details["flood_sent"])
        if "slow_reader" in r.details:
            r.details["slow_reader"]["sent"] = dict(r.details["slow_reader"]["sent"])
        if "mac_split" in r.details:
            r.details["mac_split"]["sent"] = dict(r.details["mac_split"]["sent"])
        getattr(self, f"_judge_{self.kind.replace('-', '_')}")(r, obs)
        r.reasons = self.reasons
        r.result = "FAIL" if self.reasons else "PASS"
        return r

    def _check_acked(self, r: rp.DrillReport, load: Load) -> None:
        """HTTP load: no Porcupine model for the guestbook; instead every acknowledged POST
        (303 "added entry N") must be in /entries.json exactly once, as entry N."""
        assert self.http
        try:
            final = asyncio.run(_entries(self.http))
        except (OSError, ValueError, TimeoutError, DrillError) as e:
            self.reasons.append(f"cannot read the final /entries.json: {e}")
            return
        by_msg: dict[str, list[int]] = {}
        for e in final:
            by_msg.setdefault(str(e.get("message")), []).append(int(e.get("id", -1)))
        lost = [m for m in load.acked if m not in by_msg]
        moved = [m for m, i in load.acked.items() if by_msg.get(m) not in (None, [i])]
        r.linearizability = (
            f"not checked (guestbook over HTTP): {len(load.acked)} acknowledged POSTs,"
            f" {len(lost)} lost, {len(moved)} duplicated or moved; /entries.json holds"
            f" {len(final)} entries"
        )
        r.details["http"] = dict(load.tally)
        if lost or moved:
            self.reasons.append(f"acknowledged writes lost {lost[:3]} or moved {moved[:3]}")
        if not load.acked:
            self.reasons.append("no POST was acknowledged")

    # ---- verdicts per kind ----------------------------------------------------------------
    def _need_progress(self, r: rp.DrillReport) -> None:
        if r.first_correct_reply_s is None:
            self.reasons.append("no operation issued after the fault completed")
        if r.load_after is not None and r.load_after == 0:
            self.reasons.append("no operation completed in the last 3 s: the service is stuck")

    def _judge_primary(self, r: rp.DrillReport, obs: Observer) -> None:
        s = self.service
        v0 = self.details.get("view_before", 0)
        views = {n: d.get("view") for n, d in obs.agreed.items() if n != self.details["killed"]
                 and n.startswith(f"{s.name}/agreed-")}  # fmt: skip
        self.details["views_after"] = views
        if not views or min(v or 0 for v in views.values()) <= v0:
            self.reasons.append(f"survivors did not all move past view {v0}: {views}")
        if r.detection_s is None:
            self.reasons.append("no view change observed in the agreement replicas' stats")
        self.notes.append("stats files are rewritten every status period: detection time"
                          " resolution is that period")  # fmt: skip
        if r.details["controld_deltas"]["woken"]:
            self.reasons.append("a sleeping execution replica was woken by a primary crash")
        self._need_progress(r)

    def _sleeping(self, obs: Observer) -> dict[str, list[int]]:
        """Per service, the execution replicas controld shows asleep."""
        out: dict[str, list[int]] = {}
        for st in obs.controld.values():
            for rec in st.get("replicas", []):
                if rec.get("state") in ("paused", "hibernated"):
                    out.setdefault(rec["service"], []).append(rec["index"])
        return {k: sorted(v) for k, v in out.items()}

    def _judge_client_flood(self, r: rp.DrillReport, obs: Observer) -> None:
        d = r.details["controld_deltas"]
        if d["wakeup_accepted"] or d["woken"]:
            self.reasons.append(f"a faulty client caused a wake-up: {d}")
        before = self.spares_at_start.get(self.service.name, [])
        after = self._sleeping(obs).get(self.service.name, [])
        if not before:
            self.reasons.append("no sleeping spare at the start: nothing could show a wake-up")
        if set(before) - set(after):
            self.reasons.append(f"spares asleep before the flood: {before}, after: {after}")
        asleep = [f"{self.service.name}/exec-{i}" for i in after]
        self.details["spares"] = asleep
        r.detection_s = None
        self.notes.append(f"{self.kind}: no detection, wake-up or conviction may happen;"
                          f" spares after the drill: {', '.join(asleep) or 'none'}")  # fmt: skip
        self._need_progress(r)

    def _honest_windows(
        self, r: rp.DrillReport, what: str
    ) -> tuple[dict[str, float | None], dict[str, float | None], dict[str, float]]:
        """Honest clients' throughput and latency during the attack against the quiet
        `--before` seconds, checked against SLOW_MIN_THROUGHPUT and SLOW_MAX_P99 /
        SLOW_P99_FLOOR_MS (kept as details["honest"]); returns quiet, attack, bound."""
        a = self.args

        def window(lo: float, hi: float) -> dict[str, float | None]:
            done = [x for x in self.samples if x.ret is not None and lo <= x.ret < hi]
            lat = sorted((x.ret - x.call) * 1000 for x in done if x.ret is not None)

            def pct(q: float) -> float | None:
                return round(lat[min(len(lat) - 1, int(q * len(lat)))], 1) if lat else None

            return {"ops_per_s": round(len(done) / (hi - lo), 1), "p50_ms": pct(0.5),
                    "p99_ms": pct(0.99)}  # fmt: skip

        quiet = window(-a.before, 0.0)
        attack = window(0.0, self.watched_s)
        bound = {
            "min_ops_per_s": SLOW_MIN_THROUGHPUT * (quiet["ops_per_s"] or 0.0),
            "max_p99_ms": max(SLOW_MAX_P99 * (quiet["p99_ms"] or 0.0), SLOW_P99_FLOOR_MS),
        }
        r.details["honest"] = {"quiet": quiet, "attack": attack, "bound": bound}
        if (attack["ops_per_s"] or 0.0) < bound["min_ops_per_s"]:
            self.reasons.append(
                f"honest throughput {attack['ops_per_s']:.0f} ops/s under the {what}, below"
                f" {SLOW_MIN_THROUGHPUT:.0%} of the quiet {quiet['ops_per_s']:.0f} ops/s"
            )
        p99 = attack["p99_ms"]
        if p99 is None or p99 > bound["max_p99_ms"]:
            self.reasons.append(
                f"honest p99 latency {p99} ms under the {what}, above"
                f" {bound['max_p99_ms']:.0f} ms (quiet p99 {quiet['p99_ms']})"
            )
        return quiet, attack, bound

    def _judge_slow_reader(self, r: rp.DrillReport, obs: Observer) -> None:
        """Honest clients' throughput and latency while the slow reader runs, against the
        quiet seconds before it, within the SLOW_* bounds; agreement replicas' memory bounded;
        the replicas dropped the slow reader (limits.slow_readers names its principal)."""
        self._judge_client_flood(r, obs)  # no wake-up, spares still asleep, progress
        quiet, attack, bound = self._honest_windows(r, "slow reader")
        bound["max_rss_growth_mib"] = SLOW_MAX_RSS_MIB
        p99 = attack["p99_ms"]
        rss = r.details.get("agreed_rss_mib", {})
        for name, row in sorted(rss.items()):
            grown = row.get("max", 0.0) - row.get("before", 0.0)
            row["growth"] = round(grown, 1)
            if "before" in row and grown > SLOW_MAX_RSS_MIB:
                self.reasons.append(f"{name} RSS grew {grown:.0f} MiB under the slow reader"
                                    f" (bound {SLOW_MAX_RSS_MIB:.0f} MiB)")  # fmt: skip
        who = str(r.details.get("slow_reader", {}).get("client"))
        dropped = {
            n: d.get("limits", {}).get("slow_readers", {}).get(who, 0)
            - obs.agreed_base.get(n, {}).get("limits", {}).get("slow_readers", {}).get(who, 0)
            for n, d in obs.agreed.items()
            if n.startswith(f"{self.service.name}/agreed-")
        }
        r.details["slow_reader_conns_dropped"] = dropped
        if not any(v > 0 for v in dropped.values()):
            self.reasons.append("no agreement replica dropped the slow reader's connections"
                                " (stats limits.slow_readers)")  # fmt: skip
        growth = ", ".join(f"{n} {row.get('growth')}" for n, row in sorted(rss.items()))
        self.notes.append(
            f"slow-reader: honest {attack['ops_per_s']:.0f} ops/s (quiet"
            f" {quiet['ops_per_s']:.0f}), p99 {p99} ms (quiet {quiet['p99_ms']});"
            f" agreed RSS growth {growth} MiB"
        )

    def _judge_mac_split(self, r: rp.DrillReport, obs: Observer) -> None:
        """No view change while the mac-split client runs (its requests, unsigned or with a
        wrong signature, never run a backup's view-change timer), honest throughput and p99
        within the SLOW_* bounds of the quiet seconds, and the backups saw the attack
        (signed_requests.timer_exempt and bad_signature grew)."""
        self._judge_client_flood(r, obs)  # no wake-up, spares still asleep, progress
        quiet, attack, _bound = self._honest_windows(r, "mac-split client")

        def delta(d: dict[str, Any], base: dict[str, Any], *path: str) -> int:
            for k in path[:-1]:
                d, base = d.get(k, {}), base.get(k, {})
            return int(d.get(path[-1], 0)) - int(base.get(path[-1], 0))

        rows = {
            n: {
                "view": d.get("view"),
                "view_changes": delta(d, obs.agreed_base.get(n, {}), "view_changes"),
                "timer_exempt": delta(
                    d, obs.agreed_base.get(n, {}), "signed_requests", "timer_exempt"
                ),
                "bad_signature": delta(
                    d, obs.agreed_base.get(n, {}), "signed_requests", "bad_signature"
                ),
                "sig_banned": delta(d, obs.agreed_base.get(n, {}), "signed_requests", "sig_banned"),
                "dropped_auth": delta(d, obs.agreed_base.get(n, {}), "dropped", "auth"),
            }
            for n, d in sorted(obs.agreed.items())
            if n.startswith(f"{self.service.name}/agreed-")
        }
        r.details["mac_split_replicas"] = rows
        changes = sum(row["view_changes"] for row in rows.values())
        if changes:
            self.reasons.append(f"{changes} view changes under the mac-split client: {rows}")
        if not any(row["timer_exempt"] > 0 for row in rows.values()):
            self.reasons.append("no backup took a mac-split request (signed_requests.timer_exempt)")
        if not any(row["bad_signature"] > 0 for row in rows.values()):
            self.reasons.append("no replica refused a wrong signature (bad_signature)")
        self.notes.append(
            f"mac-split: {changes} view changes; honest {attack['ops_per_s']:.0f} ops/s (quiet"
            f" {quiet['ops_per_s']:.0f}), p99 {attack['p99_ms']} ms (quiet {quiet['p99_ms']})"
        )

    def _judge_exec_fault(self, r: rp.DrillReport, obs: Observer) -> None:
        if r.detection_s is None:
            self.reasons.append(
                "missing: fault detection in zz-agreed (no mismatch/timeout/fault counter in"
                " any agreement replica's stats changed after the fault)"
            )
        d = r.details["controld_deltas"]
        if not d["wakeup_accepted"]:
            self.reasons.append(
                "missing: WAKEUP — no controld accepted a wake-up certificate"
                f" (controld counters after the fault: {d})"
            )
        elif not r.woken:
            self.reasons.append("controld accepted a WAKEUP but woke no replica")
        if not r.convicted:
            self.reasons.append("missing: SHUTDOWN — no faulty replica was convicted")
        for name in self.faulted:
            m = re.match(r"(.+)/exec-(\d+)", name)
            if (
                m
                and r.convicted
                and not any(f"convicted {m.group(1)}/{m.group(2)} " in c for c in r.convicted)
            ):
                self.reasons.append(f"{m.group(1)}/exec-{m.group(2)} was faulty but not convicted")
        faulted = {f"{m.group(1)}/{m.group(2)}" for n in self.faulted if (m := _EXEC_NAME.match(n))}
        for line in r.convicted:
            m = re.search(r"convicted (\S+/\d+) ", line)
            if m and m.group(1) not in faulted:
                # Not a safety failure (a replica too slow for the timer counts as faulty),
                # but a spare spent: the report says so.
                self.notes.append(f"also convicted, not faulted by the drill: {m.group(1)}"
                                  " (too slow for the execution-report timer?)")  # fmt: skip
        for svc in self.services:
            if r.woken and not any(f"woke {svc.name}/" in w for w in r.woken):
                self.reasons.append(f"no spare of {svc.name} was woken")
        if r.convicted and not r.spares_restored:
            self.reasons.append("no fresh spare provisioned after the conviction")
        else:
            for who in sorted(_awaiting_spares(obs)):
                self.reasons.append(
                    f"no fresh spare of {who} back asleep within --settle"
                    f" {self.args.settle:.0f} s (provisioned and announced with SPARE-READY)"
                )
        for _, line in obs.lines(r"fresh spare|destroy failed|sleep failed"):
            if line.endswith("trying once more"):
                self.notes.append(f"controld {line}")  # a spare not back fails above
            else:
                self.reasons.append(f"controld {line}")
        self._need_progress(r)

    def _counter_deltas(self, obs: Observer, key: str) -> dict[str, int]:
        """How much `key` grew in each agreement replica of the drilled services."""
        return {
            n: d.get(key, 0) - obs.agreed_base.get(n, {}).get(key, 0)
            for n, d in obs.agreed.items()
            if any(n.startswith(f"{s.name}/agreed-") for s in self.services)
        }

    def _judge_wrong_reply(self, r: rp.DrillReport, obs: Observer) -> None:
        """Also: the wrong replies must have been seen (EXEC-REPORT mismatches), not only
        timeouts of a replica too slow for the timer."""
        self._judge_exec_fault(r, obs)
        mism = self._counter_deltas(obs, "exec_mismatches")
        r.details["exec_mismatches_after_fault"] = mism
        if mism and not any(v > 0 for v in mism.values()):
            self.reasons.append(
                "no agreement replica saw a mismatching EXEC-REPORT: the replica was convicted"
                " for late reports, not for wrong replies (zz rack up --set detect_floor_ms"
                " above the replicas' hiccups)"
            )

    def _judge_slow(self, r: rp.DrillReport, obs: Observer) -> None:
        """Also: the slow replica must have been timed out (K·t1), which is what a
        replica that answers correctly but too late looks like."""
        self._judge_exec_fault(r, obs)
        late = self._counter_deltas(obs, "exec_timeouts")
        r.details["exec_timeouts_after_fault"] = late
        r.details["slow_report_ms"] = self._slow_report_ms(self.service)
        if late and not any(v > 0 for v in late.values()):
            self.reasons.append("no agreement replica timed out an EXEC-REPORT of the slow replica")

    _judge_crash = _judge_exec_fault
    _judge_byzantine_host = _judge_wrong_reply

    def _judge_corrupt_snapshot(self, r: rp.DrillReport, obs: Observer) -> None:
        self._judge_wrong_reply(r, obs)
        s = self.service
        rejected = []
        for i in range(s.n_exec):
            path = s.exec_status_path(self.config, i)
            with contextlib.suppress(OSError, ValueError):
                st = json.loads(path.read_text())
                for b in st.get("recovery", {}).get("bad_sources", []):
                    rejected.append(f"exec-{i} rejected {b.get('path')} from {b.get('source')}:"
                                    f" {b.get('why')}")  # fmt: skip
        self.details["rejected"] = r.details["rejected"] = rejected
        if not self.details.get("corrupted_files"):
            self.reasons.append(f"no snapshot file of {s.name}/exec-{self.victim} was corrupted")
        elif not any(f"from {src}:" in x for x in rejected for src in self._victim_sources()):
            self.reasons.append(
                f"no recovering replica reported a corrupted file from exec-{self.victim}"
                " (recovery.bad_sources in the execution replicas' status files)"
            )
        else:
            self.notes.append(f"corrupted copies rejected: {len(rejected)}, e.g. {rejected[0]}")

    def _victim_sources(self) -> tuple[str, str]:
        """The names a recovering runtime gives the victim's copies: the victim itself, or
        its host's controld (which serves a guest's ZFS snapshots)."""
        host = self.service.exec_host(self.config, self.victim).name
        return f"x{self.victim}", f"controld-{host}"

    @property
    def out_dir(self) -> Path:
        if self.args.out:
            return Path(self.args.out)
        if not hasattr(self, "_out"):
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self._out = self.config.rack.run_dir / "drills" / f"{self.kind}-{stamp}"
        return self._out


def run(
    config: Config, args: argparse.Namespace, progress: Progress
) -> tuple[rp.DrillReport, Path]:
    d = Drill(config, args, progress)
    limit = args.before + args.after + args.settle + 600

    async def bounded() -> rp.DrillReport:
        # Every step has its own timeout; this is the backstop that names the stuck one.
        try:
            return await asyncio.wait_for(d.run(), limit)
        except TimeoutError:
            raise DrillError(
                f"the drill did not finish in {limit:.0f} s: stuck {d.phase}"
            ) from None

    report = asyncio.run(bounded())
    js, png = rp.write(report, d.out_dir)
    return report, d.out_dir


def main_cli(args: argparse.Namespace, progress: Progress) -> int:
    config = load(args.config)
    try:
        report, out = run(config, args, progress)
    except (DrillError, RackError) as e:
        print(f"zz drill {args.kind}: {e}", file=sys.stderr)
        return 2
    print(rp.format_text(report))
    print(f"report: {out / 'report.json'}, {out / 'timeline.png'}")
    return 0 if report.result == "PASS" else 1
