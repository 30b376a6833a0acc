# tests/test_bench_hostfail.py - the parts of scripts/bench/hostfail that need no rack: the
# per-second series from the drill load's records, the longest gap, a service's figures, the
# paper's verdict, the table, and the rack of the three layouts (placement only). < 1 s.
from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from zz.config import load
from zz.placement import plan
from zz.powerloss import write_rack

REPO = Path(__file__).resolve().parent.parent
S = 1_000_000_000  # ns


def _bench() -> ModuleType:
    path = REPO / "scripts" / "bench" / "hostfail"
    loader = importlib.machinery.SourceFileLoader("bench_hostfail", str(path))
    spec = importlib.util.spec_from_loader("bench_hostfail", loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


hf = _bench()


def test_per_second_counts_ok_returns_by_second_from_t0() -> None:
    t0 = 100 * S
    http = [
        (t0 - 2 * S, t0 - S, True),  # warm-up: before t0
        (t0, t0 + S // 2, True),
        (t0, t0 + S // 2, False),  # not ok
        (t0, None, False),  # never returned
        (t0 + S, t0 + 2 * S + 1, True),
        (t0 + S, t0 + 2 * S + 2, True),
        (t0 + 3 * S, t0 + 9 * S, True),  # after the run
    ]
    assert hf.per_second(http, t0, 4) == [1, 0, 2, 0]
    assert hf.per_second([], t0, 3) == [0, 0, 0]


def test_longest_gap_spans_the_fault() -> None:
    t0 = 0
    rets = [1.0, 2.0, 9.5, 10.0, 13.0]
    http = [(0, int(t * S), True) for t in rets] + [(0, int(11 * S), False)]
    # last ok before the fault at 5 s is 2.0; the next at 9.5: 7.5 s without a reply.
    assert hf.longest_gap(http, t0, 5.0, 20.0) == 7.5
    # nothing after the fault: from the last reply to the end
    assert hf.longest_gap(http[:2], t0, 5.0, 8.0) == 6.0


def test_service_figures() -> None:
    series = [10] * 20 + [0, 0, 3, 8, 9] + [10] * 15
    f = hf.service_figures(series, 20, 10)
    assert f["before"] == 10.0 and f["after"] == 10.0
    assert f["lowest_after_fault"] == 0
    assert f["recovered_s"] == 3  # 8 and 9 are both >= half of 10
    assert f["after_over_before"] == 1.0
    never = hf.service_figures([10] * 20 + [0] * 20, 20, 10)
    assert never["recovered_s"] is None and never["after"] == 0.0


def _layouts(zz: float, sep: float, base: float) -> dict[str, Any]:
    def lay(a: float) -> dict[str, Any]:
        return {"services": {f"web{k}": {"after": a / 4, "before": a / 2} for k in range(1, 5)}}

    return {"zz": lay(zz), "sep": lay(sep), "base": lay(base)}


def test_verdict() -> None:
    v = hf.verdict(_layouts(300, 200, 150))
    assert v["claim_holds"] is True and v["zz_over_sep"] == 1.5 and v["zz_over_base"] == 2.0
    assert v["per_service"]["web1"] == {"zz_over_sep": 1.5, "zz_over_base": 2.0}
    assert v["before_total"] == {"zz": 600.0, "sep": 400.0, "base": 300.0}
    assert v["before_zz_over_sep"] == 1.5 and v["before_zz_over_base"] == 2.0
    assert hf.verdict(_layouts(196, 200, 150))["claim_holds"] is True  # within TOLERANCE
    assert hf.verdict(_layouts(180, 200, 150))["claim_holds"] is False
    assert hf.verdict(_layouts(300, 200, 300))["claim_holds"] is False  # not better than BASE
    only = hf.verdict({"zz": _layouts(1, 1, 1)["zz"]})
    assert only["claim_holds"] is None and only["zz_over_sep"] is None
    assert only["before_zz_over_sep"] is None


def test_format_table() -> None:
    svc = {"before": 10.0, "after": 9.0, "lowest_after_fault": 2, "recovered_s": 1,
           "longest_gap_s": 0.5}  # fmt: skip
    rec = {"detection_s": 0.4, "new_view_s": None, "woken": [{"t_s": 0.25}]}
    layouts = {n: {"services": {"web1": svc}, "recovery": {"web1": rec}} for n in hf.LAYOUTS}
    text = hf.format_table({"layouts": layouts, "verdict": hf.verdict(layouts)})
    assert "web1     zz" in text and "0.2" in text and "claim holds" not in text
    assert (
        "ZZ/SEP 1.0, ZZ/BASE 1.0 (before the fault: 1.0, 1.0): the paper's claim does not"
        " hold" in text
    )


def test_rack_of_each_layout_is_table_2(tmp_path: Path) -> None:
    """ZZ: h3 (Table 2's h_4) carries the spare of web1 and active replicas of web2, web3;
    SEP: active replicas of web1..web3; BASE-like: of all four; one agreement replica of
    every service on every host."""
    want = {"zz": {"web2", "web3"}, "sep": {"web1", "web2", "web3"},
            "base": {"web1", "web2", "web3", "web4"}}  # fmt: skip
    for name, active in hf.LAYOUTS.items():
        config = load(write_rack(tmp_path / name, "hf", durability="off", kv=False,
                                 webs=hf.SERVICES, active=active))  # fmt: skip
        assert [s.name for s in config.services] == ["web1", "web2", "web3", "web4"]
        ports = [s.base_port for s in config.services]
        assert all(b - a == 70 for a, b in zip(ports, ports[1:], strict=False))
        p = plan(config)
        on_h3 = {
            s.name
            for s in config.services
            for i in range(s.active)
            if s.exec_host(config, i).name == hf.FAULTY_HOST
        }
        assert on_h3 == want[name], name
        for s in config.services:
            assert s.active == active
            assert sorted(config.replica_host(s, r).name for r in range(s.n)) == [
                f"h{h}" for h in range(4)
            ]
        assert p is not None
