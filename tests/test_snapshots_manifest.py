# tests/test_snapshots_manifest.py - per-file hash manifests: encoding, incremental vs full scan.
# Runs on tmp_path directories only; the storage backends have their own test files.
from __future__ import annotations

import hashlib
import os
import random
import socket
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from zz.snapshots.manifest import (
    MEMORY_PATH,
    FileEntry,
    Manifest,
    ManifestBuilder,
    ManifestError,
    hash_file,
    normalize_path,
    scan,
)


class CountingHasher:
    """Real hash_file, counting which paths it hashed."""

    def __init__(self) -> None:
        self.calls: list[Path] = []

    def __call__(self, path: Path) -> FileEntry:
        self.calls.append(path)
        return hash_file(path)


def sha(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def test_encoding_is_the_documented_bytes() -> None:
    # Built by hand from docs/checkpoints.md, independently of Manifest.encode.
    m = Manifest({"b": FileEntry(3, sha(b"abc")), "a/x": FileEntry(0, sha(b""))}, frozenset({"c"}))
    expect = b"ZZMF" + bytes([1, 0, 0, 0]) + struct.pack(">I", 3)
    expect += struct.pack(">I", 3) + b"a/x" + b"\x01" + struct.pack(">Q", 0) + sha(b"")
    expect += struct.pack(">I", 1) + b"b" + b"\x01" + struct.pack(">Q", 3) + sha(b"abc")
    expect += struct.pack(">I", 1) + b"c" + b"\x00"
    assert m.encode() == expect
    assert m.digest() == hashlib.sha256(expect).digest()
    assert Manifest.decode(expect) == m


def test_sorted_by_utf8_bytes_and_insertion_order_irrelevant() -> None:
    names = ["z", "é", "a-b", "a/b", "a", "Z", "ä/x"]
    e = FileEntry(1, sha(b"x"))
    m1 = Manifest({n: e for n in names})
    m2 = Manifest({n: e for n in reversed(names)})
    assert m1.encode() == m2.encode()
    dec = Manifest.decode(m1.encode())
    assert list(sorted(dec.files, key=lambda s: s.encode())) == sorted(
        names, key=lambda s: s.encode()
    )
    # "a-b" (0x2d) sorts before "a/b" (0x2f) in bytes.
    enc = m1.encode()
    assert enc.index(b"a-b") < enc.index(b"a/b")


def test_empty_manifest() -> None:
    m = Manifest()
    assert m.encode() == b"ZZMF\x01\x00\x00\x00\x00\x00\x00\x00"
    assert Manifest.decode(m.encode()) == m


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b[:-1],  # truncated
        lambda b: b + b"\x00",  # trailing byte
        lambda b: b"ZZMX" + b[4:],  # magic
        lambda b: b[:4] + b"\x02" + b[5:],  # version
        lambda b: b[:5] + b"\x01" + b[6:],  # reserved byte
    ],
)
def test_decode_rejects_malformed(mutate: Callable[[bytes], bytes]) -> None:
    good = Manifest({"a": FileEntry(1, sha(b"a"))}, frozenset({"b"})).encode()
    Manifest.decode(good)
    with pytest.raises(ManifestError):
        Manifest.decode(mutate(good))


def _entry(path: bytes, kind: int = 0) -> bytes:
    return struct.pack(">I", len(path)) + path + bytes([kind])


@pytest.mark.parametrize(
    "entries",
    [
        [_entry(b"b"), _entry(b"a")],  # unsorted
        [_entry(b"a"), _entry(b"a")],  # duplicate
        [_entry(b"a//b")],  # not canonical
        [_entry(b"../a")],
        [_entry(b"/a")],
        [_entry(b"\xff")],  # not UTF-8
        [_entry(b"a", kind=7)],
    ],
)
def test_decode_rejects_non_canonical(entries: list[bytes]) -> None:
    data = b"ZZMF\x01\x00\x00\x00" + struct.pack(">I", len(entries)) + b"".join(entries)
    with pytest.raises(ManifestError):
        Manifest.decode(data)


def test_present_and_deleted_is_an_error() -> None:
    with pytest.raises(ManifestError):
        Manifest({"a": FileEntry(0, sha(b""))}, frozenset({"a"}))


@pytest.mark.parametrize(
    ("raw", "norm"), [("a", "a"), ("./a//b/", "a/b"), ("a/./b", "a/b"), ("é/ü", "é/ü")]
)
def test_normalize_path(raw: str, norm: str) -> None:
    assert normalize_path(raw) == norm


@pytest.mark.parametrize("bad", ["", ".", "/a", "a/../b", "..", "a\0b", "a\\b", "\udcff"])
def test_bad_paths_rejected(bad: str, tmp_path: Path) -> None:
    with pytest.raises(ManifestError):
        normalize_path(bad)
    with pytest.raises(ManifestError):
        ManifestBuilder(tmp_path, Manifest()).mark_dirty(bad)


def test_reserved_dir_rejected_for_app(tmp_path: Path) -> None:
    b = ManifestBuilder(tmp_path, Manifest())
    with pytest.raises(ManifestError, match="reserved"):
        b.mark_dirty(".zz/memory")


def test_hash_file_matches_hashlib(tmp_path: Path) -> None:
    data = os.urandom(3 * (1 << 20) + 17)  # spans several read chunks
    (tmp_path / "f").write_bytes(data)
    assert hash_file(tmp_path / "f") == FileEntry(len(data), sha(data))


def test_symlinks_and_specials_rejected(tmp_path: Path) -> None:
    (tmp_path / "real").write_text("x")
    (tmp_path / "link").symlink_to("real")
    with pytest.raises(ManifestError, match="symbolic link"):
        scan(tmp_path)
    with pytest.raises(ManifestError, match="symbolic link"):
        hash_file(tmp_path / "link")
    b = ManifestBuilder(tmp_path, Manifest())
    b.mark_dirty("link")
    with pytest.raises(ManifestError, match="symbolic link"):
        b.build()
    (tmp_path / "link").unlink()

    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ManifestError, match="fifo"):
        scan(tmp_path)
    (tmp_path / "fifo").unlink()

    # A socket path must be short: bind inside tmp_path via a relative name.
    cwd = os.getcwd()
    s = socket.socket(socket.AF_UNIX)
    try:
        os.chdir(tmp_path)
        s.bind("sock")
    finally:
        os.chdir(cwd)
    try:
        with pytest.raises(ManifestError, match="socket"):
            scan(tmp_path)
    finally:
        s.close()
        (tmp_path / "sock").unlink()
    assert set(scan(tmp_path).files) == {"real"}


def test_symlinked_directory_ancestor_rejected(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    state = tmp_path / "state"
    state.mkdir()
    (state / "d").symlink_to(outside)
    b = ManifestBuilder(state, Manifest())
    b.mark_dirty("d/secret")  # the app did not report "d" itself
    with pytest.raises(ManifestError, match="symbolic link"):
        b.build()


def test_tombstones_last_one_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("1")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("2")
    (tmp_path / "d" / "y").write_text("3")
    b = ManifestBuilder(tmp_path)
    m0 = b.build()
    assert set(m0.files) == {"a", "d/x", "d/y"} and not m0.deleted

    (tmp_path / "a").unlink()
    (tmp_path / "d" / "x").unlink()
    (tmp_path / "d" / "y").unlink()
    (tmp_path / "d").rmdir()
    (tmp_path / "new").write_text("n")
    (tmp_path / "new").unlink()  # created and deleted within one interval: no tombstone
    b.mark_all_dirty(["a", "d", "new"])
    m1 = b.build()
    assert m1.files == {}
    assert m1.deleted == {"a", "d/x", "d/y"}
    assert m1 == scan(tmp_path, m0)

    m2 = b.build()  # nothing dirty: tombstones are not carried over
    assert m2 == Manifest()


def test_only_dirty_files_rehashed(tmp_path: Path) -> None:
    for i in range(50):
        (tmp_path / f"f{i}").write_bytes(os.urandom(100))
    h = CountingHasher()
    b = ManifestBuilder(tmp_path, hasher=h)
    m0 = b.build()
    assert len(h.calls) == 50
    h.calls.clear()

    (tmp_path / "f3").write_bytes(b"changed")
    (tmp_path / "f7").unlink()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "g").write_bytes(b"g")
    b.mark_all_dirty(["f3", "f7", "sub/g"])
    m = b.build()
    assert sorted(p.name for p in h.calls) == ["f3", "g"]
    assert m.files["f3"] == FileEntry(7, sha(b"changed"))
    assert m.deleted == {"f7"}
    assert m == scan(tmp_path, m0)


def test_memory_state_is_a_file_of_the_manifest(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("1")
    b = ManifestBuilder(tmp_path)
    b.write_memory(b"counter=1")
    m1 = b.build()
    assert m1.files[MEMORY_PATH] == FileEntry(9, sha(b"counter=1"))
    b.write_memory(b"counter=2")
    m2 = b.build()
    assert m2.files[MEMORY_PATH] == FileEntry(9, sha(b"counter=2"))
    assert m1.digest() != m2.digest()
    assert m2 == scan(tmp_path, m1)
    assert not (tmp_path / ".zz" / "memory.tmp").exists()


def test_runtime_files_only_under_the_reserved_dir(tmp_path: Path) -> None:
    b = ManifestBuilder(tmp_path)
    b.write_runtime_file(".zz/replies", b"r1")
    assert b.build().files[".zz/replies"] == FileEntry(2, sha(b"r1"))
    for bad in ("replies", ".zz", "../.zz/x", "/abs/.zz/x"):
        with pytest.raises(ManifestError):
            b.write_runtime_file(bad, b"x")
    assert not (tmp_path / "replies").exists()


def test_directory_replaced_by_file_and_back(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("x")
    b = ManifestBuilder(tmp_path)
    m0 = b.build()
    (tmp_path / "a" / "x").unlink()
    (tmp_path / "a").rmdir()
    (tmp_path / "a").write_text("file now")
    b.mark_dirty("a")
    m1 = b.build()
    assert m1 == scan(tmp_path, m0) and set(m1.files) == {"a"} and m1.deleted == {"a/x"}
    (tmp_path / "a").unlink()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "y").write_text("y")
    b.mark_dirty("a/y")  # only the new file reported: the file "a" must still go
    m2 = b.build()
    assert m2 == scan(tmp_path, m1) and set(m2.files) == {"a/y"} and m2.deleted == {"a"}


def _random_ops(root: Path, rng: random.Random, b: ManifestBuilder, n: int) -> None:
    """Random writes, creates, deletes, file and directory renames, reported to b."""
    dirs = ["", "d1", "d1/d2", "d3"]
    for _ in range(n):
        existing = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        existing = [p for p in existing if not p.startswith(".zz")]
        op = rng.choice(["write", "write", "create", "delete", "rename", "rename_dir", "mem"])
        if op in ("write", "delete", "rename") and not existing:
            op = "create"
        if op == "write":
            p = rng.choice(existing)
            with open(root / p, "r+b" if rng.random() < 0.5 else "wb") as f:
                f.write(os.urandom(rng.randrange(0, 300)))
            b.mark_dirty(p)
        elif op == "create":
            d = rng.choice(dirs)
            p = f"{d}/n{rng.randrange(10**6)}" if d else f"n{rng.randrange(10**6)}"
            (root / p).parent.mkdir(parents=True, exist_ok=True)
            (root / p).write_bytes(os.urandom(rng.randrange(0, 300)))
            b.mark_dirty(p)
        elif op == "delete":
            p = rng.choice(existing)
            (root / p).unlink()
            b.mark_dirty(p)
        elif op == "rename":
            p = rng.choice(existing)
            d = rng.choice(dirs)
            q = f"{d}/r{rng.randrange(10**6)}" if d else f"r{rng.randrange(10**6)}"
            (root / q).parent.mkdir(parents=True, exist_ok=True)
            os.replace(root / p, root / q)
            b.mark_renamed(p, q)
        elif op == "rename_dir":
            src = rng.choice(["d1", "d1/d2", "d3"])
            dst = rng.choice(["d3", "d4", "d1/d2"])
            if (root / src).is_dir() and not (root / dst).exists() and not dst.startswith(src):
                (root / dst).parent.mkdir(parents=True, exist_ok=True)
                os.rename(root / src, root / dst)
                b.mark_renamed(src, dst)  # a directory rename is reported once, as names
        else:
            b.write_memory(os.urandom(rng.randrange(0, 100)))


@pytest.mark.parametrize("seed", range(8))
def test_incremental_equals_full_scan_after_random_ops(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    b = ManifestBuilder(tmp_path)
    prev = b.build()
    for _ in range(6):
        _random_ops(tmp_path, rng, b, rng.randrange(1, 40))
        inc = b.build()
        full = scan(tmp_path, prev)
        assert inc == full
        assert inc.encode() == full.encode() and inc.digest() == full.digest()
        prev = inc


def test_incomplete_dirty_set_is_caught_by_scan(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("1")
    b = ManifestBuilder(tmp_path)
    m0 = b.build()
    (tmp_path / "a").write_text("2")  # not reported
    assert b.build() != scan(tmp_path, m0)


# ---- decoding against a known manifest (a recovering replica's own last one) -----------


def _h(x: object) -> bytes:
    return hashlib.sha256(repr(x).encode()).digest()


def _random_pair(rnd: random.Random) -> tuple[Manifest, Manifest]:
    """A manifest and a successor: some files changed, added, removed (with tombstones)."""
    a = {
        f"d{rnd.randint(0, 3)}/f{rnd.randint(0, 60)}": FileEntry(
            rnd.randint(0, 9), _h(rnd.random())
        )
        for _ in range(rnd.randint(0, 40))
    }
    old = Manifest(a, frozenset(f"d9/g{i}" for i in range(rnd.randint(0, 3))))
    b = dict(a)
    for _ in range(rnd.randint(0, 5)):
        op = rnd.random()
        if op < 0.4 and b:
            b.pop(rnd.choice(sorted(b)))
        elif op < 0.7:
            b[f"d{rnd.randint(0, 4)}/f{rnd.randint(0, 70)}"] = FileEntry(1, _h(rnd.random()))
        elif b:
            k = rnd.choice(sorted(b))
            b[k] = FileEntry(b[k].size, _h(rnd.random()))
    gone = frozenset(p for p in a if p not in b) if rnd.random() < 0.5 else frozenset()
    return old, Manifest(b, gone)


@pytest.mark.parametrize("seed", range(6))
def test_decode_like_a_known_manifest_is_the_plain_decode(seed: int) -> None:
    rnd = random.Random(seed)
    for _ in range(100):
        old, new = _random_pair(rnd)
        enc = new.encode()
        plain = Manifest.decode(enc)
        for like in (old, Manifest.decode(old.encode()), new, Manifest(), plain):
            got = Manifest.decode(enc, like=like)
            assert got == new and got.encode() == enc
            assert list(got.files) == list(plain.files)  # same (sorted) order
            # Its layout serves the next decode like any other.
            assert Manifest.decode(old.encode(), like=got) == old


@pytest.mark.parametrize("seed", range(4))
def test_decode_like_refuses_what_the_plain_decode_refuses(seed: int) -> None:
    rnd = random.Random(100 + seed)
    for _ in range(100):
        old, new = _random_pair(rnd)
        enc = bytearray(new.encode())
        if len(enc) <= 12:
            continue
        for _ in range(4):  # flip a bit, cut, or duplicate a span: same verdict, same result
            bad = bytearray(enc)
            what = rnd.random()
            i = rnd.randrange(12, len(bad))
            if what < 0.6:
                bad[i] ^= 1 << rnd.randrange(8)
            elif what < 0.8:
                del bad[i:]
            else:
                bad[i:i] = bad[i : i + rnd.randint(1, 50)]
            try:
                plain: Manifest | Exception = Manifest.decode(bytes(bad))
            except ManifestError as e:
                plain = e
            try:
                got: Manifest | Exception = Manifest.decode(bytes(bad), like=old)
            except ManifestError as e:
                got = e
            if isinstance(plain, Exception):
                assert isinstance(got, ManifestError) and str(got) == str(plain)
            else:
                assert got == plain and list(got.files) == list(plain.files)  # type: ignore[union-attr]


def _decode_counting(
    monkeypatch: pytest.MonkeyPatch, new: Manifest, like: Manifest
) -> tuple[Manifest, list[int]]:
    """Manifest.decode(new's encoding, like=like), and the entry counts it parsed."""
    import zz.snapshots.manifest as mf

    parsed: list[int] = []
    real = mf._parse_entries

    def counting(data: bytes, off: int, count: int, *rest: object) -> int:
        parsed.append(count)
        return real(data, off, count, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(mf, "_parse_entries", counting)
    got = Manifest.decode(new.encode(), like=like)
    monkeypatch.undo()
    assert got == new and list(got.files) == list(Manifest.decode(new.encode()).files)
    return got, parsed


def test_decode_like_parses_only_what_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    # 10,000 files, one rewritten and one added (the length changes): the entries between
    # them are parsed, the leading and trailing ones are taken.
    files = {f"objects/{i:05d}": FileEntry(100, _h(i)) for i in range(10_000)}
    new = Manifest(
        {**files, "objects/00010": FileEntry(7, _h("x")), "objects/00020x": FileEntry(7, _h("y"))}
    )
    _, parsed = _decode_counting(monkeypatch, new, Manifest(files))
    assert parsed and sum(parsed) <= 12, parsed  # objects/00010 .. objects/00020x


def test_decode_like_parses_only_entries_rewritten_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Files rewritten in place (same paths, same encoded length) far apart, as a best-case
    # recovery sees them (.zz/replies at the start, one object in the middle).
    files = {f"objects/{i:05d}": FileEntry(100, _h(i)) for i in range(10_000)}
    files[".zz/replies"] = FileEntry(5, _h("r"))
    new = Manifest(
        {**files, ".zz/replies": FileEntry(6, _h("r2")), "objects/05000": FileEntry(1, _h(0))}
    )
    _, parsed = _decode_counting(monkeypatch, new, Manifest(files))
    # Differences are located to 64-byte spans: a neighbour of a changed entry may be
    # parsed too, never more than a few per change.
    assert set(parsed) == {1} and len(parsed) <= 6, parsed
