# tests/test_hostkeys.py - keys per host (zz/hostkeys.py): each machine makes its own secrets,
# the operator's bundle holds public keys only, derived MAC keys agree pairwise; rotation.
"""Five hosts and an operator, each with its own copy of the rack config and so its own
key_dir (as on separate machines). Two services, placed so that host h1 carries only the
first one. Everything goes through `zz host init` / `zz host rotate-keys` / `zz keys`."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zz import cli, hostkeys, keys, kvop, wire
from zz.client import Client
from zz.config import EXEC_PORT_OFFSET, Config, load
from zz.controld.rpc import RpcError, call
from zz.ports import free_base
from zz.procrack import ProcRack, repo_env

RACK = """\
[rack]
name = "perhost"
key_dir = "keys"
run_dir = "run"

{hosts}
[[services]]
name = "web"
id = 1
g = 1
f = 1
clients = 2
base_port = 17300
app = "kv"

[[services]]
name = "mail"
id = 2
g = 1
f = 1
clients = 2
base_port = 17400
app = "kv"
"""
HOSTS = [f"h{i}" for i in range(5)]
OWNERS = [*HOSTS, hostkeys.OPERATOR]


def _write(root: Path) -> dict[str, Path]:
    """One directory per machine, each with the same rack.toml."""
    hosts = "".join(
        f'[[hosts]]\nname = "{h}"\naddress = "127.0.0.1"\nlibvirt_uri = "test:///default"\n\n'
        for h in HOSTS
    )
    out = {}
    for owner in OWNERS:
        d = root / owner
        d.mkdir()
        (d / "rack.toml").write_text(RACK.format(hosts=hosts))
        out[owner] = d / "rack.toml"
    return out


def _host_init(cfg: Path, host: str, *extra: str) -> int:
    etc = cfg.parent / "etc"
    return cli.main(
        ["host", "init", str(cfg), "--host", host, "--backend", "process", "--packages", "skip",
         "--no-pool", "--etc", str(etc), "--prefix", str(cfg.parent / "opt"), *extra]
    )  # fmt: skip


def _bundle(machines: dict[str, Path], out: Path) -> None:
    op = load(machines[hostkeys.OPERATOR])
    exports = [str(hostkeys.export_path(load(machines[h]).rack.key_dir, h)) for h in HOSTS]
    assert cli.main(["keys", str(machines[hostkeys.OPERATOR]), "--bundle", str(out), *exports]) == 0
    assert out.exists() and op.rack.key_dir.exists()


def _everyone(machines: dict[str, Path], bundle: Path) -> None:
    for h in HOSTS:
        assert _host_init(machines[h], h, "--bundle", str(bundle)) == 0
    assert cli.main(["keys", str(machines[hostkeys.OPERATOR]), "--install", str(bundle)]) == 0


def _secrets(machines: dict[str, Path]) -> dict[hostkeys.Principal, tuple[str, keys.Secret]]:
    """Every secret file on every machine, by (service, principal): (owner, secret)."""
    out: dict[hostkeys.Principal, tuple[str, keys.Secret]] = {}
    for owner, cfg in machines.items():
        key_dir = load(cfg).rack.key_dir
        for path in sorted(key_dir.glob("s*/p*.secret")):
            sid = int(path.parent.name[1:])
            sec = keys.load_secret(path)
            assert (sid, sec.principal) not in out, f"{path}: also on another machine"
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            out[(sid, sec.principal)] = (owner, sec)
    return out


def _check_pairs(config: Config, secrets: dict[hostkeys.Principal, tuple[str, keys.Secret]]) -> int:
    """Both ends of every MAC pair hold the same key; returns the number of pairs."""
    pairs: list[tuple[int, int, int]] = []
    for s in config.services:
        pairs += [(s.id, a, b) for a, b in keys.mac_pairs(s)]
    ctl, ops = keys.rack_principals(config)
    pairs += [(0, o, c) for o in ops for c in ctl]
    seen = set()
    for sid, a, b in pairs:
        ka, kb = secrets[(sid, a)][1].macs[b], secrets[(sid, b)][1].macs[a]
        assert ka == kb, f"s{sid}: {a} and {b} disagree"
        seen.add(ka)
    assert len(seen) == len(pairs)  # a key per pair
    return len(pairs)


@pytest.fixture
def machines(tmp_path: Path) -> dict[str, Path]:
    return _write(tmp_path)


def test_each_machine_makes_its_own_keys_and_the_bundle_joins_them(
    machines: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = load(machines["h0"])
    for h in HOSTS:
        assert _host_init(machines[h], h) == 0
    assert cli.main(["keys", str(machines[hostkeys.OPERATOR]), "--operator"]) == 0
    bundle = tmp_path / "bundle"
    _bundle(machines, bundle)
    fp = hostkeys.fingerprint(bundle.read_text())
    assert fp in capsys.readouterr().out  # the operator is told what to compare
    assert "mac " not in bundle.read_text() and "sign " not in bundle.read_text()
    _everyone(machines, bundle)
    assert fp in capsys.readouterr().out  # and each host prints it

    # Every secret exists once, on the machine the placement gives it; the operator's key
    # is on the operator's machine only.
    secrets = _secrets(machines)
    assert sorted(secrets) == sorted(hostkeys.all_principals(config))
    for (sid, p), (owner, _) in secrets.items():
        assert owner == hostkeys.owner_of(config, sid, p)
    assert secrets[(0, wire.PRINCIPAL_OPERATOR)][0] == hostkeys.OPERATOR
    assert secrets[(0, wire.PRINCIPAL_HOST + 3)][0] == "h3"
    pairs = sum(len(keys.mac_pairs(s)) for s in config.services) + len(HOSTS)
    assert _check_pairs(config, secrets) == pairs == 69

    # Public files: a host gets s0 and the services it carries, the operator all.
    web, mail = config.service("web"), config.service("mail")
    carried = {
        h.name: sorted(
            {s.id for s in (web, mail) for r in range(s.n) if config.replica_host(s, r) == h}
            | {s.id for s in (web, mail) for i in range(s.n_exec) if s.exec_host(config, i) == h}
        )
        for h in config.hosts
    }
    assert carried["h1"] == [1]  # the placement this test is built on
    for owner, cfg in machines.items():
        key_dir = load(cfg).rack.key_dir
        have = sorted(int(p.parent.name[1:]) for p in key_dir.glob("s*/public"))
        assert have == ([0, 1, 2] if owner == hostkeys.OPERATOR else [0, *carried[owner]])

    # What the daemons load: controld on h1 (mail's certificates verify under no key), a
    # client's request MAC'd on the operator's machine verifies at each agreement replica.
    h1 = load(machines["h1"])
    ck = keys.load_controld(h1.rack.key_dir, h1, 1)
    assert dict(ck.services[2]) == {} and len(ck.services[1]) == len(
        keys.load_public(keys.public_path(h1.rack.key_dir, 1))
    )
    assert set(ck.operators) == {wire.PRINCIPAL_OPERATOR}
    client = secrets[(1, wire.client_principal(0))][1]
    agree = [wire.agreement_principal(r) for r in range(web.n)]
    req = wire.Request(1, client.principal, 1, 0, b"x").with_macs(keys.peer_keys(client, agree))
    assert all(req.verify_mac(r, secrets[(1, r)][1].macs[client.principal]) for r in agree)

    # Idempotent: a second run of everything changes nothing and says so.
    def snapshot(got: dict[hostkeys.Principal, tuple[str, keys.Secret]]) -> dict[object, object]:
        return {p: (o, s.macs, s.sign.seed if s.sign else b"") for p, (o, s) in got.items()}

    before = snapshot(secrets)
    capsys.readouterr()
    assert _host_init(machines["h2"], "h2", "--bundle", str(bundle)) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert cli.main(["keys", str(machines[hostkeys.OPERATOR]), "--install", str(bundle)]) == 0
    assert "already installed" in capsys.readouterr().out
    assert snapshot(_secrets(machines)) == before


def test_the_bundle_refuses_what_does_not_fit_the_rack(
    machines: dict[str, Path], tmp_path: Path
) -> None:
    config = load(machines[hostkeys.OPERATOR])
    for h in HOSTS:
        assert _host_init(machines[h], h) == 0
    assert cli.main(["keys", str(machines[hostkeys.OPERATOR]), "--operator"]) == 0
    exports = {h: hostkeys.export_path(load(machines[h]).rack.key_dir, h) for h in HOSTS}
    own = hostkeys.export_path(config.rack.key_dir, hostkeys.OPERATOR)

    with pytest.raises(hostkeys.HostKeyError, match="missing .*no export from h3"):
        hostkeys.make_bundle(config, [own, *(exports[h] for h in HOSTS if h != "h3")])
    # h4's export claiming to be h3's: its keys are not placed on h3.
    forged = tmp_path / "forged.pub"
    forged.write_text(exports["h4"].read_text().replace("owner h4", "owner h3"))
    with pytest.raises(hostkeys.HostKeyError, match="from h3, but the placement puts it on h4"):
        hostkeys.make_bundle(config, [own, forged, *(exports[h] for h in HOSTS[:3])])
    with pytest.raises(hostkeys.HostKeyError, match="forged.pub: s0 p16777220 .* also in .* h4"):
        hostkeys.make_bundle(config, [own, exports["h4"], forged])
    with pytest.raises(hostkeys.HostKeyError, match="a second export of h2"):
        hostkeys.make_bundle(config, [own, exports["h2"], *exports.values()])
    other = tmp_path / "other.pub"
    other.write_text(exports["h0"].read_text().replace("rack perhost", "rack other"))
    with pytest.raises(hostkeys.HostKeyError, match="keys of rack 'other'"):
        hostkeys.make_bundle(config, [own, other])
    bad = tmp_path / "bad.pub"
    bad.write_text(exports["h0"].read_text() + "1 0 zz\n")
    with pytest.raises(hostkeys.HostKeyError, match=r"bad.pub:\d+: expected"):
        hostkeys.make_bundle(config, [bad])

    # A bundle carrying another key for one of h2's principals: h2 refuses it, naming it,
    # and changes nothing.
    bundle = hostkeys.make_bundle(config, [own, *exports.values()])
    h2 = load(machines["h2"])
    sid, p = hostkeys.owned(h2, "h2")[1]
    key = bundle.keys[(sid, p)][0].hex()
    swapped = tmp_path / "swapped"
    swapped.write_text(bundle.text.replace(key, keys.SigningKey(b"\1" * 32).public.hex()))
    with pytest.raises(hostkeys.HostKeyError, match=f"key for s{sid} p{p} .* is not the one in"):
        hostkeys.install_bundle(h2, h2.rack.key_dir, "h2", hostkeys.load_bundle(h2, swapped))
    assert not keys.public_path(h2.rack.key_dir, 0).exists()
    # Through the CLI: a key error exits 1 with the message; a bad option names it (exit 2).
    assert _host_init(machines["h2"], "h2", "--bundle", str(swapped)) == 1
    assert cli.main(["keys", str(machines["h0"]), "--rotate"]) == 2
    assert cli.main(["host", "rotate-keys", str(machines["h0"]), "--host", "h9"]) == 2
    named = tmp_path / "named.toml"
    named.write_text(machines["h0"].read_text().replace('name = "h4"', 'name = "operator"'))
    assert _host_init(named, "operator") == 2  # the operator's machine's name in keys per host


def test_host_and_operator_key_rotation(
    machines: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = load(machines[hostkeys.OPERATOR])
    for h in HOSTS:
        assert _host_init(machines[h], h) == 0
    op_cfg = str(machines[hostkeys.OPERATOR])
    assert cli.main(["keys", op_cfg, "--operator"]) == 0
    first = tmp_path / "bundle-1"
    _bundle(machines, first)
    _everyone(machines, first)
    before = _secrets(machines)

    # Host h2: fresh secrets; the old bundle no longer fits it, a new one does.
    assert cli.main(["host", "rotate-keys", str(machines["h2"]), "--host", "h2"]) == 0
    h2 = load(machines["h2"])
    assert _host_init(machines["h2"], "h2", "--bundle", str(first)) == 1
    assert "is not the one in" in capsys.readouterr().out
    second = tmp_path / "bundle-2"
    _bundle(machines, second)
    _everyone(machines, second)
    after = _secrets(machines)
    _check_pairs(config, after)
    mine = set(hostkeys.owned(h2, "h2"))
    for sp, (_, sec) in after.items():
        old = before[sp][1]
        assert sec.sign is not None and old.sign is not None
        assert (sec.sign.seed != old.sign.seed) == (sp in mine), sp
        # MAC keys change exactly where one end was rotated.
        for peer, k in sec.macs.items():
            assert (k != old.macs[peer]) == (sp in mine or (sp[0], peer) in mine), (sp, peer)

    # The operator: a new key; every controld's MAC key with it changes, nothing else.
    assert cli.main(["keys", op_cfg, "--operator", "--rotate"]) == 0
    third = tmp_path / "bundle-3"
    _bundle(machines, third)
    _everyone(machines, third)
    rotated = _secrets(machines)
    _check_pairs(config, rotated)
    op = (0, wire.PRINCIPAL_OPERATOR)
    changed = {sp for sp in rotated if rotated[sp][1].macs != after[sp][1].macs}
    ctl = {(0, wire.PRINCIPAL_HOST + i) for i in range(len(HOSTS))}
    assert changed == {op} | ctl  # the clients' keys stay
    assert rotated[op][1].sign != after[op][1].sign
    for c in ctl:
        assert rotated[c][1].macs[op[1]] != after[c][1].macs[op[1]]


async def test_a_running_controld_takes_the_rotated_operator_key_on_sighup(
    machines: dict[str, Path], tmp_path: Path
) -> None:
    """controld of h0, keyed per host, answers the operator; after `zz keys --operator
    --rotate`, a new bundle installed on h0 and SIGHUP (the unit's ExecReload) it answers
    the new key and no longer the old one, without a restart."""
    for h in HOSTS:
        assert _host_init(machines[h], h) == 0
    op_cfg = machines[hostkeys.OPERATOR]
    assert cli.main(["keys", str(op_cfg), "--operator"]) == 0
    _bundle(machines, tmp_path / "bundle-1")
    _everyone(machines, tmp_path / "bundle-1")
    op_keys = load(op_cfg).rack.key_dir
    me, ctl = wire.PRINCIPAL_OPERATOR, wire.PRINCIPAL_HOST

    def operator_key() -> bytes:
        return keys.load_secret(keys.secret_path(op_keys, 0, me)).macs[ctl]

    cmd = [sys.executable, "-m", "zz.controld", "--config", str(machines["h0"]), "--host", "h0",
           "--backend", "process", "--port", "0", "--metrics-port", "0"]  # fmt: skip
    p = subprocess.Popen(
        cmd, env=repo_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert p.stdout is not None
        line = p.stdout.readline().decode()
        assert "listening on 127.0.0.1:" in line, line
        port = int(line.rsplit(":", 1)[1])

        async def status(key: bytes, timeout: float) -> dict[str, object]:
            return await call("127.0.0.1", port, operator=me, controld=ctl, key=key,
                              op={"op": "status"}, timeout=timeout)  # fmt: skip

        old = operator_key()
        assert (await status(old, 30))["ok"]
        assert cli.main(["keys", str(op_cfg), "--operator", "--rotate"]) == 0
        _bundle(machines, tmp_path / "bundle-2")
        _everyone(machines, tmp_path / "bundle-2")
        new = operator_key()
        assert new != old
        with pytest.raises(RpcError):  # not yet: the running daemon has the old key
            await status(new, 2)
        p.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while True:
            try:
                assert (await status(new, 2))["ok"]
                break
            except RpcError:
                assert time.monotonic() < deadline, "the new operator key was not taken"
        with pytest.raises(RpcError):
            await status(old, 2)
        assert p.poll() is None
    finally:
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    assert p.stderr is not None
    assert b"SIGHUP: operator keys reloaded" in p.stderr.read()


async def test_a_kv_service_runs_on_keys_made_per_host(tmp_path: Path) -> None:
    """The key files keys per host writes are what zz-agreed and the execution runtime
    read: four hosts and the operator each make their keys in a directory of their own;
    run on one machine, the union of those directories (disjoint secrets, the same public
    files) keys a kv service whose agreement replicas, execution replicas and client
    (zz/procrack.py) talk over MAC keys that were derived, never sent."""
    base = free_base(range(EXEC_PORT_OFFSET + 4))
    text = (
        '[rack]\nname = "kvhosts"\nkey_dir = "keys"\nrun_dir = "run"\n'
        "checkpoint_interval = 8\nlog_window = 16\n\n"
        + "".join(f'[[hosts]]\nname = "h{i}"\naddress = "127.0.0.1"\n\n' for i in range(4))
        + f'[[services]]\nname = "kv"\nid = 1\ng = 1\nf = 1\napp = "kv"\nclients = 2\n'
        f"base_port = {base}\n"
    )
    owners = ["h0", "h1", "h2", "h3", hostkeys.OPERATOR]
    configs = {}
    for owner in [*owners, "rack"]:
        (tmp_path / owner).mkdir()
        (tmp_path / owner / "rack.toml").write_text(text)
        configs[owner] = load(tmp_path / owner / "rack.toml")
    for owner in owners:
        hostkeys.create_secrets(configs[owner], configs[owner].rack.key_dir, owner)
        hostkeys.export_public(configs[owner], configs[owner].rack.key_dir, owner)
    exports = [hostkeys.export_path(configs[o].rack.key_dir, o) for o in owners]
    bundle = hostkeys.make_bundle(configs["rack"], exports)
    union = configs["rack"].rack.key_dir
    for owner in owners:
        hostkeys.install_bundle(configs[owner], configs[owner].rack.key_dir, owner, bundle)
        shutil.copytree(configs[owner].rack.key_dir, union, dirs_exist_ok=True)
    assert len(list(union.glob("s*/p*.secret"))) == len(hostkeys.all_principals(configs["rack"]))

    with ProcRack(configs["rack"]) as rack:
        rack.start(timeout=60)
        client = Client(configs["rack"], 0, service="kv")
        try:
            for i in range(4):
                put = await client.invoke(kvop.encode_put(b"k", b"v%d" % i), timeout=30)
                assert kvop.decode_reply(put).ok
            got = kvop.decode_reply(await client.invoke(kvop.encode_get(b"k"), timeout=30))
            assert got.ok and got.value == b"v3"
        finally:
            await client.close()
        assert not rack.dead()
    assert rack.last_stop is not None and rack.last_stop.clean, rack.last_stop


def test_a_slot_re_keyed_at_a_conviction_keeps_its_key_through_a_peers_rotation(
    machines: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Execution slot 0 of web re-keyed by its controld (keys.rotate_exec, epoch 1), its
    SPARE-READY copied to agreement replica 0's host; that host rotates its keys: the
    slot keeps its epoch key, and after the new bundle both ends derive the same epoch MAC
    key again from the new agreement key."""
    for h in HOSTS:
        assert _host_init(machines[h], h) == 0
    assert cli.main(["keys", str(machines[hostkeys.OPERATOR]), "--operator"]) == 0
    _bundle(machines, tmp_path / "bundle-1")
    _everyone(machines, tmp_path / "bundle-1")
    config = load(machines["h0"])
    web = config.service("web")
    slot_host, agree_host = web.exec_host(config, 0), config.replica_host(web, 0)
    assert slot_host != agree_host
    slot_keys = load(machines[slot_host.name]).rack.key_dir
    agree_keys = load(machines[agree_host.name]).rack.key_dir
    ctl = keys.load_secret(keys.secret_path(slot_keys, 0, keys.controld_principal(slot_host.index)))
    assert ctl.sign is not None
    keys.rotate_exec(slot_keys, config, web, 0, 7, ctl.sign, slot_host.index)
    cert = keys.spare_cert_path(slot_keys, 1, 256)
    shutil.copy(cert, keys.spare_cert_path(agree_keys, 1, 256))  # as SPARE-READY spreads

    def both_ends() -> tuple[bytes, bytes]:
        slot = keys.load_secret(keys.secret_path(slot_keys, 1, 256))
        assert slot.epoch == 1
        a0 = keys.load_secret(keys.secret_path(agree_keys, 1, 0))
        return slot.macs[0], keys.with_epoch_macs(a0, agree_keys, config, web).macs[256]

    before = both_ends()
    assert before[0] == before[1]
    assert cli.main(["host", "rotate-keys", str(machines[agree_host.name]),
                     "--host", agree_host.name]) == 0  # fmt: skip
    _bundle(machines, tmp_path / "bundle-2")
    _everyone(machines, tmp_path / "bundle-2")
    after = both_ends()
    assert after[0] == after[1] and after[0] != before[0]
    # The slot's own host rotates: the slot keeps its key, its SPARE-READY is signed again
    # with the new controld key, and with the new bundle everything verifies as before.
    capsys.readouterr()
    assert cli.main(["host", "rotate-keys", str(machines[slot_host.name]),
                     "--host", slot_host.name]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "kept s1 p256 (execution replica 0 of web): re-keyed at a conviction" in out
    assert f"signed {cert} again with the new controld key" in out
    _bundle(machines, tmp_path / "bundle-3")
    _everyone(machines, tmp_path / "bundle-3")
    with pytest.raises(keys.KeyFileError, match="signature"):  # the copy signed by the old key
        both_ends()
    shutil.copy(cert, keys.spare_cert_path(agree_keys, 1, 256))
    assert both_ends() == after
    slot = keys.load_secret(keys.secret_path(slot_keys, 1, 256))
    assert keys.service_publics(slot_keys, config, web)[256] == slot.sign.public  # type: ignore[union-attr]
