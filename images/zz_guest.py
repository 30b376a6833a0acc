# zz_guest.py - the guest agent (the image's default command, images/init): answers health
# requests on TCP port 7000 and runs the replica's runtime from the shared state dataset (9p
# or virtiofs). One JSON object per line each way; stdlib only (it also runs on the host).
# docs/images.md.
"""ZZ guest agent.

A sleeping replica boots into this agent *idle*: no service state is touched, it only
answers. The host (controld, through the slirp forward 127.0.0.1:H -> guest:7000) then
pauses or hibernates the VM; after the wake-up the first answer to `ping` is what
"answering" means in the wake-up benchmark (scripts/bench/wakeup).

Requests (one JSON object per line, one reply line each; a connection may send many):

    {"op": "ping"}              -> {"ok": true, "agent": "zz-guest", "mode": ..., ...}
    {"op": "sleep"}             stop the runtime, sync, unmount /state (QEMU refuses to
                                save a guest that has a 9p share mounted); with
                                "premount": true in the request, or zz.premount=on on
                                the kernel command line, then watch for the restore and
                                mount /state again as soon as it is seen
    {"op": "mount"}             mount /state again (nothing else)
    {"op": "wake", "seq": N}    mount /state, start the runtime command if one is
                                configured and not running (ZZ_RECOVER_FROM=N), then write
                                /state/zz-wake.json {"seq": N, ...} (a record)
    {"op": "meminfo"}           -> {"ok": true, "meminfo_kib": {"MemFree": ..., ...}}
    {"op": "ballast", "mib": M} hold M MiB of non-zero memory (0 frees it). Benchmarks
                                and tests only: it stands in for an application's memory.

What runs comes from /state/zz-guest.json when the share holds one (read at boot and at
every wake): {"command": [argv...], "start": "boot" | "wake", "env": {...}}; the command
runs with /state as its working directory and ZZ_RECOVER_FROM=N after a wake. Without
it the agent stays idle.

A command started at the wake (a hibernated spare's runtime) that runs a Python module
(`python3 -m MOD ...`) is started ahead, before the sleep, as far as it can be without
the share: an interpreter that has imported MOD.__main__ and what it imports (its working
directory /, nothing of /state open, so the share still unmounts) and waits for one line
on its stdin. The wake sends it the working directory, environment and arguments, and it
runs MOD as `-m` would: a TCG guest then skips the interpreter's start-up and the imports
(seconds) after the restore. Status `prestarted`: null, "importing" or "ready". With
"prestart": false in the config at the wake the command is started anew instead (the
baseline of scripts/bench/recovery-phases).

Bad requests get {"ok": false, "error": ...} and are counted; a line over 64 KiB closes
the connection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

PORT = 7000
TAG = "state"
CONFIG = "zz-guest.json"
WAKE_FILE = "zz-wake.json"
MAX_LINE = 64 * 1024
MAX_BALLAST_MIB = 1 << 16
# How long "sleep" waits for a pre-started runtime's imports, so that the save holds them
# (controld asks "sleep" with a 30 s timeout); one still importing finishes after the wake.
PRESTART_WAIT_S = 20.0
# The pre-started interpreter (python3 -c PRESTART MOD ARGS...): import MOD.__main__; if
# it has prestart(), call it with the ARGS the config names (the share is still mounted:
# it may read what it needs from there, but keeps nothing open); say "ready"; then with
# what the wake sends (one JSON line) run main(ARGS, PREPARED) of that module, or MOD as
# `python3 -m MOD ARGS` runs it, telling it when that came (ZZ_PRESTART_GO,
# time.monotonic(): execution/runtime.py's "started"). A prestart() that fails changes
# nothing: main() is then left to read everything itself. Without ARGS (zz.prestart=imports
# on the kernel command line: prestart_reads) it only imports.
PRESTART = """
import importlib, json, os, runpy, sys, time
mod = sys.argv[1]
m = importlib.import_module(mod + ".__main__")
prepared = None
if len(sys.argv) > 2 and hasattr(m, "prestart") and hasattr(m, "main"):
    try:
        prepared = m.prestart(sys.argv[2:])
    except (Exception, SystemExit) as e:
        print(f"zz-guest: {mod} prestart: {e!r}", file=sys.stderr, flush=True)
print("ready", flush=True)
line = sys.stdin.readline()
if not line:
    sys.exit(0)
go = json.loads(line)
os.chdir(go["cwd"])
os.environ.update(go["env"], ZZ_PRESTART_GO=repr(time.monotonic()))
os.dup2(2, 1)
sys.path[0] = os.getcwd()
sys.argv = [mod, *go["args"]]
if prepared is not None:
    sys.exit(m.main(go["args"], prepared))
sys.modules.pop(mod + ".__main__")  # runpy runs it afresh; what it imported stays
runpy.run_module(mod, run_name="__main__", alter_sys=True)
"""
# The same options images/init mounts with.
MOUNT_OPTS = "trans=virtio,version=9p2000.L,msize=512000"
# After a "sleep": how often the agent compares the RTC with the system clock, and by how
# much their difference must grow to be a restore (RestoreWatch).
RESTORE_POLL_S = 0.025
RESTORE_JUMP_S = 1.5
RTC = "/sys/class/rtc/rtc0/since_epoch"


def _kernel_cmdline() -> str:
    """/proc/cmdline, or "" where there is none to read (the agent run on a host)."""
    try:
        with open("/proc/cmdline") as f:
            return f.read()
    except OSError:
        return ""


def share_cache(cmdline: str | None = None) -> str | None:
    """The share's cache mode from the kernel command line (zz.share_cache=, as images/init
    reads it; images/domain.py writes it); None: the default, cache=none."""
    for word in (_kernel_cmdline() if cmdline is None else cmdline).split():
        if word.startswith("zz.share_cache="):
            mode = word.partition("=")[2]
            return mode if mode.isalpha() and mode.islower() else None
    return None


def mount_by_call(cmdline: str | None = None) -> bool:
    """Whether the agent mounts the share with mount(2) itself (sys_mount): not with
    zz.mount=exec on the kernel command line (controld's ZZ_GUEST_MOUNT, the baseline of
    scripts/bench/recovery-phases: it then runs mount(8))."""
    words = (_kernel_cmdline() if cmdline is None else cmdline).split()
    return "zz.mount=exec" not in words


def prestart_reads(cmdline: str | None = None) -> bool:
    """Whether the runtime started ahead may read ahead (its module's prestart()): not with
    zz.prestart=imports on the kernel command line (controld's ZZ_GUEST_PRESTART, the
    baseline of scripts/bench/recovery-phases: it then only imports)."""
    words = (_kernel_cmdline() if cmdline is None else cmdline).split()
    return "zz.prestart=imports" not in words


def premount_on_restore(cmdline: str | None = None) -> bool:
    """Whether the agent mounts the share by itself once it sees the restore after a
    "sleep" (RestoreWatch): only with zz.premount=on on the kernel command line (controld's
    ZZ_GUEST_PREMOUNT=on, scripts/bench/recovery-phases --modes hibernated-premount).
    Off by default: with controld growing the balloon late it was no sooner than the wake
    request's mount (docs/performance.md)."""
    words = (_kernel_cmdline() if cmdline is None else cmdline).split()
    return "zz.premount=on" in words


def rtc_offset() -> float | None:
    """The RTC's time (whole seconds) minus the system clock's; None without an RTC.
    QEMU's RTC follows the host's clock, also while the guest is stopped, and the guest's
    clock does not (under TCG its counters stop with the vCPUs and a restore continues
    them): a save and restore grows this difference by the time the guest was stopped."""
    try:
        with open(RTC) as f:
            rtc = int(f.read())
    except (OSError, ValueError):
        return None
    return rtc - time.time()


class RestoreWatch:
    """Tells a restore from the (RTC - clock) differences fed to it: the RTC counts whole
    seconds, so while the guest runs the difference stays within 1 s below its true value
    (the highest fed so far); a difference more than RESTORE_JUMP_S above that highest is
    the clock having been stopped, i.e. a save (libvirt stops the vCPUs before it saves)
    and a restore. A stop shorter than about 2 s may not be seen: then the wake request
    mounts the share, as without the watch."""

    def __init__(self, jump: float = RESTORE_JUMP_S) -> None:
        self.jump = jump
        self.high: float | None = None

    def feed(self, offset: float) -> bool:
        if self.high is not None and offset > self.high + self.jump:
            return True
        self.high = offset if self.high is None else max(self.high, offset)
        return False


def share_kind(cmdline: str | None = None) -> str:
    """The share's type: "virtiofs" when the kernel command line has zz.share=virtiofs
    (images/domain.py writes it with a virtiofs share), else "9p"."""
    words = (_kernel_cmdline() if cmdline is None else cmdline).split()
    return "virtiofs" if "zz.share=virtiofs" in words else "9p"


def mount_args(cache: str | None, kind: str = "9p") -> list[str]:
    if kind == "virtiofs":
        return ["mount", "-t", "virtiofs"]  # virtiofsd's cache mode decides the caching
    return ["mount", "-t", "9p", "-o", MOUNT_OPTS + (f",cache={cache}" if cache else "")]


def _libc() -> Any:
    """libc through ctypes, loaded when the agent starts (not at a wake, when the import
    would be code run for the first time in a guest just restored); None without ctypes."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):
        return None


LIBC = _libc()


def sys_mount(source: str, target: str, fstype: str, options: str) -> bool:
    """mount(2) through libc (ctypes), without a mount process: False where ctypes or libc
    is not there (then the caller runs mount(8)); OSError if the call fails."""
    if LIBC is None:
        return False
    import ctypes  # loaded with LIBC already

    args = (source.encode(), target.encode(), fstype.encode(), 0, options.encode())
    if LIBC.mount(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")
    return True


def drop_share_caches() -> None:
    """Forget the guest's cached dentries and inodes (drop_caches 2: slab objects, not dirty
    pages), so that a cached share sees what the host wrote since (controld's wake notice);
    with cache=none nothing is cached and this is not needed."""
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2\n")


def compact_memory() -> None:
    """Drop the page cache, dentries and inodes and compact the free memory (before a save:
    scripts/bench/hibernate-wake's "compact" variant measures what it does to the file)."""
    os.sync()
    for knob, value in (("drop_caches", "3"), ("compact_memory", "1")):
        try:
            with open(f"/proc/sys/vm/{knob}", "w") as f:
                f.write(value + "\n")
        except OSError:
            pass


def uptime() -> float:
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.monotonic()


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB (the figures the balloon's floor depends on)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0])
    except OSError:
        pass
    return out


class Agent:
    """state_dir: where the share is (or, with manage_mount False, just a directory)."""

    def __init__(self, state_dir: Path, manage_mount: bool, stop_timeout: float = 10.0) -> None:
        self.state_dir = state_dir
        self.manage_mount = manage_mount
        self.kind = share_kind() if manage_mount else "9p"
        self.cache = share_cache() if manage_mount and self.kind == "9p" else None
        self.mount_call = mount_by_call()
        self.premount = premount_on_restore() if manage_mount else False
        self.rtc_offset = rtc_offset
        self.restore_poll = RESTORE_POLL_S
        # Bumped by every request but ping: a restore watch started by a "sleep" mounts
        # only while no other request came after that sleep.
        self.generation = 0
        # restore_seen / premounted of a mount the restore watch did (time.monotonic()):
        # the next wake puts them among its marks.
        self.premount_marks: dict[str, float] = {}
        self.watcher: threading.Thread | None = None
        self.stop_timeout = stop_timeout
        self.child: subprocess.Popen[bytes] | None = None
        # A runtime started ahead of its wake-up (PRESTART), and whether it said "ready".
        self.prestarted: subprocess.Popen[bytes] | None = None
        self.prestart_ready = False
        self.recovering_from: int | None = None
        # The steps of the latest wake (time.monotonic(), the runtime's clock too): passed
        # to the runtime it starts as ZZ_WAKE_MARKS, whose status puts them among its
        # wake_marks (zz drill: the recovery's resume phase, split).
        self.wake_marks: dict[str, float] = {}
        self.ballast: bytearray | None = None
        self.counters: dict[str, int] = {}
        self.lock = threading.Lock()

    def count(self, what: str) -> None:
        self.counters[what] = self.counters.get(what, 0) + 1

    # ---- the share -------------------------------------------------------------------
    def share_present(self) -> bool:
        """A virtio-9p device tagged "state" exists (or we do not manage mounts). A
        virtiofs share is there when the command line says so (the guest's kernel, 6.1,
        lists no virtiofs tags in sysfs)."""
        if not self.manage_mount or self.kind == "virtiofs":
            return True
        for tag in Path("/sys/bus/virtio/drivers/9pnet_virtio").glob("virtio*/mount_tag"):
            try:
                if tag.read_bytes().rstrip(b"\0") == TAG.encode():
                    return True
            except OSError:
                pass
        return False

    def mounted(self) -> bool:
        if not self.manage_mount:
            return self.state_dir.is_dir()
        try:
            with open("/proc/mounts") as f:
                return any(line.split()[1] == str(self.state_dir) for line in f if " " in line)
        except OSError:
            return False

    def mount(self) -> None:
        if self.mounted() or not self.share_present():
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        argv = [*mount_args(self.cache, self.kind), TAG, str(self.state_dir)]
        # The same mount without a process: fork and exec of busybox under TCG, in a guest
        # just restored (nothing translated yet), is most of the wake's mount.
        fstype, opts = argv[2], (argv[4] if len(argv) > 5 else "")
        if self.mount_call and sys_mount(TAG, str(self.state_dir), fstype, opts):
            return
        p = subprocess.run(argv, capture_output=True)
        if p.returncode != 0:
            raise RuntimeError(f"mount {TAG}: {p.stderr.decode(errors='replace').strip()}")

    def unmount(self) -> None:
        os.sync()
        if not self.manage_mount or not self.mounted():
            return
        p = subprocess.run(["umount", str(self.state_dir)], capture_output=True)
        if p.returncode != 0:
            raise RuntimeError(f"umount /state: {p.stderr.decode(errors='replace').strip()}")

    # ---- the runtime -------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        path = self.state_dir / CONFIG
        if not self.mounted() or not path.exists():
            return {}
        cfg = json.loads(path.read_text())
        cmd = cfg.get("command")
        if cmd is not None and (
            not isinstance(cmd, list) or not cmd or not all(isinstance(a, str) for a in cmd)
        ):
            raise ValueError(f"{path}: command must be a non-empty list of strings")
        if cfg.get("start", "boot") not in ("boot", "wake"):
            raise ValueError(f"{path}: start must be 'boot' or 'wake'")
        env = cfg.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise ValueError(f"{path}: env must map names to strings")
        return cfg

    def running(self) -> bool:
        return self.child is not None and self.child.poll() is None

    def start_runtime(self, cfg: dict[str, Any]) -> bool:
        if self.running() or not cfg.get("command"):
            return False
        env = dict(cfg.get("env", {}))
        if self.recovering_from is not None:
            env["ZZ_RECOVER_FROM"] = str(self.recovering_from)
            env["ZZ_WAKE_MARKS"] = json.dumps(self.wake_marks)
        if cfg.get("prestart", True) is False:
            self.stop_prestarted()  # benchmarks' baseline: the whole start-up after the wake
        elif self._go_prestarted(cfg, env):
            return True
        # Own session: stop_runtime() signals the whole group the runtime may spawn.
        self.child = subprocess.Popen(
            cfg["command"], cwd=self.state_dir, env=dict(os.environ, **env), start_new_session=True
        )
        print(f"zz-guest: runtime started, pid {self.child.pid}: {cfg['command']}", flush=True)
        return True

    @staticmethod
    def _module_command(cfg: dict[str, Any]) -> tuple[str, str, list[str]] | None:
        """(interpreter, module, arguments) of a `python3 -m MOD ARGS...` command."""
        cmd = cfg.get("command") or []
        if len(cmd) >= 3 and cmd[1] == "-m" and "python" in Path(cmd[0]).name:
            return cmd[0], cmd[2], cmd[3:]
        return None

    def prestart(self, cfg: dict[str, Any]) -> bool:
        """Start the runtime of a "wake" config ahead (PRESTART), if it is a Python module
        and none is waiting already."""
        if cfg.get("start") != "wake" or self.running():
            return False
        if self.prestarted is not None and self.prestarted.poll() is None:
            return False
        mc = self._module_command(cfg)
        if mc is None:
            return False
        ahead = mc[2] if prestart_reads() else []
        self.prestarted = subprocess.Popen(
            [mc[0], "-c", PRESTART, mc[1], *ahead], cwd="/",
            env=dict(os.environ, **cfg.get("env", {})),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        self.prestart_ready = False
        print(f"zz-guest: runtime pre-started, pid {self.prestarted.pid}: {mc[1]}", flush=True)
        return True

    def wait_prestarted(self, timeout: float) -> bool:
        """True once the pre-started runtime said "ready" (its imports done), waiting up
        to `timeout` seconds for it."""
        p = self.prestarted
        if p is None or p.stdout is None or p.poll() is not None:
            return False
        if not self.prestart_ready:
            ready, _, _ = select.select([p.stdout], [], [], timeout)
            if ready and p.stdout.readline().strip() == b"ready":
                self.prestart_ready = True
        return self.prestart_ready

    def _go_prestarted(self, cfg: dict[str, Any], env: dict[str, str]) -> bool:
        """Hand the wake to the pre-started runtime: it becomes the child."""
        p, self.prestarted = self.prestarted, None
        mc = self._module_command(cfg)
        if p is None or p.stdin is None or p.poll() is not None or mc is None:
            return False
        go = {"cwd": str(self.state_dir), "env": env, "args": mc[2]}
        try:
            p.stdin.write(json.dumps(go).encode() + b"\n")
            p.stdin.close()
        except OSError:
            return False
        if p.stdout is not None:
            p.stdout.close()  # it writes to the console (stderr) from here
        self.child = p
        self.count("prestarted_runs")
        print(f"zz-guest: pre-started runtime pid {p.pid} runs: {cfg['command']}", flush=True)
        return True

    def stop_prestarted(self) -> None:
        p, self.prestarted = self.prestarted, None
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def stop_runtime(self) -> int | None:
        child, self.child = self.child, None
        if child is None:
            return None
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        return child.returncode

    # ---- requests ----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        child = self.child
        mode = "idle"
        if child is not None:
            mode = "running" if child.poll() is None else "exited"
        return {
            "ok": True,
            "agent": "zz-guest",
            "mode": mode,
            "uptime": uptime(),
            "state_mounted": self.mounted(),
            "share": self.kind,
            "recovering_from": self.recovering_from,
            "runtime_pid": child.pid if child is not None else None,
            "runtime_exit": child.returncode if child is not None else None,
            "prestarted": self._prestart_state(),
            "prestarted_pid": self.prestarted.pid if self._prestart_state() else None,
            "ballast_mib": len(self.ballast) >> 20 if self.ballast else 0,
            "counters": dict(self.counters),
        }

    def _prestart_state(self) -> str | None:
        p = self.prestarted
        if p is None or p.poll() is not None:
            return None
        return "ready" if self.prestart_ready else "importing"

    def handle(self, req: Any) -> dict[str, Any]:
        if not isinstance(req, dict) or not isinstance(req.get("op"), str):
            raise ValueError("a request is a JSON object with a string 'op'")
        op = req["op"]
        if op != "ping":
            self.generation += 1
        if op == "ping":
            pass
        elif op == "sleep":
            premount = req.get("premount", self.premount)
            if not isinstance(premount, bool):
                raise ValueError("premount must be true or false")
            self.premount_marks = {}
            self.watcher = None
            self.stop_runtime()
            # Its imports belong in the save (read the config while the share is there).
            try:
                self.prestart(self.config())
            except (ValueError, OSError):
                self.count("bad_config")
            self.wait_prestarted(PRESTART_WAIT_S)
            self.unmount()
            if req.get("compact") is True and self.manage_mount:
                compact_memory()
            if premount and self.manage_mount:
                self.watcher = self.watch_restore()
        elif op == "mount":
            self.mount()
        elif op == "wake":
            seq = req.get("seq")
            if seq is not None and (not isinstance(seq, int) or seq < 0):
                raise ValueError("seq must be a non-negative integer")
            self.wake_marks = {**self.premount_marks, "agent_wake": round(time.monotonic(), 4)}
            self.premount_marks = {}
            self.mount()
            self.wake_marks["mounted"] = round(time.monotonic(), 4)
            self.recovering_from = seq
            if self.cache and self.manage_mount and self.mounted():
                # the host wrote the wake notice into the share behind the guest's cache
                drop_share_caches()
            cfg = self.config()
            self.wake_marks["config_read"] = round(time.monotonic(), 4)
            if not self.start_runtime(cfg) and self.running():
                # A runtime that slept through the pause: have it read the notice now.
                assert self.child is not None
                os.kill(self.child.pid, signal.SIGUSR1)
            if self.mounted():
                # The wake's record on the share, after the runtime is on its way: the
                # runtime takes the seq from ZZ_RECOVER_FROM and controld's notice, and
                # two file calls over 9p in a guest just restored took 50-150 ms.
                wake = {"seq": seq, "uptime": uptime(), "time": time.time()}
                tmp = self.state_dir / (WAKE_FILE + ".tmp")
                tmp.write_text(json.dumps(wake) + "\n")
                os.replace(tmp, self.state_dir / WAKE_FILE)
        elif op == "meminfo":
            return {"ok": True, "meminfo_kib": meminfo()}
        elif op == "ballast":
            mib = req.get("mib")
            if not isinstance(mib, int) or not 0 <= mib <= MAX_BALLAST_MIB:
                raise ValueError(f"mib must be an integer in 0..{MAX_BALLAST_MIB}")
            self.ballast = None
            if mib:
                # Non-zero bytes: zero pages are not written to a save file.
                self.ballast = bytearray(b"\xa5") * (mib << 20)
        else:
            raise ValueError(f"unknown op {op!r}")
        self.count(op)
        return self.status()

    # ---- the restore watch -------------------------------------------------------------
    def watch_restore(self) -> threading.Thread | None:
        """After a "sleep": a thread that polls rtc_offset() every restore_poll seconds and,
        once RestoreWatch sees the guest's clock stopped for a while (it was saved and
        restored), mounts the share: at a hibernated spare's wake the mount then runs while
        controld grows the balloon and sends its wake request, which finds it done.
        Nothing before the save can trigger it (the clock and the RTC move together while
        the vCPUs run, and libvirt's save stops them first); it gives up once any other
        request came (generation), i.e. the wake or a mount came first. No RTC: no watch."""
        if self.rtc_offset() is None:
            self.count("restore_watch_no_rtc")
            return None
        gen = self.generation
        t = threading.Thread(target=self._watch, args=(gen,), daemon=True, name="restore-watch")
        t.start()
        return t

    def _watch(self, gen: int) -> None:
        watch = RestoreWatch()
        while self.generation == gen:
            off = self.rtc_offset()
            if off is not None and watch.feed(off):
                seen = time.monotonic()
                with self.lock:
                    if self.generation != gen:
                        return
                    self.count("restore_seen")
                    try:
                        self.mount()
                    except (RuntimeError, OSError) as e:
                        # The wake request mounts again and says what fails.
                        self.count("premount_failed")
                        print(f"zz-guest: mount after the restore: {e}", flush=True)
                        return
                    done = time.monotonic()
                    self.premount_marks = {"restore_seen": round(seen, 4),
                                           "premounted": round(done, 4)}  # fmt: skip
                    self.count("premounted")
                print(f"zz-guest: restore seen, share mounted in {done - seen:.3f} s", flush=True)
                return
            time.sleep(self.restore_poll)

    def locked_handle(self, req: Any) -> dict[str, Any]:
        """One state-changing request at a time (pings do not come here)."""
        with self.lock:
            return self.handle(req)

    async def serve_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    req = json.loads(line)
                    if isinstance(req, dict) and req.get("op") == "ping":
                        # Inline: a wake-up is timed until this answer, and a thread
                        # hand-off costs milliseconds under TCG.
                        reply = self.handle(req)
                    else:
                        # Blocking ops (mount, a runtime stop, a big ballast) run off the
                        # loop so pings on other connections are still answered.
                        reply = await asyncio.to_thread(self.locked_handle, req)
                except (ValueError, RuntimeError, OSError) as e:
                    self.count("bad_request")
                    reply = {"ok": False, "error": str(e)}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (asyncio.LimitOverrunError, ValueError):
            # readline() raises ValueError for a line over the stream limit.
            self.count("line_too_long")
        except ConnectionError:
            pass  # the host went away mid-request: nothing to answer
        finally:
            writer.close()


async def serve(agent: Agent, host: str, port: int) -> None:
    server = await asyncio.start_server(agent.serve_conn, host, port, limit=MAX_LINE)
    print(
        f"zz-guest: agent up at {uptime():.2f} s, python {sys.version.split()[0]}, port {port},"
        f" state {'mounted' if agent.mounted() else 'not mounted'}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
    agent.stop_runtime()
    agent.stop_prestarted()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="ZZ guest agent (docs/images.md)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--state", default="/state", help="where the 9p share is mounted")
    p.add_argument(
        "--no-mount",
        action="store_true",
        help="the state directory is a plain directory (on a host: tests, process backend)",
    )
    args = p.parse_args(argv)
    agent = Agent(Path(args.state), manage_mount=not args.no_mount)
    try:
        cfg = agent.config()
        if cfg.get("start", "boot") == "boot":
            agent.start_runtime(cfg)
        else:
            agent.prestart(cfg)
    except (ValueError, OSError) as e:
        # A broken config must not take the agent down: the host still needs answers.
        agent.count("bad_config")
        print(f"zz-guest: {CONFIG}: {e}", flush=True)
    asyncio.run(serve(agent, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
