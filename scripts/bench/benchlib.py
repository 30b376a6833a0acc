# scripts/bench/benchlib.py - what the rack benchmarks share: a process rack of one service with
# its execution replicas' state on a zfs-fuse pool of its own, a stand-in controld, instruments.
"""Shared helpers of scripts/bench/recovery, scripts/bench/detection.py and scripts/bench/files
(--figure9). Not a benchmark itself.

* `BenchRack`: one service (f = g = 1) of a given app on real zz-agreed (release build) and
  real runtime processes, the execution replicas' state on datasets of a file-backed zfs-fuse
  pool created for it (or on the directory store), the spare started by the bench itself
  (asleep, then SIGSTOPped: a paused replica); `down()` stops every process and destroys the
  pool, also after a failure.
* `Controld`: stands in for the host's controld on the control port: verifies every WAKEUP
  with zz/certs.py, collects SHUTDOWN votes into certificates, and optionally wakes the
  spare a WAKEUP names as controld does (wake notice, then SIGCONT).
* `TimedClient` (when each execution replica's REPLY arrived) and `LogWatch` (when a fault
  line appeared in an agreement replica's log), on one monotonic clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from zz import certs, wire  # noqa: E402
from zz import config as zconfig  # noqa: E402
from zz import keys as zkeys  # noqa: E402
from zz.atomicfile import write_atomic  # noqa: E402
from zz.client import Client, ClientParams  # noqa: E402
from zz.execution.runtime import WAKE_NOTICE  # noqa: E402
from zz.ports import free_base  # noqa: E402
from zz.procrack import ProcRack, reap, repo_env, signal_group, spawn  # noqa: E402
from zz.snapshots.zfs import create_file_pool, destroy_pool  # noqa: E402

SPARE = 2  # f = 1: execution replicas 0 and 1 active (or all three), 2 the spare


def load_images_module(name: str) -> ModuleType:
    """images/<name>.py by path (images/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"zz_images_{name}", REPO / "images" / f"{name}.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def load() -> float:
    return os.getloadavg()[0]


class BenchRack:
    """One service `name` of app `app` on one simulated host (127.0.0.1, its controld port
    at base + 70). `active` = 3 makes the cluster push to the spare whenever it is
    connected (no detection needed: scripts/bench/recovery); 2 leaves it asleep until a
    WAKEUP. `pad_op(n)` is a small write request of the app (pad_to_checkpoint)."""

    def __init__(
        self,
        d: Path,
        *,
        name: str,
        app: str,
        pool_tag: str,
        pool_bytes: int,
        cp: int,
        pad_op: Callable[[int], bytes],
        active: int = 2,
        store: str = "zfs",
        overrides: dict[str, Any] | None = None,
        app_options: str = "",
        agreed: Path | None = None,
    ) -> None:
        self.d = d
        self.name = name
        self.app = app
        self.cp = cp
        self.pad_op = pad_op
        self.active = active
        self.store = store
        self.overrides = overrides or {}
        self.app_options = app_options
        self.agreed = agreed  # None: the release build (procrack.DEFAULT_AGREED)
        self.pool = f"{pool_tag}{os.getpid()}x{uuid.uuid4().hex[:6]}"
        self.pool_bytes = pool_bytes
        self.vdev = d / "vdev.img"
        self.pool_made = False
        self.rack: ProcRack | None = None
        self.extra: dict[int, Any] = {}  # replicas started by the bench itself
        self.cfg: zconfig.Config

    # -- set-up ---------------------------------------------------------------------------
    def write_config(self) -> zconfig.Config:
        base = free_base(range(71))
        path = self.d / "rack.toml"
        active = f"active = {self.active}\n" if self.active != 2 else ""
        opts = f"app_options = {self.app_options}\n" if self.app_options else ""
        path.write_text(
            f'[rack]\nname = "{self.name}"\nkey_dir = "keys"\nrun_dir = "run"\n'
            f"checkpoint_interval = {self.cp}\nlog_window = {2 * self.cp}\nbatch_max = 16\n"
            "view_timeout_ms = 10000\n"
            '\n[[hosts]]\nname = "h0"\naddress = "127.0.0.1"\nlibvirt_uri = "test:///default"\n'
            f"control_port = {base + 70}\n"
            f'\n[[services]]\nname = "{self.name}"\nid = 1\ng = 1\nf = 1\n{active}'
            f'app = "{self.app}"\n{opts}clients = 32\nbase_port = {base}\n'
        )
        self.cfg = zconfig.load(path)
        zkeys.generate(self.cfg)
        return self.cfg

    def up(self) -> None:
        """Config and keys (unless write_config ran), the pool, the agreement replicas and
        the active execution replicas, linked."""
        if not hasattr(self, "cfg"):
            self.write_config()
        if self.store == "zfs":
            create_file_pool(self.pool, self.vdev, self.pool_bytes)
            self.pool_made = True
        self.rack = ProcRack(
            self.cfg,
            agreed=self.agreed,
            overrides=self.overrides,
            exec_args={i: self.store_args() for i in range(3)},
        )
        self.rack.start(timeout=60)

    def store_args(self) -> list[str]:
        if self.store == "zfs":
            return ["--store", "zfs", "--zfs-pool", self.pool]
        return ["--store", "dir"]

    @property
    def svc(self) -> zconfig.Service:
        return self.cfg.services[0]

    def live(self, i: int) -> Path:
        """Replica i's live state directory (the dataset's mountpoint on ZFS)."""
        state = self.svc.exec_state_dir(self.cfg, i)
        return state / "live" if self.store == "zfs" else state / "store" / "live"

    def start_exec(self, i: int, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "zz.execution", "--rack", str(self.cfg.path)]
        cmd += ["--service", self.name, "--index", str(i), *self.store_args(), *args]
        log = self.cfg.rack.run_dir / "s1" / f"exec-{i}.bench.log"
        self.extra[i] = spawn(cmd, log, repo_env())

    def start_spare_asleep(self, args: list[str]) -> Any:
        """The spare as a paused replica: started with --start-asleep, then SIGSTOPped."""
        self.start_exec(SPARE, ["--start-asleep", *args])
        self.wait(lambda: self.status(SPARE).get("asleep") is True, "spare asleep")
        spare = self.extra[SPARE]
        signal_group(spare.pid, signal.SIGSTOP)
        return spare

    def kill_exec(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.extra.pop(i, None)
        if p is None and self.rack is not None:
            for proc in self.rack.procs:
                if proc.kind == "exec" and proc.index == i and proc.alive():
                    p = proc.popen
        if p is not None and p.poll() is None:
            signal_group(p.pid, signal.SIGCONT)
            signal_group(p.pid, sig)
            reap(p, 10, kill_group=True)

    def down(self) -> None:
        for i in list(self.extra):
            self.kill_exec(i, signal.SIGTERM)
        if self.rack is not None:
            self.rack.stop()
        if not self.pool_made:
            return
        # zfs-fuse keeps a file system busy for a moment after its last user exits.
        for attempt in range(20):
            try:
                destroy_pool(self.pool, self.vdev)
                return
            except Exception as e:  # noqa: BLE001 - report, keep tearing down
                if attempt == 19:
                    print(f"[bench] could not destroy pool {self.pool}: {e}", file=sys.stderr)
                time.sleep(0.5)

    def status(self, i: int) -> dict[str, Any]:
        p = self.cfg.rack.run_dir / "s1" / f"exec-{i}.status.json"
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            return {}

    def wait(self, pred: Any, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.05)

    # -- load -----------------------------------------------------------------------------
    async def settled(self, i: int) -> dict[str, Any]:
        """Replica i's status once two successive status writes (1 s apart) agree."""
        path = self.cfg.rack.run_dir / "s1" / f"exec-{i}.status.json"
        prev: dict[str, Any] = {}
        prev_mtime = 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            mtime = path.stat().st_mtime_ns if path.exists() else 0
            if mtime != prev_mtime:
                st = self.status(i)
                keys = ("last_executed", "stable_checkpoint")
                if prev and all(st.get(k) == prev.get(k) for k in keys):
                    return st
                prev, prev_mtime = st, mtime
            await asyncio.sleep(0.05)
        raise TimeoutError(f"replica {i} does not settle: {self.status(i)}")

    async def pad_to_checkpoint(self, above: int = 0, client_index: int = 20) -> int:
        """Small sequential writes until replica 0 sits exactly on a stable checkpoint:
        the "fault right after a checkpoint" of the best case. With no other traffic
        each sequential request is one batch, so the distance can be computed."""
        client = Client(self.cfg, client_index, service=self.name)
        try:
            for _ in range(20):
                st = await self.settled(0)
                n, stable = st["last_executed"], st["stable_checkpoint"]
                if n > above and n % self.cp == 0:
                    if stable == n:
                        return n
                    continue  # the f+1 checkpoint votes are still on their way
                for _ in range((-n) % self.cp or self.cp):
                    await client.invoke(self.pad_op(n), timeout=60)
            raise RuntimeError(f"replica 0 does not reach a stable checkpoint: {self.status(0)}")
        finally:
            await client.close()


class Controld:
    """Stands in for the host's controld: receives what zz-agreed sends it, verifies every
    WAKEUP with zz/certs.py and collects SHUTDOWN votes into certificates. With `wake`
    (replica index -> its process), it wakes a spare the first verified WAKEUP names as
    controld does (actions.wake_notice, then resume): the wake notice with the round's seq,
    then SIGCONT. Without, it wakes nobody (a running spare that zz-agreed itself starts
    feeding once it adopts a WAKEUP: scripts/bench/detection.py)."""

    def __init__(self, cfg: zconfig.Config, wake: dict[int, Any] | None = None) -> None:
        svc = cfg.services[0]
        self.cfg = cfg
        self.port = cfg.hosts[0].control_port
        self.trust = certs.ServiceTrust.load(cfg.rack.key_dir, svc)
        self.collector = certs.ShutdownCollector(self.trust)
        self.wakeups: list[tuple[float, int, tuple[int, ...], int]] = []  # t, seq, wake, sender
        self.shutdowns: list[tuple[float, int, tuple[int, ...]]] = []  # t, seq, convict
        self.woken: dict[int, float] = {}  # index -> time of its SIGCONT
        self.wake = wake
        self.rejected: list[str] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                self._on(await wire.read_frame(reader))
        except (asyncio.IncompleteReadError, wire.FrameError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # the run is over: end quietly, the replicas reconnect to nobody
        finally:
            writer.close()

    def _on(self, raw: bytes) -> None:
        now = time.monotonic()
        try:
            msg = wire.decode(raw)
            if isinstance(msg, wire.Wakeup):
                t = self.trust
                w = certs.verify_wakeup(raw, keys=t.keys, f=t.f, g=t.g, n_exec=t.n_exec)
                self.wakeups.append((now, w.seq, w.wake, w.sender))
                self._wake(w)
            elif isinstance(msg, wire.Shutdown):
                c = self.collector.add(raw)
                if c is not None:
                    self.shutdowns.append((now, c.seq, c.convict))
            else:
                self.rejected.append(f"unexpected {msg.NAME}")
        except wire.WireError as e:
            self.rejected.append(f"malformed: {e}")
        except certs.CertError as e:
            self.rejected.append(e.reason)

    def _wake(self, w: certs.Wakeup) -> None:
        for i in w.wake:
            proc = (self.wake or {}).get(i)
            if proc is None or i in self.woken:
                continue
            svc = self.cfg.services[0]
            notice = svc.exec_state_dir(self.cfg, i) / WAKE_NOTICE
            body = {
                "service": svc.id,
                "index": i,
                "recovering_from_seq": w.seq,
                "awake": list(w.awake),
                "woken_at": time.time(),
            }
            write_atomic(notice, json.dumps(body) + "\n")
            signal_group(proc.pid, signal.SIGCONT)
            self.woken[i] = time.monotonic()

    def summary(self, t0: float) -> dict[str, Any]:
        first = min((t for t, *_ in self.wakeups), default=None)
        return {
            "wakeups_verified": len(self.wakeups),
            "wakeup_seqs": sorted({seq for _, seq, _, _ in self.wakeups}),
            "first_wakeup_after_s": None if first is None else first - t0,
            "shutdown_certificates": [{"seq": q, "convict": list(c)} for _, q, c in self.shutdowns],
            "rejected": self.rejected,
        }


# ---- instruments -----------------------------------------------------------------------


def client_params(cfg: zconfig.Config, c: int) -> ClientParams:
    return ClientParams.from_config(cfg, cfg.services[0].id, c)


class TimedClient(Client):
    """A zz.client.Client that notes when each execution replica's REPLY arrived, for the
    request in flight (REPLY header: type byte 3, sender at 8, timestamp at 16+4)."""

    def __init__(self, params: ClientParams) -> None:
        super().__init__(params)
        self.cur_ts = 0
        self.arrivals: dict[int, float] = {}  # exec index -> arrival time

    def _next_timestamp(self) -> int:
        ts = super()._next_timestamp()
        self.cur_ts, self.arrivals = ts, {}
        return ts

    def _on_message(self, raw: bytes) -> None:
        now = time.monotonic()
        if len(raw) >= 28 and raw[3] == 2:
            sender = int.from_bytes(raw[8:12], "big")
            ts = int.from_bytes(raw[20:28], "big")
            if ts == self.cur_ts and sender >= 256 and sender - 256 not in self.arrivals:
                self.arrivals[sender - 256] = now
        super()._on_message(raw)


_EVENT = re.compile(rb"replica (\d+): execution (timeout|mismatch) at seq (\d+):(.*)$")
_WAKE_SENT = re.compile(
    rb"replica (\d+): WAKEUP seq (\d+) wake \[[^]]*\], evidence.*?(\d+) ms after the fault"
)
_WAKE_ADOPTED = re.compile(rb"replica (\d+): WAKEUP seq (\d+) wake \[[^]]*\] adopted")
_SHUTDOWN = re.compile(rb"replica (\d+): SHUTDOWN seq (\d+)(.*)$")


def _classify(line: bytes) -> tuple[int, str, int, str] | None:
    if m := _EVENT.search(line):
        return int(m[1]), m[2].decode(), int(m[3]), m[4].decode().strip()
    if m := _SHUTDOWN.search(line):
        return int(m[1]), "shutdown", int(m[2]), m[3].decode()
    if m := _WAKE_SENT.search(line):  # row: zz-agreed's own flag -> WAKEUP time in ms
        return int(m[1]), "wakeup", int(m[2]), m[3].decode()
    if m := _WAKE_ADOPTED.search(line):
        return int(m[1]), "wakeup-adopted", int(m[2]), ""
    return None


class LogWatch:
    """Notes when a fault line appears in an agreement replica's log. zz-agreed writes
    them unbuffered to stderr = the log file; a thread reads what was appended every
    `interval` s (1 ms for latencies; 20 ms where only the rows count, to take less CPU
    from the replicas measured)."""

    def __init__(self, logs: list[Path], interval: float = 0.001) -> None:
        self.logs = logs
        self.interval = interval
        self.events: list[tuple[float, int, str, int, str]] = []  # time, replica, kind, seq, row
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._files: list[BinaryIO] = []
        self._close = contextlib.ExitStack()

    def __enter__(self) -> LogWatch:
        # Open once, at the current end, before returning (a read at EOF returns what was
        # appended): opened in the thread, a line written before the thread first ran
        # (a busy machine) would be skipped, as a fault's mismatch once was.
        with contextlib.ExitStack() as stack:
            for p in self.logs:
                fh = stack.enter_context(open(p, "rb"))
                fh.seek(0, os.SEEK_END)
                self._files.append(fh)
            self._close = stack.pop_all()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._close.close()

    def _run(self) -> None:
        files = self._files
        partial = [b""] * len(files)
        while not self._stop.is_set():
            for i, fh in enumerate(files):
                data = fh.read()
                if not data:
                    continue
                now = time.monotonic()
                *lines, partial[i] = (partial[i] + data).split(b"\n")
                for line in lines:
                    if (ev := _classify(line)) is not None:
                        with self._lock:
                            self.events.append((now, *ev))
            time.sleep(self.interval)

    def rows_since(self, t: float, kind: str) -> dict[int, str]:
        """The logged detail of the first `kind` line per agreement replica after t."""
        out: dict[int, str] = {}
        with self._lock:
            for when, r, k, _, row in self.events:
                if k == kind and when >= t and r not in out:
                    out[r] = row
        return out

    def since(self, t: float, kind: str) -> dict[int, tuple[float, int]]:
        """First event of `kind` per agreement replica after time t: replica -> (time, seq)."""
        out: dict[int, tuple[float, int]] = {}
        with self._lock:
            for when, r, k, seq, _ in self.events:
                if k == kind and when >= t and r not in out:
                    out[r] = (when, seq)
        return out
