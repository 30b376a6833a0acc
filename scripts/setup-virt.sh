#!/usr/bin/env bash
# setup-virt.sh - idempotent virtualization setup for ZZ guests (run as root): QEMU, libvirt,
# the tools images/build.py uses, the libvirt daemons (no systemd here: started by hand),
# the /dev/kvm group/mode fix and the libvirt-python binding. docs/design.md §9; docs/images.md.
set -euo pipefail

say() { printf '[setup-virt] %s\n' "$*"; }

APT_PACKAGES=(qemu-system-x86 qemu-utils libvirt-daemon-system libvirt-clients libvirt-dev
              pkg-config gcc cpio kmod busybox-static)
PY=${PYTHON:-python3}
URI=qemu:///system

if [ "$(id -u)" -ne 0 ]; then
    say "must run as root (sudo bash scripts/setup-virt.sh)"
    exit 1
fi

# ---- packages ---------------------------------------------------------------------------
missing=()
for p in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
        missing+=("$p")
    fi
done
if [ ${#missing[@]} -gt 0 ]; then
    say "apt-get install ${missing[*]}"
    # The cached package lists are usually good enough; update only when the install fails.
    # policy-rc.d: no init system here, so the packages must not try to start services.
    prc_created=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        prc_created=1
    fi
    install() {
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
    }
    if ! install; then
        say "install failed: apt-get update, then retry"
        apt-get update -q
        install
    fi
    if [ "$prc_created" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
else
    say "system packages present"
fi

# ---- /dev/kvm ---------------------------------------------------------------------------
# libvirt probes KVM even for <domain type='qemu'>: unless /dev/kvm is group kvm, mode 0660,
# every domain start re-probes the capabilities and takes ~60 s (docs/design.md §9).
if [ -e /dev/kvm ]; then
    getent group kvm >/dev/null || groupadd -r kvm
    chgrp kvm /dev/kvm
    chmod 0660 /dev/kvm
    say "/dev/kvm: $(stat -c '%G %a' /dev/kvm)"
fi

# ---- daemons ----------------------------------------------------------------------------
if ! pgrep -x virtlogd >/dev/null 2>&1; then
    say "starting virtlogd"
    virtlogd -d
fi
if ! virsh -c "$URI" version >/dev/null 2>&1; then
    if ! pgrep -x libvirtd >/dev/null 2>&1; then
        rm -f /run/libvirtd.pid /var/run/libvirtd.pid
        say "starting libvirtd"
        libvirtd -d
    fi
    ok=0
    for _ in $(seq 1 100); do
        if virsh -c "$URI" version >/dev/null 2>&1; then ok=1; break; fi
        sleep 0.2
    done
    if [ "$ok" != 1 ]; then
        say "libvirtd does not answer 'virsh -c $URI version' after 20 s"
        virsh -c "$URI" version || true
        exit 1
    fi
fi
say "$(virsh -c "$URI" version | grep -i 'running hypervisor' || true)"

# ---- libvirt-python ---------------------------------------------------------------------
# The `libvirt` extra of pyproject.toml (controld's libvirt backend); built from the package
# registry against libvirt-dev (~30 s the first time). setup.sh then installs zz with it.
if ! $PY -c 'import libvirt' >/dev/null 2>&1; then
    say "$PY -m pip install libvirt-python"
    $PY -m pip install -q --disable-pip-version-check 'libvirt-python>=9.0'
fi
say "libvirt-python $($PY -c 'import libvirt; print(libvirt.getVersion())')"
say "done"
