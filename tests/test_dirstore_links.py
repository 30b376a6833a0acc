# tests/test_dirstore_links.py - a directory-store checkpoint links what did not change.
"""The report of a checkpoint seq waits for the checkpoint, and on the directory store a
checkpoint copied the whole state (3 s for 401 files under the campaign's load, seed 3902
round 110, which made a correct replica late). A file whose manifest entry is the same as
in the replica's last complete checkpoint is now a hard link to its copy there."""

from __future__ import annotations

import hashlib
from pathlib import Path

from test_store_lock import _runtime_with_snapshots

from zz.snapshots import dirstore
from zz.snapshots.store import checkpoint_name


def _inode(p: Path) -> int:
    return p.stat().st_ino


def _announce(rt, seq: int, c: bytes) -> None:  # type: ignore[no-untyped-def]
    rt.ckpt.adopt(seq, c)  # what announce() does for the base: this replica's last


def test_unchanged_files_are_shared_with_the_last_checkpoint_and_live_never(
    tmp_path: Path,
) -> None:
    rt = _runtime_with_snapshots(tmp_path, 0)
    live = rt.ckpt.store.path
    snaps = rt.ckpt.store.root / "snapshots"
    for k in range(20):
        (live / f"f{k}").write_bytes(b"v1 %d" % k)
    c1 = rt._checkpoint(rt.cp)
    _announce(rt, rt.cp, c1)
    (live / "f3").write_bytes(b"v2 changed")
    rt.ckpt.builder.mark_all_dirty(["f3"])
    c2 = rt._checkpoint(2 * rt.cp)
    a, b = snaps / checkpoint_name(rt.cp), snaps / checkpoint_name(2 * rt.cp)
    assert _inode(a / "f0") == _inode(b / "f0") and _inode(a / "f7") == _inode(b / "f7")
    assert _inode(a / "f3") != _inode(b / "f3")
    assert (a / "f3").read_bytes() == b"v1 3" and (b / "f3").read_bytes() == b"v2 changed"
    for p in live.iterdir():
        if p.is_file():
            assert _inode(p) not in {_inode(q) for q in b.iterdir() if q.is_file()}, p
    # Each snapshot holds exactly what its manifest certifies.
    for seq, c in ((rt.cp, c1), (2 * rt.cp, c2)):
        m = rt.ckpt.files.manifest(seq)
        assert m is not None and m.digest() == c
        for rel, e in m.files.items():
            data = (snaps / checkpoint_name(seq) / rel).read_bytes()
            assert hashlib.sha256(data).digest() == e.sha256, (seq, rel)
    # Writing the live file again changes no snapshot.
    (live / "f0").write_bytes(b"live only")
    assert (a / "f0").read_bytes() == b"v1 0" == (b / "f0").read_bytes()


def test_a_checkpoint_taken_while_recovering_is_never_a_base(tmp_path: Path) -> None:
    """Below `complete_from` a snapshot may hold a stale local copy of a file its manifest
    certifies (the fetch had not replaced it yet): the next checkpoint copies everything."""
    rt = _runtime_with_snapshots(tmp_path, 0)
    live = rt.ckpt.store.path
    (live / "a").write_bytes(b"a")
    c1 = rt._checkpoint(rt.cp)
    _announce(rt, rt.cp, c1)
    rt.ckpt.complete_from = 2 * rt.cp  # as a recovery that completed at the next one
    calls: list[str] = []
    real = rt.ckpt.store.snapshot_since
    rt.ckpt.store.snapshot_since = lambda *a: calls.append(a[0]) or real(*a)  # type: ignore[method-assign]
    rt._checkpoint(2 * rt.cp)
    snaps = rt.ckpt.store.root / "snapshots"
    assert calls == []
    one, two = (snaps / checkpoint_name(s) / "a" for s in (rt.cp, 2 * rt.cp))
    assert _inode(one) != _inode(two)


def test_snapshot_since_copies_what_the_base_lacks(tmp_path: Path) -> None:
    st = dirstore.DirStore(tmp_path / "store")
    (st.path / "d").mkdir()
    (st.path / "d" / "x").write_bytes(b"x")
    st.snapshot("ckpt-1")
    (st.path / "d" / "new").write_bytes(b"new")
    st.snapshot_since("ckpt-2", "ckpt-1", lambda rel: True)  # even if told it is unchanged
    two = st.root / "snapshots" / "ckpt-2"
    assert (two / "d" / "new").read_bytes() == b"new" and (two / "d" / "x").read_bytes() == b"x"
    assert _inode(two / "d" / "x") == _inode(st.root / "snapshots" / "ckpt-1" / "d" / "x")
    st.snapshot_since("ckpt-3", "ckpt-gone", lambda rel: True)  # no such base: a copy
    assert _inode(st.root / "snapshots" / "ckpt-3" / "d" / "x") != _inode(two / "d" / "x")


def test_a_drills_corrupted_snapshot_is_never_a_base(tmp_path: Path) -> None:
    """corrupt-snapshot takes a copy with flipped bytes: linking the next checkpoint to it
    would keep serving the corruption after the drill turned the fault off."""
    rt = _runtime_with_snapshots(tmp_path, 0)
    live = rt.ckpt.store.path
    (live / "a").write_bytes(b"abcdef")
    rt.faults.fault = "corrupt-snapshot"
    c1 = rt._checkpoint(rt.cp)
    _announce(rt, rt.cp, c1)
    rt.faults.fault = None
    rt._checkpoint(2 * rt.cp)
    snaps = rt.ckpt.store.root / "snapshots"
    assert (snaps / checkpoint_name(rt.cp) / "a").read_bytes() != b"abcdef"
    assert (snaps / checkpoint_name(2 * rt.cp) / "a").read_bytes() == b"abcdef"


def test_a_changed_file_is_read_once_for_its_hash_and_its_copy(tmp_path: Path) -> None:
    """The manifest build keeps the bytes it hashed of each changed file (and the runtime
    files it wrote), and the checkpoint's staged copy is written from them: the live file is
    opened once per checkpoint, not twice (docs/checkpoints.md)."""
    rt = _runtime_with_snapshots(tmp_path, 0)
    live = rt.ckpt.store.path
    snaps = rt.ckpt.store.root / "snapshots"
    for k in range(4):
        (live / f"f{k}").write_bytes(b"v1 %d" % k)
    c1 = rt._checkpoint(rt.cp)
    _announce(rt, rt.cp, c1)
    (live / "f1").write_bytes(b"v2 changed")
    rt.ckpt.builder.mark_all_dirty(["f1"])
    opened: list[str] = []
    real_open = dirstore.os.open

    def counting_open(path, flags, *a):  # type: ignore[no-untyped-def]
        if str(path).startswith(str(live)) and not flags & dirstore.os.O_WRONLY:
            opened.append(Path(path).name)
        return real_open(path, flags, *a)

    dirstore.os.open = counting_open  # type: ignore[assignment]
    try:
        c2 = rt._checkpoint(2 * rt.cp)
    finally:
        dirstore.os.open = real_open  # type: ignore[assignment]
    # The snapshot's copies of f1 and the runtime files came from the bytes hashed or
    # written, not from reading the live files again.
    assert opened.count("f1") == 1 and "replies" not in opened and "memory" not in opened, opened
    m = rt.ckpt.files.manifest(2 * rt.cp)
    assert m is not None and m.digest() == c2
    for rel, e in m.files.items():
        data = (snaps / checkpoint_name(2 * rt.cp) / rel).read_bytes()
        assert hashlib.sha256(data).digest() == e.sha256, rel
    assert (snaps / checkpoint_name(2 * rt.cp) / "f1").read_bytes() == b"v2 changed"
    assert rt.ckpt.builder.kept == {}  # taken by the checkpoint, not carried to the next


def test_stage_since_writes_what_it_is_given_and_copies_the_rest(tmp_path: Path) -> None:
    st = dirstore.DirStore(tmp_path / "store")
    (st.path / "a").write_bytes(b"a1")
    (st.path / "b").write_bytes(b"b1")
    st.snapshot("ckpt-1")
    (st.path / "a").write_bytes(b"a2")
    (st.path / "b").write_bytes(b"b2")
    finish = st.stage_since("ckpt-2", "ckpt-1", ["a", "b"], lambda rel: False, {"a": b"a2"})
    assert finish is not None
    (st.path / "a").write_bytes(b"a3: written after the stage, in no snapshot")
    finish()
    two = st.root / "snapshots" / "ckpt-2"
    assert (two / "a").read_bytes() == b"a2" and (two / "b").read_bytes() == b"b2"
