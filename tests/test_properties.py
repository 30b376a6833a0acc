# tests/test_properties.py - property tests (hypothesis) of what hostile peers reach in
# Python: controld's message intake and RPC dispatch (Daemon._on_message with any bytes, and
# authentic CONTROL requests with any JSON-ish body), and the snapshot file server's request
# handling (SnapshotFiles.read with any seq, path, offset and length). Each must answer with
# an error, never raise, and leave the state alone for what it refuses. Bounded and
# derandomized (docs/security.md "Fuzzing"): the same examples every run, no example
# database written, each test well under 20 s.
from __future__ import annotations

import asyncio
import itertools
import json
import math
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zz import keys, wire
from zz.config import ConfigError, load
from zz.controld.daemon import Daemon
from zz.controld.hypervisor import open_backend
from zz.controld.rpc import RACK_SERVICE
from zz.snapshots import open_store
from zz.snapshots.fileserve import LATER, MAX_CHUNK, OK, SnapshotFiles
from zz.snapshots.manifest import scan
from zz.snapshots.store import checkpoint_name

BOUNDED = settings(
    max_examples=150,
    deadline=None,  # a shared 2-core CI machine: timing is not the property
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

RACK = """\
[rack]
name = "prop"
[[hosts]]
name = "h0"
address = "127.0.0.1"
[[hosts]]
name = "h1"
address = "127.0.0.1"
[[services]]
name = "web"
id = 1
g = 1
f = 1
app = "kv"
clients = 1
base_port = 47000
sleep = "paused"
"""
OP = keys.operator_principal(0)


class Rig:
    """One controld (process backend, nothing provisioned) and operator 0's MAC key."""

    def __init__(self, root: Path) -> None:
        p = root / "rack.toml"
        p.write_text(RACK)
        self.config = load(p)
        keys.generate(self.config)
        self.host = self.config.hosts[0]
        self.principal = keys.controld_principal(self.host.index)
        ck = keys.load_controld(self.config.rack.key_dir, self.config, self.host.index)
        self.daemon = Daemon(self.config, self.host, open_backend("process"), ck, root / "controld")
        op = keys.load_secret(keys.secret_path(self.config.rack.key_dir, 0, OP))
        self.op_key = op.macs[self.principal]
        self.ids = itertools.count(1)

    def state(self) -> Any:
        d = self.daemon
        return [asdict(r) for r in d.inventory.replicas()], sorted(d.orphans, key=str)

    def handle(self, raw: bytes) -> tuple[bool, list[dict[str, Any]]]:
        """Feed one message to the daemon as its connection handler does; the replies."""
        out: list[bytes] = []

        async def send(frame: bytes) -> None:
            out.append(frame)

        async def run() -> bool:
            authed = await self.daemon._on_message(raw, send)
            while self.daemon._tasks:  # the operation a CONTROL started
                await asyncio.gather(*list(self.daemon._tasks))
            return authed

        authed = asyncio.run(run())
        replies = []
        for f in out:
            m = wire.decode(f[4:])
            assert isinstance(m, wire.ControlReply) and m.request_id is not None
            replies.append(json.loads(m.json))
        return authed, replies

    def control(self, body: bytes) -> bytes:
        m = wire.Control(RACK_SERVICE, OP, next(self.ids), body)
        return m.with_macs({self.principal: self.op_key}).encode()


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    root = Path(tempfile.mkdtemp(prefix="zz-prop-"))
    try:
        yield Rig(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# JSON-ish values: what json.loads can return (NaN and the infinities included), nested.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from(["web", "1", "", "active", "paused", "../x", "h0", "\x00"])
    | st.text(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
OPS = ["status", "list", "provision", "destroy", "forensics", "purge_forensics", "nope", ""]
FIELDS = ["service", "index", "mode", "inject_fault", "older_than_s", "role"]
requests = st.fixed_dictionaries(
    {"op": st.sampled_from(OPS) | values},
    optional={f: values for f in FIELDS},
)


def _names_a_service(rig: Rig, req: Any) -> bool:
    try:
        rig.config.service(req["service"])
        return True
    except (KeyError, TypeError, ConfigError):
        return False
    except Exception:  # anything else a lookup raises on odd values: not a real service
        return False


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


@BOUNDED
@given(raw=st.binary(max_size=300))
def test_any_bytes_are_refused_quietly(rig: Rig, raw: bytes) -> None:
    before = rig.state()
    errors = rig.daemon.counters["internal_error"]
    authed, replies = rig.handle(raw)
    assert not authed and replies == []
    assert rig.daemon.counters["internal_error"] == errors
    assert rig.state() == before


@BOUNDED
@given(
    body=st.one_of(
        requests.map(_dumps),
        values.map(_dumps),  # not an object
        st.binary(max_size=80),  # not JSON, not UTF-8
        st.integers(min_value=20, max_value=400).map(lambda n: b"[" * n + b"]" * n),  # deep
        st.integers(min_value=20, max_value=400).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    )
)
def test_control_request_always_gets_one_final_answer(rig: Rig, body: bytes) -> None:
    try:
        req = json.loads(body)
    except (ValueError, RecursionError):
        req = None
    # Never a request that would really provision or destroy: no service of the rack.
    hypothesis.assume(not (isinstance(req, dict) and _names_a_service(rig, req)))
    before = rig.state()
    errors = rig.daemon.counters["internal_error"]
    authed, replies = rig.handle(rig.control(body))
    assert authed
    finals = [r for r in replies if r.get("final") is True]
    assert len(finals) == 1 and replies[-1] is finals[0], replies
    final = finals[0]
    assert rig.daemon.counters["internal_error"] == errors, final
    assert "internal error" not in str(final.get("error", "")), final
    op = req.get("op") if isinstance(req, dict) else None
    if op not in ("status", "list", "forensics", "purge_forensics"):
        assert final["ok"] is False and isinstance(final.get("error"), str), final
    if op == "purge_forensics" and final["ok"]:
        age = req.get("older_than_s")
        assert isinstance(age, int | float) and not isinstance(age, bool), final
        assert math.isfinite(age) and age >= 0, final
    assert rig.state() == before


@BOUNDED
@given(body=requests.map(_dumps))
def test_a_replayed_request_id_is_refused(rig: Rig, body: bytes) -> None:
    raw = rig.control(b'{"op": "list"}')
    assert rig.handle(raw)[1][-1]["ok"] is True
    # the same id again, with another body: refused before the body is read
    m = wire.decode(raw)
    again = wire.Control(RACK_SERVICE, OP, m.request_id, body)
    _, replies = rig.handle(again.with_macs({rig.principal: rig.op_key}).encode())
    assert replies[-1]["ok"] is False and "reused" in replies[-1]["error"]


# ---- the snapshot file server ----


class Files:
    def __init__(self, root: Path) -> None:
        self.store = open_store("dir", root=root / "store")
        live = self.store.path
        (live / "d").mkdir()
        (live / "d" / "f").write_bytes(b"version one")
        (live / "top").write_bytes(bytes(range(256)) * 8)
        manifests = root / "manifests"
        manifests.mkdir()
        self.manifest = scan(live)
        (manifests / f"{checkpoint_name(8)}.manifest").write_bytes(self.manifest.encode())
        self.store.snapshot(checkpoint_name(8))
        self.sizes = {"": len(self.manifest.encode()), "d/f": 11, "top": 2048}
        (live / "d" / "f").write_bytes(b"changed after the checkpoint")
        (live / "secret").write_bytes(b"not in any manifest")
        self.files = SnapshotFiles(self.store, manifests)


@pytest.fixture(scope="module")
def files() -> Iterator[Files]:
    root = Path(tempfile.mkdtemp(prefix="zz-prop-files-"))
    f = Files(root)
    try:
        yield f
    finally:
        f.files.release()
        shutil.rmtree(root, ignore_errors=True)


paths = st.one_of(
    st.sampled_from(
        [
            "",
            "d/f",
            "top",
            "secret",
            "d",
            "d/",
            "/d/f",
            "d//f",
            "./top",
            "../x",
            "d/../top",
            "d/f\x00",
            "\x00",
            "top/",
            "TOP",
        ]
    ),
    st.text(max_size=24),
)
# What FILE-FETCH can carry (docs/wire.md): u64 seq and offset, u32 length.
u64 = st.integers(min_value=0, max_value=2**64 - 1)
offsets = st.one_of(
    st.integers(min_value=0, max_value=4096), u64, st.sampled_from([2**63 - 1, 2**63, 2**64 - 1])
)
lengths = st.one_of(
    st.integers(min_value=0, max_value=5000),
    st.integers(min_value=0, max_value=2**32 - 1),
    st.sampled_from([MAX_CHUNK, MAX_CHUNK + 1, 2**32 - 1]),
)
seqs = st.one_of(st.sampled_from([0, 4, 8, 9, 16, 2**63, 2**64 - 1]), u64)


@BOUNDED
@given(seq=seqs, path=paths, offset=offsets, length=lengths)
def test_file_server_answers_every_request_with_a_status(
    files: Files, seq: int, path: str, offset: int, length: int
) -> None:
    r = files.files.read(seq, path, offset, length)
    assert 0 <= r.status <= 5
    if r.status not in (OK, LATER):
        assert r.data == b"" and r.size == 0, r
        return
    # bytes only from the manifest of checkpoint 8 (LATER: asked for an earlier one that is
    # gone), at most what was asked for, and exactly the checkpoint's content (not what the
    # live directory holds now)
    assert (seq == 8 if r.status == OK else seq < 8) and path in files.sizes, (seq, path, r)
    assert r.size == files.sizes[path]
    assert len(r.data) <= min(length, MAX_CHUNK)
    expect = {
        "": files.manifest.encode(),
        "d/f": b"version one",
        "top": bytes(range(256)) * 8,
    }[path]
    assert r.data == expect[offset : offset + min(length, MAX_CHUNK)]
