# zz/hostinit.py - `zz host init`: prepare one machine as a host of a rack (packages, ZFS pool,
# libvirt access, its own keys, the unit's environment); idempotent, each step says what it does.
"""`zz host init CONFIG --host NAME` (docs/operations.md "Four real hosts").

Steps, in order, each reported as `done` (it changed something), `ok` (already so),
`skipped` (not asked for) or `FAILED` (with why and what to do):

1. packages: the Debian packages a host needs (HOST_PACKAGES), checked with dpkg-query;
   `--packages install` installs the missing ones with apt-get (as root);
2. pool: the host's ZFS pool (default `zz<rack>h<i>`, the name `zz rack up` gives it) on a
   vdev file (created sparse) or a block device; an existing pool on that vdev is kept,
   one the vdev holds but nobody imported is imported;
2b. mounts: `/` a shared mount (`mount --make-shared /` where it is private, as systemd
   makes it at boot): in a private `/`, each QEMU's mount-namespace copy keeps the pool's
   datasets mounted, and destroying a convicted guest's dataset fails "busy";
3. libvirt: the host's `libvirt_uri` opens and lists its domains (`--backend libvirt`);
4. keys: the secrets of the principals placed on this host, made here (zz/hostkeys.py),
   their public keys exported to `<key_dir>/<host>.pub`; with `--bundle FILE` the
   operator's bundle installed (public files, derived MAC keys);
5. unit: `<etc>/controld-<host>.env`, which the systemd unit zz-controld@<host> reads
   (ZZ_CONFIG, ZZ_CONTROLD_ARGS).

A second run with the same options changes nothing and ends `nothing to do`."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zz import hostkeys
from zz.atomicfile import write_atomic
from zz.config import Config, ConfigError, Host, load
from zz.rackctl import pool_name
from zz.snapshots.zfs import (
    StorageError,
    check_pool_name,
    create_file_pool,
    ensure_zfs_daemon,
    pool_exists,
    pool_vdevs,
    run_zfs,
)

# What a host runs: the runtimes and controld in the venv (python3, python3-venv), zz-agreed
# (libssl3), guests (QEMU, libvirt; the guest image is built from Debian's kernel and busybox),
# checkpoints (zfs-fuse; a host with OpenZFS has zfsutils-linux instead).
HOST_PACKAGES = ["python3", "python3-venv", "libssl3"]
LIBVIRT_PACKAGES = ["libvirt-daemon-system", "qemu-system-x86", "qemu-utils"]
ZFS_PACKAGES = ["zfs-fuse|zfsutils-linux"]  # either satisfies
PACKAGE_MODES = ("check", "install", "skip")
BACKENDS = ("libvirt", "process")
DEFAULT_VDEV_SIZE = 8 << 30
MIN_VDEV_SIZE = 64 << 20  # zfs-fuse refuses smaller vdevs


@dataclass
class Step:
    name: str
    status: str  # done | ok | skipped | FAILED
    detail: str


@dataclass
class InitOptions:
    """`zz host init` options, checked by check_options (errors name the option)."""

    config: Path
    host: str
    backend: str = "libvirt"
    packages: str = "check"
    pool: str | None = None  # None: pool_name(config, host); "" with no_pool
    no_pool: bool = False
    vdev: Path | None = None  # None: <run_dir>/zfs/<host>.img
    vdev_size: int = DEFAULT_VDEV_SIZE
    bundle: Path | None = None
    etc: Path = Path("/etc/zz")
    prefix: Path = Path("/opt/zz")
    # controld lets `zz drill` switch and crash its runtimes (a drill ground, not production).
    drill_faults: bool = False


@dataclass
class InitReport:
    host: str
    steps: list[Step] = field(default_factory=list)

    @property
    def failed(self) -> list[Step]:
        return [s for s in self.steps if s.status == "FAILED"]

    @property
    def changed(self) -> bool:
        return any(s.status == "done" for s in self.steps)

    def json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "ok": not self.failed,
            "changed": self.changed,
            "steps": [asdict(s) for s in self.steps],
        }


_SIZE_RE = re.compile(r"(\d+)([KMGT]?)(i?B)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`8G`, `512M`, `1073741824` -> bytes (powers of 1024)."""
    m = _SIZE_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"--vdev-size: expected a size like 8G or 512M, got {text!r}")
    return int(m.group(1)) << (10 * " KMGT".index((m.group(2) or " ").upper()))


def check_options(o: InitOptions) -> tuple[Config, Host]:
    """The config and this host; a bad option is a ValueError (or ConfigError) naming it."""
    if o.backend not in BACKENDS:
        raise ValueError(f"--backend: must be one of {', '.join(BACKENDS)}, got {o.backend!r}")
    if o.packages not in PACKAGE_MODES:
        raise ValueError(
            f"--packages: must be one of {', '.join(PACKAGE_MODES)}, got {o.packages!r}"
        )
    if o.vdev_size < MIN_VDEV_SIZE:
        raise ValueError(f"--vdev-size: at least 64M (zfs-fuse refuses less), got {o.vdev_size}")
    if o.no_pool and (o.pool or o.vdev):
        raise ValueError("--no-pool: cannot be combined with --pool or --vdev")
    if o.pool:
        try:
            check_pool_name(o.pool)
        except ValueError as e:
            raise ValueError(f"--pool: {e}") from None
    if o.bundle is not None and not o.bundle.is_file():
        raise ValueError(f"--bundle: {o.bundle} is not a file")
    for name, path in (("--etc", o.etc), ("--prefix", o.prefix)):
        if not path.is_absolute():
            raise ValueError(f"{name}: must be an absolute path, got {str(path)!r}")
    # The unit splits $ZZ_CONTROLD_ARGS at whitespace and the env file quotes with '"'.
    for name, path in (("--prefix", o.prefix), ("CONFIG", o.config.absolute())):
        if any(c.isspace() or c in '"\\$`' for c in str(path)):
            raise ValueError(f"{name}: no whitespace, quotes, '\\', '$' or '`' in {str(path)!r}")
    config = load(o.config)
    hostkeys.check_names(config)
    for h in config.hosts:
        if h.name == o.host:
            return config, h
    names = ", ".join(h.name for h in config.hosts)
    raise ConfigError(f"--host: {o.host!r} is not in the config's hosts ({names})")


# ---- 1. packages ---------------------------------------------------------------------------
def installed(package: str) -> bool:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", package],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except FileNotFoundError:
        return False
    return out.returncode == 0 and "install ok installed" in out.stdout


def missing_packages(wanted: Sequence[str], is_installed: Callable[[str], bool]) -> list[str]:
    """The entries of `wanted` none of whose alternatives (`a|b`) is installed."""
    return [w for w in wanted if not any(is_installed(p) for p in w.split("|"))]


def _packages(o: InitOptions) -> Step:
    if o.packages == "skip":
        return Step("packages", "skipped", "--packages skip")
    wanted = list(HOST_PACKAGES)
    if o.backend == "libvirt":
        wanted += LIBVIRT_PACKAGES
    if not o.no_pool:
        wanted += ZFS_PACKAGES
    missing = missing_packages(wanted, installed)
    if not missing:
        have = [next(p for p in w.split("|") if installed(p)) for w in wanted]
        return Step("packages", "ok", f"installed: {' '.join(have)}")
    names = [m.split("|")[0] for m in missing]
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *names]
    if o.packages == "check":
        return Step(
            "packages", "FAILED",
            f"missing: {' '.join(missing)}; install them (`{shlex.join(cmd)}`, or"
            " `zz host init --packages install` as root)",
        )  # fmt: skip
    if os.geteuid() != 0:
        return Step("packages", "FAILED", f"missing: {' '.join(missing)}; installing needs root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        return Step("packages", "FAILED", f"{shlex.join(cmd)} failed: {' / '.join(tail)}")
    return Step("packages", "done", f"installed {' '.join(names)}")


# ---- 2. ZFS pool ---------------------------------------------------------------------------
def _pool(o: InitOptions, config: Config, host: Host) -> Step:
    if o.no_pool:
        return Step("pool", "skipped", "--no-pool (the directory store)")
    name = o.pool or pool_name(config, host)
    vdev = (o.vdev or config.rack.run_dir / "zfs" / f"{host.name}.img").absolute()
    try:
        ensure_zfs_daemon()
        if pool_exists(name):
            vdevs = pool_vdevs(name)
            if str(vdev) in vdevs:
                return Step("pool", "ok", f"pool {name} on {vdev}")
            return Step(
                "pool", "FAILED",
                f"pool {name} exists on {', '.join(vdevs) or 'other vdevs'}, not on {vdev}:"
                " pass its --vdev, or --pool another name",
            )  # fmt: skip
        if vdev.exists() and vdev.is_file():
            # A vdev file whose pool zfs-fuse does not have now (a restarted daemon).
            run_zfs(["zpool", "import", "-d", str(vdev.parent), name])
            return Step("pool", "done", f"imported pool {name} from {vdev}")
        if vdev.exists():
            if not stat.S_ISBLK(vdev.stat().st_mode):
                return Step("pool", "FAILED", f"--vdev: {vdev} is neither a file nor a device")
            run_zfs(["zpool", "create", "-m", "none", name, str(vdev)])
            return Step("pool", "done", f"created pool {name} on device {vdev}")
        vdev.parent.mkdir(parents=True, exist_ok=True)
        create_file_pool(name, vdev, o.vdev_size)
        return Step("pool", "done", f"created pool {name} on {vdev} ({o.vdev_size >> 20} MiB)")
    except StorageError as e:
        return Step("pool", "FAILED", f"pool {name} on {vdev}: {e}")


# ---- 2b. mount propagation -----------------------------------------------------------------
MOUNTINFO = Path("/proc/self/mountinfo")


def root_is_shared(mountinfo: str) -> bool:
    """Whether `/` is a shared mount: in /proc/self/mountinfo the line whose mount point
    (field 5) is `/` has `shared:N` among its optional fields (those before ` - `). The last
    such line counts: it is the mount on top."""
    shared = False
    for line in mountinfo.splitlines():
        head, sep, _ = line.partition(" - ")
        f = head.split()
        if sep and len(f) >= 6 and f[4] == "/":
            shared = any(x.startswith("shared:") for x in f[6:])
    return shared


def _mounts(
    o: InitOptions,
    mountinfo: Path = MOUNTINFO,
    run: Callable[[list[str]], subprocess.CompletedProcess[str]] | None = None,
) -> Step:
    if o.no_pool:
        return Step("mounts", "skipped", "--no-pool (no datasets to keep unmounted)")
    if root_is_shared(mountinfo.read_text()):
        return Step("mounts", "ok", "/ is a shared mount")
    cmd = ["mount", "--make-shared", "/"]
    runner = run or (lambda c: subprocess.run(c, capture_output=True, text=True, check=False))
    got = runner(cmd)
    if got.returncode != 0:
        why = (got.stderr or got.stdout).strip() or f"exit {got.returncode}"
        return Step("mounts", "FAILED", f"/ is private and {shlex.join(cmd)} failed: {why}")
    return Step(
        "mounts", "done",
        "made / a shared mount (it was private: a QEMU's mount namespace would keep the"
        " pool's datasets mounted)",
    )  # fmt: skip


# ---- 3. libvirt ----------------------------------------------------------------------------
def _libvirt(o: InitOptions, host: Host) -> Step:
    if o.backend != "libvirt":
        return Step("libvirt", "skipped", f"--backend {o.backend}")
    try:
        import libvirt  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return Step("libvirt", "FAILED", "libvirt-python is missing (pip install 'zz[libvirt]')")
    try:
        conn = libvirt.open(host.libvirt_uri)
    except libvirt.libvirtError as e:
        return Step(
            "libvirt", "FAILED",
            f"cannot open {host.libvirt_uri}: {e} (is libvirtd running, and may this user use"
            " its socket? root, or a member of group libvirt)",
        )  # fmt: skip
    try:
        doms = conn.listAllDomains()
        version = conn.getLibVersion()
    except libvirt.libvirtError as e:
        return Step("libvirt", "FAILED", f"{host.libvirt_uri}: {e}")
    finally:
        conn.close()
    v = f"{version // 1000000}.{version // 1000 % 1000}.{version % 1000}"
    return Step("libvirt", "ok", f"{host.libvirt_uri} answers (libvirt {v}, {len(doms)} domains)")


# ---- 4. keys -------------------------------------------------------------------------------
def _keys(o: InitOptions, config: Config, host: Host) -> list[Step]:
    key_dir = config.rack.key_dir
    made = hostkeys.create_secrets(config, key_dir, host.name)
    export = hostkeys.export_path(key_dir, host.name)
    before = export.read_text() if export.exists() else None
    hostkeys.export_public(config, key_dir, host.name)
    n = len(made.created) + len(made.kept) + len(made.rekeyed)
    if made.created:
        steps = [Step("keys", "done", f"made {len(made.created)} of {n} secrets in {key_dir}")]
    else:
        steps = [Step("keys", "ok", f"{n} secrets in {key_dir}")]
    if before != export.read_text():
        steps.append(Step("public keys", "done", f"wrote {export}: give it to the operator"))
    else:
        steps.append(Step("public keys", "ok", f"{export}"))
    if o.bundle is None:
        installed_fp = hostkeys.installed_fingerprint(key_dir)
        detail = f"installed {installed_fp}" if installed_fp else "none yet (--bundle FILE)"
        steps.append(Step("bundle", "skipped", detail))
        return steps
    try:
        bundle = hostkeys.load_bundle(config, o.bundle)
        rep = hostkeys.install_bundle(config, key_dir, host.name, bundle)
    except hostkeys.HostKeyError as e:
        steps.append(Step("bundle", "FAILED", f"{o.bundle}: nothing installed: {e}"))
        return steps
    if rep.changed:
        what = f"{len(rep.publics)} public files, MAC keys of {len(rep.secrets)} secrets"
        steps.append(Step("bundle", "done", f"installed {rep.fingerprint}: {what}"))
    else:
        steps.append(Step("bundle", "ok", f"{rep.fingerprint} installed"))
    return steps


# ---- 5. the unit's environment -------------------------------------------------------------
def controld_env_path(etc: Path, host: str) -> Path:
    return etc / f"controld-{host}.env"


def controld_args(o: InitOptions, config: Config, host: Host) -> list[str]:
    args = ["--backend", o.backend]
    agreed = o.prefix / "bin" / "zz-agreed"
    if agreed.exists():  # scripts/install-host.sh puts it there
        args += ["--agreed", str(agreed)]
    if not o.no_pool:
        args += ["--store", "zfs", "--zfs-pool", o.pool or pool_name(config, host)]
    if o.drill_faults:
        args.append("--drill-faults")
    return args


def _unit_env(o: InitOptions, config: Config, host: Host) -> Step:
    path = controld_env_path(o.etc, host.name)
    text = (
        f"# {path.name} - written by `zz host init`; read by zz-controld@{host.name}.service\n"
        f'ZZ_CONFIG="{config.path}"\n'
        f'ZZ_CONTROLD_ARGS="{" ".join(controld_args(o, config, host))}"\n'
    )
    if path.exists() and path.read_text() == text:
        return Step("unit", "ok", f"{path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)
    return Step("unit", "done", f"wrote {path} (systemctl enable --now zz-controld@{host.name})")


def init(o: InitOptions) -> InitReport:
    """Run every step; a failed step does not stop the later ones (each is independent),
    so one run names everything that is missing."""
    config, host = check_options(o)
    report = InitReport(host.name)
    steps: list[tuple[str, Callable[[], Step | list[Step]]]] = [
        ("packages", lambda: _packages(o)),
        ("pool", lambda: _pool(o, config, host)),
        ("mounts", lambda: _mounts(o)),
        ("libvirt", lambda: _libvirt(o, host)),
        ("keys", lambda: _keys(o, config, host)),
        ("unit", lambda: _unit_env(o, config, host)),
    ]
    for name, step in steps:
        try:
            got = step()
        except OSError as e:  # e.g. not root: /etc/zz or the key directory not writable
            got = Step(name, "FAILED", f"{e.filename or ''}: {e.strerror or e}".lstrip(": "))
        report.steps += got if isinstance(got, list) else [got]
    return report


def format_report(report: InitReport) -> str:
    width = max(len(s.name) for s in report.steps)
    lines = [f"{s.name:<{width}}  {s.status:<7}  {s.detail}" for s in report.steps]
    if report.failed:
        lines.append(f"host {report.host}: {len(report.failed)} steps FAILED")
    elif report.changed:
        lines.append(f"host {report.host}: prepared")
    else:
        lines.append(f"host {report.host}: nothing to do (already prepared)")
    return "\n".join(lines) + "\n"
