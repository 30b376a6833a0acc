# zz/drill/kind.py - DrillKind: what one kind of drill needs from the rack, how it injects its
# fault, what the verdict must see and what it reports. One subclass per kind (kinds.py).
"""The drill kind's interface (docs/operations.md, "Drills", the table of kinds).

The drill (zz/drill/runner.py) owns one DrillKind and calls it in this order:

    refuse()          at construction: the arguments this kind cannot run with
    choose(obs)       once the rack is observed: its targets (a running replica, a host)
    inject(obs)       at the fault; may start `task` (a faulty client) for the whole drill
    after_watch(obs)  once the watch after the fault ended, before the settling
    cleanup()         at the end, also when the drill failed (a fault that must not stay)
    report_details(d) the details it keeps, made JSON (Counter -> dict)
    judge(r, obs)     the verdict: appends to the drill's reasons (FAIL) and notes

The class attributes say what the rest of the drill needs to know without asking the kind
by name: whether it is an execution fault (`convicts`: the rack needs a sleeping spare, and
a replica must be convicted), which stats counters are its detection, and whether a WAKEUP
before the fault fails it. A kind works on the drill's shared findings (`details`,
`faulted`, `reasons`, `notes`) through `self.drill`."""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING, ClassVar

from zz import report as rp
from zz.drill.observe import Observer

if TYPE_CHECKING:
    from zz.drill.runner import Drill

# Agreement stats counters whose first change after the fault is the detection: the view
# (primary), or a signed fault statement / mismatch / WAKEUP sent (execution faults).
# exec_timeouts alone is not: late reports happen under load without any fault.
PRIMARY_KEYS = ("view", "in_view_change", "view_changes")
DETECT_KEYS = ("fault_statements_sent", "exec_mismatches", "wakeups_sent")


class DrillKind:
    """One kind of fault a drill injects."""

    name: ClassVar[str]
    # An execution fault: the service needs a sleeping spare the agreement replicas know,
    # and the fault must be detected, the spare woken and the faulty replica convicted.
    convicts: ClassVar[bool] = False
    # Stats counters of the drilled service's agreement replicas whose first change after
    # the fault is its detection.
    detect_keys: ClassVar[tuple[str, ...]] = DETECT_KEYS
    # A WAKEUP a controld logged before the fault: a false wake-up under load (a FAIL), or
    # only a note where the kind's own fault is not an execution fault's.
    wakeup_before_fault_fails: ClassVar[bool] = True

    def __init__(self, drill: Drill) -> None:
        self.drill = drill
        # A faulty client running from the fault to the end of the load, cancelled then.
        self.task: asyncio.Task[None] | None = None

    def refuse(self, args: argparse.Namespace) -> None:
        """Raise DrillError for arguments this kind cannot run with."""

    def choose(self, obs: Observer) -> None:
        """Pick the targets of the fault from the rack as first observed."""

    async def inject(self, obs: Observer) -> int | None:
        """Inject the fault. The monotonic ns its clock starts at when that is not the
        moment inject() is called (a runtime switched in place, lies held back)."""
        raise NotImplementedError

    async def after_watch(self, obs: Observer) -> None:
        """After the watch, before the settling: undo a fault that lasts only while it is
        watched (partition: the link comes back) and wait for what follows from that."""

    async def cleanup(self) -> None:
        """At the end of the drill, whatever happened: undo what the drill must not leave
        behind (partition: a link still cut)."""

    def report_details(self, details: dict[str, object]) -> None:
        """Make the details this kind added JSON (its Counters become dicts)."""

    def judge(self, r: rp.DrillReport, obs: Observer) -> None:
        """The verdict: what this kind must see, as reasons (FAIL) and notes."""
        raise NotImplementedError

    # ---- shared by the verdicts -----------------------------------------------------------
    def need_progress(self, r: rp.DrillReport) -> None:
        """The service went on: an operation issued after the fault completed (after its
        detection, when there was one), and some completed at the end of the watch (the
        report's after-recovery window, rp.after_window)."""
        reasons = self.drill.reasons
        if r.first_correct_reply_s is None:
            after = " after the fault's detection" if r.detection_s is not None else ""
            reasons.append(f"no operation issued after the fault completed{after}")
        if r.load_after is not None and r.load_after == 0:
            reasons.append(
                "no operation completed at the end of the watch"
                f" ({r.details.get('after_window_s')} s after the fault): the service is stuck"
            )
