# tests/test_controld_daemon.py - the controld daemon end to end over TCP: operator RPC
# authentication, provisioning, certificate-checked WAKEUP and SHUTDOWN, restart. libvirt on
# test:///default (fast, in-process domains) and the process backend with the real
# execution runtime. Certificates are real Ed25519-signed zz/wire.py messages.
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zfs_pool

from zz import audit, keys, wire
from zz.config import Config, load
from zz.controld import actions
from zz.controld import inventory as inv
from zz.controld.daemon import Daemon
from zz.controld.hypervisor import DomainNotFound, HypervisorError, open_backend
from zz.controld.rpc import RpcError, call, control_request
from zz.crypto import SigningKey
from zz.naming import domain_name
from zz.ports import free_base, free_port
from zz.procrack import REPO, repo_env

A, B = bytes([0xA]) * 32, bytes([0xB]) * 32
OP = keys.operator_principal(0)
SVC = 1
KV = 2  # make_rack(kv=True): a second service, so that one host holds slots of two


def _free_base() -> int:
    """A base port whose execution ports (base+64 .. base+66) are free now."""
    return free_base(range(64, 67))


RACK = """\
[rack]
name = "{name}"
[[hosts]]
name = "h0"
address = "127.0.0.1"
libvirt_uri = "test:///default"
[[hosts]]
name = "h1"
address = "127.0.0.1"
libvirt_uri = "test:///default"
[[hosts]]
name = "h2"
address = "127.0.0.1"
libvirt_uri = "test:///default"
[[services]]
name = "web"
id = 1
g = 1
f = 1
app = "kv"
clients = 2
base_port = {base}
sleep = "{sleep}"
"""


@dataclass
class Rack:
    config: Config
    path: Path
    signers: dict[int, SigningKey]  # agreement replica r of service 1
    op_keys: dict[int, bytes]  # operator 0's MAC key per controld principal

    def statement(self, r: int, seq: int, row: list[tuple[int, int, bytes]]) -> bytes:
        entries = [wire.RowEntry(j, st, d) for j, st, d in row]
        return wire.FaultStatement(SVC, r, seq, entries).signed(self.signers[r]).encode()

    def wakeup(
        self, sender: int, seq: int, evidence: list[bytes], sleeping: list[int], wake: list[int]
    ) -> bytes:
        m = wire.Wakeup(SVC, sender, seq, evidence, sleeping, wake)
        return m.signed(self.signers[sender]).encode()

    def valid_wakeup(self, seq: int = 7, sender: int = 0) -> bytes:
        """Scenario w1 of tests/vectors/faults.txt: 0 and 1 disagree, wake spare 2."""
        ev = [self.statement(r, seq, [(0, 1, A), (1, 1, B)]) for r in (0, 1)]
        return self.wakeup(sender, seq, ev, [2], [2])

    def shutdown(self, r: int, seq: int, convict: list[int], sleep: list[int]) -> bytes:
        # The round's awake set [0, 1] plus the woken spare 2, less the convicted and sleeping.
        active = [j for j in (0, 1, 2) if j not in convict and j not in sleep]
        m = wire.Shutdown(SVC, r, seq, [0, 1], convict, sleep, active)
        return m.signed(self.signers[r]).encode()


def make_rack(
    tmp_path: Path,
    sleep: str = "paused",
    uri: str = "test:///default",
    active: int = 0,
    kv: bool = False,
) -> Rack:
    """The 3-host rack of RACK; with `active` (4: f+1 < active = n_exec) a fourth host and
    that many active execution replicas; with `kv` a second service, "kv" (id KV), alike."""
    name = "t" + secrets.token_hex(4)  # domain names on the shared test:///default differ
    p = tmp_path / "rack.toml"
    text = RACK.format(name=name, base=_free_base(), sleep=sleep)
    if kv:
        svc = RACK[RACK.index("[[services]]") :].format(base=_free_base(), sleep=sleep)
        text += svc.replace('name = "web"', 'name = "kv"').replace("id = 1", f"id = {KV}")
    if active:
        h3 = '[[hosts]]\nname = "h3"\naddress = "127.0.0.1"\nlibvirt_uri = "test:///default"\n'
        text = text.replace("[[services]]", h3 + "[[services]]")
        text = text.replace("f = 1\n", f"f = 1\nactive = {active}\n")
    p.write_text(text.replace("test:///default", uri))
    c = load(p)
    keys.generate(c)
    signers = {}
    for r in range(4):
        sk = keys.load_secret(keys.secret_path(c.rack.key_dir, SVC, r)).sign
        assert sk is not None
        signers[r] = sk
    op = keys.load_secret(keys.secret_path(c.rack.key_dir, 0, OP))
    return Rack(c, p, signers, op.macs)


@pytest.fixture
def rack(tmp_path: Path) -> Rack:
    return make_rack(tmp_path)


class Node:
    """One in-process controld and a client for it."""

    def __init__(
        self, rack: Rack, host: int, backend: str, uri: str = "test:///default", **opts: Any
    ) -> None:
        self.rack = rack
        self.host = rack.config.hosts[host]
        self.principal = keys.controld_principal(host)
        self.hv = open_backend(backend, **({"uri": uri} if backend == "libvirt" else {}))
        ck = keys.load_controld(rack.config.rack.key_dir, rack.config, host)
        home = rack.config.rack.run_dir / "controld" / self.host.name
        opts.setdefault("ready_timeout", 30)
        self.daemon = Daemon(rack.config, self.host, self.hv, ck, home, **opts)
        self.port = 0

    async def start(self) -> None:
        self.port = await self.daemon.start(port=0)

    async def rpc(self, op: str, **params: Any) -> dict[str, Any]:
        return await call(
            "127.0.0.1",
            self.port,
            operator=OP,
            controld=self.principal,
            key=self.rack.op_keys[self.principal],
            op={"op": op, **params},
            timeout=self.daemon.ctx.ready_timeout + 60,
        )

    async def send(self, *raws: bytes, wait: bool = True) -> None:
        """Send messages on one connection, then a status RPC on it: its reply means they
        were all handled; then (`wait`) wait until the actions they queued are done."""
        r, w = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            for raw in raws:
                w.write(wire.frame(raw))
            rid = time.time_ns()
            key = self.rack.op_keys[self.principal]
            w.write(control_request(OP, self.principal, key, rid, {"op": "list"}))
            await w.drain()
            await asyncio.wait_for(wire.read_frame(r), 10)
        finally:
            w.close()
        if wait:
            await asyncio.wait_for(self.daemon.idle(), self.daemon.ctx.ready_timeout + 120)

    def counters(self) -> dict[str, int]:
        return dict(self.daemon.counters)

    def state(self, index: int) -> str | None:
        return self.daemon.inventory.get("web", index).state

    async def close(self, destroy: bool = True) -> None:
        await self.daemon.stop()
        if destroy:
            for rec in self.daemon.inventory.replicas():
                with contextlib.suppress(Exception):
                    self.hv.destroy(rec.domain)
        self.hv.close()


def close_keeping_backend(keep: Any, rack: Rack) -> None:
    """Clean up after a test that held its own test:///default connection (the driver's
    state lives as long as a connection to it does, standing for libvirtd across
    controld restarts): destroy every domain of the rack, then close it."""
    for name in keep.list():
        if rack.config.rack.name in name:
            with contextlib.suppress(Exception):
                keep.destroy(name)
    keep.close()


@contextlib.asynccontextmanager
async def nodes(rack: Rack, backend: str, *hosts: int) -> AsyncIterator[list[Node]]:
    made = [Node(rack, h, backend) for h in hosts]
    try:
        for n in made:
            await n.start()
        yield made
    finally:
        for n in made:
            await n.close()


def _raw_control(rack: Rack, principal: int, sender: int, key: bytes, rid: int) -> bytes:
    m = wire.Control(0, sender, rid, json.dumps({"op": "status"}).encode())
    return m.with_macs({principal: key}).encode()


# ---- RPC authentication -----------------------------------------------------------------


async def test_rpc_auth_and_garbage(rack: Rack) -> None:
    async with nodes(rack, "libvirt", 0) as (n,):
        st = await n.rpc("status")
        assert st["ok"] and st["host"] == "h0" and st["principal"] == 16777216
        assert st["backend"] == "libvirt" and st["replicas"] == []
        key = rack.op_keys[n.principal]
        rid = time.time_ns()
        bad_mac = _raw_control(rack, n.principal, OP, bytes(32), rid)
        unknown = _raw_control(rack, n.principal, OP + 1, key, rid)  # no such operator
        wrong_receiver = _raw_control(rack, n.principal + 1, OP, key, rid)  # entry for h1 only
        garbage = b"ZZ\x01\x17" + bytes(40)
        await n.send(bad_mac, unknown, wrong_receiver, garbage)
        c = n.counters()
        assert c["control_bad_mac"] == 2 and c["control_unknown_principal"] == 1
        assert c["malformed"] == 1
        # A reused request id is refused with an authenticated reply, and persisted.
        rid = time.time_ns()
        ok = await call(
            "127.0.0.1",
            n.port,
            operator=OP,
            controld=n.principal,
            key=key,
            op={"op": "list"},
            request_id=rid,
        )
        assert ok["ok"]
        again = await call(
            "127.0.0.1",
            n.port,
            operator=OP,
            controld=n.principal,
            key=key,
            op={"op": "list"},
            request_id=rid,
        )
        assert not again["ok"] and "reused" in again["error"]
        older = await call(
            "127.0.0.1",
            n.port,
            operator=OP,
            controld=n.principal,
            key=key,
            op={"op": "list"},
            request_id=rid - 1,
        )
        # Never used and inside the window: concurrent requests may arrive out of order.
        assert older["ok"] and n.counters()["control_replayed"] == 1
        bad = await n.rpc("frobnicate")
        assert not bad["ok"] and "unknown op" in bad["error"]
        # A frame length below 16 closes that connection; the daemon keeps serving.
        r, w = await asyncio.open_connection("127.0.0.1", n.port)
        w.write((3).to_bytes(4, "big") + b"abc")
        await w.drain()
        assert await asyncio.wait_for(r.read(), 5) == b""
        w.close()
        st = await n.rpc("status")
        assert st["counters"]["framing"] == 1
        # A client with the wrong key sees no authenticated reply (the daemon sends none).
        with pytest.raises(RpcError):
            await call(
                "127.0.0.1",
                n.port,
                operator=OP,
                controld=n.principal,
                key=bytes(32),
                op={"op": "status"},
                timeout=1.5,
            )


# ---- provisioning, WAKEUP ---------------------------------------------------------------


async def test_provision_checks_placement(rack: Rack) -> None:
    async with nodes(rack, "libvirt", 0) as (n,):
        # Execution replica i is placed on hosts[(i + 1) % 3]: h0 holds replica 2 only.
        r = await n.rpc("provision", service="web", index=1, mode="paused")
        assert not r["ok"] and "placed on host h2" in r["error"]
        r = await n.rpc("provision", service="web", index=7)
        assert not r["ok"] and "0..2" in r["error"]
        r = await n.rpc("provision", service="nope", index=2)
        assert not r["ok"] and "unknown service" in r["error"]
        r = await n.rpc("provision", service="web", index=2, mode="frozen")
        assert not r["ok"] and "mode" in r["error"]
        assert (await n.rpc("list"))["replicas"] == []


@pytest.mark.parametrize("backend", ["libvirt", "process"])
async def test_wakeup_paused(rack: Rack, backend: str) -> None:
    async with nodes(rack, backend, 0) as (n,):
        progress: list[dict[str, Any]] = []
        r = await call(
            "127.0.0.1",
            n.port,
            operator=OP,
            controld=n.principal,
            key=rack.op_keys[n.principal],
            progress=progress.append,
            op={"op": "provision", "service": "web", "index": 2, "mode": "paused"},
        )
        assert r["ok"], r
        assert progress and "booting" in progress[0]["progress"]
        assert r["replica"]["state"] == "paused" and r["replica"]["role"] == "standby"
        domain = r["replica"]["domain"]
        assert n.hv.state(domain) == "paused"
        if backend == "process":
            assert r["answering_s"] > 0  # the real runtime came up before the pause
        # Forged WAKEUPs: nothing changes.
        good_ev = [rack.statement(x, 7, [(0, 1, A), (1, 1, B)]) for x in (0, 1)]
        bad_sig = bytearray(rack.valid_wakeup())
        bad_sig[-1] ^= 1
        only_g = rack.wakeup(0, 7, good_ev[:1], [2], [2])
        agree = [rack.statement(x, 7, [(0, 1, A), (1, 1, A)]) for x in (0, 1)]
        not_a_fault = rack.wakeup(0, 7, agree, [2], [2])
        one_late = [
            rack.statement(0, 7, [(0, 1, A), (1, 1, B)]),
            rack.statement(1, 7, [(0, 1, A), (1, 1, A)]),
        ]
        not_conv = rack.wakeup(0, 7, one_late, [2], [2])
        wrong_wake = rack.wakeup(0, 7, good_ev, [2], [])
        by_client = wire.Wakeup(SVC, 65536, 7, good_ev, [2], [2]).signed(rack.signers[0]).encode()
        await n.send(bytes(bad_sig), only_g, not_a_fault, not_conv, wrong_wake, by_client)
        c = n.counters()
        assert c["wakeup_rejected"] == 6, c
        for reason in (
            "bad-signature",
            "too-few-signers",
            "not-a-fault",
            "wrong-wake",
            "bad-sender",
        ):
            assert c[f"wakeup_rejected:{reason}"] >= 1, (reason, c)
        assert n.state(2) == "paused" and n.hv.state(domain) == "paused"
        state_dir = rack.config.service("web").exec_state_dir(rack.config, 2)
        assert not (state_dir / actions.NOTICE_NAME).exists()
        # The valid one wakes replica 2, marks it recovering and leaves the notice.
        await n.send(rack.valid_wakeup())
        assert n.counters()["woken"] == 1
        assert n.state(2) == "recovering" and n.hv.state(domain) == "running"
        notice = json.loads((state_dir / actions.NOTICE_NAME).read_text())
        assert notice["recovering_from_seq"] == 7 and notice["awake"] == [0, 1]
        # Duplicates: the same message, and the same round from another sender.
        await n.send(rack.valid_wakeup(), rack.valid_wakeup(sender=3))
        c = n.counters()
        assert c["wakeup_duplicate"] == 2 and c["woken"] == 1 and c["wakeup_accepted"] == 1


async def test_the_wake_notice_is_written_before_the_replica_runs_again(
    rack: Rack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resumed replica must find the round's seq at once: its links may deliver the log
    the agreement replicas serve at the wake-up before it would look for a notice written
    after the resume (campaign seed 3202 round 18: judged by an earlier round's seq, a spare
    woken again mid-recovery recovered at the new round's checkpoint seq)."""
    async with nodes(rack, "libvirt", 0) as (n,):
        assert (await n.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        path = rack.config.service("web").exec_state_dir(rack.config, 2) / actions.NOTICE_NAME
        seen: list[Any] = []
        real_wake = actions.wake

        def wake(ctx: Any, domain: str, state: str, save: str | None) -> None:
            seen.append(json.loads(path.read_text()) if path.exists() else None)
            real_wake(ctx, domain, state, save)

        monkeypatch.setattr(actions, "wake", wake)
        await n.send(rack.valid_wakeup())
        assert n.state(2) == "recovering"
        assert seen and seen[0] is not None and seen[0]["recovering_from_seq"] == 7, seen


class _Shares(dict[str, int]):
    """libvirt's cpu_shares of each domain, for a test:/// backend that has none."""

    def get_shares(self, name: str) -> int:
        return self.get(name, 1024)

    def set_shares(self, name: str, value: int) -> bool:
        self[name] = value
        return True

    def fake(self, hv: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(hv, "cpu_shares", self.get_shares)
        monkeypatch.setattr(hv, "set_cpu_shares", self.set_shares)


async def test_a_woken_guest_runs_at_a_raised_cpu_weight_until_its_round_settles(
    rack: Rack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """controld raises a woken guest's CPU weight right after the resume (the service waits
    for it) and sets it back once a SHUTDOWN settles its round."""
    async with nodes(rack, "libvirt", 0) as (n,):
        shares = _Shares()
        shares.fake(n.hv, monkeypatch)
        assert (await n.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        domain = n.daemon.inventory.get("web", 2).domain
        assert shares[domain] == 1024  # booted at a small weight, set back before its sleep
        await n.send(rack.valid_wakeup())
        assert n.state(2) == "recovering" and shares[domain] == actions.WAKE_SHARES
        assert n.counters()["wake_priority_raised"] == 1
        await n.send(*(rack.shutdown(r, 7, convict=[0], sleep=[]) for r in (0, 1)))
        assert n.state(2) == "active", "\n".join(n.daemon.recent)
        assert shares[domain] == 1024 and n.counters()["wake_priority_lowered_settled"] == 1
        assert not n.daemon._prioritised


@pytest.mark.parametrize("off", [False, True])
async def test_a_woken_guests_weight_falls_back_by_timer_and_stays_when_off(
    rack: Rack, monkeypatch: pytest.MonkeyPatch, off: bool
) -> None:
    """No SHUTDOWN: the weight is set back wake_priority_s after the wake-up.
    ZZ_WAKE_PRIORITY=off (scripts/bench/recovery-phases' baseline): never raised."""
    if off:
        monkeypatch.setenv("ZZ_WAKE_PRIORITY", "off")
    async with nodes(rack, "libvirt", 0) as (n,):
        shares = _Shares()
        shares.fake(n.hv, monkeypatch)
        assert (await n.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        domain = n.daemon.inventory.get("web", 2).domain
        n.daemon.wake_priority_s = 0.05
        await n.send(rack.valid_wakeup())
        assert n.state(2) == "recovering"
        if off:
            assert shares[domain] == 1024 and "wake_priority_raised" not in n.counters()
            return
        deadline = time.monotonic() + 10
        while "wake_priority_lowered_timer" not in n.counters():
            assert time.monotonic() < deadline, "\n".join(n.daemon.recent)
            await asyncio.sleep(0.02)
        assert shares[domain] == 1024


@pytest.mark.parametrize("backend", ["libvirt", "process"])
async def test_wakeup_hibernated(tmp_path: Path, backend: str) -> None:
    rack = make_rack(tmp_path, sleep="hibernated")
    async with nodes(rack, backend, 0) as (n,):
        r = await n.rpc("provision", service="web", index=2)  # the service's mode
        assert r["ok"] and r["replica"]["state"] == "hibernated", r
        rec = n.daemon.inventory.get("web", 2)
        assert rec.save_file and Path(rec.save_file).exists()
        with pytest.raises(DomainNotFound):
            n.hv.state(rec.domain)  # saved: the domain is gone until restore
        if backend == "libvirt":
            assert n.hv.list() == [d for d in n.hv.list() if d != rec.domain]
        await n.send(rack.valid_wakeup())
        assert n.state(2) == "recovering" and n.hv.state(rec.domain) == "running"
        # Restored as it was saved: the balloon grows once a SHUTDOWN keeps it active.
        assert n.hv.memory_kib(rec.domain) == 192 * 1024
        assert n.daemon.wakes[-1]["from"] == "hibernated" and "grown_at" not in n.daemon.wakes[-1]
        await n.send(*(rack.shutdown(r, 7, convict=[0], sleep=[]) for r in (0, 1)))
        assert n.state(2) == "active", "\n".join(n.daemon.recent)
        assert n.hv.memory_kib(rec.domain) == 512 * 1024  # grown back to its full memory
        c = n.counters()
        assert c["grown_recovered"] == 1 and "grown_timer" not in c
        assert n.daemon.wakes[-1]["grown_at"] >= n.daemon.wakes[-1]["agent_woke_at"]


async def test_wakeup_hibernated_grows_by_timer_and_at_restart(tmp_path: Path) -> None:
    """No SHUTDOWN: the balloon grows grow_after_s after the wake-up. A controld that
    stopped before it grew one grows it when it starts again (the domain runs on)."""
    rack = make_rack(tmp_path, sleep="hibernated")
    keep = open_backend("libvirt", uri="test:///default")  # libvirtd across the restart
    try:
        async with nodes(rack, "libvirt", 0) as (n,):
            assert (await n.rpc("provision", service="web", index=2))["ok"]
            domain = n.daemon.inventory.get("web", 2).domain
            n.daemon.grow_after_s = 0.05
            await n.send(rack.valid_wakeup())
            deadline = time.monotonic() + 10
            while "grown_timer" not in n.counters():
                assert time.monotonic() < deadline, "\n".join(n.daemon.recent)
                await asyncio.sleep(0.02)
            assert n.hv.memory_kib(domain) == 512 * 1024
        # Woken, then stopped before the timer: the next controld grows it at its start.
        (tmp_path / "again").mkdir()
        rack2 = make_rack(tmp_path / "again", sleep="hibernated")
        n = Node(rack2, 0, "libvirt")
        await n.start()
        try:
            assert (await n.rpc("provision", service="web", index=2))["ok"]
            domain = n.daemon.inventory.get("web", 2).domain
            await n.send(rack2.valid_wakeup())
            assert n.hv.memory_kib(domain) == 192 * 1024 and n.state(2) == "recovering"
        finally:
            await n.close(destroy=False)
        n2 = Node(rack2, 0, "libvirt")
        await n2.start()
        try:
            assert n2.counters()["grown_at_start"] == 1
            assert n2.hv.memory_kib(domain) == 512 * 1024
        finally:
            await n2.close()
    finally:
        close_keeping_backend(keep, rack)


# ---- a round that wakes nobody (docs/fault-detection.md §4a) ---------------------------

NONE = (0, bytes(32))  # a row entry "nothing"


def _empty_round_evidence(rack: Rack, signers: tuple[int, ...] = (0, 1)) -> list[bytes]:
    """Rows over {0, 1, 2} after a round whose spare 2 was overdue: 0 and 1 disagree."""
    return [rack.statement(r, 7, [(0, 1, A), (1, 1, B), (2, *NONE)]) for r in signers]


async def test_a_round_that_wakes_nobody(rack: Rack) -> None:
    """A WAKEUP with an empty wake list is acted on (nothing to wake, the round recorded)
    only when it is justified: g+1 statements over 2f+1 awake with nobody asleep. Its
    SHUTDOWN then convicts as any other, and the fresh spare of the convicted slot sleeps."""
    async with nodes(rack, "process", 2) as (h2,):  # h2 hosts replica 1
        assert (await h2.rpc("provision", service="web", index=1, mode="active"))["ok"]
        over_two = [rack.statement(r, 7, [(0, 1, A), (1, 1, B)]) for r in (0, 1)]
        ev = _empty_round_evidence(rack)
        await h2.send(
            rack.wakeup(0, 7, over_two, [], []),  # f+1 awake: could not decide
            rack.wakeup(0, 7, ev[:1], [], []),  # g statements
            rack.wakeup(3, 7, [ev[0], ev[0]], [], []),  # one signer twice
        )
        c = h2.counters()
        assert c["wakeup_rejected:empty-round"] == 1, c
        assert c["wakeup_rejected:too-few-signers"] == 1, c
        assert c["wakeup_rejected:duplicate-signer"] == 1, c
        assert "wakeup_accepted" not in c
        await h2.send(rack.wakeup(0, 7, ev, [], []), rack.wakeup(3, 7, ev, [], []))
        c = h2.counters()
        assert c["wakeup_accepted"] == 1 and c["wakeup_duplicate"] == 1, c
        assert "woken" not in c and h2.state(1) == "active"
        votes = [
            wire.Shutdown(SVC, r, 7, [0, 1, 2], [1], [], [0, 2]).signed(rack.signers[r]).encode()
            for r in (0, 1)
        ]
        await h2.send(*votes)
        c = h2.counters()
        assert c["shutdown_accepted"] == 1 and c["convicted"] == 1 and c["reprovisioned"] == 1
        rec = h2.daemon.inventory.get("web", 1)
        assert rec.state == "paused" and h2.hv.state(rec.domain) == "paused"


async def test_a_round_that_wakes_nobody_while_a_spare_sleeps_here(tmp_path: Path) -> None:
    """f = 1 with four execution replicas (active = 4), spare 3 asleep on h0: a WAKEUP over
    {0, 1, 2} that hides 3 (sleeping []) verifies, but the rules would wake 3, so controld
    refuses it and records nothing; the WAKEUP that wakes 3 for that round is acted on."""
    rack = make_rack(tmp_path, active=4)
    async with nodes(rack, "process", 0) as (h0,):  # h0 hosts replica 3
        assert (await h0.rpc("provision", service="web", index=3, mode="paused"))["ok"]
        ev = _empty_round_evidence(rack)
        await h0.send(rack.wakeup(0, 7, ev, [], []))
        c = h0.counters()
        assert c["wakeup_rejected:spare-asleep"] == 1 and "wakeup_accepted" not in c, c
        assert h0.state(3) == "paused"
        await h0.send(rack.wakeup(1, 7, ev, [3], [3]))
        c = h0.counters()
        assert c["wakeup_accepted"] == 1 and c["woken"] == 1, c
        assert h0.state(3) == "recovering"


# ---- SHUTDOWN ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["libvirt", "process"])
async def test_shutdown_certificate(rack: Rack, backend: str) -> None:
    # h2 hosts replica 1 (active, the faulty one), h0 the spare 2.
    async with nodes(rack, backend, 0, 2) as (h0, h2):
        assert (await h2.rpc("provision", service="web", index=1, mode="active"))["ok"]
        assert (await h0.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        old_dom = h2.daemon.inventory.get("web", 1).domain
        state1 = rack.config.service("web").exec_state_dir(rack.config, 1)
        (state1 / "marker").write_text("evidence")
        await h0.send(rack.valid_wakeup())
        assert h0.state(2) == "recovering"
        # g = 1 vote: no certificate, nothing happens.
        v0 = rack.shutdown(0, 7, convict=[1], sleep=[])
        await h2.send(v0)
        assert h2.state(1) == "active" and h2.hv.state(old_dom) == "running"
        assert h2.counters()["shutdown_votes"] == 1 and "shutdown_accepted" not in h2.counters()
        # A conflicting second vote from the same replica is refused.
        await h2.send(rack.shutdown(0, 7, convict=[0], sleep=[]))
        assert h2.counters()["shutdown_rejected:conflicting"] == 1
        # A vote with a bad signature does not count.
        forged = bytearray(rack.shutdown(2, 7, convict=[1], sleep=[]))
        forged[-5] ^= 0x40
        await h2.send(bytes(forged))
        assert h2.counters()["shutdown_rejected:bad-signature"] == 1
        assert h2.state(1) == "active"
        # g+1 = 2 matching votes: destroy, keep the state aside, provision a fresh spare.
        await h2.send(rack.shutdown(1, 7, convict=[1], sleep=[]))
        c = h2.counters()
        assert c["shutdown_accepted"] == 1 and c["convicted"] == 1 and c["reprovisioned"] == 1
        rec = h2.daemon.inventory.get("web", 1)
        assert rec.state == "paused" and rec.role == "standby"
        assert h2.hv.state(rec.domain) == "paused"
        kept = state1.with_name("exec-1.forensic-7")
        assert (kept / "marker").read_text() == "evidence"
        assert not (state1 / "marker").exists()
        f = await h2.rpc("forensics")
        assert [(x["kind"], x["name"]) for x in f["forensics"]] == [("dir", str(kept))]
        assert (await h2.rpc("purge_forensics", older_than_s=3600))["purged"] == []
        assert not (await h2.rpc("purge_forensics"))["ok"]  # no default: evidence stays
        assert (await h2.rpc("purge_forensics", older_than_s=0))["purged"] == [str(kept)]
        assert not kept.exists() and (await h2.rpc("forensics"))["forensics"] == []
        # The same certificate again (late third vote, replayed votes): nothing.
        await h2.send(rack.shutdown(2, 7, convict=[1], sleep=[]), v0)
        c = h2.counters()
        assert c["convicted"] == 1 and c["reprovisioned"] == 1
        # h0 hosts nothing convicted; the SHUTDOWN keeps its woken spare 2 running, which
        # is active from now on; a stale WAKEUP of the resolved round does nothing.
        await h0.send(rack.shutdown(0, 7, convict=[1], sleep=[]), rack.shutdown(1, 7, [1], []))
        assert (
            h0.state(2) == "active"
            and h0.hv.state(h0.daemon.inventory.get("web", 2).domain) == "running"
        )
        await h0.send(rack.valid_wakeup(seq=5))
        assert h0.counters()["wakeup_stale"] == 1


async def test_shutdown_puts_extra_replicas_back_to_sleep(rack: Rack) -> None:
    async with nodes(rack, "libvirt", 0) as (h0,):
        assert (await h0.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        await h0.send(rack.valid_wakeup())
        assert h0.state(2) == "recovering"
        dom = h0.daemon.inventory.get("web", 2).domain
        await h0.send(*(rack.shutdown(r, 7, convict=[1], sleep=[2]) for r in (0, 1)))
        assert h0.state(2) == "paused" and h0.hv.state(dom) == "paused"


async def test_a_woken_replica_the_shutdown_does_not_name_goes_back_to_sleep(rack: Rack) -> None:
    """Agreement replicas build their WAKEUPs for one round from the statements each holds,
    and how many spares the rules wake depends on the rows: this controld may act on a
    WAKEUP that woke a spare the round's outcome never counted (f = 2, campaign seed 3202,
    a rerun's round 3: spare 4 ran on, asleep in every agreement replica's view). Here the
    f = 1 form: the certificate for round (7, [0, 1]) names 0 and 1 only, not the spare 2
    this controld woke for that round."""
    async with nodes(rack, "libvirt", 0) as (h0,):
        assert (await h0.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        await h0.send(rack.valid_wakeup())
        assert h0.state(2) == "recovering"
        dom = h0.daemon.inventory.get("web", 2).domain
        votes = [
            wire.Shutdown(SVC, r, 7, [0, 1], [1], [], [0]).signed(rack.signers[r]).encode()
            for r in (0, 1)
        ]
        await h0.send(*votes)
        assert h0.counters()["shutdown_accepted"] == 1
        assert h0.state(2) == "paused" and h0.hv.state(dom) == "paused"
        assert h0.counters()["woken_not_named"] == 1


async def test_a_spare_woken_for_a_sibling_sleeps_once_the_lower_seq_is_settled(
    rack: Rack,
) -> None:
    """One fault flagged at 7 and 8 (siblings): this controld woke spare 2 for the WAKEUP
    at 8; the certificate it acts on is the one at 7, over the same awake set, and does not
    name 2 (f = 1 form, as above): 2 goes back to sleep as well."""
    async with nodes(rack, "libvirt", 0) as (h0,):
        assert (await h0.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        await h0.send(rack.valid_wakeup(seq=8))
        assert h0.state(2) == "recovering"
        votes = [
            wire.Shutdown(SVC, r, 7, [0, 1], [1], [], [0]).signed(rack.signers[r]).encode()
            for r in (0, 1)
        ]
        await h0.send(*votes)
        assert h0.counters()["shutdown_accepted"] == 1
        assert h0.state(2) == "paused", h0.counters()


@pytest.mark.parametrize("order", ["xy", "yx"])
async def test_two_certificates_for_one_seq_are_merged(rack: Rack, order: str) -> None:
    """Correct agreement replicas can split so that two bodies for one round are each
    certified by g+1 (f = 2, campaign seed 3502 round 63: every controld acted on the
    first, zz-agreed settled on another, and convicted the fresh spare it counted as
    active). Both act on the merge (zz.certs.merge_outcomes): the f = 1 form here, round
    (7, [0, 1]) with spare 2 woken, X = convict [1] active [0, 2] (agreement 0 and 1),
    Y = convict [0] sleep [2] active [1] (2 and 3); merged: convict [0, 1] sleep [2]
    active []. Whichever comes first, each host ends the same: 0 and 1 destroyed, their
    state kept aside and fresh spares asleep in their slots, 2 asleep."""
    x = ([1], [], [0, 2])
    y = ([0], [2], [1])

    def cert(body: tuple[list[int], list[int], list[int]], by: tuple[int, int]) -> list[bytes]:
        return [
            wire.Shutdown(SVC, r, 7, [0, 1], *body).signed(rack.signers[r]).encode() for r in by
        ]

    first, second = (cert(x, (0, 1)), cert(y, (2, 3)))[:: 1 if order == "xy" else -1]
    async with nodes(rack, "libvirt", 0, 1, 2) as (h0, h1, h2):
        assert (await h1.rpc("provision", service="web", index=0, mode="active"))["ok"]
        assert (await h2.rpc("provision", service="web", index=1, mode="active"))["ok"]
        assert (await h0.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        svc = rack.config.service("web")
        old = {}
        for h, i in ((h1, 0), (h2, 1)):
            old[i] = h.daemon.inventory.get("web", i).domain
            (svc.exec_state_dir(rack.config, i) / "marker").write_text(f"evidence {i}")
        hosts = (h0, h1, h2)
        for h in hosts:
            await h.send(rack.valid_wakeup())
        assert h0.state(2) == "recovering"
        for h in hosts:
            await h.send(*first)
        for h in hosts:
            c = h.counters()
            assert c["shutdown_accepted"] == 1 and "shutdown_merged" not in c, c
        for h in hosts:
            await h.send(*second)
        for h, i in ((h1, 0), (h2, 1)):
            c = h.counters()
            assert c["shutdown_accepted"] == 1 and c["shutdown_merged"] == 1, c
            assert c["convicted"] == 1 and c["reprovisioned"] == 1, c
            rec = h.daemon.inventory.get("web", i)
            assert rec.state == "paused" and rec.role == "standby"
            assert rec.domain == old[i] and h.hv.state(rec.domain) == "paused"
            kept = svc.exec_state_dir(rack.config, i).with_name(f"exec-{i}.forensic-7")
            assert (kept / "marker").read_text() == f"evidence {i}"
        assert h0.counters()["shutdown_merged"] == 1
        assert h0.state(2) == "paused"
        assert h0.hv.state(h0.daemon.inventory.get("web", 2).domain) == "paused"
        merged = "SHUTDOWN web seq 7 convict [0, 1] sleep [2] active [] (merged with another"
        assert any(merged in line for line in h0.daemon.recent), list(h0.daemon.recent)
        # The merged outcome is kept (freshness.json): a certificate of the follow-up round
        # at 7 saying the same, or either one again, does nothing more.
        follow = [
            wire.Shutdown(SVC, r, 7, [0, 1, 2], [0, 1], [2], []).signed(rack.signers[r]).encode()
            for r in (0, 1)
        ]
        for h in hosts:
            await h.send(*follow, *first, *second)
        for h in hosts:
            c = h.counters()
            assert c["shutdown_merged"] == 1 and c["shutdown_stale"] == 1, c
        assert h1.counters()["convicted"] == 1 and h2.counters()["convicted"] == 1
    # The audit log holds the second certificate, verdict merged, with the merged lists;
    # it verifies offline.
    logs = audit.load_hosts(rack.config, "h0")
    entry = next(e for e in logs[0].scan.entries if e.verdict == "merged")
    assert entry.kind == "shutdown-certificate" and entry.messages == tuple(second)
    assert [entry.header[f"merged_{k}"] for k in ("convict", "sleep", "active")] == [
        [0, 1], [2], [],
    ]  # fmt: skip
    assert not [f for f in audit.verify_logs(rack.config, logs).findings if f.level == "error"]


# ---- restart ----------------------------------------------------------------------------


async def test_restart_mid_transition(rack: Rack) -> None:
    """controld stops after writing a WAKEUP's transition ahead and resuming the domain,
    before confirming: the restarted daemon settles it from the hypervisor, reports it,
    and a duplicate of the WAKEUP does nothing."""
    # test:/// state lives as long as a connection to it: this one stands for libvirtd.
    keep = open_backend("libvirt", uri="test:///default")
    try:
        await _restart_mid_transition(rack)
    finally:
        keep.close()


async def _restart_mid_transition(rack: Rack) -> None:
    n = Node(rack, 0, "libvirt")
    await n.start()
    try:
        assert (await n.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        rec = n.daemon.inventory.get("web", 2)
        n.daemon.freshness.acted_wakeup(
            __import__("zz.certs", fromlist=["x"]).verify_wakeup(
                rack.valid_wakeup(), keys=n.daemon.keys.services[SVC], f=1, g=1, n_exec=3
            )
        )
        n.daemon.freshness.save(n.daemon.freshness_path)
        n.daemon.inventory._begin(rec, inv.RECOVERING, rec.save_file)  # written ahead...
        n.hv.resume(rec.domain)  # ...the action ran, and then controld died
    finally:
        await n.close(destroy=False)
    n2 = Node(rack, 0, "libvirt")
    await n2.start()
    try:
        assert n2.daemon.inventory.get("web", 2).state == "recovering"
        st = await n2.rpc("status")
        assert (
            len(st["in_doubt_at_start"]) == 1 and "confirmed" in st["in_doubt_at_start"][0]["error"]
        )
        assert st["lost"] == []
        await n2.send(rack.valid_wakeup())
        c = n2.counters()
        assert c["wakeup_duplicate"] == 1 and "woken" not in c
    finally:
        await n2.close()


def _procs_with(text: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace"
                ):
                    out.append(int(d.name))
    return out


@pytest.fixture
def kill_leftovers(rack: Rack) -> Iterator[None]:
    yield
    for pid in _procs_with(str(rack.path)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _start_controld(rack: Rack, port: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "zz.controld",
        "--config",
        str(rack.path),
        "--host",
        "h0",
        "--backend",
        "process",
        "--port",
        str(port),
        "--ready-timeout",
        "30",
    ]
    p = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=repo_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline().decode()
    assert "listening" in line, line
    return p


async def test_controld_killed_and_restarted(rack: Rack, kill_leftovers: None) -> None:
    port = free_port()
    ctl = keys.controld_principal(0)
    key = rack.op_keys[ctl]

    async def rpc(op: dict[str, Any]) -> dict[str, Any]:
        return await call("127.0.0.1", port, operator=OP, controld=ctl, key=key, op=op, timeout=60)

    async def send(raw: bytes) -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(wire.frame(raw))
        w.write(control_request(OP, ctl, key, time.time_ns(), {"op": "list"}))
        await w.drain()
        await asyncio.wait_for(wire.read_frame(r), 10)
        w.close()

    p = _start_controld(rack, port)
    first = time.time_ns()
    try:
        r = await call(
            "127.0.0.1",
            port,
            operator=OP,
            controld=ctl,
            key=key,
            request_id=first,
            op={"op": "provision", "service": "web", "index": 2, "mode": "paused"},
        )
        assert r["ok"], r
        await send(rack.valid_wakeup())
        for _ in range(200):
            st = await rpc({"op": "status"})
            if st["replicas"][0]["state"] == "recovering":
                break
            await asyncio.sleep(0.05)
        assert st["counters"]["woken"] == 1
    finally:
        p.kill()
        p.wait()
    # The replica process outlives the killed controld; its children cannot be adopted.
    assert _procs_with(f"--rack {rack.path} --service web --index 2")
    p = _start_controld(rack, port)
    try:
        st = await rpc({"op": "status"})
        assert [(x["index"], x["state"]) for x in st["replicas"]] == [(2, "recovering")]
        assert [x["index"] for x in st["lost"]] == [2]  # reported, not acted upon
        await send(rack.valid_wakeup())
        st = await rpc({"op": "status"})
        assert st["counters"]["wakeup_duplicate"] == 1 and "woken" not in st["counters"]
        # The operator's ids are persisted too: the provision's id is still refused.
        old = await call(
            "127.0.0.1",
            port,
            operator=OP,
            controld=ctl,
            key=key,
            op={"op": "list"},
            request_id=first,
        )
        assert not old["ok"] and "reused" in old["error"]
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=20)


# ---- failures leave the inventory consistent ---------------------------------------------


async def test_provision_failure_is_rolled_back(rack: Rack) -> None:
    """The runtime cannot start (its key file is gone): the reply says so, nothing is
    left running and the inventory does not keep the replica."""
    keys.secret_path(rack.config.rack.key_dir, SVC, wire.exec_principal(2)).unlink()
    async with nodes(rack, "process", 0) as (n,):
        r = await n.rpc("provision", service="web", index=2, mode="paused")
        assert not r["ok"] and "stopped while booting" in r["error"], r
        assert "(console: " in r["error"] and "p258.secret: cannot read" in r["error"], r
        assert r["replica"] is None and n.daemon.inventory.replicas() == []
        assert n.hv.list() == []
        # The slot is free again for a later, successful attempt.
        assert n.counters()["control_failed"] == 1


async def test_fresh_spare_that_fails_to_boot_is_tried_once_more(
    rack: Rack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SHUTDOWN: the convicted replica's successor fails to boot once (seen: a TCG guest
    stopped while booting next to five busy ones); controld tries once more, and the
    service gets its spare."""
    async with nodes(rack, "process", 0, 2) as (h0, h2):
        assert (await h2.rpc("provision", service="web", index=1, mode="active"))["ok"]
        assert (await h0.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        await h0.send(rack.valid_wakeup())
        real, calls = actions.provision, []

        def flaky(*args: Any, **kw: Any) -> dict[str, Any]:
            calls.append(args[2])
            if len(calls) == 1:
                raise HypervisorError("zz-x1", "provision", "it stopped while booting")
            return real(*args, **kw)

        monkeypatch.setattr(actions, "provision", flaky)
        await h2.send(*(rack.shutdown(x, 7, convict=[1], sleep=[]) for x in (0, 1)))
        c = h2.counters()
        assert calls == [1, 1] and c["action_failed"] == 1 and c["reprovisioned"] == 1
        assert any("trying once more" in line for line in h2.daemon.recent)
        rec = h2.daemon.inventory.get("web", 1)
        assert rec.state == "paused" and h2.hv.state(rec.domain) == "paused"


def _kv_wakeup(rack: Rack, seq: int, spare: int) -> bytes:
    """A valid WAKEUP of service KV: the two awake replicas disagree, wake `spare`."""
    key_dir = rack.config.rack.key_dir
    sk = {r: keys.load_secret(keys.secret_path(key_dir, KV, r)).sign for r in (0, 1)}
    a, b = (j for j in range(3) if j != spare)
    ev = []
    for r in (0, 1):
        row = [wire.RowEntry(a, 1, A), wire.RowEntry(b, 1, B)]
        signer = sk[r]
        assert signer is not None
        ev.append(wire.FaultStatement(KV, r, seq, row).signed(signer).encode())
    signer = sk[0]
    assert signer is not None
    return wire.Wakeup(KV, 0, seq, ev, [spare], [spare]).signed(signer).encode()


async def _until(what: str, cond: Any, n: Node, most: float = 20.0) -> None:
    """Wait for cond() (a deadlock guard, not a time limit: what is waited for takes
    milliseconds once it can happen)."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < most, f"{what}: never happened\n" + "\n".join(
            n.daemon.recent
        )
        await asyncio.sleep(0.02)


async def test_fresh_spare_provisioning_does_not_hold_up_other_certificates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SHUTDOWN's fresh spare boots in the background of the certificate queue (a TCG
    boot is 60-110 s): while web/1's successor is still provisioning, a WAKEUP of another
    service's spare on the same host is acted on at once; a WAKEUP naming web/1 waits until
    its spare is provisioned and then wakes it (never half-booted, never provisioned
    twice). The spare's provisioning has an audit entry of its own."""
    rack = make_rack(tmp_path, kv=True)
    kv = rack.config.service("kv")
    h2 = rack.config.service("web").exec_host(rack.config, 1).index
    spare = next(j for j in range(3) if kv.exec_host(rack.config, j).index == h2)
    release = threading.Event()
    real, booted = actions.provision, []

    def blocked(ctx: Any, svc: Any, index: int, *args: Any, **kw: Any) -> dict[str, Any]:
        booted.append((svc.name, index))
        if svc.name == "web":
            assert release.wait(60), "never released"
        return real(ctx, svc, index, *args, **kw)

    async with nodes(rack, "libvirt", h2) as (n,):
        try:
            assert (await n.rpc("provision", service="web", index=1, mode="active"))["ok"]
            assert (await n.rpc("provision", service="kv", index=spare, mode="paused"))["ok"]
            monkeypatch.setattr(actions, "provision", blocked)
            votes = [rack.shutdown(x, 7, convict=[1], sleep=[]) for x in (0, 1)]
            await n.send(*votes, wait=False)
            await _until("web/1 convicted", lambda: n.counters().get("convicted") == 1, n)
            await _until("its successor booting", lambda: ("web", 1) in booted, n)
            # Another service's spare on this host: woken while web/1's spare boots.
            await n.send(_kv_wakeup(rack, 3, spare), wait=False)
            woken = lambda: n.daemon.inventory.get("kv", spare).state == "recovering"  # noqa: E731
            await _until("kv spare woken", woken, n)
            rec = n.daemon.inventory.get("web", 1)
            assert rec.state is None and rec.pending == "paused", rec
            # A WAKEUP naming web/1 itself waits for its spare's provisioning.
            ev = [rack.statement(r, 9, [(0, 1, A), (2, 1, B)]) for r in (0, 1)]
            await n.send(rack.wakeup(0, 9, ev, [1], [1]), wait=False)
            await _until("the wait noted", lambda: n.counters().get("spare_waited") == 1, n)
            rec = n.daemon.inventory.get("web", 1)
            assert rec.state is None and rec.pending == "paused", rec
            assert n.counters()["woken"] == 1  # the kv spare only
        finally:
            release.set()
        await asyncio.wait_for(n.daemon.idle(), 60)
        c = n.counters()
        assert c["reprovisioned"] == 1 and c["woken"] == 2, c
        assert booted == [("web", 1)], booted  # provisioned once
        assert n.state(1) == "recovering"
        recent = "\n".join(n.daemon.recent)
        assert recent.index("provisioned web/1 paused") < recent.index("woke web/1 from paused")
    sc = audit.read(rack.config.rack.run_dir / "controld" / n.host.name / "audit.log")
    acts = [e.header for e in sc.entries if e.kind == "action"]
    what = [(h["what"], h["seq"]) for h in acts if h["service"] == 1]
    assert what == [("shutdown", 7), ("fresh-spare", 7), ("wakeup", 9)], acts
    shutdown = next(h for h in acts if h["what"] == "shutdown")
    fresh = next(h for h in acts if h["what"] == "fresh-spare")
    assert any(x.startswith("convicted web/1") for x in shutdown["lines"]), shutdown
    assert not any(x.startswith("provisioned") for x in shutdown["lines"]), shutdown
    assert fresh["index"] == 1 and any(x.startswith("provisioned web/1") for x in fresh["lines"])
    entry = next(e for e in sc.entries if e.kind == "action" and e.header is fresh)
    assert audit.describe(entry)[0].startswith("fresh spare x1 of SHUTDOWN seq 7 led to: ")
    assert sc.error is None


async def test_a_lower_sibling_never_re_announces_a_convicted_incarnation(
    rack: Rack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """web/1 is convicted at seq 7 (its spare announced under key epoch 1), woken at seq 9
    and convicted again at seq 12; while its epoch-2 successor boots, a lower sibling
    certificate (seq 10, the seq-12 round's awake set) arrives. The slot's fresh spare is
    announced under that seq too, but only once it is up and with its own keys: the epoch-1
    announcement (of the destroyed incarnation) re-sent under seq 10 would tell the
    agreement replicas that a spare sleeps in the slot while it is still booting."""
    release = threading.Event()
    real, booted = actions.provision, []

    def gated(ctx: Any, svc: Any, index: int, *args: Any, **kw: Any) -> dict[str, Any]:
        booted.append(index)
        if len(booted) == 2:
            assert release.wait(60), "never released"
        return real(ctx, svc, index, *args, **kw)

    def shutdown(r: int, seq: int, awake: list[int]) -> bytes:
        m = wire.Shutdown(SVC, r, seq, awake, [1], [], [j for j in (0, 1, 2) if j != 1])
        return m.signed(rack.signers[r]).encode()

    h2 = rack.config.service("web").exec_host(rack.config, 1).index
    async with nodes(rack, "libvirt", h2) as (n,):
        try:
            assert (await n.rpc("provision", service="web", index=1, mode="active"))["ok"]
            monkeypatch.setattr(actions, "provision", gated)
            await n.send(*(shutdown(x, 7, [0, 1]) for x in (0, 1)))
            assert n.state(1) == "paused" and n.counters()["reprovisioned"] == 1
            ev = [rack.statement(r, 9, [(0, 1, A), (2, 1, B)]) for r in (0, 1)]
            await n.send(rack.wakeup(0, 9, ev, [1], [1]))
            assert n.state(1) == "recovering"
            await n.send(*(shutdown(x, 12, [0, 1]) for x in (0, 1)), wait=False)
            await _until("the second successor booting", lambda: len(booted) == 2, n)
            await n.send(*(shutdown(x, 10, [0, 1]) for x in (0, 1)), wait=False)
            assert n.counters()["shutdown_sibling"] == 1, n.counters()
            assert "spare_announced_for_sibling" not in n.counters(), n.counters()
        finally:
            release.set()
        await asyncio.wait_for(n.daemon.idle(), 60)
        assert n.counters()["spare_announced_for_sibling"] == 1, n.counters()
    sc = audit.read(rack.config.rack.run_dir / "controld" / n.host.name / "audit.log")
    sent = [(e.header["seq"], e.header["epoch"]) for e in sc.entries if e.kind == "spare-ready"]
    assert sent == [(7, 1), (12, 2), (10, 2)], sent


def _sent(rack: Rack, host: str) -> list[tuple[int, int]]:
    """(seq, epoch) of the SPARE-READYs controld `host` sent, from its audit log."""
    sc = audit.read(rack.config.rack.run_dir / "controld" / host / "audit.log")
    return [(e.header["seq"], e.header["epoch"]) for e in sc.entries if e.kind == "spare-ready"]


def _fresh_spare_lines(rack: Rack, host: str) -> list[list[str]]:
    """The log lines of each fresh spare's audit entry (action, what fresh-spare)."""
    sc = audit.read(rack.config.rack.run_dir / "controld" / host / "audit.log")
    return [e.header["lines"] for e in sc.entries
            if e.kind == "action" and e.header.get("what") == "fresh-spare"]  # fmt: skip


@pytest.mark.parametrize("left", ["asleep", "booting", "gone"])
async def test_a_fresh_spare_under_way_as_controld_stops_is_finished_at_the_next_start(
    rack: Rack, monkeypatch: pytest.MonkeyPatch, left: str
) -> None:
    """controld stops (or dies) while a fresh spare boots in the background: the record
    stays as written ahead (in doubt), and the next start finishes the job from what the
    hypervisor shows then, in the background like the first boot: `asleep` (the boot's
    thread ran on and paused it) is confirmed; `booting` (the domain runs, never put to
    sleep: controld was killed) is waited for and put to sleep; `gone` (the domain died
    with it) is provisioned anew. Each way the spare ends asleep and its SPARE-READY is sent
    under the SHUTDOWN's seq with the re-key's epoch, and the fresh spare's audit entry
    says what happened. Before, the spare was confirmed (asleep) or kept `active` (booting)
    or forgotten (gone), and never announced."""
    keep = open_backend("libvirt", uri="test:///default")  # test:/// state outlives a daemon
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    real = actions.provision

    def blocked(ctx: Any, svc: Any, index: int, mode: str, *args: Any, **kw: Any) -> Any:
        entered.set()
        try:
            if left == "asleep":  # the thread runs on after the stop and finishes the boot
                assert release.wait(60), "never released"
                return real(ctx, svc, index, mode, *args, **kw)
            # booting, gone: the domain is created, and controld dies before it is up
            ctx.hv.create(actions.replica_spec(ctx, svc, index, asleep=True, mode=mode))
            assert release.wait(60), "never released"
            raise RuntimeError("controld was killed: this thread never went on")
        finally:
            done.set()

    h2 = rack.config.service("web").exec_host(rack.config, 1).index
    host = rack.config.hosts[h2].name
    domain = domain_name(rack.config, rack.config.service("web"), 1)
    n = Node(rack, h2, "libvirt")
    try:
        await n.start()
        assert (await n.rpc("provision", service="web", index=1, mode="active"))["ok"]
        monkeypatch.setattr(actions, "provision", blocked)
        await n.send(*(rack.shutdown(x, 7, convict=[1], sleep=[]) for x in (0, 1)), wait=False)
        await _until("the spare booting", entered.is_set, n)
        await n.daemon.stop()
        rec = n.daemon.inventory.get("web", 1)
        assert rec.state is None and rec.pending == "paused", rec
        release.set()
        assert await asyncio.to_thread(done.wait, 60)
    finally:
        release.set()
        n.hv.close()
        monkeypatch.setattr(actions, "provision", real)
    assert _sent(rack, host) == []  # never announced by the stopped controld
    shown = {"asleep": "paused", "booting": "running", "gone": "running"}[left]
    assert keep.state(domain) == shown
    if left == "gone":
        keep.destroy(domain)  # e.g. the guest died with the host's controld
    n2 = Node(rack, h2, "libvirt")
    try:
        await n2.start()
        await asyncio.wait_for(n2.daemon.idle(), 30)
        rec = n2.daemon.inventory.get("web", 1)
        assert rec.state == "paused" and rec.pending is None, rec
        assert n2.hv.state(rec.domain) == "paused"
        assert _sent(rack, host) == [(7, 1)]  # the re-key's announcement, not a new epoch
        assert rec.successor_of is None, rec
        st = await n2.rpc("status")
        (doubt,) = st["in_doubt_at_start"]
        assert "finished in the background" in doubt["error"], doubt
        assert st["lost"] == [] and st["orphans"] == [], st
        c = n2.counters()
        anew = "spare_reprovisioned_at_start"
        assert c.get(anew, 0) == (left == "gone") and c["reprovisioned"] == 1, c
        assert c.get("spare_finished_at_start", 0) == (left != "gone"), c
    finally:
        await n2.close()
        close_keeping_backend(keep, rack)
    *_, lines = _fresh_spare_lines(rack, host)
    assert "provisioned paused when controld stopped: finishing it" in lines[0], lines
    assert any(x.startswith("provisioned web/1 paused") for x in lines), lines
    assert lines[-1].startswith("SPARE-READY web/1 seq 7"), lines
    found = {"asleep": "'found': 'paused'", "booting": "'found': 'running'"}
    if left in found:
        assert found[left] in "\n".join(lines), lines
    else:
        assert any("cannot be finished" in x and "provisioning it anew" in x for x in lines)


async def test_halt_stops_a_fresh_spare_booting_in_the_background(
    rack: Rack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`halt` (zz rack stop/down) while a convicted slot's fresh spare boots in the
    background: the provisioning is stopped and waited for before the destroys, and not
    tried again, so no domain is left (or created) once halt has answered; no certificate
    starts one until an operator provisions again. Before, halt destroyed the booting
    domain, the boot failed and its retry created a new one after the halt."""
    held, release = threading.Event(), threading.Event()
    created: list[str] = []

    def hold(domain: str, *args: Any) -> None:  # right after each create
        created.append(domain)
        if len(created) == 1:
            held.set()
            assert release.wait(60), "never released"

    web = rack.config.service("web")
    h2 = web.exec_host(rack.config, 1).index
    async with nodes(rack, "libvirt", h2) as (n,):
        try:
            assert (await n.rpc("provision", service="web", index=1, mode="active"))["ok"]
            monkeypatch.setattr(actions, "_test_hold", hold)
            await n.send(*(rack.shutdown(x, 7, convict=[1], sleep=[]) for x in (0, 1)),
                         wait=False)  # fmt: skip
            await _until("the successor booting", held.is_set, n)
            halt = asyncio.create_task(n.rpc("halt"))
            # Its first line (with the fix: the provisioning is stopped; before: a destroy).
            began = lambda: halt.done() or any(  # noqa: E731
                x.split(" ", 1)[1].startswith("halt") for x in n.daemon.recent
            )
            await _until("the halt under way", began, n)
        finally:
            release.set()
        answer = await asyncio.wait_for(halt, 30)
        assert answer["ok"], answer
        await asyncio.wait_for(n.daemon.idle(), 30)
        ours = [d for d in n.hv.list() if rack.config.rack.name in d]
        assert ours == [] and len(created) == 1, (ours, created, list(n.daemon.recent))
        assert "reprovisioned" not in n.counters(), "\n".join(n.daemon.recent)
        assert n.daemon.inventory.replicas() == []
        assert n.counters()["halted_not_acted"] == 1, n.counters()
        # Halted: a later conviction's successor is not provisioned either ...
        assert (await n.rpc("provision", service="web", index=1, mode="active"))["ok"]
        assert (await n.rpc("halt"))["destroyed"] == [domain_name(rack.config, web, 1)]
        round9 = [wire.Shutdown(SVC, r, 9, [0, 1, 2], [1], [], [0, 2]) for r in (0, 1)]
        await n.send(*(m.signed(rack.signers[m.sender]).encode() for m in round9))
        assert n.counters()["convicted"] == 2, n.counters()
        assert [d for d in n.hv.list() if rack.config.rack.name in d] == [], n.counters()
        assert n.counters()["halted_not_acted"] == 2, n.counters()
        # ... until an operator provisions again (`zz rack start`).
        assert (await n.rpc("provision", service="web", index=1, mode="paused"))["ok"]
        assert n.state(1) == "paused"


async def test_wake_failure_is_reported(tmp_path: Path) -> None:
    """A hibernated replica whose save file vanished cannot be woken: the WAKEUP is spent,
    the record keeps its state with the error, nothing else changes."""
    rack = make_rack(tmp_path, sleep="hibernated")
    async with nodes(rack, "libvirt", 0) as (n,):
        assert (await n.rpc("provision", service="web", index=2))["ok"]
        save = n.daemon.inventory.get("web", 2).save_file
        assert save is not None
        Path(save).unlink()
        await n.send(rack.valid_wakeup())
        rec = n.daemon.inventory.get("web", 2)
        assert rec.state == "hibernated" and rec.pending is None
        assert rec.error and "recovering failed" in rec.error
        assert n.counters()["action_failed"] == 1 and "woken" not in n.counters()
        st = await n.rpc("status")
        assert any("failed" in line for line in st["recent"])


async def test_operator_destroy(rack: Rack) -> None:
    async with nodes(rack, "libvirt", 0) as (n,):
        assert (await n.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        dom = n.daemon.inventory.get("web", 2).domain
        r = await n.rpc("destroy", service="web", index=2)
        assert r["ok"] and r["destroyed"] == dom and r["replica"] is None
        assert dom not in n.hv.list() and n.daemon.inventory.replicas() == []
        r = await n.rpc("destroy", service="web", index=2)
        assert not r["ok"] and "no replica web/2" in r["error"]


# ---- a real guest on qemu:///system -----------------------------------------------------


def real_vm_dir() -> Path:
    """A world-readable temp dir for a rack of real guests (libvirt's QEMU must reach the
    run dirs and the share); skips the test without root or qemu:///system."""
    if os.geteuid() != 0:
        pytest.skip("needs root (qemu:///system, /var/cache/zz-images)")
    try:
        import libvirt  # type: ignore[import-not-found]

        libvirt.open("qemu:///system").close()
    except Exception as e:  # ImportError or libvirtError
        pytest.skip(f"qemu:///system not available: {e}")
    d = Path(tempfile.mkdtemp(prefix="zz-controld-vm-"))
    os.chmod(d, 0o755)
    return d


@pytest.fixture
def real_vm_rack() -> Iterator[Rack]:
    """A rack in real_vm_dir(); skipped without root, libvirt or the image tools."""
    d = real_vm_dir()
    try:
        yield make_rack(d, uri="qemu:///system")
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
async def test_real_guest_wakeup(real_vm_rack: Rack) -> None:
    """Provision a paused replica as a real VM, reject a forged WAKEUP (still paused, the
    guest does not answer), wake it with a valid one (the guest answers, and its agent
    wrote the wake file into the 9p-shared state dir), destroy it; nothing is left."""
    rack = real_vm_rack
    sys.path.insert(0, str(REPO / "images"))
    import build  # type: ignore[import-not-found]

    image = (await asyncio.to_thread(build.build)).directory
    n = Node(rack, 0, "libvirt", uri="qemu:///system", image=image, ready_timeout=180)
    await n.start()
    domain = domain_name(rack.config, rack.config.service("web"), 2)
    try:
        r = await n.rpc("provision", service="web", index=2, mode="paused")
        assert r["ok"], r
        assert n.hv.state(domain) == "paused"
        boot = r["answering_s"]
        # It booted at a small CPU weight (its cgroup's: nice would not rank it against the
        # other guests, scripts/bench/spare-weight) and sleeps with the domain default.
        low, default = r["boot_cpu_shares"]
        assert r["low_priority_boot"] is True and low == actions.SPARE_BOOT_SHARES < default
        assert n.hv.cpu_shares(domain) == default
        with pytest.raises(HypervisorError):
            await asyncio.to_thread(n.hv.guest_call, domain, "ping", 1.0)
        ev = [rack.statement(0, 7, [(0, 1, A), (1, 1, B)])]
        await n.send(rack.wakeup(0, 7, ev, [2], [2]))  # only g signers: forged
        assert n.counters()["wakeup_rejected:too-few-signers"] == 1
        assert n.state(2) == "paused" and n.hv.state(domain) == "paused"
        t0 = time.monotonic()
        await n.send(rack.valid_wakeup())
        woke = time.monotonic() - t0
        assert n.state(2) == "recovering" and n.hv.state(domain) == "running"
        assert "guest_wake_failed" not in n.counters(), "\n".join(n.daemon.recent)
        reply = await asyncio.to_thread(n.hv.guest_call, domain, "ping", 5.0)
        assert reply["agent"] == "zz-guest"
        state = rack.config.service("web").exec_state_dir(rack.config, 2)
        assert json.loads((state / "zz-wake.json").read_text())["seq"] == 7
        assert json.loads((state / actions.NOTICE_NAME).read_text())["recovering_from_seq"] == 7
        r = await n.rpc("destroy", service="web", index=2)
        assert r["ok"], r
        print(f"\nreal guest: booted and answering in {boot:.1f} s, WAKEUP to woken {woke:.2f} s")
    finally:
        with contextlib.suppress(Exception):
            n.hv.destroy(domain)
        await n.close()
    virsh = ["virsh", "-c", "qemu:///system", "list", "--all", "--name"]
    out = subprocess.run(virsh, capture_output=True, text=True, check=True).stdout
    assert domain not in out.split()


@pytest.mark.slow
@pytest.mark.long
async def test_real_guest_hibernated_shutdown_restart(tmp_path: Path) -> None:
    """A real hibernated replica: provision (boot, balloon, save), a forged WAKEUP does
    nothing, a valid one restores it and grows it back; a SHUTDOWN certificate convicting
    it destroys it and provisions a fresh hibernated spare; controld restarts (the saved
    spare is found again, not lost), a replayed WAKEUP is refused and a new round wakes
    the fresh spare."""
    if os.geteuid() != 0:
        pytest.skip("needs root (qemu:///system, /var/cache/zz-images)")
    try:
        import libvirt  # type: ignore[import-not-found]

        libvirt.open("qemu:///system").close()
    except Exception as e:  # ImportError or libvirtError
        pytest.skip(f"qemu:///system not available: {e}")
    d = Path(tempfile.mkdtemp(prefix="zz-controld-vm-"))
    os.chmod(d, 0o755)
    rack = make_rack(d, sleep="hibernated", uri="qemu:///system")
    sys.path.insert(0, str(REPO / "images"))
    import build  # type: ignore[import-not-found]

    image = (await asyncio.to_thread(build.build)).directory
    opts: dict[str, Any] = {"uri": "qemu:///system", "image": image, "ready_timeout": 180}
    domain = domain_name(rack.config, rack.config.service("web"), 2)
    n = Node(rack, 0, "libvirt", **opts)
    n2: Node | None = None
    try:
        await n.start()
        r = await n.rpc("provision", service="web", index=2)
        assert r["ok"] and r["replica"]["state"] == "hibernated", r
        save = Path(r["replica"]["save_file"])
        assert save.exists() and domain not in n.hv.list()
        bad = bytearray(rack.valid_wakeup())
        bad[-1] ^= 1
        await n.send(bytes(bad))
        assert n.counters()["wakeup_rejected:bad-signature"] == 1 and n.state(2) == "hibernated"
        t0 = time.monotonic()
        await n.send(rack.valid_wakeup())
        woke = time.monotonic() - t0
        assert n.state(2) == "recovering" and n.hv.state(domain) == "running"
        # The balloon deflates while the guest runs (paged-out restore): it gets there.
        deadline = time.monotonic() + 60
        while n.hv.memory_kib(domain) < 512 * 1024 - 1024:
            assert time.monotonic() < deadline, n.hv.memory_kib(domain)
            await asyncio.sleep(0.2)
        assert "guest_wake_failed" not in n.counters(), "\n".join(n.daemon.recent)
        state = rack.config.service("web").exec_state_dir(rack.config, 2)
        assert json.loads((state / "zz-wake.json").read_text())["seq"] == 7
        # SHUTDOWN: g+1 votes convict replica 2; a fresh hibernated spare replaces it.
        await n.send(*(rack.shutdown(x, 7, convict=[2], sleep=[]) for x in (0, 1)))
        c = n.counters()
        assert c["convicted"] == 1 and c["reprovisioned"] == 1, "\n".join(n.daemon.recent)
        assert n.state(2) == "hibernated" and domain not in n.hv.list() and save.exists()
        assert (state.with_name("exec-2.forensic-7") / "zz-wake.json").exists()
        # controld restarts: the saved spare is found again (its save file), not lost.
        await n.close(destroy=False)
        n2 = Node(rack, 0, "libvirt", **opts)
        await n2.start()
        st = await n2.rpc("status")
        assert st["lost"] == [] and st["in_doubt_at_start"] == []
        await n2.send(rack.valid_wakeup())  # the resolved round again: stale
        assert n2.counters()["wakeup_stale"] == 1 and n2.state(2) == "hibernated"
        ev = [rack.statement(x, 9, [(0, 1, A), (1, 1, B)]) for x in (0, 1)]
        await n2.send(rack.wakeup(1, 9, ev, [2], [2]))
        assert n2.state(2) == "recovering" and n2.hv.state(domain) == "running"
        assert (await n2.rpc("destroy", service="web", index=2))["ok"]
        assert not save.exists()
        print(f"\nreal hibernated guest: WAKEUP to restored and grown {woke:.2f} s")
    finally:
        for node in (n, n2):
            if node is None:
                continue
            with contextlib.suppress(Exception):
                node.hv.destroy(domain)
            with contextlib.suppress(Exception):
                await node.close()
        shutil.rmtree(d, ignore_errors=True)
    virsh = ["virsh", "-c", "qemu:///system", "list", "--all", "--name"]
    assert domain not in subprocess.run(virsh, capture_output=True, text=True).stdout.split()


# ---- ZFS: the convicted replica's dataset is kept as a snapshot -------------------------

zfs_daemon, pool = zfs_pool.zfs_daemon, zfs_pool.pool


async def test_shutdown_keeps_zfs_snapshot(rack: Rack, pool: str) -> None:
    """Process backend, the runtime on its own ZFS dataset: a SHUTDOWN certificate leaves
    the convicted replica's dataset as <ds>-forensic-7@forensic-7, and the fresh spare
    gets a new, empty dataset under the old name."""
    from zz.snapshots.zfs import dataset_exists, run_zfs

    n = Node(rack, 2, "process", store="zfs", zfs_pool=pool, ready_timeout=60)
    await n.start()
    try:
        r = await n.rpc("provision", service="web", index=1, mode="active")
        assert r["ok"], r
        ds = f"{pool}/s1-exec-1"
        assert dataset_exists(ds)
        live = rack.config.service("web").exec_state_dir(rack.config, 1) / "live"
        (live / "evidence").write_text("x")
        # zfs-fuse refuses to rename a dataset mounted for more than about a second
        # ("dataset is busy"): a guest's is mounted for minutes before its conviction.
        await asyncio.sleep(2)
        await n.send(*(rack.shutdown(x, 7, convict=[1], sleep=[]) for x in (0, 1)))
        c = n.counters()
        assert c["convicted"] == 1 and c["reprovisioned"] == 1, "\n".join(n.daemon.recent)
        snaps = run_zfs(["zfs", "list", "-H", "-t", "snapshot", "-o", "name", "-r", pool])
        assert f"{ds}-forensic-7@forensic-7" in snaps.split()
        assert n.state(1) == "paused" and dataset_exists(ds)  # the fresh one's own
        assert not (live / "evidence").exists()
        fr = await n.rpc("forensics")
        assert fr["ok"], fr
        kinds = sorted(x["kind"] for x in fr["forensics"])
        assert kinds == ["dir", "zfs"]
        r = await n.rpc("purge_forensics", older_than_s=0)
        assert f"{ds}-forensic-7" in r["purged"] and r["failed"] == [], r
        assert not dataset_exists(f"{ds}-forensic-7") and dataset_exists(ds)
    finally:
        await n.close()


async def test_cli_call(rack: Rack) -> None:
    """`zz controld call` as an operator would run it: provision, then status."""
    async with nodes(rack, "libvirt", 0) as (n,):
        base = [sys.executable, "-m", "zz", "controld", "call", "--config", str(rack.path)]
        base += ["--host", "h0", "--port", str(n.port)]

        async def run(*args: str) -> tuple[int, dict[str, Any], str]:
            p = await asyncio.create_subprocess_exec(
                *base, *args, cwd=REPO, env=repo_env(),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            out, err = await asyncio.wait_for(p.communicate(), 60)
            return p.returncode or 0, json.loads(out), err.decode()

        rc, body, err = await run("provision", "service=web", "index=2", "mode=paused")
        assert rc == 0 and body["replica"]["state"] == "paused", (body, err)
        assert "booting web/2" in err  # the progress reply, on stderr
        rc, body, _ = await run("status")
        assert rc == 0 and [r["state"] for r in body["replicas"]] == ["paused"]
        rc, body, _ = await run("provision", "service=web", "index=1")
        assert rc == 1 and "placed on host h2" in body["error"]


async def test_mutated_messages_never_act_or_crash(rack: Rack) -> None:
    """Hundreds of mutations of valid WAKEUP, SHUTDOWN and CONTROL messages (flipped
    bytes, truncations, extensions, changed type bytes): each is dropped and counted,
    nothing is woken or destroyed, and no handler raised (internal_error stays 0)."""
    import random

    rng = random.Random(5)
    async with nodes(rack, "libvirt", 0) as (n,):
        assert (await n.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        key = rack.op_keys[n.principal]
        seeds = [
            rack.valid_wakeup(),
            rack.shutdown(0, 7, convict=[2], sleep=[]),
            _raw_control(rack, n.principal, OP, key, time.time_ns() + 10**18),
        ]
        mutated: list[bytes] = []
        for _ in range(400):
            m = bytearray(rng.choice(seeds))
            kind = rng.randrange(4)
            if kind == 0:
                for _ in range(rng.randint(1, 3)):
                    m[rng.randrange(len(m))] ^= 1 << rng.randrange(8)
            elif kind == 1:
                del m[rng.randrange(16, len(m)) :]
            elif kind == 2:
                m += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
            else:
                m[3] = rng.randrange(32)
            if len(m) >= 16 and bytes(m) not in seeds:  # a type byte set to itself
                mutated.append(bytes(m))
        for i in range(0, len(mutated), 50):
            await n.send(*mutated[i : i + 50])
        c = n.counters()
        assert "internal_error" not in c and "woken" not in c and "convicted" not in c, c
        assert "wakeup_accepted" not in c and "shutdown_accepted" not in c
        drops = ("malformed", "unexpected_type", "control_unknown_principal",
                 "control_bad_mac", "control_replayed", "control_bad_request",
                 "wakeup_rejected", "wakeup_unknown_service", "shutdown_rejected",
                 "shutdown_unknown_service")  # fmt: skip
        dropped = sum(c.get(k, 0) for k in drops)
        assert dropped == len(mutated), c
        assert n.state(2) == "paused"


async def test_convicted_leftover_does_not_block_the_slot(rack: Rack) -> None:
    """controld stopped after destroying a convicted replica but before forgetting it: a
    later provision of that slot works (the record is only bookkeeping)."""
    async with nodes(rack, "libvirt", 0) as (n,):
        assert (await n.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        rec = n.daemon.inventory.get("web", 2)
        await n.daemon.inventory.atransition(
            "web", 2, inv.CONVICTED, lambda: n.hv.destroy(rec.domain)
        )
        r = await n.rpc("provision", service="web", index=2, mode="paused")
        assert r["ok"] and r["replica"]["state"] == "paused", r


def test_ledger_window(tmp_path: Path) -> None:
    from zz.controld.ledger import WINDOW, Ledger

    led = Ledger(tmp_path / "ledger.json")
    assert led.accept_request(OP, 100) and led.accept_request(OP, 99)  # out of order: fine
    assert not led.accept_request(OP, 100) and not led.accept_request(OP, 99)
    assert led.accept_request(OP + 1, 100)  # per operator
    for i in range(WINDOW):
        assert led.accept_request(OP, 1000 + i)
    # The window is full: the smallest ids became the floor; anything at or below it is
    # refused even if never used (98), and everything survives a reload.
    again = Ledger(tmp_path / "ledger.json")
    for lg in (led, again):
        assert not lg.accept_request(OP, 98) and not lg.accept_request(OP, 1000)
    assert again.accept_request(OP, 1000 + WINDOW) and not again.accept_request(OP + 1, 100)


async def test_libvirt_failures_leave_nothing_behind(tmp_path: Path) -> None:
    """On test:///default: a domain of that name exists already (create fails), and the
    save directory cannot be made (hibernate fails after the boot): each reply says what
    failed, the inventory keeps no record and no domain of ours is left."""
    rack = make_rack(tmp_path, sleep="hibernated")
    async with nodes(rack, "libvirt", 0) as (n,):
        spec = actions.replica_spec(n.daemon.ctx, rack.config.service("web"), 2)
        n.hv.create(spec)  # someone else's domain with our name
        r = await n.rpc("provision", service="web", index=2, mode="paused")
        assert not r["ok"] and "outside the inventory" in r["error"], r
        assert r["replica"] is None and n.hv.state(spec.name) == "running"  # left alone
        n.hv.destroy(spec.name)
        (n.daemon.ctx.home / "saves").write_text("not a directory")
        r = await n.rpc("provision", service="web", index=2)
        assert not r["ok"] and r["replica"] is None, r
        assert spec.name not in n.hv.list() and n.daemon.inventory.replicas() == []
        assert "internal_error" not in n.counters()
