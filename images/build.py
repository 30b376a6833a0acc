#!/usr/bin/env python3
# build.py - builds the ZZ guest (Debian generic kernel + initramfs with busybox, Debian's
# python3.11 and the zz sources) from Debian packages, cached under a key that hashes every
# input (package versions + our files). docs/images.md.
#
#   python3 images/build.py [--cache DIR] [--force] [--print-key]
#
# prints the image directory (DIR/<key>/ with vmlinuz, initrd.gz, manifest.json).
from __future__ import annotations

import argparse
import fcntl
import gzip
import hashlib
import json
import lzma
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_CACHE = Path(os.environ.get("ZZ_IMAGE_CACHE", "/var/cache/zz-images"))
FORMAT = 1  # bump when the layout of the image changes in a way the inputs do not show

# Debian packages of the initramfs (besides the kernel). Python's extension modules whose
# libraries are not here (e.g. _dbm -> libdb5.3, nis -> libnsl2) are left out of the image.
PACKAGES = [
    "busybox-static",
    "python3.11-minimal",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "python3-cryptography",  # zz.crypto: Ed25519
    "python3-cffi-backend",
    "libc6",
    "libgcc-s1",
    "zlib1g",
    "libexpat1",
    "libssl3",
    "libffi8",
    "libbz2-1.0",
    "liblzma5",
    "libcrypt1",
    "libuuid1",
    "libsqlite3-0",
    "libncursesw6",
    "libtinfo6",
    "libreadline8",
]
KERNEL_META = "linux-image-amd64"  # depends on the newest linux-image-6.1.0-N-amd64

# Kernel modules the guest loads (with their modules.dep closure), unless built in.
MODULES = [
    "virtio_pci",
    "virtio_net",
    "virtio_balloon",
    "virtio_console",
    "9p",
    "9pnet_virtio",
    "virtiofs",
]

# Parts of the stdlib a server guest never needs.
STDLIB_EXCLUDE = {
    "test",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "pydoc_data",
    "config-3.11-x86_64-linux-gnu",
    "__phello__",
    "turtle.py",
    "site-packages",
}
# Our files: the /init script, the guest agent, this builder, and the zz sources.
OWN_FILES = ["images/init", "images/zz_guest.py", "images/build.py"]
ZZ_PACKAGES = {"zz": "zz", "execution": "zz/execution", "snapshots": "zz/snapshots"}
LIB_DIRS = ["lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib"]


def log(msg: str) -> None:
    print(f"[images] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Image:
    key: str
    directory: Path
    kernel: Path
    initrd: Path
    kernel_version: str
    built: bool  # False when it came from the cache


# ---- inputs ------------------------------------------------------------------------------


def _candidates(names: list[str]) -> dict[str, str]:
    """Candidate version of each package (apt-cache policy)."""
    out = subprocess.run(
        ["apt-cache", "policy", *names], check=True, capture_output=True, text=True
    ).stdout
    versions: dict[str, str] = {}
    current = None
    for line in out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1].split(":")[0]
        elif current and line.strip().startswith("Candidate:"):
            v = line.split(":", 1)[1].strip()
            if v and v != "(none)":
                versions[current] = v
    missing = [n for n in names if n not in versions]
    if missing:
        raise SystemExit(f"no installable version of {missing} (apt-get update?)")
    return versions


def kernel_package() -> str:
    out = subprocess.run(
        ["apt-cache", "depends", KERNEL_META], check=True, capture_output=True, text=True
    ).stdout
    m = re.search(r"Depends: (linux-image-6\.1\.0-\d+-amd64)\b", out)
    if not m:
        raise SystemExit(f"cannot tell the kernel package from 'apt-cache depends {KERNEL_META}'")
    return m.group(1)


def own_files() -> dict[str, Path]:
    files = {rel: REPO / rel for rel in OWN_FILES}
    for src in ZZ_PACKAGES:
        for p in sorted((REPO / src).rglob("*.py")):
            if "__pycache__" not in p.parts:
                files[str(p.relative_to(REPO))] = p
    return dict(sorted(files.items()))


def inputs() -> tuple[str, dict]:
    kpkg = kernel_package()
    versions = _candidates([*PACKAGES, kpkg])
    files = {rel: hashlib.sha256(p.read_bytes()).hexdigest() for rel, p in own_files().items()}
    desc = {
        "format": FORMAT,
        "kernel": kpkg,
        "packages": versions,
        "modules": MODULES,
        "files": files,
    }
    key = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
    return key, desc


# ---- packages ----------------------------------------------------------------------------


def _deb_name(name: str, version: str) -> str:
    return f"{name}_{version.replace(':', '%3a')}"


def fetch(cache: Path, packages: dict[str, str]) -> dict[str, Path]:
    """apt-get download every name=version not yet in cache/debs (one call), then dpkg-deb -x
    each into cache/pkgs/<name>_<version>/ once; returns name -> extracted tree."""
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    missing = [
        f"{n}={v}" for n, v in packages.items() if not list(debs.glob(_deb_name(n, v) + "_*.deb"))
    ]
    if missing:
        log(f"apt-get download {' '.join(missing)}")
        subprocess.run(
            ["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", *missing],
            cwd=debs,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    trees = {}
    for name, version in packages.items():
        tree = cache / "pkgs" / _deb_name(name, version)
        trees[name] = tree
        if (tree / ".done").exists():
            continue
        found = list(debs.glob(_deb_name(name, version) + "_*.deb"))
        if len(found) != 1:
            raise SystemExit(f"downloaded .deb of {name}={version} not found in {debs}")
        tmp = tree.with_name(tree.name + ".tmp")
        for t in (tree, tmp):
            if t.exists():
                shutil.rmtree(t)
        tmp.mkdir(parents=True)
        subprocess.run(["dpkg-deb", "-x", str(found[0]), str(tmp)], check=True)
        kmods = list((tmp / "lib/modules").glob("*/modules.builtin"))
        for b in kmods:  # the kernel package ships no modules.dep: depmod writes it
            subprocess.run(["depmod", "-b", str(tmp), b.parent.name], check=True)
        (tmp / ".done").touch()
        tmp.rename(tree)
    return trees


# ---- ELF: DT_NEEDED ----------------------------------------------------------------------


def elf_needed(path: Path) -> list[str] | None:
    """The DT_NEEDED entries of an ELF64 little-endian file, None if it is not one."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads: list[tuple[int, int, int]] = []
    dyn = None
    for i in range(phnum):
        p_type, _flags, p_offset, p_vaddr, _pa, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize
        )
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:
            dyn = (p_offset, p_filesz)
    if dyn is None:
        return []

    def off(vaddr: int) -> int:
        for va, fo, sz in loads:
            if va <= vaddr < va + sz:
                return vaddr - va + fo
        raise ValueError(f"{path}: address {vaddr:#x} not in a PT_LOAD segment")

    needed: list[int] = []
    strtab = None
    for i in range(dyn[1] // 16):
        tag, val = struct.unpack_from("<qQ", data, dyn[0] + 16 * i)
        if tag == 0:
            break
        if tag == 1:
            needed.append(val)
        elif tag == 5:
            strtab = off(val)
    if strtab is None:
        return []
    return [data[strtab + n : data.index(b"\0", strtab + n)].decode() for n in needed]


# ---- initramfs (cpio newc, deterministic) -------------------------------------------------


class Cpio:
    """A deterministic newc archive: entries sorted, mtime 0, uid/gid 0."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[int, bytes, int, int]] = {}  # path -> mode, data, maj, min

    def add_dir(self, path: str, mode: int = 0o755) -> None:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            p = "/".join(parts[:i])
            if p and p not in self.entries:
                self.entries[p] = (0o040000 | mode, b"", 0, 0)

    def _parent(self, path: str) -> str:
        path = path.strip("/")
        if "/" in path:
            self.add_dir(path.rsplit("/", 1)[0])
        return path

    def add_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.entries[self._parent(path)] = (0o100000 | mode, data, 0, 0)

    def add_symlink(self, path: str, target: str) -> None:
        self.entries[self._parent(path)] = (0o120777, target.encode(), 0, 0)

    def add_chardev(self, path: str, major: int, minor: int, mode: int = 0o600) -> None:
        self.entries[self._parent(path)] = (0o020000 | mode, b"", major, minor)

    def has(self, path: str) -> bool:
        return path.strip("/") in self.entries

    def write(self) -> bytes:
        out = bytearray()

        def entry(ino: int, name: str, mode: int, data: bytes, maj: int, mi: int) -> None:
            nlink = 2 if mode & 0o170000 == 0o040000 else 1
            fields = [ino, mode, 0, 0, nlink, 0, len(data), 0, 0, maj, mi, len(name) + 1, 0]
            out.extend(b"070701" + b"".join(b"%08X" % f for f in fields))
            out.extend(name.encode() + b"\0")
            out.extend(b"\0" * (-len(out) % 4))
            out.extend(data)
            out.extend(b"\0" * (-len(out) % 4))

        for ino, name in enumerate(sorted(self.entries), start=1):
            mode, data, maj, mi = self.entries[name]
            entry(ino, name, mode, data, maj, mi)
        entry(0, "TRAILER!!!", 0, b"", 0, 0)
        return bytes(out)


def add_tree(cpio: Cpio, src: Path) -> None:
    """Everything under src, at the same paths in the archive."""
    for root, dirs, files in os.walk(src):
        dirs.sort()
        rel = Path(root).relative_to(src)
        base = str(rel) if str(rel) != "." else ""
        if base:
            cpio.add_dir(base)
        for f in sorted(files):
            p = Path(root) / f
            if p.is_symlink():
                cpio.add_symlink(f"{base}/{f}".lstrip("/"), os.readlink(p))
            else:
                cpio.add_file(f"{base}/{f}".lstrip("/"), p.read_bytes(), p.stat().st_mode & 0o777)


# ---- the build ---------------------------------------------------------------------------


def _find_lib(roots: list[Path], soname: str) -> Path | None:
    for root in roots:
        for d in LIB_DIRS:
            p = root / d / soname
            if p.exists():
                return p
    return None


def _resolve_modules(kroot: Path, kver: str) -> list[str]:
    """Module files to insmod, dependencies first, relative to lib/modules/<kver>/."""
    mdir = kroot / "lib/modules" / kver
    deps: dict[str, list[str]] = {}
    for line in (mdir / "modules.dep").read_text().splitlines():
        mod, _, rest = line.partition(":")
        deps[mod] = rest.split()
    builtin = set((mdir / "modules.builtin").read_text().split())

    def norm(name: str) -> str:
        return name.replace("-", "_")

    by_name = {norm(re.sub(r"\.ko(\.xz|\.zst|\.gz)?$", "", Path(m).name)): m for m in deps}
    order: list[str] = []

    def visit(mod: str) -> None:
        if mod in order:
            return
        for d in deps[mod]:
            visit(d)
        order.append(mod)

    for name in MODULES:
        n = norm(name)
        if n in by_name:
            visit(by_name[n])
        elif not any(norm(Path(b).name).startswith(n + ".ko") for b in builtin):
            raise SystemExit(f"kernel module {name} is neither a module nor built in ({kver})")
    return order


def build(cache: Path = DEFAULT_CACHE, force: bool = False) -> Image:
    t0 = time.monotonic()
    key, desc = inputs()
    out = cache / key
    kver = desc["kernel"].removeprefix("linux-image-")
    if not force and (out / "manifest.json").exists():
        return Image(key, out, out / "vmlinuz", out / "initrd.gz", kver, built=False)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:  # one build per cache dir at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and (out / "manifest.json").exists():  # built while we waited
            return Image(key, out, out / "vmlinuz", out / "initrd.gz", kver, built=False)
        return _build(cache, key, desc, kver, t0)


def _build(cache: Path, key: str, desc: dict, kver: str, t0: float) -> Image:
    out = cache / key
    log(f"building image {key} (kernel {kver})")
    trees = fetch(cache, desc["packages"])
    kroot = trees.pop(desc["kernel"])
    roots = list(trees.values())
    t_fetch = time.monotonic() - t0

    cpio = Cpio()
    for d in [
        "bin",
        "sbin",
        "usr/bin",
        "usr/sbin",
        "proc",
        "sys",
        "dev",
        "tmp",
        "run",
        "state",
        "root",
        "etc",
        "opt/zz",
        "lib/modules",
    ]:
        cpio.add_dir(d)
    cpio.add_dir("tmp", 0o1777)
    cpio.entries["tmp"] = (0o041777, b"", 0, 0)
    cpio.add_chardev("dev/console", 5, 1)
    cpio.add_chardev("dev/null", 1, 3, 0o666)
    cpio.add_file("init", (HERE / "init").read_bytes(), 0o755)
    cpio.add_file("opt/zz/zz_guest.py", (HERE / "zz_guest.py").read_bytes())
    cpio.add_file("etc/hosts", b"127.0.0.1 localhost\n10.0.2.2 host\n")
    cpio.add_file("etc/resolv.conf", b"nameserver 10.0.2.3\n")
    cpio.add_file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    cpio.add_file("etc/group", b"root:x:0:\n")

    # busybox and its applets
    bb = trees["busybox-static"] / "bin/busybox"
    cpio.add_file("bin/busybox", bb.read_bytes(), 0o755)
    applets = subprocess.run(
        [str(bb), "--list"], check=True, capture_output=True, text=True
    ).stdout.split()
    for a in sorted(set(applets) - {"busybox"}):
        cpio.add_symlink(f"bin/{a}", "busybox")

    # python: stage it on disk first so that the image's own python3.11 can byte-compile it
    # A fixed staging path: the compiler's own state (and so the .pyc bytes) depends on it.
    stage = cache / ".stage"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    try:
        py = trees["python3.11-minimal"] / "usr/bin/python3.11"
        (stage / "usr/bin").mkdir(parents=True)
        shutil.copy2(py, stage / "usr/bin/python3.11")
        libdest = stage / "usr/lib/python3.11"
        for t in (trees["libpython3.11-minimal"], trees["libpython3.11-stdlib"]):
            src = t / "usr/lib/python3.11"
            if src.exists():
                shutil.copytree(
                    src,
                    libdest,
                    dirs_exist_ok=True,
                    symlinks=True,
                    ignore=lambda d, names: [n for n in names if n in STDLIB_EXCLUDE],
                )
        dist = stage / "usr/lib/python3/dist-packages"
        for t in (trees["python3-cryptography"], trees["python3-cffi-backend"]):
            shutil.copytree(
                t / "usr/lib/python3/dist-packages", dist, dirs_exist_ok=True, symlinks=True
            )
        for src, dest in ZZ_PACKAGES.items():
            shutil.copytree(
                REPO / src,
                stage / "opt/zz" / dest,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            )

        # cryptography 38 loads OpenSSL's legacy provider at its first use and fails
        # (InternalError, "could not load the shared library") when it is missing.
        legacy = "usr/lib/x86_64-linux-gnu/ossl-modules/legacy.so"
        (stage / legacy).parent.mkdir(parents=True)
        shutil.copyfile(trees["libssl3"] / legacy, stage / legacy)

        # shared libraries: DT_NEEDED closure; drop extension modules we cannot satisfy
        libs: dict[str, Path] = {}
        dropped: list[str] = []

        def closure(elf: Path) -> dict[str, Path] | None:
            found: dict[str, Path] = {}
            todo = list(elf_needed(elf) or [])
            while todo:
                so = todo.pop()
                if so in found or so in libs:
                    continue
                p = _find_lib(roots, so)
                if p is None:
                    return None
                found[so] = p
                todo.extend(elf_needed(p.resolve()) or [])
            return found

        for elf in [stage / "usr/bin/python3.11", *sorted(stage.rglob("*.so"))]:
            got = closure(elf)
            if got is None:
                dropped.append(elf.name)
                elf.unlink()
            else:
                libs.update(got)
        ld = _find_lib(roots, "ld-linux-x86-64.so.2")
        assert ld is not None
        libs["ld-linux-x86-64.so.2"] = ld
        for so, p in libs.items():
            rel = p.parent.relative_to(next(r for r in roots if p.is_relative_to(r)))
            (stage / rel).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p.resolve(), stage / rel / so)
            os.chmod(stage / rel / so, 0o755)
        (stage / "lib64").mkdir(exist_ok=True)
        if not (stage / "lib64/ld-linux-x86-64.so.2").exists():
            os.symlink(
                "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2", stage / "lib64/ld-linux-x86-64.so.2"
            )
        os.symlink("python3.11", stage / "usr/bin/python3")

        # byte-compile with the image's own interpreter (run on the host through its ld.so)
        env = {
            "PYTHONHOME": str(stage / "usr"),
            "PATH": "/usr/bin:/bin",
            "LC_ALL": "C.UTF-8",
            "PYTHONHASHSEED": "0",  # set/frozenset constants in a fixed order: same .pyc
        }
        libpath = f"{stage}/lib/x86_64-linux-gnu:{stage}/usr/lib/x86_64-linux-gnu"
        subprocess.run(
            [
                str(stage / "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"),
                "--library-path",
                libpath,
                str(stage / "usr/bin/python3.11"),
                "-m",
                "compileall",
                "-q",
                "-j1",  # one process, fixed order: byte-identical .pyc (with PYTHONHASHSEED)
                "--invalidation-mode",
                "unchecked-hash",
                "-s",
                str(stage),
                "-p",
                "/",
                str(stage / "usr/lib/python3.11"),
                str(stage / "usr/lib/python3/dist-packages"),
                str(stage / "opt/zz"),
            ],
            env=env,
            check=True,
        )
        pyver = subprocess.run(
            [
                str(stage / "lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"),
                "--library-path",
                libpath,
                str(stage / "usr/bin/python3.11"),
                "-c",
                "import sys; print(sys.version.split()[0])",
            ],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        add_tree(cpio, stage)
    finally:
        shutil.rmtree(stage, ignore_errors=True)

    # kernel modules, dependency order, uncompressed for busybox insmod
    mods = _resolve_modules(kroot, kver)
    mdir = kroot / "lib/modules" / kver
    order = []
    for m in mods:
        data = (mdir / m).read_bytes()
        if m.endswith(".xz"):
            data, m = lzma.decompress(data), m[:-3]
        elif m.endswith((".zst", ".gz")):
            raise SystemExit(f"compressed module {m}: not handled")
        cpio.add_file(f"lib/modules/{kver}/{m}", data)
        order.append(f"{kver}/{m}")
    cpio.add_file("lib/modules/load-order", ("\n".join(order) + "\n").encode())

    archive = cpio.write()
    tmp_out = cache / f".{key}.tmp"
    if tmp_out.exists():
        shutil.rmtree(tmp_out)
    tmp_out.mkdir(parents=True)
    (tmp_out / "initrd.gz").write_bytes(gzip.compress(archive, compresslevel=6, mtime=0))
    shutil.copyfile(kroot / "boot" / f"vmlinuz-{kver}", tmp_out / "vmlinuz")
    for f in ("vmlinuz", "initrd.gz"):
        os.chmod(tmp_out / f, 0o644)
    manifest = {
        **desc,
        "key": key,
        "python": pyver,
        "module_order": order,
        "dropped_extensions": sorted(dropped),
        "initrd_bytes": (tmp_out / "initrd.gz").stat().st_size,
        "initrd_uncompressed_bytes": len(archive),
        "kernel_bytes": (tmp_out / "vmlinuz").stat().st_size,
        "build_seconds": round(time.monotonic() - t0, 2),
        "fetch_seconds": round(t_fetch, 2),
    }
    (tmp_out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp_out.rename(out)
    os.chmod(cache, 0o755)
    os.chmod(out, 0o755)
    log(
        f"built {out} in {manifest['build_seconds']} s (fetch {t_fetch:.1f} s): initrd "
        f"{manifest['initrd_bytes'] / 2**20:.1f} MiB gz "
        f"({len(archive) / 2**20:.1f} MiB), kernel {manifest['kernel_bytes'] / 2**20:.1f} MiB"
    )
    if dropped:
        log(f"left out (libraries not packaged): {', '.join(sorted(dropped))}")
    return Image(key, out, out / "vmlinuz", out / "initrd.gz", kver, built=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--force", action="store_true", help="rebuild even if cached")
    ap.add_argument("--print-key", action="store_true", help="print the cache key and exit")
    a = ap.parse_args(argv)
    if a.print_key:
        print(inputs()[0])
        return 0
    img = build(a.cache, a.force)
    print(img.directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
