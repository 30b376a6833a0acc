# tests/test_limits_proxy.py - zz proxy and the service's request size limit (docs/proxy.md,
# docs/wire.md "Size limits"): --max-body is lowered to the clients' request limit, so a body
# over it gets 413 from its Content-Length (or while de-chunking) before the proxy reads it;
# an op that still does not fit (its head) or that the replicas refuse also gets 413.
from __future__ import annotations

import asyncio

from zz.client import Client, ClientParams, RequestTooLarge
from zz.proxy import ClientPool, Proxy, ProxyOptions, with_request_limit

LIMIT = 1 << 20


def pool_with_limit() -> ClientPool:
    params = ClientParams(
        service=1,
        g=1,
        client_index=0,
        replicas=[("127.0.0.1", 1)] * 4,
        keys=dict.fromkeys(range(4), bytes(32)),
        max_request=LIMIT,
    )
    return ClientPool([Client(params)])  # never started: nothing connects


async def status_of(port: int, data: bytes) -> tuple[int, bytes]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(data)
        await w.drain()
        async with asyncio.timeout(5):
            head = await r.readuntil(b"\r\n\r\n")
        return int(head.split()[1]), head
    finally:
        w.close()


async def test_body_over_the_request_limit_gets_413_unread() -> None:
    calls: list[int] = []

    async def invoke(op: bytes, read_only: bool, timeout: float) -> bytes:
        calls.append(len(op))
        raise RequestTooLarge(len(op), LIMIT)

    pool = pool_with_limit()
    assert pool.max_request == LIMIT
    options = with_request_limit(ProxyOptions(host="127.0.0.1", port=0), pool.max_request)
    assert options.limits.max_body == LIMIT
    proxy = Proxy(invoke, options)
    await proxy.start()
    port = proxy.address[1]
    try:
        # 4 MiB announced (under the proxy's own 8 MiB default), not one body byte sent:
        # the answer must come from the Content-Length alone.
        status, head = await status_of(
            port, b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 4194304\r\n\r\n"
        )
        assert status == 413 and b"Connection: close" in head
        # Chunked: refused once the chunks pass the limit; the rest is never sent.
        chunk = b"%x\r\n" % (512 << 10) + bytes(512 << 10) + b"\r\n"
        status, _ = await status_of(
            port,
            b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 3,
        )
        assert status == 413
        # A body under the limit whose op the service refuses (RequestTooLarge): 413 too.
        status, _ = await status_of(
            port, b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"
        )
        assert status == 413
        assert len(calls) == 1 and proxy.stats["too_large"] == 1
        assert proxy.stats["status_413"] == 2
    finally:
        await proxy.close()


async def test_connections_over_a_cap_get_503_and_are_counted() -> None:
    """Connections over the per-source cap (2) or the total cap (3) get 503 at once,
    nothing read, and are counted; a freed slot serves again. Sources are told apart
    by binding clients to other loopback addresses."""

    async def invoke(op: bytes, read_only: bool, timeout: float) -> bytes:
        raise RequestTooLarge(len(op), LIMIT)  # a 413 that keeps the connection

    proxy = Proxy(
        invoke, ProxyOptions(host="127.0.0.1", port=0, max_conns=3, max_conns_per_source=2)
    )
    await proxy.start()
    port = proxy.address[1]
    held: list[asyncio.StreamWriter] = []
    request = b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"

    async def connect(source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        held.append(w)
        return r, w

    async def served(source: str) -> None:
        r, w = await connect(source)
        w.write(request)
        async with asyncio.timeout(5):
            head = await r.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 413"), head  # in, and registered

    async def refused(source: str) -> None:
        r, _ = await connect(source)
        async with asyncio.timeout(5):  # without sending anything: refused on accept
            answer = await r.read()
        assert answer.startswith(b"HTTP/1.1 503") and b"Connection: close" in answer

    try:
        await served("127.0.0.1")
        await served("127.0.0.1")
        await refused("127.0.0.1")
        assert proxy.stats["conns_refused"] == proxy.stats["conns_refused_source"] == 1
        await served("127.0.0.2")
        await refused("127.0.0.3")
        assert proxy.stats["conns_refused"] == 2 and proxy.stats["conns_refused_source"] == 1
        held[0].close()
        async with asyncio.timeout(5):
            while len(proxy._conns) > 2:
                await asyncio.sleep(0.01)
        await served("127.0.0.1")
        assert proxy.stats["connections"] == 4
    finally:
        for w in held:
            w.close()
        await proxy.close()
