"""Durable agreement replicas (docs/agreement.md "Durable state"), with real zz-agreed
processes: a replica SIGKILLed under load restarts from its write-ahead log and keeps
ordering; a torn or bit-flipped log is detected, never replayed past the damage, and the
replica recovers the rest from its peers; all four killed at once keep every acknowledged
request at its seq."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import Cluster
from zz import walfile, wire
from zz.client import ClientTimeout
from zz.crypto import sha256


def _durable(r: int, tmp: Path, policy: str) -> dict[str, Any]:
    return {"data_dir": {i: str(tmp / f"data{i}") for i in range(r)}, "durability": policy}


def _cluster(tmp: Path, policy: str = "fsync", **kw: Any) -> Cluster:
    return Cluster(tmp, g=1, overrides=_durable(4, tmp, policy), **kw)


def _loadgen(c: Cluster, clients: int, seconds: int, out: Path) -> subprocess.Popen[bytes]:
    conf = c.write_loadgen_conf(timeout_ms=1000)
    cmd = [
        str(c.binary.parent / "zz-loadgen"),
        "--conf", str(conf),
        "--clients", str(clients),
        "--payload", "16",
        "--seconds", str(seconds),
        "--json", str(out),
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _current_log(c: Cluster, r: int) -> Path:
    path = walfile.current_log(c.dir / f"data{r}")
    assert path is not None, f"replica {r} has no log file"
    return path


def _secret(c: Cluster, principal: int) -> dict[int, bytes]:
    return c.client_secret(principal - 65536)


def _fetch_log(c: Cluster, replica: int) -> dict[int, bytes]:
    """The committed log above replica's stable checkpoint: seq -> batch digest (FETCH
    kind 3 as execution replica 0, docs/wire.md)."""
    principal = wire.exec_principal(0)
    keys: dict[int, bytes] = {}
    for line in (c.key_dir / f"p{principal}.secret").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "mac":
            keys[int(parts[1])] = bytes.fromhex(parts[2])
    msg = wire.Fetch(1, principal, kind=wire.FETCH_LOG, seq=0, digest=bytes(32))
    with socket.create_connection(("127.0.0.1", c.port(replica)), timeout=5) as s:
        s.sendall(wire.frame(msg.with_macs({replica: keys[replica]}).encode()))
        buf = b""
        while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
            chunk = s.recv(1 << 16)
            assert chunk, "replica closed the connection without answering"
            buf += chunk
    reply = wire.decode(buf[4 : 4 + int.from_bytes(buf[:4], "big")])
    assert isinstance(reply, wire.FetchReply)
    data = reply.data
    count, off, out = int.from_bytes(data[8:12], "big"), 12, {}
    for _ in range(count):
        seq = int.from_bytes(data[off : off + 8], "big")
        digest = data[off + 8 : off + 40]
        n = int.from_bytes(data[off + 40 : off + 44], "big")
        batch = data[off + 44 : off + 44 + n]
        assert n == 0 or sha256(batch) == digest
        out[seq] = digest
        off += 44 + n
    return out


def _ops_in_log(c: Cluster, replica: int) -> dict[bytes, int]:
    """op -> seq of every request in the committed log above the stable checkpoint."""
    principal = wire.exec_principal(0)
    keys: dict[int, bytes] = {}
    for line in (c.key_dir / f"p{principal}.secret").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "mac":
            keys[int(parts[1])] = bytes.fromhex(parts[2])
    msg = wire.Fetch(1, principal, kind=wire.FETCH_LOG, seq=0, digest=bytes(32))
    with socket.create_connection(("127.0.0.1", c.port(replica)), timeout=5) as s:
        s.sendall(wire.frame(msg.with_macs({replica: keys[replica]}).encode()))
        buf = b""
        while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
            chunk = s.recv(1 << 16)
            assert chunk
            buf += chunk
    reply = wire.decode(buf[4 : 4 + int.from_bytes(buf[:4], "big")])
    assert isinstance(reply, wire.FetchReply)
    data = reply.data
    count, off, ops = int.from_bytes(data[8:12], "big"), 12, {}
    for _ in range(count):
        seq = int.from_bytes(data[off : off + 8], "big")
        n = int.from_bytes(data[off + 40 : off + 44], "big")
        if n:
            _t, _s, reqs = wire.decode_batch(data[off + 44 : off + 44 + n])
            for raw in reqs:
                op = wire.decode(raw).op
                assert op not in ops, f"{op!r} ordered twice ({ops[op]} and {seq})"
                ops[op] = seq
        off += 44 + n
    return ops


def _start(c: Cluster, r: int) -> str:
    """Start replica r and wait for its recovery line (it listens before it replays)."""
    size = c.log_path(r).stat().st_size if c.log_path(r).exists() else 0
    c.start(r)

    def new_log() -> str:
        return c.log_path(r).read_bytes()[size:].decode(errors="replace")

    c.wait_for(lambda: "durable state: recovered" in new_log(), timeout=20, what="recovery")
    c.wait_for(lambda: "listening" in new_log(), timeout=20, what="listening")
    return new_log()


def _caught_up(c: Cluster, replicas: list[int]) -> bool:
    st = [c.stats(r) for r in replicas]
    return len({(s["last_exec"], s["app_digest"]) for s in st}) == 1


def _order(c: Cluster, ops: list[bytes], client: int = 7) -> None:
    async def run() -> None:
        cl = c.client(client)
        for op in ops:
            assert await cl.invoke(op, timeout=20) == op

    asyncio.run(run())


# The write policy differs from fsync only in the sync call; its kill run (17 s) is `long`.
@pytest.mark.parametrize("policy", ["fsync", pytest.param("write", marks=pytest.mark.long)])
def test_replica_killed_under_load_restarts_from_its_log_and_keeps_ordering(
    tmp_path: Path, policy: str
) -> None:
    c = _cluster(tmp_path, policy, checkpoint_interval=32, log_window=64)
    with c:
        c.start()
        lg = _loadgen(c, clients=8, seconds=16, out=tmp_path / "lg.json")
        try:
            c.wait_for(lambda: c.stats(2)["stable_seq"] >= 64, timeout=30, what="load")
            before = c.stats(2)
            assert before["wal"]["enabled"] == 1 and before["wal"]["writes"] > 0
            # durability write: written before every send, never synced
            assert (before["wal"]["syncs"] > 0) == (policy == "fsync")
            # fsync: the syncs run in the replica's sync thread beside its loop, whose
            # COMMITs wait in net for their ticket; the loop syncs only its rewrites
            w = before["wal"]
            assert w["sync_thread"] == (policy == "fsync"), w
            if policy == "fsync":
                assert w["syncs"] > w["loop_syncs"] and w["waited"] > 0, before
            c.kill(2)
            time.sleep(0.5)
            _start(c, 2)
            w = c.stats(2)["wal"]
            assert w["recovered_records"] > 0 and w["recovered_tail"] == "clean"
            # What it had: its stable checkpoint (rewritten into the log as it advanced)
            # and the batches it had executed above it, run again from the log.
            assert w["recovered_stable"] >= before["stable_seq"]
            assert w["recovered_last_exec"] >= before["stable_seq"]
            target = c.stats(0)["last_exec"]
            c.wait_for(lambda: c.stats(2)["last_exec"] >= target, timeout=30, what="catch up")
            # With replica 3 down, nothing commits without replica 2: it orders again.
            c.kill(3)
            at = c.stats(0)["last_exec"]
            c.wait_for(
                lambda: c.stats(0)["last_exec"] >= at + 20, timeout=30, what="order without 3"
            )
        finally:
            _, err = lg.communicate(timeout=60)
        r = json.loads((tmp_path / "lg.json").read_text())
        assert r["completed"] > 0 and r["wrong_results"] == 0, err
        c.wait_for(lambda: _caught_up(c, [0, 1, 2]), timeout=20, what="same state")
        assert all(s["view"] == 0 for s in c.stats_all([0, 1, 2]))


def _damage_setup(c: Cluster) -> Path:
    """Load, then requests until replica 2's current log holds records after its rewrite;
    replica 2 killed. Returns its current log file."""
    lg = _loadgen(c, clients=4, seconds=2, out=c.dir / "lg.json")
    lg.communicate(timeout=60)
    k = 0
    while True:
        _order(c, [b"more-%d" % i for i in range(k, k + 4)])
        k += 4
        c.wait_for(lambda: _caught_up(c, [0, 1, 2, 3]), timeout=20, what="same state")
        time.sleep(1.2)  # the once-a-second write of records no send pushed out
        _, recs = walfile.records(_current_log(c, 2))
        if len(walfile.after_rewrite(recs)) > 5:
            break
        assert k < 200, [r.type for r in recs]
    c.kill(2)
    return _current_log(c, 2)


@pytest.mark.parametrize("damage", ["torn", "bitflip"])
def test_damaged_log_is_detected_and_the_replica_recovers_from_peers(
    tmp_path: Path, damage: str
) -> None:
    c = _cluster(tmp_path, checkpoint_interval=128, log_window=256)
    with c:
        c.start()
        path = _damage_setup(c)
        if damage == "torn":
            # A write cut short by the crash: the last record's second half never landed.
            hit = walfile.tear(path)
            want = "torn tail"
        else:
            # One bit flipped in a record between the rewrite and the last one.
            hit = walfile.flip(path, random.Random(7))
            want = "corrupt tail"
        assert hit is not None
        off = hit.offset
        log = _start(c, 2)
        assert want in log and f"at offset {off}" in log, c.log_tail(2)
        w = c.stats(2)["wal"]
        assert w["recovered_tail"] == ("torn" if damage == "torn" else "corrupt")
        assert w["discard_offset"] == off
        assert (c.dir / "data2" / "wal.damaged").exists()
        if damage == "bitflip":
            # Synced records are lost: no vote for the seqs they could be about until the
            # stable checkpoint passes them; the other three order meanwhile.
            assert w["abstain_until"] == w["recovered_stable"] + 256 and w["abstaining"] == 1
            assert f"seqs up to {w['abstain_until']} until the stable checkpoint" in log
            # The abstention is in the rewritten log: a crash meanwhile does not end it.
            c.kill(2)
            _start(c, 2)
            w2 = c.stats(2)["wal"]
            assert w2["recovered_tail"] == "clean" and w2["abstaining"] == 1
            assert w2["abstain_until"] == w["abstain_until"]
            deadline = time.monotonic() + 60
            while c.stats(2)["wal"]["abstaining"]:
                assert time.monotonic() < deadline, c.summary()
                _loadgen(c, clients=4, seconds=2, out=c.dir / "lg2.json").communicate(timeout=60)
            assert c.stats(2)["stable_seq"] >= w["abstain_until"]
        else:
            assert w["abstain_until"] == 0  # a torn write was never acted on
        # It has what was before the damage and takes the rest from its peers; with replica
        # 3 down it is needed for every new request.
        c.wait_for(lambda: _caught_up(c, [0, 1, 2, 3]), timeout=30, what="recovered")
        c.kill(3)
        _order(c, [b"after-%d" % i for i in range(5)], client=9)
        c.wait_for(lambda: _caught_up(c, [0, 1, 2]), timeout=20, what="same state")
        # A restart after that replays a clean log: the damage was never written back.
        c.kill(2)
        _start(c, 2)
        assert c.stats(2)["wal"]["recovered_tail"] == "clean"
        c.wait_for(lambda: _caught_up(c, [0, 1, 2]), timeout=20, what="same state again")


@pytest.mark.parametrize("inflight", [None, 4], ids=["default-inflight", "inflight-4"])
def test_all_replicas_killed_keep_every_acknowledged_request_at_its_seq(
    tmp_path: Path, inflight: int | None
) -> None:
    # A window large enough that the whole run stays above the stable checkpoint, so the
    # committed log served (FETCH kind 3) covers every seq before and after the crash.
    # Durable replicas keep one batch in flight by default; with 4 (a rack's max_inflight)
    # several slots are prepared or committed and unexecuted at the kill.
    over = _durable(4, tmp_path, "fsync") | ({"max_inflight": inflight} if inflight else {})
    c = Cluster(tmp_path, g=1, overrides=over, checkpoint_interval=1024, log_window=2048)
    with c:
        c.start()
        acked: list[bytes] = []

        # At most 6 x 150 requests, so fewer seqs than the checkpoint interval however fast
        # the machine (a quiet CI machine ordered 3,100 seqs in the 3 s this test once slept
        # before the kill).
        async def client(i: int, stop: float) -> None:
            cl = c.client(i)
            k = 0
            while time.monotonic() < stop and k < 150:
                op = b"c%d-%d" % (i, k)
                try:
                    assert await cl.invoke(op, timeout=3) == op
                except (ClientTimeout, TimeoutError, ConnectionError, OSError):
                    return  # the replicas are gone
                acked.append(op)
                k += 1

        async def run() -> None:
            stop = time.monotonic() + 30
            tasks = [asyncio.create_task(client(i, stop)) for i in range(6)]
            while len(acked) < 300 and time.monotonic() < stop - 20:
                await asyncio.sleep(0.05)  # mid-flight: some acknowledged, more to come
            before.update(_fetch_log(c, 1))
            for r in range(4):  # all at once, mid-flight
                c.kill(r)
            await asyncio.gather(*tasks)

        before: dict[int, bytes] = {}
        asyncio.run(run())
        assert len(acked) > 20 and len(before) > 5, (len(acked), len(before))
        # all above the stable checkpoint (0), before and after
        assert max(before) < 1024, max(before)
        for r in range(4):
            _start(c, r)
        # Ordering resumes from what the logs kept.
        _order(c, [b"after-%d" % i for i in range(5)], client=20)
        c.wait_for(lambda: _caught_up(c, [0, 1, 2, 3]), timeout=30, what="same state")
        stats = c.stats_all()
        assert all(s["wal"]["recovered_records"] > 0 for s in stats), [s["wal"] for s in stats]
        assert all(s["state_transfers"] == 0 for s in stats), c.summary()
        logs = [_fetch_log(c, r) for r in range(4)]
        for r in range(4):
            # No seq committed before the crash holds another batch after it.
            for seq, digest in before.items():
                assert logs[r].get(seq) == digest, (r, seq, sorted(logs[r])[:3], c.summary())
            assert logs[r] == logs[0], (r, sorted(set(logs[r]) ^ set(logs[0]))[:10], c.summary())
        # Every acknowledged request is in the log, exactly once, at a seq the replicas agree on.
        ops = _ops_in_log(c, 0)
        missing = [op for op in acked if op not in ops]
        assert not missing, (len(missing), missing[:5], c.summary())


def test_a_data_dir_holding_another_replicas_log_is_refused(tmp_path: Path) -> None:
    c = _cluster(tmp_path)
    with c:
        c.start()
        c.stop(1)
        conf = c.conf_path(1)
        conf.write_text(conf.read_text().replace(str(tmp_path / "data1"), str(tmp_path / "data0")))
        # It listens before it reads its log: the start may or may not see it exit.
        with contextlib.suppress(RuntimeError):
            c.start(1)
        c.wait_for(lambda: not c.alive(1), timeout=20, what="the refusal")
        assert c.procs[1].returncode == 1
        log = c.log_tail(1)
        assert "another replica's or another version's log" in log, log
        assert "give each replica its own data_dir" in log


def test_the_execution_log_and_its_stable_checkpoint_survive_a_restart(tmp_path: Path) -> None:
    """External execution: the batches kept for execution replicas below the agreement
    stable checkpoint, and the stable execution checkpoint the served log starts after, come
    back from the log (before, a restarted replica served only what lay above its own
    stable checkpoint and named no execution checkpoint)."""
    from tests.test_agreement_log import _fetch_log as fetch
    from tests.test_agreement_log import _order_raw, _sign_seed
    from zz.crypto import SigningKey

    c = _cluster(tmp_path, app="kv", checkpoint_interval=8, log_window=16)
    with c:
        c.start()
        _order_raw(c, 30, one_by_one=True)  # each in its own batch: a sync per phase is slow
        digest = sha256(b"checkpoint at 8")
        for i in (0, 1):
            p = wire.exec_principal(i)
            msg = wire.ExecCheckpoint(1, p, seq=8, checkpoint=digest)
            with socket.create_connection(("127.0.0.1", c.port(1)), timeout=5) as s:
                s.sendall(wire.frame(msg.signed(SigningKey(_sign_seed(c, p))).encode()))
                time.sleep(0.3)
        c.wait_for(lambda: c.stats(1)["exec_stable"] == 8, timeout=10, what="exec stable")
        s1 = c.stats(1)
        assert s1["stable_seq"] >= 16  # the agreement log moved past the execution log's start
        me = wire.exec_principal(0)
        before = fetch(c, 1, me, 0)
        entries = wire.log_entries(before.data)
        assert [e.seq for e in entries] == list(range(1, s1["last_exec"] + 1))
        time.sleep(1.2)  # the once-a-second write of records nothing sent depended on
        c.kill(1)
        _start(c, 1)
        assert c.stats(1)["exec_stable"] == 8
        after = fetch(c, 1, me, 0)
        assert (after.seq, after.digest) == (8, digest)
        assert wire.log_entries(after.data) == entries


def test_a_replica_commits_on_its_own_commit_only_once_its_record_is_synced(
    tmp_path: Path,
) -> None:
    """A replica's own COMMIT counts toward its commit quorum only once the record it
    depends on (its P entry) is synced, as every COMMIT it receives was sent only then. With
    replica 3 stopped, replica 1 needs its own COMMIT to commit; its syncs are held
    (inject_sync_gate), so it must neither execute nor reply until one runs. Before this rule
    it committed on its own unsynced COMMIT plus those of 0 and 2 and executed at once: a
    host crash then could lose the P entry the reply relied on."""
    gate = tmp_path / "sync-gate"
    c = _cluster(tmp_path, overrides_per_replica={1: {"inject_sync_gate": str(gate)}})
    with c:
        c.start()
        _order(c, [b"warm-up"])
        c.wait_for(lambda: _caught_up(c, [0, 1, 2, 3]), timeout=30, what="same state")
        c.stop(3)
        before = c.stats(1)
        gate.touch()

        async def run() -> bytes:
            task = asyncio.create_task(c.client(0).invoke(b"gated", timeout=60))
            # Replicas 0 and 2 prepared it and synced their P entries, so their COMMITs are
            # out; replica 1 has prepared it too, its COMMIT held behind its sync.
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                s = [c.stats(r) for r in (0, 1, 2)]
                if all(x["phases"]["prepared"] > before["phases"]["prepared"] for x in s):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"not prepared everywhere: {c.summary()}")
            # Given time to take the COMMITs of 0 and 2, replica 1 still has not executed
            # it: its own COMMIT does not count yet, and nobody else can commit without it.
            for _ in range(15):
                await asyncio.sleep(0.1)
                s1 = c.stats(1)
                assert s1["last_exec"] == before["last_exec"], c.summary()
                assert s1["wal"]["commit_unsynced"] == 0, s1["wal"]
            assert not task.done()
            gate.unlink()
            return await task

        assert asyncio.run(run()) == b"gated"
        c.wait_for(
            lambda: all(c.stats(r)["last_exec"] > before["last_exec"] for r in (0, 1, 2)),
            timeout=30,
            what="executed everywhere once the sync ran",
        )
        assert all(c.stats(r)["wal"]["commit_unsynced"] == 0 for r in (0, 1, 2))


def test_pre_prepares_restored_from_the_log_are_sent_again_to_a_replica_that_lacks_them(
    tmp_path: Path,
) -> None:
    """Replica 1 is down while batches are ordered; then every replica is killed and all are
    started again. The others' slots come back from their logs without the PRE-PREPARE frame
    (the log keeps the batch), so on replica 1's STATUS the primary makes the PRE-PREPARE
    again from the logged batch (same view, seq and batch: no new proposal). Without it
    replica 1 got the votes but never the batches, and waited for the next stable
    checkpoint (1024 seqs here) or a view change: seen as a 30 s stall in CI."""
    c = _cluster(tmp_path, checkpoint_interval=1024, log_window=2048)
    with c:
        c.start()
        _order(c, [b"a-%d" % i for i in range(3)])
        c.kill(1)
        _order(c, [b"b-%d" % i for i in range(5)])  # ordered by 0, 2 and 3 alone
        for r in (0, 2, 3):
            c.kill(r)
        for r in range(4):
            _start(c, r)
        _order(c, [b"after"], client=20)
        c.wait_for(lambda: _caught_up(c, [0, 1, 2, 3]), timeout=20, what="replica 1 caught up")
