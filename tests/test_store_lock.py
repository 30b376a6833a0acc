# tests/test_store_lock.py - a checkpoint goes before a collection and before file serving.
"""The report of a checkpoint seq waits for its checkpoint, and an agreement replica
convicts a report later than its timer. A checkpoint must therefore not queue behind
background work on the store: the collection of many snapshots (a closed fault round
frees them at once) and a recovering peer's file reads. In the campaign (seed 3802, f = 2,
rounds 82 and 89) a correct replica that served a recovering peer was convicted that way:
its checkpoint waited on the store's FIFO lock past the 4 s timer."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_controld_guest_files import _ctx as guest_ctx

from zz.execution.runtime import Runtime, RuntimeOptions
from zz.execution.storelock import StoreLock
from zz.snapshots import dirstore


async def test_urgent_goes_before_background_holders_that_queued_first() -> None:
    lock = StoreLock()
    order: list[str] = []
    running = asyncio.Event()
    release = asyncio.Event()

    async def background(name: str, hold: bool = False) -> None:
        async with lock.background(name):
            order.append(name)
            if hold:
                running.set()
                await release.wait()

    async def urgent(name: str) -> None:
        async with lock.urgent(name):
            order.append(name)

    first = asyncio.create_task(background("serve 1", hold=True))
    await running.wait()
    queued = [asyncio.create_task(background(f"serve {k}")) for k in (2, 3)]
    await asyncio.sleep(0)  # both wait on the lock now
    ckpt = asyncio.create_task(urgent("checkpoint"))
    await asyncio.sleep(0)
    late = asyncio.create_task(background("serve 4"))
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(first, *queued, ckpt, late)
    assert order[:2] == ["serve 1", "checkpoint"], order
    assert sorted(order[2:]) == ["serve 2", "serve 3", "serve 4"], order
    assert lock.status()["urgent_wait_max_s"] >= 0 and not lock.locked()


async def test_two_urgent_holders_run_before_background_ones() -> None:
    lock = StoreLock()
    order: list[str] = []
    gate = asyncio.Event()

    async def hold(kind: str, name: str) -> None:
        cm = lock.urgent(name) if kind == "u" else lock.background(name)
        async with cm:
            order.append(name)
            if name == "first":
                await gate.wait()

    tasks = [asyncio.create_task(hold("b", "first"))]
    await asyncio.sleep(0)
    for kind, name in [("b", "b1"), ("u", "u1"), ("b", "b2"), ("u", "u2")]:
        tasks.append(asyncio.create_task(hold(kind, name)))
        await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(*tasks)
    assert order[0] == "first" and set(order[1:3]) == {"u1", "u2"}, order
    assert set(order[3:]) == {"b1", "b2"}, order


def _runtime_with_snapshots(tmp_path: Path, n: int) -> Runtime:
    """A runtime on the directory store with `n` checkpoints taken."""
    ctx = guest_ctx(tmp_path)
    svc = ctx.config.services[0]
    rt = Runtime(ctx.config, svc, 0, RuntimeOptions(state_dir=tmp_path / "st"))
    rt.ckpt.manifest_dir.mkdir(parents=True)
    rt._open_state()
    for k in range(1, n + 1):
        (rt.ckpt.store.path / f"f{k}").write_bytes(b"x" * k)
        rt._checkpoint(k * rt.cp)
    assert len(rt.ckpt.store.list_snapshots()) == n
    return rt


async def _checkpoint(rt: Runtime, events: list[str]) -> None:
    async with rt.ckpt.lock.urgent("checkpoint"):
        events.append("checkpoint")


async def test_a_checkpoint_waits_for_one_snapshot_not_the_whole_collection(
    tmp_path: Path,
) -> None:
    """Six snapshots to collect: a checkpoint asked for while the first is taken out of
    the store holds the store right after that one (the collection held the store for
    all six before)."""
    rt = _runtime_with_snapshots(tmp_path, 7)
    events: list[str] = []
    started = threading.Event()
    go = threading.Event()
    real_detach = rt.ckpt.store.detach_snapshot

    def detach(name: str) -> Callable[[], None]:
        events.append(f"destroy {name}")
        if not started.is_set():
            started.set()
            go.wait(30)
        return real_detach(name)

    rt.ckpt.store.detach_snapshot = detach  # type: ignore[method-assign]
    collect = asyncio.create_task(rt.ckpt._collect(7 * rt.cp))
    await asyncio.to_thread(started.wait, 30)
    ckpt = asyncio.create_task(_checkpoint(rt, events))
    await asyncio.sleep(0)
    go.set()
    await asyncio.gather(collect, ckpt)
    assert events[0].startswith("destroy") and events[1] == "checkpoint", events
    assert len(events) == 7 and rt.ckpt.store.list_snapshots() == [f"ckpt-{7 * rt.cp}"], events
    assert rt.counters["snapshots_destroyed"] == 6 and rt.counters["gc_errors"] == 0
    assert "store_lock" in rt.ckpt.status()


async def test_a_checkpoint_does_not_wait_while_a_collected_copy_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The removal of a collected directory copy (the long part) runs without the store:
    a checkpoint asked for meanwhile is not held up by it, and the copy is gone after."""
    rt = _runtime_with_snapshots(tmp_path, 2)
    snaps = rt.ckpt.store.root / "snapshots"
    removing = threading.Event()
    go = threading.Event()
    real_rmtree = shutil.rmtree

    def rmtree(path: Any, *args: Any, **kw: Any) -> None:
        if Path(path).name.startswith(".del-"):  # a collected copy
            removing.set()
            go.wait(30)
        real_rmtree(path, *args, **kw)

    monkeypatch.setattr(dirstore.shutil, "rmtree", rmtree)
    events: list[str] = []
    collect = asyncio.create_task(rt.ckpt._collect(2 * rt.cp))
    assert await asyncio.to_thread(removing.wait, 30)
    assert rt.ckpt.store.list_snapshots() == [f"ckpt-{2 * rt.cp}"]
    # A hang guard, not a timing check: the checkpoint must not need `go`.
    await asyncio.wait_for(_checkpoint(rt, events), 30)
    assert events == ["checkpoint"] and not go.is_set()
    go.set()
    await collect
    assert sorted(p.name for p in snaps.iterdir()) == [f"ckpt-{2 * rt.cp}"]
