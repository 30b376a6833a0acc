# zz/drill/load.py - the honest load a drill runs around its fault: recording kv clients
# (zz/history.py) or keep-alive HTTP connections to a guestbook behind zz proxy (--http).
"""Drill load (docs/operations.md, "Drills"): what the verdicts measure throughput, latency
and linearizability on. zz/campaign.py runs the same kv load."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from zz import history as zh
from zz.client import Client, ClientParams, ClientTimeout
from zz.config import Config, Service
from zz.drill.rack import DrillError

KEYS_PER_DRILL = 4
# Above zz proxy's 30 s in main.sh: in TCG guests the first reply after a fault can take
# ~10 s, and a client that gives up earlier only retries.
HTTP_TIMEOUT_S = 35.0


@dataclass
class Load:
    recorders: dict[str, zh.HistoryRecorder]
    tally: Counter[str]
    stop: asyncio.Event
    tasks: list[asyncio.Task[None]]
    # HTTP load (--http): (call, return or None, ok) in monotonic ns, and POST message ->
    # the entry id it was acknowledged with.
    http: list[tuple[int, int | None, bool]] = field(default_factory=list)
    acked: dict[str, int] = field(default_factory=dict)
    # kv load: workers start an op only while `gate` is set; `inflight` counts started ops.
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    inflight: Counter[str] = field(default_factory=Counter)


def first_client(s: Service, first: int | None) -> int:
    """The first honest client principal (--first-client, default clients - 16); the
    faulty clients of a drill take the principals right after the honest ones."""
    return first if first is not None else max(0, s.clients - 16)


# ---- kv load ------------------------------------------------------------------------------
async def _worker(
    client: Client, rec: zh.HistoryRecorder, seed: int, load: Load, keys: list[bytes]
) -> None:
    rng = random.Random(seed)
    kc = rec.client(client, timeout=8.0)
    seen: dict[bytes, bytes | None] = {}
    n = 0
    stop, tally = load.stop, load.tally
    try:
        while not stop.is_set():
            if not load.gate.is_set():
                await load.gate.wait()
                continue
            key = rng.choice(keys)
            n += 1
            value = b"s%d-%d" % (seed, n)
            r = rng.random()
            load.inflight["kv"] += 1
            try:
                if r < 0.4:
                    reply = await kc.get(key)
                    seen[key] = reply.value if reply.ok else None
                elif r < 0.8:
                    await kc.put(key, value)
                else:
                    await kc.cas(key, seen.get(key), value)
                tally["ok"] += 1
            except ClientTimeout:
                tally["timeouts"] += 1
            finally:
                load.inflight["kv"] -= 1
    finally:
        await client.close()


def start_load(config: Config, services: list[Service], clients: int, first: int | None) -> Load:
    """`clients` recording kv clients per service. Keys are fresh per drill (the store
    keeps earlier drills' keys, and the checker assumes every key starts absent)."""
    stamp = b"%x" % time.time_ns()
    keys = [b"d%s-k%d" % (stamp, k) for k in range(KEYS_PER_DRILL)]
    load = Load({}, Counter(), asyncio.Event(), [])
    load.gate.set()
    for s in services:
        base = first_client(s, first)
        if base + clients > s.clients:
            raise DrillError(f"{s.name}: clients {base}..{base + clients - 1} exceed {s.clients}")
        rec = load.recorders[s.name] = zh.HistoryRecorder()
        for i in range(clients):
            c = Client(ClientParams.from_config(config, s.name, base + i))
            load.tasks.append(asyncio.create_task(_worker(c, rec, s.id * 1000 + i, load, keys)))
    return load


async def stop_load(load: Load) -> None:
    """Stop the workers: each finishes its current op (<= 8 s timeout) and closes its
    client; what is still running after 15 s is cancelled."""
    load.stop.set()
    load.gate.set()
    await asyncio.wait(load.tasks, timeout=15)
    for t in load.tasks:
        t.cancel()
    await asyncio.gather(*load.tasks, return_exceptions=True)


# ---- HTTP load on a guestbook behind zz proxy (--http URL) --------------------------------
async def _http(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    method: str,
    target: str,
    body: bytes | None = None,
) -> tuple[int, bytes, bool]:
    """One HTTP/1.1 request on a keep-alive connection: (status, body, server closes)."""
    head = f"{method} {target} HTTP/1.1\r\nHost: zz\r\n"
    if body is not None:
        head += "Content-Type: application/x-www-form-urlencoded\r\n"
        head += f"Content-Length: {len(body)}\r\n"
    writer.write(head.encode() + b"\r\n" + (body or b""))
    await writer.drain()
    parts = (await reader.readline()).split()
    if len(parts) < 2 or not parts[1].isdigit():
        raise ConnectionError(f"bad status line {b' '.join(parts)[:80]!r}")
    length, close = 0, False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"connection" and b"close" in value.lower():
            close = True
    return int(parts[1]), await reader.readexactly(length), close


def _http_addr(url: str) -> tuple[str, int]:
    m = re.fullmatch(r"http://([^/:]+):(\d+)/?", url)
    if not m:
        raise DrillError(f"--http {url!r}: expected http://HOST:PORT/")
    return m.group(1), int(m.group(2))


async def _http_worker(url: str, w: int, load: Load, stamp: str) -> None:
    """POST / a new guestbook entry, every 10th request GET /entries.json; one request at
    a time on one keep-alive connection, reconnecting after an error."""
    host, port = _http_addr(url)
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    k = 0
    try:
        while not load.stop.is_set():
            is_get = k % 10 == 9
            msg = f"drill {stamp} w{w} #{k}"
            call = time.monotonic_ns()
            try:
                async with asyncio.timeout(HTTP_TIMEOUT_S):
                    if conn is None:
                        conn = await asyncio.open_connection(host, port)
                    if is_get:
                        status, body, close = await _http(*conn, "GET", "/entries.json")
                    else:
                        form = f"name=drill&message={quote(msg)}".encode()
                        status, body, close = await _http(*conn, "POST", "/", form)
            except (OSError, EOFError, TimeoutError, ValueError, asyncio.IncompleteReadError):
                load.http.append((call, None, False))
                load.tally["http_errors"] += 1
                if conn is not None:
                    conn[1].close()
                conn = None
                # The next attempt is a new entry: the one that timed out may still be
                # executed, and must then not count as a duplicate of an acknowledged one.
                k += 1
                await asyncio.sleep(0.1)
                continue
            m = re.match(rb"added entry (\d+)", body)
            ok = status == 200 if is_get else (status == 303 and m is not None)
            load.http.append((call, time.monotonic_ns(), ok))
            load.tally["ok" if ok else f"http_{status}"] += 1
            if ok and not is_get and m is not None:
                load.acked[msg] = int(m.group(1))
            if close and conn is not None:
                conn[1].close()
                conn = None
            k += 1
    finally:
        if conn is not None:
            conn[1].close()


def start_http_load(url: str, clients: int) -> Load:
    load = Load({}, Counter(), asyncio.Event(), [])
    stamp = f"{time.time_ns():x}"
    load.tasks = [asyncio.create_task(_http_worker(url, w, load, stamp)) for w in range(clients)]
    return load


async def entries(url: str) -> list[dict[str, Any]]:
    """The guestbook's final /entries.json."""
    host, port = _http_addr(url)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        async with asyncio.timeout(30.0):
            status, body, _ = await _http(reader, writer, "GET", "/entries.json")
    finally:
        writer.close()
    if status != 200:
        raise DrillError(f"GET /entries.json: HTTP {status}")
    data = json.loads(body)
    return data if isinstance(data, list) else []
