# tests/test_config_names.py - names from the rack config are used to build paths, domain
# and dataset names: every command refuses a config with a bad one (naming the field), and
# `rack down` never deletes outside the rack's own directories (issue 15 items 8 and 9).
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import RACK_TOML

from zz import rackctl
from zz.cli import main
from zz.config import ConfigError, load

BASE = RACK_TOML.format(base_port=17100)


def _victim(tmp_path: Path) -> Path:
    """A directory outside the rack holding what `rack down` would remove in a host's home."""
    victim = tmp_path / "elsewhere" / "victim"
    (victim / "replicas" / "r0").mkdir(parents=True)
    (victim / "saves").mkdir()
    (victim / "replicas" / "r0" / "precious").write_text("keep me\n")
    (victim / "inventory.json").write_text("{}\n")
    return victim


def _assert_survived(victim: Path) -> None:
    assert (victim / "replicas" / "r0" / "precious").read_text() == "keep me\n"
    assert (victim / "saves").is_dir()
    assert (victim / "inventory.json").exists()


@pytest.mark.parametrize(
    ("field", "old", "bad"),
    [
        ("hosts[0].name", 'name = "h0"', "{victim}"),
        ("hosts[0].name", 'name = "h0"', "../../elsewhere/victim"),
        ("hosts[0].name", 'name = "h0"', "h0/../x"),
        ("hosts[0].name", 'name = "h0"', ".."),
        ("hosts[0].name", 'name = "h0"', "H0"),
        ("hosts[0].name", 'name = "h0"', "h 0"),
        ("services[0].name", 'name = "web"', "we/b"),
        ("rack.name", 'name = "test"', "../test"),
    ],
)
def test_bad_names_are_refused_naming_the_field(
    write_rack: Callable[[str], Path], tmp_path: Path, field: str, old: str, bad: str
) -> None:
    victim = _victim(tmp_path)
    text = BASE.replace(old, f'name = "{bad.format(victim=victim)}"', 1)
    with pytest.raises(ConfigError) as e:
        load(write_rack(text))
    assert str(e.value).startswith(f"{field}: "), str(e.value)
    _assert_survived(victim)


@pytest.mark.parametrize(
    "argv",
    [
        ["rack", "plan"],
        ["rack", "up"],
        ["rack", "down"],
        ["rack", "stop"],
        ["rack", "start"],
        ["rack", "render"],
        ["status"],
        ["keys"],
        ["drill", "crash"],
    ],
)
def test_every_command_refuses_a_host_named_as_a_path(
    write_rack: Callable[[str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
) -> None:
    victim = _victim(tmp_path)
    config = write_rack(BASE.replace('name = "h0"', f'name = "{victim}"', 1))
    assert main([*argv, str(config)]) != 0
    assert "hosts[0].name" in capsys.readouterr().err
    _assert_survived(victim)
    # Nothing was created for the rack either.
    assert not (tmp_path / "run").exists() and not (tmp_path / "keys").exists()


def test_down_does_not_follow_a_symlink_out_of_the_run_dir(
    write_rack: Callable[[str], Path], tmp_path: Path
) -> None:
    """A valid config, but the run dir's host home is a symlink to elsewhere: `down` must not
    delete through it (resolve, then check containment)."""
    victim = _victim(tmp_path)
    config = load(write_rack(BASE))
    home = config.rack.run_dir / "controld"
    home.mkdir(parents=True)
    (home / "h0").symlink_to(victim)
    exec_dir = config.rack.run_dir / "s1"
    exec_dir.mkdir()
    (exec_dir / "exec-0").symlink_to(victim / "replicas")
    rackctl.down(config)
    _assert_survived(victim)


def test_down_ignores_a_recorded_vdev_outside_the_run_dir(
    write_rack: Callable[[str], Path], tmp_path: Path
) -> None:
    victim = _victim(tmp_path)
    config = load(write_rack(BASE))
    state = rackctl.RackState("test", str(config.path), "process", "zfs", 0.0)
    state.pools = [{"name": "zzprobablynotapool0", "vdev": str(victim / "inventory.json")}]
    config.rack.run_dir.mkdir()
    rackctl.state_path(config).write_text(__import__("json").dumps(state.to_json()))
    try:
        rackctl.down(config)
    except rackctl.RackError:
        pass  # refusing is fine too; deleting is not
    _assert_survived(victim)


def test_path_containment(tmp_path: Path) -> None:
    root = tmp_path / "run"
    (root / "a" / "b").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "link").symlink_to(outside)
    assert rackctl.contained(root / "a" / "b", root) == (root / "a" / "b").resolve()
    assert rackctl.contained(root / "missing" / "x", root) is not None
    for bad in (
        outside,
        root / ".." / "outside",
        root / "link",
        root / "link" / "x",
        root,
        Path("/"),
    ):
        assert rackctl.contained(bad, root) is None, bad
    # The removal helpers act inside and refuse outside, leaving the target alone.
    (outside / "f").write_text("x")
    (root / "a" / "b" / "f").write_text("x")
    rackctl.remove_tree(root / "a", root)
    assert not (root / "a").exists()
    for remove in (rackctl.remove_tree, rackctl.remove_file):
        for bad in (root / "link" / "f", root / ".." / "outside", outside / "f", root):
            with pytest.raises(rackctl.RackError):
                remove(bad, root)
    rackctl.remove_tree(root / "nothing-here", root)  # a missing path is fine
    rackctl.remove_file(root / "nothing-here", root)
    # A symlink inside the root is removed itself; what it points to stays.
    rackctl.remove_tree(root / "link", root)
    assert not os.path.lexists(root / "link")
    assert (outside / "f").read_text() == "x"
