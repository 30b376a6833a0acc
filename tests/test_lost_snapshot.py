# tests/test_lost_snapshot.py - execution replicas that come back without the snapshot of a
# checkpoint they already reported: the directory store lists a snapshot after the report of
# its seq went out (execution/runtime.py _take_checkpoint), so a power cut in between leaves
# the agreement replicas with that checkpoint stable and the replicas with the one before.
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_execution_faults import start_rig
from tests.test_execution_runtime import CP, KV_GET, KV_PUT, Rig, _kv, _kv_ok, needs_agreed
from zz.snapshots import checkpoint_name, open_store


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from start_rig(tmp_path, [0, 1], {})


def _lose_snapshot(rig: Rig, i: int, seq: int) -> None:
    """Replica i's disk as a cut between the report of checkpoint `seq` and the listing of
    its snapshot leaves it: neither the snapshot nor its manifest file is there."""
    state = rig.cluster.service.exec_state_dir(rig.cluster.config, i)
    store = open_store("dir", root=state / "store", writer=True)
    name = checkpoint_name(seq)
    assert name in store.list_snapshots()
    store.destroy_snapshot(name)
    (state / "manifests" / f"{name}.manifest").unlink()


@pytest.mark.slow
@needs_agreed
def test_replicas_that_lost_the_stable_snapshot_replay_the_log(rig: Rig) -> None:
    """Both active replicas lose the snapshot of the stable checkpoint 2*CP: no peer can
    serve it, so recovering to it (state transfer) could never finish. Each restores CP,
    the snapshot before it, and replays CP+1..2*CP from the agreement replicas' log, which
    they keep from the stable checkpoint before theirs (agreement/src/xlog.c)."""
    execs = rig.execs
    puts = [_kv(KV_PUT, f"k{k}".encode(), b"v%d" % k) for k in range(2 * CP)]
    assert rig.invoke_all(puts) == [_kv_ok()] * (2 * CP)
    rig.wait(
        lambda: all(execs.status(i).get("stable_checkpoint") == 2 * CP for i in (0, 1)),
        "checkpoint 2*CP stable on both replicas",
    )
    for i in (0, 1):
        execs.kill(i)
        _lose_snapshot(rig, i, 2 * CP)
    for i in (0, 1):
        execs.start(i)
    for i in (0, 1):
        rig.wait_linked(i)
    more = [_kv(KV_GET, b"k6"), _kv(KV_PUT, b"after", b"x"), _kv(KV_GET, b"after")]
    assert rig.invoke_all(more) == [_kv_ok(b"v6"), _kv_ok(), _kv_ok(b"x")]
    rig.wait(
        lambda: all(execs.status(i).get("last_executed", 0) >= 2 * CP + 2 for i in (0, 1)),
        "both replicas past the lost checkpoint",
    )
    for i in (0, 1):
        st = execs.status(i)
        assert f"restored checkpoint {checkpoint_name(CP)}" in execs.log_path(i).read_text()
        # Replayed from the log: no recovery was even tried (one that asks the peers, which
        # lost the same snapshot, fails; asking a sleeping spare takes seconds).
        assert st["recovery"] == {} and not st["counters"].get("recoveries_started"), st
        assert st["counters"].get("replayed_to_stable", 0) >= 1, st
