# controld/hv_libvirt.py - the libvirt backend of controld/hypervisor.py: one thin wrapper per
# lifecycle action over libvirt-python, every libvirtError mapped to HypervisorError naming
# the domain. Real guests get images/domain.py's XML; test:/// URIs a minimal one.
"""libvirt backend. URI configurable, qemu:///system by default (DESIGN.md §4).

Domains are transient (createXML): destroy() or a guest power-off removes them, save()
stops and removes them until restore(). On a test:/// URI (libvirt's in-process test
driver: create, suspend, resume, save, restore, setMemory and destroy without any VM) the
domain XML is a minimal <domain type='test'>, so the whole lifecycle runs in
milliseconds. Known limit of that driver: it rejects VIR_DOMAIN_SAVE_BYPASS_CACHE and
jobInfo, so neither is used here.

The calls block (a save of a big guest takes seconds); controld runs them in
asyncio.to_thread. One connection per backend object; libvirt connections are
thread-safe, so concurrent calls on different domains are fine.
"""

from __future__ import annotations

import importlib.util
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar
from xml.sax.saxutils import escape

import libvirt  # type: ignore[import-not-found]

from .hypervisor import (
    OTHER,
    PAUSED,
    RUNNING,
    SHUTOFF,
    DomainNotFound,
    HypervisorError,
    ReplicaSpec,
)

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
            cls = DomainNotFound if e.get_error_code() in _NOT_FOUND else HypervisorError
            raise cls(name, action, str(e)) from e

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
            hostfwds=list(spec.ports), state_dir=spec.state_dir,
            state_accessmode=self.state_accessmode,
            cmd=dm.shell_quote(list(spec.command)) if spec.command else None,
            domain_type=dtype,
        )  # fmt: skip
        return xml

    # ---- lifecycle: one libvirt call each -------------------------------------------------
    def create(self, spec: ReplicaSpec) -> None:
        xml = self.domain_xml(spec)
        self._call(spec.name, "create", lambda: self.conn.createXML(xml, 0))

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
        # The name comes from the image's own XML, so an error can name the domain.
        xml = self._call(str(path), "restore", lambda: self.conn.saveImageGetXMLDesc(str(path)))
        name = ET.fromstring(xml).findtext("name") or str(path)
        self._call(name, "restore", lambda: self.conn.restore(str(path)))
        return name

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
