# tests/test_empty_round.py - a round that wakes nobody (docs/fault-detection.md §4a): a round
# closes undecided because its woken spare is overdue, the awake set is 2f+1 and nobody is
# asleep; the liar must still be convicted, from the awake replicas' own reports, the awake
# set go back to f+1 and the convicted slot's fresh spare sleep. Real zz-agreed and runtimes
# with the certificate-checking controld stand-in of tests/test_fault_detection_e2e.py.
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_drill import rack_down
from tests.test_execution_runtime import needs_agreed
from tests.test_fault_detection_e2e import FAST, SPARE, FaultRig, _start
from tests.test_kv_linearizable import needs_go
from tests.test_rackctl import write_rack
from tests.test_recovery_drill import _workload
from tests.test_shortfall_recovery import refill_slot
from zz import history as zh
from zz import rackctl
from zz.atomicfile import write_atomic
from zz.config import Config, load
from zz.drill.load import start_load, stop_load
from zz.drillfaults import FAULT_FILE
from zz.history import HistoryRecorder
from zz.procrack import signal_group
from zz.rackctl import load_state

LIAR = 1


@pytest.fixture
def liar_rig(tmp_path: Path) -> Iterator[FaultRig]:
    yield from _start(tmp_path, {LIAR: ["--inject-fault", "wrong-reply"]}, FAST)


@pytest.mark.slow
@needs_go
def test_liar_convicted_when_its_rounds_spare_was_overdue(liar_rig: FaultRig) -> None:
    """f = 1: replica 1 lies from the start. The round at the first seq S wakes spare 2,
    which does not resume before the round is overdue (5 s + ceiling: a hibernated guest's
    slow restore), so the round closes undecided with {0, 1, 2} awake and nobody asleep.
    The spare then resumes and answers S late; from then on 0 and 2 certify every seq, so
    no statement about a later seq is ever signed. The statements about S over {0, 1, 2}
    must open a round that wakes nobody and decides from the reports: 1 convicted, 0 and
    2 active, and 1's fresh spare sleeps. Before, nobody was convicted, three replicas
    kept executing and no spare was left (docs/fault-detection.md §4a)."""
    rig = liar_rig
    c = rig.controld
    g = rig.cluster.g
    c.hold = True  # the WAKEUP is verified and recorded; the test resumes the spare below
    zh.lincheck_binary()
    rec = HistoryRecorder()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Three clients whose first operations wait for the spare (the liar's replies never
        # match 0's), recorded throughout.
        first = pool.submit(asyncio.run, _workload(rig, rec, 3.0, first=0))
        rig.wait(lambda: bool(c.wakeups), "the WAKEUP of the first round", 30)
        w = c.wakeups[0]
        assert w.wake == (SPARE,) and w.awake == (0, LIAR), w

        cl = rig.cluster
        undecided = f"round at seq {w.seq} undecided (a woken replica is overdue)"

        def closed_undecided() -> bool:
            return all(
                undecided in cl.log_path(r).read_text()
                and cl.stats(r)["exec_awake"] == [0, LIAR, SPARE]
                and cl.stats(r)["exec_sleeping"] == []
                for r in range(cl.n)
            )

        rig.wait(closed_undecided, "the round closed undecided over the overdue spare", 60)
        assert not c.shutdowns, c.shutdowns
        signal_group(rig.execs.procs[SPARE].pid, signal.SIGCONT)
        assert first.result(timeout=90) > 0
    assert asyncio.run(_workload(rig, rec, 2.0, first=10)) > 0

    rig.wait(lambda: bool(c.shutdowns), "a SHUTDOWN certificate", 60)
    cert = c.shutdowns[0]
    assert cert.seq == w.seq and cert.awake == (0, LIAR, SPARE), cert
    assert cert.convict == (LIAR,) and cert.active == (0, SPARE) and cert.sleep == (), cert
    assert len(cert.signers) >= g + 1
    # The round's WAKEUP woke nobody and reached the controld, which verified it.
    empty = [x for x in c.wakeups if x.wake == ()]
    assert empty and all(x.seq == w.seq and x.awake == (0, LIAR, SPARE) for x in empty), c.wakeups
    assert all(x.sleeping == () and len(x.signers) >= g + 1 for x in empty)
    assert not c.rejected, c.rejected
    rig.wait(
        lambda: all(
            s["exec_awake"] == [0, SPARE]
            and s["exec_convicted"] == [LIAR]
            and not s["fault_round_open"]
            for s in rig.agreement()
        ),
        "every agreement replica back to f+1 awake",
    )

    # controld's part after any conviction: a fresh replica in slot 1, asleep.
    refill_slot(rig, LIAR, cert.seq)
    rig.wait(
        lambda: all(
            s["exec_awake"] == [0, SPARE] and s["exec_sleeping"] == [LIAR] for s in rig.agreement()
        ),
        "every agreement replica counts the fresh 1 as a sleeping spare",
    )
    assert asyncio.run(_workload(rig, rec, 2.0, first=20)) > 0
    assert len(c.shutdowns) == 1, c.shutdowns
    h = rec.history()
    verdict = zh.check(h, timeout=60)
    assert verdict.linearizable, f"{verdict}\n{rig.diag()}"


# ---- the same on a `zz rack up` rack, with the real controlds -------------------------------


async def _on_a_rack(config: Config) -> None:
    s = config.service("kv0")
    run = config.rack.run_dir / f"s{s.id}"
    state = load_state(config)
    assert state is not None

    def stats() -> list[dict[str, Any]]:
        return [json.loads((run / f"agreed-{r}.stats.json").read_text()) for r in range(s.n)]

    async def until(pred: Callable[[], bool], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}: {stats()}")
            await asyncio.sleep(0.2)

    await until(lambda: all(x["exec_sleeping"] for x in stats()), "the spare asleep", 30)
    first = stats()[0]
    liar, spare = first["exec_awake"][0], first["exec_sleeping"][0]
    host = s.exec_host(config, spare).name
    ctl = state.proc(host)
    assert ctl.kind == "controld" and ctl.alive()
    load = start_load(config, [s], 3, None)
    try:
        await asyncio.sleep(1.0)
        # The spare's controld stalls (a host whose restore of a hibernated guest takes
        # longer than the round's deadline): the WAKEUP waits in its socket.
        os.kill(ctl.pid, signal.SIGSTOP)
        try:
            write_atomic(s.exec_state_dir(config, liar) / FAULT_FILE, '{"fault": "wrong-reply"}\n')
            logs = [run / f"agreed-{r}.log" for r in range(s.n)]
            undecided = "undecided (a woken replica is overdue)"
            await until(
                lambda: all(undecided in p.read_text() for p in logs),
                "every agreement replica closing the first round undecided",
                90,
            )
            assert all(x["exec_sleeping"] == [] for x in stats())
        finally:
            os.kill(ctl.pid, signal.SIGCONT)
        # Resumed, it wakes the spare; the spare answers late; the round that wakes nobody
        # convicts the liar, its controld provisions a fresh spare in that slot and
        # announces it: every agreement replica counts it asleep, two awake.
        others = sorted({*first["exec_awake"], spare} - {liar})
        await until(
            lambda: all(
                x["exec_awake"] == others and x["exec_sleeping"] == [liar] for x in stats()
            ),
            "the liar convicted and its fresh spare asleep",
            120,
        )
        await asyncio.sleep(2.0)  # load over the new awake set
    finally:
        await stop_load(load)
    texts = "".join(p.read_text() for p in run.glob("agreed-*.log"))
    print(*(x for x in texts.splitlines() if "WAKEUP" in x or "SHUTDOWN" in x or "round" in x))
    # The controld of every host with a replica of the service verified the round's WAKEUP
    # (zz/certs.py) and recorded it; the liar's acted on the SHUTDOWN and provisioned the
    # fresh spare (the condition above).
    hosts = {s.exec_host(config, i).name for i in range(s.n_exec)}
    ctl_logs = {p.name: Path(p.log).read_text() for p in state.procs if p.kind == "controld"}
    empty = re.compile(r"WAKEUP kv0 seq \d+ awake \[0, 1, 2\] wake \[\] from")
    assert all(empty.search(ctl_logs[h]) for h in hosts), ctl_logs
    assert "wake [] adopted" in texts or "wake [], evidence" in texts, texts[-3000:]
    shutdown = f"convict [{liar}] sleep [] active [{','.join(map(str, others))}]"
    assert shutdown in texts, texts[-3000:]
    for name, rec in load.recorders.items():
        verdict = zh.check(rec.history(), timeout=60)
        assert verdict.linearizable, f"{name}: {verdict}"


@pytest.mark.slow
@needs_agreed
@needs_go
def test_a_round_that_wakes_nobody_on_a_rack(tmp_path: Path) -> None:
    """`zz rack up` (process backend, f = 1): the spare's controld is stopped while the
    first round runs, so the spare wakes only after that round closed undecided; the round
    that wakes nobody convicts the liar, and the liar's controld replaces it by a fresh
    sleeping spare, as after any SHUTDOWN."""
    config = load(write_rack(tmp_path))
    zh.lincheck_binary()
    try:
        agreed = Path(os.environ["ZZ_AGREED"]) if os.environ.get("ZZ_AGREED") else None
        rackctl.up(config, agreed=agreed, overrides={"detect_ceiling_ms": 1000})
        asyncio.run(_on_a_rack(config))
    finally:
        rack_down(config)
