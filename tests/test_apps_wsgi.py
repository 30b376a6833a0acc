"""tests/test_apps_wsgi.py - the WSGI adapter and the guestbook through it, as a replica runs them.
Covers the request/response codec, PEP 3333 conformance, escaping, read-only and determinism."""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode
from wsgiref.validate import validator

import pytest

from zz.execution.app import ExecContext
from zz.execution.apps import guestbook
from zz.execution.apps.wsgi import WsgiApp
from zz.execution.registry import create_app
from zz.execution.state import StateDir
from zz.httpop import (
    HttpRequest,
    HttpResponse,
    WsgiCodecError,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)

T0 = 1_700_000_000_000
FORM = [("Content-Type", "application/x-www-form-urlencoded")]


def _ctx(seq: int, read_only: bool = False) -> ExecContext:
    return ExecContext(
        seq, client=5, timestamp=seq, time_ms=T0 + seq * 1000, seed=77, read_only=read_only
    )


def _open(root: Path, application: Any = None) -> WsgiApp:
    root.mkdir()
    if application is None:
        app = create_app("wsgi:guestbook")
    else:
        app = WsgiApp(application, name="test")
    assert isinstance(app, WsgiApp)
    app.open(StateDir(root))
    return app


def _call(
    app: WsgiApp,
    seq: int,
    method: str,
    target: str,
    headers: Any = (),
    body: bytes = b"",
    read_only: bool = False,
) -> HttpResponse:
    op = encode_request(method, target, headers, body)
    return decode_response(app.execute(op, _ctx(seq, read_only)))


def _post(app: WsgiApp, seq: int, **form: str) -> HttpResponse:
    return _call(app, seq, "POST", "/", FORM, urlencode(form).encode())


# -- codec ----------------------------------------------------------------------


def test_request_codec_is_canonical() -> None:
    a = encode_request(
        "post",
        "/a%20b?x=1&y=2",
        [
            ("X-B", " 2 "),
            ("Host", "h"),
            ("x-a", "1"),
            ("X-B", "3"),
            ("Connection", "close"),
            ("Content-Length", "3"),
        ],
        b"abc",
    )
    b = encode_request(
        "POST", "/a%20b?x=1&y=2", [("host", "h"), ("x-a", "1"), ("x-b", "2"), ("x-b", "3")], b"abc"
    )
    assert a == b  # header case, order across names, spacing and framing headers vanish
    req = decode_request(a)
    assert req == HttpRequest(
        "POST",
        "/a%20b",
        "x=1&y=2",
        (("host", "h"), ("x-a", "1"), ("x-b", "2"), ("x-b", "3")),
        b"abc",
    )
    assert req.header("X-B") == "2, 3"
    # Repeated headers keep their relative order: it can carry meaning.
    c = encode_request("POST", "/a%20b?x=1&y=2", [("x-b", "3"), ("x-b", "2")], b"abc")
    assert decode_request(c).headers == (("x-b", "3"), ("x-b", "2"))


def test_response_codec_round_trip() -> None:
    r = HttpResponse(201, "Created", (("Location", "/x"), ("Set-Cookie", "a=1")), b"\x00body")
    assert decode_response(encode_response(r)) == r
    with pytest.raises(WsgiCodecError):
        decode_response(encode_response(r)[:-1])
    with pytest.raises(WsgiCodecError):
        decode_response(encode_response(r) + b"x")


def _raw_request(
    method: bytes, path: bytes, query: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> bytes:
    def f(b: bytes) -> bytes:
        return len(b).to_bytes(4, "big") + b

    out = b"ZQ\x01" + bytes([len(method)]) + method + f(path) + f(query)
    out += len(headers).to_bytes(4, "big") + b"".join(f(n) + f(v) for n, v in headers)
    return out + f(body)


@pytest.mark.parametrize(
    ("op", "why"),
    [
        (b"", "truncated"),
        (b"GET / HTTP/1.1\r\n\r\n", "magic"),
        (_raw_request(b"get", b"/", b"", [], b""), "method"),
        (_raw_request(b"GET", b"nope", b"", [], b""), "path"),
        (_raw_request(b"GET", b"/a b", b"", [], b""), "path"),
        (_raw_request(b"GET", b"/", b"a#b", [], b""), "query"),
        (_raw_request(b"GET", b"/", b"", [(b"Host", b"h")], b""), "non-lowercase"),
        (_raw_request(b"GET", b"/", b"", [(b"x", b"a\r\nb")], b""), "bad value"),
        (_raw_request(b"GET", b"/", b"", [(b"x", b" a")], b""), "bad value"),
        (_raw_request(b"GET", b"/", b"", [(b"b", b"1"), (b"a", b"1")], b""), "not sorted"),
        (_raw_request(b"GET", b"/", b"", [(b"content-length", b"0")], b""), "not carried"),
        (_raw_request(b"GET", b"/", b"", [], b"") + b"\x00", "trailing"),
        (_raw_request(b"GET", b"/", b"", [], b"")[:-2], "truncated"),
    ],
)
def test_malformed_ops_get_400_not_exception(tmp_path: Path, op: bytes, why: str) -> None:
    with pytest.raises(WsgiCodecError, match=why):
        decode_request(op)
    app = _open(tmp_path / "s")
    resp = decode_response(app.execute(op, _ctx(1)))
    assert resp.status == 400
    assert why.encode() in resp.body
    assert not app.state.take_dirty()


# -- guestbook through the adapter ----------------------------------------------


def test_post_then_get_shows_escaped_entry(tmp_path: Path) -> None:
    app = _open(tmp_path / "s")
    evil = "<script>alert('x')</script> & \"friends\""
    r = _post(app, 1, name="<b>mallory</b>", message=evil)
    assert r.status == 303 and r.header("location") == "/#e1"
    page = _call(app, 2, "GET", "/")
    assert page.status == 200 and page.header("content-type").startswith("text/html")
    html = page.body.decode()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; &quot;friends&quot;" in html
    assert "&lt;b&gt;mallory&lt;/b&gt;" in html
    assert "<script>" not in html and "<b>mallory" not in html
    assert "2023-11-14 22:13:21 UTC" in html  # T0 + 1 s: the agreement clock, not the local one
    assert int(page.header("content-length")) == len(page.body)
    entries = json.loads(_call(app, 3, "GET", "/entries.json").body)
    assert entries == [{"id": 1, "name": "<b>mallory</b>", "message": evil, "time_ms": T0 + 1000}]
    files = sorted(app.state.take_dirty().written)
    assert files == ["guestbook/chunks/00000000.jsonl", "guestbook/meta.json"]


def test_guestbook_errors(tmp_path: Path) -> None:
    app = _open(tmp_path / "s")
    assert _post(app, 1, name="x", message="  ").status == 400
    assert _call(app, 2, "POST", "/", [("content-type", "text/plain")], b"hi").status == 415
    assert _call(app, 3, "GET", "/nope").status == 404
    r = _call(app, 4, "DELETE", "/")
    assert r.status == 405 and r.header("allow") == "GET, HEAD, POST"
    assert _post(app, 5, message="x" * (guestbook.MAX_MESSAGE + 1)).status == 400
    assert json.loads(_call(app, 6, "GET", "/entries.json").body) == []
    assert not app.state.take_dirty()


def test_head_strips_body_keeps_length(tmp_path: Path) -> None:
    app = _open(tmp_path / "s")
    _post(app, 1, message="hello")
    get = _call(app, 2, "GET", "/")
    head = _call(app, 3, "HEAD", "/")
    assert head.status == 200 and head.body == b""
    assert head.header("content-length") == str(len(get.body))


def test_read_only_get_runs_and_write_is_rejected(tmp_path: Path) -> None:
    app = _open(tmp_path / "s")
    _post(app, 1, message="first")
    app.state.take_dirty()
    assert app.is_read_only(encode_request("GET", "/"))
    assert not app.is_read_only(encode_request("POST", "/"))
    with app.state.read_only():  # what the runtime does around a read-only request
        ok = _call(app, 2, "GET", "/entries.json", read_only=True)
    assert ok.status == 200 and b"first" in ok.body
    # A POST sent as read-only: the adapter itself refuses the write.
    bad = _call(app, 3, "POST", "/", FORM, b"message=second", read_only=True)
    assert bad.status == 503 and bad.header("zz-read-only") == "rejected"
    assert len(json.loads(_call(app, 4, "GET", "/entries.json").body)) == 1
    assert not app.state.take_dirty()


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_two_replicas_agree(tmp_path: Path) -> None:
    rng = random.Random(5)
    ops = []
    for i in range(60):
        if rng.random() < 0.6:
            form = {"name": f"n{i}<&>", "message": rng.choice(["hi", "<i>x</i>", "é ünï", "a&b"])}
            ops.append(encode_request("POST", "/", FORM, urlencode(form).encode()))
        else:
            ops.append(
                encode_request(
                    rng.choice(["GET", "HEAD"]), rng.choice(["/", "/entries.json", "/x"])
                )
            )
    a = _open(tmp_path / "a")
    b = _open(tmp_path / "b")
    ra = [a.execute(op, _ctx(i + 1)) for i, op in enumerate(ops)]
    rb = [b.execute(op, _ctx(i + 1)) for i, op in enumerate(ops)]
    assert ra == rb
    assert _tree(a.state.root) == _tree(b.state.root)
    assert (
        len(
            json.loads(
                decode_response(a.execute(encode_request("GET", "/entries.json"), _ctx(999))).body
            )
        )
        > 10
    )


# -- adapter: PEP 3333 and deterministic inputs ----------------------------------


def _probe(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    """Reports what a WSGI app sees; the clock and RNG values must come from ctx."""
    seen = {
        "method": environ["REQUEST_METHOD"],
        "path": environ["PATH_INFO"],
        "query": environ["QUERY_STRING"],
        "ctype": environ.get("CONTENT_TYPE"),
        "host": environ.get("HTTP_HOST"),
        "cookie": environ.get("HTTP_COOKIE"),
        "under": environ.get("HTTP_X_A"),
        "body": environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"])).decode(),
        "time": time.time(),
        "random": random.random(),
        "zz_time": environ["zz.time_ms"],
        "zz_rng": environ["zz.rng"].random(),
    }
    body = json.dumps(seen, sort_keys=True).encode()
    start_response("200 OK", [("Content-Type", "application/json")])
    return [body]


def test_environ_and_deterministic_inputs(tmp_path: Path) -> None:
    app = _open(tmp_path / "s", validator(_probe))
    op = encode_request(
        "PUT",
        "/caf%C3%A9/x?q=1",
        [
            ("Host", "example.org"),
            ("Cookie", "a=1"),
            ("Cookie", "b=2"),
            ("x_a", "spoof"),
            ("Content-Type", "text/plain"),
        ],
        b"payload",
    )
    first = json.loads(decode_response(app.execute(op, _ctx(4))).body)
    assert first["method"] == "PUT"
    assert first["path"] == "/caf\u00c3\u00a9/x"  # PEP 3333: unquoted bytes as latin-1
    assert first["query"] == "q=1" and first["ctype"] == "text/plain"
    assert first["host"] == "example.org" and first["cookie"] == "a=1; b=2"
    assert first["under"] is None and first["body"] == "payload"
    assert first["time"] == (T0 + 4000) / 1000 and first["zz_time"] == T0 + 4000
    # The same ctx on a fresh replica gives the same draws; another seq does not.
    other = _open(tmp_path / "t", validator(_probe))
    assert json.loads(decode_response(other.execute(op, _ctx(4))).body) == first
    later = json.loads(decode_response(app.execute(op, _ctx(5))).body)
    assert later["random"] != first["random"] and later["zz_rng"] != first["zz_rng"]
    # The patches are gone after the request.
    assert abs(time.time() - first["time"]) > 1000


def test_app_failures_become_500(tmp_path: Path) -> None:
    def boom(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        raise RuntimeError("/secret/path in a traceback")

    def no_start(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        return [b"body"]

    def bad_header(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("X", "a\r\nInjected: 1")])
        return [b""]

    for i, fn in enumerate((boom, no_start, bad_header)):
        app = _open(tmp_path / f"s{i}", fn)
        resp = decode_response(app.execute(encode_request("GET", "/"), _ctx(1)))
        assert resp.status == 500 and b"secret" not in resp.body


def test_write_api_and_close_are_honoured(tmp_path: Path) -> None:
    closed = []

    class Result:
        def __iter__(self) -> Any:
            yield b"b"
            yield b"c"

        def close(self) -> None:
            closed.append(True)

    def app_fn(environ: dict[str, Any], start_response: Any) -> Result:
        write = start_response("202 Accepted", [("X-Order", "1")])
        write(b"a")
        return Result()

    app = _open(tmp_path / "s", app_fn)
    resp = decode_response(app.execute(encode_request("GET", "/"), _ctx(1)))
    assert (resp.status, resp.reason, resp.body) == (202, "Accepted", b"abc")
    assert closed == [True]
