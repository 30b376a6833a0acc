"""execution/runtime.py - one execution replica (ZZ §4.1-4.2, docs/design.md §3.3-§5.5).
Executes batches on 2g+1-replica commit certificates, replies to clients, checkpoints every CP."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zz import keys, naming, wire
from zz.atomicfile import write_atomic
from zz.config import Config, Service
from zz.crypto import NULL_DIGEST, SigningKey
from zz.drillfaults import FAULT_FILE, FAULTS
from zz.execution.app import App, ExecContext
from zz.execution.byzantine import BEHAVIOURS as BYZANTINE_BEHAVIOURS
from zz.execution.byzantine import Byzantine
from zz.execution.certificates import DEFAULT_WINDOW, Certificate, CommitCollector
from zz.execution.recovery import (
    CertifiedVouches,
    PeerSource,
    RecoveryError,
    StableVotes,
    fetch_manifest,
)
from zz.execution.registry import create_app
from zz.execution.replycache import PATH as REPLIES_PATH
from zz.execution.replycache import ReplyCache
from zz.execution.state import StateDir
from zz.link import Link
from zz.snapshots import CheckpointStore, checkpoint_name, open_store
from zz.snapshots.crashpoint import crash_point
from zz.snapshots.fetch import FetchError, SourceRanking, StaleCheckpoint, StateFetcher
from zz.snapshots.fileserve import (
    FILE_SEND_TIMEOUT,
    Challenge,
    FileRead,
    SnapshotFiles,
    bad_range,
)
from zz.snapshots.hostzfs import HostZfsStore
from zz.snapshots.manifest import MEMORY_PATH, Manifest, ManifestBuilder, scan

log = logging.getLogger("zz.execution")

# A FETCH-REPLY this large may have been cut at the replier's ~4 MiB limit: ask for more.
_REFETCH_BYTES = 1 << 20
# A connection whose peer stops reading is dropped rather than buffering without bound.
_MAX_WRITE_BUFFER = 64 << 20
_STALL_SECONDS = 1.0
# Own checkpoint digests kept for comparison with peers' statements, also after GC: a slow
# peer's EXEC-CHECKPOINT may arrive after the seq became stable here.
_DIGEST_HISTORY = 16
# Mismatches listed in the status file (the counter keeps the total).
_MISMATCH_LIST = 64
# corrupt-snapshot: Byzantine storage. The replica certifies the right digest but every
# snapshot it takes has one byte of each file flipped (its live state is put back after),
# so a recovering peer gets wrong bytes from it; once one such checkpoint is stable and
# CORRUPT_LIE_AFTER/cp of the next interval has passed (the agreement replicas know it
# stable by then), it also answers wrongly, so it is convicted and a spare recovers.
CORRUPT_LIE_AFTER = 0.25
# slow-report: how long the faulty replica holds each EXEC-REPORT back by default (beyond
# the K·t1 of the tests' timers, so the agreement replicas time it out). A drill sets the
# delay above its rack's detection ceiling through the fault file ("slow_report_ms").
SLOW_REPORT_SECONDS = 0.5
DIVERGE_PATH = "zz-fault-diverge"
# controld writes this into the state directory when it wakes the replica (controld/actions.py).
WAKE_NOTICE = "controld-wakeup.json"
# How long a woken replica waits for g+1 agreement replicas to name a stable checkpoint
# below its round's seq before it takes one at or above it (and cannot report that seq).
_FAULT_SEQ_PATIENCE = 5.0
_WAKE_POLL = 0.02
# How long a request waiting for a file keeps asking the peers before the replica gives up.
_FETCH_PATIENCE = 60.0
# Sleep between background file fetches: request execution keeps most of the bandwidth.
_BACKGROUND_PAUSE = 0.001


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


class AppFault(Exception):
    """The app raised instead of returning a reply: this replica cannot go on."""


@dataclass(frozen=True)
class Outgoing:
    """One reply produced by a batch, sent once the batch is done."""

    client: int
    timestamp: int
    read_only: bool
    result: bytes


def _flip_byte(path: Path, offset: int) -> bool:
    """XOR one byte with 0xFF (twice puts it back); False if the file is not here. Synced:
    a guest's write must reach the host's dataset before the host snapshots it."""
    try:
        with open(path, "r+b") as fh:
            fh.seek(offset)
            b = fh.read(1)
            if not b:
                return False
            fh.seek(offset)
            fh.write(bytes([b[0] ^ 0xFF]))
            fh.flush()
            os.fsync(fh.fileno())
    except FileNotFoundError:
        return False
    return True


class _Link(Link):
    """A reconnecting outgoing connection (to an agreement replica or a peer execution
    replica, principal `peer`). `Runtime.on_link_connect` returns what to send first on
    every fresh connection; a peer that stops reading is dropped at _MAX_WRITE_BUFFER."""

    def __init__(self, rt: Runtime, name: str, addr: tuple[str, int], peer: int) -> None:
        super().__init__(
            addr, name, task_prefix="zz-exec-link-", max_write_buffer=_MAX_WRITE_BUFFER
        )
        self.rt = rt
        self.peer = peer

    def on_connect(self) -> list[bytes]:
        return self.rt.on_link_connect(self)

    def on_frame(self, raw: bytes) -> None:
        self.rt.on_link_frame(self, raw)

    def on_frame_error(self) -> None:
        self.rt.counters["frame_error"] += 1

    def on_overflow(self) -> None:
        self.rt.counters["slow_peer_closed"] += 1


class Runtime:
    """Execution replica `index` of `service`.

    Life cycle: `await rt.start()`, then `await rt.wait()` until stop() or a fatal
    error, then `await rt.shutdown()`; `serve()` does all three."""

    def __init__(
        self,
        config: Config,
        service: Service,
        index: int,
        *,
        store_kind: str = "dir",
        zfs_pool: str | None = None,
        zfs_dataset: str | None = None,
        window: int = DEFAULT_WINDOW,
        inject_fault: str | None = None,
        recovery_mode: str = "on-demand",
        replay_skips_reads: bool = True,
        background_pause: float | None = None,
        asleep: bool = False,
        state_dir: Path | None = None,
        listen: str | None = None,
        status_path: Path | None = None,
        drill_faults: bool = False,
    ) -> None:
        if not 0 <= index < service.n_exec:
            raise ValueError(f"{service.name}: no execution replica {index}")
        if inject_fault is not None and inject_fault not in FAULTS:
            raise ValueError(f"unknown fault {inject_fault!r}: one of {', '.join(FAULTS)}")
        self.inject_fault = inject_fault
        self.config = config
        self.svc = service
        self.index = index
        self.me = wire.exec_principal(index)
        self.cp = config.rack.checkpoint_interval
        # In a guest the state dir is the 9p share (/state) and the status goes into it:
        # the host's paths mean nothing there (controld/actions.py guest_runtime_command).
        self.state_dir = state_dir or service.exec_state_dir(config, index)
        self.status_path = status_path or self.state_dir.with_name(
            f"{self.state_dir.name}.status.json"
        )
        self.listen = listen
        # Drills only: <state dir>/zz-fault.json switches inject_fault while running.
        self.drill_faults = drill_faults
        self.byz = Byzantine(self)  # the campaign's behaviours (execution/byzantine.py)
        self.slow_report_s = SLOW_REPORT_SECONDS
        # Checkpoints above the stable one that were snapshotted corrupted (the fault).
        self._corrupted: set[int] = set()
        self._corrupt_lie_from: int | None = None
        # A drill holds the lies back (fault file "lie": false) until it has seen a
        # corrupted checkpoint stable, so that it knows when the lies start.
        self.corrupt_lies = True
        self.manifest_dir = self.state_dir / "manifests"
        self.store_kind = store_kind
        self.zfs_pool = zfs_pool
        self.zfs_dataset = zfs_dataset or naming.zfs_dataset(service, index)
        self.window = window
        self.collector = CommitCollector(service.n, service.g, window)
        self.replies = ReplyCache()
        self.counters: Counter[str] = Counter()
        # The snapshot store is not safe for concurrent use (a checkpoint and the
        # collection of older snapshots both rewrite its index): one operation at a time.
        self._store_lock = asyncio.Lock()
        self.last_checkpoint = 0
        self.stable_checkpoint = 0
        self._gc_wanted = 0  # snapshots below this are no longer needed here...
        self._gc_done = 0  # ...and those below this are collected (or being collected)
        self.my_checkpoints: dict[int, bytes] = {}  # seq -> C, not yet garbage-collected
        self.ckpt_votes: dict[int, dict[int, bytes]] = {}  # seq -> exec principal -> C
        self._ckpt_msgs: dict[int, bytes] = {}  # seq -> my signed EXEC-CHECKPOINT
        self._my_digests: dict[int, bytes] = {}  # seq -> C, the last _DIGEST_HISTORY
        self.checkpoint_mismatches: list[dict[str, Any]] = []
        self._mismatch_seen: set[tuple[int, int]] = set()  # (seq, peer principal)
        self._clients: dict[int, set[asyncio.StreamWriter]] = {}
        self._conn_writers: set[asyncio.StreamWriter] = set()
        self._links: list[_Link] = []
        self._peer_links: list[_Link] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._server: asyncio.base_events.Server | None = None
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self.fatal: BaseException | None = None
        self._batch_counts: Counter[str] = Counter()
        self._view = 0  # of the latest certificate; a cached reply resent later carries it
        # Recovery (execution/recovery.py): g+1 agreement replicas vouching for a stable
        # checkpoint above last_executed mean the log no longer reaches back to us.
        if recovery_mode not in ("on-demand", "full"):
            raise ValueError(f"unknown recovery mode {recovery_mode!r}")
        self.recovery_mode = recovery_mode
        self.replay_skips_reads = replay_skips_reads
        if background_pause is not None and not 0 <= background_pause <= 3600:
            raise ValueError(f"background pause {background_pause} s: not in 0..3600")
        self.background_pause = _BACKGROUND_PAUSE if background_pause is None else background_pause
        # Provisioned as a spare: state open, listening, but not registered with the
        # agreement replicas (so not executing) until controld's wake notice.
        self.asleep = asleep
        self._wake_poked = False
        self.stable_votes = StableVotes(service.g)
        self.vouches = CertifiedVouches(service.g)
        self.replay: dict[str, Any] = {}
        self._replay_t0: float | None = None
        self._recover_target: tuple[int, bytes] | None = None
        # The seq of the fault round this replica was woken for (controld's wake notice):
        # it must recover below it and replay it, or its report never comes.
        self._fault_seq: int | None = None
        self._fault_seq_at = 0.0
        # The seq of a batch abandoned half-run because the checkpoint being recovered was
        # collected (StaleCheckpoint): nothing executes until a newer one is installed.
        self._stranded_at: int | None = None
        # An install failed after reconciling the live directory: what is in it is known
        # to no manifest any more, so the next install hashes it all (prepare's walk).
        self._half_installed = False
        self.fetcher: StateFetcher | None = None
        # Every fetcher's counters, summed for the status file's "fetch" (controld's metrics).
        self._fetch_totals: Counter[str] = Counter()
        self._fetch_seen: StateFetcher | None = None
        self.recovery: dict[str, Any] = {}
        # Own checkpoints below this miss files still being fetched: not served to peers.
        self._complete_from = 0
        self._bg_stop = threading.Event()
        self._bg_thread: threading.Thread | None = None
        self._sources: list[PeerSource] = []
        self._ranking = SourceRanking()
        self._stopping = threading.Event()
        # Set in start():
        self.store: CheckpointStore
        self.state: StateDir
        self.app: App
        self.builder: ManifestBuilder
        self.sign_key: SigningKey
        self.agree_keys: dict[int, bytes] = {}
        self.macs: dict[int, bytes] = {}
        self.publics: keys.PeerKeys  # follows the peers' key epochs (zz/keys.py)

    @property
    def last_executed(self) -> int:
        return self.collector.last_executed

    # ---- start-up and shutdown ----------------------------------------------------

    async def start(self) -> None:
        rack = self.config.rack
        secret = keys.load_secret(keys.secret_path(rack.key_dir, self.svc.id, self.me))
        if secret.sign is None:
            raise keys.KeyFileError(f"principal {self.me} has no signing key")
        self.sign_key = secret.sign
        self.agree_keys = keys.peer_keys(secret, range(self.svc.n))
        self.macs = dict(secret.macs)
        self.publics = keys.PeerKeys(rack.key_dir, self.config, self.svc, self.counters)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.manifest_dir.mkdir(exist_ok=True)
        await asyncio.to_thread(self._open_state)

        host, port = self.svc.exec_address(self.config, self.index)
        host = self.listen or host
        self._server = await self._listen(host, port)
        for r in range(self.svc.n):
            link = _Link(self, f"r{r}", self.config.replica_address(self.svc, r), r)
            self._links.append(link)
        for j in range(self.svc.n_exec):
            if j != self.index:
                addr = self.svc.exec_address(self.config, j)
                link = _Link(self, f"x{j}", addr, wire.exec_principal(j))
                self._peer_links.append(link)
        if not self.asleep:
            self._start_links()
        if self.fetcher is not None:  # restored a checkpoint taken mid-recovery
            self._start_background(self.fetcher)
        self._tasks = [
            asyncio.create_task(self._executor(), name="zz-exec-executor"),
            asyncio.create_task(self._status_loop(), name="zz-exec-status"),
            asyncio.create_task(self._stall_loop(), name="zz-exec-stall"),
            asyncio.create_task(self._wake_watch(), name="zz-exec-wake"),
        ]
        log.info(
            "execution replica %d of service %s listening on %s:%d, last executed %d",
            self.index,
            self.svc.name,
            host,
            port,
            self.last_executed,
        )

    async def _listen(self, host: str, port: int) -> asyncio.base_events.Server:
        # The port can be briefly held by someone's outgoing connection (it lies in the
        # ephemeral range on most hosts), or by our predecessor's closing sockets.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10.0
        while True:
            try:
                return await asyncio.start_server(self._serve_conn, host, port)
            except OSError as e:
                if e.errno != errno.EADDRINUSE or loop.time() > deadline:
                    raise
                self.counters["bind_retries"] += 1
                await asyncio.sleep(0.2)

    def _open_state(self) -> None:
        if self.store_kind == "dir":
            self.store = open_store("dir", root=self.state_dir / "store")
        elif self.store_kind == "host-zfs":
            # In a guest on a ZFS rack: the dataset is mounted in the share, the host's
            # controld snapshots it on our signed request (snapshots/hostzfs.py).
            self.store = HostZfsStore(
                self.state_dir, service=self.svc.id, index=self.index, sign_key=self.sign_key
            )
        elif self.store_kind == "zfs":
            if not self.zfs_pool:
                raise ValueError("--store zfs needs a pool (--zfs-pool)")
            self.store = open_store(
                "zfs",
                pool=self.zfs_pool,
                dataset=self.zfs_dataset,
                mountpoint=self.state_dir / "live",
            )
        else:
            raise ValueError(f"unknown store kind {self.store_kind!r}")
        self.app = create_app(self.svc.app)
        self._recover_store()
        ckpts = sorted(
            (int(n[5:]), n)
            for n in self.store.list_snapshots()
            if n.startswith("ckpt-") and n[5:].isdigit()
        )
        live = self.store.path
        # Anything in the live directory past the last checkpoint may be half a batch:
        # only a checkpoint is a state every correct replica also had.
        previous: Manifest | None = None
        fetcher: StateFetcher | None = None
        if not ckpts:
            for child in list(live.iterdir()):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        else:
            seq, name = ckpts[-1]
            self.store.restore_live(name)
            previous = scan(live)
            saved = self.manifest_dir / f"{name}.manifest"
            if saved.exists():
                # The saved manifest also holds that checkpoint's tombstones, which a scan
                # cannot know; its digest is the C this replica signed.
                recorded = Manifest.decode(saved.read_bytes())
                if recorded.files != previous.files:
                    wrong = [p for p, e in previous.files.items() if recorded.files.get(p) != e]
                    if wrong:
                        raise RuntimeError(
                            f"{name}: restored state does not match its manifest: {wrong[:3]}"
                        )
                    # Taken while this replica was still fetching a recovered state
                    # (docs/recovery.md): what it had not fetched yet is missing from the
                    # snapshot. Fetch it again, on first touch and in the background.
                    fetcher = self._fetcher(recorded, seq)
                    fetcher.prepare(previous.files, ())
                    self.recovery.update(
                        {"restored_incomplete": name, "files_pending": len(fetcher.pending())}
                    )
                    log.info("%s lacks %d files: fetching them", name, len(fetcher.pending()))
                previous = recorded
            replies = live / REPLIES_PATH
            if replies.exists():
                self.replies = ReplyCache.decode(replies.read_bytes())
            self.collector.executed(seq)
            self.last_checkpoint = seq
            self.my_checkpoints[seq] = previous.digest()
            self._my_digests[seq] = previous.digest()
            log.info("restored checkpoint %s", name)
        self.state = StateDir(live, lazy=fetcher)
        if fetcher is not None:
            self.fetcher = fetcher
            self._complete_from = 1 << 64
        self.app.open(self.state)
        memory = live / MEMORY_PATH
        if memory.exists():
            self.app.load_memory(memory.read_bytes())
        self.builder = ManifestBuilder(live, previous)
        self.files = SnapshotFiles(
            self.store, self.manifest_dir, servable=lambda seq: seq >= self._complete_from
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

    def stop(self) -> None:
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()

    async def shutdown(self) -> None:
        self._stopping.set()
        self._bg_stop.set()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        for link in self._links + self._peer_links:
            await link.close()
        if self._server is not None:
            self._server.close()
        for w in list(self._conn_writers):
            w.close()
        if self._server is not None:
            with contextlib.suppress(OSError):
                await self._server.wait_closed()
        with contextlib.suppress(OSError, AttributeError):
            self._write_status()
        if self._bg_thread is not None:
            await asyncio.to_thread(self._bg_thread.join, 10)
        for src in self._sources:
            src.close()
        with contextlib.suppress(AttributeError):
            await asyncio.to_thread(self.files.release)

    async def serve(self) -> None:
        """Run until stop() (SIGTERM/SIGINT in the process) or a fatal error."""
        try:
            await self.start()
            await self.wait()
        finally:
            await self.shutdown()
        if self.fatal is not None:
            raise self.fatal

    # ---- agreement and peer links -------------------------------------------------

    def _fetch_msg(self, r: int) -> bytes:
        m = wire.Fetch(self.svc.id, self.me, wire.FETCH_LOG, self.last_executed, NULL_DIGEST)
        return m.with_macs({r: self.agree_keys[r]}).encode()

    def _register_again(self) -> None:
        """FETCH (kind 3) to every agreement replica: each answers with its stable
        checkpoint and the log above our last executed batch, and pushes batches to us."""
        for link in self._links:
            link.send(self._fetch_msg(link.peer))

    def on_link_connect(self, link: _Link) -> list[bytes]:
        # Registration (FETCH kind 3) must be re-sent after every reconnect: the agreement
        # replica forgets the connection, and with it where to push EXEC-COMMITs.
        if link.peer < wire.PRINCIPAL_EXEC:
            return [self._fetch_msg(link.peer), *self._latest_ckpt_msgs()]
        return self._latest_ckpt_msgs()

    def _latest_ckpt_msgs(self) -> list[bytes]:
        return [self._ckpt_msgs[s] for s in sorted(self._ckpt_msgs)[-2:]]

    def on_link_frame(self, link: _Link, raw: bytes) -> None:
        if link.peer >= wire.PRINCIPAL_EXEC:
            self._on_peer_message(raw)
            return
        m = self._decode(raw)
        if m is None:
            return
        if m.sender != link.peer:
            self.counters["wrong_sender"] += 1
            return
        if not isinstance(m, wire.ExecCommit | wire.FetchReply):
            self.counters["unexpected"] += 1
            return
        if not m.verify_mac(self.me, self.agree_keys[link.peer]):
            self.counters["bad_mac"] += 1
            return
        if isinstance(m, wire.ExecCommit):
            self.counters["exec_commits"] += 1
            self.collector.add(m.sender, m.seq, m.digest, m.batch, m.view)
        else:
            self._on_fetch_reply(link, m)
        self._wake.set()

    def _on_fetch_reply(self, link: _Link, m: wire.FetchReply) -> None:
        if m.kind != wire.FETCH_LOG:
            self.counters["unexpected"] += 1
            return
        try:
            certified_through, entries = wire.log_reply(m.data)
        except wire.WireError:
            self.counters["bad_log"] += 1
            return
        self.counters["fetch_replies"] += 1
        self.vouches.offer(
            m.sender, certified_through, (e.seq for e in entries), above=self.last_executed
        )
        for e in entries:
            self.collector.add(m.sender, e.seq, e.digest, e.batch, 0)
        if m.seq > self.last_executed and not any(e.seq == self.last_executed + 1 for e in entries):
            # The replica's log starts above us: only state transfer (recovery) can help.
            self.counters["behind_stable"] += 1
        self.stable_votes.offer(m.sender, m.seq, m.digest)
        self._maybe_collect()
        if self._fault_seq is not None and self.last_executed >= self._fault_seq:
            self._fault_seq = None
        # Agreement replicas that saw no fault may have made the checkpoint at the fault
        # seq stable before the round opened (an equivocating replica's right reports
        # certify it there); those that saw it hold theirs below (campaign seed 3101
        # round 93: the spare recovered at the fault seq and never reported it).
        cert = self.stable_votes.certified()
        if self._fault_seq is not None:
            below = self.stable_votes.certified(below=self._fault_seq)
            if below is not None:
                cert = below
            elif time.monotonic() < self._fault_seq_at + _FAULT_SEQ_PATIENCE:
                cert = None  # the replicas that hold below it have not answered yet
        if (
            cert is not None
            and cert[0] > self.last_executed
            and (self._recover_target is None or cert[0] > self._recover_target[0])
        ):
            self._recover_target = cert
        if entries and len(m.data) >= _REFETCH_BYTES:
            more = wire.Fetch(self.svc.id, self.me, wire.FETCH_LOG, entries[-1].seq, NULL_DIGEST)
            link.send(more.with_macs({link.peer: self.agree_keys[link.peer]}).encode())

    def _decode(self, raw: bytes) -> wire.Message | None:
        try:
            m = wire.decode(raw)
        except wire.WireError as e:
            self.counters[f"bad_{e.name}"] += 1
            return None
        if m.service != self.svc.id:
            self.counters["wrong_service"] += 1
            return None
        return m

    def _on_peer_message(self, raw: bytes) -> None:
        m = self._decode(raw)
        if m is None:
            return
        if isinstance(m, wire.ExecCheckpoint):
            self._on_exec_checkpoint(m)
        else:
            self.counters["unexpected"] += 1

    def _send_agreement(self, msg: bytes) -> None:
        for link in self._links:
            link.send(msg)

    # ---- client connections ---------------------------------------------------------

    async def _serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conn_writers.add(writer)
        known: set[int] = set()
        challenge = Challenge()  # FILE-FETCHes on this connection carry it
        try:
            while True:
                raw = await wire.read_frame(reader)
                m = self._decode(raw)
                if m is None:
                    continue
                if isinstance(m, wire.Request):
                    c = self._on_client_request(m, writer)
                    if c is not None:
                        known.add(c)
                elif isinstance(m, wire.ExecCheckpoint):
                    self._on_exec_checkpoint(m)
                elif isinstance(m, wire.FileFetch):
                    await self._serve_file(m, writer, challenge)
                else:
                    self.counters["unexpected"] += 1
        except wire.FrameError:
            self.counters["frame_error"] += 1
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for c in known:
                ws = self._clients.get(c)
                if ws is not None:
                    ws.discard(writer)
                    if not ws:
                        del self._clients[c]
            self._conn_writers.discard(writer)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def _on_client_request(self, m: wire.Request, writer: asyncio.StreamWriter) -> int | None:
        kind, idx = wire.principal_kind(m.sender)
        if kind != "client" or idx >= self.svc.clients or m.sender not in self.macs:
            self.counters["wrong_sender"] += 1
            return None
        if not m.verify_mac(self.me, self.macs[m.sender]):
            self.counters["bad_mac"] += 1
            return None
        self.counters["client_requests"] += 1
        self._clients.setdefault(m.sender, set()).add(writer)
        # Only the agreement cluster orders requests; here a retransmission is answered
        # from the reply cache when it is the one the cache holds.
        hit = self.replies.cached(m.sender, m.timestamp)
        if hit is not None and hit.result is None:
            # A read skipped in replay or restored from a checkpoint: other replicas (and
            # the agreement's REPLY-AFFIRM) answer it; its client may also ask anew.
            self.counters["cache_result_not_kept"] += 1
        elif hit is not None:
            self.counters["cache_resends"] += 1
            self._send_reply(Outgoing(m.sender, m.timestamp, hit.read_only, hit.result), None)
        return m.sender

    def _send_reply(self, out: Outgoing, view: int | None) -> None:
        writers = self._clients.get(out.client)
        if not writers:
            return
        rep = wire.Reply(
            self.svc.id,
            self.me,
            self._view if view is None else view,
            out.timestamp,
            out.client,
            wire.FLAG_READONLY if out.read_only else 0,
            out.result,
        )
        msg = wire.frame(rep.with_macs({out.client: self.macs[out.client]}).encode())
        for w in list(writers):
            if w.is_closing():
                continue
            if w.transport.get_write_buffer_size() > _MAX_WRITE_BUFFER:
                self.counters["slow_client_closed"] += 1
                w.close()
                continue
            w.write(msg)
            self.counters["replies_sent"] += 1

    # ---- execution ------------------------------------------------------------------

    async def _executor(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                target = self._recover_target
                if target is not None and target[0] > self.last_executed:
                    await self._recover(*target)
                while self._stranded_at is None and (cert := self.collector.next_ready()):
                    self._batch_counts = Counter()
                    # A batch already certified without us (a replayed log): its clients
                    # hold their replies and nobody waits for our report (ZZ §4.7.2).
                    vouched = self.vouches.take(cert.seq)
                    if self._fault_seq is not None and cert.seq >= self._fault_seq:
                        # The round we were woken for decides on our report of its seq,
                        # though g+1 agreement replicas that got an equivocating
                        # replica's right reports vouch for it.
                        vouched = False
                    replay = vouched and self.replay_skips_reads
                    t_batch = time.monotonic()
                    try:
                        outs, refs = await asyncio.to_thread(self._run_batch, cert, replay)
                    except StaleCheckpoint as e:
                        self._strand(cert.seq, e)
                        break
                    if vouched:
                        self._time_replay(t_batch)
                    self.counters.update(self._batch_counts)
                    self.collector.executed(cert.seq)
                    self._view = max(self._view, cert.view)
                    for out in outs:
                        self._send_reply(out, cert.view)
                    if self.inject_fault == "slow-report":
                        await asyncio.sleep(self.slow_report_s)
                    # At a checkpoint seq the checkpoint comes first and its digest is in
                    # the report (wire.checkpoint_ref): the agreement replicas compare and
                    # certify it with the replies, so a replica that signs a wrong checkpoint
                    # digest is caught like one that answers wrongly.
                    c = None
                    if cert.seq % self.cp == 0:
                        async with self._store_lock:
                            c = await asyncio.to_thread(self._checkpoint, cert.seq)
                    if replay:
                        self.counters["replayed_certified"] += 1
                    else:
                        if c is not None:
                            refs = [*refs, wire.checkpoint_ref(cert.seq, c)]
                        rep = wire.ExecReport.of(self.svc.id, self.me, cert.seq, refs)
                        if not self.byz.report(cert.seq, rep):
                            self._send_agreement(rep.with_macs(self.agree_keys).encode())
                    self.counters["batches_executed"] += 1
                    if c is not None:
                        self._after_checkpoint(cert.seq, c)
                        self.byz.after_checkpoint(cert.seq)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            log.exception("execution stopped")
            self.fatal = e
            self._stopped.set()

    def _strand(self, seq: int, e: StaleCheckpoint) -> None:
        """Batch `seq` needed a file of the checkpoint this replica recovers from, and
        every peer has collected it since (a newer one became stable) while the file
        changed. The batch ran half-way, so this state is no state any correct replica
        had: execute nothing more, ask the agreement replicas for the stable checkpoint
        (above `seq`, as peers collect only below a stable one) and recover to it."""
        self._stranded_at = seq
        self.counters["stranded"] += 1
        self.recovery["stranded_at"] = seq
        log.warning("batch %d: recovery checkpoint collected (%s): recovering anew", seq, e)
        self._register_again()

    def _time_replay(self, started: float) -> None:
        """Status `replay`: the certified batches run since the last recovery, and the
        seconds from the start of the first to the end of the last (scripts/bench/replay)."""
        r = self.replay
        r["certified_batches"] = r.get("certified_batches", 0) + 1
        self._replay_t0 = started if self._replay_t0 is None else self._replay_t0
        r["seconds"] = round(time.monotonic() - self._replay_t0, 4)

    def _run_batch(
        self, cert: Certificate, replay: bool = False
    ) -> tuple[list[Outgoing], list[wire.ReplyRef]]:
        """Execute one committed batch (in a worker thread; nothing else touches the app,
        the state or the reply cache's writes meanwhile). Returns the replies to send and
        the EXEC-REPORT's reply list (fresh executions only, in batch order). With `replay`
        (the batch holds an execution certificate already) read-only requests only advance
        their client's timestamp: they change no state, and their clients hold the reply."""
        outs: list[Outgoing] = []
        fresh: list[wire.ReplyRef] = []
        # The status writer iterates self.counters on the loop thread: count locally.
        counts = self._batch_counts
        if cert.is_null:
            return outs, fresh
        try:
            nd_time, nd_seed, requests = wire.decode_batch(cert.batch)
        except wire.WireError:
            # Certified but undecodable: every correct replica skips it alike.
            counts["bad_batch"] += 1
            return outs, fresh
        for raw in requests:
            try:
                req = wire.decode(raw)
            except wire.WireError:
                counts["bad_request"] += 1
                continue
            kind, idx = wire.principal_kind(req.sender)
            if (
                not isinstance(req, wire.Request)
                or req.service != self.svc.id
                or kind != "client"
                or idx >= self.svc.clients
            ):
                counts["bad_request"] += 1
                continue
            if not self.replies.is_new(req.sender, req.timestamp):
                hit = self.replies.cached(req.sender, req.timestamp)
                if hit is not None and hit.result is not None:
                    # A re-proposed retransmission: the client may be waiting.
                    outs.append(Outgoing(req.sender, req.timestamp, hit.read_only, hit.result))
                counts["duplicates"] += 1
                continue
            read = req.read_only or req.ordered_read
            if replay and read:
                self.replies.record(req.sender, req.timestamp, None, req.read_only, read)
                counts["reads_skipped"] += 1
                continue
            ctx = ExecContext(
                seq=cert.seq,
                client=req.sender,
                timestamp=req.timestamp,
                time_ms=nd_time,
                seed=nd_seed,
                read_only=read,
            )
            try:
                if read:
                    with self.state.read_only():
                        result = self.app.execute(req.op, ctx)
                else:
                    result = self.app.execute(req.op, ctx)
            except StaleCheckpoint:
                raise  # not the app's fault: the executor recovers anew (_strand)
            except Exception as e:
                raise AppFault(f"app {self.app.name!r} raised at seq {cert.seq}: {e!r}") from e
            result = bytes(result)
            if self._lying(cert.seq):
                result += b" (wrong)"  # a deterministic wrong answer to every request
                counts["wrong_replies"] += 1
            self.replies.record(req.sender, req.timestamp, result, req.read_only, read)
            outs.append(Outgoing(req.sender, req.timestamp, req.read_only, result))
            fresh.append(wire.reply_ref(req.sender, req.timestamp, result))
            counts["requests_executed"] += 1
        return outs, fresh

    # ---- checkpoints ----------------------------------------------------------------

    def _checkpoint(self, seq: int) -> bytes:
        """Manifest + snapshot of the state after `seq` (worker thread); returns C."""
        self.state.sync()
        dirty = self.state.take_dirty()
        self.builder.mark_all_dirty(dirty.written | dirty.deleted)
        memory = self.app.save_memory()
        if memory is not None:
            self.builder.write_memory(memory)
        self.builder.write_runtime_file(REPLIES_PATH, self.replies.encode())
        crash_point("runtime.checkpoint.runtime-files")
        if self.inject_fault == "diverge-state":
            # A deterministic wrong state: one file no correct replica has, so this
            # replica's C differs from theirs at every checkpoint.
            (self.builder.root / DIVERGE_PATH).write_bytes(b"diverged at %d\n" % seq)
            self.builder.mark_dirty(DIVERGE_PATH)
        manifest = self.builder.build()
        name = checkpoint_name(seq)
        if self.fetcher is not None and self.fetcher.done:
            # Every certified file is here now: this snapshot is complete, peers may read it.
            self._complete_from = seq
            self.state.lazy = None
            self.fetcher = None
            self.recovery["complete_at_checkpoint"] = seq
            log.info("recovery complete: checkpoint %d holds the whole state", seq)
        write_atomic(self.manifest_dir / f"{name}.manifest", manifest.encode())
        crash_point("runtime.checkpoint.manifest")
        if self.inject_fault == "corrupt-snapshot":
            self._snapshot_corrupted(name, manifest)
            self._corrupted.add(seq)
        else:
            self.store.snapshot(name)
        crash_point("runtime.checkpoint.snapshot")
        # A recovering peer's first request is this manifest: spare the decode of an entry
        # per file (~20 ms at 10,000 files) on its critical path.
        self.files.remember(seq, manifest)
        return manifest.digest()

    def _snapshot_corrupted(self, name: str, manifest: Manifest) -> None:
        """The corrupt-snapshot fault: flip one byte of every file, snapshot, flip back."""
        flipped: list[tuple[Path, int]] = []
        try:
            for rel, entry in manifest.files.items():
                at = (self.builder.root / rel, entry.size // 2)
                if entry.size and _flip_byte(*at):
                    flipped.append(at)
            self.store.snapshot(name)
        finally:
            for at in flipped:
                _flip_byte(*at)
        self.counters["snapshot_files_corrupted"] += len(flipped)
        log.warning("drill: snapshot %s taken with %d files corrupted", name, len(flipped))

    def _lying(self, seq: int) -> bool:
        if self.inject_fault == "wrong-reply" or self.byz.lying(seq):
            return True
        if self.inject_fault != "corrupt-snapshot" or not self.corrupt_lies:
            return False
        return self._corrupt_lie_from is not None and seq >= self._corrupt_lie_from

    def _after_checkpoint(self, seq: int, c: bytes) -> None:
        self.last_checkpoint = seq
        self.my_checkpoints[seq] = c
        self._my_digests[seq] = c
        for s in sorted(self._my_digests)[:-_DIGEST_HISTORY]:
            del self._my_digests[s]
        self.counters["checkpoints"] += 1
        m = wire.ExecCheckpoint(self.svc.id, self.me, seq, c).signed(self.sign_key).encode()
        sent = self.byz.checkpoint(seq, m)
        if sent is not None:
            self._ckpt_msgs[seq] = sent
            self._send_agreement(sent)
            for link in self._peer_links:
                link.send(sent)
        self.ckpt_votes.setdefault(seq, {})[self.me] = c
        for peer, theirs in list(self.ckpt_votes[seq].items()):
            if peer != self.me:
                self._compare_checkpoint(seq, peer, theirs)
        self._check_stable(seq)

    def _on_exec_checkpoint(self, m: wire.ExecCheckpoint) -> None:
        kind, idx = wire.principal_kind(m.sender)
        if kind != "exec" or idx >= self.svc.n_exec or m.sender == self.me:
            self.counters["wrong_sender"] += 1
            return
        if not self.publics.verify(m):  # a peer's replaced key is counted per sender
            self.counters["bad_sig"] += 1
            return
        # Before the stale check: a replica that is slow and wrong still gets noticed.
        self._compare_checkpoint(m.seq, m.sender, m.checkpoint)
        if m.seq <= self.stable_checkpoint or m.seq % self.cp:
            self.counters["stale_checkpoint"] += 1
            return
        if m.seq > self.last_executed + self.window:
            self.counters["too_far"] += 1
            return
        self.counters["peer_checkpoints"] += 1
        votes = self.ckpt_votes.setdefault(m.seq, {})
        votes.setdefault(m.sender, m.checkpoint)  # first signed statement counts
        self._check_stable(m.seq)

    def _compare_checkpoint(self, seq: int, peer: int, theirs: bytes) -> None:
        """Record a peer's signed checkpoint digest that differs from ours at `seq` (once
        per seq and peer; a peer's later statements for a seq do not count anyway)."""
        mine = self._my_digests.get(seq)
        if mine is None or theirs == mine or (seq, peer) in self._mismatch_seen:
            return
        self._mismatch_seen.add((seq, peer))
        for old in [k for k in self._mismatch_seen if k[0] <= seq - _DIGEST_HISTORY * self.cp]:
            self._mismatch_seen.discard(old)
        _, idx = wire.principal_kind(peer)
        self.counters["checkpoint_mismatches"] += 1
        self.checkpoint_mismatches.append(
            {"seq": seq, "peer": idx, "principal": peer, "mine": mine.hex(), "theirs": theirs.hex()}
        )
        del self.checkpoint_mismatches[:-_MISMATCH_LIST]
        log.warning(
            "checkpoint %d: execution replica %d signed %s, this replica has %s",
            seq,
            idx,
            theirs.hex()[:16],
            mine.hex()[:16],
        )

    def _check_stable(self, seq: int) -> None:
        mine = self.my_checkpoints.get(seq)
        if mine is None or seq <= self.stable_checkpoint:
            return
        votes = self.ckpt_votes.get(seq, {})
        agree = sum(1 for c in votes.values() if c == mine)
        if agree < self.svc.f + 1:
            if len(votes) - agree >= self.svc.f + 1:
                self.counters["checkpoint_divergence"] += 1
                log.error("f+1 execution replicas certify a different state at %d", seq)
            return
        previous, self.stable_checkpoint = self.stable_checkpoint, seq
        log.info("checkpoint %d stable (%s)", seq, mine.hex()[:16])
        if seq in self._corrupted and self._corrupt_lie_from is None:
            self._corrupt_lie_from = seq + max(1, int(self.cp * CORRUPT_LIE_AFTER))
        self._corrupted = {s for s in self._corrupted if s > seq}
        for s in [s for s in self.ckpt_votes if s <= seq]:
            del self.ckpt_votes[s]
        for s in [s for s in self.my_checkpoints if s < seq]:
            del self.my_checkpoints[s]
        for s in [s for s in self._ckpt_msgs if s < seq]:
            del self._ckpt_msgs[s]
        # The snapshot of the stable checkpoint before this one stays too: a spare woken
        # at a fault above it recovers from it (the certified checkpoint it was told when
        # woken) and must replay up to the fault seq to report it, or the round never
        # resolves; collecting it at once stranded such a spare above the fault.
        self._gc_wanted = max(self._gc_wanted, previous)
        # So does every snapshot the agreement replicas may still name: they hold their
        # stable checkpoint below an open fault round while f+1 execution replicas go on
        # making newer ones stable among themselves. Ask them where they are (FETCH kind
        # 3); the replies move the collection (_maybe_collect).
        self._register_again()
        self._maybe_collect()

    def _maybe_collect(self) -> None:
        bound = min(self._gc_wanted, self.stable_votes.floor(self.svc.n))
        if bound > self._gc_done:
            self._gc_done = bound
            asyncio.get_running_loop().create_task(self._collect_garbage(bound))

    async def _collect_garbage(self, stable: int) -> None:
        try:
            async with self._store_lock:
                await asyncio.to_thread(self._destroy_below, stable)
        except Exception:
            log.exception("garbage collection below %d failed", stable)
            self.counters["gc_errors"] += 1

    def _destroy_below(self, stable: int) -> None:
        for name in self.store.list_snapshots():
            if name.startswith("ckpt-") and name[5:].isdigit() and int(name[5:]) < stable:
                self.files.release(name)  # ZFS refuses to destroy a snapshot with a clone
                self.store.destroy_snapshot(name)
                crash_point("runtime.gc.destroyed")
                (self.manifest_dir / f"{name}.manifest").unlink(missing_ok=True)
                self.counters["snapshots_destroyed"] += 1

    # ---- liveness and status --------------------------------------------------------

    async def _stall_loop(self) -> None:
        last = -1
        while True:
            await asyncio.sleep(_STALL_SECONDS)
            # Votes above us but nothing executable for a while: something was lost
            # (e.g. on a reconnect). Registration again makes the replicas resend the log.
            if self.last_executed == last and self.collector.pending():
                self.counters["refetches"] += 1
                self._register_again()
            last = self.last_executed

    def _start_links(self) -> None:
        self.asleep = False
        for link in self._links + self._peer_links:
            link.start()

    async def _wake_watch(self) -> None:
        """React at once to controld's wake-up notice (controld/actions.py wake_notice).

        A replica that slept was frozen mid-flight; once it runs again it must learn the
        cluster's stable checkpoint now, not when the stall check next fires."""
        path = self.state_dir / WAKE_NOTICE
        seen = _mtime(path)
        fault_path = self.state_dir / FAULT_FILE
        fault_seen = _mtime(fault_path)
        if self.drill_faults and fault_seen is not None:
            self._read_fault_file(fault_path)
        while True:
            await asyncio.sleep(_WAKE_POLL)
            if self.drill_faults:
                now = _mtime(fault_path)
                if now != fault_seen:
                    fault_seen = now
                    self._read_fault_file(fault_path)
            now = _mtime(path)
            poked, self._wake_poked = self._wake_poked, False
            if (now is None or now == seen) and not poked:
                continue
            seen = now
            try:
                notice = json.loads(path.read_text())
            except (OSError, ValueError):
                notice = {}
            self.counters["wake_notices"] += 1
            fault = notice.get("recovering_from_seq")
            if type(fault) is int and fault > self.last_executed:
                self._fault_seq, self._fault_seq_at = fault, time.monotonic()
            self.recovery["woken_at"] = notice.get("woken_at")
            self.recovery["noticed_at"] = time.time()
            log.info(
                "woken by controld (from seq %s): registering again",
                notice.get("recovering_from_seq"),
            )
            if self.asleep:
                self._start_links()  # registration is the links' on_connect
                continue
            self._register_again()

    def poke_wake(self) -> None:
        """SIGUSR1 (the guest agent's "wake"): look at the wake notice now, whatever its
        mtime says. A spare paused right after boot missed a notice that controld wrote
        over 9p just after the resume (observed; the cause is not known)."""
        self._wake_poked = True
        self.counters["wake_pokes"] += 1

    def _read_fault_file(self, path: Path) -> None:
        """A drill turns this replica faulty (or correct again) without restarting it: a
        guest's runtime cannot be restarted with --inject-fault in less than seconds."""
        try:
            body = json.loads(path.read_text())
            fault = body.get("fault")
            slow_ms = body.get("slow_report_ms", SLOW_REPORT_SECONDS * 1000)
            lie = body.get("lie", True)
        except FileNotFoundError:
            body, fault, slow_ms, lie = {}, None, SLOW_REPORT_SECONDS * 1000, True
        except (OSError, ValueError, AttributeError) as e:
            self.counters["bad_fault_file"] += 1
            log.warning("%s: %s", path, e)
            return
        if fault is not None and fault not in FAULTS + BYZANTINE_BEHAVIOURS:
            self.counters["bad_fault_file"] += 1
            log.warning("%s: unknown fault %r", path, fault)
            return
        if (
            isinstance(slow_ms, bool)
            or not isinstance(slow_ms, int | float)
            or not (0 <= slow_ms <= 600_000)
        ):
            self.counters["bad_fault_file"] += 1
            log.warning("%s: slow_report_ms must be a number of ms in 0..600000", path)
            return
        if not isinstance(lie, bool):
            self.counters["bad_fault_file"] += 1
            log.warning("%s: lie must be true or false", path)
            return
        try:
            self.byz.configure(fault, body if isinstance(body, dict) else {})
        except ValueError as e:
            self.counters["bad_fault_file"] += 1
            log.warning("%s: %s", path, e)
            return
        self.slow_report_s = slow_ms / 1000
        self.corrupt_lies = lie
        if fault != self.inject_fault:
            log.warning("drill: injected fault now %s", fault)
            self.counters["fault_switches"] += 1
            self.inject_fault = fault

    # ---- recovery (execution/recovery.py, docs/recovery.md) -------------------------

    def _peer_sources(self) -> list[PeerSource]:
        """The peers themselves, then the controlds of their hosts (which serve the peers'
        snapshots from the host even while a peer is paused, crashed or convicted)."""
        if not self._sources:
            n = self.svc.n_exec
            order = [(self.index + k) % n for k in range(1, n)]  # spread the load
            for j in order:
                addr = self.svc.exec_address(self.config, j)
                self._sources.append(self._source(f"x{j}", addr, wire.exec_principal(j)))
            for j in order:
                h = self.svc.exec_host(self.config, j)
                addr = (h.address, h.control_port)
                target = wire.host_principal(h.index)
                self._sources.append(self._source(f"controld-{h.name}", addr, target))
        return self._sources

    def _source(self, name: str, addr: tuple[str, int], target: int) -> PeerSource:
        """A peer or controld at `addr`, whose principal is `target`."""
        return PeerSource(
            name, addr, service=self.svc.id, me=self.me, target=target, sign_key=self.sign_key
        )

    def _fetcher(self, manifest: Manifest, seq: int) -> StateFetcher:
        """A fetcher of checkpoint `seq`'s files into the live directory, from the peers."""
        return StateFetcher(
            self.store.path,
            manifest,
            seq,
            self._peer_sources(),
            on_bad_source=self._bad_source,
            patience=_FETCH_PATIENCE,
            ranking=self._ranking,
            stop=self._stopping,
        )

    def _bad_source(self, source: str, path: str, why: str) -> None:
        self.counters["bad_source_reports"] += 1
        bad = self.recovery.setdefault("bad_sources", [])
        if len(bad) < _MISMATCH_LIST:
            bad.append({"source": source, "path": path, "why": why})

    async def _recover(self, seq: int, digest: bytes) -> None:
        """Jump to the certified checkpoint (seq, digest); files come on first touch."""
        t0 = time.monotonic()
        self.counters["recoveries_started"] += 1
        log.info("behind the stable checkpoint %d (%s): recovering", seq, digest.hex()[:16])
        try:
            async with self._store_lock:
                await asyncio.to_thread(self._install_checkpoint, seq, digest)
        except (RecoveryError, FetchError, OSError) as e:
            # Peers may not have the checkpoint yet (or be down): the next FETCH-REPLY
            # or stall retry brings us back here.
            self.counters["recovery_failures"] += 1
            if self.counters["recovery_failures"] % 25 == 1:
                log.warning("recovery to %d failed (will retry): %s", seq, e)
            if isinstance(e, StaleCheckpoint | RecoveryError):
                # Peers may have collected `seq` since: learn the stable checkpoint anew.
                self._register_again()
            await asyncio.sleep(0.2)
            self._wake.set()
            return
        self._recover_target = None
        self._stranded_at = None
        self.vouches.forget_through(seq)
        self.replay, self._replay_t0 = {}, None
        fetcher = self.fetcher
        assert fetcher is not None
        self.recovery.update(
            {
                "checkpoint": seq,
                "install_ms": round((time.monotonic() - t0) * 1000, 3),
                "files_pending": len(fetcher.pending()),
                "files_kept": fetcher.counters["kept"],
            }
        )
        self.counters["recoveries"] += 1
        # The log above seq: register again so the agreement replicas resend it.
        self._register_again()
        self._start_background(fetcher)

    def _install_checkpoint(self, seq: int, digest: bytes) -> None:
        """Worker thread, store lock held, executor idle (it is the caller). Each phase's
        time goes to the status file (recovery.install_phases_ms): what of a best-case
        recovery grows with the number of files is visible there."""
        phases: dict[str, float] = {}
        t = time.monotonic()

        def lap(name: str) -> None:
            nonlocal t
            now = time.monotonic()
            phases[name] = round((now - t) * 1000, 3)
            t = now

        sources = self._peer_sources()
        manifest = fetch_manifest(
            sources,
            seq,
            digest,
            on_bad_source=self._bad_source,
            ranking=self._ranking,
            like=self.builder.previous,
        )
        lap("manifest")
        self.state.sync()
        live = self.store.path
        fetcher = self._fetcher(manifest, seq)
        # What this replica's own last checkpoint says, plus what changed since: enough to
        # tell which files match without re-hashing the whole state (docs/recovery.md).
        own = self.builder.previous
        suspect = self.state.peek_dirty() | self.builder.dirty
        if self.fetcher is not None:  # an earlier recovery had not fetched these yet
            self._bg_stop.set()
            suspect |= set(self.fetcher.pending())
        if self._half_installed:
            fetcher.prepare()
        else:
            fetcher.prepare(own.files if own is not None else {}, suspect)
        # The live directory is half the old state, half the new one from here until the
        # install completes: if it fails, nothing may execute on it.
        self._stranded_at = self.last_executed + 1
        self._half_installed = True
        lap("reconcile")
        if self.recovery_mode == "full":
            fetcher.fetch_all()  # the baseline: nothing executes before every file is here
            if not fetcher.done:
                raise FetchError(f"full transfer of checkpoint {seq}: {fetcher.pending()[:3]}")
        # The runtime's own files are needed before the first request executes.
        for path in (MEMORY_PATH, REPLIES_PATH):
            if path in manifest.files:
                fetcher.ensure(path)
        lap("fetch")
        replies = live / REPLIES_PATH
        self.replies = ReplyCache.decode(replies.read_bytes()) if replies.exists() else ReplyCache()
        self.app = create_app(self.svc.app)
        self.state = StateDir(live, lazy=fetcher)
        self.app.open(self.state)
        memory = live / MEMORY_PATH
        if memory.exists():
            self.app.load_memory(memory.read_bytes())
        self.builder = ManifestBuilder(live, manifest)
        lap("open")
        write_atomic(self.manifest_dir / f"{checkpoint_name(seq)}.manifest", manifest.encode())
        lap("record")
        self.collector.executed(seq)
        self.last_checkpoint = seq
        self.my_checkpoints[seq] = digest
        self._my_digests[seq] = digest
        self._complete_from = 1 << 64  # until the fetch completes and a checkpoint follows
        self.fetcher = fetcher
        self._half_installed = False
        self.recovery["install_phases_ms"] = phases

    def _start_background(self, fetcher: StateFetcher) -> None:
        # A new event, not the old one cleared: the previous loop (stopped by the install)
        # may not have seen it set yet, and must not go on with a superseded manifest.
        self._bg_stop = threading.Event()
        self._bg_thread = threading.Thread(
            target=self._background_fetch,
            args=(fetcher, self._bg_stop),
            name="zz-fetch",
            daemon=True,
        )
        self._bg_thread.start()

    def _background_fetch(self, fetcher: StateFetcher, stop: threading.Event) -> None:
        t0 = time.monotonic()
        try:
            n = fetcher.fetch_all(stop, pause=self.background_pause)
        except Exception:
            log.exception("background fetch stopped")
            return
        if fetcher.done:
            self.recovery["background_s"] = round(time.monotonic() - t0, 3)
            self.recovery["background_files"] = n
            log.info("background fetch done: %d files in %.2f s", n, time.monotonic() - t0)

    async def _serve_file(
        self, m: wire.FileFetch, writer: asyncio.StreamWriter, challenge: Challenge
    ) -> None:
        refused = m.refusal(self.publics, self.svc.n_exec, server=self.me)
        if refused is not None:  # not from a peer: no answer
            self.counters[refused] += 1
            if refused == "file_fetch_bad_sig":
                self.publics.note_failed(m)  # a peer's replaced key is counted per sender
            return
        r: FileRead
        unbound = challenge.check(self.me, m.target, m.challenge)
        if unbound is not None:  # for another server or connection, or the first one
            self.counters[unbound[0]] += 1
            r = unbound[1]
        else:
            if bad_range(m.offset, m.length):
                self.counters["file_fetch_bad_range"] += 1
            async with self._store_lock:
                r = await asyncio.to_thread(
                    self.files.read, m.seq, m.path_text(), m.offset, m.length
                )
        out = wire.FileData(self.svc.id, self.me, m.seq, m.path, m.offset, r.status, r.size, r.data)
        if unbound is None:
            out = self.byz.file_data(out)  # a drill's forged bytes; never the challenge
            self.counters["file_chunks_served"] += 1
            self.counters["file_bytes_served"] += len(r.data)
        if writer.is_closing():
            return
        writer.write(wire.frame(out.encode()))
        # Requests on a connection are served one at a time, so waiting here bounds what
        # one requester makes us buffer to one chunk; one that does not read is dropped.
        try:
            async with asyncio.timeout(FILE_SEND_TIMEOUT):
                await writer.drain()
        except TimeoutError:
            self.counters["file_fetch_slow_readers"] += 1
            writer.transport.abort()
            raise ConnectionResetError("requester does not read") from None

    def status(self) -> dict[str, Any]:
        return {
            "service": self.svc.id,
            "index": self.index,
            "principal": self.me,
            "pid": os.getpid(),
            "inject_fault": self.inject_fault,
            "corrupt_lie_from": self._corrupt_lie_from,
            "last_executed": self.last_executed,
            "last_checkpoint": self.last_checkpoint,
            "stable_checkpoint": self.stable_checkpoint,
            "checkpoints": {str(s): c.hex() for s, c in sorted(self.my_checkpoints.items())},
            "checkpoint_mismatches": list(self.checkpoint_mismatches),
            "agreement_links_up": sum(1 for link in self._links if link.up),
            "clients_connected": len(self._clients),
            "pending_seqs": len(self.collector.pending()),
            "counters": dict(sorted(self.counters.items())),
            "certificates": dict(sorted(self.collector.dropped.items())),
            "recovery": dict(self.recovery),
            "replay": dict(self.replay),
            "asleep": self.asleep,
            "recovering": self.fetcher is not None,
            "files_pending": len(self.fetcher.pending()) if self.fetcher is not None else 0,
            "fetch": self._fetch_counters(),
        }

    def _fetch_counters(self) -> dict[str, int]:
        """What this runtime's state fetches did (bytes, files fetched and verified, bad
        copies, files kept): a fetcher's counters are added up once the status sees it
        replaced or gone (at most one second later)."""
        cur = self.fetcher
        if cur is not self._fetch_seen:
            if self._fetch_seen is not None:
                self._fetch_totals.update(self._fetch_seen.counters)
            self._fetch_seen = cur
        out = Counter(self._fetch_totals)
        if cur is not None:
            for _ in range(3):  # the background fetch thread may add a key meanwhile
                try:
                    out.update(dict(cur.counters))
                    break
                except RuntimeError:
                    continue
        return dict(sorted(out.items()))

    def _write_status(self) -> None:
        write_atomic(self.status_path, json.dumps(self.status(), indent=1).encode() + b"\n")

    async def _status_loop(self) -> None:
        while True:
            try:
                self._write_status()
            except OSError as e:
                log.warning("cannot write %s: %s", self.status_path, e)
            await asyncio.sleep(1.0)


async def serve(
    config: Config, service: Service, index: int, *, store_kind: str = "dir", **kw: Any
) -> None:
    """Run one execution replica until SIGTERM/SIGINT."""
    rt = Runtime(config, service, index, store_kind=store_kind, **kw)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rt.stop)
    loop.add_signal_handler(signal.SIGUSR1, rt.poke_wake)
    try:
        await rt.serve()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            loop.remove_signal_handler(sig)
