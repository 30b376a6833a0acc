"""tests/test_apps_kv.py - the kv app: op semantics, codec errors, read-only, determinism.
Two replicas fed the same ops must end with identical replies and identical state files."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from zz import kvop
from zz.execution.app import ExecContext
from zz.execution.apps import kv
from zz.execution.registry import create_app
from zz.execution.state import StateDir


def _ctx(seq: int = 1, read_only: bool = False) -> ExecContext:
    return ExecContext(
        seq=seq, client=7, timestamp=seq, time_ms=1_700_000_000_000, seed=42, read_only=read_only
    )


def _open(root: Path, **opts: int) -> tuple[kv.KvApp, StateDir]:
    root.mkdir(parents=True)
    app = create_app("kv", opts)
    assert isinstance(app, kv.KvApp)
    state = StateDir(root)
    app.open(state)
    return app, state


def _run(app: kv.KvApp, op: bytes, seq: int = 1, read_only: bool = False) -> kvop.KvReply:
    return kvop.decode_reply(app.execute(op, _ctx(seq, read_only)))


def test_put_get_delete(tmp_path: Path) -> None:
    app, state = _open(tmp_path / "s")
    assert _run(app, kvop.encode_get(b"k")) == kvop.KvReply(kvop.NOT_FOUND)
    assert _run(app, kvop.encode_put(b"k", b"v1")).ok
    assert _run(app, kvop.encode_get(b"k")) == kvop.KvReply(kvop.OK, b"v1")
    assert _run(app, kvop.encode_put(b"k", b"")).ok  # empty value is a value, not absence
    assert _run(app, kvop.encode_get(b"k")) == kvop.KvReply(kvop.OK, b"")
    assert _run(app, kvop.encode_delete(b"k")).ok
    assert _run(app, kvop.encode_delete(b"k")).status == kvop.NOT_FOUND
    assert _run(app, kvop.encode_get(b"k")).status == kvop.NOT_FOUND
    dirty = state.take_dirty()
    assert dirty.deleted == {kv.key_path(b"k")} and not dirty.written


def test_cas(tmp_path: Path) -> None:
    app, _ = _open(tmp_path / "s")
    # expected=None means "only if absent": a create-once primitive.
    assert _run(app, kvop.encode_cas(b"c", None, b"1")).ok
    r = _run(app, kvop.encode_cas(b"c", None, b"2"))
    assert r == kvop.KvReply(kvop.CAS_MISMATCH, b"1", present=True)
    assert _run(app, kvop.encode_cas(b"c", b"1", b"2")).ok
    assert _run(app, kvop.encode_cas(b"c", b"1", b"3")) == kvop.KvReply(kvop.CAS_MISMATCH, b"2")
    assert _run(app, kvop.encode_get(b"c")).value == b"2"
    r = _run(app, kvop.encode_cas(b"absent", b"x", b"y"))
    assert r == kvop.KvReply(kvop.CAS_MISMATCH, b"", present=False)


def test_append_and_limits(tmp_path: Path) -> None:
    app, _ = _open(tmp_path / "s", max_key=4, max_value=6)
    assert _run(app, kvop.encode_append(b"a", b"abc")).ok
    assert _run(app, kvop.encode_append(b"a", b"def")).ok
    assert _run(app, kvop.encode_get(b"a")).value == b"abcdef"
    assert _run(app, kvop.encode_append(b"a", b"g")).status == kvop.TOO_LARGE
    assert _run(app, kvop.encode_get(b"a")).value == b"abcdef"
    assert _run(app, kvop.encode_put(b"toolong", b"")).status == kvop.TOO_LARGE


def test_state_files_hold_the_data(tmp_path: Path) -> None:
    app, state = _open(tmp_path / "s")
    _run(app, kvop.encode_put(b"user:1", b"alice"))
    path = kv.key_path(b"user:1")
    assert path.startswith("kv/") and state.exists(path)
    assert state.take_dirty().written == {path}
    # A fresh instance on the same directory (a restarted replica) sees the data.
    again = create_app("kv")
    again.open(StateDir(state.root))
    assert kvop.decode_reply(again.execute(kvop.encode_get(b"user:1"), _ctx())).value == b"alice"


@pytest.mark.parametrize(
    "op",
    [
        b"",
        b"\x09",
        bytes([kvop.GET]),
        bytes([kvop.GET]) + b"\x00\x00\x00\x05ab",
        kvop.encode_get(b"k") + b"x",
        bytes([kvop.CAS]) + b"\x00\x00\x00\x01k" + b"\x02" + b"\x00" * 8,
        bytes([kvop.CAS]) + b"\x00\x00\x00\x01k" + b"\x00\x00\x00\x00\x01e\x00\x00\x00\x00",
    ],
)
def test_malformed_ops_get_bad_op_reply(tmp_path: Path, op: bytes) -> None:
    app, state = _open(tmp_path / "s")
    r = _run(app, op)
    assert r.status == kvop.BAD_OP and r.value
    assert not state.take_dirty()


def test_read_only(tmp_path: Path) -> None:
    app, state = _open(tmp_path / "s")
    _run(app, kvop.encode_put(b"k", b"v"))
    state.take_dirty()
    assert app.is_read_only(kvop.encode_get(b"k"))
    assert not app.is_read_only(kvop.encode_put(b"k", b"v"))
    with state.read_only():
        assert _run(app, kvop.encode_get(b"k"), read_only=True).value == b"v"
        assert _run(app, kvop.encode_put(b"k", b"w"), read_only=True).status == kvop.READ_ONLY
    assert _run(app, kvop.encode_get(b"k")).value == b"v"
    assert not state.take_dirty()


def test_reply_codec_round_trip() -> None:
    for r in (
        kvop.KvReply(kvop.OK, b"value"),
        kvop.KvReply(kvop.NOT_FOUND),
        kvop.KvReply(kvop.CAS_MISMATCH, b"", present=False),
        kvop.KvReply(kvop.BAD_OP, b"msg"),
    ):
        assert kvop.decode_reply(r.encode()) == r
    with pytest.raises(kvop.KvDecodeError):
        kvop.decode_reply(b"\x63\x00\x00\x00\x00")
    with pytest.raises(kvop.KvDecodeError):
        kvop.decode_reply(kvop.KvReply(kvop.OK, b"v").encode() + b"!")


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_two_replicas_agree(tmp_path: Path) -> None:
    rng = random.Random(1234)
    keys = [f"key{i}".encode() for i in range(25)]
    ops = []
    for _ in range(600):
        k = rng.choice(keys)
        v = rng.randbytes(rng.randrange(0, 40))
        ops.append(
            rng.choice(
                [
                    kvop.encode_get(k),
                    kvop.encode_put(k, v),
                    kvop.encode_delete(k),
                    kvop.encode_append(k, v),
                    kvop.encode_cas(k, rng.choice([None, b"", v]), v),
                ]
            )
        )
    a, sa = _open(tmp_path / "a")
    b, sb = _open(tmp_path / "b")
    replies_a = [a.execute(op, _ctx(i + 1)) for i, op in enumerate(ops)]
    replies_b = [b.execute(op, _ctx(i + 1)) for i, op in enumerate(ops)]
    assert replies_a == replies_b
    assert _tree(sa.root) == _tree(sb.root)
    assert len(_tree(sa.root)) > 5  # the workload left data behind: the check compares something
    assert sa.take_dirty() == sb.take_dirty()
    # A replica that missed one write must be caught by the same comparison.
    c, sc = _open(tmp_path / "c")
    for i, op in enumerate(ops[:-1]):
        c.execute(op, _ctx(i + 1))
    last = ops[-1]
    c.execute(kvop.encode_put(b"key0", b"diverged"), _ctx(len(ops)))
    a_last = a.execute(kvop.encode_get(b"key0"), _ctx(len(ops) + 1))
    c_last = c.execute(kvop.encode_get(b"key0"), _ctx(len(ops) + 1))
    assert last != kvop.encode_put(b"key0", b"diverged")
    assert a_last != c_last and _tree(sc.root) != _tree(sa.root)


class _Pending:
    """A LazyState of a replica still fetching: `files` are pending; what is fetched is
    recorded (and written) on first touch."""

    def __init__(self, root: Path, files: dict[str, bytes]) -> None:
        self.root, self.files, self.fetched = root, dict(files), []

    def ensure(self, rel: str) -> bool:
        if rel not in self.files:
            return False
        self.fetched.append(rel)
        (self.root / rel).parent.mkdir(parents=True, exist_ok=True)
        (self.root / rel).write_bytes(self.files.pop(rel))
        return True

    def ensure_under(self, rel: str) -> int:
        return sum(self.ensure(f) for f in [f for f in self.files if f.startswith(rel + "/")])

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

    def pending_under(self, rel: str) -> list[str]:
        return [f for f in self.files if f.startswith(rel + "/")]

    def __bool__(self) -> bool:
        return bool(self.files)


def test_put_is_applied_without_reading_the_old_value(tmp_path: Path) -> None:
    """ZZ §4.7.2: a PUT carries the key's whole new state. A recovering replica applies it
    without fetching the file it overwrites; APPEND and CAS need the old value, and fetch."""
    root = tmp_path / "s"
    root.mkdir()
    old = {kv.key_path(k): kv._field(k) + b"old" for k in (b"a", b"b", b"c")}
    lazy = _Pending(root, old)
    app = create_app("kv")
    app.open(StateDir(root, lazy=lazy))  # type: ignore[arg-type]
    assert _run(app, kvop.encode_put(b"a", b"new")) == kvop.KvReply(kvop.OK)
    assert lazy.fetched == [] and not lazy.is_pending(kv.key_path(b"a"))
    assert _run(app, kvop.encode_get(b"a")).value == b"new"
    assert _run(app, kvop.encode_append(b"b", b"+")) == kvop.KvReply(kvop.OK)
    assert _run(app, kvop.encode_cas(b"c", b"old", b"x")) == kvop.KvReply(kvop.OK)
    assert lazy.fetched == [kv.key_path(b"b"), kv.key_path(b"c")]
    assert _run(app, kvop.encode_get(b"b")).value == b"old+"
    # The limit still holds, and a too-large PUT leaves the pending file alone.
    small = create_app("kv", {"max_value": 4})
    lazy2 = _Pending(tmp_path, {})
    small.open(StateDir(root, lazy=lazy2))  # type: ignore[arg-type]
    assert kvop.decode_reply(small.execute(kvop.encode_put(b"a", b"12345"), _ctx())).status == (
        kvop.TOO_LARGE
    )
