"""zz/proxy.py - `zz proxy`: the HTTP/1.1 front of a BFT web app (docs/proxy.md).
Turns each HTTP request into one canonical WSGI op, gets it certified through a Client pool."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from zz.client import Client, ClientParams, ClientTimeout, RequestTooLarge, exec_key_stamp
from zz.config import Config, ConfigError, Service
from zz.http import HttpError, Limits, Request, body_length, format_response, read_body, read_head
from zz.http import text_response as _text
from zz.httpop import (
    EXCLUDED_HEADERS,
    READ_ONLY_METHODS,
    READ_ONLY_REJECTED_HEADER,
    HttpResponse,
    WsgiCodecError,
    decode_response,
    encode_request,
)

log = logging.getLogger("zz.proxy")

# (op, read_only, seconds left) -> certified reply bytes. The real one is ClientPool.invoke;
# tests inject one that runs the app in-process. Raising ClientTimeout or TimeoutError means
# no certificate in time.
Invoker = Callable[[bytes, bool, float], Awaitable[bytes]]

# Request fields the proxy consumes itself and never forwards: framing and connection
# fields (the WSGI codec's list), the 100-continue handshake, and credentials meant for
# a proxy (they would otherwise be copied to every replica).
DROPPED_REQUEST_HEADERS = EXCLUDED_HEADERS | {"expect", "proxy-authorization"}
# Framing of the reply is the proxy's business: the app's values would contradict it.
DROPPED_RESPONSE_HEADERS = EXCLUDED_HEADERS
DEFAULT_CLIENTS = 8  # pool size unless the service has fewer client principals
_APP_METHOD_RE = re.compile(r"^[A-Z]{1,16}$")  # what the op encoding can carry


@dataclass(frozen=True)
class ProxyOptions:
    host: str = "127.0.0.1"
    port: int = 8080
    timeout: float = 30.0  # per request, queueing for a client included
    limits: Limits = field(default_factory=Limits)
    read_only: bool = True  # try GET/HEAD on the read-only path first
    idle_timeout: float = 60.0  # keep-alive idle, and the time to send a head or body
    shutdown_grace: float = 5.0  # in-flight requests get this long to finish on shutdown
    # Each connection costs a task and its buffers (docs/security.md "Connections (zz proxy)").
    max_conns: int = 1024
    max_conns_per_source: int = 256


class ClientPool:
    """Clients 0..N-1 of one service. A Client handles one request at a time, so a request
    waits here for an idle one; the wait counts against the request's timeout."""

    def __init__(
        self, clients: list[Client], config: Config | None = None, service: Service | None = None
    ) -> None:
        if not clients:
            raise ValueError("a client pool needs at least one client")
        self.clients = clients
        self._idle: asyncio.Queue[Client] = asyncio.Queue()
        for c in clients:
            self._idle.put_nowait(c)
        self.stats: Counter[str] = Counter()
        # With the rack's config, a client whose keys predate the latest key epoch
        # announcements is rebuilt before its next request (zz/client.py exec_key_stamp):
        # a proxy or a mount outlives convictions, and a successor's replies under its new
        # key would otherwise never count, nor would it read our requests.
        self._keys = (config, service) if config is not None and service is not None else None
        self._stamps: dict[int, tuple[tuple[int, int] | None, ...]] = {}
        if self._keys is not None:
            stamp = exec_key_stamp(self._keys[0], self._keys[1].id)
            self._stamps = {c.params.client_index: stamp for c in clients}

    @classmethod
    def from_config(
        cls, config: Config, service: Service, count: int, first: int = 0
    ) -> ClientPool:
        if count < 1:
            raise ValueError("--clients must be at least 1")
        if first < 0 or first + count > service.clients:
            raise ValueError(
                f"clients {first}..{first + count - 1} not within the {service.clients}"
                f" client principals of service {service.name!r}"
            )
        return cls(
            [
                Client(ClientParams.from_config(config, service.id, i))
                for i in range(first, first + count)
            ],
            config,
            service,
        )

    def start(self) -> None:
        for c in self.clients:
            c.start()

    async def close(self) -> None:
        # All at once and bounded: closing a link to a paused replica waits up to a second
        # for a peer that never answers, and nothing is left to send.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await asyncio.gather(*(c.close() for c in self.clients))

    def _rekey(self, client: Client) -> None:
        if self._keys is None:
            return
        config, service = self._keys
        stamp = exec_key_stamp(config, service.id)
        idx = client.params.client_index
        if self._stamps.get(idx) != stamp:
            client.params = ClientParams.from_config(config, service.id, idx)
            self._stamps[idx] = stamp
            self.stats["rekeyed"] += 1

    async def invoke(self, op: bytes, read_only: bool, timeout: float) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._idle.empty():
            self.stats["queued"] += 1
        async with asyncio.timeout(timeout):
            client = await self._idle.get()
        try:
            self._rekey(client)
            left = deadline - loop.time()
            if left <= 0:
                raise ClientTimeout("timed out waiting for an idle client")
            return await client.invoke(op, read_only=read_only, timeout=left)
        finally:
            self._idle.put_nowait(client)

    @property
    def max_request(self) -> int | None:
        """The smallest REQUEST size limit of the pool's clients, if they know one."""
        limits = [c.params.max_request for c in self.clients if c.params.max_request]
        return min(limits) if limits else None

    def client_stats(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for c in self.clients:
            total.update(c.stats)
        return total


class Proxy:
    """The HTTP server. One task per connection; requests on a connection run in order
    (pipelined requests are simply read after the previous response is written)."""

    def __init__(self, invoke: Invoker, options: ProxyOptions | None = None) -> None:
        self.invoke = invoke
        self.options = options or ProxyOptions()
        self.stats: Counter[str] = Counter()
        self._server: asyncio.Server | None = None
        self._conns: dict[asyncio.Task[None], bool] = {}  # task -> inside a request
        self._by_source: Counter[str] = Counter()
        self._closing = False

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None, "start() first"
        return self._server.sockets[0].getsockname()[:2]

    async def start(self) -> None:
        o = self.options
        # The stream buffer limit bounds one line; a bit over the head limit so that
        # an over-long head gets 431 from the byte count, not an overrun.
        self._server = await asyncio.start_server(
            self._handle, o.host, o.port, limit=o.limits.max_header_bytes + 1024
        )

    async def close(self) -> None:
        """Stop accepting, let requests in flight finish (up to the grace), drop the rest."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for task, busy in list(self._conns.items()):
            if not busy:
                task.cancel()
        pending = list(self._conns)
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.options.shutdown_grace)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) else "-"
        if len(self._conns) >= self.options.max_conns or (
            self._by_source[source] >= self.options.max_conns_per_source
        ):
            await self._refuse(writer, source)
            return
        self._conns[task] = False
        self._by_source[source] += 1
        self.stats["connections"] += 1
        peer_s = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "-"
        try:
            while not self._closing:
                if not await self._one(reader, writer, task, peer_s):
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # shutdown: the connection just closes
        except Exception:
            # A bug must cost one connection, never the server.
            self.stats["internal_errors"] += 1
            log.exception("connection %s failed", peer_s)
        finally:
            del self._conns[task]
            self._by_source[source] -= 1
            if self._by_source[source] <= 0:
                del self._by_source[source]
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _refuse(self, writer: asyncio.StreamWriter, source: str) -> None:
        """Over a connection cap: 503 at once, nothing read, closed. What the socket
        buffer does not take at once is dropped, so a refusal never waits on the client."""
        self.stats["conns_refused"] += 1
        if len(self._conns) < self.options.max_conns:
            self.stats["conns_refused_source"] += 1
        headers, body = _text(503, "too many connections")
        headers.append(("Retry-After", "1"))
        with contextlib.suppress(Exception):
            writer.write(format_response(503, "", headers, body, keep_alive=False))
        if writer.transport.get_write_buffer_size():
            writer.transport.abort()  # a client that does not even take 200 bytes
        else:
            writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()

    async def _one(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        task: asyncio.Task[None],
        peer: str,
    ) -> bool:
        """Serve one request; whether the connection stays open."""
        o = self.options
        req: Request | None = None
        try:
            try:
                async with asyncio.timeout(o.idle_timeout):
                    req = await read_head(reader, o.limits)
            except TimeoutError:
                return False  # idle keep-alive connection, or a client too slow to talk
            if req is None:
                return False
            self._conns[task] = True
            t0 = time.monotonic()
            self.stats["requests"] += 1
            _check_method(req.method)
            length = body_length(req, o.limits)
            expect = req.tokens("expect")
            if expect:
                if expect != ["100-continue"]:
                    raise HttpError(417, "only Expect: 100-continue is supported")
                if req.version >= (1, 1) and length != 0:
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            try:
                async with asyncio.timeout(o.idle_timeout):
                    req.body = await read_body(reader, length, o.limits)
            except TimeoutError:
                raise HttpError(408, "request body not received in time") from None
        except HttpError as e:
            if req is None:
                self.stats["requests"] += 1
            self.stats["rejected"] += 1
            self.stats[f"status_{e.status}"] += 1
            method = req.method if req is not None else "-"
            target = req.target if req is not None else "-"
            head = req is not None and req.method == "HEAD"
            self._log(peer, method, target, e.status, None, e.message)
            headers, body = _text(e.status, e.message)
            if head:
                headers.append(("Content-Length", str(len(body))))
            writer.write(format_response(e.status, "", headers, body, head=head, keep_alive=False))
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            return False
        status, keep = await self._respond(req, writer)
        self._log(peer, req.method, req.target, status, t0)
        self._conns[task] = False
        return keep

    async def _respond(self, req: Request, writer: asyncio.StreamWriter) -> tuple[int, bool]:
        """Forward `req` and write the answer; (status, whether the connection stays)."""
        head = req.method == "HEAD"
        resp = await self._forward(req)
        # Decided after the wait: a shutdown that began meanwhile closes the connection.
        keep = req.keep_alive and not self._closing
        self.stats[f"status_{resp.status // 100}xx"] += 1
        headers = _response_headers(resp, keep_length=head or resp.status == 304)
        if head and resp.body and not any(n.lower() == "content-length" for n, _ in headers):
            # Only the proxy's own answers still have a body here; the adapter empties
            # HEAD bodies, and then an app that gave no length leaves it unknown.
            headers.append(("Content-Length", str(len(resp.body))))
        writer.write(
            format_response(
                resp.status,
                resp.reason,
                headers,
                resp.body,
                head=head,
                keep_alive=keep,
                version=req.version,
            )
        )
        try:
            # A client that never reads must not hold the connection task forever.
            async with asyncio.timeout(self.options.idle_timeout):
                await writer.drain()
        except TimeoutError:
            self.stats["write_timeouts"] += 1
            return resp.status, False
        return resp.status, keep

    async def _forward(self, req: Request) -> HttpResponse:
        """The certified response to `req`, or the proxy's own 400/502/504."""
        drop = DROPPED_REQUEST_HEADERS | set(req.tokens("connection"))
        try:
            op = encode_request(
                req.method, req.target, [(n, v) for n, v in req.headers if n not in drop], req.body
            )
        except WsgiCodecError as e:
            self.stats["rejected"] += 1
            return _own(400, f"request cannot be encoded: {e}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.timeout
        read_only = self.options.read_only and req.method in READ_ONLY_METHODS
        try:
            async with asyncio.timeout(self.options.timeout):
                resp = await self._invoke(op, read_only, deadline)
                if read_only and resp.header(READ_ONLY_REJECTED_HEADER) == "rejected":
                    # The app wrote state on a GET: only the ordered path may do that.
                    self.stats["read_only_retries"] += 1
                    resp = await self._invoke(op, False, deadline)
                return resp
        except RequestTooLarge as e:
            # The body fit --max-body but the whole op (head included) does not fit a
            # REQUEST; or the replicas refused it (docs/wire.md "Size limits").
            self.stats["too_large"] += 1
            return _own(413, f"request too large for the service: {e}")
        except (TimeoutError, ClientTimeout):
            self.stats["timeouts"] += 1
            return _own(504, f"no certified reply within {self.options.timeout:g} s")
        except WsgiCodecError as e:
            self.stats["bad_replies"] += 1
            log.error("reply is not an encoded HTTP response: %s", e)
            return _own(502, "the service's reply is not an HTTP response")
        except Exception:
            self.stats["invoke_errors"] += 1
            log.exception("invoking the service failed")
            return _own(502, "the service could not be reached")

    async def _invoke(self, op: bytes, read_only: bool, deadline: float) -> HttpResponse:
        left = deadline - asyncio.get_running_loop().time()
        resp = decode_response(await self.invoke(op, read_only, left))
        if resp.status < 200:
            # A final 1xx would leave the client waiting for a response that never comes.
            raise WsgiCodecError(f"interim status {resp.status} as a final response")
        return resp

    def _log(
        self, peer: str, method: str, target: str, status: int, t0: float | None, note: str = ""
    ) -> None:
        ms = f"{(time.monotonic() - t0) * 1000:.1f}ms" if t0 is not None else "-"
        shown = target if len(target) <= 200 else target[:200] + "..."
        log.info("%s %s %s %d %s%s", peer, method, shown, status, ms, f" ({note})" if note else "")


def _check_method(method: str) -> None:
    if not _APP_METHOD_RE.match(method):
        # Methods are case-sensitive; the op encoding carries uppercase letters only.
        raise HttpError(501, f"method {method[:32]} not supported")


def _own(status: int, message: str) -> HttpResponse:
    headers, body = _text(status, message)
    return HttpResponse(status, "", tuple(headers), body)


def _response_headers(resp: HttpResponse, keep_length: bool) -> list[tuple[str, str]]:
    """The app's headers minus framing; Content-Length kept for HEAD and 304, where the
    body is absent but the length describes the representation."""
    drop = set(DROPPED_RESPONSE_HEADERS)
    for n, v in resp.headers:
        if n.lower() == "connection":
            drop.update(t.strip().lower() for t in v.split(","))
    out = [(n, v) for n, v in resp.headers if n.lower() not in drop]
    if keep_length:
        lengths = [v.strip() for n, v in resp.headers if n.lower() == "content-length"]
        if lengths and lengths[0].isdigit():
            out.append(("Content-Length", lengths[0]))
    return out


def with_request_limit(options: ProxyOptions, max_request: int | None) -> ProxyOptions:
    """A body can be no larger than the REQUEST that carries it: lower --max-body to the
    service's request limit, so an over-long body gets 413 from its Content-Length (or
    while de-chunking) before the proxy reads it, never a REQUEST the replicas refuse."""
    if max_request is None or options.limits.max_body <= max_request:
        return options
    limits = dataclasses.replace(options.limits, max_body=max_request)
    return dataclasses.replace(options, limits=limits)


def parse_listen(text: str) -> tuple[str, int]:
    """ "HOST:PORT" or "[V6]:PORT"."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen {text!r}: want HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"--listen {text!r}: want HOST:PORT")
    return host, int(port)


async def serve(
    config: Config,
    service_name: str,
    options: ProxyOptions,
    clients: int | None = None,
    first_client: int = 0,
    ready: Callable[[tuple[str, int]], None] | None = None,
) -> Counter[str]:
    """Run the proxy for one WSGI service until SIGINT/SIGTERM; returns the counters."""
    service = config.service(service_name)
    if not service.app.startswith("wsgi:"):
        raise ConfigError(
            f"service {service.name!r} runs app {service.app!r}; zz proxy fronts wsgi:* apps"
        )
    if clients is None:
        clients = max(1, min(DEFAULT_CLIENTS, service.clients - first_client))
    pool = ClientPool.from_config(config, service, clients, first_client)
    options = with_request_limit(options, pool.max_request)
    proxy = Proxy(pool.invoke, options)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def report() -> None:
        log.info("stats %s", _stats_line(proxy, pool))

    pool.start()
    try:
        await proxy.start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGUSR1, report)
        addr = proxy.address
        log.info(
            "listening on http://%s:%d for service %s (%d clients)",
            addr[0],
            addr[1],
            service.name,
            clients,
        )
        if ready is not None:
            ready(addr)
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
            loop.remove_signal_handler(sig)
        await proxy.close()
        await pool.close()
        report()
    return proxy.stats


def _stats_line(proxy: Proxy, pool: ClientPool) -> str:
    both = Counter(proxy.stats)
    both.update({f"pool_{k}": v for k, v in pool.stats.items()})
    both.update({f"client_{k}": v for k, v in pool.client_stats().items()})
    return " ".join(f"{k}={v}" for k, v in sorted(both.items()))
