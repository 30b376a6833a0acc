# zz/drill/exec_faults.py - the drill kinds that fault execution replicas: wrong replies,
# a crash, slow reports, Byzantine storage, a whole Byzantine host. Each must be convicted.
"""Execution-fault drill kinds (docs/operations.md, "Drills"): the fault is detected in
zz-agreed, a sleeping spare is woken, the faulty replica convicted and shut down, and a
fresh spare provisioned and back asleep. A runtime's fault is switched in place through
its fault file (zz/drill/rack.py Rack.set_fault), so the replica is never restarted."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import subprocess
import time
from typing import TYPE_CHECKING, Any, ClassVar

from zz import report as rp
from zz.config import Service
from zz.drill.kind import DrillKind
from zz.drill.observe import Observer, awaiting_spares, running
from zz.drill.rack import DrillError

if TYPE_CHECKING:
    from zz.drill.runner import Drill

# How long a corrupt-snapshot victim may take to have a corrupted checkpoint
# stable: up to two checkpoint intervals of load (TCG guests: ~10 s each).
CORRUPT_WAIT_S = 120.0
# How long an aligned fault (--cp-phase) waits for the faulty replica's status to show it.
FAULT_ON_PATIENCE_S = 5.0
_EXEC_NAME = re.compile(r"(.+)/exec-(\d+)")


class ExecFault(DrillKind):
    """A fault of one running execution replica (--replica, default the first running):
    by default the runtime's own fault `runtime_fault` (zz/drillfaults.py FAULTS)."""

    convicts = True
    runtime_fault: ClassVar[str]

    def __init__(self, drill: Drill) -> None:
        super().__init__(drill)
        self.replica = 0

    def choose(self, obs: Observer) -> None:
        d = self.drill
        up = running(obs, d.service)
        if d.args.replica is None:
            if not up:
                raise DrillError(f"{d.service.name}: no running execution replica")
            self.replica = up[0]
        elif d.args.replica not in up:
            raise DrillError(f"--replica {d.args.replica} is not running (running: {up})")
        else:
            self.replica = d.args.replica

    async def inject(self, obs: Observer) -> int | None:
        return await self.faulty_runtime(self.drill.service, self.replica, self.runtime_fault)

    async def faulty_runtime(self, s: Service, i: int, fault: str) -> int:
        """Make replica i faulty; controld keeps owning it, so a SHUTDOWN certificate
        finds it. The fault starts within 20 ms (Rack.switch_fault); returns when. With
        the load paused (--cp-phase), when the replica's status shows the fault on (it
        writes it as soon as it read the switch): the batch right after the fault's seq
        is then the first one it runs faulty, and the fault's clock starts there. (Let
        go at once, that batch could run before the replica read the switch: the drill
        then counted a correct batch and its checkpoint into the detection, and the round
        came a seq later.)"""
        await self.drill.rack.switch_fault(s, i, fault)
        self.drill.faulted.append(f"{s.name}/exec-{i} ({fault})")
        if getattr(self.drill.args, "cp_phase", None) is not None:
            t_end = time.monotonic() + FAULT_ON_PATIENCE_S
            while time.monotonic() < t_end:
                st = await self.drill.rack.runtime_status(s, i)
                if st.get("inject_fault") == fault:
                    break
                await asyncio.sleep(0.02)
            else:
                self.drill.notes.append(
                    f"{s.name}/exec-{i}: its status did not show the fault {fault} within"
                    f" {FAULT_ON_PATIENCE_S:.0f} s; the load went on regardless"
                )
        return time.monotonic_ns()

    def judge(self, r: rp.DrillReport, obs: Observer) -> None:
        """Detected, WAKEUP accepted and a spare of every drilled service woken, every
        faulted replica convicted, a fresh spare back asleep, the service went on."""
        d = self.drill
        if r.detection_s is None:
            d.reasons.append(
                "missing: fault detection in zz-agreed (no mismatch/timeout/fault counter in"
                " any agreement replica's stats changed after the fault)"
            )
        deltas = r.details["controld_deltas"]
        if not deltas["wakeup_accepted"]:
            d.reasons.append(
                "missing: WAKEUP — no controld accepted a wake-up certificate"
                f" (controld counters after the fault: {deltas})"
            )
        elif not r.woken:
            d.reasons.append("controld accepted a WAKEUP but woke no replica")
        if not r.convicted:
            d.reasons.append("missing: SHUTDOWN — no faulty replica was convicted")
        convicted = {c.who for c in r.convicted}
        for name in d.faulted:
            m = _EXEC_NAME.match(name)
            if m and r.convicted and f"{m.group(1)}/{m.group(2)}" not in convicted:
                d.reasons.append(f"{m.group(1)}/exec-{m.group(2)} was faulty but not convicted")
        faulted = {f"{m.group(1)}/{m.group(2)}" for n in d.faulted if (m := _EXEC_NAME.match(n))}
        for who in sorted(convicted - faulted):
            # Not a safety failure (a replica too slow for the timer counts as faulty), but
            # a spare spent: the report says so.
            d.notes.append(f"also convicted, not faulted by the drill: {who}"
                           " (too slow for the execution-report timer?)")  # fmt: skip
        for svc in d.services:
            if r.woken and not any(w.service == svc.name for w in r.woken):
                d.reasons.append(f"no spare of {svc.name} was woken")
        if r.convicted and not r.spares_restored:
            d.reasons.append("no fresh spare provisioned after the conviction")
        else:
            for who in sorted(awaiting_spares(obs)):
                d.reasons.append(
                    f"no fresh spare of {who} back asleep within --settle"
                    f" {d.args.settle:.0f} s (provisioned and announced with SPARE-READY)"
                )
        for _, line in obs.lines(r"fresh spare|destroy failed|sleep failed"):
            if line.endswith("trying once more"):
                d.notes.append(f"controld {line}")  # a spare not back fails above
            else:
                d.reasons.append(f"controld {line}")
        self.need_progress(r)


class WrongReply(ExecFault):
    """Replica I answers wrongly: also, mismatching EXEC-REPORTs must have been seen, not
    only timeouts of a replica too slow for the timer."""

    name = "wrong-reply"
    runtime_fault = "wrong-reply"

    def judge(self, r: rp.DrillReport, obs: Observer) -> None:
        super().judge(r, obs)
        mism = obs.agreed_deltas(self.drill.services, "exec_mismatches")
        r.details["exec_mismatches_after_fault"] = mism
        if mism and not any(v > 0 for v in mism.values()):
            self.drill.reasons.append(
                "no agreement replica saw a mismatching EXEC-REPORT: the replica was convicted"
                " for late reports, not for wrong replies (zz rack up --set detect_floor_ms"
                " above the replicas' hiccups)"
            )


class Crash(ExecFault):
    """SIGKILL of replica I's runtime; a guest: libvirt destroys its domain."""

    name = "crash"

    async def inject(self, obs: Observer) -> int | None:
        d = self.drill
        key, killed = await d.rack.crash_exec(d.service, self.replica)
        d.faulted.append(f"{d.service.name}/exec-{self.replica}")
        d.details.setdefault(key, []).extend(killed)
        return None


class Slow(ExecFault):
    """Replica I answers correctly but holds each EXEC-REPORT back beyond the K·t1 ceiling:
    also, the agreement replicas must have timed it out."""

    name = "slow"
    runtime_fault = "slow-report"

    def judge(self, r: rp.DrillReport, obs: Observer) -> None:
        d = self.drill
        super().judge(r, obs)
        late = obs.agreed_deltas(d.services, "exec_timeouts")
        r.details["exec_timeouts_after_fault"] = late
        r.details["slow_report_ms"] = d.rack.slow_report_ms(d.service)
        if late and not any(v > 0 for v in late.values()):
            d.reasons.append("no agreement replica timed out an EXEC-REPORT of the slow replica")


class CorruptSnapshot(WrongReply):
    """Byzantine storage at the first peer the woken spare asks: also, the recovering spare
    must report that peer's files rejected."""

    name = "corrupt-snapshot"

    def __init__(self, drill: Drill) -> None:
        super().__init__(drill)
        self.victim = 0

    def refuse(self, args: argparse.Namespace) -> None:
        if args.cp_phase is not None:
            raise DrillError(
                "--cp-phase: the corrupt-snapshot fault starts once a corrupted checkpoint"
                " is stable (a checkpoint of its own choosing)"
            )

    def _snapshot_victim(self) -> int:
        """The replica whose storage goes bad: the first peer the spare asks (the runtime
        asks peers from index+1 on, execution/runtime.py _peer_sources), so the corrupted
        copy is really offered."""
        d = self.drill
        s = d.service
        spare = d.spares_at_start[s.name][0]
        for k in range(1, s.n_exec):
            j = (spare + k) % s.n_exec
            if j in d.running_now:
                return j
        raise DrillError(f"{s.name}: no running replica to corrupt")

    async def inject(self, obs: Observer) -> int | None:
        """Byzantine storage: replica B's runtime snapshots one flipped byte per file while
        certifying the right digest (execution/drillfaults.py, fault corrupt-snapshot), so each
        snapshot is corrupt from the moment it exists, on a directory store as on ZFS
        (where a snapshot cannot be changed from outside). Corrupting the snapshots from
        the drill instead raced the victim's checkpoints: one taken just before the lies
        could be served intact before the drill's next pass. B's lies are held back until
        one such checkpoint is stable, so the spare woken by them recovers from a
        checkpoint whose copy at B is corrupt, and the fault's clock starts at the lies."""
        d = self.drill
        self.victim = self._snapshot_victim()
        s, b = d.service, self.victim
        await d.rack.switch_fault(s, b, "corrupt-snapshot", lie=False)
        d.faulted.append(f"{s.name}/exec-{b} (corrupt-snapshot)")
        path = s.exec_status_path(d.config, b)
        t_end = time.monotonic() + CORRUPT_WAIT_S
        st: dict[str, Any] = {}
        while True:
            st = await d.rack.runtime_status(s, b) or st
            lie_from = st.get("corrupt_lie_from")
            if lie_from is not None and st.get("last_executed", 0) >= lie_from:
                break
            if time.monotonic() > t_end:
                await d.rack.switch_fault(s, b, None)  # the rack is left as it was
                raise DrillError(
                    f"{s.name}/exec-{b}: no corrupted checkpoint stable within"
                    f" {CORRUPT_WAIT_S:.0f} s ({path}: stable {st.get('stable_checkpoint')},"
                    f" last executed {st.get('last_executed')}, inject_fault"
                    f" {st.get('inject_fault')})"
                )
            await obs.poll()
        d.details["corrupted_files"] = st.get("counters", {}).get("snapshot_files_corrupted", 0)
        d.details["corrupted_from_checkpoint"] = st.get("stable_checkpoint")
        await d.rack.switch_fault(s, b, "corrupt-snapshot")
        return time.monotonic_ns()

    def judge(self, r: rp.DrillReport, obs: Observer) -> None:
        d = self.drill
        super().judge(r, obs)
        s = d.service
        rejected = []
        for i in range(s.n_exec):
            # judge runs in a thread of its own (Drill.evaluate): a loop of its own here.
            st = asyncio.run(d.rack.runtime_status(s, i))
            with contextlib.suppress(AttributeError, TypeError):
                for b in st.get("recovery", {}).get("bad_sources", []):
                    rejected.append(f"exec-{i} rejected {b.get('path')} from {b.get('source')}:"
                                    f" {b.get('why')}")  # fmt: skip
        r.details["rejected"] = rejected
        if not d.details.get("corrupted_files"):
            d.reasons.append(f"no snapshot file of {s.name}/exec-{self.victim} was corrupted")
        elif not any(f"from {src}:" in x for x in rejected for src in self._victim_sources()):
            d.reasons.append(
                f"no recovering replica reported a corrupted file from exec-{self.victim}"
                " (recovery.bad_sources in the execution replicas' status files)"
            )
        else:
            d.notes.append(f"corrupted copies rejected: {len(rejected)}, e.g. {rejected[0]}")

    def _victim_sources(self) -> tuple[str, str]:
        """The names a recovering runtime gives the victim's copies: the victim itself, or
        its host's controld (which serves a guest's ZFS snapshots)."""
        d = self.drill
        host = d.service.exec_host(d.config, self.victim).name
        return f"x{self.victim}", f"controld-{host}"


class ByzantineHost(WrongReply):
    """On host H (--host, default the faulted replica's) every execution replica of every
    kv service answers wrongly and every agreement replica is killed."""

    name = "byzantine-host"

    def __init__(self, drill: Drill) -> None:
        super().__init__(drill)
        self.host = ""
        self.running: dict[str, list[int]] = {}

    def choose(self, obs: Observer) -> None:
        super().choose(obs)
        d = self.drill
        host = d.args.host or d.service.exec_host(d.config, self.replica).name
        names = [h.name for h in d.config.hosts]
        if host not in names:
            raise DrillError(f"--host {host!r}: not one of {', '.join(names)}")
        self.host = host
        self.running = {s.name: running(obs, s) for s in d.kvs}
        hit = [
            s
            for s in d.kvs
            if any(s.exec_host(d.config, i).name == host for i in self.running[s.name])
        ]
        if not hit:
            raise DrillError(f"no active execution replica of a kv service on {host}")
        d.services = hit
        if len(hit) < 2:
            d.notes.append(
                f"only {len(hit)} kv service has an active replica on {host}: the paper's"
                " drill affects several services (add more kv services to the rack)"
            )

    async def inject(self, obs: Observer) -> int | None:
        """Every replica of every service on the host misbehaves at once: its execution
        replicas answer wrongly, its agreement replicas stop (a crash is one Byzantine
        behaviour; one faulty agreement replica per service is within g)."""
        d = self.drill
        started = None
        for s in d.services:
            for i in self.running[s.name]:
                if s.exec_host(d.config, i).name == self.host:
                    started = await self.faulty_runtime(s, i, "wrong-reply")
        for s in d.services:
            for r in range(s.n):
                if d.config.replica_host(s, r).name == self.host:
                    d.faulted.append(await d.rack.kill_agreed(s, r))
        return started


# partition: how long the partitioned host's agreement replicas have, once its link is back,
# to reach the seq the others had executed when it came back.
CATCH_UP_S = 90.0
CUT_TIMEOUT_S = 30.0


class Partition(ExecFault):
    """Host H (--host, default the host of the first running execution replica) cut off
    the network under load by the operator's command (--cut), for --after seconds, then
    connected again (--heal). H carries one of the service's 3g+1 agreement replicas and
    one of its f+1 active execution replicas, with a spare elsewhere: the service must go
    on without H (its execution replica's reports time out, the spare is woken, and it is
    convicted), and once the link is back H must catch up: its agreement replicas reach the
    seq the others had executed at the heal, and its controld, which gets the SHUTDOWN
    queued for it then, replaces the convicted replica by a fresh spare."""

    name = "partition"

    def __init__(self, drill: Drill) -> None:
        super().__init__(drill)
        self.host = ""
        self.cut_done = False
        self.healed = False
        self.heal_ns = 0

    def refuse(self, args: argparse.Namespace) -> None:
        if not args.cut or not args.heal:
            raise DrillError(
                "partition: --cut CMD and --heal CMD are required, the shell commands that take"
                " the host's network link down and bring it back ({host} is its name), e.g."
                " --cut 'ip -n BR link set {host} down' --heal 'ip -n BR link set {host} up'"
            )

    def choose(self, obs: Observer) -> None:
        d = self.drill
        s = d.service
        up = running(obs, s)
        if d.args.host is not None:
            on = [i for i in up if s.exec_host(d.config, i).name == d.args.host]
            if not on:
                where = ", ".join(f"{i} on {s.exec_host(d.config, i).name}" for i in up)
                raise DrillError(f"--host {d.args.host}: no running execution replica of"
                                 f" {s.name} there (running: {where})")  # fmt: skip
            self.replica = on[0]
        else:
            super().choose(obs)
        self.host = s.exec_host(d.config, self.replica).name
        spares = [i for st in obs.controld.values() for rec in st.get("replicas", [])
                  if rec.get("service") == s.name and rec.get("state") in ("paused", "hibernated")
                  and (i := rec["index"]) is not None
                  and s.exec_host(d.config, i).name != self.host]  # fmt: skip
        if not spares:
            raise DrillError(f"{s.name}: no sleeping spare outside {self.host} to wake")
        agreed = [f"{s.name}/agreed-{r}" for r in range(s.n)
                  if d.config.replica_host(s, r).name == self.host]  # fmt: skip
        d.details["partitioned_host"] = self.host
        d.details["partitioned_replicas"] = [f"{s.name}/exec-{self.replica}", *agreed]

    def _run(self, which: str, cmd: str) -> None:
        """Run the operator's --cut or --heal command; DrillError naming it if it fails."""
        line = cmd.replace("{host}", self.host)
        env = dict(os.environ, ZZ_HOST=self.host)
        try:
            p = subprocess.run(["/bin/sh", "-c", line], env=env, capture_output=True, text=True,
                               timeout=CUT_TIMEOUT_S, check=False)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as e:
            raise DrillError(f"--{which} {line!r}: {e}") from e
        if p.returncode != 0:
            why = (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit {p.returncode}"]
            raise DrillError(f"--{which} {line!r} failed: {why[0]}")
        self.drill.details.setdefault("commands", []).append(f"{which}: {line}")

    async def inject(self, obs: Observer) -> int | None:
        d = self.drill
        self.cut_done = True  # from here on cleanup() heals, whatever happens
        obs.unwaited.add(self.host)  # each status call to it takes the timeout now
        await asyncio.to_thread(self._run, "cut", d.args.cut)
        d.faulted.append(f"{d.service.name}/exec-{self.replica}")
        return None

    async def heal(self) -> None:
        if self.cut_done and not self.healed:
            self.healed = True
            self.heal_ns = time.monotonic_ns()
            await asyncio.to_thread(self._run, "heal", self.drill.args.heal)

    async def after_watch(self, obs: Observer) -> None:
        """The link back, then until the partitioned host's agreement replicas reach the
        seq the others had executed at that moment (CATCH_UP_S at most)."""
        d = self.drill
        s = d.service
        await self.heal()
        mine = [f"{s.name}/agreed-{r}" for r in range(s.n)
                if d.config.replica_host(s, r).name == self.host]  # fmt: skip
        others = [int(x.get("last_exec", 0)) for n, x in obs.agreed_of(s).items()
                  if n not in mine]  # fmt: skip
        target = max(others, default=0)
        d.details["heal_at_s"] = round((self.heal_ns - obs.fault_ns) / 1e9, 3)
        d.details["catch_up_target_seq"] = target
        d.progress(f"link of {self.host} back; waiting until {', '.join(mine) or 'its replicas'}"
                   f" reach seq {target} (up to {CATCH_UP_S:.0f} s)")  # fmt: skip
        caught: dict[str, float] = {}
        seen: dict[str, int] = {}
        t_end = time.monotonic() + CATCH_UP_S
        while time.monotonic() < t_end:
            for n in mine:
                x = obs.agreed.get(n, {})
                seen[n] = int(x.get("last_exec", 0))
                if n not in caught and seen[n] >= target:
                    caught[n] = round((time.monotonic_ns() - self.heal_ns) / 1e9, 2)
            if len(caught) == len(mine):
                break
            await obs.poll()
        d.details["caught_up_s"] = caught
        d.details["last_exec_seen"] = seen
        obs.unwaited.discard(self.host)

    async def cleanup(self) -> None:
        try:
            await self.heal()
        except DrillError as e:
            self.drill.reasons.append(f"{e}: the link of {self.host} may still be down")

    def judge(self, r: rp.DrillReport, obs: Observer) -> None:
        d = self.drill
        super().judge(r, obs)
        heal_s = r.details.get("heal_at_s")
        served = [x for x in d.samples if x.ok and x.ret is not None and x.call >= 0
                  and (heal_s is None or x.ret < heal_s)]  # fmt: skip
        r.details["served_while_cut_off"] = len(served)
        if heal_s is not None and not served:
            d.reasons.append(
                f"the service did not go on while {self.host} was cut off: no operation issued"
                f" after the cut completed before the link came back ({heal_s:.1f} s)"
            )
        caught = r.details.get("caught_up_s", {})
        for n, seq in sorted(r.details.get("last_exec_seen", {}).items()):
            if n not in caught:
                d.reasons.append(
                    f"{n} on {self.host} did not catch up within {CATCH_UP_S:.0f} s of the link"
                    f" coming back: at seq {seq}, the others were at"
                    f" {r.details.get('catch_up_target_seq')} then"
                )
