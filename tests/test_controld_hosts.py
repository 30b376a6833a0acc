# tests/test_controld_hosts.py - what a rack whose controlds run on their hosts (rack.controlds =
# "hosts") needs of controld and of a client: the ops `reset`, `drill_fault` and `drill_crash`
# (so that `zz rack down` and `zz drill` touch no host's files or processes themselves), a
# re-keyed slot's announcement kept by every host, and a client on another machine learning
# a slot's new key from the replica's introduction. End to end: tests/test_netns_rack.py.
from __future__ import annotations

import json
from pathlib import Path

from tests.test_controld_daemon import Node, make_rack, nodes
from zz import keys, wire
from zz.client import Client, ClientParams
from zz.drillfaults import FAULT_FILE

SVC = 1


async def test_drill_ops_need_drill_faults_and_act_in_place(tmp_path: Path) -> None:
    """Without --drill-faults a controld lets no drill touch its runtimes; with it,
    drill_fault writes the fault file in the replica's state directory (checked, placed
    here only) and drill_crash destroys the domain under the inventory, which keeps the
    record (the agreement replicas must notice, as after a real crash)."""
    rack = make_rack(tmp_path)
    async with nodes(rack, "libvirt", 0) as (n,):
        assert (await n.rpc("provision", service="web", index=2, mode="active"))["ok"]
        r = await n.rpc("drill_fault", service="web", index=2, fault="wrong-reply")
        assert not r["ok"] and "without --drill-faults" in r["error"], r
        r = await n.rpc("drill_crash", service="web", index=2)
        assert not r["ok"] and "without --drill-faults" in r["error"], r
    (tmp_path / "two").mkdir()
    rack2 = make_rack(tmp_path / "two")
    n = Node(rack2, 0, "libvirt", drill_faults=True)
    await n.start()
    try:
        svc = rack2.config.services[0]
        assert (await n.rpc("provision", service="web", index=2, mode="active"))["ok"]
        r = await n.rpc("drill_fault", service="web", index=2, fault="slow-report",
                        slow_report_ms=6000)  # fmt: skip
        assert r["ok"], r
        path = svc.exec_state_dir(rack2.config, 2) / FAULT_FILE
        assert json.loads(path.read_text()) == {"fault": "slow-report", "slow_report_ms": 6000}
        r = await n.rpc("drill_fault", service="web", index=2, fault=None)
        assert r["ok"] and json.loads(path.read_text()) == {"fault": None}
        for bad, why in (
            ({"index": 2, "fault": "explode"}, "fault must be null or one of"),
            ({"index": 0, "fault": None}, "placed on host h1, not h0"),
            ({"index": 2, "fault": None, "lie": "no"}, "lie must be true or false"),
            ({"index": 2, "fault": None, "slow_report_ms": -1}, "slow_report_ms must be"),
        ):
            r = await n.rpc("drill_fault", service="web", **bad)
            assert not r["ok"] and why in r["error"], (bad, r)
        dom = n.daemon.inventory.get("web", 2).domain
        r = await n.rpc("drill_crash", service="web", index=2)
        assert r["ok"] and r["destroyed_domains"] == [dom], r
        assert dom not in n.hv.list() and n.daemon.inventory.get("web", 2).state == "active"
        listed = (await n.rpc("list"))["replicas"]
        assert listed[0]["hv_state"] == "gone" and listed[0]["consistent"] is False
    finally:
        await n.close()


async def test_reset_clears_the_rack_state_of_its_host(tmp_path: Path) -> None:
    """`zz rack down` with controlds on their hosts: each forgets and destroys its replicas
    and deletes their state and its agreement replicas' views and logs; forensic states
    stay unless purged; the replay guard starts anew."""
    rack = make_rack(tmp_path)
    c = rack.config
    svc = c.services[0]
    run = c.rack.run_dir / f"s{svc.id}"
    async with nodes(rack, "libvirt", 0) as (n,):
        assert (await n.rpc("provision", service="web", index=2, mode="paused"))["ok"]
        dom = n.daemon.inventory.get("web", 2).domain
        (run / "agreed-0.data").mkdir(parents=True)
        (run / "agreed-0.data" / "wal-a").write_bytes(b"x")
        (run / "agreed-0.exec-view").write_text("awake 0 1\n")
        forensic = run / "exec-2.forensic-9"
        forensic.mkdir()
        n.daemon.freshness_path.write_text("{}")
        r = await n.rpc("reset")
        assert r["ok"], r
        assert dom in r["destroyed"] and n.daemon.inventory.replicas() == []
        assert dom not in n.hv.list()
        assert not svc.exec_state_dir(c, 2).exists()
        assert not (run / "agreed-0.data").exists() and not (run / "agreed-0.exec-view").exists()
        assert forensic.is_dir() and r["kept"] == [str(forensic)]
        assert not n.daemon.freshness_path.exists()
        # Placed on another host: not this controld's to delete.
        assert not any("agreed-1" in x or "exec-0" in x for x in r["deleted"]), r["deleted"]
        r = await n.rpc("reset", purge_forensics=True)
        assert r["ok"] and not forensic.exists() and r["deleted"] == [str(forensic)]
        r = await n.rpc("reset", purge_forensics="yes")
        assert not r["ok"] and "purge_forensics must be true or false" in r["error"]
        # And the slot takes a fresh replica again.
        assert (await n.rpc("provision", service="web", index=2, mode="paused"))["ok"]


async def test_another_hosts_announcement_is_kept_in_the_key_directory(tmp_path: Path) -> None:
    """A re-keyed slot's SPARE-READY, forwarded by its host's controld to every other
    controld, is verified and kept as spare-p<id>.msg (what PeerKeys, controld's key view
    and zz-agreed at start read); a known epoch is not written again; one not signed by the
    slot's host is refused and audited."""
    rack = make_rack(tmp_path)
    c = rack.config
    svc = c.services[0]
    kd = c.rack.key_dir
    sign = {h: keys.load_secret(keys.secret_path(kd, keys.RACK_SERVICE,
                                                 keys.controld_principal(h))).sign
            for h in range(3)}  # fmt: skip
    assert sign[1] is not None and sign[2] is not None
    # Slot 0 is placed on h1: its controld re-keys it (in this test's one key directory,
    # so the file is removed again: h0 had never seen it).
    raw = keys.rotate_exec(kd, c, svc, 0, 41, sign[1], 1)
    cert = keys.spare_cert_path(kd, svc.id, wire.exec_principal(0))
    cert.unlink()
    forged = wire.SpareReady(svc.id, keys.controld_principal(2), 0, 41, 1, bytes(32), bytes(32))
    async with nodes(rack, "libvirt", 0) as (n,):
        await n.send(raw)
        assert bytes.fromhex(cert.read_text().strip()) == raw
        assert n.counters()["spare_ready_stored"] == 1
        assert keys.service_publics(kd, c, svc)[wire.exec_principal(0)] != bytes(32)
        await n.send(raw)
        assert n.counters()["spare_ready_known"] == 1
        await n.send(forged.signed(sign[2]).encode())
        assert n.counters()["spare_ready_refused"] == 1
        assert bytes.fromhex(cert.read_text().strip()) == raw
        verdicts = [e.verdict for e in audit_entries(n.daemon.audit.path)]
        assert "stored" in verdicts and "refused" in verdicts


def audit_entries(path: Path) -> list[object]:
    from zz import audit

    return list(audit.read(path).entries)


def test_a_client_learns_a_slots_new_key_from_its_introduction(tmp_path: Path) -> None:
    """A client whose key directory never got a slot's announcement (another machine)
    takes the slot's new MAC key from the SPARE-READY the replica introduces itself with
    (execution/runtime.py): the key the replica holds for it; an older or equal epoch, a
    forged signature or another host's controld changes nothing."""
    rack = make_rack(tmp_path)
    c = rack.config
    svc = c.services[0]
    kd = c.rack.key_dir
    h1 = keys.load_secret(keys.secret_path(kd, keys.RACK_SERVICE, keys.controld_principal(1)))
    h2 = keys.load_secret(keys.secret_path(kd, keys.RACK_SERVICE, keys.controld_principal(2)))
    assert h1.sign is not None and h2.sign is not None
    params = ClientParams.from_config(c, "web", 0)  # before the re-key
    client = Client(params)
    old = params.exec_keys[0]
    raw = keys.rotate_exec(kd, c, svc, 0, 41, h1.sign, 1)
    replica = keys.load_secret(keys.secret_path(kd, svc.id, wire.exec_principal(0)))
    m = wire.decode(raw)
    assert isinstance(m, wire.SpareReady)
    forged = wire.SpareReady(svc.id, m.sender, 0, 41, 2, m.sign_pub, m.dh_pub).signed(h2.sign)
    other = wire.SpareReady(svc.id, keys.controld_principal(2), 0, 41, 2, m.sign_pub, m.dh_pub)
    client._on_message(forged.encode())
    client._on_message(other.signed(h2.sign).encode())
    assert params.exec_keys[0] == old
    assert client.stats["bad_spare_ready"] == 1 and client.stats["unexpected"] == 1
    client._on_message(raw)
    assert params.exec_keys[0] == replica.macs[params.principal] != old
    assert params.exec_epochs[0] == 1 and client.stats["exec_key_epochs_learned"] == 1
    client._on_message(raw)
    assert client.stats["stale_spare_ready"] == 1
    # A client made now reads the announcement from its key directory: the same key.
    assert ClientParams.from_config(c, "web", 0).exec_keys[0] == params.exec_keys[0]
