# tests/test_placement.py - `zz rack plan` and zz/placement.py (docs/placement.md):
# ZZ Table 2 on 4 hosts, the one-per-host rule on random racks, refusals with reasons.
from __future__ import annotations

import random
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

import pytest

import zz.config
from zz.config import Config, Host, Service, parse
from zz.placement import AGREEMENT, EXECUTION, PlacementError, check, hosts_needed, plan

REPO = Path(__file__).resolve().parent.parent


def rack_toml(hosts: int, services: list[dict[str, object]], placement: str = "") -> str:
    out = ['[rack]\nname = "t"\n' + (f'placement = "{placement}"\n' if placement else "")]
    for h in range(hosts):
        out.append(f'[[hosts]]\nname = "h{h}"\naddress = "127.0.0.{h + 1}"\n')
    for k, s in enumerate(services):
        fields = {"name": f"s{k}", "id": k + 1, "base_port": 10000 + 200 * k, **s}
        body = "".join(
            f"{key} = {val!r}\n" if isinstance(val, int) else f'{key} = "{val}"\n'
            for key, val in fields.items()
        )
        out.append("[[services]]\n" + body)
    return "\n".join(out)


def table2_services() -> list[dict[str, object]]:
    return [
        {"name": n, "g": 1, "f": 1, "app": "kv", "sleep": sl}
        for n, sl in [
            ("web", "paused"),
            ("db", "hibernated"),
            ("mail", "paused"),
            ("dns", "paused"),
        ]
    ]


def config_of(hosts: int, services: list[dict[str, object]], placement: str = "") -> Config:
    return parse(tomllib.loads(rack_toml(hosts, services, placement)), Path("/tmp/rack.toml"))


def test_table2_four_services_on_four_hosts() -> None:
    c = config_of(4, table2_services())
    p = plan(c)
    for load in p.loads():
        assert (load.agreement, load.active, load.sleeping) == (4, 2, 1), load
    # Every host carries one agreement replica of every service.
    for h in c.hosts:
        for svc in c.services:
            kinds = Counter(s.kind for s in p.on(h, svc))
            assert kinds[AGREEMENT] == 1 and kinds[EXECUTION] <= 1
    # Service index 1 (db): A<r> on h(r+1), E<i> on h(i+2); E2 sleeps hibernated.
    db = c.service("db")
    got = {h.name: " ".join(s.label for s in p.on(h, db)) for h in c.hosts}
    assert got == {
        "h0": "A3 E2(hibernated)",
        "h1": "A0",
        "h2": "A1 E0(active)",
        "h3": "A2 E1(active)",
    }


def test_plan_agrees_with_config_addresses() -> None:
    c = config_of(5, table2_services())
    p = plan(c)
    for s in p.slots:
        if s.kind == AGREEMENT:
            assert s.host.address == c.replica_address(s.service, s.replica)[0]
        else:
            assert s.host.address == s.service.exec_address(c, s.replica)[0]


def random_config(seed: int) -> Config:
    rnd = random.Random(seed)
    hosts = rnd.randint(1, 12)
    services = []
    for _ in range(rnd.randint(1, 6)):
        f = rnd.choice([0, 1, 1, 2, 3])
        services.append(
            {
                "g": rnd.choice([1, 1, 2, 3]),
                "f": f,
                "active": rnd.randint(f + 1, 3 * f + 1),
                "sleep": rnd.choice(["paused", "hibernated"]),
                "app": rnd.choice(["kv", "kv", "echo"]),
            }
        )
    return config_of(hosts, services, rnd.choice(["", "spread", "rotate"]))


@pytest.mark.parametrize("seed", range(40))
def test_one_per_host_on_random_racks(seed: int) -> None:
    c = random_config(seed)
    hosts = len(c.hosts)
    fits = all(hosts_needed(s) <= hosts for s in c.services)
    if not fits:
        with pytest.raises(PlacementError) as e:
            plan(c)
        short = [s for s in c.services if hosts_needed(s) > hosts]
        assert len(e.value.reasons) >= len(short)
        for s in short:
            assert any(f"service {s.name!r}" in r and f"has {hosts}" in r for r in e.value.reasons)
        return
    p = plan(c)
    per = Counter((s.service.index, s.host.index, s.kind) for s in p.slots)
    assert max(per.values()) == 1
    for svc in c.services:
        mine = [s for s in p.slots if s.service.index == svc.index]
        assert sorted(s.replica for s in mine if s.kind == AGREEMENT) == list(range(svc.n))
        ex = [s for s in mine if s.kind == EXECUTION]
        if not svc.uses_execution_replicas:
            assert ex == []
            continue
        assert sorted(s.replica for s in ex) == list(range(svc.n_exec))
        assert sum(s.state == "active" for s in ex) == svc.active
        assert {s.state for s in ex if s.state != "active"} <= {svc.sleep}
    loads = p.loads()
    assert sum(x.agreement for x in loads) == sum(s.n for s in c.services)
    assert sum(x.active + x.sleeping for x in loads) == sum(
        s.n_exec for s in c.services if s.uses_execution_replicas
    )


def test_random_racks_cover_both_outcomes() -> None:
    # The property test above must see both placeable and refused racks to mean anything.
    outcomes = Counter(not check(random_config(seed)) for seed in range(40))
    assert outcomes[True] >= 5 and outcomes[False] >= 5, outcomes


@pytest.mark.parametrize(
    ("hosts", "service", "reason"),
    [
        (
            4,
            {"name": "web", "g": 2, "f": 1, "app": "kv"},
            "service 'web': g=2 needs 7 hosts for its agreement replicas, the rack has 4",
        ),
        (
            4,
            {"name": "web", "g": 1, "f": 2, "app": "kv"},
            "service 'web': f=2, active=3 needs 5 hosts for its execution replicas, the rack has 4",
        ),
        (
            2,
            {"name": "web", "g": 1, "f": 1, "app": "echo"},
            "service 'web': g=1 needs 4 hosts for its agreement replicas, the rack has 2",
        ),
    ],
)
def test_impossible_racks_refused_with_reason(
    hosts: int, service: dict[str, object], reason: str
) -> None:
    with pytest.raises(PlacementError) as e:
        plan(config_of(hosts, [service]))
    assert e.value.reasons == [reason]


def test_echo_service_needs_no_execution_hosts() -> None:
    # f=2 means 5 execution replicas, but echo runs none: 4 hosts are enough.
    assert check(config_of(4, [{"g": 1, "f": 2, "app": "echo"}])) == []


def test_a_rule_that_breaks_the_constraint_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    def stacked(hosts: list[Host], service: Service, i: int) -> Host:
        return hosts[0]

    monkeypatch.setattr(zz.config, "_exec_host", stacked)
    with pytest.raises(PlacementError) as e:
        plan(config_of(4, table2_services()[:1]))
    assert e.value.reasons == [
        "service 'web': host 'h0' would carry 3 execution replicas (at most 1 per host)"
    ]


def run_zz(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zz", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_cli_prints_table(tmp_path: Path) -> None:
    cfg = tmp_path / "rack.toml"
    cfg.write_text(rack_toml(4, table2_services()))
    r = run_zz("rack", "plan", str(cfg))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("host "))
    assert header.split() == ["host", "web", "db", "mail", "dns", "agreement", "active", "sleeping"]
    h0 = next(ln for ln in lines if ln.startswith("h0 "))
    assert h0.split() == [
        "h0", "A0", "A3", "E2(hibernated)", "A2", "E1(active)", "A1", "E0(active)", "4", "2", "1"
    ]  # fmt: skip
    for h in ("h0", "h1", "h2", "h3"):
        row = next(ln for ln in lines if ln.startswith(h + " "))
        assert row.split()[-3:] == ["4", "2", "1"], row
    assert "active execution replicas: 8 over 4 hosts, 2..2 per host (even)" in r.stdout


def test_cli_refuses_impossible_rack_with_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "rack.toml"
    cfg.write_text(rack_toml(3, table2_services()[:2]))
    r = run_zz("rack", "plan", str(cfg))
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.splitlines() == [
        "zz rack plan: service 'web': g=1 needs 4 hosts for its agreement replicas, the rack has 3",
        "zz rack plan: service 'db': g=1 needs 4 hosts for its agreement replicas, the rack has 3",
    ]


def test_rotate_crowds_the_first_hosts_and_says_so() -> None:
    # "rotate" shifts each service by one host, so 4 services on 8 hosts crowd h1..h6:
    # still one replica of each kind per service per host, but not balanced.
    from zz.placement import format_plan

    p = plan(config_of(8, table2_services(), "rotate"))
    assert [x.agreement for x in p.loads()] == [1, 2, 3, 4, 3, 2, 1, 0]
    out = format_plan(p)
    assert "agreement replicas: 16 over 8 hosts, 0..4 per host (uneven, best 2..2)" in out
    assert "sleeping execution replicas: 4 over 8 hosts, 0..1 per host (even)" in out


def test_spread_is_even_for_fewer_services_than_hosts() -> None:
    # The default spreads S < H services of one shape over the ring: every host within one
    # replica of the mean for each kind, on every rack of 4..12 hosts.
    from zz.placement import format_plan

    for hosts in range(4, 13):
        for n in range(1, hosts + 1):
            for f in (1, 2) if hosts >= 5 else (1,):
                p = plan(config_of(hosts, [{"g": 1, "f": f, "app": "kv"}] * n))
                out = format_plan(p)
                assert "uneven" not in out, (hosts, n, f, out)
    p = plan(config_of(8, table2_services()))
    assert [x.agreement for x in p.loads()] == [2] * 8
    assert [x.active for x in p.loads()] == [1] * 8
    assert "agreement replicas: 16 over 8 hosts, 2..2 per host (even)" in format_plan(p)


def test_spread_keeps_table2_when_services_fill_the_hosts() -> None:
    # With as many services as hosts (or more) "spread" is the rotation of ZZ Table 2.
    for hosts, n in ((4, 4), (4, 6), (5, 5), (4, 9)):
        services = [{"g": 1, "f": 1, "app": "kv"}] * n
        spread, rotate = config_of(hosts, services), config_of(hosts, services, "rotate")
        assert [s.host.name for s in plan(spread).slots] == [
            s.host.name for s in plan(rotate).slots
        ]


def test_unknown_placement_is_refused_naming_the_field() -> None:
    with pytest.raises(zz.config.ConfigError, match=r"^rack\.placement: must be one of"):
        config_of(4, table2_services(), "random")
