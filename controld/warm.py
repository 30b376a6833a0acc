# controld/warm.py - a sleeping spare kept warm by its host: the files of each new stable
# checkpoint staged next to its state (ZZ's warm spares; docs/recovery.md "A warm spare",
# docs/controld.md "Warm spares"). The woken runtime reads them in snapshots/warm.py.
"""Staging the latest stable checkpoint's files for this host's sleeping spares.

While an execution replica on this host sleeps (paused or hibernated), controld follows
the service's stable execution checkpoint (as the agreement replica on this host writes
it in its stats file) and, for each new one, fetches its manifest and the files the
spare's own last checkpoint does not already hold from the other replicas' controlds and
the replicas themselves (FILE-FETCH signed with the spare's key, as the woken runtime
would), and writes them into ``<state dir>/warm/`` under the hex of their SHA-256. A woken
spare then finds its recovery's manifest and files there instead of asking its peers.

Nothing here is trusted: the runtime looks every file up by the hash its certified
manifest names and takes only bytes that hash to it (a wrong or stale staged file is a
miss). The stager checks what it writes against the manifest it fetched, so that it does
not stage what a source garbled, but that manifest is not certified: the stable seq is
one agreement replica's word and the manifest one source's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from zz import keys as keyfiles
from zz import wire
from zz.atomicfile import write_atomic
from zz.config import Config, Service
from zz.controld import inventory as inv
from zz.controld.inventory import Inventory
from zz.crypto import NULL_DIGEST
from zz.snapshots.fetch import Source, SourceError
from zz.snapshots.manifest import Manifest, ManifestError, newest_manifest_path
from zz.snapshots.peersource import PeerSource
from zz.snapshots.warm import WARM_DIR, WARM_MAX_FILE, warm_name

log = logging.getLogger("zz.controld.warm")

# What one checkpoint's staging fetches at most: the rest stays with the peers.
WARM_MAX_BYTES = 64 << 20


def newest_manifest(manifests: Path) -> Manifest | None:
    """The newest `ckpt-<n>.manifest` in a state directory's `manifests/`, decoded."""
    path = newest_manifest_path(manifests)
    if path is None:
        return None
    try:
        return Manifest.decode(path.read_bytes())
    except (OSError, ManifestError):
        return None


class WarmStager:
    """One sleeping replica's `<state dir>/warm/`, kept at the newest checkpoint staged."""

    def __init__(
        self,
        state_dir: Path,
        sources: Sequence[Source],
        *,
        max_bytes: int = WARM_MAX_BYTES,
        max_file: int = WARM_MAX_FILE,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.root = self.state_dir / WARM_DIR
        self.sources = list(sources)
        self.max_bytes = max_bytes
        self.max_file = max_file
        self.staged_seq = 0  # the newest checkpoint staged (whole or in part)
        self.counters: Counter[str] = Counter()
        self.stopped = threading.Event()  # controld stopping: no more fetches or writes
        self.ino = 0  # of the state dir it was made for (WarmSpares)
        # The names the last KEEP staged checkpoints need: the spare recovers to the stable
        # checkpoint below the fault's seq, which may be one or two before the newest
        # staged (staging follows the checkpoints taken, not only the stable ones).
        self._keep: dict[int, set[str]] = {}
        # Checkpoint seq -> turns it was staged with files missing: a checkpoint whose
        # manifest a controld serves before its snapshot is listed (the completion of a
        # directory store's checkpoint writes the manifest first) lacks its files for a
        # moment; it is staged again until they are there, at most RETRIES times.
        self._partial: dict[int, int] = {}

    KEEP = 3
    RETRIES = 2

    def _fetch(
        self, seq: int, path: str, size: int, sha256: bytes, probe: bool = False
    ) -> bytes | None:
        for src in self.sources:
            if probe and not src.name.startswith("controld-"):
                continue  # a checkpoint that may not exist yet: not asked of the guests
            try:
                data = src.fetch(seq, path, size, sha256)
            except SourceError:
                self.counters["source_errors"] += 1
                continue
            if path == "" or (len(data) == size and hashlib.sha256(data).digest() == sha256):
                return bytes(data)
            self.counters["bad_copies"] += 1  # not staged; the runtime would refuse it anyway
        return None

    def stage(self, seq: int, probe: bool = False) -> bool:
        """Stage checkpoint `seq`: its manifest, and every file it lists that neither the
        spare's own newest checkpoint nor the warm directory holds already, up to
        max_bytes. False if no source had its manifest (tried again at the next turn).
        `probe`: `seq` is a checkpoint that may not be taken yet, its manifest asked of the
        controlds only. Also False while files no source had are missing (up to RETRIES
        times, so that a file no source has holds the next checkpoint up for two turns at
        most): `staged_seq` moves only once the checkpoint is staged whole."""
        enc = self._fetch(seq, "", 0, NULL_DIGEST, probe=probe)
        if enc is None:
            self.counters["manifest_missed"] += 1
            return False
        try:
            manifest = Manifest.decode(enc)
        except ManifestError:
            self.counters["manifest_bad"] += 1
            return False
        self.root.mkdir(parents=True, exist_ok=True)
        name = warm_name(hashlib.sha256(enc).digest())
        write_atomic(self.root / name, enc)
        own = newest_manifest(self.state_dir / "manifests")
        keep = {name}
        budget = self.max_bytes
        missed = 0
        for path, entry in manifest.files.items():
            if self.stopped.is_set():
                return False
            if own is not None and own.files.get(path) == entry:
                continue  # the woken replica's reconcile keeps its own copy
            fname = warm_name(entry.sha256)
            keep.add(fname)
            if (self.root / fname).exists():
                self.counters["files_present"] += 1
                continue
            if entry.size > self.max_file or entry.size > budget:
                self.counters["files_skipped"] += 1
                continue
            # From every source, a probed checkpoint's too: a peer guest serves a copy by
            # hash from its live state while its snapshot is not listed yet.
            data = self._fetch(seq, path, entry.size, entry.sha256)
            if data is None:
                self.counters["files_missed"] += 1
                missed += 1
                continue
            budget -= len(data)
            write_atomic(self.root / fname, data)
            self.counters["files_staged"] += 1
            self.counters["bytes_staged"] += len(data)
        self._keep[seq] = keep
        for old in sorted(self._keep)[: -self.KEEP]:
            del self._keep[old]
        self._collect()
        if missed and self._partial.get(seq, 0) < self.RETRIES:
            self._partial[seq] = self._partial.get(seq, 0) + 1
            self.counters["staged_partly"] += 1
            return False
        self._partial = {k: v for k, v in self._partial.items() if k > seq}
        self.staged_seq = seq
        self.counters["checkpoints_staged"] += 1
        return True

    def _collect(self) -> None:
        """Remove what none of the last KEEP staged checkpoints needs."""
        wanted = set().union(*self._keep.values())
        with contextlib.suppress(OSError):
            for p in self.root.iterdir():
                if p.name not in wanted:
                    with contextlib.suppress(OSError):
                        if p.is_dir() and not p.is_symlink():
                            shutil.rmtree(p)
                        else:
                            os.unlink(p)
                    self.counters["files_removed"] += 1

    def clear(self) -> None:
        """The replica is awake: its warm files are of no more use."""
        shutil.rmtree(self.root, ignore_errors=True)
        self._keep = {}
        self._partial = {}
        self.staged_seq = 0

    def close(self) -> None:
        self.stopped.set()
        for src in self.sources:
            close = getattr(src, "close", None)
            if close is not None:
                close()


def replica_sources(config: Config, svc: Service, i: int) -> list[PeerSource]:
    """What replica i's recovery would fetch from, the controlds of the other replicas'
    hosts first (they read the peers' snapshots on the host, not in the guests), then the
    replicas; every request signed with i's key, which the host holds (it provisions it)."""
    me = wire.exec_principal(i)
    secret = keyfiles.load_secret(keyfiles.secret_path(config.rack.key_dir, svc.id, me))
    if secret.sign is None:
        return []
    order = [(i + k) % svc.n_exec for k in range(1, svc.n_exec)]
    out: list[PeerSource] = []
    hosts: set[int] = set()
    for j in order:
        h = svc.exec_host(config, j)
        if h.index not in hosts:
            hosts.add(h.index)
            out.append(PeerSource(f"controld-{h.name}", (h.address, h.control_port),
                                  service=svc.id, me=me, target=wire.host_principal(h.index),
                                  sign_key=secret.sign))  # fmt: skip
    for j in order:
        addr, target = svc.exec_address(config, j), wire.exec_principal(j)
        out.append(PeerSource(f"x{j}", addr, service=svc.id, me=me, target=target,
                              sign_key=secret.sign))  # fmt: skip
    return out


class WarmSpares:
    """This host's sleeping replicas kept warm (one WarmStager each), turned by controld's
    loop every quarter second: a replica paused or hibernated with no action under way gets
    each new stable checkpoint staged, and the next checkpoint as soon as a peer's controld
    serves its manifest; one awake again (active) gets its warm files removed.
    `stable(svc)` is the stable execution checkpoint's seq as this host sees it (None: not
    known here); `sources(svc, i)` the sources replica i would fetch from (replica_sources
    by default)."""

    RETRY_S = 2.0  # after a checkpoint no source had: its manifest is asked for again

    def __init__(
        self,
        config: Config,
        inventory: Inventory,
        stable: Callable[[Service], int | None],
        sources: Callable[[Service, int], Sequence[Source]] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.inventory = inventory
        self.stable = stable
        self.sources = sources or (lambda svc, i: replica_sources(config, svc, i))
        self.clock = clock
        self.wall = wall  # the host's wall clock, as status files' mtimes are
        # (service, index) -> when a turn first saw the replica active (wall clock): its
        # warm/ goes only by a status written after that (_still_fetching).
        self._active_since: dict[tuple[str, int], float] = {}
        self.stagers: dict[tuple[str, int], WarmStager] = {}
        self._failed_at: dict[tuple[str, int], float] = {}
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()  # the stagers: turned in a thread, read by status()
        self._closed = False

    def _service(self, name: str) -> Service | None:
        return next((s for s in self.config.services if s.name == name), None)

    def turn(self, recs: Sequence[inv.Replica] | None = None) -> None:
        """One pass over `recs` (the inventory's records, listed on controld's event loop)."""
        seen: set[tuple[str, int]] = set()
        for rec in self.inventory.replicas() if recs is None else recs:
            if self._closed:
                return
            key = (rec.service, rec.index)
            svc = self._service(rec.service)
            if svc is None:
                continue
            seen.add(key)
            st = self.stagers.get(key)
            if rec.state == inv.ACTIVE:
                since = self._active_since.setdefault(key, self.wall())
                if st is not None and not self._still_fetching(svc, rec.index, since):
                    st.clear()
                    st.close()
                    with self._lock:
                        del self.stagers[key]
                continue
            self._active_since.pop(key, None)
            if rec.state not in (inv.PAUSED, inv.HIBERNATED) or rec.pending is not None:
                continue
            stable = self.stable(svc)
            if stable is None or stable <= 0:
                continue
            state = svc.exec_state_dir(self.config, rec.index)
            try:
                ino = os.stat(state).st_ino
            except OSError:
                continue
            if st is not None and st.ino != ino:
                # A successor's state dir (the convicted one's was set aside), and maybe a
                # new key: start anew.
                st.close()
                st = None
            if st is None:
                try:
                    sources = self.sources(svc, rec.index)
                except (OSError, keyfiles.KeyFileError) as e:
                    self.counters["no_key"] += 1
                    self._failed_at[key] = self.clock()
                    log.warning("%s/%d: no sources to stage from: %s", *key, e)
                    continue
                st = WarmStager(state, sources)
                st.ino = ino
                with self._lock:
                    self.stagers[key] = st
            if stable > st.staged_seq:
                if self.clock() - self._failed_at.get(key, -self.RETRY_S) < self.RETRY_S:
                    continue
                seq, probe = stable, False
            else:
                # The next checkpoint, as soon as a peer's controld has it, before it is
                # stable: a fault right before a checkpoint is recovered from that one when
                # the liar's checkpoint is right (it lied in replies only).
                seq, probe = st.staged_seq + self.config.rack.checkpoint_interval, True
            try:
                ok = st.stage(seq, probe=probe)
            except OSError as e:
                ok = False
                log.warning("%s/%d: staging checkpoint %d failed: %s", *key, seq, e)
            if probe and not ok:
                self.counters["probes_missed"] += 1
            elif ok:
                self.counters["checkpoints_staged"] += 1
                self._failed_at.pop(key, None)
            else:
                self.counters["stage_failures"] += 1
                self._failed_at[key] = self.clock()
        for key in set(self.stagers) - seen:  # destroyed or set aside: its dir went with it
            with self._lock:
                gone = self.stagers.pop(key)
            gone.close()

    def _still_fetching(self, svc: Service, i: int, since: float) -> bool:
        """Whether replica i's runtime says it is still recovering (its background fetch
        takes the rest of the state, from warm/ too): its warm files are kept until then.
        Only a status written after `since` (when it was first seen active) says so: one
        written before may predate its recovery (a guest writes it when its link comes up,
        then once a second), and a SHUTDOWN that came within that second had its warm/
        removed before its background fetch looked there (4-11 files missed in drills)."""
        path = svc.exec_status_path(self.config, i)
        try:
            mtime = path.stat().st_mtime
            st = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        if mtime < since:
            return True
        return isinstance(st, dict) and st.get("recovering") is True

    def status(self) -> dict[str, Any]:
        with self._lock:
            stagers = sorted(self.stagers.items())
        return {
            f"{s}/{i}": {"staged_seq": st.staged_seq, **dict(sorted(st.counters.items()))}
            for (s, i), st in stagers
        }

    def close(self) -> None:
        self._closed = True
        with self._lock:
            stagers = list(self.stagers.values())
        for st in stagers:
            st.close()
