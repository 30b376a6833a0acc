# zz/certs.py - the verifier of WAKEUP and SHUTDOWN certificates that controld acts on.
# Signatures, principals and replica sets are checked here; the fault rules are zz/faults.py.
"""Verification of the agreement cluster's control certificates (docs/fault-detection.md,
"The C port and the certificate verifier").

controld never imports the agreement code: it trusts a wake-up or a shutdown only
through what this module checks against the service's public keys (the key directory,
``keys/s<service>/public``).

* ``verify_wakeup`` checks one self-certifying WAKEUP message: the outer signature of an
  agreement replica, ``g+1`` signed FAULT-STATEMENTs from distinct agreement replicas of
  the same service, seq and awake set, the fault rules (``zz.faults.evaluate_evidence``)
  and that the replicas to wake are exactly the ones those rules choose.
* ``ShutdownCollector`` gathers SHUTDOWN votes; ``g+1`` identical bodies from distinct
  agreement replicas make one ``Shutdown`` certificate, each body returned once (a second
  body certified for the same round is returned too).
* ``merge_outcomes`` is the one outcome of several bodies certified at one seq: what
  controld and zz-agreed both act on when correct agreement replicas split.
* ``Freshness`` is the replay guard controld persists: a round already acted upon is a
  ``duplicate``, a round at or below the last completed SHUTDOWN of the service is
  ``stale``; it keeps the outcome acted on at that seq, which a further certificate at
  the same seq is merged with.

Every failure raises ``CertError`` with a short reason string, never anything else: a
certificate is untrusted input and must not be able to crash controld.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zz import faults, keys, wire
from zz.atomicfile import write_atomic
from zz.config import Config, Service

__all__ = [
    "CertError",
    "ServiceTrust",
    "Wakeup",
    "Shutdown",
    "Outcome",
    "merge_outcomes",
    "service_of",
    "verify_wakeup",
    "verify_shutdown_vote",
    "ShutdownCollector",
    "Freshness",
]

# Reasons raised here on top of the evaluate reasons of zz/faults.py (docs/fault-detection.md §4).
REASONS = (
    "malformed",  # does not decode as a ZZ message, or a list is not ascending and distinct
    "wrong-type",  # not a WAKEUP / SHUTDOWN, or evidence that is not a FAULT-STATEMENT
    "wrong-service",  # header service differs from the service the caller verifies for
    "bad-sender",  # the outer sender is not an agreement replica 0..3g
    "bad-signature",  # a signature does not verify, or the signer has no public key
    "mixed-service",  # an evidence statement from another service
    "bad-awake",  # the evidence's awake set names a replica outside 0..n_exec-1
    "bad-sleeping",  # sleeping not ascending, out of range or overlapping the awake set
    "wrong-wake",  # wake differs from what the rules choose from sleeping
    "conflicting",  # one agreement replica voted two different SHUTDOWN bodies
    "duplicate",  # this round was already acted upon
    "stale",  # at or below the last completed SHUTDOWN of the service
)


class CertError(Exception):
    """A certificate that must not be acted upon; ``reason`` is a stable short code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class ServiceTrust:
    """What a verifier needs about one service: its agreement replicas' public keys
    (principal id -> Ed25519 key), f, g and the number of execution replicas."""

    service: int
    keys: Mapping[int, bytes]
    f: int
    g: int
    n_exec: int

    @classmethod
    def load(cls, key_dir: Path, service: Service, config: Config | None = None) -> ServiceTrust:
        """From the key directory (raises zz.keys.KeyFileError) and the service's config;
        with the rack `config`, re-keyed execution slots under their current key only."""
        if config is not None:
            pub = keys.service_publics(key_dir, config, service)
        else:
            pub = keys.load_public(keys.public_path(key_dir, service.id))
        return cls(service.id, pub, service.f, service.g, service.n_exec)


@dataclass(frozen=True)
class Wakeup:
    """A verified WAKEUP: wake ``wake`` for the round ``(service, seq, awake)``."""

    service: int
    seq: int
    sender: int
    awake: tuple[int, ...]
    sleeping: tuple[int, ...]
    wake: tuple[int, ...]
    signers: tuple[int, ...]
    raw: bytes = field(repr=False)

    @property
    def round(self) -> tuple[int, int, tuple[int, ...]]:
        return (self.service, self.seq, self.awake)


@dataclass(frozen=True)
class Outcome:
    """How the round at ``seq`` was resolved: the body of one SHUTDOWN certificate, or the
    merge of several certified at that seq (``merge_outcomes``)."""

    service: int
    seq: int
    awake: tuple[int, ...]
    convict: tuple[int, ...]
    sleep: tuple[int, ...]
    active: tuple[int, ...]


@dataclass(frozen=True)
class Shutdown(Outcome):
    """A SHUTDOWN certificate: g+1 agreement replicas resolved the round the same way."""

    signers: tuple[int, ...]
    votes: tuple[bytes, ...] = field(repr=False)

    @property
    def round(self) -> tuple[int, int, tuple[int, ...]]:
        return (self.service, self.seq, self.awake)

    @property
    def outcome(self) -> Outcome:
        """The body alone (an Outcome compares equal only to an Outcome)."""
        return Outcome(self.service, self.seq, self.awake, self.convict, self.sleep, self.active)


def _nested(a: Sequence[int], b: Sequence[int]) -> bool:
    return set(a) <= set(b) or set(b) <= set(a)


def merge_outcomes(bodies: Sequence[Outcome]) -> Outcome:
    """The one outcome of the bodies certified for one round at one seq (campaign seed 3502
    round 63: correct agreement replicas split and two bodies were each certified by g+1).

    One distinct body is returned unchanged. Otherwise: awake is the union of the awake
    sets, convict the union of the convict lists, active the intersection of the active
    lists, and sleep every id any body names (awake, convict, sleep or active) that is
    neither convicted nor active; all ascending. The result depends on the set of bodies
    only, and merging a merge with more bodies equals merging them all at once, so
    convictions only grow and the active set only shrinks as certificates arrive: acting
    on each merge in turn never wakes a replica again. Raises ValueError for no bodies,
    bodies of different services or seqs, or awake sets that are not nested (one contains
    the other: the rounds of one seq grow their awake set).
    """
    if not bodies:
        raise ValueError("no SHUTDOWN body to merge")
    first = bodies[0]
    for b in bodies:
        if (b.service, b.seq) != (first.service, first.seq):
            raise ValueError(
                f"service {b.service} seq {b.seq} merged with service {first.service}"
                f" seq {first.seq}"
            )
    distinct = sorted({(b.awake, b.convict, b.sleep, b.active) for b in bodies})
    for i, (awake, *_) in enumerate(distinct):
        for other, *_ in distinct[i + 1 :]:
            if not _nested(awake, other):
                raise ValueError(f"awake sets {list(awake)} and {list(other)} are not nested")
    if len(distinct) == 1:
        return Outcome(first.service, first.seq, *distinct[0])
    awake_u = set().union(*(set(d[0]) for d in distinct))
    convict = set().union(*(set(d[1]) for d in distinct))
    active = set.intersection(*(set(d[3]) for d in distinct))
    named = awake_u.union(*(set(d[1]) | set(d[2]) | set(d[3]) for d in distinct))
    return Outcome(
        first.service,
        first.seq,
        tuple(sorted(awake_u)),
        tuple(sorted(convict)),
        tuple(sorted(named - convict - active)),
        tuple(sorted(active)),
    )


def _decode(raw: bytes, what: str) -> wire.Message:
    try:
        return wire.decode(raw)
    except wire.WireError as e:
        raise CertError("malformed", f"{what}: {e}") from e


def service_of(raw: bytes) -> int:
    """The header's service id, to pick the ServiceTrust before verifying."""
    return _decode(raw, "message").service


def _is_agreement(sender: int, g: int) -> bool:
    return 0 <= sender <= 3 * g


def _check_sig(msg: wire.Message, trust: ServiceTrust, what: str) -> None:
    pub = trust.keys.get(msg.sender)
    if pub is None or not msg.verify_sig(pub):
        raise CertError("bad-signature", f"{what} from {msg.sender}")


def _ascending(ids: Sequence[int]) -> bool:
    return all(a < b for a, b in zip(ids, ids[1:], strict=False))


def _entry(e: wire.RowEntry) -> faults.Entry:
    # The codec already refuses these rows; checked again because a FaultStatement built
    # in memory (not decoded) reaches here too.
    if e.state == wire.ROW_NONE:
        if e.digest != bytes(len(e.digest)):
            raise CertError("malformed", f"replica {e.replica}: no report but a digest")
        return faults.Entry.missing()
    if e.state == wire.ROW_ONTIME:
        return faults.Entry.ontime(e.digest)
    if e.state == wire.ROW_LATE:
        return faults.Entry.late(e.digest)
    raise CertError("malformed", f"replica {e.replica}: state {e.state}")


def _statements(w: wire.Wakeup, trust: ServiceTrust) -> list[faults.FaultStatement]:
    """Decode the evidence and check who signed it; the cheap checks come first so that a
    WAKEUP stuffed with copies costs no signature verifications."""
    msgs: list[wire.FaultStatement] = []
    seen: set[int] = set()
    for i, raw in enumerate(w.evidence):
        m = _decode(raw, f"evidence {i}")
        if not isinstance(m, wire.FaultStatement):
            raise CertError("wrong-type", f"evidence {i} is {m.NAME}")
        if m.service != w.service:
            raise CertError("mixed-service", f"evidence {i} is about service {m.service}")
        if not _is_agreement(m.sender, trust.g):
            raise CertError("bad-signer", f"evidence {i} signed by principal {m.sender}")
        if m.sender in seen:
            raise CertError("duplicate-signer", f"evidence {i} signer {m.sender} again")
        seen.add(m.sender)
        msgs.append(m)
    for i, m in enumerate(msgs):
        _check_sig(m, trust, f"evidence {i}")
    return [
        faults.FaultStatement(
            signer=m.sender,
            service=str(m.service),
            seq=m.seq,
            replicas=tuple(e.replica for e in m.row),
            entries=tuple(_entry(e) for e in m.row),
        )
        for m in msgs
    ]


def verify_wakeup(
    raw: bytes,
    *,
    keys: Mapping[int, bytes],
    f: int,
    g: int,
    n_exec: int,
    service: int | None = None,
) -> Wakeup:
    """Verify one WAKEUP message; raise CertError(reason) unless every check passes.

    ``keys`` are the public keys of the WAKEUP's service (``ServiceTrust.keys``); when
    ``service`` is given the header must name it. The wake set is recomputed from the
    message's own ``sleeping`` list: controld must still check against its inventory
    that those replicas are in fact asleep on its host.
    """
    trust = ServiceTrust(service if service is not None else -1, keys, f, g, n_exec)
    msg = _decode(raw, "wakeup")
    if not isinstance(msg, wire.Wakeup):
        raise CertError("wrong-type", f"{msg.NAME}, not WAKEUP")
    if service is not None and msg.service != service:
        raise CertError("wrong-service", f"service {msg.service}, expected {service}")
    if not _is_agreement(msg.sender, g):
        raise CertError("bad-sender", f"principal {msg.sender} is no agreement replica")
    _check_sig(msg, trust, "wakeup")
    rows = _statements(msg, trust)
    if not rows:
        raise CertError("too-few-signers", "no evidence")
    awake = rows[0].replicas
    if any(not 0 <= j < n_exec for j in awake):
        raise CertError("bad-awake", f"awake {list(awake)} outside 0..{n_exec - 1}")
    sleeping = tuple(msg.sleeping)
    if (
        not _ascending(sleeping)
        or any(not 0 <= j < n_exec for j in sleeping)
        or set(sleeping) & set(awake)
    ):
        raise CertError("bad-sleeping", f"sleeping {list(sleeping)} with awake {list(awake)}")
    decision = faults.evaluate_evidence(
        rows,
        f=f,
        g=g,
        service=str(msg.service),
        seq=msg.seq,
        awake=awake,
        sleeping=sleeping,
    )
    if not decision.justified:
        raise CertError(decision.reason, f"seq {msg.seq}")
    if tuple(msg.wake) != decision.wake:
        raise CertError("wrong-wake", f"wake {msg.wake}, rules choose {list(decision.wake)}")
    return Wakeup(
        service=msg.service,
        seq=msg.seq,
        sender=msg.sender,
        awake=tuple(awake),
        sleeping=sleeping,
        wake=decision.wake,
        signers=decision.signers,
        raw=bytes(raw),
    )


def verify_shutdown_vote(raw: bytes, trust: ServiceTrust) -> wire.Shutdown:
    """One SHUTDOWN message: signed by an agreement replica of ``trust.service`` with a
    well-formed body. It is a vote, not yet a certificate."""
    msg = _decode(raw, "shutdown")
    if not isinstance(msg, wire.Shutdown):
        raise CertError("wrong-type", f"{msg.NAME}, not SHUTDOWN")
    if msg.service != trust.service:
        raise CertError("wrong-service", f"service {msg.service}, expected {trust.service}")
    if not _is_agreement(msg.sender, trust.g):
        raise CertError("bad-sender", f"principal {msg.sender} is no agreement replica")
    lists = {"awake": msg.awake, "convict": msg.convict, "sleep": msg.sleep, "active": msg.active}
    for name, ids in lists.items():
        if not _ascending(ids) or any(not 0 <= j < trust.n_exec for j in ids):
            raise CertError("malformed", f"{name} {ids} not ascending within 0..{trust.n_exec - 1}")
    parts = [set(msg.convict), set(msg.sleep), set(msg.active)]
    if sum(map(len, parts)) != len(set().union(*parts)) or len(msg.active) > trust.f + 1:
        raise CertError("malformed", "convict, sleep and active overlap or too many active")
    _check_sig(msg, trust, "shutdown")
    return msg


# A correct agreement replica has a round or two in flight; more pending votes from one
# sender are a faulty one filling memory, and only its own oldest votes are dropped.
MAX_PENDING_PER_SENDER = 16


@dataclass
class _Tally:
    bodies: dict[bytes, dict[int, bytes]] = field(default_factory=dict)  # body -> sender -> raw
    voted: dict[int, bytes] = field(default_factory=dict)  # sender -> body
    certified: set[bytes] = field(default_factory=set)  # bodies returned as certificates


Round = tuple[int, tuple[int, ...]]  # (seq, awake)


class ShutdownCollector:
    """Collects SHUTDOWN votes of one service; ``add`` returns each certificate once.

    A round is ``(seq, awake)``. Votes count per identical body; a sender that votes two
    different bodies for one round raises ``conflicting`` and its first vote stands. Once
    a body of a round is certified, votes for it are ``late_votes``, and the round's other
    bodies go on counting: correct agreement replicas can split so that a second body
    reaches ``g+1`` too (campaign seed 3502 round 63), and that certificate is returned as
    well, for the caller to merge (``merge_outcomes``).
    """

    def __init__(self, trust: ServiceTrust) -> None:
        self.trust = trust
        self._pending: dict[Round, _Tally] = {}  # rounds without a certificate yet
        self._done: dict[Round, _Tally] = {}  # rounds with one (their votes go on counting)
        self.late_votes = 0  # votes for a body already certified (harmless)

    def add(self, raw: bytes) -> Shutdown | None:
        msg = verify_shutdown_vote(raw, self.trust)
        key = (msg.seq, tuple(msg.awake))
        body = msg.body()
        done = self._done.get(key)
        tally = done if done is not None else self._pending.setdefault(key, _Tally())
        prev = tally.voted.get(msg.sender)
        if prev is not None and prev != body:
            raise CertError("conflicting", f"replica {msg.sender} voted twice for seq {msg.seq}")
        if body in tally.certified:
            self.late_votes += 1
            tally.voted.setdefault(msg.sender, body)
            return None
        if prev is not None:
            return None
        if done is None:
            # Certified rounds are few (each needs a correct replica's vote): only the
            # pending ones are bounded per sender.
            self._limit_sender(msg.sender, key)
        tally.voted[msg.sender] = body
        votes = tally.bodies.setdefault(body, {})
        votes[msg.sender] = bytes(raw)
        if len(votes) < self.trust.g + 1:
            return None
        tally.certified.add(body)
        self._done[key] = self._pending.pop(key, tally)
        signers = tuple(sorted(votes))
        return Shutdown(
            service=msg.service,
            seq=msg.seq,
            awake=tuple(msg.awake),
            convict=tuple(msg.convict),
            sleep=tuple(msg.sleep),
            active=tuple(msg.active),
            signers=signers,
            votes=tuple(votes[s] for s in signers),
        )

    def _limit_sender(self, sender: int, new: tuple[int, tuple[int, ...]]) -> None:
        mine = sorted(k for k, t in self._pending.items() if sender in t.voted and k != new)
        for key in mine[: max(0, len(mine) - MAX_PENDING_PER_SENDER + 1)]:
            tally = self._pending[key]
            body = tally.voted.pop(sender)
            del tally.bodies[body][sender]
            if not tally.bodies[body]:
                del tally.bodies[body]
            if not tally.voted:
                del self._pending[key]

    def forget_below(self, seq: int) -> None:
        """Drop pending votes and certified rounds below ``seq`` (after a completed
        SHUTDOWN, Freshness rejects them anyway)."""
        self._pending = {k: v for k, v in self._pending.items() if k[0] >= seq}
        self._done = {k: v for k, v in self._done.items() if k[0] >= seq}


# Rounds acted upon are remembered per service from the last completed SHUTDOWN on; past
# this many the oldest are folded into the stale floor, which only ever rejects more.
MAX_ROUNDS_PER_SERVICE = 1024


@dataclass
class _ServiceFreshness:
    shutdown_seq: int = 0  # last completed SHUTDOWN: rounds at or below it are stale
    rounds: set[tuple[int, tuple[int, ...]]] = field(default_factory=set)  # (seq, awake) acted
    # The last SHUTDOWN acted on: its awake and active sets, and the one before's seq.
    last_awake: tuple[int, ...] = ()
    last_active: tuple[int, ...] = ()
    floor: int = 0
    # The outcome acted on at shutdown_seq: its certificate's body, or the merge of the
    # certificates acted on at that seq (merge_outcomes).
    outcome: Outcome | None = None


class Freshness:
    """Replay guard for WAKEUP and SHUTDOWN certificates, per service; JSON-persistable.

    A WAKEUP round ``(seq, awake)`` is acted upon once (``duplicate`` afterwards). A
    WAKEUP or SHUTDOWN at or below the seq of the last completed SHUTDOWN is ``stale``: a
    round is resolved at most once per seq (an undecided round is followed by another
    round at the same seq over a larger awake set). When correct agreement replicas split,
    a second body can be certified at that seq: ``merged`` gives the merge of it with the
    outcome acted on (``outcome``), for controld to act on what it adds
    (``acted_merge``); the certificate itself stays ``stale``.

    A certificate over the awake set of the last SHUTDOWN acted on, which that SHUTDOWN
    changed, is a ``sibling``: the same fault flagged at another seq, where some agreement
    replicas gathered their statements first (agreed's check_done settles every correct
    replica on the lowest certified one). It is not acted on again.
    """

    def __init__(self) -> None:
        self._s: dict[int, _ServiceFreshness] = {}

    def _svc(self, service: int) -> _ServiceFreshness:
        return self._s.setdefault(service, _ServiceFreshness())

    def _sibling(self, service: int, seq: int, awake: tuple[int, ...]) -> bool:
        s = self._s.get(service, _ServiceFreshness())
        return bool(s.last_awake) and awake == s.last_awake != s.last_active and seq > s.floor

    def sibling(self, c: Shutdown) -> bool:
        return self._sibling(c.service, c.seq, c.awake)

    def check_wakeup(self, w: Wakeup) -> None:
        s = self._s.get(w.service, _ServiceFreshness())
        if w.seq <= s.shutdown_seq:
            raise CertError("stale", f"seq {w.seq} <= last shutdown {s.shutdown_seq}")
        if self._sibling(w.service, w.seq, w.awake):
            raise CertError("sibling", f"seq {w.seq}: awake {list(w.awake)} was resolved")
        if (w.seq, w.awake) in s.rounds:
            raise CertError("duplicate", f"round seq {w.seq} awake {list(w.awake)}")

    def acted_wakeup(self, w: Wakeup) -> None:
        self.check_wakeup(w)
        s = self._svc(w.service)
        s.rounds.add((w.seq, w.awake))
        if w.awake != s.last_awake:
            # The membership moved on (a round over another awake set, which may close
            # undecided and be judged again over a larger one): no longer a sibling guard.
            s.last_awake = s.last_active = ()
        if len(s.rounds) > MAX_ROUNDS_PER_SERVICE:
            oldest = min(s.rounds)
            s.shutdown_seq = max(s.shutdown_seq, oldest[0])
            s.rounds = {r for r in s.rounds if r[0] > s.shutdown_seq}

    def check_shutdown(self, c: Shutdown) -> None:
        s = self._s.get(c.service, _ServiceFreshness())
        # The one acted on is stale; another of its awake set (lower or higher) a sibling.
        if c.seq != s.shutdown_seq and self.sibling(c):
            raise CertError("sibling", f"seq {c.seq}: awake {list(c.awake)} was resolved")
        if c.seq <= s.shutdown_seq:
            raise CertError("stale", f"seq {c.seq} <= last shutdown {s.shutdown_seq}")

    def acted_shutdown(self, c: Shutdown) -> None:
        self.check_shutdown(c)
        s = self._svc(c.service)
        s.floor, s.shutdown_seq = s.shutdown_seq, c.seq
        s.last_awake, s.last_active = c.awake, c.active
        s.rounds = {r for r in s.rounds if r[0] > c.seq}
        s.outcome = c.outcome

    def last_shutdown(self, service: int) -> int:
        return self._s.get(service, _ServiceFreshness()).shutdown_seq

    def outcome(self, service: int) -> Outcome | None:
        """The outcome acted on at the service's last SHUTDOWN seq (None before any)."""
        s = self._s.get(service)
        return s.outcome if s is not None else None

    def merged(self, c: Shutdown) -> Outcome | None:
        """The outcome acted on merged with ``c``, a certificate at that same seq over an
        awake set nested with the acted outcome's, if the merge convicts, puts to sleep or
        keeps active other replicas than what was acted on; else None (also for a
        certificate at a seq the stale floor moved past)."""
        o = self.outcome(c.service)
        if o is None or c.seq != o.seq or c.seq != self.last_shutdown(c.service):
            return None
        try:
            m = merge_outcomes([o, c])
        except ValueError:
            return None
        return None if (m.convict, m.sleep, m.active) == (o.convict, o.sleep, o.active) else m

    def acted_merge(self, o: Outcome) -> None:
        """Record the merged outcome ``o`` of the last SHUTDOWN seq as acted on. The sibling
        guard keeps the first certificate's awake and active sets."""
        s = self._svc(o.service)
        if o.seq != s.shutdown_seq:
            raise CertError("stale", f"merged seq {o.seq}, last shutdown {s.shutdown_seq}")
        s.outcome = o

    # -- persistence
    def to_json(self) -> str:
        return json.dumps(
            {
                str(svc): {
                    "shutdown_seq": s.shutdown_seq,
                    "rounds": sorted([seq, list(awake)] for seq, awake in s.rounds),
                    "last_awake": list(s.last_awake),
                    "last_active": list(s.last_active),
                    "floor": s.floor,
                    **({"outcome": _outcome_json(s.outcome)} if s.outcome is not None else {}),
                }
                for svc, s in sorted(self._s.items())
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> Freshness:
        """Raises ValueError on anything but what to_json writes."""
        try:
            data = json.loads(text)
            out = cls()
            for svc, s in data.items():
                rounds = {(int(seq), tuple(int(j) for j in awake)) for seq, awake in s["rounds"]}
                out._s[int(svc)] = _ServiceFreshness(
                    int(s["shutdown_seq"]),
                    rounds,
                    tuple(int(j) for j in s.get("last_awake", [])),
                    tuple(int(j) for j in s.get("last_active", [])),
                    int(s.get("floor", 0)),
                    _outcome_from_json(int(svc), int(s["shutdown_seq"]), s.get("outcome")),
                )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"freshness state: {e}") from e
        return out

    def save(self, path: Path) -> None:
        """Atomically: a crash leaves the old or the new state, never a torn file."""
        write_atomic(path, self.to_json(), durable=True)

    @classmethod
    def load(cls, path: Path) -> Freshness:
        """A missing file is a fresh start (nothing acted upon yet)."""
        try:
            return cls.from_json(path.read_text())
        except FileNotFoundError:
            return cls()


_OUTCOME_LISTS = ("awake", "convict", "sleep", "active")


def _outcome_json(o: Outcome) -> dict[str, list[int]]:
    return {name: list(getattr(o, name)) for name in _OUTCOME_LISTS}


def _outcome_from_json(service: int, seq: int, d: Any) -> Outcome | None:
    """The outcome Freshness persisted for ``seq`` (absent in files written before it
    was kept: None, no merge for that seq)."""
    if d is None:
        return None
    lists = [tuple(int(j) for j in d[name]) for name in _OUTCOME_LISTS]
    return Outcome(service, seq, *lists)
