# tests/test_controld_inventory.py - controld's replica inventory: persistence across a
# reload, illegal transitions refused before anything happens, and backend failures (and a
# crash) mid-transition settled into a consistent, reported state. Real process backend.
from __future__ import annotations

import json
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from zz.controld import inventory as inv
from zz.controld.hv_process import ProcessHypervisor, proc_state
from zz.controld.hypervisor import PAUSED, RUNNING, HypervisorError, ReplicaSpec, open_backend
from zz.controld.inventory import IllegalTransition, Inventory

LOOP = "import time\nwhile True:\n    time.sleep(0.05)\n"


@pytest.fixture
def hv() -> Iterator[ProcessHypervisor]:
    h = open_backend("process")
    assert isinstance(h, ProcessHypervisor)
    try:
        yield h
    finally:
        h.close()


def _spec(tmp_path: Path, index: int) -> ReplicaSpec:
    name = f"zz-web-{index}-{uuid.uuid4().hex[:6]}"
    return ReplicaSpec(name, tmp_path, command=(sys.executable, "-c", LOOP))


def _provision(
    inventory: Inventory, hv: ProcessHypervisor, tmp_path: Path, index: int, state: str
) -> inv.Replica:
    spec = _spec(tmp_path, index)

    def make() -> None:
        hv.create(spec)
        if state == inv.PAUSED:
            hv.suspend(spec.name)

    role = "active" if state == inv.ACTIVE else "standby"
    return inventory.provision("web", index, role, spec.name, state, make)


def test_persists_across_reload(hv: ProcessHypervisor, tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    a = Inventory(path, hv)
    r0 = _provision(a, hv, tmp_path, 0, inv.ACTIVE)
    r1 = _provision(a, hv, tmp_path, 1, inv.PAUSED)
    save = tmp_path / "web-1.save"
    a.transition("web", 1, inv.HIBERNATED, lambda: hv.save(r1.domain, save), save_file=str(save))
    b = Inventory(path, hv)  # a restarted controld
    assert [(r.key, r.role, r.state, r.domain) for r in b.replicas()] == [
        (("web", 0), "active", inv.ACTIVE, r0.domain),
        (("web", 1), "standby", inv.HIBERNATED, r1.domain),
    ]
    assert b.get("web", 1).save_file == str(save) and not b.in_doubt()
    assert b.reconcile() == []
    # The reloaded inventory drives the same replicas on.
    b.transition("web", 1, inv.RECOVERING, lambda: hv.restore(save))
    assert hv.state(r1.domain) == RUNNING
    b.transition("web", 1, inv.ACTIVE, lambda: None)
    assert Inventory(path).get("web", 1).state == inv.ACTIVE
    assert not path.with_name(path.name + ".tmp").exists()


def test_illegal_transitions_refused(hv: ProcessHypervisor, tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    a = Inventory(path, hv)
    _provision(a, hv, tmp_path, 0, inv.ACTIVE)
    before = path.read_bytes()
    called: list[str] = []
    for to in (inv.RECOVERING, inv.ACTIVE, "sleeping"):
        with pytest.raises(IllegalTransition):
            a.transition("web", 0, to, lambda to=to: called.append(to))
    assert called == [] and path.read_bytes() == before
    with pytest.raises(IllegalTransition, match="exists"):
        _provision(a, hv, tmp_path, 0, inv.ACTIVE)
    with pytest.raises(IllegalTransition):
        a.provision("web", 5, "active", "zz-x", inv.RECOVERING, lambda: called.append("x"))
    with pytest.raises(IllegalTransition, match="not convicted"):
        a.remove("web", 0)
    a.transition("web", 0, inv.CONVICTED, lambda: hv.destroy(a.get("web", 0).domain))
    with pytest.raises(IllegalTransition):  # convicted is final
        a.transition("web", 0, inv.ACTIVE, lambda: called.append("y"))
    assert called == []
    a.remove("web", 0)
    assert Inventory(path).replicas() == []
    # A file with an unknown state is refused on load, naming the field.
    bad = tmp_path / "bad.json"
    raw = {"service": "web", "index": 0, "role": "active", "state": "dozing", "domain": "d"}
    bad.write_text(json.dumps({"format": inv.FORMAT, "replicas": [raw]}))
    with pytest.raises(ValueError, match="state 'dozing'"):
        Inventory(bad)


def test_backend_failure_leaves_consistent_state(hv: ProcessHypervisor, tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    a = Inventory(path, hv)
    r = _provision(a, hv, tmp_path, 1, inv.PAUSED)

    # 1. The action fails and nothing happened: rolled back, the error reported.
    def wake_bad() -> None:
        hv.set_memory(r.domain, 10**12)  # refused before any resume

    with pytest.raises(HypervisorError):
        a.transition("web", 1, inv.RECOVERING, wake_bad)
    rec = Inventory(path).get("web", 1)
    assert rec.state == inv.PAUSED and rec.pending is None and "rolled back" in rec.error
    assert hv.state(r.domain) == PAUSED

    # 2. The action fails half-way, after the resume: the hypervisor shows it running, so
    #    the target state is confirmed (with the failure still reported).
    def wake_half() -> None:
        hv.resume(r.domain)
        hv.set_memory(r.domain, 10**12)

    with pytest.raises(HypervisorError):
        a.transition("web", 1, inv.RECOVERING, wake_half)
    rec = Inventory(path).get("web", 1)
    assert rec.state == inv.RECOVERING and "confirmed" in rec.error
    a.transition("web", 1, inv.ACTIVE, lambda: None)
    assert a.get("web", 1).error is None

    # 3. The replica's process dies under us: suspend fails, state kept, the report says
    #    the hypervisor shows neither.
    pid = hv.pid(r.domain)
    hv._live[r.domain].popen.kill()  # the replica crashes on its own
    hv._live[r.domain].popen.wait()
    with pytest.raises(HypervisorError, match="exited"):
        a.transition("web", 1, inv.PAUSED, lambda: hv.suspend(r.domain))
    rec = Inventory(path).get("web", 1)
    assert rec.state == inv.ACTIVE and "neither" in rec.error and rec.pending is None
    a.transition("web", 1, inv.CONVICTED, lambda: hv.destroy(r.domain))
    assert proc_state(pid) is None

    # 4. Provisioning whose create fails leaves no record behind.
    with pytest.raises(HypervisorError):
        a.provision("web", 2, "standby", "zz-none", inv.PAUSED,
                    lambda: hv.create(ReplicaSpec("zz-none", tmp_path)))  # fmt: skip
    with pytest.raises(KeyError):
        Inventory(path).get("web", 2)


def test_crash_mid_transition_is_reconciled(hv: ProcessHypervisor, tmp_path: Path) -> None:
    """controld dies while an action runs: the file then holds the write-ahead record;
    a restarted controld refuses to touch it until reconcile() settles it."""
    path = tmp_path / "inventory.json"
    a = Inventory(path, hv)
    r0 = _provision(a, hv, tmp_path, 0, inv.ACTIVE)
    r1 = _provision(a, hv, tmp_path, 1, inv.ACTIVE)
    crashed = {0: tmp_path / "crash0.json", 1: tmp_path / "crash1.json"}

    def suspend_then_crash() -> None:  # the suspend happened, the confirm never did
        hv.suspend(r0.domain)
        shutil.copy(path, crashed[0])

    def crash_before_suspend() -> None:  # died before the hypervisor call
        shutil.copy(path, crashed[1])

    a.transition("web", 0, inv.PAUSED, suspend_then_crash)
    a.transition("web", 1, inv.PAUSED, crash_before_suspend)
    b = Inventory(crashed[0], hv)
    assert [x.key for x in b.in_doubt()] == [("web", 0)]
    with pytest.raises(IllegalTransition, match="in doubt"):
        b.transition("web", 0, inv.RECOVERING, lambda: None)
    c = Inventory(crashed[1], hv)
    assert [x.key for x in c.in_doubt()] == [("web", 1)]
    (s0,) = b.reconcile()
    assert s0.state == inv.PAUSED and "confirmed" in s0.error  # hypervisor: paused
    (s1,) = c.reconcile()
    assert s1.state == inv.ACTIVE and "rolled back" in s1.error  # hypervisor: running
    assert hv.state(r1.domain) == RUNNING
    assert not Inventory(crashed[0]).in_doubt() and not Inventory(crashed[1]).in_doubt()


async def test_atransition_runs_action_in_thread(hv: ProcessHypervisor, tmp_path: Path) -> None:
    a = Inventory(tmp_path / "inventory.json", hv)
    r = _provision(a, hv, tmp_path, 0, inv.ACTIVE)
    await a.atransition("web", 0, inv.PAUSED, lambda: hv.suspend(r.domain))
    assert hv.state(r.domain) == PAUSED and a.get("web", 0).state == inv.PAUSED
    with pytest.raises(IllegalTransition):
        await a.atransition("web", 0, inv.ACTIVE, lambda: hv.resume(r.domain))
    assert hv.state(r.domain) == PAUSED


async def test_a_fresh_spares_provisioning_left_in_doubt_is_finished(
    hv: ProcessHypervisor, tmp_path: Path
) -> None:
    """A fresh spare's record (successor_of: the SHUTDOWN's seq) written ahead by a
    controld that died mid-boot: reconcile(leave=...) leaves it in doubt, afinish() runs the
    rest of the provisioning with it still written ahead and confirms it, or settles it as a
    failed provisioning (the domain gone: forgotten); announced() clears successor_of."""
    path = tmp_path / "inventory.json"
    a = Inventory(path, hv)
    specs = {i: _spec(tmp_path, i) for i in (1, 2)}
    crashed = {i: tmp_path / f"crash{i}.json" for i in (1, 2)}

    def boot_then_crash(i: int) -> None:  # created, never put to sleep nor confirmed
        hv.create(specs[i])
        shutil.copy(path, crashed[i])
        raise RuntimeError("killed")

    for i in (1, 2):
        with pytest.raises(RuntimeError):
            await a.aprovision("web", i, "standby", specs[i].name, inv.PAUSED,
                               lambda i=i: boot_then_crash(i), successor_of=7)  # fmt: skip
        b = Inventory(crashed[i], hv)
        assert b.reconcile(leave=lambda r: r.successor_of is not None) == []
        (rec,) = b.in_doubt()
        assert (rec.state, rec.pending, rec.successor_of) == (None, inv.PAUSED, 7)
        if i == 1:  # it runs: finished
            done = await b.afinish("web", 1, lambda: hv.suspend(specs[1].name))
            assert (done.state, done.pending, done.successor_of) == (inv.PAUSED, None, 7)
            b.announced("web", 1)
            assert Inventory(crashed[1], hv).get("web", 1).successor_of is None
        else:  # it is gone: the finish fails, the record is forgotten
            hv.destroy(specs[2].name)
            with pytest.raises(HypervisorError):
                await b.afinish("web", 2, lambda: hv.resume(specs[2].name))
            assert ("web", 2) not in [r.key for r in Inventory(crashed[2], hv).replicas()]
    with pytest.raises(IllegalTransition, match="no provisioning to finish"):
        await Inventory(crashed[1], hv).afinish("web", 1, lambda: None)
