"""execution/__main__.py - `python -m zz.execution --rack RACK.toml --service NAME --index I`.
Runs one execution replica as an OS process (the process backend, docs/design.md §8)."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import errno
import faulthandler
import fcntl
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from zz.appspec import AppRegistryError
from zz.config import Config, ConfigError, Service, load
from zz.crypto import verify_signature
from zz.drillfaults import FAULTS
from zz.execution.runtime import AppFault, RuntimeOptions, StartKeys, load_start_keys, serve
from zz.keys import KeyFileError
from zz.snapshots import StorageError

LOCK_NAME = "runtime.lock"  # controld/orphans.py reads it: who owns this state directory
EXIT_LOCKED = 4


class StateDirInUse(Exception):
    """Another runtime holds the state directory's lock."""


def lock_state_dir(state: Path) -> int:
    """Take <state>/runtime.lock (fcntl.flock, exclusive, non-blocking) for the life of
    this process and write our pid and a fresh instance id into it. Two runtimes never own
    one state directory: the second raises StateDirInUse naming the holder. A filesystem
    without flock (ENOLCK, EOPNOTSUPP: some 9p mounts) is logged and not enforced."""
    state.mkdir(parents=True, exist_ok=True)
    path = state / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise StateDirInUse(
            f"state directory {state} is in use by another runtime ({path}: {holder});"
            " refusing to start"
        ) from None
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            os.close(fd)
            raise
        logging.getLogger("zz.execution").warning("%s: no flock here (%s): not enforced", path, e)
    me = {"pid": os.getpid(), "instance": uuid.uuid4().hex, "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    return fd  # stays open (and locked) until the process exits


def _options(
    args: argparse.Namespace,
    state_dir: Path | None,
    marks: dict[str, float] | None = None,
    start_keys: StartKeys | None = None,
) -> RuntimeOptions:
    """The runtime's options from the command line (ValueError names what is wrong)."""
    pause = {} if args.background_pause is None else {"background_pause": args.background_pause}
    return RuntimeOptions(
        store=args.store,
        zfs_pool=args.zfs_pool,
        zfs_dataset=args.zfs_dataset,
        recovery=args.recovery,
        replay_skips_reads=not args.replay_all,
        flush_replay_first=args.flush_replay_first,
        asleep=args.start_asleep,
        state_dir=state_dir,
        status_path=Path(args.status_file) if args.status_file else None,
        listen=args.listen,
        inject_fault=args.inject_fault,
        drill_faults=args.drill_faults,
        marks=tuple((marks or {}).items()),
        start_keys=start_keys,
        **pause,
    )


Stamp = tuple[int, int, int] | None


def _stamps(paths: list[Path]) -> tuple[tuple[Path, Stamp], ...]:
    """Each file's (size, mtime, ctime), None if it is not there: a file written or
    replaced since (controld re-keying a slot, rewriting the rack config) changes its
    stamp. Not the inode: a 9p share's inode numbers are QEMU's remapping of the host's
    (multidevs=remap), made anew by the QEMU process a restore starts."""
    out: list[tuple[Path, Stamp]] = []
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            out.append((path, None))
        else:
            out.append((path, (st.st_size, st.st_mtime_ns, st.st_ctime_ns)))
    return tuple(out)


@dataclass(frozen=True)
class Prepared:
    """What a runtime started ahead of its wake-up (images/zz_guest.py PRESTART, a
    hibernated guest's) read before the sleep, while the share was still mounted: its
    arguments parsed, the rack config, its keys (StartKeys), and the stamps of the files
    they came from. main() uses it only for the same arguments and if no file changed
    since; else it reads them again (a re-key during the sleep)."""

    argv: tuple[str, ...]
    args: argparse.Namespace
    config: Config
    service: Service
    keys: StartKeys
    stamps: tuple[tuple[Path, Stamp], ...]

    def fresh(self, argv: list[str]) -> bool:
        return tuple(argv) == self.argv and _stamps([p for p, _ in self.stamps]) == self.stamps


def prestart(argv: list[str]) -> Prepared:
    """Before the sleep: parse `argv`, read the rack config and the keys, and run the
    signature code once (the cryptography library loads OpenSSL's providers at its first
    use: 0.4 s under TCG). Raises what main() would report."""
    args = _parser().parse_args(argv)
    config, service = _config(args)
    k = load_start_keys(config, service, args.index, Counter())
    assert k.secret.sign is not None
    verify_signature(k.secret.sign.public, b"", k.secret.sign.sign(b""))
    return Prepared(tuple(argv), args, config, service, k,
                    _stamps([Path(args.rack), *k.files]))  # fmt: skip


def _config(args: argparse.Namespace) -> tuple[Config, Service]:
    """The rack as this runtime sees it and its service (ConfigError names what is wrong)."""
    config = load(args.rack).viewed_from(
        args.loopback_alias, Path(args.key_dir) if args.key_dir else None
    )
    service = config.service(args.service)
    if not service.uses_execution_replicas:
        raise ConfigError(
            f"service {service.name!r}: app {service.app!r} runs inside the agreement"
            " replicas, not on execution replicas"
        )
    return config, service


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m zz.execution", description=__doc__)
    p.add_argument("--rack", required=True, help="rack config (TOML)")
    p.add_argument("--service", required=True, help="service name or id")
    p.add_argument("--index", required=True, type=int, help="execution replica index i")
    p.add_argument(
        "--store",
        choices=("dir", "zfs", "host-zfs"),
        default="dir",
        help="checkpoint store: directory snapshots, a ZFS dataset of our own, or (in a guest)"
        " the dataset the host's controld mounted in the share and snapshots on request",
    )
    p.add_argument("--zfs-pool", help="ZFS pool (with --store zfs)")
    p.add_argument("--zfs-dataset", help="ZFS dataset under the pool (default s<id>-exec-<i>)")
    p.add_argument(
        "--recovery",
        choices=("on-demand", "full"),
        default="on-demand",
        help="when behind the stable checkpoint: fetch files on first touch and the rest in"
        " the background (on-demand), or fetch and verify everything before executing"
        " (full; the benchmark's baseline)",
    )
    p.add_argument(
        "--replay-all",
        action="store_true",
        help="run read-only requests also in replayed batches that already hold an"
        " execution certificate (by default they are skipped, ZZ §4.7.2; the benchmark's"
        " baseline)",
    )
    p.add_argument(
        "--flush-replay-first",
        action="store_true",
        help="write a replayed run's buffered files before the first batch that reports,"
        " not after its replies and report are sent (the benchmark's baseline)",
    )
    p.add_argument(
        "--background-pause",
        type=float,
        default=None,
        metavar="SECONDS",
        help="while recovering: the background fetch sleeps this long between files, which"
        " bounds what it takes from request execution (default 0.001)",
    )
    p.add_argument(
        "--start-asleep",
        action="store_true",
        help="a spare: open the state and listen, but do not register with the agreement"
        " replicas (nor execute) until controld writes its wake notice",
    )
    g = p.add_argument_group(
        "in a guest",
        "a runtime inside a VM sees the rack through QEMU user networking and its 9p share"
        " (controld/actions.py writes these options into the share's zz-guest.json)",
    )
    g.add_argument("--state-dir", help="the replica's directory (default: from the rack config)")
    g.add_argument("--key-dir", help="where the keys are (default: the rack config's key_dir)")
    g.add_argument("--status-file", help="status JSON (default: <state-dir>.status.json)")
    g.add_argument("--listen", help="bind address (default: the replica's address in the config)")
    g.add_argument(
        "--loopback-alias",
        help="connect here wherever the config names a loopback address (10.0.2.2: the"
        " host's 127.0.0.1 seen from a QEMU user-network guest)",
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--inject-fault",
        choices=FAULTS,
        help="TESTS ONLY: make this replica faulty (diverge-state: one extra state file"
        " before every checkpoint, so its checkpoint digest differs; wrong-reply: a wrong"
        " result for every request; slow-report: every EXEC-REPORT held back 0.5 s)",
    )
    p.add_argument(
        "--drill-faults",
        action="store_true",
        help='DRILLS ONLY: <state-dir>/zz-fault.json {"fault": NAME|null} switches the'
        " injected fault while running (zz drill on a rack of VMs)",
    )
    return p


def main(argv: list[str] | None = None, prepared: Prepared | None = None) -> int:
    """Run one execution replica; `prepared`: what prestart() read before a sleep, used
    if still fresh."""
    marks = {"main": round(time.monotonic(), 4)}
    stale = prepared is not None and not prepared.fresh(sys.argv[1:] if argv is None else argv)
    if prepared is None or stale:
        prepared = None
        args = _parser().parse_args(argv)
    else:
        args = prepared.args
    _reuse_freed_memory()
    # A replica that will not stop can be asked where it is stuck: SIGUSR2 writes every
    # thread's stack to its log.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s exec-{args.index} %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    if stale:
        logging.getLogger("zz.execution").info(
            "the rack config or the keys changed since they were read ahead: reading them again"
        )
    try:
        config, service = _config(args) if prepared is None else (prepared.config, prepared.service)
        state_dir = Path(args.state_dir) if args.state_dir else None
        marks["config_loaded"] = round(time.monotonic(), 4)
        lock_state_dir(state_dir or service.exec_state_dir(config, args.index))
        opts = _options(args, state_dir, marks, prepared.keys if prepared else None)
        asyncio.run(serve(config, service, args.index, opts))
    except StateDirInUse as e:
        print(f"zz.execution: {e}", file=sys.stderr)
        return EXIT_LOCKED
    except (ConfigError, KeyFileError, AppRegistryError, StorageError, ValueError) as e:
        print(f"zz.execution: {e}", file=sys.stderr)
        return 2
    except AppFault as e:
        print(f"zz.execution: {e}", file=sys.stderr)
        return 3
    except OSError as e:
        print(f"zz.execution: {e}", file=sys.stderr)
        return 1
    return 0


# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def _reuse_freed_memory() -> None:
    """glibc's malloc: blocks up to 16 MiB come from the heap, and up to 64 MiB freed at its
    top stay mapped. With the defaults, the buffers of a replica's large messages (the
    agreement replicas' FETCH-REPLYs of up to 4 MiB, several at a wake-up, the 128 KiB
    batches and the files fetched) were mostly fresh pages: mapped, zero-filled on first
    touch and unmapped again, for every copy. A 4 MiB frame taken the way asyncio's reader
    takes it cost 6.0 ms against 2.2 ms with the heap reused (scripts/bench/frame-copies;
    docs/files.md, Figure 9). Up to 64 MiB freed after a peak stays mapped. Elsewhere
    (another C library, no mallopt) nothing is changed."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(_M_MMAP_THRESHOLD, 16 << 20)
    mallopt(_M_TRIM_THRESHOLD, 64 << 20)


if __name__ == "__main__":
    sys.exit(main())
