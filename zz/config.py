# zz/config.py - load and validate the rack config (TOML, docs/config.md) into dataclasses.
# Validation happens once, here, so every other tool can trust the values it gets.
from __future__ import annotations

import ipaddress
import re
import tomllib
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from zz.appspec import AppRegistryError, get_spec

# Rack, host and service names: they become file names (run/controld/<host>), libvirt
# domain names (zz-<rack>-...), ZFS pool names and command-line arguments, so a letter or
# digit first (never `-`, never a path), at most 63 characters; matched whole (fullmatch).
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
U32_MAX = 0xFFFFFFFF
# Timers in milliseconds: at most an hour (the replica file takes a u32; a view timeout
# doubles per failed view, so a huge first value means no view change ever happens).
MAX_TIMER_MS = 3_600_000
# agreement/src/wire.h ZZ_MAX_LIST: a PRE-PREPARE's request list on the wire.
MAX_LIST = 65536
# Mirrors agreement/src/conf.h: a replica holds at most this many keyed principals.
MAX_REPLICAS = 64
MAX_PRINCIPALS = 4096
# Execution replica i listens on base_port + EXEC_PORT_OFFSET + i. Agreement replicas use
# base_port .. base_port + n - 1 and n <= MAX_REPLICAS, so the two ranges never overlap.
EXEC_PORT_OFFSET = MAX_REPLICAS
# Where a runtime in a guest writes its status, in its state dir (Service.exec_status_path).
GUEST_STATUS = "status.json"


# Mirrors of the C limits (agreement/src/wire.h, conf.h; docs/wire.md "Size limits").
MAX_MSG = 16777216
MSG_OVERHEAD_MAX = 65536
MAX_BATCH_BYTES = MAX_MSG - 4194304 - MSG_OVERHEAD_MAX
BATCH_HDR_LEN = 20
MIN_MAX_REQUEST = 1024


def request_limit(rack: Rack, clients: int, echo: bool) -> int:
    """The largest REQUEST message (MAC vector included) the agreement replicas accept; the
    same formula as zz_request_limit in agreement/src/request.c. With the echo app every
    client's last result (its op) is in one state encoding, which must fit a frame."""
    lim = min(rack.max_request, rack.batch_bytes - BATCH_HDR_LEN - 4)
    if echo and clients > 0:
        per = (MAX_MSG - MSG_OVERHEAD_MAX - 44) // clients
        lim = min(lim, max(per - 16, 0))
    return lim


class ConfigError(Exception):
    """An invalid rack config; the message starts with the offending field path."""


@dataclass(frozen=True)
class Rack:
    name: str
    key_dir: Path
    run_dir: Path
    checkpoint_interval: int = 128
    log_window: int = 256
    batch_max: int = 400
    view_timeout_ms: int = 1000
    # Replica tunables rendered into agreed-<r>.conf; optional in the TOML.
    # max_inflight None: not rendered, zz-agreed's default (4; 1 with a synced log,
    # docs/agreement.md "One batch in flight").
    max_inflight: int | None = None
    status_interval_ms: int = 200
    time_tolerance_ms: int = 10000
    # How services are laid over the hosts (docs/placement.md): "spread" or "rotate".
    placement: str = "spread"
    # Size limits (docs/wire.md "Size limits"): the largest REQUEST message and batch.
    max_request: int = 1 << 20
    batch_bytes: int = 4 << 20
    # When clients sign their requests (docs/agreement.md "Signed requests"): "retransmit"
    # (MACs first, signed retransmissions) or "always" (every request, and the agreement
    # replicas order signed requests only).
    client_signatures: str = "retransmit"
    # Durable agreement state (docs/agreement.md "Durable state"): "fsync" (each replica's
    # write-ahead log is synced before any message that depends on it is sent), "write"
    # (written to the kernel only: survives a process crash, not the host's) or "off".
    durability: str = "off"
    # Who runs each host's controld (docs/config.md): "local", `zz rack up` starts every
    # one as a process of the operator's machine (a rack on one machine); "hosts", each
    # runs on its host under its own supervisor (systemd: zz-controld@NAME), and `zz rack`,
    # `zz status` and `zz drill` only talk to them (docs/operations.md "Four real hosts").
    controlds: str = "local"
    # How a guest's state dataset is shared into it on a libvirt rack (docs/images.md "The
    # state share"): "virtiofs" for the replicas of services whose spares pause, 9p for
    # those whose spares hibernate (QEMU 7.2 cannot save a guest with virtiofs); "9p" for
    # every guest.
    guest_share: str = "virtiofs"


PLACEMENTS = ("spread", "rotate")
CONTROLDS = ("local", "hosts")
CLIENT_SIGNATURES = ("retransmit", "always")
DURABILITY = ("fsync", "write", "off")
GUEST_SHARES = ("virtiofs", "9p")


def placement_shift(placement: str, index: int, services: int, hosts: int) -> int:
    """How many hosts service `index` of `services` is rotated by. "rotate" shifts each
    service by one host (ZZ Table 2: even when the services are a multiple of the hosts,
    crowding the first hosts otherwise); "spread" gives each of fewer services than
    hosts an equal share of the ring, so the load stays within one replica of even."""
    if placement == "rotate" or services >= hosts:
        return index % hosts
    return index * hosts // services


@dataclass(frozen=True)
class Host:
    index: int
    name: str
    address: str
    libvirt_uri: str = "qemu:///system"
    # controld's RPC port (docs/controld.md); default 7000 + index.
    control_port: int = 7000
    # controld's Prometheus /metrics port (docs/monitoring.md); default 9700 + index, 0: none.
    metrics_port: int = 0

    @property
    def metrics_url(self) -> str | None:
        """Where controld serves /metrics (None: metrics_port 0, switched off)."""
        if not self.metrics_port:
            return None
        addr = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{addr}:{self.metrics_port}/metrics"


@dataclass(frozen=True)
class Service:
    index: int
    name: str
    id: int
    g: int
    f: int
    active: int
    sleep: str
    app: str
    clients: int
    base_port: int
    # Fault detection timer K·t1 clamped to [floor, ceiling] (docs/fault-detection.md §6).
    # The floor is 500 ms: at 50 ms a correct replica slowed by load was late often enough
    # to be convicted (bench-results/detection.json).
    detect_k: int = 4
    detect_floor_ms: int = 500
    detect_ceiling_ms: int = 5000
    # Hosts this service's replicas are rotated by (placement_shift); agreement replica r
    # is on host (r + shift) % H, execution replica i on (i + shift + 1) % H.
    shift: int = 0

    @property
    def n(self) -> int:
        """Agreement replicas: 3g+1."""
        return 3 * self.g + 1

    @property
    def exec_replicas(self) -> int:
        """Execution replicas with keys: f+1 active + f sleeping, more if `active` asks."""
        return max(2 * self.f + 1, self.active)

    @property
    def n_exec(self) -> int:
        """Execution replicas 0 .. n_exec-1 (same as exec_replicas)."""
        return self.exec_replicas

    @property
    def uses_execution_replicas(self) -> bool:
        """Whether the app runs on execution replicas. The built-in echo state machine
        runs inside the agreement replicas, and clients take their replies."""
        return self.app != "echo"

    def exec_host(self, config: Config, i: int) -> Host:
        """Execution replica i sits one host further than agreement replica i, so that
        with several hosts replica i's agreement and execution halves are apart."""
        self._check_exec(i)
        return _exec_host(config.hosts, self, i)

    def exec_address(self, config: Config, i: int) -> tuple[str, int]:
        return self.exec_host(config, i).address, self.base_port + EXEC_PORT_OFFSET + i

    def exec_addresses(self, config: Config) -> list[tuple[str, int]]:
        """Where execution replica i listens, for i in 0 .. n_exec-1."""
        return [self.exec_address(config, i) for i in range(self.n_exec)]

    def exec_state_dir(self, config: Config, i: int) -> Path:
        """Execution replica i's working state: run_dir/s<id>/exec-<i>."""
        self._check_exec(i)
        return config.rack.run_dir / f"s{self.id}" / f"exec-{i}"

    def exec_status_path(self, config: Config, i: int) -> Path:
        """Execution replica i's status JSON: next to its state dir (run/s<id>/exec-<i>
        .status.json), or inside it (GUEST_STATUS) when the replica runs in a guest, whose
        only writable host directory is its share."""
        state = self.exec_state_dir(config, i)
        inside = state / GUEST_STATUS
        return inside if inside.exists() else state.with_name(f"{state.name}.status.json")

    def _check_exec(self, i: int) -> None:
        if not 0 <= i < self.n_exec:
            raise ValueError(f"{self.name}: no execution replica {i} (0..{self.n_exec - 1})")


def _exec_host(hosts: list[Host], service: Service, i: int) -> Host:
    return hosts[(i + service.shift + 1) % len(hosts)]


@dataclass(frozen=True)
class Config:
    path: Path
    rack: Rack
    hosts: list[Host] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)

    def service(self, key: str | int) -> Service:
        """Look a service up by name or id (an all-digit string counts as an id)."""
        for s in self.services:
            if s.name == key or s.id == key or (isinstance(key, str) and key == str(s.id)):
                return s
        raise ConfigError(f"services: no service named or numbered {key!r}")

    def replica_address(self, service: Service, r: int) -> tuple[str, int]:
        """Where agreement replica r listens: spread over hosts, shifted per service."""
        return self.replica_host(service, r).address, service.base_port + r

    def replica_host(self, service: Service, r: int) -> Host:
        return self.hosts[(r + service.shift) % len(self.hosts)]

    def viewed_from(self, loopback_alias: str | None = None, key_dir: Path | None = None) -> Config:
        """The rack as a process elsewhere sees it: inside a guest on QEMU user networking
        the host's 127.0.0.1 is `loopback_alias` (10.0.2.2), and the keys sit where the
        guest's share puts them. Non-loopback addresses are reachable as they are."""
        hosts = self.hosts
        if loopback_alias is not None:
            hosts = [
                replace(h, address=loopback_alias) if is_loopback(h.address) else h for h in hosts
            ]
        rack = self.rack if key_dir is None else replace(self.rack, key_dir=key_dir)
        return replace(self, rack=rack, hosts=hosts)


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


class _Table:
    """Typed accessors over one TOML table that remember which keys were consumed."""

    def __init__(self, data: Any, path: str) -> None:
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: must be a table")
        self.data = data
        self.path = path
        self.seen: set[str] = set()

    def _get(self, key: str, required: bool) -> Any:
        self.seen.add(key)
        if key not in self.data:
            if required:
                raise ConfigError(f"{self.fp(key)}: required")
            return None
        return self.data[key]

    def fp(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get_int(
        self, key: str, default: int | None = None, lo: int | None = None, hi: int | None = None
    ) -> int:
        v = self._get(key, default is None)
        if v is None:
            assert default is not None
            return default
        # bool is an int subclass in Python; TOML `true` must not pass as 1.
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"{self.fp(key)}: must be an integer{_range(lo, hi)}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise ConfigError(f"{self.fp(key)}: must be an integer{_range(lo, hi)}, got {v}")
        return v

    def get_str(
        self, key: str, default: str | None = None, pattern: re.Pattern[str] | None = None
    ) -> str:
        v = self._get(key, default is None)
        if v is None:
            assert default is not None
            return default
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{self.fp(key)}: must be a non-empty string")
        if pattern is not None and not pattern.fullmatch(v):
            raise ConfigError(f"{self.fp(key)}: must match {pattern.pattern}, got {v!r}")
        return v

    def finish(self) -> None:
        extra = sorted(set(self.data) - self.seen)
        if extra:
            raise ConfigError(f"{self.fp(extra[0])}: unknown key")


def _range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f" in {lo}..{hi}"
    if lo is not None:
        return f" >= {lo}"
    return ""


# A DNS host name (RFC 1123): dot-separated labels of letters, digits and inner hyphens.
_HOST_LABEL_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
# libvirt's URI form driver[+transport]://[user@][host][:port]/[path][?params]
# (https://libvirt.org/uri.html); the transports it knows.
_LIBVIRT_SCHEME_RE = re.compile(r"[a-z][a-z0-9]*(?:\+(tls|tcp|ssh|libssh|libssh2|unix|ext))?")


def _check_address(t: _Table, address: str) -> str:
    """An IPv4 or IPv6 address, or a DNS host name: what the daemons bind to and connect
    to. `rack plan` refuses a URL, a host:port or a path rather than a daemon failing later."""
    try:
        ipaddress.ip_address(address)
        return address
    except ValueError:
        pass
    labels = address.removesuffix(".").split(".")
    ok = len(address) <= 253 and all(_HOST_LABEL_RE.fullmatch(x) for x in labels)
    # All-numeric labels are a mistyped IPv4 address (1.2.3, 10.0.0.256), not a name.
    if not ok or all(x.isdigit() for x in labels):
        raise ConfigError(
            f"{t.fp('address')}: must be an IPv4 or IPv6 address or a host name, got {address!r}"
        )
    return address


def _check_libvirt_uri(t: _Table, uri: str) -> str:
    """driver[+transport]://[user@][host][:port]/[path][?params], e.g. qemu:///system,
    qemu+ssh://root@h1/system, test:///default (https://libvirt.org/uri.html)."""
    why = ""
    try:
        parts = urllib.parse.urlsplit(uri)
        _ = parts.port  # ValueError on a port that is not a number in 0..65535
    except ValueError as e:
        parts, why = None, f" ({e})"
    if (
        parts is None
        or not _LIBVIRT_SCHEME_RE.fullmatch(parts.scheme)
        or not uri.startswith(f"{parts.scheme}://")
        or any(c.isspace() for c in uri)
        or parts.fragment
    ):
        raise ConfigError(
            f"{t.fp('libvirt_uri')}: must be a libvirt URI driver[+transport]://[host]/path"
            f" (e.g. qemu:///system, qemu+ssh://root@h1/system), got {uri!r}{why}"
        )
    return uri


def _check_app(t: _Table, app: str) -> str:
    """An app the catalogue knows (zz/appspec.py), so `rack plan` refuses what the runtime
    would refuse only once started."""
    try:
        get_spec(app)
    except AppRegistryError as e:
        raise ConfigError(f"{t.fp('app')}: {e}") from None
    return app


def _array(data: dict[str, Any], key: str) -> list[Any]:
    v = data.get(key, [])
    if not isinstance(v, list):
        raise ConfigError(f"{key}: must be an array of tables ([[{key}]])")
    return v


def parse(data: dict[str, Any], path: Path) -> Config:
    """Validate an already parsed TOML document; `path` anchors relative directories."""
    top = _Table(data, "")
    base = path.parent

    rt = _Table(top._get("rack", True), "rack")
    cp = rt.get_int("checkpoint_interval", 128, lo=1, hi=U32_MAX)
    rack = Rack(
        name=rt.get_str("name", pattern=_NAME_RE),
        key_dir=(base / rt.get_str("key_dir", "keys")).resolve(),
        run_dir=(base / rt.get_str("run_dir", "run")).resolve(),
        checkpoint_interval=cp,
        log_window=rt.get_int("log_window", 2 * cp, lo=cp, hi=U32_MAX),
        batch_max=rt.get_int("batch_max", 400, lo=1, hi=MAX_LIST),
        view_timeout_ms=rt.get_int("view_timeout_ms", 1000, lo=1, hi=MAX_TIMER_MS),
        max_inflight=rt.get_int("max_inflight", lo=1, hi=U32_MAX)
        if "max_inflight" in rt.data
        else None,
        status_interval_ms=rt.get_int("status_interval_ms", 200, lo=1, hi=MAX_TIMER_MS),
        time_tolerance_ms=rt.get_int("time_tolerance_ms", 10000, lo=1, hi=MAX_TIMER_MS),
        placement=rt.get_str("placement", "spread"),
        max_request=rt.get_int("max_request", 1 << 20, lo=MIN_MAX_REQUEST),
        batch_bytes=rt.get_int("batch_bytes", 4 << 20, lo=MIN_MAX_REQUEST + BATCH_HDR_LEN + 4),
        client_signatures=rt.get_str("client_signatures", "retransmit"),
        durability=rt.get_str("durability", "off"),
        controlds=rt.get_str("controlds", "local"),
        guest_share=rt.get_str("guest_share", "virtiofs"),
    )
    if rack.batch_bytes > MAX_BATCH_BYTES:
        raise ConfigError(
            f"rack.batch_bytes: at most {MAX_BATCH_BYTES} (the frame limit less a log reply's"
            f" share and the overhead), got {rack.batch_bytes}"
        )
    if rack.max_request + BATCH_HDR_LEN + 4 > rack.batch_bytes:
        raise ConfigError(
            f"rack.max_request: {rack.max_request} does not fit batch_bytes {rack.batch_bytes}"
            f" (a batch of one needs {BATCH_HDR_LEN + 4} bytes more)"
        )
    if rack.client_signatures not in CLIENT_SIGNATURES:
        raise ConfigError(
            f"rack.client_signatures: must be one of {', '.join(CLIENT_SIGNATURES)},"
            f" got {rack.client_signatures!r}"
        )
    if rack.durability not in DURABILITY:
        raise ConfigError(
            f"rack.durability: must be one of {', '.join(DURABILITY)}, got {rack.durability!r}"
        )
    if rack.controlds not in CONTROLDS:
        raise ConfigError(
            f"rack.controlds: must be one of {', '.join(CONTROLDS)} (local: `zz rack up` starts"
            " every host's controld on this machine; hosts: each runs on its host, started"
            f" there), got {rack.controlds!r}"
        )
    if rack.guest_share not in GUEST_SHARES:
        raise ConfigError(
            f"rack.guest_share: must be one of {', '.join(GUEST_SHARES)}, got {rack.guest_share!r}"
        )
    if rack.placement not in PLACEMENTS:
        raise ConfigError(
            f"rack.placement: must be one of {', '.join(PLACEMENTS)}, got {rack.placement!r}"
        )
    if rack.log_window % cp:
        raise ConfigError(
            f"rack.log_window: must be a multiple of checkpoint_interval ({cp}),"
            f" got {rack.log_window}"
        )
    rt.finish()

    hosts: list[Host] = []
    raw_hosts = _array(data, "hosts")
    top.seen.add("hosts")
    if not raw_hosts:
        raise ConfigError("hosts: at least one [[hosts]] entry is required")
    names: set[str] = set()
    # Every listener on the rack, (address, port) -> who; services are checked against it too.
    used: dict[tuple[str, int], str] = {}
    for i, h in enumerate(raw_hosts):
        t = _Table(h, f"hosts[{i}]")
        name = t.get_str("name", pattern=_NAME_RE)
        if name in names:
            raise ConfigError(f"hosts[{i}].name: duplicate {name!r}")
        names.add(name)
        host = Host(
            i,
            name,
            _check_address(t, t.get_str("address")),
            _check_libvirt_uri(t, t.get_str("libvirt_uri", "qemu:///system")),
            t.get_int("control_port", 7000 + i, lo=1, hi=65535),
            t.get_int("metrics_port", 9700 + i if 9700 + i <= 65535 else 0, lo=0, hi=65535),
        )
        t.finish()
        for field_name, port in (("control_port", host.control_port),
                                 ("metrics_port", host.metrics_port)):  # fmt: skip
            addr = (host.address, port)
            if not port:
                continue  # metrics_port 0: no /metrics
            if addr in used:
                raise ConfigError(
                    f"hosts[{i}].{field_name}: port {addr[1]} on {addr[0]} already used by"
                    f" {used[addr]}"
                )
            used[addr] = f"hosts[{i}] {field_name}"
        hosts.append(host)

    services: list[Service] = []
    raw_services = _array(data, "services")
    top.seen.add("services")
    snames: set[str] = set()
    ids: set[int] = set()
    for i, s in enumerate(raw_services):
        t = _Table(s, f"services[{i}]")
        name = t.get_str("name", pattern=_NAME_RE)
        if name in snames:
            raise ConfigError(f"services[{i}].name: duplicate {name!r}")
        snames.add(name)
        sid = t.get_int("id", lo=1, hi=65535)
        if sid in ids:
            raise ConfigError(f"services[{i}].id: duplicate {sid}")
        ids.add(sid)
        g = t.get_int("g", lo=1, hi=(MAX_REPLICAS - 1) // 3)
        f = t.get_int("f", lo=0, hi=1000)
        active = t.get_int("active", f + 1, lo=f + 1, hi=3 * f + 1)
        sleep = t.get_str("sleep", "paused")
        if sleep not in ("paused", "hibernated"):
            raise ConfigError(f"services[{i}].sleep: must be 'paused' or 'hibernated'")
        app = _check_app(t, t.get_str("app", "echo"))
        clients = t.get_int("clients", 64, lo=1)
        n = 3 * g + 1
        base_port = t.get_int("base_port", lo=1, hi=65535 - n + 1)
        # Bounds as agreement/src/conf.c checks them in the replica file.
        detect_k = t.get_int("detect_k", 4, lo=1, hi=1000)
        floor = t.get_int("detect_floor_ms", 500, lo=1, hi=3600000)
        ceiling = t.get_int("detect_ceiling_ms", max(5000, floor), lo=1, hi=3600000)
        if floor > ceiling:
            raise ConfigError(
                f"services[{i}].detect_floor_ms: {floor} is above detect_ceiling_ms {ceiling}"
            )
        t.finish()
        shift = placement_shift(rack.placement, i, len(raw_services), len(hosts))
        svc = Service(
            i, name, sid, g, f, active, sleep, app, clients, base_port, detect_k, floor, ceiling,
            shift,
        )  # fmt: skip
        # An agreement replica holds keys for its peers, execution replicas and clients.
        if n + svc.exec_replicas + clients > MAX_PRINCIPALS:
            raise ConfigError(
                f"services[{i}].clients: {n} replicas + {svc.exec_replicas} execution replicas"
                f" + {clients} clients exceed {MAX_PRINCIPALS} principals"
            )
        listeners = [
            ((hosts[(r + shift) % len(hosts)].address, base_port + r), f"replica {r}")
            for r in range(n)
        ]
        # Echo services start no execution replicas, so their exec ports stay free for
        # other services; their keys still exist, for when the app changes.
        if svc.uses_execution_replicas:
            last = base_port + EXEC_PORT_OFFSET + svc.n_exec - 1
            if last > 65535:
                raise ConfigError(
                    f"services[{i}].base_port: execution replica ports up to {last} exceed 65535"
                )
            listeners += [
                (
                    (_exec_host(hosts, svc, x).address, base_port + EXEC_PORT_OFFSET + x),
                    f"execution replica {x}",
                )
                for x in range(svc.n_exec)
            ]
        for addr, who in listeners:
            if addr in used:
                raise ConfigError(
                    f"services[{i}].base_port: port {addr[1]} on {addr[0]}"
                    f" already used by {used[addr]}"
                )
            used[addr] = f"services[{i}] {who}"
        services.append(svc)
    top.finish()
    return Config(path=path.resolve(), rack=rack, hosts=hosts, services=services)


def load(path: str | Path) -> Config:
    p = Path(path)
    try:
        with p.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as e:
        raise ConfigError(f"{p}: cannot read: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from e
    return parse(data, p)
