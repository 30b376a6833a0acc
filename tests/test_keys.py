# tests/test_keys.py - `zz keys`: key directory layout, pairing, permissions, refusal/--force.
# Loads the files back with zz.keys so the format the C loader reads is checked end to end.
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from zz import cli, keys, wire
from zz.config import load
from zz.crypto import SigningKey


def test_generate_layout_and_pairs(rack_config: Path) -> None:
    c = load(rack_config)
    s = c.service("web")
    out = keys.generate(c)
    d = out / "s1"
    agree, execs, clients = keys.principals(s)
    assert execs == [256, 257, 258] and clients == [65536 + i for i in range(4)]
    pub = keys.load_public(d / "public")
    assert sorted(pub) == agree + execs + clients
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    secrets = {}
    for p in agree + execs + clients:
        path = keys.secret_path(out, 1, p)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        sec = keys.load_secret(path)
        assert sec.sign is not None and sec.sign.public == pub[p]
        secrets[p] = sec
    # Pairwise keys are symmetric and exactly the documented pairs.
    for a, b in keys.mac_pairs(s):
        assert secrets[a].macs[b] == secrets[b].macs[a]
    assert set(secrets[0].macs) == set(agree[1:] + execs + clients)
    assert set(secrets[65536].macs) == set(agree + execs)
    assert set(secrets[256].macs) == set(agree + clients)
    all_keys = [k for sec in secrets.values() for k in sec.macs.values()]
    assert len(set(all_keys)) == len(keys.mac_pairs(s))  # fresh randomness per pair
    # A client message MAC'd with its file keys verifies with the replica's file keys.
    req = wire.Request(1, 65536, 1, 0, b"x").with_macs(keys.peer_keys(secrets[65536], agree))
    assert all(req.verify_mac(r, secrets[r].macs[65536]) for r in agree)


def test_refuses_overwrite_unless_forced(
    rack_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["keys", str(rack_config)]) == 0
    pub = (rack_config.parent / "keys/s1/public").read_text()
    assert cli.main(["keys", str(rack_config)]) == 1
    assert "--force" in capsys.readouterr().err
    assert (rack_config.parent / "keys/s1/public").read_text() == pub
    assert cli.main(["keys", "--force", str(rack_config)]) == 0
    assert (rack_config.parent / "keys/s1/public").read_text() != pub
    leftovers = [p.name for p in rack_config.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_malformed_key_files(tmp_path: Path) -> None:
    p = tmp_path / "p3.secret"
    p.write_text("sign 00\n")
    with pytest.raises(keys.KeyFileError, match="p3.secret:1"):
        keys.load_secret(p)
    p.write_text(f"sign {'11' * 32}\nmac x {'22' * 32}\n")
    with pytest.raises(keys.KeyFileError, match="p3.secret:2"):
        keys.load_secret(p)
    p.write_text(f"sign {'11' * 32}\nmac 7 {'22' * 32}\n")
    sec = keys.load_secret(p)
    assert sec.principal == 3 and sec.macs == {7: bytes([0x22]) * 32}
    assert sec.sign is not None and sec.sign.public == SigningKey(bytes([0x11]) * 32).public
    with pytest.raises(keys.KeyFileError, match="no MAC key with 8"):
        keys.peer_keys(sec, [7, 8])


def test_rack_level_keys(rack_config: Path) -> None:
    c = load(rack_config)
    out = keys.generate(c)
    d = out / "s0"
    ctl, ops = keys.rack_principals(c)
    assert ctl == [16777216, 16777217] and ops == [33554432]
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    pub = keys.load_public(d / "public")
    assert sorted(pub) == ctl + ops
    secrets = {p: keys.load_secret(keys.secret_path(out, 0, p)) for p in ctl + ops}
    for p, sec in secrets.items():
        assert stat.S_IMODE(os.stat(keys.secret_path(out, 0, p)).st_mode) == 0o600
        assert sec.sign is not None and sec.sign.public == pub[p]
    # Operator <-> every controld, symmetric, distinct; controlds share nothing with each other.
    assert set(secrets[ops[0]].macs) == set(ctl)
    for h in ctl:
        assert set(secrets[h].macs) == set(ops)
        assert secrets[h].macs[ops[0]] == secrets[ops[0]].macs[h]
    assert secrets[ctl[0]].macs[ops[0]] != secrets[ctl[1]].macs[ops[0]]
    # What a controld loads: its MAC keys with operators and every service's public keys.
    ck = keys.load_controld(out, c, 1)
    assert ck.secret.principal == ctl[1] and set(ck.operators) == set(ops)
    assert ck.services[1] == keys.load_public(out / "s1" / "public")
    # A CONTROL-like MAC from the operator verifies with the controld's copy of the key.
    msg = wire.Request(0, ops[0], 1, 0, b"op").with_macs(keys.peer_keys(secrets[ops[0]], ctl))
    assert msg.verify_mac(ctl[1], ck.operators[ops[0]])
    assert not msg.verify_mac(ctl[1], secrets[ctl[0]].macs[ops[0]])


def test_several_operators(rack_config: Path) -> None:
    c = load(rack_config)
    out = keys.generate(c, operators=3)
    ck = keys.load_controld(out, c, 0)
    assert sorted(ck.operators) == [33554432, 33554433, 33554434]
    with pytest.raises(ValueError, match="operator"):
        keys.generate(c, force=True, operators=0)
