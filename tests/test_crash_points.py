# tests/test_crash_points.py - a replica killed at any step of a checkpoint, of the
# collection of old checkpoints or of a restore comes back up, consistent (issue 15 item 6).
# As SQLite tests its journal: a reference run records every crash point it passes
# (ZZ_CRASH_TRACE, snapshots/crashpoint.py); then, for each point in turn, a run is
# SIGKILLed there (ZZ_CRASH_AT), the runtime is restarted on the same directory, and it
# must start, hold a checkpoint that is complete (its manifest matches the snapshot and the
# live state), list no half-made snapshot or manifest, and, replaying the same requests,
# reach the reference run's checkpoint digests.
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests import zfs_pool

zfs_daemon, pool = zfs_pool.zfs_daemon, zfs_pool.pool  # the fixtures, found here by pytest
REPO = Path(__file__).resolve().parents[1]

CP = 4
END = 20  # checkpoints at 4, 8, 12, 16, 20; collection from 12 on
DRIVER_TIMEOUT = 60


# ---- the driver: one replica's runtime without network, in its own process ------------


def _apply(state: Any, seq: int) -> None:
    """The requests of `seq`: a deterministic mix of writes, a rewrite and deletes."""
    state.write_bytes(f"d{seq % 3}/k{seq % 5}", f"v{seq}\n".encode() * (seq % 4 + 1))
    if seq % 6 == 0 and state.exists(f"d{seq % 3}/k{(seq + 1) % 5}"):
        state.delete(f"d{seq % 3}/k{(seq + 1) % 5}")
    if seq % 10 == 7 and state.exists("d1"):
        state.delete("d1")


def _files(root: Path) -> dict[str, Any]:
    from zz.snapshots.manifest import scan

    return scan(root).files


def _check_consistent(rt: Any) -> dict[str, Any]:
    """What a restarted runtime holds, after checking it is one complete checkpoint."""
    from zz.snapshots.dirstore import DirStore
    from zz.snapshots.manifest import Manifest

    snaps = rt.ckpt.store.list_snapshots()
    manifests = sorted(p.name for p in rt.ckpt.manifest_dir.iterdir())
    assert manifests == sorted(f"{n}.manifest" for n in snaps), (manifests, snaps)
    for name in snaps:
        recorded = Manifest.decode((rt.ckpt.manifest_dir / f"{name}.manifest").read_bytes())
        with rt.ckpt.store.open_snapshot(name) as snap:
            assert _files(snap) == recorded.files, name
    if isinstance(rt.ckpt.store, DirStore):
        assert sorted(p.name for p in (rt.ckpt.store.root / "snapshots").iterdir()) == sorted(snaps)
    live = _files(rt.ckpt.store.path)
    assert live == rt.ckpt.builder.previous.files if rt.ckpt.builder.previous else live == {}
    seq = rt.ckpt.last
    return {
        "restored": seq,
        "digest": rt.ckpt.mine[seq].hex() if seq else None,
        "snapshots": snaps,
    }


def _drive(state_dir: str, rack: str, kind: str, pool: str) -> None:
    from zz.config import load
    from zz.execution.runtime import Runtime, RuntimeOptions

    config = load(rack)
    opts = RuntimeOptions(store=kind, zfs_pool=pool or None, state_dir=Path(state_dir))
    rt = Runtime(config, config.services[0], 0, opts)
    rt.ckpt.manifest_dir.mkdir(parents=True, exist_ok=True)  # as start() does
    rt._open_state()
    print(json.dumps(_check_consistent(rt)), flush=True)
    for seq in range(rt.ckpt.last + 1, END + 1):
        _apply(rt.state, seq)
        if seq % CP == 0:
            c = rt._checkpoint(seq)
            print(json.dumps({"ckpt": seq, "digest": c.hex()}), flush=True)
            # As the runtime once `seq` is stable: keep it and the stable one before.
            rt.ckpt.destroy_below(seq - CP)
    print(json.dumps({"done": _check_consistent(rt)}), flush=True)


def _serve() -> None:
    """The driver's process: import the runtime once, then for each job read from stdin
    (one JSON line) fork a child that runs `_drive` armed as the job says, its stdout and
    stderr in the job's files, and answer the child's exit code. Forking saves each run
    the interpreter's start and the runtime's imports (about half a second here, two runs
    per crash point); each run is still a process of its own, killed for real."""
    import signal
    import traceback

    import zz.execution.runtime  # noqa: F401  (imported once, before the forks)
    from zz.snapshots import crashpoint, dirstore, manifest  # noqa: F401

    for line in sys.stdin:
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for fd, name in ((1, job["out"]), (2, job["err"])):
                    f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    os.dup2(f, fd)
                    os.close(f)
                crashpoint.arm(job["at"], job["trace"])
                signal.alarm(DRIVER_TIMEOUT)
                _drive(*job["args"])
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    _serve()
    sys.exit(0)


# ---- the tests ------------------------------------------------------------------------


class _Driver:
    """`_serve` in a child process, for the runs of one test."""

    def __init__(self, tmp_path: Path, kind: str, pool: str) -> None:
        self.tmp_path = tmp_path
        self.args = [str(tmp_path / "exec-0"), str(tmp_path / "rack.toml"), kind, pool]
        self.p = subprocess.Popen(
            [sys.executable, "-m", "tests.test_crash_points"],
            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip

    def run(
        self, at: str | None = None, trace: Path | None = None
    ) -> tuple[int, list[dict[str, Any]], str]:
        out, err = self.tmp_path / "run.out", self.tmp_path / "run.err"
        job = {"args": self.args, "at": at, "trace": str(trace) if trace else None,
               "out": str(out), "err": str(err)}  # fmt: skip
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(json.dumps(job) + "\n")
        self.p.stdin.flush()
        answer = self.p.stdout.readline()  # a child runs at most DRIVER_TIMEOUT s (alarm)
        assert answer, f"the driver process ended (rc {self.p.wait()})"
        rc = json.loads(answer)["rc"]
        lines = [json.loads(x) for x in out.read_text().splitlines() if x.startswith("{")]
        return rc, lines, err.read_text()[-3000:]

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        try:
            self.p.wait(DRIVER_TIMEOUT + 10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def _rack(tmp_path: Path) -> None:
    from conftest import RACK_TOML

    text = RACK_TOML.format(base_port=17100).replace(
        "base_port = 17100", 'base_port = 17100\napp = "kv"'
    )
    (tmp_path / "rack.toml").write_text(
        text.replace("checkpoint_interval = 4", f"checkpoint_interval = {CP}")
    )


def _points(tmp_path: Path, driver: _Driver) -> tuple[list[tuple[str, int]], dict[int, str]]:
    """Reference run: its checkpoint digests, and every (point, k-th hit) to crash at."""
    trace = tmp_path / "trace"
    rc, lines, err = driver.run(trace=trace)
    assert rc == 0, err
    digests = {x["ckpt"]: x["digest"] for x in lines if "ckpt" in x}
    assert sorted(digests) == list(range(CP, END + 1, CP))
    hits = Counter(trace.read_text().split())
    # The first two passes of each point (a checkpoint's steps, a collection's steps)
    # and the last (the one with the most history behind it).
    points = sorted({(n, k) for n, c in hits.items() for k in {1, 2, c}})
    return points, digests


def _crash_at_each_point(tmp_path: Path, kind: str, pool: str, reset: Any) -> list[str]:
    _rack(tmp_path)
    driver = _Driver(tmp_path, kind, pool)
    try:
        return _crash_at_points(tmp_path, driver, reset)
    finally:
        driver.close()


def _crash_at_points(tmp_path: Path, driver: _Driver, reset: Any) -> list[str]:
    points, reference = _points(tmp_path, driver)
    names = {n for n, _ in points}
    for needed in (
        "runtime.checkpoint.manifest",
        "runtime.checkpoint.snapshot",
        "runtime.gc.destroyed",
    ):
        assert needed in names, names
    failures = []
    for name, k in points:
        reset()
        rc, crashed, _ = driver.run(at=f"{name}:{k}")
        assert rc == -9, f"{name}:{k} never reached (rc {rc})"
        done = [x["ckpt"] for x in crashed if "ckpt" in x]
        rc, lines, err = driver.run()
        if rc != 0:
            failures.append(f"{name}:{k}: restart failed: {err.strip().splitlines()[-1:]}")
            continue
        first = lines[0]
        # Complete (the checkpoint being taken, if its snapshot got listed) or as if it
        # never started (the last one reported): nothing in between.
        last = done[-1] if done else 0
        if first["restored"] not in (last, last + CP):
            failures.append(f"{name}:{k}: restored {first['restored']}, last done {last}")
        if first["restored"] and first["digest"] != reference[first["restored"]]:
            failures.append(f"{name}:{k}: restored checkpoint {first['restored']} differs")
        again = {x["ckpt"]: x["digest"] for x in lines if "ckpt" in x}
        if any(reference[s] != d for s, d in again.items()) or "done" not in lines[-1]:
            failures.append(f"{name}:{k}: replay diverged or did not finish")
    return failures


def _reset_dir(tmp_path: Path) -> Any:
    import shutil

    def reset() -> None:
        shutil.rmtree(tmp_path / "exec-0", ignore_errors=True)

    return reset


def test_dir_store_survives_a_crash_at_every_point(tmp_path: Path) -> None:
    failures = _crash_at_each_point(tmp_path, "dir", "", _reset_dir(tmp_path))
    assert not failures, "\n".join(failures)


def test_snapshot_renamed_but_not_listed_does_not_block_the_next(tmp_path: Path) -> None:
    """The reported case, without the hook: a copy renamed into place that ORDER does not
    list yet (killed in between) must not make the same snapshot fail ever after."""
    from zz.snapshots.dirstore import DirStore

    store = DirStore(tmp_path / "store")
    (store.path / "f").write_text("one")
    store.snapshot("ckpt-4")
    (store.path / "f").write_text("two")
    # What a kill between os.rename and the ORDER update leaves behind:
    import shutil

    shutil.copytree(store.path, tmp_path / "store" / "snapshots" / "ckpt-8")
    (tmp_path / "store" / "snapshots" / ".tmp-ckpt-12").mkdir()
    again = DirStore(tmp_path / "store")
    assert again.list_snapshots() == ["ckpt-4"]
    assert again.recover() == ["snapshots/.tmp-ckpt-12", "snapshots/ckpt-8"]
    again.snapshot("ckpt-8")
    assert again.list_snapshots() == ["ckpt-4", "ckpt-8"]
    assert sorted(p.name for p in (tmp_path / "store" / "snapshots").iterdir()) == [
        "ckpt-4",
        "ckpt-8",
    ]
    # Without recover() (a crash, then the same snapshot taken again): replaced, no error.
    shutil.copytree(store.path, tmp_path / "store" / "snapshots" / "ckpt-12")
    again.snapshot("ckpt-12")
    assert again.list_snapshots() == ["ckpt-4", "ckpt-8", "ckpt-12"]


def test_crash_point_is_a_no_op_unless_armed() -> None:
    from zz.snapshots import crashpoint

    seen: list[str] = []
    crashpoint.crash_point("x")  # nothing armed in the test process: returns
    crashpoint.set_hook(seen.append)
    try:
        crashpoint.crash_point("dirstore.snapshot.renamed")
    finally:
        crashpoint.set_hook(None)
    crashpoint.crash_point("y")
    assert seen == ["dirstore.snapshot.renamed"]


@pytest.fixture
def zfs_pool_or_skip(request: pytest.FixtureRequest) -> str:
    from zz.snapshots.zfs import ZfsMissingError, ensure_zfs_daemon

    try:
        ensure_zfs_daemon()
    except (ZfsMissingError, OSError) as e:
        pytest.skip(f"no ZFS here: {e}")
    return str(request.getfixturevalue("pool"))


def test_zfs_store_survives_a_crash_at_every_point(tmp_path: Path, zfs_pool_or_skip: str) -> None:
    from zz.snapshots.zfs import dataset_exists, run_zfs

    pool = zfs_pool_or_skip

    def reset() -> None:
        if dataset_exists(f"{pool}/s1-exec-0"):
            run_zfs(["zfs", "destroy", "-r", f"{pool}/s1-exec-0"], retry_busy=True)
        _reset_dir(tmp_path)()

    failures = _crash_at_each_point(tmp_path, "zfs", pool, reset)
    assert not failures, "\n".join(failures)
