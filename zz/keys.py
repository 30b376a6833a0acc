# zz/keys.py - generate and load the rack key directory (docs/config.md, "Key directory").
# Secrets come from os.urandom and are written 0600 into a fresh directory swapped in whole.
from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import struct
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from zz import wire
from zz.atomicfile import write_atomic
from zz.config import Config, Service
from zz.crypto import KEY_LEN, SigningKey


class KeyFileError(Exception):
    """A missing or malformed key file."""


@dataclass
class Secret:
    """One principal's secrets: its Ed25519 seed and its pairwise MAC keys by peer id."""

    principal: int
    sign: SigningKey | None = None
    macs: dict[int, bytes] = field(default_factory=dict)
    epoch: int = 0  # the key generation of an execution replica's slot (docs/wire.md)


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
    lines = [f"epoch {secret.epoch}"] if secret.epoch else []
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
        elif parts[0] == "epoch" and len(parts) == 2 and parts[1].isdigit():
            sec.epoch = int(parts[1])
            if sec.epoch >= 1 << 32:
                raise KeyFileError(f"{where}: epoch beyond u32")
        else:
            raise KeyFileError(f"{where}: expected 'sign HEX', 'mac PEER HEX' or 'epoch N'")
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
    services: dict[int, Mapping[int, bytes]]


def load_controld(key_dir: Path, config: Config, host_index: int) -> ControldKeys:
    me = controld_principal(host_index)
    sec = load_secret(secret_path(key_dir, RACK_SERVICE, me))
    if sec.sign is None:
        raise KeyFileError(f"{secret_path(key_dir, RACK_SERVICE, me)}: no signing key")
    ops = {p: k for p, k in sec.macs.items() if p >= PRINCIPAL_OPERATOR}
    # Re-keyed slots count under their current key only (key epochs, below), also those
    # another host's controld re-keys while this one runs: the view follows the signed
    # announcements in the key directory (PeerKeys). A fixed view made a spare refilled by
    # one controld unable to fetch state through the others (seen in the campaign).
    # A host of a rack keyed per host (zz/hostkeys.py) holds the public files of the services
    # it carries only: another service's certificates then verify under no key (refused).
    counters: Counter[str] = Counter()
    services: dict[int, Mapping[int, bytes]] = {}
    for s in config.services:
        carried = any(config.replica_host(s, r).index == host_index for r in range(s.n)) or any(
            s.exec_host(config, i).index == host_index for i in range(s.n_exec)
        )
        if carried or public_path(key_dir, s.id).exists():
            services[s.id] = PeerKeys(key_dir, config, s, counters)
        else:
            services[s.id] = {}
    return ControldKeys(sec, ops, services)


# ---- key epochs: a fresh spare's new keys (docs/wire.md "Key epochs") ----------------------
# A convicted replica's successor in slot i gets a new Ed25519 key and new MAC keys; its
# controld announces the new public keys in a SPARE-READY it signs (epoch e+1). The MAC key
# it shares with principal p is derived by X25519 between the new replica's key and p's own
# Ed25519 key (read as the X25519 key of the same scalar), so nobody holding the old keys,
# and nothing on the wire, gives it away. The signed SPARE-READY is kept next to the public
# file (spare-p<id>.msg, hex) so every verifier that reads the key directory sees the slot's
# current key (service_publics).

_P25519 = 2**255 - 19
EPOCH_MAC_INFO = b"zz-epoch-mac"


def dh_private(sign: SigningKey) -> X25519PrivateKey:
    """The X25519 key of an Ed25519 seed's own scalar (SHA-512(seed)[:32], RFC 8032)."""
    return X25519PrivateKey.from_private_bytes(hashlib.sha512(sign.seed).digest()[:32])


def dh_public(sign: SigningKey) -> bytes:
    return dh_private(sign).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def ed25519_to_x25519(pub: bytes) -> bytes:
    """An Ed25519 public key's Montgomery u coordinate, u = (1+y)/(1-y) mod p: the X25519
    public key of the same scalar."""
    if len(pub) != KEY_LEN:
        raise ValueError(f"public key must be {KEY_LEN} bytes")
    y = int.from_bytes(pub, "little") & ((1 << 255) - 1)
    if y >= _P25519 or (1 - y) % _P25519 == 0:
        raise ValueError("not an Ed25519 public key")
    u = (1 + y) * pow(1 - y, _P25519 - 2, _P25519) % _P25519
    return u.to_bytes(KEY_LEN, "little")


def epoch_mac_key(
    own: SigningKey, peer_dh_pub: bytes, service: int, a: int, b: int, epoch: int
) -> bytes:
    """K(a, b) in `epoch` of the execution slot among a and b: HMAC-SHA-256(X25519(own,
    peer), "zz-epoch-mac" || u16 service || u32 min || u32 max || u32 epoch). Both ends get
    the same key: the new replica from its seed and the peer's Ed25519 public key converted
    (ed25519_to_x25519), the peer from its own seed and the announced dh_pub."""
    shared = dh_private(own).exchange(X25519PublicKey.from_public_bytes(peer_dh_pub))
    if shared == bytes(KEY_LEN):
        raise ValueError("low-order X25519 key")
    lo, hi = min(a, b), max(a, b)
    info = EPOCH_MAC_INFO + struct.pack(">HIII", service, lo, hi, epoch)
    return hmac.new(shared, info, hashlib.sha256).digest()


def spare_cert_path(key_dir: Path, service_id: int, principal: int) -> Path:
    return service_dir(key_dir, service_id) / f"spare-p{principal}.msg"


class SpareKeyError(Exception):
    """A SPARE-READY that does not vouch for a slot's key."""


def verify_spare_ready(
    raw: bytes, config: Config, service: Service, rack_public: dict[int, bytes]
) -> wire.SpareReady:
    """A SPARE-READY for `service` signed by the controld of the replica's host (the rule
    zz-agreed applies, docs/wire.md); raises SpareKeyError."""
    try:
        m = wire.decode(raw)
    except wire.WireError as e:
        raise SpareKeyError(f"malformed: {e}") from e
    if not isinstance(m, wire.SpareReady) or m.service != service.id:
        raise SpareKeyError("not a SPARE-READY of this service")
    if m.replica >= service.n_exec:
        raise SpareKeyError(f"unknown replica {m.replica}")
    host = service.exec_host(config, m.replica)
    if m.sender != controld_principal(host.index):
        raise SpareKeyError("sender is not the controld of the replica's host")
    pub = rack_public.get(m.sender)
    if pub is None or not m.verify_sig(pub):
        raise SpareKeyError("signature")
    return m


def slot_keys(
    key_dir: Path, config: Config, service: Service
) -> dict[int, wire.SpareReady]:
    """The verified SPARE-READY of every re-keyed slot of `service`, by principal."""
    out: dict[int, wire.SpareReady] = {}
    rack = service_dir(key_dir, RACK_SERVICE) / "public"
    rack_public: dict[int, bytes] | None = None
    for i in range(service.n_exec):
        p = spare_cert_path(key_dir, service.id, wire.exec_principal(i))
        try:
            text = p.read_text()
        except FileNotFoundError:
            continue
        except OSError as e:
            raise KeyFileError(f"{p}: cannot read: {e.strerror}") from e
        if rack_public is None:
            rack_public = load_public(rack)
        try:
            m = verify_spare_ready(bytes.fromhex(text.strip()), config, service, rack_public)
        except (ValueError, SpareKeyError) as e:
            raise KeyFileError(f"{p}: {e}") from e
        if m.replica != i:
            raise KeyFileError(f"{p}: announces replica {m.replica}")
        if m.epoch > 0:
            out[wire.exec_principal(i)] = m
    return out


def service_publics(key_dir: Path, config: Config, service: Service) -> dict[int, bytes]:
    """The service's public keys with every re-keyed slot's CURRENT key: a verifier that
    uses this accepts a slot's messages only from its latest incarnation."""
    pub = load_public(public_path(key_dir, service.id))
    for p, m in slot_keys(key_dir, config, service).items():
        pub[p] = m.sign_pub
    return pub


def rotate_exec(
    key_dir: Path,
    config: Config,
    service: Service,
    index: int,
    seq: int,
    host_key: SigningKey,
    host_index: int,
) -> bytes:
    """controld, before provisioning the successor of the replica convicted at `seq` in
    slot `index`: write the slot a new secret (a fresh Ed25519 key, epoch + 1, MAC keys
    with the agreement replicas and clients derived by epoch_mac_key) and keep the signed
    SPARE-READY that announces it. Returns that SPARE-READY. Called again for the same
    conviction (a retry, a restarted controld), it returns the one already made."""
    me = wire.exec_principal(index)
    cert = spare_cert_path(key_dir, service.id, me)
    sec_path = secret_path(key_dir, service.id, me)
    old = load_secret(sec_path)
    if cert.exists():
        m = wire.decode(bytes.fromhex(cert.read_text().strip()))
        if isinstance(m, wire.SpareReady) and m.seq == seq and m.epoch == old.epoch:
            return m.encode()
    agree, _, clients = principals(service)
    publics = load_public(public_path(key_dir, service.id))
    new = Secret(me, SigningKey(os.urandom(KEY_LEN)), epoch=old.epoch + 1)
    assert new.sign is not None
    for p in agree + clients:
        if p not in publics:
            raise KeyFileError(f"{public_path(key_dir, service.id)}: no key for {p}")
        new.macs[p] = epoch_mac_key(
            new.sign, ed25519_to_x25519(publics[p]), service.id, me, p, new.epoch
        )
    raw = (
        wire.SpareReady(
            service.id,
            controld_principal(host_index),
            index,
            seq,
            new.epoch,
            new.sign.public,
            dh_public(new.sign),
        )
        .signed(host_key)
        .encode()
    )
    lines = [f"epoch {new.epoch}", f"sign {new.sign.seed.hex()}"]
    lines += [f"mac {peer} {key.hex()}" for peer, key in sorted(new.macs.items())]
    # The secret first: a crash between the two leaves a key nobody trusts yet (the next
    # attempt makes another), never a trusted key without its secret.
    write_atomic(sec_path, "\n".join(lines) + "\n", durable=True, mode=0o600)
    write_atomic(cert, raw.hex() + "\n", durable=True)
    return raw


class PeerKeys(Mapping[int, bytes]):
    """A runtime's view of its service's public keys, by principal, that follows the slots'
    key epochs: a re-keyed slot counts under its current key only, and a signature under a
    key the slot had before is dropped and counted per sender (`stale_key_from_<id>` in
    `counters`). The announcements are re-read when one of their files changes, so a
    running replica learns a peer's new key without a restart."""

    def __init__(
        self, key_dir: Path, config: Config, service: Service, counters: Counter[str]
    ) -> None:
        self.key_dir = Path(key_dir)
        self.config = config
        self.service = service
        self.counters = counters
        self.retired: dict[int, set[bytes]] = {}
        self.epochs: dict[int, int] = {}
        self._base = load_public(public_path(self.key_dir, service.id))
        self._keys: dict[int, bytes] = dict(self._base)
        self._stamp: tuple[tuple[int, int], ...] | None = None
        self.refresh()

    def _files_stamp(self) -> tuple[tuple[int, int], ...]:
        out = []
        for i in range(self.service.n_exec):
            p = spare_cert_path(self.key_dir, self.service.id, wire.exec_principal(i))
            try:
                st = p.stat()
            except FileNotFoundError:
                out.append((0, 0))
            else:
                out.append((st.st_mtime_ns, st.st_ino))
        return tuple(out)

    def refresh(self) -> None:
        stamp = self._files_stamp()
        if stamp == self._stamp:
            return
        try:
            slots = slot_keys(self.key_dir, self.config, self.service)
        except KeyFileError:
            if self._stamp is None:
                raise  # at start: the caller reports it
            # A running verifier keeps the view it has (a bad file never lowers an epoch).
            self.counters["key_view_errors"] += 1
            self._stamp = stamp
            return
        for p, m in slots.items():
            if m.epoch <= self.epochs.get(p, 0):
                continue  # an older announcement never takes a slot back
            old = self._keys.get(p)
            if old is not None and old != m.sign_pub:
                self.retired.setdefault(p, set()).add(old)
            self._keys[p] = m.sign_pub
            self.epochs[p] = m.epoch
        self._stamp = stamp

    def __getitem__(self, principal: int) -> bytes:
        self.refresh()
        return self._keys[principal]

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def verify(self, m: wire.Message) -> bool:
        """m's signature verifies under its sender's current key; a stale one is counted."""
        pub = self.get(m.sender)
        if pub is not None and m.verify_sig(pub):
            return True
        self.note_failed(m)
        return False

    def note_failed(self, m: wire.Message) -> None:
        """Count m (its signature failed) if it verifies under a key its slot had before."""
        if any(m.verify_sig(k) for k in self.retired.get(m.sender, ())):
            self.counters[f"stale_key_from_{m.sender}"] += 1
            self.counters["stale_key_dropped"] += 1


def with_epoch_macs(secret: Secret, key_dir: Path, config: Config, service: Service) -> Secret:
    """`secret` (an agreement replica's or a client's) with the MAC key it shares with every
    re-keyed execution slot replaced by that slot's current epoch key (epoch_mac_key): the
    key file's key, which the slot's earlier incarnations held, authenticates nothing."""
    if secret.sign is None:
        return secret
    out = Secret(secret.principal, secret.sign, dict(secret.macs), secret.epoch)
    for p, m in slot_keys(key_dir, config, service).items():
        if p in out.macs:
            out.macs[p] = epoch_mac_key(
                secret.sign, m.dh_pub, service.id, secret.principal, p, m.epoch
            )
    return out
