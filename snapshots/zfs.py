# snapshots/zfs.py - CheckpointStore on OpenZFS through the zpool/zfs command line.
# Works with zfs-fuse (docs/design.md §9): no .zfs/snapshot dir there, so snapshots are read
# through clones.
"""ZFS backend: one pool per host (a file vdev is fine), one dataset per execution replica.

Calls are synchronous subprocesses (each ~5-50 ms on zfs-fuse); an asyncio daemon runs them
with ``asyncio.to_thread``. Every failure raises :class:`StorageError` carrying the argv and
the tool's stderr.

zfs-fuse quirks handled here, measured on the development machines:

* a freshly mounted dataset or clone is "busy" for ~70 ms, so destroys retry on "busy";
* there is no ``.zfs/snapshot`` directory: :meth:`ZfsStore.open_snapshot` makes a read-only
  ``zfs clone`` mounted in a fresh temporary directory and destroys it on exit;
* the daemon must be started by hand (no systemd): :func:`ensure_zfs_daemon`;
* two mounts at once wedge it for good: :func:`run_zfs` runs every command that may change
  something (so may mount) one at a time on the machine, under :data:`CHANGE_LOCK`.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from zz.snapshots.store import CheckpointStore, StorageError, check_snapshot_name

# ZFS component names: a letter first for pools; datasets allow digits first too.
_POOL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.:-]{0,63}")
_DATASET_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
_BUSY_RETRY_S = 10.0
_CMD_TIMEOUT_S = 120.0
SETUP_HINT = "run `sudo bash scripts/setup.sh` (it installs and starts zfs-fuse)"
DAEMON_PIDFILE = Path("/run/zz-zfs-fuse.pid")
# zfs-fuse hands each new mount to its FUSE listener threads through one pipe: the thread
# serving the command writes a record (with the mountpoint's length), then the mountpoint,
# in two write()s. Two mounts at once (`zfs create`, `clone`, `mount`, `set mountpoint`,
# `rename`, `receive`, `zpool import` ... from two processes or threads)
# interleave there; the listener reading the pipe takes mountpoint bytes for a length, waits
# in read() for good while holding the mutex the 39 other listeners wait on, and no FUSE
# request of any dataset is served again: whoever touches a dataset sleeps in the kernel's
# fuse_get_req (new mounts) or request_wait_answer, `zpool list` still answers. Every
# command except the reads below takes this lock (flock, so processes and threads alike
# wait for it); there is one zfs-fuse per machine, so one lock per machine.
CHANGE_LOCK = Path("/run/lock/zz-zfs.lock")
_READS = {
    ("zfs", "list"), ("zfs", "get"), ("zfs", "send"),
    ("zpool", "list"), ("zpool", "get"), ("zpool", "status"),
}  # fmt: skip


class ZfsMissingError(StorageError):
    """The zfs/zpool commands are not installed."""


def run_zfs(argv: Sequence[str], *, retry_busy: bool = False) -> str:
    """Run a zfs/zpool command, return its stdout; StorageError on failure.

    With ``retry_busy`` a "dataset is busy" / "pool is busy" failure is retried for up to
    10 s: zfs-fuse reports busy for a short while after a mount.
    """
    deadline = time.monotonic() + _BUSY_RETRY_S
    pause = 0.02
    while True:
        try:
            asked = time.monotonic()
            with _change_lock(argv):
                started = time.monotonic()
                proc = subprocess.run(
                    list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S,
                    check=False,
                )  # fmt: skip
            _trace(argv, asked, started, proc.returncode)
        except FileNotFoundError as e:
            raise ZfsMissingError(f"{argv[0]} not found: {SETUP_HINT}", argv) from e
        except subprocess.TimeoutExpired as e:
            raise StorageError(f"timed out after {_CMD_TIMEOUT_S:.0f} s", argv) from e
        if proc.returncode == 0:
            return proc.stdout
        busy = "busy" in proc.stderr
        if not (retry_busy and busy and time.monotonic() < deadline):
            raise StorageError(f"exit status {proc.returncode}", argv, proc.stderr)
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


# ZZ_ZFS_TRACE=FILE (measurements only): one JSON line per zfs/zpool command run, with
# when it was asked for (wall clock), how long it waited for CHANGE_LOCK and how long it ran.
_TRACE = os.environ.get("ZZ_ZFS_TRACE")


def _trace(argv: Sequence[str], asked: float, started: float, rc: int) -> None:
    if not _TRACE:
        return
    now = time.monotonic()
    line = json.dumps({
        "at": round(time.time() - (now - asked), 3), "pid": os.getpid(),
        "wait_s": round(started - asked, 4), "run_s": round(now - started, 4),
        "rc": rc, "argv": list(argv),
    })  # fmt: skip
    try:
        with open(_TRACE, "a") as f:
            f.write(line + "\n")
    except OSError:
        pass


@contextmanager
def _change_lock(argv: Sequence[str]) -> Iterator[None]:
    """Hold :data:`CHANGE_LOCK` while `argv` runs, unless it only reads (see there)."""
    if (Path(argv[0]).name, *argv[1:2]) in _READS:
        yield
        return
    try:
        # O_NOFOLLOW: /run/lock is writable by everyone.
        fd = os.open(CHANGE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise StorageError(f"cannot open the ZFS change lock {CHANGE_LOCK}: {e}", argv) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _zfs_daemon_pids() -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            comm = Path(entry.path, "comm").read_text().strip()
        except OSError:
            continue
        if comm == "zfs-fuse":
            pids.append(int(entry.name))
    return pids


def _zpool_answers() -> bool:
    try:
        run_zfs(["zpool", "list", "-H"])
    except ZfsMissingError:
        raise
    except StorageError:
        return False
    return True


def ensure_zfs_daemon(timeout: float = 10.0) -> int | None:
    """Make sure ``zpool``/``zfs`` work, starting zfs-fuse if needed.

    Returns the pid of the daemon if this call started it (so the caller may stop it with
    :func:`stop_zfs_daemon`), or None if it was running already or is not needed (a kernel
    ZFS). Raises ZfsMissingError if the commands are not installed, StorageError if the
    daemon does not answer within ``timeout`` seconds.
    """
    if shutil.which("zfs") is None or shutil.which("zpool") is None:
        raise ZfsMissingError(f"the zfs/zpool commands are not installed: {SETUP_HINT}")
    if _zpool_answers():
        return None
    if shutil.which("zfs-fuse") is None:
        raise ZfsMissingError(f"zpool does not answer and zfs-fuse is missing: {SETUP_HINT}")
    started: int | None = None
    tried = False
    deadline = time.monotonic() + timeout
    while True:
        # A daemon still starting or still exiting may hold the name for a moment: start
        # ours only once none is left (zfs-fuse refuses to run twice anyway).
        if not tried and not _zfs_daemon_pids():
            tried = True
            started = _start_zfs_fuse()
        if _zpool_answers():
            return started
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    raise StorageError(f"zfs-fuse did not answer `zpool list` within {timeout:.0f} s: {SETUP_HINT}")


def _start_zfs_fuse() -> int | None:
    DAEMON_PIDFILE.unlink(missing_ok=True)
    argv = ["zfs-fuse", "--pidfile", str(DAEMON_PIDFILE)]
    # zfs-fuse forks and the parent exits once the daemon is up; a failure to start
    # (e.g. another instance won the race) shows as zpool not answering.
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        return None
    try:
        return int(DAEMON_PIDFILE.read_text().strip())
    except (OSError, ValueError):
        return None


def stop_zfs_daemon(pid: int, timeout: float = 10.0) -> None:
    """Stop the zfs-fuse started by :func:`ensure_zfs_daemon` (by its pid, SIGTERM)."""
    try:
        os.kill(pid, 15)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            break
        time.sleep(0.05)
    else:
        raise StorageError(f"zfs-fuse (pid {pid}) did not exit within {timeout:.0f} s")
    DAEMON_PIDFILE.unlink(missing_ok=True)


def check_pool_name(name: str) -> str:
    if not _POOL_NAME.fullmatch(name):
        raise ValueError(f"bad pool name {name!r}")
    return name


def check_dataset_name(name: str) -> str:
    """A dataset path below the pool, e.g. ``web/exec-0``."""
    parts = name.split("/")
    if not all(_DATASET_PART.fullmatch(p) for p in parts):
        raise ValueError(f"bad dataset name {name!r}")
    return name


def pool_exists(name: str) -> bool:
    try:
        run_zfs(["zpool", "list", "-H", "-o", "name", check_pool_name(name)])
    except ZfsMissingError:
        raise
    except StorageError:
        return False
    return True


def pool_vdevs(name: str) -> list[str]:
    """The file/device paths of pool ``name``'s vdevs, from ``zpool status`` (zfs-fuse's
    ``zpool list`` has no -v)."""
    out = run_zfs(["zpool", "status", check_pool_name(name)])
    vdevs = []
    in_config = False
    for line in out.splitlines():
        if line.strip().startswith("NAME") and "STATE" in line:
            in_config = True
            continue
        if in_config:
            if not line.strip() or line.startswith("errors:"):
                break
            first = line.split()[0]
            if first.startswith("/"):
                vdevs.append(first)
    return vdevs


def create_file_pool(name: str, file: Path | str, size: int) -> None:
    """Create pool ``name`` on a sparse file vdev of ``size`` bytes (zfs-fuse wants >= 64 MiB).

    The pool itself is not mounted (mountpoint=none); each dataset gets its own mountpoint.
    The file must not exist yet; it is removed again if the pool cannot be created.
    """
    check_pool_name(name)
    file = Path(file).absolute()
    try:
        with open(file, "xb") as f:
            f.truncate(size)
    except OSError as e:
        raise StorageError(f"cannot create vdev file {file}: {e}") from e
    try:
        run_zfs(["zpool", "create", "-m", "none", name, str(file)])
    except BaseException:
        file.unlink(missing_ok=True)
        raise


def destroy_pool(name: str, file: Path | str | None = None) -> None:
    """Destroy pool ``name`` (all its datasets go with it) and remove its vdev ``file``."""
    run_zfs(["zpool", "destroy", "-f", check_pool_name(name)], retry_busy=True)
    if file is not None:
        Path(file).unlink(missing_ok=True)


def dataset_exists(full_name: str) -> bool:
    try:
        run_zfs(["zfs", "list", "-H", "-o", "name", full_name])
    except ZfsMissingError:
        raise
    except StorageError:
        return False
    return True


class ZfsStore(CheckpointStore):
    """Dataset ``pool/dataset``; created (with ``mountpoint``) if it does not exist yet.

    `reader` names this user's read clones (``<dataset>--<reader>-...``): the owning
    runtime's are "read"; controld, which serves another process's snapshots, opens the
    store with ``create=False, reader="ctl"`` and never touches the owner's clones.
    `unmounted=True` (a reader only) takes a dataset without a mountpoint (a convicted
    replica's, kept for forensics): its snapshots are read through clones as usual, and
    it has no live directory (``path`` raises)."""

    def __init__(
        self,
        pool: str,
        dataset: str,
        mountpoint: Path | str | None = None,
        *,
        create: bool = True,
        reader: str = "read",
        unmounted: bool = False,
    ) -> None:
        self.pool = check_pool_name(pool)
        self.dataset = check_dataset_name(dataset)
        self.name = f"{pool}/{dataset}"
        if not reader.isalnum():
            raise StorageError(f"reader tag {reader!r}: letters and digits only")
        self.reader = reader
        if not dataset_exists(self.name):
            if not create:
                raise StorageError(f"no dataset {self.name}")
            argv = ["zfs", "create", "-p"]
            if mountpoint is not None:
                argv += ["-o", f"mountpoint={Path(mountpoint).absolute()}"]
            run_zfs([*argv, self.name])
        mp = run_zfs(["zfs", "get", "-H", "-o", "value", "mountpoint", self.name]).strip()
        if unmounted and not create:
            self._path: Path | None = None
            self._drop_stale_read_clones()
            return
        if not mp.startswith("/"):
            raise StorageError(f"dataset {self.name} has no mountpoint ({mp!r}); pass one")
        if mountpoint is not None and Path(mp) != Path(mountpoint).absolute():
            raise StorageError(f"dataset {self.name} exists with mountpoint {mp}, not {mountpoint}")
        self._path = Path(mp)
        self._drop_stale_read_clones()

    def _drop_stale_read_clones(self) -> None:
        # Read clones (open_snapshot) of a process that was killed outlive it, and a
        # snapshot with a clone can be neither destroyed nor rolled back past: they go.
        prefix = f"{self.name}--{self.reader}-"
        out = run_zfs(["zfs", "list", "-H", "-o", "name", "-t", "filesystem"])
        for line in out.splitlines():
            if line.startswith(prefix):
                run_zfs(["zfs", "destroy", line], retry_busy=True)

    @property
    def path(self) -> Path:
        if self._path is None:
            raise StorageError(f"dataset {self.name} is not mounted (opened unmounted)")
        return self._path

    def _snap(self, name: str) -> str:
        return f"{self.name}@{check_snapshot_name(name)}"

    def snapshot(self, name: str) -> None:
        run_zfs(["zfs", "snapshot", self._snap(name)])

    def list_snapshots(self) -> list[str]:
        # createtxg, not creation: creation has one-second resolution and checkpoints
        # can come faster than that.
        out = run_zfs(
            ["zfs", "list", "-H", "-t", "snapshot", "-o", "name", "-s", "createtxg",
             "-d", "1", self.name]
        )  # fmt: skip
        prefix = f"{self.name}@"
        return [line[len(prefix) :] for line in out.splitlines() if line.startswith(prefix)]

    def destroy_snapshot(self, name: str) -> None:
        snap = self._snap(name)
        try:
            run_zfs(["zfs", "destroy", snap], retry_busy=True)
            return
        except StorageError:
            clones = self._clones_of(snap)
            if not clones:
                raise
        # Read clones others hold of it (controld serving it to a recovering peer) go with
        # it; their next read finds it gone and falls back to a later checkpoint.
        for clone in clones:
            run_zfs(["zfs", "destroy", clone], retry_busy=True)
        run_zfs(["zfs", "destroy", snap], retry_busy=True)

    def _clones_of(self, snap: str) -> list[str]:
        argv = ["zfs", "list", "-H", "-o", "name,origin", "-t", "filesystem", "-r", self.pool]
        out = run_zfs(argv)
        return [n for n, _, o in (line.partition("\t") for line in out.splitlines()) if o == snap]

    def open_snapshot(self, name: str) -> AbstractContextManager[Path]:
        return self._open(name)

    def restore_live(self, name: str) -> None:
        # -r: snapshots taken after `name` (a checkpoint that never became the last one
        # recorded, e.g. cut off by a crash) go; ZFS cannot roll back past them otherwise.
        run_zfs(["zfs", "rollback", "-r", self._snap(name)], retry_busy=True)

    @contextmanager
    def _open(self, name: str) -> Iterator[Path]:
        snap = self._snap(name)
        # A unique clone name so concurrent readers of one snapshot do not collide.
        clone = f"{self.name}--{self.reader}-{name}-{uuid.uuid4().hex[:8]}"
        mnt = Path(tempfile.mkdtemp(prefix=f"zz-snap-{name}-"))
        try:
            run_zfs(["zfs", "clone", "-o", "readonly=on", "-o", f"mountpoint={mnt}", snap, clone])
            try:
                yield mnt
            finally:
                try:
                    run_zfs(["zfs", "destroy", clone], retry_busy=True)
                except StorageError:
                    # Unless the snapshot's owner destroyed it, clone included.
                    if dataset_exists(clone):
                        raise
        finally:
            try:
                mnt.rmdir()
            except FileNotFoundError:
                pass

    def destroy(self) -> None:
        # -r takes the snapshots along; a clone still open would make this fail, loudly.
        run_zfs(["zfs", "destroy", "-r", self.name], retry_busy=True)
