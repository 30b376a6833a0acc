# zz/procrack.py - start and stop a whole rack as local OS processes (the process backend).
# Every agreement replica (zz-agreed) and every ACTIVE execution replica (python -m
# zz.execution) of the chosen services; sleeping replicas are simply not started.
"""Process launcher for a rack config.

    config = zz.config.load("rack.toml")      # keys already generated (zz keys)
    with ProcRack(config) as rack:            # stops everything on exit, also on errors
        rack.start()                          # renders replica files, waits until listening
        ...                                   # clients talk to the addresses in the config
    report = rack.last_stop                   # exit codes and leftover pids

Each process runs in its own session (process group), so a stop reaches anything it
spawned. Execution replicas `0 .. active-1` are the active ones (docs/config.md).
Logs go to `run/s<id>/agreed-<r>.log` and `run/s<id>/exec-<i>.log`.

The single-process helpers (spawn, terminate, reap, signal_group, leftover_pids) are the
one implementation of this start/stop discipline; the test harness and scripts use them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zz import render
from zz.config import Config, Service

REPO = Path(__file__).resolve().parent.parent
DEFAULT_AGREED = REPO / "agreement" / "build" / "zz-agreed"
_TICKS = os.sysconf("SC_CLK_TCK")


def split_tree() -> str | None:
    """Why a process started from this tree would run code of another one, or None.

    The editable install maps zz.controld, zz.execution and zz.snapshots to the tree it
    was made from, so `PYTHONPATH=<a worktree>` alone mixes that worktree's zz with the
    installed tree's sub-packages (a campaign run from a worktree once did, and its
    runtimes failed on the other tree's half-changed fetch code)."""
    import importlib.util

    for name in ("zz.controld", "zz.execution", "zz.snapshots"):
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve() if spec and spec.origin else None
        if origin is None or not origin.is_relative_to(REPO):
            return (
                f"{name} comes from {origin.parent if origin else 'nowhere'}, not from {REPO}:"
                f" install this tree (pip install -e {REPO}) or link its top-level"
                " controld, execution and snapshots directories into zz/"
            )
    return None


# ---- single processes (also used by tests/cluster.py, the tests and scripts/demo_web.py) --
def repo_env() -> dict[str, str]:
    """Our environment with this tree first on PYTHONPATH, so `python -m zz...` imports
    from it even when the package is not installed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def spawn(
    cmd: list[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = REPO,
) -> subprocess.Popen[bytes]:
    """Start `cmd` in its own session (= its own process group, so a signal to the group
    reaches anything it spawns), stdin from /dev/null, stdout and stderr appended to
    `log_path`; `env` None inherits ours."""
    with open(log_path, "ab") as fh:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
            env=env,
        )


def stat_fields(path: Path | str) -> list[str] | None:
    """The fields of a /proc .../stat file after the parenthesised command name (which may
    hold spaces and parentheses): state first, start time at 19. None if unreadable."""
    try:
        stat = Path(path).read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None
    if it is gone or a zombie. pid and start time together name one process: a recycled pid
    has another start time, so it is never signalled by mistake."""
    rest = stat_fields(f"/proc/{pid}/stat")
    if rest is None or rest[0] == "Z":
        return None
    return int(rest[19])


def threads_left(pid: int) -> bool:
    """Whether a thread of process `pid` has not exited yet. A zombie leader (start_ticks
    None) may still have some, and the process's files, sockets included, close only with
    the last one: /proc/<pid>/task lists them."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        rest = stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if rest is not None and rest[0] not in ("Z", "X"):
            return True
    return False


def signal_group(pid: int, sig: int) -> None:
    """Send `sig` to process group `pid` (a spawn()ed process's pid); gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def reap(popen: subprocess.Popen[bytes], timeout: float, kill_group: bool = False) -> int | None:
    """Wait up to `timeout` for `popen` to exit: its exit code, or None when it had to be
    SIGKILLed (with its group). With `kill_group`, the group is SIGKILLed also after an
    exit, which takes down anything it spawned."""
    try:
        code: int | None = popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
    if code is None or kill_group:
        signal_group(popen.pid, signal.SIGKILL)
    if code is None:
        popen.wait(timeout=10)
    return code


def terminate(popen: subprocess.Popen[bytes], timeout: float = 10.0) -> int | None:
    """SIGTERM `popen`'s group (if it still runs), SIGKILL after `timeout`: its exit code,
    None if it had to be killed."""
    if popen.poll() is None:
        signal_group(popen.pid, signal.SIGTERM)
    return reap(popen, timeout)


def leftover_pids(any_of: Iterable[str], all_of: Iterable[str] = ()) -> list[int]:
    """Live processes (not zombies, not this one) whose command line contains one of
    `any_of` and every one of `all_of`: what survived of processes we started."""
    some = [m.encode() for m in any_of]
    every = [m.encode() for m in all_of]
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if (
            any(m in cmd for m in some)
            and all(m in cmd for m in every)
            and (rest := stat_fields(d / "stat")) is not None
            and rest[0] != "Z"
        ):
            found.append(int(d.name))
    return found


@dataclass
class Proc:
    """One started replica process."""

    kind: str  # "agreed" or "exec"
    service: Service
    index: int
    address: tuple[str, int]
    log: Path
    popen: subprocess.Popen[bytes]

    @property
    def name(self) -> str:
        return f"{self.service.name}/{self.kind}-{self.index}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class StopReport:
    """What stop() found: exit codes (None = had to be SIGKILLed) and survivors."""

    codes: dict[str, int | None] = field(default_factory=dict)
    leftovers: list[int] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.leftovers and all(c == 0 for c in self.codes.values())


class ProcRack:
    """The processes of `services` (default: all) of one rack config."""

    def __init__(
        self,
        config: Config,
        services: Iterable[Service] | None = None,
        agreed: Path | str | None = None,
        python: str = sys.executable,
        overrides: Mapping[str, Any] | None = None,
        exec_args: Mapping[int, list[str]] | None = None,
    ) -> None:
        self.config = config
        # Extra command-line arguments per execution replica index (store, fault switches).
        self.exec_args = dict(exec_args or {})
        self.services = list(services) if services is not None else list(config.services)
        self.agreed = Path(agreed) if agreed else DEFAULT_AGREED
        self.python = python
        self.overrides = overrides
        self.procs: list[Proc] = []
        self.last_stop: StopReport | None = None

    # ---- start ------------------------------------------------------------------------
    def start(self, timeout: float = 30.0, linked: bool = True) -> None:
        """Start every agreement replica, then every active execution replica, and wait
        until all listen (and, with `linked`, until every execution replica is connected
        to all agreement replicas). Anything already started is stopped on failure."""
        if not self.agreed.exists():
            raise FileNotFoundError(f"{self.agreed} not built: make -C agreement")
        try:
            for svc in self.services:
                render.render_service(self.config, svc, self.overrides)
                for r in range(svc.n):
                    self._spawn(
                        "agreed",
                        svc,
                        r,
                        self.config.replica_address(svc, r),
                        [str(self.agreed), "--conf", str(self._run(svc) / f"agreed-{r}.conf")],
                    )
            for svc in self.services:
                if not svc.uses_execution_replicas:
                    continue
                for i in range(svc.active):
                    cmd = [self.python, "-m", "zz.execution", "--rack", str(self.config.path)]
                    cmd += ["--service", svc.name, "--index", str(i), *self.exec_args.get(i, [])]
                    self._spawn("exec", svc, i, svc.exec_address(self.config, i), cmd)
            deadline = time.monotonic() + timeout
            for p in self.procs:
                self._wait_listening(p, deadline)
            if linked:
                for p in self.procs:
                    if p.kind == "exec":
                        self._wait_linked(p, deadline)
        except BaseException:
            self.stop()
            raise

    def _run(self, svc: Service) -> Path:
        return self.config.rack.run_dir / f"s{svc.id}"

    def _spawn(
        self, kind: str, svc: Service, index: int, addr: tuple[str, int], cmd: list[str]
    ) -> None:
        log = self._run(svc) / f"{kind}-{index}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.procs.append(Proc(kind, svc, index, addr, log, spawn(cmd, log, repo_env())))

    def _wait_listening(self, p: Proc, deadline: float) -> None:
        while True:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{p.log_tail()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(p.address, timeout=0.5),
            ):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{p.name} not listening on {p.address}:\n{p.log_tail()}")
            time.sleep(0.05)

    def _wait_linked(self, p: Proc, deadline: float) -> None:
        import json

        status = self._run(p.service) / f"exec-{p.index}.status.json"
        while True:
            with contextlib.suppress(OSError, ValueError):
                if json.loads(status.read_text()).get("agreement_links_up") == p.service.n:
                    return
            if not p.alive():
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}:\n{p.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{p.name} not linked to its agreement replicas")
            time.sleep(0.1)

    # ---- observe ----------------------------------------------------------------------
    def cpu_seconds(self) -> dict[str, float]:
        """User+system CPU seconds per live process (its main process, from /proc), so
        a caller can tell which part of the rack a benchmark saturates."""
        out: dict[str, float] = {}
        for p in self.procs:
            rest = stat_fields(f"/proc/{p.popen.pid}/stat")
            if rest is not None and len(rest) > 12:
                out[p.name] = (int(rest[11]) + int(rest[12])) / _TICKS  # utime, stime
        return out

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if not p.alive()]

    def log_tails(self, lines: int = 15) -> str:
        return "\n".join(f"---- {p.name} ({p.log}) ----\n{p.log_tail(lines)}" for p in self.procs)

    # ---- stop -------------------------------------------------------------------------
    def stop(self, timeout: float = 10.0) -> StopReport:
        """SIGTERM every process group, SIGKILL what is still there after `timeout`,
        then look for leftovers (processes naming this rack's files)."""
        report = StopReport()
        for p in self.procs:
            if p.alive():
                signal_group(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            # kill_group also reaps anything the replica spawned in its group.
            left = max(0.1, deadline - time.monotonic())
            report.codes[p.name] = reap(p.popen, left, kill_group=True)
        report.leftovers = self.leftovers()
        self.last_stop = report
        return report

    def leftovers(self) -> list[int]:
        """Live processes (not zombies) whose command line names this rack's config or
        run directory: anything of ours that survived."""
        # The separator keeps run_dir "x/run" from matching a neighbour "x/run2".
        return leftover_pids([str(self.config.path), f"{self.config.rack.run_dir}/"])

    def __enter__(self) -> ProcRack:
        return self

    def __exit__(self, et: object, ev: object, tb: object) -> None:
        try:
            if et is not None and self.procs:
                print(self.log_tails(), file=sys.stderr)
        finally:
            self.stop()
