# snapshots/hostzfs.py - a guest's checkpoint store on the host's ZFS (docs/design.md §8: one
# dataset per execution replica, shared into the guest; @ckpt-n taken by the host). The
# guest writes its state on the share; the host's controld snapshots it when asked.
"""HostZfsStore: the guest side of a ZFS dataset that lives on the host.

There is no ZFS inside a guest. The host's controld creates the replica's dataset
``<pool>/s<id>-exec-<i>`` with its mountpoint at ``<share>/live``, so the guest sees it
through its 9p share, and acts on the guest's **signed requests** to snapshot, destroy
and roll back (docs/controld.md "Guest snapshots"):

* the guest writes ``<share>/zz-snap-req.json`` (atomically): ``n`` (strictly increasing,
  nanoseconds), ``op`` (list | snapshot | destroy | rollback), ``name`` (``ckpt-<seq>``,
  empty for list), and
  ``sig``: the replica's Ed25519 signature over :func:`request_bytes`;
* controld checks the signature against the service's public key of that execution
  replica and that ``n`` is new, runs ``zfs snapshot|destroy|rollback -r`` on the dataset
  and answers in ``<share>/zz-snap-done.json``: the same ``n``, ``ok``, ``error``, and
  ``snapshots`` (the dataset's snapshots, oldest first, after the operation).

The share is the guest's own: nothing else but the host writes it; the signature keeps a
file planted there by anything but the replica's runtime from moving its dataset. The
guest waits for the answer before it goes on, so a snapshot holds exactly the state after
the checkpoint's batch (9p writes reach the host before write() returns). Reading a
snapshot is the host's business too: peers fetch a guest's checkpoint files from its
controld, which reads them through ``zfs clone`` (controld/snapshots.py), so
:meth:`open_snapshot` refuses.
"""

from __future__ import annotations

import json
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from zz.atomicfile import write_atomic
from zz.crypto import SigningKey
from zz.snapshots.store import CheckpointStore, StorageError, check_snapshot_name

REQUEST = "zz-snap-req.json"
ANSWER = "zz-snap-done.json"
OPS = ("list", "snapshot", "destroy", "rollback")
_TAG = b"zz guest snapshot request\n"
_POLL = 0.002


def request_bytes(service: int, index: int, n: int, op: str, name: str) -> bytes:
    """What the signature covers: the request with the replica it is for."""
    body = {"index": index, "n": n, "name": name, "op": op, "service": service}
    return _TAG + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(obj, sort_keys=True))


class HostZfsStore(CheckpointStore):
    def __init__(
        self,
        share: Path | str,
        *,
        service: int,
        index: int,
        sign_key: SigningKey,
        timeout: float = 60.0,
    ) -> None:
        self.share = Path(share)
        self._live = self.share / "live"
        if not self._live.is_dir():
            raise StorageError(f"{self._live}: no dataset mounted (controld creates it)")
        self.service = service
        self.index = index
        self.sign_key = sign_key
        self.timeout = timeout
        self._last_n = 0
        self._snapshots: list[str] | None = None

    @property
    def path(self) -> Path:
        return self._live

    def _ask(self, op: str, name: str) -> list[str]:
        """One request, answered by controld; the dataset's snapshots after it."""
        n = max(time.time_ns(), self._last_n + 1)
        self._last_n = n
        sig = self.sign_key.sign(request_bytes(self.service, self.index, n, op, name))
        write_json_atomic(self.share / REQUEST, {"n": n, "op": op, "name": name, "sig": sig.hex()})
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                answer = json.loads((self.share / ANSWER).read_text())
            except (OSError, ValueError):
                answer = {}
            if isinstance(answer, dict) and answer.get("n") == n:
                break
            if time.monotonic() > deadline:
                raise StorageError(f"{op} {name}: no answer from controld in {self.timeout:.0f} s")
            time.sleep(_POLL)
        if not answer.get("ok"):
            raise StorageError(f"{op} {name}: controld: {answer.get('error', 'refused')}")
        snaps = answer.get("snapshots")
        if not isinstance(snaps, list) or not all(isinstance(s, str) for s in snaps):
            raise StorageError(f"{op} {name}: controld's answer lists no snapshots")
        self._snapshots = list(snaps)
        return self._snapshots

    def snapshot(self, name: str) -> None:
        self._ask("snapshot", check_snapshot_name(name))

    def list_snapshots(self) -> list[str]:
        if self._snapshots is None:
            # The first call (a runtime starting) asks; later ones know from the answers,
            # as nothing but this store changes the dataset's snapshots.
            self._ask("list", "")
        assert self._snapshots is not None
        return list(self._snapshots)

    def destroy_snapshot(self, name: str) -> None:
        self._ask("destroy", check_snapshot_name(name))

    def restore_live(self, name: str) -> None:
        self._ask("rollback", check_snapshot_name(name))

    def open_snapshot(self, name: str) -> AbstractContextManager[Path]:
        raise StorageError(f"{name}: a guest's snapshots are read on the host (controld)")

    def destroy(self) -> None:
        raise StorageError("a guest's dataset is destroyed by its host's controld")
