# zz/drill/observe.py - what a drill sees: every controld's status, with its agreement
# replicas' stats, polled on one monotonic clock; the rules read from them (rounds open,
# spares back).
"""The drill's observer (docs/operations.md, "Drills").

Every POLL_S: each controld's `status` as operator 0 (its counters, its `recent` lines,
which name the replicas woken, convicted and provisioned, and the stats file of each
agreement replica on its host: the first change after the fault of the view or of a fault
counter is an event). Nothing here acts on the rack; zz/campaign.py watches with the same
Observer."""

from __future__ import annotations

import asyncio
import datetime
import json
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from zz.config import Config, Service
from zz.rackctl import operator_call

POLL_S = 0.1
# Status samples kept per runtime (Observer.runtime_clock): 40 s of polls.
_CLOCK_SAMPLES = 400


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
    # Hosts whose controld a poll does not wait for (the partition drill's, while it is cut
    # off: each call to it takes the 3 s timeout); the status calls still running, by host.
    unwaited: set[str] = field(default_factory=set)
    _asking: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    # Per runtime ("svc/index"), each status file seen: (its mtime on the host's clock, that
    # less the status's `mono_now`): the offset that places the runtime's wake_marks on the
    # host's clock, in the order seen (recovery_marks takes the first after a wake).
    runtime_clock: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    clock_notes: dict[str, dict[str, float]] = field(default_factory=dict)
    # Per runtime, the steps of each checkpoint seq's report it showed (status
    # `checkpoint_reports`), on the host's wall clock: zz drill splits detection by them.
    checkpoint_reports: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    # Per sleeping replica, the last status of its host's warm stager seen (controld/warm.py).
    warm_last: dict[str, dict[str, Any]] = field(default_factory=dict)

    def now(self) -> int:
        return time.monotonic_ns()

    def rel(self) -> list[Event]:
        """Every event with `t` set relative to the fault."""
        for e in self.events:
            e.t = (e.t_ns - self.fault_ns) / 1e9
        return self.events

    def read_agreed(self) -> None:
        """The agreement replicas' stats as their controlds returned them in the last
        read_controlds (`agreed` of `status`)."""
        reported = {
            e["name"]: e.get("stats")
            for st in self.controld.values()
            for e in st.get("agreed", [])
            if isinstance(e, dict) and "name" in e
        }
        for s in self.services:
            for r in range(s.n):
                name = f"{s.name}/agreed-{r}"
                d = reported.get(name)
                if not isinstance(d, dict):
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
        """One observation of every controld and agreement replica, then POLL_S of rest. A
        controld in `unwaited` (a host the partition drill cut off) is not waited for: it
        is asked in the background, its answer taken when it comes."""
        await self.read_controlds(patient=False)
        self.read_agreed()
        await asyncio.sleep(POLL_S)

    async def read_controlds(self, patient: bool = True) -> None:
        """Ask every controld for its status (as operator 0, 3 s each) and take in what
        changed, waiting until each answered or timed out; not `patient`: except those in
        `unwaited`, which are asked in the background (and not again while that call
        runs)."""

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
            self._take_clocks(st)
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

        for name, t in list(self._asking.items()):
            if t.done():
                del self._asking[name]
        started = {
            h.name: asyncio.create_task(one(h))
            for h in self.config.hosts
            if h.name not in self._asking
        }
        self._asking.update(started)
        todo = [t for n, t in self._asking.items() if patient or n not in self.unwaited]
        if todo:
            await asyncio.wait(todo)
        for name, t in list(self._asking.items()):
            if t.done():
                del self._asking[name]

    def _take_clocks(self, st: dict[str, Any]) -> None:
        for who, w in (st.get("warm") or {}).items():
            if isinstance(w, dict):
                self.warm_last[who] = w  # a stager goes once its replica is awake
        for e in st.get("runtimes", []):
            status, written = e.get("status"), e.get("status_written_at")
            if not isinstance(status, dict) or not isinstance(written, int | float):
                continue
            now = status.get("mono_now")
            if not isinstance(now, int | float):
                continue
            who = f"{e.get('service')}/{e.get('index')}"
            seen = self.runtime_clock.setdefault(who, [])
            if not seen or seen[-1][0] != written:
                seen.append((written, written - now))
                del seen[:-_CLOCK_SAMPLES]
            for rep in status.get("checkpoint_reports", []):
                if isinstance(rep, dict) and isinstance(rep.get("seq"), int):
                    # On the host's clock by this status's offset.
                    self.checkpoint_reports.setdefault(who, {}).setdefault(rep["seq"], {
                        k: v if k == "fault" else v + written - now for k, v in rep.items()
                        if k != "seq" and isinstance(v, int | float)})  # fmt: skip

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

    def agreed_of(self, s: Service) -> dict[str, dict[str, Any]]:
        """The latest stats of `s`'s agreement replicas, by name."""
        return {n: d for n, d in self.agreed.items() if n.startswith(f"{s.name}/agreed-")}

    def agreed_deltas(self, services: list[Service], key: str) -> dict[str, int]:
        """How much stats counter `key` grew since the fault in each agreement replica of
        `services`."""
        return {
            n: d.get(key, 0) - self.agreed_base.get(n, {}).get(key, 0)
            for n, d in self.agreed.items()
            if any(n.startswith(f"{s.name}/agreed-") for s in services)
        }


async def agreed_entries_now(config: Config, s: Service) -> dict[str, dict[str, Any]]:
    """`s`'s agreement replicas as their controlds report them now (agreed_list entries by
    name: state, stats, rss_mib, ...); none for one whose controld does not answer."""
    hosts = {config.replica_host(s, r).name: config.replica_host(s, r) for r in range(s.n)}

    async def one(h: Any) -> dict[str, Any]:
        try:
            return await operator_call(config, h, {"op": "agreed_list"}, timeout=5.0)
        except Exception:  # not answering: its replicas are unknown
            return {}

    answers = await asyncio.gather(*(one(h) for h in hosts.values()))
    names = {f"{s.name}/agreed-{r}" for r in range(s.n)}
    return {
        e["name"]: e
        for answer in answers
        for e in answer.get("agreed", [])
        if isinstance(e, dict) and e.get("name") in names
    }


async def agreed_stats_now(config: Config, s: Service) -> list[dict[str, Any]]:
    """The stats of `s`'s agreement replicas as their controlds report them now
    (agreed_list; {} for one whose controld does not answer or that wrote none)."""
    entries = await agreed_entries_now(config, s)
    out = []
    for r in range(s.n):
        e = entries.get(f"{s.name}/agreed-{r}", {})
        out.append(e.get("stats") if isinstance(e.get("stats"), dict) else {})
    return out


async def agreed_logs(config: Config, s: Service, lines: int = 1000) -> dict[str, list[str]]:
    """The last `lines` lines of each of `s`'s agreement replicas' logs, through their
    controlds (agreed_log); none for one whose controld does not answer."""

    async def one(r: int) -> tuple[str, list[str]]:
        h = config.replica_host(s, r)
        req = {"op": "agreed_log", "service": s.name, "replica": r, "lines": lines}
        try:
            got = await operator_call(config, h, req, timeout=5.0)
        except Exception:  # not answering: its log is unknown
            return f"{s.name}/agreed-{r}", []
        return f"{s.name}/agreed-{r}", [x for x in got.get("lines", []) if isinstance(x, str)]

    return dict(await asyncio.gather(*(one(r) for r in range(s.n))))


# zz-agreed's log lines (agreement/src/log.c: UTC with milliseconds) that mark a recovery's
# steps: the first flag of a fault, and the first WAKEUP formed.
_LOG_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3})Z ")
_FLAGGED = re.compile(r"zz-agreed: replica \d+: execution (mismatch|timeout) at seq \d+")
_FORMED = re.compile(r"zz-agreed: replica \d+: WAKEUP seq \d+ wake \[")


def log_time(line: str) -> float | None:
    """The wall-clock time (Unix seconds) of a zz-agreed log line, None without a stamp."""
    m = _LOG_STAMP.match(line)
    if m is None:
        return None
    when = datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f")
    return when.replace(tzinfo=datetime.UTC).timestamp()


def recovery_marks(
    obs: Observer, logs: dict[str, list[str]], fault_wall: float, service: str
) -> dict[str, dict[str, float]]:
    """Per replica of `service` woken after the fault ("svc/i"), the steps of its
    recovery in seconds after the fault (zz/report.py PHASES): from the agreement
    replicas' logs (`logs`, wall clock), the woken replica's controld (`wakes`, wall
    clock) and its runtime's `wake_marks` (its own monotonic clock, placed on the host's
    by the status file's mtime and the status's `mono_now`)."""

    def rel(t: float) -> float:
        return round(t - fault_wall, 4)

    shared: dict[str, float] = {}
    for lines in logs.values():
        for line in lines:
            t = log_time(line)
            if t is None or t < fault_wall:
                continue
            for key, rx in (("flagged", _FLAGGED), ("wakeup_formed", _FORMED)):
                if rx.search(line) and (key not in shared or rel(t) < shared[key]):
                    shared[key] = rel(t)
    out: dict[str, dict[str, float]] = {}
    for st in obs.controld.values():
        for w in st.get("wakes", []):
            at = w.get("accepted_at")
            if w.get("service") != service or not isinstance(at, int | float) or at < fault_wall:
                continue
            who = f"{service}/{w.get('index')}"
            if who in out:
                continue  # the first wake after the fault
            m = dict(shared)
            for key, name in (("received_at", "wakeup_received"), ("accepted_at",
                              "wakeup_accepted"), ("taken_at", "wake_taken"),
                              ("resume_at", "resume_start"), ("resumed_at", "resumed"),
                              ("agent_woke_at", "agent_woke")):  # fmt: skip
                if isinstance(w.get(key), int | float):
                    m[name] = rel(w[key])
            after = w.get("resumed_at", at)
            m.update(_runtime_marks(obs, service, w.get("index"), fault_wall, at, after))
            out[who] = m
    return out


def _wake_offset(obs: Observer, who: str, after: float) -> float | None:
    """The runtime's clock offset (host wall - its monotonic) from the first status it
    wrote after `after` (the resume): a guest's monotonic clock stands still while it is
    paused, and may run at another rate than the host's, so the offset taken nearest the
    wake places its marks best. Notes in `obs.clock_notes[who]` how far the offset moved
    from then to the last status."""
    seen = [s for s in obs.runtime_clock.get(who, []) if s[0] >= after]
    if not seen:
        return None
    (w0, o0), (w1, o1) = seen[0], seen[-1]
    obs.clock_notes[who] = {"first_status_after_s": round(w0 - after, 3),
                            "span_s": round(w1 - w0, 3),
                            "offset_moved_ms": round((o1 - o0) * 1000, 1)}  # fmt: skip
    return o0


def _runtime_marks(
    obs: Observer,
    service: str,
    index: object,
    fault_wall: float,
    since: float,
    resumed: float | None = None,
) -> dict[str, float]:
    """The woken runtime's wake_marks after `since` (wall clock), seconds after the fault;
    `runtime_ready`: when it connected to the agreement replicas (else noticed/started).
    Placed on the host's clock by the first status written after `resumed` (else by the
    last one)."""
    for st in obs.controld.values():
        for e in st.get("runtimes", []):
            if e.get("service") != service or e.get("index") != index:
                continue
            status, written = e.get("status"), e.get("status_written_at")
            if not isinstance(status, dict) or not isinstance(written, int | float):
                return {}
            marks, now = status.get("wake_marks"), status.get("mono_now")
            if not isinstance(marks, dict) or not isinstance(now, int | float):
                return {}
            offset = written - now
            if resumed is not None:
                first = _wake_offset(obs, f"{service}/{index}", resumed)
                if first is not None:
                    offset = first
            out = {
                k: round(offset + v - fault_wall, 4)
                for k, v in marks.items()
                if isinstance(v, int | float) and offset + v >= since - 0.05
            }
            ready = out.get("link_up", out.get("noticed", out.get("started")))
            if ready is not None:
                out["runtime_ready"] = ready
            return out
    return {}


def agreed_stats(config: Config, s: Service, r: int) -> dict[str, Any] | None:
    """Agreement replica r's stats file (zz-agreed rewrites it every status period), read
    here: for tools on the rack's machine (zz/powerloss.py) and the limits drills' last
    look (zz/drill/client_faults.py); the observer takes them from the controlds."""
    path = config.rack.run_dir / f"s{s.id}" / f"agreed-{r}.stats.json"
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _is_fault_counter(key: str) -> bool:
    return any(w in key for w in ("mismatch", "timeout", "fault", "wakeup", "shutdown", "convict"))


def running(obs: Observer, s: Service) -> list[int]:
    """Execution replicas of `s` controld shows running (active or recovering): after a
    conviction the woken spare is active and the convicted index a fresh spare."""
    return sorted(
        rec["index"]
        for st in obs.controld.values()
        for rec in st.get("replicas", [])
        if rec.get("service") == s.name and rec.get("state") in ("active", "recovering")
    )


def sleeping(obs: Observer) -> dict[str, list[int]]:
    """Per service, the execution replicas controld shows asleep."""
    out: dict[str, list[int]] = {}
    for st in obs.controld.values():
        for rec in st.get("replicas", []):
            if rec.get("state") in ("paused", "hibernated"):
                out.setdefault(rec["service"], []).append(rec["index"])
    return {k: sorted(v) for k, v in out.items()}


def awaiting_spares(obs: Observer) -> set[str]:
    """ "svc/i" convicted by a SHUTDOWN some controld acted on whose fresh spare is not
    provisioned yet (a host re-provisions its convicted replicas one after the other), or
    not yet back in the agreement replicas' sleeping set (its SPARE-READY is sent once the
    guest is paused; until they have it, a next fault could not wake it). A fresh spare
    that a later round woke is awake, not awaited: counting it kept the campaign waiting
    for a slot that was serving (seed 3602, f = 2, rounds 2 and 8)."""
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
    watched, placed = set(), set()
    for name, d in obs.agreed.items():
        if "exec_sleeping" in d:
            svc = name.split("/agreed-", 1)[0]
            watched.add(svc)
            for key in ("exec_sleeping", "exec_awake"):
                placed |= {f"{svc}/{i}" for i in d.get(key) or []}
    return {
        c
        for c in convicted
        if c not in restored or (c.split("/", 1)[0] in watched and c not in placed)
    }


def _at_g_plus_1(obs: Observer, key: str) -> set[str]:
    """Services whose agreement replicas show `key` set at g+1 of them (so at a correct one:
    a stopped replica's last stats may say anything)."""
    at: Counter[str] = Counter()
    for name, d in obs.agreed.items():
        if d.get(key):
            at[name.split("/agreed-", 1)[0]] += 1
    return {s.name for s in obs.services if at[s.name] >= s.g + 1}


def open_rounds(obs: Observer) -> set[str]:
    """Services with a fault round still undecided at g+1 of their agreement replicas. A
    woken replica that cannot report the round's seq leaves it to the WAKE_RESOLVE timeout
    (5 s plus the detection ceiling) to decide without it."""
    return _at_g_plus_1(obs, "fault_round_open")


def waiting_faults(obs: Observer) -> set[str]:
    """Services with a fault flagged at g+1 of their agreement replicas whose statements
    are still to be signed (`fault_flags_waiting`: the row waits for a report or the K·t1
    deadline). A round follows although none is open yet."""
    return _at_g_plus_1(obs, "fault_flags_waiting")


def fault_handled(obs: Observer) -> bool:
    """A replica convicted since the fault, no fault round open and no convicted replica
    waiting for its fresh spare: what --after-recovery waits for."""
    convicted = obs.lines(r"^SHUTDOWN \S+ seq \d+ convict \[\d")
    return bool(convicted) and not open_rounds(obs) and not awaiting_spares(obs)
