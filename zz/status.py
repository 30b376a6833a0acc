# zz/status.py - `zz status`: every service's replicas, role, host, state, checkpoints and
# recent faults, each host's controld from its `status` RPC (which carries its replicas'
# stats and status files), and whether the rack is healthy, degraded or not running.
"""Rack status from the controlds' answers: the replicas' stats and status files.

Agreement replicas write ``run/s<id>/agreed-<r>.stats.json`` (zz-agreed, docs/agreement.md)
every second; their host's controld supervises them and returns each one's state and last
stats in its `status` (``agreed``, controld/agreed.py). `zz status` takes them from there: a
replica its controld reports not running, or whose stats are older than `stale_after`
seconds (hung), is ``down``; one on a host whose controld does not answer is ``?``. Without
controld answers (a harness of bare processes: `controlds` None) the stats files are read
directly. Execution replicas write ``run/s<id>/exec-<i>.status.json`` (docs/execution.md),
which their host's controld returns too (``runtimes``): one older than `stale_after`
seconds means the process is not running (or hung).
Execution roles (active, sleeping, convicted) come from the agreement replicas' view of them
(``exec_awake``/``exec_sleeping``/``exec_convicted`` in their stats), else from the plan; a
sleeping spare's state from its host's controld inventory when that controld answered.

This module judges (and reads the files only without controld answers); asking the
controlds is the orchestration layer's (zz/cli.py through zz/rackctl.py
`controld_statuses`), which passes their answers in as `Controlds`: host name -> the
`status` reply, or the error text of one that did not answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Set
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zz.config import Config, Service

SCHEMA = "zz-status/1"
# Exit codes of `zz status` (docs/operations.md "Exit codes").
HEALTHY, DEGRADED, NOT_RUNNING = 0, 1, 2
COLUMNS = ("service", "replica", "role", "host", "state", "checkpoint", "detail")
Controlds = dict[str, dict[str, Any] | str]


@dataclass
class Row:
    service: str
    replica: str  # "A<r>", "E<i>" or "controld"
    role: str  # agreement role (primary/backup) or execution role (active/sleeping)
    host: str
    state: str  # up / down / in view change / the sleep mode
    checkpoint: str  # stable / last checkpoint
    detail: str  # view, last executed, faults seen
    kind: str = ""  # "agreement", "execution" or "controld"
    index: int = -1  # the replica's number (-1: a controld)
    figures: dict[str, int] = field(default_factory=dict)  # raw numbers, for --json


Stats = dict[str, Any] | None  # one replica's stats file; None: missing or stale


def _read(path: Path, stale_after: float, not_before: float = 0.0) -> Stats:
    """The file's JSON if it was written in the last `stale_after` seconds and after
    `not_before` (when the rack last went down: rackctl.down_time); else None."""
    try:
        mtime = path.stat().st_mtime
        if time.time() - mtime > stale_after or mtime <= not_before:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def agreed_stats_path(run: Path, r: int) -> Path:
    """The stats file the replica was told to write: its rendered replica file says where
    (a harness may have overridden the default)."""
    try:
        for line in (run / f"agreed-{r}.conf").read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "stats_file":
                return Path(parts[1])
    except OSError:
        pass
    return run / f"agreed-{r}.stats.json"


def agreement_stats_from(
    config: Config, svc: Service, controlds: Controlds, stale_after: float
) -> tuple[list[Stats], set[int]]:
    """Each agreement replica's stats as its host's controld returned them (`agreed` of its
    `status`): None when it is not running, has written none since it started, or wrote
    them more than `stale_after` s ago; and the replicas whose controld did not answer."""
    out: list[Stats] = []
    unknown: set[int] = set()
    for r in range(svc.n):
        answer = controlds.get(config.replica_host(svc, r).name)
        if not isinstance(answer, dict):
            unknown.add(r)
            out.append(None)
            continue
        name = f"{svc.name}/agreed-{r}"
        e = next((x for x in answer.get("agreed", []) if isinstance(x, dict)
                  and x.get("name") == name), None)  # fmt: skip
        stats, age = (e or {}).get("stats"), (e or {}).get("stats_age_s")
        ok = (
            e is not None
            and e.get("state") == "running"
            and isinstance(stats, dict)
            and isinstance(age, int | float)
            and age <= stale_after
            and e.get("stats_current") is True  # written by this process, not a former one
        )
        out.append(stats if ok else None)
    return out, unknown


def agreement_stats(
    config: Config, svc: Service, stale_after: float, not_before: float = 0.0
) -> list[Stats]:
    """Each agreement replica's stats file (None: missing, or older than `stale_after` s or
    than `not_before`); `stale_after` inf reads what a stopped rack left."""
    run = config.rack.run_dir / f"s{svc.id}"
    return [_read(agreed_stats_path(run, r), stale_after, not_before) for r in range(svc.n)]


def exec_view(config: Config, svc: Service, stale_after: float) -> dict[str, list[int]]:
    """Who is awake, sleeping, convicted (exec_view_of) from the stats files."""
    return exec_view_of(agreement_stats(config, svc, stale_after))


def _ints(d: dict[str, Any], keys: tuple[str, ...]) -> dict[str, int]:
    return {k: int(d[k]) for k in keys if isinstance(d.get(k), int | bool)}


_AGREED_FIGURES = ("view", "last_exec", "stable_seq", "exec_stable", "exec_mismatches",
                   "exec_timeouts", "in_view_change")  # fmt: skip
_EXEC_FIGURES = ("last_executed", "stable_checkpoint", "last_checkpoint", "agreement_links_up")


def _agreement_rows(
    config: Config, svc: Service, stats: list[Stats], unknown: Set[int] = frozenset()
) -> list[Row]:
    views = [s["view"] for s in stats if s]
    view = max(views) if views else 0
    rows = []
    for r, s in enumerate(stats):
        role = "primary" if r == view % svc.n else "backup"
        host = config.replica_host(svc, r).name
        if r in unknown:
            rows.append(Row(svc.name, f"A{r}", role, host, "?", "-", "controld not answering",
                            "agreement", r))  # fmt: skip
            continue
        if s is None:
            rows.append(Row(svc.name, f"A{r}", role, host, "down", "-", "", "agreement", r))
            continue
        faults = s.get("exec_mismatches", 0) + s.get("exec_timeouts", 0)
        detail = f"view {s['view']} last_exec {s['last_exec']}"
        if svc.uses_execution_replicas:
            detail += f" exec_stable {s.get('exec_stable', 0)}"
        if faults:
            detail += (
                f" faults: {s.get('exec_mismatches', 0)} mismatch,"
                f" {s.get('exec_timeouts', 0)} timeout"
            )
        state = "view change" if s.get("in_view_change") else "up"
        rows.append(
            Row(svc.name, f"A{r}", role, host, state, f"{s['stable_seq']}", detail, "agreement",
                r, _ints(s, _AGREED_FIGURES))  # fmt: skip
        )
    return rows


def exec_view_of(stats: list[Stats]) -> dict[str, list[int]]:
    """Who is awake, sleeping, convicted now, as the agreement replicas (zz-agreed's stats,
    the most advanced one) see it: after a fault the woken spare is active and the
    convicted index a fresh spare. Empty when no replica says."""
    best = max((s for s in stats if s and "exec_awake" in s), default=None,
               key=lambda s: s.get("last_exec", 0))  # fmt: skip
    if best is None:
        return {}
    return {k: list(best.get(f"exec_{k}", [])) for k in ("awake", "sleeping", "convicted")}


def runtime_status(
    answer: dict[str, Any], service: str, index: int, stale_after: float, not_before: float = 0.0
) -> Stats:
    """An execution replica's status file as its controld returned it (`runtimes` of its
    `status`); None when there is none or it was written more than `stale_after` s ago,
    or before `not_before` (the rack's last stop or down: a runtime halted a moment ago
    left a file that still looks fresh)."""
    for e in answer.get("runtimes", []):
        if isinstance(e, dict) and (e.get("service"), e.get("index")) == (service, index):
            st, age = e.get("status"), e.get("status_age_s")
            if isinstance(st, dict) and isinstance(age, int | float) and age <= stale_after:
                if not_before and time.time() - age <= not_before:
                    return None
                return st
    return None


def inventory_record(
    controlds: Controlds | None, host: str, service: str, index: int
) -> dict[str, Any] | str | None:
    """controld `host`'s inventory record of service/index; None if it has none; the
    error text if that controld did not answer (or was not asked: "")."""
    if controlds is None or host not in controlds:
        return ""
    answer = controlds[host]
    if isinstance(answer, str):
        return answer
    for rec in answer.get("replicas", []):
        if isinstance(rec, dict) and rec.get("service") == service and rec.get("index") == index:
            return rec
    return None


def _sleeping_state(svc: Service, rec: dict[str, Any] | str | None) -> tuple[str, str]:
    """(state, detail) of a replica not running as far as its status file says: what its
    controld's inventory holds, "missing" if it holds nothing, "?" if it did not answer."""
    if rec == "":
        return svc.sleep, ""  # nobody asked controld: the plan's sleep mode
    if isinstance(rec, str):
        return "?", "controld not answering"
    if rec is None:
        return "missing", "not in its controld's inventory"
    state = str(rec.get("state"))
    if rec.get("pending"):
        state += f"->{rec['pending']}"
    return state, f"error: {rec['error']}" if rec.get("error") else ""


def _execution_rows(
    config: Config,
    svc: Service,
    stale_after: float,
    stats: list[Stats],
    controlds: Controlds | None,
    not_before: float = 0.0,
) -> list[Row]:
    rows = []
    view = exec_view_of(stats)
    for i in range(svc.n_exec):
        role = "active" if i < svc.active else "sleeping"
        if view:
            role = next((k for k in ("convicted", "awake", "sleeping") if i in view[k]), role)
            role = {"awake": "active"}.get(role, role)
        host = svc.exec_host(config, i).name
        if controlds is None:
            st = _read(svc.exec_status_path(config, i), stale_after, not_before)
        elif isinstance(controlds.get(host), dict):
            st = runtime_status(controlds[host], svc.name, i, stale_after, not_before)
        else:
            rows.append(Row(svc.name, f"E{i}", role, host, "?", "-", "controld not answering",
                            "execution", i))  # fmt: skip
            continue
        if st is None or st.get("asleep"):
            if role == "active" and st is None:
                rows.append(Row(svc.name, f"E{i}", role, host, "down", "-", "", "execution", i))
                continue
            rec = inventory_record(controlds, host, svc.name, i)
            state, detail = _sleeping_state(svc, rec)
            rows.append(Row(svc.name, f"E{i}", role, host, state, "-", detail, "execution", i))
            continue
        mism = st.get("checkpoint_mismatches", [])
        detail = f"last_exec {st['last_executed']}"
        if mism:
            peers = sorted({m["peer"] for m in mism})
            detail += f" checkpoint mismatch with E{', E'.join(map(str, peers))}"
        ckpt = f"{st['stable_checkpoint']}/{st['last_checkpoint']}"
        state = "recovering" if st.get("recovering") else "up"
        figures = _ints(st, _EXEC_FIGURES)
        figures["checkpoint_mismatches"] = len(mism)
        rows.append(
            Row(svc.name, f"E{i}", role, host, state, ckpt, detail, "execution", i, figures)
        )
    return rows


def rack_status(
    config: Config,
    stale_after: float = 5.0,
    controlds: Controlds | None = None,
    not_before: float = 0.0,
) -> list[Row]:
    """One row per agreement and execution replica. With `controlds` (the answers of the
    hosts' controlds), the replicas' states, stats and status files are theirs, and a spare
    that is not running shows its inventory state; without, the files are read here.
    Files written before `not_before` (the rack's last `down`) count as stale."""
    rows: list[Row] = []
    for svc in config.services:
        unknown: set[int] = set()
        if controlds is None:
            stats = agreement_stats(config, svc, stale_after, not_before)
        else:
            stats, unknown = agreement_stats_from(config, svc, controlds, stale_after)
        rows += _agreement_rows(config, svc, stats, unknown)
        if svc.uses_execution_replicas:
            rows += _execution_rows(config, svc, stale_after, stats, controlds, not_before)
    return rows


def _uptime(s: object) -> str:
    if not isinstance(s, int | float):
        return "?"
    s = int(s)
    return f"{s} s" if s < 120 else f"{s // 60} min" if s < 7200 else f"{s // 3600} h"


def controld_rows(config: Config, controlds: Controlds) -> list[Row]:
    """One row per host's controld: up (its backend, uptime, replicas) or not answering."""
    rows = []
    for h in config.hosts:
        answer = controlds.get(h.name, "not asked")
        if isinstance(answer, str):
            rows.append(Row("-", "controld", "-", h.name, "not answering", "-", answer,
                            "controld", h.index))  # fmt: skip
            continue
        reps = answer.get("replicas", [])
        detail = (
            f"{answer.get('backend', '?')} backend, up {_uptime(answer.get('uptime_s'))},"
            f" {len(reps)} replica{'s' if len(reps) != 1 else ''}"
        )
        if answer.get("lost"):
            detail += f", lost {len(answer['lost'])}"
        figures = {"uptime_s": int(answer.get("uptime_s") or 0), "replicas": len(reps)}
        rows.append(Row("-", "controld", "-", h.name, "up", "-", detail, "controld", h.index,
                        figures))  # fmt: skip
    return rows


@dataclass
class Health:
    """The verdict `zz status` exits with: 0 healthy, 1 degraded, 2 not running."""

    running: bool
    problems: list[str] = field(default_factory=list)

    @property
    def code(self) -> int:
        if not self.running:
            return NOT_RUNNING
        return DEGRADED if self.problems else HEALTHY

    @property
    def word(self) -> str:
        return {HEALTHY: "healthy", DEGRADED: "degraded", NOT_RUNNING: "not running"}[self.code]


def _fresh(row: Row) -> bool:
    """The row's process wrote its file recently (it is running)."""
    return bool(row.figures) and row.kind != "controld"


def assess(
    config: Config, rows: list[Row], controlds: Controlds, recorded_alive: bool = False
) -> Health:
    """Running: a process `zz rack up` recorded is alive, a replica's file is fresh, or a
    controld answered (with rack.controlds = "hosts" a controld runs on its host whether
    the rack does or not: there only the replicas count). Degraded when running and an
    agreement replica or an active execution replica is down, a sleeping spare is missing
    (not in its controld's inventory, or convicted and not yet replaced), or a controld
    does not answer."""
    answered = [h for h, a in controlds.items() if not isinstance(a, str)]
    if config.rack.controlds == "hosts":
        answered = []
    running = recorded_alive or any(_fresh(r) for r in rows) or bool(answered)
    health = Health(running)
    if not running:
        return health
    for r in rows:
        name = f"{r.service}/{r.replica}"
        if r.kind == "agreement" and r.state == "down":
            health.problems.append(f"{name} down (agreement replica on {r.host})")
        elif r.kind == "execution":
            if r.role == "active" and r.state == "down":
                health.problems.append(f"{name} down (active execution replica on {r.host})")
            elif r.role == "convicted":
                health.problems.append(
                    f"{name} convicted, its fresh spare not back asleep yet (on {r.host})"
                )
            elif r.state == "missing":
                health.problems.append(
                    f"{name} spare missing (not in controld {r.host}'s inventory)"
                )
            elif r.state.startswith("convicted"):
                health.problems.append(f"{name} spare missing (controld {r.host}: {r.state})")
    for h in config.hosts:
        answer = controlds.get(h.name, "not asked")
        if isinstance(answer, str):
            health.problems.append(f"controld {h.name} not answering ({answer})")
    return health


def status_document(
    config: Config,
    rows: list[Row],
    controlds: Controlds,
    health: Health,
    recorded: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`zz status --json` (docs/operations.md "zz status --json"). A rack that is not
    running lists no replicas: a planned role is not a running one."""
    running = health.running
    ctl = []
    for h in config.hosts:
        answer = controlds.get(h.name, "not asked")
        d: dict[str, Any] = {"host": h.name, "answering": not isinstance(answer, str)}
        if isinstance(answer, str):
            d["error"] = answer
        else:
            d.update(
                error=None,
                backend=answer.get("backend"),
                uptime_s=answer.get("uptime_s"),
                replicas=answer.get("replicas", []),
                lost=answer.get("lost", []),
                in_doubt_at_start=answer.get("in_doubt_at_start", []),
                counters=answer.get("counters", {}),
                recent=answer.get("recent", []),
            )
        ctl.append(d)
    return {
        "schema": SCHEMA,
        "rack": config.rack.name,
        "config": str(config.path),
        "time": round(time.time(), 3),
        "running": running,
        "health": health.word,
        "exit_code": health.code,
        "problems": health.problems,
        "recorded": recorded,
        "hosts": [
            {
                "name": h.name,
                "address": h.address,
                "control_port": h.control_port,
                "metrics_url": h.metrics_url,
            }
            for h in config.hosts
        ],
        "controlds": ctl,
        "replicas": [asdict(r) for r in rows] if running else [],
    }


def format_rows(rows: list[Row]) -> str:
    head = Row("SERVICE", "REPLICA", "ROLE", "HOST", "STATE", "CHECKPOINT", "DETAIL")
    table = [head, *rows]
    widths = {c: max(len(str(getattr(r, c))) for r in table) for c in COLUMNS[:-1]}
    lines = []
    for r in table:
        cells = [str(getattr(r, c)).ljust(widths[c]) for c in COLUMNS[:-1]]
        lines.append("  ".join([*cells, str(r.detail)]).rstrip())
    return "\n".join(lines)


def summary_line(
    config: Config, health: Health, stale_after: float = 5.0, stopped_at: float | None = None
) -> str:
    """The last line of `zz status`: healthy, DEGRADED with every problem, or not running
    (`stopped_at`: stopped by `zz rack stop` then, its state kept)."""
    name = f"rack {config.rack.name!r}"
    if not health.running and stopped_at is not None:
        return (
            f"{name}: not running, stopped at {time.ctime(stopped_at)} with its state kept;"
            f" `zz rack start {config.path}` brings it back"
        )
    if not health.running and config.rack.controlds == "hosts":
        return (
            f"{name}: not running (no agreement or execution replica running or writing its"
            f" stats in the last {stale_after:g} s; the controlds run on their hosts);"
            f" `zz rack up {config.path}`"
        )
    if not health.running:
        return (
            f"{name}: not running (no process of run/rack.json alive, no replica stats newer"
            f" than {stale_after:g} s, no controld answering); `zz rack up {config.path}`"
        )
    if health.problems:
        n = len(health.problems)
        return f"{name}: DEGRADED, {n} problem{'s' if n > 1 else ''}: " + "; ".join(
            health.problems
        )
    return f"{name}: healthy"


def format_status(
    config: Config,
    rows: list[Row],
    controlds: Controlds,
    health: Health,
    stale_after: float = 5.0,
    verbose: int = 0,
    stopped_at: float | None = None,
) -> str:
    """What `zz status` prints: the replicas and controlds, then the verdict line; only
    the verdict when the rack is not running. `verbose`: each controld's metrics URL and
    its last log lines too."""
    if not health.running:
        return summary_line(config, health, stale_after, stopped_at)
    out = [format_rows(rows + controld_rows(config, controlds))]
    if verbose:
        for h in config.hosts:
            answer = controlds.get(h.name)
            out.append(f"controld {h.name}: {h.metrics_url or 'no /metrics (metrics_port 0)'}")
            if isinstance(answer, dict):
                out += [f"  {line}" for line in answer.get("recent", [])[-10:]]
    out.append(summary_line(config, health, stale_after))
    return "\n".join(out)
