"""execution/checkpointing.py - an execution replica's checkpoints (ZZ §4.2, docs/design.md
§4.2-§4.5): taking one every CP (manifest + snapshot), the signed EXEC-CHECKPOINTs exchanged with
the peers, which one is stable, collecting the snapshots nobody needs, and restarting after a
crash.

Owned by the runtime (execution/runtime.py), which hands it three callables and nothing
else of itself: `send` (a signed EXEC-CHECKPOINT to every agreement replica and peer),
`register_again` (FETCH kind 3 to every agreement replica) and `agreed_floor` (the lowest
stable checkpoint the agreement replicas may still name, execution/recovery.py StableVotes).

Fields and their invariants:

* `last`: the seq of the last checkpoint taken or installed here; the live directory is
  that checkpoint's state plus the batches executed since.
* `stable`: the highest checkpoint that f+1 signed statements, this replica's own among
  them, certify with this replica's own digest. Never decreases.
* `mine`: seq -> this replica's digest C, for the checkpoints >= `stable` (and the one
  restored or installed); `_digests` keeps the last _DIGEST_HISTORY, also below `stable`,
  to compare with a slow peer's statement.
* `votes`: seq -> principal -> C, the first signed statement of each replica, for seqs
  above `stable`; `_msgs`: this replica's own signed statements above the stable one but
  one, sent again on every fresh link.
* `complete_from`: checkpoints below it miss files still being fetched by a recovery and
  are not served to peers (`files`).
* Snapshots below min(`_gc_wanted`, `agreed_floor()`) are collected; `_gc_done` is the
  bound already handed to a collection.
* `lock`: the store is not safe for concurrent use (a checkpoint and the collection of
  older snapshots both rewrite its index): one operation at a time, held by whoever
  calls into the store from a worker thread. What a report waits on (take, install)
  holds it `urgent`, ahead of the background work (serve a file, collect one snapshot),
  execution/storelock.py."""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zz import wire
from zz.atomicfile import write_atomic
from zz.config import Service
from zz.crypto import SigningKey
from zz.execution.drillfaults import DrillFaults
from zz.execution.replycache import PATH as REPLIES_PATH
from zz.execution.storelock import StoreLock
from zz.snapshots import CheckpointStore, checkpoint_name, open_store
from zz.snapshots.crashpoint import crash_point
from zz.snapshots.fileserve import SnapshotFiles
from zz.snapshots.hostzfs import HostZfsStore
from zz.snapshots.manifest import Manifest, ManifestBuilder, scan

log = logging.getLogger("zz.execution")

# Own checkpoint digests kept for comparison with peers' statements, also after GC: a slow
# peer's EXEC-CHECKPOINT may arrive after the seq became stable here.
_DIGEST_HISTORY = 16
# Mismatches listed in the status file (the counter keeps the total).
MISMATCH_LIST = 64
# A changed file up to this size is kept in memory from its hashing to its snapshot copy.
KEEP_LIMIT = 1 << 20
STORE_KINDS = ("dir", "zfs", "host-zfs")


@dataclass(eq=False, repr=False)
class Checkpoints:
    """Execution replica `me`'s checkpoints of service `svc`, every `cp` seqs. The
    runtime's three callables: `send`, `register_again`, `agreed_floor` (above)."""

    svc: Service
    me: int
    cp: int
    manifest_dir: Path
    counters: Counter[str]
    faults: DrillFaults
    send: Callable[[bytes], None]
    register_again: Callable[[], None]
    agreed_floor: Callable[[], int]
    lock: StoreLock = field(default_factory=StoreLock)
    last: int = 0
    stable: int = 0
    mine: dict[int, bytes] = field(default_factory=dict)
    votes: dict[int, dict[int, bytes]] = field(default_factory=dict)
    _msgs: dict[int, bytes] = field(default_factory=dict)
    _digests: dict[int, bytes] = field(default_factory=dict)
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    _mismatch_seen: set[tuple[int, int]] = field(default_factory=set)  # (seq, peer principal)
    _gc_wanted: int = 0
    _gc_done: int = 0
    complete_from: int = 0
    _drill_snapshot: int = -1  # the last snapshot a drill fault took (corrupted)
    # Set by open():
    store: CheckpointStore = field(init=False)
    files: SnapshotFiles = field(init=False)
    builder: ManifestBuilder = field(init=False)

    # ---- the store: opening and restart (worker thread) ---------------------------------
    def open(
        self,
        kind: str,
        state_dir: Path,
        index: int,
        sign_key: SigningKey | None,
        zfs_pool: str | None,
        zfs_dataset: str,
    ) -> None:
        """Open the store of kind `kind` and undo what a crash left half-made."""
        if kind == "dir":
            self.store = open_store("dir", root=state_dir / "store", writer=True)
        elif kind == "host-zfs":
            # In a guest on a ZFS rack: the dataset is mounted in the share, the host's
            # controld snapshots it on our signed request (snapshots/hostzfs.py).
            assert sign_key is not None
            self.store = HostZfsStore(
                state_dir, service=self.svc.id, index=index, sign_key=sign_key
            )
        elif kind == "zfs":
            if not zfs_pool:
                raise ValueError("--store zfs needs a pool (--zfs-pool)")
            self.store = open_store(
                "zfs", pool=zfs_pool, dataset=zfs_dataset, mountpoint=state_dir / "live"
            )
        else:
            raise ValueError(f"unknown store kind {kind!r}")
        self._recover_store()
        self.files = SnapshotFiles(
            self.store, self.manifest_dir, servable=lambda seq: seq >= self.complete_from
        )

    def _recover_store(self) -> None:
        """After a crash anywhere in a checkpoint, a collection or an install: the store
        undoes its half-made steps, and a manifest whose snapshot is not listed (written
        before a snapshot that never completed, left by a collection or by an install that
        did not finish) goes, so what remains is complete checkpoints only
        (docs/checkpoints.md "Crash consistency")."""
        removed = self.store.recover()
        listed = {f"{n}.manifest" for n in self.store.list_snapshots()}
        for p in self.manifest_dir.iterdir():
            if p.name not in listed and p.is_file():
                p.unlink()
                removed.append(f"manifests/{p.name}")
        if removed:
            log.warning("removed what an interrupted checkpoint left: %s", ", ".join(removed))

    def restore_latest(self) -> tuple[int, Manifest, Manifest] | None:
        """Put the live directory back to the last complete checkpoint: its seq, the
        manifest of what is there and the manifest this replica certified (the same files,
        unless the checkpoint was taken while a recovery still fetched some: those are
        missing). None, and an empty live directory, without a checkpoint: anything past
        the last checkpoint may be half a batch, and only a checkpoint is a state every
        correct replica also had."""
        ckpts = sorted(
            (int(n[5:]), n)
            for n in self.store.list_snapshots()
            if n.startswith("ckpt-") and n[5:].isdigit()
        )
        live = self.store.path
        if not ckpts:
            for child in list(live.iterdir()):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
            return None
        seq, name = ckpts[-1]
        self.store.restore_live(name)
        there = scan(live)
        recorded = there
        saved = self.manifest_dir / f"{name}.manifest"
        if saved.exists():
            # The saved manifest also holds that checkpoint's tombstones, which a scan
            # cannot know; its digest is the C this replica signed.
            recorded = Manifest.decode(saved.read_bytes())
            if recorded.files != there.files:
                wrong = [p for p, e in there.files.items() if recorded.files.get(p) != e]
                if wrong:
                    raise RuntimeError(
                        f"{name}: restored state does not match its manifest: {wrong[:3]}"
                    )
        log.info("restored checkpoint %s", name)
        return seq, there, recorded

    def adopt(self, seq: int, digest: bytes) -> None:
        """Checkpoint `seq` with digest C is this replica's own now (restored, installed)."""
        self.last = seq
        self.mine[seq] = digest
        self._digests[seq] = digest

    def record_manifest(self, seq: int, manifest: Manifest) -> None:
        write_atomic(self.manifest_dir / f"{checkpoint_name(seq)}.manifest", manifest.encode())

    # ---- taking one (worker thread, `lock` held) -----------------------------------------
    def build(
        self, seq: int, dirty: Iterable[str], memory: bytes | None, replies: bytes
    ) -> Manifest:
        """The manifest of the state after `seq`: the files written or deleted since the
        last one re-hashed, the app's memory and the reply cache as runtime files."""
        # A directory store copies each changed file into the snapshot: the bytes hashed
        # here are kept for that copy (DirStore.stage_since), one read instead of two.
        self.builder.keep_limit = KEEP_LIMIT if self.store.shares_unchanged else 0
        self.builder.take_kept()
        self.builder.mark_all_dirty(dirty)
        if memory is not None:
            self.builder.write_memory(memory)
        self.builder.write_runtime_file(REPLIES_PATH, replies)
        crash_point("runtime.checkpoint.runtime-files")
        self.faults.before_manifest(self.builder, seq)
        return self.builder.build()

    def take(self, seq: int, manifest: Manifest) -> bytes:
        """Manifest file, then the snapshot (its listing is the commit point); returns C."""
        c, finish = self.stage(seq, manifest)
        finish()
        return c

    def stage(self, seq: int, manifest: Manifest) -> tuple[bytes, Callable[[], None]]:
        """take() in two halves: this one does what reads the live directory and returns
        C with the rest. On a store that can part them (store.stage_since) the rest
        (linking the files unchanged since the base, the manifest file, the listing)
        reads only the store and may run while the next batches write the live directory,
        the lock still held (docs/checkpoints.md "The directory store"); elsewhere the
        snapshot is taken here and the rest is nothing."""
        name = checkpoint_name(seq)
        base = None
        if self.store.shares_unchanged and not self.faults.corrupts_snapshots():
            base = self._snapshot_base(seq)
        rest: Callable[[], None] | None = None
        if base is None:
            self.builder.take_kept()  # not needed: the snapshot is copied whole
        if base is not None:
            had = base[1].files
            base_name = checkpoint_name(base[0])

            def unchanged(rel: str) -> bool:
                return (e := manifest.files.get(rel)) is not None and had.get(rel) == e

            kept = self.builder.take_kept()
            rest = self.store.stage_since(name, base_name, manifest.files, unchanged, kept)

        def finish() -> None:
            if rest is not None:
                # The manifest file comes after the report too: it has to be there before
                # the snapshot is listed (a restart checks one against the other).
                self.record_manifest(seq, manifest)
                crash_point("runtime.checkpoint.manifest")
                rest()
            crash_point("runtime.checkpoint.snapshot")
            # A recovering peer's first request is this manifest: spare the decode of an
            # entry per file (~20 ms at 10,000 files) on its critical path.
            self.files.remember(seq, manifest)

        if rest is not None:
            return manifest.digest(), finish
        self.record_manifest(seq, manifest)
        crash_point("runtime.checkpoint.manifest")
        if self.faults.snapshot(self.store, name, manifest, self.builder.root, seq):
            # A drill's corrupted copy: never a base, or its corruption would go on in the
            # next snapshots after the drill turned the fault off.
            self._drill_snapshot = seq
        elif base is None:
            self.store.snapshot(name)
        else:
            self.store.snapshot_since(name, base_name, unchanged)
        finish()
        return manifest.digest(), _nothing

    def _snapshot_base(self, seq: int) -> tuple[int, Manifest] | None:
        """This replica's last checkpoint below `seq` and its manifest, if its snapshot is
        still here and complete: a file whose entry is the same in both holds the same
        bytes there (store.snapshot_since). A snapshot taken while a recovery still
        fetched files (below `complete_from`) may hold a stale local copy of a file its
        manifest certifies: never a base."""
        last = self.last
        if not (self.complete_from <= last < seq) or last == self._drill_snapshot:
            return None
        m = self.files.manifest(last)
        if m is None or checkpoint_name(last) not in self.store.list_snapshots():
            return None
        return last, m

    # ---- the signed statements ----------------------------------------------------------
    def announce(self, seq: int, c: bytes, sign_key: SigningKey) -> None:
        """Checkpoint `seq` is taken with digest `c`: sign and send EXEC-CHECKPOINT, and
        count this replica's own vote."""
        self.adopt(seq, c)
        for s in sorted(self._digests)[:-_DIGEST_HISTORY]:
            del self._digests[s]
        self.counters["checkpoints"] += 1
        m = wire.ExecCheckpoint(self.svc.id, self.me, seq, c).signed(sign_key).encode()
        sent = self.faults.checkpoint_msg(seq, m)
        if sent is not None:
            self._msgs[seq] = sent
            self.send(sent)
        self.votes.setdefault(seq, {})[self.me] = c
        for peer, theirs in list(self.votes[seq].items()):
            if peer != self.me:
                self._compare(seq, peer, theirs)
        self._check_stable(seq)

    def latest_msgs(self) -> list[bytes]:
        """This replica's last two signed statements, for a fresh link."""
        return [self._msgs[s] for s in sorted(self._msgs)[-2:]]

    def offer(self, seq: int, peer: int, c: bytes, last_executed: int, window: int) -> None:
        """A peer's signed statement (signature checked by the caller)."""
        # Before the stale check: a replica that is slow and wrong still gets noticed.
        self._compare(seq, peer, c)
        if seq <= self.stable or seq % self.cp:
            self.counters["stale_checkpoint"] += 1
            return
        if seq > last_executed + window:
            self.counters["too_far"] += 1
            return
        self.counters["peer_checkpoints"] += 1
        self.votes.setdefault(seq, {}).setdefault(peer, c)  # first signed statement counts
        self._check_stable(seq)

    def peer_ahead(self, seq: int) -> bool:
        """Whether a peer signed a checkpoint above `seq`."""
        return any(s > seq and any(p != self.me for p in v) for s, v in self.votes.items())

    def _compare(self, seq: int, peer: int, theirs: bytes) -> None:
        """Record a peer's signed checkpoint digest that differs from ours at `seq` (once
        per seq and peer; a peer's later statements for a seq do not count anyway)."""
        mine = self._digests.get(seq)
        if mine is None or theirs == mine or (seq, peer) in self._mismatch_seen:
            return
        self._mismatch_seen.add((seq, peer))
        for old in [k for k in self._mismatch_seen if k[0] <= seq - _DIGEST_HISTORY * self.cp]:
            self._mismatch_seen.discard(old)
        _, idx = wire.principal_kind(peer)
        self.counters["checkpoint_mismatches"] += 1
        self.mismatches.append(
            {"seq": seq, "peer": idx, "principal": peer, "mine": mine.hex(), "theirs": theirs.hex()}
        )
        del self.mismatches[:-MISMATCH_LIST]
        log.warning(
            "checkpoint %d: execution replica %d signed %s, this replica has %s",
            seq,
            idx,
            theirs.hex()[:16],
            mine.hex()[:16],
        )

    def _check_stable(self, seq: int) -> None:
        mine = self.mine.get(seq)
        if mine is None or seq <= self.stable:
            return
        votes = self.votes.get(seq, {})
        agree = sum(1 for c in votes.values() if c == mine)
        if agree < self.svc.f + 1:
            if len(votes) - agree >= self.svc.f + 1:
                self.counters["checkpoint_divergence"] += 1
                log.error("f+1 execution replicas certify a different state at %d", seq)
            return
        previous, self.stable = self.stable, seq
        log.info("checkpoint %d stable (%s)", seq, mine.hex()[:16])
        self.faults.on_stable(seq)
        for s in [s for s in self.votes if s <= seq]:
            del self.votes[s]
        for s in [s for s in self.mine if s < seq]:
            del self.mine[s]
        for s in [s for s in self._msgs if s < seq]:
            del self._msgs[s]
        # The snapshot of the stable checkpoint before this one stays too: a spare woken
        # at a fault above it recovers from it (the certified checkpoint it was told when
        # woken) and must replay up to the fault seq to report it, or the round never
        # resolves; collecting it at once stranded such a spare above the fault.
        self._gc_wanted = max(self._gc_wanted, previous)
        # So does every snapshot the agreement replicas may still name: they hold their
        # stable checkpoint below an open fault round while f+1 execution replicas go on
        # making newer ones stable among themselves. Ask them where they are (FETCH kind
        # 3); the replies move the collection (maybe_collect).
        self.register_again()
        self.maybe_collect()

    # ---- collection ---------------------------------------------------------------------
    def maybe_collect(self) -> None:
        """Collect the snapshots below both bounds (in the loop; a task does the work)."""
        bound = min(self._gc_wanted, self.agreed_floor())
        if bound > self._gc_done:
            self._gc_done = bound
            asyncio.get_running_loop().create_task(self._collect(bound))

    async def _collect(self, stable: int) -> None:
        """One snapshot per turn of the lock: a checkpoint due meanwhile waits for one,
        not for all of them (a closed fault round can free many at once). What a snapshot
        held is freed after the lock is let go: a directory copy took 1.0-1.2 s to remove
        at load 16-20 on 2 cores, and a checkpoint waited for it (campaign seed 3902)."""
        try:
            while True:
                async with self.lock.background("collection"):
                    more, free = await asyncio.to_thread(self._detach_below, stable, 1)
                for f in free:
                    await asyncio.to_thread(f)
                if not more:
                    break
        except Exception:
            log.exception("garbage collection below %d failed", stable)
            self.counters["gc_errors"] += 1

    def destroy_below(self, stable: int) -> None:
        """Destroy the snapshots below `stable`."""
        for f in self._detach_below(stable)[1]:
            f()

    def _detach_below(
        self, stable: int, limit: int | None = None
    ) -> tuple[bool, list[Callable[[], None]]]:
        """Take the snapshots below `stable` out of the store, at most `limit` of them:
        whether some are left for another call, and what frees their space."""
        doomed = [
            name
            for name in self.store.list_snapshots()
            if name.startswith("ckpt-") and name[5:].isdigit() and int(name[5:]) < stable
        ]
        free = []
        for name in doomed[:limit]:
            self.files.release(name)  # ZFS refuses to destroy a snapshot with a clone
            free.append(self.store.detach_snapshot(name))
            crash_point("runtime.gc.destroyed")
            (self.manifest_dir / f"{name}.manifest").unlink(missing_ok=True)
            self.counters["snapshots_destroyed"] += 1
        return limit is not None and len(doomed) > limit, free

    def status(self) -> dict[str, Any]:
        return {
            "last_checkpoint": self.last,
            "stable_checkpoint": self.stable,
            "checkpoints": {str(s): c.hex() for s, c in sorted(self.mine.items())},
            "checkpoint_mismatches": list(self.mismatches),
            "store_lock": self.lock.status(),
        }


def _nothing() -> None:
    pass
