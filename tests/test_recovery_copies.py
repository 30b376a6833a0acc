# tests/test_recovery_copies.py - the campaign's f = 2 rounds 53 and 76 (seeds 3401/3402): the
# replicas that alone held a checkpoint's files went faulty while the only correct one was
# still recovering. A file is served by its certified hash from any copy (docs/recovery.md
# "Copies by hash"), so a fresh replica recovers from the recovering one's verified files.
# Real zz-agreed, real runtime processes.
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_execution_faults import start_rig
from tests.test_execution_runtime import CP, KV_PUT, Rig, _kv, _kv_ok, needs_agreed
from zz.execution.apps.kv import key_path
from zz.kvop import GET as KV_GET

KEYS = 3 * CP + 1
SPARE = 2


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from start_rig(tmp_path, [0, 1], {})


def _only_the_recovering_spare_left(rig: Rig, corrupt: bytes | None = None) -> None:
    """Replicas 0 and 1 hold the stable checkpoints; the spare recovers and fetches every
    file, but takes no checkpoint since, so it serves nothing by path. With `corrupt`, one
    bit of that key's file in the spare's live state is flipped (same size: only the hash
    tells). Then 0 and 1 fail: 0 stops, 1 comes back with its state wiped, as a fresh spare
    would, and recovers with the spare as its only source."""
    execs, cluster = rig.execs, rig.cluster
    puts = [_kv(KV_PUT, f"k{k}".encode(), b"v%d" % k) for k in range(KEYS)]
    assert rig.invoke_all(puts) == [_kv_ok()] * KEYS
    rig.wait(
        lambda: all(execs.status(i).get("stable_checkpoint", 0) >= 2 * CP for i in (0, 1)),
        "a stable checkpoint on replicas 0 and 1",
    )
    execs.start(SPARE)
    rig.wait_linked(SPARE)
    rig.wait(
        lambda: execs.status(SPARE).get("recovery", {}).get("background_s") is not None,
        "the spare recovered and fetched every file",
        timeout=60,
    )
    st = execs.status(SPARE)
    # The round-53 situation: the one correct replica left holds no complete checkpoint.
    assert st["recovering"] and "complete_at_checkpoint" not in st["recovery"], st["recovery"]
    if corrupt is not None:
        live = cluster.run_dir / f"exec-{SPARE}" / "store" / "live" / key_path(corrupt)
        data = live.read_bytes()
        live.write_bytes(bytes([data[0] ^ 1]) + data[1:])
    assert execs.stop(0) == 0
    assert execs.stop(1) == 0
    shutil.rmtree(cluster.service.exec_state_dir(cluster.config, 1))
    execs.status_path(1).unlink()
    execs.start(1)
    rig.wait_linked(1)


@pytest.mark.slow
@needs_agreed
def test_a_file_only_faulty_replicas_held_is_fetched_from_a_recovering_peer(rig: Rig) -> None:
    """Before, replica 1 found no source for the manifest or any file ("x2: refused") and
    never recovered; now the spare serves its verified files by hash and both answer."""
    execs = rig.execs
    _only_the_recovering_spare_left(rig)
    rig.wait(
        lambda: execs.status(1).get("recovery", {}).get("background_s") is not None,
        "replica 1 recovered from the spare's copies and fetched every file",
        timeout=60,
    )
    # f+1 = 2 matching replies need both: the certified values, from the copies.
    got = rig.invoke_all([_kv(KV_GET, f"k{k}".encode()) for k in range(KEYS)], client_index=1)
    assert got == [_kv_ok(b"v%d" % k) for k in range(KEYS)]
    st1 = execs.status(1)
    assert st1["recovery"].get("bad_sources", []) == [], st1["recovery"]
    assert st1["fetch"].get("fetched_copies", 0) >= 1, st1["fetch"]
    assert execs.status(SPARE)["counters"].get("file_copies_served", 0) >= 1


@pytest.mark.slow
@needs_agreed
def test_a_copy_whose_bytes_do_not_hash_right_is_never_sent(rig: Rig) -> None:
    """The spare's copy of k5's file no longer hashes to what its manifest says: the spare
    reads it, counts it and does not send it. Replica 1 gets every other file, blames
    nobody, and keeps k5's pending (no right copy is reachable); the keys it has answer."""
    execs = rig.execs
    _only_the_recovering_spare_left(rig, corrupt=b"k5")
    rig.wait(
        lambda: execs.status(SPARE)["counters"].get("file_copies_mismatched", 0) >= 1,
        "the spare skipped its changed copy",
        timeout=60,
    )
    rig.wait(
        lambda: (
            execs.status(1).get("files_pending") == 1
            and execs.status(1)["fetch"].get("fetched_background", 0) >= 1
        ),
        "replica 1 fetched everything else",
        timeout=60,
    )
    st1 = execs.status(1)
    assert st1["recovery"].get("bad_sources", []) == [], st1["recovery"]
    assert st1["fetch"].get("bad_content", 0) == 0, st1["fetch"]
    live1 = rig.cluster.run_dir / "exec-1" / "store" / "live" / key_path(b"k5")
    assert not live1.exists()
    keys = [f"k{k}".encode() for k in range(KEYS) if k != 5]
    got = rig.invoke_all([_kv(KV_GET, k) for k in keys], client_index=1)
    assert got == [_kv_ok(b"v" + k[1:]) for k in keys]
