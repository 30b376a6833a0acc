# zz/drill/client_faults.py - the drill kinds whose fault is not an execution replica's: the
# agreement primary killed, and three faulty clients (flood, slow reader, MAC split).
"""Drill kinds with no execution fault (docs/operations.md, "Drills"): nothing may be
detected, no spare woken, and honest clients go on within bounds."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections import Counter
from typing import Any, ClassVar

from zz import kvop, wire
from zz import report as rp
from zz.client import Client, ClientParams, ClientTimeout
from zz.drill.kind import PRIMARY_KEYS, DrillKind
from zz.drill.load import first_client
from zz.drill.observe import Observer, sleeping
from zz.drill.rack import DrillError

# slow-reader: a client that never reads its replies, on SLOW_CONNS connections to every
# agreement replica, sending read-only requests of SLOW_OP bytes (each echoed back in a
# reply of that size) at SLOW_RATE bytes/s per replica. The verdict's bounds, against the
# quiet seconds before the fault: honest throughput at least SLOW_MIN_THROUGHPUT of it, p99
# latency at most SLOW_MAX_P99 times it (or SLOW_P99_FLOOR_MS, whichever is more), and no
# agreement replica's RSS more than SLOW_MAX_RSS_MIB above where it was.
SLOW_CONNS = 3
SLOW_OP = 256 << 10
SLOW_RATE = 8 << 20
SLOW_MIN_THROUGHPUT = 0.5
SLOW_MAX_P99 = 3.0
SLOW_P99_FLOOR_MS = 250.0
SLOW_MAX_RSS_MIB = 32.0
# mac-split: a client whose requests authenticate at the backups but not at the primary
# (its MAC entry for the current primary is garbage), MAC_SPLIT_RATE new ones a second to
# every agreement replica, every other one also as a signed copy with a wrong signature.
# Before signed requests each such request made the backups suspect a correct primary
# (22 view changes in 30 s). Bounds: no view change at all, and honest throughput and p99
# as for slow-reader (SLOW_MIN_THROUGHPUT, SLOW_MAX_P99, SLOW_P99_FLOOR_MS).
MAC_SPLIT_RATE = 50.0


class Primary(DrillKind):
    """SIGKILL of the agreement primary (`view % n`): survivors all in a later view, the
    service resumes, nobody woken."""

    name = "primary"
    detect_keys = PRIMARY_KEYS
    wakeup_before_fault_fails = False

    async def inject(self, obs: Observer) -> int | None:
        d = self.drill
        s = d.service
        views = [x.get("view", 0) for x in obs.agreed_of(s).values()]
        view = max(views) if views else 0
        killed = d.rack.kill_agreed(s, view % s.n)
        d.details["view_before"] = view
        d.details["killed"] = killed
        d.faulted.append(killed)
        return None

    def judge(self, r: rp.DrillReport, obs: Observer) -> None:
        d = self.drill
        v0 = d.details.get("view_before", 0)
        views = {n: x.get("view") for n, x in obs.agreed_of(d.service).items()
                 if n != d.details["killed"]}  # fmt: skip
        if not views or min(v or 0 for v in views.values()) <= v0:
            d.reasons.append(f"survivors did not all move past view {v0}: {views}")
        if r.detection_s is None:
            d.reasons.append("no view change observed in the agreement replicas' stats")
        d.notes.append("stats files are rewritten every status period: detection time"
                       " resolution is that period")  # fmt: skip
        if r.details["controld_deltas"]["woken"]:
            d.reasons.append("a sleeping execution replica was woken by a primary crash")
        self.need_progress(r)


class ClientFault(DrillKind):
    """A faulty client (the principal right after the honest load's clients) running from
    the fault to the end of the load: no detection, wake-up or conviction may follow."""

    # The details key of the client's send counters: a Counter, or a dict holding one
    # under "sent".
    sent_key: ClassVar[str]

    def faulty_client(self, role: str) -> tuple[int, ClientParams]:
        """The faulty client's index and parameters."""
        d = self.drill
        s = d.service
        idx = first_client(s, d.args.first_client) + d.args.clients
        if idx >= s.clients:
            raise DrillError(f"{s.name}: no client principal {idx} for {role}")
        return idx, ClientParams.from_config(d.config, s.name, idx)

    def report_details(self, details: dict[str, Any]) -> None:
        sent = details.get(self.sent_key)
        if isinstance(sent, Counter):
            details[self.sent_key] = dict(sent)
        elif isinstance(sent, dict) and "sent" in sent:
            sent["sent"] = dict(sent["sent"])

    def judge(self, r: rp.DrillReport, obs: Observer) -> None:
        """No WAKEUP accepted, no replica woken, the spares asleep before still asleep,
        and the service went on."""
        d = self.drill
        s = d.service
        deltas = r.details["controld_deltas"]
        if deltas["wakeup_accepted"] or deltas["woken"]:
            d.reasons.append(f"a faulty client caused a wake-up: {deltas}")
        before = d.spares_at_start.get(s.name, [])
        after = sleeping(obs).get(s.name, [])
        if not before:
            d.reasons.append("no sleeping spare at the start: nothing could show a wake-up")
        if set(before) - set(after):
            d.reasons.append(f"spares asleep before the flood: {before}, after: {after}")
        asleep = [f"{s.name}/exec-{i}" for i in after]
        r.detection_s = None
        d.notes.append(f"{self.name}: no detection, wake-up or conviction may happen;"
                       f" spares after the drill: {', '.join(asleep) or 'none'}")  # fmt: skip
        self.need_progress(r)

    def honest_windows(
        self, r: rp.DrillReport, what: str
    ) -> tuple[dict[str, float | None], dict[str, float | None], dict[str, float]]:
        """Honest clients' throughput and latency during the attack against the quiet
        `--before` seconds, checked against SLOW_MIN_THROUGHPUT and SLOW_MAX_P99 /
        SLOW_P99_FLOOR_MS (kept as details["honest"]); returns quiet, attack, bound."""
        d = self.drill

        def window(lo: float, hi: float) -> dict[str, float | None]:
            done = [x for x in d.samples if x.ret is not None and lo <= x.ret < hi]
            lat = sorted((x.ret - x.call) * 1000 for x in done if x.ret is not None)

            def pct(q: float) -> float | None:
                return round(lat[min(len(lat) - 1, int(q * len(lat)))], 1) if lat else None

            return {"ops_per_s": round(len(done) / (hi - lo), 1), "p50_ms": pct(0.5),
                    "p99_ms": pct(0.99)}  # fmt: skip

        quiet = window(-d.args.before, 0.0)
        attack = window(0.0, d.watched_s)
        bound = {
            "min_ops_per_s": SLOW_MIN_THROUGHPUT * (quiet["ops_per_s"] or 0.0),
            "max_p99_ms": max(SLOW_MAX_P99 * (quiet["p99_ms"] or 0.0), SLOW_P99_FLOOR_MS),
        }
        r.details["honest"] = {"quiet": quiet, "attack": attack, "bound": bound}
        if (attack["ops_per_s"] or 0.0) < bound["min_ops_per_s"]:
            d.reasons.append(
                f"honest throughput {attack['ops_per_s']:.0f} ops/s under the {what}, below"
                f" {SLOW_MIN_THROUGHPUT:.0%} of the quiet {quiet['ops_per_s']:.0f} ops/s"
            )
        p99 = attack["p99_ms"]
        if p99 is None or p99 > bound["max_p99_ms"]:
            d.reasons.append(
                f"honest p99 latency {p99} ms under the {what}, above"
                f" {bound['max_p99_ms']:.0f} ms (quiet p99 {quiet['p99_ms']})"
            )
        return quiet, attack, bound


class ClientFlood(ClientFault):
    """A Byzantine client resending its own and old requests (and requests with garbage
    MACs) to every agreement and execution replica every ~2 ms."""

    name = "client-flood"
    sent_key = "flood_sent"

    async def inject(self, obs: Observer) -> int | None:
        self.task = asyncio.create_task(self._flood())
        return None

    async def _flood(self) -> None:
        """A Byzantine client: its own valid requests, and every request it ever sent,
        resent to every agreement and execution replica every ~2 ms, for the whole drill.
        Plus requests whose MACs are garbage."""
        idx, params = self.faulty_client("the flooding client")
        params.initial_timeout = 0.002
        params.max_timeout = 0.004
        c = Client(params)
        c.start()
        sent: Counter[str] = Counter()
        self.drill.details["flood_client"] = idx
        self.drill.details["flood_sent"] = sent
        everyone = list(range(params.n))
        all_exec = list(range(params.n_exec))
        old: list[bytes] = []
        try:
            while True:
                ts = time.time_ns()
                req = wire.Request(params.service, params.principal, ts, 0, kvop.encode_get(b"k0"))
                macs = {r: params.keys[r] for r in everyone}
                macs |= {wire.exec_principal(i): k for i, k in params.exec_keys.items()}
                good = req.with_macs(macs).encode()
                bad = req.with_macs({r: os.urandom(32) for r in everyone}).encode()
                old = (old + [good])[-8:]
                for _ in range(25):
                    for m in old:
                        c._send(m, everyone, all_exec)
                        sent["retransmissions"] += 1
                    c._send(bad, everyone, all_exec)
                    sent["bad_mac"] += 1
                    await asyncio.sleep(0.002)
                with contextlib.suppress(ClientTimeout, ValueError):
                    # And its own pending requests on a 2 ms retransmission timer.
                    await c.invoke(kvop.encode_get(b"k1"), timeout=0.05)
                    sent["invoked"] += 1
        finally:
            await c.close()


class SlowReader(ClientFault):
    """A client that never reads its replies (SLOW_* above): honest clients within bounds,
    agreement replicas' memory bounded, and the replicas drop the slow reader."""

    name = "slow-reader"
    sent_key = "slow_reader"

    async def inject(self, obs: Observer) -> int | None:
        d = self.drill
        d.rack.agreed_rss(d.service, d.details.setdefault("agreed_rss_mib", {}), "before")
        self.task = asyncio.create_task(self._slow_reader())
        return None

    async def _slow_reader(self) -> None:
        """A faulty client that never reads: SLOW_CONNS connections to every agreement
        replica, each sent read-only requests whose replies (SLOW_OP bytes each) it never
        reads, at SLOW_RATE bytes/s per replica; a connection the replica closes is opened
        again. Every request is valid (its own key), so each one is answered."""
        d = self.drill
        _, params = self.faulty_client("the slow reader")
        op = b"r" * min(SLOW_OP, (params.max_request or SLOW_OP) - 4096)
        req = wire.Request(params.service, params.principal, time.time_ns(), wire.FLAG_READONLY, op)
        frame = wire.frame(req.with_macs(params.keys).encode())
        sent: Counter[str] = Counter()
        d.details["slow_reader"] = {"client": params.principal, "conns_per_replica":
                                    SLOW_CONNS, "op_bytes": len(op), "rate_bytes_s":
                                    SLOW_RATE, "sent": sent}  # fmt: skip
        rss = d.details.setdefault("agreed_rss_mib", {})
        loop = asyncio.get_running_loop()

        async def one(addr: tuple[str, int]) -> None:
            gap = len(frame) * SLOW_CONNS / SLOW_RATE  # seconds between two frames per conn
            while True:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, addr)
                    sent["connections"] += 1
                    while True:  # never a recv: every reply stays queued somewhere
                        await loop.sock_sendall(sock, frame)
                        sent["requests"] += 1
                        sent["bytes"] += len(frame)
                        await asyncio.sleep(gap)
                except OSError:
                    sent["closed_by_replica"] += 1
                    await asyncio.sleep(0.5)
                finally:
                    sock.close()

        async def watch_rss() -> None:
            while True:
                d.rack.agreed_rss(d.service, rss, "max")
                await asyncio.sleep(0.5)

        tasks = [asyncio.create_task(watch_rss())]
        tasks += [asyncio.create_task(one(a)) for a in params.replicas for _ in range(SLOW_CONNS)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def judge(self, r: rp.DrillReport, obs: Observer) -> None:
        """Honest clients' throughput and latency while the slow reader runs, against the
        quiet seconds before it, within the SLOW_* bounds; agreement replicas' memory bounded;
        the replicas dropped the slow reader (limits.slow_readers names its principal)."""
        d = self.drill
        super().judge(r, obs)  # no wake-up, spares still asleep, progress
        quiet, attack, bound = self.honest_windows(r, "slow reader")
        bound["max_rss_growth_mib"] = SLOW_MAX_RSS_MIB
        p99 = attack["p99_ms"]
        rss = r.details.get("agreed_rss_mib", {})
        for name, row in sorted(rss.items()):
            grown = row.get("max", 0.0) - row.get("before", 0.0)
            row["growth"] = round(grown, 1)
            if "before" in row and grown > SLOW_MAX_RSS_MIB:
                d.reasons.append(f"{name} RSS grew {grown:.0f} MiB under the slow reader"
                                 f" (bound {SLOW_MAX_RSS_MIB:.0f} MiB)")  # fmt: skip
        who = str(r.details.get("slow_reader", {}).get("client"))
        dropped = {
            n: x.get("limits", {}).get("slow_readers", {}).get(who, 0)
            - obs.agreed_base.get(n, {}).get("limits", {}).get("slow_readers", {}).get(who, 0)
            for n, x in obs.agreed_of(d.service).items()
        }
        r.details["slow_reader_conns_dropped"] = dropped
        if not any(v > 0 for v in dropped.values()):
            d.reasons.append("no agreement replica dropped the slow reader's connections"
                             " (stats limits.slow_readers)")  # fmt: skip
        growth = ", ".join(f"{n} {row.get('growth')}" for n, row in sorted(rss.items()))
        d.notes.append(
            f"slow-reader: honest {attack['ops_per_s']:.0f} ops/s (quiet"
            f" {quiet['ops_per_s']:.0f}), p99 {p99} ms (quiet {quiet['p99_ms']});"
            f" agreed RSS growth {growth} MiB"
        )


class MacSplit(ClientFault):
    """A client whose requests authenticate at the backups but not at the primary
    (MAC_SPLIT_RATE above): no view change, honest clients within bounds."""

    name = "mac-split"
    sent_key = "mac_split"

    async def inject(self, obs: Observer) -> int | None:
        self.task = asyncio.create_task(self._mac_split(obs))
        return None

    async def _mac_split(self, obs: Observer) -> None:
        """A faulty client (the principal after the honest ones) whose requests carry MAC
        entries good for every agreement replica but the current primary (the highest view
        in the stats files): MAC_SPLIT_RATE new requests a second, each to every agreement
        replica, every other one followed by its signed copy (auth kind 3) with the same MAC
        split and a wrong signature. Each is a kv read of a key nobody writes."""
        d = self.drill
        _, params = self.faulty_client("the mac-split client")
        c = Client(params)
        c.start()
        sent: Counter[str] = Counter()
        d.details["mac_split"] = {"client": params.principal, "rate_per_s": MAC_SPLIT_RATE,
                                  "sent": sent}  # fmt: skip
        everyone = list(range(params.n))
        try:
            while True:
                views = [x.get("view", 0) for x in obs.agreed_of(d.service).values()]
                primary = max(views, default=0) % params.n
                req = wire.Request(params.service, params.principal, time.time_ns(), 0,
                                   kvop.encode_get(b"mac-split"))  # fmt: skip
                macs = {r: params.keys[r] if r != primary else os.urandom(32) for r in everyone}
                c._send(req.with_macs(macs).encode(), everyone)
                sent["mac_split"] += 1
                if sent["mac_split"] % 2 == 0 and params.sign is not None:
                    signed = bytearray(req.signed_with_macs(macs, params.sign).encode())
                    signed[-1] ^= 0x01  # a wrong signature
                    c._send(bytes(signed), everyone)
                    sent["bad_signature"] += 1
                await asyncio.sleep(1.0 / MAC_SPLIT_RATE)
        finally:
            await c.close()

    def judge(self, r: rp.DrillReport, obs: Observer) -> None:
        """No view change while the mac-split client runs (its requests, unsigned or with a
        wrong signature, never run a backup's view-change timer), honest throughput and p99
        within the SLOW_* bounds of the quiet seconds, and the backups saw the attack
        (signed_requests.timer_exempt and bad_signature grew)."""
        d = self.drill
        super().judge(r, obs)  # no wake-up, spares still asleep, progress
        quiet, attack, _bound = self.honest_windows(r, "mac-split client")

        def delta(x: dict[str, Any], base: dict[str, Any], *path: str) -> int:
            for k in path[:-1]:
                x, base = x.get(k, {}), base.get(k, {})
            return int(x.get(path[-1], 0)) - int(base.get(path[-1], 0))

        rows = {}
        for n, x in sorted(obs.agreed_of(d.service).items()):
            base = obs.agreed_base.get(n, {})
            rows[n] = {
                "view": x.get("view"),
                "view_changes": delta(x, base, "view_changes"),
                "timer_exempt": delta(x, base, "signed_requests", "timer_exempt"),
                "bad_signature": delta(x, base, "signed_requests", "bad_signature"),
                "sig_banned": delta(x, base, "signed_requests", "sig_banned"),
                "dropped_auth": delta(x, base, "dropped", "auth"),
            }
        r.details["mac_split_replicas"] = rows
        changes = sum(row["view_changes"] for row in rows.values())
        if changes:
            d.reasons.append(f"{changes} view changes under the mac-split client: {rows}")
        if not any(row["timer_exempt"] > 0 for row in rows.values()):
            d.reasons.append("no backup took a mac-split request (signed_requests.timer_exempt)")
        if not any(row["bad_signature"] > 0 for row in rows.values()):
            d.reasons.append("no replica refused a wrong signature (bad_signature)")
        d.notes.append(
            f"mac-split: {changes} view changes; honest {attack['ops_per_s']:.0f} ops/s (quiet"
            f" {quiet['ops_per_s']:.0f}), p99 {attack['p99_ms']} ms (quiet {quiet['p99_ms']})"
        )
