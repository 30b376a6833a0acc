"""execution/drillfaults.py - an execution replica's test-only misbehaviour behind one seam: the
runtime's own faults (--inject-fault, zz/drillfaults.py FAULTS) and the campaign's Byzantine
behaviours (execution/byzantine.py), switched in place through the fault file (--drill-faults).

DRILLS AND TESTS ONLY. The runtime (execution/runtime.py) and its checkpoints
(execution/checkpointing.py) call DrillFaults at these points only; with no fault on, each
is a no-op or hands back what it was given:

  lying(seq)                    the replies of batch `seq` are wrong (wrong-reply, the lies
                                of corrupt-snapshot, the Byzantine fetch liars)
  report_delay()                seconds to hold each EXEC-REPORT back (slow-report)
  report(seq, rep)              sends the EXEC-REPORT itself, or withholds it (Byzantine)
  before_manifest(builder, seq) diverge-state's file that no correct replica has
  snapshot(store, name, ...)    corrupt-snapshot takes the checkpoint's snapshot itself
  checkpoint_msg(seq, msg)      the signed EXEC-CHECKPOINT to send (None: withheld)
  after_checkpoint(seq)         once the checkpoint is taken and announced
  on_stable(seq)                a checkpoint became stable (corrupt-snapshot's lies start)
  file_data(out)                an answer of the snapshot file server
  status()                      the status file's `inject_fault` and `corrupt_lie_from`

and `watch()`, the task that reads the fault file (<state dir>/zz-fault.json) every 20 ms
while the runtime runs with --drill-faults (zz rack up gives it; a production controld
does not)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zz import wire
from zz.drillfaults import FAULTS
from zz.execution.byzantine import BEHAVIOURS as BYZANTINE_BEHAVIOURS
from zz.execution.byzantine import Byzantine
from zz.snapshots import CheckpointStore
from zz.snapshots.manifest import Manifest, ManifestBuilder

if TYPE_CHECKING:
    from zz.execution.runtime import Runtime

log = logging.getLogger("zz.execution")

# corrupt-snapshot: Byzantine storage. The replica certifies the right digest but every
# snapshot it takes has one byte of each file flipped (its live state is put back after),
# so a recovering peer gets wrong bytes from it; once one such checkpoint is stable and
# CORRUPT_LIE_AFTER/cp of the next interval has passed (the agreement replicas know it
# stable by then), it also answers wrongly, so it is convicted and a spare recovers.
CORRUPT_LIE_AFTER = 0.25
# slow-report: how long the faulty replica holds each EXEC-REPORT back by default (beyond
# the K·t1 of the tests' timers, so the agreement replicas time it out). A drill sets the
# delay above its rack's detection ceiling through the fault file ("slow_report_ms").
SLOW_REPORT_SECONDS = 0.5
DIVERGE_PATH = "zz-fault-diverge"
_POLL = 0.02


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _flip_byte(path: Path, offset: int) -> bool:
    """XOR one byte with 0xFF (twice puts it back); False if the file is not here. Synced:
    a guest's write must reach the host's dataset before the host snapshots it."""
    try:
        with open(path, "r+b") as fh:
            fh.seek(offset)
            b = fh.read(1)
            if not b:
                return False
            fh.seek(offset)
            fh.write(bytes([b[0] ^ 0xFF]))
            fh.flush()
            os.fsync(fh.fileno())
    except FileNotFoundError:
        return False
    return True


class DrillFaults:
    """The fault on at this replica (`fault`: one of FAULTS, or None) and the Byzantine
    behaviour (`byz`), with what each needs to remember."""

    def __init__(self, rt: Runtime, fault: str | None, fault_file: Path | None) -> None:
        self.fault = fault  # checked by RuntimeOptions
        # Drills only (--drill-faults): this file switches `fault` while running.
        self.fault_file = fault_file
        self.counters: Counter[str] = rt.counters
        self.cp = rt.cp
        self.byz = Byzantine(rt)  # the campaign's behaviours
        self.slow_report_s = SLOW_REPORT_SECONDS
        # Checkpoints above the stable one that were snapshotted corrupted.
        self._corrupted: set[int] = set()
        self.corrupt_lie_from: int | None = None
        # Called when the fault file switched the fault: the runtime writes its status at
        # once (a drill waits for it there before it lets its load go on).
        self.on_switch: Callable[[], None] = lambda: None
        # A drill holds the lies back (fault file "lie": false) until it has seen a
        # corrupted checkpoint stable, so that it knows when the lies start.
        self.corrupt_lies = True

    # ---- hooks of the production path ---------------------------------------------------
    def lying(self, seq: int) -> bool:
        if self.fault == "wrong-reply" or self.byz.lying(seq):
            return True
        if self.fault != "corrupt-snapshot" or not self.corrupt_lies:
            return False
        return self.corrupt_lie_from is not None and seq >= self.corrupt_lie_from

    def report_delay(self) -> float:
        return self.slow_report_s if self.fault == "slow-report" else 0.0

    def report(self, seq: int, rep: wire.ExecReport) -> bool:
        return self.byz.report(seq, rep)

    def before_manifest(self, builder: ManifestBuilder, seq: int) -> None:
        if self.fault == "diverge-state":
            # A deterministic wrong state: one file no correct replica has, so this
            # replica's C differs from theirs at every checkpoint.
            (builder.root / DIVERGE_PATH).write_bytes(b"diverged at %d\n" % seq)
            builder.mark_dirty(DIVERGE_PATH)

    def corrupts_snapshots(self) -> bool:
        """Whether snapshot() takes the next snapshot (corrupt-snapshot)."""
        return self.fault == "corrupt-snapshot"

    def snapshot(
        self, store: CheckpointStore, name: str, manifest: Manifest, root: Path, seq: int
    ) -> bool:
        """corrupt-snapshot: flip one byte of every file, snapshot, flip back (True: the
        snapshot is taken)."""
        if self.fault != "corrupt-snapshot":
            return False
        flipped: list[tuple[Path, int]] = []
        try:
            for rel, entry in manifest.files.items():
                at = (root / rel, entry.size // 2)
                if entry.size and _flip_byte(*at):
                    flipped.append(at)
            store.snapshot(name)
        finally:
            for at in flipped:
                _flip_byte(*at)
        self.counters["snapshot_files_corrupted"] += len(flipped)
        self._corrupted.add(seq)
        log.warning("drill: snapshot %s taken with %d files corrupted", name, len(flipped))
        return True

    def checkpoint_msg(self, seq: int, msg: bytes) -> bytes | None:
        return self.byz.checkpoint(seq, msg)

    def after_checkpoint(self, seq: int) -> None:
        self.byz.after_checkpoint(seq)

    def on_stable(self, seq: int) -> None:
        if seq in self._corrupted and self.corrupt_lie_from is None:
            self.corrupt_lie_from = seq + max(1, int(self.cp * CORRUPT_LIE_AFTER))
        self._corrupted = {s for s in self._corrupted if s > seq}

    def file_data(self, out: wire.FileData) -> wire.FileData:
        return self.byz.file_data(out)

    def status(self) -> dict[str, Any]:
        return {"inject_fault": self.fault, "corrupt_lie_from": self.corrupt_lie_from}

    # ---- the fault file ---------------------------------------------------------------------
    async def watch(self) -> None:
        """Read the fault file at start and whenever it changes (every _POLL)."""
        path = self.fault_file
        assert path is not None
        seen = _mtime(path)
        if seen is not None:
            self.read_file(path)
        while True:
            await asyncio.sleep(_POLL)
            now = _mtime(path)
            if now != seen:
                seen = now
                self.read_file(path)

    def read_file(self, path: Path) -> None:
        """A drill turns this replica faulty (or correct again) without restarting it: a
        guest's runtime cannot be restarted with --inject-fault in less than seconds."""
        try:
            body = json.loads(path.read_text())
            fault = body.get("fault")
            slow_ms = body.get("slow_report_ms", SLOW_REPORT_SECONDS * 1000)
            lie = body.get("lie", True)
        except FileNotFoundError:
            body, fault, slow_ms, lie = {}, None, SLOW_REPORT_SECONDS * 1000, True
        except (OSError, ValueError, AttributeError) as e:
            self.counters["bad_fault_file"] += 1
            log.warning("%s: %s", path, e)
            return
        if fault is not None and fault not in FAULTS + BYZANTINE_BEHAVIOURS:
            self.counters["bad_fault_file"] += 1
            log.warning("%s: unknown fault %r", path, fault)
            return
        if (
            isinstance(slow_ms, bool)
            or not isinstance(slow_ms, int | float)
            or not (0 <= slow_ms <= 600_000)
        ):
            self.counters["bad_fault_file"] += 1
            log.warning("%s: slow_report_ms must be a number of ms in 0..600000", path)
            return
        if not isinstance(lie, bool):
            self.counters["bad_fault_file"] += 1
            log.warning("%s: lie must be true or false", path)
            return
        try:
            self.byz.configure(fault, body if isinstance(body, dict) else {})
        except ValueError as e:
            self.counters["bad_fault_file"] += 1
            log.warning("%s: %s", path, e)
            return
        self.slow_report_s = slow_ms / 1000
        self.corrupt_lies = lie
        if fault != self.fault:
            log.warning("drill: injected fault now %s", fault)
            self.counters["fault_switches"] += 1
            self.fault = fault
            self.on_switch()
