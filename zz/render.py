# zz/render.py - render run/s<id>/agreed-<r>.conf for zz-agreed from the rack config.
# Test harnesses call render_service() with overrides to add fault injection per replica.
from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zz import keys
from zz.atomicfile import write_atomic
from zz.config import DURABILITY, Config, ConfigError, Service

# Keys a caller may set or replace; structural keys (service, id, g, listen, peer)
# come from the rack config only, so a harness cannot render an inconsistent cluster.
OVERRIDABLE = {
    "secret",
    "public",
    "checkpoint_interval",
    "log_window",
    "batch_max",
    "max_inflight",
    "exec_inflight",
    "exec_hold_ms",
    "exec_hold_max_ms",
    "view_timeout_ms",
    "status_interval_ms",
    "time_tolerance_ms",
    "max_request",
    "batch_bytes",
    "max_conns",
    "max_conns_per_source",
    "frame_timeout_ms",
    "unauth_timeout_ms",
    "unauth_buffer_bytes",
    "client_out_bytes",
    "client_out_total",
    "out_stall_timeout_ms",
    "require_signed",
    "stats_file",
    "inject_drop",
    "inject_dup",
    "inject_delay_ms",
    "inject_seed",
    "byzantine",
    "byzantine_commits",
    "detect_k",
    "detect_floor_ms",
    "detect_ceiling_ms",
    "exec_log",
    "exec_view",
    "rack_public",
    "data_dir",
    "durability",
    "sync_threads",
    "sync_slice_us",
    "loop_slice_us",
    "inject_sync_gate",
}
BYZANTINE = ("none", "equivocate", "drop-requests", "silent", "false-fault")


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, bool):
        raise ConfigError(f"override {key}: booleans have no replica-file form")
    if key in ("inject_drop", "inject_dup"):
        if not isinstance(value, int | float) or not 0 <= value <= 1:
            raise ConfigError(f"override {key}: must be a probability in 0..1")
        return repr(float(value))
    if key == "byzantine":
        if value not in BYZANTINE:
            raise ConfigError(f"override byzantine: must be one of {', '.join(BYZANTINE)}")
        return str(value)
    if key == "byzantine_commits":
        if not isinstance(value, str) or not re.fullmatch(r"\d+:\d+-\d+:\d+(,\d+)*", value):
            raise ConfigError(f"override {key}: must be VIEW:LO-HI:PEER[,PEER...]")
        return value
    if key == "durability":
        if value not in DURABILITY:
            raise ConfigError(f"override durability: must be one of {', '.join(DURABILITY)}")
        return str(value)
    paths = (
        "secret",
        "public",
        "stats_file",
        "exec_view",
        "rack_public",
        "spare_keys",
        "data_dir",
        "inject_sync_gate",
    )
    if key in paths:
        s = str(value)
        if not s or any(c.isspace() for c in s):
            raise ConfigError(f"override {key}: a path without whitespace is required")
        return s
    if not isinstance(value, int) or value < 0:
        raise ConfigError(f"override {key}: must be a non-negative integer")
    return str(value)


def replica_conf(
    config: Config, service: Service, r: int, overrides: Mapping[str, Any] | None = None
) -> str:
    """The text of agreed-<r>.conf. An override value that is a Mapping is per replica
    ({replica: value}); replicas absent from it keep the default."""
    rack = config.rack
    run = rack.run_dir / f"s{service.id}"
    values: dict[str, Any] = {
        "secret": keys.secret_path(rack.key_dir, service.id, r),
        "public": keys.public_path(rack.key_dir, service.id),
        "checkpoint_interval": rack.checkpoint_interval,
        "log_window": rack.log_window,
        "batch_max": rack.batch_max,
        "view_timeout_ms": rack.view_timeout_ms,
        "status_interval_ms": rack.status_interval_ms,
        "time_tolerance_ms": rack.time_tolerance_ms,
        "max_request": rack.max_request,
        "batch_bytes": rack.batch_bytes,
        "stats_file": run / f"agreed-{r}.stats.json",
    }
    if rack.max_inflight is not None:  # else zz-agreed's default, which depends on durability
        values["max_inflight"] = rack.max_inflight
    if rack.client_signatures == "always":  # only then: the default needs no line
        values["require_signed"] = 1
    if rack.durability != "off":
        # The replica's write-ahead log (docs/agreement.md "Durable state").
        values["data_dir"] = run / f"agreed-{r}.data"
        values["durability"] = rack.durability
    if service.uses_execution_replicas:
        values |= {
            # The awake/sleeping/convicted view, kept across restarts; controlds' keys
            # (keys/s0/public) verify SPARE-READY.
            "exec_view": run / f"agreed-{r}.exec-view",
            "rack_public": keys.public_path(rack.key_dir, keys.RACK_SERVICE),
            # Re-keyed slots' signed announcements (spare-p<256+i>.msg), taken at start.
            "spare_keys": keys.service_dir(rack.key_dir, service.id),
            "detect_k": service.detect_k,
            "detect_floor_ms": service.detect_floor_ms,
            "detect_ceiling_ms": service.detect_ceiling_ms,
        }
    for key, v in (overrides or {}).items():
        if key not in OVERRIDABLE:
            raise ConfigError(f"override {key}: not a replica-file key that may be overridden")
        if isinstance(v, Mapping):
            if r in v:
                values[key] = v[r]
        else:
            values[key] = v
    host, port = config.replica_address(service, r)
    lines = [
        f"# agreed-{r}.conf - generated by `zz rack render` from {config.path}; do not edit.",
        f"# Service {service.name!r}, agreement replica {r} of {service.n}.",
        f"service {service.id}",
        f"id {r}",
        f"g {service.g}",
        f"listen {host} {port}",
        # The echo app is the agreement replicas' built-in null service; any other app
        # runs on execution replicas, to which zz-agreed pushes committed batches.
        f"execution {'echo' if service.app == 'echo' else 'external'}",
        f"f {service.f}",
    ]
    for p in range(service.n):
        ph, pp = config.replica_address(service, p)
        lines.append(f"peer {p} {ph} {pp}")
    if service.uses_execution_replicas:
        # Fault detection: which execution replicas start awake (the first `active` ids),
        # where each lives, and whose controld to send WAKEUP/SHUTDOWN to.
        for i in range(service.n_exec):
            state = "active" if i < service.active else "sleeping"
            lines.append(f"exec {i} {service.exec_host(config, i).index} {state}")
        for h in config.hosts:
            lines.append(f"controld {h.index} {h.address} {h.control_port}")
    lines += [f"{k} {_fmt(k, v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


def _check_overrides(service: Service, overrides: Mapping[str, Any] | None) -> None:
    for key, v in (overrides or {}).items():
        if isinstance(v, Mapping):
            bad = [r for r in v if not isinstance(r, int) or not 0 <= r < service.n]
            if bad:
                raise ConfigError(f"override {key}: no replica {bad[0]!r} in {service.name}")


def render_service(
    config: Config, service: Service, overrides: Mapping[str, Any] | None = None
) -> list[Path]:
    """Write run/s<id>/agreed-<r>.conf for every agreement replica; returns the paths."""
    _check_overrides(service, overrides)
    texts = [replica_conf(config, service, r, overrides) for r in range(service.n)]
    return [_write_conf(config, service, r, text) for r, text in enumerate(texts)]


def render_replica(
    config: Config, service: Service, r: int, overrides: Mapping[str, Any] | None = None
) -> Path:
    """Write run/s<id>/agreed-<r>.conf of agreement replica `r` alone (controld renders the
    files of the replicas placed on its host); returns its path."""
    _check_overrides(service, overrides)
    return _write_conf(config, service, r, replica_conf(config, service, r, overrides))


def _write_conf(config: Config, service: Service, r: int, text: str) -> Path:
    out_dir = config.rack.run_dir / f"s{service.id}"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"agreed-{r}.conf"
    write_atomic(path, text)
    return path


def render_rack(config: Config) -> list[Path]:
    return [p for s in config.services for p in render_service(config, s)]
