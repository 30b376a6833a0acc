"""execution/registry.py - app name (the rack config's `app = "..."`) -> validated options -> App.
The names and options are the catalogue in zz/appspec.py, which the config checker reads too;
here is how each is built."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from zz.appspec import UnknownAppError, validate_options
from zz.execution.app import App, EchoApp


def _kv(opts: dict[str, Any]) -> App:
    from zz.execution.apps.kv import KvApp

    return KvApp(**opts)


def _files(opts: dict[str, Any]) -> App:
    from zz.execution.apps.files import FilesApp

    return FilesApp(**opts)


def _microbench(opts: dict[str, Any]) -> App:
    from zz.execution.apps.microbench import MicrobenchApp

    return MicrobenchApp(**opts)


def _wsgi(name: str, application: Any, opts: dict[str, Any]) -> App:
    from zz.execution.apps.wsgi import WsgiApp

    return WsgiApp(application, name=name, **opts)


def _guestbook(opts: dict[str, Any]) -> App:
    from zz.execution.apps import guestbook

    return _wsgi("wsgi:guestbook", guestbook.application, opts)


# One builder per bundled app of the catalogue (zz/appspec.py _SPECS).
_BUILDERS: dict[str, Callable[[dict[str, Any]], App]] = {
    "echo": lambda _opts: EchoApp(),
    "files": _files,
    "kv": _kv,
    "microbench": _microbench,
    "wsgi:guestbook": _guestbook,
}


def _user_wsgi(name: str, opts: dict[str, Any]) -> App:
    """`wsgi:<module>:<callable>`: any importable WSGI app (the operator's own code)."""
    _, module, attr = name.split(":")  # the catalogue checked the form
    try:
        application = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise UnknownAppError(f"app {name!r}: cannot load {module}.{attr}: {e}") from e
    if not callable(application):
        raise UnknownAppError(f"app {name!r}: {module}.{attr} is not callable")
    return _wsgi(name, application, opts)


def create_app(name: str, options: Mapping[str, Any] | None = None) -> App:
    """The App for a rack config's `app` name and options, not yet open()ed."""
    opts = validate_options(name, options)  # AppRegistryError for an unknown name or option
    build = _BUILDERS.get(name)
    if build is not None:
        return build(opts)
    if name.startswith("wsgi:"):
        return _user_wsgi(name, opts)
    raise UnknownAppError(f"app {name!r} is in zz/appspec.py but has no builder here")
