# tests/test_execution_faults.py - a Byzantine execution replica whose state diverges: the
# correct replicas record the checkpoint mismatch naming it, and its digest never becomes stable.
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import REPO, Cluster, _port_free
from tests.test_execution_runtime import (
    CP,
    KV_PUT,
    ExecReplicas,
    Rig,
    _kv,
    _kv_cluster,
    _kv_ok,
    needs_agreed,
)
from zz.crypto import sha256
from zz.snapshots.manifest import Manifest

FAULTY = 2
DIVERGE_PATH = "zz-fault-diverge"  # execution/drillfaults.py DIVERGE_PATH


def start_rig(
    tmp_path: Path,
    replicas: list[int],
    args: dict[int, list[str]],
    overrides: dict[str, Any] | None = None,
    one_by_one: bool = False,
) -> Iterator[Rig]:
    """zz-agreed (g = f = 1, kv app) + the given execution replica processes, all of them
    active (agreement replicas push batches only to active ones); everything is torn down
    also on failure, and every replica must exit 0 on SIGTERM. `overrides`: replica-file
    keys for every zz-agreed (e.g. detection timers). `one_by_one`: each replica is linked
    before the next starts (zfs-fuse once died under two concurrent dataset creates)."""
    for attempt in range(20):
        cluster = _kv_cluster(
            tmp_path / f"try{attempt}", CP, active=max(2, len(replicas)), overrides=overrides
        )
        if all(_port_free(a[1]) for a in cluster.service.exec_addresses(cluster.config)):
            break
    execs = ExecReplicas(cluster, args)
    rig = Rig(cluster, execs)
    ok = False
    try:
        cluster.start()
        for i in replicas:
            execs.start(i)
            if one_by_one:
                rig.wait_linked(i)
        for i in replicas:
            rig.wait_linked(i)
        rig.wait_peers_linked(replicas)
        yield rig
        ok = True
    finally:
        if not ok:
            print(rig.diag(), file=sys.stderr)
        codes = execs.close()
        cluster.__exit__(None if ok else RuntimeError, None, None)
    assert all(c == 0 for c in codes.values()), f"exit codes {codes}\n{execs.tails()}"


@pytest.fixture
def diverging_rig(tmp_path: Path) -> Iterator[Rig]:
    # n_exec = 3 for f = 1 (f+1 active, f sleeping): two correct replicas can still make a
    # checkpoint stable while the third lies about its state.
    yield from start_rig(tmp_path, [0, 1, FAULTY], {FAULTY: ["--inject-fault", "diverge-state"]})


def _manifest(cluster: Cluster, i: int, seq: int) -> bytes:
    return (cluster.run_dir / f"exec-{i}" / "manifests" / f"ckpt-{seq}.manifest").read_bytes()


@pytest.mark.slow
@needs_agreed
def test_diverging_replica_is_named_and_never_stable(diverging_rig: Rig) -> None:
    rig = diverging_rig
    cluster, execs = rig.cluster, rig.execs

    def named(i: int, seq: int) -> bool:
        ms = execs.status(i).get("checkpoint_mismatches", [])
        return any(m["seq"] == seq and m["peer"] == FAULTY for m in ms)

    def settled(seq: int) -> bool:
        st = [execs.status(i) for i in (0, 1, FAULTY)]
        return (
            all(s.get("stable_checkpoint") == seq and named(i, seq) for i, s in enumerate(st[:2]))
            and st[2].get("last_checkpoint", 0) >= seq
        )

    # Two rounds of CP requests, checked after each: the older manifests of the correct
    # replicas are collected once the next checkpoint is stable.
    for rnd in (1, 2):
        seq = rnd * CP
        puts = [_kv(KV_PUT, f"k{rnd}.{k}".encode(), b"v%d" % k) for k in range(CP)]
        # The fault does not touch replies: f+1 = 2 matching replies come back regardless.
        assert rig.invoke_all(puts) == [_kv_ok()] * CP
        rig.wait(lambda s=seq: settled(s), f"checkpoint {seq} stable and the mismatch recorded")
        st = {i: execs.status(i) for i in (0, 1, FAULTY)}
        good = _manifest(cluster, 0, seq)
        bad = _manifest(cluster, FAULTY, seq)
        assert good == _manifest(cluster, 1, seq)
        # The faulty state is the correct one plus exactly the injected file.
        good_m, bad_m = Manifest.decode(good), Manifest.decode(bad)
        assert set(bad_m.files) - set(good_m.files) == {DIVERGE_PATH}
        assert {p: e for p, e in bad_m.files.items() if p != DIVERGE_PATH} == good_m.files
        for i in (0, 1):
            ms = [m for m in st[i]["checkpoint_mismatches"] if m["seq"] == seq]
            # Exactly one entry: the faulty replica, with both digests as signed.
            assert ms == [
                {
                    "seq": seq,
                    "peer": FAULTY,
                    "principal": st[FAULTY]["principal"],
                    "mine": sha256(good).hex(),
                    "theirs": sha256(bad).hex(),
                }
            ], st[i]["checkpoint_mismatches"]
            # No correct replica is ever named, and the stable digest is the correct one.
            assert all(m["peer"] == FAULTY for m in st[i]["checkpoint_mismatches"])
            assert st[i]["counters"]["checkpoint_mismatches"] == rnd
            assert st[i]["checkpoints"][str(seq)] == sha256(good).hex()
            log = execs.log_path(i).read_text()
            assert f"checkpoint {seq}: execution replica {FAULTY} signed" in log
        # The faulty digest has only its own vote: nothing becomes stable there (so
        # nothing is collected), and it sees f+1 peers certify a different state.
        f = st[FAULTY]
        assert f["stable_checkpoint"] == 0
        assert f["checkpoints"][str(seq)] == sha256(bad).hex()
        assert f["counters"].get("checkpoint_divergence", 0) >= 1
        assert {m["peer"] for m in f["checkpoint_mismatches"] if m["seq"] == seq} == {0, 1}
        assert f["counters"].get("snapshots_destroyed", 0) == 0
    assert all(execs.alive(i) for i in (0, 1, FAULTY))


def test_unknown_fault_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "zz.execution", "--rack", str(tmp_path / "none.toml"),
         "--service", "web", "--index", "0", "--inject-fault", "make-it-rain"],
        capture_output=True, text=True, cwd=REPO, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
