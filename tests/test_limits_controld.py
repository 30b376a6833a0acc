# tests/test_limits_controld.py - resource limits of controld's RPC listener (docs/security.md
# "Resource limits"): frames over max_frame close the connection at once, half-sent frames
# and connections that authenticate nothing are closed after their timeouts, connections
# over the per-source cap are accepted, closed and counted; the daemon keeps serving.
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from test_controld_daemon import OP, SVC, Node, make_rack

from zz import wire
from zz.controld.daemon import ConnLimits
from zz.controld.rpc import RACK_SERVICE, decode_json

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


async def test_rpc_refuses_non_finite_ages_and_deep_json(tmp_path: Path) -> None:
    """purge_forensics with older_than_s NaN (which purged every kept state: NaN makes
    every age comparison false), inf or < 0 is refused naming the field, and the state
    stays; a CONTROL whose JSON nests 100,000 deep (RecursionError in json.loads: no
    reply at all) gets a clear error and is counted; the daemon keeps serving."""
    rack = make_rack(tmp_path)
    kept = rack.config.rack.run_dir / f"s{SVC}" / "exec-1.forensic-7"
    kept.mkdir(parents=True)
    n = Node(rack, 0, "libvirt", limits=LIMITS)
    await n.start()
    try:
        for age in (float("nan"), float("inf"), -1, "3600"):
            r = await asyncio.wait_for(n.rpc("purge_forensics", older_than_s=age), 10)
            assert not r["ok"] and r["error"].startswith("older_than_s:"), r
        assert kept.is_dir()
        key = rack.op_keys[n.principal]
        deep = b'{"op":"status","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        msg = wire.Control(RACK_SERVICE, OP, time.time_ns(), deep).with_macs({n.principal: key})
        r_, w = await asyncio.open_connection("127.0.0.1", n.port)
        try:
            w.write(wire.frame(msg.encode()))
            await w.drain()
            reply = wire.decode(await asyncio.wait_for(wire.read_frame(r_), 10))
        finally:
            w.close()
        assert isinstance(reply, wire.ControlReply) and reply.verify_mac(OP, key)
        body = decode_json(reply.json)
        assert not body["ok"] and "nested 100001 deep" in body["error"], body
        c = n.daemon.counters
        assert c["control_json_too_deep"] == 1 and c["internal_error"] == 0
        assert (await n.rpc("status"))["ok"]
    finally:
        await n.close()
