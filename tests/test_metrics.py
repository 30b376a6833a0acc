# tests/test_metrics.py - controld's Prometheus /metrics (controld/metrics.py,
# docs/monitoring.md): a live process rack under load scraped over HTTP at the URLs
# `zz status --json` lists and parsed with prometheus_client's own parser; one controld's
# wake-up latency histogram, drops per peer and HTTP handling; the mapping of zz-agreed's
# stats and a runtime's status file onto metric families.
from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from test_controld_daemon import Rack, make_rack, nodes
from test_rackctl import leftovers, write_rack

from tests.test_execution_runtime import needs_agreed
from zz import cli, kvop, ports, rackctl
from zz.client import Client, ClientParams
from zz.config import Config, load

Samples = dict[str, list[Sample]]


def scrape(url: str, accept: str | None = None) -> tuple[str, str]:
    req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode(), r.headers["Content-Type"]


def parse(text: str) -> Samples:
    """Sample name -> its samples, through the library's own parser."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, [])  # a family without samples yet is still declared
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    hits = [
        s for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0].value


# ---- a live rack --------------------------------------------------------------------------


@pytest.fixture
def live_rack(tmp_path: Path) -> Iterator[Config]:
    path = write_rack(tmp_path, name="rm")
    text = path.read_text()
    hosts = 4
    addrs = [f"127.0.0.{h + 1}" for h in range(hosts)]
    mbase = ports.free_base(range(hosts), addrs)
    for h in range(hosts):
        line = f'name = "h{h}"\naddress = "{addrs[h]}"\n'
        text = text.replace(line, line + f"metrics_port = {mbase + h}\n")
    path.write_text(text)
    config = load(path)
    try:
        yield config
    finally:
        rackctl.down(config)
        for pid in leftovers(config):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


async def _load(config: Config, ops: int) -> None:
    async with Client(ClientParams.from_config(config, "kv0", 0)) as c:
        for k in range(ops):
            await c.invoke(kvop.encode_put(b"k%d" % k, b"v%d" % k), timeout=30)


@needs_agreed
def test_scrape_a_live_rack(live_rack: Config) -> None:
    config = live_rack
    svc = config.service("kv0")
    rackctl.up(config, overrides={"detect_floor_ms": 1000})
    ops = 40
    asyncio.run(_load(config, ops))
    time.sleep(1.5)  # every stats and status file rewritten since the load
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["status", str(config.path), "--json"]) == 0
    listed = json.loads(buf.getvalue())
    urls = {h["name"]: h["metrics_url"] for h in listed["hosts"]}
    assert urls == {h.name: f"http://{h.address}:{h.metrics_port}/metrics" for h in config.hosts}
    assert len(listed["replicas"]) == svc.n + svc.n_exec

    scraped: dict[str, Samples] = {}
    for h in config.hosts:
        text, ctype = scrape(urls[h.name])
        assert ctype.startswith("text/plain"), ctype
        scraped[h.name] = parse(text)
    agree_up, exec_up, executed, ordered = {}, {}, {}, {}
    for h in config.hosts:
        s = scraped[h.name]
        assert value(s, "zz_controld_up", host=h.name) == 1
        assert value(s, "zz_controld_uptime_seconds", host=h.name) > 0
        for fam in ("zz_controld_wakeup_seconds", "zz_controld_wakeups", "zz_controld_convictions"):
            assert fam in s, fam  # declared before the first wake-up or conviction
        for x in s.get("zz_agreement_up", []):
            assert x.labels["host"] == h.name and x.labels["service"] == "kv0"
            agree_up[int(x.labels["replica"])] = (h.name, x.value)
        for x in s.get("zz_execution_up", []):
            exec_up[int(x.labels["replica"])] = (h.name, x.value)
        for x in s.get("zz_execution_requests_executed_total", []):
            executed[int(x.labels["replica"])] = x.value
        for x in s.get("zz_agreement_requests_total", []):
            ordered[int(x.labels["replica"])] = x.value
        for x in s.get("zz_controld_replica_state", []):
            i = int(x.labels["replica"])
            assert x.labels["state"] == ("paused" if i == 2 else "active"), x
            assert h.name == svc.exec_host(config, i).name
            assert value(s, "zz_controld_provisioned_total", replica=str(i)) == 1
            assert value(s, "zz_controld_events_total", event="control_ok") >= 1
    # Every replica is reported by its own host's controld, per replica, with sane values.
    assert agree_up == {r: (config.replica_host(svc, r).name, 1.0) for r in range(svc.n)}
    assert {i: h for i, (h, _) in exec_up.items()} == {
        i: svc.exec_host(config, i).name for i in range(svc.n_exec)
    }
    assert exec_up[0][1] == exec_up[1][1] == 1  # the paused spare 2 runs no status loop
    assert executed[0] >= ops and executed[1] >= ops
    assert ordered[0] >= ops, ordered  # the client sends to the primary (view 0: A0)
    for r in range(svc.n):
        s = scraped[config.replica_host(svc, r).name]
        assert value(s, "zz_agreement_view", replica=str(r)) == 0
        assert value(s, "zz_agreement_last_executed_seq", replica=str(r)) >= 1
        assert value(s, "zz_agreement_batches_executed_total", replica=str(r)) >= 1
        assert value(s, "zz_agreement_exec_mismatches_total", replica=str(r)) == 0
        sent = value(s, "zz_agreement_fault_statements_total", replica=str(r), direction="sent")
        assert sent == 0
        peers = {x.labels["peer"] for x in s["zz_agreement_window_drops_total"]
                 if x.labels["replica"] == str(r)}  # fmt: skip
        assert {"A0", "A1", "A2", "A3"} <= peers
        malformed = {x.labels["peer"]: x.value for x in s["zz_agreement_malformed_drops_total"]
                     if x.labels["replica"] == str(r)}  # fmt: skip
        assert {"A0", "A1", "A2", "A3"} <= set(malformed) and not any(malformed.values())
    for i in (0, 1):
        s = scraped[svc.exec_host(config, i).name]
        assert 0 <= value(s, "zz_execution_lag_seqs", replica=str(i)) <= 2  # caught up
        assert value(s, "zz_execution_last_executed_seq", replica=str(i)) >= 1
        assert value(s, "zz_execution_asleep", replica=str(i)) == 0


# ---- one controld: wake-up histogram, drops per peer, HTTP ---------------------------------


async def _get(url: str, method: str = "GET") -> tuple[int, str]:
    def run() -> tuple[int, str]:
        req = urllib.request.Request(url, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    return await asyncio.to_thread(run)


async def test_wakeup_latency_drops_per_peer_and_http(tmp_path: Path) -> None:
    rack: Rack = make_rack(tmp_path)
    async with nodes(rack, "process", 0) as (h0,):
        st = await h0.rpc("status")
        url = st["metrics"]["url"]
        assert url and st["metrics"]["error"] is None
        assert (await h0.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        forged = bytearray(rack.valid_wakeup())
        forged[-1] ^= 1
        await h0.send(bytes(forged), b"\x00" * 40, rack.valid_wakeup())
        code, text = await _get(url)
        assert code == 200
        s = parse(text)
        lab = {"host": "h0", "service": "web"}
        assert value(s, "zz_controld_wakeups_total", **lab, replica="2", mechanism="unpause") == 1
        assert value(s, "zz_controld_wakeup_seconds_count", **lab, mechanism="unpause") == 1
        wake_s = value(s, "zz_controld_wakeup_seconds_sum", **lab, mechanism="unpause")
        assert 0 < wake_s < 30
        inf = value(s, "zz_controld_wakeup_seconds_bucket", **lab, mechanism="unpause", le="+Inf")
        assert inf == 1
        # The forged WAKEUP and the garbage frame came from 127.0.0.1.
        assert value(s, "zz_controld_messages_dropped_total", host="h0", peer="127.0.0.1") == 2
        assert value(s, "zz_controld_events_total", host="h0", event="wakeup_rejected") == 1
        assert value(s, "zz_controld_replica_state", **lab, replica="2", state="recovering") == 1
        assert value(s, "zz_controld_provisioned_total", **lab, replica="2", mode="paused") == 1
        # HTTP: HEAD, 404, 405, OpenMetrics when asked for.
        assert (await _get(url, "HEAD"))[0] == 200
        assert (await _get(url.replace("/metrics", "/other")))[0] == 404
        assert (await _get(url, "POST"))[0] == 405
        om, ctype = await asyncio.to_thread(
            scrape, url, "application/openmetrics-text; version=1.0.0"
        )
        assert ctype.startswith("application/openmetrics-text") and om.rstrip().endswith("# EOF")
        c = h0.counters()
        assert c["metrics_scrapes"] >= 2


async def test_metrics_port_busy_is_not_fatal() -> None:
    import socket
    from collections import Counter

    from prometheus_client import CollectorRegistry

    from zz.controld.metrics import MetricsServer

    notes: list[str] = []
    counters: Counter[str] = Counter()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = MetricsServer(CollectorRegistry(), "127.0.0.1", counters, notes.append)
        await server.start(busy.getsockname()[1])
    assert server.url is None and server.error and "cannot listen" in server.error
    assert counters["metrics_listen_failed"] == 1 and notes == [f"metrics: {server.error}"]
    await server.close()


# ---- the mapping of the stats files -------------------------------------------------------


AGREED = {
    "id": 0, "view": 2, "in_view_change": 0, "last_exec": 120, "stable_seq": 96,
    "batches_executed": 118, "batches_proposed": 60, "requests_in": 300, "requests_dup": 4,
    "requests_readonly": 0, "view_changes": 2, "new_views": 2, "stable_advances": 3,
    "exec_stable": 96, "exec_stable_advances": 3, "exec_certificates": 110,
    "exec_mismatches": 5, "exec_timeouts": 7, "retransmits": 9, "state_transfers": 0,
    "dropped": {"auth": 3, "short": 1, "framing": 2}, "dropped_total": 6,
    "peer_window_drops": [0, 4, 0, 0], "exec_window_drops": [0, 0, 1],
    "peer_malformed_drops": [0, 0, 3, 0], "exec_malformed_drops": [2, 0, 0],
    "fault_statements_sent": 2, "fault_statements_received": 6, "fault_statements_rejected": 1,
    "wakeups_sent": 1, "wakeups_received": 2, "wakeups_rejected": 0, "wakeups_relayed": 0,
    "shutdowns_sent": 1, "shutdowns_received": 3, "shutdowns_rejected": 0,
    "spares_ready_received": 1, "spares_ready_rejected": 0, "spares_ready_held": 0,
    "detect_latency_last_ms": 640, "detect_latency_max_ms": 900,
    "exec_awake": [0, 2], "exec_sleeping": [1], "exec_convicted": [],
    "net": {"frames_in": 1000, "frames_out": 900},
}  # fmt: skip
STATUS = {
    "service": 1, "index": 2, "last_executed": 100, "stable_checkpoint": 96,
    "last_checkpoint": 96, "checkpoint_mismatches": [{"peer": 1}], "pending_seqs": 3,
    "counters": {"requests_executed": 250, "batches_executed": 100, "checkpoints": 3,
                 "recoveries": 1, "file_bytes_served": 4096},
    "recovery": {"install_ms": 1234.5, "background_s": 2.5},
    "fetch": {"bytes_fetched": 65536, "fetched_foreground": 3, "fetched_background": 7,
              "bad_content": 1, "stale_copies": 0, "kept": 12},
    "asleep": False, "recovering": True, "files_pending": 4,
}  # fmt: skip


async def test_stats_files_map_onto_families(tmp_path: Path) -> None:
    """h0 of the 3-host rack holds agreement replicas 0 and 3 and execution replica 2: fresh
    files are mapped, a stale one is only `up 0`, nothing of another host is reported."""
    rack = make_rack(tmp_path)
    config = rack.config
    svc = config.service("web")
    run = config.rack.run_dir / "s1"
    run.mkdir(parents=True, exist_ok=True)
    (run / "agreed-0.stats.json").write_text(json.dumps(AGREED))
    (run / "agreed-3.stats.json").write_text(json.dumps(AGREED))
    old = time.time() - 60
    os.utime(run / "agreed-3.stats.json", (old, old))
    (run / "agreed-1.stats.json").write_text(json.dumps(AGREED))  # h1's
    svc.exec_status_path(config, 2).write_text(json.dumps(STATUS))
    async with nodes(rack, "libvirt", 0) as (h0,):
        assert (await h0.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        await h0.send(b"\x00" * 40)  # one malformed message: a drop from 127.0.0.1
        code, text = await _get((await h0.rpc("status"))["metrics"]["url"])
    assert code == 200
    s = parse(text)
    _dashboard_uses_only(s)
    a = {"host": "h0", "service": "web", "replica": "0"}
    assert value(s, "zz_agreement_up", **a) == 1
    assert value(s, "zz_agreement_up", **{**a, "replica": "3"}) == 0
    assert {x.labels["replica"] for x in s["zz_agreement_up"]} == {"0", "3"}
    assert not [x for x in s["zz_agreement_view"] if x.labels["replica"] == "3"]
    assert value(s, "zz_agreement_view", **a) == 2
    assert value(s, "zz_agreement_view_changes_total", **a) == 2
    assert value(s, "zz_agreement_last_executed_seq", **a) == 120
    assert value(s, "zz_agreement_requests_total", **a) == 300
    assert value(s, "zz_agreement_batches_executed_total", **a) == 118
    assert value(s, "zz_agreement_checkpoints_stable_total", **a) == 3
    assert value(s, "zz_agreement_exec_mismatches_total", **a) == 5
    assert value(s, "zz_agreement_report_timers_fired_total", **a) == 7
    assert value(s, "zz_agreement_fault_statements_total", **a, direction="received") == 6
    assert value(s, "zz_agreement_wakeups_total", **a, direction="sent") == 1
    assert value(s, "zz_agreement_shutdowns_total", **a, direction="received") == 3
    assert value(s, "zz_agreement_spares_ready_total", **a, direction="received") == 1
    assert value(s, "zz_agreement_detect_latency_seconds", **a, which="max") == 0.9
    assert value(s, "zz_agreement_messages_dropped_total", **a, reason="auth") == 3
    assert value(s, "zz_agreement_window_drops_total", **a, peer="A1") == 4
    assert value(s, "zz_agreement_window_drops_total", **a, peer="E2") == 1
    assert value(s, "zz_agreement_malformed_drops_total", **a, peer="A2") == 3
    assert value(s, "zz_agreement_malformed_drops_total", **a, peer="E0") == 2
    assert value(s, "zz_agreement_malformed_drops_total", **a, peer="A1") == 0
    assert (
        len([x for x in s["zz_agreement_malformed_drops_total"] if x.labels["replica"] == "0"]) == 7
    )
    assert value(s, "zz_agreement_exec_view", **a, exec="1", state="sleeping") == 1
    e = {"host": "h0", "service": "web", "replica": "2"}
    assert {x.labels["replica"] for x in s["zz_execution_up"]} == {"2"}
    assert value(s, "zz_execution_up", **e) == 1
    assert value(s, "zz_execution_recovering", **e) == 1
    assert value(s, "zz_execution_lag_seqs", **e) == 20  # 120 ordered here, 100 executed
    assert value(s, "zz_execution_requests_executed_total", **e) == 250
    assert value(s, "zz_execution_checkpoint_mismatches", **e) == 1
    assert value(s, "zz_execution_recovery_install_seconds", **e) == 1.2345
    assert value(s, "zz_execution_fetch_bytes_total", **e) == 65536
    assert value(s, "zz_execution_fetch_files_total", **e, result="verified") == 10
    assert value(s, "zz_execution_fetch_files_total", **e, result="rejected") == 1
    assert value(s, "zz_execution_events_total", **e, event="recoveries") == 1


MONITORING = Path(__file__).resolve().parents[1] / "docs" / "monitoring"


def _dashboard_uses_only(s: Samples) -> None:
    """Every metric the shipped Grafana dashboard queries is one controld serves (a family
    declared without samples yet counts with its _total/_bucket/_count/_sum names)."""
    import re

    served = set(s)
    for name in list(s):
        served |= {name + suffix for suffix in ("_total", "_bucket", "_count", "_sum")}
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    used = {m for e in exprs for m in re.findall(r"\bzz_[a-z_]+", e)}
    assert used and used <= served, used - served
    # The scrape config is valid YAML with a job per controld target.
    import yaml  # the test extra (pyproject.toml)
    conf = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    job = conf["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
