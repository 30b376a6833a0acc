# tests/conftest.py - generic fixtures shared by the Python test suite.
# Only rack-config helpers live here; component-specific fixtures belong in their tests.
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

RACK_TOML = """\
[rack]
name = "test"
key_dir = "keys"
run_dir = "run"
checkpoint_interval = 4
log_window = 8
batch_max = 16
view_timeout_ms = 500

[[hosts]]
name = "h0"
address = "127.0.0.1"
libvirt_uri = "test:///default"

[[hosts]]
name = "h1"
address = "127.0.0.1"
libvirt_uri = "test:///default"

[[services]]
name = "web"
id = 1
g = 1
f = 1
clients = 4
base_port = {base_port}
"""


@pytest.fixture
def write_rack(tmp_path: Path) -> Callable[[str], Path]:
    """Write TOML text as tmp_path/rack.toml and return its path."""

    def write(text: str) -> Path:
        p = tmp_path / "rack.toml"
        p.write_text(text)
        return p

    return write


@pytest.fixture
def rack_config(write_rack: Callable[[str], Path]) -> Path:
    """A minimal valid one-service rack (g = f = 1) in a temporary directory."""
    return write_rack(RACK_TOML.format(base_port=17100))
