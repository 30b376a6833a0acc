# tests/test_status.py - `zz status` over a running rack (real zz-agreed + execution replicas):
# roles, hosts and states are right, a dead replica shows as down, faults are shown; on a rack
# brought up by zz rack up: exit 0 healthy, 1 degraded (a replica or a controld down, a spare
# missing), 2 not running, and the same in --json.
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_execution_faults import start_rig
from tests.test_execution_runtime import KV_PUT, Rig, _kv, needs_agreed
from tests.test_rackctl import leftovers, write_rack
from zz import rackctl
from zz.config import Config, load
from zz.status import format_rows, rack_status


@pytest.fixture
def rig3(tmp_path: Path) -> Iterator[Rig]:
    yield from start_rig(tmp_path, [0, 1, 2], {2: ["--inject-fault", "wrong-reply"]})


@pytest.mark.slow
def test_status_shows_roles_states_and_faults(rig3: Rig) -> None:
    rig = rig3
    rig.invoke_all([_kv(KV_PUT, b"k%d" % k, b"v") for k in range(6)])
    rig.wait(
        lambda: all(rig.cluster.stats(r)["exec_mismatches"] >= 1 for r in range(4)),
        "mismatches seen",
    )
    time.sleep(1.2)  # every status file rewritten since
    rows = {r.replica: r for r in rack_status(rig.cluster.config)}
    assert [k for k in rows if k.startswith("A")] == ["A0", "A1", "A2", "A3"]
    assert rows["A0"].role == "primary" and rows["A1"].role == "backup"
    assert all(rows[f"A{r}"].state == "up" for r in range(4))
    assert "mismatch" in rows["A1"].detail
    assert rows["E0"].role == "active" and rows["E0"].state == "up"
    assert rows["E2"].state == "up"  # started here although it is the spare's index
    text = format_rows(list(rows.values()))
    assert text.splitlines()[0].split()[:3] == ["SERVICE", "REPLICA", "ROLE"]
    cli = subprocess.run(
        [sys.executable, "-m", "zz", "status", str(rig.cluster.config_path), "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    # This rig runs no controld, and only a host's controld answers for its replicas: zz
    # status sees none of them (it reads no replica's files) and says why.
    doc = json.loads(cli.stdout)
    assert cli.returncode == 2 and doc["health"] == "not running", cli
    assert [(c["host"], c["answering"]) for c in doc["controlds"]] == [("h0", False)], doc
    assert "cannot connect to controld" in doc["controlds"][0]["error"], doc
    assert doc["replicas"] == [], doc
    # A killed agreement replica goes stale and is shown as down.
    rig.cluster.kill(3)
    time.sleep(2.2)
    rows = {r.replica: r for r in rack_status(rig.cluster.config, stale_after=2.0)}
    assert rows["A3"].state == "down" and rows["A2"].state == "up"


# ---- exit codes and --json on a rack of zz rack up ---------------------------------------
def _status(config: Config, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zz", "status", str(config.path), "--stale-after", "2", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _doc(config: Config) -> dict[str, Any]:
    r = _status(config, "--json")
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == r.returncode, (doc, r.stderr)
    return dict(doc)


@needs_agreed
@pytest.mark.slow
def test_status_exit_codes_healthy_degraded_not_running(tmp_path: Path) -> None:
    config = load(write_rack(tmp_path))
    svc = config.services[0]
    try:
        # Not up yet: exit 2, and no planned role shown as if it ran.
        r = _status(config)
        assert r.returncode == 2 and "not running" in r.stdout, r
        assert "primary" not in r.stdout and "sleeping" not in r.stdout
        doc = _doc(config)
        assert (doc["running"], doc["health"], doc["replicas"]) == (False, "not running", [])

        state = rackctl.up(config)
        r = _status(config)
        assert r.returncode == 0, r
        assert r.stdout.splitlines()[-1] == f"rack {config.rack.name!r}: healthy", r.stdout
        controld_lines = [ln for ln in r.stdout.splitlines() if ln.split()[1:2] == ["controld"]]
        assert len(controld_lines) == len(config.hosts), r.stdout
        doc = _doc(config)
        assert (doc["schema"], doc["health"], doc["problems"]) == ("zz-status/1", "healthy", [])
        kinds = [x["kind"] for x in doc["replicas"]]
        assert kinds == ["agreement"] * svc.n + ["execution"] * svc.n_exec
        assert all(c["answering"] and c["error"] is None for c in doc["controlds"])
        assert sum(len(c["replicas"]) for c in doc["controlds"]) == svc.n_exec
        spare = next(x for x in doc["replicas"] if x["replica"] == f"E{svc.n_exec - 1}")
        assert (spare["role"], spare["state"]) == ("sleeping", "paused"), spare
        assert doc["recorded"]["alive"] == len(state.procs) and doc["recorded"]["unknown"] == []
        # -q: nothing on stdout, the exit code says it; -v: the metrics URLs too.
        r = _status(config, "-q")
        assert (r.returncode, r.stdout) == (0, ""), r
        r = subprocess.run([sys.executable, "-m", "zz", "-v", "status", str(config.path)],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0 and f"controld h0: {config.hosts[0].metrics_url}" in r.stdout

        # An agreement replica killed: degraded, naming it.
        agreed = state.proc(f"{svc.name}/agreed-3")
        os.kill(agreed.pid, signal.SIGKILL)
        time.sleep(2.5)
        doc = _doc(config)
        assert doc["exit_code"] == 1 and doc["health"] == "degraded"
        assert doc["problems"] == [f"{svc.name}/A3 down (agreement replica on h3)"], doc
        # The spare gone from its controld: a spare missing.
        sp = svc.n_exec - 1
        host = svc.exec_host(config, sp)
        reply = asyncio.run(rackctl.operator_call(
            config, host, {"op": "destroy", "service": svc.name, "index": sp}, timeout=60))
        assert reply["ok"], reply
        # A controld killed: its row says it does not answer.
        ctl = state.proc("h0")
        os.kill(ctl.pid, signal.SIGKILL)
        r = _status(config)
        assert r.returncode == 1, r
        assert f"{svc.name}/E{sp} spare missing (not in controld {host.name}'s inventory)" in (
            r.stdout.splitlines()[-1]
        ), r.stdout
        row = next(ln for ln in r.stdout.splitlines() if ln.split()[1:4] == ["controld", "-", "h0"])
        assert "not answering" in row, r.stdout
        doc = _doc(config)
        h0 = next(c for c in doc["controlds"] if c["host"] == "h0")
        assert h0["answering"] is False and h0["error"], h0
        # Its agreement replicas are unknown, not down: only their controld could say.
        on_h0 = [x for x in doc["replicas"] if x["kind"] == "agreement" and x["host"] == "h0"]
        assert on_h0 and all(x["state"] == "?" for x in on_h0), on_h0
        assert doc["recorded"]["unknown"] == [p.name for p in state.agreed() if p.host == "h0"]
        assert any(p.startswith("controld h0 not answering") for p in doc["problems"]), doc
        assert len(doc["problems"]) == 3, doc["problems"]
    finally:
        rackctl.down(config)
        for pid in leftovers(config):
            os.kill(pid, signal.SIGKILL)
    # Down: not running at once (the stats files it left are from before the down).
    r = _status(config)
    assert r.returncode == 2 and "not running" in r.stdout, r
    assert _doc(config)["replicas"] == []
