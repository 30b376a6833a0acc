# controld/orphans.py - what really runs on this host for a replica slot, whatever the
# inventory says: runtime processes in its state directory (the process backend), whoever
# listens on its execution port, and ending an orphan. docs/controld.md "Orphans".
"""Orphan runtimes and port holders (Linux /proc).

A runtime (python -m zz.execution) locks <state>/runtime.lock for its life and writes its
pid there (execution/__main__.py lock_state_dir); a process-backend runtime also runs with
its state directory as cwd. So the runtimes of a slot are: the lock's holder, and any
zz.execution process whose cwd or --state-dir is the state directory. Nothing here takes
the lock (that would make a runtime starting right then refuse): a holder is recognised by
its pid being alive and being a zz.execution process.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = "runtime.lock"  # execution/__main__.py LOCK_NAME
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


@dataclass(frozen=True)
class Proc:
    pid: int
    cmdline: str

    def describe(self) -> str:
        cmd = self.cmdline if len(self.cmdline) <= 160 else self.cmdline[:157] + "..."
        return f"pid {self.pid} ({cmd})"


def _cmdline(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip() or None


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in ("Z", "X")


def is_runtime(cmdline: str) -> bool:
    return "zz.execution" in cmdline


def lock_holder(state: Path) -> int | None:
    """The pid the state directory's lock file names, if that process is a live runtime."""
    try:
        pid = int(json.loads((state / LOCK_NAME).read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    cmd = _cmdline(pid)
    return pid if cmd is not None and is_runtime(cmd) and _alive(pid) else None


def runtimes_in(state: Path) -> list[Proc]:
    """Live zz.execution processes that own `state`: its lock's holder, and those whose cwd
    or --state-dir is it."""
    want = str(state.resolve())
    found: dict[int, Proc] = {}
    holder = lock_holder(state)
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        pid = int(d.name)
        cmd = _cmdline(pid)
        if cmd is None or not is_runtime(cmd) or not _alive(pid):
            continue
        try:
            cwd = os.readlink(d / "cwd")
        except OSError:
            cwd = ""
        if pid == holder or cwd == want or f"--state-dir {want}" in cmd:
            found[pid] = Proc(pid, cmd)
    return sorted(found.values(), key=lambda p: p.pid)


def port_listeners(port: int) -> list[Proc]:
    """Processes holding a TCP socket listening on `port` (any address, v4 or v6)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == _LISTEN and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    if not inodes:
        return []
    out: list[Proc] = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fds = os.listdir(d / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(d / "fd" / fd)
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                out.append(Proc(int(d.name), _cmdline(int(d.name)) or "?"))
                break
    return out


def end(pid: int, timeout: float = 10.0) -> bool:
    """SIGTERM the orphan (its process group if it leads one: spawn() starts every runtime
    in its own session), SIGCONT so a stopped one sees it, SIGKILL after `timeout`. True
    once it is gone (not our child: init reaps it)."""

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)

    send(signal.SIGTERM)
    send(signal.SIGCONT)
    for sig in (None, signal.SIGKILL):
        if sig is not None:
            send(sig)
        deadline = time.monotonic() + (timeout if sig is None else 5.0)
        while time.monotonic() < deadline:
            if not _alive(pid):
                return True
            time.sleep(0.02)
    return not _alive(pid)
