#!/usr/bin/env bash
# setup.sh - idempotent machine setup for ZZ on Debian 12 (run as root): system packages,
# the Python package in editable mode, and both C builds. main.sh, test.sh and CI call it.
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)

say() { printf '[setup] %s\n' "$*"; }

# Build and test dependencies of the agreement daemon (C11 + OpenSSL, ASan/UBSan, libFuzzer).
APT_PACKAGES=(build-essential clang libclang-rt-14-dev llvm libssl-dev pkg-config xxd curl)
# `zz mount` (docs/files.md): fusermount3, and libfuse3-dev to build pyfuse3 (the mount extra).
# fuse3 replaces Debian's fuse 2 package, whose place in zfs-fuse's dependencies it takes.
APT_PACKAGES+=(fuse3 libfuse3-dev rsync)  # rsync: tests/test_mount.py runs it on a mount
# scripts/install-host.sh, as tests/test_host_install.py runs it (offline, Debian's python3):
# a venv that sees setuptools and wheel; systemd-analyze checks controld's unit (systemd's
# package brings it; looked for first, since a machine may have it without the package).
APT_PACKAGES+=(python3-venv python3-setuptools python3-wheel)
# scripts/bench/web: wrk drives HTTP load at zz proxy and at gunicorn (the bench extra below).
APT_PACKAGES+=(wrk)
# tests/test_netns_rack.py: hosts as network namespaces (ip netns, veth, bridge).
APT_PACKAGES+=(iproute2)
command -v systemd-analyze >/dev/null 2>&1 || APT_PACKAGES+=(systemd)

# ---- storage, Go, virtualization: their own scripts ---------------------------------------
# Each installs its packages and starts its daemons by hand (no systemd on these machines;
# docs/design.md §9): zfs-fuse; Go for tools/lincheck; QEMU/libvirt and the /dev/kvm fix.
bash "$ROOT/scripts/setup-zfs.sh"  # after the cd above, $(dirname "$0") may be stale
bash "$ROOT/scripts/setup-go.sh"   # the linearizability checker (tools/lincheck) is Go
bash "$ROOT/scripts/setup-virt.sh"  # QEMU/libvirt, virtlogd+libvirtd, /dev/kvm fix, libvirt-python
# ------------------------------------------------------------------------------------------

missing=()
for p in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$p")
    fi
done

if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        say "missing packages ${missing[*]} and not root: run as root (sudo bash scripts/setup.sh)"
        exit 1
    fi
    # Only refresh the package lists when they are stale: an update costs ~10-30 s.
    lists_age=999999
    if [ -e /var/lib/apt/lists/lock ] && ls /var/lib/apt/lists/*_InRelease >/dev/null 2>&1; then
        newest=$(stat -c %Y /var/lib/apt/lists/*_InRelease | sort -n | tail -1)
        lists_age=$(( $(date +%s) - newest ))
    fi
    if [ "$lists_age" -gt 86400 ]; then
        say "apt-get update (package lists are ${lists_age}s old)"
        apt-get update -q
    fi
    say "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    say "system packages present: ${APT_PACKAGES[*]}"
fi

PY=${PYTHON:-python3}
say "python: $($PY --version 2>&1) at $(command -v "$PY")"
if [ -f pyproject.toml ]; then
    # Editable install so tests and scripts see the working tree; pip is a no-op when current.
    # Extras (pyproject.toml): test (pytest, ruff, ... and matplotlib, which the report tests
    # need), plots (matplotlib: the drill reports' timeline.png), mount (pyfuse3, for
    # `zz mount`; built against libfuse3-dev above), libvirt (libvirt-python,
    # for controld's libvirt backend; setup-virt.sh above installed libvirt-dev for it),
    # bench (gunicorn, the unreplicated baseline of scripts/bench/web; py-spy, its profiler).
    extras=test,plots,mount,bench
    if $PY -c 'import libvirt' >/dev/null 2>&1 || pkg-config --exists libvirt 2>/dev/null; then
        extras=$extras,libvirt
    fi
    say "$PY -m pip install -e '.[$extras]'"
    $PY -m pip install -q --disable-pip-version-check -e "$ROOT[$extras]"
    $PY -c 'import matplotlib' 2>/dev/null || { say "matplotlib missing after pip install"; exit 1; }
    # Byte-compile the project's packages once: a rack starts a dozen Python processes
    # (controld per host, runtimes, proxy, CLI), and where PYTHONDONTWRITEBYTECODE is set
    # Python reads cached bytecode but never writes it, so each of them compiled every
    # project module again (0.7-0.9 s of CPU per start against 0.3 s, measured with `time`).
    say "$PY -m compileall -q zz execution controld snapshots"
    $PY -m compileall -q zz execution controld snapshots
    # The Porcupine checker of kv histories (tools/lincheck, Go), built here once per version
    # of its sources and cached (zz/history.py lincheck_binary): a drill never builds it on
    # its clock, and refuses to start without it.
    if command -v go >/dev/null 2>&1 || [ -n "${ZZ_LINCHECK:-}" ]; then
        lincheck=$($PY -m zz.history --build) || { say "building tools/lincheck failed (above)"; exit 1; }
        say "tools/lincheck: $lincheck"
    else
        say "no go: tools/lincheck not built; kv drills refuse to start until" \
            "scripts/setup-go.sh and \`$PY -m zz.history --build\` have run"
    fi
else
    say "no pyproject.toml yet: skipping the Python package"
fi
# ruff and pytest are needed by scripts/test.sh even before pyproject.toml lists them.
for tool in ruff pytest; do
    if ! $PY -m "$tool" --version >/dev/null 2>&1; then
        say "$PY -m pip install $tool"
        $PY -m pip install -q --disable-pip-version-check "$tool"
    fi
done

if [ -f agreement/Makefile ]; then
    say "make -C agreement all asan"
    make -s -C agreement -j"$(nproc)" all asan
else
    say "no agreement/Makefile yet: skipping the C build"
fi
say "done"
