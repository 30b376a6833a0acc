# tests/test_recovery_drill.py - the whole fault path with recovery (ZZ §4.3-4.5): concurrent KV
# clients recording a history, an active execution replica fails after the state has grown past
# several stable checkpoints, the agreement cluster wakes the paused spare (via a certificate-
# checking controld stand-in, tests/test_fault_detection_e2e.py), the spare recovers from the
# certified checkpoint by fetching state from its peers, the client gets correct replies, the
# faulty replica is convicted, and Porcupine finds the whole history linearizable.
from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_fault_detection_e2e import FaultRig, _start
from tests.test_kv_linearizable import needs_go
from zz import history as zh
from zz.client import ClientTimeout
from zz.history import HistoryRecorder
from zz.procrack import signal_group

CP = 8
TIMERS = {"detect_k": 4, "detect_floor_ms": 300, "detect_ceiling_ms": 1000}
KEYS = [b"a", b"b", b"c", b"d"]


# What the agreement replicas logged of detection and views (their logs' lines).
_EVENTS = ("execution timeout", "execution mismatch", "WAKEUP", "SHUTDOWN", "view")


def _events(rig: FaultRig) -> str:
    cl = rig.cluster
    lines = []
    for r in range(cl.n):
        try:
            text = cl.log_path(r).read_text(errors="replace")
        except OSError:
            continue
        lines += [ln for ln in text.splitlines() if any(e in ln for e in _EVENTS)]
    c = rig.controld
    head = f"controld: wakeups={c.wakeups} shutdowns={c.shutdowns} rejected={c.rejected}"
    return "\n".join([head, *sorted(lines), rig.diag()])


def _settled(rig: FaultRig, i: int) -> int:
    """Replica i's last executed seq once two status writes (1 s apart) agree. Two reads
    of one write are not two writes: on a loaded machine a write came late, the same file
    was read twice while batches still ran, and the seq the test then aimed at was off
    (a clean-clone run: 144 where 7 mod 8 was due)."""
    prev: tuple[int, float] | None = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        st = rig.execs.status(i)
        n, written = st.get("last_executed"), st.get("mono_now")
        if n is not None and written is not None:
            if prev is not None and n == prev[0] and written >= prev[1] + 1.0:
                return n
            if prev is None or written != prev[1]:
                prev = (n, written)
        time.sleep(0.25)
    raise TimeoutError(f"replica {i} does not settle\n{rig.diag()}")


async def _workload(
    rig: FaultRig, rec: HistoryRecorder, seconds: float, first: int, reads_only: bool = False
) -> int:
    """3 clients doing get/put/cas (or only gets) on a few keys for `seconds`; returns
    acknowledged ops."""
    loop = asyncio.get_running_loop()
    stop = loop.time() + seconds
    done = 0

    async def worker(w: int) -> None:
        nonlocal done
        rng = random.Random(first * 100 + w)
        client = rig.cluster.client(first + w)
        kc = rec.client(client, timeout=20.0)
        n = 0
        try:
            while loop.time() < stop:
                n += 1
                key = rng.choice(KEYS)
                value = b"w%d-%d-%d" % (first, w, n)
                try:
                    r = 0.0 if reads_only else rng.random()
                    if r < 0.45:
                        await kc.get(key)
                    elif r < 0.9:
                        await kc.put(key, value)
                    else:
                        await kc.cas(key, None, value)
                    done += 1
                except ClientTimeout:
                    pass
        finally:
            await client.close()

    await asyncio.gather(*(worker(w) for w in range(3)))
    return done


async def _sequential_puts(rig: FaultRig, rec: HistoryRecorder, k: int, client_index: int) -> None:
    client = rig.cluster.client(client_index)
    kc = rec.client(client, timeout=20.0)
    try:
        for j in range(k):
            await kc.put(b"pad", b"pad-%d-%d" % (client_index, j))
    finally:
        await client.close()


def _drill(
    rig: FaultRig,
    faulty: int,
    spare: int,
    fault: str,
    phase: int,
    reads_first: float = 0.0,
    in_place: bool = False,
) -> dict[str, Any]:
    """Load, then bring the service to seq = m*CP + phase with nothing in flight, inject
    the fault, and load again through detection, wake-up and recovery (the first
    `reads_first` seconds of it only reads). `in_place`: the faulty replica (run with
    --drill-faults) turns Byzantine through its fault file, as in a drill, not by a
    restart."""
    zh.lincheck_binary()
    rec = HistoryRecorder()
    before = asyncio.run(_workload(rig, rec, 3.0, first=0))
    n = _settled(rig, 0)
    k = (phase - n) % CP
    if n + k < 2 * CP:
        k += 2 * CP  # at least two checkpoints, so the spare cannot just replay the log
    asyncio.run(_sequential_puts(rig, rec, k, client_index=10))
    at = _settled(rig, 0)
    assert at % CP == phase % CP, f"{(at, phase)}\n{_events(rig)}"
    # Nothing was to be detected before the fault. A replica convicted here (one late
    # beyond the detection bound) is SIGKILLed by the test controld, and the drill would
    # fail further on with no word of why: the stop below returns -9, not 0.
    c = rig.controld
    assert not c.wakeups and not c.shutdowns, f"a fault round before the fault\n{_events(rig)}"
    execs = rig.execs
    if fault == "crash":
        execs.kill(faulty)
    elif in_place:
        (rig.cluster.run_dir / f"exec-{faulty}" / "zz-fault.json").write_text(
            json.dumps({"fault": fault})
        )
        rig.wait(lambda: execs.status(faulty).get("inject_fault") == fault, "the fault")
    else:
        # A replica that turns Byzantine now: restarted with wrong replies, it restores
        # its own checkpoint and catches up first, then lies about every new request.
        status = execs.stop(faulty)
        assert status == 0, f"replica {faulty} exited with {status}\n{_events(rig)}"
        execs.args[faulty] = ["--inject-fault", "wrong-reply"]
        execs.start(faulty)
        rig.wait_linked(faulty)
    t0 = time.monotonic()
    after = 0
    if reads_first:
        after += asyncio.run(_workload(rig, rec, reads_first, first=30, reads_only=True))
    after += asyncio.run(_workload(rig, rec, 5.0, first=20))
    rig.wait(lambda: bool(c.shutdowns), "a SHUTDOWN certificate", timeout=60)
    # Once resolved, the service runs on the survivors and the recovered spare.
    after += asyncio.run(_workload(rig, rec, 2.0, first=40))
    h = rec.history()
    verdict = zh.check(h, timeout=60)
    assert verdict.linearizable, f"{verdict}\n{rig.diag()}"
    assert c.wakeups and spare in c.wakeups[0].wake, _events(rig)
    assert not c.rejected, _events(rig)
    assert c.shutdowns[0].convict == (faulty,), _events(rig)
    st = execs.status(spare)
    rec_info = st.get("recovery", {})
    # It slept since seq 0 and the cluster's log starts at a stable checkpoint above it:
    # the spare must have jumped to that checkpoint and fetched state from its peers.
    assert st["counters"].get("recoveries", 0) >= 1, f"{c.wakeups}\n{c.shutdowns}\n{rig.diag()}"
    assert rec_info.get("checkpoint", 0) >= CP, rec_info
    assert before > 20 and after > 20, f"{(before, after)}\n{rig.diag()}"

    return {
        "fault_at_seq": at,
        "recovered_checkpoint": rec_info["checkpoint"],
        "files_pending_at_wake": rec_info.get("files_pending"),
        "ops_before": before,
        "ops_after": after,
        "ops_in_history": len(h.operations),
        "first_wakeup_s": c.woken_at and min(c.woken_at.values()) - t0,
    }


@pytest.fixture
def f1_rig(tmp_path: Path) -> Iterator[FaultRig]:
    yield from _start(tmp_path, {}, TIMERS, cp=CP)


@pytest.fixture
def drill_faults_rig(tmp_path: Path) -> Iterator[FaultRig]:
    yield from _start(tmp_path, {1: ["--drill-faults"]}, TIMERS, cp=CP)


@pytest.fixture
def f2_rig(tmp_path: Path) -> Iterator[FaultRig]:
    yield from _start(tmp_path, {}, TIMERS, cp=CP, f=2)


# `long`: tests/test_drill.py::test_two_faults_in_a_row crashes a replica at the same phase
# through the real controld on every run; this one only prints what it saw.
@pytest.mark.slow
@pytest.mark.long
@needs_go
def test_crash_right_after_a_checkpoint(f1_rig: FaultRig) -> None:
    print(_drill(f1_rig, faulty=1, spare=2, fault="crash", phase=0))


# `long`: tests/test_drill.py::test_two_faults_in_a_row lies one seq before a checkpoint
# through the real controld on every run; this one only prints what it saw.
@pytest.mark.slow
@pytest.mark.long
@needs_go
def test_wrong_reply_right_before_the_next_checkpoint(f1_rig: FaultRig) -> None:
    print(_drill(f1_rig, faulty=1, spare=2, fault="wrong-reply", phase=CP - 2))


@pytest.mark.slow
@needs_go
def test_wrong_reply_at_a_checkpoint_with_a_slow_wake(drill_faults_rig: FaultRig) -> None:
    """The first wrong reply is at a checkpoint seq S, the spare wakes 2 s late (a
    guest's resume), and the load is only reads until then: a wrong read reply is not
    kept in the reply cache, so the liar and the correct replica sign S and later
    checkpoints alike. Were those stable, the spare would recover at or above S, never
    report S, and the round could not convict (seen in CI); zz-agreed holds them back
    while the round is open (exec_stable_held), so the spare replays S and the liar is
    convicted."""
    rig = drill_faults_rig
    rig.controld.wake_delay = 2.0
    out = _drill(rig, 1, 2, "wrong-reply", phase=CP - 1, reads_first=3.0, in_place=True)
    print(out)
    assert out["recovered_checkpoint"] <= out["fault_at_seq"], out
    keys = ("exec_stable", "exec_stable_held", "exec_mismatches", "wakeups_sent", "last_exec")
    assert rig.total("exec_stable_held") > 0, [{k: a.get(k) for k in keys} for a in rig.agreement()]


@pytest.mark.slow
@needs_go
def test_equivocation_at_a_checkpoint_with_a_slow_wake(drill_faults_rig: FaultRig) -> None:
    """The liar's first wrong report is at a checkpoint seq S and goes to agreement
    replicas 0 and 1 only; 2 and 3 get right reports, so f+1 matching reports certify S's
    checkpoint there before any round is open, and they name S as their stable checkpoint.
    The spare, woken 2 s late, must still recover below S (the seq its wake notice names)
    and replay S to report it, or the round never decides (campaign seed 3101 round 93)."""
    rig = drill_faults_rig
    rig.controld.wake_delay = 2.0
    out = _drill(rig, 1, 2, "equivocate", phase=CP - 1, in_place=True)
    print(out)
    assert out["recovered_checkpoint"] <= out["fault_at_seq"], out


@pytest.mark.slow
@needs_go
def test_f2_crash_wakes_one_of_two_spares(f2_rig: FaultRig) -> None:
    out = _drill(f2_rig, faulty=2, spare=3, fault="crash", phase=1)
    print(out)


@pytest.fixture
def f2_slow_rig(tmp_path: Path) -> Iterator[FaultRig]:
    timers = {"detect_k": 4, "detect_floor_ms": 2000, "detect_ceiling_ms": 3000}
    yield from _start(tmp_path, {0: ["--drill-faults"], 1: ["--drill-faults"]}, timers, cp=CP, f=2)


@pytest.mark.slow
@needs_go
def test_f2_liar_and_a_slower_correct_replica(f2_slow_rig: FaultRig) -> None:
    """f = 2: replica 0 lies, replica 1 is correct but reports 0.15 s after replica 2 (well
    within the 2 s floor). Only the liar is convicted: the agreement replicas sign their
    fault statements once every awake replica reported, so the rows show replica 1 on
    time. (Signed as soon as 0 and 2 disagreed, they showed it as "-", which counts like
    silence, and it was convicted with the liar: an f = 2 VM drill in CI.)"""
    rig = f2_slow_rig
    (rig.cluster.run_dir / "exec-1" / "zz-fault.json").write_text(
        '{"fault": "slow-report", "slow_report_ms": 150}'
    )
    rig.wait(lambda: rig.execs.status(1).get("inject_fault") == "slow-report", "slow 1")
    out = _drill(rig, faulty=0, spare=3, fault="wrong-reply", phase=3, in_place=True)
    print(out)
    assert rig.controld.shutdowns[0].convict == (0,), rig.controld.shutdowns


# The agreement replicas' detection ring (agreement/src/replica.c): log_window (2 CP in
# these rigs) + 1024 records, one per seq; a seq's record is reused that many seqs on.
RING = 2 * CP + 1024


@pytest.fixture
def long_round_rig(tmp_path: Path) -> Iterator[FaultRig]:
    # The ceiling only bounds K·t1 (never reached here: t1 is a few ms); a round resolves
    # without a silent woken replica 5 s + ceiling after it opened, 35 s here, which gives
    # the load time to carry the agreement replicas a whole ring past the round's seq.
    timers = {**TIMERS, "detect_ceiling_ms": 30000}
    yield from _start(tmp_path, {1: ["--drill-faults"]}, timers, cp=CP)


@pytest.mark.slow
def test_a_spare_that_reports_once_the_ring_moved_on(long_round_rig: FaultRig) -> None:
    """Replica 1 equivocates to every agreement replica (right replies, so the clients go
    on); the round at its first seq S wakes the spare, which takes its time: the load
    carries every agreement replica more than a ring of seqs past S before it resumes (under
    the campaign's load, 1,088 seqs took 7 s: less than a VM's resume and recovery, and less
    than 5 s + ceiling). Its report for S must still count: the round keeps its own record
    of S's reports. Before, S's record was reused, the report dropped as stale and the round
    never resolved, not even once overdue (campaign seed 3202 round 14)."""
    rig = long_round_rig
    c = rig.controld
    c.hold = True
    rec = HistoryRecorder()
    asyncio.run(_workload(rig, rec, 1.0, first=0))
    fault = {"fault": "equivocate", "to": list(range(rig.cluster.n))}
    (rig.cluster.run_dir / "exec-1" / "zz-fault.json").write_text(json.dumps(fault))
    rig.wait(lambda: rig.execs.status(1).get("inject_fault") == "equivocate", "the fault")
    t0 = time.monotonic()
    first, seq = 10, None
    while seq is None or min(a["last_exec"] for a in rig.agreement()) <= seq + RING:
        assert time.monotonic() - t0 < 30, f"no round, or too slow a load\n{rig.diag()}"
        asyncio.run(_workload(rig, rec, 2.0, first=first))
        first += 3
        rounds = {a.get("fault_round_seq") for a in rig.agreement() if a["fault_round_open"]}
        seq = min(rounds) if rounds else None
    assert c.wakeups and not c.shutdowns, (c.wakeups, c.shutdowns)
    signal_group(rig.execs.procs[2].pid, signal.SIGCONT)
    rig.wait(lambda: bool(c.shutdowns), "a SHUTDOWN certificate", timeout=30)
    assert c.shutdowns[0].seq == seq and c.shutdowns[0].convict == (1,), c.shutdowns
    assert time.monotonic() - t0 < 35, "resolved only because it was overdue"
