# zz/drill/rack.py - the rack a drill runs against: that it is up, and the few things a drill
# does to it (crash an agreement replica through its controld, kill a runtime or a domain,
# switch a runtime's fault, start a killed agreement replica again through its controld).
"""The drill's hands on the rack (docs/operations.md, "Drills"). What the drill sees is in
zz/drill/observe.py; which of these a kind uses is in its class (zz/drill/kind.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zz.atomicfile import write_atomic
from zz.config import Config, Service
from zz.drillfaults import FAULT_FILE
from zz.naming import domain_name
from zz.procrack import leftover_pids
from zz.rackctl import (
    ProcRecord,
    RackError,
    RackState,
    _save_state,
    agreed_states,
    call_ok,
    load_state,
)


class DrillError(Exception):
    """The drill cannot run against this rack (not up, no kv service, unsupported kind)."""


@dataclass
class Rack:
    """A rack that `zz rack up` brought up, as its state file records it."""

    config: Config
    state: RackState

    @classmethod
    def up(cls, config: Config) -> Rack:
        """The rack, which must be up: every controld it started running, and every
        agreement replica running as its host's controld reports it."""
        state = load_state(config)
        if state is None or not state.complete:
            raise DrillError(f"rack {config.rack.name!r} is not up: zz rack up {config.path}")
        alive = {p.name for p in state.alive()}
        dead = [p.name for p in state.procs if p.kind == "controld" and p.name not in alive]
        entries, silent = agreed_states(config)
        dead += [f"controld {h} (not answering: {why})" for h, why in sorted(silent.items())]
        dead += [p.name for p in state.agreed()
                 if entries.get(p.name, {}).get("state", "running") != "running"]  # fmt: skip
        if dead:
            raise DrillError(
                f"rack {config.rack.name!r} is degraded ({', '.join(dead)} not running):"
                f" zz rack down {config.path} && zz rack up {config.path}"
            )
        return cls(config, state)

    # ---- agreement replicas ---------------------------------------------------------------
    def agreed_proc(self, s: Service, r: int) -> ProcRecord:
        return self.state.proc(f"{s.name}/agreed-{r}")

    async def kill_agreed(self, s: Service, r: int) -> str:
        """Crash agreement replica r: its controld SIGKILLs it (agreed_stop kill); its
        name."""
        h = self.config.replica_host(s, r)
        op = {"op": "agreed_stop", "service": s.name, "replica": r, "kill": True}
        try:
            await call_ok(self.config, h, op, 30.0)
        except RackError as e:
            raise DrillError(f"{s.name}/agreed-{r}: {e}") from e
        return f"{s.name}/agreed-{r}"

    @property
    def on_hosts(self) -> bool:
        """The controlds run on their hosts (rack.controlds = "hosts"): nothing of the rack
        is this machine's to read or signal, everything goes through them."""
        return self.config.rack.controlds == "hosts"

    async def agreed_rss(self, s: Service, into: dict[str, dict[str, float]], key: str) -> None:
        """VmRSS (MiB) of the service's agreement replicas, as `key` (\"max\" keeps the
        largest seen). Read from /proc of this machine by the pid their controlds reported,
        or with the controlds on their hosts from their agreed_list (`rss_mib`; sampled
        every 0.5 s inside the drill's event loop)."""
        got: dict[str, float] = {}
        if self.on_hosts:
            from zz.drill.observe import agreed_entries_now

            for name, e in (await agreed_entries_now(self.config, s)).items():
                if e.get("state") == "running" and isinstance(e.get("rss_mib"), int | float):
                    got[name] = float(e["rss_mib"])
        else:
            for r in range(s.n):
                p = self.agreed_proc(s, r)
                try:
                    status = Path(f"/proc/{p.pid}/status").read_text()
                except OSError:
                    continue
                m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
                if m and p.alive():
                    got[p.name] = int(m.group(1)) / 1024
        for name, mib in got.items():
            row = into.setdefault(name, {})
            row[key] = max(row.get(key, 0.0), mib) if key == "max" else mib

    async def restart_dead_agreed(self) -> list[str]:
        """Start every agreement replica that is not running again through its controld
        (agreed_start, the same replica file and --set values); the names started."""
        from zz.rackctl import ask_controlds

        answers = await asyncio.to_thread(ask_controlds, self.config, {"op": "agreed_list"})
        started = []
        for s in self.config.services:
            for r in range(s.n):
                h = self.config.replica_host(s, r)
                answer = answers.get(h.name)
                if not isinstance(answer, dict):
                    raise DrillError(f"controld {h.name} does not answer ({answer})")
                e = next((x for x in answer.get("agreed", [])
                          if x.get("name") == f"{s.name}/agreed-{r}"), {})  # fmt: skip
                if e.get("state") == "running":
                    continue
                op = {"op": "agreed_start", "service": s.name, "replica": r,
                      "overrides": self.state.overrides}  # fmt: skip
                try:
                    rec = (await call_ok(self.config, h, op, 90.0))["agreed"]
                except RackError as err:
                    raise DrillError(f"{s.name}/agreed-{r}: {err}") from err
                old = self.agreed_proc(s, r)
                self.state.record(ProcRecord("agreed", old.name, int(rec["pid"]),
                                             int(rec["ticks"]), old.log, old.address, old.port,
                                             host=h.name))  # fmt: skip
                started.append(old.name)
        _save_state(self.config, self.state)
        return started

    # ---- execution replicas ---------------------------------------------------------------
    def _exec_pids(self, s: Service, i: int) -> list[int]:
        return leftover_pids(
            ["zz.execution"],
            [
                str(self.config.path),
                f"--service {s.name}".replace(" ", "\0"),
                f"--index\0{i}\0",
            ],  # fmt: skip
        )

    def kill_exec(self, s: Service, i: int) -> tuple[str, list[Any]]:
        """Crash execution replica i: SIGKILL its runtime, or on libvirt destroy its domain.
        The details key and what it killed ("killed_pids" or "destroyed_domains")."""
        if self.state.backend == "libvirt":
            return "destroyed_domains", [self._crash_domain(s, i)]
        pids = self._exec_pids(s, i)
        if not pids:
            raise DrillError(f"{s.name}/exec-{i}: no running process found")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return "killed_pids", list(pids)

    async def crash_exec(self, s: Service, i: int) -> tuple[str, list[Any]]:
        """kill_exec, or with the controlds on their hosts its host's controld crashes it
        (drill_crash: SIGKILL of its runtime's process group, or its domain destroyed)."""
        if not self.on_hosts:
            return self.kill_exec(s, i)
        h = s.exec_host(self.config, i)
        op = {"op": "drill_crash", "service": s.name, "index": i}
        try:
            reply = await call_ok(self.config, h, op, 30.0)
        except RackError as e:
            raise DrillError(f"{s.name}/exec-{i}: {e}") from e
        if "killed_pids" in reply:
            return "killed_pids", list(reply["killed_pids"])
        return "destroyed_domains", list(reply.get("destroyed_domains", []))

    def _crash_domain(self, s: Service, i: int) -> str:
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
        return name

    def set_fault(self, s: Service, i: int, fault: str | None, lie: bool = True) -> None:
        """Switch a running runtime's injected fault through its state directory (a
        guest's share): runtimes of a `zz rack up` rack run with --drill-faults and look
        at the file every 20 ms. In place, so the replica is never down for a restart
        (which the timers would see as a crash, not as the fault), and a guest needs no
        reboot."""
        body: dict[str, object] = {"fault": fault}
        if fault == "slow-report":
            body["slow_report_ms"] = self.slow_report_ms(s)
        if not lie:
            body["lie"] = False
        path = s.exec_state_dir(self.config, i) / FAULT_FILE
        write_atomic(path, json.dumps(body) + "\n")

    async def switch_fault(self, s: Service, i: int, fault: str | None, lie: bool = True) -> None:
        """set_fault, or with the controlds on their hosts through replica i's controld
        (drill_fault: it writes the same file in the replica's state directory)."""
        if not self.on_hosts:
            self.set_fault(s, i, fault, lie)
            return
        op: dict[str, Any] = {"op": "drill_fault", "service": s.name, "index": i, "fault": fault}
        if fault == "slow-report":
            op["slow_report_ms"] = self.slow_report_ms(s)
        if not lie:
            op["lie"] = False
        try:
            await call_ok(self.config, s.exec_host(self.config, i), op, 30.0)
        except RackError as e:
            raise DrillError(f"{s.name}/exec-{i}: {e}") from e

    async def runtime_status(self, s: Service, i: int) -> dict[str, Any]:
        """Execution replica i's status file ({} when there is none): read here, or with
        the controlds on their hosts as its controld returns it (exec_status)."""
        if not self.on_hosts:
            with contextlib.suppress(OSError, ValueError):
                st = json.loads(s.exec_status_path(self.config, i).read_text())
                return st if isinstance(st, dict) else {}
            return {}
        h = s.exec_host(self.config, i)
        try:
            reply = await call_ok(self.config, h, {"op": "exec_status"}, 10.0)
        except RackError:
            return {}
        for e in reply.get("runtimes", []):
            if e.get("service") == s.name and e.get("index") == i:
                return e["status"] if isinstance(e.get("status"), dict) else {}
        return {}

    def slow_report_ms(self, s: Service) -> int:
        """Slow means later than the agreement replicas wait: one second beyond the
        K·t1 timer's ceiling as the rack runs it (its --set values win)."""
        floor = int(self.state.overrides.get("detect_floor_ms", s.detect_floor_ms))
        ceiling = int(self.state.overrides.get("detect_ceiling_ms", s.detect_ceiling_ms))
        return max(floor, ceiling) + 1000
