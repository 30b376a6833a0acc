#!/usr/bin/env bash
# install-host.sh - install ZZ on a host from this checkout: the source under PREFIX/src, a venv
# in PREFIX/venv, zz-agreed in PREFIX/bin, controld's systemd unit (docs/operations.md "Four real hosts").
#
#   sudo bash scripts/install-host.sh [--prefix /opt/zz] [--etc /etc/zz]
#        [--systemd-dir /etc/systemd/system] [--packages install|check|skip]
#        [--zz-agreed FILE] [--offline]
#
# Downloads nothing but Debian packages (apt-get, --packages install) and Python packages
# from the package registry (pip; none with --offline). Re-runnable: it replaces the source
# and the binary, keeps the venv, and pip brings it up to date. It never enables or starts
# the unit: `zz host init` then `systemctl enable --now zz-controld@NAME` do (printed at the end).
#
#   --prefix DIR       where it goes (default /opt/zz): DIR/src (the checkout's files but
#                      what .gitignore excludes; the venv installs it editable, so images/
#                      and scripts/ are found next to the code), DIR/venv, DIR/bin/zz-agreed,
#                      DIR/bin/zz
#   --etc DIR          where zz host init writes controld-NAME.env (default /etc/zz)
#   --systemd-dir DIR  where zz-controld@.service goes (default /etc/systemd/system)
#   --packages MODE    install (default as root): apt-get the missing build and run-time
#                      packages; check: only say which are missing (and stop); skip
#   --zz-agreed FILE   install this zz-agreed build instead of building one (make -C src/agreement)
#   --offline          pip downloads nothing: the venv sees the system Python's site-packages,
#                      which must hold zz's dependencies and setuptools + wheel (Debian:
#                      python3-setuptools, python3-wheel), and zz is installed without its
#                      dependencies and without build isolation (tests/test_host_install.py)
set -euo pipefail

SRC=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=/opt/zz
ETC=/etc/zz
SYSTEMD_DIR=/etc/systemd/system
PACKAGES=
AGREED=
OFFLINE=0
PY=${PYTHON:-python3}

say() { printf '[install-host] %s\n' "$*"; }
die() { printf '[install-host] %s\n' "$*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) PREFIX=${2:?--prefix: a directory is required}; shift 2 ;;
        --etc) ETC=${2:?--etc: a directory is required}; shift 2 ;;
        --systemd-dir) SYSTEMD_DIR=${2:?--systemd-dir: a directory is required}; shift 2 ;;
        --packages) PACKAGES=${2:?--packages: install, check or skip}; shift 2 ;;
        --zz-agreed) AGREED=${2:?--zz-agreed: a file is required}; shift 2 ;;
        --offline) OFFLINE=1; shift ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) die "unknown option $1 (--help lists them)" ;;
    esac
done
for v in PREFIX ETC SYSTEMD_DIR; do
    case "${!v}" in /*) ;; *) die "--$(echo "$v" | tr 'A-Z_' 'a-z-'): must be an absolute path, got '${!v}'" ;; esac
done
if [ -z "$PACKAGES" ]; then
    if [ "$(id -u)" -eq 0 ]; then PACKAGES=install; else PACKAGES=check; fi
fi
case "$PACKAGES" in install|check|skip) ;; *) die "--packages: must be install, check or skip, got '$PACKAGES'" ;; esac
if [ -n "$AGREED" ] && [ ! -x "$AGREED" ]; then
    die "--zz-agreed: $AGREED is not an executable file"
fi

# ---- 1. Debian packages: to build zz-agreed and libvirt-python, to run the venv ------------
APT=(python3 python3-venv libssl3 rsync)
[ -n "$AGREED" ] || APT+=(build-essential libssl-dev pkg-config)
[ "$OFFLINE" = 1 ] || APT+=(libvirt-dev pkg-config python3-dev gcc)  # libvirt-python builds a C extension
missing=()
for p in "${APT[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ] || [ "$PACKAGES" = skip ]; then
    say "packages: ${missing[*]:-all present}${missing[*]:+ missing (--packages skip)}"
elif [ "$PACKAGES" = check ]; then
    die "packages missing: ${missing[*]} (apt-get install them, or run as root with --packages install)"
else
    [ "$(id -u)" -eq 0 ] || die "packages missing: ${missing[*]}; installing needs root"
    say "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# ---- 2. the source: the checkout's tracked files, swapped in whole -------------------------
mkdir -p "$PREFIX/bin"
rm -rf "$PREFIX/src.new"
mkdir -p "$PREFIX/src.new"
if git -C "$SRC" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    # Tracked files and new ones .gitignore does not exclude: the checkout as it is.
    git -C "$SRC" ls-files -z --cached --others --exclude-standard \
        | rsync -a --from0 --ignore-missing-args --files-from=- "$SRC/" "$PREFIX/src.new/"
    rev=$(git -C "$SRC" describe --always --dirty 2>/dev/null || echo unknown)
else
    rsync -a --exclude .git --exclude 'build*/' --exclude __pycache__ --exclude '*.egg-info' \
        --exclude /run --exclude /keys "$SRC/" "$PREFIX/src.new/"
    rev=unknown
fi
echo "$rev" > "$PREFIX/src.new/.zz-install-rev"
rm -rf "$PREFIX/src.old"
[ ! -d "$PREFIX/src" ] || mv "$PREFIX/src" "$PREFIX/src.old"
mv "$PREFIX/src.new" "$PREFIX/src"
rm -rf "$PREFIX/src.old"
say "source: $SRC ($rev) -> $PREFIX/src"

# ---- 3. zz-agreed: built here (release build) unless given ---------------------------------
if [ -z "$AGREED" ]; then
    say "make -C $PREFIX/src/agreement all"
    make -s -C "$PREFIX/src/agreement" all
    AGREED=$PREFIX/src/agreement/build/zz-agreed
fi
install -m 0755 "$AGREED" "$PREFIX/bin/zz-agreed.new"
mv "$PREFIX/bin/zz-agreed.new" "$PREFIX/bin/zz-agreed"
say "zz-agreed: $PREFIX/bin/zz-agreed"

# ---- 4. the venv, zz installed editable from PREFIX/src ------------------------------------
if [ ! -x "$PREFIX/venv/bin/python" ]; then
    if [ "$OFFLINE" = 1 ]; then
        "$PY" -m venv --system-site-packages "$PREFIX/venv"
    else
        "$PY" -m venv "$PREFIX/venv"
    fi
    say "venv: $PREFIX/venv ($("$PREFIX/venv/bin/python" --version 2>&1))"
fi
VPIP=("$PREFIX/venv/bin/python" -m pip install -q --disable-pip-version-check)
if [ "$OFFLINE" = 1 ]; then
    "${VPIP[@]}" --no-index --no-build-isolation --no-deps -e "$PREFIX/src"
    say "pip: zz from $PREFIX/src, offline (dependencies from the system's site-packages)"
else
    extras=
    if pkg-config --exists libvirt 2>/dev/null; then extras='[libvirt]'; fi
    "${VPIP[@]}" -e "$PREFIX/src$extras"
    say "pip: zz$extras from $PREFIX/src with its dependencies"
fi
ln -sfn ../venv/bin/zz "$PREFIX/bin/zz"

# ---- 5. the systemd unit (never enabled or started here) -----------------------------------
mkdir -p "$SYSTEMD_DIR" "$ETC"
unit=$SYSTEMD_DIR/zz-controld@.service
sed -e "s|@PREFIX@|$PREFIX|g" -e "s|@ETC@|$ETC|g" "$SRC/scripts/systemd/zz-controld@.service" > "$unit.new"
mv "$unit.new" "$unit"
say "unit: $unit"
if [ "$SYSTEMD_DIR" = /etc/systemd/system ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    say "systemctl daemon-reload"
fi

cat <<EOF
[install-host] done. Next, on this host (docs/operations.md "Four real hosts"):
  $PREFIX/bin/zz host init RACK.toml --host NAME --etc $ETC --prefix $PREFIX [--bundle BUNDLE]
  systemctl enable --now zz-controld@NAME
EOF
