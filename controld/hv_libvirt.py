# controld/hv_libvirt.py - the libvirt backend of controld/hypervisor.py: one thin wrapper per
# lifecycle action over libvirt-python, every libvirtError mapped to HypervisorError naming
# the domain. Real guests get images/domain.py's XML; test:/// URIs a minimal one.
"""libvirt backend. URI configurable, qemu:///system by default (docs/design.md §8).

Domains are transient (createXML): destroy() or a guest power-off removes them, save()
stops and removes them until restore(). On a test:/// URI (libvirt's in-process test
driver: create, suspend, resume, save, restore, setMemory and destroy without any VM) the
domain XML is a minimal <domain type='test'>, so the whole lifecycle runs in
milliseconds. Known limit of that driver: it rejects VIR_DOMAIN_SAVE_BYPASS_CACHE and
jobInfo, so neither is used here.

Sleeping replicas: hibernate() = guest agent "sleep" + balloon + save, wake_hibernated()
= restore + grow (the paged-out restore), guest_call() = one request to the guest agent
(images/zz_guest.py) on the domain's forward of guest port 7000. docs/controld.md
"Sleeping replicas".

The calls block (a save of a big guest takes seconds); controld runs them in
asyncio.to_thread. One connection per backend object; libvirt connections are
thread-safe, so concurrent calls on different domains are fine.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar
from xml.sax.saxutils import escape

import libvirt  # type: ignore[import-not-found]
import libvirt_qemu  # type: ignore[import-not-found]

from zz.controld.hypervisor import (
    DEFAULT_BALLOON_MIB,
    GUEST_AGENT_PORT,
    OTHER,
    PAUSED,
    RUNNING,
    SHUTOFF,
    DomainNotFound,
    HibernateResult,
    HypervisorError,
    ReplicaSpec,
    guest_request,
)
from zz.procrack import leftover_pids

T = TypeVar("T")
# Where images/ lives in the source tree (it is not installed: docs/images.md).
DEFAULT_IMAGES_DIR = Path(__file__).resolve().parent.parent / "images"
_STATES = {
    libvirt.VIR_DOMAIN_RUNNING: RUNNING,
    libvirt.VIR_DOMAIN_PAUSED: PAUSED,
    libvirt.VIR_DOMAIN_PMSUSPENDED: PAUSED,
    libvirt.VIR_DOMAIN_SHUTOFF: SHUTOFF,
}
_NOT_FOUND = (libvirt.VIR_ERR_NO_DOMAIN,)
_EAGAIN = os.strerror(11)  # "Resource temporarily unavailable", as libvirt words errno EAGAIN
_START_RETRY_DELAYS = (0.05, 0.2, 0.5)  # then one last try, whose error is the answer


def _mapped(name: str, action: str, e: libvirt.libvirtError) -> HypervisorError:
    cls = DomainNotFound if e.get_error_code() in _NOT_FOUND else HypervisorError
    return cls(name, action, str(e))


# The slirp forward to the guest agent, as images/domain.py writes it on the QEMU command line.
_AGENT_FWD = re.compile(rf"hostfwd=tcp:127\.0\.0\.1:(\d+)-:{GUEST_AGENT_PORT}\b")
# The QEMU user network images/domain.py defines, and where restore() keeps the forwards
# it adds to a restored domain only once the guest runs (restore_xml below).
_QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
NETDEV_ID = "zznet"
FWD_NS = "urn:zz:controld:deferred-hostfwd"
ET.register_namespace("qemu", _QEMU_NS)
ET.register_namespace("zzfwd", FWD_NS)
_AGENT_OPT = re.compile(rf"hostfwd=tcp:127\.0\.0\.1:\d+-:{GUEST_AGENT_PORT}")
# A virtiofs share in a live domain's XML.
_VIRTIOFS = re.compile(r"<driver type=['\"]virtiofs['\"]")
BALLOON_SLACK_KIB = 1024  # the balloon driver lands on the target, give or take a page run
BALLOON_STALL_S = 2.0  # no progress for this long: the guest has nothing more to give

# libvirt prints every error to stderr besides raising it; the exception is enough.
libvirt.registerErrorHandler(lambda _ctx, _err: None, None)


def _load_domain_module(images_dir: Path) -> ModuleType:
    """images/domain.py by path (images/ is not a package)."""
    path = images_dir / "domain.py"
    spec = importlib.util.spec_from_file_location("zz_images_domain", path)
    if spec is None or spec.loader is None or not path.exists():
        raise FileNotFoundError(f"{path}: the domain template of the guest image")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


def minimal_xml(spec: ReplicaSpec) -> str:
    """A domain for libvirt's test driver: a name, memory and nothing to boot."""
    cur = spec.current_mib or spec.memory_mib
    return (
        f"<domain type='test'><name>{escape(spec.name)}</name>"
        f"<memory unit='MiB'>{spec.memory_mib}</memory>"
        f"<currentMemory unit='MiB'>{cur}</currentMemory>"
        f"<vcpu>{spec.vcpus}</vcpu><os><type>hvm</type></os></domain>"
    )


def guest_tuning(env: dict[str, str] | None = None) -> dict[str, Any]:
    """render_domain options from controld's environment, read at each domain's creation
    (scripts/bench/web --guest-share-cache/--guest-cpu/--guest-tb-mib set them for the
    guests' rack; docs/performance.md "The web path on guests" measures each):
    ZZ_GUEST_SHARE_CACHE the 9p share's cache= mode in the guest (zz.share_cache= on the
    kernel command line: images/init, images/zz_guest.py), ZZ_GUEST_CPU the CPU model,
    ZZ_GUEST_TB_MIB TCG's translation-block cache, ZZ_GUEST_VIRTIOFS_CACHE virtiofsd's cache
    mode for a virtiofs share (none unless set: the only mode in which the host and the
    guest see each other's writes at once, docs/images.md "The state share"),
    ZZ_GUEST_PRESTART=imports a hibernated spare's runtime started ahead only imports
    (zz.prestart=imports: images/zz_guest.py), ZZ_GUEST_MOUNT=exec the guest agent mounts
    the share with mount(8) (zz.mount=exec); both the baseline of
    scripts/bench/recovery-phases; ZZ_GUEST_PREMOUNT=on the agent mounts the share by
    itself as soon as it sees a restore, before the wake request (zz.premount=on,
    recovery-phases' hibernated-premount). Unset: QEMU's and the kernel's defaults, the
    runtime started ahead reads ahead, the agent calls mount(2) at the wake request."""
    env = os.environ if env is None else env
    out: dict[str, Any] = {}
    words: list[str] = []
    if vcache := env.get("ZZ_GUEST_VIRTIOFS_CACHE"):
        if vcache not in ("none", "auto", "always"):
            raise ValueError(f"ZZ_GUEST_VIRTIOFS_CACHE={vcache!r}")
        out["virtiofs_cache"] = vcache
    if cache := env.get("ZZ_GUEST_SHARE_CACHE"):
        if not (cache.isalpha() and cache.islower()):
            raise ValueError(f"ZZ_GUEST_SHARE_CACHE={cache!r}")
        if cache != "none":
            words.append(f"zz.share_cache={cache}")
    if prestart := env.get("ZZ_GUEST_PRESTART"):
        if prestart != "imports":
            raise ValueError(f"ZZ_GUEST_PRESTART={prestart!r}")
        words.append("zz.prestart=imports")
    if mount := env.get("ZZ_GUEST_MOUNT"):
        if mount != "exec":
            raise ValueError(f"ZZ_GUEST_MOUNT={mount!r}")
        words.append("zz.mount=exec")
    if premount := env.get("ZZ_GUEST_PREMOUNT"):
        if premount != "on":
            raise ValueError(f"ZZ_GUEST_PREMOUNT={premount!r}")
        words.append("zz.premount=on")
    if words:
        out["extra_cmdline"] = " ".join(words)
    if cpu := env.get("ZZ_GUEST_CPU"):
        out["cpu_model"] = cpu
    if tb := env.get("ZZ_GUEST_TB_MIB"):
        out["tb_cache_mib"] = int(tb)
    return out


def restore_xml(xml: str) -> tuple[str, list[str]]:
    """The XML to restore a saved domain with, and the forwards to add once it runs.

    A restored QEMU listens on every forwarded port before the guest runs; a client
    dialling then is accepted by libslirp, whose SYN to the guest waits for an ARP answer
    the stopped guest cannot give, expires, and is sent again only 5.5-6 s later
    (docs/performance.md, the hibernated drills' first_reply). So every `hostfwd=` of the
    `-netdev user,id=zznet` argument but the guest agent's (controld talks to the agent
    right after the restore) is taken out of the command line, listed in the domain's
    <metadata> (element `forwards` in namespace FWD_NS, one <hostfwd> each, the option's
    value), and returned to be added with hostfwd_add. The metadata travels in the live
    XML into the next save file, so the forwards of a domain restored before are taken
    from it as well. ([] and `xml` unchanged: nothing to defer.)"""
    root = ET.fromstring(xml)
    deferred: list[str] = []
    meta = root.find("metadata")
    kept = meta.find(f"{{{FWD_NS}}}forwards") if meta is not None else None
    if kept is not None:
        deferred += [(e.text or "").strip() for e in kept.findall(f"{{{FWD_NS}}}hostfwd")]
    netdev = None
    for arg in root.iter(f"{{{_QEMU_NS}}}arg"):
        opts = (arg.get("value") or "").split(",")
        if opts[0] == "user" and f"id={NETDEV_ID}" in opts:
            netdev = arg
            break
    if netdev is not None:
        opts = (netdev.get("value") or "").split(",")
        now = [o for o in opts if o.startswith("hostfwd=") and not _AGENT_OPT.fullmatch(o)]
        deferred += [o.removeprefix("hostfwd=") for o in now]
        netdev.set("value", ",".join(o for o in opts if o not in now))
    deferred = list(dict.fromkeys(f for f in deferred if f))
    if not deferred:
        return xml, []
    if meta is None:
        meta = ET.Element("metadata")
        root.insert(1 if root.find("name") is not None else 0, meta)
    if kept is not None:
        meta.remove(kept)
    kept = ET.SubElement(meta, f"{{{FWD_NS}}}forwards")
    for fwd in deferred:
        ET.SubElement(kept, f"{{{FWD_NS}}}hostfwd").text = fwd
    return ET.tostring(root, encoding="unicode"), deferred


class LibvirtHypervisor:
    """Replicas as libvirt domains on `uri`.

    domain_type: "qemu" (TCG) or "kvm"; None detects it per image with
    images/domain.py:detect_domain_type (KVM only where a guest really boots under it).
    state_accessmode: how spec.state_dir is shared (images/domain.py: squash needs the
    directory owned by libvirt-qemu, passthrough runs QEMU as root)."""

    kind = "libvirt"

    def __init__(
        self,
        uri: str = "qemu:///system",
        domain_type: str | None = None,
        state_accessmode: str = "squash",
        images_dir: Path | None = None,
    ) -> None:
        self.uri = uri
        self.domain_type = domain_type
        self.state_accessmode = state_accessmode
        self.images_dir = images_dir or DEFAULT_IMAGES_DIR
        self.is_test = uri.startswith("test:")
        try:
            self.conn = libvirt.open(uri)
        except libvirt.libvirtError as e:
            raise HypervisorError("-", "connect", f"{uri}: {e}") from e
        self._domain_mod: ModuleType | None = None

    # ---- plumbing ------------------------------------------------------------------------
    def _call(self, name: str, action: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except libvirt.libvirtError as e:
            raise _mapped(name, action, e) from e

    def _start(self, name: str, action: str, fn: Callable[[], T]) -> T:
        """_call for the calls that start a QEMU process (create, restore). On cgroup v2,
        libvirt loads a BPF device program per domain, and BPF_PROG_LOAD can answer
        EAGAIN (bpf(2): e.g. a signal pending during verification); libvirt does not retry
        it (libbpf does), so one busy moment failed a whole provision in CI. A failed start
        leaves no domain behind, so trying again is safe."""
        for delay in _START_RETRY_DELAYS:
            try:
                return fn()
            except libvirt.libvirtError as e:
                if _EAGAIN not in str(e):
                    raise _mapped(name, action, e) from e
                print(f"[hv_libvirt] {action} {name}: {e}; trying again in {delay:.2f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
            time.sleep(delay)
        return self._call(name, action, fn)

    def _dom(self, name: str, action: str) -> libvirt.virDomain:
        return self._call(name, action, lambda: self.conn.lookupByName(name))

    def domain_xml(self, spec: ReplicaSpec) -> str:
        """The XML create() would define for `spec` on this URI."""
        if self.is_test:
            return minimal_xml(spec)
        if spec.image is None:
            raise HypervisorError(spec.name, "create", "a real libvirt guest needs spec.image")
        if self._domain_mod is None:
            self._domain_mod = _load_domain_module(self.images_dir)
        dm = self._domain_mod
        kernel, initrd = spec.image / "vmlinuz", spec.image / "initrd.gz"
        dtype = self.domain_type or dm.detect_domain_type(kernel, initrd)
        xml: str = dm.render_domain(
            spec.name, kernel, initrd,
            console_socket=spec.run_dir / "console.sock",
            console_log=spec.run_dir / "console.log",
            memory_mib=spec.memory_mib, current_memory_mib=spec.current_mib, vcpus=spec.vcpus,
            hostfwds=list(spec.ports), public_address=spec.public_address,
            public_ports=spec.public_ports, state_dir=spec.state_dir,
            state_accessmode=self.state_accessmode,
            cmd=dm.shell_quote(list(spec.command)) if spec.command else None,
            domain_type=dtype, share=spec.share, **guest_tuning(),
        )  # fmt: skip
        return xml

    # ---- lifecycle: one libvirt call each -------------------------------------------------
    def create(self, spec: ReplicaSpec) -> None:
        xml = self.domain_xml(spec)
        self._start(spec.name, "create", lambda: self.conn.createXML(xml, 0))

    def suspend(self, name: str) -> None:
        dom = self._dom(name, "suspend")
        self._call(name, "suspend", dom.suspend)

    def resume(self, name: str) -> None:
        dom = self._dom(name, "resume")
        self._call(name, "resume", dom.resume)

    def save(self, name: str, path: Path) -> None:
        dom = self._dom(name, "save")
        self._call(name, "save", lambda: dom.save(str(path)))

    def restore(self, path: Path) -> str:
        """Restore the saved domain with its service forwards off until the guest runs,
        then add them (restore_xml). A forward that cannot be added destroys the domain
        and raises HypervisorError(name, "restore"): nobody could reach its service."""
        # The name comes from the image's own XML, so an error can name the domain.
        xml = self._call(str(path), "restore", lambda: self.conn.saveImageGetXMLDesc(str(path)))
        name = ET.fromstring(xml).findtext("name") or str(path)
        dxml, deferred = (xml, []) if self.is_test else restore_xml(xml)
        if not deferred:  # test:/// (no QEMU to add forwards to), or nothing forwarded
            self._start(name, "restore", lambda: self.conn.restore(str(path)))
            return name
        self._start(name, "restore", lambda: self.conn.restoreFlags(str(path), dxml, 0))
        self._add_forwards(name, deferred)
        return name

    def _add_forwards(self, name: str, forwards: list[str]) -> None:
        """hostfwd_add (HMP; QEMU reports a failure in its output, not as an error) of each
        forward to the running domain; on a failure the domain is destroyed."""
        hmp = libvirt_qemu.VIR_DOMAIN_QEMU_MONITOR_COMMAND_HMP
        dom = self._dom(name, "restore")
        try:
            for fwd in forwards:
                cmd = f"hostfwd_add {NETDEV_ID} {fwd}"
                try:
                    out = libvirt_qemu.qemuMonitorCommand(dom, cmd, hmp)
                except libvirt.libvirtError as e:
                    raise _mapped(name, "restore", e) from e
                if out.strip():
                    raise HypervisorError(name, "restore", f"{cmd}: {out.strip()}")
        except HypervisorError:
            try:
                dom.destroy()
            except libvirt.libvirtError:
                pass  # already gone
            raise

    def discard(self, path: Path) -> None:
        """A libvirt save file holds the whole guest; deleting it is all there is."""
        Path(path).unlink(missing_ok=True)

    def set_memory(self, name: str, kib: int) -> None:
        dom = self._dom(name, "set_memory")
        self._call(name, "set_memory", lambda: dom.setMemory(int(kib)))

    def destroy(self, name: str) -> None:
        dom = self._dom(name, "destroy")
        self._call(name, "destroy", dom.destroy)

    def state(self, name: str) -> str:
        dom = self._dom(name, "state")
        code = self._call(name, "state", dom.state)[0]
        return _STATES.get(code, OTHER)

    def memory_kib(self, name: str) -> int:
        """The domain's current memory (balloon target) in KiB."""
        dom = self._dom(name, "memory")
        return int(self._call(name, "memory", dom.info)[2])

    def list(self) -> list[str]:
        flags = libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE
        doms = self._call("-", "list", lambda: self.conn.listAllDomains(flags))
        return sorted(d.name() for d in doms)

    def close(self) -> None:
        try:
            self.conn.close()
        except libvirt.libvirtError:
            pass

    def cpu_shares(self, name: str) -> int | None:
        """The domain's CPU weight against the other domains (libvirt's `cpu_shares`: the
        `cpu.shares` of its cgroup on cgroup v1, `cpu.weight` on v2); None on test:/// or
        when libvirt does not say."""
        if self.is_test:
            return None
        dom = self._dom(name, "cpu shares")
        try:  # libvirt refuses when the cgroup CPU controller is not there
            params = self._call(name, "cpu shares", dom.schedulerParameters)
        except HypervisorError:
            return None
        shares = params.get("cpu_shares")
        return int(shares) if shares is not None else None

    def set_cpu_shares(self, name: str, shares: int) -> bool:
        """Set the running domain's CPU weight (cpu_shares, above). libvirt puts each domain
        in a cgroup of its own, whose weight is what its threads compete with against the
        other guests: a spare booting under TCG (a whole core for ~30 s) gets a small one,
        so the active replicas, e.g. one recovering right after a conviction, keep theirs.
        (Nice on its threads does not do that: it ranks them only against the other
        threads of their own cgroup.) False on test:/// or when libvirt refused."""
        if self.is_test:
            return False
        dom = self._dom(name, "cpu shares")
        try:
            self._call(name, "cpu shares", lambda: dom.setSchedulerParametersFlags(
                {"cpu_shares": shares}, libvirt.VIR_DOMAIN_AFFECT_LIVE))  # fmt: skip
        except HypervisorError:
            return False
        return True

    def set_nice(self, name: str, nice: int) -> bool:
        """Renice every thread of the domain's QEMU process (a local URI only; nice is per
        thread on Linux): the spare's low priority where libvirt gives domains no cgroup of
        their own (set_cpu_shares failed). False if the process was not found or not
        reniced."""
        if self.is_test or not self.uri.endswith(":///system"):
            return False
        done = False
        for pid in leftover_pids([f"guest={name},"]):
            try:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    os.setpriority(os.PRIO_PROCESS, int(task.name), nice)
                    done = True
            except (OSError, ValueError):
                continue
        return done

    # ---- sleeping replicas: sequences of the calls above ---------------------------------
    def agent_port(self, name: str) -> int | None:
        """The host port forwarded to the guest agent, read from the live domain's XML (so
        it also works for a domain this object did not create, e.g. after a restart of
        controld). None: no such forward (test:/// domains, other commands)."""
        dom = self._dom(name, "agent_port")
        m = _AGENT_FWD.search(self._call(name, "agent_port", lambda: dom.XMLDesc(0)))
        return int(m.group(1)) if m else None

    def guest_call(self, name: str, op: str, timeout: float = 10.0, **args: Any) -> dict[str, Any]:
        """One request to the guest agent (images/zz_guest.py); its reply. A guest that
        does not answer, or answers {"ok": false}, raises HypervisorError(name, "guest
        <op>")."""
        action = f"guest {op}"
        port = self.agent_port(name)
        if port is None:
            raise HypervisorError(name, action, f"no forward to guest port {GUEST_AGENT_PORT}")
        try:
            reply = guest_request(port, {"op": op, **args}, timeout)
        except (OSError, ValueError) as e:
            raise HypervisorError(name, action, f"guest agent on 127.0.0.1:{port}: {e}") from e
        if reply.get("ok") is not True:
            raise HypervisorError(name, action, str(reply.get("error", reply)))
        return reply

    def _actual_kib(self, dom: libvirt.virDomain) -> int:
        """The balloon's current size: QEMU's "actual" (query-balloon), else info()."""
        try:
            actual = dom.memoryStats().get("actual")
        except libvirt.libvirtError:
            actual = None  # the test driver has no memory stats
        return int(actual) if actual else int(dom.info()[2])

    def _wait_balloon(
        self, dom: libvirt.virDomain, name: str, target_kib: int, timeout: float
    ) -> tuple[int, bool]:
        """Poll the balloon until it reaches the target, `timeout` passes, or it stops
        shrinking for BALLOON_STALL_S: a guest with less free memory than asked for
        settles above the target (autodeflate gives pages back under memory pressure),
        and waiting longer would only delay the save. (actual KiB, reached)."""
        start = time.monotonic()
        best, best_at = None, start
        while True:
            actual = self._call(name, "hibernate", lambda: self._actual_kib(dom))
            now = time.monotonic()
            if actual <= target_kib + BALLOON_SLACK_KIB:
                return actual, True
            if best is None or actual < best:
                best, best_at = actual, now
            if now - start > timeout or now - best_at > BALLOON_STALL_S:
                return actual, False
            time.sleep(0.05)

    def hibernate(
        self,
        name: str,
        path: Path,
        balloon_mib: int | None = DEFAULT_BALLOON_MIB,
        timeout: float = 60.0,
    ) -> HibernateResult:
        """Guest agent "sleep" (when the domain has an agent forward), balloon down to
        balloon_mib and wait for the guest to get there (at most `timeout`, or until the
        balloon stops moving; a guest that does not get there is saved anyway, with a
        bigger file: HibernateResult.reached), save to `path`. balloon_mib=None: plain save. On a
        failure after the guest went to sleep, its memory is grown back and its share
        mounted again (best effort) before the error goes up: the domain keeps running.
        A paused domain (paused -> hibernated) is resumed first, since a paused guest
        cannot unmount its share, and paused again if the hibernation fails."""
        dom = self._dom(name, "hibernate")
        if _VIRTIOFS.search(self._call(name, "hibernate", lambda: dom.XMLDesc(0))):
            # QEMU 7.2 refuses to save it ("vhost-user-fs" is not migratable); say so
            # before the guest's runtime is stopped for nothing.
            raise HypervisorError(name, "hibernate", "a guest with a virtiofs share cannot be"
                                  " saved (docs/images.md \"The state share\")")  # fmt: skip
        full_kib = self._call(name, "hibernate", lambda: int(dom.maxMemory()))
        port = self.agent_port(name)
        was_paused = self.state(name) == PAUSED
        t0 = time.monotonic()
        if was_paused:
            self._call(name, "hibernate", dom.resume)
        try:
            if port is not None:
                self.guest_call(name, "sleep", timeout=30.0)
        except HypervisorError:
            if was_paused:
                self._call(name, "hibernate", dom.suspend)
            raise
        t1 = time.monotonic()
        balloon_kib: int | None = None
        reached = True
        try:
            if balloon_mib is not None:
                target = int(balloon_mib) * 1024
                if not 0 < target <= full_kib:
                    raise HypervisorError(
                        name, "hibernate", f"balloon {balloon_mib} MiB outside 1..{full_kib >> 10}"
                    )
                self._call(name, "hibernate", lambda: dom.setMemory(target))
                balloon_kib, reached = self._wait_balloon(dom, name, target, timeout)
            t2 = time.monotonic()
            self._call(name, "save", lambda: dom.save(str(path)))
        except HypervisorError:
            self._undo_sleep(name, full_kib, port, was_paused)
            raise
        t3 = time.monotonic()
        return HibernateResult(
            name=name, path=Path(path), full_kib=full_kib, balloon_kib=balloon_kib,
            reached=reached, sleep_s=t1 - t0, balloon_s=t2 - t1, save_s=t3 - t2,
            file_bytes=Path(path).stat().st_size,
        )  # fmt: skip

    def _undo_sleep(self, name: str, full_kib: int, port: int | None, pause: bool) -> None:
        try:
            dom = self.conn.lookupByName(name)
            dom.setMemory(full_kib)
        except libvirt.libvirtError:
            return  # the domain is gone (or cannot be grown): nothing to mount either
        if port is not None:
            try:
                self.guest_call(name, "mount")
            except HypervisorError:
                pass
        if pause:
            try:
                dom.suspend()
            except libvirt.libvirtError:
                pass

    def wake_hibernated(self, path: Path, full_mib: int) -> str:
        """Paged-out restore: restore `path`, then grow the balloon to full_mib (the guest
        runs meanwhile; it gets the memory back as the balloon deflates). The domain's
        name. A failed grow raises HypervisorError with the domain left running."""
        name = self.restore(path)
        dom = self._dom(name, "wake_hibernated")
        kib = int(full_mib) * 1024
        try:
            self._call(name, "wake_hibernated", lambda: dom.setMemory(kib))
        except HypervisorError as e:
            raise HypervisorError(
                name,
                "wake_hibernated",
                f"restored, but growing to {full_mib} MiB failed: {e.detail}",
            ) from e
        return name
