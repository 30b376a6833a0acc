# tests/test_dependencies.py - optional dependencies stay optional and say how to get them
# (issue 17 item 5): libvirt-python for the libvirt backend, the Porcupine checker built at
# set-up. (matplotlib, the "plots" extra: tests/test_drill.py.)
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from zz import history as zh
from zz import rackctl
from zz.config import load
from zz.controld.hypervisor import HypervisorError, open_backend

REPO = Path(__file__).resolve().parent.parent


def test_extras_are_declared() -> None:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = " ".join(meta["dependencies"])
    assert "matplotlib" not in deps and "libvirt" not in deps
    extras = meta["optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras["plots"])
    assert any(d.startswith("libvirt-python") for d in extras["libvirt"])
    assert any(d.startswith("argcomplete") for d in meta["dependencies"])


def test_libvirt_backend_without_libvirt_python(
    monkeypatch: pytest.MonkeyPatch, rack_config: Path
) -> None:
    monkeypatch.setitem(sys.modules, "libvirt", None)  # `import libvirt` fails
    monkeypatch.delitem(sys.modules, "zz.controld.hv_libvirt", raising=False)
    want = r"open libvirt backend: needs libvirt-python: pip install 'zz\[libvirt\]'"
    with pytest.raises(HypervisorError, match=want):
        open_backend("libvirt", uri="test:///default")
    # `zz rack up --backend libvirt` says so before it starts anything.
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(rackctl.RackError, match=r"--backend libvirt needs libvirt-python"):
        rackctl.up(load(rack_config), backend="libvirt")


@pytest.mark.skipif(
    shutil.which("go") is None and "ZZ_LINCHECK" not in os.environ,
    reason="no Go toolchain for tools/lincheck: run scripts/setup-go.sh",
)
def test_lincheck_built_by_setup_command() -> None:
    """scripts/setup.sh runs `python3 -m zz.history --build`; afterwards nothing builds."""
    r = subprocess.run(
        [sys.executable, "-m", "zz.history", "--build"],
        capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    built = Path(r.stdout.strip())
    assert built == zh.lincheck_binary(build=False) and os.access(built, os.X_OK)
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "-m zz.history --build" in setup
