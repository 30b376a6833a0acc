# zz/status.py - `zz status`: every service's replicas, role, host, state, checkpoints and
# recent faults, read from the files the daemons rewrite every second (no extra RPC).
"""Rack status from the replicas' own stats files.

Agreement replicas write ``run/s<id>/agreed-<r>.stats.json`` (zz-agreed, docs/agreement.md),
execution replicas ``run/s<id>/exec-<i>.status.json`` (docs/execution.md). A file older
than `stale_after` seconds means the process is not running (or hung): shown as ``down``.
Execution roles (active, sleeping, convicted) come from the agreement replicas' view of them
(``exec_awake``/``exec_sleeping``/``exec_convicted`` in their stats), else from the plan.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zz.config import Config, Service


@dataclass
class Row:
    service: str
    replica: str  # "A<r>" or "E<i>"
    role: str  # agreement role (primary/backup) or execution role (active/sleeping)
    host: str
    state: str  # up / down / in view change / the sleep mode
    checkpoint: str  # stable / last checkpoint
    detail: str  # view, last executed, faults seen


Stats = dict[str, Any] | None  # one replica's stats file; None: missing or stale


def _read(path: Path, stale_after: float) -> Stats:
    try:
        if time.time() - path.stat().st_mtime > stale_after:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stats_path(run: Path, r: int) -> Path:
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


def _agreement_stats(config: Config, svc: Service, stale_after: float) -> list[Stats]:
    run = config.rack.run_dir / f"s{svc.id}"
    return [_read(_stats_path(run, r), stale_after) for r in range(svc.n)]


def _agreement_rows(config: Config, svc: Service, stats: list[Stats]) -> list[Row]:
    views = [s["view"] for s in stats if s]
    view = max(views) if views else 0
    rows = []
    for r, s in enumerate(stats):
        role = "primary" if r == view % svc.n else "backup"
        host = config.replica_host(svc, r).name
        if s is None:
            rows.append(Row(svc.name, f"A{r}", role, host, "down", "-", ""))
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
        rows.append(Row(svc.name, f"A{r}", role, host, state, f"{s['stable_seq']}", detail))
    return rows


def _exec_view(stats: list[Stats]) -> dict[str, list[int]]:
    """Who is awake, sleeping, convicted now, as the agreement replicas (zz-agreed's stats,
    the most advanced one) see it: after a fault the woken spare is active and the
    convicted index a fresh spare. Empty when no replica says."""
    best = max((s for s in stats if s and "exec_awake" in s), default=None,
               key=lambda s: s.get("last_exec", 0))  # fmt: skip
    if best is None:
        return {}
    return {k: list(best.get(f"exec_{k}", [])) for k in ("awake", "sleeping", "convicted")}


def _execution_rows(
    config: Config, svc: Service, stale_after: float, stats: list[Stats]
) -> list[Row]:
    rows = []
    view = _exec_view(stats)
    for i in range(svc.n_exec):
        role = "active" if i < svc.active else "sleeping"
        if view:
            role = next((k for k in ("convicted", "awake", "sleeping") if i in view[k]), role)
            role = {"awake": "active"}.get(role, role)
        host = svc.exec_host(config, i).name
        st = _read(svc.exec_status_path(config, i), stale_after)
        if st is None:
            state = "down" if role == "active" else svc.sleep
            rows.append(Row(svc.name, f"E{i}", role, host, state, "-", ""))
            continue
        if st.get("asleep"):
            rows.append(Row(svc.name, f"E{i}", role, host, svc.sleep, "-", ""))
            continue
        mism = st.get("checkpoint_mismatches", [])
        detail = f"last_exec {st['last_executed']}"
        if mism:
            peers = sorted({m["peer"] for m in mism})
            detail += f" checkpoint mismatch with E{', E'.join(map(str, peers))}"
        ckpt = f"{st['stable_checkpoint']}/{st['last_checkpoint']}"
        state = "recovering" if st.get("recovering") else "up"
        rows.append(Row(svc.name, f"E{i}", role, host, state, ckpt, detail))
    return rows


def rack_status(config: Config, stale_after: float = 5.0) -> list[Row]:
    rows: list[Row] = []
    for svc in config.services:
        stats = _agreement_stats(config, svc, stale_after)
        rows += _agreement_rows(config, svc, stats)
        if svc.uses_execution_replicas:
            rows += _execution_rows(config, svc, stale_after, stats)
    return rows


def status_json(config: Config, rows: list[Row]) -> dict[str, Any]:
    """`zz status --json`: the rows, and each host's controld with its /metrics URL
    (`hosts[].metrics_port`, docs/monitoring.md; null when switched off)."""
    return {
        "rack": config.rack.name,
        "hosts": [
            {
                "name": h.name,
                "address": h.address,
                "control_port": h.control_port,
                "metrics_url": h.metrics_url,
            }
            for h in config.hosts
        ],
        "replicas": [vars(r) for r in rows],
    }


def format_rows(rows: list[Row]) -> str:
    head = Row("SERVICE", "REPLICA", "ROLE", "HOST", "STATE", "CHECKPOINT", "DETAIL")
    table = [head, *rows]
    cols = list(vars(head))
    widths = {c: max(len(str(getattr(r, c))) for r in table) for c in cols[:-1]}
    lines = []
    for r in table:
        cells = [str(getattr(r, c)).ljust(widths[c]) for c in cols[:-1]]
        lines.append("  ".join([*cells, str(r.detail)]).rstrip())
    return "\n".join(lines)
