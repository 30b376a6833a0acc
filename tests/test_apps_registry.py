"""tests/test_apps_registry.py - app names, option validation, the echo app and ExecContext.rng().
A typo in a rack config's app or option must fail at start with a message naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from zz.appspec import AppOptionError, UnknownAppError, app_names, validate_options
from zz.execution.app import App, EchoApp, ExecContext
from zz.execution.apps.wsgi import WsgiApp
from zz.execution.registry import create_app
from zz.execution.state import StateDir
from zz.httpop import decode_response, encode_request


def test_bundled_names() -> None:
    assert app_names() == ["echo", "files", "kv", "microbench", "wsgi:guestbook"]
    for name in app_names():
        assert isinstance(create_app(name), App)


def test_unknown_app_lists_valid_ones() -> None:
    with pytest.raises(UnknownAppError) as e:
        create_app("kvv")
    msg = str(e.value)
    assert "'kvv'" in msg and "echo, files, kv, microbench, wsgi:guestbook" in msg
    with pytest.raises(UnknownAppError, match="cannot load"):
        create_app("wsgi:no_such_module_zz:app")


def test_option_errors_name_app_and_option() -> None:
    assert validate_options("kv", {"max_key": 8}) == {"max_key": 8, "max_value": 1 << 20}
    with pytest.raises(AppOptionError, match=r"app 'kv': unknown option 'maxkey' \(valid: max_key"):
        create_app("kv", {"maxkey": 8})
    with pytest.raises(AppOptionError, match="'max_key': must be int, got str"):
        create_app("kv", {"max_key": "8"})
    with pytest.raises(AppOptionError, match="'max_key': must be int, got bool"):
        create_app("kv", {"max_key": True})
    with pytest.raises(AppOptionError, match="'server_port': must be <= 65535"):
        create_app("wsgi:guestbook", {"server_port": 70000})
    with pytest.raises(AppOptionError, match="unknown option 'x' \\(valid: none\\)"):
        create_app("echo", {"x": 1})


def test_user_wsgi_app_by_import_path(tmp_path: Path) -> None:
    app = create_app("wsgi:wsgiref.simple_server:demo_app", {"server_name": "h"})
    assert isinstance(app, WsgiApp)
    app.open(StateDir(tmp_path))
    resp = decode_response(app.execute(encode_request("GET", "/"), ExecContext(1, 1, 1, 0, 0)))
    assert resp.status == 200 and b"SERVER_NAME = 'h'" in resp.body


def test_echo_and_rng() -> None:
    echo = create_app("echo")
    assert isinstance(echo, EchoApp)
    ctx = ExecContext(seq=3, client=2, timestamp=9, time_ms=0, seed=1)
    assert echo.execute(b"\x00op", ctx) == b"\x00op" and echo.is_read_only(b"")
    assert echo.save_memory() is None
    with pytest.raises(ValueError):
        echo.load_memory(b"unexpected")
    same = ExecContext(seq=3, client=2, timestamp=9, time_ms=123, seed=1)
    assert ctx.rng().random() == same.rng().random()  # time is not an RNG input
    draws = {
        c.rng().random()
        for c in (
            ctx,
            ExecContext(4, 2, 9, 0, 1),
            ExecContext(3, 3, 9, 0, 1),
            ExecContext(3, 2, 10, 0, 1),
            ExecContext(3, 2, 9, 0, 2),
        )
    }
    assert len(draws) == 5
