# execution/recovery.py - how a woken execution replica catches up (ZZ §4.5, §5.2 steps 3-6;
# docs/design.md §5.5): a certified checkpoint, its manifest from any peer, then files on
# first touch and the rest in the background. docs/recovery.md is the narrative.
"""Recovery of an execution replica that is behind the agreement cluster's log.

Pieces, each usable on its own:

* :class:`StableVotes` turns FETCH-REPLY (kind 3) answers into a checkpoint certificate:
  ``g+1`` agreement replicas naming the same stable execution checkpoint ``(seq, C)``.
* :class:`PeerSource` (snapshots/peersource.py, where the host's controld uses it too)
  reads checkpoint files from one peer over FILE-FETCH / FILE-DATA.
* :func:`fetch_manifest` gets the manifest of ``seq`` from the first peer whose copy
  hashes to ``C``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable, Sequence

from zz.crypto import NULL_DIGEST
from zz.snapshots.fetch import Source, SourceError, SourceRanking
from zz.snapshots.manifest import Manifest, ManifestError

log = logging.getLogger("zz.execution.recovery")


class RecoveryError(Exception):
    """Recovery cannot proceed (no peer has a manifest matching the certificate, ...)."""


class StableVotes:
    """Which stable execution checkpoint do g+1 agreement replicas vouch for?

    One FETCH-REPLY is one replica's claim; a faulty one could name any (seq, C). g+1
    matching claims include a correct replica, whose stable checkpoint is certified by
    f+1 matching EXEC-CHECKPOINTs."""

    def __init__(self, g: int) -> None:
        self.g = g
        self._claims: dict[int, tuple[int, bytes]] = {}

    def offer(self, replica: int, seq: int, digest: bytes) -> tuple[int, bytes] | None:
        if seq == 0 or digest == NULL_DIGEST:
            return None
        prev = self._claims.get(replica)
        if prev is None or seq >= prev[0]:
            self._claims[replica] = (seq, digest)
        return self.certified()

    def certified(self, below: int | None = None) -> tuple[int, bytes] | None:
        """The highest (seq, C) claimed by at least g+1 distinct agreement replicas (with
        `below`: the highest below that seq)."""
        counts: dict[tuple[int, bytes], int] = {}
        for claim in self._claims.values():
            counts[claim] = counts.get(claim, 0) + 1
        best = [c for c, k in counts.items() if k >= self.g + 1 and (below is None or c[0] < below)]
        return max(best) if best else None

    def floor(self, n: int) -> int:
        """The (g+1)-th lowest stable seq the n agreement replicas last named (0 for one
        not heard from). At most g replicas name a lower one, so no checkpoint below it
        can gather g+1 matching claims, now or later (a correct replica's stable only
        rises): the snapshots below it are the ones a woken spare can never be told."""
        seqs = sorted([seq for seq, _ in self._claims.values()] + [0] * n)[-n:]
        return seqs[self.g] if n > self.g else 0


class CertifiedVouches:
    """Which batches of a replayed log hold execution certificates (ZZ §4.7.2)?

    A FETCH-REPLY's certified_through is one agreement replica's word for the batches it
    lists; g+1 distinct replicas vouching for a seq include a correct one, which holds f+1
    matching EXEC-REPORTs for it. Such a batch's clients already hold their replies and
    nobody waits for this replica's report, so its read-only requests need not run again."""

    def __init__(self, g: int) -> None:
        self.g = g
        self._by_seq: dict[int, set[int]] = {}

    def offer(self, replica: int, certified_through: int, seqs: Iterable[int], above: int) -> None:
        """`replica` vouches for the listed `seqs` up to certified_through; those at or
        below `above` (executed already) are of no use."""
        for seq in seqs:
            if above < seq <= certified_through:
                self._by_seq.setdefault(seq, set()).add(replica)

    def certified(self, seq: int) -> bool:
        return len(self._by_seq.get(seq, ())) >= self.g + 1

    def take(self, seq: int) -> bool:
        """certified(seq), forgetting seq (it is being executed)."""
        return len(self._by_seq.pop(seq, ())) >= self.g + 1

    def forget_through(self, seq: int) -> None:
        """Drop the vouches a jump to checkpoint `seq` made useless."""
        for s in [s for s in self._by_seq if s <= seq]:
            del self._by_seq[s]

    def __len__(self) -> int:
        return len(self._by_seq)


def fetch_manifest(
    sources: Sequence[Source],
    seq: int,
    digest: bytes,
    *,
    on_bad_source: Callable[[str, str, str], None] | None = None,
    ranking: SourceRanking | None = None,
    like: Manifest | None = None,
) -> Manifest:
    """The manifest of checkpoint `seq` from the first source whose copy hashes to the
    certified `digest`. `like` (the replica's own last manifest) makes decoding cost
    what changed since, not an entry per file (Manifest.decode)."""
    reasons = []
    ranking = ranking or SourceRanking()
    for src in ranking.order(sources):
        try:
            enc = src.fetch(seq, "", 0, digest)
        except SourceError as e:
            reasons.append(f"{src.name}: {e}")
            ranking.failed(src.name)
            continue
        if hashlib.sha256(enc).digest() != digest:
            ranking.lied(src.name)
            reasons.append(f"{src.name}: manifest does not hash to the certified digest")
            if on_bad_source is not None:
                on_bad_source(src.name, "<manifest>", "does not hash to the certified digest")
            continue
        ranking.served(src.name)
        try:
            return Manifest.decode(enc, like=like)
        except ManifestError as e:  # hashes right yet does not decode: C itself is bad
            raise RecoveryError(f"certified manifest of {seq} does not decode: {e}") from e
    raise RecoveryError(f"no peer has the manifest of checkpoint {seq}: " + "; ".join(reasons))
