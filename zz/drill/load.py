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
from zz.execution.apps.guestbook import MAX_LIMIT as GUESTBOOK_MAX_LIMIT
from zz.http import CLIENT_ERRORS, ClientConnection

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
async def kv_step(
    kc: zh.RecordingKvClient,
    rng: random.Random,
    key: bytes,
    value: bytes,
    seen: dict[bytes, bytes | None],
) -> None:
    """One recorded operation of the mixed load: 40% get, 40% put, 20% cas from the value
    this client last read (so some succeed and some fail); raises ClientTimeout."""
    r = rng.random()
    if r < 0.4:
        reply = await kc.get(key)
        seen[key] = reply.value if reply.ok else None
    elif r < 0.8:
        await kc.put(key, value)
    else:
        await kc.cas(key, seen.get(key), value)


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
            load.inflight["kv"] += 1
            try:
                await kv_step(kc, rng, key, value, seen)
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
def _http_addr(url: str) -> tuple[str, int]:
    m = re.fullmatch(r"http://([^/:]+):(\d+)/?", url)
    if not m:
        raise DrillError(f"--http {url!r}: expected http://HOST:PORT/")
    return m.group(1), int(m.group(2))


async def guestbook_request(
    conn: ClientConnection, is_get: bool, name: str, message: str
) -> tuple[int, bytes, int | None]:
    """One request of a guestbook load: GET /entries.json, or POST / a new entry. The
    status, the body and, for a POST acknowledged (303 "added entry N"), N."""
    if is_get:
        status, body = await conn.request("GET", "/entries.json")
        return status, body, None
    form = f"name={quote(name)}&message={quote(message)}".encode()
    status, body = await conn.request("POST", "/", form)
    m = re.match(rb"added entry (\d+)", body)
    return status, body, int(m.group(1)) if status == 303 and m else None


async def _http_worker(url: str, w: int, load: Load, stamp: str) -> None:
    """POST / a new guestbook entry, every 10th request GET /entries.json; one request at
    a time on one keep-alive connection, reconnecting after an error."""
    conn = ClientConnection(*_http_addr(url))
    k = 0
    try:
        while not load.stop.is_set():
            is_get = k % 10 == 9
            msg = f"drill {stamp} w{w} #{k}"
            call = time.monotonic_ns()
            k += 1  # after an error too: the next attempt is a new entry
            try:
                async with asyncio.timeout(HTTP_TIMEOUT_S):
                    status, _, entry = await guestbook_request(conn, is_get, "drill", msg)
            except CLIENT_ERRORS:
                # The one that timed out may still be executed, and must then not count
                # as a duplicate of an acknowledged one.
                load.http.append((call, None, False))
                load.tally["http_errors"] += 1
                await asyncio.sleep(0.1)
                continue
            ok = status == 200 if is_get else entry is not None
            load.http.append((call, time.monotonic_ns(), ok))
            load.tally["ok" if ok else f"http_{status}"] += 1
            if entry is not None:
                load.acked[msg] = entry
    finally:
        conn.close()


def start_http_load(url: str, clients: int) -> Load:
    load = Load({}, Counter(), asyncio.Event(), [])
    stamp = f"{time.time_ns():x}"
    load.tasks = [asyncio.create_task(_http_worker(url, w, load, stamp)) for w in range(clients)]
    return load


async def entries(url: str, since: int = 1) -> list[dict[str, Any]]:
    """Every entry of the guestbook at URL, oldest first: /entries.json page by page, each
    page the MAX_LIMIT entries before the oldest id of the previous one (what its `Link:
    rel="next"` names), until a page is short or reaches entry `since` (default 1: all;
    the first page holding entry `since` is returned whole)."""
    conn = ClientConnection(*_http_addr(url))
    pages: list[list[dict[str, Any]]] = []
    before: int | None = None
    try:
        async with asyncio.timeout(60.0):
            while True:
                target = f"/entries.json?limit={GUESTBOOK_MAX_LIMIT}"
                if before is not None:
                    target += f"&before={before}"
                status, body = await conn.request("GET", target)
                if status != 200:
                    raise DrillError(f"GET {target}: HTTP {status}")
                page = json.loads(body)
                if not isinstance(page, list):
                    raise DrillError(f"GET {target}: not a JSON array")
                if not page:
                    break
                oldest = int(page[0].get("id", 0))
                if before is not None and oldest >= before:
                    raise DrillError(f"GET {target}: entry {oldest} is not before {before}")
                pages.append(page)
                if len(page) < GUESTBOOK_MAX_LIMIT or oldest <= max(since, 1):
                    break
                before = oldest
    finally:
        conn.close()
    return [e for page in reversed(pages) for e in page]


def check_acked_posts(
    acked: dict[str, int], final: list[dict[str, Any]], since: int = 1
) -> tuple[list[str], list[str]]:
    """The guestbook's write check: every acknowledged POST (message -> the N of its 303
    "added entry N") must be in `final` (/entries.json) exactly once, as entry N. Only
    those acknowledged as entry `since` or later are checked (`final` may start there).
    Returns (lost, moved): the messages missing, and those there twice or under another
    id."""
    by_msg: dict[str, list[int]] = {}
    for e in final:
        by_msg.setdefault(str(e.get("message")), []).append(int(e.get("id", -1)))
    mine = {m: i for m, i in acked.items() if i >= since}
    lost = [m for m in mine if m not in by_msg]
    moved = [m for m, i in mine.items() if by_msg.get(m) not in (None, [i])]
    return lost, moved
