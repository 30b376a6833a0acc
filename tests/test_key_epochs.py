# tests/test_key_epochs.py - a fresh spare's new keys (docs/wire.md "Key epochs"): once a
# SPARE-READY announces a slot's new key, zz-agreed and the Python verifiers take that slot's
# messages only under it; what the previous incarnation's keys sign or MAC is dropped and
# counted per sender.
from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest

from tests.cluster import SERVICE_ID, Cluster
from zz import certs, keys, wire
from zz.crypto import SigningKey, sha256


def _send(port: int, *msgs: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for m in msgs:
            s.sendall(wire.frame(m))


def _controld_key(key_dir: Path, h: int = 0) -> SigningKey:
    sec = keys.load_secret(keys.secret_path(key_dir, keys.RACK_SERVICE, keys.controld_principal(h)))
    assert sec.sign is not None
    return sec.sign


def _secret(key_dir: Path, p: int) -> keys.Secret:
    sec = keys.load_secret(keys.secret_path(key_dir, SERVICE_ID, p))
    assert sec.sign is not None
    return sec


def _exec_msgs(sec: keys.Secret, n: int, seq: int) -> tuple[bytes, bytes]:
    """An EXEC-CHECKPOINT signed and an EXEC-REPORT MACed with `sec`'s keys."""
    assert sec.sign is not None
    cp = wire.ExecCheckpoint(SERVICE_ID, sec.principal, seq, sha256(b"cp")).signed(sec.sign)
    rep = wire.ExecReport(SERVICE_ID, sec.principal, seq, sha256(b""), [])
    return cp.encode(), rep.with_macs({r: sec.macs[r] for r in range(n)}).encode()


def test_agreed_refuses_the_replaced_key_of_a_slot(tmp_path: Path) -> None:
    with Cluster(tmp_path, app="kv", f=1) as c:
        c.start()
        kd = c.dir / "keys"
        svc = c.service
        spare = svc.n_exec - 1  # sleeping from the start
        x = wire.exec_principal(spare)
        old = _secret(kd, x)
        raw = keys.rotate_exec(kd, c.config, svc, spare, 0, _controld_key(kd), 0)
        new = _secret(kd, x)
        assert new.sign is not None and old.sign is not None
        assert new.epoch == 1 and new.sign.public != old.sign.public
        assert all(new.macs[r] != old.macs[r] for r in range(c.n))
        # The same conviction again (a retry) gives the same announcement, not epoch 2.
        assert keys.rotate_exec(kd, c.config, svc, spare, 0, _controld_key(kd), 0) == raw

        # A forged announcement (not the controld's key) changes nothing.
        forged = wire.decode(raw)
        assert isinstance(forged, wire.SpareReady)
        forged.epoch = 5
        bad = forged.signed(SigningKey(bytes(32))).encode()
        for r in range(c.n):
            _send(c.port(r), bad, raw)
        c.wait_for(
            lambda: all(s.get("exec_key_epoch", [0] * 3)[spare] == 1 for s in c.stats_all()),
            what="every agreement replica holds epoch 1 for the spare",
        )
        assert all(s["spares_ready_rejected"] == 1 for s in c.stats_all())

        old_cp, old_rep = _exec_msgs(old, c.n, 128)
        new_cp, new_rep = _exec_msgs(new, c.n, 128)
        auth0 = [s["dropped"]["auth"] for s in c.stats_all()]
        for r in range(c.n):
            # In order on one connection: the last old-key message is processed after the
            # new-key ones, so its count shows they were seen too.
            _send(c.port(r), old_cp, old_rep, new_cp, new_rep, old_cp)
        c.wait_for(
            lambda: all(s["exec_stale_key_drops"][spare] == 3 for s in c.stats_all()),
            what="old-key messages dropped and counted for the spare's slot",
        )
        for r in range(c.n):
            s = c.stats(r)
            # only the three old-key ones failed authentication: the new keys verify
            assert s["dropped"]["auth"] == auth0[r] + 3, (r, s["dropped"])
            assert s["exec_stale_key_drops"][:spare] == [0] * spare
        assert "under its previous key (epoch 0) dropped" in c.log_path(0).read_text()

        # A replayed older announcement does not bring the old key back, nor does a restart.
        first = wire.SpareReady(SERVICE_ID, keys.controld_principal(0), spare, 0)
        c.kill(1)
        c.start(1)
        _send(c.port(1), first.signed(_controld_key(kd)).encode(), old_cp)
        c.wait_for(
            lambda: c.stats(1)["exec_stale_key_drops"][spare] == 1,
            what="restarted replica 1 still refuses the old key",
        )
        assert c.stats(1)["exec_key_epoch"][spare] == 1
        assert f"exec {spare} key epoch 1 from" in c.log_path(1).read_text()


def test_a_restart_takes_the_announced_key_of_a_slot_not_convicted_here(tmp_path: Path) -> None:
    """Awake slot 0 is re-keyed for a successor and its SPARE-READY held by every agreement
    replica (a conviction not applied here yet, as at agreement replicas 0 and 3 in campaign
    seed 3101 round 26); the rack restarts (views gone, `.keys` files kept). Each replica
    must take the slot's key from the key directory's announcement at start: the runtime
    started in slot 0 uses it, and a replica on the old key drops everything it sends, so
    the correct runtime never reports seq 1 and is convicted (round 27)."""
    with Cluster(tmp_path, app="kv", f=1) as c:
        c.start()
        kd = c.dir / "keys"
        svc = c.service
        x = wire.exec_principal(0)
        old = _secret(kd, x)
        raw = keys.rotate_exec(kd, c.config, svc, 0, 5, _controld_key(kd), 0)
        new = _secret(kd, x)
        for r in range(c.n):
            _send(c.port(r), raw)
        c.wait_for(
            lambda: all(s["spares_ready_held"] == 1 for s in c.stats_all()),
            what="the announcement held everywhere (slot 0 is not convicted here)",
        )
        assert all(s["exec_key_epoch"][0] == 0 for s in c.stats_all())

        # The rack restart (zz/rackctl.py down, up): every replica stops, the views go.
        for r in range(c.n):
            c.kill(r)
            (c.run_dir / f"agreed-{r}.exec-view").unlink(missing_ok=True)
        c.start()
        c.wait_for(
            lambda: all(s["exec_key_epoch"][0] == 1 for s in c.stats_all()),
            what="every replica on slot 0's announced key after the restart",
        )
        for r in range(c.n):
            assert "exec 0 key epoch 1 announced in" in c.log_path(r).read_text()
            assert c.stats(r)["exec_awake"] == [0, 1]  # the key moved, not the view

        # What the runtime in slot 0 sends now verifies; the old key is refused and counted.
        old_cp, old_rep = _exec_msgs(old, c.n, 128)
        new_cp, new_rep = _exec_msgs(new, c.n, 128)
        auth0 = [s["dropped"]["auth"] for s in c.stats_all()]
        for r in range(c.n):
            _send(c.port(r), new_cp, new_rep, old_rep)
        c.wait_for(
            lambda: all(s["exec_stale_key_drops"][0] == 1 for s in c.stats_all()),
            what="the old key's report dropped and counted",
        )
        for r in range(c.n):
            assert c.stats(r)["dropped"]["auth"] == auth0[r] + 1


def test_a_convicted_slot_takes_only_its_convictions_announcement(tmp_path: Path) -> None:
    """A slot convicted here keeps its key at start, whatever the key directory announces:
    its key moves with the SPARE-READY that answers its conviction (a replayed one must not
    make a convicted incarnation a spare), and a file that does not verify stops zz-agreed."""
    with Cluster(tmp_path, app="kv", f=1) as c:
        kd = c.dir / "keys"
        svc = c.service
        view = c.run_dir / "agreed-0.exec-view"
        keys.rotate_exec(kd, c.config, svc, 1, 9, _controld_key(kd), 0)
        c.start()
        c.wait_for(
            lambda: all(s["exec_key_epoch"][1] == 1 for s in c.stats_all()),
            what="awake slot 1 on the announced key from the first start",
        )
        c.kill(0)
        text = view.read_text()
        assert "exec 1 awake 0\n" in text, text
        view.write_text(text.replace("exec 1 awake 0\n", "exec 1 convicted 9\n"))
        (c.run_dir / "agreed-0.exec-view.keys").unlink()
        c.start(0)
        c.wait_for(lambda: c.stats(0)["exec_convicted"] == [1], what="replica 0 back")
        assert c.stats(0)["exec_key_epoch"][1] == 0

        c.kill(0)
        cert = keys.spare_cert_path(kd, svc.id, wire.exec_principal(1))
        forged = wire.decode(bytes.fromhex(cert.read_text()))
        assert isinstance(forged, wire.SpareReady) and forged.replica == 1
        cert.write_text(forged.signed(SigningKey(bytes(32))).encode().hex() + "\n")
        with contextlib.suppress(RuntimeError):  # it may exit before it listens
            c.start(0)
        assert c.procs[0].wait(timeout=15) != 0
        assert "spare-p257.msg: signature" in c.log_path(0).read_text()


def test_python_verifiers_follow_the_slot_key(tmp_path: Path) -> None:
    with Cluster(tmp_path, app="kv", f=1) as c:  # not started: only its key directory
        kd = c.dir / "keys"
        svc = c.service
        x = wire.exec_principal(1)
        old = _secret(kd, x)
        from collections import Counter

        counters: Counter[str] = Counter()
        view = keys.PeerKeys(kd, c.config, svc, counters)  # a running peer's view
        # A running controld of another host (its view loaded before the re-keying).
        other_controld = keys.load_controld(kd, c.config, 0)
        ff_old = (
            wire.FileFetch(SERVICE_ID, x, 8, b"", 0, 1024, wire.exec_principal(0))
            .signed(old.sign)
            .encode()
        )
        m_old = wire.decode(ff_old)
        assert isinstance(m_old, wire.FileFetch)
        assert m_old.refusal(view, svc.n_exec, server=wire.exec_principal(0)) is None

        keys.rotate_exec(kd, c.config, svc, 1, 9, _controld_key(kd), 0)
        new = _secret(kd, x)
        assert new.sign is not None
        ff_new = wire.decode(
            wire.FileFetch(SERVICE_ID, x, 8, b"", 0, 1024, wire.exec_principal(0))
            .signed(new.sign)
            .encode()
        )
        # the peer view picked up the new key without a restart
        assert m_old.refusal(view, svc.n_exec, server=wire.exec_principal(0)) == (
            "file_fetch_bad_sig"
        )
        assert not view.verify(m_old) and view.verify(ff_new)
        assert counters[f"stale_key_from_{x}"] == 1
        cp_old, rep_old = _exec_msgs(old, c.n, 128)
        assert not view.verify(wire.decode(cp_old))
        assert counters[f"stale_key_from_{x}"] == 2

        # controld's and the certificate verifiers' view, loaded from the key directory, and
        # the view of a controld that was running already (it serves FILE-FETCHes too)
        assert keys.load_controld(kd, c.config, 0).services[SERVICE_ID][x] == new.sign.public
        assert other_controld.services[SERVICE_ID][x] == new.sign.public
        assert m_old.refusal(other_controld.services[SERVICE_ID], svc.n_exec) is not None
        assert certs.ServiceTrust.load(kd, svc, c.config).keys[x] == new.sign.public
        assert keys.service_publics(kd, c.config, svc)[x] == new.sign.public

        # Agreement replica 2's and client 0's MAC keys with the slot: the epoch key, equal
        # to the new replica's; the key file's one (which the thief has) verifies nothing.
        for p in (2, wire.client_principal(0)):
            mine = keys.with_epoch_macs(_secret(kd, p), kd, c.config, svc)
            assert mine.macs[x] == new.macs[p] != old.macs[p]
            rep = wire.decode(rep_old) if p == 2 else None
            if rep is not None:
                assert not rep.verify_mac(p, mine.macs[x])
            reply = wire.Reply(SERVICE_ID, x, 0, 1, p, 0, b"r")
            assert not wire.decode(reply.with_macs({p: old.macs[p]}).encode()).verify_mac(
                p, mine.macs[x]
            )
            assert wire.decode(reply.with_macs({p: new.macs[p]}).encode()).verify_mac(
                p, mine.macs[x]
            )

        # An announcement in the key directory that the controld did not sign is an error.
        cert = keys.spare_cert_path(kd, SERVICE_ID, x)
        m = wire.decode(bytes.fromhex(cert.read_text()))
        cert.write_text(m.signed(SigningKey(bytes(32))).encode().hex() + "\n")
        with pytest.raises(keys.KeyFileError, match="signature"):
            keys.service_publics(kd, c.config, svc)


def test_epoch_mac_key_is_x25519_of_the_ed25519_keys() -> None:
    a, b = SigningKey(bytes(range(32))), SigningKey(bytes(range(1, 33)))
    assert keys.ed25519_to_x25519(a.public) == keys.dh_public(a)
    k_ab = keys.epoch_mac_key(a, keys.dh_public(b), 3, 2, 258, 4)
    assert k_ab == keys.epoch_mac_key(b, keys.ed25519_to_x25519(a.public), 3, 258, 2, 4)
    assert k_ab != keys.epoch_mac_key(a, keys.dh_public(b), 3, 2, 258, 5)
    with pytest.raises(ValueError):
        keys.epoch_mac_key(a, bytes(32), 3, 2, 258, 4)  # a low-order point


@pytest.mark.slow
def test_fresh_spare_has_new_keys_end_to_end(tmp_path: Path) -> None:
    """Process backend: a wrong reply convicts replica 1; its successor is re-keyed the way
    controld does it (zz.keys.rotate_exec, then the announcement by controld.announce), the
    old key is refused by every agreement replica and by the running peer, and the successor
    serves under its new keys when a second fault wakes it."""
    import asyncio
    import shutil
    import signal
    from collections import Counter

    from controld.announce import Announcer
    from tests.test_execution_runtime import KV_GET, _kv, _kv_ok
    from tests.test_fault_detection_e2e import (
        FAST,
        SPARE,
        _check_wakeup,
        _puts,
        _start,
        _wait_resolved,
    )
    from zz.procrack import signal_group

    gen = _start(tmp_path, {1: ["--inject-fault", "wrong-reply"]}, FAST)
    rig = next(gen)
    try:
        c = rig.cluster
        svc = c.service
        kd = c.dir / "keys"
        x = wire.exec_principal(1)
        old = _secret(kd, x)
        assert _puts(rig, 1, "w") == [_kv_ok()]
        _check_wakeup(rig)
        seq = _wait_resolved(rig, convicted=1).seq
        rig.execs.procs[1].wait(timeout=10)  # SIGKILLed by the test's controld

        # controld's fresh spare: new keys, a fresh runtime, the signed announcement.
        ctl = _controld_key(kd)
        raw = keys.rotate_exec(kd, c.config, svc, 1, seq, ctl, 0)
        shutil.rmtree(svc.exec_state_dir(c.config, 1), ignore_errors=True)
        rig.execs.args[1] = []
        rig.execs.start(1)
        counters: Counter[str] = Counter()
        notes: list[str] = []

        async def announce() -> None:
            a = Announcer(c.config, c.config.hosts[0], ctl, counters, notes.append)
            a.announce(svc, 1, seq, raw)
            await asyncio.wait_for(a.idle(), 30)

        asyncio.run(announce())
        assert counters["spare_ready_sent"] == c.n, (counters, notes)
        rig.wait(
            lambda: all(
                s["exec_sleeping"] == [1] and s["exec_key_epoch"][1] == 1 for s in rig.agreement()
            ),
            "every agreement replica has the fresh spare asleep under key epoch 1",
        )
        rig.wait_linked(1)
        signal_group(rig.execs.procs[1].pid, signal.SIGSTOP)

        new = _secret(kd, x)
        assert new.sign is not None and old.sign is not None
        assert new.epoch == 1 and new.sign.public != old.sign.public
        assert wire.decode(raw).sign_pub == new.sign.public  # type: ignore[attr-defined]

        # What a thief of the convicted guest's key file can still sign or MAC: refused.
        old_cp, old_rep = _exec_msgs(old, c.n, seq)
        for r in range(c.n):
            _send(c.port(r), old_cp, old_rep)
        rig.wait(
            lambda: all(s["exec_stale_key_drops"] == [0, 2, 0] for s in rig.agreement()),
            "old-key messages dropped and counted for slot 1 at every agreement replica",
        )
        ff = (
            wire.FileFetch(SERVICE_ID, x, 0, b"", 0, 1024, wire.exec_principal(0))
            .signed(old.sign)
            .encode()
        )
        _send(svc.exec_address(c.config, 0)[1], ff)
        rig.wait(
            lambda: rig.execs.status(0).get("counters", {}).get(f"stale_key_from_{x}") == 1,
            "the running peer refuses the old key's FILE-FETCH and counts it",
        )

        # A second fault wakes the re-keyed spare: it executes and reports under its new
        # keys (its EXEC-REPORTs make certificates with replica 0's).
        rig.execs.kill(SPARE)
        assert _puts(rig, 1, "second") == [_kv_ok()]
        rig.wait(lambda: len(rig.controld.shutdowns) >= 2, "a second SHUTDOWN certificate", 60)
        rig.wait(
            lambda: all(
                s["exec_awake"] == [0, 1] and s["exec_convicted"] == [SPARE]
                for s in rig.agreement()
            ),
            "0 and the re-keyed replica 1 awake",
        )
        assert rig.invoke_all([_kv(KV_GET, b"w0")]) == [_kv_ok(b"v0")]
        assert _puts(rig, 2, "third") == [_kv_ok()] * 2
        assert all(s["exec_stale_key_drops"] == [0, 2, 0] for s in rig.agreement())
    finally:
        gen.close()


def test_a_runtime_no_agreement_replica_verifies_is_linked_but_not_answered(
    tmp_path: Path,
) -> None:
    """What the campaign's readiness check reads (zz/campaign.py `_problems`): slot 0 is
    re-keyed after the agreement replicas started and never announced. Its runtime connects
    to every agreement replica (`agreement_links_up` 4), but none verifies its FETCH, so
    none answers (`agreement_links_answered` 0); runtime 1 is answered by all four."""
    import json
    import time

    from tests.test_execution_runtime import ExecReplicas, _kv_cluster, _port_free

    for attempt in range(20):
        c = _kv_cluster(tmp_path / f"try{attempt}", 4)
        if all(_port_free(a[1]) for a in c.service.exec_addresses(c.config)):
            break
    execs = ExecReplicas(c)
    try:
        c.start()
        kd = c.dir / "keys"
        keys.rotate_exec(kd, c.config, c.service, 0, 5, _controld_key(kd), 0)
        execs.start(0)
        execs.start(1)

        def links(i: int) -> tuple[int, int]:
            st = execs.status(i)
            return st.get("agreement_links_up", -1), st.get("agreement_links_answered", -1)

        deadline = time.monotonic() + 30
        while (links(0)[0], links(1)) != (c.n, (c.n, c.n)):
            assert time.monotonic() < deadline, execs.tails()
            time.sleep(0.1)
        time.sleep(2)  # FETCH-REPLYs come at once on registration: none will for runtime 0
        assert links(0) == (c.n, 0), execs.tails()
        assert json.loads(execs.status_path(0).read_text())["last_executed"] == 0
    finally:
        execs.close()
        c.__exit__(None, None, None)


def test_a_client_pool_takes_a_successors_key_before_its_next_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zz proxy and zz mount outlive convictions: once a slot is re-keyed for a convicted
    replica's successor, the pool's clients must MAC to and verify that slot under the new
    epoch key, or the successor, once woken, is never heard (found with zz mount)."""
    import asyncio

    from zz.client import Client
    from zz.proxy import ClientPool

    with Cluster(tmp_path, app="kv", f=1) as c:  # not started: only its key directory
        kd = c.dir / "keys"
        svc = c.config.service(SERVICE_ID)
        x = wire.exec_principal(1)
        pool = ClientPool.from_config(c.config, svc, 1)
        client = pool.clients[0]
        before = client.params.exec_keys[1]
        keys.rotate_exec(kd, c.config, svc, 1, 9, _controld_key(kd), 0)
        new = _secret(kd, x)
        assert new.macs[wire.client_principal(0)] != before

        async def invoke(self: Client, op: bytes, read_only: bool, timeout: float) -> bytes:
            return self.params.exec_keys[1]  # what the client would use for slot 1

        monkeypatch.setattr(Client, "invoke", invoke)
        used = asyncio.run(pool.invoke(b"op", False, 5.0))
        again = asyncio.run(pool.invoke(b"op", False, 5.0))
        assert used == again == new.macs[wire.client_principal(0)]
        assert pool.stats["rekeyed"] == 1  # once per announcement, not per request
