# tests/test_execution_prestart.py - a runtime started ahead of its wake-up (a hibernated
# guest's, images/zz_guest.py PRESTART) reads its arguments, the rack config and its keys
# before the sleep (execution/__main__.py prestart); at the wake main() uses them only if
# none of those files changed meanwhile, so a re-key during the sleep is still honoured.
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from zz import keys, wire
from zz.config import ConfigError, load
from zz.crypto import SigningKey

RACK = """[rack]
name = "pre"
checkpoint_interval = 32

[[hosts]]
name = "h0"
address = "127.0.0.1"
control_port = 29990

[[hosts]]
name = "h1"
address = "127.0.0.1"
control_port = 29991

[[hosts]]
name = "h2"
address = "127.0.0.1"
control_port = 29992

[[hosts]]
name = "h3"
address = "127.0.0.1"
control_port = 29993

[[services]]
name = "kv0"
id = 1
g = 1
f = 1
app = "kv"
sleep = "hibernated"
base_port = 29000
"""


def _rack(tmp_path: Path) -> tuple[Path, list[str]]:
    path = tmp_path / "rack.toml"
    path.write_text(RACK)
    keys.generate(load(path))
    argv = ["--rack", str(path), "--service", "kv0", "--index", "2", "--state-dir",
            str(tmp_path / "state"), "--loopback-alias", "10.0.2.2"]  # fmt: skip
    return path, argv


def _started_with(monkeypatch: pytest.MonkeyPatch, argv: list[str], prepared: object) -> object:
    """main(argv, prepared) up to the runtime's start: the options it would run with."""
    from zz.execution import __main__ as em

    seen: list[object] = []

    async def fake_serve(config: object, service: object, index: int, opts: object) -> None:
        seen.append(opts)

    monkeypatch.setattr(em, "serve", fake_serve)
    monkeypatch.setattr(em, "lock_state_dir", lambda state: -1)  # held for the process's life
    assert em.main(argv, prepared) == 0  # type: ignore[arg-type]
    return seen[0]


def test_prestart_reads_ahead_and_main_uses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zz.execution.__main__ import prestart

    _, argv = _rack(tmp_path)
    prep = prestart(argv)
    assert prep.fresh(argv)
    assert prep.service.name == "kv0" and prep.args.index == 2
    assert all(h.address == "10.0.2.2" for h in prep.config.hosts)  # the guest's view
    opts = _started_with(monkeypatch, argv, prep)
    assert opts.start_keys is prep.keys  # type: ignore[attr-defined]
    assert dict(opts.marks).keys() >= {"main", "config_loaded"}  # type: ignore[attr-defined]
    # Other arguments at the wake (the config was rewritten): nothing read ahead is used.
    other = [*argv, "--replay-all"]
    assert not prep.fresh(other)
    assert _started_with(monkeypatch, other, prep).start_keys is None  # type: ignore[attr-defined]


def test_a_rekey_during_the_sleep_is_read_at_the_wake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """controld re-keys slot 2 (rotate_exec: a new secret and its SPARE-READY) after the
    runtime read its keys ahead: at the wake the stamps differ, main() leaves the keys to
    start(), which reads the new ones."""
    from zz.execution.__main__ import prestart
    from zz.execution.runtime import load_start_keys

    path, argv = _rack(tmp_path)
    prep = prestart(argv)
    old = prep.keys.secret
    config = load(path)
    svc = config.service("kv0")
    kd = config.rack.key_dir
    h = svc.exec_host(config, 2).index
    host = keys.load_secret(keys.secret_path(kd, keys.RACK_SERVICE, keys.controld_principal(h)))
    assert isinstance(host.sign, SigningKey)
    keys.rotate_exec(kd, config, svc, 2, 5, host.sign, h)
    assert not prep.fresh(argv)
    assert _started_with(monkeypatch, argv, prep).start_keys is None  # type: ignore[attr-defined]
    new = load_start_keys(prep.config, prep.service, 2, Counter())
    assert new.secret.epoch == old.epoch + 1 and new.announcement is not None
    assert new.secret.sign is not None and old.sign is not None
    assert new.secret.sign.public != old.sign.public
    assert new.publics[wire.exec_principal(2)] == new.secret.sign.public


def test_a_peers_announcement_during_the_sleep_is_read_at_the_wake(tmp_path: Path) -> None:
    """Another slot re-keyed while this one slept (its SPARE-READY appears in the key
    directory): the stamps differ too."""
    from zz.execution.__main__ import prestart

    path, argv = _rack(tmp_path)
    prep = prestart(argv)
    config = load(path)
    kd = config.rack.key_dir
    svc = config.service("kv0")
    h = svc.exec_host(config, 0).index
    host = keys.load_secret(keys.secret_path(kd, keys.RACK_SERVICE, keys.controld_principal(h)))
    assert isinstance(host.sign, SigningKey)
    keys.rotate_exec(kd, config, svc, 0, 5, host.sign, h)
    assert not prep.fresh(argv)


def test_prestart_of_bad_arguments_raises(tmp_path: Path) -> None:
    from zz.execution.__main__ import prestart

    with pytest.raises(SystemExit):
        prestart(["--rack"])
    _, argv = _rack(tmp_path)
    with pytest.raises(ConfigError):
        prestart([*argv[:2], "--service", "nope", *argv[4:]])
