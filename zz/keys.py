# zz/keys.py - generate and load the rack key directory (docs/config.md, "Key directory").
# Secrets come from os.urandom and are written 0600 into a fresh directory swapped in whole.
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from . import wire
from .config import Config, Service
from .crypto import KEY_LEN, SigningKey


class KeyFileError(Exception):
    """A missing or malformed key file."""


@dataclass
class Secret:
    """One principal's secrets: its Ed25519 seed and its pairwise MAC keys by peer id."""

    principal: int
    sign: SigningKey | None = None
    macs: dict[int, bytes] = field(default_factory=dict)


def principals(service: Service) -> tuple[list[int], list[int], list[int]]:
    """(agreement, execution, client) principal ids of a service."""
    agree = [wire.agreement_principal(r) for r in range(service.n)]
    execs = [wire.exec_principal(i) for i in range(service.exec_replicas)]
    clients = [wire.client_principal(c) for c in range(service.clients)]
    return agree, execs, clients


def mac_pairs(service: Service) -> list[tuple[int, int]]:
    """Every pair that shares a MAC key: agreement with agreement, execution replicas and
    clients; execution replicas with clients (their REPLYs go straight to the client)."""
    agree, execs, clients = principals(service)
    pairs = [(a, b) for i, a in enumerate(agree) for b in agree[i + 1 :]]
    pairs += [(a, x) for a in agree for x in execs]
    pairs += [(a, c) for a in agree for c in clients]
    pairs += [(x, c) for x in execs for c in clients]
    return pairs


# Rack-level principals in service 0 (docs/wire.md): controld of host h, operator k (`zz`).
RACK_SERVICE = 0
PRINCIPAL_OPERATOR = wire.PRINCIPAL_OPERATOR
operator_principal = wire.operator_principal


def controld_principal(h: int) -> int:
    return wire.host_principal(h)


def rack_principals(config: Config, operators: int = 1) -> tuple[list[int], list[int]]:
    """(controld, operator) principal ids of the rack (service 0)."""
    return (
        [controld_principal(h.index) for h in config.hosts],
        [operator_principal(k) for k in range(operators)],
    )


def service_dir(key_dir: Path, service_id: int) -> Path:
    return key_dir / f"s{service_id}"


def secret_path(key_dir: Path, service_id: int, principal: int) -> Path:
    return service_dir(key_dir, service_id) / f"p{principal}.secret"


def public_path(key_dir: Path, service_id: int) -> Path:
    return service_dir(key_dir, service_id) / "public"


def _write_secret(path: Path, secret: Secret) -> None:
    lines = []
    if secret.sign is not None:
        lines.append(f"sign {secret.sign.seed.hex()}")
    lines += [f"mac {peer} {key.hex()}" for peer, key in sorted(secret.macs.items())]
    # O_EXCL + mode at creation: the secret is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def _generate_service(root: Path, service: Service) -> None:
    d = service_dir(root, service.id)
    d.mkdir(mode=0o700)
    agree, execs, clients = principals(service)
    secrets = {p: Secret(p, SigningKey(os.urandom(KEY_LEN))) for p in agree + execs + clients}
    for a, b in mac_pairs(service):
        k = os.urandom(KEY_LEN)
        secrets[a].macs[b] = k
        secrets[b].macs[a] = k
    pub_lines = [f"{p} {s.sign.public.hex()}" for p, s in sorted(secrets.items()) if s.sign]
    (d / "public").write_text("\n".join(pub_lines) + "\n")
    for p, s in secrets.items():
        _write_secret(d / f"p{p}.secret", s)


def _generate_rack(root: Path, config: Config, operators: int) -> None:
    """keys/s0: controlds and operators, each with an Ed25519 key; every operator shares a
    MAC key with every controld (CONTROL/CONTROL-REPLY). Controlds verify WAKEUP/SHUTDOWN
    with the services' own public files, so they need no keys shared with replicas."""
    d = service_dir(root, RACK_SERVICE)
    d.mkdir(mode=0o700)
    ctl, ops = rack_principals(config, operators)
    secrets = {p: Secret(p, SigningKey(os.urandom(KEY_LEN))) for p in ctl + ops}
    for o in ops:
        for c in ctl:
            k = os.urandom(KEY_LEN)
            secrets[o].macs[c] = k
            secrets[c].macs[o] = k
    pub_lines = [f"{p} {s.sign.public.hex()}" for p, s in sorted(secrets.items()) if s.sign]
    (d / "public").write_text("\n".join(pub_lines) + "\n")
    for p, s in secrets.items():
        _write_secret(d / f"p{p}.secret", s)


def generate(config: Config, force: bool = False, operators: int = 1) -> Path:
    """Write the whole key directory (every service plus the rack-level s0); refuse to
    replace an existing one unless `force`."""
    if operators < 1:
        raise ValueError("at least one operator principal is needed")
    key_dir = config.rack.key_dir
    if key_dir.exists() and not force:
        raise FileExistsError(f"{key_dir} exists; pass --force to replace it")
    key_dir.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename: a crash never leaves a half-written key set.
    tmp = Path(tempfile.mkdtemp(prefix=f".{key_dir.name}.", dir=key_dir.parent))
    try:
        _generate_rack(tmp, config, operators)
        for s in config.services:
            _generate_service(tmp, s)
        if key_dir.exists():
            old = key_dir.with_name(f".{key_dir.name}.old.{os.getpid()}")
            key_dir.rename(old)
            tmp.rename(key_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(key_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return key_dir


def _hex32(text: str, where: str) -> bytes:
    try:
        b = bytes.fromhex(text)
    except ValueError:
        b = b""
    if len(b) != KEY_LEN:
        raise KeyFileError(f"{where}: expected {KEY_LEN} bytes of hex")
    return b


def load_secret(path: Path) -> Secret:
    name = path.name
    if not (name.startswith("p") and name.endswith(".secret") and name[1:-7].isdigit()):
        raise KeyFileError(f"{path}: not a p<id>.secret file")
    sec = Secret(int(name[1:-7]))
    try:
        text = path.read_text()
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read: {e.strerror}") from e
    for no, line in enumerate(text.splitlines(), 1):
        where = f"{path}:{no}"
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        if parts[0] == "sign" and len(parts) == 2:
            sec.sign = SigningKey(_hex32(parts[1], where))
        elif parts[0] == "mac" and len(parts) == 3 and parts[1].isdigit():
            sec.macs[int(parts[1])] = _hex32(parts[2], where)
        else:
            raise KeyFileError(f"{where}: expected 'sign HEX' or 'mac PEER HEX'")
    return sec


def load_public(path: Path) -> dict[int, bytes]:
    try:
        text = path.read_text()
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read: {e.strerror}") from e
    out: dict[int, bytes] = {}
    for no, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        if len(parts) != 2 or not parts[0].isdigit():
            raise KeyFileError(f"{path}:{no}: expected '<id> <hex public key>'")
        out[int(parts[0])] = _hex32(parts[1], f"{path}:{no}")
    return out


def peer_keys(secret: Secret, peers: Iterable[int]) -> dict[int, bytes]:
    """The MAC keys for `peers`, in their order; a missing one is an error, not a skip."""
    out = {}
    for p in peers:
        if p not in secret.macs:
            raise KeyFileError(f"principal {secret.principal} has no MAC key with {p}")
        out[p] = secret.macs[p]
    return out


@dataclass
class ControldKeys:
    """What one controld needs: its own secret (MAC keys with the operators) and every
    service's public keys, by service id (WAKEUP/SHUTDOWN signatures)."""

    secret: Secret
    operators: dict[int, bytes]
    services: dict[int, dict[int, bytes]]


def load_controld(key_dir: Path, config: Config, host_index: int) -> ControldKeys:
    me = controld_principal(host_index)
    sec = load_secret(secret_path(key_dir, RACK_SERVICE, me))
    if sec.sign is None:
        raise KeyFileError(f"{secret_path(key_dir, RACK_SERVICE, me)}: no signing key")
    ops = {p: k for p, k in sec.macs.items() if p >= PRINCIPAL_OPERATOR}
    services = {s.id: load_public(public_path(key_dir, s.id)) for s in config.services}
    return ControldKeys(sec, ops, services)
