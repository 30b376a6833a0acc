# tests/test_limits_slow_reader.py - a client that never reads its replies (docs/security.md
# "Slow readers"): the replies queued for one client, over all its connections, stay within
# client_out_bytes; a connection over that budget, or whose queue makes no progress for
# out_stall_timeout_ms, is closed and counted per client; an honest client keeps being
# served. Before the budget each connection held up to 64 MiB of replies for good (three
# connections: +192 MiB of RSS).
from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from pathlib import Path

import pytest
from cluster import running_cluster
from test_limits_conns import limits, rss_kib

from zz import wire

MIB = 1 << 20
OP = 512 << 10  # each read-only request's op, echoed back in its reply
PER_CONN = 140  # requests per connection: 70 MiB of replies, over the old 64 MiB bound
N_CONNS = 3
ATTACKER = 3  # client index; the honest one is 1


@pytest.fixture(autouse=True)
def _small_quarantine(monkeypatch: pytest.MonkeyPatch) -> None:
    # ASan keeps freed memory in a quarantine (256 MB by default), which would show in RSS.
    monkeypatch.setenv("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0:quarantine_size_mb=8")


def reader_that_never_reads(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # little kernel buffering
    s.settimeout(10)
    s.connect(("127.0.0.1", port))
    return s


def read_only_request(c: object, ts: int) -> bytes:
    req = wire.Request(c.service.id, c.client_principal(ATTACKER), ts, wire.FLAG_READONLY,  # type: ignore[attr-defined]
                       b"r" * OP)  # fmt: skip
    return wire.frame(req.with_macs(c.client_secret(ATTACKER)).encode())  # type: ignore[attr-defined]


def reset_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True once the replica closed the connection within `timeout`, seen without reading
    (a read would be progress): it resets a slow reader's connection."""
    p = select.poll()
    p.register(sock, select.POLLRDHUP)
    return any(ev & (select.POLLHUP | select.POLLERR | select.POLLRDHUP)
               for _, ev in p.poll(timeout * 1000))  # fmt: skip


def flood(sock: socket.socket, frame: bytes, count: int) -> int:
    """Send `count` requests, each answered with a reply of OP bytes that is never read;
    returns how many went out before the replica closed the connection."""
    for i in range(count):
        try:
            sock.sendall(frame)
        except OSError:
            return i
    return count


def test_never_reading_client_is_bounded_and_dropped(tmp_path: Path) -> None:
    with running_cluster(tmp_path, clients=4) as c:
        pid = c.procs[0].pid
        port = c.port(0)
        latencies: list[float] = []
        stop = threading.Event()

        async def honest() -> None:
            async with c.client(1) as cl:
                k = 0
                while not stop.is_set():
                    op = f"honest {k}".encode()
                    t0 = time.monotonic()
                    assert await cl.invoke(op, timeout=10) == op
                    latencies.append(time.monotonic() - t0)
                    k += 1
                    await asyncio.sleep(0.02)

        thread = threading.Thread(target=lambda: asyncio.run(honest()))
        thread.start()
        socks: list[socket.socket] = []
        try:
            time.sleep(1.0)
            base = rss_kib(pid)
            quiet = len(latencies)
            frame = read_only_request(c, time.time_ns())
            # The attack: one connection after the other gets 70 MiB of replies it never
            # reads (replies go to the connection the client's newest request came from).
            sent = []
            for _ in range(N_CONNS):
                s = reader_that_never_reads(port)
                socks.append(s)
                sent.append(flood(s, frame, PER_CONN))
            time.sleep(1.0)
            lim = limits(c, 0)
            grown_mib = (rss_kib(pid) - base) / 1024
            # One client's replies: at most its budget (4 MiB) plus the reply that found its
            # queue empty; the buffers holding them at most twice that; read buffers and
            # allocator slack the rest.
            assert grown_mib < 40, f"RSS grew {grown_mib:.0f} MiB ({lim}, sent {sent})"
            assert lim["client_out_budget"] == 4 * MIB
            assert lim["client_out_largest"] <= 4 * MIB + OP + 64, lim
            assert lim["out_buffer_bytes"] <= 4 * MIB + OP + 64, lim
            # Every connection that stopped reading is closed: over the budget at once,
            # the rest once out_stall_timeout_ms (10 s) passes without progress.
            assert all(reset_by_peer(s, 15) for s in socks), f"slow readers kept open {lim}"
            lim = limits(c, 0)
            assert lim["client_out_overflows"] >= 1, lim
            assert lim["slow_readers"].get(str(c.client_principal(ATTACKER)), 0) >= N_CONNS, lim
            assert str(c.client_principal(1)) not in lim["slow_readers"], lim
            c.wait_for(lambda: limits(c, 0)["out_buffer_bytes"] == 0, 5, "queues released")
            # The honest client was served all along.
            assert len(latencies) > quiet, "no honest request completed during the attack"
            assert max(latencies) < 5.0, f"honest latency up to {max(latencies):.1f} s"
        finally:
            stop.set()
            thread.join(timeout=20)
            for s in socks:
                s.close()


def test_budget_spans_connections_and_stalls_time_out(tmp_path: Path) -> None:
    """Two connections of one client, each under its 16 MiB budget, together over it: the
    older one is closed (over the budget); the newer one, under it but never read, after
    out_stall_timeout_ms. Both counted for that client."""
    overrides = {"out_stall_timeout_ms": 1500, "client_out_bytes": 16 * MIB}
    with running_cluster(tmp_path, clients=4, overrides=overrides) as c:
        frame = read_only_request(c, time.time_ns())
        older, newer = (reader_that_never_reads(c.port(0)) for _ in range(2))
        try:
            # 14 MiB of replies each: the kernel's socket buffers take a few MiB, the rest
            # (10 MiB or more) waits in the replica.
            assert flood(older, frame, 28) == 28
            lim = limits(c, 0)
            assert 0 < lim["client_out_queued"] <= 16 * MIB, lim
            assert flood(newer, frame, 28) == 28
            assert reset_by_peer(older, 2), "the older connection was kept over the budget"
            lim = limits(c, 0)
            assert lim["client_out_overflows"] == 1 and lim["out_stall_timeouts"] == 0, lim
            assert 0 < lim["client_out_largest"] <= 16 * MIB, lim
            t0 = time.monotonic()
            assert reset_by_peer(newer, 10), "a stalled reader was kept open"
            waited = time.monotonic() - t0
            lim = limits(c, 0)
            assert lim["out_stall_timeouts"] == 1, lim
            assert lim["slow_readers"] == {str(c.client_principal(ATTACKER)): 2}, lim
            assert waited < 1.5 + 2.0, f"closed {waited:.1f} s after the last request"
            assert lim["out_buffer_bytes"] == 0 and lim["client_out_queued"] == 0, lim

            async def one() -> bytes:
                async with c.client(ATTACKER) as cl:  # it may come back and read this time
                    return await cl.invoke(b"back", timeout=15)

            assert asyncio.run(one()) == b"back"
        finally:
            older.close()
            newer.close()
