"""zz/atomicfile.py: a file is replaced whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from zz.atomicfile import write_atomic


@pytest.mark.parametrize("durable", [False, True])
def test_write_atomic_replaces_the_file(tmp_path: Path, durable: bool) -> None:
    p = tmp_path / "status.json"
    write_atomic(p, "old\n", durable=durable)
    write_atomic(p, b"new\n", durable=durable)
    assert p.read_bytes() == b"new\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["status.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    p = tmp_path / "inventory.json"
    write_atomic(p, "old\n")
    with pytest.raises(TypeError):
        write_atomic(p, 42)  # type: ignore[arg-type]
    assert p.read_text() == "old\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["inventory.json"]
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "no-such-dir" / "x.json", "data")
