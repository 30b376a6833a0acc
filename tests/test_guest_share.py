# tests/test_guest_share.py - what the host and a real TCG guest see of each other's writes on
# the state share, for each share a rack uses (9p, virtiofs with virtiofsd's cache=none):
# the guest's atomically replaced status file complete on the host as soon as the guest says
# it is written (controld reads status.json so, and snapshots the dataset so); a file the
# host rewrote in place (same size, mtime put back, as a rollback leaves it) and a directory
# it replaced, seen new by the guest right after; a file the host rewrote while the guest
# was paused (controld's wake notice), seen new after the resume. And where virtiofsd runs:
# started with the domain, there while it is paused, gone with it. docs/images.md "The
# state share". The domain and its directory are removed, also on failure.
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import test_images
from test_images import domain

image = test_images.image  # the cached guest build (skips without root/apt)
conn = test_images.conn  # libvirt, or a skip that says how to set it up
# `long` (two guests, 40 s): the default command runs the runtimes on a rack of virtiofs
# guests (tests/test_vm_drills.py test_runtimes_run_inside_the_guests).
pytestmark = [pytest.mark.slow, pytest.mark.long]

MARK = "ZZ-PROBE "
BIG = 300_000  # a status file of several virtio requests' worth

# Runs in the guest from /state (images/init mounted the share there). Markers are new
# files: each side waits for the other's before it looks.
PROBE = f"""
import json, os, time
S = "/state"
def wait(name):
    while not os.path.exists(os.path.join(S, name)):
        time.sleep(0.05)
def mark(name):
    with open(os.path.join(S, name), "w") as f:
        f.write("1")
def read(rel):
    with open(os.path.join(S, rel)) as f:
        return f.read()
res = {{}}
for k in range(3):  # guest -> host: write a temporary file, rename it over the old one
    with open(S + "/status.json.tmp", "w") as f:
        f.write(json.dumps({{"k": k, "pad": "x" * {BIG}}}))
    os.replace(S + "/status.json.tmp", S + "/status.json")
    mark("g-status-%d" % k)
    wait("h-status-%d" % k)
res["h_before"] = read("h.txt")  # host -> guest: the guest has read (cached) them first
res["d_before"] = sorted(os.listdir(S + "/d"))
res["dx_before"] = read("d/x")
mark("g-read")
wait("h-wrote")
res["h_after"] = read("h.txt")
res["d_after"] = sorted(os.listdir(S + "/d"))
res["dx_after"] = read("d/x")
res["wake_before"] = read("wake.json")  # host -> paused guest
mark("g-read2")
wait("h-wrote2")
res["wake_after"] = read("wake.json")
print({MARK!r} + json.dumps(res), flush=True)
"""


def _wait(path: Path, dom_alive: object, deadline: float) -> None:
    """Until `path` exists; a guard against a guest that died, not a timing check."""
    while not path.exists():
        assert dom_alive(), f"the guest stopped before writing {path.name}"  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {path.name} from the guest"
        time.sleep(0.05)


def _virtiofsd_pids(state: Path) -> list[int]:
    """virtiofsd processes serving `state` (libvirt starts them with -o source=<dir>)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"virtiofsd") and any(str(state).encode() in a for a in argv):
            out.append(int(p.name))
    return out


@pytest.mark.parametrize("share", ["9p", "virtiofs"])
def test_host_and_guest_see_each_others_writes(  # type: ignore[no-untyped-def]
    image, conn, share: str, virtiofs_cache: str = "none"
) -> None:
    """virtiofs_cache: virtiofsd's cache mode; the rack's is none (the test's default)."""
    import libvirt

    name = f"zz-share-{share}-{uuid.uuid4().hex[:6]}"
    work = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    os.chmod(work, 0o755)
    state = work / "state"
    state.mkdir()
    (state / "probe.py").write_text(PROBE)
    (state / "h.txt").write_text("A" * 4096)
    (state / "d").mkdir()
    (state / "d" / "x").write_text("old x")
    (state / "wake.json").write_text('{"seq": 1}\n')
    xml = domain.render_domain(
        name, image.kernel, image.initrd, console_socket=work / "console.sock",
        console_log=work / "console.log", memory_mib=512, state_dir=state,
        state_accessmode="passthrough", cmd="python3 /state/probe.py", domain_type="qemu",
        share=share, virtiofs_cache=virtiofs_cache,
    )  # fmt: skip
    assert ("<cache mode='none'/>" in xml) == (share == "virtiofs" and virtiofs_cache == "none")

    def alive() -> bool:
        try:
            conn.lookupByName(name)  # type: ignore[attr-defined]
            return True
        except libvirt.libvirtError:
            return False

    try:
        dom = conn.createXML(xml, 0)  # type: ignore[attr-defined]
        if share == "virtiofs":
            assert _virtiofsd_pids(state), "libvirt started virtiofsd with the domain"
        deadline = time.monotonic() + 900
        for k in range(3):
            _wait(state / f"g-status-{k}", alive, deadline)
            got = json.loads((state / "status.json").read_text())
            assert got["k"] == k and len(got["pad"]) == BIG
            (state / f"h-status-{k}").write_text("1")
        _wait(state / "g-read", alive, deadline)
        st = (state / "h.txt").stat()
        with open(state / "h.txt", "r+") as f:  # in place: same inode, same size
            f.write("B" * 4096)
        os.utime(state / "h.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
        (state / "d").rename(state / "d.old")
        (state / "d").mkdir()
        (state / "d" / "x").write_text("new x")
        (state / "d" / "y").write_text("y")
        (state / "h-wrote").write_text("1")
        _wait(state / "g-read2", alive, deadline)
        dom.suspend()
        (state / "wake.json").write_text('{"seq": 2, "awake": [0, 2]}\n')
        if share == "virtiofs":
            assert _virtiofsd_pids(state), "virtiofsd stays while the guest is paused"
        dom.resume()
        (state / "h-wrote2").write_text("1")
        while alive():  # the probe's end powers the guest off (on_poweroff destroy)
            assert time.monotonic() < deadline, "the guest did not finish"
            time.sleep(0.2)
        text = (work / "console.log").read_text(errors="replace")
        lines = [ln for ln in text.splitlines() if ln.startswith(MARK)]
        assert len(lines) == 1, text[-3000:]
        res = json.loads(lines[0][len(MARK) :])
        print("probe:", {k: v[:40] if isinstance(v, str) else v for k, v in res.items()})
        assert res["h_before"] == "A" * 4096 and res["h_after"] == "B" * 4096
        assert res["d_before"] == ["x"] and res["d_after"] == ["x", "y"]
        assert res["dx_before"] == "old x" and res["dx_after"] == "new x"
        assert res["wake_before"] == '{"seq": 1}\n'
        assert res["wake_after"] == '{"seq": 2, "awake": [0, 2]}\n'
        # libvirt's virtiofsd ends when QEMU closes its socket: not left behind
        while _virtiofsd_pids(state):
            assert time.monotonic() < deadline, "virtiofsd outlived its domain"
            time.sleep(0.1)
    finally:
        try:
            conn.lookupByName(name).destroy()  # type: ignore[attr-defined]
        except libvirt.libvirtError:
            pass
        shutil.rmtree(work, ignore_errors=True)
