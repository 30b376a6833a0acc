# tests/test_snapshots_copies.py - a checkpoint file served by its certified SHA-256 from any
# copy the server holds (snapshots/copies.py, SnapshotFiles.read with a sha256): another
# checkpoint, the live state, a recovering state's verified files; a copy that does not hash
# right is skipped and counted, never served. Real directory stores, no transport.
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from zz.crypto import NULL_DIGEST
from zz.snapshots.copies import Place
from zz.snapshots.dirstore import DirStore
from zz.snapshots.fileserve import COPY, LATER, OK, REFUSED, SnapshotFiles
from zz.snapshots.manifest import Manifest, scan
from zz.snapshots.store import checkpoint_name

A0, A1, B = b"alpha, first version\n", b"alpha, rewritten\n", bytes(range(256)) * 9


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def checkpoint(store: DirStore, manifests: Path, seq: int) -> Manifest:
    m = scan(store.path)
    manifests.mkdir(exist_ok=True)
    (manifests / f"{checkpoint_name(seq)}.manifest").write_bytes(m.encode())
    store.snapshot(checkpoint_name(seq))
    return m


def two_checkpoints(tmp_path: Path) -> tuple[DirStore, Path, Manifest]:
    """Checkpoint 8 (a = A0, d/b = B), then checkpoint 16 (a = A1); the live state is 16's."""
    store, manifests = DirStore(tmp_path / "store"), tmp_path / "manifests"
    (store.path / "d").mkdir()
    (store.path / "a").write_bytes(A0)
    (store.path / "d" / "b").write_bytes(B)
    checkpoint(store, manifests, 8)
    (store.path / "a").write_bytes(A1)
    return store, manifests, checkpoint(store, manifests, 16)


def live_place(store: DirStore, m: Manifest, pending: set[str] | None = None) -> Place:
    return Place("live", m, lambda: store.path, lambda p: p in (pending or set()))


def whole(files: SnapshotFiles, seq: int, path: str, want: bytes) -> tuple[int, bytes]:
    """Read in chunks of 5 bytes (a copy is verified once, then served range by range)."""
    out, status = b"", OK
    while len(out) < len(want) + 1:
        r = files.read(seq, path, len(out), 5, sha(want))
        if r.status not in (OK, COPY, LATER):
            return r.status, out
        status = r.status
        out += r.data
        if len(out) >= r.size:
            break
    return status, out


def test_a_file_of_a_collected_checkpoint_is_served_from_any_copy_with_its_hash(
    tmp_path: Path,
) -> None:
    store, manifests, _ = two_checkpoints(tmp_path)
    files = SnapshotFiles(store, manifests)
    # Checkpoint 4 was never here: by path, only 8's copy, marked later.
    assert files.read(4, "a", 0, 100).status == LATER
    # By hash: A0 is in checkpoint 8, A1 in checkpoint 16 and the live state.
    assert whole(files, 4, "a", A0) == (COPY, A0)
    assert whole(files, 4, "a", A1) == (COPY, A1)
    # The path does not matter, the hash does (B is at d/b only).
    assert whole(files, 4, "a", B) == (COPY, B)
    # The cheap path first: a file of a checkpoint that is here is an ordinary read.
    assert files.read(16, "a", 0, 100, sha(A1)).status == OK
    # A hash nothing here has: what the path read says, never a copy.
    r = files.read(4, "nope", 0, 100, sha(b"nothing has this"))
    assert r.status not in (OK, COPY) and r.data == b""
    assert files.copies.counters["mismatched"] == 0


def test_a_copy_that_does_not_hash_right_is_skipped_and_counted(tmp_path: Path) -> None:
    store, manifests, m16 = two_checkpoints(tmp_path)
    files = SnapshotFiles(store, manifests, live=lambda: live_place(store, m16))
    # Both copies of B rewritten in place, same size: the manifests still list B's hash.
    bad = bytes([B[0] ^ 1]) + B[1:]
    with store.open_snapshot(checkpoint_name(16)) as snap:
        (snap / "d" / "b").write_bytes(bad)
    with store.open_snapshot(checkpoint_name(8)) as snap:
        (snap / "d" / "b").write_bytes(bad)
    (store.path / "d" / "b").write_bytes(bad)
    # No copy by hash; what is left is the path read's later copy, which the requester
    # checks and takes for "checkpoint 4 is gone" (docs/recovery.md), not a copy.
    assert files.read(4, "d/b", 0, len(B), sha(B)).status == LATER
    assert files.copies.counters["mismatched"] == 3  # 16, 8, live: each read, hashed, dropped
    # One right copy anywhere (the live state here) is enough, found past the bad ones.
    (store.path / "d" / "b").write_bytes(B)
    assert whole(files, 4, "d/b", B) == (COPY, B)
    assert files.copies.counters["mismatched"] == 5


def test_a_recovering_server_serves_its_verified_files_by_hash_only(tmp_path: Path) -> None:
    """A replica still fetching its recovered state holds no complete snapshot (refused by
    path), but the files it has fetched and verified are right where their hash matches."""
    store, manifests, m16 = two_checkpoints(tmp_path)
    (store.path / "d" / "b").unlink()  # not fetched yet
    files = SnapshotFiles(
        store,
        manifests,
        servable=lambda seq: False,
        live=lambda: live_place(store, m16, pending={"d/b"}),
    )
    assert files.read(16, "a", 0, 100).status == REFUSED
    assert files.read(16, "a", 0, 100, NULL_DIGEST).status == REFUSED
    assert whole(files, 16, "a", A1) == (COPY, A1)
    # Its recorded manifest of the checkpoint it recovers, by the certified digest only.
    r = files.read(16, "", 0, 1 << 20, m16.digest())
    assert (r.status, r.data) == (COPY, m16.encode())
    assert files.read(16, "", 0, 1 << 20, sha(b"another digest")).status == REFUSED
    # A pending file is not looked for in the live state; checkpoint 16's snapshot has it.
    assert whole(files, 16, "d/b", B) == (COPY, B)


def test_a_store_served_by_hash_only_refuses_path_reads(tmp_path: Path) -> None:
    """controld serves a convicted replica's forensic state this way: its snapshots may have
    been corrupted on purpose, so nothing goes out that this server did not verify."""
    store, manifests, m16 = two_checkpoints(tmp_path)
    files = SnapshotFiles(store, manifests, path_reads=False)
    assert files.read(16, "a", 0, 100).status == REFUSED
    assert files.read(16, "", 0, 1 << 20).status == REFUSED
    assert whole(files, 16, "a", A1) == (COPY, A1)
    r = files.read(16, "", 0, 1 << 20, m16.digest())
    assert (r.status, r.data) == (COPY, m16.encode())
    assert files.read(99, "", 0, 1 << 20, m16.digest()).status == REFUSED


def test_a_symlink_or_fifo_where_a_file_was_is_neither_followed_nor_waited_on(
    tmp_path: Path,
) -> None:
    """A convicted replica's state is the attacker's: a symlink to a file with the right
    bytes elsewhere on the host is not followed, a FIFO does not hang the server."""
    store, manifests, m16 = two_checkpoints(tmp_path)
    outside = tmp_path / "outside"
    outside.write_bytes(A1)
    (store.path / "a").unlink()
    (store.path / "a").symlink_to(outside)
    (store.path / "d" / "b").unlink()
    os.mkfifo(store.path / "d" / "b")
    only_live = SnapshotFiles(store, tmp_path / "no-manifests", live=lambda: live_place(store, m16))
    assert only_live.read(16, "a", 0, 100, sha(A1)).status != COPY
    assert only_live.read(16, "d/b", 0, 100, sha(B)).status != COPY
    assert only_live.copies.counters["mismatched"] == 2
