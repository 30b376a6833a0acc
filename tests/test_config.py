# tests/test_config.py - rack config loading and validation (docs/config.md).
# Every rejection must name the offending field path, so operators can fix the file.
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import RACK_TOML

from zz.config import ConfigError, load
from zz.render import render_service

BASE = RACK_TOML.format(base_port=17100)


def test_valid_config_and_defaults(rack_config: Path) -> None:
    c = load(rack_config)
    assert c.rack.name == "test"
    assert c.rack.key_dir == rack_config.parent / "keys"
    assert c.rack.max_inflight is None  # not rendered: zz-agreed's default
    s = c.service("web")
    assert c.service(1) is s and c.service("1") is s
    assert (s.n, s.active, s.sleep, s.app, s.exec_replicas) == (4, 2, "paused", "echo", 3)
    # Placement: replica r on hosts[(r + service index) % hosts], port base + r.
    assert [c.replica_host(s, r).name for r in range(4)] == ["h0", "h1", "h0", "h1"]
    assert c.replica_address(s, 3) == ("127.0.0.1", 17103)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("g = 1", "g = 0", "services[0].g: must be an integer in 1..21, got 0"),
        ("g = 1", "g = true", "services[0].g: must be an integer"),
        ("g = 1", 'g = "1"', "services[0].g: must be an integer"),
        ('name = "h1"', 'name = "h0"', "hosts[1].name: duplicate 'h0'"),
        ('name = "test"', 'name = "Bad Name"', "rack.name: must match"),
        ("log_window = 8", "log_window = 6", "rack.log_window: must be a multiple"),
        ("batch_max = 16", "batch_max = 16\nbogus = 1", "rack.bogus: unknown key"),
        ("base_port = 17100", "base_port = 17100\ncolour = 'red'", "services[0].colour: unknown"),
        ("f = 1", "f = 1\nactive = 5", "services[0].active: must be an integer in 2..4, got 5"),
        ("f = 1", "f = 1\nsleep = 'frozen'", "services[0].sleep: must be 'paused'"),
        ("id = 1", "id = 0", "services[0].id: must be an integer in 1..65535"),
        ("base_port = 17100", "base_port = 65534", "services[0].base_port: must be an integer"),
        (
            'address = "127.0.0.1"\nlibvirt_uri = "test:///default"\n\n[[services]]',
            "[[services]]",
            "hosts[1].address: required",
        ),
        ("[rack]", "[extra]\nx = 1\n[rack]", "extra: unknown key"),
        # Out-of-range settings and unknown apps (zz rack up named a generated file).
        ("view_timeout_ms = 500", "view_timeout_ms = 99999999999", "rack.view_timeout_ms: must be"),
        ("batch_max = 16", "batch_max = 1000000", "rack.batch_max: must be an integer in 1..65536"),
        ("checkpoint_interval = 4", "checkpoint_interval = 4294967296", "rack.checkpoint_interval"),
        ("base_port = 17100", 'base_port = 17100\napp = "nope"', "services[0].app: unknown app"),
        ("base_port = 17100", 'base_port = 17100\napp = "wsgi:x"', "services[0].app: unknown app"),
        ("batch_max = 16", 'batch_max = 16\nclient_signatures = "never"', "rack.client_signatures"),
        ("batch_max = 16", 'batch_max = 16\ndurability = "always"', "rack.durability: must be"),
        ("batch_max = 16", 'batch_max = 16\ncontrolds = "remote"', "rack.controlds: must be one"),
        ("batch_max = 16", "batch_max = 16\ncontrolds = 1", "rack.controlds: must be a non-empty"),
        ("batch_max = 16", 'batch_max = 16\nguest_share = "nfs"', "rack.guest_share: must be"),
        # Hosts: an address that is not one, a libvirt URI that is not one (issue 17).
        ('address = "127.0.0.1"', 'address = "127.0.0.1:7000"', "hosts[0].address: must be an"),
        ('address = "127.0.0.1"', 'address = "10.0.0.256"', "hosts[0].address: must be an"),
        ('address = "127.0.0.1"', 'address = "http://h0"', "hosts[0].address: must be an"),
        ('address = "127.0.0.1"', 'address = "my host"', "hosts[0].address: must be an"),
        ('"test:///default"', '"qemu:/system"', "hosts[0].libvirt_uri: must be a libvirt URI"),
        ('"test:///default"', '"qemu+rsh:///system"', "hosts[0].libvirt_uri: must be a libvirt"),
        ('"test:///default"', '"qemu://h:70000/system"', "hosts[0].libvirt_uri: must be a"),
        ('"test:///default"', '"qemu:///sys tem"', "hosts[0].libvirt_uri: must be a libvirt URI"),
    ],
)
def test_errors_name_the_field(
    write_rack: Callable[[str], Path], old: str, new: str, message: str
) -> None:
    assert old in BASE
    with pytest.raises(ConfigError) as e:
        load(write_rack(BASE.replace(old, new, 1)))
    assert str(e.value).startswith(message), str(e.value)


def test_addresses_and_libvirt_uris_that_are_fine(write_rack: Callable[[str], Path]) -> None:
    h0 = 'address = "127.0.0.1"\nlibvirt_uri = "test:///default"'
    assert h0 in BASE
    for addr, uri in (
        ("::1", "qemu:///system"),
        ("localhost", "qemu+ssh://root@h1.example.com/system"),
        ("h0.rack.example", "qemu+tls://h0:16514/system?no_verify=1"),
        ("192.0.2.7", "xen://"),
    ):
        c = load(write_rack(BASE.replace(h0, f'address = "{addr}"\nlibvirt_uri = "{uri}"', 1)))
        assert (c.hosts[0].address, c.hosts[0].libvirt_uri) == (addr, uri)


def test_missing_sections(write_rack: Callable[[str], Path]) -> None:
    with pytest.raises(ConfigError, match="^rack: required"):
        load(write_rack("[[hosts]]\nname='h'\naddress='a'\n"))
    with pytest.raises(ConfigError, match="^hosts: at least one"):
        load(write_rack('[rack]\nname = "x"\n'))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(write_rack("[rack\n"))


def test_second_service_duplicates_and_port_clash(write_rack: Callable[[str], Path]) -> None:
    svc2 = '\n[[services]]\nname = "{n}"\nid = {i}\ng = 1\nf = 1\nbase_port = {p}\n'
    ok = load(write_rack(BASE + svc2.format(n="db", i=2, p=17200)))
    assert [s.index for s in ok.services] == [0, 1]
    # Service 1 is shifted by one host, so replica 0 lands on h1 as service 0's replica 1.
    assert ok.replica_host(ok.services[1], 0).name == "h1"
    with pytest.raises(ConfigError, match=r"^services\[1\]\.name: duplicate 'web'"):
        load(write_rack(BASE + svc2.format(n="web", i=2, p=17200)))
    with pytest.raises(ConfigError, match=r"^services\[1\]\.id: duplicate 1"):
        load(write_rack(BASE + svc2.format(n="db", i=1, p=17200)))
    with pytest.raises(ConfigError, match=r"^services\[1\]\.base_port: port 17102"):
        load(write_rack(BASE + svc2.format(n="db", i=2, p=17102)))


def test_render_with_overrides(rack_config: Path) -> None:
    c = load(rack_config)
    s = c.service("web")
    paths = render_service(c, s, {"inject_drop": 0.1, "byzantine": {0: "silent"}})
    assert [p.name for p in paths] == [f"agreed-{r}.conf" for r in range(4)]
    text0 = paths[0].read_text().splitlines()
    text1 = paths[1].read_text().splitlines()
    assert "byzantine silent" in text0 and not any(x.startswith("byzantine") for x in text1)
    assert "inject_drop 0.1" in text1
    assert "listen 127.0.0.1 17101" in text1
    assert [x for x in text1 if x.startswith("peer ")] == [
        f"peer {r} 127.0.0.1 {17100 + r}" for r in range(4)
    ]
    assert f"secret {c.rack.key_dir}/s1/p1.secret" in text1
    assert "checkpoint_interval 4" in text1 and "log_window 8" in text1
    for bad in ({"listen": "x"}, {"inject_dup": 2}, {"byzantine": "evil"}, {"g": {7: 1}}):
        with pytest.raises(ConfigError):
            render_service(c, s, bad)
    with pytest.raises(ConfigError, match="no replica 9"):
        render_service(c, s, {"byzantine": {9: "silent"}})


def test_client_signatures_always_renders_require_signed(
    write_rack: Callable[[str], Path],
) -> None:
    """docs/agreement.md "Signed requests": the default renders no require_signed line (an
    older zz-agreed would refuse the key); "always" renders require_signed 1."""
    c = load(write_rack(BASE))
    assert c.rack.client_signatures == "retransmit"
    text = render_service(c, c.service("web"))[0].read_text()
    assert "require_signed" not in text
    c = load(
        write_rack(BASE.replace("batch_max = 16", 'batch_max = 16\nclient_signatures = "always"'))
    )
    assert c.rack.client_signatures == "always"
    assert "require_signed 1" in render_service(c, c.service("web"))[0].read_text().splitlines()


def test_guest_share(write_rack: Callable[[str], Path]) -> None:
    """docs/config.md: virtiofs by default; "9p" shares every guest's state over 9p."""
    assert load(write_rack(BASE)).rack.guest_share == "virtiofs"
    rack = BASE.replace("batch_max = 16", 'batch_max = 16\nguest_share = "9p"')
    assert load(write_rack(rack)).rack.guest_share == "9p"


def test_durability_renders_data_dir_and_policy(write_rack: Callable[[str], Path]) -> None:
    """docs/agreement.md "Durable state": off by default (no data_dir line, no log); "fsync"
    and "write" give each replica its own data directory under run/ and the policy."""
    c = load(write_rack(BASE))
    assert c.rack.durability == "off"
    text = render_service(c, c.service("web"))[0].read_text()
    keys = {line.split()[0] for line in text.splitlines()}
    assert "data_dir" not in keys and "durability" not in keys
    for policy in ("fsync", "write"):
        rack = BASE.replace("batch_max = 16", f'batch_max = 16\ndurability = "{policy}"')
        c = load(write_rack(rack))
        assert c.rack.durability == policy
        paths = render_service(c, c.service("web"))
        for r, path in enumerate(paths):
            lines = path.read_text().splitlines()
            assert f"data_dir {c.rack.run_dir / 's1' / f'agreed-{r}.data'}" in lines
            assert f"durability {policy}" in lines
            # no max_inflight line: zz-agreed's default follows the policy (4, 1 with fsync)
            assert not any(x.startswith("max_inflight") for x in lines)
    rack = BASE.replace("batch_max = 16", 'batch_max = 16\nmax_inflight = 3\ndurability = "fsync"')
    c = load(write_rack(rack))
    assert c.rack.max_inflight == 3
    assert "max_inflight 3" in render_service(c, c.service("web"))[0].read_text().splitlines()


def test_execution_replica_placement(write_rack: Callable[[str], Path]) -> None:
    c = load(write_rack(BASE.replace("f = 1", 'f = 1\napp = "kv"', 1)))
    s = c.service("web")
    assert s.uses_execution_replicas and s.n_exec == 3
    # One host further than agreement replica i; ports start 64 above base_port.
    assert [s.exec_host(c, i).name for i in range(3)] == ["h1", "h0", "h1"]
    assert s.exec_addresses(c) == [("127.0.0.1", 17164 + i) for i in range(3)]
    assert s.exec_state_dir(c, 2) == c.rack.run_dir / "s1" / "exec-2"
    with pytest.raises(ValueError):
        s.exec_state_dir(c, 3)
    with pytest.raises(ValueError):
        s.exec_address(c, -1)
    echo = load(write_rack(BASE)).service("web")
    assert not echo.uses_execution_replicas


def test_execution_ports_collide_with_other_services(
    write_rack: Callable[[str], Path],
) -> None:
    kv = BASE.replace("f = 1", 'f = 1\napp = "kv"', 1)
    svc2 = '\n[[services]]\nname = "db"\nid = 2\ng = 1\nf = 1\nbase_port = {p}\n{app}'
    # 17164..17166 belong to web's execution replicas: db's agreement replicas clash.
    with pytest.raises(ConfigError, match=r"^services\[1\]\.base_port: port 17164 ") as e:
        load(write_rack(kv + svc2.format(p=17163, app="")))
    assert "services[0] execution replica 0" in str(e.value)
    # An echo service reserves no execution ports, so the same layout is fine for it.
    load(write_rack(BASE + svc2.format(p=17163, app="")))
    # Two external-execution services: db's exec ports (17264..) against web's agreement.
    with pytest.raises(ConfigError, match=r"^services\[1\]\.base_port: port 17100") as e:
        load(write_rack(BASE + svc2.format(p=17036, app='app = "kv"')))
    assert "services[0] replica 0" in str(e.value)
    with pytest.raises(ConfigError, match=r"^services\[0\]\.base_port: execution replica ports"):
        load(write_rack(kv.replace("base_port = 17100", "base_port = 65472")))
    # Without an external app the same base port is valid (agreement needs 4 ports).
    load(write_rack(BASE.replace("base_port = 17100", "base_port = 65472")))


def test_control_port(write_rack: Callable[[str], Path]) -> None:
    c = load(write_rack(BASE))
    assert [h.control_port for h in c.hosts] == [7000, 7001]
    h1 = 'name = "h1"\naddress = "127.0.0.1"\n'
    c = load(write_rack(BASE.replace(h1, h1 + "control_port = 7500\n")))
    assert [h.control_port for h in c.hosts] == [7000, 7500]
    for bad in ("0", "65536", "true", '"7000"'):
        with pytest.raises(ConfigError, match=r"^hosts\[1\]\.control_port: must be an integer"):
            load(write_rack(BASE.replace(h1, h1 + f"control_port = {bad}\n")))
    # Two controlds on one address, and a service listener on a controld's port, collide.
    with pytest.raises(ConfigError, match=r"^hosts\[1\]\.control_port: port 7000 on 127"):
        load(write_rack(BASE.replace(h1, h1 + "control_port = 7000\n")))
    with pytest.raises(ConfigError, match=r"^services\[0\]\.base_port: port 7000 .* hosts\[0\]"):
        load(write_rack(BASE.replace("base_port = 17100", "base_port = 6999")))


def test_metrics_port(write_rack: Callable[[str], Path]) -> None:
    c = load(write_rack(BASE))
    assert [h.metrics_port for h in c.hosts] == [9700, 9701]
    assert c.hosts[1].metrics_url == "http://127.0.0.1:9701/metrics"
    h1 = 'name = "h1"\naddress = "127.0.0.1"\n'
    c = load(write_rack(BASE.replace(h1, h1 + "metrics_port = 0\n")))
    assert c.hosts[1].metrics_port == 0 and c.hosts[1].metrics_url is None
    for bad in ("-1", "65536", "true", '"9700"'):
        with pytest.raises(ConfigError, match=r"^hosts\[1\]\.metrics_port: must be an integer"):
            load(write_rack(BASE.replace(h1, h1 + f"metrics_port = {bad}\n")))
    # It collides like any listener: with a controld's port, another metrics port, a service.
    with pytest.raises(ConfigError, match=r"^hosts\[1\]\.metrics_port: port 7000 on 127.* hosts"
                       r"\[0\] control_port"):  # fmt: skip
        load(write_rack(BASE.replace(h1, h1 + "metrics_port = 7000\n")))
    with pytest.raises(ConfigError, match=r"^hosts\[1\]\.metrics_port: .* hosts\[0\] metrics"):
        load(write_rack(BASE.replace(h1, h1 + "metrics_port = 9700\n")))
    with pytest.raises(
        ConfigError, match=r"^services\[0\]\.base_port: port 9700 .* hosts\[0\] metrics"
    ):
        load(write_rack(BASE.replace("base_port = 17100", "base_port = 9698")))


def test_detection_timers_per_service(write_rack: Callable[[str], Path]) -> None:
    kv = BASE.replace("f = 1", 'f = 1\napp = "kv"', 1)
    s = load(write_rack(kv)).service("web")
    assert (s.detect_k, s.detect_floor_ms, s.detect_ceiling_ms) == (4, 500, 5000)
    timers = "detect_k = 8\ndetect_floor_ms = 800\ndetect_ceiling_ms = 9000\n"
    c = load(write_rack(kv.replace("base_port", timers + "base_port", 1)))
    s = c.service("web")
    assert (s.detect_k, s.detect_floor_ms, s.detect_ceiling_ms) == (8, 800, 9000)
    # A floor above the default ceiling raises the ceiling with it unless one is given.
    big = load(write_rack(kv.replace("base_port", "detect_floor_ms = 7000\nbase_port", 1)))
    assert big.service("web").detect_ceiling_ms == 7000
    text = render_service(c, s)[1].read_text().splitlines()
    assert {"detect_k 8", "detect_floor_ms 800", "detect_ceiling_ms 9000"} <= set(text)
    assert f"exec_view {c.rack.run_dir}/s1/agreed-1.exec-view" in text
    assert f"rack_public {c.rack.key_dir}/s0/public" in text
    assert f"spare_keys {c.rack.key_dir}/s1" in text  # re-keyed slots' announcements
    # An explicit override still wins over the service's value.
    text = render_service(c, s, {"detect_floor_ms": {1: 300}})[1].read_text().splitlines()
    assert "detect_floor_ms 300" in text and "detect_floor_ms 800" not in text
    for bad, message in [
        ("detect_k = 0", "services[0].detect_k: must be an integer in 1..1000, got 0"),
        ("detect_floor_ms = true", "services[0].detect_floor_ms: must be an integer"),
        ("detect_ceiling_ms = 0", "services[0].detect_ceiling_ms: must be an integer in 1.."),
        (
            "detect_floor_ms = 900\ndetect_ceiling_ms = 800",
            "services[0].detect_floor_ms: 900 is above detect_ceiling_ms 800",
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            load(write_rack(kv.replace("base_port", bad + "\nbase_port", 1)))
        assert str(e.value).startswith(message), str(e.value)
    # Echo services have no execution replicas: nothing about detection is rendered.
    echo = load(write_rack(BASE))
    text = render_service(echo, echo.service("web"))[0].read_text()
    assert "exec_view" not in text and "detect_floor_ms" not in text
    assert "spare_keys" not in text


def test_viewed_from_a_guest(write_rack: Callable[[str], Path]) -> None:
    """Inside a QEMU user-network guest the host's loopback is 10.0.2.2; a real address is
    reached as it is; the keys are where the share puts them."""
    text = RACK_TOML.format(base_port=17100).replace(
        'name = "h1"\naddress = "127.0.0.1"', 'name = "h1"\naddress = "192.0.2.7"'
    )
    config = load(write_rack(text))
    seen = config.viewed_from("10.0.2.2", Path("/state/guest/keys"))
    assert [h.address for h in seen.hosts] == ["10.0.2.2", "192.0.2.7"]
    assert seen.rack.key_dir == Path("/state/guest/keys")
    svc = seen.services[0]
    assert seen.replica_address(svc, 0) == ("10.0.2.2", 17100)
    assert seen.replica_address(svc, 1) == ("192.0.2.7", 17101)
    # The original is untouched, and no alias means no change.
    assert config.hosts[0].address == "127.0.0.1" and config.rack.key_dir != seen.rack.key_dir
    assert config.viewed_from() == config


def test_exec_status_path_follows_a_guest(rack_config: Path) -> None:
    config = load(rack_config)
    svc = config.services[0]
    state = svc.exec_state_dir(config, 0)
    assert svc.exec_status_path(config, 0) == state.with_name("exec-0.status.json")
    state.mkdir(parents=True)
    (state / "status.json").write_text("{}")
    assert svc.exec_status_path(config, 0) == state / "status.json"
