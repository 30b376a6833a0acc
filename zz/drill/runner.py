# zz/drill/runner.py - one drill from start to report: load before the fault, the kind's fault,
# the watch after it, the settling, the verdicts and the rack left as it was (zz drill).
"""The drill's phases (docs/operations.md, "Drills"). What is particular to a kind is in
its DrillKind (zz/drill/kinds.py); this is what every kind shares."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zz import history as zh
from zz import report as rp
from zz.client import Client, ClientParams
from zz.config import Config, Service, load
from zz.drill.kind import DrillKind
from zz.drill.kinds import KINDS
from zz.drill.load import (
    Load,
    check_acked_posts,
    entries,
    first_client,
    start_http_load,
    start_load,
    stop_load,
)
from zz.drill.observe import (
    Observer,
    agreed_logs,
    agreed_stats_now,
    awaiting_spares,
    fault_handled,
    open_rounds,
    recovery_marks,
    running,
    sleeping,
)
from zz.drill.rack import DrillError, Rack
from zz.rackctl import RackError

Progress = Callable[[str], None]
# controld counters whose growth since the fault the report gives.
CONTROLD_DELTAS = ("wakeup_accepted", "wakeup_rejected", "woken", "shutdown_accepted",
                   "convicted", "reprovisioned", "action_failed")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=list(KINDS), metavar="KIND", help=" | ".join(KINDS))
    p.add_argument("config", metavar="CONFIG", help="rack config (TOML) of a rack that is up")
    p.add_argument("--service", help="the kv service to load and fault (default: the first kv)")
    p.add_argument(
        "--replica", type=int, help="execution replica to fault (default: first running)"
    )
    p.add_argument(
        "--host",
        help="byzantine-host, partition: the host (default: the faulted replica's, the first"
        " running execution replica's)",
    )
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
    p.add_argument(
        "--cut",
        metavar="CMD",
        help="partition: the shell command that takes the host's network link down ({host}:"
        " its name, also in $ZZ_HOST), e.g. 'ip -n BRIDGE-NS link set {host} down'",
    )
    p.add_argument(
        "--heal",
        metavar="CMD",
        help="partition: the shell command that brings the link back after --after seconds",
    )
    p.add_argument("--out", type=Path, help="report directory (default run/drills/KIND-TIME)")
    p.add_argument(
        "--http",
        metavar="URL",
        help="HTTP load on the guestbook served at URL by zz proxy (with --service), instead"
        " of KV clients",
    )


def need_lincheck() -> None:
    """A kv drill checks its history with tools/lincheck (Porcupine), which set-up builds
    (scripts/setup.sh); a drill never builds it on its clock. Refuse to start without it."""
    try:
        zh.lincheck_binary(build=False)
    except zh.LincheckError as e:
        raise DrillError(
            f"cannot check the kv history for linearizability: {e}"
            if isinstance(e, zh.LincheckMissing)
            else f"tools/lincheck: {e}"
        ) from None


class Drill:
    """One drill against a rack that is up. Owns the rack handle, the kind, and the
    findings the kind and the phases add to: `details` (into the report), `faulted` (what
    was made faulty, for the verdict and the restore), `reasons` (FAIL) and `notes`."""

    def __init__(self, config: Config, args: argparse.Namespace, progress: Progress) -> None:
        self.config = config
        self.args = args
        self.progress = progress
        self.watched_s: float = args.after  # how long the watch after the fault really ran
        self.rack = Rack.up(config)
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
        self.kind: DrillKind = KINDS[args.kind](self)
        self.kind.refuse(args)
        if not self.http:
            need_lincheck()
        self.phase = "starting"
        self.notes: list[str] = []
        self.details: dict[str, Any] = {}
        self.reasons: list[str] = []
        self.faulted: list[str] = []
        self.services = [self.service]  # the services drilled (byzantine-host: several)
        self.kvs = kvs
        self.running_now: list[int] = []
        self.spares_at_start: dict[str, list[int]] = {}
        self.samples: list[rp.Sample] = []
        self.load_end_ns = 0  # when the load was told to stop (the end of the watch)
        self.pause_ns = 0  # --cp-phase: when the load was paused before the fault
        self.fault_wall = 0.0  # the fault on the wall clock (controld and zz-agreed stamp it)
        self.agreed_logs: dict[str, list[str]] = {}  # the drilled service's, after the watch
        if self.kind.convicts and self.service.n_exec <= self.service.active:
            raise DrillError(f"{self.service.name} has no sleeping spare to wake")

    # ---- before the fault -----------------------------------------------------------------
    def _check_agreement_spares(self, obs: Observer) -> None:
        """The agreement replicas must know a sleeping spare to wake: after a conviction
        controld provisions a fresh one, but the cluster may still list its index as
        convicted."""
        for s in self.services:
            rows = list(obs.agreed_of(s).values())
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

    async def _survey(self, obs: Observer) -> None:
        """Observe the rack once; the kind picks its targets; an execution fault needs a
        sleeping spare of every drilled service."""
        await obs.read_controlds()
        obs.read_agreed()
        if len(obs.controld) < len(self.config.hosts):
            raise DrillError(f"controlds not answering: {dict(obs.errors)}")
        self.kind.choose(obs)
        # The kind may pick the services it drills (byzantine-host: every kv service with a
        # replica on the host): watch those.
        obs.services = self.services
        obs.read_agreed()
        if self.kind.convicts:
            self._check_agreement_spares(obs)
        self.running_now = running(obs, self.service)
        self.spares_at_start = sleeping(obs)
        if self.kind.convicts:
            missing = [s.name for s in self.services if not self.spares_at_start.get(s.name)]
            if missing:
                raise DrillError(
                    f"no sleeping spare of {', '.join(missing)} to wake (an earlier fault round"
                    f" woke it; `zz status {self.config.path}`): restart the rack"
                )

    async def _align_cp_phase(self, load: Load) -> None:
        """Pause the load and PUT one request at a time until the service's last executed
        seq is cp_phase mod checkpoint_interval with nothing in flight: the fault follows at
        once, right after a checkpoint or right before the next one (docs/operations.md)."""
        s, a = self.service, self.args
        cp = self.config.rack.checkpoint_interval
        want = a.cp_phase % cp
        load.gate.clear()
        self.pause_ns = time.monotonic_ns()
        t_end = time.monotonic() + 30
        while load.inflight["kv"] and time.monotonic() < t_end:
            await asyncio.sleep(0.02)
        if load.inflight["kv"]:
            raise DrillError("--cp-phase: the kv load did not pause within 30 s")
        base = first_client(s, a.first_client)
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
            stats = await agreed_stats_now(self.config, s)
            n = max(int(d.get("last_exec", 0)) for d in stats)
            if n == prev:
                return n
            prev = n
            await asyncio.sleep(1.1)
        raise DrillError(f"{s.name}: the agreement replicas did not settle in 33 s")

    # ---- after the fault ------------------------------------------------------------------
    async def _watch(self, obs: Observer) -> None:
        """--after seconds (less with --after-recovery once the fault is handled)."""
        a = self.args
        t_fault = time.monotonic()
        t_end = t_fault + a.after
        handled = False
        while time.monotonic() < t_end:
            await obs.poll()
            if a.after_recovery is not None and not handled and fault_handled(obs):
                handled = True
                t_end = min(t_end, time.monotonic() + a.after_recovery)
                self.progress(f"fault handled; watching {a.after_recovery:.0f} s more")
        self.watched_s = time.monotonic() - t_fault

    async def _settle(self, obs: Observer) -> None:
        """A fault round still open is decided at the latest by its timeout, and a
        convicted replica's successor boots as a fresh spare: a VM takes tens of seconds
        under TCG. Keep watching (load running) until both are done, up to --settle."""
        a = self.args
        t_end = time.monotonic() + a.settle
        while time.monotonic() < t_end:
            if rounds := open_rounds(obs):
                phase = f"waiting for the fault round of {', '.join(sorted(rounds))}"
            elif awaiting_spares(obs):
                phase = "waiting for the fresh spare"
            else:
                break
            if self.phase != phase:
                self.phase = phase
                self.progress(f"{phase} (up to {a.settle:.0f} s)")
            await obs.poll()
        if rounds := open_rounds(obs):
            self.notes.append(
                f"fault round still open at the end (--settle {a.settle:.0f} s):"
                f" {', '.join(sorted(rounds))}"
            )

    async def restore(self, report: rp.DrillReport) -> None:
        """Leave the rack usable for the next drill: a killed agreement replica is started
        again (same replica file); a faulty execution replica that was not convicted is
        told to behave again (a convicted one controld already replaced)."""
        for name in await self.rack.restart_dead_agreed():
            self.notes.append(f"restarted {name} after the drill")
        for name in self.faulted:
            m = re.match(r"(.+)/exec-(\d+)", name)
            if not m:
                continue
            s, i = self.config.service(m.group(1)), int(m.group(2))
            if any((c.service, c.replica) == (s.name, i) for c in report.convicted):
                continue
            if "(" in name:
                await self.rack.switch_fault(s, i, None)
                self.notes.append(f"not convicted: {s.name}/exec-{i} told to behave again")

    # ---- run ------------------------------------------------------------------------------
    async def run(self) -> rp.DrillReport:
        a = self.args
        obs = Observer(self.config, self.services)
        await self._survey(obs)
        self.phase = "load before the fault"
        if self.http:
            load = start_http_load(self.http, a.clients)
        else:
            load = start_load(self.config, self.services, a.clients, a.first_client)
        what = "HTTP connections" if self.http else "kv clients"
        self.progress(f"load: {a.clients} {what} on {', '.join(s.name for s in self.services)}"
                      f"; fault '{self.kind.name}' in {a.before:.0f} s")  # fmt: skip
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
            started = await self.kind.inject(obs)
            load.gate.set()
            if started:
                obs.fault_ns = started
            self.fault_wall = time.time() - (time.monotonic_ns() - obs.fault_ns) / 1e9
            self.phase = "watching after the fault"
            self.progress(f"fault injected: {', '.join(self.faulted) or self.kind.name};"
                          f" watching {a.after:.0f} s")  # fmt: skip
            await self._watch(obs)
            await self.kind.after_watch(obs)
            await self._settle(obs)
            await obs.read_controlds()
            if self.kind.convicts:
                self.agreed_logs = await agreed_logs(self.config, self.service)
        finally:
            await self.kind.cleanup()
            self.load_end_ns = time.monotonic_ns()
            load.stop.set()
            load.gate.set()
            if self.kind.task is not None:
                self.kind.task.cancel()
                with contextlib.suppress(BaseException):
                    await self.kind.task
            self.phase = "stopping the load"
            await stop_load(load)
        self.phase = "checking the history (Porcupine)"
        report = await asyncio.to_thread(self.evaluate, obs, load, wall)
        self.phase = "restoring the rack"
        await self.restore(report)
        report.notes = self.notes
        return report

    # ---- the report -----------------------------------------------------------------------
    def evaluate(self, obs: Observer, load: Load, wall: float) -> rp.DrillReport:
        r = rp.DrillReport(
            self.kind.name, self.config.rack.name, ",".join(x.name for x in self.services), wall
        )
        self._load_figures(r, obs, load)
        self._control_plane(r, obs)
        # The first correct reply counts from the detection, so after _control_plane.
        end_s = (self.load_end_ns - obs.fault_ns) / 1e9
        # With --cp-phase the throughput before is that of the load before its pause.
        until = (self.pause_ns - obs.fault_ns) / 1e9 if self.pause_ns else 0.0
        rp.throughput(r, self.samples, self.args.before, end_s, before_until_s=min(until, 0.0))
        self._phases(r, obs)
        r.details.update(self.details)
        r.details["faulted"] = self.faulted
        r.details["tally"] = dict(load.tally)
        r.details["events"] = [vars(e) for e in obs.rel()[:600]]
        r.details["controld_deltas"] = {k: obs.counter_delta(k) for k in CONTROLD_DELTAS}
        if obs.errors:
            r.details["observer_errors"] = dict(obs.errors)
        self.kind.report_details(r.details)
        self.kind.judge(r, obs)
        r.reasons = self.reasons
        rp.verdict(r)
        return r

    def _load_figures(self, r: rp.DrillReport, obs: Observer, load: Load) -> None:
        """Operations, the timeline, and the histories checked (kv) or the acknowledged
        POSTs found (HTTP); the samples for rp.throughput."""
        f_ns = obs.fault_ns
        samples: list[rp.Sample] = []
        verdicts = []
        for name, rec in load.recorders.items():
            h = rec.history()
            for o in h.operations:
                call = (o.call - f_ns) / 1e9
                ret = None if o.ret is None else (o.ret - f_ns) / 1e9
                samples.append(rp.Sample(call, ret))
            r.operations += len(h.operations)
            r.pending += sum(1 for o in h.operations if o.pending)
            out = self.out_dir
            out.mkdir(parents=True, exist_ok=True)
            h.save(out / f"history-{name}.json")
            try:
                v = zh.check(h, html=out / f"history-{name}.html", timeout=120, build=False)
                verdicts.append((name, v))
            except zh.LincheckError as e:
                self.reasons.append(f"linearizability check of {name} failed to run: {e}")
        for c, ret_ns, ok in load.http:
            call = (c - f_ns) / 1e9
            ret = None if ret_ns is None else (ret_ns - f_ns) / 1e9
            samples.append(rp.Sample(call, ret, ok))
            r.operations += 1
            r.pending += ret is None
        if self.http:
            self._check_acked(r, load)
        self.samples = samples
        r.timeline = rp.buckets(samples)
        if verdicts:
            r.linearizable = all(v.linearizable for _, v in verdicts)
            r.linearizability = "; ".join(f"{n}: {v}" for n, v in verdicts)
            if not r.linearizable:
                self.reasons.append("history is not linearizable")

    def _control_plane(self, r: rp.DrillReport, obs: Observer) -> None:
        """What the controlds logged (woken, convicted, shut down, spares restored), the
        detection time (the kind's stats counters, or the first WAKEUP), a WAKEUP before
        the fault, and each agreement replica's detection latency."""
        woke = obs.lines(r"^woke ")
        r.wakeup_s = woke[0][0] if woke else None
        r.woken = rp.Woken.from_lines(woke)
        r.convicted = rp.Convicted.from_lines(obs.lines(r"^convicted "))
        r.shut_down = rp.ShutDown.from_lines(obs.lines(r"^SHUTDOWN .* convict "))
        r.spares_restored = rp.SpareRestored.from_lines(
            obs.lines(r"^provisioned .* (paused|hibernated)")
        )
        keys, s = self.kind.detect_keys, self.service
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
            if self.kind.wakeup_before_fault_fails:
                self.reasons.append(msg)
            else:
                self.notes.append(msg)
        for n, d in obs.agreed.items():
            if "detect_latency_max_ms" in d:
                r.details.setdefault("detect_latency_ms", {})[n] = {
                    "last": d.get("detect_latency_last_ms"),
                    "max": d["detect_latency_max_ms"],
                }

    def _phases(self, r: rp.DrillReport, obs: Observer) -> None:
        """The recovery's steps per woken replica of the drilled service
        (`details.recovery_marks`, seconds after the fault), and the phases of the fault ->
        first correct reply (rp.recovery_phases) of the replica woken first."""
        if not self.kind.convicts:
            return
        marks = recovery_marks(obs, self.agreed_logs, self.fault_wall, self.service.name)
        if not marks:
            return
        for m in marks.values():
            if r.first_correct_reply_s is not None:
                m["first_correct_reply"] = round(r.first_correct_reply_s, 4)
        r.details["recovery_marks"] = marks
        r.details["fault_wall"] = round(self.fault_wall, 6)
        if obs.clock_notes:
            r.details["runtime_clock"] = dict(obs.clock_notes)
        # The woken replicas' warm stagers as last seen before they were awake.
        r.details["warm_stagers"] = {w: obs.warm_last[w] for w in marks if w in obs.warm_last}
        # Detection at a checkpoint seq: each runtime's report of the round's seq, its steps
        # in seconds after the fault (first commit vote, execution, checkpoint, sent).
        split = {}
        for st in obs.controld.values():
            for w in st.get("wakes", []):
                seq, at = w.get("seq"), w.get("accepted_at")
                if w.get("service") != self.service.name or not isinstance(seq, int):
                    continue
                if not isinstance(at, int | float) or at < self.fault_wall:
                    continue
                base = seq - seq % self.config.rack.checkpoint_interval
                for who, reps in obs.checkpoint_reports.items():
                    if not who.startswith(f"{self.service.name}/"):
                        continue
                    for n in range(base, seq + 1):
                        if n in reps:
                            split[f"{who}@{n}"] = {
                                k: v if k == "fault" else round(v - self.fault_wall, 4)
                                for k, v in reps[n].items()}  # fmt: skip
                if split:
                    r.details["checkpoint_report_steps"] = {"seq": seq, **split}
                break
        first = min(marks.values(), key=lambda m: m.get("wakeup_accepted", math.inf))
        r.phases = rp.recovery_phases(first)

    def _check_acked(self, r: rp.DrillReport, load: Load) -> None:
        """HTTP load: no Porcupine model for the guestbook; instead every acknowledged POST
        (303 "added entry N") must be in /entries.json exactly once, as entry N."""
        assert self.http
        try:
            final = asyncio.run(entries(self.http))
        except (OSError, ValueError, TimeoutError, DrillError) as e:
            self.reasons.append(f"cannot read the final /entries.json: {e}")
            return
        lost, moved = check_acked_posts(load.acked, final)
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

    @property
    def out_dir(self) -> Path:
        if self.args.out:
            return Path(self.args.out)
        if not hasattr(self, "_out"):
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self._out = self.config.rack.run_dir / "drills" / f"{self.kind.name}-{stamp}"
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
    rp.write(report, d.out_dir)
    return report, d.out_dir


def main_cli(args: argparse.Namespace, progress: Progress) -> int:
    """`zz drill`: exit 0 PASS, 1 FAIL, 3 DEGRADED (rp.EXIT_CODES), 2 refused (not up, no
    kv service, no checker...).
    `args.json`: the report as JSON on stdout; `args.quiet`: nothing on stdout."""
    config = load(args.config)
    try:
        report, out = run(config, args, progress)
    except (DrillError, RackError) as e:
        print(f"zz drill {args.kind}: {e}", file=sys.stderr)
        return 2
    png = out / "timeline.png"
    if getattr(args, "json", False):
        doc = {
            "result": report.result,
            "report_json": str(out / "report.json"),
            "timeline_png": str(png) if png.exists() else None,
            "report": report.to_json(),
        }
        print(json.dumps(doc, indent=1, default=str), flush=True)
    elif not getattr(args, "quiet", False):
        print(rp.format_text(report))
        print(f"report: {out / 'report.json'}" + (f", {png}" if png.exists() else ""))
    return rp.EXIT_CODES.get(report.result, 1)
