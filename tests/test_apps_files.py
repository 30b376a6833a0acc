"""tests/test_apps_files.py - the files app (docs/files.md): op semantics and error cases, the
codec, read-only requests, determinism across replicas, exact incremental manifests, on-demand
fetch, and a seeded random sequence checked against a model."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from zz import fsop
from zz.execution.app import ExecContext
from zz.execution.apps import files
from zz.execution.registry import create_app
from zz.execution.state import StateDir
from zz.snapshots.manifest import ManifestBuilder, scan

T0 = 1_700_000_000_000
ROOT = fsop.ROOT_INO


class Fs:
    """One replica of the app on a temporary StateDir, with helpers that decode replies."""

    def __init__(self, root: Path, **opts: int) -> None:
        root.mkdir(parents=True)
        app = create_app("files", opts)
        assert isinstance(app, files.FilesApp)
        self.app = app
        self.state = StateDir(root)
        app.open(self.state)
        self.seq = 0

    def raw(self, op: bytes, read_only: bool = False) -> bytes:
        self.seq += 1
        ctx = ExecContext(self.seq, 7, self.seq, T0 + self.seq, 42, read_only)
        if read_only:
            with self.state.read_only():
                return self.app.execute(op, ctx)
        return self.app.execute(op, ctx)

    def do(self, op: bytes, read_only: bool | None = None) -> fsop.FsReply:
        ro = fsop.decode_op(op).read_only if read_only is None else read_only
        return fsop.decode_reply(op[0] if op else 0, self.raw(op, ro))

    def ok(self, op: bytes) -> fsop.FsReply:
        r = self.do(op)
        assert r.ok, (fsop.ERROR_NAMES.get(r.status), r.data)
        return r

    def err(self, op: bytes) -> int:
        r = self.do(op)
        assert not r.ok, "expected an error"
        return r.status

    def create(self, parent: int, name: bytes, mode: int = 0o644) -> fsop.Attr:
        a = self.ok(fsop.encode_create(parent, name, mode, 1000, 1000)).attr
        assert a is not None
        return a

    def mkdir(self, parent: int, name: bytes, mode: int = 0o755) -> fsop.Attr:
        a = self.ok(fsop.encode_mkdir(parent, name, mode, 1000, 1000)).attr
        assert a is not None
        return a

    def attr(self, ino: int) -> fsop.Attr:
        a = self.ok(fsop.encode_getattr(ino)).attr
        assert a is not None
        return a

    def lookup(self, parent: int, name: bytes) -> fsop.Attr:
        a = self.ok(fsop.encode_lookup(parent, name)).attr
        assert a is not None
        return a

    def names(self, ino: int, page: int = 1024) -> list[bytes]:
        out: list[bytes] = []
        after = b""
        while True:
            r = self.ok(fsop.encode_readdir(ino, after, page))
            out += [e.name for e in r.entries]
            if not r.more:
                return out
            after = r.entries[-1].name

    def read(self, ino: int, off: int = 0, size: int = 1 << 20) -> bytes:
        return self.ok(fsop.encode_read(ino, off, size)).data

    def write(self, ino: int, off: int, data: bytes) -> fsop.Attr:
        a = self.ok(fsop.encode_write(ino, off, data)).attr
        assert a is not None
        return a


@pytest.fixture
def fs(tmp_path: Path) -> Fs:
    return Fs(tmp_path / "s")


def test_empty_root_and_statfs(fs: Fs) -> None:
    root = fs.attr(ROOT)
    assert root.is_dir and root.mode == fsop.S_IFDIR | 0o755 and root.nlink == 2
    assert fs.names(ROOT) == []
    assert fs.lookup(ROOT, b".") == root and fs.lookup(ROOT, b"..") == root
    s = fs.ok(fsop.encode_statfs()).statfs
    assert s is not None and s.bsize == 4096 and s.namemax == 255
    assert s.blocks == s.bfree == (1 << 33) // 4096 and s.ffree == s.files - 1
    assert fs.state.listdir() == [], "reads write nothing"


def test_create_write_read_getattr(fs: Fs) -> None:
    a = fs.create(ROOT, b"hello.txt", 0o600)
    assert a.ino == 2 and a.mode == fsop.S_IFREG | 0o600 and a.nlink == 1 and a.size == 0
    assert (a.uid, a.gid) == (1000, 1000)
    assert a.mtime_ns == a.ctime_ns == a.atime_ns == (T0 + 1) * 1_000_000
    w = fs.write(a.ino, 0, b"hello world")
    assert w.size == 11 and w.mtime_ns == (T0 + 2) * 1_000_000
    assert fs.read(a.ino) == b"hello world"
    assert fs.read(a.ino, 6, 3) == b"wor"
    assert fs.read(a.ino, 11) == b"" and fs.read(a.ino, 99) == b""
    # A write past the end leaves a hole of zeros.
    assert fs.write(a.ino, 20, b"!").size == 21
    assert fs.read(a.ino) == b"hello world" + bytes(9) + b"!"
    assert fs.lookup(ROOT, b"hello.txt") == fs.attr(a.ino)
    assert fs.names(ROOT) == [b"hello.txt"]
    st = fs.ok(fsop.encode_statfs()).statfs
    assert st is not None and st.ffree == st.files - 2 and st.bfree == st.blocks - 1


def test_setattr_size_mode_owner_times(fs: Fs) -> None:
    a = fs.create(ROOT, b"f")
    fs.write(a.ino, 0, b"abcdef")
    r = fs.ok(fsop.encode_setattr(a.ino, fsop.SET_SIZE, size=3)).attr
    assert r is not None and r.size == 3 and fs.read(a.ino) == b"abc"
    fs.ok(fsop.encode_setattr(a.ino, fsop.SET_SIZE, size=6))
    assert fs.read(a.ino) == b"abc\0\0\0", "extending fills with zeros"
    fs.ok(fsop.encode_setattr(a.ino, fsop.SET_SIZE, size=0))
    assert fs.read(a.ino) == b"" and not fs.state.exists(files.data_path(a.ino))
    v = fsop.SET_MODE | fsop.SET_UID | fsop.SET_GID | fsop.SET_ATIME | fsop.SET_MTIME
    r = fs.ok(fsop.encode_setattr(a.ino, v, 0o4750, 5, 6, 0, 111, 222)).attr
    assert r is not None and r.mode == fsop.S_IFREG | 0o4750 and (r.uid, r.gid) == (5, 6)
    assert (r.atime_ns, r.mtime_ns) == (111, 222) and r.ctime_ns == (T0 + fs.seq) * 1_000_000
    # The type bits cannot change; a directory has no size to set.
    assert fs.err(fsop.encode_setattr(a.ino, fsop.SET_MODE, mode=fsop.S_IFDIR | 0o755)) == (
        fsop.EINVAL
    )
    assert fs.err(fsop.encode_setattr(ROOT, fsop.SET_SIZE, size=1)) == fsop.EISDIR


def test_directories_and_nlink(fs: Fs) -> None:
    d = fs.mkdir(ROOT, b"d")
    assert d.nlink == 2 and fs.attr(ROOT).nlink == 3
    e = fs.mkdir(d.ino, b"e")
    assert fs.attr(d.ino).nlink == 3
    assert fs.lookup(e.ino, b"..") == fs.attr(d.ino)
    fs.create(e.ino, b"x")
    assert fs.err(fsop.encode_rmdir(d.ino, b"e")) == fsop.ENOTEMPTY
    fs.ok(fsop.encode_unlink(e.ino, b"x"))
    fs.ok(fsop.encode_rmdir(d.ino, b"e"))
    assert fs.attr(d.ino).nlink == 2 and fs.names(d.ino) == []
    assert fs.err(fsop.encode_getattr(e.ino)) == fsop.ESTALE
    fs.ok(fsop.encode_rmdir(ROOT, b"d"))
    assert fs.attr(ROOT).nlink == 2


def test_error_cases(fs: Fs) -> None:
    f = fs.create(ROOT, b"f")
    d = fs.mkdir(ROOT, b"d")
    assert fs.err(fsop.encode_lookup(ROOT, b"missing")) == fsop.ENOENT
    assert fs.err(fsop.encode_unlink(ROOT, b"missing")) == fsop.ENOENT
    assert fs.err(fsop.encode_rmdir(ROOT, b"missing")) == fsop.ENOENT
    assert fs.err(fsop.encode_rename(ROOT, b"missing", ROOT, b"x")) == fsop.ENOENT
    assert fs.err(fsop.encode_create(ROOT, b"f", 0o644, 0, 0)) == fsop.EEXIST
    assert fs.err(fsop.encode_mkdir(ROOT, b"d", 0o755, 0, 0)) == fsop.EEXIST
    assert fs.err(fsop.encode_mkdir(ROOT, b"f", 0o755, 0, 0)) == fsop.EEXIST
    assert fs.err(fsop.encode_link(f.ino, ROOT, b"d")) == fsop.EEXIST
    assert fs.err(fsop.encode_unlink(ROOT, b"d")) == fsop.EISDIR
    assert fs.err(fsop.encode_read(d.ino, 0, 10)) == fsop.EISDIR
    assert fs.err(fsop.encode_write(d.ino, 0, b"x")) == fsop.EISDIR
    assert fs.err(fsop.encode_rmdir(ROOT, b"f")) == fsop.ENOTDIR
    assert fs.err(fsop.encode_lookup(f.ino, b"x")) == fsop.ENOTDIR
    assert fs.err(fsop.encode_create(f.ino, b"x", 0o644, 0, 0)) == fsop.ENOTDIR
    assert fs.err(fsop.encode_readdir(f.ino)) == fsop.ENOTDIR
    assert fs.err(fsop.encode_link(d.ino, ROOT, b"d2")) == fsop.EPERM
    assert fs.err(fsop.encode_readlink(f.ino)) == fsop.EINVAL
    assert fs.err(fsop.encode_getattr(999)) == fsop.ESTALE
    assert fs.err(fsop.encode_getattr(0)) == fsop.ESTALE
    assert fs.err(fsop.encode_create(ROOT, b"fifo", fsop.S_IFMT & 0o010000, 0, 0)) == fsop.EPERM
    # Names: length, '/', NUL, '.', '..' and the empty name.
    assert fs.err(fsop.encode_create(ROOT, b"n" * 256, 0o644, 0, 0)) == fsop.ENAMETOOLONG
    assert fs.err(fsop.encode_lookup(ROOT, b"n" * 256)) == fsop.ENAMETOOLONG
    fs.create(ROOT, b"n" * 255)
    for bad in (b"a/b", b"../etc", b"a\0b", b"/"):
        assert fs.err(fsop.encode_create(ROOT, bad, 0o644, 0, 0)) == fsop.EINVAL, bad
        assert fs.err(fsop.encode_lookup(ROOT, bad)) == fsop.EINVAL, bad
    assert fs.err(fsop.encode_create(ROOT, b"", 0o644, 0, 0)) == fsop.ENOENT
    assert fs.err(fsop.encode_mkdir(ROOT, b"..", 0o755, 0, 0)) == fsop.EEXIST
    assert fs.err(fsop.encode_create(ROOT, b".", 0o644, 0, 0)) == fsop.EEXIST
    assert fs.err(fsop.encode_rmdir(ROOT, b".")) == fsop.EINVAL
    assert fs.err(fsop.encode_rmdir(ROOT, b"..")) == fsop.ENOTEMPTY
    assert fs.err(fsop.encode_unlink(ROOT, b"..")) == fsop.EISDIR
    assert fs.err(fsop.encode_rename(ROOT, b"..", ROOT, b"x")) == fsop.EINVAL
    assert fs.err(fsop.encode_rename(ROOT, b"f", ROOT, b"a/b")) == fsop.EINVAL
    assert fs.err(fsop.encode_symlink(ROOT, b"s", b"", 0, 0)) == fsop.EINVAL
    assert fs.err(fsop.encode_symlink(ROOT, b"s", b"x" * 4097, 0, 0)) == fsop.ENAMETOOLONG
    assert fs.err(fsop.encode_readdir(ROOT, b"", 0)) == fsop.EINVAL
    # No name ever reaches the state directory: traversal names stay names.
    paths = [str(p.relative_to(fs.state.root)) for p in fs.state.root.rglob("*") if p.is_file()]
    assert paths and all(p == "fs/super" or p.startswith("fs/i/") for p in paths), paths


def test_errors_change_nothing(fs: Fs) -> None:
    d = fs.mkdir(ROOT, b"d")
    fs.create(d.ino, b"x")
    fs.state.sync()
    fs.state.take_dirty()
    before = {p: p.read_bytes() for p in fs.state.root.rglob("*") if p.is_file()}
    for op in (
        fsop.encode_rmdir(ROOT, b"d"),
        fsop.encode_rename(ROOT, b"d", d.ino, b"inside"),
        fsop.encode_create(d.ino, b"x", 0o644, 0, 0),
        fsop.encode_write(d.ino, 0, b"data"),
        b"\x63garbage",
        b"",
        fsop.encode_getattr(2)[:-1],
        fsop.encode_getattr(2) + b"\0",
    ):
        assert not fs.do(op, read_only=False).ok
    assert not fs.state.take_dirty()
    assert {p: p.read_bytes() for p in fs.state.root.rglob("*") if p.is_file()} == before


def test_malformed_ops_are_eproto_replies(fs: Fs) -> None:
    for op in (b"", b"\x00", b"\x63", fsop.encode_lookup(ROOT, b"x")[:-1]):
        r = fsop.decode_reply(op[0] if op else 0, fs.raw(op))
        assert r.status == fsop.EPROTO and r.data
    bad_valid = bytearray(fsop.encode_setattr(ROOT, 0))
    bad_valid[9:13] = (64).to_bytes(4, "big")
    assert fs.do(bytes(bad_valid), read_only=False).status == fsop.EPROTO


def test_read_only_requests(fs: Fs) -> None:
    fs.create(ROOT, b"f")
    # A write op sent read-only is refused and writes nothing; a read runs read-only.
    op = fsop.encode_create(ROOT, b"g", 0o644, 0, 0)
    assert fs.app.is_read_only(op) is False
    assert fs.do(op, read_only=True).status == fsop.EROFS
    assert fs.names(ROOT) == [b"f"]
    for op in (
        fsop.encode_lookup(ROOT, b"f"),
        fsop.encode_getattr(ROOT),
        fsop.encode_read(2, 0, 1),
        fsop.encode_readdir(ROOT),
        fsop.encode_readlink(2),
        fsop.encode_statfs(),
    ):
        assert fs.app.is_read_only(op), op
    assert fs.do(fsop.encode_lookup(ROOT, b"f"), read_only=True).ok
    assert not fs.app.is_read_only(b"\xff")


def test_rename_semantics(fs: Fs) -> None:
    a = fs.mkdir(ROOT, b"a")
    b = fs.mkdir(a.ino, b"b")
    f = fs.create(ROOT, b"f")
    g = fs.create(ROOT, b"g")
    fs.write(g.ino, 0, b"g's data")
    # A directory cannot move below itself.
    assert fs.err(fsop.encode_rename(ROOT, b"a", b.ino, b"a")) == fsop.EINVAL
    assert fs.err(fsop.encode_rename(ROOT, b"a", a.ino, b"x")) == fsop.EINVAL
    # Replacing: a file by a file (the old one is freed), dir/non-dir mismatches.
    fs.ok(fsop.encode_rename(ROOT, b"g", ROOT, b"f"))
    assert fs.names(ROOT) == [b"a", b"f"] and fs.lookup(ROOT, b"f").ino == g.ino
    assert fs.err(fsop.encode_getattr(f.ino)) == fsop.ESTALE
    assert fs.read(g.ino) == b"g's data"
    assert fs.err(fsop.encode_rename(ROOT, b"f", ROOT, b"a")) == fsop.EISDIR
    assert fs.err(fsop.encode_rename(a.ino, b"b", ROOT, b"f")) == fsop.ENOTDIR
    fs.create(b.ino, b"inner")
    c = fs.mkdir(ROOT, b"c")
    assert fs.err(fsop.encode_rename(ROOT, b"c", a.ino, b"b")) == fsop.ENOTEMPTY
    # Moving a directory across parents fixes the link counts and '..'.
    fs.ok(fsop.encode_rename(a.ino, b"b", c.ino, b"b2"))
    assert fs.attr(a.ino).nlink == 2 and fs.attr(c.ino).nlink == 3
    assert fs.lookup(b.ino, b"..").ino == c.ino
    # Replacing an empty directory.
    e = fs.mkdir(ROOT, b"e")
    fs.ok(fsop.encode_rename(ROOT, b"e", c.ino, b"b3"))
    assert fs.attr(ROOT).nlink == 4 and fs.attr(c.ino).nlink == 4
    fs.ok(fsop.encode_rename(c.ino, b"b3", a.ino, b"x"))
    empty = fs.mkdir(ROOT, b"empty")
    fs.ok(fsop.encode_rename(a.ino, b"x", ROOT, b"empty"))
    assert fs.err(fsop.encode_getattr(empty.ino)) == fsop.ESTALE
    assert fs.lookup(ROOT, b"empty").ino == e.ino and fs.attr(ROOT).nlink == 5
    # NOREPLACE and EXCHANGE.
    h = fs.create(ROOT, b"h")
    assert fs.err(fsop.encode_rename(ROOT, b"h", ROOT, b"f", fsop.RENAME_NOREPLACE)) == (
        fsop.EEXIST
    )
    fs.ok(fsop.encode_rename(ROOT, b"h", c.ino, b"h", fsop.RENAME_NOREPLACE))
    fs.ok(fsop.encode_rename(c.ino, b"h", ROOT, b"empty", fsop.RENAME_EXCHANGE))
    assert fs.lookup(ROOT, b"empty").ino == h.ino and fs.lookup(c.ino, b"h").ino == e.ino
    assert fs.lookup(e.ino, b"..").ino == c.ino and fs.attr(c.ino).nlink == 4
    assert fs.err(fsop.encode_rename(ROOT, b"f", ROOT, b"zz", fsop.RENAME_EXCHANGE)) == (
        fsop.ENOENT
    )
    assert fs.err(fsop.encode_rename(ROOT, b"f", ROOT, b"zz", 3)) == fsop.EINVAL
    # Renaming onto another name of the same inode does nothing.
    fs.ok(fsop.encode_link(g.ino, ROOT, b"g2"))
    fs.ok(fsop.encode_rename(ROOT, b"f", ROOT, b"g2"))
    assert fs.lookup(ROOT, b"f").ino == fs.lookup(ROOT, b"g2").ino == g.ino


def test_links_symlinks_and_unlink(fs: Fs) -> None:
    f = fs.create(ROOT, b"f")
    fs.write(f.ino, 0, b"data")
    assert fs.ok(fsop.encode_link(f.ino, ROOT, b"f2")).attr.nlink == 2  # type: ignore[union-attr]
    fs.ok(fsop.encode_unlink(ROOT, b"f"))
    assert fs.attr(f.ino).nlink == 1 and fs.read(f.ino) == b"data"
    fs.ok(fsop.encode_unlink(ROOT, b"f2"))
    assert fs.err(fsop.encode_getattr(f.ino)) == fsop.ESTALE
    assert not fs.state.exists(files.inode_path(f.ino))
    assert not fs.state.exists(files.data_path(f.ino))
    s = fs.ok(fsop.encode_symlink(ROOT, b"s", b"../some/where", 3, 4)).attr
    assert s is not None and s.is_symlink and s.size == 13 and s.mode & 0o777 == 0o777
    assert fs.ok(fsop.encode_readlink(s.ino)).data == b"../some/where"
    assert fs.err(fsop.encode_read(s.ino, 0, 1)) == fsop.EINVAL
    assert fs.err(fsop.encode_setattr(s.ino, fsop.SET_SIZE, size=1)) == fsop.EINVAL
    st = fs.ok(fsop.encode_statfs()).statfs
    assert st is not None and st.ffree == st.files - 2


def test_readdir_pages_in_name_order(fs: Fs) -> None:
    names = [f"n{i:03d}".encode() for i in range(50)]
    for n in reversed(names):
        fs.create(ROOT, n)
    assert fs.names(ROOT, page=7) == names
    r = fs.ok(fsop.encode_readdir(ROOT, b"n047", 10))
    assert [e.name for e in r.entries] == names[48:] and not r.more
    assert [e.attr for e in r.entries] == [fs.lookup(ROOT, n) for n in names[48:]]


def test_limits(tmp_path: Path) -> None:
    fs = Fs(tmp_path / "s", max_bytes=100, max_inodes=3, max_file_size=60, max_io=4096)
    a = fs.create(ROOT, b"a")
    assert fs.err(fsop.encode_write(a.ino, 60, b"x")) == fsop.EFBIG
    assert fs.err(fsop.encode_setattr(a.ino, fsop.SET_SIZE, size=61)) == fsop.EFBIG
    fs.write(a.ino, 0, b"x" * 60)
    b = fs.create(ROOT, b"b")
    assert fs.err(fsop.encode_write(b.ino, 0, b"y" * 41)) == fsop.ENOSPC
    fs.write(b.ino, 0, b"y" * 40)
    assert fs.err(fsop.encode_create(ROOT, b"c", 0o644, 0, 0)) == fsop.ENOSPC
    assert fs.err(fsop.encode_read(a.ino, 0, 4097)) == fsop.EINVAL
    assert fs.err(fsop.encode_write(a.ino, 0, bytes(4097))) == fsop.EINVAL
    fs.ok(fsop.encode_unlink(ROOT, b"a"))
    fs.create(ROOT, b"c")
    st = fs.ok(fsop.encode_statfs()).statfs
    assert st is not None and st.ffree == 0


def test_setgid_directory_passes_its_group_on(fs: Fs) -> None:
    d = fs.mkdir(ROOT, b"d", 0o2775)
    fs.ok(fsop.encode_setattr(d.ino, fsop.SET_GID, gid=50))
    f = fs.ok(fsop.encode_create(d.ino, b"f", 0o644, 1, 1)).attr
    sub = fs.ok(fsop.encode_mkdir(d.ino, b"sub", 0o755, 1, 1)).attr
    assert f is not None and sub is not None and f.gid == sub.gid == 50
    assert sub.mode & 0o2000 and not f.mode & 0o2000


def test_codec_roundtrip_and_vectors() -> None:
    ops = [
        fsop.encode_lookup(1, b"x"),
        fsop.encode_setattr(2, fsop.SET_ALL, 0o644, 1, 2, 3, 4, 5),
        fsop.encode_create(1, b"f", 0o644, 0, 0),
        fsop.encode_symlink(1, b"s", b"t", 0, 0),
        fsop.encode_read(2, 10, 20),
        fsop.encode_write(2, 10, b"abc"),
        fsop.encode_rename(1, b"a", 3, b"b", fsop.RENAME_NOREPLACE),
        fsop.encode_link(2, 1, b"l"),
        fsop.encode_readdir(1, b"after", 5),
        fsop.encode_statfs(),
    ]
    for op in ops:
        assert fsop.decode_op(op).code == op[0]
    # The test vectors of docs/files.md.
    assert fsop.encode_lookup(1, b"a").hex() == "01" "0000000000000001" "00000001" "61"
    assert fsop.encode_write(2, 3, b"hi").hex() == (
        "09" "0000000000000002" "0000000000000003" "00000002" "6869"
    )
    attr = fsop.Attr(2, fsop.S_IFREG | 0o644, 1, 0, 0, 2, 5, 6, 7)
    assert fsop.encode_reply(fsop.GETATTR, fsop.FsReply(fsop.OK, attr=attr)).hex() == (
        "0000" "0000000000000002" "000081a4" "00000001" "00000000" "00000000"
        "0000000000000002" "0000000000000005" "0000000000000006" "0000000000000007"
    )  # fmt: skip
    assert fsop.encode_reply(fsop.LOOKUP, fsop.error(fsop.ENOENT, "no")).hex() == (
        "0002" "00000002" "6e6f"
    )  # fmt: skip
    rd = fsop.FsReply(fsop.OK, entries=(fsop.DirEntry(b"a", attr),), more=True)
    assert fsop.decode_reply(fsop.READDIR, fsop.encode_reply(fsop.READDIR, rd)) == rd
    with pytest.raises(fsop.FsDecodeError, match="unknown status"):
        fsop.decode_reply(fsop.GETATTR, b"\x03\xe7\0\0\0\0")
    with pytest.raises(fsop.FsDecodeError, match="trailing"):
        fsop.decode_reply(fsop.UNLINK, b"\0\0\0")


# ---- determinism, checkpoints, on-demand fetch, and a model --------------------------------


def _random_ops(rng: random.Random, n: int) -> list[bytes]:
    """Ops over a small namespace of inode numbers and names, valid or not."""
    names = [b"a", b"b", b"c", b"d"]
    ops = []
    for _ in range(n):
        ino = rng.randrange(1, 12)
        name = rng.choice(names)
        k = rng.randrange(10)
        if k == 0:
            ops.append(fsop.encode_create(ino, name, 0o644, 0, 0))
        elif k == 1:
            ops.append(fsop.encode_mkdir(ino, name, 0o755, 0, 0))
        elif k == 2:
            ops.append(fsop.encode_write(ino, rng.randrange(0, 9000), rng.randbytes(200)))
        elif k == 3:
            ops.append(fsop.encode_setattr(ino, fsop.SET_SIZE, size=rng.randrange(0, 5000)))
        elif k == 4:
            ops.append(fsop.encode_unlink(ino, name))
        elif k == 5:
            ops.append(fsop.encode_rmdir(ino, name))
        elif k == 6:
            ops.append(fsop.encode_rename(ino, name, rng.randrange(1, 12), rng.choice(names)))
        elif k == 7:
            ops.append(fsop.encode_link(ino, rng.randrange(1, 12), name))
        elif k == 8:
            ops.append(fsop.encode_symlink(ino, name, b"t" * rng.randrange(1, 20), 0, 0))
        else:
            ops.append(fsop.encode_read(ino, rng.randrange(0, 9000), 300))
    return ops


def test_two_replicas_agree_and_manifests_are_exact(tmp_path: Path) -> None:
    a, b = Fs(tmp_path / "a"), Fs(tmp_path / "b")
    builder = ManifestBuilder(a.state.root)
    builder.build()
    rng = random.Random(18)
    for round_ in range(20):
        for op in _random_ops(rng, 25):
            assert a.raw(op) == b.raw(op)
        a.state.sync()
        dirty = a.state.take_dirty()
        builder.mark_all_dirty(dirty.written | dirty.deleted)
        prev = builder.previous
        assert builder.build() == scan(a.state.root, previous=prev), f"round {round_}"
    files_a = {p.relative_to(a.state.root): p.read_bytes() for p in a.state.root.rglob("*")
               if p.is_file()}  # fmt: skip
    files_b = {p.relative_to(b.state.root): p.read_bytes() for p in b.state.root.rglob("*")
               if p.is_file()}  # fmt: skip
    assert files_a == files_b and len(files_a) > 5


class _Pending:
    """A LazyState: `files` are certified but not on disk until ensure() fetches them."""

    def __init__(self, root: Path, files: dict[str, bytes]) -> None:
        self.root = root
        self.files = dict(files)
        self.fetched: list[str] = []

    def ensure(self, rel: str) -> bool:
        if rel in self.files:
            p = self.root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(self.files.pop(rel))
            self.fetched.append(rel)
        return True

    def ensure_under(self, rel: str) -> int:
        under = [f for f in self.files if f == rel or f.startswith(rel + "/")]
        for f in under:
            self.ensure(f)
        return len(under)

    def forget(self, rel: str) -> None:
        self.files.pop(rel, None)

    def is_pending(self, rel: str) -> bool:
        return rel in self.files

    def pending_names(self, directory: str) -> set[str]:
        prefix = directory + "/" if directory else ""
        return {f[len(prefix) :].split("/")[0] for f in self.files if f.startswith(prefix)}

    def dir_pending(self, rel: str) -> bool:
        return any(f.startswith(rel + "/") for f in self.files)

    def forget_dir(self, rel: str) -> None:
        pass

    def pending_under(self, rel: str) -> list[str]:  # as snapshots/fetch.py: rel included
        return sorted(f for f in self.files if f == rel or f.startswith(rel + "/"))


def _recovering(tmp_path: Path, src: Fs) -> tuple[Fs, _Pending]:
    """A replica recovering to src's state: every file of it pending (fetched on touch)."""
    certified = {
        str(p.relative_to(src.state.root)): p.read_bytes()
        for p in src.state.root.rglob("*")
        if p.is_file()
    }
    root = tmp_path / "rec"
    root.mkdir()
    lazy = _Pending(root, certified)
    app = create_app("files")
    rec = Fs.__new__(Fs)
    rec.app, rec.state, rec.seq = app, StateDir(root, lazy=lazy), src.seq  # type: ignore[assignment]
    app.open(rec.state)
    return rec, lazy


def test_recovering_replica_fetches_only_what_a_request_needs(tmp_path: Path) -> None:
    """On-demand fetch (ZZ §4.5, §4.7.2): metadata requests fetch the small inode files,
    never a file's data; a truncate to zero and an unlink drop the data unfetched."""
    src = Fs(tmp_path / "src")
    f = src.create(ROOT, b"big")
    src.write(f.ino, 0, b"x" * 50_000)
    g = src.create(ROOT, b"other")
    src.write(g.ino, 0, b"y" * 1000)
    rec, lazy = _recovering(tmp_path, src)
    assert rec.lookup(ROOT, b"big").size == 50_000
    assert rec.names(ROOT) == [b"big", b"other"]
    assert files.data_path(f.ino) not in lazy.fetched
    rec.ok(fsop.encode_setattr(f.ino, fsop.SET_SIZE, size=0))
    rec.ok(fsop.encode_unlink(ROOT, b"other"))
    assert not any(p.startswith("fs/d/") for p in lazy.fetched), lazy.fetched
    assert not lazy.is_pending(files.data_path(f.ino))
    assert not lazy.is_pending(files.data_path(g.ino))
    rec.write(f.ino, 0, b"new")
    assert rec.read(f.ino) == b"new"


def test_random_sequence_matches_a_model(fs: Fs) -> None:
    """fsx in miniature: writes at random offsets, truncates, reads checked byte for byte."""
    rng = random.Random(7)
    ino = fs.create(ROOT, b"f").ino
    model = bytearray()
    for _ in range(400):
        k = rng.randrange(4)
        if k == 0:
            off = rng.randrange(0, 70_000)
            data = rng.randbytes(rng.randrange(1, 9000))
            fs.write(ino, off, data)
            if off > len(model):
                model += bytes(off - len(model))
            model[off : off + len(data)] = data
        elif k == 1:
            size = rng.randrange(0, 70_000)
            fs.ok(fsop.encode_setattr(ino, fsop.SET_SIZE, size=size))
            model = model[:size] + bytearray(max(0, size - len(model)))
        else:
            off = rng.randrange(0, 80_000)
            n = rng.randrange(1, 20_000)
            assert fs.read(ino, off, n) == bytes(model[off : off + n])
        assert fs.attr(ino).size == len(model)


def test_recovering_replica_write_into_a_pending_file_keeps_the_rest(tmp_path: Path) -> None:
    """A WRITE in the middle of a file not fetched yet (StateDir.write_at) fetches it first:
    the bytes around the range are the certified ones, not zeros."""
    src = Fs(tmp_path / "src")
    f = src.create(ROOT, b"big")
    src.write(f.ino, 0, b"x" * 50_000)
    rec, lazy = _recovering(tmp_path, src)
    rec.write(f.ino, 20_000, b"new")
    assert files.data_path(f.ino) in lazy.fetched
    assert rec.read(f.ino) == b"x" * 20_000 + b"new" + b"x" * 29_997
