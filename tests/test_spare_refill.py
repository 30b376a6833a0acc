# tests/test_spare_refill.py - closing the fault-handling loop end to end (docs/fault-detection.md
# "In zz-agreed"): a wrong reply wakes the spare and convicts the faulty replica; the agreement
# replicas adopt a certified outcome over their own; a restarted zz-agreed keeps its view; the
# re-provisioned replica is announced with a real SPARE-READY (controld/announce.py), sleeps
# again in every agreement replica's view, and a second fault wakes it.
from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster import SERVICE_ID
from tests.test_execution_runtime import KV_GET, _kv, _kv_ok
from tests.test_fault_detection_e2e import (
    FAST,
    SPARE,
    FaultRig,
    _check_wakeup,
    _puts,
    _start,
    _wait_resolved,
)
from zz import keys, wire
from zz.controld.announce import Announcer, spare_ready
from zz.crypto import SigningKey
from zz.ports import free_base
from zz.procrack import signal_group


@pytest.fixture
def refill_rig(tmp_path: Path) -> Iterator[FaultRig]:
    yield from _start(tmp_path, {1: ["--inject-fault", "wrong-reply"]}, FAST)


def _send(port: int, *msgs: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for m in msgs:
            s.sendall(wire.frame(m))


def _replica_key(rig: FaultRig, r: int) -> SigningKey:
    sec = keys.load_secret(keys.secret_path(rig.cluster.dir / "keys", SERVICE_ID, r))
    assert sec.sign is not None
    return sec.sign


def _log(rig: FaultRig, r: int) -> str:
    return rig.cluster.log_path(r).read_text(errors="replace")


@pytest.mark.slow
def test_spare_is_refilled_and_woken_again(refill_rig: FaultRig) -> None:
    rig = refill_rig
    c = rig.cluster
    svc = c.service
    # 1. wrong reply -> WAKEUP -> SHUTDOWN convicts replica 1
    assert _puts(rig, 1, "w") == [_kv_ok()]
    _check_wakeup(rig)
    cert = _wait_resolved(rig, convicted=1)
    seq = cert.seq

    # 2. Replica 3's own outcome is outvoted: SHUTDOWNs for another outcome of the same
    # round, signed by 0, 1 and 2, are a certificate its own body does not have; it adopts
    # it. The true outcome from the same three then wins back (it is certified, ours is not).
    def shutdowns(convict: list[int], active: list[int]) -> list[bytes]:
        return [
            wire.Shutdown(SERVICE_ID, r, seq, list(cert.awake), convict, [], active)
            .signed(_replica_key(rig, r))
            .encode()
            for r in (0, 1, 2)
        ]

    _send(c.port(3), *shutdowns([0], [1, SPARE]))
    rig.wait(
        lambda: c.stats(3)["exec_convicted"] == [0] and c.stats(3)["exec_awake"] == [1, SPARE],
        "replica 3 adopted the certified outcome over its own",
    )
    assert c.stats(3)["shutdowns_adopted_over_own"] == 1
    assert "over our own outcome" in _log(rig, 3)
    _send(c.port(3), *shutdowns(list(cert.convict), list(cert.active)))
    rig.wait(
        lambda: (
            c.stats(3)["exec_convicted"] == [1] and c.stats(3)["shutdowns_adopted_over_own"] == 2
        ),
        "replica 3 back on the certificate the others hold",
    )
    for r in (0, 1, 2):
        assert c.stats(r)["shutdowns_adopted_over_own"] == 0

    # 3. A restarted zz-agreed starts from its exec_view file, not from its replica file.
    view = c.run_dir / "agreed-3.exec-view"
    assert f"exec 1 convicted {seq}" in view.read_text()
    c.kill(3)
    c.start(3)
    rig.wait(
        lambda: (
            c.stats(3).get("exec_convicted") == [1]
            and c.stats(3).get("exec_awake") == [0, SPARE]
            and c.stats(3).get("exec_sleeping") == []
        ),
        "restarted replica 3 shows the post-SHUTDOWN view",
    )
    assert f"view from {view}" in _log(rig, 3)

    # 4. controld re-provisions 1: a fresh state, no injected fault, registered, then asleep.
    rig.execs.procs[1].wait(timeout=10)  # SIGKILLed by the test's controld at the SHUTDOWN
    shutil.rmtree(svc.exec_state_dir(c.config, 1), ignore_errors=True)
    rig.execs.args[1] = []
    rig.execs.start(1)
    rig.wait_linked(1)
    signal_group(rig.execs.procs[1].pid, signal.SIGSTOP)

    # Bad announcements change nothing: a forged signature, a controld of another host, and
    # a seq that is not the conviction's (an old SPARE-READY replayed).
    host0 = c.config.hosts[0]
    ctl_key = keys.load_secret(
        keys.secret_path(c.dir / "keys", keys.RACK_SERVICE, keys.controld_principal(0))
    ).sign
    assert ctl_key is not None
    forged = spare_ready(host0, SigningKey(bytes(32)), svc, 1, seq)
    other_host = wire.SpareReady(SERVICE_ID, keys.controld_principal(5), 1, seq)
    old = spare_ready(host0, ctl_key, svc, 1, 0)
    for r in range(c.n):
        _send(c.port(r), forged, other_host.signed(ctl_key).encode(), old)
    rig.wait(
        lambda: all(s["spares_ready_rejected"] == 3 for s in rig.agreement()),
        "bad SPARE-READYs rejected and counted",
    )
    assert all(s["exec_convicted"] == [1] for s in rig.agreement())
    log0 = _log(rig, 0)
    for why in ("signature", "not the controld of the replica's host", "not the conviction's"):
        assert why in log0, why

    # The real one, sent the way controld sends it after re-provisioning.
    counters: Counter[str] = Counter()
    notes: list[str] = []

    async def announce() -> None:
        a = Announcer(c.config, host0, ctl_key, counters, notes.append)
        a.announce(svc, 1, seq)
        await asyncio.wait_for(a.idle(), 30)

    asyncio.run(announce())
    assert counters["spare_ready_sent"] == c.n, (counters, notes)
    rig.wait(
        lambda: all(
            s["exec_sleeping"] == [1] and s["exec_convicted"] == [] and s["spares_ready_received"]
            for s in rig.agreement()
        ),
        "every agreement replica counts replica 1 as a sleeping spare again",
    )
    assert f"exec 1 sleeping {seq}" in view.read_text()

    # 5. A second fault (the former spare crashes) wakes the refilled spare.
    rig.execs.kill(SPARE)
    assert _puts(rig, 1, "second") == [_kv_ok()]
    rig.wait(lambda: len(rig.controld.shutdowns) >= 2, "a second SHUTDOWN certificate", 60)
    cert2 = rig.controld.shutdowns[1]
    assert cert2.convict == (SPARE,) and cert2.active == (0, 1), cert2
    assert 1 in rig.controld.woken_at
    rig.wait(
        lambda: all(
            s["exec_awake"] == [0, 1] and s["exec_convicted"] == [SPARE] for s in rig.agreement()
        ),
        "every agreement replica has 0 and the refilled spare awake",
    )
    # The woken spare replayed the log since seq 0 and serves reads of the first round's data.
    assert rig.invoke_all([_kv(KV_GET, b"w0")]) == [_kv_ok(b"v0")]
    assert _puts(rig, 2, "third") == [_kv_ok()] * 2


def test_announcer_retries_until_a_replica_listens(tmp_path: Path) -> None:
    """An agreement replica that is not listening yet gets the SPARE-READY once it is; each
    replica gets one signed frame that verifies with the controld's public key."""

    base = free_base(range(4))
    (tmp_path / "rack.toml").write_text(
        f"""[rack]
name = "t"
[[hosts]]
name = "h0"
address = "127.0.0.1"
[[services]]
name = "kv"
id = 3
g = 1
f = 1
app = "kv"
base_port = {base}
"""
    )
    from zz import config as zconfig

    cfg = zconfig.load(tmp_path / "rack.toml")
    svc = cfg.services[0]
    key = SigningKey(bytes(range(32)))
    got: dict[int, list[bytes]] = {r: [] for r in range(svc.n)}

    async def main() -> Counter[str]:
        async def serve(r: int) -> asyncio.base_events.Server:
            async def on_conn(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                got[r].append(await wire.read_frame(reader))
                w.close()

            return await asyncio.start_server(on_conn, "127.0.0.1", base + r)

        servers = [await serve(r) for r in range(svc.n - 1)]  # the last one comes up late
        counters: Counter[str] = Counter()
        a = Announcer(cfg, cfg.hosts[0], key, counters, lambda _: None, retry_for=10)
        a.announce(svc, 2, 41)
        await asyncio.sleep(1.0)
        servers.append(await serve(svc.n - 1))
        await asyncio.wait_for(a.idle(), 15)
        for s in servers:
            s.close()
        return counters

    counters = asyncio.run(main())
    assert counters["spare_ready_sent"] == svc.n and counters["spare_ready_retries"] >= 1
    assert not counters["spare_ready_failed"]
    for frames in got.values():
        assert len(frames) == 1
        m = wire.decode(frames[0])
        assert isinstance(m, wire.SpareReady)
        assert (m.service, m.sender, m.replica, m.seq) == (3, keys.controld_principal(0), 2, 41)
        assert m.verify_sig(key.public)


def test_announcer_close_ends_a_send_whose_connect_failed_as_it_was_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.11's wait_for hands back the connect's own error when the connect had
    failed just as the task was cancelled, and the cancellation is lost: the send then
    retried for the whole retry period, and a controld stop took two minutes (the
    controld test of a round that wakes nobody took 117 s). close() ends it at once."""
    from zz import config as zconfig

    (tmp_path / "rack.toml").write_text(
        '[rack]\nname = "t"\n[[hosts]]\nname = "h0"\naddress = "127.0.0.1"\n'
        '[[services]]\nname = "kv"\nid = 3\ng = 1\nf = 1\napp = "kv"\nbase_port = 17300\n'
    )
    cfg = zconfig.load(tmp_path / "rack.toml")
    attempts: list[int] = []

    async def refused_when_cancelled(self: Announcer, addr: object, raw: bytes) -> None:
        attempts.append(1)
        first = len(attempts) <= 4  # each of the 4 sends' first connect
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if first:
                raise ConnectionRefusedError("what wait_for hands back") from None
            raise

    monkeypatch.setattr(Announcer, "_send_once", refused_when_cancelled)

    async def main() -> tuple[Counter[str], bool]:
        counters: Counter[str] = Counter()
        a = Announcer(cfg, cfg.hosts[0], SigningKey(bytes(32)), counters, lambda _: None,
                      retry_for=3600)  # fmt: skip
        a.announce(cfg.services[0], 2, 41)
        await asyncio.sleep(0.1)  # every send waits in its connect
        close = asyncio.create_task(a.close())
        await asyncio.wait({close}, timeout=60)  # a guard: it took the retry period before
        return counters, close.done()

    counters, closed = asyncio.run(main())
    assert closed and len(attempts) == 4, attempts
    assert not counters["spare_ready_retries"] and not counters["spare_ready_failed"]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("exec 0 awake 0\nexec 1 awake 0\nexec 2 dozing 0\n", ":3: expected 'exec I awake"),
        ("exec 0 awake 0\nexec 1 awake 0\n", ": replica 2 missing"),
        ("exec 0 awake 0\nexec 0 awake 0\nexec 2 sleeping 0\n", ":2: replica 0 listed twice"),
        ("exec 0 awake 0\nexec 1 awake 0\nexec 9 sleeping 0\n", ":3: replica 9 is not in"),
        ("exec 0 awake 0\nexec 1 awake -1\nexec 2 sleeping 0\n", ":2: expected"),
        ("\x00garbage", ":1: NUL byte"),
        ("exec 0 awake 0\n" + "#" * 300 + "\n", ":2: line too long"),
    ],
)
def test_corrupt_view_file_stops_the_replica(tmp_path: Path, text: str, why: str) -> None:
    from tests.cluster import Cluster

    with Cluster(tmp_path, app="kv", f=1) as c:
        view = c.run_dir / "agreed-0.exec-view"
        assert f"exec_view {view}" in c.conf_path(0).read_text()
        view.write_text(text)
        # It may listen for a moment before it reads the view, so wait for the exit.
        with contextlib.suppress(RuntimeError, TimeoutError):
            c.start(0)
        assert c.procs[0].wait(timeout=10) != 0
        log = c.log_path(0).read_text(errors="replace")
        assert f"zz-agreed: {view}{why}" in log, log
        # A well-formed one is taken: replica 1 convicted at seq 12, 2 awake.
        view.write_text("# kept\nexec 0 awake 0\nexec 1 convicted 12\nexec 2 awake 0\n")
        c.start(0)
        c.wait_for(lambda: c.stats(0).get("exec_convicted") == [1], 10, "view loaded")
        assert c.stats(0)["exec_awake"] == [0, 2]
