# tests/netns.py - hosts as network namespaces (issue 20 item 3): four hosts, an operator and a
# bridge, each a network namespace of its own, joined by veth pairs; addresses in
# 198.18.0.0/15 that exist only inside them. Created and torn down by the test that uses it.
"""Network namespaces standing in for the machines of a rack (docs/operations.md "Four real
hosts", whose steps tests/test_netns_rack.py follows).

    <tag>-h0 .. <tag>-h3   the hosts: eth0 198.18.0.1 .. 198.18.0.4/24, lo
    <tag>-op               the operator's machine: eth0 198.18.0.100/24, lo
    <tag>-br               the switch: bridge br0, and the other end of every host's and
                           the operator's veth pair, named after it (h0 .. h3, op)

`<tag>` is `zzt<pid><hex>`, unique per run. Nothing is created in the machine's own
namespace: each veth pair is made inside its host's namespace with its peer put straight
into the bridge's, no namespace has a default route, and 198.18.0.0/15 (RFC 2544's
benchmarking range) is routed nowhere else, so no packet leaves the machine.
`ip link set <host> down` in the bridge's namespace cuts a host off as a pulled cable does
(the host keeps its address and still reaches itself).

A machine's commands run in its network namespace only (`nsenter --net`, not `ip netns
exec`, which would also give each a private mount namespace: the datasets zfs-fuse mounts
afterwards would not show in it). Every process the test starts in a namespace goes
through `Namespaces.start` (its own session, recorded); `close()` ends them by their
process groups, then anything left in the namespaces (`ip netns pids`), then deletes the
namespaces. A run killed before its
teardown leaves namespaces named after its dead pid: `sweep_dead_runs` deletes them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

NET = "198.18.0"
OPERATOR = "op"
BRIDGE = "br"
_TAG = re.compile(r"zzt(\d+)[0-9a-f]{4}-(?:h\d+|op|br)")


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if shutil.which("nsenter") is None:
        return "no `nsenter` command (util-linux)"
    try:
        subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return f"`ip netns` does not work here: {e}"
    return None


def ip(*args: str, timeout: float = 30.0) -> str:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")
    return p.stdout


def _namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def _running(pid: int) -> bool:
    """`pid` has not exited yet (a zombie has: it holds no directory or file any more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _kill_inside(ns: str, timeout: float = 30.0) -> list[int]:
    """SIGKILL everything still in `ns` and wait until it has exited: a process killed a
    moment ago may still have its cwd or open files in a dataset, and the pool's destroy
    then fails as busy. Returns the pids still running after `timeout` (none expected)."""
    pids = []
    with contextlib.suppress(RuntimeError):
        for pid in ip("netns", "pids", ns).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
                pids.append(int(pid))
    deadline = time.monotonic() + timeout
    while (pids := [p for p in pids if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def sweep_dead_runs() -> list[str]:
    """Delete the namespaces of test runs that died before their teardown (the pid in the
    name is gone), with whatever still runs in them."""
    gone = []
    for ns in _namespaces():
        m = _TAG.fullmatch(ns)
        if m is None or Path(f"/proc/{m.group(1)}").exists():
            continue
        _kill_inside(ns)
        with contextlib.suppress(RuntimeError):
            ip("netns", "del", ns)
        gone.append(ns)
    return gone


class Namespaces:
    """The hosts, the operator and the bridge of one test run (see the module's doc)."""

    def __init__(self, hosts: Sequence[str]) -> None:
        self.tag = f"zzt{os.getpid()}{uuid.uuid4().hex[:4]}"
        self.hosts = list(hosts)
        self.made: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stuck: dict[str, list[int]] = {}  # close(): what SIGKILL did not end

    def ns(self, machine: str) -> str:
        return f"{self.tag}-{machine}"

    def address(self, machine: str) -> str:
        return f"{NET}.{100 if machine == OPERATOR else self.hosts.index(machine) + 1}"

    def create(self) -> Namespaces:
        """Make every namespace, the bridge and the links; addresses, loopback up, no
        default route anywhere."""
        for m in [BRIDGE, OPERATOR, *self.hosts]:
            ip("netns", "add", self.ns(m))
            self.made.append(self.ns(m))
            ip("-n", self.ns(m), "link", "set", "lo", "up")
        br = self.ns(BRIDGE)
        ip("-n", br, "link", "add", "br0", "type", "bridge")
        ip("-n", br, "link", "set", "br0", "up")
        for m in [OPERATOR, *self.hosts]:
            ns = self.ns(m)
            # Made inside the host's namespace, its peer straight into the bridge's.
            ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", m, "netns", br)
            ip("-n", ns, "addr", "add", f"{self.address(m)}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", br, "link", "set", m, "master", "br0")
            ip("-n", br, "link", "set", m, "up")
        return self

    def link(self, machine: str, up: bool) -> None:
        """Plug or pull `machine`'s cable: its port on the bridge up or down."""
        ip("-n", self.ns(BRIDGE), "link", "set", machine, "up" if up else "down")

    def exec_argv(self, machine: str, argv: Sequence[str]) -> list[str]:
        """`argv` run in `machine`'s network namespace and nothing else. Not `ip netns exec`:
        that also gives the command a mount namespace of its own (to remount /sys), a
        private copy where the machine's / is private (no systemd, before
        scripts/setup-zfs.sh made it shared), so the datasets zfs-fuse mounts later (a
        runtime's state, controld's clones) would not show in it. A real host has one mount
        namespace; nsenter --net keeps the machine's."""
        return ["nsenter", f"--net=/run/netns/{self.ns(machine)}", "--", *argv]

    def run(
        self, machine: str, argv: Sequence[str], timeout: float = 300.0, **kw: object
    ) -> subprocess.CompletedProcess[str]:
        """`argv` in `machine`'s namespace, to the end; its output captured (text)."""
        return subprocess.run(  # type: ignore[call-overload, no-any-return]
            self.exec_argv(machine, argv), capture_output=True, text=True, timeout=timeout,
            check=False, **kw,
        )  # fmt: skip

    def start(
        self, machine: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """`argv` in `machine`'s namespace in the background (its own session, recorded,
        ended by close()); output to `log`."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            p = subprocess.Popen(
                self.exec_argv(machine, argv), stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True, env=env,
            )  # fmt: skip
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes], timeout: float = 30.0) -> int | None:
        """SIGTERM to `p`'s process group, SIGKILL after `timeout`; its exit status."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            return p.wait(10)

    def default_routes(self) -> dict[str, str]:
        """Any default route in any of our namespaces (there must be none)."""
        out = {}
        for ns in self.made:
            routes = ip("-n", ns, "route", "show", "default").strip()
            if routes:
                out[ns] = routes
        return out

    def close(self) -> None:
        """Every process started here (its group: SIGTERM, SIGKILL after 20 s), anything
        else still in the namespaces (SIGKILL, waited for until it has exited; `stuck`
        names what had not after 30 s), then the namespaces (their links go with them)."""
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)
        self.stuck = {ns: pids for ns in self.made if (pids := _kill_inside(ns))}
        for ns in reversed(self.made):
            with contextlib.suppress(RuntimeError):
                ip("netns", "del", ns)
        self.made = [ns for ns in self.made if ns in _namespaces()]


def outside_traces(tag: str) -> list[str]:
    """What of the run shows in the machine's own namespace: an interface named after one
    of its links, or an address or route in 198.18.0.0/15 (there must be none)."""
    out = []
    for line in ip("-o", "link", "show").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if re.fullmatch(r"h\d+|op", name):
            out.append(f"link {name}")
    for line in ip("-o", "addr", "show").splitlines() + ip("route", "show").splitlines():
        if re.search(r"\b198\.1[89]\.", line):
            out.append(line.strip())
    if any(ns.startswith(tag) for ns in _namespaces()):
        out.append(f"namespaces {tag}-*")
    return out
