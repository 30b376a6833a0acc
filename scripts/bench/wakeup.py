#!/usr/bin/env python3
# scripts/bench/wakeup.py - the ZZ §6.5.3 wake-up table measured here in one run: unpause,
# plain restore and paged-out restore of one 2 GiB guest, each until its agent answers, and
# a ZFS clone of the replica's dataset. Writes bench-results/wakeup.json. docs/controld.md.
"""Wake-up benchmark (scripts/bench/wakeup [--quick]).

One guest on qemu:///system (the image of images/build.py, 1 vCPU, 2 GiB, TCG where KVM
does not work), its state directory a zfs-fuse dataset shared in with virtio-9p. Every
figure is the time from the first hypervisor call of the wake-up until the guest agent
(images/zz_guest.py, the runtime's stand-in before a service exists) answers a ping on
its forwarded port with its JSON status: an application-level answer from Python in the
guest, not a TCP accept (slirp accepts on the host side even while the guest sleeps).

  unpause          suspend, wait, then resume -> answer
  plain restore    the guest holds `--dirty-mib` of non-zero memory (the agent's ballast,
                   standing in for an application's working set), hibernate without the
                   balloon (save), restore -> answer
  paged-out        the ballast freed, hibernate with the balloon at `--balloon-mib`
                   (controld's hibernate(): agent sleep, balloon, save), then
                   wake_hibernated(): restore + grow back to the full size -> answer
  zfs clone        `zfs clone` of a snapshot of the replica's dataset (zfs-fuse)

Save files are evicted from the host page cache (fsync + POSIX_FADV_DONTNEED on that file
only) before each restore: a sleeping replica's file has usually left the cache by the
time it is woken, and the cold read is the cost that paging out saves.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import load_images_module  # noqa: E402

from zz.controld.hypervisor import (  # noqa: E402
    GUEST_AGENT_PORT,
    HypervisorError,
    ReplicaSpec,
    guest_request,
    open_backend,
)
from zz.ports import free_port  # noqa: E402
from zz.snapshots.zfs import (  # noqa: E402
    create_file_pool,
    destroy_pool,
    ensure_zfs_daemon,
    pool_exists,
    run_zfs,
)

TARGET_UNPAUSE_S = 0.050
TARGET_PAGED_OUT_S = 2.0
TARGET_SPEEDUP = 3.0
PAPER = {"unpause_s": 0.29, "paged_out_restore_s": 5.88}  # ZZ §6.5.3, as the issue cites
POOL_SIZE = 256 << 20
STATE_MIB = 32  # files in the replica's dataset (what the clone is of)


def wait_answer(port: int, t0: float, limit: float = 120.0) -> tuple[float, dict[str, Any]]:
    """Seconds from t0 until the guest agent answers a ping, and the answer."""
    while True:
        try:
            reply = guest_request(port, {"op": "ping"}, timeout=1.0)
            if reply.get("ok") is True:
                return time.monotonic() - t0, reply
        except (OSError, ValueError):
            pass
        if time.monotonic() - t0 > limit:
            raise RuntimeError(f"the guest agent on 127.0.0.1:{port} did not answer")
        time.sleep(0.001)


def evict(path: Path) -> None:
    """Drop this one file's pages from the host page cache (a cold restore)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def wait_memory(hv: Any, name: str, kib: int, limit: float = 120.0) -> float | None:
    """Seconds until the balloon has given the guest `kib` back (so a ballast fits), None
    if it did not within `limit` (autodeflate still lets the ballast in, more slowly)."""
    t0 = time.monotonic()
    dom = hv.conn.lookupByName(name)
    while hv._actual_kib(dom) < kib - 1024:
        if time.monotonic() - t0 > limit:
            print(f"  (memory of {name} not back to {kib >> 10} MiB after {limit:.0f} s)")
            return None
        time.sleep(0.05)
    return time.monotonic() - t0


def stats(xs: list[float]) -> dict[str, Any]:
    return {
        "median_s": statistics.median(xs),
        "min_s": min(xs),
        "max_s": max(xs),
        "n": len(xs),
        "samples_s": [round(x, 4) for x in xs],
    }


def make_state(mnt: Path) -> None:
    """A replica's dataset: a guest config (idle agent) and STATE_MIB of files."""
    (mnt / "zz-guest.json").write_text('{"start": "wake"}\n')
    data = mnt / "data"
    data.mkdir()
    for i in range(STATE_MIB):
        (data / f"f{i:03d}").write_bytes(os.urandom(1 << 20))


def measure_unpause(hv: Any, name: str, port: int, reps: int) -> list[dict[str, float]]:
    out = []
    for _ in range(reps):
        hv.suspend(name)
        time.sleep(0.3)
        t0 = time.monotonic()
        hv.resume(name)
        t_resume = time.monotonic() - t0
        total, _ = wait_answer(port, t0)
        out.append({"resume_call_s": t_resume, "answer_s": total, "loadavg1": os.getloadavg()[0]})
    return out


def measure_restores(
    hv: Any, name: str, port: int, tmp: Path, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    plain, paged = [], []
    full_kib = args.memory_mib * 1024
    for i in range(args.reps):
        # Plain: the whole dirty guest goes to disk and comes back.
        wait_memory(hv, name, full_kib)
        t0 = time.monotonic()
        hv.guest_call(name, "ballast", timeout=300, mib=args.dirty_mib)
        dirty_s = time.monotonic() - t0
        save = tmp / f"plain-{i}.save"
        res = hv.hibernate(name, save, balloon_mib=None)
        evict(save)
        t0 = time.monotonic()
        hv.restore(save)
        t_restore = time.monotonic() - t0
        total, reply = wait_answer(port, t0)
        assert reply["ballast_mib"] == args.dirty_mib, reply  # the memory came back
        hv.discard(save)
        plain.append(
            {"answer_s": total, "restore_call_s": t_restore, "file_bytes": res.file_bytes,
             "save_s": res.save_s, "dirty_s": dirty_s, "loadavg1": os.getloadavg()[0]}
        )  # fmt: skip
        print(
            f"  [{i + 1}/{args.reps}] plain: save {res.save_s:.2f} s"
            f" ({res.file_bytes / 1e9:.2f} GB), restore -> answer {total:.3f} s",
            flush=True,
        )
        # Paged-out: what a sleeping replica holds is freed, the balloon takes the rest.
        hv.guest_call(name, "ballast", timeout=60, mib=0)
        save = tmp / f"paged-{i}.save"
        res = hv.hibernate(name, save, balloon_mib=args.balloon_mib)
        evict(save)
        t0 = time.monotonic()
        hv.wake_hibernated(save, args.memory_mib)
        t_wake = time.monotonic() - t0
        total, _ = wait_answer(port, t0)
        t1 = time.monotonic()
        woke = hv.guest_call(name, "wake", timeout=30, seq=i)
        mount_s = time.monotonic() - t1
        assert woke["state_mounted"], woke
        grown = wait_memory(hv, name, full_kib)
        # From the restore until the balloon is fully deflated.
        grown_s = None if grown is None else time.monotonic() - t0
        hv.discard(save)
        paged.append(
            {"answer_s": total, "restore_and_grow_call_s": t_wake, "file_bytes": res.file_bytes,
             "save_s": res.save_s, "balloon_s": res.balloon_s, "sleep_s": res.sleep_s,
             "balloon_reached_kib": res.balloon_kib, "balloon_target_reached": res.reached,
             "wake_mount_s": mount_s, "fully_grown_after_s": grown_s,
             "loadavg1": os.getloadavg()[0]}
        )  # fmt: skip
        print(
            f"  [{i + 1}/{args.reps}] paged-out: balloon {res.balloon_s:.2f} s to"
            f" {(res.balloon_kib or 0) >> 10} MiB, save {res.save_s:.2f} s"
            f" ({res.file_bytes / 1e6:.0f} MB), restore + grow -> answer {total:.3f} s",
            flush=True,
        )
    return plain, paged


def measure_clones(pool: str, dataset: str, tmp: Path, reps: int) -> list[float]:
    out = []
    for i in range(reps):
        clone = f"{pool}/clone-{i}"
        mnt = tmp / f"clone-{i}"
        t0 = time.monotonic()
        run_zfs(["zfs", "clone", "-o", f"mountpoint={mnt}", f"{dataset}@ckpt-1", clone])
        out.append(time.monotonic() - t0)
        run_zfs(["zfs", "destroy", clone], retry_busy=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 repetitions instead of 5")
    ap.add_argument("--reps", type=int, help="repetitions of each measurement (>= 1)")
    ap.add_argument("--memory-mib", type=int, default=2048)
    ap.add_argument("--dirty-mib", type=int, default=1300, help="ballast before a plain save")
    ap.add_argument("--balloon-mib", type=int, default=192, help="balloon target when paged out")
    ap.add_argument("--uri", default=os.environ.get("ZZ_LIBVIRT_URI", "qemu:///system"))
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "wakeup.json")
    args = ap.parse_args()
    args.reps = args.reps or (3 if args.quick else 5)
    if args.reps < 1 or not 0 < args.balloon_mib < args.memory_mib:
        ap.error("--reps >= 1 and 0 < --balloon-mib < --memory-mib")
    if os.geteuid() != 0:
        print("needs root (libvirt qemu:///system, zfs-fuse, the image cache)", file=sys.stderr)
        return 1

    started = time.monotonic()
    load_before = list(os.getloadavg())
    build = load_images_module("build")
    domain = load_images_module("domain")
    img = build.build()
    dtype = domain.detect_domain_type(img.kernel, img.initrd)
    ensure_zfs_daemon()

    tag = uuid.uuid4().hex[:6]
    name = f"zz-wakeup-{tag}"
    pool = f"zzwake{tag}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}-", dir="/var/tmp"))
    os.chmod(tmp, 0o755)  # QEMU writes the console socket and log here
    vdev = tmp / "vdev.img"
    dataset = f"{pool}/replica"
    mnt = tmp / "replica"
    port = free_port()
    # passthrough: QEMU (as root) reads the FUSE mount of zfs-fuse (docs/design.md §9).
    hv: Any = open_backend("libvirt", uri=args.uri, domain_type=dtype,
                           state_accessmode="passthrough")  # fmt: skip
    created = False
    doc: dict[str, Any] = {}
    try:
        create_file_pool(pool, vdev, POOL_SIZE)
        run_zfs(["zfs", "create", "-o", f"mountpoint={mnt}", dataset])
        make_state(mnt)
        t0 = time.monotonic()
        run_zfs(["zfs", "snapshot", f"{dataset}@ckpt-1"])
        snapshot_s = time.monotonic() - t0

        spec = ReplicaSpec(
            name, tmp, image=img.directory, memory_mib=args.memory_mib, vcpus=1,
            ports=((port, GUEST_AGENT_PORT),), state_dir=mnt,
        )  # fmt: skip
        print(f"{name}: {args.memory_mib} MiB, 1 vCPU, {dtype}, image {img.key}", flush=True)
        t0 = time.monotonic()
        hv.create(spec)
        created = True
        boot_s, hello = wait_answer(port, t0)
        assert hello["state_mounted"] and hello["mode"] == "idle", hello
        print(f"  booted, agent answers after {boot_s:.1f} s", flush=True)

        unpause = measure_unpause(hv, name, port, args.reps)
        print(
            "  unpause -> answer: "
            + ", ".join(f"{u['answer_s'] * 1000:.1f}" for u in unpause)
            + " ms",
            flush=True,
        )
        plain, paged = measure_restores(hv, name, port, tmp, args)
        clones = measure_clones(pool, dataset, tmp, args.reps)
        print("  zfs clone: " + ", ".join(f"{c * 1000:.0f}" for c in clones) + " ms", flush=True)
    finally:
        if created:
            try:
                hv.destroy(name)
            except HypervisorError as e:
                print(f"destroy {name}: {e}", file=sys.stderr)
        hv.close()
        if pool_exists(pool):
            destroy_pool(pool, vdev)
        shutil.rmtree(tmp, ignore_errors=True)

    total_s = time.monotonic() - started
    u = stats([x["answer_s"] for x in unpause])
    pl = stats([x["answer_s"] for x in plain])
    po = stats([x["answer_s"] for x in paged])
    zc = stats(clones)
    speedup = pl["median_s"] / po["median_s"]
    doc = {
        "unpause": {**u, "runs": unpause},
        "plain_restore": {**pl, "runs": plain},
        "paged_out_restore": {**po, "runs": paged},
        "zfs_clone": {**zc, "snapshot_s": snapshot_s, "dataset_mib": STATE_MIB},
        "plain_over_paged_out": speedup,
        "targets": {
            "unpause_le_50ms": u["median_s"] <= TARGET_UNPAUSE_S,
            "paged_out_le_2s": po["median_s"] <= TARGET_PAGED_OUT_S,
            "paged_out_3x_faster_than_plain": speedup >= TARGET_SPEEDUP,
        },
        "paper": PAPER,
        "setup": {
            "guest": f"1 vCPU, {args.memory_mib} MiB, domain type {dtype}, image {img.key}",
            "dirty_mib_before_plain_save": args.dirty_mib,
            "balloon_target_mib": args.balloon_mib,
            "answering": "the guest agent's JSON reply to {'op': 'ping'} on the forwarded port",
            "cache": "each save file evicted from the host page cache before its restore",
            "boot_to_answer_s": boot_s,
            "reps": args.reps,
            "total_run_s": total_s,
        },
        "machine": {
            "loadavg_before": load_before,
            "loadavg_after": list(os.getloadavg()),
            "nproc": os.cpu_count(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")

    gb = statistics.median(x["file_bytes"] for x in plain) / 1e9
    mb = statistics.median(x["file_bytes"] for x in paged) / 1e6
    print(
        f"\nwake-up of a {args.memory_mib} MiB guest until its agent answers"
        f" (median of {args.reps})"
    )
    print(f"{'mechanism':<44}{'median':>10}{'min':>10}{'max':>10}  target")
    rows = [
        ("unpause", u, f"<= {TARGET_UNPAUSE_S * 1000:.0f} ms (paper 0.29 s)"),
        (f"plain restore ({gb:.2f} GB file)", pl, ""),
        (f"paged-out restore + grow ({mb:.0f} MB file)", po,
         f"<= {TARGET_PAGED_OUT_S:.0f} s, >= {TARGET_SPEEDUP:.0f}x plain (paper 5.88 s)"),
        (f"zfs clone ({STATE_MIB} MiB dataset)", zc, ""),
    ]  # fmt: skip
    for label, s, target in rows:
        print(f"{label:<44}{s['median_s']:>9.3f}s{s['min_s']:>9.3f}s{s['max_s']:>9.3f}s  {target}")
    print(f"plain / paged-out = {speedup:.1f}x")
    la, lb = load_before, doc["machine"]["loadavg_after"]
    print(
        f"load average before {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}, after"
        f" {lb[0]:.2f} {lb[1]:.2f} {lb[2]:.2f}; {total_s:.0f} s; wrote {args.out}"
    )
    missed = [k for k, ok in doc["targets"].items() if not ok]
    if missed:
        print(f"targets missed: {', '.join(missed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
