# tests/test_limits_controld.py - resource limits of controld's RPC listener (docs/security.md
# "Resource limits"): frames over max_frame close the connection at once, half-sent frames
# and connections that authenticate nothing are closed after their timeouts, connections
# over the per-source cap are accepted, closed and counted; the daemon keeps serving.
from __future__ import annotations

import asyncio
from pathlib import Path

from test_controld_daemon import Node, make_rack
from zz.controld.daemon import ConnLimits

LIMITS = ConnLimits(
    max_conns=256, max_conns_per_source=20, max_frame=1 << 20, frame_timeout=1.0,
    unauth_timeout=1.5,
)  # fmt: skip


async def closed(reader: asyncio.StreamReader, timeout: float) -> bool:
    """True once controld closed the connection within `timeout`."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(4096):
                pass
        return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False


async def test_rpc_listener_limits(tmp_path: Path) -> None:
    n = Node(make_rack(tmp_path), 0, "libvirt", limits=LIMITS)
    await n.start()
    writers: list[asyncio.StreamWriter] = []
    try:
        # 1) Announcing 16 MiB (the format's limit, 16x controld's): closed at once.
        big = []
        for _ in range(10):
            r, w = await asyncio.open_connection("127.0.0.1", n.port)
            w.write((16 << 20).to_bytes(4, "big") + bytes(1024))
            writers.append(w)
            big.append(r)
        assert all(await asyncio.gather(*(closed(r, 5) for r in big))), "16 MiB frames held"
        assert n.counters()["framing"] >= 10
        # 2) Half-sent frames within the limit, and idle connections: closed by timeout.
        slow = []
        for i in range(10):
            r, w = await asyncio.open_connection("127.0.0.1", n.port)
            if i % 2 == 0:
                w.write((512 << 10).to_bytes(4, "big") + bytes(1024))
            writers.append(w)
            slow.append(r)
        # 3) Over the per-source cap (20, 10 still open): 15 more, at least 5 refused.
        extra = []
        for _ in range(15):
            r, w = await asyncio.open_connection("127.0.0.1", n.port)
            writers.append(w)
            extra.append(r)
        await asyncio.sleep(0.2)
        assert n.counters()["conns_refused"] >= 5
        assert n.counters()["conns_refused_source"] >= 5
        assert all(await asyncio.gather(*(closed(r, 15) for r in slow + extra)))
        c = n.counters()
        assert c["unauth_timeouts"] + c["frame_timeouts"] >= 10 + 15 - c["conns_refused"]
        # 4) An operator is still served.
        st = await n.rpc("status")
        assert st["ok"]
    finally:
        for w in writers:
            w.close()
        await n.close()
