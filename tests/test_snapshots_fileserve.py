# tests/test_snapshots_fileserve.py - serving checkpoint files to recovering peers
# (snapshots/fileserve.py), from a directory store and from real ZFS snapshots via clones.
from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from test_controld_guest_files import _ctx as guest_ctx

from tests import zfs_pool
from zz import keys, wire
from zz.config import Config
from zz.execution import runtime
from zz.execution.runtime import Runtime
from zz.snapshots import open_store
from zz.snapshots.fetch import SourceError, StateFetcher
from zz.snapshots.fileserve import (
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

    def fetch(self, seq: int, path: str, size: int) -> bytes:
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


def signed_fetch(config: Config, index: int, seq: int, path: bytes, offset: int) -> bytes:
    """A framed FILE-FETCH for one chunk, signed by execution replica `index`."""
    svc = config.services[0]
    key = keys.load_secret(keys.secret_path(config.rack.key_dir, svc.id, 256 + index)).sign
    assert key is not None
    m = wire.FileFetch(svc.id, wire.exec_principal(index), seq, path, offset, MAX_CHUNK)
    return wire.frame(m.signed(key).encode())


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
    rt = Runtime(ctx.config, svc, 0, state_dir=tmp_path / "st")
    # What Runtime.serve sets up before it listens, without the agreement links.
    rt.publics = keys.PeerKeys(ctx.config.rack.key_dir, ctx.config, svc, rt.counters)
    rt.manifest_dir.mkdir(parents=True)
    rt._open_state()
    chunk = bytes(MAX_CHUNK)
    real_read = rt.files.read
    monkeypatch.setattr(
        rt.files,
        "read",
        lambda seq, path, offset, length: (
            real_read(seq, path, offset, length) if path != "big" else FileRead(OK, 1 << 30, chunk)
        ),
    )
    monkeypatch.setattr(runtime, "FILE_SEND_TIMEOUT", 1.0, raising=False)
    server = await asyncio.start_server(rt._serve_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    sock = socket.socket()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(signed_fetch(ctx.config, 1, 8, b"a", 1 << 63))
        async with asyncio.timeout(5):
            m = wire.decode(await wire.read_frame(r))
        assert isinstance(m, wire.FileData) and m.status == REFUSED and m.offset == 1 << 63
        assert rt.counters["file_fetch_bad_range"] == 1
        w.close()

        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        for k in range(8):
            await asyncio.get_running_loop().sock_sendall(
                sock, signed_fetch(ctx.config, 1, 8, b"big", k * MAX_CHUNK)
            )
        async with asyncio.timeout(8):
            while rt.counters["file_fetch_slow_readers"] == 0:
                await asyncio.sleep(0.05)
        assert rt.counters["file_chunks_served"] <= 1 + 2  # the bad range's, then 1 or 2
    finally:
        sock.close()
        server.close()
        await server.wait_closed()
