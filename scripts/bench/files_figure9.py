# scripts/bench/files_figure9.py - ZZ Figure 9 on the files app: a replica's corrupted file is read
# back, the agreement cluster detects the lie and a spare is woken; on-demand vs full transfer.
"""ZZ Figure 9 (§6.4.1, NFS recovery) reproduced: `scripts/bench/files --figure9`.

Per file size and recovery mode, one fresh rack (benchlib.BenchRack): 4 zz-agreed (release
build, the cluster's own fault detection), execution replicas 0 and 1 active, replica 2 a
paused spare (started asleep with `--recovery on-demand|full`, then SIGSTOPped; it slept
since seq 0, so it holds no state), all three on datasets of a zfs-fuse pool of the bench's
own. A stand-in controld (benchlib.Controld) verifies the agreement replicas' WAKEUP
certificate and wakes the spare as controld does (wake notice, SIGCONT).

1. Fill: 200 files of equal size created through the files app's client API (CREATE, then
   WRITEs of 128 KiB, what `zz mount` sends), 8 clients in parallel; 199 files, then small
   SETATTRs up to a stable checkpoint S, then the 200th file by one client, one request per
   batch: the requests a woken replica replays (1 + size/128 KiB of them).
2. Replica 1's copy of file k (chosen at random among the first 199) is corrupted on its
   disk: one byte flipped in its live data file (its checkpoints stay as they were).
3. The fault: a client reads the first 128 KiB of file k (an ordered read, as the mount
   sends it). Replica 1's reply and EXEC-REPORT differ from replica 0's: the agreement
   replicas flag a mismatch, send WAKEUP; the spare wakes, recovers to S, replays the tail,
   executes the read (fetching file k's data on demand) and replies; the client holds f+1 =
   2 matching replies: the correct answer.

Recorded per point (one monotonic clock; the spare's times from its status file and log):
send -> first "execution mismatch" line (detection), -> verified WAKEUP at controld, ->
the spare noticed the wake-up, -> it starts recovering (checkpoint certified by g+1
agreement replicas), install (manifest, reconcile, own files; in full mode every file),
replay of the certified tail (seconds and per request), the rest (the log resent, the read
executed with its fetch, the reply) -> the client's certificate. Recovery time as in the
paper: fault detected (the first mismatch) -> the client holds the correct answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from benchlib import (  # noqa: E402
    REPO,
    SPARE,
    BenchRack,
    Controld,
    LogWatch,
    TimedClient,
    client_params,
    load,
)

from zz import fsop  # noqa: E402
from zz.client import Client  # noqa: E402
from zz.snapshots.zfs import ensure_zfs_daemon  # noqa: E402

N_FILES = 200
CHUNK = 128 * 1024  # the largest WRITE and READ `zz mount` sends
CP = 64  # the tail (at most 41 requests for 5 MB files) stays within one interval
FILL_CLIENTS = 8
LIAR = 1
# Timers far above a loaded 2-core machine's hiccups: only the lie is detected (a mismatch
# needs no timer), never a correct replica that fell behind during the fill.
TIMERS = {"detect_floor_ms": 10000, "detect_ceiling_ms": 30000}
SIZES_KB = [64, 512, 1024, 5120]
QUICK_KB = [64, 512]
MODES = ("on-demand", "full")


def pad_op(n: int) -> bytes:
    """The checkpoint padding: the root's mtime set (a write of one small inode file)."""
    return fsop.encode_setattr(fsop.ROOT_INO, fsop.SET_MTIME, mtime_ns=n + 1)


def data_path(ino: int) -> str:
    return f"fs/d/{ino % 256:02x}/{ino}"


def _ok(code: int, raw: bytes) -> fsop.FsReply:
    r = fsop.decode_reply(code, raw)
    if not r.ok:
        raise RuntimeError(f"{fsop.OP_NAMES[code]}: {fsop.ERROR_NAMES[r.status]} {r.data!r}")
    return r


def _log_time(log: Path, pattern: str) -> float | None:
    """Epoch time of the first line of the runtime's log matching `pattern` (its asctime,
    ms resolution)."""
    rx = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*" + pattern)
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if m := rx.match(line):
            t = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").timestamp()
            return t + int(m[2]) / 1000
    return None


class Point(BenchRack):
    """One measurement: a rack, its fill, the corrupted read, the recovery."""

    def __init__(
        self,
        d: Path,
        file_kb: int,
        mode: str,
        seed: int,
        store: str,
        n_files: int,
        agreed: Path | None,
    ) -> None:
        state = n_files * file_kb * 1024
        super().__init__(
            d,
            name="files",
            app="files",
            pool_tag="zzfig9",
            pool_bytes=max(512 << 20, int(state * 4.5)),
            cp=CP,
            pad_op=pad_op,
            store=store,
            overrides=TIMERS,
            agreed=agreed,
        )
        self.file_kb = file_kb
        self.mode = mode
        self.n_files = n_files
        self.rng = random.Random(seed)
        self.inos: dict[int, int] = {}
        self.first_chunk: dict[int, bytes] = {}

    async def write_file(self, client: Client, k: int) -> int:
        """File k: CREATE, then its bytes in CHUNK writes; one request at a time."""
        op = fsop.encode_create(fsop.ROOT_INO, b"f%03d" % k, 0o644, 0, 0)
        attr = _ok(fsop.CREATE, await client.invoke(op, timeout=300)).attr
        assert attr is not None
        size = self.file_kb * 1024
        for off in range(0, size, CHUNK):
            data = os.urandom(min(CHUNK, size - off))
            if off == 0:
                self.first_chunk[k] = data
            op = fsop.encode_write(attr.ino, off, data)
            _ok(fsop.WRITE, await client.invoke(op, timeout=300))
        self.inos[k] = attr.ino
        return 1 + -(-size // CHUNK)

    async def fill(self, reader: Client) -> dict[str, Any]:
        """199 files in parallel, `reader` connected (a GETATTR), a stable checkpoint S,
        then file 199 alone (the tail: what the woken replica replays)."""
        todo = list(range(self.n_files - 1))
        t = time.monotonic()

        async def worker(c: int) -> None:
            async with Client(self.cfg, c, service=self.name) as client:
                while todo:
                    await self.write_file(client, todo.pop())

        await asyncio.gather(*(worker(c) for c in range(FILL_CLIENTS)))
        fill_s = time.monotonic() - t
        # Connected and introduced to every replica (the spare's connection waits in its
        # listen queue) before S, so that the tail holds nothing but the last file.
        _ok(fsop.GETATTR, await reader.invoke(fsop.encode_getattr(fsop.ROOT_INO), True))
        s = await self.pad_to_checkpoint()
        async with Client(self.cfg, 21, service=self.name) as client:
            tail = await self.write_file(client, self.n_files - 1)
        last = (await self.settled(0))["last_executed"]
        self.wait(lambda: self.status(LIAR).get("last_executed") == last, "replica 1 caught up")
        return {
            "fill_s": round(fill_s, 2),
            "checkpoint": s,
            "tail_requests": tail,
            "last_before_fault": last,
        }

    def corrupt(self, k: int) -> str:
        """Flip one byte of the liar's live copy of file k (its disk, not its checkpoints)."""
        rel = data_path(self.inos[k])
        path = self.live(LIAR) / rel
        off = min(CHUNK, self.file_kb * 1024) // 2
        with open(path, "r+b") as fh:
            fh.seek(off)
            b = fh.read(1)
            fh.seek(off)
            fh.write(bytes([b[0] ^ 0xFF]))
        return rel

    async def fault(self, k: int, reader: TimedClient, controld: Controld) -> dict[str, Any]:
        off = time.time() - time.monotonic()  # monotonic -> epoch
        logs = [self.cfg.rack.run_dir / "s1" / f"agreed-{r}.log" for r in range(4)]
        want = self.first_chunk[k][: min(CHUNK, self.file_kb * 1024)]
        if controld.wakeups:
            raise RuntimeError(f"a WAKEUP before the fault: {controld.summary(0)}")
        rel = self.corrupt(k)
        with LogWatch(logs) as watch:
            t_send = time.monotonic()
            op = fsop.encode_read(self.inos[k], 0, len(want))
            raw = await reader.invoke(op, read_only=True, timeout=900)
            t_answer = time.monotonic()
            arrivals = dict(reader.arrivals)
            mismatch = watch.since(t_send, "mismatch")
        if _ok(fsop.READ, raw).data != want:
            raise RuntimeError("the certified answer is not the file's content")
        if not mismatch or not controld.wakeups:
            raise RuntimeError(f"no detection: mismatch {mismatch}, controld {controld.summary(0)}")
        # The spare's own figures, from a status written after it executed the fault seq.
        fault_seq = controld.wakeups[0][1]
        self.wait(
            lambda: self.status(SPARE).get("last_executed", 0) >= fault_seq, "spare status", 30
        )
        st = self.status(SPARE)
        rec, replay = st.get("recovery", {}), st.get("replay", {})
        log = self.cfg.rack.run_dir / "s1" / f"exec-{SPARE}.bench.log"
        t_detect = min(t for t, _ in mismatch.values())
        t_wakeup = min(t for t, *_ in controld.wakeups)
        noticed, recovering = rec.get("noticed_at"), _log_time(log, "behind the stable checkpoint")
        if noticed is None or recovering is None:
            raise RuntimeError(f"the spare did not recover: {st}")
        t_noticed, t_recover = noticed - off, recovering - off
        install_s = rec["install_ms"] / 1000
        replay_s = replay.get("seconds", 0.0)
        batches = replay.get("certified_batches", 0)
        phases = {
            "detect": t_detect - t_send,
            "wakeup_certificate": t_wakeup - t_detect,
            "wake": t_noticed - t_wakeup,
            "checkpoint_learned": t_recover - t_noticed,
            "install": install_s,
            "replay": replay_s,
            "rest": t_answer - (t_recover + install_s + replay_s),
        }
        return {
            "corrupted": {"file": k, "path": rel},
            "fault_seq": fault_seq,
            "recovery_s": round(t_answer - t_detect, 4),
            "total_s": round(t_answer - t_send, 4),
            "phases_s": {p: round(v, 4) for p, v in phases.items()},
            "replies_after_send_s": {i: round(t - t_send, 4) for i, t in sorted(arrivals.items())},
            "replayed_batches": batches,
            "replay_per_request_ms": round(replay_s / batches * 1000, 3) if batches else None,
            "install_phases_ms": rec.get("install_phases_ms"),
            # The spare's own steps (runtime wake_marks, the same monotonic clock), ms
            # after the first mismatch: noticed, link_up, recover_start, recovered,
            # replay_first, replay_last, first_fresh.
            "spare_marks_ms": {
                k: round((v - t_detect) * 1000, 1)
                for k, v in sorted(st.get("wake_marks", {}).items(), key=lambda kv: kv[1])
            },
            "files_pending_at_start": rec.get("files_pending"),
            "recovered_checkpoint": rec.get("checkpoint"),
            "bad_sources": rec.get("bad_sources", []),
            "shutdowns": controld.summary(t_send)["shutdown_certificates"],
        }


async def run_point(
    d: Path,
    file_kb: int,
    mode: str,
    seed: int,
    store: str = "zfs",
    n_files: int = N_FILES,
    agreed: Path | None = None,
) -> dict[str, Any]:
    """One fresh rack, its fill, the fault, the recovery; everything torn down after.
    (tests/test_bench_figure9.py runs a small one on the directory store.)"""
    p = Point(d, file_kb, mode, seed, store, n_files, agreed)
    p.write_config()
    controld = Controld(p.cfg)
    await controld.start()
    reader = TimedClient(client_params(p.cfg, 24))
    try:
        p.up()
        controld.wake = {SPARE: p.start_spare_asleep(["--recovery", mode])}
        filled = await p.fill(reader)
        k = p.rng.randrange(n_files - 1)
        out = {
            "file_kb": file_kb,
            "files": n_files,
            "state_mb": round(n_files * file_kb / 1024, 1),
            "mode": mode,
            **filled,
            **await p.fault(k, reader, controld),
            "load": load(),
        }
        return out
    finally:
        await reader.close()
        await controld.close()
        p.down()


def plot(points: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = {"on-demand": "tab:blue", "full": "tab:red"}
    for mode in MODES:
        pts = sorted((p["state_mb"], p["recovery_s"]) for p in points if p["mode"] == mode)
        if pts:
            a1.plot(*zip(*pts, strict=True), marker="o", color=colors[mode], label=mode)
        rp = sorted(
            (p["state_mb"], p["replay_per_request_ms"] or 0) for p in points if p["mode"] == mode
        )
        if rp:
            a3.plot(*zip(*rp, strict=True), marker="o", color=colors[mode], label=mode)
    a1.axhline(0.5, color="grey", linestyle=":", label="target 0.5 s")
    a1.set_xscale("log")
    a1.set_yscale("log")
    a1.set_xlabel("state: 200 files (MB)")
    a1.set_ylabel("fault detected -> correct answer (s)")
    a1.set_title("Recovery time (cf. ZZ Fig. 9a)")
    a1.legend()
    ond = sorted((p for p in points if p["mode"] == "on-demand"), key=lambda p: p["state_mb"])
    names = ["wake", "checkpoint_learned", "install", "replay", "rest"]
    bottom = [0.0] * len(ond)
    labels = [f"{p['state_mb']:g}" for p in ond]
    for name in names:
        vals = [max(0.0, p["phases_s"][name]) for p in ond]
        a2.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    a2.set_xlabel("state (MB)")
    a2.set_ylabel("s")
    a2.set_title("On-demand: where the time goes")
    a2.legend(fontsize=8)
    a3.set_xscale("log")
    a3.set_xlabel("state (MB)")
    a3.set_ylabel("replay per request (ms)")
    a3.set_title("Replay cost per request (cf. Fig. 9b)")
    a3.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run of a (size, mode) point, with every run's times and phases."""
    runs = sorted(runs, key=lambda r: r["recovery_s"])
    p = dict(runs[len(runs) // 2])
    p["samples_s"] = [r["recovery_s"] for r in runs]
    keep = (
        "recovery_s",
        "phases_s",
        "install_phases_ms",
        "spare_marks_ms",
        "replay_per_request_ms",
        "load",
    )
    p["runs"] = [{k: r[k] for k in keep} for r in runs]
    return p


def write_result(
    args: argparse.Namespace,
    sizes: list[int],
    modes: list[str],
    points: list[dict[str, Any]],
    load_before: list[float],
    t: float,
) -> dict[str, Any]:
    """The JSON of the points so far (written after every point: a run cut short keeps
    what it measured)."""
    ond = [p["recovery_s"] for p in points if p["mode"] == "on-demand"]
    result = {
        "bench": "files-figure9",
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": list(os.getloadavg()),
        },
        "params": {
            "files": N_FILES,
            "chunk": CHUNK,
            "checkpoint_interval": CP,
            "f": 1,
            "g": 1,
            "store": "zfs",
            "sizes_kb": sizes,
            "modes": modes,
            "reps": args.reps,
            "timers": TIMERS,
        },
        "points": points,
        "targets": {
            "on_demand_le_0.5s_every_size": all(x <= 0.5 for x in ond) if ond else None,
            "on_demand_max_s": max(ond) if ond else None,
            "on_demand_median_s": statistics.median(ond) if ond else None,
        },
        "wall_s": round(time.monotonic() - t, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="scripts/bench/files --figure9", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--quick", action="store_true", help=f"file sizes {QUICK_KB} KB only")
    ap.add_argument("--sizes", help=f"comma-separated file sizes in KB (default {SIZES_KB})")
    ap.add_argument("--modes", default=",".join(MODES), help="on-demand,full")
    ap.add_argument("--reps", type=int, default=1, help="runs per point (median)")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "files-figure9.json")
    args = ap.parse_args(argv)
    sizes = QUICK_KB if args.quick else SIZES_KB
    if args.sizes:
        sizes = [int(x) for x in args.sizes.split(",")]
    modes = args.modes.split(",")
    ensure_zfs_daemon()
    # SIGTERM must run the finally blocks that stop the rack and destroy the pool.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = list(os.getloadavg())
    print(f"[figure9] load average before: {load_before}", flush=True)
    t = time.monotonic()
    points: list[dict[str, Any]] = []
    for kb in sizes:
        for mode in modes:
            runs = []
            for rep in range(args.reps):
                d = Path(tempfile.mkdtemp(prefix="zz-bench-fig9-"))
                try:
                    r = asyncio.run(run_point(d, kb, mode, seed=kb * 100 + rep))
                except BaseException:
                    print(f"[figure9] failed; logs kept in {d}/run", file=sys.stderr)
                    raise
                shutil.rmtree(d, ignore_errors=True)
                ph = " ".join(f"{n} {v * 1000:.0f}" for n, v in r["phases_s"].items())
                print(
                    f"[figure9] {N_FILES} x {kb} KB ({r['state_mb']} MB) {mode:9s} recovery"
                    f" {r['recovery_s'] * 1000:8.1f} ms; phases ms: {ph}; replay"
                    f" {r['replayed_batches']} req, {r['replay_per_request_ms']} ms/req;"
                    f" fill {r['fill_s']} s; load {r['load']:.2f}",
                    flush=True,
                )
                runs.append(r)
            points.append(summarize(runs))
            write_result(args, sizes, modes, points, load_before, t)
    result = write_result(args, sizes, modes, points, load_before, t)
    png = args.out.with_suffix(".png")
    plot(points, png)
    print()
    print(f"{'state MB':>9} {'mode':>10} {'recovery ms':>12} {'replayed':>9} {'ms/req':>8}")
    for p in points:
        print(
            f"{p['state_mb']:>9} {p['mode']:>10} {p['recovery_s'] * 1000:>12.1f}"
            f" {p['replayed_batches']:>9} {p['replay_per_request_ms'] or 0:>8.2f}"
        )
    print(f"targets: {json.dumps(result['targets'])}")
    print(f"wrote {args.out} and {png}; load {load_before[0]:.2f} -> {load():.2f}")
    return 0
