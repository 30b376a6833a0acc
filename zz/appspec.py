"""zz/appspec.py - the app catalogue: the app names a rack config's `app = "..."` may give and
the options each takes. The config checker reads it; execution/registry.py builds the apps."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_WSGI_TARGET_RE = re.compile(r"^wsgi:([A-Za-z_][\w.]*):([A-Za-z_]\w*)$")


class AppRegistryError(ValueError):
    """An app name or option the registry cannot accept; the message names it."""


class UnknownAppError(AppRegistryError):
    pass


class AppOptionError(AppRegistryError):
    pass


@dataclass(frozen=True)
class Option:
    name: str
    kind: type  # int, str or bool
    default: Any
    doc: str
    min: int | None = None
    max: int | None = None

    def check(self, app: str, value: Any) -> Any:
        where = f"app {app!r}: option {self.name!r}"
        # bool is an int subclass; a TOML `true` for a count is a mistake, not 1.
        if type(value) is not self.kind:
            raise AppOptionError(
                f"{where}: must be {self.kind.__name__}, got {type(value).__name__} {value!r}"
            )
        if self.min is not None and value < self.min:
            raise AppOptionError(f"{where}: must be >= {self.min}, got {value}")
        if self.max is not None and value > self.max:
            raise AppOptionError(f"{where}: must be <= {self.max}, got {value}")
        return value


@dataclass(frozen=True)
class AppSpec:
    name: str
    summary: str
    options: tuple[Option, ...]


_WSGI_OPTIONS = (
    Option("server_name", str, "zz.invalid", "SERVER_NAME in the WSGI environ"),
    Option("server_port", int, 80, "SERVER_PORT in the WSGI environ", 1, 65535),
)
_U32_MAX = 0xFFFFFFFF

# Every bundled app here has a builder in execution/registry.py (_BUILDERS).
_SPECS: dict[str, AppSpec] = {
    s.name: s
    for s in (
        AppSpec("echo", "null service: the reply is the op", ()),
        AppSpec(
            "kv",
            "key-value store, one state file per key (GET/PUT/DELETE/CAS/APPEND)",
            (
                Option("max_key", int, 1024, "largest key in bytes", 1, 65536),
                Option("max_value", int, 1 << 20, "largest value in bytes", 0, 1 << 30),
            ),
        ),
        AppSpec(
            "files",
            "POSIX-style file service (lookup, read, write, rename, ...) behind `zz mount`",
            (
                Option("max_bytes", int, 1 << 33, "capacity: bytes of all files", 0, 1 << 50),
                Option("max_inodes", int, 1_000_000, "most inodes, the root included", 1),
                Option("max_file_size", int, 1 << 30, "largest file in bytes", 0, 1 << 50),
                Option("max_io", int, 1 << 20, "largest READ or WRITE in bytes", 4096, 1 << 24),
                Option("root_mode", int, 0o755, "permission bits of the root directory", 0, 0o7777),
                Option("root_uid", int, 0, "owner of the root directory", 0, _U32_MAX),
                Option("root_gid", int, 0, "group of the root directory", 0, _U32_MAX),
            ),
        ),
        AppSpec(
            "microbench",
            "burns E of CPU per request as SHA-256 iterations; optional reply size, writes",
            (
                Option("iters_per_ms", int, 1000, "rack-wide SHA-256 iterations per ms", 1),
                Option("files", int, 1024, "distinct state files that writes cycle over", 1),
                Option("max_iterations", int, 100_000_000, "per-request work limit", 0),
                Option("max_reply", int, 1 << 20, "largest reply_size", 0, _U32_MAX),
                Option("max_write", int, 1 << 20, "largest write_size", 0, _U32_MAX),
                Option("max_writes", int, 64, "most files written per request", 0, 65535),
            ),
        ),
        AppSpec(
            "wsgi:guestbook",
            "guestbook web app through the WSGI adapter",
            _WSGI_OPTIONS,
        ),
    )
}


def app_names() -> list[str]:
    return sorted(_SPECS)


def _unknown(name: str) -> UnknownAppError:
    valid = ", ".join(app_names())
    return UnknownAppError(
        f"unknown app {name!r}; valid apps: {valid} (or wsgi:<module>:<callable>)"
    )


def _user_wsgi_spec(name: str) -> AppSpec:
    """`wsgi:<module>:<callable>`: any importable WSGI app (the operator's own code), loaded
    only when the runtime builds it (execution/registry.py)."""
    m = _WSGI_TARGET_RE.match(name)
    if m is None:
        raise _unknown(name)
    module, attr = m.groups()
    return AppSpec(name, f"WSGI app {module}.{attr}", _WSGI_OPTIONS)


def get_spec(name: str) -> AppSpec:
    if not isinstance(name, str):
        raise UnknownAppError(f"app name must be a string, got {type(name).__name__}")
    spec = _SPECS.get(name)
    if spec is not None:
        return spec
    if name.startswith("wsgi:") and name.count(":") == 2:
        return _user_wsgi_spec(name)
    raise _unknown(name)


def validate_options(name: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Options with defaults filled in, or AppRegistryError naming the app and option."""
    spec = get_spec(name)
    given = dict(options or {})
    known = {o.name: o for o in spec.options}
    for key in sorted(given):
        if key not in known:
            valid = ", ".join(sorted(known)) or "none"
            raise AppOptionError(f"app {name!r}: unknown option {key!r} (valid: {valid})")
    return {o.name: o.check(name, given.get(o.name, o.default)) for o in spec.options}
