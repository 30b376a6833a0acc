# tests/test_exec_pacing.py - batching against execution (zz-agreed exec_inflight and
# exec_hold_ms, docs/agreement.md "Batching against execution"): with every execution
# replica stopped the primary still orders what arrives, each hold released by its timer,
# and once they run again every request is answered. One microbench rack, ~5 s.
from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.test_bench_execution import microbench_rack
from zz import config as zconfig
from zz.client import Client
from zz.execution.apps import microbench as mb
from zz.procrack import DEFAULT_AGREED, ProcRack, signal_group

CLIENTS = 6


def _rack(tmp_path: Path) -> zconfig.Config:
    return microbench_rack(tmp_path, "pacing", CLIENTS, log_window=64)


def _primary_stats(cfg: zconfig.Config, newer_than: float) -> dict[str, Any]:
    p = cfg.rack.run_dir / "s1" / "agreed-0.stats.json"
    try:
        if p.stat().st_mtime > newer_than:
            return dict(json.loads(p.read_text()))
    except (OSError, ValueError):
        pass
    return {}


@pytest.mark.slow
@pytest.mark.skipif(not DEFAULT_AGREED.exists(), reason="make -C agreement first")
def test_primary_orders_while_execution_is_stopped(tmp_path: Path) -> None:
    cfg = _rack(tmp_path)
    op = mb.encode_op(iterations=10)
    want = bytes([mb.STATUS_OK]) + mb.burn(op, 10)

    async def run(rack: ProcRack) -> dict[str, Any]:
        clients = [Client(cfg, c, service="mb") for c in range(CLIENTS)]
        execs = [p for p in rack.procs if p.kind == "exec"]
        try:
            assert await clients[0].invoke(op, timeout=20) == want
            for p in execs:
                signal_group(p.popen.pid, signal.SIGSTOP)
            t0 = time.time()
            start = {}
            while not start:
                await asyncio.sleep(0.2)
                start = _primary_stats(cfg, t0)
            calls = [asyncio.create_task(c.invoke(op, timeout=60)) for c in clients]
            # Nothing is executed, so exec_done stays: every batch beyond it is one hold
            # released by the exec_hold_ms timer.
            deadline = time.monotonic() + 30
            while True:
                await asyncio.sleep(0.2)
                st = _primary_stats(cfg, 0)
                # Every client's request ordered (with external execution "executed"
                # counts what the agreement replicas committed), however the holds split
                # them into batches: one batch may take all of them.
                if st.get("executed", 0) - start["executed"] >= CLIENTS:
                    break
                assert time.monotonic() < deadline, f"primary stopped ordering: {st}"
            assert st["exec_done"] == start["exec_done"]
            assert st["exec_pace_expired"] > start["exec_pace_expired"]
            for p in execs:
                signal_group(p.popen.pid, signal.SIGCONT)
            assert await asyncio.gather(*calls) == [want] * CLIENTS
            return st
        finally:
            for p in execs:  # a failed check must not leave them stopped for the teardown
                signal_group(p.popen.pid, signal.SIGCONT)
            for c in clients:
                await c.close()

    with ProcRack(cfg) as rack:
        rack.start(timeout=20)
        asyncio.run(run(rack))
        assert not rack.dead()
