# tests/test_limits_conns.py - resource limits of zz-agreed's listener (docs/security.md
# "Resource limits"): read buffers grow with the bytes that arrived, not with the length a
# frame announces; half-sent frames and connections that never authenticate are closed
# after their timeouts; connections over the per-source cap are accepted, closed and counted.
from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

from cluster import running_cluster

MIB = 1 << 20
ANNOUNCED = 16 * MIB  # the largest frame the format admits
SENT = 256 << 10  # bytes of it each connection really sends
N_PARTIAL = 40


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def partial_frame(sock: socket.socket) -> None:
    sock.sendall(ANNOUNCED.to_bytes(4, "big") + b"\x5a\x5a\x01\x01" + bytes(SENT - 4))


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True once the replica closed the connection (EOF or reset) within `timeout`."""
    sock.settimeout(timeout)
    try:
        while True:
            if sock.recv(4096) == b"":
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def limits(c: object, r: int) -> dict[str, int]:
    st = c.stats(r)  # type: ignore[attr-defined]
    assert "limits" in st, f"replica {r} reports no resource limits: {sorted(st)}"
    return st["limits"]  # type: ignore[no-any-return]


def test_partial_frames_idle_and_over_cap(tmp_path: Path) -> None:
    overrides = {
        "frame_timeout_ms": 1500,
        "unauth_timeout_ms": 2500,
        "max_conns_per_source": 48,
        "max_conns": 1024,
    }
    socks: list[socket.socket] = []
    with running_cluster(tmp_path, clients=4, overrides=overrides) as c:
        try:
            pid = c.procs[0].pid
            time.sleep(0.5)
            base = rss_kib(pid)
            # 1) Partial frames: each announces 16 MiB and sends 256 KiB of it.
            partial = []
            for _ in range(N_PARTIAL):
                s = socket.create_connection(("127.0.0.1", c.port(0)), timeout=5)
                partial_frame(s)
                partial.append(s)
            socks += partial
            time.sleep(0.5)
            grown_mib = (rss_kib(pid) - base) / 1024
            # What arrived is 10 MiB; the announced total is 640 MiB. Buffers double with
            # the bytes that arrived, so twice that plus slack bounds the growth.
            assert grown_mib < 2 * N_PARTIAL * SENT / MIB + 16, f"RSS grew {grown_mib:.0f} MiB"
            # 2) Over the per-source cap (48; the 40 partial ones and up to 3 peer links
            # already count): the rest are accepted and closed at once.
            addr = ("127.0.0.1", c.port(0))
            extra = [socket.create_connection(addr, timeout=5) for _ in range(20)]
            socks += extra
            refused = sum(closed_by_peer(s, 1.0) for s in extra[-10:])
            assert refused == 10
            # 3) Every partial frame is closed after frame_timeout_ms; the accepted idle
            # ones after unauth_timeout_ms (they never authenticate anything).
            assert all(closed_by_peer(s, 15) for s in partial), "half-sent frames kept open"
            assert all(closed_by_peer(s, 15) for s in extra), "idle connections kept open"
            lim = limits(c, 0)
            assert lim["frame_timeouts"] >= N_PARTIAL
            assert lim["unauth_timeouts"] >= 1
            assert lim["conns_refused_source"] >= 10 and lim["conns_refused"] >= 10
            c.wait_for(lambda: limits(c, 0)["in_buffer_bytes"] < MIB, 10, "buffers given back")
            # 4) The replica still serves an honest client.
            async def one() -> bytes:
                async with c.client(1) as cl:
                    return await cl.invoke(b"still here", timeout=15)

            assert asyncio.run(one()) == b"still here"
        finally:
            for s in socks:
                s.close()
