# tests/test_link.py - zz.link.Link against a local asyncio server: reconnects after the
# server restarts, on_connect messages first, frames delivered, backoff capped, close.
from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from zz import wire
from zz.link import Link
from zz.ports import free_port


def M(text: bytes) -> bytes:
    """A message of at least the 16 bytes a frame must carry."""
    return text.ljust(wire.HDR_LEN, b".")


class Server:
    """A frame server on a fixed port: records what it reads, can push frames, restart."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.server: asyncio.Server | None = None
        self.received: list[bytes] = []
        self.writers: list[asyncio.StreamWriter] = []
        self.accepts = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", self.port)

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.close()
        self.writers = []
        await self.server.wait_closed()
        self.server = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepts += 1
        self.writers.append(writer)
        try:
            while True:
                self.received.append(await wire.read_frame(reader))
        except (OSError, asyncio.IncompleteReadError, wire.FrameError):
            pass
        finally:
            writer.close()

    def push(self, msg: bytes) -> None:
        for w in self.writers:
            w.write(wire.frame(msg))


class Recorder(Link):
    def __init__(self, addr: tuple[str, int], hello: list[bytes] | None = None, **kw: Any) -> None:
        super().__init__(addr, "test", **kw)
        self.hello = hello or []
        self.frames: list[bytes] = []
        self.errors = 0

    def on_connect(self) -> list[bytes]:
        return list(self.hello)

    def on_frame(self, raw: bytes) -> None:
        self.frames.append(raw)

    def on_frame_error(self) -> None:
        self.errors += 1


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def with_server(body: Callable[[Server], Awaitable[None]]) -> None:
    srv = Server(free_port())
    await srv.start()
    try:
        await body(srv)
    finally:
        if srv.server is not None:
            await srv.stop()


async def test_on_connect_first_then_send_and_frames() -> None:
    async def body(srv: Server) -> None:
        link = Recorder(("127.0.0.1", srv.port), hello=[M(b"hello-1"), M(b"hello-2")])
        assert not link.send(M(b"too early"))  # down: refused, not queued
        link.start()
        await until(lambda: link.up)
        assert link.send(M(b"payload"))
        await until(lambda: len(srv.received) == 3)
        assert srv.received == [M(b"hello-1"), M(b"hello-2"), M(b"payload")]
        srv.push(M(b"from server"))
        await until(lambda: link.frames == [M(b"from server")])
        assert link.connects == 1
        await link.close()

    await with_server(body)


async def test_reconnects_after_server_restart() -> None:
    async def body(srv: Server) -> None:
        link = Recorder(("127.0.0.1", srv.port), hello=[M(b"hi")])
        link.start()
        await until(lambda: link.up and srv.received == [M(b"hi")])
        await srv.stop()
        await until(lambda: not link.up)
        assert not link.send(M(b"lost"))
        await asyncio.sleep(0.2)  # a few failed dials while the server is away
        await srv.start()
        await until(lambda: link.up and link.connects == 2)
        assert link.send(M(b"after"))
        # The hello goes out again on the new connection, before anything sent on it.
        await until(lambda: srv.received == [M(b"hi"), M(b"hi"), M(b"after")])
        srv.push(M(b"again"))
        await until(lambda: link.frames == [M(b"again")])
        await link.close()

    await with_server(body)


async def test_frame_error_drops_connection_and_reconnects() -> None:
    async def body(srv: Server) -> None:
        link = Recorder(("127.0.0.1", srv.port))
        link.start()
        await until(lambda: link.up)
        for w in srv.writers:
            w.write(b"\xff\xff\xff\xff garbage")  # a length far above the frame limit
        await until(lambda: link.errors == 1 and link.frame_errors == 1)
        await until(lambda: link.up and link.connects == 2)
        await link.close()

    await with_server(body)


async def test_backoff_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(delay: float) -> None:
        # asyncio.sleep is one module-wide function: record only the link's own sleeps.
        if asyncio.current_task() is link.task:
            sleeps.append(delay)
            delay = 0
        await real_sleep(delay)

    link = Recorder(("127.0.0.1", free_port()), backoff_min=0.05, backoff_max=0.4)
    monkeypatch.setattr("zz.link.asyncio.sleep", fake_sleep)
    link.start()
    try:
        await until(lambda: len(sleeps) >= 8)
    finally:
        monkeypatch.undo()
        await link.close()
    assert sleeps[:6] == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4]
    assert max(sleeps) == 0.4
    assert link.connects == 0


async def test_write_buffer_cap_closes_slow_peer() -> None:
    overflowed: list[int] = []

    class Capped(Recorder):
        def on_overflow(self) -> None:
            overflowed.append(1)

    # A server that accepts but never reads: the writes pile up in our transport.
    stalled: list[asyncio.StreamWriter] = []

    async def handle(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        stalled.append(w)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    link = Capped(("127.0.0.1", port), max_write_buffer=1 << 16)
    link.start()
    try:
        await until(lambda: link.up)
        chunk = b"x" * (1 << 16)
        for _ in range(10_000):
            if not link.send(chunk):
                break
        assert link.overflows == 1 and overflowed == [1]
        assert not link.up and not link.send(b"x" * 16)
        # close() keeps the buffered bytes until the peer takes them or goes away; the
        # peer going away ends the connection, and the link dials again.
        for w in stalled:
            w.transport.abort()
        await until(lambda: link.connects == 2)
    finally:
        for w in stalled:
            w.transport.abort()
        await link.close()
        server.close()
        await server.wait_closed()


async def test_close_cancels_while_connected_and_while_dialling() -> None:
    async def body(srv: Server) -> None:
        link = Recorder(("127.0.0.1", srv.port))
        link.start()
        await until(lambda: link.up)
        await link.close()
        assert link.task is not None and link.task.done()
        assert not link.up
        await until(lambda: srv.writers[0].is_closing())  # the server saw the close
        assert srv.accepts == 1

    await with_server(body)

    nowhere = Recorder(("127.0.0.1", free_port()))
    nowhere.start()
    await asyncio.sleep(0.1)
    await nowhere.close()
    assert nowhere.task is not None and nowhere.task.cancelled()
    assert nowhere.connects == 0


async def test_close_does_not_hang_on_a_peer_that_stopped_reading() -> None:
    """A paused replica accepts but never reads: bytes pile up in our send buffer, and
    a plain close() would wait for them to drain for ever (zz drill hung on this)."""
    held: list[socket.socket] = []
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    link = Recorder(lsock.getsockname())
    link.start()
    try:
        await until(lambda: link.up)
        conn, _ = lsock.accept()  # accepted, never read from
        held.append(conn)
        big = M(b"x" * 65536)
        for _ in range(200):  # ~13 MB: far beyond the kernel's socket buffers
            link.send(big)
        await asyncio.wait_for(link.close(), 3)
    finally:
        for s in held:
            s.close()
        lsock.close()
