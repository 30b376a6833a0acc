# tests/test_controld_guest_files.py - what controld puts on a guest's share for the runtime
# inside it (controld/actions.py write_guest_files), and the runtime's drill fault switch.
# Without VMs: the files are checked here, their use in real guests in tests/test_vm_drills.py.
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import RACK_TOML

from zz import keys
from zz.config import load
from zz.controld import actions
from zz.drillfaults import FAULT_FILE
from zz.execution.drillfaults import SLOW_REPORT_SECONDS
from zz.execution.runtime import Runtime, RuntimeOptions


def _ctx(tmp_path: Path, **kw: Any) -> actions.HostContext:
    path = tmp_path / "rack.toml"
    path.write_text(RACK_TOML.format(base_port=17100).replace('sleep = "paused"', ""))
    config = load(path)
    keys.generate(config)
    hv = SimpleNamespace(kind="libvirt", state_accessmode="passthrough")
    return actions.HostContext(config, config.hosts[1], hv, tmp_path / "home", **kw)  # type: ignore[arg-type]


def test_guest_gets_its_own_keys_config_and_command(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path, drill_faults=True)
    svc = ctx.config.services[0]
    state = svc.exec_state_dir(ctx.config, 1)
    state.mkdir(parents=True)
    (state / "status.json").write_text("{}")  # an earlier incarnation's
    actions.write_guest_files(ctx, svc, 1, state, None, asleep=True)

    files = sorted(str(p.relative_to(state)) for p in state.rglob("*") if p.is_file())
    me = keys.secret_path(Path("keys"), svc.id, 256 + 1)
    assert files == sorted(
        ["guest/rack.toml", f"guest/{me}", f"guest/keys/s{svc.id}/public", "zz-guest.json"]
    ), "only this replica's secret travels, and the stale status is gone"
    assert (state / "guest" / me).read_bytes() == (
        ctx.config.rack.key_dir / me.relative_to("keys")
    ).read_bytes()
    assert (state / "guest" / me).stat().st_mode & 0o077 == 0

    cfg = json.loads((state / "zz-guest.json").read_text())
    assert cfg["start"] == "boot"
    cmd = cfg["command"]
    assert cmd[:3] == ["python3", "-m", "zz.execution"]
    args = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert args["--rack"] == "/state/guest/rack.toml" and args["--state-dir"] == "/state"
    assert args["--loopback-alias"] == "10.0.2.2" and args["--listen"] == "0.0.0.0"
    assert "--start-asleep" in cmd and "--drill-faults" in cmd and "--inject-fault" not in cmd
    assert args["--store"] == "dir"  # directory snapshots on the share
    # A rack on ZFS: the host mounts the guest's dataset in the share and snapshots it.
    (tmp_path / "z").mkdir()
    zfs = actions.guest_runtime_command(_ctx(tmp_path / "z", store="zfs"), svc, 1, None, False)
    assert zfs[zfs.index("--store") + 1] == "host-zfs"

    # The guest's view of that config: the agreement replicas at the host's loopback alias.
    seen = load(state / "guest" / "rack.toml").viewed_from("10.0.2.2", state / "guest" / "keys")
    assert seen.replica_address(svc, 0)[0] == "10.0.2.2"
    assert keys.load_secret(keys.secret_path(seen.rack.key_dir, svc.id, 257)).sign is not None


def test_hibernated_spare_starts_its_runtime_at_the_wake(tmp_path: Path) -> None:
    """The agent stops the runtime to unmount the share before the save: a hibernated
    spare's runtime starts at the wake, awake (no --start-asleep, no notice to wait for)."""
    ctx = _ctx(tmp_path)
    svc = ctx.config.services[0]
    svc = type(svc)(**{**svc.__dict__, "sleep": "hibernated"})
    state = svc.exec_state_dir(ctx.config, 2)
    state.mkdir(parents=True)
    actions.write_guest_files(ctx, svc, 2, state, "wrong-reply", asleep=True)
    cfg = json.loads((state / "zz-guest.json").read_text())
    assert cfg["start"] == "wake"
    assert "--start-asleep" not in cfg["command"] and "--drill-faults" not in cfg["command"]
    assert cfg["command"][-2:] == ["--inject-fault", "wrong-reply"]


def test_guest_share_is_9p_wherever_a_replica_may_be_hibernated(tmp_path: Path) -> None:
    """docs/images.md "The state share": virtiofs for a service whose spares pause (active
    and paused alike), 9p for every replica of one whose spares hibernate (an active one
    goes back to sleep hibernated) and for one provisioned hibernated; rack.guest_share
    "9p" gives 9p to all. A virtiofs guest cannot be saved."""
    ctx = _ctx(tmp_path)
    paused = ctx.config.services[0]
    assert paused.sleep == "paused"
    hib = type(paused)(**{**paused.__dict__, "sleep": "hibernated"})
    assert actions.guest_share(ctx, paused, "active") == "virtiofs"
    assert actions.guest_share(ctx, paused, "paused") == "virtiofs"
    assert actions.guest_share(ctx, paused, "hibernated") == "9p"
    assert actions.guest_share(ctx, hib, "active") == "9p"
    assert actions.guest_share(ctx, hib, "hibernated") == "9p"
    rack = type(ctx.config.rack)(**{**ctx.config.rack.__dict__, "guest_share": "9p"})
    ctx9 = actions.HostContext(
        type(ctx.config)(**{**ctx.config.__dict__, "rack": rack}), ctx.host, ctx.hv, ctx.home
    )
    assert actions.guest_share(ctx9, paused, "active") == "9p"


def test_runtime_switches_its_fault_from_the_fault_file(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    svc = ctx.config.services[0]
    rt = Runtime(ctx.config, svc, 0, RuntimeOptions(state_dir=tmp_path / "st", drill_faults=True))
    path = tmp_path / FAULT_FILE
    path.write_text('{"fault": "wrong-reply"}')
    rt.faults.read_file(path)
    assert rt.faults.fault == "wrong-reply" and rt.counters["fault_switches"] == 1
    # A switch has the status written at once: a drill waits for it there (--cp-phase).
    assert rt._status_changed.is_set()
    rt._status_changed.clear()
    for bad in ("{", '{"fault": "eat-cpu"}', "[1]"):
        path.write_text(bad)
        rt.faults.read_file(path)
    assert rt.faults.fault == "wrong-reply" and rt.counters["bad_fault_file"] == 3
    assert not rt._status_changed.is_set()
    path.write_text('{"fault": null}')
    rt.faults.read_file(path)
    assert rt.faults.fault is None
    path.write_text('{"fault": "slow-report"}')
    rt.faults.read_file(path)
    path.unlink()
    rt.faults.read_file(path)  # gone: behave again
    assert rt.faults.fault is None and rt.counters["fault_switches"] == 4


def test_fault_file_sets_how_slow_a_slow_replica_is(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    rt = Runtime(ctx.config, ctx.config.services[0], 0, RuntimeOptions(state_dir=tmp_path / "st"))
    path = tmp_path / FAULT_FILE
    assert rt.faults.slow_report_s == SLOW_REPORT_SECONDS
    path.write_text('{"fault": "slow-report", "slow_report_ms": 6000}')
    rt.faults.read_file(path)
    assert rt.faults.fault == "slow-report" and rt.faults.slow_report_s == 6.0
    for bad in ('"6000"', "-1", "600001", "true", "null"):
        path.write_text(f'{{"fault": "wrong-reply", "slow_report_ms": {bad}}}')
        rt.faults.read_file(path)
    # Refused whole: neither the fault nor the delay changed.
    assert rt.counters["bad_fault_file"] == 5
    assert rt.faults.fault == "slow-report" and rt.faults.slow_report_s == 6.0
    path.write_text('{"fault": null}')
    rt.faults.read_file(path)
    assert rt.faults.fault is None and rt.faults.slow_report_s == SLOW_REPORT_SECONDS


def test_fault_file_holds_a_corrupt_snapshot_replicas_lies_back(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    rt = Runtime(ctx.config, ctx.config.services[0], 0, RuntimeOptions(state_dir=tmp_path / "st"))
    path = tmp_path / FAULT_FILE
    path.write_text('{"fault": "corrupt-snapshot", "lie": false}')
    rt.faults.read_file(path)
    assert rt.faults.fault == "corrupt-snapshot" and rt.faults.corrupt_lies is False
    rt.faults.corrupt_lie_from = 40  # a corrupted checkpoint became stable
    assert not rt.faults.lying(41)
    for bad in ('"no"', "0", "null"):
        path.write_text(f'{{"fault": "corrupt-snapshot", "lie": {bad}}}')
        rt.faults.read_file(path)
    assert rt.counters["bad_fault_file"] == 3 and rt.faults.corrupt_lies is False
    path.write_text('{"fault": "corrupt-snapshot"}')
    rt.faults.read_file(path)
    assert not rt.faults.lying(39) and rt.faults.lying(40) and rt.faults.lying(41)
    path.write_text('{"fault": null}')
    rt.faults.read_file(path)
    assert not rt.faults.lying(41)


def test_a_resumed_runtime_takes_the_wake_notice_before_the_log(tmp_path: Path) -> None:
    """The log the agreement replicas serve at a wake-up may reach a resumed runtime before
    its notice poll: the round's seq must be taken first, and a recovery target chosen by an
    earlier round's seq at or above it dropped (campaign seed 3202 round 18)."""
    from zz import wire
    from zz.execution.runtime import WAKE_NOTICE

    ctx = _ctx(tmp_path)
    rt = Runtime(ctx.config, ctx.config.services[0], 0, RuntimeOptions(state_dir=tmp_path / "st"))
    rt.state_dir.mkdir(parents=True, exist_ok=True)
    # Woken before for a round at seq 40 (its patience long over) and a target at 48.
    rt._fault_seq, rt._fault_seq_at = 40, 0.0
    rt._recover_target = (48, b"\x01" * 32)
    notice = rt.state_dir / WAKE_NOTICE
    notice.write_text(json.dumps({"recovering_from_seq": 48, "awake": [0, 1]}))
    empty_log = (0).to_bytes(8, "big") + (0).to_bytes(4, "big")
    reply = wire.FetchReply(rt.svc.id, 0, wire.FETCH_LOG, 0, wire.NULL_DIGEST, empty_log)
    rt._on_fetch_reply(None, reply)  # type: ignore[arg-type]
    assert rt._fault_seq == 48 and rt._recover_target is None
    assert rt.counters["wake_notices_peeked"] == 1 and rt.counters["recover_target_dropped"] == 1
    rt._on_fetch_reply(None, reply)  # type: ignore[arg-type]
    assert rt.counters["wake_notices_peeked"] == 1  # the same notice is taken once


def _start_and_wake(rt: Runtime, wake: Callable[[], Awaitable[None]]) -> None:
    """Start the sleeping runtime `rt`, run `wake` right after, give it 2 s to wake, stop it."""
    import asyncio

    async def run() -> None:
        await rt.start()
        try:
            await wake()
            for _ in range(100):
                await asyncio.sleep(0.02)
                if not rt.asleep:
                    break
        finally:
            await rt.shutdown()

    asyncio.run(run())


def test_a_spare_paused_before_its_wake_watch_ran_still_wakes(tmp_path: Path) -> None:
    """controld writes the wake notice before it resumes a spare. A spare provisioned and
    paused before its notice watch took its first step must still take that notice as new
    (campaign seed 3302 round 3, f = 2: the woken fresh spare stayed silent and was
    convicted)."""

    from zz.execution.runtime import WAKE_NOTICE

    ctx = _ctx(tmp_path)
    state = tmp_path / "st"
    rt = Runtime(
        ctx.config, ctx.config.services[0], 0, RuntimeOptions(state_dir=state, asleep=True)
    )

    async def notice() -> None:
        # No await since start(): the watch task has not run a step yet, as in a spare
        # stopped right after it began listening and resumed after the notice was written.
        (state / WAKE_NOTICE).write_text(json.dumps({"recovering_from_seq": 7, "awake": [1]}))

    _start_and_wake(rt, notice)
    assert not rt.asleep and rt.counters["wake_notices"] == 1
    assert rt._fault_seq == 7
    # The wake's steps (status wake_marks): the poll's look that found the notice, the
    # notice taken and read, the links started; noticed by the poll, not a poke.
    m = rt.wake_marks
    assert m["poll_before"] <= m["poll_looked"] <= m["noticed"] <= m["notice_read"], m
    assert m["notice_read"] <= m["links_started"] and "poked" not in m, m
    assert rt.recovery["noticed_by"] == "poll"


def test_a_poked_spare_takes_the_notice_and_marks_the_poke(tmp_path: Path) -> None:
    """The guest agent's SIGUSR1 (poke_wake) makes the watch read the notice whatever its
    mtime says; the wake's marks say it was the poke and when it came."""
    import asyncio
    import os

    from zz.execution.runtime import WAKE_NOTICE

    ctx = _ctx(tmp_path)
    state = tmp_path / "st"
    state.mkdir()
    notice = state / WAKE_NOTICE
    notice.write_text(json.dumps({"recovering_from_seq": 9, "awake": [1]}))
    os.utime(notice, ns=(10**9, 10**9))
    rt = Runtime(
        ctx.config, ctx.config.services[0], 0, RuntimeOptions(state_dir=state, asleep=True)
    )
    rt._notice_taken = None  # a notice before this runtime, taken as new only when poked

    async def poke() -> None:
        for _ in range(5):
            await asyncio.sleep(0.02)
        assert rt.asleep  # its mtime is the one seen at the start: no wake
        rt.poke_wake()

    _start_and_wake(rt, poke)
    assert not rt.asleep and rt._fault_seq == 9
    assert rt.recovery["noticed_by"] == "poke"
    m = rt.wake_marks
    assert m["poked"] <= m["poll_looked"] <= m["noticed"] <= m["links_started"], m


def test_a_running_guest_takes_a_slots_new_key_from_its_host(tmp_path: Path) -> None:
    """A guest's key copy is made at its provisioning. When a slot is re-keyed later (a
    convicted replica's successor), controld copies the announcement, and the controlds'
    keys that verify it, into the running guest's copy (actions.refresh_guest_keys), where
    its runtime's PeerKeys takes the successor's new signing key: without it the guest
    dropped the successor's FILE-FETCHes as badly signed."""
    from collections import Counter

    ctx = _ctx(tmp_path)
    config, svc = ctx.config, ctx.config.services[0]
    state = svc.exec_state_dir(config, 1)
    state.mkdir(parents=True)
    actions.write_guest_files(ctx, svc, 1, state, None, asleep=False)
    guest_keys = state / "guest" / "keys"
    peer = keys.PeerKeys(guest_keys, config, svc, Counter())
    old = peer[256 + 0]
    assert actions.refresh_guest_keys(ctx, svc, state) == 0, "nothing re-keyed yet"

    h = svc.exec_host(config, 0).index
    ctl = keys.load_secret(keys.secret_path(config.rack.key_dir, keys.RACK_SERVICE,
                                            keys.controld_principal(h)))  # fmt: skip
    assert ctl.sign is not None
    keys.rotate_exec(config.rack.key_dir, config, svc, 0, 9, ctl.sign, h)
    assert peer[256 + 0] == old, "the guest's copy does not have it yet"
    assert actions.refresh_guest_keys(ctx, svc, state) == 2  # s0/public, spare-p256.msg
    new = peer[256 + 0]
    assert new != old and peer.epochs[256 + 0] == 1
    assert new == keys.service_publics(config.rack.key_dir, config, svc)[256 + 0]
    assert actions.refresh_guest_keys(ctx, svc, state) == 0, "already up to date"
    assert not list(guest_keys.rglob("*.new"))
    # A guest with no key copy (not provisioned here, or a fake guest) is left alone.
    assert actions.refresh_guest_keys(ctx, svc, tmp_path / "none") == 0


def test_the_status_takes_mono_now_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host places a runtime's marks by its status file's mtime and `mono_now`: the
    clock is read after the status is encoded, right before the bytes are written, so the
    encoding's time (10-100 ms in the guests) does not shift the marks."""
    from zz.execution import runtime as rtmod

    ctx = _ctx(tmp_path)
    rt = Runtime(ctx.config, ctx.config.services[0], 0, RuntimeOptions(state_dir=tmp_path / "st"))
    rt.status_path.parent.mkdir(parents=True, exist_ok=True)
    clock = iter([100.0, 200.0, 300.0])  # status() reads it first, _with_mono_now last
    monkeypatch.setattr(rtmod.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(rt, "status", lambda: {"index": 0, "mono_now": rtmod.time.monotonic()})
    rt._write_status()
    st = json.loads(rt.status_path.read_text())
    assert st == {"index": 0, "mono_now": 200.0}
    assert json.loads(rtmod._with_mono_now("{}")).keys() == {"mono_now"}
