# zz/report.py - a drill's report: report.json, the timeline.png of throughput and latency
# per 100 ms around the fault (like ZZ Figures 8 and 11), and the short text summary.
"""Drill reports (docs/operations.md, "Reading a drill report").

A drill records, on one monotonic clock, every client operation (call, return or never)
and a few marks (fault injected, fault detected, spare woken, first correct reply). This
module turns that into per-bucket throughput and latency, writes both files, and prints
the summary. It does not run anything: `zz/drill/` does.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zz.atomicfile import write_atomic

BUCKET_S = 0.1
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Marks drawn on the timeline, in this order, with these colours.
MARKS = {
    "fault": "tab:red",
    "detection": "tab:orange",
    "wakeup": "tab:green",
    "first_correct_reply": "tab:blue",
}


@dataclass
class Sample:
    """One client operation, seconds relative to the fault (negative: before it);
    `ret` None: it never returned (timed out, or still pending at the end)."""

    call: float
    ret: float | None
    ok: bool = True


@dataclass
class Bucket:
    start: float  # seconds relative to the fault
    completed: int
    throughput: float  # completed operations per second
    latency_ms_mean: float | None
    latency_ms_max: float | None


def buckets(samples: list[Sample], width: float = BUCKET_S) -> list[Bucket]:
    """Completed operations per `width` seconds, by return time, from the first call to the
    last return; each bucket's latency is that of the operations returning in it."""
    done = [s for s in samples if s.ret is not None and s.ok]
    if not samples:
        return []
    t0 = min(s.call for s in samples)
    t1 = max([s.ret for s in done if s.ret is not None] + [t0])
    first = math.floor(t0 / width)
    count = max(1, math.floor(t1 / width) - first + 1)
    lat: list[list[float]] = [[] for _ in range(count)]
    for s in done:
        assert s.ret is not None
        k = min(count - 1, max(0, math.floor(s.ret / width) - first))
        lat[k].append((s.ret - s.call) * 1000)
    out = []
    for k, ls in enumerate(lat):
        out.append(
            Bucket(
                start=round((first + k) * width, 6),
                completed=len(ls),
                throughput=len(ls) / width,
                latency_ms_mean=round(sum(ls) / len(ls), 3) if ls else None,
                latency_ms_max=round(max(ls), 3) if ls else None,
            )
        )
    return out


@dataclass
class DrillReport:
    """What a drill found. Times are seconds after the fault; None: did not happen (or
    does not apply: `notes` says which)."""

    kind: str
    rack: str
    service: str
    started_at: float  # wall clock of the fault
    result: str = "FAIL"  # PASS or FAIL
    reasons: list[str] = field(default_factory=list)  # why FAIL (empty on PASS)
    detection_s: float | None = None
    wakeup_s: float | None = None
    first_correct_reply_s: float | None = None
    convicted: list[str] = field(default_factory=list)
    shut_down: list[str] = field(default_factory=list)
    woken: list[str] = field(default_factory=list)
    spares_restored: list[str] = field(default_factory=list)
    linearizability: str = "not checked"
    linearizable: bool | None = None
    operations: int = 0
    pending: int = 0
    load_before: float | None = None  # ops/s in the seconds before the fault
    load_after: float | None = None  # ops/s after the first correct reply
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    timeline: list[Bucket] = field(default_factory=list)

    def marks(self) -> dict[str, float]:
        m = {"fault": 0.0}
        for name, v in (
            ("detection", self.detection_s),
            ("wakeup", self.wakeup_s),
            ("first_correct_reply", self.first_correct_reply_s),
        ):
            if v is not None:
                m[name] = v
        return m

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def plot_timeline(report: DrillReport, path: Path) -> Path:
    """Two panels over the same time axis: throughput (ops/s) and mean latency (ms) per
    bucket, with the marks as vertical lines. Agg backend: no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [b.start for b in report.timeline]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5), dpi=100)
    try:
        top.step(xs, [b.throughput for b in report.timeline], where="post", color="black")
        top.set_ylabel("throughput (ops/s)")
        top.set_ylim(bottom=0)
        lx = [b.start for b in report.timeline if b.latency_ms_mean is not None]
        ly = [b.latency_ms_mean for b in report.timeline if b.latency_ms_mean is not None]
        bottom.plot(lx, ly, ".", color="black", markersize=3)
        bottom.set_ylabel("latency (ms, mean per 100 ms)")
        if ly and max(ly) / max(min(ly), 1e-3) > 50:
            bottom.set_yscale("log")
        bottom.set_xlabel("time since the fault (s)")
        # A legend, not labels at the lines: detection, wake-up and first reply are often
        # a few ms apart and their labels would overlap.
        for name, t in report.marks().items():
            label = f"{name.replace('_', ' ')} ({t * 1000:.0f} ms)" if t else name
            top.axvline(t, color=MARKS[name], linestyle="--", linewidth=1, label=label)
            bottom.axvline(t, color=MARKS[name], linestyle="--", linewidth=1)
        rep = report.details.get("replace_s")
        if isinstance(rep, int | float) and rep > 0:
            # The replica was down while a faulty runtime replaced it: not the fault itself.
            for ax in (top, bottom):
                ax.axvspan(-rep, 0, color="grey", alpha=0.15, linewidth=0)
            top.plot([], [], color="grey", alpha=0.3, linewidth=6, label="replacing the runtime")
        top.legend(loc="upper right", fontsize=7, framealpha=0.9)
        top.set_title(f"zz drill {report.kind}: {report.rack}/{report.service} — {report.result}")
        fig.tight_layout()
        tmp = path.with_name(path.name + ".tmp.png")
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
    return path


# matplotlib is the optional extra "plots" (pyproject.toml): how to get it.
PLOTS_HINT = "pip install 'zz[plots]' (or: python3 -m pip install matplotlib)"


def no_plot_note(error: ImportError) -> str:
    return (
        f"no timeline.png: matplotlib is not installed ({error}); {PLOTS_HINT}, then draw it"
        " from this report with `python3 -m zz.report DIR`"
    )


def write(report: DrillReport, directory: Path) -> tuple[Path, Path | None]:
    """report.json and timeline.png in `directory` (created). Without matplotlib (the
    optional extra "plots") there is no PNG: None, and a note in the report says how to
    get it."""
    directory.mkdir(parents=True, exist_ok=True)
    png: Path | None
    try:
        png = plot_timeline(report, directory / "timeline.png")
    except ImportError as e:
        png = None
        note = no_plot_note(e)
        if note not in report.notes:
            report.notes.append(note)
    js = directory / "report.json"
    write_atomic(js, json.dumps(report.to_json(), indent=1) + "\n")
    return js, png


def load(path: Path) -> DrillReport:
    d = json.loads(Path(path).read_text())
    d["timeline"] = [Bucket(**b) for b in d.get("timeline", [])]
    return DrillReport(**d)


def _s(v: float | None, what: str = "") -> str:
    if v is None:
        return f"— {what}".rstrip()
    return f"{v * 1000:.0f} ms" if v < 10 else f"{v:.1f} s"


def _list(xs: list[str]) -> str:
    return ", ".join(xs) if xs else "none"


def format_text(report: DrillReport) -> str:
    """The short report a drill prints."""
    r = report
    lines = [f"==== drill {r.kind}: service {r.service} of rack {r.rack} ===="]
    if "replace_s" in r.details:
        lines.append(
            f"(the faulty runtime replaced the replica in {r.details['replace_s']:.1f} s;"
            " times below count from when it answered)"
        )
    lines += [
        f"detection time            {_s(r.detection_s)}",
        f"wake-up time              {_s(r.wakeup_s)}",
        f"first correct reply       {_s(r.first_correct_reply_s)}",
        f"convicted                 {_list(r.convicted)}",
        f"shut down                 {_list(r.shut_down)}",
        f"woken                     {_list(r.woken)}",
        f"spares restored           {_list(r.spares_restored)}",
        f"operations                {r.operations} ({r.pending} never returned)",
    ]
    if r.load_before is not None:
        after = f"{r.load_after:.0f}" if r.load_after is not None else "—"
        lines.append(f"throughput before/after   {r.load_before:.0f} / {after} ops/s")
    lines.append(f"linearizability           {r.linearizability}")
    lines += [f"note: {n}" for n in r.notes]
    lines += [f"FAIL: {why}" for why in r.reasons]
    lines.append(f"RESULT: {r.result}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """python3 -m zz.report DIR: draw DIR/timeline.png again from DIR/report.json (after
    installing matplotlib, or to redraw an old report)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python3 -m zz.report", description=main.__doc__)
    ap.add_argument("dir", type=Path, help="a drill's report directory")
    a = ap.parse_args(argv)
    try:
        r = load(a.dir / "report.json")
        png = plot_timeline(r, a.dir / "timeline.png")
    except ImportError as e:
        print(f"zz.report: matplotlib is not installed ({e}); {PLOTS_HINT}", file=sys.stderr)
        return 1
    except (OSError, ValueError, TypeError) as e:
        print(f"zz.report: {a.dir / 'report.json'}: {e}", file=sys.stderr)
        return 1
    print(png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
