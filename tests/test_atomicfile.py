"""zz/atomicfile.py: a file is replaced whole or not at all."""

from __future__ import annotations

import grp
import os
import pwd
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


@pytest.mark.skipif(os.geteuid() != 0, reason="only root gives a file away")
def test_the_new_file_has_its_owner_and_mode_when_it_takes_the_name(tmp_path: Path) -> None:
    """owner: the file is that user's and group's from the moment it has the name, as the
    keys controld copies into a guest's share must be QEMU's user's (controld/actions.py).
    Debian's `daemon` is a user and a group of one name, as libvirt-qemu is."""
    p = tmp_path / "spare-p256.msg"
    write_atomic(p, b"old\n")
    write_atomic(p, b"announcement\n", mode=0o600, owner="daemon")
    st = p.stat()
    assert (st.st_uid, st.st_gid) == (pwd.getpwnam("daemon").pw_uid, grp.getgrnam("daemon").gr_gid)
    assert st.st_mode & 0o777 == 0o600 and p.read_bytes() == b"announcement\n"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["spare-p256.msg"]
