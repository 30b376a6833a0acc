# zz/link.py - one persistent, reconnecting outgoing connection carrying wire frames.
# Serves the client's connections to replicas and the execution runtime's links.
"""A `Link` dials `addr` until it connects, retrying with exponential backoff capped at
`backoff_max`. On each fresh connection it first writes what `on_connect()` returns,
then hands every frame it reads to `on_frame(raw)` until the connection breaks; then it
waits `backoff_min` and dials again. Subclasses override the hooks.

Invariants: `writer` is the live connection or None (never a closed one for longer than
the teardown of a broken one); `send` never blocks or queues while the link is down
(it returns False and what to do with the message is the caller's business). With
`max_write_buffer` set, a peer that stops reading has its connection closed once that
many bytes wait in the transport (counted in `overflows`), rather than buffering
without bound; the connection is aborted (its buffered bytes dropped at once: the
protocol retransmits what matters) and the link reconnects as after any other break.
A graceful close would keep those bytes, and the link down, for as long as the peer
stays stalled (stopped, not crashed).
"""

from __future__ import annotations

import asyncio
import contextlib

from zz import wire

BACKOFF_MIN = 0.05
BACKOFF_MAX = 1.0


class Link:
    """A reconnecting connection to `addr`; `start()` it once, `await close()` at the end.

    Counters (for status files and tests): `connects` (connections made), `frame_errors`
    (connections dropped for an undecodable frame), `overflows` (connections closed for a
    full write buffer)."""

    def __init__(
        self,
        addr: tuple[str, int],
        name: str = "",
        *,
        task_prefix: str = "zz-link-",
        max_write_buffer: int | None = None,
        backoff_min: float = BACKOFF_MIN,
        backoff_max: float = BACKOFF_MAX,
    ) -> None:
        self.addr = addr
        self.name = name or f"{addr[0]}:{addr[1]}"
        self.task_prefix = task_prefix
        self.max_write_buffer = max_write_buffer
        self.backoff_min = backoff_min
        self.backoff_max = backoff_max
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None
        self.connects = 0
        self.frame_errors = 0
        self.overflows = 0

    # ---- hooks ------------------------------------------------------------------------

    def on_connect(self) -> list[bytes]:
        """Messages to write first on every fresh connection, before any `send`."""
        return []

    def on_frame(self, raw: bytes) -> None:
        """One frame read from the connection."""

    def on_frame_error(self) -> None:
        """The peer sent something that is not a frame; the connection is dropped."""

    def on_overflow(self) -> None:
        """The write buffer passed `max_write_buffer`; the connection is being closed."""

    # ---- use --------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return self.writer is not None and not self.writer.is_closing()

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"{self.task_prefix}{self.name}")

    def send(self, msg: bytes) -> bool:
        """Frame and write `msg` if the link is up; False if it is down (or was just
        closed for overflowing)."""
        w = self.writer
        if w is None or w.is_closing():
            return False
        cap = self.max_write_buffer
        if cap is not None and w.transport.get_write_buffer_size() > cap:
            self.overflows += 1
            self.on_overflow()
            w.transport.abort()
            return False
        w.write(wire.frame(msg))
        return True

    async def close(self) -> None:
        if self.task is not None:
            # Cancel until the task is really done: asyncio.wait_for before Python 3.12
            # swallows a cancellation that races its inner future's completion, and a
            # link whose peer hung up at that moment went on reconnecting for good (a
            # runtime that never exited on SIGTERM: seen in CI).
            while not self.task.done():
                self.task.cancel()
                await asyncio.wait({self.task}, timeout=0.5)
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.writer is not None:
            self.writer.close()

    # ---- the connection loop ----------------------------------------------------------

    async def _run(self) -> None:
        backoff = self.backoff_min
        while True:
            try:
                reader, writer = await asyncio.open_connection(*self.addr)
            except OSError:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.backoff_max)
                continue
            backoff = self.backoff_min
            self.connects += 1
            self.writer = writer
            try:
                for msg in self.on_connect():
                    writer.write(wire.frame(msg))
                while True:
                    self.on_frame(await wire.read_frame(reader))
            except wire.FrameError:
                self.frame_errors += 1
                self.on_frame_error()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                self.writer = None
                # A peer that stopped reading (a paused replica) never lets buffered bytes
                # drain, and close() waits for them: abort instead, and bound the wait, or
                # a cancelled link hangs its owner for good.
                if writer.transport.get_write_buffer_size():
                    writer.transport.abort()
                else:
                    writer.close()
                with contextlib.suppress(OSError, TimeoutError):
                    async with asyncio.timeout(1.0):  # not wait_for: see close()
                        await writer.wait_closed()
            await asyncio.sleep(backoff)
