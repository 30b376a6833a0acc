"""zz/ports.py: picked ranges are free and stay below the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from zz import ports


def test_ephemeral_low_reads_the_kernel_range(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert ports.ephemeral_low(str(f)) == 40000
    f.write_text("garbage\n")
    assert ports.ephemeral_low(str(f)) == 32768
    assert ports.ephemeral_low(str(tmp_path / "missing")) == 32768


def test_free_base_is_free_and_below_the_ephemeral_range() -> None:
    offsets = ports.service_ports(0)
    for _ in range(20):
        base = ports.free_base(offsets)
        assert base >= 10000
        assert base + max(offsets) < ports.ephemeral_low()
        assert all(ports.is_free("127.0.0.1", base + o) for o in offsets)


def test_a_bound_port_is_not_free() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not ports.is_free("127.0.0.1", s.getsockname()[1])


def test_no_free_range_is_an_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match="no free port range"):
            ports.free_base([0], low=port, high=port + 1, tries=5)
