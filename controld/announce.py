# controld/announce.py - tell a service's agreement replicas that a fresh sleeping replica
# stands under an index (SPARE-READY, docs/wire.md), so that their sleeping set is refilled.
"""SPARE-READY sender.

An announcement of a re-keyed slot (key epoch above 0) also goes to every other host's
controld, which keeps it in its key directory (daemon.py _on_spare_ready): on a rack keyed
per host that is how the other hosts' runtimes and controlds learn the slot's new keys.

controld signs one SPARE-READY per provisioned standby and sends it to every agreement
replica of the service on its own short connection. zz-agreed accepts it only from the
controld of the host the replica is placed on, and only for a replica it holds convicted
by the SHUTDOWN at `seq` (0: a first provisioning) or already sleeping; a correct replica
that has not applied that SHUTDOWN yet holds it until it does. There is no reply: a send
counts as delivered once the frame is written to a connected socket. An agreement replica
that is down for the whole retry period misses the announcement (docs/controld.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from zz import wire
from zz.config import Config, Host, Service
from zz.crypto import SigningKey
from zz.keys import controld_principal, slot_keys

log = logging.getLogger("zz.controld.announce")

RETRY_FOR_S = 120.0  # an agreement replica restarting within this still gets the announcement
BACKOFF_S = (0.2, 5.0)  # first retry delay, cap (doubling)
CONNECT_TIMEOUT_S = 2.0


def spare_ready(
    host: Host,
    key: SigningKey,
    svc: Service,
    index: int,
    seq: int,
    slot: wire.SpareReady | None = None,
) -> bytes:
    """The signed SPARE-READY of `host`'s controld for `svc`/`index`, naming the slot's
    current key epoch and public keys (`slot`: its last announcement; none: epoch 0, the
    key directory's keys, which zz-agreed already holds)."""
    epoch, pub, dh = (slot.epoch, slot.sign_pub, slot.dh_pub) if slot else (0, bytes(32), bytes(32))
    msg = wire.SpareReady(svc.id, controld_principal(host.index), index, seq, epoch, pub, dh)
    return msg.signed(key).encode()


class Announcer:
    """Sends SPARE-READY in the background; `close()` cancels what is still retrying."""

    def __init__(
        self,
        config: Config,
        host: Host,
        key: SigningKey,
        counters: Counter[str],
        note: Callable[[str], None],
        *,
        retry_for: float = RETRY_FOR_S,
        audit: Callable[[bytes], None] | None = None,
    ) -> None:
        self.config = config
        self.audit = audit  # told each announcement before it is sent (the audit log)
        self.host = host
        self.key = key
        self.counters = counters
        self.note = note
        self.retry_for = retry_for
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def announce(self, svc: Service, index: int, seq: int, raw: bytes | None = None) -> None:
        """SPARE-READY{index, seq} to every agreement replica of `svc` (needs a running loop).
        `raw`: the signed announcement of a re-keyed slot (zz.keys.rotate_exec); without it,
        one naming the slot's current key from the key directory."""
        if raw is None:
            cur = slot_keys(Path(self.config.rack.key_dir), self.config, svc)
            slot = cur.get(wire.exec_principal(index))
            raw = spare_ready(self.host, self.key, svc, index, seq, slot)
        if self.audit is not None:
            self.audit(raw)
        self.note(f"SPARE-READY {svc.name}/{index} seq {seq} to {svc.n} agreement replicas")
        targets = [(f"agreement replica {r}", self.config.replica_address(svc, r))
                   for r in range(svc.n)]  # fmt: skip
        if wire.decode(raw).epoch > 0:  # type: ignore[attr-defined]
            # A re-keyed slot: every other host keeps its new keys too (a rack keyed per
            # host shares no key directory; controld's _on_spare_ready).
            targets += [(f"controld {h.name}", (h.address, h.control_port))
                        for h in self.config.hosts if h.index != self.host.index]  # fmt: skip
        for who, addr in targets:
            t = asyncio.create_task(self._deliver(svc, who, addr, raw))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _deliver(self, svc: Service, who: str, addr: tuple[str, int], raw: bytes) -> None:
        # Counters: spare_ready_{sent,retries,failed} (agreement replicas), and
        # spare_ready_forward{ed,_retries,_failed} (other hosts' controlds).
        fwd = who.startswith("controld")
        sent, retries, failed = (
            ("spare_ready_forwarded", "spare_ready_forward_retries", "spare_ready_forward_failed")
            if fwd
            else ("spare_ready_sent", "spare_ready_retries", "spare_ready_failed")
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_for
        delay = BACKOFF_S[0]
        while True:
            try:
                await self._send_once(addr, raw)
            except (OSError, TimeoutError) as e:
                # Python 3.11's wait_for hands back the connect's own error when it had
                # failed as the task was cancelled, and the cancellation is lost: without
                # this check close() waited out the whole retry period (2 minutes of a
                # controld stop).
                task = asyncio.current_task()
                if self._closed or (task is not None and task.cancelling()):
                    raise asyncio.CancelledError from e
                if loop.time() + delay > deadline:
                    self.counters[failed] += 1
                    self.note(f"SPARE-READY {svc.name} to {who} failed: {e}")
                    return
                self.counters[retries] += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, BACKOFF_S[1])
                continue
            self.counters[sent] += 1
            return

    async def _send_once(self, addr: tuple[str, int], raw: bytes) -> None:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(addr[0], addr[1]), CONNECT_TIMEOUT_S
        )
        try:
            writer.write(wire.frame(raw))
            await asyncio.wait_for(writer.drain(), CONNECT_TIMEOUT_S)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def idle(self) -> None:
        """Wait until every announcement is delivered or given up (tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        self._closed = True
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(BaseException):
                await t
