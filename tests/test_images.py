# tests/test_images.py - the guest image (images/build.py) and its libvirt domain
# (images/domain.py + images/domain.xml): cached build, XML rendering, and a real boot on
# qemu:///system: boot until the guest agent answers a ping through the slirp host forward,
# suspend/resume, destroy, no domain left behind; the guest agent (images/zz_guest.py) on the
# host. docs/images.md.
from __future__ import annotations

import base64
import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from zz.ports import free_port

REPO = Path(__file__).resolve().parent.parent
URI = os.environ.get("ZZ_LIBVIRT_URI", "qemu:///system")


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        f"zz_images_{name}", REPO / "images" / f"{name}.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


build = _load("build")
domain = _load("domain")


def _can_build() -> str | None:
    if os.geteuid() != 0:
        return "building the image writes /var/cache/zz-images: needs root"
    for tool in ("apt-get", "apt-cache", "dpkg-deb", "depmod"):
        if shutil.which(tool) is None:
            return f"{tool} missing (scripts/setup-virt.sh)"
    return None


@pytest.fixture(scope="module")
def image():  # type: ignore[no-untyped-def]
    why = _can_build()
    if why:
        pytest.skip(why)
    t0 = time.monotonic()
    img = build.build()
    print(
        f"\nimage {img.key}: {'built' if img.built else 'cached'} in "
        f"{time.monotonic() - t0:.2f} s, initrd {img.initrd.stat().st_size / 2**20:.1f} MiB"
    )
    return img


def test_build_is_cached(image) -> None:  # type: ignore[no-untyped-def]
    # The fixture's image, or a rebuild if a source file changed since (the key covers
    # every zz/ file, and other work may edit them while the suite runs).
    first = build.build()
    t0 = time.monotonic()
    again = build.build()
    assert again.key == first.key and not again.built
    # ~0.9 s on an idle machine (apt-cache + hashing); a rebuild takes 4 s and more, but
    # with other jobs on both cores a cache hit has taken 9 s: `built` is the real check.
    assert time.monotonic() - t0 < 30
    assert image.kernel.stat().st_size > 1 << 20
    assert image.initrd.read_bytes()[:2] == b"\x1f\x8b"


def test_key_changes_with_our_files(monkeypatch: pytest.MonkeyPatch) -> None:
    if shutil.which("apt-cache") is None:
        pytest.skip("apt-cache missing")
    key, desc = build.inputs()
    assert "zz/wire.py" in desc["files"] and "execution/runtime.py" in desc["files"]
    real = build.own_files

    def patched() -> dict[str, Path]:
        files = real()
        files["images/init"] = REPO / "images" / "zz_guest.py"  # different content
        return files

    monkeypatch.setattr(build, "own_files", patched)
    assert build.inputs()[0] != key


def test_cpio_is_deterministic() -> None:
    def make() -> bytes:
        c = build.Cpio()
        c.add_file("b/x", b"1")
        c.add_symlink("a/y", "../b/x")
        c.add_chardev("dev/console", 5, 1)
        return c.write()

    a = make()
    assert a == make()
    assert a.startswith(b"070701") and b"TRAILER!!!" in a


def test_render_domain_xml(tmp_path: Path) -> None:
    xml = domain.render_domain(
        "zz-x", "/k", "/i", console_socket=tmp_path / "c.sock", console_log=tmp_path / "c.log",
        memory_mib=2048, current_memory_mib=192, hostfwds=[(17001, 7000), (17002, 7100)],
        state_dir=tmp_path / "state & co", state_accessmode="passthrough", cmd='echo "hi" > /x',
    )  # fmt: skip
    root = ET.fromstring(xml)
    assert root.get("type") == "qemu"
    assert root.findtext("memory") == "2048" and root.findtext("currentMemory") == "192"
    balloon = root.find("devices/memballoon")
    assert balloon is not None and balloon.get("autodeflate") == "on"
    assert balloon.get("freePageReporting") == "on"
    fs = root.find("devices/filesystem")
    assert fs is not None and fs.find("source").get("dir") == str(tmp_path / "state & co")  # type: ignore[union-attr]
    assert root.find("seclabel/label").text == "+0:+0"  # type: ignore[union-attr]
    args = [a.get("value") for a in root.iter("{http://libvirt.org/schemas/domain/qemu/1.0}arg")]
    assert "hostfwd=tcp:127.0.0.1:17001-:7000,hostfwd=tcp:127.0.0.1:17002-:7100" in args[1]
    cmdline = root.findtext("os/cmdline") or ""
    enc = [p for p in cmdline.split() if p.startswith("zz.cmd64=")][0].split("=", 1)[1]
    assert base64.b64decode(enc).decode() == 'echo "hi" > /x'
    # A guest starved of CPU while booting must not fail the kernel's timer check.
    assert "no_timer_check" in cmdline.split()
    # On a real host the execution port is forwarded from the host's rack address, the
    # agent's stays local.
    public = domain.render_domain(
        "zz-z", "/k", "/i", console_socket="/s", hostfwds=[(17001, 7000), (17002, 7100)],
        public_address="10.0.0.11", public_ports=(7100,),
    )  # fmt: skip
    assert "hostfwd=tcp:127.0.0.1:17001-:7000,hostfwd=tcp:10.0.0.11:17002-:7100" in public
    plain = ET.fromstring(domain.render_domain("zz-y", "/k", "/i", console_socket="/s"))
    assert plain.find("devices/filesystem") is None and plain.find("seclabel") is None
    assert plain.find("cpu") is None and plain.find("features/tcg") is None
    assert plain.find("memoryBacking") is None


def test_render_domain_tuning(tmp_path: Path) -> None:
    """The options scripts/bench/web measures: CPU model, TCG cache, virtiofs, 9p cache."""
    xml = domain.render_domain(
        "zz-t", "/k", "/i", console_socket="/s", state_dir=tmp_path, share="virtiofs",
        cpu_model="max", tb_cache_mib=256, extra_cmdline="zz.share_cache=loose",
    )  # fmt: skip
    root = ET.fromstring(xml)
    assert root.find("cpu").get("mode") == "maximum"  # type: ignore[union-attr]
    assert root.findtext("features/tcg/tb-cache") == "256"
    fs = root.find("devices/filesystem")
    assert fs is not None and fs.find("driver").get("type") == "virtiofs"  # type: ignore[union-attr]
    assert root.find("memoryBacking/access").get("mode") == "shared"  # type: ignore[union-attr]
    assert "zz.share_cache=loose" in (root.findtext("os/cmdline") or "").split()
    # what a rack's virtiofs guest gets: virtiofsd without guest caching, no xattrs, and the
    # word that makes images/init and the agent mount virtiofs
    assert fs.find("binary/cache").get("mode") == "none"  # type: ignore[union-attr]
    assert fs.find("binary").get("xattr") == "off"  # type: ignore[union-attr]
    assert "zz.share=virtiofs" in (root.findtext("os/cmdline") or "").split()
    auto = ET.fromstring(domain.render_domain("zz-a", "/k", "/i", console_socket="/s",
                                              state_dir=tmp_path, share="virtiofs",
                                              virtiofs_cache="auto"))  # fmt: skip
    assert auto.find("devices/filesystem/binary/cache") is None  # virtiofsd's default
    p9 = ET.fromstring(domain.render_domain("zz-9", "/k", "/i", console_socket="/s",
                                            state_dir=tmp_path))  # fmt: skip
    assert "zz.share=virtiofs" not in (p9.findtext("os/cmdline") or "")
    assert p9.find("memoryBacking") is None
    named = ET.fromstring(domain.render_domain("zz-n", "/k", "/i", console_socket="/s",
                                               cpu_model="qemu64", tb_cache_mib=64,
                                               domain_type="kvm"))  # fmt: skip
    assert named.findtext("cpu/model") == "qemu64" and named.find("features/tcg") is None
    with pytest.raises(ValueError):
        domain.render_domain("zz-b", "/k", "/i", console_socket="/s", share="nfs")
    with pytest.raises(ValueError):
        domain.render_domain("zz-b", "/k", "/i", console_socket="/s", virtiofs_cache="loose")


def test_guest_tuning_from_controld_environment() -> None:
    """controld's environment -> render_domain options (controld/hv_libvirt.py)."""
    hv = pytest.importorskip("zz.controld.hv_libvirt")
    assert hv.guest_tuning({}) == {}
    env = {"ZZ_GUEST_SHARE_CACHE": "loose", "ZZ_GUEST_CPU": "max", "ZZ_GUEST_TB_MIB": "256"}
    want = {"extra_cmdline": "zz.share_cache=loose", "cpu_model": "max", "tb_cache_mib": 256}
    assert hv.guest_tuning(env) == want
    assert hv.guest_tuning({"ZZ_GUEST_SHARE_CACHE": "none"}) == {}
    assert hv.guest_tuning({"ZZ_GUEST_VIRTIOFS_CACHE": "auto"}) == {"virtiofs_cache": "auto"}
    with pytest.raises(ValueError):
        hv.guest_tuning({"ZZ_GUEST_VIRTIOFS_CACHE": "loose"})
    with pytest.raises(ValueError):
        hv.guest_tuning({"ZZ_GUEST_SHARE_CACHE": "loose zz.cmd64=x"})
    both = {"ZZ_GUEST_SHARE_CACHE": "loose", "ZZ_GUEST_PRESTART": "imports"}
    assert hv.guest_tuning(both) == {"extra_cmdline": "zz.share_cache=loose zz.prestart=imports"}
    with pytest.raises(ValueError):
        hv.guest_tuning({"ZZ_GUEST_PRESTART": "all"})
    agent = _load("zz_guest")
    assert agent.prestart_reads("quiet panic=-1")
    assert not agent.prestart_reads("quiet zz.prestart=imports")
    assert hv.guest_tuning({"ZZ_GUEST_MOUNT": "exec"}) == {"extra_cmdline": "zz.mount=exec"}
    assert agent.mount_by_call("quiet") and not agent.mount_by_call("quiet zz.mount=exec")


def test_guest_share_cache_from_cmdline() -> None:
    """The agent mounts the share as images/init does, with zz.share_cache= when given."""
    agent = _load("zz_guest")
    assert agent.share_cache("console=ttyS0 quiet") is None
    assert agent.share_cache("quiet zz.share_cache=loose panic=-1") == "loose"
    assert agent.share_cache("zz.share_cache=lo/se") is None
    assert agent.mount_args(None)[-1] == "trans=virtio,version=9p2000.L,msize=512000"
    assert agent.mount_args("loose")[-1].endswith(",cache=loose")
    assert agent.share_kind("quiet zz.share=virtiofs panic=-1") == "virtiofs"
    assert agent.share_kind("quiet zz.share=virtiofsx") == "9p"
    assert agent.mount_args(None, "virtiofs") == ["mount", "-t", "virtiofs"]


# ---- a real guest on libvirt ---------------------------------------------------------------


def _ping(port: int, timeout: float) -> dict:  # type: ignore[type-arg]
    """The guest agent's answer to a ping. Before the agent listens, slirp accepts and
    closes: that raises OSError, as a timeout does."""
    from zz.controld.hypervisor import guest_request

    reply = guest_request(port, {"op": "ping"}, timeout)
    assert reply.get("agent") == "zz-guest", reply
    return reply


def _answers(port: int, timeout: float) -> bool:
    try:
        _ping(port, timeout)
        return True
    except (OSError, ValueError):
        return False


def _wait_ok(port: int, deadline: float) -> float:
    """Seconds until the guest agent answered a ping."""
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        if _answers(port, 2.0):
            return time.monotonic() - t0
        time.sleep(0.01)
    raise AssertionError(f"no answer from the guest agent on 127.0.0.1:{port}")


def _all_domains() -> list[str]:
    out = subprocess.run(
        ["virsh", "-c", URI, "list", "--all", "--name"], capture_output=True, text=True, check=True
    ).stdout
    return [n for n in out.split() if n]


@pytest.fixture
def conn() -> Iterator[object]:
    try:
        import libvirt  # type: ignore[import-not-found]
    except ImportError as e:
        pytest.skip(f"libvirt-python not importable ({e}): bash scripts/setup-virt.sh")
    try:
        c = libvirt.open(URI)
    except libvirt.libvirtError as e:
        pytest.skip(f"cannot connect to {URI} ({e}): bash scripts/setup-virt.sh")
    try:
        yield c
    finally:
        c.close()


@pytest.mark.slow
# `long`: controld's real-guest tests (test_controld_daemon.py, test_controld_libvirt_vms.py)
# boot, pause and resume the same image through the product's code on every run.
@pytest.mark.long
def test_guest_boots_suspends_resumes(image, conn) -> None:  # type: ignore[no-untyped-def]
    import libvirt

    name = f"zz-test-{uuid.uuid4().hex[:8]}"
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    os.chmod(workdir, 0o755)
    log = workdir / "console.log"
    dtype = domain.detect_domain_type(image.kernel, image.initrd)
    xml = domain.render_domain(
        name, image.kernel, image.initrd, console_socket=workdir / "console.sock",
        console_log=log, memory_mib=512, hostfwds=[(port, domain.GUEST_PORT)], domain_type=dtype,
    )  # fmt: skip
    dom = None
    try:
        t0 = time.monotonic()
        dom = conn.createXML(xml, 0)  # transient: gone once destroyed
        t_create = time.monotonic() - t0
        _wait_ok(port, t0 + 120)
        boot = time.monotonic() - t0
        t1 = time.monotonic()
        dom.suspend()
        t_suspend = time.monotonic() - t1
        assert dom.state()[0] == libvirt.VIR_DOMAIN_PAUSED
        # paused: slirp (QEMU's main loop) still accepts, but the guest cannot answer
        assert not _answers(port, 1.0)
        t1 = time.monotonic()
        dom.resume()
        t_resume = time.monotonic() - t1
        assert dom.state()[0] == libvirt.VIR_DOMAIN_RUNNING
        again = _wait_ok(port, time.monotonic() + 30)
        print(
            f"\n{name} ({dtype}): create {t_create:.2f} s, boot to an answer {boot:.2f} s, "
            f"suspend {t_suspend * 1000:.1f} ms, resume {t_resume * 1000:.1f} ms, "
            f"answers again after {again * 1000:.0f} ms"
        )
    except BaseException:
        if log.exists():
            print(f"--- console of {name} ---\n{log.read_text(errors='replace')[-4000:]}")
        raise
    finally:
        try:
            if dom is not None:
                dom.destroy()
        except libvirt.libvirtError:
            pass
        shutil.rmtree(workdir, ignore_errors=True)
    assert name not in _all_domains()


# ---- the guest agent, run on the host (--no-mount: the state dir is a plain directory) --------


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """images/zz_guest.py on a free port with tmp_path/state; killed afterwards."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "zz-guest.json").write_text(
        '{"command": ["sh", "-c", "echo $ZZ_RECOVER_FROM > ran; exec sleep 60"], "start": "wake"}'
    )
    with _running_agent(state) as port:
        yield port, state


def _prestart_guest(tmp_path: Path, package: str, files: dict[str, str]) -> Path:
    """A state directory whose zz-guest.json has the agent start `python -m <package> a b`
    ahead, at the wake, from a package of `files` under tmp_path/mods; returns it."""
    mods, state = tmp_path / "mods", tmp_path / "state"
    (mods / package).mkdir(parents=True)
    (mods / package / "__init__.py").write_text("")
    for name, text in files.items():
        (mods / package / name).write_text(text)
    state.mkdir()
    cfg = {"command": [sys.executable, "-m", package, "a", "b"], "start": "wake",
           "env": {"PYTHONPATH": str(mods)}}  # fmt: skip
    (state / "zz-guest.json").write_text(json.dumps(cfg))
    return state


@contextlib.contextmanager
def _running_agent(state: Path) -> Iterator[int]:
    """images/zz_guest.py on a free port over `state`, answering; its port. Stopped with
    SIGTERM afterwards (the agent stops its runtime, and one started ahead, on it), its
    process group killed if it does not exit within 10 s."""
    port = free_port()
    p = subprocess.Popen(
        [sys.executable, str(REPO / "images" / "zz_guest.py"), "--port", str(port),
         "--host", "127.0.0.1", "--state", str(state), "--no-mount"],
        start_new_session=True,
    )  # fmt: skip
    try:
        _wait_ok(port, time.monotonic() + 20)
        yield port
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()


def test_guest_agent_protocol(agent: tuple[int, Path]) -> None:
    from zz.controld.hypervisor import guest_request

    port, state = agent
    r = _ping(port, 5)
    assert r["ok"] and r["mode"] == "idle" and r["state_mounted"] and r["runtime_pid"] is None
    # wake: the runtime learns where it recovers from (file + environment) and starts.
    r = guest_request(port, {"op": "wake", "seq": 42})
    assert r["mode"] == "running" and r["recovering_from"] == 42
    assert json.loads((state / "zz-wake.json").read_text())["seq"] == 42
    deadline = time.monotonic() + 10
    while not (state / "ran").exists() or not (state / "ran").read_text():
        assert time.monotonic() < deadline, "the runtime command did not run"
        time.sleep(0.02)
    assert (state / "ran").read_text().strip() == "42"
    pid = r["runtime_pid"]
    assert guest_request(port, {"op": "wake", "seq": 42})["runtime_pid"] == pid  # not twice
    # sleep: the runtime is stopped (its whole group).
    r = guest_request(port, {"op": "sleep"})
    assert r["mode"] == "idle" and r["runtime_pid"] is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert guest_request(port, {"op": "ballast", "mib": 8})["ballast_mib"] == 8
    assert guest_request(port, {"op": "ballast", "mib": 0})["ballast_mib"] == 0
    assert guest_request(port, {"op": "meminfo"})["meminfo_kib"]["MemTotal"] > 0
    # Bad input: an error reply, counted; the agent goes on answering.
    for bad in ({"op": "fly"}, {"op": "wake", "seq": -1}, {"op": "ballast", "mib": "x"}, [1]):
        r = guest_request(port, bad)  # type: ignore[arg-type]
        assert r["ok"] is False and r["error"]
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"{not json\n")
        assert b'"ok": false' in s.recv(4096)
        s.sendall(b"x" * 70000 + b"\n")  # over the 64 KiB line limit: connection closed
        s.settimeout(5)
        assert s.recv(4096) == b""
    r = _ping(port, 5)
    assert r["counters"]["bad_request"] == 5 and r["counters"]["line_too_long"] == 1


PRESTART_MAIN = """
import json, os, sys, time
import zzpre.dep
if __name__ == "__main__":
    out = {"cwd": os.getcwd(), "argv": sys.argv[1:], "recover": os.environ.get("ZZ_RECOVER_FROM"),
           "pid": os.getpid(),
           "preimported": zzpre.dep.AT < float(os.environ.get("ZZ_PRESTART_GO", "0")),
           "go": os.environ.get("ZZ_PRESTART_GO")}
    with open("ran.json", "w") as f:
        json.dump(out, f)
    time.sleep(60)
"""


def test_guest_agent_prestarts_a_python_runtime_for_the_wake(tmp_path: Path) -> None:
    """A "wake" config whose command is `python3 -m MOD`: the agent starts the interpreter
    ahead (MOD.__main__ imported, working directory /, waiting on its stdin); "sleep" waits
    for its imports; the wake hands it the command, and it runs MOD in the state directory
    with the arguments and ZZ_RECOVER_FROM, as the same process. Stopped by the next
    "sleep", which starts another one ahead."""
    from zz.controld.hypervisor import guest_request

    state = _prestart_guest(tmp_path, "zzpre", {"__main__.py": PRESTART_MAIN,
                            "dep.py": "import time\nAT = time.monotonic()\n"})  # fmt: skip
    pids: list[int] = []
    try:
        with _running_agent(state) as port:
            r = _ping(port, 5)
            assert r["mode"] == "idle" and r["prestarted"] in ("importing", "ready"), r
            r = guest_request(port, {"op": "sleep"}, timeout=30)
            assert r["prestarted"] == "ready" and r["mode"] == "idle", r
            ahead = r["prestarted_pid"]
            pids.append(ahead)
            assert os.readlink(f"/proc/{ahead}/cwd") == "/"
            r = guest_request(port, {"op": "wake", "seq": 7})
            assert r["mode"] == "running" and r["runtime_pid"] == ahead and r["prestarted"] is None
            deadline = time.monotonic() + 10
            while not (state / "ran.json").exists() or not (state / "ran.json").read_text():
                assert time.monotonic() < deadline, "the pre-started runtime did not run"
                time.sleep(0.02)
            ran = json.loads((state / "ran.json").read_text())
            assert ran["pid"] == ahead and ran["preimported"], ran
            assert ran["cwd"] == str(state) and ran["argv"] == ["a", "b"] and ran["recover"] == "7"
            assert ran["go"] is not None and r["counters"]["prestarted_runs"] == 1
            r = guest_request(port, {"op": "sleep"}, timeout=30)
            assert r["mode"] == "idle" and r["prestarted"] == "ready", r
            pids.append(r["prestarted_pid"])
            assert r["prestarted_pid"] != ahead
            with pytest.raises(ProcessLookupError):
                os.kill(ahead, 0)
            # "prestart": false at the wake: the command starts anew, the one ahead is stopped.
            cfg = json.loads((state / "zz-guest.json").read_text())
            (state / "zz-guest.json").write_text(json.dumps({**cfg, "prestart": False}))
            (state / "ran.json").unlink()
            r = guest_request(port, {"op": "wake", "seq": 8})
            assert r["mode"] == "running" and r["runtime_pid"] not in pids, r
            pids.append(r["runtime_pid"])
            deadline = time.monotonic() + 10
            while not (state / "ran.json").exists() or not (state / "ran.json").read_text():
                assert time.monotonic() < deadline, "the runtime command did not run"
                time.sleep(0.02)
            ran = json.loads((state / "ran.json").read_text())
            assert not ran["preimported"] and ran["go"] is None and ran["recover"] == "8", ran
            with pytest.raises(ProcessLookupError):
                os.kill(pids[1], 0)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, 9)


PREPARED_MAIN = """
import json, os, sys, time
def prestart(argv):
    # Read while the share is there, before the sleep (the agent passes the config's args).
    return {"argv": argv, "cwd": os.getcwd(), "at": time.monotonic()}
def main(argv, prepared):
    out = {"argv": argv, "prepared": prepared, "pid": os.getpid(), "cwd": os.getcwd(),
           "recover": os.environ.get("ZZ_RECOVER_FROM"),
           "marks": json.loads(os.environ.get("ZZ_WAKE_MARKS", "{}")),
           "go": float(os.environ["ZZ_PRESTART_GO"])}
    with open("ran.json", "w") as f:
        json.dump(out, f)
    time.sleep(60)
    return 0
"""


def test_guest_agent_prestart_reads_ahead_and_hands_it_to_main(tmp_path: Path) -> None:
    """A module whose __main__ has prestart(argv) and main(argv, prepared) (as
    zz.execution's): the interpreter started ahead calls prestart with the config's
    arguments before the sleep, in /, and the wake calls main with the wake's arguments,
    what prestart returned, and the agent's wake steps (ZZ_WAKE_MARKS) in its environment."""
    from zz.controld.hypervisor import guest_request

    state = _prestart_guest(tmp_path, "zzprep", {"__main__.py": PREPARED_MAIN})
    pids: list[int] = []
    try:
        with _running_agent(state) as port:
            r = guest_request(port, {"op": "sleep"}, timeout=30)
            assert r["prestarted"] == "ready", r
            pids.append(r["prestarted_pid"])
            r = guest_request(port, {"op": "wake", "seq": 9})
            assert r["mode"] == "running" and r["runtime_pid"] == pids[0], r
            deadline = time.monotonic() + 10
            while not (state / "ran.json").exists() or not (state / "ran.json").read_text():
                assert time.monotonic() < deadline, "main() did not run"
                time.sleep(0.02)
            ran = json.loads((state / "ran.json").read_text())
            assert ran["pid"] == pids[0] and ran["argv"] == ["a", "b"] and ran["recover"] == "9"
            assert ran["prepared"]["argv"] == ["a", "b"] and ran["prepared"]["cwd"] == "/"
            assert ran["cwd"] == str(state) and ran["prepared"]["at"] < ran["go"]
            m = ran["marks"]
            assert m["agent_wake"] <= m["mounted"] <= m["config_read"] <= ran["go"]
            # the wake's record follows the hand-over, before the reply
            assert json.loads((state / "zz-wake.json").read_text())["seq"] == 9
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, 9)


def test_guest_agent_bad_config(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "zz-guest.json").write_text('{"command": "not a list"}')
    port = free_port()
    p = subprocess.Popen(
        [sys.executable, str(REPO / "images" / "zz_guest.py"), "--port", str(port),
         "--host", "127.0.0.1", "--state", str(state), "--no-mount"],
    )  # fmt: skip
    try:
        _wait_ok(port, time.monotonic() + 20)  # a broken config does not take it down
        r = _ping(port, 5)
        assert r["mode"] == "idle" and r["counters"]["bad_config"] == 1
    finally:
        p.terminate()
        p.wait(10)


# ---- the agent's own mount once it sees the restore (RestoreWatch) ---------------------------


def test_restore_watch_tells_a_stopped_clock_from_the_rtc_s_whole_seconds() -> None:
    """RTC - clock moves within 1 s while the guest runs (the RTC counts whole seconds);
    only a jump of more than RESTORE_JUMP_S above the highest seen is a restore."""
    agent = _load("zz_guest")
    w = agent.RestoreWatch(jump=1.5)
    assert not any(w.feed(x) for x in (-0.2, -0.9, -0.01, -0.5, -0.99, 0.0))
    assert not w.feed(1.4)  # within the jump: taken as the new highest
    assert not w.feed(2.8)
    assert w.feed(4.5)  # stopped for about 2-3 s: a restore
    w = agent.RestoreWatch(jump=1.5)
    assert not w.feed(100.0) and w.feed(160.0)  # a minute saved


class _FakeShare:
    """An Agent (manage_mount True) whose share, RTC and runtime are stand-ins: mount()
    and unmount() flip a flag and count, rtc_offset() returns what the test sets."""

    def __init__(self, agent_mod: ModuleType, state: Path, rtc: float | None = 0.0) -> None:
        self.a = agent_mod.Agent(state, manage_mount=True)
        self.a.premount = True  # whatever the host's /proc/cmdline says
        self.a.cache = None
        self.a.restore_poll = 0.002
        self.rtc: float | None = rtc
        self.is_mounted = True
        self.mounts = 0
        self.a.rtc_offset = lambda: self.rtc
        self.a.mounted = lambda: self.is_mounted
        self.a.mount = self._mount
        self.a.unmount = self._unmount

    def _mount(self) -> None:
        if not self.is_mounted:
            self.mounts += 1
            self.is_mounted = True

    def _unmount(self) -> None:
        self.is_mounted = False

    def sleep(self, **args: object) -> threading.Thread | None:
        self.a.handle({"op": "sleep", **args})
        return self.a.watcher


def test_guest_agent_mounts_the_share_once_it_sees_the_restore(tmp_path: Path) -> None:
    """After "sleep" the share is unmounted (a save needs that) and stays so while the
    clocks move together; once the RTC jumps ahead (the guest was stopped: saved and
    restored) the agent mounts it by itself, and the wake finds it mounted and reports
    the two steps among its marks."""
    f = _FakeShare(_load("zz_guest"), tmp_path)
    t = f.sleep()
    assert t is not None and not f.is_mounted
    for x in (-0.3, -0.9, -0.1):  # running: no mount, however long
        f.rtc = x
        time.sleep(0.02)
    assert not f.is_mounted and f.mounts == 0 and t.is_alive()
    f.rtc = 7.0  # restored 7 s after the save began
    t.join(10)
    assert not t.is_alive() and f.is_mounted and f.mounts == 1
    assert f.a.counters["premounted"] == 1
    marks = f.a.premount_marks
    assert marks["restore_seen"] <= marks["premounted"]
    r = f.a.handle({"op": "wake", "seq": 9})
    assert f.mounts == 1 and r["recovering_from"] == 9
    assert json.loads((tmp_path / "zz-wake.json").read_text())["seq"] == 9
    wm = f.a.wake_marks
    assert wm["restore_seen"] == marks["restore_seen"] and wm["premounted"] <= wm["agent_wake"]
    assert f.a.premount_marks == {}
    # The next wake (a later sleep, no restore seen) carries no old premount marks.
    f.sleep(premount=False)
    f.a.handle({"op": "wake", "seq": 10})
    assert "restore_seen" not in f.a.wake_marks and f.mounts == 2


def test_guest_agent_restore_watch_gives_way_to_a_request(tmp_path: Path) -> None:
    """A request after the sleep (the wake, a mount, another sleep) ends the watch: it
    never mounts behind the host's back, e.g. between a later sleep and its save."""
    mod = _load("zz_guest")
    f = _FakeShare(mod, tmp_path)
    t = f.sleep()
    assert t is not None
    f.a.handle({"op": "mount"})  # hibernate()'s undo, or a benchmark
    f.a.handle({"op": "sleep", "premount": False})  # unmounted again, no watch
    assert f.a.watcher is None or f.a.watcher is t
    f.rtc = 30.0
    t.join(10)
    assert not t.is_alive() and not f.is_mounted and f.mounts == 1
    assert "premounted" not in f.a.counters
    # Without an RTC nothing is watched; a bad "premount" is refused.
    g = _FakeShare(mod, tmp_path, rtc=None)
    assert g.sleep() is None and g.a.counters["restore_watch_no_rtc"] == 1
    with pytest.raises(ValueError):
        g.a.handle({"op": "sleep", "premount": "yes"})
    # Only with zz.premount=on on the kernel command line (controld's ZZ_GUEST_PREMOUNT=on).
    assert not mod.premount_on_restore("quiet") and mod.premount_on_restore("quiet zz.premount=on")
    hv = pytest.importorskip("zz.controld.hv_libvirt")
    assert hv.guest_tuning({"ZZ_GUEST_PREMOUNT": "on"}) == {"extra_cmdline": "zz.premount=on"}
    with pytest.raises(ValueError):
        hv.guest_tuning({"ZZ_GUEST_PREMOUNT": "off"})
