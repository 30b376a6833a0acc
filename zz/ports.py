"""zz/ports.py - free loopback ports for racks, proxies and guests that scripts, benchmarks and
tests start on the fly: the one port picker (free_base for a range, free_port for one).

A service uses base+0..n-1 (agreement replicas) and base+64.. (execution replicas,
docs/config.md); a rack of several services strides them. A port counts as free when it
binds with SO_REUSEADDR (a TIME_WAIT leftover of an earlier run does not block it).

Ports are picked below the kernel's ephemeral range: a port that is free when picked but
inside that range can become the source port of any outgoing connection before the replica
or QEMU's hostfwd binds it (a CI run lost a VM drill that way)."""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Iterable

EXEC_OFFSET = 64  # Service.exec_address: base_port + 64 + i


def is_free(address: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port the kernel may hand out as a source port (32768 if unreadable)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def service_ports(base: int, n: int = 4, n_exec: int = 3) -> list[int]:
    return [*range(base, base + n), *range(base + EXEC_OFFSET, base + EXEC_OFFSET + n_exec)]


def free_base(
    offsets: Iterable[int] | None = None,
    addresses: Iterable[str] = ("127.0.0.1",),
    low: int = 10000,
    high: int | None = None,
    tries: int = 200,
) -> int:
    """A random base port such that base + every offset is free on every address (default
    offsets: one g = 1, f = 1 service, service_ports(0)) and below ``high`` (default: the
    ephemeral range)."""
    offs = list(offsets) if offsets is not None else service_ports(0)
    addrs = list(addresses)
    if high is None:
        high = max(ephemeral_low(), low + max(offs) + 1000)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(tries):
        base = rng.randrange(low, high - max(offs))
        if all(is_free(a, base + o) for a in addrs for o in offs):
            return base
    raise RuntimeError(f"no free port range on {', '.join(addrs)}")


def free_port(address: str = "127.0.0.1") -> int:
    """One free port on `address`, below the ephemeral range (a proxy's, a guest agent's
    forwarded port, a test server's)."""
    return free_base([0], [address])
