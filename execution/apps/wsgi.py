"""execution/apps/wsgi.py - runs a PEP 3333 WSGI app as a ZZ app: canonical HTTP request in and out.
Time, randomness and files come from the ExecContext and the StateDir, so the replies agree."""

from __future__ import annotations

import contextlib
import io
import logging
import random
import re
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_to_bytes

from zz.execution.app import App, ExecContext
from zz.execution.state import ReadOnlyStateError

log = logging.getLogger("zz.execution.wsgi")

REQUEST_MAGIC = b"ZQ\x01"
RESPONSE_MAGIC = b"ZP\x01"
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")

# Connection-level headers (RFC 9110 §7.6.1) and Content-Length (the body length is
# explicit) never reach the app, so one HTTP request has one encoding however the
# client framed it.
EXCLUDED_HEADERS = frozenset(
    {
        "connection",
        "content-length",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
READ_ONLY_METHODS = frozenset({"GET", "HEAD"})
# Reply header telling the proxy a read-only attempt wanted to write: resend ordered.
READ_ONLY_REJECTED_HEADER = "zz-read-only"

_METHOD_RE = re.compile(rb"^[A-Z]{1,16}$")
_TOKEN_RE = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9a-z]+$")  # lowercase header-name token
_RESPONSE_NAME_RE = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_BAD_VALUE_RE = re.compile(rb"[\x00\r\n]")
_BAD_TARGET_RE = re.compile(rb"[\x00-\x20\x7f#]")
_STATUS_RE = re.compile(r"^([1-5][0-9][0-9]) ([^\r\n]*)$")

Headers = tuple[tuple[str, str], ...]


class WsgiCodecError(ValueError):
    """Bytes that are not a canonical encoded HTTP request or response."""


# -- codec ------------------------------------------------------------------------


@dataclass(frozen=True)
class HttpRequest:
    method: str  # uppercase token
    path: str  # raw (still percent-encoded) path, starts with "/"
    query: str = ""  # raw query string without "?"
    headers: Headers = ()  # lowercase names, sorted by name, stable within a name
    body: bytes = b""

    def header(self, name: str) -> str | None:
        """Values of a header joined with ", " (RFC 9110 §5.3), or None."""
        vals = [v for n, v in self.headers if n == name.lower()]
        return ", ".join(vals) if vals else None


@dataclass(frozen=True)
class HttpResponse:
    status: int
    reason: str = ""
    headers: Headers = ()  # as the app gave them, order kept
    body: bytes = b""

    def header(self, name: str) -> str | None:
        vals = [v for n, v in self.headers if n.lower() == name.lower()]
        return ", ".join(vals) if vals else None


def _latin1(s: str, what: str) -> bytes:
    try:
        return s.encode("latin-1")
    except UnicodeEncodeError as e:
        raise WsgiCodecError(f"{what} {s!r} is not latin-1") from e


def _field(data: bytes) -> bytes:
    return _U32.pack(len(data)) + data


def canonical_headers(headers: Iterable[tuple[str, str]]) -> Headers:
    """Lowercase names, strip values, drop excluded headers, sort by name (stable)."""
    out = []
    for name, value in headers:
        n = name.strip().lower()
        if n in EXCLUDED_HEADERS:
            continue
        out.append((n, value.strip(" \t")))
    out.sort(key=lambda nv: nv[0])
    return tuple(out)


def encode_request(
    method: str, target: str, headers: Iterable[tuple[str, str]] = (), body: bytes = b""
) -> bytes:
    """Canonical op for an HTTP/1.1 request; `target` is the request-target (path?query)."""
    path, _, query = target.partition("?")
    req = HttpRequest(method.upper(), path, query, canonical_headers(headers), bytes(body))
    data = _encode_request(req)
    decode_request(data)  # one validation, shared with the replicas
    return data


def _encode_request(req: HttpRequest) -> bytes:
    m = _latin1(req.method, "method")
    out = [REQUEST_MAGIC, bytes([len(m) & 0xFF]), m]
    out.append(_field(_latin1(req.path, "path")))
    out.append(_field(_latin1(req.query, "query")))
    out.append(_U32.pack(len(req.headers)))
    for n, v in req.headers:
        out.append(_field(_latin1(n, "header name")) + _field(_latin1(v, "header value")))
    out.append(_field(req.body))
    return b"".join(out)


class _Reader:
    def __init__(self, data: bytes, what: str) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.what = what

    def take(self, n: int, field_name: str) -> bytes:
        if self.pos + n > len(self.data):
            raise WsgiCodecError(f"{self.what} truncated at {field_name}")
        self.pos += n
        return bytes(self.data[self.pos - n : self.pos])

    def u16(self, field_name: str) -> int:
        return _U16.unpack(self.take(2, field_name))[0]

    def u32(self, field_name: str) -> int:
        return _U32.unpack(self.take(4, field_name))[0]

    def field(self, field_name: str) -> bytes:
        return self.take(self.u32(f"{field_name} length"), field_name)

    def end(self) -> None:
        if self.pos != len(self.data):
            raise WsgiCodecError(f"{self.what} has {len(self.data) - self.pos} trailing bytes")


def decode_request(data: bytes) -> HttpRequest:
    """Decode and check canonical form; anything else raises WsgiCodecError."""
    r = _Reader(data, "request")
    if r.take(3, "magic") != REQUEST_MAGIC:
        raise WsgiCodecError("request does not start with the ZQ v1 magic")
    method = r.take(r.take(1, "method length")[0], "method")
    if not _METHOD_RE.match(method):
        raise WsgiCodecError(f"bad method {method!r}")
    path = r.field("path")
    if not path.startswith(b"/") or _BAD_TARGET_RE.search(path) or b"?" in path:
        raise WsgiCodecError(f"bad path {path[:80]!r}")
    query = r.field("query")
    if _BAD_TARGET_RE.search(query):
        raise WsgiCodecError(f"bad query {query[:80]!r}")
    count = r.u32("header count")
    headers = []
    for i in range(count):
        name = r.field(f"header {i} name")
        value = r.field(f"header {i} value")
        if not _TOKEN_RE.match(name):
            raise WsgiCodecError(f"header {i}: bad or non-lowercase name {name[:80]!r}")
        if name.decode() in EXCLUDED_HEADERS:
            raise WsgiCodecError(f"header {i}: {name.decode()} is not carried in an op")
        if _BAD_VALUE_RE.search(value) or value != value.strip(b" \t"):
            raise WsgiCodecError(f"header {i} ({name.decode()}): bad value")
        if headers and name.decode() < headers[-1][0]:
            raise WsgiCodecError(f"header {i} ({name.decode()}): headers not sorted by name")
        headers.append((name.decode("latin-1"), value.decode("latin-1")))
    body = r.field("body")
    r.end()
    return HttpRequest(
        method.decode(), path.decode("latin-1"), query.decode("latin-1"), tuple(headers), body
    )


def encode_response(resp: HttpResponse) -> bytes:
    if not 100 <= resp.status <= 599:
        raise WsgiCodecError(f"status {resp.status} out of range")
    out = [RESPONSE_MAGIC, _U16.pack(resp.status), _field(_latin1(resp.reason, "reason"))]
    out.append(_U32.pack(len(resp.headers)))
    for n, v in resp.headers:
        out.append(_field(_latin1(n, "header name")) + _field(_latin1(v, "header value")))
    out.append(_field(resp.body))
    return b"".join(out)


def decode_response(data: bytes) -> HttpResponse:
    r = _Reader(data, "response")
    if r.take(3, "magic") != RESPONSE_MAGIC:
        raise WsgiCodecError("response does not start with the ZP v1 magic")
    status = r.u16("status")
    if not 100 <= status <= 599:
        raise WsgiCodecError(f"status {status} out of range")
    reason = r.field("reason")
    if _BAD_VALUE_RE.search(reason):
        raise WsgiCodecError("bad reason phrase")
    headers = []
    for i in range(r.u32("header count")):
        name = r.field(f"header {i} name")
        value = r.field(f"header {i} value")
        if not _RESPONSE_NAME_RE.match(name) or _BAD_VALUE_RE.search(value):
            raise WsgiCodecError(f"header {i}: bad name or value")
        headers.append((name.decode("latin-1"), value.decode("latin-1")))
    body = r.field("body")
    r.end()
    return HttpResponse(status, reason.decode("latin-1"), tuple(headers), body)


def simple_response(status: int, reason: str, message: str, extra: Headers = ()) -> HttpResponse:
    body = (message + "\n").encode()
    headers = (
        ("Content-Type", "text/plain; charset=utf-8"),
        ("Content-Length", str(len(body))),
        *extra,
    )
    return HttpResponse(status, reason, headers, body)


# -- deterministic inputs ---------------------------------------------------------


@contextlib.contextmanager
def deterministic_inputs(ctx: ExecContext) -> Iterator[None]:
    """Make time.time()/time_ns() return the agreement time and seed the global `random`.

    Known limit: code that did `from time import time` at import, datetime.now(),
    time.monotonic() and os.urandom are not covered; apps should use environ['zz.*'].
    Execution is single-threaded, so patching the modules for one request is safe.
    """
    saved_time, saved_time_ns = time.time, time.time_ns
    saved_random = random.getstate()
    time.time = lambda: ctx.time_ms / 1000.0
    time.time_ns = lambda: ctx.time_ms * 1_000_000
    random.seed(ctx.rng().getrandbits(64))
    try:
        yield
    finally:
        time.time, time.time_ns = saved_time, saved_time_ns
        random.setstate(saved_random)


# -- the adapter ------------------------------------------------------------------

WsgiApplication = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclass
class _StartResponse:
    status: str | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    written: list[bytes] = field(default_factory=list)

    def __call__(
        self, status: str, headers: list[tuple[str, str]], exc_info: Any = None
    ) -> Callable[[bytes], None]:
        # Everything is buffered, so headers are never "sent" and a later call with
        # exc_info may always replace them (PEP 3333).
        if self.status is not None and exc_info is None:
            raise AssertionError("start_response called twice without exc_info")
        self.status, self.headers = status, list(headers)
        return self.written.append


class WsgiApp(App):
    """Adapter: one op = one HTTP request to `application`, reply = its encoded response."""

    def __init__(
        self,
        application: WsgiApplication,
        name: str = "wsgi",
        server_name: str = "zz.invalid",
        server_port: int = 80,
    ) -> None:
        self.application = application
        self.name = name
        self.server_name = server_name
        self.server_port = server_port

    def is_read_only(self, op: bytes) -> bool:
        """GET/HEAD are read-only *candidates*: if the app writes anyway, the reply says so."""
        try:
            return decode_request(op).method in READ_ONLY_METHODS
        except WsgiCodecError:
            return True  # the 400 reply writes nothing

    def environ(self, req: HttpRequest, ctx: ExecContext) -> dict[str, Any]:
        env: dict[str, Any] = {
            "REQUEST_METHOD": req.method,
            "SCRIPT_NAME": "",
            "PATH_INFO": unquote_to_bytes(req.path).decode("latin-1"),
            "QUERY_STRING": req.query,
            "SERVER_NAME": self.server_name,
            "SERVER_PORT": str(self.server_port),
            "SERVER_PROTOCOL": "HTTP/1.1",
            "CONTENT_LENGTH": str(len(req.body)),
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": "http",
            "wsgi.input": io.BytesIO(req.body),
            "wsgi.errors": io.StringIO(),
            "wsgi.multithread": False,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
            "zz.time_ms": ctx.time_ms,
            "zz.rng": ctx.rng(),
            "zz.state": self.state,
            "zz.seq": ctx.seq,
            "zz.client": ctx.client,
            "zz.read_only": ctx.read_only,
        }
        grouped: dict[str, list[str]] = {}
        for n, v in req.headers:
            if "_" in n:
                continue  # HTTP_X_A from "x_a" could spoof "x-a" (CGI name clash)
            grouped.setdefault(n, []).append(v)
        for n, vals in grouped.items():
            if n == "content-type":
                env["CONTENT_TYPE"] = vals[-1]
                continue
            sep = "; " if n == "cookie" else ", "
            env["HTTP_" + n.upper().replace("-", "_")] = sep.join(vals)
        return env

    def execute(self, op: bytes, ctx: ExecContext) -> bytes:
        try:
            req = decode_request(op)
        except WsgiCodecError as e:
            return encode_response(simple_response(400, "Bad Request", f"bad request op: {e}"))
        return encode_response(self.handle(req, ctx))

    def handle(self, req: HttpRequest, ctx: ExecContext) -> HttpResponse:
        env = self.environ(req, ctx)
        errors_sink = env["wsgi.errors"]  # middleware may replace the environ entry
        guard = self.state.read_only() if ctx.read_only else contextlib.nullcontext()
        try:
            with deterministic_inputs(ctx), guard:
                resp = self._run(env)
        except ReadOnlyStateError:
            return simple_response(
                503,
                "Service Unavailable",
                "request wrote state while running read-only; resend it ordered",
                ((READ_ONLY_REJECTED_HEADER, "rejected"),),
            )
        except Exception:
            # Same state + same op => the same exception on every correct replica, so a
            # fixed 500 body (no traceback with replica paths) keeps replies equal.
            log.exception("WSGI app %s failed on seq %d", self.name, ctx.seq)
            return simple_response(500, "Internal Server Error", "internal server error")
        finally:
            errors = errors_sink.getvalue()
            if errors:
                log.warning("%s wsgi.errors: %s", self.name, errors.rstrip())
        if req.method == "HEAD":
            resp = HttpResponse(resp.status, resp.reason, resp.headers, b"")
        return resp

    def _run(self, env: dict[str, Any]) -> HttpResponse:
        start = _StartResponse()
        result = self.application(env, start)
        try:
            for chunk in result:
                if start.status is None and chunk:
                    raise AssertionError("WSGI app yielded a body before start_response")
                # One list for write() and the iterable keeps their interleaving.
                start.written.append(bytes(chunk))
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        if start.status is None:
            raise AssertionError("WSGI app returned without calling start_response")
        m = _STATUS_RE.match(start.status)
        if m is None:
            raise AssertionError(f"bad WSGI status line {start.status!r}")
        m.group(2).encode("latin-1")  # a non-latin-1 reason is an app error (500)
        body = b"".join(start.written)
        return HttpResponse(int(m.group(1)), m.group(2), _check_headers(start.headers), body)


def _check_headers(headers: Sequence[tuple[str, str]]) -> Headers:
    for n, v in headers:
        if not isinstance(n, str) or not isinstance(v, str):
            raise AssertionError("WSGI header names and values must be str")
        if not _RESPONSE_NAME_RE.match(n.encode("latin-1")) or _BAD_VALUE_RE.search(
            v.encode("latin-1")
        ):
            raise AssertionError(f"bad WSGI response header {n!r}")
    return tuple((n, v) for n, v in headers)
