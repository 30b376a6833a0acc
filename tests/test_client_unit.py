# tests/test_client_unit.py - zz.client against an in-test fake replica set (asyncio servers).
# The fakes answer like agreement replicas with an echo state machine, some of them faulty.
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from zz import keys, wire
from zz.client import Client, ClientParams, ClientTimeout
from zz.crypto import SigningKey, sha256

G = 1
N = 3 * G + 1
CLIENT = wire.client_principal(0)


@dataclass
class FakeReplica:
    r: int
    key: bytes
    mode: str = "echo"  # echo | wrong | silent | badmac
    view: int = 0
    received: list[wire.Request] = field(default_factory=list)
    server: asyncio.Server | None = None

    cluster: list[FakeReplica] = field(default_factory=list)
    writer: asyncio.StreamWriter | None = None

    def reply(self, m: wire.Request) -> None:
        if self.mode == "silent" or self.writer is None:
            return
        result = b"evil" if self.mode == "wrong" else m.op
        rep = wire.Reply(1, self.r, self.view, m.timestamp, CLIENT, m.flags, result)
        key = os.urandom(32) if self.mode == "badmac" else self.key
        self.writer.write(wire.frame(rep.with_macs({CLIENT: key}).encode()))

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                m = wire.decode(await wire.read_frame(reader))
                assert isinstance(m, wire.Request)
                assert m.verify_mac(self.r, self.key), "client sent a bad MAC"
                self.received.append(m)
                # A working primary gets the request executed everywhere (the fake's
                # stand-in for ordering); a backup hit by a retransmission answers alone.
                primary = self.r == self.view % N and self.mode != "silent"
                for rep in self.cluster if primary and not m.read_only else [self]:
                    rep.reply(m)
        writer.close()


@dataclass
class Rig:
    replicas: list[FakeReplica]
    params: ClientParams


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    keys = {r: os.urandom(32) for r in range(N)}
    reps = [FakeReplica(r, keys[r]) for r in range(N)]
    for rep in reps:
        rep.cluster = reps
    addrs = []
    for rep in reps:
        rep.server = await asyncio.start_server(rep.handle, "127.0.0.1", 0)
        addrs.append(rep.server.sockets[0].getsockname()[:2])
    params = ClientParams(1, G, 0, addrs, keys, initial_timeout=0.2)
    yield Rig(reps, params)
    for rep in reps:
        assert rep.server is not None
        rep.server.close()


async def test_matching_replies_from_primary(rig: Rig) -> None:
    async with Client(rig.params) as c:
        assert await c.invoke(b"hello", timeout=5) == b"hello"
        assert await c.invoke(b"again", timeout=5) == b"again"
    # Without faults only the primary is asked, and timestamps strictly increase.
    # The first request also introduces the client to every replica (they reply on the
    # connection it arrived on); after that only the primary gets requests.
    assert [len(r.received) for r in rig.replicas] == [2, 1, 1, 1]
    ts = [m.timestamp for m in rig.replicas[0].received]
    assert ts[0] < ts[1]
    assert c.stats["retransmits"] == 0


async def test_one_faulty_result_is_outvoted(rig: Rig) -> None:
    rig.replicas[1].mode = "wrong"
    rig.replicas[0].mode = "silent"  # force the request to reach everyone
    async with Client(rig.params) as c:
        assert await c.invoke(b"x", timeout=5) == b"x"


async def test_two_faulty_results_cannot_win_alone(rig: Rig) -> None:
    # g+1 = 2 matching wrong answers would be accepted; with g = 1 only one is faulty,
    # so make sure a single wrong reply plus silence is never taken as a result.
    for r, mode in enumerate(["wrong", "silent", "silent", "echo"]):
        rig.replicas[r].mode = mode
    async with Client(rig.params) as c:
        with pytest.raises(ClientTimeout):
            await c.invoke(b"x", timeout=1.0)
        assert c.stats["retransmits"] >= 1


async def test_silent_primary_triggers_retransmission_to_all(rig: Rig) -> None:
    loop = asyncio.get_running_loop()
    async with Client(rig.params) as c:
        assert await c.invoke(b"warm-up", timeout=5) == b"warm-up"  # goes to everyone
        rig.replicas[0].mode = "silent"
        t0 = loop.time()
        assert await c.invoke(b"op", timeout=5) == b"op"
        elapsed = loop.time() - t0
    assert c.stats["retransmits"] == 1
    assert 0.2 <= elapsed < 2.0
    assert all(len(r.received) == 2 for r in rig.replicas[1:])  # warm-up + retransmission
    assert len(rig.replicas[0].received) == 3  # warm-up, first send, retransmission


async def test_retransmissions_are_signed(rig: Rig) -> None:
    """First sends carry MACs only; a retransmission is the same request signed (auth kind
    3), its MACs still good, so that backups run their view-change timers on it (docs/
    agreement.md "Signed requests"). With sign_always every request is signed."""
    sign = SigningKey(os.urandom(32))
    params = dataclasses.replace(rig.params, sign=sign)
    async with Client(params) as c:
        assert await c.invoke(b"warm-up", timeout=5) == b"warm-up"
        rig.replicas[0].mode = "silent"
        assert await c.invoke(b"op", timeout=5) == b"op"
    first, again = rig.replicas[0].received[1:3]
    assert not first.is_signed and again.is_signed and again.verify_sig(sign.public)
    assert (again.timestamp, again.op) == (first.timestamp, first.op)
    assert all(m.is_signed for m in rig.replicas[1].received[1:])
    assert c.stats["signed"] == 1
    rig.replicas[0].mode = "echo"
    async with Client(dataclasses.replace(params, sign_always=True)) as c:
        assert await c.invoke(b"signed", timeout=5) == b"signed"
    m = rig.replicas[0].received[-1]
    assert m.op == b"signed" and m.is_signed and m.verify_sig(sign.public)


async def test_bad_mac_replies_are_ignored_and_counted(rig: Rig) -> None:
    rig.replicas[0].mode = "silent"
    rig.replicas[1].mode = "badmac"
    rig.replicas[2].mode = "badmac"
    async with Client(rig.params) as c:
        # Only replica 3 answers with a valid MAC: below g+1, so no result.
        with pytest.raises(ClientTimeout):
            await c.invoke(b"op", timeout=0.8)
        assert c.stats["bad_mac"] >= 2
        rig.replicas[2].mode = "echo"
        assert await c.invoke(b"op2", timeout=5) == b"op2"


async def test_view_is_learned_from_replies(rig: Rig) -> None:
    for rep in rig.replicas:
        rep.view = 5
    async with Client(rig.params) as c:
        await c.invoke(b"a", timeout=5)
        assert c.view == 5 and c.primary == 1
        before = [len(r.received) for r in rig.replicas]
        await c.invoke(b"b", timeout=5)
    after = [len(r.received) for r in rig.replicas]
    assert [a - b for a, b in zip(after, before, strict=True)] == [0, 1, 0, 0]


async def test_lying_view_from_one_replica_is_not_trusted(rig: Rig) -> None:
    rig.replicas[0].mode = "silent"
    rig.replicas[3].view = 1000
    async with Client(rig.params) as c:
        await c.invoke(b"a", timeout=5)
        assert c.view == 0


async def test_read_only_needs_2g_plus_1_then_falls_back(rig: Rig) -> None:
    async with Client(rig.params) as c:
        assert await c.invoke(b"get", read_only=True, timeout=5) == b"get"
        assert all(r.received[-1].read_only for r in rig.replicas)
        assert c.stats["read_only_fallbacks"] == 0
        rig.replicas[2].mode = "wrong"
        rig.replicas[3].mode = "silent"
        # Two echo replies + one wrong: 2g+1 = 3 matching impossible -> ordered request.
        assert await c.invoke(b"get2", read_only=True, timeout=5) == b"get2"
        assert c.stats["read_only_fallbacks"] == 1
        assert not rig.replicas[0].received[-1].read_only


async def test_reconnects_after_replica_restart(rig: Rig) -> None:
    async with Client(rig.params) as c:
        assert await c.invoke(b"one", timeout=5) == b"one"
        rep = rig.replicas[0]
        assert rep.server is not None
        host, port = rig.params.replicas[0]
        rep.server.close()
        for conn in c._conns:  # drop live connections as a crash would
            if conn.writer is not None:
                conn.writer.close()
        await asyncio.sleep(0.1)
        rep.server = await asyncio.start_server(rep.handle, host, port)
        assert await c.invoke(b"two", timeout=5) == b"two"
        assert c.stats["connects"] >= N + 1


# ---- services whose app runs on execution replicas ------------------------------------

F = 1
N_EXEC = 2 * F + 1


@dataclass
class FakeExec:
    """An execution replica: executes what the fake primary orders (standing in for
    EXEC-COMMIT certificates), pushes the REPLY to the client if it has its connection,
    and answers a REQUEST it receives directly from its reply cache."""

    i: int
    key: bytes
    mode: str = "echo"  # echo | wrong | silent | badmac | lost (executes, first REPLY lost)
    view: int = 0
    received: list[wire.Request] = field(default_factory=list)
    cache: dict[int, bytes] = field(default_factory=dict)
    server: asyncio.Server | None = None
    writer: asyncio.StreamWriter | None = None

    @property
    def principal(self) -> int:
        return wire.exec_principal(self.i)

    def execute(self, m: wire.Request) -> None:
        if self.mode == "silent":
            return
        self.cache[m.timestamp] = b"evil" if self.mode == "wrong" else b"exec:" + m.op
        if self.mode != "lost":
            self.reply(m.timestamp)

    def reply(self, ts: int) -> None:
        if self.writer is None or ts not in self.cache:
            return
        rep = wire.Reply(1, self.principal, self.view, ts, CLIENT, 0, self.cache[ts])
        key = os.urandom(32) if self.mode == "badmac" else self.key
        self.writer.write(wire.frame(rep.with_macs({CLIENT: key}).encode()))

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                m = wire.decode(await wire.read_frame(reader))
                assert isinstance(m, wire.Request)
                self.on_request(m, writer)
        writer.close()

    def on_request(self, m: wire.Request, writer: asyncio.StreamWriter) -> None:
        assert m.verify_mac(self.principal, self.key), "client sent a bad MAC"
        self.received.append(m)
        self.reply(m.timestamp)


@dataclass
class ExecRig:
    replicas: list[FakeReplica]
    execs: list[FakeExec]
    params: ClientParams


class OrderingReplica(FakeReplica):
    """Agreement fake for an external-execution service: a working primary hands the
    request to every execution replica, and every replica still sends its own echo
    REPLY, which the client must not count as a result."""

    execs: list[FakeExec]
    # REPLY-AFFIRM sent for every request it receives: none | right | wrong | badmac
    affirm = "none"

    def reply(self, m: wire.Request) -> None:
        super().reply(m)
        if self.mode != "silent" and self.r == self.view % N:
            for x in self.execs:
                x.execute(m)
        if self.affirm != "none" and self.writer is not None:
            result = b"evil" if self.affirm == "wrong" else b"exec:" + m.op
            aff = wire.ReplyAffirm(1, self.r, m.timestamp, CLIENT, sha256(result))
            key = os.urandom(32) if self.affirm == "badmac" else self.key
            self.writer.write(wire.frame(aff.with_macs({CLIENT: key}).encode()))


@pytest.fixture
async def exec_rig() -> AsyncIterator[ExecRig]:
    keys = {r: os.urandom(32) for r in range(N)}
    xkeys = {i: os.urandom(32) for i in range(N_EXEC)}
    execs = [FakeExec(i, xkeys[i]) for i in range(N_EXEC)]
    reps: list[FakeReplica] = []
    for r in range(N):
        rep = OrderingReplica(r, keys[r])
        rep.execs = execs
        reps.append(rep)
    for rep in reps:
        rep.cluster = reps
    addrs, xaddrs = [], []
    for rep in reps:
        rep.server = await asyncio.start_server(rep.handle, "127.0.0.1", 0)
        addrs.append(rep.server.sockets[0].getsockname()[:2])
    for x in execs:
        x.server = await asyncio.start_server(x.handle, "127.0.0.1", 0)
        xaddrs.append(x.server.sockets[0].getsockname()[:2])
    params = ClientParams(
        1, G, 0, addrs, keys, initial_timeout=0.2, f=F, exec_replicas=xaddrs, exec_keys=xkeys
    )
    yield ExecRig(reps, execs, params)
    for srv in [rep.server for rep in reps] + [x.server for x in execs]:
        assert srv is not None
        srv.close()


async def test_exec_f_plus_1_matching_replies_are_a_result(exec_rig: ExecRig) -> None:
    exec_rig.execs[2].mode = "silent"  # a sleeping spare: only f+1 are active
    async with Client(exec_rig.params) as c:
        assert await c.invoke(b"hello", timeout=5) == b"exec:hello"
        assert await c.invoke(b"again", timeout=5) == b"exec:again"
        assert c.stats["retransmits"] == 0
        # Every agreement replica answered too (they were introduced), to no effect.
        assert c.stats["agreement_replies_ignored"] >= G + 1
    # Fresh connections to execution replicas carry the first request, so they know
    # where to reply; after that only the primary gets requests.
    assert [len(x.received) for x in exec_rig.execs] == [1, 1, 1]
    assert [len(r.received) for r in exec_rig.replicas] == [2, 1, 1, 1]


async def test_exec_single_faulty_reply_is_outvoted(exec_rig: ExecRig) -> None:
    exec_rig.execs[0].mode = "wrong"
    exec_rig.execs[2].mode = "silent"
    async with Client(exec_rig.params) as c:
        # One wrong and one correct reply: f+1 = 2 matching impossible, no result.
        with pytest.raises(ClientTimeout):
            await c.invoke(b"x", timeout=0.8)
        assert c.stats["retransmits"] >= 1
        exec_rig.execs[2].mode = "echo"  # a woken spare joins
        assert await c.invoke(b"y", timeout=5) == b"exec:y"


async def test_exec_bad_mac_reply_does_not_count(exec_rig: ExecRig) -> None:
    exec_rig.execs[0].mode = "badmac"
    exec_rig.execs[2].mode = "silent"
    async with Client(exec_rig.params) as c:
        with pytest.raises(ClientTimeout):
            await c.invoke(b"x", timeout=0.8)
        assert c.stats["bad_mac"] >= 1


async def test_agreement_replies_are_not_results(exec_rig: ExecRig) -> None:
    for x in exec_rig.execs:
        x.mode = "silent"
    async with Client(exec_rig.params) as c:
        # All 3g+1 agreement replicas answer with valid MACs and matching results.
        with pytest.raises(ClientTimeout):
            await c.invoke(b"x", timeout=1.0)
        assert c.stats["agreement_replies_ignored"] >= G + 1
        assert c.stats["retransmits"] >= 1


async def test_exec_retransmission_reaches_execution_replicas(exec_rig: ExecRig) -> None:
    async with Client(exec_rig.params) as c:
        assert await c.invoke(b"warm-up", timeout=5) == b"exec:warm-up"
        for x in exec_rig.execs:
            x.mode = "lost"  # executed, but the pushed REPLY never reaches the client
        assert await c.invoke(b"op", timeout=5) == b"exec:op"
        assert c.stats["retransmits"] == 1
    ts = exec_rig.replicas[0].received[-1].timestamp
    for x in exec_rig.execs:
        # Answered from the reply cache once the retransmission arrived directly.
        assert [m.timestamp for m in x.received][-1] == ts
    assert all(r.received[-1].timestamp == ts for r in exec_rig.replicas)
    # One MAC vector covers every agreement and every execution replica.
    receivers = [rcv for rcv, _ in exec_rig.execs[0].received[-1].mac_entries()]
    assert receivers == list(range(N)) + [wire.exec_principal(i) for i in range(N_EXEC)]


async def test_exec_client_follows_the_view_change_to_the_new_primary(exec_rig: ExecRig) -> None:
    """The primary drill's path (docs/operations.md "The primary drill's throughput"): the
    primary of view 0 dies and the cluster moves to view 1. The request in flight needs
    one retransmission; the execution replicas' REPLYs carry view 1, and from then on the
    client sends to the new primary alone, with no retransmission and nothing to the dead
    replica."""
    exec_rig.execs[2].mode = "silent"  # a sleeping spare: only f+1 are active
    async with Client(exec_rig.params) as c:
        assert await c.invoke(b"warm-up", timeout=5) == b"exec:warm-up"
        assert c.primary == 0
        exec_rig.replicas[0].mode = "silent"
        for rep in exec_rig.replicas:
            rep.view = 1
        for x in exec_rig.execs:
            x.view = 1
        assert await c.invoke(b"in-flight", timeout=5) == b"exec:in-flight"
        assert c.stats["retransmits"] == 1
        assert c.view == 1 and c.primary == 1
        before = [len(r.received) for r in exec_rig.replicas]
        for k in range(3):
            assert await c.invoke(b"after-%d" % k, timeout=5) == b"exec:after-%d" % k
        assert c.stats["retransmits"] == 1
    after = [len(r.received) for r in exec_rig.replicas]
    assert [a - b for a, b in zip(after, before, strict=True)] == [0, 3, 0, 0]


async def test_exec_read_only_is_ordered(exec_rig: ExecRig) -> None:
    async with Client(exec_rig.params) as c:
        assert await c.invoke(b"get", read_only=True, timeout=5) == b"exec:get"
        assert c.stats["read_only_ordered"] == 1 and c.stats["read_only_fallbacks"] == 0
    last = exec_rig.replicas[0].received[-1]
    assert not last.read_only and last.ordered_read  # ordered, run without write access
    # Ordered, so only the primary and the not yet introduced replicas were asked once.
    assert [len(r.received) for r in exec_rig.replicas] == [1, 1, 1, 1]


class RekeyedSpare(FakeExec):
    """A fresh spare under a new key epoch, just woken (execution/runtime.py): a REQUEST
    that does not verify under its key makes it introduce itself with its host's signed
    SPARE-READY and is dropped; it replies only on a connection that carried one that
    verifies (the connection the runtime registers for the client)."""

    intro: bytes = b""
    registered = False

    def reply(self, ts: int) -> None:
        if self.registered:
            super().reply(ts)

    def on_request(self, m: wire.Request, writer: asyncio.StreamWriter) -> None:
        self.received.append(m)
        if not m.verify_mac(self.principal, self.key):
            writer.write(wire.frame(self.intro))
            return
        self.registered = True
        self.reply(m.timestamp)


async def test_a_request_dropped_by_a_rekeyed_spare_is_sent_again_at_its_introduction(
    exec_rig: ExecRig,
) -> None:
    """Active replica 1 has crashed and the woken spare 2 holds a key epoch this client
    has not seen (a fresh spare provisioned after a conviction; a proxy on another machine
    learns it only from the spare). The spare drops the request and introduces itself: the
    client sends the request again under the new key at once, not at its next
    retransmission (backed off to seconds by the time a spare is woken), and gets its
    f+1 matching replies."""
    p = exec_rig.params
    host = SigningKey(os.urandom(32))
    p.sign = SigningKey(os.urandom(32))
    p.exec_hosts = [keys.controld_principal(h) for h in range(N_EXEC)]
    p.rack_public = {keys.controld_principal(2): host.public}
    p.initial_timeout = p.max_timeout = 60.0  # no retransmission within the test
    spare_key = SigningKey(os.urandom(32))
    dh_pub = keys.dh_public(spare_key)
    new_key = keys.epoch_mac_key(p.sign, dh_pub, 1, p.principal, wire.exec_principal(2), 1)
    spare = RekeyedSpare(2, new_key)
    intro = wire.SpareReady(1, keys.controld_principal(2), 2, 7, 1, spare_key.public, dh_pub)
    spare.intro = intro.signed(host).encode()
    x = exec_rig.execs[2]
    assert x.server is not None
    x.server.close()
    spare.server = await asyncio.start_server(spare.handle, *p.exec_replicas[2])
    exec_rig.execs[2] = spare
    for rep in exec_rig.replicas:
        assert isinstance(rep, OrderingReplica)
        rep.execs = exec_rig.execs
    exec_rig.execs[1].mode = "silent"
    async with Client(p) as c:
        assert await c.invoke(b"op", timeout=10) == b"exec:op"
        assert c.stats["exec_key_epochs_learned"] == 1
        assert c.stats["resent_on_introduction"] == 1 and c.stats["retransmits"] == 0
    assert [m.verify_mac(spare.principal, new_key) for m in spare.received] == [False, True]
    spare.server.close()


def _affirm_rig(rig: ExecRig, modes: list[str]) -> None:
    # exec 0 right, exec 1 wrong, exec 2 asleep: f+1 = 2 matching REPLYs cannot be had.
    rig.execs[1].mode = "wrong"
    rig.execs[2].mode = "silent"
    for rep, mode in zip(rig.replicas, modes, strict=True):
        rep.affirm = mode


async def test_affirmation_certificate_is_a_result(exec_rig: ExecRig) -> None:
    _affirm_rig(exec_rig, ["right", "right", "none", "none"])
    async with Client(exec_rig.params) as c:
        assert await c.invoke(b"op", timeout=5) == b"exec:op"
        assert c.stats["affirmed_results"] == 1 and c.stats["affirms"] >= G + 1


async def test_g_affirms_are_not_enough(exec_rig: ExecRig) -> None:
    # One correct affirm, one faulty replica affirming the wrong reply's digest: neither
    # digest has g+1 affirms, and f+1 matching REPLYs are impossible.
    _affirm_rig(exec_rig, ["right", "wrong", "none", "none"])
    async with Client(exec_rig.params) as c:
        with pytest.raises(ClientTimeout):
            await c.invoke(b"op", timeout=1.0)
        assert c.stats["affirmed_results"] == 0


async def test_affirms_need_a_reply_with_that_result(exec_rig: ExecRig) -> None:
    _affirm_rig(exec_rig, ["right", "right", "right", "right"])
    exec_rig.execs[0].mode = "silent"  # the only correct REPLY never comes
    async with Client(exec_rig.params) as c:
        with pytest.raises(ClientTimeout):
            await c.invoke(b"op", timeout=1.0)
        assert c.stats["affirms"] >= G + 1 and c.stats["affirmed_results"] == 0


async def test_faulty_affirms_cannot_vouch_for_a_wrong_reply(exec_rig: ExecRig) -> None:
    # g = 1 faulty agreement replica affirms the wrong result that exec 1 sent: 1 < g+1.
    _affirm_rig(exec_rig, ["wrong", "none", "none", "none"])
    async with Client(exec_rig.params) as c:
        with pytest.raises(ClientTimeout):
            await c.invoke(b"op", timeout=1.0)
        assert c.stats["affirmed_results"] == 0


async def test_affirms_with_bad_macs_do_not_count(exec_rig: ExecRig) -> None:
    _affirm_rig(exec_rig, ["right", "badmac", "badmac", "none"])
    async with Client(exec_rig.params) as c:
        with pytest.raises(ClientTimeout):
            await c.invoke(b"op", timeout=1.0)
        assert c.stats["bad_mac"] >= 1 and c.stats["affirmed_results"] == 0


def test_params_from_config_for_external_app(write_rack: Callable[[str], Path]) -> None:
    from conftest import RACK_TOML

    from zz import keys
    from zz.config import load

    text = RACK_TOML.format(base_port=17100).replace("f = 1", 'f = 1\napp = "kv"', 1)
    cfg = load(write_rack(text))
    keys.generate(cfg)
    svc = cfg.service("web")
    p = ClientParams.from_config(cfg, "web", 2)
    assert p.uses_execution_replicas and p.f == 1
    assert p.exec_replicas == svc.exec_addresses(cfg)
    me = wire.client_principal(2)
    for i in range(svc.n_exec):
        xsec = keys.load_secret(keys.secret_path(cfg.rack.key_dir, 1, wire.exec_principal(i)))
        assert p.exec_keys[i] == xsec.macs[me]
    echo = load(write_rack(RACK_TOML.format(base_port=17100)))
    assert not ClientParams.from_config(echo, "web", 2).uses_execution_replicas


async def test_a_request_lost_on_a_dying_connection_goes_again_on_the_next(
    exec_rig: ExecRig,
) -> None:
    """Execution replica 2 is a hibernated spare being woken: its port is accepted (QEMU's
    user network of the restored guest) and closed again (its runtime does not listen
    yet), swallowing the request that waited for that connection; then the runtime
    listens, having executed the request meanwhile. The fresh connection carries the
    pending request again, so the spare answers it from its reply cache at once, not at
    the client's next retransmission (none within this test)."""
    p = exec_rig.params
    p.initial_timeout = p.max_timeout = 60.0
    exec_rig.execs[1].mode = "silent"  # the convicted replica: f+1 needs the spare
    x = exec_rig.execs[2]
    assert x.server is not None
    x.server.close()
    await x.server.wait_closed()
    swallowed: list[bytes] = []

    async def accept_and_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            swallowed.append(await wire.read_frame(reader))
        writer.close()

    early = await asyncio.start_server(accept_and_close, *p.exec_replicas[2])
    async with Client(p) as c:
        call = asyncio.create_task(c.invoke(b"op", timeout=20))
        while not swallowed:
            await asyncio.sleep(0.01)
        early.close()
        await early.wait_closed()
        x.server = await asyncio.start_server(x.handle, *p.exec_replicas[2])
        assert await call == b"exec:op"
        assert c.stats["retransmits"] == 0 and c.stats["resent_on_connect"] >= 1
    assert [m.timestamp for m in x.received] == [wire.decode(swallowed[0]).timestamp]
