# zz/placement.py - which host carries each replica of each service (docs/placement.md).
# The placement rule itself lives in zz/config.py (Config.replica_host, Service.exec_host);
# this module applies it to a whole rack, checks the fault-model constraint "at most one
# agreement and one execution replica of a service per host" (docs/design.md §1) and reports
# the load per host, so an operator sees the ZZ Table 2 layout before starting anything.
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from zz.config import Config, Host, Service

AGREEMENT = "agreement"
EXECUTION = "execution"


class PlacementError(Exception):
    """A rack config the placement rule cannot serve; `reasons` has one line per problem,
    each naming the service and the numbers."""

    def __init__(self, reasons: list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons


@dataclass(frozen=True)
class Slot:
    """One replica on one host. `state` is "agreement" for agreement replicas and
    "active", "paused" or "hibernated" for execution replicas."""

    service: Service
    kind: str
    replica: int
    host: Host
    state: str

    @property
    def label(self) -> str:
        if self.kind == AGREEMENT:
            return f"A{self.replica}"
        return f"E{self.replica}({self.state})"


@dataclass(frozen=True)
class HostLoad:
    host: Host
    agreement: int
    active: int
    sleeping: int


@dataclass(frozen=True)
class Plan:
    config: Config
    slots: list[Slot]

    def on(self, host: Host, service: Service) -> list[Slot]:
        """The replicas of `service` on `host`, agreement first."""
        return [
            s for s in self.slots if s.host.index == host.index and s.service.index == service.index
        ]

    def loads(self) -> list[HostLoad]:
        out = []
        for h in self.config.hosts:
            mine = [s for s in self.slots if s.host.index == h.index]
            out.append(
                HostLoad(
                    h,
                    agreement=sum(s.kind == AGREEMENT for s in mine),
                    active=sum(s.state == "active" for s in mine),
                    sleeping=sum(s.kind == EXECUTION and s.state != "active" for s in mine),
                )
            )
        return out


def hosts_needed(service: Service) -> int:
    """Hosts a service needs under the one-per-host rule: max(3g+1, n_exec), or 3g+1
    when its app runs inside the agreement replicas (echo: no execution replicas)."""
    if service.uses_execution_replicas:
        return max(service.n, service.n_exec)
    return service.n


def _slots(config: Config, service: Service) -> list[Slot]:
    out = [
        Slot(service, AGREEMENT, r, config.replica_host(service, r), AGREEMENT)
        for r in range(service.n)
    ]
    if service.uses_execution_replicas:
        out += [
            Slot(
                service,
                EXECUTION,
                i,
                service.exec_host(config, i),
                "active" if i < service.active else service.sleep,
            )
            for i in range(service.n_exec)
        ]
    return out


def check(config: Config) -> list[str]:
    """Why the rack cannot be placed, one reason per line; empty when it can."""
    hcount = len(config.hosts)
    reasons: list[str] = []
    for svc in config.services:
        before = len(reasons)
        if svc.n > hcount:
            reasons.append(
                f"service {svc.name!r}: g={svc.g} needs {svc.n} hosts for its agreement"
                f" replicas, the rack has {hcount}"
            )
        if svc.uses_execution_replicas and svc.n_exec > hcount:
            reasons.append(
                f"service {svc.name!r}: f={svc.f}, active={svc.active} needs {svc.n_exec}"
                f" hosts for its execution replicas, the rack has {hcount}"
            )
        if len(reasons) > before:
            continue
        # The arithmetic above is what the rule in config.py needs; check the rule's
        # actual output too, so a change there cannot silently break the fault model.
        per_host = Counter((s.host.index, s.kind) for s in _slots(config, svc))
        for (h, kind), k in sorted(per_host.items()):
            if k > 1:
                reasons.append(
                    f"service {svc.name!r}: host {config.hosts[h].name!r} would carry {k}"
                    f" {kind} replicas (at most 1 per host)"
                )
    return reasons


def plan(config: Config) -> Plan:
    """Place every replica of every service; PlacementError if the rule cannot."""
    reasons = check(config)
    if reasons:
        raise PlacementError(reasons)
    return Plan(config, [s for svc in config.services for s in _slots(config, svc)])


def _spread(values: list[int]) -> str:
    total, n = sum(values), len(values)
    lo, hi = min(values), max(values)
    # The best any placement can do: every host within one replica of total/n.
    best_lo, best_hi = total // n, -(-total // n)
    verdict = "even" if (lo, hi) == (best_lo, best_hi) else f"uneven, best {best_lo}..{best_hi}"
    return f"{total} over {n} hosts, {lo}..{hi} per host ({verdict})"


def format_plan(p: Plan) -> str:
    """The host x service table plus per-host load, as `zz rack plan` prints it."""
    config = p.config
    header = ["host", *(s.name for s in config.services), "agreement", "active", "sleeping"]
    rows = [header]
    loads = p.loads()
    for h, load in zip(config.hosts, loads, strict=True):
        cells = [" ".join(s.label for s in p.on(h, svc)) or "-" for svc in config.services]
        rows.append([h.name, *cells, str(load.agreement), str(load.active), str(load.sleeping)])
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    nsvc = len(config.services)

    def line(r: list[str]) -> str:
        left = [r[c].ljust(widths[c]) for c in range(nsvc + 1)]
        right = [r[c].rjust(widths[c]) for c in range(nsvc + 1, len(r))]
        return "  ".join(left + right).rstrip()

    out = [
        f"rack {config.rack.name}: {len(config.hosts)} hosts, {nsvc} services"
        " (at most one agreement and one execution replica of a service per host)",
        "",
        *(line(r) for r in rows),
        "",
    ]
    out.append("agreement replicas: " + _spread([x.agreement for x in loads]))
    out.append("active execution replicas: " + _spread([x.active for x in loads]))
    out.append("sleeping execution replicas: " + _spread([x.sleeping for x in loads]))
    return "\n".join(out) + "\n"


def plan_json(p: Plan) -> dict[str, Any]:
    """`zz rack plan --json`: every host with its replicas and load, and every replica
    with its host, port and state at bring-up."""
    config = p.config
    hosts = []
    for h, load in zip(config.hosts, p.loads(), strict=True):
        mine = [s for s in p.slots if s.host.index == h.index]
        hosts.append(
            {
                "name": h.name,
                "address": h.address,
                "agreement": load.agreement,
                "active": load.active,
                "sleeping": load.sleeping,
                "replicas": [f"{s.service.name}/{s.label}" for s in mine],
            }
        )
    replicas = []
    for s in p.slots:
        if s.kind == AGREEMENT:
            port = config.replica_address(s.service, s.replica)[1]
        else:
            port = s.service.exec_address(config, s.replica)[1]
        replicas.append(
            {
                "service": s.service.name,
                "kind": s.kind,
                "replica": s.replica,
                "host": s.host.name,
                "address": s.host.address,
                "port": port,
                "state": s.state,
            }
        )
    return {"rack": config.rack.name, "ok": True, "hosts": hosts, "replicas": replicas}
