# tests/test_exec_detection.py - the agreement replicas watch EXEC-REPORTs (ZZ §4.3): f+1
# matching on-time reports make an execution certificate; a wrong reply is a mismatch and a
# report later than K·t1 a timeout, each named in the replica's log with the report row.
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_execution_faults import start_rig
from tests.test_execution_runtime import KV_PUT, Rig, _kv, _kv_ok


def _puts(rig: Rig, n: int, tag: str) -> list[bytes]:
    return rig.invoke_all([_kv(KV_PUT, f"{tag}{k}".encode(), b"v") for k in range(n)])


def _agreement(rig: Rig) -> list[dict]:
    return [rig.cluster.stats(r) for r in range(rig.cluster.n)]


@pytest.fixture
def correct_rig(tmp_path: Path) -> Iterator[Rig]:
    yield from start_rig(tmp_path, [0, 1], {})


@pytest.fixture
def wrong_rig(tmp_path: Path) -> Iterator[Rig]:
    # Three replicas run, so the client still gets f+1 = 2 matching replies from 0 and 1.
    yield from start_rig(tmp_path, [0, 1, 2], {2: ["--inject-fault", "wrong-reply"]})


@pytest.fixture
def slow_rig(tmp_path: Path) -> Iterator[Rig]:
    # Replies go out at once, only the EXEC-REPORTs of replica 1 are late: 0.5 s, beyond
    # K·t1 clamped to 100..300 ms (the default floor of 500 ms would make it a near tie).
    timers = {"detect_k": 4, "detect_floor_ms": 100, "detect_ceiling_ms": 300}
    yield from start_rig(tmp_path, [0, 1], {1: ["--inject-fault", "slow-report"]}, timers)


@pytest.mark.slow
def test_correct_replicas_make_execution_certificates(correct_rig: Rig) -> None:
    rig = correct_rig
    assert _puts(rig, 12, "ok") == [_kv_ok()] * 12
    rig.wait(
        lambda: all(s["exec_certificates"] >= 12 for s in _agreement(rig)),
        "an execution certificate per batch at every agreement replica",
    )
    for s in _agreement(rig):
        assert s["exec_mismatches"] == 0 and s["exec_timeouts"] == 0, s


@pytest.mark.slow
def test_wrong_reply_is_detected_as_a_mismatch(wrong_rig: Rig) -> None:
    rig = wrong_rig
    assert _puts(rig, 6, "w") == [_kv_ok()] * 6  # the two correct replicas outvote it
    rig.wait(
        lambda: all(s["exec_mismatches"] >= 6 for s in _agreement(rig)),
        "a mismatch per batch at every agreement replica",
    )
    for s in _agreement(rig):
        assert s["exec_certificates"] >= 6, s  # 0 and 1 still certify the right reply
    log = rig.cluster.log_path(0).read_text()
    assert "execution mismatch at seq" in log, log[-2000:]


@pytest.mark.slow
def test_late_report_is_detected_as_a_timeout(slow_rig: Rig) -> None:
    rig = slow_rig
    assert _puts(rig, 3, "s") == [_kv_ok()] * 3
    rig.wait(
        lambda: all(s["exec_timeouts"] >= 3 for s in _agreement(rig)),
        "a timeout per batch at every agreement replica",
    )
    for s in _agreement(rig):
        assert s["exec_mismatches"] == 0, s
    log = rig.cluster.log_path(1).read_text()
    assert "execution timeout at seq" in log, log[-2000:]
