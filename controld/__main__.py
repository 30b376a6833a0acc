# controld/__main__.py - `python -m zz.controld` (also `zz controld`): run the daemon of one
# host, or, with `call`, send it one operator RPC and print the reply.
"""controld: the per-host control daemon (docs/controld.md).

Run the daemon of host NAME:
    python -m zz.controld --config RACK.toml --host NAME [--backend libvirt|process]
Ask it something (as operator 0, key from keys/s0):
    python -m zz.controld call --config RACK.toml --host NAME status
    python -m zz.controld call --config RACK.toml --host NAME provision \
        service=web index=2 mode=paused
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from zz.audit import AuditError
from zz.config import Config, ConfigError, Host, load
from zz.controld.hypervisor import BACKENDS, HypervisorError, open_backend
from zz.controld.rpc import RACK_SERVICE, RpcError, call
from zz.keys import (
    ControldKeys,
    KeyFileError,
    controld_principal,
    load_controld,
    load_secret,
    operator_principal,
    secret_path,
)


def _host(config: Config, name: str) -> Host:
    for h in config.hosts:
        if h.name == name:
            return h
    raise ConfigError(f"--host {name!r}: not in hosts ({', '.join(h.name for h in config.hosts)})")


def default_home(config: Config, host: Host) -> Path:
    return config.rack.run_dir / "controld" / host.name


async def _run(args: argparse.Namespace) -> int:
    from zz.controld.daemon import Daemon

    config = load(args.config)
    host = _host(config, args.host)
    keys = load_controld(config.rack.key_dir, config, host.index)
    opts: dict[str, Any] = {}
    if args.backend == "libvirt":
        opts["uri"] = args.uri or host.libvirt_uri
    hv = open_backend(args.backend, **opts)
    image = args.image
    if image is None and args.backend == "libvirt" and not opts["uri"].startswith("test:"):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "images"))
        import build  # type: ignore[import-not-found]  # images/build.py: cached, fast when built

        image = (await asyncio.to_thread(build.build)).directory
    d = Daemon(
        config,
        host,
        hv,
        keys,
        args.home or default_home(config, host),
        memory_mib=args.memory_mib,
        image=image,
        store=args.store,
        zfs_pool=args.zfs_pool,
        ready_timeout=args.ready_timeout,
        drill_faults=args.drill_faults,
        agreed=args.agreed,
    )
    try:
        port = await d.start(args.port, args.metrics_port)
        print(f"controld {host.name} listening on {host.address}:{port}", flush=True)
        if d.lost or d.in_doubt_at_start:
            print(f"controld {host.name}: in doubt at start {len(d.in_doubt_at_start)},"
                  f" lost {len(d.lost)} (see status)", flush=True)  # fmt: skip
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, _reload_operators, config, host, keys)
        await stop.wait()
    finally:
        await d.stop()
        hv.close()
    return 0


def _reload_operators(config: Config, host: Host, keys: ControldKeys) -> None:
    """SIGHUP (`systemctl reload zz-controld@NAME`): read this host's keys again and take the
    operators' MAC keys from them, so an operator key rotation needs no restart
    (docs/security.md "Key rotation"). The daemon reads `keys.operators` per request. Its
    own signing key is not swapped under a running daemon: a new one needs a restart."""
    log = logging.getLogger("zz.controld")
    try:
        fresh = load_controld(config.rack.key_dir, config, host.index)
    except KeyFileError as e:
        log.error("SIGHUP: keys not reloaded, the old ones stay: %s", e)
        return
    assert fresh.secret.sign is not None and keys.secret.sign is not None
    if fresh.secret.sign.public != keys.secret.sign.public:
        log.warning("SIGHUP: this host's controld key changed: it takes effect at a restart")
    keys.operators.clear()
    keys.operators.update(fresh.operators)
    log.info("SIGHUP: operator keys reloaded (%s)", ", ".join(map(str, sorted(fresh.operators))))


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


async def _call(args: argparse.Namespace) -> int:
    config = load(args.config)
    host = _host(config, args.host)
    me = operator_principal(args.operator)
    ctl = controld_principal(host.index)
    sec = load_secret(secret_path(config.rack.key_dir, RACK_SERVICE, me))
    if ctl not in sec.macs:
        raise KeyFileError(f"operator {me} has no MAC key with controld {ctl}")
    op: dict[str, Any] = {"op": args.op}
    for kv in args.params:
        k, sep, v = kv.partition("=")
        if not sep:
            raise ValueError(f"parameter {kv!r}: expected key=value")
        op[k] = _value(v)

    def progress(body: dict[str, Any]) -> None:
        print(f"... {body.get('progress', body)}", file=sys.stderr, flush=True)

    reply = await call(
        host.address,
        args.port or host.control_port,
        operator=me,
        controld=ctl,
        key=sec.macs[ctl],
        op=op,
        timeout=args.timeout,
        progress=progress,
    )
    print(json.dumps(reply, indent=1, sort_keys=True))
    return 0 if reply.get("ok") else 1


_RAW = argparse.RawDescriptionHelpFormatter


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "call":
        p = argparse.ArgumentParser(
            prog="zz controld call", description=__doc__, formatter_class=_RAW
        )
        p.add_argument("--config", required=True, help="rack config (TOML)")
        p.add_argument("--host", required=True, help="the host whose controld to ask")
        p.add_argument("--operator", type=int, default=0, help="operator index k (default 0)")
        p.add_argument("--port", type=int, help="override the host's control_port")
        p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait")
        p.add_argument("op", help="status, list, provision, destroy, forensics, purge_forensics,"
                       " agreed_start, agreed_stop, agreed_list, agreed_log")  # fmt: skip
        p.add_argument("params", nargs="*", help="key=value (JSON values: index=2)")
        args = p.parse_args(argv[1:])
        fn = _call
    else:
        p = argparse.ArgumentParser(
            prog="python -m zz.controld", description=__doc__, formatter_class=_RAW
        )
        p.add_argument("--config", required=True, help="rack config (TOML)")
        p.add_argument("--host", required=True, help="this host's name in the config")
        p.add_argument("--backend", choices=BACKENDS, default="libvirt")
        p.add_argument("--uri", help="libvirt URI (default: the host's libvirt_uri)")
        p.add_argument("--home", type=Path, help="state directory (default run/controld/HOST)")
        p.add_argument("--port", type=int, help="override the host's control_port (0: any)")
        p.add_argument("--metrics-port", type=int,
                       help="override the host's metrics_port for /metrics (0: any)")  # fmt: skip
        p.add_argument("--memory-mib", type=int, default=512, help="a replica's full memory")
        p.add_argument("--image", type=Path, help="guest image dir (default: images/build.py)")
        p.add_argument("--store", choices=("dir", "zfs"), default="dir", help="runtime store")
        p.add_argument("--zfs-pool", help="ZFS pool of the replicas' datasets (--store zfs)")
        p.add_argument("--ready-timeout", type=float, default=60.0,
                       help="seconds a booting replica has to answer")  # fmt: skip
        p.add_argument("--drill-faults", action="store_true",
                       help="let `zz drill` switch a runtime's injected fault through"
                       " <state>/zz-fault.json (one-machine racks only)")  # fmt: skip
        p.add_argument("--agreed", type=Path,
                       help="the zz-agreed binary of this host's agreement replicas"
                       " (default agreement/build/zz-agreed)")  # fmt: skip
        p.add_argument("--log-level", default="INFO")
        args = p.parse_args(argv)
        logging.basicConfig(
            level=args.log_level.upper(),
            format=f"%(asctime)s controld-{args.host} %(levelname)s %(message)s",
            stream=sys.stderr,
        )
        fn = _run
    try:
        return asyncio.run(fn(args))
    except (ConfigError, KeyFileError, HypervisorError, RpcError, ValueError, OSError,
            AuditError) as e:  # fmt: skip
        print(f"zz controld: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
