# tests/test_host_install.py - scripts/install-host.sh into a temporary prefix (offline: no
# download), twice; controld's systemd unit checked with `systemd-analyze verify`, never enabled.
"""The install runs with Debian's python3 (/usr/bin/python3: python3-venv, python3-wheel,
python3-setuptools, which scripts/setup.sh installs) and --offline, so pip downloads
nothing; its venv sees the system's site-packages for zz's dependencies. Every path is
under tmp_path: the unit goes to a directory of its own, not /etc/systemd/system, and
systemd-analyze only reads it (~15 s, two installs)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "install-host.sh"
UNIT = "zz-controld@.service"
AGREED = REPO / "agreement" / "build" / "zz-agreed"
DEBIAN_PYTHON = Path("/usr/bin/python3")


def _verify(unit_dir: Path, *units: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """systemd-analyze verify, the unit directory first on the search path."""
    env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{unit_dir}:")
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *units],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.fixture
def tools() -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is required (scripts/setup.sh installs systemd for it)")
    if not AGREED.exists():
        pytest.fail(f"{AGREED} is not built (make -C agreement all; scripts/setup.sh does)")
    probe = subprocess.run(
        [str(DEBIAN_PYTHON), "-c", "import venv, wheel, setuptools"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.fail("Debian's python3 with python3-venv, -wheel, -setuptools is required")


def test_install_into_a_prefix_twice_and_the_unit_verifies(tools: None, tmp_path: Path) -> None:
    prefix, etc, units = tmp_path / "opt", tmp_path / "etc", tmp_path / "systemd"
    argv = ["bash", str(SCRIPT), "--prefix", str(prefix), "--etc", str(etc),
            "--systemd-dir", str(units), "--packages", "skip", "--zz-agreed", str(AGREED),
            "--offline"]  # fmt: skip
    env = dict(os.environ, PYTHON=str(DEBIAN_PYTHON))
    for run in (1, 2):  # re-runnable: the second replaces the source, keeps the venv
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (run, done.stdout, done.stderr)
        assert ("venv: " in done.stdout) == (run == 1), done.stdout

    # The layout: the checkout's files, the binary, the venv importing zz from src.
    assert (prefix / "src" / "zz" / "hostinit.py").exists()
    assert not (prefix / "src" / ".git").exists() and not (prefix / "src.old").exists()
    assert (prefix / "bin" / "zz-agreed").read_bytes() == AGREED.read_bytes()
    where = subprocess.run(
        [str(prefix / "venv" / "bin" / "python"), "-c",
         "import zz, zz.controld, zz.hostinit; print(zz.__file__, zz.controld.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True,
    ).stdout.split()  # fmt: skip
    assert where == [str(prefix / "src" / "zz" / "__init__.py"),
                     str(prefix / "src" / "controld" / "__init__.py")]  # fmt: skip
    version = subprocess.run(
        [str(prefix / "bin" / "zz"), "--version"], cwd=tmp_path, capture_output=True,
        text=True, timeout=60, check=True,
    )  # fmt: skip
    assert version.stdout.startswith("zz ")

    # The unit: filled in, and systemd-analyze finds nothing to say about it (the template
    # and an instance), while a unit whose program is missing fails the same check.
    text = (units / UNIT).read_text()
    assert "@PREFIX@" not in text and "@ETC@" not in text
    assert f"ExecStart={prefix}/venv/bin/python -m zz.controld --config ${{ZZ_CONFIG}}" in text
    assert f"EnvironmentFile={etc}/controld-%i.env" in text
    for unit in (str(units / UNIT), "zz-controld@h0.service"):
        ok = _verify(units, unit, cwd=tmp_path)
        assert ok.returncode == 0 and ok.stderr.strip() == "", (unit, ok.stderr)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / UNIT).write_text(text.replace(f"{prefix}/venv", f"{tmp_path}/missing"))
    bad = _verify(broken, "zz-controld@h0.service", cwd=tmp_path)
    assert bad.returncode != 0 and "is not executable" in bad.stderr, bad.stderr


def test_install_refuses_bad_options(tmp_path: Path) -> None:
    for extra, said in (
        (["--prefix", "opt"], "--prefix: must be an absolute path, got 'opt'"),
        (["--packages", "maybe"], "--packages: must be install, check or skip, got 'maybe'"),
        (["--zz-agreed", str(tmp_path / "none")], "--zz-agreed: "),
        (["--frobnicate"], "unknown option --frobnicate"),
    ):
        done = subprocess.run(
            ["bash", str(SCRIPT), *extra], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 1 and said in done.stderr, (extra, done.stderr)
    assert list(tmp_path.iterdir()) == []
