# tests/test_execution_runtime.py - execution replica runtime: commit certificates, reply
# cache, and the full path client -> zz-agreed -> execution replicas (real processes).
from __future__ import annotations

import asyncio
import json
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import REPO, SERVICE_ID, Cluster, _port_free
from zz import wire
from zz.crypto import NULL_DIGEST, sha256
from zz.execution.certificates import CommitCollector
from zz.execution.replycache import ReplyCache, ReplyCacheError
from zz.procrack import reap, signal_group, spawn, terminate

# ---- certificates ---------------------------------------------------------------------


def _batch(tag: bytes) -> tuple[bytes, bytes]:
    b = wire.batch_encoding(1000, 7, [tag])
    return sha256(b), b


def test_certificate_needs_2g_plus_1_matching() -> None:
    c = CommitCollector(4, 1)
    d, b = _batch(b"x")
    assert c.add(0, 1, d, b, 3)
    assert c.add(1, 1, d, b, 3)
    assert c.next_ready() is None
    assert c.add(2, 1, d, b, 2)
    cert = c.next_ready()
    assert cert is not None
    assert (cert.seq, cert.digest, cert.batch) == (1, d, b)
    assert cert.replicas == frozenset({0, 1, 2})
    assert cert.view == 3  # the (g+1)-th highest of 3, 3, 2


def test_certificate_waits_for_previous_seq() -> None:
    c = CommitCollector(4, 1)
    d, b = _batch(b"two")
    for r in range(3):
        c.add(r, 2, d, b)
    assert c.next_ready() is None  # seq 1 has not run
    assert c.certificate(2) is not None
    d1, b1 = _batch(b"one")
    for r in range(3):
        c.add(r, 1, d1, b1)
    cert = c.next_ready()
    assert cert is not None and cert.seq == 1
    c.executed(1)
    cert = c.next_ready()
    assert cert is not None and cert.seq == 2 and cert.batch == b


def test_faulty_conflicting_digest_ignored() -> None:
    c = CommitCollector(4, 1)
    good_d, good_b = _batch(b"good")
    bad_d, bad_b = _batch(b"evil")
    c.add(3, 1, bad_d, bad_b)  # the faulty replica votes first
    c.add(0, 1, good_d, good_b)
    c.add(1, 1, good_d, good_b)
    assert c.next_ready() is None
    # The faulty replica cannot vote again to complete or split a certificate.
    assert not c.add(3, 1, good_d, good_b)
    assert c.dropped["conflict"] == 1
    assert c.next_ready() is None
    c.add(2, 1, good_d, good_b)
    cert = c.next_ready()
    assert cert is not None and cert.digest == good_d and 3 not in cert.replicas


def test_duplicate_from_same_replica_counts_once() -> None:
    c = CommitCollector(4, 1)
    d, b = _batch(b"x")
    assert c.add(0, 1, d, b)
    assert not c.add(0, 1, d, b)
    assert not c.add(0, 1, d, b, 9)
    assert c.add(1, 1, d, b)
    assert c.next_ready() is None
    assert c.dropped["duplicate"] == 2


def test_batch_must_hash_to_digest() -> None:
    c = CommitCollector(4, 1)
    d, _ = _batch(b"real")
    _, other = _batch(b"fake")
    for r in range(4):
        assert not c.add(r, 1, d, other)
    assert c.next_ready() is None
    assert c.dropped["bad_batch"] == 4
    # A null request has an empty batch and the null digest, nothing else.
    assert not c.add(0, 1, NULL_DIGEST, b"junk")
    for r in range(3):
        assert c.add(r, 1, NULL_DIGEST, b"")
    cert = c.next_ready()
    assert cert is not None and cert.is_null and cert.batch == b""


def test_window_and_old_seqs() -> None:
    c = CommitCollector(4, 1, window=10)
    d, b = _batch(b"x")
    assert not c.add(0, 11, d, b)
    assert c.dropped["too_far"] == 1
    assert c.add(0, 10, d, b)
    c.executed(5)
    assert not c.add(1, 5, d, b)
    assert c.dropped["old"] == 1
    assert c.pending() == [10]
    assert not c.add(4, 6, d, b)  # replica 4 does not exist with n = 4
    assert c.dropped["bad_sender"] == 1


def test_g2_needs_five() -> None:
    c = CommitCollector(7, 2)
    d, b = _batch(b"x")
    for r in range(4):
        c.add(r, 1, d, b)
    assert c.next_ready() is None
    c.add(6, 1, d, b)
    assert c.next_ready() is not None


# ---- reply cache ------------------------------------------------------------------------


def test_reply_cache_exactly_once() -> None:
    rc = ReplyCache()
    assert rc.is_new(65536, 5)
    rc.record(65536, 5, b"r5")
    assert not rc.is_new(65536, 5)
    assert not rc.is_new(65536, 4)
    assert rc.is_new(65536, 6)
    hit = rc.cached(65536, 5)
    assert hit is not None and hit.result == b"r5"
    assert rc.cached(65536, 4) is None
    with pytest.raises(ValueError):
        rc.record(65536, 5, b"again")
    rc.record(65536, 9, b"r9", read_only=True)
    hit = rc.get(65536)
    assert hit is not None and hit.timestamp == 9 and hit.read_only


def test_reply_cache_encoding_canonical_and_strict() -> None:
    a, b = ReplyCache(), ReplyCache()
    a.record(65540, 1, b"one")
    a.record(65536, 2, b"")
    b.record(65536, 2, b"")
    b.record(65540, 1, b"one")
    assert a.encode() == b.encode()  # insertion order does not matter
    enc = a.encode()
    back = ReplyCache.decode(enc)
    assert back.encode() == enc and len(back) == 2
    assert ReplyCache.decode(ReplyCache().encode()).encode() == ReplyCache().encode()
    for bad in (enc[:-1], enc + b"\0", b"XXRC" + enc[4:], enc[:4] + b"\x01" + enc[5:]):
        with pytest.raises(ReplyCacheError):
            ReplyCache.decode(bad)
    # Entries out of order are not the canonical encoding.
    e1 = struct.pack(">IQBI", 65540, 1, 0, 0)
    e0 = struct.pack(">IQBI", 65536, 1, 0, 0)
    with pytest.raises(ReplyCacheError):
        ReplyCache.decode(struct.pack(">4sBBHI", b"ZZRC", 2, 0, 0, 2) + e1 + e0)


def test_reply_cache_keeps_no_read_results_in_checkpoints() -> None:
    """A replica that skipped a certified read in replay (ZZ §4.7.2) and one that ran it
    encode alike: a read's timestamp is state, its result is not."""
    ran, skipped = ReplyCache(), ReplyCache()
    ran.record(65536, 3, b"the value", read=True)
    skipped.record(65536, 3, None, read=True)
    ran.record(65537, 9, b"unordered", read_only=True)
    skipped.record(65537, 9, None, read_only=True)
    assert ran.encode() == skipped.encode()
    assert ReplyCache.decode(ran.encode()).encode() == ran.encode()
    back = ReplyCache.decode(ran.encode())
    hit = back.cached(65536, 3)
    assert hit is not None and hit.read and not hit.read_only and hit.result is None
    assert not back.is_new(65536, 3)  # exactly-once survives the lost result
    with pytest.raises(ValueError):
        skipped.record(65536, 4, None)  # a write's result is always kept
    # A stored read result is not the canonical encoding.
    e = struct.pack(">IQBI", 65536, 3, 1, 1) + b"v"
    with pytest.raises(ReplyCacheError):
        ReplyCache.decode(struct.pack(">4sBBHI", b"ZZRC", 2, 0, 0, 1) + e)


# ---- end to end: zz-agreed + two execution replicas + kv ------------------------------

KV_GET, KV_PUT = 1, 2


def _kv(code: int, *fields: bytes) -> bytes:
    return bytes([code]) + b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _kv_ok(value: bytes = b"") -> bytes:
    return bytes([0]) + struct.pack(">I", len(value)) + value


class ExecReplicas:
    """`python -m zz.execution` processes for one service; always torn down. `args[i]` are
    extra command-line arguments of replica i (fault switches, store)."""

    def __init__(self, cluster: Cluster, args: dict[int, list[str]] | None = None) -> None:
        self.cluster = cluster
        self.args = args or {}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def log_path(self, i: int) -> Path:
        return self.cluster.run_dir / f"exec-{i}.log"

    def status_path(self, i: int) -> Path:
        return self.cluster.run_dir / f"exec-{i}.status.json"

    def start(self, i: int) -> None:
        argv = [
            sys.executable, "-m", "zz.execution",
            "--rack", str(self.cluster.config_path),
            "--service", str(SERVICE_ID),
            "--index", str(i),
            *self.args.get(i, []),
        ]  # fmt: skip
        self.procs[i] = spawn(argv, self.log_path(i))

    def status(self, i: int) -> dict[str, Any]:
        try:
            return json.loads(self.status_path(i).read_text())
        except (OSError, ValueError):
            return {}

    def alive(self, i: int) -> bool:
        return self.procs[i].poll() is None

    def kill(self, i: int) -> None:
        """Crash replica i: SIGKILL its process group (no chance to clean up, as a power
        cut) and reap it."""
        p = self.procs[i]
        signal_group(p.pid, signal.SIGKILL)
        p.wait(timeout=10)

    def stop(self, i: int) -> int | None:
        """SIGTERM replica i, SIGKILL after 10 s: its exit status, None if killed."""
        return terminate(self.procs[i], timeout=10)

    def close(self) -> dict[int, int | None]:
        """Stop every replica (all SIGTERMed at once): exit status per replica. One still
        running after 10 s writes its threads' stacks to its log (SIGUSR2) and gets 20 s
        more (a loaded CI machine) before it is killed and reported as None."""
        for p in self.procs.values():
            if p.poll() is None:
                signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.05)
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGUSR2)
        return {i: reap(p, timeout=20) for i, p in self.procs.items()}

    def tails(self) -> str:
        out = []
        for i in self.procs:
            try:
                text = self.log_path(i).read_text(errors="replace")
            except OSError:
                text = "(no log)"
            out.append(f"---- exec {i} ----\n" + "\n".join(text.splitlines()[-30:]))
            out.append(json.dumps(self.status(i)))
        return "\n".join(out)


def _kv_cluster(
    tmp_path: Path, cp: int, active: int = 2, overrides: dict[str, Any] | None = None
) -> Cluster:
    """A g = f = 1 cluster whose service runs the kv app on `active` (default f+1 = 2)
    execution replicas; only those get committed batches (the others are spares)."""
    c = Cluster(
        tmp_path,
        checkpoint_interval=cp,
        log_window=2 * cp,
        app="kv",
        f=1,
        active=active,
        overrides=overrides,
    )
    assert c.service.active == active
    assert "execution external" in c.conf_path(0).read_text()
    return c


def _wait(pred: Any, timeout: float, what: str, diag: Any) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}\n{diag()}")
        time.sleep(0.1)


CP = 4
needs_agreed = pytest.mark.skipif(
    not (REPO / "agreement" / "src" / "main.c").exists(), reason="zz-agreed not written yet"
)


class Rig:
    def __init__(self, cluster: Cluster, execs: ExecReplicas) -> None:
        self.cluster = cluster
        self.execs = execs

    def diag(self) -> str:
        return self.execs.tails() + "\n" + self.cluster.summary()

    def wait(self, pred: Any, what: str, timeout: float = 30.0) -> None:
        _wait(pred, timeout, what, self.diag)

    def wait_linked(self, i: int) -> None:
        n = self.cluster.n
        self.wait(
            lambda: self.execs.status(i).get("agreement_links_up") == n,
            f"execution replica {i} connected to every agreement replica",
        )

    def wait_peers_linked(self, replicas: list[int]) -> None:
        """Every replica in `replicas` connected to every other one: until then a peer's
        EXEC-CHECKPOINT may be missed (only the last two are sent again on connect), and
        that replica sees a later checkpoint stable but not this one."""
        for i in replicas:
            want = sorted(j for j in replicas if j != i)
            self.wait(
                lambda i=i, want=want: set(want)
                <= set(self.execs.status(i).get("peer_links_up", [])),
                f"execution replica {i} connected to its peers {want}",
            )

    def invoke_all(self, ops: list[bytes], client_index: int = 0) -> list[bytes]:
        async def drive() -> list[bytes]:
            client = self.cluster.client(client_index)
            try:
                return [await client.invoke(op, timeout=30) for op in ops]
            finally:
                await client.close()

        return asyncio.run(drive())


def restart_after_checkpoint(rig: Rig, exact: bool = False) -> None:
    """PUT k0 .. k(2CP-1) = v0 .. ; once replica 1's stable checkpoint is 2*CP (or later,
    unless `exact`), stop replica 1 (SIGTERM: it must exit 0), start it again and wait
    until it is connected to every agreement replica."""
    execs = rig.execs
    puts = [_kv(KV_PUT, f"k{k}".encode(), b"v%d" % k) for k in range(2 * CP)]
    assert rig.invoke_all(puts) == [_kv_ok()] * (2 * CP)

    def stable() -> bool:
        seq = execs.status(1).get("stable_checkpoint", 0)
        return seq == 2 * CP if exact else seq >= 2 * CP

    rig.wait(stable, "checkpoint 2*CP stable on replica 1")
    assert execs.stop(1) == 0
    execs.start(1)
    rig.wait_linked(1)


@pytest.fixture
def rig(tmp_path: Path) -> Any:
    """zz-agreed (g = 1, kv app) + execution replicas 0 and 1, always torn down; the
    replicas must exit cleanly (status 0) on SIGTERM."""
    for attempt in range(20):
        cluster = _kv_cluster(tmp_path / f"try{attempt}", CP)
        # The harness picks free agreement ports; ours sit at base_port + 64 + i.
        addrs = cluster.service.exec_addresses(cluster.config)
        if all(_port_free(a[1]) for a in addrs):
            break
    execs = ExecReplicas(cluster)
    r = Rig(cluster, execs)
    ok = False
    try:
        cluster.start()
        execs.start(0)
        execs.start(1)
        r.wait_linked(0)
        r.wait_linked(1)
        yield r
        ok = True
    finally:
        if not ok:
            print(r.diag(), file=sys.stderr)
        codes = execs.close()
        cluster.__exit__(None if ok else RuntimeError, None, None)
    assert all(c == 0 for c in codes.values()), codes


@pytest.mark.slow
@needs_agreed
def test_kv_through_agreement_and_execution_replicas(rig: Rig) -> None:
    cp = CP
    cluster, execs = rig.cluster, rig.execs
    ops = [_kv(KV_PUT, f"k{k}".encode(), b"v%d" % k) for k in range(2 * cp + 1)]
    ops += [_kv(KV_GET, b"k3"), _kv(KV_GET, b"nope")]
    results = rig.invoke_all(ops)
    assert results[: 2 * cp + 1] == [_kv_ok()] * (2 * cp + 1)
    assert results[-2] == _kv_ok(b"v3")
    assert results[-1][0] == 1  # NOT_FOUND

    def caught_up(s: dict) -> bool:
        return (
            s.get("stable_checkpoint", 0) >= cp
            and s.get("last_executed", 0) >= 2 * cp
            and s.get("counters", {}).get("requests_executed", 0) >= 2 * cp + 3
        )

    # The status file is rewritten once a second: one written after the checkpoint turned
    # stable may still predate the last requests' execution.
    rig.wait(
        lambda: all(caught_up(execs.status(i)) for i in (0, 1)),
        "a stable checkpoint and every request executed on both execution replicas",
    )
    st = [execs.status(i) for i in (0, 1)]
    # Same checkpoint, same manifest, byte for byte, on both replicas.
    common = set(st[0]["checkpoints"]) & set(st[1]["checkpoints"])
    assert common, st
    for seq in common:
        assert st[0]["checkpoints"][seq] == st[1]["checkpoints"][seq]
        m = [
            (cluster.run_dir / f"exec-{i}" / "manifests" / f"ckpt-{seq}.manifest").read_bytes()
            for i in (0, 1)
        ]
        assert m[0] == m[1]
        assert sha256(m[0]).hex() == st[0]["checkpoints"][seq]
    # Snapshots live in the dir store; those below the stable checkpoint before the last
    # one are gone (a spare woken below the newest recovers from that one).
    for i in (0, 1):
        store = cluster.run_dir / f"exec-{i}" / "store"
        names = (store / "ORDER").read_text().split()
        stable = st[i]["stable_checkpoint"]
        assert f"ckpt-{stable}" in names
        assert all(int(n[5:]) >= stable - CP for n in names), names
        snap = store / "snapshots" / f"ckpt-{stable}"
        assert (snap / ".zz" / "replies").is_file()
        assert any((snap / "kv").iterdir())
        assert execs.alive(i)
    # The agreement replicas got the execution replicas' reports and checkpoints.
    agreed = cluster.stats(0)
    assert agreed.get("exec_reports", 0) >= 2 * (2 * cp)
    assert agreed.get("exec_checkpoints", 0) >= 2


@pytest.mark.slow
@needs_agreed
def test_hostile_input_is_dropped_and_counted(rig: Rig) -> None:
    cluster, execs = rig.cluster, rig.execs
    host, port = cluster.service.exec_address(cluster.config, 0)
    me = wire.exec_principal(0)
    client = wire.client_principal(0)
    key = cluster.client_secret(0)[me]
    junk = b"\x00" * 20
    bad_mac = wire.Request(SERVICE_ID, client, 1, 0, b"op").with_macs({me: bytes(32)})
    stranger = wire.client_principal(cluster.nclients + 5)
    unknown_client = wire.Request(SERVICE_ID, stranger, 1, 0, b"op").with_macs({me: key})
    wrong_service = wire.Request(SERVICE_ID + 1, client, 1, 0, b"op").with_macs({me: key})
    # A client key is not execution replica 1's signing key.
    from zz.crypto import SigningKey

    forged = wire.ExecCheckpoint(SERVICE_ID, wire.exec_principal(1), CP, bytes(32)).signed(
        SigningKey(bytes(range(32)))
    )
    not_for_us = wire.Prepare(SERVICE_ID, 0, 0, 1, bytes(32)).with_macs({me: key})
    import socket

    with socket.create_connection((host, port), timeout=5) as s:
        for m in (junk, *(x.encode() for x in (bad_mac, unknown_client, wrong_service))):
            s.sendall(wire.frame(m))
        s.sendall(wire.frame(forged.encode()) + wire.frame(not_for_us.encode()))
        s.sendall(b"\x00\x00\x00\x03abc")  # framing error: the replica closes
        s.settimeout(5)
        assert s.recv(1) == b""

    def counted() -> bool:
        c = execs.status(0).get("counters", {})
        return (
            c.get("bad_magic", 0) >= 1
            and c.get("bad_mac", 0) >= 1
            and c.get("wrong_sender", 0) >= 1
            and c.get("wrong_service", 0) >= 1
            and c.get("bad_sig", 0) >= 1
            and c.get("unexpected", 0) >= 1
            and c.get("frame_error", 0) >= 1
        )

    rig.wait(counted, "every bad message counted")
    # Nothing of it executed, and the replica still serves.
    assert execs.status(0)["counters"].get("requests_executed", 0) == 0
    assert rig.invoke_all([_kv(KV_PUT, b"a", b"1"), _kv(KV_GET, b"a")]) == [
        _kv_ok(),
        _kv_ok(b"1"),
    ]
    assert execs.alive(0) and execs.alive(1)


@pytest.mark.slow
@needs_agreed
def test_restart_resumes_from_own_checkpoint(rig: Rig) -> None:
    execs = rig.execs
    restart_after_checkpoint(rig)
    # Both replicas are needed for f+1 = 2 matching replies: replica 1 must have
    # restored the checkpoint's files and caught up with the committed log.
    more = [_kv(KV_GET, b"k2"), _kv(KV_PUT, b"after", b"x"), _kv(KV_GET, b"after")]
    assert rig.invoke_all(more, client_index=1) == [_kv_ok(b"v2"), _kv_ok(), _kv_ok(b"x")]
    rig.wait(
        lambda: execs.status(1).get("last_executed") == execs.status(0).get("last_executed"),
        "replica 1 caught up",
    )
    text = execs.log_path(1).read_text()
    assert "restored checkpoint ckpt-" in text
    # Each start logs its first report (power-loss runs compare the two runtimes' lines).
    assert text.count("first report since the process started: batch ") == 2, text
