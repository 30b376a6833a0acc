# tests/test_status.py - `zz status` over a running rack (real zz-agreed + execution replicas):
# roles, hosts and states are right, a dead replica shows as down, faults are shown.
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_execution_faults import start_rig
from tests.test_execution_runtime import KV_PUT, Rig, _kv
from zz.status import format_rows, rack_status


@pytest.fixture
def rig3(tmp_path: Path) -> Iterator[Rig]:
    yield from start_rig(tmp_path, [0, 1, 2], {2: ["--inject-fault", "wrong-reply"]})


@pytest.mark.slow
def test_status_shows_roles_states_and_faults(rig3: Rig) -> None:
    rig = rig3
    rig.invoke_all([_kv(KV_PUT, b"k%d" % k, b"v") for k in range(6)])
    rig.wait(
        lambda: all(rig.cluster.stats(r)["exec_mismatches"] >= 1 for r in range(4)),
        "mismatches seen",
    )
    time.sleep(1.2)  # every status file rewritten since
    rows = {r.replica: r for r in rack_status(rig.cluster.config)}
    assert [k for k in rows if k.startswith("A")] == ["A0", "A1", "A2", "A3"]
    assert rows["A0"].role == "primary" and rows["A1"].role == "backup"
    assert all(rows[f"A{r}"].state == "up" for r in range(4))
    assert "mismatch" in rows["A1"].detail
    assert rows["E0"].role == "active" and rows["E0"].state == "up"
    assert rows["E2"].state == "up"  # started here although it is the spare's index
    text = format_rows(list(rows.values()))
    assert text.splitlines()[0].split()[:3] == ["SERVICE", "REPLICA", "ROLE"]
    cli = subprocess.run(
        [sys.executable, "-m", "zz", "status", str(rig.cluster.config_path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    lines = cli.stdout.splitlines()
    assert len(lines) == 1 + 4 + rig.cluster.service.n_exec, cli.stdout
    assert any(ln.split()[1:3] == ["A0", "primary"] for ln in lines[1:]), cli.stdout
    # A killed agreement replica goes stale and is shown as down.
    rig.cluster.kill(3)
    time.sleep(2.2)
    rows = {r.replica: r for r in rack_status(rig.cluster.config, stale_after=2.0)}
    assert rows["A3"].state == "down" and rows["A2"].state == "up"
