"""execution/apps/wsgi.py - runs a PEP 3333 WSGI app as a ZZ app: canonical HTTP request in and out.
Time, randomness and files come from the ExecContext and the StateDir, so the replies agree."""

from __future__ import annotations

import contextlib
import io
import logging
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote_to_bytes

from zz.execution.app import App, ExecContext
from zz.execution.state import ReadOnlyStateError
from zz.httpop import (
    READ_ONLY_METHODS,
    READ_ONLY_REJECTED_HEADER,
    Headers,
    HttpRequest,
    HttpResponse,
    WsgiCodecError,
    decode_request,
    encode_response,
    valid_response_header,
)

log = logging.getLogger("zz.execution.wsgi")

# The op and reply encoding (request in, response out) is zz/httpop.py, shared with the proxy.
_STATUS_RE = re.compile(r"^([1-5][0-9][0-9]) ([^\r\n]*)$")


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
        if not valid_response_header(n, v):
            raise AssertionError(f"bad WSGI response header {n!r}")
    return tuple((n, v) for n, v in headers)
