# zz/client.py - asyncio client library for one ZZ service (PBFT client side, docs/wire.md).
# Sends MAC'd REQUESTs, retransmits them signed to all replicas on timeout (docs/agreement.md
# "Signed requests"), accepts g+1 matching REPLYs
# (echo services) or f+1 matching REPLYs from execution replicas (every other app), or g+1
# matching REPLY-AFFIRMs from agreement replicas plus one REPLY with the affirmed result.
from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from zz import keys, wire
from zz.config import Config, request_limit
from zz.crypto import SIG_LEN, SigningKey, sha256
from zz.link import Link

SIGN_AFTER_RETRY_S = 60.0


class ClientTimeout(Exception):
    """No reply certificate before the caller's deadline."""


class RequestTooLarge(Exception):
    """The REQUEST is over the replicas' size limit (docs/wire.md "Size limits"): refused
    before sending when the client knows the limit, or by g+1 matching REJECTED replies."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"request of {size} bytes is over the service's limit of {limit} bytes")
        self.size = size
        self.limit = limit


class _NoQuorum(Exception):
    """A read-only attempt cannot gather 2g+1 matching replies; fall back to ordering."""


def exec_key_stamp(config: Config, service: str | int) -> tuple[tuple[int, int] | None, ...]:
    """What the key directory says of each execution slot's key epoch announcement (mtime
    and size of its file; None: never re-keyed). A long-lived client compares it before a
    request: when a convicted replica's successor is announced with a new key epoch
    (docs/wire.md "Key epochs"), ClientParams.from_config must be read again, or the
    successor, once woken, can neither read our requests nor be heard."""
    svc = config.service(service)
    out: list[tuple[int, int] | None] = []
    for i in range(svc.n_exec):
        path = keys.spare_cert_path(config.rack.key_dir, svc.id, wire.exec_principal(i))
        try:
            st = path.stat()
            out.append((st.st_mtime_ns, st.st_size))
        except FileNotFoundError:
            out.append(None)
    return tuple(out)


@dataclass
class ClientParams:
    """Everything a client needs, independent of how it was configured."""

    service: int
    g: int
    client_index: int
    replicas: list[tuple[str, int]]  # agreement replica r listens at replicas[r]
    keys: dict[int, bytes]  # MAC key shared with each agreement replica r
    initial_timeout: float = 0.5
    max_timeout: float = 8.0
    # Services whose app runs on execution replicas: execution replica i listens at
    # exec_replicas[i] and shares exec_keys[i]; results need f+1 of their REPLYs.
    # Empty for echo services, whose agreement replicas answer themselves.
    f: int = 0
    exec_replicas: list[tuple[str, int]] = field(default_factory=list)
    exec_keys: dict[int, bytes] = field(default_factory=dict)
    # The largest REQUEST message the replicas accept (zz.config.request_limit); None: not
    # known here, the replicas' REJECTED replies tell.
    max_request: int | None = None
    # The client's Ed25519 key: it signs its retransmissions (auth kind 3), the only requests
    # that make backups suspect the primary. None: retransmissions go unsigned, and a faulty
    # primary that ignores this client is not replaced on its account.
    sign: SigningKey | None = field(default=None, repr=False)
    # Sign every request, not only retransmissions (rack client_signatures = "always": the
    # agreement replicas then order signed requests only).
    sign_always: bool = False
    # Re-keyed execution slots (docs/wire.md "Key epochs"): the rack's controld keys (which
    # sign a slot's SPARE-READY) by principal, the controld principal of each slot's host,
    # and each slot's key epoch as we know it. A replica of a newer epoch introduces itself
    # with its SPARE-READY when our REQUEST does not verify under its keys
    # (Client._on_spare_ready): how a client on another machine than the slot's learns it.
    rack_public: dict[int, bytes] = field(default_factory=dict, repr=False)
    exec_hosts: list[int] = field(default_factory=list)
    exec_epochs: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = 3 * self.g + 1
        if len(self.replicas) != n:
            raise ValueError(f"g={self.g} needs {n} replica addresses, got {len(self.replicas)}")
        missing = [r for r in range(n) if r not in self.keys]
        if missing:
            raise ValueError(f"no MAC key for replica {missing[0]}")
        if self.exec_replicas:
            if len(self.exec_replicas) < self.f + 1:
                raise ValueError(
                    f"f={self.f} needs at least {self.f + 1} execution replica addresses,"
                    f" got {len(self.exec_replicas)}"
                )
            missing = [i for i in range(len(self.exec_replicas)) if i not in self.exec_keys]
            if missing:
                raise ValueError(f"no MAC key for execution replica {missing[0]}")

    @property
    def uses_execution_replicas(self) -> bool:
        return bool(self.exec_replicas)

    @property
    def n_exec(self) -> int:
        return len(self.exec_replicas)

    @property
    def n(self) -> int:
        return 3 * self.g + 1

    @property
    def principal(self) -> int:
        return wire.client_principal(self.client_index)

    @classmethod
    def from_config(cls, config: Config, service: str | int, client_index: int) -> ClientParams:
        svc = config.service(service)
        if not 0 <= client_index < svc.clients:
            raise ValueError(f"client {client_index} not in 0..{svc.clients - 1} of {svc.name}")
        pid = wire.client_principal(client_index)
        secret = keys.load_secret(keys.secret_path(config.rack.key_dir, svc.id, pid))
        # Re-keyed execution slots: their current MAC keys only (docs/wire.md "Key epochs").
        secret = keys.with_epoch_macs(secret, config.rack.key_dir, config, svc)
        exec_addrs: list[tuple[str, int]] = []
        exec_keys: dict[int, bytes] = {}
        exec_hosts: list[int] = []
        epochs: dict[int, int] = {}
        rack_public: dict[int, bytes] = {}
        if svc.uses_execution_replicas:
            exec_addrs = svc.exec_addresses(config)
            pids = [wire.exec_principal(i) for i in range(svc.n_exec)]
            exec_keys = dict(enumerate(keys.peer_keys(secret, pids).values()))
            exec_hosts = [keys.controld_principal(svc.exec_host(config, i).index)
                          for i in range(svc.n_exec)]  # fmt: skip
            for p, m in keys.slot_keys(config.rack.key_dir, config, svc).items():
                epochs[p - wire.exec_principal(0)] = m.epoch
            rack = keys.service_dir(config.rack.key_dir, keys.RACK_SERVICE) / "public"
            if rack.exists():
                rack_public = keys.load_public(rack)
        return cls(
            service=svc.id,
            g=svc.g,
            client_index=client_index,
            replicas=[config.replica_address(svc, r) for r in range(svc.n)],
            keys=keys.peer_keys(secret, range(svc.n)),
            f=svc.f,
            exec_replicas=exec_addrs,
            exec_keys=exec_keys,
            max_request=request_limit(config.rack, svc.clients, svc.app == "echo"),
            sign=secret.sign,
            sign_always=config.rack.client_signatures == "always",
            rack_public=rack_public,
            exec_hosts=exec_hosts,
            exec_epochs=epochs,
        )


class _Conn(Link):
    """A persistent, reconnecting connection to one replica. While it is down the latest
    message waits (older ones are superseded: the protocol retransmits anyway). A fresh
    connection to an execution replica (`exec_slot`) with nothing waiting carries the
    pending request if that replica has not answered it yet (Client._pending_for)."""

    def __init__(
        self,
        client: Client,
        r: int,
        addr: tuple[str, int],
        label: str = "",
        exec_slot: int | None = None,
    ) -> None:
        super().__init__(addr, label or str(r), task_prefix="zz-client-conn-")
        self.client = client
        self.r = r
        self.exec_slot = exec_slot
        self.waiting: bytes | None = None
        # A replica replies on the connection a request of ours arrived on; until this
        # connection has carried one, the replica cannot answer us at all.
        self.introduced = False

    def send(self, msg: bytes) -> bool:
        if not super().send(msg):
            self.waiting = msg
            return False
        self.introduced = True
        return True

    def on_connect(self) -> list[bytes]:
        self.client.stats["connects"] += 1
        first, self.waiting = self.waiting, None
        if first is None and self.exec_slot is not None:
            first = self.client._pending_for(self.exec_slot)
        self.introduced = first is not None
        return [first] if first is not None else []

    def on_frame(self, raw: bytes) -> None:
        self.client._on_message(raw)

    def on_frame_error(self) -> None:
        self.client.stats["frame_errors"] += 1


@dataclass
class _Pending:
    timestamp: int
    read_only: bool
    quorum: int
    future: asyncio.Future[bytes]
    # Replies counted from repliers of which at most `faulty` lie (g agreement replicas
    # or f execution replicas), keyed by sender principal: (result, view).
    faulty: int = 0
    replies: dict[int, tuple[bytes, int]] = field(default_factory=dict)
    # REPLY-AFFIRMs by agreement replica: the result digest it saw certified.
    affirms: dict[int, bytes] = field(default_factory=dict)
    # REJECTED replies by agreement replica: the limit it named.
    rejects: dict[int, int] = field(default_factory=dict)
    size: int = 0
    # The request itself, so that an execution replica that introduces itself with a new
    # key epoch gets it again at once (Client._on_spare_ready).
    request: wire.Request | None = None


class Client:
    """`await Client(params_or_config, c, service=...).invoke(op)`; one request at a time
    per client (the replicas' reply cache keeps only the latest timestamp per client)."""

    def __init__(
        self,
        config_or_params: ClientParams | Config,
        client_index: int | None = None,
        service: str | int | None = None,
    ) -> None:
        if isinstance(config_or_params, Config):
            if service is None:
                if len(config_or_params.services) != 1:
                    raise ValueError("the rack has several services: name one")
                service = config_or_params.services[0].id
            params = ClientParams.from_config(config_or_params, service, client_index or 0)
        else:
            params = config_or_params
            if client_index is not None and client_index != params.client_index:
                raise ValueError("client_index disagrees with the given ClientParams")
        self.params = params
        self.view = 0
        self.stats: Counter[str] = Counter()
        self._last_ts = 0
        self._conns: list[_Conn] = []
        self._exec_conns: list[_Conn] = []
        self._pending: _Pending | None = None
        self._lock = asyncio.Lock()
        # After a request that needed its signed retransmission, sign first sends too for
        # SIGN_AFTER_RETRY_S: a replica that could not check one of our MACs in a
        # PRE-PREPARE (a faulty primary forging us) orders only our signed requests for a
        # while (docs/agreement.md "Signed requests").
        self._sign_until = 0.0

    @classmethod
    def from_file(cls, config_path: str | Path, service: str | int, client_index: int) -> Client:
        from zz.config import load

        return cls(ClientParams.from_config(load(config_path), service, client_index))

    async def __aenter__(self) -> Client:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        if not self._conns:
            self._conns = [_Conn(self, r, a) for r, a in enumerate(self.params.replicas)]
            self._exec_conns = [
                _Conn(self, i, a, f"exec-{i}", exec_slot=i)
                for i, a in enumerate(self.params.exec_replicas)
            ]
            for c in self._conns + self._exec_conns:
                c.start()

    async def close(self) -> None:
        conns, self._conns = self._conns + self._exec_conns, []
        self._exec_conns = []
        for c in conns:
            await c.close()

    @property
    def primary(self) -> int:
        return self.view % self.params.n

    def _macs(self) -> dict[int, bytes]:
        """A REQUEST's MAC keys: every agreement replica's, every execution slot's at the
        newest key epoch we know."""
        p = self.params
        macs = {r: p.keys[r] for r in range(p.n)}
        macs |= {wire.exec_principal(i): k for i, k in sorted(p.exec_keys.items())}
        return macs

    def _next_timestamp(self) -> int:
        # Wall-clock based so a restarted client keeps increasing, never repeating.
        self._last_ts = max(time.time_ns(), self._last_ts + 1)
        return self._last_ts

    def _send(self, msg: bytes, to: list[int], to_exec: list[int] | None = None) -> None:
        for r in to:
            self._conns[r].send(msg)
        for i in to_exec or []:
            self._exec_conns[i].send(msg)

    async def invoke(self, op: bytes, read_only: bool = False, timeout: float = 30.0) -> bytes:
        """Run `op` and return its result once a reply certificate is in. Raises
        ClientTimeout after `timeout` seconds, RequestTooLarge for a request over the
        replicas' size limit (nothing is sent if the limit is known)."""
        self.start()
        async with self._lock:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            p = self.params
            if p.uses_execution_replicas:
                # Only f+1 execution replicas are active, so the 2f+1 matching unordered
                # replies a read-only certificate needs cannot be had: order it instead,
                # marked so that it runs without write access and a replica replaying a
                # certified log may skip it (ZZ §4.7.2).
                if read_only:
                    self.stats["read_only_ordered"] += 1
                return await self._attempt(op, False, p.f + 1, deadline, ordered_read=read_only)
            if read_only:
                try:
                    return await self._attempt(op, True, 2 * p.g + 1, deadline)
                except _NoQuorum:
                    self.stats["read_only_fallbacks"] += 1
            return await self._attempt(op, False, p.g + 1, deadline)

    async def _attempt(
        self, op: bytes, read_only: bool, quorum: int, deadline: float, ordered_read: bool = False
    ) -> bytes:
        p = self.params
        loop = asyncio.get_running_loop()
        ts = self._next_timestamp()
        flags = wire.FLAG_READONLY if read_only else wire.FLAG_ORDERED_READ if ordered_read else 0
        req = wire.Request(p.service, p.principal, ts, flags, op)
        macs = self._macs()
        msg = req.with_macs(macs).encode()
        # The signed retransmission is SIG_LEN bytes longer: it must fit the limit too.
        size = len(msg) + (SIG_LEN if p.sign is not None and not read_only else 0)
        if p.max_request is not None and size > p.max_request:
            self.stats["too_large_refused"] += 1
            raise RequestTooLarge(size, p.max_request)
        signed: bytes | None = None
        sign_now = p.sign_always or loop.time() < self._sign_until
        if sign_now and p.sign is not None and not read_only and size <= wire.MAX_MSG:
            signed = msg = req.signed_with_macs(macs, p.sign).encode()
            self.stats["signed"] += 1
        faulty = p.f if p.uses_execution_replicas else p.g
        pend = _Pending(ts, read_only, quorum, loop.create_future(), faulty, size=len(msg),
                        request=req)  # fmt: skip
        self._pending = pend
        self.stats["requests"] += 1
        everyone = list(range(p.n))
        all_exec = list(range(p.n_exec))
        # Read-only requests skip ordering, so every replica must see them at once.
        # Ordered ones go to the primary, and to any replica that has not heard from us on
        # its current connection yet, so that it can send its REPLY back. Execution
        # replicas likewise reply on connections we have used, so fresh ones get a copy.
        first = [r for r, c in enumerate(self._conns) if not c.introduced or r == self.primary]
        first_exec = [i for i, c in enumerate(self._exec_conns) if not c.introduced]
        self._send(msg, everyone if read_only else first, first_exec)
        interval = p.initial_timeout
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise ClientTimeout(f"no reply certificate for timestamp {ts}")
                try:
                    result = await asyncio.wait_for(
                        asyncio.shield(pend.future), min(interval, remaining)
                    )
                    if signed is not None and not sign_now:
                        self._sign_until = loop.time() + SIGN_AFTER_RETRY_S
                    return result
                except TimeoutError:
                    if pend.future.done():
                        return pend.future.result()
                    if read_only and loop.time() < deadline:
                        raise _NoQuorum() from None
                    if loop.time() >= deadline:
                        continue
                    # The primary may be faulty or the request lost: tell everyone, so
                    # backups forward it and start their view-change timers, which only a
                    # signed request does (every replica can check a signature, so no
                    # client can make backups suspect a primary that rightly refused it).
                    self.stats["retransmits"] += 1
                    fresh = {wire.exec_principal(i): k for i, k in p.exec_keys.items()}
                    if any(macs.get(x) != k for x, k in fresh.items()):
                        # A slot's new key epoch learned meanwhile (_on_spare_ready).
                        macs |= fresh
                        msg = req.with_macs(macs).encode()
                        signed = None
                    # (Not one that would not fit a frame signed: no replica orders it.)
                    if signed is None and p.sign is not None and len(msg) + SIG_LEN <= wire.MAX_MSG:
                        signed = req.signed_with_macs(macs, p.sign).encode()
                        self.stats["signed"] += 1
                    self._send(signed or msg, everyone, all_exec)
                    interval = min(interval * 2, p.max_timeout)
        finally:
            self._pending = None
            if not pend.future.done():
                pend.future.cancel()

    def _pending_for(self, i: int) -> bytes | None:
        """The pending request for execution replica `i` on a fresh connection to it, if
        it has not answered: an execution replica replies only on a connection the request
        came on, and the one this request first went out on may have died unread (a
        hibernated spare's port, accepted by QEMU's user network while the restored guest
        did not listen yet). Without this, the woken spare's reply waited for the next
        retransmission, backed off to seconds by then."""
        pend = self._pending
        if pend is None or pend.future.done() or pend.request is None:
            return None
        if wire.exec_principal(i) in pend.replies:
            return None
        self.stats["resent_on_connect"] += 1
        return pend.request.with_macs(self._macs()).encode()

    def _on_message(self, raw: bytes) -> None:
        p = self.params
        try:
            m = wire.decode(raw)
        except wire.WireError:
            self.stats["bad_msg"] += 1
            return
        if isinstance(m, wire.ReplyAffirm):
            self._on_affirm(m)
            return
        if isinstance(m, wire.SpareReady):
            self._on_spare_ready(m)
            return
        if not isinstance(m, wire.Reply) or m.service != p.service or m.client != p.principal:
            self.stats["unexpected"] += 1
            return
        kind, idx = wire.principal_kind(m.sender)
        if m.rejected is not None:
            self._on_rejected(m, kind, idx)
            return
        if p.uses_execution_replicas:
            if kind == "agreement" and idx < p.n:
                # Agreement replicas of such a service do not run the app: whatever they
                # answer is not a result.
                self.stats["agreement_replies_ignored"] += 1
                return
            if kind != "exec" or idx >= p.n_exec:
                self.stats["unexpected"] += 1
                return
            key = p.exec_keys[idx]
        else:
            if kind != "agreement" or idx >= p.n:
                self.stats["unexpected"] += 1
                return
            key = p.keys[idx]
        if not m.verify_mac(p.principal, key):
            self.stats["bad_mac"] += 1
            return
        self.stats["replies"] += 1
        pend = self._pending
        if pend is None or pend.future.done() or m.timestamp != pend.timestamp:
            self.stats["stale"] += 1
            return
        if m.read_only != pend.read_only:
            self.stats["unexpected"] += 1
            return
        # The latest reply per replica counts: a correct replica never changes its answer.
        pend.replies[m.sender] = (m.result, m.view)
        if self._affirmed(pend):
            return
        votes = Counter(res for res, _ in pend.replies.values())
        result, count = votes.most_common(1)[0]
        if count >= pend.quorum:
            views = sorted((v for res, v in pend.replies.values() if res == result), reverse=True)
            # The (faulty+1)-th highest view is vouched for by at least one correct replica.
            self.view = max(self.view, views[pend.faulty])
            pend.future.set_result(result)
        elif pend.read_only and len(pend.replies) - count + pend.quorum > p.n:
            pend.future.set_exception(_NoQuorum())

    def _on_spare_ready(self, m: wire.SpareReady) -> None:
        """An execution replica's introduction (execution/runtime.py): the SPARE-READY its
        host's controld signed for its slot, sent because our REQUEST did not verify under
        its keys. One that verifies under that controld's key in the rack's public file and
        names an epoch above the one we know for the slot replaces our MAC key with the slot
        by the epoch key (keys.epoch_mac_key, docs/wire.md "Key epochs"); our next requests
        go to it again, under that key. Anything else is counted and ignored (an older or
        equal epoch never replaces a key)."""
        p = self.params
        i = m.replica
        if (
            m.service != p.service
            or i >= p.n_exec
            or i >= len(p.exec_hosts)
            or m.sender != p.exec_hosts[i]
            or p.sign is None
        ):
            self.stats["unexpected"] += 1
            return
        pub = p.rack_public.get(m.sender)
        if pub is None or not m.verify_sig(pub):
            self.stats["bad_spare_ready"] += 1
            return
        if m.epoch <= p.exec_epochs.get(i, 0):
            self.stats["stale_spare_ready"] += 1
            return
        try:
            key = keys.epoch_mac_key(
                p.sign, m.dh_pub, p.service, p.principal, wire.exec_principal(i), m.epoch
            )
        except ValueError:
            self.stats["bad_spare_ready"] += 1
            return
        p.exec_keys[i] = key
        p.exec_epochs[i] = m.epoch
        self.stats["exec_key_epochs_learned"] += 1
        if i >= len(self._exec_conns):
            return
        conn = self._exec_conns[i]
        conn.introduced = False  # our next request goes to it again
        # The replica dropped our pending request for its MAC: it introduces itself when it
        # reads one, typically a spare just woken, so the request is part of the fault
        # round and the reply certificate may need its reply. Send it again now, under the
        # new key, rather than at the next retransmission (the timer is backed off by then:
        # up to seconds after the replica could have answered).
        pend = self._pending
        if pend is not None and not pend.future.done() and pend.request is not None:
            if wire.exec_principal(i) not in pend.replies:
                conn.send(pend.request.with_macs(self._macs()).encode())
                self.stats["resent_on_introduction"] += 1

    def _on_rejected(self, m: wire.Reply, kind: str, idx: int) -> None:
        """A REJECTED reply: agreement replica `idx` refused our request unordered. g+1
        matching ones (at least one correct replica) end the request with RequestTooLarge."""
        p = self.params
        if kind != "agreement" or idx >= p.n:
            self.stats["unexpected"] += 1
            return
        if not m.verify_mac(p.principal, p.keys[idx]):
            self.stats["bad_mac"] += 1
            return
        self.stats["rejected_replies"] += 1
        pend = self._pending
        rej = m.rejected
        if pend is None or pend.future.done() or m.timestamp != pend.timestamp or rej is None:
            self.stats["stale"] += 1
            return
        reason, limit = rej
        if reason != wire.REJECT_TOO_LARGE:
            self.stats["unexpected"] += 1
            return
        pend.rejects[idx] = limit
        votes = Counter(pend.rejects.values())
        limit, count = votes.most_common(1)[0]
        if count >= p.g + 1:
            pend.future.set_exception(RequestTooLarge(pend.size, limit))

    def _on_affirm(self, m: wire.ReplyAffirm) -> None:
        """A REPLY-AFFIRM: agreement replica `sender` saw f+1 execution replicas agree that
        our request's result hashes to `result_digest` (docs/wire.md)."""
        p = self.params
        kind, idx = wire.principal_kind(m.sender)
        if m.service != p.service or m.client != p.principal or kind != "agreement" or idx >= p.n:
            self.stats["unexpected"] += 1
            return
        if not m.verify_mac(p.principal, p.keys[idx]):
            self.stats["bad_mac"] += 1
            return
        self.stats["affirms"] += 1
        pend = self._pending
        if pend is None or pend.future.done() or m.timestamp != pend.timestamp or pend.read_only:
            self.stats["stale"] += 1
            return
        pend.affirms[idx] = m.result_digest
        self._affirmed(pend)

    def _affirmed(self, pend: _Pending) -> bool:
        """The affirmation certificate: g+1 matching REPLY-AFFIRMs from distinct agreement
        replicas (at least one correct) and one REPLY, from any replica, with that result.
        Completes the request and returns True when it holds."""
        if not pend.affirms or pend.read_only or pend.future.done():
            return False
        quorum = {d for d, n in Counter(pend.affirms.values()).items() if n >= self.params.g + 1}
        for result, _view in pend.replies.values():
            if sha256(result) in quorum:
                self.stats["affirmed_results"] += 1
                pend.future.set_result(result)
                return True
        return False
