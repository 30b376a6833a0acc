# controld/hv_process.py - the process backend of controld/hypervisor.py: a replica is an OS
# process (zz.procrack.spawn, its own process group); pause = SIGSTOP/SIGCONT of the group.
# For protocol tests and for hosts without virtualization (docs/design.md §8).
"""Process backend.

    create   spawn spec.command in its own session; output to run_dir/replica.log,
             working directory state_dir (else run_dir)
    suspend  SIGSTOP to the process group, returns once the leader shows state T
    resume   SIGCONT to the group, returns once the leader runs again
    save     suspend + write a JSON record to `path`. **A process cannot be saved to
             disk**: its memory stays where it is, the process just stays stopped. So
             "hibernated" in the process backend means *stopped*, exactly like "paused",
             and a restore is a SIGCONT: wake-up figures measured on this backend say
             nothing about hibernation. The record only lets restore(path) find it.
    restore  SIGCONT the process the record names; the record stays (as a libvirt save
             file does) until discard(path)
    set_memory  a process has no balloon: the target is validated and recorded
             (memory_kib reports it), the process's memory is not touched
    destroy  SIGTERM the group (+ SIGCONT so a stopped group sees it), SIGKILL after
             `stop_timeout`; the domain is gone
    hibernate  record the balloon target + save; wake_hibernated = restore + record the
             full size. Nothing is paged out (see save).
    guest_call a request to the guest agent on the host port the spec pairs with
             GUEST_AGENT_PORT (the process must be images/zz_guest.py --no-mount or speak
             its protocol on that port)

Known limits: the processes are controld's children, held as Popen objects in memory; a
restarted controld cannot adopt them (restore() of an older record raises), and close()
terminates every process of this backend, saved ones included.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zz.atomicfile import write_atomic
from zz.controld.hypervisor import (
    DEFAULT_BALLOON_MIB,
    GUEST_AGENT_PORT,
    PAUSED,
    RUNNING,
    SHUTOFF,
    DomainNotFound,
    HibernateResult,
    HypervisorError,
    ReplicaSpec,
    guest_request,
)
from zz.procrack import reap, repo_env, signal_group, spawn

RECORD_FORMAT = "zz-process-save/1"


def proc_state(pid: int) -> str | None:
    """The one-letter state of /proc/<pid>/stat (R, S, T, Z, ...), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def _start_ticks(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat: the start time, which tells a reused pid apart."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


@dataclass
class _Replica:
    spec: ReplicaSpec
    popen: subprocess.Popen[bytes]
    start_ticks: int
    memory_kib: int


class ProcessHypervisor:
    """Replicas as local process groups. env: their environment (default: ours with this
    tree on PYTHONPATH, zz.procrack.repo_env)."""

    kind = "process"

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        stop_timeout: float = 10.0,
        signal_timeout: float = 2.0,
    ) -> None:
        self.env = dict(env) if env is not None else repo_env()
        self.stop_timeout = stop_timeout
        self.signal_timeout = signal_timeout
        self._live: dict[str, _Replica] = {}
        self._saved: dict[str, _Replica] = {}  # by resolved save path

    # ---- plumbing ------------------------------------------------------------------------
    def _get(self, name: str, action: str) -> _Replica:
        r = self._live.get(name)
        if r is None:
            raise DomainNotFound(name, action, "no such process replica")
        return r

    def _alive(self, r: _Replica, action: str) -> None:
        code = r.popen.poll()
        if code is not None:
            raise HypervisorError(r.spec.name, action, f"process exited with {code}")

    def _wait_state(self, r: _Replica, action: str, stopped: bool) -> None:
        """Signals are delivered asynchronously; return once the leader is (not) in T."""
        deadline = time.monotonic() + self.signal_timeout
        while True:
            st = proc_state(r.popen.pid)
            if st is None or st == "Z":
                self._alive(r, action)  # raises unless it is a zombie we have not reaped
                raise HypervisorError(r.spec.name, action, "process is gone")
            if (st == "T") == stopped:
                return
            if time.monotonic() > deadline:
                raise HypervisorError(r.spec.name, action, f"still in state {st}")
            time.sleep(0.002)

    # ---- lifecycle ----------------------------------------------------------------------
    def create(self, spec: ReplicaSpec) -> None:
        if spec.command is None:
            raise HypervisorError(spec.name, "create", "the process backend needs a command")
        if spec.name in self._live or any(r.spec.name == spec.name for r in self._saved.values()):
            raise HypervisorError(spec.name, "create", "a replica of that name exists")
        try:
            popen = spawn(
                list(spec.command), spec.run_dir / "replica.log", self.env,
                cwd=spec.state_dir or spec.run_dir,
            )  # fmt: skip
        except OSError as e:
            raise HypervisorError(spec.name, "create", str(e)) from e
        try:
            ticks = _start_ticks(popen.pid)
        except (OSError, ValueError):
            ticks = 0  # already exited and reaped by the kernel: state() says SHUTOFF
        self._live[spec.name] = _Replica(spec, popen, ticks, spec.memory_mib * 1024)

    def suspend(self, name: str) -> None:
        r = self._get(name, "suspend")
        self._alive(r, "suspend")
        signal_group(r.popen.pid, signal.SIGSTOP)
        self._wait_state(r, "suspend", stopped=True)

    def resume(self, name: str) -> None:
        r = self._get(name, "resume")
        self._alive(r, "resume")
        signal_group(r.popen.pid, signal.SIGCONT)
        self._wait_state(r, "resume", stopped=False)

    def save(self, name: str, path: Path) -> None:
        r = self._get(name, "save")
        if proc_state(r.popen.pid) != "T":
            self.suspend(name)
        record = {
            "format": RECORD_FORMAT,
            "name": name,
            "pid": r.popen.pid,
            "start_ticks": r.start_ticks,
            "command": list(r.spec.command or ()),
            "note": "a process cannot be saved to disk: it is kept stopped in memory",
        }
        try:
            write_atomic(path, json.dumps(record, indent=1) + "\n")
        except OSError as e:
            raise HypervisorError(name, "save", f"{path}: {e}") from e
        self._saved[str(Path(path).resolve())] = self._live.pop(name)

    def restore(self, path: Path) -> str:
        try:
            record = json.loads(Path(path).read_text())
            name = str(record["name"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HypervisorError(str(path), "restore", f"not a process save record: {e}") from e
        r = self._saved.get(str(Path(path).resolve()))
        if r is None or r.popen.pid != record.get("pid"):
            raise HypervisorError(name, "restore", "the process of this record is not ours")
        if name in self._live:
            raise HypervisorError(name, "restore", "a replica of that name is running")
        self._alive(r, "restore")
        signal_group(r.popen.pid, signal.SIGCONT)
        self._wait_state(r, "restore", stopped=False)
        del self._saved[str(Path(path).resolve())]
        self._live[name] = r
        return name

    def discard(self, path: Path) -> None:
        """Terminate the stopped process a save record holds (if ours) and delete it."""
        r = self._saved.pop(str(Path(path).resolve()), None)
        if r is not None:
            self._terminate(r)
        Path(path).unlink(missing_ok=True)

    def set_memory(self, name: str, kib: int) -> None:
        r = self._get(name, "set_memory")
        self._alive(r, "set_memory")
        if not 0 < kib <= r.spec.memory_mib * 1024:
            raise HypervisorError(name, "set_memory", f"{kib} KiB outside 1..memory_mib")
        r.memory_kib = int(kib)

    def memory_kib(self, name: str) -> int:
        return self._get(name, "memory").memory_kib

    def destroy(self, name: str) -> None:
        r = self._get(name, "destroy")
        self._terminate(r)
        del self._live[name]

    def _terminate(self, r: _Replica) -> None:
        if r.popen.poll() is None:
            signal_group(r.popen.pid, signal.SIGTERM)
            signal_group(r.popen.pid, signal.SIGCONT)  # a stopped group never sees SIGTERM
        # kill_group: whatever the replica spawned into its group goes too.
        reap(r.popen, self.stop_timeout, kill_group=True)

    def state(self, name: str) -> str:
        r = self._get(name, "state")
        if r.popen.poll() is not None:
            return SHUTOFF
        return PAUSED if proc_state(r.popen.pid) == "T" else RUNNING

    def pid(self, name: str) -> int:
        """The replica's process (= process group) id."""
        return self._get(name, "pid").popen.pid

    def list(self) -> list[str]:
        return sorted(n for n, r in self._live.items() if r.popen.poll() is None)

    def close(self) -> None:
        """Terminate every process of this backend (they have no other supervisor)."""
        for r in [*self._live.values(), *self._saved.values()]:
            self._terminate(r)
        self._live.clear()
        self._saved.clear()

    # ---- sleeping replicas ----------------------------------------------------------------
    def hibernate(
        self,
        name: str,
        path: Path,
        balloon_mib: int | None = DEFAULT_BALLOON_MIB,
        timeout: float = 60.0,
    ) -> HibernateResult:
        """The balloon target is recorded, the process stopped (save): nothing is paged out."""
        r = self._get(name, "hibernate")
        t0 = time.monotonic()
        if balloon_mib is not None:
            self.set_memory(name, int(balloon_mib) * 1024)
        t1 = time.monotonic()
        self.save(name, path)
        t2 = time.monotonic()
        return HibernateResult(
            name=name, path=Path(path), full_kib=r.spec.memory_mib * 1024,
            balloon_kib=r.memory_kib if balloon_mib is not None else None, reached=True,
            sleep_s=0.0, balloon_s=t1 - t0, save_s=t2 - t1, file_bytes=Path(path).stat().st_size,
        )  # fmt: skip

    def wake_hibernated(self, path: Path, full_mib: int) -> str:
        name = self.restore(path)
        try:
            self.set_memory(name, int(full_mib) * 1024)
        except HypervisorError as e:
            raise HypervisorError(
                name,
                "wake_hibernated",
                f"restored, but growing to {full_mib} MiB failed: {e.detail}",
            ) from e
        return name

    def guest_call(self, name: str, op: str, timeout: float = 10.0, **args: Any) -> dict[str, Any]:
        action = f"guest {op}"
        r = self._get(name, action)
        ports = [h for h, g in r.spec.ports if g == GUEST_AGENT_PORT]
        if not ports:
            raise HypervisorError(name, action, f"no port paired with {GUEST_AGENT_PORT}")
        try:
            reply = guest_request(ports[0], {"op": op, **args}, timeout)
        except (OSError, ValueError) as e:
            raise HypervisorError(name, action, f"agent on 127.0.0.1:{ports[0]}: {e}") from e
        if reply.get("ok") is not True:
            raise HypervisorError(name, action, str(reply.get("error", reply)))
        return reply
