"""zz/mountpoints.py - finding and unmounting zz mounts (`zz umount`, docs/files.md); apart
from zz/mount.py so that unmounting needs no FUSE binding."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

FSTYPE = "fuse.zz"  # the mount's type: FUSE with subtype zz


class MountError(Exception):
    """A mount or unmount that cannot be done; the message says why."""


def mounted_zz(mountpoint: str | Path) -> bool:
    """Whether a zz mount is at `mountpoint` (from /proc/self/mountinfo)."""
    target = os.path.realpath(mountpoint)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        left, _, right = line.partition(" - ")
        parts = left.split()
        if len(parts) > 4 and _unescape(parts[4]) == target and right.split()[:1] == [FSTYPE]:
            return True
    return False


def _unescape(s: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        s = s.replace(esc, ch)
    return s


def umount(mountpoint: str | Path, lazy: bool = False) -> None:
    """Unmount a zz mount: fusermount3 -u (umount(8) when it is missing). A path that is
    not a zz mount is refused, and nothing is done."""
    if not mounted_zz(mountpoint):
        raise MountError(f"{mountpoint} is not a zz mount (no {FSTYPE} there in mountinfo)")
    if shutil.which("fusermount3"):
        cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [str(mountpoint)]
    else:
        cmd = ["umount"] + (["-l"] if lazy else []) + [str(mountpoint)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise MountError(f"{' '.join(cmd)} failed: {res.stderr.strip() or res.returncode}")
