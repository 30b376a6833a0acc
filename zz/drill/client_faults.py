# zz/drill/client_faults.py - the drill kinds whose fault is not an execution replica's: the
# agreement primary killed, and faulty clients (flood, slow reader, MAC split, oversized
# requests) and an unauthenticated attacker holding half-sent frames.
"""Drill kinds with no execution fault (docs/operations.md, "Drills"): nothing may be
detected, no spare woken, and honest clients go on within bounds."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import time
from collections import Counter
from collections.abc import Coroutine
from typing import Any, ClassVar

from zz import kvop, wire
from zz import report as rp
from zz.client import Client, ClientParams, ClientTimeout, RequestTooLarge
from zz.crypto import SIG_LEN
from zz.drill.kind import PRIMARY_KEYS, DrillKind
from zz.drill.load import first_client
from zz.drill.observe import Observer, agreed_stats, agreed_stats_now, sleeping
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
# big-request: a client that sends, BIG_RATE rounds a second, one REQUEST over the service's
# request limit (zz.config.request_limit, the stats' limits.request_limit) to every
# agreement replica, its size cycling through BIG_OVER (None: one byte over the limit; the
# last just under the 16 MiB frame limit), then one kv PUT of its own key BIG_UNDER bytes
# under the limit (its signed retransmission fits too), ordered and answered. Before the
# limits one valid 16 MiB request made every primary build a batch it could not send (22-35
# view changes in 20-30 s). Bounds: no view change, every oversized request refused with
# REJECTED replies (limits.requests_too_large), honest throughput and p99 as for
# slow-reader. BIG_RATE is where the bound holds on 2 busy cores (docs/security.md).
BIG_RATE = 2.0
BIG_OVER: tuple[int | None, ...] = (None, 4 << 20, None, wire.MAX_MSG - 64)
BIG_UNDER = 256
BIG_REJECT_WAIT_S = 5.0
BIG_KEY = b"big-request"
# half-frames: an unauthenticated attacker, per agreement replica HALF_CONNS connections
# that each announce a 16 MiB frame and send HALF_SENT bytes of it, and IDLE_CONNS that send
# nothing, all held until the replica closes them (then opened again HALF_REOPEN_S later).
# Bounds: every attacking connection closed within its timeout (frame_timeout_ms /
# unauth_timeout_ms, as the rack runs them) plus HALF_SLACK_S, counted in limits.
# frame_timeouts / unauth_timeouts; no agreement replica's RSS more than HALF_MAX_RSS_MIB
# above its value at the attack; honest clients as for slow-reader. The attacker stays
# HALF_HEADROOM connections under the per-source cap (max_conns_per_source): honest
# clients on this machine share its source address.
HALF_CONNS = 48
IDLE_CONNS = 16
HALF_SENT = 4 << 10
HALF_REOPEN_S = 0.5
HALF_SLACK_S = 1.5
HALF_MAX_RSS_MIB = 32.0
HALF_HEADROOM = 32


def _limits_delta(x: dict[str, Any], base: dict[str, Any], key: str) -> int:
    """Growth of the stats counter limits.<key> from `base` to `x`."""
    return int(x.get("limits", {}).get(key, 0)) - int(base.get("limits", {}).get(key, 0))


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
        killed = await d.rack.kill_agreed(s, view % s.n)
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

    async def start_watching_rss(self, attack: Coroutine[Any, Any, None]) -> None:
        """Record every agreement replica's RSS at the fault, then start the attack (which
        samples "max" while it runs: zz/drill/rack.py agreed_rss)."""
        d = self.drill
        await d.rack.agreed_rss(d.service, d.details.setdefault("agreed_rss_mib", {}), "before")
        self.task = asyncio.create_task(attack)

    def judge_rss(self, r: rp.DrillReport, bound_mib: float, under: str) -> dict[str, Any]:
        """Each replica's RSS growth (kept as its row's "growth"); a reason for each one over
        `bound_mib`. Returns the rows."""
        rss = r.details.get("agreed_rss_mib", {})
        for name, row in sorted(rss.items()):
            grown = row.get("max", 0.0) - row.get("before", 0.0)
            row["growth"] = round(grown, 1)
            if "before" in row and grown > bound_mib:
                self.drill.reasons.append(f"{name} RSS grew {grown:.0f} MiB under {under}"
                                          f" (bound {bound_mib:.0f} MiB)")  # fmt: skip
        return rss

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

    def settled_limits(
        self, obs: Observer, keys: tuple[str, ...], want: dict[str, dict[str, int]]
    ) -> dict[str, dict[str, int]]:
        """Each agreement replica's growth of limits.<key> since the fault, read afresh from
        the stats files (rewritten every status period, so the last poll may miss the end of
        the attack) until every row reaches `want` or 3 s have passed."""
        d = self.drill
        s = d.service
        t_end = time.monotonic() + 3.0
        while True:
            rows: dict[str, dict[str, int]] = {}
            # judge runs in a thread of its own (Drill.evaluate): a loop of its own here.
            now = asyncio.run(agreed_stats_now(d.config, s)) if d.rack.on_hosts else []
            for r in range(s.n):
                name = f"{s.name}/agreed-{r}"
                fresh = now[r] if now else agreed_stats(d.config, s, r)
                x = fresh or obs.agreed.get(name, {})
                base = obs.agreed_base.get(name, {})
                rows[name] = {k: _limits_delta(x, base, k) for k in keys}
            short = any(rows[n][k] < v for n, w in want.items() for k, v in w.items() if n in rows)
            if not short or time.monotonic() >= t_end:
                return rows
            time.sleep(0.25)

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
        await self.start_watching_rss(self._slow_reader())
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
                await d.rack.agreed_rss(d.service, rss, "max")
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
        rss = self.judge_rss(r, SLOW_MAX_RSS_MIB, "the slow reader")
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


class BigRequest(ClientFault):
    """A client sending requests over the service's request limit and just under it
    (BIG_* above): no view change, every oversized one refused, honest clients within
    bounds."""

    name = "big-request"
    sent_key = "big_request"
    # Set by choose(): the client's parameters and the oversized requests by size.
    params: ClientParams
    oversized: dict[int, bytes]

    def choose(self, obs: Observer) -> None:
        """Build the oversized requests before the load starts: MACs over 16 MiB take a
        while, and the honest clients share the drill's event loop."""
        d = self.drill
        _, params = self.faulty_client("the big-request client")
        limit = params.max_request
        if limit is None:
            raise DrillError(f"{d.service.name}: no request limit known")
        self.params = params
        agreement_macs = {r: params.keys[r] for r in range(params.n)}
        plain = len(kvop.encode_put(BIG_KEY, b""))
        empty = wire.Request(params.service, params.principal, 0, 0, b"").with_macs(agreement_macs)
        over_overhead = len(empty.encode()) + plain
        # A replica refuses each copy at intake, before it looks at the timestamp.
        self.oversized = {}
        for want in BIG_OVER:
            size = max(want or 0, limit + 1)
            op = kvop.encode_put(BIG_KEY, b"o" * (size - over_overhead))
            req = wire.Request(params.service, params.principal, time.time_ns(), 0, op)
            self.oversized[size] = req.with_macs(agreement_macs).encode()
            assert len(self.oversized[size]) == size

    async def inject(self, obs: Observer) -> int | None:
        self.task = asyncio.create_task(self._big_request())
        return None

    async def _big_request(self) -> None:
        """A faulty client (the principal after the honest ones): BIG_RATE rounds a second,
        each one REQUEST over the limit (a kv PUT of BIG_KEY, valid MACs for every agreement
        replica, sent raw to every agreement replica, the client's size check skipped: built
        in choose()) and one PUT of BIG_KEY just under the limit, invoked as an honest client
        would."""
        d = self.drill
        params = self.params
        limit = params.max_request
        assert limit is not None
        msgs = self.oversized
        sent: Counter[str] = Counter()
        sizes: Counter[int] = Counter()
        d.details["big_request"] = {"client": params.principal, "request_limit": limit,
                                    "rate_per_s": BIG_RATE, "sizes_over": sizes,
                                    "sent": sent}  # fmt: skip
        everyone = list(range(params.n))
        macs = {r: params.keys[r] for r in everyone}
        macs |= {wire.exec_principal(i): k for i, k in params.exec_keys.items()}
        # Bytes a request adds to its op (header, MAC vector): the PUT is sized from it.
        empty = wire.Request(params.service, params.principal, 0, 0, b"").with_macs(macs)
        overhead = len(empty.encode())
        plain = len(kvop.encode_put(BIG_KEY, b""))
        under = kvop.encode_put(BIG_KEY, b"u" * (limit - overhead - plain - SIG_LEN - BIG_UNDER))
        d.details["big_request"]["under_bytes"] = len(under) + overhead
        c = Client(params)
        c.start()
        try:
            for k in range(1 << 30):
                t0 = time.monotonic()
                size = max(BIG_OVER[k % len(BIG_OVER)] or 0, limit + 1)
                seen = c.stats["rejected_replies"]
                c._send(msgs[size], everyone)
                sent["over"] += 1
                sizes[size] += 1
                # Every agreement replica answers REJECTED (counted once its MAC checks).
                t_end = time.monotonic() + BIG_REJECT_WAIT_S
                while c.stats["rejected_replies"] < seen + params.n:
                    if time.monotonic() >= t_end:
                        sent["over_unanswered"] += 1
                        break
                    await asyncio.sleep(0.01)
                else:
                    sent["over_refused"] += 1
                try:
                    reply = await c.invoke(under, timeout=10.0)
                    ok = kvop.decode_reply(reply).status == kvop.OK
                    sent["under_ok" if ok else "under_not_ok"] += 1
                except ClientTimeout:
                    sent["under_timeout"] += 1
                except RequestTooLarge:
                    sent["under_refused"] += 1
                sent["rejected_replies"] = c.stats["rejected_replies"]
                await asyncio.sleep(max(0.0, 1.0 / BIG_RATE - (time.monotonic() - t0)))
        finally:
            sent["rejected_replies"] = c.stats["rejected_replies"]
            await c.close()

    def report_details(self, details: dict[str, Any]) -> None:
        super().report_details(details)
        big = details.get("big_request")
        if isinstance(big, dict) and isinstance(big.get("sizes_over"), Counter):
            big["sizes_over"] = {str(k): v for k, v in sorted(big["sizes_over"].items())}

    def judge(self, r: rp.DrillReport, obs: Observer) -> None:
        """No view change while the client runs, every oversized request refused by every
        agreement replica (limits.requests_too_large grew by at least the number sent, and
        REJECTED replies came back), the ones just under the limit ordered and answered,
        and honest throughput and p99 within the SLOW_* bounds of the quiet seconds."""
        d = self.drill
        super().judge(r, obs)  # no wake-up, spares still asleep, progress
        quiet, attack, _bound = self.honest_windows(r, "big-request client")
        big = r.details.get("big_request", {})
        sent = big.get("sent", {})
        over = int(sent.get("over", 0))
        refused = int(sent.get("over_refused", 0))
        want = {f"{d.service.name}/agreed-{i}": {"requests_too_large": refused}
                for i in range(d.service.n)}  # fmt: skip
        grown = self.settled_limits(obs, ("requests_too_large",), want)
        rows = {}
        for n, x in sorted(obs.agreed_of(d.service).items()):
            base = obs.agreed_base.get(n, {})
            rows[n] = {
                "view": x.get("view"),
                "view_changes": int(x.get("view_changes", 0)) - int(base.get("view_changes", 0)),
                "requests_too_large": grown.get(n, {}).get("requests_too_large", 0),
                "request_limit": x.get("limits", {}).get("request_limit"),
            }
        r.details["big_request_replicas"] = rows
        changes = sum(row["view_changes"] for row in rows.values())
        if changes:
            d.reasons.append(f"{changes} view changes under the big-request client: {rows}")
        if refused == 0:
            d.reasons.append("no oversized request was refused by every agreement replica")
        # The last one may still be in flight when the drill cancels the client.
        if sent.get("over_unanswered") or refused < over - 1:
            d.reasons.append(f"oversized requests without a REJECTED reply from every agreement"
                             f" replica within {BIG_REJECT_WAIT_S:g} s: {sent}")  # fmt: skip
        short = {n: row["requests_too_large"] for n, row in rows.items()
                 if row["requests_too_large"] < refused}  # fmt: skip
        if short:
            d.reasons.append(f"{refused} oversized requests refused, but"
                             f" limits.requests_too_large grew only {short}")  # fmt: skip
        limits = {n: row["request_limit"] for n, row in rows.items()
                  if row["request_limit"] != big.get("request_limit")}  # fmt: skip
        if limits:
            d.reasons.append(f"stats limits.request_limit {limits} is not zz.config's"
                             f" {big.get('request_limit')}")  # fmt: skip
        rejected = int(sent.get("rejected_replies", 0))
        failed = {k: v for k, v in sent.items() if k.startswith("under_") and k != "under_ok"}
        if not sent.get("under_ok") or failed:
            d.reasons.append(f"requests just under the limit not all answered: {sent}")
        d.notes.append(
            f"big-request: {changes} view changes, {refused} of {over} oversized requests refused"
            f" ({rejected} REJECTED replies), {sent.get('under_ok', 0)} just under the limit"
            f" answered; honest {attack['ops_per_s']:.0f} ops/s (quiet {quiet['ops_per_s']:.0f}),"
            f" p99 {attack['p99_ms']} ms (quiet {quiet['p99_ms']})"
        )


class HalfFrames(ClientFault):
    """An unauthenticated attacker holding half-sent 16 MiB frames and idle connections on
    every agreement replica (HALF_* above): each closed within its timeout, memory bounded,
    honest clients within bounds."""

    name = "half-frames"
    sent_key = "half_frames"

    def _timeouts(self) -> tuple[float, float]:
        """frame_timeout_ms and unauth_timeout_ms (s) as the rack runs them: its
        `zz rack up --set` values, else zz-agreed's defaults (docs/security.md)."""
        ov = self.drill.rack.state.overrides

        def ms(key: str, default: int) -> float:
            v = ov.get(key, default)
            vals = list(v.values()) if isinstance(v, dict) else [v]
            return max(int(x) for x in vals) / 1000

        return ms("frame_timeout_ms", 20000), ms("unauth_timeout_ms", 10000)

    def refuse(self, args: Any) -> None:
        frame, unauth = self._timeouts()
        need = max(frame, unauth) + HALF_SLACK_S + 1.0
        if args.after < need:
            raise DrillError(
                f"half-frames: --after {args.after:g} s cannot see connections closed after"
                f" frame_timeout_ms / unauth_timeout_ms ({frame:g} s / {unauth:g} s): watch"
                f" at least {math.ceil(need)} s, or bring the rack up with lower ones"
                " (zz rack up --set frame_timeout_ms=2000 --set unauth_timeout_ms=3000)"
            )
        v = self.drill.rack.state.overrides.get("max_conns_per_source", 256)
        cap = min(int(x) for x in (v.values() if isinstance(v, dict) else [v]))
        if cap < HALF_CONNS + IDLE_CONNS + HALF_HEADROOM:
            raise DrillError(f"half-frames: max_conns_per_source {cap} leaves no room for"
                             f" {HALF_CONNS + IDLE_CONNS} attacking connections and the"
                             " honest clients on the same address")  # fmt: skip

    async def inject(self, obs: Observer) -> int | None:
        await self.start_watching_rss(self._attack())
        return None

    async def _attack(self) -> None:
        """HALF_CONNS connections to every agreement replica that announce a 16 MiB frame
        and send HALF_SENT bytes of it, and IDLE_CONNS that send nothing; each waits for the
        replica to close it (how long it was held is kept), then is opened again."""
        d = self.drill
        s = d.service
        frame_s, unauth_s = self._timeouts()
        head = wire.MAX_MSG.to_bytes(4, "big") + os.urandom(HALF_SENT)
        sent: Counter[str] = Counter()
        held: dict[str, list[float]] = {"half": [], "idle": []}
        open_at_end: dict[str, list[float]] = {"half": [], "idle": []}
        closed: Counter[str] = Counter()  # "agreed-R half" / "agreed-R idle"
        d.details["half_frames"] = {
            "conns_per_replica": {"half": HALF_CONNS, "idle": IDLE_CONNS},
            "announced_bytes": wire.MAX_MSG, "sent_bytes": HALF_SENT,
            "frame_timeout_s": frame_s, "unauth_timeout_s": unauth_s, "sent": sent,
            "held_s": held, "open_at_end_s": open_at_end, "closed": closed,
        }  # fmt: skip
        rss = d.details.setdefault("agreed_rss_mib", {})
        loop = asyncio.get_running_loop()
        addrs = [d.rack.agreed_proc(s, r) for r in range(s.n)]

        async def one(r: int, kind: str) -> None:
            addr = (addrs[r].address, addrs[r].port)
            while True:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setblocking(False)
                opened: float | None = None
                try:
                    await loop.sock_connect(sock, addr)
                    opened = time.monotonic()
                    sent[f"{kind}_connections"] += 1
                    if kind == "half":
                        await loop.sock_sendall(sock, head)
                        sent["bytes"] += len(head)
                    while await loop.sock_recv(sock, 4096):
                        sent["bytes_received"] += 1  # nothing is ever due to us
                    raise ConnectionResetError  # closed by the replica
                except OSError:
                    if opened is None:
                        sent["connect_failed"] += 1
                    else:
                        held[kind].append(round(time.monotonic() - opened, 2))
                        closed[f"agreed-{r} {kind}"] += 1
                        opened = None
                finally:
                    if opened is not None:  # cancelled at the end of the drill, still open
                        open_at_end[kind].append(round(time.monotonic() - opened, 2))
                    sock.close()
                await asyncio.sleep(HALF_REOPEN_S)

        async def watch_rss() -> None:
            while True:
                await d.rack.agreed_rss(s, rss, "max")
                await asyncio.sleep(0.5)

        tasks = [asyncio.create_task(watch_rss())]
        for r in range(s.n):
            tasks += [asyncio.create_task(one(r, "half")) for _ in range(HALF_CONNS)]
            tasks += [asyncio.create_task(one(r, "idle")) for _ in range(IDLE_CONNS)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def report_details(self, details: dict[str, Any]) -> None:
        super().report_details(details)
        half = details.get("half_frames")
        if isinstance(half, dict) and isinstance(half.get("closed"), Counter):
            half["closed"] = dict(sorted(half["closed"].items()))

    def judge(self, r: rp.DrillReport, obs: Observer) -> None:
        """Every attacking connection closed by the replica within its timeout plus
        HALF_SLACK_S (a half-sent frame: the smaller of frame_timeout_ms and
        unauth_timeout_ms; an idle one: unauth_timeout_ms), the closes counted in every
        replica's limits (frame_timeouts / unauth_timeouts), nobody refused over the
        per-source cap, no agreement replica's RSS more than HALF_MAX_RSS_MIB above its
        value at the attack, and honest throughput and p99 within the SLOW_* bounds."""
        d = self.drill
        s = d.service
        super().judge(r, obs)  # no wake-up, spares still asleep, progress
        quiet, attack, bound = self.honest_windows(r, "half-sent frames")
        bound["max_rss_growth_mib"] = HALF_MAX_RSS_MIB
        half = r.details.get("half_frames", {})
        frame_s, unauth_s = self._timeouts()
        # The sweep closes a half-sent frame at the first of its two timeouts, counting it a
        # frame timeout when frame_timeout_ms is the smaller (or equal) one.
        limit_s = {"half": min(frame_s, unauth_s), "idle": unauth_s}
        half_key = "frame_timeouts" if frame_s <= unauth_s else "unauth_timeouts"
        closed = half.get("closed", {})
        per = {"half": HALF_CONNS, "idle": IDLE_CONNS}
        for kind in ("half", "idle"):
            longest = max(half.get("held_s", {}).get(kind, []) + half.get(
                "open_at_end_s", {}).get(kind, []), default=0.0)  # fmt: skip
            if longest > limit_s[kind] + HALF_SLACK_S:
                d.reasons.append(f"a {kind} connection held {longest:.1f} s, over its"
                                 f" {limit_s[kind]:g} s timeout + {HALF_SLACK_S:g} s")  # fmt: skip
            few = {i: closed.get(f"agreed-{i} {kind}", 0) for i in range(s.n)
                   if closed.get(f"agreed-{i} {kind}", 0) < per[kind]}  # fmt: skip
            if few:
                d.reasons.append(f"of {per[kind]} {kind} connections per agreement replica,"
                                 f" only {few} closed by the replica")  # fmt: skip
        want: dict[str, dict[str, int]] = {}
        for i in range(s.n):
            n_half, n_idle = closed.get(f"agreed-{i} half", 0), closed.get(f"agreed-{i} idle", 0)
            w = want.setdefault(f"{s.name}/agreed-{i}", {"unauth_timeouts": n_idle})
            w[half_key] = w.get(half_key, 0) + n_half
        keys = ("frame_timeouts", "unauth_timeouts", "conns_refused_source", "conns_refused",
                "unauth_buffer_refusals")  # fmt: skip
        rows = self.settled_limits(obs, keys, want)
        r.details["half_frames_replicas"] = rows
        for n, w in sorted(want.items()):
            row = rows.get(n, {})
            short = {k: (row.get(k, 0), v) for k, v in w.items() if row.get(k, 0) < v}
            if short:
                d.reasons.append(f"{n}: limits counters (grown, closed by it) {short}")
            if row.get("conns_refused_source") or row.get("conns_refused"):
                d.reasons.append(f"{n} refused connections over a cap, which the attack stays"
                                 f" under: {row}")  # fmt: skip
        rss = self.judge_rss(r, HALF_MAX_RSS_MIB, "the half-sent frames")
        if sent_failed := half.get("sent", {}).get("connect_failed"):
            d.notes.append(f"half-frames: {sent_failed} connects failed")
        holds = {k: max(v, default=None) for k, v in half.get("held_s", {}).items()}
        growth = ", ".join(f"{n} {row.get('growth')}" for n, row in sorted(rss.items()))
        d.notes.append(
            f"half-frames: longest hold {holds} s (timeouts {limit_s}); honest"
            f" {attack['ops_per_s']:.0f} ops/s (quiet {quiet['ops_per_s']:.0f}), p99"
            f" {attack['p99_ms']} ms (quiet {quiet['p99_ms']}); agreed RSS growth {growth} MiB"
        )
