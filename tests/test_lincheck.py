# tests/test_lincheck.py - tools/lincheck (Porcupine) verdicts on hand-made kv histories,
# and zz.history's recorder over an in-process kv app (correct and deliberately stale).
from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from zz import history as zh
from zz import kvop
from zz.client import ClientTimeout
from zz.execution.app import ExecContext
from zz.execution.apps import kv
from zz.execution.state import StateDir
from zz.history import History, HistoryRecorder, Op, Output

pytestmark = pytest.mark.skipif(
    shutil.which("go") is None and "ZZ_LINCHECK" not in os.environ,
    reason="no Go toolchain: run scripts/setup-go.sh",
)


def op(
    client: int,
    call: int,
    ret: int | None,
    kind: str,
    key: bytes,
    value: bytes | None = None,
    out: Output | None = None,
    expected: bytes | None = None,
) -> Op:
    return Op(client, call, kind, key, value, expected, ret, out)


OK = Output("ok")
NF = Output("not_found")


def got(v: bytes) -> Output:
    return Output("ok", v)


def verdict(*ops: Op, **kw: Any) -> zh.Verdict:
    return zh.check(History(list(ops)), **kw)


# ---- hand-made histories -------------------------------------------------------------------


def test_sequential_history_of_every_op_is_linearizable() -> None:
    v = verdict(
        op(0, 0, 1, "get", b"k", out=NF),
        op(0, 2, 3, "put", b"k", b"a", OK),
        op(0, 4, 5, "append", b"k", b"b", OK),
        op(0, 6, 7, "get", b"k", out=got(b"ab")),
        op(0, 8, 9, "cas", b"k", b"c", OK, expected=b"ab"),
        op(0, 10, 11, "cas", b"k", b"d", Output("mismatch", b"c", True), expected=b"ab"),
        op(0, 12, 13, "delete", b"k", out=OK),
        op(0, 14, 15, "delete", b"k", out=NF),
        op(0, 16, 17, "cas", b"k", b"e", OK),  # expected None: iff absent
        op(0, 18, 19, "cas", b"k", b"f", Output("mismatch", b"e", True)),
        op(0, 20, 21, "get", b"k", out=got(b"e")),
    )
    assert v.linearizable and v.result == "Ok"
    assert (v.operations, v.pending, v.keys, v.bad_keys) == (11, 0, 1, [])


def test_stale_read_after_completed_write_is_not_linearizable() -> None:
    v = verdict(
        op(0, 0, 10, "put", b"x", b"1", OK),
        op(0, 20, 30, "put", b"x", b"2", OK),
        op(1, 40, 50, "get", b"x", out=got(b"1")),  # x = 2 was acknowledged at 30
    )
    assert not v.linearizable and v.result == "Illegal"
    assert v.bad_keys == [b"x"]


def test_read_overlapping_a_write_may_see_either_value() -> None:
    for seen in (b"1", b"2"):
        v = verdict(
            op(0, 0, 10, "put", b"x", b"1", OK),
            op(0, 20, 40, "put", b"x", b"2", OK),
            op(1, 30, 50, "get", b"x", out=got(seen)),
        )
        assert v.linearizable, seen


def test_reads_cannot_go_back_in_time() -> None:
    # Both reads overlap the write, but once one saw the new value a later one cannot
    # see the old one.
    v = verdict(
        op(0, 0, 10, "put", b"x", b"1", OK),
        op(0, 20, 100, "put", b"x", b"2", OK),
        op(1, 30, 40, "get", b"x", out=got(b"2")),
        op(2, 50, 60, "get", b"x", out=got(b"1")),
    )
    assert not v.linearizable


def test_value_never_written_is_not_linearizable() -> None:
    v = verdict(op(0, 0, 10, "put", b"x", b"1", OK), op(1, 5, 15, "get", b"x", out=got(b"9")))
    assert not v.linearizable


def test_closed_intervals_touching_ops_are_concurrent() -> None:
    # Porcupine reads [call, return] as closed: a get calling at the put's return time
    # may still be ordered before it.
    v = verdict(op(0, 0, 10, "put", b"x", b"1", OK), op(1, 10, 20, "get", b"x", out=NF))
    assert v.linearizable
    v = verdict(op(0, 0, 10, "put", b"x", b"1", OK), op(1, 11, 20, "get", b"x", out=NF))
    assert not v.linearizable


def test_pending_write_may_or_may_not_take_effect() -> None:
    pending_put = op(0, 0, None, "put", b"x", b"1")
    assert verdict(pending_put, op(1, 50, 60, "get", b"x", out=got(b"1"))).linearizable
    assert verdict(pending_put, op(1, 50, 60, "get", b"x", out=NF)).linearizable
    # ... but it takes effect at most once, at one point in time.
    v = verdict(
        pending_put,
        op(1, 50, 60, "get", b"x", out=got(b"1")),
        op(1, 70, 80, "get", b"x", out=NF),
    )
    assert not v.linearizable and v.pending == 1


def test_cas_outcomes_must_match_the_state() -> None:
    put = op(0, 0, 1, "put", b"x", b"a", OK)
    # Succeeding although the value differs.
    assert not verdict(put, op(0, 2, 3, "cas", b"x", b"c", OK, expected=b"b")).linearizable
    # Failing although the value matches.
    miss = Output("mismatch", b"a", True)
    assert not verdict(put, op(0, 2, 3, "cas", b"x", b"c", miss, expected=b"a")).linearizable
    # Failing and reporting a current value that is not the current value.
    wrong = Output("mismatch", b"z", True)
    assert not verdict(put, op(0, 2, 3, "cas", b"x", b"c", wrong, expected=b"b")).linearizable
    absent = Output("mismatch", b"", False)
    assert not verdict(put, op(0, 2, 3, "cas", b"x", b"c", absent, expected=b"b")).linearizable
    right = Output("mismatch", b"a", True)
    assert verdict(put, op(0, 2, 3, "cas", b"x", b"c", right, expected=b"b")).linearizable


def test_delete_of_present_key_cannot_be_not_found() -> None:
    put = op(0, 0, 1, "put", b"x", b"a", OK)
    assert not verdict(put, op(0, 2, 3, "delete", b"x", out=NF)).linearizable
    v = verdict(put, op(0, 2, 3, "delete", b"x", out=OK), op(0, 4, 5, "get", b"x", out=NF))
    assert v.linearizable


def test_keys_are_checked_independently_and_culprits_named() -> None:
    v = verdict(
        op(0, 0, 10, "put", b"good", b"1", OK),
        op(1, 0, 10, "put", b"bad", b"1", OK),
        op(0, 20, 30, "get", b"good", out=got(b"1")),
        op(1, 20, 30, "get", b"bad", out=NF),
        op(2, 20, 30, "get", b"other", out=NF),
    )
    assert not v.linearizable
    assert (v.keys, v.bad_keys) == (3, [b"bad"])


def test_html_visualization_written(tmp_path: Path) -> None:
    out = tmp_path / "viz.html"
    v = verdict(op(0, 0, 10, "put", b"x", b"1", OK), op(1, 20, 30, "get", b"x", out=NF), html=out)
    assert not v.linearizable and v.html == out
    text = out.read_text()
    assert "<html" in text.lower() and "put(" in text


def test_binary_exit_codes_and_bad_input(tmp_path: Path) -> None:
    binary = zh.lincheck_binary()

    def run(doc: Any) -> subprocess.CompletedProcess[str]:
        p = tmp_path / "h.json"
        p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        return subprocess.run([str(binary), str(p)], capture_output=True, text=True)

    put = {"client": 0, "call": 0, "return": 10, "op": "put", "key": "x", "value": "1",
           "output": {"status": "ok"}}  # fmt: skip
    get = {"client": 1, "call": 20, "return": 30, "op": "get", "key": "x",
           "output": {"status": "ok", "value": "1"}}  # fmt: skip
    r = run({"operations": [put, get]})
    assert r.returncode == 0 and r.stdout.startswith("linearizable"), r
    r = run([put, dict(get, output={"status": "not_found"})])  # a bare list is accepted too
    assert r.returncode == 1 and r.stdout.startswith("NOT linearizable"), r
    bad_docs: list[Any] = [
        "not json",
        {"ops": []},
        [dict(put, op="increment")],
        [dict(put, unknown_field=1)],  # a typo must not silently change the verdict
        [{k: v for k, v in put.items() if k != "key"}],
        [dict(put, output=None)],  # return without output
        [dict(put, call=20)],  # returns before its call
        [dict(get, output={"status": "mismatch"})],  # not a status of get
        [dict(get, output={"status": "ok"})],  # a read without its value
        [{k: v for k, v in put.items() if k != "value"}],
    ]
    for doc in bad_docs:
        r = run(doc)
        assert r.returncode == 2 and "lincheck" in r.stderr, (doc, r)
    with pytest.raises(zh.LincheckError, match="not one of"):
        zh.check(History([op(0, 0, 1, "incr", b"x", out=OK)]))


def test_json_round_trip_keeps_arbitrary_bytes() -> None:
    raw = bytes(range(256))
    h = History(
        [
            op(0, 1, 2, "put", raw, raw[::-1], OK),
            op(1, 3, None, "cas", b"k", b"n", expected=raw),
            op(1, 3, 4, "cas", b"k", b"n", Output("mismatch", b"", False), expected=b"q"),
        ]
    )
    back = History.from_json(json.loads(h.dumps()))
    assert back == h
    assert zh.check(h).result == "Ok"


# ---- the recorder over an in-process kv app -----------------------------------------------


class LocalKv:
    """An invoker running the real kv app atomically at a random point inside the call:
    linearizable by construction. `stale=True` serves GETs from a per-key cache filled
    by the first read, like a replica that stopped applying updates to its cache."""

    def __init__(self, root: Path, seed: int, stale: bool = False) -> None:
        root.mkdir(parents=True)
        self.app = kv.KvApp()
        self.app.open(StateDir(root))
        self.rng = random.Random(seed)
        self.seq = 0
        self.stale = stale
        self.cache: dict[bytes, bytes] = {}

    async def invoke(self, op: bytes, read_only: bool = False, timeout: float = 30.0) -> bytes:
        await asyncio.sleep(self.rng.random() * 0.004)
        self.seq += 1
        ctx = ExecContext(seq=self.seq, client=0, timestamp=self.seq, time_ms=0, seed=0)
        key = kvop.decode_op(op).key
        if self.stale and op[0] == kvop.GET and key in self.cache:
            reply = self.cache[key]
        else:
            reply = self.app.execute(op, ctx)
            if op[0] == kvop.GET:
                self.cache[key] = reply
        await asyncio.sleep(self.rng.random() * 0.004)
        return reply


async def _workload(rec: HistoryRecorder, invoker: Any, clients: int, ops: int, seed: int) -> None:
    rng = random.Random(seed)

    async def one(c: int) -> None:
        cl = rec.client(invoker)
        for i in range(ops):
            key = rng.choice([b"a", b"b"])
            r = rng.random()
            if r < 0.4:
                await cl.get(key)
            elif r < 0.7:
                await cl.put(key, b"%d-%d" % (c, i))
            elif r < 0.8:
                await cl.delete(key)
            else:
                cur = await cl.get(key)
                await cl.cas(key, cur.value if cur.ok else None, b"cas%d-%d" % (c, i))

    await asyncio.gather(*(one(c) for c in range(clients)))


def test_recorder_over_correct_store_is_linearizable(tmp_path: Path) -> None:
    rec = HistoryRecorder()
    asyncio.run(_workload(rec, LocalKv(tmp_path / "s", 1), clients=5, ops=40, seed=2))
    h = rec.history()
    assert len(h.operations) >= 200 and not any(o.pending for o in h.operations)
    assert {o.op for o in h.operations} == {"get", "put", "delete", "cas"}
    assert {o.client for o in h.operations} == set(range(5))
    assert all(o.ret is not None and o.call <= o.ret for o in h.operations)
    v = zh.check(h)
    assert v.linearizable, v


def test_recorder_over_stale_cache_is_caught(tmp_path: Path) -> None:
    async def drive() -> HistoryRecorder:
        rec = HistoryRecorder()
        cl = rec.client(LocalKv(tmp_path / "s", 1, stale=True))
        await cl.put(b"x", b"1")
        assert (await cl.get(b"x")).value == b"1"
        await cl.put(b"x", b"2")
        assert (await cl.get(b"x")).value == b"1"  # the bug under test
        return rec

    v = zh.check(asyncio.run(drive()).history())
    assert not v.linearizable and v.bad_keys == [b"x"]


class TimesOut:
    """Applies the op (or not), then times out: the client cannot know which."""

    def __init__(self, inner: LocalKv) -> None:
        self.inner = inner
        self.fail_next: bool | None = None  # None: pass through; True/False: apply first?

    async def invoke(self, op: bytes, read_only: bool = False, timeout: float = 30.0) -> bytes:
        mode, self.fail_next = self.fail_next, None
        if mode is None:
            return await self.inner.invoke(op, read_only, timeout)
        if mode:
            await self.inner.invoke(op, read_only, timeout)
        raise ClientTimeout("injected")


def test_timed_out_op_is_pending_and_moves_to_a_new_process(tmp_path: Path) -> None:
    inv = TimesOut(LocalKv(tmp_path / "s", 3))

    async def drive() -> HistoryRecorder:
        rec = HistoryRecorder()
        cl = rec.client(inv)
        await cl.put(b"x", b"1")
        for applied in (True, False):
            inv.fail_next = applied
            with pytest.raises(ClientTimeout):
                await cl.put(b"x", b"lost" if not applied else b"2")
        assert (await cl.get(b"x")).value == b"2"
        return rec

    h = asyncio.run(drive()).history()
    assert [o.pending for o in h.operations] == [False, True, True, False]
    assert [o.client for o in h.operations] == [0, 0, 1, 2]
    v = zh.check(h)
    assert v.linearizable and v.pending == 2, v
    # Had the client not recorded the timed-out write, reading 2 would be a violation:
    # the pending op is what makes the history explainable.
    h.operations = [o for o in h.operations if not o.pending]
    assert not zh.check(h).linearizable


def test_build_cache_keyed_by_source(tmp_path: Path) -> None:
    first = zh.lincheck_binary(tmp_path)
    assert first.parent == tmp_path and first.exists()
    assert zh.lincheck_binary(tmp_path) == first  # no rebuild on second use
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp leftovers


def test_cli_exit_codes(tmp_path: Path) -> None:
    good = History([op(0, 0, 1, "put", b"x", b"1", OK), op(0, 2, 3, "get", b"x", out=got(b"1"))])
    bad = History([op(0, 0, 1, "put", b"x", b"1", OK), op(0, 2, 3, "get", b"x", out=NF)])
    assert zh.main([str(good.save(tmp_path / "g.json"))]) == 0
    assert zh.main([str(bad.save(tmp_path / "b.json")), "--html", str(tmp_path / "b.html")]) == 1
    assert (tmp_path / "b.html").exists()
    (tmp_path / "x.json").write_text("[{}]")
    assert zh.main([str(tmp_path / "x.json")]) == 2
