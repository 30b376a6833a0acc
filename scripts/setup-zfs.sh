#!/usr/bin/env bash
# setup-zfs.sh - idempotent ZFS setup for ZZ checkpoints: install zfs-fuse, start its daemon.
# No ZFS kernel module and no systemd on the development machines: user space it is
# (docs/design.md §9).
set -euo pipefail

say() { printf '[setup-zfs] %s\n' "$*"; }

if ! command -v zfs >/dev/null 2>&1 || ! command -v zpool >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
        say "zfs is missing and we are not root: run as root (sudo bash scripts/setup.sh)"
        exit 1
    fi
    say "apt-get install zfs-fuse"
    # Try the cached package lists first: an update costs 10-30 s and is usually not needed.
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends zfs-fuse; then
        say "install failed: apt-get update, then retry"
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends zfs-fuse
    fi
fi

# zfs-fuse needs /dev/fuse; in containers the node may be missing even though FUSE works.
if [ ! -e /dev/fuse ]; then
    mknod -m 0666 /dev/fuse c 10 229 || say "warning: cannot create /dev/fuse"
fi

# libvirt starts each QEMU in a mount namespace of its own: a copy of every mount at that
# moment, made a slave of the machine's. Where / is a private mount (no systemd here) the
# copy is private too and keeps each ZFS dataset mounted then: once ZZ unmounts one, its
# FUSE mount lives on in the copy, zfs-fuse keeps the dataset open, and destroying it (or
# its pool) says "dataset is busy" until that QEMU exits. Make / shared, as systemd does at
# boot: the copies are then slaves and the unmount reaches them (docs/design.md §9).
if ! awk '$5 == "/"' /proc/self/mountinfo | grep -q ' shared:'; then
    say "mount --make-shared / (it is private: QEMU's mount namespaces would keep datasets)"
    mount --make-shared /
fi

if zpool list >/dev/null 2>&1; then
    # A long-lived zfs-fuse was seen to stop completing new FUSE mounts (a stat on the
    # fresh mount never returns): what two mounts at once do to it, which snapshots/zfs.py
    # now prevents (CHANGE_LOCK); a daemon wedged so before still is. With no pool in use,
    # start the test run on a fresh daemon; with pools, leave it alone.
    if [ -z "$(zpool list -H -o name 2>/dev/null)" ] && pgrep -x zfs-fuse >/dev/null 2>&1; then
        say "restarting the idle zfs-fuse (no pools) for a fresh daemon"
        pkill -x zfs-fuse || true
        for _ in $(seq 1 50); do
            pgrep -x zfs-fuse >/dev/null 2>&1 || break
            sleep 0.2
        done
    else
        say "zfs-fuse is running"
        exit 0
    fi
fi

# The package's init script would start it, but there is no init system here: start it
# ourselves. zfs-fuse daemonizes and writes its pid file; a stale pid file blocks a restart.
if ! pgrep -x zfs-fuse >/dev/null 2>&1; then
    rm -f /var/run/zfs-fuse.pid /run/zfs-fuse.pid
    say "starting zfs-fuse"
    # Without the caller's open files (fd 3 and up): a daemon started under `flock LOCK
    # setup.sh` kept the lock for its whole life, and every later flock waited on it.
    (
        for fd in /proc/self/fd/*; do
            n=${fd##*/}
            if [ "$n" -gt 2 ]; then eval "exec $n>&-" 2>/dev/null || true; fi
        done
        exec zfs-fuse
    )
fi
for _ in $(seq 1 50); do
    if zpool list >/dev/null 2>&1; then
        say "zfs-fuse is running"
        exit 0
    fi
    sleep 0.2
done
say "zfs-fuse did not answer 'zpool list' within 10 s"
zpool list || true
exit 1
