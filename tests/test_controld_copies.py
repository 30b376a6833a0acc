# tests/test_controld_copies.py - controld serves a convicted replica's forensic state by hash
# (controld/snapshots.py, docs/recovery.md "Copies by hash"): a file no live replica's
# checkpoint holds any more is fetched and verified from it; a forensic copy whose bytes do
# not hash right is never sent, only counted. In-process controld, real socket, the
# runtime's own fetch client (PeerSource, StateFetcher, fetch_manifest).
from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from test_controld_daemon import Node, Rack, make_rack
from test_controld_fileserve import FILES, SEQ, _checkpoint, _datasets, _exec_key, _source, node

from tests import zfs_pool
from zz import wire
from zz.controld import actions
from zz.execution.recovery import fetch_manifest
from zz.naming import zfs_dataset
from zz.snapshots.fetch import StateFetcher
from zz.snapshots.manifest import scan
from zz.snapshots.store import checkpoint_name
from zz.snapshots.zfs import ZfsStore

__all__ = ["node"]  # the fixture, found here by pytest

REQUESTER = 2  # execution replica 2 recovers; replica 0 (on this controld's host) was convicted


def _convict(rack: Rack) -> Path:
    """Replica 0's state with checkpoint SEQ set aside the way controld keeps a convicted
    replica's (controld/actions.py set_aside_state, directory store): exec-0 becomes
    exec-0.forensic-<seq>, and its successor starts an empty exec-0."""
    svc = rack.config.services[0]
    state = svc.exec_state_dir(rack.config, 0)
    kept = state.with_name(f"{state.name}.forensic-{SEQ + 3}")
    state.rename(kept)
    state.mkdir()
    return kept


def _recover(port: int, rack: Rack, local: Path, digest: bytes) -> StateFetcher:
    """What a recovering runtime does with controld as its one source: the manifest of SEQ
    checked against the certified digest, then every file fetched and verified."""
    src = _source(port, wire.exec_principal(REQUESTER), _exec_key(rack, REQUESTER))
    bad: list[tuple[str, str, str]] = []
    try:
        manifest = fetch_manifest([src], SEQ, digest, on_bad_source=lambda *a: bad.append(a))
        fetcher = StateFetcher(local, manifest, SEQ, [src], on_bad_source=lambda *a: bad.append(a))
        fetcher.prepare()
        fetcher.fetch_all()
    finally:
        src.close()
    assert bad == []  # controld never sent a byte that failed a check
    return fetcher


async def test_a_file_only_a_convicted_replica_held_is_fetched_from_its_forensic_copy(
    node: tuple[Rack, Node], tmp_path: Path
) -> None:
    """Campaign seeds 3401/3402, f = 2 rounds 53 and 76: the replicas that alone held some
    files were convicted. Their checkpoints live on only in the forensic states; before,
    controld served checkpoints of live replicas only, and no recovery could complete."""
    rack, n = node
    digest = hashlib.sha256(_checkpoint(rack, 0)).digest()
    _convict(rack)
    local = tmp_path / "recovering"
    local.mkdir()
    fetcher = await asyncio.to_thread(_recover, n.port, rack, local, digest)
    assert fetcher.done, fetcher.pending()
    for rel, data in FILES.items():
        assert (local / rel).read_bytes() == data
    assert fetcher.counters["fetched_copies"] == len(FILES)
    assert n.daemon.counters["file_copies_served"] >= len(FILES) + 1  # and the manifest
    assert n.daemon.counters["file_copies_mismatched"] == 0


async def test_a_forensic_copy_with_a_wrong_hash_is_never_served(
    node: tuple[Rack, Node], tmp_path: Path
) -> None:
    """A liar's files are right where their hash matches, and only there: controld hashes
    each candidate before it goes out. A wrong one is counted and skipped, never sent; the
    requester blames nobody, and takes the file once a copy with the right hash is there."""
    rack, n = node
    digest = hashlib.sha256(_checkpoint(rack, 0)).digest()
    kept = _convict(rack)
    b = FILES["dir/b.bin"]
    wrong = bytes([b[0] ^ 1]) + b[1:]  # same size, one bit off: only the hash tells
    # Both copies of dir/b.bin on the host wrong: the checkpoint's and the live state's.
    (kept / "store" / "snapshots" / checkpoint_name(SEQ) / "dir" / "b.bin").write_bytes(wrong)
    (kept / "store" / "live" / "dir" / "b.bin").write_bytes(wrong)
    local = tmp_path / "recovering"
    local.mkdir()
    fetcher = await asyncio.to_thread(_recover, n.port, rack, local, digest)
    assert fetcher.pending() == ["dir/b.bin"]  # a.txt came; dir/b.bin from nowhere
    assert not (local / "dir" / "b.bin").exists()
    assert fetcher.counters["bad_content"] == 0
    assert n.daemon.counters["file_copies_mismatched"] == 2
    # One right copy (the live state's, as it was at the checkpoint) is all it takes.
    (kept / "store" / "live" / "dir" / "b.bin").write_bytes(b)
    again = tmp_path / "again"
    again.mkdir()
    fetcher = await asyncio.to_thread(_recover, n.port, rack, again, digest)
    assert fetcher.done and (again / "dir" / "b.bin").read_bytes() == b
    assert n.daemon.counters["file_copies_mismatched"] == 3  # the checkpoint's, again


zfs_daemon, pool = zfs_pool.zfs_daemon, zfs_pool.pool  # the fixtures, found here by pytest


async def test_a_forensic_zfs_dataset_serves_its_checkpoints_and_live_state_by_hash(
    tmp_path: Path, pool: str
) -> None:
    """On ZFS a convicted replica's state is the unmounted dataset <dataset>-forensic-<seq>
    (controld/actions.py set_aside_state, run here for real): controld reads its checkpoint
    snapshots and its @forensic snapshot (the live state at the conviction) through clones
    of its own, and lets go of them before the dataset is purged."""
    rack = make_rack(tmp_path)
    svc = rack.config.services[0]
    state = svc.exec_state_dir(rack.config, 0)
    store = ZfsStore(pool, zfs_dataset(svc, 0), mountpoint=state / "live")
    (state / "manifests").mkdir(parents=True)
    encs = {}
    for seq, value in ((SEQ, b"at 8\n"), (2 * SEQ, b"at 16\n")):
        for rel, data in FILES.items():
            (store.path / rel).parent.mkdir(parents=True, exist_ok=True)
            (store.path / rel).write_bytes(value if rel == "a.txt" else data)
        encs[seq] = scan(store.path).encode()
        store.snapshot(checkpoint_name(seq))
        (state / "manifests" / f"{checkpoint_name(seq)}.manifest").write_bytes(encs[seq])
    # Checkpoint 16's snapshot is gone (its manifest stays): its a.txt is only in the live
    # state the conviction keeps.
    store.destroy_snapshot(checkpoint_name(2 * SEQ))
    n = Node(rack, 1, "libvirt", store="zfs", zfs_pool=pool)
    await n.start()
    try:
        kept = await asyncio.to_thread(actions.set_aside_state, n.daemon.ctx, svc, 0, 21)
        assert kept is not None and "-forensic-21@forensic-21" in kept, kept
        local = tmp_path / "recovering"
        local.mkdir()
        digest = hashlib.sha256(encs[SEQ]).digest()
        fetcher = await asyncio.to_thread(_recover, n.port, rack, local, digest)
        assert fetcher.done and (local / "a.txt").read_bytes() == b"at 8\n"
        assert fetcher.counters["fetched_copies"] == len(FILES)
        src = _source(n.port, wire.exec_principal(REQUESTER), _exec_key(rack, REQUESTER))
        try:
            at16 = await asyncio.to_thread(
                src.fetch, 2 * SEQ, "a.txt", 6, hashlib.sha256(b"at 16\n").digest()
            )
        finally:
            src.close()
        assert at16 == b"at 16\n"
        assert any("--ctl-" in d for d in _datasets(pool))  # the clones it reads through
        out = await n.rpc("purge_forensics", older_than_s=0)
        assert out["failed"] == [] and any("-forensic-21" in p for p in out["purged"]), out
    finally:
        await n.daemon.stop()
        n.hv.close()
    assert not [d for d in _datasets(pool) if "--ctl-" in d or "forensic" in d], _datasets(pool)
