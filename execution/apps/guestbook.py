"""execution/apps/guestbook.py - a small plain-WSGI guestbook: HTML list, form POST, JSON export.
The demo BFT web app: its entries are files in the StateDir, its clock is environ['zz.time_ms']."""

from __future__ import annotations

import html
import json
import os
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs

from zz.execution.state import StateDir

INDEX = "guestbook/index.json"
ENTRY_DIR = "guestbook/entries"
MAX_NAME = 100
MAX_MESSAGE = 2000
MAX_BODY = 16384
PAGE_ENTRIES = 100

StartResponse = Callable[..., Any]


class _HttpError(Exception):
    def __init__(self, status: str, message: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.headers = list(headers)


def _dumps(obj: Any) -> bytes:
    # Sorted keys and fixed separators: the same entry gives the same file bytes on
    # every replica, so checkpoint hashes agree.
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _load_index(state: StateDir) -> dict[str, Any]:
    if not state.exists(INDEX):
        return {"next_id": 1, "ids": []}
    return json.loads(state.read_bytes(INDEX))


def _entry_path(entry_id: int) -> str:
    return f"{ENTRY_DIR}/{entry_id:08d}.json"


def load_entries(state: StateDir) -> list[dict[str, Any]]:
    """All entries, oldest first."""
    return [json.loads(state.read_bytes(_entry_path(i))) for i in _load_index(state)["ids"]]


def add_entry(state: StateDir, name: str, message: str, time_ms: int) -> dict[str, Any]:
    index = _load_index(state)
    entry_id = index["next_id"]
    entry = {"id": entry_id, "name": name, "message": message, "time_ms": time_ms}
    # Entry first, index second: an index never names a missing entry file.
    state.write_bytes(_entry_path(entry_id), _dumps(entry))
    index["next_id"] = entry_id + 1
    index["ids"].append(entry_id)
    state.write_bytes(INDEX, _dumps(index))
    return entry


def _format_time(time_ms: int) -> str:
    return datetime.fromtimestamp(time_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def render_page(entries: list[dict[str, Any]]) -> bytes:
    shown = list(reversed(entries[-PAGE_ENTRIES:]))
    items = "\n".join(
        f'<li id="e{e["id"]}"><b>{html.escape(e["name"])}</b> '
        f"<small>{_format_time(e['time_ms'])}</small>"
        f"<p>{html.escape(e['message'])}</p></li>"
        for e in shown
    )
    more = f" (newest {PAGE_ENTRIES} shown)" if len(entries) > PAGE_ENTRIES else ""
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>ZZ guestbook</title></head>
<body>
<h1>Guestbook</h1>
<form method="post" action="/">
<p><label>Name <input name="name" maxlength="{MAX_NAME}"></label></p>
<p><label>Message <textarea name="message" maxlength="{MAX_MESSAGE}"></textarea></label></p>
<p><button type="submit">Sign</button></p>
</form>
<p>{len(entries)} entries{more}</p>
<ul>
{items}
</ul>
</body></html>
"""
    return page.encode()


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
    if path == "/":
        if method in ("GET", "HEAD"):
            body = render_page(load_entries(state))
            return "200 OK", [("Content-Type", "text/html; charset=utf-8")], body
        if method == "POST":
            return _post(environ)
        raise _HttpError(
            "405 Method Not Allowed", "use GET or POST", [("Allow", "GET, HEAD, POST")]
        )
    if path == "/entries.json":
        if method in ("GET", "HEAD"):
            body = _dumps(load_entries(state)) + b"\n"
            return "200 OK", [("Content-Type", "application/json")], body
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
