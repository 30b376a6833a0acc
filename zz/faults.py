# zz/faults.py - fault detection decisions of the agreement cluster (docs/design.md §5.2-§5.6).
# Pure functions: is a wake-up justified, whom to wake, whom to convict and put back to sleep.
"""ZZ fault detection, as decisions over already-verified fault statements.

The model, the rules and where each comes from are in docs/fault-detection.md; the
worked scenarios are in tests/vectors/faults.txt, shared with the C implementation.

Everything here is a function of the statements, ``f``, ``g`` and replica ids; there
is deliberately no client input anywhere: a faulty client must never be able to wake
a sleeping replica (docs/design.md §1), so nothing a client says can reach these rules.

Signatures are checked by the caller (Ed25519: zz/certs.py for controld, zz-agreed for its
peers): a ``FaultStatement`` handed in here is trusted to come from ``signer``.  What is
*not* trusted is that signers are distinct, in range, talk about the same
``(service, seq)`` and replica set, or that a signer is correct; all of that is checked
here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "Kind",
    "Entry",
    "FaultStatement",
    "WakeupDecision",
    "Resolution",
    "certified_digest",
    "is_fault_row",
    "timer_duration",
    "is_late",
    "convictable",
    "evaluate_evidence",
    "resolve",
]


class Kind(Enum):
    """What an agreement replica saw from one execution replica for one seq."""

    ONTIME = "ontime"  # an EXEC-REPORT digest that arrived before the timer expired
    LATE = "late"  # a digest that arrived after the timer expired (the TR's hatted P)
    NONE = "none"  # nothing (yet)


@dataclass(frozen=True, slots=True)
class Entry:
    """One cell of a fault statement row.

    A late digest never equals an on-time one, even with the same bytes: that is what
    turns a timeout into a mismatch that can be convicted (docs/fault-detection.md §2).
    """

    kind: Kind
    digest: bytes | None = None

    def __post_init__(self) -> None:
        if (self.kind is Kind.NONE) != (self.digest is None):
            raise ValueError("an entry has a digest unless it is NONE")

    @classmethod
    def ontime(cls, digest: bytes) -> Entry:
        return cls(Kind.ONTIME, digest)

    @classmethod
    def late(cls, digest: bytes) -> Entry:
        return cls(Kind.LATE, digest)

    @classmethod
    def missing(cls) -> Entry:
        return cls(Kind.NONE, None)

    def is_ontime(self, digest: bytes) -> bool:
        return self.kind is Kind.ONTIME and self.digest == digest


@dataclass(frozen=True, slots=True)
class FaultStatement:
    """A verified, signed fault statement: agreement replica ``signer``'s row for ``seq``.

    ``replicas`` are the execution replicas awake at ``seq`` in ascending id order;
    ``entries[k]`` is what ``signer`` saw from ``replicas[k]``.
    """

    signer: int
    service: str
    seq: int
    replicas: tuple[int, ...]
    entries: tuple[Entry, ...]

    def entry(self, replica: int) -> Entry:
        return self.entries[self.replicas.index(replica)]


@dataclass(frozen=True, slots=True)
class WakeupDecision:
    """Outcome of evaluating WAKEUP evidence.

    ``reason`` is one of: ``ok``, ``bad-params``, ``bad-signer``, ``duplicate-signer``,
    ``wrong-seq`` (service or seq differ), ``shape`` (replica set or row length),
    ``not-a-fault`` (a row holds an execution certificate), ``too-few-signers``,
    ``not-convictable``, ``empty-round`` (nobody is asleep to wake and fewer than 2f+1
    are awake, so a round that wakes nobody could not be sure to decide).  The C side
    reports the same codes.
    """

    justified: bool
    reason: str
    signers: tuple[int, ...] = ()
    wake: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Resolution:
    """What to do once the awake replicas (old and newly woken) have reported.

    ``decided`` is the digest ``f+1`` replicas agree on, or None while there is none
    (then every other field is empty: wait for more reports, or start another round).
    ``shortfall`` counts replicas still needed for ``f+1`` active ones; ``provision``
    counts fresh sleepers to create so that ``f`` spares exist again.
    """

    decided: bytes | None
    convict: tuple[int, ...] = ()
    stay_active: tuple[int, ...] = ()
    to_sleep: tuple[int, ...] = ()
    shortfall: int = 0
    provision: int = 0


def certified_digest(entries: Iterable[Entry], f: int) -> bytes | None:
    """The digest of ``f+1`` matching on-time entries (an execution certificate), if any."""
    counts = Counter(e.digest for e in entries if e.kind is Kind.ONTIME)
    for digest, n in counts.items():
        if n >= f + 1:
            return digest
    return None


def is_fault_row(entries: Iterable[Entry], f: int) -> bool:
    """A correct agreement replica signs a row only when it holds no certificate."""
    return certified_digest(entries, f) is None


def timer_duration(t1: float, k: float, floor: float, ceiling: float) -> float:
    """How long after the first EXEC-REPORT a replica waits for the others.

    ``t1`` is the time from this agreement replica's commit of ``seq`` to the first
    EXEC-REPORT for it.  The floor keeps a faulty replica that answers instantly
    (t1 near 0) from making every correct replica late; the ceiling bounds how long
    a slow first report can delay detection.
    """
    if not (k >= 1 and 0 <= floor <= ceiling and t1 >= 0):
        raise ValueError("need k >= 1, 0 <= floor <= ceiling, t1 >= 0")
    return min(max(k * t1, floor), ceiling)


def is_late(
    arrival: float, commit: float, first: float, k: float, floor: float, ceiling: float
) -> bool:
    """Whether a report arriving at ``arrival`` is recorded LATE (all times absolute)."""
    return arrival > first + timer_duration(first - commit, k, floor, ceiling)


def _against(rows: Sequence[FaultStatement], replica: int, digest: bytes) -> int:
    """How many rows show ``replica`` without an on-time ``digest``."""
    return sum(1 for r in rows if not r.entry(replica).is_ontime(digest))


def convictable(rows: Sequence[FaultStatement], g: int) -> bool:
    """Definition 1 in our terms (docs/fault-detection.md §3).

    Whatever digest turns out correct, some replica is shown without it, on time, by
    at least g+1 rows, so at least one correct agreement replica vouches for it.
    A digest nobody reported on time is covered trivially (every replica, every row).
    """
    if len(rows) < g + 1:
        return False
    replicas = rows[0].replicas
    candidates = {e.digest for r in rows for e in r.entries if e.digest is not None}
    return all(any(_against(rows, j, d) >= g + 1 for j in replicas) for d in candidates)


def _wrong(rows: Sequence[FaultStatement], replica: int, digest: bytes) -> int:
    """How many rows show ``replica`` with a digest other than ``digest``, on time or late."""
    return sum(
        1
        for r in rows
        if r.entry(replica).kind is not Kind.NONE and r.entry(replica).digest != digest
    )


def _blamed(
    rows: Sequence[FaultStatement],
    awake: Sequence[int],
    decided: bytes,
    g: int,
    answered: Set[int],
) -> set[int]:
    """The awake replicas the evidence convicts once ``decided`` is known (TR §9.1.1).

    A mismatch first: replicas that g+1 rows show with a wrong digest (late or not) are
    faulty whatever the timing. Timeouts count for replicas that g+1 rows show without
    ``decided`` on time (late, silent or wrong), but when someone is blamed for a mismatch
    only for those that have not ``answered`` this agreement replica at all by now.
    "Mismatches are more egregious than late but correct responses": a wrong early reply
    may have started the timer a correct replica then missed (Lemma 2, example 2: E1 Q Q P
    P, E2 P̂ P̂ P P shuts down E1 only). A replica that never answered, while the woken
    ones recovered and answered, gave no late but correct response to excuse (a crash next
    to a liar, f = 2: campaign seed 3102 round 12).
    """
    mismatch = {j for j in awake if _wrong(rows, j, decided) >= g + 1}
    timeout = {j for j in awake if _against(rows, j, decided) >= g + 1}
    if mismatch:
        return mismatch | {j for j in timeout if j not in answered}
    return timeout


def _check(
    statements: Sequence[FaultStatement],
    *,
    f: int,
    g: int,
    service: str,
    seq: int,
    awake: Sequence[int],
) -> str | None:
    if f < 0 or g < 0 or list(awake) != sorted(set(awake)) or not awake:
        return "bad-params"
    signers: set[int] = set()
    for s in statements:
        if not 0 <= s.signer <= 3 * g:
            return "bad-signer"
        if s.signer in signers:
            # One signer twice would let g faulty replicas look like g+1.
            return "duplicate-signer"
        signers.add(s.signer)
        if s.service != service or s.seq != seq:
            return "wrong-seq"
        if s.replicas != tuple(awake) or len(s.entries) != len(awake):
            return "shape"
        if not is_fault_row(s.entries, f):
            return "not-a-fault"
    return None


def _wake_count(rows: Sequence[FaultStatement], f: int) -> int:
    """Replicas still missing from the largest group every row agrees on.

    Intersecting over all rows means a faulty row can only make the group smaller,
    i.e. wake more replicas (never more than f in total), never fewer.
    """
    replicas = rows[0].replicas
    best = 0
    for d in {e.digest for e in rows[0].entries if e.kind is Kind.ONTIME}:
        assert d is not None
        group = sum(1 for j in replicas if all(r.entry(j).is_ontime(d) for r in rows))
        best = max(best, group)
    return f + 1 - best


def evaluate_evidence(
    statements: Sequence[FaultStatement],
    *,
    f: int,
    g: int,
    service: str,
    seq: int,
    awake: Sequence[int],
    sleeping: Sequence[int],
) -> WakeupDecision:
    """Is a wake-up for ``(service, seq)`` justified by these statements, and whom to wake?

    ``awake`` are the execution replicas the rows describe (ascending ids), ``sleeping``
    the spares that may be woken.  Sleepers are taken in ascending id order, so every
    agreement replica and every controld computes the same set.  With fewer than f+1
    awake (a shortfall left by an earlier round) no certificate can form, and g+1 rows
    wake the missing replicas without Definition 1 (docs/fault-detection.md §4).  With
    nobody asleep the wake set is empty, which is justified only over at least 2f+1 awake
    replicas (``empty-round`` otherwise; §4a).
    """
    reason = _check(statements, f=f, g=g, service=service, seq=seq, awake=awake)
    if reason is not None:
        return WakeupDecision(False, reason)
    rows = sorted(statements, key=lambda s: s.signer)
    signers = tuple(s.signer for s in rows)
    if len(rows) < g + 1:
        return WakeupDecision(False, "too-few-signers", signers)
    # A shortfall: fewer than f+1 awake can never certify anything, so g+1 rows over such
    # a set (at least one from a correct agreement replica that applied a SHUTDOWN leaving
    # fewer than f+1 active) justify waking up to f+1 without anyone to convict.
    if len(awake) >= f + 1 and not convictable(rows, g):
        return WakeupDecision(False, "not-convictable", signers)
    # Nobody asleep: a round that wakes nobody decides from the awake replicas' own reports
    # (docs/fault-detection.md §4a). Only with at least 2f+1 awake are f+1 of them correct,
    # so that their reports decide a digest; with fewer the statements wait for a spare.
    if not sleeping and len(awake) < 2 * f + 1:
        return WakeupDecision(False, "empty-round", signers)
    count = min(_wake_count(rows, f), len(sleeping))
    return WakeupDecision(True, "ok", signers, tuple(sorted(sleeping)[:count]))


def resolve(
    statements: Sequence[FaultStatement],
    reports: Mapping[int, Entry],
    *,
    f: int,
    g: int,
    service: str,
    seq: int,
    awake: Sequence[int],
    woken: Sequence[int],
) -> Resolution:
    """Convictions and the new active set once the woken replicas have reported.

    ``statements`` is the evidence that justified the wake-up; ``reports`` is this
    agreement replica's own view of what every replica in ``awake`` and ``woken``
    reported for ``seq`` (late ones still marked LATE).  A replica is convicted when
    it reported a digest other than the decided one to this agreement replica, and an
    awake replica when the evidence blames it (``_blamed``: a wrong digest shown by g+1
    rows, or the decided digest missing or late in g+1 rows, which is excused when
    another awake replica is blamed for a wrong digest and this one did answer here).  Of
    the rest, replicas that reported the decided digest stay active
    first (``awake`` before ``woken``, ascending ids, since the old ones hold their state
    already); everyone beyond f+1 goes back to sleep.
    """
    reason = _check(statements, f=f, g=g, service=service, seq=seq, awake=awake)
    if reason is not None:
        raise ValueError(f"evidence rejected: {reason}")
    everyone = [*awake, *sorted(woken)]
    if len(set(everyone)) != len(everyone):
        raise ValueError("a woken replica is also awake")
    got = {j: reports.get(j, Entry.missing()) for j in everyone}
    counts = Counter(e.digest for e in got.values() if e.kind is not Kind.NONE)
    decided = [d for d, n in counts.items() if n >= f + 1]
    if not decided:
        return Resolution(None)
    if len(decided) > 1:
        raise ValueError("two digests with f+1 reports: more than f faulty replicas")
    d = decided[0]
    assert d is not None
    answered = {j for j in everyone if got[j].kind is not Kind.NONE}
    blamed = _blamed(statements, awake, d, g, answered)
    convict = tuple(
        sorted(
            j
            for j in everyone
            if (got[j].kind is not Kind.NONE and got[j].digest != d) or j in blamed
        )
    )
    keep = [j for j in everyone if j not in convict]
    # Replicas that produced the decided digest are known to hold the right state.
    ranked = [j for j in keep if got[j].digest == d] + [j for j in keep if got[j].digest != d]
    stay = ranked[: f + 1]
    return Resolution(
        decided=d,
        convict=convict,
        stay_active=tuple(sorted(stay)),
        to_sleep=tuple(sorted(ranked[f + 1 :])),
        shortfall=f + 1 - len(stay),
        provision=len(convict),
    )
