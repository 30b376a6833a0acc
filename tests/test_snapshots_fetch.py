# tests/test_snapshots_fetch.py - on-demand, hash-verified fetching (snapshots/fetch.py) and
# the lazy StateDir a recovering replica executes on. Sources here read a real directory;
# the wire transport is tested in tests/test_recovery_fetch.py.
from __future__ import annotations

import threading
from pathlib import Path

import pytest

import zz.snapshots.fetch as fetch_mod
from zz.execution.state import StateDir, StateError
from zz.snapshots.fetch import FetchError, SourceError, StateFetcher
from zz.snapshots.manifest import scan


class DirSource:
    """Serves the files of a directory as checkpoint `seq`; counts what it served."""

    def __init__(self, name: str, root: Path, seq: int, *, corrupt: set[str] | None = None):
        self.name = name
        self.root = root
        self.seq = seq
        self.corrupt = corrupt or set()
        self.served: list[str] = []
        self.lock = threading.Lock()

    def fetch(self, seq: int, path: str, size: int, sha256: bytes = b"") -> bytes:
        if seq != self.seq:
            raise SourceError(f"no checkpoint {seq}")
        full = self.root / path
        if not full.is_file():
            raise SourceError(f"no file {path}")
        data = full.read_bytes()
        with self.lock:
            self.served.append(path)
        if path in self.corrupt:
            return bytes([data[0] ^ 1]) + data[1:] if data else b"x"
        return data


class DeadSource:
    name = "dead"

    def fetch(self, seq: int, path: str, size: int, sha256: bytes = b"") -> bytes:
        raise SourceError("connection refused")


class GatedSource(DirSource):
    """Blocks every fetch until `gate` is set; `fail_first` fails the first one."""

    def __init__(self, *a, fail_first: bool = False, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fail_first = fail_first

    def fetch(self, seq, path, size, sha256=b""):
        self.started.set()
        assert self.gate.wait(10)
        if self.fail_first:
            self.fail_first = False
            raise SourceError("busy")
        return super().fetch(seq, path, size)


@pytest.fixture
def certified(tmp_path: Path) -> tuple[Path, object]:
    src = tmp_path / "peer"
    (src / "db").mkdir(parents=True)
    (src / "db" / "a").write_bytes(b"alpha" * 100)
    (src / "db" / "b").write_bytes(b"beta")
    (src / "top").write_bytes(b"top file")
    (src / ".zz").mkdir()
    (src / ".zz" / "memory").write_bytes(b"mem")
    return src, scan(src)


def make(tmp_path: Path, certified, sources=None, **kw) -> tuple[StateFetcher, Path]:
    src, manifest = certified
    local = tmp_path / "local"
    local.mkdir(exist_ok=True)
    f = StateFetcher(local, manifest, 7, sources or [DirSource("p1", src, 7)], **kw)
    f.prepare()
    return f, local


def test_files_are_fetched_on_first_touch_only(tmp_path, certified):
    f, local = make(tmp_path, certified)
    assert f.pending() == [".zz/memory", "db/a", "db/b", "top"]
    # Reconciling makes no directory (a mkdir each grew with the state): the install does.
    assert not (local / "db").exists() and f.dir_pending("db")
    assert f.ensure("db/a") is True
    assert (local / "db").is_dir() and not f.dir_pending("db")
    assert (local / "db" / "a").read_bytes() == b"alpha" * 100
    assert f.ensure("db/a") is False
    assert f.pending() == [".zz/memory", "db/b", "top"]
    assert f.sources[0].served == ["db/a"]


def test_matching_local_files_are_kept_and_stale_ones_removed(tmp_path, certified):
    local = tmp_path / "local"
    (local / "db").mkdir(parents=True)
    (local / "db" / "a").write_bytes(b"alpha" * 100)  # same content: kept
    (local / "db" / "b").write_bytes(b"BETA")  # same size, other content: refetched
    (local / "old").write_bytes(b"not in the certified state")
    f, _ = make(tmp_path, certified)
    assert f.counters["kept"] == 1
    assert f.counters["removed"] == 1
    assert not (local / "old").exists()
    assert "db/a" not in f.pending() and "db/b" in f.pending()
    f.fetch_all()
    assert (local / "db" / "b").read_bytes() == b"beta"
    assert f.sources[0].served.count("db/a") == 0


def test_corrupt_source_is_reported_and_the_next_one_used(tmp_path, certified):
    src, _ = certified
    bad = DirSource("bad", src, 7, corrupt={"top"})
    good = DirSource("good", src, 7)
    reported = []
    f, local = make(
        tmp_path, certified, [DeadSource(), bad, good], on_bad_source=lambda *a: reported.append(a)
    )
    f.ensure("top")
    assert (local / "top").read_bytes() == b"top file"
    assert [r[:2] for r in reported] == [("bad", "top")]
    assert f.counters["bad_content"] == 1 and f.counters["source_errors"] == 1


def test_no_good_source_raises_and_keeps_the_file_pending(tmp_path, certified):
    src, _ = certified
    f, local = make(tmp_path, certified, [DirSource("bad", src, 7, corrupt={"top"})])
    with pytest.raises(FetchError, match="top: no source had the certified content"):
        f.ensure("top")
    assert not (local / "top").exists()
    assert f.is_pending("top")
    f.sources.append(DirSource("good", src, 7))
    assert f.ensure("top")


def test_concurrent_touches_fetch_once(tmp_path, certified):
    src, _ = certified
    slow = GatedSource("slow", src, 7)
    f, _ = make(tmp_path, certified, [slow])
    results = []
    ts = [threading.Thread(target=lambda: results.append(f.ensure("db/a"))) for _ in range(4)]
    for t in ts:
        t.start()
    slow.gate.set()
    for t in ts:
        t.join(10)
    assert results == [True] * 4
    assert f.sources[0].served == ["db/a"]


def test_background_fetch_completes_and_yields_to_foreground(tmp_path, certified):
    f, local = make(tmp_path, certified)
    stop = threading.Event()
    n = f.fetch_all(stop, pause=0.001)
    assert n == 4 and f.done
    assert scan(local).files == certified[1].files


def test_touching_files_that_are_present_does_not_hold_up_the_background(
    tmp_path, certified
):
    """The app calls ensure() for every file it touches. Only a fetch makes the background
    step aside: when every call did, a woken spare under steady load fetched 4 files in
    24 s (the short campaign) and stayed that long in recovery."""
    f, _ = make(tmp_path, certified)
    assert f.ensure("not/in/the/manifest") is False
    got: list[int] = []
    stop = threading.Event()
    t = threading.Thread(
        target=lambda: got.append(f.fetch_all(stop, yield_after_foreground=3600)), daemon=True
    )
    t.start()
    t.join(10)
    stop.set()
    assert got == [4] and f.done


def test_lazy_statedir_sees_the_certified_tree(tmp_path, certified):
    f, local = make(tmp_path, certified)
    st = StateDir(local, lazy=f)
    assert st.listdir() == ["db", "top"]
    assert st.listdir("db") == ["a", "b"]
    assert st.exists("db/b") and not f.sources[0].served
    assert st.read_bytes("db/b") == b"beta"
    with st.open("top", "rb") as fh:
        assert fh.read() == b"top file"
    # Overwriting an unfetched file does not fetch it.
    st.write_bytes("db/a", b"new")
    assert "db/a" not in f.sources[0].served
    assert st.read_bytes("db/a") == b"new"
    assert sorted(f.sources[0].served) == ["db/b", "top"]


def test_directories_not_made_yet_are_directories_to_the_app(tmp_path, certified):
    """The certified tree's directories are made on disk at the first install below them
    or when the app needs one there; until then the app sees them as a replica that made
    them at reconcile would (the files app spreads its files over 512 bucket
    directories, and a mkdir each on zfs-fuse was most of a woken spare's install)."""
    src, manifest = certified
    (src / "x" / "y" / "z").mkdir(parents=True)
    (src / "x" / "y" / "z" / "deep").write_bytes(b"deep")
    (src / "x" / "w").write_bytes(b"w")
    f, local = make(tmp_path, (src, scan(src)))
    st = StateDir(local, lazy=f)
    assert not (local / "x").exists() and not (local / "db").exists()
    assert st.listdir() == ["db", "top", "x"]
    assert st.listdir("x") == ["w", "y"] and st.listdir("x/y") == ["z"]
    assert st.is_dir("x/y") and st.exists("x/y/z") and not st.is_dir("x/w")
    assert not st.exists("x/q") and not st.is_dir("x/q")
    with pytest.raises(FileNotFoundError):
        st.listdir("x/q")
    # A directory whose pending files were all dropped unfetched stays, as a made one
    # does when its last file is deleted.
    st.delete("x/y/z/deep")
    assert st.is_dir("x/y/z") and st.listdir("x/y/z") == [] and st.listdir("x/y") == ["z"]
    # Moving a directory makes it on disk with every directory below it.
    st.rename("x/y", "moved")
    assert (local / "moved" / "z").is_dir() and st.listdir("moved") == ["z"]
    assert not st.exists("x/y") and st.listdir("x") == ["w"]
    # Deleting one not made yet: it is gone, with what it held.
    st.delete("x")
    assert not st.exists("x") and not st.is_dir("x") and "x/w" in st.take_dirty().deleted
    with pytest.raises(StateError):
        st.delete("x")
    with pytest.raises(StateError):
        st.rename("top", "db")  # onto a directory not made yet: refused as onto a made one
    f.fetch_all()
    assert f.done and scan(local).files.keys() == {".zz/memory", "db/a", "db/b", "top"}


def test_lazy_statedir_delete_and_rename(tmp_path, certified):
    f, local = make(tmp_path, certified)
    st = StateDir(local, lazy=f)
    st.delete("db/b")  # never fetched, still recorded as deleted
    assert not st.exists("db/b")
    assert "db/b" in st.take_dirty().deleted
    st.rename("db", "moved")  # a directory move fetches what it carries
    assert st.read_bytes("moved/a") == b"alpha" * 100
    assert f.sources[0].served == ["db/a"]
    with pytest.raises(StateError):
        st.delete("db/b")
    # Appending needs the old content.
    with st.open("top", "ab") as fh:
        fh.write(b"!")
    assert st.read_bytes("top") == b"top file!"


def test_a_file_being_fetched_still_exists_for_the_app(tmp_path, certified):
    """While the background fetches a file it is neither on disk nor (before the fix)
    pending: the kv app's exists() took it for missing and a correct replica answered a
    GET wrongly. It stays pending until it is installed."""
    src, _ = certified
    gated = GatedSource("p1", src, 7)
    f, local = make(tmp_path, certified, [gated])
    st = StateDir(local, lazy=f)
    bg = threading.Thread(target=lambda: f._ensure("db/a", foreground=False))
    bg.start()
    assert gated.started.wait(5)
    assert not (local / "db" / "a").exists()
    assert f.is_pending("db/a") and st.exists("db/a") and st.listdir("db") == ["a", "b"]
    gated.gate.set()
    bg.join(10)
    assert not f.is_pending("db/a") and st.read_bytes("db/a") == b"alpha" * 100


def test_overwriting_a_file_being_fetched_waits_for_the_install(tmp_path, certified):
    """The app truncates a file the background is fetching: the fetched copy must not be
    installed on top of the app's write."""
    src, _ = certified
    gated = GatedSource("p1", src, 7)
    f, local = make(tmp_path, certified, [gated])
    st = StateDir(local, lazy=f)
    bg = threading.Thread(target=lambda: f.ensure("db/a"))
    bg.start()
    assert gated.started.wait(5)
    app = threading.Thread(target=lambda: st.write_bytes("db/a", b"new"))
    app.start()
    app.join(0.3)
    assert app.is_alive()  # waits for the fetch under way
    gated.gate.set()
    bg.join(10)
    app.join(10)
    assert st.read_bytes("db/a") == b"new" and not f.is_pending("db/a")


def test_a_touch_waiting_on_a_failed_fetch_fetches_itself(tmp_path, certified):
    src, _ = certified
    gated = GatedSource("p1", src, 7, fail_first=True)
    f, local = make(tmp_path, certified, [gated], patience=5.0)
    errors: list[BaseException] = []

    def background() -> None:
        try:
            f._ensure("top", foreground=False)  # no patience: fails on "busy"
        except FetchError as e:
            errors.append(e)

    bg = threading.Thread(target=background)
    bg.start()
    assert gated.started.wait(5)
    results: list[bool] = []
    fg = threading.Thread(target=lambda: results.append(f.ensure("top")))
    fg.start()
    gated.gate.set()
    bg.join(10)
    fg.join(10)
    assert len(errors) == 1 and results == [True]
    assert (local / "top").read_bytes() == b"top file" and not f.is_pending("top")


def test_directory_where_a_file_is_certified_is_an_error(tmp_path, certified):
    local = tmp_path / "local"
    (local / "top").mkdir(parents=True)
    with pytest.raises(FetchError, match="top: a directory"):
        make(tmp_path, certified)


def test_prepare_with_known_local_state_hashes_only_dirty_files(tmp_path, certified, monkeypatch):
    src, manifest = certified
    local = tmp_path / "local"
    (local / "db").mkdir(parents=True)
    (local / "db" / "a").write_bytes(b"alpha" * 100)  # in the own manifest, clean: kept
    (local / "db" / "b").write_bytes(b"BETA")  # own manifest says old content: refetched
    (local / "top").write_bytes(b"top file")  # dirty but matching: hashed and kept
    (local / "gone").write_bytes(b"x")  # own manifest lists it, certified one does not
    own = scan(local).files
    (local / "db" / "a").write_bytes(b"tampered after the checkpoint")  # not reported dirty
    hashed = []
    f = StateFetcher(local, manifest, 7, [DirSource("p1", src, 7)])
    orig = fetch_mod.hash_file
    monkeypatch.setattr(fetch_mod, "hash_file", lambda p: hashed.append(p.name) or orig(p))
    f.prepare(own, {"top"})
    assert hashed == ["top"]
    # db/a is trusted from the own manifest (O(changes), by design: the runtime reports
    # every write); db/b's own entry differs from the certified one, so it is fetched.
    assert f.pending() == [".zz/memory", "db/b"]
    assert not (local / "gone").exists()
    assert f.counters["kept"] == 2
    f.fetch_all()
    assert (local / "db" / "b").read_bytes() == b"beta"


def test_foreground_fetch_waits_for_a_source_to_come_back(tmp_path, certified):
    src, manifest = certified

    class Flaky(DirSource):
        fails = 2

        def fetch(self, seq, path, size, sha256=b""):
            if self.fails:
                self.fails -= 1
                raise SourceError("connection refused")
            return super().fetch(seq, path, size)

    local = tmp_path / "local"
    local.mkdir()
    f = StateFetcher(local, manifest, 7, [Flaky("flaky", src, 7)], patience=5.0)
    f.prepare()
    assert f.ensure("top")
    assert f.counters["fetch_retries"] == 2
    g = StateFetcher(local, manifest, 7, [DeadSource()], patience=0.2)
    g.prepare()
    with pytest.raises(FetchError):
        g.ensure("db/a")


def test_a_failing_source_is_asked_last_until_it_serves(tmp_path, certified):
    src, manifest = certified

    class Counting(DeadSource):
        asked = 0

        def fetch(self, seq, path, size, sha256=b""):
            self.asked += 1
            return super().fetch(seq, path, size)

    dead = Counting()
    good = DirSource("good", src, 7, corrupt=set())
    f, _ = make(tmp_path, certified, [dead, good])
    f.fetch_all()
    assert dead.asked == 1  # a paused peer costs one timeout, not one per file
    assert f.done


class LaterSource:
    """A peer that collected the checkpoint asked for and offers its next one's copy
    (FILE-DATA status 5): `later` maps a path to those bytes."""

    def __init__(self, name: str, later: dict[str, bytes]) -> None:
        self.name = name
        self.later = later

    def fetch(self, seq: int, path: str, size: int, sha256: bytes = b"") -> bytes:
        return fetch_mod.LaterBytes(self.later[path])


def test_a_later_copy_is_taken_when_unchanged_and_means_gone_when_not(tmp_path, certified):
    src, _ = certified
    reported = []
    peer = LaterSource("x1", {"top": b"top file", "db/b": b"beta, changed since"})
    f, local = make(tmp_path, certified, [peer], on_bad_source=lambda *a: reported.append(a))
    # Unchanged between the two checkpoints: the later copy is the certified content.
    assert f.ensure("top") and (local / "top").read_bytes() == b"top file"
    # Changed since: the checkpoint is gone for this replica. Nobody lied, and waiting
    # (patience) cannot bring it back: StaleCheckpoint at once.
    f.patience = 30.0
    with pytest.raises(fetch_mod.StaleCheckpoint, match="db/b: .*checkpoint 7 collected"):
        f.ensure("db/b")
    assert reported == [] and f.counters["bad_content"] == 0
    assert f.counters["stale_copies"] == 1 and f.counters["fetch_retries"] == 0
    assert f.is_pending("db/b")
    # One honest source with checkpoint 7 still there: no StaleCheckpoint.
    f.sources.append(DirSource("x2", src, 7))
    assert f.ensure("db/b") and (local / "db" / "b").read_bytes() == b"beta"
    assert peer.name not in f.ranking._liars
