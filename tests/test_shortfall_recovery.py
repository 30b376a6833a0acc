# tests/test_shortfall_recovery.py - liveness after a conviction (issue: no recovery from a
# shortfall): the partner of a convicted replica crashes before the convicted slot's fresh spare
# is ready. Nobody is asleep, so the statements about the stuck request wake no one; once the
# fresh spare is announced (SPARE-READY), those statements must wake it, without waiting for
# some later request to fail too. Real zz-agreed and runtimes (tests/test_fault_detection_e2e.py).
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import shutil
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_execution_runtime import KV_GET, KV_PUT, _kv, _kv_ok
from tests.test_fault_detection_e2e import (  # wrong_rig: replica 1 answers wrongly
    FAST,
    SPARE,
    FaultRig,
    _check_wakeup,
    _puts,
    _start,
    _wait_resolved,
    wrong_rig,  # noqa: F401
)
from zz import keys
from zz.atomicfile import write_atomic
from zz.controld.announce import Announcer
from zz.drillfaults import FAULT_FILE
from zz.procrack import signal_group


@pytest.mark.slow
def test_partner_crash_before_the_fresh_spare_is_ready(request: pytest.FixtureRequest) -> None:
    rig: FaultRig = request.getfixturevalue("wrong_rig")
    c = rig.cluster
    # 1. Replica 1 lies: the spare is woken, 1 convicted; 0 and the former spare are active.
    assert _puts(rig, 1, "w") == [_kv_ok()]
    _check_wakeup(rig)
    seq = _wait_resolved(rig, convicted=1).seq

    # 2. The former spare crashes before 1's slot is refilled: a PUT gets one reply (from 0)
    # and cannot complete. Its seq times out and every agreement replica signs a statement,
    # but nobody is asleep, so no WAKEUP.
    rig.execs.kill(SPARE)
    sent = rig.total("fault_statements_sent")

    async def put_stuck() -> bytes:
        client = c.client(0)
        try:  # long enough for the refill below on a loaded machine
            return await client.invoke(_kv(KV_PUT, b"stuck", b"v"), timeout=150)
        finally:
            await client.close()

    pool = concurrent.futures.ThreadPoolExecutor(1)
    stuck = pool.submit(asyncio.run, put_stuck())
    try:
        rig.wait(
            lambda: rig.total("fault_statements_sent") >= sent + c.g + 1,
            "statements about the stuck PUT's seq",
        )
        assert len(rig.controld.shutdowns) == 1 and not stuck.done()
        assert all(s["exec_sleeping"] == [] for s in rig.agreement())

        # 3. controld refills slot 1 (fresh state, no fault, registered, asleep) and
        # announces it. Nothing else happens: no new request, no new seq.
        refill_slot(rig, 1, seq)

        # 4. The statements collected while nobody slept now wake 1; the crashed replica is
        # convicted, 0 and 1 are active, and the stuck PUT completes.
        rig.wait(lambda: len(rig.controld.shutdowns) >= 2, "a second SHUTDOWN certificate", 60)
        cert = rig.controld.shutdowns[1]
        assert cert.convict == (SPARE,) and cert.active == (0, 1), cert
        assert rig.controld.wakeups[-1].wake == (1,)
        assert 1 in rig.controld.woken_at
        assert stuck.result(timeout=150) == _kv_ok()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    assert rig.invoke_all([_kv(KV_GET, b"stuck"), _kv(KV_GET, b"w0")]) == [
        _kv_ok(b"v"),
        _kv_ok(b"v0"),
    ]

    # 5. Slot 2 is refilled too. The awake set is {0, 1} again, the one the first round's
    # statements name: they are settled (a decided round is above them) and must not wake
    # the refilled spare at that old seq (controld refuses it as stale, and the agreement
    # replicas counted 2 awake: the campaign saw stalls from it).
    wakeups = sum(s["wakeups_sent"] for s in rig.agreement())
    refill_slot(rig, SPARE, cert.seq, clear_args=False)
    rig.wait(
        lambda: all(s["exec_sleeping"] == [SPARE] for s in rig.agreement()),
        "every agreement replica counts 2 as a sleeping spare",
    )
    assert _puts(rig, 2, "later") == [_kv_ok()] * 2
    assert sum(s["wakeups_sent"] for s in rig.agreement()) == wakeups
    assert all(
        s["exec_awake"] == [0, 1] and s["exec_sleeping"] == [SPARE] for s in rig.agreement()
    ), [(s["exec_awake"], s["exec_sleeping"]) for s in rig.agreement()]


def refill_slot(rig: FaultRig, x: int, seq: int, *, clear_args: bool = True) -> None:
    """What controld does after a SHUTDOWN convicting x: a fresh replica in slot x (new
    state; without its fault arguments unless `clear_args` is false), registered and
    paused, announced by SPARE-READY for `seq`."""
    c = rig.cluster
    svc = c.service
    rig.execs.procs[x].wait(timeout=10)  # SIGKILLed by the controld stand-in
    shutil.rmtree(svc.exec_state_dir(c.config, x), ignore_errors=True)
    if clear_args:
        rig.execs.args[x] = []
    rig.execs.start(x)
    rig.wait_linked(x)
    signal_group(rig.execs.procs[x].pid, signal.SIGSTOP)
    host = c.config.hosts[0]  # the test rack's one controld (tests/test_spare_refill.py)
    ctl_key = keys.load_secret(
        keys.secret_path(c.dir / "keys", keys.RACK_SERVICE, keys.controld_principal(0))
    ).sign
    assert ctl_key is not None
    counters: Counter[str] = Counter()

    async def announce() -> None:
        a = Announcer(c.config, host, ctl_key, counters, print)
        a.announce(svc, x, seq)
        await asyncio.wait_for(a.idle(), 30)

    asyncio.run(announce())


@pytest.fixture
def f2_liar_rig(tmp_path: Path) -> Iterator[FaultRig]:
    yield from _start(tmp_path, {0: ["--inject-fault", "wrong-reply"]}, FAST, f=2)


@pytest.mark.slow
def test_f2_liar_and_a_dead_spare(f2_liar_rig: FaultRig) -> None:
    """f = 2: replica 0 lies and spare 3, the one its WAKEUP wakes, is dead (two faulty
    execution replicas). The round cannot decide without 3's report; once 3 is overdue the
    round closes and the seq is judged again over {0, 1, 2, 3}, which wakes spare 4. Before,
    the round stayed open for good and the PUT never completed."""
    rig = f2_liar_rig
    dead = rig.execs.procs[3]
    signal_group(dead.pid, signal.SIGKILL)  # not reaped: the test controld's SIGCONT finds it
    assert _puts(rig, 1, "w") == [_kv_ok()]
    rig.wait(lambda: bool(rig.controld.shutdowns), "a SHUTDOWN certificate", 60)
    wakes = sorted({w.wake for w in rig.controld.wakeups})
    assert wakes == [(3,), (4,)], wakes
    cert = rig.controld.shutdowns[0]
    # The liar and the dead spare are convicted: the mismatch excuses only a late but correct
    # answer (TR Lemma 2), and 3 never answered (docs/fault-detection.md §5).
    assert cert.convict == (0, 3) and cert.active == (1, 2, 4) and cert.sleep == (), cert
    assert rig.invoke_all([_kv(KV_GET, b"w0")]) == [_kv_ok(b"v0")]


@pytest.fixture
def equivocator_rig(tmp_path: Path) -> Iterator[FaultRig]:
    yield from _start(tmp_path, {0: ["--drill-faults"]}, FAST, cp=8)


@pytest.mark.slow
def test_woken_spare_finds_the_checkpoint_the_agreement_replicas_hold(
    equivocator_rig: FaultRig,
) -> None:
    """Replica 0 answers clients correctly but sends wrong EXEC-REPORTs to agreement
    replicas 0 and 1 (equivocation). While the round is open the agreement replicas hold
    their stable checkpoint below the fault (exec_stable_held) and tell the woken spare to
    recover from it; replicas 0 and 1 sign matching checkpoints and go on making newer
    ones stable among themselves. They must keep the snapshot the agreement replicas hold:
    before, they collected it, the spare found no source for its files, registered again,
    was told the same checkpoint, and the round never closed (campaign seed 3001 round 5)."""
    rig = equivocator_rig
    c = rig.cluster
    assert _puts(rig, 40, "a") == [_kv_ok()] * 40
    rig.wait(lambda: rig.execs.status(1).get("stable_checkpoint", 0) >= 32, "checkpoint 32 stable")
    rig.controld.wake_delay = 600.0  # the test resumes the spare itself, below
    write_atomic(
        c.service.exec_state_dir(c.config, 0) / FAULT_FILE,
        json.dumps({"fault": "equivocate"}) + "\n",
    )
    rig.wait(lambda: rig.execs.status(0).get("inject_fault") == "equivocate", "0 equivocates")

    def reads_and_writes(tag: str) -> None:
        """GET and PUT of the keys checkpoint 40 holds: the spare must fetch their files."""
        ops = [
            op
            for k in range(40)
            for op in (_kv(KV_GET, b"a%d" % k), _kv(KV_PUT, b"a%d" % k, tag.encode()))
        ]
        assert rig.invoke_all(ops)[1::2] == [_kv_ok()] * 40

    reads_and_writes("x")  # the first report mismatches: WAKEUP; clients are served
    assert rig.controld.wakeups and rig.controld.wakeups[0].seq <= 42
    # A guest resumes in seconds; meanwhile 0 and 1 make newer checkpoints stable.
    rig.wait(lambda: rig.execs.status(1).get("stable_checkpoint", 0) >= 72, "checkpoint 72")
    signal_group(rig.execs.procs[SPARE].pid, signal.SIGCONT)
    reads_and_writes("y")
    rig.wait(lambda: bool(rig.controld.shutdowns), "a SHUTDOWN certificate", 60)
    cert = rig.controld.shutdowns[0]
    assert cert.convict == (0,) and cert.active == (1, SPARE), cert
    # The spare recovered below the fault and replayed it (the round decided on its
    # report), not from a checkpoint above it after the overdue round closed.
    log = rig.execs.log_path(SPARE).read_text()
    first = re.search(r"behind the stable checkpoint (\d+)", log)
    assert first and int(first.group(1)) <= cert.seq, log[-3000:]
    assert "recovery to " not in log, log[-3000:]  # "... failed (will retry)"
    assert rig.invoke_all([_kv(KV_GET, b"a39")]) == [_kv_ok(b"y")]


@pytest.fixture
def f2_waiting_rig(tmp_path: Path) -> Iterator[FaultRig]:
    # A 3 s deadline: the rows of a mismatch with a silent third replica wait that long.
    timer = {**FAST, "detect_floor_ms": 3000, "detect_ceiling_ms": 3000}
    yield from _start(tmp_path, {0: ["--inject-fault", "wrong-reply"]}, timer, f=2)


@pytest.mark.slow
def test_a_flagged_fault_waiting_for_its_rows_is_in_the_stats(f2_waiting_rig: FaultRig) -> None:
    """f = 2: 0 lies and 2 is silent. 0 and 1 disagree at once (flagged), but no statement
    is signed before 2 reports or the deadline passes: `fault_flags_waiting` shows the
    round that is coming while none is open, and is 0 once it is decided. The campaign
    took a rack in that gap for settled (seed 3602 round 130: the WAKEUP and SHUTDOWN of
    the lie fell after the round had been checked)."""
    rig = f2_waiting_rig
    g = rig.cluster.g
    signal_group(rig.execs.procs[2].pid, signal.SIGSTOP)
    waiting_seen = False
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        put = pool.submit(_puts, rig, 1, "w")  # completes once spares answer with 1

        def waiting() -> bool:
            nonlocal waiting_seen
            stats = rig.agreement()
            if any(s["fault_round_open"] or s["wakeups_sent"] for s in stats):
                return True  # too late to see it: fails below
            waiting_seen = sum(1 for s in stats if s["fault_flags_waiting"]) >= g + 1
            return waiting_seen

        rig.wait(waiting, "a flagged fault waiting at g+1 agreement replicas", 30)
        seen = [(s["fault_flags_waiting"], s["wakeups_sent"]) for s in rig.agreement()]
        assert waiting_seen, seen
        assert put.result(timeout=60) == [_kv_ok()]
    rig.wait(lambda: bool(rig.controld.shutdowns), "a SHUTDOWN certificate", 60)
    rig.wait(
        lambda: all(not s["fault_round_open"] for s in rig.agreement()), "the round decided", 30
    )
    assert all(s["fault_flags_waiting"] == 0 for s in rig.agreement()), rig.agreement()
