"""execution/certificates.py - commit certificates of an execution replica (docs/design.md §3.3).
A batch runs only once 2g+1 distinct agreement replicas vouch for the same (seq, digest)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from zz.crypto import NULL_DIGEST, sha256

# How far above the last executed seq votes are kept. Agreement replicas never commit
# beyond their log window, so a seq this far ahead is garbage (or an attack on memory).
DEFAULT_WINDOW = 4096


@dataclass(frozen=True)
class Vote:
    digest: bytes
    batch: bytes
    view: int  # 0 for FETCH-REPLY log entries, which carry no view


@dataclass(frozen=True)
class Certificate:
    """2g+1 matching votes for `seq`: the batch is committed and may be executed."""

    seq: int
    digest: bytes
    batch: bytes  # empty for a null request
    view: int
    replicas: frozenset[int]

    @property
    def is_null(self) -> bool:
        return self.digest == NULL_DIGEST


@dataclass
class _Slot:
    votes: dict[int, Vote] = field(default_factory=dict)
    first_at: float = 0.0  # the first vote's arrival (time.monotonic())
    ready_at: float | None = None  # when 2g+1 votes first matched


class CommitCollector:
    """Votes per seq from agreement replicas 0..n-1; certificates for the next seq.

    A replica's first authenticated vote for a seq is the one that counts: a correct
    replica never commits two batches at one seq, so a later conflicting vote can only
    come from a faulty one and must not let it vote twice.
    """

    def __init__(self, n: int, g: int, window: int = DEFAULT_WINDOW) -> None:
        if n != 3 * g + 1:
            raise ValueError(f"n={n} agreement replicas do not match g={g}")
        self.n = n
        self.g = g
        self.window = window
        self.last_executed = 0
        # A checkpoint being installed: votes are kept within `window` of it too (the log
        # above it arrives during the install, before last_executed jumps to it).
        self.floor = 0
        self._slots: dict[int, _Slot] = {}
        self.dropped: Counter[str] = Counter()

    @property
    def quorum(self) -> int:
        return 2 * self.g + 1

    def add(
        self,
        replica: int,
        seq: int,
        digest: bytes,
        batch: bytes,
        view: int = 0,
        *,
        hashed: bool = False,
    ) -> bool:
        """Record one (already authenticated) vote; False when it does not count. `hashed`:
        the caller checked that `batch` hashes to `digest` (wire.log_reply does, for every
        entry of a FETCH-REPLY's log), so it is not hashed again."""
        if not 0 <= replica < self.n:
            self.dropped["bad_sender"] += 1
            return False
        if seq <= self.last_executed:
            self.dropped["old"] += 1
            return False
        if seq > max(self.last_executed, self.floor) + self.window:
            self.dropped["too_far"] += 1
            return False
        if len(digest) != 32:
            self.dropped["bad_digest"] += 1
            return False
        # A vote whose batch does not hash to its digest proves nothing about the batch;
        # keeping it could let a faulty replica park garbage under a good digest.
        if digest == NULL_DIGEST:
            if batch:
                self.dropped["bad_batch"] += 1
                return False
        elif not hashed and sha256(batch) != digest:
            self.dropped["bad_batch"] += 1
            return False
        slot = self._slots.get(seq)
        if slot is None:
            slot = self._slots[seq] = _Slot(first_at=time.monotonic())
        prev = slot.votes.get(replica)
        if prev is not None:
            self.dropped["duplicate" if prev.digest == digest else "conflict"] += 1
            return False
        slot.votes[replica] = Vote(digest, batch, view)
        if slot.ready_at is None and sum(v.digest == digest for v in slot.votes.values()) >= (
            self.quorum
        ):
            slot.ready_at = time.monotonic()
        return True

    def expect(self, seq: int) -> None:
        """The replica is about to jump to checkpoint `seq`: keep votes up to `window`
        above it."""
        self.floor = max(self.floor, seq)

    def arrival(self, seq: int) -> tuple[float, float | None] | None:
        """When seq's first vote arrived and when 2g+1 of them matched (monotonic), if
        its votes are still held (not yet executed)."""
        slot = self._slots.get(seq)
        return None if slot is None else (slot.first_at, slot.ready_at)

    def certificate(self, seq: int) -> Certificate | None:
        slot = self._slots.get(seq)
        if slot is None:
            return None
        counts = Counter(v.digest for v in slot.votes.values())
        if not counts:
            return None
        digest, count = counts.most_common(1)[0]
        if count < self.quorum:
            return None
        voters = {r: v for r, v in slot.votes.items() if v.digest == digest}
        views = sorted((v.view for v in voters.values()), reverse=True)
        # The (g+1)-th highest view among the voters is vouched for by a correct replica.
        view = views[self.g]
        batch = next(iter(voters.values())).batch
        return Certificate(seq, digest, batch, view, frozenset(voters))

    def ready_through(self) -> int:
        """The highest seq up to which every seq above last_executed holds 2g+1 matching
        votes (last_executed when the next one does not)."""
        seq = self.last_executed
        while self.certificate(seq + 1) is not None:
            seq += 1
        return seq

    def next_ready(self) -> Certificate | None:
        """The certificate for last_executed + 1, if complete."""
        return self.certificate(self.last_executed + 1)

    def executed(self, seq: int) -> None:
        """seq has run: forget its votes and everything below."""
        if seq <= self.last_executed:
            return
        self.last_executed = seq
        for s in [s for s in self._slots if s <= seq]:
            del self._slots[s]

    def pending(self) -> list[int]:
        """Seqs holding votes (all above last_executed), ascending."""
        return sorted(self._slots)

    def votes(self, seq: int) -> dict[int, bytes]:
        """Replica -> digest voted for seq (for status and tests)."""
        slot = self._slots.get(seq)
        return {r: v.digest for r, v in slot.votes.items()} if slot else {}
