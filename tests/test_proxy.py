"""tests/test_proxy.py - zz proxy's HTTP layer end to end over real sockets (httpx, raw, curl).
The invoker runs the real guestbook through the WSGI adapter in-process, as a replica would."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest

from tests.cluster import REPO, Cluster, _port_free, default_binary
from tests.test_execution_runtime import ExecReplicas
from zz.client import ClientTimeout
from zz.execution.app import ExecContext
from zz.execution.apps.wsgi import WsgiApp
from zz.execution.registry import create_app
from zz.execution.state import StateDir
from zz.http import Limits
from zz.httpop import decode_request
from zz.ports import free_port
from zz.proxy import ClientPool, Proxy, ProxyOptions, parse_listen

T0 = 1_700_000_000_000
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


@dataclass
class AppInvoker:
    """Stands in for the Client pool: executes each op on one WsgiApp, in arrival order,
    with the read-only flag the proxy chose, and records what it was given."""

    app: WsgiApp
    calls: list[tuple[bytes, bool]] = field(default_factory=list)
    seq: int = 0

    async def __call__(self, op: bytes, read_only: bool, timeout: float) -> bytes:
        assert timeout > 0
        self.calls.append((op, read_only))
        self.seq += 1
        ctx = ExecContext(
            self.seq, client=65536, timestamp=self.seq, time_ms=T0 + self.seq, seed=7,
            read_only=read_only,
        )  # fmt: skip
        return self.app.execute(op, ctx)


def _guestbook(root: Path) -> WsgiApp:
    root.mkdir()
    app = create_app("wsgi:guestbook")
    assert isinstance(app, WsgiApp)
    app.open(StateDir(root))
    return app


async def _start(invoke: Any, **opts: Any) -> Proxy:
    proxy = Proxy(invoke, ProxyOptions(host="127.0.0.1", port=0, **opts))
    await proxy.start()
    return proxy


@pytest.fixture
def gb(tmp_path: Path) -> AppInvoker:
    return AppInvoker(_guestbook(tmp_path / "state"))


@pytest.fixture
async def proxy(gb: AppInvoker) -> AsyncIterator[Proxy]:
    p = await _start(gb, limits=Limits(max_body=64 << 10), timeout=5.0)
    yield p
    await p.close()


def _url(p: Proxy) -> str:
    host, port = p.address
    return f"http://{host}:{port}"


async def _raw(p: Proxy, data: bytes, read_to_eof: bool = True) -> bytes:
    """Send `data` on a fresh connection and return everything until the server closes."""
    reader, writer = await asyncio.open_connection(*p.address)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response with a Content-Length body (what the proxy sends) off a stream."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        if line:
            n, _, v = line.partition(":")
            headers[n.strip().lower()] = v.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return status, headers, body


# -- the guestbook through the proxy -------------------------------------------------


async def test_get_root_serves_the_page(proxy: Proxy) -> None:
    async with httpx.AsyncClient(base_url=_url(proxy)) as c:
        r = await c.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert int(r.headers["content-length"]) == len(r.content)
    assert b"<form" in r.content
    assert "date" in r.headers


async def test_post_then_get_shows_escaped_entry(proxy: Proxy, gb: AppInvoker) -> None:
    async with httpx.AsyncClient(base_url=_url(proxy)) as c:
        form = {"name": "<b>eve</b>", "message": "hi <script>alert(1)</script> & bye"}
        r = await c.post("/", data=form)
        assert r.status_code == 303
        assert r.headers["location"] == "/#e1"
        page = (await c.get("/")).text
        entries = (await c.get("/entries.json")).json()
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; bye" in page
    assert "<script>" not in page
    assert "&lt;b&gt;eve&lt;/b&gt;" in page
    assert entries[0]["message"] == form["message"]
    assert entries[0]["time_ms"] == T0 + 1
    # The POST went ordered, the GETs on the read-only path.
    assert [ro for _, ro in gb.calls] == [False, True, True]


async def test_keep_alive_serves_several_requests_on_one_connection(proxy: Proxy) -> None:
    reader, writer = await asyncio.open_connection(*proxy.address)
    try:
        body = urlencode({"name": "a", "message": "one"}).encode()
        writer.write(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert (await _read_response(reader))[0] == 303
        writer.write(b"GET /entries.json HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, got = await _read_response(reader)
        assert status == 200 and json.loads(got)[0]["message"] == "one"
        # Pipelined: two requests in one write, answered in order.
        writer.write(
            b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n"
            b"Connection: close\r\n\r\n"
        )
        assert (await _read_response(reader))[0] == 404
        status, headers, _ = await _read_response(reader)
        assert status == 200 and headers["connection"] == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        writer.close()
    assert proxy.stats["connections"] == 1
    assert proxy.stats["requests"] == 4


async def test_http10_closes_unless_keep_alive(proxy: Proxy) -> None:
    out = await _raw(proxy, b"GET /entries.json HTTP/1.0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and out.endswith(b"[]\n")
    reader, writer = await asyncio.open_connection(*proxy.address)
    try:
        writer.write(b"GET /entries.json HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        status, headers, _ = await _read_response(reader)
        assert status == 200 and headers["connection"] == "keep-alive"
        writer.write(b"GET /entries.json HTTP/1.0\r\n\r\n")
        assert (await _read_response(reader))[0] == 200
        assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        writer.close()


async def test_chunked_upload(proxy: Proxy, gb: AppInvoker) -> None:
    body = urlencode({"name": "chunky", "message": "x" * 300}).encode()
    parts = [body[:7], body[7:200], body[200:]]
    chunked = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts)
    reader, writer = await asyncio.open_connection(*proxy.address)
    try:
        writer.write(
            b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\n\r\n"
            + chunked
            + b"0\r\nX-Trailer: dropped\r\n\r\n"
        )
        assert (await _read_response(reader))[0] == 303
        writer.write(b"GET /entries.json HTTP/1.1\r\nHost: x\r\n\r\n")
        entries = json.loads((await _read_response(reader))[2])
    finally:
        writer.close()
    assert entries[0]["name"] == "chunky" and entries[0]["message"] == "x" * 300
    req = decode_request(gb.calls[0][0])
    assert req.body == body
    assert [n for n, _ in req.headers] == ["content-type", "host"]


async def test_oversized_bodies_get_413_and_close(proxy: Proxy, gb: AppInvoker) -> None:
    out = await _raw(proxy, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 65537\r\n\r\nabc")
    assert out.startswith(b"HTTP/1.1 413 Content Too Large\r\n")
    assert b"Connection: close\r\n" in out
    chunk = b"8000\r\n" + b"a" * 0x8000 + b"\r\n"
    out = await _raw(
        proxy, b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 3
    )
    assert out.startswith(b"HTTP/1.1 413 ")
    # Exactly at the limit is fine (the guestbook itself then refuses it: over 16 KiB).
    async with httpx.AsyncClient(base_url=_url(proxy)) as c:
        r = await c.post("/", content=b"m=" + b"a" * ((64 << 10) - 2), headers=FORM)
    assert r.status_code == 413 and b"form over" in r.content
    assert len(gb.calls) == 1


async def test_expect_100_continue(proxy: Proxy) -> None:
    body = urlencode({"message": "after continue"}).encode()
    reader, writer = await asyncio.open_connection(*proxy.address)
    try:
        writer.write(
            b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\n\r\n" % len(body)
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        assert (await _read_response(reader))[0] == 303
    finally:
        writer.close()
    out = await _raw(proxy, b"POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                     b"Content-Length: 99999999\r\n\r\n")  # fmt: skip
    assert out.startswith(b"HTTP/1.1 413 ")  # refused before the client sends the body
    out = await _raw(proxy, b"GET / HTTP/1.1\r\nHost: x\r\nExpect: teapot\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 417 ")


@pytest.mark.parametrize(
    "data",
    [
        b"GARBAGE\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # a TLS ClientHello
        b"GET / HTTP/1.1 extra\r\nHost: x\r\n\r\n",
        b"GET  / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTQ/1.1\r\nHost: x\r\n\r\n",
        b"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /#frag HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET * HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\n\r\n",  # no Host
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-A : 1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n folded\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-A: a\rb\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0x10\r\n\r\n",
        b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY0\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nshort",  # then EOF
        b"GET / HTTP/1.1\r\nHost: x\r\n",  # EOF inside the head
    ],
)
async def test_malformed_requests_get_400_and_close(
    proxy: Proxy, gb: AppInvoker, data: bytes
) -> None:
    reader, writer = await asyncio.open_connection(*proxy.address)
    try:
        writer.write(data)
        if data.endswith((b"short", b"x\r\n")) and not data.endswith(b"\r\n\r\n"):
            writer.write_eof()
        out = await asyncio.wait_for(reader.read(), 5)  # EOF: the proxy closed
    finally:
        writer.close()
    assert out.startswith(b"HTTP/1.1 400 Bad Request\r\n"), out[:80]
    assert b"Connection: close\r\n" in out
    assert gb.calls == []
    # The server is still there.
    async with httpx.AsyncClient(base_url=_url(proxy)) as c:
        assert (await c.get("/entries.json")).status_code == 200


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"get / HTTP/1.1\r\nHost: x\r\n\r\n", 501),
        (b"CONNECT x:443 HTTP/1.1\r\nHost: x\r\n\r\n", 501),
        (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (70 << 10) + b"\r\n\r\n", 431),
        (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: aaaaaaaaaaaaaa\r\n" * 4000 + b"\r\n", 431),
    ],
)
async def test_other_refusals(proxy: Proxy, data: bytes, status: int) -> None:
    out = await _raw(proxy, data)
    assert out.startswith(b"HTTP/1.1 %d " % status), out[:80]


async def test_head_has_headers_but_no_body(proxy: Proxy) -> None:
    reader, writer = await asyncio.open_connection(*proxy.address)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        _, get_headers, page = await _read_response(reader)
        writer.write(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        # If HEAD had leaked a body, it would show up in front of this 404.
        writer.write(b"GET /missing HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, _ = await _read_response(reader)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Length: %d\r\n" % len(page) in head
    assert int(get_headers["content-length"]) == len(page)
    assert status == 404
    out = await _raw(proxy, b"HEAD / HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400 ") and out.endswith(b"\r\n\r\n")


async def test_timeout_gives_504_and_the_connection_lives_on(gb: AppInvoker) -> None:
    slow_paths: set[str] = {"/slow"}

    async def invoke(op: bytes, read_only: bool, timeout: float) -> bytes:
        if decode_request(op).path in slow_paths:
            await asyncio.sleep(3600)
        return await gb(op, read_only, timeout)

    p = await _start(invoke, timeout=0.3)
    try:
        async with httpx.AsyncClient(base_url=_url(p)) as c:
            r = await c.get("/slow")
            assert r.status_code == 504
            assert r.text == "no certified reply within 0.3 s\n"
            assert (await c.get("/entries.json")).status_code == 200
    finally:
        await p.close()
    assert p.stats["timeouts"] == 1


async def test_client_timeout_gives_504(gb: AppInvoker) -> None:
    async def invoke(op: bytes, read_only: bool, timeout: float) -> bytes:
        raise ClientTimeout("no reply certificate")

    p = await _start(invoke)
    try:
        async with httpx.AsyncClient(base_url=_url(p)) as c:
            assert (await c.get("/")).status_code == 504
    finally:
        await p.close()


async def test_bad_replies_and_invoker_failures_give_502(gb: AppInvoker) -> None:
    replies: list[Callable[[], Awaitable[bytes]]] = []

    async def not_http() -> bytes:
        return b"echo"

    async def boom() -> bytes:
        raise RuntimeError("network is down")

    async def interim() -> bytes:
        return b"ZP\x01\x00\x64" + b"\x00" * 12  # status 100, no reason/headers/body

    replies += [not_http, boom, interim]

    async def invoke(op: bytes, read_only: bool, timeout: float) -> bytes:
        return await replies.pop(0)()

    p = await _start(invoke)
    try:
        async with httpx.AsyncClient(base_url=_url(p)) as c:
            for _ in range(3):
                assert (await c.get("/")).status_code == 502
    finally:
        await p.close()
    assert p.stats["bad_replies"] == 2 and p.stats["invoke_errors"] == 1


async def test_read_only_rejection_is_resent_ordered(tmp_path: Path) -> None:
    def counter(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        state = environ["zz.state"]
        n = int(state.read_bytes("n")) + 1 if state.exists("n") else 1
        state.write_bytes("n", str(n).encode())  # a GET that writes
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [str(n).encode()]

    (tmp_path / "s").mkdir()
    app = WsgiApp(counter, name="counter")
    app.open(StateDir(tmp_path / "s"))
    inv = AppInvoker(app)
    p = await _start(inv)
    try:
        async with httpx.AsyncClient(base_url=_url(p)) as c:
            assert (await c.get("/")).text == "1"
            assert (await c.get("/")).text == "2"
    finally:
        await p.close()
    assert [ro for _, ro in inv.calls] == [True, False, True, False]
    assert p.stats["read_only_retries"] == 2
    p2 = await _start(inv, read_only=False)
    try:
        async with httpx.AsyncClient(base_url=_url(p2)) as c:
            assert (await c.get("/")).text == "3"
    finally:
        await p2.close()
    assert inv.calls[-1][1] is False


async def test_op_is_canonical_and_hop_by_hop_headers_are_dropped(
    proxy: Proxy, gb: AppInvoker
) -> None:
    await _raw(
        proxy,
        b"GET http://example.org:8080/entries.json?b=2&a=1 HTTP/1.1\r\n"
        b"Host: ignored\r\nConnection: X-Secret, close\r\nX-Secret: s\r\nKeep-Alive: 5\r\n"
        b"TE: trailers\r\nUpgrade: h2c\r\nProxy-Authorization: Basic eA==\r\n"
        b"X-B: 2\r\nx-a:   1  \r\nACCEPT: */*\r\nX-B: 1\r\n\r\n",
    )
    req = decode_request(gb.calls[0][0])
    assert req.method == "GET" and req.path == "/entries.json" and req.query == "b=2&a=1"
    assert req.headers == (
        ("accept", "*/*"),
        ("host", "example.org:8080"),
        ("x-a", "1"),
        ("x-b", "2"),
        ("x-b", "1"),
    )
    # The same request framed differently is the same op.
    await _raw(
        proxy,
        b"GET /entries.json?b=2&a=1 HTTP/1.1\r\nX-A: 1\r\nX-B: 2\r\nAccept: */*\r\n"
        b"Host: example.org:8080\r\nX-B: 1\r\nConnection: close\r\n\r\n",
    )
    assert gb.calls[1][0] == gb.calls[0][0]


async def test_random_bytes_never_crash_the_server(proxy: Proxy) -> None:
    rng = random.Random(1234)
    good = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    for _ in range(60):
        data = bytearray(good)
        for _ in range(rng.randrange(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        reader, writer = await asyncio.open_connection(*proxy.address)
        writer.write(bytes(data))
        writer.write_eof()
        out = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert out == b"" or out.startswith(b"HTTP/1.1 "), out[:80]
    assert proxy.stats["internal_errors"] == 0
    async with httpx.AsyncClient(base_url=_url(proxy)) as c:
        assert (await c.get("/entries.json")).status_code == 200


async def test_close_waits_for_in_flight_requests(gb: AppInvoker) -> None:
    release = asyncio.Event()

    async def invoke(op: bytes, read_only: bool, timeout: float) -> bytes:
        await release.wait()
        return await gb(op, read_only, timeout)

    p = await _start(invoke)
    idle_r, idle_w = await asyncio.open_connection(*p.address)
    async with httpx.AsyncClient(base_url=_url(p)) as c:
        pending = asyncio.create_task(c.get("/entries.json"))
        await asyncio.sleep(0.1)
        closing = asyncio.create_task(p.close())
        await asyncio.sleep(0.1)
        assert await asyncio.wait_for(idle_r.read(), 5) == b""  # idle: dropped at once
        assert not closing.done()
        release.set()
        r = await pending
        await asyncio.wait_for(closing, 5)
    idle_w.close()
    assert r.status_code == 200 and r.headers["connection"] == "close"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
async def test_curl(proxy: Proxy, tmp_path: Path) -> None:
    url = _url(proxy)

    async def curl(*args: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            "curl", "-sS", "--max-time", "10", *args, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
        assert proc.returncode == 0
        return out.decode()

    code = ("-o", "/dev/null", "-w", "%{http_code}")
    assert await curl(*code, "-d", "name=c&message=<i>c</i>", f"{url}/") == "303"
    page = await curl(f"{url}/")
    assert "&lt;i&gt;c&lt;/i&gt;" in page
    te = ("-H", "Transfer-Encoding: chunked")
    assert await curl(*code, *te, "-d", "message=chunked", f"{url}/") == "303"
    # curl sends Expect: 100-continue for uploads over 1 MiB; the limit here is 64 KiB.
    big = tmp_path / "big"
    big.write_bytes(b"message=" + b"a" * (2 << 20))
    assert await curl(*code, "--data-binary", f"@{big}", f"{url}/") == "413"
    head = await curl("-I", f"{url}/entries.json")
    assert head.startswith("HTTP/1.1 200 OK")


class _OneAtATime:
    """A Client stand-in that fails if it is ever given two requests at once."""

    def __init__(self) -> None:
        self.busy = False
        self.served = 0
        self.stats: Counter[str] = Counter()

    async def invoke(self, op: bytes, read_only: bool = False, timeout: float = 30.0) -> bytes:
        assert not self.busy, "a Client got a second request while one was outstanding"
        self.busy = True
        try:
            await asyncio.sleep(0.02)
        finally:
            self.busy = False
        self.served += 1
        return op


async def test_client_pool_queues_for_idle_clients() -> None:
    fakes = [_OneAtATime(), _OneAtATime()]
    pool = ClientPool(fakes)  # type: ignore[arg-type]
    got = await asyncio.gather(*(pool.invoke(b"op%d" % i, False, 5.0) for i in range(10)))
    assert got == [b"op%d" % i for i in range(10)]
    assert sorted(f.served for f in fakes) == [5, 5]
    assert pool.stats["queued"] == 8
    # Waiting for a client counts against the request's own timeout.
    slow = [pool.invoke(b"x", False, 5.0) for _ in range(2)]
    late = pool.invoke(b"late", False, 0.01)
    results = await asyncio.gather(*slow, late, return_exceptions=True)
    assert results[:2] == [b"x", b"x"] and isinstance(results[2], TimeoutError)
    assert await pool.invoke(b"after", False, 1.0) == b"after"  # no client was lost


async def test_many_concurrent_connections(proxy: Proxy) -> None:
    async def conn(i: int) -> list[int]:
        reader, writer = await asyncio.open_connection(*proxy.address)
        try:
            statuses = []
            for j in range(3):
                writer.write(b"GET /entries.json?c=%d&r=%d HTTP/1.1\r\nHost: x\r\n\r\n" % (i, j))
                status, _, body = await _read_response(reader)
                assert body == b"[]\n"
                statuses.append(status)
            return statuses
        finally:
            writer.close()

    got = await asyncio.gather(*(conn(i) for i in range(100)))
    assert got == [[200, 200, 200]] * 100
    assert proxy.stats["requests"] == 300 and proxy.stats["connections"] == 100


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("8080", ":80", "h:x", "h:70000"):
        with pytest.raises(ValueError):
            parse_listen(bad)


# -- end to end: curl -> zz proxy -> zz-agreed -> execution replicas (real processes) ----


def _curl(*args: str) -> str:
    out = subprocess.run(
        ["curl", "-sS", "--max-time", "30", *args], capture_output=True, check=True, timeout=60
    )
    return out.stdout.decode()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
@pytest.mark.skipif(not default_binary().exists(), reason="zz-agreed not built")
def test_guestbook_through_real_replicas_with_curl(tmp_path: Path) -> None:
    for attempt in range(20):
        cluster = Cluster(tmp_path / f"try{attempt}", app="wsgi:guestbook", f=1,
                          checkpoint_interval=4, log_window=8)  # fmt: skip
        addrs = cluster.service.exec_addresses(cluster.config)
        if all(_port_free(a[1]) for a in addrs):
            break
    execs = ExecReplicas(cluster)
    proxy_log = tmp_path / "proxy.log"
    port = free_port()
    proxy: subprocess.Popen[bytes] | None = None
    ok = False
    try:
        cluster.start()
        execs.start(0)
        execs.start(1)
        with open(proxy_log, "ab") as log:
            proxy = subprocess.Popen(
                [sys.executable, "-m", "zz", "proxy", str(cluster.config_path), "svc",
                 "--listen", f"127.0.0.1:{port}", "--clients", "3", "--timeout", "20"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=REPO,
            )  # fmt: skip
        deadline = time.monotonic() + 20
        while b"listening on" not in proxy_log.read_bytes():
            assert proxy.poll() is None, proxy_log.read_text()
            assert time.monotonic() < deadline, proxy_log.read_text()
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}"
        code = ("-o", "/dev/null", "-w", "%{http_code}")
        assert "<form" in _curl(f"{url}/")
        form = ("--data-urlencode", "name=<b>x</b>", "--data-urlencode", "message=a <script> & b")
        assert _curl(*code, *form, f"{url}/") == "303"
        # More concurrent requests than pooled clients: the rest queue for one.
        posts = [
            subprocess.Popen(
                ["curl", "-sS", "--max-time", "30", *code, "-d", f"message=m{i}", f"{url}/"],
                stdout=subprocess.PIPE,
            )
            for i in range(8)
        ]
        assert [p.communicate(timeout=60)[0] for p in posts] == [b"303"] * 8
        page = _curl(f"{url}/")
        assert "a &lt;script&gt; &amp; b" in page and "&lt;b&gt;x&lt;/b&gt;" in page
        assert "<script>" not in page
        entries = json.loads(_curl(f"{url}/entries.json"))
        assert sorted(e["message"] for e in entries[1:]) == sorted(f"m{i}" for i in range(8))
        head = _curl("-I", f"{url}/entries.json")
        assert head.startswith("HTTP/1.1 200 OK") and "Content-Length:" in head
        # Both active execution replicas hold the same entries, byte for byte (both had
        # to reply for every certificate, so both have executed every POST).
        trees = []
        for i in (0, 1):
            root = cluster.run_dir / f"exec-{i}" / "store" / "live" / "guestbook"
            trees.append(
                {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
            )
        # One chunk file holds the 9 entries, meta.json counts them.
        assert trees[0] == trees[1] and sorted(map(str, trees[0])) == [
            "chunks/00000000.jsonl",
            "meta.json",
        ]
        assert json.loads(trees[0][Path("meta.json")])["count"] == 9
        ok = True
    finally:
        if proxy is not None and proxy.poll() is None:
            os.killpg(proxy.pid, signal.SIGTERM)
            try:
                proxy.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proxy.pid, signal.SIGKILL)
                proxy.wait(timeout=10)
        if not ok:
            print(execs.tails(), proxy_log.read_text(errors="replace"), file=sys.stderr)
        codes = execs.close()
        cluster.__exit__(None if ok else RuntimeError, None, None)
    assert proxy is not None and proxy.returncode == 0, proxy_log.read_text()
    text = proxy_log.read_text()
    assert "POST / 303" in text and "GET /entries.json 200" in text
    assert "stats " in text and "requests=13" in text
    assert all(c == 0 for c in codes.values()), codes
