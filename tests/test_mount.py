"""tests/test_mount.py - `zz mount` on a real process rack running the files app: unmodified
programs (cp -r, tar, rsync, git, diff -r, find, editors' save-by-rename) on the FUSE mount,
and errors, not hangs, once the service is gone. Every mount, process and directory is cleaned
up, also on failure. Skipped only where /dev/fuse is absent."""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.test_execution_runtime import needs_agreed
from tests.test_rackctl import leftovers, write_rack
from zz import rackctl
from zz.config import Config, load
from zz.mountpoints import mounted_zz
from zz.procrack import REPO, repo_env, spawn

needs_fuse = pytest.mark.skipif(
    not os.path.exists("/dev/fuse"), reason="no /dev/fuse: a FUSE mount cannot be made here"
)
pytestmark = [pytest.mark.slow, needs_agreed, needs_fuse]


def files_rack(tmp_path: Path) -> Path:
    """A rack of 4 process hosts with one service kv0 running the files app."""
    path = write_rack(tmp_path, name="fs")
    path.write_text(path.read_text().replace('app = "kv"', 'app = "files"'))
    return path


class Mount:
    """`zz mount` as a child process; on exit the mount, the process and the mount point go,
    whatever happened in between."""

    def __init__(self, config: Config, where: Path, timeout: float = 20.0, cache: float = 1.0):
        self.config = config
        self.path = where
        self.log = where.with_suffix(".log")
        where.mkdir(parents=True)
        self.proc = spawn(
            [sys.executable, "-m", "zz", "mount", str(config.path), config.services[0].name,
             str(where), "--timeout", str(timeout), "--cache", str(cache)],
            self.log, env=repo_env(),
        )  # fmt: skip

    def wait_mounted(self, within: float = 60.0) -> None:
        deadline = time.monotonic() + within
        while not mounted_zz(self.path):
            if self.proc.poll() is not None:
                pytest.fail(f"zz mount exited {self.proc.returncode}:\n{self.log.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"not mounted after {within} s:\n{self.log.read_text()}")
            time.sleep(0.2)

    def umount(self) -> None:
        zz(["umount", str(self.path)])
        assert self.proc.wait(30) == 0, self.log.read_text()
        assert not mounted_zz(self.path)

    def close(self) -> None:
        if mounted_zz(self.path):
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if mounted_zz(self.path):  # a killed process leaves its mount behind
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], check=False)
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> Mount:
        try:
            self.wait_mounted()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def zz(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zz", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=repo_env(),
        cwd=REPO,
    )


def run(cmd: list[str] | str, cwd: Path | None = None, timeout: float = 600) -> str:
    res = subprocess.run(
        cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, shell=isinstance(cmd, str)
    )
    assert res.returncode == 0, f"{cmd}: exit {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout


def same_tree(a: Path, b: Path) -> None:
    """diff -r finds no difference, and the modes and symlinks agree too."""
    run(["diff", "-r", "--no-dereference", str(a), str(b)])
    fa = run(f"cd {a} && find . -printf '%p %y %m %l\\n' | sort")
    fb = run(f"cd {b} && find . -printf '%p %y %m %l\\n' | sort")
    assert fa == fb


def make_tree(root: Path) -> Path:
    """A small source tree: Python files in two levels, an executable, a symlink, an empty
    directory, a 300 KiB binary file, a name with spaces."""
    src = root / "src"
    (src / "zz").mkdir(parents=True)
    for p in sorted((REPO / "zz").glob("*.py"))[:8]:
        shutil.copy(p, src / "zz" / p.name)
    (src / "zz" / "drill").mkdir()
    for p in sorted((REPO / "zz" / "drill").glob("*.py"))[:3]:
        shutil.copy(p, src / "zz" / "drill" / p.name)
    (src / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "run.sh").chmod(0o755)
    (src / "link").symlink_to("zz/__init__.py")
    (src / "empty").mkdir()
    (src / "blob.bin").write_bytes(os.urandom(300 * 1024))
    (src / "a name with spaces.txt").write_text("spaces\n")
    return src


@pytest.fixture(scope="module")
def rack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Config]:
    config = load(files_rack(tmp_path_factory.mktemp("fsrack")))
    try:
        rackctl.up(config, overrides={"detect_floor_ms": 4000})
        yield config
    finally:
        rackctl.down(config)
        for pid in leftovers(config):
            os.kill(pid, signal.SIGKILL)


def test_real_programs_on_the_mount(rack: Config, tmp_path: Path) -> None:
    src = make_tree(tmp_path)
    with Mount(rack, tmp_path / "mnt") as m:
        mnt = m.path
        run(["cp", "-r", "-p", str(src), str(mnt / "cp")])
        same_tree(src, mnt / "cp")
        # tar x onto the mount, tar c from it.
        run(["tar", "cf", str(tmp_path / "src.tar"), "-C", str(src), "."])
        (mnt / "tar").mkdir()
        run(["tar", "xf", str(tmp_path / "src.tar"), "-C", str(mnt / "tar")])
        same_tree(src, mnt / "tar")
        run(["tar", "cf", str(tmp_path / "back.tar"), "-C", str(mnt / "tar"), "."])
        (tmp_path / "back").mkdir()
        run(["tar", "xf", str(tmp_path / "back.tar"), "-C", str(tmp_path / "back")])
        same_tree(src, tmp_path / "back")
        # rsync, twice: the second run sends only the changed file (temp file + rename).
        run(["rsync", "-a", f"{src}/", f"{mnt}/rs/"])
        same_tree(src, mnt / "rs")
        (src / "zz" / "__init__.py").write_text("# changed\n")
        out = run(["rsync", "-a", "-i", f"{src}/", f"{mnt}/rs/"])
        assert "zz/__init__.py" in out and "blob.bin" not in out, out
        same_tree(src, mnt / "rs")
        # git: init, add, commit, fsck, a clean status.
        repo = mnt / "tar"
        git = ["git", "-c", "user.email=t@zz.invalid", "-c", "user.name=zz"]
        run(["git", "init", "-q"], cwd=repo)
        run([*git, "add", "-A"], cwd=repo)
        run([*git, "commit", "-q", "-m", "on a BFT file service"], cwd=repo)
        run(["git", "fsck", "--full", "--strict"], cwd=repo)
        assert run(["git", "status", "--porcelain"], cwd=repo) == ""
        assert "on a BFT file service" in run(["git", "log", "--oneline"], cwd=repo)
        # Editors save by writing a new file and renaming it over the old one.
        f = mnt / "rs" / "run.sh"
        ino = f.stat().st_ino
        run(["sed", "-i", "s/hi/hello/", str(f)])
        assert f.read_text() == "#!/bin/sh\necho hello\n" and f.stat().st_ino != ino
        assert f.stat().st_mode & 0o777 == 0o755
        run(["vim", "-Es", "-n", "-u", "NONE", "-c", "set backupcopy=no writebackup",
             "-c", "%s/hello/vim/", "-c", "wq", str(f)])  # fmt: skip
        assert f.read_text() == "#!/bin/sh\necho vim\n"
        assert not list((mnt / "rs").glob("*~")), "vim's backup is removed after the write"
        # find, links, times, removal.
        names = run(f"cd {mnt}/cp && find . | sort")
        assert names == run(f"cd {src} && find . | sort")
        os.link(mnt / "cp" / "run.sh", mnt / "cp" / "hard")
        assert (mnt / "cp" / "run.sh").stat().st_nlink == 2
        os.utime(mnt / "cp" / "hard", ns=(1_000_000_000, 2_000_000_000))
        assert (mnt / "cp" / "run.sh").stat().st_mtime_ns == 2_000_000_000
        assert os.readlink(mnt / "cp" / "link") == "zz/__init__.py"
        run(["rm", "-r", str(mnt / "cp")])
        assert sorted(p.name for p in mnt.iterdir()) == ["rs", "tar"]
        st = os.statvfs(mnt)
        assert st.f_bsize == 4096 and st.f_namemax == 255 and st.f_bfree < st.f_blocks
        m.umount()
    assert not (tmp_path / "mnt").exists() or not mounted_zz(tmp_path / "mnt")


def test_mount_refuses_bad_input(rack: Config, tmp_path: Path) -> None:
    res = zz(["mount", str(rack.path), "kv0", str(tmp_path / "missing")])
    assert res.returncode == 1 and "is not a directory" in res.stderr
    res = zz(["umount", str(tmp_path)])
    assert res.returncode == 1 and "is not a zz mount" in res.stderr
    # A mount whose process was killed stays until unmounted: mounting over it is refused
    # with the way out, and zz umount removes it.
    with Mount(rack, tmp_path / "mnt") as m:
        m.proc.kill()
        m.proc.wait(10)
        with pytest.raises(OSError) as e:
            (m.path / "x").stat()
        assert e.value.errno == errno.ENOTCONN
        res = zz(["mount", str(rack.path), "kv0", str(m.path)])
        assert res.returncode == 1 and "already a zz mount" in res.stderr, res.stderr
        assert zz(["umount", str(m.path)]).returncode == 0
        assert not mounted_zz(m.path) and m.path.is_dir()


# ---- against a real file system, across drills ----------------------------------------------


def replica_states(config: Config) -> dict[int, str]:
    """Execution replica index -> controld's state of it (active, recovering, paused...)."""
    import asyncio

    async def ask() -> dict[int, str]:
        out: dict[int, str] = {}
        for h in config.hosts:
            reply = await rackctl.operator_call(config, h, {"op": "list"}, timeout=10)
            for rec in reply.get("replicas", []):
                out[int(rec["index"])] = str(rec["state"])
        return out

    return asyncio.run(ask())


def running(config: Config) -> list[int]:
    return sorted(i for i, st in replica_states(config).items() if st in ("active", "recovering"))


def wait_settled(config: Config, within: float = 180.0) -> list[int]:
    """Until f+1 replicas are active and a spare is asleep again (after a drill: the woken
    spare serves, the convicted one is a fresh spare); the active ones."""
    deadline = time.monotonic() + within
    while True:
        states = replica_states(config)
        active = sorted(i for i, st in states.items() if st == "active")
        asleep = [i for i, st in states.items() if st in ("paused", "hibernated")]
        if len(active) == 2 and len(asleep) == 1:
            return active
        assert time.monotonic() < deadline, f"not settled within {within} s: {states}"
        time.sleep(0.5)


def exec_mismatches(config: Config) -> int:
    from zz.drill.observe import agreed_stats

    svc = config.services[0]
    total = 0
    for r in range(svc.n):
        st = agreed_stats(config, svc, r) or {}
        counters = st.get("counters", st)
        total += int(counters.get("exec_mismatches", 0)) if isinstance(counters, dict) else 0
    return total


class Fsx:
    """fsx in the small: one seeded sequence of file operations on two trees (the mount and
    a local directory) in lockstep. Every result (bytes read, sizes, listings, the errno of
    a failure) must be the same on both."""

    NAMES = ("f0", "f1", "f2", "f3", "f4")
    SPAN = 256 * 1024

    def __init__(self, seed: int, mount: Path, local: Path) -> None:
        self.rng = random.Random(seed)
        self.roots = (mount, local)
        self.counts: dict[str, int] = {}

    def _both(self, what: str, fn: Callable[[Path], object]) -> None:
        out = []
        for root in self.roots:
            try:
                out.append(("ok", fn(root)))
            except OSError as e:
                out.append(("err", e.errno))
        assert out[0] == out[1], f"{what}: mount {out[0]!r:.200} != local {out[1]!r:.200}"
        self.counts[what] = self.counts.get(what, 0) + 1

    def step(self) -> None:
        rng = self.rng
        name = rng.choice(self.NAMES)
        k = rng.randrange(100)
        if k < 35:
            off = rng.randrange(self.SPAN)
            data = rng.randbytes(rng.randrange(1, 64 * 1024))

            def write(root: Path) -> int:
                fd = os.open(root / name, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    return os.pwrite(fd, data, off)
                finally:
                    os.close(fd)

            self._both("write", write)
        elif k < 50:
            size = rng.randrange(self.SPAN + 4096)
            self._both("truncate", lambda root: os.truncate(root / name, size))
        elif k < 60:
            other = rng.choice(self.NAMES)
            self._both("rename", lambda root: os.rename(root / name, root / other))
        elif k < 63:
            self._both("unlink", lambda root: os.unlink(root / name))
        elif k < 90:
            off = rng.randrange(self.SPAN + 8192)
            n = rng.randrange(1, 96 * 1024)

            def read(root: Path) -> bytes:
                fd = os.open(root / name, os.O_RDONLY)
                try:
                    return os.pread(fd, n, off)
                finally:
                    os.close(fd)

            self._both("read", read)
        else:
            self._both("whole", lambda root: (root / name).read_bytes())
            self._both("list", lambda root: sorted(
                (p.name, p.stat().st_size) for p in root.iterdir()))  # fmt: skip


def test_fsx_against_a_local_directory_across_drills(rack: Config, tmp_path: Path) -> None:
    """A seeded fsx sequence on the mount and on a local directory gives the same results,
    with a wrong-reply drill after a third of it and a crash drill after two thirds."""
    from zz.drill.rack import Rack

    svc = rack.services[0]
    local = tmp_path / "local"
    local.mkdir()
    steps = 240
    with Mount(rack, tmp_path / "mnt", timeout=120.0) as m:
        (m.path / "fsx").mkdir()
        fsx = Fsx(1818, m.path / "fsx", local)
        drills = []
        for i in range(steps):
            if i == steps // 3:
                liar = wait_settled(rack)[0]
                mism = exec_mismatches(rack)
                Rack.up(rack).set_fault(svc, liar, "wrong-reply")
                drills.append(("wrong-reply", liar, mism))
            if i == 2 * steps // 3:
                active = wait_settled(rack)
                assert liar not in active, "the liar was convicted and is a fresh spare"
                victim = active[-1]
                Rack.up(rack).kill_exec(svc, victim)
                drills.append(("crash", victim, 0))
            fsx.step()
        same_tree(local, m.path / "fsx")
        after = wait_settled(rack)
        m.umount()
    print("fsx ops", fsx.counts, "drills", drills, "active after", after)
    assert fsx.counts["write"] > 50 and fsx.counts["read"] > 40 and fsx.counts["rename"] > 10
    (_, liar, mism_before), (_, victim, _) = drills
    assert exec_mismatches(rack) > mism_before, "the lying replica's reports were seen"
    assert victim not in after, "the killed replica was convicted and is a fresh spare"
    assert "no certified reply" not in m.log.read_text(), "no operation timed out"


# `long` (25-35 s): the mount across drills stays in the default command through
# test_fsx_against_a_local_directory_across_drills, real programs on it through
# test_real_programs_on_the_mount.
@pytest.mark.long
def test_untar_git_diff_across_a_crash(rack: Config, tmp_path: Path) -> None:
    """Untar a source tree onto the mount while an active execution replica is killed, then
    commit it to git, git fsck, and diff -r against the original."""
    from zz.drill.rack import Rack

    svc = rack.services[0]
    src = make_tree(tmp_path)
    for k in range(15):  # more files, so the crash lands in the middle of the untar
        (src / "zz" / f"gen{k:02d}.txt").write_text(f"file {k}\n" * (k + 1))
    run(["tar", "cf", str(tmp_path / "src.tar"), "-C", str(src), "."])
    with Mount(rack, tmp_path / "mnt", timeout=120.0) as m:
        victim = wait_settled(rack)[0]
        (m.path / "t").mkdir()
        tar = subprocess.Popen(["tar", "xf", str(tmp_path / "src.tar"), "-C", str(m.path / "t")])
        try:
            # The crash comes once tar is under way: a few of the generated files are in.
            deadline = time.monotonic() + 120
            while len(list((m.path / "t").glob("zz/gen*"))) < 3:
                assert tar.poll() is None, "tar finished before the crash: make the tree bigger"
                assert time.monotonic() < deadline, "tar made no progress"
                time.sleep(0.05)
            Rack.up(rack).kill_exec(svc, victim)
            assert tar.poll() is None, "tar finished before the crash: make the tree bigger"
            assert tar.wait(300) == 0
        finally:
            if tar.poll() is None:
                tar.kill()
                tar.wait()
        repo = m.path / "t"
        git = ["git", "-c", "user.email=t@zz.invalid", "-c", "user.name=zz"]
        run(["git", "init", "-q"], cwd=repo)
        run([*git, "add", "-A"], cwd=repo)
        run([*git, "commit", "-q", "-m", "across a crash"], cwd=repo)
        run(["git", "fsck", "--full", "--strict"], cwd=repo)
        run(["diff", "-r", "--exclude=.git", str(src), str(repo)])
        assert victim not in wait_settled(rack), "the killed replica is a fresh spare"
        m.umount()
    assert "no certified reply" not in m.log.read_text(), "no operation timed out"


def test_unreachable_service_gives_errors_not_hangs(rack: Config, tmp_path: Path) -> None:
    """Last in this module: it takes the rack down."""
    with Mount(rack, tmp_path / "mnt", timeout=3.0) as m:
        (m.path / "f").write_text("x")
        rackctl.down(rack)
        t = time.monotonic()
        with pytest.raises(TimeoutError):  # ETIMEDOUT
            (m.path / "never-looked-up").stat()
        took = time.monotonic() - t
        assert 2.5 < took < 15, took
        t = time.monotonic()
        with pytest.raises(TimeoutError):
            (m.path / "g").write_text("y")
        assert time.monotonic() - t < 15
        m.umount()
    t = time.monotonic()
    (tmp_path / "mnt2").mkdir()
    res = zz(["mount", str(rack.path), "kv0", str(tmp_path / "mnt2"), "--timeout", "2"])
    assert res.returncode == 1 and "no certified answer" in res.stderr, res.stderr
    assert time.monotonic() - t < 30 and not mounted_zz(tmp_path / "mnt2")
