# tests/test_controld_agreed.py - controld starts, stops and watches the agreement replicas
# placed on its host (controld/agreed.py) over its authenticated RPC: forged and bad requests
# refused and counted, a replica that dies reported and not restarted, adoption after a
# controld restart; real zz-agreed, plus a stand-in binary for the fast checks. And a
# controld that does not answer is named by zz rack (zz/rackctl.py).
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_controld_daemon import OP, Node, Rack, close_keeping_backend, make_rack
from tests.test_execution_runtime import needs_agreed
from zz import keys, rackctl, wire
from zz.config import Config, load
from zz.controld.rpc import call
from zz.procrack import DEFAULT_AGREED, REPO, start_ticks

# A stand-in for zz-agreed in the fast tests (the real one is in the others): listens where
# its replica file says, rewrites its stats file every 0.1 s, writes it once more on SIGTERM.
FAKE_AGREED = """\
import json, os, signal, socket, sys, time
conf = dict(line.split(None, 1) for line in open(sys.argv[2]).read().splitlines()
            if line and not line.startswith("#") and len(line.split(None, 1)) == 2)
host, port = conf["listen"].split()
stats = conf["stats_file"]
def write(final=False):
    tmp = stats + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"view": 0, "last_exec": 7, "stable_seq": 0, "final": final}, fh)
    os.replace(tmp, stats)
def term(*_):
    write(final=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, int(port)))
s.listen()
s.settimeout(0.1)
print("fake zz-agreed listening on", host, port, flush=True)
while True:
    write()
    try:
        s.accept()[0].close()
    except OSError:
        pass
"""


def fake_agreed(tmp: Path) -> Path:
    path = tmp / "fake-zz-agreed"
    path.write_text(f"#!{sys.executable}\n{FAKE_AGREED}")
    path.chmod(0o755)
    return path


@contextlib.asynccontextmanager
async def node(rack: Rack, binary: Path, host: int = 0) -> AsyncIterator[Node]:
    """controld of `host` in-process on the process backend; every agreement replica it
    started is stopped at the end, whatever happened."""
    n = Node(rack, host, "process", agreed=binary)
    try:
        await n.start()
        yield n
    finally:
        ag = n.daemon.agreed
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ag.stop, list(ag.records), 5.0, True)
        await n.close()


def mine(n: Node) -> list[int]:
    """The agreement replicas of `web` placed on this node's host."""
    return [r for svc, r in n.daemon.agreed.placed() if svc.name == "web"]


def entry(listed: dict[str, Any], r: int) -> dict[str, Any]:
    return next(e for e in listed["agreed"] if e["name"] == f"web/agreed-{r}")


async def wait_for(what: str, pred: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = await pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


# ---- fast: the stand-in binary ----------------------------------------------------------
async def test_forged_and_bad_agreed_requests_are_refused_and_counted(tmp_path: Path) -> None:
    rack = make_rack(tmp_path)
    async with node(rack, fake_agreed(tmp_path)) as n:
        r = mine(n)[0]
        key = rack.op_keys[n.principal]
        start = {"op": "agreed_start", "service": "web", "replica": r}
        # Forged: a MAC under a wrong key, an unknown operator. No reply, counted, nothing runs.
        for sender, k in ((OP, bytes(32)), (OP + 1, key)):
            m = wire.Control(0, sender, time.time_ns(), json.dumps(start).encode())
            await n.send(m.with_macs({n.principal: k}).encode())
        c = n.counters()
        assert c["control_bad_mac"] == 1 and c["control_unknown_principal"] == 1, c
        assert n.daemon.agreed.records == {}
        # A replayed request id: refused with an authenticated answer, started once only.
        rid = time.time_ns()
        kw: dict[str, Any] = dict(operator=OP, controld=n.principal, key=key, request_id=rid)
        first = await call("127.0.0.1", n.port, op={**start, "op": "agreed_stop"}, **kw)
        again = await call("127.0.0.1", n.port, op=start, **kw)
        assert first["ok"] and first["stopped"] == [], first
        assert not again["ok"] and "reused" in again["error"], again
        assert n.counters()["control_replayed"] == 1
        # Authentic but wrong: each refused naming what is wrong, counted, nothing runs.
        elsewhere = next(x for x in range(4) if x not in mine(n))
        host = rack.config.replica_host(rack.config.service("web"), elsewhere).name
        bad: list[tuple[dict[str, Any], str]] = [
            ({"service": "web", "replica": elsewhere}, f"placed on host {host}, not h0"),
            ({"service": "web", "replica": 4}, "replica must be an integer in 0..3"),
            ({"service": "web", "replica": True}, "replica must be an integer"),
            ({"service": "nope", "replica": r}, "unknown service 'nope'"),
            ({"service": "web", "replica": r, "overrides": [1]}, "overrides must be an object"),
            ({"service": "web", "replica": r, "overrides": {"nonsense": 1}},
             "not a replica-file key"),
            ({"service": "web", "replica": r, "overrides": {"detect_floor_ms": {"x": 1}}},
             "replica numbers to values"),
            ({"service": "web", "replica": r, "wait_s": float("nan")}, "wait_s"),
            ({"service": "web", "replica": r, "wait_s": 1e9}, "wait_s: must be in 0..600"),
        ]  # fmt: skip
        for params, why in bad:
            reply = await n.rpc("agreed_start", **params)
            assert not reply["ok"] and why in reply["error"], (params, reply)
        for op, params, why in [
            ("agreed_stop", {"replica": r}, "replica needs its service"),
            ("agreed_stop", {"kill": "yes"}, "kill must be true or false"),
            ("agreed_stop", {"timeout_s": -1}, "timeout_s: must be in"),
            ("agreed_log", {"service": "web", "replica": r, "lines": 0}, "lines must be"),
            ("agreed_log", {"service": "web", "replica": elsewhere}, "placed on host"),
        ]:
            reply = await n.rpc(op, **params)
            assert not reply["ok"] and why in reply["error"], (op, params, reply)
        assert n.counters()["control_failed"] == len(bad) + 5
        listed = await n.rpc("agreed_list")
        assert [e["state"] for e in listed["agreed"]] == ["not started"] * len(mine(n))
        assert n.daemon.agreed.records == {} and n.counters().get("internal_error", 0) == 0


async def test_agreed_start_stop_list_log_and_a_death_reported_not_restarted(
    tmp_path: Path,
) -> None:
    rack = make_rack(tmp_path)
    async with node(rack, fake_agreed(tmp_path)) as n:
        r = mine(n)[0]
        got = await n.rpc("agreed_start", service="web", replica=r,
                          overrides={"detect_floor_ms": {str(r): 1234}})  # fmt: skip
        assert got["ok"], got
        pid, ticks = got["agreed"]["pid"], got["agreed"]["ticks"]
        assert start_ticks(pid) == ticks
        conf = rack.config.rack.run_dir / "s1" / f"agreed-{r}.conf"
        assert "detect_floor_ms 1234" in conf.read_text(), "rendered here, with the override"
        twice = await n.rpc("agreed_start", service="web", replica=r)
        assert not twice["ok"] and f"runs already (pid {pid})" in twice["error"]

        async def current() -> dict[str, Any] | None:
            e = entry(await n.rpc("agreed_list"), r)
            return e if e["stats_current"] else None

        e = await wait_for("stats written by the process", current)
        assert (e["state"], e["pid"], e["stats"]["last_exec"]) == ("running", pid, 7), e
        assert e["rss_mib"] and e["stats_age_s"] < 5 and e["on_disk"] is False
        log = await n.rpc("agreed_log", service="web", replica=r, lines=5)
        assert any("fake zz-agreed listening" in line for line in log["lines"]), log
        status = await n.rpc("status")
        assert entry(status, r)["state"] == "running"

        # It dies: reported with its status, counted, noted, and not restarted.
        os.killpg(pid, signal.SIGKILL)

        async def exited() -> dict[str, Any] | None:
            e = entry(await n.rpc("agreed_list"), r)
            return e if e["state"] == "exited" else None

        e = await wait_for("the death reported", exited, 5.0)
        assert e["exit_status"] == -signal.SIGKILL and e["rss_mib"] is None, e
        assert n.counters()["agreed_exited"] == 1
        assert any(f"web/agreed-{r} (pid {pid}) exited" in x and "not restarted" in x
                   for x in n.daemon.recent)  # fmt: skip
        await asyncio.sleep(1.5)
        e = entry(await n.rpc("agreed_list"), r)
        assert e["state"] == "exited" and n.counters()["agreed_started"] == 1, e

        # Started again by the operator; the final stats come back with the stop.
        again = await n.rpc("agreed_start", service="web", replica=r)
        assert again["ok"] and again["agreed"]["pid"] != pid
        stop = await n.rpc("agreed_stop", service="web")
        assert stop["stopped"] == [f"web/agreed-{r}"] and stop["killed"] == [], stop
        assert stop["stats"][f"web/agreed-{r}"]["final"] is True, stop
        e = entry(await n.rpc("agreed_list"), r)
        assert (e["state"], e["exit_status"]) == ("stopped", 0), e
        assert start_ticks(again["agreed"]["pid"]) is None


async def test_a_restarted_controld_adopts_its_running_agreement_replicas(
    tmp_path: Path,
) -> None:
    rack = make_rack(tmp_path)
    binary = fake_agreed(tmp_path)
    pids = []
    try:
        async with node(rack, binary) as n:
            r = mine(n)[0]
            got = await n.rpc("agreed_start", service="web", replica=r)
            pid = got["agreed"]["pid"]
            pids.append(pid)
            # controld stops (as for an upgrade): the replica runs on. (The records are
            # dropped from memory only, so that the cleanup of `node` leaves it alone.)
            n.daemon.agreed.records.clear()
        assert start_ticks(pid) is not None, "an agreement replica outlives its controld"
        async with node(rack, binary) as n2:
            e = entry(await n2.rpc("agreed_list"), r)
            assert (e["state"], e["pid"], e["adopted"]) == ("running", pid, True), e
            assert any("adopted" in x for x in n2.daemon.recent)
            stop = await n2.rpc("agreed_stop", service="web", replica=r, timeout_s=10)
            assert stop["stopped"] == [f"web/agreed-{r}"], stop
            e = entry(await n2.rpc("agreed_list"), r)
            assert (e["state"], e["exit_status"]) == ("stopped", None), e  # not its child
        assert start_ticks(pid) is None
    finally:
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p, signal.SIGKILL)


# ---- the real zz-agreed ------------------------------------------------------------------
@needs_agreed
async def test_real_agreement_replica_started_watched_and_stopped_by_controld(
    tmp_path: Path,
) -> None:
    """One real zz-agreed (its peers absent: it listens, waits for them and writes its
    stats): started through the RPC, its stats and log read back, a SIGKILL reported as
    its death and not restarted, started again, stopped with its last stats returned."""
    assert DEFAULT_AGREED.exists(), "make -C agreement"
    rack = make_rack(tmp_path)
    async with node(rack, DEFAULT_AGREED) as n:
        r = mine(n)[0]
        name = f"web/agreed-{r}"
        got = await n.rpc("agreed_start", service="web", replica=r, wait_s=30)
        assert got["ok"], got
        pid = got["agreed"]["pid"]

        async def current() -> dict[str, Any] | None:
            e = entry(await n.rpc("agreed_list"), r)
            return e if e["stats_current"] else None

        e = await wait_for("its stats", current)
        assert e["state"] == "running" and e["stats"]["last_exec"] == 0, e
        assert e["stats"]["view"] == 0 and e["stats_age_s"] < 5, e
        log = await n.rpc("agreed_log", service="web", replica=r, lines=20)
        assert log["ok"] and log["name"] == name and log["lines"], log

        os.killpg(pid, signal.SIGKILL)

        async def exited() -> dict[str, Any] | None:
            e = entry(await n.rpc("agreed_list"), r)
            return e if e["state"] == "exited" else None

        e = await wait_for("its death reported", exited, 5.0)
        assert e["exit_status"] == -signal.SIGKILL and n.counters()["agreed_exited"] == 1, e
        await asyncio.sleep(1.0)
        assert entry(await n.rpc("agreed_list"), r)["state"] == "exited", "not restarted"

        again = await n.rpc("agreed_start", service="web", replica=r, wait_s=30)
        assert again["ok"], again
        pid2 = again["agreed"]["pid"]
        await wait_for("stats again", current)
        stop = await n.rpc("agreed_stop", service="web", replica=r, timeout_s=15)
        assert stop["stopped"] == [name] and stop["killed"] == [], stop
        assert stop["stats"][name]["last_exec"] == 0, stop
        e = entry(await n.rpc("agreed_list"), r)
        assert (e["state"], e["exit_status"]) == ("stopped", 0), e
        assert start_ticks(pid2) is None


# ---- halt: controld destroys its own domains (zz rack stop / down) ----------------------
async def test_halt_destroys_this_hosts_domains_and_keeps_the_records(tmp_path: Path) -> None:
    """libvirt test:///default: a forged halt destroys nothing; an authentic one destroys
    the replica's domain and a stray zz-<rack>-* domain, and keeps the record (`list`: gone,
    inconsistent), so `zz rack start` provisions it again."""
    pytest.importorskip("libvirt")
    from zz.controld.hypervisor import ReplicaSpec, open_backend

    rack = make_rack(tmp_path)
    svc = rack.config.service("web")
    i = next(x for x in range(svc.n_exec) if svc.exec_host(rack.config, x).index == 0)
    keep = open_backend("libvirt", uri="test:///default")  # stands for libvirtd
    n = Node(rack, 0, "libvirt")
    try:
        await n.start()
        got = await n.rpc("provision", service="web", index=i, mode="paused")
        assert got["ok"], got
        domain = got["replica"]["domain"]
        stray = ReplicaSpec(f"zz-{rack.config.rack.name}-stray", tmp_path)
        keep.create(stray)
        forged = wire.Control(0, OP, time.time_ns(), json.dumps({"op": "halt"}).encode())
        await n.send(forged.with_macs({n.principal: bytes(32)}).encode())
        assert n.counters()["control_bad_mac"] == 1
        assert {domain, stray.name} <= set(keep.list()), "a forged halt destroyed something"
        halted = await n.rpc("halt")
        assert halted["ok"] and sorted(halted["destroyed"]) == sorted([domain, stray.name])
        assert halted["failed"] == [] and not {domain, stray.name} & set(keep.list())
        listed = (await n.rpc("list"))["replicas"]
        assert [(r["index"], r["state"], r["hv_state"], r["consistent"]) for r in listed] == [
            (i, "paused", "gone", False)
        ], listed
    finally:
        await n.close()
        close_keeping_backend(keep, rack)


# ---- exec_status: the runtimes' status files, read by their host's controld ----------------
async def test_exec_status_returns_the_runtimes_status_files(tmp_path: Path) -> None:
    """The real runtime (process backend), provisioned active: its status file comes back
    through `exec_status` and `status` (`zz rack up` waits for its links this way); a slot
    with no runtime has none; a slot of another host is not listed."""
    rack = make_rack(tmp_path)
    svc = rack.config.service("web")
    i = next(x for x in range(svc.n_exec) if svc.exec_host(rack.config, x).index == 0)
    async with node(rack, fake_agreed(tmp_path)) as n:
        before = await n.rpc("exec_status")
        assert before["runtimes"] == [
            {"service": "web", "index": i, "status": None, "status_age_s": None,
             "status_written_at": None, "checkpoint": None}
        ], before
        got = await n.rpc("provision", service="web", index=i, mode="active")
        assert got["ok"], got

        async def written() -> dict[str, Any] | None:
            e = (await n.rpc("exec_status"))["runtimes"][0]
            return e if e["status"] is not None else None

        e = await wait_for("its status file", written, 30.0)
        assert e["status"]["agreement_links_up"] == 0, e  # no agreement replica runs here
        assert 0 <= e["status_age_s"] < 5, e
        assert (await n.rpc("status"))["runtimes"][0]["index"] == i


# ---- a controld that does not answer is named --------------------------------------------
@pytest.fixture
def silent_rack(tmp_path: Path) -> Iterator[tuple[Config, list[subprocess.Popen[bytes]]]]:
    """A recorded rack whose two "controlds" run (as far as their pids go) but listen
    nowhere: stand-in processes named by rack.json, ended at the end."""
    from tests.test_rackctl import write_rack

    config = load(write_rack(tmp_path, hosts=2))
    keys.generate(config)
    procs = [subprocess.Popen(["sleep", "300"], start_new_session=True) for _ in config.hosts]
    state = rackctl.RackState(config.rack.name, str(config.path), "process", "dir", time.time())
    for h, p in zip(config.hosts, procs, strict=True):
        ticks = start_ticks(p.pid)
        assert ticks is not None
        state.procs.append(rackctl.ProcRecord("controld", h.name, p.pid, ticks, "/dev/null",
                                              h.address, h.control_port))  # fmt: skip
    state.complete = True
    rackctl._save_state(config, state)
    try:
        yield config, procs
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


def test_a_controld_that_does_not_answer_is_named(
    silent_rack: tuple[Config, list[subprocess.Popen[bytes]]],
) -> None:
    config, _ = silent_rack
    entries, silent = rackctl.agreed_states(config, timeout=2.0)
    assert entries == {} and sorted(silent) == ["h0", "h1"]
    assert all("cannot connect to controld" in why for why in silent.values()), silent
    # `up` on it would repair it: it cannot see the agreement replicas, and says whose.
    with pytest.raises(rackctl.RackError, match=r"controld h0 does not answer .*controld h1"
                       r" does not answer .*cannot see the agreement replicas"):  # fmt: skip
        rackctl.up(config, agreed=DEFAULT_AGREED if DEFAULT_AGREED.exists() else Path("/bin/true"))
    # zz status: both named, the rack degraded.
    out = subprocess.run([sys.executable, "-m", "zz", "status", str(config.path), "--json",
                          "--timeout", "2"], capture_output=True, text=True, timeout=60,
                         cwd=REPO)  # fmt: skip
    doc = json.loads(out.stdout)
    assert doc["health"] == "degraded", doc
    named = [p for p in doc["problems"] if "not answering" in p]
    assert [p.split()[1] for p in named] == ["h0", "h1"], doc["problems"]
    svc = config.services[0]
    assert {x["replica"]: x["state"] for x in doc["replicas"]} == {
        **{f"A{r}": "?" for r in range(svc.n)}, **{f"E{i}": "?" for i in range(svc.n_exec)}
    }, doc["replicas"]
    # stop: the agreement replicas not stopped by whom, named; the stand-ins are stopped.
    lines: list[str] = []
    report = rackctl.stop(config, progress=lines.append)
    assert sorted(report.unanswered)[0].startswith("controld h0 does not answer (cannot"), report
    assert len(report.unanswered) == 2 and sorted(report.stopped) == ["h0", "h1"], report
    assert any(line.startswith(f"rack {config.rack.name!r}: controld h1 does not answer")
               for line in lines), lines  # fmt: skip
