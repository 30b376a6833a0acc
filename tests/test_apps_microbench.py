"""tests/test_apps_microbench.py - microbench: equal work, equal replies; limits, writes, calibrate.
Benchmarks trust that replicas agree on a reply whose cost they chose, so both are checked."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest

from zz.appspec import AppOptionError
from zz.execution.app import ExecContext
from zz.execution.apps import microbench as mb
from zz.execution.registry import create_app
from zz.execution.state import StateDir


def _ctx(seq: int = 1, client: int = 3, read_only: bool = False) -> ExecContext:
    return ExecContext(seq, client, seq, 1_700_000_000_000, 9, read_only)


def _app(root: Path, **opts: int) -> mb.MicrobenchApp:
    root.mkdir()
    app = create_app("microbench", opts)
    assert isinstance(app, mb.MicrobenchApp)
    app.open(StateDir(root))
    return app


def test_reply_is_the_iterated_hash(tmp_path: Path) -> None:
    app = _app(tmp_path / "s")
    op = mb.encode_op(iterations=3, payload=b"pad")
    h = hashlib.sha256(op).digest()
    for _ in range(3):
        h = hashlib.sha256(h).digest()
    assert mb.decode_reply(app.execute(op, _ctx())) == h


def test_same_op_same_reply_across_instances(tmp_path: Path) -> None:
    a = _app(tmp_path / "a")
    b = _app(tmp_path / "b")
    op = mb.encode_op(iterations=5000, reply_size=100)
    ra, rb = a.execute(op, _ctx(1)), b.execute(op, _ctx(2, client=8))
    assert ra == rb and len(mb.decode_reply(ra)) == 100
    other = mb.encode_op(iterations=5001, reply_size=100)
    assert a.execute(other, _ctx()) != ra


def test_microseconds_use_the_rack_constant(tmp_path: Path) -> None:
    # 250 µs at 2000 iterations/ms is exactly 500 iterations; a local calibration
    # never enters, so a slower or faster replica still agrees.
    app = _app(tmp_path / "s", iters_per_ms=2000)
    assert app.iterations(mb.decode_op(mb.encode_op(us=250))) == 500
    op_us = mb.encode_op(us=250)
    expected = mb.burn(op_us, 500)
    assert mb.decode_reply(app.execute(op_us, _ctx())) == expected


def test_writes_are_deterministic_and_bounded(tmp_path: Path) -> None:
    a = _app(tmp_path / "a", files=8)
    b = _app(tmp_path / "b", files=8)
    for seq in range(1, 30):
        op = mb.encode_op(iterations=10, writes=3, write_size=64)
        assert a.execute(op, _ctx(seq)) == b.execute(op, _ctx(seq))
    files_a = sorted((tmp_path / "a" / mb.DATA_DIR).iterdir())
    files_b = sorted((tmp_path / "b" / mb.DATA_DIR).iterdir())
    assert [f.name for f in files_a] == [f.name for f in files_b]
    assert 1 < len(files_a) <= 8
    assert all(f.stat().st_size == 64 for f in files_a)
    assert [f.read_bytes() for f in files_a] == [f.read_bytes() for f in files_b]
    assert a.state.take_dirty().written == {f"{mb.DATA_DIR}/{f.name}" for f in files_a}


def test_read_only_and_errors(tmp_path: Path) -> None:
    app = _app(tmp_path / "s", max_iterations=100)
    assert app.is_read_only(mb.encode_op(iterations=1))
    assert not app.is_read_only(mb.encode_op(iterations=1, writes=1, write_size=1))
    with pytest.raises(mb.MicrobenchError, match="read-only"):
        mb.decode_reply(app.execute(mb.encode_op(iterations=1, writes=1), _ctx(read_only=True)))
    with pytest.raises(mb.MicrobenchError, match="limit"):
        mb.decode_reply(app.execute(mb.encode_op(iterations=101), _ctx()))
    with pytest.raises(mb.MicrobenchError, match="header"):
        mb.decode_reply(app.execute(b"\x00\x01", _ctx()))
    with pytest.raises(mb.MicrobenchError, match="unit"):
        mb.decode_reply(app.execute(b"\x07" + bytes(14), _ctx()))
    assert not app.state.take_dirty()
    with pytest.raises(ValueError):
        mb.encode_op(iterations=1, us=1)


def test_option_validation() -> None:
    with pytest.raises(AppOptionError, match="iters_per_ms.*>= 1"):
        create_app("microbench", {"iters_per_ms": 0})


def test_calibration_is_sane() -> None:
    rate = mb.calibrate(0.05)
    # A SHA-256 of 32 bytes takes well under 100 µs and over 10 ns on any machine.
    assert 10 < rate < 100_000
    # Burning rate*20 iterations takes about 20 ms; wide bounds as other jobs share the CPU.
    n = int(rate * 20)
    start = time.perf_counter()
    mb.burn(b"x", n)
    elapsed_ms = (time.perf_counter() - start) * 1000
    assert 2 < elapsed_ms < 1000
