# tests/test_bench_execution.py - smoke test of zz/procrack.py, the launcher behind
# scripts/bench/execution: one microbench service, 4 agreement + 2 active execution replicas.
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from zz import config as zconfig
from zz import keys as zkeys
from zz.client import Client
from zz.execution.apps import microbench as mb
from zz.ports import free_base
from zz.procrack import DEFAULT_AGREED, ProcRack


def microbench_rack(
    tmp_path: Path, name: str = "smoke", clients: int = 4, log_window: int = 32
) -> zconfig.Config:
    """One microbench service, f = g = 1, both execution replicas active, on one simulated
    host, keys made (also tests/test_exec_pacing.py's rack)."""
    # Agreement ports base .. base+3 and execution ports base+64 .. base+66 must be free.
    base = free_base(range(68))
    path = tmp_path / "rack.toml"
    path.write_text(
        f"""[rack]
name = "{name}"
checkpoint_interval = 16
log_window = {log_window}

[[hosts]]
name = "h0"
address = "127.0.0.1"
libvirt_uri = "test:///default"

[[services]]
name = "mb"
id = 1
g = 1
f = 1
active = 2
app = "microbench"
clients = {clients}
base_port = {base}
"""
    )
    cfg = zconfig.load(path)
    zkeys.generate(cfg)
    return cfg


@pytest.mark.slow
@pytest.mark.skipif(not DEFAULT_AGREED.exists(), reason="make -C agreement first")
def test_procrack_runs_microbench_and_leaves_nothing(tmp_path: Path) -> None:
    cfg = microbench_rack(tmp_path)
    op = mb.encode_op(iterations=200)
    want = bytes([mb.STATUS_OK]) + mb.burn(op, 200)

    async def load() -> list[int]:
        clients = [Client(cfg, c, service="mb") for c in range(2)]
        done = [0, 0]
        end = time.monotonic() + 2.0

        async def loop(k: int) -> None:
            while time.monotonic() < end:
                assert await clients[k].invoke(op, timeout=20) == want
                done[k] += 1

        try:
            await asyncio.gather(loop(0), loop(1))
        finally:
            for c in clients:
                await c.close()
        return done

    with ProcRack(cfg) as rack:
        rack.start(timeout=20)
        # f+1 = 2 active execution replicas (0 and 1); replica 2 sleeps = not started.
        assert sorted(p.name for p in rack.procs if p.kind == "exec") == [
            "mb/exec-0",
            "mb/exec-1",
        ]
        done = asyncio.run(load())
        assert all(n > 0 for n in done), done
        assert not rack.dead()
        assert set(rack.cpu_seconds()) == {p.name for p in rack.procs}
    report = rack.last_stop
    assert report is not None
    assert report.clean, report
    assert all(p.popen.poll() is not None for p in rack.procs)
    assert rack.leftovers() == []
