# controld/hypervisor.py - the one narrow interface controld drives replicas through, the
# replica spec, the project's hypervisor exception and open_backend(), the one place a
# backend (hv_libvirt.py, hv_process.py) is chosen. docs/design.md §8, docs/controld.md.
"""Hypervisor interface (in the shape of Redis' ae.c: one set of calls, a file per backend).

Every call is synchronous and short, one lifecycle action each; the daemon runs them with
`asyncio.to_thread` (libvirt blocks). A failure of any call raises HypervisorError naming
the domain and the action; an unknown domain raises its subclass DomainNotFound.

Life of a replica domain, the same in both backends:

    create(spec) -> running     suspend -> paused      resume -> running
    save(name, path) -> the domain is gone from list() until restore(path) -> running;
                        discard(path) drops a save that will never be restored
    set_memory(name, kib)       destroy(name) -> gone

Sleeping replicas, the convenience calls controld uses (each a sequence of the above):

    hibernate(name, path, balloon_mib=192)   guest agent "sleep" (stop the runtime, unmount
        the 9p share: QEMU refuses to save a guest with it mounted), balloon down to
        balloon_mib, wait until the guest got there (bounded), save. balloon_mib=None: a
        plain save of the whole memory. Returns a HibernateResult.
    wake_hibernated(path, full_mib) -> name  restore, then grow the balloon back to
        full_mib: the paged-out restore (ZZ §5.1).
    guest_call(name, op, **args) -> dict     one request to the guest agent
        (images/zz_guest.py) on the domain's forward of GUEST_AGENT_PORT: "ping",
        "wake" (seq=N: mount the share, tell the runtime it recovers from N, start it),
        "sleep", "mount".

state(name) is one of RUNNING, PAUSED, SHUTOFF, OTHER (libvirt's crashed, blocked, ...).
"""

from __future__ import annotations

import json
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

RUNNING = "running"
PAUSED = "paused"
SHUTOFF = "shutoff"
OTHER = "other"
STATES = (RUNNING, PAUSED, SHUTOFF, OTHER)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
GUEST_AGENT_PORT = 7000  # images/zz_guest.py listens here inside the guest
DEFAULT_BALLOON_MIB = 192  # docs/design.md §9: 192 MiB is safe, 128 MiB can lock the guest up
MAX_AGENT_REPLY = 1 << 20


class HypervisorError(Exception):
    """A lifecycle action on one domain failed; `detail` is the backend's own message."""

    def __init__(self, name: str, action: str, detail: str) -> None:
        super().__init__(f"{action} {name}: {detail}")
        self.name = name
        self.action = action
        self.detail = detail


class DomainNotFound(HypervisorError):
    """The backend has no domain of that name (never created, destroyed, or saved)."""


@dataclass(frozen=True)
class HibernateResult:
    """What hibernate() did. balloon_kib: the guest's memory when the save began (None:
    no balloon step); reached: it got to the target before the timeout (a guest that
    did not is saved anyway, only with a bigger file)."""

    name: str
    path: Path
    full_kib: int
    balloon_kib: int | None
    reached: bool
    sleep_s: float  # the guest agent's "sleep" (0 when the domain has no agent forward)
    balloon_s: float
    save_s: float
    file_bytes: int


def guest_request(port: int, request: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """One request to a guest agent on 127.0.0.1:port, its JSON reply. Raises OSError
    (also on a timeout or a connection closed early: slirp accepts and closes while the
    guest is not listening yet) or ValueError (a reply that is not a JSON object)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.settimeout(timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionResetError("the guest agent closed the connection")
            buf += chunk
            if len(buf) > MAX_AGENT_REPLY:
                raise ValueError(f"guest agent reply over {MAX_AGENT_REPLY} bytes")
    reply = json.loads(buf)
    if not isinstance(reply, dict):
        raise ValueError("guest agent reply is not a JSON object")
    return reply


@dataclass(frozen=True)
class ReplicaSpec:
    """What create() needs to start one replica.

    name       the domain name, unique on the host (letters, digits, _ . -; at most 64)
    run_dir    controld's own files of this replica: the console socket and log (libvirt),
               the process's log (process backend). Must exist.
    command    process backend: the argv run on the host (required). libvirt: the command
               the guest runs (None: the image's default, the guest agent images/zz_guest.py).
    image      libvirt on a real driver: the image directory made by images/build.py
               (vmlinuz + initrd.gz). Ignored by the process backend and test:///.
    memory_mib the guest's maximum memory; current_mib its balloon target at start (None:
               all of it). The process backend ignores both (a process has no balloon).
    ports      (host port on 127.0.0.1, guest port) pairs forwarded into the guest. A process
               listens on the host itself, so the process backend only records them.
    state_dir  the replica's state directory: shared into the guest as tag "state" (9p or
               virtiofs: `share`; mounted at /state), the working directory of a process.
    """

    name: str
    run_dir: Path
    command: tuple[str, ...] | None = None
    image: Path | None = None
    memory_mib: int = 512
    current_mib: int | None = None
    vcpus: int = 1
    ports: tuple[tuple[int, int], ...] = ()
    state_dir: Path | None = None
    # Guest ports forwarded from `public_address` (the host's address in the rack config)
    # rather than 127.0.0.1: the execution port, which clients and other hosts reach.
    public_address: str = "127.0.0.1"
    public_ports: tuple[int, ...] = ()
    # libvirt: how state_dir is shared, "9p" or "virtiofs" (docs/images.md "The state
    # share"; a virtiofs guest cannot be saved). The process backend ignores it.
    share: str = "9p"

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"replica name {self.name!r}: letters, digits, _ . - (<= 64)")
        if self.memory_mib <= 0 or self.vcpus <= 0:
            raise ValueError(f"{self.name}: memory_mib and vcpus must be positive")
        if self.current_mib is not None and not 0 < self.current_mib <= self.memory_mib:
            raise ValueError(f"{self.name}: current_mib must be in 1..memory_mib")
        if self.share not in ("9p", "virtiofs"):
            raise ValueError(f"{self.name}: share must be 9p or virtiofs, got {self.share!r}")
        for host, guest in self.ports:
            if not (0 < host < 65536 and 0 < guest < 65536):
                raise ValueError(f"{self.name}: port pair {(host, guest)} out of range")
        if self.command is not None and not self.command:
            raise ValueError(f"{self.name}: empty command")


@runtime_checkable
class Hypervisor(Protocol):
    """The calls controld makes; hv_libvirt.LibvirtHypervisor and hv_process.ProcessHypervisor
    implement them. `kind` names the backend ("libvirt", "process")."""

    kind: str

    def create(self, spec: ReplicaSpec) -> None: ...
    def suspend(self, name: str) -> None: ...
    def resume(self, name: str) -> None: ...
    def save(self, name: str, path: Path) -> None: ...
    def restore(self, path: Path) -> str: ...  # the restored domain's name
    def set_memory(self, name: str, kib: int) -> None: ...
    def memory_kib(self, name: str) -> int: ...  # current memory (balloon target)
    def destroy(self, name: str) -> None: ...
    def state(self, name: str) -> str: ...
    def list(self) -> list[str]: ...  # names of the running or paused domains
    def discard(self, path: Path) -> None: ...  # drop a save file (and what it holds)
    def close(self) -> None: ...
    def hibernate(
        self, name: str, path: Path, balloon_mib: int | None = DEFAULT_BALLOON_MIB,
        timeout: float = 60.0,
    ) -> HibernateResult: ...  # fmt: skip
    def wake_hibernated(self, path: Path, full_mib: int) -> str: ...
    def guest_call(
        self, name: str, op: str, timeout: float = 10.0, **args: Any
    ) -> dict[str, Any]: ...


BACKENDS = ("libvirt", "process")
# libvirt-python is the optional extra "libvirt" of pyproject.toml.
LIBVIRT_HINT = (
    "pip install 'zz[libvirt]' (it builds against the system's libvirt-dev;"
    " scripts/setup-virt.sh installs both)"
)


def open_backend(kind: str, **opts: Any) -> Hypervisor:
    """The one place a backend is chosen: kind "libvirt" (opts: uri, domain_type) or
    "process" (opts: env). Imports lazily so the process backend works without
    libvirt-python installed."""
    if kind == "libvirt":
        try:
            from zz.controld.hv_libvirt import LibvirtHypervisor
        except ModuleNotFoundError as e:
            if e.name != "libvirt":
                raise
            need = f"needs libvirt-python: {LIBVIRT_HINT}"
            raise HypervisorError("backend", "open libvirt", need) from e
        return LibvirtHypervisor(**opts)
    if kind == "process":
        from zz.controld.hv_process import ProcessHypervisor

        return ProcessHypervisor(**opts)
    raise ValueError(f"hypervisor backend {kind!r}: one of {', '.join(BACKENDS)}")
