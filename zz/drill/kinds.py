# zz/drill/kinds.py - the registry of drill kinds: every DrillKind subclass by its name, in the
# order `zz drill --help` lists them. A new kind is one class and one entry here.
"""Drill kinds by name (docs/operations.md, "Drills", the table of kinds)."""

from __future__ import annotations

from zz.drill.client_faults import (
    BigRequest,
    ClientFlood,
    HalfFrames,
    MacSplit,
    Primary,
    SlowReader,
)
from zz.drill.exec_faults import (
    ByzantineHost,
    CorruptSnapshot,
    Crash,
    Partition,
    Slow,
    WrongReply,
)
from zz.drill.kind import DrillKind

CLIENT_KINDS = (Primary, ClientFlood, SlowReader, MacSplit, BigRequest, HalfFrames)
EXEC_KINDS = (WrongReply, Crash, Slow, CorruptSnapshot, ByzantineHost, Partition)
KINDS: dict[str, type[DrillKind]] = {k.name: k for k in CLIENT_KINDS + EXEC_KINDS}
