# tests/test_recovery.py - a replica that is behind the agreement cluster's stable execution
# checkpoint recovers (execution/recovery.py, docs/recovery.md): certified checkpoint from g+1
# agreement replicas, manifest from a peer checked against it, files fetched from peers on
# first touch and verified, the rest in the background; a peer serving a corrupted file is
# reported and the file is taken from another peer. Real zz-agreed, real runtime processes.
from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.test_execution_faults import start_rig
from tests.test_execution_runtime import CP, KV_PUT, Rig, _kv, _kv_ok, needs_agreed
from zz.controld.actions import NOTICE_NAME
from zz.controld.warm import WarmStager, replica_sources
from zz.execution.apps.kv import key_path
from zz.execution.runtime import WAKE_NOTICE
from zz.kvop import APPEND as KV_APPEND
from zz.kvop import GET as KV_GET
from zz.snapshots.warm import WARM_DIR

SPARE = 2
KEYS = 3 * CP + 1


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    yield from start_rig(tmp_path, [0, 1], {})


def _fill(rig: Rig) -> int:
    """PUT k0.. through replicas 0 and 1 until the agreement replicas hold a stable
    execution checkpoint above 0 and their log no longer reaches back to seq 1 (a spare
    started at 0 must recover, not replay); returns replicas 0 and 1's stable checkpoint."""
    puts = [_kv(KV_PUT, f"k{k}".encode(), b"v%d" % k) for k in range(KEYS)]
    assert rig.invoke_all(puts) == [_kv_ok()] * KEYS
    rig.wait(
        lambda: all(rig.execs.status(i).get("stable_checkpoint", 0) >= 2 * CP for i in (0, 1)),
        "a stable checkpoint on replicas 0 and 1",
    )
    # An agreement replica keeps the log from the stable checkpoint before its last one
    # (agreement/src/xlog.c advance_stable). One that held its stable checkpoint until the
    # reports were certified and then advanced once, straight to 3*CP, still keeps it from
    # seq 1: a spare started then replayed the whole log, never recovered, and the test
    # timed out waiting for its recovery (seen at load 8). The next checkpoint seq, once
    # stable there, is its second advance.
    n = rig.cluster.n
    if not all(rig.cluster.stats(r).get("exec_stable_advances", 0) >= 2 for r in range(n)):
        more = [_kv(KV_PUT, b"k0", b"v0")] * CP
        assert rig.invoke_all(more, client_index=5) == [_kv_ok()] * CP

    def settled() -> bool:
        """Every agreement replica advanced twice, and all of them and replicas 0 and 1's
        status files (written once a second) name the same last batch and stable checkpoint:
        what the callers read from replica 0's status is current."""
        agreed = [rig.cluster.stats(r) for r in range(n)]
        if any(a.get("exec_stable_advances", 0) < 2 for a in agreed):
            return False
        seen = {(a["last_exec"], a["exec_stable"]) for a in agreed}
        for i in (0, 1):
            st = rig.execs.status(i)
            seen.add((st["last_executed"], st.get("stable_checkpoint")))
        return len(seen) == 1

    rig.wait(settled, "the agreement replicas' log collected below a stable checkpoint")
    return min(rig.execs.status(i)["stable_checkpoint"] for i in (0, 1))


def _wait_spare_checkpoint_matches(rig: Rig) -> None:
    """Wait until the spare holds a stable checkpoint within the last interval of what it
    executed, with no mismatch: its own checkpoint matches replica 0's."""
    execs = rig.execs
    n = execs.status(SPARE)["last_executed"]
    rig.wait(
        lambda: (
            execs.status(SPARE).get("stable_checkpoint", 0) > n - CP
            and not execs.status(SPARE)["checkpoint_mismatches"]
        ),
        "the spare's own checkpoint stable",
    )
    assert not execs.status(SPARE)["checkpoint_mismatches"]


def _snapshot_dir(rig: Rig, i: int, seq: int) -> Path:
    """Where the dir store keeps replica i's snapshot of checkpoint seq."""
    base = rig.cluster.run_dir / f"exec-{i}" / "store"
    hits = [p for p in base.rglob(f"ckpt-{seq}") if p.is_dir()]
    assert hits, f"no snapshot ckpt-{seq} under {base}"
    return hits[0]


@pytest.mark.slow
@needs_agreed
def test_spare_recovers_on_demand_and_serves_clients(rig: Rig) -> None:
    execs = rig.execs
    _fill(rig)
    execs.start(SPARE)
    rig.wait_linked(SPARE)
    rig.wait(lambda: execs.status(SPARE).get("recovery", {}).get("checkpoint"), "recovery")
    rec = execs.status(SPARE)["recovery"]
    assert rec["checkpoint"] >= 2 * CP and rec["checkpoint"] % CP == 0
    phases = rec["install_phases_ms"]
    assert list(phases) == ["manifest", "reconcile", "fetch", "open", "record"], phases
    assert sum(phases.values()) <= rec["install_ms"] + 1, rec
    # Replica 1 leaves: f+1 = 2 matching replies now need the recovered replica. Reading
    # old keys makes it fetch their files on first touch (or finds them fetched already
    # by the background loop): either way the values must be the certified ones.
    assert execs.stop(1) == 0
    got = rig.invoke_all([_kv(KV_GET, f"k{k}".encode()) for k in range(KEYS)], client_index=1)
    assert got == [_kv_ok(b"v%d" % k) for k in range(KEYS)]
    more = [_kv(KV_PUT, b"after", b"x"), _kv(KV_GET, b"after")]
    assert rig.invoke_all(more, client_index=2) == [_kv_ok(), _kv_ok(b"x")]
    st = execs.status(SPARE)
    assert st["counters"].get("recoveries") == 1
    # Fully fetched, it takes a checkpoint of its own that holds the whole state and
    # agrees with replica 0's (stable needs f+1 = 2 matching: 0 and the spare).
    n = st["last_executed"]
    extra = [_kv(KV_PUT, b"x%d" % k, b"y") for k in range(2 * CP)]
    assert rig.invoke_all(extra, client_index=3) == [_kv_ok()] * (2 * CP)
    rig.wait(
        lambda: (
            execs.status(SPARE).get("stable_checkpoint", 0) > n
            and execs.status(SPARE).get("recovery", {}).get("complete_at_checkpoint")
        ),
        "the recovered replica's own checkpoint stable and complete",
    )
    assert not execs.status(SPARE)["recovering"]


@pytest.mark.slow
@needs_agreed
def test_corrupted_peer_file_is_rejected_and_fetched_elsewhere(rig: Rig) -> None:
    execs = rig.execs
    _fill(rig)
    # No requests follow, so no new checkpoint: the spare recovers to this one.
    seq = min(execs.status(i)["stable_checkpoint"] for i in (0, 1))
    victim = key_path(b"k1")
    # The spare (index 2) asks peers from index+1 on: replica 0 first. Corrupt its copy.
    path = _snapshot_dir(rig, 0, seq) / victim
    path.write_bytes(path.read_bytes() + b"corrupt")
    execs.start(SPARE)
    rig.wait_linked(SPARE)
    rig.wait(lambda: execs.status(SPARE).get("recovery", {}).get("checkpoint"), "recovery")
    # The background loop fetches everything; the corrupted file must come from replica 1.
    rig.wait(
        lambda: execs.status(SPARE).get("recovery", {}).get("background_s") is not None,
        "background fetch done",
        timeout=60,
    )
    bad = execs.status(SPARE)["recovery"].get("bad_sources", [])
    assert any(b["source"] == "x0" and b["path"] == victim for b in bad), bad
    live = rig.cluster.run_dir / f"exec-{SPARE}"
    files = [p for p in live.rglob(victim.split("/")[-1]) if "live" in p.parts]
    assert files and all(b"corrupt" not in p.read_bytes() for p in files)
    # The status file's totals (controld's zz_execution_fetch_* metrics): files fetched and
    # verified, bytes, and the bad copy rejected.
    fetch = execs.status(SPARE)["fetch"]
    assert fetch["bad_content"] >= 1 and fetch["bytes_fetched"] > 0, fetch
    assert fetch.get("fetched_foreground", 0) + fetch.get("fetched_background", 0) >= 1, fetch


@pytest.mark.slow
@needs_agreed
def test_spare_asleep_until_the_wake_notice(rig: Rig) -> None:
    execs = rig.execs
    execs.args[SPARE] = ["--start-asleep"]
    execs.start(SPARE)
    rig.wait(lambda: execs.status(SPARE).get("asleep") is True, "spare up and asleep")
    _fill(rig)
    st = execs.status(SPARE)
    assert st["last_executed"] == 0 and st["agreement_links_up"] == 0
    # What controld writes when it wakes a replica (controld/actions.py wake_notice).
    assert NOTICE_NAME == WAKE_NOTICE
    notice = rig.cluster.service.exec_state_dir(rig.cluster.config, SPARE) / WAKE_NOTICE
    notice.write_text(json.dumps({"recovering_from_seq": 1, "woken_at": time.time()}))
    rig.wait(lambda: execs.status(SPARE).get("recovery", {}).get("checkpoint"), "recovery")
    st = execs.status(SPARE)
    assert not st["asleep"] and st["counters"].get("wake_notices") == 1
    assert execs.stop(0) == 0  # now the client needs the woken spare
    got = rig.invoke_all([_kv(KV_GET, f"k{k}".encode()) for k in range(KEYS)], client_index=1)
    assert got == [_kv_ok(b"v%d" % k) for k in range(KEYS)]


@pytest.mark.slow
@needs_agreed
def test_restart_from_a_snapshot_that_lacks_files_fetches_them(rig: Rig) -> None:
    """A checkpoint taken while the replica was still fetching a recovered state lacks
    the files it had not fetched yet; restarted from it, the replica fetches them again
    instead of refusing to start."""
    execs = rig.execs
    _fill(rig)
    assert execs.stop(1) == 0
    seq = execs.status(1)["last_checkpoint"]
    victim = _snapshot_dir(rig, 1, seq) / key_path(b"k3")
    victim.unlink()
    execs.start(1)
    rig.wait_linked(1)
    st = execs.status(1)
    assert st["recovery"].get("restored_incomplete") == f"ckpt-{seq}", st
    got = rig.invoke_all([_kv(KV_GET, b"k3"), _kv(KV_PUT, b"z", b"1")], client_index=4)
    assert got == [_kv_ok(b"v3"), _kv_ok()]


@pytest.mark.slow
@needs_agreed
@pytest.mark.parametrize("replay_all", [False, True], ids=["skip-reads", "replay-all"])
def test_replay_skips_certified_reads(rig: Rig, replay_all: bool) -> None:
    """ZZ §4.7.2: a recovering replica replays the log above the certified checkpoint; the
    batches g+1 agreement replicas vouch are certified need no report, and their ordered
    reads are not run again. Its state, reply cache included, still matches the others'."""
    execs, cluster = rig.execs, rig.cluster
    _fill(rig)
    last = execs.status(0)["last_executed"]
    reads = (CP - 1 - last % CP) % CP or CP  # so that reads sit above the last checkpoint
    got = _invoke_reads(rig, [f"k{k % KEYS}".encode() for k in range(reads)])
    assert got == [_kv_ok(b"v%d" % (k % KEYS)) for k in range(reads)]
    last += reads
    above = last % CP  # batches the spare replays above the stable checkpoint
    skippable = min(reads, above)  # the reads among them (the last ones)
    assert skippable > 0
    rig.wait(
        lambda: all(cluster.stats(r)["exec_certificates"] >= last for r in range(cluster.n)),
        "every batch certified at every agreement replica",
    )
    if replay_all:
        execs.args[SPARE] = ["--replay-all"]
    execs.start(SPARE)
    rig.wait(lambda: execs.status(SPARE).get("last_executed") == last, "the spare caught up")
    st = execs.status(SPARE)
    assert st["recovery"]["checkpoint"] == last - above
    counters = st["counters"]
    assert counters.get("reads_skipped", 0) == (0 if replay_all else skippable)
    assert counters.get("replayed_certified", 0) == (0 if replay_all else above)
    # Only the spare can complete a certificate now: its values must be the certified ones,
    # and its next checkpoint (reply cache included) must match replica 0's.
    assert execs.stop(1) == 0
    keys = [f"k{k}".encode() for k in range(CP)]
    assert _invoke_reads(rig, keys, client_index=1) == [_kv_ok(b"v%d" % k) for k in range(CP)]
    _wait_spare_checkpoint_matches(rig)


@pytest.mark.slow
@needs_agreed
@pytest.mark.parametrize("flush_first", [False, True], ids=["flush-after", "flush-first"])
def test_first_reporting_batch_runs_on_the_replayed_writes(rig: Rig, flush_first: bool) -> None:
    """A spare replays certified PUTs of one key, kept in memory and written once for the
    run (docs/recovery.md "Each file written once per run"); the batch right after them,
    committed but certified by nobody (replica 1 is stopped), is the first it reports: a
    GET of that key and a PUT of another. It runs on the buffered writes, and the files
    are written after its replies and report (counter `reported_before_flush`), or before
    it with --flush-replay-first (the baseline). Either way it answers the replayed value
    and its next checkpoint, which hashes the files, matches replica 0's."""
    execs, cluster = rig.execs, rig.cluster
    _fill(rig)
    last = execs.status(0)["last_executed"]
    puts = (CP - 2 - last % CP) % CP or CP  # the first batch to report: no checkpoint seq
    got = rig.invoke_all([_kv(KV_PUT, b"r", b"w%d" % k) for k in range(puts)], client_index=3)
    assert got == [_kv_ok()] * puts
    last += puts
    above = last % CP
    assert above > 0
    rig.wait(
        lambda: all(cluster.stats(r)["exec_certificates"] >= last for r in range(cluster.n)),
        "every batch certified at every agreement replica",
    )
    assert execs.stop(1) == 0
    # Ordered, executed by replica 0 alone: its client waits for the spare's reply.
    first = ThreadPoolExecutor(1)
    answer = first.submit(
        rig.invoke_all, [_kv(KV_GET, b"r"), _kv(KV_PUT, b"s", b"x")], client_index=4
    )
    try:
        rig.wait(
            lambda: all(cluster.stats(r)["last_exec"] >= last + 1 for r in range(cluster.n)),
            "the GET's batch committed",
        )
        if flush_first:
            execs.args[SPARE] = ["--flush-replay-first"]
        execs.start(SPARE)
        assert answer.result(timeout=60) == [_kv_ok(b"w%d" % (puts - 1)), _kv_ok()]
    finally:
        first.shutdown(wait=False, cancel_futures=True)
    rig.wait(lambda: execs.status(SPARE)["last_executed"] > last, "the spare's status")
    st = execs.status(SPARE)
    assert st["recovery"]["checkpoint"] == last - above
    assert st["counters"].get("replayed_certified", 0) == above
    assert st["counters"].get("reported_before_flush", 0) == (0 if flush_first else 1)
    _wait_spare_checkpoint_matches(rig)


@pytest.mark.slow
@needs_agreed
def test_checkpoint_collected_while_recovering_from_it(rig: Rig) -> None:
    """The spare recovers to checkpoint s and replays a PUT of the victim key; the victim's
    file of s cannot be read (moved aside on both peers, in every checkpoint that holds
    those bytes: a copy with their hash would be served, docs/recovery.md "Copies by
    hash") until the peers have gone on and collected s. Then the spare gets the later
    checkpoint's copy (FILE-DATA "later"), which fails its hash check: it blames nobody,
    drops the half-run batch, recovers to the newer stable checkpoint and goes on; its
    answers are the certified ones. (Found on a rack of guests: a woken spare blamed every
    peer for such a file, forever, and never answered.)"""
    execs = rig.execs
    s = _fill(rig)
    # The background loop (one file, then a long pause) must not fetch the victim first.
    victim = max((f"k{k}".encode() for k in range(min(s, KEYS))), key=key_path)
    for i in (0, 1):
        for snap in _snapshot_dir(rig, i, s).parent.glob("ckpt-*"):  # s, and older ones kept
            f = snap / key_path(victim)
            if f.exists():
                f.rename(f.with_name(f.name + ".aside"))
    # Above s, below the next checkpoint: the spare replays it from s. An APPEND reads
    # the old value (a PUT would not: it is applied without it, and fetch nothing).
    assert rig.invoke_all([_kv(KV_APPEND, victim, b"+")], client_index=1) == [_kv_ok()]
    execs.args[SPARE] = ["--background-pause", "600"]  # the victim stays pending
    execs.start(SPARE)
    rig.wait_linked(SPARE)
    rig.wait(lambda: execs.status(SPARE).get("recovery", {}).get("checkpoint") == s, "recovery")
    ops = [_kv(KV_PUT, b"more%d" % k, b"m") for k in range(3 * CP)]
    assert rig.invoke_all(ops, client_index=1) == [_kv_ok()] * len(ops)
    rig.wait(
        lambda: execs.status(SPARE)["counters"].get("stranded", 0) >= 1,
        "the spare's fetch of a collected checkpoint's changed file",
    )

    # The agreement replicas count the spare asleep and push it no batches: it learns them
    # only from the log its registrations bring, and registers again once a peer signed a
    # checkpoint above it (docs/recovery.md step 4). Its second recovery happens as the
    # PUTs end (s is collected only once a later checkpoint is stable), so its last
    # registration may be answered before the last PUT's batch is committed: it is then
    # behind replica 0's last batch until a batch comes to it, and only the peers' last
    # checkpoint is a point it must reach (waiting for replica 0's last batch timed out).
    def recovered_again() -> bool:
        st, peer_ckpt = execs.status(SPARE), execs.status(0).get("last_checkpoint", 1 << 64)
        return st["counters"].get("recoveries", 0) >= 2 and st["last_executed"] >= peer_ckpt

    rig.wait(recovered_again, "the spare's second recovery and replay to the peers' checkpoint")
    st = execs.status(SPARE)
    assert st["recovery"]["checkpoint"] > s, st
    assert not st["recovery"].get("bad_sources"), st["recovery"]
    # One more batch, not pushed to the spare (nothing makes it ask for one whose seq is
    # no checkpoint's): in most runs the spare is behind replica 0 when replica 1 stops,
    # which the race above left in a few, and the woken spare is served the log it lacks.
    assert rig.invoke_all([_kv(KV_PUT, b"last", b"l")], client_index=3) == [_kv_ok()]
    # Only the spare can complete a certificate now: the victim's value must be the new one.
    assert execs.stop(1) == 0
    got = rig.invoke_all([_kv(KV_GET, victim), _kv(KV_GET, b"k0")], client_index=2)
    assert got == [_kv_ok(b"v" + victim[1:] + b"+"), _kv_ok(b"v0")]


@pytest.fixture
def drill_rig(tmp_path: Path) -> Iterator[Rig]:
    """Replica 0 takes faults from its fault file (zz-fault.json, as drills write it)."""
    yield from start_rig(tmp_path, [0, 1], {0: ["--drill-faults"]})


@pytest.mark.slow
@needs_agreed
def test_corrupt_snapshot_fault_serves_wrong_bytes_that_are_rejected(drill_rig: Rig) -> None:
    """The corrupt-snapshot fault (the drills' Byzantine storage on ZFS, where a snapshot
    cannot be changed from outside): replica 0 certifies the right digest but its snapshot
    holds one flipped byte per file, and its live state stays right. Once that checkpoint
    is stable it lies too. The spare recovers from it, asks replica 0 first, rejects its
    files and takes them from replica 1."""
    rig, execs = drill_rig, drill_rig.execs
    _fill(rig)
    (rig.cluster.run_dir / "exec-0" / "zz-fault.json").write_text('{"fault": "corrupt-snapshot"}')
    rig.wait(lambda: execs.status(0).get("inject_fault") == "corrupt-snapshot", "the fault")
    # That status was written after the fill: its last_executed is current. Up to the
    # next checkpoint and no further (one PUT is one batch here): lies start after it,
    # and with two active replicas a lie stalls the client.
    last = execs.status(0)["last_executed"]
    c = (last // CP + 1) * CP
    ops = [_kv(KV_PUT, b"k%d" % k, b"w%d" % k) for k in range(c - last)]
    assert rig.invoke_all(ops, client_index=1) == [_kv_ok()] * len(ops)
    rig.wait(lambda: all(execs.status(i)["stable_checkpoint"] >= c for i in (0, 1)), "stable")
    st0 = execs.status(0)
    assert st0["counters"].get("snapshot_files_corrupted", 0) > 0, st0["counters"]
    assert not st0["counters"].get("wrong_replies") and not st0["checkpoint_mismatches"]
    key = key_path(b"k0")
    snap0, snap1 = _snapshot_dir(rig, 0, c), _snapshot_dir(rig, 1, c)
    assert (snap0 / key).read_bytes() != (snap1 / key).read_bytes()
    live0 = [
        p
        for p in (rig.cluster.run_dir / "exec-0").rglob(key.rsplit("/", 1)[1])
        if "live" in p.parts
    ]
    assert live0 and all(p.read_bytes() == (snap1 / key).read_bytes() for p in live0)
    execs.start(SPARE)
    rig.wait_linked(SPARE)
    rig.wait(lambda: execs.status(SPARE).get("recovery", {}).get("checkpoint") == c, "recovery")
    rig.wait(
        lambda: execs.status(SPARE).get("recovery", {}).get("background_s") is not None,
        "background fetch done",
        timeout=60,
    )
    bad = execs.status(SPARE)["recovery"].get("bad_sources", [])
    assert any(b["source"] == "x0" for b in bad), bad
    assert not any(b["source"] == "x1" for b in bad), bad
    # Replica 0 lies from here on; 1 and the spare agree.
    got = rig.invoke_all([_kv(KV_GET, b"k0"), _kv(KV_GET, b"k%d" % (KEYS - 1))], 2)
    assert got == [_kv_ok(b"w0"), _kv_ok(b"v%d" % (KEYS - 1))]
    rig.wait(lambda: execs.status(0)["counters"].get("wrong_replies", 0) > 0, "the lies")


def _invoke_reads(rig: Rig, keys: list[bytes], client_index: int = 0) -> list[bytes]:
    """GETs as ordered reads (the client's read_only with execution replicas)."""

    async def drive() -> list[bytes]:
        client = rig.cluster.client(client_index)
        try:
            return [await client.invoke(_kv(KV_GET, k), read_only=True, timeout=30) for k in keys]
        finally:
            await client.close()

    return asyncio.run(drive())


@pytest.mark.slow
@needs_agreed
@pytest.mark.parametrize("forged", ["file", "manifest"])
def test_woken_spare_takes_what_its_host_staged_only_when_it_hashes_right(
    rig: Rig, forged: str
) -> None:
    """A warm spare (docs/recovery.md "A warm spare"): while it sleeps, what controld stages
    for it (controld/warm.py, fetched over FILE-FETCH signed with its key) holds its recovery
    checkpoint's manifest and files. The woken spare takes them instead of asking its peers,
    but only what hashes to the certified manifest: a forged staged file or manifest is a
    miss (fetched from a peer), nobody is blamed, and the values served are the certified
    ones."""
    execs, cluster = rig.execs, rig.cluster
    svc, config = cluster.service, cluster.config
    execs.args[SPARE] = ["--start-asleep"]
    execs.start(SPARE)
    rig.wait(lambda: execs.status(SPARE).get("asleep") is True, "spare up and asleep")
    seq = _fill(rig)
    state = svc.exec_state_dir(config, SPARE)
    stager = WarmStager(state, replica_sources(config, svc, SPARE))
    try:
        assert stager.stage(seq), stager.counters
    finally:
        stager.close()
    assert stager.counters["files_staged"] >= KEYS, stager.counters
    warm = state / WARM_DIR
    if forged == "file":
        victim = _snapshot_dir(rig, 0, seq) / key_path(b"k1")
        staged = warm / hashlib.sha256(victim.read_bytes()).hexdigest()
        staged.write_bytes(bytes(len(staged.read_bytes())))  # same size, wrong bytes
    else:
        enc = (svc.exec_state_dir(config, 0) / "manifests" / f"ckpt-{seq}.manifest").read_bytes()
        staged = warm / hashlib.sha256(enc).hexdigest()
        staged.write_bytes(enc[:-1] + bytes([enc[-1] ^ 1]))
    notice = state / WAKE_NOTICE
    last = execs.status(0)["last_executed"]
    notice.write_text(json.dumps({"recovering_from_seq": last + 1, "woken_at": time.time()}))
    rig.wait(lambda: execs.status(SPARE).get("recovery", {}).get("checkpoint"), "recovery")
    assert execs.status(SPARE)["recovery"]["checkpoint"] == seq
    assert execs.stop(0) == 0  # now the client needs the woken spare
    got = rig.invoke_all([_kv(KV_GET, f"k{k}".encode()) for k in range(KEYS)], client_index=1)
    assert got == [_kv_ok(b"v%d" % k) for k in range(KEYS)]
    t = time.monotonic()  # the runtime's status carries its monotonic clock: the same one
    rig.wait(lambda: execs.status(SPARE)["mono_now"] > t, "a status written since")
    st = execs.status(SPARE)
    assert not st["recovery"].get("bad_sources"), st["recovery"]
    if forged == "file":
        assert st["warm"].get("manifest_hit") == 1 and st["warm"].get("mismatched") == 1, (
            st["warm"], st["fetch"], st["recovery"])
        assert st["fetch"].get("fetched_warm", 0) >= KEYS - 1, st["fetch"]
    else:
        assert st["warm"].get("manifest_mismatched") == 1 and not st["warm"].get("manifest_hit")
