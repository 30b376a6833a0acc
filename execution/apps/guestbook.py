"""execution/apps/guestbook.py - a small plain-WSGI guestbook: HTML list, form POST, JSON export.
The demo BFT web app: its entries are in fixed-size chunk files of the StateDir, its clock is
environ['zz.time_ms']; every page and export reads only the entries it shows."""

from __future__ import annotations

import html
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, parse_qsl, urlencode

from zz.execution.state import StateDir

# Layout 2 (this code): entries in chunk files of CHUNK_ENTRIES each, so a page reads at
# most two or three small files and a POST rewrites one chunk and the meta file.
META = "guestbook/meta.json"
CHUNK_DIR = "guestbook/chunks"
CHUNK_ENTRIES = 100
LAYOUT = 2
META_BYTES = 128
# Layout 1 (before): one file per entry and an index naming all ids. Migrated on the
# first request that finds it (_migrate_layout_1).
INDEX = "guestbook/index.json"
ENTRY_DIR = "guestbook/entries"

MAX_NAME = 100
MAX_MESSAGE = 2000
MAX_BODY = 16384
PAGE_ENTRIES = 100  # default page size, HTML and JSON
MAX_LIMIT = 1000  # largest ?limit=
MAX_PARAM_DIGITS = 18  # ?before= and ?limit= are decimal integers of at most this many digits

StartResponse = Callable[..., Any]


class _HttpError(Exception):
    def __init__(self, status: str, message: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.headers = list(headers)


class LayoutError(Exception):
    """The state directory holds a guestbook this code cannot read (a bug or tampering);
    the adapter turns it into a fixed 500 and logs it."""


def _dumps(obj: Any) -> bytes:
    # Sorted keys and fixed separators: the same entry gives the same file bytes on
    # every replica, so checkpoint hashes agree.
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# -- storage ------------------------------------------------------------------------


@dataclass(frozen=True)
class Meta:
    count: int  # entries 1..count exist; ids are never reused or removed
    tail_bytes: int = 0  # the valid length of the chunk holding entry `count`
    chunk_entries: int = CHUNK_ENTRIES

    def encode(self) -> bytes:
        """JSON padded with spaces to META_BYTES, so each POST overwrites it in place."""
        d = {"chunk_entries": self.chunk_entries, "count": self.count, "layout": LAYOUT}
        data = _dumps({**d, "tail_bytes": self.tail_bytes})
        return data + b" " * (META_BYTES - 1 - len(data)) + b"\n"


def _chunk_path(k: int) -> str:
    return f"{CHUNK_DIR}/{k:08d}.jsonl"


def load_meta(state: StateDir) -> Meta:
    try:
        d = json.loads(state.read_bytes(META))
    except FileNotFoundError:
        return Meta(0)
    if d.get("layout") != LAYOUT or not isinstance(d.get("count"), int):
        raise LayoutError(f"{META}: not a layout-{LAYOUT} guestbook: {d!r}")
    chunk, tail = d.get("chunk_entries"), d.get("tail_bytes")
    if not isinstance(chunk, int) or chunk < 1 or d["count"] < 0 or not isinstance(tail, int):
        raise LayoutError(f"{META}: bad chunk_entries, count or tail_bytes: {d!r}")
    return Meta(d["count"], tail, chunk)


def _write_at(state: StateDir, path: str, offset: int, data: bytes) -> int:
    """Write `data` at `offset` of `path` and cut the file there; the new length. Opened
    "r+b", not "wb": rewriting a file by truncating it costs milliseconds on ext4 (it
    flushes the old blocks), an in-place write microseconds."""
    mode = "r+b" if offset > 0 or state.exists(path) else "wb"
    with state.open(path, mode) as f:
        f.seek(offset)
        f.write(data)
        end = f.tell()
        if os.fstat(f.fileno()).st_size > end:
            f.truncate()
    return end


def _chunk_lines(state: StateDir, k: int) -> list[bytes]:
    try:
        return state.read_bytes(_chunk_path(k)).splitlines()
    except FileNotFoundError:
        return []


def read_lines(state: StateDir, meta: Meta, first: int, last: int) -> list[bytes]:
    """The stored JSON (one `_dumps` each) of entries first..last (ids, inclusive, clipped
    to 1..count), oldest first. Reads only the chunk files holding them."""
    first, last = max(first, 1), min(last, meta.count)
    out: list[bytes] = []
    c = meta.chunk_entries
    for k in range((first - 1) // c, (last - 1) // c + 1) if first <= last else ():
        lines = _chunk_lines(state, k)
        lo, hi = max(first, k * c + 1) - 1 - k * c, min(last, (k + 1) * c) - k * c
        if hi > len(lines):
            raise LayoutError(f"{_chunk_path(k)}: {len(lines)} entries, meta needs {hi}")
        out.extend(lines[lo:hi])
    return out


def load_entries(state: StateDir) -> list[dict[str, Any]]:
    """All entries, oldest first (O(entries): for tests and tools, not for requests)."""
    meta = load_meta(state)
    return [json.loads(line) for line in read_lines(state, meta, 1, meta.count)]


def add_entry(state: StateDir, name: str, message: str, time_ms: int) -> dict[str, Any]:
    meta = load_meta(state)
    entry_id = meta.count + 1
    entry = {"id": entry_id, "name": name, "message": message, "time_ms": time_ms}
    k, pos = divmod(entry_id - 1, meta.chunk_entries)
    # Append at the chunk's valid length (0 starts a new chunk): bytes a torn earlier
    # write left behind (outside ZZ, where no checkpoint rolls it back) are cut off.
    # Chunk first, meta second: the meta file never counts a missing entry.
    tail = _write_at(state, _chunk_path(k), meta.tail_bytes if pos else 0, _dumps(entry) + b"\n")
    _write_at(state, META, 0, Meta(entry_id, tail, meta.chunk_entries).encode())
    return entry


def _migrate_layout_1(state: StateDir) -> None:
    """Rewrite a layout-1 guestbook (index.json + one file per entry) as chunks, ids
    kept. Chunks, then meta, then the old files are deleted: a crash in between leaves
    either the old layout (migrated again) or the new one plus old files (deleted at the
    next request). Every replica runs it at the same request, so states stay equal; a
    read-only request that gets here is rejected by the adapter and resent ordered."""
    if not state.exists(META):
        index = json.loads(state.read_bytes(INDEX))
        ids = index.get("ids")
        if (
            not isinstance(ids, list)
            or ids != list(range(1, len(ids) + 1))
            or index.get("next_id") != len(ids) + 1
        ):
            raise LayoutError(f"{INDEX}: ids are not 1..n with next_id n+1; not migrated")
        c = CHUNK_ENTRIES
        tail = 0
        for k in range((len(ids) + c - 1) // c):
            chunk = b"".join(
                _dumps(json.loads(state.read_bytes(f"{ENTRY_DIR}/{i:08d}.json"))) + b"\n"
                for i in ids[k * c : (k + 1) * c]
            )
            state.write_bytes(_chunk_path(k), chunk)
            tail = len(chunk)
        state.write_bytes(META, Meta(len(ids), tail).encode())
    state.delete(INDEX)
    if state.exists(ENTRY_DIR):
        state.delete(ENTRY_DIR)


# -- pages --------------------------------------------------------------------------


@dataclass(frozen=True)
class Page:
    """One page: the stored JSON of entries first..first+len(lines)-1, oldest first, out
    of `total`; `before` and `limit` as asked (None: no ?before=)."""

    total: int
    before: int | None
    limit: int
    first: int
    lines: list[bytes]

    @property
    def entries(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines]

    @property
    def older(self) -> int | None:
        """The ?before= of the next (older) page; None on the oldest page."""
        return self.first if self.lines and self.first > 1 else None

    def export(self) -> bytes:
        """The JSON array of the page's entries: the stored lines joined, the same bytes
        as `_dumps(self.entries)` without parsing them."""
        return b"[" + b",".join(self.lines) + b"]\n"

    def link(self, path: str, before: int | None) -> str:
        params = {} if before is None else {"before": before}
        if self.limit != PAGE_ENTRIES:
            params["limit"] = self.limit
        return path + ("?" + urlencode(params) if params else "")


def _int_param(name: str, value: str, low: int, high: int | None) -> int:
    if not value.isascii() or not value.isdigit() or len(value) > MAX_PARAM_DIGITS:
        raise _HttpError(
            "400 Bad Request",
            f"{name} must be a decimal integer of at most {MAX_PARAM_DIGITS} digits, got {value!r}",
        )
    n = int(value)
    if n < low or (high is not None and n > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise _HttpError("400 Bad Request", f"{name} must be {bound}, got {n}")
    return n


def _page(environ: dict[str, Any], state: StateDir) -> Page:
    """The page the query string asks for: ?before=ID (entries with smaller ids; default
    all) and ?limit=N (1..MAX_LIMIT, default PAGE_ENTRIES), the newest `limit` of them."""
    query = environ.get("QUERY_STRING", "")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True) if query else []
    except ValueError as e:
        raise _HttpError("400 Bad Request", f"bad query string {query!r}") from e
    params: dict[str, str] = {}
    for key, value in pairs:
        if key not in ("before", "limit"):
            continue  # other parameters are ignored (e.g. cache busters), as before paging
        if key in params:
            raise _HttpError("400 Bad Request", f"parameter {key!r} given more than once")
        params[key] = value
    before = _int_param("before", params["before"], 1, None) if "before" in params else None
    limit = (
        _int_param("limit", params["limit"], 1, MAX_LIMIT) if "limit" in params else PAGE_ENTRIES
    )
    meta = load_meta(state)
    end = meta.count if before is None else min(before - 1, meta.count)
    first = max(end - limit + 1, 1)
    return Page(meta.count, before, limit, first, read_lines(state, meta, first, end))


def _format_time(time_ms: int) -> str:
    return datetime.fromtimestamp(time_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def render_page(page: Page) -> bytes:
    entries = page.entries
    items = "\n".join(
        f'<li id="e{e["id"]}"><b>{html.escape(e["name"])}</b> '
        f"<small>{_format_time(e['time_ms'])}</small>"
        f"<p>{html.escape(e['message'])}</p></li>"
        for e in reversed(entries)
    )
    if entries:
        shown = f"#{entries[-1]['id']} to #{entries[0]['id']} shown, newest first"
    else:
        shown = "none shown"
    nav = []
    if page.before is not None:
        nav.append(f'<a href="{html.escape(page.link("/", None))}">newest entries</a>')
    if page.older is not None:
        nav.append(f'<a href="{html.escape(page.link("/", page.older))}">older entries</a>')
    page_html = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>ZZ guestbook</title></head>
<body>
<h1>Guestbook</h1>
<form method="post" action="/">
<p><label>Name <input name="name" maxlength="{MAX_NAME}"></label></p>
<p><label>Message <textarea name="message" maxlength="{MAX_MESSAGE}"></textarea></label></p>
<p><button type="submit">Sign</button></p>
</form>
<p>{page.total} entries ({shown})</p>
<ul>
{items}
</ul>
{f"<p>{' | '.join(nav)}</p>{chr(10)}" if nav else ""}</body></html>
"""
    return page_html.encode()


def _read_form(environ: dict[str, Any]) -> dict[str, str]:
    ctype = environ.get("CONTENT_TYPE", "").split(";")[0].strip().lower()
    if ctype != "application/x-www-form-urlencoded":
        raise _HttpError("415 Unsupported Media Type", "send application/x-www-form-urlencoded")
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError as e:
        raise _HttpError("400 Bad Request", "bad Content-Length") from e
    if length > MAX_BODY:
        raise _HttpError("413 Content Too Large", f"form over {MAX_BODY} bytes")
    body = environ["wsgi.input"].read(length)
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
    except UnicodeDecodeError as e:
        raise _HttpError("400 Bad Request", "form is not UTF-8") from e
    return {k: v[0] for k, v in fields.items()}


def _post(environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
    form = _read_form(environ)
    name = form.get("name", "").strip() or "anonymous"
    message = form.get("message", "").strip()
    if not message:
        raise _HttpError("400 Bad Request", "message is required")
    if len(name) > MAX_NAME or len(message) > MAX_MESSAGE:
        raise _HttpError("400 Bad Request", f"name over {MAX_NAME} or message over {MAX_MESSAGE}")
    time_ms = environ.get("zz.time_ms")
    if time_ms is None:  # outside ZZ (e.g. wsgiref during development)
        time_ms = int(time.time() * 1000)
    entry = add_entry(environ["zz.state"], name, message, int(time_ms))
    body = f"added entry {entry['id']}\n".encode()
    return (
        "303 See Other",
        [("Location", f"/#e{entry['id']}"), ("Content-Type", "text/plain")],
        body,
    )


def _route(environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
    method = environ["REQUEST_METHOD"]
    path = environ.get("PATH_INFO") or "/"
    state: StateDir = environ["zz.state"]
    if state.exists(INDEX):
        _migrate_layout_1(state)
    if path == "/":
        if method in ("GET", "HEAD"):
            body = render_page(_page(environ, state))
            return "200 OK", [("Content-Type", "text/html; charset=utf-8")], body
        if method == "POST":
            return _post(environ)
        raise _HttpError(
            "405 Method Not Allowed", "use GET or POST", [("Allow", "GET, HEAD, POST")]
        )
    if path == "/entries.json":
        if method in ("GET", "HEAD"):
            page = _page(environ, state)
            headers = [("Content-Type", "application/json")]
            if page.older is not None:
                link = page.link("/entries.json", page.older)
                headers.append(("Link", f'<{link}>; rel="next"'))
            return "200 OK", headers, page.export()
        raise _HttpError("405 Method Not Allowed", "use GET", [("Allow", "GET, HEAD")])
    raise _HttpError("404 Not Found", f"no page {path}")


def application(environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
    """The WSGI entry point (PEP 3333). Needs environ['zz.state'] (a StateDir)."""
    try:
        status, headers, body = _route(environ)
    except _HttpError as e:
        status, body = e.status, (str(e) + "\n").encode()
        headers = [("Content-Type", "text/plain; charset=utf-8"), *e.headers]
    headers.append(("Content-Length", str(len(body))))
    start_response(status, headers)
    return [body]


def standalone(root: str) -> Callable[[dict[str, Any], StartResponse], list[bytes]]:
    """The app outside ZZ, for trying it with wsgiref: state in `root`, the local clock."""
    os.makedirs(root, exist_ok=True)
    state = StateDir(root)

    def app(environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
        environ["zz.state"] = state
        environ["zz.time_ms"] = int(time.time() * 1000)
        return application(environ, start_response)

    return app
