# tests/test_host_init.py - `zz host init` (zz/hostinit.py): every step into temporary
# directories, twice (the second run changes nothing), a ZFS pool on a vdev file, bad options.
"""The machine's /etc is never touched: --etc and the key and run directories are under
tmp_path, the pool is a test pool (swept by tests/zfs_pool.py if a run is killed) on a
file in tmp_path, libvirt is test:///default, and packages are checked with a stand-in
dpkg-query on PATH (nothing is installed)."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import zfs_pool
from zz import cli, hostinit, hostkeys
from zz.config import load
from zz.snapshots.zfs import destroy_pool, pool_exists, pool_vdevs, run_zfs

zfs_daemon = zfs_pool.zfs_daemon  # the fixture, found here by pytest


def _fake_dpkg(tmp_path: Path, installed: list[str]) -> str:
    """A PATH whose dpkg-query knows only `installed`."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "dpkg-query"
    names = " ".join(installed)
    script.write_text(
        "#!/bin/sh\n# dpkg-query -W -f=${Status} PKG\n"
        f"for p in {names}; do\n"
        '  [ "$p" = "$3" ] && { echo "install ok installed"; exit 0; }\ndone\n'
        'echo "dpkg-query: no packages found matching $3" >&2; exit 1\n'
    )
    script.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def _init(cfg: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["host", "init", str(cfg), "--host", "h1", "--etc", str(tmp_path / "etc"),
            "--prefix", str(tmp_path / "opt"), *extra]  # fmt: skip


def test_host_init_twice_pool_libvirt_keys_unit(
    rack_config: Path,
    tmp_path: Path,
    zfs_daemon: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    everything = hostinit.HOST_PACKAGES + hostinit.LIBVIRT_PACKAGES + ["zfsutils-linux"]
    monkeypatch.setenv("PATH", _fake_dpkg(tmp_path, everything))
    pool = f"zztest{os.getpid()}x{uuid.uuid4().hex[:6]}"
    vdev = tmp_path / "vdev.img"
    argv = _init(rack_config, tmp_path, "--pool", pool, "--vdev", str(vdev), "--vdev-size", "128M")
    config = load(rack_config)
    try:
        assert cli.main([*argv, "--json"]) == 0
        first = json.loads(capsys.readouterr().out)
        status = {s["name"]: s["status"] for s in first["steps"]}
        assert status == {
            "packages": "ok",  # zfsutils-linux stands in for zfs-fuse
            "pool": "done",
            "mounts": "ok",  # scripts/setup-zfs.sh made / shared
            "libvirt": "ok",
            "keys": "done",
            "public keys": "done",
            "bundle": "skipped",
            "unit": "done",
        }, first
        assert first["ok"] and first["changed"]
        assert pool_exists(pool) and pool_vdevs(pool) == [str(vdev)]
        assert "test:///default answers" in str(first["steps"])
        env = (tmp_path / "etc" / "controld-h1.env").read_text()
        assert f'ZZ_CONFIG="{config.path}"\n' in env
        assert f'ZZ_CONTROLD_ARGS="--backend libvirt --store zfs --zfs-pool {pool}"' in env
        export = hostkeys.export_path(config.rack.key_dir, "h1")
        assert export.exists() and "sign" not in export.read_text()
        secrets = sorted(config.rack.key_dir.glob("s*/p*.secret"))
        # h1 holds its controld, agreement replicas 1 and 3, execution replicas 0 and 2.
        assert sorted(f"{p.parent.name}/{p.name}" for p in secrets) == [
            "s0/p16777217.secret", "s1/p1.secret", "s1/p256.secret", "s1/p258.secret",
            "s1/p3.secret",
        ]  # fmt: skip
        seeds = {p: p.read_bytes() for p in secrets}

        # Second run: the same options change nothing, and it says so.
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert "host h1: nothing to do (already prepared)" in out
        assert " done " not in out
        assert {p: p.read_bytes() for p in secrets} == seeds

        # The pool's daemon lost it (exported): the next run imports it from its vdev.
        run_zfs(["zpool", "export", pool])
        assert cli.main(argv) == 0
        assert f"imported pool {pool} from {vdev}" in capsys.readouterr().out
        assert pool_exists(pool)

        # The same pool name asked on another vdev is refused, naming both.
        other = tmp_path / "other.img"
        assert cli.main([*argv[:-4], "--vdev", str(other), "--vdev-size", "128M"]) == 1
        out = capsys.readouterr().out
        assert f"pool {pool} exists on {vdev}, not on {other}" in out
        assert not other.exists()
    finally:
        if pool_exists(pool):
            destroy_pool(pool, vdev)
    assert not pool_exists(pool)


def test_host_init_reports_what_is_missing(
    rack_config: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Packages: only python3 is there; the check names the rest and installs nothing.
    monkeypatch.setenv("PATH", _fake_dpkg(tmp_path, ["python3"]))
    argv = _init(rack_config, tmp_path, "--backend", "process", "--no-pool")
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "packages     FAILED   missing: python3-venv libssl3;" in out
    assert "apt-get install -y --no-install-recommends python3-venv libssl3" in out
    assert "host h1: 1 steps FAILED" in out
    # The other steps ran all the same; the unit's args name the backend, no pool.
    env = (tmp_path / "etc" / "controld-h1.env").read_text()
    assert 'ZZ_CONTROLD_ARGS="--backend process"' in env
    assert hostinit.missing_packages(["a|b", "c"], lambda p: p == "b") == ["c"]

    # A libvirt URI that does not open: named, with what to check.
    text = rack_config.read_text().replace("test:///default", "test:///nonexistent-zz.xml")
    broken = tmp_path / "broken.toml"
    broken.write_text(text)
    monkeypatch.setenv("PATH", _fake_dpkg(tmp_path, hostinit.HOST_PACKAGES
                                          + hostinit.LIBVIRT_PACKAGES))  # fmt: skip
    assert cli.main(_init(broken, tmp_path, "--no-pool")) == 1
    out = capsys.readouterr().out
    assert "libvirt      FAILED   cannot open test:///nonexistent-zz.xml" in out

    # A directory it may not write (as a user for /etc/zz): that step fails, named.
    (tmp_path / "ro").mkdir(mode=0o500)
    try:
        argv = _init(rack_config, tmp_path, "--backend", "process", "--no-pool",
                     "--packages", "skip")  # fmt: skip
        argv[argv.index("--etc") + 1] = str(tmp_path / "ro" / "etc")
        if os.geteuid() == 0:  # root writes anyway: make the file's place a file
            (tmp_path / "ro").chmod(0o700)
            (tmp_path / "ro" / "etc").write_text("")
        assert cli.main(argv) == 1
        out = capsys.readouterr().out
        assert f"unit         FAILED   {tmp_path / 'ro' / 'etc'}" in out, out
        assert "keys         ok" in out
    finally:
        (tmp_path / "ro").chmod(0o700)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["--vdev-size", "1M"], "--vdev-size: at least 64M"),
        (["--vdev-size", "lots"], "--vdev-size: expected a size like 8G"),
        (["--packages", "maybe"], "--packages: must be one of check, install, skip"),
        (["--backend", "kvm"], "--backend: must be one of libvirt, process"),
        (["--pool", "Bad/Name"], "--pool: "),
        (["--no-pool", "--pool", "zzx"], "--no-pool: cannot be combined with --pool"),
        (["--etc", "etc"], "--etc: must be an absolute path"),
        (["--bundle", "/nonexistent/bundle"], "--bundle: /nonexistent/bundle is not a file"),
    ],
)
def test_bad_options_name_the_field(
    rack_config: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    field: str,
) -> None:
    argv = ["host", "init", str(rack_config), "--host", "h1", "--packages", "skip",
            "--etc", str(tmp_path / "etc"), *extra]  # fmt: skip
    assert cli.main(argv) == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "etc").exists() and not (tmp_path / "keys").exists()


def test_unknown_host_is_named(rack_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["host", "init", str(rack_config), "--host", "h7", "--packages", "skip"]) == 2
    assert "--host: 'h7' is not in the config's hosts (h0, h1)" in capsys.readouterr().err


# /proc/self/mountinfo of a machine without systemd (/ private) and with it (/ shared).
_PRIVATE = """\
22 1 0:21 / / rw,relatime - overlay overlay rw,lowerdir=/l
23 22 0:22 / /proc rw,nosuid shared:5 - proc proc rw
"""
_SHARED = """\
22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw
23 22 0:22 / /proc rw,nosuid shared:5 - proc proc rw
"""


def test_mounts_step_makes_a_private_root_shared(tmp_path: Path) -> None:
    """A private / (no systemd) is made shared, so that a QEMU's mount namespace does not
    keep the pool's datasets; a shared one is left alone; a failed mount names why; no
    pool, nothing to do."""
    assert not hostinit.root_is_shared(_PRIVATE) and hostinit.root_is_shared(_SHARED)
    o = hostinit.InitOptions(config=tmp_path / "rack.toml", host="h1")
    info = tmp_path / "mountinfo"
    calls: list[list[str]] = []

    def run(rc: int) -> Callable[[list[str]], subprocess.CompletedProcess[str]]:
        def f(cmd: list[str]) -> subprocess.CompletedProcess[str]:
            calls.append(cmd)
            return subprocess.CompletedProcess(cmd, rc, "", "" if rc == 0 else "permission denied")

        return f

    info.write_text(_SHARED)
    assert hostinit._mounts(o, info, run(0)).status == "ok" and calls == []
    info.write_text(_PRIVATE)
    step = hostinit._mounts(o, info, run(0))
    assert step.status == "done" and calls == [["mount", "--make-shared", "/"]], step
    step = hostinit._mounts(o, info, run(32))
    assert step.status == "FAILED" and "permission denied" in step.detail, step
    o.no_pool = True
    assert hostinit._mounts(o, info, run(0)).status == "skipped"
