# domain.py - libvirt domain XML of a ZZ guest from images/domain.xml (string.Template), and
# the domain type check (kvm only where a guest really boots under it; docs/design.md §8, §9).
# docs/images.md.
from __future__ import annotations

import base64
import json
import os
import shlex
import subprocess
import time
from pathlib import Path
from string import Template
from xml.sax.saxutils import escape, quoteattr

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "domain.xml"
GUEST_PORT = 7000  # zz_guest.py, the guest agent (the default command) listens here
# QEMU 7.2's virtiofsd (Debian's qemu-system-common); libvirt finds it by its vhost-user
# descriptor when it is elsewhere.
VIRTIOFSD = "/usr/lib/qemu/virtiofsd"
VIRTIOFS_CACHE_MODES = ("none", "auto", "always")


def kernel_cmdline(cmd: str | None = None, extra: str = "") -> str:
    """The guest kernel command line; cmd (a sh command) goes base64-encoded (zz.cmd64)."""
    # no_timer_check: the kernel's check that the timer interrupt arrives (check_timer, at
    # boot) busy-waits a number of loops calibrated moments before; a TCG guest whose QEMU
    # gets little CPU (a spare booting at a small CPU weight on a loaded host) mis-times
    # it, finds "no timer" and panics ("..MP-BIOS bug: 8254 timer not connected to
    # IO-APIC", then a trace in start_kernel): the domain stops while booting.
    parts = ["console=ttyS0", "quiet", "panic=-1", "no_timer_check"]
    if cmd is not None:
        parts.append("zz.cmd64=" + base64.b64encode(cmd.encode()).decode())
    if extra:
        parts.append(extra)
    return " ".join(parts)


def render_domain(
    name: str,
    kernel: Path | str,
    initrd: Path | str,
    *,
    console_socket: Path | str,
    console_log: Path | str | None = None,
    memory_mib: int = 512,
    current_memory_mib: int | None = None,
    vcpus: int = 1,
    hostfwds: list[tuple[int, int]] | None = None,
    public_address: str = "127.0.0.1",
    public_ports: tuple[int, ...] = (),
    state_dir: Path | str | None = None,
    state_accessmode: str = "squash",
    cmd: str | None = None,
    extra_cmdline: str = "",
    domain_type: str = "qemu",
    share: str = "9p",
    virtiofs_cache: str = "none",
    cpu_model: str | None = None,
    tb_cache_mib: int | None = None,
) -> str:
    """Domain XML. hostfwds: (host port on 127.0.0.1, guest port) pairs; a guest port in
    public_ports is forwarded from public_address instead (the host's rack address: other
    hosts reach the execution replica there, while the agent stays local). state_dir: a host
    directory shared as 9p tag "state" (the guest mounts it at /state); accessmode 'squash'
    needs it owned by libvirt-qemu, 'passthrough' adds a static DAC seclabel +0:+0 so QEMU
    runs as root (docs/design.md §9). share "virtiofs" shares it through virtiofsd instead
    (shared memfd memory backing, as vhost-user needs; QEMU 7.2 cannot save such a guest, so
    it cannot hibernate), virtiofsd's cache mode virtiofs_cache (none: no guest caching of
    entries, attributes or pages, so each side sees the other's writes at once; auto or
    always measure what the guest's cache would give), and zz.share=virtiofs on the kernel
    command line tells images/init and the agent to mount that. cpu_model: libvirt's <cpu>
    model (None: QEMU's default, qemu64 under TCG). tb_cache_mib: TCG's translation-block
    cache (<tcg><tb-cache>; None: QEMU's default). docs/performance.md "The web path on
    guests" measures each."""
    if share not in ("9p", "virtiofs"):
        raise ValueError(f"share {share!r}")
    if virtiofs_cache not in VIRTIOFS_CACHE_MODES:
        raise ValueError(f"virtiofs cache mode {virtiofs_cache!r}")
    if domain_type not in ("qemu", "kvm"):
        raise ValueError(f"domain type {domain_type!r}")
    fwd = "".join(
        f",hostfwd=tcp:{public_address if g in public_ports else '127.0.0.1'}:{int(h)}-:{int(g)}"
        for h, g in hostfwds or []
    )
    filesystems = ""
    seclabel = ""
    memory_backing = ""
    if state_dir is not None and share == "virtiofs":
        # libvirt starts virtiofsd (as root: it serves the directory as it is, no
        # accessmode) before QEMU, and it ends when QEMU closes its socket (the domain's
        # end). No writeback cache (virtiofsd's default, said here): a guest write() reaches
        # the host file before it returns, as with 9p. No xattrs: the runtime uses none.
        # libvirt 9.0 knows cache modes none and always; virtiofsd's own default is auto.
        binary = f" path={quoteattr(VIRTIOFSD)}" if Path(VIRTIOFSD).exists() else ""
        cache = "" if virtiofs_cache == "auto" else f"<cache mode='{virtiofs_cache}'/>"
        filesystems = (
            "    <filesystem type='mount' accessmode='passthrough'>\n"
            "      <driver type='virtiofs'/>\n"
            f"      <binary{binary} xattr='off'>{cache}</binary>\n"
            f"      <source dir={quoteattr(str(state_dir))}/>\n"
            "      <target dir='state'/>\n"
            "    </filesystem>"
        )
        memory_backing = (
            "  <memoryBacking><source type='memfd'/><access mode='shared'/></memoryBacking>\n"
        )
        extra_cmdline = " ".join(filter(None, ["zz.share=virtiofs", extra_cmdline]))
    elif state_dir is not None:
        if state_accessmode not in ("squash", "passthrough", "mapped"):
            raise ValueError(f"accessmode {state_accessmode!r}")
        # multidevs='remap': the share may hold another file system (a guest's ZFS
        # dataset at live/); QEMU's default only warns when inode numbers of the two
        # collide, and the guest's 9p client would take two files for one.
        filesystems = (
            f"    <filesystem type='mount' accessmode='{state_accessmode}' multidevs='remap'>\n"
            f"      <source dir={quoteattr(str(state_dir))}/>\n"
            "      <target dir='state'/>\n"
            "    </filesystem>"
        )
        if state_accessmode == "passthrough":
            seclabel = (
                "  <seclabel type='static' model='dac' relabel='no'><label>+0:+0</label></seclabel>"
            )
    log = ""
    if console_log is not None:
        log = f"<log file={quoteattr(str(console_log))} append='off'/>"
    return Template(TEMPLATE.read_text()).substitute(
        domain_type=domain_type,
        name=escape(name),
        memory_mib=int(memory_mib),
        current_memory_mib=int(current_memory_mib or memory_mib),
        vcpus=int(vcpus),
        kernel=escape(str(kernel)),
        initrd=escape(str(initrd)),
        cmdline=escape(kernel_cmdline(cmd, extra_cmdline)),
        console_socket=escape(str(console_socket)),
        console_log=log,
        filesystems=filesystems,
        seclabel=seclabel,
        memory_backing=memory_backing,
        cpu=_cpu_xml(cpu_model),
        tcg=(
            f"    <tcg><tb-cache unit='MiB'>{int(tb_cache_mib)}</tb-cache></tcg>\n"
            if tb_cache_mib and domain_type == "qemu"
            else ""
        ),
        hostfwds=escape(fwd),
    )


def _cpu_xml(model: str | None) -> str:
    """<cpu>: "max" is libvirt's mode='maximum' (every feature the accelerator can give),
    any other name a custom model; None: none (QEMU's default)."""
    if not model:
        return ""
    if model == "max":
        return "  <cpu mode='maximum' check='none'/>\n"
    return (
        f"  <cpu mode='custom' match='exact' check='none'><model fallback='forbid'>"
        f"{escape(model)}</model></cpu>\n"
    )


def _kvm_boots(kernel: Path, initrd: Path, timeout: float) -> bool:
    """Boot the image under KVM with a command that powers off at once."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    argv = [
        "qemu-system-x86_64", "-accel", "kvm", "-M", "pc", "-m", "256", "-nodefaults",
        "-nographic", "-no-reboot", "-serial", "stdio", "-kernel", str(kernel),
        "-initrd", str(initrd), "-append", kernel_cmdline("echo zz-kvm-ok"),
    ]  # fmt: skip
    try:
        p = subprocess.run(argv, capture_output=True, timeout=timeout)
    except (subprocess.TimeoutExpired, OSError):
        return False
    return p.returncode == 0 and b"zz-kvm-ok" in p.stdout


def detect_domain_type(
    kernel: Path, initrd: Path, cache_dir: Path | None = None, timeout: float = 6.0
) -> str:
    """'kvm' if the image boots to its command under KVM within timeout (a TCG boot takes
    ~8 s, a KVM one ~1-2 s), else 'qemu'. ZZ_DOMAIN_TYPE=kvm|qemu overrides. The answer is
    cached per image, QEMU binary and host kernel in cache_dir/domain-type.json."""
    forced = os.environ.get("ZZ_DOMAIN_TYPE")
    if forced:
        return forced
    if not Path("/dev/kvm").exists():
        return "qemu"
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True)
    key = (
        f"{Path(initrd).resolve()}|{qemu.stdout.splitlines()[0] if qemu.stdout else ''}|"
        f"{os.uname().release}"
    )
    cache = Path(cache_dir or Path(initrd).parent) / "domain-type.json"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return str(known[key])
    t0 = time.monotonic()
    answer = "kvm" if _kvm_boots(Path(kernel), Path(initrd), timeout) else "qemu"
    known[key] = answer
    try:
        cache.write_text(json.dumps(known, indent=1) + "\n")
    except OSError:
        pass
    print(f"[images] KVM check: {answer} ({time.monotonic() - t0:.1f} s)")
    return answer


def shell_quote(argv: list[str]) -> str:
    """argv as one sh command for render_domain(cmd=...)."""
    return shlex.join(argv)
