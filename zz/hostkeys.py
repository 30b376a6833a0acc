# zz/hostkeys.py - keys per host (docs/security.md "Keys per host"): every machine makes the
# secrets of its own principals, and the pairwise MAC keys come from X25519, so no secret travels.
"""Keys made where they are used.

`zz keys CONFIG` writes every principal's secrets on one machine (the one-machine rack).
For a rack of real hosts each machine is an *owner*: a host (`hosts[].name`) owns its
controld and the agreement and execution replicas the placement puts on it; the operator
(OPERATOR) owns the operator principal and every service's clients. The flow:

1. each owner makes its secrets (create_secrets: an Ed25519 seed per principal, from
   os.urandom, in its own key_dir) and exports their public keys (export_public, a
   `<owner>.pub` text file: public keys only);
2. the operator checks the exports against the placement and joins them into one bundle
   (make_bundle), whose SHA-256 (fingerprint) it gives every host out of band;
3. each owner installs the bundle (install_bundle): the `s<id>/public` files it needs (s0
   and the services it carries; the operator all) and the MAC lines of its secrets,
   K(a, b) = keys.epoch_mac_key(a's seed, b's public key as X25519, service, a, b, epoch):
   both ends compute the same key from their own seed and the other's public key, as the
   key epochs of re-keyed slots already do (docs/wire.md "Key epochs").

The files are the ones `zz keys` writes (docs/config.md "Key directory"), so zz-agreed,
the runtimes, controld and the CLI read them unchanged."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from zz import keys, wire
from zz.atomicfile import write_atomic
from zz.config import Config, ConfigError, Host
from zz.crypto import KEY_LEN, SigningKey

OPERATOR = "operator"  # the owner name of the operator's machine
EXPORT_MAGIC = "zz-public-keys 1"
BUNDLE_MAGIC = "zz-key-bundle 1"

Principal = tuple[int, int]  # (service id, principal id); service 0 is the rack


class HostKeyError(keys.KeyFileError):
    """An export or bundle that does not fit the rack, or local keys that do not fit it."""


# ---- who owns what -------------------------------------------------------------------------
def _host(config: Config, name: str) -> Host:
    for h in config.hosts:
        if h.name == name:
            return h
    names = ", ".join(h.name for h in config.hosts)
    raise ConfigError(f"--host {name!r}: not in hosts ({names})")


def owner_of(config: Config, service_id: int, principal: int) -> str:
    """The machine that holds `principal`'s secret: a host name or OPERATOR."""
    if service_id == keys.RACK_SERVICE:
        if principal >= wire.PRINCIPAL_OPERATOR:
            return OPERATOR
        return config.hosts[principal - wire.PRINCIPAL_HOST].name
    s = config.service(service_id)
    if principal >= wire.PRINCIPAL_CLIENT:
        return OPERATOR
    if principal >= wire.PRINCIPAL_EXEC:
        return s.exec_host(config, principal - wire.PRINCIPAL_EXEC).name
    return config.replica_host(s, principal).name


def all_principals(config: Config) -> list[Principal]:
    """Every principal of the rack: s0 (each controld and operator 0), then each service's."""
    ctl, ops = keys.rack_principals(config)
    out = [(keys.RACK_SERVICE, p) for p in ctl + ops]
    for s in config.services:
        agree, execs, clients = keys.principals(s)
        out += [(s.id, p) for p in agree + execs + clients]
    return out


def check_names(config: Config) -> None:
    for h in config.hosts:
        if h.name == OPERATOR:
            raise ConfigError(
                f"hosts[{h.index}].name: {OPERATOR!r} names the operator's machine in keys"
                " per host: give the host another name"
            )


def owned(config: Config, owner: str) -> list[Principal]:
    """The principals whose secrets `owner` holds."""
    check_names(config)
    if owner != OPERATOR:
        _host(config, owner)  # a ConfigError naming the hosts
    return [sp for sp in all_principals(config) if owner_of(config, *sp) == owner]


def services_needed(config: Config, owner: str) -> list[int]:
    """The service ids whose public files `owner` needs: s0 (controlds verify the operator's
    CONTROL, every replica verifies SPARE-READY with the controlds' keys) and the services
    it has principals of. The operator's clients are in every service."""
    ids = {sid for sid, _ in owned(config, owner)} | {keys.RACK_SERVICE}
    return sorted(ids)


def describe(config: Config, service_id: int, principal: int) -> str:
    """`s1 p257 (execution replica 1 of web)` - for messages."""
    if service_id == keys.RACK_SERVICE:
        h = principal - wire.PRINCIPAL_HOST
        if principal >= wire.PRINCIPAL_OPERATOR:
            what = f"operator {principal - wire.PRINCIPAL_OPERATOR}"
        elif 0 <= h < len(config.hosts):
            what = f"controld of {config.hosts[h].name}"
        else:
            what = "no principal of this rack"
    elif service_id not in {s.id for s in config.services}:
        what = "no service of this rack"
    else:
        s = config.service(service_id)
        if principal >= wire.PRINCIPAL_CLIENT:
            what = f"client {principal - wire.PRINCIPAL_CLIENT} of {s.name}"
        elif principal >= wire.PRINCIPAL_EXEC:
            what = f"execution replica {principal - wire.PRINCIPAL_EXEC} of {s.name}"
        else:
            what = f"agreement replica {principal} of {s.name}"
    return f"s{service_id} p{principal} ({what})"


# ---- 1. secrets made here ------------------------------------------------------------------
@dataclass
class SecretsReport:
    created: list[Principal] = field(default_factory=list)
    kept: list[Principal] = field(default_factory=list)
    # Rotation leaves slots a conviction re-keyed alone: their key was made on this host by
    # controld at the conviction (keys.rotate_exec) and peers know it by its SPARE-READY,
    # which is signed again with the host's new controld key (`resigned`, the files).
    rekeyed: list[Principal] = field(default_factory=list)
    resigned: list[Path] = field(default_factory=list)


def _secret_dir(key_dir: Path, service_id: int) -> Path:
    d = keys.service_dir(key_dir, service_id)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def _write_secret(path: Path, secret: keys.Secret) -> None:
    assert secret.sign is not None
    lines = [f"epoch {secret.epoch}"] if secret.epoch else []
    lines.append(f"sign {secret.sign.seed.hex()}")
    lines += [f"mac {peer} {key.hex()}" for peer, key in sorted(secret.macs.items())]
    write_atomic(path, "\n".join(lines) + "\n", durable=True, mode=0o600)


def create_secrets(
    config: Config,
    key_dir: Path,
    owner: str,
    *,
    rotate: bool = False,
    services: Collection[int] | None = None,
) -> SecretsReport:
    """Make a signing seed for each principal `owner` holds that has no secret in `key_dir`
    yet (each existing one is kept: a second run changes nothing). `rotate`: replace each
    one (of `services` only, if given) with a fresh seed, its MAC keys gone until the next
    install_bundle; slots a conviction re-keyed are left alone. A secret file without a
    signing key is an error."""
    key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    report = SecretsReport()
    for sid, p in owned(config, owner):
        path = keys.secret_path(key_dir, sid, p)
        if path.exists():
            old = keys.load_secret(path)
            if old.sign is None:
                raise HostKeyError(f"{path}: no signing key (not a file zz made)")
            if old.epoch:
                report.rekeyed.append((sid, p))
                continue
            if not rotate or (services is not None and sid not in services):
                report.kept.append((sid, p))
                continue
        _secret_dir(key_dir, sid)
        _write_secret(path, keys.Secret(p, SigningKey(os.urandom(KEY_LEN))))
        report.created.append((sid, p))
    if owner != OPERATOR and report.rekeyed:
        _resign_spares(config, key_dir, owner, report)
    return report


def _resign_spares(config: Config, key_dir: Path, owner: str, report: SecretsReport) -> None:
    """The SPARE-READY of each re-keyed slot on this host, signed with its controld's key
    as it is now: a rotated controld key would otherwise leave the announcements verifying
    under no key (keys.slot_keys refuses them)."""
    me = keys.controld_principal(_host(config, owner).index)
    ctl = keys.load_secret(keys.secret_path(key_dir, keys.RACK_SERVICE, me))
    assert ctl.sign is not None
    for sid, p in report.rekeyed:
        cert = keys.spare_cert_path(key_dir, sid, p)
        if not cert.exists():
            continue
        try:
            m = wire.decode(bytes.fromhex(cert.read_text().strip()))
        except (ValueError, wire.WireError) as e:
            raise HostKeyError(f"{cert}: {e}") from e
        if not isinstance(m, wire.SpareReady) or m.sender != me:
            raise HostKeyError(f"{cert}: not a SPARE-READY of this host's controld")
        if m.verify_sig(ctl.sign.public):
            continue
        raw = wire.SpareReady(
            m.service, m.sender, m.replica, m.seq, m.epoch, m.sign_pub, m.dh_pub
        ).signed(ctl.sign)
        write_atomic(cert, raw.encode().hex() + "\n", durable=True)
        report.resigned.append(cert)


def _local_secrets(config: Config, key_dir: Path, owner: str) -> dict[Principal, keys.Secret]:
    out = {}
    for sid, p in owned(config, owner):
        path = keys.secret_path(key_dir, sid, p)
        if not path.exists():
            raise HostKeyError(
                f"{path}: missing ({describe(config, sid, p)} is {owner}'s): make it first"
                f" ({'zz keys CONFIG --operator' if owner == OPERATOR else 'zz host init'})"
            )
        sec = keys.load_secret(path)
        if sec.sign is None:
            raise HostKeyError(f"{path}: no signing key")
        out[(sid, p)] = sec
    return out


def export_path(key_dir: Path, owner: str) -> Path:
    return key_dir / f"{owner}.pub"


def export_public(config: Config, key_dir: Path, owner: str) -> Path:
    """Write `<key_dir>/<owner>.pub`: the public keys of `owner`'s principals, for the
    operator's bundle. Rewritten only when it changes."""
    lines = [EXPORT_MAGIC, f"rack {config.rack.name}", f"owner {owner}"]
    for (sid, p), sec in sorted(_local_secrets(config, key_dir, owner).items()):
        assert sec.sign is not None
        lines.append(f"{sid} {p} {sec.sign.public.hex()}")
    text = "\n".join(lines) + "\n"
    out = export_path(key_dir, owner)
    if not out.exists() or out.read_text() != text:
        write_atomic(out, text)
    return out


# ---- 2. the operator's bundle --------------------------------------------------------------
def _header(lines: list[str], magic: str, where: str) -> tuple[str, list[str]]:
    """Check the magic line; returns the rack name and the remaining lines."""
    if not lines or lines[0].strip() != magic:
        raise HostKeyError(f"{where}: not a {magic!r} file (first line)")
    if len(lines) < 2 or not lines[1].startswith("rack "):
        raise HostKeyError(f"{where}:2: expected 'rack NAME'")
    return lines[1].split(None, 1)[1].strip(), lines[2:]


def _key_line(line: str, where: str, fields: int) -> list[str]:
    parts = line.split()
    ok = len(parts) == fields and parts[0].isdigit() and parts[1].isdigit()
    if ok:
        try:
            ok = len(bytes.fromhex(parts[2])) == KEY_LEN
        except ValueError:
            ok = False
    if not ok:
        form = "<service> <principal> <hex key>" + (" <owner>" if fields == 4 else "")
        raise HostKeyError(f"{where}: expected '{form}'")
    return parts


def parse_export(text: str, where: str) -> tuple[str, str, dict[Principal, bytes]]:
    """(rack, owner, {(service, principal): public key}) of an `<owner>.pub` file."""
    rack, rest = _header(text.splitlines(), EXPORT_MAGIC, where)
    if not rest or not rest[0].startswith("owner "):
        raise HostKeyError(f"{where}:3: expected 'owner NAME'")
    owner = rest[0].split(None, 1)[1].strip()
    out: dict[Principal, bytes] = {}
    for no, line in enumerate(rest[1:], 4):
        if not line.strip() or line.startswith("#"):
            continue
        sid, p, key = _key_line(line, f"{where}:{no}", 3)
        if (int(sid), int(p)) in out:
            raise HostKeyError(f"{where}:{no}: s{sid} p{p} listed twice")
        out[(int(sid), int(p))] = bytes.fromhex(key)
    return rack, owner, out


@dataclass(frozen=True)
class Bundle:
    rack: str
    keys: dict[Principal, tuple[bytes, str]]  # (service, principal) -> (public key, owner)
    text: str

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.text)

    def public(self, service_id: int) -> dict[int, bytes]:
        return {p: k for (sid, p), (k, _) in self.keys.items() if sid == service_id}


def fingerprint(text: str) -> str:
    """What the operator tells each host, out of band, to compare before installing."""
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _check_complete(config: Config, got: dict[Principal, tuple[bytes, str]], where: str) -> None:
    """Every principal of the rack once, from the owner the placement gives it."""
    check_names(config)
    expected = set(all_principals(config))
    for (sid, p), (_, owner) in sorted(got.items()):
        if (sid, p) not in expected:
            raise HostKeyError(f"{where}: s{sid} p{p} is no principal of rack {config.rack.name}")
        should = owner_of(config, sid, p)
        if owner != should:
            raise HostKeyError(
                f"{where}: {describe(config, sid, p)} comes from {owner}, but the placement"
                f" puts it on {should}"
            )
    missing = sorted(expected - set(got))
    if missing:
        owners = sorted({owner_of(config, *sp) for sp in missing})
        first = ", ".join(describe(config, *sp) for sp in missing[:3])
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise HostKeyError(
            f"{where}: {len(missing)} public keys missing ({first}{more}): no export from"
            f" {', '.join(owners)}"
        )


def make_bundle(config: Config, exports: Iterable[Path]) -> Bundle:
    """Join the owners' exports into the rack's bundle, refusing a key from the wrong
    owner, a principal exported twice, another rack's export, or a missing owner."""
    got: dict[Principal, tuple[bytes, str]] = {}
    seen_owners: dict[str, Path] = {}
    for path in exports:
        try:
            text = path.read_text()
        except OSError as e:
            raise HostKeyError(f"{path}: cannot read: {e.strerror}") from e
        rack, owner, pubs = parse_export(text, str(path))
        if rack != config.rack.name:
            raise HostKeyError(f"{path}: keys of rack {rack!r}, not {config.rack.name!r}")
        if owner in seen_owners:
            raise HostKeyError(f"{path}: a second export of {owner} (first: {seen_owners[owner]})")
        seen_owners[owner] = path
        for sp, key in pubs.items():
            if sp in got:
                raise HostKeyError(
                    f"{path}: {describe(config, *sp)} is also in the export of {got[sp][1]}"
                )
            got[sp] = (key, owner)
    _check_complete(config, got, "bundle")
    lines = [BUNDLE_MAGIC, f"rack {config.rack.name}"]
    lines += [f"{sid} {p} {k.hex()} {o}" for (sid, p), (k, o) in sorted(got.items())]
    text = "\n".join(lines) + "\n"
    return Bundle(config.rack.name, got, text)


def parse_bundle(config: Config, text: str, where: str) -> Bundle:
    rack, rest = _header(text.splitlines(), BUNDLE_MAGIC, where)
    if rack != config.rack.name:
        raise HostKeyError(f"{where}: a bundle of rack {rack!r}, not {config.rack.name!r}")
    got: dict[Principal, tuple[bytes, str]] = {}
    for no, line in enumerate(rest, 3):
        if not line.strip() or line.startswith("#"):
            continue
        sid, p, key, owner = _key_line(line, f"{where}:{no}", 4)
        if (int(sid), int(p)) in got:
            raise HostKeyError(f"{where}:{no}: s{sid} p{p} listed twice")
        got[(int(sid), int(p))] = (bytes.fromhex(key), owner)
    _check_complete(config, got, where)
    return Bundle(rack, got, text)


def load_bundle(config: Config, path: Path) -> Bundle:
    try:
        text = path.read_text()
    except OSError as e:
        raise HostKeyError(f"{path}: cannot read: {e.strerror}") from e
    return parse_bundle(config, text, str(path))


# ---- 3. installing the bundle: public files and derived MAC keys ---------------------------
def mac_peers(config: Config, service_id: int, principal: int, bundle: Bundle) -> list[int]:
    """The principals `principal` shares a MAC key with: keys.mac_pairs in a service; in s0
    every operator with every controld (CONTROL / CONTROL-REPLY)."""
    if service_id == keys.RACK_SERVICE:
        rack = bundle.public(keys.RACK_SERVICE)
        ops = sorted(p for p in rack if p >= wire.PRINCIPAL_OPERATOR)
        ctls = sorted(p for p in rack if p < wire.PRINCIPAL_OPERATOR)
        return ctls if principal >= wire.PRINCIPAL_OPERATOR else ops
    s = config.service(service_id)
    out = [b for a, b in keys.mac_pairs(s) if a == principal]
    out += [a for a, b in keys.mac_pairs(s) if b == principal]
    return sorted(out)


def derived_macs(
    config: Config, service_id: int, secret: keys.Secret, bundle: Bundle
) -> dict[int, bytes]:
    """The MAC keys of `secret` with each of its peers, from its seed and their public keys
    in the bundle (keys.epoch_mac_key at the secret's epoch). A slot a conviction re-keyed
    (epoch > 0) shares keys with the agreement replicas and clients only, as
    keys.rotate_exec makes them; its peers derive the same from its SPARE-READY."""
    assert secret.sign is not None
    pub = bundle.public(service_id)
    peers = mac_peers(config, service_id, secret.principal, bundle)
    if secret.epoch:
        peers = [p for p in peers if p < wire.PRINCIPAL_EXEC or p >= wire.PRINCIPAL_CLIENT]
    out = {}
    for peer in peers:
        out[peer] = keys.epoch_mac_key(
            secret.sign,
            keys.ed25519_to_x25519(pub[peer]),
            service_id,
            secret.principal,
            peer,
            secret.epoch,
        )
    return out


@dataclass
class InstallReport:
    fingerprint: str
    publics: list[Path] = field(default_factory=list)  # public files written
    secrets: list[Path] = field(default_factory=list)  # secret files whose MAC keys changed

    @property
    def changed(self) -> bool:
        return bool(self.publics or self.secrets)


def install_bundle(config: Config, key_dir: Path, owner: str, bundle: Bundle) -> InstallReport:
    """Install `bundle` into `owner`'s key_dir: the public files it needs (services_needed)
    and, in each of its secrets, the MAC keys derived with its peers. Refuses a bundle
    that does not carry this owner's own public keys as its secrets have them (an old
    bundle, or somebody else's keys). Writes only what differs: a second install of the
    same bundle changes nothing."""
    mine = _local_secrets(config, key_dir, owner)
    for (sid, p), sec in sorted(mine.items()):
        assert sec.sign is not None
        got = bundle.keys.get((sid, p))
        if sec.epoch:
            continue  # a re-keyed slot's key is vouched for by its SPARE-READY, not the bundle
        if got is None or got[0] != sec.sign.public:
            raise HostKeyError(
                f"bundle {bundle.fingerprint}: its key for {describe(config, sid, p)} is not"
                f" the one in {keys.secret_path(key_dir, sid, p)} (a bundle made before"
                f" {owner}'s keys were made or rotated? build it again from {owner}'s"
                f" {export_path(key_dir, owner).name})"
            )
    report = InstallReport(bundle.fingerprint)
    for sid in services_needed(config, owner):
        lines = [f"{p} {k.hex()}" for p, k in sorted(bundle.public(sid).items())]
        text = "\n".join(lines) + "\n"
        path = keys.public_path(key_dir, sid)
        _secret_dir(key_dir, sid)
        if not path.exists() or path.read_text() != text:
            write_atomic(path, text, durable=True)
            report.publics.append(path)
    for (sid, p), sec in sorted(mine.items()):
        macs = derived_macs(config, sid, sec, bundle)
        if macs != sec.macs:
            sec.macs = macs
            path = keys.secret_path(key_dir, sid, p)
            _write_secret(path, sec)
            report.secrets.append(path)
    write_installed(key_dir, bundle)
    return report


def installed_path(key_dir: Path) -> Path:
    return key_dir / "bundle.installed"


def write_installed(key_dir: Path, bundle: Bundle) -> None:
    """Keep the installed bundle (public keys only) next to the keys: `zz host init`
    reports its fingerprint, and a later install compares against it."""
    path = installed_path(key_dir)
    if not path.exists() or path.read_text() != bundle.text:
        write_atomic(path, bundle.text, durable=True)


def installed_fingerprint(key_dir: Path) -> str | None:
    path = installed_path(key_dir)
    return fingerprint(path.read_text()) if path.exists() else None
