"""tests/test_apps_state.py - StateDir: path confinement, dirty tracking, sync, read-only mode.
The checkpoint manifest trusts the dirty set: a missed write here is a silent divergence."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from zz.execution.state import (
    DirtySet,
    ReadOnlyStateError,
    StateDir,
    StateError,
    normalize,
)
from zz.snapshots.manifest import ManifestBuilder, scan


@pytest.fixture
def state(tmp_path: Path) -> StateDir:
    root = tmp_path / "state"
    root.mkdir()
    return StateDir(root)


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("a", "a"),
        ("a/b", "a/b"),
        ("./a//b/./c", "a/b/c"),
        ("a/", "a"),
        ("dir/.hidden", "dir/.hidden"),
    ],
)
def test_normalize_canonical_form(raw: str, norm: str) -> None:
    assert normalize(raw) == norm


@pytest.mark.parametrize(
    "bad", ["", ".", "/etc/passwd", "../x", "a/../../x", "a/..", "a\\b", "a\x00b", "./"]
)
def test_normalize_rejects(bad: str) -> None:
    with pytest.raises(StateError):
        normalize(bad)


def test_escape_attempts_touch_nothing_outside(state: StateDir, tmp_path: Path) -> None:
    for bad in ("../outside", "/tmp/outside", "a/../../outside"):
        with pytest.raises(StateError):
            state.write_bytes(bad, b"x")
        with pytest.raises(StateError):
            state.open(bad, "w")
    assert not (tmp_path / "outside").exists()
    assert state.take_dirty() == DirtySet(frozenset(), frozenset())


def test_symlinks_refused(state: StateDir, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    os.symlink(outside, state.root / "link")
    os.symlink(outside / "secret", state.root / "filelink")
    with pytest.raises(StateError, match="symlink"):
        state.read_bytes("link/secret")
    with pytest.raises(StateError, match="symlink"):
        state.write_bytes("link/new", b"x")
    with pytest.raises(StateError, match="symlink"):
        state.read_bytes("filelink")
    with pytest.raises(StateError, match="symlink"):
        state.rename("filelink", "other")
    assert not (outside / "new").exists()


def test_write_read_exists_listdir(state: StateDir) -> None:
    state.write_bytes("b/2", b"two")
    state.write_bytes("b/1", b"one")
    state.makedirs("empty/dir")
    assert state.read_bytes("b/1") == b"one"
    assert state.exists("b/2") and not state.exists("b/3")
    assert state.listdir() == ["b", "empty"]
    assert state.listdir("b") == ["1", "2"]
    assert state.is_dir("empty/dir")


def test_dirty_tracks_writes_and_resets(state: StateDir) -> None:
    state.write_bytes("a", b"1")
    with state.open("d/b.txt", "w") as f:
        f.write("héllo")
    with state.open("a", "rb") as f:  # a read does not dirty anything new
        assert f.read() == b"1"
    assert (state.root / "d/b.txt").read_bytes() == "héllo".encode()
    assert state.take_dirty() == DirtySet(frozenset({"a", "d/b.txt"}), frozenset())
    assert not state.take_dirty()
    with state.open("a", "rb") as f:
        f.read()
    assert not state.take_dirty()
    with state.open("a", "ab") as f:
        f.write(b"2")
    assert state.take_dirty().written == {"a"}


def test_delete_and_rewrite(state: StateDir) -> None:
    state.write_bytes("x", b"1")
    state.take_dirty()
    state.delete("x")
    assert state.take_dirty() == DirtySet(frozenset(), frozenset({"x"}))
    state.write_bytes("x", b"2")
    state.delete("x")
    state.write_bytes("x", b"3")
    # Last action wins, and the two sets stay disjoint.
    assert state.take_dirty() == DirtySet(frozenset({"x"}), frozenset())
    with pytest.raises(StateError, match="does not exist"):
        state.delete("nope")


def test_rename_is_delete_plus_write(state: StateDir) -> None:
    state.write_bytes("tmp/new", b"v2")
    state.write_bytes("data", b"v1")
    state.take_dirty()
    state.rename("tmp/new", "data")
    assert state.read_bytes("data") == b"v2"
    assert state.take_dirty() == DirtySet(frozenset({"data"}), frozenset({"tmp/new"}))


def test_rename_and_delete_directories_cover_every_file(state: StateDir) -> None:
    state.write_bytes("d/a", b"a")
    state.write_bytes("d/sub/b", b"b")
    state.take_dirty()
    state.rename("d", "e/d2")
    dirty = state.take_dirty()
    assert dirty.written == {"e/d2/a", "e/d2/sub/b"}
    assert dirty.deleted == {"d/a", "d/sub/b"}
    with pytest.raises(StateError, match="into itself"):
        state.rename("e", "e/inner")
    state.delete("e")
    assert state.take_dirty() == DirtySet(frozenset(), frozenset({"e/d2/a", "e/d2/sub/b"}))
    assert state.listdir() == []


def test_sync_closes_writers(state: StateDir) -> None:
    f = state.open("log", "wb")
    f.write(b"pending")
    state.sync()
    assert f.closed
    assert (state.root / "log").read_bytes() == b"pending"
    reader = state.open("log", "rb")
    state.sync()  # readers are not the checkpoint's business
    assert not reader.closed
    reader.close()


def test_read_only_blocks_every_write(state: StateDir) -> None:
    state.write_bytes("k", b"v")
    state.take_dirty()
    with state.read_only():
        assert state.is_read_only
        assert state.read_bytes("k") == b"v"
        for attempt in (
            lambda: state.write_bytes("k", b"w"),
            lambda: state.open("k", "r+b"),
            lambda: state.delete("k"),
            lambda: state.rename("k", "k2"),
            lambda: state.makedirs("d"),
        ):
            with pytest.raises(ReadOnlyStateError):
                attempt()
    assert not state.is_read_only
    assert state.read_bytes("k") == b"v"
    assert not state.take_dirty()


def test_bad_mode_and_directory_write(state: StateDir) -> None:
    state.makedirs("d")
    with pytest.raises(StateError):
        state.open("f", "wq")
    with pytest.raises(StateError, match="directory"):
        state.open("d", "wb")


def test_reserved_and_unrecordable_paths(state: StateDir) -> None:
    for bad in (".zz", ".zz/memory", "./.zz/x", "a\udcff", "x" * 5000):
        with pytest.raises(StateError):
            state.write_bytes(bad, b"x")
    (state.root / ".zz").mkdir()  # the runtime's directory
    (state.root / ".zz" / "memory").write_bytes(b"m")
    state.write_bytes("sub/.zz", b"only the top-level name is reserved")
    assert state.listdir() == ["sub"]


def test_dirty_set_drives_an_exact_incremental_manifest(state: StateDir) -> None:
    # The manifest builder re-hashes only what take_dirty() reports; after a random
    # workload its result must equal a full scan, or a checkpoint would certify the
    # wrong digest.
    rng = random.Random(99)
    builder = ManifestBuilder(state.root)
    builder.build()  # first build is a full scan (empty directory)
    names = ["a", "b", "d/x", "d/y", "d/e/z", "f/g"]
    for round_ in range(30):
        for _ in range(8):
            action = rng.randrange(4)
            p = rng.choice(names)
            try:
                if action == 0:
                    state.write_bytes(p, rng.randbytes(rng.randrange(0, 64)))
                elif action == 1 and state.exists(p):
                    state.delete(rng.choice([p, p.split("/")[0]]))
                elif action == 2 and state.exists(p):
                    state.rename(p, rng.choice(names))
                elif action == 3:
                    with state.open(p, "ab") as f:
                        f.write(b"+")
            except (StateError, OSError):
                pass  # e.g. a file where a directory is needed: skipped, like a failed app op
        state.sync()
        dirty = state.take_dirty()
        builder.mark_all_dirty(dirty.written | dirty.deleted)
        prev = builder.previous
        incremental = builder.build()
        full = scan(state.root, previous=prev)
        assert incremental == full, f"round {round_}: dirty set {dirty} missed a change"


def test_write_at_keeps_the_rest_and_makes_parents(state: StateDir) -> None:
    state.write_at("d/e/f", 3, b"xyz")
    assert state.read_bytes("d/e/f") == b"\0\0\0xyz"
    state.take_dirty()
    state.write_at("d/e/f", 1, b"AB")
    assert state.read_bytes("d/e/f") == b"\0ABxyz"
    assert state.take_dirty().written == {"d/e/f"}
    state.makedirs("dir")
    with pytest.raises(StateError, match="directory"):
        state.write_at("dir", 0, b"x")
    with state.read_only(), pytest.raises(ReadOnlyStateError):
        state.write_at("d/e/f", 0, b"x")
    assert state.read_bytes("d/e/f") == b"\0ABxyz"


def test_symlink_planted_where_a_known_directory_was(state: StateDir, tmp_path: Path) -> None:
    """Directories seen once are not lstat'ed again; a delete or rename forgets them, so
    a symlink that takes a directory's name afterwards is still refused."""
    outside = tmp_path / "outside"
    outside.mkdir()
    state.write_bytes("a/b/f", b"1")
    assert state.read_bytes("a/b/f") == b"1"
    state.rename("a", "gone")
    os.symlink(outside, state.root / "a")
    for attempt in (
        lambda: state.write_bytes("a/b/f", b"x"),
        lambda: state.write_at("a/f", 0, b"x"),
        lambda: state.read_bytes("a/f"),
    ):
        with pytest.raises(StateError, match="symlink"):
            attempt()
    state.write_bytes("c/d/f", b"1")
    state.delete("c/d")
    os.symlink(outside, state.root / "c" / "d")
    with pytest.raises(StateError, match="symlink"):
        state.write_at("c/d/f", 0, b"x")
    os.symlink(outside / "t", state.root / "gone" / "b" / "l")
    with pytest.raises(StateError, match="symlink"):
        state.write_at("gone/b/l", 0, b"x")  # the last component is always checked
    assert list(outside.iterdir()) == []


def test_buffered_writes_reach_the_files_once_and_reads_see_them(tmp_path: Path) -> None:
    """A replayed run of certified batches keeps whole-file writes in memory
    (StateDir.buffer_writes, ZZ §4.7.2 "apply the writes"): the app reads what it wrote,
    the file is written at the flush, and every call that looks at the directory flushes
    first, so the app sees what it would have without the buffer."""
    st = StateDir(tmp_path)
    st.write_bytes("kv/a", b"old")
    st.buffer_writes()
    st.write_bytes("kv/a", b"one")
    st.write_bytes("kv/a", b"two")
    st.write_bytes("kv/b/c", b"new")
    assert (tmp_path / "kv/a").read_bytes() == b"old" and not (tmp_path / "kv/b").exists()
    assert st.read_bytes("kv/a") == b"two" and st.exists("kv/b/c")
    assert st.listdir("kv") == ["a", "b"]  # flushed first
    assert (tmp_path / "kv/b/c").read_bytes() == b"new"
    st.write_bytes("kv/a", b"three")
    st.sync()  # a checkpoint's: everything written, and no more buffering
    assert (tmp_path / "kv/a").read_bytes() == b"three" and not st.buffering
    st.write_bytes("kv/a", b"four")
    assert (tmp_path / "kv/a").read_bytes() == b"four"
    assert st.take_dirty().written == {"kv/a", "kv/b/c"}
