"""Durable agreement replicas after a host restart (docs/agreement.md "Durable state"), with
real zz-agreed processes. A PRE-PREPARE or PREPARE record is written before its message
leaves and synced with the next sync (at the latest the one before the replica's COMMIT):
a process restart keeps it, a host restart may not. The log's header names the boot it was
written under; a log of another boot makes the replica send no PREPARE in the view it
recovers until a later view."""

from __future__ import annotations

from pathlib import Path

from tests.cluster import Cluster
from tests.test_agreed_durable import _caught_up, _order, _start
from zz import walfile


def test_crc32c_check_value() -> None:
    assert walfile.crc32c(b"123456789") == 0xE3069283


def _current_log(c: Cluster, r: int) -> Path:
    """The file a restart replays: the one with the higher epoch (its first record's)."""
    path = walfile.current_log(c.dir / f"data{r}")
    assert path is not None, f"replica {r} has no log file"
    return path


def _as_if_rebooted(path: Path) -> None:
    """The file's header with another boot id: the file looks written before the host
    restarted (zz/walfile.py)."""
    assert walfile.as_if_rebooted(path), "not a version 2 header"


def _cluster(tmp: Path) -> Cluster:
    data = {i: str(tmp / f"data{i}") for i in range(4)}
    return Cluster(
        tmp,
        g=1,
        checkpoint_interval=32,
        log_window=64,
        overrides={"data_dir": data, "durability": "fsync"},
    )


def test_a_backup_whose_log_predates_a_host_restart_withholds_its_prepares_in_that_view(
    tmp_path: Path,
) -> None:
    c = _cluster(tmp_path)
    with c:
        c.start()
        _order(c, [b"first-%d" % i for i in range(10)])
        c.wait_for(lambda: _caught_up(c, [0, 1, 2, 3]), timeout=20, what="same state")
        # A process restart (same boot) keeps what was written: nothing is withheld.
        c.kill(2)
        _start(c, 2)
        w = c.stats(2)["wal"]
        assert w["boot_known"] == 1 and w["boot_changed"] == 0, w
        assert w["withholding"] == 0 and w["lost_until"] == 0, w
        c.kill(2)
        _as_if_rebooted(_current_log(c, 2))
        log = _start(c, 2)
        assert "was written before the host restarted" in log, c.log_tail(2)
        w = c.stats(2)["wal"]
        assert w["boot_changed"] == 1 and w["withholding"] == 1 and w["lost_view"] == 0, w
        assert w["lost_until"] == w["recovered_stable"] + 64, w
        # The others order without its PREPAREs; it still commits (PREPAREs of backups 1, 3).
        _order(c, [b"second-%d" % i for i in range(5)])
        c.wait_for(lambda: _caught_up(c, [0, 1, 2, 3]), timeout=20, what="same state")
        assert c.stats(2)["wal"]["withheld"] >= 5, c.stats(2)["wal"]
        # Its log was rewritten under this boot with the bound: a process restart keeps it.
        c.kill(2)
        _start(c, 2)
        w2 = c.stats(2)["wal"]
        assert w2["boot_changed"] == 0 and w2["withholding"] == 1, w2
        assert w2["lost_until"] == w["lost_until"], w2
        # Replica 3 down: in view 0 only backup 1 prepares, so nothing prepares until the
        # view changes; in view 1 replica 2 prepares again.
        c.kill(3)
        _order(c, [b"third-%d" % i for i in range(3)], client=9)
        assert all(s["view"] >= 1 for s in c.stats_all([0, 1, 2])), c.summary()
        assert c.stats(2)["wal"]["withholding"] == 0, c.stats(2)["wal"]
        c.wait_for(lambda: _caught_up(c, [0, 1, 2]), timeout=20, what="same state in view 1")


def test_a_primary_whose_log_predates_a_host_restart_proposes_nothing_in_that_view(
    tmp_path: Path,
) -> None:
    c = _cluster(tmp_path)
    with c:
        c.start()
        _order(c, [b"first-%d" % i for i in range(10)])
        c.wait_for(lambda: _caught_up(c, [0, 1, 2, 3]), timeout=20, what="same state")
        c.kill(0)
        _as_if_rebooted(_current_log(c, 0))
        log = _start(c, 0)
        assert "was written before the host restarted" in log, c.log_tail(0)
        proposed = c.stats(0)["batches_proposed"]
        # It may have proposed batches it lost: it proposes none in view 0, the backups
        # change view, and the new primary (replica 1) orders.
        _order(c, [b"second-%d" % i for i in range(3)])
        st = c.stats(0)
        assert st["batches_proposed"] == proposed, st
        assert all(s["view"] >= 1 for s in c.stats_all()), c.summary()
        c.wait_for(lambda: _caught_up(c, [0, 1, 2, 3]), timeout=20, what="same state")
        assert c.stats(0)["wal"]["withholding"] == 0
