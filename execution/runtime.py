"""execution/runtime.py - one execution replica (ZZ §4.1-4.2, docs/design.md §3.3-§5.5).
Executes batches on 2g+1-replica commit certificates, replies to clients, checkpoints every CP."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zz import keys, naming, wire
from zz.atomicfile import write_atomic
from zz.config import Config, Service
from zz.crypto import NULL_DIGEST, SigningKey
from zz.drillfaults import FAULT_FILE, FAULTS
from zz.execution.app import App, ExecContext
from zz.execution.certificates import DEFAULT_WINDOW, Certificate, CommitCollector
from zz.execution.checkpointing import MISMATCH_LIST, STORE_KINDS, Checkpoints
from zz.execution.drillfaults import DrillFaults
from zz.execution.recovery import (
    CertifiedVouches,
    RecoveryError,
    StableVotes,
    fetch_manifest,
)
from zz.execution.registry import create_app
from zz.execution.replycache import PATH as REPLIES_PATH
from zz.execution.replycache import ReplyCache
from zz.execution.reports import SentReports
from zz.execution.state import StateDir
from zz.link import Link
from zz.snapshots import checkpoint_name
from zz.snapshots.copies import Place
from zz.snapshots.fetch import FetchError, SourceRanking, StaleCheckpoint, StateFetcher
from zz.snapshots.fileserve import COPY, FILE_SEND_TIMEOUT, Challenge, FileRead, bad_range
from zz.snapshots.manifest import MEMORY_PATH, Manifest, ManifestBuilder, ManifestError
from zz.snapshots.peersource import PeerSource
from zz.snapshots.warm import WARM_DIR, WarmFiles

log = logging.getLogger("zz.execution")

# A FETCH-REPLY this large may have been cut at the replier's ~4 MiB limit: ask for more.
_REFETCH_BYTES = 1 << 20
# A connection whose peer stops reading is dropped rather than buffering without bound.
_MAX_WRITE_BUFFER = 64 << 20
_STALL_SECONDS = 1.0
# A report this long after its batch's first commit vote is logged with where the time
# went (status `slow_reports`): the agreement replicas' timer floor is 2 s on guest racks.
SLOW_REPORT_S = 0.5
SLOW_LOG_S = 10.0
# controld writes this into the state directory when it wakes the replica (controld/actions.py).
WAKE_NOTICE = "controld-wakeup.json"
# How long a woken replica waits for g+1 agreement replicas to name a stable checkpoint
# below its round's seq before it takes one at or above it (and cannot report that seq).
_FAULT_SEQ_PATIENCE = 5.0
_WAKE_POLL = 0.02
# A gap this long between agreement frames means the replica was stopped (paused) or idle:
# look for a wake notice before judging the next frame (_peek_wake_notice).
_PEEK_GAP = 0.25
# The status file is written every second, and at most this long after a link came up.
_STATUS_MIN_GAP = 0.05
# How long a request waiting for a file keeps asking the peers before the replica gives up.
_FETCH_PATIENCE = 60.0
# Sleep between background file fetches: request execution keeps most of the bandwidth.
_BACKGROUND_PAUSE = 0.001


def _process_start_mono() -> float | None:
    """This process's start on the time.monotonic() clock (from /proc/self/stat; None
    where there is none): a runtime started at a wake-up (a hibernated guest's) counts its
    interpreter start-up and imports from here. One the guest agent started ahead of the
    wake (images/zz_guest.py PRESTART) counts from when the wake handed it its command."""
    go = os.environ.get("ZZ_PRESTART_GO")
    if go:
        with contextlib.suppress(ValueError):
            return float(go)
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime, field 22
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.monotonic() - age


def _with_mono_now(body: str) -> str:
    """A JSON object's text with `"mono_now": time.monotonic()` added as its last member."""
    end = body.rstrip()
    assert end.endswith("}")
    sep = "" if end[:-1].rstrip().endswith("{") else ","
    return f'{end[:-1].rstrip()}{sep}\n "mono_now": {round(time.monotonic(), 4)}\n}}'


def _handed_marks() -> dict[str, float]:
    """The steps of a wake-up taken before this runtime ran, on the same time.monotonic()
    clock: the guest agent's (ZZ_WAKE_MARKS, images/zz_guest.py: agent_wake, mounted,
    notice_written, config_read) for a runtime it started or handed its command at the
    wake. A value that is not a number is left out."""
    try:
        marks = json.loads(os.environ.get("ZZ_WAKE_MARKS") or "{}")
    except ValueError:
        return {}
    if not isinstance(marks, dict):
        return {}
    return {str(k): round(float(v), 4) for k, v in marks.items() if isinstance(v, int | float)}


@dataclass
class StartKeys:
    """What Runtime.start reads from the key directory: this replica's secret (its signing
    key and the MAC keys it shares with the agreement replicas and the clients), the
    service's public keys (PeerKeys: they follow the slots' key epochs) and its own
    announcement (SPARE-READY) at the secret's epoch. `files`: what they were read from,
    present or not (execution/__main__.py prestart reads them before a hibernated guest's
    sleep and keeps them only if none of these changed by the wake)."""

    secret: keys.Secret
    publics: keys.PeerKeys
    announcement: bytes | None
    files: tuple[Path, ...]


def load_start_keys(
    config: Config, svc: Service, index: int, counters: Counter[str]
) -> StartKeys:
    """Read the keys of execution replica `index` (raises keys.KeyFileError)."""
    kd, me = config.rack.key_dir, wire.exec_principal(index)
    path = keys.secret_path(kd, svc.id, me)
    secret = keys.load_secret(path)
    if secret.sign is None:
        raise keys.KeyFileError(f"principal {me} has no signing key")
    keys.peer_keys(secret, range(svc.n))  # every agreement replica's MAC key is there
    files = (
        path,
        keys.public_path(kd, svc.id),
        keys.service_dir(kd, keys.RACK_SERVICE) / "public",
        *(keys.spare_cert_path(kd, svc.id, wire.exec_principal(j)) for j in range(svc.n_exec)),
    )
    publics = keys.PeerKeys(kd, config, svc, counters)
    return StartKeys(secret, publics, _own_announcement(kd, svc, index, secret.epoch), files)


def _own_announcement(key_dir: Path, svc: Service, index: int, epoch: int) -> bytes | None:
    """The framed SPARE-READY announcing slot `index`'s keys at `epoch` (None at epoch 0,
    or when the key directory holds no announcement of that epoch)."""
    if epoch == 0:
        return None
    path = keys.spare_cert_path(key_dir, svc.id, wire.exec_principal(index))
    with contextlib.suppress(OSError, ValueError, wire.WireError):
        raw = bytes.fromhex(path.read_text().strip())
        m = wire.decode(raw)
        if isinstance(m, wire.SpareReady) and m.epoch == epoch and m.replica == index:
            return wire.frame(raw)
    log.warning("key epoch %d but no announcement of it in %s", epoch, path)
    return None


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


def _log_start(data: bytes) -> int:
    """The first seq a FETCH-REPLY kind 3 log lists (docs/wire.md: u64 certified_through,
    u32 count, then entries each beginning with its u64 seq), read without decoding the
    batches; 0 when it lists none or is too short to say."""
    if len(data) < 20 or int.from_bytes(data[8:12], "big") == 0:
        return 0
    return int.from_bytes(data[12:20], "big")


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
        # An agreement replica sent a frame on this connection whose MAC verifies: it
        # registered us under the keys we use (a link up shows only the TCP connection).
        self.answered = False

    def on_connect(self) -> list[bytes]:
        self.answered = False
        return self.rt.on_link_connect(self)

    def on_frame(self, raw: bytes) -> None:
        self.rt.on_link_frame(self, raw)

    def on_frame_error(self) -> None:
        self.rt.counters["frame_error"] += 1

    def on_overflow(self) -> None:
        self.rt.counters["slow_peer_closed"] += 1


@dataclass(frozen=True)
class RuntimeOptions:
    """How one execution replica runs, beyond what the rack config says (execution/__main__.py
    maps its command line onto it). Checked once, when made; errors name the field."""

    store: str = "dir"  # STORE_KINDS: dir, zfs (on the host), host-zfs (in a guest)
    zfs_pool: str | None = None  # store zfs
    zfs_dataset: str | None = None  # store zfs; default zz/naming.py zfs_dataset
    window: int = DEFAULT_WINDOW  # certificates held above the last executed seq
    recovery: str = "on-demand"  # on-demand (files on first touch) | full (all, then run)
    replay_skips_reads: bool = True  # a vouched batch's reads only advance the timestamp
    # A replayed run's buffered writes go to the files before the first batch that reports
    # (the baseline) instead of after its replies and report are sent (docs/recovery.md
    # "Each file written once per run").
    flush_replay_first: bool = False
    background_pause: float = _BACKGROUND_PAUSE  # s between two background file fetches
    asleep: bool = False  # provisioned as a spare: not registered until the wake notice
    state_dir: Path | None = None  # default Service.exec_state_dir (a guest: its share)
    status_path: Path | None = None  # default <state dir>.status.json
    listen: str | None = None  # address to listen on instead of the configured one
    inject_fault: str | None = None  # DRILLS: one of zz/drillfaults.py FAULTS
    drill_faults: bool = False  # DRILLS: <state dir>/zz-fault.json switches the fault
    # Steps of the start-up taken before the Runtime was made (execution/__main__.py: main,
    # config_loaded), on the time.monotonic() clock: wake_marks of a runtime started awake.
    marks: tuple[tuple[str, float], ...] = ()
    # The keys as read before the start (execution/__main__.py prestart), else None: read
    # in start().
    start_keys: StartKeys | None = None

    def __post_init__(self) -> None:
        if self.store not in STORE_KINDS:
            raise ValueError(f"store {self.store!r}: one of {', '.join(STORE_KINDS)}")
        if self.recovery not in ("on-demand", "full"):
            raise ValueError(f"recovery {self.recovery!r}: on-demand or full")
        if not 0 <= self.background_pause <= 3600:
            raise ValueError(f"background_pause {self.background_pause} s: not in 0..3600")
        if self.inject_fault is not None and self.inject_fault not in FAULTS:
            raise ValueError(f"inject_fault {self.inject_fault!r}: one of {', '.join(FAULTS)}")


class Runtime:
    """Execution replica `index` of `service`. It owns its checkpoints (`ckpt`,
    execution/checkpointing.py) and the seam of test-only faults (`faults`,
    execution/drillfaults.py); recovery's pieces are in execution/recovery.py.

    Life cycle: `await rt.start()`, then `await rt.wait()` until stop() or a fatal
    error, then `await rt.shutdown()`; `serve()` does all three."""

    def __init__(
        self,
        config: Config,
        service: Service,
        index: int,
        options: RuntimeOptions | None = None,
    ) -> None:
        if not 0 <= index < service.n_exec:
            raise ValueError(f"{service.name}: no execution replica {index}")
        opts = self.options = options or RuntimeOptions()
        self.config = config
        self.svc = service
        self.index = index
        self.me = wire.exec_principal(index)
        self.cp = config.rack.checkpoint_interval
        # In a guest the state dir is the 9p share (/state) and the status goes into it:
        # the host's paths mean nothing there (controld/actions.py guest_runtime_command).
        self.state_dir = opts.state_dir or service.exec_state_dir(config, index)
        self.status_path = opts.status_path or self.state_dir.with_name(
            f"{self.state_dir.name}.status.json"
        )
        self.collector = CommitCollector(service.n, service.g, opts.window)
        self.replies = ReplyCache()
        # The newest EXEC-REPORTs, sent again on every fresh connection to an agreement
        # replica: one lost on a link that broke would show this replica silent there.
        self.sent_reports = SentReports(service.n, config.rack.log_window)
        self.counters: Counter[str] = Counter()
        fault_file = self.state_dir / FAULT_FILE if opts.drill_faults else None
        self.faults = DrillFaults(self, opts.inject_fault, fault_file)
        self.ckpt = Checkpoints(
            service,
            self.me,
            self.cp,
            manifest_dir=self.state_dir / "manifests",
            counters=self.counters,
            faults=self.faults,
            send=self._send_checkpoint,
            register_again=self._register_again,
            agreed_floor=lambda: self.stable_votes.floor(self.svc.n),
        )
        self._clients: dict[int, set[asyncio.StreamWriter]] = {}
        self._conn_writers: set[asyncio.StreamWriter] = set()
        self._links: list[_Link] = []
        self._peer_links: list[_Link] = []
        self._tasks: list[asyncio.Task[None]] = []
        # Set when a link comes up: the status file says so at once, not at the next
        # second's write (controld and `zz rack up` wait for every link in that file).
        self._status_changed = asyncio.Event()
        self.faults.on_switch = self._status_changed.set
        self._server: asyncio.base_events.Server | None = None
        self._wake = asyncio.Event()
        self._stopped = asyncio.Event()
        self.fatal: BaseException | None = None
        self._batch_counts: Counter[str] = Counter()
        self._view = 0  # of the latest certificate; a cached reply resent later carries it
        # Recovery (execution/recovery.py): g+1 agreement replicas vouching for a stable
        # checkpoint above last_executed mean the log no longer reaches back to us.
        # Provisioned as a spare: state open, listening, but not registered with the
        # agreement replicas (so not executing) until controld's wake notice.
        self.asleep = opts.asleep
        # A spare (started asleep) recovers when woken, as the round it was woken for needs
        # (docs/recovery.md); only a replica that started active replays past a certified
        # checkpoint (_on_fetch_reply).
        self._started_asleep = opts.asleep
        self._wake_poked = False
        self._poked_at: float | None = None  # when the last SIGUSR1 came (wake_marks `poked`)
        self.stable_votes = StableVotes(service.g)
        self.vouches = CertifiedVouches(service.g)
        self.replay: dict[str, Any] = {}
        self.slow_reports: deque[dict[str, float]] = deque(maxlen=16)
        self.checkpoint_reports: deque[dict[str, float]] = deque(maxlen=8)
        # Milliseconds of the last checkpoint's parts and the slowest of each (status).
        self.checkpoint_ms: dict[str, float] = {}
        self.checkpoint_ms_max: dict[str, float] = {}
        self._ckpt_task: asyncio.Task[None] | None = None
        self._slow_worst: dict[str, float] | None = None
        self._slow_since = 0
        self._slow_logged = -SLOW_LOG_S
        self._replay_t0: float | None = None
        self._replay_end: float | None = None  # when the last replayed batch's turn ended
        self._recover_target: tuple[int, bytes] | None = None
        # The seq of the fault round this replica was woken for (controld's wake notice):
        # it must recover below it and replay it, or its report never comes.
        self._fault_seq: int | None = None
        self._fault_seq_at = 0.0
        # The wake notice whose seq was last taken (its mtime), by _wake_watch or by
        # _peek_wake_notice, which looks before a resumed replica judges anything by it.
        self._notice_taken = _mtime(self.state_dir / WAKE_NOTICE)
        # What _wake_watch compares against: the notice as it was when this runtime was made,
        # before it listens. Read at the task's first step instead, it took a notice that
        # controld wrote while the freshly provisioned spare was paused before that step
        # ran (the notice is written before the resume) for an old one, and the woken spare
        # stayed silent until it was convicted (campaign seed 3302 round 3 at f = 2).
        self._notice_at_start = self._notice_taken
        # The steps of this replica's latest wake-up on its time.monotonic() clock (status
        # `wake_marks`, with `mono_now`): noticed (the wake notice taken; with it
        # poll_before and poll_looked, the notice poll's looks before and at it, poked, the
        # guest agent's SIGUSR1, notice_read and links_started) or started (a
        # runtime started at the wake; before it the guest agent's steps, and after it
        # main, config_loaded, keys_loaded, state_opened, listening), link_up,
        # recover_start, recovered, replay_first and replay_last (certified batches run
        # again), first_fresh (the first batch whose report counts: its replies are sent).
        # zz drill places them on the host's clock (docs/operations.md "Recovery phases").
        self.wake_marks: dict[str, float] = {}
        self._process_started = _process_start_mono() or time.monotonic()
        # The first report this process sends is logged with how long after its start it
        # went (power-loss runs: which runtime of a service reported the first seqs after a
        # whole-rack restart late, and by how much, is read from the two lines).
        self._first_report_logged = False
        if not opts.asleep:
            self.wake_marks = {**_handed_marks(), **dict(opts.marks),
                               "started": round(self._process_started, 4)}  # fmt: skip
        self._last_agreement_frame = time.monotonic()
        # The seq of a batch abandoned half-run because the checkpoint being recovered was
        # collected (StaleCheckpoint): nothing executes until a newer one is installed.
        self._stranded_at: int | None = None
        # An install failed after reconciling the live directory: what is in it is known
        # to no manifest any more, so the next install hashes it all (prepare's walk).
        self._half_installed = False
        # The checkpoint being installed: the agreement replicas are asked for the log
        # above it during the install (_recover), and a reply's log that starts right
        # above it is taken as it comes.
        self._installing: int | None = None
        self.fetcher: StateFetcher | None = None
        # Every fetcher's counters, summed for the status file's "fetch" (controld's metrics).
        self._fetch_totals: Counter[str] = Counter()
        self._fetch_seen: StateFetcher | None = None
        self.recovery: dict[str, Any] = {}
        self._bg_stop = threading.Event()
        self._bg_thread: threading.Thread | None = None
        # A recovery's background fetch waits for the replay (_start_due_background).
        self._bg_due: tuple[StateFetcher, float] | None = None
        self._sources: list[PeerSource] = []
        self._ranking = SourceRanking()
        # What the host's controld staged while this replica slept (docs/recovery.md "A
        # warm spare"): the manifest and files are looked up there by their certified hash
        # before any peer is asked, and taken only if they hash to it.
        self.warm = WarmFiles(self.state_dir / WARM_DIR)
        self._stopping = threading.Event()
        # Set in start():
        self.state: StateDir
        self.app: App
        self.sign_key: SigningKey
        self.agree_keys: dict[int, bytes] = {}
        self.macs: dict[int, bytes] = {}
        self.publics: keys.PeerKeys  # follows the peers' key epochs (zz/keys.py)
        # A re-keyed slot's signed SPARE-READY (its controld's, in the key directory): sent,
        # once per connection, to a client whose REQUEST does not verify under this
        # incarnation's keys, so that a client that cannot read the announcement where it
        # runs (another machine) learns them (docs/wire.md "Key epochs"). None: epoch 0.
        self._announcement: bytes | None = None
        self._introduced: set[asyncio.StreamWriter] = set()

    @property
    def last_executed(self) -> int:
        return self.collector.last_executed

    # ---- start-up and shutdown ----------------------------------------------------

    async def start(self) -> None:
        k = self.options.start_keys
        if k is None:
            k = load_start_keys(self.config, self.svc, self.index, self.counters)
        else:
            self.counters.update(k.publics.counters)
            k.publics.counters = self.counters
            self.counters["start_keys_read_ahead"] += 1
        secret = k.secret
        assert secret.sign is not None  # load_start_keys checked it
        self.sign_key = secret.sign
        self.agree_keys = keys.peer_keys(secret, range(self.svc.n))
        self.macs = dict(secret.macs)
        self.publics = k.publics
        self._announcement = k.announcement
        self._start_mark("keys_loaded")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt.manifest_dir.mkdir(exist_ok=True)
        await asyncio.to_thread(self._open_state)
        self._start_mark("state_opened")

        host, port = self.svc.exec_address(self.config, self.index)
        host = self.options.listen or host
        self._server = await self._listen(host, port)
        self._start_mark("listening")
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
        if self.faults.fault_file is not None:
            self._tasks.append(asyncio.create_task(self.faults.watch(), name="zz-exec-faults"))
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
        """Open the store and the app on the last complete checkpoint (worker thread)."""
        o, ck = self.options, self.ckpt
        ck.open(
            o.store,
            self.state_dir,
            self.index,
            self.sign_key if o.store == "host-zfs" else None,  # it signs snapshot requests
            o.zfs_pool,
            o.zfs_dataset or naming.zfs_dataset(self.svc, self.index),
        )
        ck.files.live = self._live_copies
        self.app = create_app(self.svc.app)
        live = ck.store.path
        previous: Manifest | None = None
        fetcher: StateFetcher | None = None
        restored = ck.restore_latest()
        if restored is not None:
            seq, there, previous = restored
            if previous.files != there.files:
                # Taken while this replica was still fetching a recovered state
                # (docs/recovery.md): what it had not fetched yet is missing from the
                # snapshot. Fetch it again, on first touch and in the background.
                fetcher = self._fetcher(previous, seq)
                fetcher.prepare(there.files, ())
                name = checkpoint_name(seq)
                self.recovery.update(
                    {"restored_incomplete": name, "files_pending": len(fetcher.pending())}
                )
                log.info("%s lacks %d files: fetching them", name, len(fetcher.pending()))
            replies = live / REPLIES_PATH
            if replies.exists():
                self.replies = ReplyCache.decode(replies.read_bytes())
            self.collector.executed(seq)
            ck.adopt(seq, previous.digest())
        self.state = StateDir(live, lazy=fetcher)
        if fetcher is not None:
            self.fetcher = fetcher
            ck.complete_from = 1 << 64
        self.app.open(self.state)
        memory = live / MEMORY_PATH
        if memory.exists():
            self.app.load_memory(memory.read_bytes())
        ck.builder = ManifestBuilder(live, previous)

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
        if self._ckpt_task is not None:  # a snapshot being completed: let it list itself
            with contextlib.suppress(Exception):
                await self._ckpt_task
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
            await asyncio.to_thread(self.ckpt.files.release)

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

    def _log_base(self) -> int:
        """The seq the log is asked for from: the last executed batch, or during an
        install the checkpoint being installed."""
        return self.last_executed if self._installing is None else self._installing

    def _fetch_msg(self, r: int, since: int | None = None) -> bytes:
        seq = self._log_base() if since is None else since
        m = wire.Fetch(self.svc.id, self.me, wire.FETCH_LOG, seq, NULL_DIGEST)
        return m.with_macs({r: self.agree_keys[r]}).encode()

    def _register_again(self, since: int | None = None) -> None:
        """FETCH (kind 3) to every agreement replica: each answers with its stable
        checkpoint and the log above our last executed batch (above `since` if given), and
        pushes batches to us."""
        for link in self._links:
            link.send(self._fetch_msg(link.peer, since))

    def on_link_connect(self, link: _Link) -> list[bytes]:
        # Registration (FETCH kind 3) must be re-sent after every reconnect: the agreement
        # replica forgets the connection, and with it where to push EXEC-COMMITs.
        self._status_changed.set()
        if link.peer < wire.PRINCIPAL_EXEC:
            self._mark("link_up")
            return [self._fetch_msg(link.peer), *self.ckpt.latest_msgs(), *self._resend(link.peer)]
        return self.ckpt.latest_msgs()

    def _resend(self, r: int) -> list[bytes]:
        """The kept EXEC-REPORTs agreement replica `r` may have missed while the link was
        down or breaking (execution/reports.py), each with its one MAC for `r`. One it
        already holds changes nothing there (docs/fault-detection.md)."""
        out = [
            rep.with_macs({r: self.agree_keys[r]}).encode()
            for rep in self.sent_reports.for_replica(r)
        ]
        self.counters["reports_resent"] += len(out)
        return out

    def on_link_frame(self, link: _Link, raw: bytes) -> None:
        if link.peer >= wire.PRINCIPAL_EXEC:
            self._on_peer_message(raw)
            return
        now = time.monotonic()
        if now - self._last_agreement_frame > _PEEK_GAP:
            self._peek_wake_notice()  # stopped (paused) or idle: maybe woken since
        self._last_agreement_frame = now
        m = self._decode(raw)
        if m is None:
            return
        if m.sender != link.peer:
            self.counters["wrong_sender"] += 1
            return
        if not isinstance(m, wire.ExecCommit | wire.FetchReply):
            self.counters["unexpected"] += 1
            return
        if not m.verify_mac_received(raw, self.me, self.agree_keys[link.peer]):
            self.counters["bad_mac"] += 1
            return
        link.answered = True
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
        self._peek_wake_notice()  # the target below is chosen by the round's seq
        self.counters["fetch_replies"] += 1
        self.sent_reports.stable_at(m.sender, m.seq)  # it needs no report at or below it
        self.stable_votes.offer(m.sender, m.seq, m.digest)
        self.ckpt.maybe_collect()
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
        start = _log_start(m.data)
        # A certified checkpoint one interval above us, with a log that goes on right above
        # our last executed batch, is reached by replay, with nothing fetched: the agreement
        # replicas keep the log from the stable checkpoint before theirs, and that one's
        # snapshot is what a replica has after a power cut took the snapshot of the
        # checkpoint it had just reported (the directory store lists it after the report).
        # Recovering instead asked peers that had lost the same snapshot, or slept, for 2-4 s
        # while the agreement replicas timed out our reports (a correct replica convicted in
        # a power-loss run). Further behind, fetching what changed beats replaying it all.
        replayable = (
            not self._started_asleep
            and self._fault_seq is None
            and self._installing is None
            and self._recover_target is None
            and start == self.last_executed + 1
            and (cert is None or cert[0] - self.last_executed <= self.cp)
        )
        if (
            cert is not None
            and cert[0] > self.last_executed
            and not replayable
            and (self._recover_target is None or cert[0] > self._recover_target[0])
        ):
            self._recover_target = cert
        elif replayable and cert is not None and cert[0] > self.last_executed:
            self.counters["replayed_to_stable"] += 1
        target = self._recover_target
        if (
            target is not None
            and target[0] > self.last_executed
            and (start > self.last_executed + 1 if self._installing is None else
                 start != self._installing + 1)
        ):  # fmt: skip
            # Recovering, and this log cannot be replayed from here: its batches are not
            # even hashed (up to ~4 MiB a reply, from every agreement replica, before the
            # install could start). The registration at the install asks for the log
            # above the checkpoint recovered to (_recover); during the install only a log
            # that starts right above that checkpoint is taken.
            self.counters["behind_stable"] += 1
            self.counters["log_replies_skipped"] += 1
            return
        try:
            certified_through, entries = wire.log_reply(m.data)
        except wire.WireError:
            self.counters["bad_log"] += 1
            return
        self.vouches.offer(
            m.sender, certified_through, (e.seq for e in entries), above=self._log_base()
        )
        for e in entries:  # log_reply checked every batch against its digest
            self.collector.add(m.sender, e.seq, e.digest, e.batch, 0, hashed=True)
        if m.seq > self.last_executed and not any(e.seq == self.last_executed + 1 for e in entries):
            # The replica's log starts above us: only state transfer (recovery) can help.
            self.counters["behind_stable"] += 1
        if entries and len(m.data) >= _REFETCH_BYTES:
            target = self._recover_target
            if target is not None and target[0] >= entries[-1].seq:
                # Recovering to a checkpoint at or above all this reply listed: the
                # registration after the install asks for the log above it (_recover).
                # Pulling the rest of the log below it (the agreement replicas keep it from
                # the stable checkpoint before theirs, tens of MiB of 128 KiB WRITEs in
                # scripts/bench/files --figure9) held a woken spare's loop for 0.4 s.
                self.counters["log_refetch_skipped"] += 1
                return
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

    def _send_checkpoint(self, msg: bytes) -> None:
        """A signed EXEC-CHECKPOINT to every agreement replica and every peer."""
        self._send_agreement(msg)
        for link in self._peer_links:
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
            self._introduced.discard(writer)
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
            if self._announcement is not None and writer not in self._introduced:
                # Perhaps a client that knows this slot's keys of an earlier epoch only.
                self._introduced.add(writer)
                writer.write(self._announcement)
                self.counters["introductions_sent"] += 1
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
                    replay = vouched and self.options.replay_skips_reads
                    if replay and self.app.buffers_writes:
                        self.state.buffer_writes()  # written once at the run's end (flush)
                    # A batch that reports, run on a replayed run's writes still in memory.
                    on_buffer = not replay and self.state.buffering
                    t_batch = time.monotonic()
                    arrival = self.collector.arrival(cert.seq)
                    try:
                        run = self._run_batch_timed
                        outs, refs, cpu = await asyncio.to_thread(run, cert, replay)
                    except StaleCheckpoint as e:
                        self._strand(cert.seq, e)
                        break
                    t_done = time.monotonic()
                    if vouched:
                        self._time_replay(t_batch, t_done, cpu)
                        if "replay_first" not in self.wake_marks:
                            self.wake_marks["replay_first"] = round(t_batch, 4)
                        self._mark("replay_last", again=True)
                    self.counters.update(self._batch_counts)
                    self.collector.executed(cert.seq)
                    self._view = max(self._view, cert.view)
                    for out in outs:
                        self._send_reply(out, cert.view)
                    if not vouched:
                        self._mark("first_fresh")
                        self._start_due_background()
                    if delay := self.faults.report_delay():
                        await asyncio.sleep(delay)
                    # At a checkpoint seq the checkpoint comes first and its digest is in
                    # the report (wire.checkpoint_ref): the agreement replicas compare and
                    # certify it with the replies, so a replica that signs a wrong checkpoint
                    # digest is caught like one that answers wrongly.
                    c = None
                    t_ckpt = time.monotonic()
                    if cert.seq % self.cp == 0:
                        c = await self._take_checkpoint(cert.seq)
                    if replay:
                        self.counters["replayed_certified"] += 1
                    else:
                        if c is not None:
                            refs = [*refs, wire.checkpoint_ref(cert.seq, c)]
                        rep = wire.ExecReport.of(self.svc.id, self.me, cert.seq, refs)
                        if not self.faults.report(cert.seq, rep):
                            self._send_agreement(rep.with_macs(self.agree_keys).encode())
                            self.sent_reports.add(rep)
                            if not self._first_report_logged:
                                self._first_report_logged = True
                                log.info("first report since the process started: batch %d,"
                                         " %.2f s after the start", cert.seq,
                                         time.monotonic() - self._process_started)  # fmt: skip
                    self.counters["batches_executed"] += 1
                    if not vouched and arrival is not None:
                        self._time_report(cert.seq, arrival, t_batch, t_done, cpu, t_ckpt)
                    if c is not None:
                        self.ckpt.announce(cert.seq, c, self.sign_key)
                        self.faults.after_checkpoint(cert.seq)
                    if vouched:
                        self._replay_end = time.monotonic()
                    if on_buffer and not self.options.flush_replay_first:
                        # It ran on the buffered writes (reads answered from them) and its
                        # replies and report are out; the files are written before the next
                        # batch (at a checkpoint seq its checkpoint wrote them already).
                        self.counters["reported_before_flush"] += 1
                        if self.state.buffering:
                            await asyncio.to_thread(self.state.flush)
                if self.state.buffering:  # no batch ready: the run's files are written
                    await asyncio.to_thread(self.state.flush)
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

    def _mark(self, name: str, again: bool = False) -> None:
        """Note step `name` of the current wake-up now (`again`: the latest time, else the
        first)."""
        if again or name not in self.wake_marks:
            self.wake_marks[name] = round(time.monotonic(), 4)

    def _start_mark(self, name: str) -> None:
        """A step of start() for a runtime started awake (a hibernated guest's, at its
        wake-up); a spare provisioned asleep marks its wake-up from the notice on."""
        if not self.asleep:
            self._mark(name)

    def _new_wake(self) -> None:
        """A new wake notice was taken: the marks start over from it."""
        self.wake_marks = {}
        self._mark("noticed")

    def _time_replay(self, started: float, done: float, cpu: float) -> None:
        """Status `replay`: the certified batches run since the last recovery, and the
        seconds from the start of the first to the end of the last (scripts/bench/replay);
        of them `execute_s` in the worker thread running the batches (`cpu_s` its CPU
        time) and `between_s` from one batch's end in the loop to the next one's start
        (the wait for its commit votes, and the loop's own work between batches)."""
        r = self.replay
        r["certified_batches"] = r.get("certified_batches", 0) + 1
        if self._replay_t0 is None:
            self._replay_t0 = started
        elif self._replay_end is not None:
            r["between_s"] = round(r.get("between_s", 0.0) + started - self._replay_end, 4)
        r["seconds"] = round(time.monotonic() - self._replay_t0, 4)
        r["execute_s"] = round(r.get("execute_s", 0.0) + done - started, 4)
        r["cpu_s"] = round(r.get("cpu_s", 0.0) + cpu, 4)

    def _time_report(
        self,
        seq: int,
        arrival: tuple[float, float | None],
        started: float,
        done: float,
        cpu: float,
        ckpt_from: float,
    ) -> None:
        """Status `slow_reports` (the last 16): a batch whose report went out SLOW_REPORT_S
        or more after its first commit vote arrived, and where the time went: `votes`
        (first vote to 2g+1 matching), `queue` (to the executor taking it: earlier
        batches, the loop), `execute` (of it `cpu`: this thread's CPU time), `checkpoint`
        (with its lock wait; a checkpoint seq only), `send` (replies and report). The
        worst of each SLOW_LOG_S is logged (a guest's log is its serial console, which
        costs emulated I/O per byte)."""
        now = time.monotonic()
        first, ready = arrival
        total = now - first
        ready = started if ready is None else ready
        if seq % self.cp < 4:
            # Status `checkpoint_reports`, on this runtime's monotonic clock: the steps of
            # the reports of the latest checkpoint seqs and the three batches after each
            # (zz drill splits a detection there), and whether a drill's fault was on.
            self.checkpoint_reports.append(
                {"seq": seq, "first_vote": round(first, 4), "ready": round(ready, 4),
                 "started": round(started, 4), "done": round(done, 4),
                 "checkpoint_from": round(ckpt_from, 4), "sent": round(now, 4),
                 "fault": 1 if self.faults.fault else 0}
            )  # fmt: skip
        if total < SLOW_REPORT_S:
            return
        checkpoint = now - ckpt_from if seq % self.cp == 0 else 0.0
        parts = {
            "votes": ready - first,
            "queue": started - ready,
            "execute": done - started,
            "cpu": cpu,
            "checkpoint": checkpoint,
            "send": now - done - checkpoint,
        }
        entry = {"seq": seq, "total": round(total, 3), "at": round(time.time(), 3)}
        entry.update({k: round(v, 3) for k, v in parts.items()})
        self.slow_reports.append(entry)
        self.counters["slow_reports"] += 1
        worst = self._slow_worst
        if worst is None or entry["total"] > worst["total"]:
            self._slow_worst = worst = entry
        self._slow_since += 1
        if now - self._slow_logged < SLOW_LOG_S:
            return
        log.warning(
            "%d report(s) %.1f s or more after their first commit vote; the worst: batch "
            "%d, %.2f s (votes %.2f, queue %.2f, execute %.2f of which cpu %.2f, checkpoint "
            "%.2f, send %.2f)",
            self._slow_since, SLOW_REPORT_S, worst["seq"], worst["total"], worst["votes"],
            worst["queue"], worst["execute"], worst["cpu"], worst["checkpoint"], worst["send"],
        )  # fmt: skip
        self._slow_logged, self._slow_since, self._slow_worst = now, 0, None

    def _run_batch_timed(
        self, cert: Certificate, replay: bool
    ) -> tuple[list[Outgoing], list[wire.ReplyRef], float]:
        cpu0 = time.thread_time()
        outs, refs = self._run_batch(cert, replay)
        return outs, refs, time.thread_time() - cpu0

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
        if not replay and self.options.flush_replay_first:
            self.state.flush()  # the baseline: a replayed run's writes, before the batch
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
            if self.faults.lying(cert.seq):
                result += b" (wrong)"  # a deterministic wrong answer to every request
                counts["wrong_replies"] += 1
            self.replies.record(req.sender, req.timestamp, result, req.read_only, read)
            outs.append(Outgoing(req.sender, req.timestamp, req.read_only, result))
            fresh.append(wire.reply_ref(req.sender, req.timestamp, result))
            counts["requests_executed"] += 1
        return outs, fresh

    # ---- checkpoints (execution/checkpointing.py) ------------------------------------

    def _checkpoint(self, seq: int) -> bytes:
        """Manifest + snapshot of the state after `seq` (worker thread, ckpt.lock held);
        returns C."""
        c, finish = self._checkpoint_staged(seq)
        finish()
        return c

    def _checkpoint_staged(self, seq: int) -> tuple[bytes, Callable[[], None]]:
        """_checkpoint in two halves (Checkpoints.stage): C once what reads the live
        directory is done, and the rest of the snapshot, which the next batches need not
        wait for. Times each part (status `checkpoint_ms`: the last one, `_max` the
        slowest)."""
        t0 = time.monotonic()
        self.state.sync()
        dirty = self.state.take_dirty()
        memory = self.app.save_memory()
        replies = self.replies.encode()
        manifest = self.ckpt.build(seq, dirty.written | dirty.deleted, memory, replies)
        if self.fetcher is not None and self.fetcher.done:
            # Every certified file is here now: this snapshot is complete, peers may read it.
            self.ckpt.complete_from = seq
            self.state.lazy = None
            self.fetcher = None
            self.recovery["complete_at_checkpoint"] = seq
            log.info("recovery complete: checkpoint %d holds the whole state", seq)
        t1 = time.monotonic()
        c, rest = self.ckpt.stage(seq, manifest)
        t2 = time.monotonic()
        times = {"seq": seq, "build": round((t1 - t0) * 1e3, 1), "stage": round((t2 - t1) * 1e3, 1)}

        def finish() -> None:
            t3 = time.monotonic()
            rest()
            times["finish"] = round((time.monotonic() - t3) * 1e3, 1)
            self.checkpoint_ms = times
            worst = self.checkpoint_ms_max
            for k in ("build", "stage", "finish"):
                worst[k] = max(worst.get(k, 0.0), times[k])

        return c, finish

    async def _take_checkpoint(self, seq: int) -> bytes:
        """The checkpoint of `seq`: its digest C as soon as what reads the live directory
        is done (`_checkpoint_staged`). The rest of the snapshot runs in a task that keeps
        store until it is listed, while the report goes out and the next batches run: the
        next checkpoint, an install and a collection wait for it (execution/storelock.py,
        completion); a file served to a peer does not, and a request for this checkpoint
        finds it not there yet, as before it was taken."""
        staged: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(self._checkpoint_task(seq, staged), name=f"zz-ckpt-{seq}")
        self._ckpt_task = task
        return await staged

    async def _checkpoint_task(self, seq: int, staged: asyncio.Future[bytes]) -> None:
        lock = self.ckpt.lock
        try:
            async with lock.urgent(f"checkpoint {seq}"):
                try:
                    c, finish = await asyncio.to_thread(self._checkpoint_staged, seq)
                except BaseException as e:
                    if not staged.done():
                        staged.set_exception(e)
                    return
                if not staged.done():  # cancelled: the executor stopped (shutdown)
                    staged.set_result(c)
                # The rest changes only this snapshot's own entries: a file served to a
                # peer meanwhile need not wait (execution/storelock.py, completion).
                lock.begin_completion()
            try:
                await asyncio.to_thread(finish)
            finally:
                lock.end_completion()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            # As when the checkpoint ran in the executor: the replica stops.
            log.exception("checkpoint %d: completing the snapshot failed", seq)
            self.fatal = e
            self._stopped.set()

    def _on_exec_checkpoint(self, m: wire.ExecCheckpoint) -> None:
        kind, idx = wire.principal_kind(m.sender)
        if kind != "exec" or idx >= self.svc.n_exec or m.sender == self.me:
            self.counters["wrong_sender"] += 1
            return
        if not self.publics.verify(m):  # a peer's replaced key is counted per sender
            self.counters["bad_sig"] += 1
            return
        self.ckpt.offer(m.seq, m.sender, m.checkpoint, self.last_executed, self.options.window)

    # ---- liveness and status --------------------------------------------------------

    async def _stall_loop(self) -> None:
        last = -1
        while True:
            await asyncio.sleep(_STALL_SECONDS)
            last = self._stall_tick(last)

    def _stall_tick(self, last: int) -> int:
        """One turn of the stall loop, `last` the seq executed at the previous one;
        returns the seq executed now."""
        self._start_due_background(idle=True)
        # Votes above us but nothing executable for a while: something was lost
        # (e.g. on a reconnect). Registration again makes the replicas resend the log.
        # So does a peer's signed checkpoint above us with no vote here: a replica the
        # agreement replicas count asleep gets no batches pushed, only the log a
        # registration brings, and ran out of it.
        behind = self.collector.pending() or self.ckpt.peer_ahead(self.last_executed)
        if self.last_executed == last and behind:
            self.counters["refetches"] += 1
            self._register_again()
        return self.last_executed

    def _start_links(self) -> None:
        self.asleep = False
        for link in self._links + self._peer_links:
            link.start()

    async def _wake_watch(self) -> None:
        """React at once to controld's wake-up notice (controld/actions.py wake_notice).

        A replica that slept was frozen mid-flight; once it runs again it must learn the
        cluster's stable checkpoint now, not when the stall check next fires."""
        path = self.state_dir / WAKE_NOTICE
        seen = self._notice_at_start
        looked = time.monotonic()
        while True:
            await asyncio.sleep(_WAKE_POLL)
            before, looked = looked, time.monotonic()
            now = _mtime(path)
            poked, self._wake_poked = self._wake_poked, False
            changed = now is not None and now != seen
            if not changed and not poked:
                continue
            seen = now
            try:
                notice = json.loads(path.read_text())
            except (OSError, ValueError):
                notice = {}
            self.counters["wake_notices"] += 1
            if now != self._notice_taken:
                self._notice_taken = now
                self._new_wake()
                self._take_fault_seq(notice.get("recovering_from_seq"))
                # How it was noticed (status `recovery`): by the poll or by the guest
                # agent's poke, and the poll's look before (its sleep's overshoot).
                self.wake_marks["poll_before"] = round(before, 4)
                self.wake_marks["poll_looked"] = round(looked, 4)
                self.recovery["noticed_by"] = "poll" if changed else "poke"
                if poked and self._poked_at is not None:
                    self.wake_marks["poked"] = round(self._poked_at, 4)
            self.wake_marks.setdefault("notice_read", round(time.monotonic(), 4))
            self.recovery["woken_at"] = notice.get("woken_at")
            self.recovery["noticed_at"] = time.time()
            log.info(
                "woken by controld (from seq %s): registering again",
                notice.get("recovering_from_seq"),
            )
            if self.asleep:
                self._start_links()  # registration is the links' on_connect
                self._mark("links_started")
                continue
            self._register_again()

    def _take_fault_seq(self, fault: object) -> None:
        """The round's seq from a wake notice: recover below it and replay it. A recovery
        target chosen before, by an earlier round's seq, at or above it is dropped."""
        if type(fault) is not int or fault <= self.last_executed:
            return
        self._fault_seq, self._fault_seq_at = fault, time.monotonic()
        if self._recover_target is not None and self._recover_target[0] >= fault:
            self._recover_target = None
            self.counters["recover_target_dropped"] += 1

    def _peek_wake_notice(self) -> None:
        """Take a new wake notice's seq now rather than at _wake_watch's next poll. controld
        writes the notice before it resumes a replica, and the links of a resumed replica
        may deliver the log the agreement replicas serve at the wake-up first: judged by an
        earlier round's seq, whose patience had run out, it made a spare woken again
        mid-recovery recover at the new round's checkpoint seq and never report it
        (campaign seed 3202 round 18). _wake_watch still registers again."""
        path = self.state_dir / WAKE_NOTICE
        now = _mtime(path)
        if now is None or now == self._notice_taken:
            return
        try:
            notice = json.loads(path.read_text())
        except (OSError, ValueError):
            return  # half written: the next look, or _wake_watch, takes it
        self._notice_taken = now
        self._new_wake()
        self.counters["wake_notices_peeked"] += 1
        if isinstance(notice, dict):
            self._take_fault_seq(notice.get("recovering_from_seq"))

    def poke_wake(self) -> None:
        """SIGUSR1 (the guest agent's "wake"): look at the wake notice now, whatever its
        mtime says. A spare paused right after boot missed a notice that controld wrote
        over 9p around the resume. A watch that read its baseline only at its first step
        explains that (fixed: _notice_at_start); the poke stays as the guest agent's
        direct signal."""
        self._wake_poked = True
        self._poked_at = time.monotonic()
        self.counters["wake_pokes"] += 1
        if "noticed" in self.wake_marks:
            self.wake_marks.setdefault("poked", round(self._poked_at, 4))

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
            self.ckpt.store.path,
            manifest,
            seq,
            self._peer_sources(),
            on_bad_source=self._bad_source,
            patience=_FETCH_PATIENCE,
            ranking=self._ranking,
            stop=self._stopping,
            warm=self.warm,
        )

    def _live_copies(self) -> Place | None:
        """The live state as a place to find a file by its hash (snapshots/copies.py): the
        files of the last checkpoint's manifest, those still pending in a recovery left
        out. Called by the file server with the store lock held; every copy is hashed
        before it is served, so a file the app rewrote since is skipped, not sent."""
        manifest = self.ckpt.builder.previous if hasattr(self.ckpt, "builder") else None
        if manifest is None:
            return None
        fetcher = self.fetcher
        skip = fetcher.is_pending if fetcher is not None else (lambda path: False)
        return Place("live", manifest, lambda: self.ckpt.store.path, skip)

    def _bad_source(self, source: str, path: str, why: str) -> None:
        self.counters["bad_source_reports"] += 1
        bad = self.recovery.setdefault("bad_sources", [])
        if len(bad) < MISMATCH_LIST:
            bad.append({"source": source, "path": path, "why": why})

    async def _recover(self, seq: int, digest: bytes) -> None:
        """Jump to the certified checkpoint (seq, digest); files come on first touch."""
        t0 = time.monotonic()
        self._mark("recover_start")
        self.counters["recoveries_started"] += 1
        log.info("behind the stable checkpoint %d (%s): recovering", seq, digest.hex()[:16])
        # The log above seq, asked for now: the agreement replicas send it (5 MiB in the
        # Figure 9 bench at 1 GB, ~4 MiB a reply) and the event loop MAC-checks, decodes
        # and hashes it while the install runs in its thread, instead of after it, with
        # the first replayed batch waiting for 2g+1 replicas' copies (98-164 ms at 1 GB).
        self._installing = seq
        self.collector.expect(seq)
        self._register_again()
        try:
            async with self.ckpt.lock.urgent(f"the install of checkpoint {seq}"):
                await asyncio.to_thread(self._install_checkpoint, seq, digest)
        except (RecoveryError, FetchError, OSError) as e:
            self._installing = None
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
        self._installing = None
        self._recover_target = None
        self._stranded_at = None
        self.vouches.forget_through(seq)
        self.replay, self._replay_t0, self._replay_end = {}, None, None
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
        self._mark("recovered", again=True)
        # The log above seq was asked for when the install began (above). Register again
        # from the end of what already holds 2g+1 votes: the agreement replicas send what
        # was committed since (a replica they do not push batches to, one they count
        # asleep, learns of it only so) without resending the whole tail.
        self._register_again(self.collector.ready_through())
        self._bg_due = (fetcher, time.monotonic())
        self._wake.set()  # batches above seq may be in already

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

        like = self.ckpt.builder.previous
        staged = self.warm.manifest(digest)  # hashes to the certified digest, or None
        try:
            manifest = None if staged is None else Manifest.decode(staged, like=like)
        except ManifestError as e:  # hashes right yet does not decode: C itself is bad
            raise RecoveryError(f"certified manifest of {seq} does not decode: {e}") from e
        if manifest is None:
            manifest = fetch_manifest(
                self._peer_sources(),
                seq,
                digest,
                on_bad_source=self._bad_source,
                ranking=self._ranking,
                like=like,
            )
        lap("manifest")
        self.state.sync()
        ck = self.ckpt
        live = ck.store.path
        fetcher = self._fetcher(manifest, seq)
        # What this replica's own last checkpoint says, plus what changed since: enough to
        # tell which files match without re-hashing the whole state (docs/recovery.md).
        own = ck.builder.previous
        suspect = self.state.peek_dirty() | ck.builder.dirty
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
        if self.options.recovery == "full":
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
        ck.builder = ManifestBuilder(live, manifest)
        lap("open")
        ck.record_manifest(seq, manifest)
        lap("record")
        self.collector.executed(seq)
        ck.adopt(seq, digest)
        ck.complete_from = 1 << 64  # until the fetch completes and a checkpoint follows
        self.fetcher = fetcher
        self._half_installed = False
        self.recovery["install_phases_ms"] = phases

    def _start_due_background(self, idle: bool = False) -> None:
        """Start the background fetch of the last recovery once its replica executed a
        batch the certified log did not vouch for (it caught up), or (`idle`, the stall
        loop) _STALL_SECONDS after the install when none came. Started at the install,
        it took the peer connection, the GIL and zfs-fuse from the replay and the files
        the replayed requests touched (Figure 9: ~20 ms per replayed 128 KiB WRITE)."""
        due = self._bg_due
        if due is None or (idle and time.monotonic() - due[1] < _STALL_SECONDS):
            return
        self._bg_due = None
        if due[0] is self.fetcher:  # not superseded by a later recovery
            self._start_background(due[0])

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
            n = fetcher.fetch_all(stop, pause=self.options.background_pause)
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
            async with self.ckpt.lock.background("a file served to a peer", reads=True):
                r = await asyncio.to_thread(
                    self.ckpt.files.read, m.seq, m.path_text(), m.offset, m.length, m.sha256
                )
        out = wire.FileData(self.svc.id, self.me, m.seq, m.path, m.offset, r.status, r.size, r.data)
        if unbound is None:
            out = self.faults.file_data(out)  # a drill's forged bytes; never the challenge
            self.counters["file_chunks_served"] += 1
            self.counters["file_bytes_served"] += len(r.data)
            if r.status == COPY:
                self.counters["file_copies_served"] += 1
            # Copies whose bytes did not hash to what a manifest said: skipped, never sent.
            mismatched = self.ckpt.files.copies.counters["mismatched"]
            if mismatched:
                self.counters["file_copies_mismatched"] = mismatched
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
            **self.faults.status(),  # inject_fault, corrupt_lie_from
            "last_executed": self.last_executed,
            **self.ckpt.status(),  # last and stable checkpoint, checkpoints, mismatches
            "agreement_links_up": sum(1 for link in self._links if link.up),
            "agreement_links_answered": sum(1 for link in self._links if link.up and link.answered),
            "peer_links_up": sorted(
                wire.principal_kind(link.peer)[1] for link in self._peer_links if link.up
            ),
            "clients_connected": len(self._clients),
            "pending_seqs": len(self.collector.pending()),
            "slow_reports": list(self.slow_reports),
            "checkpoint_reports": list(self.checkpoint_reports),
            "checkpoint_ms": dict(self.checkpoint_ms),
            "checkpoint_ms_max": dict(self.checkpoint_ms_max),
            "reports_kept": len(self.sent_reports),
            "counters": dict(sorted(self.counters.items())),
            "certificates": dict(sorted(self.collector.dropped.items())),
            "recovery": dict(self.recovery),
            "replay": dict(self.replay),
            "wake_marks": dict(self.wake_marks),
            "mono_now": round(time.monotonic(), 4),
            "asleep": self.asleep,
            "recovering": self.fetcher is not None,
            "files_pending": len(self.fetcher.pending()) if self.fetcher is not None else 0,
            "fetch": self._fetch_counters(),
            "warm": dict(sorted(self.warm.counters.items())),
            "warm_missed": list(self.warm.missed_paths),
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
        """The status file, its `mono_now` taken last, right before the bytes are written:
        the host places this runtime's marks by the file's mtime, which the write sets
        (on a guest's share too), and the encoding before it took 10-100 ms in the guests."""
        st = self.status()
        st.pop("mono_now", None)
        body = json.dumps(st, indent=1)
        write_atomic(self.status_path, _with_mono_now(body).encode() + b"\n")

    async def _status_loop(self) -> None:
        while True:
            self._status_changed.clear()
            try:
                self._write_status()
            except OSError as e:
                log.warning("cannot write %s: %s", self.status_path, e)
            await asyncio.sleep(_STATUS_MIN_GAP)  # a flapping link is not a write per connect
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0 - _STATUS_MIN_GAP):
                    await self._status_changed.wait()


async def serve(
    config: Config, service: Service, index: int, options: RuntimeOptions | None = None
) -> None:
    """Run one execution replica until SIGTERM/SIGINT."""
    rt = Runtime(config, service, index, options)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, rt.stop)
    loop.add_signal_handler(signal.SIGUSR1, rt.poke_wake)
    try:
        await rt.serve()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            loop.remove_signal_handler(sig)
