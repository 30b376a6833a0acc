# tests/test_rack_lifecycle.py - zz rack stop / start / down --purge-forensics and `up` on a
# rack with dead members, on racks of real processes (process backend: zz-agreed, controlds,
# execution runtimes), through the library and the `zz` command (--json).
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_execution_runtime import needs_agreed
from tests.test_rackctl import assert_nothing_left, leftovers, write_rack
from zz import cli, keys, kvop, rackctl, wire
from zz.client import Client, ClientParams
from zz.config import Config, load

FLOOR = {"detect_floor_ms": 4000}  # no conviction of a replica this test kills on purpose


@contextlib.contextmanager
def rack_config(tmp_path: Path, name: str = "lc", durability: str = "off") -> Iterator[Config]:
    """A rack config whose name no other run shares (its ZFS pool names follow it); torn
    down with its forensic states whatever happens, and anything of it left is killed."""
    path = write_rack(tmp_path, name=f"{name}{uuid.uuid4().hex[:6]}")
    text = path.read_text().replace("[rack]\n", f'[rack]\ndurability = "{durability}"\n', 1)
    path.write_text(text)
    config = load(path)
    try:
        yield config
    finally:
        with contextlib.suppress(Exception):
            rackctl.down(config, purge_forensics=True)
        for pid in leftovers(config):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def rack(tmp_path: Path) -> Iterator[Config]:
    with rack_config(tmp_path) as config:
        yield config


def zz(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, object]]:
    """`zz ARGV --json`: its exit code and document."""
    capsys.readouterr()
    rc = cli.main([*argv, "--json"])
    out = capsys.readouterr()
    assert out.out, f"zz {' '.join(argv)}: exit {rc}, no document; stderr:\n{out.err}"
    return rc, json.loads(out.out)


def kv(config: Config, *ops: bytes, timeout: float = 30.0) -> list[kvop.KvReply]:
    async def run() -> list[kvop.KvReply]:
        params = ClientParams.from_config(config, config.services[0].name, 0)
        async with Client(params) as client:
            return [kvop.decode_reply(await client.invoke(op, timeout=timeout)) for op in ops]

    return asyncio.run(run())


def inventories(config: Config) -> dict[str, list[tuple[int, str, str]]]:
    async def one(h: str) -> list[tuple[int, str, str]]:
        host = next(x for x in config.hosts if x.name == h)
        reply = await rackctl.operator_call(config, host, {"op": "list"}, timeout=10)
        assert reply["ok"], reply
        return [(r["index"], r["state"], r["hv_state"]) for r in reply["replicas"]]

    return {h.name: asyncio.run(one(h.name)) for h in config.hosts}


def key_digest(config: Config) -> str:
    h = hashlib.sha256()
    for p in sorted(config.rack.key_dir.rglob("*")):
        if p.is_file():
            h.update(str(p).encode() + p.read_bytes())
    return h.hexdigest()


def exec_pid(config: Config, i: int) -> int:
    svc = config.services[0]
    return int(json.loads(svc.exec_status_path(config, i).read_text())["pid"])


def wait_for(what: str, ok: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def wait_dead(pids: list[int]) -> None:
    wait_for(f"pids {pids} to exit", lambda: not any(rackctl.start_ticks(p) for p in pids), 30)


@needs_agreed
def test_stop_keeps_everything_and_start_brings_the_same_rack_back(
    rack: Config, capsys: pytest.CaptureFixture[str]
) -> None:
    state = rackctl.up(rack, store="dir", overrides=FLOOR)
    before = inventories(rack)
    assert sorted(i for h in before.values() for i, _, _ in h) == [0, 1, 2]
    keys_before = key_digest(rack)
    audit = rack.rack.run_dir / "controld" / "h1" / "audit.log"
    rc, doc = zz(capsys, "rack", "stop", str(rack.path))
    assert rc == 0 and doc["clean"] and not doc["nothing"], doc
    assert sorted(doc["stopped"]) == sorted(p.name for p in state.procs)  # type: ignore[arg-type]
    # Nothing of the rack runs; everything it had is still on disk.
    assert not leftovers(rack) and not any(p.alive() for p in state.procs)
    stopped = rackctl.load_state(rack)
    assert stopped is not None and stopped.stopped_at is not None
    assert stopped.stopped_seq == {"kv0": 0}
    svc = rack.services[0]
    for i in range(svc.n_exec):
        assert svc.exec_state_dir(rack, i).is_dir()
        assert f"execution state {svc.exec_state_dir(rack, i)}" in doc["kept"]  # type: ignore[operator]
    for h in {r.host for r in state.replicas}:
        assert (rack.rack.run_dir / "controld" / h / "inventory.json").exists()
    assert audit.exists() and (rack.rack.run_dir / "s1" / "agreed-0.log").exists()
    assert key_digest(rack) == keys_before
    capsys.readouterr()
    assert cli.main(["status", str(rack.path)]) == 2  # not running
    assert "stopped at" in (out := capsys.readouterr().out) and "`zz rack start" in out, out
    # Stopped again: nothing to do. `up` does not start a stopped rack anew.
    assert rackctl.stop(rack).nothing
    with pytest.raises(rackctl.RackError, match="was stopped .* `zz rack start"):
        rackctl.up(rack)
    assert not leftovers(rack)

    rc, doc = zz(capsys, "rack", "start", str(rack.path))
    assert rc == 0 and doc["how"] == "started", doc
    started = rackctl.load_state(rack)
    assert started is not None and started.complete and started.stopped_at is None
    assert all(p.alive() for p in started.procs) and len(started.procs) == len(state.procs)
    # Same keys, the same replicas in the same states, really running.
    assert key_digest(rack) == keys_before
    after = inventories(rack)
    assert {h: [(i, s) for i, s, _ in v] for h, v in after.items()} == {
        h: [(i, s) for i, s, _ in v] for h, v in before.items()
    }
    assert all(hv == ("running" if s == "active" else "paused")
               for v in after.values() for _, s, hv in v)  # fmt: skip
    assert [r.ok for r in kv(rack, kvop.encode_put(b"k", b"v"), kvop.encode_get(b"k"))] == [
        True,
        True,
    ]
    # Started twice: it runs, nothing to do.
    with pytest.raises(rackctl.AlreadyUp, match="already up"):
        rackctl.start(rack)
    report = rackctl.down(rack)
    assert report.clean, report
    assert_nothing_left(rack)


@needs_agreed
def test_start_refuses_what_it_cannot_continue(
    rack: Config, capsys: pytest.CaptureFixture[str]
) -> None:
    """zz-agreed keeps no state on disk: a rack that ordered requests cannot be started at
    the sequence numbers it had, and start says so instead of starting from seq 0."""
    rackctl.up(rack, store="dir", overrides=FLOOR)
    replies = kv(rack, *(kvop.encode_put(b"k%d" % n, b"v") for n in range(5)))
    assert all(r.ok for r in replies)
    assert rackctl.stop(rack).clean
    stopped = rackctl.load_state(rack)
    assert stopped is not None and stopped.stopped_seq["kv0"] >= 5
    rc, doc = zz(capsys, "rack", "start", str(rack.path))
    assert rc == 1 and doc["cannot_continue"] and not doc["ok"], doc
    why = str(doc["error"])
    assert f"kv0 reached seq {stopped.stopped_seq['kv0']}" in why, why
    assert "agreed-0.data is missing or empty" in why and "zz rack down" in why, why
    assert 'rack.durability is "off"' in why, why
    # Nothing started, nothing changed.
    assert not leftovers(rack)
    again = rackctl.load_state(rack)
    assert again is not None and again.to_json() == stopped.to_json()
    assert rack.services[0].exec_state_dir(rack, 0).is_dir()
    assert rackctl.down(rack).clean
    assert_nothing_left(rack)


@needs_agreed
def test_up_repairs_a_rack_with_dead_members(
    rack: Config, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dead execution runtime (its controld alive), a dead agreement replica and a
    SIGKILLed controld (its runtime left running, orphaned): `up` restarts each, the
    orphan is replaced, and the service answers with all of them again."""
    state = rackctl.up(rack, store="dir", overrides=FLOOR)
    assert all(r.ok for r in kv(rack, *(kvop.encode_put(b"a%d" % n, b"v") for n in range(40))))
    svc = rack.services[0]
    # exec-0 lives on h1, exec-1 on h2 (placement); kill exec-0's runtime, h2's controld
    # and backup agreement replica 3.
    runtime = exec_pid(rack, 0)
    orphan = exec_pid(rack, 1)
    ctl = state.proc("h2")
    agreed3 = state.proc("kv0/agreed-3")
    os.killpg(runtime, signal.SIGKILL)
    os.kill(ctl.pid, signal.SIGKILL)
    os.killpg(agreed3.pid, signal.SIGKILL)
    wait_dead([runtime, ctl.pid, agreed3.pid])
    assert rackctl.start_ticks(orphan) is not None, "a SIGKILLed controld's runtime runs on"

    rc, doc = zz(capsys, "rack", "up", str(rack.path))
    assert rc == 0 and doc["how"] == "repaired" and not doc["already_up"], doc
    lines = " | ".join(doc["repaired"])  # type: ignore[arg-type]
    assert f"controld h2 (pid {ctl.pid} dead)" in lines, lines
    assert f"agreed kv0/agreed-3 (pid {agreed3.pid} dead)" in lines, lines
    inv = "active in controld's inventory, the hypervisor shows"
    assert f"kv0/exec-0 on h1 ({inv} shutoff)" in lines, lines
    assert f"kv0/exec-1 on h2 ({inv} gone)" in lines, lines
    repaired = rackctl.load_state(rack)
    assert repaired is not None and all(p.alive() for p in repaired.procs)
    assert repaired.repairs[-1]["by"] == "up"
    wait_dead([orphan])  # ended by h2's new controld before it provisioned exec-1 again
    assert exec_pid(rack, 0) != runtime and exec_pid(rack, 1) != orphan
    assert all(hv in ("running", "paused") and s in ("active", "paused")
               for v in inventories(rack).values() for _, s, hv in v)  # fmt: skip
    # Both active replicas answer again (the client needs f+1 = 2 matching replies), and
    # the restarted agreement replica catches up past a checkpoint (interval 32).
    got = kv(rack, *(kvop.encode_put(b"b%d" % n, b"w") for n in range(40)), kvop.encode_get(b"a7"))
    assert got[-1] == kvop.KvReply(kvop.OK, b"v")
    stats = rack.rack.run_dir / "s1" / "agreed-3.stats.json"
    wait_for("agreed-3 to catch up",
             lambda: json.loads(stats.read_text()).get("last_exec", 0) >= 64, 60)  # fmt: skip
    # Nothing dead now: up says so and touches nothing.
    with pytest.raises(rackctl.AlreadyUp, match="all 8 processes run"):
        rackctl.up(rack)
    assert svc.n == 4 and rackctl.down(rack).clean
    assert_nothing_left(rack)


@needs_agreed
def test_up_says_why_it_cannot_repair(rack: Config) -> None:
    """More than g agreement replicas dead, without state on disk: no repair, the reason
    names them, and the live members are left as they were."""
    state = rackctl.up(rack, store="dir", overrides=FLOOR)
    dead = [state.proc("kv0/agreed-2"), state.proc("kv0/agreed-3")]
    for p in dead:
        os.killpg(p.pid, signal.SIGKILL)
    wait_dead([p.pid for p in dead])
    with pytest.raises(rackctl.RackError, match="cannot be repaired") as e:
        rackctl.up(rack)
    assert not isinstance(e.value, rackctl.AlreadyUp)
    assert "2 of kv0's 4 agreement replicas are dead (kv0/agreed-2, kv0/agreed-3)" in str(e.value)
    assert all(p.alive() for p in state.procs if p not in dead)
    assert rackctl.down(rack).clean
    assert_nothing_left(rack)


def _convict(config: Config, index: int, seq: int) -> None:
    """Send controld of `index`'s host g+1 = 2 SHUTDOWN votes convicting it, signed with
    agreement replicas 0 and 1's real keys: controld destroys it, keeps its state for
    forensics and provisions a fresh spare (docs/controld.md "SHUTDOWN")."""
    svc = config.services[0]
    host = svc.exec_host(config, index)
    votes = []
    for r in (0, 1):
        sk = keys.load_secret(keys.secret_path(config.rack.key_dir, svc.id, r)).sign
        assert sk is not None
        # The round's awake set less the convicted one, plus the spare woken in its place.
        active = [j for j in range(svc.active + 1) if j != index]
        m = wire.Shutdown(svc.id, r, seq, list(range(svc.active)), [index], [], active)
        votes.append(m.signed(sk).encode())

    async def send() -> None:
        _, w = await asyncio.open_connection(host.address, host.control_port)
        for raw in votes:
            w.write(wire.frame(raw))
        await w.drain()
        w.close()

    asyncio.run(send())


@needs_agreed
def test_down_keeps_forensic_states_unless_purged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On ZFS (the default where zpool works): a convicted replica's state directory, its
    console log and its ZFS dataset (saved as a `zfs send` stream before the pool goes)
    survive `down`, which lists them as kept and the rest as deleted; `--purge-forensics`
    deletes them."""
    from zz.snapshots.zfs import ensure_zfs_daemon

    ensure_zfs_daemon()  # CI installs zfs-fuse; without it this test fails, not skips
    with rack_config(tmp_path, "lcz") as rack:
        state = rackctl.up(rack, store="auto", overrides=FLOOR)
        assert state.store == "zfs" and "zpool answers" in state.store_reason, state
        svc = rack.services[0]
        _convict(rack, 0, seq=7)
        kept = svc.exec_state_dir(rack, 0).with_name("exec-0.forensic-7")
        wait_for("the forensic state", lambda: (kept / "console" / "replica.log").exists())
        wait_for("the fresh spare", lambda: (0, "paused", "paused") in inventories(rack)["h1"])
        rc, doc = zz(capsys, "rack", "down", str(rack.path))
        assert rc == 0 and doc["clean"], doc
        assert f"forensic state {kept}" in doc["kept"]  # type: ignore[operator]
        stream = kept / "zfs" / "s1-exec-0-forensic-7@forensic-7.zfs-send"
        assert any(str(stream) in k for k in doc["kept"]), doc["kept"]  # type: ignore[union-attr]
        assert stream.stat().st_size > 0
        deleted = doc["deleted"]
        assert str(svc.exec_state_dir(rack, 1)) in deleted, deleted  # type: ignore[operator]
        assert f"ZFS pool {rackctl.pool_name(rack, rack.hosts[1])}" in deleted  # type: ignore[operator]
        assert kept.is_dir() and (kept / "console" / "replica.log").exists()
        assert_nothing_left(rack)
        # A second down finds nothing running and still keeps them; --purge-forensics goes.
        assert rackctl.down(rack).kept
        assert kept.exists()
        rc, doc = zz(capsys, "rack", "down", str(rack.path), "--purge-forensics")
        assert rc == 0 and str(kept) in doc["deleted"], doc  # type: ignore[operator]
        assert not kept.exists()


def test_store_auto_falls_back_to_directories_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--store auto is zfs where zpool answers; without the zfs commands it is the
    directory store with the reason. zfs and dir are taken as given; anything else names
    the choices."""
    from zz.snapshots.zfs import ensure_zfs_daemon

    ensure_zfs_daemon()
    store, why = rackctl.choose_store("auto")
    assert store == "zfs" and "zpool answers" in why, why
    assert rackctl.choose_store("dir") == ("dir", "--store dir given")
    assert rackctl.choose_store("zfs") == ("zfs", "--store zfs given")
    with pytest.raises(rackctl.RackError, match="auto, dir, zfs"):
        rackctl.choose_store("btrfs")
    monkeypatch.setenv("PATH", str(tmp_path))  # no zpool, no zfs-fuse
    store, why = rackctl.choose_store("auto")
    assert store == "dir", why
    assert why.startswith("fallback, ZFS is not usable here: ") and "zpool not found" in why, why


@needs_agreed
def test_stop_and_start_on_zfs_keep_the_pools(tmp_path: Path) -> None:
    """On ZFS: stop keeps the pools (imported); start uses them, and imports one that
    zfs-fuse no longer has (exported here, as after a restart of zfs-fuse) from its vdev
    file; the replicas' datasets are the same ones."""
    from zz.snapshots.zfs import ensure_zfs_daemon, pool_exists, run_zfs

    ensure_zfs_daemon()
    with rack_config(tmp_path, "lcp") as rack:
        state = rackctl.up(rack, store="auto", overrides=FLOOR)
        assert state.store == "zfs", state.store_reason
        pool = rackctl.pool_name(rack, rack.hosts[1])  # exec-0's host

        def datasets() -> list[str]:
            return run_zfs(["zfs", "list", "-H", "-o", "name", "-r", pool]).split()

        before = datasets()
        assert f"{pool}/s1-exec-0" in before, before
        report = rackctl.stop(rack)
        assert report.clean and all(pool_exists(p["name"]) for p in state.pools)
        assert any(f"ZFS pool {pool}" in k for k in report.kept), report.kept
        run_zfs(["zpool", "export", pool])
        assert not pool_exists(pool)
        lines: list[str] = []
        rackctl.start(rack, progress=lines.append)
        assert any(f"ZFS pool {pool} imported from" in x for x in lines), lines
        assert datasets() == before
        assert [r.ok for r in kv(rack, kvop.encode_put(b"z", b"1"), kvop.encode_get(b"z"))] == [
            True,
            True,
        ]
        assert rackctl.down(rack).clean
        assert not any(pool_exists(p["name"]) for p in state.pools)
        assert_nothing_left(rack)


@needs_agreed
def test_start_continues_the_sequence_numbers_of_durable_agreement_replicas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """rack.durability = "fsync": the agreement replicas keep their log in
    run/s<id>/agreed-<r>.data, so start brings the rack back where it stopped: the same
    sequence numbers (past a checkpoint), the same execution state, and a client's next
    requests are ordered after the ones before the stop; `up` restarts more than g dead
    agreement replicas from their logs."""
    with rack_config(tmp_path, "lcd", durability="fsync") as rack:
        rackctl.up(rack, store="dir", overrides=FLOOR)
        assert all(r.ok for r in kv(rack, *(kvop.encode_put(b"d%d" % n, b"%d" % n)
                                           for n in range(40))))  # fmt: skip
        assert rackctl.stop(rack).clean
        stopped = rackctl.load_state(rack)
        assert stopped is not None
        seq = stopped.stopped_seq["kv0"]
        assert seq >= 40, seq
        svc = rack.services[0]
        assert rackctl.agreement_on_disk(rack, svc) is None
        assert rackctl.start_blockers(rack, stopped) == []
        rc, doc = zz(capsys, "rack", "start", str(rack.path))
        assert rc == 0 and doc["how"] == "started", doc
        got = kv(rack, kvop.encode_get(b"d7"), kvop.encode_get(b"d39"),
                 kvop.encode_put(b"after", b"1"))  # fmt: skip
        assert got[:2] == [kvop.KvReply(kvop.OK, b"7"), kvop.KvReply(kvop.OK, b"39")], got
        assert got[2].ok
        stats = [json.loads((rack.rack.run_dir / "s1" / f"agreed-{r}.stats.json").read_text())
                 for r in range(svc.n)]  # fmt: skip
        # Ordered after the stop's seq, by replicas that recovered it from their logs.
        wait_for("the next seq", lambda: rackctl.reached_seq(rack, svc) > seq, 30)
        assert all(s["wal"]["recovered_last_exec"] >= seq for s in stats), [
            s["wal"] for s in stats
        ]
        # With their logs on disk, more than g dead agreement replicas are restarted too.
        started = rackctl.load_state(rack)
        assert started is not None
        dead = [started.proc("kv0/agreed-2"), started.proc("kv0/agreed-3")]
        for p in dead:
            os.killpg(p.pid, signal.SIGKILL)
        wait_dead([p.pid for p in dead])
        repaired = rackctl.up(rack)
        assert len(repaired.repairs) == 1 and all(p.alive() for p in repaired.procs)
        assert kv(rack, kvop.encode_get(b"after")) == [kvop.KvReply(kvop.OK, b"1")]
        assert rackctl.down(rack).clean
        assert not any(rackctl.agreed_data_dir(rack, svc, r).exists() for r in range(svc.n))
        assert_nothing_left(rack)
