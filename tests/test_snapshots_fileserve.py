# tests/test_snapshots_fileserve.py - serving checkpoint files to recovering peers
# (snapshots/fileserve.py), from a directory store and from real ZFS snapshots via clones.
from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_controld_guest_files import _ctx as guest_ctx

from tests import zfs_pool
from zz import keys, wire
from zz.config import Config
from zz.crypto import SigningKey
from zz.execution import runtime
from zz.execution.runtime import Runtime, RuntimeOptions
from zz.snapshots import open_store
from zz.snapshots.fetch import SourceError, StateFetcher
from zz.snapshots.fileserve import (
    CHALLENGE,
    CHALLENGE_LEN,
    LATER,
    MAX_CHUNK,
    NO_CHECKPOINT,
    NO_FILE,
    OK,
    REFUSED,
    FileRead,
    SnapshotFiles,
)
from zz.snapshots.manifest import Manifest, scan
from zz.snapshots.peersource import PeerSource
from zz.snapshots.store import CheckpointStore, checkpoint_name

zfs_daemon, pool = zfs_pool.zfs_daemon, zfs_pool.pool  # the fixtures, found here by pytest


def checkpoint(store: CheckpointStore, manifests: Path, seq: int) -> Manifest:
    m = scan(store.path)
    manifests.mkdir(exist_ok=True)
    (manifests / f"{checkpoint_name(seq)}.manifest").write_bytes(m.encode())
    store.snapshot(checkpoint_name(seq))
    return m


class LocalSource:
    """A StateFetcher source straight on SnapshotFiles (the wire in between is tested
    in tests/test_recovery_fetch.py)."""

    name = "local"

    def __init__(self, files: SnapshotFiles) -> None:
        self.files = files

    def fetch(self, seq: int, path: str, size: int, sha256: bytes = b"") -> bytes:
        out = b""
        while True:
            r = self.files.read(seq, path, len(out), 3)  # tiny chunks: exercise offsets
            if r.status != OK:
                raise SourceError(f"status {r.status}")
            out += r.data
            if len(out) >= r.size or not r.data:
                return out


def exercise(store: CheckpointStore, tmp_path: Path) -> None:
    manifests = tmp_path / "manifests"
    (store.path / "d").mkdir()
    (store.path / "d" / "f").write_bytes(b"version one")
    m10 = checkpoint(store, manifests, 10)
    (store.path / "d" / "f").write_bytes(b"version two, longer")
    (store.path / "g").write_bytes(b"g")
    checkpoint(store, manifests, 20)
    files = SnapshotFiles(store, manifests, servable=lambda s: s != 30)
    try:
        assert files.read(10, "d/f", 0, 100).data == b"version one"
        assert files.read(20, "d/f", 8, 3).data == b"two"
        assert files.read(20, "d/f", 0, 1).size == len(b"version two, longer")
        assert files.read(10, "", 0, 1 << 20).data == m10.encode()
        assert files.read(10, "g", 0, 10).status == NO_FILE  # not in that checkpoint
        assert files.read(10, "../etc/passwd", 0, 10).status == REFUSED
        assert files.read(10, "d//f", 0, 10).status == REFUSED
        assert files.read(99, "d/f", 0, 10).status == NO_CHECKPOINT
        assert files.read(30, "d/f", 0, 10).status == REFUSED
        # A fetcher recovers checkpoint 10 into an empty directory through it.
        local = tmp_path / "recovering"
        local.mkdir()
        f = StateFetcher(local, m10, 10, [LocalSource(files)])
        f.prepare()
        f.fetch_all()
        assert scan(local).files == m10.files
        # Release before destroying: ZFS refuses to destroy a snapshot with a clone.
        files.release(checkpoint_name(10))
        store.destroy_snapshot(checkpoint_name(10))
        (manifests / f"{checkpoint_name(10)}.manifest").unlink()
        # A file of a collected checkpoint comes from the next one (the requester checks
        # it against its own manifest); the manifest itself only from the exact one.
        later = files.read(10, "d/f", 0, 100)
        assert (later.status, later.data) == (LATER, b"version two, longer")
        assert files.read(10, "", 0, 100).status == NO_CHECKPOINT
        assert files.read(20, "d/f", 0, 100).status == OK
        assert files.read(25, "d/f", 0, 100).status == NO_CHECKPOINT
    finally:
        files.release()


def test_dir_store(tmp_path: Path) -> None:
    exercise(open_store("dir", root=tmp_path / "store"), tmp_path)


def test_zfs_store_through_clones(pool: str, tmp_path: Path) -> None:
    store = open_store("zfs", pool=pool, dataset="fs", mountpoint=tmp_path / "live")
    exercise(store, tmp_path)


@pytest.mark.parametrize("bad", ["", "x" * 5000])
def test_bad_paths_never_raise(tmp_path: Path, bad: str) -> None:
    store = open_store("dir", root=tmp_path / "store")
    (store.path / "a").write_bytes(b"a")
    checkpoint(store, tmp_path / "m", 1)
    files = SnapshotFiles(store, tmp_path / "m")
    r = files.read(1, bad, 0, 10)
    assert r.status in (OK, REFUSED)  # "" is the manifest itself


def test_remembered_manifest_is_served_without_reading_its_file(tmp_path: Path) -> None:
    """The runtime hands over the manifest it just built (SnapshotFiles.remember): the
    first request of a recovering peer needs no decode of the saved file."""
    store = open_store("dir", root=tmp_path / "store")
    manifests = tmp_path / "manifests"
    (store.path / "a").write_bytes(b"a")
    m = checkpoint(store, manifests, 4)
    files = SnapshotFiles(store, manifests)
    files.remember(4, m)
    (manifests / f"{checkpoint_name(4)}.manifest").write_bytes(b"not read")
    assert files.read(4, "", 0, 1 << 20).data == m.encode()
    assert files.read(4, "a", 0, 10).data == b"a"
    files.release(checkpoint_name(4))  # forgets the remembered copy too
    assert files.read(4, "", 0, 1 << 20).status == NO_CHECKPOINT


def test_offsets_past_what_pread_takes_are_refused(tmp_path: Path) -> None:
    """A u64 offset >= 2^63 made os.pread raise OverflowError out of read()."""
    store = open_store("dir", root=tmp_path / "store")
    (store.path / "a").write_bytes(b"abc")
    checkpoint(store, tmp_path / "m", 1)
    files = SnapshotFiles(store, tmp_path / "m")
    for offset, length in ((1 << 63, 10), ((1 << 64) - 1, 10), (-1, 10), (0, -1)):
        assert files.read(1, "a", offset, length).status == REFUSED
    assert files.read(1, "a", 1 << 62, 10) == FileRead(OK, 3, b"")
    assert files.read(1, "a", 1, 1 << 40).data == b"bc"


def signed_fetch(
    config: Config,
    index: int,
    seq: int,
    path: bytes,
    offset: int,
    *,
    target: int,
    challenge: bytes = b"",
) -> bytes:
    """A framed FILE-FETCH for one chunk, signed by execution replica `index`, for the
    server `target` on the connection whose challenge is `challenge`."""
    svc = config.services[0]
    key = keys.load_secret(keys.secret_path(config.rack.key_dir, svc.id, 256 + index)).sign
    assert key is not None
    m = wire.FileFetch(
        svc.id, wire.exec_principal(index), seq, path, offset, MAX_CHUNK, target, challenge
    )
    return wire.frame(m.signed(key).encode())


async def answer(r: asyncio.StreamReader) -> wire.FileData:
    async with asyncio.timeout(5):
        m = wire.decode(await wire.read_frame(r))
    assert isinstance(m, wire.FileData)
    return m


async def challenge_of(
    r: asyncio.StreamReader, w: asyncio.StreamWriter, config: Config, index: int, target: int
) -> bytes:
    """The server's challenge on the connection (r, w), as a requester's first FILE-FETCH
    on it gets it."""
    w.write(signed_fetch(config, index, 0, b"", 0, target=target))
    m = await answer(r)
    assert m.status == CHALLENGE and len(m.data) == CHALLENGE_LEN
    return m.data


async def sock_challenge_of(sock: socket.socket, config: Config, index: int, target: int) -> bytes:
    """challenge_of on a non-blocking socket."""
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(sock, signed_fetch(config, index, 0, b"", 0, target=target))
    buf = b""
    async with asyncio.timeout(5):
        while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
            buf += await loop.sock_recv(sock, 4096)
    m = wire.decode(buf[4:])
    assert isinstance(m, wire.FileData) and m.status == CHALLENGE
    return m.data


async def test_runtime_answers_bad_ranges_and_drops_requesters_that_never_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime's file server over a real socket: an offset of 2^63 gets a REFUSED
    FILE-DATA and is counted (of a file it has, it raised out of the connection task); a
    requester that sends 8 requests for 4 MiB chunks and never reads holds at most one
    chunk in our buffers and is dropped after FILE_SEND_TIMEOUT (every chunk was buffered
    at once, for good)."""
    ctx = guest_ctx(tmp_path)
    svc = ctx.config.services[0]
    rt = Runtime(ctx.config, svc, 0, RuntimeOptions(state_dir=tmp_path / "st"))
    # What Runtime.serve sets up before it listens, without the agreement links.
    rt.publics = keys.PeerKeys(ctx.config.rack.key_dir, ctx.config, svc, rt.counters)
    rt.ckpt.manifest_dir.mkdir(parents=True)
    rt._open_state()
    chunk = bytes(MAX_CHUNK)
    real_read = rt.ckpt.files.read
    monkeypatch.setattr(
        rt.ckpt.files,
        "read",
        lambda seq, path, offset, length, sha256=b"": (
            real_read(seq, path, offset, length) if path != "big" else FileRead(OK, 1 << 30, chunk)
        ),
    )
    monkeypatch.setattr(runtime, "FILE_SEND_TIMEOUT", 1.0, raising=False)
    server = await asyncio.start_server(rt._serve_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sock = socket.socket()
    x0 = wire.exec_principal(0)
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        c = await challenge_of(r, w, ctx.config, 1, x0)
        w.write(signed_fetch(ctx.config, 1, 8, b"a", 1 << 63, target=x0, challenge=c))
        m = await answer(r)
        assert m.status == REFUSED and m.offset == 1 << 63
        assert rt.counters["file_fetch_bad_range"] == 1
        w.close()

        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        c = await sock_challenge_of(sock, ctx.config, 1, x0)
        for k in range(8):
            await asyncio.get_running_loop().sock_sendall(
                sock, signed_fetch(ctx.config, 1, 8, b"big", k * MAX_CHUNK, target=x0, challenge=c)
            )
        async with asyncio.timeout(8):
            while rt.counters["file_fetch_slow_readers"] == 0:
                await asyncio.sleep(0.05)
        assert rt.counters["file_chunks_served"] <= 1 + 2  # the bad range's, then 1 or 2
    finally:
        sock.close()
        server.close()
        await server.wait_closed()


# ---- FILE-FETCH bound to one server and one connection (docs/security.md) -------------


class Recorder:
    """A TCP relay between a requester and a server that keeps every frame the requester
    sends: what someone capturing the rack's traffic holds afterwards."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.frames: list[bytes] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return "127.0.0.1", self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _relay(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(*self.upstream)

        async def requests() -> None:
            while True:
                n = await cr.readexactly(4)
                frame = n + await cr.readexactly(int.from_bytes(n, "big"))
                self.frames.append(frame)
                sw.write(frame)
                await sw.drain()

        async def answers() -> None:
            while data := await sr.read(1 << 16):
                cw.write(data)
                await cw.drain()

        tasks = [asyncio.create_task(requests()), asyncio.create_task(answers())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        cw.close()
        sw.close()


def exec_key(config: Config, index: int) -> SigningKey:
    svc = config.services[0]
    key = keys.load_secret(keys.secret_path(config.rack.key_dir, svc.id, 256 + index)).sign
    assert key is not None
    return key


def peer_source(
    config: Config, addr: tuple[str, int], index: int, target: int, name: str = "x0"
) -> PeerSource:
    """What execution replica `index` fetches from the server `target` at addr with."""
    return PeerSource(
        name,
        addr,
        service=config.services[0].id,
        me=wire.exec_principal(index),
        target=target,
        sign_key=exec_key(config, index),
        timeout=2.0,
    )


FETCHED = {"small": b"checkpoint 8\n", "big": bytes(range(256)) * (9 << 12)}  # 9 MiB: 3 chunks


async def serving_runtime(tmp_path: Path) -> tuple[Config, Runtime, asyncio.Server]:
    """Execution replica 0's runtime with checkpoint 8 of FETCHED, its file server
    listening on a port of its own (Runtime._serve_conn, as Runtime.serve sets it up)."""
    ctx = guest_ctx(tmp_path)
    svc = ctx.config.services[0]
    rt = Runtime(ctx.config, svc, 0, RuntimeOptions(state_dir=tmp_path / "st"))
    rt.publics = keys.PeerKeys(ctx.config.rack.key_dir, ctx.config, svc, rt.counters)
    rt.ckpt.manifest_dir.mkdir(parents=True)
    rt._open_state()
    for rel, data in FETCHED.items():
        (rt.ckpt.store.path / rel).write_bytes(data)
    checkpoint(rt.ckpt.store, rt.ckpt.manifest_dir, 8)
    (rt.ckpt.store.path / "small").write_bytes(b"changed since\n")
    server = await asyncio.start_server(rt._serve_conn, "127.0.0.1", 0)
    return ctx.config, rt, server


async def test_runtime_refuses_a_captured_fetch_replayed_on_another_connection(
    tmp_path: Path,
) -> None:
    """Replica 1 fetches a file from replica 0 through a relay that keeps its frames.
    Each captured frame, replayed byte for byte on a connection of the replayer's own
    (then, or after the requester's connection closed: stale), gets no byte of the file:
    the requester's first one gets a challenge it cannot sign for, the one carrying its
    connection's challenge is refused (REFUSED) and counted. Before, the replay was
    answered with the file, any number of times."""
    config, rt, server = await serving_runtime(tmp_path)
    rec = Recorder(server.sockets[0].getsockname()[:2])
    try:
        src = peer_source(config, await rec.start(), 1, wire.exec_principal(0))
        got = await asyncio.to_thread(src.fetch, 8, "small", len(FETCHED["small"]))
        assert got == FETCHED["small"]
        assert len(rec.frames) == 2  # the first without a challenge, then with it
        for closed in (False, True):
            if closed:
                src.close()  # the requester's connection is gone: its challenge with it
            for frame in rec.frames:
                r, w = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
                w.write(frame)
                w.write(frame)  # twice on one connection, too
                for _ in range(2):
                    m = await answer(r)
                    assert m.status in (CHALLENGE, REFUSED), m
                    assert FETCHED["small"] not in m.data
                w.close()
        assert rt.counters["file_fetch_replayed"] == 4
        assert rt.counters["file_chunks_served"] == 1  # the requester's own
    finally:
        src.close()
        await rec.close()
        server.close()
        await server.wait_closed()


async def test_runtime_refuses_a_fetch_addressed_to_another_server(tmp_path: Path) -> None:
    """A FILE-FETCH names the server it is for: one for replica 2 (captured on its way
    there, say) is refused by replica 0 even with replica 0's challenge on the
    connection, and counted; the requester hears REFUSED at once, not a timeout."""
    config, rt, server = await serving_runtime(tmp_path)
    addr = server.sockets[0].getsockname()[:2]
    x0, x2 = wire.exec_principal(0), wire.exec_principal(2)
    try:
        r, w = await asyncio.open_connection(*addr)
        c = await challenge_of(r, w, config, 1, x0)
        w.write(signed_fetch(config, 1, 8, b"small", 0, target=x2, challenge=c))
        assert (await answer(r)).status == REFUSED
        w.write(signed_fetch(config, 1, 8, b"small", 0, target=x0, challenge=c))
        assert (await answer(r)).data == FETCHED["small"]
        w.close()
        src = peer_source(config, addr, 1, x2)
        with pytest.raises(SourceError, match="refused"):
            await asyncio.to_thread(src.fetch, 8, "small", 0)
        src.close()
        assert rt.counters["file_fetch_wrong_target"] == 2
        assert rt.counters["file_chunks_served"] == 1
    finally:
        server.close()
        await server.wait_closed()


def fetch_in_parallel(sources: list[PeerSource], threads_per_source: int) -> list[bytes]:
    """Every file of FETCHED through every source, from threads_per_source threads each
    (the executor's and the background fetch's share a source), all at once."""
    jobs = [(src, rel) for src in sources for _ in range(threads_per_source) for rel in FETCHED]
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda j: j[0].fetch(8, j[1], len(FETCHED[j[1]])), jobs))


async def test_runtime_serves_a_requester_on_parallel_connections(tmp_path: Path) -> None:
    """A requester that fetches on several connections at once, and from several threads
    on one connection, is never refused: each connection has its own challenge, and
    requests on one connection may come in any order and repeat."""
    config, rt, server = await serving_runtime(tmp_path)
    addr = server.sockets[0].getsockname()[:2]
    sources = [peer_source(config, addr, 1, wire.exec_principal(0)) for _ in range(3)]
    try:
        got = await asyncio.to_thread(fetch_in_parallel, sources, 2)
        assert got == [FETCHED[rel] for _ in range(3 * 2) for rel in FETCHED]
        assert rt.counters["file_fetch_challenges"] == 3  # one per connection
        assert rt.counters["file_fetch_replayed"] == 0
        assert rt.counters["file_fetch_wrong_target"] == 0
    finally:
        for src in sources:
            src.close()
        server.close()
        await server.wait_closed()
