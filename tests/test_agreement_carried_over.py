# tests/test_agreement_carried_over.py - a view change that carries over seqs some replicas
# executed and others only prepared (PBFT, TOCS §4.5: the protocol runs again in the new view
# for every seq between min-s and max-s, but no replica executes a request twice).
from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import REPO, Cluster, running_cluster
from zz.procrack import signal_group

pytestmark = pytest.mark.skipif(
    not (REPO / "agreement" / "src" / "main.c").exists(), reason="zz-agreed not written yet"
)

REQUEST_TIMEOUT = 60.0


async def _requests(c: Cluster, n: int, tag: str) -> list[tuple[bytes, bytes]]:
    cl = c.client(0)
    out = []
    try:
        for k in range(n):
            op = f"{tag}-{k}".encode()
            out.append((op, await cl.invoke(op, timeout=REQUEST_TIMEOUT)))
    finally:
        await cl.close()
    return out


def _execs(c: Cluster, replicas: Any = None) -> list[int]:
    return [s["last_exec"] for s in c.stats_all(replicas)]


def test_replicas_past_a_carried_over_seq_commit_it_in_the_new_view(tmp_path: Path) -> None:
    """Replicas 0 and 1 send their view-0 COMMITs for seqs 3..5 to nobody but each other
    (`byzantine_commits`), so they execute those seqs while 2 and 3 have them prepared and
    stop at 2. Primary 0 then pauses: 1, 2 and 3 move to view 1, whose NEW-VIEW carries
    3..5 (and what followed) over. 1, ahead, must prepare and commit them again in view 1
    without executing them twice, or 2 and 3 never get 2g+1 COMMITs: they time out view
    after view (the livelock of a power-loss run). When 0 runs again it joins and does the
    same; all four end at the same seq and state and the cluster keeps answering."""
    withhold = {"byzantine_commits": "0:3-5:2,3"}
    with running_cluster(
        tmp_path, g=1, view_timeout_ms=500, overrides_per_replica={0: withhold, 1: withhold}
    ) as c:
        first = asyncio.run(_requests(c, 8, "before"))
        assert all(op == res for op, res in first)
        top = _execs(c, [0, 1])[0]
        c.wait_for(lambda: _execs(c) == [top, top, 2, 2], timeout=20, what="2 and 3 at seq 2")
        assert top >= 5

        signal_group(c.procs[0].pid, signal.SIGSTOP)
        try:

            async def during_pause() -> list[tuple[bytes, bytes]]:
                task = asyncio.create_task(_requests(c, 1, "paused"))
                try:
                    while True:
                        st = c.stats_all([1, 2, 3])
                        if all(s["view"] >= 1 and not s["in_view_change"] for s in st):
                            break
                        if task.done():
                            break
                        await asyncio.sleep(0.2)
                finally:
                    signal_group(c.procs[0].pid, signal.SIGCONT)
                return await task

            paused = asyncio.run(during_pause())
        finally:
            signal_group(c.procs[0].pid, signal.SIGCONT)
        assert all(op == res for op, res in paused)

        c.wait_for(
            lambda: len(set(_execs(c))) == 1 and _execs(c)[0] > top,
            timeout=30,
            what="all four at the same executed seq",
        )
        after = asyncio.run(_requests(c, 4, "after"))
        assert all(op == res for op, res in after)
        c.wait_for(
            lambda: len({(s["last_exec"], s["app_digest"]) for s in c.stats_all()}) == 1,
            timeout=30,
            what="all four at the same seq and state",
        )
        views = [s["view"] for s in c.stats_all()]
        assert min(views) >= 1, views
        # Nothing ran twice: every replica executed each request once.
        executed = [s["executed"] for s in c.stats_all()]
        assert executed == [8 + 1 + 4] * 4, executed
