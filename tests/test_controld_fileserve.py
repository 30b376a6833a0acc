# tests/test_controld_fileserve.py - controld serves its replicas' checkpoint snapshots to
# recovering replicas of the same service (FILE-FETCH / FILE-DATA, controld/snapshots.py),
# over a real socket to an in-process daemon, with the runtime's own fetch client.
from __future__ import annotations

import asyncio
import hashlib
import socket
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_controld_daemon import SVC, Node, Rack, make_rack
from test_snapshots_fileserve import (
    Recorder,
    answer,
    challenge_of,
    signed_fetch,
    sock_challenge_of,
)

from tests import zfs_pool
from zz import keys, wire
from zz.controld.daemon import ConnLimits
from zz.crypto import SigningKey
from zz.naming import zfs_dataset
from zz.snapshots.dirstore import DirStore
from zz.snapshots.fetch import SourceError
from zz.snapshots.fileserve import CHALLENGE, MAX_CHUNK, REFUSED
from zz.snapshots.manifest import scan
from zz.snapshots.peersource import PeerSource
from zz.snapshots.store import checkpoint_name
from zz.snapshots.zfs import ZfsStore, run_zfs

SEQ = 8
FILES = {"a.txt": b"alpha\n", "dir/b.bin": bytes(range(256)) * 40}
H1 = wire.host_principal(1)  # the controld the tests run (Node(rack, 1))


def _exec_key(rack: Rack, i: int) -> SigningKey:
    sk = keys.load_secret(keys.secret_path(rack.config.rack.key_dir, SVC, 256 + i)).sign
    assert sk is not None
    return sk


def _checkpoint(rack: Rack, i: int) -> bytes:
    """Replica i's directory store with checkpoint SEQ and its manifest, as the runtime
    leaves them in its state dir; returns the manifest encoding."""
    svc = rack.config.services[0]
    state = svc.exec_state_dir(rack.config, i)
    store = DirStore(state / "store")
    for rel, data in FILES.items():
        (store.path / rel).parent.mkdir(parents=True, exist_ok=True)
        (store.path / rel).write_bytes(data)
    m = scan(store.path)
    store.snapshot(checkpoint_name(SEQ))
    (state / "manifests").mkdir(exist_ok=True)
    enc = m.encode()
    (state / "manifests" / f"{checkpoint_name(SEQ)}.manifest").write_bytes(enc)
    (store.path / "a.txt").write_bytes(b"changed after the checkpoint\n")
    return enc


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[tuple[Rack, Node]]:
    rack = make_rack(tmp_path)
    # Execution replica 0 sits on hosts[(0 + service index 0 + 1) % 3] = h1.
    n = Node(rack, 1, "libvirt")
    await n.start()
    try:
        yield rack, n
    finally:
        await n.daemon.stop()
        n.hv.close()


def _source(port: int, me: int, key: SigningKey, target: int = H1) -> PeerSource:
    return PeerSource(
        "controld-h1",
        ("127.0.0.1", port),
        service=SVC,
        me=me,
        target=target,
        sign_key=key,
        timeout=1.0,
    )


def _fetch(port: int, me: int, key: SigningKey, path: str, size: int = 0) -> bytes:
    src = _source(port, me, key)
    try:
        return src.fetch(SEQ, path, size)
    finally:
        src.close()


async def test_controld_serves_its_replicas_checkpoint_files(node: tuple[Rack, Node]) -> None:
    rack, n = node
    enc = _checkpoint(rack, 0)
    me, key = wire.exec_principal(2), _exec_key(rack, 2)
    got = await asyncio.to_thread(_fetch, n.port, me, key, "")
    assert hashlib.sha256(got).digest() == hashlib.sha256(enc).digest()
    for rel, data in FILES.items():
        # The checkpoint's bytes, not the live directory's later ones.
        assert await asyncio.to_thread(_fetch, n.port, me, key, rel, len(data)) == data
    with pytest.raises(SourceError, match="no such file"):
        await asyncio.to_thread(_fetch, n.port, me, key, "missing.txt")
    with pytest.raises(SourceError):
        await asyncio.to_thread(_fetch, n.port, me, key, "../rack.toml")
    assert n.daemon.counters["file_chunks_served"] >= 3


async def test_controld_refuses_strangers_and_never_serves_a_replica_its_own_state(
    node: tuple[Rack, Node],
) -> None:
    rack, n = node
    _checkpoint(rack, 0)
    # Replica 0 asking for its own checkpoint: this host has no other replica of the service.
    with pytest.raises(SourceError):
        await asyncio.to_thread(_fetch, n.port, wire.exec_principal(0), _exec_key(rack, 0), "a.txt")
    # A forged signature, and a client principal: dropped and counted, no answer at all.
    with pytest.raises(SourceError):
        await asyncio.to_thread(_fetch, n.port, wire.exec_principal(2), _exec_key(rack, 1), "a.txt")
    with pytest.raises(SourceError):
        await asyncio.to_thread(_fetch, n.port, 1000, _exec_key(rack, 2), "a.txt")
    assert n.daemon.counters["file_fetch_bad_sig"] == 1
    assert n.daemon.counters["file_fetch_wrong_sender"] == 1
    assert n.daemon.counters["file_chunks_served"] == 0


zfs_daemon, pool = zfs_pool.zfs_daemon, zfs_pool.pool  # the fixtures, found here by pytest


async def test_controld_serves_a_zfs_replica_and_never_blocks_its_gc(
    tmp_path: Path, pool: str
) -> None:
    """A replica on ZFS (the runtime's dataset <pool>/s<id>-exec-<i>): controld reads its
    snapshot through a clone of its own, and the runtime's garbage collection destroys
    the snapshot anyway (and controld's clone with it); controld's next read falls back to the later
    checkpoint; nothing of controld's is left on the pool once it stops."""
    rack = make_rack(tmp_path)
    svc = rack.config.services[0]
    state = svc.exec_state_dir(rack.config, 0)
    store = ZfsStore(pool, zfs_dataset(svc, 0), mountpoint=state / "live")
    (state / "manifests").mkdir(parents=True)
    encs = {}
    for seq, value in ((SEQ, b"at 8\n"), (2 * SEQ, b"at 16\n")):
        for rel, data in FILES.items():
            (store.path / rel).parent.mkdir(parents=True, exist_ok=True)
            (store.path / rel).write_bytes(value if rel == "a.txt" else data)
        encs[seq] = scan(store.path).encode()
        store.snapshot(checkpoint_name(seq))
        (state / "manifests" / f"{checkpoint_name(seq)}.manifest").write_bytes(encs[seq])
    n = Node(rack, 1, "libvirt", store="zfs", zfs_pool=pool)
    await n.start()
    try:
        me, key = wire.exec_principal(2), _exec_key(rack, 2)
        assert await asyncio.to_thread(_fetch, n.port, me, key, "a.txt", 5) == b"at 8\n"
        clones = [d for d in _datasets(pool) if "--ctl-" in d]
        assert clones, _datasets(pool)  # controld holds a clone of ckpt-8
        # The runtime collects ckpt-8 (checkpoint 16 became stable): not blocked by it.
        store.destroy_snapshot(checkpoint_name(SEQ))
        (state / "manifests" / f"{checkpoint_name(SEQ)}.manifest").unlink()
        assert checkpoint_name(SEQ) not in store.list_snapshots()
        assert not [d for d in _datasets(pool) if d in clones]
        # dir/b.bin did not change: checkpoint 16's copy serves a request for 8's.
        data = FILES["dir/b.bin"]
        got = await asyncio.to_thread(_fetch, n.port, me, key, "dir/b.bin", len(data))
        assert got == data
    finally:
        await n.daemon.stop()
        n.hv.close()
    assert not [d for d in _datasets(pool) if "--ctl-" in d], _datasets(pool)
    store.destroy()


def _datasets(pool: str) -> list[str]:
    return run_zfs(["zfs", "list", "-H", "-o", "name", "-r", pool]).split()


async def test_controld_answers_bad_ranges_and_drops_requesters_that_never_read(
    tmp_path: Path,
) -> None:
    """An offset of 2^63 gets a REFUSED FILE-DATA, counted (it raised in the handler: no
    answer, internal_error); a requester that asks for 4 MiB chunks and never reads is
    dropped after send_timeout and counted (its handler waited on it for good)."""
    rack = make_rack(tmp_path)
    _checkpoint(rack, 0)
    big = (
        rack.config.services[0].exec_state_dir(rack.config, 0)
        / "store"
        / "snapshots"
        / checkpoint_name(SEQ)
        / "a.txt"
    )
    big.write_bytes(bytes(3 * MAX_CHUNK))  # the snapshot's copy, as served
    n = Node(rack, 1, "libvirt", limits=ConnLimits(send_timeout=1.0))
    await n.start()
    sock = socket.socket()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", n.port)
        c = await challenge_of(r, w, rack.config, 2, H1)
        w.write(signed_fetch(rack.config, 2, SEQ, b"a.txt", 1 << 63, target=H1, challenge=c))
        m = await answer(r)
        assert m.status == REFUSED
        assert n.daemon.counters["file_fetch_bad_range"] == 1
        w.close()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", n.port))
        c = await sock_challenge_of(sock, rack.config, 2, H1)
        for k in range(3):
            await loop.sock_sendall(
                sock,
                signed_fetch(rack.config, 2, SEQ, b"a.txt", k * MAX_CHUNK, target=H1, challenge=c),
            )
        async with asyncio.timeout(8):
            while n.daemon.counters["send_timeouts"] == 0:
                await asyncio.sleep(0.05)
        assert n.daemon.counters["internal_error"] == 0
        assert (await n.rpc("status"))["ok"]
    finally:
        sock.close()
        await n.close()


async def test_controld_refuses_replayed_and_misaddressed_fetches(
    node: tuple[Rack, Node],
) -> None:
    """Replica 2 fetches a.txt from controld through a relay that keeps its frames. Each
    captured frame replayed on a connection of the replayer's own, while the requester's
    connection is open and after it closed (stale), gets no byte of the file; a FILE-FETCH
    for another server (replica 0's own runtime) is refused even with this connection's
    challenge. All counted, and controld keeps serving. Before, every replay was answered
    with the file."""
    rack, n = node
    _checkpoint(rack, 0)
    me, key = wire.exec_principal(2), _exec_key(rack, 2)
    rec = Recorder(("127.0.0.1", n.port))
    src = _source((await rec.start())[1], me, key)
    try:
        assert await asyncio.to_thread(src.fetch, SEQ, "a.txt", 6) == FILES["a.txt"]
        assert len(rec.frames) == 2  # the first without a challenge, then with it
        for closed in (False, True):
            if closed:
                src.close()
            for frame in rec.frames:
                r, w = await asyncio.open_connection("127.0.0.1", n.port)
                w.write(frame)
                m = await answer(r)
                assert m.status in (CHALLENGE, REFUSED) and FILES["a.txt"] not in m.data, m
                w.close()
        assert n.daemon.counters["file_fetch_replayed"] == 2
        assert n.daemon.counters["file_chunks_served"] == 1  # the requester's own

        r, w = await asyncio.open_connection("127.0.0.1", n.port)
        c = await challenge_of(r, w, rack.config, 2, H1)
        x0 = wire.exec_principal(0)
        w.write(signed_fetch(rack.config, 2, SEQ, b"a.txt", 0, target=x0, challenge=c))
        assert (await answer(r)).status == REFUSED
        w.write(signed_fetch(rack.config, 2, SEQ, b"a.txt", 0, target=H1, challenge=c))
        assert (await answer(r)).data == FILES["a.txt"]
        w.close()
        with pytest.raises(SourceError, match="refused"):
            await asyncio.to_thread(_source(n.port, me, key, target=x0).fetch, SEQ, "a.txt", 6)
        assert n.daemon.counters["file_fetch_wrong_target"] == 2
        assert n.daemon.counters["internal_error"] == 0
        assert (await n.rpc("status"))["ok"]
    finally:
        src.close()
        await rec.close()


async def test_controld_serves_a_requester_on_parallel_connections(
    node: tuple[Rack, Node],
) -> None:
    """Three connections of one requester, two threads on each, all files at once: never
    refused (each connection has its own challenge)."""
    rack, n = node
    _checkpoint(rack, 0)
    me, key = wire.exec_principal(2), _exec_key(rack, 2)
    sources = [_source(n.port, me, key) for _ in range(3)]
    jobs = [(src, rel) for src in sources for _ in range(2) for rel in FILES]
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = await asyncio.to_thread(
                lambda: list(pool.map(lambda j: j[0].fetch(SEQ, j[1], len(FILES[j[1]])), jobs))
            )
        assert got == [FILES[rel] for _, rel in jobs]
        assert n.daemon.counters["file_fetch_challenges"] == 3
        assert n.daemon.counters["file_fetch_replayed"] == 0
    finally:
        for src in sources:
            src.close()
