# tests/test_bench_figure9.py - smoke test of the pieces of `scripts/bench/files --figure9` (ZZ
# Figure 9): one small point on the directory store, the lie detected and the spare's answer taken.
from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.cluster import default_binary
from zz.procrack import leftover_pids

REPO = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "zz_bench_files_figure9", REPO / "scripts" / "bench" / "files_figure9.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_a_corrupted_read_is_answered_by_the_woken_spare(tmp_path: Path) -> None:
    """20 files of 8 KiB, replica 1's copy of one corrupted on its disk, then read: the
    agreement replicas flag the mismatch, the stand-in controld verifies the WAKEUP and wakes
    the paused spare, which recovers on demand, replays the tail (the last file's CREATE
    and WRITE, certified) and supplies the second matching reply. Every phase is there and
    the rack is gone afterwards."""
    fig9 = _load()
    out = asyncio.run(
        fig9.run_point(
            tmp_path, 8, "on-demand", seed=1, store="dir", n_files=20, agreed=default_binary()
        )
    )
    assert out["tail_requests"] == 2
    assert out["fault_seq"] > out["checkpoint"]
    assert out["recovered_checkpoint"] == out["checkpoint"]
    # The tail: certified by replicas 0 and 1, so replayed (one request per batch).
    assert out["replayed_batches"] == out["tail_requests"]
    assert set(out["replies_after_send_s"]) == {0, 1, 2}
    ph = out["phases_s"]
    assert set(ph) == {
        "detect",
        "wakeup_certificate",
        "wake",
        "checkpoint_learned",
        "install",
        "replay",
        "rest",
    }
    assert all(v > -0.01 for v in ph.values()), ph
    assert 0 < out["recovery_s"] <= out["total_s"]
    assert out["bad_sources"] == []
    assert leftover_pids([str(tmp_path)]) == []


def test_the_log_watch_sees_a_line_written_before_its_thread_first_ran(tmp_path: Path) -> None:
    """The watch starts at the logs' ends when entered, not when its thread first runs: on
    a busy machine the thread may run only after the fault's mismatch line is written, and
    the bench then found no detection of a fault every agreement replica had logged."""
    import threading

    _load()  # puts scripts/bench on sys.path
    from benchlib import LogWatch

    log = tmp_path / "agreed-0.log"
    log.write_text("earlier line\n")
    line = (
        "2026-11-27T21:28:31.247Z zz-agreed: replica 0: execution mismatch at seq 42: 0=0f 1=bb\n"
    )
    watch = LogWatch([log])
    late = watch._thread
    watch._thread = threading.Thread(target=lambda: None)  # the thread not run yet
    with watch:
        with open(log, "a") as fh:
            fh.write(line)
        late.start()  # it runs now
        for _ in range(500):
            if watch.since(0.0, "mismatch"):
                break
            late.join(0.01)
        watch._thread = late
    assert {r: seq for r, (_, seq) in watch.since(0.0, "mismatch").items()} == {0: 42}
