"""zz/http.py - a small strict HTTP/1.1 server-side parser and response writer on asyncio streams.
Only what `zz proxy` needs (RFC 9112): request head, Content-Length and chunked bodies, limits;
and at the end the keep-alive client connection of the load generators (zz drill, demo_web)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from email.utils import formatdate

# RFC 9110 §5.6.2 token; methods are case-sensitive tokens (§9.1).
_TOKEN_RE = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_VERSION_RE = re.compile(rb"^HTTP/([0-9])\.([0-9])$")
# Field values: visible chars, SP, HTAB and obs-text; any other control is rejected
# rather than forwarded, since some servers treat bare CR or NUL as line breaks.
_BAD_VALUE_RE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_CHUNK_SIZE_RE = re.compile(rb"^([0-9A-Fa-f]{1,16})[ \t]*(;.*)?$")
# Request-target in origin form; absolute form is reduced to it. No CTL, SP or '#'.
_BAD_TARGET_RE = re.compile(rb"[\x00-\x20\x7f#]")
_ABSOLUTE_RE = re.compile(rb"^[A-Za-z][A-Za-z0-9+.\-]*://([^/?]*)(.*)$")

REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    408: "Request Timeout",
    413: "Content Too Large",
    414: "URI Too Long",
    417: "Expectation Failed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    505: "HTTP Version Not Supported",
}


class HttpError(Exception):
    """A request the server answers itself with `status` and then closes the connection:
    after a framing error the rest of the byte stream cannot be trusted."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Limits:
    max_line: int = 8 << 10  # request line, and each chunk-size line
    max_header_bytes: int = 64 << 10  # the whole head (request line + fields)
    max_headers: int = 128
    max_body: int = 8 << 20  # after de-chunking


@dataclass
class Request:
    method: str
    target: str  # origin form: "/path?query"
    version: tuple[int, int]
    headers: list[tuple[str, str]] = field(default_factory=list)  # names lowercased, order kept
    body: bytes = b""
    keep_alive: bool = True

    def values(self, name: str) -> list[str]:
        return [v for n, v in self.headers if n == name]

    def tokens(self, name: str) -> list[str]:
        """Comma-separated list header values as lowercase tokens (RFC 9110 §5.6.1)."""
        out = []
        for v in self.values(name):
            out.extend(t.strip().lower() for t in v.split(",") if t.strip())
        return out


async def _read_line(reader: asyncio.StreamReader, limit: int, status: int, what: str) -> bytes:
    """One line without its LF (and CR). Bare LF ends a line too (RFC 9112 §2.2)."""
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError as e:
        raise HttpError(status, f"{what} too long") from e
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            raise
        raise HttpError(400, f"connection closed inside the {what}") from e
    if len(line) > limit:
        raise HttpError(status, f"{what} too long")
    line = line[:-1]
    if line.endswith(b"\r"):
        line = line[:-1]
    if b"\r" in line:
        raise HttpError(400, f"bare CR in the {what}")
    return line


async def read_head(reader: asyncio.StreamReader, limits: Limits) -> Request | None:
    """The request line and header fields; None on a clean EOF between requests.

    The reader's own buffer limit (asyncio.start_server(limit=...)) must be at least
    `limits.max_header_bytes`, or a long line fails earlier with the same status."""
    line = b""
    used = 0
    # A client may send a stray CRLF after a body (RFC 9112 §2.2); ignore a few.
    for _ in range(4):
        try:
            line = await _read_line(reader, limits.max_line, 414, "request line")
        except asyncio.IncompleteReadError:
            return None
        used += len(line) + 2
        if line:
            break
    else:
        raise HttpError(400, "no request line")
    method, target, authority, version = _parse_request_line(line)
    headers: list[tuple[str, str]] = []
    while True:
        try:
            raw = await _read_line(reader, limits.max_header_bytes, 431, "header section")
        except asyncio.IncompleteReadError as e:
            raise HttpError(400, "connection closed inside the header section") from e
        used += len(raw) + 2
        if used > limits.max_header_bytes:
            raise HttpError(431, f"header section over {limits.max_header_bytes} bytes")
        if not raw:
            break
        if len(headers) >= limits.max_headers:
            raise HttpError(431, f"more than {limits.max_headers} header fields")
        headers.append(_parse_field(raw))
    if authority is not None:
        # RFC 9112 §3.2.2: the target's authority replaces any Host field.
        headers = [(n, v) for n, v in headers if n != "host"]
        headers.append(("host", authority))
    req = Request(method, target, version, headers)
    _check_host(req)
    conn = req.tokens("connection")
    if version >= (1, 1):
        req.keep_alive = "close" not in conn
    else:
        req.keep_alive = "keep-alive" in conn
    return req


def _parse_request_line(line: bytes) -> tuple[str, str, str | None, tuple[int, int]]:
    parts = line.split(b" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if not _TOKEN_RE.match(method):
        raise HttpError(400, "malformed method")
    m = _VERSION_RE.match(version)
    if m is None:
        raise HttpError(400, "malformed HTTP version")
    ver = (int(m.group(1)), int(m.group(2)))
    if ver[0] != 1:
        raise HttpError(505, f"HTTP/{ver[0]}.{ver[1]} not supported")
    if method == b"CONNECT":
        raise HttpError(501, "CONNECT is not supported")  # its target is not a path
    if not target or _BAD_TARGET_RE.search(target):
        raise HttpError(400, "malformed request target")
    authority, path = _origin_form(target)
    return method.decode("ascii"), path, authority, ver


def _origin_form(target: bytes) -> tuple[str | None, str]:
    """(authority or None, origin-form target): absolute form is reduced to its path."""
    if target.startswith(b"/"):
        return None, target.decode("latin-1")
    m = _ABSOLUTE_RE.match(target)
    if m is None:
        # asterisk-form (OPTIONS *) and authority-form (CONNECT) have no path to run.
        raise HttpError(400, "request target must be a path or an absolute URI")
    rest = m.group(2)
    if not rest.startswith(b"/"):
        rest = b"/" + rest
    return m.group(1).decode("latin-1"), rest.decode("latin-1")


def _parse_field(raw: bytes) -> tuple[str, str]:
    if raw[:1] in (b" ", b"\t"):
        raise HttpError(400, "obsolete line folding in a header field")
    name, sep, value = raw.partition(b":")
    # Whitespace before the colon is a smuggling vector (RFC 9112 §5.1): reject.
    if not sep or not _TOKEN_RE.match(name):
        raise HttpError(400, "malformed header field")
    value = value.strip(b" \t")
    if _BAD_VALUE_RE.search(value):
        raise HttpError(400, f"control character in header {name.decode('ascii')}")
    return name.decode("ascii").lower(), value.decode("latin-1")


def _check_host(req: Request) -> None:
    hosts = req.values("host")
    if len(hosts) > 1:
        raise HttpError(400, "more than one Host header")
    if req.version >= (1, 1) and not hosts:
        raise HttpError(400, "HTTP/1.1 request without Host")
    if hosts and any(c in hosts[0] for c in " \t/@"):
        raise HttpError(400, "malformed Host")


def body_length(req: Request, limits: Limits) -> int | None:
    """Content-Length of the body, or None for chunked; checks the framing and the size."""
    te = req.tokens("transfer-encoding")
    cls = req.values("content-length")
    if te:
        if req.version < (1, 1):
            raise HttpError(400, "Transfer-Encoding in an HTTP/1.0 request")
        if cls:
            # Both framings at once is the classic request-smuggling shape.
            raise HttpError(400, "both Transfer-Encoding and Content-Length")
        if te != ["chunked"]:
            raise HttpError(501, f"transfer coding {', '.join(te)} not supported")
        return None
    if not cls:
        return 0
    values = {v.strip() for c in cls for v in c.split(",")}
    if len(values) != 1:
        raise HttpError(400, "conflicting Content-Length values")
    (text,) = values
    if not text.isdigit() or not text.isascii() or len(text) > 18:
        raise HttpError(400, "malformed Content-Length")
    n = int(text)
    if n > limits.max_body:
        raise HttpError(413, f"body of {n} bytes over the {limits.max_body}-byte limit")
    return n


async def read_body(reader: asyncio.StreamReader, length: int | None, limits: Limits) -> bytes:
    """The body given body_length()'s answer: that many bytes, or de-chunked."""
    if length is not None:
        try:
            return await reader.readexactly(length)
        except asyncio.IncompleteReadError as e:
            raise HttpError(400, "connection closed inside the body") from e
    parts: list[bytes] = []
    total = 0
    while True:
        try:
            line = await _read_line(reader, limits.max_line, 400, "chunk size line")
        except asyncio.IncompleteReadError as e:
            raise HttpError(400, "connection closed inside a chunked body") from e
        m = _CHUNK_SIZE_RE.match(line)
        if m is None:
            raise HttpError(400, "malformed chunk size")
        size = int(m.group(1), 16)
        if size == 0:
            break
        total += size
        if total > limits.max_body:
            raise HttpError(413, f"chunked body over the {limits.max_body}-byte limit")
        try:
            parts.append(await reader.readexactly(size))
            end = await reader.readexactly(2)
        except asyncio.IncompleteReadError as e:
            raise HttpError(400, "connection closed inside a chunk") from e
        if end != b"\r\n":
            raise HttpError(400, "chunk data not followed by CRLF")
    # Trailer fields are read and dropped: the op carries no trailers.
    used = 0
    while True:
        try:
            raw = await _read_line(reader, limits.max_header_bytes, 431, "trailer section")
        except asyncio.IncompleteReadError as e:
            raise HttpError(400, "connection closed inside the trailer section") from e
        used += len(raw) + 2
        if used > limits.max_header_bytes:
            raise HttpError(431, "trailer section too large")
        if not raw:
            break
        _parse_field(raw)
    return b"".join(parts)


def format_response(
    status: int,
    reason: str,
    headers: list[tuple[str, str]],
    body: bytes,
    *,
    head: bool = False,
    keep_alive: bool = True,
    version: tuple[int, int] = (1, 1),
) -> bytes:
    """Serialize a response. `headers` must hold no framing fields (Content-Length,
    Transfer-Encoding, Connection): this function sets them from `body` and `keep_alive`.
    For HEAD, `body` is not sent; Content-Length is given by the caller in `headers` if
    it is known, since the length of an empty HEAD body says nothing."""
    out = [f"HTTP/1.1 {status} {reason or REASONS.get(status, '')}".rstrip() + "\r\n"]
    for n, v in headers:
        out.append(f"{n}: {v}\r\n")
    if not any(n.lower() == "date" for n, _ in headers):
        out.append(f"Date: {formatdate(usegmt=True)}\r\n")
    # 1xx, 204 and 304 never have a body (RFC 9110 §6.4.1); 204 may not carry a length.
    no_body = status < 200 or status in (204, 304)
    if not head and not no_body:
        out.append(f"Content-Length: {len(body)}\r\n")
    if not keep_alive:
        out.append("Connection: close\r\n")
    elif version < (1, 1):
        out.append("Connection: keep-alive\r\n")
    out.append("\r\n")
    data = "".join(out).encode("latin-1")
    if head or no_body:
        return data
    return data + body


def text_response(status: int, message: str) -> tuple[list[tuple[str, str]], bytes]:
    """Headers and body of a short plain-text answer the proxy writes itself."""
    body = (message + "\n").encode("utf-8", errors="replace")
    return [("Content-Type", "text/plain; charset=utf-8")], body


# ---- client: one keep-alive connection of a load generator --------------------------------
# What a request on a ClientConnection may raise when the server or the network fails it.
CLIENT_ERRORS = (OSError, EOFError, TimeoutError, ValueError, asyncio.IncompleteReadError)


class ClientConnection:
    """One keep-alive HTTP/1.1 connection of a load generator (`zz drill --http`,
    scripts/demo_web.py): opened on first use, and again after the server closed it or a
    request failed. One request at a time; a body is sent form-encoded. Only what those
    need: Content-Length bodies (no chunked responses), no redirects followed."""

    def __init__(self, host: str, port: int) -> None:
        self.addr = (host, port)
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def request(
        self, method: str, target: str, body: bytes | None = None
    ) -> tuple[int, bytes]:
        """(status, body); CLIENT_ERRORS close the connection and go to the caller, as
        does a cancellation (asyncio.timeout around the call)."""
        try:
            if self._conn is None:
                self._conn = await asyncio.open_connection(*self.addr)
            reader, writer = self._conn
            head = f"{method} {target} HTTP/1.1\r\nHost: {self.addr[0]}\r\n"
            if body is not None:
                head += "Content-Type: application/x-www-form-urlencoded\r\n"
                head += f"Content-Length: {len(body)}\r\n"
            writer.write(head.encode() + b"\r\n" + (body or b""))
            await writer.drain()
            status, length, close = await _response_head(reader)
            data = await reader.readexactly(length)
        except BaseException:
            self.close()
            raise
        if close:
            self.close()
        return status, data

    def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None


async def _response_head(reader: asyncio.StreamReader) -> tuple[int, int, bool]:
    """A response's status, Content-Length (0 if none) and whether the server closes."""
    status_line = await reader.readline()
    parts = status_line.split()
    if len(parts) < 2 or not parts[1].isdigit():
        raise ConnectionError(f"bad status line {status_line[:80]!r}")
    length, close = 0, False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"connection" and b"close" in value.lower():
            close = True
    return int(parts[1]), length, close
