# controld/guestsnap.py - the host side of a guest's ZFS checkpoint store: one dataset per
# guest replica, mounted on its share, snapshotted on the guest's signed request
# (snapshots/hostzfs.py has the guest side and the request format; docs/controld.md).
"""GuestDatasets: datasets of this host's guests, and their snapshot requests.

controld creates ``<pool>/s<id>-exec-<i>`` with its mountpoint at ``<share>/live`` when it
provisions a guest (rack on ZFS; actions.make_guest_dataset), and polls every guest's
share for ``zz-snap-req.json``.
A request is acted on only if its signature is the execution replica's own (the
service's public key of that principal) and its ``n`` is above the last one seen; the
request file is removed before the answer is written, so a restarted controld never
acts on it twice. Anything else is answered with ``ok: false`` and counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zz import wire
from zz.config import Service
from zz.controld.actions import HostContext, replica_dataset
from zz.crypto import verify_signature
from zz.snapshots import StorageError, check_snapshot_name
from zz.snapshots.hostzfs import ANSWER, OPS, REQUEST, request_bytes, write_json_atomic
from zz.snapshots.zfs import ZfsStore

log = logging.getLogger("zz.controld.guestsnap")

POLL_SECONDS = 0.01  # a guest's checkpoint waits for us: poll often, it is a stat()


class GuestDatasets:
    def __init__(
        self,
        ctx: HostContext,
        publics: Callable[[int], dict[int, bytes]],
        counters: Counter[str],
    ) -> None:
        self.ctx = ctx
        self.publics = publics
        self.counters = counters
        self._lock = threading.Lock()
        self._stores: dict[tuple[int, int], ZfsStore] = {}
        self._snapshots: dict[tuple[int, int], list[str]] = {}
        self._last_n: dict[tuple[int, int], int] = {}

    @property
    def enabled(self) -> bool:
        return (
            self.ctx.store == "zfs"
            and bool(self.ctx.zfs_pool)
            and self.ctx.hv.kind == "libvirt"
            and not self.ctx.fake_guests
        )

    def _replicas(self) -> list[tuple[Service, int]]:
        cfg = self.ctx.config
        return [
            (svc, i)
            for svc in cfg.services
            if svc.uses_execution_replicas
            for i in range(svc.n_exec)
            if svc.exec_host(cfg, i) == self.ctx.host
        ]

    # ---- datasets -----------------------------------------------------------------------

    def forget(self, svc: Service, i: int) -> None:
        """Replica i's dataset is set aside or replaced: stop acting on the old one."""
        with self._lock:
            self._stores.pop((svc.id, i), None)
            self._snapshots.pop((svc.id, i), None)

    def _store(self, svc: Service, i: int) -> ZfsStore:
        with self._lock:
            store = self._stores.get((svc.id, i))
        if store is None:
            pool = self.ctx.zfs_pool
            assert pool is not None
            name = replica_dataset(pool, svc.exec_state_dir(self.ctx.config, i))
            if name is None:
                raise StorageError(f"no dataset of {svc.name}/{i} is mounted in its share")
            # create=False: a request for a dataset we did not make is refused, not obeyed.
            store = ZfsStore(pool, name.partition("/")[2], create=False)
            with self._lock:
                self._stores[(svc.id, i)] = store
        return store

    # ---- requests -----------------------------------------------------------------------

    async def run(self) -> None:
        """Poll the shares of this host's guests until cancelled."""
        replicas = self._replicas()
        while True:
            await asyncio.sleep(POLL_SECONDS)
            for svc, i in replicas:
                share = svc.exec_state_dir(self.ctx.config, i)
                if os.path.exists(share / REQUEST):
                    await asyncio.to_thread(self.handle, svc, i, share)

    def handle(self, svc: Service, i: int, share: Path) -> None:
        """Act on the request in `share` (if it is a valid one) and answer it."""
        path = share / REQUEST
        try:
            raw = path.read_text()
            path.unlink()
        except OSError:
            return  # gone meanwhile (the share set aside)
        n, answer = self._answer(svc, i, raw)
        if n is None:
            return  # not even a number to answer to: nobody waits for it
        try:
            write_json_atomic(share / ANSWER, {"n": n, **answer})
        except OSError as e:
            self.counters["guest_snapshot_answer_failed"] += 1
            log.warning("%s/%d: cannot answer its snapshot request: %s", svc.name, i, e)

    def _answer(self, svc: Service, i: int, raw: str) -> tuple[int | None, dict[str, Any]]:
        try:
            req = json.loads(raw)
        except ValueError:
            req = None
        n = req.get("n") if isinstance(req, dict) else None
        if not isinstance(n, int) or isinstance(n, bool):
            self.counters["guest_snapshot_malformed"] += 1
            return None, {}
        try:
            assert isinstance(req, dict)
            op, name, sig = req["op"], req["name"], bytes.fromhex(req["sig"])
            if op not in OPS or not isinstance(name, str):
                raise ValueError("op must be one of " + ", ".join(OPS) + ", name a string")
            if op != "list":
                check_snapshot_name(name)
        except (ValueError, KeyError, TypeError) as e:
            self.counters["guest_snapshot_malformed"] += 1
            return n, {"ok": False, "error": f"malformed: {e}"}
        key = (svc.id, i)
        public = self.publics(svc.id).get(wire.exec_principal(i))
        if public is None or not verify_signature(
            public, request_bytes(svc.id, i, n, op, name), sig
        ):
            self.counters["guest_snapshot_bad_sig"] += 1
            return n, {"ok": False, "error": "bad signature"}
        if n <= self._last_n.get(key, 0):
            self.counters["guest_snapshot_replayed"] += 1
            return n, {"ok": False, "error": "replayed request"}
        self._last_n[key] = n
        try:
            snaps = self._act(svc, i, op, name)
        except StorageError as e:
            self.counters["guest_snapshot_failed"] += 1
            log.warning("%s/%d: %s %s: %s", svc.name, i, op, name, e)
            return n, {"ok": False, "error": str(e)}
        self.counters[f"guest_{op}"] += 1
        return n, {"ok": True, "snapshots": snaps}

    def _act(self, svc: Service, i: int, op: str, name: str) -> list[str]:
        store = self._store(svc, i)
        key = (svc.id, i)
        with self._lock:
            snaps = self._snapshots.get(key)
        if snaps is None:
            snaps = store.list_snapshots()
        if op == "snapshot":
            store.snapshot(name)
            snaps = [*snaps, name]
        elif op == "destroy":
            store.destroy_snapshot(name)
            snaps = [s for s in snaps if s != name]
        elif op == "rollback":
            store.restore_live(name)  # -r: later snapshots go
            snaps = snaps[: snaps.index(name) + 1] if name in snaps else store.list_snapshots()
        with self._lock:
            self._snapshots[key] = snaps
        return list(snaps)
