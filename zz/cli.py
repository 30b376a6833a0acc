# zz/cli.py - the `zz` command line: keys, host, rack, client, proxy, mount, status, drill.
# Thin argparse layer: every command is a library call so tests and scripts share the code.
# PYTHON_ARGCOMPLETE_OK (argcomplete: `eval "$(register-python-argcomplete zz)"`)
"""The `zz` command (docs/operations.md "The zz command").

Exit codes: 0 success (`zz status`: healthy), 1 failure (`zz status`: degraded; a drill
that fails; a rack down that had to kill), 2 usage or config error (`zz status`: the rack
is not running), 3 a drill DEGRADED (every check passed, the throughput after recovery
stayed under half of before), 130 Ctrl-C, 141 stdout closed under us (`zz status | head -1`).
Every command takes -q (nothing on stdout but what --json asks for; errors still on
stderr) and -v (more: status adds each controld's metrics URL and last log lines; logs
at INFO, -vv DEBUG; an error shows its traceback)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import select
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from zz import __version__, keys, placement, render
from zz.client import Client, ClientParams, ClientTimeout
from zz.config import ConfigError, load


def _cmd_keys(args: argparse.Namespace) -> int:
    config = load(args.config)
    if args.operator or args.bundle or args.install:
        return _cmd_keys_operator(args, config)
    if args.rotate:
        raise ValueError("--rotate: only with --operator (a host's: zz host rotate-keys)")
    try:
        out = keys.generate(config, force=args.force)
    except FileExistsError as e:
        print(f"zz keys: {e}", file=sys.stderr)
        return 1
    n = sum(s.n + s.exec_replicas + s.clients for s in config.services)
    n += len(config.hosts) + 1  # s0: one controld per host and operator 0
    _out(args, f"wrote keys for {n} principals in {len(config.services)} services to {out}")
    return 0


def _cmd_keys_operator(args: argparse.Namespace, config: Any) -> int:
    """The operator's side of keys per host (zz/hostkeys.py, docs/security.md)."""
    from zz import hostkeys

    key_dir = config.rack.key_dir
    op = hostkeys.OPERATOR
    if args.operator:
        # --rotate renews the operator key (s0); the clients' keys stay.
        made = hostkeys.create_secrets(
            config, key_dir, op, rotate=args.rotate, services=[keys.RACK_SERVICE]
        )
        export = hostkeys.export_public(config, key_dir, op)
        verb = "rotated" if args.rotate else "made"
        _out(args, f"{verb} {len(made.created)} secrets, kept {len(made.kept)} in {key_dir}"
                   " (operator 0 and every service's clients)")  # fmt: skip
        _out(args, f"public keys: {export}")
        return 0
    if args.bundle:
        out, exports = Path(args.bundle[0]), [Path(e) for e in args.bundle[1:]]
        own = hostkeys.export_path(key_dir, op)
        if own.exists() and own.resolve() not in {e.resolve() for e in exports}:
            exports.append(own)
        bundle = hostkeys.make_bundle(config, exports)
        from zz.atomicfile import write_atomic

        write_atomic(out, bundle.text)
        _out(args, f"bundle of {len(bundle.keys)} public keys from {len(exports)} exports: {out}")
        _out(args, f"fingerprint {bundle.fingerprint} (tell each host; zz host init prints it)")
        return 0
    bundle = hostkeys.load_bundle(config, Path(args.install))
    rep = hostkeys.install_bundle(config, key_dir, op, bundle)
    what = "installed" if rep.changed else "already installed"
    _out(args, f"bundle {rep.fingerprint} {what} in {key_dir}: {len(rep.publics)} public files"
               f" and the MAC keys of {len(rep.secrets)} secrets written")  # fmt: skip
    return 0


def _host_options(args: argparse.Namespace) -> Any:
    from zz import hostinit

    return hostinit.InitOptions(
        config=Path(args.config),
        host=args.host,
        backend=args.backend,
        packages=args.packages,
        pool=args.pool,
        no_pool=args.no_pool,
        vdev=args.vdev,
        vdev_size=hostinit.parse_size(args.vdev_size),
        bundle=args.bundle,
        drill_faults=args.drill_faults,
        etc=args.etc,
        prefix=args.prefix,
    )


def _cmd_host_init(args: argparse.Namespace) -> int:
    from zz import hostinit

    report = hostinit.init(_host_options(args))
    if args.json:
        _json(report.json())
    elif not args.quiet:
        sys.stdout.write(hostinit.format_report(report))
    return 1 if report.failed else 0


def _cmd_host_rotate(args: argparse.Namespace) -> int:
    from zz import hostkeys

    config = load(args.config)
    key_dir = config.rack.key_dir
    made = hostkeys.create_secrets(config, key_dir, args.host, rotate=True)
    export = hostkeys.export_public(config, key_dir, args.host)
    _out(args, f"host {args.host}: {len(made.created)} new secrets in {key_dir} (their MAC keys"
               " follow with the next bundle)")  # fmt: skip
    for sid, p in made.rekeyed:
        _out(args, f"  kept {hostkeys.describe(config, sid, p)}: re-keyed at a conviction on"
                   " this host (its SPARE-READY announces the key)")  # fmt: skip
    for cert in made.resigned:
        _out(args, f"  signed {cert} again with the new controld key: replace its copies")
    _out(args, f"public keys: {export}: give it to the operator for a new bundle")
    return 0


def _cmd_render(args: argparse.Namespace) -> int:
    config = load(args.config)
    services = [config.service(s) for s in args.service] if args.service else config.services
    for s in services:
        for p in render.render_service(config, s):
            _out(args, str(p))
    return 0


# ---- output: -q, -v, --json --------------------------------------------------------------
USAGE, INTERRUPTED, BROKEN_PIPE = 2, 130, 141


def _out(args: argparse.Namespace, text: str) -> None:
    """A result line on stdout, unless -q."""
    if not args.quiet:
        print(text, flush=True)


def _json(doc: Any) -> None:
    print(json.dumps(doc, indent=1, default=str), flush=True)


def _progress_of(args: argparse.Namespace) -> Callable[[str], None]:
    """Progress lines: stdout, or stderr when stdout carries --json; none with -q."""
    if args.quiet:
        return lambda _line: None
    stream = sys.stderr if getattr(args, "json", False) else sys.stdout
    return lambda line: print(line, file=stream, flush=True)


def _cmd_plan(args: argparse.Namespace) -> int:
    config = load(args.config)
    try:
        p = placement.plan(config)
    except placement.PlacementError as e:
        for reason in e.reasons:
            print(f"zz rack plan: {reason}", file=sys.stderr)
        if args.json:
            _json({"rack": config.rack.name, "ok": False, "reasons": e.reasons})
        return 2
    if args.json:
        _json(placement.plan_json(p))
    elif not args.quiet:
        sys.stdout.write(placement.format_plan(p))
    return 0


async def _run_client(args: argparse.Namespace) -> int:
    config = load(args.config)
    params = ClientParams.from_config(config, args.service, args.client)
    params.initial_timeout = args.retransmit
    async with Client(params) as client:
        for op in args.op:
            data = bytes.fromhex(op) if args.hex_in else op.encode()
            result = await client.invoke(data, read_only=args.read_only, timeout=args.timeout)
            if args.hex_out:
                print(result.hex())
            else:
                print(result.decode("utf-8", errors="backslashreplace"))
        if args.stats:
            print(dict(sorted(client.stats.items())), file=sys.stderr)
    return 0


def _cmd_client(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_run_client(args))
    except ClientTimeout as e:
        print(f"zz client: timeout: {e}", file=sys.stderr)
        return 2


def _cmd_proxy(args: argparse.Namespace) -> int:
    import logging

    from zz import proxy
    from zz.http import Limits

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s zz-proxy %(message)s", stream=sys.stderr
    )
    host, port = proxy.parse_listen(args.listen)
    if args.timeout <= 0:
        raise ValueError("--timeout must be positive")
    if args.max_body < 0:
        raise ValueError("--max-body must be >= 0")
    if args.max_conns < 1 or args.max_conns_per_source < 1:
        raise ValueError("--max-conns and --max-conns-per-source must be at least 1")
    options = proxy.ProxyOptions(
        host=host,
        port=port,
        timeout=args.timeout,
        limits=Limits(max_body=args.max_body),
        read_only=not args.ordered_reads,
        max_conns=args.max_conns,
        max_conns_per_source=args.max_conns_per_source,
    )
    config = load(args.config)
    try:
        asyncio.run(proxy.serve(config, args.service, options, args.clients, args.first_client))
    except OSError as e:
        print(f"zz proxy: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_mount(args: argparse.Namespace) -> int:
    try:
        from zz import mount
    except ImportError as e:
        hint = "pip install -e '.[mount]' with Debian's fuse3, libfuse3-dev (scripts/setup.sh)"
        print(f"zz mount: {e}: {hint}", file=sys.stderr)
        return 1
    if args.timeout <= 0 or args.cache < 0:
        raise ValueError("--timeout must be positive and --cache not negative")
    if not args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s zz-mount %(message)s")
    options = mount.MountOptions(args.timeout, args.cache, args.allow_other)
    config = load(args.config)
    try:
        asyncio.run(mount.serve(config, args.service, args.mountpoint, options,
                                args.clients, args.first_client))  # fmt: skip
    except (mount.MountError, OSError, RuntimeError) as e:
        print(f"zz mount: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_umount(args: argparse.Namespace) -> int:
    from zz import mountpoints

    try:
        mountpoints.umount(args.mountpoint, lazy=args.lazy)
    except mountpoints.MountError as e:
        print(f"zz umount: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_rack_up(args: argparse.Namespace) -> int:
    from zz import rackctl

    config = load(args.config)
    t0 = time.monotonic()
    overrides = dict(_key_value(kv) for kv in args.set or [])
    old = rackctl.load_state(config) if rackctl.state_path(config).exists() else None
    try:
        # With the controlds on their hosts, what they run (zz host init) unless given.
        local = not rackctl.on_hosts(config)
        state = rackctl.up(
            config,
            backend=args.backend or ("process" if local else None),
            store=args.store or ("auto" if local else None),
            progress=_progress_of(args),
            overrides=overrides,
        )
    except rackctl.AlreadyUp as e:
        return _already_up(args, config, "up", e)
    except (rackctl.RackError, OSError) as e:
        print(f"zz rack up: {e}", file=sys.stderr)
        if args.json:
            _json({"rack": config.rack.name, "ok": False, "error": str(e)})
        return 1
    repaired = old is not None and len(state.repairs) > len(old.repairs)
    how = "repaired" if repaired else "up"
    return _rack_result(args, config, state, time.monotonic() - t0, how)


def _already_up(args: argparse.Namespace, config: Any, verb: str, e: Exception) -> int:
    from zz import rackctl

    print(f"zz rack {verb}: {e}", file=sys.stderr)
    if args.json:
        old = rackctl.load_state(config)
        _json({"rack": config.rack.name, "ok": True, "already_up": True, "message": str(e),
               "state_file": str(rackctl.state_path(config)),
               "state": old.to_json() if old else None})  # fmt: skip
    return 0


def _rack_result(args: argparse.Namespace, config: Any, state: Any, took: float, how: str) -> int:
    """What `rack up` and `rack start` print: the recorded rack, and for a repair what was
    restarted; --json: the document of docs/operations.md."""
    from zz import rackctl

    repaired = state.repairs[-1]["restarted"] if how == "repaired" else []
    if args.json:
        _json({"rack": config.rack.name, "ok": True, "already_up": False, "how": how,
               "repaired": repaired, "took_s": round(took, 1),
               "state_file": str(rackctl.state_path(config)),
               "state": state.to_json()})  # fmt: skip
        return 0
    _out(args, rackctl.format_state(state))
    for line in repaired:
        _out(args, f"repaired: {line}")
    _out(args, f"rack {config.rack.name!r} {how} in {took:.1f} s;"
               f" state in {rackctl.state_path(config)}")  # fmt: skip
    _out(args, f"`zz rack stop {args.config}` stops it keeping its state,"
               f" `zz rack down {args.config}` tears it down")  # fmt: skip
    return 0


def _cmd_rack_start(args: argparse.Namespace) -> int:
    from zz import rackctl

    config = load(args.config)
    t0 = time.monotonic()
    old = rackctl.load_state(config) if rackctl.state_path(config).exists() else None
    try:
        state = rackctl.start(config, progress=_progress_of(args))
    except rackctl.AlreadyUp as e:
        return _already_up(args, config, "start", e)
    except (rackctl.RackError, OSError) as e:
        print(f"zz rack start: {e}", file=sys.stderr)
        if args.json:
            _json({"rack": config.rack.name, "ok": False, "error": str(e),
                   "cannot_continue": isinstance(e, rackctl.CannotContinue)})  # fmt: skip
        return 1
    was_alive = old is not None and (
        bool(old.alive()) or (rackctl.on_hosts(config) and old.stopped_at is None)
    )
    return _rack_result(args, config, state, time.monotonic() - t0,
                        "repaired" if was_alive else "started")  # fmt: skip


def _cmd_rack_stop(args: argparse.Namespace) -> int:
    from zz import rackctl

    config = load(args.config)
    try:
        report = rackctl.stop(config, progress=_progress_of(args))
    except (rackctl.RackError, OSError) as e:
        print(f"zz rack stop: {e}", file=sys.stderr)
        return 1
    if args.json:
        _json({"rack": config.rack.name, "clean": report.clean, "stopped": report.stopped,
               "killed": report.killed, "leftovers": report.leftovers,
               "domains": report.domains, "kept": report.kept,
               "nothing": report.nothing})  # fmt: skip
    return 0 if report.clean else 1


def _key_value(text: str) -> tuple[str, int | str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"--set {text!r}: expected KEY=VALUE")
    return key, int(value) if value.isdigit() else value


def _cmd_rack_down(args: argparse.Namespace) -> int:
    from zz import rackctl

    config = load(args.config)
    try:
        report = rackctl.down(
            config, progress=_progress_of(args), purge_forensics=args.purge_forensics
        )
    except (rackctl.RackError, OSError) as e:
        print(f"zz rack down: {e}", file=sys.stderr)
        return 1
    if args.json:
        _json({"rack": config.rack.name, "clean": report.clean, **vars(report)})
    return 0 if report.clean else 1


def _cmd_drill(args: argparse.Namespace) -> int:
    from zz import drill

    return drill.main_cli(args, _progress_of(args))


def _cmd_bench(args: argparse.Namespace) -> int:
    import subprocess

    from zz.procrack import REPO

    script = REPO / "scripts" / "bench" / args.name
    if not script.exists():
        print(f"zz bench: {script} does not exist (not built yet)", file=sys.stderr)
        return 2
    # Run it as its shebang says; one not marked executable is a bash script.
    cmd = [str(script)] if os.access(script, os.X_OK) else ["bash", str(script)]
    return subprocess.call([*cmd, *args.args], cwd=REPO)


def _cmd_status(args: argparse.Namespace) -> int:
    """Exit 0 healthy, 1 degraded, 2 not running (zz/status.py `assess`)."""
    from zz import rackctl
    from zz import status as st

    config = load(args.config)
    controlds = rackctl.controld_statuses(config, timeout=args.timeout)
    alive, recorded = rackctl.recorded(config)
    rows = st.rack_status(config, args.stale_after, controlds, rackctl.down_time(config))
    health = st.assess(config, rows, controlds, recorded_alive=alive)
    if args.json:
        _json(st.status_document(config, rows, controlds, health, recorded))
    elif not args.quiet:
        stopped_at = (recorded or {}).get("stopped_at")
        print(st.format_status(config, rows, controlds, health, args.stale_after, args.verbose,
                               stopped_at))  # fmt: skip
    return health.code


def _cmd_audit_verify(args: argparse.Namespace) -> int:
    from zz import audit

    config = load(args.config)
    if args.json:
        doc, rc = audit.verify_json(config, host=args.host, path=args.log)
        _json(doc)
        return rc
    out = (lambda _line: None) if args.quiet else print
    return audit.verify_command(config, host=args.host, path=args.log, out=out)


def _cmd_audit_show(args: argparse.Namespace) -> int:
    from zz import audit

    config = load(args.config)
    if args.json:
        doc, rc = audit.show_json(config, args.service, host=args.host, path=args.log)
        _json(doc)
        return rc
    out = (lambda _line: None) if args.quiet else print
    return audit.show_command(config, args.service, host=args.host, path=args.log, out=out)


def _verbosity(parser: argparse.ArgumentParser, top: bool) -> None:
    """-q and -v, before the command (`zz -q status`) or after it (`zz status -q`): on the
    subcommands they default to SUPPRESS, so they do not undo what was given before."""
    kw: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="nothing on stdout but what --json asks for; the exit code tells",
        **kw,
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="count",
        help="more detail (status: metrics URLs, controlds' last log lines); repeatable",
        **({"default": 0} if top else kw),
    )


def _json_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON on stdout")


class _Parser(argparse.ArgumentParser):
    """Every subcommand parser gets -q/-v (see _verbosity)."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        if self.prog != "zz":
            _verbosity(self, top=False)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="zz",
        description="ZZ: Byzantine-fault-tolerant hosting control plane.",
        epilog="Exit codes: 0 success (status: healthy), 1 failure (status: degraded),"
        " 2 usage or config error (status: rack not running), 130 interrupted."
        ' Shell completion: eval "$(register-python-argcomplete zz)".',
    )
    _verbosity(ap, top=True)
    ap.add_argument("--version", action="version", version=f"zz {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    k = sub.add_parser(
        "keys",
        help="generate the rack key directory",
        description="Generate MAC and Ed25519 keys for every principal of every service "
        "into the config's key_dir (docs/config.md): a rack on one machine. Keys per host "
        "(docs/security.md): --operator makes the operator's own, --bundle joins the hosts' "
        "exports, --install installs a bundle.",
    )
    k.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
    k.add_argument("--force", action="store_true", help="replace an existing key directory")
    kmode = k.add_mutually_exclusive_group()
    kmode.add_argument(
        "--operator",
        action="store_true",
        help="keys per host: make only the operator's secrets (operator 0, every client)"
        " here, and key_dir/operator.pub",
    )
    kmode.add_argument(
        "--bundle",
        nargs="+",
        metavar=("OUT", "EXPORT"),
        help="keys per host: join the hosts' exports (<host>.pub files; key_dir/operator.pub"
        " is added) into the bundle OUT and print its fingerprint",
    )
    kmode.add_argument(
        "--install",
        metavar="BUNDLE",
        help="keys per host: install a bundle on the operator's machine (public files,"
        " derived MAC keys)",
    )
    k.add_argument("--rotate", action="store_true", help="with --operator: new secrets")
    k.set_defaults(func=_cmd_keys)

    ho = sub.add_parser(
        "host",
        help="prepare this machine as a host of a rack",
        description="A host's own side (docs/operations.md \"Four real hosts\").",
    )
    hsub = ho.add_subparsers(dest="host_command", required=True, metavar="COMMAND")
    hi = hsub.add_parser(
        "init",
        help="packages, ZFS pool, libvirt access, this host's keys, controld's unit env",
        description="Prepare this machine as host NAME of the rack: every step says done, ok"
        " (already so), skipped or FAILED; a second run changes nothing.",
    )
    hi.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
    hi.add_argument("--host", required=True, help="this machine's name in the config's hosts")
    hi.add_argument("--backend", default="libvirt", help="libvirt (default) or process")
    hi.add_argument(
        "--packages", default="check", help="check (default), install (apt-get, as root) or skip"
    )
    hi.add_argument("--pool", help="ZFS pool name (default zz<rack>h<index>, as zz rack up)")
    hi.add_argument("--no-pool", action="store_true", help="no ZFS pool: the directory store")
    hi.add_argument(
        "--vdev", type=Path, help="the pool's vdev: a file (made sparse) or a block device"
        " (default run_dir/zfs/<host>.img)",
    )  # fmt: skip
    hi.add_argument("--vdev-size", default="8G", help="size of a new vdev file (default 8G)")
    hi.add_argument("--bundle", type=Path, help="the operator's key bundle to install")
    hi.add_argument(
        "--etc", type=Path, default=Path("/etc/zz"), help="where controld-<host>.env goes"
    )
    hi.add_argument(
        "--prefix", type=Path, default=Path("/opt/zz"), help="the install (bin/zz-agreed)"
    )
    hi.add_argument(
        "--drill-faults",
        action="store_true",
        help="controld lets `zz drill` switch and crash this host's runtimes (a drill"
        " ground; never on a production host)",
    )
    _json_flag(hi, "the steps")
    hi.set_defaults(func=_cmd_host_init)
    hr = hsub.add_parser(
        "rotate-keys",
        help="new secrets for this host's principals (then a new bundle, installed everywhere)",
        description="Replace the secrets of every principal placed on this host with fresh"
        " ones and export their public keys (docs/security.md \"Key rotation\").",
    )
    hr.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
    hr.add_argument("--host", required=True, help="this machine's name in the config's hosts")
    hr.set_defaults(func=_cmd_host_rotate)

    rack = sub.add_parser("rack", help="rack-wide operations", description="Rack operations.")
    rsub = rack.add_subparsers(dest="rack_command", required=True, metavar="COMMAND")
    r = rsub.add_parser(
        "render",
        help="write run/s<id>/agreed-<r>.conf for every agreement replica",
        description="Render the zz-agreed replica files from the rack config.",
    )
    r.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
    r.add_argument("--service", action="append", help="only this service (name or id); repeatable")
    r.set_defaults(func=_cmd_render)
    pl = rsub.add_parser(
        "plan",
        help="show which host carries each replica, and the load per host",
        description="Place every agreement and execution replica of every service "
        "(at most one of each per service per host, docs/placement.md) and print the "
        "host x service table with the load per host. Exit 2 if the rack cannot.",
    )
    pl.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
    _json_flag(pl, "the hosts with their replicas and every replica's host and port")
    pl.set_defaults(func=_cmd_plan)
    ru = rsub.add_parser(
        "up",
        help="bring the planned rack up (its controlds on this machine, or on their hosts)",
        description="Keys if missing, replica files, one controld per host, every agreement"
        " replica, every execution replica through its host's controld (active ones running,"
        " spares paused or hibernated); recorded in run/rack.json (docs/operations.md)."
        " A rack that is up is left alone; one with dead members is repaired. With"
        ' rack.controlds = "hosts" the controlds run on their hosts already and only these'
        " are asked (docs/config.md).",
    )
    ru.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
    ru.add_argument(
        "--backend",
        choices=("process", "libvirt"),
        help="replicas as processes (default) or libvirt VMs; with rack.controlds ="
        ' "hosts" the backend the hosts\' controlds run (given: it must be that)',
    )
    ru.add_argument(
        "--store",
        choices=("auto", "dir", "zfs"),
        help="checkpoint store: a ZFS pool per host (auto, the default, where zpool works;"
        ' else directories, saying why) or as given; with rack.controlds = "hosts" the'
        " store the hosts' controlds run",
    )
    ru.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="replica-file setting for every zz-agreed (e.g. detect_floor_ms=500); repeatable",
    )
    _json_flag(ru, "the recorded rack (run/rack.json); progress goes to stderr")
    ru.set_defaults(func=_cmd_rack_up)
    rd = rsub.add_parser(
        "down",
        help="tear the rack down completely",
        description="Stop everything run/rack.json records (controlds destroy their"
        " replicas), kill leftovers naming the rack's files, destroy zz-<rack>-* domains and"
        " the rack's ZFS pools. Exit 1 if something had to be killed.",
    )
    rd.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
    rd.add_argument(
        "--purge-forensics",
        action="store_true",
        help="also delete the kept states of convicted replicas (exec-*.forensic-*)",
    )
    _json_flag(rd, "what was stopped, killed, destroyed, deleted and kept")
    rd.set_defaults(func=_cmd_rack_down)
    rs = rsub.add_parser(
        "stop",
        help="stop every process and guest of the rack, keeping all its state",
        description="Stop the controlds (their replicas with them), the rack's guests and the"
        " agreement replicas; keep keys, execution state, ZFS pools, inventories, logs and"
        " forensic states; run/rack.json is marked stopped (docs/operations.md).",
    )
    rs.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
    _json_flag(rs, "what was stopped and what was kept")
    rs.set_defaults(func=_cmd_rack_stop)
    rst = rsub.add_parser(
        "start",
        help="bring a stopped rack back from disk (or repair one with dead members)",
        description="Start the controlds on their inventories, the agreement replicas and"
        " every execution replica on its state directory, with the same keys. Refused, with"
        " the reason, when a service would not continue its sequence numbers"
        " (docs/operations.md).",
    )
    rst.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
    _json_flag(rst, "the recorded rack (run/rack.json); progress goes to stderr")
    rst.set_defaults(func=_cmd_rack_start)

    from zz.drill import KINDS, add_arguments

    dr = sub.add_parser(
        "drill",
        help="inject a fault into a running rack under load and report",
        description="Run KV load on a service of a rack that is up, inject the fault, watch,"
        " and write run/drills/<kind>-<time>/report.json + timeline.png (docs/operations.md)."
        " Kinds: " + ", ".join(KINDS) + ". Exit 0 PASS, 1 FAIL, 3 DEGRADED (every check"
        " passed, but the throughput in the last 5 s of the watch stayed under 50% of the"
        " throughput before the fault), 2 refused to start.",
    )
    add_arguments(dr)
    _json_flag(dr, "the report (report.json's content and its paths); progress goes to stderr")
    dr.set_defaults(func=_cmd_drill)

    be = sub.add_parser(
        "bench",
        help="run a benchmark of scripts/bench",
        description="Run scripts/bench/NAME with the remaining arguments (e.g. --quick).",
    )
    be.add_argument(
        "name",
        choices=(
            "wakeup",
            "recovery",
            "replay",
            "execution",
            "agreement",
            "detection",
            "checkpoint",
            "byzantine",
            "powerloss",
            "guestbook-reads",
            "files",
            "web",
            "hostfail",
        ),
    )
    be.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script")
    be.set_defaults(func=_cmd_bench)

    c = sub.add_parser(
        "client",
        help="invoke operations on a service and print the results",
        description="Send each OP as one request, in order, and print each result.",
    )
    c.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
    c.add_argument("service", metavar="SERVICE", help="service name or id")
    c.add_argument("op", metavar="OP", nargs="+", help="operation (UTF-8 text, or hex with --hex)")
    c.add_argument("--client", type=int, default=0, help="client index (default 0)")
    c.add_argument("--read-only", action="store_true", help="try the read-only fast path")
    c.add_argument("--timeout", type=float, default=30.0, help="seconds per operation")
    c.add_argument("--retransmit", type=float, default=0.5, help="first retransmission timeout (s)")
    c.add_argument("--hex", dest="hex_in", action="store_true", help="OPs are hex")
    c.add_argument("--hex-out", action="store_true", help="print results as hex")
    c.add_argument("--stats", action="store_true", help="print client counters to stderr")
    c.set_defaults(func=_cmd_client)

    p = sub.add_parser(
        "proxy",
        help="serve a WSGI service over HTTP/1.1",
        description="HTTP front of a BFT web app: each request becomes one ordered op, "
        "answered once f+1 replicas agree on the reply (docs/proxy.md).",
    )
    p.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
    p.add_argument("service", metavar="SERVICE", help="service name or id (a wsgi:* app)")
    p.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT (default %(default)s)")
    p.add_argument(
        "--clients", type=int, help="client principals to use (default 8, or all if fewer)"
    )
    p.add_argument("--first-client", type=int, default=0, help="first client index (default 0)")
    p.add_argument(
        "--timeout", type=float, default=30.0, help="seconds per request before 504 (default 30)"
    )
    p.add_argument(
        "--max-body", type=int, default=8 << 20, help="request body limit in bytes (default 8 MiB)"
    )
    p.add_argument(
        "--ordered-reads", action="store_true", help="never try GET/HEAD on the read-only path"
    )
    p.add_argument(
        "--max-conns", type=int, default=1024, help="open connections in total (default 1024)"
    )
    p.add_argument(
        "--max-conns-per-source",
        type=int,
        default=256,
        help="open connections from one address (default 256)",
    )
    p.set_defaults(func=_cmd_proxy)

    mo = sub.add_parser(
        "mount",
        help="mount a files service with FUSE (docs/files.md)",
        description="Serve a files service at MOUNTPOINT until it is unmounted: every file "
        "operation is a BFT request, answered once f+1 replicas agree (docs/files.md).",
    )
    mo.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
    mo.add_argument("service", metavar="SERVICE", help="service name or id (app files)")
    mo.add_argument("mountpoint", metavar="MOUNTPOINT", help="an existing directory")
    mo.add_argument("--timeout", type=float, default=30.0,
                    help="seconds per operation, then ETIMEDOUT (default 30)")  # fmt: skip
    mo.add_argument("--cache", type=float, default=1.0,
                    help="seconds the kernel keeps names and attributes (default 1)")  # fmt: skip
    mo.add_argument("--clients", type=int, help="client principals to use (default 4)")
    mo.add_argument("--first-client", type=int, default=0, help="first client index (default 0)")
    mo.add_argument("--allow-other", action="store_true", help="let other users in (FUSE option)")
    mo.set_defaults(func=_cmd_mount)
    um = sub.add_parser("umount", help="unmount a zz mount", description="Unmount a zz mount.")
    um.add_argument("mountpoint", metavar="MOUNTPOINT")
    um.add_argument("--lazy", action="store_true", help="detach now, clean up when not busy")
    um.set_defaults(func=_cmd_umount)

    st = sub.add_parser(
        "status",
        help="every replica's role, host, state, checkpoint and faults; exit 0/1/2",
        description="Read the stats files the replicas rewrite every second (run_dir of the"
        " rack config), ask every host's controld for its status, and print one line per"
        " replica: role (primary/backup, active/sleeping), host, state (up, down = no fresh"
        " stats, view change, or a spare's state in its controld), checkpoint (agreement:"
        " stable seq; execution: stable/last) and faults seen; one line per controld; then"
        " the verdict. Exit 0 healthy, 1 degraded (a replica down, a spare missing, a"
        " controld not answering), 2 not running.",
    )
    st.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
    st.add_argument(
        "--stale-after",
        type=float,
        default=5.0,
        help="seconds after which a stats file counts as a dead replica (default 5)",
    )
    st.add_argument(
        "--timeout",
        type=float,
        default=3.0,
        help="seconds to wait for each controld's answer (default 3)",
    )
    st.add_argument(
        "--json",
        action="store_true",
        help="print JSON: the verdict and its problems, the replicas, each controld's answer"
        " and each host's metrics URL (docs/operations.md)",
    )
    st.set_defaults(func=_cmd_status)

    au = sub.add_parser(
        "audit",
        help="check and read the controlds' audit logs of certificates",
        description="Every WAKEUP, SHUTDOWN and SPARE-READY a controld received or sent,"
        " accepted or refused, is in its hash-chained run/controld/<host>/audit.log"
        " (docs/audit.md).",
    )
    asub = au.add_subparsers(dest="audit_command", required=True, metavar="COMMAND")
    av = asub.add_parser(
        "verify",
        help="walk every chain and verify every certificate again with the rack's keys",
        description="Walk each host's audit log, check the hash chain and every signature"
        " again with the rack's public keys (offline), print who was woken and convicted and"
        " on which fault statements. Exit 1 on a broken chain or an entry logged as accepted"
        " that does not verify, naming the entry.",
    )
    ash = asub.add_parser(
        "show",
        help="the story of a service: rounds, wake-ups, convictions, signatures",
        description="Print a service's certificates from every host's audit log in time"
        " order, by round: who was woken on whose fault statements, who was convicted on"
        " whose signatures, the fresh spares announced, what was refused and why.",
    )
    for a in (av, ash):
        a.add_argument("config", metavar="CONFIG", help="rack config (TOML)")
        a.add_argument("--host", help="only this host's log")
        a.add_argument("--log", type=Path, help="read this file (a copied audit.log) instead")
        _json_flag(a, "the entries and findings")
    ash.add_argument("--service", required=True, help="service name or id")
    av.set_defaults(func=_cmd_audit_verify)
    ash.set_defaults(func=_cmd_audit_show)

    cd = sub.add_parser(
        "controld",
        help="run a host's controld, or `zz controld call ...` to ask one",
        description="Everything after `controld` goes to python -m zz.controld"
        " (docs/controld.md): `zz controld --config RACK --host NAME` runs the daemon,"
        " `zz controld call --config RACK --host NAME status` asks it.",
        add_help=False,
    )
    cd.add_argument("args", nargs=argparse.REMAINDER)
    cd.set_defaults(func=_cmd_controld)
    return ap


def _cmd_controld(args: argparse.Namespace) -> int:
    from zz.controld.__main__ import main as controld_main

    return controld_main(args.args)


def _complete(
    parser: argparse.ArgumentParser,
    output_stream: Any = None,
    exit_method: Callable[[int], Any] = os._exit,
) -> None:
    """Shell completion (argcomplete): acts only when the shell's completion hook runs
    `zz` (_ARGCOMPLETE set), prints the candidates and exits; else returns at once. A
    rack config argument completes *.toml files."""
    if "_ARGCOMPLETE" not in os.environ:
        return
    import argcomplete
    from argcomplete.completers import FilesCompleter

    toml = FilesCompleter(allowednames=("toml",), directories=True)
    todo = [parser]
    while todo:
        p = todo.pop()
        for action in p._actions:
            if action.dest == "config":
                action.completer = toml  # type: ignore[attr-defined]
            if isinstance(action, argparse._SubParsersAction):
                todo += list(action.choices.values())
    argcomplete.autocomplete(
        parser,
        always_complete_options=False,  # options once a "-" is typed
        output_stream=output_stream,
        exit_method=exit_method,
    )


def _stdout_broken() -> bool:
    """stdout is a pipe whose reader has gone (`zz status | head -1`)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush finds nothing to fail on."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _run(argv: list[str]) -> int:
    if argv[:1] == ["controld"]:  # its options (--help, --config) are controld's own
        return _cmd_controld(argparse.Namespace(args=argv[1:]))
    parser = build_parser()
    _complete(parser)
    args = parser.parse_args(argv)  # a usage error exits 2 (argparse)
    if args.verbose:
        logging.basicConfig(
            level=logging.DEBUG if args.verbose > 1 else logging.INFO,
            format="%(asctime)s %(name)s %(levelname)s %(message)s",
            stream=sys.stderr,
        )
    try:
        return int(args.func(args))
    except (ConfigError, ValueError) as e:
        # The config or an argument is wrong: a usage error.
        if args.verbose:
            logging.exception("zz")
        print(f"zz: {e}", file=sys.stderr)
        return USAGE
    except keys.KeyFileError as e:
        if args.verbose:
            logging.exception("zz")
        print(f"zz: {e}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """The `zz` entry point: the command's exit code; Ctrl-C and a closed stdout end it
    quietly (130, 141) instead of with a traceback."""
    try:
        rc = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return rc
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the ^C was echoed on
        return INTERRUPTED
    except BrokenPipeError:
        if not _stdout_broken():
            raise  # a socket, not our stdout: a real error
        _silence_stdout()
        return BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
