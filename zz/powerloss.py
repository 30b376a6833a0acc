# zz/powerloss.py - `zz bench powerloss` (scripts/bench/powerloss): Jepsen-style power-loss
# tests of a durable rack under recorded kv load and guestbook HTTP load (issue 16 item 4).
"""Power loss, Jepsen style (docs/operations.md "Power loss").

One process-backend rack with durable agreement replicas (``rack.durability = "fsync"``):
4 simulated hosts, a kv service ``kv0`` and a guestbook ``web`` (``wsgi:guestbook``),
``g = f = 1`` each, served over HTTP by a ``zz proxy`` that outlives every kill (it is a
client). Under load all along:

* kv register clients: get/put/cas on a small set of keys, every operation recorded with
  its call and return time on one monotonic clock (zz/history.py) in **one history for the
  whole run**, across every restart. The key set changes every ``keys_every`` events (each
  key's history spans that many kills), so Porcupine's per-key search stays small. An
  operation in flight at a kill that never returns stays pending: indeterminate, as
  Jepsen and Porcupine treat a crashed client's operation;
* a kv set client: appends unique tokens to ``set-<j>`` keys (100 per key), recorded in
  the same history; after every event the keys appended to since the last check are read:
  every acknowledged token must be there exactly once, nothing that was never sent;
* guestbook HTTP clients through the proxy (zz/drill/load.py): after every event the
  entries acknowledged since the last check (``303 added entry N``) must be in
  /entries.json exactly once, as entry N.

Events, in a seeded random order, each after a seeded random stretch of load
(``min_up_s``..``max_up_s``):

``rack``     power loss: every process of the rack (controlds, every zz-agreed, every
             execution runtime, on libvirt the guests' QEMU processes) is SIGSTOPped, then
             SIGKILLed, so none sees another die; then ``zz rack start`` (rackctl.start)
             brings the crashed rack back from disk. kv clients start no new operation
             while the rack is down (their in-flight ones stay in flight); the HTTP clients
             keep sending. Measured: the start's duration, and the time from the start to
             the first kv answer (a probe client) and the first HTTP answer (the load's);
``replica``  one agreement replica SIGKILLed and started again from its disk (``zz rack
             start`` on a rack with a dead member repairs it), load running: it must
             recover its log clean and catch up with the others;
``torn``     as ``replica``, its current log cut inside its last record before the
             restart (a write the crash cut short): it must say ``torn tail ... at offset
             X``, discard it and catch up from its peers;
``bitflip``  as ``replica``, one bit flipped in a synced record of its current log: it
             must say ``corrupt tail ... at offset X``, abstain and catch up.

After every event and at the end: every acknowledged write present, no replica convicted
(controlds' audit logs: a SHUTDOWN certificate convicting anyone, and the agreement
replicas' convicted sets), the service answering within ``bound_s``. At the end Porcupine
checks the whole kv history and ``zz audit verify`` the audit logs. Figures are printed
and written to OUT/powerloss.json with the history (OUT/history-kv0.json, .html).

SIGKILL keeps the kernel's page cache: what a killed process wrote survives it. So a kill
tests that every process restarts from what it wrote and that nothing was sent before it
was written (the fsync ordering); what a real power cut also loses (written, not synced)
is what the ``torn`` event puts on disk by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zz import audit, kvop, rackctl, walfile
from zz import history as zh
from zz.atomicfile import write_atomic
from zz.campaign import down
from zz.client import Client, ClientParams, ClientTimeout
from zz.config import Config, Service, load
from zz.drill.load import Load, check_acked_posts, entries, kv_step, start_http_load
from zz.drill.rack import DrillError
from zz.http import CLIENT_ERRORS
from zz.ports import free_base
from zz.procrack import leftover_pids, repo_env, spawn, terminate, threads_left

Progress = Callable[[str], None]

KV, WEB = "kv0", "web"
EVENTS = ("rack", "replica", "torn", "bitflip")
SET_PER_KEY = 100  # tokens appended to one set key before the next
OP_TIMEOUT_S = 8.0  # a kv operation's timeout (then pending: indeterminate)
# No replica is convicted for having been down: the report timer's floor is set above the
# scheduling hiccups of this busy 2-core machine, as the drills and the campaign do.
OVERRIDES = {"detect_floor_ms": 4000}


@dataclass
class Options:
    kills: int = 50  # whole-rack power losses
    replica_kills: int = 10  # one agreement replica killed, restarted from its disk
    damage: int = 6  # one agreement replica killed and its log damaged (torn, bitflip, ...)
    min_up_s: float = 2.0  # load before each event: uniform in [min_up_s, max_up_s]
    max_up_s: float = 6.0
    tail_s: float = 2.0  # load after the last event
    during_start: float = 0.0  # probability that a rack kill is followed by one mid-start
    reboot: float = 0.0  # probability that a rack kill is a host restart (another boot id)
    clients: int = 4  # kv register clients
    http_clients: int = 2  # guestbook HTTP clients (0: no web service)
    keys: int = 8  # register keys at a time
    keys_every: int = 4  # a new key set every this many events
    bound_s: float = 60.0  # the service answers within this after a start
    backend: str = "process"
    store: str = "dir"
    durability: str = "fsync"
    overrides: dict[str, Any] = field(default_factory=lambda: dict(OVERRIDES))
    agreed: Path | None = None
    lincheck_timeout_s: float = 300.0

    def schedule(self, rng: random.Random) -> list[str]:
        kinds = ["rack"] * self.kills + ["replica"] * self.replica_kills
        kinds += [("torn", "bitflip")[i % 2] for i in range(self.damage)]
        rng.shuffle(kinds)
        return kinds


@dataclass
class Event:
    n: int
    kind: str  # EVENTS
    at_s: float  # since the run's start
    target: str = ""  # "rack", or the agreement replica (kv0/agreed-2)
    killed: int = 0  # processes SIGKILLed
    in_flight: int = 0  # kv operations in flight at the kill
    cut_during_start_s: float | None = None  # a second power loss this far into the start
    rebooted: bool = False  # the logs were marked as written before a host restart
    views_settled_s: float | None = None  # after the first answer, until one view each
    # Services whose agreement replicas were not in one view within the bound: (view, in
    # view change) of each replica. The service runs on the others (DEGRADED, not FAIL).
    apart: dict[str, list[Any]] = field(default_factory=dict)
    damage: str = ""  # what was done to the log
    start_s: float | None = None  # `zz rack start`'s duration
    first_kv_s: float | None = None  # from the start to the first kv answer
    first_http_s: float | None = None  # ... to the first HTTP answer through the proxy
    recovered: dict[str, Any] = field(default_factory=dict)  # its wal stats after the start
    said: str = ""  # the damaged replica's log line about the damage
    caught_up_s: float | None = None  # restart -> its last_exec at the others' (replica)
    checked: dict[str, int] = field(default_factory=dict)  # writes checked after the event
    lost: list[str] = field(default_factory=list)  # acknowledged writes missing
    convictions: list[str] = field(default_factory=list)  # new since the previous event
    wakeups: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what failed (empty: the event passed)
    notes: list[str] = field(default_factory=list)


class PowerLossError(Exception):
    """The run cannot go on (the rack did not come up, the checker is missing)."""


# ---- the rack ------------------------------------------------------------------------------
def write_rack(directory: Path, name: str = "pl", durability: str = "fsync", web: bool = True,
               checkpoint_interval: int = 32, one_address: bool = False,
               kv: bool = True, webs: int = 1, active: int | None = None) -> Path:  # fmt: skip
    """4 simulated hosts (127.0.0.1..4; all 127.0.0.1 with `one_address`, as guests need),
    kv0 (kv; not without `kv`) and, with `web`, web (wsgi:guestbook), g = f = 1 each, one
    paused spare each, durable agreement replicas (`durability`), free ports. Also the rack
    of scripts/bench/web (web only, durability off unless its --durability) and of
    scripts/bench/hostfail: `webs`
    guestbooks web1..webN (named `web` when there is one), each with `active` active
    execution replicas (default f+1; 2f+1 = SEP and 3f+1 = BASE-like, docs/config.md)."""
    ctl = free_base(range(4))
    lines = [f'[rack]\nname = "{name}"\ndurability = "{durability}"\n'
             f'checkpoint_interval = {checkpoint_interval}\nplacement = "spread"\n']  # fmt: skip
    for h in range(4):
        lines.append(
            f'[[hosts]]\nname = "h{h}"\naddress = "127.0.0.{1 if one_address else h + 1}"\n'
            f"control_port = {ctl + h}\n"
        )
    names = [WEB] if webs == 1 else [f"{WEB}{k}" for k in range(1, webs + 1)]
    services = ([(KV, "kv")] if kv else []) + (
        [(n, "wsgi:guestbook") for n in names] if web else []
    )
    # One range for all services, 70 ports each: separate random ranges could overlap.
    base = free_base(range(70 * max(1, len(services))))
    for sid, (svc, app) in enumerate(services, start=1):
        extra = f"active = {active}\n" if active is not None and app != "kv" else ""
        lines.append(
            f'[[services]]\nname = "{svc}"\nid = {sid}\ng = 1\nf = 1\napp = "{app}"\n'
            f'sleep = "paused"\nbase_port = {base + 70 * (sid - 1)}\n{extra}'
        )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "rack.toml"
    path.write_text("\n".join(lines))
    return path


def rack_pids(config: Config) -> list[int]:
    """Every live process of the rack: the recorded ones (controlds, agreement replicas)
    and whatever else runs naming its config or run directory (execution runtimes, on
    libvirt the guests' QEMU)."""
    state = rackctl.load_state(config)
    pids = {p.pid for p in state.procs if p.alive()} if state is not None else set()
    return sorted(pids | set(rackctl.rack_leftovers(config)))


def power_cut(config: Config) -> list[int]:
    """Power loss: SIGSTOP every process of the rack first, so that none sees another die
    (no log line, no last write, no closed connection acted on), then SIGKILL each (and its
    process group: anything it spawned). Returns the pids killed."""
    # Listed again until nothing new shows: a process forked after a listing, before its
    # parent stopped (a controld starting a runtime), would escape the cut. A stopped
    # process forks no more, so the listing ends.
    pids: list[int] = []
    while new := [p for p in rack_pids(config) if p not in pids]:
        for pid in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
        pids += new
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    # Gone means every thread gone: a runtime's leader thread is a zombie while a worker
    # thread still finishes its system call (a checkpoint's file copy), and the process's
    # sockets close only with the last thread; `zz rack start` right then failed on
    # "ports in use" for that runtime's port (a CI run, and a long run here).
    while any(threads_left(p) for p in pids):
        if time.monotonic() > deadline:
            raise PowerLossError(f"processes {pids} still alive 30 s after SIGKILL")
        time.sleep(0.02)
    return pids


def mark_rebooted(config: Config) -> int:
    """Make every agreement replica's log look written before a host restart (another boot
    id in its header, zz/walfile.py), as after a real power cut, where what was written
    but not synced may be lost; the number of files marked."""
    n = 0
    for s in config.services:
        for r in range(s.n):
            d = rackctl.agreed_data_dir(config, s, r)
            n += sum(walfile.as_if_rebooted(d / f) for f in walfile.FILES if (d / f).exists())
    return n


def agreed_pids(config: Config, s: Service, r: int) -> list[int]:
    conf = config.rack.run_dir / f"s{s.id}" / f"agreed-{r}.conf"
    return leftover_pids(["zz-agreed"], [str(conf)])


def agreed_log(config: Config, s: Service, r: int) -> Path:
    return config.rack.run_dir / f"s{s.id}" / f"agreed-{r}.log"


def agreed_stats_path(config: Config, s: Service, r: int) -> Path:
    return config.rack.run_dir / f"s{s.id}" / f"agreed-{r}.stats.json"


def agreed_stats(config: Config, s: Service, r: int, newer_than: float = 0.0) -> dict[str, Any]:
    """Agreement replica r's stats file ({} if missing, or not written after `newer_than`,
    a wall-clock time: what a replica killed before then left is not its successor's)."""
    path = agreed_stats_path(config, s, r)
    with contextlib.suppress(OSError, ValueError):
        if path.stat().st_mtime <= newer_than:
            return {}
        d = json.loads(path.read_text())
        if isinstance(d, dict):
            return d
    return {}


# ---- what the controlds and agreement replicas say -----------------------------------------
def _wakeup_text(e: audit.Entry) -> str:
    """A WAKEUP acted on, with when controld logged it (the event it is listed under is the
    one after which it was first read) and its evidence: why, and each signer's row (which
    agreement replicas timed out, and on whom)."""
    lines = [x.strip() for x in audit.describe(e)]
    at = time.strftime("%H:%M:%S", time.gmtime(e.time)) + f".{int(e.time * 10) % 10}"
    return f"{lines[0]} (logged {at} UTC" + "".join(f"; {x}" for x in lines[1:]) + ")"


@dataclass
class Verdicts:
    """What the audit logs of every controld hold, deduplicated across hosts: the WAKEUPs
    and SHUTDOWN certificates acted on (a certificate several controlds logged is one)."""

    wakeups: dict[tuple[int, int], str] = field(default_factory=dict)  # (service, seq) -> text
    convictions: dict[tuple[int, int], str] = field(default_factory=dict)
    votes: int = 0  # SHUTDOWN votes received
    torn_tails: int = 0  # controld found its audit log cut short at a start

    @classmethod
    def read(cls, config: Config) -> Verdicts:
        v = cls()
        for hl in audit.load_hosts(config):
            for e in hl.scan.entries:
                key = (int(e.header.get("service", 0)), int(e.header.get("seq", 0) or 0))
                if e.kind == "wakeup" and e.verdict == "acted":
                    v.wakeups.setdefault(key, f"{hl.host}: {_wakeup_text(e)}")
                elif e.kind == "shutdown-certificate" and e.verdict in ("acted", "merged"):
                    if e.header.get("convict"):
                        v.convictions.setdefault(key, f"{hl.host}: {audit.describe(e)[0]}")
                elif e.kind == "shutdown":
                    v.votes += 1
                elif e.kind == "torn-tail":
                    v.torn_tails += 1
        return v


def convicted_sets(config: Config) -> dict[str, list[int]]:
    """Each agreement replica's convicted set (its stats: `exec_convicted`), non-empty ones."""
    out = {}
    for s in config.services:
        for r in range(s.n):
            got = agreed_stats(config, s, r).get("exec_convicted") or []
            if got:
                out[f"{s.name}/agreed-{r}"] = list(got)
    return out


# ---- the kv load ---------------------------------------------------------------------------
class KvLoad:
    """Register clients on the current key set and one set client, recording one history.
    Workers start an operation only while `gate` is set (not while the rack is down)."""

    def __init__(self, config: Config, opts: Options, seed: int) -> None:
        self.config = config
        self.svc = config.service(KV)
        self.opts = opts
        self.seed = seed
        self.rec = zh.HistoryRecorder()
        self.gate = asyncio.Event()
        self.gate.set()
        self.stop = asyncio.Event()
        self.tally: Counter[str] = Counter()
        self.inflight = 0
        self.stamp = b"%x" % time.time_ns()
        self.group = 0
        # set workload: token -> its key; acked / pending (raised) / issued tokens
        self.set_key_of: dict[bytes, bytes] = {}
        self.acked: set[bytes] = set()
        self.pending: set[bytes] = set()
        self.set_keys: list[bytes] = []
        self.dirty: set[bytes] = set()  # set keys appended to since the last check
        self.tasks: list[asyncio.Task[None]] = []
        base = max(0, self.svc.clients - 16)
        need = opts.clients + 3
        if base + need > self.svc.clients:
            raise PowerLossError(f"{KV}: {need} clients from {base} exceed {self.svc.clients}")
        self.base = base

    def client(self, i: int, fast: bool = False) -> Client:
        p = ClientParams.from_config(self.config, KV, self.base + i)
        if fast:  # the probe: retransmit often, to see the first answer soon
            p.initial_timeout, p.max_timeout = 0.2, 0.5
        return Client(p)

    def keys(self) -> list[bytes]:
        return [b"r%s-%d-%d" % (self.stamp, self.group, k) for k in range(self.opts.keys)]

    def start(self) -> None:
        for i in range(self.opts.clients):
            self.tasks.append(asyncio.create_task(self._register(i)))
        self.tasks.append(asyncio.create_task(self._set(self.opts.clients)))

    async def _register(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        c = self.client(i)
        kc = self.rec.client(c, timeout=OP_TIMEOUT_S)
        seen: dict[bytes, bytes | None] = {}
        n = 0
        try:
            while not self.stop.is_set():
                if not self.gate.is_set():
                    await self.gate.wait()
                    continue
                key = rng.choice(self.keys())
                n += 1
                value = b"c%d-%d" % (i, n)
                self.inflight += 1
                try:
                    await kv_step(kc, rng, key, value, seen)
                    self.tally["ok"] += 1
                except ClientTimeout:
                    self.tally["timeouts"] += 1
                finally:
                    self.inflight -= 1
        finally:
            await c.close()

    async def _set(self, i: int) -> None:
        c = self.client(i)
        kc = self.rec.client(c, timeout=OP_TIMEOUT_S)
        n = 0
        try:
            while not self.stop.is_set():
                if not self.gate.is_set():
                    await self.gate.wait()
                    continue
                key = b"set%s-%d" % (self.stamp, n // SET_PER_KEY)
                if not self.set_keys or self.set_keys[-1] != key:
                    self.set_keys.append(key)
                token = b"t%d;" % n
                n += 1
                self.set_key_of[token] = key
                self.dirty.add(key)
                self.inflight += 1
                try:
                    reply = await kc.append(key, token)
                    if reply.ok:
                        self.acked.add(token)
                    else:
                        self.pending.add(token)  # refused? counted as not acknowledged
                        self.tally[f"append_status_{reply.status}"] += 1
                except ClientTimeout:
                    self.pending.add(token)
                    self.tally["timeouts"] += 1
                finally:
                    self.inflight -= 1
        finally:
            await c.close()

    async def close(self) -> None:
        self.stop.set()
        self.gate.set()
        await asyncio.wait(self.tasks, timeout=OP_TIMEOUT_S + 7)
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def check_sets(self, keys: list[bytes], timeout: float) -> tuple[int, list[str]]:
        """Read `keys` (recorded in the history) and check them against what was
        acknowledged before each read was called: (tokens checked, problems)."""
        c = self.client(self.opts.clients + 2)
        kc = self.rec.client(c, timeout=timeout)
        checked, problems = 0, []
        try:
            for key in keys:
                # Acknowledged before the read is called: must be there. Sent before it
                # returned: may be there.
                acked = {t for t in self.acked if self.set_key_of[t] == key}
                reply = await kc.get(key)
                issued = {t for t, k in self.set_key_of.items() if k == key}
                value = reply.value if reply.ok else b""
                lost, extra = set_check(value, acked, issued)
                checked += len(acked)
                problems += [f"{key.decode()}: acknowledged append {t.decode()} lost"
                             for t in sorted(lost)]  # fmt: skip
                problems += [f"{key.decode()}: {x}" for x in extra]
        finally:
            await c.close()
        return checked, problems


def set_check(value: bytes, acked: set[bytes], issued: set[bytes]) -> tuple[set[bytes], list[str]]:
    """The set workload's check of one key's value (tokens "t<n>;" appended): the acked
    tokens missing from it, and what else is wrong (a token twice, one never sent)."""
    tokens = [t + b";" for t in value.split(b";") if t]
    counts = Counter(tokens)
    extra = [f"token {t.decode()} appears {k} times" for t, k in sorted(counts.items()) if k > 1]
    extra += [f"token {t.decode()} was never sent" for t in sorted(counts) if t not in issued]
    return acked - set(counts), extra


# ---- the run -------------------------------------------------------------------------------
class Run:
    def __init__(self, config: Config, opts: Options, seed: int, out: Path,
                 progress: Progress) -> None:  # fmt: skip
        self.config = config
        self.opts = opts
        self.seed = seed
        self.rng = random.Random(seed)
        self.out = out
        self.progress = progress
        self.events: list[Event] = []
        self.t0 = time.monotonic()
        self.proxy: subprocess.Popen[bytes] | None = None
        self.url: str | None = None
        self.http: Load | None = None
        self.http_checked_id = 0  # entries up to this id are checked already
        self.verdicts = Verdicts()
        self.result: dict[str, Any] = {}

    # ---- set-up ----------------------------------------------------------------------------
    def start_proxy(self) -> None:
        port = free_base([0])
        log = self.config.rack.run_dir.parent / "proxy.log"
        cmd = [sys.executable, "-m", "zz", "proxy", str(self.config.path), WEB,
               "--listen", f"127.0.0.1:{port}", "--timeout", "30"]  # fmt: skip
        self.proxy = spawn(cmd, log, env=repo_env())
        deadline = time.monotonic() + 30
        while "listening on" not in (log.read_text() if log.exists() else ""):
            if self.proxy.poll() is not None or time.monotonic() > deadline:
                raise PowerLossError(f"zz proxy did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        self.url = f"http://127.0.0.1:{port}/"

    def stop_proxy(self) -> None:
        if self.proxy is not None:
            terminate(self.proxy)
            self.proxy = None

    # ---- helpers ---------------------------------------------------------------------------
    def now(self) -> float:
        return time.monotonic() - self.t0

    async def _first_kv(self, kv: KvLoad, t0: float) -> float | None:
        """Seconds from t0 to the probe's first kv answer (an unrecorded GET), None if not
        within the bound."""
        c = kv.client(self.opts.clients + 1, fast=True)
        c.start()
        # Dial the replicas again every 0.1 s while they are down (a client's links back
        # off to 1 s, which would measure its backoff rather than the rack).
        for link in c._conns + c._exec_conns:
            link.backoff_max = 0.1
        try:
            left = self.opts.bound_s - (time.monotonic() - t0)
            await c.invoke(kvop.encode_get(b"probe"), read_only=True, timeout=max(left, 0.1))
            return time.monotonic() - t0
        except ClientTimeout:
            return None
        finally:
            await c.close()

    async def _first_http(self, t0_ns: int) -> float | None:
        """Seconds from t0 to the first HTTP request of the load answered after it."""
        if self.http is None:
            return None
        deadline = time.monotonic() + self.opts.bound_s
        seen = len(self.http.http)  # answered before t0 (a request answered after it is later)
        while time.monotonic() < deadline:
            done = [ret for _c, ret, ok in self.http.http[seen:] if ok and ret and ret > t0_ns]
            if done:
                return (min(done) - t0_ns) / 1e9
            await asyncio.sleep(0.05)
        return None

    async def _start(self, ev: Event, what: str) -> bool:
        """`zz rack start` (rackctl.start) in a thread; False, with the problem noted, if it
        failed."""
        t = time.monotonic()
        try:
            await asyncio.to_thread(rackctl.start, self.config, self.opts.agreed,
                                    lambda _line: None, 120.0)  # fmt: skip
        except rackctl.AlreadyUp:
            ev.notes.append(f"{what}: start found nothing dead (something restarted it)")
        except rackctl.RackError as e:
            ev.start_s = round(time.monotonic() - t, 2)
            ev.problems.append(f"{what}: zz rack start failed: {e}")
            self.progress(f"    {what}: zz rack start failed after {ev.start_s} s: {e}")
            return False
        ev.start_s = round(time.monotonic() - t, 2)
        return True

    # ---- events ----------------------------------------------------------------------------
    async def power_loss(self, ev: Event, kv: KvLoad) -> None:
        kv.gate.clear()
        ev.in_flight = kv.inflight
        ev.target = "rack"
        ev.killed = len(await asyncio.to_thread(power_cut, self.config))
        if self.rng.random() < self.opts.during_start:
            await self.cut_during_start(ev)
        if self.rng.random() < self.opts.reboot:
            ev.rebooted = True
            marked = await asyncio.to_thread(mark_rebooted, self.config)
            ev.notes.append(f"host restart: {marked} log files as written under another boot")
        t0, t0_ns, t_wall = time.monotonic(), time.monotonic_ns(), time.time()
        probe = asyncio.create_task(self._first_kv(kv, t0))
        web = asyncio.create_task(self._first_http(t0_ns))
        ok = await self._start(ev, "power loss")
        kv.gate.set()
        ev.first_kv_s = await probe
        first_http = await web
        ev.first_http_s = None if first_http is None else round(first_http, 2)
        ev.first_kv_s = None if ev.first_kv_s is None else round(ev.first_kv_s, 2)
        if not ok:
            return
        if ev.first_kv_s is None:
            ev.problems.append(f"{KV} did not answer within {self.opts.bound_s} s of the start")
        if self.http is not None and ev.first_http_s is None:
            ev.problems.append(f"{WEB} did not answer over HTTP within {self.opts.bound_s} s")
        # What each agreement replica recovered from its log (its first stats file after
        # the start; written every second).
        tails: Counter[str] = Counter()
        views: Counter[int] = Counter()
        deadline = time.monotonic() + 10
        for s in self.config.services:
            for r in range(s.n):
                while not (st := agreed_stats(self.config, s, r, newer_than=t_wall)):
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
                w = st.get("wal") or {}
                tails[str(w.get("recovered_tail"))] += 1
                views[int(st.get("view", -1))] += 1
                if ev.rebooted and not w.get("boot_changed"):
                    ev.problems.append(f"{s.name}/agreed-{r} did not see its log as written"
                                       " before a host restart (wal.boot_changed 0)")  # fmt: skip
                # A kill may cut a write short (torn: never acted on); a corrupt log after
                # a kill would be a record lost under ones synced after it.
                if w.get("recovered_tail") not in ("clean", "torn"):
                    ev.problems.append(f"{s.name}/agreed-{r}: its log after the kill is"
                                       f" {w.get('recovered_tail')}")  # fmt: skip
                if not w.get("recovered_records"):
                    ev.problems.append(f"{s.name}/agreed-{r} recovered nothing from its log"
                                       f" (stats: {w or 'none since the start'})")  # fmt: skip
        ev.recovered = {"tails": dict(tails), "views": dict(views)}
        await self.views_settle(ev, t_wall)

    async def views_settle(self, ev: Event, t_wall: float) -> None:
        """Every agreement replica of a service in one view and not in a view change,
        within the bound: a replica left alone in a later view takes no part in ordering
        (the service then runs on the other 2g+1, one fault from a stall)."""
        deadline = time.monotonic() + self.opts.bound_s
        t = time.monotonic()
        while True:
            apart = {}
            for s in self.config.services:
                got = [agreed_stats(self.config, s, r, newer_than=t_wall) for r in range(s.n)]
                seen = {(st.get("view"), st.get("in_view_change")) for st in got}
                if len(seen) != 1 or next(iter(seen))[1]:
                    apart[s.name] = [(st.get("view"), st.get("in_view_change")) for st in got]
            if not apart:
                ev.views_settled_s = round(time.monotonic() - t, 2)
                return
            if time.monotonic() > deadline:
                ev.apart = apart
                return
            await asyncio.sleep(0.2)

    async def cut_during_start(self, ev: Event) -> None:
        """The power goes again while `zz rack start` brings the rack back: at a seeded
        random moment of the start (processes recovering their logs, runtimes restoring
        checkpoints, controlds provisioning), every process is cut, and again every 0.1 s
        (what the start spawns after the cut dies too) until the start gives up."""
        delay = round(self.rng.uniform(0.0, 4.0), 2)
        task = asyncio.create_task(asyncio.to_thread(
            rackctl.start, self.config, self.opts.agreed, lambda _line: None, 30.0))  # fmt: skip
        await asyncio.sleep(delay)
        cut = 0
        while True:
            cut += len(await asyncio.to_thread(power_cut, self.config))
            if task.done():
                break
            await asyncio.sleep(0.1)
        try:
            await task
            how = "it had finished"
        except rackctl.RackError as e:
            how = f"it failed: {str(e)[:200]}"
        ev.cut_during_start_s = delay
        ev.killed += cut
        ev.notes.append(f"power cut again {delay} s into the start ({cut} processes); {how}")
        # An interrupted start ends in `stop` (rackctl.start's failure path): the rack is
        # recorded as stopped, which the next start accepts as well as a crash.
        cut = len(await asyncio.to_thread(power_cut, self.config))
        if cut:
            ev.notes.append(f"{cut} processes left by the interrupted start cut")

    async def replica_loss(self, ev: Event, kind: str) -> None:
        s = self.config.services[self.rng.randrange(len(self.config.services))]
        r = self.rng.randrange(s.n)
        ev.target = f"{s.name}/agreed-{r}"
        log = agreed_log(self.config, s, r)
        size = log.stat().st_size if log.exists() else 0
        pids = agreed_pids(self.config, s, r)
        if not pids:
            ev.problems.append(f"{ev.target}: not running before the kill")
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        ev.killed = len(pids)
        while any(rackctl.start_ticks(p) is not None for p in pids):
            await asyncio.sleep(0.02)
        others = [agreed_stats(self.config, s, x) for x in range(s.n) if x != r]
        target = max(int(o.get("last_exec", 0)) for o in others)
        hit = None
        if kind != "replica":
            path = walfile.current_log(rackctl.agreed_data_dir(self.config, s, r))
            if path is None:
                ev.problems.append(f"{ev.target}: no log file to damage")
                return
            hit = walfile.tear(path) if kind == "torn" else walfile.flip(path, self.rng)
            if hit is None and kind == "bitflip":
                ev.notes.append("fewer than 2 records after the rewrite: torn instead")
                hit = walfile.tear(path)
            if hit is None:
                ev.notes.append(f"{path} holds no record: nothing damaged")
            else:
                ev.damage = f"{hit.kind}: {hit.detail} in {hit.path.name}"
        t, t_wall = time.monotonic(), time.time()
        if not await self._start(ev, f"restart of {ev.target}"):
            return

        def new_log() -> str:
            try:
                return log.read_bytes()[size:].decode(errors="replace")
            except OSError:
                return ""

        deadline = t + self.opts.bound_s
        while "durable state: recovered" not in new_log() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        text = new_log()
        if "durable state: recovered" not in text:
            ev.problems.append(f"{ev.target}: no 'durable state: recovered' line in its log")
        said = [ln for ln in text.splitlines() if "durable state:" in ln]
        ev.said = " | ".join(re.sub(r"^\S+ zz-agreed: ", "", ln) for ln in said)
        if hit is not None and hit.kind == "torn-rewrite":
            # The newer file is incomplete: the older one (or nothing) is recovered from.
            if "is damaged inside its rewrite" not in text and "no complete log in" not in text:
                said = ev.said or text[-500:]
                ev.problems.append(f"{ev.target}: its log does not say its newer file is"
                                   f" damaged inside its rewrite: {said}")  # fmt: skip
        elif hit is not None:
            word = "torn tail" if hit.kind == "torn" else "corrupt tail"
            if f"{word} in " not in text or f"at offset {hit.offset}" not in text:
                ev.problems.append(f"{ev.target}: its log does not say '{word} ... at offset"
                                   f" {hit.offset}': {ev.said or text[-500:]}")  # fmt: skip
        # Caught up: it executed what the others had when it was killed.
        while time.monotonic() < deadline:
            st = agreed_stats(self.config, s, r, newer_than=t_wall)
            if st.get("wal") and int(st.get("last_exec", 0)) >= target:
                ev.caught_up_s = round(time.monotonic() - t, 2)
                break
            await asyncio.sleep(0.1)
        st = agreed_stats(self.config, s, r, newer_than=t_wall)
        w = st.get("wal") or {}
        ev.recovered = {k: w.get(k) for k in ("recovered_records", "recovered_tail",
                                              "discard_offset", "recovered_stable",
                                              "recovered_last_exec", "recover_ms",
                                              "abstain_until", "abstaining")}  # fmt: skip
        tails = {None: "clean", "torn": "torn", "torn-rewrite": "corrupt", "bitflip": "corrupt"}
        want = tails[hit.kind if hit is not None else None]
        if w.get("recovered_tail") != want:
            ev.problems.append(f"{ev.target}: recovered_tail {w.get('recovered_tail')!r},"
                               f" expected {want!r}")  # fmt: skip
        if ev.caught_up_s is None:
            ev.problems.append(f"{ev.target}: not at seq {target} (the others' when it was"
                               f" killed) within {self.opts.bound_s} s of its restart"
                               f" (last_exec {st.get('last_exec')})")  # fmt: skip

    # ---- checks ----------------------------------------------------------------------------
    async def check(self, ev: Event, kv: KvLoad, final: bool = False) -> None:
        """Every acknowledged write present, nobody convicted: after an event (what was
        written since the previous check) or at the end (everything)."""
        keys = list(kv.set_keys) if final else sorted(kv.dirty)
        kv.dirty.clear()
        try:
            n, problems = await kv.check_sets(keys, timeout=self.opts.bound_s)
            ev.checked["kv_appends"] = n
            ev.lost += problems
        except ClientTimeout:
            ev.problems.append(f"{KV}: reading the set keys timed out")
        if self.http is not None and self.url is not None:
            acked = dict(self.http.acked)
            since = 1 if final else min(
                [i for i in acked.values() if i > self.http_checked_id], default=0)  # fmt: skip
            if since:
                try:
                    got = await entries(self.url, since=since)
                    lost, moved = check_acked_posts(acked, got, since=since)
                    ev.checked["http_posts"] = sum(1 for i in acked.values() if i >= since)
                    ev.lost += [f"acknowledged POST {m!r} (entry {acked[m]}) lost" for m in lost]
                    ev.lost += [f"acknowledged POST {m!r} not once as entry {acked[m]}"
                                for m in moved]  # fmt: skip
                    # Every POST's message is unique: one there twice, acknowledged or not,
                    # was executed twice (a retransmission after a restart taken anew).
                    twice = Counter(str(e.get("message")) for e in got)
                    ev.lost += [f"entry {m!r} is there {k} times" for m, k in twice.items()
                                if k > 1 and m not in acked]  # fmt: skip
                    ev.checked["http_entries"] = len(got)
                    self.http_checked_id = max(acked.values(), default=0)
                except (OSError, ValueError, TimeoutError, DrillError, *CLIENT_ERRORS) as e:
                    # An error status (the proxy's 504 when the service is down) is a
                    # problem of this event, not the end of the run: the event's own
                    # problems (a failed start) are what says why.
                    ev.problems.append(f"{WEB}: cannot read /entries.json: {e}")
        v = await asyncio.to_thread(Verdicts.read, self.config)
        ev.convictions = [t for k, t in sorted(v.convictions.items())
                          if k not in self.verdicts.convictions]  # fmt: skip
        ev.wakeups = [t for k, t in sorted(v.wakeups.items()) if k not in self.verdicts.wakeups]
        self.verdicts = v
        if ev.convictions:
            ev.problems.append(f"convicted: {'; '.join(ev.convictions)}")

    # ---- the whole run ---------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        kv = KvLoad(self.config, self.opts, self.seed)
        kv.start()
        if self.url is not None:
            self.http = start_http_load(self.url, self.opts.http_clients)
        schedule = self.opts.schedule(self.rng)
        try:
            for n, kind in enumerate(schedule, start=1):
                if n > 1 and (n - 1) % self.opts.keys_every == 0:
                    kv.group += 1
                await asyncio.sleep(self.rng.uniform(self.opts.min_up_s, self.opts.max_up_s))
                ev = Event(n, kind, round(self.now(), 2))
                if kind == "rack":
                    await self.power_loss(ev, kv)
                else:
                    await self.replica_loss(ev, kind)
                await self.check(ev, kv)
                self.events.append(ev)
                self.progress(format_event(ev))
                self.save_partial(kv)
                if any("zz rack start failed" in p for p in ev.problems):
                    break  # a rack that does not start: nothing more to learn from it
            await asyncio.sleep(self.opts.tail_s)
        finally:
            await kv.close()
            if self.http is not None:
                self.http.stop.set()
                await asyncio.wait(self.http.tasks, timeout=40)
                for t in self.http.tasks:
                    t.cancel()
                await asyncio.gather(*self.http.tasks, return_exceptions=True)
        final = Event(0, "final", round(self.now(), 2))
        await self.check(final, kv, final=True)
        return self.finish(kv, final)

    def save_partial(self, kv: KvLoad) -> None:
        doc = {"seed": self.seed, "running": True,
               "events": [asdict(e) for e in self.events]}  # fmt: skip
        write_atomic(self.out / "powerloss.json", json.dumps(doc, indent=1) + "\n")
        kv.rec.history().save(self.out / f"history-{KV}.json")

    def finish(self, kv: KvLoad, final: Event) -> dict[str, Any]:
        h = kv.rec.history()
        h.save(self.out / f"history-{KV}.json")
        try:
            verdict = zh.check(h, html=self.out / f"history-{KV}.html",
                               timeout=self.opts.lincheck_timeout_s, build=False)  # fmt: skip
            lin: bool | None = verdict.linearizable if verdict.result != "Unknown" else None
            lin_text = str(verdict)
        except zh.LincheckError as e:
            lin, lin_text = None, f"check failed to run: {e}"
        audit_ok, audit_text = verify_audit(self.config)
        acked_kv = sum(1 for o in h.operations if o.op in ("put", "cas", "append")
                       and o.output is not None and o.output.status == "ok")  # fmt: skip
        return summarize(
            self.events,
            final,
            {
                "linearizable": lin,
                "linearizability": lin_text,
                "operations": len(h.operations),
                "pending": sum(1 for o in h.operations if o.pending),
                "kv_acked_writes": acked_kv,
                "kv_appends_acked": len(kv.acked),
                "kv_appends_indeterminate": len(kv.pending),
                "http_posts_acked": len(self.http.acked) if self.http else 0,
                "http_tally": dict(self.http.tally) if self.http else {},
                "kv_tally": dict(kv.tally),
                "audit_verified": audit_ok,
                "audit": audit_text,
                "audit_torn_tails": self.verdicts.torn_tails,
                "convicted_sets": convicted_sets(self.config),
                "bound_s": self.opts.bound_s,
            },
        )


def verify_audit(config: Config) -> tuple[bool, str]:
    """`zz audit verify` over every host's audit log: the chains and every signature."""
    try:
        res = audit.verify_logs(config, audit.load_hosts(config))
    except Exception as e:  # the verdict is the figure; a crash of the verifier is one too
        return False, f"audit verify failed to run: {type(e).__name__}: {e}"
    text = (f"{sum(x.entries for x in res.logs)} entries in {len(res.logs)} logs,"
            f" {res.errors} errors, {res.warnings} warnings")  # fmt: skip
    bad = [f"{f.where}: {f.text}" for f in res.findings if f.level == "error"][:3]
    return res.errors == 0, text + (f": {bad}" if bad else "")


# ---- figures -------------------------------------------------------------------------------
def _stats(xs: list[float]) -> dict[str, float | None]:
    return {
        "median": round(statistics.median(xs), 2) if xs else None,
        "worst": round(max(xs), 2) if xs else None,
    }


def summarize(events: list[Event], final: Event, extra: dict[str, Any]) -> dict[str, Any]:
    """The run's figures and verdict from its events and the final check."""
    rack = [e for e in events if e.kind == "rack"]
    lost = [x for e in [*events, final] for x in e.lost]
    convictions = [x for e in [*events, final] for x in e.convictions]
    wakeups = [x for e in [*events, final] for x in e.wakeups]
    problems = [f"event {e.n} ({e.kind}): {p}" for e in events for p in e.problems]
    problems += [f"final check: {p}" for p in final.problems]
    if lost:
        problems.append(f"{len(lost)} acknowledged writes lost or wrong: {lost[:5]}")
    if extra.get("convicted_sets"):
        problems.append(f"agreement replicas count convicted replicas: {extra['convicted_sets']}")
    if extra.get("linearizable") is False:
        problems.append("the kv history is NOT linearizable")
    elif extra.get("linearizable") is None:
        problems.append(f"linearizability unknown: {extra.get('linearizability')}")
    if extra.get("audit_verified") is False:
        problems.append(f"audit logs do not verify: {extra.get('audit')}")
    degraded = [f"event {e.n} ({e.kind}): agreement replicas not in one view"
                f" {extra.get('bound_s', '')} s after the start ((view, in view change) by"
                f" replica): {e.apart}" for e in events if e.apart]  # fmt: skip
    figures = {
        "rack_kills": len(rack),
        "views_apart": sum(1 for e in events if e.apart),
        "views_settled_s": _stats(
            [e.views_settled_s for e in rack if e.views_settled_s is not None]
        ),
        "replica_kills": sum(1 for e in events if e.kind == "replica"),
        "damaged_logs": dict(Counter(e.damage.split(":")[0] for e in events if e.damage)),
        "acked_writes_checked": {
            "kv_appends": final.checked.get("kv_appends", 0),
            "http_posts": final.checked.get("http_posts", 0),
            "kv_register_writes_in_history": extra.get("kv_acked_writes", 0),
        },
        "lost_writes": len(lost),
        "linearizable": extra.get("linearizable"),
        "convictions": len(convictions),
        "wakeups": len(wakeups),
        "start_s": _stats([e.start_s for e in rack if e.start_s is not None]),
        "host_restarts": sum(1 for e in rack if e.rebooted),
        "cut_during_start": sum(1 for e in rack if e.cut_during_start_s is not None),
        "first_kv_answer_s": _stats([e.first_kv_s for e in rack if e.first_kv_s is not None]),
        "first_kv_answer_s_kill": _stats(
            [e.first_kv_s for e in rack if e.first_kv_s is not None and not e.rebooted]
        ),
        "first_kv_answer_s_host_restart": _stats(
            [e.first_kv_s for e in rack if e.first_kv_s is not None and e.rebooted]
        ),
        "first_http_answer_s": _stats([e.first_http_s for e in rack if e.first_http_s is not None]),
        "replica_caught_up_s": _stats(
            [e.caught_up_s for e in events if e.kind != "rack" and e.caught_up_s is not None]
        ),
    }
    return {
        "result": "FAIL" if problems else "DEGRADED" if degraded else "PASS",
        "degraded": degraded,
        "problems": problems,
        "figures": figures,
        **extra,
        "lost": lost[:100],
        "convicted": convictions,
        "woken": wakeups,
        "final": asdict(final),
        "events": [asdict(e) for e in events],
    }


def format_event(e: Event) -> str:
    head = f"  {e.n:3d} {e.kind:7} t={e.at_s:7.1f}s {e.target}"
    if e.kind == "rack":
        again = ("" if e.cut_during_start_s is None
                 else f", cut again {e.cut_during_start_s} s into the start")  # fmt: skip
        head += (f" ({'host restart' if e.rebooted else 'kill'}{again}):"
                 f" {e.killed} processes killed, {e.in_flight} kv ops in flight; start"
                 f" {e.start_s} s, first answer kv {e.first_kv_s} s http {e.first_http_s} s,"
                 f" logs {e.recovered.get('tails')} views {e.recovered.get('views')}")  # fmt: skip
    else:
        head += (f": restart {e.start_s} s, caught up {e.caught_up_s} s, tail"
                 f" {e.recovered.get('recovered_tail')}")  # fmt: skip
        if e.damage:
            head += f"; {e.damage}"
    head += f"; checked {e.checked}"
    if e.wakeups:
        head += f"; WAKEUPs: {e.wakeups}"
    if e.apart:
        head += f"; NOT in one view: {e.apart}"
    bad = e.problems + ([f"{len(e.lost)} writes lost or wrong: {e.lost[:3]}"] if e.lost else [])
    return head + (f" -> FAIL: {'; '.join(bad)}" if bad else " -> ok")


def format_figures(doc: dict[str, Any]) -> str:
    f = doc["figures"]
    a = f["acked_writes_checked"]

    def mw(key: str) -> str:
        return f"median {f[key]['median']} s, worst {f[key]['worst']} s"

    audited = "verified" if doc.get("audit_verified") else "NOT verified"
    lines = [
        f"==== power loss: {doc.get('command', '')} (seed {doc.get('seed')})",
        f"whole-rack kills             {f['rack_kills']} ({f['host_restarts']} as host restarts,"
        f" {f['cut_during_start']} cut again during the start)",
        f"agreement replica kills      {f['replica_kills']}",
        f"damaged logs                 {f['damaged_logs']}",
        f"acknowledged writes checked  {a['kv_appends']} kv appends and {a['http_posts']}"
        f" guestbook POSTs read back; {a['kv_register_writes_in_history']} kv writes in the"
        " history",
        f"lost writes                  {f['lost_writes']}",
        f"linearizable                 {f['linearizable']} ({doc.get('linearizability')})",
        f"convictions                  {f['convictions']} (WAKEUPs {f['wakeups']})",
        f"zz rack start                {mw('start_s')}",
        f"start -> first kv answer     {mw('first_kv_answer_s')} (kill:"
        f" {mw('first_kv_answer_s_kill')}; host restart: {mw('first_kv_answer_s_host_restart')})",
        f"start -> first HTTP answer   {mw('first_http_answer_s')}",
        f"replica restart -> caught up {mw('replica_caught_up_s')}",
        f"audit logs                   {audited}: {doc.get('audit')}",
        f"agreement views settled      {mw('views_settled_s')} after the first answer;"
        f" {f['views_apart']} events left a replica in another view",
        f"RESULT: {doc['result']}",
    ]
    bad = doc["problems"][:20] + doc.get("degraded", [])[:5]
    return "\n".join(lines + [f"  {p}" for p in bad])


# ---- entry points --------------------------------------------------------------------------
def keep_replica_logs(config: Config, dest: Path) -> list[Path]:
    """Copy the runtimes' logs (each controld's replicas/<domain>/replica.log, every start
    of the run appended) to DEST/<host>/<domain>.log: `down` removes the replicas' homes
    with them."""
    copied = []
    for src in sorted((config.rack.run_dir / "controld").glob("*/replicas/*/replica.log")):
        target = dest / src.parent.parent.parent.name / f"{src.parent.name}.log"
        target.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            shutil.copy2(src, target)
            copied.append(target)
    return copied


def run_powerloss(opts: Options, seed: int, out: Path, progress: Progress = print,
                  workdir: Path | None = None, keep: bool = False) -> dict[str, Any]:  # fmt: skip
    """Bring a rack up, run the events, write OUT/powerloss.json and return it. The rack
    goes down whatever happens; its directory (logs, and the runtimes' logs copied to
    replica-logs/ before `down` removes them) is kept when the run failed, woke a spare, or
    `keep`."""
    try:
        zh.lincheck_binary(build=False)
    except zh.LincheckError as e:
        raise PowerLossError(f"cannot check the kv history: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="zz-powerloss-", dir=workdir))
    libvirt = opts.backend == "libvirt"
    if libvirt:
        os.chmod(tmp, 0o755)  # QEMU runs as libvirt-qemu and must reach the guests' shares
    # A name of its own: ZFS pools and libvirt domains are named after the rack.
    name = f"pl{os.getpid() % 100000}"
    config = load(write_rack(tmp, name, durability=opts.durability, web=opts.http_clients > 0,
                             one_address=libvirt))  # fmt: skip
    doc: dict[str, Any] = {"result": "FAIL", "problems": []}
    run = Run(config, opts, seed, out, progress)
    try:
        progress(f"rack in {tmp}: up ({opts.backend} backend, {opts.store} store,"
                 f" durability {opts.durability}, --set {opts.overrides})")  # fmt: skip
        t = time.monotonic()
        try:
            rackctl.up(config, backend=opts.backend, store=opts.store, agreed=opts.agreed,
                       overrides=opts.overrides)  # fmt: skip
        except rackctl.RackError as e:
            raise PowerLossError(f"the rack did not come up: {e}") from e
        progress(f"rack up in {time.monotonic() - t:.1f} s")
        if opts.http_clients > 0:
            run.start_proxy()
            progress(f"zz proxy on {run.url}")
        run.t0 = time.monotonic()
        doc = asyncio.run(run.run())
    except PowerLossError as e:
        doc = {"result": "FAIL", "problems": [str(e)], "error": str(e),
               "figures": None, "events": [asdict(x) for x in run.events]}  # fmt: skip
        progress(f"power loss run stopped: {e}")
    finally:
        run.stop_proxy()
        kept = doc.get("result") != "PASS" or keep or bool(doc.get("woken"))
        if kept:
            keep_replica_logs(config, tmp / "replica-logs")  # before down removes them
        down(config)
        if kept:
            progress(f"rack directory kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    doc.update(
        {
            "seed": seed,
            "command": " ".join(["zz bench powerloss", *sys.argv[1:]]) if sys.argv else "",
            "options": {**asdict(opts), "agreed": str(opts.agreed)},
            "rack_dir": str(tmp) if tmp.exists() else None,
            "uptime": _uptime(),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
    )
    write_atomic(out / "powerloss.json", json.dumps(doc, indent=1, default=str) + "\n")
    return doc


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _terminate(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def _setting(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set {text!r}: want KEY=VALUE")
    return key, int(value) if value.lstrip("-").isdigit() else value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="zz bench powerloss",
        description="Jepsen-style power-loss tests: under kv load (one history, checked by"
        " Porcupine) and guestbook HTTP load (acknowledged POSTs read back), SIGKILL every"
        " process of a durable rack at seeded random moments and `zz rack start` it; kill"
        " one agreement replica, or damage its log, and restart it from its disk. Checks no"
        " acknowledged write lost, a linearizable history, no conviction, and the time to"
        " the first answer. Exit 0 PASS, 1 FAIL, 3 DEGRADED (every check held, but after a"
        " start the agreement replicas of a service were not in one view within --bound),"
        " 2 could not run.",
    )
    p.add_argument("--seed", type=int, help="seed (default: from the clock, printed)")
    p.add_argument("--kills", type=int, default=50, help="whole-rack power losses (50)")
    p.add_argument(
        "--replica-kills",
        type=int,
        default=10,
        help="one agreement replica killed and restarted from its disk (10)",
    )
    p.add_argument(
        "--damage",
        type=int,
        default=6,
        help="one agreement replica killed, its log torn or bit-flipped (6)",
    )
    p.add_argument("--min-up", type=float, default=2.0, help="load before an event: at least (s)")
    p.add_argument("--max-up", type=float, default=6.0, help="... at most (s)")
    p.add_argument("--clients", type=int, default=4, help="kv register clients (4)")
    p.add_argument(
        "--http-clients",
        type=int,
        default=2,
        help="guestbook HTTP clients through zz proxy (2; 0: no guestbook)",
    )
    p.add_argument(
        "--during-start",
        type=float,
        default=0.25,
        metavar="P",
        help="probability that a whole-rack kill is followed by another one at a random"
        " moment of the `zz rack start` (0.25)",
    )
    p.add_argument(
        "--reboot",
        type=float,
        default=0.5,
        metavar="P",
        help="probability that a whole-rack kill is a host restart: every agreement"
        " replica's log then looks written under another boot id (0.5)",
    )
    p.add_argument(
        "--bound",
        type=float,
        default=60.0,
        help="the service must answer within this after a start (s, 60)",
    )
    p.add_argument("--backend", choices=rackctl.BACKENDS, default="process")
    p.add_argument("--store", choices=rackctl.STORE_CHOICES, default="dir")
    p.add_argument("--durability", choices=("fsync", "write"), default="fsync")
    p.add_argument(
        "--set",
        action="append",
        type=_setting,
        default=[],
        metavar="KEY=VALUE",
        help="replica file setting for the rack (default detect_floor_ms=4000)",
    )
    p.add_argument("--agreed", type=Path, help="zz-agreed binary (default $ZZ_AGREED or build)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="3 rack kills, 1 replica kill, 2 damaged logs, 1-3 s apart",
    )
    p.add_argument("--keep", action="store_true", help="keep the rack directory (logs)")
    p.add_argument("--out", type=Path, help="output directory (default bench-results/...)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    seed = a.seed if a.seed is not None else int(time.time()) % 1_000_000
    overrides = dict(OVERRIDES)
    overrides.update(dict(a.set))
    opts = Options(
        kills=3 if a.quick else a.kills,
        replica_kills=1 if a.quick else a.replica_kills,
        damage=2 if a.quick else a.damage,
        min_up_s=1.0 if a.quick else a.min_up,
        max_up_s=3.0 if a.quick else a.max_up,
        during_start=a.during_start,
        reboot=a.reboot,
        clients=a.clients,
        http_clients=a.http_clients,
        bound_s=a.bound,
        backend=a.backend,
        store=a.store,
        durability=a.durability,
        overrides=overrides,
        agreed=a.agreed or (Path(os.environ["ZZ_AGREED"]) if os.environ.get("ZZ_AGREED") else None),
    )
    from zz.procrack import REPO

    out = a.out or REPO / "bench-results" / f"powerloss-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"seed {seed}; writing {out / 'powerloss.json'}", flush=True)
    try:
        doc = run_powerloss(opts, seed, out, lambda x: print(x, flush=True), keep=a.keep)
    except PowerLossError as e:
        print(f"zz bench powerloss: {e}", file=sys.stderr)
        return 2
    if doc.get("figures"):
        print(format_figures(doc))
    else:
        print(f"RESULT: {doc['result']}: {doc.get('error')}")
    print(f"written: {out / 'powerloss.json'}")
    return {"PASS": 0, "DEGRADED": 3}.get(doc["result"], 1)


if __name__ == "__main__":
    sys.exit(main())
