# tests/test_campaign.py - the adversarial campaign (zz/campaign.py, `zz bench byzantine`): its
# invariant checker on made-up rounds, the Byzantine behaviours' switch (execution/byzantine.py)
# and a short seeded run against a real process-backend rack.
from __future__ import annotations

import collections
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.test_execution_runtime import needs_agreed
from zz import campaign as cp
from zz import rackctl, wire
from zz.config import load
from zz.execution import byzantine
from zz.procrack import DEFAULT_AGREED

needs_go = pytest.mark.skipif(
    shutil.which("go") is None and "ZZ_LINCHECK" not in os.environ,
    reason="no Go toolchain for tools/lincheck: run scripts/setup-go.sh",
)
AGREED = Path(os.environ["ZZ_AGREED"]) if os.environ.get("ZZ_AGREED") else DEFAULT_AGREED


# ---- the invariant checker on made-up rounds ----------------------------------------------
def _healthy(r: cp.Round, awake: list[int], sleeping: list[int]) -> cp.Round:
    r.views = {f"kv0/agreed-{k}": {"awake": awake, "sleeping": sleeping} for k in range(4)}
    r.controld_running, r.controld_sleeping = awake, sleeping
    r.worst_gap_s, r.linearizable = 2.0, True
    return r


def _good_round() -> cp.Round:
    """exec-0 lies, spare 2 is woken, the SHUTDOWN at the round's seq convicts 0, and 0's
    fresh spare sleeps again."""
    r = cp.Round(1, f=1, attacks=[cp.Attack(0, "wrong-reply")])
    r.wakeups = {100: [2]}
    r.shutdowns = {100: [0]}
    return _healthy(r, [1, 2], [0])


def _kinds(r: cp.Round) -> list[str]:
    return [k for k, _ in cp.check_round(r, bound_s=30)]


def test_a_clean_round_violates_nothing() -> None:
    assert cp.check_round(_good_round(), bound_s=30) == []


def test_convicting_a_correct_replica_is_a_false_conviction() -> None:
    r = _good_round()
    r.shutdowns = {100: [1]}  # the correct exec-1 convicted, the liar kept
    got = cp.check_round(r, bound_s=30)
    assert ("false-conviction", "exec-1 convicted at seq 100, correct") in got
    assert "missed-conviction" in [k for k, _ in got]  # and the wake-up convicted no liar


def test_a_conviction_besides_the_faulty_one_is_still_false() -> None:
    r = _good_round()
    r.shutdowns = {100: [0, 1]}
    assert _kinds(r) == ["false-conviction"]


def test_the_fresh_spare_of_a_convicted_liar_is_correct() -> None:
    """exec-0 lies and is convicted at 100; its fresh spare (index 0 again) is woken at 120
    and convicted: that second conviction is of a correct replica."""
    r = _good_round()
    r.wakeups[120] = [0]
    r.shutdowns[120] = [0]
    got = cp.check_round(r, bound_s=30)
    assert [k for k, _ in got] == ["false-conviction", "missed-conviction"], got
    assert "fresh spare" in got[0][1]


def test_a_wakeup_without_shutdown_is_a_missed_conviction() -> None:
    r = _good_round()
    r.shutdowns = {}
    assert _kinds(r) == ["missed-conviction"]
    r = _good_round()
    r.wakeups[140] = [0]  # a second round, never decided
    assert _kinds(r) == ["missed-conviction"]


def test_a_sibling_wakeup_is_the_same_wake_up() -> None:
    """One fault flagged at 100 and 101, both WAKEUPs certified before the SHUTDOWN at 100:
    controld woke 2 once and the round at 100 convicted the liar (seed 3001 round 17)."""
    r = _good_round()
    r.wakeup_awake = {100: [0, 1], 101: [0, 1]}
    r.wakeups[101] = [2]
    assert _kinds(r) == []
    r.wakeup_awake[101] = [1, 2]  # another awake set: another round, never decided
    assert _kinds(r) == ["missed-conviction"]
    r.wakeup_awake[101] = [0, 1]
    r.shutdowns = {101: [0]}  # controld acted on the higher one: the lower is the same
    assert _kinds(r) == []
    r.wakeups, r.wakeup_awake = {100: [2], 130: [2]}, {100: [0, 1], 130: [0, 1]}
    r.shutdowns = {100: [0], 120: [1]}  # a SHUTDOWN between: 130 is a round of its own
    assert "missed-conviction" in _kinds(r)


def test_a_sibling_wakeup_may_wake_fewer() -> None:
    """f = 2, a crash and a liar (seed 3102, a rerun's round 10): the mismatch at 6304 woke
    two spares, the timeout alone at 6305 one; the SHUTDOWN at 6304 settled both."""
    attacks = [cp.Attack(0, "crash-before-checkpoint"), cp.Attack(1, "wrong-checkpoint")]
    r = cp.Round(10, f=2, attacks=attacks)
    r.wakeups, r.wakeup_awake = {6304: [3, 4], 6305: [3]}, {6304: [0, 1, 2], 6305: [0, 1, 2]}
    r.shutdowns = {6304: [0, 1]}
    _healthy(r, [2, 3, 4], [0, 1])
    assert cp.check_round(r, bound_s=30) == []


def test_a_wakeup_that_mends_a_shortfall_convicts_nobody() -> None:
    """f = 2, two equivocating replicas (seed 3902 round 135): the merged outcome of the
    first round kept 1 and 2 active, 4 asleep; the next seq had two matching reports of
    three needed, and the round woke the fresh spare 0 and convicted nobody, as it must.
    The same SHUTDOWN over f+1 awake replicas is still a missed conviction."""
    attacks = [cp.Attack(0, "equivocate"), cp.Attack(3, "equivocate")]
    r = cp.Round(135, f=2, attacks=attacks)
    r.wakeups, r.wakeup_awake = {33600: [2, 4], 33634: [0]}, {33600: [0, 1, 3], 33634: [1, 2]}
    r.shutdowns = {33600: [0, 3], 33634: []}
    _healthy(r, [0, 1, 2], [3, 4])
    assert cp.check_round(r, bound_s=30) == []
    assert any("shortfall" in n for n in r.notes), r.notes
    r.wakeup_awake[33634] = [1, 2, 4]
    r.notes = []
    assert _kinds(r) == ["missed-conviction"]


def test_a_round_that_wakes_nobody_convicts_the_liar() -> None:
    """exec-0 lies; the round at 100 woke 2, which was overdue, and closed undecided; the
    round at 100 over {0, 1, 2} woke nobody (the controlds logged `wake []`) and its
    SHUTDOWN convicted 0 (docs/fault-detection.md §4a). Without that SHUTDOWN the liar
    stays unconvicted: a missed conviction."""
    r = _good_round()
    r.wakeups, r.wakeup_awake = {100: []}, {100: [0, 1, 2]}
    assert cp.check_round(r, bound_s=30) == []
    r.shutdowns = {}
    assert _kinds(r) == ["missed-conviction"]


def test_no_wakeup_no_conviction_is_fine() -> None:
    """A behaviour nobody can see (a replayed old report) wakes nobody: nothing to convict."""
    r = _healthy(cp.Round(1, f=1, attacks=[cp.Attack(1, "replay-old")]), [0, 1], [2])
    assert cp.check_round(r, bound_s=30) == []


def test_stall_linearizability_and_cost() -> None:
    r = _good_round()
    r.worst_gap_s = 31.0
    assert _kinds(r) == ["stall"]
    r.worst_gap_s = None
    assert _kinds(r) == ["stall"]
    r = _good_round()
    r.linearizable, r.linearizability = False, "kv0: NOT linearizable"
    assert _kinds(r) == ["not-linearizable"]
    r = _good_round()
    r.views["kv0/agreed-3"] = {"awake": [0, 1, 2], "sleeping": []}
    assert _kinds(r) == ["cost"]
    r = _good_round()
    r.controld_sleeping = []
    assert _kinds(r) == ["cost"]
    r = _good_round()
    r.dead = [0]
    assert _kinds(r) == ["cost"]


def test_f2_two_liars_one_convicted_per_round() -> None:
    r = cp.Round(3, f=2, attacks=[cp.Attack(0, "wrong-reply"), cp.Attack(1, "slow")])
    r.wakeups = {50: [3, 4]}
    r.shutdowns = {50: [0, 1]}
    _healthy(r, [2, 3, 4], [0, 1])
    assert cp.check_round(r, bound_s=30) == []
    assert r.label == "slow+wrong-reply"


def test_figures_count_by_behaviour() -> None:
    fg = cp.Figures(1)
    fg.add(_good_round())
    bad = _good_round()
    bad.shutdowns = {100: [1]}
    bad.violations = cp.check_round(bad, 30)
    fg.add(bad)
    j = fg.to_json()
    assert j["rounds"] == 2 and j["attacks"] == {"wrong-reply": 2}
    assert j["false_convictions"] == 1 and j["missed_convictions"] == 1 and j["stalls"] == 0
    assert j["by_behaviour"]["wrong-reply"] == {
        "rounds": 2,
        "false-conviction": 1,
        "missed-conviction": 1,
    }
    assert j["worst_time_to_correct_service_s"] == 2.0
    assert "false convictions 1" in cp.format_figures([fg], 5, 30)


def test_menu_and_known_open_are_consistent() -> None:
    assert set(cp.TESTED) <= set(cp.BEHAVIOURS)
    assert not set(cp.TESTED) & set(cp.KNOWN_OPEN)
    assert set(cp.KNOWN_OPEN) <= set(cp.BEHAVIOURS)
    runtime_faults = {"wrong-reply", "slow", "corrupt-snapshot"}
    assert set(cp.BEHAVIOURS) == runtime_faults | set(byzantine.BEHAVIOURS)


def test_plans_are_seeded_and_at_most_f(tmp_path: Path) -> None:
    config = load(cp.write_rack(tmp_path, 2))
    assert len(config.hosts) == 5 and config.services[0].n_exec == 5

    def plans(seed: int) -> list[list[tuple[int, str]]]:
        c = cp.Campaign(config, cp.Options(), random.Random(seed), print)
        return [[(a.replica, a.behaviour) for a in c._plan([0, 1, 2])] for _ in range(50)]

    a = plans(3)
    assert a == plans(3) and a != plans(4)
    assert all(1 <= len(p) <= 2 and len({i for i, _ in p}) == len(p) for p in a)
    assert any(len(p) == 2 for p in a)


# ---- the behaviours' switch ---------------------------------------------------------------
class _Rt:
    """What Byzantine reads of a runtime."""

    class svc:  # noqa: N801
        g = 1
        id = 1

    cp = 32
    stable_checkpoint = 0


def test_byzantine_configure_validates() -> None:
    b = byzantine.Byzantine(_Rt())  # type: ignore[arg-type]
    b.configure("equivocate", {"to": [2, 3]})
    assert b.mode == "equivocate" and b.to == {2, 3}
    b.configure("wrong-reply", {})  # the runtime's own fault: nothing here
    assert b.mode is None
    b.configure("equivocate", {})
    assert b.to == {0, 1}  # g+1 agreement replicas by default
    with pytest.raises(ValueError):
        b.configure("future-seq", {"ahead": [-1]})
    with pytest.raises(ValueError):
        b.configure("report-flood", {"copies": 10**6})
    assert b.mode == "equivocate"  # unchanged by a bad file
    b.configure(None, {})
    assert b.mode is None and not b.lying(100)


def test_byzantine_replay_old_sends_the_kept_reports_macd() -> None:
    """Reports are kept without MACs (no MAC work per batch with no fault on); replay-old
    sends the kept one of seq - d with the MACs it would have carried, and only the last
    _KEEP_REPORTS are kept."""
    sent: list[bytes] = []
    rt = _Rt()
    rt.me, rt.agree_keys = 256, {r: bytes([r + 1]) * 32 for r in range(4)}  # type: ignore[attr-defined]
    rt.counters = collections.Counter()  # type: ignore[attr-defined]
    rt._send_agreement = sent.append  # type: ignore[attr-defined]
    b = byzantine.Byzantine(rt)  # type: ignore[arg-type]

    def report(seq: int) -> wire.ExecReport:
        return wire.ExecReport.of(1, 256, seq, [wire.reply_ref(0, seq, b"r%d" % seq)])

    for seq in range(1, 2001):
        assert b.report(seq, report(seq)) is False  # no fault: the runtime sends it
    assert min(b._sent) == 2001 - byzantine._KEEP_REPORTS and len(b._sent) == 1025
    b.configure("replay-old", {"back": [0, 5]})
    assert b.report(2001, report(2001)) is True
    assert sent == [report(s).with_macs(rt.agree_keys).encode() for s in (2001, 1996)]  # type: ignore[attr-defined]


# ---- a short seeded run on a real rack ----------------------------------------------------
@pytest.mark.slow
@needs_agreed
@needs_go
@pytest.mark.skipif(not AGREED.exists(), reason=f"no zz-agreed at {AGREED}")
def test_short_seeded_campaign(tmp_path: Path) -> None:
    """Two rounds of f = 1 with the behaviours today's code handles: the campaign's own
    checks hold (0 false convictions, 0 missed, 0 stalls, linearizable, f+1 again), and
    the rack is gone afterwards. Seed 7 plays corrupt-snapshot on exec-0, then wrong-reply
    on exec-1: the second round does not bring the awake set back to the first round's,
    which today re-opens the first round (zz.campaign.KNOWN_OPEN_SEQUENCES)."""
    opts = cp.Options(rounds=2, behaviours=cp.TESTED, agreed=AGREED)
    out = tmp_path / "out"
    result = cp.run_campaign([1], opts, seed=7, out=out, workdir=tmp_path)
    (run,) = result["runs"]
    print(result["summary"])
    assert run["error"] is None, run["error"]
    figs = run["figures"]
    assert figs["rounds"] == 2
    bad = [(r["index"], r["behaviours"], r["violations"]) for r in run["rounds"] if r["violations"]]
    assert not bad, bad
    assert figs["false_convictions"] == figs["missed_convictions"] == figs["stalls"] == 0
    assert figs["wakeups"] >= 1 and figs["convictions"] >= 1
    assert all(r["linearizable"] for r in run["rounds"])
    assert json.loads((out / "campaign.json").read_text())["seed"] == 7
    assert [r["behaviours"] for r in run["rounds"]] == ["corrupt-snapshot", "wrong-reply"]
    leftover = [d for d in tmp_path.glob("zz-byz-f1-*")]
    assert not leftover, "the rack's directory is removed after a clean run"
    for d in leftover:
        assert not rackctl.rack_leftovers(load(d / "rack.toml"))


# `long`: the zz-agreed side of the same finding is
# tests/test_key_epochs.py::test_a_restart_takes_the_announced_key_of_a_slot_not_convicted_here,
# in the default run; this one replays it through a whole campaign rack (14 s).
@pytest.mark.slow
@pytest.mark.long
@needs_agreed
@pytest.mark.skipif(not AGREED.exists(), reason=f"no zz-agreed at {AGREED}")
def test_a_slot_re_keyed_before_a_restart_is_not_convicted_after_it(tmp_path: Path) -> None:
    """The campaign's rack restart after a round whose conviction some agreement replicas
    had not applied (seed 3101 rounds 26 and 27). Slot 0's controld re-keyed it for a
    successor and announced the key, which every agreement replica held: slot 0 is awake,
    not convicted, there. The restart keeps the key directory, so the correct runtime
    started in slot 0 speaks the new key; each agreement replica must take it at start, or
    it drops all the runtime sends and the runtime, silent at seq 1, is convicted."""
    import asyncio
    import socket
    import time

    from zz import keys, wire
    from zz.drill import start_load, stop_load

    config = load(cp.write_rack(tmp_path / "rack", 1))
    s = config.services[0]
    camp = cp.Campaign(config, cp.Options(agreed=AGREED), random.Random(1), lambda _: None)
    stats = [config.rack.run_dir / f"s{s.id}" / f"agreed-{r}.stats.json" for r in range(s.n)]

    def agreed() -> list[dict[str, object]]:
        out = []
        for p in stats:
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                out.append({})
        return out

    def wait(pred: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"{what}: {agreed()}"
            time.sleep(0.2)

    camp.up()
    try:
        kd = config.rack.key_dir
        h = s.exec_host(config, 0).index
        ctl = keys.load_secret(
            keys.secret_path(kd, keys.RACK_SERVICE, keys.controld_principal(h))
        ).sign
        assert ctl is not None
        raw = keys.rotate_exec(kd, config, s, 0, 5, ctl, h)
        for r in range(s.n):
            with socket.create_connection(config.replica_address(s, r), timeout=5) as sock:
                sock.sendall(wire.frame(raw))
        wait(lambda: all(d.get("spares_ready_held") == 1 for d in agreed()), "held")

        camp.restart("test: slot 0 re-keyed")
        assert asyncio.run(camp._ready(60)) == []  # every runtime linked: ready for a round

        async def run_load() -> dict[str, int]:
            ld = start_load(config, [s], 2, None)
            # Past the report timer's floor (cp.OVERRIDES, 4 s) after the first seqs.
            await asyncio.sleep(8)
            await stop_load(ld)
            return dict(ld.tally)

        tally = asyncio.run(run_load())
        assert tally.get("ok", 0) > 0, tally
        for d in agreed():
            assert d["exec_convicted"] == [] and d["wakeups_sent"] == 0, d
            assert d["exec_awake"] == [0, 1], d
        st = json.loads(s.exec_status_path(config, 0).read_text())
        assert st["last_executed"] > 0, st
        assert all(d["exec_key_epoch"][0] == 1 for d in agreed())
    finally:
        cp.down(config)


def test_a_round_waits_for_every_active_replica_to_hold_the_whole_state() -> None:
    """The next fault waits until the runtimes woken by the last one have fetched every
    certified file: otherwise the files may exist only at the replicas the round makes
    faulty (seed 3402 round 53, f = 2), and a correct replica never completes."""
    ready = {"agreement_links_answered": 4, "agreement_links_up": 4, "recovering": False}
    assert cp.runtime_problems(0, ready, 4) == []
    recovering = {**ready, "recovering": True, "files_pending": 17}
    assert cp.runtime_problems(1, recovering, 4) == [
        "exec-1 still recovering (17 files to fetch)"
    ]
    late = {**ready, "agreement_links_answered": 3}
    assert cp.runtime_problems(2, late, 4) == [
        "exec-2 answered by 3 of 4 agreement replicas (4 linked)"
    ]
    assert len(cp.runtime_problems(3, {}, 4)) == 1  # no status file yet: not ready


def test_a_campaign_refuses_a_tree_whose_sub_packages_come_from_another(tmp_path: Path) -> None:
    """A copy of zz/ on PYTHONPATH without its controld, execution and snapshots would
    run the installed tree's runtimes: the campaign refuses it, naming the package."""
    import subprocess
    import sys

    from zz.procrack import REPO, split_tree

    assert split_tree() is None
    shutil.copytree(REPO / "zz", tmp_path / "zz", ignore=shutil.ignore_patterns("__pycache__"))
    run = subprocess.run(
        [sys.executable, "-m", "zz.campaign", "--rounds", "1", "--f", "1"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "zz.controld comes from" in run.stderr and f"not from {tmp_path}" in run.stderr
