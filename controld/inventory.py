# controld/inventory.py - the host's replicas and their lifecycle states, persisted
# atomically as JSON so a restarted controld carries on; every transition is validated
# and written ahead of the hypervisor call, then confirmed or rolled back.
"""Replica inventory of one host.

States and the only legal transitions (anything else raises IllegalTransition before
anything is written or any hypervisor call is made):

    (new)      -> active | paused | hibernated    provisioning: create (+ suspend/save)
    active     -> paused | hibernated | convicted   put to sleep, or shut down
    paused     -> recovering | hibernated | convicted   WAKEUP resumes; deeper sleep
    hibernated -> recovering | convicted           WAKEUP restores (+ set_memory)
    recovering -> active | paused | hibernated | convicted
                                                   caught up (fetched its state), or put
                                                   back to sleep by a SHUTDOWN (`sleep`)
    convicted  -> (nothing; remove() forgets it)    SHUTDOWN (or the operator) destroyed it

Write-ahead: transition() first persists the record with `pending` = the target state,
then runs the hypervisor action, then persists the outcome. Invariants, at every point
the file can be read:
  * `state` is a state the replica really was in at some point, and if `pending` is set
    the replica is somewhere between `state` and `pending` (an action was under way);
  * after a failed action `pending` is None again and `error` says what failed: the
    state is settled from what the hypervisor reports (confirm if it shows the target,
    roll back if it shows the old state, else keep the old one and say so in `error`);
  * a record with `pending` set on load is "in doubt" (controld died mid-action, or was
    stopped while an action's thread ran: a cancelled atransition/aprovision leaves the
    record as written ahead): reconcile() settles it the same way before anything else
    may touch it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from zz.atomicfile import write_atomic
from zz.controld.hypervisor import PAUSED as HV_PAUSED
from zz.controld.hypervisor import RUNNING as HV_RUNNING
from zz.controld.hypervisor import DomainNotFound, Hypervisor, HypervisorError

ACTIVE = "active"
PAUSED = "paused"
HIBERNATED = "hibernated"
RECOVERING = "recovering"
CONVICTED = "convicted"
STATES = (ACTIVE, PAUSED, HIBERNATED, RECOVERING, CONVICTED)
ROLES = ("active", "standby")  # where placement put the replica; `state` is what it is now
TRANSITIONS: dict[str | None, frozenset[str]] = {
    None: frozenset({ACTIVE, PAUSED, HIBERNATED}),
    ACTIVE: frozenset({PAUSED, HIBERNATED, CONVICTED}),
    PAUSED: frozenset({RECOVERING, HIBERNATED, CONVICTED}),
    HIBERNATED: frozenset({RECOVERING, CONVICTED}),
    RECOVERING: frozenset({ACTIVE, PAUSED, HIBERNATED, CONVICTED}),
    CONVICTED: frozenset(),
}
FORMAT = "zz-inventory/1"
_KEEP = object()  # transition(save_file=...) default: leave the field as it is


class IllegalTransition(ValueError):
    """A transition the table above does not allow, or one on a record in doubt."""


@dataclass
class Replica:
    """One execution replica on this host.

    service, index  which replica (the service name and its execution-replica index)
    role       "active" or "standby" as placed; never changes
    state      one of STATES; None only while the record is being provisioned (pending)
    domain     the hypervisor's name for it (ReplicaSpec.name)
    save_file  where its hibernation image is (hibernated, and recovering from it)
    pending    the state an action under way is taking it to (write-ahead), else None
    error      what the last failed action reported, None after a success
    updated    time.time() of the last change
    successor_of  a fresh spare's: the seq of the SHUTDOWN that convicted the replica it
               succeeds, written ahead with its provisioning and cleared once its
               SPARE-READY is sent (a controld stopped before that finishes the job at its
               next start); None for a replica the operator provisioned
    """

    service: str
    index: int
    role: str
    state: str | None
    domain: str
    save_file: str | None = None
    pending: str | None = None
    error: str | None = None
    updated: float = 0.0
    successor_of: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.service, self.index)

    def check(self) -> None:
        """Raise ValueError naming the bad field."""
        if self.role not in ROLES:
            raise ValueError(f"{self.service}/{self.index}: role {self.role!r}")
        if self.state not in STATES and not (self.state is None and self.pending):
            raise ValueError(f"{self.service}/{self.index}: state {self.state!r}")
        if self.pending is not None and self.pending not in STATES:
            raise ValueError(f"{self.service}/{self.index}: pending {self.pending!r}")
        if not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"{self.service}/{self.index}: index")
        if self.successor_of is not None and not isinstance(self.successor_of, int):
            raise ValueError(f"{self.service}/{self.index}: successor_of {self.successor_of!r}")


def consistent_states(hv: Hypervisor, rec: Replica) -> set[str | None]:
    """Inventory states that agree with what the hypervisor shows for rec.domain."""
    try:
        observed = hv.state(rec.domain)
    except DomainNotFound:
        gone: set[str | None] = {None, CONVICTED}
        if rec.save_file and Path(rec.save_file).exists():
            gone.add(HIBERNATED)
        return gone
    if observed == HV_RUNNING:
        return {ACTIVE, RECOVERING}
    if observed == HV_PAUSED:
        return {PAUSED}
    return set()  # shut off, crashed: nothing we would have put it in


class Inventory:
    """The replicas of one host, persisted in `path` (JSON). hv, if given, is asked what
    really happened when an action fails and when in-doubt records are reconciled."""

    def __init__(self, path: Path, hv: Hypervisor | None = None) -> None:
        self.path = Path(path)
        self.hv = hv
        self._replicas: dict[tuple[str, int], Replica] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        if self.path.exists():
            self._load()

    # ---- persistence ----------------------------------------------------------------------
    def _load(self) -> None:
        data = json.loads(self.path.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"{self.path}: format {data.get('format')!r}, want {FORMAT}")
        names = {f.name for f in fields(Replica)}
        for raw in data["replicas"]:
            rec = Replica(**{k: v for k, v in raw.items() if k in names})
            rec.check()
            self._replicas[rec.key] = rec

    def _persist(self) -> None:
        """Write the whole inventory to a temporary file, fsync, rename over the old one,
        fsync the directory: a reader sees the old or the new file, never a torn one."""
        data = {"format": FORMAT, "replicas": [asdict(r) for r in self._replicas.values()]}
        write_atomic(self.path, json.dumps(data, indent=1) + "\n", durable=True)

    # ---- queries --------------------------------------------------------------------------
    def get(self, service: str, index: int) -> Replica:
        try:
            return self._replicas[(service, index)]
        except KeyError:
            raise KeyError(f"no replica {service}/{index} on this host") from None

    def replicas(self) -> list[Replica]:
        return sorted(self._replicas.values(), key=lambda r: r.key)

    def in_doubt(self) -> list[Replica]:
        return [r for r in self.replicas() if r.pending is not None]

    # ---- transitions ----------------------------------------------------------------------
    def provision(
        self,
        service: str,
        index: int,
        role: str,
        domain: str,
        state: str,
        action: Callable[[], object],
        save_file: str | None = None,
    ) -> Replica:
        """Add a replica that `action` creates in `state` (active, paused, hibernated)."""
        if (service, index) in self._replicas:
            raise IllegalTransition(f"{service}/{index} exists already")
        rec = Replica(service, index, role, None, domain)
        rec.pending = state  # check() needs it set: a None state is only legal while pending
        rec.check()
        self._check_edge(rec, state)
        self._replicas[rec.key] = rec
        return self._run(rec, state, action, save_file)

    def transition(
        self, service: str, index: int, to: str, action: Callable[[], object],
        save_file: Any = _KEEP,
    ) -> Replica:  # fmt: skip
        """Move a replica to `to` by running `action` (the hypervisor calls), write-ahead.
        Raises IllegalTransition (nothing written, nothing run) or what `action` raised
        (after settling the record, see the module docstring)."""
        rec = self.get(service, index)
        if rec.pending is not None:
            raise IllegalTransition(f"{service}/{index} is in doubt ({rec.state} -> "
                                    f"{rec.pending}): reconcile() first")  # fmt: skip
        self._check_edge(rec, to)
        return self._run(rec, to, action, save_file)

    async def atransition(
        self, service: str, index: int, to: str, action: Callable[[], object],
        save_file: Any = _KEEP,
    ) -> Replica:  # fmt: skip
        """transition() for the daemon: one transition per replica at a time, the
        (blocking) action in a thread, the bookkeeping on the event loop."""
        lock = self._locks.setdefault((service, index), asyncio.Lock())
        async with lock:
            rec = self.get(service, index)
            if rec.pending is not None:
                raise IllegalTransition(f"{service}/{index} is in doubt: reconcile() first")
            self._check_edge(rec, to)
            old_save = self._begin(rec, to, save_file)
            try:
                await asyncio.to_thread(action)
            except asyncio.CancelledError:
                raise  # left in doubt, as in aprovision()
            except BaseException as e:
                self._settle_failure(rec, to, e, old_save)
                raise
            return self._confirm(rec, to)

    async def aprovision(
        self,
        service: str,
        index: int,
        role: str,
        domain: str,
        state: str,
        action: Callable[[], object],
        save_file: str | None = None,
        successor_of: int | None = None,
    ) -> Replica:
        """provision() for the daemon: written ahead on the event loop, the (blocking)
        action in a thread, under the replica's lock like atransition()."""
        lock = self._locks.setdefault((service, index), asyncio.Lock())
        async with lock:
            if (service, index) in self._replicas:
                raise IllegalTransition(f"{service}/{index} exists already")
            rec = Replica(service, index, role, None, domain, successor_of=successor_of)
            rec.pending = state
            rec.check()
            self._check_edge(rec, state)
            self._replicas[rec.key] = rec
            self._begin(rec, state, save_file)
            try:
                await asyncio.to_thread(action)
            except asyncio.CancelledError:
                # The action's thread cannot be cancelled and runs on (a daemon stopped
                # mid-boot): settling now would record what the hypervisor shows halfway.
                # The record stays written ahead, in doubt as after a crash, and the next
                # start's reconcile() settles it from what the hypervisor shows then.
                raise
            except BaseException as e:
                self._settle_failure(rec, state, e, None)
                raise
            return self._confirm(rec, state)

    async def afinish(self, service: str, index: int, action: Callable[[], object]) -> Replica:
        """Finish a provisioning left in doubt (a record written ahead with state None by a
        controld that stopped before confirming it; reconcile() left it alone): `action`
        takes the replica from wherever it got to to the pending state while the record
        stays written ahead, then it is confirmed, or settled as a failed provisioning (a
        record whose replica the hypervisor does not show is forgotten)."""
        lock = self._locks.setdefault((service, index), asyncio.Lock())
        async with lock:
            rec = self.get(service, index)
            to = rec.pending
            if rec.state is not None or to is None:
                raise IllegalTransition(f"{service}/{index} is {rec.state}: no provisioning"
                                        " to finish")  # fmt: skip
            try:
                await asyncio.to_thread(action)
            except asyncio.CancelledError:
                raise  # still in doubt, for the next start
            except BaseException as e:
                self._settle_failure(rec, to, e, None)
                raise
            return self._confirm(rec, to)

    def announced(self, service: str, index: int) -> None:
        """A fresh spare's SPARE-READY is sent: it succeeds no conviction any more."""
        rec = self.get(service, index)
        if rec.successor_of is not None:
            rec.successor_of = None
            self._persist()

    def remove(self, service: str, index: int) -> None:
        """Forget a convicted replica."""
        rec = self.get(service, index)
        if rec.state != CONVICTED or rec.pending is not None:
            raise IllegalTransition(f"{service}/{index} is {rec.state}, not convicted")
        del self._replicas[rec.key]
        self._persist()

    def reconcile(self, leave: Callable[[Replica], bool] | None = None) -> list[Replica]:
        """Settle every in-doubt record from what the hypervisor shows (without one: roll
        back), except those `leave` picks (the daemon finishes them: afinish()); returns
        the records settled, with `error` telling the outcome."""
        settled = [r for r in self.in_doubt() if leave is None or not leave(r)]
        for rec in settled:
            to = rec.pending
            assert to is not None
            # The write-ahead save file is kept unless the state rolls back to one without.
            old = rec.save_file if rec.state in (HIBERNATED, RECOVERING) else None
            self._settle_failure(rec, to, RuntimeError("controld stopped mid-transition"), old)
        return settled

    # ---- the write-ahead steps ------------------------------------------------------------
    def _check_edge(self, rec: Replica, to: str) -> None:
        if to not in TRANSITIONS.get(rec.state, frozenset()):
            was = rec.state or "(new)"
            raise IllegalTransition(f"{rec.service}/{rec.index}: {was} -> {to} not allowed")

    def _run(self, rec: Replica, to: str, action: Callable[[], object], save_file: Any) -> Replica:
        old_save = self._begin(rec, to, save_file)
        try:
            action()
        except BaseException as e:
            self._settle_failure(rec, to, e, old_save)
            raise
        return self._confirm(rec, to)

    def _begin(self, rec: Replica, to: str, save_file: Any) -> str | None:
        """Write ahead: the target state and the save file it will have. Returns the old
        save file, for a roll back."""
        old = rec.save_file
        rec.pending = to
        if save_file is not _KEEP:
            rec.save_file = save_file
        rec.updated = time.time()
        self._persist()
        return old

    def _confirm(self, rec: Replica, to: str) -> Replica:
        rec.state, rec.pending, rec.error = to, None, None
        rec.updated = time.time()
        self._persist()
        return rec

    def _settle_failure(
        self, rec: Replica, to: str, exc: BaseException, old_save: Any = _KEEP
    ) -> None:
        prev = rec.state
        why = f"{prev or '(new)'} -> {to} failed: {exc}"
        if self.hv is None:
            ok: set[str | None] = {prev}
        else:
            try:
                ok = consistent_states(self.hv, rec)
            except HypervisorError as e:
                ok, why = {prev}, f"{why}; state unknown ({e})"
        if to in ok:
            rec.state, rec.error = to, f"{why}; but the hypervisor shows it done: confirmed"
        elif prev in ok:
            rec.error = f"{why}; rolled back to {prev or '(new)'}"
        elif prev is None and (made := sorted(ok & TRANSITIONS[None])):
            # Created, but the rest of provisioning failed: keep what exists, never leak it.
            rec.state = made[0]
            rec.error = f"{why}; the hypervisor shows it {made[0]}: kept as such"
        else:
            rec.error = f"{why}; the hypervisor shows neither state, kept {prev}"
        if rec.state != to and old_save is not _KEEP:
            rec.save_file = old_save
        rec.pending = None
        rec.updated = time.time()
        if rec.state is None:  # provisioning that never happened: forget the record
            del self._replicas[rec.key]
        self._persist()
