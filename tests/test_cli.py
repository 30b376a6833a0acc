# tests/test_cli.py - the `zz` command as scripts use it (issue 17 item 3): usage and config
# errors exit 2 naming the field, a closed stdout and Ctrl-C end quietly, -q/-v anywhere,
# `rack plan --json`, shell completion. (`zz status` exit codes: tests/test_status.py.)
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import argcomplete.finders
import argcomplete.io
import pytest
from conftest import RACK_TOML

from zz import cli

REPO = Path(__file__).resolve().parent.parent
# Four hosts: the conftest rack (g = 1) can be placed.
PLACEABLE = RACK_TOML.format(base_port=17100) + "".join(
    f'\n[[hosts]]\nname = "h{h}"\naddress = "127.0.0.1"\ncontrol_port = {7000 + h}\n'
    for h in (2, 3)
)


def zz(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zz", *args], capture_output=True, text=True, timeout=60,
        cwd=REPO, **kw,  # type: ignore[call-overload]
    )  # fmt: skip


def main(*args: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(list(args))
    return rc, buf.getvalue()


def test_usage_errors_exit_2() -> None:
    for args in (["bogus"], ["status"], ["rack"], ["rack", "plan"], ["status", "x", "--nope"]):
        r = zz(*args)
        assert r.returncode == 2 and "usage: zz" in r.stderr, (args, r)
        assert "Traceback" not in r.stderr
    with pytest.raises(SystemExit) as e:
        cli.main(["drill", "no-such-kind", "rack.toml"])
    assert e.value.code == 2


def test_config_errors_exit_2_naming_the_field(write_rack: Callable[[str], Path]) -> None:
    for old, new, field in (
        ('address = "127.0.0.1"', 'address = "127.0.0.1:7000"', "hosts[0].address"),
        ('libvirt_uri = "test:///default"', 'libvirt_uri = "qemu:/system"', "hosts[0].libvirt_uri"),
        ("base_port = 17100", 'base_port = 17100\napp = "nope"', "services[0].app"),
    ):
        path = write_rack(PLACEABLE.replace(old, new, 1))
        r = zz("rack", "plan", str(path))
        assert r.returncode == 2, r
        assert r.stderr.startswith(f"zz: {field}: "), r.stderr
        assert r.stdout == "" and "Traceback" not in r.stderr
    r = zz("status", str(path), "--json")
    assert r.returncode == 2 and r.stdout == "" and "services[0].app" in r.stderr


def test_rack_plan_json_and_quiet(write_rack: Callable[[str], Path]) -> None:
    path = write_rack(PLACEABLE)
    rc, out = main("rack", "plan", str(path), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] and [h["name"] for h in doc["hosts"]] == ["h0", "h1", "h2", "h3"]
    assert [(x["kind"], x["replica"], x["host"]) for x in doc["replicas"]] == [
        ("agreement", r, f"h{r}") for r in range(4)
    ]
    assert doc["replicas"][0]["port"] == 17100
    # -q before or after the command: nothing on stdout, the exit code says it.
    assert main("-q", "rack", "plan", str(path)) == (0, "")
    assert main("rack", "plan", "-q", str(path)) == (0, "")
    # A rack that cannot be placed: exit 2, and --json says why.
    small = write_rack(RACK_TOML.format(base_port=17100))
    rc, out = main("rack", "plan", str(small), "--json")
    doc = json.loads(out)
    assert rc == 2 and not doc["ok"] and "needs 4 hosts" in doc["reasons"][0], doc


def test_closed_stdout_ends_quietly(write_rack: Callable[[str], Path]) -> None:
    """`zz status | head -1`: the reader is gone before zz writes; no traceback, no
    'Exception ignored' at exit, exit 141 (128 + SIGPIPE, as a killed writer would)."""
    path = write_rack(PLACEABLE)
    for args in (["status", str(path)], ["rack", "plan", str(path)]):
        p = subprocess.Popen(
            [sys.executable, "-m", "zz", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=REPO,
        )  # fmt: skip
        assert p.stdout is not None and p.stderr is not None
        p.stdout.close()  # like `head` that has read its line and left
        err = p.stderr.read().decode()
        assert p.wait(timeout=60) == 141, (args, err)
        assert "Traceback" not in err and "Exception ignored" not in err, (args, err)
    # Through a real shell pipe, as an operator types it.
    r = subprocess.run(
        f"{sys.executable} -m zz rack plan {path} | head -1", shell=True, capture_output=True,
        text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert r.stdout.startswith("rack test: 4 hosts") and r.stderr == "", r


def test_ctrl_c_ends_quietly_with_130(write_rack: Callable[[str], Path]) -> None:
    """Ctrl-C (SIGINT) in a command that waits (a client whose service is not up):
    exit 130, no traceback."""
    path = write_rack(PLACEABLE)
    assert zz("keys", str(path)).returncode == 0
    # As `python -m zz`, but saying when zz.cli is imported: a Ctrl-C while the interpreter
    # still imports is Python's own traceback, before any code of ours runs. A fixed sleep
    # instead failed on a loaded machine (the signal came while it compiled bytecode).
    run_main = (
        "import sys; from zz.cli import main; sys.stderr.write('imported\\n');"
        " sys.stderr.flush(); sys.exit(main())"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", run_main, "client", str(path), "web", "x", "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    assert p.stderr is not None and p.stderr.readline() == b"imported\n", p.communicate()
    time.sleep(1.0)  # into the client's retries
    assert p.poll() is None, p.communicate()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, (out, err)
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err


def test_keyboard_interrupt_in_any_command(
    monkeypatch: pytest.MonkeyPatch, write_rack: Callable[[str], Path]
) -> None:
    def interrupted(_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_plan", interrupted)
    assert main("rack", "plan", str(write_rack(PLACEABLE))) == (130, "")


def _complete(line: str) -> list[str]:
    out = io.StringIO()
    env = {"_ARGCOMPLETE": "1", "_ARGCOMPLETE_IFS": "\n", "COMP_LINE": line,
           "COMP_POINT": str(len(line))}  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        # argcomplete wraps fd 9 (the shell hook's debug stream) in a file object, and the
        # next completion's replaces it, closing fd 9: in pytest that can be the fd that
        # its faulthandler closes at exit ("Bad file descriptor", exit code 1 after every
        # test passed). Its own docs say to override this under pytest.
        mp.setattr(argcomplete.finders.CompletionFinder, "_init_debug_stream",
                   lambda _self: setattr(argcomplete.io, "debug_stream", sys.stderr))  # fmt: skip

        def stop(code: int) -> None:
            raise SystemExit(code)

        with pytest.raises(SystemExit):
            cli._complete(cli.build_parser(), output_stream=out, exit_method=stop)
    return [c.strip() for c in out.getvalue().split("\n")]


def test_shell_completion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _complete("zz rack p") == ["plan"]
    assert "wrong-reply" in _complete("zz drill w")
    assert {"--json", "--quiet", "--verbose"} <= set(_complete("zz status --"))
    (tmp_path / "rack.toml").write_text("")
    (tmp_path / "notes.txt").write_text("")
    monkeypatch.chdir(tmp_path)
    assert _complete("zz status ") == ["rack.toml"]  # a rack config: *.toml only
    # Without the shell's hook nothing happens.
    monkeypatch.delenv("_ARGCOMPLETE", raising=False)
    cli._complete(cli.build_parser())
    # The command answers the hook `register-python-argcomplete zz` sets up: the
    # candidates on file descriptor 8.
    r = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m zz 8>&1 9>/dev/null"], capture_output=True,
        text=True, timeout=60, cwd=REPO, stdin=subprocess.DEVNULL,
        env={**os.environ, "_ARGCOMPLETE": "1", "_ARGCOMPLETE_IFS": "\n",
             "COMP_LINE": "zz rack d", "COMP_POINT": "9"},
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "down", r
