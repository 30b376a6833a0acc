# tests/test_checkpoint_liar.py - a replica that replies correctly but signs wrong or no
# execution checkpoint digests (issue 14 item 3). Its EXEC-REPORT at a checkpoint seq carries
# its checkpoint digest (docs/wire.md, the checkpoint ref), so a wrong one is a mismatch that
# wakes the spare and convicts it, and f+1 matching reports make the checkpoint stable without
# anyone's EXEC-CHECKPOINT. Before, nothing was detected and no execution checkpoint ever
# became stable: the agreement replicas' execution log grew to its bound.
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_execution_runtime import KV_GET, _kv, _kv_ok
from tests.test_fault_detection_e2e import FAST, SPARE, FaultRig, _puts, _start, _wait_resolved

CP = 8


def _liar(rig: FaultRig, i: int, behaviour: str) -> None:
    """Switch replica i's Byzantine behaviour in place (execution/byzantine.py)."""
    state = rig.cluster.service.exec_state_dir(rig.cluster.config, i)
    state.mkdir(parents=True, exist_ok=True)
    (state / "zz-fault.json").write_text(json.dumps({"fault": behaviour}))
    rig.wait(
        lambda: rig.execs.status(i).get("inject_fault") == behaviour,
        f"replica {i} runs {behaviour}",
    )


@pytest.fixture
def ckpt_rig(tmp_path: Path) -> Iterator[FaultRig]:
    yield from _start(tmp_path, {1: ["--drill-faults"]}, FAST, cp=CP)


@pytest.mark.slow
def test_wrong_checkpoint_digest_is_convicted(ckpt_rig: FaultRig) -> None:
    rig = ckpt_rig
    _liar(rig, 1, "wrong-checkpoint")
    assert _puts(rig, 3 * CP, "k") == [_kv_ok()] * (3 * CP)
    cert = _wait_resolved(rig, convicted=1)
    assert cert.seq % CP == 0, cert  # the mismatch is the checkpoint ref of a checkpoint seq
    # Checkpoints become stable again once 0 and the woken spare report them.
    assert _puts(rig, 2 * CP, "after") == [_kv_ok()] * (2 * CP)
    rig.wait(
        lambda: all(s["exec_stable"] > cert.seq for s in rig.agreement()),
        "a stable execution checkpoint above the round",
    )
    assert rig.invoke_all([_kv(KV_GET, b"k0")]) == [_kv_ok(b"v0")]
    assert SPARE in rig.controld.woken_at


@pytest.mark.slow
def test_withheld_checkpoints_are_stable_by_reports(ckpt_rig: FaultRig) -> None:
    rig = ckpt_rig
    _liar(rig, 1, "withhold-checkpoint")
    assert _puts(rig, 3 * CP, "k") == [_kv_ok()] * (3 * CP)
    rig.wait(
        lambda: all(s["exec_stable"] >= 2 * CP for s in rig.agreement()),
        "execution checkpoints stable without replica 1's EXEC-CHECKPOINTs",
    )
    assert all(s["exec_stable_by_reports"] >= 1 for s in rig.agreement())
    # The runtime rewrites its status file once a second: wait for the one that counts.
    rig.wait(
        lambda: rig.execs.status(1).get("counters", {}).get("byz_checkpoints_withheld", 0) >= 1,
        "replica 1's status counts a withheld checkpoint",
    )
    assert not rig.controld.wakeups  # withholding a signature is no fault
