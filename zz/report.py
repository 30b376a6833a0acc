# zz/report.py - a drill's report: report.json, the timeline.png of throughput and latency
# per 100 ms around the fault (like ZZ Figures 8 and 11), and the short text summary.
"""Drill reports (docs/operations.md, "Reading a drill report").

A drill records, on one monotonic clock, every client operation (call, return or never)
and a few marks (fault injected, fault detected, spare woken, replicas convicted and
restored). This module turns that into per-bucket throughput and latency, the first
correct reply, the throughput after recovery and the verdict (PASS, DEGRADED, FAIL),
writes both files, and prints the summary. It does not run anything: `zz/drill/` does.

report.json's layout is versioned (SCHEMA_VERSION, docs/operations.md "report.json"):
version 1 had no `schema_version` and gave convicted / woken / shut-down / restored
replicas as controld's log lines; `load` reads it and turns those lines into entries.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from zz.atomicfile import write_atomic

SCHEMA_VERSION = 2
BUCKET_S = 0.1
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Marks drawn on the timeline, in this order, with these colours.
MARKS = {
    "fault": "tab:red",
    "detection": "tab:orange",
    "wakeup": "tab:green",
    "first_correct_reply": "tab:blue",
    "conviction": "tab:purple",
    "spare_restored": "tab:brown",
}
# Throughput after recovery: over the last AFTER_WINDOW_S of the watch (from the first
# correct reply if that is later; under AFTER_MIN_S left: not measured). Below
# DEGRADED_FRACTION of the throughput before the fault, a drill that passes every other
# check is DEGRADED.
AFTER_WINDOW_S = 5.0
AFTER_MIN_S = 1.0
DEGRADED_FRACTION = 0.5
# `zz drill`'s exit code per verdict (2: the drill refused to start).
EXIT_CODES = {"PASS": 0, "FAIL": 1, "DEGRADED": 3}


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


# ---- what the controlds did: structured entries from their log lines ----------------------
# Each entry is one line of a controld's `recent` log (controld/daemon.py `_note`), seen `t_s`
# seconds after the fault on `host`. PATTERN is the line's form; `parse` builds the entry
# from it, and only lines that parse are entries.
E = TypeVar("E", bound="Entry")


@dataclass
class Entry:
    t_s: float  # seconds after the fault when the drill saw the line (polled every 100 ms)
    host: str  # the controld's host

    PATTERN: ClassVar[re.Pattern[str]]

    @classmethod
    def parse(cls: type[E], t_s: float, host: str, line: str) -> E | None:
        m = cls.PATTERN.match(line)
        return None if m is None else cls(round(t_s, 6), host, **cls._fields(m))

    @classmethod
    def _fields(cls, m: re.Match[str]) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_lines(cls: type[E], lines: list[tuple[float, str]]) -> list[E]:
        """Entries from (t, "host: line") pairs (zz/drill/observe.py Observer.lines)."""
        out = []
        for t, hl in lines:
            host, _, line = hl.partition(": ")
            if (e := cls.parse(t, host, line)) is not None:
                out.append(e)
        return out

    @property
    def who(self) -> str:
        """`service/replica` of the replica the entry is about ("" for a certificate)."""
        svc, idx = getattr(self, "service", ""), getattr(self, "replica", None)
        return f"{svc}/{idx}" if idx is not None else ""


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


@dataclass
class Convicted(Entry):
    """`convicted S/I destroyed; state kept as KEPT`: controld destroyed a replica a
    SHUTDOWN certificate convicted and set its state aside for forensics. KEPT is
    controld/actions.py set_aside_state's list: a ZFS dataset@snapshot, the state
    directory, `console log in PATH` (comma-separated; `None`: nothing was there)."""

    service: str = ""
    replica: int = 0
    state_kept: list[str] = field(default_factory=list)  # datasets, directories
    console_log: str | None = None  # the convicted replica's console log, kept with it

    PATTERN = re.compile(r"convicted (\S+)/(\d+) destroyed; state kept as (.*)$")

    @classmethod
    def _fields(cls, m: re.Match[str]) -> dict[str, Any]:
        kept, console = [], None
        for item in m.group(3).split(", "):
            if item.startswith("console log in "):
                console = item.removeprefix("console log in ")
            elif item and item != "None":
                kept.append(item)
        return {
            "service": m.group(1),
            "replica": int(m.group(2)),
            "state_kept": kept,
            "console_log": console,
        }


@dataclass
class Woken(Entry):
    """`woke S/I from STATE in MS ms; notice PATH`: controld resumed a sleeping spare."""

    service: str = ""
    replica: int = 0
    from_state: str = ""  # paused or hibernated
    resume_ms: float = 0.0  # how long the resume itself took at controld
    notice: str = ""

    PATTERN = re.compile(r"woke (\S+)/(\d+) from (\S+) in ([\d.]+) ms; notice (.*)$")

    @classmethod
    def _fields(cls, m: re.Match[str]) -> dict[str, Any]:
        return {
            "service": m.group(1),
            "replica": int(m.group(2)),
            "from_state": m.group(3),
            "resume_ms": float(m.group(4)),
            "notice": m.group(5),
        }


@dataclass
class ShutDown(Entry):
    """`SHUTDOWN S seq N convict [..] sleep [..] active [..]`: a controld acted on a
    SHUTDOWN certificate (each host that received it logs it); with `(merged with another
    certificate)` after it, on the merge of two certified at that seq (docs/controld.md)."""

    service: str = ""
    seq: int = 0
    convict: list[int] = field(default_factory=list)
    sleep: list[int] = field(default_factory=list)
    active: list[int] = field(default_factory=list)

    PATTERN = re.compile(
        r"SHUTDOWN (\S+) seq (\d+) convict \[([\d, ]*)\] sleep \[([\d, ]*)\] active \[([\d, ]*)\]"
        r"( \(merged with another certificate\))?$"
    )

    @classmethod
    def _fields(cls, m: re.Match[str]) -> dict[str, Any]:
        return {
            "service": m.group(1),
            "seq": int(m.group(2)),
            "convict": _ints(m.group(3)),
            "sleep": _ints(m.group(4)),
            "active": _ints(m.group(5)),
        }


@dataclass
class SpareRestored(Entry):
    """`provisioned S/I MODE (DOMAIN) {...}`: a fresh spare provisioned asleep (after a
    conviction, the convicted index); `detail` is what provisioning returned (`seconds`
    it took, `answering_s`, ...)."""

    service: str = ""
    replica: int = 0
    mode: str = ""  # paused or hibernated
    domain: str = ""
    detail: dict[str, Any] = field(default_factory=dict)

    PATTERN = re.compile(r"provisioned (\S+)/(\d+) (paused|hibernated) \((\S*)\) ?(.*)$")

    @classmethod
    def _fields(cls, m: re.Match[str]) -> dict[str, Any]:
        try:
            detail = ast.literal_eval(m.group(5)) if m.group(5) else {}
        except (ValueError, SyntaxError):
            detail = {"text": m.group(5)}
        return {
            "service": m.group(1),
            "replica": int(m.group(2)),
            "mode": m.group(3),
            "domain": m.group(4),
            "detail": detail if isinstance(detail, dict) else {"text": m.group(5)},
        }


# ---- where the time from the fault to the first correct reply went -------------------------
# The recovery phases, in order, and the mark (seconds after the fault, report
# details["recovery_marks"]) each one ends at (docs/operations.md "Recovery phases"):
#   detection       the fault -> an agreement replica flags it (its log: execution
#                   mismatch / timeout at seq N)
#   certificate     -> the woken replica's controld accepted the WAKEUP (g+1 signed fault
#                   statements exchanged, the WAKEUP formed, sent and verified)
#   resume          -> the woken runtime connected to the agreement replicas: controld's
#                   queue, the resume (or restore), the guest agent's wake, the runtime's
#                   notice (a hibernated guest's runtime: started, imports, state opened)
#   recovery_fetch  -> the stable checkpoint installed (manifest, the runtime's own files;
#                   the others come on first touch); 0 when no recovery was needed
#   replay          -> the last certified batch run again ended; 0 when there was none
#   first_reply     -> the first correct reply at a client: the fault's batches executed
#                   fresh, f+1 matching replies sent and received
PHASES = (
    ("detection", "flagged"),
    ("certificate", "wakeup_accepted"),
    ("resume", "runtime_ready"),
    ("recovery_fetch", "recovered"),
    ("replay", "replay_last"),
    ("first_reply", "first_correct_reply"),
)


def recovery_phases(marks: dict[str, float | None]) -> dict[str, float | None]:
    """Seconds per phase (PHASES) from the marks (seconds after the fault). A phase
    whose end mark is missing is None and the next one starts where the last known one
    ended; an end mark earlier than that (clocks a few ms apart, steps that overlap)
    gives 0. `recovered` and `replay_last` missing while the runtime's marks are there
    (`runtime_ready` set) mean the step did not happen: 0."""
    out: dict[str, float | None] = {}
    prev = 0.0
    runtime = marks.get("runtime_ready") is not None
    for phase, mark in PHASES:
        t = marks.get(mark)
        if t is None and runtime and mark in ("recovered", "replay_last"):
            t = prev
        if t is None:
            out[phase] = None
            continue
        end = max(t, prev)
        out[phase] = round(end - prev, 4)
        prev = end
    return out


# report.json's list fields and the entry type each holds.
ENTRY_FIELDS: dict[str, type[Entry]] = {
    "convicted": Convicted,
    "shut_down": ShutDown,
    "woken": Woken,
    "spares_restored": SpareRestored,
}


@dataclass
class DrillReport:
    """What a drill found. Times are seconds after the fault; None: did not happen (or
    does not apply: `notes` says which)."""

    kind: str
    rack: str
    service: str
    started_at: float  # wall clock of the fault
    schema_version: int = SCHEMA_VERSION
    result: str = "FAIL"  # PASS, DEGRADED or FAIL (verdict())
    reasons: list[str] = field(default_factory=list)  # why FAIL (empty otherwise)
    degraded: list[str] = field(default_factory=list)  # why DEGRADED (the throughput rule)
    detection_s: float | None = None
    wakeup_s: float | None = None
    first_correct_reply_s: float | None = None  # never before detection_s (first_reply())
    # Fault -> first correct reply split into PHASES (recovery_phases); empty: no replica
    # was woken, or the drill could not place its steps.
    phases: dict[str, float | None] = field(default_factory=dict)
    convicted: list[Convicted] = field(default_factory=list)
    shut_down: list[ShutDown] = field(default_factory=list)
    woken: list[Woken] = field(default_factory=list)
    spares_restored: list[SpareRestored] = field(default_factory=list)
    linearizability: str = "not checked"
    linearizable: bool | None = None
    operations: int = 0
    pending: int = 0
    load_before: float | None = None  # ops/s in the seconds before the fault
    load_after: float | None = None  # ops/s at the end of the watch (after_window)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    timeline: list[Bucket] = field(default_factory=list)

    def marks(self) -> dict[str, float]:
        """The times drawn on the timeline: the fault (0), detection, wake-up, first
        correct reply, the first conviction and the last spare restored (the rack whole
        again)."""
        m = {"fault": 0.0}
        for name, v in (
            ("detection", self.detection_s),
            ("wakeup", self.wakeup_s),
            ("first_correct_reply", self.first_correct_reply_s),
            ("conviction", min((c.t_s for c in self.convicted), default=None)),
            ("spare_restored", max((x.t_s for x in self.spares_restored), default=None)),
        ):
            if v is not None:
                m[name] = v
        return m

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return {"schema_version": d.pop("schema_version"), **d}


def verdict(r: DrillReport) -> str:
    """FAIL when a check failed (`reasons`), else DEGRADED when the service came back far
    slower than before the fault (`degraded`), else PASS; sets and returns `result`."""
    r.result = "FAIL" if r.reasons else "DEGRADED" if r.degraded else "PASS"
    return r.result


def first_reply(
    samples: list[Sample], detection_s: float | None
) -> tuple[float | None, float | None, int]:
    """The first correct reply, measured from the fault: the earliest return of an
    operation issued after the fault (answered on f+1 matching replies, so correct), and
    when the fault was detected, not before the detection. Returns (first correct reply,
    earliest such return regardless of detection, how many returned before detection)."""
    after = sorted(
        s.ret for s in samples if s.ok and s.ret is not None and s.call >= 0 and s.ret >= 0
    )
    earliest = after[0] if after else None
    if detection_s is None:
        return earliest, earliest, 0
    before = sum(1 for t in after if t < detection_s)
    return (after[before] if before < len(after) else None), earliest, before


def after_window(
    end_s: float, first_correct_s: float | None, width: float = AFTER_WINDOW_S
) -> tuple[float, float] | None:
    """The span whose throughput is the throughput after recovery: the last `width`
    seconds of the watch (ending when the load stopped, `end_s` after the fault), starting
    no earlier than the first correct reply; None if less than AFTER_MIN_S of it is left."""
    start = max(end_s - width, first_correct_s if first_correct_s is not None else -math.inf)
    return (start, end_s) if end_s - start >= AFTER_MIN_S else None


def throughput(
    r: DrillReport,
    samples: list[Sample],
    before_s: float,
    end_s: float,
    before_until_s: float = 0.0,
) -> None:
    """The load figures and the throughput rule. `samples` on the fault's clock, `before_s`
    seconds of load before the fault (ending `before_until_s`: 0, or earlier when the load
    was paused before the fault, --cp-phase), the load stopped `end_s` after it; needs
    `r.detection_s`. Sets first_correct_reply_s, load_before, load_after and, when the
    throughput after recovery is under DEGRADED_FRACTION of before, `degraded`."""
    first, earliest, early = first_reply(samples, r.detection_s)
    r.first_correct_reply_s = first
    r.details["first_reply_after_fault_s"] = earliest
    if early:
        r.details["replies_before_detection"] = early
        r.notes.append(
            f"{early} operation(s) issued after the fault returned before its detection was"
            f" seen (the earliest {_s(earliest)} after it); the first correct reply counts"
            " from the detection"
        )
    ok = [s.ret for s in samples if s.ok and s.ret is not None]
    b0, b1 = before_until_s - before_s, before_until_s
    r.load_before = sum(1 for t in ok if b0 <= t < b1) / before_s if before_s > 0 else None
    r.details["before_window_s"] = [round(b0, 3), round(b1, 3)]
    win = after_window(end_s, first)
    r.details["after_window_s"] = None if win is None else [round(win[0], 3), round(win[1], 3)]
    if win is None:
        r.load_after = None
        r.notes.append(
            f"throughput after recovery not measured: less than {AFTER_MIN_S:.0f} s between"
            f" the first correct reply and the end of the watch ({end_s:.1f} s)"
        )
        return
    r.load_after = sum(1 for t in ok if win[0] <= t < win[1]) / (win[1] - win[0])
    if r.load_before and r.load_after < DEGRADED_FRACTION * r.load_before:
        r.degraded.append(
            f"throughput after recovery {r.load_after:.0f} ops/s ({win[0]:.1f}..{win[1]:.1f} s"
            f" after the fault) is {r.load_after / r.load_before:.0%} of the"
            f" {r.load_before:.0f} ops/s before it (below {DEGRADED_FRACTION:.0%})"
        )


def timeline_figure(report: DrillReport) -> Any:
    """The timeline as a matplotlib Figure (Agg backend: no display needed): two panels over
    the same time axis, throughput (ops/s) and mean latency (ms) per bucket, the marks as
    vertical lines, the throughput before the fault and after recovery as dotted levels,
    and the legend to the right of the panels, off the data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [b.start for b in report.timeline]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 5), dpi=100)
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
    # A legend, not labels at the lines: detection, wake-up and first reply are often a few
    # ms apart and their labels would overlap.
    for name, t in report.marks().items():
        label = f"{name.replace('_', ' ')} ({_s(t)})" if t else name
        top.axvline(t, color=MARKS[name], linestyle="--", linewidth=1, label=label)
        bottom.axvline(t, color=MARKS[name], linestyle="--", linewidth=1)
    win = report.details.get("after_window_s")
    bwin = report.details.get("before_window_s")
    if report.load_before is not None and isinstance(bwin, list) and len(bwin) == 2:
        top.hlines(report.load_before, bwin[0], bwin[1], color="tab:grey", linestyle=":",
                   linewidth=1.5,
                   label=f"before the fault ({report.load_before:.0f} ops/s)")  # fmt: skip
    if report.load_after is not None and isinstance(win, list) and len(win) == 2:
        top.hlines(report.load_after, win[0], win[1], color="tab:cyan", linestyle=":",
                   linewidth=1.5,
                   label=f"after recovery ({report.load_after:.0f} ops/s)")  # fmt: skip
    rep = report.details.get("replace_s")
    if isinstance(rep, int | float) and rep > 0:
        # The replica was down while a faulty runtime replaced it: not the fault itself.
        for ax in (top, bottom):
            ax.axvspan(-rep, 0, color="grey", alpha=0.15, linewidth=0)
        top.plot([], [], color="grey", alpha=0.3, linewidth=6, label="replacing the runtime")
    # Outside the axes, right of the top panel: it never covers a bucket or a mark.
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=7)
    top.set_title(f"zz drill {report.kind}: {report.rack}/{report.service} — {report.result}")
    fig.tight_layout()
    return fig


def plot_timeline(report: DrillReport, path: Path) -> Path:
    """timeline.png of `report` (timeline_figure), written atomically."""
    fig = timeline_figure(report)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    try:
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
    """A report.json back as a DrillReport. A version 1 report (no `schema_version`; its
    convicted / woken / shut-down / restored entries "host: controld line", no times) is
    read with each line parsed into its entry at t_s 0 (unknown), and a note saying so.
    ValueError for a newer schema or an entry that does not parse."""
    d = json.loads(Path(path).read_text())
    if not isinstance(d, dict):
        raise ValueError("not a drill report (a JSON object)")
    version = d.get("schema_version", 1)
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise ValueError(f"report schema version {version!r}: this zz reads 1..{SCHEMA_VERSION}")
    d["timeline"] = [Bucket(**b) for b in d.get("timeline", [])]
    for key, cls in ENTRY_FIELDS.items():
        items = d.get(key, [])
        if version == 1:
            got = cls.from_lines([(0.0, str(x)) for x in items])
            if len(got) != len(items):
                raise ValueError(f"{key}: a version 1 line that does not parse")
            d[key] = got
        else:
            d[key] = [cls(**x) for x in items]
    if version == 1:
        d["schema_version"] = SCHEMA_VERSION
        d.setdefault("notes", []).append(
            "read from a version 1 report: the entries' times (t_s) are unknown, 0"
        )
    return DrillReport(**d)


def _s(v: float | None, what: str = "") -> str:
    if v is None:
        return f"— {what}".rstrip()
    return f"{v * 1000:.0f} ms" if abs(v) < 10 else f"{v:.1f} s"


def _list(xs: list[str]) -> str:
    return ", ".join(xs) if xs else "none"


def _shut_downs(xs: list[ShutDown]) -> list[str]:
    """One line per certificate, with the hosts that acted on it."""
    hosts: dict[tuple[Any, ...], list[str]] = {}
    for x in xs:
        key = (x.service, x.seq, tuple(x.convict), tuple(x.sleep), tuple(x.active))
        hosts.setdefault(key, []).append(x.host)
    return [
        f"{svc} seq {seq}: convict {list(c)} sleep {list(sl)} active {list(a)}"
        f" (at {', '.join(sorted(hs))})"
        for (svc, seq, c, sl, a), hs in hosts.items()
    ]


def format_text(report: DrillReport) -> str:
    """The short report a drill prints."""
    r = report
    lines = [f"==== drill {r.kind}: service {r.service} of rack {r.rack} ===="]
    if "replace_s" in r.details:
        lines.append(
            f"(the faulty runtime replaced the replica in {r.details['replace_s']:.1f} s;"
            " times below count from when it answered)"
        )
    convicted = [
        f"{c.who} on {c.host} at {_s(c.t_s)} (state kept as {', '.join(c.state_kept) or '—'})"
        for c in r.convicted
    ]
    woken = [
        f"{w.who} on {w.host} at {_s(w.t_s)} (from {w.from_state} in {w.resume_ms:g} ms)"
        for w in r.woken
    ]
    restored = []
    for x in r.spares_restored:
        took = x.detail.get("seconds")
        how = f", provisioned in {took:.1f} s" if isinstance(took, int | float) else ""
        restored.append(f"{x.who} {x.mode} on {x.host} at {_s(x.t_s)}{how}")
    lines += [
        f"detection time            {_s(r.detection_s)}",
        f"wake-up time              {_s(r.wakeup_s)}",
        f"first correct reply       {_s(r.first_correct_reply_s)}",
        *(
            [f"phases                    {', '.join(f'{k} {_s(v)}' for k, v in r.phases.items())}"]
            if r.phases
            else []
        ),
        f"convicted                 {_list(convicted)}",
        f"shut down                 {_list(_shut_downs(r.shut_down))}",
        f"woken                     {_list(woken)}",
        f"spares restored           {_list(restored)}",
        f"operations                {r.operations} ({r.pending} never returned)",
    ]
    if r.load_before is not None:
        after = f"{r.load_after:.0f}" if r.load_after is not None else "—"
        lines.append(f"throughput before/after   {r.load_before:.0f} / {after} ops/s")
    lines.append(f"linearizability           {r.linearizability}")
    lines += [f"note: {n}" for n in r.notes]
    lines += [f"FAIL: {why}" for why in r.reasons]
    lines += [f"DEGRADED: {why}" for why in r.degraded]
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
