"""zz/httpop.py - the canonical encoding of an HTTP request and response as a ZZ op and reply.
The proxy (zz/proxy.py) encodes requests with it, the WSGI app (execution/apps/wsgi.py) replies."""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass

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

Headers = tuple[tuple[str, str], ...]


class WsgiCodecError(ValueError):
    """Bytes that are not a canonical encoded HTTP request or response."""


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


def valid_response_header(name: str, value: str) -> bool:
    """Whether decode_response takes this header (name and value as latin-1 text)."""
    return bool(_RESPONSE_NAME_RE.match(name.encode("latin-1"))) and not _BAD_VALUE_RE.search(
        value.encode("latin-1")
    )
