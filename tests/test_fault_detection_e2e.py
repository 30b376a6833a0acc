# tests/test_fault_detection_e2e.py - fault detection end to end (ZZ §4.3): 4 zz-agreed, f = g = 1,
# two active execution replicas and a spare that sleeps (SIGSTOP) from the start. A test-side
# controld verifies every WAKEUP with zz/certs.py and wakes (SIGCONT) the spare it names, and
# kills the convicted replica once a SHUTDOWN certificate (g+1 identical votes) arrives.
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import socketserver
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import SERVICE_ID, Cluster, _port_free
from tests.test_execution_runtime import KV_GET, KV_PUT, ExecReplicas, Rig, _kv, _kv_ok
from zz import certs, wire
from zz.atomicfile import write_atomic
from zz.client import ClientParams
from zz.crypto import sha256
from zz.procrack import signal_group

SPARE = 2
# Large enough that no execution checkpoint becomes stable during a test: the agreement
# replicas then still hold the committed log since seq 0 (xlog.c collects it only at a
# stable execution checkpoint), which is what the spare that slept since start replays.
CP = 1024
# The timer floor stays well above scheduling noise on a loaded 2-core machine, so that
# correct replicas are never late (docs/fault-detection.md §6) and only the faults count.
FAST = {"detect_k": 4, "detect_floor_ms": 300, "detect_ceiling_ms": 1000}


@dataclass
class FakeControld:
    """Listens on the host's controld port; acts only on verified certificates."""

    cluster: Cluster
    execs: ExecReplicas
    trust: certs.ServiceTrust
    wakeups: list[certs.Wakeup] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    votes: int = 0
    shutdowns: list[certs.Shutdown] = field(default_factory=list)
    woken_at: dict[int, float] = field(default_factory=dict)
    # Seconds between a verified WAKEUP and the SIGCONT: a guest's resume and reconnect
    # take that long while the cluster goes on.
    wake_delay: float = 0.0
    # Verify and record WAKEUPs and write the wake notice, but leave the SIGCONT to the
    # test (a spare that takes as long as the test says).
    hold: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: socketserver.ThreadingTCPServer | None = None

    def __post_init__(self) -> None:
        self.collector = certs.ShutdownCollector(self.trust)

    def on_message(self, raw: bytes) -> None:
        with self.lock:
            try:
                kind = wire.decode(raw)
            except wire.WireError as e:
                self.rejected.append(f"decode: {e}")
                return
            try:
                if isinstance(kind, wire.Wakeup):
                    w = certs.verify_wakeup(
                        raw,
                        keys=self.trust.keys,
                        f=self.trust.f,
                        g=self.trust.g,
                        n_exec=self.trust.n_exec,
                        service=self.trust.service,
                    )
                    self.wakeups.append(w)
                    for i in w.wake:
                        if i not in self.woken_at and i in self.execs.procs:
                            self.woken_at[i] = time.monotonic() + self.wake_delay
                            # As controld does (actions.wake_notice): the runtime learns
                            # the round's seq, which it must recover below and replay.
                            svc, cfg = self.cluster.service, self.cluster.config
                            notice = svc.exec_state_dir(cfg, i) / "controld-wakeup.json"
                            notice.parent.mkdir(parents=True, exist_ok=True)
                            write_atomic(notice, json.dumps({
                                "service": svc.id, "index": i, "recovering_from_seq": w.seq,
                                "awake": list(w.awake), "woken_at": time.time(),
                            }) + "\n")  # fmt: skip
                            pid = self.execs.procs[i].pid
                            if self.hold:
                                pass
                            elif self.wake_delay > 0:
                                t = threading.Timer(self.wake_delay, signal_group,
                                                    (pid, signal.SIGCONT))  # fmt: skip
                                t.daemon = True
                                t.start()
                            else:
                                signal_group(pid, signal.SIGCONT)
                elif isinstance(kind, wire.Shutdown):
                    self.votes += 1
                    cert = self.collector.add(raw)
                    if cert is not None:
                        self.shutdowns.append(cert)
                        for i in cert.convict:
                            p = self.execs.procs.get(i)
                            if p is not None and p.poll() is None:
                                signal_group(p.pid, signal.SIGKILL)
                else:
                    self.rejected.append(f"unexpected {kind.NAME}")
            except certs.CertError as e:
                self.rejected.append(e.reason)

    def start(self, port: int) -> None:
        fake = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                f = self.request.makefile("rb")
                while True:
                    hdr = f.read(4)
                    if len(hdr) < 4:
                        return
                    (n,) = struct.unpack(">I", hdr)
                    if not wire.HDR_LEN <= n <= wire.MAX_MSG:
                        return
                    body = f.read(n)
                    if len(body) < n:
                        return
                    fake.on_message(body)

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


class FaultRig(Rig):
    controld: FakeControld

    def agreement(self) -> list[dict[str, Any]]:
        cl = self.cluster
        return cl.stats_all([r for r in range(cl.n) if cl.alive(r)])

    def total(self, key: str) -> int:
        return sum(s.get(key, 0) for s in self.agreement())


def _start(
    tmp_path: Path,
    args: dict[int, list[str]],
    overrides: dict[str, Any],
    per_replica: dict[int, dict[str, Any]] | None = None,
    controld_up: bool = True,
    cp: int = CP,
    f: int = 1,
    before_execs: Callable[[Cluster], None] | None = None,
) -> Iterator[FaultRig]:
    for attempt in range(20):
        cluster = Cluster(
            tmp_path / f"try{attempt}",
            checkpoint_interval=cp,
            log_window=2 * cp,
            app="kv",
            f=f,
            overrides=overrides,
            overrides_per_replica=per_replica,
        )
        ports = [a[1] for a in cluster.service.exec_addresses(cluster.config)]
        if all(_port_free(p) for p in [*ports, cluster.control_port]):
            break
    svc = cluster.service
    assert svc.active == f + 1 and svc.n_exec == 2 * f + 1
    conf = cluster.conf_path(0).read_text()
    assert f"exec {svc.active} 0 sleeping" in conf and "controld 0 127.0.0.1" in conf
    execs = ExecReplicas(cluster, args)
    rig = FaultRig(cluster, execs)
    trust = certs.ServiceTrust.load(cluster.dir / "keys", cluster.service)
    rig.controld = FakeControld(cluster, execs, trust)
    ok = False
    try:
        if controld_up:
            rig.controld.start(cluster.control_port)
        cluster.start()
        if before_execs is not None:  # e.g. what sits between a runtime and the cluster
            before_execs(cluster)
        for i in range(svc.n_exec):
            execs.start(i)
        for i in range(svc.n_exec):
            rig.wait_linked(i)
        # The spares registered (FETCH kind 3) and now sleep: no CPU, no EXEC-COMMITs.
        for i in range(svc.active, svc.n_exec):
            signal_group(execs.procs[i].pid, signal.SIGSTOP)
        yield rig
        ok = True
    finally:
        if not ok:
            print(rig.diag(), file=sys.stderr)
            print(
                f"controld: wakeups={rig.controld.wakeups} rejected={rig.controld.rejected}"
                f" shutdowns={rig.controld.shutdowns}",
                file=sys.stderr,
            )
        for p in execs.procs.values():  # a stopped process cannot act on SIGTERM
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    signal_group(p.pid, signal.SIGCONT)
        execs.close()
        cluster.__exit__(None if ok else RuntimeError, None, None)
        rig.controld.stop()


def _puts(rig: Rig, n: int, tag: str) -> list[bytes]:
    return rig.invoke_all([_kv(KV_PUT, f"{tag}{k}".encode(), b"v%d" % k) for k in range(n)])


def _wait_resolved(rig: FaultRig, convicted: int) -> certs.Shutdown:
    c = rig.controld
    rig.wait(lambda: bool(c.shutdowns), "a SHUTDOWN certificate at controld", timeout=60)
    cert = c.shutdowns[0]
    assert cert.convict == (convicted,), cert
    assert cert.active == (0, SPARE) if convicted == 1 else (1, SPARE), cert
    assert len(cert.signers) >= rig.cluster.g + 1
    rig.wait(
        lambda: all(
            s["exec_convicted"] == [convicted] and s["exec_awake"] == list(cert.active)
            for s in rig.agreement()
        ),
        "every agreement replica adopted the new awake set",
    )
    return cert


def _check_wakeup(rig: FaultRig) -> certs.Wakeup:
    c = rig.controld
    assert c.wakeups, "no verified WAKEUP"
    w = c.wakeups[0]
    assert w.wake == (SPARE,) and w.awake == (0, 1) and w.sleeping == (SPARE,)
    assert len(set(w.signers)) >= rig.cluster.g + 1
    assert not c.rejected, c.rejected
    assert all(x.seq == w.seq for x in c.wakeups)  # one round, several senders/relays
    return w


def _latency(rig: FaultRig) -> str:
    lat = [s["detect_latency_last_ms"] for s in rig.agreement() if s["wakeups_sent"]]
    return f"detection latency (flag -> WAKEUP sent) ms per sender: {lat}"


# ---- scenarios that must wake the spare -------------------------------------------------


@pytest.fixture
def wrong_rig(tmp_path: Path) -> Iterator[FaultRig]:
    yield from _start(tmp_path, {1: ["--inject-fault", "wrong-reply"]}, FAST)


@pytest.mark.slow
def test_wrong_reply_wakes_the_spare_and_is_convicted(wrong_rig: FaultRig) -> None:
    rig = wrong_rig
    t0 = time.monotonic()
    # 0 and 1 disagree: no f+1 matching REPLYs until the spare answers like replica 0.
    assert _puts(rig, 1, "w") == [_kv_ok()]
    first = time.monotonic() - t0
    w = _check_wakeup(rig)
    assert w.seq == 1
    _wait_resolved(rig, convicted=1)
    # Service goes on with 0 and the former spare; replica 1 is gone.
    assert _puts(rig, 5, "after") == [_kv_ok()] * 5
    assert rig.invoke_all([_kv(KV_GET, b"w0")]) == [_kv_ok(b"v0")]
    assert not rig.execs.alive(1)
    for s in rig.agreement():
        assert s["wakeups_rejected"] == 0 and s["fault_statements_rejected"] == 0, s
    # A replica that adopts a peer's WAKEUP before its own reports disagree signs nothing.
    assert rig.total("fault_statements_sent") >= rig.cluster.g + 1
    assert rig.total("wakeups_sent") >= 1 and rig.total("shutdowns_sent") >= rig.cluster.g + 1
    print(f"wrong reply: first result after {first:.2f} s; {_latency(rig)}")


@pytest.fixture
def late_controld_rig(tmp_path: Path) -> Iterator[FaultRig]:
    yield from _start(tmp_path, {1: ["--inject-fault", "wrong-reply"]}, FAST, controld_up=False)


@pytest.mark.slow
def test_controld_down_at_wakeup_gets_it_once_up(late_controld_rig: FaultRig) -> None:
    rig = late_controld_rig
    port = rig.cluster.control_port
    timer = threading.Timer(2.0, rig.controld.start, args=(port,))
    timer.start()
    try:
        t0 = time.monotonic()
        # Blocks until the spare answers, i.e. until the WAKEUP got through.
        assert _puts(rig, 1, "d") == [_kv_ok()]
        waited = time.monotonic() - t0
    finally:
        timer.join()
    assert waited >= 1.5, waited
    _check_wakeup(rig)
    _wait_resolved(rig, convicted=1)
    # Connection attempts failed meanwhile, were counted, and nothing else stalled.
    assert sum(s["net"]["connect_failures"] for s in rig.agreement()) >= 1
    assert rig.total("controld_sends") > rig.total("wakeups_sent") + rig.total("wakeups_relayed")
    print(f"controld up after 2 s: first result after {waited:.2f} s")


@pytest.fixture
def crash_rig(tmp_path: Path) -> Iterator[FaultRig]:
    yield from _start(tmp_path, {}, FAST)


@pytest.mark.slow
def test_crashed_replica_times_out_and_wakes_the_spare(crash_rig: FaultRig) -> None:
    rig = crash_rig
    assert _puts(rig, 3, "pre") == [_kv_ok()] * 3
    # The client has its replies before replica 1's EXEC-REPORT for seq 3 need have left:
    # killed before that, seq 3 itself times out (seen in CI). Crash it after seq 3.
    rig.wait(
        lambda: all(s.get("exec_certificates", 0) >= 3 for s in rig.agreement()),
        "seqs 1-3 certified by every agreement replica",
    )
    assert not rig.controld.wakeups
    rig.execs.kill(1)
    t0 = time.monotonic()
    assert _puts(rig, 1, "c") == [_kv_ok()]
    first = time.monotonic() - t0
    w = _check_wakeup(rig)
    assert w.seq == 4
    _wait_resolved(rig, convicted=1)
    for s in rig.agreement():
        assert s["exec_timeouts"] >= 1, s
    assert rig.invoke_all([_kv(KV_GET, b"pre2")]) == [_kv_ok(b"v2")]
    print(f"crash: first result after {first:.2f} s; {_latency(rig)}")


@pytest.fixture
def slow_rig(tmp_path: Path) -> Iterator[FaultRig]:
    # Replica 1 holds every EXEC-REPORT back 0.5 s, beyond K·t1 clamped to 100..250 ms.
    bound = {"detect_k": 4, "detect_floor_ms": 100, "detect_ceiling_ms": 250}
    yield from _start(tmp_path, {1: ["--inject-fault", "slow-report"]}, bound)


@pytest.mark.slow
def test_report_beyond_the_bound_wakes_the_spare(slow_rig: FaultRig) -> None:
    rig = slow_rig
    # Replies are not delayed, so the client is served at once by 0 and 1.
    assert _puts(rig, 1, "s") == [_kv_ok()]
    rig.wait(lambda: bool(rig.controld.wakeups), "a WAKEUP for the late replica")
    _check_wakeup(rig)
    _wait_resolved(rig, convicted=1)
    print(f"slow: {_latency(rig)}")


# ---- scenarios that must not wake anyone ---------------------------------------------------


@pytest.fixture
def late_ok_rig(tmp_path: Path) -> Iterator[FaultRig]:
    # Same 0.5 s delay, but the floor of the timer is 2 s: late, yet within the bound.
    bound = {"detect_k": 4, "detect_floor_ms": 2000, "detect_ceiling_ms": 5000}
    yield from _start(tmp_path, {1: ["--inject-fault", "slow-report"]}, bound)


def _assert_quiet(rig: FaultRig) -> None:
    time.sleep(1.0)  # anything in flight would reach controld by now
    assert not rig.controld.wakeups and not rig.controld.votes, rig.controld
    for s in rig.agreement():
        assert s["wakeups_sent"] == 0 and s["wakeups_received"] == 0, s
        assert s["exec_awake"] == [0, 1] and s["exec_sleeping"] == [SPARE], s
    assert rig.execs.status(SPARE) == {} or rig.execs.status(SPARE).get("last_executed") == 0


@pytest.mark.slow
def test_late_within_the_bound_wakes_nobody(late_ok_rig: FaultRig) -> None:
    rig = late_ok_rig
    assert _puts(rig, 4, "l") == [_kv_ok()] * 4
    rig.wait(
        lambda: all(s["exec_certificates"] >= 4 for s in rig.agreement()),
        "certificates from the slow but timely reports",
    )
    _assert_quiet(rig)
    for s in rig.agreement():
        assert s["exec_timeouts"] == 0 and s["fault_statements_sent"] == 0, s


@pytest.fixture
def byzantine_rig(tmp_path: Path) -> Iterator[FaultRig]:
    yield from _start(tmp_path, {}, FAST, {3: {"byzantine": "false-fault"}})


@pytest.mark.slow
def test_one_false_fault_statement_wakes_nobody(byzantine_rig: FaultRig) -> None:
    rig = byzantine_rig
    assert _puts(rig, 6, "b") == [_kv_ok()] * 6
    rig.wait(
        lambda: all(rig.cluster.stats(r)["fault_statements_received"] >= 6 for r in range(3)),
        "the faulty replica's statements at every correct replica",
    )
    _assert_quiet(rig)
    for r in range(3):
        s = rig.cluster.stats(r)
        assert s["fault_statements_sent"] == 0 and s["exec_certificates"] >= 6, s
    assert rig.cluster.stats(3)["fault_statements_sent"] >= 6


@pytest.fixture
def quiet_rig(tmp_path: Path) -> Iterator[FaultRig]:
    yield from _start(tmp_path, {}, FAST)


async def _spam(params: ClientParams, req: bytes, times: int) -> list[wire.ReplyAffirm]:
    """Send the same REQUEST `times` times to every agreement replica; collect answers."""
    got: list[wire.ReplyAffirm] = []
    conns = [await asyncio.open_connection(*a) for a in params.replicas]
    try:
        for _ in range(times):
            for _, w in conns:
                w.write(wire.frame(req))
            await asyncio.sleep(0.01)
        for reader, _ in conns:
            with contextlib.suppress(TimeoutError):
                while True:
                    m = wire.decode(await asyncio.wait_for(wire.read_frame(reader), 0.5))
                    if isinstance(m, wire.ReplyAffirm):
                        r = m.sender
                        assert m.verify_mac(params.principal, params.keys[r])
                        got.append(m)
    finally:
        for _, w in conns:
            w.close()
    return got


@pytest.mark.slow
def test_client_spamming_retransmissions_gets_affirms_and_wakes_nobody(
    quiet_rig: FaultRig,
) -> None:
    rig = quiet_rig
    params = ClientParams.from_config(rig.cluster.config, SERVICE_ID, 5)
    op = _kv(KV_PUT, b"spam", b"1")
    ts = time.time_ns()
    macs = {r: params.keys[r] for r in range(params.n)}
    req = wire.Request(SERVICE_ID, params.principal, ts, 0, op).with_macs(macs).encode()
    # First copy gets ordered and executed (nobody receives the execution replicas' REPLY).
    asyncio.run(_spam(params, req, 1))
    rig.wait(
        lambda: all(s["exec_certificates"] >= 1 for s in rig.agreement()),
        "the request executed and certified",
    )
    affirms = asyncio.run(_spam(params, req, 50))
    senders = {m.sender for m in affirms}
    assert len(senders) >= rig.cluster.g + 1, affirms
    assert all(m.timestamp == ts and m.client == params.principal for m in affirms)
    assert {m.result_digest for m in affirms} == {sha256(_kv_ok())}
    assert rig.total("reply_affirms_sent") >= 50
    _assert_quiet(rig)
    for s in rig.agreement():
        assert s["fault_statements_sent"] == 0 and s["exec_mismatches"] == 0, s


@pytest.mark.slow
def test_rack_controld_port_is_the_rendered_one(quiet_rig: FaultRig) -> None:
    # What the test listens on is what zz-agreed was told (docs/config.md `controld` line).
    host = quiet_rig.cluster.config.hosts[0]
    assert (
        f"controld 0 {host.address} {host.control_port}"
        in quiet_rig.cluster.conf_path(1).read_text()
    )
    with socket.create_connection(("127.0.0.1", host.control_port), timeout=2):
        pass
    assert os.path.exists(quiet_rig.cluster.stats_path(0))


def test_replica_files_name_every_execution_replica_and_controld(tmp_path: Path) -> None:
    """zz rack render: `exec I HOST active|sleeping` and `controld H ADDR PORT` lines."""
    from zz import config as zconfig
    from zz import render

    rack = tmp_path / "rack.toml"
    rack.write_text(
        """
[rack]
name = "t"
key_dir = "keys"
run_dir = "run"
"""
        + "".join(
            f'[[hosts]]\nname = "h{h}"\naddress = "127.0.0.{h + 1}"\ncontrol_port = {7100 + h}\n'
            for h in range(4)
        )
        + """
[[services]]
name = "web"
id = 3
g = 1
f = 1
app = "kv"
clients = 4
base_port = 20000

[[services]]
name = "echo"
id = 4
g = 1
f = 1
app = "echo"
clients = 4
base_port = 21000
"""
    )
    c = zconfig.load(rack)
    web = c.service("web")
    lines = render.replica_conf(c, web, 0).splitlines()
    execs = [ln for ln in lines if ln.startswith("exec ")]
    hosts = [web.exec_host(c, i).index for i in range(3)]
    assert execs == [
        f"exec 0 {hosts[0]} active",
        f"exec 1 {hosts[1]} active",
        f"exec 2 {hosts[2]} sleeping",
    ]
    assert [ln for ln in lines if ln.startswith("controld ")] == [
        f"controld {h} 127.0.0.{h + 1} {7100 + h}" for h in range(4)
    ]
    # The echo app runs inside the agreement replicas: nothing to wake, no such lines.
    echo = render.replica_conf(c, c.service("echo"), 0)
    assert "exec " not in echo and "controld " not in echo


def _sign_key(cluster: Cluster, r: int) -> Any:
    from zz import keys

    sk = keys.load_secret(keys.secret_path(cluster.dir / "keys", SERVICE_ID, r)).sign
    assert sk is not None
    return sk


def _send(port: int, msgs: list[bytes]) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for m in msgs:
            s.sendall(wire.frame(m))
        time.sleep(0.3)  # let the replica read them before the connection goes


@pytest.mark.slow
def test_forged_wakeups_are_rejected(quiet_rig: FaultRig) -> None:
    """WAKEUPs that fail verification never change a replica's awake set nor reach
    controld, whoever signs the outer message (here: replica 3's own key)."""
    rig = quiet_rig
    cl = rig.cluster
    assert _puts(rig, 2, "q") == [_kv_ok()] * 2
    keys = {r: _sign_key(cl, r) for r in range(cl.n)}
    da, db = sha256(b"digest a"), sha256(b"digest b")
    row = [wire.RowEntry(0, wire.ROW_ONTIME, da), wire.RowEntry(1, wire.ROW_ONTIME, db)]

    def stmt(signer: int, key: int | None = None, seq: int = 1) -> bytes:
        m = wire.FaultStatement(SERVICE_ID, signer, seq, row)
        return m.signed(keys[signer if key is None else key]).encode()

    def wakeup(
        ev: list[bytes], wake: list[int], key: int = 3, sleeping: tuple[int, ...] = (SPARE,)
    ) -> bytes:
        m = wire.Wakeup(SERVICE_ID, 3, 1, ev, list(sleeping), wake)
        return m.signed(keys[key]).encode()

    bad = {
        "forged evidence signature": wakeup([stmt(1), stmt(2, key=0)], [SPARE]),
        "one statement only": wakeup([stmt(1)], [SPARE]),
        "the same signer twice": wakeup([stmt(1), stmt(1)], [SPARE]),
        "evidence about another seq": wakeup([stmt(1), stmt(2, seq=2)], [SPARE]),
        "wake is not the rules' choice": wakeup([stmt(1), stmt(2)], []),
        # sleeping [] hides the spare: a round that wakes nobody over two awake (f = 1) is
        # not justified (docs/fault-detection.md §4a)
        "a round that wakes nobody over f+1 awake": wakeup([stmt(1), stmt(2)], [], sleeping=()),
        "a round that wakes nobody on one statement": wakeup([stmt(1)], [], sleeping=()),
    }
    outer_forged = wakeup([stmt(1), stmt(2)], [SPARE], key=2)  # claims sender 3
    before = [cl.stats(r) for r in (0, 1)]
    for port in (cl.port(0), cl.port(1)):
        _send(port, [*bad.values(), outer_forged])
    rig.wait(
        lambda: all(cl.stats(r)["wakeups_rejected"] >= len(bad) for r in (0, 1)),
        "every forged WAKEUP rejected",
    )
    for r, b in zip((0, 1), before, strict=True):
        s = cl.stats(r)
        assert s["wakeups_rejected"] == len(bad), s
        assert s["dropped"]["auth"] == b["dropped"]["auth"] + 1, s  # the outer forgery
        assert s["wakeups_received"] == 0 and s["fault_round_open"] == 0, s
        assert s["exec_awake"] == [0, 1], s
        log = cl.log_path(r).read_text()
        assert "rejected: evidence signature" in log and "duplicate-signer" in log, log[-3000:]
        assert "rejected: empty-round" in log, log[-3000:]
    _assert_quiet(rig)
