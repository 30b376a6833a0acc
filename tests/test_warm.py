# tests/test_warm.py - a sleeping spare kept warm by its host (docs/recovery.md "A warm
# spare"): controld stages a stable checkpoint's manifest and files by their SHA-256
# (controld/warm.py), the woken runtime's fetcher takes a staged file only if it hashes to the
# certified entry (snapshots/warm.py, snapshots/fetch.py). Sources are fakes reading a
# directory; the real FILE-FETCH path is in tests/test_recovery.py.
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.test_snapshots_fetch import DeadSource, DirSource
from zz.controld import inventory as inv
from zz.controld.warm import WarmSpares, WarmStager
from zz.snapshots.fetch import SourceError, StateFetcher
from zz.snapshots.manifest import Manifest, scan
from zz.snapshots.warm import WARM_DIR, WarmFiles, warm_name

SEQ = 64


class CheckpointSource(DirSource):
    """DirSource that also serves checkpoint `seq`'s manifest for the empty path."""

    def __init__(self, *a, manifest: Manifest, **kw):
        super().__init__(*a, **kw)
        self.manifest = manifest

    def fetch(self, seq: int, path: str, size: int, sha256: bytes = b"") -> bytes:
        if path == "":
            if seq != self.seq:
                raise SourceError(f"no checkpoint {seq}")
            with self.lock:
                self.served.append("")
            return self.manifest.encode()
        return super().fetch(seq, path, size, sha256)


@pytest.fixture
def peer(tmp_path: Path) -> tuple[Path, Manifest]:
    src = tmp_path / "peer"
    (src / "db").mkdir(parents=True)
    (src / "db" / "a").write_bytes(b"alpha" * 100)
    (src / "db" / "b").write_bytes(b"beta")
    (src / ".zz").mkdir()
    (src / ".zz" / "memory").write_bytes(b"mem")
    (src / ".zz" / "replies").write_bytes(b"replies")
    return src, scan(src)


def _digest(m: Manifest) -> bytes:
    return hashlib.sha256(m.encode()).digest()


# ---- the read side -------------------------------------------------------------------------


def test_a_staged_file_is_taken_only_when_it_hashes_to_the_certified_entry(tmp_path: Path):
    warm = WarmFiles(tmp_path / WARM_DIR)
    good, forged = b"certified bytes", b"forged bytes!!!"
    h = hashlib.sha256(good).digest()
    assert warm.get(len(good), h) is None  # nothing staged: a miss
    (tmp_path / WARM_DIR).mkdir()
    (tmp_path / WARM_DIR / warm_name(h)).write_bytes(forged)  # same size, wrong content
    assert warm.get(len(good), h) is None
    (tmp_path / WARM_DIR / warm_name(h)).write_bytes(good)
    assert warm.get(len(good), h) == good
    assert warm.get(len(good) + 1, h) is None  # the manifest's size counts too
    (tmp_path / WARM_DIR / warm_name(h)).unlink()
    (tmp_path / WARM_DIR / warm_name(h)).symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(good)
    assert warm.get(len(good), h) is None  # no symlink followed
    assert warm.counters == {"missed": 2, "mismatched": 2, "hit": 1}


def test_a_staged_manifest_must_hash_to_the_digest(tmp_path: Path, peer):
    _, m = peer
    warm = WarmFiles(tmp_path / WARM_DIR)
    (tmp_path / WARM_DIR).mkdir()
    d = _digest(m)
    (tmp_path / WARM_DIR / warm_name(d)).write_bytes(m.encode() + b"x")
    assert warm.manifest(d) is None
    (tmp_path / WARM_DIR / warm_name(d)).write_bytes(m.encode())
    assert warm.manifest(d) == m.encode()
    assert warm.counters == {"manifest_mismatched": 1, "manifest_hit": 1}


def test_fetcher_takes_warm_files_before_any_source_and_a_forged_one_is_only_a_miss(
    tmp_path: Path, peer
):
    src, m = peer
    root = tmp_path / "live"
    root.mkdir()
    wd = tmp_path / WARM_DIR
    wd.mkdir()
    a, b = m.files["db/a"], m.files["db/b"]
    (wd / warm_name(a.sha256)).write_bytes((src / "db" / "a").read_bytes())
    (wd / warm_name(b.sha256)).write_bytes(b"BETA")  # stale or forged: same size
    source = DirSource("x0", src, SEQ)
    bad: list[tuple[str, str, str]] = []
    f = StateFetcher(root, m, SEQ, [source], warm=WarmFiles(wd),
                     on_bad_source=lambda *x: bad.append(x))  # fmt: skip
    f.prepare()
    assert f.ensure("db/a") and f.ensure("db/b")
    assert (root / "db" / "a").read_bytes() == b"alpha" * 100
    assert (root / "db" / "b").read_bytes() == b"beta"
    assert source.served == ["db/b"]  # db/a never left the peer
    assert f.counters["fetched_warm"] == 1 and not bad and not f.bad_sources
    assert f.warm is not None and f.warm.counters["mismatched"] == 1
    f.fetch_all()
    assert f.done and sorted(source.served) == [".zz/memory", ".zz/replies", "db/b"]


# ---- the host's side -----------------------------------------------------------------------


def _staged(state: Path) -> set[str]:
    return {p.name for p in (state / WARM_DIR).iterdir() if not p.name.startswith(".")}


def test_stager_stages_the_manifest_and_what_the_spare_lacks(tmp_path: Path, peer):
    src, m = peer
    state = tmp_path / "exec-2"
    (state / "manifests").mkdir(parents=True)
    # The spare's own newest checkpoint already holds db/b as certified: not staged.
    own = Manifest(files={"db/b": m.files["db/b"], "old": m.files["db/a"]})
    (state / "manifests" / "ckpt-32.manifest").write_bytes(own.encode())
    liar = CheckpointSource("x0", src, SEQ, manifest=m, corrupt={"db/a"})
    good = CheckpointSource("x1", src, SEQ, manifest=m)
    st = WarmStager(state, [DeadSource(), liar, good])
    assert st.stage(SEQ) and st.staged_seq == SEQ
    want = {warm_name(_digest(m))} | {
        warm_name(m.files[p].sha256) for p in ("db/a", ".zz/memory", ".zz/replies")
    }
    assert _staged(state) == want
    warm = WarmFiles(state / WARM_DIR)
    for p in ("db/a", ".zz/memory", ".zz/replies"):
        e = m.files[p]
        assert warm.get(e.size, e.sha256) == (src / p).read_bytes()
    assert warm.manifest(_digest(m)) == m.encode()
    assert st.counters["bad_copies"] == 1  # the liar's db/a was not staged, x1's was
    assert "db/b" not in good.served


def test_stager_keeps_three_checkpoints_and_clears_when_awake(tmp_path: Path, peer):
    src, m1 = peer
    state = tmp_path / "exec-2"
    st = WarmStager(state, [CheckpointSource("x0", src, SEQ, manifest=m1)])
    assert st.stage(SEQ)
    first = _staged(state)
    ms = [m1]
    for k, (path, data) in enumerate([("db/a", b"new alpha"), ("db/b", b"newer beta"),
                                      ("db/a", b"newest alpha")], start=2):  # fmt: skip
        (src / path).write_bytes(data)
        ms.append(scan(src))
        st.sources = [CheckpointSource("x0", src, k * SEQ, manifest=ms[-1])]
        assert st.stage(k * SEQ)
        if k == 3:
            assert first <= _staged(state)  # the two before the newest are kept
    assert warm_name(_digest(ms[0])) not in _staged(state)
    assert warm_name(ms[0].files["db/a"].sha256) not in _staged(state)
    assert {warm_name(_digest(m)) for m in ms[1:]} <= _staged(state)
    st.clear()
    assert not (state / WARM_DIR).exists()


def test_a_probe_asks_only_the_controlds(tmp_path: Path, peer):
    """The next checkpoint's manifest is asked for before it is stable, of the peers'
    controlds only (they read it on their hosts): a guest is not asked every turn for a
    checkpoint it may not have taken yet."""
    src, m = peer
    guest = CheckpointSource("x0", src, SEQ, manifest=m)
    st = WarmStager(tmp_path / "exec-2", [guest])
    assert not st.stage(SEQ, probe=True) and guest.served == []
    ctl = CheckpointSource("controld-h1", src, SEQ, manifest=m)
    st.sources = [ctl, guest]
    assert st.stage(SEQ, probe=True) and ctl.served[0] == "" and "" not in guest.served


def test_stager_without_a_manifest_stages_nothing(tmp_path: Path):
    st = WarmStager(tmp_path / "exec-2", [DeadSource()])
    assert not st.stage(SEQ)
    assert st.staged_seq == 0 and not (tmp_path / "exec-2" / WARM_DIR).exists()


def test_stager_respects_its_byte_budget(tmp_path: Path, peer):
    src, m = peer
    st = WarmStager(tmp_path / "exec-2", [CheckpointSource("x0", src, SEQ, manifest=m)],
                    max_bytes=20)  # fmt: skip
    assert st.stage(SEQ)
    assert st.counters["files_skipped"] >= 1  # db/a (500 bytes) is left to the peers
    assert warm_name(m.files["db/a"].sha256) not in _staged(tmp_path / "exec-2")


@dataclass
class _Rec:
    service: str
    index: int
    state: str
    pending: str | None = None


class _Inventory:
    def __init__(self, recs: list[_Rec]) -> None:
        self.recs = recs

    def replicas(self) -> list[_Rec]:
        return list(self.recs)


@dataclass
class _Svc:
    name: str
    root: Path

    def exec_state_dir(self, config: object, i: int) -> Path:
        return self.root / f"exec-{i}"

    def exec_status_path(self, config: object, i: int) -> Path:
        return self.root / f"exec-{i}.status.json"


@dataclass
class _Rack:
    checkpoint_interval: int = SEQ


@dataclass
class _Config:
    services: list[_Svc]
    rack: _Rack = field(default_factory=_Rack)


def test_spares_staged_while_asleep_and_cleared_once_active(tmp_path: Path, peer):
    src, m = peer
    svc = _Svc("kv0", tmp_path)
    for i in (1, 2):
        (tmp_path / f"exec-{i}").mkdir()
    rec = _Rec("kv0", 2, inv.PAUSED)
    busy = _Rec("kv0", 1, inv.HIBERNATED, pending=inv.RECOVERING)
    stable = {"seq": SEQ}
    now = [0.0]
    asked: list[int] = []
    # What the controld source serves: the checkpoints taken so far, stable or not.
    taken = {SEQ: m}

    class Controld(CheckpointSource):
        def fetch(self, seq, path, size, sha256=b""):
            if seq not in taken:
                raise SourceError(f"no checkpoint {seq}")
            self.seq, self.manifest = seq, taken[seq]
            return super().fetch(seq, path, size, sha256)

    def sources(s, i):
        asked.append(i)
        return [Controld("controld-h1", src, SEQ, manifest=m)]

    spares = WarmSpares(_Config([svc]), _Inventory([rec, busy]),  # type: ignore[arg-type]
                        lambda s: stable["seq"], sources, clock=lambda: now[0])  # fmt: skip
    spares.turn()
    assert asked == [2]  # not the one with an action under way
    assert spares.status()["kv0/2"]["staged_seq"] == SEQ
    assert (tmp_path / "exec-2" / WARM_DIR / warm_name(_digest(m))).is_file()
    spares.turn()  # nothing new: the next checkpoint is probed for and not there yet
    assert spares.counters == {"checkpoints_staged": 1, "probes_missed": 1}
    (src / "db" / "a").write_bytes(b"taken, not stable yet")
    taken[2 * SEQ] = m2 = scan(src)
    spares.turn()  # staged before it is stable
    assert spares.status()["kv0/2"]["staged_seq"] == 2 * SEQ
    assert (tmp_path / "exec-2" / WARM_DIR / warm_name(m2.files["db/a"].sha256)).is_file()
    stable["seq"] = 4 * SEQ  # stable, yet no source has it: asked again only after RETRY_S
    spares.turn()
    spares.turn()
    assert spares.counters["stage_failures"] == 1
    now[0] += WarmSpares.RETRY_S
    spares.turn()
    assert spares.counters["stage_failures"] == 2
    rec.state = inv.ACTIVE
    status = tmp_path / "exec-2.status.json"
    status.write_text('{"recovering": false}')
    os.utime(status, (1.0, 1.0))
    spares.turn()  # a status from before it was active: its recovery may not show yet
    assert (tmp_path / "exec-2" / WARM_DIR).exists()
    later = time.time() + 10
    status.write_text('{"recovering": true}')
    os.utime(status, (later, later))
    spares.turn()  # its background fetch may still take files from warm/
    assert (tmp_path / "exec-2" / WARM_DIR).exists()
    status.write_text('{"recovering": false}')
    os.utime(status, (later, later))
    spares.turn()
    assert not (tmp_path / "exec-2" / WARM_DIR).exists() and spares.status() == {}
    # Convicted, its state dir set aside and a successor provisioned there: staged anew.
    rec.state = inv.PAUSED
    stable["seq"] = 2 * SEQ
    now[0] += WarmSpares.RETRY_S
    spares.turn()
    assert spares.status()["kv0/2"]["staged_seq"] == 2 * SEQ and asked == [2, 2]
    (tmp_path / "exec-2").rename(tmp_path / "exec-2.forensic-9")
    (tmp_path / "exec-2").mkdir()
    spares.turn()
    assert asked == [2, 2, 2]  # new sources (the successor's key) for the new dir
    assert spares.status()["kv0/2"]["staged_seq"] == 2 * SEQ


def test_a_checkpoint_staged_with_files_missing_is_staged_again(tmp_path: Path, peer):
    """A controld serves a checkpoint's manifest before its snapshot is listed (the
    directory store writes the manifest first): the files are missing for a moment, and
    the checkpoint counts as staged only once they are there (or after RETRIES turns)."""
    src, m = peer
    source = CheckpointSource("controld-h1", src, SEQ, manifest=m)
    real = source.fetch
    listed = [False]

    def fetch(seq, path, size, sha256=b""):
        if path and not listed[0]:
            raise SourceError("no such checkpoint")
        return real(seq, path, size, sha256)

    source.fetch = fetch  # type: ignore[method-assign]
    st = WarmStager(tmp_path / "exec-2", [source])
    assert not st.stage(SEQ, probe=True) and st.staged_seq == 0
    assert st.counters["staged_partly"] == 1
    listed[0] = True
    assert st.stage(SEQ, probe=True) and st.staged_seq == SEQ
    want = {warm_name(e.sha256) for e in m.files.values()} | {warm_name(_digest(m))}
    assert _staged(tmp_path / "exec-2") == want
    listed[0] = False  # a file no source ever has: staged without it after RETRIES turns
    (src / "db" / "b").write_bytes(b"gone")
    m2 = scan(src)
    source.seq, source.manifest = 2 * SEQ, m2
    results = [st.stage(2 * SEQ) for _ in range(WarmStager.RETRIES + 1)]
    assert results == [False] * WarmStager.RETRIES + [True] and st.staged_seq == 2 * SEQ
