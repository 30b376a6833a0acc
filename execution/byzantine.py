# execution/byzantine.py - the Byzantine behaviours of an execution replica for the adversarial
# campaign (zz/campaign.py, `zz bench byzantine`). DRILLS ONLY: switched in place through the
# fault file (<state dir>/zz-fault.json, runtime --drill-faults), like the runtime's own FAULTS.
"""Byzantine execution-replica behaviours (docs/fault-detection.md, "Adversarial campaign").

The runtime calls this module only through execution/drillfaults.py (DrillFaults, the one
seam of test-only faults), at these points, and does what it always does when no behaviour
of this module is on:

* `report(seq, rep)` where it would send the EXEC-REPORT for `seq` to the agreement
  replicas: returns True if it sent (or withheld) it itself;
* `checkpoint(seq, msg)` where it sends its signed EXEC-CHECKPOINT: returns what to send
  instead (None: nothing);
* `after_checkpoint(seq)` once the checkpoint is taken and announced;
* `file_data(out)` where its snapshot file server answers a FILE-FETCH;
* `lying(seq)`: whether the replies of `seq` are wrong (as the runtime's wrong-reply).

Behaviours (the fault file's "fault"; parameters in the same JSON object):

  equivocate              correct replies to clients, but the EXEC-REPORT digest is wrong
                          at the agreement replicas listed in "to" (default: 0..g) and
                          right at the others
  future-seq              besides its correct reports, reports with bogus digests for
                          seqs ahead of the one it executed ("ahead": offsets)
  replay-old              besides its correct reports, its own earlier reports sent again
                          ("back": offsets; 1024 = the detection ring's size)
  wrong-checkpoint        signs a wrong EXEC-CHECKPOINT digest, and puts the same wrong
                          digest in its reports' checkpoint_ref (its state is right)
  withhold-checkpoint     sends no EXEC-CHECKPOINT
  crash-before-checkpoint the process dies after executing seq = -1 mod checkpoint_interval
  crash-after-checkpoint  the process dies right after announcing a checkpoint
  forged-fetch            its FILE-DATA answers carry flipped bytes; it also answers
                          wrongly once a checkpoint taken under the fault is stable (so a
                          spare is woken and fetches state)
  truncated-fetch         the same with FILE-DATA cut short (half the data, size kept)
  report-flood            each report also sent "copies" times, plus as many reports with
                          random digests for random seqs in the next "spread" seqs
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import random
import signal
from typing import TYPE_CHECKING, Any

from zz import wire

if TYPE_CHECKING:
    from zz.execution.runtime import Runtime

log = logging.getLogger("zz.execution.byzantine")

BEHAVIOURS = (
    "equivocate",
    "future-seq",
    "replay-old",
    "wrong-checkpoint",
    "withhold-checkpoint",
    "crash-before-checkpoint",
    "crash-after-checkpoint",
    "forged-fetch",
    "truncated-fetch",
    "report-flood",
)
# Own reports kept for replay-old: one more than the agreement replicas' ring of 1024 seqs.
_KEEP_REPORTS = 1025
_DEFAULT_AHEAD = (1, 2, 64, 1024)
_DEFAULT_BACK = (1, 32, 1024)
# Fetch liars start lying (wrong replies) this far (fraction of an interval) past the first
# checkpoint taken under the fault once it is stable, as the runtime's corrupt-snapshot.
_LIE_AFTER = 0.25


def _ints(v: Any, default: tuple[int, ...]) -> tuple[int, ...]:
    if v is None:
        return default
    if not isinstance(v, list) or not all(isinstance(x, int) and x >= 0 for x in v):
        raise ValueError("expected a list of non-negative integers")
    return tuple(v)


class Byzantine:
    """The behaviour currently on (None: the runtime's own code runs unchanged)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.mode: str | None = None
        self.to: frozenset[int] = frozenset()
        self.ahead: tuple[int, ...] = _DEFAULT_AHEAD
        self.back: tuple[int, ...] = _DEFAULT_BACK
        self.copies = 20
        self.spread = 256
        # seq -> own report and the keys to MAC it with, the last _KEEP_REPORTS (in seq
        # order); MACed only when replay-old sends it again, not for every batch.
        self._sent: dict[int, tuple[wire.ExecReport, dict[int, bytes]]] = {}
        self._lie_from: int | None = None
        self._armed_at: int | None = None  # fetch liars: first checkpoint under the fault
        self._rng = random.Random(os.getpid())

    # ---- switching ----------------------------------------------------------------------
    def configure(self, fault: str | None, body: dict[str, Any]) -> None:
        """Validate and apply the fault file's body (ValueError: nothing changes)."""
        if fault is not None and fault not in BEHAVIOURS:
            fault = None  # one of the runtime's own FAULTS: nothing here
        to = body.get("to")
        if to is not None and (
            not isinstance(to, list) or not all(isinstance(x, int) and x >= 0 for x in to)
        ):
            raise ValueError("to: expected a list of agreement replica indices")
        ahead = _ints(body.get("ahead"), _DEFAULT_AHEAD)
        back = _ints(body.get("back"), _DEFAULT_BACK)
        copies, spread = body.get("copies", 20), body.get("spread", 256)
        if not all(isinstance(x, int) and 0 <= x <= 10_000 for x in (copies, spread)):
            raise ValueError("copies, spread: integers in 0..10000")
        self.to = frozenset(to if to is not None else range(self.rt.svc.g + 1))
        self.ahead, self.back, self.copies, self.spread = ahead, back, copies, spread
        if fault != self.mode:
            self._lie_from = None
            self._armed_at = None
        self.mode = fault

    # ---- hooks ----------------------------------------------------------------------------
    def lying(self, seq: int) -> bool:
        if self.mode not in ("forged-fetch", "truncated-fetch"):
            return False
        if self._lie_from is None and self._armed_at is not None:
            stable = self.rt.ckpt.stable
            if stable >= self._armed_at:
                self._lie_from = stable + max(1, int(self.rt.cp * _LIE_AFTER))
        return self._lie_from is not None and seq >= self._lie_from

    def report(self, seq: int, rep: wire.ExecReport) -> bool:
        """Send the EXEC-REPORT for `seq` (True) or leave it to the runtime (False)."""
        rt, mode = self.rt, self.mode
        keys = rt.agree_keys
        if mode == "wrong-checkpoint" and any(
            r.client == wire.CHECKPOINT_REF_CLIENT for r in rep.replies
        ):
            # The checkpoint digest a report carries (wire.checkpoint_ref) is the same lie.
            refs = [
                r._replace(result_digest=_lie(r.result_digest))
                if r.client == wire.CHECKPOINT_REF_CLIENT
                else r
                for r in rep.replies
            ]
            rep = wire.ExecReport.of(rep.service, rep.sender, seq, refs)
            rt.counters["byz_checkpoint_refs_forged"] += 1
        self._sent[seq] = (rep, keys)
        while (oldest := next(iter(self._sent))) <= seq - _KEEP_REPORTS:
            del self._sent[oldest]
        if mode is None or mode not in ("equivocate", "future-seq", "replay-old", "report-flood",
                                        "crash-before-checkpoint", "wrong-checkpoint"):  # fmt: skip
            return False
        good = rep.with_macs(keys).encode()
        svc, me = rt.svc.id, rt.me
        if mode == "equivocate":
            bad = wire.ExecReport.of(svc, me, seq, _wrong(rep.replies, seq)).with_macs(keys)
            raw_bad = bad.encode()
            for link in rt._links:
                link.send(raw_bad if link.peer in self.to else good)
            rt.counters["byz_equivocations"] += 1
            return True
        rt._send_agreement(good)
        if mode == "future-seq":
            for d in self.ahead:
                if d:
                    fake = wire.ExecReport.of(svc, me, seq + d, _wrong([], seq + d))
                    rt._send_agreement(fake.with_macs(keys).encode())
                    rt.counters["byz_future_reports"] += 1
        elif mode == "replay-old":
            for d in self.back:
                old = self._sent.get(seq - d)
                if d and old is not None:
                    rt._send_agreement(old[0].with_macs(old[1]).encode())
                    rt.counters["byz_replayed_reports"] += 1
        elif mode == "report-flood":
            for _ in range(self.copies):
                rt._send_agreement(good)
                s = seq + self._rng.randrange(-self.spread, self.spread + 1)
                fake = wire.ExecReport.of(svc, me, max(1, s), _wrong([], self._rng.random()))
                rt._send_agreement(fake.with_macs(keys).encode())
            rt.counters["byz_flood_reports"] += 2 * self.copies
        elif mode == "crash-before-checkpoint" and (seq + 1) % rt.cp == 0:
            _crash(f"crash-before-checkpoint after seq {seq}")
        return True

    def checkpoint(self, seq: int, msg: bytes) -> bytes | None:
        """The signed EXEC-CHECKPOINT to send for `seq` (None: withheld)."""
        rt, mode = self.rt, self.mode
        if mode in ("forged-fetch", "truncated-fetch") and self._armed_at is None:
            self._armed_at = seq
        if mode == "withhold-checkpoint":
            rt.counters["byz_checkpoints_withheld"] += 1
            return None
        if mode == "wrong-checkpoint":
            m = wire.decode(msg)
            assert isinstance(m, wire.ExecCheckpoint)
            lie = _lie(m.checkpoint)
            rt.counters["byz_checkpoints_forged"] += 1
            return wire.ExecCheckpoint(m.service, m.sender, seq, lie).signed(rt.sign_key).encode()
        return msg

    def after_checkpoint(self, seq: int) -> None:
        if self.mode == "crash-after-checkpoint":
            _crash(f"crash-after-checkpoint at {seq}")

    def file_data(self, out: wire.FileData) -> wire.FileData:
        if self.mode == "forged-fetch" and out.data:
            data = bytearray(out.data)
            data[len(data) // 2] ^= 0xFF
            self.rt.counters["byz_fetch_forged"] += 1
            return dataclasses.replace(out, data=bytes(data))
        if self.mode == "truncated-fetch" and out.data:
            self.rt.counters["byz_fetch_truncated"] += 1
            return dataclasses.replace(out, data=out.data[: len(out.data) // 2])
        return out


def _wrong(refs: list[wire.ReplyRef], salt: object) -> list[wire.ReplyRef]:
    """A reply list whose digest no correct replica reports: every result digest changed,
    or (an empty list, a null batch) one made-up reply."""
    if not refs:
        return [wire.ReplyRef(0, 0, hashlib.sha256(b"byzantine %r" % (salt,)).digest())]
    return [r._replace(result_digest=hashlib.sha256(b"x" + r.result_digest).digest()) for r in refs]


def _lie(digest: bytes) -> bytes:
    return hashlib.sha256(b"wrong" + digest).digest()


def _crash(why: str) -> None:
    log.warning("drill: %s: crashing", why)
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    os.kill(os.getpid(), signal.SIGKILL)
