# controld/metrics.py - controld's Prometheus /metrics: everything on its host, per service and
# replica: zz-agreed's stats files and the runtimes' status files read at scrape time by a
# custom collector, and controld's own events (wake-ups and their latency by mechanism,
# convictions, provisioning, drops per peer). Exposition by prometheus_client, served by a
# small asyncio HTTP responder (no thread). docs/monitoring.md.
"""controld's metrics (docs/monitoring.md).

Nothing here runs in the background: a scrape reads the host's stats files (zz-agreed
rewrites ``run/s<id>/agreed-<r>.stats.json`` every second, a runtime its status file) and
controld's counters, in the event loop, and answers. A file older than ``STALE_AFTER``
seconds (or missing) is a replica that is not running: only its ``*_up`` gauge is exported,
0, never its last values.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from zz.config import Config, Service

if TYPE_CHECKING:
    from zz.controld.daemon import Daemon

log = logging.getLogger("zz.controld.metrics")

STALE_AFTER = 5.0  # seconds: as `zz status`
# Wake-up latency (the hypervisor calls; docs/controld.md "Wake-up latency"): unpause is
# ~10-50 ms, a paged-out restore ~1-2 s, a plain restore several seconds.
WAKE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
MECHANISM = {"paused": "unpause", "hibernated": "restore"}  # the state woken from
MAX_PEERS = 256  # distinct source addresses counted; the rest as "other"


def read_json(path: Path, stale_after: float = STALE_AFTER) -> dict[str, Any] | None:
    """A stats/status file, or None if missing, unreadable or older than stale_after."""
    try:
        if time.time() - path.stat().st_mtime > stale_after:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def agreed_stats_path(config: Config, svc: Service, r: int) -> Path:
    """Where agreement replica r writes its stats: its rendered replica file says (a harness
    may have set another path), else run/s<id>/agreed-<r>.stats.json."""
    run = config.rack.run_dir / f"s{svc.id}"
    with contextlib.suppress(OSError):
        for line in (run / f"agreed-{r}.conf").read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "stats_file":
                return Path(parts[1])
    return run / f"agreed-{r}.stats.json"


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


class _Families:
    """Metric families built up during one scrape, every sample labelled with the host."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.fams: dict[str, Metric] = {}

    def _fam(self, kind: str, name: str, doc: str, labels: list[str]) -> Metric:
        fam = self.fams.get(name)
        if fam is None:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            fam = self.fams[name] = cls(name, doc, labels=["host", *labels])
        return fam

    def gauge(self, name: str, doc: str, value: object, **labels: str) -> None:
        v = _num(value)
        if v is not None:
            self._fam("gauge", name, doc, list(labels)).add_metric([self.host, *labels.values()], v)

    def counter(self, name: str, doc: str, value: object, **labels: str) -> None:
        v = _num(value)
        if v is not None:
            fam = self._fam("counter", name, doc, list(labels))
            fam.add_metric([self.host, *labels.values()], v)


# (stats key, metric name, help) of zz-agreed's stats file (docs/agreement.md).
AGREED_GAUGES = (
    ("view", "zz_agreement_view", "Current view"),
    ("in_view_change", "zz_agreement_in_view_change", "1 while a view change is in progress"),
    ("last_exec", "zz_agreement_last_executed_seq", "Last sequence number executed (ordered)"),
    ("stable_seq", "zz_agreement_stable_checkpoint_seq", "Last stable checkpoint"),
    ("exec_stable", "zz_agreement_exec_stable_seq", "Last stable execution checkpoint"),
)
AGREED_COUNTERS = (
    ("requests_in", "zz_agreement_requests", "REQUESTs received"),
    ("requests_dup", "zz_agreement_requests_duplicate", "REQUESTs received again"),
    ("requests_readonly", "zz_agreement_requests_readonly", "Read-only REQUESTs"),
    ("batches_proposed", "zz_agreement_batches_proposed", "Batches proposed as primary"),
    ("batches_executed", "zz_agreement_batches_executed", "Batches ordered and executed"),
    ("view_changes", "zz_agreement_view_changes", "View changes started"),
    ("new_views", "zz_agreement_new_views", "New views installed"),
    ("stable_advances", "zz_agreement_checkpoints_stable", "Checkpoints that became stable"),
    (
        "exec_stable_advances",
        "zz_agreement_exec_checkpoints_stable",
        "Execution checkpoints that became stable",
    ),
    ("exec_certificates", "zz_agreement_exec_certificates", "Execution certificates formed"),
    ("exec_mismatches", "zz_agreement_exec_mismatches", "Execution reports that disagreed"),
    (
        "exec_timeouts",
        "zz_agreement_report_timers_fired",
        "Execution report timers fired without a certificate",
    ),
    ("retransmits", "zz_agreement_retransmits", "Retransmissions"),
    ("state_transfers", "zz_agreement_state_transfers", "State transfers"),
)
# key prefix -> (metric, help, label, values)
AGREED_DIRECTIONS = (
    (
        "fault_statements",
        "zz_agreement_fault_statements",
        "FAULT-STATEMENTs",
        ("sent", "received", "rejected"),
    ),
    ("wakeups", "zz_agreement_wakeups", "WAKEUPs", ("sent", "received", "rejected", "relayed")),
    ("shutdowns", "zz_agreement_shutdowns", "SHUTDOWN votes", ("sent", "received", "rejected")),
    (
        "spares_ready",
        "zz_agreement_spares_ready",
        "SPARE-READY announcements",
        ("received", "rejected", "held"),
    ),
)


class HostCollector(Collector):
    """Everything on the daemon's host, read at scrape time."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon

    def collect(self) -> Iterator[Metric]:
        d = self.d
        f = _Families(d.host.name)
        ordered: dict[int, float] = {}  # service id -> highest last_exec seen on this host
        for svc in d.config.services:
            for r in range(svc.n):
                if d.config.replica_host(svc, r).index == d.host.index:
                    self._agreement(f, svc, r, ordered)
        for svc in d.config.services:
            if not svc.uses_execution_replicas:
                continue
            for i in range(svc.n_exec):
                if svc.exec_host(d.config, i).index == d.host.index:
                    self._execution(f, svc, i, ordered.get(svc.id))
        self._controld(f)
        yield from f.fams.values()

    def _agreement(self, f: _Families, svc: Service, r: int, ordered: dict[int, float]) -> None:
        lab = {"service": svc.name, "replica": str(r)}
        st = read_json(agreed_stats_path(self.d.config, svc, r))
        f.gauge(
            "zz_agreement_up",
            "1 if the agreement replica's stats file is fresh",
            1 if st else 0,
            **lab,
        )
        if st is None:
            return
        for key, name, doc in AGREED_GAUGES:
            f.gauge(name, doc, st.get(key), **lab)
        for key, name, doc in AGREED_COUNTERS:
            f.counter(name, doc, st.get(key), **lab)
        for prefix, name, doc, values in AGREED_DIRECTIONS:
            for v in values:
                f.counter(name, f"{doc} by direction", st.get(f"{prefix}_{v}"), **lab, direction=v)
        for which in ("last", "max"):
            ms = _num(st.get(f"detect_latency_{which}_ms"))
            f.gauge(
                "zz_agreement_detect_latency_seconds",
                "Fault detection latency (last, max)",
                None if ms is None else ms / 1000,
                **lab,
                which=which,
            )
        dropped = st.get("dropped")
        if isinstance(dropped, dict):
            for reason, n in sorted(dropped.items()):
                f.counter(
                    "zz_agreement_messages_dropped",
                    "Messages dropped, by reason",
                    n,
                    **lab,
                    reason=str(reason),
                )
        # Per peer (one series per configured peer): drops outside the window, charged to
        # the sender; malformed messages, charged to the peer whose own messages the
        # connection carries (zz-agreed replica.c attribute_conn; on a connection no peer
        # was identified on, only by reason above).
        for key, prefix in (("peer_window_drops", "A"), ("exec_window_drops", "E")):
            drops = st.get(key)
            if isinstance(drops, list):
                for j, n in enumerate(drops):
                    f.counter(
                        "zz_agreement_window_drops",
                        "Messages dropped outside the"
                        " window, per peer (A<r> agreement, E<i> execution)",
                        n,
                        **lab,
                        peer=f"{prefix}{j}",
                    )
        for key, prefix in (("peer_malformed_drops", "A"), ("exec_malformed_drops", "E")):
            drops = st.get(key)
            if isinstance(drops, list):
                for j, n in enumerate(drops):
                    f.counter(
                        "zz_agreement_malformed_drops",
                        "Malformed messages dropped (undecodable, wrong service or sender,"
                        " failed authenticator, bad frame length) on a peer's connection,"
                        " per peer (A<r> agreement, E<i> execution)",
                        n,
                        **lab,
                        peer=f"{prefix}{j}",
                    )
        for state in ("awake", "sleeping", "convicted"):
            ids = st.get(f"exec_{state}")
            if isinstance(ids, list):
                for x in ids:
                    f.gauge(
                        "zz_agreement_exec_view",
                        "This agreement replica's view of the"
                        " execution replicas (1 per replica and state)",
                        1,
                        **lab,
                        exec=str(x),
                        state=state,
                    )
        net = st.get("net")
        if isinstance(net, dict):
            for way in ("in", "out"):
                f.counter(
                    "zz_agreement_frames",
                    "Frames by direction",
                    net.get(f"frames_{way}"),
                    **lab,
                    direction=way,
                )
        last = _num(st.get("last_exec"))
        if last is not None:
            ordered[svc.id] = max(ordered.get(svc.id, 0.0), last)

    def _execution(self, f: _Families, svc: Service, i: int, ordered: float | None) -> None:
        lab = {"service": svc.name, "replica": str(i)}
        st = read_json(svc.exec_status_path(self.d.config, i))
        f.gauge(
            "zz_execution_up",
            "1 if the execution replica's status file is fresh",
            1 if st else 0,
            **lab,
        )
        if st is None:
            return
        f.gauge("zz_execution_asleep", "1 while a spare sleeps", int(bool(st.get("asleep"))), **lab)
        f.gauge(
            "zz_execution_recovering",
            "1 while fetching a recovered state",
            int(bool(st.get("recovering"))),
            **lab,
        )
        last = _num(st.get("last_executed"))
        f.gauge("zz_execution_last_executed_seq", "Last sequence number executed", last, **lab)
        f.gauge(
            "zz_execution_stable_checkpoint_seq",
            "Last stable checkpoint",
            st.get("stable_checkpoint"),
            **lab,
        )
        f.gauge(
            "zz_execution_pending_seqs",
            "Committed batches waiting to execute",
            st.get("pending_seqs"),
            **lab,
        )
        if ordered is not None and last is not None and not st.get("asleep"):
            f.gauge(
                "zz_execution_lag_seqs",
                "Ordered (highest last_exec of this host's agreement replicas) minus executed",
                max(0.0, ordered - last),
                **lab,
            )
        mism = st.get("checkpoint_mismatches")
        if isinstance(mism, list):
            f.gauge(
                "zz_execution_checkpoint_mismatches",
                "Checkpoints where this replica disagreed with a certified digest",
                len(mism),
                **lab,
            )
        f.gauge(
            "zz_execution_files_pending",
            "Files of a recovered state not fetched yet",
            st.get("files_pending"),
            **lab,
        )
        c = st.get("counters") if isinstance(st.get("counters"), dict) else {}
        assert isinstance(c, dict)
        f.counter(
            "zz_execution_requests_executed",
            "Requests executed (ordered)",
            c.get("requests_executed", 0),
            **lab,
        )
        f.counter(
            "zz_execution_batches_executed", "Batches executed", c.get("batches_executed", 0), **lab
        )
        f.counter("zz_execution_checkpoints", "Checkpoints taken", c.get("checkpoints", 0), **lab)
        f.counter(
            "zz_execution_recoveries",
            "Recoveries to a certified checkpoint",
            c.get("recoveries", 0),
            **lab,
        )
        f.counter(
            "zz_execution_file_bytes_served",
            "Snapshot file bytes served to peers",
            c.get("file_bytes_served", 0),
            **lab,
        )
        for key, n in sorted(c.items()):
            f.counter(
                "zz_execution_events",
                "Every counter of the runtime's status file",
                n,
                **lab,
                event=str(key),
            )
        rec = st.get("recovery") if isinstance(st.get("recovery"), dict) else {}
        assert isinstance(rec, dict)
        ms = _num(rec.get("install_ms"))
        if ms is not None:
            f.gauge(
                "zz_execution_recovery_install_seconds",
                "Last recovery: certified checkpoint to executing again",
                ms / 1000,
                **lab,
            )
        f.gauge(
            "zz_execution_recovery_background_seconds",
            "Last recovery: the background fetch of the rest of the state",
            rec.get("background_s"),
            **lab,
        )
        fetch = st.get("fetch") if isinstance(st.get("fetch"), dict) else {}
        assert isinstance(fetch, dict)
        f.counter(
            "zz_execution_fetch_bytes",
            "State bytes fetched and verified",
            fetch.get("bytes_fetched", 0),
            **lab,
        )
        verified = (_num(fetch.get("fetched_foreground")) or 0) + (
            _num(fetch.get("fetched_background")) or 0
        )
        for result, n in (
            ("verified", verified),
            ("rejected", fetch.get("bad_content", 0)),
            ("stale", fetch.get("stale_copies", 0)),
            ("kept", fetch.get("kept", 0)),
        ):
            f.counter(
                "zz_execution_fetch_files",
                "Files of a recovered state: fetched and"
                " hash-verified, rejected (bad content), stale copies, kept (local"
                " copy matched)",
                n,
                **lab,
                result=result,
            )

    def _controld(self, f: _Families) -> None:
        d = self.d
        f.gauge("zz_controld_up", "1: controld answers", 1)
        f.gauge(
            "zz_controld_uptime_seconds", "Seconds since controld started", time.time() - d.started
        )
        for key, n in sorted(d.counters.items()):
            f.counter(
                "zz_controld_events", "Every controld counter (docs/controld.md)", n, event=key
            )
        for peer, n in sorted(d.dropped_by_source.items()):
            f.counter(
                "zz_controld_messages_dropped",
                "Messages controld dropped (malformed,"
                " unauthenticated, refused), per source address",
                n,
                peer=peer,
            )
        for rec in d.inventory.replicas():
            f.gauge(
                "zz_controld_replica_state",
                "Inventory state of each replica here (1)",
                1,
                service=rec.service,
                replica=str(rec.index),
                state=str(rec.state),
            )
        a = d.audit.status()
        f.gauge("zz_controld_audit_entries", "Entries in the audit log", a["entries"])


class HostMetrics:
    """One registry per daemon (tests run several in one process): controld's own event
    metrics, counted where they happen, and the HostCollector for the rest."""

    def __init__(self, daemon: Daemon) -> None:
        self.host = daemon.host.name
        self.registry = CollectorRegistry()
        reg = self.registry
        self.wakeups = PromCounter(
            "zz_controld_wakeups",
            "Replicas woken, by mechanism",
            ["host", "service", "replica", "mechanism"],
            registry=reg,
        )
        self.wakeup_seconds = Histogram(
            "zz_controld_wakeup_seconds",
            "Wake-up latency: inventory write-ahead + the hypervisor's resume or restore",
            ["host", "service", "mechanism"],
            buckets=WAKE_BUCKETS,
            registry=reg,
        )
        self.convictions = PromCounter(
            "zz_controld_convictions",
            "Replicas convicted and destroyed by a SHUTDOWN certificate",
            ["host", "service", "replica"],
            registry=reg,
        )
        self.provisioned = PromCounter(
            "zz_controld_provisioned",
            "Replicas provisioned (mode paused/hibernated: a spare)",
            ["host", "service", "replica", "mode"],
            registry=reg,
        )
        self.provision_seconds = Histogram(
            "zz_controld_provision_seconds",
            "Provisioning time: boot until the runtime answers, then asleep",
            ["host", "service", "mode"],
            buckets=(0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0),
            registry=reg,
        )
        reg.register(HostCollector(daemon))

    def woke(self, svc: Service, index: int, from_state: str, seconds: float) -> None:
        mech = MECHANISM.get(from_state, from_state)
        self.wakeups.labels(self.host, svc.name, str(index), mech).inc()
        self.wakeup_seconds.labels(self.host, svc.name, mech).observe(seconds)

    def convicted(self, svc: Service, index: int) -> None:
        self.convictions.labels(self.host, svc.name, str(index)).inc()

    def provision(self, svc: Service, index: int, mode: str, seconds: float) -> None:
        self.provisioned.labels(self.host, svc.name, str(index), mode).inc()
        self.provision_seconds.labels(self.host, svc.name, mode).observe(seconds)


def count_peer(counts: Counter[str], peer: str) -> None:
    """One dropped message from `peer`, with a bounded number of distinct peers."""
    if peer not in counts and len(counts) >= MAX_PEERS:
        peer = "other"
    counts[peer] += 1


class MetricsServer:
    """GET /metrics over HTTP/1.x on an asyncio listener: one request per connection, the
    request head within 5 s and 8 KiB, at most 16 connections at a time."""

    MAX_CONNS = 16
    HEAD_TIMEOUT = 5.0
    HEAD_LIMIT = 8192

    def __init__(
        self,
        registry: CollectorRegistry,
        address: str,
        counters: Counter[str],
        note: Callable[[str], None],
    ) -> None:
        self.registry = registry
        self.address = address
        self.counters = counters
        self.note = note
        self.port: int | None = None
        self.error: str | None = None
        self._server: asyncio.base_events.Server | None = None
        self._open = 0

    @property
    def url(self) -> str | None:
        if self.port is None:
            return None
        addr = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{addr}:{self.port}/metrics"

    async def start(self, port: int) -> None:
        """Listen; a port that cannot be bound is noted and counted, never fatal: controld's
        work does not depend on being watched."""
        try:
            self._server = await asyncio.start_server(
                self._handle, self.address, port, limit=self.HEAD_LIMIT
            )
        except OSError as e:
            self.error = f"cannot listen on {self.address}:{port}: {e.strerror or e}"
            self.counters["metrics_listen_failed"] += 1
            self.note(f"metrics: {self.error}")
            return
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    def status(self) -> dict[str, Any]:
        return {"url": self.url, "error": self.error}

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= self.MAX_CONNS:
            self.counters["metrics_conns_refused"] += 1
            writer.close()
            return
        self._open += 1
        try:
            try:
                async with asyncio.timeout(self.HEAD_TIMEOUT):
                    head = await reader.readuntil(b"\r\n\r\n")
            except (
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
                TimeoutError,
                ConnectionError,
            ):
                self.counters["metrics_bad_requests"] += 1
                return
            status, ctype, body = self._answer(head)
            hdr = (
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            send_body = not head.startswith(b"HEAD ")
            writer.write(hdr.encode() + (body if send_body else b""))
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(self.HEAD_TIMEOUT):
                    await writer.drain()
        finally:
            self._open -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _answer(self, head: bytes) -> tuple[str, str, bytes]:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        text = "text/plain; charset=utf-8"
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self.counters["metrics_bad_requests"] += 1
            return "400 Bad Request", text, b"bad request\n"
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", text, b"GET /metrics\n"
        if target.split("?", 1)[0] != "/metrics":
            return "404 Not Found", text, b"GET /metrics\n"
        accept = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "accept":
                accept = value.strip()
        encoder, ctype = choose_encoder(accept)
        try:
            body = encoder(self.registry)
        except Exception as e:  # a collector bug must not take controld down
            self.counters["metrics_errors"] += 1
            log.exception("metrics collection failed")
            return "500 Internal Server Error", text, f"collection failed: {e}\n".encode()
        self.counters["metrics_scrapes"] += 1
        return "200 OK", ctype, body
