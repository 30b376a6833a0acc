# tests/test_kv_linearizable.py - end to end: concurrent clients drive the kv app through
# real zz-agreed processes and two execution replicas; Porcupine must find the recorded
# history linearizable.
from __future__ import annotations

import asyncio
import os
import random
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests import test_execution_runtime as runtime
from tests.test_execution_runtime import Rig, needs_agreed
from zz import history as zh
from zz.client import ClientTimeout
from zz.history import History, HistoryRecorder, Op, Output

CLIENTS = 6
KEYS = [b"k0", b"k1", b"k2"]
SECONDS = 6.0

# zz-agreed (g = 1) + execution replicas 0 and 1 running kv, as the runtime tests use.
rig = runtime.rig

needs_go = pytest.mark.skipif(
    shutil.which("go") is None and "ZZ_LINCHECK" not in os.environ,
    reason="no Go toolchain for tools/lincheck: run scripts/setup-go.sh",
)


async def _workload(rig: Rig, rec: HistoryRecorder, seed: int) -> Counter[str]:
    loop = asyncio.get_running_loop()
    stop = loop.time() + SECONDS
    tally: Counter[str] = Counter()

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        client = rig.cluster.client(i)
        kc = rec.client(client, timeout=5.0)
        seen: dict[bytes, bytes | None] = {}  # last value this worker read per key
        n = 0
        try:
            while loop.time() < stop:
                key = rng.choice(KEYS)
                n += 1
                # Every written value is unique, so a read pins down which write it saw.
                value = b"c%d-%d" % (i, n)
                r = rng.random()
                try:
                    if r < 0.4:
                        reply = await kc.get(key)
                        seen[key] = reply.value if reply.ok else None
                    elif r < 0.7:
                        await kc.put(key, value)
                    elif r < 0.8:
                        await kc.delete(key)
                    else:
                        # Often stale by now: exercises both CAS outcomes.
                        reply = await kc.cas(key, seen.get(key), value)
                        tally["cas_ok" if reply.ok else "cas_mismatch"] += 1
                except ClientTimeout:
                    tally["timeouts"] += 1
        finally:
            await client.close()

    await asyncio.gather(*(worker(i) for i in range(CLIENTS)))
    return tally


def _stale_read(h: History) -> Op | None:
    """A get, after everything, of a value that an acknowledged later put replaced: the
    value is unique to its put, so no linearization can show it again."""
    puts = [o for o in h.operations if o.op == "put" and not o.pending]
    end = max(o.ret or o.call for o in h.operations) + 1
    for first in puts:
        for later in puts:
            if later.key == first.key and first.ret is not None and later.call > first.ret:
                return Op(999, end, "get", first.key, ret=end + 1, output=Output("ok", first.value))
    return None


@pytest.mark.slow
@needs_agreed
@needs_go
def test_concurrent_kv_history_is_linearizable(rig: Rig, tmp_path: Path) -> None:
    zh.lincheck_binary()  # build before the clock starts, not inside the workload
    rec = HistoryRecorder()
    tally = asyncio.run(_workload(rig, rec, seed=int.from_bytes(os.urandom(2), "big")))
    h = rec.history()
    path = h.save(tmp_path / "history.json")
    done = [o for o in h.operations if not o.pending]
    kinds = Counter(o.op for o in done)
    print(f"history {path}: {len(h.operations)} ops, {dict(kinds)}, {dict(tally)}")

    verdict = zh.check(h, html=tmp_path / "history.html", timeout=60)
    if not verdict.linearizable:
        print(f"{verdict}\n{rig.diag()}", file=sys.stderr)
    assert verdict.linearizable, str(verdict)

    # An execution replica that died mid-run stalls every later op (f+1 = 2 replicas
    # must answer): say so, rather than fail on the thin history below.
    dead = [i for i in (0, 1) if not rig.execs.alive(i)]
    assert not dead, f"execution replica(s) {dead} died during the run\n{rig.diag()}"

    # The run must have been a real concurrent workload, not a trickle of timeouts.
    assert len(done) >= 100, (len(done), dict(tally), rig.diag())
    assert {o.client for o in done} >= set(range(CLIENTS))
    assert kinds["get"] and kinds["put"] and kinds["cas"], kinds
    assert tally["cas_ok"] and tally["cas_mismatch"], tally
    writer = {o.value: o.client for o in done if o.op in ("put", "cas") and o.value}
    cross = sum(
        1
        for o in done
        if o.op == "get" and o.output and o.output.value and writer.get(o.output.value) != o.client
    )
    assert cross >= 10, "reads should see other clients' writes"

    # The same history with one stale read appended must be rejected: the verdict above
    # is not vacuous for a history of this size and shape.
    stale = _stale_read(h)
    assert stale is not None
    bad = zh.check(History(h.operations + [stale]), timeout=60)
    assert bad.result == "Illegal" and bad.bad_keys == [stale.key], str(bad)
