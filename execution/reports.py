"""execution/reports.py - the EXEC-REPORTs an execution replica keeps to send again
(docs/execution.md "Reports sent again").

A report goes to every agreement replica over a reconnecting link (zz/link.py), which drops
what is sent while it is down, and a connection that breaks loses what was still in flight.
An agreement replica that missed a correct replica's report sees it silent: its timer
expires and it signs a fault statement with "-" for it, and g+1 such statements convict the
correct replica (docs/fault-detection.md §3). So the runtime keeps its newest reports and
sends them again on every fresh connection to an agreement replica, after the registration
(Runtime.on_link_connect); a report the replica already holds changes nothing there.

Bounds: at most `limit` reports (the rack's log_window, the agreement window: the runtime
executes nothing an agreement replica that keeps up has not ordered within it), and none at
or below the stable execution checkpoint that every agreement replica last named in a
FETCH-REPLY (kind 3). One replica is sent only the reports above the stable execution
checkpoint it last named itself: it holds an execution certificate there, or judged that
seq long ago."""

from __future__ import annotations

from collections import OrderedDict

from zz import wire


class SentReports:
    """The newest EXEC-REPORTs sent (without MACs: each resend is authenticated for its one
    receiver), by seq, ascending; and the stable execution checkpoint each of the `n`
    agreement replicas last named. A claim can only spare its own claimant resends: a
    report is forgotten for all only below what every replica named."""

    def __init__(self, n: int, limit: int) -> None:
        if n < 1 or limit < 1:
            raise ValueError(f"n={n}, limit={limit}: both must be at least 1")
        self.n = n
        self.limit = limit
        self._reports: OrderedDict[int, wire.ExecReport] = OrderedDict()
        self._stable = [0] * n

    def __len__(self) -> int:
        return len(self._reports)

    def add(self, rep: wire.ExecReport) -> None:
        """A report just sent. Seqs only rise in one runtime; should one not, what was kept
        at and above it goes (the newest execution's report is the one to send)."""
        while self._reports and next(reversed(self._reports)) >= rep.seq:
            self._reports.popitem(last=True)
        self._reports[rep.seq] = rep
        while len(self._reports) > self.limit:
            self._reports.popitem(last=False)
        self._collect()

    def stable_at(self, replica: int, seq: int) -> None:
        """Agreement replica `replica` named `seq` its stable execution checkpoint (its
        latest claim counts: a replica that restarted may name a lower one)."""
        if 0 <= replica < self.n:
            self._stable[replica] = seq
            self._collect()

    def for_replica(self, replica: int) -> list[wire.ExecReport]:
        """What to send `replica` again on a fresh connection, ascending."""
        low = self._stable[replica] if 0 <= replica < self.n else 0
        return [rep for seq, rep in self._reports.items() if seq > low]

    def _collect(self) -> None:
        low = min(self._stable)
        while self._reports and next(iter(self._reports)) <= low:
            self._reports.popitem(last=False)
